//! The `inband` telemetry source: time to first byte and delivery rate per backend, from the
//! data plane's `INBAND_STATS` (what the clients' ACKs say; see `lb-ebpf/src/inband.rs`).
//!
//! Pure: [`Tracker::observe`] takes cumulative counters and the time, keeps the deltas of the
//! last [`WINDOW`], and returns a sample part with what the deltas are enough to judge: the
//! time to first byte when the window holds [`MIN_ANSWERS`] answers, the delivery rate when
//! the last [`DELIVERY_WINDOW`] holds [`MIN_STREAM_S`] of streaming. The delivery rate has
//! the shorter window because it is what shows a slowdown first: every stream in flight slows
//! at once, while new answers arrive a few a second (an 8 s window of answers takes most of
//! its length to show a 2.5x slowdown), and it needs no new answer, so a backend moved away
//! keeps showing what its last streams see. Its staleness is its own: a backend that streamed
//! and answered nothing in the windows yields no part, and the hub leaves its last part out
//! once older than `stale_after`. In-band is never a *configured* source, so an idle backend
//! does not go stale for lack of traffic.

use std::{
    collections::{BTreeMap, VecDeque},
    time::{Duration, Instant},
};

use lb_common::{InbandStats, INBAND_TIME_SHIFT};

use super::{BackendKey, Sample};

/// The span of deltas a part is computed over: long enough for a few answers per backend at
/// lab load, short enough that a slowdown shows within a few control steps.
pub const WINDOW: Duration = Duration::from_secs(8);
/// Answers (first bytes) a window needs before its time to first byte is evidence.
pub const MIN_ANSWERS: u64 = 4;
/// The span the delivery rate is computed over: the last two control steps.
pub const DELIVERY_WINDOW: Duration = Duration::from_secs(2);
/// Streaming time (summed over the backend's flows) the delivery window needs before its rate
/// is evidence: a few streams for a fraction of a second each is not a rate yet.
pub const MIN_STREAM_S: f64 = 1.0;

/// Seconds in `units` in-band time units (2^20 ns).
pub fn units_to_secs(units: u64) -> f64 {
    (units << INBAND_TIME_SHIFT) as f64 / 1e9
}

#[derive(Debug, Default)]
struct Backend {
    last: Option<InbandStats>,
    deltas: VecDeque<(Instant, InbandStats)>,
}

/// Per-backend windows of in-band deltas.
#[derive(Debug, Default)]
pub struct Tracker {
    backends: BTreeMap<BackendKey, Backend>,
}

fn minus(a: &InbandStats, b: &InbandStats) -> InbandStats {
    let mut d = InbandStats {
        requests: a.requests.saturating_sub(b.requests),
        first_bytes: a.first_bytes.saturating_sub(b.first_bytes),
        ttfb_units: a.ttfb_units.saturating_sub(b.ttfb_units),
        acked_bytes: a.acked_bytes.saturating_sub(b.acked_bytes),
        stream_units: a.stream_units.saturating_sub(b.stream_units),
        stalls: a.stalls.saturating_sub(b.stalls),
        ..InbandStats::default()
    };
    for (i, h) in d.ttfb_hist.iter_mut().enumerate() {
        *h = a.ttfb_hist[i].saturating_sub(b.ttfb_hist[i]);
    }
    d
}

impl Tracker {
    /// Records `key`'s cumulative counters at `now`; returns the part for the hub when the
    /// windows hold enough to judge (see the module docs). Counters that went backwards (the
    /// data plane was reloaded, the backend id reused) restart the window.
    pub fn observe(&mut self, key: &BackendKey, cur: InbandStats, now: Instant) -> Option<Sample> {
        let b = self.backends.entry(key.clone()).or_default();
        let back = b
            .last
            .is_some_and(|l| cur.requests < l.requests || cur.acked_bytes < l.acked_bytes);
        if back {
            b.deltas.clear();
        } else if let Some(l) = &b.last {
            b.deltas.push_back((now, minus(&cur, l)));
        }
        b.last = Some(cur);
        while b
            .deltas
            .front()
            .is_some_and(|(at, _)| now.saturating_duration_since(*at) > WINDOW)
        {
            b.deltas.pop_front();
        }
        let sum = |span: Duration| {
            b.deltas
                .iter()
                // A delta covers the step before it: `span` holds the deltas younger than it.
                .filter(|(at, _)| now.saturating_duration_since(*at) < span)
                .fold(InbandStats::default(), |acc, (_, d)| acc.merged(d))
        };
        let w = sum(WINDOW);
        let recent = sum(DELIVERY_WINDOW);
        let ttfb_s = (w.first_bytes >= MIN_ANSWERS)
            .then(|| units_to_secs(w.ttfb_units) / w.first_bytes as f64);
        let streamed = units_to_secs(recent.stream_units);
        let delivery_bps = (streamed >= MIN_STREAM_S).then(|| recent.acked_bytes as f64 / streamed);
        (ttfb_s.is_some() || delivery_bps.is_some()).then(|| Sample {
            ttfb_s,
            delivery_bps,
            load_bps: Some(w.acked_bytes as f64 / WINDOW.as_secs_f64()),
            stalls: Some(w.stalls as f64),
            ..Sample::default()
        })
    }

