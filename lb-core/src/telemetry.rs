//! Accelerator telemetry for adaptive steering: what each backend's GPUs, inference engine
//! and RoCE fabric report, gathered into one [`Sample`] per backend.
//!
//! Sources:
//! - [`dcgm`]: NVIDIA dcgm-exporter pages (utilisation, memory, temperature, power, throttling);
//! - [`engine`]: vLLM and SGLang `/metrics` pages (queue depth, running requests, KV cache,
//!   time per output token);
//! - [`roce`]: RoCE congestion counters (ECN marks, CNPs) from sysfs or an exporter, as rates;
//! - [`inband`]: time to first byte and delivery rate from the data plane (in-band VIPs);
//! - push: samples posted through the admin API ([`Hub::update`] with [`Source::Push`]).
//!
//! Everything here interprets data and takes the time as a parameter: [`prom`] parses the text
//! exposition format, the extractors turn a page into a partial [`Sample`], [`Hub`] merges the
//! parts and judges staleness. The I/O shell is the `sluice` crate's `scrape` module: it fetches
//! each [`Target`] built by [`targets`] and feeds the hub.
//!
//! The daemon wires it up in `daemon::start_scraper`: the hub is told each backend's sources
//! ([`Hub::configure`], [`Hub::retain`]) and its staleness limit, then the scrape loop starts.
//! A configuration reload stops the loop, does the same for the new file and starts it again;
//! the hub, and so each backend's last samples, lives on. The steering tick reads
//! [`Hub::view`]; the admin API's `POST .../telemetry` pushes samples ([`Hub::push`]).

pub mod dcgm;
pub mod engine;
pub mod hub;
pub mod inband;
pub mod prom;
pub mod roce;
pub mod target;

use std::{fmt, net::IpAddr};

use serde::{Deserialize, Serialize};

pub use hub::{BackendTelemetry, Hub};
pub use target::{sources, targets, Target};

/// A backend: (VIP name, backend address).
pub type BackendKey = (String, IpAddr);

/// The clock-throttling bits of `DCGM_FI_DEV_CLOCKS_EVENT_REASONS` that mean the GPU is
/// slowed by something other than load: hardware slowdown (0x8), software thermal (0x20),
/// hardware thermal (0x40) and hardware power brake (0x80). Idle (0x1) and the software power
/// cap (0x4) are normal operation.
pub const THROTTLE_MASK: u64 = 0x8 | 0x20 | 0x40 | 0x80;

/// The latest signals of one backend; None = no source reports it.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Sample {
    /// 0..=1, the busiest of the backend's GPUs (DCGM_FI_DEV_GPU_UTIL is 0..100).
    #[serde(default)]
    pub gpu_util: Option<f64>,
    /// 0..=1, max over GPUs of FB_USED / (FB_USED + FB_FREE).
    #[serde(default)]
    pub fb_used: Option<f64>,
    /// Max over GPUs, °C.
    #[serde(default)]
    pub gpu_temp_c: Option<f64>,
    /// Sum over GPUs, W.
    #[serde(default)]
    pub power_w: Option<f64>,
    /// OR of DCGM_FI_DEV_CLOCKS_EVENT_REASONS over GPUs, masked to [`THROTTLE_MASK`].
    #[serde(default)]
    pub throttle: Option<u64>,
    /// vllm:num_requests_waiting / sglang:num_queue_reqs, summed over matching series.
    #[serde(default)]
    pub queue_depth: Option<f64>,
    /// vllm:num_requests_running / sglang:num_running_reqs, summed over matching series.
    #[serde(default)]
    pub running: Option<f64>,
    /// 0..=1, vllm:kv_cache_usage_perc (older vLLM: vllm:gpu_cache_usage_perc) /
    /// sglang:token_usage; max over matching series.
    #[serde(default)]
    pub kv_cache: Option<f64>,
    /// Mean time per output token, seconds: the delta of the engine's inter-token latency
    /// histogram's `_sum` over that of its `_count` since the last reading, reported once
    /// that interval holds [`engine::MIN_TOKENS`] tokens (a backend serving anything: every
    /// scrape), else None ([`engine::TpotTracker`]).
    #[serde(default)]
    pub tpot_s: Option<f64>,
    /// np_ecn_marked_roce_packets per second.
    #[serde(default)]
    pub ecn_rate: Option<f64>,
    /// CNPs per second (np_cnp_sent + rp_cnp_handled; Broadcom rx_cnp_pkts + tx_cnp_pkts).
    #[serde(default)]
    pub cnp_rate: Option<f64>,
    /// In-band: mean time to first byte over the window, seconds ([`inband`]).
    #[serde(default)]
    pub ttfb_s: Option<f64>,
    /// In-band: server bytes acknowledged per second of streaming, per stream ([`inband`]).
    #[serde(default)]
    pub delivery_bps: Option<f64>,
    /// In-band: server bytes acknowledged per second over the window, all streams together:
    /// the work the backend carries, at which its in-band readings are judged ([`inband`]).
    #[serde(default)]
    pub load_bps: Option<f64>,
    /// In-band: requests whose flow stalled within the window ([`inband`]).
    #[serde(default)]
    pub stalls: Option<f64>,
}

