//! The controller: owns the steering state, turns validated requests into data-plane
//! writes, persists the result, audits every request and completes drains.
//!
//! It is written against the `Plane` trait, so its logic runs in tests with a fake plane
//! and a fake clock; the daemon plugs in the map writer.

use std::{
    collections::{BTreeMap, VecDeque},
    io::Write,
    net::IpAddr,
    path::PathBuf,
    time::Duration,
};

use anyhow::{Context, Result};
use lb_common::TrafficStats;
use serde::{Deserialize, Serialize};
use serde_json::json;

use crate::{
    config::TenantConfig,
    private_file,
    state::{
        Admin, Backend, BackendSpec, FlowState, Limits, Op, OpError, QuicMode, State, VipSpec,
    },
};

/// What adaptive steering lays over the operator's state: it changes how new sessions are
/// admitted and spread, never the VIPs and backends themselves.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct Overlay {
    /// Maglev weight per backend id where it differs from the configured weight.
    pub weights: BTreeMap<u32, u32>,
    /// Backends at their session cap or saturated: new sessions probe past them.
    pub full: std::collections::BTreeSet<u32>,
    /// Of `full`, those at the operator's session cap: affinity entries bring them no new
    /// sessions either (a saturated backend keeps its clients' next turns).
    #[serde(default)]
    pub capped: std::collections::BTreeSet<u32>,
    /// Backends down, moved away by the policy for a fault (to weight 0, or a reduced
    /// weight when the others have no headroom), or with requests waiting in their queue:
    /// affinity entries bring them no new sessions. A saturation move is not one. Named
    /// `moved` in the fleet's shared document, as before (hosts of both versions read it
    /// the same way: their clients' affinity yields there).
    #[serde(rename = "moved")]
    pub no_affinity: std::collections::BTreeSet<u32>,
    /// VIPs whose new sessions are shed (their priority class is below what the
    /// overloaded pool admits).
    pub shed: std::collections::BTreeSet<String>,
    /// VIPs with admission control configured: a new session that finds only full backends
    /// is refused. Elsewhere full backends are only probed past.
    #[serde(default)]
    pub admission: std::collections::BTreeSet<String>,
    /// `policy.shed = "rst"`: every VIP answers the TCP sessions it refuses with a RST, also
    /// those refused because all of its backends are full (not only shed VIPs).
    pub rst: bool,
    /// `TENANT_F_*` flags by `TENANT_LIMITS` index (`vip_id * MAX_TENANTS + tenant`), where
    /// not zero: the tenants at their session cap or over their share of a busy or full pool.
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub tenant_flags: BTreeMap<u32, u32>,
}

impl Overlay {
    pub fn weight(&self, b: &Backend) -> u32 {
        self.weights.get(&b.id).copied().unwrap_or(b.spec.weight)
    }
}

/// One connection-table entry, as `sluice flows` shows it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct FlowEntry {
    pub key: lb_common::FlowKey,
    pub backend: u32,
    /// Time since the flow's last packet.
    pub idle: Duration,
}

/// When active flows were last counted (unix ms) and how long that walk took.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct FlowCount {
    pub taken_ms: u64,
    pub walk: Duration,
}

/// Where the data plane lives, as the controller needs it.
pub trait Plane: Send {
    /// Writes `new` (coming from `old`) with the adaptive `overlay`.
    fn apply(&mut self, old: &State, new: &State, overlay: &Overlay) -> Result<()>;
    /// Connection-table entries seen within `idle`, per backend id.
    fn active_flows(&mut self, idle: Duration) -> Result<BTreeMap<u32, u64>>;
    /// When and at what cost the counts `active_flows` returns were taken, where they may
    /// lag (a background walk); None when they are always current.
    fn flows_counted(&self) -> Option<FlowCount> {
        None
    }
    /// Global counters by name, and traffic of the VIPs and backends in `state` by id.
    fn counters(&mut self, state: &State) -> Result<Counters>;
    /// Gives connection-table entries to `f`, in table order, until it returns false.
    fn flow_entries(&mut self, f: &mut dyn FnMut(FlowEntry) -> bool) -> Result<()>;
    /// Switches the data plane's decision tracing.
    fn set_trace(&mut self, on: bool) -> Result<()>;
    /// In-band aggregates of these backend ids, summed over CPUs (none without a data plane).
    fn inband(&mut self, ids: &[u32]) -> Result<BTreeMap<u32, lb_common::InbandStats>> {
        let _ = ids;
        Ok(BTreeMap::new())
    }
    /// Traffic counters of these backend ids, summed over CPUs (none without a data plane).
    fn backend_traffic(&mut self, ids: &[u32]) -> Result<BTreeMap<u32, Traffic>> {
        let _ = ids;
        Ok(BTreeMap::new())
    }
    /// Connection-table entries seen within `idle` per (backend id, client's tenant id),
    /// where tenants are configured.
    fn tenant_flows(&mut self, idle: Duration) -> Result<BTreeMap<(u32, u32), u64>> {
        let _ = idle;
        Ok(BTreeMap::new())
    }
    /// The tenant counters at these `TENANT_STATS` indexes, summed over CPUs (none without
    /// a data plane).
    fn tenant_stats(&mut self, indexes: &[u32]) -> Result<BTreeMap<u32, lb_common::TenantStats>> {
        let _ = indexes;
        Ok(BTreeMap::new())
    }
}

