//! In-band move-away: a backend whose time to first byte or delivery rate, as the clients'
//! own ACKs show them (the `inband` telemetry source), departs from its VIP's other backends
//! gets a [`Reason::Slow`] trigger, and goes through the usual cooldown like any other
//! reason. Peers, not thresholds: what a "slow" first byte is depends on the model and the
//! load, but a backend answering much later than the others under the same steering is slow.
//!
//! Compared at equal load: a continuous-batching engine streams each answer slower, and
//! answers later, the more streams it batches, and a source-hashed VIP gives backends
//! different shares. So a backend is only compared with the peers that carry at least as
//! much work as it does (in-band bytes per second, all streams: [`LOAD_SLACK`]). A backend
//! slower than peers that carry more is slow whatever its load; one slower than peers that
//! carry less may only be busier. Work, not streams in flight, is the measure: a slow
//! backend holds more streams for the same work, and would otherwise excuse itself.
//!
//! Slowness its load explains is not `slow`: a backend whose fresh load pressure is at a
//! threshold (a full KV cache preempts streams, a queue delays first bytes) is as slow as its
//! load makes it, and moving it away for that is saturation's business, with saturation's
//! rules about headroom (otherwise the backends that take a slow one's share fill up, stream
//! slower and are moved away as `slow` one after another). A gray failure is slowness the
//! exporters do not explain.
//!
//! Cross-check: a slow backend whose exporters explain nothing (no exporter trigger, and no
//! load signal at its threshold) is flagged once per episode with a
//! `telemetry-mismatch` event: its exporter says "fine" while its clients say "slow" (a
//! frozen or lying exporter, or a gray failure the exporters cannot see).

use std::{collections::BTreeSet, time::Duration};

use super::{EventKind, PolicyEvent, Reason, Trigger, Work};

/// Slow when the time to first byte is over this many times the peers' median...
pub const TTFB_FACTOR: f64 = 1.8;
/// ...and over it by at least this much (sub-second first bytes jitter by whole ticks).
pub const TTFB_MARGIN_S: f64 = 0.2;
/// Slow when the per-stream delivery rate is under the peers' median divided by this.
pub const DELIVERY_FACTOR: f64 = 1.8;
/// A peer is compared when it carries at least this fraction less work than the backend
/// judged: loads within it are equal (the windows' own noise).
pub const LOAD_SLACK: f64 = 0.1;

/// The median of `v`; None when empty.
pub(super) fn median(mut v: Vec<f64>) -> Option<f64> {
    if v.is_empty() {
        return None;
    }
    v.sort_by(f64::total_cmp);
    let n = v.len();
    Some(if n % 2 == 1 {
        v[n / 2]
    } else {
        (v[n / 2 - 1] + v[n / 2]) / 2.0
    })
}

/// Why `i` departs from its peers, if it does; needs two peers with in-band readings that
/// carry at least as much work.
/// How far: the factor by which it is slower than the median.
fn departs(work: &[Work], i: usize) -> Option<(f64, String)> {
    let me = &work[i];
    let sample = |w: &Work| w.input.telemetry.map(|t| t.sample.clone());
    let s = sample(me)?;
    // Where either load is unknown (a pushed sample without it) the peer is compared.
    let load = |w: &Work| w.input.telemetry.and_then(|t| t.sample.load_bps);
    let carries_as_much = |w: &Work| match (load(w), load(me)) {
        (Some(peer), Some(mine)) => peer >= (1.0 - LOAD_SLACK) * mine,
        _ => true,
    };
    let peers: Vec<&Work> = work
        .iter()
        .enumerate()
        .filter(|(j, w)| *j != i && w.input.vip == me.input.vip && w.eligible)
        .map(|(_, w)| w)
        .filter(|w| carries_as_much(w))
        .collect();
    let of = |f: fn(&crate::telemetry::Sample) -> Option<f64>| -> Vec<f64> {
        peers
            .iter()
            .filter_map(|w| sample(w).and_then(|s| f(&s)))
            .collect()
    };
    let ttfbs = of(|s| s.ttfb_s);
    if let (Some(t), true) = (s.ttfb_s, ttfbs.len() >= 2) {
        let m = median(ttfbs)?;
        if t > TTFB_FACTOR * m && t - m > TTFB_MARGIN_S {
            return Some((
                t / m,
                format!("in-band time to first byte {t:.3}s, peers' median {m:.3}s"),
            ));
        }
    }
    let rates = of(|s| s.delivery_bps);
    if let (Some(r), true) = (s.delivery_bps, rates.len() >= 2) {
        let m = median(rates)?;
        if r * DELIVERY_FACTOR < m {
            return Some((
                m / r,
                format!("in-band delivery {r:.0} B/s per stream, peers' median {m:.0} B/s"),
            ));
        }
    }
    None
}

