//! A fleet of LB hosts sharing one desired state and one steering decision through etcd.
//!
//! With `[fleet]` configured, the fleet's VIPs, backends, drains, weights and the steering
//! overlay are one versioned table set in etcd ([`doc::Tables`]). An admin request on any
//! host is a compare-and-put of the next version; every host applies the versions it
//! watches, in order, so hosts at the same version hold the same Maglev tables (their ring
//! digests are equal). One host, holding the `leader` key through an etcd lease, runs the
//! adaptive policy on the fleet's session counts and completes drains, publishing each
//! change as a new version.
//!
//! Static stability: when etcd cannot be reached a host keeps the last version it applied,
//! its health checks go on (health is each host's own verdict, never in etcd), writes are
//! refused with a clear error, and when etcd answers again the host reads the latest version
//! and carries on.

/// `[fleet]`: its types and validation live with the rest of the configuration.
pub use crate::config::fleet as config;
pub mod doc;
pub mod gateway;
pub mod run;
pub mod store;

use std::{collections::BTreeMap, net::IpAddr, sync::Mutex};

use serde::Serialize;

use crate::{
    controller::{Controller, Event, Overlay, Plane},
    state::{Admin, Limits, Op, OpError, State},
};
pub use config::FleetConfig;
use doc::{HostReport, Keys, Tables};
use store::{Store, StoreError};

/// What `sluice status`, `/v1/status` and the metrics show of the fleet.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize)]
pub struct FleetStatus {
    pub host: String,
    /// etcd answered the last request.
    pub etcd_up: bool,
    /// Since when (unix ms) etcd has been up or unreachable.
    pub since_ms: u64,
    /// Why etcd counts as unreachable (the last error).
    pub error: Option<String>,
    /// The table-set version this host applied (0: none yet).
    pub version: u64,
    /// Who published it and why.
    pub by: String,
    pub reason: String,
    /// The steering leader's host name, as last seen.
    pub leader: Option<String>,
    pub is_leader: bool,
    /// Times etcd became unreachable since the start.
    pub outages: u64,
    /// Each VIP's ring digest (FNV-1a of the ring by backend address) as applied here.
    pub digests: BTreeMap<String, String>,
}

/// Why a write to the fleet failed.
#[derive(Debug, thiserror::Error)]
pub enum WriteError {
    #[error("{0}")]
    Op(#[from] OpError),
    #[error(
        "the fleet's desired state is in etcd, which cannot be reached ({0}); this host keeps \
         forwarding with table-set version {1} and its health checks, but changes are refused \
         until etcd answers again: retry then"
    )]
    Unreachable(String, u64),
    #[error("etcd refused the change: {0}")]
    Refused(String),
    #[error("the table set changed under this request {0} times in a row; retry")]
    Contended(u32),
}

impl WriteError {
    pub fn http_status(&self) -> u16 {
        match self {
            WriteError::Op(e) => e.http_status(),
            WriteError::Unreachable(..) => 503,
            WriteError::Refused(_) => 502,
            WriteError::Contended(_) => 409,
        }
    }
}

impl<S: Store> std::fmt::Debug for Fleet<S> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Fleet")
            .field("cfg", &self.cfg)
            .field("status", &self.status())
            .finish_non_exhaustive()
    }
}

/// Tries of one compare-and-put before a write gives up as contended.
const WRITE_TRIES: u32 = 8;

/// One host's view of the fleet: the store, its keys and what it applied.
pub struct Fleet<S: Store> {
    pub store: S,
    pub keys: Keys,
    pub cfg: FleetConfig,
    pub limits: Limits,
    pub seed: u32,
    status: Mutex<FleetStatus>,
}

impl<S: Store> Fleet<S> {
    pub fn new(store: S, cfg: FleetConfig, limits: Limits, seed: u32) -> Fleet<S> {
        let status = FleetStatus {
            host: cfg.host.clone(),
            ..Default::default()
        };
        Fleet {
            store,
            keys: Keys::new(&cfg.prefix),
            cfg,
            limits,
            seed,
            status: Mutex::new(status),
        }
    }

    pub fn status(&self) -> FleetStatus {
        self.status.lock().expect("fleet status lock").clone()
    }

