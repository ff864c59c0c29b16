//! Encapsulation towards a backend (IPIP / IPv6-in-IP, or GUE over UDP for backends running
//! `sluice_decap`) and the choice of next hop.

use aya_ebpf::{
    bindings::{
        bpf_fib_lookup, xdp_action, BPF_FIB_LKUP_RET_FRAG_NEEDED, BPF_FIB_LKUP_RET_SUCCESS,
    },
    helpers::{bpf_fib_lookup as fib_lookup, bpf_xdp_adjust_head},
    programs::XdpContext,
    EbpfContext,
};
use lb_common::{
    stat::{self, Counter},
    LbConfig, NextHop, BACKEND_F_GUE, FAMILY_V4, GUE_PORT, GUE_PRIV_HDR_LEN, GUE_PRIV_KIND,
    GUE_SPORT_BASE, GUE_SPORT_MASK, NEXTHOP_TTL_NS, PROTO_IPIP, PROTO_IPV6, PROTO_UDP,
    RING_HISTORY,
};

use crate::{
    ablate,
    csum::{add_all, fold},
    decide::{second_hops, Decision, SecondHops},
    hdr::{
        EthHdr, Ipv4Hdr, Ipv6Hdr, ETH_HLEN, ETH_P_IP, ETH_P_IPV6, GUE_HLEN, IPV4_HLEN, IPV6_HLEN,
        TTL, UDP_HLEN,
    },
    icmp,
    maps::{NEXTHOPS, TX_PORTS},
    parse::{at, trim_to, Parsed},
    stats::count,
};

const AF_INET: u8 = 2;
const AF_INET6: u8 = 10;
/// UDP, GUE and Sluice's private data (which ends with `RING_HISTORY` addresses of `WORDS`
/// words) after the outer IP header.
const fn gue_len(words: usize) -> usize {
    UDP_HLEN + GUE_HLEN + GUE_PRIV_HDR_LEN + 4 * words * RING_HISTORY
}

/// What [`forward`] did with a packet it did not drop, and the XDP action for it.
pub enum Forwarded {
    /// Encapsulated and sent toward the backend.
    ToBackend(u32),
    /// Not sent: answered in its place (an ICMP too-big to the client) or aborted.
    Answered(u32),
}

