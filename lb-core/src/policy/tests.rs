//! Scenarios on a simulated clock with scripted telemetry, one step per second.

use std::net::{IpAddr, Ipv4Addr};

use super::*;
use crate::{config::ShedMode, telemetry::Sample};

const S: Duration = Duration::from_secs(1);

pub(crate) fn sample() -> Sample {
    Sample::default()
}

pub(crate) fn telemetry(sample: Sample) -> BackendTelemetry {
    BackendTelemetry {
        sample,
        age: Some(Duration::from_millis(200)),
        stale: false,
        errors: Vec::new(),
    }
}

struct Backend {
    vip: &'static str,
    id: u32,
    /// The accelerator host (its address); VIPs sharing hosts form one admission pool.
    host: u32,
    /// Its VIP's admission class.
    class: u8,
    healthy: bool,
    sessions: u64,
    max_sessions: u32,
    telemetry: Option<BackendTelemetry>,
    /// Cumulative TCP handshakes; `None`: the data plane counts none.
    handshakes: Option<Handshakes>,
}

struct Sim {
    policy: Policy,
    now: Duration,
    backends: Vec<Backend>,
}

impl Sim {
    /// `n` idle backends of weight 100 in VIP "v", telemetry all zero.
    fn new(cfg: PolicyConfig, n: u32) -> Self {
        let backends = (1..=n)
            .map(|id| Backend {
                vip: "v",
                id,
                host: id,
                class: LOWEST_CLASS,
                healthy: true,
                sessions: 0,
                max_sessions: 0,
                telemetry: Some(telemetry(idle())),
                handshakes: None,
            })
            .collect();
        Sim {
            policy: Policy::new(cfg),
            now: Duration::ZERO,
            backends,
        }
    }

    fn sample(&mut self, i: usize) -> &mut Sample {
        &mut self.backends[i].telemetry.as_mut().unwrap().sample
    }

    /// Busy engines (utilisation 100%, as any batching engine with work reads), backend `i`
    /// at KV use `kv[i]` and queue depth `queue[i]`.
    fn engines(&mut self, kv: &[f64], queue: &[f64]) {
        for (i, (&kv, &queue)) in kv.iter().zip(queue).enumerate() {
            let s = self.sample(i);
            s.gpu_util = Some(1.0);
            s.kv_cache = Some(kv);
            s.queue_depth = Some(queue);
        }
    }

    fn step(&mut self) -> Decisions {
        self.step_with_tenants(&[])
    }

    fn step_with_tenants(&mut self, tenants: &[TenantInput]) -> Decisions {
        let inputs: Vec<BackendInput> = self
            .backends
            .iter()
            .map(|b| BackendInput {
                vip: b.vip,
                address: addr(b.host),
                id: b.id,
                weight: 100,
                class: b.class,
                healthy: b.healthy,
                sessions: b.sessions,
                max_sessions: b.max_sessions,
                telemetry: b.telemetry.as_ref(),
                handshakes: b.handshakes,
            })
            .collect();
        let d = self.policy.step_with_tenants(self.now, &inputs, tenants);
        self.now += S;
        d
    }

    /// Steps until `now` reaches `t`; returns every decision made.
    fn run_until(&mut self, t: Duration) -> Vec<Decisions> {
        let mut out = Vec::new();
        while self.now < t {
            out.push(self.step());
        }
        out
    }
}

fn addr(id: u32) -> IpAddr {
    IpAddr::V4(Ipv4Addr::new(10, 0, 0, id as u8))
}

fn idle() -> Sample {
    Sample {
        gpu_util: Some(0.0),
        ecn_rate: Some(0.0),
        ..sample()
    }
}

fn kinds(d: &Decisions, id: u32) -> Vec<EventKind> {
    d.events
        .iter()
        .filter(|e| e.backend == Some(addr(id)))
        .map(|e| e.kind)
        .collect()
}

#[test]
fn congestion_spike_cuts_the_weight_in_one_step() {
    let mut sim = Sim::new(PolicyConfig::default(), 2);
    sim.run_until(5 * S);
    sim.sample(0).ecn_rate = Some(5000.0);
    let d = sim.step();
    let b = &d.backends[0];
    assert_eq!((b.weight, b.state), (0, SteerState::MovedAway));
    assert!(b.moved_away);
    assert_eq!(b.reason, Some(Reason::Congestion));
    assert_eq!(b.cooldown_left, PolicyConfig::default().cooldown_base);
    assert_eq!(
        kinds(&d, 1),
        [
            EventKind::Reroute,
            EventKind::CooldownStart,
            EventKind::WeightChange
        ]
    );
    let reroute = &d.events[0];
    assert_eq!(reroute.reason, "ecn_rate 5000 over 1000");
    assert_eq!(
        reroute.telemetry.as_ref().unwrap()["sample"]["ecn_rate"],
        5000.0
    );
    assert_eq!(d.backends[1].weight, 100);
    assert_eq!(d.weights(), BTreeMap::from([(1, 0), (2, 100)]));
    let json = serde_json::to_value(&d).unwrap();
    assert_eq!(json["backends"][0]["state"], "moved-away");
    assert_eq!(json["backends"][0]["cooldown_left_s"], 10.0);
    assert_eq!(json["events"][0]["kind"], "reroute");
}

/// The most moves away within `span` when every return is followed by a move within
/// `flap_window` and before `stable_period` (so each cooldown doubles): move k comes at
/// least cooldown_1 + ... + cooldown_(k-1) after the first.
fn max_moves(cfg: &PolicyConfig, span: Duration) -> u32 {
    let (mut moves, mut elapsed, mut cooldown) = (1, Duration::ZERO, cfg.cooldown_base);
    while elapsed + cooldown < span {
        elapsed += cooldown;
        cooldown = (cooldown * 2).min(cfg.cooldown_max);
        moves += 1;
    }
    moves
}

#[test]
fn flapping_signal_doubles_the_cooldown_and_bounds_weight_changes() {
    let cfg = PolicyConfig::default();
    let (toggle, span) = (5 * S, 600 * S);
    // Bound: each move is one change (to 0); each stay in rotation lasts under `toggle`, and
    // the weight only rises within it (the score falls, the ramp climbs, probation holds
    // its reduced level through it: `toggle` <= PROBATION), so it takes at most the ramp levels
    // reachable in `toggle`: 1 + (levels - 1) * toggle / slow_start. The signal is
    // congestion, so the first move from probation keeps the base cooldown: one move more.
    let moves = max_moves(&cfg, span) + 1;
    let ramp =
        1 + (cfg.weight_levels - 1) * toggle.as_secs() as u32 / cfg.slow_start.as_secs() as u32;
    let bound = moves * (1 + ramp);
    // base 10s, max 600s: cooldowns 10+10+20+40+80+160 = 320s < 600s, +320s = 640s > 600s.
    assert_eq!((moves, ramp, bound), (7, 2, 21));
    assert!(toggle <= PROBATION);
    assert!(toggle < cfg.flap_window && toggle < cfg.stable_period);

    let mut sim = Sim::new(cfg.clone(), 2);
    sim.run_until(10 * S);
    let start = sim.now;
    let mut decisions = Vec::new();
    while sim.now < start + span {
        let bad = ((sim.now - start).as_secs() / toggle.as_secs()).is_multiple_of(2);
        sim.sample(0).ecn_rate = Some(if bad { 5000.0 } else { 0.0 });
        decisions.push(sim.step());
    }
    let events: Vec<&PolicyEvent> = decisions.iter().flat_map(|d| &d.events).collect();
    let cooldowns: Vec<String> = events
        .iter()
        .filter(|e| matches!(e.kind, EventKind::CooldownStart | EventKind::CooldownExtend))
        .map(|e| e.reason.rsplit(' ').next().unwrap().to_owned())
        .collect();
    assert_eq!(
        cooldowns,
        ["10s", "10s", "20s", "40s", "80s", "160s", "320s"][..cooldowns.len()]
    );
    assert!(cooldowns.len() as u32 <= moves);
    let changes = events
        .iter()
        .filter(|e| e.kind == EventKind::WeightChange)
        .count() as u32;
    let weights: Vec<u32> = decisions.iter().map(|d| d.backends[0].weight).collect();
    let diffs = weights.windows(2).filter(|w| w[0] != w[1]).count() as u32;
    assert_eq!(changes, diffs + u32::from(weights[0] != 100));
    // Without the cooldown each of the 120 toggles would change the weight.
    assert!(changes <= bound, "{changes} weight changes, bound {bound}");
    // The other backend never moves.
    assert!(decisions.iter().all(|d| d.backends[1].weight == 100));
}

