//! The adaptive-steering shell: schedules health checks and policy steps and turns their
//! results into controller calls. The decisions themselves live in `policy` (pure).

use std::{
    collections::{BTreeMap, BTreeSet},
    future::Future,
    net::IpAddr,
    sync::Arc,
    time::{Duration, Instant},
};

use tokio::sync::Mutex;

use crate::{
    clock::now_ms,
    config::{Config, FlowState, HealthCheck, Protocol},
    controller::{self, Controller, Overlay, Peer, Plane},
    policy::{self, health, BackendDecision, BackendInput, Decisions, Handshakes, Policy},
    state::{Op, Vip},
    telemetry::{inband::Tracker, BackendKey, Hub, Source},
};

/// The controller's event of a policy event (with wall-clock time, without telemetry).
fn to_controller(e: &policy::PolicyEvent, time_ms: u64) -> controller::Event {
    controller::Event {
        time_ms,
        kind: e.kind.as_str().to_owned(),
        vip: e.vip.clone(),
        backend: e.backend,
        reason: e.reason.clone(),
    }
}

/// The health check of a backend: the configured one, else TCP to the VIP's port (a
/// backend of an all-ports VIP added at run time without one is not checked).
fn check_of(cfg: &Config, vip: &Vip, addr: IpAddr) -> Option<HealthCheck> {
    let configured = cfg
        .vips
        .iter()
        .find(|v| v.name == vip.spec.name)
        .and_then(|v| v.backends.iter().find(|b| b.address == addr))
        .map(|b| b.health.clone());
    configured.or((vip.spec.port != 0).then_some(HealthCheck::Tcp {
        port: vip.spec.port,
    }))
}

/// Probes every backend each `health.interval`; a backend that fails `fall` times is marked
/// down in the data plane at once (its flows re-steer), and up again after `rise` successes.
pub async fn run_health<P: Plane + 'static>(
    ctl: Arc<Mutex<Controller<P>>>,
    cfg: Arc<Config>,
    epoch: Instant,
    shutdown: impl Future<Output = ()>,
) {
    let hc = cfg.health.clone();
    let mut trackers: BTreeMap<BackendKey, health::Health> = BTreeMap::new();
    let mut every = tokio::time::interval(hc.interval);
    every.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    tokio::pin!(shutdown);
    loop {
        tokio::select! {
            _ = every.tick() => {}
            _ = &mut shutdown => return,
        }
        let probes: Vec<(BackendKey, bool, HealthCheck)> = {
            let c = ctl.lock().await;
            c.state()
                .vips
                .values()
                .flat_map(|v| {
                    let cfg = &cfg;
                    v.backends.values().filter_map(move |b| {
                        let check = check_of(cfg, v, b.spec.address)?;
                        Some(((v.spec.name.clone(), b.spec.address), b.healthy, check))
                    })
                })
                .collect()
        };
        let keys: BTreeSet<BackendKey> = probes.iter().map(|(k, ..)| k.clone()).collect();
        trackers.retain(|k, _| keys.contains(k));
        // All probes run at once, each bounded by the timeout; each reports when it ended.
        let tasks: Vec<_> = probes
            .iter()
            .map(|((_, addr), _, check)| {
                let (addr, check, timeout) = (*addr, check.clone(), hc.timeout);
                tokio::spawn(
                    async move { (health::check(addr, &check, timeout).await, Instant::now()) },
                )
            })
            .collect();
        let mut results = Vec::with_capacity(tasks.len());
        for t in tasks {
            results.push(t.await.unwrap_or_else(|_| {
                (Err(health::CheckError::Timeout(hc.timeout)), Instant::now())
            }));
        }
        for (((vip, addr), healthy, _), (result, ended)) in probes.into_iter().zip(results) {
            let now = epoch.elapsed();
            let t = trackers
                .entry((vip.clone(), addr))
                .or_insert_with(|| health::Health::new(now, healthy));
            if let Err(e @ health::CheckError::Local(_)) = &result {
                tracing::warn!(%vip, backend = %addr, error = %e, "health check skipped; the backend keeps its state");
            }
            let Some(ev) = t.record(now, &result, &hc, &vip, addr) else {
                continue;
            };
            let mut c = ctl.lock().await;
            let op = Op::SetHealth {
                vip: vip.clone(),
                address: addr,
                healthy: t.up,
            };
            let mut ev = to_controller(&ev, now_ms());
            match c.submit(op, Peer::default(), now_ms()) {
                // The failover latency the operator cares about, measured where it happens
                // (the failover bench reads it from the event).
                Ok(()) => ev.reason.push_str(&format!(
                    "; data plane updated {} us after the deciding check",
                    ended.elapsed().as_micros()
                )),
                Err(e) => {
                    tracing::error!(%vip, backend = %addr, error = %e, "cannot apply a health change")
                }
            }
            c.record(ev);
        }
    }
}

/// Reads the in-band aggregates of the in-band VIPs' backends into the tracker, and each
/// backend's part, when its window has one, into the hub as the `inband` source.
pub fn ingest_inband<P: Plane>(
    c: &mut Controller<P>,
    state: &crate::state::State,
    hub: &std::sync::Mutex<Hub>,
    tracker: &mut Tracker,
) -> anyhow::Result<()> {
    let backends: Vec<(BackendKey, u32)> = state
        .vips
        .values()
        .filter(|v| v.spec.inband)
        .flat_map(|v| {
            v.backends
                .values()
                .map(move |b| ((v.spec.name.clone(), b.spec.address), b.id))
        })
        .collect();
    tracker.retain(|k| backends.iter().any(|(b, _)| b == k));
    if backends.is_empty() {
        return Ok(());
    }
    let ids: Vec<u32> = backends.iter().map(|(_, id)| *id).collect();
    let stats = c.inband(&ids)?;
    let at = Instant::now();
    let mut hub = hub.lock().expect("telemetry hub lock");
    for (key, id) in &backends {
        if let Some(part) = stats.get(id).and_then(|s| tracker.observe(key, *s, at)) {
            hub.update(key, Source::Inband, part, at);
        }
    }
    Ok(())
}