/// Encapsulates the packet for the decided backend, or `Err(drop counter)`.
#[inline(always)]
pub fn forward(
    ctx: &XdpContext,
    p: &Parsed,
    d: &Decision,
    cfg: &LbConfig,
) -> Result<Forwarded, Counter> {
    let b = &d.backend;
    let h = d.hash;
    let outer_v4 = b.family == FAMILY_V4;
    if outer_v4 && p.key.family != FAMILY_V4 {
        // IPv6 inside IPv4 is not offered: the control plane refuses such backends.
        return Err(stat::DROP_BAD_BACKEND);
    }
    let inner_proto = if p.key.family == FAMILY_V4 {
        PROTO_IPIP
    } else {
        PROTO_IPV6
    };
    let src_v4 = cfg.encap_src_v4 | (h & cfg.encap_src_v4_hostmask);
    let mut src_v6 = cfg.encap_src_v6;
    src_v6[3] |= h & cfg.encap_src_v6_hostmask;
    let gue = b.flags & BACKEND_F_GUE != 0;
    let ip_len = if outer_v4 { IPV4_HLEN } else { IPV6_HLEN };
    let tunnel_len = match (gue, outer_v4) {
        (false, _) => 0,
        (true, true) => gue_len(1),
        (true, false) => gue_len(4),
    };
    let outer_len = ip_len + tunnel_len;
    let outer_proto = if gue { PROTO_UDP } else { inner_proto };
    let src = OuterSource {
        v4: src_v4,
        v6: src_v6,
    };
    let hop = match next_hop(ctx, d, &src, p.l3_len + outer_len, cfg) {
        Ok(hop) => hop,
        Err(NoHop::Drop(reason)) => return Err(reason),
        Err(NoHop::TooBig(mtu)) => {
            // Tell the client the largest packet that fits once encapsulated.
            let fits = mtu.saturating_sub(outer_len as u32);
            return match icmp::too_big(ctx, p, fits) {
                Some(action) => {
                    count(stat::ICMP_TOO_BIG_SENT);
                    Ok(Forwarded::Answered(action))
                }
                None => Err(stat::DROP_FRAG_NEEDED),
            };
        }
    };

    // What follows the IP packet (Ethernet padding) stays out of the tunnel: the outer
    // length counts the client's packet and nothing else. The kernel refuses a shrink only
    // below an Ethernet header, and the frame keeps at least its IP header: no packet
    // reaches the refusal (so it has no counter); the xdp_exception tracepoint would show one.
    match trim_to(ctx, p.l3_off + p.l3_len) {
        Some(true) => count(stat::PADDING_TRIMMED),
        Some(false) => {}
        None => return Ok(Forwarded::Answered(xdp_action::XDP_ABORTED)),
    }

    let delta = (ETH_HLEN + outer_len) as i32 - p.l3_off as i32;
    if unsafe { bpf_xdp_adjust_head(ctx.as_ptr() as *mut _, -delta) } != 0 {
        return Err(stat::DROP_ADJUST_HEAD);
    }
    let Some(hdr) = at(ctx, 0, ETH_HLEN + outer_len) else {
        return Err(stat::DROP_ADJUST_HEAD);
    };
    let eth = EthHdr {
        dst: hop.dmac,
        src: hop.smac,
        proto: if outer_v4 {
            ETH_P_IP.to_be()
        } else {
            ETH_P_IPV6.to_be()
        },
    };
    unsafe { core::ptr::write_unaligned(hdr as *mut EthHdr, eth) };
    if outer_v4 {
        let mut ip = Ipv4Hdr {
            vihl: 0x45,
            tos: p.tos,
            tot_len: ((p.l3_len + outer_len) as u16).to_be(),
            id: 0,
            frag: 0,
            ttl: TTL,
            proto: outer_proto,
            csum: 0,
            src: src_v4,
            dst: b.addr[0],
        };
        if !ablate::NO_CSUM {
            ip.csum = csum20(&ip);
        }
        unsafe { core::ptr::write_unaligned((hdr + ETH_HLEN) as *mut Ipv4Hdr, ip) };
    } else {
        let ip = Ipv6Hdr {
            // Flow label from the flow hash: ECMP and RSS on the backend side spread flows.
            vtc_flow: (0x6000_0000 | (p.tos as u32) << 20 | (h & 0x000f_ffff)).to_be(),
            payload_len: ((p.l3_len + tunnel_len) as u16).to_be(),
            next: outer_proto,
            hop_limit: TTL,
            src: src_v6,
            dst: b.addr,
        };
        unsafe { core::ptr::write_unaligned((hdr + ETH_HLEN) as *mut Ipv6Hdr, ip) };
    }
    if gue {
        let udp_len = (tunnel_len + p.l3_len) as u16;
        let previous = second_hops(d.backend, d.slot);
        let written = if outer_v4 {
            write_gue::<1>(
                ctx,
                ETH_HLEN + IPV4_HLEN,
                h,
                udp_len,
                inner_proto,
                &previous,
            )
        } else {
            write_gue::<4>(
                ctx,
                ETH_HLEN + IPV6_HLEN,
                h,
                udp_len,
                inner_proto,
                &previous,
            )
        };
        if written.is_none() {
            return Err(stat::DROP_ADJUST_HEAD);
        }
    }

    if hop.ifindex == unsafe { (*ctx.ctx).ingress_ifindex } || ablate::NO_REDIRECT {
        count(stat::TX);
        return Ok(Forwarded::ToBackend(xdp_action::XDP_TX));
    }
    match TX_PORTS.redirect(hop.ifindex, 0) {
        Ok(a) => {
            count(stat::REDIRECT);
            Ok(Forwarded::ToBackend(a))
        }
        Err(_) => Err(stat::DROP_NO_NEXTHOP),
    }
}

/// Writes the UDP header, the GUE base header and Sluice's private data at `off`: the
/// source port from the flow hash, a zero UDP checksum (the inner packet carries its own;
/// RFC 6935 allows it for tunnels over IPv6), hop count 0, and the previous backends'
/// addresses (`WORDS` words each, the outer family's size; all zero where none is named).
#[inline(always)]
fn write_gue<const WORDS: usize>(
    ctx: &XdpContext,
    off: usize,
    h: u32,
    udp_len: u16,
    inner_proto: u8,
    previous: &SecondHops,
) -> Option<()> {
    let t = at(ctx, off, gue_len(WORDS))?;
    let sport = GUE_SPORT_BASE | (h as u16 & GUE_SPORT_MASK);
    // Hlen counts the 32-bit words after the base header: here, only the private data.
    let hlen = ((GUE_PRIV_HDR_LEN + 4 * WORDS * RING_HISTORY) / 4) as u8;
    let head: [u16; 6] = [
        sport.to_be(),
        GUE_PORT.to_be(),
        udp_len.to_be(),
        0,
        u16::from_ne_bytes([hlen, inner_proto]),
        0,
    ];
    unsafe {
        core::ptr::write_unaligned(t as *mut [u16; 6], head);
        core::ptr::write_unaligned(
            (t + UDP_HLEN + GUE_HLEN) as *mut [u8; 4],
            [GUE_PRIV_KIND, 0, 0, 0],
        );
        let addrs = t + UDP_HLEN + GUE_HLEN + GUE_PRIV_HDR_LEN;
        for (k, addr) in previous.iter().enumerate() {
            for (i, w) in addr.iter().take(WORDS).enumerate() {
                core::ptr::write_unaligned((addrs + 4 * (WORDS * k + i)) as *mut u32, *w);
            }
        }
    }
    Some(())
}

