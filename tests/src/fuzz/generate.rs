//! The fuzzed frames: well-formed packets of every kind the program meets, wrapped in VLAN
//! tags, then mutated.

use lb_common::{PROTO_ICMP, PROTO_ICMPV6, PROTO_TCP, PROTO_UDP};

use super::{Rng, Vip, CLIENT_MAC, JUMBO, LB_MAC};
use crate::frames::*;

pub(super) const CLIENTS4: [&str; 4] = ["192.0.2.10", "192.0.2.11", "198.51.100.7", "203.0.113.99"];
pub(super) const CLIENTS6: [&str; 4] = [
    "2001:db8:c::10",
    "2001:db8:c::11",
    "2001:db8:d::1",
    "2001:db8:e::2",
];
const OTHERS4: [&str; 3] = ["10.9.9.9", "10.200.0.4", "127.0.0.1"];
const OTHERS6: [&str; 3] = ["fd00:200::2", "ff02::1", "fe80::1"];

/// One fuzzed frame: a well-formed packet of some kind, wrapped in VLAN tags, then mutated.
pub(super) fn frame(rng: &mut Rng, vips: &[Vip]) -> Vec<u8> {
    let l3 = match rng.below(12) {
        0..=4 => to_vip(rng, vips),
        5 => icmp_error_packet(rng, vips),
        6 => fragment(rng, vips),
        7 => other_host(rng),
        8 => {
            // Bytes that claim to be IP.
            let n = rng.below(80) + 1;
            let mut b = rng.bytes(n);
            b[0] = (rng.pick(&[4u8, 6, 5, 0]) << 4) | (b[0] & 0x0f);
            b
        }
        _ => to_vip(rng, vips),
    };
    let ety = match l3[0] >> 4 {
        _ if rng.chance(2) => rng.pick(&[ETH_ARP, 0x88cc, ETH_IP, ETH_IPV6]),
        4 => ETH_IP,
        _ => ETH_IPV6,
    };
    let mut f = eth(LB_MAC, CLIENT_MAC, ety, &l3);
    let mut l3_off = 14;
    for _ in 0..rng.pick(&[0, 0, 0, 0, 0, 1, 1, 2, 2, 3]) {
        f = vlan_tag(
            &f,
            rng.pick(&[0x8100, 0x8100, 0x8100, 0x88a8, 0x88a8, 0x9100]),
            rng.below(4096) as u16,
        );
        l3_off += 4;
    }
    for _ in 0..rng.pick(&[0, 0, 1, 1, 2, 3]) {
        mutate(rng, &mut f, l3_off);
    }
    f
}

pub(super) fn mutate(rng: &mut Rng, f: &mut Vec<u8>, l3: usize) {
    match rng.below(7) {
        // Ethernet padding, or junk after the packet.
        0 | 1 => {
            let n = rng.pick(&[1, 2, 6, 18, 46, 64]);
            let pad = if rng.chance(50) {
                vec![0; n]
            } else {
                rng.bytes(n)
            };
            f.extend_from_slice(&pad);
        }
        // Cut, mostly near a header boundary.
        2 => {
            let at = if rng.chance(70) {
                let b = rng.pick(&[14, 18, 22, 26, 34, 38, 42, 54, 58, 62, 74, 82, 94, 102]);
                b + rng.below(9) - 4
            } else {
                14 + rng.below(f.len())
            };
            f.truncate(at.clamp(14, f.len()));
        }
        // A lying IP length field (IPv4 total length or IPv6 payload length).
        3 if f.len() >= l3 + 6 => {
            let v4 = f[l3] >> 4 == 4;
            let field = if v4 { l3 + 2 } else { l3 + 4 };
            let cur = u16::from_be_bytes([f[field], f[field + 1]]) as i64;
            let v = match rng.below(4) {
                0 => rng.below(65536) as i64,
                1 => cur + rng.below(41) as i64 - 20,
                2 => rng.pick(&[0, 8, 20, 28, 40, 48]),
                _ => (f.len() - l3) as i64 - if v4 { 0 } else { 40 },
            };
            f[field..field + 2].copy_from_slice(&(v.clamp(0, 65535) as u16).to_be_bytes());
        }
        // A lying IHL.
        4 if f.len() > l3 && f[l3] >> 4 == 4 => {
            f[l3] = 0x40 | rng.below(16) as u8;
        }
        // Any byte of the headers.
        _ => {
            let end = f.len().min(l3 + 100);
            if end > 12 {
                let i = 12 + rng.below(end - 12);
                f[i] = rng.next() as u8;
            }
        }
    }
}

fn payload(rng: &mut Rng) -> Vec<u8> {
    let n = match rng.below(100) {
        0 => JUMBO - rng.below(200) - 100,
        1..=3 => 1400 + rng.below(200),
        4..=20 => rng.below(600),
        _ => rng.below(24),
    };
    rng.bytes(n)
}

