//! `sluice-bench reads`: how long the operator's reads take with a full connection table. In
//! the namespace lab with the real daemon, the pinned connection table is filled with
//! `--entries` live flows (default 1,000,000, spread over the VIP's backends); then the bench
//! times `sluice backend list` (the CLI process, end to end), `/metrics` scrapes, and the
//! daemon's own report of its policy step (`sluice_policy_step_duration_seconds`), and
//! measures the daemon's CPU use over `--cpu-secs` seconds of one scrape per second.

use std::{
    io::{Read, Write},
    net::{Ipv4Addr, SocketAddr, TcpStream},
    path::PathBuf,
    thread,
    time::{Duration, Instant},
};

use anyhow::{anyhow, bail, Context, Result};
use aya::maps::{HashMap, Map, MapData};
use lb_common::{maps, ConnEntry, FlowKey, FAMILY_V4, PROTO_TCP};
use serde_json::json;
use sluice::clock::monotonic_ns;
use sluice_tests::{
    daemon_lab::{wait_for, DaemonLab, DaemonLabOptions, VipDef},
    netns::{TCP_PORT, VIP4},
};

use crate::{out, summary::Summary, sys};

const VIP: &str = "chat";
const BACKENDS: usize = 3;
const ROUNDS: usize = 10;

/// `sluice-bench reads --help`.
#[derive(clap::Parser, Debug)]
#[command(
    name = "sluice-bench reads",
    about = "`sluice backend list`, a /metrics scrape and a policy step with a full connection \
             table, and the daemon's CPU use at one scrape per second"
)]
struct Args {
    /// Connection-table entries to fill.
    #[arg(long, default_value_t = 1_000_000)]
    entries: u32,
    /// Seconds of the CPU measurement at one scrape per second.
    #[arg(long = "cpu-secs", default_value_t = 30)]
    cpu_secs: u64,
    /// JSON results (default target/bench/reads.json).
    #[arg(long)]
    out: Option<PathBuf>,
    #[arg(long, help = out::RECORD_HELP)]
    record: bool,
}

