//! `sluice-bench steer`: does adaptive steering put token streams where they are served
//! fastest? The namespace lab with the real `sluice run` daemon in front of simulated
//! accelerators (`sluice-accel`, one per backend namespace, its dcgm/vLLM/RoCE pages scraped
//! by the daemon), and the load generator (`sluice-bench tokens`) in the client namespace
//! with many source addresses. Every cell (scenario x policy) runs in a fresh lab with the
//! same seeded workload; faults go to the accelerators' control listeners, never through
//! Sluice. See [`scenario`] for the scenarios and policies.
//!
//! Writes `steer.json` (command line, git revision, one entry per cell) and SVG plots under
//! `steer/`, in `target/bench/` or with `--record` in `bench/results/`: the TTFT CDF of each
//! scenario (one line per
//! policy) and each cell's timeline (weights and steering states read from the daemon's
//! admin API, KV use from each accelerator's `GET /state`, once a second).

mod cell;
pub mod matrix;
mod plot;
pub mod pool;
mod results;
pub mod scenario;
mod stats;
mod tenants;

use std::{
    fs,
    path::PathBuf,
    time::{Duration, Instant},
};

use anyhow::{bail, Context, Result};
use serde_json::{json, Value};
use sluice_tests::daemon_lab::MAX_CLIENT_SOURCES;

use self::{
    cell::run_cell,
    results::{aims, cells_by_key},
    scenario::{list, Policy, Scenario, DEFAULT_POLICIES, DEFAULT_SCENARIOS},
};
use crate::{out, sys};

const VIP: &str = "chat";

/// Lab scale: a batch of 16 and an 8192-token KV cache per accelerator keep the real
/// per-token pace while four accelerators at 70% stream about 2000 tokens/s, which a
/// two-core machine carries (load generator, daemon and simulators). A batch of 8 queues
/// for seconds at 70% even under plain Maglev: so small a batch multiplexes too little for
/// a fleet to have headroom.
const DEFAULT_ACCEL_ARGS: &str = "--max-num-seqs 16 --kv-capacity-tokens 8192";

/// A stream counts as broken when it waits this long for its next byte (a client's read
/// timeout; the OpenAI SDK's is 600 s), however long it has run: a long answer from a slow
/// accelerator is slow, not broken (a 60 s cut on the whole request broke 2048-token answers
/// still streaming at 39-45 ms a token on the half-speed or throttled accelerator).
const STALL: Duration = Duration::from_secs(60);

/// The most a request may take in all, so that a cell ends by itself: a 2048-token answer
/// takes 41 s at full speed and 102 s at 0.4x.
const REQUEST_LIMIT: Duration = Duration::from_secs(180);

/// How long after a kill new sessions may still be sent to the dead backend, ms: the default
/// health checks (interval 1 s, fall 2) mark it down within (fall + 1) intervals.
const AVOID_BOUND_MS: f64 = 3000.0;

/// The VIP's affinity window, seconds. It counts from the client's last packet, so it must
/// outlast the think time between a conversation's turns: the workload's is exponential with
/// a 3 s mean (scaled down to fit one-minute runs, as a real deployment's window in minutes
/// is to its users' pauses), and exceeds 20 s for 0.13% of turns. A longer window would also
/// pin the next conversation from the same address (the generator reuses an address about
/// every 45 s), which is not the prefix a turn comes back for.
const AFFINITY_SECS: u32 = 20;

fn words(s: &str) -> Vec<String> {
    s.split_whitespace().map(str::to_owned).collect()
}

