//! `sluice-bench steer-pool`: the TTFT aims judged over several seeded runs at once. A 60 s
//! cell has about 420 requests, so its p99 time to first token is the fifth-slowest request,
//! and one slow request more or less moves a cell's ratio to Maglev by a factor of 2 or more
//! between runs of the same policy. Pooling the per-request records of
//! the same cells under several seeds puts each p99 on a few thousand requests; each run's
//! own ratio is kept beside the pooled one, so the spread shows too.

use std::{
    collections::BTreeMap,
    fs,
    path::{Path, PathBuf},
};

use anyhow::{anyhow, bail, Context, Result};
use serde_json::{json, Map, Value};

use super::{
    results::{aims, cells_by_key},
    stats,
};
use crate::{out, sys};

/// `sluice-bench steer-pool --help`.
#[derive(clap::Parser, Debug)]
#[command(
    name = "sluice-bench steer-pool",
    about = "Pools seeded `sluice-bench steer` runs: per cell the TTFT quantiles over every \
             run's requests, per steered policy the p99 ratio to Maglev by seed and pooled"
)]
struct Args {
    /// Each RESULT.json a `sluice-bench steer` result and RECORDS_DIR the directory its
    /// --records option wrote; at least two runs, of different seeds, with the same cells
    /// and the same settings (duration, backends, capacity, load, sessions cap, sources,
    /// accelerator and load-generator arguments, and each cell's load-generator settings but
    /// the seed: its stall and request limits among them).
    #[arg(value_name = "RESULT.json:RECORDS_DIR", value_parser = parse_source)]
    runs: Vec<(PathBuf, PathBuf)>,
    /// JSON results (default target/bench/steer-pooled.json).
    #[arg(long)]
    out: Option<PathBuf>,
    #[arg(long, help = out::RECORD_HELP)]
    record: bool,
}

/// One run argument, `RESULT.json:RECORDS_DIR`.
fn parse_source(a: &str) -> Result<(PathBuf, PathBuf), String> {
    match a.split_once(':') {
        Some((json, dir)) => Ok((PathBuf::from(json), PathBuf::from(dir))),
        None => Err(format!("{a}: expected RESULT.json:RECORDS_DIR")),
    }
}

/// What `pool` adds to its refusals: how to give the runs.
const RUNS_HINT: &str = "give RESULT.json:RECORDS_DIR of each run (sluice-bench steer-pool --help)";

/// The settings that make two runs' cells the same experiment but for the seed.
const SETTINGS: [&str; 8] = [
    "duration_s",
    "backends",
    "capacity_rps_per_backend",
    "load",
    "max_sessions",
    "client_sources",
    "accel_args",
    "tokens_args",
];

/// One seeded run: its seed, its result document, each cell's TTFTs (ms) from its records
/// and each cell's load-generator settings but the seed (the stall and request limits among
/// them, which decide what counts as broken).
pub struct Run {
    pub seed: u64,
    pub result: Value,
    pub ttfts: BTreeMap<(String, String), Vec<f64>>,
    pub generators: BTreeMap<(String, String), Map<String, Value>>,
}

pub fn main(args: &[String]) -> Result<()> {
    let Some(a) = crate::cli_args::<Args>("sluice-bench steer-pool", args)? else {
        return Ok(());
    };
    let out_path = a
        .out
        .unwrap_or_else(|| out::default_path(a.record, "steer-pooled.json"));
    let sources = a.runs;
    let runs = sources
        .iter()
        .map(|(json, dir)| read_run(json, dir))
        .collect::<Result<Vec<_>>>()?;
    let mut doc = pool(&runs)?;
    let (git_head, _) = sys::git_state();
    doc["command_line"] = json!(std::env::args().collect::<Vec<_>>().join(" "));
    doc["git_head"] = json!(git_head);
    doc["date_utc"] = json!(sys::utc_now());
    doc["sources"] = sources
        .iter()
        .map(
            |(j, d)| json!({"result": j.display().to_string(), "records": d.display().to_string()}),
        )
        .collect();
    for r in doc["ratios"].as_array().into_iter().flatten() {
        println!(
            "{} / {}: pooled p99 TTFT ratio {:.2} (by seed {})",
            r["scenario"].as_str().unwrap_or(""),
            r["policy"].as_str().unwrap_or(""),
            r["pooled"].as_f64().unwrap_or(f64::NAN),
            r["by_seed"]
        );
    }
    out::write_json(&out_path, &doc)
}

