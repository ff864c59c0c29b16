//! What the read endpoints answer, and the snapshot they (and the metrics) are built from.

use std::{collections::BTreeMap, net::IpAddr};

use anyhow::{Context, Result};
use serde::Serialize;
use serde_json::{json, Value};
use tokio::sync::Mutex;

use crate::{
    config::{Cidr, TenantList},
    controller::{Controller, Counters, Plane, Traffic},
    policy::BackendDecision,
    state::{Admin, Backend, PlaneState, QuicMode, State, Vip, VipSpec},
};

/// What the read endpoints and the metrics report, copied under the controller lock.
pub(crate) struct Snapshot {
    pub state: State,
    /// Backend id → the Maglev weight it is steered with now.
    pub effective: BTreeMap<u32, u32>,
    /// Backend id → active connection-table entries.
    pub flows: BTreeMap<u32, u64>,
    /// When `flows` was counted and how long the walk took, where counts may lag.
    pub flows_counted: Option<crate::controller::FlowCount>,
    pub counters: Counters,
    pub event_counts: BTreeMap<String, u64>,
    /// Backend id → the adaptive policy's latest view (score, state, cooldown, telemetry).
    pub steering: BTreeMap<u32, BackendDecision>,
    /// Each tenant on each VIP ([`tenant_rows`]).
    pub tenants: Vec<TenantRow>,
}

impl Snapshot {
    pub(crate) async fn take<P: Plane>(ctl: &Mutex<Controller<P>>) -> Result<Snapshot> {
        let mut ctl = ctl.lock().await;
        let flows = ctl.active_flows().context("counting active flows")?;
        let counters = ctl.counters().context("reading the data-plane counters")?;
        let tenants = tenant_rows(&mut ctl)?;
        let state = ctl.state().clone();
        let effective = state
            .vips
            .values()
            .flat_map(|v| v.backends.values())
            .map(|b| (b.id, ctl.effective_weight(b)))
            .collect();
        let steering = state
            .vips
            .values()
            .flat_map(|v| v.backends.values())
            .filter_map(|b| ctl.decision(b.id).map(|d| (b.id, d.clone())))
            .collect();
        Ok(Snapshot {
            state,
            effective,
            flows,
            flows_counted: ctl.flows_counted(),
            counters,
            event_counts: ctl.event_counts().clone(),
            steering,
            tenants,
        })
    }

    pub(crate) fn backend_flows(&self, b: &Backend) -> u64 {
        self.flows.get(&b.id).copied().unwrap_or(0)
    }

    pub(crate) fn backend_traffic(&self, b: &Backend) -> Traffic {
        self.counters
            .backends
            .get(&b.id)
            .copied()
            .unwrap_or_default()
    }

    pub(crate) fn vip_traffic(&self, v: &Vip) -> Traffic {
        self.counters.vips.get(&v.id).copied().unwrap_or_default()
    }

    pub(super) fn vip_live(&self, v: &Vip) -> Live {
        Live {
            active_flows: v.backends.values().map(|b| self.backend_flows(b)).sum(),
            traffic: self.vip_traffic(v),
            steering: None,
        }
    }

    pub(super) fn backend_view<'a>(&self, b: &'a Backend) -> BackendView<'a> {
        let live = Live {
            active_flows: self.backend_flows(b),
            traffic: self.backend_traffic(b),
            steering: self.steering.get(&b.id).cloned(),
        };
        BackendView::new(b, self.effective[&b.id], Some(live))
    }
}

/// One tenant on one VIP, as `GET /v1/tenants`, `sluice tenant list` and the metrics show
/// it: its limits there (overrides applied), its sessions, counters and state.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub(crate) struct TenantRow {
    pub tenant: String,
    pub id: u32,
    pub vip: String,
    pub prefixes: Vec<Cidr>,
    pub weight: u32,
    pub max_sessions: u32,
    pub new_sessions_per_sec: u32,
    pub burst: u32,
    /// Active sessions of its clients on the VIP (0 on a second-chance VIP).
    pub sessions: u64,
    /// New sessions admitted, cumulative.
    pub admitted: u64,
    /// New sessions admitted per second at the latest policy step.
    pub admitted_per_sec: f64,
    /// New sessions refused, cumulative, by the limit that refused them.
    pub refused: TenantRefused,
    /// `"ok"`, `"capped"` (at max_sessions) or `"over-share"` (over its share of a full
    /// pool): what the data plane applies to its new sessions now.
    pub state: &'static str,
}

#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize)]
pub(crate) struct TenantRefused {
    pub sessions: u64,
    pub share: u64,
    pub rate: u64,
}

