//! Per-CPU counters: plain increments, no atomics (each CPU owns its slot).

use lb_common::{stat::Counter, TrafficStats};

use crate::{
    ablate,
    maps::{BACKEND_STATS, STATS, VIP_STATS},
};

#[inline(always)]
pub fn count(counter: Counter) {
    if ablate::NO_COUNTERS {
        return;
    }
    if let Some(c) = STATS.get_ptr_mut(counter.0) {
        unsafe { *c += 1 };
    }
}

/// `handshake` bits of [`traffic`]: the packet is a SYN that started a TCP handshake, or
/// the first ACK that completed one (see `lb_common::CONN_F_HANDSHAKE`).
pub const HANDSHAKE_STARTED: u8 = 1 << 0;
pub const HANDSHAKE_COMPLETED: u8 = 1 << 1;

#[inline(always)]
fn add(s: Option<*mut TrafficStats>, bytes: u64, new_flow: bool, handshake: u8) {
    if let Some(s) = s {
        unsafe {
            (*s).packets += 1;
            (*s).bytes += bytes;
            if new_flow {
                (*s).new_flows += 1;
            }
            // Added, not branched on: a branch here would split the verifier's paths by
            // the handshake's state through everything before it, and the program is
            // close to the verifier's limit.
            (*s).handshakes += (handshake & HANDSHAKE_STARTED) as u64;
            (*s).handshakes_completed += (handshake >> 1) as u64;
        }
    }
}

#[inline(always)]
pub fn traffic(vip: u32, backend: u32, bytes: u64, new_flow: bool, handshake: u8) {
    if ablate::NO_COUNTERS {
        return;
    }
    add(VIP_STATS.get_ptr_mut(vip), bytes, new_flow, handshake);
    add(
        BACKEND_STATS.get_ptr_mut(backend),
        bytes,
        new_flow,
        handshake,
    );
}
