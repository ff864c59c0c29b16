//! Load score, weight level and move-away triggers from one backend's telemetry.
//!
//! Pressure of a sample = the largest of `signal / threshold` over the signals that grow with
//! load (KV cache, queue depth), capped at 1. Fabric trouble (ECN rate, CNP rate) is a
//! congestion trigger only: the marks count the traffic the backend carries, and as a
//! pressure they would lower a congested backend's level for a whole [`LEVEL_DWELL`], so it
//! would return at a reduced weight long after its fabric clears. GPU utilisation says only
//! idle vs busy (a continuous-batching engine is busy whenever it has any work), so it counts
//! only for a backend without engine metrics: [`BUSY`] when at or over `gpu_util_high`, else
//! 0. Temperature does not load a backend; over `temp_high_c` it is a throttling trigger. The
//! score is the pressure's EWMA (`ewma_alpha`).
//!
//! The weight level compares the score with the VIP's mean ([`relative_level`]): a backend
//! within [`LEVEL_BAND`] of the mean, or all backends equally loaded, keeps full weight; a
//! more loaded one gets weight in proportion to how much more, unless its engine shows room
//! ([`super::HEADROOM`], `Policy::relevel`). The level only moves when the target is more
//! than `0.5 + hysteresis * weight_levels` levels from the current level, and at most once
//! per [`LEVEL_DWELL`]: every level change remaps ring slots, and on a healthy fleet behind a
//! source-hashed VIP the load of each backend wanders with which clients are talking (with no
//! dwell and a 25% band a healthy fleet changes levels dozens of times per backend in ten
//! minutes). Moves away (throttling, congestion, saturation) are triggers, not levels, and
//! keep their one-scrape reaction.
//!
//! Speed is a second level ([`Speed`]): KV and queue measure load, and a half-speed
//! accelerator carrying its share reads like a busy healthy one. Its time per output token
//! does not: a backend markedly slower per token than its VIP's others ([`SLOW_RATIO`]) gets
//! a level in proportion to its relative speed. The backend's level is the lower of the two.

use std::time::Duration;

use serde::Serialize;

use crate::config::PolicyConfig;
use crate::telemetry::{BackendTelemetry, Sample};

/// Why a backend is moved away from new sessions.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum Reason {
    /// ECN marks or CNPs over their threshold.
    Congestion,
    /// Queue depth or KV-cache usage at its threshold.
    Saturation,
    /// GPU throttling bits set, or temperature over its threshold.
    Throttling,
    /// Telemetry too old to trust: treated as saturated.
    Stale,
    /// In-band time to first byte or delivery rate departs from the VIP's other backends
    /// (`policy::inband`).
    Slow,
    /// Its clients' TCP handshakes fail far more often than its peers' (`policy::refusing`).
    Refusing,
}

impl Reason {
    /// A fault, not load: a backend moved away for it loses its clients' affinity too (their
    /// next turn goes where the ring says). Saturation passes as load moves elsewhere and
    /// stale telemetry is no evidence, so a conversation's next turn still finds its prefix
    /// cached on such a backend.
    pub fn is_fault(self) -> bool {
        matches!(
            self,
            Reason::Congestion | Reason::Throttling | Reason::Slow | Reason::Refusing
        )
    }

    /// How strongly the reason argues against new sessions: a refusing backend fails the
    /// sessions it gets; a throttled accelerator is slow whatever its load; congestion slows
    /// its collectives; slowness is a comparison with peers, which load and client mix can
    /// mislead; saturation passes as load moves elsewhere; stale telemetry is no evidence at
    /// all.
    pub fn severity(self) -> u8 {
        match self {
            Reason::Stale => 0,
            Reason::Saturation => 1,
            Reason::Slow => 2,
            Reason::Congestion => 3,
            Reason::Throttling => 4,
            Reason::Refusing => 5,
        }
    }
}

/// A move-away condition that holds now, with the numbers behind it.
#[derive(Clone, Debug, PartialEq)]
pub struct Trigger {
    pub reason: Reason,
    pub detail: String,
}

