//! Sluice's data plane: `sluice_xdp` steers VIP traffic to backends, `sluice_decap` runs on
//! backends, `sluice_pass` is the XDP_PASS baseline the benchmarks compare against.
//!
//! Every program is multi-buffer aware (`xdp.frags`): native XDP on an interface with a
//! jumbo MTU accepts only such programs, and a frame larger than a page arrives as a linear
//! first part plus fragments. Headers are read from the linear part; lengths are checked
//! against the whole frame.
#![no_std]

mod ablate;
mod csum;
mod decap;
mod decide;
mod encap;
mod hdr;
mod icmp;
mod inband;
mod maps;
mod parse;
mod quic;
mod refusal;
mod rst;
mod second_hop;
mod stats;
mod tenant;
mod trace;

use aya_ebpf::{bindings::xdp_action, macros::xdp, programs::XdpContext};
use lb_common::{
    stat, LB_F_TRACE, PROTO_TCP, PROTO_UDP, VIP_F_INBAND, VIP_F_QUIC_CID, VIP_F_SHED_RST,
};

use crate::{encap::Forwarded, maps::CONFIG, refusal::Refusal, stats::count};

#[xdp(frags)]
pub fn sluice_xdp(ctx: XdpContext) -> u32 {
    count(stat::RX);
    let p = match parse::parse(&ctx) {
        Ok(p) => p,
        Err(reason) => {
            count(reason);
            return xdp_action::XDP_PASS;
        }
    };
    if ablate::STOP_AFTER_PARSE {
        return xdp_action::XDP_PASS;
    }
    // Element 0 of an array map always exists: the check is for the verifier and never fails.
    let Some(cfg) = CONFIG.get(0) else {
        return xdp_action::XDP_PASS;
    };
    let Some(vip) = decide::vip(&p.key, cfg) else {
        count(if p.icmp_error {
            stat::PASS_ICMP_NOT_VIP
        } else {
            stat::PASS_NOT_VIP
        });
        return xdp_action::XDP_PASS;
    };
    if ablate::STOP_AFTER_VIP {
        return xdp_action::XDP_PASS;
    }
    let server = if vip.flags & VIP_F_QUIC_CID != 0 && p.key.proto == PROTO_UDP && !p.icmp_error {
        quic_server(&ctx, &p, &vip, cfg.hash_seed)
    } else {
        0
    };
    let d = match decide::decide(
        &p.key,
        &vip,
        cfg,
        server,
        !p.icmp_error,
        p.opens(),
        if p.icmp_error { 0 } else { p.tcp_flags },
    ) {
        Ok(d) => {
            if cfg.flags & LB_F_TRACE != 0 {
                trace::decision(&p.key, vip.id, d.backend_id, d.new_flow);
            }
            d
        }
        Err(Refusal::Drop(reason)) => {
            count(reason);
            return xdp_action::XDP_DROP;
        }
        Err(Refusal::Shed(reason)) => {
            count(reason);
            if vip.flags & VIP_F_SHED_RST != 0 {
                if let Some(action) = rst::reply(&ctx, &p) {
                    count(stat::SHED_RST_SENT);
                    return action;
                }
            }
            count(stat::DROP_SHED);
            return xdp_action::XDP_DROP;
        }
    };
    if ablate::STOP_AFTER_DECIDE {
        return xdp_action::XDP_PASS;
    }
    if p.icmp_error {
        count(stat::ICMP_TOO_BIG_STEERED);
    } else if vip.flags & VIP_F_INBAND != 0 && p.key.proto == PROTO_TCP {
        if let Some(e) = d.conn {
            inband::observe(&ctx, &p, e, d.backend_id, d.now);
        }
    }
    match encap::forward(&ctx, &p, &d, cfg) {
        Ok(Forwarded::ToBackend(action)) => {
            // Counted once sent: a packet answered with a too-big, or dropped on the way,
            // is no traffic of the backend it never reached.
            stats::traffic(
                vip.id,
                d.backend_id,
                p.l3_len as u64,
                d.new_flow,
                d.handshake,
            );
            action
        }
        Ok(Forwarded::Answered(action)) => action,
        Err(reason) => {
            count(reason);
            xdp_action::XDP_DROP
        }
    }
}

/// The backend a QUIC packet's connection ID names and the ID's hash, as `decide` takes them,
/// or 0 (with the reason counted) when the packet takes the 5-tuple path.
#[inline(always)]
fn quic_server(ctx: &XdpContext, p: &parse::Parsed, vip: &lb_common::VipMeta, seed: u32) -> u64 {
    match quic::server(ctx, p, vip, seed) {
        Ok((id, hash)) => (id as u64) << 32 | hash as u64,
        Err(reason) => {
            count(reason);
            0
        }
    }
}

#[xdp(frags)]
pub fn sluice_decap(ctx: XdpContext) -> u32 {
    decap::decap(&ctx)
}

/// Baseline for benchmarks: the cheapest program that still touches a per-CPU counter.
#[xdp(frags)]
pub fn sluice_pass(_ctx: XdpContext) -> u32 {
    count(stat::RX);
    xdp_action::XDP_PASS
}

#[cfg(not(test))]
#[panic_handler]
fn panic(_: &core::panic::PanicInfo) -> ! {
    loop {}
}
