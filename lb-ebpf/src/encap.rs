//! IPIP / IPv6 encapsulation towards a backend and the choice of next hop.

use aya_ebpf::{
    bindings::{bpf_fib_lookup, xdp_action, BPF_FIB_LKUP_RET_SUCCESS},
    helpers::{bpf_fib_lookup as fib_lookup, bpf_xdp_adjust_head},
    programs::XdpContext,
    EbpfContext,
};
use lb_common::{stat, Backend, LbConfig, FAMILY_V4, PROTO_IPIP, PROTO_IPV6};

use crate::{
    maps::TX_PORTS,
    parse::{at, Parsed, ETH_HLEN, ETH_P_IP, ETH_P_IPV6},
    stats::count,
};

const AF_INET: u8 = 2;
const AF_INET6: u8 = 10;
const IPV4_HLEN: usize = 20;
const IPV6_HLEN: usize = 40;
const TTL: u8 = 64;

#[repr(C)]
struct EthHdr {
    dst: [u8; 6],
    src: [u8; 6],
    proto: u16,
}

#[repr(C)]
struct Ipv4Hdr {
    vihl: u8,
    tos: u8,
    tot_len: u16,
    id: u16,
    frag: u16,
    ttl: u8,
    proto: u8,
    csum: u16,
    src: u32,
    dst: u32,
}

#[repr(C)]
struct Ipv6Hdr {
    vtc_flow: u32,
    payload_len: u16,
    next: u8,
    hop_limit: u8,
    src: [u32; 4],
    dst: [u32; 4],
}

struct NextHop {
    smac: [u8; 6],
    dmac: [u8; 6],
    ifindex: u32,
}

/// Encapsulates the packet for `b` and returns the XDP action, or `Err(drop counter)`.
#[inline(always)]
pub fn forward(
    ctx: &XdpContext,
    p: &Parsed,
    b: &Backend,
    h: u32,
    cfg: &LbConfig,
) -> Result<u32, u32> {
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
    // The ingress MAC is this host's: it is the source when the FIB gives no neighbour.
    let ingress_mac = match at(ctx, 0, 6) {
        Some(m) => unsafe { core::ptr::read_unaligned(m as *const [u8; 6]) },
        None => return Err(stat::DROP_ADJUST_HEAD),
    };
    let outer_len = if outer_v4 { IPV4_HLEN } else { IPV6_HLEN };
    let nh = next_hop(
        ctx,
        b,
        outer_v4,
        src_v4,
        &src_v6,
        p.l3_len + outer_len,
        ingress_mac,
        cfg,
    )?;

    let delta = (ETH_HLEN + outer_len) as i32 - p.l3_off as i32;
    if unsafe { bpf_xdp_adjust_head(ctx.as_ptr() as *mut _, -delta) } != 0 {
        return Err(stat::DROP_ADJUST_HEAD);
    }
    let Some(hdr) = at(ctx, 0, ETH_HLEN + outer_len) else {
        return Err(stat::DROP_ADJUST_HEAD);
    };
    let eth = EthHdr {
        dst: nh.dmac,
        src: nh.smac,
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
            tot_len: ((p.l3_len + IPV4_HLEN) as u16).to_be(),
            id: 0,
            frag: 0,
            ttl: TTL,
            proto: inner_proto,
            csum: 0,
            src: src_v4,
            dst: b.addr[0],
        };
        ip.csum = csum20(&ip);
        unsafe { core::ptr::write_unaligned((hdr + ETH_HLEN) as *mut Ipv4Hdr, ip) };
    } else {
        let ip = Ipv6Hdr {
            // Flow label from the flow hash: ECMP and RSS on the backend side spread flows.
            vtc_flow: (0x6000_0000 | (p.tos as u32) << 20 | (h & 0x000f_ffff)).to_be(),
            payload_len: (p.l3_len as u16).to_be(),
            next: inner_proto,
            hop_limit: TTL,
            src: src_v6,
            dst: b.addr,
        };
        unsafe { core::ptr::write_unaligned((hdr + ETH_HLEN) as *mut Ipv6Hdr, ip) };
    }

    if nh.ifindex == unsafe { (*ctx.ctx).ingress_ifindex } {
        count(stat::TX);
        return Ok(xdp_action::XDP_TX);
    }
    match TX_PORTS.redirect(nh.ifindex, 0) {
        Ok(a) => {
            count(stat::REDIRECT);
            Ok(a)
        }
        Err(_) => Err(stat::DROP_NO_NEXTHOP),
    }
}

/// Next hop from the kernel FIB; when it has none (no route, no resolved neighbour,
/// forwarding off), the configured fallback MAC out of the ingress interface.
#[inline(always)]
#[allow(clippy::too_many_arguments)]
fn next_hop(
    ctx: &XdpContext,
    b: &Backend,
    v4: bool,
    src_v4: u32,
    src_v6: &[u32; 4],
    tot_len: usize,
    ingress_mac: [u8; 6],
    cfg: &LbConfig,
) -> Result<NextHop, u32> {
    let ingress = unsafe { (*ctx.ctx).ingress_ifindex };
    let mut f: bpf_fib_lookup = unsafe { core::mem::zeroed() };
    f.family = if v4 { AF_INET } else { AF_INET6 };
    f.__bindgen_anon_1.tot_len = tot_len as u16;
    f.ifindex = ingress;
    if v4 {
        f.__bindgen_anon_3.ipv4_src = src_v4;
        f.__bindgen_anon_4.ipv4_dst = b.addr[0];
    } else {
        f.__bindgen_anon_3.ipv6_src = *src_v6;
        f.__bindgen_anon_4.ipv6_dst = b.addr;
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
        return Ok(NextHop {
            smac: f.smac,
            dmac: f.dmac,
            ifindex: f.ifindex,
        });
    }
    if cfg.fallback_mac == [0; 6] {
        return Err(stat::DROP_NO_NEXTHOP);
    }
    count(stat::FIB_FALLBACK_MAC);
    // The fallback router sits on the ingress segment, whose MAC is this host's.
    Ok(NextHop {
        smac: ingress_mac,
        dmac: cfg.fallback_mac,
        ifindex: ingress,
    })
}

/// IPv4 header checksum. The one's-complement sum is byte-order independent, so the words
/// are summed as they lie in memory.
#[inline(always)]
fn csum20(ip: &Ipv4Hdr) -> u16 {
    let w = unsafe { &*(ip as *const Ipv4Hdr as *const [u16; 10]) };
    let mut s: u32 = 0;
    for x in w {
        s += *x as u32;
    }
    s = (s & 0xffff) + (s >> 16);
    s = (s & 0xffff) + (s >> 16);
    !(s as u16)
}
