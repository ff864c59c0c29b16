//! The live views: `sluice top` (per-backend rates, flows, weights, steering and telemetry
//! age, and the latest events, redrawn in place) and `--watch` on the read commands. Plain
//! ANSI: move home, draw, clear what is left of the old frame.

use std::{
    collections::BTreeMap,
    io::Write,
    time::{Duration, Instant},
};

use anyhow::{bail, Result};
use serde_json::Value;

use super::{cell, event_row, items, table, EVENT_COLUMNS};
use crate::client::{path_segment, Client};

/// Cursor home, then the frame, then clear to the end of the screen: no flicker, no
/// leftovers from a longer previous frame.
pub(super) fn frame(text: &str) -> String {
    let mut s = String::from("\x1b[H");
    for line in text.lines() {
        // Clear each line's old tail.
        s += line;
        s += "\x1b[K\n";
    }
    s + "\x1b[J"
}

/// Parses `--watch` / `--every` values like "2s" or "500ms" (at least 100 ms).
pub fn interval(s: &str) -> Result<Duration, String> {
    let d = humantime::parse_duration(s)
        .map_err(|e| format!("{s:?} is not a duration like \"2s\" or \"500ms\": {e}"))?;
    if d < Duration::from_millis(100) {
        return Err(format!("{s:?} is too short: at least 100ms"));
    }
    Ok(d)
}

/// Redraws `draw`'s output every `every`, `rounds` times (forever when None; Ctrl-C ends it).
pub(super) fn repeat(
    out: &mut dyn Write,
    every: Duration,
    rounds: Option<u64>,
    mut draw: impl FnMut(&mut dyn Write) -> Result<()>,
) -> Result<()> {
    write!(out, "\x1b[2J")?;
    let mut n = 0;
    loop {
        let started = Instant::now();
        let mut buf = Vec::new();
        if let Err(e) = draw(&mut buf) {
            // A daemon restart should not end the view: show the error, try again.
            buf = format!("{e:#}\n").into_bytes();
        }
        write!(out, "{}", frame(&String::from_utf8_lossy(&buf)))?;
        out.flush()?;
        n += 1;
        if rounds.is_some_and(|r| n >= r) {
            return Ok(());
        }
        std::thread::sleep(every.saturating_sub(started.elapsed()));
    }
}

/// One reading of the daemon for `top`.
#[derive(Clone, Debug)]
pub(super) struct Sample {
    pub at: Instant,
    pub status: Value,
    /// VIP name → its backends (`GET /v1/vips/{vip}/backends`).
    pub backends: BTreeMap<String, Vec<Value>>,
    pub events: Vec<Value>,
}

impl Sample {
    pub(super) fn take(client: &Client) -> Result<Sample> {
        let status = client.call("GET", "/v1/status", None)?;
        let vips = client.call("GET", "/v1/vips", None)?;
        let mut backends = BTreeMap::new();
        for v in items(&vips["vips"]) {
            let Some(name) = v["name"].as_str() else {
                bail!("a VIP without a name in /v1/vips: {v}");
            };
            let path = format!("/v1/vips/{}/backends", path_segment(name));
            let b = client.call("GET", &path, None)?;
            backends.insert(name.to_string(), items(&b["backends"]).to_vec());
        }
        let events = client.call("GET", "/v1/events", None)?;
        Ok(Sample {
            at: Instant::now(),
            status,
            backends,
            events: items(&events["events"]).to_vec(),
        })
    }
}

/// "1.2k", "3.4M": rates in a narrow column.
fn si(x: f64) -> String {
    let (v, unit) = match x {
        x if x >= 1e9 => (x / 1e9, "G"),
        x if x >= 1e6 => (x / 1e6, "M"),
        x if x >= 1e3 => (x / 1e3, "k"),
        x => (x, ""),
    };
    if unit.is_empty() {
        format!("{v:.0}")
    } else {
        format!("{v:.1}{unit}")
    }
}

