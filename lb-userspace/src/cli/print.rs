//! The printers of the read commands: tables and rows from the admin API's JSON, every
//! string escaped for the terminal.

use std::{
    io::Write,
    time::{Duration, UNIX_EPOCH},
};

use anyhow::Result;
use serde_json::Value;

use crate::clock::now_ms;
use crate::escape;

pub(super) fn print_sample(out: &mut dyn Write, v: &Value) -> Result<()> {
    for (k, v) in v.as_object().into_iter().flatten() {
        let shown = match v {
            Value::Null => "-".to_string(),
            Value::Number(n) if k == "throttle" => format!("{:#x}", n.as_u64().unwrap_or(0)),
            other => other.to_string(),
        };
        writeln!(out, "{:<12} {}", escape::text(k), escape::text(&shown))?;
    }
    Ok(())
}

/// A JSON value as a table cell: strings bare (escaped for the terminal), null as "-".
pub(super) fn cell(v: &Value) -> String {
    match v {
        Value::Null => "-".into(),
        Value::String(s) => escape::text(s).into_owned(),
        other => other.to_string(),
    }
}

/// "10.0.0.1:443" or "[fd00::1]:443" from an object with address and port.
pub(super) fn host_port(v: &Value) -> String {
    let addr = cell(&v["address"]);
    if addr.contains(':') {
        format!("[{addr}]:{}", cell(&v["port"]))
    } else {
        format!("{addr}:{}", cell(&v["port"]))
    }
}

/// RFC 3339 time of unix milliseconds `ms`; a value past year 9999 (which RFC 3339 cannot
/// write, and no daemon sends) is shown as the number rather than panicking.
pub(super) fn timestamp(ms: u64) -> String {
    const YEAR_10000_MS: u64 = 253_402_300_800_000;
    if ms >= YEAR_10000_MS {
        return format!("{ms} ms after 1970");
    }
    humantime::format_rfc3339_seconds(UNIX_EPOCH + Duration::from_millis(ms)).to_string()
}

/// "3m ago" or "in 7m" relative to now.
fn relative(ms: u64) -> String {
    let now = now_ms();
    let d = |ms: u64| humantime::format_duration(Duration::from_secs(ms / 1000)).to_string();
    if ms <= now {
        format!("{} ago", d(now - ms))
    } else {
        format!("in {}", d(ms - now))
    }
}

/// Aligned columns separated by two spaces; the last column is not padded.
/// Every cell goes through the escaper: cells hold what the daemon sent.
pub(super) fn table(out: &mut dyn Write, header: &[&str], rows: &[Vec<String>]) -> Result<()> {
    let header: Vec<String> = header.iter().map(|h| h.to_string()).collect();
    let rows: Vec<Vec<String>> = rows
        .iter()
        .map(|r| r.iter().map(|c| escape::text(c).into_owned()).collect())
        .collect();
    let mut widths: Vec<usize> = header.iter().map(|h| h.len()).collect();
    for row in &rows {
        for (w, c) in widths.iter_mut().zip(row) {
            *w = (*w).max(c.chars().count());
        }
    }
    for row in std::iter::once(&header).chain(&rows) {
        let mut line = String::new();
        for (i, (c, w)) in row.iter().zip(&widths).enumerate() {
            if i + 1 == row.len() {
                line += c;
            } else {
                line += &format!("{c:<w$}  ");
            }
        }
        writeln!(out, "{}", line.trim_end())?;
    }
    Ok(())
}

pub(super) fn items(v: &Value) -> &[Value] {
    v.as_array().map_or(&[], Vec::as_slice)
}

