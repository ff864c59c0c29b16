//! `[health]`, `[telemetry]` and `[policy]`: how backends are judged and steered.

use super::*;

/// `shorter`'s duration must be below `longer`'s.
pub(in crate::config) fn below(
    c: &mut Checker,
    p: &KeyPath,
    shorter: (&str, Option<&str>, Option<Duration>),
    longer: (&str, Option<Duration>),
    relation: &str,
) {
    let (Some(s), Some(l)) = (shorter.2, longer.1) else {
        return;
    };
    if s >= l {
        let shown = shorter
            .1
            .map_or_else(|| humantime::format_duration(s).to_string(), str::to_owned);
        c.err(
            &p.key(shorter.0),
            format!(
                "{shown:?} is not shorter than {p}.{} = \"{}\"; allowed: {relation}",
                longer.0,
                humantime::format_duration(l)
            ),
        );
    }
}

pub(in crate::config) fn health(
    c: &mut Checker,
    p: &KeyPath,
    r: RawHealth,
) -> Option<HealthConfig> {
    let d = HealthConfig::default();
    let interval = c.positive(&p.key("interval"), r.interval.as_deref(), d.interval);
    let timeout = c.positive(&p.key("timeout"), r.timeout.as_deref(), d.timeout);
    below(
        c,
        p,
        ("timeout", r.timeout.as_deref(), timeout),
        ("interval", interval),
        "a timeout shorter than the interval",
    );
    let rise = c.int(&p.key("rise"), r.rise, d.rise, 1, 10, "");
    let fall = c.int(&p.key("fall"), r.fall, d.fall, 1, 10, "");
    let out = HealthConfig {
        interval: interval?,
        timeout: timeout?,
        rise: rise?,
        fall: fall?,
    };
    (out.timeout < out.interval).then_some(out)
}

pub(in crate::config) fn telemetry(
    c: &mut Checker,
    p: &KeyPath,
    r: RawTelemetry,
) -> Option<TelemetryConfig> {
    let d = TelemetryConfig::default();
    let interval = c.positive(
        &p.key("scrape_interval"),
        r.scrape_interval.as_deref(),
        d.scrape_interval,
    );
    let timeout = c.positive(
        &p.key("scrape_timeout"),
        r.scrape_timeout.as_deref(),
        d.scrape_timeout,
    );
    let stale = c.positive(
        &p.key("stale_after"),
        r.stale_after.as_deref(),
        d.stale_after,
    );
    below(
        c,
        p,
        ("scrape_timeout", r.scrape_timeout.as_deref(), timeout),
        ("scrape_interval", interval),
        "a timeout shorter than the scrape interval",
    );
    if let (Some(i), Some(s)) = (interval, stale) {
        if s <= i {
            let shown = r.stale_after.as_deref().unwrap_or("3s");
            c.err(
                &p.key("stale_after"),
                format!(
                    "{shown:?} is not longer than {p}.scrape_interval = \"{}\"; allowed: longer \
                     than the scrape interval, e.g. 3 intervals",
                    humantime::format_duration(i)
                ),
            );
        }
    }
    let max = c.int(
        &p.key("max_concurrent_scrapes"),
        r.max_concurrent_scrapes,
        d.max_concurrent_scrapes,
        1,
        256,
        "",
    );
    let out = TelemetryConfig {
        scrape_interval: interval?,
        scrape_timeout: timeout?,
        stale_after: stale?,
        max_concurrent_scrapes: max?,
    };
    (out.scrape_timeout < out.scrape_interval && out.stale_after > out.scrape_interval)
        .then_some(out)
}

