//! Packet fixtures: the real `sluice_xdp` / `sluice_decap` programs run through
//! BPF_PROG_TEST_RUN on crafted frames, asserting the XDP action, the exact output bytes and
//! the counter that explains the outcome. Each test is named for the behaviour it proves.

use std::net::IpAddr;

use lb_common::{
    quic, stat, AffinityEntry, AffinityKey, QuicServerKey, TenantLimits, TenantStats, BACKEND_DOWN,
    BACKEND_DRAINING, BACKEND_F_CAPPED, BACKEND_F_FULL, BACKEND_F_GUE, BACKEND_F_NO_AFFINITY,
    CONN_F_CLOSED, CONN_F_HANDSHAKE, PROTO_ICMP, PROTO_ICMPV6, PROTO_IPIP, PROTO_IPV6, PROTO_TCP,
    PROTO_UDP, TENANT_F_CAPPED, TENANT_F_OVER_SHARE, VIP_F_ADMISSION, VIP_F_QUIC_CID,
    VIP_F_SECOND_CHANCE, VIP_F_SHED, VIP_F_SHED_RST, VIP_F_SRC_HASH, VIP_F_TENANTS,
};
use sluice::dataplane::PROG_DECAP;
use sluice_tests::{flow, frames::*, run_prog, tenants::TenantMaps, Lab, FALLBACK_MAC};

const XDP_DROP: u32 = 1;
const XDP_PASS: u32 = 2;
const XDP_TX: u32 = 3;
const XDP_REDIRECT: u32 = 4;

const LB_MAC: Mac = [0x02, 0, 0, 0, 0, 0x01];
const CLIENT_MAC: Mac = [0x02, 0, 0, 0, 0, 0x02];

const VIP4: &str = "10.200.0.1";
const VIP6: &str = "fd00:200::1";
const CLIENT4: &str = "192.0.2.10";
const CLIENT6: &str = "2001:db8:c::10";
const BACKENDS4: [(u32, &str, u32); 3] =
    [(1, "10.1.0.1", 1), (2, "10.1.0.2", 1), (3, "10.1.0.3", 1)];
/// `BACKENDS4` and two more: a table change that moves many flows' ring choice.
const BACKENDS4_GROWN: [(u32, &str, u32); 5] = [
    (1, "10.1.0.1", 1),
    (2, "10.1.0.2", 1),
    (3, "10.1.0.3", 1),
    (4, "10.1.0.4", 1),
    (5, "10.1.0.5", 1),
];
const BACKENDS6: [(u32, &str, u32); 3] = [
    (11, "fd00:1::1", 1),
    (12, "fd00:1::2", 1),
    (13, "fd00:1::3", 1),
];

fn v4_tcp(src: &str, sport: u16, dst: &str, dport: u16, flags: u8, tos: u8) -> Vec<u8> {
    let mut h = V4::new(src, dst, PROTO_TCP);
    h.tos = tos;
    h.build(&tcp(sport, dport, flags, b""))
}

fn on_wire(l3: &[u8]) -> Vec<u8> {
    let ty = if l3[0] >> 4 == 4 { ETH_IP } else { ETH_IPV6 };
    eth(LB_MAC, CLIENT_MAC, ty, l3)
}

/// The frame the data plane must emit for `inner` (an L3 packet) sent to `backend` through
/// the fallback next hop.
fn encapsulated(lab: &Lab, inner: &[u8], backend: IpAddr, h: u32) -> Vec<u8> {
    let inner_v4 = inner[0] >> 4 == 4;
    let next = if inner_v4 { PROTO_IPIP } else { PROTO_IPV6 };
    let tos = if inner_v4 {
        inner[1]
    } else {
        (u16::from_be_bytes([inner[0], inner[1]]) >> 4) as u8
    };
    match backend {
        IpAddr::V4(b) => {
            let IpAddr::V4(src) = lab.outer_src(h, false) else {
                unreachable!()
            };
            let outer = V4 {
                src,
                dst: b,
                proto: next,
                tos,
                ttl: 64,
                frag: 0,
                options: vec![],
            };
            eth(FALLBACK_MAC, LB_MAC, ETH_IP, &outer.build(inner))
        }
        IpAddr::V6(b) => {
            let src = lab.outer_src(h, true).to_string();
            eth(
                FALLBACK_MAC,
                LB_MAC,
                ETH_IPV6,
                &ipv6(&src, &b.to_string(), next, tos, h, inner),
            )
        }
    }
}

/// The frame the data plane must emit for `inner` sent to a GUE `backend` through the
/// fallback next hop, naming the `previous` backends (up to three, most recent first).
fn gue_encapsulated(
    lab: &Lab,
    inner: &[u8],
    backend: IpAddr,
    h: u32,
    previous: &[IpAddr],
) -> Vec<u8> {
    let src = lab.outer_src(h, backend.is_ipv6());
    let sport = 0xc000 | (h as u16 & 0x3fff);
    gue_frame(
        (FALLBACK_MAC, LB_MAC),
        src,
        backend,
        sport,
        h,
        inner,
        previous,
        0,
    )
}

/// A GUE frame as Sluice writes it: UDP to 6080 with checksum 0, GUE version 0 (Hlen in
/// words of private data, inner protocol, no flags), private data 0x53, the `hop` count, two
/// zero bytes and three address fields: the `previous` backends, then zeros.
#[allow(clippy::too_many_arguments)]
fn gue_frame(
    (dmac, smac): (Mac, Mac),
    src: IpAddr,
    dst: IpAddr,
    sport: u16,
    flow_label: u32,
    inner: &[u8],
    previous: &[IpAddr],
    hop: u8,
) -> Vec<u8> {
    let inner_v4 = inner[0] >> 4 == 4;
    let tos = if inner_v4 {
        inner[1]
    } else {
        (u16::from_be_bytes([inner[0], inner[1]]) >> 4) as u8
    };
    assert!(previous.len() <= 3, "three previous backends at most");
    let mut addr: Vec<u8> = Vec::new();
    for p in previous {
        match (dst, p) {
            (IpAddr::V4(_), IpAddr::V4(p)) => addr.extend_from_slice(&p.octets()),
            (IpAddr::V6(_), IpAddr::V6(p)) => addr.extend_from_slice(&p.octets()),
            _ => panic!("previous backend of another family"),
        }
    }
    let width = if dst.is_ipv4() { 4 } else { 16 };
    addr.resize(3 * width, 0);
    let mut tunnel = Vec::new();
    tunnel.extend_from_slice(&sport.to_be_bytes());
    tunnel.extend_from_slice(&6080u16.to_be_bytes());
    let udp_len = (8 + 4 + 4 + addr.len() + inner.len()) as u16;
    tunnel.extend_from_slice(&udp_len.to_be_bytes());
    tunnel.extend_from_slice(&[0, 0]);
    let next = if inner_v4 { PROTO_IPIP } else { PROTO_IPV6 };
    tunnel.extend_from_slice(&[((4 + addr.len()) / 4) as u8, next, 0, 0]);
    tunnel.extend_from_slice(&[0x53, hop, 0, 0]);
    tunnel.extend_from_slice(&addr);
    tunnel.extend_from_slice(inner);
    match (src, dst) {
        (IpAddr::V4(src), IpAddr::V4(b)) => {
            let outer = V4 {
                src,
                dst: b,
                proto: PROTO_UDP,
                tos,
                ttl: 64,
                frag: 0,
                options: vec![],
            };
            eth(dmac, smac, ETH_IP, &outer.build(&tunnel))
        }
        (src, b) => eth(
            dmac,
            smac,
            ETH_IPV6,
            &ipv6(
                &src.to_string(),
                &b.to_string(),
                PROTO_UDP,
                tos,
                flow_label,
                &tunnel,
            ),
        ),
    }
}

fn lab_v4() -> (Lab, lb_common::VipKey) {
    let mut lab = Lab::new();
    let vip = lab.vip(0, VIP4, 443, PROTO_TCP, 0, 0);
    lab.backends(&vip, &BACKENDS4);
    (lab, vip)
}

/// The first client port from `from` whose TCP flow to VIP4:443 the ring gives backend `id`.
fn port_on(lab: &mut Lab, vip: &lb_common::VipKey, id: u32, from: u16) -> u16 {
    (from..60000)
        .find(|&p| lab.ring_choice(vip, &flow(CLIENT4, p, VIP4, 443, PROTO_TCP), false) == id)
        .expect("some port maps to every backend")
}

/// Address of the backend the ring gives this flow.
fn ring_backend(lab: &mut Lab, vip: &lb_common::VipKey, key: &lb_common::FlowKey) -> IpAddr {
    let id = lab.ring_choice(vip, key, false);
    lab.backend_addr(id)
}

/// Sends `l3` from the client and asserts it left encapsulated to the ring's backend.
fn assert_steered(lab: &mut Lab, l3: &[u8], expected_backend: u32, h: u32) {
    let (action, out) = lab.run(&on_wire(l3));
    assert_eq!(action, XDP_TX, "expected XDP_TX");
    let addr = lab.backend_addr(expected_backend);
    assert_eq!(out, encapsulated(lab, l3, addr, h), "output frame differs");
}

#[test]
fn v4_syn_to_vip_is_ipip_encapsulated_to_its_maglev_backend() {
    let (mut lab, vip) = lab_v4();
    let key = flow(CLIENT4, 40000, VIP4, 443, PROTO_TCP);
    let want = lab.ring_choice(&vip, &key, false);
    let h = lab.flow_hash(&key, false);
    let syn = v4_tcp(CLIENT4, 40000, VIP4, 443, SYN, 0x28);
    assert_steered(&mut lab, &syn, want, h);
    assert_eq!(lab.dp.conn(&key).unwrap().unwrap().backend, want);
    assert_eq!(lab.stat(stat::CONN_MISS), 1);
    assert_eq!(lab.stat(stat::FIB_FALLBACK_MAC), 1);
    let vs = lab.dp.vip_stats(0).unwrap();
    assert_eq!(
        (vs.packets, vs.bytes, vs.new_flows),
        (1, syn.len() as u64, 1)
    );
    assert_eq!(lab.dp.backend_stats(want).unwrap().new_flows, 1);
}

#[test]
fn v6_syn_to_vip_is_ipv6_encapsulated_with_flow_label_from_hash() {
    let mut lab = Lab::new();
    let vip = lab.vip(1, VIP6, 443, PROTO_TCP, 0, 0);
    lab.backends(&vip, &BACKENDS6);
    let key = flow(CLIENT6, 40001, VIP6, 443, PROTO_TCP);
    let want = lab.ring_choice(&vip, &key, false);
    let h = lab.flow_hash(&key, false);
    let syn = ipv6(CLIENT6, VIP6, PROTO_TCP, 0, 7, &tcp(40001, 443, SYN, b""));
    assert_steered(&mut lab, &syn, want, h);
}

#[test]
fn v4_vip_on_v6_backends_is_ipv4_in_ipv6() {
    let mut lab = Lab::new();
    let vip = lab.vip(0, VIP4, 443, PROTO_TCP, 0, 0);
    lab.backends(&vip, &BACKENDS6);
    let key = flow(CLIENT4, 40002, VIP4, 443, PROTO_TCP);
    let want = lab.ring_choice(&vip, &key, false);
    let h = lab.flow_hash(&key, false);
    assert_steered(
        &mut lab,
        &v4_tcp(CLIENT4, 40002, VIP4, 443, SYN, 0),
        want,
        h,
    );
}

#[test]
fn udp_flow_to_vip_is_steered_like_tcp() {
    let mut lab = Lab::new();
    let vip = lab.vip(0, VIP4, 443, PROTO_UDP, 0, 0);
    lab.backends(&vip, &BACKENDS4);
    let key = flow(CLIENT4, 50000, VIP4, 443, PROTO_UDP);
    let want = lab.ring_choice(&vip, &key, false);
    let h = lab.flow_hash(&key, false);
    let pkt = V4::new(CLIENT4, VIP4, PROTO_UDP).build(&udp(50000, 443, b"quic initial"));
    assert_steered(&mut lab, &pkt, want, h);
}

#[test]
fn all_ports_vip_matches_any_destination_port() {
    let mut lab = Lab::new();
    let vip = lab.vip(0, VIP4, 0, PROTO_TCP, 0, 0);
    lab.backends(&vip, &BACKENDS4);
    for port in [80, 8000, 65535] {
        let key = flow(CLIENT4, 40003, VIP4, port, PROTO_TCP);
        let want = lab.ring_choice(&vip, &key, false);
        let h = lab.flow_hash(&key, false);
        assert_steered(
            &mut lab,
            &v4_tcp(CLIENT4, 40003, VIP4, port, SYN, 0),
            want,
            h,
        );
    }
}

#[test]
fn established_flow_keeps_its_backend_after_backends_are_added_and_removed() {
    let (mut lab, vip) = lab_v4();
    // Find flows whose ring choice changes when the backend set changes.
    let changed: Vec<u16> = (41000..42000)
        .filter(|&p| {
            let k = flow(CLIENT4, p, VIP4, 443, PROTO_TCP);
            lab.ring_choice(&vip, &k, false) == 1
        })
        .take(40)
        .collect();
    let mut before = vec![];
    for &p in &changed {
        let (a, _) = lab.run(&on_wire(&v4_tcp(CLIENT4, p, VIP4, 443, SYN, 0)));
        assert_eq!(a, XDP_TX);
        before.push(
            lab.dp
                .conn(&flow(CLIENT4, p, VIP4, 443, PROTO_TCP))
                .unwrap()
                .unwrap()
                .backend,
        );
    }
    // Backend 3 leaves, four arrive: the ring moves many of these flows elsewhere.
    lab.set_state(3, BACKEND_DOWN);
    lab.backends(
        &vip,
        &[
            (1, "10.1.0.1", 1),
            (2, "10.1.0.2", 1),
            (4, "10.1.0.4", 1),
            (5, "10.1.0.5", 1),
            (6, "10.1.0.6", 1),
            (7, "10.1.0.7", 1),
        ],
    );
    let mut moved_in_ring = 0;
    for (&p, &b) in changed.iter().zip(&before) {
        let key = flow(CLIENT4, p, VIP4, 443, PROTO_TCP);
        if lab.ring_choice(&vip, &key, false) != b {
            moved_in_ring += 1;
        }
        let h = lab.flow_hash(&key, false);
        assert_steered(&mut lab, &v4_tcp(CLIENT4, p, VIP4, 443, ACK, 0), b, h);
    }
    assert!(
        moved_in_ring > 10,
        "the new table must move some of these flows ({moved_in_ring})"
    );
    assert_eq!(lab.stat(stat::CONN_HIT), changed.len() as u64);
}

#[test]
fn client_affinity_vip_sends_every_source_port_of_a_client_to_one_backend() {
    let mut lab = Lab::new();
    let vip = lab.vip(0, VIP4, 443, PROTO_TCP, VIP_F_SRC_HASH, 0);
    lab.backends(&vip, &BACKENDS4);
    let mut seen = std::collections::BTreeSet::new();
    for client in [
        "192.0.2.1",
        "192.0.2.2",
        "192.0.2.3",
        "192.0.2.4",
        "192.0.2.5",
        "192.0.2.6",
    ] {
        let key = flow(client, 1, VIP4, 443, PROTO_TCP);
        let want = lab.ring_choice(&vip, &key, true);
        seen.insert(want);
        for sport in [1000, 2000, 3000] {
            let k = flow(client, sport, VIP4, 443, PROTO_TCP);
            let h = lab.flow_hash(&k, true);
            assert_steered(&mut lab, &v4_tcp(client, sport, VIP4, 443, SYN, 0), want, h);
        }
    }
    assert!(
        seen.len() > 1,
        "different clients should not all share one backend"
    );
}

#[test]
fn affinity_window_keeps_a_reconnecting_client_on_its_backend_after_a_table_change() {
    let mut lab = Lab::new();
    let vip = lab.vip(0, VIP4, 443, PROTO_TCP, 0, 600);
    lab.backends(&vip, &BACKENDS4);
    let first = flow(CLIENT4, 1000, VIP4, 443, PROTO_TCP);
    let (a, _) = lab.run(&on_wire(&v4_tcp(CLIENT4, 1000, VIP4, 443, SYN, 0)));
    assert_eq!(a, XDP_TX);
    let b = lab.dp.conn(&first).unwrap().unwrap().backend;
    // More backends: most new 5-tuples would hash elsewhere, yet the client returns to `b`.
    lab.backends(&vip, &BACKENDS4_GROWN);
    for sport in 2000..2010 {
        let (a, _) = lab.run(&on_wire(&v4_tcp(CLIENT4, sport, VIP4, 443, SYN, 0)));
        assert_eq!(a, XDP_TX);
        let k = flow(CLIENT4, sport, VIP4, 443, PROTO_TCP);
        assert_eq!(lab.dp.conn(&k).unwrap().unwrap().backend, b);
    }
    assert_eq!(lab.stat(stat::AFFINITY_HIT), 10);
}

/// The affinity window counts from the client's last packet, not its last new session: a
/// stream longer than the window keeps its client's entry fresh (a packet a second does), so
/// the conversation's next turn still finds the backend, through a table change too; an
/// entry that names another backend (the client's newer session) is left as it is.
#[test]
fn affinity_window_counts_from_the_clients_last_packet_not_its_last_new_session() {
    const SEC: u64 = 1_000_000_000;
    let mut lab = Lab::new();
    let vip = lab.vip(0, VIP4, 443, PROTO_TCP, 0, 10);
    lab.backends(&vip, &BACKENDS4);
    let (a, _) = lab.run(&on_wire(&v4_tcp(CLIENT4, 1000, VIP4, 443, SYN, 0)));
    assert_eq!(a, XDP_TX);
    let first = flow(CLIENT4, 1000, VIP4, 443, PROTO_TCP);
    let mut conn = lab.dp.conn(&first).unwrap().unwrap();
    let b = conn.backend;
    let akey = AffinityKey {
        addr: first.src,
        vip: 0, // the id `lab.vip` was given
    };
    let mut entry = lab
        .dp
        .affinity(&akey)
        .unwrap()
        .expect("the SYN wrote an entry");
    assert_eq!(entry.backend, b);
    // The stream began 20 s ago, twice the window, and is still sending.
    conn.last_seen_ns -= 20 * SEC;
    entry.last_seen_ns -= 20 * SEC;
    lab.dp.set_conn(&first, &conn).unwrap();
    lab.dp.set_affinity(&akey, &entry).unwrap();
    let h = lab.flow_hash(&first, false);
    assert_steered(&mut lab, &v4_tcp(CLIENT4, 1000, VIP4, 443, ACK, 0), b, h);
    let fresh = lab.dp.affinity(&akey).unwrap().unwrap();
    assert!(
        fresh.last_seen_ns >= entry.last_seen_ns + 20 * SEC,
        "the stream's packet did not refresh its client's entry ({} -> {})",
        entry.last_seen_ns,
        fresh.last_seen_ns
    );
    // The next turn, after a table change, returns to `b`.
    lab.backends(&vip, &BACKENDS4_GROWN);
    let port = (2000..60000)
        .find(|&p| lab.ring_choice(&vip, &flow(CLIENT4, p, VIP4, 443, PROTO_TCP), false) != b)
        .expect("some port maps elsewhere");
    let next = flow(CLIENT4, port, VIP4, 443, PROTO_TCP);
    let h = lab.flow_hash(&next, false);
    assert_steered(&mut lab, &v4_tcp(CLIENT4, port, VIP4, 443, SYN, 0), b, h);
    assert_eq!(lab.stat(stat::AFFINITY_HIT), 1);
    // An entry naming another backend is not the old stream's to refresh.
    let other = AffinityEntry {
        backend: if b == 1 { 2 } else { 1 },
        _pad: 0,
        last_seen_ns: fresh.last_seen_ns - 20 * SEC,
    };
    lab.dp.set_affinity(&akey, &other).unwrap();
    let mut conn = lab.dp.conn(&first).unwrap().unwrap();
    conn.last_seen_ns -= 20 * SEC;
    lab.dp.set_conn(&first, &conn).unwrap();
    let h = lab.flow_hash(&first, false);
    assert_steered(&mut lab, &v4_tcp(CLIENT4, 1000, VIP4, 443, ACK, 0), b, h);
    assert_eq!(lab.dp.affinity(&akey).unwrap().unwrap(), other);
}