/// Why there is no next hop to send the packet to.
enum NoHop {
    Drop(Counter),
    /// The encapsulated packet exceeds this egress MTU.
    TooBig(u32),
}

impl From<Counter> for NoHop {
    fn from(counter: Counter) -> Self {
        NoHop::Drop(counter)
    }
}

struct OuterSource {
    v4: u32,
    v6: [u32; 4],
}

/// Next hop from the kernel FIB, reused per backend and CPU for `NEXTHOP_TTL_NS` while the
/// packet fits its MTU; when the FIB has none (no route, no resolved neighbour, forwarding
/// off), the configured fallback MAC out of the ingress interface.
#[inline(always)]
fn next_hop(
    ctx: &XdpContext,
    d: &Decision,
    src: &OuterSource,
    tot_len: usize,
    cfg: &LbConfig,
) -> Result<NextHop, NoHop> {
    let ingress = unsafe { (*ctx.ctx).ingress_ifindex };
    if ablate::NO_NEXT_HOP {
        return Ok(NextHop {
            dmac: cfg.fallback_mac,
            ifindex: ingress,
            ..NextHop::default()
        });
    }
    let cache = NEXTHOPS.get_ptr_mut(d.backend_id);
    if let Some(c) = cache {
        let c = unsafe { &*c };
        if c.expires_ns > d.now && c.ingress == ingress && tot_len as u32 <= c.mtu {
            return Ok(*c);
        }
    }
    let v4 = d.backend.family == FAMILY_V4;
    let mut f: bpf_fib_lookup = unsafe { core::mem::zeroed() };
    f.family = if v4 { AF_INET } else { AF_INET6 };
    f.__bindgen_anon_1.tot_len = tot_len as u16;
    f.ifindex = ingress;
    if v4 {
        f.__bindgen_anon_3.ipv4_src = src.v4;
        f.__bindgen_anon_4.ipv4_dst = d.backend.addr[0];
    } else {
        f.__bindgen_anon_3.ipv6_src = src.v6;
        f.__bindgen_anon_4.ipv6_dst = d.backend.addr;
    }
    let rc = unsafe {
        fib_lookup(
            ctx.as_ptr(),
            &mut f as *mut _,
            core::mem::size_of::<bpf_fib_lookup>() as i32,
            0,
        )
    };
    if rc == BPF_FIB_LKUP_RET_SUCCESS as i64 {
        let e = NextHop {
            expires_ns: d.now + NEXTHOP_TTL_NS,
            ifindex: f.ifindex,
            ingress,
            // The lookup answers with the egress MTU in place of the length it was given.
            mtu: unsafe { f.__bindgen_anon_1.mtu_result } as u32,
            smac: f.smac,
            dmac: f.dmac,
        };
        if let Some(c) = cache {
            unsafe { *c = e };
        }
        return Ok(e);
    }
    if rc == BPF_FIB_LKUP_RET_FRAG_NEEDED as i64 {
        // Encapsulated, the packet exceeds the path to the backend (the fallback router
        // would not take it either).
        return Err(NoHop::TooBig(
            unsafe { f.__bindgen_anon_1.mtu_result } as u32
        ));
    }
    if cfg.fallback_mac == [0; 6] {
        return Err(stat::DROP_NO_NEXTHOP.into());
    }
    count(stat::FIB_FALLBACK_MAC);
    // The fallback router sits on the ingress segment, and the frame's destination MAC is
    // this host's address there.
    let smac = match at(ctx, 0, 6) {
        Some(m) => unsafe { core::ptr::read_unaligned(m as *const [u8; 6]) },
        None => return Err(stat::DROP_ADJUST_HEAD.into()),
    };
    Ok(NextHop {
        smac,
        dmac: cfg.fallback_mac,
        ifindex: ingress,
        ..NextHop::default()
    })
}

/// IPv4 header checksum.
#[inline(always)]
fn csum20(ip: &Ipv4Hdr) -> u16 {
    fold(add_all(0, unsafe {
        &*(ip as *const Ipv4Hdr as *const [u32; 5])
    }))
}
