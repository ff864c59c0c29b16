//! The operator's view of the lab: the `sluice` CLI and the admin API on the lab's socket.

use std::{
    collections::BTreeMap,
    net::{IpAddr, SocketAddr},
    process::Command,
};

use anyhow::Result;
use serde_json::Value;
use sluice::client::Client;

use super::{DaemonLab, CLI_TIMEOUT};
use crate::netns::{run_output, CmdOutput, DEV};

impl DaemonLab {
    /// Runs `sluice --socket <lab socket> <args>`: (exit code, stdout, stderr).
    pub fn cli(&self, args: &[&str]) -> (i32, String, String) {
        let out = self
            .cli_output(args)
            .unwrap_or_else(|e| panic!("running sluice {args:?}: {e:#}"));
        (out.status.code().unwrap_or(-1), out.stdout, out.stderr)
    }

    /// `sluice --socket <lab socket> <args>` without panicking: its exit status and output.
    pub fn cli_output(&self, args: &[&str]) -> Result<CmdOutput> {
        let mut cmd = Command::new(&self.sluice);
        cmd.arg("--socket").arg(&self.socket).args(args);
        run_output(&mut cmd, CLI_TIMEOUT)
    }

    /// `sluice <args>`, which must succeed: its stdout.
    pub fn cli_ok(&self, args: &[&str]) -> String {
        let (code, out, err) = self.cli(args);
        assert_eq!(
            code,
            0,
            "`sluice {}` failed with {code}: {err}{out}",
            args.join(" ")
        );
        out
    }

    /// `sluice --json <args>`, which must succeed: its JSON.
    pub fn cli_json(&self, args: &[&str]) -> Value {
        let mut all = vec!["--json"];
        all.extend_from_slice(args);
        let out = self.cli_ok(&all);
        serde_json::from_str(&out)
            .unwrap_or_else(|e| panic!("`sluice {}`: not JSON ({e}): {out}", all.join(" ")))
    }

    /// One admin API request on the lab's socket: (status, JSON).
    pub fn api(&self, method: &str, path: &str, body: Option<&Value>) -> Result<(u16, Value)> {
        Client::new(&self.socket).request(method, path, body)
    }

    /// `sluice backend list <vip> --json`'s backends.
    pub fn backends(&self, vip: &str) -> Vec<Value> {
        self.cli_json(&["backend", "list", vip])["backends"]
            .as_array()
            .cloned()
            .unwrap_or_default()
    }

    /// The backend entry of `addr` in `sluice backend list <vip> --json`.
    pub fn backend(&self, vip: &str, addr: IpAddr) -> Option<Value> {
        let a = addr.to_string();
        self.backends(vip)
            .into_iter()
            .find(|b| b["address"].as_str() == Some(&a))
    }

    /// Active flows per backend name of `vip`, from `sluice flows --json`.
    pub fn flows(&self, vip: &str) -> BTreeMap<String, u64> {
        let v = self.cli_json(&["flows", "--summary"]);
        let mut out = BTreeMap::new();
        for x in v["vips"].as_array().into_iter().flatten() {
            if x["vip"].as_str() != Some(vip) {
                continue;
            }
            for b in x["backends"].as_array().into_iter().flatten() {
                let name = b["address"]
                    .as_str()
                    .and_then(|a| a.parse().ok())
                    .and_then(|a| self.backend_name(a))
                    .unwrap_or_else(|| b["address"].to_string());
                out.insert(name, b["active_flows"].as_u64().unwrap_or(0));
            }
        }
        out
    }

    /// `sluice events --json`'s events.
    pub fn events(&self) -> Vec<Value> {
        self.cli_json(&["events"])["events"]
            .as_array()
            .cloned()
            .unwrap_or_default()
    }

    /// The data plane's global counters from `sluice stats --json`.
    pub fn counters(&self) -> BTreeMap<String, u64> {
        self.cli_json(&["stats"])["global"]
            .as_object()
            .map(|m| {
                m.iter()
                    .map(|(k, v)| (k.clone(), v.as_u64().unwrap_or(0)))
                    .collect()
            })
            .unwrap_or_default()
    }

    /// The topology name of the backend with this address (v4 or v6).
    pub fn backend_name(&self, addr: IpAddr) -> Option<String> {
        self.topo
            .backends
            .iter()
            .find(|b| b.addr(false) == addr || b.addr(true) == addr)
            .map(|b| b.name.clone())
    }

    /// Backend `i`'s address in the family of `vip`.
    pub fn backend_addr(&self, i: usize, vip: SocketAddr) -> IpAddr {
        self.topo.backends[i].addr(vip.is_ipv6())
    }

    /// Whether an XDP program is attached to the LB's eth0: `ip link show` prints a
    /// `prog/xdp id N` line (`prog/xdpgeneric` in generic mode) for an attached program.
    pub fn lb_has_xdp(&self) -> Result<bool> {
        let out = self.topo.lb.ns.ip(&["link", "show", DEV])?;
        Ok(out.lines().any(|l| l.trim_start().starts_with("prog/xdp")))
    }
}
