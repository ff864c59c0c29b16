//! Header parsing, bounds-checked at every step and separate from the steering decision.
//!
//! The result is either the flow key to steer (plus where the L3 packet sits) or the
//! counter that explains why the frame passes untouched: Sluice only acts on what it fully
//! understands and leaves everything else to the kernel.

use aya_ebpf::{
    helpers::{bpf_xdp_adjust_tail, bpf_xdp_get_buff_len},
    programs::XdpContext,
    EbpfContext,
};
use lb_common::{
    stat::{self, Counter},
    FlowKey, FAMILY_V4, FAMILY_V6, PROTO_ICMP, PROTO_ICMPV6, PROTO_TCP, PROTO_UDP,
};

use core::mem::offset_of;

use crate::hdr::{
    Ipv4Hdr, Ipv6Hdr, ETH_HLEN, ETH_P_8021AD, ETH_P_8021Q, ETH_P_IP, ETH_P_IPV6, IPV4_HLEN,
    IPV6_HLEN, TCP_ACK, TCP_SYN,
};

/// IPv6 extension headers walked before giving up (hop-by-hop, routing, destination options).
const MAX_EXT_HDRS: usize = 4;

pub struct Parsed {
    /// The flow as a client sends it (for an ICMP error, the flow the error quotes, reversed).
    pub key: FlowKey,
    /// Offset of the L3 header (the L2 header's length, VLAN tags included).
    pub l3_off: usize,
    /// Length of the L3 packet to carry (from its own length field, so Ethernet padding is
    /// not encapsulated). The frame, fragments included, holds at least this much after
    /// `l3_off`; every header above was read within it.
    pub l3_len: usize,
    /// Traffic class copied to the outer header so DSCP and ECN survive encapsulation.
    pub tos: u8,
    pub icmp_error: bool,
    /// Offset of the L4 header (for a shed SYN's RST reply).
    pub l4_off: usize,
    /// TCP flags (0 for other protocols).
    pub tcp_flags: u8,
}

impl Parsed {
    /// A packet that opens a session: a TCP SYN without ACK, or any UDP packet (QUIC has no
    /// handshake visible at L4).
    #[inline(always)]
    pub fn opens(&self) -> bool {
        self.key.proto != PROTO_TCP || self.tcp_flags & (TCP_SYN | TCP_ACK) == TCP_SYN
    }
}

/// A frame that passes untouched, with the counter that says why.
pub type Pass = Counter;

/// Pointer to `len` bytes at `off`, or `None` when the frame is shorter.
#[inline(always)]
pub fn at(ctx: &XdpContext, off: usize, len: usize) -> Option<usize> {
    let p = ctx.data() + off;
    if p + len > ctx.data_end() {
        return None;
    }
    Some(p)
}

/// Pointer to `len` bytes at `off` inside the IP packet that ends at `ip_end`: `truncated`
/// when the frame (its linear part) ends first, `PASS_SHORT_IP_LEN` when the frame holds the
/// bytes but the packet's own length says they are not part of it (Ethernet padding, or a
/// lying length).
#[inline(always)]
fn in_packet(
    ctx: &XdpContext,
    off: usize,
    len: usize,
    ip_end: usize,
    truncated: Pass,
) -> Result<usize, Pass> {
    let p = at(ctx, off, len).ok_or(truncated)?;
    if off + len > ip_end {
        return Err(stat::PASS_SHORT_IP_LEN);
    }
    Ok(p)
}

/// The frame's length, fragments included (multi-buffer XDP: a jumbo frame's linear part is
/// only its first page).
#[inline(always)]
pub fn frame_len(ctx: &XdpContext) -> usize {
    unsafe { bpf_xdp_get_buff_len(ctx.as_ptr() as *mut _) as usize }
}

