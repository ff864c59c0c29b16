//! Tells a client that its packet, once encapsulated, no longer fits the path to the backend:
//! ICMP "fragmentation needed" (IPv4, DF set) or ICMPv6 "packet too big", from the VIP, so
//! path-MTU discovery shrinks the client's packets instead of them vanishing. Built in place
//! from the packet itself; only untagged frames with plain headers are answered.

use aya_ebpf::{
    bindings::xdp_action,
    helpers::{bpf_xdp_adjust_head, bpf_xdp_adjust_tail, bpf_xdp_get_buff_len},
    programs::XdpContext,
    EbpfContext,
};
use lb_common::{FAMILY_V4, PROTO_ICMP, PROTO_ICMPV6};

use crate::{
    csum::{add32, add_all, fold},
    hdr::{ETH_HLEN, ETH_P_IP, ETH_P_IPV6, ICMP_HLEN, IPV4_HLEN, IPV6_HLEN, TTL},
    parse::{at, be16_at, raw32_at, Parsed},
};

/// The quoted part of the offending packet: its IP header and 8 bytes of L4.
const QUOTE_V4: usize = IPV4_HLEN + 8;
const QUOTE_V6: usize = IPV6_HLEN + 8;
const IPV6_MIN_MTU: u32 = 1280;

/// Rewrites the packet in `p` into the ICMP error announcing `mtu` (the largest inner packet
/// that fits) back to its sender; `None` when it cannot or must not be answered.
#[inline(always)]
pub fn too_big(ctx: &XdpContext, p: &Parsed, mtu: u32) -> Option<u32> {
    // Never answer an ICMP error with one (RFC 1122 3.2.2), nor guess at VLAN tags.
    if p.icmp_error || p.l3_off != ETH_HLEN {
        return None;
    }
    if p.key.family == FAMILY_V4 {
        v4(ctx, p, mtu)
    } else {
        v6(ctx, p, mtu.max(IPV6_MIN_MTU))
    }
}

/// Grows the head by `grow` bytes and cuts the tail so the frame is `keep` bytes; the old
/// frame's MACs are swapped into the new Ethernet header with `ethertype`.
#[inline(always)]
fn reshape(ctx: &XdpContext, grow: usize, keep: usize, ethertype: u16) -> Option<()> {
    if unsafe { bpf_xdp_adjust_head(ctx.as_ptr() as *mut _, -(grow as i32)) } != 0 {
        return None;
    }
    let len = unsafe { bpf_xdp_get_buff_len(ctx.as_ptr() as *mut _) } as usize;
    if unsafe { bpf_xdp_adjust_tail(ctx.as_ptr() as *mut _, keep as i32 - len as i32) } != 0 {
        return None;
    }
    let old = at(ctx, grow, 12)?;
    let macs = unsafe { core::ptr::read_unaligned(old as *const [[u8; 6]; 2]) };
    let e = at(ctx, 0, ETH_HLEN)?;
    unsafe {
        core::ptr::write_unaligned(e as *mut [[u8; 6]; 2], [macs[1], macs[0]]);
        core::ptr::write_unaligned((e + 12) as *mut u16, ethertype.to_be());
    }
    Some(())
}

#[inline(always)]
fn v4(ctx: &XdpContext, p: &Parsed, mtu: u32) -> Option<u32> {
    if p.l4_off != p.l3_off + IPV4_HLEN {
        return None;
    }
    // Without DF the client expects routers to fragment, and cannot act on the error.
    let ip = at(ctx, p.l3_off, IPV4_HLEN)?;
    if unsafe { be16_at(ip + 6) } & 0x4000 == 0 {
        return None;
    }
    let grow = IPV4_HLEN + ICMP_HLEN;
    let quote = ETH_HLEN + grow;
    reshape(ctx, grow, quote + QUOTE_V4, ETH_P_IP)?;
    let q = at(ctx, quote, QUOTE_V4)?;
    let (client, vip) = unsafe { (raw32_at(q + 12), raw32_at(q + 16)) };
    let h = at(ctx, ETH_HLEN, IPV4_HLEN + ICMP_HLEN)?;
    // Words are built as host values and stored big-endian; a checksum (a memory-order
    // value) goes into its host-value slot byte-swapped.
    let ttl_proto = (TTL as u32) << 24 | (PROTO_ICMP as u32) << 16;
    let mut ip: [u32; 5] = [
        (0x4500_0000u32 | (IPV4_HLEN + ICMP_HLEN + QUOTE_V4) as u32).to_be(),
        0,
        ttl_proto.to_be(),
        vip,
        client,
    ];
    let c = fold(add_all(0, &ip));
    ip[2] = (ttl_proto | c.swap_bytes() as u32).to_be();
    let mut icmp: [u32; 2] = [(3u32 << 24 | 4 << 16).to_be(), (mtu & 0xffff).to_be()];
    let quoted = unsafe { core::ptr::read_unaligned(q as *const [u32; 7]) };
    let c = fold(add_all(add_all(0, &icmp), &quoted));
    icmp[0] = (3u32 << 24 | 4 << 16 | c.swap_bytes() as u32).to_be();
    unsafe {
        core::ptr::write_unaligned(h as *mut [u32; 5], ip);
        core::ptr::write_unaligned((h + IPV4_HLEN) as *mut [u32; 2], icmp);
    }
    Some(xdp_action::XDP_TX)
}

#[inline(always)]
fn v6(ctx: &XdpContext, p: &Parsed, mtu: u32) -> Option<u32> {
    if p.l4_off != p.l3_off + IPV6_HLEN {
        return None;
    }
    let grow = IPV6_HLEN + ICMP_HLEN;
    let quote = ETH_HLEN + grow;
    reshape(ctx, grow, quote + QUOTE_V6, ETH_P_IPV6)?;
    let q = at(ctx, quote, QUOTE_V6)?;
    let (client, vip) = unsafe {
        (
            core::ptr::read_unaligned((q + 8) as *const [u32; 4]),
            core::ptr::read_unaligned((q + 24) as *const [u32; 4]),
        )
    };
    let len = (ICMP_HLEN + QUOTE_V6) as u32;
    let h = at(ctx, ETH_HLEN, IPV6_HLEN + ICMP_HLEN)?;
    let head: [u32; 2] = [
        0x6000_0000u32.to_be(),
        (len << 16 | (PROTO_ICMPV6 as u32) << 8 | TTL as u32).to_be(),
    ];
    // Pseudo-header: addresses, upper-layer length, next header.
    let mut sum = add_all(add_all(0, &vip), &client);
    sum = add32(add32(sum, len.to_be()), (PROTO_ICMPV6 as u32).to_be());
    let mut icmp: [u32; 2] = [(2u32 << 24).to_be(), mtu.to_be()];
    let quoted = unsafe { core::ptr::read_unaligned(q as *const [u32; 12]) };
    let c = fold(add_all(add_all(sum, &icmp), &quoted));
    icmp[0] = (2u32 << 24 | c.swap_bytes() as u32).to_be();
    unsafe {
        core::ptr::write_unaligned(h as *mut [u32; 2], head);
        core::ptr::write_unaligned((h + 8) as *mut [u32; 4], vip);
        core::ptr::write_unaligned((h + 24) as *mut [u32; 4], client);
        core::ptr::write_unaligned((h + IPV6_HLEN) as *mut [u32; 2], icmp);
    }
    Some(xdp_action::XDP_TX)
}