pub(super) fn print_status(out: &mut dyn Write, v: &Value) -> Result<()> {
    let interfaces: Vec<String> = items(&v["interfaces"])
        .iter()
        .map(|i| format!("{} ({})", cell(&i["name"]), cell(&i["mode"])))
        .collect();
    let uptime =
        humantime::format_duration(Duration::from_secs(v["uptime_s"].as_u64().unwrap_or(0)));
    let rows = [
        ("version", cell(&v["version"])),
        ("pid", cell(&v["pid"])),
        ("uptime", uptime.to_string()),
        ("interfaces", interfaces.join(", ")),
        ("pin dir", cell(&v["pin_dir"])),
        (
            "data plane",
            if v["dataplane_reused"].as_bool() == Some(true) {
                "re-adopted from pinned maps".to_string()
            } else {
                "created at start".to_string()
            },
        ),
        ("vips", cell(&v["vips"])),
        ("backends", cell(&v["backends"])),
    ];
    for (k, val) in rows {
        writeln!(out, "{k:<12}{}", escape::text(&val))?;
    }
    if !v["announce"].is_null() {
        for (k, val) in super::lb::rows(&v["announce"]) {
            writeln!(out, "{k:<12}{}", escape::text(&val))?;
        }
    }
    if v["fleet"].is_object() {
        for (k, val) in crate::fleet::status_rows(&v["fleet"]) {
            writeln!(out, "{k:<12}{}", escape::text(&val))?;
        }
    }
    Ok(())
}

pub(super) fn print_vips(out: &mut dyn Write, v: &Value) -> Result<()> {
    let rows: Vec<Vec<String>> = items(&v["vips"])
        .iter()
        .map(|v| {
            let affinity = match v["affinity_secs"].as_u64() {
                Some(0) | None => "-".to_string(),
                Some(s) => humantime::format_duration(Duration::from_secs(s)).to_string(),
            };
            vec![
                cell(&v["name"]),
                cell(&v["protocol"]),
                host_port(v),
                cell(&v["hash"]),
                affinity,
                cell(&v["priority"]),
                cell(&v["backend_count"]),
                cell(&v["active_flows"]),
                cell(&v["traffic"]["packets"]),
                cell(&v["traffic"]["bytes"]),
            ]
        })
        .collect();
    table(
        out,
        &[
            "NAME", "PROTO", "ADDRESS", "HASH", "AFFINITY", "PRIO", "BACKENDS", "FLOWS", "PACKETS",
            "BYTES",
        ],
        &rows,
    )
}

pub(super) fn print_backends(out: &mut dyn Write, v: &Value) -> Result<()> {
    let rows: Vec<Vec<String>> = items(&v["backends"])
        .iter()
        .map(|b| {
            let drain = match (
                b["drain_since_ms"].as_u64(),
                b["drain_deadline_ms"].as_u64(),
            ) {
                (None, _) => "-".to_string(),
                (Some(since), None) => format!("since {}", relative(since)),
                (Some(since), Some(d)) => {
                    format!("since {}, deadline {}", relative(since), relative(d))
                }
            };
            let labels = b["labels"]
                .as_object()
                .map(|m| {
                    m.iter()
                        .map(|(k, v)| format!("{k}={}", cell(v)))
                        .collect::<Vec<_>>()
                        .join(",")
                })
                .filter(|s| !s.is_empty())
                .unwrap_or_else(|| "-".into());
            // The adaptive policy's view, when it has one for this backend.
            let s = &b["steering"];
            let steer = match (s["state"].as_str(), s["reason"].as_str()) {
                (None, _) => "-".to_string(),
                (Some(st), None) => st.to_string(),
                (Some(st), Some(r)) => format!("{st} ({r})"),
            };
            let secs = |v: &Value| {
                v.as_f64()
                    .map_or_else(|| "-".to_string(), |x| format!("{x:.1}s"))
            };
            let score = s["score"]
                .as_f64()
                .map_or_else(|| "-".to_string(), |x| format!("{x:.2}"));
            let cooldown = match s["cooldown_left_s"].as_f64() {
                Some(x) if x > 0.0 => format!("{x:.0}s"),
                Some(_) => "-".to_string(),
                None => "-".to_string(),
            };
            vec![
                cell(&b["address"]),
                cell(&b["id"]),
                cell(&b["weight"]),
                cell(&b["effective_weight"]),
                cell(&b["state"]),
                steer,
                score,
                cooldown,
                secs(&s["telemetry_age_s"]),
                match (s["ttfb_s"].as_f64(), s["delivery_bps"].as_f64()) {
                    (None, None) => "-".to_string(),
                    (t, r) => format!(
                        "{}/{}",
                        t.map_or("-".into(), |t| format!("{t:.2}s")),
                        r.map_or("-".into(), |r| format!("{:.1}kB/s", r / 1e3))
                    ),
                },
                // Completed of started TCP handshakes, the newest the refusing rule judges.
                match (
                    s["handshakes"]["completed"].as_u64(),
                    s["handshakes"]["started"].as_u64(),
                ) {
                    (Some(c), Some(n)) => format!("{c}/{n}"),
                    _ => "-".to_string(),
                },
                if b["healthy"].as_bool() == Some(false) {
                    "no"
                } else {
                    "yes"
                }
                .into(),
                cell(&b["active_flows"]),
                cell(&b["traffic"]["packets"]),
                cell(&b["traffic"]["bytes"]),
                drain,
                cell(&b["quic_server_id"]),
                labels,
            ]
        })
        .collect();
    table(
        out,
        &[
            "ADDRESS",
            "ID",
            "WEIGHT",
            "EFFECTIVE",
            "STATE",
            "STEERING",
            "SCORE",
            "COOLDOWN",
            "TELEMETRY",
            "INBAND",
            "HANDSHAKES",
            "HEALTHY",
            "FLOWS",
            "PACKETS",
            "BYTES",
            "DRAIN",
            "QUIC-ID",
            "LABELS",
        ],
        &rows,
    )
}