/// `sluice-bench steer --help`.
#[derive(clap::Parser, Debug)]
#[command(
    name = "sluice-bench steer",
    about = "Adaptive steering against plain Maglev on simulated accelerators: every \
             (scenario, policy) cell",
    after_help = "sluice-bench steer --matrix [ci] ...: the robustness matrix \
                  (sluice-bench steer --matrix --help)"
)]
struct Cli {
    /// Scenarios, comma separated: healthy, heterogeneous, throttled, congested, dying,
    /// overload, gray (the default); near-saturation, idle, steady, lying, flapping,
    /// noisy-tenant, noisy-tenant-calm (on request: a fleet without headroom, a light load,
    /// 10 minutes at 65% whatever --duration says, an exporter that reports idle while its
    /// accelerator slows, a throttle that comes and goes every 10 s, one tenant of four
    /// offering 5x its share over the middle third, the same tenants without the burst).
    #[arg(long)]
    scenarios: Option<String>,
    /// Policies, comma separated: maglev, adaptive, adaptive+admission, adaptive+inband
    /// (the default); adaptive+tenants (on request: admission plus the lab's tenants).
    #[arg(long)]
    policies: Option<String>,
    /// Seconds of load per cell.
    #[arg(long, default_value_t = 50)]
    duration: u64,
    /// Simulated accelerators, 4..=8.
    #[arg(long, default_value_t = 4)]
    backends: usize,
    /// The workload's seed.
    #[arg(long, default_value_t = 7)]
    seed: u64,
    /// Requests per second one healthy accelerator sustains with the default workload
    /// (measured: see docs/benchmarks.md); scenarios offer a fraction of backends x this.
    #[arg(long = "capacity-rps", default_value_t = 3.0)]
    capacity_rps: f64,
    /// Offered load of the scenarios at the usual load, as a fraction of backends x
    /// --capacity-rps (idle, near-saturation, overload and steady keep their own).
    #[arg(long, default_value_t = scenario::USUAL_LOAD)]
    load: f64,
    /// adaptive+admission's and adaptive+tenants' per-backend session cap (24: a batch of
    /// 16, a short queue, and flows of ended streams until they idle out); the tenants'
    /// caps are their shares of the fleet's.
    #[arg(long = "max-sessions", default_value_t = 24)]
    max_sessions: u32,
    /// Client source addresses, 1..=1000.
    #[arg(long, default_value_t = 180)]
    sources: u16,
    /// More sluice-accel arguments for every accelerator, space-separated (the default is
    /// lab scale, see docs/benchmarks.md).
    #[arg(long = "accel-args", allow_hyphen_values = true, default_value = DEFAULT_ACCEL_ARGS)]
    accel_args: String,
    /// More load generator (sluice-bench tokens) arguments, space-separated, e.g.
    /// "--output-median 40 --output-sigma 0.5" (default: none, its workload).
    #[arg(long = "tokens-args", allow_hyphen_values = true)]
    tokens_args: Option<String>,
    /// JSON results (default target/bench/steer.json).
    #[arg(long)]
    out: Option<PathBuf>,
    /// Directory of the plots (default target/bench/steer).
    #[arg(long)]
    plots: Option<PathBuf>,
    /// Keep each cell's per-request records (the generator's --records lines) as
    /// DIR/SCENARIO-POLICY.jsonl.
    #[arg(long, value_name = "DIR")]
    records: Option<PathBuf>,
    #[arg(long, help = out::RECORD_HELP)]
    record: bool,
}

/// The benchmark's options.
#[derive(Clone, Debug)]
pub struct Args {
    pub scenarios: Vec<Scenario>,
    pub policies: Vec<Policy>,
    pub duration: Duration,
    pub backends: usize,
    pub seed: u64,
    pub capacity_rps: f64,
    /// Offered load of the scenarios at the usual load ([`Scenario::load`]).
    pub load: f64,
    pub max_sessions: u32,
    pub sources: u16,
    pub accel_args: Vec<String>,
    pub tokens_args: Vec<String>,
    pub out: PathBuf,
    pub plots: PathBuf,
    pub records: Option<PathBuf>,
}

impl Args {
    /// The options from the command line; None when it asked for `--help`.
    pub fn parse(args: &[String]) -> Result<Option<Args>> {
        match crate::cli_args::<Cli>("sluice-bench steer", args)? {
            Some(c) => Args::from_cli(c).map(Some),
            None => Ok(None),
        }
    }

    /// The options of a run given no arguments.
    pub fn defaults() -> Result<Args> {
        Args::from_cli(<Cli as clap::Parser>::parse_from(["sluice-bench steer"]))
    }

    fn from_cli(c: Cli) -> Result<Args> {
        let a = Args {
            scenarios: match &c.scenarios {
                Some(v) => list(v, Scenario::parse)?,
                None => DEFAULT_SCENARIOS.to_vec(),
            },
            policies: match &c.policies {
                Some(v) => list(v, Policy::parse)?,
                None => DEFAULT_POLICIES.to_vec(),
            },
            duration: Duration::from_secs(c.duration),
            backends: c.backends,
            seed: c.seed,
            capacity_rps: c.capacity_rps,
            load: c.load,
            max_sessions: c.max_sessions,
            sources: c.sources,
            accel_args: words(&c.accel_args),
            tokens_args: c.tokens_args.as_deref().map(words).unwrap_or_default(),
            out: c
                .out
                .unwrap_or_else(|| out::default_path(c.record, "steer.json")),
            plots: c
                .plots
                .unwrap_or_else(|| out::default_path(c.record, "steer")),
            records: c.records,
        };
        if !(4..=8).contains(&a.backends) {
            bail!("--backends {}: 4 to 8 accelerators", a.backends);
        }
        if a.duration < Duration::from_secs(9) || a.duration > Duration::from_secs(3600) {
            bail!("--duration {:?}: 9 s to 1 h", a.duration);
        }
        if !(a.capacity_rps > 0.0 && a.capacity_rps.is_finite()) {
            bail!("--capacity-rps must be a positive number");
        }
        if !(a.load > 0.0 && a.load <= 1.5) {
            bail!(
                "--load {}: a fraction of the fleet's capacity in (0, 1.5]",
                a.load
            );
        }
        if a.sources == 0 || a.sources > MAX_CLIENT_SOURCES {
            bail!("--sources {}: 1 to {MAX_CLIENT_SOURCES}", a.sources);
        }
        if a.scenarios.is_empty() || a.policies.is_empty() {
            bail!("nothing to run: --scenarios and --policies name none");
        }
        Ok(a)
    }
}

