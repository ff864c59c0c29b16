//! Namespace tests: real TCP and UDP through the XDP data plane. A client namespace talks to
//! the VIPs through the LB namespace (`sluice_xdp`, native XDP on a veth), which encapsulates
//! to three backend namespaces (`sluice_decap`, VIP on lo, `sluice-testsrv`) on one bridged
//! segment; replies go from the backends straight to the client (DSR). See
//! `sluice_tests::netns` for the topology. Needs root, `ip` and `ethtool`; fails, never skips.

use std::{
    collections::BTreeMap,
    net::SocketAddr,
    path::PathBuf,
    thread,
    time::{Duration, Instant},
};

use lb_common::{stat, PROTO_TCP};
use sluice_tests::{
    net_lab::{Counters, LabOptions, NetLab},
    netns::{lab_namespaces, TopologySpec, TCP_PORT, UDP_PORT, VIP4, VIP6},
    stream::{udp_ask, udp_flow_key, udp_socket_in, TokenStream},
};

const SERVER: &str = env!("CARGO_BIN_EXE_sluice-testsrv");

fn start_lab() -> NetLab {
    let t = Instant::now();
    let lab = NetLab::start(&LabOptions {
        server: Some(PathBuf::from(SERVER)),
        server_lifetime: Duration::from_secs(120),
        ..Default::default()
    })
    .unwrap_or_else(|e| panic!("building the namespace lab: {e:#}"));
    eprintln!("lab {} up in {:?}", lab.topo.id, t.elapsed());
    lab
}

/// Frames that are neither client->VIP packets nor the LB's encapsulations may cross the LB's
/// port during a test: ARP and neighbour discovery, and a bridge flooding a frame before it
/// has learnt a MAC. Replies through the LB would be thousands.
const OTHER_FRAMES_SLACK: u64 = 40;

/// The counters since `before` once a traffic phase's last packets (the closes) have landed:
/// read every 50 ms until two reads agree and every VIP packet is counted as sent and
/// decapsulated, at most 10 s. Past the deadline the last read comes back, for
/// [`assert_dsr`] to report.
fn settled_counters(lab: &mut NetLab, before: &Counters) -> Counters {
    let deadline = Instant::now() + Duration::from_secs(10);
    let key = |d: &Counters| {
        let decapped: u64 = d.decap.iter().map(|s| s[stat::DECAP_OK.index()]).sum();
        (
            d.vip_packets,
            d.lb[stat::TX.index()],
            decapped,
            d.lb[stat::RX.index()],
        )
    };
    let mut last = key(&lab.counters().unwrap().since(before));
    loop {
        thread::sleep(Duration::from_millis(50));
        let d = lab.counters().unwrap().since(before);
        let now = key(&d);
        let (vip, tx, decapped, _) = now;
        if now == last && vip > 0 && tx == vip && decapped >= tx {
            return d;
        }
        if Instant::now() >= deadline {
            eprintln!("counters did not settle within 10 s: last two reads {last:?}, {now:?}");
            return d;
        }
        last = now;
    }
}