/// Draws one `top` frame: rates are the counters' change since `prev` (blank on the first).
pub(super) fn render_top(
    out: &mut dyn Write,
    prev: Option<&Sample>,
    cur: &Sample,
    events: usize,
) -> Result<()> {
    let s = &cur.status;
    writeln!(
        out,
        "sluice {}  up {}  vips {}  backends {}  pid {}",
        cell(&s["version"]),
        humantime::format_duration(Duration::from_secs(s["uptime_s"].as_u64().unwrap_or(0))),
        cell(&s["vips"]),
        cell(&s["backends"]),
        cell(&s["pid"]),
    )?;
    writeln!(out)?;
    let dt = prev.map(|p| cur.at.saturating_duration_since(p.at).as_secs_f64());
    let before = |vip: &str, addr: &Value| {
        prev?
            .backends
            .get(vip)?
            .iter()
            .find(|b| b["address"] == *addr)
    };
    let mut rows = vec![];
    for (vip, bs) in &cur.backends {
        for b in bs {
            let rate = |key: &str, scale: f64| match (dt, before(vip, &b["address"])) {
                (Some(dt), Some(p)) if dt > 0.0 => {
                    let now = b["traffic"][key].as_u64().unwrap_or(0);
                    let then = p["traffic"][key].as_u64().unwrap_or(0);
                    si(now.saturating_sub(then) as f64 * scale / dt)
                }
                _ => "-".into(),
            };
            let st = &b["steering"];
            let steer = match (st["state"].as_str(), st["reason"].as_str()) {
                (None, _) => "-".to_string(),
                (Some(x), None) => x.to_string(),
                (Some(x), Some(r)) => format!("{x} ({r})"),
            };
            let age = st["telemetry_age_s"]
                .as_f64()
                .map_or_else(|| "-".into(), |a| format!("{a:.1}s"));
            rows.push(vec![
                vip.clone(),
                cell(&b["address"]),
                cell(&b["state"]),
                steer,
                format!("{}/{}", cell(&b["effective_weight"]), cell(&b["weight"])),
                cell(&b["active_flows"]),
                rate("new_flows", 1.0),
                rate("packets", 1.0),
                rate("bytes", 8.0),
                age,
            ]);
        }
    }
    table(
        out,
        &[
            "VIP",
            "BACKEND",
            "STATE",
            "STEERING",
            "WEIGHT",
            "FLOWS",
            "NEW/S",
            "PKT/S",
            "BIT/S",
            "TELEMETRY",
        ],
        &rows,
    )?;
    writeln!(out)?;
    let recent: Vec<Vec<String>> = cur
        .events
        .iter()
        .rev()
        .take(events)
        .map(event_row)
        .collect();
    table(out, &EVENT_COLUMNS, &recent)
}

#[cfg(test)]
mod tests {
    use serde_json::json;

    use super::*;

    fn sample(at: Instant, packets: u64, bytes: u64) -> Sample {
        Sample {
            at,
            status: json!({"version": "1.0", "uptime_s": 61, "vips": 1, "backends": 1, "pid": 7}),
            backends: BTreeMap::from([(
                "chat".to_string(),
                vec![json!({
                    "address": "10.1.0.1", "state": "active", "weight": 100,
                    "effective_weight": 50, "active_flows": 3,
                    "traffic": {"packets": packets, "bytes": bytes, "new_flows": 2},
                    "steering": {"state": "moved-away", "reason": "congestion",
                                 "telemetry_age_s": 0.5},
                })],
            )]),
            events: vec![
                json!({"time_ms": 0, "kind": "old", "vip": "chat", "backend": null, "reason": "a"}),
                json!({"time_ms": 0, "kind": "weight", "vip": "chat", "backend": "10.1.0.1", "reason": "b"}),
            ],
        }
    }

    #[test]
    fn top_shows_rates_from_the_previous_sample_and_the_latest_events() {
        let t0 = Instant::now();
        let a = sample(t0, 1000, 100_000);
        let b = sample(t0 + Duration::from_secs(2), 5000, 1_100_000);
        let mut out = vec![];
        render_top(&mut out, Some(&a), &b, 1).unwrap();
        let text = String::from_utf8(out).unwrap();
        let row = text.lines().find(|l| l.starts_with("chat")).unwrap();
        let cols: Vec<&str> = row.split_whitespace().collect();
        // 4000 packets and 8 Mbit over 2 s; weight effective/configured; reason shown.
        assert_eq!(
            cols,
            [
                "chat",
                "10.1.0.1",
                "active",
                "moved-away",
                "(congestion)",
                "50/100",
                "3",
                "0",
                "2.0k",
                "4.0M",
                "0.5s"
            ]
        );
        assert!(text.starts_with("sluice 1.0  up 1m 1s  vips 1  backends 1  pid 7\n"));
        assert!(text.contains(" weight "), "{text}");
        assert!(!text.contains(" old "), "only the latest event: {text}");
        // Without a previous sample there is no rate.
        let mut out = vec![];
        render_top(&mut out, None, &b, 5).unwrap();
        let text = String::from_utf8(out).unwrap();
        let row = text.lines().find(|l| l.starts_with("chat")).unwrap();
        assert_eq!(row.split_whitespace().nth(8), Some("-"));
    }

    #[test]
    fn frames_redraw_in_place() {
        assert_eq!(frame("a\nbc\n"), "\x1b[Ha\x1b[K\nbc\x1b[K\n\x1b[J");
        let mut out = vec![];
        let mut n = 0;
        repeat(&mut out, Duration::from_millis(1), Some(2), |w| {
            n += 1;
            Ok(writeln!(w, "round {n}")?)
        })
        .unwrap();
        assert_eq!(
            String::from_utf8(out).unwrap(),
            "\x1b[2J\x1b[Hround 1\x1b[K\n\x1b[J\x1b[Hround 2\x1b[K\n\x1b[J"
        );
        assert!(interval("50ms").is_err());
        assert_eq!(interval("2s"), Ok(Duration::from_secs(2)));
    }
}
