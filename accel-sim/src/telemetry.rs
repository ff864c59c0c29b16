//! The accelerator's telemetry pages, rendered from the model's state at scrape time in the
//! formats Sluice reads (lb-userspace/src/telemetry/): vLLM's `/metrics`, dcgm-exporter's
//! page and node_exporter's `infiniband` collector for the RoCE port.
//!
//! What the GPU figures derive from: [`GPUS`] H100 SXM 80GB per simulated accelerator (the
//! model's tensor-parallel pair), which share the work evenly and so read the same:
//! - utilisation: the fraction of the last second the engine spent in steps;
//! - framebuffer: constant at 90 % of 81559 MiB, because vLLM preallocates its KV cache
//!   (`gpu_memory_utilization` 0.9) whatever the load; KV use is on the vLLM page;
//! - power 75 W idle to 700 W (the H100 SXM's TDP) per GPU with utilisation, times the
//!   throttle factor;
//! - temperature 32 to 72 degrees C with utilisation; 91 while throttled;
//! - SM clock 1980 MHz busy, 345 idle, 1980 x factor when throttled;
//! - clock event reasons: 0x1 (idle) when idle, 0 busy, 0x48 (hardware slowdown + hardware
//!   thermal) while throttled: both bits are in Sluice's throttle mask.
//!
//! RoCE: every processed token moves [`ROCE_PACKETS_PER_TOKEN`] packets over the fabric (the
//! tensor-parallel all-reduces); under `congest` a share `(1 - factor) / 2` of them arrive
//! ECN-marked, and one CNP is sent (and one handled) per 10 marked packets. These ratios are
//! assumptions of the lab, chosen so that congestion shows as rates in the thousands per
//! second and that the rate follows the accelerator's traffic.

use std::{collections::VecDeque, fmt::Write as _};

use crate::model::{Totals, ITL_BUCKETS, TTFT_BUCKETS};

/// Assumption: a token's all-reduce traffic for a 70B model at TP 2 (80 layers, two
/// all-reduces of an 8192-wide fp8 activation each) is about 1.3 MB, ~320 packets of 4 KiB.
pub const ROCE_PACKETS_PER_TOKEN: f64 = 320.0;
/// CNPs per ECN-marked packet (assumption).
pub const CNP_PER_ECN: f64 = 0.1;
pub const FB_TOTAL_MIB: f64 = 81_559.0;
/// GPUs per simulated accelerator (tensor parallel 2, as the model's parameters assume).
pub const GPUS: usize = 2;
pub const FB_USED_FRACTION: f64 = 0.9;
const SM_CLOCK_MAX_MHZ: f64 = 1980.0;
const SM_CLOCK_IDLE_MHZ: f64 = 345.0;
/// DCGM clock event reasons.
const REASON_IDLE: u64 = 0x1;
const REASON_THROTTLED: u64 = 0x8 | 0x40;

/// Cumulative RoCE counters of the accelerator's port.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct Fabric {
    pub packets: f64,
    pub ecn_marked: f64,
    pub cnp_sent: f64,
    pub cnp_handled: f64,
}

impl Fabric {
    /// Accounts a step that processed `tokens`; `congest` is the congestion factor in force.
    pub fn on_step(&mut self, tokens: u64, congest: Option<f64>) {
        let packets = tokens as f64 * ROCE_PACKETS_PER_TOKEN;
        self.packets += packets;
        if let Some(f) = congest {
            let marked = packets * (1.0 - f) / 2.0;
            self.ecn_marked += marked;
            self.cnp_sent += marked * CNP_PER_ECN;
            self.cnp_handled += marked * CNP_PER_ECN;
        }
    }
}

/// The steps of the last second: utilisation and tokens per second.
#[derive(Clone, Debug, Default)]
pub struct Recent {
    /// (start, end, tokens emitted), seconds.
    steps: VecDeque<(f64, f64, u64)>,
}

const WINDOW_S: f64 = 1.0;

impl Recent {
    pub fn push(&mut self, start_s: f64, end_s: f64, tokens: u64) {
        self.steps.push_back((start_s, end_s, tokens));
        while self
            .steps
            .front()
            .is_some_and(|&(_, end, _)| end < end_s - WINDOW_S)
        {
            self.steps.pop_front();
        }
    }

