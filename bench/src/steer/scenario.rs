//! The steer benchmark's scenarios and policies: what each cell offers, which fault it puts
//! into which accelerator when, and how the daemon is configured.

use std::time::Duration;

use anyhow::{bail, Result};
use serde_json::{json, Value};

/// The accelerator the faults hit (b1: not the first, so nothing depends on ordering).
pub const FAULTY: usize = 1;

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Scenario {
    /// Homogeneous fleet, ~70% of its capacity offered.
    Healthy,
    /// One accelerator at half speed from the start.
    Heterogeneous,
    /// One accelerator throttled to 0.4x at 1/3 of the run, recovered at 2/3.
    Throttled,
    /// One accelerator's fabric congested over the middle third.
    Congested,
    /// One accelerator killed at 1/2.
    Dying,
    /// Offered load 1.3x the fleet's capacity.
    Overload,
    /// A gray failure: one accelerator's exporter frozen at 0.4 of the run, and the
    /// accelerator slowed 2.5x right after (its pages keep the values from before).
    Gray,
    /// A fleet near saturation (90%) while one accelerator is throttled to 0.4x over the
    /// middle third: the others have no headroom for its share.
    NearSaturation,
    /// A healthy fleet at idle temperature and light load (25%): every weight stays full.
    Idle,
    /// A healthy fleet at 65% for 10 minutes whatever `--duration` says: weight changes per
    /// backend per 10 minutes, counted rather than extrapolated.
    Steady,
    /// A lying exporter: one accelerator's pages report it idle from 0.39 of the run, and
    /// the accelerator slows 2.5x right after.
    Lying,
    /// A throttle that comes and goes: one accelerator at a third of its speed for 10 s, then
    /// full speed for 10 s, and so on, from a quarter of the run to its end (DCGM reports the
    /// throttle while it is in force).
    Flapping,
    /// The clients split by prefix into three quiet tenants and a noisy one
    /// ([`super::tenants::TENANTS`]), each offering its share of the usual load; over the
    /// middle third the noisy tenant offers [`BURST_FACTOR`] times its share.
    NoisyTenant,
    /// `noisy-tenant` without the burst: each policy's figures for the same load, calm.
    NoisyTenantCalm,
}

/// Every scenario `--scenarios` knows.
pub const SCENARIOS: [Scenario; 14] = [
    Scenario::Healthy,
    Scenario::Heterogeneous,
    Scenario::Throttled,
    Scenario::Congested,
    Scenario::Dying,
    Scenario::Overload,
    Scenario::Gray,
    Scenario::NearSaturation,
    Scenario::Idle,
    Scenario::Steady,
    Scenario::Lying,
    Scenario::Flapping,
    Scenario::NoisyTenant,
    Scenario::NoisyTenantCalm,
];

/// The offered load of the scenarios that do not set their own, as a fraction of the fleet's
/// capacity (`--load`).
pub const USUAL_LOAD: f64 = 0.7;

/// A flapping accelerator's period: as long slowed as at full speed.
pub const FLAP_PERIOD_S: f64 = 10.0;

/// The noisy tenant's offered load in its burst, as a multiple of its share: at the usual
/// load the fleet is then offered 0.7 x (3/4 + 5/4) = 1.4 of its capacity.
pub const BURST_FACTOR: f64 = 5.0;

/// A burst of one tenant's load: a second load generator from its addresses only, over a
/// part of the run.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Burst {
    /// 0..1 of the run.
    pub from: f64,
    pub to: f64,
    /// The noisy tenant's load in the burst over its steady share.
    pub factor: f64,
}

/// The scenarios run when `--scenarios` is not given: the faults of one accelerator, overload
/// and the gray failure. Near-saturation, idle and steady run on request (`steady` alone
/// takes 10 minutes a cell).
pub const DEFAULT_SCENARIOS: [Scenario; 7] = [
    Scenario::Healthy,
    Scenario::Heterogeneous,
    Scenario::Throttled,
    Scenario::Congested,
    Scenario::Dying,
    Scenario::Overload,
    Scenario::Gray,
];

/// A fault put into an accelerator at a fraction of the run.
#[derive(Clone, Debug, PartialEq)]
pub struct Fault {
    /// 0..1 of the run.
    pub at: f64,
    pub backend: usize,
    /// The body of `POST /fault`.
    pub body: Value,
    /// For plots and the summary.
    pub label: String,
}

