//! Admission control: which backends are full, and which priority classes a VIP sheds.
//!
//! A backend is full when its active sessions reach `max_sessions` (0 = no cap) or its fresh
//! telemetry shows the queue or KV cache at its threshold; the data plane probes past full
//! backends. Stale telemetry does not make a backend full, so a telemetry outage never sheds.
//!
//! Shedding, per pool (the VIPs that share backend hosts), over the pool's healthy backends
//! of positive weight: while all of them are full, VIPs of classes `admit_max + 1 ..= 7` shed
//! their new sessions, so the capacity that frees up goes to the higher classes. The first all-full step sheds class 7
//! (`admit_max` 6); every further `period` it stays all full sheds one more class, down to
//! admitting class 0 only (class 0 is never shed). Once some backend has room for `period`,
//! one class is readmitted per `period` until none is shed. Changes are at most one class per
//! `period` both ways, so a pool at the edge does not toggle.

use std::time::Duration;

use serde::Serialize;

use crate::config::{PolicyConfig, ShedMode};
use crate::telemetry::BackendTelemetry;

/// The lowest-priority class; 0 is the highest.
pub const LOWEST_CLASS: u8 = 7;

/// Whether the data plane should probe past this backend (see the module docs).
pub fn full(
    sessions: u64,
    max_sessions: u32,
    telemetry: Option<&BackendTelemetry>,
    cfg: &PolicyConfig,
) -> bool {
    let capped = max_sessions > 0 && sessions >= u64::from(max_sessions);
    let saturated = telemetry.filter(|t| !t.stale).is_some_and(|t| {
        let s = &t.sample;
        s.queue_depth
            .is_some_and(|q| q >= f64::from(cfg.queue_depth_high))
            || s.kv_cache.is_some_and(|kv| kv >= cfg.kv_cache_high)
    });
    capped || saturated
}

/// Whether admission control is configured for a VIP: `policy.shed` is set, or one of its
/// backends has a session cap. Telemetry saturation alone (a fleet at KV 0.8 or queue 5)
/// must not refuse sessions where the operator asked for no admission: clients would retry
/// dropped SYNs after 1, 3, 7 s, far longer than any engine queue.
pub fn configured(cfg: &PolicyConfig, mut max_sessions: impl Iterator<Item = u32>) -> bool {
    cfg.shed.is_some() || max_sessions.any(|m| m > 0)
}

/// A VIP's admission state, as the data plane is to apply it.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct Shed {
    /// Admission control is configured for this VIP ([`configured`]): it refuses new
    /// sessions that find only full backends, and sheds by class. Without it, full backends
    /// are only probed past and nothing is refused for want of room.
    pub admission: bool,
    /// New sessions of classes `<= admit_max` are admitted; 7 = none shed.
    pub admit_max: u8,
    /// How a shed session is refused.
    pub mode: ShedMode,
    /// Full backends among `backends` (healthy, positive weight).
    pub full: u32,
    pub backends: u32,
}

impl Shed {
    pub fn shedding(&self) -> bool {
        self.admit_max < LOWEST_CLASS
    }

    /// Whether a VIP of admission class `class` sheds new sessions now.
    pub fn sheds(&self, class: u8) -> bool {
        self.admission && class > self.admit_max
    }
}

/// A shed level change, for the audit log.
#[derive(Clone, Debug, PartialEq)]
pub enum ShedChange {
    /// One more class shed.
    Tighten,
    /// One class readmitted.
    Relax,
}

/// Time-stepped shed level of one VIP.
#[derive(Clone, Debug, PartialEq)]
pub struct Shedder {
    admit_max: u8,
    all_full: bool,
    /// Last level change or change of `all_full`: the start of the current wait.
    mark: Duration,
}

impl Shedder {
    pub fn new(now: Duration) -> Self {
        Shedder {
            admit_max: LOWEST_CLASS,
            all_full: false,
            mark: now,
        }
    }

    pub fn admit_max(&self) -> u8 {
        self.admit_max
    }

    pub fn update(
        &mut self,
        now: Duration,
        all_full: bool,
        period: Duration,
    ) -> Option<ShedChange> {
        if all_full != self.all_full {
            self.all_full = all_full;
            self.mark = now;
        }
        let waited = now.saturating_sub(self.mark) >= period;
        let change = if all_full && (self.admit_max == LOWEST_CLASS || waited) {
            (self.admit_max > 0).then_some(ShedChange::Tighten)
        } else if !all_full && waited {
            (self.admit_max < LOWEST_CLASS).then_some(ShedChange::Relax)
        } else {
            None
        }?;
        self.admit_max = match change {
            ShedChange::Tighten => self.admit_max - 1,
            ShedChange::Relax => self.admit_max + 1,
        };
        self.mark = now;
        Some(change)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::policy::tests::{sample, telemetry};

    const S: Duration = Duration::from_secs(1);

    #[test]
    fn full_by_sessions_or_fresh_queue_or_kv_but_not_stale() {
        let cfg = PolicyConfig::default();
        assert!(full(10, 10, None, &cfg));
        assert!(!full(9, 10, None, &cfg));
        assert!(!full(1_000_000, 0, None, &cfg));
        let mut s = sample();
        s.kv_cache = Some(0.85);
        let mut t = telemetry(s);
        assert!(full(0, 0, Some(&t), &cfg));
        t.stale = true;
        assert!(!full(0, 0, Some(&t), &cfg));
        let mut s = sample();
        s.queue_depth = Some(5.0);
        assert!(full(0, 0, Some(&telemetry(s)), &cfg));
    }

    #[test]
    fn lowest_class_shed_first_one_class_per_period_never_class_zero() {
        let period = 10 * S;
        let mut sh = Shedder::new(Duration::ZERO);
        let mut levels = Vec::new();
        for t in 0..=100 {
            sh.update(t * S, true, period);
            levels.push(sh.admit_max());
        }
        assert_eq!(levels[0], 6);
        assert_eq!(levels[9], 6);
        assert_eq!(levels[10], 5);
        assert_eq!(levels[60], 0);
        assert_eq!(levels[100], 0);
        // Room again: readmits one class per period, from the highest priority down.
        assert_eq!(sh.update(101 * S, false, period), None);
        assert_eq!(sh.update(110 * S, false, period), None);
        assert_eq!(sh.update(111 * S, false, period), Some(ShedChange::Relax));
        assert_eq!(sh.admit_max(), 1);
        for t in 112..=200 {
            sh.update(t * S, false, period);
        }
        assert_eq!(sh.admit_max(), LOWEST_CLASS);
    }

    #[test]
    fn brief_relief_does_not_readmit() {
        let period = 10 * S;
        let mut sh = Shedder::new(Duration::ZERO);
        sh.update(Duration::ZERO, true, period);
        for t in 1..50 {
            // Full for 4 s, room for 1 s: never `period` of room.
            sh.update(t * S, t % 5 != 0, period);
        }
        assert_eq!(sh.admit_max(), 6);
    }
}