/// The rows of every tenant on every VIP, the default tenant first on each VIP (none
/// without tenants).
pub(crate) fn tenant_rows<P: Plane>(ctl: &mut Controller<P>) -> Result<Vec<TenantRow>> {
    let usage = ctl
        .tenant_usage()
        .context("counting the tenants' sessions")?;
    let state = ctl.state();
    if state.tenants.is_empty() {
        return Ok(Vec::new());
    }
    let tenants = state.tenants.with_ids();
    let mut rows = Vec::new();
    for v in state.vips.values() {
        for (id, t) in &tenants {
            let l = t.limits_on(&v.spec.tenants);
            let key = (v.spec.name.clone(), t.name.clone());
            let u = usage.get(&key).copied().unwrap_or_default();
            let decision = ctl.tenant_decision(&v.spec.name, &t.name);
            let st = match decision {
                Some(d) if d.capped => "capped",
                Some(d) if d.over_share => "over-share",
                _ => "ok",
            };
            rows.push(TenantRow {
                tenant: t.name.clone(),
                id: *id,
                vip: v.spec.name.clone(),
                prefixes: t.prefixes.clone(),
                weight: l.weight,
                max_sessions: l.max_sessions,
                new_sessions_per_sec: l.new_sessions_per_sec,
                burst: l.burst,
                sessions: u.sessions,
                admitted: u.stats.admitted,
                admitted_per_sec: decision.map_or(0.0, |d| d.admitted_per_sec),
                refused: TenantRefused {
                    sessions: u.stats.refused_sessions,
                    share: u.stats.refused_share,
                    rate: u.stats.refused_rate,
                },
                state: st,
            });
        }
    }
    Ok(rows)
}

/// `GET /v1/tenants`: the `[[tenant]]` tables in force, in the shape `PUT` takes, and the
/// rows.
pub(crate) fn tenants_view<P: Plane>(ctl: &mut Controller<P>) -> Result<Value> {
    let rows = tenant_rows(ctl)?;
    let tables = TenantList {
        tenants: ctl.state().tenants.list.clone(),
    };
    let mut v = serde_json::to_value(tables)?;
    v["tenants"] = serde_json::to_value(rows)?;
    Ok(v)
}

/// Counts read from the data plane; reads show them, change replies leave them out.
#[derive(Serialize)]
pub(super) struct Live {
    active_flows: u64,
    traffic: Traffic,
    /// Score, steering state, cooldown left, sessions and telemetry age.
    #[serde(skip_serializing_if = "Option::is_none")]
    steering: Option<BackendDecision>,
}

#[derive(Serialize)]
pub(super) struct VipView<'a> {
    id: u32,
    #[serde(flatten)]
    spec: &'a VipSpec,
    /// `"off"`, which the spec leaves out at its default (a `cid` VIP's spec has its own).
    #[serde(rename = "quic", skip_serializing_if = "Option::is_none")]
    quic_off: Option<QuicMode>,
    backend_count: usize,
    #[serde(flatten)]
    live: Option<Live>,
}

impl<'a> VipView<'a> {
    pub(super) fn new(v: &'a Vip, live: Option<Live>) -> Self {
        VipView {
            id: v.id,
            spec: &v.spec,
            quic_off: (v.spec.quic == QuicMode::Off).then_some(QuicMode::Off),
            backend_count: v.backends.len(),
            live,
        }
    }
}

#[derive(Serialize)]
pub(super) struct BackendView<'a> {
    address: IpAddr,
    id: u32,
    weight: u32,
    effective_weight: u32,
    state: PlaneState,
    drain_since_ms: Option<u64>,
    drain_deadline_ms: Option<u64>,
    healthy: bool,
    labels: &'a BTreeMap<String, String>,
    max_sessions: u32,
    /// The QUIC-LB server ID (hex) on a `quic = "cid"` VIP; null elsewhere.
    quic_server_id: Option<&'a str>,
    #[serde(flatten)]
    live: Option<Live>,
}

impl<'a> BackendView<'a> {
    pub(super) fn new(b: &'a Backend, effective_weight: u32, live: Option<Live>) -> Self {
        let (drain_since_ms, drain_deadline_ms) = match b.admin {
            Admin::Active => (None, None),
            Admin::Draining {
                since_ms,
                deadline_ms,
            } => (Some(since_ms), deadline_ms),
        };
        BackendView {
            address: b.spec.address,
            id: b.id,
            weight: b.spec.weight,
            effective_weight,
            state: b.plane_state(),
            drain_since_ms,
            drain_deadline_ms,
            healthy: b.healthy,
            labels: &b.spec.labels,
            max_sessions: b.spec.max_sessions,
            quic_server_id: b.spec.quic_server_id.as_deref(),
            live,
        }
    }
}

/// `{"vip": ..., "backends": [...]}`: what GET and POST of a VIP answer.
pub(super) fn vip_detail(v: &Vip, backends: Vec<BackendView>, live: Option<Live>) -> Value {
    json!({ "vip": VipView::new(v, live), "backends": backends })
}

/// Every VIP with one figure (`key`) for itself and for each of its backends.
fn per_vip(
    snap: &Snapshot,
    key: &str,
    vip: impl Fn(&Vip) -> Value,
    backend: impl Fn(&Backend) -> Value,
) -> Vec<Value> {
    snap.state
        .vips
        .values()
        .map(|v| {
            let backends: Vec<_> = v
                .backends
                .values()
                .map(|b| json!({ "address": b.spec.address, "id": b.id, key: backend(b) }))
                .collect();
            json!({ "vip": v.spec.name, key: vip(v), "backends": backends })
        })
        .collect()
}

pub(super) fn flows(snap: &Snapshot) -> Value {
    let vips = per_vip(
        snap,
        "active_flows",
        |v| json!(snap.vip_live(v).active_flows),
        |b| json!(snap.backend_flows(b)),
    );
    json!({ "vips": vips })
}

pub(super) fn stats(snap: &Snapshot) -> Value {
    let vips = per_vip(
        snap,
        "traffic",
        |v| json!(snap.vip_traffic(v)),
        |b| json!(snap.backend_traffic(b)),
    );
    json!({ "global": snap.counters.global, "vips": vips })
}