pub(in crate::config) fn policy(
    c: &mut Checker,
    p: &KeyPath,
    r: RawPolicy,
) -> Option<PolicyConfig> {
    let d = PolicyConfig::default();
    let unit = |v: f64| v > 0.0 && v <= 1.0;
    let ewma_alpha = c.num(
        &p.key("ewma_alpha"),
        r.ewma_alpha,
        d.ewma_alpha,
        unit,
        "0 < ewma_alpha <= 1",
    );
    let weight_levels = c.int(
        &p.key("weight_levels"),
        r.weight_levels,
        d.weight_levels,
        2,
        64,
        "",
    );
    let hysteresis = c.num(
        &p.key("hysteresis"),
        r.hysteresis,
        d.hysteresis,
        |v| (0.0..0.5).contains(&v),
        "0 <= hysteresis < 0.5",
    );
    let gpu_util_high = c.num(
        &p.key("gpu_util_high"),
        r.gpu_util_high,
        d.gpu_util_high,
        unit,
        "0 < gpu_util_high <= 1",
    );
    let kv_cache_high = c.num(
        &p.key("kv_cache_high"),
        r.kv_cache_high,
        d.kv_cache_high,
        unit,
        "0 < kv_cache_high <= 1",
    );
    let queue_depth_high = c.int(
        &p.key("queue_depth_high"),
        r.queue_depth_high,
        d.queue_depth_high,
        1,
        u32::MAX as i64,
        "",
    );
    let temp_high_c = c.num(
        &p.key("temp_high_c"),
        r.temp_high_c,
        d.temp_high_c,
        |v| v > 0.0 && v <= 150.0,
        "0 < temp_high_c <= 150",
    );
    let ecn = c.num(
        &p.key("ecn_rate_high"),
        r.ecn_rate_high,
        d.ecn_rate_high,
        |v| v > 0.0,
        "a number > 0 (marked packets per second)",
    );
    let cnp = c.num(
        &p.key("cnp_rate_high"),
        r.cnp_rate_high,
        d.cnp_rate_high,
        |v| v > 0.0,
        "a number > 0 (CNPs per second)",
    );
    let cooldown_base = c.positive(
        &p.key("cooldown_base"),
        r.cooldown_base.as_deref(),
        d.cooldown_base,
    );
    let cooldown_max = c.positive(
        &p.key("cooldown_max"),
        r.cooldown_max.as_deref(),
        d.cooldown_max,
    );
    if let (Some(b), Some(m)) = (cooldown_base, cooldown_max) {
        if m < b {
            let shown = r.cooldown_max.as_deref().unwrap_or("10m");
            c.err(
                &p.key("cooldown_max"),
                format!(
                    "{shown:?} is shorter than {p}.cooldown_base = \"{}\"; allowed: at least \
                     cooldown_base",
                    humantime::format_duration(b)
                ),
            );
        }
    }
    let flap_window = c.positive(
        &p.key("flap_window"),
        r.flap_window.as_deref(),
        d.flap_window,
    );
    let stable_period = c.positive(
        &p.key("stable_period"),
        r.stable_period.as_deref(),
        d.stable_period,
    );
    let slow_start = c.duration(&p.key("slow_start"), r.slow_start.as_deref(), d.slow_start);
    let shed = match r.shed.as_deref() {
        None => Some(d.shed),
        s => c.keyword(&p.key("shed"), s, ShedMode::Drop).map(Some),
    };
    let tenant_busy_fraction = c.num(
        &p.key("tenant_busy_fraction"),
        r.tenant_busy_fraction,
        d.tenant_busy_fraction,
        unit,
        "0 < tenant_busy_fraction <= 1",
    );
    let out = PolicyConfig {
        ewma_alpha: ewma_alpha?,
        weight_levels: weight_levels?,
        hysteresis: hysteresis?,
        gpu_util_high: gpu_util_high?,
        kv_cache_high: kv_cache_high?,
        queue_depth_high: queue_depth_high?,
        temp_high_c: temp_high_c?,
        ecn_rate_high: ecn?,
        cnp_rate_high: cnp?,
        cooldown_base: cooldown_base?,
        cooldown_max: cooldown_max?,
        flap_window: flap_window?,
        stable_period: stable_period?,
        slow_start: slow_start?,
        tenant_busy_fraction: tenant_busy_fraction?,
        shed: shed?,
    };
    (out.cooldown_max >= out.cooldown_base).then_some(out)
}
