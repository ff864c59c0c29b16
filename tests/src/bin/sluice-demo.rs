//! The namespace-lab demo (`cargo xtask demo`), run as an operator would run Sluice: the
//! load balancer in the LB namespace is the real daemon (`sluice run --config`, see
//! `sluice_tests::daemon_lab`), driven through the `sluice` CLI. A client namespace opens
//! OpenAI-style streaming completions (`POST /v1/chat/completions`, server-sent events) to
//! the VIPs (IPv4 and IPv6); the daemon spreads them over three simulated accelerators
//! (gpu0..gpu2: `sluice-accel`, paced by a continuous-batching model, each serving its own
//! dcgm/vLLM/RoCE telemetry, which the daemon scrapes); the tokens come straight back from
//! the accelerators (DSR). At a third of the run gpu0 is drained (`sluice backend drain`), at
//! two thirds gpu1 is throttled to 0.4x (through its control listener, not through Sluice)
//! and the policy moves it away for new sessions. A live view shows each stream, each
//! backend as the client (time to first token, tokens/s) and the daemon see it, and the
//! daemon's events; the summary says how many streams completed and broke, the p99 time to
//! first token, and where new sessions went after each event. Everything is removed at the
//! end, also on Ctrl-C or failure.
//!
//! `sluice-demo [--seconds N] [--streams N] [--accel PATH]` (as root).

use std::{
    collections::{BTreeMap, HashSet},
    io::Write,
    net::SocketAddr,
    path::PathBuf,
    process::ExitCode,
    sync::{
        atomic::{AtomicBool, AtomicUsize, Ordering},
        Arc, Mutex,
    },
    thread,
    time::{Duration, Instant},
};

use anyhow::{bail, Context, Result};
use serde_json::Value;
use sluice_tests::{
    daemon_lab::{Accel, DaemonLab, DaemonLabOptions, VipDef, PREFIX},
    netns::{
        lab_namespaces, Netns, TopologySpec, BRIDGE, DEV, GATEWAY_V4, GATEWAY_V6, NS_PREFIX,
        TCP_PORT, VIP4, VIP6, VIP_NET_V4, VIP_NET_V6,
    },
    openai::{ChatStream, Event},
};

static STOP: AtomicBool = AtomicBool::new(false);
/// 0: before the drain, 1: after draining gpu0, 2: after gpu1's throttling.
static PHASE: AtomicUsize = AtomicUsize::new(0);
const PHASES: [&str; 3] = [
    "before any action",
    "after draining gpu0",
    "after throttling gpu1",
];
/// The daemon's VIPs: (name, address).
const VIPS: [(&str, bool); 2] = [("chat", false), ("chat6", true)];
const BACKENDS: [&str; 3] = ["gpu0", "gpu1", "gpu2"];

extern "C" fn on_signal(_: libc::c_int) {
    STOP.store(true, Ordering::SeqCst);
}

fn vip_addr(v6: bool) -> SocketAddr {
    if v6 {
        SocketAddr::new(VIP6.into(), TCP_PORT)
    } else {
        SocketAddr::new(VIP4.into(), TCP_PORT)
    }
}

struct Opts {
    seconds: u64,
    streams: usize,
    accel: PathBuf,
}

fn parse_args() -> Result<Opts> {
    let mut o = Opts {
        seconds: 20,
        streams: 12,
        accel: std::env::current_exe()
            .context("locating this executable")?
            .with_file_name("sluice-accel"),
    };
    let mut args = std::env::args().skip(1);
    while let Some(a) = args.next() {
        let mut val = |what: &str| args.next().with_context(|| format!("{a} needs {what}"));
        match a.as_str() {
            "--seconds" => o.seconds = val("a number of seconds")?.parse()?,
            "--streams" => o.streams = val("a number of streams")?.parse()?,
            "--accel" => o.accel = val("a path")?.into(),
            "-h" | "--help" => {
                println!(
                    "usage: sluice-demo [--seconds N (default 20)] [--streams N (default 12)] \
                     [--accel PATH (the sluice-accel binary)]"
                );
                std::process::exit(0);
            }
            _ => bail!("unknown argument {a:?} (see --help)"),
        }
    }
    if !(1..=3600).contains(&o.seconds) {
        bail!("--seconds must be 1 to 3600");
    }
    if !(1..=64).contains(&o.streams) {
        bail!("--streams must be 1 to 64");
    }
    Ok(o)
}