/// Adds the `Slow` triggers, at most one per VIP (see [`one_per_vip`]); records a mismatch
/// event for each newly slow backend whose exporters explain nothing (`mismatched` holds the
/// backends flagged in this episode). `moved_slow` says whether a backend is moved away as
/// slow now.
pub(super) fn slow(
    now: Duration,
    work: &mut [Work],
    moved_slow: impl Fn(u32) -> bool,
    mismatched: &mut BTreeSet<u32>,
    events: &mut Vec<PolicyEvent>,
) {
    // Pressure is capped at 1: at 1 some load signal is at its threshold.
    let loaded = |w: &Work| w.pressure.is_some_and(|p| p >= 1.0);
    let departing: Vec<(usize, f64, String)> = (0..work.len())
        .filter(|&i| !loaded(&work[i]))
        .filter_map(|i| departs(work, i).map(|(far, d)| (i, far, d)))
        .collect();
    let found = one_per_vip(work, departing, moved_slow);
    let slow_ids: BTreeSet<u32> = found.iter().map(|(i, _)| work[*i].input.id).collect();
    mismatched.retain(|id| slow_ids.contains(id));
    for (i, detail) in found {
        let w = &mut work[i];
        if w.conditions.is_empty() && mismatched.insert(w.input.id) {
            events.push(PolicyEvent {
                at: now,
                kind: EventKind::TelemetryMismatch,
                vip: w.input.vip.to_owned(),
                backend: Some(w.input.address),
                reason: format!(
                    "exporter reports pressure {:.2} and no trigger, but {detail}",
                    w.pressure.unwrap_or(0.0)
                ),
                telemetry: w.input.telemetry.and_then(|t| serde_json::to_value(t).ok()),
            });
        }
        w.conditions.push(Trigger {
            reason: Reason::Slow,
            detail,
        });
    }
}

/// In-band compares peers with each other, so it can be wrong about several at once (load it
/// misreads, a client population that moved): it takes at most one backend of a VIP out at a
/// time. The one already out as slow keeps its trigger while it departs; otherwise the one
/// departing furthest gets it.
fn one_per_vip(
    work: &[Work],
    mut departing: Vec<(usize, f64, String)>,
    moved_slow: impl Fn(u32) -> bool,
) -> Vec<(usize, String)> {
    let out = |i: usize| moved_slow(work[i].input.id);
    departing.sort_by(|a, b| out(b.0).cmp(&out(a.0)).then(b.1.total_cmp(&a.1)));
    let mut vips = BTreeSet::new();
    let mut found = Vec::new();
    for (i, _, detail) in departing {
        if vips.insert(work[i].input.vip) {
            found.push((i, detail));
        }
    }
    // A VIP whose slow backend is out but no longer departs (its streams ended) stays
    // budgeted until it is back: the others are judged while its share is on them.
    found.retain(|&(i, _)| {
        let vip = work[i].input.vip;
        out(i) || !(0..work.len()).any(|j| j != i && work[j].input.vip == vip && out(j))
    });
    found.sort_by_key(|&(i, _)| i);
    found
}

#[cfg(test)]
mod tests {
    use std::net::{IpAddr, Ipv4Addr};

    use super::super::{BackendInput, Policy, SteerState};
    use super::*;
    use crate::{
        config::PolicyConfig,
        telemetry::{BackendTelemetry, Sample},
    };

    const S: Duration = Duration::from_secs(1);

    /// An exporter that reports a moderately busy backend, plus in-band readings.
    fn view(ttfb_s: Option<f64>, delivery_bps: Option<f64>) -> BackendTelemetry {
        BackendTelemetry {
            sample: Sample {
                gpu_util: Some(0.6),
                queue_depth: Some(1.0),
                kv_cache: Some(0.4),
                ttfb_s,
                delivery_bps,
                ..Sample::default()
            },
            age: Some(Duration::from_millis(200)),
            stale: false,
            errors: Vec::new(),
        }
    }

