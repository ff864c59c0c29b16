//! Where a benchmark writes its results. A run writes under `target/bench/`, so running a
//! benchmark leaves the work tree as it was; `--record` writes under `bench/results/`, the
//! committed results the docs quote, so replacing one is a deliberate act.

use std::path::{Path, PathBuf};

use anyhow::{Context, Result};
use serde_json::Value;

/// The committed results (paths are relative to the workspace root, where
/// `cargo xtask bench` runs the benchmarks).
pub const RECORDED: &str = "bench/results";
/// Where a run that is not recorded writes (ignored by git with the rest of `target/`).
pub const SCRATCH: &str = "target/bench";

/// Help text of `--record` (a `record: bool` clap flag), the same in every benchmark.
pub const RECORD_HELP: &str =
    "Write the results under bench/results/ (the committed results) instead of target/bench/";

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

/// Writes `doc` as [`write_json`] does, except that each element of its array `key` is one
/// compact line: a file of many large records (a matrix's cells) stays a few MB and a diff
/// still shows which record changed.
pub fn write_json_records(path: &Path, doc: &Value, key: &str) -> Result<()> {
    let Some(fields) = doc.as_object() else {
        return write_json(path, doc);
    };
    let mut text = String::from("{\n");
    for (i, (k, v)) in fields.iter().enumerate() {
        let value = match v.as_array().filter(|_| k == key) {
            Some(records) => {
                let lines: Vec<String> = records
                    .iter()
                    .map(|r| Ok(format!("    {}", serde_json::to_string(r)?)))
                    .collect::<Result<_>>()?;
                format!("[\n{}\n  ]", lines.join(",\n"))
            }
            None => serde_json::to_string_pretty(v)?.replace('\n', "\n  "),
        };
        let sep = if i + 1 < fields.len() { "," } else { "" };
        text += &format!("  {}: {value}{sep}\n", serde_json::to_string(k)?);
    }
    text += "}\n";
    if let Some(dir) = path.parent() {
        std::fs::create_dir_all(dir).with_context(|| format!("creating {}", dir.display()))?;
    }
    std::fs::write(path, text).with_context(|| format!("writing {}", path.display()))?;
    println!("wrote {}", path.display());
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn records_are_one_line_each_and_the_document_reads_back_the_same() {
        let doc = serde_json::json!({
            "cells": [{"a": 1, "b": [1, 2]}, {"a": 2, "b": []}],
            "report": {"worst": {"x": 1.5}},
            "seeds": [7, 11],
        });
        let path = std::env::temp_dir().join(format!("records-{}.json", std::process::id()));
        write_json_records(&path, &doc, "cells").unwrap();
        let text = std::fs::read_to_string(&path).unwrap();
        std::fs::remove_file(&path).unwrap();
        assert_eq!(serde_json::from_str::<Value>(&text).unwrap(), doc);
        assert!(text.contains("\n    {\"a\":1,\"b\":[1,2]},\n"), "{text}");
        assert!(text.contains("\n    {\"a\":2,\"b\":[]}\n  ]"), "{text}");
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

    /// A benchmark's arguments with the shared flag, as each CLI declares it.
    #[derive(clap::Parser, Debug)]
    struct Args {
        #[arg(long)]
        rounds: Option<usize>,
        #[arg(long)]
        quick: bool,
        #[arg(long)]
        out: Option<String>,
        #[arg(long, help = RECORD_HELP)]
        record: bool,
    }

    fn parse(args: &[&str]) -> Args {
        crate::cli_args::<Args>("t", &args.iter().map(|s| s.to_string()).collect::<Vec<_>>())
            .unwrap()
            .unwrap()
    }

    #[test]
    fn record_is_taken_wherever_it_stands_and_the_rest_keeps_its_meaning() {
        let a = parse(&["--rounds", "3", "--record", "--quick"]);
        assert!(a.record);
        assert_eq!(a.rounds, Some(3));
        assert!(a.quick);
        let a = parse(&["--record"]);
        assert!(a.record);
        assert_eq!(a.rounds, None);
        let a = parse(&["--rounds", "5"]);
        assert!(!a.record);
        assert_eq!(a.rounds, Some(5));
    }

    #[test]
    fn a_value_that_merely_contains_record_is_not_the_flag() {
        let a = parse(&["--out", "my--record.json"]);
        assert!(!a.record);
        assert_eq!(a.out.as_deref(), Some("my--record.json"));
    }
}
