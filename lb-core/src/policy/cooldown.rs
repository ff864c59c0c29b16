//! Per-backend move-away state: exponential cooldown and slow start.
//!
//! A move away starts a cooldown. It is `cooldown_base`, unless the backend moves away again
//! within `flap_window` of its last return (a flap): then it is twice the previous cooldown,
//! capped at `cooldown_max`. The previous cooldown decays back to `cooldown_base` once the
//! backend has stayed in rotation for `stable_period`. A backend returns only when its
//! cooldown is over (a saturation move's ends early once its load has passed:
//! [`MoveAway::end_early`]) and no condition holds, and then ramps up over `slow_start`,
//! unless it was out for saturation: its hardware is fine and its queue has drained, and a
//! 30-second ramp after a saturation move keeps a loaded fleet short of capacity until the
//! others saturate in turn.
//!
//! A backend out for congestion returns on probation instead, for [`PROBATION`]: ECN marks
//! and CNPs count the traffic a backend carries, so an emptied one reads clear whatever its
//! fabric does, and its clear reading at the end of the cooldown is no evidence. On probation
//! it takes a reduced share (the caller's level), which makes its readings mean something
//! again; congestion seen then sends it out with `cooldown_base` (the cause it could not show
//! while empty, not a flap: doubling the cooldown would keep it out long after its fabric has
//! cleared), and a probation without congestion ends at full weight (no ramp: it has been
//! serving). A second failed probation in a row doubles the cooldown as a flap does: the
//! fabric was seen congested with traffic on it, so probing it again soon would only churn. A
//! backend that kept a reduced share while out (its VIP had no headroom: [`super::HEADROOM`])
//! was never emptied: its clear reading is evidence, and it returns at full weight without
//! probation (a probation would hold it at a quarter of its weight while the others queue).

use std::time::Duration;

use crate::config::PolicyConfig;

use super::score::Reason;

/// How long a backend back from a congestion move stays on probation: time for a few sessions
/// at its reduced share (a session every 2 s or so) to show whether its fabric marks them.
pub const PROBATION: Duration = Duration::from_secs(5);

#[derive(Clone, Debug, PartialEq)]
pub enum Phase {
    /// Takes new sessions; ramping up since `ramp_from` while slow start lasts.
    InRotation { ramp_from: Option<Duration> },
    /// Weight 0 for new sessions; at least until `until`.
    MovedAway { until: Duration, reason: Reason },
}

/// What one update did.
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum Change {
    /// Moved away, cooling down for `cooldown`; `flap`: doubled by a recent return.
    Moved { cooldown: Duration, flap: bool },
    /// Back in rotation: ramping up, or on probation after congestion.
    Returned { probation: bool },
    /// Probation over without congestion: full weight.
    Cleared,
}

#[derive(Clone, Debug, PartialEq)]
/// A backend's move-away state: in rotation or moved away, its cooldown and its ramp.
pub struct MoveAway {
    pub phase: Phase,
    /// The last cooldown served, the base for doubling.
    cooldown: Duration,
    returned_at: Option<Duration>,
    /// On probation (see the module docs) until this time.
    probation: Option<Duration>,
    /// The last move was congestion seen on probation: another one in a row is a flap.
    probation_failed: bool,
}

impl MoveAway {
    /// `ramp_from`: start in slow start from this time (`None`: at full weight).
    pub fn new(ramp_from: Option<Duration>) -> Self {
        MoveAway {
            phase: Phase::InRotation { ramp_from },
            cooldown: Duration::ZERO,
            returned_at: None,
            probation: None,
            probation_failed: false,
        }
    }

    /// Whether the backend stays (or goes) out of rotation if nothing overrides it.
    pub fn wants_out(&self, now: Duration, trigger: Option<Reason>) -> bool {
        match self.phase {
            Phase::InRotation { .. } => trigger.is_some(),
            Phase::MovedAway { until, .. } => now < until || trigger.is_some(),
        }
    }

    /// `carrying`: it took new sessions at its last step (a reduced share while out).
    pub fn update(
        &mut self,
        now: Duration,
        trigger: Option<Reason>,
        carrying: bool,
        cfg: &PolicyConfig,
    ) -> Option<Change> {
        match (&self.phase, trigger) {
            (Phase::InRotation { .. }, Some(reason)) => {
                let since_return = self.returned_at.map(|r| now.saturating_sub(r));
                // The first congestion seen on probation is the cause an emptied backend could
                // not show, not a flap; a second in a row is: its fabric stays congested.
                let probed = self.probation.take().is_some() && reason == Reason::Congestion;
                let excused = probed && !self.probation_failed;
                self.probation_failed = probed;
                let flap = !excused && since_return.is_some_and(|d| d <= cfg.flap_window);
                let previous = match since_return {
                    Some(d) if d < cfg.stable_period => self.cooldown,
                    _ => cfg.cooldown_base,
                };
                self.cooldown = if flap {
                    (previous * 2).min(cfg.cooldown_max)
                } else {
                    cfg.cooldown_base
                };
                self.phase = Phase::MovedAway {
                    until: now + self.cooldown,
                    reason,
                };
                Some(Change::Moved {
                    cooldown: self.cooldown,
                    flap,
                })
            }
            (Phase::MovedAway { until, reason }, None) if now >= *until => {
                let probation = *reason == Reason::Congestion && !carrying;
                self.phase = Phase::InRotation {
                    ramp_from: (!matches!(reason, Reason::Congestion | Reason::Saturation))
                        .then_some(now),
                };
                self.probation = probation.then_some(now + PROBATION);
                self.returned_at = Some(now);
                Some(Change::Returned { probation })
            }
            (Phase::InRotation { .. }, None) if self.probation.is_some_and(|p| now >= p) => {
                self.probation = None;
                self.probation_failed = false;
                Some(Change::Cleared)
            }
            _ => None,
        }
    }