/// The conditions that hold for this telemetry, most specific first. Stale telemetry yields
/// only `Stale`: its values are not evidence of anything.
pub fn triggers(t: &BackendTelemetry, cfg: &PolicyConfig) -> Vec<Trigger> {
    if t.stale {
        let age = t
            .age
            .map_or("never scraped".to_owned(), |a| format!("age {a:?}"));
        return vec![Trigger {
            reason: Reason::Stale,
            detail: format!("stale telemetry ({age})"),
        }];
    }
    let s = &t.sample;
    let mut out = Vec::new();
    let mut check = |reason, value: Option<f64>, limit: f64, hit: fn(f64, f64) -> bool, what| {
        if let Some(v) = value.filter(|&v| hit(v, limit)) {
            out.push(Trigger {
                reason,
                detail: format!("{what} {v} over {limit}"),
            });
        }
    };
    let over = |v, l| v > l;
    let at = |v, l| v >= l;
    check(
        Reason::Congestion,
        s.ecn_rate,
        cfg.ecn_rate_high,
        over,
        "ecn_rate",
    );
    check(
        Reason::Congestion,
        s.cnp_rate,
        cfg.cnp_rate_high,
        over,
        "cnp_rate",
    );
    let queue_high = f64::from(cfg.queue_depth_high);
    check(
        Reason::Saturation,
        s.queue_depth,
        queue_high,
        at,
        "queue_depth",
    );
    check(
        Reason::Saturation,
        s.kv_cache,
        cfg.kv_cache_high,
        at,
        "kv_cache",
    );
    check(
        Reason::Throttling,
        s.gpu_temp_c,
        cfg.temp_high_c,
        over,
        "gpu_temp_c",
    );
    if let Some(bits) = s.throttle.filter(|&b| b != 0) {
        out.push(Trigger {
            reason: Reason::Throttling,
            detail: format!("throttle reasons {bits:#x}"),
        });
    }
    out
}

/// The pressure of a busy GPU whose engine reports no load: its depth is unknown.
pub const BUSY: f64 = 0.5;

/// Pressure above the VIP's mean (as a fraction of it) that still counts as evenly loaded
/// for saturation moves.
pub const LOAD_BAND: f64 = 0.25;

/// Score above the VIP's mean (as a fraction of it) that still gets full weight: wider than
/// [`LOAD_BAND`], since a level change remaps clients while a saturation move needs a
/// backend to be at its threshold as well.
pub const LEVEL_BAND: f64 = 0.5;

/// The least time between two level changes of a backend.
pub const LEVEL_DWELL: Duration = Duration::from_secs(60);

/// Added to scores before comparing them, so that light-load noise (0.17 against a mean of
/// 0.06, seen in the demo's first seconds) is not read as three times the load.
const LOAD_FLOOR: f64 = 0.2;

/// The sample's pressure in 0..=1, or `None` when it carries none of the scored signals.
pub fn pressure(s: &Sample, cfg: &PolicyConfig) -> Option<f64> {
    let engine = s.engine_load();
    let util = s
        .gpu_util
        .filter(|_| !engine)
        .map(|u| if u >= cfg.gpu_util_high { BUSY } else { 0.0 });
    [
        (s.kv_cache, cfg.kv_cache_high),
        (s.queue_depth, f64::from(cfg.queue_depth_high)),
        (util, 1.0),
    ]
    .into_iter()
    .filter_map(|(v, high)| v.filter(|v| v.is_finite()).map(|v| v / high))
    // Capped so one huge spike decays as fast as a reading at the threshold.
    .map(|p| p.clamp(0.0, 1.0))
    .reduce(f64::max)
}

/// A backend of score `score` is more loaded than others whose mean score is `mean` by more
/// than `band` (a fraction of it), with the same floor as [`relative_level`].
pub fn hotter(score: f64, mean: f64, band: f64) -> bool {
    score + LOAD_FLOOR > (1.0 + band) * (mean + LOAD_FLOOR)
}

/// The level (unrounded, `0..=levels`) a backend of score `score` deserves beside others
/// whose mean score is `mean`: full within the band, then in inverse proportion to the load.
pub fn relative_level(score: f64, mean: f64, levels: u32) -> f64 {
    let share = (1.0 + LEVEL_BAND) * (mean + LOAD_FLOOR) / (score + LOAD_FLOOR);
    share.min(1.0) * f64::from(levels)
}

/// A backend's smoothed score and the weight level it maps to.
#[derive(Clone, Debug, PartialEq)]
pub struct Score {
    /// `None` until the first reading, which seeds the EWMA.
    ewma: Option<f64>,
    pub level: u32,
    /// When the level last changed; `None` before any change.
    changed_at: Option<Duration>,
}

