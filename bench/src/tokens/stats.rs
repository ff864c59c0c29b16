//! The load generator's statistics, pure: percentiles, the summary of a run's records,
//! affinity counting and KV imbalance.

use std::collections::BTreeMap;

use serde::Serialize;

use super::Record;

/// p50/p90/p99/p99.9 by nearest rank; `None` fields when there is no sample.
#[derive(Clone, Debug, Default, PartialEq, Serialize)]
pub struct Percentiles {
    pub count: usize,
    pub p50: Option<f64>,
    pub p90: Option<f64>,
    pub p99: Option<f64>,
    #[serde(rename = "p99.9")]
    pub p99_9: Option<f64>,
    pub max: Option<f64>,
    pub mean: Option<f64>,
}

/// The nearest-rank `q`-quantile (0 < q <= 1) of a sorted slice.
pub fn nearest_rank(sorted: &[f64], q: f64) -> Option<f64> {
    (!sorted.is_empty()).then(|| sorted[rank(sorted.len(), q) - 1])
}

/// The 1-based nearest rank of the `q`-quantile among `n` > 0 values.
fn rank(n: usize, q: f64) -> usize {
    ((q * n as f64).ceil() as usize).clamp(1, n)
}

impl Percentiles {
    pub fn of(values: &[f64]) -> Percentiles {
        let mut v: Vec<f64> = values.iter().copied().filter(|x| x.is_finite()).collect();
        v.sort_by(f64::total_cmp);
        let q = |q| nearest_rank(&v, q).map(r3);
        Percentiles {
            count: v.len(),
            p50: q(0.5),
            p90: q(0.9),
            p99: q(0.99),
            p99_9: q(0.999),
            max: v.last().copied().map(r3),
            mean: (!v.is_empty()).then(|| r3(v.iter().sum::<f64>() / v.len() as f64)),
        }
    }
}

/// Rounded to microseconds when the unit is ms: enough for latencies, short in JSON.
pub fn r3(x: f64) -> f64 {
    (x * 1000.0).round() / 1000.0
}

/// Turns of a conversation after its first, and how many landed on the first turn's backend.
/// Turns whose backend is unknown (no answer) and conversations whose first turn has none
/// are not counted.
#[derive(Clone, Debug, Default, PartialEq, Serialize)]
pub struct Affinity {
    pub later_turns: u64,
    pub kept: u64,
    pub fraction: Option<f64>,
}

pub fn affinity(records: &[Record]) -> Affinity {
    // conversation -> (turn, backend), to find each conversation's first turn.
    let mut by_conv: BTreeMap<u64, Vec<(u32, &str)>> = BTreeMap::new();
    for r in records {
        if let Some(b) = r.backend.as_deref() {
            by_conv.entry(r.conversation).or_default().push((r.turn, b));
        }
    }
    let mut a = Affinity::default();
    for mut turns in by_conv.into_values() {
        turns.sort();
        let (first_turn, first) = turns[0];
        if first_turn != 0 {
            continue;
        }
        for &(_, b) in &turns[1..] {
            a.later_turns += 1;
            a.kept += (b == first) as u64;
        }
    }
    a.fraction = (a.later_turns > 0).then(|| a.kept as f64 / a.later_turns as f64);
    a
}

/// Imbalance of KV use over time: the mean over sampling instants of max/mean of the
/// backends' KV use, skipping instants where every backend is empty. 1.0 is perfect balance.
pub fn imbalance(samples: &[Vec<f64>]) -> Option<f64> {
    let ratios: Vec<f64> = samples
        .iter()
        .filter(|s| !s.is_empty())
        .filter_map(|s| {
            let mean = s.iter().sum::<f64>() / s.len() as f64;
            let max = s.iter().copied().fold(f64::NEG_INFINITY, f64::max);
            (mean > 0.0).then(|| max / mean)
        })
        .collect();
    (!ratios.is_empty()).then(|| r3(ratios.iter().sum::<f64>() / ratios.len() as f64))
}

/// One backend's share of a run.
#[derive(Clone, Debug, Default, PartialEq, Serialize)]
pub struct BackendSummary {
    /// Requests answered by it.
    pub sessions: u64,
    pub completed: u64,
    pub broken: u64,
    /// Tokens of every stream it answered, completed or not.
    pub tokens: u64,
    pub tokens_per_s: f64,
    pub ttft_ms: Percentiles,
    pub itl_ms: Percentiles,
    /// Its streams' gaps longer than the run's p99 ITL: where the run's slowest 1% came
    /// from (a slow accelerator's streams, or steps carrying prefill on a busy one).
    pub itl_gaps_over_run_p99: usize,
}

