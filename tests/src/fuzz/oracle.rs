//! The oracle: what `sluice_xdp` may do with a frame, read from the frame apart from the
//! program.

use std::net::IpAddr;

use anyhow::{bail, ensure, Context, Result};
use lb_common::{
    stat::{self, Kind},
    PROTO_ICMP, PROTO_ICMPV6, PROTO_IPIP, PROTO_IPV6, PROTO_TCP, PROTO_UDP,
};

use super::{hex, Vip, QUIC_SID_LEN, XDP_DROP, XDP_PASS, XDP_REDIRECT, XDP_TX};
use crate::{fib_neighbour_mac, frames::*, Lab, FALLBACK_MAC, FIB_LOCAL_MAC};

/// The oracle for one frame.
pub(super) fn check(
    lab: &Lab,
    vips: &[Vip],
    frame: &[u8],
    action: u32,
    out: &[u8],
    before: &[u64],
    after: &[u64],
) -> Result<()> {
    let delta: Vec<u64> = after.iter().zip(before).map(|(a, b)| a - b).collect();
    ensure!(
        delta[stat::RX.index()] == 1,
        "rx moved by {}",
        delta[stat::RX.index()]
    );
    let moved: Vec<(usize, u64)> = delta
        .iter()
        .enumerate()
        .filter(|(i, d)| {
            **d != 0 && matches!(stat::KINDS[*i], Kind::Pass | Kind::Drop | Kind::Sent)
        })
        .map(|(i, d)| (i, *d))
        .collect();
    let names: Vec<&str> = moved.iter().map(|(i, _)| stat::NAMES[*i]).collect();
    ensure!(
        moved.len() == 1 && moved[0].1 == 1,
        "exactly one outcome counter must move by one, moved: {names:?}"
    );
    let (counter, _) = moved[0];
    let kind = stat::KINDS[counter];
    let ip = ip_packet(frame);
    let quic = quic_expectation(vips, frame, ip.as_ref());
    let quic_moved: Vec<&str> = QUIC_COUNTERS
        .iter()
        .filter(|c| delta[c.index()] != 0)
        .map(|c| c.name())
        .collect();
    if quic.is_none() {
        ensure!(
            quic_moved.is_empty(),
            "QUIC counters moved for a packet that is no UDP to the QUIC VIP: {quic_moved:?}"
        );
    }
    // What the QUIC VIP's packet was routed by, once the program was seen to steer it: for
    // a frame it passed or dropped, the oracle cannot tell whether it got that far.
    let steered = |backend: Option<IpAddr>| -> Result<()> {
        let Some((expect, vip)) = &quic else {
            return Ok(());
        };
        let want = match expect {
            Quic::Routed(_) => stat::QUIC_CID_ROUTED,
            Quic::FiveTuple(c) => *c,
        };
        ensure!(
            quic_moved == [want.name()],
            "QUIC counters moved: {quic_moved:?}, expected [{}]",
            want.name()
        );
        if let (Quic::Routed(i), Some(b)) = (expect, backend) {
            ensure!(
                b == vip.backends[*i].0,
                "routed by its connection ID to {b}, which names {}",
                vip.backends[*i].0
            );
        }
        Ok(())
    };
    let to_vip_addr = ip
        .as_ref()
        .is_some_and(|p| vips.iter().any(|v| v.addr == p.dst));
    match action {
        XDP_PASS => {
            ensure!(kind == Kind::Pass, "XDP_PASS counted as {names:?}");
            ensure!(out == frame, "a passed frame must be byte-identical");
        }
        XDP_DROP => {
            ensure!(kind == Kind::Drop, "XDP_DROP counted as {names:?}");
            ensure!(to_vip_addr, "a frame not addressed to a VIP was dropped");
        }
        XDP_TX | XDP_REDIRECT => {
            let Some(ip) = ip else {
                bail!("a frame without an IP packet was sent")
            };
            ensure!(to_vip_addr, "a frame not addressed to a VIP was sent");
            if counter == stat::REDIRECT.index() {
                ensure!(
                    action == XDP_REDIRECT,
                    "redirect counted for action {action}"
                );
                let backend = encapsulation(lab, vips, frame, &ip, out, true)?;
                steered(Some(backend))?;
                return Ok(());
            }
            ensure!(action == XDP_TX, "action {action} counted as {names:?}");
            if counter == stat::ICMP_TOO_BIG_SENT.index() {
                too_big_reply(vips, frame, &ip, out)?;
                steered(None)?;
            } else if counter == stat::SHED_RST_SENT.index() {
                ensure!(
                    vips.iter().any(|v| v.addr == ip.dst && v.shed_rst),
                    "a RST from {}, which sheds nothing",
                    ip.dst
                );
                rst_reply(frame, &ip, out)?;
            } else {
                ensure!(counter == stat::TX.index(), "XDP_TX counted as {names:?}");
                let backend = encapsulation(lab, vips, frame, &ip, out, false)?;
                steered(Some(backend))?;
            }
        }
        a => bail!("unexpected XDP action {a}"),
    }
    Ok(())
}

