//! Adaptive steering end to end: the daemon in the namespace lab scrapes fake exporters on
//! the backends (`sluice-testsrv serve --metrics`: one page in the dcgm-exporter, vLLM and
//! node_exporter formats, rewritten by the test at run time) and steers real token streams
//! on what they report, on its health checks and on admission control. See
//! `sluice_tests::daemon_lab`. Needs root, `ip`, `ethtool`, `nsenter`, a bpffs and the
//! `sluice` binary; fails, never skips.
//!
//! Priority classes: VIPs that share accelerator hosts form one admission pool. While every
//! backend of the pool is full, new sessions of every VIP find only full backends, so the
//! class-0 VIP is refused too (`shed_full`); the lowest class is also shed by priority
//! (`shed_priority`, one more class per further period, never the pool's highest class: a
//! lone VIP is refused session by session only). When a host frees up, the VIPs still
//! shed by priority stay refused until the pool has had room for a whole period, so the freed
//! capacity goes to the higher class first (a session of it whose four probe positions all
//! hold full hosts is still refused). `shared_pool_...` shows that with two VIPs on the
//! same hosts; the capped tests show each refusal path on one VIP.

use std::{
    collections::BTreeMap,
    io::ErrorKind,
    net::{Ipv4Addr, SocketAddr},
    thread,
    time::{Duration, Instant},
};

use sluice::clock::now_ms;
use sluice_tests::{
    daemon_lab::{tally, wait_for, DaemonLab, DaemonLabOptions, FakeTelemetry, Running, VipDef},
    netns::{TCP_PORT, VIP4},
};

const SERVER: &str = env!("CARGO_BIN_EXE_sluice-testsrv");
const VIP: &str = "chat";
const BACKENDS: usize = 3;

fn vip() -> SocketAddr {
    SocketAddr::new(VIP4.into(), TCP_PORT)
}

/// Three backends with fake exporters, every one scraped for dcgm, vLLM and RoCE.
fn telemetry_options() -> DaemonLabOptions {
    let mut v = VipDef::tcp(VIP, vip(), BACKENDS);
    v.telemetry = true;
    let mut o = DaemonLabOptions::new(SERVER, BACKENDS, vec![v]);
    o.exporters = true;
    o
}

/// Starts the lab and waits until the policy has seen every backend's telemetry: all in
/// rotation. A starting daemon must not move backends away for want of a first scrape.
fn start_settled(opts: DaemonLabOptions) -> DaemonLab {
    let telemetry = opts.vips.iter().any(|v| v.telemetry);
    let lab = DaemonLab::start(opts).unwrap_or_else(|e| panic!("starting the daemon lab: {e:#}"));
    let t = Instant::now();
    wait_for(
        "every backend in rotation with fresh telemetry",
        Duration::from_secs(10),
        || {
            let bs = lab.backends(VIP);
            let ok = bs.iter().all(|b| {
                let s = &b["steering"];
                s["state"] == "active" && (!telemetry || s["telemetry_age_s"].is_f64())
            });
            if ok && bs.len() == BACKENDS {
                Ok(Some(()))
            } else {
                Err(format!("{:?}", steering(&bs)))
            }
        },
    )
    .unwrap();
    let reroutes: Vec<_> = lab
        .events()
        .into_iter()
        .filter(|e| e["kind"] == "reroute" || e["kind"] == "cooldown-start")
        .collect();
    assert!(
        reroutes.is_empty(),
        "a starting daemon moved backends away: {reroutes:?}"
    );
    eprintln!("steering settled {:?} after the start", t.elapsed());
    lab
}

/// (address, steering state, reason, effective weight) per backend, for messages.
fn steering(bs: &[serde_json::Value]) -> Vec<String> {
    bs.iter()
        .map(|b| {
            format!(
                "{} {} {} w{} full={}",
                b["address"].as_str().unwrap_or("?"),
                b["steering"]["state"],
                b["steering"]["reason"],
                b["effective_weight"],
                b["steering"]["full"]
            )
        })
        .collect()
}