/// Direct server return, from the counters of one traffic phase: the LB's port saw the
/// client->VIP packets and nothing else (up to neighbour chatter), every one of them left
/// encapsulated through XDP_TX with a FIB-resolved next hop, and the LB namespace sent
/// nothing else; yet the client received many more packets (the replies) than that slack.
fn assert_dsr(d: &Counters, what: &str) {
    let lb = &d.lb;
    let rx = lb[stat::RX.index()];
    let tx = lb[stat::TX.index()];
    let edge_rx = d.edge[stat::RX.index()];
    let decapped: u64 = d.decap.iter().map(|s| s[stat::DECAP_OK.index()]).sum();
    let reply_packets = d.client_link.rx_packets;
    eprintln!(
        "{what}: LB XDP rx {rx} (VIP {}), encapsulated+XDP_TX {tx}, fallback {}, dropped \
         (no backend/no next hop) {}/{}; frames out of the LB namespace {edge_rx}; \
         decapsulated on backends {decapped}; client eth0 rx {} packets / {} bytes, tx {} \
         packets; LB eth0 rx {} packets / {} bytes",
        d.vip_packets,
        lb[stat::FIB_FALLBACK_MAC.index()],
        lb[stat::DROP_NO_BACKEND.index()],
        lb[stat::DROP_NO_NEXTHOP.index()],
        d.client_link.rx_packets,
        d.client_link.rx_bytes,
        d.client_link.tx_packets,
        d.lb_link.rx_packets,
        d.lb_link.rx_bytes,
    );
    assert!(
        d.vip_packets > 0 && tx == d.vip_packets,
        "{what}: every VIP packet must leave the LB encapsulated by XDP_TX: VIP packets {}, \
         XDP_TX {tx}",
        d.vip_packets
    );
    assert_eq!(
        lb[stat::FIB_FALLBACK_MAC.index()],
        0,
        "{what}: the FIB gave no next hop for some backend (neighbours not resolved?)"
    );
    assert!(
        decapped >= tx,
        "{what}: the backends decapsulated {decapped} packets, fewer than the {tx} the LB sent"
    );
    assert!(
        reply_packets >= 20 * OTHER_FRAMES_SLACK,
        "{what}: the client received only {reply_packets} packets; too few to tell DSR apart"
    );
    assert!(
        rx <= d.vip_packets + OTHER_FRAMES_SLACK,
        "{what}: the LB's port received {rx} frames but only {} were client->VIP packets: \
         replies (the client received {reply_packets} packets) are passing through the LB",
        d.vip_packets
    );
    assert!(
        edge_rx <= tx + OTHER_FRAMES_SLACK,
        "{what}: the LB namespace sent {edge_rx} frames but only {tx} encapsulations: it is \
         forwarding traffic that should go from the backends to the client directly"
    );
}

#[test]
fn tcp_token_streams_through_native_xdp_lb_return_directly_from_three_backends() {
    let mut lab = start_lab();
    let client = lab.topo.client.ns.clone();
    let before = lab.counters().unwrap();
    const V4_STREAMS: usize = 60;
    const V6_STREAMS: usize = 6;
    const TOKENS: u32 = 30;
    const INTERVAL_MS: u32 = 5;
    let t = Instant::now();
    let deadline = t + Duration::from_secs(30);
    let handles: Vec<_> = (0..V4_STREAMS + V6_STREAMS)
        .map(|k| {
            let vip = if k < V4_STREAMS {
                SocketAddr::new(VIP4.into(), TCP_PORT)
            } else {
                SocketAddr::new(VIP6.into(), TCP_PORT)
            };
            let client = client.clone();
            thread::spawn(move || {
                let mut s =
                    TokenStream::open(&client, vip, TOKENS, INTERVAL_MS, Duration::from_secs(5))?;
                s.read_to_end(deadline)?;
                let (flow, backend, local) = (s.flow_key(), s.backend.clone(), s.local);
                s.close();
                anyhow::Ok((vip, local, flow, backend))
            })
        })
        .collect();
    let mut results = Vec::new();
    let mut failures = Vec::new();
    for h in handles {
        match h.join().expect("stream thread panicked") {
            Ok(r) => results.push(r),
            Err(e) => failures.push(format!("{e:#}")),
        }
    }
    let elapsed = t.elapsed();
    assert!(
        failures.is_empty(),
        "{} of {} streams failed:\n{}",
        failures.len(),
        V4_STREAMS + V6_STREAMS,
        failures.join("\n")
    );
    let d = settled_counters(&mut lab, &before);
    eprintln!(
        "{} streams of {TOKENS} tokens in {elapsed:?}",
        V4_STREAMS + V6_STREAMS
    );

    // Spread: every backend served some of the IPv4 streams, and the IPv6 ones were served.
    let mut per_backend: BTreeMap<&str, usize> = BTreeMap::new();
    for (vip, _, _, b) in &results {
        if vip.is_ipv4() {
            *per_backend.entry(b.as_str()).or_default() += 1;
        }
    }
    eprintln!("IPv4 streams per backend: {per_backend:?}");
    for b in &lab.topo.backends {
        let n = per_backend.get(b.name.as_str()).copied().unwrap_or(0);
        assert!(
            n >= 5,
            "backend {} served {n} of {V4_STREAMS} IPv4 streams (expected about {}): {per_backend:?}",
            b.name,
            V4_STREAMS / lab.topo.backends.len()
        );
    }
    // Each stream was served by the backend the LB's connection table pinned it to.
    for (vip, local, flow, backend) in &results {
        let pinned = lab.conn_backend(flow).unwrap();
        assert_eq!(
            pinned.as_deref(),
            Some(backend.as_str()),
            "stream {local} -> {vip}: greeting from {backend}, LB connection table says {pinned:?}"
        );
    }
    // New flows counted per backend by the data plane match the streams.
    let tcp4 = lab
        .service(SocketAddr::new(VIP4.into(), TCP_PORT), PROTO_TCP)
        .unwrap()
        .clone();
    for (i, b) in lab.topo.backends.clone().iter().enumerate() {
        let st = lab.lb_dp.backend_stats(tcp4.backend_ids[i]).unwrap();
        let n = per_backend.get(b.name.as_str()).copied().unwrap_or(0) as u64;
        assert_eq!(
            st.new_flows, n,
            "backend {}: data plane counted {} new flows, the client saw {n} streams",
            b.name, st.new_flows
        );
    }
    assert_dsr(&d, "TCP streams");
}

