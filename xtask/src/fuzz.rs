//! `cargo xtask fuzz --frames N [--seed S] [--record]`: a long run of the data-plane fuzzer
//! (sluice-tests' `fuzz` tests: N fuzzed frames through `sluice_xdp`, N/4 tunnel frames through
//! `sluice_decap`, with BPF_PROG_TEST_RUN, each checked by an oracle). `--record` writes the
//! `sluice_xdp` result to `bench/results/fuzz.json`.

use anyhow::{bail, Result};

use crate::{
    build::{self, Profile},
    cmd::{self, step},
};

pub fn run(frames: u64, seed: Option<&str>, record: bool) -> Result<()> {
    if !cmd::is_root() {
        bail!(
            "`cargo xtask fuzz` loads BPF programs and creates a network namespace: run it as \
             root (e.g. `sudo -E cargo xtask fuzz --frames {frames}`)"
        );
    }
    // Debug: the test profile reuses the dev profile's dependencies.
    build::run(Profile::Debug)?;
    step(&format!("fuzz sluice_xdp with {frames} frames"));
    let root = cmd::workspace_root();
    let mut command_line = format!("cargo xtask fuzz --frames {frames}");
    let mut cargo = cmd::cargo();
    cargo
        .current_dir(&root)
        .args(["test", "-p", "sluice-tests", "--test", "fuzz", "--"])
        .args(["--nocapture", "--test-threads=1"])
        .env("SLUICE_FUZZ_FRAMES", frames.to_string());
    if let Some(seed) = seed {
        cargo.env("SLUICE_FUZZ_SEED", seed);
        command_line.push_str(&format!(" --seed {seed}"));
    }
    if record {
        command_line.push_str(" --record");
        cargo.env(
            "SLUICE_FUZZ_RECORD",
            root.join("bench/results/fuzz.json").as_os_str(),
        );
    }
    cargo.env("SLUICE_FUZZ_COMMAND", &command_line);
    cmd::run(&mut cargo)
}
