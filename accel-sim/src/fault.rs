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
}

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
    /// Applies a request (not `Kill`, which the server handles). Bad input changes nothing.
    pub fn apply(&mut self, req: &FaultRequest) -> Result<(), String> {
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
            FaultRequest::Clear => *self = Faults::default(),
            FaultRequest::Kill => return Err("kill is handled by the server".into()),
        }
        Ok(())
    }

    /// The model's speed: the start-up factor times every slowing fault.
    pub fn speed(&self, base: f64) -> f64 {
        base * self.throttle.unwrap_or(1.0) * self.congest.unwrap_or(1.0) * self.slow.unwrap_or(1.0)
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
        f.apply(&req(r#"{"kind":"throttle","factor":0.4}"#).unwrap())
            .unwrap();
        f.apply(&req(r#"{"kind":"congest","factor":0.5}"#).unwrap())
            .unwrap();
        assert!((f.speed(1.0) - 0.2).abs() < 1e-12);
        assert!((f.speed(0.5) - 0.1).abs() < 1e-12);
        assert_eq!(f.describe(), "throttle 0.4+congest 0.5");
        f.apply(&req(r#"{"kind":"freeze"}"#).unwrap()).unwrap();
        f.apply(&req(r#"{"kind":"clear"}"#).unwrap()).unwrap();
        assert_eq!(f, Faults::default());
        assert_eq!(f.describe(), "none");
        assert_eq!(req(r#"{"kind":"kill"}"#).unwrap(), FaultRequest::Kill);
    }

    #[test]
    fn bad_requests_change_nothing() {
        let mut f = Faults::default();
        let e = f
            .apply(&req(r#"{"kind":"throttle","factor":1.5}"#).unwrap())
            .unwrap_err();
        assert!(e.contains("throttle factor 1.5 is out of range"), "{e}");
        assert!(f
            .apply(&req(r#"{"kind":"slow","factor":0}"#).unwrap())
            .is_err());
        assert_eq!(f, Faults::default());
        assert!(req(r#"{"kind":"melt"}"#).unwrap_err().contains("melt"));
        assert!(req(r#"{"kind":"throttle"}"#)
            .unwrap_err()
            .contains("missing field `factor`"));
    }
}
