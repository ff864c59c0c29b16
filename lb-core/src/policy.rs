//! Adaptive steering: Maglev weights, move-aways, cooldowns and admission from telemetry.
//!
//! A pure engine: [`Policy::step`] takes the time (`now`, since any fixed epoch) and a view of
//! every backend, and returns the weights and flags to write plus audit events. It reads no
//! clock and does no I/O, so the daemon drives it and tests script it. Health probes run in
//! the daemon's crate; their results feed the pure [`health::Health::record`].
//!
//! Per step and backend (see the submodules for each rule):
//! - the load score (an EWMA of the largest normalised load signal), compared with the mean
//!   of the VIP's backends, sets a weight level `1..=weight_levels`, moved only past a
//!   hysteresis band (`score`), and full while the engine shows room ([`HEADROOM`]); a
//!   backend markedly slower per output token than the median of its VIP's others in
//!   rotation gets a level in proportion to its relative speed (`score::Speed`), and the
//!   lower of the two levels counts;
//! - congestion, saturation, throttling or stale telemetry moves the backend away (weight 0
//!   for new sessions, established ones stay) under an exponential cooldown, and a return
//!   ramps up over `slow_start`, or after congestion holds the reduced level on probation
//!   (`cooldown`); a saturation move ends as soon as the backend is under its thresholds
//!   and no more loaded than the others (`Policy::trigger`). Saturation counts only for a backend more
//!   loaded than its VIP's others, and only after [`SATURATION_STEPS`] steps in a row: a
//!   queue or KV reading at its threshold for one scrape is a burst a healthy fleet at 65%
//!   load sees every few minutes, each move costs affinity and two weight changes, and a
//!   whole VIP saturated is admission control's business (`Policy::trigger`);
//! - a backend whose clients' TCP handshakes fail far more often than its peers' moves away
//!   as `refusing` under the same cooldown (`refusing`);
//! - a down backend gets weight 0 ([`health`] tracks up/down);
//! - while a backend is moved away for a fault, the markedly more loaded of the rest take
//!   none of its share: their level is held to the share they had (`Policy::hold_shares`);
//! - full backends and the VIP's shed level come from `admission`, with `cooldown_base`
//!   as the shed period.
//!
//! Guard: telemetry alone never empties a VIP. When every healthy backend of positive weight
//! would be moved away, half of them (rounded up) stay in at their score weight, and
//! admission control deals with real overload. They are ranked first by what holds now, then
//! by why they went out (refusing > throttled > congested > slow > saturated > stale:
//! [`Reason::severity`]), then by score: a throttled backend that was emptied has a low score
//! because it carries nothing, not because it would serve well.

mod admission;
mod cooldown;
mod event;
mod harm;
pub mod health;
mod inband;
mod pool;
mod refusing;
mod score;
mod tenants;
#[cfg(test)]
mod tests;

use std::{
    collections::{BTreeMap, BTreeSet},
    net::IpAddr,
    time::Duration,
};

use serde::{Serialize, Serializer};

pub use self::{
    admission::{Shed, LOWEST_CLASS},
    event::{EventKind, PolicyEvent},
    refusing::Handshakes,
    score::Reason,
    tenants::{TenantDecision, TenantInput},
};
use self::{
    admission::{ShedChange, Shedder},
    cooldown::{Change, MoveAway, Phase, PROBATION},
    event::backend_event,
    pool::{pools, POOL_SEP},
    score::{Score, Speed, Trigger, LOAD_BAND},
};
use crate::{
    config::{PolicyConfig, ShedMode},
    telemetry::BackendTelemetry,
};

/// One backend of one VIP as the policy sees it at a step.
#[derive(Clone, Copy, Debug)]
pub struct BackendInput<'a> {
    pub vip: &'a str,
    pub address: IpAddr,
    /// Data-plane backend id, unique across VIPs.
    pub id: u32,
    /// Configured (operator) weight.
    pub weight: u32,
    /// Its VIP's admission class (0 highest, [`LOWEST_CLASS`] lowest).
    pub class: u8,
    pub healthy: bool,
    /// Active sessions in the connection table.
    pub sessions: u64,
    /// 0 = no cap.
    pub max_sessions: u32,
    /// `None`: no telemetry configured for this backend.
    pub telemetry: Option<&'a BackendTelemetry>,
    /// Cumulative TCP handshakes the data plane counted for it; `None` where it counts none
    /// (a UDP or second-chance VIP).
    pub handshakes: Option<Handshakes>,
}

/// Where a backend stands for new sessions.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
#[serde(rename_all = "kebab-case")]
pub enum SteerState {
    Active,
    SlowStart,
    MovedAway,
    /// Would be moved away, kept in by the guard.
    Guarded,
    Down,
}