/// The cumulative TCP handshake counters of the backends of TCP VIPs with a connection table
/// (the data plane counts none elsewhere), by backend id.
pub fn handshakes<P: Plane>(
    c: &mut Controller<P>,
    state: &crate::state::State,
) -> anyhow::Result<BTreeMap<u32, Handshakes>> {
    let ids: Vec<u32> = state
        .vips
        .values()
        .filter(|v| v.spec.protocol == Protocol::Tcp && v.spec.flow_state == FlowState::Table)
        .flat_map(|v| v.backends.values().map(|b| b.id))
        .collect();
    if ids.is_empty() {
        return Ok(BTreeMap::new());
    }
    Ok(c.backend_traffic(&ids)?
        .into_iter()
        .map(|(id, t)| {
            let h = Handshakes {
                started: t.handshakes,
                completed: t.handshakes_completed,
            };
            (id, h)
        })
        .collect())
}

/// One policy step: gathers sessions, health, telemetry and handshakes, steps the policy,
/// installs the overlay and records the decisions' events. Returns the per-backend decisions.
pub async fn step<P: Plane + 'static>(
    ctl: &Mutex<Controller<P>>,
    hub: &std::sync::Mutex<Hub>,
    policy: &mut Policy,
    inband: &mut Tracker,
    shed_rst: bool,
    now: Duration,
) -> anyhow::Result<Vec<BackendDecision>> {
    let mut c = ctl.lock().await;
    let sessions = c.active_flows()?;
    let state = c.state().clone();
    ingest_inband(&mut c, &state, hub, inband)?;
    let handshakes = handshakes(&mut c, &state)?;
    let (overlay, d) = decide(&c, hub, policy, shed_rst, now, &sessions, &handshakes);
    c.set_overlay(overlay)?;
    record(&mut c, &d);
    Ok(d.backends)
}

/// Records a step's events (log, audit) and keeps its per-backend view for the API.
pub fn record<P: Plane>(c: &mut Controller<P>, d: &Decisions) {
    let t = now_ms();
    for e in &d.events {
        c.record(to_controller(e, t));
        c.audit_event(e);
    }
    c.set_decisions(d.backends.clone());
}

/// Steps the policy on `sessions` (this host's, or the fleet's for its steering leader),
/// `handshakes` ([`handshakes`]) and the controller's health and telemetry; the overlay it
/// decides, not installed.
pub fn decide<P: Plane>(
    c: &Controller<P>,
    hub: &std::sync::Mutex<Hub>,
    policy: &mut Policy,
    shed_rst: bool,
    now: Duration,
    sessions: &BTreeMap<u32, u64>,
    handshakes: &BTreeMap<u32, Handshakes>,
) -> (Overlay, Decisions) {
    let state = c.state();
    let views: BTreeMap<u32, _> = {
        let hub = hub.lock().expect("telemetry hub lock");
        let known: BTreeSet<&BackendKey> = hub.keys().collect();
        let at = Instant::now();
        state
            .vips
            .values()
            .flat_map(|v| v.backends.values().map(move |b| (v, b)))
            .filter(|(v, b)| known.contains(&(v.spec.name.clone(), b.spec.address)))
            .map(|(v, b)| (b.id, hub.view(&(v.spec.name.clone(), b.spec.address), at)))
            .collect()
    };
    let inputs: Vec<BackendInput> = state
        .vips
        .values()
        .flat_map(|v| v.backends.values().map(move |b| (v, b)))
        .filter(|(_, b)| b.admin == crate::state::Admin::Active)
        .map(|(v, b)| BackendInput {
            vip: &v.spec.name,
            address: b.spec.address,
            id: b.id,
            weight: b.spec.weight,
            class: v.spec.priority as u8,
            healthy: b.healthy,
            sessions: sessions.get(&b.id).copied().unwrap_or(0),
            max_sessions: b.spec.max_sessions,
            telemetry: views.get(&b.id),
            handshakes: handshakes.get(&b.id).copied(),
        })
        .collect();
    let d = policy.step(now, &inputs);
    let overlay = Overlay {
        weights: d.weights(),
        full: d.backends.iter().filter(|b| b.full).map(|b| b.id).collect(),
        capped: d
            .backends
            .iter()
            .filter(|b| b.capped)
            .map(|b| b.id)
            .collect(),
        no_affinity: d
            .backends
            .iter()
            .filter(|b| b.breaks_affinity)
            .map(|b| b.id)
            .collect(),
        shed: state
            .vips
            .values()
            .filter(|v| {
                d.shed
                    .get(&v.spec.name)
                    .is_some_and(|s| s.sheds(v.spec.priority as u8))
            })
            .map(|v| v.spec.name.clone())
            .collect(),
        admission: d
            .shed
            .iter()
            .filter(|(_, s)| s.admission)
            .map(|(v, _)| v.clone())
            .collect(),
        rst: shed_rst,
    };
    (overlay, d)
}