impl Score {
    /// The state before any reading: full level.
    pub fn new(cfg: &PolicyConfig) -> Self {
        Score {
            ewma: None,
            level: cfg.weight_levels,
            changed_at: None,
        }
    }

    pub fn value(&self) -> f64 {
        self.ewma.unwrap_or(0.0)
    }

    /// Folds in one pressure reading (`None`: no signal, counted as idle).
    pub fn update(&mut self, pressure: Option<f64>, cfg: &PolicyConfig) {
        let p = pressure.unwrap_or(0.0);
        let ewma = self.ewma.map_or(p, |e| ewma(e, p, cfg));
        self.ewma = Some(ewma);
    }

    /// Moves the level to `target` (unrounded) if it is outside the hysteresis band and the
    /// last change is at least [`LEVEL_DWELL`] old.
    pub fn relevel(&mut self, now: Duration, target: f64, cfg: &PolicyConfig) {
        let dwelt = self
            .changed_at
            .is_none_or(|at| now.saturating_sub(at) >= LEVEL_DWELL);
        if let Some(level) = past_band(target, self.level, cfg).filter(|_| dwelt) {
            self.level = level;
            self.changed_at = Some(now);
        }
    }
}

/// `previous` moved towards the reading `x` by `ewma_alpha`.
fn ewma(previous: f64, x: f64, cfg: &PolicyConfig) -> f64 {
    cfg.ewma_alpha * x + (1.0 - cfg.ewma_alpha) * previous
}

/// The level (quantised to `1..=weight_levels`) that `target` asks for, when it is more than
/// `0.5 + hysteresis * weight_levels` levels from `level`: the band both the load and the
/// speed level move past.
fn past_band(target: f64, level: u32, cfg: &PolicyConfig) -> Option<u32> {
    let band = 0.5 + cfg.hysteresis * f64::from(cfg.weight_levels);
    let next = (target.round() as u32).clamp(1, cfg.weight_levels);
    (next != level && (target - f64::from(level)).abs() > band).then_some(next)
}

/// Time per output token over the median of the VIP's others past which a backend is slow
/// hardware rather than busy. From the step formula (docs/token-lab.md: 17.7 ms base, +0.1 ms
/// per sequence, +0.14 ms per 1000 KV tokens, + prompt tokens / 14000 per s, all / speed): in
/// the lab (batch 16, 8192 KV tokens) a full healthy batch steps at 20.5 ms against 17.8 ms
/// for one sequence (1.15x), and a source-hash hot spot's extra prefill chunks add under
/// 10 % more; a half-speed accelerator is 2x at any load. 1.5 sits between.
pub const SLOW_RATIO: f64 = 1.5;

/// A slow backend returns to full speed level only under this ratio, so one hovering at
/// [`SLOW_RATIO`] does not flip between full and two thirds every scrape.
pub const SLOW_CLEAR_RATIO: f64 = 1.25;

/// The level (unrounded) a backend whose time per output token is `own` deserves beside
/// others whose median is `others`; `slow` says it is at a reduced speed level now.
pub fn speed_level(own: f64, others: f64, slow: bool, levels: u32) -> f64 {
    let ratio = own / others;
    let limit = if slow { SLOW_CLEAR_RATIO } else { SLOW_RATIO };
    let full = f64::from(levels);
    if ratio > limit {
        full / ratio
    } else {
        full
    }
}

/// A backend's smoothed time per output token and the weight level it maps to.
#[derive(Clone, Debug, PartialEq)]
pub struct Speed {
    /// EWMA (`ewma_alpha`) of the scraped means, seconds; `None` before the first token.
    tpot_s: Option<f64>,
    pub level: u32,
}

impl Speed {
    pub fn new(cfg: &PolicyConfig) -> Self {
        Speed {
            tpot_s: None,
            level: cfg.weight_levels,
        }
    }

    pub fn tpot_s(&self) -> Option<f64> {
        self.tpot_s
    }

    /// Folds in one interval's mean; `None` (no token generated) keeps the estimate: an idle
    /// or emptied backend has shown no speed, slow or fast.
    pub fn update(&mut self, tpot_s: Option<f64>, cfg: &PolicyConfig) {
        if let Some(t) = tpot_s.filter(|t| t.is_finite() && *t > 0.0) {
            self.tpot_s = Some(self.tpot_s.map_or(t, |e| ewma(e, t, cfg)));
        }
    }

