//! `sluice-bench <name> [args...]`: Sluice's benchmarks. Run through
//! `cargo xtask bench <name> [args...]`, which builds first and runs this as root.
//!
//! Benchmarks:
//! - `xdp`: per-packet cost of `sluice_xdp` through BPF_PROG_TEST_RUN against the
//!   `sluice_pass` baseline (see `xdp.rs`; `sluice-bench xdp --help`).
//! - `maglev`: table build time for 10 to 1000 backends and the cost of publishing a change.
//! - `failover`: time from a backend's death to the data plane steering around it.
//! - `tokens`: a load generator of OpenAI-style token streams (see `tokens/mod.rs`;
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

fn main() -> ExitCode {
    let mut args = std::env::args().skip(1);
    let Some(name) = args.next() else {
        eprintln!(
            "usage: sluice-bench <name> [args...] [--record]\nbenchmarks: xdp, maglev, failover, reads, tokens, steer, steer-pool, history\n{}",
            out::RECORD_HELP
        );
        return ExitCode::from(2);
    };
    let args: Vec<String> = args.collect();
    let result = match name.as_str() {
        "xdp" => xdp::main(&args),
        "maglev" => maglev::main(&args),
        "failover" => failover::main(&args),
        "reads" => reads::main(&args),
        "tokens" => tokens::main(&args),
        "steer" => steer::main(&args),
        "steer-pool" => steer::pool::main(&args),
        "history" => history::main(&args),
        _ => {
            eprintln!(
                "unknown benchmark: {name} (known: xdp, maglev, failover, reads, tokens, steer, steer-pool, history)"
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
