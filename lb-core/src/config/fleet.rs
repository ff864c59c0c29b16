//! `[fleet]`: where the fleet's shared state lives (etcd) and who this host is in it.

use std::time::Duration;

use serde::{Deserialize, Serialize};

/// `[fleet]`, validated.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub struct FleetConfig {
    /// etcd client URLs (`http://host:port`), tried in order.
    pub endpoints: Vec<String>,
    /// Every key of this fleet starts with it (several fleets can share one etcd).
    pub prefix: String,
    /// This host's name in the fleet: unique, it names its report and its leadership.
    pub host: String,
    /// The steering leader's lease: a dead leader is replaced within this time.
    #[serde(with = "super::types::duration_str")]
    pub lease_ttl: Duration,
    /// One etcd request's limit; past it etcd counts as unreachable.
    #[serde(with = "super::types::duration_str")]
    pub request_timeout: Duration,
}

/// `[fleet]` as written.
#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RawFleet {
    pub endpoints: Option<Vec<String>>,
    pub prefix: Option<String>,
    pub host: Option<String>,
    pub lease_ttl: Option<String>,
    pub request_timeout: Option<String>,
}

pub const DEFAULT_PREFIX: &str = "/sluice";
pub const DEFAULT_LEASE_TTL: Duration = Duration::from_secs(5);
pub const DEFAULT_REQUEST_TIMEOUT: Duration = Duration::from_secs(1);

/// Validates `[fleet]`; the errors are (key, message), every one found.
pub fn validate(r: RawFleet) -> Result<FleetConfig, Vec<(&'static str, String)>> {
    let mut errs = vec![];
    let endpoints = r.endpoints.unwrap_or_default();
    if endpoints.is_empty() {
        errs.push((
            "endpoints",
            "missing (required); allowed: a list of etcd client URLs such as \
             [\"http://10.0.0.1:2379\"]"
                .to_string(),
        ));
    }
    for e in &endpoints {
        if let Err(why) = super::HttpUrl::parse(e) {
            errs.push(("endpoints", why));
        }
    }
    let prefix = r.prefix.unwrap_or_else(|| DEFAULT_PREFIX.to_string());
    if !prefix.starts_with('/') || prefix.ends_with('/') || prefix.len() < 2 {
        errs.push((
            "prefix",
            format!("{prefix:?}: allowed: a key path starting with `/`, not ending with one, e.g. \"/sluice/edge-1\""),
        ));
    }
    let host = r.host.unwrap_or_default();
    let name_ok = |s: &str| {
        !s.is_empty()
            && s.len() <= 63
            && s.bytes()
                .all(|b| b.is_ascii_alphanumeric() || b == b'-' || b == b'_' || b == b'.')
    };
    if !name_ok(&host) {
        errs.push((
            "host",
            format!(
                "{host:?}: allowed: this host's unique name in the fleet, 1 to 63 of \
                 [A-Za-z0-9._-] (required)"
            ),
        ));
    }
    let mut dur = |key: &'static str, v: Option<String>, d: Duration, lo: u64, hi: u64| {
        let Some(s) = v else { return d };
        match humantime::parse_duration(&s) {
            Ok(t) if t >= Duration::from_millis(lo) && t <= Duration::from_millis(hi) => t,
            Ok(_) => {
                errs.push((
                    key,
                    format!("{s:?} is out of range; allowed: {lo}ms to {hi}ms"),
                ));
                d
            }
            Err(e) => {
                errs.push((key, format!("{s:?}: {e}; allowed: e.g. \"5s\"")));
                d
            }
        }
    };
    let lease_ttl = dur("lease_ttl", r.lease_ttl, DEFAULT_LEASE_TTL, 2_000, 60_000);
    let request_timeout = dur(
        "request_timeout",
        r.request_timeout,
        DEFAULT_REQUEST_TIMEOUT,
        100,
        10_000,
    );
    if request_timeout * 2 > lease_ttl {
        errs.push((
            "request_timeout",
            format!(
                "{} is more than half of lease_ttl ({}): a leader could lose its lease while \
                 one request waits; allowed: at most lease_ttl / 2",
                humantime::format_duration(request_timeout),
                humantime::format_duration(lease_ttl)
            ),
        ));
    }
    if !errs.is_empty() {
        return Err(errs);
    }
    Ok(FleetConfig {
        endpoints,
        prefix,
        host,
        lease_ttl,
        request_timeout,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn raw(host: &str) -> RawFleet {
        RawFleet {
            endpoints: Some(vec!["http://127.0.0.1:2379".into()]),
            host: Some(host.into()),
            ..Default::default()
        }
    }

    #[test]
    fn defaults_and_errors() {
        let c = validate(raw("lb-1")).unwrap();
        assert_eq!(c.prefix, "/sluice");
        assert_eq!(c.lease_ttl, Duration::from_secs(5));
        let e = validate(RawFleet {
            endpoints: Some(vec!["https://x:1".into()]),
            prefix: Some("sluice/".into()),
            host: Some("a b".into()),
            lease_ttl: Some("1s".into()),
            request_timeout: None,
        })
        .unwrap_err();
        let keys: Vec<&str> = e.iter().map(|(k, _)| *k).collect();
        assert_eq!(keys, ["endpoints", "prefix", "host", "lease_ttl"], "{e:?}");
        let e = validate(RawFleet {
            request_timeout: Some("3s".into()),
            ..raw("lb-1")
        })
        .unwrap_err();
        assert_eq!(e[0].0, "request_timeout");
        assert!(e[0].1.contains("at most lease_ttl / 2"), "{e:?}");
    }
}