/// What the live view shows of one stream slot (a slot runs streams back to back).
#[derive(Clone, Default)]
struct Slot {
    vip: Option<SocketAddr>,
    stream_no: u32,
    backend: String,
    received: u32,
    expected: u32,
    ttft_ms: Option<f64>,
    state: &'static str,
    completed: u32,
    errors: u32,
    last_error: Option<String>,
}

#[derive(Default)]
struct Shared {
    slots: Vec<Slot>,
    /// Per backend: (streams opened, tokens received by the client).
    by_backend: BTreeMap<String, (u64, u64)>,
    /// Per backend: time to first token of each stream, ms.
    ttfts: BTreeMap<String, Vec<f64>>,
    /// New sessions per backend in each phase.
    by_phase: [BTreeMap<String, u64>; 3],
    /// Time to first token of the streams started in each phase, ms.
    phase_ttfts: [Vec<f64>; 3],
}

/// Nearest-rank 99th percentile, ms; `None` for no sample.
fn p99(v: &[f64]) -> Option<f64> {
    let mut s = v.to_vec();
    s.sort_by(f64::total_cmp);
    let rank = (s.len() as f64 * 0.99).ceil() as usize;
    s.get(rank.max(1) - 1).copied()
}

fn ms(v: Option<f64>) -> String {
    v.map_or("-".into(), |v| format!("{v:.0} ms"))
}

fn main() -> ExitCode {
    let opts = match parse_args() {
        Ok(o) => o,
        Err(e) => {
            eprintln!("sluice-demo: {e:#}");
            return ExitCode::from(2);
        }
    };
    for sig in [libc::SIGINT, libc::SIGTERM, libc::SIGHUP] {
        unsafe { libc::signal(sig, on_signal as *const () as libc::sighandler_t) };
    }
    let result = run(&opts);
    // The lab was dropped inside run(), on success, error or panic alike.
    let ours = format!("{NS_PREFIX}{}-", std::process::id());
    let mut left: Vec<String> = lab_namespaces()
        .into_iter()
        .filter(|n| n.starts_with(&ours))
        .collect();
    let pins = format!("{PREFIX}{}-", std::process::id());
    for root in [PathBuf::from("/sys/fs/bpf"), std::env::temp_dir()] {
        for e in std::fs::read_dir(&root).into_iter().flatten().flatten() {
            if e.file_name().to_string_lossy().starts_with(&pins) {
                left.push(e.path().display().to_string());
            }
        }
    }
    if left.is_empty() {
        println!(
            "cleaned up: the daemon, every namespace, veth, bridge, server, pin and temporary \
             directory of the demo is gone"
        );
    } else {
        println!("WARNING: left behind: {}", left.join(" "));
    }
    match result {
        Ok(true) => ExitCode::SUCCESS,
        Ok(false) => ExitCode::FAILURE,
        Err(e) => {
            eprintln!("sluice-demo: {e:#}");
            ExitCode::FAILURE
        }
    }
}

/// `sluice --json <args>` on the lab's daemon; an error (never a panic) when it fails.
fn cli_json(lab: &DaemonLab, args: &[&str]) -> Result<Value> {
    let mut all = vec!["--json"];
    all.extend_from_slice(args);
    let out = lab.cli_output(&all)?;
    if !out.status.success() {
        bail!(
            "`sluice {}` failed: {}{}",
            all.join(" "),
            out.stderr,
            out.stdout
        );
    }
    serde_json::from_str(&out.stdout).with_context(|| format!("`sluice {}`", all.join(" ")))
}

/// The daemon's view: per VIP, per backend name, its `sluice backend list --json` entry.
type DaemonView = BTreeMap<&'static str, BTreeMap<String, Value>>;

fn daemon_view(lab: &DaemonLab) -> DaemonView {
    let mut out = DaemonView::new();
    for (vip, _) in VIPS {
        let Ok(v) = cli_json(lab, &["backend", "list", vip]) else {
            continue;
        };
        let m = out.entry(vip).or_default();
        for b in v["backends"].as_array().into_iter().flatten() {
            let name = b["address"]
                .as_str()
                .and_then(|a| a.parse().ok())
                .and_then(|a| lab.backend_name(a))
                .unwrap_or_else(|| b["address"].to_string());
            m.insert(name, b.clone());
        }
    }
    out
}

