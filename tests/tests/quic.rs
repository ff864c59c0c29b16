//! QUIC connection-ID routing end to end: `sluice run` in the namespace lab with a UDP VIP
//! of `quic = "cid"`, every backend running a quinn server (`sluice-testsrv serve --quic`)
//! whose connection IDs carry its QUIC-LB server ID (`sluice-quic-lb`), and a quinn client
//! whose connections move to a new UDP port, or a new source address, in the middle of their
//! token streams (see `sluice_tests::quic`). Needs root, `ip`, `ethtool`, `nsenter`, a bpffs
//! and the `sluice` binary; fails, never skips.
//!
//! The first two tests program the data plane directly (`net_lab::NetLab`: the VIP's flag,
//! rotation and server-ID length, the `QUIC_SERVERS` entries), the others run the daemon
//! with the configuration keys (`quic = "cid"`, `quic_server_id_len`,
//! `quic_config_rotation`, per backend `quic_server_id`).
//!
//! Every stream's lines name the server that sent them: a stream completes only if every
//! token came in order from one server, and a connection whose packets reach another backend
//! breaks (that backend has no state for it and drops them), so "complete" means "stayed".

use std::{
    net::{IpAddr, SocketAddr},
    time::{Duration, Instant},
};

use lb_common::{quic::server_id_value, QuicServerKey, PROTO_UDP, VIP_F_QUIC_CID};
use sluice_tests::{
    daemon_lab::{
        hex, lab_quic_server_id, DaemonLab, DaemonLabOptions, QuicCid, QuicServe, VipDef,
    },
    net_lab::{backend_id, LabOptions, NetLab},
    netns::{Host, DEV, VIP4, VIP6},
    quic::{
        bind_here, lines, per_server, QuicStreams, SocketMaker, StreamOutcome, StreamsSpec,
        QUIC_PORT,
    },
};

const SERVER: &str = env!("CARGO_BIN_EXE_sluice-testsrv");
const VIP: &str = "quic";
const BACKENDS: usize = 3;
/// Connections (one stream each) per run.
const STREAMS: usize = 12;
/// 40 tokens every 50 ms: 2 s streams; the connection moves after token 10.
const TOKENS: u32 = 40;
const INTERVAL_MS: u32 = 50;
const REBIND_AFTER: u32 = 10;
/// A rotation codepoint other than the default 0, so that the key is written and used.
const CID: QuicCid = QuicCid {
    server_id_len: 2,
    rotation: 1,
};

fn vip() -> SocketAddr {
    SocketAddr::new(VIP4.into(), QUIC_PORT)
}

fn vip6() -> SocketAddr {
    SocketAddr::new(VIP6.into(), QUIC_PORT)
}

/// A lab whose VIP routes by connection ID (`cid`) or by the 5-tuple only; the servers issue
/// QUIC-LB connection IDs either way.
fn options(cid: bool) -> DaemonLabOptions {
    let mut o = DaemonLabOptions::new(
        SERVER,
        BACKENDS,
        vec![VipDef::udp(VIP, vip(), BACKENDS, cid.then_some(CID))],
    );
    o.quic = Some(QuicServe {
        listen: vec![vip()],
        cid: CID,
    });
    o
}

fn start(opts: DaemonLabOptions) -> DaemonLab {
    DaemonLab::start(opts).unwrap_or_else(|e| panic!("starting the daemon lab: {e:#}"))
}

/// Sockets made in the client namespace.
fn client_sockets(lab: &DaemonLab) -> Box<SocketMaker> {
    let ns = lab.topo.client.ns.clone();
    Box::new(move |addr: Option<IpAddr>, v6: bool| {
        ns.run(move || bind_here(addr, v6)).and_then(|r| r)
    })
}

/// The streams of one run: `STREAMS` connections, each moving after `REBIND_AFTER` tokens to
/// a new port, the odd ones also to a second client address.
fn spec(lab: &DaemonLab) -> StreamsSpec {
    let second = lab
        .add_client_sources(1)
        .unwrap_or_else(|e| panic!("adding a second client address: {e:#}"))[0];
    let mut s = StreamsSpec::new(vip(), STREAMS, TOKENS, INTERVAL_MS);
    s.rebind_after = Some(REBIND_AFTER);
    s.rebind_address = Some(second);
    s
}

fn run(lab: &DaemonLab, spec: StreamsSpec) -> Vec<StreamOutcome> {
    let t = Instant::now();
    let out = QuicStreams::start(spec, &*client_sockets(lab))
        .and_then(QuicStreams::finish)
        .unwrap_or_else(|e| panic!("running the QUIC streams: {e:#}"));
    eprintln!(
        "{} streams in {:?}, per server {:?}:\n{}",
        out.len(),
        t.elapsed(),
        per_server(&out),
        lines(&out)
    );
    out
}

