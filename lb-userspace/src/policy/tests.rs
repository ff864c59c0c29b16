//! Shared test helpers.

use std::time::Duration;

use crate::telemetry::{BackendTelemetry, Sample};

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
