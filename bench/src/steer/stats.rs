//! A cell's figures from the load generator's per-request records, the sampled timeline and
//! the daemon's events: pure functions, unit-tested.

use std::collections::BTreeMap;

use serde_json::{json, Value};

use super::plot::{Point, Sample};
use crate::tokens::stats::nearest_rank;

/// One request as `sluice-bench tokens --records` writes it.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct Record {
    /// Since the run's start.
    pub start_ms: f64,
    pub client: String,
    pub conversation: u64,
    pub turn: u64,
    pub backend: Option<String>,
    pub ttft_ms: Option<f64>,
    /// From the first attempt's start to the stream's end (or break).
    pub e2e_ms: Option<f64>,
    /// Answer tokens received.
    pub tokens: u64,
    /// Prompt tokens sent, and those the accelerator said came from its prefix cache.
    pub prompt_tokens: u64,
    pub cached_tokens: u64,
    /// `None`: completed.
    pub broken: Option<String>,
    /// When its last attempt refused before any response byte started (a retried request
    /// may have completed after it); `None` when none was.
    pub last_refused_ms: Option<f64>,
}

impl Record {
    pub fn parse(v: &Value) -> Record {
        let s = |k: &str| v[k].as_str().map(str::to_owned);
        Record {
            start_ms: v["start_ms"].as_f64().unwrap_or(0.0),
            client: s("client").unwrap_or_default(),
            conversation: v["conversation"].as_u64().unwrap_or(0),
            turn: v["turn"].as_u64().unwrap_or(0),
            backend: s("backend").filter(|b| !b.is_empty()),
            ttft_ms: v["ttft_ms"].as_f64(),
            e2e_ms: v["e2e_ms"].as_f64(),
            tokens: v["tokens"].as_u64().unwrap_or(0),
            prompt_tokens: v["prompt_tokens"].as_u64().unwrap_or(0),
            cached_tokens: v["cached_tokens"].as_u64().unwrap_or(0),
            broken: s("broken"),
            last_refused_ms: v["last_refused_ms"].as_f64(),
        }
    }
}

/// The prefix cache's figures: the accelerators' counters (tokens queried and hit, summed at
/// the end of the cell) and their ratio, and the records' cached and prompt tokens.
pub fn prefix_cache(queries: u64, hits: u64, records: &[Record]) -> Value {
    let ratio =
        |num: u64, den: u64| (den > 0).then(|| (num as f64 / den as f64 * 1000.0).round() / 1000.0);
    let prompt: u64 = records.iter().map(|r| r.prompt_tokens).sum();
    let cached: u64 = records.iter().map(|r| r.cached_tokens).sum();
    json!({
        "queried_tokens": queries,
        "hit_tokens": hits,
        "hit_rate": ratio(hits, queries),
        "records_prompt_tokens": prompt,
        "records_cached_tokens": cached,
        "records_cached_fraction": ratio(cached, prompt),
    })
}

/// Nearest-rank percentile (`q` in 0..=100) of an unsorted sample; 0 when empty.
pub fn percentile(v: &[f64], q: f64) -> f64 {
    let mut s = v.to_vec();
    s.sort_by(f64::total_cmp);
    nearest_rank(&s, q / 100.0).unwrap_or(0.0)
}

/// A second generator's record as if the first had written it: started `at_ms` later
/// (`start_ms`, `last_refused_ms`), its conversation ids from `conversations` on.
pub fn shifted(mut v: Value, at_ms: f64, conversations: u64) -> Value {
    for k in ["start_ms", "last_refused_ms"] {
        if let Some(t) = v[k].as_f64() {
            v[k] = json!(((t + at_ms) * 1000.0).round() / 1000.0);
        }
    }
    if let Some(c) = v["conversation"].as_u64() {
        v["conversation"] = json!(c + conversations);
    }
    v
}

/// Goodput: tokens of the completed streams over `elapsed_s`.
pub fn goodput(records: &[Record], elapsed_s: f64) -> f64 {
    let tokens: u64 = records
        .iter()
        .filter(|r| r.broken.is_none())
        .map(|r| r.tokens)
        .sum();
    per_s(tokens, elapsed_s)
}