#[test]
fn recovery_ramps_linearly_over_slow_start() {
    let cfg = PolicyConfig::default(); // cooldown 10s, slow start 30s, 8 levels
    let mut sim = Sim::new(cfg, 2);
    sim.run_until(5 * S);
    sim.sample(0).throttle = Some(0x40);
    let moved = sim.now;
    assert_eq!(sim.step().backends[0].reason, Some(Reason::Throttling));
    sim.sample(0).throttle = Some(0);
    // Signals fine again, but the cooldown holds it out.
    let out = sim.run_until(moved + 10 * S);
    assert!(out.iter().all(|d| d.backends[0].weight == 0));
    assert_eq!(out.last().unwrap().backends[0].cooldown_left, S);
    let ramp = sim.run_until(moved + 41 * S);
    assert_eq!(kinds(&ramp[0], 1)[0], EventKind::Recover);
    let weights: Vec<u32> = ramp.iter().map(|d| d.backends[0].weight).collect();
    // Level 1 + 7 * t / 30 of 8: 12 at t=0, 25 at 5s, 50 at 15s, 87 at 29s, 100 at 30s.
    assert_eq!(
        [
            weights[0],
            weights[5],
            weights[15],
            weights[29],
            weights[30]
        ],
        [12, 25, 50, 87, 100]
    );
    assert!(weights.windows(2).all(|w| w[0] <= w[1]));
    assert_eq!(ramp[15].backends[0].state, SteerState::SlowStart);
    assert_eq!(ramp[30].backends[0].state, SteerState::Active);
}

#[test]
fn stale_telemetry_is_treated_as_saturated_but_not_down() {
    let mut sim = Sim::new(PolicyConfig::default(), 2);
    sim.run_until(3 * S);
    let t = sim.backends[0].telemetry.as_mut().unwrap();
    t.stale = true;
    t.age = Some(10 * S);
    let d = sim.step();
    let b = &d.backends[0];
    assert_eq!((b.weight, b.state), (0, SteerState::MovedAway));
    assert_eq!(b.reason, Some(Reason::Stale));
    assert_eq!(b.telemetry_age, Some(10 * S));
    // Not down, and not full: a telemetry outage does not shed.
    assert!(!b.full);
    assert!(!d.shed["v"].shedding());
    assert!(!d.events.iter().any(|e| e.kind == EventKind::Down));
}

#[test]
fn noise_within_the_hysteresis_band_changes_no_weight() {
    let noisy = |cfg: PolicyConfig| {
        let mut sim = Sim::new(cfg, 2);
        let mut rng = 0x2545_f491_4f6c_dd1d_u64;
        let mut changes = 0;
        sim.sample(0).kv_cache = Some(0.5);
        sim.sample(1).kv_cache = Some(0.0);
        for _ in 0..1000 {
            let d = sim.step();
            assert_eq!(d.backends[0].state, SteerState::Active);
            changes += kinds(&d, 1).len();
            // kv 0.1..0.75 against an idle backend: pressures 0.125..0.94, relative level
            // 1.5 * (mean + 0.2) / (score + 0.2) * 8 in 7.06..9.7 (capped at 8): never over
            // 0.5 + 0.1 * 8 = 1.3 levels from 8.
            rng ^= rng << 13;
            rng ^= rng >> 7;
            rng ^= rng << 17;
            sim.sample(0).kv_cache = Some(0.1 + 0.65 * (rng % 1000) as f64 / 1000.0);
        }
        changes
    };
    assert_eq!(noisy(PolicyConfig::default()), 0);
    // The band is what holds it: without it the same noise moves the weight, and the
    // level's dwell is what bounds that (one change a minute at most).
    let bare = PolicyConfig {
        hysteresis: 0.0,
        ewma_alpha: 1.0,
        ..PolicyConfig::default()
    };
    let changes = noisy(bare);
    let dwells = (1000 / super::score::LEVEL_DWELL.as_secs() + 1) as usize;
    assert!(changes > 5 && changes <= dwells, "{changes} changes");
}

#[test]
fn never_all_backends_moved_away() {
    let mut sim = Sim::new(PolicyConfig::default(), 4);
    for (i, kv) in [0.7, 0.2, 0.5, 0.1].into_iter().enumerate() {
        sim.sample(i).kv_cache = Some(kv);
    }
    sim.run_until(10 * S);
    // The whole VIP saturated: nobody moves (that would only load the rest harder).
    for i in 0..4 {
        sim.sample(i).kv_cache = Some(0.9);
    }
    for d in sim.run_until(15 * S) {
        assert!(
            d.backends.iter().all(|b| b.state == SteerState::Active),
            "{d:?}"
        );
    }
    for (i, kv) in [0.7, 0.2, 0.5, 0.1].into_iter().enumerate() {
        sim.sample(i).kv_cache = Some(kv);
        sim.sample(i).cnp_rate = Some(1e4);
    }
    let d = sim.step();
    let states: Vec<SteerState> = d.backends.iter().map(|b| b.state).collect();
    // Every backend congested: the least-loaded half (by score) stays in, at a score weight.
    use SteerState::{Guarded, MovedAway};
    assert_eq!(states, [MovedAway, Guarded, MovedAway, Guarded]);
    assert!(d.backends[1].weight > 0 && d.backends[3].weight > 0);
    assert_eq!(d.backends[3].reason, Some(Reason::Congestion));

    // A lone backend with stale telemetry stays in.
    let mut sim = Sim::new(PolicyConfig::default(), 1);
    sim.backends[0].telemetry.as_mut().unwrap().stale = true;
    let d = sim.step();
    assert_eq!((d.backends[0].state, d.backends[0].weight), (Guarded, 100));

    // Down backends do not count: the healthy one stays in.
    let mut sim = Sim::new(PolicyConfig::default(), 2);
    sim.backends[0].healthy = false;
    sim.sample(1).cnp_rate = Some(1e4);
    let d = sim.step();
    assert_eq!(d.backends[0].state, SteerState::Down);
    assert_eq!(d.backends[1].state, Guarded);
}

#[test]
fn down_is_weight_zero_at_once_and_up_enters_slow_start() {
    let mut sim = Sim::new(PolicyConfig::default(), 2);
    sim.run_until(3 * S);
    sim.backends[0].healthy = false;
    let d = sim.step();
    assert_eq!(
        (d.backends[0].state, d.backends[0].weight),
        (SteerState::Down, 0)
    );
    sim.run_until(20 * S);
    sim.backends[0].healthy = true;
    let ramp = sim.run_until(51 * S);
    let weights: Vec<u32> = ramp.iter().map(|d| d.backends[0].weight).collect();
    assert_eq!((weights[0], weights[15], weights[30]), (12, 50, 100));
}

#[test]
fn admission_marks_full_backends_and_sheds_the_lowest_priority_first() {
    let cfg = PolicyConfig {
        shed: Some(ShedMode::Rst),
        ..PolicyConfig::default()
    };
    let period = cfg.cooldown_base;
    let mut sim = Sim::new(cfg, 4);
    // "v" (class 7) on hosts 1 and 2, "premium" (class 0) on the same hosts: one pool.
    for (b, (vip, host, class)) in sim.backends.iter_mut().zip([
        ("v", 1, LOWEST_CLASS),
        ("v", 2, LOWEST_CLASS),
        ("premium", 1, 0),
        ("premium", 2, 0),
    ]) {
        (b.vip, b.host, b.class) = (vip, host, class);
        b.max_sessions = 10;
        b.sessions = 10;
    }
    sim.backends[1].sessions = 9;
    let d = sim.step();
    assert_eq!(
        d.backends.iter().map(|b| b.full).collect::<Vec<_>>(),
        [true, false, true, true]
    );
    assert!(!d.shed["v"].shedding());

    // Full pool: class 7 first, then one more class per period, class 0 never.
    sim.backends[1].sessions = 10;
    let out = sim.run_until(sim.now + 10 * period);
    let admit: Vec<u8> = out.iter().map(|d| d.shed["v"].admit_max).collect();
    assert_eq!(admit[0], 6);
    assert_eq!(admit[10], 5);
    assert_eq!(admit[20], 4);
    assert_eq!(*admit.last().unwrap(), 0);
    let shed = &out[10].shed["v"];
    assert!(shed.sheds(7) && shed.sheds(6) && !shed.sheds(5));
    assert_eq!(shed.mode, ShedMode::Rst);
    let starts = out
        .iter()
        .flat_map(|d| &d.events)
        .filter(|e| e.kind == EventKind::ShedStart);
    assert_eq!(starts.count(), 7);
    assert_eq!(
        out[0].events[0].reason,
        "all 4 backends full: admitting classes 0..=6"
    );

    // Room again: highest priority readmitted first, one class per period.
    sim.backends[0].sessions = 3;
    sim.backends[2].sessions = 3;
    let out = sim.run_until(sim.now + 8 * period);
    let admit: Vec<u8> = out.iter().map(|d| d.shed["v"].admit_max).collect();
    assert_eq!((admit[9], admit[10], admit[20]), (0, 1, 2));
    assert_eq!(*admit.last().unwrap(), LOWEST_CLASS);
    let stops = out
        .iter()
        .flat_map(|d| &d.events)
        .filter(|e| e.kind == EventKind::ShedStop);
    assert_eq!(stops.count(), 7);
}

