//! `sluice flows`: connection-table entries, filtered and bounded (`GET /v1/conns`), or the
//! active flows per backend (`--summary`, `GET /v1/flows`).

use std::{io::Write, net::IpAddr, time::Duration};

use anyhow::Result;
use clap::Args;
use serde_json::Value;

use super::{cell, items, print_flows, table, Output};
use crate::client::{path_segment, Client};

#[derive(Args, Debug)]
pub struct FlowsArgs {
    /// Only flows of this VIP.
    #[arg(long, value_name = "NAME")]
    pub vip: Option<String>,
    /// Only flows to this backend address.
    #[arg(long, value_name = "ADDR")]
    pub backend: Option<IpAddr>,
    /// List at most this many entries.
    #[arg(long, default_value_t = 100, value_name = "N")]
    pub limit: usize,
    /// Show active flows per VIP and backend instead of entries.
    #[arg(long, conflicts_with_all = ["vip", "backend", "limit"])]
    pub summary: bool,
}

impl FlowsArgs {
    /// The `/v1/conns` request for these filters.
    fn path(&self) -> String {
        let mut q = vec![format!("limit={}", self.limit)];
        if let Some(v) = &self.vip {
            q.push(format!("vip={}", path_segment(v)));
        }
        if let Some(b) = self.backend {
            q.push(format!("backend={}", path_segment(&b.to_string())));
        }
        format!("/v1/conns?{}", q.join("&"))
    }
}

pub(super) fn run(args: &FlowsArgs, client: &Client, out: &mut Output) -> Result<()> {
    if args.summary {
        return out.show(&client.call("GET", "/v1/flows", None)?, print_flows);
    }
    out.show(&client.call("GET", &args.path(), None)?, print_conns)
}

fn print_conns(out: &mut dyn Write, v: &Value) -> Result<()> {
    let rows: Vec<Vec<String>> = items(&v["flows"])
        .iter()
        .map(|f| {
            let idle = Duration::from_millis(f["idle_ms"].as_u64().unwrap_or(0));
            vec![
                cell(&f["client"]),
                cell(&f["vip"]),
                cell(&f["vip_address"]),
                cell(&f["protocol"]),
                cell(&f["backend"]),
                format!("{:.1}s", idle.as_secs_f64()),
            ]
        })
        .collect();
    table(
        out,
        &["CLIENT", "VIP", "VIP ADDRESS", "PROTO", "BACKEND", "IDLE"],
        &rows,
    )?;
    if v["truncated"] == true {
        writeln!(
            out,
            "(more entries match: raise --limit or filter with --vip / --backend)"
        )?;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn builds_the_request_with_encoded_filters() {
        let a = FlowsArgs {
            vip: Some("chat v2".into()),
            backend: Some("fd00::1".parse().unwrap()),
            limit: 5,
            summary: false,
        };
        assert_eq!(a.path(), "/v1/conns?limit=5&vip=chat%20v2&backend=fd00::1");
    }
}