/// `tokens` over `secs`, to the thousandth (0 over no time).
pub fn per_s(tokens: u64, secs: f64) -> f64 {
    if secs > 0.0 {
        (tokens as f64 / secs * 1000.0).round() / 1000.0
    } else {
        0.0
    }
}

/// The generator's `--records` lines (blank lines skipped).
pub fn parse_records(text: &str) -> serde_json::Result<Vec<Record>> {
    text.lines()
        .filter(|l| !l.trim().is_empty())
        .map(|l| serde_json::from_str(l).map(|v| Record::parse(&v)))
        .collect()
}

/// TTFTs (ms) of the requests that got a first token.
pub fn ttfts(records: &[Record]) -> Vec<f64> {
    records.iter().filter_map(|r| r.ttft_ms).collect()
}

/// A backend killed at `at_ms`, whose new sessions may fail for `bound_ms` (until health
/// checks mark it down).
#[derive(Clone, Copy, Debug)]
pub struct Kill<'a> {
    pub backend: &'a str,
    pub at_ms: f64,
    pub bound_ms: f64,
}

/// (completed, broken, broken on the killed backend). A stream that broke names its
/// backend; a connection that failed names none (the client never reached a backend), and
/// one started within the bound after the kill counts on the killed backend: the data plane
/// sent it there before the backend was marked down (nothing else refuses a connection of
/// a VIP without admission control; with admission a shed in that window would count too).
pub fn sessions(records: &[Record], kill: Option<Kill>) -> (u64, u64, u64) {
    let broken: Vec<&Record> = records.iter().filter(|r| r.broken.is_some()).collect();
    let on_killed = broken
        .iter()
        .filter(|r| {
            kill.is_some_and(|k| match r.backend.as_deref() {
                Some(b) => b == k.backend,
                None => (k.at_ms..=k.at_ms + k.bound_ms).contains(&r.start_ms),
            })
        })
        .count();
    (
        (records.len() - broken.len()) as u64,
        broken.len() as u64,
        on_killed as u64,
    )
}

/// Broken streams by reason.
pub fn broken_by_reason<'a>(
    records: impl IntoIterator<Item = &'a Record>,
) -> BTreeMap<String, u64> {
    let mut m = BTreeMap::new();
    for r in records {
        if let Some(b) = &r.broken {
            *m.entry(b.clone()).or_default() += 1;
        }
    }
    m
}

/// Of the later turns of conversations whose first turn landed on a backend outside
/// `faulty` (one that stayed healthy), the fraction on the first turn's backend; `None`
/// when there are none.
pub fn affinity_kept(records: &[Record], faulty: &[&str]) -> Option<f64> {
    let mut first: BTreeMap<(&str, u64), &str> = BTreeMap::new();
    let mut sorted: Vec<&Record> = records.iter().collect();
    sorted.sort_by_key(|r| (r.conversation, r.turn));
    let (mut kept, mut total) = (0u64, 0u64);
    for r in sorted {
        let Some(b) = r.backend.as_deref() else {
            continue;
        };
        let key = (r.client.as_str(), r.conversation);
        match first.get(&key) {
            None => {
                first.insert(key, b);
            }
            Some(f) if !faulty.contains(f) => {
                total += 1;
                kept += u64::from(*f == b);
            }
            Some(_) => {}
        }
    }
    (total > 0).then(|| kept as f64 / total as f64)
}