/// Prints (unless `quiet`) and logs the daemon's events not seen yet.
fn poll_events(
    lab: &DaemonLab,
    seen: &mut HashSet<String>,
    log: &mut Vec<String>,
    t: Duration,
    quiet: bool,
) {
    let Ok(v) = cli_json(lab, &["events"]) else {
        return;
    };
    for e in v["events"].as_array().into_iter().flatten() {
        if !seen.insert(e.to_string()) {
            continue;
        }
        let backend = e["backend"]
            .as_str()
            .and_then(|a| a.parse().ok())
            .and_then(|a| lab.backend_name(a))
            .unwrap_or_else(|| e["backend"].as_str().unwrap_or("-").to_string());
        let line = format!(
            "t={:>5.1} s  event {:<15} vip {:<6} backend {:<5} {}",
            t.as_secs_f64(),
            e["kind"].as_str().unwrap_or("?"),
            e["vip"].as_str().unwrap_or("-"),
            backend,
            e["reason"].as_str().unwrap_or("")
        );
        if !quiet {
            println!("{line}");
        }
        log.push(line);
    }
}

/// Waits (10 s at most) until the daemon has every backend of every VIP in rotation with
/// fresh telemetry.
fn wait_settled(lab: &DaemonLab) -> bool {
    let deadline = Instant::now() + Duration::from_secs(10);
    while Instant::now() < deadline && !STOP.load(Ordering::SeqCst) {
        let view = daemon_view(lab);
        let ok = VIPS.iter().all(|(vip, _)| {
            view.get(vip).is_some_and(|m| {
                m.len() == BACKENDS.len()
                    && m.values().all(|b| {
                        b["steering"]["state"] == "active"
                            && b["steering"]["telemetry_age_s"].is_f64()
                    })
            })
        });
        if ok {
            return true;
        }
        thread::sleep(Duration::from_millis(200));
    }
    false
}

/// Runs the demo; Ok(false) when some stream failed.
fn run(opts: &Opts) -> Result<bool> {
    let lab = start_lab(opts)?;
    if STOP.load(Ordering::SeqCst) {
        println!("interrupted");
        return Ok(true);
    }
    if !wait_settled(&lab) {
        println!("(the daemon had not seen every backend's telemetry within 10 s)");
    }
    let tty = unsafe { libc::isatty(1) } == 1;
    let mut seen = HashSet::new();
    let mut events = Vec::new();
    poll_events(&lab, &mut seen, &mut events, Duration::ZERO, tty);

    let start = Instant::now();
    let deadline = start + Duration::from_secs(opts.seconds);
    let shared = Arc::new(Mutex::new(Shared {
        slots: vec![Slot::default(); opts.streams],
        ..Default::default()
    }));
    let actions = live(&lab, opts, &shared, start, &mut seen, &mut events, tty)?;
    poll_events(&lab, &mut seen, &mut events, start.elapsed(), tty);

    let s = shared.lock().unwrap();
    let interrupted = STOP.load(Ordering::SeqCst) && Instant::now() < deadline;
    let ok = print_summary(&s, &actions, &events, interrupted);
    drop(s);
    println!("\nstopping the daemon and tearing the lab down...");
    drop(lab);
    Ok(ok)
}

/// Starts the daemon lab with the simulated accelerators and prints its topology.
fn start_lab(opts: &Opts) -> Result<DaemonLab> {
    if !opts.accel.is_file() {
        bail!(
            "the simulated accelerator {} is missing: build the workspace (`cargo xtask build`)",
            opts.accel.display()
        );
    }
    println!(
        "Sluice daemon demo: {} OpenAI-style token streams for {} s through `sluice run` (XDP) \
         to 3 simulated accelerators; gpu0 is drained at {:.0} s, gpu1 throttled at {:.0} s\n",
        opts.streams,
        opts.seconds,
        opts.seconds as f64 / 3.0,
        opts.seconds as f64 * 2.0 / 3.0
    );
    let t0 = Instant::now();
    let vips = VIPS
        .iter()
        .map(|&(name, v6)| {
            let mut v = VipDef::tcp(name, vip_addr(v6), BACKENDS.len());
            v.telemetry = true;
            v
        })
        .collect();
    let mut lo = DaemonLabOptions::new(&opts.accel, BACKENDS.len(), vips);
    lo.topology = TopologySpec {
        backends: BACKENDS.iter().map(|b| b.to_string()).collect(),
        ..TopologySpec::default()
    };
    lo.accel = Some(Accel {
        binary: opts.accel.clone(),
        args: Vec::new(),
    });
    let lab = DaemonLab::start(lo).context("starting the daemon lab")?;
    print_topology(&lab, t0.elapsed());
    Ok(lab)
}

