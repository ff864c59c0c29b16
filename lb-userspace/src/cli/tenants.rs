//! `sluice tenant`: the tenants' limits and usage per VIP, and replacing the tenant tables.

use std::{io::Write, path::PathBuf};

use anyhow::{Context, Result};
use clap::Subcommand;
use serde_json::Value;

use super::{cell, items, table, Output};
use crate::client::Client;

#[derive(Subcommand, Debug)]
pub enum TenantCommand {
    /// Show each tenant on each VIP: prefixes, limits, sessions, admitted rate, refusals, state
    #[command(after_help = "\
Examples:
  sluice tenant list
  sluice tenant list --json | jq '.tenants[] | select(.state != \"ok\")'

MAX and RATE/BURST are the tenant's limits on the VIP (- = none); SESSIONS are its clients'
active flows there; ADMIT/S is the rate of new sessions admitted at the latest policy step;
REFUSED counts new sessions refused at the cap, for the share and by the rate; STATE is
ok, capped (at MAX) or over-share (over its weighted share of a busy or full pool).")]
    List,
    /// Replace every [[tenant]] table with those of a TOML file (checked as the configuration is)
    #[command(after_help = "\
Example:
  sluice tenant set tenants.toml

The file holds [[tenant]] tables only, as in the configuration. A file with any mistake
changes nothing and every mistake is named. The change is kept across restarts until the
configuration file itself changes.")]
    Set {
        /// The TOML file of [[tenant]] tables.
        file: PathBuf,
    },
}

pub fn run(cmd: &TenantCommand, client: &Client, out: &mut Output) -> Result<()> {
    match cmd {
        TenantCommand::List => out.show(&client.call("GET", "/v1/tenants", None)?, print),
        TenantCommand::Set { file } => {
            let text = std::fs::read_to_string(file)
                .with_context(|| format!("reading {}", file.display()))?;
            let body: Value =
                toml::from_str(&text).with_context(|| format!("{} is not TOML", file.display()))?;
            let v = client.call("PUT", "/v1/tenants", Some(&body))?;
            out.show(&v, print)
        }
    }
}

/// A limit of 0 is none.
fn limit(v: &Value) -> String {
    match v.as_u64() {
        Some(0) => "-".to_owned(),
        _ => cell(v),
    }
}

fn print(out: &mut dyn Write, v: &Value) -> Result<()> {
    let rows: Vec<Vec<String>> = items(&v["tenants"])
        .iter()
        .map(|t| {
            let prefixes: Vec<String> = items(&t["prefixes"]).iter().map(cell).collect();
            let prefixes = if prefixes.is_empty() {
                "(others)".to_owned()
            } else {
                prefixes.join(",")
            };
            let rate = match t["new_sessions_per_sec"].as_u64() {
                Some(0) | None => "-".to_owned(),
                Some(r) => format!(
                    "{r}/{}",
                    t["burst"].as_u64().filter(|b| *b > 0).unwrap_or(r)
                ),
            };
            let r = &t["refused"];
            vec![
                cell(&t["tenant"]),
                cell(&t["vip"]),
                prefixes,
                cell(&t["weight"]),
                limit(&t["max_sessions"]),
                rate,
                cell(&t["sessions"]),
                format!("{:.1}", t["admitted_per_sec"].as_f64().unwrap_or(0.0)),
                format!(
                    "{}/{}/{}",
                    cell(&r["sessions"]),
                    cell(&r["share"]),
                    cell(&r["rate"])
                ),
                cell(&t["state"]),
            ]
        })
        .collect();
    if rows.is_empty() {
        writeln!(out, "no tenants are configured")?;
        return Ok(());
    }
    table(
        out,
        &[
            "TENANT",
            "VIP",
            "PREFIXES",
            "WEIGHT",
            "MAX",
            "RATE/BURST",
            "SESSIONS",
            "ADMIT/S",
            "REFUSED(CAP/SHARE/RATE)",
            "STATE",
        ],
        &rows,
    )
}