/// The IP packet of a frame as the oracle reads it: after up to two VLAN tags, an IPv4 or
/// IPv6 header whose version matches the ethertype and whose length fits the frame.
struct IpPacket {
    /// Offset of the IP header in the frame.
    off: usize,
    /// Length from the header's own length field.
    len: usize,
    v4: bool,
    dst: IpAddr,
    tos: u8,
}

/// Where the L3 header starts and its EtherType, past up to two VLAN tags (as the data
/// plane reads them).
pub(super) fn l3_start(frame: &[u8]) -> Option<(usize, u16)> {
    let mut off = 12;
    let mut ty = u16::from_be_bytes([frame[12], frame[13]]);
    for _ in 0..2 {
        if ty != 0x8100 && ty != 0x88a8 {
            break;
        }
        ty = u16::from_be_bytes(frame.get(off + 4..off + 6)?.try_into().ok()?);
        off += 4;
    }
    let l3 = off + 2;
    Some((l3, ty))
}

fn ip_packet(frame: &[u8]) -> Option<IpPacket> {
    let (l3, ty) = l3_start(frame)?;
    let h = frame.get(l3..)?;
    let (len, v4, dst, tos) = match ty {
        ETH_IP if h.len() >= 20 && h[0] >> 4 == 4 => {
            let dst: [u8; 4] = h[16..20].try_into().unwrap();
            (
                u16::from_be_bytes([h[2], h[3]]) as usize,
                true,
                IpAddr::from(dst),
                h[1],
            )
        }
        ETH_IPV6 if h.len() >= 40 && h[0] >> 4 == 6 => {
            let dst: [u8; 16] = h[24..40].try_into().unwrap();
            (
                u16::from_be_bytes([h[4], h[5]]) as usize + 40,
                false,
                IpAddr::from(dst),
                (u16::from_be_bytes([h[0], h[1]]) >> 4) as u8,
            )
        }
        _ => return None,
    };
    (len <= h.len()).then_some(IpPacket {
        off: l3,
        len,
        v4,
        dst,
        tos,
    })
}