#[test]
fn affinity_entry_brings_no_new_session_to_a_backend_moved_to_weight_zero() {
    let mut lab = Lab::new();
    let vip = lab.vip(0, VIP4, 443, PROTO_TCP, 0, 600);
    lab.backends(&vip, &BACKENDS4);
    let (a, _) = lab.run(&on_wire(&v4_tcp(CLIENT4, 1000, VIP4, 443, SYN, 0)));
    assert_eq!(a, XDP_TX);
    let first = flow(CLIENT4, 1000, VIP4, 443, PROTO_TCP);
    let b = lab.dp.conn(&first).unwrap().unwrap().backend;
    // The policy moves `b` away: weight 0 (no ring slot) and flagged, state still active.
    let rest: Vec<(u32, &str, u32)> = BACKENDS4
        .iter()
        .map(|&(id, addr, w)| (id, addr, if id == b { 0 } else { w }))
        .collect();
    lab.backends(&vip, &rest);
    lab.set_flags(b, BACKEND_F_NO_AFFINITY);
    for sport in 2000..2010 {
        let (a, _) = lab.run(&on_wire(&v4_tcp(CLIENT4, sport, VIP4, 443, SYN, 0)));
        assert_eq!(a, XDP_TX);
        let k = flow(CLIENT4, sport, VIP4, 443, PROTO_TCP);
        let now = lab.dp.conn(&k).unwrap().unwrap().backend;
        assert_ne!(
            now, b,
            "the client's next session went to the moved-away backend"
        );
    }
    assert_eq!(
        lab.stat(stat::AFFINITY_HIT),
        9,
        "re-pinned to the new backend after one miss"
    );
    // The established flow stays where it was.
    let h = lab.flow_hash(&first, false);
    assert_steered(&mut lab, &v4_tcp(CLIENT4, 1000, VIP4, 443, ACK, 0), b, h);
}

/// A conversation's next turn (a new session from the same client) finds its prefix cached
/// on the backend of its earlier turns: a backend only saturated (full) keeps it, while new
/// clients probe past; the operator's cap and a fault (no affinity) send it where the ring
/// says.
#[test]
fn affinity_entry_stands_on_a_saturated_backend_but_not_at_its_cap_or_after_a_fault() {
    for (flags, stays) in [
        (BACKEND_F_FULL, true),
        (BACKEND_F_FULL | BACKEND_F_CAPPED, false),
        (BACKEND_F_FULL | BACKEND_F_NO_AFFINITY, false),
        (BACKEND_F_NO_AFFINITY, false),
    ] {
        let mut lab = Lab::new();
        let vip = lab.vip(0, VIP4, 443, PROTO_TCP, 0, 600);
        lab.backends(&vip, &BACKENDS4);
        let (a, _) = lab.run(&on_wire(&v4_tcp(CLIENT4, 1000, VIP4, 443, SYN, 0)));
        assert_eq!(a, XDP_TX);
        let b = lab
            .dp
            .conn(&flow(CLIENT4, 1000, VIP4, 443, PROTO_TCP))
            .unwrap()
            .unwrap()
            .backend;
        lab.set_flags(b, flags);
        // Full: a port whose first probe is `b`, so the turn that leaves it is probed past
        // it. Not full: one whose ring choice is another backend, where the turn goes.
        let port = if flags & BACKEND_F_FULL != 0 {
            port_on(&mut lab, &vip, b, 2000)
        } else {
            (2000..60000)
                .find(|&p| {
                    lab.ring_choice(&vip, &flow(CLIENT4, p, VIP4, 443, PROTO_TCP), false) != b
                })
                .expect("some port maps elsewhere")
        };
        let key = flow(CLIENT4, port, VIP4, 443, PROTO_TCP);
        let next = *lab.probes(&vip, &key).iter().find(|&&id| id != b).unwrap();
        let h = lab.flow_hash(&key, false);
        let want = if stays { b } else { next };
        assert_steered(&mut lab, &v4_tcp(CLIENT4, port, VIP4, 443, SYN, 0), want, h);
        let hits = u64::from(stays);
        assert_eq!(
            (
                lab.stat(stat::AFFINITY_HIT),
                lab.stat(stat::AFFINITY_HIT_SATURATED)
            ),
            (hits, hits),
            "flags {flags:#x}"
        );
        // A new client whose first probe is `b` probes past it while it is full.
        if flags & BACKEND_F_FULL != 0 {
            let client = (1..=250)
                .map(|i| format!("192.0.2.{i}"))
                .filter(|c| c != CLIENT4)
                .find(|c| {
                    let k = flow(c, 3000, VIP4, 443, PROTO_TCP);
                    let p = lab.probes(&vip, &k);
                    p[0] == b && p.iter().any(|&id| id != b)
                })
                .expect("some client probes `b` first");
            let k = flow(&client, 3000, VIP4, 443, PROTO_TCP);
            let past = *lab.probes(&vip, &k).iter().find(|&&id| id != b).unwrap();
            let h = lab.flow_hash(&k, false);
            assert_steered(&mut lab, &v4_tcp(&client, 3000, VIP4, 443, SYN, 0), past, h);
        }
    }
}

#[test]
fn draining_backend_takes_no_new_flow_but_keeps_its_established_one() {
    let (mut lab, vip) = lab_v4();
    let old = port_on(&mut lab, &vip, 2, 1000);
    lab.run(&on_wire(&v4_tcp(CLIENT4, old, VIP4, 443, SYN, 0)));
    lab.set_state(2, BACKEND_DRAINING);
    // The established flow stays.
    let key = flow(CLIENT4, old, VIP4, 443, PROTO_TCP);
    let h = lab.flow_hash(&key, false);
    assert_steered(&mut lab, &v4_tcp(CLIENT4, old, VIP4, 443, ACK, 0), 2, h);
    // A new flow whose ring slot is the draining backend goes to its next probe.
    let new = port_on(&mut lab, &vip, 2, old + 1);
    let nkey = flow(CLIENT4, new, VIP4, 443, PROTO_TCP);
    let next = *lab.probes(&vip, &nkey).iter().find(|&&id| id != 2).unwrap();
    let h = lab.flow_hash(&nkey, false);
    assert_steered(&mut lab, &v4_tcp(CLIENT4, new, VIP4, 443, SYN, 0), next, h);
    assert!(lab.stat(stat::PROBE_SKIP) >= 1);
}

/// A client that reuses a 5-tuple opens a new connection while the old one's entry is still
/// in the table. Its SYN follows the entry only while the backend keeps its clients (a
/// retransmitted SYN stays); to a draining backend, or one moved away (out of the ring,
/// `BACKEND_F_NO_AFFINITY`), it goes where a new session would, and the entry goes with it.
#[test]
fn a_syn_reusing_the_5_tuple_of_a_draining_or_moved_away_backend_is_a_new_session() {
    type Leave = fn(&mut Lab, &lb_common::VipKey);
    let cases: [(&str, Leave); 2] = [
        ("draining", |lab, _| lab.set_state(2, BACKEND_DRAINING)),
        ("moved away", |lab, vip| {
            lab.backends(vip, &[BACKENDS4[0], BACKENDS4[2]]);
            lab.set_flags(2, BACKEND_F_NO_AFFINITY);
        }),
    ];
    for (what, leave) in cases {
        let (mut lab, vip) = lab_v4();
        let p = port_on(&mut lab, &vip, 2, 1000);
        let key = flow(CLIENT4, p, VIP4, 443, PROTO_TCP);
        let h = lab.flow_hash(&key, false);
        let syn = v4_tcp(CLIENT4, p, VIP4, 443, SYN, 0);
        let ack = v4_tcp(CLIENT4, p, VIP4, 443, ACK, 0);
        assert_steered(&mut lab, &syn, 2, h);
        assert_steered(&mut lab, &syn, 2, h);
        assert_eq!(lab.stat(stat::CONN_HIT), 1, "{what}: the retransmitted SYN");
        leave(&mut lab, &vip);
        // The old connection's packets stay; the new connection's SYN moves.
        assert_steered(&mut lab, &ack, 2, h);
        let next = *lab.probes(&vip, &key).iter().find(|&&id| id != 2).unwrap();
        assert_steered(&mut lab, &syn, next, h);
        assert_eq!(lab.stat(stat::CONN_REOPEN_RESTEER), 1, "{what}");
        assert_eq!(lab.stat(stat::CONN_MISS), 1, "{what}: only the first SYN");
        assert_eq!(lab.dp.conn(&key).unwrap().unwrap().backend, next, "{what}");
        assert_steered(&mut lab, &ack, next, h);
        assert_eq!(lab.dp.backend_stats(next).unwrap().new_flows, 1, "{what}");
    }
}

#[test]
fn down_backend_flow_is_resteered_to_the_current_table_choice() {
    let (mut lab, vip) = lab_v4();
    let p = port_on(&mut lab, &vip, 3, 1000);
    lab.run(&on_wire(&v4_tcp(CLIENT4, p, VIP4, 443, SYN, 0)));
    lab.set_state(3, BACKEND_DOWN);
    lab.backends(&vip, &BACKENDS4[..2]);
    let key = flow(CLIENT4, p, VIP4, 443, PROTO_TCP);
    let want = lab.ring_choice(&vip, &key, false);
    assert_ne!(want, 3);
    let h = lab.flow_hash(&key, false);
    assert_steered(&mut lab, &v4_tcp(CLIENT4, p, VIP4, 443, ACK, 0), want, h);
    assert_eq!(lab.stat(stat::CONN_RESTEER_DOWN), 1);
    assert_eq!(lab.dp.conn(&key).unwrap().unwrap().backend, want);
}

/// A connection entry whose backend id was freed and reused for another VIP (a new backend
/// elsewhere) is not followed: the flow re-steers within its own VIP, never reaching the
/// other VIP's backend.
#[test]
fn a_stale_backend_id_reused_by_another_vip_is_never_reached() {
    let (mut lab, vip) = lab_v4();
    let p = port_on(&mut lab, &vip, 3, 1000);
    lab.run(&on_wire(&v4_tcp(CLIENT4, p, VIP4, 443, SYN, 0)));
    let key = flow(CLIENT4, p, VIP4, 443, PROTO_TCP);
    assert_eq!(lab.dp.conn(&key).unwrap().unwrap().backend, 3);
    // Backend 3 leaves VIP 0 and its id goes to a backend of VIP 1, still active.
    lab.backends(&vip, &BACKENDS4[..2]);
    let other = lab.vip(1, "10.200.0.2", 443, PROTO_TCP, 0, 0);
    lab.backends(&other, &[(3, "10.9.0.3", 1)]);
    let want = lab.ring_choice(&vip, &key, false);
    assert!(want == 1 || want == 2, "{want}");
    let h = lab.flow_hash(&key, false);
    assert_steered(&mut lab, &v4_tcp(CLIENT4, p, VIP4, 443, ACK, 0), want, h);
    assert_eq!(lab.stat(stat::CONN_RESTEER_DOWN), 1);
    assert_eq!(lab.dp.conn(&key).unwrap().unwrap().backend, want);
    assert_eq!(
        lab.dp.backend_stats(3).unwrap().new_flows,
        1,
        "only the SYN"
    );
}

/// An IPv6 client packet cannot ride an IPv4 tunnel: a VIP given an IPv4 backend for IPv6
/// traffic (the control plane refuses it; the maps could still hold it) drops and counts.
#[test]
fn ipv6_traffic_to_an_ipv4_backend_is_dropped_as_a_bad_backend() {
    let mut lab = Lab::new();
    let vip6 = lab.vip(1, VIP6, 443, PROTO_TCP, 0, 0);
    lab.backends(&vip6, &[(11, "10.1.0.1", 1)]);
    let syn6 = on_wire(&ipv6(
        CLIENT6,
        VIP6,
        PROTO_TCP,
        0,
        0,
        &tcp(41000, 443, SYN, b""),
    ));
    assert_eq!(lab.run(&syn6).0, XDP_DROP);
    assert_eq!(lab.stat(stat::DROP_BAD_BACKEND), 1);
    assert_eq!(lab.stat(stat::TX), 0);
}

/// Without a FIB route to the backend and without a fallback router MAC there is nowhere to
/// send the encapsulated packet: dropped and counted.
#[test]
fn no_fib_route_and_no_fallback_mac_drops_as_no_next_hop() {
    let (mut lab, _vip) = lab_v4();
    lab.cfg.fallback_mac = [0; 6];
    let cfg = lab.cfg;
    lab.dp.set_config(&cfg).unwrap();
    let syn = on_wire(&v4_tcp(CLIENT4, 41001, VIP4, 443, SYN, 0));
    assert_eq!(lab.run(&syn).0, XDP_DROP);
    assert_eq!(lab.stat(stat::DROP_NO_NEXTHOP), 1);
    assert_eq!(
        (lab.stat(stat::TX), lab.stat(stat::FIB_FALLBACK_MAC)),
        (0, 0)
    );
}

/// A VIP shed by priority refuses new sessions only: a mid-stream packet whose connection
/// entry was lost (evicted, or the LB restarted without its pins) is steered, not cut.
#[test]
fn shedding_by_priority_never_cuts_a_stream_whose_entry_was_lost() {
    let mut lab = Lab::new();
    let vip = lab.vip(0, VIP4, 443, PROTO_TCP, VIP_F_SHED | VIP_F_SHED_RST, 0);
    lab.backends(&vip, &BACKENDS4);
    // ACK, ACK+PSH and FIN+ACK (0x01 is FIN).
    for (k, flags) in [ACK, ACK | PSH, 0x01 | ACK].into_iter().enumerate() {
        let sport = 42000 + k as u16;
        let key = flow(CLIENT4, sport, VIP4, 443, PROTO_TCP);
        let want = lab.ring_choice(&vip, &key, false);
        let h = lab.flow_hash(&key, false);
        assert_steered(
            &mut lab,
            &v4_tcp(CLIENT4, sport, VIP4, 443, flags, 0),
            want,
            h,
        );
    }
    assert_eq!(
        (lab.stat(stat::SHED_PRIORITY), lab.stat(stat::SHED_RST_SENT)),
        (0, 0)
    );
    // A SYN of the same VIP is shed: the flag is in force.
    let (a, _) = lab.run(&on_wire(&v4_tcp(CLIENT4, 42010, VIP4, 443, SYN, 0)));
    assert_eq!((a, lab.stat(stat::SHED_PRIORITY)), (XDP_TX, 1));
}

#[test]
fn vip_without_backends_drops_and_counts() {
    let mut lab = Lab::new();
    lab.vip(0, VIP4, 443, PROTO_TCP, 0, 0);
    let frame = on_wire(&v4_tcp(CLIENT4, 1, VIP4, 443, SYN, 0));
    assert_eq!(lab.run(&frame).0, XDP_DROP);
    assert_eq!(lab.stat(stat::DROP_NO_BACKEND), 1);
}

#[test]
fn icmp_fragmentation_needed_follows_the_flow_it_quotes() {
    let (mut lab, _vip) = lab_v4();
    let key = flow(CLIENT4, 40100, VIP4, 443, PROTO_TCP);
    lab.run(&on_wire(&v4_tcp(CLIENT4, 40100, VIP4, 443, SYN, 0)));
    let b = lab.dp.conn(&key).unwrap().unwrap().backend;
    // The backend's reply (VIP:443 -> client) hit a small MTU; a router reports it to the VIP.
    let quoted = v4_tcp(VIP4, 443, CLIENT4, 40100, ACK, 0);
    let icmp =
        V4::new("198.51.100.1", VIP4, PROTO_ICMP).build(&icmp_error(3, 4, 1400, &quoted[..28]));
    let h = lab.flow_hash(&key, false);
    assert_steered(&mut lab, &icmp, b, h);
    assert_eq!(lab.stat(stat::ICMP_TOO_BIG_STEERED), 1);
    assert_eq!(lab.stat(stat::CONN_HIT), 1);
}

#[test]
fn icmpv6_packet_too_big_follows_the_flow_it_quotes() {
    let mut lab = Lab::new();
    let vip = lab.vip(1, VIP6, 443, PROTO_TCP, 0, 0);
    lab.backends(&vip, &BACKENDS6);
    let key = flow(CLIENT6, 40101, VIP6, 443, PROTO_TCP);
    lab.run(&on_wire(&ipv6(
        CLIENT6,
        VIP6,
        PROTO_TCP,
        0,
        0,
        &tcp(40101, 443, SYN, b""),
    )));
    let b = lab.dp.conn(&key).unwrap().unwrap().backend;
    let quoted = ipv6(VIP6, CLIENT6, PROTO_TCP, 0, 0, &tcp(443, 40101, ACK, b"x"));
    let icmp = ipv6(
        "2001:db8:ffff::1",
        VIP6,
        PROTO_ICMPV6,
        0,
        0,
        &icmp_error(2, 0, 1280, &quoted[..48]),
    );
    let h = lab.flow_hash(&key, false);
    assert_steered(&mut lab, &icmp, b, h);
}

#[test]
fn vlan_tagged_vip_traffic_is_steered_and_leaves_untagged() {
    let (mut lab, vip) = lab_v4();
    let l3 = v4_tcp(CLIENT4, 40200, VIP4, 443, SYN, 0);
    let key = flow(CLIENT4, 40200, VIP4, 443, PROTO_TCP);
    let want = lab.ring_choice(&vip, &key, false);
    let h = lab.flow_hash(&key, false);
    let addr = lab.backend_addr(want);
    let expect = encapsulated(&lab, &l3, addr, h);
    let single = vlan_tag(&on_wire(&l3), 0x8100, 100);
    let double = vlan_tag(&single, 0x88a8, 200);
    for frame in [single, double] {
        let (a, out) = lab.run(&frame);
        assert_eq!(a, XDP_TX);
        assert_eq!(out, expect);
    }
}

#[test]
fn ipv4_options_and_ipv6_extension_headers_are_skipped_and_carried() {
    let (mut lab, vip) = lab_v4();
    let mut h4 = V4::new(CLIENT4, VIP4, PROTO_TCP);
    h4.options = vec![0x01, 0x01, 0x01, 0x00]; // NOP, NOP, NOP, EOL
    let l3 = h4.build(&tcp(40300, 443, SYN, b""));
    let key = flow(CLIENT4, 40300, VIP4, 443, PROTO_TCP);
    let want = lab.ring_choice(&vip, &key, false);
    let h = lab.flow_hash(&key, false);
    assert_steered(&mut lab, &l3, want, h);

    let vip6 = lab.vip(1, VIP6, 443, PROTO_TCP, 0, 0);
    lab.backends(&vip6, &BACKENDS6);
    // Hop-by-hop (PadN) then destination options (PadN), then TCP.
    let mut ext = vec![60, 0, 1, 4, 0, 0, 0, 0];
    ext.extend_from_slice(&[PROTO_TCP, 0, 1, 4, 0, 0, 0, 0]);
    ext.extend_from_slice(&tcp(40301, 443, SYN, b""));
    let l3 = ipv6(CLIENT6, VIP6, 0, 0, 0, &ext);
    let key = flow(CLIENT6, 40301, VIP6, 443, PROTO_TCP);
    let want = lab.ring_choice(&vip6, &key, false);
    let h = lab.flow_hash(&key, false);
    assert_steered(&mut lab, &l3, want, h);
}

#[test]
fn flood_guard_stops_inserting_new_flows_above_the_rate() {
    let (mut lab, _vip) = lab_v4();
    lab.cfg.flood_new_flows_per_sec = 3;
    let cfg = lab.cfg;
    lab.dp.set_config(&cfg).unwrap();
    for p in 0..5u16 {
        assert_eq!(
            lab.run(&on_wire(&v4_tcp(CLIENT4, 7000 + p, VIP4, 443, SYN, 0)))
                .0,
            XDP_TX
        );
    }
    assert_eq!(lab.stat(stat::FLOOD_BYPASS), 2);
    assert_eq!(lab.dp.conns().unwrap().len(), 3);
}

/// The FIB segment of these fixtures: the three IPv4 and three IPv6 backends.
fn fib_segment(mtu: u32) -> u32 {
    let backends: Vec<IpAddr> = ["10.1.0.1", "10.1.0.2", "10.1.0.3"]
        .into_iter()
        .chain(["fd00:1::1", "fd00:1::2", "fd00:1::3"])
        .map(ip)
        .collect();
    sluice_tests::fib_segment(mtu, &backends)
}