/// The run itself: the stream slots from `start` until every one has ended, the drain and
/// the throttle on schedule, the daemon's events and the live view; returns the actions
/// taken, as shown.
fn live(
    lab: &DaemonLab,
    opts: &Opts,
    shared: &Arc<Mutex<Shared>>,
    start: Instant,
    seen: &mut HashSet<String>,
    events: &mut Vec<String>,
    tty: bool,
) -> Result<Vec<String>> {
    let deadline = start + Duration::from_secs(opts.seconds);
    let handles: Vec<_> = (0..opts.streams)
        .map(|k| {
            let client = lab.topo.client.ns.clone();
            let shared = shared.clone();
            thread::spawn(move || slot_loop(k, &client, deadline, &shared))
        })
        .collect();

    let frame_every = if tty {
        Duration::from_secs(1)
    } else {
        Duration::from_secs(4)
    };
    let drain_at = start + Duration::from_secs(opts.seconds) / 3;
    let congest_at = start + Duration::from_secs(opts.seconds) * 2 / 3;
    let hard_end = deadline + Duration::from_secs(10);
    let mut next_frame = start;
    let mut next_events = start;
    let mut actions: Vec<String> = Vec::new();
    // Client-side tokens per backend at the last frame, for the tokens/s column.
    let mut last_tokens: (Instant, BTreeMap<String, u64>) = (start, BTreeMap::new());
    loop {
        let now = Instant::now();
        let t = start.elapsed();
        if PHASE.load(Ordering::SeqCst) == 0 && now >= drain_at {
            for line in drain_gpu0(lab, t) {
                if !tty {
                    println!("{line}");
                }
                actions.push(line);
            }
            PHASE.store(1, Ordering::SeqCst);
        }
        if PHASE.load(Ordering::SeqCst) == 1 && now >= congest_at {
            let line = throttle_gpu1(lab, t);
            if !tty {
                println!("{line}");
            }
            actions.push(line);
            PHASE.store(2, Ordering::SeqCst);
        }
        if now >= next_events {
            poll_events(lab, seen, events, t, tty);
            next_events = now + Duration::from_millis(500);
        }
        let done = handles.iter().all(|h| h.is_finished());
        if done || now >= next_frame {
            let view = daemon_view(lab);
            let rates = token_rates(shared, &mut last_tokens);
            let text = render(
                lab,
                shared,
                &view,
                &rates,
                &actions,
                events,
                t,
                opts.seconds,
                tty,
            )?;
            if tty {
                print!("\x1b[2J\x1b[H");
            }
            println!("{text}");
            let _ = std::io::stdout().flush();
            next_frame += frame_every;
        }
        if done {
            break;
        }
        if now >= hard_end {
            // Streams are sized to end by the deadline: this is a stuck one.
            STOP.store(true, Ordering::SeqCst);
        }
        thread::sleep(Duration::from_millis(100));
    }
    for h in handles {
        let _ = h.join();
    }
    Ok(actions)
}

/// Drains gpu0 from every VIP through the CLI, `t` into the run; one action line per VIP.
fn drain_gpu0(lab: &DaemonLab, t: Duration) -> Vec<String> {
    let gpu0 = &lab.topo.backends[0];
    let mut lines = Vec::new();
    for (vip, v6) in VIPS {
        let addr = gpu0.addr(v6).to_string();
        let line = match lab.cli_output(&["backend", "drain", vip, &addr]) {
            Ok(o) if o.status.success() => o.stdout.trim().to_string(),
            Ok(o) => format!("failed: {}{}", o.stderr.trim(), o.stdout.trim()),
            Err(e) => format!("failed: {e:#}"),
        };
        lines.push(format!(
            "t={:>5.1} s  $ sluice backend drain {vip} {addr}  ->  {line}",
            t.as_secs_f64()
        ));
    }
    lines
}