impl Scenario {
    pub fn name(self) -> &'static str {
        match self {
            Scenario::Healthy => "healthy",
            Scenario::Heterogeneous => "heterogeneous",
            Scenario::Throttled => "throttled",
            Scenario::Congested => "congested",
            Scenario::Dying => "dying",
            Scenario::Overload => "overload",
            Scenario::Gray => "gray",
            Scenario::NearSaturation => "near-saturation",
            Scenario::Idle => "idle",
            Scenario::Steady => "steady",
            Scenario::Lying => "lying",
            Scenario::Flapping => "flapping",
            Scenario::NoisyTenant => "noisy-tenant",
            Scenario::NoisyTenantCalm => "noisy-tenant-calm",
        }
    }

    pub fn parse(s: &str) -> Result<Scenario> {
        match SCENARIOS.iter().find(|c| c.name() == s) {
            Some(c) => Ok(*c),
            None => bail!(
                "unknown scenario {s:?}; known: {}",
                SCENARIOS.map(Scenario::name).join(", ")
            ),
        }
    }

    /// Offered load as a fraction of the healthy fleet's capacity: `usual` unless the
    /// scenario is about its load.
    pub fn load(self, usual: f64) -> f64 {
        match self {
            Scenario::Overload => 1.3,
            Scenario::NearSaturation => 0.9,
            Scenario::Idle => 0.25,
            Scenario::Steady => 0.65,
            _ => usual,
        }
    }

    /// Seconds of load: `steady`'s own 10 minutes, else what `--duration` asked.
    pub fn duration(self, asked: Duration) -> Duration {
        match self {
            Scenario::Steady => Duration::from_secs(600),
            _ => asked,
        }
    }

    /// `sluice-accel --slow` of the slow accelerator, if any.
    pub fn slow(self) -> Option<(usize, f64)> {
        (self == Scenario::Heterogeneous).then_some((FAULTY, 0.5))
    }

    /// The faults, in time order.
    pub fn faults(self) -> Vec<Fault> {
        let f = |at: f64, body: Value, label: &str| Fault {
            at,
            backend: FAULTY,
            body,
            label: label.to_owned(),
        };
        let clear = json!({"kind": "clear"});
        match self {
            Scenario::Throttled | Scenario::NearSaturation => vec![
                f(
                    1.0 / 3.0,
                    json!({"kind": "throttle", "factor": 0.4}),
                    "b1 throttled 0.4x",
                ),
                f(2.0 / 3.0, clear, "b1 recovered"),
            ],
            Scenario::Congested => vec![
                f(
                    1.0 / 3.0,
                    json!({"kind": "congest", "factor": 0.6}),
                    "b1 fabric congested",
                ),
                f(2.0 / 3.0, clear, "b1 fabric clear"),
            ],
            Scenario::Dying => vec![f(0.5, json!({"kind": "kill"}), "b1 killed")],
            Scenario::Gray => vec![
                f(0.39, json!({"kind": "freeze"}), "b1 telemetry frozen"),
                f(
                    0.4,
                    json!({"kind": "throttle", "factor": 0.4}),
                    "b1 slowed 2.5x, telemetry frozen",
                ),
            ],
            Scenario::Lying => vec![
                f(0.39, json!({"kind": "lie"}), "b1 exporter reports idle"),
                f(
                    0.4,
                    json!({"kind": "throttle", "factor": 0.4}),
                    "b1 slowed 2.5x, exporter reports idle",
                ),
            ],
            Scenario::Flapping => vec![f(
                0.25,
                json!({"kind": "flap", "factor": 1.0 / 3.0, "period_s": FLAP_PERIOD_S}),
                "b1 flapping 3x slow / normal every 10 s",
            )],
            _ => Vec::new(),
        }
    }

    /// Whether the load comes from the tenants' addresses only, split by prefix.
    pub fn tenants(self) -> bool {
        matches!(self, Scenario::NoisyTenant | Scenario::NoisyTenantCalm)
    }

    /// The noisy tenant's burst, in `noisy-tenant`; its calm cell keeps the window (the
    /// same requests compared) and bursts nothing.
    pub fn burst(self) -> Option<Burst> {
        (self == Scenario::NoisyTenant).then_some(Burst {
            from: 1.0 / 3.0,
            to: 2.0 / 3.0,
            factor: BURST_FACTOR,
        })
    }

    /// The window whose requests the tenants' figures compare (the burst's, also in the
    /// calm cell).
    pub fn burst_window(self) -> Option<(f64, f64)> {
        self.tenants().then_some((1.0 / 3.0, 2.0 / 3.0))
    }

    /// The accelerator whose streams may break (killed).
    pub fn killed(self) -> Option<usize> {
        (self == Scenario::Dying).then_some(FAULTY)
    }
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Policy {
    /// Plain weighted Maglev with a connection table: no telemetry, no health-driven changes.
    Maglev,
    /// Sluice's defaults.
    Adaptive,
    /// Defaults plus per-backend session caps and shedding (RST).
    Admission,
    /// Defaults plus in-band signals on the VIP (`inband = true`).
    Inband,
    /// Admission (session caps, RST shedding) plus the lab's tenants with limits derived
    /// from the fleet's capacity ([`super::tenants::tables`]).
    Tenants,
}