    fn with_status<T>(&self, f: impl FnOnce(&mut FleetStatus) -> T) -> T {
        f(&mut self.status.lock().expect("fleet status lock"))
    }

    /// Records an etcd outcome; the event to log when it flips (up ↔ unreachable).
    pub fn observed(&self, r: Result<(), &StoreError>, now_ms: u64) -> Option<Event> {
        self.with_status(|s| {
            let (up, error) = match r {
                Ok(()) => (true, None),
                // etcd answered, even if it refused: it is reachable.
                Err(StoreError::Refused(e)) => (true, Some(e.clone())),
                Err(StoreError::Unreachable(e)) => (false, Some(e.clone())),
            };
            let flipped = up != s.etcd_up || s.since_ms == 0;
            s.error = error;
            if !flipped {
                return None;
            }
            s.etcd_up = up;
            s.since_ms = now_ms;
            if !up {
                s.outages += 1;
                s.is_leader = false;
            }
            let (kind, reason) = if up {
                (
                    "fleet-etcd-up",
                    format!("etcd answers; applied version {}", s.version),
                )
            } else {
                (
                    "fleet-etcd-unreachable",
                    format!(
                        "{}; forwarding with table-set version {}, local health checks go on, \
                         changes are refused",
                        s.error.as_deref().unwrap_or_default(),
                        s.version
                    ),
                )
            };
            Some(Event {
                time_ms: now_ms,
                kind: kind.into(),
                vip: String::new(),
                backend: None,
                reason,
            })
        })
    }

    fn observe<T>(
        &self,
        r: Result<T, StoreError>,
        now_ms: u64,
        events: &mut Vec<Event>,
    ) -> Result<T, StoreError> {
        events.extend(self.observed(r.as_ref().map(drop), now_ms));
        r
    }

    /// The table set in etcd and its mod revision (0 and None: not there).
    pub async fn read(&self) -> Result<(Option<Tables>, i64, i64), StoreError> {
        let r = self.store.list(&self.keys.tables).await?;
        let kv = r.kvs.into_iter().find(|kv| kv.key == self.keys.tables);
        match kv {
            None => Ok((None, 0, r.revision)),
            Some(kv) => {
                let t: Tables = serde_json::from_slice(&kv.value).map_err(|e| {
                    StoreError::Refused(format!("{} is not a table set: {e}", self.keys.tables))
                })?;
                Ok((Some(t), kv.mod_revision, r.revision))
            }
        }
    }

    /// Publishes the table set `change` makes of the current one as the next version
    /// (compare-and-put, retried while others publish). Returns what was published; the
    /// caller applies it (or its watch will).
    pub async fn publish(
        &self,
        reason: &str,
        now_ms: u64,
        events: &mut Vec<Event>,
        change: impl Fn(&Tables) -> Result<Option<Tables>, OpError>,
    ) -> Result<Option<Tables>, WriteError> {
        let version = || self.with_status(|s| s.version);
        for _ in 0..WRITE_TRIES {
            let r = self.read().await;
            let (current, rev, _) = match self.observe(r, now_ms, events) {
                Ok(c) => c,
                Err(StoreError::Unreachable(e)) => {
                    return Err(WriteError::Unreachable(e, version()))
                }
                Err(StoreError::Refused(e)) => return Err(WriteError::Refused(e)),
            };
            let current = current.unwrap_or_default();
            let Some(mut next) = change(&current)? else {
                return Ok(None);
            };
            next.version = current.version + 1;
            next.by = self.cfg.host.clone();
            next.reason = reason.to_string();
            for v in next.state.vips.values_mut() {
                for b in v.backends.values_mut() {
                    b.healthy = true;
                }
            }
            let body = serde_json::to_vec(&next).expect("a table set serializes");
            let r = self.store.put_if(&self.keys.tables, body, rev, 0).await;
            match self.observe(r, now_ms, events) {
                Ok(true) => return Ok(Some(next)),
                Ok(false) => continue,
                Err(StoreError::Unreachable(e)) => {
                    return Err(WriteError::Unreachable(e, version()))
                }
                Err(StoreError::Refused(e)) => return Err(WriteError::Refused(e)),
            }
        }
        Err(WriteError::Contended(WRITE_TRIES))
    }