pub(super) fn print_flows(out: &mut dyn Write, v: &Value) -> Result<()> {
    let mut rows = vec![];
    for vip in items(&v["vips"]) {
        rows.push(vec![
            cell(&vip["vip"]),
            "(all)".into(),
            cell(&vip["active_flows"]),
        ]);
        for b in items(&vip["backends"]) {
            rows.push(vec![
                cell(&vip["vip"]),
                cell(&b["address"]),
                cell(&b["active_flows"]),
            ]);
        }
    }
    table(out, &["VIP", "BACKEND", "FLOWS"], &rows)
}

pub(super) fn print_stats(out: &mut dyn Write, v: &Value) -> Result<()> {
    // In the data plane's order (receive, passes, steering, drops, transmit), not by name.
    let global: Vec<Vec<String>> = lb_common::stat::NAMES
        .iter()
        .map(|n| vec![n.to_string(), cell(&v["global"][n])])
        .collect();
    table(out, &["COUNTER", "VALUE"], &global)?;
    writeln!(out)?;
    let t = |row: &mut Vec<String>, t: &Value| {
        row.extend(
            [
                "packets",
                "bytes",
                "new_flows",
                "handshakes",
                "handshakes_completed",
            ]
            .map(|k| cell(&t[k])),
        );
    };
    let mut rows = vec![];
    for vip in items(&v["vips"]) {
        let mut row = vec![cell(&vip["vip"]), "(all)".into()];
        t(&mut row, &vip["traffic"]);
        rows.push(row);
        for b in items(&vip["backends"]) {
            let mut row = vec![cell(&vip["vip"]), cell(&b["address"])];
            t(&mut row, &b["traffic"]);
            rows.push(row);
        }
    }
    table(
        out,
        &[
            "VIP",
            "BACKEND",
            "PACKETS",
            "BYTES",
            "NEW FLOWS",
            "HANDSHAKES",
            "COMPLETED",
        ],
        &rows,
    )
}

pub(super) fn print_events(out: &mut dyn Write, v: &Value) -> Result<()> {
    let rows: Vec<Vec<String>> = items(&v["events"]).iter().map(event_row).collect();
    table(out, &EVENT_COLUMNS, &rows)
}

/// The columns of an event listing ([`event_row`]).
pub(crate) const EVENT_COLUMNS: [&str; 5] = ["TIME", "KIND", "VIP", "BACKEND", "REASON"];

/// One event of the daemon's event log as a table row.
pub(crate) fn event_row(e: &Value) -> Vec<String> {
    vec![
        e["time_ms"].as_u64().map_or_else(|| "-".into(), timestamp),
        cell(&e["kind"]),
        cell(&e["vip"]),
        cell(&e["backend"]),
        cell(&e["reason"]),
    ]
}