#[test]
fn udp_echo_through_native_xdp_lb_is_answered_by_the_pinned_backend() {
    let mut lab = start_lab();
    let client = lab.topo.client.ns.clone();
    let before = lab.counters().unwrap();
    let mut per_backend: BTreeMap<String, usize> = BTreeMap::new();
    let mut sockets = Vec::new();
    for k in 0..36 {
        let vip = if k < 30 {
            SocketAddr::new(VIP4.into(), UDP_PORT)
        } else {
            SocketAddr::new(VIP6.into(), UDP_PORT)
        };
        let s = udp_socket_in(&client, vip).unwrap();
        sockets.push((vip, s));
    }
    for (k, (vip, s)) in sockets.iter().enumerate() {
        // Several datagrams per flow: all must come back from the same backend.
        let mut first = None;
        for j in 0..25 {
            let backend = udp_ask(s, &format!("ping {k}.{j}"), 3, Duration::from_secs(1))
                .unwrap_or_else(|e| panic!("flow {k} to {vip}: {e:#}"));
            match &first {
                None => first = Some(backend),
                Some(f) => assert_eq!(
                    f, &backend,
                    "flow {k} to {vip}: datagram {j} answered by another backend"
                ),
            }
        }
        let backend = first.unwrap();
        let pinned = lab.conn_backend(&udp_flow_key(s).unwrap()).unwrap();
        assert_eq!(
            pinned.as_deref(),
            Some(backend.as_str()),
            "flow {k} to {vip}: answered by {backend}, the LB pinned it to {pinned:?}"
        );
        if vip.is_ipv4() {
            *per_backend.entry(backend).or_default() += 1;
        }
    }
    eprintln!("IPv4 UDP flows per backend: {per_backend:?}");
    assert!(
        per_backend.len() >= 2,
        "30 UDP flows all went to one backend: {per_backend:?}"
    );
    let d = settled_counters(&mut lab, &before);
    assert_dsr(&d, "UDP echo");
}