/// The figures of a run, from its records and its wall time.
#[derive(Clone, Debug, Default, PartialEq, Serialize)]
pub struct Summary {
    pub requests: u64,
    pub completed: u64,
    pub broken: u64,
    pub broken_by_reason: BTreeMap<String, u64>,
    pub ttft_ms: Percentiles,
    /// Gaps between successive chunks of a stream (a chunk may carry several tokens when
    /// they arrive together), over all streams.
    pub itl_ms: Percentiles,
    pub e2e_ms: Percentiles,
    pub tokens: u64,
    /// Tokens of completed streams per second of the run.
    pub goodput_tokens_per_s: f64,
    pub backends: BTreeMap<String, BackendSummary>,
    pub affinity: Affinity,
    /// Requests tried more than once (refused, then retried), and their retries in all.
    pub requests_retried: u64,
    pub retries: u64,
}

/// `gaps[i]` holds `records[i]`'s inter-chunk gaps (ms), `elapsed_s` the run's wall time.
pub fn summarise(records: &[Record], gaps: &[Vec<f64>], elapsed_s: f64) -> Summary {
    let mut s = Summary {
        requests: records.len() as u64,
        ..Summary::default()
    };
    let mut ttft = Vec::new();
    let mut e2e = Vec::new();
    let mut good_tokens = 0u64;
    let mut backend_ttft: BTreeMap<String, Vec<f64>> = BTreeMap::new();
    let mut backend_gaps: BTreeMap<String, Vec<f64>> = BTreeMap::new();
    for (r, g) in records.iter().zip(gaps) {
        s.tokens += r.tokens as u64;
        let retries = u64::from(r.attempts.saturating_sub(1));
        s.requests_retried += u64::from(retries > 0);
        s.retries += retries;
        match &r.broken {
            None => {
                s.completed += 1;
                good_tokens += r.tokens as u64;
                if let Some(e) = r.e2e_ms {
                    e2e.push(e);
                }
            }
            Some(why) => {
                s.broken += 1;
                *s.broken_by_reason.entry(why.clone()).or_default() += 1;
            }
        }
        if let Some(t) = r.ttft_ms {
            ttft.push(t);
        }
        if let Some(b) = &r.backend {
            let e = s.backends.entry(b.clone()).or_default();
            e.sessions += 1;
            e.tokens += r.tokens as u64;
            if r.broken.is_none() {
                e.completed += 1;
            } else {
                e.broken += 1;
            }
            if let Some(t) = r.ttft_ms {
                backend_ttft.entry(b.clone()).or_default().push(t);
            }
            backend_gaps.entry(b.clone()).or_default().extend(g);
        }
    }
    let all_gaps: Vec<f64> = gaps.concat();
    s.itl_ms = Percentiles::of(&all_gaps);
    let per_s = |n: u64| {
        if elapsed_s > 0.0 {
            r3(n as f64 / elapsed_s)
        } else {
            0.0
        }
    };
    for (name, b) in s.backends.iter_mut() {
        b.tokens_per_s = per_s(b.tokens);
        b.ttft_ms = Percentiles::of(backend_ttft.get(name).map_or(&[][..], |v| v));
        let g = backend_gaps.get(name).map_or(&[][..], |v| v);
        b.itl_ms = Percentiles::of(g);
        b.itl_gaps_over_run_p99 = s
            .itl_ms
            .p99
            .map_or(0, |p| g.iter().filter(|&&x| x > p).count());
    }
    s.ttft_ms = Percentiles::of(&ttft);
    s.e2e_ms = Percentiles::of(&e2e);
    s.goodput_tokens_per_s = per_s(good_tokens);
    s.affinity = affinity(records);
    s
}

