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

pub mod matrix;
mod plot;
pub mod pool;
pub mod scenario;
mod stats;

use std::{
    collections::BTreeMap,
    fs,
    net::SocketAddr,
    path::{Path, PathBuf},
    time::{Duration, Instant},
};

use anyhow::{bail, Context, Result};
use serde_json::{json, Value};
use sluice::clock::now_ms;
use sluice_tests::{
    daemon_lab::{wait_for, Accel, DaemonLab, DaemonLabOptions, VipDef, MAX_CLIENT_SOURCES},
    netns::{ProcId, TCP_PORT, VIP4},
};

use self::{
    plot::{Point, Sample},
    scenario::{list, Policy, Scenario, DEFAULT_SCENARIOS, POLICIES},
    stats::Record,
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
    /// overload, gray (the default); near-saturation, idle, steady, lying, flapping (on
    /// request: a fleet without headroom, a light load, 10 minutes at 65% whatever
    /// --duration says, an exporter that reports idle while its accelerator slows, a
    /// throttle that comes and goes every 10 s).
    #[arg(long)]
    scenarios: Option<String>,
    /// Policies, comma separated: maglev, adaptive, adaptive+admission, adaptive+inband
    /// (default: all).
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
    /// adaptive+admission's per-backend session cap (24: a batch of 16, a short queue, and
    /// flows of ended streams until they idle out).
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
                None => POLICIES.to_vec(),
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
    out::write_json(&args.out, &doc)?;
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

struct CellOut {
    json: Value,
    ttfts: Vec<f64>,
    timeline_svg: String,
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
}

/// A scratch directory for one cell's load-generator files, removed on drop.
struct Scratch(PathBuf);

impl Drop for Scratch {
    fn drop(&mut self) {
        let _ = fs::remove_dir_all(&self.0);
    }
}

fn run_cell(args: &Args, tools: &Tools, scenario: Scenario, policy: Policy) -> Result<CellOut> {
    let n = args.backends;
    let vip_addr = SocketAddr::new(VIP4.into(), TCP_PORT);
    let mut cell = start_cell_lab(args, tools, scenario, policy, vip_addr)?;

    let scratch = Scratch(std::env::temp_dir().join(format!("{}-steer", cell.lab.id)));
    fs::create_dir_all(&scratch.0)?;
    let sources = cell.lab.add_client_sources(args.sources)?;
    let files = GenFiles::in_dir(&scratch.0);
    fs::write(
        &files.sources,
        sources.iter().map(|a| format!("{a}\n")).collect::<String>(),
    )?;
    let duration = scenario.duration(args.duration);
    let secs = duration.as_secs_f64();
    let rate = scenario.load(args.load) * n as f64 * args.capacity_rps;
    let faults = scenario.faults();
    let gen_args = generator_args(args, &faults, vip_addr, rate, duration, &files);
    let client = cell.lab.topo.client.ns.clone();
    let since_ms = now_ms();
    let t0 = Instant::now();
    let gen = cell
        .lab
        .topo
        .spawn(&client, "sluice-bench tokens", &tools.bench, &gen_args)?;
    let seen = drive(&mut cell, gen, &faults, duration, t0)?;
    let got = gather(&cell.lab, args, scenario, policy, &files)?;
    let CellLab {
        lab, names, ips, ..
    } = cell;
    drop(lab);

    let facts = CellFacts {
        scenario,
        policy,
        rate,
        secs,
        since_ms,
        names: &names,
        ips: &ips,
    };
    let ttfts = stats::ttfts(&got.records);
    let json = cell_json(&facts, &seen, &got, &ttfts);
    let title = format!("{} / {}", scenario.name(), policy.name());
    let timeline_svg = plot::timeline(&title, secs, &names, &seen.timeline, &seen.fired, 100.0);
    Ok(CellOut {
        json,
        ttfts,
        timeline_svg,
    })
}

/// One cell's daemon lab, and how its backends are named.
struct CellLab {
    lab: DaemonLab,
    names: Vec<String>,
    /// The backends' addresses on the VIP's port (how the admin API names them).
    addrs: Vec<String>,
    /// How the daemon's events name the backends.
    ips: Vec<String>,
}

/// Starts the lab of a cell: the VIP set for `policy`, one simulated accelerator per
/// backend (the scenario's slow one slowed), and waits until every backend is healthy and,
/// for a policy that reads telemetry, scraped.
fn start_cell_lab(
    args: &Args,
    tools: &Tools,
    scenario: Scenario,
    policy: Policy,
    vip_addr: SocketAddr,
) -> Result<CellLab> {
    let n = args.backends;
    let mut vip = VipDef::tcp(VIP, vip_addr, n);
    vip.telemetry = policy.telemetry();
    vip.inband = policy == Policy::Inband;
    vip.max_sessions = policy.max_sessions(args.max_sessions);
    // Each client address keeps its conversations on one accelerator (affinity by source),
    // through weight changes too: an affinity window longer than a conversation's think
    // time, as a chat deployment would set (a weight change would otherwise remap whole
    // source addresses, and a conversation's next turn would lose its prefix cache).
    vip.hash = "source";
    vip.affinity_secs = AFFINITY_SECS;
    // The lowest admission class; alone in its pool it is never shed whole, only its
    // sessions that find every backend full are refused.
    vip.priority = 7;
    let mut opts = DaemonLabOptions::new(&tools.server, n, vec![vip]);
    // The shipped defaults, not the lab's fast test timings.
    for section in ["health", "telemetry", "policy"] {
        opts.settings.remove(section);
    }
    for (section, key, value) in policy.settings() {
        opts.set(section, key, value);
    }
    let mut per_backend = vec![args.accel_args.clone(); n];
    if let Some((i, factor)) = scenario.slow() {
        per_backend[i].extend(["--slow".to_string(), factor.to_string()]);
    }
    opts.accel = Some(Accel {
        binary: tools.accel.clone(),
        args: per_backend,
    });
    let lab = DaemonLab::start(opts).context("starting the lab")?;
    let names: Vec<String> = lab.topo.backends.iter().map(|b| b.name.clone()).collect();
    let addrs: Vec<String> = (0..n)
        .map(|i| lab.backend_addr(i, vip_addr).to_string())
        .collect();
    let ips: Vec<String> = lab.topo.backends.iter().map(|b| b.v4.to_string()).collect();
    wait_for(
        "every backend healthy and scraped",
        Duration::from_secs(20),
        || {
            let bs = backends_json(&lab).map_err(|e| format!("{e:#}"))?;
            let ready = bs.len() == n
                && bs.iter().all(|b| {
                    b["healthy"] == true
                        && (!policy.telemetry() || !b["steering"]["telemetry_age_s"].is_null())
                });
            Ok(ready.then_some(()))
        },
    )?;
    Ok(CellLab {
        lab,
        names,
        addrs,
        ips,
    })
}

/// The load generator's files in a cell's scratch directory.
struct GenFiles {
    sources: PathBuf,
    summary: PathBuf,
    records: PathBuf,
}

impl GenFiles {
    fn in_dir(dir: &Path) -> GenFiles {
        GenFiles {
            sources: dir.join("sources.txt"),
            summary: dir.join("summary.json"),
            records: dir.join("records.jsonl"),
        }
    }
}

/// The load generator's (`sluice-bench tokens`) arguments for a cell.
fn generator_args(
    args: &Args,
    faults: &[scenario::Fault],
    vip_addr: SocketAddr,
    rate: f64,
    duration: Duration,
    files: &GenFiles,
) -> Vec<String> {
    let secs = duration.as_secs_f64();
    let mut gen_args: Vec<String> = [
        "tokens",
        "--target",
        &vip_addr.to_string(),
        "--rate",
        &format!("{rate:.3}"),
        "--duration",
        &duration.as_secs().to_string(),
        "--max-requests",
        &((rate * secs * 2.0).ceil() as u64 + 10).to_string(),
        "--seed",
        &args.seed.to_string(),
        // A refused session comes back as the OpenAI SDK's clients do (twice, backing off).
        "--retries",
        &crate::tokens::client::DEFAULT_RETRIES.to_string(),
        "--timeout-s",
        &REQUEST_LIMIT.as_secs().to_string(),
        "--stall-s",
        &STALL.as_secs().to_string(),
        "--sources-file",
        &files.sources.display().to_string(),
        "--json",
        &files.summary.display().to_string(),
        "--records",
        &files.records.display().to_string(),
    ]
    .map(str::to_owned)
    .to_vec();
    gen_args.extend(args.tokens_args.iter().cloned());
    // The streams in flight at the first fault: what no later placement can move.
    if let Some(f) = faults.first() {
        gen_args.extend([
            "--mark-ms".to_owned(),
            format!("{:.0}", f.at * secs * 1000.0),
        ]);
    }
    gen_args
}

/// What was seen while the load ran.
struct Observed {
    /// The faults fired: seconds into the cell, and the label.
    fired: Vec<(f64, String)>,
    /// One sample a second.
    timeline: Vec<Sample>,
    /// The steering flags at every tick (the samples among them).
    flags: Vec<Sample>,
    /// The accelerators' KV use at each sample.
    kv_samples: Vec<Vec<f64>>,
}

/// Runs the cell until the load generator `gen` ends: fires the scenario's faults on time,
/// samples the backends every tick and once a second; stops the generator when
/// interrupted or late.
fn drive(
    cell: &mut CellLab,
    gen: ProcId,
    faults: &[scenario::Fault],
    duration: Duration,
    t0: Instant,
) -> Result<Observed> {
    let secs = duration.as_secs_f64();
    let lab = &mut cell.lab;
    let mut seen = Observed {
        fired: Vec::new(),
        timeline: Vec::new(),
        flags: Vec::new(),
        kv_samples: Vec::new(),
    };
    let limit = duration + REQUEST_LIMIT + Duration::from_secs(30);
    let mut next_sample = Duration::ZERO;
    let status = loop {
        let t = t0.elapsed();
        if let Some(f) = faults
            .get(seen.fired.len())
            .filter(|f| t.as_secs_f64() >= f.at * secs)
        {
            // A killed accelerator answers nothing: the request's error is expected.
            let r = lab.accel_request(f.backend, "POST", "/fault", Some(&f.body));
            if f.body["kind"] != "kill" {
                let (code, body) = r.with_context(|| format!("fault {}", f.label))?;
                if code != 200 {
                    bail!("fault {}: {code} {body}", f.label);
                }
            }
            seen.fired.push((t.as_secs_f64(), f.label.clone()));
            continue;
        }
        if t >= next_sample {
            let s = sample(lab, &cell.addrs, t.as_secs_f64());
            seen.kv_samples
                .push(s.points.iter().filter_map(|p| p.kv).collect());
            seen.flags.push(s.clone());
            seen.timeline.push(s);
            next_sample += Duration::from_secs(1);
        } else {
            // Full flags change with each policy step: the affinity breakdown needs them at
            // each turn's start, not the nearest second.
            seen.flags.push(steering(lab, &cell.addrs, t.as_secs_f64()));
        }
        if let Some(st) = lab.topo.try_wait(gen)? {
            break st;
        }
        if let Err(e) = sys::interrupted() {
            lab.topo.signal(gen, libc::SIGKILL)?;
            return Err(e);
        }
        if t > limit {
            lab.topo.signal(gen, libc::SIGKILL)?;
            bail!("the load generator did not stop within {limit:?}");
        }
        std::thread::sleep(Duration::from_millis(100));
    };
    if !status.success() {
        bail!("the load generator failed ({status})");
    }
    Ok(seen)
}

/// What the daemon, the load generator and the accelerators report after the load.
struct Gathered {
    events: Vec<Value>,
    summary: Value,
    records: Vec<Record>,
    shed_counters: BTreeMap<String, u64>,
    cache_queries: u64,
    cache_hits: u64,
}

/// Reads the cell's reports; keeps the per-request records under `--records` when given.
fn gather(
    lab: &DaemonLab,
    args: &Args,
    scenario: Scenario,
    policy: Policy,
    files: &GenFiles,
) -> Result<Gathered> {
    let events = lab
        .api("GET", "/v1/events", None)?
        .1
        .get("events")
        .and_then(Value::as_array)
        .cloned()
        .unwrap_or_default();
    let summary: Value = serde_json::from_str(
        &fs::read_to_string(&files.summary)
            .with_context(|| format!("reading {}", files.summary.display()))?,
    )?;
    let records_text = fs::read_to_string(&files.records)
        .with_context(|| format!("reading {}", files.records.display()))?;
    if let Some(dir) = &args.records {
        let kept = dir.join(format!("{}-{}.jsonl", scenario.name(), policy.name()));
        fs::create_dir_all(dir).with_context(|| format!("creating {}", dir.display()))?;
        fs::write(&kept, &records_text).with_context(|| format!("writing {}", kept.display()))?;
    }
    let records = stats::parse_records(&records_text).context("parsing the records")?;
    let shed_counters: BTreeMap<String, u64> = lab
        .api("GET", "/v1/stats", None)
        .map(|(_, v)| v)
        .unwrap_or_default()["global"]
        .as_object()
        .into_iter()
        .flatten()
        .filter(|(k, _)| k.contains("shed"))
        .filter_map(|(k, v)| Some((k.clone(), v.as_u64()?)))
        .collect();
    // The prefix cache counters, summed over the accelerators (a killed one reads nothing).
    let (mut cache_queries, mut cache_hits) = (0, 0);
    for i in 0..args.backends {
        if let Ok((200, v)) = lab.accel_request(i, "GET", "/state", None) {
            cache_queries += v["prefix_cache_queries"].as_u64().unwrap_or(0);
            cache_hits += v["prefix_cache_hits"].as_u64().unwrap_or(0);
        }
    }
    Ok(Gathered {
        events,
        summary,
        records,
        shed_counters,
        cache_queries,
        cache_hits,
    })
}

/// What a cell's result needs besides what it saw and gathered.
struct CellFacts<'a> {
    scenario: Scenario,
    policy: Policy,
    /// Offered requests per second.
    rate: f64,
    /// Seconds of load.
    secs: f64,
    /// When the load started (the daemon's events are counted from here).
    since_ms: u64,
    names: &'a [String],
    ips: &'a [String],
}