/// Opens 6 s streams until backend `name` has two and every other one (at most 40).
fn open_spread(lab: &DaemonLab, name: &str) -> Vec<Running> {
    let mut streams: Vec<Running> = Vec::new();
    loop {
        let c = tally(streams.iter().map(|s| &s.backend));
        let n = |b: &str| c.get(b).copied().unwrap_or(0);
        if n(name) >= 2 && lab.topo.backends.iter().all(|b| n(&b.name) >= 1) {
            return streams;
        }
        assert!(streams.len() < 40, "40 streams did not spread: {c:?}");
        streams.push(
            lab.stream(vip(), 60, 100)
                .unwrap_or_else(|e| panic!("opening a stream: {e:#}")),
        );
    }
}

/// Every stream must complete (all tokens, in order, from the backend that greeted).
fn finish_all(streams: Vec<Running>, what: &str) -> BTreeMap<String, usize> {
    let mut failures = Vec::new();
    let mut done = Vec::new();
    for s in streams {
        let (backend, local) = (s.backend.clone(), s.local);
        match s.finish() {
            Ok(_) => done.push(backend),
            Err(e) => failures.push(format!("{local} on {backend}: {e:#}")),
        }
    }
    assert!(
        failures.is_empty(),
        "{what}: {} streams did not complete:\n{}",
        failures.len(),
        failures.join("\n")
    );
    tally(done.iter())
}

fn event<'a>(
    events: &'a [serde_json::Value],
    kind: &str,
    backend: Option<&str>,
) -> Option<&'a serde_json::Value> {
    events
        .iter()
        .find(|e| e["kind"] == kind && backend.is_none_or(|b| e["backend"].as_str() == Some(b)))
}

#[test]
fn congested_backend_gets_no_new_sessions_while_its_streams_finish_and_returns_after_cooldown() {
    let lab = start_settled(telemetry_options());
    let hot = lab.topo.backends[0].clone();
    let addr = hot.v4.to_string();
    let streams = open_spread(&lab, &hot.name);
    let on_hot = streams.iter().filter(|s| s.backend == hot.name).count();
    eprintln!(
        "{} streams open: {:?}",
        streams.len(),
        tally(streams.iter().map(|s| &s.backend))
    );

    // RoCE congestion on b0: ECN marks at 5000/s (threshold 1000/s).
    let t = Instant::now();
    lab.set_telemetry(
        0,
        &FakeTelemetry {
            ecn_per_s: 5000.0,
            ..FakeTelemetry::default()
        },
    )
    .unwrap();
    let moved = wait_for(
        "the congested backend to be moved away",
        Duration::from_secs(5),
        || {
            let b = lab.backend(VIP, hot.v4.into()).unwrap();
            let s = &b["steering"];
            if s["state"] == "moved-away" && s["reason"] == "congestion" {
                Ok(Some(b))
            } else {
                Err(format!("{s}"))
            }
        },
    )
    .unwrap();
    eprintln!(
        "moved away {:?} after the exporter reported congestion (scrape interval 250 ms): {}",
        t.elapsed(),
        moved["steering"]
    );
    assert_eq!(moved["effective_weight"], 0, "{moved}");
    let page = lab.metrics_page().unwrap();
    let series = format!(
        "sluice_backend_moved_away{{vip=\"{VIP}\",backend=\"{addr}\",reason=\"congestion\"}} 1"
    );
    assert!(
        page.lines().any(|l| l == series),
        "the metrics do not show {series}:\n{page}"
    );

    // 90 new sessions: b0 gets none while moved away.
    let new = lab.sessions(vip(), 90);
    let fair = 90 / BACKENDS;
    let got = new.get(&hot.name).copied().unwrap_or(0);
    eprintln!("90 sessions while b0 is congested: {new:?}");
    assert_eq!(
        got, 0,
        "the moved-away backend got {got} of 90 new sessions (fair share {fair}): {new:?}"
    );
    let still = lab.backend(VIP, hot.v4.into()).expect("listed");
    assert_eq!(
        still["steering"]["state"], "moved-away",
        "b0 came back during the sessions: {still}"
    );

    // Its established streams stay and complete on it.
    let done = finish_all(streams, "streams open before the congestion");
    assert_eq!(done.get(&hot.name).copied().unwrap_or(0), on_hot);

    let events = lab.events();
    let reroute = event(&events, "reroute", Some(&addr))
        .unwrap_or_else(|| panic!("no reroute event for {addr}: {events:?}"));
    assert!(
        reroute["reason"]
            .as_str()
            .is_some_and(|r| r.contains("ecn_rate")),
        "{reroute}"
    );
    assert!(
        event(&events, "cooldown-start", Some(&addr)).is_some(),
        "no cooldown-start event for {addr}: {events:?}"
    );

    // Calm again: back after the cooldown (2 s), through slow start.
    let t = Instant::now();
    lab.set_telemetry(0, &FakeTelemetry::default()).unwrap();
    wait_for(
        "the backend to come back after its cooldown",
        Duration::from_secs(10),
        || {
            let e = lab.events();
            match event(&e, "recover", Some(&addr)) {
                Some(_) => Ok(Some(())),
                None => Err(format!("{:?}", steering(&lab.backends(VIP)))),
            }
        },
    )
    .unwrap();
    eprintln!("recovered {:?} after the congestion cleared", t.elapsed());
    let b = lab.backend(VIP, hot.v4.into()).unwrap();
    assert!(
        ["slow-start", "active"].contains(&b["steering"]["state"].as_str().unwrap_or("")),
        "{b}"
    );
}