pub fn main(args: &[String]) -> Result<()> {
    let Some(a) = crate::cli_args::<Args>("sluice-bench reads", args)? else {
        return Ok(());
    };
    let out_path = a
        .out
        .clone()
        .unwrap_or_else(|| out::default_path(a.record, "reads.json"));
    sys::require_root()?;
    sys::catch_interrupts();
    // The revision measured: taken now, before any edit made while the bench runs.
    let (rev, dirty) = sys::git_state();
    let exe = std::env::current_exe()?;
    let server: PathBuf = exe.with_file_name("sluice-testsrv");
    if !server.is_file() {
        bail!(
            "{} is missing: build the workspace in release mode",
            server.display()
        );
    }
    let vip = VipDef::tcp(VIP, SocketAddr::new(VIP4.into(), TCP_PORT), BACKENDS);
    let mut opts = DaemonLabOptions::new(&server, BACKENDS, vec![vip]);
    // Per-CPU LRU lists: each CPU owns capacity / CPUs entries, so leave room on each.
    let capacity = (u64::from(a.entries) * 2).next_power_of_two();
    opts.set("dataplane", "conn_table_size", &capacity.to_string())
        .set("dataplane", "flow_idle_timeout", "\"1h\"");
    let lab = DaemonLab::start(opts).context("starting the daemon lab")?;
    let ids: Vec<u32> = lab
        .backends(VIP)
        .iter()
        .map(|b| b["id"].as_u64().map(|i| i as u32))
        .collect::<Option<_>>()
        .ok_or_else(|| anyhow!("backend list without ids"))?;
    let t = Instant::now();
    fill(&lab, &ids, a.entries)?;
    sys::interrupted()?;
    println!(
        "filled the connection table with {} entries in {:.1} s",
        a.entries,
        t.elapsed().as_secs_f64()
    );
    // Every reader must see the whole table before it is timed (a cached count may lag).
    let counted = wait_for(
        "the active-flow count to reach the fill",
        Duration::from_secs(120),
        || {
            let n: u64 = lab
                .backends(VIP)
                .iter()
                .filter_map(|b| b["active_flows"].as_u64())
                .sum();
            Ok((n >= u64::from(a.entries)).then_some(n))
        },
    )?;
    sys::interrupted()?;
    println!("daemon counts {counted} active flows");

    let mut list_ms = vec![];
    let mut scrape_ms = vec![];
    for _ in 0..ROUNDS {
        sys::interrupted()?;
        let t = Instant::now();
        lab.cli_ok(&["backend", "list", VIP]);
        list_ms.push(t.elapsed().as_secs_f64() * 1e3);
        let t = Instant::now();
        let page = scrape(&lab)?;
        scrape_ms.push(t.elapsed().as_secs_f64() * 1e3);
        if !page.contains("sluice_backend_active_flows") {
            bail!("the metrics page has no sluice_backend_active_flows");
        }
    }

    // CPU over a window of one scrape per second; the policy step's own timing is read from
    // each scrape.
    let pid = lab
        .daemon_pid()
        .ok_or_else(|| anyhow!("the daemon is not running"))?;
    let (cpu0, t0) = (cpu_ticks(pid)?, Instant::now());
    let mut step_ms = vec![];
    let mut walk_ms = vec![];
    for s in 0..a.cpu_secs {
        sys::interrupted()?;
        let page = scrape(&lab)?;
        if let Some(v) = metric(&page, "sluice_policy_step_duration_seconds") {
            step_ms.push(v * 1e3);
        }
        // The background count's own cost (absent in builds without the walker).
        if let Some(v) = metric(&page, "sluice_active_flows_walk_duration_seconds") {
            walk_ms.push(v * 1e3);
        }
        let next = t0 + Duration::from_secs(s + 1);
        thread::sleep(next.saturating_duration_since(Instant::now()));
    }
    let ticks = cpu_ticks(pid)? - cpu0;
    let hz = unsafe { libc::sysconf(libc::_SC_CLK_TCK) } as f64;
    let cpu_pct = ticks as f64 / hz / t0.elapsed().as_secs_f64() * 100.0;

    let (l, s, p, w) = (
        Summary::of(&list_ms),
        Summary::of(&scrape_ms),
        Summary::of(&step_ms),
        Summary::of(&walk_ms),
    );
    println!(
        "{} entries: backend list median {:.1} ms [{:.1} {:.1}]; /metrics median {:.1} ms \
         [{:.1} {:.1}]; policy step median {:.1} ms [{:.1} {:.1}]; daemon CPU {cpu_pct:.1}% \
         of a core at one scrape per second; background walk median {:.1} ms",
        a.entries, l.median, l.min, l.p90, s.median, s.min, s.p90, p.median, p.min, p.p90, w.median
    );
    let doc = json!({
        "benchmark": "reads",
        "command_line": std::env::args().collect::<Vec<_>>().join(" "),
        "date_utc": sys::utc_now(),
        "git_revision": rev,
        "git_dirty": dirty,
        "kernel": sys::kernel_release(),
        "cpu_model": sys::cpu_model(),
        "online_cpus": sys::online_cpus(),
        "entries": a.entries,
        "conn_table_size": capacity,
        "counted_active_flows": counted,
        "backend_list_ms": {"median": l.median, "min": l.min, "p90": l.p90, "samples": list_ms},
        "metrics_scrape_ms": {"median": s.median, "min": s.min, "p90": s.p90, "samples": scrape_ms},
        "policy_step_ms": {"median": p.median, "min": p.min, "p90": p.p90, "samples": step_ms},
        "active_flows_walk_ms": {"median": w.median, "min": w.min, "p90": w.p90, "samples": walk_ms},
        "daemon_cpu_percent_of_a_core": cpu_pct,
        "cpu_window_s": a.cpu_secs,
        "note": "backend list is the CLI process end to end (start, socket, table); the \
                 policy step is the daemon's own measure of its drain check and policy step",
    });
    out::write_json(&out_path, &doc)
}