/// Each tenant's usage on each VIP, by (VIP name, tenant name).
pub type TenantUsages = BTreeMap<(String, String), TenantUsage>;

/// One tenant on one VIP: its `TENANT_*` index, active sessions and counters.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct TenantUsage {
    pub index: u32,
    pub sessions: u64,
    pub stats: lb_common::TenantStats,
}

#[derive(Clone, Debug, Default, Serialize)]
pub struct Counters {
    pub global: BTreeMap<String, u64>,
    pub vips: BTreeMap<u32, Traffic>,
    pub backends: BTreeMap<u32, Traffic>,
    /// Map fill levels: map name → (entries in use, capacity).
    pub maps: BTreeMap<String, (u64, u64)>,
}

#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize)]
pub struct Traffic {
    pub packets: u64,
    pub bytes: u64,
    pub new_flows: u64,
    /// TCP handshakes started and completed (`lb_common::TrafficStats`).
    pub handshakes: u64,
    pub handshakes_completed: u64,
}

impl From<TrafficStats> for Traffic {
    fn from(t: TrafficStats) -> Self {
        Traffic {
            packets: t.packets,
            bytes: t.bytes,
            new_flows: t.new_flows,
            handshakes: t.handshakes,
            handshakes_completed: t.handshakes_completed,
        }
    }
}

/// Who made a request (SO_PEERCRED of the admin socket's client).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct Peer {
    pub uid: u32,
    pub gid: u32,
    pub pid: i32,
}

/// A control-plane event: shown by the API, counted in metrics, logged.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct Event {
    pub time_ms: u64,
    pub kind: String,
    pub vip: String,
    pub backend: Option<IpAddr>,
    pub reason: String,
}

#[derive(Debug, thiserror::Error)]
pub enum RequestError {
    #[error(transparent)]
    Rejected(#[from] OpError),
    #[error("the data plane refused the change, which was rolled back: {0:#}")]
    Plane(anyhow::Error),
}

impl RequestError {
    pub fn http_status(&self) -> u16 {
        match self {
            RequestError::Rejected(e) => e.http_status(),
            RequestError::Plane(_) => 500,
        }
    }
}

/// What is persisted so a restarted daemon restores config plus runtime changes.
#[derive(Clone, Debug, Serialize, Deserialize, PartialEq)]
pub struct Persisted {
    pub layout: u32,
    /// Hash of the config file the state was built from; a changed config is merged in.
    pub config_hash: u64,
    /// Which function made `config_hash`. Files written before it was recorded (no field)
    /// hold [`HashKind::Legacy`].
    #[serde(default)]
    pub hash: HashKind,
    pub state: State,
}

/// How a state file's `config_hash` was computed.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum HashKind {
    /// Rust's `DefaultHasher`, in state files written before the hash was FNV-1a; not stable
    /// across Rust releases.
    #[default]
    Legacy,
    /// 64-bit FNV-1a over the file's bytes: the same value from every build.
    Fnv1a,
}

/// A health verdict of one backend (see [`Controller::set_health`]).
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub struct HealthChange {
    pub vip: String,
    pub address: IpAddr,
    pub healthy: bool,
}

pub struct Settings {
    pub limits: Limits,
    pub seed: u32,
    /// A connection seen within this long counts as active (drain completion, listings).
    pub flow_idle: Duration,
    pub state_file: Option<PathBuf>,
    pub audit_log: Option<PathBuf>,
    pub config_hash: u64,
}

const EVENTS_KEPT: usize = 1000;

pub struct Controller<P: Plane> {
    state: State,
    plane: P,
    settings: Settings,
    events: VecDeque<Event>,
    event_counts: BTreeMap<String, u64>,
    /// Set by the adaptive policy.
    overlay: Overlay,
    /// The policy's latest per-backend view (score, state, cooldown, telemetry age).
    decisions: BTreeMap<u32, crate::policy::BackendDecision>,
    /// The policy's latest per-(VIP, tenant) view, by (VIP name, tenant name).
    tenant_decisions: BTreeMap<(String, String), crate::policy::TenantDecision>,
    /// Decision tracing is on (off at every start).
    trace: bool,
}

fn affected(state: &State, op: &Op) -> serde_json::Value {
    let vip = match op {
        Op::SetTenants(_) => return serde_json::to_value(&state.tenants).unwrap_or_default(),
        Op::AddVip { vip, .. } => &vip.name,
        Op::RemoveVip { vip }
        | Op::AddBackend { vip, .. }
        | Op::RemoveBackend { vip, .. }
        | Op::SetWeight { vip, .. }
        | Op::Drain { vip, .. }
        | Op::Undrain { vip, .. }
        | Op::SetHealth { vip, .. } => vip,
    };
    state.vips.get(vip).map_or(serde_json::Value::Null, |v| {
        serde_json::to_value(v).unwrap_or_default()
    })
}