/// Why the later turns counted by [`affinity_kept`] left their first turn's backend, turn by
/// turn. The data plane keeps one affinity entry per client address: the backend of its last
/// new session, wherever that session went (also past a capped backend). An entry stands on
/// a backend that is only saturated (full, moved away for saturation). Replaying every
/// address's sessions in start order with the daemon's steering state at each start
/// (`steering`, sampled about every 100 ms) gives what the entry named when a turn left:
/// - `expired`: no packet from the address to the entry's backend within the affinity window
///   (`window_secs`; a session keeps the entry fresh until it ends, as the data plane's
///   refresh from established packets does);
/// - `capped` / `moved` / `queued`: it named the first backend, which was at its session cap
///   (probed past), out of rotation for a fault (moved away for one, down), or in rotation
///   with requests waiting in its queue (its affinity yields to a queue); `unseen`: none
///   showed in the nearest sample;
/// - `followed_own_turn`: an earlier turn of the same conversation had moved it (probed
///   past the first backend);
/// - `followed_other_conversation`: another conversation from the same address had moved it.
///
/// Also `turns_sharing_an_address` (later turns, kept or not, whose address opened another
/// conversation's session since the conversation's first turn) and `kept_when_free`: the
/// fraction kept of the later turns whose first backend was neither capped nor out for a
/// fault.
pub fn affinity_lost(
    records: &[Record],
    faulty: &[&str],
    names: &[String],
    steering: &[Sample],
    window_secs: u32,
) -> Value {
    let at = |b: &str, ms: f64| -> Option<&Point> {
        let i = names.iter().position(|n| n == b)?;
        let s = steering.iter().min_by(|x, y| {
            (x.t * 1000.0 - ms)
                .abs()
                .total_cmp(&(y.t * 1000.0 - ms).abs())
        })?;
        s.points.get(i)
    };
    let out = |p: Option<&Point>| {
        p.is_some_and(|p| match p.state.as_deref() {
            Some("active") | Some("slow-start") | Some("guarded") => false,
            Some("moved-away") => p.no_affinity,
            _ => true,
        })
    };
    let capped = |p: Option<&Point>| p.is_some_and(|p| p.capped);
    let queued = |p: Option<&Point>| p.is_some_and(|p| p.no_affinity) && !out(p);
    let window_ms = f64::from(window_secs) * 1000.0;
    let mut sorted: Vec<&Record> = records.iter().filter(|r| r.backend.is_some()).collect();
    sorted.sort_by(|a, b| a.start_ms.total_cmp(&b.start_ms));
    // Per address: the backend its entry names, when it was last refreshed and which
    // conversation set it; every session's (start, conversation); and its sessions'
    // (backend, end), whose packets refresh an entry naming their backend.
    let mut entry: BTreeMap<&str, (&str, f64, u64)> = BTreeMap::new();
    let mut live: BTreeMap<&str, Vec<(&str, f64)>> = BTreeMap::new();
    let mut opened: BTreeMap<&str, Vec<(f64, u64)>> = BTreeMap::new();
    let mut first: BTreeMap<(&str, u64), (&str, f64)> = BTreeMap::new();
    let mut n: BTreeMap<&str, u64> = BTreeMap::new();
    let (mut free, mut free_kept) = (0u64, 0u64);
    for r in sorted {
        let b = r.backend.as_deref().unwrap_or_default();
        let (c, conv, t) = (r.client.as_str(), r.conversation, r.start_ms);
        let fresh = entry.get(c).copied().filter(|&(e, since, _)| {
            let last = live.get(c).into_iter().flatten().filter(|s| s.0 == e);
            let last = last.fold(since, |m, s| m.max(s.1.min(t)));
            t - last < window_ms
        });
        let sessions = opened.entry(c).or_default();
        match first.get(&(c, conv)) {
            None => {
                first.insert((c, conv), (b, t));
            }
            Some(&(f, _)) if faulty.contains(&f) => {}
            Some(&(f, since)) => {
                let p = at(f, t);
                if !out(p) && !capped(p) && !queued(p) {
                    free += 1;
                    free_kept += u64::from(f == b);
                }
                if sessions.iter().any(|&(o, k)| o > since && k != conv) {
                    *n.entry("turns_sharing_an_address").or_default() += 1;
                }
                if f != b {
                    let why = match fresh {
                        None => "expired",
                        Some((e, ..)) if e == f && out(p) => "moved",
                        Some((e, ..)) if e == f && capped(p) => "capped",
                        Some((e, ..)) if e == f && queued(p) => "queued",
                        Some((e, ..)) if e == f => "unseen",
                        Some((.., by)) if by == conv => "followed_own_turn",
                        Some(_) => "followed_other_conversation",
                    };
                    *n.entry(why).or_default() += 1;
                }
            }
        }
        sessions.push((t, conv));
        live.entry(c)
            .or_default()
            .push((b, t + r.e2e_ms.unwrap_or(0.0)));
        // A hit refreshes the entry (still the conversation's that set it); else it follows.
        let next = match fresh {
            Some((e, _, by)) if e == b => (e, t, by),
            _ => (b, t, conv),
        };
        entry.insert(c, next);
    }
    let count = |k: &str| n.get(k).copied().unwrap_or(0);
    json!({
        "expired": count("expired"),
        "capped": count("capped"),
        "moved": count("moved"),
        "queued": count("queued"),
        "unseen": count("unseen"),
        "followed_own_turn": count("followed_own_turn"),
        "followed_other_conversation": count("followed_other_conversation"),
        "turns_sharing_an_address": count("turns_sharing_an_address"),
        "kept_when_free": (free > 0).then(|| free_kept as f64 / free as f64),
    })
}

