//! `sluice-bench steer --matrix`: the robustness matrix. The steer benchmark's cells
//! (scenario x policy) on fleets that differ where real ones do (engine batch limit and
//! per-sequence cost, KV size, client sources, answer lengths, load), each with several
//! seeds; a policy is judged by its worst cell, not by a pooled figure.
//!
//! Each cell's p99 TTFT is compared with Maglev's in the same fleet, seed and scenario; the
//! report gives, per scenario, the worst ratio for `adaptive` and `adaptive+inband`, and the
//! worst `adaptive+inband` / `adaptive`, next to the aims (`RATIO_AIMS`), with broken
//! streams and weight churn. The result file is rewritten after every cell, so an
//! interrupted run keeps what it measured.

mod fleets;
mod verdict;

use std::{path::PathBuf, time::Duration};

use anyhow::{bail, Context, Result};
use serde_json::{json, Value};

use self::{
    fleets::{Fleet, CELL_OVERHEAD_S, FLEETS},
    verdict::{report, table},
};
use super::{
    cell::run_cell,
    scenario::{list, Policy, Scenario},
    Args, Tools,
};
use crate::{out, sys};

/// The flag that turns `sluice-bench steer` into the matrix.
pub const FLAG: &str = "--matrix";

/// `sluice-bench steer --matrix --help` (the fleets are listed after it at run time).
#[derive(clap::Parser, Debug)]
#[command(
    name = "sluice-bench steer",
    about = "The robustness matrix: runs every (fleet, scenario, policy, seed) cell and \
             reports, per scenario, the worst cell's p99 TTFT / Maglev's (same fleet and seed) \
             against the aims; the matrix sets the rest of the options per fleet"
)]
struct MatrixCli {
    /// The matrix; with ci, a small one that runs in a few minutes: fleets
    /// few-clients-short and many-clients-short-busy, scenarios healthy and throttled,
    /// policies maglev and adaptive, seed 7, 15 s (the other flags override).
    #[arg(long, value_name = "ci", num_args = 0..=1, value_parser = ["ci"])]
    matrix: Option<Option<String>>,
    /// Fleets by name, comma separated, every scenario on each (all: every fleet); default:
    /// each scenario on two fleets, a batch-16 and a batch-64 one, in turn (about two hours).
    #[arg(long)]
    fleets: Option<String>,
    /// Workload seeds, comma separated (default 7,11).
    #[arg(long, value_delimiter = ',')]
    seeds: Option<Vec<u64>>,
    /// Scenarios, comma separated (default: healthy, heterogeneous, throttled, congested,
    /// gray, lying, flapping, dying, near-saturation, idle).
    #[arg(long)]
    scenarios: Option<String>,
    /// Policies, comma separated: maglev, adaptive, adaptive+inband (default: all three).
    #[arg(long)]
    policies: Option<String>,
    /// Seconds of load per cell (default 25).
    #[arg(long)]
    duration: Option<u64>,
    /// JSON results (default target/bench/steer-matrix.json).
    #[arg(long)]
    out: Option<PathBuf>,
    #[arg(long, help = out::RECORD_HELP)]
    record: bool,
    /// Runs nothing: judges the cells of this matrix result file again with this build's
    /// aims and report, rewrites the file's report and prints the table.
    #[arg(long, value_name = "FILE")]
    judge: Option<PathBuf>,
}

/// The matrix's scenarios when `--scenarios` is not given.
pub const MATRIX_SCENARIOS: [Scenario; 10] = [
    Scenario::Healthy,
    Scenario::Heterogeneous,
    Scenario::Throttled,
    Scenario::Congested,
    Scenario::Gray,
    Scenario::Lying,
    Scenario::Flapping,
    Scenario::Dying,
    Scenario::NearSaturation,
    Scenario::Idle,
];

/// The matrix's policies when `--policies` is not given.
pub const MATRIX_POLICIES: [Policy; 3] = [Policy::Maglev, Policy::Adaptive, Policy::Inband];

/// One cell of the matrix.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Cell {
    pub fleet: Fleet,
    pub scenario: Scenario,
    pub policy: Policy,
    pub seed: u64,
}