/// Cuts the frame to its first `end` bytes, dropping what follows the IP packet (Ethernet
/// padding). `Some(true)` when something was cut, `None` when the kernel refused.
#[inline(always)]
pub fn trim_to(ctx: &XdpContext, end: usize) -> Option<bool> {
    let len = frame_len(ctx);
    if len <= end {
        return Some(false);
    }
    if unsafe { bpf_xdp_adjust_tail(ctx.as_ptr() as *mut _, end as i32 - len as i32) } != 0 {
        return None;
    }
    Some(true)
}

/// True when the frame holds `len` bytes; the helper is only asked when the linear part is
/// shorter.
#[inline(always)]
pub fn frame_holds(ctx: &XdpContext, len: usize) -> bool {
    ctx.data() + len <= ctx.data_end() || frame_len(ctx) >= len
}

#[inline(always)]
pub unsafe fn u8_at(p: usize) -> u8 {
    *(p as *const u8)
}

#[inline(always)]
pub unsafe fn be16_at(p: usize) -> u16 {
    u16::from_be(core::ptr::read_unaligned(p as *const u16))
}

/// Raw (network order) 32-bit word.
#[inline(always)]
pub unsafe fn raw32_at(p: usize) -> u32 {
    core::ptr::read_unaligned(p as *const u32)
}

#[inline(always)]
unsafe fn addr6_at(p: usize) -> [u32; 4] {
    core::ptr::read_unaligned(p as *const [u32; 4])
}

/// Ethernet and up to two VLAN tags: returns (ethertype, L3 offset).
#[inline(always)]
pub fn l2(ctx: &XdpContext) -> Result<(u16, usize), Pass> {
    let p = at(ctx, 0, ETH_HLEN).ok_or(stat::PASS_TRUNCATED_L2)?;
    let mut proto = unsafe { be16_at(p + 12) };
    let mut off = ETH_HLEN;
    for _ in 0..2 {
        if proto != ETH_P_8021Q && proto != ETH_P_8021AD {
            break;
        }
        let v = at(ctx, off, 4).ok_or(stat::PASS_TRUNCATED_L2)?;
        proto = unsafe { be16_at(v + 2) };
        off += 4;
    }
    Ok((proto, off))
}

pub fn parse(ctx: &XdpContext) -> Result<Parsed, Pass> {
    let (proto, l3_off) = l2(ctx)?;
    match proto {
        ETH_P_IP => ipv4(ctx, l3_off),
        ETH_P_IPV6 => ipv6(ctx, l3_off),
        _ => Err(stat::PASS_NOT_IP),
    }
}

#[inline(always)]
fn ipv4(ctx: &XdpContext, l3: usize) -> Result<Parsed, Pass> {
    let p = at(ctx, l3, IPV4_HLEN).ok_or(stat::PASS_TRUNCATED_L3)?;
    let vihl = unsafe { u8_at(p) };
    let ihl = ((vihl & 0x0f) as usize) * 4;
    if vihl >> 4 != 4 || ihl < IPV4_HLEN {
        return Err(stat::PASS_BAD_IP_LEN);
    }
    at(ctx, l3, ihl).ok_or(stat::PASS_TRUNCATED_L3)?;
    let tot_len = unsafe { be16_at(p + offset_of!(Ipv4Hdr, tot_len)) } as usize;
    if tot_len < ihl || !frame_holds(ctx, l3 + tot_len) {
        return Err(stat::PASS_BAD_IP_LEN);
    }
    let end = l3 + tot_len;
    // More-fragments flag or a fragment offset: only the first fragment has ports, so
    // steering fragments by 5-tuple would split them. They go to the kernel.
    if unsafe { be16_at(p + offset_of!(Ipv4Hdr, frag)) } & 0x3fff != 0 {
        return Err(stat::PASS_FRAGMENT);
    }
    let mut key = FlowKey {
        family: FAMILY_V4,
        proto: unsafe { u8_at(p + offset_of!(Ipv4Hdr, proto)) },
        ..FlowKey::default()
    };
    key.src[0] = unsafe { raw32_at(p + offset_of!(Ipv4Hdr, src)) };
    key.dst[0] = unsafe { raw32_at(p + offset_of!(Ipv4Hdr, dst)) };
    let tos = unsafe { u8_at(p + offset_of!(Ipv4Hdr, tos)) };
    let mut tcp_flags = 0;
    let icmp_error = match key.proto {
        PROTO_TCP | PROTO_UDP => {
            tcp_flags = ports(ctx, l3 + ihl, end, &mut key)?;
            false
        }
        PROTO_ICMP => {
            icmp4_too_big(ctx, l3 + ihl, end, &mut key)?;
            true
        }
        _ => return Err(stat::PASS_UNSUPPORTED_L4),
    };
    Ok(Parsed {
        key,
        l3_off: l3,
        l3_len: tot_len,
        tos,
        icmp_error,
        l4_off: l3 + ihl,
        tcp_flags,
    })
}

