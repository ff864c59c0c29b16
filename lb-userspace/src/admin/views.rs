//! What the read endpoints answer, and the snapshot they (and the metrics) are built from.

use std::{collections::BTreeMap, net::IpAddr};

use anyhow::{Context, Result};
use serde::Serialize;
use serde_json::{json, Value};
use tokio::sync::Mutex;

use crate::{
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
}

impl Snapshot {
    pub(crate) async fn take<P: Plane>(ctl: &Mutex<Controller<P>>) -> Result<Snapshot> {
        let mut ctl = ctl.lock().await;
        let flows = ctl.active_flows().context("counting active flows")?;
        let counters = ctl.counters().context("reading the data-plane counters")?;
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