/// `out` must be `ip`, byte-identical and alone, in an exact outer header to an active
/// backend of a VIP at the packet's destination; through the FIB's next hop when `fib`, else
/// through the fallback MAC.
fn encapsulation(
    lab: &Lab,
    vips: &[Vip],
    frame: &[u8],
    ip: &IpPacket,
    out: &[u8],
    fib: bool,
) -> Result<IpAddr> {
    ensure!(out.len() >= 14, "output shorter than Ethernet");
    let inner_proto = if ip.v4 { PROTO_IPIP } else { PROTO_IPV6 };
    let ety = u16::from_be_bytes([out[12], out[13]]);
    let (hlen, backend) = match ety {
        ETH_IP => {
            ensure!(out.len() >= 34, "outer IPv4 header cut");
            let h = &out[14..34];
            ensure!(h[0] == 0x45, "outer version/IHL {:#x}", h[0]);
            ensure!(h[1] == ip.tos, "outer TOS {:#x}, inner {:#x}", h[1], ip.tos);
            let tot = u16::from_be_bytes([h[2], h[3]]) as usize;
            ensure!(
                tot == out.len() - 14,
                "outer total length {tot}, frame carries {}",
                out.len() - 14
            );
            ensure!(h[4..8] == [0, 0, 0, 0], "outer id/fragment fields not zero");
            ensure!(
                h[8] == 64 && h[9] == inner_proto,
                "outer TTL {} protocol {}",
                h[8],
                h[9]
            );
            ensure!(csum(h) == 0, "outer header checksum is wrong");
            let src = u32::from_be_bytes(h[12..16].try_into().unwrap());
            let want = u32::from_be_bytes(lab.cfg.encap_src_v4.to_ne_bytes());
            let mask = u32::from_be_bytes(lab.cfg.encap_src_v4_hostmask.to_ne_bytes());
            ensure!(
                src & !mask == want & !mask,
                "outer source outside the encap prefix"
            );
            let dst: [u8; 4] = h[16..20].try_into().unwrap();
            (20, IpAddr::from(dst))
        }
        ETH_IPV6 => {
            ensure!(out.len() >= 54, "outer IPv6 header cut");
            let h = &out[14..54];
            let w = u32::from_be_bytes(h[0..4].try_into().unwrap());
            ensure!(w >> 28 == 6, "outer version");
            ensure!((w >> 20) as u8 == ip.tos, "outer traffic class");
            let plen = u16::from_be_bytes([h[4], h[5]]) as usize;
            ensure!(
                plen == out.len() - 54,
                "outer payload length {plen}, frame carries {}",
                out.len() - 54
            );
            ensure!(
                h[6] == inner_proto && h[7] == 64,
                "outer next header {} hop limit {}",
                h[6],
                h[7]
            );
            let prefix: Vec<u8> = lab.cfg.encap_src_v6[..3]
                .iter()
                .flat_map(|w| w.to_ne_bytes())
                .collect();
            ensure!(
                h[8..20] == prefix[..],
                "outer source outside the encap prefix"
            );
            let dst: [u8; 16] = h[24..40].try_into().unwrap();
            (40, IpAddr::from(dst))
        }
        t => bail!("outer ethertype {t:#x}"),
    };
    ensure!(
        out[14 + hlen..] == frame[ip.off..ip.off + ip.len],
        "the inner packet differs from the client's IP packet ({} bytes carried, {} expected)",
        out.len() - 14 - hlen,
        ip.len
    );
    ensure!(
        vips.iter()
            .filter(|v| v.addr == ip.dst)
            .any(|v| v.backends.contains(&(backend, true))),
        "{backend} is not an active backend of a VIP at {}",
        ip.dst
    );
    let (dmac, smac) = if fib {
        (fib_neighbour_mac(backend), FIB_LOCAL_MAC)
    } else {
        (FALLBACK_MAC, frame[0..6].try_into().unwrap())
    };
    ensure!(
        out[0..6] == dmac && out[6..12] == smac,
        "outer MACs {:02x?} -> {:02x?}, expected {smac:02x?} -> {dmac:02x?} (fib {fib})",
        &out[6..12],
        &out[0..6]
    );
    Ok(backend)
}

