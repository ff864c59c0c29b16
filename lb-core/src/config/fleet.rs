//! `[fleet]`: where the fleet's shared state lives (etcd) and who this host is in it.

use std::time::Duration;

use serde::{Deserialize, Serialize};

use super::{Checker, HttpUrl, KeyPath, UrlUse};

/// `[fleet]`, validated.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub struct FleetConfig {
    /// etcd client URLs (`http://host:port`), tried in order.
    pub endpoints: Vec<HttpUrl>,
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

/// Checks `[fleet]` at `p`, recording every problem in `c`.
pub(super) fn fleet(c: &mut Checker, p: &KeyPath, r: RawFleet) -> Option<FleetConfig> {
    let endpoints = endpoints(c, &p.key("endpoints"), r.endpoints.unwrap_or_default());
    let prefix = r.prefix.unwrap_or_else(|| DEFAULT_PREFIX.to_string());
    let prefix_ok = c.rule(
        &p.key("prefix"),
        if prefix.starts_with('/') && !prefix.ends_with('/') && prefix.len() >= 2 {
            Ok(())
        } else {
            Err(format!(
                "{prefix:?}: allowed: a key path starting with `/`, not ending with one, e.g. \
                 \"/sluice/edge-1\""
            ))
        },
    );
    let host = r.host.unwrap_or_default();
    let host_ok = c.rule(&p.key("host"), host_name(&host));
    let lease_ttl = c.duration_in(
        &p.key("lease_ttl"),
        r.lease_ttl.as_deref(),
        DEFAULT_LEASE_TTL,
        Duration::from_secs(2)..=Duration::from_secs(60),
        "5s",
    );
    let request_timeout = c.duration_in(
        &p.key("request_timeout"),
        r.request_timeout.as_deref(),
        DEFAULT_REQUEST_TIMEOUT,
        Duration::from_millis(100)..=Duration::from_secs(10),
        "1s",
    );
    if let (Some(timeout), Some(ttl)) = (request_timeout, lease_ttl) {
        if timeout * 2 > ttl {
            c.err(
                &p.key("request_timeout"),
                format!(
                    "{} is more than half of lease_ttl ({}): a leader could lose its lease while \
                     one request waits; allowed: at most lease_ttl / 2",
                    humantime::format_duration(timeout),
                    humantime::format_duration(ttl)
                ),
            );
            return None;
        }
    }
    (prefix_ok && host_ok).then_some(())?;
    Some(FleetConfig {
        endpoints: endpoints?,
        prefix,
        host,
        lease_ttl: lease_ttl?,
        request_timeout: request_timeout?,
    })
}

/// etcd's client URLs: at least one, each an http:// URL.
fn endpoints(c: &mut Checker, p: &KeyPath, list: Vec<String>) -> Option<Vec<HttpUrl>> {
    const ETCD: UrlUse = UrlUse {
        client: "the fleet's etcd client",
        server: "etcd's",
        example: "http://10.0.0.1:2379",
    };
    if list.is_empty() {
        c.missing(
            p,
            &format!("a list of etcd client URLs such as [{:?}]", ETCD.example),
        );
        return None;
    }
    let urls: Vec<Option<HttpUrl>> = list
        .iter()
        .enumerate()
        .map(|(i, e)| c.url(&p.idx(i), Some(e), &ETCD))
        .collect();
    urls.into_iter().collect()
}

/// This host's name in the fleet: it names its report and its leadership.
fn host_name(host: &str) -> Result<(), String> {
    let ok = !host.is_empty()
        && host.len() <= 63
        && host
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || b == b'-' || b == b'_' || b == b'.');
    if ok {
        Ok(())
    } else {
        Err(format!(
            "{host:?}: allowed: this host's unique name in the fleet, 1 to 63 of [A-Za-z0-9._-] \
             (required)"
        ))
    }
}
