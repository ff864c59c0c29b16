//! Tenant isolation with real streams: the daemon lab with two tenants on one VIP, each a
//! prefix of the client's source addresses. The noisy tenant is capped at a few concurrent
//! sessions and rate-limited; while long streams of both tenants run, it opens many sessions
//! at once. Its excess sessions must be refused with a RST (the VIP sheds with `shed =
//! "rst"`) and counted as refused for its session limit (`sluice tenant list` shows it
//! capped), the quiet tenant's new sessions must still succeed, and no established stream of
//! either tenant may be cut. See
//! `sluice_tests::daemon_lab`. Needs root, `ip`, `ethtool`, `nsenter`, a bpffs and the
//! `sluice` binary; fails, never skips.

use std::{
    io::ErrorKind,
    net::{IpAddr, Ipv4Addr, SocketAddr},
    thread,
    time::{Duration, Instant},
};

use sluice_tests::{
    daemon_lab::{wait_for, DaemonLab, DaemonLabOptions, Running, TenantDef, VipDef},
    netns::{Netns, TCP_PORT, VIP4},
    stream::connect_from,
};

const SERVER: &str = env!("CARGO_BIN_EXE_sluice-testsrv");
const VIP: &str = "chat";
const BACKENDS: usize = 2;
/// The quiet tenant's prefix and the noisy one's, among the lab's client sources
/// (10.111.0.75 and up).
const QUIET: (Ipv4Addr, u8) = (Ipv4Addr::new(10, 111, 0, 96), 27);
const NOISY: (Ipv4Addr, u8) = (Ipv4Addr::new(10, 111, 0, 192), 27);
/// The noisy tenant's concurrent sessions on the VIP.
const NOISY_CAP: u32 = 4;
/// Long streams: 200 tokens 100 ms apart, 20 s, running through the flood.
const LONG_TOKENS: u32 = 200;
const LONG_INTERVAL_MS: u32 = 100;
/// The noisy tenant's sessions opened at once while capped.
const FLOOD: usize = 24;

fn vip() -> SocketAddr {
    SocketAddr::new(VIP4.into(), TCP_PORT)
}

fn cidr((a, len): (Ipv4Addr, u8)) -> String {
    format!("{a}/{len}")
}

fn inside(addr: IpAddr, (net, len): (Ipv4Addr, u8)) -> bool {
    let mask = u32::MAX << (32 - len);
    matches!(addr, IpAddr::V4(a) if u32::from(a) & mask == u32::from(net))
}

/// Two backends behind one VIP that sheds with RST; the quiet tenant with a generous cap,
/// the noisy one capped at [`NOISY_CAP`] sessions and 2 new sessions a second (burst 4).
fn options() -> DaemonLabOptions {
    let mut o = DaemonLabOptions::new(SERVER, BACKENDS, vec![VipDef::tcp(VIP, vip(), BACKENDS)]);
    o.set("policy", "shed", "\"rst\"");
    o.tenants = [
        TenantDef {
            name: "quiet".into(),
            prefixes: vec![cidr(QUIET)],
            weight: 1,
            max_sessions: 32,
            new_sessions_per_sec: 0,
            burst: 0,
        },
        TenantDef {
            name: "noisy".into(),
            prefixes: vec![cidr(NOISY)],
            weight: 1,
            max_sessions: NOISY_CAP,
            new_sessions_per_sec: 2,
            burst: 4,
        },
    ]
    .iter()
    .map(TenantDef::table)
    .collect();
    o
}

/// Opens a long stream from `src`.
fn long_stream(lab: &DaemonLab, src: IpAddr) -> Running {
    lab.stream_from(Some(src), vip(), LONG_TOKENS, LONG_INTERVAL_MS)
        .unwrap_or_else(|e| panic!("opening a long stream from {src}: {e:#}"))
}

/// One connection attempt from `src` in the client namespace `ns`: Ok, or the kind of its
/// error.
fn attempt(ns: &Netns, src: IpAddr, timeout: Duration) -> Result<(), ErrorKind> {
    connect_from(ns, src, vip(), timeout)
        .map(drop)
        .map_err(|e| {
            e.chain()
                .find_map(|c| c.downcast_ref::<std::io::Error>())
                .map_or(ErrorKind::Other, std::io::Error::kind)
        })
}

fn shed_counter(lab: &DaemonLab, name: &str) -> u64 {
    lab.counters().get(name).copied().unwrap_or(0)
}

/// Every stream must complete: a stream cut by a limit breaks this.
fn finish_all(streams: Vec<Running>, what: &str) {
    let cut: Vec<String> = streams.into_iter().filter_map(Running::broken).collect();
    assert!(
        cut.is_empty(),
        "{what}: {} established streams did not complete:\n{}",
        cut.len(),
        cut.join("\n")
    );
}