/// Every stream completed, on one server, and moved mid-stream.
fn assert_all_stayed(out: &[StreamOutcome], what: &str) {
    let bad: Vec<String> = out
        .iter()
        .filter(|o| !o.completed() || o.servers.len() != 1 || o.rebound_to.is_none())
        .map(|o| o.to_string())
        .collect();
    assert!(
        bad.is_empty(),
        "{what}: {} of {} streams broke, moved or did not rebind:\n{}",
        bad.len(),
        out.len(),
        bad.join("\n")
    );
}

fn counter(lab: &DaemonLab, name: &str) -> u64 {
    lab.counters().get(name).copied().unwrap_or(0)
}

/// The configuration the lab wrote has the QUIC keys (a check of the lab itself).
fn assert_quic_config(lab: &DaemonLab) {
    let text = lab.config_text();
    for want in [
        "quic = \"cid\"".to_string(),
        "quic_server_id_len = 2".into(),
        "quic_config_rotation = 1".into(),
        format!("quic_server_id = \"{}\"", hex(&lab_quic_server_id(2, 2))),
    ] {
        assert!(text.contains(&want), "{want} missing from\n{text}");
    }
}

/// The namespace lab with the data plane programmed directly: a UDP VIP (id 4) at `vip`
/// ([`vip`] or [`vip6`]) on every backend, routed by connection ID if `cid`, and a QUIC server
/// on every backend.
fn net_lab(vip: SocketAddr, cid: bool) -> NetLab {
    let mut lab = NetLab::start(&LabOptions::default())
        .unwrap_or_else(|e| panic!("starting the namespace lab: {e:#}"));
    let all: Vec<usize> = (0..lab.topo.backends.len()).collect();
    let id = 4;
    let key = lab
        .add_service(id, vip, PROTO_UDP, &all)
        .unwrap_or_else(|e| panic!("adding the QUIC VIP: {e:#}"))
        .key;
    if cid {
        let mut meta = lab.lb_dp.vip(&key).unwrap().expect("the VIP just added");
        meta.flags |= VIP_F_QUIC_CID;
        meta.quic_rotation = CID.rotation;
        meta.quic_server_id_len = CID.server_id_len;
        lab.lb_dp.set_vip(&key, &meta).unwrap();
        for &i in &all {
            let sid = lab_quic_server_id(i, CID.server_id_len);
            let k = QuicServerKey {
                vip: id,
                _pad: 0,
                id: server_id_value(&sid),
            };
            lab.lb_dp.set_quic_server(&k, backend_id(id, i)).unwrap();
        }
    }
    for i in all {
        let name = lab.topo.backends[i].name.clone();
        let args: Vec<String> = [
            "--quic".to_string(),
            vip.to_string(),
            "--quic-server-id".into(),
            hex(&lab_quic_server_id(i, CID.server_id_len)),
            "--quic-rotation".into(),
            CID.rotation.to_string(),
        ]
        .into();
        let p = lab
            .topo
            .start_server(
                i,
                std::path::Path::new(SERVER),
                &name,
                Duration::from_secs(120),
                &args,
            )
            .unwrap_or_else(|e| panic!("starting the QUIC server on {name}: {e:#}"));
        lab.servers.push(p);
    }
    lab
}

/// The streams of a run on the namespace lab: as [`spec`], the second client address added
/// here (on the segment).
fn net_lab_spec(lab: &NetLab, vip: SocketAddr) -> StreamsSpec {
    let (second, prefix): (IpAddr, &str) = if vip.is_ipv6() {
        ("fd00:111::75".parse().unwrap(), "64")
    } else {
        ("10.111.0.75".parse().unwrap(), "24")
    };
    let a = format!("{second}/{prefix}");
    let mut args = vec!["addr", "add", &a, "dev", DEV];
    if vip.is_ipv6() {
        args.push("nodad");
    }
    lab.topo
        .client
        .ns
        .ip(&args)
        .unwrap_or_else(|e| panic!("adding a second client address: {e:#}"));
    let mut s = StreamsSpec::new(vip, STREAMS, TOKENS, INTERVAL_MS);
    s.rebind_after = Some(REBIND_AFTER);
    s.rebind_address = Some(second);
    s
}

fn net_lab_run(lab: &NetLab, vip: SocketAddr) -> Vec<StreamOutcome> {
    let ns = lab.topo.client.ns.clone();
    let sockets = move |addr: Option<IpAddr>, v6: bool| ns.run(move || bind_here(addr, v6))?;
    let t = Instant::now();
    let out = QuicStreams::start(net_lab_spec(lab, vip), &sockets)
        .and_then(QuicStreams::finish)
        .unwrap_or_else(|e| panic!("running the QUIC streams: {e:#}"));
    eprintln!(
        "{} streams in {:?}, per server {:?}:\n{}",
        out.len(),
        t.elapsed(),
        per_server(&out),
        lines(&out)
    );
    out
}