/// Throttles gpu1 to 0.4x through its control listener, `t` into the run; the action line.
fn throttle_gpu1(lab: &DaemonLab, t: Duration) -> String {
    let fault = serde_json::json!({"kind": "throttle", "factor": 0.4});
    let line = match lab.accel_request(1, "POST", "/fault", Some(&fault)) {
        Ok((200, _)) => "gpu1 throttled to 0.4x (its DCGM page now sets clock-throttle \
                         reasons; POST /fault on its control listener)"
            .to_string(),
        Ok((code, body)) => format!("gpu1 refused the fault: {code} {body}"),
        Err(e) => format!("could not throttle gpu1: {e:#}"),
    };
    format!("t={:>5.1} s  {line}", t.as_secs_f64())
}

/// Prints the actions, the daemon's events and the summary of the streams; true when none
/// broke.
fn print_summary(s: &Shared, actions: &[String], events: &[String], interrupted: bool) -> bool {
    let completed: u32 = s.slots.iter().map(|x| x.completed).sum();
    let errors: u32 = s.slots.iter().map(|x| x.errors).sum();
    let tokens: u64 = s.by_backend.values().map(|v| v.1).sum();
    println!("actions:");
    for a in actions {
        println!("  {a}");
    }
    println!("the daemon's events during the run:");
    for e in events {
        println!("  {e}");
    }
    let all: Vec<f64> = s.ttfts.values().flatten().copied().collect();
    println!(
        "\n{}: {completed} streams completed, {errors} broken, {tokens} tokens; p99 time to \
         first token {}",
        if interrupted {
            "INTERRUPTED"
        } else {
            "SUMMARY"
        },
        ms(p99(&all))
    );
    for (b, (streams, toks)) in &s.by_backend {
        let t = s.ttfts.get(b).map(|v| p99(v)).unwrap_or_default();
        println!(
            "  {b}: {streams} streams, {toks} tokens, p99 TTFT {}",
            ms(t)
        );
    }
    println!("where new sessions went:");
    for (i, what) in PHASES.iter().enumerate() {
        let m = &s.by_phase[i];
        let list: Vec<String> = BACKENDS
            .iter()
            .map(|b| format!("{b} {:>3}", m.get(*b).copied().unwrap_or(0)))
            .collect();
        println!(
            "  {what:<22} {}   p99 TTFT {}",
            list.join(", "),
            ms(p99(&s.phase_ttfts[i]))
        );
    }
    for (i, x) in s.slots.iter().enumerate() {
        if let Some(e) = &x.last_error {
            println!("  stream slot {}: last error: {e}", i + 1);
        }
    }
    errors == 0
}

fn print_topology(lab: &DaemonLab, took: Duration) {
    let t = &lab.topo;
    println!(
        "lab {} ({}) built in {:.1} s:",
        t.id,
        lab.id,
        took.as_secs_f64()
    );
    println!(
        "  {:<7} {:<18} {:<13} {:<15} role",
        "host", "namespace", "IPv4", "IPv6"
    );
    println!(
        "  {:<7} {:<18} {:<13} {:<15} routes {VIP_NET_V4} and {VIP_NET_V6} via the LB",
        "client",
        t.client.ns.name(),
        t.client.v4,
        t.client.v6
    );
    println!(
        "  {:<7} {:<18} {:<13} {:<15} `sluice run` (pid {}): native XDP on {DEV}, admin \
         socket {}",
        "lb",
        t.lb.ns.name(),
        t.lb.v4,
        t.lb.v6,
        lab.daemon_pid().unwrap_or(0),
        lab.socket.display()
    );
    for b in &t.backends {
        println!(
            "  {:<7} {:<18} {:<13} {:<15} sluice backend-host (decap on {DEV}, VIPs on lo), sluice-accel \
             (OpenAI API, /dcgm /metrics /roce on :{TCP_PORT})",
            b.name,
            b.ns.name(),
            b.v4,
            b.v6
        );
    }
    println!(
        "  {:<7} {:<18} {:<13} {:<15} bridge {BRIDGE} (router, fallback next hop); \
         sluice_pass on {}",
        "switch",
        t.switch.name(),
        GATEWAY_V4,
        GATEWAY_V6,
        t.lb.port
    );
    println!(
        "  VIPs: chat {VIP4}:{TCP_PORT}/tcp and chat6 [{VIP6}]:{TCP_PORT}/tcp over the 3 \
         accelerators, dcgm/vLLM/RoCE telemetry scraped every 250 ms; replies return \
         directly (DSR)\n"
    );
}