#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct BackendDecision {
    pub vip: String,
    pub address: IpAddr,
    pub id: u32,
    /// The Maglev weight to write.
    pub weight: u32,
    pub state: SteerState,
    pub moved_away: bool,
    /// Why it is (or, guarded, would be) moved away.
    pub reason: Option<Reason>,
    #[serde(rename = "cooldown_left_s", serialize_with = "secs")]
    pub cooldown_left: Duration,
    /// The data plane probes past full backends.
    pub full: bool,
    /// At the operator's session cap (also full): affinity entries bring it no new session.
    pub capped: bool,
    /// Down, moved away for a fault ([`Reason::is_fault`]), or requests wait in its queue:
    /// its clients' affinity entries bring it no new session. Saturation alone (a full KV
    /// cache that still admits at once) only steers new clients away.
    pub breaks_affinity: bool,
    /// Smoothed load score (0 idle .. 1 at a threshold).
    pub score: f64,
    pub sessions: u64,
    pub max_sessions: u32,
    #[serde(rename = "telemetry_age_s", serialize_with = "opt_secs")]
    pub telemetry_age: Option<Duration>,
    /// In-band time to first byte and per-stream delivery rate, where fresh.
    pub ttfb_s: Option<f64>,
    pub delivery_bps: Option<f64>,
    /// The TCP handshakes the refusing rule judges (its newest, at least
    /// `refusing::MIN_HANDSHAKES` within `refusing::WINDOW` where there are as many),
    /// started and completed, where the data plane counts them.
    pub handshakes: Option<Handshakes>,
}

#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct Decisions {
    /// In input order.
    pub backends: Vec<BackendDecision>,
    /// Per VIP name.
    pub shed: BTreeMap<String, Shed>,
    pub events: Vec<PolicyEvent>,
    /// Per (VIP, tenant), in input order within each pool.
    pub tenants: Vec<TenantDecision>,
}

impl Decisions {
    /// Backend id → weight, for the overlay the shell hands to `Controller::set_overlay`.
    pub fn weights(&self) -> BTreeMap<u32, u32> {
        self.backends.iter().map(|b| (b.id, b.weight)).collect()
    }
}

fn secs<S: Serializer>(d: &Duration, s: S) -> Result<S::Ok, S::Error> {
    s.serialize_f64(d.as_secs_f64())
}

fn opt_secs<S: Serializer>(d: &Option<Duration>, s: S) -> Result<S::Ok, S::Error> {
    match d {
        Some(d) => secs(d, s),
        None => s.serialize_none(),
    }
}

/// Consecutive steps a saturation condition must hold to move a backend away.
pub const SATURATION_STEPS: u32 = 2;

/// The most mean pressure a VIP's backends in rotation may carry and still have headroom for
/// another's share. Without headroom a move away only saturates the rest in turn (a throttled
/// fleet would see three of four moved away within seconds, leaving one ramping backend with
/// every new session), so then:
/// - saturation moves nobody (the data plane probes past a full backend);
/// - a throttled or congested backend keeps [`REDUCED_LEVEL_DIV`] of its weight instead of
///   none, and counts as full while anything waits in its queue;
/// - a backend returning from a move skips slow start.
///
/// The test counts the share a moved-away backend still carries (a reduced one's quarter) as
/// the others' load, and a VIP without headroom regains it only below
/// `HEADROOM - HEADROOM_BAND` (`Policy::headroom`).
pub const HEADROOM: f64 = 0.5;

/// How far under [`HEADROOM`] a VIP's mean pressure must fall to regain headroom. A lone
/// backend in rotation reads around the threshold (0.48-0.56 scrape by scrape in
/// `cargo xtask demo` while the throttled one is out), and without a band each reading would
/// flip that one between weight 0 and a quarter every 0.5-2 s.
pub const HEADROOM_BAND: f64 = 0.1;

/// A throttled or congested backend of a VIP without headroom keeps
/// `weight_levels / REDUCED_LEVEL_DIV` levels (at least one): a quarter of its weight, under
/// the share a 0.4x accelerator can serve, instead of its whole share moved onto backends
/// that have no room for it. A backend on probation after congestion takes the same level.
/// Its sessions run slower per token, but switching it off (weight 0) does not improve the
/// p99 inter-token latency (the crowded others' steps are as slow) and makes the p99 time to
/// first token worse in most cells (docs/benchmarks.md).
pub const REDUCED_LEVEL_DIV: u32 = 4;

/// What the policy remembers of a backend between steps.
struct Memory {
    score: Score,
    speed: Speed,
    move_away: MoveAway,
    healthy: bool,
    /// Consecutive steps with a saturation condition.
    saturated: u32,
    /// Takes none of a faulty backend's share ([`Policy::hold_shares`]).
    holds_share: bool,
    /// Moved away and keeping [`REDUCED_LEVEL_DIV`] of its weight at the last step.
    reduced: bool,
    /// The weight last decided; `None` before the first.
    weight: Option<u32>,
    handshakes: refusing::Window,
}