    /// In-band readings of a backend carrying `load_bps`.
    fn loaded(ttfb_s: f64, delivery_bps: f64, load_bps: f64) -> BackendTelemetry {
        let mut v = view(Some(ttfb_s), Some(delivery_bps));
        v.sample.load_bps = Some(load_bps);
        v
    }

    /// A source-hashed VIP gives its backends uneven shares, and a batching engine streams
    /// each answer slower and later the more it carries: the busiest backend reads 2x slower
    /// than its peers' median, and is not slow. The same reading at equal load is.
    #[test]
    fn slowness_is_judged_against_peers_carrying_as_much() {
        let mut p = Policy::new(PolicyConfig::default());
        let uneven = [
            loaded(1.2, 4000.0, 300_000.0),
            loaded(0.6, 7000.0, 200_000.0),
            loaded(0.5, 8000.0, 150_000.0),
            loaded(0.4, 10_000.0, 100_000.0),
        ];
        for t in 0..30 {
            let d = step(&mut p, t * S, &uneven);
            assert!(
                d.backends.iter().all(|b| b.reason.is_none()),
                "at {t} s: {:?}",
                d.events
            );
        }
        let gray = [
            loaded(1.2, 4000.0, 195_000.0),
            loaded(0.6, 7000.0, 200_000.0),
            loaded(0.5, 8000.0, 205_000.0),
            loaded(0.4, 10_000.0, 190_000.0),
        ];
        let d = step(&mut p, 30 * S, &gray);
        assert_eq!(
            (d.backends[0].state, d.backends[0].reason),
            (SteerState::MovedAway, Some(Reason::Slow))
        );
        assert!(
            d.events.iter().any(|e| e
                .reason
                .contains("in-band time to first byte 1.200s, peers' median 0.500s")),
            "{:?}",
            d.events
        );
    }

    /// Two backends read slow at once: the furthest goes, and the other stays in while it is
    /// out (in-band takes one backend of a VIP out at a time); the second goes only once the
    /// first is back.
    #[test]
    fn in_band_takes_one_backend_of_a_vip_out_at_a_time() {
        let mut p = Policy::new(PolicyConfig::default());
        let two_slow = [
            loaded(0.4, 2500.0, 200_000.0),
            loaded(0.4, 3500.0, 200_000.0),
            loaded(0.4, 8000.0, 200_000.0),
            loaded(0.4, 8000.0, 200_000.0),
        ];
        let out = |d: &super::super::Decisions| -> Vec<usize> {
            (0..4)
                .filter(|&i| d.backends[i].state == SteerState::MovedAway)
                .collect()
        };
        for t in 0..20 {
            let d = step(&mut p, t * S, &two_slow);
            assert_eq!(out(&d), [0], "at {t} s");
        }
        // The first one's streams end (no reading): it returns (its cooldown is over), and
        // then the second one may go.
        let first_quiet = [
            view(None, None),
            loaded(0.4, 3500.0, 200_000.0),
            loaded(0.4, 8000.0, 200_000.0),
            loaded(0.4, 8000.0, 200_000.0),
        ];
        let mut seen = Vec::new();
        // Until the second move's effect is judged (readings that stay put show none).
        for t in 20..40 {
            let d = step(&mut p, t * S, &first_quiet);
            let o = out(&d);
            assert!(o.len() <= 1, "at {t} s: {o:?}");
            if seen.last() != Some(&o) {
                seen.push(o);
            }
        }
        assert_eq!(
            seen,
            [vec![], vec![1]],
            "the first back, then the second out"
        );
    }

    fn step(p: &mut Policy, now: Duration, views: &[BackendTelemetry]) -> super::super::Decisions {
        let inputs: Vec<BackendInput> = views
            .iter()
            .enumerate()
            .map(|(i, t)| BackendInput {
                vip: "chat",
                address: IpAddr::V4(Ipv4Addr::new(10, 0, 0, i as u8 + 1)),
                id: i as u32 + 1,
                weight: 100,
                class: 0,
                healthy: true,
                sessions: 10,
                max_sessions: 0,
                telemetry: Some(t),
                handshakes: None,
            })
            .collect();
        p.step(now, &inputs)
    }

    fn kinds(d: &super::super::Decisions) -> Vec<EventKind> {
        d.events.iter().map(|e| e.kind).collect()
    }