/// Runs streams back to back in slot `k` until the deadline (or a signal).
fn slot_loop(k: usize, client: &Netns, deadline: Instant, shared: &Mutex<Shared>) {
    // Two thirds IPv4, one third IPv6.
    let vip = if k % 3 == 2 {
        SocketAddr::new(VIP6.into(), TCP_PORT)
    } else {
        SocketAddr::new(VIP4.into(), TCP_PORT)
    };
    let set = |f: &mut dyn FnMut(&mut Slot)| f(&mut shared.lock().unwrap().slots[k]);
    set(&mut |s| {
        s.vip = Some(vip);
        s.state = "starting";
    });
    let mut n: u32 = 0;
    // Bounded in count as well as by the deadline (retries after errors wait 0.5 s).
    for _ in 0..10_000 {
        if STOP.load(Ordering::SeqCst) {
            set(&mut |s| s.state = "stopped");
            return;
        }
        let left = deadline.saturating_duration_since(Instant::now());
        if left < Duration::from_millis(1500) {
            set(&mut |s| s.state = "finished");
            return;
        }
        n += 1;
        // A mix of prompt (100 to 1500 tokens) and answer lengths (40 to 200 tokens: 1 to 5 s
        // at the accelerator's pace), fewer tokens when the deadline is near.
        let prompt = 100 + (k as u32 * 337 + n * 211) % 1400;
        let tokens = 40 + (k as u32 * 53 + n * 37) % 161;
        let tokens = tokens.min((left.as_millis() as u32 / 40).max(5));
        set(&mut |s| {
            s.stream_no = n;
            s.state = "connecting";
            s.backend.clear();
            s.received = 0;
            s.expected = tokens;
            s.ttft_ms = None;
        });
        match run_stream(k, client, vip, prompt, tokens, deadline, shared) {
            Ok(()) => set(&mut |s| {
                s.completed += 1;
                s.state = "done";
            }),
            Err(e) => {
                if STOP.load(Ordering::SeqCst) {
                    set(&mut |s| s.state = "stopped");
                    return;
                }
                set(&mut |s| {
                    s.errors += 1;
                    s.state = "FAILED";
                    s.last_error = Some(format!("{e:#}"));
                });
                thread::sleep(Duration::from_millis(500));
            }
        }
    }
}

fn run_stream(
    k: usize,
    client: &Netns,
    vip: SocketAddr,
    prompt: u32,
    tokens: u32,
    deadline: Instant,
    shared: &Mutex<Shared>,
) -> Result<()> {
    let mut st = ChatStream::open(client, vip, prompt, tokens, Duration::from_secs(10))?;
    let phase = PHASE.load(Ordering::SeqCst).min(2);
    {
        let mut s = shared.lock().unwrap();
        s.slots[k].backend = st.backend.clone();
        s.slots[k].state = "waiting";
        s.by_backend.entry(st.backend.clone()).or_default().0 += 1;
        *s.by_phase[phase].entry(st.backend.clone()).or_default() += 1;
    }
    let hard = deadline + Duration::from_secs(10);
    loop {
        if STOP.load(Ordering::SeqCst) {
            bail!("stopped");
        }
        if Instant::now() >= hard {
            bail!(
                "stream did not finish in time ({} of {tokens} tokens)",
                st.tokens
            );
        }
        match st.next_event()? {
            Event::Token => {
                let mut s = shared.lock().unwrap();
                if st.tokens == 1 {
                    let ttft = st.ttft.unwrap_or_default().as_secs_f64() * 1e3;
                    s.slots[k].ttft_ms = Some(ttft);
                    s.slots[k].state = "streaming";
                    s.ttfts.entry(st.backend.clone()).or_default().push(ttft);
                    s.phase_ttfts[phase].push(ttft);
                }
                s.slots[k].received = st.tokens;
                s.by_backend.entry(st.backend.clone()).or_default().1 += 1;
            }
            Event::Done => break,
        }
    }
    if st.tokens != tokens {
        bail!("{} of {tokens} tokens before [DONE]", st.tokens);
    }
    Ok(())
}

