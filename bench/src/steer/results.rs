//! A cell's result: what it saw and gathered, its result document, and the aims judged over
//! the cells of a run.

use std::collections::BTreeMap;

use anyhow::{bail, Result};
use serde_json::{json, Value};
use sluice_tests::daemon_lab::DaemonLab;

use super::{
    plot::{Point, Sample},
    scenario::{self, Policy, Scenario},
    stats::{self, Record},
    tenants, AFFINITY_SECS, AVOID_BOUND_MS, VIP,
};

/// What was seen while the load ran.
pub(super) struct Observed {
    /// The faults fired: seconds into the cell, and the label.
    pub(super) fired: Vec<(f64, String)>,
    /// One sample a second.
    pub(super) timeline: Vec<Sample>,
    /// The steering flags at every tick (the samples among them).
    pub(super) flags: Vec<Sample>,
    /// The accelerators' KV use at each sample.
    pub(super) kv_samples: Vec<Vec<f64>>,
}

/// What the daemon, the load generator and the accelerators report after the load.
pub(super) struct Gathered {
    pub(super) events: Vec<Value>,
    /// The steady load generator's summary.
    pub(super) summary: Value,
    /// The burst's load generator's summary, in a scenario with a burst.
    pub(super) burst_summary: Option<Value>,
    /// From the start to the end of the last generator's last request, seconds.
    pub(super) elapsed_s: f64,
    /// `GET /v1/tenants` at the end, with tenants configured.
    pub(super) tenant_counters: Option<Value>,
    pub(super) records: Vec<Record>,
    pub(super) shed_counters: BTreeMap<String, u64>,
    pub(super) cache_queries: u64,
    pub(super) cache_hits: u64,
}

/// What a cell's result needs besides what it saw and gathered.
pub(super) struct CellFacts<'a> {
    pub(super) scenario: Scenario,
    pub(super) policy: Policy,
    /// Offered requests per second.
    pub(super) rate: f64,
    /// Offered by the burst's generator, besides `rate`, while it runs.
    pub(super) burst_rate: Option<f64>,
    /// Seconds of load.
    pub(super) secs: f64,
    /// When the load started (the daemon's events are counted from here).
    pub(super) since_ms: u64,
    pub(super) names: &'a [String],
    pub(super) ips: &'a [String],
}