#[test]
fn packet_too_big_for_the_backend_path_gets_an_exact_icmp_too_big_from_the_vip() {
    let (mut lab, _vip) = lab_v4();
    let vip6 = lab.vip(1, VIP6, 443, PROTO_TCP, 0, 0);
    lab.backends(&vip6, &BACKENDS6);
    let ifindex = fib_segment(1400);
    lab.dp.add_tx_port(ifindex).unwrap();
    let l3 = |len: usize, df: bool| {
        let mut h = V4::new(CLIENT4, VIP4, PROTO_TCP);
        h.frag = if df { 0x4000 } else { 0 };
        h.build(&tcp(40600, 443, ACK, &vec![0u8; len - 40]))
    };
    // Fits: 1380 + 20 <= 1400.
    assert_eq!(lab.run(&on_wire(&l3(1380, true))).0, XDP_REDIRECT);
    // 1381 + 20 does not: "fragmentation needed", next-hop MTU 1380, quoting 28 bytes.
    let big = l3(1381, true);
    let (a, out) = lab.run(&on_wire(&big));
    assert_eq!(a, XDP_TX);
    let mut ip4 = V4::new(VIP4, CLIENT4, PROTO_ICMP);
    ip4.frag = 0;
    let msg = icmp_checksummed(icmp_error(3, 4, 1380, &big[..28]), None);
    assert_eq!(out, eth(CLIENT_MAC, LB_MAC, ETH_IP, &ip4.build(&msg)));
    // Without DF the client cannot act on it: dropped and counted.
    assert_eq!(lab.run(&on_wire(&l3(1381, false))).0, XDP_DROP);
    assert_eq!(lab.stat(stat::ICMP_TOO_BIG_SENT), 1);
    assert_eq!(lab.stat(stat::DROP_FRAG_NEEDED), 1);

    // IPv6 over IPv6: 1361 + 40 > 1400: "packet too big", MTU 1360, quoting 48 bytes.
    let big6 = ipv6(
        CLIENT6,
        VIP6,
        PROTO_TCP,
        0,
        0,
        &tcp(40601, 443, ACK, &vec![0u8; 1361 - 60]),
    );
    let (a, out) = lab.run(&on_wire(&big6));
    assert_eq!(a, XDP_TX);
    let msg6 = icmp_checksummed(icmp_error(2, 0, 1360, &big6[..48]), Some((VIP6, CLIENT6)));
    let mut expect = eth(
        CLIENT_MAC,
        LB_MAC,
        ETH_IPV6,
        &ipv6(VIP6, CLIENT6, PROTO_ICMPV6, 0, 0, &msg6),
    );
    expect[14 + 7] = 64;
    assert_eq!(out, expect);
    assert_eq!(lab.stat(stat::ICMP_TOO_BIG_SENT), 2);
}

/// Traffic counters move only for packets sent to that backend: a frame answered with a
/// too-big, or dropped because it does not fit and may not be fragmented, never reached it.
#[test]
fn a_frame_that_never_reaches_its_backend_is_not_its_traffic() {
    let (mut lab, _vip) = lab_v4();
    let vip6 = lab.vip(1, VIP6, 443, PROTO_TCP, 0, 0);
    lab.backends(&vip6, &BACKENDS6);
    let ifindex = fib_segment(1400);
    lab.dp.add_tx_port(ifindex).unwrap();
    let l3 = |port: u16, len: usize, df: bool| {
        let mut h = V4::new(CLIENT4, VIP4, PROTO_TCP);
        h.frag = if df { 0x4000 } else { 0 };
        h.build(&tcp(port, 443, ACK, &vec![0u8; len - 40]))
    };
    let big6 = ipv6(
        CLIENT6,
        VIP6,
        PROTO_TCP,
        0,
        0,
        &tcp(40601, 443, ACK, &vec![0u8; 1361 - 60]),
    );
    assert_eq!(lab.run(&on_wire(&l3(40600, 1381, true))).0, XDP_TX);
    assert_eq!(lab.run(&on_wire(&l3(40600, 1381, false))).0, XDP_DROP);
    assert_eq!(lab.run(&on_wire(&big6)).0, XDP_TX);
    assert_eq!(lab.stat(stat::ICMP_TOO_BIG_SENT), 2);
    assert_eq!(lab.stat(stat::DROP_FRAG_NEEDED), 1);
    let backend_packets = |lab: &mut Lab| -> u64 {
        BACKENDS4
            .iter()
            .chain(&BACKENDS6)
            .map(|(id, _, _)| lab.dp.backend_stats(*id).unwrap().packets)
            .sum()
    };
    for vip in [0, 1] {
        let v = lab.dp.vip_stats(vip).unwrap();
        assert_eq!((v.packets, v.bytes, v.new_flows), (0, 0, 0), "VIP {vip}");
    }
    assert_eq!(backend_packets(&mut lab), 0);

    // One that fits, of another flow, is its backend's traffic and a new flow there,
    // counted at the client's IP length.
    assert_eq!(lab.run(&on_wire(&l3(40602, 1380, true))).0, XDP_REDIRECT);
    let v = lab.dp.vip_stats(0).unwrap();
    assert_eq!((v.packets, v.bytes, v.new_flows), (1, 1380, 1));
    assert_eq!(backend_packets(&mut lab), 1);
}

#[test]
fn fib_next_hop_redirects_through_the_devmap() {
    let (mut lab, vip) = lab_v4();
    let ifindex = fib_segment(1500);
    lab.dp.add_tx_port(ifindex).unwrap();
    let key = flow(CLIENT4, 40400, VIP4, 443, PROTO_TCP);
    let want = lab.ring_choice(&vip, &key, false);
    let h = lab.flow_hash(&key, false);
    let l3 = v4_tcp(CLIENT4, 40400, VIP4, 443, SYN, 0);
    let (a, out) = lab.run(&on_wire(&l3));
    assert_eq!(a, XDP_REDIRECT);
    let addr = lab.backend_addr(want);
    let mut expect = encapsulated(&lab, &l3, addr, h);
    expect[0..6].copy_from_slice(&[0x02, 0, 0, 0, 0x0b, want as u8]);
    expect[6..12].copy_from_slice(&[0x02, 0, 0, 0, 0x0a, 0x0a]);
    assert_eq!(out, expect);
    assert_eq!(lab.stat(stat::REDIRECT), 1);
    assert_eq!(lab.stat(stat::FIB_FALLBACK_MAC), 0);
}

/// Frames that are not Sluice's to steer: each passes byte-identical and bumps its counter.
#[test]
fn frames_not_steered_pass_untouched_and_are_counted() {
    let (mut lab, _vip) = lab_v4();
    let vip6 = lab.vip(1, VIP6, 443, PROTO_TCP, 0, 0);
    lab.backends(&vip6, &BACKENDS6);
    let arp = eth([0xff; 6], CLIENT_MAC, ETH_ARP, &[0u8; 28]);
    let ns = ipv6(
        CLIENT6,
        "ff02::1:ff00:1",
        PROTO_ICMPV6,
        0,
        0,
        &[
            135, 0, 0, 0, 0, 0, 0, 0, 0xfd, 0, 2, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 1,
        ],
    );
    let mut frag = V4::new(CLIENT4, VIP4, PROTO_TCP);
    frag.frag = 0x2000; // more fragments
    let mut later_frag = V4::new(CLIENT4, VIP4, PROTO_TCP);
    later_frag.frag = 0x0010;
    let frag6 = ipv6(
        CLIENT6,
        VIP6,
        44,
        0,
        0,
        &[PROTO_TCP, 0, 0, 1, 0, 0, 0, 1, 0, 0, 0, 0],
    );
    let gre = V4::new(CLIENT4, VIP4, 47).build(&[0u8; 8]);
    let echo = V4::new(CLIENT4, VIP4, PROTO_ICMP).build(&[
        8, 0, 0, 0, 0, 1, 0, 1, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0,
    ]);
    let mut deep = vec![];
    for _ in 0..5 {
        deep.extend_from_slice(&[60, 0, 1, 4, 0, 0, 0, 0]);
    }
    deep[5 * 8 - 8] = PROTO_TCP;
    deep.extend_from_slice(&tcp(1, 443, SYN, b""));
    let cases: Vec<(&str, Vec<u8>, stat::Counter)> = vec![
        ("arp", arp, stat::PASS_NOT_IP),
        (
            "ipv6_neighbour_solicitation",
            on_wire(&ns),
            stat::PASS_ICMP_NOT_VIP,
        ),
        ("icmp_echo_to_vip", on_wire(&echo), stat::PASS_ICMP_NOT_VIP),
        (
            "tcp_to_other_address",
            on_wire(&v4_tcp(CLIENT4, 1, "10.9.9.9", 443, SYN, 0)),
            stat::PASS_NOT_VIP,
        ),
        (
            "tcp_to_vip_other_port",
            on_wire(&v4_tcp(CLIENT4, 1, VIP4, 80, SYN, 0)),
            stat::PASS_NOT_VIP,
        ),
        (
            "udp_to_tcp_vip",
            on_wire(&V4::new(CLIENT4, VIP4, PROTO_UDP).build(&udp(1, 443, b""))),
            stat::PASS_NOT_VIP,
        ),
        (
            "ipv4_first_fragment",
            on_wire(&frag.build(&tcp(1, 443, SYN, b""))),
            stat::PASS_FRAGMENT,
        ),
        (
            "ipv4_later_fragment",
            on_wire(&later_frag.build(&[0u8; 16])),
            stat::PASS_FRAGMENT,
        ),
        ("ipv6_fragment_header", on_wire(&frag6), stat::PASS_FRAGMENT),
        ("gre_to_vip", on_wire(&gre), stat::PASS_UNSUPPORTED_L4),
        (
            "ipv6_five_extension_headers",
            on_wire(&ipv6(CLIENT6, VIP6, 60, 0, 0, &deep)),
            stat::PASS_EXT_HDR_LIMIT,
        ),
    ];
    for (name, frame, counter) in cases {
        let before = lab.stat(counter);
        let (a, out) = lab.run(&frame);
        assert_eq!(a, XDP_PASS, "{name}: action");
        assert_eq!(out, frame, "{name}: frame must pass byte-identical");
        assert_eq!(
            lab.stat(counter),
            before + 1,
            "{name}: counter {}",
            counter.name()
        );
    }
}

/// Lying length fields: the frame passes untouched (the kernel applies its own checks).
#[test]
fn lying_length_fields_pass_untouched_and_are_counted() {
    let (mut lab, _vip) = lab_v4();
    let good = v4_tcp(CLIENT4, 1, VIP4, 443, SYN, 0);
    let patch = |f: &dyn Fn(&mut Vec<u8>)| {
        let mut p = good.clone();
        f(&mut p);
        eth(LB_MAC, CLIENT_MAC, ETH_IP, &p)
    };
    let v6 = ipv6(CLIENT6, VIP6, PROTO_TCP, 0, 0, &tcp(1, 443, SYN, b""));
    let mut v6_long = v6.clone();
    v6_long[4..6].copy_from_slice(&100u16.to_be_bytes());
    let mut short_l4 = V4::new(CLIENT4, VIP4, PROTO_TCP).build(&[0u8; 10]);
    short_l4[2..4].copy_from_slice(&30u16.to_be_bytes());
    let cases: Vec<(&str, Vec<u8>, stat::Counter)> = vec![
        (
            "ipv4_total_length_beyond_frame",
            patch(&|p| p[2..4].copy_from_slice(&1500u16.to_be_bytes())),
            stat::PASS_BAD_IP_LEN,
        ),
        (
            "ipv4_total_length_below_header",
            patch(&|p| p[2..4].copy_from_slice(&10u16.to_be_bytes())),
            stat::PASS_BAD_IP_LEN,
        ),
        (
            "ipv4_ihl_below_five",
            patch(&|p| p[0] = 0x44),
            stat::PASS_BAD_IP_LEN,
        ),
        (
            "ipv4_ihl_beyond_frame",
            patch(&|p| p[0] = 0x4f),
            stat::PASS_TRUNCATED_L3,
        ),
        (
            "ipv4_version_six_in_ipv4_frame",
            patch(&|p| p[0] = 0x65),
            stat::PASS_BAD_IP_LEN,
        ),
        (
            "ipv6_payload_length_beyond_frame",
            on_wire(&v6_long),
            stat::PASS_BAD_IP_LEN,
        ),
        (
            "tcp_header_shorter_than_20",
            on_wire(&short_l4),
            stat::PASS_TRUNCATED_L4,
        ),
    ];
    for (name, frame, counter) in cases {
        let before = lab.stat(counter);
        let (a, out) = lab.run(&frame);
        assert_eq!(a, XDP_PASS, "{name}: action");
        assert_eq!(out, frame, "{name}: untouched");
        assert_eq!(
            lab.stat(counter),
            before + 1,
            "{name}: counter {}",
            counter.name()
        );
    }
}

/// Every prefix of valid VIP frames (tagged IPv4, IPv6 with an extension header) passes
/// untouched with the counter of the header it was cut in.
#[test]
fn frames_truncated_at_every_length_pass_untouched_and_are_counted() {
    let (mut lab, _vip) = lab_v4();
    let vip6 = lab.vip(1, VIP6, 443, PROTO_TCP, 0, 0);
    lab.backends(&vip6, &BACKENDS6);
    let v4 = vlan_tag(&on_wire(&v4_tcp(CLIENT4, 1, VIP4, 443, SYN, 0)), 0x8100, 5);
    let mut ext = vec![PROTO_TCP, 0, 1, 4, 0, 0, 0, 0];
    ext.extend_from_slice(&tcp(1, 443, SYN, b""));
    let v6 = on_wire(&ipv6(CLIENT6, VIP6, 0, 0, 0, &ext));
    for (frame, l3) in [(v4, 18usize), (v6, 14)] {
        let ip_hlen = if l3 == 18 { 20 } else { 40 };
        assert_eq!(lab.run(&frame).0, XDP_TX, "the full frame is steered");
        for cut in 0..frame.len() {
            let f = &frame[..cut];
            let counter = if cut < l3 {
                stat::PASS_TRUNCATED_L2
            } else if cut < l3 + ip_hlen {
                stat::PASS_TRUNCATED_L3
            } else {
                stat::PASS_BAD_IP_LEN // the IP length field now claims more than the frame
            };
            let before = lab.stat(counter);
            let (a, out) = match run_prog(&mut lab.dp, sluice::dataplane::PROG_XDP, f) {
                Ok(r) => r,
                // The kernel itself refuses frames shorter than an Ethernet header.
                Err(_) if cut < 14 => continue,
                Err(e) => panic!("cut {cut}: {e:#}"),
            };
            assert_eq!(a, XDP_PASS, "cut at {cut}");
            assert_eq!(out, f, "cut at {cut}: untouched");
            assert_eq!(
                lab.stat(counter),
                before + 1,
                "cut at {cut}: {}",
                counter.name()
            );
        }
    }
}

#[test]
fn decap_strips_each_outer_header_and_passes_the_client_packet() {
    let mut lab = Lab::new();
    let inner4 = v4_tcp(CLIENT4, 1, VIP4, 443, SYN, 0);
    let inner6 = ipv6(CLIENT6, VIP6, PROTO_TCP, 0, 0, &tcp(1, 443, SYN, b"hi"));
    let bmac: Mac = [0x02, 0, 0, 0, 0x0b, 0x01];
    let mut o4 = V4::new("172.16.1.2", "10.1.0.1", PROTO_IPIP);
    o4.frag = 0;
    let cases = [
        (
            "ipip",
            eth(bmac, LB_MAC, ETH_IP, &o4.build(&inner4)),
            &inner4,
            ETH_IP,
        ),
        (
            "ipv6_in_ipv6",
            eth(
                bmac,
                LB_MAC,
                ETH_IPV6,
                &ipv6("fd00:5:1::1", "fd00:1::1", PROTO_IPV6, 0, 0, &inner6),
            ),
            &inner6,
            ETH_IPV6,
        ),
        (
            "ipv4_in_ipv6",
            eth(
                bmac,
                LB_MAC,
                ETH_IPV6,
                &ipv6("fd00:5:1::1", "fd00:1::1", PROTO_IPIP, 0, 0, &inner4),
            ),
            &inner4,
            ETH_IP,
        ),
    ];
    for (name, frame, inner, ty) in cases {
        let (a, out) = run_prog(&mut lab.dp, PROG_DECAP, &frame).unwrap();
        assert_eq!(a, XDP_PASS, "{name}");
        assert_eq!(out, eth(bmac, LB_MAC, ty, inner), "{name}");
    }
    assert_eq!(lab.stat(stat::DECAP_OK), 3);
    let plain = on_wire(&inner4);
    let (a, out) = run_prog(&mut lab.dp, PROG_DECAP, &plain).unwrap();
    assert_eq!((a, out), (XDP_PASS, plain));
    assert_eq!(lab.stat(stat::DECAP_PASS_NOT_ENCAP), 1);
}

#[test]
fn full_backend_is_probed_past_by_new_sessions_but_keeps_its_streams() {
    let (mut lab, vip) = lab_v4();
    let old = port_on(&mut lab, &vip, 1, 1000);
    lab.run(&on_wire(&v4_tcp(CLIENT4, old, VIP4, 443, SYN, 0)));
    lab.set_flags(1, BACKEND_F_FULL);
    let key = flow(CLIENT4, old, VIP4, 443, PROTO_TCP);
    let h = lab.flow_hash(&key, false);
    assert_steered(&mut lab, &v4_tcp(CLIENT4, old, VIP4, 443, ACK, 0), 1, h);
    let new = port_on(&mut lab, &vip, 1, old + 1);
    let nkey = flow(CLIENT4, new, VIP4, 443, PROTO_TCP);
    let next = *lab.probes(&vip, &nkey).iter().find(|&&id| id != 1).unwrap();
    let h = lab.flow_hash(&nkey, false);
    assert_steered(&mut lab, &v4_tcp(CLIENT4, new, VIP4, 443, SYN, 0), next, h);
}

#[test]
fn syn_is_shed_by_drop_when_every_backend_is_full_while_established_flows_continue() {
    let mut lab = Lab::new();
    let vip = lab.vip(0, VIP4, 443, PROTO_TCP, VIP_F_ADMISSION, 0);
    lab.backends(&vip, &BACKENDS4);
    lab.run(&on_wire(&v4_tcp(CLIENT4, 3000, VIP4, 443, SYN, 0)));
    for id in 1..=3 {
        lab.set_flags(id, BACKEND_F_FULL);
    }
    let syn = on_wire(&v4_tcp(CLIENT4, 3001, VIP4, 443, SYN, 0));
    assert_eq!(lab.run(&syn).0, XDP_DROP);
    assert_eq!(lab.stat(stat::SHED_FULL), 1);
    assert_eq!(lab.stat(stat::DROP_SHED), 1);
    // The established flow, and a mid-stream packet whose entry was lost, still flow.
    assert_eq!(
        lab.run(&on_wire(&v4_tcp(CLIENT4, 3000, VIP4, 443, ACK, 0)))
            .0,
        XDP_TX
    );
    assert_eq!(
        lab.run(&on_wire(&v4_tcp(CLIENT4, 3002, VIP4, 443, ACK | PSH, 0)))
            .0,
        XDP_TX
    );
    assert_eq!(lab.stat(stat::SHED_FULL), 1);
}

#[test]
fn without_admission_a_syn_finding_only_full_backends_goes_to_the_first_active_one() {
    // Full by telemetry is a preference: a VIP with no admission control refuses nothing.
    let (mut lab, vip) = lab_v4();
    lab.set_state(1, BACKEND_DOWN);
    for id in 2..=3 {
        lab.set_flags(id, BACKEND_F_FULL);
    }
    let port = (3000..60000)
        .find(|&p| {
            let probes = lab.probes(&vip, &flow(CLIENT4, p, VIP4, 443, PROTO_TCP));
            probes[0] == 1 && probes.iter().any(|&id| id != 1)
        })
        .expect("some port probes the down backend first, then another");
    let key = flow(CLIENT4, port, VIP4, 443, PROTO_TCP);
    let first_active = *lab.probes(&vip, &key).iter().find(|&&id| id != 1).unwrap();
    let h = lab.flow_hash(&key, false);
    assert_steered(
        &mut lab,
        &v4_tcp(CLIENT4, port, VIP4, 443, SYN, 0),
        first_active,
        h,
    );
    assert_eq!(lab.stat(stat::FULL_FALLBACK), 1);
    assert_eq!(
        (lab.stat(stat::SHED_FULL), lab.stat(stat::DROP_SHED)),
        (0, 0)
    );
}

