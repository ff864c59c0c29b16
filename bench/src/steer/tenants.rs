//! Tenants in the steer lab: the lab's client addresses split by prefix into three quiet
//! tenants and a noisy one, the `[[tenant]]` tables `adaptive+tenants` gives the daemon, and
//! each tenant's figures from the load generator's records.

use std::{
    collections::BTreeMap,
    net::{IpAddr, Ipv4Addr},
};

use anyhow::{bail, Result};
use serde_json::{json, Value};
use sluice_tests::daemon_lab::TenantDef;

use super::stats::{self, Record};

/// One tenant of the lab: a named IPv4 prefix of the segment's client addresses
/// (`DaemonLab::add_client_sources` puts them at 10.111.0.75 and up).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Tenant {
    pub name: &'static str,
    pub prefix: &'static str,
    /// The one that bursts in `noisy-tenant`.
    pub noisy: bool,
}

/// Four /27s of 32 client addresses each: equal shares of the steady load (the generator
/// deals conversations to its sources round robin).
pub const TENANTS: [Tenant; 4] = [
    Tenant {
        name: "quiet-a",
        prefix: "10.111.0.96/27",
        noisy: false,
    },
    Tenant {
        name: "quiet-b",
        prefix: "10.111.0.128/27",
        noisy: false,
    },
    Tenant {
        name: "quiet-c",
        prefix: "10.111.0.160/27",
        noisy: false,
    },
    Tenant {
        name: "noisy",
        prefix: "10.111.0.192/27",
        noisy: true,
    },
];

/// Every tenant's weight: equal shares of a full pool.
pub const WEIGHT: u32 = 1;

/// The noisy tenant's share of the steady load and of a full pool.
pub fn noisy_share() -> f64 {
    1.0 / TENANTS.len() as f64
}

/// `a.b.c.d/len` as (network, mask).
fn parse_v4(prefix: &str) -> (u32, u32) {
    let (a, l) = prefix.split_once('/').unwrap_or((prefix, "32"));
    let addr: Ipv4Addr = a.parse().unwrap_or(Ipv4Addr::UNSPECIFIED);
    let len: u32 = l.parse().unwrap_or(32);
    let mask = u32::MAX.checked_shl(32 - len).unwrap_or(0);
    (u32::from(addr) & mask, mask)
}

/// The tenant whose prefix holds `addr`, if any.
pub fn tenant_of(addr: &str) -> Option<&'static Tenant> {
    let Ok(IpAddr::V4(a)) = addr.parse::<IpAddr>() else {
        return None;
    };
    TENANTS.iter().find(|t| {
        let (net, mask) = parse_v4(t.prefix);
        u32::from(a) & mask == net
    })
}

/// The lab's client addresses that belong to a tenant (`noisy_only`: only the noisy
/// tenant's), interleaved across the tenants (the first of each, then the second of each...):
/// the generator deals conversations to its addresses round robin, so each tenant gets every
/// fourth conversation rather than runs of 32 in a row. Fails when a tenant has none (too few
/// `--sources` to reach its prefix).
pub fn sources(all: &[IpAddr], noisy_only: bool) -> Result<Vec<IpAddr>> {
    let mut each = Vec::new();
    for t in TENANTS.iter().filter(|t| t.noisy || !noisy_only) {
        let mine: Vec<IpAddr> = all
            .iter()
            .filter(|a| tenant_of(&a.to_string()) == Some(t))
            .copied()
            .collect();
        if mine.is_empty() {
            bail!(
                "tenant {} ({}) has no client address among the lab's {}: the tenant \
                 scenarios need --sources 180 (the whole segment)",
                t.name,
                t.prefix,
                all.len()
            );
        }
        each.push(mine);
    }
    let longest = each.iter().map(Vec::len).max().unwrap_or(0);
    Ok((0..longest)
        .flat_map(|i| each.iter().filter_map(move |m| m.get(i).copied()))
        .collect())
}