#[test]
fn telemetry_saturation_never_sheds_a_vip_without_admission() {
    // Every backend at KV 0.9 for a minute: full (probed past), and with `policy.shed`
    // unset and no session cap the VIP sheds nothing, so no SYN is refused for it.
    let mut sim = Sim::new(PolicyConfig::default(), 3);
    for i in 0..3 {
        sim.sample(i).kv_cache = Some(0.9);
    }
    let out = sim.run_until(60 * S);
    for (t, d) in out.iter().enumerate() {
        assert!(d.backends.iter().all(|b| b.full));
        assert!(!d.shed["v"].sheds(LOWEST_CLASS), "shed at {t} s");
        assert!(!d.shed["v"].shedding());
    }
    let sheds = out.iter().flat_map(|d| &d.events);
    assert_eq!(sheds.filter(|e| e.kind == EventKind::ShedStart).count(), 0);

    // The same fleet with shedding configured has admission (a SYN finding only full
    // backends is refused)...
    let cfg = PolicyConfig {
        shed: Some(ShedMode::Drop),
        ..PolicyConfig::default()
    };
    let mut sim = Sim::new(cfg, 3);
    for i in 0..3 {
        sim.sample(i).kv_cache = Some(0.9);
    }
    let d = sim.step();
    assert!(d.shed["v"].admission);
    // ...and so does one with a session cap on a backend, though none is reached.
    let mut sim = Sim::new(PolicyConfig::default(), 3);
    for i in 0..3 {
        sim.sample(i).kv_cache = Some(0.9);
    }
    sim.backends[0].max_sessions = 100;
    let d = sim.step();
    assert!(d.shed["v"].admission);
}

#[test]
fn a_lone_class_is_refused_session_by_session_never_shed_whole() {
    // An overload: one class-7 VIP with admission, every backend full now and then. Shedding
    // the class would refuse every new session for `cooldown_base` and more while the fleet
    // drains (its accelerators idle for half of that): with no higher class to take the room,
    // only the sessions that find every backend full are refused, by the data plane.
    let cfg = PolicyConfig {
        shed: Some(ShedMode::Rst),
        ..PolicyConfig::default()
    };
    let mut sim = Sim::new(cfg, 4);
    for b in &mut sim.backends {
        b.max_sessions = 24;
        b.sessions = 24;
    }
    let out = sim.run_until(60 * S);
    for (t, d) in out.iter().enumerate() {
        let shed = &d.shed["v"];
        assert!(shed.admission && shed.full == 4, "at {t} s: {shed:?}");
        assert!(!shed.sheds(LOWEST_CLASS), "class 7 shed whole at {t} s");
    }
    let events = out.iter().flat_map(|d| &d.events);
    assert_eq!(events.filter(|e| e.kind == EventKind::ShedStart).count(), 0);
}

#[test]
fn a_session_cap_counts_the_engines_requests_not_finished_flows() {
    // Under overload the connection table counts 26-31 flows per backend (streams that ended
    // within flow_idle_timeout among them) while the engines run 9-16 requests with 0-4
    // waiting. Counting flows against a cap of 24 would read every backend full and refuse
    // new sessions while the engines have room.
    let cfg = PolicyConfig {
        shed: Some(ShedMode::Rst),
        ..PolicyConfig::default()
    };
    let mut sim = Sim::new(cfg, 4);
    for (i, (table, running, waiting)) in [
        (26, 9.0, 0.0),
        (29, 14.0, 0.0),
        (27, 16.0, 4.0),
        (31, 16.0, 1.0),
    ]
    .into_iter()
    .enumerate()
    {
        sim.backends[i].max_sessions = 24;
        sim.backends[i].sessions = table;
        let s = sim.sample(i);
        (s.running, s.queue_depth, s.kv_cache) = (Some(running), Some(waiting), Some(0.6));
    }
    let out = sim.run_until(30 * S);
    for d in &out {
        assert_eq!(d.shed["v"].full, 0, "{:?}", d.shed["v"]);
    }
    // The engines fill up: running and waiting reach the cap, and the backend is full.
    let s = sim.sample(1);
    (s.running, s.queue_depth) = (Some(16.0), Some(4.0));
    sim.backends[1].sessions = 24;
    // 20 of 24: room still.
    assert!(!sim.step().backends[1].full);
    sim.sample(1).running = Some(20.0);
    assert!(sim.step().backends[1].full);
}

#[test]
fn vips_sharing_hosts_are_one_pool_and_its_lower_classes_are_shed_first() {
    let cfg = PolicyConfig::default();
    let period = cfg.cooldown_base;
    let mut sim = Sim::new(cfg, 5);
    // "premium" (class 0) and "free" (class 5) on hosts 1 and 2; "other" alone on host 5.
    for (b, (vip, host)) in sim.backends.iter_mut().zip([
        ("premium", 1),
        ("premium", 2),
        ("free", 1),
        ("free", 2),
        ("other", 5),
    ]) {
        b.vip = vip;
        b.host = host;
        b.class = match vip {
            "premium" => 0,
            "free" => 5,
            _ => LOWEST_CLASS,
        };
        b.max_sessions = 4;
        b.sessions = if vip == "other" { 0 } else { 4 };
    }
    let out = sim.run_until(sim.now + 4 * period);
    let last = out.last().unwrap();
    // One shedder for the pool: both VIPs see the same level; the free tier (class 5) is
    // shed once the level drops below 5, the premium tier (class 0) never.
    assert_eq!(last.shed["premium"].admit_max, last.shed["free"].admit_max);
    assert_eq!(
        last.shed["free"].backends, 4,
        "the pool counts both VIPs' backends"
    );
    let first_free_shed = out.iter().position(|d| d.shed["free"].sheds(5)).unwrap();
    assert!(out.iter().all(|d| !d.shed["premium"].sheds(0)));
    assert!(first_free_shed > 0, "class 7 goes first, class 5 later");
    assert!(
        out.iter().all(|d| !d.shed["other"].shedding()),
        "another pool is not affected"
    );
    let starts: Vec<&str> = out
        .iter()
        .flat_map(|d| &d.events)
        .filter(|e| e.kind == EventKind::ShedStart)
        .map(|e| e.vip.as_str())
        .collect();
    assert!(starts.iter().all(|v| *v == "free+premium"), "{starts:?}");
}

/// xorshift64: noise that is the same on every run.
fn noise(rng: &mut u64) -> f64 {
    *rng ^= *rng << 13;
    *rng ^= *rng >> 7;
    *rng ^= *rng << 17;
    (*rng % 10_000) as f64 / 10_000.0
}

/// The three healthy backends fill up while carrying a throttled one's share; the throttled
/// one, emptied, has the lowest score. Saturated together they stay in; when they all want
/// out too (congested), the guard keeps two of them, not the throttled one.
#[test]
fn guard_keeps_the_saturated_in_and_the_throttled_out() {
    let mut sim = Sim::new(PolicyConfig::default(), 4);
    for i in 0..4 {
        sim.sample(i).kv_cache = Some(0.5);
    }
    sim.run_until(10 * S);
    sim.sample(0).throttle = Some(0x20);
    let d = sim.step();
    assert_eq!(d.backends[0].reason, Some(Reason::Throttling));
    // It empties while the others fill up past kv_cache_high.
    sim.sample(0).kv_cache = Some(0.0);
    sim.run_until(20 * S);
    for i in 1..4 {
        sim.sample(i).kv_cache = Some(0.9);
    }
    // The others have no headroom: it keeps a reduced weight (a quarter), never the
    // guard's score weight, and counts as full while anything waits in its queue.
    for d in sim.run_until(30 * S) {
        let b = &d.backends[0];
        assert_eq!((b.state, b.weight), (SteerState::MovedAway, 25), "{b:?}");
        assert!(!b.full);
        assert!(d.backends[1..].iter().all(|b| b.weight > 0), "{d:?}");
    }
    sim.sample(0).queue_depth = Some(1.0);
    assert!(sim.step().backends[0].full);
    sim.sample(0).queue_depth = Some(0.0);
    for i in 1..4 {
        sim.sample(i).ecn_rate = Some(5000.0);
    }
    for d in sim.run_until(40 * S) {
        let b = &d.backends[0];
        assert_eq!((b.state, b.weight), (SteerState::MovedAway, 25), "{b:?}");
        let guarded = d
            .backends
            .iter()
            .filter(|b| b.state == SteerState::Guarded && b.weight > 0)
            .count();
        assert_eq!(guarded, 2, "half the VIP, rounded up, stays in");
    }
}