/// Sends `n` TCP SYNs from `src` ports `first_port..` to `vip` through a raw socket in `ns`
/// (the kernel fills in the IP checksum; the TCP checksum stays zero, so backends drop them
/// after the LB steered them): a bounded SYN flood. At most 10 s; returns how many were sent.
fn syn_flood(
    ns: &sluice_tests::netns::Netns,
    src: std::net::Ipv4Addr,
    vip: SocketAddr,
    first_port: u16,
    n: u16,
) -> usize {
    use sluice_tests::frames::{tcp, SYN, V4};
    let SocketAddr::V4(vip) = vip else {
        panic!("{vip}: an IPv4 VIP")
    };
    ns.run(move || {
        let fd = unsafe { libc::socket(libc::AF_INET, libc::SOCK_RAW, libc::IPPROTO_RAW) };
        assert!(fd >= 0, "raw socket: {}", std::io::Error::last_os_error());
        let to = libc::sockaddr_in {
            sin_family: libc::AF_INET as u16,
            sin_port: 0,
            sin_addr: libc::in_addr {
                s_addr: u32::from_ne_bytes(vip.ip().octets()),
            },
            sin_zero: [0; 8],
        };
        let end = Instant::now() + Duration::from_secs(10);
        let mut sent = 0;
        for k in 0..n {
            let mut h = V4::new("0.0.0.0", "0.0.0.0", PROTO_TCP);
            (h.src, h.dst) = (src, *vip.ip());
            let pkt = h.build(&tcp(first_port + k, vip.port(), SYN, b""));
            let r = unsafe {
                libc::sendto(
                    fd,
                    pkt.as_ptr().cast(),
                    pkt.len(),
                    0,
                    (&to as *const libc::sockaddr_in).cast(),
                    std::mem::size_of::<libc::sockaddr_in>() as u32,
                )
            };
            if r == pkt.len() as isize {
                sent += 1;
            }
            if Instant::now() >= end {
                break;
            }
        }
        unsafe { libc::close(fd) };
        sent
    })
    .unwrap()
}

/// A SYN flood cannot evict established flows: with the flood guard on, 20,000 SYNs from
/// fresh source ports (five times the connection table) cross the LB while streams run;
/// every stream keeps its connection entry and completes.
#[test]
fn a_syn_flood_does_not_evict_the_entries_of_running_streams() {
    let mut lab = NetLab::start(&LabOptions {
        server: Some(PathBuf::from(SERVER)),
        server_lifetime: Duration::from_secs(120),
        conn_table_size: 4096,
        ..Default::default()
    })
    .unwrap_or_else(|e| panic!("building the namespace lab: {e:#}"));
    lab.cfg.flood_new_flows_per_sec = 200;
    let cfg = lab.cfg;
    lab.lb_dp.set_config(&cfg).unwrap();
    let client = lab.topo.client.clone();
    let vip = SocketAddr::new(VIP4.into(), TCP_PORT);
    // 20 streams of 4 tokens every 2 s, read on their own threads: the flood falls in their
    // quiet gaps, when an LRU table would find their entries the least recently used.
    let deadline = Instant::now() + Duration::from_secs(60);
    let mut flows = Vec::new();
    let mut readers = Vec::new();
    for _ in 0..20 {
        let mut s = TokenStream::open(&client.ns, vip, 4, 2000, Duration::from_secs(5)).unwrap();
        flows.push((s.flow_key(), s.backend.clone(), s.local));
        readers.push(thread::spawn(move || {
            let r = s.read_to_end(deadline);
            s.close();
            r
        }));
    }
    let before = lab.counters().unwrap();
    let sent = syn_flood(&client.ns, client.v4, vip, 1024, 20_000);
    let d = lab.counters().unwrap().since(&before);
    let bypass = d.lb[stat::FLOOD_BYPASS.index()];
    eprintln!(
        "{sent} SYNs sent; flood_bypass +{bypass}, VIP packets +{}",
        d.vip_packets
    );
    assert!(sent >= 19_000, "only {sent} of 20000 SYNs sent");
    assert!(
        bypass >= 15_000,
        "the flood guard let {} of {sent} SYNs into the table",
        sent as u64 - bypass
    );
    for (flow, backend, local) in &flows {
        assert_eq!(
            lab.conn_backend(flow).unwrap().as_deref(),
            Some(backend.as_str()),
            "stream {local} lost its connection entry to the flood"
        );
    }
    let failures: Vec<String> = readers
        .into_iter()
        .filter_map(|h| h.join().unwrap().err().map(|e| format!("{e:#}")))
        .collect();
    assert!(
        failures.is_empty(),
        "streams failed:\n{}",
        failures.join("\n")
    );
}