    /// An operator's request: validated against the fleet's current table set, published as
    /// the next version.
    pub async fn submit(
        &self,
        op: &Op,
        now_ms: u64,
        events: &mut Vec<Event>,
    ) -> Result<Tables, WriteError> {
        if let Op::SetHealth { .. } = op {
            return Err(OpError::Invalid(
                "health is each host's own verdict in a fleet; it is not set through etcd".into(),
            )
            .into());
        }
        let reason = format!("request {}", op_name(op));
        let t = self
            .publish(&reason, now_ms, events, |t| {
                let state = t.state.apply(op, now_ms, &self.limits)?;
                Ok(Some(Tables {
                    state,
                    overlay: t.overlay.clone(),
                    ..Default::default()
                }))
            })
            .await?;
        Ok(t.expect("a request always publishes"))
    }

    /// Seeds an empty fleet with this host's configured state (version 1); a fleet that has
    /// a table set keeps it.
    pub async fn seed(
        &self,
        state: &State,
        now_ms: u64,
        events: &mut Vec<Event>,
    ) -> Result<Option<Tables>, WriteError> {
        self.publish("seeded from the configuration", now_ms, events, |t| {
            Ok((t.version == 0).then(|| Tables {
                state: state.clone(),
                ..Default::default()
            }))
        })
        .await
    }

    /// Applies `t` to the controller when it is newer than what this host applied (versions
    /// only move forward, whatever order watch events and replies arrive in). True if applied.
    pub fn apply<P: Plane>(&self, ctl: &mut Controller<P>, t: &Tables, now_ms: u64) -> bool {
        if t.version <= self.with_status(|s| s.version) {
            return false;
        }
        if let Err(e) = ctl.adopt(t.state.clone(), t.overlay.clone(), now_ms, &t.reason) {
            tracing::error!(version = t.version, error = %e, "cannot apply the fleet's table set; keeping the previous one");
            return false;
        }
        let digests = doc::ring_digests(ctl.state(), ctl.overlay(), self.seed);
        self.with_status(|s| {
            s.version = t.version;
            s.by = t.by.clone();
            s.reason = t.reason.clone();
            s.digests = digests;
        });
        ctl.record(Event {
            time_ms: now_ms,
            kind: "fleet-apply".into(),
            vip: String::new(),
            backend: None,
            reason: format!(
                "table set version {} from {}: {}",
                t.version, t.by, t.reason
            ),
        });
        true
    }

    /// Recomputes the digests after a local change (a health verdict).
    pub fn refresh_digests<P: Plane>(&self, ctl: &Controller<P>) {
        let digests = doc::ring_digests(ctl.state(), ctl.overlay(), self.seed);
        self.with_status(|s| s.digests = digests);
    }

    pub fn set_leader(&self, leader: Option<String>, is_leader: bool) {
        self.with_status(|s| {
            s.leader = leader;
            s.is_leader = is_leader;
        });
    }
}

fn op_name(op: &Op) -> String {
    serde_json::to_value(op)
        .ok()
        .and_then(|v| v.get("op").and_then(|o| o.as_str()).map(str::to_owned))
        .unwrap_or_default()
}

/// Drains the fleet can complete: a draining backend with no active flow on any live host
/// (a host's report lives under its lease), every report taken after the drain began; or
/// one past its deadline.
pub fn drains_done(
    t: &Tables,
    reports: &BTreeMap<String, HostReport>,
    now_ms: u64,
) -> Vec<(String, IpAddr, String)> {
    let mut out = vec![];
    for v in t.state.vips.values() {
        for b in v.backends.values() {
            let Admin::Draining {
                since_ms,
                deadline_ms,
            } = b.admin
            else {
                continue;
            };
            let fresh = reports.values().filter(|r| r.taken_ms >= since_ms).count();
            let left: u64 = reports.values().filter_map(|r| r.flows.get(&b.id)).sum();
            if left == 0 && fresh == reports.len() && !reports.is_empty() {
                out.push((
                    v.spec.name.clone(),
                    b.spec.address,
                    format!("no active flows left on {} hosts", reports.len()),
                ));
            } else if deadline_ms.is_some_and(|d| now_ms >= d) {
                out.push((
                    v.spec.name.clone(),
                    b.spec.address,
                    format!(
                        "deadline reached with {left} active flows in the fleet; they re-steer"
                    ),
                ));
            }
        }
    }
    out
}

