//! Do no harm: a backend moved away as [`Reason::Slow`] was judged by comparing it with its
//! peers, a comparison that load or a change in the client mix can mislead. So the move is
//! checked against its own effect: [`VERDICT_AFTER`] later, the VIP's delivery rate per
//! stream (all its backends' streams together) must have risen by [`GAIN`]. Moving a slow
//! backend's share onto healthy ones does that, as its slow streams end; moving a healthy
//! backend's share onto its peers does not, since they now batch more and stream slower.
//!
//! A move that fails the check is undone at once (the backend returns through slow start)
//! and held: no in-band move of that backend for [`HOLD_BASE`], doubled by each undo within
//! the hold's reach, up to `cooldown_max`. Exporter triggers are not held: the exporters'
//! evidence is about the backend itself, not a comparison.

use std::{collections::BTreeMap, time::Duration};

use super::{EventKind, PolicyEvent, Reason, Work};
use crate::config::PolicyConfig;

/// How long after an in-band move its effect is judged: long enough for the moved share's
/// new streams to be batched elsewhere and for the delivery window to hold them.
pub const VERDICT_AFTER: Duration = Duration::from_secs(20);
/// The rise in the VIP's delivery rate a move must show to stand.
pub const GAIN: f64 = 0.05;
/// The first hold after an undone move.
pub const HOLD_BASE: Duration = Duration::from_secs(60);

/// The checks of in-band moves, and the holds of the undone ones, by backend id.
#[derive(Debug, Default)]
pub(super) struct Checks {
    moves: BTreeMap<u32, Check>,
    holds: BTreeMap<u32, Hold>,
}

#[derive(Clone, Copy, Debug)]
enum Check {
    /// Moved at `at`, when its VIP delivered `before` (None: nothing to compare).
    Pending { at: Duration, before: Option<f64> },
    /// Judged and kept: nothing more to check in this episode.
    Kept,
}

#[derive(Debug)]
struct Hold {
    until: Duration,
    /// The next hold, should this one's backend be undone again.
    next: Duration,
}

/// The VIP's delivery rate per stream: bytes per second over the seconds its streams spent
/// streaming, from each backend's load (bytes per second) and per-stream rate.
pub(super) fn vip_delivery(work: &[Work], vip: &str) -> Option<f64> {
    let (mut bytes, mut streams) = (0.0, 0.0);
    for w in work.iter().filter(|w| w.input.vip == vip && w.eligible) {
        let s = match w.input.telemetry {
            Some(t) => &t.sample,
            None => continue,
        };
        if let (Some(load), Some(rate)) = (s.load_bps, s.delivery_bps) {
            if rate > 0.0 {
                bytes += load;
                streams += load / rate;
            }
        }
    }
    (streams > 0.0).then(|| bytes / streams)
}

impl Checks {
    /// Judges the in-band moves due at `now`: returns the backends (indexes into `work`) whose
    /// move is undone, with the events that say why, and holds them. `moved_slow` says
    /// whether a backend is out as slow now.
    pub(super) fn judge(
        &mut self,
        now: Duration,
        work: &[Work],
        moved_slow: impl Fn(u32) -> bool,
        cfg: &PolicyConfig,
        events: &mut Vec<PolicyEvent>,
    ) -> Vec<usize> {
        self.moves.retain(|id, _| moved_slow(*id));
        self.holds.retain(|_, h| now < h.until + cfg.stable_period);
        let mut undone = Vec::new();
        for (i, w) in work.iter().enumerate() {
            let id = w.input.id;
            let Some(&Check::Pending { at, before }) = self.moves.get(&id) else {
                continue;
            };
            if now < at + VERDICT_AFTER {
                continue;
            }
            let after = vip_delivery(work, w.input.vip);
            let improved = match (before, after) {
                (Some(before), Some(after)) => after >= before * (1.0 + GAIN),
                // Nothing to compare: no evidence of harm.
                _ => true,
            };
            if improved {
                self.moves.insert(id, Check::Kept);
                continue;
            }
            let next = self.holds.get(&id).map_or(HOLD_BASE, |h| h.next);
            self.holds.insert(
                id,
                Hold {
                    until: now + next,
                    next: (next * 2).min(cfg.cooldown_max.max(HOLD_BASE)),
                },
            );
            self.moves.remove(&id);
            events.push(PolicyEvent {
                at: now,
                kind: EventKind::Recover,
                vip: w.input.vip.to_owned(),
                backend: Some(w.input.address),
                reason: format!(
                    "moving it away as slow did not help: its VIP delivered {} per stream \
                     before, {} after; back now, and not moved as slow again for {next:?}",
                    rate(before),
                    rate(after)
                ),
                telemetry: None,
            });
            undone.push(i);
        }
        undone
    }

    /// Drops the `Slow` conditions of held backends.
    pub(super) fn hold(&self, now: Duration, work: &mut [Work]) {
        for w in work.iter_mut() {
            if self.holds.get(&w.input.id).is_some_and(|h| now < h.until) {
                w.conditions.retain(|t| t.reason != Reason::Slow);
            }
        }
    }

    /// Starts the check of each backend moved away as slow at this step.
    pub(super) fn moved(&mut self, now: Duration, id: u32, before: Option<f64>) {
        self.moves
            .entry(id)
            .or_insert(Check::Pending { at: now, before });
    }
}

fn rate(r: Option<f64>) -> String {
    r.map_or_else(|| "nothing".to_owned(), |r| format!("{r:.0} B/s"))
}
