//! The Grafana dashboard (`packaging/grafana/sluice.json`) queries only metrics the daemon
//! exports: every `sluice_*` name in its panel and variable queries must appear on a scrape
//! of a daemon with every family populated.

use std::collections::BTreeSet;

use serde_json::Value;

use super::{render, tests::snapshot};
use crate::admin::testing::info;

const DASHBOARD: &str = concat!(
    env!("CARGO_MANIFEST_DIR"),
    "/../packaging/grafana/sluice.json"
);

/// Every `sluice_*` metric name in a PromQL expression (outside quoted label values).
fn names_in(expr: &str) -> BTreeSet<String> {
    let ident = |c: char| c.is_ascii_alphanumeric() || c == '_' || c == ':';
    let mut quoted = false;
    let unquoted: String = expr
        .chars()
        .map(|c| {
            if c == '"' {
                quoted = !quoted;
            }
            if quoted || c == '"' {
                ' '
            } else {
                c
            }
        })
        .collect();
    let mut out = BTreeSet::new();
    let mut rest = unquoted.as_str();
    while let Some(i) = rest.find("sluice_") {
        let starts_word = !rest[..i].chars().next_back().is_some_and(ident);
        let len = rest[i..]
            .find(|c: char| !ident(c))
            .unwrap_or(rest.len() - i);
        if starts_word {
            out.insert(rest[i..i + len].to_string());
        }
        rest = &rest[i + len..];
    }
    out
}

/// Every query of the dashboard: panel targets (rows included) and variable queries.
fn queries(dash: &Value) -> Vec<String> {
    fn walk(v: &Value, out: &mut Vec<String>) {
        match v {
            Value::Object(m) => {
                for (k, v) in m {
                    match (k.as_str(), v) {
                        ("expr" | "definition", Value::String(s)) => out.push(s.clone()),
                        ("query", Value::String(s)) if s.contains('(') => out.push(s.clone()),
                        _ => walk(v, out),
                    }
                }
            }
            Value::Array(a) => a.iter().for_each(|v| walk(v, out)),
            _ => {}
        }
    }
    let mut out = vec![];
    walk(dash, &mut out);
    out
}

/// Metric names on a scrape: the sample names (counters with `_total`, info with `_info`).
fn exported(page: &str) -> BTreeSet<String> {
    page.lines()
        .filter(|l| !l.starts_with('#') && !l.is_empty())
        .filter_map(|l| l.split(['{', ' ']).next())
        .map(str::to_string)
        .collect()
}

fn missing(dash: &Value, page: &str) -> Vec<String> {
    let have = exported(page);
    queries(dash)
        .iter()
        .flat_map(|q| names_in(q))
        .filter(|n| !have.contains(n))
        .collect::<BTreeSet<_>>()
        .into_iter()
        .collect()
}

#[tokio::test]
async fn every_metric_the_dashboard_queries_is_exported() {
    let text = std::fs::read_to_string(DASHBOARD).expect("reading the dashboard");
    let dash: Value = serde_json::from_str(&text).expect("the dashboard is JSON");
    let mut snap = snapshot().await;
    snap.flows_counted = Some(Default::default());
    let mut info = info();
    info.fleet = Some(std::sync::Arc::new(crate::fleet::sample()));
    info.policy_step_ns
        .store(1_000_000, std::sync::atomic::Ordering::Relaxed);
    let announcer = crate::announce::Announcer::new(crate::announce::config::BgpConfig::default());
    let d = &crate::announce::decide::decide(&crate::announce::decide::inputs(
        snap.state
            .vips
            .values()
            .map(crate::announce::decide::vip_input),
        true,
        false,
    ));
    announcer.set_status(crate::announce::Status {
        vips: d.clone(),
        ..Default::default()
    });
    info.announce = Some(announcer);
    let page = render(&snap, &info);
    let qs = queries(&dash);
    assert!(qs.len() >= 20, "too few queries found: {qs:?}");
    assert_eq!(missing(&dash, &page), Vec::<String>::new());
    // Every family the daemon exports has a panel.
    let used: BTreeSet<String> = qs.iter().flat_map(|q| names_in(q)).collect();
    let unused: Vec<_> = exported(&page)
        .into_iter()
        .filter(|n| !used.contains(n))
        .collect();
    assert_eq!(
        unused,
        Vec::<String>::new(),
        "exported but not on the dashboard"
    );
}

#[test]
fn a_query_of_an_unknown_metric_is_found() {
    let dash = serde_json::json!({"panels": [{"targets": [
        {"expr": "rate(sluice_vip_packets_total[5m]) / sluice_nope"}
    ]}]});
    let page = "# TYPE sluice_vip_packets counter\nsluice_vip_packets_total{vip=\"a\"} 1\n";
    assert_eq!(missing(&dash, page), vec!["sluice_nope".to_string()]);
    assert_eq!(
        names_in("x_sluice_a + sluice_b{l=\"sluice_c\"}"),
        BTreeSet::from(["sluice_b".to_string()])
    );
}
