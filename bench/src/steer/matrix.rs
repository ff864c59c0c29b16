//! `sluice-bench steer --matrix`: the robustness matrix. The steer benchmark's cells
//! (scenario x policy) on fleets that differ where real ones do (engine batch limit and
//! per-sequence cost, KV size, client sources, answer lengths, load), each with several
//! seeds; a policy is judged by its worst cell, not by a pooled figure.
//!
//! Each cell's p99 TTFT is compared with Maglev's in the same fleet, seed and scenario; the
//! report gives, per scenario, the worst ratio for `adaptive` and `adaptive+inband`, and the
//! worst `adaptive+inband` / `adaptive`, next to the aims ([`RATIO_AIMS`]), with broken
//! streams and weight churn. The result file is rewritten after every cell, so an
//! interrupted run keeps what it measured.

use std::{path::PathBuf, time::Duration};

use anyhow::{bail, Context, Result};
use serde_json::{json, Value};
use sluice_accel::model::Params;

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

/// Answer lengths: log-normal (median, sigma) cut at a largest answer, in tokens.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Answers {
    /// Short answers (median 40, sigma 0.5): classification, extraction, short chat turns.
    Short,
    /// The load generator's chat workload (LMSYS-Chat-1M's mean, median 155, sigma 0.8), cut
    /// at 768 tokens (2% of answers) so that a cell does not wait a minute for its last
    /// stream.
    Chat,
    /// Heavy-tailed (median 155, sigma 1.4, cut at 768: a fifth of answers are longer than 500
    /// tokens): a few answers hold a batch slot for most of a run.
    HeavyTailed,
}

impl Answers {
    pub fn name(self) -> &'static str {
        match self {
            Answers::Short => "short",
            Answers::Chat => "chat",
            Answers::HeavyTailed => "heavy-tailed",
        }
    }

    /// (median, sigma, largest answer) of the load generator's answers.
    pub fn shape(self) -> (f64, f64, u32) {
        match self {
            Answers::Short => (40.0, 0.5, 1024),
            Answers::Chat => (155.0, 0.8, 768),
            Answers::HeavyTailed => (155.0, 1.4, 768),
        }
    }

    /// Mean answer tokens after the cut (sampled once; a test checks it against the
    /// generator's draws).
    pub fn mean_tokens(self) -> f64 {
        match self {
            Answers::Short => 45.3,
            Answers::Chat => 204.0,
            Answers::HeavyTailed => 262.0,
        }
    }

    /// The 99.9th percentile answer, tokens: about the longest stream a cell waits for.
    pub fn p999_tokens(self) -> f64 {
        let (median, sigma, max) = self.shape();
        (median * (3.09 * sigma).exp()).min(f64::from(max))
    }
}

/// A fleet: settings that differ where real fleets do. Passed to every accelerator
/// (`sluice-accel --max-num-seqs --step-per-seq-ms --kv-capacity-tokens`) and to the load
/// generator (`--output-median --output-sigma --max-output`, its sources and its rate).
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Fleet {
    pub name: &'static str,
    /// The engine's batch limit (vLLM's max-num-seqs).
    pub max_num_seqs: u32,
    /// What each sequence adds to a step, ms: with the batch, how far a stream's pace falls
    /// as the batch grows.
    pub step_per_seq_ms: f64,
    pub kv_capacity_tokens: u64,
    /// Client source addresses (the VIP hashes by source).
    pub sources: u16,
    pub answers: Answers,
    /// Offered load, a fraction of the fleet's nominal capacity ([`Fleet::capacity_rps`]);
    /// idle, near-saturation and overload keep their own.
    pub load: f64,
}

