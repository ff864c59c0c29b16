//! Per-CPU counters: plain increments, no atomics (each CPU owns its slot).

use lb_common::{stat::Counter, TrafficStats};

use crate::maps::{BACKEND_STATS, STATS, VIP_STATS};

#[inline(always)]
pub fn count(counter: Counter) {
    if let Some(c) = STATS.get_ptr_mut(counter.0) {
        unsafe { *c += 1 };
    }
}

#[inline(always)]
fn add(s: Option<*mut TrafficStats>, bytes: u64, new_flow: bool) {
    if let Some(s) = s {
        unsafe {
            (*s).packets += 1;
            (*s).bytes += bytes;
            if new_flow {
                (*s).new_flows += 1;
            }
        }
    }
}

#[inline(always)]
pub fn traffic(vip: u32, backend: u32, bytes: u64, new_flow: bool) {
    add(VIP_STATS.get_ptr_mut(vip), bytes, new_flow);
    add(BACKEND_STATS.get_ptr_mut(backend), bytes, new_flow);
}
