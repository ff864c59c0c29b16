//! `cargo xtask demo`: setup, build (release), then the daemon-lab demo: a client namespace
//! opens OpenAI-style token streams (IPv4 and IPv6) through the real `sluice run` daemon
//! (native XDP in an LB namespace) to three simulated accelerators (`sluice-accel`); mid-run
//! gpu0 is drained through the CLI and gpu1 is throttled through its control listener; a live
//! view shows the streams, each backend's time to first token and tokens/s, the daemon's view
//! of each backend and its events, and a summary ends it (streams completed and broken, p99
//! time to first token, where new sessions went after each event); the lab is removed at the
//! end, also on Ctrl-C.
//!
//! The demo itself is `sluice-demo` from the sluice-tests crate (tests/src/bin/sluice-demo.rs,
//! built on `sluice_tests::daemon_lab`). It runs about 20 s; `SLUICE_DEMO_SECONDS=N` changes
//! that (or run `target/release/sluice-demo --seconds N` directly).
//!
//! `cargo xtask demo fleet` runs `sluice-fleet-demo` instead (tests/src/bin/
//! sluice-fleet-demo.rs, on `sluice_tests::fleet_lab`): three LB hosts behind a BIRD router
//! with BGP, BFD and ECMP; one dies under live token streams and none breaks.
use std::{os::unix::process::CommandExt, process::Command};

use anyhow::{bail, Result};

use crate::{
    build::{self, Profile},
    cmd::{self, step},
    setup,
};

/// Overrides the demo's duration in seconds.
const SECONDS_ENV: &str = "SLUICE_DEMO_SECONDS";

pub fn run(fleet: bool, seconds: Option<u64>) -> Result<()> {
    if !cmd::is_root() {
        bail!(
            "`cargo xtask demo` must run as root: the demo creates network namespaces, loads \
             BPF programs and attaches XDP (e.g. `sudo -E cargo xtask demo`)"
        );
    }
    let seconds = match (seconds, std::env::var(SECONDS_ENV)) {
        (Some(n), _) => Some(n.to_string()),
        (None, Ok(s)) => Some(s),
        (None, Err(_)) => None,
    };
    let seconds = match seconds {
        Some(s) => match s.parse::<u64>() {
            Ok(n) if (1..=3600).contains(&n) => Some(n),
            _ => bail!(
                "--seconds / {SECONDS_ENV} = {s:?}: expected a number of seconds from 1 to 3600"
            ),
        },
        None => None,
    };
    setup::run()?;
    build::run(Profile::Release)?;

    step("demo");
    let name = if fleet {
        "sluice-fleet-demo"
    } else {
        "sluice-demo"
    };
    let demo = cmd::target_dir().join("release").join(name);
    if !cmd::is_executable(&demo) {
        bail!(
            "{} was not built (it comes from the sluice-tests crate)",
            demo.display()
        );
    }
    let mut c = Command::new(&demo);
    if let Some(n) = seconds {
        c.args(["--seconds", &n.to_string()]);
    }
    println!("{}", cmd::display(&c));
    // Replace this process: Ctrl-C then reaches the demo alone, which stops its streams and
    // removes the lab before exiting (a parent xtask would die at once and leave it running
    // on the terminal).
    let e = c.exec();
    bail!("could not run {}: {e}", demo.display())
}