impl<P: Plane> Controller<P> {
    /// Takes over `state` and writes it to the plane (`previous` is what the plane holds:
    /// an empty state for fresh maps, the restored state after a restart). A write that fails
    /// is undone, so re-adopted maps keep what they held. Nothing is persisted yet: a start
    /// persists ([`Controller::persist`]) once nothing else can fail.
    pub fn new(state: State, previous: &State, mut plane: P, settings: Settings) -> Result<Self> {
        if let Err(e) = plane.apply(previous, &state, &Overlay::default()) {
            if let Err(back) = plane.apply(&state, previous, &Overlay::default()) {
                tracing::error!(error = %format!("{back:#}"), "undoing a failed initial write also failed");
            }
            return Err(e.context("writing the initial state"));
        }
        Ok(Controller {
            state,
            plane,
            settings,
            events: VecDeque::new(),
            event_counts: BTreeMap::new(),
            overlay: Overlay::default(),
            decisions: BTreeMap::new(),
            tenant_decisions: BTreeMap::new(),
            trace: false,
        })
    }

    pub fn state(&self) -> &State {
        &self.state
    }

    pub fn trace(&self) -> bool {
        self.trace
    }

    /// Switches decision tracing in the data plane; audited.
    pub fn set_trace(&mut self, on: bool, peer: Peer, now_ms: u64) -> Result<()> {
        self.plane.set_trace(on)?;
        self.trace = on;
        self.audit(
            json!({"time_ms": now_ms, "peer": peer, "request": {"trace": on}, "result": "ok"}),
        );
        Ok(())
    }

    pub fn plane(&mut self) -> &mut P {
        &mut self.plane
    }

    pub fn events(&self) -> impl Iterator<Item = &Event> {
        self.events.iter()
    }

    pub fn event_counts(&self) -> &BTreeMap<String, u64> {
        &self.event_counts
    }

    /// The Maglev weight a backend is steered with now.
    /// Connection-table entries given to `f` until it returns false.
    pub fn flow_entries(&mut self, f: &mut dyn FnMut(FlowEntry) -> bool) -> Result<()> {
        self.plane.flow_entries(f)
    }

    /// When the active-flow counts were taken and at what cost, where they may lag.
    pub fn flows_counted(&self) -> Option<FlowCount> {
        self.plane.flows_counted()
    }

    pub fn effective_weight(&self, b: &Backend) -> u32 {
        self.overlay.weight(b)
    }

    pub fn overlay(&self) -> &Overlay {
        &self.overlay
    }

    pub fn set_decisions(&mut self, d: Vec<crate::policy::BackendDecision>) {
        self.decisions = d.into_iter().map(|b| (b.id, b)).collect();
    }

    pub fn set_tenant_decisions(&mut self, d: Vec<crate::policy::TenantDecision>) {
        self.tenant_decisions = d
            .into_iter()
            .map(|t| ((t.vip.clone(), t.tenant.clone()), t))
            .collect();
    }

    /// The policy's latest view of a tenant on a VIP, if it has one.
    pub fn tenant_decision(
        &self,
        vip: &str,
        tenant: &str,
    ) -> Option<&crate::policy::TenantDecision> {
        self.tenant_decisions
            .get(&(vip.to_owned(), tenant.to_owned()))
    }

    /// The adaptive policy's latest view of a backend, if it has one.
    pub fn decision(&self, id: u32) -> Option<&crate::policy::BackendDecision> {
        self.decisions.get(&id)
    }

    /// Audits a steering decision with the telemetry that caused it.
    pub fn audit_event(&self, e: &crate::policy::PolicyEvent) {
        self.audit(json!({"time_ms": crate::clock::now_ms(), "peer": null, "steering": e}));
    }

    pub fn record(&mut self, e: Event) {
        match &e.backend {
            Some(b) => {
                tracing::info!(kind = %e.kind, vip = %e.vip, backend = %b, reason = %e.reason, "event")
            }
            None => tracing::info!(kind = %e.kind, vip = %e.vip, reason = %e.reason, "event"),
        }
        *self.event_counts.entry(e.kind.clone()).or_default() += 1;
        if self.events.len() == EVENTS_KEPT {
            self.events.pop_front();
        }
        self.events.push_back(e);
    }

    fn write(&mut self, new: State) -> Result<(), RequestError> {
        if let Err(e) = self.plane.apply(&self.state, &new, &self.overlay) {
            // Put back what was there; the request fails as a whole.
            if let Err(back) = self.plane.apply(&new, &self.state, &self.overlay) {
                tracing::error!(error = %format!("{back:#}"), "rolling back a failed data-plane write also failed");
            }
            return Err(RequestError::Plane(e));
        }
        self.state = new;
        if let Err(e) = self.persist() {
            tracing::error!(error = %format!("{e:#}"), "the change is live but could not be persisted");
        }
        Ok(())
    }

    /// Validates and applies one request; rejected requests change nothing. Both outcomes
    /// are audited.
    pub fn submit(&mut self, op: Op, peer: Peer, now_ms: u64) -> Result<(), RequestError> {
        let before = affected(&self.state, &op);
        let result = self
            .state
            .apply(&op, now_ms, &self.settings.limits)
            .map_err(RequestError::from)
            .and_then(|new| self.write(new));
        let after = affected(&self.state, &op);
        self.audit(json!({
            "time_ms": now_ms,
            "peer": peer,
            "request": op,
            "result": match &result { Ok(()) => "ok".to_string(), Err(e) => format!("error: {e}") },
            "before": before,
            "after": after,
        }));
        if result.is_ok() {
            // Changes that move live or future flows are events, not only audit lines.
            let ev = match &op {
                Op::RemoveBackend { vip, address } => {
                    Some(("backend-removed", vip, Some(*address)))
                }
                Op::RemoveVip { vip } => Some(("vip-removed", vip, None)),
                Op::Drain { vip, address, .. } => Some(("drain-start", vip, Some(*address))),
                Op::Undrain { vip, address } => Some(("undrain", vip, Some(*address))),
                _ => None,
            };
            if let Some((kind, vip, backend)) = ev {
                let reason = format!("requested by uid {} (pid {})", peer.uid, peer.pid);
                self.record(Event {
                    time_ms: now_ms,
                    kind: kind.into(),
                    vip: vip.clone(),
                    backend,
                    reason,
                });
            }
        }
        result
    }