/// When every backend of a VIP would be out, the guard keeps in first those whose trigger is
/// softest: a backend its peers' in-band readings call slow goes back before a congested one,
/// and a throttled one, whose exporters still say so, stays out. An emptied throttled
/// backend has the lowest score, so by score alone it would be the first kept in.
#[test]
fn guard_keeps_the_slow_in_before_the_throttled() {
    let mut sim = Sim::new(PolicyConfig::default(), 3);
    for i in 0..3 {
        let s = sim.sample(i);
        s.kv_cache = Some(0.3);
        s.ttfb_s = Some(0.4);
        s.delivery_bps = Some(8000.0);
        s.load_bps = Some(200_000.0);
    }
    sim.run_until(10 * S);
    sim.sample(1).delivery_bps = Some(2000.0);
    assert_eq!(sim.step().backends[1].reason, Some(Reason::Slow));
    sim.sample(0).throttle = Some(0x20);
    sim.sample(0).kv_cache = Some(0.0);
    sim.sample(2).ecn_rate = Some(5000.0);
    sim.step();
    for d in sim.run_until(30 * S) {
        let states: Vec<SteerState> = d.backends.iter().map(|b| b.state).collect();
        assert_eq!(
            states,
            [
                SteerState::MovedAway,
                SteerState::Guarded,
                SteerState::Guarded
            ],
            "{d:?}"
        );
    }
}

/// In-band readings at equal load, backend `slow` (index) streaming at `slow_bps` and the
/// others at 8000 B/s.
fn in_band(sim: &mut Sim, slow: usize, slow_bps: f64) {
    for i in 0..sim.backends.len() {
        let s = sim.sample(i);
        s.kv_cache = Some(0.3);
        s.ttfb_s = Some(0.4);
        s.delivery_bps = Some(if i == slow { slow_bps } else { 8000.0 });
        s.load_bps = Some(200_000.0);
    }
}

/// The times of `id`'s moves away and of its undone moves.
fn moves_and_undos(ds: &[Decisions], id: u32) -> (Vec<u64>, Vec<u64>) {
    let (mut moves, mut undos) = (Vec::new(), Vec::new());
    for e in ds.iter().flat_map(|d| &d.events) {
        if e.backend != Some(addr(id)) {
            continue;
        }
        match e.kind {
            EventKind::Reroute => moves.push(e.at.as_secs()),
            EventKind::Recover if e.reason.contains("did not help") => undos.push(e.at.as_secs()),
            _ => {}
        }
    }
    (moves, undos)
}

/// Moving a backend away as slow must raise its VIP's delivery rate; here nothing changes
/// when it goes (as when its share only slows the peers that take it). The move is undone
/// after 20 s, before its cooldown ends, and the backend is not moved as slow again for 60 s,
/// then 120 s.
#[test]
fn an_in_band_move_that_does_not_help_is_undone_and_held() {
    // A cooldown longer than the verdict's wait: the undo ends it early.
    let cfg = PolicyConfig {
        cooldown_base: 30 * S,
        ..PolicyConfig::default()
    };
    let mut sim = Sim::new(cfg, 4);
    in_band(&mut sim, 0, 3000.0);
    let ds = sim.run_until(300 * S);
    let (moves, undos) = moves_and_undos(&ds, 1);
    assert_eq!(moves, [0, 80, 220]);
    assert_eq!(undos, [20, 100, 240]);
    let undo = ds[20]
        .events
        .iter()
        .find(|e| e.kind == EventKind::Recover)
        .unwrap();
    assert_eq!(
        undo.reason,
        "moving it away as slow did not help: its VIP delivered 5647 B/s per stream before, \
         5647 B/s after; back now, and not moved as slow again for 60s"
    );
}

/// A move that does help stands: the slow backend's streams end once it is out, and the
/// VIP's rate rises with them.
#[test]
fn an_in_band_move_that_helps_stands() {
    let mut sim = Sim::new(PolicyConfig::default(), 4);
    in_band(&mut sim, 0, 3000.0);
    let mut ds = sim.run_until(5 * S);
    // Its last streams: a tenth of its work left.
    sim.sample(0).load_bps = Some(20_000.0);
    ds.extend(sim.run_until(60 * S));
    let (moves, undos) = moves_and_undos(&ds, 1);
    assert_eq!((moves, undos), (vec![0], vec![]));
    assert!(ds.last().unwrap().backends[0].state == SteerState::MovedAway);
}

/// Every loaded batching engine reports ~100% utilisation, so the weights must tell the more
/// loaded backend from the others by queue and KV use.
#[test]
fn weights_follow_relative_load_not_utilisation() {
    let mut sim = Sim::new(PolicyConfig::default(), 4);
    sim.engines(&[0.08, 0.08, 0.08, 0.3], &[0.0, 0.0, 0.0, 4.0]);
    let d = sim.run_until(10 * S).pop().unwrap();
    let weights: Vec<u32> = d.backends.iter().map(|b| b.weight).collect();
    // Pressure 0.8 against 0.1: 1.5 * (0.275 + 0.2) / (0.8 + 0.2) * 8 = 5.7 levels.
    assert_eq!(weights, [100, 100, 100, 75]);
    assert!(d.backends.iter().all(|b| b.state == SteerState::Active));
    // Without engine metrics, utilisation still tells an idle GPU from a busy one: busy
    // (0.5) among three idle ones, 1.5 * (0.125 + 0.2) / (0.5 + 0.2) * 8 = 5.6 levels.
    let mut sim = Sim::new(PolicyConfig::default(), 4);
    sim.sample(0).gpu_util = Some(1.0);
    let d = sim.run_until(10 * S).pop().unwrap();
    assert!(d.backends[0].weight < d.backends[1].weight, "{d:?}");
}

/// At light load the source hash's unevenness at 25% load (one engine at KV 0.38, the others
/// at 0.03, nothing queued) is no reason to remap clients, however many times the mean it
/// reads; past headroom the same backend gets less weight.
#[test]
fn a_backend_with_room_keeps_full_weight_however_little_the_others_carry() {
    let mut sim = Sim::new(PolicyConfig::default(), 4);
    sim.engines(&[0.03, 0.03, 0.03, 0.38], &[0.0; 4]);
    // Pressure 0.475 against a mean of 0.147: 1.5 * (0.147 + 0.2) / (0.475 + 0.2) * 8 =
    // 6.2 levels, which the old rule applied.
    for d in sim.run_until(180 * S) {
        assert_eq!(d.weights().values().max(), Some(&100), "{d:?}");
        assert_eq!(d.weights().values().min(), Some(&100), "{d:?}");
    }
    // KV 0.6 (pressure 0.75): as its score passes 0.5, 1.5 * (0.153 + 0.2) / (0.5 + 0.2)
    // * 8 = 6.05 levels; at 0.75, 5.3 is within the hysteresis band of 6.
    sim.sample(3).kv_cache = Some(0.6);
    let d = sim.run_until(240 * S).pop().unwrap();
    assert_eq!(
        d.weights(),
        BTreeMap::from([(1, 100), (2, 100), (3, 100), (4, 75)])
    );
}

/// An idle GPU at room temperature is idle; temperature matters only past its limit, as
/// throttling.
#[test]
fn temperature_sets_no_floor_and_counts_only_over_its_limit() {
    let mut sim = Sim::new(PolicyConfig::default(), 2);
    for i in 0..2 {
        sim.sample(i).gpu_temp_c = Some(45.0);
    }
    sim.sample(1).gpu_temp_c = Some(80.0);
    for d in sim.run_until(10 * S) {
        assert_eq!(d.weights(), BTreeMap::from([(1, 100), (2, 100)]));
    }
    sim.sample(1).gpu_temp_c = Some(86.0);
    let d = sim.step();
    assert_eq!(d.backends[1].state, SteerState::MovedAway);
    assert_eq!(d.backends[1].reason, Some(Reason::Throttling));
}