/// A cell's result (`ttfts`: every request's time to first token, ms).
pub(super) fn cell_json(c: &CellFacts, seen: &Observed, got: &Gathered, ttfts: &[f64]) -> Value {
    let (scenario, secs, names) = (c.scenario, c.secs, c.names);
    let (records, summary, fired) = (&got.records, &got.summary, &seen.fired);
    let killed = scenario.killed().map(|i| names[i].clone());
    let faulty: Vec<&str> = if scenario.faults().is_empty() && scenario.slow().is_none() {
        Vec::new()
    } else {
        vec![names[scenario::FAULTY].as_str()]
    };
    let kill = killed
        .as_deref()
        .zip(fired.first())
        .map(|(backend, (at, _))| stats::Kill {
            backend,
            at_ms: at * 1000.0,
            bound_ms: AVOID_BOUND_MS,
        });
    let (completed, broken, on_killed) = stats::sessions(records, kill);
    let changes = stats::weight_changes(&got.events, c.since_ms, c.ips);
    let total_changes: u64 = changes.values().sum();
    let max_changes = changes.values().copied().max().unwrap_or(0);
    let mut after = Vec::new();
    for (k, (at, label)) in fired.iter().enumerate() {
        let to = fired.get(k + 1).map_or(f64::MAX, |f| f.0) * 1000.0;
        // New sessions from 2 s after the fault (detection and one scrape) to the next one.
        after.push(json!({
            "fault": label,
            "at_s": (at * 10.0).round() / 10.0,
            "new_sessions": stats::landed(records, at * 1000.0 + 2000.0, to),
            "ttft_ms": stats::quantiles(&window_ttfts(records, at * 1000.0, to)),
        }));
    }
    json!({
        "scenario": scenario.name(),
        "policy": c.policy.name(),
        "offered_rps": (c.rate * 1000.0).round() / 1000.0,
        "duration_s": secs,
        "ttft_ms": stats::quantiles(ttfts),
        "itl_ms": itl(summary),
        // Over the generators' whole run (requests start for `duration`, then finish).
        "goodput_tokens_per_s": match &got.burst_summary {
            Some(_) => json!(stats::goodput(records, got.elapsed_s)),
            None => summary["summary"]["goodput_tokens_per_s"].clone(),
        },
        // A second figure beside goodput: only streams that met a TTFT SLO count.
        "slo_goodput": {
            "ttft_slo_ms": stats::TTFT_SLO_MS,
            "tokens_per_s": stats::slo_goodput(
                records,
                stats::TTFT_SLO_MS,
                got.elapsed_s,
            ),
        },
        "sessions": {
            "completed": completed,
            "broken": broken,
            "broken_on_killed_backend": on_killed,
            "broken_by_reason": stats::broken_by_reason(records),
            "per_backend": stats::landed(records, 0.0, f64::MAX),
        },
        // Requests refused (or reset before any byte) and tried again, and their retries.
        "retries": {
            "requests_retried": summary["summary"]["requests_retried"],
            "retries": summary["summary"]["retries"],
        },
        // The faulty backend's streams in flight at the fault: the p99 inter-token latency
        // their later gaps alone set (`p99_floor_ms`), whatever the policy does after.
        "itl_floor": faulty
            .first()
            .map(|b| &summary["in_flight_at_mark"]["per_backend"][*b])
            .filter(|f| !f.is_null()),
        "imbalance": (stats::imbalance(&seen.kv_samples) * 1000.0).round() / 1000.0,
        "affinity_kept": stats::affinity_kept(records, &faulty),
        // What affinity saves: prompt tokens served from the accelerators' prefix caches.
        "prefix_cache": stats::prefix_cache(got.cache_queries, got.cache_hits, records),
        "affinity_lost": stats::affinity_lost(records, &faulty, names, &seen.flags, AFFINITY_SECS),
        "weight_changes": total_changes,
        "weight_changes_per_backend": changes,
        "weight_changes_per_backend_per_10min": (max_changes as f64 * 600.0 / secs).round(),
        "after_faults": after,
        "new_sessions_failed_for_ms_after_kill": fired
            .first()
            .filter(|_| killed.is_some())
            .map(|(at, _)| stats::avoided_after_ms(records, at * 1000.0).round()),
        "backends": names,
        "timeline": seen.timeline.iter().map(|s| json!({
            "t_s": (s.t * 10.0).round() / 10.0,
            "weight": s.points.iter().map(|p| p.weight).collect::<Vec<_>>(),
            "state": s.points.iter().map(|p| p.state.clone()).collect::<Vec<_>>(),
            "kv": s.points.iter().map(|p| p.kv.map(|k| (k * 1000.0).round() / 1000.0)).collect::<Vec<_>>(),
            "full": s.points.iter().map(|p| p.full).collect::<Vec<_>>(),
            "waiting": s.points.iter().map(|p| p.waiting).collect::<Vec<_>>(),
            "telemetry_age_s": s.points.iter().map(|p| p.telemetry_age_s.map(|a| (a * 1000.0).round() / 1000.0)).collect::<Vec<_>>(),
        })).collect::<Vec<_>>(),
        // Admission: the shed level's changes (s into the cell) and the data plane's
        // refusals, by priority class (the whole VIP) or for want of a backend with room.
        "shed_changes": stats::shed_changes(&got.events, c.since_ms),
        "shed_counters": got.shed_counters,
        // Per tenant (by the client's prefix): over the run and of the requests started in
        // the burst window, in both the burst's cell and its calm one.
        "tenants": scenario.burst_window().map(|(from, to)| {
            tenants::per_tenant(records, got.elapsed_s, from * secs * 1000.0, to * secs * 1000.0)
        }),
        "tenant_counters": got.tenant_counters,
        "burst": c.burst_rate.map(|r| json!({
            "offered_rps": (r * 1000.0).round() / 1000.0,
            "generator_summary": got.burst_summary,
        })),
        "generator_summary": summary,
    })
}