    /// Applies a round of health verdicts as one change: one data-plane write, one state
    /// write and one audit line however many backends flip. All or nothing.
    pub fn set_health(
        &mut self,
        changes: &[HealthChange],
        now_ms: u64,
    ) -> Result<(), RequestError> {
        let mut new = self.state.clone();
        let result = changes
            .iter()
            .try_for_each(|c| new.set_health(&c.vip, c.address, c.healthy))
            .map_err(RequestError::from)
            .and_then(|()| self.write(new));
        self.audit(json!({
            "time_ms": now_ms,
            "peer": null,
            "request": {"op": "set-health", "changes": changes},
            "result": match &result { Ok(()) => "ok".to_string(), Err(e) => format!("error: {e}") },
        }));
        result
    }

    /// Runs a reloaded configuration the way a start does ([`State::for_config`]): the file
    /// the running state was built from keeps it whole; a changed file replaces the VIPs and
    /// backends (ids, drains and health of what stays are kept). All or nothing, like a
    /// request.
    pub fn reload(
        &mut self,
        specs: &[(VipSpec, Vec<BackendSpec>)],
        tenants: &[TenantConfig],
        config_hash: u64,
        now_ms: u64,
    ) -> Result<(), RequestError> {
        let same_file = config_hash == self.settings.config_hash;
        let new = self
            .state
            .for_config(same_file, specs, tenants, &self.settings.limits)?;
        let result = self.write(new);
        if result.is_ok() {
            self.settings.config_hash = config_hash;
            if let Err(e) = self.persist() {
                tracing::error!(error = %format!("{e:#}"), "the reload is live but could not be persisted");
            }
            self.record(Event {
                time_ms: now_ms,
                kind: "config-reload".into(),
                vip: String::new(),
                backend: None,
                reason: format!("{} VIPs", specs.len()),
            });
        }
        self.audit(json!({
            "time_ms": now_ms,
            "peer": null,
            "request": {"op": "reload", "vips": specs.iter().map(|(v, _)| &v.name).collect::<Vec<_>>()},
            "result": match &result { Ok(()) => "ok".to_string(), Err(e) => format!("error: {e}") },
        }));
        result
    }

    /// Takes over the fleet's table set (`crate::fleet`): its VIPs, backends and overlay,
    /// with this host's own health verdicts laid over (health is never shared). All or
    /// nothing, like a request; audited.
    pub fn adopt(
        &mut self,
        mut state: State,
        overlay: Overlay,
        now_ms: u64,
        why: &str,
    ) -> Result<(), RequestError> {
        for v in state.vips.values_mut() {
            let here = self.state.vips.get(&v.spec.name);
            for b in v.backends.values_mut() {
                b.healthy = here
                    .and_then(|h| h.backends.get(&b.spec.address))
                    .is_none_or(|h| h.healthy);
            }
        }
        let previous = std::mem::replace(&mut self.overlay, overlay);
        let result = self.write(state);
        if result.is_err() {
            // `write` put the old state back, built with the new overlay: rebuild it with
            // the old one.
            self.overlay = previous;
            if let Err(e) = self.plane.apply(&self.state, &self.state, &self.overlay) {
                tracing::error!(error = %format!("{e:#}"), "restoring the previous overlay failed");
            }
        }
        self.audit(json!({
            "time_ms": now_ms,
            "peer": null,
            "request": {"op": "fleet-apply", "reason": why},
            "result": match &result { Ok(()) => "ok".to_string(), Err(e) => format!("error: {e}") },
        }));
        result
    }

    /// Installs the adaptive policy's overlay; only tables and flags that change are written.
    pub fn set_overlay(&mut self, overlay: Overlay) -> Result<()> {
        if overlay == self.overlay {
            return Ok(());
        }
        self.plane.apply(&self.state, &self.state, &overlay)?;
        self.overlay = overlay;
        Ok(())
    }

    fn audit(&self, line: serde_json::Value) {
        let Some(path) = &self.settings.audit_log else {
            return;
        };
        let r = private_file::append(path).and_then(|mut f| writeln!(f, "{line}"));
        if let Err(e) = r {
            tracing::error!(path = %path.display(), error = %e, "cannot write the audit log");
        }
    }

    /// Writes the state file (atomically: the old file stays whole until the rename).
    pub fn persist(&self) -> Result<()> {
        let Some(path) = &self.settings.state_file else {
            return Ok(());
        };
        let p = Persisted {
            layout: lb_common::LAYOUT_VERSION,
            config_hash: self.settings.config_hash,
            hash: HashKind::Fnv1a,
            state: self.state.clone(),
        };
        private_file::write(path, &serde_json::to_vec_pretty(&p)?)
            .with_context(|| format!("writing {}", path.display()))
    }