/// The fleets, spanning the extremes rather than every combination: batch 16 (the first
/// four) and 64 (the last four) at several per-sequence costs, KV caches from 8192 to 32768
/// tokens, 32 / 180 / 1000 client sources, short to heavy-tailed answers, 40 / 65 / 85% load.
/// Batch-64 fleets pay a higher per-sequence cost: at the lab's pace a batch of 64 would
/// stream more tokens than a 2-core machine's load generator and simulators carry (a test
/// holds every fleet to 2600 answer tokens/s offered). Fleet `i` and `i + 4` differ in batch size, which the default
/// matrix pairs.
pub const FLEETS: [Fleet; 8] = [
    Fleet {
        name: "lab",
        max_num_seqs: 16,
        step_per_seq_ms: 0.1,
        kv_capacity_tokens: 8192,
        sources: 180,
        answers: Answers::Chat,
        load: 0.65,
    },
    Fleet {
        name: "few-clients-short",
        max_num_seqs: 16,
        step_per_seq_ms: 0.1,
        kv_capacity_tokens: 8192,
        sources: 32,
        answers: Answers::Short,
        load: 0.4,
    },
    Fleet {
        name: "few-clients-busy",
        max_num_seqs: 16,
        step_per_seq_ms: 0.1,
        kv_capacity_tokens: 8192,
        sources: 32,
        answers: Answers::Chat,
        load: 0.85,
    },
    Fleet {
        name: "many-clients-short-busy",
        max_num_seqs: 16,
        step_per_seq_ms: 0.4,
        kv_capacity_tokens: 16384,
        sources: 1000,
        answers: Answers::Short,
        load: 0.85,
    },
    Fleet {
        name: "wide-small-kv-heavy",
        max_num_seqs: 64,
        step_per_seq_ms: 0.8,
        kv_capacity_tokens: 8192,
        sources: 180,
        answers: Answers::HeavyTailed,
        load: 0.65,
    },
    Fleet {
        name: "wide-many-clients",
        max_num_seqs: 64,
        step_per_seq_ms: 0.8,
        kv_capacity_tokens: 32768,
        sources: 1000,
        answers: Answers::Chat,
        load: 0.65,
    },
    Fleet {
        name: "wide-costly-light",
        max_num_seqs: 64,
        step_per_seq_ms: 1.5,
        kv_capacity_tokens: 32768,
        sources: 32,
        answers: Answers::HeavyTailed,
        load: 0.4,
    },
    Fleet {
        name: "wide-heavy-busy",
        max_num_seqs: 64,
        step_per_seq_ms: 0.8,
        kv_capacity_tokens: 32768,
        sources: 180,
        answers: Answers::HeavyTailed,
        load: 0.85,
    },
];

/// The lab fleet's measured capacity, requests/s per accelerator (docs/benchmarks.md): the
/// other fleets' capacities scale from it by the model's cost of a request.
const LAB_CAPACITY_RPS: f64 = 3.0;
/// The lab fleet's engine as that capacity was measured (its answers: the generator's
/// chat workload, mean 214 tokens, uncut).
const LAB_ENGINE: (u32, f64, u64, f64) = (16, 0.1, 8192, 214.0);
/// Prompt tokens per request and KV tokens a running sequence holds beyond its answer
/// (the conversation so far): the chat workload's mean, an assumption for every fleet.
const PROMPT_TOKENS: f64 = 150.0;
/// The accelerators of a matrix cell (the steer benchmark's default).
const BACKENDS: f64 = 4.0;
/// A cell's time beyond its load and its longest stream: the lab's start and teardown.
const CELL_OVERHEAD_S: f64 = 12.0;

/// One step of `n` running sequences of `ctx` tokens each, ms ([`sluice_accel::model`]'s
/// step cost, with the fleet's per-sequence cost).
fn step_ms(per_seq_ms: f64, n: f64, ctx: f64) -> f64 {
    let p = Params::default();
    p.step_base_ms + per_seq_ms * n + p.step_per_ktoken_ms * n * ctx / 1000.0
}

/// Seconds of an accelerator's time one request takes when its batch is full (or its KV
/// cache is): its answer's share of the decode steps plus its prefill.
fn request_cost_s(max_num_seqs: u32, per_seq_ms: f64, kv: u64, answer: f64) -> f64 {
    let ctx = PROMPT_TOKENS + answer;
    let n = f64::from(max_num_seqs).min(kv as f64 / ctx);
    let tokens_per_s = n / step_ms(per_seq_ms, n, ctx) * 1000.0;
    answer / tokens_per_s + PROMPT_TOKENS / Params::default().prefill_tokens_per_s
}

