//! `sluice-bench failover`: how fast a dead backend leaves the data plane. In the namespace lab
//! with the real daemon (health interval 200 ms, fall 2, timeout 150 ms), a backend's server
//! is killed; the daemon reports, in its `down` event, the time from the check that decided it
//! to the data-plane write, and the bench times the kill to that event (detection included).

use std::{
    net::SocketAddr,
    path::PathBuf,
    time::{Duration, Instant},
};

use anyhow::{anyhow, bail, Context, Result};
use serde_json::json;
use sluice::clock::now_ms;
use sluice_tests::{
    daemon_lab::{wait_for, DaemonLab, DaemonLabOptions, VipDef},
    netns::{TCP_PORT, VIP4},
};

use crate::{out, summary::Summary, sys};

const VIP: &str = "chat";
const MARK: &str = "data plane updated ";

/// `sluice-bench failover --help`.
#[derive(clap::Parser, Debug)]
#[command(
    name = "sluice-bench failover",
    about = "Time from a backend's death to the data plane steering around it (daemon lab)"
)]
struct Args {
    /// Rounds, each killing one backend of a fresh lab.
    #[arg(long, default_value_t = 5)]
    rounds: usize,
    #[arg(long, help = out::RECORD_HELP)]
    record: bool,
}

pub fn main(args: &[String]) -> Result<()> {
    let Some(Args { rounds, record }) = crate::cli_args::<Args>("sluice-bench failover", args)?
    else {
        return Ok(());
    };
    sys::require_root()?;
    sys::catch_interrupts();
    let exe = std::env::current_exe()?;
    let server: PathBuf = exe.with_file_name("sluice-testsrv");
    if !server.is_file() {
        bail!(
            "{} is missing: build the workspace in release mode",
            server.display()
        );
    }
    let mut to_event_ms = vec![];
    let mut apply_us = vec![];
    for round in 0..rounds {
        sys::interrupted()?;
        let vip = VipDef::tcp(VIP, SocketAddr::new(VIP4.into(), TCP_PORT), 3);
        let mut lab = DaemonLab::start(DaemonLabOptions::new(&server, 3, vec![vip]))
            .context("starting the daemon lab")?;
        wait_for("every backend healthy", Duration::from_secs(10), || {
            let ok = lab.backends(VIP).iter().all(|b| b["healthy"] == true);
            Ok(ok.then_some(()))
        })?;
        sys::interrupted()?;
        let dead = lab.topo.backends[1].v4.to_string();
        let killed = now_ms();
        let t = Instant::now();
        let server = lab.servers[1];
        lab.topo.signal(server, libc::SIGKILL)?;
        let ev = wait_for("the down event", Duration::from_secs(10), || {
            Ok(lab
                .events()
                .into_iter()
                .find(|e| e["kind"] == "down" && e["backend"] == dead.as_str()))
        })?;
        sys::interrupted()?;
        let seen = t.elapsed();
        let reason = ev["reason"].as_str().unwrap_or_default();
        let us: f64 = reason
            .split(MARK)
            .nth(1)
            .and_then(|r| r.split_whitespace().next())
            .and_then(|n| n.parse().ok())
            .ok_or_else(|| {
                anyhow!("the down event does not say when the data plane changed: {reason}")
            })?;
        let ms = ev["time_ms"].as_u64().unwrap_or(0).saturating_sub(killed) as f64;
        println!(
            "round {}: kill -> down event {ms:.0} ms (seen by polling after {:.0} ms); deciding check -> data plane {us:.0} us",
            round + 1,
            seen.as_secs_f64() * 1e3
        );
        to_event_ms.push(ms);
        apply_us.push(us);
        drop(lab);
    }
    let (e, a) = (Summary::of(&to_event_ms), Summary::of(&apply_us));
    println!(
        "kill -> down: median {:.0} ms [{:.0} {:.0}]; deciding check -> data plane: median {:.0} us [{:.0} {:.0}]",
        e.median, e.min, e.p90, a.median, a.min, a.p90
    );
    let (git_revision, git_dirty) = sys::git_state();
    let doc = json!({
        "benchmark": "failover",
        "command_line": std::env::args().collect::<Vec<_>>().join(" "),
        "git_revision": git_revision,
        "git_dirty": git_dirty,
        "date_utc": sys::utc_now(),
        "kernel": sys::kernel_release(),
        "cpu_model": sys::cpu_model(),
        "health": {"interval_ms": 200, "timeout_ms": 150, "fall": 2, "kind": "tcp connect"},
        "rounds": rounds,
        "kill_to_down_event_ms": {"median": e.median, "min": e.min, "p90": e.p90, "samples": to_event_ms},
        "deciding_check_to_dataplane_us": {"median": a.median, "min": a.min, "p90": a.p90, "samples": apply_us},
        "note": "kill -> down includes detection: up to one interval until the next check, then fall checks; the data plane is written before the event is recorded",
    });
    out::write_json(&out::default_path(record, "failover.json"), &doc)
}