#[test]
fn dead_backend_is_marked_down_within_the_health_bound_and_new_sessions_avoid_it() {
    let mut lab = start_settled(telemetry_options());
    let dead = lab.topo.backends[1].clone();
    let addr = dead.v4.to_string();
    // The token server is also the health-check target; the exporter stays up, so only
    // the health checks can tell.
    let killed_at = now_ms();
    let server = lab.servers[1];
    lab.topo.signal(server, libc::SIGKILL).unwrap();
    let down = wait_for(
        "a down event for the killed backend",
        Duration::from_secs(10),
        || {
            let e = lab.events();
            match event(&e, "down", Some(&addr)) {
                Some(d) => Ok(Some(d.clone())),
                None => Err(format!("{:?}", steering(&lab.backends(VIP)))),
            }
        },
    )
    .unwrap();
    let latency = down["time_ms"].as_u64().unwrap().saturating_sub(killed_at);
    eprintln!("down {latency} ms after the kill: {down}");
    // The health bound is a count, not a time (a loaded machine stretches every interval):
    // down after exactly `fall` (2) consecutive failed checks, each a refused connection.
    let reason = down["reason"].as_str().unwrap_or_default();
    assert!(
        reason.starts_with("2 consecutive failed checks, last: ") && reason.contains("refused"),
        "down for another reason than 2 refused checks: {down}"
    );

    let new = lab.sessions(vip(), 30);
    eprintln!("30 sessions after the kill: {new:?}");
    assert_eq!(new.get(&dead.name), None, "{new:?}");
    // The data plane took it out at once; the policy's view follows at its next step.
    let b = wait_for(
        "the listing to show the backend down",
        Duration::from_secs(3),
        || {
            let b = lab.backend(VIP, dead.v4.into()).unwrap();
            if b["healthy"] == false && b["state"] == "down" && b["steering"]["state"] == "down" {
                Ok(Some(b))
            } else {
                Err(format!("{b}"))
            }
        },
    )
    .unwrap();
    assert_eq!(b["effective_weight"], 0, "{b}");
}

/// A VIP of class `priority` whose backends take at most 2 sessions each, shed per `mode`.
fn capped_options(mode: &str, priority: u8) -> DaemonLabOptions {
    let mut v = VipDef::tcp(VIP, vip(), BACKENDS);
    v.max_sessions = 2;
    v.priority = priority;
    let mut o = DaemonLabOptions::new(SERVER, BACKENDS, vec![v]);
    o.set("policy", "shed", &format!("{mode:?}"));
    o
}

fn all_full(lab: &DaemonLab) -> bool {
    lab.backends(VIP)
        .iter()
        .all(|b| b["steering"]["full"] == true)
}

