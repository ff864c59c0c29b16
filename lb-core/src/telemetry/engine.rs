//! The engine part of a sample from a vLLM or SGLang `/metrics` page.
//!
//! Queue depth and running requests are summed over the matching series (one per engine
//! core under data parallelism); KV-cache use is the fullest series. `model` selects the
//! `model_name` label; series without one never match a selection.
//!
//! Speed: the engine's inter-token latency histogram (the gap before every output token after
//! a request's first), whose `_sum` and `_count` are summed over the matching series; a
//! [`TpotTracker`] per target turns two scrapes into the mean time per output token between
//! them. KV and queue measure load; this measures how fast the accelerator turns it into
//! tokens, which is what tells a slow accelerator from a busy one.

use std::collections::BTreeSet;

use super::{prom::Page, reading, Sample};
use crate::config::EngineKind;

struct Names {
    queue: &'static str,
    running: &'static str,
    /// In order of preference: the first one on the page is used.
    kv_cache: &'static [&'static str],
    /// Inter-token latency histograms, in order of preference.
    tpot: &'static [&'static str],
}

const VLLM: Names = Names {
    queue: "vllm:num_requests_waiting",
    running: "vllm:num_requests_running",
    // vLLM renamed gpu_cache_usage_perc to kv_cache_usage_perc in the V1 engine; some
    // versions export both.
    kv_cache: &["vllm:kv_cache_usage_perc", "vllm:gpu_cache_usage_perc"],
    // vLLM 0.10 added inter_token_latency_seconds and deprecated time_per_output_token_seconds
    // (the same observations); older versions export only the latter.
    tpot: &[
        "vllm:inter_token_latency_seconds",
        "vllm:time_per_output_token_seconds",
    ],
};

const SGLANG: Names = Names {
    queue: "sglang:num_queue_reqs",
    running: "sglang:num_running_reqs",
    kv_cache: &["sglang:token_usage"],
    // Newer SGLang names the inter-token histogram so; older versions time_per_output_token.
    tpot: &[
        "sglang:inter_token_latency_seconds",
        "sglang:time_per_output_token_seconds",
    ],
};

fn names(kind: EngineKind) -> &'static Names {
    match kind {
        EngineKind::Vllm => &VLLM,
        EngineKind::Sglang => &SGLANG,
    }
}

pub fn extract(page: &Page<'_>, kind: EngineKind, model: Option<&str>) -> Result<Sample, String> {
    let names = names(kind);
    let values = |name| {
        page.get(name)
            .filter(move |s| model.is_none() || s.label("model_name") == model)
            .filter_map(|s| reading(s.value))
    };
    let queue_depth = values(names.queue).reduce(|a, b| a + b);
    if queue_depth.is_none() {
        if !page.has(names.queue) {
            return Err(format!(
                "{} is not on the page (is this a {kind} metrics endpoint?)",
                names.queue
            ));
        }
        let models: BTreeSet<&str> = page
            .get(names.queue)
            .filter_map(|s| s.label("model_name"))
            .collect();
        return Err(match model {
            Some(m) => format!(
                "no {} series with model_name={m:?}; models on the page: {}",
                names.queue,
                models.into_iter().collect::<Vec<_>>().join(", ")
            ),
            None => format!(
                "{} has no valid value (finite and >= 0), so the page says nothing of the \
                 queue",
                names.queue
            ),
        });
    }
    let kv_cache = names
        .kv_cache
        .iter()
        .find(|n| page.has(n))
        .and_then(|n| values(n).reduce(f64::max))
        .map(|v| v.min(1.0));
    Ok(Sample {
        queue_depth,
        running: values(names.running).reduce(|a, b| a + b),
        kv_cache,
        ..Sample::default()
    })
}

/// Cumulative totals of an inter-token latency histogram: seconds and tokens.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct TpotTotals {
    pub sum_s: f64,
    pub count: f64,
}

/// The first of the engine's inter-token latency histograms on the page, `_sum` and `_count`
/// each summed over the matching series; None when the page has neither, or a part has no
/// valid value.
pub fn tpot_totals(page: &Page<'_>, kind: EngineKind, model: Option<&str>) -> Option<TpotTotals> {
    let name = names(kind)
        .tpot
        .iter()
        .find(|n| page.has(&format!("{n}_count")))?;
    let total = |part: &str| {
        page.get(&format!("{name}_{part}"))
            .filter(|s| model.is_none() || s.label("model_name") == model)
            .filter_map(|s| reading(s.value))
            .reduce(|a, b| a + b)
    };
    Some(TpotTotals {
        sum_s: total("sum")?,
        count: total("count")?,
    })
}

