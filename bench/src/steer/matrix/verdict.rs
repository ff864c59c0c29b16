//! The matrix's verdict: per scenario the worst cell's p99 TTFT / Maglev's of the same fleet
//! and seed against the aims, and its stdout table.

use serde_json::{json, Value};

/// The aims (the worst cell of the matrix): the most a steered policy's p99 TTFT may be of
/// Maglev's in the same fleet, seed and scenario.
pub const RATIO_AIMS: [(&str, f64); 8] = [
    ("healthy", 1.05),
    ("idle", 1.05),
    ("throttled", 0.2),
    ("congested", 0.2),
    ("heterogeneous", 0.3),
    ("gray", 0.3),
    ("lying", 0.3),
    ("flapping", 0.5),
];

/// The most adaptive+inband's p99 TTFT may be of adaptive's alone, in every scenario.
pub const INBAND_OVER_ADAPTIVE_AIM: f64 = 1.05;

/// The most weight changes per backend per 10 minutes on a healthy fleet.
pub const CHURN_AIM: f64 = 12.0;

/// The steered policies the report judges.
const STEERED: [&str; 2] = ["adaptive", "adaptive+inband"];

fn ratio_aim(scenario: &str) -> Option<f64> {
    RATIO_AIMS
        .iter()
        .find(|(s, _)| *s == scenario)
        .map(|&(_, a)| a)
}

fn p99(c: &Value) -> Option<f64> {
    c.pointer("/ttft_ms/p99").and_then(Value::as_f64)
}

/// A cell's (fleet name, seed, scenario, policy).
fn key(c: &Value) -> (String, u64, String, String) {
    (
        c["fleet"]["name"].as_str().unwrap_or("").to_owned(),
        c["seed"].as_u64().unwrap_or(0),
        c["scenario"].as_str().unwrap_or("").to_owned(),
        c["policy"].as_str().unwrap_or("").to_owned(),
    )
}

/// The largest figure and the cell that gave it, with the aim and whether it held (`held`
/// null without an aim; the whole entry null without a figure).
fn worst(figures: Vec<(f64, &Value)>, aim: Option<f64>) -> Value {
    let Some((w, c)) = figures
        .into_iter()
        .filter(|(f, _)| f.is_finite())
        .max_by(|a, b| a.0.total_cmp(&b.0))
    else {
        return Value::Null;
    };
    json!({
        "worst": (w * 1000.0).round() / 1000.0,
        "fleet": c["fleet"]["name"],
        "seed": c["seed"],
        "scenario": c["scenario"],
        "aim": aim,
        "held": aim.map(|a| w <= a),
    })
}