    /// 0..=1: the share of `[now - 1 s, now]` spent in steps.
    pub fn utilisation(&self, now_s: f64) -> f64 {
        let from = now_s - WINDOW_S;
        // A fold from +0.0: an empty sum of f64 is -0.0, which a page would show as "-0".
        let busy = self
            .steps
            .iter()
            .map(|&(s, e, _)| (e.min(now_s) - s.max(from)).max(0.0))
            .fold(0.0, |a, b| a + b);
        (busy / WINDOW_S).clamp(0.0, 1.0)
    }

    /// Tokens emitted by steps that ended in `(now - 1 s, now]`.
    pub fn tokens_per_s(&self, now_s: f64) -> f64 {
        let n: u64 = self
            .steps
            .iter()
            .filter(|&&(_, e, _)| e > now_s - WINDOW_S && e <= now_s)
            .map(|&(_, _, t)| t)
            .sum();
        n as f64 / WINDOW_S
    }
}

/// Everything a page shows, taken under the state lock.
#[derive(Clone, Debug)]
pub struct Snapshot {
    pub name: String,
    pub model: String,
    /// One per GPU ([`GPUS`]).
    pub gpu_uuids: Vec<String>,
    pub running: usize,
    pub waiting: usize,
    pub kv_fraction: f64,
    pub totals: Totals,
    pub utilisation: f64,
    /// Throttle factor in force.
    pub throttle: Option<f64>,
    pub fabric: Fabric,
}

impl Snapshot {
    /// What a lying exporter shows: the same accelerator idle (nothing running or waiting,
    /// no KV in use, no utilisation, no throttle), its counters where they stand.
    pub fn idle(&self) -> Snapshot {
        Snapshot {
            running: 0,
            waiting: 0,
            kv_fraction: 0.0,
            utilisation: 0.0,
            throttle: None,
            ..self.clone()
        }
    }
}

/// `GET /metrics`: vLLM's V1 engine metrics.
pub fn vllm_page(s: &Snapshot) -> String {
    let labels = format!("engine=\"0\",model_name=\"{}\"", s.model);
    let mut out = String::new();
    let mut metric = |name: &str, kind: &str, help: &str, value: f64| {
        let _ = write!(
            out,
            "# HELP {name} {help}\n# TYPE {name} {kind}\n{name}{{{labels}}} {value:?}\n"
        );
    };
    metric(
        "vllm:num_requests_running",
        "gauge",
        "Number of requests in model execution batches.",
        s.running as f64,
    );
    metric(
        "vllm:num_requests_waiting",
        "gauge",
        "Number of requests waiting to be processed.",
        s.waiting as f64,
    );
    metric(
        "vllm:kv_cache_usage_perc",
        "gauge",
        "KV-cache usage. 1 means 100 percent usage.",
        s.kv_fraction,
    );
    metric(
        "vllm:num_preemptions_total",
        "counter",
        "Cumulative number of preemption from the engine.",
        s.totals.preemptions as f64,
    );
    // vLLM V1's prefix cache counters (vllm/v1/metrics/loggers.py, PrometheusStatLogger:
    // `Counter(name="vllm:prefix_cache_queries")` and `"vllm:prefix_cache_hits"`, which
    // prometheus_client exposes with `_total`), in tokens.
    metric(
        "vllm:prefix_cache_queries_total",
        "counter",
        "Prefix cache queries, in terms of number of queried tokens.",
        s.totals.prefix_cache_queries as f64,
    );
    metric(
        "vllm:prefix_cache_hits_total",
        "counter",
        "Prefix cache hits, in terms of number of cached tokens.",
        s.totals.prefix_cache_hits as f64,
    );
    metric(
        "vllm:prompt_tokens_total",
        "counter",
        "Number of prefill tokens processed.",
        s.totals.prompt_tokens as f64,
    );
    metric(
        "vllm:generation_tokens_total",
        "counter",
        "Number of generation tokens processed.",
        s.totals.generation_tokens as f64,
    );
    let _ = write!(
        out,
        "# HELP vllm:request_success_total Count of successfully processed requests.\n\
         # TYPE vllm:request_success_total counter\n\
         vllm:request_success_total{{engine=\"0\",finished_reason=\"length\",model_name=\"{}\"}} {:?}\n\
         vllm:request_success_total{{engine=\"0\",finished_reason=\"abort\",model_name=\"{}\"}} {:?}\n",
        s.model,
        s.totals.finished as f64,
        s.model,
        s.totals.cancelled as f64
    );
    let t = &s.totals;
    let mut histogram =
        |name: &str, help: &str, bounds: &[f64], buckets: &[u64], count: u64, sum: f64| {
            // Observations over the last bound are in +Inf only: the count, not the buckets' sum.
            let _ = write!(out, "# HELP {name} {help}\n# TYPE {name} histogram\n");
            let mut cumulative = 0u64;
            for (le, n) in bounds.iter().zip(buckets) {
                cumulative += n;
                let _ = writeln!(
                    out,
                    "{name}_bucket{{engine=\"0\",le=\"{le:?}\",model_name=\"{}\"}} {:?}",
                    s.model, cumulative as f64
                );
            }
            let _ = write!(
                out,
                "{name}_bucket{{engine=\"0\",le=\"+Inf\",model_name=\"{m}\"}} {c:?}\n\
             {name}_count{{{labels}}} {c:?}\n{name}_sum{{{labels}}} {sum:?}\n",
                m = s.model,
                c = count as f64,
            );
        };
    histogram(
        "vllm:time_to_first_token_seconds",
        "Histogram of time to first token in seconds.",
        &TTFT_BUCKETS,
        &t.ttft_buckets,
        t.ttft_count,
        t.ttft_sum_s,
    );
    // vLLM 0.10 and 0.11 serve the same observations under both names, the older one
    // deprecated; Sluice reads either.
    histogram(
        "vllm:time_per_output_token_seconds",
        "Histogram of time per output token in seconds.DEPRECATED: Use \
         vllm:inter_token_latency_seconds instead.",
        &ITL_BUCKETS,
        &t.itl_buckets,
        t.itl_count,
        t.itl_sum_s,
    );
    histogram(
        "vllm:inter_token_latency_seconds",
        "Histogram of inter-token latency in seconds.",
        &ITL_BUCKETS,
        &t.itl_buckets,
        t.itl_count,
        t.itl_sum_s,
    );
    out
}