/// `out` must be the exact ICMP "fragmentation needed" / ICMPv6 "packet too big" from the VIP
/// to the client for `ip`, announcing what fits the 1500-byte backend segment once
/// encapsulated for the VIP's backends.
fn too_big_reply(vips: &[Vip], frame: &[u8], ip: &IpPacket, out: &[u8]) -> Result<()> {
    ensure!(ip.off == 14, "a tagged frame was answered");
    let p = &frame[ip.off..ip.off + ip.len];
    let proto = if ip.v4 { p[9] } else { p[6] };
    let vip = vips
        .iter()
        .find(|v| v.addr == ip.dst && v.proto == proto)
        .context("no VIP for the answered packet")?;
    let outer = if vip.backends[0].0.is_ipv4() { 20 } else { 40 };
    let mtu = 1500 - outer;
    let (client, macs) = (
        frame[6..12].try_into().unwrap(),
        frame[0..6].try_into().unwrap(),
    );
    let want = if ip.v4 {
        ensure!(p[6] & 0x40 != 0, "answered a packet without DF");
        let h = V4 {
            src: <[u8; 4]>::try_from(&p[16..20]).unwrap().into(),
            dst: <[u8; 4]>::try_from(&p[12..16]).unwrap().into(),
            proto: PROTO_ICMP,
            tos: 0,
            ttl: 64,
            frag: 0,
            options: vec![],
        };
        let msg = icmp_checksummed(icmp_error(3, 4, mtu, &p[..28]), None);
        eth(client, macs, ETH_IP, &h.build(&msg))
    } else {
        let src = IpAddr::from(<[u8; 16]>::try_from(&p[24..40]).unwrap()).to_string();
        let dst = IpAddr::from(<[u8; 16]>::try_from(&p[8..24]).unwrap()).to_string();
        let msg = icmp_checksummed(
            icmp_error(2, 0, mtu.max(1280), &p[..48]),
            Some((&src, &dst)),
        );
        eth(
            client,
            macs,
            ETH_IPV6,
            &ipv6(&src, &dst, PROTO_ICMPV6, 0, 0, &msg),
        )
    };
    ensure!(
        out == want,
        "the too-big reply differs from\n  want: {}",
        hex(&want)
    );
    Ok(())
}

/// `out` must be the exact RST|ACK answering the TCP segment in `ip`: same L2 header with the
/// MACs swapped, addresses and ports swapped, acknowledging the segment, checksums valid.
fn rst_reply(frame: &[u8], ip: &IpPacket, out: &[u8]) -> Result<()> {
    let hlen = if ip.v4 { 20 } else { 40 };
    let (l3, t) = (ip.off, ip.off + hlen);
    ensure!(
        out.len() == t + 20,
        "RST frame of {} bytes, expected {}",
        out.len(),
        t + 20
    );
    ensure!(
        out[0..6] == frame[6..12] && out[6..12] == frame[0..6] && out[12..l3] == frame[12..l3],
        "RST L2 header: MACs not swapped or tags changed"
    );
    let (o, i) = (&out[l3..], &frame[l3..]);
    let mut pseudo = vec![];
    if ip.v4 {
        ensure!(o[0] == 0x45 && o[1] == i[1], "RST version/IHL/TOS");
        ensure!(
            o[2..10] == [0, 40, 0, 0, 0x40, 0, 64, PROTO_TCP],
            "RST IPv4 fields"
        );
        ensure!(
            o[12..16] == i[16..20] && o[16..20] == i[12..16],
            "RST addresses not swapped"
        );
        ensure!(csum(&o[..20]) == 0, "RST IPv4 header checksum");
        pseudo.extend_from_slice(&o[12..20]);
        pseudo.extend_from_slice(&[0, PROTO_TCP, 0, 20]);
    } else {
        ensure!(o[0..4] == i[0..4], "RST version/class/flow label");
        ensure!(o[4..8] == [0, 20, PROTO_TCP, 64], "RST IPv6 fields");
        ensure!(
            o[8..24] == i[24..40] && o[24..40] == i[8..24],
            "RST addresses not swapped"
        );
        pseudo.extend_from_slice(&o[8..40]);
        pseudo.extend_from_slice(&[0, 0, 0, 20, 0, 0, 0, PROTO_TCP]);
    }
    let (ot, it) = (&out[t..], &frame[t..]);
    ensure!(
        ot[0..2] == it[2..4] && ot[2..4] == it[0..2],
        "RST ports not swapped"
    );
    let seq = u32::from_be_bytes(it[4..8].try_into().unwrap());
    let doff = (it[12] >> 4) as usize * 4;
    let data = (ip.len - hlen).saturating_sub(doff) as u32;
    let ack = seq.wrapping_add(data).wrapping_add(1);
    ensure!(ot[4..8] == [0; 4], "RST sequence number");
    ensure!(
        ot[8..12] == ack.to_be_bytes(),
        "RST acknowledges {:?}, not {ack}",
        &ot[8..12]
    );
    ensure!(
        ot[12..14] == [0x50, 0x14] && ot[14..16] == [0, 0] && ot[18..20] == [0, 0],
        "RST flags, window, urgent"
    );
    pseudo.extend_from_slice(ot);
    ensure!(csum(&pseudo) == 0, "RST TCP checksum");
    Ok(())
}

