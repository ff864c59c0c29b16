//! `sluice lb`: this host's route announcement (`[bgp]`). `drain` takes the host out for
//! maintenance (every route withdrawn) and waits until its flows have moved or the deadline;
//! `undrain` brings it back.

use std::{
    io::Write,
    time::{Duration, Instant},
};

use anyhow::{bail, Result};
use clap::Subcommand;
use serde_json::Value;

use super::{cell, items, Output};
use crate::client::Client;

#[derive(Subcommand, Debug)]
pub enum LbCommand {
    /// Withdraw every route of this host and wait until its flows have moved to other hosts
    #[command(after_help = "\
Examples:
  sluice lb drain
  sluice lb drain --deadline 30m

Returns when a count of active flows taken after the withdrawal finds none (the host can
then be stopped without breaking a stream), or fails at the deadline naming how many flows
are left. The host stays in maintenance until `sluice lb undrain`.")]
    Drain {
        /// How long to wait for the flows to move.
        #[arg(long, default_value = "10m", value_parser = humantime::parse_duration, value_name = "DURATION")]
        deadline: Duration,
    },
    /// End maintenance: announce the served VIPs again
    #[command(after_help = "Example:\n  sluice lb undrain")]
    Undrain,
    /// Show what this host announces, and why
    #[command(after_help = "Example:\n  sluice lb status")]
    Status,
}

/// How often `drain` asks whether the host is empty.
const POLL: Duration = Duration::from_millis(200);

pub fn run(cmd: &LbCommand, client: &Client, out: &mut Output) -> Result<()> {
    match cmd {
        LbCommand::Status => out.show(&client.call("GET", "/v1/lb", None)?, print),
        LbCommand::Undrain => out.show(&client.call("POST", "/v1/lb/undrain", None)?, print),
        LbCommand::Drain { deadline } => {
            let started = Instant::now();
            let mut v = client.call("POST", "/v1/lb/drain", None)?;
            if !out.json {
                writeln!(out.out, "maintenance: withdrawing every route of this host")?;
            }
            let mut said_withdrawn = false;
            while v["drained_ms"].is_null() {
                if !said_withdrawn && !v["withdrawn_ms"].is_null() && !out.json {
                    writeln!(out.out, "routes withdrawn; waiting for the flows to move")?;
                    said_withdrawn = true;
                }
                if started.elapsed() >= *deadline {
                    let what = if v["withdrawn_ms"].is_null() {
                        format!(
                            "the routes are not withdrawn yet ({})",
                            v["speaker_error"]
                                .as_str()
                                .unwrap_or("BIRD has not taken them")
                        )
                    } else {
                        format!(
                            "{} active flows are still on this host",
                            cell(&v["active_flows"])
                        )
                    };
                    bail!(
                        "deadline {} reached: {what}; the host stays in maintenance",
                        humantime::format_duration(*deadline)
                    );
                }
                std::thread::sleep(POLL);
                v = client.call("GET", "/v1/lb", None)?;
            }
            let took = started.elapsed();
            if out.json {
                return out.show(&v, print);
            }
            writeln!(
                out.out,
                "drained in {:.1}s: no active flow left; the host can be taken down (`sluice lb undrain` brings it back)",
                took.as_secs_f64()
            )?;
            Ok(())
        }
    }
}

/// One line per fact, for `sluice lb status` and the announce part of `sluice status`.
pub fn rows(v: &Value) -> Vec<(&'static str, String)> {
    let state = if !v["drained_ms"].is_null() {
        "maintenance, drained".to_string()
    } else if !v["maintenance_since_ms"].is_null() {
        format!(
            "maintenance, {} active flows left",
            cell(&v["active_flows"])
        )
    } else {
        "in service".to_string()
    };
    let announced: Vec<String> = items(&v["announced"]).iter().map(cell).collect();
    let sessions: Vec<String> = items(&v["sessions"])
        .iter()
        .map(|s| {
            format!(
                "{} {} {}",
                cell(&s["name"]),
                cell(&s["state"]),
                cell(&s["info"])
            )
        })
        .collect();
    let mut rows = vec![
        ("host", state),
        (
            "announced",
            if announced.is_empty() {
                "nothing".into()
            } else {
                announced.join(", ")
            },
        ),
        ("bgp", sessions.join("; ")),
    ];
    if let Some(e) = v["speaker_error"].as_str() {
        rows.push(("speaker", format!("ERROR: {e}")));
    }
    for d in items(&v["vips"]) {
        let how = if d["announce"] == true {
            "announced"
        } else {
            "withdrawn"
        };
        rows.push((
            "vip",
            format!(
                "{} {} {how}: {}",
                cell(&d["vip"]),
                cell(&d["address"]),
                cell(&d["reason"])
            ),
        ));
    }
    rows
}

fn print(out: &mut dyn Write, v: &Value) -> Result<()> {
    for (k, val) in rows(v) {
        writeln!(out, "{k:<12}{}", crate::escape::text(&val))?;
    }
    Ok(())
}