    /// Forgets the backends for which `keep` is false.
    pub fn retain(&mut self, mut keep: impl FnMut(&BackendKey) -> bool) {
        self.backends.retain(|k, _| keep(k));
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn key() -> BackendKey {
        ("chat".into(), "10.0.0.1".parse().unwrap())
    }

    /// Cumulative counters after `answers` answers of `ttfb_units` each and `bytes` over
    /// `stream_units`.
    fn cum(answers: u64, ttfb_units: u64, bytes: u64, stream_units: u64) -> InbandStats {
        InbandStats {
            requests: answers,
            first_bytes: answers,
            ttfb_units: answers * ttfb_units,
            acked_bytes: bytes,
            stream_units,
            ..InbandStats::default()
        }
    }

    #[test]
    fn a_window_with_enough_answers_gives_ttfb_and_delivery() {
        let t0 = Instant::now();
        let mut t = Tracker::default();
        assert_eq!(t.observe(&key(), cum(0, 0, 0, 0), t0), None, "no delta yet");
        let s = t
            .observe(&key(), cum(3, 512, 3000, 1024), t0 + Duration::from_secs(1))
            .expect("a second of streaming");
        assert_eq!(s.ttfb_s, None, "3 answers are too few");
        let s = t
            .observe(&key(), cum(4, 512, 4096, 1024), t0 + Duration::from_secs(2))
            .expect("4 answers");
        // 512 units = 2^29 ns = 0.536870912 s.
        assert_eq!(s.ttfb_s, Some(0.536_870_912));
        // 4096 bytes over 1024 units (1.073741824 s).
        assert_eq!(s.delivery_bps, Some(4096.0 / 1.073_741_824));
        // The work carried: every byte acknowledged in the window, per second of it.
        assert_eq!(s.load_bps, Some(4096.0 / 8.0));
        assert_eq!(s.stalls, Some(0.0));
    }

    #[test]
    fn the_delivery_rate_needs_no_answer_and_follows_the_last_two_seconds() {
        let t0 = Instant::now();
        let at = |s: u64| t0 + Duration::from_secs(s);
        // 1024 units of streaming per second (1.07 s summed over the flows).
        let mut t = Tracker::default();
        t.observe(&key(), cum(0, 0, 0, 0), t0);
        let s = t
            .observe(&key(), cum(0, 0, 4000, 1024), at(1))
            .expect("a second of streaming is a rate without any answer");
        assert_eq!(
            (s.ttfb_s, s.delivery_bps),
            (None, Some(4000.0 / 1.073_741_824))
        );
        t.observe(&key(), cum(0, 0, 8000, 2048), at(2));
        // The backend slows to 0.4x: two seconds later the rate is all slow, while an 8 s
        // window would still be mostly the fast part.
        t.observe(&key(), cum(0, 0, 9600, 3072), at(3));
        let s = t
            .observe(&key(), cum(0, 0, 11200, 4096), at(4))
            .expect("streaming");
        assert_eq!(s.delivery_bps, Some(3200.0 / 2.147_483_648));
        // Half a second of streaming in the last two seconds is too little to judge.
        t.observe(&key(), cum(0, 0, 11300, 4352), at(5));
        assert_eq!(t.observe(&key(), cum(0, 0, 11400, 4608), at(6)), None);
    }

    #[test]
    fn old_deltas_leave_the_window() {
        let t0 = Instant::now();
        let mut t = Tracker::default();
        t.observe(&key(), cum(0, 0, 0, 0), t0);
        assert!(t
            .observe(&key(), cum(10, 100, 0, 0), t0 + Duration::from_secs(1))
            .is_some());
        // Nine seconds later nothing new: the window is empty, no part.
        assert_eq!(
            t.observe(&key(), cum(10, 100, 0, 0), t0 + Duration::from_secs(10)),
            None
        );
    }

    #[test]
    fn counters_going_back_restart_the_window() {
        let t0 = Instant::now();
        let mut t = Tracker::default();
        t.observe(&key(), cum(100, 100, 0, 0), t0);
        assert_eq!(
            t.observe(&key(), cum(5, 100, 0, 0), t0 + Duration::from_secs(1)),
            None,
            "a reload is no burst of negative answers"
        );
        assert!(t
            .observe(&key(), cum(9, 100, 0, 0), t0 + Duration::from_secs(2))
            .is_some());
    }
}