impl Fleet {
    /// Nominal capacity, requests/s per accelerator: the lab fleet's measured capacity scaled
    /// by the model's cost of a request in this fleet against the lab's. An estimate; the
    /// load fractions are of it.
    pub fn capacity_rps(&self) -> f64 {
        let (b, s, kv, answer) = LAB_ENGINE;
        let lab = request_cost_s(b, s, kv, answer);
        let this = request_cost_s(
            self.max_num_seqs,
            self.step_per_seq_ms,
            self.kv_capacity_tokens,
            self.answers.mean_tokens(),
        );
        LAB_CAPACITY_RPS * lab / this
    }

    /// Answer tokens per second the fleet is offered at its load.
    pub fn offered_tokens_per_s(&self) -> f64 {
        self.load * BACKENDS * self.capacity_rps() * self.answers.mean_tokens()
    }

    /// About how long a cell waits for its last stream after the load ends: the longest
    /// answer at the step time of the batch the load keeps running.
    pub fn drain_s(&self) -> f64 {
        let ctx = PROMPT_TOKENS + self.answers.mean_tokens();
        let full = f64::from(self.max_num_seqs).min(self.kv_capacity_tokens as f64 / ctx);
        let n = (full * self.load).max(1.0);
        self.answers.p999_tokens() * step_ms(self.step_per_seq_ms, n, ctx) / 1000.0
    }

    pub fn accel_args(&self) -> Vec<String> {
        vec![
            "--max-num-seqs".into(),
            self.max_num_seqs.to_string(),
            "--step-per-seq-ms".into(),
            self.step_per_seq_ms.to_string(),
            "--kv-capacity-tokens".into(),
            self.kv_capacity_tokens.to_string(),
        ]
    }

    pub fn tokens_args(&self) -> Vec<String> {
        let (median, sigma, max) = self.answers.shape();
        vec![
            "--output-median".into(),
            median.to_string(),
            "--output-sigma".into(),
            sigma.to_string(),
            "--max-output".into(),
            max.to_string(),
        ]
    }

    /// The fleet's settings, as each cell of the result names them.
    pub fn json(&self) -> Value {
        let (median, sigma, max) = self.answers.shape();
        json!({
            "name": self.name,
            "max_num_seqs": self.max_num_seqs,
            "step_per_seq_ms": self.step_per_seq_ms,
            "kv_capacity_tokens": self.kv_capacity_tokens,
            "client_sources": self.sources,
            "answers": {"kind": self.answers.name(), "median": median, "sigma": sigma,
                        "max": max},
            "load": self.load,
            "capacity_rps_per_backend": (self.capacity_rps() * 1000.0).round() / 1000.0,
            "accel_args": self.accel_args().join(" "),
            "tokens_args": self.tokens_args().join(" "),
        })
    }

    pub fn parse(s: &str) -> Result<Fleet> {
        match FLEETS.iter().find(|f| f.name == s) {
            Some(f) => Ok(*f),
            None => bail!(
                "unknown fleet {s:?}; known: {}",
                FLEETS.map(|f| f.name).join(", ")
            ),
        }
    }
}

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

/// The aims (the worst cell of the matrix): the most a steered policy's p99 TTFT may be of
/// Maglev's in the same fleet, seed and scenario.
pub const RATIO_AIMS: [(&str, f64); 8] = [
    ("healthy", 1.05),
    ("idle", 1.05),
    ("throttled", 0.2),
    ("congested", 0.2),
    ("heterogeneous", 0.3),
    ("gray", 0.3),
    ("lying", 0.3),
    ("flapping", 0.5),
];
/// The most adaptive+inband's p99 TTFT may be of adaptive's alone, in every scenario.
pub const INBAND_OVER_ADAPTIVE_AIM: f64 = 1.05;
/// The most weight changes per backend per 10 minutes on a healthy fleet.
pub const CHURN_AIM: f64 = 12.0;

/// The steered policies the report judges.
const STEERED: [&str; 2] = ["adaptive", "adaptive+inband"];

fn ratio_aim(scenario: &str) -> Option<f64> {
    RATIO_AIMS
        .iter()
        .find(|(s, _)| *s == scenario)
        .map(|&(_, a)| a)
}