#[inline(always)]
fn ipv6(ctx: &XdpContext, l3: usize) -> Result<Parsed, Pass> {
    let p = at(ctx, l3, IPV6_HLEN).ok_or(stat::PASS_TRUNCATED_L3)?;
    let vtc = unsafe { be16_at(p) };
    if vtc >> 12 != 6 {
        return Err(stat::PASS_BAD_IP_LEN);
    }
    let l3_len = unsafe { be16_at(p + offset_of!(Ipv6Hdr, payload_len)) } as usize + IPV6_HLEN;
    if !frame_holds(ctx, l3 + l3_len) {
        return Err(stat::PASS_BAD_IP_LEN);
    }
    let end = l3 + l3_len;
    let mut key = FlowKey {
        family: FAMILY_V6,
        ..FlowKey::default()
    };
    key.src = unsafe { addr6_at(p + offset_of!(Ipv6Hdr, src)) };
    key.dst = unsafe { addr6_at(p + offset_of!(Ipv6Hdr, dst)) };
    let (next_hdr, l4) = ext_headers(
        ctx,
        unsafe { u8_at(p + offset_of!(Ipv6Hdr, next)) },
        l3 + IPV6_HLEN,
        end,
    )?;
    key.proto = next_hdr;
    let tos = (vtc >> 4) as u8;
    let mut tcp_flags = 0;
    let icmp_error = match next_hdr {
        PROTO_TCP | PROTO_UDP => {
            tcp_flags = ports(ctx, l4, end, &mut key)?;
            false
        }
        PROTO_ICMPV6 => {
            icmp6_too_big(ctx, l4, end, &mut key)?;
            true
        }
        _ => return Err(stat::PASS_UNSUPPORTED_L4),
    };
    Ok(Parsed {
        key,
        l3_off: l3,
        l3_len,
        tos,
        icmp_error,
        l4_off: l4,
        tcp_flags,
    })
}

/// Skips hop-by-hop (0), routing (43) and destination-options (60) headers.
#[inline(always)]
fn ext_headers(
    ctx: &XdpContext,
    mut next_hdr: u8,
    mut off: usize,
    end: usize,
) -> Result<(u8, usize), Pass> {
    for _ in 0..MAX_EXT_HDRS {
        match next_hdr {
            0 | 43 | 60 => {
                let e = in_packet(ctx, off, 8, end, stat::PASS_TRUNCATED_L3)?;
                next_hdr = unsafe { u8_at(e) };
                off += (unsafe { u8_at(e + 1) } as usize + 1) * 8;
            }
            44 => return Err(stat::PASS_FRAGMENT),
            _ => return Ok((next_hdr, off)),
        }
    }
    Err(stat::PASS_EXT_HDR_LIMIT)
}

#[inline(always)]
/// Reads the ports into `key`; returns the TCP flags (0 for UDP).
fn ports(ctx: &XdpContext, l4: usize, end: usize, key: &mut FlowKey) -> Result<u8, Pass> {
    let p = in_packet(ctx, l4, 8, end, stat::PASS_TRUNCATED_L4)?;
    key.sport = unsafe { core::ptr::read_unaligned(p as *const u16) };
    key.dport = unsafe { core::ptr::read_unaligned((p + 2) as *const u16) };
    if key.proto != PROTO_TCP {
        return Ok(0);
    }
    let t = in_packet(ctx, l4, 20, end, stat::PASS_TRUNCATED_L4)?;
    Ok(unsafe { u8_at(t + 13) })
}