/// `GET /dcgm`: dcgm-exporter's page for the accelerator's GPUs: each field's HELP and TYPE,
/// then one series per GPU.
pub fn dcgm_page(s: &Snapshot) -> String {
    let u = s.utilisation;
    let busy = u > 0.0;
    let (clock, temp, reasons, power) = match s.throttle {
        Some(f) => (
            SM_CLOCK_MAX_MHZ * f,
            91.0,
            REASON_THROTTLED,
            (75.0 + 625.0 * u) * f,
        ),
        None if busy => (SM_CLOCK_MAX_MHZ, 32.0 + 40.0 * u, 0, 75.0 + 625.0 * u),
        None => (SM_CLOCK_IDLE_MHZ, 32.0, REASON_IDLE, 75.0),
    };
    let fb_used = (FB_TOTAL_MIB * FB_USED_FRACTION).round();
    let labels: Vec<String> = s
        .gpu_uuids
        .iter()
        .enumerate()
        .map(|(i, uuid)| {
            format!(
                "gpu=\"{i}\",UUID=\"{uuid}\",pci_bus_id=\"00000000:{:02X}:00.0\",device=\"nvidia{i}\",\
                 modelName=\"NVIDIA H100 80GB HBM3\",Hostname=\"{}\",DCGM_FI_DRIVER_VERSION=\"550.90.07\"",
                0x18 + 0x12 * i,
                s.name
            )
        })
        .collect();
    let fields: [(&str, &str, String); 7] = [
        (
            "DCGM_FI_DEV_SM_CLOCK",
            "SM clock frequency (in MHz).",
            format!("{}", clock.round()),
        ),
        (
            "DCGM_FI_DEV_GPU_TEMP",
            "GPU temperature (in C).",
            format!("{}", temp.round()),
        ),
        (
            "DCGM_FI_DEV_POWER_USAGE",
            "Power draw (in W).",
            format!("{:.3}", power),
        ),
        (
            "DCGM_FI_DEV_GPU_UTIL",
            "GPU utilization (in %).",
            format!("{}", (u * 100.0).round()),
        ),
        (
            "DCGM_FI_DEV_FB_FREE",
            "Framebuffer memory free (in MiB).",
            format!("{}", FB_TOTAL_MIB - fb_used),
        ),
        (
            "DCGM_FI_DEV_FB_USED",
            "Framebuffer memory used (in MiB).",
            format!("{fb_used}"),
        ),
        (
            "DCGM_FI_DEV_CLOCK_THROTTLE_REASONS",
            "Current clock throttle reasons (bitmask of DCGM_CLOCKS_THROTTLE_REASON_*)",
            format!("{reasons}"),
        ),
    ];
    let mut out = String::new();
    for (name, help, value) in fields {
        let _ = write!(out, "# HELP {name} {help}\n# TYPE {name} gauge\n");
        for l in &labels {
            let _ = writeln!(out, "{name}{{{l}}} {value}");
        }
    }
    out
}