/// The cells to run, Maglev first within each (fleet, seed, scenario) so that its baseline
/// is there when the others are compared. `pair`: each scenario on two fleets in turn
/// (scenario `k` on fleet `k mod F` and `(k + F/2) mod F`); otherwise every scenario on
/// every fleet.
pub fn plan(
    fleets: &[Fleet],
    scenarios: &[Scenario],
    policies: &[Policy],
    seeds: &[u64],
    pair: bool,
) -> Vec<Cell> {
    let mut policies = policies.to_vec();
    policies.sort_by_key(|p| *p != Policy::Maglev);
    let n = fleets.len();
    let mut out = Vec::new();
    for (k, &scenario) in scenarios.iter().enumerate() {
        let on: Vec<Fleet> = if pair && n >= 2 {
            vec![fleets[k % n], fleets[(k + n / 2) % n]]
        } else {
            fleets.to_vec()
        };
        for fleet in on {
            for &seed in seeds {
                for &policy in &policies {
                    out.push(Cell {
                        fleet,
                        scenario,
                        policy,
                        seed,
                    });
                }
            }
        }
    }
    out
}

/// About how long the cells take, seconds: each its load, its last stream and the lab's
/// start and teardown.
pub fn estimate_s(cells: &[Cell], duration: Duration) -> f64 {
    cells
        .iter()
        .map(|c| c.scenario.duration(duration).as_secs_f64() + c.fleet.drain_s() + CELL_OVERHEAD_S)
        .sum()
}

/// The matrix's options.
#[derive(Clone, Debug)]
pub struct MatrixArgs {
    pub fleets: Vec<Fleet>,
    /// Each scenario on two fleets in turn ([`plan`]): no `--fleets` given.
    pub pair: bool,
    pub seeds: Vec<u64>,
    pub scenarios: Vec<Scenario>,
    pub policies: Vec<Policy>,
    pub duration: Duration,
    pub out: PathBuf,
    /// A result file to judge again instead of running cells.
    pub judge: Option<PathBuf>,
}

/// The fleets, listed after the matrix's help.
fn fleet_table() -> String {
    let mut u = "Fleets:".to_owned();
    for f in FLEETS {
        u += &format!(
            "\n  {:<24} batch {:>2}, {} ms/seq, KV {:>5}, {:>4} sources, {} answers, load {}",
            f.name,
            f.max_num_seqs,
            f.step_per_seq_ms,
            f.kv_capacity_tokens,
            f.sources,
            f.answers.name(),
            f.load
        );
    }
    u
}

impl MatrixArgs {
    /// The matrix's options from the command line; None when it asked for `--help`.
    pub fn parse(args: &[String]) -> Result<Option<MatrixArgs>> {
        let cmd = <MatrixCli as clap::CommandFactory>::command().after_help(fleet_table());
        match crate::cli_args_in::<MatrixCli>(cmd, "sluice-bench steer", args)? {
            Some(c) => MatrixArgs::from_cli(c).map(Some),
            None => Ok(None),
        }
    }

    fn from_cli(c: MatrixCli) -> Result<MatrixArgs> {
        let ci = matches!(c.matrix, Some(Some(_)));
        let mut a = MatrixArgs {
            fleets: FLEETS.to_vec(),
            pair: true,
            seeds: vec![7, 11],
            scenarios: MATRIX_SCENARIOS.to_vec(),
            policies: MATRIX_POLICIES.to_vec(),
            duration: Duration::from_secs(25),
            out: c
                .out
                .unwrap_or_else(|| out::default_path(c.record, "steer-matrix.json")),
            judge: c.judge,
        };
        if ci {
            a.fleets = vec![FLEETS[1], FLEETS[3]];
            a.pair = false;
            a.seeds = vec![7];
            a.scenarios = vec![Scenario::Healthy, Scenario::Throttled];
            a.policies = vec![Policy::Maglev, Policy::Adaptive];
            a.duration = Duration::from_secs(15);
        }
        if let Some(v) = &c.fleets {
            a.fleets = if v == "all" {
                FLEETS.to_vec()
            } else {
                list(v, Fleet::parse)?
            };
            a.pair = false;
        }
        if let Some(seeds) = c.seeds {
            a.seeds = seeds;
        }
        if let Some(v) = &c.scenarios {
            a.scenarios = list(v, Scenario::parse)?;
        }
        if let Some(v) = &c.policies {
            a.policies = list(v, Policy::parse)?;
        }
        if let Some(secs) = c.duration {
            a.duration = Duration::from_secs(secs);
        }
        if let Some(p) = a.policies.iter().find(|p| !MATRIX_POLICIES.contains(p)) {
            bail!(
                "--policies: the matrix runs maglev, adaptive and adaptive+inband, not {}",
                p.name()
            );
        }
        if !a.policies.contains(&Policy::Maglev) {
            bail!("--policies must include maglev: every ratio is to Maglev's p99 TTFT");
        }
        if a.duration < Duration::from_secs(9) || a.duration > Duration::from_secs(3600) {
            bail!("--duration {:?}: 9 s to 1 h", a.duration);
        }
        if a.fleets.is_empty() || a.seeds.is_empty() || a.scenarios.is_empty() {
            bail!("nothing to run: --fleets, --seeds and --scenarios must each name one");
        }
        Ok(a)
    }
}

