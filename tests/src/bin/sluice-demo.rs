//! The namespace-lab demo (`cargo xtask demo`): a client namespace opens LLM-style token
//! streams to the VIPs; Sluice (native XDP in the LB namespace) spreads them over three
//! accelerator backends; the tokens come straight back from the backends (DSR). A live view
//! shows each stream's backend and progress and the data plane's counters; everything is
//! removed at the end, also on Ctrl-C or failure.
//!
//! `sluice-demo [--seconds N] [--streams N] [--server PATH]` (as root).

use std::{
    collections::BTreeMap,
    io::Write,
    net::SocketAddr,
    path::PathBuf,
    process::ExitCode,
    sync::{
        atomic::{AtomicBool, Ordering},
        Arc, Mutex,
    },
    thread,
    time::{Duration, Instant},
};

use anyhow::{bail, Context, Result};
use lb_common::{stat, PROTO_TCP};
use sluice_tests::{
    netns::{
        lab_namespaces, Counters, LabOptions, NetLab, Netns, TopologySpec, BRIDGE, DEV, GATEWAY_V4,
        GATEWAY_V6, NS_PREFIX, TCP_PORT, VIP4, VIP6, VIP_NET_V4, VIP_NET_V6,
    },
    stream::{Event, TokenStream},
};

static STOP: AtomicBool = AtomicBool::new(false);

extern "C" fn on_signal(_: libc::c_int) {
    STOP.store(true, Ordering::SeqCst);
}

struct Opts {
    seconds: u64,
    streams: usize,
    server: PathBuf,
}