/// Tokens per second per backend since the last call, as the client received them.
fn token_rates(
    shared: &Mutex<Shared>,
    last: &mut (Instant, BTreeMap<String, u64>),
) -> BTreeMap<String, f64> {
    let now = Instant::now();
    let secs = now.duration_since(last.0).as_secs_f64().max(1e-3);
    let s = shared.lock().unwrap();
    let mut out = BTreeMap::new();
    for (b, (_, toks)) in &s.by_backend {
        let before = last.1.insert(b.clone(), *toks).unwrap_or(0);
        out.insert(b.clone(), (toks - before) as f64 / secs);
    }
    last.0 = now;
    out
}

/// One VIP's entry for a backend in the daemon's view: state, steering state (reason),
/// effective weight, active flows.
fn daemon_cell(b: Option<&Value>) -> String {
    let Some(b) = b else {
        return "(removed)".into();
    };
    let st = &b["steering"];
    let reason = st["reason"].as_str().filter(|r| !r.is_empty());
    format!(
        "{}, {}{} w={} flows={}",
        b["state"].as_str().unwrap_or("?"),
        st["state"].as_str().unwrap_or("?"),
        reason.map(|r| format!(" ({r})")).unwrap_or_default(),
        b["effective_weight"],
        b["active_flows"]
    )
}

#[allow(clippy::too_many_arguments)]
fn render(
    lab: &DaemonLab,
    shared: &Mutex<Shared>,
    view: &DaemonView,
    rates: &BTreeMap<String, f64>,
    actions: &[String],
    events: &[String],
    elapsed: Duration,
    total: u64,
    tty: bool,
) -> Result<String> {
    use std::fmt::Write as _;
    let mut o = String::new();
    let s = shared.lock().unwrap();
    writeln!(
        o,
        "── Sluice daemon lab {} ── t = {:>4.1} s of {total} s ── {} ── Ctrl-C stops and \
         cleans up ──",
        lab.topo.id,
        elapsed.as_secs_f64(),
        PHASES[PHASE.load(Ordering::SeqCst).min(2)]
    )?;
    writeln!(
        o,
        "{:>4}  {:<24} {:<7} {:>5} {:>13}  {:>8} {:>6}  state",
        "slot", "VIP", "backend", "no.", "tokens", "TTFT", "done"
    )?;
    for (i, x) in s.slots.iter().enumerate() {
        let vip = x.vip.map(|v| v.to_string()).unwrap_or_default();
        let backend = if x.backend.is_empty() {
            "-"
        } else {
            x.backend.as_str()
        };
        let failed = if x.errors > 0 {
            format!(" ({} failed)", x.errors)
        } else {
            String::new()
        };
        writeln!(
            o,
            "{:>4}  {:<24} {:<7} {:>5} {:>6}/{:<6}  {:>8} {:>6}  {}{failed}",
            i + 1,
            vip,
            backend,
            x.stream_no,
            x.received,
            x.expected,
            ms(x.ttft_ms),
            x.completed,
            x.state,
        )?;
    }
    writeln!(o)?;
    writeln!(
        o,
        "{:<7} {:>7} {:>7} {:>6} {:>9}  {:<46} daemon: chat6 (v6)",
        "backend", "streams", "tokens", "tok/s", "TTFT p99", "daemon: chat (v4)"
    )?;
    for name in BACKENDS {
        let (streams, toks) = s.by_backend.get(name).copied().unwrap_or_default();
        let rate = rates.get(name).copied().unwrap_or(0.0);
        let ttft = s.ttfts.get(name).map(|v| p99(v)).unwrap_or_default();
        let cells: Vec<String> = VIPS
            .iter()
            .map(|(vip, _)| daemon_cell(view.get(vip).and_then(|m| m.get(name))))
            .collect();
        writeln!(
            o,
            "{:<7} {:>7} {:>7} {:>6.0} {:>9}  {:<46} {}",
            name,
            streams,
            toks,
            rate,
            ms(ttft),
            cells[0],
            cells[1]
        )?;
    }
    writeln!(
        o,
        "(streams, tokens, tokens/s and p99 time to first token as the client saw them; \
         daemon: `sluice backend list --json`: state, steering state (reason), effective \
         weight, active flows)"
    )?;
    if tty {
        writeln!(o)?;
        for a in actions {
            writeln!(o, "{a}")?;
        }
        writeln!(o, "the daemon's latest events:")?;
        for e in &events[events.len().saturating_sub(8)..] {
            writeln!(o, "  {e}")?;
        }
    }
    Ok(o)
}