/// A cell's result (`ttfts`: every request's time to first token, ms).
fn cell_json(c: &CellFacts, seen: &Observed, got: &Gathered, ttfts: &[f64]) -> Value {
    let (scenario, secs, names) = (c.scenario, c.secs, c.names);
    let (records, summary, fired) = (&got.records, &got.summary, &seen.fired);
    let killed = scenario.killed().map(|i| names[i].clone());
    let faulty: Vec<&str> = if scenario.faults().is_empty() && scenario.slow().is_none() {
        Vec::new()
    } else {
        vec![names[scenario::FAULTY].as_str()]
    };
    let kill = killed
        .as_deref()
        .zip(fired.first())
        .map(|(backend, (at, _))| stats::Kill {
            backend,
            at_ms: at * 1000.0,
            bound_ms: AVOID_BOUND_MS,
        });
    let (completed, broken, on_killed) = stats::sessions(records, kill);
    let changes = stats::weight_changes(&got.events, c.since_ms, c.ips);
    let total_changes: u64 = changes.values().sum();
    let max_changes = changes.values().copied().max().unwrap_or(0);
    let mut after = Vec::new();
    for (k, (at, label)) in fired.iter().enumerate() {
        let to = fired.get(k + 1).map_or(f64::MAX, |f| f.0) * 1000.0;
        // New sessions from 2 s after the fault (detection and one scrape) to the next one.
        after.push(json!({
            "fault": label,
            "at_s": (at * 10.0).round() / 10.0,
            "new_sessions": stats::landed(records, at * 1000.0 + 2000.0, to),
            "ttft_ms": stats::quantiles(&window_ttfts(records, at * 1000.0, to)),
        }));
    }
    json!({
        "scenario": scenario.name(),
        "policy": c.policy.name(),
        "offered_rps": (c.rate * 1000.0).round() / 1000.0,
        "duration_s": secs,
        "ttft_ms": stats::quantiles(ttfts),
        "itl_ms": itl(summary),
        // Over the generator's whole run (requests start for `duration`, then finish).
        "goodput_tokens_per_s": summary["summary"]["goodput_tokens_per_s"],
        // A second figure beside goodput: only streams that met a TTFT SLO count.
        "slo_goodput": {
            "ttft_slo_ms": stats::TTFT_SLO_MS,
            "tokens_per_s": stats::slo_goodput(
                records,
                stats::TTFT_SLO_MS,
                summary["elapsed_s"].as_f64().unwrap_or(0.0),
            ),
        },
        "sessions": {
            "completed": completed,
            "broken": broken,
            "broken_on_killed_backend": on_killed,
            "broken_by_reason": stats::broken_by_reason(records),
            "per_backend": stats::landed(records, 0.0, f64::MAX),
        },
        // Requests refused (or reset before any byte) and tried again, and their retries.
        "retries": {
            "requests_retried": summary["summary"]["requests_retried"],
            "retries": summary["summary"]["retries"],
        },
        // The faulty backend's streams in flight at the fault: the p99 inter-token latency
        // their later gaps alone set (`p99_floor_ms`), whatever the policy does after.
        "itl_floor": faulty
            .first()
            .map(|b| &summary["in_flight_at_mark"]["per_backend"][*b])
            .filter(|f| !f.is_null()),
        "imbalance": (stats::imbalance(&seen.kv_samples) * 1000.0).round() / 1000.0,
        "affinity_kept": stats::affinity_kept(records, &faulty),
        // What affinity saves: prompt tokens served from the accelerators' prefix caches.
        "prefix_cache": stats::prefix_cache(got.cache_queries, got.cache_hits, records),
        "affinity_lost": stats::affinity_lost(records, &faulty, names, &seen.flags, AFFINITY_SECS),
        "weight_changes": total_changes,
        "weight_changes_per_backend": changes,
        "weight_changes_per_backend_per_10min": (max_changes as f64 * 600.0 / secs).round(),
        "after_faults": after,
        "new_sessions_failed_for_ms_after_kill": fired
            .first()
            .filter(|_| killed.is_some())
            .map(|(at, _)| stats::avoided_after_ms(records, at * 1000.0).round()),
        "backends": names,
        "timeline": seen.timeline.iter().map(|s| json!({
            "t_s": (s.t * 10.0).round() / 10.0,
            "weight": s.points.iter().map(|p| p.weight).collect::<Vec<_>>(),
            "state": s.points.iter().map(|p| p.state.clone()).collect::<Vec<_>>(),
            "kv": s.points.iter().map(|p| p.kv.map(|k| (k * 1000.0).round() / 1000.0)).collect::<Vec<_>>(),
            "full": s.points.iter().map(|p| p.full).collect::<Vec<_>>(),
            "waiting": s.points.iter().map(|p| p.waiting).collect::<Vec<_>>(),
            "telemetry_age_s": s.points.iter().map(|p| p.telemetry_age_s.map(|a| (a * 1000.0).round() / 1000.0)).collect::<Vec<_>>(),
        })).collect::<Vec<_>>(),
        // Admission: the shed level's changes (s into the cell) and the data plane's
        // refusals, by priority class (the whole VIP) or for want of a backend with room.
        "shed_changes": stats::shed_changes(&got.events, c.since_ms),
        "shed_counters": got.shed_counters,
        "generator_summary": summary,
    })
}