impl Sample {
    /// Whether the engine reports its load (KV-cache use or queue depth), which says more
    /// than GPU utilisation: a batching engine is busy whenever it has any work.
    pub fn engine_load(&self) -> bool {
        self.kv_cache.is_some() || self.queue_depth.is_some()
    }

    /// Checks a pushed sample: fractions in 0..=1, other numbers finite and >= 0, `throttle`
    /// within [`THROTTLE_MASK`]. The error names every offending field.
    pub fn validate(&self) -> Result<(), String> {
        let fractions = [
            ("gpu_util", self.gpu_util),
            ("fb_used", self.fb_used),
            ("kv_cache", self.kv_cache),
        ];
        let amounts = [
            ("gpu_temp_c", self.gpu_temp_c),
            ("power_w", self.power_w),
            ("queue_depth", self.queue_depth),
            ("running", self.running),
            ("tpot_s", self.tpot_s),
            ("ecn_rate", self.ecn_rate),
            ("cnp_rate", self.cnp_rate),
            ("ttfb_s", self.ttfb_s),
            ("delivery_bps", self.delivery_bps),
            ("load_bps", self.load_bps),
            ("stalls", self.stalls),
        ];
        let mut bad = Vec::new();
        for (name, v) in fractions {
            if let Some(v) = v.filter(|v| !(0.0..=1.0).contains(v)) {
                bad.push(format!("{name} = {v} is not a fraction; allowed: 0..=1"));
            }
        }
        for (name, v) in amounts {
            if let Some(v) = v.filter(|v| !(v.is_finite() && *v >= 0.0)) {
                bad.push(format!(
                    "{name} = {v} is out of range; allowed: a finite number >= 0"
                ));
            }
        }
        if let Some(t) = self.throttle.filter(|t| t & !THROTTLE_MASK != 0) {
            bad.push(format!(
                "throttle = {t:#x} has bits outside {THROTTLE_MASK:#x}; allowed: 0x8 hw slowdown, \
                 0x20 sw thermal, 0x40 hw thermal, 0x80 hw power brake"
            ));
        }
        if bad.is_empty() {
            Ok(())
        } else {
            Err(bad.join("; "))
        }
    }

    /// Replaces each field of `self` that `top` reports.
    pub fn overlay(&mut self, top: &Sample) {
        fn put<T: Copy>(dst: &mut Option<T>, src: Option<T>) {
            if src.is_some() {
                *dst = src;
            }
        }
        put(&mut self.gpu_util, top.gpu_util);
        put(&mut self.fb_used, top.fb_used);
        put(&mut self.gpu_temp_c, top.gpu_temp_c);
        put(&mut self.power_w, top.power_w);
        put(&mut self.throttle, top.throttle);
        put(&mut self.queue_depth, top.queue_depth);
        put(&mut self.running, top.running);
        put(&mut self.kv_cache, top.kv_cache);
        put(&mut self.tpot_s, top.tpot_s);
        put(&mut self.ecn_rate, top.ecn_rate);
        put(&mut self.cnp_rate, top.cnp_rate);
        put(&mut self.ttfb_s, top.ttfb_s);
        put(&mut self.delivery_bps, top.delivery_bps);
        put(&mut self.load_bps, top.load_bps);
        put(&mut self.stalls, top.stalls);
    }
}

/// Which source a part of a sample came from. Ordered by precedence: where two fresh
/// sources report the same field, the later one wins (a push overrides scraped values).
#[derive(
    Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord, serde::Serialize, serde::Deserialize,
)]
#[serde(rename_all = "lowercase")]
pub enum Source {
    Dcgm,
    Engine,
    Roce,
    /// The data plane's in-band signals (never configured: it has its own staleness).
    Inband,
    Push,
}

