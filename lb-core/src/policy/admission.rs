//! Admission control: which backends are full, and which priority classes a VIP sheds.
//!
//! A backend is full when its active sessions reach `max_sessions` (0 = no cap) or its fresh
//! telemetry shows the queue or KV cache at its threshold; the data plane probes past full
//! backends. Stale telemetry does not make a backend full, so a telemetry outage never sheds.
//! Active sessions are the connection table's flows seen within `flow_idle_timeout`, which
//! counts a finished stream until its flow idles out; where fresh telemetry reports the
//! engine's requests, the cap counts the engine's running and waiting requests when fewer
//! ([`sessions`]).
//!
//! Two ways to refuse. Per session, in the data plane: where admission is configured, a new
//! session whose probes find only full backends is refused (`shed_full`), so a pool runs its
//! accelerators full and refuses only what finds no room at that moment. Per class, here:
//! while all of a pool's (the VIPs that share backend hosts) healthy backends of positive
//! weight are full, VIPs of classes `admit_max + 1 ..= 7` shed every new session, so the
//! capacity that frees up goes to the higher classes. The first all-full step sheds the
//! lowest class (`admit_max` 6); every further `period` it stays all full sheds one more
//! class, down to admitting the pool's highest class only. That class is never shed whole: no
//! higher class would take the room, and shedding it would idle the accelerators for a period
//! while per-session refusal has already turned away the excess (a lone class-7 VIP at 130%
//! load would serve less than plain Maglev, its fleet empty for a period at a time). Once
//! some backend has room for `period`, one class is readmitted per `period` until none is
//! shed. Changes are at most one class per `period` both ways, so a pool at the edge does not
//! toggle.

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
    let capped = capped(sessions, max_sessions, telemetry);
    let saturated = telemetry.filter(|t| !t.stale).is_some_and(|t| {
        let s = &t.sample;
        s.queue_depth
            .is_some_and(|q| q >= f64::from(cfg.queue_depth_high))
            || s.kv_cache.is_some_and(|kv| kv >= cfg.kv_cache_high)
    });
    capped || saturated
}

/// Whether the backend is at the session cap the operator set: full, and a client's
/// affinity entry brings it no new session either (saturation alone does not stop one).
pub fn capped(sessions: u64, max_sessions: u32, telemetry: Option<&BackendTelemetry>) -> bool {
    max_sessions > 0 && self::sessions(sessions, telemetry) >= u64::from(max_sessions)
}