    #[test]
    fn a_backend_answering_late_is_moved_away_and_its_exporter_flagged_once() {
        let cfg = PolicyConfig::default();
        let mut p = Policy::new(cfg.clone());
        let fast = view(Some(0.5), Some(2000.0));
        let healthy = [fast.clone(), fast.clone(), fast.clone(), fast.clone()];
        for t in 0..5 {
            let d = step(&mut p, t * S, &healthy);
            assert!(
                d.events.is_empty(),
                "peers alike: nothing happens ({:?})",
                d.events
            );
        }
        // Backend 4 answers 3x later; its exporter still says what it said.
        let gray = [
            fast.clone(),
            fast.clone(),
            fast.clone(),
            view(Some(1.5), Some(1900.0)),
        ];
        let d = step(&mut p, 5 * S, &gray);
        let b = &d.backends[3];
        assert_eq!((b.weight, b.state), (0, SteerState::MovedAway));
        assert_eq!(b.reason, Some(Reason::Slow));
        assert_eq!(b.cooldown_left, cfg.cooldown_base);
        assert_eq!(
            kinds(&d),
            [
                EventKind::TelemetryMismatch,
                EventKind::Reroute,
                EventKind::CooldownStart,
                EventKind::WeightChange
            ]
        );
        assert!(
            d.events[0]
                .reason
                .contains("in-band time to first byte 1.500s, peers' median 0.500s"),
            "{}",
            d.events[0].reason
        );
        // Still slow next step: no second mismatch event in the same episode.
        let d = step(&mut p, 6 * S, &gray);
        assert!(!kinds(&d).contains(&EventKind::TelemetryMismatch));
        // Moved away, its streams in flight still stream slowly: it stays out past its
        // cooldown (10 s) while they say so.
        for t in 7..25 {
            let d = step(&mut p, t * S, &gray);
            assert_eq!(d.backends[3].state, SteerState::MovedAway, "at {t} s");
        }
        // They end: its in-band part ages out (no reading), and it comes back.
        let quiet = [fast.clone(), fast.clone(), fast.clone(), view(None, None)];
        let back = (25..60)
            .map(|t| step(&mut p, t * S, &quiet))
            .find(|d| kinds(d).contains(&EventKind::Recover));
        assert!(back.is_some(), "recovered after the cooldown");
    }

    #[test]
    fn a_slow_delivery_rate_is_slow_too_and_one_peer_is_not_enough() {
        let mut p = Policy::new(PolicyConfig::default());
        let ok = view(Some(0.5), Some(2000.0));
        let d = step(
            &mut p,
            S,
            &[ok.clone(), ok.clone(), view(Some(0.5), Some(800.0))],
        );
        assert_eq!(d.backends[2].reason, Some(Reason::Slow));
        assert!(
            d.events[0].reason.contains("in-band delivery 800 B/s"),
            "{:?}",
            d.events
        );
        // With one peer there is no majority to depart from.
        let mut p = Policy::new(PolicyConfig::default());
        let d = step(&mut p, S, &[ok.clone(), view(Some(5.0), Some(10.0))]);
        assert_eq!(d.backends[1].reason, None);
    }

    #[test]
    fn slowness_its_load_explains_is_not_slow() {
        let mut p = Policy::new(PolicyConfig::default());
        let ok = view(Some(0.5), Some(2000.0));
        // Its KV cache at the threshold (0.8): its streams are preempted and slow.
        let mut full = view(Some(0.5), Some(700.0));
        full.sample.kv_cache = Some(0.85);
        let d = step(&mut p, S, &[ok.clone(), ok.clone(), ok.clone(), full]);
        assert_eq!(d.backends[3].reason, None, "{:?}", d.events);
        assert!(d.events.is_empty(), "{:?}", d.events);
        // The same delivery with an exporter reading under every threshold is slow.
        let d = step(
            &mut p,
            2 * S,
            &[
                ok.clone(),
                ok.clone(),
                ok.clone(),
                view(Some(0.5), Some(700.0)),
            ],
        );
        assert_eq!(d.backends[3].reason, Some(Reason::Slow));
        assert_eq!(d.backends[3].state, SteerState::MovedAway);
    }

    #[test]
    fn small_absolute_differences_are_not_slow() {
        let mut p = Policy::new(PolicyConfig::default());
        let ok = view(Some(0.05), None);
        // 0.15 s is 3x the peers' 0.05 s but only 0.1 s later: jitter, not a slow backend.
        let d = step(&mut p, S, &[ok.clone(), ok.clone(), view(Some(0.15), None)]);
        assert!(d.events.is_empty(), "{:?}", d.events);
    }
}