/// Inserts `n` distinct TCP flows to the VIP, round-robin over `ids`, one thread per CPU (an
/// LRU map without a common list takes an insert from the inserting CPU's share).
fn fill(lab: &DaemonLab, ids: &[u32], n: u32) -> Result<()> {
    let path = lab.bpffs.join(maps::CONNS);
    let cpus = sys::online_cpus() as u32;
    let now = monotonic_ns();
    let vip = u32::from_ne_bytes(VIP4.octets());
    thread::scope(|s| {
        let workers: Vec<_> = (0..cpus)
            .map(|cpu| {
                let path = path.clone();
                s.spawn(move || -> Result<()> {
                    sys::pin_cpu(cpu as usize)?;
                    let data = MapData::from_pin(&path)
                        .with_context(|| format!("opening {}", path.display()))?;
                    let mut m: HashMap<MapData, FlowKey, ConnEntry> =
                        HashMap::try_from(Map::from_map_data(data)?)?;
                    for (k, i) in (cpu..n).step_by(cpus as usize).enumerate() {
                        if k % 65_536 == 0 {
                            sys::interrupted()?;
                        }
                        // Clients 10.200.0.0/16 with every source port: distinct 5-tuples.
                        let key = FlowKey {
                            src: [
                                u32::from_ne_bytes(
                                    Ipv4Addr::from(0x0ac8_0000 | (i >> 16)).octets(),
                                ),
                                0,
                                0,
                                0,
                            ],
                            dst: [vip, 0, 0, 0],
                            sport: ((i & 0xffff) as u16).to_be(),
                            dport: TCP_PORT.to_be(),
                            proto: PROTO_TCP,
                            family: FAMILY_V4,
                            _pad: [0; 2],
                        };
                        let entry = ConnEntry {
                            backend: ids[i as usize % ids.len()],
                            hash: i,
                            last_seen_ns: now,
                            ..ConnEntry::default()
                        };
                        m.insert(key, entry, 0)
                            .with_context(|| format!("inserting entry {i}"))?;
                    }
                    Ok(())
                })
            })
            .collect();
        workers
            .into_iter()
            .try_for_each(|w| w.join().map_err(|_| anyhow!("a fill thread panicked"))?)
    })
}

/// One `GET /metrics` from inside the LB namespace, where the daemon listens.
fn scrape(lab: &DaemonLab) -> Result<String> {
    let addr = lab.metrics;
    lab.topo.lb.ns.run(move || -> Result<String> {
        let mut s = TcpStream::connect(addr).context("connecting to the metrics endpoint")?;
        s.set_read_timeout(Some(Duration::from_secs(60)))?;
        write!(
            s,
            "GET /metrics HTTP/1.1\r\nHost: {addr}\r\nConnection: close\r\n\r\n"
        )?;
        let mut page = String::new();
        s.read_to_string(&mut page)?;
        if !page.starts_with("HTTP/1.1 200") {
            bail!(
                "metrics answered: {}",
                page.lines().next().unwrap_or_default()
            );
        }
        Ok(page)
    })?
}

fn metric(page: &str, name: &str) -> Option<f64> {
    page.lines()
        .find_map(|l| l.strip_prefix(name)?.strip_prefix(' ')?.trim().parse().ok())
}

/// utime + stime of a process, in clock ticks.
fn cpu_ticks(pid: u32) -> Result<u64> {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat"))?;
    // Fields after the command (which may hold spaces) start after the last ')'.
    let rest = &stat[stat.rfind(')').ok_or_else(|| anyhow!("bad /proc stat"))? + 2..];
    let f: Vec<&str> = rest.split_whitespace().collect();
    Ok(f[11].parse::<u64>()? + f[12].parse::<u64>()?)
}
