//! The fleet's daemon tasks: following the table set (read, then watch), and the steering
//! rounds (lease and host report; on the leader, the policy step and drain completion).

use std::{
    collections::BTreeMap,
    future::Future,
    sync::Arc,
    time::{Duration, Instant},
};

use serde::{Deserialize, Serialize};
use tokio::sync::{Mutex, MutexGuard};

use super::{
    doc::{HostReport, Tables},
    drains_done,
    store::{Store, StoreError, WatchEvent},
    with_overlay, Fleet,
};
use crate::{
    clock::now_ms,
    controller::{Controller, Event, Peer, Plane},
    policy::Policy,
    scheduler, scrape,
    state::Op,
    telemetry::{inband::Tracker, Hub},
};

/// Wait between two attempts to reach etcd after a failure.
const RETRY: Duration = Duration::from_millis(500);

fn log_events<P: Plane>(c: &mut Controller<P>, events: Vec<Event>) {
    for e in events {
        if e.kind == "fleet-etcd-unreachable" {
            tracing::error!(reason = %e.reason, "etcd unreachable");
        }
        c.record(e);
    }
}

/// Keeps this host on the fleet's latest table set until `stop`: reads it (seeding an empty
/// fleet with this host's state), then follows the watch; whenever etcd fails, the host
/// keeps what it applied, says so, and tries again every `RETRY`.
pub async fn follow<S: Store, P: Plane>(
    fleet: Arc<Fleet<S>>,
    ctl: Arc<Mutex<Controller<P>>>,
    stop: impl Future<Output = ()>,
) {
    tokio::pin!(stop);
    loop {
        let err = tokio::select! {
            e = follow_once(&fleet, &ctl) => e,
            _ = &mut stop => return,
        };
        if let Some(e) = fleet.observed(Err(&err), now_ms()) {
            log_events(&mut *ctl.lock().await, vec![e]);
        }
        tracing::warn!(error = %err, "following the fleet's table set; retrying");
        tokio::select! {
            _ = tokio::time::sleep(RETRY) => {}
            _ = &mut stop => return,
        }
    }
}

/// Reads and applies the latest table set, then applies each one the watch brings. Returns
/// only with the error that ended it.
async fn follow_once<S: Store, P: Plane>(
    fleet: &Fleet<S>,
    ctl: &Mutex<Controller<P>>,
) -> StoreError {
    let mut events = vec![];
    let (tables, rev) = match fleet.read().await {
        Ok((Some(t), _, rev)) => (t, rev),
        Ok((None, ..)) => {
            let state = ctl.lock().await.state().clone();
            match fleet.seed(&state, now_ms(), &mut events).await {
                // Read again: another host may have seeded first.
                Ok(_) => match fleet.read().await {
                    Ok((Some(t), _, rev)) => (t, rev),
                    Ok((None, ..)) => {
                        return StoreError::Refused("the seeded table set vanished".into())
                    }
                    Err(e) => return e,
                },
                Err(e) => return StoreError::Unreachable(e.to_string()),
            }
        }
        Err(e) => return e,
    };
    events.extend(fleet.observed(Ok(()), now_ms()));
    {
        let mut c = ctl.lock().await;
        log_events(&mut c, std::mem::take(&mut events));
        fleet.apply(&mut c, &tables, now_ms());
    }
    let mut watch = match fleet.store.watch(&fleet.keys.tables, rev).await {
        Ok(w) => w,
        Err(e) => return e,
    };
    // A watch over a connection that died without a reset (a cut link) delivers nothing and
    // reports nothing: a read every lease TTL checks the version, and its failure restarts the
    // watch.
    let mut check = tokio::time::interval(fleet.cfg.lease_ttl);
    check.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    check.tick().await;
    loop {
        tokio::select! {
            batch = watch.recv() => {
                let batch = match batch {
                    Some(Ok(b)) => b,
                    Some(Err(e)) => return e,
                    None => break,
                };
                for ev in batch {
                    let WatchEvent::Put(kv) = ev else { continue };
                    if kv.key != fleet.keys.tables {
                        continue;
                    }
                    match serde_json::from_slice::<Tables>(&kv.value) {
                        Ok(t) => {
                            fleet.apply(&mut *ctl.lock().await, &t, now_ms());
                        }
                        Err(e) => {
                            tracing::error!(error = %e, "a table set in etcd cannot be read; skipped")
                        }
                    }
                }
            }
            _ = check.tick() => match fleet.read().await {
                Ok((Some(t), ..)) => {
                    fleet.apply(&mut *ctl.lock().await, &t, now_ms());
                }
                Ok((None, ..)) => {}
                Err(e) => return e,
            },
        }
    }
    StoreError::Unreachable("the watch ended".into())
}

/// The leader key's value: who and under which lease.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct LeaderClaim {
    pub host: String,
    pub lease: i64,
}

/// This host's lease and leadership between steering rounds.
#[derive(Default)]
pub struct Campaign {
    pub lease: i64,
}