/// Where new sessions went from `from_ms` to `to_ms`: sessions per backend (`"none"`: no
/// backend answered).
pub fn landed(records: &[Record], from_ms: f64, to_ms: f64) -> BTreeMap<String, u64> {
    let mut m = BTreeMap::new();
    for r in records
        .iter()
        .filter(|r| r.start_ms >= from_ms && r.start_ms < to_ms)
    {
        let b = r.backend.clone().unwrap_or_else(|| "none".into());
        *m.entry(b).or_default() += 1;
    }
    m
}

/// After a kill at `at_ms`: how long new sessions still failed (the start of the last
/// session that found no backend, or of the last refused attempt of a retried one, relative
/// to the kill), in ms; 0 when none did. A refusal the client's retry then got past still
/// counts: the data plane sent that attempt to a dead backend.
pub fn avoided_after_ms(records: &[Record], at_ms: f64) -> f64 {
    records
        .iter()
        .flat_map(|r| {
            let failed = (r.backend.is_none() && r.broken.is_some()).then_some(r.start_ms);
            [failed, r.last_refused_ms]
        })
        .flatten()
        .filter(|&t| t >= at_ms)
        .map(|t| t - at_ms)
        .fold(0.0, f64::max)
}

/// Mean over samples of max/mean KV use across the backends sampled then (samples whose
/// mean is 0 are skipped); 1.0 is a perfect balance.
pub fn imbalance(kv: &[Vec<f64>]) -> f64 {
    let ratios: Vec<f64> = kv
        .iter()
        .filter(|s| !s.is_empty())
        .filter_map(|s| {
            let mean = s.iter().sum::<f64>() / s.len() as f64;
            (mean > 0.0).then(|| s.iter().copied().fold(0.0, f64::max) / mean)
        })
        .collect();
    if ratios.is_empty() {
        return 1.0;
    }
    ratios.iter().sum::<f64>() / ratios.len() as f64
}

/// Weight changes per backend address among the daemon's events at or after `since_ms`.
pub fn weight_changes(
    events: &[Value],
    since_ms: u64,
    backends: &[String],
) -> BTreeMap<String, u64> {
    // Every backend is named, those never changed with 0.
    let mut m: BTreeMap<String, u64> = backends.iter().map(|b| (b.clone(), 0)).collect();
    for e in events {
        if e["kind"] == "weight-change" && e["time_ms"].as_u64().unwrap_or(0) >= since_ms {
            let b = e["backend"].as_str().unwrap_or("?").to_owned();
            *m.entry(b).or_default() += 1;
        }
    }
    m
}

/// A TTFT SLO for [`slo_goodput`]: about twice the healthy fleet's p99 TTFT in this lab
/// (0.6-1.5 s), well under the overloaded Maglev fleet's (12.5 s).
pub const TTFT_SLO_MS: f64 = 2000.0;

