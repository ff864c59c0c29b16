//! The faults an accelerator can be put into at run time (`POST /fault` on the control
//! listener), and what each does to the model's speed and to the telemetry.

use serde::{Deserialize, Serialize};

/// A request to the control endpoint.
#[derive(Clone, Debug, PartialEq, Deserialize)]
#[serde(tag = "kind", rename_all = "lowercase", deny_unknown_fields)]
pub enum FaultRequest {
    /// Clocks throttled: steps and prefill slowed to `factor` (0 < factor <= 1); DCGM reports
    /// hardware slowdown and thermal throttling, a lower SM clock and a high temperature.
    Throttle { factor: f64 },
    /// Congested fabric: steps slowed to `factor`, RoCE ECN-marked packets and CNPs grow with
    /// the accelerator's traffic.
    Congest { factor: f64 },
    /// A slower accelerator: speed scaled by `factor`, nothing in the telemetry says why.
    Slow { factor: f64 },
    /// Accepts connections and never answers; streams stop.
    Hang,
    /// Telemetry pages keep the values they had; the model goes on.
    Freeze,
    /// Telemetry pages report an idle accelerator (nothing running or waiting, no KV in use,
    /// no utilisation, no throttle, counters standing still) whatever the model does, as an
    /// exporter that lies; the model keeps its real pace.
    Lie,
    /// A throttle that comes and goes: slowed to `factor` for `period_s` seconds, then full
    /// speed for `period_s`, and so on, starting slowed; DCGM reports the throttle while it
    /// is in force, as a thermal throttle does.
    Flap { factor: f64, period_s: f64 },
    /// The process exits at once and its connections are reset.
    Kill,
    /// Back to healthy (the start-up `--slow` stays).
    Clear,
}

/// The faults in force.
#[derive(Clone, Debug, Default, PartialEq, Serialize)]
pub struct Faults {
    pub throttle: Option<f64>,
    pub congest: Option<f64>,
    pub slow: Option<f64>,
    pub hang: bool,
    pub freeze: bool,
    pub lie: bool,
    pub flap: Option<Flap>,
}

/// A flapping throttle ([`FaultRequest::Flap`]).
#[derive(Clone, Copy, Debug, PartialEq, Serialize)]
pub struct Flap {
    pub factor: f64,
    pub period_s: f64,
    /// When it began, seconds on the accelerator's clock.
    pub since_s: f64,
}

impl Flap {
    /// Whether the throttle is in force at `now_s`: the even periods from `since_s` on.
    pub fn slowed(&self, now_s: f64) -> bool {
        let k = ((now_s - self.since_s) / self.period_s).floor();
        k % 2.0 == 0.0
    }

    /// When the throttle next goes on or off after `now_s`.
    pub fn next_change_s(&self, now_s: f64) -> f64 {
        let k = ((now_s - self.since_s) / self.period_s).floor().max(0.0);
        self.since_s + (k + 1.0) * self.period_s
    }
}

/// The longest flapping period: longer is a throttle and a recovery, not a flap.
pub const FLAP_PERIOD_MAX_S: f64 = 3600.0;

/// A speed factor: finite, in (0, 1].
pub fn check_factor(kind: &str, factor: f64) -> Result<f64, String> {
    if factor.is_finite() && factor > 0.0 && factor <= 1.0 {
        Ok(factor)
    } else {
        Err(format!(
            "{kind} factor {factor} is out of range; allowed: 0 < factor <= 1 (the fraction of \
             full speed)"
        ))
    }
}

impl Faults {
    /// Applies a request (not `Kill`, which the server handles) at `now_s` on the
    /// accelerator's clock. Bad input changes nothing.
    pub fn apply(&mut self, req: &FaultRequest, now_s: f64) -> Result<(), String> {
        match *req {
            FaultRequest::Throttle { factor } => {
                self.throttle = Some(check_factor("throttle", factor)?)
            }
            FaultRequest::Congest { factor } => {
                self.congest = Some(check_factor("congest", factor)?)
            }
            FaultRequest::Slow { factor } => self.slow = Some(check_factor("slow", factor)?),
            FaultRequest::Hang => self.hang = true,
            FaultRequest::Freeze => self.freeze = true,
            FaultRequest::Lie => self.lie = true,
            FaultRequest::Flap { factor, period_s } => {
                let factor = check_factor("flap", factor)?;
                if !(period_s.is_finite() && period_s > 0.0 && period_s <= FLAP_PERIOD_MAX_S) {
                    return Err(format!(
                        "flap period_s {period_s} is out of range; allowed: 0 < period_s <= \
                         {FLAP_PERIOD_MAX_S} (seconds slowed, then as many at full speed)"
                    ));
                }
                self.flap = Some(Flap {
                    factor,
                    period_s,
                    since_s: now_s,
                });
            }
            FaultRequest::Clear => *self = Faults::default(),
            FaultRequest::Kill => return Err("kill is handled by the server".into()),
        }
        Ok(())
    }

    /// The throttle factor in force at `now_s` (a throttle, a flap in its slowed period, or
    /// both), as DCGM reports it.
    pub fn throttle_at(&self, now_s: f64) -> Option<f64> {
        let flap = self.flap.filter(|f| f.slowed(now_s)).map(|f| f.factor);
        match (self.throttle, flap) {
            (Some(a), Some(b)) => Some(a * b),
            (a, b) => a.or(b),
        }
    }