/// The data plane alone (IPv4): with the VIP's connection-ID routing on, every stream stays on
/// its server across its client's move; the packets went by connection ID.
#[test]
fn data_plane_cid_routing_keeps_streams_across_a_rebind() {
    data_plane_cid_routing(vip());
}

/// The same over IPv6.
#[test]
fn data_plane_cid_routing_keeps_streams_across_a_rebind_over_ipv6() {
    data_plane_cid_routing(vip6());
}

fn data_plane_cid_routing(vip: SocketAddr) {
    use lb_common::stat;
    let mut lab = net_lab(vip, true);
    let before = lab.lb_dp.stats().unwrap();
    let out = net_lab_run(&lab, vip);
    let after = lab.lb_dp.stats().unwrap();
    let d = |c: stat::Counter| after[c.index()] - before[c.index()];
    eprintln!(
        "quic_cid_routed {} client_cid {} unknown_server {} unknown_rotation {} malformed {}",
        d(stat::QUIC_CID_ROUTED),
        d(stat::QUIC_CLIENT_CID),
        d(stat::QUIC_UNKNOWN_SERVER),
        d(stat::QUIC_UNKNOWN_ROTATION),
        d(stat::QUIC_MALFORMED)
    );
    assert_all_stayed(&out, "data plane with VIP_F_QUIC_CID");
    assert!(per_server(&out).len() > 1, "{:?}", per_server(&out));
    assert!(d(stat::QUIC_CID_ROUTED) > 0);
    assert_eq!(d(stat::QUIC_UNKNOWN_SERVER), 0);
    assert_eq!(d(stat::QUIC_UNKNOWN_ROTATION), 0);
}

/// The data plane alone, the control: without the flag a move breaks most streams.
#[test]
fn data_plane_five_tuple_breaks_streams_on_a_rebind() {
    let lab = net_lab(vip(), false);
    let out = net_lab_run(&lab, vip());
    assert!(
        out.iter().any(|o| !o.completed() || o.servers.len() != 1),
        "no stream broke or moved across a rebind with 5-tuple steering:\n{}",
        lines(&out)
    );
}

/// Connection-ID routing: every stream completes on the server that greeted it although its
/// client moved to a new port or address mid-stream; the data plane routed its packets by
/// the connection ID (`quic_cid_routed`).
#[test]
fn cid_routing_keeps_streams_on_their_server_across_a_rebind() {
    let lab = start(options(true));
    assert_quic_config(&lab);
    let before = counter(&lab, "quic_cid_routed");
    let out = run(&lab, spec(&lab));
    assert_all_stayed(&out, "with quic = \"cid\"");
    assert!(
        per_server(&out).len() > 1,
        "every stream went to one server, the test shows nothing: {:?}",
        per_server(&out)
    );
    let routed = counter(&lab, "quic_cid_routed") - before;
    assert!(
        routed > (STREAMS as u64) * u64::from(TOKENS - REBIND_AFTER) / 4,
        "only {routed} packets routed by connection ID"
    );
}

/// The control: the same streams through a VIP with plain 5-tuple steering break when their
/// client moves (a new 5-tuple lands on another backend for about two in three).
#[test]
fn five_tuple_steering_breaks_streams_on_a_rebind() {
    let lab = start(options(false));
    let out = run(&lab, spec(&lab));
    let broken: Vec<&StreamOutcome> = out
        .iter()
        .filter(|o| !o.completed() || o.servers.len() != 1)
        .collect();
    assert!(
        !broken.is_empty(),
        "no stream broke or moved across a rebind with 5-tuple steering:\n{}",
        lines(&out)
    );
    eprintln!(
        "{} of {} streams broke or moved with 5-tuple steering",
        broken.len(),
        out.len()
    );
    // Broken after their move, not before: the handshake and first tokens went through.
    for o in &broken {
        assert!(o.tokens >= REBIND_AFTER, "broke before the rebind: {o}");
    }
}