/// Every policy `--policies` knows.
pub const POLICIES: [Policy; 5] = [
    Policy::Maglev,
    Policy::Adaptive,
    Policy::Admission,
    Policy::Inband,
    Policy::Tenants,
];

/// The policies run when `--policies` is not given: tenants run on request, with the
/// scenarios that split the clients into tenants.
pub const DEFAULT_POLICIES: [Policy; 4] = [
    Policy::Maglev,
    Policy::Adaptive,
    Policy::Admission,
    Policy::Inband,
];

impl Policy {
    pub fn name(self) -> &'static str {
        match self {
            Policy::Maglev => "maglev",
            Policy::Adaptive => "adaptive",
            Policy::Admission => "adaptive+admission",
            Policy::Inband => "adaptive+inband",
            Policy::Tenants => "adaptive+tenants",
        }
    }

    pub fn parse(s: &str) -> Result<Policy> {
        match POLICIES.iter().find(|p| p.name() == s) {
            Some(p) => Ok(*p),
            None => bail!(
                "unknown policy {s:?}; known: {}",
                POLICIES.map(Policy::name).join(", ")
            ),
        }
    }

    pub fn telemetry(self) -> bool {
        self != Policy::Maglev
    }

    /// Configuration keys (section, key, TOML value) over the lab's: the shipped defaults
    /// for health, telemetry and policy (the lab's fast test timings removed), health checks
    /// an hour apart for `maglev` (never within a run: no health-driven change), RST
    /// shedding with admission.
    pub fn settings(self) -> Vec<(&'static str, &'static str, &'static str)> {
        match self {
            Policy::Maglev => vec![
                ("health", "interval", "\"1h\""),
                ("health", "timeout", "\"1s\""),
            ],
            Policy::Adaptive | Policy::Inband => Vec::new(),
            Policy::Admission | Policy::Tenants => vec![("policy", "shed", "\"rst\"")],
        }
    }

    /// `max_sessions` per backend (0: no cap).
    pub fn max_sessions(self, cap: u32) -> u32 {
        if matches!(self, Policy::Admission | Policy::Tenants) {
            cap
        } else {
            0
        }
    }
}

/// Splits a comma-separated list and parses each item.
pub fn list<T>(s: &str, parse: fn(&str) -> Result<T>) -> Result<Vec<T>> {
    s.split(',').filter(|x| !x.is_empty()).map(parse).collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_round_trip_and_faults_are_in_order() {
        for s in SCENARIOS {
            assert_eq!(Scenario::parse(s.name()).unwrap(), s);
            let at: Vec<f64> = s.faults().iter().map(|f| f.at).collect();
            assert!(
                at.windows(2).all(|w| w[0] < w[1]) && at.iter().all(|a| (0.0..1.0).contains(a))
            );
        }
        for p in POLICIES {
            assert_eq!(Policy::parse(p.name()).unwrap(), p);
        }
        assert!(Scenario::parse("calm").is_err());
        assert!(DEFAULT_SCENARIOS.iter().all(|s| SCENARIOS.contains(s)));
        assert!(DEFAULT_POLICIES.iter().all(|p| POLICIES.contains(p)));
        assert!(
            Scenario::NoisyTenant.burst().is_some() && Scenario::NoisyTenantCalm.burst().is_none()
        );
        assert_eq!(
            Scenario::NoisyTenant.burst_window(),
            Scenario::NoisyTenantCalm.burst_window()
        );
        assert_eq!(Scenario::Healthy.load(0.4), 0.4);
        assert_eq!(Scenario::Idle.load(0.4), 0.25);
        let asked = Duration::from_secs(50);
        assert_eq!(Scenario::Steady.duration(asked), Duration::from_secs(600));
        assert_eq!(Scenario::Idle.duration(asked), asked);
        assert_eq!(
            list("maglev,adaptive", Policy::parse).unwrap(),
            [Policy::Maglev, Policy::Adaptive]
        );
    }
}
