//! Sluice's data plane: `sluice_xdp` steers VIP traffic to backends, `sluice_decap` runs on
//! backends, `sluice_pass` is the XDP_PASS baseline the benchmarks compare against.
#![no_std]

mod decap;
mod encap;
mod maps;
mod parse;
mod stats;
mod steer;

use aya_ebpf::{bindings::xdp_action, macros::xdp, programs::XdpContext};
use lb_common::stat;

use crate::{maps::CONFIG, stats::count};

#[xdp]
pub fn sluice_xdp(ctx: XdpContext) -> u32 {
    count(stat::RX);
    let p = match parse::parse(&ctx) {
        Ok(p) => p,
        Err(reason) => {
            count(reason);
            return xdp_action::XDP_PASS;
        }
    };
    let Some(vip) = steer::vip(&p.key) else {
        count(if p.icmp_error {
            stat::PASS_ICMP_NOT_VIP
        } else {
            stat::PASS_NOT_VIP
        });
        return xdp_action::XDP_PASS;
    };
    let Some(cfg) = CONFIG.get(0) else {
        count(stat::DROP_NO_CONFIG);
        return xdp_action::XDP_DROP;
    };
    let d = match steer::decide(&p.key, &vip, cfg, !p.icmp_error) {
        Ok(d) => d,
        Err(reason) => {
            count(reason);
            return xdp_action::XDP_DROP;
        }
    };
    if p.icmp_error {
        count(stat::ICMP_TOO_BIG_STEERED);
    }
    stats::traffic(vip.id, d.backend_id, p.l3_len as u64, d.new_flow);
    match encap::forward(&ctx, &p, &d.backend, d.hash, cfg) {
        Ok(action) => action,
        Err(reason) => {
            count(reason);
            xdp_action::XDP_DROP
        }
    }
}

#[xdp]
pub fn sluice_decap(ctx: XdpContext) -> u32 {
    decap::decap(&ctx)
}

/// Baseline for benchmarks: the cheapest program that still touches a per-CPU counter.
#[xdp]
pub fn sluice_pass(_ctx: XdpContext) -> u32 {
    count(stat::RX);
    xdp_action::XDP_PASS
}

#[cfg(not(test))]
#[panic_handler]
fn panic(_: &core::panic::PanicInfo) -> ! {
    loop {}
}