/// TTFTs of the requests started in `[from_ms, to_ms)`.
fn window_ttfts(records: &[Record], from_ms: f64, to_ms: f64) -> Vec<f64> {
    records
        .iter()
        .filter(|r| r.start_ms >= from_ms && r.start_ms < to_ms)
        .filter_map(|r| r.ttft_ms)
        .collect()
}

/// The inter-token latency quantiles of the generator's summary (over every gap).
fn itl(summary: &Value) -> Value {
    summary["summary"]["itl_ms"].clone()
}

/// The VIP's backends from the admin API.
fn backends_json(lab: &DaemonLab) -> Result<Vec<Value>> {
    let (code, v) = lab.api("GET", &format!("/v1/vips/{VIP}"), None)?;
    if code != 200 {
        bail!("GET /v1/vips/{VIP}: {code} {v}");
    }
    Ok(v["backends"].as_array().cloned().unwrap_or_default())
}

/// One timeline sample: weights and states from the daemon, KV use and requests from the
/// accelerators.
fn sample(lab: &DaemonLab, addrs: &[String], t: f64) -> Sample {
    let mut s = steering(lab, addrs, t);
    for (i, p) in s.points.iter_mut().enumerate() {
        let engine = lab
            .accel_request(i, "GET", "/state", None)
            .ok()
            .and_then(|(c, v)| (c == 200).then_some(v));
        let engine = |k: &str| engine.as_ref().map(|v| v[k].clone());
        p.kv = engine("kv_used_fraction").and_then(|v| v.as_f64());
        p.running = engine("running").and_then(|v| v.as_u64());
        p.waiting = engine("waiting").and_then(|v| v.as_u64());
    }
    s
}