    /// Moves the level against the others' median time per output token, past the same
    /// hysteresis band as the load level but with no dwell: speed is the hardware's, and
    /// does not wander with which clients are talking.
    pub fn relevel(&mut self, others_s: f64, cfg: &PolicyConfig) {
        let Some(own) = self.tpot_s else {
            return;
        };
        let levels = cfg.weight_levels;
        let target = speed_level(own, others_s, self.level < levels, levels);
        if let Some(level) = past_band(target, self.level, cfg) {
            self.level = level;
        }
    }
}

/// `weight` scaled to `level / weight_levels`, never below 1 for a positive weight.
pub fn scaled(weight: u32, level: u32, cfg: &PolicyConfig) -> u32 {
    if weight == 0 || level == 0 {
        return 0;
    }
    let w = u64::from(weight) * u64::from(level) / u64::from(cfg.weight_levels);
    (w as u32).max(1)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::policy::tests::sample;

    #[test]
    fn pressure_is_the_largest_capped_ratio() {
        let cfg = PolicyConfig::default();
        let mut s = sample();
        assert_eq!(pressure(&s, &cfg), None);
        // Utilisation alone: idle or busy.
        s.gpu_util = Some(0.5);
        assert_eq!(pressure(&s, &cfg), Some(0.0));
        s.gpu_util = Some(1.0);
        assert_eq!(pressure(&s, &cfg), Some(BUSY));
        // With engine metrics utilisation says nothing more; temperature never loads.
        s.queue_depth = Some(4.0);
        s.gpu_temp_c = Some(84.0);
        assert_eq!(pressure(&s, &cfg), Some(0.8));
        // Fabric marks are a congestion trigger, not load.
        s.ecn_rate = Some(1e9);
        s.cnp_rate = Some(1e9);
        assert_eq!(pressure(&s, &cfg), Some(0.8));
        s.kv_cache = Some(1.6);
        assert_eq!(pressure(&s, &cfg), Some(1.0));
    }

    #[test]
    fn triggers_name_each_condition_and_stale_hides_values() {
        let cfg = PolicyConfig::default();
        let mut s = sample();
        s.cnp_rate = Some(600.0);
        s.kv_cache = Some(0.8);
        s.throttle = Some(0x20);
        let mut t = BackendTelemetry {
            sample: s,
            age: None,
            stale: false,
            errors: Vec::new(),
        };
        let reasons: Vec<Reason> = triggers(&t, &cfg).iter().map(|t| t.reason).collect();
        assert_eq!(
            reasons,
            [Reason::Congestion, Reason::Saturation, Reason::Throttling]
        );
        t.stale = true;
        let reasons: Vec<Reason> = triggers(&t, &cfg).iter().map(|t| t.reason).collect();
        assert_eq!(reasons, [Reason::Stale]);
    }

    #[test]
    fn first_level_is_quantised_and_floored_at_one() {
        let cfg = PolicyConfig::default();
        let mut s = Score::new(&cfg);
        let mut now = Duration::ZERO;
        s.relevel(now, relative_level(0.5, 0.5, 8), &cfg);
        assert_eq!(s.level, 8, "as loaded as the rest: full weight");
        // Within the band: 1.5 * (0.4 + 0.2) / (0.6 + 0.2) * 8 = 9 levels, capped at 8.
        s.relevel(now, relative_level(0.6, 0.4, 8), &cfg);
        assert_eq!(s.level, 8);
        // Over twice the others' load: 1.5 * (0.3 + 0.2) / (0.9 + 0.2) * 8 = 5.45.
        s.relevel(now, relative_level(0.9, 0.3, 8), &cfg);
        assert_eq!(s.level, 5);
        // No second change within the dwell, one as soon as it has passed.
        now += LEVEL_DWELL - Duration::from_secs(1);
        s.relevel(now, relative_level(1.0, 0.0, 8), &cfg);
        assert_eq!(s.level, 5);
        now += Duration::from_secs(1);
        s.relevel(now, relative_level(1.0, 0.0, 8), &cfg);
        assert_eq!(s.level, 2);
        now += LEVEL_DWELL;
        s.relevel(now, 0.0, &cfg);
        assert_eq!(s.level, 1);
        assert_eq!(scaled(100, 1, &cfg), 12);
        assert_eq!(scaled(3, 1, &cfg), 1);
        assert_eq!(scaled(100, 0, &cfg), 0);
    }
}