/// The sessions a backend's cap counts: the connection table's `table` count, or the engine's
/// running plus waiting requests where fresh telemetry reports them and they are fewer. The
/// table keeps a finished stream for `flow_idle_timeout` after its last packet (a minute by
/// default): at 130% load it can count 20-30 sessions on engines running 7-16 requests with
/// none waiting, so a cap of 24 would refuse sessions that the engines have room for.
pub fn sessions(table: u64, telemetry: Option<&BackendTelemetry>) -> u64 {
    let engine = telemetry.filter(|t| !t.stale).and_then(|t| {
        let s = &t.sample;
        s.running
            .map(|r| (r + s.queue_depth.unwrap_or(0.0)).round() as u64)
    });
    engine.map_or(table, |e| e.min(table))
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
    /// Admission control is configured for this VIP (`configured`): it refuses new
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

    /// One step: `all_full` says whether the pool has room, `top` is its highest class
    /// (the lowest number among its VIPs with admission), which is never shed. While
    /// `tenants_over_share`, some tenant is shed for holding more than its share: the level
    /// does not tighten (tenants go before any class), and tightens once no tenant is.
    pub fn update(
        &mut self,
        now: Duration,
        all_full: bool,
        period: Duration,
        top: u8,
        tenants_over_share: bool,
    ) -> Option<ShedChange> {
        if all_full != self.all_full {
            self.all_full = all_full;
            self.mark = now;
        }
        if self.admit_max < top {
            // The pool's highest class changed (a VIP left it or was reclassed).
            self.admit_max = top;
            self.mark = now;
            return Some(ShedChange::Relax);
        }
        let waited = now.saturating_sub(self.mark) >= period;
        let change = if all_full && (self.admit_max == LOWEST_CLASS || waited) {
            (self.admit_max > top && !tenants_over_share).then_some(ShedChange::Tighten)
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
    fn the_cap_counts_the_engines_requests_where_fewer_than_the_tables_flows() {
        let cfg = PolicyConfig::default();
        let engine = |running, waiting, stale| {
            let mut s = sample();
            (s.running, s.queue_depth) = (Some(running), Some(waiting));
            let mut t = telemetry(s);
            t.stale = stale;
            t
        };
        // 30 flows in the table, 12 of them streams the engine still runs: room under 24.
        assert_eq!(sessions(30, Some(&engine(12.0, 0.0, false))), 12);
        assert!(!full(30, 24, Some(&engine(12.0, 0.0, false)), &cfg));
        // Running and waiting together reach the cap (a queue of 4 is under its threshold).
        assert!(!full(30, 24, Some(&engine(16.0, 4.0, false)), &cfg));
        assert!(full(30, 24, Some(&engine(20.0, 4.0, false)), &cfg));
        // The table counts a session the engine has not seen yet: the smaller count wins.
        assert_eq!(sessions(5, Some(&engine(12.0, 0.0, false))), 5);
        // No engine counts, or stale ones: the table's.
        assert_eq!(sessions(30, Some(&telemetry(sample()))), 30);
        assert_eq!(sessions(30, Some(&engine(12.0, 0.0, true))), 30);
        assert_eq!(sessions(30, None), 30);
    }

    #[test]
    fn lowest_class_shed_first_one_class_per_period_never_class_zero() {
        let period = 10 * S;
        let mut sh = Shedder::new(Duration::ZERO);
        let mut levels = Vec::new();
        for t in 0..=100 {
            sh.update(t * S, true, period, 0, false);
            levels.push(sh.admit_max());
        }
        assert_eq!(levels[0], 6);
        assert_eq!(levels[9], 6);
        assert_eq!(levels[10], 5);
        assert_eq!(levels[60], 0);
        assert_eq!(levels[100], 0);
        // Room again: readmits one class per period, from the highest priority down.
        assert_eq!(sh.update(101 * S, false, period, 0, false), None);
        assert_eq!(sh.update(110 * S, false, period, 0, false), None);
        assert_eq!(
            sh.update(111 * S, false, period, 0, false),
            Some(ShedChange::Relax)
        );
        assert_eq!(sh.admit_max(), 1);
        for t in 112..=200 {
            sh.update(t * S, false, period, 0, false);
        }
        assert_eq!(sh.admit_max(), LOWEST_CLASS);
    }

    #[test]
    fn the_pools_highest_class_is_never_shed_whole() {
        let period = 10 * S;
        // A pool of classes 3 and 7: tightens to admitting class 3, no further.
        let mut sh = Shedder::new(Duration::ZERO);
        for t in 0..=100 {
            sh.update(t * S, true, period, 3, false);
        }
        assert_eq!(sh.admit_max(), 3);
        // A pool of class 7 alone: full for a minute, never shed by class.
        let mut sh = Shedder::new(Duration::ZERO);
        for t in 0..=60 {
            assert_eq!(sh.update(t * S, true, period, LOWEST_CLASS, false), None);
        }
        assert_eq!(sh.admit_max(), LOWEST_CLASS);
        // The pool's class-3 VIP leaves a pool shedding down to 3: class 7 is its top now.
        let mut sh = Shedder::new(Duration::ZERO);
        for t in 0..=100 {
            sh.update(t * S, true, period, 3, false);
        }
        assert_eq!(
            sh.update(101 * S, true, period, 7, false),
            Some(ShedChange::Relax)
        );
        assert_eq!(sh.admit_max(), LOWEST_CLASS);
    }

    #[test]
    fn classes_are_not_shed_while_a_tenant_is_shed_for_its_share() {
        let period = 10 * S;
        let mut sh = Shedder::new(Duration::ZERO);
        // Full for a minute, a tenant over its share all along: no class is shed.
        for t in 0..=60 {
            assert_eq!(sh.update(t * S, true, period, 0, true), None);
        }
        assert_eq!(sh.admit_max(), LOWEST_CLASS);
        // Still full with no tenant over its share: the classes go as before.
        assert_eq!(
            sh.update(61 * S, true, period, 0, false),
            Some(ShedChange::Tighten)
        );
        assert_eq!(sh.admit_max(), 6);
        // A tenant over its share again holds the level where it is, without readmitting.
        for t in 62..=100 {
            assert_eq!(sh.update(t * S, true, period, 0, true), None);
        }
        assert_eq!(sh.admit_max(), 6);
    }

    #[test]
    fn brief_relief_does_not_readmit() {
        let period = 10 * S;
        let mut sh = Shedder::new(Duration::ZERO);
        sh.update(Duration::ZERO, true, period, 0, false);
        for t in 1..50 {
            // Full for 4 s, room for 1 s: never `period` of room.
            sh.update(t * S, t % 5 != 0, period, 0, false);
        }
        assert_eq!(sh.admit_max(), 6);
    }
}