/// The steering engine; holds per-backend memory (scores, cooldowns) between steps.
pub struct Policy {
    cfg: PolicyConfig,
    backends: BTreeMap<u32, Memory>,
    shedders: BTreeMap<String, Shedder>,
    started: bool,
    /// Backends flagged for a telemetry mismatch in their current slow episode.
    mismatched: BTreeSet<u32>,
    /// The checks of in-band moves against their effect ([`harm`]).
    harm: harm::Checks,
    /// VIPs without headroom at the last step ([`HEADROOM`]).
    crowded: BTreeSet<String>,
    tenants: tenants::Memory,
}

/// A backend's view within one step.
struct Work<'a> {
    input: &'a BackendInput<'a>,
    /// Every condition that holds in the telemetry.
    conditions: Vec<Trigger>,
    /// This step's load pressure (fresh telemetry only).
    pressure: Option<f64>,
    /// The condition acted on (see [`Policy::trigger`]).
    trigger: Option<Trigger>,
    eligible: bool,
    wants_out: bool,
    /// Its VIP's backends in rotation have no headroom ([`HEADROOM`]).
    crowded: bool,
    /// Its handshakes as the refusing rule samples them ([`refusing::Window::observe`]).
    handshakes: Handshakes,
}

impl Policy {
    pub fn new(cfg: PolicyConfig) -> Self {
        Policy {
            cfg,
            backends: BTreeMap::new(),
            shedders: BTreeMap::new(),
            started: false,
            mismatched: BTreeSet::new(),
            harm: harm::Checks::default(),
            crowded: BTreeSet::new(),
            tenants: tenants::Memory::default(),
        }
    }

    /// A reloaded `[policy]`: later steps decide with it; each backend's memory (score
    /// history, cooldown, slow start) is kept, so a reload moves no traffic by itself.
    pub fn set_config(&mut self, cfg: PolicyConfig) {
        self.cfg = cfg;
    }

    /// One control interval. Backends missing from `inputs` are forgotten.
    pub fn step(&mut self, now: Duration, inputs: &[BackendInput]) -> Decisions {
        self.step_with_tenants(now, inputs, &[])
    }

    /// [`Policy::step`] with the VIPs' tenants: their flags are decided with each pool's
    /// admission (`tenants`).
    pub fn step_with_tenants(
        &mut self,
        now: Duration,
        inputs: &[BackendInput],
        tenant_inputs: &[TenantInput],
    ) -> Decisions {
        let activity = self.tenants.observe(now, tenant_inputs);
        let tenant_work: Vec<(&TenantInput, tenants::Activity)> =
            tenant_inputs.iter().zip(activity).collect();
        let ids: BTreeSet<u32> = inputs.iter().map(|i| i.id).collect();
        self.backends.retain(|id, _| ids.contains(id));
        let vips: BTreeSet<&str> = inputs.iter().map(|i| i.vip).collect();
        let pools = pools(inputs);
        self.shedders.retain(|p, _| pools.values().any(|q| q == p));

        let mut work: Vec<Work> = inputs.iter().map(|i| self.observe(now, i)).collect();
        self.headroom(&mut work);
        let mut events = Vec::new();
        let slow_out: BTreeSet<u32> = self
            .backends
            .iter()
            .filter(|(_, m)| {
                matches!(
                    m.move_away.phase,
                    Phase::MovedAway {
                        reason: Reason::Slow,
                        ..
                    }
                )
            })
            .map(|(id, _)| *id)
            .collect();
        let moved_slow = |id| slow_out.contains(&id);
        inband::slow(
            now,
            &mut work,
            moved_slow,
            &mut self.mismatched,
            &mut events,
        );
        for i in self
            .harm
            .judge(now, &work, moved_slow, &self.cfg, &mut events)
        {
            let m = self.backends.get_mut(&work[i].input.id).expect("observed");
            m.move_away.end_early(now, Reason::Slow);
        }
        self.harm.hold(now, &mut work);
        let backends = &self.backends;
        refusing::refusing(&mut work, |id| {
            matches!(backends[&id].move_away.phase, Phase::InRotation { .. })
        });
        self.relevel(now, &work);
        self.respeed(&work);
        self.trigger(now, &mut work);
        let kept = self.guard(&work);
        let caps = self.hold_shares(&work);

        let mut out = Decisions {
            backends: Vec::with_capacity(inputs.len()),
            shed: BTreeMap::new(),
            events,
            tenants: Vec::new(),
        };
        for (i, w) in work.iter().enumerate() {
            let cap = caps.get(w.input.vip).copied();
            let d = self.decide(now, w, kept.contains(&i), cap, &mut out.events);
            if d.state == SteerState::MovedAway && d.reason == Some(Reason::Slow) {
                let before = harm::vip_delivery(&work, w.input.vip);
                self.harm.moved(now, w.input.id, before);
            }
            out.backends.push(d);
        }
        let mut done = BTreeSet::new();
        for vip in vips {
            let pool = &pools[vip];
            if done.insert(pool.clone()) {
                self.shed(now, pool, &work, &tenant_work, &mut out);
            }
        }
        self.started = true;
        out
    }

