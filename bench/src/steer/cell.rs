//! Running one cell: its lab (daemon, accelerators, load generator), the faults on schedule,
//! the once-a-second observations and what the tools left behind.

use std::{
    collections::BTreeMap,
    fs,
    net::{IpAddr, SocketAddr},
    path::{Path, PathBuf},
    time::{Duration, Instant},
};

use anyhow::{bail, Context, Result};
use serde_json::{json, Value};
use sluice::clock::now_ms;
use sluice_tests::{
    daemon_lab::{wait_for, Accel, DaemonLab, DaemonLabOptions, TenantDef, VipDef},
    netns::{ProcId, TCP_PORT, VIP4},
};

use super::{
    plot,
    results::{backends_json, cell_json, sample, steering, CellFacts, Gathered, Observed},
    scenario::{self, Policy, Scenario},
    stats, tenants, Args, Tools, AFFINITY_SECS, REQUEST_LIMIT, STALL, VIP,
};
use crate::sys;

pub(super) struct CellOut {
    pub(super) json: Value,
    pub(super) ttfts: Vec<f64>,
    pub(super) timeline_svg: String,
}

/// A scratch directory for one cell's load-generator files, removed on drop.
struct Scratch(PathBuf);

impl Drop for Scratch {
    fn drop(&mut self) {
        let _ = fs::remove_dir_all(&self.0);
    }
}