#[test]
fn shed_vip_answers_syn_with_an_exact_rst_and_drops_udp() {
    let mut lab = Lab::new();
    let vip = lab.vip(0, VIP4, 443, PROTO_TCP, VIP_F_SHED | VIP_F_SHED_RST, 0);
    lab.backends(&vip, &BACKENDS4);
    let mut h = V4::new(CLIENT4, VIP4, PROTO_TCP);
    h.tos = 0x10;
    let syn = on_wire(&h.build(&tcp(40500, 443, SYN, b"")));
    let (a, out) = lab.run(&syn);
    assert_eq!(a, XDP_TX);
    let mut r = V4::new(VIP4, CLIENT4, PROTO_TCP);
    r.tos = 0x10;
    let rst = tcp_rst(ip(VIP4), ip(CLIENT4), 443, 40500, 1001);
    assert_eq!(out, eth(CLIENT_MAC, LB_MAC, ETH_IP, &r.build(&rst)));
    assert_eq!(
        (lab.stat(stat::SHED_PRIORITY), lab.stat(stat::SHED_RST_SENT)),
        (1, 1)
    );
    assert!(
        lab.dp.conns().unwrap().is_empty(),
        "a shed session leaves no entry"
    );

    let vip6 = lab.vip(1, VIP6, 443, PROTO_TCP, VIP_F_SHED | VIP_F_SHED_RST, 0);
    lab.backends(&vip6, &BACKENDS6);
    let syn6 = on_wire(&ipv6(
        CLIENT6,
        VIP6,
        PROTO_TCP,
        0,
        0,
        &tcp(40501, 443, SYN, b""),
    ));
    let (a, out) = lab.run(&syn6);
    assert_eq!(a, XDP_TX);
    let rst6 = tcp_rst(ip(VIP6), ip(CLIENT6), 443, 40501, 1001);
    let mut expect = eth(
        CLIENT_MAC,
        LB_MAC,
        ETH_IPV6,
        &ipv6(VIP6, CLIENT6, PROTO_TCP, 0, 0, &rst6),
    );
    expect[14 + 7] = 64;
    assert_eq!(out, expect);

    let uvip = lab.vip(2, VIP4, 443, PROTO_UDP, VIP_F_SHED | VIP_F_SHED_RST, 0);
    lab.backends(&uvip, &[(21, "10.1.0.21", 1)]);
    let quic = on_wire(&V4::new(CLIENT4, VIP4, PROTO_UDP).build(&udp(5000, 443, b"initial")));
    assert_eq!(lab.run(&quic).0, XDP_DROP);
    assert_eq!(lab.stat(stat::SHED_PRIORITY), 3);
    assert_eq!(
        (lab.stat(stat::SHED_RST_SENT), lab.stat(stat::DROP_SHED)),
        (2, 1),
        "every shed frame ends in one outcome: a RST sent or a drop"
    );
}

/// Ethernet pads short frames to 60 bytes, and a frame may carry bytes after its IP packet:
/// they are not the client's, and the tunnel carries exactly the IP packet.
#[test]
fn bytes_after_the_ip_packet_are_cut_before_encapsulation() {
    let (mut lab, vip) = lab_v4();
    let vip6 = lab.vip(1, VIP6, 443, PROTO_TCP, 0, 0);
    lab.backends(&vip6, &BACKENDS6);

    // 14 + 40 bytes, padded to the 60-byte minimum.
    let l3 = v4_tcp(CLIENT4, 41000, VIP4, 443, SYN, 0);
    let mut frame = on_wire(&l3);
    frame.extend_from_slice(&[0xee; 6]);
    let key = flow(CLIENT4, 41000, VIP4, 443, PROTO_TCP);
    let addr = ring_backend(&mut lab, &vip, &key);
    let h = lab.flow_hash(&key, false);
    let (a, out) = lab.run(&frame);
    assert_eq!(a, XDP_TX);
    assert_eq!(out, encapsulated(&lab, &l3, addr, h));
    assert_eq!(lab.stat(stat::PADDING_TRIMMED), 1);
    let vs = lab.dp.vip_stats(0).unwrap();
    assert_eq!(vs.bytes, l3.len() as u64, "the VIP is billed the IP packet");

    // VLAN-tagged, padded: leaves untagged and unpadded.
    let l3 = v4_tcp(CLIENT4, 41001, VIP4, 443, SYN, 0);
    let mut frame = vlan_tag(&on_wire(&l3), 0x8100, 7);
    frame.extend_from_slice(&[0; 2]);
    let key = flow(CLIENT4, 41001, VIP4, 443, PROTO_TCP);
    let addr = ring_backend(&mut lab, &vip, &key);
    let h = lab.flow_hash(&key, false);
    let (a, out) = lab.run(&frame);
    assert_eq!(a, XDP_TX);
    assert_eq!(out, encapsulated(&lab, &l3, addr, h));

    // IPv6 with 20 trailing bytes.
    let l3 = ipv6(CLIENT6, VIP6, PROTO_TCP, 0, 0, &tcp(41002, 443, SYN, b"x"));
    let mut frame = on_wire(&l3);
    frame.extend_from_slice(&[0xaa; 20]);
    let key = flow(CLIENT6, 41002, VIP6, 443, PROTO_TCP);
    let addr = ring_backend(&mut lab, &vip6, &key);
    let h = lab.flow_hash(&key, false);
    let (a, out) = lab.run(&frame);
    assert_eq!(a, XDP_TX);
    assert_eq!(out, encapsulated(&lab, &l3, addr, h));
    assert_eq!(lab.stat(stat::PADDING_TRIMMED), 3);
}

/// An IP length that ends before the headers the frame holds: the frame is not steered on
/// bytes outside its packet (ports read from padding), it passes untouched and is counted.
#[test]
fn headers_past_the_ip_length_are_not_read_and_the_frame_passes_untouched() {
    let (mut lab, _vip) = lab_v4();
    let vip6 = lab.vip(1, VIP6, 443, PROTO_TCP, 0, 0);
    lab.backends(&vip6, &BACKENDS6);
    let with_len = |mut l3: Vec<u8>, len: u16| {
        if l3[0] >> 4 == 4 {
            l3[2..4].copy_from_slice(&len.to_be_bytes());
        } else {
            l3[4..6].copy_from_slice(&len.to_be_bytes());
        }
        on_wire(&l3)
    };
    let syn = v4_tcp(CLIENT4, 41100, VIP4, 443, SYN, 0);
    let syn6 = ipv6(CLIENT6, VIP6, PROTO_TCP, 0, 0, &tcp(41101, 443, SYN, b""));
    let mut ext = vec![PROTO_TCP, 0, 0, 0, 0, 0, 0, 0];
    ext.extend_from_slice(&tcp(41102, 443, SYN, b""));
    let ext6 = ipv6(CLIENT6, VIP6, 60, 0, 0, &ext);
    let quoted = v4_tcp(VIP4, 443, CLIENT4, 41103, ACK, 0);
    let icmp =
        V4::new("198.51.100.1", VIP4, PROTO_ICMP).build(&icmp_error(3, 4, 1400, &quoted[..28]));
    let cases: Vec<(&str, Vec<u8>)> = vec![
        ("ipv4_length_of_its_header_alone", with_len(syn.clone(), 20)),
        ("ipv4_length_ending_inside_tcp", with_len(syn, 30)),
        ("ipv6_payload_length_zero", with_len(syn6.clone(), 0)),
        ("ipv6_payload_length_ending_inside_tcp", with_len(syn6, 12)),
        (
            "ipv6_length_ending_after_extension_header",
            with_len(ext6.clone(), 8),
        ),
        (
            "ipv6_length_ending_inside_extension_header",
            with_len(ext6, 4),
        ),
        (
            "icmp_quote_past_the_ipv4_length",
            with_len(icmp, 20 + 8 + 10),
        ),
    ];
    for (name, frame) in cases {
        let before = lab.stat(stat::PASS_SHORT_IP_LEN);
        let (a, out) = lab.run(&frame);
        assert_eq!(a, XDP_PASS, "{name}: action");
        assert_eq!(out, frame, "{name}: untouched");
        assert_eq!(lab.stat(stat::PASS_SHORT_IP_LEN), before + 1, "{name}");
    }
    assert!(lab.dp.conns().unwrap().is_empty(), "no flow was created");
}

/// An ICMP error quoting a VIP flow but sent to another host is not the balancer's.
#[test]
fn icmp_error_addressed_to_another_host_passes_untouched() {
    let (mut lab, _vip) = lab_v4();
    let vip6 = lab.vip(1, VIP6, 443, PROTO_TCP, 0, 0);
    lab.backends(&vip6, &BACKENDS6);
    let quoted = v4_tcp(VIP4, 443, CLIENT4, 41200, ACK, 0);
    let icmp = V4::new("198.51.100.1", "10.200.0.9", PROTO_ICMP).build(&icmp_error(
        3,
        4,
        1400,
        &quoted[..28],
    ));
    let quoted6 = ipv6(VIP6, CLIENT6, PROTO_TCP, 0, 0, &tcp(443, 41201, ACK, b""));
    let icmp6 = ipv6(
        "2001:db8:ff::1",
        "fd00:200::9",
        PROTO_ICMPV6,
        0,
        0,
        &icmp_error(2, 0, 1400, &quoted6[..48]),
    );
    for frame in [on_wire(&icmp), on_wire(&icmp6)] {
        let (a, out) = lab.run(&frame);
        assert_eq!((a, &out), (XDP_PASS, &frame));
    }
    assert_eq!(lab.stat(stat::PASS_ICMP_NOT_VIP), 2);
    assert_eq!(lab.stat(stat::ICMP_TOO_BIG_STEERED), 0);
}

/// A TCP segment to VIP4:443 whose IPv4 packet is `len` bytes.
fn jumbo(sport: u16, len: usize) -> Vec<u8> {
    let payload: Vec<u8> = (0..len - 40).map(|i| i as u8).collect();
    V4::new(CLIENT4, VIP4, PROTO_TCP).build(&tcp(sport, 443, ACK, &payload))
}

/// A 9000-byte frame is larger than a page: multi-buffer XDP hands it over in fragments, and
/// it is encapsulated whole, not passed as `pass_bad_ip_len` for an IP length past the first
/// fragment.
#[test]
fn jumbo_frame_larger_than_a_page_is_encapsulated_whole() {
    let (mut lab, vip) = lab_v4();
    let vip6 = lab.vip(1, VIP6, 443, PROTO_TCP, 0, 0);
    lab.backends(&vip6, &BACKENDS6);
    let l3 = jumbo(41300, 9000);
    let key = flow(CLIENT4, 41300, VIP4, 443, PROTO_TCP);
    let addr = ring_backend(&mut lab, &vip, &key);
    let h = lab.flow_hash(&key, false);
    let (a, out) = lab.run(&on_wire(&l3));
    assert_eq!(a, XDP_TX);
    assert_eq!(out, encapsulated(&lab, &l3, addr, h));

    // Padded jumbo frame: the bytes after the packet are cut from the last fragment.
    let mut frame = on_wire(&l3);
    frame.extend_from_slice(&[0xee; 100]);
    let (a, out) = lab.run(&frame);
    assert_eq!(a, XDP_TX);
    assert_eq!(out, encapsulated(&lab, &l3, addr, h));

    // IPv6, 9000 bytes.
    let payload: Vec<u8> = (0..9000 - 60).map(|i| (i * 7) as u8).collect();
    let l3 = ipv6(
        CLIENT6,
        VIP6,
        PROTO_TCP,
        0,
        0,
        &tcp(41301, 443, ACK, &payload),
    );
    let key = flow(CLIENT6, 41301, VIP6, 443, PROTO_TCP);
    let addr = ring_backend(&mut lab, &vip6, &key);
    let h = lab.flow_hash(&key, false);
    let (a, out) = lab.run(&on_wire(&l3));
    assert_eq!(a, XDP_TX);
    assert_eq!(out, encapsulated(&lab, &l3, addr, h));

    // A jumbo frame whose IP length claims more than the frame holds still passes.
    let mut lying = on_wire(&jumbo(41302, 9000));
    lying.truncate(14 + 8000);
    let (a, out) = lab.run(&lying);
    assert_eq!((a, out == lying), (XDP_PASS, true));
    assert_eq!(lab.stat(stat::PASS_BAD_IP_LEN), 1);
    assert_eq!(lab.stat(stat::PASS_SHORT_IP_LEN), 0);
}

/// A jumbo frame towards a backend behind a 1500-byte path: "fragmentation needed" from the
/// VIP, cut from the fragmented frame.
#[test]
fn jumbo_frame_too_big_for_the_backend_path_gets_an_exact_icmp_too_big() {
    let (mut lab, _vip) = lab_v4();
    let ifindex = fib_segment(1500);
    lab.dp.add_tx_port(ifindex).unwrap();
    let big = jumbo(41400, 9000);
    let (a, out) = lab.run(&on_wire(&big));
    assert_eq!(a, XDP_TX);
    let mut ip4 = V4::new(VIP4, CLIENT4, PROTO_ICMP);
    ip4.frag = 0;
    let msg = icmp_checksummed(icmp_error(3, 4, 1480, &big[..28]), None);
    assert_eq!(out, eth(CLIENT_MAC, LB_MAC, ETH_IP, &ip4.build(&msg)));
    assert_eq!(lab.stat(stat::ICMP_TOO_BIG_SENT), 1);
}

/// The backend strips a tunnel packet only when its outer length matches the inner packet
/// exactly; padding after it is cut, so the stack sees the client's packet alone.
#[test]
fn decap_cuts_padding_and_leaves_tunnel_packets_whose_lengths_disagree() {
    let mut lab = Lab::new();
    let inner4 = v4_tcp(CLIENT4, 1, VIP4, 443, SYN, 0);
    let bmac: Mac = [0x02, 0, 0, 0, 0x0b, 0x01];
    let mut o4 = V4::new("172.16.1.2", "10.1.0.1", PROTO_IPIP);
    o4.frag = 0;
    let ipip = o4.build(&inner4);

    let mut padded = eth(bmac, LB_MAC, ETH_IP, &ipip);
    padded.extend_from_slice(&[0xee; 10]);
    let (a, out) = run_prog(&mut lab.dp, PROG_DECAP, &padded).unwrap();
    assert_eq!((a, out), (XDP_PASS, eth(bmac, LB_MAC, ETH_IP, &inner4)));
    assert_eq!(lab.stat(stat::DECAP_OK), 1);

    let outer_len = |mut l3: Vec<u8>, len: u16| {
        l3[2..4].copy_from_slice(&len.to_be_bytes());
        eth(bmac, LB_MAC, ETH_IP, &l3)
    };
    let mut ipip_extra = ipip.clone();
    ipip_extra.extend_from_slice(&[0; 4]);
    let inner6 = ipv6(CLIENT6, VIP6, PROTO_TCP, 0, 0, &tcp(1, 443, SYN, b""));
    let mut six = ipv6("fd00:5:1::1", "fd00:1::1", PROTO_IPV6, 0, 0, &inner6);
    six[4..6].copy_from_slice(&50u16.to_be_bytes());
    let cases = [
        (
            "outer_length_beyond_the_frame",
            outer_len(ipip.clone(), 200),
        ),
        (
            "outer_length_shorter_than_inner",
            outer_len(ipip.clone(), 50),
        ),
        (
            "outer_length_longer_than_inner",
            outer_len(ipip_extra, (ipip.len() + 4) as u16),
        ),
        (
            "ipv6_payload_shorter_than_inner",
            eth(bmac, LB_MAC, ETH_IPV6, &six),
        ),
    ];
    for (name, frame) in cases {
        let before = lab.stat(stat::DECAP_PASS_BAD_LEN);
        let (a, out) = run_prog(&mut lab.dp, PROG_DECAP, &frame).unwrap();
        assert_eq!((a, &out), (XDP_PASS, &frame), "{name}: untouched");
        assert_eq!(lab.stat(stat::DECAP_PASS_BAD_LEN), before + 1, "{name}");
    }
    assert_eq!(lab.stat(stat::DECAP_OK), 1);
}

/// Marks backends as running the backend program (GUE) after `Lab::backends` wrote them.
fn gue(lab: &mut Lab, ids: &[u32]) {
    for &id in ids {
        lab.set_flags(id, BACKEND_F_GUE);
    }
}

/// A flow (client port from 1024) whose ring slot moved from one backend to another between
/// the tables published before and after; (port, old owner, new owner).
fn moved_flow(lab: &mut Lab, vip: &lb_common::VipKey, before: &[u32]) -> (u16, u32, u32) {
    let meta = lab.dp.vip(vip).unwrap().unwrap();
    let ring = lab.dp.live_ring(vip).unwrap().unwrap();
    (1024..60000)
        .find_map(|p| {
            let key = flow(CLIENT4, p, VIP4, 443, PROTO_TCP);
            let slot = lb_common::hash::probe_slot(lab.flow_hash(&key, false), 0, meta.ring_size);
            let s = ring[slot as usize];
            let old = before[slot as usize];
            (u32::from(s.backend) != old).then(|| {
                assert_eq!(
                    u32::from(s.previous[0]),
                    old,
                    "the slot names its old owner"
                );
                (p, old, u32::from(s.backend))
            })
        })
        .expect("adding a backend moves some slots")
}

#[test]
fn gue_backend_is_sent_udp_gue_naming_the_previous_owner_of_the_flows_slot() {
    let (mut lab, vip) = lab_v4();
    gue(&mut lab, &[1, 2, 3]);
    let before: Vec<u32> = lab
        .dp
        .live_ring(&vip)
        .unwrap()
        .unwrap()
        .iter()
        .map(|s| u32::from(s.backend))
        .collect();
    let mut four = BACKENDS4.to_vec();
    four.push((4, "10.1.0.4", 1));
    lab.backends(&vip, &four);
    gue(&mut lab, &[1, 2, 3, 4]);
    let (port, old, new) = moved_flow(&mut lab, &vip, &before);
    assert_eq!(new, 4);
    let key = flow(CLIENT4, port, VIP4, 443, PROTO_TCP);
    let h = lab.flow_hash(&key, false);
    let ack = v4_tcp(CLIENT4, port, VIP4, 443, ACK, 0);
    let (action, out) = lab.run(&on_wire(&ack));
    assert_eq!(action, XDP_TX);
    let prev = lab.backend_addr(old);
    let to = lab.backend_addr(4);
    assert_eq!(out, gue_encapsulated(&lab, &ack, to, h, &[prev]));
    // The tunnel header, spelled out: UDP to 6080 from the hashed port, checksum 0, then
    // GUE (Hlen 4 words, IPIP, no flags) and the private data: hop count 0, 10.1.0.<old>,
    // and two empty address fields.
    let sport = (0xc000 | (h & 0x3fff)) as u16;
    let udp_len = (8 + 4 + 16 + ack.len()) as u16;
    let mut want = sport.to_be_bytes().to_vec();
    want.extend_from_slice(&[0x17, 0xc0]);
    want.extend_from_slice(&udp_len.to_be_bytes());
    want.extend_from_slice(&[0, 0, 4, 4, 0, 0, 0x53, 0, 0, 0, 10, 1, 0, old as u8]);
    want.extend_from_slice(&[0; 8]);
    assert_eq!(out[34..62], want[..]);
    assert_eq!(out[23], PROTO_UDP, "outer protocol");
    assert_eq!(lab.stat(stat::TX), 1);
}