/// Weights, steering states, full flags and session counts from the daemon alone (one admin
/// API call): what the data plane applies to new sessions.
fn steering(lab: &DaemonLab, addrs: &[String], t: f64) -> Sample {
    let daemon: BTreeMap<String, Value> = backends_json(lab)
        .unwrap_or_default()
        .into_iter()
        .filter_map(|b| Some((b["address"].as_str()?.to_owned(), b)))
        .collect();
    let points = addrs
        .iter()
        .map(|a| {
            let b = daemon.get(a);
            let state = b.and_then(|b| {
                b["steering"]["state"]
                    .as_str()
                    .map(str::to_owned)
                    .or_else(|| {
                        Some(
                            if b["healthy"] == true {
                                "active"
                            } else {
                                "down"
                            }
                            .into(),
                        )
                    })
            });
            Point {
                weight: b.and_then(|b| b["effective_weight"].as_f64()),
                state,
                kv: None,
                full: b.is_some_and(|b| b["steering"]["full"] == true),
                capped: b.is_some_and(|b| b["steering"]["capped"] == true),
                no_affinity: b.is_some_and(|b| b["steering"]["breaks_affinity"] == true),
                sessions: b.and_then(|b| b["steering"]["sessions"].as_u64()),
                telemetry_age_s: b.and_then(|b| b["steering"]["telemetry_age_s"].as_f64()),
                running: None,
                waiting: None,
            }
        })
        .collect();
    Sample { t, points }
}