    /// The model's speed at `now_s`: the start-up factor times every slowing fault.
    pub fn speed(&self, base: f64, now_s: f64) -> f64 {
        base * self.throttle_at(now_s).unwrap_or(1.0)
            * self.congest.unwrap_or(1.0)
            * self.slow.unwrap_or(1.0)
    }

    /// A short description for `/state`: `none`, or the faults joined by `+`.
    pub fn describe(&self) -> String {
        let mut parts = Vec::new();
        if let Some(f) = self.throttle {
            parts.push(format!("throttle {f}"));
        }
        if let Some(f) = self.congest {
            parts.push(format!("congest {f}"));
        }
        if let Some(f) = self.slow {
            parts.push(format!("slow {f}"));
        }
        if self.hang {
            parts.push("hang".into());
        }
        if self.freeze {
            parts.push("freeze".into());
        }
        if self.lie {
            parts.push("lie".into());
        }
        if let Some(f) = self.flap {
            parts.push(format!("flap {} every {} s", f.factor, f.period_s));
        }
        if parts.is_empty() {
            "none".into()
        } else {
            parts.join("+")
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn req(json: &str) -> Result<FaultRequest, String> {
        serde_json::from_str(json).map_err(|e| e.to_string())
    }

    #[test]
    fn requests_parse_and_combine() {
        let mut f = Faults::default();
        f.apply(&req(r#"{"kind":"throttle","factor":0.4}"#).unwrap(), 0.0)
            .unwrap();
        f.apply(&req(r#"{"kind":"congest","factor":0.5}"#).unwrap(), 0.0)
            .unwrap();
        assert!((f.speed(1.0, 0.0) - 0.2).abs() < 1e-12);
        assert!((f.speed(0.5, 0.0) - 0.1).abs() < 1e-12);
        assert_eq!(f.describe(), "throttle 0.4+congest 0.5");
        f.apply(&req(r#"{"kind":"freeze"}"#).unwrap(), 0.0).unwrap();
        f.apply(&req(r#"{"kind":"lie"}"#).unwrap(), 0.0).unwrap();
        assert_eq!(f.describe(), "throttle 0.4+congest 0.5+freeze+lie");
        f.apply(&req(r#"{"kind":"clear"}"#).unwrap(), 0.0).unwrap();
        assert_eq!(f, Faults::default());
        assert_eq!(f.describe(), "none");
        assert_eq!(req(r#"{"kind":"kill"}"#).unwrap(), FaultRequest::Kill);
    }

    #[test]
    fn bad_requests_change_nothing() {
        let mut f = Faults::default();
        let e = f
            .apply(&req(r#"{"kind":"throttle","factor":1.5}"#).unwrap(), 0.0)
            .unwrap_err();
        assert!(e.contains("throttle factor 1.5 is out of range"), "{e}");
        assert!(f
            .apply(&req(r#"{"kind":"slow","factor":0}"#).unwrap(), 0.0)
            .is_err());
        let e = f
            .apply(
                &req(r#"{"kind":"flap","factor":0.5,"period_s":0}"#).unwrap(),
                0.0,
            )
            .unwrap_err();
        assert!(e.contains("flap period_s 0 is out of range"), "{e}");
        assert!(f
            .apply(
                &req(r#"{"kind":"flap","factor":2,"period_s":10}"#).unwrap(),
                0.0
            )
            .is_err());
        assert_eq!(f, Faults::default());
        assert!(req(r#"{"kind":"flap","factor":0.5}"#)
            .unwrap_err()
            .contains("missing field `period_s`"));
        assert!(req(r#"{"kind":"melt"}"#).unwrap_err().contains("melt"));
        assert!(req(r#"{"kind":"throttle"}"#)
            .unwrap_err()
            .contains("missing field `factor`"));
    }

    #[test]
    fn a_flap_alternates_slowed_and_full_speed_from_its_start() {
        let mut f = Faults::default();
        f.apply(
            &req(r#"{"kind":"flap","factor":0.25,"period_s":10}"#).unwrap(),
            100.0,
        )
        .unwrap();
        let speed = |t: f64| f.speed(1.0, t);
        // Slowed first, then full speed, then slowed again, each for one period.
        assert_eq!(speed(100.0), 0.25);
        assert_eq!(speed(109.9), 0.25);
        assert_eq!(speed(110.0), 1.0);
        assert_eq!(speed(119.9), 1.0);
        assert_eq!(speed(120.0), 0.25);
        assert_eq!(speed(135.0), 1.0);
        // DCGM sees the throttle only while it is in force; with a throttle too, both.
        assert_eq!(f.throttle_at(105.0), Some(0.25));
        assert_eq!(f.throttle_at(115.0), None);
        f.apply(&req(r#"{"kind":"throttle","factor":0.5}"#).unwrap(), 130.0)
            .unwrap();
        assert_eq!(f.throttle_at(125.0), Some(0.125));
        assert_eq!(f.throttle_at(115.0), Some(0.5));
        let flap = f.flap.unwrap();
        assert_eq!(flap.next_change_s(100.0), 110.0);
        assert_eq!(flap.next_change_s(115.0), 120.0);
        assert_eq!(f.describe(), "throttle 0.5+flap 0.25 every 10 s");
        f.apply(&req(r#"{"kind":"clear"}"#).unwrap(), 140.0)
            .unwrap();
        assert_eq!(f.speed(1.0, 140.0), 1.0);
    }
}