#[test]
fn gue_names_no_previous_backend_that_lacks_the_program_or_is_down() {
    let (mut lab, vip) = lab_v4();
    let before: Vec<u32> = lab
        .dp
        .live_ring(&vip)
        .unwrap()
        .unwrap()
        .iter()
        .map(|s| u32::from(s.backend))
        .collect();
    let mut four = BACKENDS4.to_vec();
    four.push((4, "10.1.0.4", 1));
    lab.backends(&vip, &four);
    // Only the new owner runs the backend program: the old one could not take GUE.
    gue(&mut lab, &[4]);
    let (port, old, _) = moved_flow(&mut lab, &vip, &before);
    let key = flow(CLIENT4, port, VIP4, 443, PROTO_TCP);
    let h = lab.flow_hash(&key, false);
    let ack = v4_tcp(CLIENT4, port, VIP4, 443, ACK, 0);
    let to = lab.backend_addr(4);
    let (action, out) = lab.run(&on_wire(&ack));
    assert_eq!(action, XDP_TX);
    assert_eq!(out, gue_encapsulated(&lab, &ack, to, h, &[]));
    // It runs the program but is down: still not named. (Each case starts without the
    // connection entry the last packet made: a table hit names no previous backend.)
    gue(&mut lab, &[old, 4]);
    lab.set_state(old, BACKEND_DOWN);
    lab.dp.clear_conns().unwrap();
    let (_, out) = lab.run(&on_wire(&ack));
    assert_eq!(out, gue_encapsulated(&lab, &ack, to, h, &[]));
    // Draining, it still holds its flows: named.
    lab.set_state(old, BACKEND_DRAINING);
    lab.dp.clear_conns().unwrap();
    let (_, out) = lab.run(&on_wire(&ack));
    let prev = lab.backend_addr(old);
    assert_eq!(out, gue_encapsulated(&lab, &ack, to, h, &[prev]));
}

/// A slot that changed three times (owners 1, 2, 3, then 4): the tunnel to 4 names 3, 2 and
/// 1, most recent first. A previous backend that is down is left out and the others move up.
#[test]
fn gue_names_up_to_three_previous_owners_most_recent_first() {
    let (mut lab, vip) = lab_v4();
    let mut four = BACKENDS4.to_vec();
    four.push((4, "10.1.0.4", 1));
    lab.backends(&vip, &four);
    gue(&mut lab, &[1, 2, 3, 4]);
    for id in 1..=4 {
        let meta = lab.dp.vip(&vip).unwrap().unwrap();
        let table = vec![id; meta.ring_size as usize];
        lab.dp.publish(&vip, meta, &table).unwrap();
    }
    let slot = lab.dp.live_ring(&vip).unwrap().unwrap()[0];
    assert_eq!((slot.backend, slot.previous), (4, [3, 2, 1]));
    let key = flow(CLIENT4, 40000, VIP4, 443, PROTO_TCP);
    let h = lab.flow_hash(&key, false);
    let ack = v4_tcp(CLIENT4, 40000, VIP4, 443, ACK, 0);
    let addr = |lab: &mut Lab, id| lab.backend_addr(id);
    let (to, p3, p2, p1) = (
        addr(&mut lab, 4),
        addr(&mut lab, 3),
        addr(&mut lab, 2),
        addr(&mut lab, 1),
    );
    let (action, out) = lab.run(&on_wire(&ack));
    assert_eq!(action, XDP_TX);
    assert_eq!(out, gue_encapsulated(&lab, &ack, to, h, &[p3, p2, p1]));
    // GUE (Hlen 4 words, IPIP) and the private data: kind, hop count 0, reserved, then
    // 10.1.0.3, 10.1.0.2, 10.1.0.1.
    assert_eq!(
        out[42..62],
        [4, 4, 0, 0, 0x53, 0, 0, 0, 10, 1, 0, 3, 10, 1, 0, 2, 10, 1, 0, 1]
    );
    lab.set_state(2, BACKEND_DOWN);
    lab.dp.clear_conns().unwrap();
    let (_, out) = lab.run(&on_wire(&ack));
    assert_eq!(out, gue_encapsulated(&lab, &ack, to, h, &[p3, p1]));
    assert_eq!(
        out[42..62],
        [4, 4, 0, 0, 0x53, 0, 0, 0, 10, 1, 0, 3, 10, 1, 0, 1, 0, 0, 0, 0]
    );
}

#[test]
fn v6_gue_backend_gets_a_16_byte_previous_field_and_ipip_backends_stay_ipip() {
    let mut lab = Lab::new();
    let vip = lab.vip(1, VIP6, 443, PROTO_TCP, 0, 0);
    lab.backends(&vip, &BACKENDS6);
    gue(&mut lab, &[11, 12]);
    for port in 40000..40032 {
        let key = flow(CLIENT6, port, VIP6, 443, PROTO_TCP);
        let id = lab.ring_choice(&vip, &key, false);
        let h = lab.flow_hash(&key, false);
        let syn = ipv6(CLIENT6, VIP6, PROTO_TCP, 0, 0, &tcp(port, 443, SYN, b""));
        let (action, out) = lab.run(&on_wire(&syn));
        assert_eq!(action, XDP_TX);
        let to = lab.backend_addr(id);
        // The VIP's first table: no slot has a previous owner.
        let want = if id == 13 {
            encapsulated(&lab, &syn, to, h)
        } else {
            gue_encapsulated(&lab, &syn, to, h, &[])
        };
        assert_eq!(out, want, "port {port} to backend {id}");
    }
}

#[test]
fn decap_strips_gue_from_the_lbs_own_output_and_leaves_other_udp_alone() {
    let (mut lab, vip) = lab_v4();
    gue(&mut lab, &[1, 2, 3]);
    let mut lab6 = Lab::new();
    let vip6 = lab6.vip(1, VIP6, 443, PROTO_TCP, 0, 0);
    lab6.backends(&vip6, &BACKENDS6);
    gue(&mut lab6, &[11, 12, 13]);
    let _ = vip;
    let inner4 = v4_tcp(CLIENT4, 4000, VIP4, 443, ACK, 0);
    let inner6 = ipv6(CLIENT6, VIP6, PROTO_TCP, 0, 0, &tcp(4000, 443, ACK, b"tok"));
    for (lab, inner, ty) in [(&mut lab, &inner4, ETH_IP), (&mut lab6, &inner6, ETH_IPV6)] {
        let (action, tunnelled) = lab.run(&on_wire(inner));
        assert_eq!(action, XDP_TX);
        assert_eq!(u16::from_be_bytes([tunnelled[12], tunnelled[13]]), ty);
        let before = lab.stat(stat::DECAP_OK);
        let (a, out) = run_prog(&mut lab.dp, PROG_DECAP, &tunnelled).unwrap();
        assert_eq!(a, XDP_PASS);
        assert_eq!(
            out,
            eth(FALLBACK_MAC, LB_MAC, ty, inner),
            "exactly the client packet"
        );
        assert_eq!(lab.stat(stat::DECAP_OK), before + 1);
    }
    // Ordinary UDP to the backend, GUE we do not speak, GUE whose UDP length lies.
    let (_, tunnelled) = lab.run(&on_wire(&inner4));
    let mut other_port = tunnelled.clone();
    other_port[36..38].copy_from_slice(&53u16.to_be_bytes());
    let mut flags = tunnelled.clone();
    flags[44] = 0x80;
    let mut long = tunnelled.clone();
    let l = u16::from_be_bytes([long[38], long[39]]) + 4;
    long[38..40].copy_from_slice(&l.to_be_bytes());
    for (name, frame, counter) in [
        (
            "udp to another port",
            other_port,
            stat::DECAP_PASS_NOT_ENCAP,
        ),
        ("gue flags", flags, stat::DECAP_PASS_BAD_GUE),
        ("udp length", long, stat::DECAP_PASS_BAD_LEN),
    ] {
        let before = lab.stat(counter);
        let (a, out) = run_prog(&mut lab.dp, PROG_DECAP, &frame).unwrap();
        assert_eq!(a, XDP_PASS, "{name}");
        assert_eq!(out, frame, "{name}: untouched");
        assert_eq!(lab.stat(counter), before + 1, "{name}");
    }
}

/// A backend host for second-chance tests: loopback up, a route and neighbour for the
/// previous backends 10.1.0.2, 10.1.0.3 and 10.1.0.4 (`fib_segment`), and a listener with one established
/// connection on 127.0.0.1. Returns (lab, listener, client stream, client port, server port).
fn backend_host() -> (Lab, std::net::TcpListener, std::net::TcpStream, u16, u16) {
    let lab = Lab::new();
    sluice_tests::fib_segment(1500, &[ip("10.1.0.2"), ip("10.1.0.3"), ip("10.1.0.4")]);
    let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let client = std::net::TcpStream::connect(listener.local_addr().unwrap()).unwrap();
    let cport = client.local_addr().unwrap().port();
    let sport = listener.local_addr().unwrap().port();
    (lab, listener, client, cport, sport)
}

/// A GUE frame from the LB (outer 172.16.0.9 -> 10.1.0.1) carrying `inner`.
fn from_lb(inner: &[u8], previous: &[&str], hop: u8) -> Vec<u8> {
    gue_frame(
        ([0x02, 0, 0, 0, 0x0b, 0x01], LB_MAC),
        ip("172.16.0.9"),
        ip("10.1.0.1"),
        0xc123,
        0,
        inner,
        &previous.iter().map(|a| ip(a)).collect::<Vec<_>>(),
        hop,
    )
}

fn decap_run(lab: &mut Lab, frame: &[u8]) -> (u32, Vec<u8>) {
    run_prog(&mut lab.dp, PROG_DECAP, frame).unwrap()
}

#[test]
fn backend_delivers_a_packet_whose_socket_it_holds() {
    let (mut lab, _l, _c, cport, sport) = backend_host();
    let ack = v4_tcp("127.0.0.1", cport, "127.0.0.1", sport, ACK, 0);
    let (a, out) = decap_run(&mut lab, &from_lb(&ack, &["10.1.0.2"], 0));
    assert_eq!(a, XDP_PASS);
    assert_eq!(out, eth([0x02, 0, 0, 0, 0x0b, 0x01], LB_MAC, ETH_IP, &ack));
    assert_eq!(lab.stat(stat::DECAP_OK), 1);
    assert_eq!(lab.stat(stat::DECAP_SECOND_HOP), 0);
}

#[test]
fn backend_passes_a_packet_without_socket_once_to_the_previous_backend() {
    let (mut lab, _l, _c, _cport, sport) = backend_host();
    // Another client port: only the listener matches, and a bare ACK carries no cookie of
    // this host's, so the connection is elsewhere.
    let ack = v4_tcp("127.0.0.1", 1, "127.0.0.1", sport, ACK, 0);
    let (a, out) = decap_run(&mut lab, &from_lb(&ack, &["10.1.0.2"], 0));
    assert_eq!(a, XDP_REDIRECT);
    let want = gue_frame(
        (
            sluice_tests::fib_neighbour_mac(ip("10.1.0.2")),
            sluice_tests::FIB_LOCAL_MAC,
        ),
        ip("172.16.0.9"),
        ip("10.1.0.2"),
        0xc123,
        0,
        &ack,
        &[],
        1,
    );
    assert_eq!(out, want, "readdressed, hop count 1, no address left");
    assert_eq!(lab.stat(stat::DECAP_SECOND_HOP), 1);
    assert_eq!(lab.stat(stat::DECAP_OK), 0);
    // Arriving at the previous backend (here: the same host, which has no socket either),
    // it is delivered to the stack and counted, never passed on again.
    let (a, out) = decap_run(&mut lab, &want);
    assert_eq!(a, XDP_PASS);
    assert_eq!(
        out,
        eth(
            sluice_tests::fib_neighbour_mac(ip("10.1.0.2")),
            sluice_tests::FIB_LOCAL_MAC,
            ETH_IP,
            &ack
        )
    );
    assert_eq!(lab.stat(stat::DECAP_HISTORY_SHORT), 1);
    assert_eq!(lab.stat(stat::DECAP_SECOND_HOP), 1);
    assert_eq!(lab.stat(stat::DECAP_OK), 1);
}

/// The frame a backend without the socket sends on: the tunnel readdressed to `to` (MACs
/// from the FIB segment), the remaining `names` and hop count `hop`.
fn passed_on(ack: &[u8], to: &str, names: &[&str], hop: u8) -> Vec<u8> {
    gue_frame(
        (
            sluice_tests::fib_neighbour_mac(ip(to)),
            sluice_tests::FIB_LOCAL_MAC,
        ),
        ip("172.16.0.9"),
        ip(to),
        0xc123,
        0,
        ack,
        &names.iter().map(|a| ip(a)).collect::<Vec<_>>(),
        hop,
    )
}

/// A slot that changed three times: the LB names three previous backends. Each host without
/// the socket (here the same host, three times) passes the packet to the first name left and
/// takes that name off, so it goes to #1, #2, #3 in turn and then, with no name left, to the
/// stack: passed on three times in all, each time by one host, never back.
#[test]
fn backend_passes_a_packet_on_through_three_previous_backends_in_order_then_stops() {
    let (mut lab, _l, _c, _cport, sport) = backend_host();
    let ack = v4_tcp("127.0.0.1", 1, "127.0.0.1", sport, ACK, 0);
    let names = ["10.1.0.2", "10.1.0.3", "10.1.0.4"];
    let sent = from_lb(&ack, &names, 0);
    // GUE (Hlen 4 words, IPIP) and the private data, spelled out: kind, hop count 0,
    // reserved, three addresses.
    assert_eq!(
        sent[42..62],
        [4, 4, 0, 0, 0x53, 0, 0, 0, 10, 1, 0, 2, 10, 1, 0, 3, 10, 1, 0, 4]
    );
    let hops = [
        passed_on(&ack, "10.1.0.2", &names[1..], 1),
        passed_on(&ack, "10.1.0.3", &names[2..], 2),
        passed_on(&ack, "10.1.0.4", &[], 3),
    ];
    let mut frame = sent;
    for (n, want) in hops.iter().enumerate() {
        let (a, out) = decap_run(&mut lab, &frame);
        assert_eq!(a, XDP_REDIRECT, "hop {}", n + 1);
        assert_eq!(&out, want, "hop {}: readdressed to #{}", n + 1, n + 1);
        assert_eq!(lab.stat(stat::DECAP_SECOND_HOP), n as u64 + 1);
        assert_eq!(lab.stat(stat::DECAP_HOP_FURTHER), n as u64);
        frame = out;
    }
    // The third previous backend's private data: hop count 3, no address left.
    assert_eq!(
        frame[46..62],
        [0x53, 3, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0]
    );
    let (a, out) = decap_run(&mut lab, &frame);
    assert_eq!(a, XDP_PASS, "no name left: to the stack, which resets it");
    assert_eq!(
        out,
        eth(
            sluice_tests::fib_neighbour_mac(ip("10.1.0.4")),
            sluice_tests::FIB_LOCAL_MAC,
            ETH_IP,
            &ack
        )
    );
    assert_eq!(
        lab.stat(stat::DECAP_HISTORY_SHORT),
        1,
        "history too short, counted"
    );
    assert_eq!(
        (lab.stat(stat::DECAP_SECOND_HOP), lab.stat(stat::DECAP_OK)),
        (3, 1)
    );
    // A hop count at the limit is never passed on, whatever names the tunnel still carries.
    let forged = from_lb(&ack, &names, 3);
    let (a, _) = decap_run(&mut lab, &forged);
    assert_eq!(a, XDP_PASS);
    assert_eq!(lab.stat(stat::DECAP_HISTORY_SHORT), 2);
    assert_eq!(lab.stat(stat::DECAP_SECOND_HOP), 3);
}

#[test]
fn backend_never_passes_on_a_syn_and_counts_a_missing_socket_with_no_previous_backend() {
    let (mut lab, _l, _c, _cport, sport) = backend_host();
    let syn = v4_tcp("127.0.0.1", 2, "127.0.0.1", sport, SYN, 0);
    let (a, out) = decap_run(&mut lab, &from_lb(&syn, &["10.1.0.2"], 0));
    assert_eq!(a, XDP_PASS);
    assert_eq!(out, eth([0x02, 0, 0, 0, 0x0b, 0x01], LB_MAC, ETH_IP, &syn));
    let ack = v4_tcp("127.0.0.1", 3, "127.0.0.1", 9, ACK, 0);
    let (a, _) = decap_run(&mut lab, &from_lb(&ack, &[], 0));
    assert_eq!(a, XDP_PASS);
    assert_eq!(lab.stat(stat::DECAP_NO_SECOND_HOP), 1);
    assert_eq!(lab.stat(stat::DECAP_SECOND_HOP), 0);
    assert_eq!(lab.stat(stat::DECAP_OK), 2);
}

/// A raw IPv4 TCP socket in the test's namespace: sends hand-made IPv4/TCP packets (any
/// source address) and reads the TCP segments the host receives, each read bounded.
struct RawTcp(std::os::fd::OwnedFd);

impl RawTcp {
    fn open() -> RawTcp {
        use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
        let fd = unsafe { libc::socket(libc::AF_INET, libc::SOCK_RAW, libc::IPPROTO_TCP) };
        assert!(fd >= 0, "raw socket: {}", std::io::Error::last_os_error());
        let fd = unsafe { OwnedFd::from_raw_fd(fd) };
        let tv = libc::timeval {
            tv_sec: 0,
            tv_usec: 200_000,
        };
        let rc = unsafe {
            libc::setsockopt(
                fd.as_raw_fd(),
                libc::SOL_SOCKET,
                libc::SO_RCVTIMEO,
                &tv as *const _ as *const libc::c_void,
                std::mem::size_of::<libc::timeval>() as u32,
            )
        };
        assert_eq!(rc, 0, "SO_RCVTIMEO: {}", std::io::Error::last_os_error());
        let on: libc::c_int = 1;
        let rc = unsafe {
            libc::setsockopt(
                fd.as_raw_fd(),
                libc::IPPROTO_IP,
                libc::IP_HDRINCL,
                &on as *const _ as *const libc::c_void,
                std::mem::size_of::<libc::c_int>() as u32,
            )
        };
        assert_eq!(rc, 0, "IP_HDRINCL: {}", std::io::Error::last_os_error());
        RawTcp(fd)
    }

    /// Sends an IPv4 packet to its destination address.
    fn send(&self, packet: &[u8]) {
        use std::os::fd::AsRawFd;
        let sa = libc::sockaddr_in {
            sin_family: libc::AF_INET as u16,
            sin_port: 0,
            sin_addr: libc::in_addr {
                s_addr: u32::from_ne_bytes(packet[16..20].try_into().unwrap()),
            },
            sin_zero: [0; 8],
        };
        let n = unsafe {
            libc::sendto(
                self.0.as_raw_fd(),
                packet.as_ptr() as *const libc::c_void,
                packet.len(),
                0,
                &sa as *const _ as *const libc::sockaddr,
                std::mem::size_of::<libc::sockaddr_in>() as u32,
            )
        };
        assert_eq!(
            n,
            packet.len() as isize,
            "sendto: {}",
            std::io::Error::last_os_error()
        );
    }

    /// The TCP header of the first segment from port `from` to port `to` with `flags` set
    /// that the host receives within 2 s; fails naming the segments seen instead.
    fn wait_for(&self, from: u16, to: u16, flags: u8) -> Vec<u8> {
        use std::os::fd::AsRawFd;
        let deadline = std::time::Instant::now() + std::time::Duration::from_secs(2);
        let mut seen = Vec::new();
        let mut buf = [0u8; 2048];
        while std::time::Instant::now() < deadline {
            let n = unsafe {
                libc::recv(
                    self.0.as_raw_fd(),
                    buf.as_mut_ptr() as *mut libc::c_void,
                    buf.len(),
                    0,
                )
            };
            if n < 20 {
                continue;
            }
            let ihl = (buf[0] & 0x0f) as usize * 4;
            let t = &buf[ihl..n as usize];
            let (sp, dp) = (
                u16::from_be_bytes([t[0], t[1]]),
                u16::from_be_bytes([t[2], t[3]]),
            );
            if sp == from && dp == to && t[13] & flags == flags {
                return t[..20].to_vec();
            }
            seen.push(format!("{sp}->{dp} flags {:#04x}", t[13]));
        }
        panic!("no segment {from}->{to} with flags {flags:#04x} within 2 s; seen: {seen:?}");
    }
}

/// An IPv4/TCP packet `src`:`sport` -> `dst`:`dport` without payload, checksummed.
fn tcp_packet(
    (src, sport): (&str, u16),
    (dst, dport): (&str, u16),
    seq: u32,
    ack: u32,
    flags: u8,
) -> Vec<u8> {
    let mut t = tcp(sport, dport, flags, b"");
    t[4..8].copy_from_slice(&seq.to_be_bytes());
    t[8..12].copy_from_slice(&ack.to_be_bytes());
    let (s4, d4): (std::net::Ipv4Addr, std::net::Ipv4Addr) =
        (src.parse().unwrap(), dst.parse().unwrap());
    let mut pseudo = [s4.octets(), d4.octets()].concat();
    pseudo.extend_from_slice(&[0, PROTO_TCP, 0, t.len() as u8]);
    pseudo.extend_from_slice(&t);
    t[16..18].copy_from_slice(&csum(&pseudo).to_be_bytes());
    V4::new(src, dst, PROTO_TCP).build(&t)
}