/// The report over the matrix's cells (cells with an `error` are counted, not judged):
/// per scenario the worst ratio of p99 TTFT to Maglev's (same fleet, seed and scenario) for
/// each steered policy and the worst adaptive+inband / adaptive, each against its aim; per
/// steered policy the worst cell's streams broken off a backend that was not killed (aim 0)
/// and the worst weight churn on the healthy fleet (per backend per 10 minutes, aim
/// [`CHURN_AIM`]).
pub fn report(cells: &[Value]) -> Value {
    let ok: Vec<&Value> = cells.iter().filter(|c| c.get("error").is_none()).collect();
    let find = |fleet: &str, seed: u64, scenario: &str, policy: &str| {
        ok.iter()
            .find(|c| key(c) == (fleet.into(), seed, scenario.into(), policy.into()))
            .copied()
    };
    let mut scenarios: Vec<String> = Vec::new();
    for c in &ok {
        let s = key(c).2;
        if !scenarios.contains(&s) {
            scenarios.push(s);
        }
    }
    let mut rows = Vec::new();
    for s in &scenarios {
        let aim = ratio_aim(s);
        let mut row = json!({"scenario": s});
        for policy in STEERED {
            let ratios = ok
                .iter()
                .filter(|c| key(c).2 == *s && key(c).3 == policy)
                .filter_map(|c| {
                    let (f, seed, ..) = key(c);
                    let m = p99(find(&f, seed, s, "maglev")?)?;
                    Some((p99(c)? / m.max(1e-9), *c))
                })
                .collect();
            row[policy] = worst(ratios, aim);
        }
        let over = ok
            .iter()
            .filter(|c| key(c).2 == *s && key(c).3 == "adaptive+inband")
            .filter_map(|c| {
                let (f, seed, ..) = key(c);
                let a = p99(find(&f, seed, s, "adaptive")?)?;
                Some((p99(c)? / a.max(1e-9), *c))
            })
            .collect();
        row["inband_over_adaptive"] = worst(over, Some(INBAND_OVER_ADAPTIVE_AIM));
        rows.push(row);
    }
    let per_policy = |figure: &dyn Fn(&Value) -> Option<f64>, only: Option<&str>, aim: f64| {
        STEERED
            .iter()
            .map(|&policy| {
                let figures = ok
                    .iter()
                    .filter(|c| key(c).3 == policy && only.is_none_or(|s| key(c).2 == s))
                    .filter_map(|c| Some((figure(c)?, *c)))
                    .collect();
                json!({"policy": policy, "cell": worst(figures, Some(aim))})
            })
            .collect::<Vec<_>>()
    };
    let broken_elsewhere = |c: &Value| {
        let all = c.pointer("/sessions/broken")?.as_f64()?;
        let killed = c
            .pointer("/sessions/broken_on_killed_backend")
            .and_then(Value::as_f64)
            .unwrap_or(0.0);
        Some(all - killed)
    };
    let churn = |c: &Value| {
        c.get("weight_changes_per_backend_per_10min")
            .and_then(Value::as_f64)
    };
    json!({
        "scenarios": rows,
        "noise": noise(&ok, &find),
        "broken_not_on_a_killed_backend": per_policy(&broken_elsewhere, None, 0.0),
        "healthy_weight_changes_per_backend_per_10min":
            per_policy(&churn, Some("healthy"), CHURN_AIM),
        "cells": cells.len(),
        "failed_cells": cells.len() - ok.len(),
    })
}

/// How far p99 TTFT moves with nothing but the run: over the cells where a steered policy
/// changed no weight (it placed every session as Maglev does), the lowest and highest p99 ÷
/// Maglev's in the same fleet, seed and scenario. A ratio of another cell inside that range
/// is not evidence of an effect either way.
fn noise<'a>(ok: &[&'a Value], find: &dyn Fn(&str, u64, &str, &str) -> Option<&'a Value>) -> Value {
    let ratios: Vec<f64> = ok
        .iter()
        .filter(|c| STEERED.contains(&key(c).3.as_str()))
        .filter(|c| c.get("weight_changes").and_then(Value::as_u64) == Some(0))
        .filter_map(|c| {
            let (f, seed, s, _) = key(c);
            Some(p99(c)? / p99(find(&f, seed, &s, "maglev")?)?.max(1e-9))
        })
        .filter(|r| r.is_finite())
        .collect();
    let round = |x: f64| (x * 1000.0).round() / 1000.0;
    match (
        ratios.iter().copied().reduce(f64::min),
        ratios.iter().copied().reduce(f64::max),
    ) {
        (Some(lo), Some(hi)) => {
            json!({"cells": ratios.len(), "lowest": round(lo), "highest": round(hi)})
        }
        _ => json!({"cells": 0}),
    }
}

fn held_word(v: &Value) -> &'static str {
    match v["held"].as_bool() {
        Some(true) => "held",
        Some(false) => "MISSED",
        None => "no aim",
    }
}

fn figure(v: &Value) -> String {
    if v.is_null() {
        return "not run".into();
    }
    format!(
        "{:.2} ({} seed {}) {}",
        v["worst"].as_f64().unwrap_or(f64::NAN),
        v["fleet"].as_str().unwrap_or("?"),
        v["seed"],
        held_word(v)
    )
}