fn read_run(json: &Path, dir: &Path) -> Result<Run> {
    let result: Value = serde_json::from_str(
        &fs::read_to_string(json).with_context(|| format!("reading {}", json.display()))?,
    )
    .with_context(|| format!("parsing {}", json.display()))?;
    let (seed, cells) = seed_and_cells(&result).ok_or_else(|| {
        anyhow!(
            "{}: not a `sluice-bench steer` result (it needs \"benchmark\": \"steer\", a \
             \"seed\" and \"cells\" naming their scenario and policy)",
            json.display()
        )
    })?;
    let mut ttfts = BTreeMap::new();
    let mut generators = BTreeMap::new();
    // `seed_and_cells` read the cells in this order.
    for ((s, p), cell) in cells
        .into_iter()
        .zip(result["cells"].as_array().into_iter().flatten())
    {
        generators.insert((s.clone(), p.clone()), generator_settings(cell));
        let file = dir.join(format!("{s}-{p}.jsonl"));
        let text = fs::read_to_string(&file).with_context(|| {
            format!(
                "reading {} (the records of {}'s cell {s} / {p}: run steer with --records {})",
                file.display(),
                json.display(),
                dir.display()
            )
        })?;
        let records =
            stats::parse_records(&text).with_context(|| format!("parsing {}", file.display()))?;
        ttfts.insert((s, p), stats::ttfts(&records));
    }
    Ok(Run {
        seed,
        result,
        ttfts,
        generators,
    })
}

/// A steer result's seed and its cells' (scenario, policy); `None` unless it is one.
fn seed_and_cells(result: &Value) -> Option<(u64, Vec<(String, String)>)> {
    let cells = result["cells"]
        .as_array()
        .filter(|c| result["benchmark"] == "steer" && !c.is_empty())?;
    let cells = cells
        .iter()
        .map(|c| {
            Some((
                c["scenario"].as_str()?.to_owned(),
                c["policy"].as_str()?.to_owned(),
            ))
        })
        .collect::<Option<_>>()?;
    Some((result["seed"].as_u64()?, cells))
}

/// A cell's load-generator settings but its seed; none for a cell that does not record them.
fn generator_settings(cell: &Value) -> Map<String, Value> {
    let mut settings = cell["generator_summary"]["config"]
        .as_object()
        .cloned()
        .unwrap_or_default();
    settings.remove("seed");
    settings
}