    /// Updates the score and health memory; works out the move-away wish.
    fn observe<'a>(&mut self, now: Duration, input: &'a BackendInput<'a>) -> Work<'a> {
        let cfg = &self.cfg;
        // Backends present at the first step keep their weight; later ones are new: ramp.
        let ramp = self.started.then_some(now);
        let m = self.backends.entry(input.id).or_insert_with(|| Memory {
            score: Score::new(cfg),
            speed: Speed::new(cfg),
            move_away: MoveAway::new(ramp),
            healthy: input.healthy,
            saturated: 0,
            holds_share: false,
            reduced: false,
            weight: None,
            handshakes: refusing::Window::default(),
        });
        if input.healthy && !m.healthy {
            m.move_away.on_up(now);
        }
        m.healthy = input.healthy;
        let fresh = input.telemetry.filter(|t| !t.stale);
        let pressure = fresh.and_then(|t| score::pressure(&t.sample, cfg));
        if let Some(t) = fresh {
            m.score.update(pressure, cfg);
            m.speed.update(t.sample.tpot_s, cfg);
        }
        let handshakes = m.handshakes.observe(now, input.handshakes);
        Work {
            input,
            conditions: input
                .telemetry
                .map(|t| score::triggers(t, cfg))
                .unwrap_or_default(),
            pressure,
            trigger: None,
            eligible: input.healthy && input.weight > 0,
            wants_out: false,
            crowded: false,
            handshakes,
        }
    }

    /// Marks the backends of VIPs without headroom ([`HEADROOM`]). The mean pressure of the
    /// backends in rotation is scaled up by the ring weight that moved-away backends still
    /// carry, as if it were on them: that share returns to them if the decision goes the
    /// other way, so the test sees the same load whichever way it last went (without this, a
    /// reduced backend's quarter relieves the others, which gives headroom back, which sends
    /// it to 0, which takes headroom away). The band against scrape noise is the same kind
    /// of hysteresis the weight levels have.
    fn headroom(&mut self, work: &mut [Work]) {
        let pressure = self.vip_means(work, |_, w| w.pressure.unwrap_or(0.0));
        let weight = |m: &Memory, w: &Work| f64::from(m.weight.unwrap_or(w.input.weight));
        let in_rotation = self.vip_means(work, weight);
        let mut carried: BTreeMap<&str, f64> = BTreeMap::new();
        for w in work.iter().filter(|w| w.eligible) {
            let m = &self.backends[&w.input.id];
            if matches!(m.move_away.phase, Phase::MovedAway { .. }) {
                *carried.entry(w.input.vip).or_default() += weight(m, w);
            }
        }
        let crowded: BTreeSet<String> = pressure
            .into_iter()
            .filter(|(vip, (sum, n))| {
                let rotation = in_rotation[vip].0;
                let scale = if rotation > 0.0 {
                    (rotation + carried.get(vip).copied().unwrap_or(0.0)) / rotation
                } else {
                    1.0
                };
                let band = if self.crowded.contains(*vip) {
                    HEADROOM_BAND
                } else {
                    0.0
                };
                sum / f64::from(*n) * scale > HEADROOM - band
            })
            .map(|(vip, _)| vip.to_owned())
            .collect();
        for w in work.iter_mut() {
            w.crowded = crowded.contains(w.input.vip);
        }
        self.crowded = crowded;
    }

    /// Picks the condition each backend acts on: the most severe. Saturation counts only when
    /// the backend is more loaded than its VIP's others (pressure over `1 + LOAD_BAND` times
    /// the mean pressure in rotation) for [`SATURATION_STEPS`] steps in a row, the others
    /// have room ([`HEADROOM`]) and no other backend of the VIP is moved away: when the whole
    /// VIP is saturated, moving one away only saturates the rest harder (a healthy fleet
    /// would cascade so), and admission control is what deals with a full fleet.
    ///
    /// A saturation move ends before its cooldown once the backend reads under its thresholds
    /// and no more loaded than the mean of the backends in rotation: the gap between that and
    /// the trigger (at a threshold and [`score::LOAD_BAND`] over the mean, for
    /// [`SATURATION_STEPS`] steps) is the hysteresis. Ending early matters because an emptied
    /// backend drains fast (KV 0.98 to 0.34 within 3 s): kept at weight 0 for its whole
    /// cooldown, it leaves the backend that took its share full and starting the slowest
    /// first tokens.
    fn trigger(&mut self, now: Duration, work: &mut [Work]) {
        let sums: BTreeMap<String, (f64, u32)> = self
            .vip_means(work, |_, w| w.pressure.unwrap_or(0.0))
            .into_iter()
            .map(|(vip, sum)| (vip.to_owned(), sum))
            .collect();
        // Backends moved away already: their share is on the others.
        let out: BTreeSet<(String, u32)> = work
            .iter()
            .filter(|w| {
                matches!(
                    self.backends[&w.input.id].move_away.phase,
                    Phase::MovedAway { .. }
                )
            })
            .map(|w| (w.input.vip.to_owned(), w.input.id))
            .collect();
        for w in work.iter_mut() {
            let m = self.backends.get_mut(&w.input.id).expect("observed");
            let own = w.pressure.unwrap_or(0.0);
            let sum = sums.get(w.input.vip).copied();
            let hotter =
                sum.is_none_or(|(sum, n)| own > (1.0 + score::LOAD_BAND) * sum / f64::from(n));
            // The others (in rotation) must have room for its share.
            let room = sum
                .is_none_or(|(sum, n)| n <= 1 || (sum - own) / f64::from(n - 1) <= HEADROOM)
                && !out
                    .iter()
                    .any(|(vip, id)| vip == w.input.vip && *id != w.input.id);
            let at_threshold = w.conditions.iter().any(|t| t.reason == Reason::Saturation);
            let saturated = hotter && room && at_threshold;
            // Load passes: once the backend reads under its thresholds and no more loaded
            // than the mean of those in rotation, keeping it out only saturates them.
            let cooled = !at_threshold
                && w.pressure
                    .is_some_and(|p| sum.is_none_or(|(sum, n)| p <= sum / f64::from(n)));
            if cooled {
                m.move_away.end_early(now, Reason::Saturation);
            }
            m.saturated = if saturated { m.saturated + 1 } else { 0 };
            let act = m.saturated >= SATURATION_STEPS;
            w.trigger = w
                .conditions
                .iter()
                .filter(|t| t.reason != Reason::Saturation || act)
                .max_by_key(|t| t.reason.severity())
                .cloned();
            let reason = w.trigger.as_ref().map(|t| t.reason);
            w.wants_out = w.eligible && m.move_away.wants_out(now, reason);
        }
    }