/// Tokens an interval must hold before its mean counts. A lightly used backend's interval can
/// hold a handful of gaps, one of them a step that also prefilled another request's prompt
/// (up to 2048 tokens, 146 ms in the lab): over 3 tokens that reads as 3-8x the others' time
/// per output token, enough to cut a healthy backend's weight while its fleet drains after
/// its arrivals. Over 32 such a step adds at most a quarter to an 18 ms mean, while one
/// stream generates ~55 tokens a second, so a backend serving anything still reads every
/// scrape.
pub const MIN_TOKENS: f64 = 32.0;

/// The totals at the start of the current interval of one target.
#[derive(Clone, Debug, Default)]
pub struct TpotTracker {
    since: Option<TpotTotals>,
}

impl TpotTracker {
    /// Mean seconds per output token since the interval began, once it holds
    /// [`MIN_TOKENS`] (then the next interval begins); None before that (the interval goes
    /// on), for the first totals, when the page has none, or when a total went down (an
    /// engine restart: the next interval starts from the new totals).
    pub fn observe(&mut self, now: Option<TpotTotals>) -> Option<f64> {
        let (Some(since), Some(now)) = (self.since, now) else {
            self.since = now;
            return None;
        };
        let (tokens, secs) = (now.count - since.count, now.sum_s - since.sum_s);
        if tokens < 0.0 || secs < 0.0 {
            self.since = Some(now);
            return None;
        }
        if tokens < MIN_TOKENS {
            return None;
        }
        self.since = Some(now);
        Some(secs / tokens)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::telemetry::prom::parse;

    const VLLM_PAGE: &str = include_str!(concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/tests/fixtures/telemetry/vllm.prom"
    ));
    const SGLANG_PAGE: &str = include_str!(concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/tests/fixtures/telemetry/sglang.prom"
    ));

    fn vllm(model: Option<&str>) -> Result<Sample, String> {
        extract(&parse(VLLM_PAGE).unwrap(), EngineKind::Vllm, model)
    }

    #[test]
    fn vllm_all_engines() {
        // Two data-parallel engine cores serving one model.
        assert_eq!(
            vllm(None).unwrap(),
            Sample {
                queue_depth: Some(7.0),
                running: Some(45.0),
                kv_cache: Some(0.8125),
                ..Sample::default()
            }
        );
    }

    #[test]
    fn vllm_model_filter() {
        assert_eq!(
            vllm(Some("meta-llama/Llama-3.1-70B-Instruct")).unwrap(),
            vllm(None).unwrap()
        );
        let e = vllm(Some("llama-3-70b")).unwrap_err();
        assert_eq!(
            e,
            "no vllm:num_requests_waiting series with model_name=\"llama-3-70b\"; models on \
             the page: meta-llama/Llama-3.1-70B-Instruct"
        );
    }

    #[test]
    fn vllm_older_kv_cache_name() {
        let page = parse(
            "# TYPE vllm:num_requests_waiting gauge\n\
             vllm:num_requests_waiting{model_name=\"a\"} 2.0\n\
             vllm:num_requests_waiting{model_name=\"b\"} 5.0\n\
             vllm:num_requests_running{model_name=\"a\"} 1.0\n\
             vllm:gpu_cache_usage_perc{model_name=\"a\"} 0.5\n\
             vllm:gpu_cache_usage_perc{model_name=\"b\"} 0.9\n",
        )
        .unwrap();
        let a = extract(&page, EngineKind::Vllm, Some("a")).unwrap();
        assert_eq!(
            (a.queue_depth, a.running, a.kv_cache),
            (Some(2.0), Some(1.0), Some(0.5))
        );
        let b = extract(&page, EngineKind::Vllm, Some("b")).unwrap();
        assert_eq!(
            (b.queue_depth, b.running, b.kv_cache),
            (Some(5.0), None, Some(0.9))
        );
        let all = extract(&page, EngineKind::Vllm, None).unwrap();
        assert_eq!((all.queue_depth, all.kv_cache), (Some(7.0), Some(0.9)));
    }

    /// The fixture's inter-token histogram (two engine cores), then the next scrape's: engine
    /// 0 generated 1000 tokens in 25 s of gaps, engine 1 3000 in 55 s, 20 ms a token.
    #[test]
    fn vllm_time_per_output_token_over_the_scrape_interval() {
        let first = tpot_totals(&parse(VLLM_PAGE).unwrap(), EngineKind::Vllm, None).unwrap();
        assert_eq!(first.count, 2.0 * 5.494002e6);
        assert_eq!(first.sum_s, 2.0 * 211432.00915503502);
        let series = |engine, part, v: &str| {
            format!(
                "vllm:inter_token_latency_seconds_{part}{{engine=\"{engine}\",\
                 model_name=\"meta-llama/Llama-3.1-70B-Instruct\"}} {v}\n"
            )
        };
        let text = VLLM_PAGE
            .replace(
                &series(0, "count", "5.494002e+06"),
                &series(0, "count", "5.495002e+06"),
            )
            .replace(
                &series(0, "sum", "211432.00915503502"),
                &series(0, "sum", "211457.00915503502"),
            )
            .replace(
                &series(1, "count", "5.494002e+06"),
                &series(1, "count", "5.497002e+06"),
            )
            .replace(
                &series(1, "sum", "211432.00915503502"),
                &series(1, "sum", "211487.00915503502"),
            );
        let model = Some("meta-llama/Llama-3.1-70B-Instruct");
        let next = tpot_totals(&parse(&text).unwrap(), EngineKind::Vllm, model).unwrap();
        assert_eq!(next.count, first.count + 4000.0);

        let mut t = TpotTracker::default();
        assert_eq!(t.observe(Some(first)), None, "one scrape is no interval");
        let tpot = t.observe(Some(next)).unwrap();
        assert!((tpot - 0.020).abs() < 1e-9, "{tpot}");
        assert_eq!(t.observe(Some(next)), None, "no token in the interval");
        // A trickle: 10 tokens are too few to judge, 40 are enough, over the whole span.
        let more = |tokens: f64, secs: f64| TpotTotals {
            sum_s: next.sum_s + secs,
            count: next.count + tokens,
        };
        assert_eq!(t.observe(Some(more(10.0, 0.5))), None);
        let tpot = t.observe(Some(more(40.0, 1.0))).unwrap();
        assert!((tpot - 0.025).abs() < 1e-9, "{tpot}");
        let next = more(40.0, 1.0);
        // An engine restart: its totals start again, and so does the interval.
        assert_eq!(t.observe(Some(first)), None);
        // A page without the histogram breaks the chain.
        assert_eq!(t.observe(None), None);
        assert_eq!(t.observe(Some(next)), None);
        // The fixture's other model has no series.
        let other = tpot_totals(&parse(&text).unwrap(), EngineKind::Vllm, Some("other"));
        assert_eq!(other, None);
    }

    /// vLLM before 0.10 exports only `vllm:time_per_output_token_seconds`; SGLang names
    /// its histogram `sglang:inter_token_latency_seconds` (older: time_per_output_token).
    #[test]
    fn older_vllm_and_sglang_inter_token_histograms() {
        let vllm = parse(
            "# HELP vllm:time_per_output_token_seconds Histogram of time per output token in seconds.\n\
             # TYPE vllm:time_per_output_token_seconds histogram\n\
             vllm:time_per_output_token_seconds_bucket{le=\"0.025\",model_name=\"m\"} 90.0\n\
             vllm:time_per_output_token_seconds_bucket{le=\"+Inf\",model_name=\"m\"} 100.0\n\
             vllm:time_per_output_token_seconds_count{model_name=\"m\"} 100.0\n\
             vllm:time_per_output_token_seconds_sum{model_name=\"m\"} 2.5\n",
        )
        .unwrap();
        assert_eq!(
            tpot_totals(&vllm, EngineKind::Vllm, Some("m")),
            Some(TpotTotals {
                sum_s: 2.5,
                count: 100.0
            })
        );
        let sglang = parse(
            "# HELP sglang:inter_token_latency_seconds Histogram of inter-token latency in seconds.\n\
             # TYPE sglang:inter_token_latency_seconds histogram\n\
             sglang:inter_token_latency_seconds_sum{model_name=\"q\",tp_rank=\"0\"} 8.0\n\
             sglang:inter_token_latency_seconds_bucket{le=\"+Inf\",model_name=\"q\",tp_rank=\"0\"} 400.0\n\
             sglang:inter_token_latency_seconds_count{model_name=\"q\",tp_rank=\"0\"} 400.0\n",
        )
        .unwrap();
        assert_eq!(
            tpot_totals(&sglang, EngineKind::Sglang, None),
            Some(TpotTotals {
                sum_s: 8.0,
                count: 400.0
            })
        );
        // The SGLang fixture has no such histogram: no reading, and the rest still reads.
        let page = parse(SGLANG_PAGE).unwrap();
        assert_eq!(tpot_totals(&page, EngineKind::Sglang, None), None);
    }

    #[test]
    fn sglang() {
        let page = parse(SGLANG_PAGE).unwrap();
        let want = Sample {
            queue_depth: Some(12.0),
            running: Some(64.0),
            kv_cache: Some(0.91),
            ..Sample::default()
        };
        assert_eq!(extract(&page, EngineKind::Sglang, None).unwrap(), want);
        assert_eq!(
            extract(&page, EngineKind::Sglang, Some("Qwen/Qwen2.5-72B-Instruct")).unwrap(),
            want
        );
    }

    #[test]
    fn wrong_engine_kind() {
        let e = extract(&parse(SGLANG_PAGE).unwrap(), EngineKind::Vllm, None).unwrap_err();
        assert_eq!(
            e,
            "vllm:num_requests_waiting is not on the page (is this a vllm metrics endpoint?)"
        );
    }

    #[test]
    fn nan_values_are_not_readings() {
        let page = parse("vllm:num_requests_waiting NaN\n").unwrap();
        assert_eq!(
            extract(&page, EngineKind::Vllm, None).unwrap_err(),
            "vllm:num_requests_waiting has no valid value (finite and >= 0), so the page says \
             nothing of the queue"
        );
    }

    /// Each series is judged before the sum: 100 and -1000 would sum to -900, clamp to 0, and
    /// make a saturated backend look idle.
    #[test]
    fn vllm_negative_nan_and_infinite_series_are_dropped_before_the_sum() {
        let page = parse(
            "vllm:num_requests_waiting{engine=\"0\"} 100\n\
             vllm:num_requests_waiting{engine=\"1\"} -1000\n\
             vllm:num_requests_waiting{engine=\"2\"} NaN\n\
             vllm:num_requests_waiting{engine=\"3\"} +Inf\n\
             vllm:num_requests_running{engine=\"0\"} 8\n\
             vllm:num_requests_running{engine=\"1\"} -8\n\
             vllm:kv_cache_usage_perc{engine=\"0\"} 0.5\n\
             vllm:kv_cache_usage_perc{engine=\"1\"} -Inf\n",
        )
        .unwrap();
        let s = extract(&page, EngineKind::Vllm, None).unwrap();
        assert_eq!(
            (s.queue_depth, s.running, s.kv_cache),
            (Some(100.0), Some(8.0), Some(0.5))
        );
    }

    /// A page whose every queue series is invalid is no reading at all: the source fails
    /// this round and the backend goes stale rather than fresh and empty.
    #[test]
    fn a_page_without_a_valid_value_fails_vllm_and_sglang() {
        for (kind, text) in [
            (
                EngineKind::Vllm,
                "vllm:num_requests_waiting{engine=\"0\"} -1\n\
                 vllm:num_requests_waiting{engine=\"1\"} NaN\n\
                 vllm:num_requests_running 3\n",
            ),
            (
                EngineKind::Sglang,
                "sglang:num_queue_reqs -5\nsglang:num_queue_reqs -Inf\nsglang:token_usage 0.2\n",
            ),
        ] {
            let e = extract(&parse(text).unwrap(), kind, None).unwrap_err();
            assert!(
                e.contains("has no valid value (finite and >= 0)"),
                "{kind}: {e}"
            );
        }
    }

    #[test]
    fn sglang_negative_series_are_dropped_before_the_sum() {
        let page = parse(
            "sglang:num_queue_reqs{dp=\"0\"} 12\n\
             sglang:num_queue_reqs{dp=\"1\"} -12\n\
             sglang:num_running_reqs{dp=\"0\"} NaN\n\
             sglang:num_running_reqs{dp=\"1\"} 4\n\
             sglang:token_usage{dp=\"0\"} -0.5\n",
        )
        .unwrap();
        let s = extract(&page, EngineKind::Sglang, None).unwrap();
        assert_eq!(
            (s.queue_depth, s.running, s.kv_cache),
            (Some(12.0), Some(4.0), None)
        );
    }
}