/// The pooled document: per cell the TTFT quantiles over every run's requests, per steered
/// policy and scenario the p99 ratio to Maglev by seed and pooled, and the aims that the
/// pooled cells can judge (the TTFT ones). Refuses runs that are not the same experiment.
pub fn pool(runs: &[Run]) -> Result<Value> {
    let [first, rest @ ..] = runs else {
        bail!("no runs given: {RUNS_HINT}");
    };
    if rest.is_empty() {
        bail!("one run has nothing to pool with: give two or more seeds; {RUNS_HINT}");
    }
    let mut seeds: Vec<u64> = runs.iter().map(|r| r.seed).collect();
    seeds.sort_unstable();
    if let Some(w) = seeds.windows(2).find(|w| w[0] == w[1]) {
        bail!(
            "seed {} is given twice: a repeat of one seed replays its workload, so pool \
             different seeds",
            w[0]
        );
    }
    for r in rest {
        for key in SETTINGS {
            if r.result[key] != first.result[key] {
                bail!(
                    "seed {} ran with {key} = {}, seed {} with {}: pool runs of the same \
                     settings",
                    r.seed,
                    r.result[key],
                    first.seed,
                    first.result[key]
                );
            }
        }
        if r.ttfts.keys().ne(first.ttfts.keys()) {
            bail!(
                "seeds {} and {} ran different cells: pool runs of the same scenarios and \
                 policies",
                first.seed,
                r.seed
            );
        }
        for ((scenario, policy), a) in &r.generators {
            let b = &first.generators[&(scenario.clone(), policy.clone())];
            let value = |m: &Map<String, Value>, k: &str| m.get(k).cloned().unwrap_or_default();
            if let Some(key) = a
                .keys()
                .chain(b.keys())
                .filter(|k| a.get(*k) != b.get(*k))
                .min()
            {
                bail!(
                    "seed {}'s cell {scenario} / {policy} ran its load generator with {key} = \
                     {}, seed {}'s with {}: pool runs of the same settings",
                    r.seed,
                    value(a, key),
                    first.seed,
                    value(b, key)
                );
            }
        }
    }
    let p99 = |v: &[f64]| stats::percentile(v, 99.0);
    let pooled: BTreeMap<&(String, String), Vec<f64>> = first
        .ttfts
        .keys()
        .map(|k| {
            (
                k,
                runs.iter()
                    .flat_map(|r| r.ttfts[k].iter().copied())
                    .collect(),
            )
        })
        .collect();
    let cells: Vec<Value> = pooled
        .iter()
        .map(|(key, all)| {
            json!({
                "scenario": key.0,
                "policy": key.1,
                "ttft_ms": stats::quantiles(all),
                "ttft_p99_ms_by_seed": runs
                    .iter()
                    .map(|r| (r.seed.to_string(), json!(p99(&r.ttfts[key]))))
                    .collect::<serde_json::Map<_, _>>(),
            })
        })
        .collect();
    let mut ratios = Vec::new();
    for (scenario, policy) in first.ttfts.keys().filter(|(_, p)| p != "maglev") {
        let maglev = (scenario.clone(), "maglev".to_owned());
        if !first.ttfts.contains_key(&maglev) {
            continue;
        }
        let key = (scenario.clone(), policy.clone());
        let ratio = |a: &[f64], m: &[f64]| p99(a) / p99(m).max(1e-9);
        ratios.push(json!({
            "scenario": scenario,
            "policy": policy,
            "by_seed": runs
                .iter()
                .map(|r| (r.seed.to_string(), json!(ratio(&r.ttfts[&key], &r.ttfts[&maglev]))))
                .collect::<serde_json::Map<_, _>>(),
            "pooled": ratio(&pooled[&key], &pooled[&maglev]),
        }));
    }
    Ok(json!({
        "benchmark": "steer-pool",
        "seeds": seeds,
        "settings": SETTINGS
            .iter()
            .map(|k| (k.to_string(), first.result[*k].clone()))
            .collect::<serde_json::Map<_, _>>(),
        "runs": runs
            .iter()
            .map(|r| json!({
                "seed": r.seed,
                "git_head": r.result["git_head"],
                "date_utc": r.result["date_utc"],
                "command_line": r.result["command_line"],
            }))
            .collect::<Vec<_>>(),
        "aims": aims(&cells_by_key(&cells.iter().collect::<Vec<_>>())),
        "ratios": ratios,
        "cells": cells,
    }))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn run(seed: u64, cells: &[(&str, &str, Vec<f64>)]) -> Run {
        Run {
            seed,
            result: json!({"duration_s": 60, "backends": 4, "git_head": "abc"}),
            ttfts: cells
                .iter()
                .map(|(s, p, v)| ((s.to_string(), p.to_string()), v.clone()))
                .collect(),
            generators: cells
                .iter()
                .map(|(s, p, _)| ((s.to_string(), p.to_string()), Map::new()))
                .collect(),
        }
    }

    /// 100 first tokens: 1..=100 ms times `scale`.
    fn ms(scale: f64) -> Vec<f64> {
        (1..=100).map(|i| f64::from(i) * scale).collect()
    }

    #[test]
    fn pooled_p99_ranks_over_every_seeds_requests_and_judges_the_ttft_aims() {
        // Seed 7's adaptive cell has two slow first tokens of 100: its p99 alone.
        let mut slow = ms(1.0);
        slow[98] = 1000.0;
        slow[99] = 1000.0;
        let runs = [
            run(
                7,
                &[
                    ("healthy", "maglev", ms(1.0)),
                    ("healthy", "adaptive", slow),
                ],
            ),
            run(
                11,
                &[
                    ("healthy", "maglev", ms(1.0)),
                    ("healthy", "adaptive", ms(0.5)),
                ],
            ),
        ];
        let doc = pool(&runs).unwrap();
        // By seed: 1000 / 99 and 49.5 / 99. Pooled, the p99 is the 198th of 200: 98 ms
        // (under the two slow ones) against Maglev's 99.
        let r = &doc["ratios"][0];
        assert_eq!(r["policy"], "adaptive");
        assert!((r["by_seed"]["7"].as_f64().unwrap() - 1000.0 / 99.0).abs() < 1e-9);
        assert!((r["by_seed"]["11"].as_f64().unwrap() - 49.5 / 99.0).abs() < 1e-9);
        assert!(
            (r["pooled"].as_f64().unwrap() - 98.0 / 99.0).abs() < 1e-9,
            "{r}"
        );
        let cell = &doc["cells"][0];
        assert_eq!(
            (cell["policy"].as_str(), cell["ttft_ms"]["n"].as_u64()),
            (Some("adaptive"), Some(200))
        );
        let aims = doc["aims"].as_array().unwrap();
        assert_eq!(aims.len(), 1, "only the TTFT aim can be judged: {aims:?}");
        assert_eq!(aims[0]["aim"], "healthy: adaptive p99 TTFT <= 1.05x maglev");
        assert_eq!(aims[0]["held"], true);
    }

    #[test]
    fn only_a_steer_result_with_a_seed_and_named_cells_is_read() {
        let cell = json!({"scenario": "healthy", "policy": "maglev"});
        let ok = json!({"benchmark": "steer", "seed": 7, "cells": [cell]});
        assert_eq!(
            seed_and_cells(&ok),
            Some((7, vec![("healthy".into(), "maglev".into())]))
        );
        let without = |key: &str| {
            let mut v = ok.clone();
            v.as_object_mut().unwrap().remove(key);
            v
        };
        for bad in [
            without("benchmark"),
            without("seed"),
            without("cells"),
            json!({"benchmark": "steer-pool", "seed": 7, "cells": [cell]}),
            json!({"benchmark": "steer", "seed": 7, "cells": []}),
            json!({"benchmark": "steer", "seed": 7, "cells": [{"scenario": "healthy"}]}),
        ] {
            assert_eq!(seed_and_cells(&bad), None, "{bad}");
        }
    }

    #[test]
    fn runs_that_are_not_the_same_experiment_are_refused() {
        let cell = || {
            vec![
                ("healthy", "maglev", ms(1.0)),
                ("healthy", "adaptive", ms(1.0)),
            ]
        };
        let err = |runs: &[Run]| pool(runs).unwrap_err().to_string();
        assert!(err(&[run(7, &cell())]).contains("give two or more seeds"));
        assert!(err(&[run(7, &cell()), run(7, &cell())]).contains("seed 7 is given twice"));
        let mut long = run(11, &cell());
        long.result["duration_s"] = json!(180);
        assert!(err(&[run(7, &cell()), long]).contains("duration_s = 180"));
        let other = run(11, &[("throttled", "maglev", ms(1.0))]);
        assert!(err(&[run(7, &cell()), other]).contains("ran different cells"));
        // A run with other request limits counts broken streams by another rule.
        let with_generator = |seed, config: Value| {
            let mut r = run(seed, &cell());
            let cell = json!({"generator_summary": {"config": config}});
            r.generators.insert(
                ("healthy".into(), "maglev".into()),
                generator_settings(&cell),
            );
            r
        };
        let now = json!({"seed": 7, "stall_s": 60.0, "timeout_s": 180.0});
        let before = json!({"seed": 11, "timeout_s": 60.0});
        assert!(
            err(&[with_generator(7, now.clone()), with_generator(11, before)])
                .contains("cell healthy / maglev ran its load generator with stall_s = null")
        );
        let mut same = now.clone();
        same["seed"] = json!(11);
        pool(&[with_generator(7, now), with_generator(11, same)]).unwrap();
    }
}