    /// See [`Plane::inband`].
    pub fn inband(&mut self, ids: &[u32]) -> Result<BTreeMap<u32, lb_common::InbandStats>> {
        self.plane.inband(ids)
    }

    /// See [`Plane::backend_traffic`].
    pub fn backend_traffic(&mut self, ids: &[u32]) -> Result<BTreeMap<u32, Traffic>> {
        self.plane.backend_traffic(ids)
    }

    pub fn active_flows(&mut self) -> Result<BTreeMap<u32, u64>> {
        let idle = self.settings.flow_idle;
        self.plane.active_flows(idle)
    }

    /// Each tenant's usage on each VIP: active sessions (the connection table's flows of
    /// the VIP's backends whose client the tenant's prefixes match) and the data plane's
    /// counters, by (VIP name, tenant name); empty without tenants.
    pub fn tenant_usage(&mut self) -> Result<TenantUsages> {
        let state = &self.state;
        if state.tenants.is_empty() {
            return Ok(BTreeMap::new());
        }
        let flows = self.plane.tenant_flows(self.settings.flow_idle)?;
        let tenants = state.tenants.with_ids();
        let mut slots = Vec::new();
        for v in state.vips.values() {
            for (id, t) in &tenants {
                slots.push((v, *id, t, lb_common::tenant_index(v.id, *id)));
            }
        }
        let indexes: Vec<u32> = slots.iter().map(|s| s.3).collect();
        let stats = self.plane.tenant_stats(&indexes)?;
        let mut out = BTreeMap::new();
        for (v, id, t, index) in slots {
            let sessions = v
                .backends
                .values()
                .map(|b| flows.get(&(b.id, id)).copied().unwrap_or(0))
                .sum();
            out.insert(
                (v.spec.name.clone(), t.name.clone()),
                TenantUsage {
                    index,
                    sessions,
                    stats: stats.get(&index).copied().unwrap_or_default(),
                },
            );
        }
        Ok(out)
    }

    /// Completes drains: a draining backend is removed once it has no active flow, or at
    /// its deadline (its remaining flows then re-steer). A TCP VIP in second-chance mode keeps
    /// no flows in the LB's table, and a `quic = "cid"` VIP's connections leave it after their
    /// handshake (their packets are routed by connection ID), so a count of zero says nothing
    /// there: their drains end at the deadline only (removing the backend earlier would break
    /// its streams, which reach it only while it serves). Returns what happened.
    pub fn tick(&mut self, now_ms: u64) -> Result<Vec<Event>> {
        #[allow(clippy::type_complexity)]
        let draining: Vec<(String, IpAddr, u32, u64, Option<u64>, bool)> = self
            .state
            .vips
            .values()
            .flat_map(|v| {
                v.backends.values().filter_map(move |b| match b.admin {
                    Admin::Draining {
                        since_ms,
                        deadline_ms,
                    } => Some((
                        v.spec.name.clone(),
                        b.spec.address,
                        b.id,
                        since_ms,
                        deadline_ms,
                        (v.spec.flow_state == FlowState::Table
                            || v.spec.protocol == crate::state::Protocol::Udp)
                            && v.spec.quic != QuicMode::Cid,
                    )),
                    Admin::Active => None,
                })
            })
            .collect();
        if draining.is_empty() {
            return Ok(vec![]);
        }
        let flows = self.active_flows()?;
        let mut out = vec![];
        for (vip, addr, id, since_ms, deadline, counted) in draining {
            let left = flows.get(&id).copied().unwrap_or(0);
            // A count taken before the drain began may miss a flow that arrived just before
            // it: wait for a newer one before calling the backend empty.
            let stale = self
                .plane
                .flows_counted()
                .is_some_and(|c| c.taken_ms < since_ms);
            let (kind, reason) = if counted && left == 0 && !stale {
                ("drain-complete", "no active flows left".to_string())
            } else if deadline.is_some_and(|d| now_ms >= d) {
                (
                    "drain-deadline",
                    format!("deadline reached with {left} active flows; they re-steer"),
                )
            } else {
                continue;
            };
            let op = Op::RemoveBackend {
                vip: vip.clone(),
                address: addr,
            };
            let new = self
                .state
                .apply(&op, now_ms, &self.settings.limits)
                .map_err(anyhow::Error::from)?;
            self.write(new).map_err(|e| anyhow::anyhow!("{e}"))?;
            self.audit(json!({"time_ms": now_ms, "peer": null, "request": op, "result": "ok", "reason": reason}));
            let e = Event {
                time_ms: now_ms,
                kind: kind.into(),
                vip,
                backend: Some(addr),
                reason,
            };
            self.record(e.clone());
            out.push(e);
        }
        Ok(out)
    }

    pub fn counters(&mut self) -> Result<Counters> {
        self.plane.counters(&self.state)
    }
}

#[cfg(test)]
pub mod fake {
    //! A plane that records what it was told, for controller and API tests.
    use super::*;

    #[derive(Default)]
    pub struct FakePlane {
        pub applied: Vec<State>,
        pub flows: BTreeMap<u32, u64>,
        pub entries: Vec<FlowEntry>,
        pub trace: bool,
        pub fail_next: bool,
        /// Cumulative in-band aggregates per backend id.
        pub inband: BTreeMap<u32, lb_common::InbandStats>,
        /// Cumulative traffic counters per backend id.
        pub traffic: BTreeMap<u32, Traffic>,
        /// Active flows per (backend id, tenant id).
        pub tenant_flows: BTreeMap<(u32, u32), u64>,
        /// Tenant counters per `TENANT_STATS` index.
        pub tenant_stats: BTreeMap<u32, lb_common::TenantStats>,
    }