/// The limits an operator derives from the fleet's capacity (docs/benchmarks.md): each
/// tenant's weighted share of the sessions admission lets the fleet hold (`backends` x the
/// per-backend `max_sessions`), and its weighted share of the fleet's nominal request rate as
/// its new-session rate, with two seconds of it as the burst (a tenant below its share
/// arrives as a Poisson process whose bunches the burst absorbs). A rate above the share
/// lets one tenant take what the others leave, which a burst turns into every tenant's queue.
pub fn tables(backends: usize, max_sessions: u32, capacity_rps: f64) -> Vec<TenantDef> {
    let total: u32 = WEIGHT * TENANTS.len() as u32;
    let share = |x: f64| x * f64::from(WEIGHT) / f64::from(total);
    let sessions = share(backends as f64 * f64::from(max_sessions)).floor() as u32;
    let rate = share(backends as f64 * capacity_rps).ceil() as u32;
    TENANTS
        .iter()
        .map(|t| TenantDef {
            name: t.name.into(),
            prefixes: vec![t.prefix.into()],
            weight: WEIGHT,
            max_sessions: sessions,
            new_sessions_per_sec: rate,
            burst: 2 * rate,
        })
        .collect()
}

/// A tenant table as the results record it.
pub fn table_json(t: &TenantDef) -> Value {
    json!({
        "name": t.name,
        "prefixes": t.prefixes,
        "weight": t.weight,
        "max_sessions": t.max_sessions,
        "new_sessions_per_sec": t.new_sessions_per_sec,
        "burst": t.burst,
    })
}

/// Whether a record was refused: no connection, or reset before its first token, after the
/// generator's retries.
fn refused(r: &Record) -> bool {
    r.ttft_ms.is_none() && matches!(r.broken.as_deref(), Some("connect") | Some("reset"))
}

/// Whether a record is an established stream cut: it broke after its first token.
fn cut(r: &Record) -> bool {
    r.broken.is_some() && r.ttft_ms.is_some()
}

/// One group of records' figures: TTFT quantiles, goodput over `secs` (tokens of completed
/// streams), requests completed, refused, cut, broken by reason.
fn figures(records: &[&Record], secs: f64) -> Value {
    let ttfts: Vec<f64> = records.iter().filter_map(|r| r.ttft_ms).collect();
    let completed: Vec<&&Record> = records.iter().filter(|r| r.broken.is_none()).collect();
    let tokens: u64 = completed.iter().map(|r| r.tokens).sum();
    json!({
        "requests": records.len(),
        "completed": completed.len(),
        "refused": records.iter().filter(|r| refused(r)).count(),
        "established_cut": records.iter().filter(|r| cut(r)).count(),
        "broken_by_reason": stats::broken_by_reason(records.iter().copied()),
        "ttft_ms": stats::quantiles(&ttfts),
        "completed_tokens": tokens,
        "goodput_tokens_per_s": stats::per_s(tokens, secs),
    })
}