/// The overlay a steering decision publishes, keyed by backend id (ids are the fleet's).
pub fn with_overlay(t: &Tables, overlay: &Overlay) -> Option<Tables> {
    (t.overlay != *overlay).then(|| Tables {
        state: t.state.clone(),
        overlay: overlay.clone(),
        ..Default::default()
    })
}

#[cfg(test)]
mod tests;

/// `sluice status` lines for the fleet section of `/v1/status`.
pub fn status_rows(f: &serde_json::Value) -> Vec<(&'static str, String)> {
    let s = |k: &str| match &f[k] {
        serde_json::Value::String(s) => s.clone(),
        serde_json::Value::Null => "-".into(),
        v => v.to_string(),
    };
    let etcd = if f["etcd_up"].as_bool() == Some(true) {
        "up".to_string()
    } else {
        format!(
            "UNREACHABLE: forwarding with version {}, changes refused ({})",
            s("version"),
            s("error")
        )
    };
    let leader = match (f["is_leader"].as_bool(), s("leader")) {
        (Some(true), l) => format!("{l} (this host)"),
        (_, l) => l,
    };
    let mut rows = vec![
        ("fleet host", s("host")),
        ("etcd", etcd),
        (
            "tables",
            format!(
                "version {} from {} ({})",
                s("version"),
                s("by"),
                s("reason")
            ),
        ),
        ("leader", leader),
    ];
    if let Some(d) = f["digests"].as_object() {
        for (vip, digest) in d {
            rows.push(("ring", format!("{vip} {}", digest.as_str().unwrap_or("-"))));
        }
    }
    rows
}

/// The fleet's metrics: etcd reachability, the applied version, leadership, ring digests.
pub fn metrics(reg: &mut prometheus_client::registry::Registry, s: &FleetStatus) {
    use crate::prom_text::gauges;
    let host = || vec![("host", s.host.clone())];
    gauges(
        reg,
        "fleet_etcd_up",
        "1 while etcd answers; 0: forwarding with the last applied table set, changes refused",
        vec![(host(), i64::from(s.etcd_up))],
    );
    gauges(
        reg,
        "fleet_table_version",
        "The fleet table-set version this host applied",
        vec![(host(), s.version as i64)],
    );
    gauges(
        reg,
        "fleet_leader",
        "1 on the fleet's steering leader",
        vec![(host(), i64::from(s.is_leader))],
    );
    crate::prom_text::counters(
        reg,
        "fleet_etcd_outages",
        "Times etcd became unreachable since the daemon started",
        vec![(host(), s.outages)],
    );
    gauges(
        reg,
        "fleet_ring_digest",
        "Each VIP's ring digest (label), 1 per VIP: equal digests on every host mean equal tables",
        s.digests
            .iter()
            .map(|(vip, d)| (vec![("vip", vip.clone()), ("digest", d.clone())], 1))
            .collect(),
    );
}

/// A valid `[fleet]` with one etcd endpoint, for tests.
#[cfg(test)]
pub(crate) fn config_for_tests(
    endpoint: &str,
    host: &str,
    lease_ttl: std::time::Duration,
) -> FleetConfig {
    FleetConfig {
        endpoints: vec![crate::config::HttpUrl::parse(endpoint).expect("a valid URL")],
        prefix: config::DEFAULT_PREFIX.into(),
        host: host.into(),
        lease_ttl,
        request_timeout: config::DEFAULT_REQUEST_TIMEOUT,
    }
}

/// A fleet whose status has one of everything, for the metrics and dashboard tests.
#[cfg(test)]
pub(crate) fn sample() -> Fleet<gateway::Gateway> {
    let cfg = config_for_tests("http://127.0.0.1:9", "lb-1", config::DEFAULT_LEASE_TTL);
    let store = gateway::Gateway::new(&cfg.endpoints, cfg.request_timeout);
    let f = Fleet::new(store, cfg, Limits { max_vips: 4 }, 1);
    f.with_status(|s| {
        s.etcd_up = true;
        s.version = 3;
        s.digests.insert("api".into(), "0123456789abcdef".into());
    });
    f
}