/// A healthy fleet at about 65% load for ten minutes (noisy KV, queue, utilisation and
/// temperature, and now and then one scrape with a burst over the saturation thresholds)
/// moves nobody away and changes each weight at most 12 times; a real slowdown still moves
/// its backend away within 2 s.
#[test]
fn healthy_fleet_does_not_churn_and_a_slowdown_moves_within_two_seconds() {
    let mut sim = Sim::new(PolicyConfig::default(), 4);
    let mut rng = 0x9e37_79b9_7f4a_7c15_u64;
    let mut decisions = Vec::new();
    let mut bursts = 0;
    while sim.now < 600 * S {
        for i in 0..4 {
            let s = sim.sample(i);
            s.gpu_util = Some(0.6 + 0.4 * noise(&mut rng));
            s.gpu_temp_c = Some(55.0 + 20.0 * noise(&mut rng));
            s.kv_cache = Some(0.3 + 0.35 * noise(&mut rng));
            s.queue_depth = Some((3.0 * noise(&mut rng)).floor());
        }
        // A one-scrape burst on some backend about every 15 s.
        if noise(&mut rng) < 1.0 / 15.0 {
            let i = (noise(&mut rng) * 4.0) as usize;
            sim.sample(i).queue_depth = Some(6.0);
            sim.sample(i).kv_cache = Some(0.82);
            bursts += 1;
        }
        decisions.push(sim.step());
    }
    assert!(bursts > 24, "{bursts} bursts: the test must exercise them");
    let events: Vec<&PolicyEvent> = decisions.iter().flat_map(|d| &d.events).collect();
    let reroutes = events
        .iter()
        .filter(|e| e.kind == EventKind::Reroute)
        .count();
    assert_eq!(reroutes, 0, "a one-scrape burst is no reason to move");
    for id in 1..=4 {
        let changes = events
            .iter()
            .filter(|e| e.kind == EventKind::WeightChange && e.backend == Some(addr(id)))
            .count();
        assert!(
            changes <= 12,
            "backend {id}: {changes} weight changes in 10 minutes"
        );
    }
    // A real slowdown: backend 1's queue and KV stay high. The data plane probes past it
    // from the first step (full), and while the others have room it moves away within two
    // steps (2 s).
    sim.sample(0).kv_cache = Some(0.9);
    sim.sample(0).queue_depth = Some(8.0);
    for i in 1..4 {
        sim.sample(i).kv_cache = Some(0.3);
        sim.sample(i).queue_depth = Some(0.0);
    }
    let out = [sim.step(), sim.step()];
    assert!(out[0].backends[0].full);
    assert_eq!(out[1].backends[0].state, SteerState::MovedAway);
    assert_eq!(out[1].backends[0].reason, Some(Reason::Saturation));
    // Throttling: out at the first step.
    sim.sample(1).throttle = Some(0x40);
    assert_eq!(sim.step().backends[1].state, SteerState::MovedAway);
}

/// A throttled fleet near saturation: moving the throttled backend's whole share onto the
/// others, then a saturated one's, then ramping the throttled one back over 30 s, would
/// saturate them all (a p99 time to first token about twice Maglev's). With headroom a
/// throttled backend goes to weight 0 and a saturated one moves; without it the throttled one
/// keeps a quarter of its weight, nobody moves for saturation, and returns skip the ramp.
#[test]
fn without_headroom_a_sick_backend_keeps_a_part_and_saturation_moves_nobody() {
    let run = |others_kv: f64| {
        let mut sim = Sim::new(PolicyConfig::default(), 4);
        for i in 0..4 {
            sim.sample(i).kv_cache = Some(others_kv);
        }
        sim.run_until(10 * S);
        sim.sample(0).throttle = Some(0x20);
        sim.run_until(12 * S);
        let d = sim.step();
        // One of the others saturates while the throttled one is out.
        sim.sample(1).kv_cache = Some(0.95);
        sim.sample(1).queue_depth = Some(8.0);
        let later = sim.run_until(16 * S);
        (d, later, sim)
    };
    // Room elsewhere (mean pressure 0.25): weight 0; the throttled one being out, the
    // saturated one stays in (one move at a time) and the data plane probes past it.
    let (d, later, _) = run(0.2);
    assert_eq!(
        (d.backends[0].state, d.backends[0].weight),
        (SteerState::MovedAway, 0)
    );
    let last = later.last().unwrap();
    assert_eq!(last.backends[1].state, SteerState::Active);
    assert!(last.backends[1].full);
    // No room (mean pressure 0.75): a quarter of its weight, and no ramp on its return.
    let (d, later, mut sim) = run(0.6);
    assert_eq!(
        (d.backends[0].state, d.backends[0].weight),
        (SteerState::MovedAway, 25)
    );
    assert!(later
        .iter()
        .all(|d| d.backends[1].state == SteerState::Active));
    sim.sample(0).throttle = Some(0);
    let back = sim.run_until(40 * S);
    let first = back
        .iter()
        .find(|d| d.backends[0].state != SteerState::MovedAway)
        .expect("returned after its cooldown");
    assert_eq!(first.backends[0].state, SteerState::Active);
    assert_eq!(
        first.backends[0].weight, 100,
        "no slow start without headroom"
    );
}

/// In `cargo xtask demo` the backend alone in rotation while gpu1 is throttled reads pressure
/// 0.48-0.56 scrape by scrape, and each reading over or under `HEADROOM` could flip gpu1
/// between weight 0 and a quarter. Here the one in rotation reads as much (0.52, +-8%) while
/// it carries the throttled one's share, and sheds a fifth of it while that one has a quarter
/// of its weight: the quarter must hold while the load does, and go only once the load really
/// falls. Both halves are needed: without the band the noise at weight 0 flips it, without
/// counting the quarter as the others' load the noise under it does.
#[test]
fn a_throttled_backends_reduced_weight_holds_while_its_share_tips_the_others_over_headroom() {
    let mut sim = Sim::new(PolicyConfig::default(), 2);
    let mut rng = 0x2545_f491_4f6c_dd1d_u64;
    let mut throttled_weight = 100;
    // Backend 2 carries `load`, less what backend 1's ring share takes, within +-8%. Returns
    // backend 1's weights and the reasons its weight changes gave.
    let mut run = |sim: &mut Sim, load: f64, until: Duration| {
        let (mut weights, mut reasons) = (Vec::new(), Vec::new());
        while sim.now < until {
            let share = 100.0 / (100.0 + f64::from(throttled_weight));
            let pressure = load * share * (0.92 + 0.16 * noise(&mut rng));
            sim.sample(1).kv_cache = Some(0.8 * pressure);
            let d = sim.step();
            throttled_weight = d.backends[0].weight;
            weights.push(throttled_weight);
            reasons.extend(
                d.events
                    .into_iter()
                    .filter(|e| e.backend == Some(addr(1)) && e.kind == EventKind::WeightChange)
                    .map(|e| e.reason),
            );
        }
        (weights, reasons)
    };
    sim.sample(0).kv_cache = Some(0.3);
    run(&mut sim, 0.52, 10 * S);
    sim.sample(0).throttle = Some(0x48);
    let (weights, reasons) = run(&mut sim, 0.52, 70 * S);
    // Out at the first step.
    assert_eq!(weights[0], 0);
    let changes = |w: &[u32]| w.windows(2).filter(|w| w[0] != w[1]).count();
    assert_eq!(
        (changes(&weights), *weights.last().unwrap()),
        (1, 25),
        "one change, to a quarter, in a minute: {weights:?}"
    );
    // Each change says why a backend that is out has weight, and why it loses it.
    assert!(
        reasons[1].ends_with("no headroom for its share)"),
        "{reasons:?}"
    );
    // The others' load falls for real (0.25 with its share on them): all of it goes.
    let (later, reasons) = run(&mut sim, 0.25, 80 * S);
    let weights = [vec![25], later].concat();
    assert_eq!(
        (changes(&weights), *weights.last().unwrap()),
        (1, 0),
        "{weights:?}"
    );
    assert!(
        reasons[0].ends_with("headroom for its share again)"),
        "{reasons:?}"
    );
}