fn sysctl(setting: &str) {
    let ok = std::process::Command::new("sysctl")
        .args(["-qw", setting])
        .status()
        .unwrap()
        .success();
    assert!(ok, "sysctl -w {setting}");
}

/// The handshake's last ACK of a connection opened with a SYN cookie: no socket but the
/// listener exists for it, and only the cookie (checked by `bpf_tcp_check_syncookie`) tells
/// that it is this host's. With the right cookie it is delivered; with a wrong one it is
/// another host's and passed on.
#[test]
fn backend_delivers_the_last_ack_of_a_syn_cookie_handshake_and_passes_on_a_wrong_cookie() {
    let (mut lab, _l, _c, _cport, sport) = backend_host();
    // Cookies for every SYN, in this test's namespace only: the SYN leaves no request socket.
    sysctl("net.ipv4.tcp_syncookies=2");
    let raw = RawTcp::open();
    let (cport, isn) = (40123, 7000);
    let (client, server) = (("127.0.0.1", cport), ("127.0.0.1", sport));
    raw.send(&tcp_packet(client, server, isn, 0, SYN));
    let synack = raw.wait_for(sport, cport, SYN | ACK);
    let cookie = u32::from_be_bytes(synack[4..8].try_into().unwrap());
    let inner = |ack: u32| tcp_packet(client, server, isn + 1, ack, ACK);
    let good = inner(cookie.wrapping_add(1));
    let (a, out) = decap_run(&mut lab, &from_lb(&good, &["10.1.0.2"], 0));
    assert_eq!(a, XDP_PASS, "the cookie is this host's: delivered");
    assert_eq!(out, eth([0x02, 0, 0, 0, 0x0b, 0x01], LB_MAC, ETH_IP, &good));
    assert_eq!(lab.stat(stat::DECAP_OK), 1);
    assert_eq!(lab.stat(stat::DECAP_SECOND_HOP), 0);
    // (Its low bits encode the MSS: only a change above them makes a cookie invalid.)
    let bad = inner(cookie.wrapping_add(1) ^ 0x00ff_0000);
    let (a, _) = decap_run(&mut lab, &from_lb(&bad, &["10.1.0.2"], 0));
    assert_eq!(a, XDP_REDIRECT, "a cookie not of this host: passed on");
    assert_eq!(lab.stat(stat::DECAP_SECOND_HOP), 1);
    assert_eq!(lab.stat(stat::DECAP_OK), 1);
}

/// The handshake's last ACK while the connection is a request socket (the SYN answered, the
/// ACK not yet seen) is this host's, whatever its numbers; an ACK of another client is not.
#[test]
fn backend_delivers_the_last_ack_to_a_request_socket() {
    let (mut lab, _l, _c, _cport, _sport) = backend_host();
    sysctl("net.ipv4.tcp_syncookies=0");
    // A listener on the segment's address, and a client beyond a route through the (silent)
    // previous backend: the SYN-ACK leaves, no RST comes back, the request socket stays.
    let listener = std::net::TcpListener::bind("10.1.0.254:0").unwrap();
    let port = listener.local_addr().unwrap().port();
    let ok = std::process::Command::new("ip")
        .args(["route", "add", "10.5.5.0/24", "via", "10.1.0.2"])
        .status()
        .unwrap()
        .success();
    assert!(ok, "ip route add 10.5.5.0/24 via 10.1.0.2");
    let server = ("10.1.0.254", port);
    RawTcp::open().send(&tcp_packet(("10.5.5.5", 40124), server, 9000, 0, SYN));
    // Bounded wait for the request socket (state 03, SYN_RECV, in this thread's namespace).
    // /proc/net/tcp: local then remote address (the __be32 printed as a native u32) and
    // port, then the state.
    let want = format!("FE00010A:{port:04X} 0505050A:9CBC 03");
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(2);
    let mut table = String::new();
    while std::time::Instant::now() < deadline {
        table = std::fs::read_to_string("/proc/thread-self/net/tcp").unwrap();
        if table.lines().any(|l| l.contains(&want)) {
            break;
        }
        std::thread::sleep(std::time::Duration::from_millis(10));
    }
    assert!(
        table.lines().any(|l| l.contains(&want)),
        "no request socket {want} within 2 s:\n{table}"
    );
    let ack = tcp_packet(("10.5.5.5", 40124), server, 9001, 1, ACK);
    let (a, _) = decap_run(&mut lab, &from_lb(&ack, &["10.1.0.2"], 0));
    assert_eq!(a, XDP_PASS, "the request socket is here: delivered");
    assert_eq!(lab.stat(stat::DECAP_OK), 1);
    assert_eq!(lab.stat(stat::DECAP_SECOND_HOP), 0);
    let other = tcp_packet(("10.5.5.5", 40125), server, 9001, 1, ACK);
    let (a, _) = decap_run(&mut lab, &from_lb(&other, &["10.1.0.2"], 0));
    assert_eq!(
        a, XDP_REDIRECT,
        "another client's ACK meets only the listener: passed on"
    );
    assert_eq!(lab.stat(stat::DECAP_SECOND_HOP), 1);
}

#[test]
fn second_chance_vip_steers_tcp_by_the_ring_alone_and_udp_keeps_the_table() {
    let mut lab = Lab::new();
    let vip = lab.vip(0, VIP4, 443, PROTO_TCP, VIP_F_SECOND_CHANCE, 0);
    lab.backends(&vip, &BACKENDS4);
    gue(&mut lab, &[1, 2, 3]);
    let before: Vec<u32> = lab
        .dp
        .live_ring(&vip)
        .unwrap()
        .unwrap()
        .iter()
        .map(|s| u32::from(s.backend))
        .collect();
    let key = flow(CLIENT4, 40000, VIP4, 443, PROTO_TCP);
    let syn = v4_tcp(CLIENT4, 40000, VIP4, 443, SYN, 0);
    let (a, _) = lab.run(&on_wire(&syn));
    assert_eq!(a, XDP_TX);
    assert_eq!(lab.dp.conn(&key).unwrap(), None, "no entry for a SYN");
    // A backend is added: a flow whose slot moved goes to the new owner, naming the old one,
    // packet after packet, with no entry and no table lookup.
    let mut four = BACKENDS4.to_vec();
    four.push((4, "10.1.0.4", 1));
    lab.backends(&vip, &four);
    gue(&mut lab, &[1, 2, 3, 4]);
    let (port, old, new) = moved_flow(&mut lab, &vip, &before);
    let key = flow(CLIENT4, port, VIP4, 443, PROTO_TCP);
    let h = lab.flow_hash(&key, false);
    let ack = v4_tcp(CLIENT4, port, VIP4, 443, ACK, 0);
    let to = lab.backend_addr(new);
    let prev = lab.backend_addr(old);
    for _ in 0..2 {
        let (a, out) = lab.run(&on_wire(&ack));
        assert_eq!(a, XDP_TX);
        assert_eq!(out, gue_encapsulated(&lab, &ack, to, h, &[prev]));
    }
    assert_eq!(lab.dp.conn(&key).unwrap(), None);
    assert_eq!(lab.stat(stat::CONN_MISS), 0);
    assert_eq!(lab.stat(stat::CONN_HIT), 0);
    assert_eq!(lab.stat(stat::SECOND_CHANCE_STEERED), 3);
    // UDP on a second-chance VIP keeps the table.
    let uvip = lab.vip(1, VIP4, 443, PROTO_UDP, VIP_F_SECOND_CHANCE, 0);
    lab.backends(&uvip, &[(5, "10.1.0.5", 1)]);
    let udp_pkt = V4::new(CLIENT4, VIP4, PROTO_UDP).build(&udp(5000, 443, b"q"));
    let (a, _) = lab.run(&on_wire(&udp_pkt));
    assert_eq!(a, XDP_TX);
    let ukey = flow(CLIENT4, 5000, VIP4, 443, PROTO_UDP);
    assert_eq!(lab.dp.conn(&ukey).unwrap().map(|c| c.backend), Some(5));
}

/// BPF_PROG_TEST_RUN of `sluice_xdp` on `frame` preceded by `meta` bytes of XDP metadata.
/// The metadata takes its room from the frame's headroom, as a NIC driver or an earlier XDP
/// program that leaves metadata does; the kernel takes at most 216 bytes here (the 256 of
/// headroom less its own `xdp_frame`), which leaves no room to grow the frame at the front.
/// Returns the action and the output (metadata included).
fn run_with_metadata(lab: &mut Lab, frame: &[u8], meta: usize) -> (u32, Vec<u8>) {
    use aya::programs::{TestRun, TestRunOptions};
    let mut data = vec![0xa5u8; meta];
    data.extend_from_slice(frame);
    // struct xdp_md: data, data_end, data_meta, ingress_ifindex, rx_queue_index,
    // egress_ifindex.
    let md: Vec<u8> = [meta as u32, data.len() as u32, 0, 0, 0, 0]
        .iter()
        .flat_map(|w| w.to_ne_bytes())
        .collect();
    let mut out = vec![0u8; data.len() + 128];
    let r = lab
        .dp
        .program(sluice::dataplane::PROG_XDP)
        .unwrap()
        .test_run(TestRunOptions {
            data_in: Some(&data),
            data_out: Some(&mut out),
            ctx_in: Some(&md),
            ..Default::default()
        })
        .unwrap_or_else(|e| panic!("BPF_PROG_TEST_RUN with {meta} bytes of metadata: {e:#}"));
    out.truncate(r.data_size_out as usize);
    (r.return_value, out)
}

/// Encapsulation needs headroom in front of the frame; when metadata left none, the packet is
/// dropped and counted as `drop_adjust_head`, and nothing is counted as sent. With a little
/// metadata (32 bytes) the same packet leaves encapsulated.
#[test]
fn encapsulation_without_headroom_drops_as_drop_adjust_head() {
    let (mut lab, vip) = lab_v4();
    let syn = on_wire(&v4_tcp(CLIENT4, 43000, VIP4, 443, SYN, 0));
    let (a, _) = run_with_metadata(&mut lab, &syn, 216);
    assert_eq!(a, XDP_DROP);
    assert_eq!(lab.stat(stat::DROP_ADJUST_HEAD), 1);
    assert_eq!((lab.stat(stat::TX), lab.stat(stat::REDIRECT)), (0, 0));
    let key = flow(CLIENT4, 43001, VIP4, 443, PROTO_TCP);
    let want = lab.ring_choice(&vip, &key, false);
    let h = lab.flow_hash(&key, false);
    let l3 = v4_tcp(CLIENT4, 43001, VIP4, 443, SYN, 0);
    let (a, out) = run_with_metadata(&mut lab, &on_wire(&l3), 32);
    assert_eq!(a, XDP_TX);
    let addr = lab.backend_addr(want);
    assert_eq!(out[32..], encapsulated(&lab, &l3, addr, h)[..]);
    assert_eq!(
        (lab.stat(stat::DROP_ADJUST_HEAD), lab.stat(stat::TX)),
        (1, 1)
    );
}

/// A tunnel packet whose inner IPv4 length is shorter than its own header (8 bytes, and the
/// outer length agrees) is not stripped: handing the stack 8 bytes as a packet would only
/// move the length check there. It passes untouched as `decap_pass_bad_len`.
#[test]
fn decap_passes_an_inner_length_shorter_than_its_header_untouched() {
    let mut lab = Lab::new();
    let bmac: Mac = [0x02, 0, 0, 0, 0x0b, 0x01];
    let mut inner = v4_tcp(CLIENT4, 1, VIP4, 443, SYN, 0);
    inner[2..4].copy_from_slice(&8u16.to_be_bytes());
    let mut o4 = V4::new("172.16.1.2", "10.1.0.1", PROTO_IPIP);
    o4.frag = 0;
    let mut frame = eth(bmac, LB_MAC, ETH_IP, &o4.build(&inner));
    frame[16..18].copy_from_slice(&28u16.to_be_bytes());
    let (a, out) = run_prog(&mut lab.dp, PROG_DECAP, &frame).unwrap();
    assert_eq!((a, out), (XDP_PASS, frame));
    assert_eq!(
        (lab.stat(stat::DECAP_PASS_BAD_LEN), lab.stat(stat::DECAP_OK)),
        (1, 0)
    );
}

// QUIC connection-ID routing: a `quic = "cid"` VIP with server IDs of `SID_LEN` octets,
// config rotation `ROTATION`, and `BACKENDS4` holding the IDs in `QUIC_SIDS`.

const SID_LEN: u8 = 2;
const ROTATION: u8 = 1;
const QUIC_SIDS: [(u32, [u8; 2]); 3] = [(1, [0x0a, 0x01]), (2, [0x0a, 0x02]), (3, [0x0a, 0x03])];
const QUIC_VERSION_2: u32 = 0x6b33_43cf;

fn quic_lab() -> (Lab, lb_common::VipKey) {
    let mut lab = Lab::new();
    let vip = lab.vip(0, VIP4, 443, PROTO_UDP, VIP_F_QUIC_CID, 0);
    let mut meta = lab.dp.vip(&vip).unwrap().unwrap();
    meta.quic_rotation = ROTATION;
    meta.quic_server_id_len = SID_LEN;
    lab.dp.set_vip(&vip, &meta).unwrap();
    lab.backends(&vip, &BACKENDS4);
    for (id, sid) in QUIC_SIDS {
        lab.dp.set_quic_server(&quic_key(0, &sid), id).unwrap();
    }
    (lab, vip)
}

fn quic_key(vip: u32, sid: &[u8]) -> QuicServerKey {
    QuicServerKey {
        vip,
        _pad: 0,
        id: quic::server_id_value(sid),
    }
}

/// A connection ID the server with `sid` chose: rotation bits and 5 random-looking low bits,
/// the server ID, then a 6-octet nonce.
fn cid(rotation: u8, sid: &[u8], nonce: u8) -> Vec<u8> {
    let mut c = vec![rotation << 5 | 0x15];
    c.extend_from_slice(sid);
    c.extend((0..6).map(|i| nonce.wrapping_mul(31).wrapping_add(i)));
    c
}

/// A short-header packet to `dcid`: first octet, the ID, a packet number and a sealed
/// payload (its octets differ per packet, as header protection makes them).
fn short_header(dcid: &[u8], pn: u8) -> Vec<u8> {
    let mut p = vec![0x40 | 0x01];
    p.extend_from_slice(dcid);
    p.extend_from_slice(&[pn, pn]);
    p.extend(std::iter::repeat_n(0xa5 ^ pn, 24));
    p
}

/// A long-header packet of `version` and type `kind` to `dcid` from a 4-octet SCID.
fn long_header(version: u32, kind: u8, dcid: &[u8]) -> Vec<u8> {
    let mut p = vec![0xc0 | kind << 4];
    p.extend_from_slice(&version.to_be_bytes());
    p.push(dcid.len() as u8);
    p.extend_from_slice(dcid);
    p.extend_from_slice(&[4, 0xc1, 0xc2, 0xc3, 0xc4]);
    p.extend(std::iter::repeat_n(0x5a, 40));
    p
}

fn quic_pkt(sport: u16, payload: &[u8]) -> Vec<u8> {
    V4::new(CLIENT4, VIP4, PROTO_UDP).build(&udp(sport, 443, payload))
}

/// The outer-header hash of a packet routed by `dcid`: the server ID and the nonce's first
/// four octets, as the data plane reads them.
fn cid_hash_of(dcid: &[u8]) -> u32 {
    let stable = (SID_LEN as usize + 4).min(8);
    let mut next = [0u8; 8];
    next[..stable].copy_from_slice(&dcid[1..1 + stable]);
    lb_common::hash::cid_hash(
        u64::from_be_bytes(next) >> (64 - 8 * stable),
        sluice_tests::SEED,
    )
}

/// Sends a QUIC packet routed by its connection ID and checks the exact frame that left for
/// backend `id`, and that no connection-table entry was made.
fn assert_cid_routed(lab: &mut Lab, l3: &[u8], dcid: &[u8], id: u32, sport: u16) {
    let before = lab.stat(stat::QUIC_CID_ROUTED);
    let addr = lab.backend_addr(id);
    let (action, out) = lab.run(&on_wire(l3));
    assert_eq!(action, XDP_TX);
    assert_eq!(out, encapsulated(lab, l3, addr, cid_hash_of(dcid)));
    assert_eq!(lab.stat(stat::QUIC_CID_ROUTED), before + 1);
    let key = flow(CLIENT4, sport, VIP4, 443, PROTO_UDP);
    assert!(lab.dp.conn(&key).unwrap().is_none(), "no table entry");
}

/// Sends a QUIC packet that must take the 5-tuple path, counted under `counter`: it goes to
/// the ring's choice and gets a connection-table entry, as any UDP flow does.
fn assert_five_tuple(
    lab: &mut Lab,
    vip: &lb_common::VipKey,
    l3: &[u8],
    sport: u16,
    counter: stat::Counter,
) {
    let before = lab.stat(counter);
    let key = flow(CLIENT4, sport, VIP4, 443, PROTO_UDP);
    let want = lab.ring_choice(vip, &key, false);
    let h = lab.flow_hash(&key, false);
    assert_steered(lab, l3, want, h);
    assert_eq!(lab.stat(counter), before + 1, "counter {}", counter.name());
    assert_eq!(lab.dp.conn(&key).unwrap().unwrap().backend, want);
}

#[test]
fn a_short_header_goes_to_the_server_its_connection_id_names_from_any_address_and_port() {
    let (mut lab, _vip) = quic_lab();
    for (id, sid) in QUIC_SIDS {
        let dcid = cid(ROTATION, &sid, id as u8);
        // The same connection after NAT rebinding: new ports, and a new address.
        for (n, sport) in [50000u16, 50001, 61234].into_iter().enumerate() {
            let pkt = quic_pkt(sport, &short_header(&dcid, n as u8));
            assert_cid_routed(&mut lab, &pkt, &dcid, id, sport);
        }
        let moved = V4::new("198.51.100.77", VIP4, PROTO_UDP).build(&udp(
            4433,
            443,
            &short_header(&dcid, 9),
        ));
        let (action, out) = lab.run(&on_wire(&moved));
        assert_eq!(action, XDP_TX);
        let addr = lab.backend_addr(id);
        assert_eq!(out, encapsulated(&lab, &moved, addr, cid_hash_of(&dcid)));
    }
    assert_eq!(
        lab.stat(stat::CONN_MISS),
        0,
        "no packet took the table path"
    );
    assert_eq!(lab.dp.backend_stats(2).unwrap().packets, 4);
    assert_eq!(lab.dp.backend_stats(2).unwrap().new_flows, 0);
}

#[test]
fn handshake_packets_of_v1_and_v2_are_routed_by_the_servers_connection_id() {
    let (mut lab, _vip) = quic_lab();
    let dcid = cid(ROTATION, &QUIC_SIDS[2].1, 7);
    assert_cid_routed(
        &mut lab,
        &quic_pkt(50100, &long_header(1, 2, &dcid)),
        &dcid,
        3,
        50100,
    );
    assert_cid_routed(
        &mut lab,
        &quic_pkt(50101, &long_header(QUIC_VERSION_2, 3, &dcid)),
        &dcid,
        3,
        50101,
    );
}

#[test]
fn initial_0rtt_and_unknown_versions_carry_the_clients_id_and_take_the_5_tuple_path() {
    let (mut lab, vip) = quic_lab();
    // A client's first DCID is random; here it even looks like backend 1's, and still does not
    // route: only the server's own IDs do.
    let dcid = cid(ROTATION, &QUIC_SIDS[0].1, 3);
    let cases: [(&str, Vec<u8>); 6] = [
        ("v1 initial", long_header(1, 0, &dcid)),
        ("v1 0-rtt", long_header(1, 1, &dcid)),
        ("v2 initial", long_header(QUIC_VERSION_2, 1, &dcid)),
        ("v2 0-rtt", long_header(QUIC_VERSION_2, 2, &dcid)),
        ("version negotiation", long_header(0, 0, &dcid)),
        ("unknown version", long_header(0x1a2a_3a4a, 2, &dcid)),
    ];
    for (n, (name, payload)) in cases.iter().enumerate() {
        let sport = 51000 + n as u16;
        eprintln!("{name}");
        assert_five_tuple(
            &mut lab,
            &vip,
            &quic_pkt(sport, payload),
            sport,
            stat::QUIC_CLIENT_CID,
        );
    }
    assert_eq!(lab.stat(stat::QUIC_CID_ROUTED), 0);
}

