//! `cargo xtask bench <name> [args...]`: builds (release; with `xdp --stages`, also the
//! stage-ablation objects), then runs `sluice-bench` as root.

use std::process::Command;

use anyhow::{bail, Result};

use crate::{
    build::{self, Profile},
    cmd::{self, step},
};

pub fn run(name: &str, args: &[String]) -> Result<()> {
    build::run(Profile::Release)?;
    // The per-packet cost breakdown loads one object per stage taken out.
    if name == "xdp" && args.iter().any(|a| a == "--stages") {
        build::build_stage_objects()?;
    }
    step(&format!("benchmark {name}"));
    let bin = cmd::target_dir().join("release/sluice-bench");
    if !bin.is_file() {
        bail!("the build did not produce {}", bin.display());
    }
    // Benchmarks load BPF programs and create namespaces: root.
    let mut command = if cmd::is_root() {
        Command::new(&bin)
    } else if cmd::find_on_path("sudo").is_some() {
        println!("not root: running the benchmark through sudo");
        let mut sudo = Command::new("sudo");
        sudo.arg(&bin);
        sudo
    } else {
        bail!("benchmarks need root (BPF programs, namespaces): run this as root");
    };
    cmd::run(
        command
            .current_dir(cmd::workspace_root())
            .arg(name)
            .args(args),
    )
}