/// ECN marks count the traffic a backend carries, so a congested backend, once emptied, reads
/// clear; returned into the congestion after its cooldown and moved away again on a doubled
/// cooldown (a flap), it would come back long after the fabric has cleared. Back from
/// congestion it takes a reduced share on probation instead: congestion seen then sends it
/// out for `cooldown_base` again (no doubling), and a clean probation restores full weight.
#[test]
fn a_congested_backend_returns_on_probation_and_is_not_flapped_for_marks_it_cannot_show_empty() {
    let cfg = PolicyConfig::default(); // cooldown 10s, 8 levels
    let mut sim = Sim::new(cfg.clone(), 4);
    for i in 0..4 {
        sim.sample(i).kv_cache = Some(0.4); // pressure 0.5: the others have headroom
    }
    sim.run_until(10 * S);
    let (fault, clear) = (10 * S, 30 * S);
    // Its streams finish within 3 s of its weight going to 0.
    let mut weights = vec![100; 3];
    let mut decisions = Vec::new();
    while sim.now < 80 * S {
        let carries = weights[weights.len() - 3..].iter().any(|&w| w > 0);
        let marked = (fault..clear).contains(&sim.now) && carries;
        sim.sample(0).ecn_rate = Some(if marked { 5000.0 } else { 0.0 });
        let d = sim.step();
        weights.push(d.backends[0].weight);
        decisions.push(d);
    }
    let events: Vec<&PolicyEvent> = decisions.iter().flat_map(|d| &d.events).collect();
    let cooldowns: Vec<(EventKind, &str)> = events
        .iter()
        .filter(|e| matches!(e.kind, EventKind::CooldownStart | EventKind::CooldownExtend))
        .map(|e| (e.kind, e.reason.as_str()))
        .collect();
    assert!(cooldowns.len() >= 2, "{cooldowns:?}");
    assert!(
        cooldowns
            .iter()
            .all(|&c| c == (EventKind::CooldownStart, "moved away: cooldown 10s")),
        "congestion seen on probation is no flap: {cooldowns:?}"
    );
    // Back within cooldown_base + PROBATION of the fabric clearing, at full weight, to stay.
    let back = clear + cfg.cooldown_base + PROBATION;
    for (t, d) in (10..).map(|s| s * S).zip(&decisions) {
        let b = &d.backends[0];
        if t > fault && t < clear {
            assert!(b.weight <= 25, "at {t:?}: {b:?}");
        }
        if b.weight > 0 && b.weight < 100 {
            assert_eq!((b.weight, b.state), (25, SteerState::SlowStart), "at {t:?}");
        }
        if t >= back {
            assert_eq!((b.weight, b.state), (100, SteerState::Active), "at {t:?}");
        }
    }
}

/// Without headroom a congested backend keeps a quarter of its weight while out, so it
/// carries traffic and its fabric's marks show: its clear reading at the end of its cooldown
/// is evidence, and it returns at full weight at once, without probation. On probation it
/// would serve a quarter for 5 s more while the others, with no headroom, queue.
#[test]
fn a_congested_backend_that_carried_traffic_while_out_returns_at_full_weight() {
    let cfg = PolicyConfig::default(); // cooldown 10s, 8 levels
    let mut sim = Sim::new(cfg.clone(), 4);
    for i in 0..4 {
        sim.sample(i).kv_cache = Some(0.6); // pressure 0.75: no headroom
    }
    sim.run_until(10 * S);
    let (fault, clear) = (10 * S, 30 * S);
    let mut weight = 100;
    let mut decisions = Vec::new();
    while sim.now < 45 * S {
        let marked = (fault..clear).contains(&sim.now) && weight > 0;
        sim.sample(0).ecn_rate = Some(if marked { 5000.0 } else { 0.0 });
        let d = sim.step();
        weight = d.backends[0].weight;
        decisions.push(d);
    }
    for (t, d) in (10..).map(|s| s * S).zip(&decisions) {
        let b = &d.backends[0];
        if t > fault && t < clear {
            assert_eq!((b.weight, b.state), (25, SteerState::MovedAway), "at {t:?}");
        }
        if t >= clear {
            assert_eq!((b.weight, b.state), (100, SteerState::Active), "at {t:?}");
        }
    }
    let recovered: Vec<&str> = decisions
        .iter()
        .flat_map(|d| &d.events)
        .filter(|e| e.kind == EventKind::Recover)
        .map(|e| e.reason.as_str())
        .collect();
    assert_eq!(recovered, ["cooldown over and signals fine: full weight"]);
}

/// A `heterogeneous` fleet: a half-speed accelerator reports the same KV and queue as a busy
/// healthy one, and only its time per output token tells them apart. It gets about half
/// weight at the first scrape that shows it (not a move away), keeps it while it generates
/// nothing (no evidence is not evidence), and returns to full weight once it is as fast as
/// the others; per-token noise on a healthy fleet changes nothing.
#[test]
fn a_half_speed_backend_gets_half_weight_from_its_time_per_output_token() {
    let mut sim = Sim::new(PolicyConfig::default(), 4);
    let loaded = |s: &mut Sample, tpot: Option<f64>| {
        s.kv_cache = Some(0.6);
        s.queue_depth = Some(1.0);
        s.tpot_s = tpot;
    };
    for i in 0..4 {
        loaded(sim.sample(i), None);
    }
    sim.run_until(5 * S);
    for i in 0..4 {
        loaded(sim.sample(i), Some(if i == 0 { 0.040 } else { 0.0205 }));
    }
    let d = sim.step();
    assert_eq!(d.backends[0].weight, 50, "{:?}", d.backends[0]);
    assert_eq!(d.backends[0].state, SteerState::Active);
    assert_eq!(kinds(&d, 1), [EventKind::WeightChange]);
    for b in &d.backends[1..] {
        assert_eq!(b.weight, 100);
    }
    // No token in an interval: the estimate stands.
    sim.sample(0).tpot_s = None;
    for d in sim.run_until(sim.now + 10 * S) {
        assert_eq!(d.backends[0].weight, 50);
    }
    // As fast as the others again: full weight within a few scrapes (the estimate is an
    // EWMA), no dwell.
    sim.sample(0).tpot_s = Some(0.0205);
    let back = sim
        .run_until(sim.now + 10 * S)
        .iter()
        .position(|d| d.backends[0].weight == 100);
    assert!(matches!(back, Some(0..=6)), "{back:?}");

    // A healthy fleet whose per-token times wander between idle and a full batch with
    // prefill chunks (17.8 to 24 ms) changes no weight in 10 minutes.
    let mut sim = Sim::new(PolicyConfig::default(), 4);
    let mut rng = 0x2545_f491_4f6c_dd1d_u64;
    let mut changes = 0;
    while sim.now < 600 * S {
        for i in 0..4 {
            let busy = noise(&mut rng);
            loaded(sim.sample(i), Some(0.0178 + 0.0062 * busy));
            if noise(&mut rng) < 0.1 {
                sim.sample(i).tpot_s = None;
            }
        }
        changes += sim.step().events.len();
    }
    assert_eq!(changes, 0);
}

/// A throttled backend's streams run slow while it is moved away; once the throttle clears
/// and it returns, that speed is the fault's, not the hardware's: it returns at its full
/// level rather than the speed level its throttled tokens earned.
#[test]
fn a_backend_back_from_a_throttle_forgets_the_speed_it_showed_under_it() {
    let cfg = PolicyConfig::default();
    let mut sim = Sim::new(cfg.clone(), 4);
    for i in 0..4 {
        sim.sample(i).tpot_s = Some(0.020);
    }
    sim.run_until(5 * S);
    // Throttled to 0.4x: out at once, its remaining streams at 2.5x the others.
    sim.sample(0).throttle = Some(0x48);
    sim.sample(0).tpot_s = Some(0.050);
    let d = sim.step();
    assert_eq!(d.backends[0].state, SteerState::MovedAway);
    sim.run_until(sim.now + 5 * S);
    // The throttle clears; its streams finished while it was out: no new reading.
    sim.sample(0).throttle = Some(0);
    sim.sample(0).tpot_s = None;
    let back = sim
        .run_until(sim.now + cfg.cooldown_base + 2 * S)
        .into_iter()
        .find(|d| d.backends[0].state != SteerState::MovedAway)
        .expect("returns after its cooldown");
    assert!(back.backends[0].weight > 0, "{:?}", back.backends[0]);
    sim.run_until(sim.now + cfg.slow_start + S);
    assert_eq!(sim.step().backends[0].weight, 100);
}