#[test]
fn ids_of_another_rotation_or_no_known_server_take_the_5_tuple_path() {
    let (mut lab, vip) = quic_lab();
    let cases = [
        (
            cid(ROTATION + 1, &QUIC_SIDS[0].1, 1),
            stat::QUIC_UNKNOWN_ROTATION,
        ),
        (
            cid(quic::ROTATION_UNROUTABLE, &QUIC_SIDS[0].1, 1),
            stat::QUIC_UNKNOWN_ROTATION,
        ),
        (cid(ROTATION, &[0x0a, 0x09], 1), stat::QUIC_UNKNOWN_SERVER),
    ];
    for (n, (dcid, counter)) in cases.iter().enumerate() {
        let sport = 52000 + n as u16;
        assert_five_tuple(
            &mut lab,
            &vip,
            &quic_pkt(sport, &short_header(dcid, 0)),
            sport,
            *counter,
        );
        // A stateless reset looks like any short header: its random octets route nowhere.
    }
    // The same server ID under another VIP is not this VIP's.
    lab.dp
        .remove_quic_server(&quic_key(0, &QUIC_SIDS[1].1))
        .unwrap();
    lab.dp
        .set_quic_server(&quic_key(1, &QUIC_SIDS[1].1), 2)
        .unwrap();
    let dcid = cid(ROTATION, &QUIC_SIDS[1].1, 1);
    assert_five_tuple(
        &mut lab,
        &vip,
        &quic_pkt(52010, &short_header(&dcid, 0)),
        52010,
        stat::QUIC_UNKNOWN_SERVER,
    );
}

#[test]
fn a_draining_server_keeps_its_connections_and_a_down_one_loses_them_to_the_5_tuple_path() {
    let (mut lab, vip) = quic_lab();
    let dcid = cid(ROTATION, &QUIC_SIDS[1].1, 5);
    lab.set_state(2, BACKEND_DRAINING);
    assert_cid_routed(
        &mut lab,
        &quic_pkt(53000, &short_header(&dcid, 0)),
        &dcid,
        2,
        53000,
    );
    lab.set_state(2, BACKEND_DOWN);
    // The ring may still name backend 2 for this 5-tuple: then the table's down-backend
    // handling applies, as for any UDP flow. Pick a port whose ring choice is another backend.
    let sport = (53001..60000)
        .find(|&p| lab.ring_choice(&vip, &flow(CLIENT4, p, VIP4, 443, PROTO_UDP), false) != 2)
        .unwrap();
    assert_five_tuple(
        &mut lab,
        &vip,
        &quic_pkt(sport, &short_header(&dcid, 1)),
        sport,
        stat::QUIC_SERVER_DOWN,
    );
}

#[test]
fn malformed_quic_headers_take_the_5_tuple_path_and_are_counted() {
    let (mut lab, vip) = quic_lab();
    let dcid = cid(ROTATION, &QUIC_SIDS[0].1, 2);
    let mut too_long = long_header(1, 2, &[0x20; 21]);
    too_long[5] = 21;
    // A 20-octet DCID of which the packet holds ten: the server ID is there, the rest not.
    let mut past_packet = vec![0xe0, 0, 0, 0, 1, 20];
    past_packet.extend_from_slice(&dcid);
    past_packet.extend_from_slice(&[0x33; 1]);
    let cases: [(&str, Vec<u8>); 6] = [
        ("empty payload", vec![]),
        ("short header, id cut", vec![0x41, ROTATION << 5, 0x0a]),
        ("long header cut in its fixed part", vec![0xe0, 0, 0, 0, 1]),
        ("handshake dcid over 20 octets", too_long),
        (
            "handshake dcid shorter than a server id",
            long_header(1, 2, &[ROTATION << 5, 0x0a]),
        ),
        ("handshake dcid past the packet", past_packet),
    ];
    for (n, (name, payload)) in cases.iter().enumerate() {
        eprintln!("{name}");
        let sport = 54000 + n as u16;
        assert_five_tuple(
            &mut lab,
            &vip,
            &quic_pkt(sport, payload),
            sport,
            stat::QUIC_MALFORMED,
        );
    }
    // Octets past the IP length (Ethernet padding) are not part of the packet: a short
    // header whose server ID lies there is malformed, not routed.
    let mut padded = quic_pkt(54100, &[0x41, ROTATION << 5, 0x0a]);
    padded.extend_from_slice(&[0x01; 20]);
    let before = lab.stat(stat::QUIC_MALFORMED);
    let (action, _) = lab.run(&on_wire(&padded));
    assert_eq!(action, XDP_TX);
    assert_eq!(lab.stat(stat::QUIC_MALFORMED), before + 1);
    assert_eq!(lab.stat(stat::QUIC_CID_ROUTED), 0);
}

#[test]
fn server_ids_of_one_and_eight_octets_are_read_exactly() {
    for len in [1u8, 8] {
        let mut lab = Lab::new();
        let vip = lab.vip(0, VIP4, 443, PROTO_UDP, VIP_F_QUIC_CID, 0);
        let mut meta = lab.dp.vip(&vip).unwrap().unwrap();
        meta.quic_server_id_len = len;
        lab.dp.set_vip(&vip, &meta).unwrap();
        lab.backends(&vip, &BACKENDS4);
        let sid: Vec<u8> = (0..len).map(|i| 0x80 | i).collect();
        lab.dp.set_quic_server(&quic_key(0, &sid), 3).unwrap();
        let mut dcid = vec![0x1f];
        dcid.extend_from_slice(&sid);
        dcid.extend_from_slice(&[0xee; 4]);
        let (action, out) = lab.run(&on_wire(&quic_pkt(55000, &short_header(&dcid, 0))));
        assert_eq!(action, XDP_TX, "{len}");
        let inner_dst = &out[14 + 20 + 16..14 + 20 + 20];
        assert_eq!(inner_dst, [10, 200, 0, 1]);
        assert_eq!(
            &out[14 + 16..14 + 20],
            [10, 1, 0, 3],
            "{len}-octet id: backend 3"
        );
        // One octet more or less of the ID is another server.
        dcid[len as usize] ^= 1;
        lab.run(&on_wire(&quic_pkt(55001, &short_header(&dcid, 0))));
        assert_eq!(lab.stat(stat::QUIC_UNKNOWN_SERVER), 1, "{len}");
    }
}

#[test]
fn without_quic_cid_a_vip_steers_quic_by_its_5_tuple_and_icmp_errors_never_by_id() {
    let mut lab = Lab::new();
    let vip = lab.vip(0, VIP4, 443, PROTO_UDP, 0, 0);
    lab.backends(&vip, &BACKENDS4);
    lab.dp
        .set_quic_server(&quic_key(0, &QUIC_SIDS[0].1), 1)
        .unwrap();
    let dcid = cid(0, &QUIC_SIDS[0].1, 1);
    let key = flow(CLIENT4, 56000, VIP4, 443, PROTO_UDP);
    let want = lab.ring_choice(&vip, &key, false);
    let h = lab.flow_hash(&key, false);
    assert_steered(&mut lab, &quic_pkt(56000, &short_header(&dcid, 0)), want, h);
    let quic_counters = [
        stat::QUIC_CID_ROUTED,
        stat::QUIC_CLIENT_CID,
        stat::QUIC_UNKNOWN_ROTATION,
        stat::QUIC_UNKNOWN_SERVER,
        stat::QUIC_SERVER_DOWN,
        stat::QUIC_MALFORMED,
    ];
    assert!(quic_counters.iter().all(|c| lab.stat(*c) == 0));

    // On a CID VIP, an ICMP error quoting a server's packet follows the quoted 5-tuple.
    let (mut lab, _vip) = quic_lab();
    lab.run(&on_wire(&quic_pkt(56001, &long_header(1, 0, &dcid))));
    let key = flow(CLIENT4, 56001, VIP4, 443, PROTO_UDP);
    let b = lab.dp.conn(&key).unwrap().unwrap().backend;
    let quoted = V4::new(VIP4, CLIENT4, PROTO_UDP).build(&udp(443, 56001, &short_header(&dcid, 0)));
    let icmp =
        V4::new("198.51.100.1", VIP4, PROTO_ICMP).build(&icmp_error(3, 4, 1400, &quoted[..28]));
    let h = lab.flow_hash(&key, false);
    assert_steered(&mut lab, &icmp, b, h);
    assert_eq!(lab.stat(stat::QUIC_CID_ROUTED), 0);
    assert_eq!(lab.stat(stat::QUIC_CLIENT_CID), 1);
}

// Tenants: client prefixes in `TENANT_PREFIXES`, each tenant's limits per VIP in
// `TENANT_LIMITS`, written here as the controller writes them. Tenant 1 holds 10.7.0.0/16
// and 2001:db8:7::/48; tenant 2 the /24 and /56 inside them.

/// The rate tests' interval: one new session an hour, so no stall of a test run between
/// reading the clock and sending its packets earns a token (no test races the clock).
const HOUR_NS: u64 = 3600 * 1_000_000_000;
const TENANT1_V4: &str = "10.7.9.5";
const TENANT2_V4: &str = "10.7.3.5";
const TENANT1_V6: &str = "2001:db8:7:900::5";
const TENANT2_V6: &str = "2001:db8:7:300::5";

fn tenant_maps(lab: &mut Lab) -> TenantMaps {
    let mut t = TenantMaps::open(&mut lab.dp).unwrap();
    for (cidr, tenant) in [
        ("10.7.0.0/16", 1),
        ("10.7.3.0/24", 2),
        ("2001:db8:7::/48", 1),
        ("2001:db8:7:300::/56", 2),
    ] {
        t.set_prefix(cidr, tenant).unwrap();
    }
    t
}

fn flagged(flags: u32) -> TenantLimits {
    TenantLimits {
        flags,
        ..Default::default()
    }
}

/// One new session an hour with a burst of `burst`, as the controller writes a rate.
fn hourly(burst: u64) -> TenantLimits {
    TenantLimits {
        interval_ns: HOUR_NS,
        burst_ns: burst * HOUR_NS,
        ..Default::default()
    }
}

/// Sends a TCP segment from `client` to `vip_addr`:443 and asserts it left encapsulated, byte
/// for byte, to the ring's backend.
fn assert_tcp_forwarded(
    lab: &mut Lab,
    vip: &lb_common::VipKey,
    client: &str,
    sport: u16,
    flags: u8,
) {
    let dst = sluice::addr::from_words(vip.addr, vip.family);
    let key = flow(client, sport, &dst.to_string(), 443, PROTO_TCP);
    let want = lab.ring_choice(vip, &key, false);
    let h = lab.flow_hash(&key, false);
    let l3 = tcp_packet_to(client, &dst.to_string(), sport, flags);
    assert_steered(lab, &l3, want, h);
}

/// An IPv4 or IPv6 TCP segment without payload, by the addresses' family.
fn tcp_packet_to(client: &str, dst: &str, sport: u16, flags: u8) -> Vec<u8> {
    let seg = tcp(sport, 443, flags, b"");
    if ip(client).is_ipv4() {
        V4::new(client, dst, PROTO_TCP).build(&seg)
    } else {
        ipv6(client, dst, PROTO_TCP, 0, 0, &seg)
    }
}

/// The frame an IPv4 client's SYN to VIP4:443 is refused with on a VIP with
/// `VIP_F_SHED_RST`.
fn rst_to(client: &str, sport: u16) -> Vec<u8> {
    let rst = tcp_rst(ip(VIP4), ip(client), 443, sport, 1001);
    eth(
        CLIENT_MAC,
        LB_MAC,
        ETH_IP,
        &V4::new(VIP4, client, PROTO_TCP).build(&rst),
    )
}

/// The prefixes as the controller writes them (`Dataplane::sync_tenants`: the trie, then the
/// IPv4 table): 10.7.0.0/16 tenant 1, 10.7.3.0/24 tenant 2, 10.7.9.16/28 tenant 3 (so the
/// /24 10.7.9.0 is left to the trie), 2001:db8:7::/48 tenant 1.
fn sync_tenant_prefixes(lab: &mut Lab) {
    let prefixes = [
        ("10.7.0.0/16", 1),
        ("10.7.3.0/24", 2),
        ("10.7.9.16/28", 3),
        ("2001:db8:7::/48", 1),
    ]
    .into_iter()
    .map(|(c, t)| (c.parse().unwrap(), t))
    .collect();
    lab.dp
        .sync_tenants(&prefixes, &Default::default(), &[])
        .unwrap();
}

/// Sends one SYN from each client and asserts the tenant whose session it was counted as.
fn assert_tenants(lab: &mut Lab, vip: &lb_common::VipKey, vip_id: u32, cases: &[(&str, u32)]) {
    let t = TenantMaps::open(&mut lab.dp).unwrap();
    for (n, &(client, tenant)) in cases.iter().enumerate() {
        let before = t.stats(vip_id, tenant).unwrap().admitted;
        assert_tcp_forwarded(lab, vip, client, 47200 + n as u16, SYN);
        assert_eq!(
            t.stats(vip_id, tenant).unwrap().admitted,
            before + 1,
            "{client} is tenant {tenant}"
        );
    }
}

#[test]
fn the_longest_tenant_prefix_names_the_clients_tenant_and_no_match_is_the_default_tenant() {
    let mut lab = Lab::new();
    let vip4 = lab.vip(0, VIP4, 443, PROTO_TCP, VIP_F_TENANTS, 0);
    lab.backends(&vip4, &BACKENDS4);
    let vip6 = lab.vip(1, VIP6, 443, PROTO_TCP, VIP_F_TENANTS, 0);
    lab.backends(&vip6, &BACKENDS6);
    let t = tenant_maps(&mut lab);
    assert_tenants(
        &mut lab,
        &vip4,
        0,
        &[(TENANT1_V4, 1), (TENANT2_V4, 2), (CLIENT4, 0)],
    );
    assert_tenants(
        &mut lab,
        &vip6,
        1,
        &[(TENANT1_V6, 1), (TENANT2_V6, 2), (CLIENT6, 0)],
    );
    for (vip_id, tenant) in [(0, 0), (0, 1), (0, 2), (1, 0), (1, 1), (1, 2)] {
        assert_eq!(
            t.stats(vip_id, tenant).unwrap(),
            TenantStats {
                admitted: 1,
                ..Default::default()
            },
            "VIP {vip_id}, tenant {tenant}: one session, nothing refused"
        );
    }
}

/// One trie holds both families: an IPv4 prefix whose 32 bits are the first word of an IPv6
/// client's address (32.1.13.184 is 2001:db8) matches that IPv4 address, never the IPv6
/// client, whose tenant stays the default one.
#[test]
fn an_ipv4_tenant_prefix_never_matches_an_ipv6_client() {
    let mut lab = Lab::new();
    let vip4 = lab.vip(0, VIP4, 443, PROTO_TCP, VIP_F_TENANTS, 0);
    lab.backends(&vip4, &BACKENDS4);
    let vip6 = lab.vip(1, VIP6, 443, PROTO_TCP, VIP_F_TENANTS, 0);
    lab.backends(&vip6, &BACKENDS6);
    let mut t = tenant_maps(&mut lab);
    t.set_prefix("32.1.13.184/32", 5).unwrap();
    t.set_prefix("0.0.0.0/0", 6).unwrap();
    t.set_limits(1, 5, flagged(TENANT_F_CAPPED)).unwrap();
    t.set_limits(1, 6, flagged(TENANT_F_CAPPED)).unwrap();
    assert_tcp_forwarded(&mut lab, &vip6, CLIENT6, 47100, SYN);
    assert_eq!(t.stats(1, 0).unwrap().admitted, 1);
    assert_tcp_forwarded(&mut lab, &vip4, "32.1.13.184", 47101, SYN);
    assert_eq!(t.stats(0, 5).unwrap().admitted, 1);
    assert_tcp_forwarded(&mut lab, &vip4, CLIENT4, 47102, SYN);
    assert_eq!(
        t.stats(0, 6).unwrap().admitted,
        1,
        "0.0.0.0/0 holds every IPv4 client"
    );
    for tenant in [5, 6] {
        assert_eq!(t.stats(1, tenant).unwrap(), TenantStats::default());
    }
}

#[test]
fn an_ipv4_clients_tenant_comes_from_its_slash_24_and_a_longer_prefix_inside_from_the_trie() {
    let mut lab = Lab::new();
    let vip4 = lab.vip(0, VIP4, 443, PROTO_TCP, VIP_F_TENANTS, 0);
    lab.backends(&vip4, &BACKENDS4);
    let vip6 = lab.vip(1, VIP6, 443, PROTO_TCP, VIP_F_TENANTS, 0);
    lab.backends(&vip6, &BACKENDS6);
    sync_tenant_prefixes(&mut lab);
    assert_tenants(
        &mut lab,
        &vip4,
        0,
        &[
            ("10.7.200.1", 1),
            ("10.7.3.5", 2),
            ("10.7.9.20", 3),
            ("10.7.9.5", 1),
            (CLIENT4, 0),
        ],
    );
    assert_tenants(&mut lab, &vip6, 1, &[(TENANT1_V6, 1), (CLIENT6, 0)]);
}

/// The IPv4 table answers on its own: with the trie's /16 moved to another tenant behind the
/// table's back, a client of a /24 the table holds stays tenant 1, while one of the /24 left
/// to the trie follows the trie.
#[test]
fn an_ipv4_slash_24_the_table_holds_is_not_looked_up_in_the_trie() {
    let mut lab = Lab::new();
    let vip4 = lab.vip(0, VIP4, 443, PROTO_TCP, VIP_F_TENANTS, 0);
    lab.backends(&vip4, &BACKENDS4);
    sync_tenant_prefixes(&mut lab);
    TenantMaps::open(&mut lab.dp)
        .unwrap()
        .set_prefix("10.7.0.0/16", 5)
        .unwrap();
    assert_tenants(&mut lab, &vip4, 0, &[("10.7.200.1", 1), ("10.7.9.5", 5)]);
}

/// A tenant flagged by the controller (`flag`) has each new session refused, counted under
/// `counter` and in the tenant's `refused` field: answered with an exact RST where the VIP
/// sheds by RST, dropped where it sheds by drop. Another tenant's SYN is forwarded.
fn flagged_tenant_is_refused(flag: u32, counter: stat::Counter, refused: fn(&TenantStats) -> u64) {
    let mut lab = Lab::new();
    let rst_vip = lab.vip(0, VIP4, 443, PROTO_TCP, VIP_F_TENANTS | VIP_F_SHED_RST, 0);
    lab.backends(&rst_vip, &BACKENDS4);
    let drop_vip = lab.vip(1, VIP6, 443, PROTO_TCP, VIP_F_TENANTS, 0);
    lab.backends(&drop_vip, &BACKENDS6);
    let mut t = tenant_maps(&mut lab);
    t.set_limits(0, 1, flagged(flag)).unwrap();
    t.set_limits(1, 1, flagged(flag)).unwrap();

    let (a, out) = lab.run(&on_wire(&tcp_packet_to(TENANT1_V4, VIP4, 47200, SYN)));
    assert_eq!((a, out), (XDP_TX, rst_to(TENANT1_V4, 47200)));
    assert_eq!((lab.stat(counter), lab.stat(stat::SHED_RST_SENT)), (1, 1));
    let (a, _) = lab.run(&on_wire(&tcp_packet_to(TENANT1_V6, VIP6, 47201, SYN)));
    assert_eq!(a, XDP_DROP);
    assert_eq!((lab.stat(counter), lab.stat(stat::DROP_SHED)), (2, 1));
    assert!(
        lab.dp.conns().unwrap().is_empty(),
        "a refused session leaves no entry"
    );
    for vip_id in [0, 1] {
        let s = t.stats(vip_id, 1).unwrap();
        assert_eq!((refused(&s), s.admitted), (1, 0), "VIP {vip_id}");
        assert_eq!(
            s.refused_sessions + s.refused_share + s.refused_rate,
            1,
            "one reason only"
        );
    }
    // The tenant's /24 inside its /16 is another tenant, and so is everyone else.
    assert_tcp_forwarded(&mut lab, &rst_vip, TENANT2_V4, 47202, SYN);
    assert_tcp_forwarded(&mut lab, &drop_vip, CLIENT6, 47203, SYN);
    assert_eq!(t.stats(0, 2).unwrap().admitted, 1);
    assert_eq!(t.stats(1, 0).unwrap().admitted, 1);
    assert_eq!(lab.stat(stat::SHED_PRIORITY), 0);
}