/// TTFTs of the requests started in `[from_ms, to_ms)`.
fn window_ttfts(records: &[Record], from_ms: f64, to_ms: f64) -> Vec<f64> {
    records
        .iter()
        .filter(|r| r.start_ms >= from_ms && r.start_ms < to_ms)
        .filter_map(|r| r.ttft_ms)
        .collect()
}

/// The inter-token latency quantiles of the generator's summary (over every gap).
fn itl(summary: &Value) -> Value {
    summary["summary"]["itl_ms"].clone()
}

/// The VIP's backends from the admin API.
pub(super) fn backends_json(lab: &DaemonLab) -> Result<Vec<Value>> {
    let (code, v) = lab.api("GET", &format!("/v1/vips/{VIP}"), None)?;
    if code != 200 {
        bail!("GET /v1/vips/{VIP}: {code} {v}");
    }
    Ok(v["backends"].as_array().cloned().unwrap_or_default())
}

/// One timeline sample: weights and states from the daemon, KV use and requests from the
/// accelerators.
pub(super) fn sample(lab: &DaemonLab, addrs: &[String], t: f64) -> Sample {
    let mut s = steering(lab, addrs, t);
    for (i, p) in s.points.iter_mut().enumerate() {
        let engine = lab
            .accel_request(i, "GET", "/state", None)
            .ok()
            .and_then(|(c, v)| (c == 200).then_some(v));
        let engine = |k: &str| engine.as_ref().map(|v| v[k].clone());
        p.kv = engine("kv_used_fraction").and_then(|v| v.as_f64());
        p.running = engine("running").and_then(|v| v.as_u64());
        p.waiting = engine("waiting").and_then(|v| v.as_u64());
    }
    s
}

/// Weights, steering states, full flags and session counts from the daemon alone (one admin
/// API call): what the data plane applies to new sessions.
pub(super) fn steering(lab: &DaemonLab, addrs: &[String], t: f64) -> Sample {
    let daemon: BTreeMap<String, Value> = backends_json(lab)
        .unwrap_or_default()
        .into_iter()
        .filter_map(|b| Some((b["address"].as_str()?.to_owned(), b)))
        .collect();
    let points = addrs
        .iter()
        .map(|a| {
            let b = daemon.get(a);
            let state = b.and_then(|b| {
                b["steering"]["state"]
                    .as_str()
                    .map(str::to_owned)
                    .or_else(|| {
                        Some(
                            if b["healthy"] == true {
                                "active"
                            } else {
                                "down"
                            }
                            .into(),
                        )
                    })
            });
            Point {
                weight: b.and_then(|b| b["effective_weight"].as_f64()),
                state,
                kv: None,
                full: b.is_some_and(|b| b["steering"]["full"] == true),
                capped: b.is_some_and(|b| b["steering"]["capped"] == true),
                no_affinity: b.is_some_and(|b| b["steering"]["breaks_affinity"] == true),
                sessions: b.and_then(|b| b["steering"]["sessions"].as_u64()),
                telemetry_age_s: b.and_then(|b| b["steering"]["telemetry_age_s"].as_f64()),
                running: None,
                waiting: None,
            }
        })
        .collect();
    Sample { t, points }
}

/// Cells by (scenario, policy).
pub(super) fn cells_by_key<'a>(cells: &[&'a Value]) -> BTreeMap<(String, String), &'a Value> {
    cells
        .iter()
        .map(|c| {
            (
                (
                    c["scenario"].as_str().unwrap_or("").to_owned(),
                    c["policy"].as_str().unwrap_or("").to_owned(),
                ),
                *c,
            )
        })
        .collect()
}