/// Quoted ports of an ICMP error, reversed: the quoted packet went VIP -> client, so the
/// client's flow has the quoted destination as source.
#[inline(always)]
fn quoted_ports(ctx: &XdpContext, l4: usize, end: usize, key: &mut FlowKey) -> Result<(), Pass> {
    let p = in_packet(ctx, l4, 4, end, stat::PASS_TRUNCATED_L4)?;
    key.dport = unsafe { core::ptr::read_unaligned(p as *const u16) };
    key.sport = unsafe { core::ptr::read_unaligned((p + 2) as *const u16) };
    Ok(())
}

/// ICMP "fragmentation needed" (type 3 code 4) about a VIP flow: steer it with that flow so
/// the backend that sends the stream learns the path MTU.
#[inline(always)]
fn icmp4_too_big(ctx: &XdpContext, l4: usize, end: usize, key: &mut FlowKey) -> Result<(), Pass> {
    let p = in_packet(ctx, l4, 8, end, stat::PASS_TRUNCATED_L4)?;
    if unsafe { u8_at(p) } != 3 || unsafe { u8_at(p + 1) } != 4 {
        return Err(stat::PASS_ICMP_NOT_VIP);
    }
    let q = in_packet(ctx, l4 + 8, IPV4_HLEN, end, stat::PASS_TRUNCATED_L4)?;
    let ihl = ((unsafe { u8_at(q) } & 0x0f) as usize) * 4;
    if ihl < IPV4_HLEN {
        return Err(stat::PASS_BAD_IP_LEN);
    }
    key.proto = unsafe { u8_at(q + offset_of!(Ipv4Hdr, proto)) };
    if key.proto != PROTO_TCP && key.proto != PROTO_UDP {
        return Err(stat::PASS_ICMP_NOT_VIP);
    }
    // The error must be addressed to the quoted packet's sender (the VIP): one sent to
    // another host is not this balancer's to steer.
    if unsafe { raw32_at(q + offset_of!(Ipv4Hdr, src)) } != key.dst[0] {
        return Err(stat::PASS_ICMP_NOT_VIP);
    }
    key.src[0] = unsafe { raw32_at(q + offset_of!(Ipv4Hdr, dst)) };
    key.dst[0] = unsafe { raw32_at(q + offset_of!(Ipv4Hdr, src)) };
    quoted_ports(ctx, l4 + 8 + ihl, end, key)
}

/// ICMPv6 "packet too big" (type 2) about a VIP flow; the quoted header must be followed
/// directly by TCP or UDP.
#[inline(always)]
fn icmp6_too_big(ctx: &XdpContext, l4: usize, end: usize, key: &mut FlowKey) -> Result<(), Pass> {
    let p = in_packet(ctx, l4, 8, end, stat::PASS_TRUNCATED_L4)?;
    if unsafe { u8_at(p) } != 2 {
        return Err(stat::PASS_ICMP_NOT_VIP);
    }
    let q = in_packet(ctx, l4 + 8, IPV6_HLEN, end, stat::PASS_TRUNCATED_L4)?;
    key.proto = unsafe { u8_at(q + offset_of!(Ipv6Hdr, next)) };
    if key.proto != PROTO_TCP && key.proto != PROTO_UDP {
        return Err(stat::PASS_ICMP_NOT_VIP);
    }
    // Addressed to the quoted packet's sender (the VIP), as for IPv4.
    if unsafe { addr6_at(q + offset_of!(Ipv6Hdr, src)) } != key.dst {
        return Err(stat::PASS_ICMP_NOT_VIP);
    }
    key.src = unsafe { addr6_at(q + offset_of!(Ipv6Hdr, dst)) };
    key.dst = unsafe { addr6_at(q + offset_of!(Ipv6Hdr, src)) };
    quoted_ports(ctx, l4 + 8 + IPV6_HLEN, end, key)
}