#[test]
fn a_capped_tenants_syn_is_refused_by_rst_or_drop_and_counted_while_others_pass() {
    flagged_tenant_is_refused(TENANT_F_CAPPED, stat::SHED_TENANT_SESSIONS, |s| {
        s.refused_sessions
    });
}

#[test]
fn an_over_share_tenants_syn_is_refused_by_rst_or_drop_and_counted_while_others_pass() {
    flagged_tenant_is_refused(TENANT_F_OVER_SHARE, stat::SHED_TENANT_SHARE, |s| {
        s.refused_share
    });
}

/// Capped and over share at once: the session limit is the reason counted, once; a refused
/// session takes no token from the tenant's rate.
#[test]
fn a_tenant_capped_and_over_share_is_refused_once_for_its_sessions_and_keeps_its_tokens() {
    let mut lab = Lab::new();
    let vip = lab.vip(0, VIP4, 443, PROTO_TCP, VIP_F_TENANTS, 0);
    lab.backends(&vip, &BACKENDS4);
    let mut t = tenant_maps(&mut lab);
    let mut limits = hourly(1);
    limits.flags = TENANT_F_CAPPED | TENANT_F_OVER_SHARE;
    t.set_limits(0, 1, limits).unwrap();
    let (a, _) = lab.run(&on_wire(&tcp_packet_to(TENANT1_V4, VIP4, 47300, SYN)));
    assert_eq!(a, XDP_DROP);
    let shed = [
        stat::SHED_TENANT_SESSIONS,
        stat::SHED_TENANT_SHARE,
        stat::SHED_TENANT_RATE,
        stat::DROP_SHED,
    ]
    .map(|c| lab.stat(c));
    assert_eq!(shed, [1, 0, 0, 1]);
    assert_eq!(
        t.stats(0, 1).unwrap(),
        TenantStats {
            refused_sessions: 1,
            ..Default::default()
        }
    );
    assert_eq!(t.bucket(0, 1).unwrap(), 0, "no token taken");
}

/// GCRA with a burst of `BURST`: an idle tenant opens `BURST` sessions at once (distinct
/// ports), the next is refused, counted, and moves nothing in the bucket.
#[test]
fn a_tenants_rate_admits_its_burst_and_refuses_the_next_session_without_taking_a_token() {
    const BURST: u64 = 3;
    let mut lab = Lab::new();
    let vip = lab.vip(0, VIP4, 443, PROTO_TCP, VIP_F_TENANTS | VIP_F_SHED_RST, 0);
    lab.backends(&vip, &BACKENDS4);
    let mut t = tenant_maps(&mut lab);
    let limits = hourly(BURST);
    t.set_limits(0, 1, limits).unwrap();
    let start = sluice_tests::tenants::coarse_now_ns();
    for port in 0..BURST as u16 {
        assert_tcp_forwarded(&mut lab, &vip, TENANT1_V4, 47400 + port, SYN);
    }
    let tat = t.bucket(0, 1).unwrap();
    // The first session found the bucket idle: its theoretical arrival time starts now.
    assert!(
        tat >= start + BURST * limits.interval_ns
            && tat <= sluice_tests::tenants::coarse_now_ns() + BURST * limits.interval_ns,
        "after the burst the bucket is BURST intervals ahead of the first session"
    );
    let next = 47400 + BURST as u16;
    let (a, out) = lab.run(&on_wire(&tcp_packet_to(TENANT1_V4, VIP4, next, SYN)));
    assert_eq!((a, out), (XDP_TX, rst_to(TENANT1_V4, next)));
    assert_eq!(
        (
            lab.stat(stat::SHED_TENANT_RATE),
            lab.stat(stat::SHED_RST_SENT)
        ),
        (1, 1)
    );
    assert_eq!(
        t.stats(0, 1).unwrap(),
        TenantStats {
            admitted: BURST,
            refused_rate: 1,
            ..Default::default()
        }
    );
    assert_eq!(
        t.bucket(0, 1).unwrap(),
        tat,
        "a refused session takes no token"
    );
    // Other tenants keep their own buckets.
    assert_tcp_forwarded(&mut lab, &vip, TENANT2_V4, next, SYN);
}

/// The bucket refills at the tenant's rate: a burst spent one interval ago has earned one
/// session back, and exactly one passes. The bucket is set from the data plane's own clock
/// (CLOCK_MONOTONIC_COARSE).
#[test]
fn a_spent_tenant_bucket_admits_exactly_one_session_per_interval_that_passed() {
    const BURST: u64 = 4;
    let mut lab = Lab::new();
    let vip = lab.vip(0, VIP4, 443, PROTO_TCP, VIP_F_TENANTS, 0);
    lab.backends(&vip, &BACKENDS4);
    let mut t = tenant_maps(&mut lab);
    let limits = hourly(BURST);
    t.set_limits(0, 1, limits).unwrap();
    // Spent at `now - interval`: its theoretical arrival time is BURST intervals past that.
    let spent =
        sluice_tests::tenants::coarse_now_ns() - limits.interval_ns + BURST * limits.interval_ns;
    t.set_bucket(0, 1, spent).unwrap();
    assert_tcp_forwarded(&mut lab, &vip, TENANT1_V4, 47500, SYN);
    assert_eq!(t.bucket(0, 1).unwrap(), spent + limits.interval_ns);
    let (a, _) = lab.run(&on_wire(&tcp_packet_to(TENANT1_V4, VIP4, 47501, SYN)));
    assert_eq!(a, XDP_DROP);
    assert_eq!(t.bucket(0, 1).unwrap(), spent + limits.interval_ns);
    assert_eq!(
        t.stats(0, 1).unwrap(),
        TenantStats {
            admitted: 1,
            refused_rate: 1,
            ..Default::default()
        }
    );
    assert_eq!(
        (lab.stat(stat::SHED_TENANT_RATE), lab.stat(stat::DROP_SHED)),
        (1, 1)
    );
}

/// Limits refuse new sessions only: a stream whose session was admitted keeps flowing, byte
/// for byte, once its tenant is capped, over share and out of tokens; so does its SYN's
/// retransmission, a mid-stream packet whose entry was lost, a mid-stream packet of a
/// second-chance VIP (no table) and a UDP flow's later packets.
#[test]
fn established_streams_of_a_tenant_over_every_limit_keep_flowing() {
    let mut lab = Lab::with_max_vips(8);
    let tcp_vip = lab.vip(0, VIP4, 443, PROTO_TCP, VIP_F_TENANTS | VIP_F_SHED_RST, 0);
    lab.backends(&tcp_vip, &BACKENDS4);
    let udp_vip = lab.vip(1, VIP4, 443, PROTO_UDP, VIP_F_TENANTS, 0);
    lab.backends(&udp_vip, &[(21, "10.1.0.21", 1), (22, "10.1.0.22", 1)]);
    let sc_vip = lab.vip(
        2,
        VIP6,
        443,
        PROTO_TCP,
        VIP_F_TENANTS | VIP_F_SECOND_CHANCE,
        0,
    );
    lab.backends(&sc_vip, &BACKENDS6);
    let mut t = tenant_maps(&mut lab);

    assert_tcp_forwarded(&mut lab, &tcp_vip, TENANT1_V4, 47600, SYN);
    let ukey = flow(TENANT1_V4, 47601, VIP4, 443, PROTO_UDP);
    let uwant = lab.ring_choice(&udp_vip, &ukey, false);
    let uh = lab.flow_hash(&ukey, false);
    let udp_pkt = |n: u8| V4::new(TENANT1_V4, VIP4, PROTO_UDP).build(&udp(47601, 443, &[n; 30]));
    assert_steered(&mut lab, &udp_pkt(0), uwant, uh);

    // Every limit at once, the bucket ten hours ahead of now.
    let mut over = hourly(1);
    over.flags = TENANT_F_CAPPED | TENANT_F_OVER_SHARE;
    let ahead = sluice_tests::tenants::coarse_now_ns() + 10 * HOUR_NS;
    for vip_id in 0..3 {
        t.set_limits(vip_id, 1, over).unwrap();
        t.set_bucket(vip_id, 1, ahead).unwrap();
    }
    // The SYN's retransmission (its handshake pending), then the stream.
    for flags in [SYN, ACK, ACK | PSH, 0x01 | ACK] {
        assert_tcp_forwarded(&mut lab, &tcp_vip, TENANT1_V4, 47600, flags);
    }
    // A stream whose entry was lost opens no session: it is steered and pinned again.
    assert_tcp_forwarded(&mut lab, &tcp_vip, TENANT1_V4, 47602, ACK | PSH);
    for n in 1..4 {
        assert_steered(&mut lab, &udp_pkt(n), uwant, uh);
    }
    // A second-chance VIP keeps no entries: its SYN is refused, its mid-stream ACK is not.
    let (a, _) = lab.run(&on_wire(&tcp_packet_to(TENANT1_V6, VIP6, 47603, SYN)));
    assert_eq!(a, XDP_DROP);
    assert_tcp_forwarded(&mut lab, &sc_vip, TENANT1_V6, 47603, ACK);
    assert_tcp_forwarded(&mut lab, &sc_vip, TENANT1_V6, 47603, ACK | PSH);

    // New sessions are refused meanwhile: the limits are in force.
    let (a, out) = lab.run(&on_wire(&tcp_packet_to(TENANT1_V4, VIP4, 47604, SYN)));
    assert_eq!((a, out), (XDP_TX, rst_to(TENANT1_V4, 47604)));
    let new_udp = V4::new(TENANT1_V4, VIP4, PROTO_UDP).build(&udp(47605, 443, b"initial"));
    assert_eq!(lab.run(&on_wire(&new_udp)).0, XDP_DROP);
    assert_eq!(lab.stat(stat::SHED_TENANT_SESSIONS), 3);
    for vip_id in 0..3 {
        let s = t.stats(vip_id, 1).unwrap();
        assert_eq!(s.refused_sessions, 1, "VIP {vip_id}");
        assert_eq!(
            t.bucket(vip_id, 1).unwrap(),
            ahead,
            "VIP {vip_id}: no token moved"
        );
    }
    assert_eq!(
        (
            t.stats(0, 1).unwrap().admitted,
            t.stats(1, 1).unwrap().admitted
        ),
        (1, 1),
        "the admitted sessions, once each"
    );
}

#[test]
fn a_vip_without_the_tenants_flag_ignores_the_tenant_maps() {
    let mut lab = Lab::new();
    let vip = lab.vip(0, VIP4, 443, PROTO_TCP, VIP_F_SHED_RST, 0);
    lab.backends(&vip, &BACKENDS4);
    let mut t = tenant_maps(&mut lab);
    let mut over = hourly(1);
    over.flags = TENANT_F_CAPPED | TENANT_F_OVER_SHARE;
    t.set_limits(0, 1, over).unwrap();
    t.set_limits(0, 0, over).unwrap();
    let ahead = sluice_tests::tenants::coarse_now_ns() + 10 * HOUR_NS;
    t.set_bucket(0, 1, ahead).unwrap();
    for (n, client) in [TENANT1_V4, TENANT1_V4, CLIENT4].into_iter().enumerate() {
        assert_tcp_forwarded(&mut lab, &vip, client, 47700 + n as u16, SYN);
    }
    for tenant in [0, 1] {
        assert_eq!(t.stats(0, tenant).unwrap(), TenantStats::default());
    }
    assert_eq!(t.bucket(0, 1).unwrap(), ahead);
    let shed = [
        stat::SHED_TENANT_SESSIONS,
        stat::SHED_TENANT_SHARE,
        stat::SHED_TENANT_RATE,
        stat::SHED_RST_SENT,
        stat::DROP_SHED,
    ];
    assert!(shed.iter().all(|c| lab.stat(*c) == 0));
}

/// `admitted` counts sessions, not packets: a SYN's retransmission, the stream's later
/// packets and a UDP flow's later datagrams add nothing; each new session adds one.
#[test]
fn a_tenants_admitted_counter_counts_each_new_session_once() {
    let mut lab = Lab::new();
    let vip = lab.vip(0, VIP4, 443, PROTO_TCP, VIP_F_TENANTS, 0);
    lab.backends(&vip, &BACKENDS4);
    let uvip = lab.vip(1, VIP4, 443, PROTO_UDP, VIP_F_TENANTS, 0);
    lab.backends(&uvip, &[(21, "10.1.0.21", 1)]);
    let t = tenant_maps(&mut lab);
    for flags in [SYN, SYN, ACK, ACK | PSH] {
        assert_tcp_forwarded(&mut lab, &vip, TENANT1_V4, 47800, flags);
    }
    assert_eq!(t.stats(0, 1).unwrap().admitted, 1);
    assert_tcp_forwarded(&mut lab, &vip, TENANT1_V4, 47801, SYN);
    assert_eq!(t.stats(0, 1).unwrap().admitted, 2);
    for n in 0..3u8 {
        let d = V4::new(TENANT1_V4, VIP4, PROTO_UDP).build(&udp(47802, 443, &[n; 8]));
        assert_eq!(lab.run(&on_wire(&d)).0, XDP_TX);
    }
    assert_eq!(t.stats(1, 1).unwrap().admitted, 1);
    assert_eq!(t.stats(0, 1).unwrap().admitted, 2);
}

/// A client's FIN or RST marks its flow's entry closed (no longer its tenant's session), while
/// the flow's later packets, the FIN's own and the last ACK, still reach its backend; a SYN
/// that reopens the 5-tuple opens the entry again. The handshake bit is kept apart.
#[test]
fn a_clients_fin_or_rst_closes_its_entry_and_a_syn_reusing_the_5_tuple_opens_it() {
    let mut lab = Lab::new();
    let vip = lab.vip(0, VIP4, 443, PROTO_TCP, 0, 0);
    lab.backends(&vip, &BACKENDS4);
    let flags = |lab: &mut Lab, sport: u16| {
        let key = flow(CLIENT4, sport, VIP4, 443, PROTO_TCP);
        lab.dp.conn(&key).unwrap().unwrap().flags
    };
    for (sport, close) in [(48000, FIN | ACK), (48001, RST), (48002, RST | ACK)] {
        assert_tcp_forwarded(&mut lab, &vip, CLIENT4, sport, SYN);
        assert_eq!(flags(&mut lab, sport), CONN_F_HANDSHAKE);
        assert_tcp_forwarded(&mut lab, &vip, CLIENT4, sport, ACK | PSH);
        assert_eq!(flags(&mut lab, sport), 0, "an open, established flow");
        assert_tcp_forwarded(&mut lab, &vip, CLIENT4, sport, close);
        assert_eq!(
            flags(&mut lab, sport),
            CONN_F_CLOSED,
            "closed by {close:#x}"
        );
        assert_tcp_forwarded(&mut lab, &vip, CLIENT4, sport, ACK);
        assert_eq!(
            flags(&mut lab, sport),
            CONN_F_CLOSED,
            "a late ACK keeps it closed"
        );
        assert_tcp_forwarded(&mut lab, &vip, CLIENT4, sport, SYN);
        assert_eq!(
            flags(&mut lab, sport),
            CONN_F_HANDSHAKE,
            "the next session's SYN opens it, its handshake pending"
        );
    }
    // A FIN before the handshake completes closes the entry and leaves the handshake pending.
    assert_tcp_forwarded(&mut lab, &vip, CLIENT4, 48003, SYN);
    assert_tcp_forwarded(&mut lab, &vip, CLIENT4, 48003, FIN);
    assert_eq!(flags(&mut lab, 48003), CONN_F_HANDSHAKE | CONN_F_CLOSED);
    assert_eq!(lab.stat(stat::CONN_HIT), 13);
}

/// A SYN reusing the 5-tuple of a connection whose handshake completed is the client's next
/// session: on a VIP with tenants the finished connection's entry goes and the SYN is
/// steered as a miss, through its tenant's limits. Refused, nothing is pinned (a late packet
/// of the old connection is steered as a lost entry's is); admitted, it counts once, and its
/// retransmission is not checked again.
#[test]
fn a_syn_reusing_a_finished_connections_5_tuple_is_held_to_its_tenants_limits() {
    let mut lab = Lab::new();
    let vip = lab.vip(0, VIP4, 443, PROTO_TCP, VIP_F_TENANTS | VIP_F_SHED_RST, 0);
    lab.backends(&vip, &BACKENDS4);
    let mut t = tenant_maps(&mut lab);
    let key = flow(TENANT1_V4, 47900, VIP4, 443, PROTO_TCP);
    assert_tcp_forwarded(&mut lab, &vip, TENANT1_V4, 47900, SYN);
    assert_tcp_forwarded(&mut lab, &vip, TENANT1_V4, 47900, ACK);
    assert_eq!(
        lab.dp.conn(&key).unwrap().unwrap().flags & CONN_F_HANDSHAKE,
        0
    );
    t.set_limits(0, 1, flagged(TENANT_F_CAPPED)).unwrap();

    let (a, out) = lab.run(&on_wire(&tcp_packet_to(TENANT1_V4, VIP4, 47900, SYN)));
    assert_eq!((a, out), (XDP_TX, rst_to(TENANT1_V4, 47900)));
    assert_eq!(
        (
            lab.stat(stat::SHED_TENANT_SESSIONS),
            lab.stat(stat::SHED_RST_SENT)
        ),
        (1, 1)
    );
    assert_eq!(
        t.stats(0, 1).unwrap(),
        TenantStats {
            admitted: 1,
            refused_sessions: 1,
            ..Default::default()
        }
    );
    assert_eq!(
        lab.dp.conn(&key).unwrap(),
        None,
        "the finished connection's entry goes: the SYN was steered as a miss"
    );
    assert_tcp_forwarded(&mut lab, &vip, TENANT1_V4, 47900, ACK | PSH);

    t.set_limits(0, 1, TenantLimits::default()).unwrap();
    assert_tcp_forwarded(&mut lab, &vip, TENANT1_V4, 47900, SYN);
    t.set_limits(0, 1, flagged(TENANT_F_CAPPED)).unwrap();
    assert_tcp_forwarded(&mut lab, &vip, TENANT1_V4, 47900, SYN);
    assert_eq!(t.stats(0, 1).unwrap().admitted, 2);
    assert_eq!(lab.stat(stat::SHED_TENANT_SESSIONS), 1);
}

/// Class shedding holds a reused 5-tuple's SYN as tenant limits do: the finished
/// connection's entry does not carry the client's next session past a shedding VIP.
#[test]
fn a_syn_reusing_a_finished_connections_5_tuple_is_shed_by_its_vips_class() {
    let mut lab = Lab::new();
    let vip = lab.vip(0, VIP4, 443, PROTO_TCP, VIP_F_SHED_RST, 0);
    lab.backends(&vip, &BACKENDS4);
    let key = flow(TENANT1_V4, 47901, VIP4, 443, PROTO_TCP);
    assert_tcp_forwarded(&mut lab, &vip, TENANT1_V4, 47901, SYN);
    assert_tcp_forwarded(&mut lab, &vip, TENANT1_V4, 47901, ACK);
    lab.vip(0, VIP4, 443, PROTO_TCP, VIP_F_SHED | VIP_F_SHED_RST, 0);

    let (a, out) = lab.run(&on_wire(&tcp_packet_to(TENANT1_V4, VIP4, 47901, SYN)));
    assert_eq!((a, out), (XDP_TX, rst_to(TENANT1_V4, 47901)));
    assert_eq!(
        (
            lab.stat(stat::CONN_REOPEN_RESTEER),
            lab.stat(stat::SHED_PRIORITY),
            lab.stat(stat::SHED_RST_SENT)
        ),
        (1, 1, 1)
    );
    assert_eq!(lab.dp.conn(&key).unwrap(), None);
}