pub(super) fn l4(rng: &mut Rng, proto: u8, sport: u16, dport: u16) -> Vec<u8> {
    let data = payload(rng);
    if proto == PROTO_TCP {
        tcp(
            sport,
            dport,
            rng.pick(&[SYN, SYN, ACK, ACK | PSH, 0x11, 0x04, 0x12]),
            &data,
        )
    } else {
        udp(sport, dport, &data)
    }
}

/// TCP or UDP to a VIP address (usually its port and protocol), from a small pool of clients
/// so flows repeat (connection-table hits, re-steering past the down backend).
fn to_vip(rng: &mut Rng, vips: &[Vip]) -> Vec<u8> {
    let v = &vips[rng.below(vips.len())];
    let proto = if rng.chance(90) {
        v.proto
    } else {
        rng.pick(&[PROTO_TCP, PROTO_UDP])
    };
    let dport = if v.port != 0 && rng.chance(90) {
        v.port
    } else {
        rng.below(65536) as u16
    };
    let sport = 40000 + rng.below(64) as u16;
    let seg = match &v.quic {
        Some((rotation, sids)) if proto == PROTO_UDP && rng.chance(80) => {
            udp(sport, dport, &quic_payload(rng, *rotation, sids))
        }
        _ => l4(rng, proto, sport, dport),
    };
    let dst = v.addr.to_string();
    if v.addr.is_ipv4() {
        let mut h = V4::new(rng.pick(&CLIENTS4), &dst, proto);
        h.tos = rng.pick(&[0, 0x28, 0xb8, 0x03]);
        h.frag = rng.pick(&[0x4000, 0]);
        if rng.chance(20) {
            h.options = options(rng);
        }
        h.build(&seg)
    } else {
        let (next, body) = if rng.chance(30) {
            ext_chain(rng, proto, &seg)
        } else {
            (proto, seg)
        };
        ipv6(
            rng.pick(&CLIENTS6),
            &dst,
            next,
            rng.pick(&[0, 0x28, 0xb8]),
            rng.below(1 << 20) as u32,
            &body,
        )
    }
}

/// IPv4 options: NOPs, an end-of-list, a record-route-shaped option, random bytes.
pub(super) fn options(rng: &mut Rng) -> Vec<u8> {
    let words = rng.below(10) + 1;
    let mut o = match rng.below(3) {
        0 => vec![1; words * 4],
        1 => {
            let mut o = vec![7, (words * 4) as u8, 4];
            o.resize(words * 4, 0);
            o
        }
        _ => rng.bytes(words * 4),
    };
    o.truncate(40);
    o
}

/// An IPv6 extension-header chain ending in `proto`: long (past the program's limit),
/// repeating, with fragment headers, or with a header type the program does not walk.
fn ext_chain(rng: &mut Rng, proto: u8, seg: &[u8]) -> (u8, Vec<u8>) {
    let n = rng.below(7) + 1;
    let types: Vec<u8> = (0..n)
        .map(|_| rng.pick(&[0, 43, 60, 60, 44, 51, 59]))
        .collect();
    let mut body = vec![];
    for (i, _) in types.iter().enumerate() {
        let next = types.get(i + 1).copied().unwrap_or(proto);
        let len = rng.pick(&[0u8, 0, 1, 3]);
        let mut h = vec![next, len];
        h.extend(rng.bytes(6 + len as usize * 8));
        body.extend(h);
    }
    body.extend_from_slice(seg);
    (types[0], body)
}

