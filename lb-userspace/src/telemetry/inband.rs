//! The `inband` telemetry source: time to first byte and delivery rate per backend, from the
//! data plane's `INBAND_STATS` (what the clients' ACKs say; see `lb-ebpf/src/inband.rs`).
//!
//! Pure: [`Tracker::observe`] takes cumulative counters and the time, keeps the deltas of the
//! last [`WINDOW`], and returns a sample part when the window holds enough answers to judge
//! ([`MIN_ANSWERS`]). Its staleness is its own: a backend that served no answer in the window
//! yields no part, and the hub leaves its last part out once older than `stale_after`. In-band
//! is never a *configured* source, so an idle backend does not go stale for lack of traffic.

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
    /// window holds at least [`MIN_ANSWERS`] answers. Counters that went backwards (the data
    /// plane was reloaded, the backend id reused) restart the window.
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
        let w = b
            .deltas
            .iter()
            .fold(InbandStats::default(), |acc, (_, d)| acc.merged(d));
        (w.first_bytes >= MIN_ANSWERS).then(|| Sample {
            ttfb_s: Some(units_to_secs(w.ttfb_units) / w.first_bytes as f64),
            delivery_bps: (w.stream_units > 0)
                .then(|| w.acked_bytes as f64 / units_to_secs(w.stream_units)),
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
        assert_eq!(
            t.observe(&key(), cum(3, 512, 3000, 1024), t0 + Duration::from_secs(1)),
            None,
            "3 answers are too few"
        );
        let s = t
            .observe(&key(), cum(4, 512, 4096, 1024), t0 + Duration::from_secs(2))
            .expect("4 answers");
        // 512 units = 2^29 ns = 0.536870912 s.
        assert_eq!(s.ttfb_s, Some(0.536_870_912));
        // 4096 bytes over 1024 units (1.073741824 s).
        assert_eq!(s.delivery_bps, Some(4096.0 / 1.073_741_824));
        assert_eq!(s.stalls, Some(0.0));
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