fn p99(c: &Value) -> Option<f64> {
    c.pointer("/ttft_ms/p99").and_then(Value::as_f64)
}

/// A cell's (fleet name, seed, scenario, policy).
fn key(c: &Value) -> (String, u64, String, String) {
    (
        c["fleet"]["name"].as_str().unwrap_or("").to_owned(),
        c["seed"].as_u64().unwrap_or(0),
        c["scenario"].as_str().unwrap_or("").to_owned(),
        c["policy"].as_str().unwrap_or("").to_owned(),
    )
}

/// The largest figure and the cell that gave it, with the aim and whether it held (`held`
/// null without an aim; the whole entry null without a figure).
fn worst(figures: Vec<(f64, &Value)>, aim: Option<f64>) -> Value {
    let Some((w, c)) = figures
        .into_iter()
        .filter(|(f, _)| f.is_finite())
        .max_by(|a, b| a.0.total_cmp(&b.0))
    else {
        return Value::Null;
    };
    json!({
        "worst": (w * 1000.0).round() / 1000.0,
        "fleet": c["fleet"]["name"],
        "seed": c["seed"],
        "scenario": c["scenario"],
        "aim": aim,
        "held": aim.map(|a| w <= a),
    })
}

/// The report over the matrix's cells (cells with an `error` are counted, not judged):
/// per scenario the worst ratio of p99 TTFT to Maglev's (same fleet, seed and scenario) for
/// each steered policy and the worst adaptive+inband / adaptive, each against its aim; per
/// steered policy the worst cell's streams broken off a backend that was not killed (aim 0)
/// and the worst weight churn on the healthy fleet (per backend per 10 minutes, aim
/// [`CHURN_AIM`]).
pub fn report(cells: &[Value]) -> Value {
    let ok: Vec<&Value> = cells.iter().filter(|c| c.get("error").is_none()).collect();
    let find = |fleet: &str, seed: u64, scenario: &str, policy: &str| {
        ok.iter()
            .find(|c| key(c) == (fleet.into(), seed, scenario.into(), policy.into()))
            .copied()
    };
    let mut scenarios: Vec<String> = Vec::new();
    for c in &ok {
        let s = key(c).2;
        if !scenarios.contains(&s) {
            scenarios.push(s);
        }
    }
    let mut rows = Vec::new();
    for s in &scenarios {
        let aim = ratio_aim(s);
        let mut row = json!({"scenario": s});
        for policy in STEERED {
            let ratios = ok
                .iter()
                .filter(|c| key(c).2 == *s && key(c).3 == policy)
                .filter_map(|c| {
                    let (f, seed, ..) = key(c);
                    let m = p99(find(&f, seed, s, "maglev")?)?;
                    Some((p99(c)? / m.max(1e-9), *c))
                })
                .collect();
            row[policy] = worst(ratios, aim);
        }
        let over = ok
            .iter()
            .filter(|c| key(c).2 == *s && key(c).3 == "adaptive+inband")
            .filter_map(|c| {
                let (f, seed, ..) = key(c);
                let a = p99(find(&f, seed, s, "adaptive")?)?;
                Some((p99(c)? / a.max(1e-9), *c))
            })
            .collect();
        row["inband_over_adaptive"] = worst(over, Some(INBAND_OVER_ADAPTIVE_AIM));
        rows.push(row);
    }
    let per_policy = |figure: &dyn Fn(&Value) -> Option<f64>, only: Option<&str>, aim: f64| {
        STEERED
            .iter()
            .map(|&policy| {
                let figures = ok
                    .iter()
                    .filter(|c| key(c).3 == policy && only.is_none_or(|s| key(c).2 == s))
                    .filter_map(|c| Some((figure(c)?, *c)))
                    .collect();
                json!({"policy": policy, "cell": worst(figures, Some(aim))})
            })
            .collect::<Vec<_>>()
    };
    let broken_elsewhere = |c: &Value| {
        let all = c.pointer("/sessions/broken")?.as_f64()?;
        let killed = c
            .pointer("/sessions/broken_on_killed_backend")
            .and_then(Value::as_f64)
            .unwrap_or(0.0);
        Some(all - killed)
    };
    let churn = |c: &Value| {
        c.get("weight_changes_per_backend_per_10min")
            .and_then(Value::as_f64)
    };
    json!({
        "scenarios": rows,
        "broken_not_on_a_killed_backend": per_policy(&broken_elsewhere, None, 0.0),
        "healthy_weight_changes_per_backend_per_10min":
            per_policy(&churn, Some("healthy"), CHURN_AIM),
        "cells": cells.len(),
        "failed_cells": cells.len() - ok.len(),
    })
}