pub fn main(args: &[String]) -> Result<()> {
    if args.iter().any(|a| a == matrix::FLAG) {
        return matrix::main(args);
    }
    let Some(args) = Args::parse(args)? else {
        return Ok(());
    };
    sys::require_root()?;
    sys::catch_interrupts();
    let doc = run(&args)?;
    out::write_json_records(&args.out, &doc, "cells")?;
    println!("plots under {}", args.plots.display());
    Ok(())
}

/// The binaries next to this one (a built workspace has them all in one directory).
fn sibling(name: &str) -> Result<PathBuf> {
    let p = std::env::current_exe()?.with_file_name(name);
    if !p.is_file() {
        bail!(
            "{} is missing: build the workspace (`cargo xtask build`)",
            p.display()
        );
    }
    Ok(p)
}

/// Runs every cell; returns the results document (and writes the plots).
pub fn run(args: &Args) -> Result<Value> {
    let tools = Tools::find()?;
    fs::create_dir_all(&args.plots)
        .with_context(|| format!("creating {}", args.plots.display()))?;
    let started = Instant::now();
    let mut cells = Vec::new();
    for &scenario in &args.scenarios {
        let mut cdfs = Vec::new();
        for &policy in &args.policies {
            sys::interrupted()?;
            println!(
                "== {} / {} ({:.0} s so far)",
                scenario.name(),
                policy.name(),
                started.elapsed().as_secs_f64()
            );
            let cell = run_cell(args, &tools, scenario, policy)
                .with_context(|| format!("cell {} / {}", scenario.name(), policy.name()))?;
            print_cell(&cell.json);
            let file =
                args.plots
                    .join(format!("timeline-{}-{}.svg", scenario.name(), slug(policy)));
            fs::write(&file, &cell.timeline_svg)?;
            cdfs.push((policy.name().to_owned(), cell.ttfts));
            cells.push(cell.json);
        }
        let file = args.plots.join(format!("ttft-cdf-{}.svg", scenario.name()));
        fs::write(
            &file,
            plot::cdf(&format!("{}: time to first token", scenario.name()), &cdfs),
        )?;
    }
    Ok(result_doc(
        "steer",
        json!({
        "backends": args.backends,
        "duration_s": args.duration.as_secs(),
        "seed": args.seed,
        "capacity_rps_per_backend": args.capacity_rps,
        "max_sessions": args.max_sessions,
        "client_sources": args.sources,
        "load": args.load,
        "accel_args": args.accel_args.join(" "),
        "tokens_args": args.tokens_args.join(" "),
        // What adaptive+tenants configures, derived from the options above.
        "tenant_tables": args.policies.contains(&Policy::Tenants).then(|| {
            tenants::tables(args.backends, args.max_sessions, args.capacity_rps)
                .iter()
                .map(tenants::table_json)
                .collect::<Vec<_>>()
        }),
        "wall_s": started.elapsed().as_secs(),
        "cells": cells,
        "aims": aims(&cells_by_key(&cells.iter().collect::<Vec<_>>())),
        }),
    ))
}

/// A result document: what every steer result opens with (the benchmark, how it was run,
/// on what), then `fields`.
fn result_doc(benchmark: &str, fields: Value) -> Value {
    let (git_head, _) = sys::git_state();
    let mut doc = json!({
        "benchmark": benchmark,
        "command_line": std::env::args().collect::<Vec<_>>().join(" "),
        "git_head": git_head,
        "date_utc": sys::utc_now(),
        "kernel": sys::kernel_release(),
        "cpu_model": sys::cpu_model(),
        "cpus": sys::online_cpus(),
    });
    if let (Some(d), Value::Object(f)) = (doc.as_object_mut(), fields) {
        d.extend(f);
    }
    doc
}

