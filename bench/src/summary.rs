//! Summaries of repeated measurements, shared by every benchmark.

use serde_json::{json, Value};

/// Median, minimum and 90th percentile (nearest rank) of a sample.
#[derive(Clone, Copy, Debug)]
pub struct Summary {
    pub median: f64,
    pub min: f64,
    pub p90: f64,
}

impl Summary {
    pub fn of(v: &[f64]) -> Summary {
        let mut s: Vec<f64> = v.iter().copied().filter(|x| x.is_finite()).collect();
        if s.is_empty() {
            return Summary {
                median: f64::NAN,
                min: f64::NAN,
                p90: f64::NAN,
            };
        }
        s.sort_by(|a, b| a.partial_cmp(b).unwrap());
        let n = s.len();
        let median = if n % 2 == 1 {
            s[n / 2]
        } else {
            (s[n / 2 - 1] + s[n / 2]) / 2.0
        };
        let rank = ((0.9 * n as f64).ceil() as usize).clamp(1, n);
        Summary {
            median,
            min: s[0],
            p90: s[rank - 1],
        }
    }

    pub fn json(&self) -> Value {
        json!({ "median": r1(self.median), "min": r1(self.min), "p90": r1(self.p90) })
    }
}

pub fn r1(x: f64) -> f64 {
    (x * 10.0).round() / 10.0
}