    /// Sets each scored backend's level from its score against its VIP's mean score over
    /// the backends in rotation with fresh telemetry (one moved away is empty because it was
    /// emptied, and counting it would make the others look loaded).
    ///
    /// A backend whose engine shows room (a score at most [`HEADROOM`]: KV use and queue at
    /// most half their thresholds, smoothed) keeps full weight however little the others
    /// carry: lowering it would only remap clients. At light load the source hash's
    /// unevenness alone reads as several times the mean (at 25% load one backend can read KV
    /// 0.35-0.49 while the others read 0-0.1 and nothing queues). A busy GPU known only by
    /// its utilisation ([`score::BUSY`]) shows no depth, so it is compared as before.
    fn relevel(&mut self, now: Duration, work: &[Work]) {
        let scored = |w: &&Work| w.eligible && w.input.telemetry.is_some_and(|t| !t.stale);
        let sums = self.vip_means(work, |m, _| m.score.value());
        let levels = self.cfg.weight_levels;
        for w in work.iter().filter(scored) {
            let Some(&(sum, n)) = sums.get(w.input.vip) else {
                continue;
            };
            let engine = w.input.telemetry.is_some_and(|t| t.sample.engine_load());
            let m = self.backends.get_mut(&w.input.id).expect("observed");
            let score = m.score.value();
            let target = if engine && score <= HEADROOM {
                f64::from(levels)
            } else {
                score::relative_level(score, sum / f64::from(n), levels)
            };
            m.score.relevel(now, target, &self.cfg);
        }
    }

    /// Sets each backend's speed level from its time per output token against the median
    /// of its VIP's other eligible backends in rotation with an estimate.
    fn respeed(&mut self, work: &[Work]) {
        let mut by_vip: BTreeMap<&str, Vec<(u32, f64)>> = BTreeMap::new();
        for w in work.iter().filter(|w| w.eligible) {
            let m = &self.backends[&w.input.id];
            if let (Phase::InRotation { .. }, Some(t)) = (&m.move_away.phase, m.speed.tpot_s()) {
                by_vip.entry(w.input.vip).or_default().push((w.input.id, t));
            }
        }
        for w in work.iter().filter(|w| w.eligible) {
            let others: Vec<f64> = by_vip
                .get(w.input.vip)
                .into_iter()
                .flatten()
                .filter(|(id, _)| *id != w.input.id)
                .map(|&(_, t)| t)
                .collect();
            if let Some(median) = inband::median(others) {
                let m = self.backends.get_mut(&w.input.id).expect("observed");
                m.speed.relevel(median, &self.cfg);
            }
        }
    }