/// Cells by (scenario, policy).
fn cells_by_key<'a>(cells: &[&'a Value]) -> BTreeMap<(String, String), &'a Value> {
    cells
        .iter()
        .map(|c| {
            (
                (
                    c["scenario"].as_str().unwrap_or("").to_owned(),
                    c["policy"].as_str().unwrap_or("").to_owned(),
                ),
                *c,
            )
        })
        .collect()
}

/// The steering aims (docs/benchmarks.md), each with the figures behind it and whether it
/// held (absent when the cells it needs were not run).
pub fn aims(cells: &BTreeMap<(String, String), &Value>) -> Vec<Value> {
    let get = |s: &str, p: &str| cells.get(&(s.to_owned(), p.to_owned())).copied();
    let f = |c: &Value, ptr: &str| c.pointer(ptr).and_then(Value::as_f64);
    let mut out = Vec::new();
    let mut aim = |name: String, held: Option<bool>, figures: Value| {
        if let Some(held) = held {
            out.push(json!({"aim": name, "held": held, "figures": figures}));
        }
    };
    for s in ["heterogeneous", "throttled", "congested"] {
        if let (Some(m), Some(a)) = (get(s, "maglev"), get(s, "adaptive")) {
            let ratio = |ptr| Some(f(a, ptr)? / f(m, ptr)?.max(1e-9));
            let t = ratio("/ttft_ms/p99");
            let i = ratio("/itl_ms/p99");
            let broken = f(a, "/sessions/broken");
            aim(
                format!("{s}: adaptive p99 TTFT <= 0.5x maglev"),
                t.map(|t| t <= 0.5),
                json!({"ratio": t}),
            );
            // Over 0.7 the aim is out of reach of any placement of new sessions: the faulty
            // backend's streams in flight at the fault set that p99 on their own.
            let floor = f(a, "/itl_floor/p99_floor_ms")
                .zip(f(m, "/itl_ms/p99"))
                .map(|(floor, m)| floor / m.max(1e-9));
            aim(
                format!("{s}: adaptive p99 ITL <= 0.7x maglev"),
                i.map(|i| i <= 0.7),
                json!({"ratio": i, "floor_ratio": floor}),
            );
            aim(
                format!("{s}: adaptive 0 broken streams"),
                broken.map(|b| b == 0.0),
                json!({"broken": broken}),
            );
        }
    }
    if let Some(a) = get("dying", "adaptive") {
        let (b, k) = (
            f(a, "/sessions/broken"),
            f(a, "/sessions/broken_on_killed_backend"),
        );
        let after = f(a, "/new_sessions_failed_for_ms_after_kill");
        aim(
            "dying: only the killed accelerator's streams break".into(),
            b.zip(k).map(|(b, k)| b == k),
            json!({"broken": b, "on_killed": k}),
        );
        aim(
            "dying: new sessions avoid it within interval x (fall + 1) = 3 s".into(),
            after.map(|ms| ms <= AVOID_BOUND_MS),
            json!({"new_sessions_failed_for_ms": after}),
        );
    }
    if let (Some(m), Some(a)) = (get("healthy", "maglev"), get("healthy", "adaptive")) {
        let t = f(a, "/ttft_ms/p99")
            .zip(f(m, "/ttft_ms/p99"))
            .map(|(a, m)| a / m.max(1e-9));
        aim(
            "healthy: adaptive p99 TTFT <= 1.05x maglev".into(),
            t.map(|t| t <= 1.05),
            json!({"ratio": t}),
        );
        // The churn aim is judged by the `steady` cell, which counts 10 real minutes: from a
        // 60 s cell one move out and back extrapolates to 20 and read as a miss every run.
    }
    if let (Some(h), Some(o), Some(m)) = (
        get("healthy", "adaptive+admission"),
        get("overload", "adaptive+admission"),
        get("overload", "maglev"),
    ) {
        let i = f(o, "/itl_ms/p99")
            .zip(f(h, "/itl_ms/p99"))
            .map(|(o, h)| o / h.max(1e-9));
        aim(
            "overload: with admission, p99 ITL <= 1.5x the healthy run's".into(),
            i.map(|i| i <= 1.5),
            json!({"ratio": i}),
        );
        let g = f(o, "/goodput_tokens_per_s").zip(f(m, "/goodput_tokens_per_s"));
        aim(
            "overload: with admission, goodput > maglev's".into(),
            g.map(|(o, m)| o > m),
            json!({"admission": g.map(|g| g.0), "maglev": g.map(|g| g.1)}),
        );
    }
    for s in ["near-saturation"] {
        if let (Some(m), Some(a)) = (get(s, "maglev"), get(s, "adaptive")) {
            let t = f(a, "/ttft_ms/p99")
                .zip(f(m, "/ttft_ms/p99"))
                .map(|(a, m)| a / m.max(1e-9));
            aim(
                format!("{s}: adaptive p99 TTFT < maglev's"),
                t.map(|t| t < 1.0),
                json!({"ratio": t}),
            );
        }
    }
    if let Some(a) = get("idle", "adaptive") {
        let w = f(a, "/weight_changes");
        aim(
            "idle: adaptive changes no weight (no temperature floor)".into(),
            w.map(|w| w == 0.0),
            json!({"weight_changes": w}),
        );
    }
    if let Some(a) = get("steady", "adaptive") {
        let w = f(a, "/weight_changes_per_backend_per_10min");
        aim(
            "steady: <= 12 weight changes per backend in 10 min".into(),
            w.map(|w| w <= 12.0),
            json!({"per_backend_per_10min": w}),
        );
    }
    let worst = cells
        .values()
        .filter(|c| c["policy"] != "maglev")
        .filter_map(|c| f(c, "/affinity_kept"))
        .fold(None, |m: Option<f64>, a| Some(m.map_or(a, |m| m.min(a))));
    aim(
        "affinity kept >= 99% of turns whose backend stayed healthy (steered policies)".into(),
        worst.map(|w| w >= 0.99),
        json!({"worst": worst}),
    );
    out
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

    #[test]
    fn aims_compare_the_same_scenarios_cells() {
        let cell = |s: &str, p: &str, ttft: f64, broken: u64| {
            json!({"scenario": s, "policy": p, "ttft_ms": {"p99": ttft}, "itl_ms": {"p99": 50.0},
                   "sessions": {"broken": broken, "broken_on_killed_backend": 0},
                   "affinity_kept": 1.0})
        };
        let mut adaptive = cell("throttled", "adaptive", 600.0, 0);
        // Its streams in flight at the fault alone set a p99 of 45 ms: 0.9 of Maglev's.
        adaptive["itl_floor"] = json!({"p99_floor_ms": 45.0});
        let cells = [cell("throttled", "maglev", 3000.0, 0), adaptive];
        let refs: Vec<&Value> = cells.iter().collect();
        let aims = aims(&cells_by_key(&refs));
        let held: Vec<(String, bool)> = aims
            .iter()
            .map(|a| (a["aim"].as_str().unwrap().to_owned(), a["held"] == true))
            .collect();
        assert_eq!(
            held,
            [
                (
                    "throttled: adaptive p99 TTFT <= 0.5x maglev".to_owned(),
                    true
                ),
                (
                    "throttled: adaptive p99 ITL <= 0.7x maglev".to_owned(),
                    false
                ),
                ("throttled: adaptive 0 broken streams".to_owned(), true),
                (
                    "affinity kept >= 99% of turns whose backend stayed healthy (steered policies)"
                        .to_owned(),
                    true
                ),
            ]
        );
        assert_eq!(aims[1]["figures"]["floor_ratio"], 0.9);
    }

    #[test]
    fn weight_churn_is_judged_by_the_ten_minute_cell_only() {
        let cell = |s: &str, p: &str, per_10min: f64| {
            json!({"scenario": s, "policy": p, "ttft_ms": {"p99": 100.0},
                   "weight_changes_per_backend_per_10min": per_10min})
        };
        // One move out and back in 60 s extrapolates to 20: no verdict from that.
        let cells = [
            cell("healthy", "maglev", 0.0),
            cell("healthy", "adaptive", 20.0),
            cell("steady", "adaptive", 7.0),
        ];
        let refs: Vec<&Value> = cells.iter().collect();
        let aims = aims(&cells_by_key(&refs));
        let churn: Vec<(&str, bool)> = aims
            .iter()
            .filter_map(|a| {
                a["aim"]
                    .as_str()
                    .filter(|n| n.contains("weight changes"))
                    .map(|n| (n, a["held"] == true))
            })
            .collect();
        assert_eq!(
            churn,
            [("steady: <= 12 weight changes per backend in 10 min", true)]
        );
    }
}