/// Opens 12 s streams one at a time until the policy marks every backend full (long enough
/// that the first ones still run when a loaded machine has opened the last).
fn fill(lab: &DaemonLab) -> Vec<Running> {
    let mut streams = Vec::new();
    for _ in 0..15 {
        if all_full(lab) {
            break;
        }
        match lab.stream(vip(), 120, 100) {
            Ok(s) => streams.push(s),
            // Full between the check and the SYN: refused, which is what comes next.
            Err(e) => eprintln!("a filling stream was refused: {e:#}"),
        }
        // Wait until a policy step has counted every admitted session (or marked all full).
        // Every running stream counted (an ended one may linger until its flow idles out).
        let want = streams.iter().filter(|s| !s.is_finished()).count() as u64;
        wait_for(
            "the policy to count the new session",
            Duration::from_secs(10),
            || {
                let bs = lab.backends(VIP);
                let counted: u64 = bs
                    .iter()
                    .map(|b| b["steering"]["sessions"].as_u64().unwrap_or(0))
                    .sum();
                if counted >= want || all_full(lab) {
                    Ok(Some(()))
                } else {
                    Err(format!(
                        "{counted} of {want} sessions counted: {:?}",
                        steering(&bs)
                    ))
                }
            },
        )
        .unwrap();
    }
    wait_for("every backend full", Duration::from_secs(5), || {
        if all_full(lab) {
            Ok(Some(()))
        } else {
            Err(format!("{:?}", steering(&lab.backends(VIP))))
        }
    })
    .unwrap();
    eprintln!(
        "{} streams fill the pool: {:?}",
        streams.len(),
        tally(streams.iter().map(|s| &s.backend))
    );
    streams
}

/// `n` connection attempts at once, each bounded by `timeout`: how each ended, and how long
/// the slowest took.
fn attempts(lab: &DaemonLab, n: usize, timeout: Duration) -> (Vec<std::io::Result<()>>, Duration) {
    let t = Instant::now();
    let ns = lab.topo.client.ns.clone();
    let hs: Vec<_> = (0..n)
        .map(|_| {
            let ns = ns.clone();
            thread::spawn(move || {
                ns.run(|| std::net::TcpStream::connect_timeout(&vip(), timeout).map(drop))
                    .map_err(std::io::Error::other)?
            })
        })
        .collect();
    let r = hs.into_iter().map(|h| h.join().unwrap()).collect();
    (r, t.elapsed())
}

fn shed_counters(lab: &DaemonLab) -> (u64, u64, u64) {
    let c = lab.counters();
    (c["shed_full"], c["shed_priority"], c["shed_rst_sent"])
}

/// After the streams end and their flows idle out, new sessions are admitted again.
fn admitted_again(lab: &DaemonLab) {
    let t = Instant::now();
    wait_for(
        "new sessions admitted once the pool has room",
        Duration::from_secs(30),
        || match lab.greet(vip(), Duration::from_millis(800)) {
            Ok(b) => Ok(Some(b)),
            Err(e) => Err(format!("{e:#}")),
        },
    )
    .unwrap();
    eprintln!("admitted again {:?} after the streams ended", t.elapsed());
}

#[test]
fn saturated_pool_drops_new_syns_of_a_lone_low_priority_vip_while_established_streams_finish() {
    let lab = start_settled(capped_options("drop", 7));
    let streams = fill(&lab);
    let before = shed_counters(&lab);
    let (results, took) = attempts(&lab, 6, Duration::from_secs(1));
    eprintln!("6 new connections while full, in {took:?}: {results:?}");
    for r in &results {
        let e = r
            .as_ref()
            .expect_err("a new connection was admitted to a full pool");
        assert!(
            matches!(e.kind(), ErrorKind::TimedOut | ErrorKind::WouldBlock),
            "a dropped SYN should time out, not fail with {e}"
        );
    }
    let after = shed_counters(&lab);
    eprintln!("shed_full, shed_priority, shed_rst_sent: {before:?} -> {after:?}");
    // Alone in its pool, class 7 is its highest class: its SYNs find only full backends,
    // and the class is not shed whole (nothing of a higher class would take the room).
    assert!(after.0 >= before.0 + 6, "shed_full {before:?} -> {after:?}");
    assert_eq!(after.1, before.1, "a lone VIP was shed by priority");
    assert_eq!(after.2, before.2, "drop mode sent RSTs");
    let events = lab.events();
    assert!(
        event(&events, "shed-start", None).is_none(),
        "a lone VIP's class was shed: {events:?}"
    );

    finish_all(streams, "streams admitted before the pool filled");
    admitted_again(&lab);
}