fn slug(p: Policy) -> String {
    p.name().replace('+', "-")
}

struct Tools {
    server: PathBuf,
    accel: PathBuf,
    bench: PathBuf,
}

impl Tools {
    fn find() -> Result<Tools> {
        Ok(Tools {
            server: sibling("sluice-testsrv")?,
            accel: sibling("sluice-accel")?,
            bench: std::env::current_exe()?,
        })
    }
}

fn print_cell(c: &Value) {
    println!(
        "   ttft p50 {} p99 {} ms; itl p99 {} ms; goodput {} tok/s; completed {} broken {}; \
         affinity {}; prefix cache hit rate {}; weight changes {}",
        c["ttft_ms"]["p50"],
        c["ttft_ms"]["p99"],
        c["itl_ms"]["p99"],
        c["goodput_tokens_per_s"],
        c["sessions"]["completed"],
        c["sessions"]["broken"],
        c["affinity_kept"],
        c["prefix_cache"]["hit_rate"],
        c["weight_changes"]
    );
    let Some(tenants) = c["tenants"]["tenants"].as_object() else {
        return;
    };
    for (name, t) in tenants {
        for (label, f) in [("run", &t["run"]), ("burst window", &t["burst_window"])] {
            println!(
                "   {name} ({label}): ttft p50 {} p99 {} ms; goodput {} tok/s; completed {} \
                 refused {} cut {}; broken {}",
                f["ttft_ms"]["p50"],
                f["ttft_ms"]["p99"],
                f["goodput_tokens_per_s"],
                f["completed"],
                f["refused"],
                f["established_cut"],
                f["broken_by_reason"]
            );
        }
    }
    println!(
        "   noisy tenant's share of the burst window's tokens {} (weighted share {})",
        c["tenants"]["noisy_share_of_window_tokens"], c["tenants"]["noisy_weighted_share"]
    );
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn args_default_and_check() {
        let a = Args::parse(&[]).unwrap().unwrap();
        assert_eq!((a.scenarios.len(), a.policies.len(), a.backends), (7, 4, 4));
        let s = |v: &[&str]| v.iter().map(|x| x.to_string()).collect::<Vec<_>>();
        let a = Args::parse(&s(&[
            "--scenarios",
            "throttled",
            "--policies",
            "maglev,adaptive",
            "--duration",
            "15",
        ]))
        .unwrap()
        .unwrap();
        assert_eq!(a.scenarios, [Scenario::Throttled]);
        assert_eq!(a.duration, Duration::from_secs(15));
        assert!(Args::parse(&s(&["--backends", "9"])).is_err());
        assert!(Args::parse(&s(&["--duration"])).is_err());
        assert!(Args::parse(&s(&["--policies", "katran"])).is_err());
    }

    #[test]
    fn tool_arguments_that_start_with_dashes_are_values() {
        let s = |v: &[&str]| v.iter().map(|x| x.to_string()).collect::<Vec<_>>();
        let a = Args::parse(&s(&[
            "--tokens-args",
            "--output-median 40 --output-sigma 0.5",
            "--accel-args",
            "--max-num-seqs 64",
        ]))
        .unwrap()
        .unwrap();
        assert_eq!(
            a.tokens_args,
            s(&["--output-median", "40", "--output-sigma", "0.5"])
        );
        assert_eq!(a.accel_args, s(&["--max-num-seqs", "64"]));
        let d = Args::defaults().unwrap();
        assert_eq!(d.accel_args, words(DEFAULT_ACCEL_ARGS));
        assert!(d.tokens_args.is_empty());
    }

    #[test]
    fn results_go_under_target_unless_recorded() {
        let s = |v: &[&str]| v.iter().map(|x| x.to_string()).collect::<Vec<_>>();
        let a = Args::parse(&s(&["--seed", "11"])).unwrap().unwrap();
        assert_eq!(a.out, PathBuf::from("target/bench/steer.json"));
        assert_eq!(a.plots, PathBuf::from("target/bench/steer"));
        let a = Args::parse(&s(&["--seed", "11", "--record", "--duration", "15"]))
            .unwrap()
            .unwrap();
        assert_eq!(a.out, PathBuf::from("bench/results/steer.json"));
        assert_eq!(a.plots, PathBuf::from("bench/results/steer"));
        assert_eq!((a.seed, a.duration), (11, Duration::from_secs(15)));
        let a = Args::parse(&s(&["--record", "--out", "/tmp/x.json"]))
            .unwrap()
            .unwrap();
        assert_eq!(a.out, PathBuf::from("/tmp/x.json"));
    }
}
