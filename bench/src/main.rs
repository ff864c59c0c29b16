//! `sluice-bench <name> [args...]`: Sluice's benchmarks. Run through
//! `cargo xtask bench <name> [args...]`, which builds first and runs this as root.
//!
//! No benchmark exists yet: every name is reported as unknown.

use std::process::ExitCode;

fn main() -> ExitCode {
    let mut args = std::env::args().skip(1);
    let Some(name) = args.next() else {
        eprintln!("usage: sluice-bench <name> [args...]");
        return ExitCode::from(2);
    };
    let _args: Vec<String> = args.collect();
    // Benchmarks are dispatched on `name` here.
    eprintln!("unknown benchmark: {name}");
    ExitCode::from(2)
}