    impl Plane for FakePlane {
        fn apply(&mut self, _old: &State, new: &State, _overlay: &Overlay) -> Result<()> {
            if std::mem::take(&mut self.fail_next) {
                anyhow::bail!("injected failure");
            }
            self.applied.push(new.clone());
            Ok(())
        }
        fn active_flows(&mut self, _idle: Duration) -> Result<BTreeMap<u32, u64>> {
            Ok(self.flows.clone())
        }
        fn counters(&mut self, _state: &State) -> Result<Counters> {
            Ok(Counters::default())
        }
        fn set_trace(&mut self, on: bool) -> Result<()> {
            self.trace = on;
            Ok(())
        }
        fn flow_entries(&mut self, f: &mut dyn FnMut(FlowEntry) -> bool) -> Result<()> {
            for e in &self.entries {
                if !f(e.clone()) {
                    break;
                }
            }
            Ok(())
        }
        fn inband(&mut self, ids: &[u32]) -> Result<BTreeMap<u32, lb_common::InbandStats>> {
            Ok(ids
                .iter()
                .filter_map(|id| self.inband.get(id).map(|s| (*id, *s)))
                .collect())
        }
        fn tenant_flows(&mut self, _idle: Duration) -> Result<BTreeMap<(u32, u32), u64>> {
            Ok(self.tenant_flows.clone())
        }
        fn tenant_stats(
            &mut self,
            indexes: &[u32],
        ) -> Result<BTreeMap<u32, lb_common::TenantStats>> {
            Ok(indexes
                .iter()
                .filter_map(|i| self.tenant_stats.get(i).map(|s| (*i, *s)))
                .collect())
        }
        fn backend_traffic(&mut self, ids: &[u32]) -> Result<BTreeMap<u32, Traffic>> {
            Ok(ids
                .iter()
                .filter_map(|id| self.traffic.get(id).map(|t| (*id, *t)))
                .collect())
        }
    }
}

#[cfg(test)]
mod tests {
    use std::fs;

    use super::{fake::FakePlane, *};
    use crate::state::testing::{be, vip};
    use crate::test_dir::TestDir;

    fn settings(dir: &std::path::Path) -> Settings {
        Settings {
            limits: Limits { max_vips: 4 },
            seed: 1,
            flow_idle: Duration::from_secs(30),
            state_file: Some(dir.join("state.json")),
            audit_log: Some(dir.join("audit.jsonl")),
            config_hash: 7,
        }
    }

    /// A controller over an empty fake plane, persisting into a fresh directory.
    fn fresh() -> (TestDir, Controller<FakePlane>) {
        let d = TestDir::new("ctl");
        let c = Controller::new(
            State::default(),
            &State::default(),
            FakePlane::default(),
            settings(&d),
        )
        .unwrap();
        (d, c)
    }

    fn add_chat() -> Op {
        Op::AddVip {
            vip: vip("chat", "10.0.0.1"),
            backends: vec![be("10.1.0.1"), be("10.1.0.2")],
        }
    }

    #[test]
    fn accepted_requests_are_applied_persisted_and_audited_with_peer() {
        let (d, mut c) = fresh();
        let peer = Peer {
            uid: 1000,
            gid: 1000,
            pid: 42,
        };
        c.submit(add_chat(), peer, 5).unwrap();
        let st = c.state().clone();
        assert_eq!(c.plane().applied.last().unwrap(), &st);
        let saved: Persisted =
            serde_json::from_slice(&fs::read(d.join("state.json")).unwrap()).unwrap();
        assert_eq!(&saved.state, c.state());
        let audit = fs::read_to_string(d.join("audit.jsonl")).unwrap();
        let line: serde_json::Value = serde_json::from_str(audit.lines().last().unwrap()).unwrap();
        assert_eq!(line["peer"]["pid"], 42);
        assert_eq!(line["result"], "ok");
        assert_eq!(line["before"], serde_json::Value::Null);
        assert_eq!(line["after"]["backends"].as_object().unwrap().len(), 2);
    }

    /// A round of health verdicts is one data-plane write, one state write and one audit
    /// line, whatever its size; one that names an unknown backend changes nothing.
    #[test]
    fn a_round_of_health_changes_is_one_update() {
        let (d, mut c) = fresh();
        c.submit(add_chat(), Peer::default(), 5).unwrap();
        let (writes, lines) = (c.plane().applied.len(), 1);
        let down = |a: &str| HealthChange {
            vip: "chat".into(),
            address: a.parse().unwrap(),
            healthy: false,
        };
        c.set_health(&[down("10.1.0.1"), down("10.1.0.2")], 6)
            .unwrap();
        assert_eq!(c.plane().applied.len(), writes + 1);
        assert!(c.state().vips["chat"].backends.values().all(|b| !b.healthy));
        let saved: Persisted =
            serde_json::from_slice(&fs::read(d.join("state.json")).unwrap()).unwrap();
        assert_eq!(&saved.state, c.state());
        let audit = fs::read_to_string(d.join("audit.jsonl")).unwrap();
        assert_eq!(audit.lines().count(), lines + 1);
        let line: serde_json::Value = serde_json::from_str(audit.lines().last().unwrap()).unwrap();
        assert_eq!(line["request"]["changes"].as_array().unwrap().len(), 2);

        let before = c.state().clone();
        let mut up = down("10.1.0.1");
        up.healthy = true;
        let e = c.set_health(&[up, down("10.1.0.9")], 7).unwrap_err();
        assert_eq!(e.http_status(), 404, "{e}");
        assert_eq!(c.state(), &before, "all or nothing");
        assert_eq!(c.plane().applied.len(), writes + 1);
    }