fn held_word(v: &Value) -> &'static str {
    match v["held"].as_bool() {
        Some(true) => "held",
        Some(false) => "MISSED",
        None => "no aim",
    }
}

fn figure(v: &Value) -> String {
    if v.is_null() {
        return "not run".into();
    }
    format!(
        "{:.2} ({} seed {}) {}",
        v["worst"].as_f64().unwrap_or(f64::NAN),
        v["fleet"].as_str().unwrap_or("?"),
        v["seed"],
        held_word(v)
    )
}

/// The report as a table for the terminal.
pub fn table(report: &Value) -> String {
    let mut out = format!(
        "{:<16} {:>5}  {:<42} {:<42} {}\n",
        "scenario",
        "aim",
        "adaptive / maglev, worst cell",
        "adaptive+inband / maglev, worst cell",
        "adaptive+inband / adaptive (aim <= 1.05)"
    );
    for row in report["scenarios"].as_array().into_iter().flatten() {
        let aim = ratio_aim(row["scenario"].as_str().unwrap_or(""))
            .map_or("-".to_owned(), |a| format!("{a}"));
        out += &format!(
            "{:<16} {:>5}  {:<42} {:<42} {}\n",
            row["scenario"].as_str().unwrap_or("?"),
            aim,
            figure(&row["adaptive"]),
            figure(&row["adaptive+inband"]),
            figure(&row["inband_over_adaptive"]),
        );
    }
    for (title, k) in [
        (
            "broken streams not on a killed accelerator (aim 0)",
            "broken_not_on_a_killed_backend",
        ),
        (
            "weight changes per backend per 10 min, healthy (aim <= 12)",
            "healthy_weight_changes_per_backend_per_10min",
        ),
    ] {
        out += &format!("{title}:\n");
        for p in report[k].as_array().into_iter().flatten() {
            out += &format!(
                "  {:<16} {}\n",
                p["policy"].as_str().unwrap_or("?"),
                figure(&p["cell"])
            );
        }
    }
    if report["failed_cells"].as_u64().unwrap_or(0) > 0 {
        out += &format!(
            "{} of {} cells failed (their errors are in the result file)\n",
            report["failed_cells"], report["cells"]
        );
    }
    out
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
        out::write_json(&m.out, &doc)?;
    }
    if sys::interrupted().is_err() {
        interrupted = true;
    }
    let doc = document(&m, &results, started.elapsed().as_secs(), interrupted);
    out::write_json(&m.out, &doc)?;
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
    use crate::tokens::workload::{Generator, Shape};

    /// Tokens per second the load generator, daemon and four simulators carry on a 2-core
    /// machine (docs/benchmarks.md, lab scale), with some headroom.
    const MACHINE_TOKENS_PER_S: f64 = 2600.0;

    fn s(v: &[&str]) -> Vec<String> {
        v.iter().map(|x| x.to_string()).collect()
    }

    #[test]
    fn fleets_span_the_extremes_and_fit_the_machine() {
        let names: Vec<&str> = FLEETS.iter().map(|f| f.name).collect();
        let mut unique = names.clone();
        unique.sort();
        unique.dedup();
        assert_eq!(unique.len(), FLEETS.len(), "{names:?}");
        let has = |p: &dyn Fn(&Fleet) -> bool| FLEETS.iter().any(p);
        for b in [16, 64] {
            assert!(has(&|f| f.max_num_seqs == b), "batch {b}");
        }
        for n in [32, 180, 1000] {
            assert!(has(&|f| f.sources == n), "{n} sources");
        }
        for l in [0.4, 0.65, 0.85] {
            assert!(has(&|f| f.load == l), "load {l}");
        }
        for a in [Answers::Short, Answers::HeavyTailed] {
            assert!(has(&|f| f.answers == a), "{a:?}");
        }
        // The default matrix pairs fleet i with i + 4: a batch of 16 with one of 64.
        for i in 0..4 {
            assert_eq!(
                (FLEETS[i].max_num_seqs, FLEETS[i + 4].max_num_seqs),
                (16, 64)
            );
        }
        for f in FLEETS {
            let t = f.offered_tokens_per_s();
            assert!(t <= MACHINE_TOKENS_PER_S, "{}: {t:.0} tokens/s", f.name);
            assert_eq!(Fleet::parse(f.name).unwrap(), f);
        }
        assert!(Fleet::parse("huge")
            .unwrap_err()
            .to_string()
            .contains("known: lab"));
    }

    #[test]
    fn capacity_scales_from_the_lab_fleets_measurement() {
        let lab = Fleet {
            answers: Answers::Chat,
            ..FLEETS[0]
        };
        // The lab fleet's engine, as measured; its answers cut at 1024 tokens are a little
        // shorter than the measurement's, so a little more fits.
        let (b, s, kv, _) = LAB_ENGINE;
        assert_eq!(
            (
                lab.max_num_seqs,
                lab.step_per_seq_ms,
                lab.kv_capacity_tokens
            ),
            (b, s, kv)
        );
        let c = lab.capacity_rps();
        assert!((3.0..3.2).contains(&c), "{c}");
        // Shorter answers: more requests; a wider batch: more; a costlier sequence: fewer;
        // a KV cache too small for the batch: fewer than the batch allows.
        let short = Fleet {
            answers: Answers::Short,
            ..lab
        };
        assert!(short.capacity_rps() > 3.0 * lab.capacity_rps());
        let wide = Fleet {
            max_num_seqs: 64,
            kv_capacity_tokens: 32768,
            ..lab
        };
        assert!(wide.capacity_rps() > 2.0 * lab.capacity_rps());
        let costly = Fleet {
            step_per_seq_ms: 1.0,
            ..wide
        };
        assert!(costly.capacity_rps() < wide.capacity_rps());
        let small_kv = Fleet {
            kv_capacity_tokens: 8192,
            ..wide
        };
        assert!(small_kv.capacity_rps() < 0.5 * wide.capacity_rps());
    }

    #[test]
    fn answer_means_match_the_generators_draws() {
        for a in [Answers::Short, Answers::Chat, Answers::HeavyTailed] {
            let (median, sigma, max) = a.shape();
            let shape = Shape {
                output_median: median,
                output_sigma: sigma,
                max_output: max,
                ..Shape::default()
            };
            let mut g = Generator::new(shape, 1).unwrap();
            let firsts: Vec<f64> = (0..20_000)
                .map(|_| f64::from(g.conversation()[0].max_tokens))
                .collect();
            let mean = firsts.iter().sum::<f64>() / firsts.len() as f64;
            assert!(
                (mean / a.mean_tokens() - 1.0).abs() < 0.04,
                "{a:?}: drawn mean {mean}, table {}",
                a.mean_tokens()
            );
        }
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

    fn cell(fleet: &str, seed: u64, scenario: &str, policy: &str, p99: f64) -> Value {
        json!({"fleet": {"name": fleet}, "seed": seed, "scenario": scenario, "policy": policy,
               "ttft_ms": {"p50": p99 / 4.0, "p99": p99},
               "sessions": {"broken": 0, "broken_on_killed_backend": 0},
               "weight_changes_per_backend_per_10min": 0.0})
    }

    #[test]
    fn the_report_takes_each_scenarios_worst_cell_against_maglev_of_the_same_fleet_and_seed() {
        let cells = vec![
            // Fleet a: Maglev 1000 ms at seed 7, 400 ms at seed 11.
            cell("a", 7, "throttled", "maglev", 1000.0),
            cell("a", 7, "throttled", "adaptive", 150.0),
            cell("a", 7, "throttled", "adaptive+inband", 100.0),
            cell("a", 11, "throttled", "maglev", 400.0),
            // 120 / 400 = 0.3: the worst, though 150 is the largest p99.
            cell("a", 11, "throttled", "adaptive", 120.0),
            cell("a", 11, "throttled", "adaptive+inband", 132.0),
            cell("b", 7, "throttled", "maglev", 5000.0),
            cell("b", 7, "throttled", "adaptive", 500.0),
            cell("b", 7, "throttled", "adaptive+inband", 500.0),
            cell("a", 7, "healthy", "maglev", 200.0),
            cell("a", 7, "healthy", "adaptive", 204.0),
            cell("a", 7, "dying", "maglev", 200.0),
            cell("a", 7, "dying", "adaptive", 300.0),
            // A failed cell is counted, not judged.
            json!({"fleet": {"name": "a"}, "seed": 7, "scenario": "healthy",
                   "policy": "adaptive+inband", "error": "lab did not start"}),
        ];
        let r = report(&cells);
        let rows = r["scenarios"].as_array().unwrap();
        let row = |s: &str| rows.iter().find(|r| r["scenario"] == s).unwrap();
        let t = row("throttled");
        assert_eq!(t["adaptive"]["worst"], 0.3);
        assert_eq!(
            (&t["adaptive"]["fleet"], &t["adaptive"]["seed"]),
            (&json!("a"), &json!(11))
        );
        assert_eq!(t["adaptive"]["aim"], 0.2);
        assert_eq!(t["adaptive"]["held"], false);
        assert_eq!(t["adaptive+inband"]["worst"], 0.33);
        assert_eq!(t["adaptive+inband"]["held"], false);
        // Worst in-band over adaptive: 132 / 120 = 1.1 (fleet a, seed 11), over the aim.
        assert_eq!(t["inband_over_adaptive"]["worst"], 1.1);
        assert_eq!(t["inband_over_adaptive"]["held"], false);
        let h = row("healthy");
        assert_eq!(h["adaptive"]["worst"], 1.02);
        assert_eq!(h["adaptive"]["held"], true);
        assert!(h["adaptive+inband"].is_null(), "only a failed cell");
        // No aim for dying: a figure, no verdict.
        let d = row("dying");
        assert_eq!(d["adaptive"]["worst"], 1.5);
        assert!(d["adaptive"]["held"].is_null());
        assert_eq!(
            (r["cells"].as_u64(), r["failed_cells"].as_u64()),
            (Some(14), Some(1))
        );
        let text = table(&r);
        assert!(text.contains("throttled"), "{text}");
        assert!(text.contains("0.30 (a seed 11) MISSED"), "{text}");
        assert!(text.contains("1 of 14 cells failed"), "{text}");
    }

    #[test]
    fn broken_streams_count_off_the_killed_accelerator_and_churn_on_the_healthy_fleet() {
        let mut dying = cell("a", 7, "dying", "adaptive", 100.0);
        dying["sessions"] = json!({"broken": 5, "broken_on_killed_backend": 5});
        let mut gray = cell("a", 7, "gray", "adaptive", 100.0);
        gray["sessions"] = json!({"broken": 2, "broken_on_killed_backend": 0});
        let mut healthy = cell("b", 11, "healthy", "adaptive+inband", 100.0);
        healthy["weight_changes_per_backend_per_10min"] = json!(30.0);
        let mut throttled = cell("b", 11, "throttled", "adaptive+inband", 100.0);
        // Churn under a fault is not judged.
        throttled["weight_changes_per_backend_per_10min"] = json!(90.0);
        let r = report(&[dying, gray, healthy, throttled]);
        let broken = &r["broken_not_on_a_killed_backend"];
        assert_eq!(broken[0]["policy"], "adaptive");
        assert_eq!(broken[0]["cell"]["worst"], 2.0);
        assert_eq!(broken[0]["cell"]["scenario"], "gray");
        assert_eq!(broken[0]["cell"]["held"], false);
        assert_eq!(broken[1]["cell"]["worst"], 0.0);
        assert_eq!(broken[1]["cell"]["held"], true);
        let churn = &r["healthy_weight_changes_per_backend_per_10min"];
        assert!(churn[0]["cell"].is_null(), "no healthy adaptive cell");
        assert_eq!(churn[1]["cell"]["worst"], 30.0);
        assert_eq!(churn[1]["cell"]["held"], false);
    }
}
