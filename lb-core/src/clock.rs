//! The two clocks the controller reads, in one place: wall-clock milliseconds for what people
//! read (audit log, events, drain deadlines) and the monotonic clock the data plane stamps
//! connections with. Pure code takes the time as a parameter; only shells call these.

use std::time::{SystemTime, UNIX_EPOCH};

use crate::config::rules;

/// Wall-clock time as the controller takes it: unix milliseconds.
pub fn now_ms() -> u64 {
    rules::millis(
        SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .unwrap_or_default(),
    )
}

/// CLOCK_MONOTONIC in ns, the clock `bpf_ktime_get_coarse_ns` stamps connections with (the
/// coarse clock lags by at most a tick, far below any idle timeout).
pub fn monotonic_ns() -> u64 {
    let mut ts = libc::timespec {
        tv_sec: 0,
        tv_nsec: 0,
    };
    // SAFETY: clock_gettime writes the struct we pass.
    unsafe { libc::clock_gettime(libc::CLOCK_MONOTONIC, &mut ts) };
    ts.tv_sec as u64 * 1_000_000_000 + ts.tv_nsec as u64
}