/// Affinity: a conversation's next turn carries its whole prefix, cached on the backend of
/// its earlier turns, so a backend busy but healthy (full by saturation, or moved away for
/// it) keeps its conversations' later turns. The operator's cap, a fault, a down backend or a
/// queue breaks affinity; a full KV cache alone only steers new clients away.
#[test]
fn saturation_keeps_a_conversations_affinity_and_the_cap_faults_down_and_a_queue_break_it() {
    let mut sim = Sim::new(PolicyConfig::default(), 5);
    for i in 0..5 {
        sim.sample(i).kv_cache = Some(0.3);
    }
    sim.run_until(10 * S);
    // Saturated while the others have room: full at once, moved away (weight 0, new clients
    // go elsewhere) after two scrapes, and its clients' next turns still find it while it
    // admits at once.
    sim.sample(0).kv_cache = Some(0.9);
    sim.sample(0).queue_depth = Some(0.0);
    let full = &sim.step().backends[0];
    assert!(
        full.full && !full.capped && !full.breaks_affinity,
        "{full:?}"
    );
    let moved = &sim.step().backends[0];
    assert_eq!(
        (moved.state, moved.reason, moved.weight),
        (SteerState::MovedAway, Some(Reason::Saturation), 0)
    );
    assert!(moved.full && !moved.capped && !moved.breaks_affinity);
    // Once requests wait there, a next turn would wait too: it goes where the ring says.
    sim.sample(0).queue_depth = Some(2.0);
    let queued = &sim.step().backends[0];
    assert!(queued.full && queued.breaks_affinity, "{queued:?}");
    sim.sample(0).queue_depth = Some(0.0);
    // Throttled (a fault), at the operator's cap of 10, down.
    sim.sample(1).throttle = Some(0x40);
    sim.backends[2].max_sessions = 10;
    sim.backends[2].sessions = 10;
    sim.backends[3].healthy = false;
    let d = sim.step();
    let b = &d.backends;
    assert_eq!(b[1].state, SteerState::MovedAway);
    assert!(b[1].breaks_affinity);
    assert!(
        b[2].full && b[2].capped && !b[2].breaks_affinity,
        "{:?}",
        b[2]
    );
    assert!(b[3].breaks_affinity);
    assert!(!b[4].full && !b[4].capped && !b[4].breaks_affinity);
}

/// A backend moved away at KV 0.98 is down to 0.34 within 3 s; kept at weight 0 for its whole
/// cooldown, it leaves the backend that took its share to fill. A saturation move lasts while
/// the backend is over a threshold or more loaded than the others in rotation, and no longer.
#[test]
fn a_saturation_move_ends_when_its_backend_is_no_more_loaded_than_the_others() {
    let cfg = PolicyConfig::default();
    let mut sim = Sim::new(cfg.clone(), 4);
    let load = |sim: &mut Sim, kv: [f64; 4]| {
        for (i, kv) in kv.into_iter().enumerate() {
            let s = sim.sample(i);
            s.gpu_util = Some(1.0);
            s.kv_cache = Some(kv);
            s.queue_depth = Some(0.0);
        }
    };
    load(&mut sim, [0.4; 4]);
    sim.run_until(5 * S);
    load(&mut sim, [0.95, 0.4, 0.4, 0.4]);
    let out = [sim.step(), sim.step()];
    assert_eq!(out[1].backends[0].state, SteerState::MovedAway);
    assert_eq!(out[1].backends[0].reason, Some(Reason::Saturation));
    let moved_at = sim.now - S;
    // Under its threshold but still more loaded than the others: it stays out.
    load(&mut sim, [0.6, 0.5, 0.5, 0.5]);
    let d = sim.step();
    assert_eq!(
        (d.backends[0].state, d.backends[0].weight),
        (SteerState::MovedAway, 0)
    );
    // As loaded as the others, 3 s into a 10 s cooldown: back at full weight (no ramp
    // after saturation).
    load(&mut sim, [0.5, 0.55, 0.5, 0.5]);
    let d = sim.step();
    assert!(sim.now - moved_at < cfg.cooldown_base);
    assert_eq!(
        (d.backends[0].state, d.backends[0].weight),
        (SteerState::Active, 100),
        "a saturation move outlasted its load"
    );
    assert!(kinds(&d, 1).contains(&EventKind::Recover));
    // A fault's move keeps its cooldown whatever the load reads.
    sim.sample(1).throttle = Some(0x40);
    assert_eq!(sim.step().backends[1].state, SteerState::MovedAway);
    sim.sample(1).throttle = Some(0);
    load(&mut sim, [0.5, 0.1, 0.5, 0.5]);
    let d = sim.step();
    assert_eq!(d.backends[1].state, SteerState::MovedAway);
}

/// Maglev spreads a removed backend's slots by weight, so the backend its clients' source
/// hash already loaded most takes as much of a faulty one's share as those with room, which
/// raises the p99 time to first token. While a backend is moved away for a fault, a markedly
/// more loaded one keeps the share it had, and takes its full weight back with the faulty
/// one's return.
#[test]
fn a_faulty_backends_share_goes_to_the_backends_with_room() {
    let fleet = |kvs: [f64; 4]| {
        let mut sim = Sim::new(PolicyConfig::default(), 4);
        for (i, kv) in kvs.into_iter().enumerate() {
            sim.sample(i).kv_cache = Some(kv);
        }
        sim
    };
    let mut sim = fleet([0.16, 0.36, 0.52, 0.16]);
    let weights = |d: &Decisions| d.backends.iter().map(|b| b.weight).collect::<Vec<_>>();
    // Pressure 0.65 against a mean of 0.375 is within the level band: all at full weight.
    let d = sim.run_until(10 * S).pop().unwrap();
    assert_eq!(weights(&d), [100, 100, 100, 100]);
    // Throttled; its streams in flight stay on it, so its KV stays.
    sim.sample(1).throttle = Some(0x48);
    let out = sim.run_until(15 * S);
    // Out at once; from the next step backend 2 (0.65 against a mean of 0.35 in rotation)
    // holds 6 of 8 levels, 3 of the ring's 4 weights in rotation.
    assert_eq!(weights(&out[0]), [100, 0, 100, 100]);
    assert_eq!(weights(&out[1]), [100, 0, 75, 100]);
    let change = out[1]
        .events
        .iter()
        .find(|e| e.backend == Some(addr(3)) && e.kind == EventKind::WeightChange)
        .expect("backend 2's weight change");
    assert!(
        change.reason.contains("holding its share: at most 6"),
        "{}",
        change.reason
    );
    // The throttle clears; backend 1 returns after its cooldown and backend 2 with it.
    sim.sample(1).throttle = Some(0);
    let back = sim.run_until(40 * S);
    let returned = back
        .iter()
        .position(|d| d.backends[1].state != SteerState::MovedAway)
        .expect("backend 1 returns after its cooldown");
    let b2: Vec<u32> = out
        .iter()
        .chain(&back)
        .map(|d| d.backends[2].weight)
        .collect();
    let changes = b2.windows(2).filter(|w| w[0] != w[1]).count();
    assert_eq!(changes, 2, "held once, released once: {b2:?}");
    assert_eq!(back[returned + 1].backends[2].weight, 100);
    // A backend that cools while the fault lasts takes its weight back then.
    let mut sim = fleet([0.16, 0.36, 0.52, 0.16]);
    sim.run_until(10 * S);
    sim.sample(1).throttle = Some(0x48);
    sim.run_until(13 * S);
    sim.sample(2).kv_cache = Some(0.16);
    let d = sim.run_until(25 * S).pop().unwrap();
    assert_eq!(weights(&d), [100, 0, 100, 100]);
    // Nothing is held for a backend that is down (it may stay down for hours, and holds
    // would follow the load's wandering all that time), nor on one with room left.
    for (kvs, down) in [
        ([0.16, 0.36, 0.52, 0.16], true),
        ([0.06, 0.2, 0.3, 0.06], false),
    ] {
        let mut sim = fleet(kvs);
        sim.run_until(10 * S);
        if down {
            sim.backends[1].healthy = false;
        } else {
            sim.sample(1).throttle = Some(0x48);
        }
        let d = sim.run_until(20 * S);
        assert!(
            d.iter().all(|d| weights(d) == [100, 0, 100, 100]),
            "down {down}: {:?}",
            d.iter().map(weights).collect::<Vec<_>>()
        );
    }
}

impl Sim {
    /// `n` backends of VIP "v" without telemetry (no exporter), whose handshakes the data
    /// plane counts.
    fn counting_handshakes(n: u32) -> Self {
        let mut sim = Sim::new(PolicyConfig::default(), n);
        for b in &mut sim.backends {
            b.telemetry = None;
            b.handshakes = Some(Handshakes::default());
        }
        sim
    }

    /// One step, then the handshakes of the second that follows it: backend `i` gets
    /// `per_step` handshakes at full weight, in proportion to the weight just decided, and
    /// `complete(i, started)` of them complete.
    fn step_handshakes(
        &mut self,
        per_step: u64,
        mut complete: impl FnMut(usize, u64) -> u64,
    ) -> Decisions {
        let d = self.step();
        for (i, (b, dec)) in self.backends.iter_mut().zip(&d.backends).enumerate() {
            let started = per_step * u64::from(dec.weight) / 100;
            let h = b.handshakes.as_mut().expect("counting");
            h.started += started;
            h.completed += complete(i, started);
        }
        d
    }
}

