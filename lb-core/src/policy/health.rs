//! Health: a rise/fall state machine per backend, and the probes that feed it.
//!
//! `fall` consecutive failures mark a backend down, `rise` consecutive successes mark it up
//! (GLB-style dampening, so one lost probe does not flap the table). The caller writes a
//! down transition to the data plane at once; an up backend enters slow start in the policy.

use std::{
    collections::{BTreeMap, BTreeSet},
    net::IpAddr,
    time::Duration,
};

use serde::Serialize;

use crate::{config::HealthConfig, telemetry::BackendKey};

use super::{EventKind, PolicyEvent};

#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub struct Health {
    pub up: bool,
    /// Consecutive results contradicting `up` so far.
    pub streak: u32,
    /// When `up` last changed (or the tracker started).
    #[serde(serialize_with = "super::secs")]
    pub since: Duration,
    /// The last failure, for display.
    pub last_error: Option<String>,
}

impl Health {
    /// A tracker starting in the given state (e.g. the persisted one).
    pub fn new(now: Duration, up: bool) -> Self {
        Health {
            up,
            streak: 0,
            since: now,
            last_error: None,
        }
    }

    /// Folds in one probe result; returns the up/down event when the state flips.
    pub fn record(
        &mut self,
        now: Duration,
        result: &Result<(), CheckError>,
        cfg: &HealthConfig,
        vip: &str,
        backend: IpAddr,
    ) -> Option<PolicyEvent> {
        if let Err(e) = result {
            self.last_error = Some(e.to_string());
        }
        // Our own shortage (out of descriptors, memory or ports) says nothing about the
        // backend: its state and streak stay as they are.
        if let Err(CheckError::Local(_)) = result {
            return None;
        }
        if result.is_ok() == self.up {
            self.streak = 0;
            return None;
        }
        self.streak += 1;
        let needed = if self.up { cfg.fall } else { cfg.rise };
        if self.streak < needed {
            return None;
        }
        self.up = !self.up;
        self.streak = 0;
        self.since = now;
        let (kind, reason) = match (self.up, &self.last_error) {
            (true, _) => (
                EventKind::Up,
                format!("{needed} consecutive successful checks"),
            ),
            (false, e) => (
                EventKind::Down,
                format!(
                    "{needed} consecutive failed checks, last: {}",
                    e.as_deref().unwrap_or("?")
                ),
            ),
        };
        Some(PolicyEvent {
            at: now,
            kind,
            vip: vip.to_owned(),
            backend: Some(backend),
            reason,
            telemetry: None,
        })
    }
}

/// Each backend's tracker, kept across rounds of checks.
#[derive(Debug, Default)]
pub struct Trackers(BTreeMap<BackendKey, Health>);

/// One probe of a round: the backend, whether the table has it up, and the check's result.
#[derive(Debug)]
pub struct Outcome {
    pub key: BackendKey,
    pub healthy: bool,
    pub result: Result<(), CheckError>,
}

impl Trackers {
    /// Folds one round's outcomes in at `now` (a backend missing from the round was removed
    /// and is forgotten; a new one starts from the table's state). Returns the outcomes
    /// whose backend flips, by index, with their events: the caller applies them together.
    pub fn round(
        &mut self,
        now: Duration,
        outcomes: &[Outcome],
        cfg: &HealthConfig,
    ) -> Vec<(usize, PolicyEvent)> {
        let keys: BTreeSet<&BackendKey> = outcomes.iter().map(|o| &o.key).collect();
        self.0.retain(|k, _| keys.contains(k));
        let mut flips = Vec::new();
        for (i, o) in outcomes.iter().enumerate() {
            let t = self
                .0
                .entry(o.key.clone())
                .or_insert_with(|| Health::new(now, o.healthy));
            if let Some(ev) = t.record(now, &o.result, cfg, &o.key.0, o.key.1) {
                flips.push((i, ev));
            }
        }
        flips
    }
}

/// The granularity of a round's start times: probes due in the same step start together,
/// so a round of thousands wakes the checker some tens of times, not once per probe.
pub const START_STEP: Duration = Duration::from_millis(10);

