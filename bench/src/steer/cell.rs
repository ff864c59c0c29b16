//! Running one cell: its lab (daemon, accelerators, load generator), the faults on schedule,
//! the once-a-second observations and what the tools left behind.

use std::{
    collections::BTreeMap,
    fs,
    net::SocketAddr,
    path::{Path, PathBuf},
    time::{Duration, Instant},
};

use anyhow::{bail, Context, Result};
use serde_json::Value;
use sluice::clock::now_ms;
use sluice_tests::{
    daemon_lab::{wait_for, Accel, DaemonLab, DaemonLabOptions, VipDef},
    netns::{ProcId, TCP_PORT, VIP4},
};

use super::{
    plot,
    results::{backends_json, cell_json, sample, steering, CellFacts, Gathered, Observed},
    scenario::{self, Policy, Scenario},
    stats, Args, Tools, AFFINITY_SECS, REQUEST_LIMIT, STALL, VIP,
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