fn parse_args() -> Result<Opts> {
    let mut o = Opts {
        seconds: 20,
        streams: 12,
        server: std::env::current_exe()
            .context("locating this executable")?
            .with_file_name("sluice-testsrv"),
    };
    let mut args = std::env::args().skip(1);
    while let Some(a) = args.next() {
        let mut val = |what: &str| args.next().with_context(|| format!("{a} needs {what}"));
        match a.as_str() {
            "--seconds" => o.seconds = val("a number of seconds")?.parse()?,
            "--streams" => o.streams = val("a number of streams")?.parse()?,
            "--server" => o.server = val("a path")?.into(),
            "-h" | "--help" => {
                println!(
                    "usage: sluice-demo [--seconds N (default 20)] [--streams N (default 12)] \
                     [--server PATH]"
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
    rate: u32,
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
    let left: Vec<String> = lab_namespaces()
        .into_iter()
        .filter(|n| n.starts_with(&ours))
        .collect();
    if left.is_empty() {
        println!("cleaned up: every namespace, veth, bridge and server of the demo is gone");
    } else {
        println!("WARNING: namespaces left behind: {}", left.join(" "));
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

/// Runs the demo; Ok(false) when some stream failed.
fn run(opts: &Opts) -> Result<bool> {
    if !opts.server.is_file() {
        bail!(
            "the backend server {} is missing: build the workspace (`cargo xtask build`)",
            opts.server.display()
        );
    }
    println!(
        "Sluice namespace-lab demo: {} token streams for {} s through an XDP load balancer \
         to 3 accelerator backends\n",
        opts.streams, opts.seconds
    );
    let t0 = Instant::now();
    let mut lab = NetLab::start(&LabOptions {
        topology: TopologySpec {
            backends: vec!["gpu0".into(), "gpu1".into(), "gpu2".into()],
        },
        server: Some(opts.server.clone()),
        server_lifetime: Duration::from_secs(opts.seconds + 60),
        ..Default::default()
    })
    .context("building the lab")?;
    print_topology(&lab, t0.elapsed());
    if STOP.load(Ordering::SeqCst) {
        println!("interrupted");
        return Ok(true);
    }

    let start = Instant::now();
    let deadline = start + Duration::from_secs(opts.seconds);
    let shared = Arc::new(Mutex::new(Shared {
        slots: vec![Slot::default(); opts.streams],
        ..Default::default()
    }));
    let before = lab.counters()?;
    let handles: Vec<_> = (0..opts.streams)
        .map(|k| {
            let client = lab.topo.client.ns.clone();
            let shared = shared.clone();
            thread::spawn(move || slot_loop(k, &client, deadline, &shared))
        })
        .collect();

    let tty = unsafe { libc::isatty(1) } == 1;
    let frame_every = if tty {
        Duration::from_secs(1)
    } else {
        Duration::from_secs(4)
    };
    let hard_end = deadline + Duration::from_secs(10);
    let mut next_frame = start;
    loop {
        let done = handles.iter().all(|h| h.is_finished());
        if done || Instant::now() >= next_frame {
            let now = lab.counters()?.since(&before);
            let view = render(&mut lab, &shared, &now, start.elapsed(), opts.seconds)?;
            if tty {
                print!("\x1b[2J\x1b[H");
            }
            println!("{view}");
            let _ = std::io::stdout().flush();
            next_frame += frame_every;
        }
        if done {
            break;
        }
        if Instant::now() >= hard_end {
            // Streams are sized to end by the deadline: this is a stuck one.
            STOP.store(true, Ordering::SeqCst);
        }
        thread::sleep(Duration::from_millis(100));
    }
    for h in handles {
        let _ = h.join();
    }

    let s = shared.lock().unwrap();
    let completed: u32 = s.slots.iter().map(|x| x.completed).sum();
    let errors: u32 = s.slots.iter().map(|x| x.errors).sum();
    let tokens: u64 = s.by_backend.values().map(|v| v.1).sum();
    let interrupted = STOP.load(Ordering::SeqCst) && Instant::now() < deadline;
    println!(
        "{}: {completed} streams completed, {tokens} tokens received, {errors} failed streams",
        if interrupted { "interrupted" } else { "done" }
    );
    for (b, (streams, toks)) in &s.by_backend {
        println!("  {b}: {streams} streams, {toks} tokens");
    }
    for (i, x) in s.slots.iter().enumerate() {
        if let Some(e) = &x.last_error {
            println!("  stream slot {}: last error: {e}", i + 1);
        }
    }
    let ok = errors == 0;
    drop(s);
    println!("\ntearing the lab down...");
    drop(lab);
    Ok(ok)
}

fn print_topology(lab: &NetLab, took: Duration) {
    let t = &lab.topo;
    println!("lab {} built in {:.1} s:", t.id, took.as_secs_f64());
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
        "  {:<7} {:<18} {:<13} {:<15} sluice_xdp, native XDP on {DEV} (XDP_TX back out)",
        "lb",
        t.lb.ns.name(),
        t.lb.v4,
        t.lb.v6
    );
    for b in &t.backends {
        println!(
            "  {:<7} {:<18} {:<13} {:<15} sluice_decap on {DEV}, VIPs on lo, token server",
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
        "  VIPs: {VIP4}:{TCP_PORT}/tcp and [{VIP6}]:{TCP_PORT}/tcp, Maglev over the 3 \
         backends; replies return directly (DSR)\n"
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
        // A mix of generation speeds (10 to 50 tokens/s) and lengths (3 to 8 s), cut to
        // end before the deadline.
        let rate = 10 + ((k as u32 * 7 + n * 13) % 41);
        let secs = 3 + (k as u32 + n * 5) % 6;
        let secs_fit = (left.as_millis() as u64).saturating_sub(800) / 1000;
        let secs = (secs as u64).min(secs_fit.max(1)) as u32;
        let interval = 1000 / rate;
        let tokens = rate * secs;
        set(&mut |s| {
            s.stream_no = n;
            s.state = "connecting";
            s.backend.clear();
            s.received = 0;
            s.expected = tokens;
            s.rate = rate;
        });
        match run_stream(k, client, vip, tokens, interval, deadline, shared) {
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
    tokens: u32,
    interval: u32,
    deadline: Instant,
    shared: &Mutex<Shared>,
) -> Result<()> {
    let mut st = TokenStream::open(client, vip, tokens, interval, Duration::from_secs(2))?;
    {
        let mut s = shared.lock().unwrap();
        s.slots[k].backend = st.backend.clone();
        s.slots[k].state = "streaming";
        s.by_backend.entry(st.backend.clone()).or_default().0 += 1;
    }
    let hard = deadline + Duration::from_secs(5);
    loop {
        if STOP.load(Ordering::SeqCst) {
            st.close();
            bail!("stopped");
        }
        if Instant::now() >= hard {
            bail!(
                "stream did not finish in time ({} of {tokens} tokens)",
                st.received
            );
        }
        match st.next_event()? {
            Event::Token { backend, .. } => {
                if backend != st.backend {
                    bail!("token from {backend} in a stream served by {}", st.backend);
                }
                let mut s = shared.lock().unwrap();
                s.slots[k].received = st.received;
                s.by_backend.entry(st.backend.clone()).or_default().1 += 1;
            }
            Event::Done => break,
        }
    }
    if st.received != st.expected {
        bail!("{} of {} tokens before [DONE]", st.received, st.expected);
    }
    st.close();
    Ok(())
}

fn render(
    lab: &mut NetLab,
    shared: &Mutex<Shared>,
    d: &Counters,
    elapsed: Duration,
    total: u64,
) -> Result<String> {
    use std::fmt::Write as _;
    let mut o = String::new();
    let s = shared.lock().unwrap();
    writeln!(
        o,
        "── Sluice lab {} ── t = {:>4.1} s of {total} s ── Ctrl-C stops and cleans up ──",
        lab.topo.id,
        elapsed.as_secs_f64()
    )?;
    writeln!(
        o,
        "{:>4}  {:<24} {:<7} {:>5} {:>13}  {:>6} {:>6}  state",
        "slot", "VIP", "backend", "no.", "tokens", "tok/s", "done"
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
            "{:>4}  {:<24} {:<7} {:>5} {:>6}/{:<6}  {:>6} {:>6}  {}{failed}",
            i + 1,
            vip,
            backend,
            x.stream_no,
            x.received,
            x.expected,
            x.rate,
            x.completed,
            x.state,
        )?;
    }
    writeln!(o)?;
    writeln!(
        o,
        "{:<8} {:>8} {:>10}   {:>13} {:>10} {:>12}",
        "backend", "streams", "tokens", "LB new flows", "LB packets", "LB bytes"
    )?;
    let tcp: Vec<_> = lab
        .services
        .iter()
        .filter(|v| v.proto == PROTO_TCP)
        .cloned()
        .collect();
    let names: Vec<String> = lab.topo.backends.iter().map(|b| b.name.clone()).collect();
    for (i, name) in names.iter().enumerate() {
        let (mut flows, mut pkts, mut bytes) = (0, 0, 0);
        for v in &tcp {
            let st = lab.lb_dp.backend_stats(v.backend_ids[i])?;
            flows += st.new_flows;
            pkts += st.packets;
            bytes += st.bytes;
        }
        let (streams, toks) = s.by_backend.get(name).copied().unwrap_or_default();
        writeln!(
            o,
            "{:<8} {:>8} {:>10}   {:>13} {:>10} {:>12}",
            name, streams, toks, flows, pkts, bytes
        )?;
    }
    writeln!(
        o,
        "(streams and tokens as the client saw them; LB columns: sluice_xdp's per-backend \
         counters, client->VIP direction)"
    )?;
    writeln!(o)?;
    let c = |i: u32| d.lb[i as usize];
    writeln!(
        o,
        "LB sluice_xdp: rx {}  encapsulated (XDP_TX) {}  conn hits {}  new flows {}  \
         fallback MAC {}  drops {}",
        c(stat::RX),
        c(stat::TX),
        c(stat::CONN_HIT),
        c(stat::CONN_MISS),
        c(stat::FIB_FALLBACK_MAC),
        c(stat::DROP_NO_BACKEND) + c(stat::DROP_NO_NEXTHOP) + c(stat::DROP_ADJUST_HEAD)
    )?;
    let decap: u64 = d.decap.iter().map(|x| x[stat::DECAP_OK as usize]).sum();
    writeln!(
        o,
        "DSR: {} client->VIP packets went through the LB, encapsulated to the backends ({} \
         decapsulated there); {} packets ({} kB) came from the backends straight to the \
         client: the LB's port saw only {} other frames and sent {} besides its encapsulations",
        d.vip_packets,
        decap,
        d.client_link.rx_packets,
        d.client_link.rx_bytes / 1000,
        c(stat::RX).saturating_sub(d.vip_packets),
        d.edge[stat::RX as usize].saturating_sub(c(stat::TX)),
    )?;
    Ok(o)
}
