//! The policy's audit events: what changed, for which backend, and why.

use std::{net::IpAddr, time::Duration};

use serde::Serialize;

use super::{secs, BackendInput};

/// `Down` and `Up` come from `health::Health::record`, the rest from `Policy::step`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
#[serde(rename_all = "kebab-case")]
pub enum EventKind {
    WeightChange,
    Reroute,
    CooldownStart,
    CooldownExtend,
    Recover,
    Down,
    Up,
    ShedStart,
    ShedStop,
    /// An exporter says nothing is wrong while the in-band signals say slow.
    TelemetryMismatch,
}

impl EventKind {
    pub fn as_str(self) -> &'static str {
        match self {
            EventKind::WeightChange => "weight-change",
            EventKind::Reroute => "reroute",
            EventKind::CooldownStart => "cooldown-start",
            EventKind::CooldownExtend => "cooldown-extend",
            EventKind::Recover => "recover",
            EventKind::Down => "down",
            EventKind::Up => "up",
            EventKind::ShedStart => "shed-start",
            EventKind::ShedStop => "shed-stop",
            EventKind::TelemetryMismatch => "telemetry-mismatch",
        }
    }
}

/// An audit event; `telemetry` is the backend's telemetry view at the time, as JSON.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct PolicyEvent {
    #[serde(rename = "at_s", serialize_with = "secs")]
    pub at: Duration,
    pub kind: EventKind,
    pub vip: String,
    pub backend: Option<IpAddr>,
    pub reason: String,
    pub telemetry: Option<serde_json::Value>,
}

/// An event about `input`'s backend, with its telemetry at the time.
pub(super) fn backend_event(
    now: Duration,
    input: &BackendInput,
    kind: EventKind,
    reason: String,
) -> PolicyEvent {
    PolicyEvent {
        at: now,
        kind,
        vip: input.vip.to_owned(),
        backend: Some(input.address),
        reason,
        telemetry: input.telemetry.and_then(|t| serde_json::to_value(t).ok()),
    }
}
