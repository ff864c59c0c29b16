//! `sluice-bench <name> [args...]`: Sluice's benchmarks. Run through
//! `cargo xtask bench <name> [args...]`, which builds first and runs this as root.
//!
//! Benchmarks:
//! - `xdp`: per-packet cost of `sluice_xdp` through BPF_PROG_TEST_RUN against the
//!   `sluice_pass` baseline (see `xdp.rs`; `sluice-bench xdp --help`).
//! - `maglev`: table build time for 10 to 1000 backends and the cost of publishing a change.
//! - `failover`: time from a backend's death to the data plane steering around it.
//! - `health`: the health checker's CPU, time to mark a mass failure and time to stop at
//!   100 to 4,095 backends (`health.rs`).
//! - `tokens`: a load generator of OpenAI-style token streams (see `tokens.rs`;
//!   `sluice-bench tokens --help`); needs no root.
//! - `reads`: `sluice backend list`, a `/metrics` scrape and a policy step with a full
//!   connection table, and the daemon's CPU use at one scrape per second.
//! - `steer`: adaptive steering against plain Maglev on simulated accelerators (`steer/`).
//! - `history`: ring-slot owner changes when the steer runs' weights are published, and the
//!   share of streams each second-chance history depth would lose (`history.rs`).
//!
//! Each writes its results under `target/bench/`, or under `bench/results/` (the committed
//! results) with `--record` (`out.rs`).

mod failover;
mod health;
mod history;
mod maglev;
mod out;
mod reads;
mod steer;
mod summary;
mod sys;
pub mod tokens;
mod xdp;

use std::process::ExitCode;

/// A benchmark's arguments parsed by clap as `name args...`; None when they asked for
/// `--help` (printed here).
pub fn cli_args<T: clap::Parser>(name: &str, args: &[String]) -> anyhow::Result<Option<T>> {
    cli_args_in(T::command(), name, args)
}

/// As [`cli_args`], with `cmd`: `T`'s command with help added at run time.
pub fn cli_args_in<T: clap::FromArgMatches>(
    cmd: clap::Command,
    name: &str,
    args: &[String],
) -> anyhow::Result<Option<T>> {
    let argv = std::iter::once(name.to_string()).chain(args.iter().cloned());
    match cmd
        .try_get_matches_from(argv)
        .and_then(|m| T::from_arg_matches(&m))
    {
        Ok(c) => Ok(Some(c)),
        Err(e) if !e.use_stderr() => {
            // --help, --version
            print!("{e}");
            Ok(None)
        }
        Err(e) if e.kind() == clap::error::ErrorKind::UnknownArgument => {
            let arg = e
                .get(clap::error::ContextKind::InvalidArg)
                .map(|v| v.to_string())
                .unwrap_or_default();
            anyhow::bail!("unknown option {arg} (see {name} --help)")
        }
        // The caller adds its own `error: `.
        Err(e) => anyhow::bail!("{}", e.to_string().trim_start_matches("error: ").trim_end()),
    }
}

fn main() -> ExitCode {
    let mut args = std::env::args().skip(1);
    let Some(name) = args.next() else {
        eprintln!(
            "usage: sluice-bench <name> [args...] [--record]\nbenchmarks: xdp, maglev, failover, health, reads, tokens, steer, steer-pool, history\n--record  {}",
            out::RECORD_HELP
        );
        return ExitCode::from(2);
    };
    let args: Vec<String> = args.collect();
    let result = match name.as_str() {
        "xdp" => xdp::main(&args),
        "maglev" => maglev::main(&args),
        "failover" => failover::main(&args),
        "health" => health::main(&args),
        "reads" => reads::main(&args),
        "tokens" => tokens::main(&args),
        "steer" => steer::main(&args),
        "steer-pool" => steer::pool::main(&args),
        "history" => history::main(&args),
        _ => {
            eprintln!(
                "unknown benchmark: {name} (known: xdp, maglev, failover, health, reads, tokens, steer, steer-pool, history)"
            );
            return ExitCode::from(2);
        }
    };
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("error: {e:#}");
            ExitCode::FAILURE
        }
    }
}