#[test]
fn a_noisy_tenants_excess_sessions_are_refused_while_the_quiet_tenant_and_every_established_stream_go_on(
) {
    let lab = DaemonLab::start(options()).unwrap_or_else(|e| panic!("starting the lab: {e:#}"));
    let sources = lab.add_client_sources(180).unwrap();
    let quiet: Vec<IpAddr> = sources
        .iter()
        .copied()
        .filter(|a| inside(*a, QUIET))
        .collect();
    let noisy: Vec<IpAddr> = sources
        .iter()
        .copied()
        .filter(|a| inside(*a, NOISY))
        .collect();
    assert!(
        quiet.len() >= 16 && noisy.len() >= 16,
        "{quiet:?} {noisy:?}"
    );
    wait_for("every backend healthy", Duration::from_secs(15), || {
        let bs = lab.backends(VIP);
        let ok = bs.len() == BACKENDS && bs.iter().all(|b| b["healthy"] == true);
        Ok(ok.then_some(()))
    })
    .unwrap();

    // Long streams of both tenants: the noisy tenant's fill its cap.
    let quiet_long: Vec<Running> = quiet[..3].iter().map(|&a| long_stream(&lab, a)).collect();
    let noisy_long: Vec<Running> = noisy[..NOISY_CAP as usize]
        .iter()
        .map(|&a| long_stream(&lab, a))
        .collect();
    let t = Instant::now();

    // The controller counts the noisy tenant's sessions and caps it: a new session of it is
    // refused at once, counted against its session limit.
    let before = shed_counter(&lab, "shed_tenant_sessions");
    let mut probe = noisy[NOISY_CAP as usize..].iter().cycle();
    wait_for(
        "the noisy tenant capped (a new session refused for its session limit)",
        Duration::from_secs(10),
        || {
            let src = *probe.next().unwrap();
            let r = attempt(&lab.topo.client.ns, src, Duration::from_secs(1));
            let counted = shed_counter(&lab, "shed_tenant_sessions");
            if r == Err(ErrorKind::ConnectionRefused) && counted > before {
                Ok(Some(()))
            } else {
                Err(format!(
                    "attempt from {src}: {r:?}, shed_tenant_sessions {counted}"
                ))
            }
        },
    )
    .unwrap();
    eprintln!(
        "noisy tenant capped {:?} after its streams opened",
        t.elapsed()
    );

    // The flood, from the noisy tenant's other addresses, while the quiet tenant opens new
    // sessions.
    let (sessions_before, rst_before) = (
        shed_counter(&lab, "shed_tenant_sessions"),
        shed_counter(&lab, "shed_rst_sent"),
    );
    let flood_from: Vec<IpAddr> = noisy[NOISY_CAP as usize..]
        .iter()
        .copied()
        .cycle()
        .take(FLOOD)
        .collect();
    let ns = lab.topo.client.ns.clone();
    let (flood, quiet_new) = thread::scope(|s| {
        let flood = s.spawn(|| {
            let hs: Vec<_> = flood_from
                .iter()
                .map(|&src| {
                    let ns = ns.clone();
                    s.spawn(move || attempt(&ns, src, Duration::from_secs(2)))
                })
                .collect();
            hs.into_iter()
                .map(|h| h.join().expect("an attempt's thread panicked"))
                .collect::<Vec<_>>()
        });
        let quiet_new: Vec<Running> = quiet[3..9]
            .iter()
            .map(|&a| {
                lab.stream_from(Some(a), vip(), 10, 20).unwrap_or_else(|e| {
                    panic!("the quiet tenant's new session from {a} during the flood: {e:#}")
                })
            })
            .collect();
        (
            flood.join().expect("the flood's thread panicked"),
            quiet_new,
        )
    });
    let refused = flood
        .iter()
        .filter(|r| **r == Err(ErrorKind::ConnectionRefused))
        .count();
    assert_eq!(
        refused, FLOOD,
        "every excess session of the capped tenant must be refused with a RST: {flood:?}"
    );
    let (sessions_after, rst_after) = (
        shed_counter(&lab, "shed_tenant_sessions"),
        shed_counter(&lab, "shed_rst_sent"),
    );
    assert!(
        sessions_after >= sessions_before + FLOOD as u64,
        "shed_tenant_sessions {sessions_before} -> {sessions_after}"
    );
    assert!(
        rst_after >= rst_before + FLOOD as u64,
        "shed_rst_sent {rst_before} -> {rst_after}"
    );
    // The operator's view: the noisy tenant capped, its refusals counted against its session
    // limit; the quiet tenant refused nothing.
    let list = lab.cli_json(&["tenant", "list"]);
    let row = |name: &str| {
        list["tenants"]
            .as_array()
            .into_iter()
            .flatten()
            .find(|t| t["tenant"] == name && t["vip"] == VIP)
            .cloned()
            .unwrap_or_else(|| panic!("no {name} on {VIP} in `sluice tenant list`: {list}"))
    };
    let (n, q) = (row("noisy"), row("quiet"));
    assert_eq!(n["state"], "capped", "{n}");
    assert!(
        n["refused"]["sessions"].as_u64().unwrap_or(0) >= FLOOD as u64,
        "{n}"
    );
    assert_eq!(q["state"], "ok", "{q}");
    assert_eq!(
        q["refused"],
        serde_json::json!({"sessions": 0, "share": 0, "rate": 0}),
        "{q}"
    );
    finish_all(
        quiet_new,
        "the quiet tenant's sessions opened during the flood",
    );
    assert!(
        quiet_long
            .iter()
            .chain(&noisy_long)
            .all(|s| !s.is_finished()),
        "the long streams must still run after the flood ({:?} in): lengthen them",
        t.elapsed()
    );
    finish_all(quiet_long, "the quiet tenant's long streams");
    finish_all(noisy_long, "the noisy tenant's long streams");

    // Its sessions ended (and their flows idled out), the noisy tenant is admitted again.
    wait_for(
        "the noisy tenant admitted again once its sessions ended",
        Duration::from_secs(20),
        || match lab.stream_from(Some(noisy[0]), vip(), 2, 10) {
            Ok(s) => Ok(s.broken().is_none().then_some(())),
            Err(e) => Err(format!("{e:#}")),
        },
    )
    .unwrap();
}