impl fmt::Display for Source {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Source::Dcgm => "dcgm",
            Source::Engine => "engine",
            Source::Roce => "roce",
            Source::Inband => "inband",
            Source::Push => "push",
        })
    }
}

/// One series' value, if it is a reading. Every quantity read (queue lengths, utilisation,
/// temperatures, watts, counters) is >= 0, so a negative value is a broken exporter and is
/// dropped per series, before any sum or max: summed, one -1000 would hide a queue of 100.
/// DCGM reports fields it cannot read as large sentinels (int64 blanks from 2^63 - 16, fp64
/// blanks from 2^47); no real reading comes near 2^47, so anything at or above it is absent,
/// as are NaN and infinities.
fn reading(v: f64) -> Option<f64> {
    const DCGM_FP64_BLANK: f64 = 140_737_488_355_328.0;
    (v.is_finite() && (0.0..DCGM_FP64_BLANK).contains(&v)).then_some(v)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn push_json_round_trip_and_unknown_fields() {
        let s: Sample = serde_json::from_str(r#"{"gpu_util": 0.5, "queue_depth": 3}"#).unwrap();
        assert_eq!(
            s,
            Sample {
                gpu_util: Some(0.5),
                queue_depth: Some(3.0),
                ..Sample::default()
            }
        );
        assert_eq!(
            serde_json::from_str::<Sample>("{}").unwrap(),
            Sample::default()
        );
        let err = serde_json::from_str::<Sample>(r#"{"gpu_utilisation": 0.5}"#).unwrap_err();
        assert!(
            err.to_string().contains("unknown field `gpu_utilisation`"),
            "{err}"
        );
        let back: Sample = serde_json::from_str(&serde_json::to_string(&s).unwrap()).unwrap();
        assert_eq!(back, s);
    }

    #[test]
    fn validate_names_every_bad_field() {
        assert_eq!(Sample::default().validate(), Ok(()));
        let ok = Sample {
            gpu_util: Some(1.0),
            fb_used: Some(0.0),
            kv_cache: Some(0.5),
            gpu_temp_c: Some(80.0),
            throttle: Some(0x48),
            ecn_rate: Some(0.0),
            ..Sample::default()
        };
        assert_eq!(ok.validate(), Ok(()));
        let bad = Sample {
            gpu_util: Some(1.5),
            kv_cache: Some(-0.1),
            queue_depth: Some(-1.0),
            power_w: Some(f64::INFINITY),
            throttle: Some(0x1),
            ..Sample::default()
        };
        let err = bad.validate().unwrap_err();
        for field in [
            "gpu_util = 1.5",
            "kv_cache = -0.1",
            "queue_depth = -1",
            "power_w = inf",
        ] {
            assert!(err.contains(field), "{field} missing from {err}");
        }
        assert!(
            err.contains("throttle = 0x1 has bits outside 0xe8"),
            "{err}"
        );
        let nan = Sample {
            fb_used: Some(f64::NAN),
            ..Sample::default()
        };
        assert!(nan.validate().unwrap_err().contains("fb_used = NaN"));
    }

    #[test]
    fn overlay_replaces_only_reported_fields() {
        let mut base = Sample {
            gpu_util: Some(0.2),
            queue_depth: Some(4.0),
            ..Sample::default()
        };
        base.overlay(&Sample {
            gpu_util: Some(0.9),
            ecn_rate: Some(10.0),
            ..Sample::default()
        });
        assert_eq!(
            base,
            Sample {
                gpu_util: Some(0.9),
                queue_depth: Some(4.0),
                ecn_rate: Some(10.0),
                ..Sample::default()
            }
        );
    }

    #[test]
    fn dcgm_blanks_are_absent() {
        assert_eq!(reading(42.0), Some(42.0));
        assert_eq!(reading(9_223_372_036_854_775_794.0), None);
        assert_eq!(reading(140_737_488_355_328.0), None);
        assert_eq!(reading(f64::NAN), None);
        assert_eq!(reading(-1000.0), None, "no quantity read is negative");
        assert_eq!(reading(f64::INFINITY), None);
        assert_eq!(reading(f64::NEG_INFINITY), None);
        assert_eq!(reading(0.0), Some(0.0));
    }
}
