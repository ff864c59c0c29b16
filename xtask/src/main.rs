//! Sluice's developer tasks, run as `cargo xtask <command>` (alias in .cargo/config.toml).
//! Each command prints what it does and every command line it runs.

mod bench;
mod build;
mod cmd;
mod demo;
mod exports;
mod fuzz;
mod lint;
mod modgraph;
mod package;
mod setup;
mod test;
#[cfg(test)]
use sluice_core::test_dir;
mod verify;

use std::process::ExitCode;

use clap::{Parser, Subcommand};

#[derive(Parser)]
#[command(
    name = "cargo xtask",
    bin_name = "cargo xtask",
    about = "Sluice developer tasks"
)]
struct Cli {
    #[command(subcommand)]
    command: Cmd,
}

#[derive(Subcommand)]
enum Cmd {
    /// Install or check bpf-linker (against rustc's LLVM), bpffs and the Debian packages
    /// the tests use. Idempotent.
    Setup,
    /// Build the eBPF object (target/bpf/sluice.bpf.o), then the workspace (release), then
    /// the upgrade test's second sluice (target/upgrade/debug/sluice).
    Build {
        /// Build the workspace in the dev profile instead of release.
        #[arg(long)]
        debug: bool,
    },
    /// setup, build, then all tests (the packet and namespace tests need root).
    Test,
    /// rustfmt --check and clippy -D warnings, for the workspace and the eBPF crate; rustdoc
    /// without a warning; no import cycle between a crate's modules.
    Lint,
    /// Build (release), then the Debian package target/package/sluice_VERSION_ARCH.deb
    /// (cargo-deb): the binary, systemd units, default configurations, man pages, completions.
    Package,
    /// Build (release), then run `sluice-bench <name> [args...]` as root. Results go under
    /// target/bench/; `--record` writes them under bench/results/ (the committed results).
    Bench {
        /// The benchmark to run.
        name: String,
        /// Passed to the benchmark.
        #[arg(trailing_var_arg = true, allow_hyphen_values = true)]
        args: Vec<String>,
    },
    /// Build, then fuzz `sluice_xdp` through BPF_PROG_TEST_RUN: every frame checked by an
    /// oracle (the test suite runs 100,000; this runs as many as asked). Needs root.
    Fuzz {
        /// Frames to run.
        #[arg(long, default_value_t = 1_000_000)]
        frames: u64,
        /// Replay a run (decimal or 0x-hex); a fresh seed otherwise (printed).
        #[arg(long)]
        seed: Option<String>,
        /// Write the result to bench/results/fuzz.json (the committed result); without it
        /// nothing is written.
        #[arg(long)]
        record: bool,
    },
    /// setup, build, then the namespace-lab demo: a client streaming tokens through the LB
    /// to three accelerator backends, with a live view (about 20 s).
    Demo {
        /// `fleet`: three LB hosts behind a BGP/ECMP router, one dies under live streams.
        #[arg(value_parser = ["fleet"])]
        scenario: Option<String>,
        /// How long the streams run.
        #[arg(long)]
        seconds: Option<u64>,
    },
}

fn main() -> ExitCode {
    let result = match Cli::parse().command {
        Cmd::Setup => setup::run(),
        Cmd::Build { debug } => build::run(if debug {
            build::Profile::Debug
        } else {
            build::Profile::Release
        })
        .and_then(|()| build::build_upgrade_binary()),
        Cmd::Test => test::run(),
        Cmd::Lint => lint::run(),
        Cmd::Package => package::run().map(drop),
        Cmd::Bench { name, args } => bench::run(&name, &args),
        Cmd::Demo { scenario, seconds } => demo::run(scenario.is_some(), seconds),
        Cmd::Fuzz {
            frames,
            seed,
            record,
        } => fuzz::run(frames, seed.as_deref(), record),
    };
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            // `{:#}`: the error and its causes on one line, without a backtrace.
            eprintln!("\nerror: {e:#}");
            ExitCode::FAILURE
        }
    }
}