/// The steering aims (docs/benchmarks.md), each with the figures behind it and whether it
/// held (absent when the cells it needs were not run).
pub fn aims(cells: &BTreeMap<(String, String), &Value>) -> Vec<Value> {
    let get = |s: &str, p: &str| cells.get(&(s.to_owned(), p.to_owned())).copied();
    let f = |c: &Value, ptr: &str| c.pointer(ptr).and_then(Value::as_f64);
    let mut out = Vec::new();
    let mut aim = |name: String, held: Option<bool>, figures: Value| {
        if let Some(held) = held {
            out.push(json!({"aim": name, "held": held, "figures": figures}));
        }
    };
    for s in ["heterogeneous", "throttled", "congested"] {
        if let (Some(m), Some(a)) = (get(s, "maglev"), get(s, "adaptive")) {
            let ratio = |ptr| Some(f(a, ptr)? / f(m, ptr)?.max(1e-9));
            let t = ratio("/ttft_ms/p99");
            let i = ratio("/itl_ms/p99");
            let broken = f(a, "/sessions/broken");
            aim(
                format!("{s}: adaptive p99 TTFT <= 0.5x maglev"),
                t.map(|t| t <= 0.5),
                json!({"ratio": t}),
            );
            // Over 0.7 the aim is out of reach of any placement of new sessions: the faulty
            // backend's streams in flight at the fault set that p99 on their own.
            let floor = f(a, "/itl_floor/p99_floor_ms")
                .zip(f(m, "/itl_ms/p99"))
                .map(|(floor, m)| floor / m.max(1e-9));
            aim(
                format!("{s}: adaptive p99 ITL <= 0.7x maglev"),
                i.map(|i| i <= 0.7),
                json!({"ratio": i, "floor_ratio": floor}),
            );
            aim(
                format!("{s}: adaptive 0 broken streams"),
                broken.map(|b| b == 0.0),
                json!({"broken": broken}),
            );
        }
    }
    if let Some(a) = get("dying", "adaptive") {
        let (b, k) = (
            f(a, "/sessions/broken"),
            f(a, "/sessions/broken_on_killed_backend"),
        );
        let after = f(a, "/new_sessions_failed_for_ms_after_kill");
        aim(
            "dying: only the killed accelerator's streams break".into(),
            b.zip(k).map(|(b, k)| b == k),
            json!({"broken": b, "on_killed": k}),
        );
        aim(
            "dying: new sessions avoid it within interval x (fall + 1) = 3 s".into(),
            after.map(|ms| ms <= AVOID_BOUND_MS),
            json!({"new_sessions_failed_for_ms": after}),
        );
    }
    if let (Some(m), Some(a)) = (get("healthy", "maglev"), get("healthy", "adaptive")) {
        let t = f(a, "/ttft_ms/p99")
            .zip(f(m, "/ttft_ms/p99"))
            .map(|(a, m)| a / m.max(1e-9));
        aim(
            "healthy: adaptive p99 TTFT <= 1.05x maglev".into(),
            t.map(|t| t <= 1.05),
            json!({"ratio": t}),
        );
        // The churn aim is judged by the `steady` cell, which counts 10 real minutes: from a
        // 60 s cell one move out and back extrapolates to 20 and read as a miss every run.
    }
    if let (Some(h), Some(o), Some(m)) = (
        get("healthy", "adaptive+admission"),
        get("overload", "adaptive+admission"),
        get("overload", "maglev"),
    ) {
        let i = f(o, "/itl_ms/p99")
            .zip(f(h, "/itl_ms/p99"))
            .map(|(o, h)| o / h.max(1e-9));
        aim(
            "overload: with admission, p99 ITL <= 1.5x the healthy run's".into(),
            i.map(|i| i <= 1.5),
            json!({"ratio": i}),
        );
        let g = f(o, "/goodput_tokens_per_s").zip(f(m, "/goodput_tokens_per_s"));
        aim(
            "overload: with admission, goodput > maglev's".into(),
            g.map(|(o, m)| o > m),
            json!({"admission": g.map(|g| g.0), "maglev": g.map(|g| g.1)}),
        );
    }
    for s in ["near-saturation"] {
        if let (Some(m), Some(a)) = (get(s, "maglev"), get(s, "adaptive")) {
            let t = f(a, "/ttft_ms/p99")
                .zip(f(m, "/ttft_ms/p99"))
                .map(|(a, m)| a / m.max(1e-9));
            aim(
                format!("{s}: adaptive p99 TTFT < maglev's"),
                t.map(|t| t < 1.0),
                json!({"ratio": t}),
            );
        }
    }
    if let Some(a) = get("idle", "adaptive") {
        let w = f(a, "/weight_changes");
        aim(
            "idle: adaptive changes no weight (no temperature floor)".into(),
            w.map(|w| w == 0.0),
            json!({"weight_changes": w}),
        );
    }
    if let Some(a) = get("steady", "adaptive") {
        let w = f(a, "/weight_changes_per_backend_per_10min");
        aim(
            "steady: <= 12 weight changes per backend in 10 min".into(),
            w.map(|w| w <= 12.0),
            json!({"per_backend_per_10min": w}),
        );
    }
    tenant_aims(cells, &mut aim);
    let worst = cells
        .values()
        .filter(|c| c["policy"] != "maglev")
        .filter_map(|c| f(c, "/affinity_kept"))
        .fold(None, |m: Option<f64>, a| Some(m.map_or(a, |m| m.min(a))));
    aim(
        "affinity kept >= 99% of turns whose backend stayed healthy (steered policies)".into(),
        worst.map(|w| w >= 0.99),
        json!({"worst": worst}),
    );
    out
}