/// The RoCE device and port the page reports, as Sluice's `roce` exporter config selects them.
pub const ROCE_DEVICE: &str = "mlx5_0";
pub const ROCE_PORT: &str = "1";

/// `GET /roce`: node_exporter's infiniband counters of the accelerator's RoCE port.
pub fn roce_page(s: &Snapshot) -> String {
    let f = &s.fabric;
    let counters = [
        (
            "node_infiniband_port_packets_transmitted_total",
            "Number of packets transmitted on all VLs by this port (including errors)",
            f.packets,
        ),
        (
            "node_infiniband_np_ecn_marked_roce_packets_received_total",
            "The number of RoCEv2 packets received by the notification point which were marked for experiencing the congestion (ECN bits where '11' on the ingress RoCE traffic) .",
            f.ecn_marked,
        ),
        (
            "node_infiniband_np_cnp_packets_sent_total",
            "The number of CNP packets sent by the Notification Point when it noticed congestion experienced in the RoCEv2 IP header (ECN bits).",
            f.cnp_sent,
        ),
        (
            "node_infiniband_rp_cnp_packets_handled_total",
            "The number of CNP packets handled by the Reaction Point HCA to throttle the transmission rate.",
            f.cnp_handled,
        ),
    ];
    let mut out = String::new();
    for (name, help, value) in counters {
        // Counters are whole packets.
        let _ = write!(
            out,
            "# HELP {name} {help}\n# TYPE {name} counter\n\
             {name}{{device=\"{ROCE_DEVICE}\",port=\"{ROCE_PORT}\"}} {}\n",
            value.floor()
        );
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::model::{Engine, Params};
    use sluice::{
        config::EngineKind,
        telemetry::{dcgm, engine, prom, roce, THROTTLE_MASK},
    };

    /// A snapshot of an engine with work in it.
    fn busy_snapshot(throttle: Option<f64>, congest: Option<f64>) -> Snapshot {
        let mut e = Engine::new(Params::default()).unwrap();
        for id in 0..40 {
            e.submit(id, 300, 100, 0.0).unwrap();
        }
        let mut now = 0.0;
        let (mut recent, mut fabric) = (Recent::default(), Fabric::default());
        for _ in 0..30 {
            let step = e.step(now).unwrap();
            recent.push(now, now + step.duration_s, step.events.len() as u64);
            fabric.on_step(step.tokens, congest);
            now += step.duration_s;
        }
        Snapshot {
            name: "gpu0".into(),
            model: "sluice-sim/llama-70b".into(),
            gpu_uuids: (0..GPUS)
                .map(|i| format!("GPU-00000000-0000-4000-8000-00000000000{i}"))
                .collect(),
            running: e.running(),
            waiting: e.waiting(),
            kv_fraction: e.kv_used_fraction(),
            totals: e.totals().clone(),
            utilisation: recent.utilisation(now),
            throttle,
            fabric,
        }
    }

    #[test]
    fn the_vllm_page_reads_back_through_sluices_parser() {
        let s = busy_snapshot(None, None);
        let text = vllm_page(&s);
        let page = prom::parse(&text).unwrap_or_else(|e| panic!("{e}\n{text}"));
        let got = engine::extract(&page, EngineKind::Vllm, Some("sluice-sim/llama-70b")).unwrap();
        assert_eq!(got.running, Some(32.0));
        assert_eq!(got.queue_depth, Some(8.0));
        assert_eq!(got.kv_cache, Some(s.kv_fraction));
        assert!(s.kv_fraction > 0.5, "{}", s.kv_fraction);
        // Prefix cache counters, in tokens: every prompt was queried.
        let counter = |name: &str| page.get(name).map(|x| x.value).next();
        assert_eq!(
            counter("vllm:prefix_cache_queries_total"),
            Some(s.totals.prefix_cache_queries as f64)
        );
        assert!(s.totals.prefix_cache_queries > 0);
        assert_eq!(counter("vllm:prefix_cache_hits_total"), Some(0.0));
        // The histogram is cumulative and ends at the count.
        let buckets: Vec<f64> = page
            .get("vllm:time_to_first_token_seconds_bucket")
            .map(|x| x.value)
            .collect();
        assert!(buckets.windows(2).all(|w| w[0] <= w[1]));
        assert_eq!(*buckets.last().unwrap(), 32.0);
        assert_eq!(buckets.len(), TTFT_BUCKETS.len() + 1);
        // Both inter-token histograms, in vLLM's bucket layout, with the model's totals; the
        // parser prefers the newer name.
        for name in [
            "vllm:inter_token_latency_seconds",
            "vllm:time_per_output_token_seconds",
        ] {
            let buckets: Vec<f64> = page
                .get(&format!("{name}_bucket"))
                .map(|x| x.value)
                .collect();
            assert_eq!(buckets.len(), ITL_BUCKETS.len() + 1, "{name}");
            assert!(buckets.windows(2).all(|w| w[0] <= w[1]));
            assert_eq!(*buckets.last().unwrap(), s.totals.itl_count as f64);
        }
        let tpot =
            engine::tpot_totals(&page, EngineKind::Vllm, Some("sluice-sim/llama-70b")).unwrap();
        assert_eq!(tpot.count, s.totals.itl_count as f64);
        assert_eq!(tpot.sum_s, s.totals.itl_sum_s);
        assert!(tpot.count > 0.0);
    }

    /// The mean time per output token Sluice derives from two scrapes is the model's step
    /// time, and half speed doubles it.
    #[test]
    fn time_per_output_token_between_scrapes_follows_the_speed() {
        let mean = |speed: f64| {
            let mut e = Engine::new(Params::default()).unwrap();
            e.set_speed(speed);
            for id in 0..8 {
                e.submit(id, 200, 400, 0.0).unwrap();
            }
            let mut now = 0.0;
            let mut tracker = engine::TpotTracker::default();
            let mut scrape = |e: &Engine| {
                let s = Snapshot {
                    totals: e.totals().clone(),
                    ..busy_snapshot(None, None)
                };
                let text = vllm_page(&s);
                let page = prom::parse(&text).unwrap();
                tracker.observe(engine::tpot_totals(&page, EngineKind::Vllm, None))
            };
            // Past the prefills, then one second of decode steps.
            while now < 1.0 {
                now += e.step(now).unwrap().duration_s;
            }
            assert_eq!(scrape(&e), None, "a first scrape has no interval");
            let mut steps = Vec::new();
            while now < 2.0 {
                let d = e.step(now).unwrap().duration_s;
                steps.push(d);
                now += d;
            }
            let got = scrape(&e).unwrap();
            let want = steps.iter().sum::<f64>() / steps.len() as f64;
            assert!((got - want).abs() < 1e-9, "{got} against the steps' {want}");
            assert_eq!(scrape(&e), None, "no token, no reading");
            got
        };
        let (full, half) = (mean(1.0), mean(0.5));
        assert!((0.0178..0.0195).contains(&full), "{full}");
        assert!((half / full - 2.0).abs() < 0.01, "{half} vs {full}");
    }

    #[test]
    fn the_dcgm_page_reads_back_healthy_and_throttled() {
        let healthy = busy_snapshot(None, None);
        let text = dcgm_page(&healthy);
        let page = prom::parse(&text).unwrap_or_else(|e| panic!("{e}\n{text}"));
        let got = dcgm::extract(&page, &["0".into(), "1".into()], &[]).unwrap();
        assert_eq!(got.gpu_util, Some(1.0));
        assert_eq!(got.throttle, Some(0));
        assert_eq!(got.fb_used, Some(73_403.0 / FB_TOTAL_MIB));
        assert_eq!(got.gpu_temp_c, Some(72.0));
        assert_eq!(got.power_w, Some(1400.0), "two GPUs at 700 W");
        let one = dcgm::extract(&page, &["1".into()], &[]).unwrap();
        assert_eq!(one.power_w, Some(700.0));

        let throttled = busy_snapshot(Some(0.4), None);
        let page_text = dcgm_page(&throttled);
        let got = dcgm::extract(&prom::parse(&page_text).unwrap(), &[], &[]).unwrap();
        assert_eq!(got.throttle, Some(0x48));
        assert_eq!(got.throttle.unwrap() & THROTTLE_MASK, 0x48);
        assert_eq!(got.gpu_temp_c, Some(91.0));
        assert!(page_text.contains("DCGM_FI_DEV_SM_CLOCK{") && page_text.contains("} 792\n"));

        let idle = Snapshot {
            utilisation: 0.0,
            ..healthy
        };
        let got = dcgm::extract(&prom::parse(&dcgm_page(&idle)).unwrap(), &[], &[]).unwrap();
        // Idle (0x1) is not a throttle reason Sluice counts.
        assert_eq!((got.gpu_util, got.throttle), (Some(0.0), Some(0)));
    }

    /// A lying exporter's pages read back through Sluice's parsers as an idle, unthrottled
    /// accelerator, whatever load and throttle the snapshot it lies about carries.
    #[test]
    fn a_lying_snapshot_reads_back_idle() {
        let busy = busy_snapshot(Some(0.4), Some(0.5));
        let lie = busy.idle();
        let text = vllm_page(&lie);
        let vllm = prom::parse(&text).unwrap();
        let got = engine::extract(&vllm, EngineKind::Vllm, Some("sluice-sim/llama-70b")).unwrap();
        assert_eq!(
            (got.running, got.queue_depth, got.kv_cache),
            (Some(0.0), Some(0.0), Some(0.0))
        );
        let dcgm = dcgm::extract(&prom::parse(&dcgm_page(&lie)).unwrap(), &[], &[]).unwrap();
        assert_eq!((dcgm.gpu_util, dcgm.throttle), (Some(0.0), Some(0)));
        // The truth it hides: busy and throttled.
        let text = vllm_page(&busy);
        let truth = engine::extract(&prom::parse(&text).unwrap(), EngineKind::Vllm, None).unwrap();
        assert_eq!(truth.running, Some(32.0));
        let truth = dcgm::extract(&prom::parse(&dcgm_page(&busy)).unwrap(), &[], &[]).unwrap();
        assert_eq!(truth.throttle, Some(0x48));
        // Counters stand where they were: no rate, no inter-token reading from them.
        assert_eq!(lie.totals, busy.totals);
        assert_eq!(lie.fabric, busy.fabric);
    }

    #[test]
    fn the_roce_page_reads_back_and_congestion_shows_as_rates() {
        use std::time::{Duration, Instant};
        let mut fabric = Fabric::default();
        let read = |f: &Fabric| {
            let s = Snapshot {
                fabric: f.clone(),
                ..busy_snapshot(None, None)
            };
            let text = roce_page(&s);
            let page = prom::parse(&text).unwrap_or_else(|e| panic!("{e}\n{text}"));
            roce::exporter_counters(&page, ROCE_DEVICE, ROCE_PORT).unwrap()
        };
        let mut tracker = roce::RateTracker::default();
        let t0 = Instant::now();
        assert!(tracker.observe(read(&fabric), t0).is_none());
        // One second of 1000 tokens/s, healthy: no marks.
        fabric.on_step(1000, None);
        let c = read(&fabric);
        let rates = tracker
            .observe(c.clone(), t0 + Duration::from_secs(1))
            .unwrap();
        let sample = roce::sample(&c, &rates);
        assert_eq!((sample.ecn_rate, sample.cnp_rate), (Some(0.0), Some(0.0)));
        // Another second congested at 0.6: 320k packets, 20 % marked, a tenth of those as CNPs
        // sent and handled.
        fabric.on_step(1000, Some(0.6));
        let c = read(&fabric);
        let rates = tracker
            .observe(c.clone(), t0 + Duration::from_secs(2))
            .unwrap();
        let sample = roce::sample(&c, &rates);
        assert_eq!(sample.ecn_rate, Some(64_000.0));
        assert_eq!(sample.cnp_rate, Some(12_800.0));
    }

    #[test]
    fn utilisation_and_token_rate_cover_the_last_second() {
        let mut r = Recent::default();
        r.push(0.0, 0.25, 10);
        r.push(0.5, 1.0, 20);
        assert!((r.utilisation(1.0) - 0.75).abs() < 1e-12);
        assert_eq!(r.tokens_per_s(1.0), 30.0);
        // Half a second later the first step has left the window.
        assert!((r.utilisation(1.5) - 0.5).abs() < 1e-12);
        assert_eq!(r.tokens_per_s(1.5), 20.0);
        assert_eq!(r.utilisation(3.0), 0.0);
        assert!(Recent::default().utilisation(1.0).is_sign_positive());
        r.push(3.0, 3.1, 1);
        assert_eq!(r.tokens_per_s(3.1), 1.0);
    }
}