/// A lab leaves nothing behind once dropped, also when the test using it panics: its
/// namespaces are gone and its server processes are dead.
#[test]
fn a_lab_dropped_by_a_panicking_test_leaves_no_namespace_or_process() {
    let seen = std::sync::Mutex::new((String::new(), Vec::new()));
    let r = std::panic::catch_unwind(|| {
        let lab = start_lab();
        let pids: Vec<u32> = lab.servers.iter().map(|p| lab.topo.pid(*p)).collect();
        *seen.lock().unwrap() = (lab.topo.id.clone(), pids);
        assert!(
            lab_namespaces()
                .iter()
                .any(|n| n.starts_with(&format!("{}-", lab.topo.id))),
            "the lab's namespaces are listed while it runs"
        );
        panic!("deliberate panic with the lab alive");
    });
    assert!(r.is_err());
    let (id, pids) = seen.into_inner().unwrap();
    assert!(
        !id.is_empty() && pids.len() == 3,
        "lab {id:?}, servers {pids:?}"
    );
    let left: Vec<String> = lab_namespaces()
        .into_iter()
        .filter(|n| n.starts_with(&format!("{id}-")))
        .collect();
    assert!(left.is_empty(), "namespaces left after the panic: {left:?}");
    for pid in pids {
        assert!(
            !std::path::Path::new(&format!("/proc/{pid}")).exists(),
            "server process {pid} still runs after the lab was dropped"
        );
    }
}

/// The startup sweep removes namespaces left by a run that died (its pid is gone), and kills
/// what still ran in them; namespaces of live runs stay.
#[test]
fn namespaces_of_a_dead_run_are_swept_and_their_processes_killed() {
    sluice_tests::require_root();
    // A pid that was just used and is gone.
    let mut gone = std::process::Command::new("true").spawn().unwrap();
    let dead_pid = gone.id();
    gone.wait().unwrap();
    let stale = [format!("sl{dead_pid}-7-sw"), format!("sl{dead_pid}-7-lb")];
    let live = format!("sl{}-99-x", std::process::id());
    for n in stale.iter().chain([&live]) {
        sluice_tests::netns::ip(&["netns", "add", n]).unwrap();
    }
    let ns = sluice_tests::netns::Netns::existing(&stale[1]);
    let mut straggler = ns
        .command("sleep")
        .arg("30")
        .spawn()
        .expect("start a process in the stale namespace");
    // `ip netns exec` enters the namespace, then execs sleep: once the pid runs sleep, it is
    // inside.
    let comm = format!("/proc/{}/comm", straggler.id());
    let end = Instant::now() + Duration::from_secs(5);
    loop {
        let now = std::fs::read_to_string(&comm).unwrap_or_default();
        if now.trim() == "sleep" {
            break;
        }
        assert!(
            Instant::now() < end,
            "the straggler did not exec sleep within 5 s; {comm}: {now:?}"
        );
        thread::sleep(Duration::from_millis(10));
    }

    let swept = sluice_tests::netns::sweep_stale();
    let remaining = lab_namespaces();
    sluice_tests::netns::ip(&["netns", "del", &live]).unwrap();
    let end = Instant::now() + Duration::from_secs(5);
    let status = loop {
        if let Some(s) = straggler.try_wait().unwrap() {
            break Some(s);
        }
        if Instant::now() >= end {
            let _ = straggler.kill();
            let _ = straggler.wait();
            break None;
        }
        thread::sleep(Duration::from_millis(10));
    };
    for n in &stale {
        assert!(swept.contains(n), "{n} was not swept: {swept:?}");
        assert!(!remaining.contains(n), "{n} still exists");
    }
    assert!(
        remaining.contains(&live),
        "the sweep removed a namespace of this (live) process"
    );
    assert!(
        status.is_some(),
        "the process in the stale namespace was not killed"
    );
}