/// When the `i`th of a round's `n` probes starts, after the round's start: spread evenly
/// (in steps of [`START_STEP`]) over the part of the interval that leaves each probe its
/// whole timeout before the next round, so a round's answers are in by then and its
/// connects do not leave all at once.
pub fn offset(i: usize, n: usize, cfg: &HealthConfig) -> Duration {
    let spread = cfg.interval.saturating_sub(cfg.timeout).as_nanos();
    let at = spread * i as u128 / n.max(1) as u128;
    let step = START_STEP.as_nanos();
    Duration::from_nanos((at / step * step) as u64)
}

#[derive(Debug, thiserror::Error)]
pub enum CheckError {
    #[error("no answer within {0:?}")]
    Timeout(Duration),
    #[error("connect: {0}")]
    Connect(std::io::Error),
    /// The probe could not run for want of a local resource; not the backend's fault.
    #[error("the check could not run here (a local shortage, not a backend failure): {0}")]
    Local(std::io::Error),
    #[error("http: {0}")]
    Http(String),
    #[error("status {got}, expected {expected}")]
    Status { got: u16, expected: u16 },
}

/// A failed connect: the backend's fault, or a shortage of ours (a socket could not be
/// made: descriptors, kernel memory, buffers, or no local port left).
pub fn connect_error(e: std::io::Error) -> CheckError {
    match e.raw_os_error() {
        Some(libc::EMFILE | libc::ENFILE | libc::ENOBUFS | libc::ENOMEM | libc::EADDRNOTAVAIL) => {
            CheckError::Local(e)
        }
        _ => CheckError::Connect(e),
    }
}

#[cfg(test)]
mod tests {
    use std::net::Ipv4Addr;

    use super::*;

    const LOCAL: IpAddr = IpAddr::V4(Ipv4Addr::LOCALHOST);
    const S: Duration = Duration::from_secs(1);

    fn cfg(rise: u32, fall: u32) -> HealthConfig {
        HealthConfig {
            rise,
            fall,
            ..HealthConfig::default()
        }
    }

    #[test]
    fn fall_failures_mark_down_and_rise_successes_mark_up() {
        let cfg = cfg(3, 2);
        let mut h = Health::new(Duration::ZERO, true);
        let mut kinds = Vec::new();
        // fail, ok (resets), fail, fail -> down; ok, ok, fail (resets), ok, ok, ok -> up
        let script = [
            false, true, false, false, true, true, false, true, true, true,
        ];
        for (i, ok) in script.into_iter().enumerate() {
            let r = if ok {
                Ok(())
            } else {
                Err(CheckError::Status {
                    got: 503,
                    expected: 200,
                })
            };
            if let Some(e) = h.record(i as u32 * S, &r, &cfg, "v", LOCAL) {
                kinds.push((i, e.kind, e.reason));
            }
        }
        assert_eq!(
            kinds,
            [
                (
                    3,
                    EventKind::Down,
                    "2 consecutive failed checks, last: status 503, expected 200".into()
                ),
                (9, EventKind::Up, "3 consecutive successful checks".into()),
            ]
        );
        assert!(h.up);
        assert_eq!(h.since, 9 * S);
    }

    /// A local shortage (out of descriptors: every check fails with EMFILE) is not a backend
    /// failure: marking every backend down would break every stream, so each stays as it is.
    #[test]
    fn local_shortages_are_not_backend_failures() {
        let cfg = cfg(1, 1);
        for errno in [
            libc::EMFILE,
            libc::ENFILE,
            libc::ENOBUFS,
            libc::ENOMEM,
            libc::EADDRNOTAVAIL,
        ] {
            let e = connect_error(std::io::Error::from_raw_os_error(errno));
            assert!(matches!(e, CheckError::Local(_)), "{errno}: {e}");
            assert!(
                e.to_string()
                    .contains("a local shortage, not a backend failure"),
                "{e}"
            );
            for up in [true, false] {
                let mut h = Health::new(Duration::ZERO, up);
                for i in 0..5 {
                    let r = Err(connect_error(std::io::Error::from_raw_os_error(errno)));
                    assert_eq!(h.record(i * S, &r, &cfg, "v", LOCAL), None);
                }
                assert_eq!((h.up, h.streak, h.since), (up, 0, Duration::ZERO));
            }
        }
        let refused = connect_error(std::io::Error::from_raw_os_error(libc::ECONNREFUSED));
        assert!(matches!(refused, CheckError::Connect(_)));
        let mut h = Health::new(Duration::ZERO, true);
        assert!(
            h.record(S, &Err(refused), &cfg, "v", LOCAL).is_some(),
            "a real failure counts"
        );
    }