/// An ICMP error towards a VIP address (or not), quoting a VIP flow's reply, part of one,
/// or garbage.
fn icmp_error_packet(rng: &mut Rng, vips: &[Vip]) -> Vec<u8> {
    let v = &vips[rng.below(vips.len())];
    let proto = if rng.chance(80) { v.proto } else { PROTO_ICMP };
    let port = if v.port == 0 { 443 } else { v.port };
    let sport = 40000 + rng.below(64) as u16;
    let to_vip = rng.chance(85);
    if v.addr.is_ipv4() {
        let client = rng.pick(&CLIENTS4);
        let mut quoted = V4::new(&v.addr.to_string(), client, proto);
        if rng.chance(20) {
            quoted.options = options(rng);
        }
        let mut q = quoted.build(&l4(rng, proto, port, sport));
        let keep = rng.pick(&[28, 28, 28 + quoted.options.len(), 20, 24, 64, q.len()]);
        q.truncate(keep.min(q.len()));
        if rng.chance(15) {
            q = rng.bytes(q.len());
        }
        if rng.chance(10) {
            q[0] = 0x40 | rng.below(16) as u8;
        }
        let (ty, code) = if rng.chance(85) {
            (3, 4)
        } else {
            (rng.pick(&[3, 11, 5, 0]), rng.below(16) as u8)
        };
        let dst = if to_vip {
            v.addr.to_string()
        } else {
            rng.pick(&OTHERS4).to_string()
        };
        V4::new("198.51.100.1", &dst, PROTO_ICMP).build(&icmp_error(ty, code, 1400, &q))
    } else {
        let client = rng.pick(&CLIENTS6);
        let mut q = ipv6(
            &v.addr.to_string(),
            client,
            proto,
            0,
            0,
            &l4(rng, proto, port, sport),
        );
        let keep = rng.pick(&[48, 48, 40, 44, 100, q.len()]);
        q.truncate(keep.min(q.len()));
        if rng.chance(15) {
            q = rng.bytes(q.len());
        }
        let ty = if rng.chance(85) {
            2
        } else {
            rng.pick(&[1, 3, 4, 128, 135])
        };
        let dst = if to_vip {
            v.addr.to_string()
        } else {
            rng.pick(&OTHERS6).to_string()
        };
        ipv6(
            "2001:db8:ff::1",
            &dst,
            PROTO_ICMPV6,
            0,
            0,
            &icmp_error(ty, 0, 1400, &q),
        )
    }
}

/// A fragment of a VIP flow: IPv4 first or later fragments, IPv6 with a fragment header.
fn fragment(rng: &mut Rng, vips: &[Vip]) -> Vec<u8> {
    let v = &vips[rng.below(vips.len())];
    let sport = 40000 + rng.below(64) as u16;
    let seg = l4(rng, v.proto, sport, v.port.max(1));
    if v.addr.is_ipv4() {
        let mut h = V4::new(rng.pick(&CLIENTS4), &v.addr.to_string(), v.proto);
        h.frag = rng.pick(&[0x2000, 0x2010, 0x0010, 0x1fff, 0x6000]);
        h.build(&seg)
    } else {
        let mut body = vec![v.proto, 0];
        body.extend_from_slice(&rng.pick(&[[0u8, 1], [0, 0], [1, 0]]));
        body.extend(rng.bytes(4));
        body.extend_from_slice(&seg);
        ipv6(rng.pick(&CLIENTS6), &v.addr.to_string(), 44, 0, 0, &body)
    }
}

/// Traffic for other hosts, which must pass untouched.
fn other_host(rng: &mut Rng) -> Vec<u8> {
    let proto = rng.pick(&[PROTO_TCP, PROTO_UDP]);
    let sport = 1000 + rng.below(100) as u16;
    let dport = rng.pick(&[443, 80, 4433]);
    let seg = l4(rng, proto, sport, dport);
    if rng.chance(50) {
        V4::new(rng.pick(&CLIENTS4), rng.pick(&OTHERS4), proto).build(&seg)
    } else {
        ipv6(rng.pick(&CLIENTS6), rng.pick(&OTHERS6), proto, 0, 0, &seg)
    }
}

/// A QUIC packet, or something near one: a short or long header (versions 1, 2, 0 and
/// another; every long-header type), a connection ID naming one of `sids` or another server,
/// of this rotation or another, of any length up to a lying one, cut anywhere.
fn quic_payload(rng: &mut Rng, rotation: u8, sids: &[[u8; 2]]) -> Vec<u8> {
    let other = rng.below(8) as u8;
    let low = rng.below(32) as u8;
    let mut dcid = vec![rng.pick(&[rotation, rotation, rotation, 7, other]) << 5 | low];
    let sid = if rng.chance(80) {
        sids[rng.below(sids.len())]
    } else {
        [rng.next() as u8, rng.next() as u8]
    };
    dcid.extend_from_slice(&sid);
    let nonce = rng.pick(&[4, 5, 8, 15]);
    dcid.extend(rng.bytes(nonce));
    dcid.truncate(rng.pick(&[20, 20, 20, 2, 3, 1, 0]));
    let mut p = if rng.chance(50) {
        let mut p = vec![0x40 | rng.below(64) as u8];
        p.extend_from_slice(&dcid);
        p
    } else {
        let mut p = vec![0x80 | rng.below(128) as u8];
        p.extend_from_slice(
            &rng.pick(&[1u32, 1, 0x6b33_43cf, 0, 0xff00_001d])
                .to_be_bytes(),
        );
        let len = if rng.chance(90) {
            dcid.len()
        } else {
            rng.below(256)
        };
        p.push(len as u8);
        p.extend_from_slice(&dcid);
        p
    };
    let tail = rng.pick(&[0, 1, 8, 20, 40, 1200]);
    p.extend(rng.bytes(tail));
    if rng.chance(10) {
        p.truncate(rng.below(p.len() + 1));
    }
    p
}