    fn set_tenants(list: serde_json::Value) -> Op {
        serde_json::from_value(json!({"op": "set-tenants", "tenant": list})).unwrap()
    }

    #[test]
    fn set_tenants_is_applied_persisted_and_audited_and_a_refused_one_changes_nothing() {
        let (d, mut c) = fresh();
        c.submit(add_chat(), Peer::default(), 5).unwrap();
        let op = set_tenants(json!([{"name": "acme", "prefixes": ["10.0.2.0/24"]}]));
        c.submit(op, Peer::default(), 6).unwrap();
        assert_eq!(c.state().tenants.ids["acme"], 1);
        let st = c.state().clone();
        assert_eq!(c.plane().applied.last().unwrap(), &st);
        let saved: Persisted =
            serde_json::from_slice(&fs::read(d.join("state.json")).unwrap()).unwrap();
        assert_eq!(saved.state.tenants, c.state().tenants);
        let audit = fs::read_to_string(d.join("audit.jsonl")).unwrap();
        let line: serde_json::Value = serde_json::from_str(audit.lines().last().unwrap()).unwrap();
        assert_eq!(line["request"]["op"], "set-tenants");
        assert_eq!(line["before"]["list"], json!([]));
        assert_eq!(line["after"]["ids"]["acme"], 1);

        // The data plane refuses: rolled back, nothing changed.
        let before = c.state().clone();
        c.plane().fail_next = true;
        let op = set_tenants(json!([{"name": "beta", "prefixes": ["10.0.3.0/24"]}]));
        let e = c.submit(op, Peer::default(), 7).unwrap_err();
        assert_eq!(e.http_status(), 500);
        assert_eq!(c.state(), &before);
        assert_eq!(c.plane().applied.last().unwrap(), &before);
    }

    #[test]
    fn tenant_usage_sums_each_vips_backends_per_tenant() {
        let (_d, mut c) = fresh();
        c.submit(add_chat(), Peer::default(), 5).unwrap();
        let op = set_tenants(json!([{"name": "acme", "prefixes": ["10.0.2.0/24"]}]));
        c.submit(op, Peer::default(), 6).unwrap();
        let chat = &c.state().vips["chat"];
        let (vip, ids) = (
            chat.id,
            chat.backends.values().map(|b| b.id).collect::<Vec<_>>(),
        );
        c.plane().tenant_flows =
            BTreeMap::from([((ids[0], 1), 3), ((ids[1], 1), 2), ((ids[1], 0), 7)]);
        let acme = lb_common::tenant_index(vip, 1);
        c.plane().tenant_stats = BTreeMap::from([(
            acme,
            lb_common::TenantStats {
                admitted: 9,
                refused_rate: 4,
                ..Default::default()
            },
        )]);
        let u = c.tenant_usage().unwrap();
        let of = |t: &str| u[&("chat".to_owned(), t.to_owned())];
        assert_eq!((of("acme").sessions, of("acme").index), (5, acme));
        assert_eq!(of("acme").stats.refused_rate, 4);
        assert_eq!(of("default").sessions, 7);
        assert_eq!(of("default").stats, Default::default());
    }

    #[test]
    fn a_reload_of_the_same_file_keeps_runtime_changes_and_a_changed_file_merges() {
        let (d, mut c) = fresh();
        let Op::AddVip { vip, backends } = add_chat() else {
            unreachable!()
        };
        let specs = vec![(vip, backends)];
        // A file (hash 8) and runtime changes on top.
        c.reload(&specs, &[], 8, 1).unwrap();
        let added = be("10.1.0.9");
        c.submit(
            Op::AddBackend {
                vip: "chat".into(),
                backend: added.clone(),
            },
            Peer::default(),
            2,
        )
        .unwrap();
        let a: IpAddr = "10.1.0.1".parse().unwrap();
        c.submit(
            Op::SetWeight {
                vip: "chat".into(),
                address: a,
                weight: 5,
            },
            Peer::default(),
            3,
        )
        .unwrap();
        let runtime = c.state().clone();
        c.reload(&specs, &[], 8, 4).unwrap();
        assert_eq!(
            c.state(),
            &runtime,
            "the same file keeps every runtime change"
        );
        c.reload(&specs, &[], 9, 5).unwrap();
        let chat = &c.state().vips["chat"];
        assert!(!chat.backends.contains_key(&added.address));
        assert_eq!(chat.backends[&a].spec.weight, 100);
        assert_eq!(chat.backends[&a].id, runtime.vips["chat"].backends[&a].id);
        let saved: Persisted =
            serde_json::from_slice(&fs::read(d.join("state.json")).unwrap()).unwrap();
        assert_eq!((saved.config_hash, &saved.state), (9, c.state()));
    }