/// With no neighbour entry for the backends (bpf_fib_lookup does not resolve them itself),
/// the LB sends to the fallback MAC, the segment's router in the switch namespace, which
/// routes the encapsulated packets on to the backends: streams still complete.
#[test]
fn without_neighbour_entries_the_lb_forwards_through_the_fallback_router() {
    let mut lab = start_lab();
    lab.topo
        .lb
        .ns
        .ip(&["neigh", "flush", "dev", sluice_tests::netns::DEV])
        .unwrap();
    let before = lab.counters().unwrap();
    let client = lab.topo.client.ns.clone();
    for vip in [
        SocketAddr::new(VIP4.into(), TCP_PORT),
        SocketAddr::new(VIP6.into(), TCP_PORT),
    ] {
        for _ in 0..4 {
            let mut s = TokenStream::open(&client, vip, 10, 1, Duration::from_secs(5))
                .unwrap_or_else(|e| panic!("stream to {vip} via the fallback router: {e:#}"));
            s.read_to_end(Instant::now() + Duration::from_secs(10))
                .unwrap_or_else(|e| panic!("stream to {vip} via the fallback router: {e:#}"));
        }
    }
    let d = lab.counters().unwrap().since(&before);
    let (fallback, tx) = (d.lb[stat::FIB_FALLBACK_MAC.index()], d.lb[stat::TX.index()]);
    assert!(
        tx > 0 && fallback == tx,
        "fallback {fallback} of {tx} encapsulations"
    );
}

/// Jumbo frames: every link at MTU 9100, the client's VIP routes at 9000. Native XDP on a veth
/// refuses an MTU above a page for a program without multi-buffer support, so this lab comes up
/// only because Sluice's programs are `xdp.frags`; then 8900-byte datagrams cross the LB as one
/// frame each (a linear page plus fragments), are encapsulated whole, decapsulated on the
/// backend, and echoed by the backend the LB pinned them to.
#[test]
fn jumbo_udp_datagrams_cross_a_native_xdp_lb_at_mtu_9000() {
    let mut lab = NetLab::start(&LabOptions {
        topology: TopologySpec {
            mtu: 9100,
            vip_route_mtu: 9000,
            ..TopologySpec::default()
        },
        server: Some(PathBuf::from(SERVER)),
        server_lifetime: Duration::from_secs(120),
        ..Default::default()
    })
    .unwrap_or_else(|e| panic!("building the MTU-9000 lab: {e:#}"));
    let client = lab.topo.client.ns.clone();
    let before = lab.counters().unwrap();
    let vip_before: Vec<_> = [2, 3]
        .iter()
        .map(|&id| lab.lb_dp.vip_stats(id).unwrap())
        .collect();
    const PER_VIP: u64 = 5;
    const SIZE: usize = 8900;
    for vip in [
        SocketAddr::new(VIP4.into(), UDP_PORT),
        SocketAddr::new(VIP6.into(), UDP_PORT),
    ] {
        for k in 0..PER_VIP {
            let s = udp_socket_in(&client, vip).unwrap();
            let payload = format!("{k}-{}", "j".repeat(SIZE));
            let who = udp_ask(&s, &payload, 3, Duration::from_secs(2))
                .unwrap_or_else(|e| panic!("{SIZE}-byte datagram {k} to {vip}: {e:#}"));
            let pinned = lab.conn_backend(&udp_flow_key(&s).unwrap()).unwrap();
            assert_eq!(
                pinned.as_deref(),
                Some(who.as_str()),
                "datagram {k} to {vip}"
            );
        }
    }
    let d = lab.counters().unwrap().since(&before);
    for (i, id) in [2u32, 3].into_iter().enumerate() {
        let now = lab.lb_dp.vip_stats(id).unwrap();
        let packets = now.packets - vip_before[i].packets;
        let bytes = now.bytes - vip_before[i].bytes;
        assert!(packets >= PER_VIP, "VIP {id}: {packets} packets steered");
        assert!(
            bytes >= packets * SIZE as u64,
            "VIP {id}: {bytes} bytes in {packets} packets: the datagrams did not cross as jumbo frames"
        );
    }
    assert_eq!(
        d.lb[stat::PASS_BAD_IP_LEN.index()],
        0,
        "the LB saw a frame shorter than its IP length (a jumbo frame's first page only)"
    );
    let decapped: u64 = d.decap.iter().map(|s| s[stat::DECAP_OK.index()]).sum();
    assert!(decapped >= 2 * PER_VIP, "backends decapsulated {decapped}");
}
