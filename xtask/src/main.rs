//! Sluice's developer tasks, run as `cargo xtask <command>` (alias in .cargo/config.toml).
//! Each command prints what it does and every command line it runs.

mod cmd;
mod setup;
#[cfg(test)]
mod test_util;

use std::process::ExitCode;

use clap::{Parser, Subcommand};

#[derive(Parser)]
#[command(name = "cargo xtask", about = "Sluice developer tasks")]
struct Cli {
    #[command(subcommand)]
    command: Cmd,
}

#[derive(Subcommand)]
enum Cmd {
    /// Install or check bpf-linker (against rustc's LLVM), bpffs and the Debian packages
    /// the tests use. Idempotent.
    Setup,
}

fn main() -> ExitCode {
    let result = match Cli::parse().command {
        Cmd::Setup => setup::run(),
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