const QUIC_COUNTERS: [stat::Counter; 6] = [
    stat::QUIC_CID_ROUTED,
    stat::QUIC_CLIENT_CID,
    stat::QUIC_UNKNOWN_ROTATION,
    stat::QUIC_UNKNOWN_SERVER,
    stat::QUIC_SERVER_DOWN,
    stat::QUIC_MALFORMED,
];

/// How a packet to the QUIC VIP must be steered.
enum Quic {
    /// By its connection ID, to the backend of this index.
    Routed(usize),
    /// By its 5-tuple, for the reason this counter names.
    FiveTuple(stat::Counter),
}

/// For a UDP packet (not an ICMP error) to the QUIC VIP's address and port: how it must be
/// steered, read from its bytes by RFC 8999's invariants, RFC 9000's and RFC 9369's
/// long-header types and the QUIC-LB layout. `None` for every other frame.
fn quic_expectation<'a>(
    vips: &'a [Vip],
    frame: &[u8],
    ip: Option<&IpPacket>,
) -> Option<(Quic, &'a Vip)> {
    let ip = ip?;
    let vip = vips.iter().find(|v| v.quic.is_some() && v.addr == ip.dst)?;
    let (rotation, sids) = vip.quic.as_ref()?;
    let h = &frame[ip.off..];
    // Not a fragment: no more-fragments bit, offset 0.
    if !ip.v4 || h[9] != PROTO_UDP || u16::from_be_bytes([h[6], h[7]]) & 0x3fff != 0 {
        return None;
    }
    let l4 = ip.off + 4 * (h[0] & 0x0f) as usize;
    let end = ip.off + ip.len;
    if l4 + 8 > end || u16::from_be_bytes([frame[l4 + 2], frame[l4 + 3]]) != vip.port {
        return None;
    }
    let payload = &frame[l4 + 8..end];
    let sid_len = QUIC_SID_LEN as usize;
    let malformed = Quic::FiveTuple(stat::QUIC_MALFORMED);
    let Some(&first) = payload.first() else {
        return Some((malformed, vip));
    };
    let cid = if first & 0x80 == 0 {
        1
    } else {
        if payload.len() < 6 {
            return Some((malformed, vip));
        }
        let version = u32::from_be_bytes(payload[1..5].try_into().unwrap());
        let kind = (first >> 4) & 3;
        if !matches!((version, kind), (1, 2) | (0x6b33_43cf, 3)) {
            return Some((Quic::FiveTuple(stat::QUIC_CLIENT_CID), vip));
        }
        let len = payload[5] as usize;
        if len > 20 || len < 1 + sid_len || 6 + len > payload.len() {
            return Some((malformed, vip));
        }
        6
    };
    // The program reads nine octets from the ID on, inside the frame.
    if cid + 1 + sid_len > payload.len() || l4 + 8 + cid + 9 > frame.len() {
        return Some((malformed, vip));
    }
    if payload[cid] >> 5 != *rotation {
        return Some((Quic::FiveTuple(stat::QUIC_UNKNOWN_ROTATION), vip));
    }
    let sid = &payload[cid + 1..cid + 1 + sid_len];
    let Some(i) = sids.iter().position(|s| s[..] == *sid) else {
        return Some((Quic::FiveTuple(stat::QUIC_UNKNOWN_SERVER), vip));
    };
    if !vip.backends[i].1 {
        return Some((Quic::FiveTuple(stat::QUIC_SERVER_DOWN), vip));
    }
    Some((Quic::Routed(i), vip))
}