/// A backend whose health port answers while its serving port resets every connection: its
/// clients' SYNs are never followed by an ACK. It is moved away within two seconds, with the
/// usual cooldown, and once its handshakes complete again it returns when the cooldown ends
/// and ramps back to full weight.
#[test]
fn a_backend_refusing_handshakes_moves_within_seconds_and_returns_when_they_complete() {
    let cfg = PolicyConfig::default();
    let mut sim = Sim::counting_handshakes(3);
    // Clients abandon one handshake in ten everywhere.
    let healthy = |_: usize, n: u64| n * 9 / 10;
    for _ in 0..10 {
        let d = sim.step_handshakes(20, healthy);
        assert!(d.events.is_empty(), "{:?}", d.events);
    }
    // Backend 3 refuses from now on.
    let refusing = |i: usize, n: u64| if i == 2 { 0 } else { n * 9 / 10 };
    let moved_at = sim.now;
    let out: Vec<Decisions> = (0..2).map(|_| sim.step_handshakes(20, refusing)).collect();
    let b = &out[1].backends[2];
    assert_eq!((b.weight, b.state), (0, SteerState::MovedAway));
    assert_eq!(b.reason, Some(Reason::Refusing));
    assert!(b.breaks_affinity, "a refusing backend keeps no client");
    let reroute = out
        .iter()
        .flat_map(|d| &d.events)
        .find(|e| e.kind == EventKind::Reroute)
        .expect("a reroute event");
    assert!(
        reroute.reason.contains(
            "20 of its last 20 TCP handshakes never completed (100%), its peers' 10% of 40"
        ),
        "{}",
        reroute.reason
    );
    assert_eq!(
        out[1].backends[2].handshakes,
        Some(Handshakes {
            started: 20,
            completed: 0
        })
    );
    // The others keep their weight.
    assert!(out[1].backends[..2].iter().all(|b| b.weight == 100));
    // Its worker restarts: handshakes complete again. It comes back when the cooldown ends
    // (its failures have left the window by then) and ramps up.
    let back = (0..30)
        .map(|_| sim.step_handshakes(20, healthy))
        .position(|d| kinds(&d, 3).contains(&EventKind::Recover))
        .expect("it returns");
    let out_for = sim.now - moved_at;
    assert!(
        out_for >= cfg.cooldown_base && out_for <= cfg.cooldown_base + 4 * S,
        "back after {out_for:?} (step {back})"
    );
    let d = sim.run_until(sim.now + cfg.slow_start + 2 * S);
    let last = &d.last().expect("steps").backends[2];
    assert_eq!((last.weight, last.state), (100, SteerState::Active));
    assert!(d.iter().all(|d| d.backends[2].reason.is_none()));
}

/// Clients that give up on handshakes at the same rate everywhere (30% of them, with noise,
/// and a few seconds when every handshake of the VIP fails) are no outlier: in ten minutes
/// nobody is moved.
#[test]
fn equal_abandonment_everywhere_moves_nobody() {
    let mut sim = Sim::counting_handshakes(4);
    let mut rng = 0x2545_f491_4f6c_dd1d_u64;
    let mut events = Vec::new();
    while sim.now < 600 * S {
        let blackout = (300 * S..305 * S).contains(&sim.now);
        let d = sim.step_handshakes(20, |_, n| {
            if blackout {
                0
            } else {
                (0..n).filter(|_| noise(&mut rng) >= 0.3).count() as u64
            }
        });
        events.extend(d.events);
    }
    assert!(events.is_empty(), "{events:?}");
}

/// Too few handshakes, or no peer with enough of its own, is no evidence.
#[test]
fn a_refusing_backend_needs_enough_handshakes_and_a_peer_to_depart_from() {
    // Five failing handshakes per step for one, one completing every other step for its
    // peer: the peer never has ten in its window.
    let mut sim = Sim::counting_handshakes(2);
    for step in 0..30 {
        let d = sim.step();
        assert!(d.events.is_empty(), "{:?}", d.events);
        sim.backends[0].handshakes.as_mut().unwrap().started += 5;
        if step % 2 == 0 {
            let peer = sim.backends[1].handshakes.as_mut().unwrap();
            peer.started += 1;
            peer.completed += 1;
        }
    }
    // A backend alone in its VIP has no peers, however many of its handshakes fail.
    let mut sim = Sim::counting_handshakes(1);
    for _ in 0..20 {
        let d = sim.step_handshakes(50, |_, _| 0);
        assert!(d.events.is_empty(), "{:?}", d.events);
    }
}

/// A tenant of VIP "v" at weight 1 without a cap, with its counters.
fn tenant(name: &str, sessions: u64, admitted: u64, refused: u64) -> TenantInput<'_> {
    TenantInput {
        vip: "v",
        tenant: name,
        weight: 1,
        max_sessions: 0,
        sessions,
        admitted,
        refused,
    }
}

/// A full pool with a noisy tenant over its share: the noisy tenant is flagged, the quiet
/// one keeps being admitted, and no class is shed while the tenant is; once the noisy
/// tenant is back within its share and the pool is still full, classes shed as before.
#[test]
fn a_full_pool_sheds_the_tenant_over_its_share_before_any_class() {
    let cfg = PolicyConfig {
        shed: Some(ShedMode::Rst),
        ..PolicyConfig::default()
    };
    let period = cfg.cooldown_base;
    let mut sim = Sim::new(cfg, 2);
    for b in &mut sim.backends {
        // Class 3, the pool's highest: classes 4..=7 may be shed.
        b.class = 3;
        b.max_sessions = 4;
        b.sessions = 4;
    }
    let tenant = |name, sessions, admitted| tenant(name, sessions, admitted, 0);
    let mut admitted = 0;
    for _ in 0..3 * period.as_secs() {
        admitted += 10;
        let d = sim.step_with_tenants(&[tenant("noisy", 7, admitted), tenant("quiet", 1, 3)]);
        assert_eq!(d.tenants.len(), 2);
        assert!(d.tenants[0].over_share, "noisy holds 7 of a 4 share");
        assert!(!d.tenants[1].over_share && !d.tenants[1].capped);
        assert_eq!(d.shed["v"].admit_max, LOWEST_CLASS, "no class is shed");
    }
    // Within its share now, the pool still full: the class rule takes over.
    let d = sim.step_with_tenants(&[tenant("noisy", 4, admitted), tenant("quiet", 4, 3)]);
    assert!(d.tenants.iter().all(|t| !t.over_share));
    assert!(d.shed["v"].admit_max < LOWEST_CLASS);
    // Room again: no tenant is flagged.
    sim.backends[0].sessions = 1;
    let d = sim.step_with_tenants(&[tenant("noisy", 9, admitted), tenant("quiet", 0, 3)]);
    assert!(d.tenants.iter().all(|t| !t.over_share && t.flags() == 0));
}

/// A pool is busy for tenants' shares once its VIP's sessions fill `tenant_busy_fraction` of
/// its backends' session caps: from there a tenant over its share that presses its limits is
/// refused, though no backend is full; below it, or where a backend has no cap, only a full
/// pool applies shares.
#[test]
fn a_busy_pool_holds_a_pressing_tenant_to_its_share_before_any_backend_is_full() {
    let cfg = PolicyConfig {
        tenant_busy_fraction: 0.25,
        ..PolicyConfig::default()
    };
    let mut sim = Sim::new(cfg, 2);
    for b in &mut sim.backends {
        b.max_sessions = 20;
        b.sessions = 5;
    }
    // Busy from 0.25 x 40 = 10 sessions.
    let (mut admitted, mut refused) = (0, 0);
    let mut step = |sim: &mut Sim, noisy: u64, quiet: u64| {
        // Noisy's limits refuse two of its new sessions for each one admitted.
        admitted += 1;
        refused += 2;
        let d = sim.step_with_tenants(&[
            tenant("noisy", noisy, admitted, refused),
            tenant("quiet", quiet, admitted, 0),
        ]);
        assert!(d.backends.iter().all(|b| !b.full));
        assert!(!d.tenants[1].over_share, "quiet is within its limits");
        d.tenants[0].over_share
    };
    step(&mut sim, 6, 2);
    assert!(!step(&mut sim, 6, 3), "9 sessions of 40: not busy");
    assert!(
        step(&mut sim, 7, 3),
        "10 of 40: busy, noisy holds 7 of a 5 share"
    );
    sim.backends[1].max_sessions = 0;
    assert!(
        !step(&mut sim, 7, 3),
        "a backend without a cap: the pool's room is unknown"
    );
}