#[test]
fn saturated_pool_answers_new_syns_with_rst_in_rst_mode_while_established_streams_finish() {
    // Class 0: never shed by priority; its SYNs find only full backends.
    let lab = start_settled(capped_options("rst", 0));
    let streams = fill(&lab);
    let before = shed_counters(&lab);
    let (results, took) = attempts(&lab, 6, Duration::from_secs(2));
    eprintln!("6 new connections while full, in {took:?}: {results:?}");
    for r in &results {
        let e = r
            .as_ref()
            .expect_err("a new connection was admitted to a full pool");
        assert_eq!(
            e.kind(),
            ErrorKind::ConnectionRefused,
            "shed = \"rst\": a shed SYN must be refused at once, not {e}"
        );
    }
    let after = shed_counters(&lab);
    eprintln!("shed_full, shed_priority, shed_rst_sent: {before:?} -> {after:?}");
    assert!(after.0 >= before.0 + 6, "shed_full {before:?} -> {after:?}");
    assert!(
        after.2 >= before.2 + 6,
        "shed_rst_sent {before:?} -> {after:?}"
    );

    finish_all(streams, "streams admitted before the pool filled");
    admitted_again(&lab);
}

/// A class-7 VIP sharing the three accelerator hosts with the class-0 `chat`.
const BATCH: &str = "batch";

fn batch_vip() -> SocketAddr {
    SocketAddr::new(Ipv4Addr::new(10, 111, 100, 2).into(), TCP_PORT)
}

/// `chat` (class 0) and `batch` (class 7) on the same three hosts, scraped for telemetry,
/// refused sessions answered with RST (so each refusal is seen at once). A 20 s shed period
/// leaves a long window between room appearing and the first class being readmitted.
fn shared_pool_options() -> DaemonLabOptions {
    let mut chat = VipDef::tcp(VIP, vip(), BACKENDS);
    chat.telemetry = true;
    let mut batch = VipDef::tcp(BATCH, batch_vip(), BACKENDS);
    batch.telemetry = true;
    batch.priority = 7;
    let mut o = DaemonLabOptions::new(SERVER, BACKENDS, vec![chat, batch]);
    o.exporters = true;
    o.backend_vips.push(batch_vip().ip());
    o.serve.push(batch_vip());
    o.set("policy", "shed", "\"rst\"");
    o.set("policy", "cooldown_base", "\"20s\"");
    o
}

/// `n` connection attempts to `to`, one after another: the backend that greeted, or the error.
fn sessions(lab: &DaemonLab, to: SocketAddr, n: usize) -> Vec<Result<String, ErrorKind>> {
    (0..n)
        .map(|_| {
            lab.greet(to, Duration::from_secs(2)).map_err(|e| {
                e.downcast_ref::<std::io::Error>()
                    .map_or(ErrorKind::Other, |e| e.kind())
            })
        })
        .collect()
}

/// Per VIP, the `full` flag of each backend.
fn fullness(lab: &DaemonLab) -> BTreeMap<&'static str, Vec<bool>> {
    [VIP, BATCH]
        .into_iter()
        .map(|v| {
            let full = lab
                .backends(v)
                .iter()
                .map(|b| b["steering"]["full"] == true)
                .collect();
            (v, full)
        })
        .collect()
}

fn shed_counts(lab: &DaemonLab) -> [u64; 3] {
    let c = lab.counters();
    [c["shed_full"], c["shed_priority"], c["shed_rst_sent"]]
}