/// A backend drained mid-stream: its streams (and every other) complete across the rebind;
/// a connection ID still reaches a draining backend. The streams outlast the flow idle
/// timeout (3 s here): the LB's connection table holds a QUIC connection only for its
/// Initial packets, so a drain must not be taken as complete (and the backend removed) when
/// the table has no flows of it left while its connections still run.
#[test]
fn a_drained_backends_streams_complete_across_a_rebind() {
    let lab = start(options(true));
    let mut spec = spec(&lab);
    // 6 s streams, moving after 4 s: past the idle timeout of the Initials' table entries.
    spec.tokens = 120;
    spec.rebind_after = Some(80);
    let streams = QuicStreams::start(spec, &*client_sockets(&lab))
        .unwrap_or_else(|e| panic!("starting the streams: {e:#}"));
    let greeted = streams
        .wait_greeted(Duration::from_secs(10))
        .unwrap_or_else(|e| panic!("{e:#}"));
    // The backend of the first stream, so that some stream is on it.
    let drained = first_backend(&lab, &greeted).clone();
    let on_drained = greeted
        .iter()
        .filter(|g| g.as_deref() == Some(drained.name.as_str()))
        .count();
    let out = lab.cli_ok(&["backend", "drain", VIP, &drained.v4.to_string()]);
    assert!(out.contains("draining backend"), "drain said: {out}");
    let out = streams
        .finish()
        .unwrap_or_else(|e| panic!("running the QUIC streams: {e:#}"));
    eprintln!("{on_drained} on the drained backend:\n{}", lines(&out));
    let events: Vec<String> = lab
        .events()
        .iter()
        .filter(|e| e["backend"].as_str() == Some(drained.v4.to_string().as_str()))
        .map(|e| e.to_string())
        .collect();
    let b = lab.backend(VIP, drained.v4.into()).unwrap_or_else(|| {
        panic!(
            "the drained backend was removed while {on_drained} QUIC streams ran on it; its \
             events:\n{}\nstreams:\n{}",
            events.join("\n"),
            lines(&out)
        )
    });
    assert_eq!(b["state"], "draining", "{b}");
    assert_all_stayed(&out, "a backend drained mid-stream");
}

/// The topology backend that greeted the first stream.
fn first_backend<'a>(lab: &'a DaemonLab, greeted: &[Option<String>]) -> &'a Host {
    let name = greeted[0]
        .as_deref()
        .unwrap_or_else(|| panic!("the first stream broke before its greeting"));
    lab.topo.backend(name).expect("a backend of the lab")
}

/// A backend's server killed mid-stream: its streams break, every other completes across
/// the rebind.
#[test]
fn a_killed_backend_breaks_only_its_own_streams() {
    let mut lab = start(options(true));
    let mut spec = spec(&lab);
    spec.tokens = 60;
    spec.rebind_after = Some(30);
    let streams = QuicStreams::start(spec, &*client_sockets(&lab))
        .unwrap_or_else(|e| panic!("starting the streams: {e:#}"));
    let greeted = streams
        .wait_greeted(Duration::from_secs(10))
        .unwrap_or_else(|e| panic!("{e:#}"));
    let victim = first_backend(&lab, &greeted).name.clone();
    let index = lab
        .topo
        .backends
        .iter()
        .position(|b| b.name == victim)
        .unwrap();
    let id = lab.servers[index];
    lab.topo.signal(id, libc::SIGKILL).unwrap();
    let out = streams
        .finish()
        .unwrap_or_else(|e| panic!("running the QUIC streams: {e:#}"));
    eprintln!("greeted by {greeted:?}:\n{}", lines(&out));
    let mut victims = 0;
    for o in &out {
        if o.server() == Some(victim.as_str()) {
            victims += 1;
            assert!(!o.completed(), "survived its server's death: {o}");
        } else {
            assert!(o.completed() && o.servers.len() == 1, "{o}");
        }
    }
    assert!(
        victims > 0,
        "no stream was on {victim}: {:?}",
        per_server(&out)
    );
}

/// The daemon replaced mid-stream (stopped with `keep_dataplane_on_exit`, started again):
/// the data plane keeps routing by connection ID with no per-flow state to lose, and the
/// streams move after the new daemon is up.
#[test]
fn streams_survive_a_daemon_replacement_and_move_after_it() {
    let mut o = options(true);
    o.set("daemon", "keep_dataplane_on_exit", "true");
    let mut lab = start(o);
    let mut spec = spec(&lab);
    spec.tokens = 100;
    spec.rebind_after = Some(70);
    spec.read_timeout = Duration::from_secs(5);
    let streams = QuicStreams::start(spec, &*client_sockets(&lab))
        .unwrap_or_else(|e| panic!("starting the streams: {e:#}"));
    streams
        .wait_greeted(Duration::from_secs(10))
        .unwrap_or_else(|e| panic!("{e:#}"));
    let t = Instant::now();
    let status = lab.stop().unwrap();
    assert!(status.success(), "the daemon exited with {status}");
    lab.start_daemon()
        .unwrap_or_else(|e| panic!("restarting the daemon: {e:#}"));
    eprintln!("daemon replaced in {:?}", t.elapsed());
    let rebound = streams
        .snapshot()
        .iter()
        .filter(|o| o.rebound_to.is_some())
        .count();
    let out = streams
        .finish()
        .unwrap_or_else(|e| panic!("running the QUIC streams: {e:#}"));
    eprintln!("{rebound} streams had moved when the new daemon was up");
    assert_all_stayed(&out, "across a daemon replacement");
}