/// The tenants' aims (docs/benchmarks.md), for each policy run in both `noisy-tenant` and
/// `noisy-tenant-calm`: the quiet tenants' p99 TTFT over the burst window against their own
/// in the calm cell (judged with tenants configured, <= 1.2x; reported for the others), the
/// noisy tenant's share of the window's completed tokens against its weighted share, and no
/// established stream cut.
fn tenant_aims(
    cells: &BTreeMap<(String, String), &Value>,
    aim: &mut impl FnMut(String, Option<bool>, Value),
) {
    let get = |s: &str, p: &str| cells.get(&(s.to_owned(), p.to_owned())).copied();
    let quiet_p99 = |c: &Value| {
        c.pointer("/tenants/tenants/quiet/burst_window/ttft_ms/p99")
            .and_then(Value::as_f64)
    };
    let ratio = |p: &str| {
        let (b, calm) = (get("noisy-tenant", p)?, get("noisy-tenant-calm", p)?);
        Some(quiet_p99(b)? / quiet_p99(calm)?.max(1e-9))
    };
    let r = |x: Option<f64>| x.map(|x| (x * 1000.0).round() / 1000.0);
    let tenants = Policy::Tenants.name();
    let Some(b) = get("noisy-tenant", tenants) else {
        return;
    };
    let others: serde_json::Map<String, Value> = cells
        .keys()
        .filter(|(s, p)| s == "noisy-tenant" && p != tenants)
        .map(|(_, p)| (p.clone(), json!(r(ratio(p)))))
        .collect();
    let t = ratio(tenants);
    aim(
        "noisy-tenant: with tenants, the quiet tenants' p99 TTFT in the burst <= 1.2x calm".into(),
        t.map(|t| t <= 1.2),
        json!({"ratio": r(t), "without_tenants": others}),
    );
    let share = b["tenants"]["noisy_share_of_window_tokens"].as_f64();
    let weighted = b["tenants"]["noisy_weighted_share"].as_f64();
    aim(
        "noisy-tenant: with tenants, the noisy tenant gets at least its weighted share".into(),
        share.zip(weighted).map(|(s, w)| s >= w),
        json!({"share_of_window_tokens": share, "weighted_share": weighted}),
    );
    let cut = b["tenants"]["established_cut"].as_u64();
    aim(
        "noisy-tenant: with tenants, 0 established streams cut".into(),
        cut.map(|c| c == 0),
        json!({"cut": cut}),
    );
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn aims_compare_the_same_scenarios_cells() {
        let cell = |s: &str, p: &str, ttft: f64, broken: u64| {
            json!({"scenario": s, "policy": p, "ttft_ms": {"p99": ttft}, "itl_ms": {"p99": 50.0},
                   "sessions": {"broken": broken, "broken_on_killed_backend": 0},
                   "affinity_kept": 1.0})
        };
        let mut adaptive = cell("throttled", "adaptive", 600.0, 0);
        // Its streams in flight at the fault alone set a p99 of 45 ms: 0.9 of Maglev's.
        adaptive["itl_floor"] = json!({"p99_floor_ms": 45.0});
        let cells = [cell("throttled", "maglev", 3000.0, 0), adaptive];
        let refs: Vec<&Value> = cells.iter().collect();
        let aims = aims(&cells_by_key(&refs));
        let held: Vec<(String, bool)> = aims
            .iter()
            .map(|a| (a["aim"].as_str().unwrap().to_owned(), a["held"] == true))
            .collect();
        assert_eq!(
            held,
            [
                (
                    "throttled: adaptive p99 TTFT <= 0.5x maglev".to_owned(),
                    true
                ),
                (
                    "throttled: adaptive p99 ITL <= 0.7x maglev".to_owned(),
                    false
                ),
                ("throttled: adaptive 0 broken streams".to_owned(), true),
                (
                    "affinity kept >= 99% of turns whose backend stayed healthy (steered policies)"
                        .to_owned(),
                    true
                ),
            ]
        );
        assert_eq!(aims[1]["figures"]["floor_ratio"], 0.9);
    }

    #[test]
    fn the_tenants_aims_compare_each_policys_burst_with_its_calm_cell() {
        let cell = |s: &str, p: &str, quiet_p99: f64, share: f64, cut: u64| {
            json!({"scenario": s, "policy": p, "ttft_ms": {"p99": 1.0},
                   "tenants": {"tenants": {"quiet": {"burst_window": {"ttft_ms": {"p99": quiet_p99}}}},
                               "noisy_share_of_window_tokens": share,
                               "noisy_weighted_share": 0.25, "established_cut": cut}})
        };
        let cells = [
            cell("noisy-tenant", "adaptive", 4000.0, 0.6, 0),
            cell("noisy-tenant-calm", "adaptive", 1000.0, 0.25, 0),
            cell("noisy-tenant", "adaptive+tenants", 1100.0, 0.3, 0),
            cell("noisy-tenant-calm", "adaptive+tenants", 1000.0, 0.25, 0),
        ];
        let refs: Vec<&Value> = cells.iter().collect();
        let aims = aims(&cells_by_key(&refs));
        let tenant: Vec<&Value> = aims
            .iter()
            .filter(|a| a["aim"].as_str().unwrap().starts_with("noisy-tenant"))
            .collect();
        assert_eq!(tenant.len(), 3);
        assert!(tenant.iter().all(|a| a["held"] == true));
        assert_eq!(tenant[0]["figures"]["ratio"], 1.1);
        assert_eq!(tenant[0]["figures"]["without_tenants"]["adaptive"], 4.0);
    }

    #[test]
    fn weight_churn_is_judged_by_the_ten_minute_cell_only() {
        let cell = |s: &str, p: &str, per_10min: f64| {
            json!({"scenario": s, "policy": p, "ttft_ms": {"p99": 100.0},
                   "weight_changes_per_backend_per_10min": per_10min})
        };
        // One move out and back in 60 s extrapolates to 20: no verdict from that.
        let cells = [
            cell("healthy", "maglev", 0.0),
            cell("healthy", "adaptive", 20.0),
            cell("steady", "adaptive", 7.0),
        ];
        let refs: Vec<&Value> = cells.iter().collect();
        let aims = aims(&cells_by_key(&refs));
        let churn: Vec<(&str, bool)> = aims
            .iter()
            .filter_map(|a| {
                a["aim"]
                    .as_str()
                    .filter(|n| n.contains("weight changes"))
                    .map(|n| (n, a["held"] == true))
            })
            .collect();
        assert_eq!(
            churn,
            [("steady: <= 12 weight changes per backend in 10 min", true)]
        );
    }
}