    /// Ends the cooldown of a move for `why` now, so the next update returns the backend: a
    /// saturation move whose load has passed (see [`Policy::trigger`](super::Policy) for
    /// when), an in-band move that did not help ([`super::harm`]). A move for any other
    /// reason keeps its cooldown: a fault's clear reading from an emptied backend is no
    /// evidence.
    pub fn end_early(&mut self, now: Duration, why: Reason) {
        if let Phase::MovedAway { until, reason } = &mut self.phase {
            if *reason == why {
                *until = (*until).min(now);
            }
        }
    }

    /// Health came back: ramp up like a return (a pending cooldown still applies).
    pub fn on_up(&mut self, now: Duration) {
        if let Phase::InRotation { ramp_from } = &mut self.phase {
            *ramp_from = Some(now);
        }
    }

    pub fn cooldown_left(&self, now: Duration) -> Duration {
        match self.phase {
            Phase::MovedAway { until, .. } => until.saturating_sub(now),
            Phase::InRotation { .. } => Duration::ZERO,
        }
    }

    /// The level allowed by slow start: linear from 1 to `target` over `slow_start`.
    pub fn ramp_level(&mut self, now: Duration, target: u32, cfg: &PolicyConfig) -> u32 {
        let Phase::InRotation { ramp_from } = &mut self.phase else {
            return 0;
        };
        let Some(from) = *ramp_from else {
            return target;
        };
        let elapsed = now.saturating_sub(from);
        if elapsed >= cfg.slow_start {
            *ramp_from = None;
            return target;
        }
        let steps =
            u128::from(target.saturating_sub(1)) * elapsed.as_nanos() / cfg.slow_start.as_nanos();
        (1 + steps as u32).min(target)
    }

    /// Ends a ramp at once (the VIP has no headroom to wait for it): `target`.
    pub fn skip_ramp(&mut self, target: u32) -> u32 {
        if let Phase::InRotation { ramp_from } = &mut self.phase {
            *ramp_from = None;
        }
        target
    }

    pub fn ramping(&self) -> bool {
        matches!(self.phase, Phase::InRotation { ramp_from: Some(_) })
    }

    pub fn on_probation(&self) -> bool {
        self.probation.is_some()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const S: Duration = Duration::from_secs(1);

    #[test]
    fn cooldown_doubles_on_flaps_caps_and_resets_after_stability() {
        let cfg = PolicyConfig::default(); // base 10s, max 600s, flap 300s, stable 120s
        let mut st = MoveAway::new(None);
        let mut t = Duration::ZERO;
        let mut served = Vec::new();
        for _ in 0..8 {
            match st.update(t, Some(Reason::Throttling), false, &cfg) {
                Some(Change::Moved { cooldown, .. }) => served.push(cooldown.as_secs()),
                other => panic!("{other:?}"),
            }
            t += st.cooldown_left(t);
            assert_eq!(
                st.update(t, None, false, &cfg),
                Some(Change::Returned { probation: false })
            );
            t += S;
        }
        assert_eq!(served, [10, 20, 40, 80, 160, 320, 600, 600]);
        // Stable for stable_period but within flap_window: decays to base, then doubles.
        t += cfg.stable_period;
        st.update(t, Some(Reason::Stale), false, &cfg);
        assert_eq!(st.cooldown_left(t), 2 * cfg.cooldown_base);
        t += st.cooldown_left(t);
        st.update(t, None, false, &cfg);
        // Past flap_window: not a flap.
        t += cfg.flap_window + S;
        assert_eq!(
            st.update(t, Some(Reason::Saturation), false, &cfg),
            Some(Change::Moved {
                cooldown: cfg.cooldown_base,
                flap: false
            })
        );
    }

    #[test]
    fn stays_away_until_cooldown_ends_and_signals_are_fine() {
        let cfg = PolicyConfig::default();
        let mut st = MoveAway::new(None);
        st.update(Duration::ZERO, Some(Reason::Throttling), false, &cfg);
        assert!(st.wants_out(5 * S, None));
        assert_eq!(st.update(5 * S, None, false, &cfg), None);
        assert_eq!(
            st.update(10 * S, Some(Reason::Throttling), false, &cfg),
            None
        );
        assert!(!st.wants_out(11 * S, None));
        assert_eq!(
            st.update(11 * S, None, false, &cfg),
            Some(Change::Returned { probation: false })
        );
    }

    #[test]
    fn no_ramp_after_saturation() {
        let cfg = PolicyConfig::default();
        let mut st = MoveAway::new(None);
        st.update(Duration::ZERO, Some(Reason::Saturation), false, &cfg);
        assert_eq!(
            st.update(10 * S, None, false, &cfg),
            Some(Change::Returned { probation: false })
        );
        assert!(!st.ramping());
        assert_eq!(st.ramp_level(10 * S, 7, &cfg), 7);
    }

    #[test]
    fn ramp_is_linear_from_one_level_to_target() {
        let cfg = PolicyConfig::default(); // slow_start 30s
        let mut st = MoveAway::new(Some(Duration::ZERO));
        let levels: Vec<u32> = [0, 5, 15, 29, 30, 31]
            .iter()
            .map(|&s| st.ramp_level(s * S, 7, &cfg))
            .collect();
        assert_eq!(levels, [1, 2, 4, 6, 7, 7]);
        assert!(!st.ramping());
    }
}
