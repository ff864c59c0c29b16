//! The adaptive-steering shell: schedules health checks and policy steps and turns their
//! results into controller calls. The decisions themselves live in `policy` (pure).

use std::{
    collections::{BTreeMap, BTreeSet, HashMap},
    future::Future,
    net::IpAddr,
    sync::Arc,
    time::{Duration, Instant},
};

use tokio::{
    sync::{Mutex, Semaphore},
    task::JoinSet,
};

use crate::{
    clock::now_ms,
    config::{Config, FlowState, HealthCheck, HealthConfig, Protocol},
    controller::{self, Controller, HealthChange, Overlay, Plane, TenantUsages},
    policy::{
        self, health, BackendDecision, BackendInput, Decisions, Handshakes, Policy, TenantInput,
    },
    probe,
    state::Vip,
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

/// The configured health check of each backend, looked up once rather than per probe.
fn configured_checks(cfg: &Config) -> HashMap<BackendKey, HealthCheck> {
    cfg.vips
        .iter()
        .flat_map(|v| {
            v.backends
                .iter()
                .map(|b| ((v.name.clone(), b.address), b.health.clone()))
        })
        .collect()
}

/// The health check of a backend: the configured one, else TCP to the VIP's port (a
/// backend of an all-ports VIP added at run time without one is not checked).
fn check_of(
    configured: &HashMap<BackendKey, HealthCheck>,
    vip: &Vip,
    addr: IpAddr,
) -> Option<HealthCheck> {
    configured
        .get(&(vip.spec.name.clone(), addr))
        .cloned()
        .or((vip.spec.port != 0).then_some(HealthCheck::Tcp {
            port: vip.spec.port,
        }))
}

/// Probes in flight at once, at most: the bound on the sockets a round holds. Probes
/// answered at once (the common case) hold theirs for a moment; with every backend
/// timing out, a round of `n` backends takes about `n / MAX_IN_FLIGHT × timeout`.
pub const MAX_IN_FLIGHT: usize = 1024;

/// Runs one round's probes, each started at its offset in the round (`health::offset`) and
/// at most [`MAX_IN_FLIGHT`] at once; each result comes with the time its probe ended.
async fn probe_round(
    probes: &[(BackendKey, bool, HealthCheck)],
    hc: &HealthConfig,
    slots: &Arc<Semaphore>,
) -> Vec<(Result<(), health::CheckError>, Instant)> {
    let start = tokio::time::Instant::now();
    let mut tasks = JoinSet::new();
    for (i, ((_, addr), _, check)) in probes.iter().enumerate() {
        let (addr, check, timeout) = (*addr, check.clone(), hc.timeout);
        let at = start + health::offset(i, probes.len(), hc);
        let slots = slots.clone();
        tasks.spawn(async move {
            tokio::time::sleep_until(at).await;
            let _slot = slots.acquire_owned().await;
            (i, probe::check(addr, &check, timeout).await, Instant::now())
        });
    }
    let mut results: Vec<Option<(Result<(), health::CheckError>, Instant)>> =
        probes.iter().map(|_| None).collect();
    while let Some(done) = tasks.join_next().await {
        if let Ok((i, r, ended)) = done {
            results[i] = Some((r, ended));
        }
    }
    results
        .into_iter()
        .map(|r| {
            r.unwrap_or_else(|| (Err(health::CheckError::Timeout(hc.timeout)), Instant::now()))
        })
        .collect()
}

/// Probes every backend each `health.interval`, the probes spread over the interval; a
/// backend that fails `fall` times is marked down in the data plane (its flows re-steer),
/// and up again after `rise` successes. A round's flips go to the controller as one change
/// (one table rebuild, one state write). Returns as soon as `shutdown` completes, also in
/// the middle of a round (its probes are dropped).
pub async fn run_health<P: Plane + 'static>(
    ctl: Arc<Mutex<Controller<P>>>,
    cfg: Arc<Config>,
    epoch: Instant,
    shutdown: impl Future<Output = ()>,
) {
    let hc = cfg.health.clone();
    let configured = configured_checks(&cfg);
    let slots = Arc::new(Semaphore::new(MAX_IN_FLIGHT));
    let mut trackers = health::Trackers::default();
    let mut every = tokio::time::interval(hc.interval);
    every.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    tokio::pin!(shutdown);
    loop {
        tokio::select! {
            _ = every.tick() => {}
            _ = &mut shutdown => return,
        }
        let probes: Vec<(BackendKey, bool, HealthCheck)> = {
            let c = tokio::select! {
                c = ctl.lock() => c,
                _ = &mut shutdown => return,
            };
            c.state()
                .vips
                .values()
                .flat_map(|v| {
                    let configured = &configured;
                    v.backends.values().filter_map(move |b| {
                        let check = check_of(configured, v, b.spec.address)?;
                        Some(((v.spec.name.clone(), b.spec.address), b.healthy, check))
                    })
                })
                .collect()
        };
        let results = tokio::select! {
            r = probe_round(&probes, &hc, &slots) => r,
            _ = &mut shutdown => return,
        };
        let mut ended = Vec::with_capacity(results.len());
        let outcomes: Vec<health::Outcome> = probes
            .into_iter()
            .zip(results)
            .map(|((key, healthy, _), (result, at))| {
                ended.push(at);
                health::Outcome {
                    key,
                    healthy,
                    result,
                }
            })
            .collect();
        let mut local = outcomes.iter().filter_map(|o| match &o.result {
            Err(e @ health::CheckError::Local(_)) => Some(e),
            _ => None,
        });
        if let Some(e) = local.next() {
            tracing::warn!(checks = 1 + local.count(), error = %e, "health checks skipped; their backends keep their state");
        }
        let flips = trackers.round(epoch.elapsed(), &outcomes, &hc);
        if flips.is_empty() {
            continue;
        }
        let changes: Vec<HealthChange> = flips
            .iter()
            .map(|(_, ev)| HealthChange {
                vip: ev.vip.clone(),
                address: ev.backend.expect("a health event names its backend"),
                healthy: ev.kind == policy::EventKind::Up,
            })
            .collect();
        let mut c = tokio::select! {
            c = ctl.lock() => c,
            _ = &mut shutdown => return,
        };
        let applied = c.set_health(&changes, now_ms());
        if let Err(e) = &applied {
            tracing::error!(backends = changes.len(), error = %e, "cannot apply a round of health changes");
        }
        let t = now_ms();
        for (i, ev) in &flips {
            let mut ev = to_controller(ev, t);
            // The failover latency the operator cares about, measured where it happens (the
            // failover bench reads it from the event).
            if applied.is_ok() {
                ev.reason.push_str(&format!(
                    "; data plane updated {} us after the deciding check",
                    ended[*i].elapsed().as_micros()
                ));
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
    let tenants = c.tenant_usage()?;
    let (overlay, d) = decide(
        &c,
        hub,
        policy,
        shed_rst,
        now,
        (&sessions, &tenants),
        &handshakes,
    );
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
    c.set_tenant_decisions(d.tenants.clone());
}

/// Steps the policy on `sessions` (this host's, or the fleet's for its steering leader),
/// the tenants' usage ([`Controller::tenant_usage`]), `handshakes` ([`handshakes`]) and the
/// controller's health and telemetry; the overlay it decides, not installed.
pub fn decide<P: Plane>(
    c: &Controller<P>,
    hub: &std::sync::Mutex<Hub>,
    policy: &mut Policy,
    shed_rst: bool,
    now: Duration,
    (sessions, tenants): (&BTreeMap<u32, u64>, &TenantUsages),
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
    let configured = state.tenants.with_ids();
    let tenant_inputs: Vec<TenantInput> = tenants
        .iter()
        .filter_map(|((vip, tenant), u)| {
            let v = state.vips.get(vip)?;
            let (_, t) = configured.iter().find(|(_, t)| &t.name == tenant)?;
            let limits = t.limits_on(&v.spec.tenants);
            Some(TenantInput {
                vip,
                tenant,
                weight: limits.weight,
                max_sessions: limits.max_sessions,
                sessions: u.sessions,
                admitted: u.stats.admitted,
                refused: u.stats.refused_sessions + u.stats.refused_share + u.stats.refused_rate,
            })
        })
        .collect();
    let d = policy.step_with_tenants(now, &inputs, &tenant_inputs);
    let index = |vip: &str, tenant: &str| {
        let v = state.vips.get(vip)?;
        Some(lb_common::tenant_index(v.id, state.tenants.id(tenant)?))
    };
    let overlay = Overlay {
        tenant_flags: d
            .tenants
            .iter()
            .filter(|t| t.flags() != 0)
            .filter_map(|t| Some((index(&t.vip, &t.tenant)?, t.flags())))
            .collect(),
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