/// The steer benchmark's options for one cell.
fn cell_args(c: &Cell, duration: Duration) -> Result<Args> {
    let mut a = Args::defaults()?;
    a.seed = c.seed;
    a.duration = duration;
    a.capacity_rps = c.fleet.capacity_rps();
    a.load = c.fleet.load;
    a.sources = c.fleet.sources;
    a.accel_args = c.fleet.accel_args();
    a.tokens_args = c.fleet.tokens_args();
    Ok(a)
}

fn hms(s: f64) -> String {
    let s = s.round() as u64;
    format!("{}h{:02}m{:02}s", s / 3600, s / 60 % 60, s % 60)
}

pub fn main(args: &[String]) -> Result<()> {
    let Some(m) = MatrixArgs::parse(args)? else {
        return Ok(());
    };
    if let Some(path) = &m.judge {
        return judge(path);
    }
    let cells = plan(&m.fleets, &m.scenarios, &m.policies, &m.seeds, m.pair);
    let fleets: Vec<&str> = {
        let mut v: Vec<&str> = cells.iter().map(|c| c.fleet.name).collect();
        v.sort();
        v.dedup();
        v
    };
    println!(
        "matrix: {} cells ({} fleets, {} scenarios, {} policies, {} seeds, {} s each); \
         estimated {}",
        cells.len(),
        fleets.len(),
        m.scenarios.len(),
        m.policies.len(),
        m.seeds.len(),
        m.duration.as_secs(),
        hms(estimate_s(&cells, m.duration))
    );
    for f in m.fleets.iter().filter(|f| fleets.contains(&f.name)) {
        println!(
            "  {:<24} {:.2} requests/s per accelerator nominal, {:.0} answer tokens/s offered",
            f.name,
            f.capacity_rps(),
            f.offered_tokens_per_s()
        );
    }
    sys::require_root()?;
    sys::catch_interrupts();
    let tools = Tools::find()?;
    let started = std::time::Instant::now();
    let mut results: Vec<Value> = Vec::new();
    let mut interrupted = false;
    for (i, c) in cells.iter().enumerate() {
        if sys::interrupted().is_err() {
            interrupted = true;
            break;
        }
        println!(
            "== [{}/{}] {} / {} / {} / seed {} ({} so far)",
            i + 1,
            cells.len(),
            c.fleet.name,
            c.scenario.name(),
            c.policy.name(),
            c.seed,
            hms(started.elapsed().as_secs_f64())
        );
        let result = cell_args(c, m.duration)
            .and_then(|a| run_cell(&a, &tools, c.scenario, c.policy))
            .with_context(|| {
                format!(
                    "cell {} / {} / {} / seed {}",
                    c.fleet.name,
                    c.scenario.name(),
                    c.policy.name(),
                    c.seed
                )
            });
        let mut cell = match result {
            Ok(out) => {
                super::print_cell(&out.json);
                out.json
            }
            Err(e) => {
                println!("   failed: {e:#}");
                json!({"scenario": c.scenario.name(), "policy": c.policy.name(),
                       "error": format!("{e:#}")})
            }
        };
        cell["seed"] = json!(c.seed);
        cell["fleet"] = c.fleet.json();
        results.push(cell);
        let doc = document(&m, &results, started.elapsed().as_secs(), false);
        out::write_json_records(&m.out, &doc, "cells")?;
    }
    if sys::interrupted().is_err() {
        interrupted = true;
    }
    let doc = document(&m, &results, started.elapsed().as_secs(), interrupted);
    out::write_json_records(&m.out, &doc, "cells")?;
    print!("{}", table(&doc["report"]));
    if interrupted {
        bail!(
            "interrupted after {} of {} cells; the result file has those",
            results.len(),
            cells.len()
        );
    }
    Ok(())
}

