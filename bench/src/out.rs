//! Where a benchmark writes its results. A run writes under `target/bench/`, so running a
//! benchmark leaves the work tree as it was; `--record` writes under `bench/results/`, the
//! committed results the docs quote, so replacing one is a deliberate act.

use std::path::{Path, PathBuf};

use anyhow::{Context, Result};
use serde_json::Value;

/// The flag every benchmark takes to write its results under [`RECORDED`].
pub const RECORD: &str = "--record";
/// The committed results (paths are relative to the workspace root, where
/// `cargo xtask bench` runs the benchmarks).
pub const RECORDED: &str = "bench/results";
/// Where a run that is not recorded writes (ignored by git with the rest of `target/`).
pub const SCRATCH: &str = "target/bench";

/// Help text for `--record`, the same in every benchmark's usage.
pub const RECORD_HELP: &str =
    "--record  write the results under bench/results/ (default: under target/bench/)";

/// Takes `--record` out of `args`: whether it was given, and the other arguments in order.
pub fn take_record(args: &[String]) -> (bool, Vec<String>) {
    let rest: Vec<String> = args.iter().filter(|a| *a != RECORD).cloned().collect();
    (rest.len() != args.len(), rest)
}

/// The default path of the result file or directory `name`: under [`RECORDED`] when
/// recording, under [`SCRATCH`] otherwise.
pub fn default_path(record: bool, name: &str) -> PathBuf {
    Path::new(if record { RECORDED } else { SCRATCH }).join(name)
}

/// Writes `doc` as pretty JSON to `path`, creating its directory, and says where.
pub fn write_json(path: &Path, doc: &Value) -> Result<()> {
    if let Some(dir) = path.parent() {
        std::fs::create_dir_all(dir).with_context(|| format!("creating {}", dir.display()))?;
    }
    std::fs::write(path, serde_json::to_string_pretty(doc)? + "\n")
        .with_context(|| format!("writing {}", path.display()))?;
    println!("wrote {}", path.display());
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn strings(v: &[&str]) -> Vec<String> {
        v.iter().map(|s| s.to_string()).collect()
    }

    #[test]
    fn a_run_writes_under_target_and_a_recorded_run_under_bench_results() {
        assert_eq!(
            default_path(false, "xdp.json"),
            PathBuf::from("target/bench/xdp.json")
        );
        assert_eq!(
            default_path(true, "xdp.json"),
            PathBuf::from("bench/results/xdp.json")
        );
        assert!(default_path(false, "steer").starts_with("target/"));
    }

    #[test]
    fn record_is_taken_out_wherever_it_stands_and_the_rest_keeps_its_order() {
        let (record, rest) = take_record(&strings(&["--rounds", "3", "--record", "--quick"]));
        assert!(record);
        assert_eq!(rest, strings(&["--rounds", "3", "--quick"]));
        let (record, rest) = take_record(&strings(&["--record"]));
        assert!(record);
        assert!(rest.is_empty());
        let (record, rest) = take_record(&strings(&["--runs", "5"]));
        assert!(!record);
        assert_eq!(rest, strings(&["--runs", "5"]));
    }

    #[test]
    fn a_value_that_merely_contains_record_is_not_the_flag() {
        let (record, rest) = take_record(&strings(&["--out", "my--record.json"]));
        assert!(!record);
        assert_eq!(rest, strings(&["--out", "my--record.json"]));
    }
}