    #[test]
    fn a_plane_failure_rolls_back_and_changes_nothing() {
        let (d, mut c) = fresh();
        c.plane().fail_next = true;
        let e = c.submit(add_chat(), Peer::default(), 5).unwrap_err();
        assert_eq!(e.http_status(), 500);
        assert!(c.state().vips.is_empty());
        // The rollback wrote the old (empty) state back.
        assert!(c.plane().applied.last().unwrap().vips.is_empty());
        let audit = fs::read_to_string(d.join("audit.jsonl")).unwrap();
        assert!(audit.contains("injected failure"));
    }

    #[test]
    fn a_quic_cid_vip_drains_until_its_deadline_whatever_the_lbs_table_counts() {
        let (_dir, mut c) = fresh();
        let Op::AddVip {
            mut vip,
            mut backends,
        } = add_chat()
        else {
            unreachable!()
        };
        vip.protocol = crate::state::Protocol::Udp;
        vip.quic = QuicMode::Cid;
        for (i, b) in backends.iter_mut().enumerate() {
            b.quic_server_id = Some(format!("0a0{}", i + 1));
        }
        c.submit(Op::AddVip { vip, backends }, Peer::default(), 0)
            .unwrap();
        let a: IpAddr = "10.1.0.1".parse().unwrap();
        // The connections routed by their IDs have no entries: the count is zero.
        c.plane().flows = BTreeMap::new();
        c.submit(
            Op::Drain {
                vip: "chat".into(),
                address: a,
                deadline_ms: Some(1000),
            },
            Peer::default(),
            10,
        )
        .unwrap();
        assert!(
            c.tick(500).unwrap().is_empty(),
            "no flows counted, but QUIC connections are not in the table: still draining"
        );
        assert!(c.state().backend("chat", a).is_ok());
        let ev = c.tick(1000).unwrap();
        assert_eq!(
            (ev[0].kind.as_str(), ev[0].backend),
            ("drain-deadline", Some(a))
        );
    }

    #[test]
    fn a_second_chance_tcp_vip_drains_until_its_deadline_whatever_the_lbs_table_counts() {
        let (_dir, mut c) = fresh();
        let Op::AddVip { mut vip, backends } = add_chat() else {
            unreachable!()
        };
        vip.flow_state = FlowState::SecondChance;
        c.submit(Op::AddVip { vip, backends }, Peer::default(), 0)
            .unwrap();
        let a: IpAddr = "10.1.0.1".parse().unwrap();
        // The LB's table holds no TCP flow of this VIP: the count is zero.
        c.plane().flows = BTreeMap::new();
        c.submit(
            Op::Drain {
                vip: "chat".into(),
                address: a,
                deadline_ms: Some(1000),
            },
            Peer::default(),
            10,
        )
        .unwrap();
        assert!(
            c.tick(500).unwrap().is_empty(),
            "no flows counted, but second chance cannot count them: still draining"
        );
        assert!(c.state().backend("chat", a).is_ok());
        let ev = c.tick(1000).unwrap();
        assert_eq!(
            (ev[0].kind.as_str(), ev[0].backend),
            ("drain-deadline", Some(a))
        );
        assert!(c.state().backend("chat", a).is_err());
    }

    #[test]
    fn drains_complete_at_zero_flows_or_at_the_deadline() {
        let (_dir, mut c) = fresh();
        c.submit(add_chat(), Peer::default(), 0).unwrap();
        let a: IpAddr = "10.1.0.1".parse().unwrap();
        let b: IpAddr = "10.1.0.2".parse().unwrap();
        let (ia, ib) = (
            c.state().backend("chat", a).unwrap().id,
            c.state().backend("chat", b).unwrap().id,
        );
        c.plane().flows = BTreeMap::from([(ia, 3), (ib, 2)]);
        c.submit(
            Op::Drain {
                vip: "chat".into(),
                address: a,
                deadline_ms: None,
            },
            Peer::default(),
            10,
        )
        .unwrap();
        c.submit(
            Op::Drain {
                vip: "chat".into(),
                address: b,
                deadline_ms: Some(1000),
            },
            Peer::default(),
            10,
        )
        .unwrap();
        assert!(
            c.tick(500).unwrap().is_empty(),
            "flows left, deadline ahead: nothing happens"
        );
        c.plane().flows = BTreeMap::from([(ib, 2)]);
        let ev = c.tick(600).unwrap();
        assert_eq!(ev.len(), 1);
        assert_eq!(
            (ev[0].kind.as_str(), ev[0].backend),
            ("drain-complete", Some(a))
        );
        let ev = c.tick(1000).unwrap();
        assert_eq!(
            (ev[0].kind.as_str(), ev[0].backend),
            ("drain-deadline", Some(b))
        );
        assert!(ev[0].reason.contains("2 active flows"));
        assert!(c.state().vip("chat").unwrap().backends.is_empty());
        assert_eq!(c.event_counts()["drain-complete"], 1);
        c.submit(
            Op::RemoveVip { vip: "chat".into() },
            Peer {
                uid: 7,
                gid: 7,
                pid: 9,
            },
            2000,
        )
        .unwrap();
        let last = c.events().last().unwrap();
        assert_eq!(
            (last.kind.as_str(), last.reason.as_str()),
            ("vip-removed", "requested by uid 7 (pid 9)")
        );
    }
}