    /// Per VIP, the sum and count of `value` over its eligible backends in rotation with
    /// fresh telemetry.
    fn vip_means<'w>(
        &self,
        work: &[Work<'w>],
        value: impl Fn(&Memory, &Work) -> f64,
    ) -> BTreeMap<&'w str, (f64, u32)> {
        let mut sums: BTreeMap<&str, (f64, u32)> = BTreeMap::new();
        for w in work {
            let m = &self.backends[&w.input.id];
            let fresh = w.input.telemetry.is_some_and(|t| !t.stale);
            if w.eligible && fresh && matches!(m.move_away.phase, Phase::InRotation { .. }) {
                let e = sums.entry(w.input.vip).or_default();
                e.0 += value(m, w);
                e.1 += 1;
            }
        }
        sums
    }

    /// While a VIP has a backend moved away for a fault (throttling, congestion or slowness),
    /// the level its hot backends may take: their share of the whole ring, `weight_levels`
    /// times the configured weight still in rotation over all of it, so the faulty backend's
    /// share goes to the backends with room. Maglev spreads a removed backend's slots by
    /// weight, a third to each of three equal others, so the backend its clients' source hash
    /// already loaded most takes as much of it as those with room. Holding it keeps the share
    /// Maglev would otherwise pile onto the hot peer, which raises the p99 time to first
    /// token under a throttled or congested backend.
    ///
    /// Hot is a score over [`HEADROOM`] (under it a backend has room for more) and past
    /// [`LOAD_BAND`] over the mean of the VIP's backends in rotation ([`score::hotter`]); a
    /// backend stays held until it is within half that band (an EWMA that falls towards the
    /// others' level never reaches their mean), or until nothing of its VIP is out.
    /// Saturation moves hold nothing: they need the others to have room, and they end with
    /// their load. Nor does a down backend: it may stay down for hours, and holds following
    /// the wandering load of a source-hashed VIP for that long would be the churn the level
    /// dwell ([`score::LEVEL_DWELL`]) prevents; a fault move returns after its cooldown.
    /// Decided on the phases of the previous step, so every backend of the VIP sees the
    /// same set out.
    fn hold_shares<'w>(&mut self, work: &[Work<'w>]) -> BTreeMap<&'w str, u32> {
        let mut ring: BTreeMap<&str, (u64, u64)> = BTreeMap::new();
        for w in work.iter().filter(|w| w.input.weight > 0) {
            let m = &self.backends[&w.input.id];
            let faulty = w.input.healthy
                && matches!(m.move_away.phase, Phase::MovedAway { reason, .. } if reason.is_fault());
            let e = ring.entry(w.input.vip).or_default();
            e.0 += u64::from(w.input.weight);
            e.1 += if faulty { u64::from(w.input.weight) } else { 0 };
        }
        let caps: BTreeMap<&str, u32> = ring
            .into_iter()
            .filter(|(_, (_, out))| *out > 0)
            .map(|(vip, (all, out))| {
                let levels = u64::from(self.cfg.weight_levels);
                (vip, ((levels * (all - out) / all) as u32).max(1))
            })
            .collect();
        let means = self.vip_means(work, |m, _| m.score.value());
        for w in work {
            let m = self.backends.get_mut(&w.input.id).expect("observed");
            let in_rotation = w.eligible && matches!(m.move_away.phase, Phase::InRotation { .. });
            let mean = means.get(w.input.vip).map(|&(sum, n)| sum / f64::from(n));
            m.holds_share = match mean.filter(|_| in_rotation && caps.contains_key(w.input.vip)) {
                None => false,
                Some(mean) if m.holds_share => {
                    score::hotter(m.score.value(), mean, LOAD_BAND / 2.0)
                }
                Some(mean) => {
                    m.score.value() > HEADROOM && score::hotter(m.score.value(), mean, LOAD_BAND)
                }
            };
        }
        caps
    }

    /// Indexes of backends the guard keeps in (see the module docs).
    fn guard(&self, work: &[Work]) -> BTreeSet<usize> {
        let mut by_vip: BTreeMap<&str, Vec<usize>> = BTreeMap::new();
        for (i, w) in work.iter().enumerate().filter(|(_, w)| w.eligible) {
            by_vip.entry(w.input.vip).or_default().push(i);
        }
        let mut kept = BTreeSet::new();
        for mut pool in by_vip.into_values() {
            if !pool.iter().all(|&i| work[i].wants_out) {
                continue;
            }
            // What holds now first, then why it went out: a backend whose trigger has passed
            // goes back before one whose exporters still say so.
            let load = |i: usize| {
                let m = &self.backends[&work[i].input.id];
                let went = match &m.move_away.phase {
                    Phase::MovedAway { reason, .. } => Some(reason.severity()),
                    Phase::InRotation { .. } => None,
                };
                let now = work[i].trigger.as_ref().map(|t| t.reason.severity());
                (now, went, m.score.value())
            };
            pool.sort_by(|&a, &b| {
                let (a, b) = (load(a), load(b));
                (a.0, a.1).cmp(&(b.0, b.1)).then(a.2.total_cmp(&b.2))
            });
            kept.extend(pool.iter().take(pool.len().div_ceil(2)));
        }
        kept
    }

    fn decide(
        &mut self,
        now: Duration,
        w: &Work,
        kept: bool,
        cap: Option<u32>,
        events: &mut Vec<PolicyEvent>,
    ) -> BackendDecision {
        let cfg = &self.cfg;
        let input = w.input;
        let m = self.backends.get_mut(&input.id).expect("observed");
        if w.eligible && !kept {
            move_away_or_back(m, cfg, now, w, events);
        }
        let moved = matches!(m.move_away.phase, Phase::MovedAway { .. });
        // Slow for its hardware, not for its load: with no room elsewhere it keeps a part.
        let reduced = moved
            && w.crowded
            && matches!(
                m.move_away.phase,
                Phase::MovedAway {
                    reason: Reason::Throttling | Reason::Congestion,
                    ..
                }
            );
        let reduced_level = (cfg.weight_levels / REDUCED_LEVEL_DIV).max(1);
        let own = m.score.level.min(m.speed.level);
        let held = cap.filter(|&cap| m.holds_share && !moved && cap < own);
        let rotating = held.unwrap_or(own);
        // Kept a part for want of headroom, not by the guard (which keeps its own level).
        let keeps_part = reduced && input.healthy && !kept;
        let level = match (input.healthy, moved, kept) {
            (false, ..) => 0,
            (true, true, false) if keeps_part => reduced_level,
            (true, true, false) => 0,
            (true, true, true) => own,
            (true, false, _) if m.move_away.on_probation() => reduced_level.min(rotating),
            (true, false, _) if w.crowded => m.move_away.skip_ramp(rotating),
            (true, false, _) => m.move_away.ramp_level(now, rotating, cfg),
        };
        let state = if !input.healthy {
            SteerState::Down
        } else if kept {
            SteerState::Guarded
        } else if moved {
            SteerState::MovedAway
        } else if m.move_away.ramping() || m.move_away.on_probation() {
            SteerState::SlowStart
        } else {
            SteerState::Active
        };
        let weight = score::scaled(input.weight, level, cfg);
        if let Some(old) = m.weight.filter(|&old| old != weight) {
            // A moved-away backend's weight follows its VIP's headroom, not its own signals:
            // say so, or the operator sees a sick backend given weight for no reason.
            let cause = match held {
                Some(cap) => {
                    format!(", holding its share: at most {cap} while a faulty backend is out")
                }
                None if keeps_part => {
                    ", keeping a part: the backends in rotation have no headroom for its share"
                        .to_owned()
                }
                None if m.reduced && moved && input.healthy && !kept => {
                    ", the backends in rotation have headroom for its share again".to_owned()
                }
                None => String::new(),
            };
            let why = format!(
                "{old} -> {weight} ({state:?}, score {:.2}, level {level}/{}{cause})",
                m.score.value(),
                cfg.weight_levels
            );
            events.push(backend_event(now, input, EventKind::WeightChange, why));
        }
        m.weight = Some(weight);
        m.reduced = keeps_part;
        let reason = match &m.move_away.phase {
            Phase::MovedAway { reason, .. } => Some(*reason),
            Phase::InRotation { .. } => w.trigger.as_ref().map(|t| t.reason),
        };
        BackendDecision {
            vip: input.vip.to_owned(),
            address: input.address,
            id: input.id,
            weight,
            state,
            moved_away: state == SteerState::MovedAway,
            reason,
            cooldown_left: m.move_away.cooldown_left(now),
            // A reduced backend takes its ring share only while nothing waits there: the
            // data plane probes past full backends, and a slow backend the others' probes
            // reach would otherwise take every new session they refuse.
            full: admission::full(input.sessions, input.max_sessions, input.telemetry, cfg)
                || (reduced && queued(input.telemetry)),
            capped: admission::capped(input.sessions, input.max_sessions, input.telemetry),
            // A cached prefix saves its prefill (tens of ms for a chat history, 0.4 s for
            // 5000 tokens at the lab's H100 pace); a place in the queue costs the wait for a
            // running request to finish (seconds). So affinity stands on a busy backend
            // only while nothing waits there.
            breaks_affinity: !input.healthy
                || (state == SteerState::MovedAway && reason.is_some_and(Reason::is_fault))
                || queued(input.telemetry),
            score: m.score.value(),
            sessions: input.sessions,
            max_sessions: input.max_sessions,
            telemetry_age: input.telemetry.and_then(|t| t.age),
            ttfb_s: input.telemetry.and_then(|t| t.sample.ttfb_s),
            delivery_bps: input.telemetry.and_then(|t| t.sample.delivery_bps),
            handshakes: input.handshakes.map(|_| w.handshakes),
        }
    }

    /// Admission for one pool: the VIPs that share backend hosts. While all of the pool's
    /// backends are full its shedder tightens, and each VIP of a class below what it admits
    /// sheds its new sessions: capacity that frees up goes to the higher classes.
    ///
    /// The pool's tenants are flagged first ([`tenants`]); while one of them is over its
    /// share the shedder does not tighten.
    fn shed(
        &mut self,
        now: Duration,
        pool: &str,
        work: &[Work],
        tenant_work: &[(&TenantInput, tenants::Activity)],
        out: &mut Decisions,
    ) {
        let members: BTreeSet<&str> = pool.split(POOL_SEP).collect();
        let (mut full, mut backends) = (0, 0);
        for (w, d) in work.iter().zip(&out.backends) {
            if members.contains(w.input.vip) && w.eligible {
                backends += 1;
                full += u32::from(d.full);
            }
        }
        let shedder = self
            .shedders
            .entry(pool.to_owned())
            .or_insert_with(|| Shedder::new(now));
        let admitting: BTreeSet<&str> = members
            .iter()
            .copied()
            .filter(|&vip| {
                let caps = work.iter().filter(|w| w.input.vip == vip);
                admission::configured(&self.cfg, caps.map(|w| w.input.max_sessions))
            })
            .collect();
        // A pool none of whose VIPs has admission never tightens: nothing of it would shed.
        let all_full = !admitting.is_empty() && backends > 0 && full == backends;
        let top = work
            .iter()
            .filter(|w| admitting.contains(w.input.vip))
            .map(|w| w.input.class)
            .min()
            .unwrap_or(LOWEST_CLASS);
        // Tenants' shares count whenever every backend is full: configuring tenants asks
        // for their admission, whether or not classes shed.
        let pool_full = backends > 0 && full == backends;
        let mut over_share = false;
        for &vip in &members {
            let of_vip: Vec<(&TenantInput, tenants::Activity)> = tenant_work
                .iter()
                .filter(|(t, _)| t.vip == vip)
                .copied()
                .collect();
            let caps = work
                .iter()
                .filter(|w| w.input.vip == vip && w.eligible)
                .map(|w| w.input.max_sessions);
            let room = tenants::room(pool_full, self.cfg.tenant_busy_fraction, &of_vip, caps);
            let decided = tenants::decide(room, &of_vip);
            over_share |= decided.iter().any(|d| d.over_share);
            out.tenants.extend(decided);
        }
        let period = self.cfg.cooldown_base;
        if let Some(change) = shedder.update(now, all_full, period, top, over_share) {
            let admit = shedder.admit_max();
            let (kind, why) = match change {
                ShedChange::Tighten => (
                    EventKind::ShedStart,
                    format!("all {backends} backends full"),
                ),
                ShedChange::Relax => (
                    EventKind::ShedStop,
                    format!("{} of {backends} backends have room", backends - full),
                ),
            };
            out.events.push(PolicyEvent {
                at: now,
                kind,
                vip: pool.to_owned(),
                backend: None,
                reason: format!("{why}: admitting classes 0..={admit}"),
                telemetry: None,
            });
        }
        for vip in members {
            out.shed.insert(
                vip.to_owned(),
                Shed {
                    admission: admitting.contains(vip),
                    admit_max: shedder.admit_max(),
                    mode: self.cfg.shed.unwrap_or(ShedMode::Drop),
                    full,
                    backends,
                },
            );
        }
    }
}

