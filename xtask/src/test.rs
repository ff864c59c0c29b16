//! `cargo xtask test`: setup, build, then every test in the workspace.

use anyhow::{bail, Result};

use crate::{
    build::{self, Profile},
    cmd::{self, step},
    setup,
};

pub fn run() -> Result<()> {
    if !cmd::is_root() {
        bail!(
            "`cargo xtask test` must run as root: the packet (BPF_PROG_TEST_RUN) and \
             network-namespace tests in sluice-tests load BPF programs, create namespaces and \
             attach XDP. Run it as root (e.g. `sudo -E cargo xtask test`)."
        );
    }
    setup::run()?;
    // Debug: the test profile reuses the dev profile's dependencies.
    build::run(Profile::Debug)?;

    let root = cmd::workspace_root();
    let mut failed = Vec::new();

    step("unit tests (workspace, except sluice-tests)");
    let unit = cmd::run(cmd::cargo().current_dir(&root).args([
        "test",
        "--workspace",
        "--exclude",
        "sluice-tests",
    ]));
    if let Err(e) = unit {
        println!("FAILED: {e:#}");
        failed.push("unit tests");
    }

    // One at a time: these tests share bpffs, interfaces and namespaces.
    step("packet and namespace tests (sluice-tests, single-threaded)");
    let packet = cmd::run(cmd::cargo().current_dir(&root).args([
        "test",
        "-p",
        "sluice-tests",
        "--",
        "--test-threads=1",
    ]));
    if let Err(e) = packet {
        println!("FAILED: {e:#}");
        failed.push("packet and namespace tests");
    }

    if !failed.is_empty() {
        bail!("failed: {}", failed.join(", "));
    }
    println!("\nall tests passed");
    Ok(())
}