/// Judges a result file's cells again and rewrites its report.
fn judge(path: &std::path::Path) -> Result<()> {
    let text =
        std::fs::read_to_string(path).with_context(|| format!("reading {}", path.display()))?;
    let mut doc: Value = serde_json::from_str(&text)
        .with_context(|| format!("{} is not a JSON result file", path.display()))?;
    let Some(cells) = doc.get("cells").and_then(Value::as_array) else {
        bail!("{} has no cells: not a matrix result file", path.display());
    };
    doc["report"] = report(cells);
    out::write_json_records(path, &doc, "cells")?;
    print!("{}", table(&doc["report"]));
    Ok(())
}

fn document(m: &MatrixArgs, cells: &[Value], wall_s: u64, interrupted: bool) -> Value {
    super::result_doc(
        "steer-matrix",
        json!({
        "duration_s": m.duration.as_secs(),
        "seeds": m.seeds,
        "fleets": m.fleets.iter().map(Fleet::json).collect::<Vec<_>>(),
        "wall_s": wall_s,
        "interrupted": interrupted,
        "report": report(cells),
        "cells": cells,
        }),
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    fn s(v: &[&str]) -> Vec<String> {
        v.iter().map(|x| x.to_string()).collect()
    }

    #[test]
    fn the_default_plan_pairs_fleets_and_fits_about_two_hours() {
        let m = MatrixArgs::parse(&s(&["--matrix"])).unwrap().unwrap();
        let cells = plan(&m.fleets, &m.scenarios, &m.policies, &m.seeds, m.pair);
        // 10 scenarios x 2 fleets x 2 seeds x 3 policies.
        assert_eq!(cells.len(), 120);
        let on = |scenario: Scenario| {
            let mut v: Vec<&str> = cells
                .iter()
                .filter(|c| c.scenario == scenario)
                .map(|c| c.fleet.name)
                .collect();
            v.dedup();
            v
        };
        assert_eq!(on(Scenario::Healthy), ["lab", "wide-small-kv-heavy"]);
        assert_eq!(
            on(Scenario::Idle),
            ["few-clients-short", "wide-many-clients"]
        );
        // Every fleet runs; Maglev comes first in each group.
        for f in FLEETS {
            assert!(cells.iter().any(|c| c.fleet == f), "{}", f.name);
        }
        assert!(cells.chunks(3).all(|g| g[0].policy == Policy::Maglev));
        let hours = estimate_s(&cells, m.duration) / 3600.0;
        assert!((1.5..=2.2).contains(&hours), "{hours:.2} h");

        let ci = MatrixArgs::parse(&s(&["--matrix", "ci"])).unwrap().unwrap();
        let cells = plan(&ci.fleets, &ci.scenarios, &ci.policies, &ci.seeds, ci.pair);
        assert_eq!(cells.len(), 8);
        assert!(estimate_s(&cells, ci.duration) < 6.0 * 60.0);
        // Explicit fleets: every scenario on each.
        let m = MatrixArgs::parse(&s(&[
            "--matrix",
            "--fleets",
            "lab,wide-costly-light",
            "--seeds",
            "3",
            "--scenarios",
            "healthy,lying,flapping",
        ]))
        .unwrap()
        .unwrap();
        let cells = plan(&m.fleets, &m.scenarios, &m.policies, &m.seeds, m.pair);
        assert_eq!(cells.len(), 2 * 3 * 3);
    }

    #[test]
    fn bad_matrix_options_are_refused() {
        assert!(
            MatrixArgs::parse(&s(&["--matrix", "--policies", "adaptive"]))
                .unwrap_err()
                .to_string()
                .contains("must include maglev")
        );
        assert!(
            MatrixArgs::parse(&s(&["--matrix", "--policies", "maglev,adaptive+admission"]))
                .is_err()
        );
        assert!(MatrixArgs::parse(&s(&["--matrix", "--sources", "5"]))
            .unwrap_err()
            .to_string()
            .contains("unknown option --sources"));
        assert!(MatrixArgs::parse(&s(&["--matrix", "--seeds", "x"])).is_err());
        assert!(MatrixArgs::parse(&s(&["--matrix", "--fleets", "nope"])).is_err());
        let m = MatrixArgs::parse(&s(&["--matrix", "ci", "--duration", "20", "--record"]))
            .unwrap()
            .unwrap();
        assert_eq!(m.duration, Duration::from_secs(20));
        assert_eq!(m.out, PathBuf::from("bench/results/steer-matrix.json"));
    }
}