/// Moves the backend away or back as its trigger and cooldown say, with the events that
/// say so.
fn move_away_or_back(
    m: &mut Memory,
    cfg: &PolicyConfig,
    now: Duration,
    w: &Work,
    events: &mut Vec<PolicyEvent>,
) {
    let event = |kind, reason| backend_event(now, w.input, kind, reason);
    let reason = w.trigger.as_ref().map(|t| t.reason);
    let was = match m.move_away.phase {
        Phase::MovedAway { reason, .. } => Some(reason),
        Phase::InRotation { .. } => None,
    };
    let carrying = m.weight.is_some_and(|w| w > 0);
    match m.move_away.update(now, reason, carrying, cfg) {
        Some(Change::Moved { cooldown, flap }) => {
            let detail = w.trigger.as_ref().map_or("", |t| &t.detail);
            events.push(event(EventKind::Reroute, detail.to_owned()));
            let (kind, why) = if flap {
                (
                    EventKind::CooldownExtend,
                    "moved away again within flap_window",
                )
            } else {
                (EventKind::CooldownStart, "moved away")
            };
            events.push(event(kind, format!("{why}: cooldown {cooldown:?}")));
        }
        Some(Change::Returned { probation }) => {
            // The speed its streams showed under a throttle or congestion is that
            // fault's, and the exporter says it has cleared: measure afresh, or it
            // returns at a reduced weight while the others, full with its share,
            // queue.
            if matches!(was, Some(Reason::Throttling | Reason::Congestion)) {
                m.speed = Speed::new(cfg);
            }
            let detail = if probation {
                format!("cooldown over and signals fine: on probation for {PROBATION:?}")
            } else if m.move_away.ramping() {
                format!(
                    "cooldown over and signals fine: slow start over {:?}",
                    cfg.slow_start
                )
            } else {
                "cooldown over and signals fine: full weight".to_owned()
            };
            events.push(event(EventKind::Recover, detail));
        }
        Some(Change::Cleared) => events.push(event(
            EventKind::Recover,
            "probation over without congestion: full weight".to_owned(),
        )),
        None => {}
    }
}

/// Fresh telemetry says requests wait in the engine's queue.
fn queued(t: Option<&BackendTelemetry>) -> bool {
    t.filter(|t| !t.stale)
        .and_then(|t| t.sample.queue_depth)
        .is_some_and(|q| q >= 1.0)
}