pub(super) fn run_cell(
    args: &Args,
    tools: &Tools,
    scenario: Scenario,
    policy: Policy,
) -> Result<CellOut> {
    let n = args.backends;
    let vip_addr = SocketAddr::new(VIP4.into(), TCP_PORT);
    let mut cell = start_cell_lab(args, tools, scenario, policy, vip_addr)?;

    let scratch = Scratch(std::env::temp_dir().join(format!("{}-steer", cell.lab.id)));
    fs::create_dir_all(&scratch.0)?;
    let all_sources = cell.lab.add_client_sources(args.sources)?;
    let sources = if scenario.tenants() {
        tenants::sources(&all_sources, false)?
    } else {
        all_sources.clone()
    };
    let files = GenFiles::in_dir(&scratch.0, "");
    write_sources(&files, &sources)?;
    let duration = scenario.duration(args.duration);
    let secs = duration.as_secs_f64();
    let rate = scenario.load(args.load) * n as f64 * args.capacity_rps;
    let faults = scenario.faults();
    let gen_args = generator_args(args, args.seed, &faults, vip_addr, rate, duration, &files);
    let burst = burst_generator(
        args,
        scenario,
        &all_sources,
        vip_addr,
        rate,
        secs,
        &scratch.0,
    )?;
    let client = cell.lab.topo.client.ns.clone();
    let since_ms = now_ms();
    let t0 = Instant::now();
    let gen = cell
        .lab
        .topo
        .spawn(&client, "sluice-bench tokens", &tools.bench, &gen_args)?;
    let (seen, burst_at) = drive(&mut cell, tools, gen, burst.as_ref(), &faults, duration, t0)?;
    let got = gather(
        &cell.lab,
        args,
        scenario,
        policy,
        &files,
        burst.as_ref().zip(burst_at),
    )?;
    let CellLab {
        lab, names, ips, ..
    } = cell;
    drop(lab);

    let facts = CellFacts {
        scenario,
        policy,
        rate,
        burst_rate: burst.as_ref().map(|b| b.rate),
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
    if policy == Policy::Tenants {
        opts.tenants = tenants::tables(n, args.max_sessions, args.capacity_rps)
            .iter()
            .map(TenantDef::table)
            .collect();
    }
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

/// A load generator's files in a cell's scratch directory.
struct GenFiles {
    sources: PathBuf,
    summary: PathBuf,
    records: PathBuf,
}

impl GenFiles {
    /// The files of the generator whose names start with `prefix`.
    fn in_dir(dir: &Path, prefix: &str) -> GenFiles {
        GenFiles {
            sources: dir.join(format!("{prefix}sources.txt")),
            summary: dir.join(format!("{prefix}summary.json")),
            records: dir.join(format!("{prefix}records.jsonl")),
        }
    }
}

fn write_sources(files: &GenFiles, sources: &[IpAddr]) -> Result<()> {
    fs::write(
        &files.sources,
        sources.iter().map(|a| format!("{a}\n")).collect::<String>(),
    )
    .with_context(|| format!("writing {}", files.sources.display()))
}

/// Conversation ids of the burst's generator start here in the merged records: the two
/// generators count conversations from 0 each.
const BURST_CONVERSATIONS: u64 = 1 << 32;

/// A generator's summary and its records (one JSON value per request).
fn read_generator(files: &GenFiles) -> Result<(Value, Vec<Value>)> {
    let summary: Value = serde_json::from_str(
        &fs::read_to_string(&files.summary)
            .with_context(|| format!("reading {}", files.summary.display()))?,
    )?;
    let text = fs::read_to_string(&files.records)
        .with_context(|| format!("reading {}", files.records.display()))?;
    let lines = text
        .lines()
        .filter(|l| !l.trim().is_empty())
        .map(serde_json::from_str)
        .collect::<serde_json::Result<Vec<Value>>>()
        .with_context(|| format!("parsing {}", files.records.display()))?;
    Ok((summary, lines))
}

/// The second load generator of a scenario with a burst: the noisy tenant's load over its
/// share, from its addresses only, started `at` into the cell.
struct BurstGen {
    at: Duration,
    args: Vec<String>,
    files: GenFiles,
    /// Offered requests per second.
    rate: f64,
}

/// The scenario's burst generator, if it has one: over the burst's part of the run, the
/// noisy tenant's steady share of `rate` times the burst's factor less the share the
/// steady generator already offers, with a workload of its own (not the steady
/// generator's conversations again).
fn burst_generator(
    args: &Args,
    scenario: Scenario,
    all_sources: &[IpAddr],
    vip_addr: SocketAddr,
    rate: f64,
    secs: f64,
    dir: &Path,
) -> Result<Option<BurstGen>> {
    let Some(b) = scenario.burst() else {
        return Ok(None);
    };
    let files = GenFiles::in_dir(dir, "burst-");
    write_sources(&files, &tenants::sources(all_sources, true)?)?;
    let len = Duration::from_secs_f64((b.to - b.from) * secs);
    let burst_rate = (b.factor - 1.0) * tenants::noisy_share() * rate;
    let seed = args.seed + 1;
    Ok(Some(BurstGen {
        at: Duration::from_secs_f64(b.from * secs),
        args: generator_args(args, seed, &[], vip_addr, burst_rate, len, &files),
        files,
        rate: burst_rate,
    }))
}

/// The load generator's (`sluice-bench tokens`) arguments for a cell.
fn generator_args(
    args: &Args,
    seed: u64,
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
        &seed.to_string(),
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

/// Runs the cell until the load generators end: fires the scenario's faults on time, starts
/// the burst's generator on time, samples the backends every tick and once a second; stops
/// the generators when interrupted or late. Returns what it saw and when the burst's
/// generator started.
fn drive(
    cell: &mut CellLab,
    tools: &Tools,
    gen: ProcId,
    burst: Option<&BurstGen>,
    faults: &[scenario::Fault],
    duration: Duration,
    t0: Instant,
) -> Result<(Observed, Option<Duration>)> {
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
    // Running generators, and when the burst's started.
    let mut gens = vec![gen];
    let (mut faults_fired, mut burst_at) = (0, None);
    loop {
        let t = t0.elapsed();
        if let Some(f) = faults
            .get(faults_fired)
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
            faults_fired += 1;
            continue;
        }
        if let Some(b) = burst.filter(|b| burst_at.is_none() && t >= b.at) {
            let client = lab.topo.client.ns.clone();
            let g = lab.topo.spawn(
                &client,
                "sluice-bench tokens (burst)",
                &tools.bench,
                &b.args,
            )?;
            gens.push(g);
            burst_at = Some(t0.elapsed());
            seen.fired
                .push((t.as_secs_f64(), "noisy tenant bursts".to_owned()));
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
        let (mut still, mut failed) = (Vec::new(), None);
        for &g in &gens {
            match lab.topo.try_wait(g)? {
                None => still.push(g),
                Some(st) if !st.success() => failed = Some(st),
                Some(_) => {}
            }
        }
        gens = still;
        if let Some(st) = failed {
            stop_all(lab, &gens)?;
            bail!("a load generator failed ({st})");
        }
        if gens.is_empty() && (burst.is_none() || burst_at.is_some()) {
            break;
        }
        if let Err(e) = sys::interrupted() {
            stop_all(lab, &gens)?;
            return Err(e);
        }
        if t > limit {
            stop_all(lab, &gens)?;
            bail!("the load generators did not stop within {limit:?}");
        }
        std::thread::sleep(Duration::from_millis(100));
    }
    Ok((seen, burst_at))
}

/// Kills the load generators still running.
fn stop_all(lab: &mut DaemonLab, gens: &[ProcId]) -> Result<()> {
    for &g in gens {
        lab.topo.signal(g, libc::SIGKILL)?;
    }
    Ok(())
}

/// Reads the cell's reports (the burst's generator's, with when it started, merged in);
/// keeps the per-request records under `--records` when given.
fn gather(
    lab: &DaemonLab,
    args: &Args,
    scenario: Scenario,
    policy: Policy,
    files: &GenFiles,
    burst: Option<(&BurstGen, Duration)>,
) -> Result<Gathered> {
    let events = lab
        .api("GET", "/v1/events", None)?
        .1
        .get("events")
        .and_then(Value::as_array)
        .cloned()
        .unwrap_or_default();
    let (summary, mut lines) = read_generator(files)?;
    let mut elapsed_s = summary["elapsed_s"].as_f64().unwrap_or(0.0);
    let burst_summary = match burst {
        Some((b, at)) => {
            let (s, more) = read_generator(&b.files)?;
            let at_ms = at.as_secs_f64() * 1000.0;
            elapsed_s = elapsed_s.max(at.as_secs_f64() + s["elapsed_s"].as_f64().unwrap_or(0.0));
            lines.extend(
                more.into_iter()
                    .map(|v| stats::shifted(v, at_ms, BURST_CONVERSATIONS)),
            );
            Some(s)
        }
        None => None,
    };
    let records_text: String = lines.iter().map(|v| format!("{v}\n")).collect();
    if let Some(dir) = &args.records {
        let kept = dir.join(format!("{}-{}.jsonl", scenario.name(), policy.name()));
        fs::create_dir_all(dir).with_context(|| format!("creating {}", dir.display()))?;
        fs::write(&kept, &records_text).with_context(|| format!("writing {}", kept.display()))?;
    }
    let records: Vec<stats::Record> = lines.iter().map(stats::Record::parse).collect();
    // The daemon's own view of its tenants: sessions, admissions and refusals by reason.
    let tenant_counters = (policy == Policy::Tenants)
        .then(|| lab.api("GET", "/v1/tenants", None).ok())
        .flatten()
        .map(|(code, v)| {
            if code == 200 {
                v
            } else {
                json!({"status": code, "body": v})
            }
        });
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
        burst_summary,
        elapsed_s,
        tenant_counters,
        records,
        shed_counters,
        cache_queries,
        cache_hits,
    })
}