/// SLO goodput (as in DistServe): tokens per second of the completed streams whose first
/// token came within `slo_ms`, over `elapsed_s` (the load generator's run, as for goodput).
pub fn slo_goodput(records: &[Record], slo_ms: f64, elapsed_s: f64) -> f64 {
    let tokens: u64 = records
        .iter()
        .filter(|r| r.broken.is_none() && r.ttft_ms.is_some_and(|t| t <= slo_ms))
        .map(|r| r.tokens)
        .sum();
    per_s(tokens, elapsed_s)
}

/// The daemon's shed-start and shed-stop events after `since_ms`: seconds into the cell,
/// kind and reason.
pub fn shed_changes(events: &[Value], since_ms: u64) -> Vec<Value> {
    events
        .iter()
        .filter(|e| e["kind"] == "shed-start" || e["kind"] == "shed-stop")
        .filter_map(|e| {
            let at = e["time_ms"].as_u64()?.checked_sub(since_ms)?;
            Some(json!({"t_s": at as f64 / 1000.0, "kind": e["kind"], "reason": e["reason"]}))
        })
        .collect()
}

/// `{"p50", "p90", "p99", "p99.9"}` of a sample, rounded to 0.1 ms.
pub fn quantiles(v: &[f64]) -> Value {
    let r = |x: f64| (x * 10.0).round() / 10.0;
    json!({
        "p50": r(percentile(v, 50.0)),
        "p90": r(percentile(v, 90.0)),
        "p99": r(percentile(v, 99.0)),
        "p99.9": r(percentile(v, 99.9)),
        "n": v.len(),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn rec(
        conv: u64,
        turn: u64,
        start_ms: f64,
        backend: Option<&str>,
        broken: Option<&str>,
    ) -> Record {
        Record {
            start_ms,
            client: "10.111.0.160".into(),
            conversation: conv,
            turn,
            backend: backend.map(Into::into),
            ttft_ms: backend.map(|_| 100.0 + start_ms),
            e2e_ms: None,
            tokens: 10,
            broken: broken.map(Into::into),
            ..Record::default()
        }
    }

    #[test]
    fn a_second_generators_records_are_shifted_into_the_first_ones_run() {
        let v = json!({"start_ms": 100.5, "last_refused_ms": null, "conversation": 3,
                       "client": "10.111.0.200"});
        let s = shifted(v, 20_000.0, 1 << 32);
        let r = Record::parse(&s);
        assert_eq!((r.start_ms, r.conversation), (20_100.5, (1 << 32) + 3));
        assert_eq!(r.last_refused_ms, None);
        let s = shifted(json!({"start_ms": 1.0, "last_refused_ms": 2.0}), 10.0, 0);
        assert_eq!(Record::parse(&s).last_refused_ms, Some(12.0));
        let done = Record {
            tokens: 30,
            ..Record::default()
        };
        let broken = Record {
            tokens: 50,
            broken: Some("reset".into()),
            ..Record::default()
        };
        assert_eq!(goodput(&[done, broken], 10.0), 3.0);
    }

    #[test]
    fn prefix_cache_hit_rate_and_the_records_cached_share() {
        let r = |prompt, cached| Record {
            prompt_tokens: prompt,
            cached_tokens: cached,
            ..Record::default()
        };
        let v = prefix_cache(4000, 1000, &[r(100, 0), r(300, 160)]);
        assert_eq!(v["hit_rate"], 0.25);
        assert_eq!(v["records_cached_tokens"], 160);
        assert_eq!(v["records_cached_fraction"], 0.4);
        // A cell that queried nothing has no rate.
        assert_eq!(prefix_cache(0, 0, &[])["hit_rate"], Value::Null);
        let parsed = Record::parse(&json!({"prompt_tokens": 70, "cached_tokens": 48}));
        assert_eq!((parsed.prompt_tokens, parsed.cached_tokens), (70, 48));
    }

    #[test]
    fn slo_goodput_counts_completed_streams_within_the_ttft_slo() {
        // TTFTs 100, 110, 2100 ms (completed), 130 ms (broken), none (refused).
        let rs = vec![
            rec(1, 0, 0.0, Some("b0"), None),
            rec(1, 1, 10.0, Some("b0"), None),
            rec(2, 0, 2000.0, Some("b1"), None),
            rec(3, 0, 30.0, Some("b1"), Some("reset")),
            rec(4, 0, 40.0, None, Some("connect")),
        ];
        assert_eq!(slo_goodput(&rs, 2000.0, 2.0), 10.0);
        assert_eq!(slo_goodput(&rs, 5000.0, 2.0), 15.0);
        assert_eq!(slo_goodput(&rs, 2000.0, 0.0), 0.0);
    }

    #[test]
    fn percentiles_are_nearest_rank() {
        let v: Vec<f64> = (1..=100).map(f64::from).collect();
        assert_eq!(percentile(&v, 50.0), 50.0);
        assert_eq!(percentile(&v, 99.0), 99.0);
        assert_eq!(percentile(&v, 99.9), 100.0);
        assert_eq!(percentile(&[3.0], 0.0), 3.0);
        assert_eq!(percentile(&[], 50.0), 0.0);
    }

    #[test]
    fn sessions_affinity_and_landing() {
        let rs = vec![
            rec(1, 0, 0.0, Some("b0"), None),
            rec(1, 1, 10.0, Some("b0"), None),
            rec(1, 2, 20.0, Some("b2"), None),
            rec(2, 0, 5.0, Some("b1"), None),
            rec(2, 1, 30.0, Some("b1"), Some("reset")),
            rec(3, 0, 40.0, None, Some("connect")),
        ];
        let kill = |at_ms| Kill {
            backend: "b1",
            at_ms,
            bound_ms: 3.0,
        };
        assert_eq!(sessions(&rs, Some(kill(25.0))), (4, 2, 1));
        // The failed connect at 40 ms, within 3 ms of a kill at 38 ms: the killed one's.
        assert_eq!(sessions(&rs, Some(kill(38.0))), (4, 2, 2));
        assert_eq!(sessions(&rs, None), (4, 2, 0));
        // Conversation 2 started on the faulty b1: not counted. Conversation 1: 1 of 2 kept.
        assert_eq!(affinity_kept(&rs, &["b1"]), Some(0.5));
        assert_eq!(affinity_kept(&rs, &[]), Some(2.0 / 3.0));
        // Conversation 1's third turn left b0 while b0 was at its cap.
        let names: Vec<String> = ["b0", "b1", "b2"].map(String::from).to_vec();
        let point = |capped| Point {
            state: Some("active".into()),
            full: capped,
            capped,
            ..Point::default()
        };
        let timeline = [
            Sample {
                t: 0.0,
                points: vec![point(false), point(false), point(false)],
            },
            Sample {
                t: 0.02,
                points: vec![point(true), point(false), point(false)],
            },
        ];
        assert_eq!(
            affinity_lost(&rs, &["b1"], &names, &timeline, 60)["capped"],
            json!(1)
        );
        assert_eq!(
            landed(&rs, 10.0, 41.0),
            BTreeMap::from([
                ("b0".into(), 1),
                ("b2".into(), 1),
                ("b1".into(), 1),
                ("none".into(), 1)
            ])
        );
        assert_eq!(avoided_after_ms(&rs, 25.0), 15.0);
        // A session that completed on a retry after a refusal at 52 ms: the data plane still
        // sent that attempt nowhere.
        let retried = Record {
            last_refused_ms: Some(52.0),
            ..rec(4, 0, 50.0, Some("b2"), None)
        };
        let mut with_retry = rs.clone();
        with_retry.push(retried);
        assert_eq!(avoided_after_ms(&with_retry, 25.0), 27.0);
        assert_eq!(sessions(&with_retry, Some(kill(38.0))), (5, 2, 2));
        assert_eq!(ttfts(&rs).len(), 5);
        assert_eq!(broken_by_reason(&rs)["connect"], 1);
    }

    #[test]
    fn affinity_losses_are_told_apart_by_replaying_each_address() {
        let turn = |client: &str, conv, turn, ms, b: &str| Record {
            client: client.into(),
            ..rec(conv, turn, ms, Some(b), None)
        };
        let names: Vec<String> = ["b0", "b1", "b2"].map(String::from).to_vec();
        let at = |t, b0_capped, b1_state: &str| Sample {
            t,
            points: vec![
                Point {
                    state: Some("active".into()),
                    full: b0_capped,
                    capped: b0_capped,
                    ..Point::default()
                },
                Point {
                    state: Some(b1_state.into()),
                    no_affinity: b1_state != "active",
                    ..Point::default()
                },
                Point {
                    state: Some("active".into()),
                    ..Point::default()
                },
            ],
        };
        let steering = [
            at(0.0, false, "active"),
            at(1.0, true, "active"),
            at(2.0, false, "active"),
            at(3.0, false, "moved-away"),
            at(4.0, false, "active"),
            // b1 in rotation with requests waiting: its affinity yields.
            {
                let mut s = at(5.0, false, "active");
                s.points[1].no_affinity = true;
                s
            },
        ];
        let rs = vec![
            // Probed past capped b0 to b2, which the entry follows, so the next turn too.
            turn("a", 1, 0, 500.0, "b0"),
            turn("a", 1, 1, 1000.0, "b2"),
            turn("a", 1, 2, 2000.0, "b2"),
            // b1 moved away: the entry follows to b2 and the next turn with it, though b1
            // is back; then another conversation of the address moves it to b0.
            turn("b", 3, 0, 2500.0, "b1"),
            turn("b", 3, 1, 3000.0, "b2"),
            turn("b", 3, 2, 4000.0, "b2"),
            turn("b", 4, 0, 4100.0, "b0"),
            turn("b", 3, 3, 4200.0, "b0"),
            // 70 s of silence: past the window.
            turn("c", 5, 0, 0.0, "b1"),
            turn("c", 5, 1, 70_000.0, "b2"),
            // A 65 s answer keeps its entry fresh to its end: its next turn 15 s later finds
            // b2 named and in rotation (so `unseen`, not `expired`).
            Record {
                e2e_ms: Some(65_000.0),
                ..turn("d", 6, 0, 0.0, "b2")
            },
            turn("d", 6, 1, 80_000.0, "b0"),
            turn("e", 7, 0, 4600.0, "b1"),
            turn("e", 7, 1, 5000.0, "b2"),
        ];
        assert_eq!(affinity_kept(&rs, &[]), Some(0.0));
        assert_eq!(
            affinity_lost(&rs, &[], &names, &steering, 60),
            json!({
                "expired": 1,
                "capped": 1,
                "moved": 1,
                "queued": 1,
                "unseen": 1,
                "followed_own_turn": 2,
                "followed_other_conversation": 1,
                "turns_sharing_an_address": 1,
                "kept_when_free": 0.0,
            })
        );
    }

    #[test]
    fn imbalance_is_the_mean_max_over_mean() {
        assert_eq!(imbalance(&[vec![0.5, 0.5], vec![0.0, 0.0]]), 1.0);
        assert_eq!(imbalance(&[vec![0.6, 0.2], vec![0.3, 0.3]]), 1.25);
    }

    #[test]
    fn weight_changes_count_per_backend_since_the_start() {
        let ev = vec![
            json!({"kind": "weight-change", "backend": "10.111.0.12", "time_ms": 5}),
            json!({"kind": "weight-change", "backend": "10.111.0.12", "time_ms": 15}),
            json!({"kind": "reroute", "backend": "10.111.0.12", "time_ms": 15}),
            json!({"kind": "weight-change", "backend": "10.111.0.13", "time_ms": 20}),
        ];
        assert_eq!(
            weight_changes(&ev, 10, &["10.111.0.11".into(), "10.111.0.12".into()]),
            BTreeMap::from([
                ("10.111.0.11".into(), 0),
                ("10.111.0.12".into(), 1),
                ("10.111.0.13".into(), 1)
            ])
        );
    }
}