    fn refused() -> Result<(), CheckError> {
        Err(CheckError::Connect(std::io::Error::from_raw_os_error(
            libc::ECONNREFUSED,
        )))
    }

    fn outcomes(n: u32, failing: impl Fn(u32) -> bool) -> Vec<Outcome> {
        (0..n)
            .map(|i| Outcome {
                key: ("v".into(), IpAddr::V4(Ipv4Addr::from(0x0a00_0000 + i))),
                healthy: true,
                result: if failing(i) { refused() } else { Ok(()) },
            })
            .collect()
    }

    /// A mass failure flips every failed backend in the same round, the `fall`th after it
    /// began (so within `interval × fall` of it), and the survivors not at all.
    #[test]
    fn a_mass_failure_is_decided_in_one_round() {
        let cfg = cfg(2, 2);
        let mut t = Trackers::default();
        assert!(t
            .round(Duration::ZERO, &outcomes(1000, |_| false), &cfg)
            .is_empty());
        let failing = |i| i >= 3;
        let first = t.round(cfg.interval, &outcomes(1000, failing), &cfg);
        assert!(first.is_empty(), "one failure is not a verdict");
        let second = t.round(2 * cfg.interval, &outcomes(1000, failing), &cfg);
        assert_eq!(second.len(), 997);
        assert!(second
            .iter()
            .all(|(i, e)| *i >= 3 && e.kind == EventKind::Down && e.at == 2 * cfg.interval));
        let mut after: Vec<Outcome> = outcomes(1000, failing);
        for o in after.iter_mut().skip(3) {
            o.healthy = false;
        }
        assert!(t.round(3 * cfg.interval, &after, &cfg).is_empty());
        // They come back after `rise` rounds of success, again together.
        assert!(t
            .round(4 * cfg.interval, &outcomes(1000, |_| false), &cfg)
            .is_empty());
        let up = t.round(5 * cfg.interval, &outcomes(1000, |_| false), &cfg);
        assert_eq!(up.len(), 997);
        assert!(up.iter().all(|(_, e)| e.kind == EventKind::Up));
    }

    /// A backend removed between rounds is forgotten; one added starts from its table state
    /// (a down one needs `rise` successes, not one).
    #[test]
    fn removed_backends_are_forgotten_and_new_ones_start_from_the_table() {
        let cfg = cfg(2, 2);
        let mut t = Trackers::default();
        t.round(Duration::ZERO, &outcomes(2, |i| i == 1), &cfg);
        assert_eq!(t.0.len(), 2);
        t.round(S, &outcomes(1, |_| false), &cfg);
        assert_eq!(t.0.len(), 1, "the removed backend's streak is gone");
        let mut back = outcomes(2, |i| i == 1);
        back[1].healthy = false;
        back[1].result = Ok(());
        assert!(t.round(2 * S, &back, &cfg).is_empty());
        assert_eq!(t.round(3 * S, &back, &cfg).len(), 1);
    }

    /// A round's starts spread evenly over `interval - timeout`: the last probe still has its
    /// whole timeout before the next round.
    #[test]
    fn probes_start_spread_over_the_interval_less_the_timeout() {
        let cfg = HealthConfig::default();
        let n = 4095;
        let starts: Vec<Duration> = (0..n).map(|i| offset(i, n, &cfg)).collect();
        assert_eq!(starts[0], Duration::ZERO);
        assert!(starts.windows(2).all(|w| w[0] <= w[1]));
        let last = starts[n - 1] + cfg.timeout;
        assert!(last < cfg.interval, "{last:?}");
        assert!(last >= cfg.interval - START_STEP, "{last:?}");
        assert!(starts
            .iter()
            .all(|s| s.as_nanos() % START_STEP.as_nanos() == 0));
        let distinct: BTreeSet<&Duration> = starts.iter().collect();
        assert_eq!(distinct.len(), 50, "one wake-up per step of the spread");
        assert_eq!(offset(0, 0, &cfg), Duration::ZERO);
    }
}