/// The report as a table for the terminal.
pub fn table(report: &Value) -> String {
    let mut out = format!(
        "{:<16} {:>5}  {:<42} {:<42} {}\n",
        "scenario",
        "aim",
        "adaptive / maglev, worst cell",
        "adaptive+inband / maglev, worst cell",
        "adaptive+inband / adaptive (aim <= 1.05)"
    );
    for row in report["scenarios"].as_array().into_iter().flatten() {
        let aim = ratio_aim(row["scenario"].as_str().unwrap_or(""))
            .map_or("-".to_owned(), |a| format!("{a}"));
        out += &format!(
            "{:<16} {:>5}  {:<42} {:<42} {}\n",
            row["scenario"].as_str().unwrap_or("?"),
            aim,
            figure(&row["adaptive"]),
            figure(&row["adaptive+inband"]),
            figure(&row["inband_over_adaptive"]),
        );
    }
    for (title, k) in [
        (
            "broken streams not on a killed accelerator (aim 0)",
            "broken_not_on_a_killed_backend",
        ),
        (
            "weight changes per backend per 10 min, healthy (aim <= 12)",
            "healthy_weight_changes_per_backend_per_10min",
        ),
    ] {
        out += &format!("{title}:\n");
        for p in report[k].as_array().into_iter().flatten() {
            out += &format!(
                "  {:<16} {}\n",
                p["policy"].as_str().unwrap_or("?"),
                figure(&p["cell"])
            );
        }
    }
    let n = &report["noise"];
    if n["cells"].as_u64().unwrap_or(0) > 0 {
        out += &format!(
            "noise: in the {} cells where a steered policy changed no weight, p99 TTFT was {:.2} to {:.2} of Maglev's\n",
            n["cells"],
            n["lowest"].as_f64().unwrap_or(f64::NAN),
            n["highest"].as_f64().unwrap_or(f64::NAN)
        );
    }
    if report["failed_cells"].as_u64().unwrap_or(0) > 0 {
        out += &format!(
            "{} of {} cells failed (their errors are in the result file)\n",
            report["failed_cells"], report["cells"]
        );
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    fn cell(fleet: &str, seed: u64, scenario: &str, policy: &str, p99: f64) -> Value {
        json!({"fleet": {"name": fleet}, "seed": seed, "scenario": scenario, "policy": policy,
               "ttft_ms": {"p50": p99 / 4.0, "p99": p99},
               "sessions": {"broken": 0, "broken_on_killed_backend": 0},
               "weight_changes_per_backend_per_10min": 0.0})
    }

    #[test]
    fn the_report_takes_each_scenarios_worst_cell_against_maglev_of_the_same_fleet_and_seed() {
        let cells = vec![
            // Fleet a: Maglev 1000 ms at seed 7, 400 ms at seed 11.
            cell("a", 7, "throttled", "maglev", 1000.0),
            cell("a", 7, "throttled", "adaptive", 150.0),
            cell("a", 7, "throttled", "adaptive+inband", 100.0),
            cell("a", 11, "throttled", "maglev", 400.0),
            // 120 / 400 = 0.3: the worst, though 150 is the largest p99.
            cell("a", 11, "throttled", "adaptive", 120.0),
            cell("a", 11, "throttled", "adaptive+inband", 132.0),
            cell("b", 7, "throttled", "maglev", 5000.0),
            cell("b", 7, "throttled", "adaptive", 500.0),
            cell("b", 7, "throttled", "adaptive+inband", 500.0),
            cell("a", 7, "healthy", "maglev", 200.0),
            cell("a", 7, "healthy", "adaptive", 204.0),
            cell("a", 7, "dying", "maglev", 200.0),
            cell("a", 7, "dying", "adaptive", 300.0),
            // A failed cell is counted, not judged.
            json!({"fleet": {"name": "a"}, "seed": 7, "scenario": "healthy",
                   "policy": "adaptive+inband", "error": "lab did not start"}),
        ];
        let r = report(&cells);
        let rows = r["scenarios"].as_array().unwrap();
        let row = |s: &str| rows.iter().find(|r| r["scenario"] == s).unwrap();
        let t = row("throttled");
        assert_eq!(t["adaptive"]["worst"], 0.3);
        assert_eq!(
            (&t["adaptive"]["fleet"], &t["adaptive"]["seed"]),
            (&json!("a"), &json!(11))
        );
        assert_eq!(t["adaptive"]["aim"], 0.2);
        assert_eq!(t["adaptive"]["held"], false);
        assert_eq!(t["adaptive+inband"]["worst"], 0.33);
        assert_eq!(t["adaptive+inband"]["held"], false);
        // Worst in-band over adaptive: 132 / 120 = 1.1 (fleet a, seed 11), over the aim.
        assert_eq!(t["inband_over_adaptive"]["worst"], 1.1);
        assert_eq!(t["inband_over_adaptive"]["held"], false);
        let h = row("healthy");
        assert_eq!(h["adaptive"]["worst"], 1.02);
        assert_eq!(h["adaptive"]["held"], true);
        assert!(h["adaptive+inband"].is_null(), "only a failed cell");
        // No aim for dying: a figure, no verdict.
        let d = row("dying");
        assert_eq!(d["adaptive"]["worst"], 1.5);
        assert!(d["adaptive"]["held"].is_null());
        assert_eq!(
            (r["cells"].as_u64(), r["failed_cells"].as_u64()),
            (Some(14), Some(1))
        );
        let text = table(&r);
        assert!(text.contains("throttled"), "{text}");
        assert!(text.contains("0.30 (a seed 11) MISSED"), "{text}");
        assert!(text.contains("1 of 14 cells failed"), "{text}");
    }

    #[test]
    fn cells_where_the_policy_changed_no_weight_give_the_noise() {
        let idle = |policy: &str, p99: f64, changes: u64| {
            let mut c = cell("a", 7, "healthy", policy, p99);
            c["weight_changes"] = json!(changes);
            c
        };
        let cells = vec![
            idle("maglev", 100.0, 0),
            idle("adaptive", 196.0, 0),
            idle("adaptive+inband", 90.0, 0),
            cell("a", 7, "throttled", "maglev", 1000.0),
            // A policy that acted is not noise, however far it moved p99.
            {
                let mut c = cell("a", 7, "throttled", "adaptive", 3000.0);
                c["weight_changes"] = json!(4);
                c
            },
        ];
        let r = report(&cells);
        assert_eq!(
            r["noise"],
            json!({"cells": 2, "lowest": 0.9, "highest": 1.96})
        );
        assert!(table(&r).contains("p99 TTFT was 0.90 to 1.96 of Maglev's"));
    }

    #[test]
    fn broken_streams_count_off_the_killed_accelerator_and_churn_on_the_healthy_fleet() {
        let mut dying = cell("a", 7, "dying", "adaptive", 100.0);
        dying["sessions"] = json!({"broken": 5, "broken_on_killed_backend": 5});
        let mut gray = cell("a", 7, "gray", "adaptive", 100.0);
        gray["sessions"] = json!({"broken": 2, "broken_on_killed_backend": 0});
        let mut healthy = cell("b", 11, "healthy", "adaptive+inband", 100.0);
        healthy["weight_changes_per_backend_per_10min"] = json!(30.0);
        let mut throttled = cell("b", 11, "throttled", "adaptive+inband", 100.0);
        // Churn under a fault is not judged.
        throttled["weight_changes_per_backend_per_10min"] = json!(90.0);
        let r = report(&[dying, gray, healthy, throttled]);
        let broken = &r["broken_not_on_a_killed_backend"];
        assert_eq!(broken[0]["policy"], "adaptive");
        assert_eq!(broken[0]["cell"]["worst"], 2.0);
        assert_eq!(broken[0]["cell"]["scenario"], "gray");
        assert_eq!(broken[0]["cell"]["held"], false);
        assert_eq!(broken[1]["cell"]["worst"], 0.0);
        assert_eq!(broken[1]["cell"]["held"], true);
        let churn = &r["healthy_weight_changes_per_backend_per_10min"];
        assert!(churn[0]["cell"].is_null(), "no healthy adaptive cell");
        assert_eq!(churn[1]["cell"]["worst"], 30.0);
        assert_eq!(churn[1]["cell"]["held"], false);
    }
}