/// Per tenant (and the quiet tenants pooled as `quiet`): the figures over the whole run
/// (goodput over `elapsed_s`, the generators' wall time), and of the requests started in
/// the burst window `[from_ms, to_ms)` (goodput over the window), with the noisy tenant's
/// share of the window's completed tokens.
pub fn per_tenant(records: &[Record], elapsed_s: f64, from_ms: f64, to_ms: f64) -> Value {
    let mut groups: BTreeMap<&str, Vec<&Record>> = BTreeMap::new();
    for r in records {
        let name = tenant_of(&r.client).map_or("default", |t| t.name);
        groups.entry(name).or_default().push(r);
        if tenant_of(&r.client).is_some_and(|t| !t.noisy) {
            groups.entry("quiet").or_default().push(r);
        }
    }
    let window_s = (to_ms - from_ms) / 1000.0;
    fn in_window<'a>(rs: &[&'a Record], from_ms: f64, to_ms: f64) -> Vec<&'a Record> {
        rs.iter()
            .filter(|r| r.start_ms >= from_ms && r.start_ms < to_ms)
            .copied()
            .collect()
    }
    let window_tokens = |rs: &[&Record]| -> u64 {
        in_window(rs, from_ms, to_ms)
            .iter()
            .filter(|r| r.broken.is_none())
            .map(|r| r.tokens)
            .sum()
    };
    let all: Vec<&Record> = records.iter().collect();
    let total = window_tokens(&all);
    let noisy = groups.get("noisy").map_or(0, |g| window_tokens(g));
    let mut out = serde_json::Map::new();
    for (name, rs) in &groups {
        out.insert(
            (*name).to_owned(),
            json!({
                "run": figures(rs, elapsed_s),
                "burst_window": figures(&in_window(rs, from_ms, to_ms), window_s),
            }),
        );
    }
    json!({
        "burst_window_s": [from_ms / 1000.0, to_ms / 1000.0],
        "tenants": out,
        "noisy_share_of_window_tokens": (total > 0)
            .then(|| (noisy as f64 / total as f64 * 1000.0).round() / 1000.0),
        "noisy_weighted_share": noisy_share(),
        "established_cut": records.iter().filter(|r| cut(r)).count(),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn rec(client: &str, start_ms: f64, ttft: Option<f64>, broken: Option<&str>) -> Record {
        Record {
            start_ms,
            client: client.into(),
            ttft_ms: ttft,
            tokens: 100,
            broken: broken.map(Into::into),
            ..Record::default()
        }
    }

    #[test]
    fn clients_fall_into_their_tenants_prefix() {
        assert_eq!(tenant_of("10.111.0.96").unwrap().name, "quiet-a");
        assert_eq!(tenant_of("10.111.0.127").unwrap().name, "quiet-a");
        assert_eq!(tenant_of("10.111.0.200").unwrap().name, "noisy");
        assert!(tenant_of("10.111.0.95").is_none());
        assert!(tenant_of("10.111.0.224").is_none());
        assert!(tenant_of("").is_none());
        let all: Vec<IpAddr> = (75..=254u8)
            .map(|k| IpAddr::V4(Ipv4Addr::new(10, 111, 0, k)))
            .collect();
        let quiet_and_noisy = sources(&all, false).unwrap();
        assert_eq!(quiet_and_noisy.len(), 128);
        let first: Vec<&str> = quiet_and_noisy[..5]
            .iter()
            .map(|a| tenant_of(&a.to_string()).unwrap().name)
            .collect();
        assert_eq!(first, ["quiet-a", "quiet-b", "quiet-c", "noisy", "quiet-a"]);
        let noisy = sources(&all, true).unwrap();
        assert_eq!(noisy.len(), 32);
        assert!(noisy
            .iter()
            .all(|a| tenant_of(&a.to_string()).unwrap().noisy));
        // Too few addresses to reach the noisy tenant's prefix.
        assert!(sources(&all[..100], false).is_err());
    }

    #[test]
    fn limits_are_each_tenants_share_of_the_fleet() {
        let t = tables(4, 24, 3.0);
        assert_eq!(t.len(), 4);
        assert!(t.iter().all(|t| t.max_sessions == 24
            && t.new_sessions_per_sec == 3
            && t.burst == 6
            && t.weight == WEIGHT));
        assert_eq!(t[3].prefixes, ["10.111.0.192/27"]);
        assert_eq!(
            table_json(&t[3]),
            json!({"name": "noisy", "prefixes": ["10.111.0.192/27"], "weight": 1,
                   "max_sessions": 24, "new_sessions_per_sec": 3, "burst": 6})
        );
    }

    #[test]
    fn per_tenant_figures_split_refusals_from_cut_streams() {
        let records = [
            rec("10.111.0.100", 1000.0, Some(200.0), None),
            rec("10.111.0.100", 25_000.0, Some(900.0), None),
            rec("10.111.0.200", 21_000.0, None, Some("connect")),
            rec("10.111.0.200", 22_000.0, Some(300.0), Some("reset")),
            rec("10.111.0.200", 23_000.0, Some(300.0), None),
            rec("10.111.0.80", 23_000.0, Some(300.0), None),
        ];
        let v = per_tenant(&records, 10.0, 20_000.0, 40_000.0);
        let t = &v["tenants"];
        assert_eq!(t["noisy"]["run"]["refused"], 1);
        assert_eq!(t["noisy"]["run"]["established_cut"], 1);
        assert_eq!(t["noisy"]["run"]["completed"], 1);
        assert_eq!(t["noisy"]["run"]["broken_by_reason"]["reset"], 1);
        assert_eq!(t["quiet-a"]["run"]["completed"], 2);
        assert_eq!(t["quiet-a"]["run"]["goodput_tokens_per_s"], 20.0);
        assert_eq!(t["quiet-a"]["burst_window"]["requests"], 1);
        assert_eq!(t["quiet"]["burst_window"]["ttft_ms"]["p99"], 900.0);
        assert_eq!(t["default"]["run"]["requests"], 1);
        // Window tokens: quiet-a 100, noisy 100, default 100.
        assert_eq!(v["noisy_share_of_window_tokens"], 0.333);
        assert_eq!(v["established_cut"], 1);
    }
}
