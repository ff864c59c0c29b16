//! Backend side: strips the outer IPv4/IPv6 header (and, for GUE, the UDP and GUE headers)
//! so the stack receives the client's own packet to the VIP (configured on the backend's
//! `lo`) and replies straight to the client.

use aya_ebpf::{
    bindings::xdp_action, helpers::bpf_xdp_adjust_head, programs::XdpContext, EbpfContext,
};
use lb_common::{
    stat::{self, Counter},
    GUE_PORT, GUE_PRIV_HDR_LEN, GUE_PRIV_KIND, PROTO_IPIP, PROTO_IPV6, PROTO_UDP, RING_HISTORY,
};

use crate::{
    hdr::{ETH_HLEN, ETH_P_IP, ETH_P_IPV6, IPV4_HLEN, IPV6_HLEN},
    parse::{at, be16_at, frame_holds, l2, trim_to, u8_at},
    second_hop::{self, Tunnel},
    stats::count,
};

pub fn decap(ctx: &XdpContext) -> u32 {
    match try_decap(ctx) {
        Ok(a) => a,
        Err(c) => {
            count(c);
            xdp_action::XDP_PASS
        }
    }
}

#[inline(always)]
fn try_decap(ctx: &XdpContext) -> Result<u32, Counter> {
    let (proto, l3) = l2(ctx).map_err(|_| stat::DECAP_PASS_NOT_ENCAP)?;
    // (outer header length, outer packet length, inner protocol)
    let (ip_len, outer_tot, outer) = match proto {
        ETH_P_IP => {
            let p = at(ctx, l3, IPV4_HLEN).ok_or(stat::DECAP_PASS_NOT_ENCAP)?;
            let ihl = ((unsafe { u8_at(p) } & 0x0f) as usize) * 4;
            // A fragmented tunnel packet cannot be stripped in place.
            if ihl < IPV4_HLEN || unsafe { be16_at(p + 6) } & 0x3fff != 0 {
                return Err(stat::DECAP_PASS_NOT_ENCAP);
            }
            (ihl, unsafe { be16_at(p + 2) } as usize, unsafe {
                u8_at(p + 9)
            })
        }
        ETH_P_IPV6 => {
            let p = at(ctx, l3, IPV6_HLEN).ok_or(stat::DECAP_PASS_NOT_ENCAP)?;
            (
                IPV6_HLEN,
                unsafe { be16_at(p + 4) } as usize + IPV6_HLEN,
                unsafe { u8_at(p + 6) },
            )
        }
        _ => return Err(stat::DECAP_PASS_NOT_ENCAP),
    };
    let udp_len = outer_tot.saturating_sub(ip_len);
    let (tunnel_len, inner, tunnel) = if outer != PROTO_UDP {
        (0, outer, None)
    } else if proto == ETH_P_IP {
        gue::<1>(ctx, l3 + ip_len, udp_len)?
    } else {
        gue::<4>(ctx, l3 + ip_len, udp_len)?
    };
    let outer_len = ip_len + tunnel_len;
    let inner_eth = match inner {
        PROTO_IPIP => ETH_P_IP,
        PROTO_IPV6 => ETH_P_IPV6,
        _ => return Err(stat::DECAP_PASS_NOT_ENCAP),
    };
    // The inner packet's own length must cover its header, fill the outer payload exactly,
    // and the frame must hold it: the stack then receives exactly the packet the LB
    // encapsulated, and a frame whose lengths disagree is left to the kernel's checks. (20 bytes hold both
    // families' length fields.)
    let i = at(ctx, l3 + outer_len, IPV4_HLEN).ok_or(stat::DECAP_PASS_BAD_LEN)?;
    let inner_len = if inner_eth == ETH_P_IP {
        (unsafe { be16_at(i + 2) }) as usize
    } else {
        (unsafe { be16_at(i + 4) }) as usize + IPV6_HLEN
    };
    if inner_len < 20 || outer_tot != outer_len + inner_len || !frame_holds(ctx, l3 + outer_tot) {
        return Err(stat::DECAP_PASS_BAD_LEN);
    }
    if let Some(t) = tunnel {
        let passed_on = if proto == ETH_P_IP {
            second_hop::forward::<1>(ctx, l3, &t, l3 + outer_len, inner_eth)
        } else {
            second_hop::forward::<4>(ctx, l3, &t, l3 + outer_len, inner_eth)
        };
        if let Some(action) = passed_on {
            return Ok(action);
        }
    }
    // The kernel refuses the two moves below only for a frame left shorter than an Ethernet
    // header, which the lengths checked above rule out: no packet reaches these branches
    // (so they have no counter); the kernel's xdp_exception tracepoint would show one.
    if trim_to(ctx, l3 + outer_tot).is_none() {
        return Ok(xdp_action::XDP_ABORTED);
    }
    let macs = at(ctx, 0, 12).ok_or(stat::DECAP_PASS_NOT_ENCAP)?;
    let macs = unsafe { core::ptr::read_unaligned(macs as *const [u8; 12]) };
    // Keep the MACs, drop VLAN tags and the outer header: the inner packet follows a fresh
    // Ethernet header.
    let shrink = (l3 + outer_len - ETH_HLEN) as i32;
    if unsafe { bpf_xdp_adjust_head(ctx.as_ptr() as *mut _, shrink) } != 0 {
        return Ok(xdp_action::XDP_ABORTED);
    }
    let Some(hdr) = at(ctx, 0, ETH_HLEN) else {
        return Ok(xdp_action::XDP_ABORTED);
    };
    unsafe {
        core::ptr::write_unaligned(hdr as *mut [u8; 12], macs);
        core::ptr::write_unaligned((hdr + 12) as *mut u16, inner_eth.to_be());
    }
    count(stat::DECAP_OK);
    Ok(xdp_action::XDP_PASS)
}

/// The UDP datagram at `off` (`len` bytes by the outer header): if it is Sluice's GUE
/// (port, version 0, data message, no flags, our private data with `RING_HISTORY` addresses
/// of `WORDS` words),
/// the length of the UDP and GUE headers, the inner protocol and what the private data says.
/// Other UDP is not ours.
#[inline(always)]
fn gue<const WORDS: usize>(
    ctx: &XdpContext,
    off: usize,
    len: usize,
) -> Result<(usize, u8, Option<Tunnel>), Counter> {
    const UDP_GUE: usize = 8 + 4;
    let tunnel = UDP_GUE + GUE_PRIV_HDR_LEN + 4 * WORDS * RING_HISTORY;
    let u = at(ctx, off, tunnel).ok_or(stat::DECAP_PASS_NOT_ENCAP)?;
    if unsafe { be16_at(u + 2) } != GUE_PORT {
        return Err(stat::DECAP_PASS_NOT_ENCAP);
    }
    let hlen = ((GUE_PRIV_HDR_LEN + 4 * WORDS * RING_HISTORY) / 4) as u8;
    let ours = unsafe {
        u8_at(u + 8) == hlen && be16_at(u + 10) == 0 && u8_at(u + UDP_GUE) == GUE_PRIV_KIND
    };
    if !ours {
        return Err(stat::DECAP_PASS_BAD_GUE);
    }
    if unsafe { be16_at(u + 4) } as usize != len {
        return Err(stat::DECAP_PASS_BAD_LEN);
    }
    let t = Tunnel {
        priv_off: off + UDP_GUE,
        hops: unsafe { u8_at(u + UDP_GUE + 1) },
    };
    Ok((tunnel, unsafe { u8_at(u + 9) }, Some(t)))
}