/// docs/policy.md's promise for VIPs that share accelerator hosts: when every host is full, the
/// pool sheds the lowest class by priority (and the class-0 VIP finds only full backends), and
/// capacity that frees up goes to the higher class: `chat` is admitted to the freed host while
/// `batch` stays shed, until the pool has had room for a whole period.
#[test]
fn shared_pool_sheds_the_low_class_and_freed_capacity_goes_to_the_high_class() {
    let lab = start_settled(shared_pool_options());
    let hosts: Vec<String> = lab.topo.backends.iter().map(|b| b.name.clone()).collect();
    for to in [vip(), batch_vip()] {
        let r = sessions(&lab, to, 1);
        assert!(r[0].is_ok(), "{to} before saturation: {r:?}");
    }

    // Every host's KV cache over the threshold: both VIPs' backends are full.
    let saturated = FakeTelemetry {
        kv_cache: 0.95,
        ..FakeTelemetry::default()
    };
    for i in 0..BACKENDS {
        lab.set_telemetry(i, &saturated).unwrap();
    }
    let pool = format!("{BATCH}+{VIP}");
    wait_for(
        "every backend of both VIPs full and the pool shedding",
        Duration::from_secs(15),
        || {
            let f = fullness(&lab);
            let shed = lab
                .events()
                .iter()
                .any(|e| e["kind"] == "shed-start" && e["vip"] == pool.as_str());
            if shed
                && f.values()
                    .all(|v| v.len() == BACKENDS && v.iter().all(|&x| x))
            {
                Ok(Some(()))
            } else {
                Err(format!("shed-start for {pool}: {shed}, full: {f:?}"))
            }
        },
    )
    .unwrap();
    let before = shed_counts(&lab);
    let chat = sessions(&lab, vip(), 4);
    let batch = sessions(&lab, batch_vip(), 4);
    let after = shed_counts(&lab);
    eprintln!("all full: chat {chat:?}, batch {batch:?}; shed_full, shed_priority, rst: {before:?} -> {after:?}");
    let refused = vec![Err(ErrorKind::ConnectionRefused); 4];
    assert_eq!(chat, refused, "class 0 with every backend full");
    assert_eq!(batch, refused, "class 7 with every backend full");
    assert_eq!(
        [
            after[0] - before[0],
            after[1] - before[1],
            after[2] - before[2]
        ],
        [4, 4, 8],
        "chat's SYNs find only full backends (shed_full), batch's are shed by priority"
    );

    // One host frees up. Until the pool has had room for a period (20 s), it goes to chat.
    lab.set_telemetry(0, &FakeTelemetry::default()).unwrap();
    let t = Instant::now();
    wait_for(
        "host 0 to have room for both VIPs",
        Duration::from_secs(10),
        || {
            let f = fullness(&lab);
            if f.values().all(|v| !v[0]) {
                Ok(Some(()))
            } else {
                Err(format!("{f:?}"))
            }
        },
    )
    .unwrap();
    let before = shed_counts(&lab);
    let chat = sessions(&lab, vip(), 8);
    let batch = sessions(&lab, batch_vip(), 4);
    let after = shed_counts(&lab);
    let window = t.elapsed();
    eprintln!("host 0 free ({window:?}): chat {chat:?}, batch {batch:?}; {before:?} -> {after:?}");
    // The checks fall inside the period of room (20 s) unless the pool readmitted early.
    let events = lab.events();
    let early = event(&events, "shed-stop", None);
    assert!(
        early.is_none(),
        "the pool readmitted a class {window:?} after host 0 freed, within the 20 s period: \
         {early:?}"
    );
    assert_eq!(batch, refused, "the class-7 VIP stays shed");
    // A chat session goes to the freed host, or is refused when its four probe positions all
    // hold full hosts (until the policy moves those out of the ring): never to a full host.
    let admitted = chat.iter().filter(|r| r.is_ok()).count() as u64;
    assert!(
        chat.iter()
            .all(|r| *r == Ok(hosts[0].clone()) || *r == Err(ErrorKind::ConnectionRefused)),
        "chat sessions go to the freed host or are refused: {chat:?}"
    );
    assert!(
        admitted > 0,
        "the freed capacity goes to the class-0 VIP: {chat:?}"
    );
    assert_eq!(
        [after[0] - before[0], after[1] - before[1]],
        [8 - admitted, 4],
        "chat refused for full hosts only, batch by priority (not for want of room)"
    );

    // A whole period with room: class 7 is readmitted, and batch gets the free host.
    let readmitted = wait_for(
        "batch readmitted after a period of room",
        Duration::from_secs(40),
        || match sessions(&lab, batch_vip(), 1).remove(0) {
            Ok(b) => Ok(Some(b)),
            Err(e) => Err(format!("{e:?}")),
        },
    )
    .unwrap();
    eprintln!("batch readmitted {:?} after host 0 freed", t.elapsed());
    assert_eq!(readmitted, hosts[0]);
    let events = lab.events();
    let stop = event(&events, "shed-stop", None)
        .unwrap_or_else(|| panic!("no shed-stop event: {events:?}"));
    assert_eq!(stop["vip"], pool.as_str(), "{stop}");
}