impl Campaign {
    /// Renews (or takes) this host's lease and claims leadership if nobody holds it. Returns
    /// the leader's name and whether it is this host.
    pub async fn round<S: Store>(
        &mut self,
        fleet: &Fleet<S>,
    ) -> Result<(Option<String>, bool), StoreError> {
        if self.lease == 0 || !fleet.store.keep_alive(self.lease).await? {
            let ttl = fleet.cfg.lease_ttl.as_secs().max(1) as i64;
            self.lease = fleet.store.grant(ttl).await?;
        }
        let r = fleet.store.list(&fleet.keys.leader).await?;
        let held = r
            .kvs
            .iter()
            .find(|kv| kv.key == fleet.keys.leader)
            .and_then(|kv| serde_json::from_slice::<LeaderClaim>(&kv.value).ok());
        if let Some(c) = held {
            return Ok((Some(c.host.clone()), c.lease == self.lease));
        }
        let claim = LeaderClaim {
            host: fleet.cfg.host.clone(),
            lease: self.lease,
        };
        let body = serde_json::to_vec(&claim).expect("a claim serializes");
        if fleet
            .store
            .put_if(&fleet.keys.leader, body, 0, self.lease)
            .await?
        {
            return Ok((Some(claim.host), true));
        }
        // Someone else claimed it between the read and the write: next round reads who.
        Ok((None, false))
    }
}

/// Everything the steering rounds need from the daemon.
pub struct Steering<P: Plane> {
    pub ctl: Arc<Mutex<Controller<P>>>,
    pub hub: Arc<std::sync::Mutex<Hub>>,
    pub policy: Policy,
    /// This host's in-band windows (see `step`).
    pub inband: Tracker,
    pub shed_rst: bool,
    pub scrape_interval: Duration,
    pub scrape_timeout: Duration,
    pub epoch: Instant,
}

/// Two rounds. Every `lease_ttl / 3`: lease and leadership, and this host's report
/// (`lease_round`). On the leader, at every scrape round once it has reported, as the
/// single host's ticker does (`daemon::start_ticker`): the policy step on the fleet's
/// sessions and drain completion, each published as a new table-set version (`step`). A
/// step on the lease rounds decided on telemetry up to a scrape interval old.
pub async fn steer<S: Store, P: Plane>(
    fleet: Arc<Fleet<S>>,
    mut s: Steering<P>,
    stop: impl Future<Output = ()>,
) {
    let ctl = s.ctl.clone();
    let leases = async {
        let mut every = tokio::time::interval(fleet.cfg.lease_ttl / 3);
        every.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        let mut campaign = Campaign::default();
        loop {
            every.tick().await;
            let (now, mut events) = (now_ms(), vec![]);
            let r = lease_round(&fleet, &ctl, &mut campaign, now, &mut events).await;
            observed(&fleet, &ctl, r, now, events).await;
        }
    };
    let steps = async {
        let mut every = scrape::rounds(s.epoch, s.scrape_interval);
        loop {
            let round = every.tick().await.into_std();
            if !fleet.status().is_leader {
                continue;
            }
            scrape::round_in(&s.hub, round, round + s.scrape_timeout).await;
            let (now, mut events) = (now_ms(), vec![]);
            let r = step(&fleet, &mut s, now, &mut events).await;
            observed(&fleet, &s.ctl, r, now, events).await;
        }
    };
    tokio::select! {
        _ = leases => {}
        _ = steps => {}
        _ = stop => {}
    }
}

/// After a round: a failure gives up leadership until the next lease round; etcd's
/// reachability, the digests and the round's events are recorded.
async fn observed<S: Store, P: Plane>(
    fleet: &Fleet<S>,
    ctl: &Mutex<Controller<P>>,
    r: Result<(), StoreError>,
    now: u64,
    mut events: Vec<Event>,
) {
    if let Err(e) = &r {
        tracing::warn!(error = %e, "fleet steering round");
        fleet.set_leader(fleet.status().leader, false);
    }
    events.extend(fleet.observed(r.as_ref().map(drop), now));
    let mut c = ctl.lock().await;
    fleet.refresh_digests(&c);
    log_events(&mut c, events);
}

/// Lease and leadership, and this host's report (its active flows per backend).
pub(super) async fn lease_round<S: Store, P: Plane>(
    fleet: &Fleet<S>,
    ctl: &Mutex<Controller<P>>,
    campaign: &mut Campaign,
    now: u64,
    events: &mut Vec<Event>,
) -> Result<(), StoreError> {
    let was = fleet.status().is_leader;
    let (leader, is_leader) = campaign.round(fleet).await?;
    fleet.set_leader(leader.clone(), is_leader);
    if is_leader != was {
        events.push(Event {
            time_ms: now,
            kind: if is_leader {
                "fleet-leader"
            } else {
                "fleet-follower"
            }
            .into(),
            vip: String::new(),
            backend: None,
            reason: format!("steering leader: {}", leader.as_deref().unwrap_or("none")),
        });
    }
    let flows = ctl
        .lock()
        .await
        .active_flows()
        .map_err(|e| StoreError::Refused(format!("counting flows: {e:#}")))?;
    let report = HostReport {
        version: fleet.status().version,
        flows,
        taken_ms: now,
    };
    let key = fleet.keys.host(&fleet.cfg.host);
    let body = serde_json::to_vec(&report).expect("a report serializes");
    fleet.store.put(&key, body, campaign.lease).await?;
    Ok(())
}