/// What one backend's streams in flight at a moment (a fault's start) sent after it.
#[derive(Clone, Debug, Default, PartialEq, Serialize)]
pub struct InFlight {
    /// Streams started before the mark that sent a chunk after it.
    pub streams: u64,
    /// Their gaps that ended after the mark.
    pub gaps_after: usize,
    /// The run's p99 inter-token latency had every other gap of the run taken no time: no
    /// placement of the other sessions could bring the p99 under it, short of breaking these
    /// streams. `None` when these gaps are too few to reach the p99 (1% of all).
    pub p99_floor_ms: Option<f64>,
}

/// Per backend, the streams in flight at `mark_ms` (ms from the run's start) and their gaps
/// after it: each chunk's time is the request's start plus its TTFT plus the gaps before it.
/// `gaps[i]` holds `records[i]`'s gaps, as for [`summarise`].
pub fn in_flight(
    records: &[Record],
    gaps: &[Vec<f64>],
    mark_ms: f64,
) -> BTreeMap<String, InFlight> {
    let mut after: BTreeMap<String, (u64, Vec<f64>)> = BTreeMap::new();
    for (r, g) in records.iter().zip(gaps) {
        let (Some(b), Some(ttft)) = (&r.backend, r.ttft_ms) else {
            continue;
        };
        if r.start_ms >= mark_ms {
            continue;
        }
        let mut t = r.start_ms + ttft;
        let mut late = Vec::new();
        for &gap in g {
            t += gap;
            if t > mark_ms {
                late.push(gap);
            }
        }
        if !late.is_empty() {
            let e = after.entry(b.clone()).or_default();
            e.0 += 1;
            e.1.extend(late);
        }
    }
    let all = gaps.iter().map(Vec::len).sum::<usize>();
    after
        .into_iter()
        .map(|(b, (streams, mut late))| {
            late.sort_by(f64::total_cmp);
            // The other gaps, at 0, fill the ranks below these (`all` >= 1: `late` is in it).
            let zeros = all - late.len();
            let floor = rank(all, 0.99).checked_sub(zeros + 1).map(|i| r3(late[i]));
            let f = InFlight {
                streams,
                gaps_after: late.len(),
                p99_floor_ms: floor,
            };
            (b, f)
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn rec(conv: u64, turn: u32, backend: Option<&str>, broken: Option<&str>) -> Record {
        Record {
            start_ms: 0.0,
            client: "10.0.0.1".into(),
            conversation: conv,
            turn,
            backend: backend.map(str::to_owned),
            ttft_ms: backend.map(|_| 100.0 + conv as f64),
            itl_ms_p50: None,
            itl_ms_p99: None,
            itl_ms_max: None,
            e2e_ms: Some(1000.0),
            tokens: 10,
            broken: broken.map(str::to_owned),
            ..Record::default()
        }
    }

    #[test]
    fn nearest_rank_percentiles() {
        let v: Vec<f64> = (1..=1000).map(f64::from).collect();
        let p = Percentiles::of(&v);
        assert_eq!(
            (p.p50, p.p90, p.p99, p.p99_9, p.max),
            (
                Some(500.0),
                Some(900.0),
                Some(990.0),
                Some(999.0),
                Some(1000.0)
            )
        );
        assert_eq!(p.mean, Some(500.5));
        // Order does not matter; NaN is dropped; one sample is every percentile.
        let p = Percentiles::of(&[3.0, f64::NAN, 1.0, 2.0]);
        assert_eq!((p.count, p.p50, p.p99), (3, Some(2.0), Some(3.0)));
        assert_eq!(Percentiles::of(&[7.0]).p99_9, Some(7.0));
        assert_eq!(Percentiles::of(&[]), Percentiles::default());
        // Ten samples: p90 is the 9th, p99 and p99.9 the 10th.
        let ten: Vec<f64> = (1..=10).map(f64::from).collect();
        let p = Percentiles::of(&ten);
        assert_eq!((p.p90, p.p99, p.p99_9), (Some(9.0), Some(10.0), Some(10.0)));
    }

    #[test]
    fn affinity_counts_later_turns_on_the_first_backend() {
        let records = vec![
            rec(1, 0, Some("a"), None),
            rec(1, 1, Some("a"), None),
            rec(1, 2, Some("b"), None),
            rec(2, 1, Some("b"), None), // turn 0 unknown below: not counted
            rec(2, 0, None, Some("connect")),
            rec(3, 0, Some("c"), None),
            rec(3, 1, None, Some("connect")), // no backend: not counted
            rec(3, 2, Some("c"), Some("reset")),
        ];
        let a = affinity(&records);
        assert_eq!((a.later_turns, a.kept), (3, 2));
        assert_eq!(a.fraction, Some(2.0 / 3.0));
        assert_eq!(affinity(&[rec(1, 0, Some("a"), None)]).fraction, None);
    }

    #[test]
    fn imbalance_is_max_over_mean_averaged_over_time() {
        let samples = vec![
            vec![0.5, 0.5],
            vec![0.9, 0.3], // max 0.9 / mean 0.6 = 1.5
            vec![0.0, 0.0], // idle: skipped
            vec![],
        ];
        assert_eq!(imbalance(&samples), Some(1.25));
        assert_eq!(imbalance(&[vec![0.0]]), None);
    }

    #[test]
    fn streams_in_flight_at_a_mark_and_the_p99_they_alone_set() {
        let at = |start_ms, backend, ttft_ms| Record {
            start_ms,
            backend: Some(String::from(backend)),
            ttft_ms,
            ..Record::default()
        };
        let records = [
            // Chunks at 60, 120, 190 and 270 ms: three gaps end after the mark at 100.
            at(0.0, "slow", Some(10.0)),
            // Chunks at 80, 100 and 120: only the last gap ends after the mark.
            at(50.0, "fast", Some(10.0)),
            // Started after the mark, or no first token: not in flight.
            at(200.0, "fast", Some(10.0)),
            at(20.0, "slow", None),
        ];
        let gaps = [
            vec![50.0, 60.0, 70.0, 80.0],
            vec![20.0, 20.0, 20.0],
            vec![10.0; 93],
            vec![],
        ];
        let f = in_flight(&records, &gaps, 100.0);
        assert_eq!(f.len(), 2);
        // 100 gaps: the p99 is the 99th; with the 97 others at 0 it is slow's 70.
        assert_eq!(
            f["slow"],
            InFlight {
                streams: 1,
                gaps_after: 3,
                p99_floor_ms: Some(70.0),
            }
        );
        // One gap of 100 does not reach the p99.
        assert_eq!(
            f["fast"],
            InFlight {
                streams: 1,
                gaps_after: 1,
                p99_floor_ms: None,
            }
        );
        assert!(in_flight(&records, &gaps, 0.0).is_empty());
        assert!(in_flight(&records[3..], &gaps[3..], 100.0).is_empty());
    }

    #[test]
    fn summary_counts_goodput_of_completed_streams_only() {
        let records = vec![
            rec(1, 0, Some("a"), None),
            Record {
                attempts: 2,
                ..rec(2, 0, Some("b"), None)
            },
            rec(3, 0, Some("b"), Some("reset")),
            Record {
                attempts: 3,
                ..rec(4, 0, None, Some("connect"))
            },
        ];
        // 102 gaps: a's 98 of 20 ms, 90 and 95; b's 40 and 10. The p99 is the 101st: 90.
        let mut a = vec![20.0; 98];
        a.extend([90.0, 95.0]);
        let gaps = [a, vec![40.0, 10.0], vec![], vec![]];
        let s = summarise(&records, &gaps, 2.0);
        assert_eq!((s.requests, s.completed, s.broken), (4, 2, 2));
        assert_eq!((s.requests_retried, s.retries), (2, 3));
        assert_eq!(s.broken_by_reason["reset"], 1);
        assert_eq!(s.broken_by_reason["connect"], 1);
        assert_eq!(s.tokens, 40);
        assert_eq!(s.goodput_tokens_per_s, 10.0);
        assert_eq!(s.backends["b"].sessions, 2);
        assert_eq!(s.backends["b"].broken, 1);
        assert_eq!(s.backends["b"].tokens_per_s, 10.0);
        assert_eq!(
            (s.itl_ms.count, s.itl_ms.p50, s.itl_ms.p99),
            (102, Some(20.0), Some(90.0))
        );
        assert_eq!(s.backends["a"].itl_ms.max, Some(95.0));
        assert_eq!(s.backends["b"].itl_ms.count, 2);
        assert_eq!(s.backends["a"].itl_gaps_over_run_p99, 1);
        assert_eq!(s.backends["b"].itl_gaps_over_run_p99, 0);
        assert_eq!(s.ttft_ms.count, 3);
        assert_eq!(s.backends["a"].ttft_ms.p50, Some(101.0));
    }
}