/// A backend whose health port answers while its serving port refuses every connection (its
/// server replaced by one that listens on the backend's own address only, so connections to
/// the VIP are reset by its kernel, straight to the client): the health checks keep passing,
/// and only the clients' unanswered SYNs tell. Within a few seconds the policy moves it away
/// as `refusing`; new sessions then all succeed, on the other backends.
#[test]
fn a_backend_refusing_connections_behind_a_passing_health_check_is_moved_away() {
    let mut lab = start_settled(DaemonLabOptions::new(
        SERVER,
        BACKENDS,
        vec![VipDef::tcp(VIP, vip(), BACKENDS)],
    ));
    let sick = lab.topo.backends[1].clone();
    let results = lab.greet_many(vip(), 30, 6);
    assert!(results.iter().all(|r| r.is_ok()), "a healthy fleet");

    let server = lab.servers[1];
    lab.topo.signal(server, libc::SIGKILL).unwrap();
    let own: Vec<String> = [false, true]
        .into_iter()
        .flat_map(|v6| {
            let a = SocketAddr::new(sick.addr(v6), TCP_PORT);
            ["--tcp".to_string(), a.to_string()]
        })
        .collect();
    let lifetime = lab.opts.server_lifetime;
    let server_bin = lab.opts.server.clone();
    lab.servers[1] = lab
        .topo
        .start_server(1, &server_bin, "health-only", lifetime, &own)
        .unwrap();
    let refusing_at = Instant::now();

    // Clients keep opening sessions; a third of them fail until the backend is moved away.
    let mut failed = 0;
    let moved = wait_for(
        "the refusing backend moved away as refusing",
        Duration::from_secs(15),
        || {
            failed += lab
                .greet_many(vip(), 12, 6)
                .iter()
                .filter(|r| r.is_err())
                .count();
            let b = lab.backend(VIP, sick.v4.into()).unwrap();
            if b["steering"]["reason"] == "refusing" && b["effective_weight"] == 0 {
                Ok(Some(b))
            } else {
                Err(format!("{:?}", steering(&lab.backends(VIP))))
            }
        },
    )
    .unwrap();
    eprintln!(
        "moved away {:?} after it began refusing ({failed} sessions failed meanwhile): {moved}",
        refusing_at.elapsed()
    );
    assert_eq!(
        moved["healthy"], true,
        "its health checks still pass: {moved}"
    );
    assert_eq!(moved["steering"]["state"], "moved-away", "{moved}");
    let h = &moved["steering"]["handshakes"];
    assert!(
        h["started"].as_u64() > h["completed"].as_u64(),
        "its window shows handshakes that never completed: {moved}"
    );
    let events = lab.events();
    let reroute = event(&events, "reroute", Some(&sick.v4.to_string())).expect("a reroute");
    assert!(
        reroute["reason"]
            .as_str()
            .unwrap_or_default()
            .contains("TCP handshakes never completed"),
        "{reroute}"
    );

    // New sessions all succeed, none on the refusing backend.
    let new = lab.sessions(vip(), 30);
    assert_eq!(new.get(&sick.name), None, "{new:?}");
    // Its handshakes were counted in the data plane and exported.
    let metrics = lab.metrics_page().unwrap();
    let line = |name: &str| {
        metrics
            .lines()
            .find(|l| l.starts_with(name) && l.contains(&format!("backend=\"{}\"", sick.v4)))
            .and_then(|l| l.rsplit(' ').next()?.parse::<u64>().ok())
            .unwrap_or_else(|| panic!("{name} of {} missing:\n{metrics}", sick.v4))
    };
    let (started, completed) = (
        line("sluice_backend_handshakes_total"),
        line("sluice_backend_handshakes_completed_total"),
    );
    // At least the sample the rule judges (10 handshakes), some of them never completed.
    assert!(
        started >= 10 && started > completed,
        "{started} handshakes started, {completed} completed"
    );
}
