//! `cargo xtask lint`: rustfmt and clippy (warnings are errors) for the workspace and for the
//! eBPF crate, which is outside the workspace and needs its own runs; rustdoc without a
//! warning (a doc link that names nothing, or a private item from a public page); no import
//! cycle between the modules of a crate.

use anyhow::{bail, Result};

use crate::{
    build::{self, EBPF_HOST_TARGET, EBPF_RUSTFLAGS},
    cmd::{self, step},
    modgraph,
};

/// The source directories whose modules must not import each other in a cycle.
const CRATES: &[&str] = &[
    "lb-core/src",
    "lb-userspace/src",
    "lb-common/src",
    "lb-ebpf/src",
    "bench/src",
    "accel-sim/src",
    "quic-lb/src",
    "tests/src",
    "xtask/src",
];

pub fn run() -> Result<()> {
    let root = cmd::workspace_root();
    let ebpf = root.join("lb-ebpf");
    let mut failed = Vec::new();
    let mut check = |what: &str, result: Result<()>| {
        if let Err(e) = result {
            println!("FAILED: {e:#}");
            failed.push(what.to_string());
        }
    };

    // lb-userspace's build script embeds the BPF object, so clippy needs it built.
    check("eBPF build", build::build_ebpf().map(drop));

    step("rustfmt (workspace)");
    check(
        "rustfmt (workspace)",
        cmd::run(
            cmd::cargo()
                .current_dir(&root)
                .args(["fmt", "--all", "--check"]),
        ),
    );
    step("clippy (workspace)");
    check(
        "clippy (workspace)",
        cmd::run(cmd::cargo().current_dir(&root).args([
            "clippy",
            "--workspace",
            "--all-targets",
            "--",
            "-D",
            "warnings",
        ])),
    );
    step("rustdoc (workspace)");
    check(
        "rustdoc (workspace)",
        cmd::run(
            cmd::cargo()
                .current_dir(&root)
                .env("RUSTDOCFLAGS", "-D warnings")
                .args(["doc", "--workspace", "--no-deps"]),
        ),
    );
    step("rustfmt (lb-ebpf)");
    check(
        "rustfmt (lb-ebpf)",
        cmd::run(
            // Not `--all`: that also checks the whole workspace of the path dependency
            // lb-common (the workspace run above covers it).
            cmd::clean_cargo()
                .current_dir(&ebpf)
                .args(["fmt", "--check"]),
        ),
    );
    // Same target and flags as the build. Library target only: a test harness would link std
    // next to the crate's #[panic_handler].
    step("clippy (lb-ebpf)");
    check(
        "clippy (lb-ebpf)",
        cmd::run(
            cmd::clean_cargo()
                .current_dir(&ebpf)
                .env("RUSTFLAGS", EBPF_RUSTFLAGS.join(" "))
                .args(["clippy", "--release", "--target", EBPF_HOST_TARGET])
                .args(["--", "-D", "warnings"]),
        ),
    );

    step("module graph");
    check("module graph", modgraph::check(&root, CRATES));

    if !failed.is_empty() {
        bail!("lint failed: {}", failed.join(", "));
    }
    println!("\nlint passed");
    Ok(())
}