/// The leader's step: the policy on the fleet's sessions (the hosts' reports summed),
/// published as the next version, then the drains whose streams have ended completed.
pub(super) async fn step<S: Store, P: Plane>(
    fleet: &Fleet<S>,
    s: &mut Steering<P>,
    now: u64,
    events: &mut Vec<Event>,
) -> Result<(), StoreError> {
    let reports: BTreeMap<String, HostReport> = fleet
        .store
        .list(&fleet.keys.hosts)
        .await?
        .kvs
        .into_iter()
        .filter_map(|kv| {
            let host = kv.key.strip_prefix(&fleet.keys.hosts)?.to_string();
            Some((host, serde_json::from_slice(&kv.value).ok()?))
        })
        .collect();
    let mut sessions: BTreeMap<u32, u64> = BTreeMap::new();
    for r in reports.values() {
        for (id, n) in &r.flows {
            *sessions.entry(*id).or_default() += n;
        }
    }
    let overlay = {
        let mut c = s.ctl.lock().await;
        // In-band signals come from this host's data plane alone: the flows ECMP gives the
        // leader, a sample of the fleet's (see docs/design.md, "In-band signals").
        let state = c.state().clone();
        if let Err(e) = scheduler::ingest_inband(&mut c, &state, &s.hub, &mut s.inband) {
            tracing::warn!(error = %e, "reading in-band aggregates");
        }
        // Handshakes likewise: the leader's share of the fleet's clients.
        let handshakes = scheduler::handshakes(&mut c, &state).unwrap_or_else(|e| {
            tracing::warn!(error = %e, "reading handshake counters");
            BTreeMap::new()
        });
        let (overlay, d) = scheduler::decide(
            &c,
            &s.hub,
            &mut s.policy,
            s.shed_rst,
            s.epoch.elapsed(),
            // Tenants' sessions are counted per host, not summed in the fleet's reports:
            // the leader decides no tenant flags.
            (&sessions, &BTreeMap::new()),
            &handshakes,
        );
        scheduler::record(&mut c, &d);
        overlay
    };
    let published = fleet
        .publish("steering decision", now, events, |t| {
            Ok(with_overlay(t, &overlay))
        })
        .await;
    publish_outcome(fleet, &s.ctl, published).await?;
    let (tables, ..) = fleet.read().await?;
    let Some(tables) = tables else { return Ok(()) };
    for (vip, address, reason) in drains_done(&tables, &reports, now) {
        let op = Op::RemoveBackend {
            vip: vip.clone(),
            address,
        };
        let r = fleet.submit(&op, now, events).await;
        if r.is_ok() {
            events.push(Event {
                time_ms: now,
                kind: "drain-complete".into(),
                vip,
                backend: Some(address),
                reason,
            });
        }
        publish_outcome(fleet, &s.ctl, r.map(Some)).await?;
    }
    Ok(())
}

/// Applies what a publish produced here at once (the watch brings it too; versions make the
/// second one a no-op).
async fn publish_outcome<S: Store, P: Plane>(
    fleet: &Fleet<S>,
    ctl: &Mutex<Controller<P>>,
    r: Result<Option<Tables>, super::WriteError>,
) -> Result<(), StoreError> {
    match r {
        Ok(Some(t)) => {
            fleet.apply(&mut *ctl.lock().await, &t, now_ms());
            Ok(())
        }
        Ok(None) => Ok(()),
        Err(super::WriteError::Unreachable(e, _)) => Err(StoreError::Unreachable(e)),
        Err(e) => Err(StoreError::Refused(e.to_string())),
    }
}

/// An admin request in a fleet: published to etcd as the next version, then applied here
/// before the answer (so the caller reads its own write). The guard lets the caller answer
/// with the result before anyone else changes it.
pub async fn submit<'a, S: Store, P: Plane>(
    fleet: &Fleet<S>,
    ctl: &'a Mutex<Controller<P>>,
    op: Op,
    peer: Peer,
    now: u64,
) -> Result<MutexGuard<'a, Controller<P>>, super::WriteError> {
    let mut events = vec![];
    let r = fleet.submit(&op, now, &mut events).await;
    let mut c = ctl.lock().await;
    log_events(&mut c, events);
    let t = r?;
    c.record(Event {
        time_ms: now,
        kind: "fleet-request".into(),
        vip: String::new(),
        backend: None,
        reason: format!(
            "{} by uid {} (pid {}) published as version {}",
            t.reason, peer.uid, peer.pid, t.version
        ),
    });
    fleet.apply(&mut c, &t, now);
    Ok(c)
}
