//! The command line's grammar: commands, arguments, their help text and value parsers.

use std::{net::IpAddr, path::PathBuf, time::Duration};

use clap::{
    builder::{PossibleValuesParser, TypedValueParser},
    Parser, Subcommand, ValueEnum,
};
use serde::de::DeserializeOwned;
use serde_json::{json, Value};

use super::{flows, lb, live, tenants};
use crate::state::{BackendSpec, FlowState, HashMode, Protocol, QuicMode};

/// The version `sluice --version` prints: the crate's and the git revision it was built from.
pub const VERSION: &str = concat!(
    env!("CARGO_PKG_VERSION"),
    " (git ",
    env!("SLUICE_GIT_REV"),
    ")"
);

const EXAMPLES: &str = "\
Examples:
  sluice check --config /etc/sluice/sluice.toml
  sluice run --config /etc/sluice/sluice.toml
  sluice status
  sluice vip add chat --address 10.0.0.1 --port 443 --backend 10.1.0.1 --backend 10.1.0.2:50
  sluice backend drain chat 10.1.0.1 --deadline 10m
  sluice backend list chat
  sluice stats --json | jq .global

Commands other than `run`, `check`, `backend-host`, `completions`, `telemetry` and `cleanup`
talk to the daemon through its admin socket, which is open to root and the members of the
socket's group.

Exit status: 0 success; 1 failure (a refused configuration or request, an unreachable
daemon, a connection closed or an answer cut short before the daemon's whole answer was
read, a DSR problem found by `backend-host check`); 2 bad usage (unknown command or
option, bad argument). A command exits 0 only when it read the daemon's complete answer
and that answer reports success.";

#[derive(Parser, Debug)]
#[command(
    name = "sluice",
    version = VERSION,
    about = "Sluice: an XDP layer-4 load balancer for LLM inference traffic",
    after_help = EXAMPLES,
    propagate_version = true
)]
pub struct Cli {
    /// The admin socket of the daemon to talk to.
    #[arg(
        long,
        global = true,
        env = "SLUICE_SOCKET",
        value_name = "PATH",
        default_value = "/run/sluice/admin.sock"
    )]
    pub socket: PathBuf,

    /// Print the API's JSON instead of tables.
    #[arg(long, global = true)]
    pub json: bool,

    /// Retry a request up to N times (at most 10; the waits double from 0.1 s up to 2 s,
    /// 15 s in all at most) when the daemon answers 503 (its connection caps are full;
    /// nothing was done) or the request reached no daemon (no socket, nothing listening).
    /// A connection closed before any answer is retried only for reads, `set-weight` and
    /// `trace on|off`, which change nothing more when repeated; other changes then fail
    /// and may have been applied: check with a listing.
    #[arg(long, global = true, value_name = "N", default_value_t = 0,
          value_parser = clap::value_parser!(u32).range(0..=i64::from(crate::client::MAX_RETRIES)))]
    pub retry: u32,

    /// Redraw a read command's answer in place at this interval, e.g. 2s (until Ctrl-C).
    #[arg(long, global = true, value_name = "INTERVAL", value_parser = live::interval)]
    pub watch: Option<Duration>,

    #[command(subcommand)]
    pub command: Command,
}

#[derive(Subcommand, Debug)]
pub enum Command {
    /// Run the daemon: load and attach the data plane, then serve the admin API and metrics
    #[command(after_help = "\
Examples:
  sluice run --config /etc/sluice/sluice.toml
  RUST_LOG=debug sluice run --config ./sluice.toml

Runs until SIGTERM or SIGINT; SIGHUP reloads the configuration (a bad file changes nothing).
Needs root (or CAP_BPF, CAP_NET_ADMIN and CAP_PERFMON) and a bpffs mount.")]
    Run {
        /// The configuration file (TOML).
        #[arg(
            long,
            short,
            value_name = "FILE",
            default_value = "/etc/sluice/sluice.toml"
        )]
        config: PathBuf,
    },

    /// Validate a configuration without root and without touching the system
    #[command(after_help = "\
Examples:
  sluice check --config /etc/sluice/sluice.toml
  sluice check -c ./sluice.toml && systemctl reload sluice

Refuses exactly what `sluice run` would refuse at start, with the same messages (one line
per problem); prints warnings to stderr. Exit status 0 when valid, 1 when refused.")]
    Check {
        /// The configuration file (TOML).
        #[arg(
            long,
            short,
            value_name = "FILE",
            default_value = "/etc/sluice/sluice.toml"
        )]
        config: PathBuf,
    },

    /// The backend host's side: decapsulation, VIPs on lo, DSR checks and metrics
    #[command(
        subcommand,
        after_help = "\
Examples:
  sluice backend-host check --config /etc/sluice/backend-host.toml
  sluice backend-host run --config /etc/sluice/backend-host.toml
  sluice backend-host status --config /etc/sluice/backend-host.toml

Run on every accelerator host behind Sluice (the sluice-backend-host service)."
    )]
    BackendHost(crate::backend_host::cli::BackendHostCommand),

    /// Write the man pages (sluice.1 and one per subcommand) into a directory
    #[command(hide = true, after_help = "Example:\n  sluice manpages target/man")]
    Manpages {
        /// The directory to write into (created if missing).
        dir: PathBuf,
    },

    /// Show the daemon's version, uptime, interfaces and counts of VIPs and backends
    #[command(after_help = "Example:\n  sluice status")]
    Status,

    /// This host's route announcement over BGP: drain for maintenance, undrain, status
    #[command(
        subcommand,
        after_help = "\
Examples:
  sluice lb status
  sluice lb drain --deadline 30m
  sluice lb undrain"
    )]
    Lb(lb::LbCommand),

    /// List, add and remove VIPs
    #[command(
        subcommand,
        after_help = "\
Examples:
  sluice vip list
  sluice vip add chat --address 10.0.0.1 --port 443 --backend 10.1.0.1 --backend 10.1.0.2
  sluice vip remove chat"
    )]
    Vip(VipCommand),

    /// List, add, remove, reweight and drain a VIP's backends
    #[command(
        subcommand,
        after_help = "\
Examples:
  sluice backend list chat
  sluice backend add chat 10.1.0.3 --weight 50
  sluice backend set-weight chat 10.1.0.3 100
  sluice backend drain chat 10.1.0.1 --deadline 10m
  sluice backend undrain chat 10.1.0.1
  sluice backend remove chat 10.1.0.1"
    )]
    Backend(BackendCommand),

    /// Show the tenants' limits, sessions and refusals per VIP, or replace the tenant tables
    #[command(
        subcommand,
        after_help = "\
Examples:
  sluice tenant list
  sluice tenant set tenants.toml"
    )]
    Tenant(tenants::TenantCommand),

    /// List connection-table entries (client, VIP, backend, idle time), or active flows per backend
    #[command(after_help = "\
Examples:
  sluice flows
  sluice flows --vip chat --backend 10.1.0.2 --limit 20
  sluice flows --summary

Entries are listed in table order, at most --limit (100; 100000 at most). --summary shows
the active flows per VIP and backend instead: a flow is active when its entry saw a packet
within the daemon's dataplane.flow_idle_timeout (counted in the background, at most a few
seconds old).")]
    Flows(flows::FlowsArgs),

    /// A live view: per-backend rates, flows, weights, steering and telemetry age, and events
    #[command(after_help = "\
Examples:
  sluice top
  sluice top --every 2s --events 20

Redrawn in place until Ctrl-C. WEIGHT is effective/configured; STEERING is the adaptive
policy's state and reason; rates are the change of the counters since the last frame.")]
    Top {
        /// Refresh interval.
        #[arg(long, default_value = "1s", value_parser = live::interval, value_name = "INTERVAL")]
        every: Duration,
        /// How many of the latest events to show.
        #[arg(long, default_value_t = 10, value_name = "N")]
        events: usize,
    },

    /// Switch the data plane's per-flow decision tracing on or off, or show whether it is on
    #[command(after_help = "\
Examples:
  sluice trace on
  sluice trace off
  sluice trace

Each steering decision is then logged by the daemon (target sluice::dataplane), e.g.
  flow ::ffff:192.0.2.7:40312 to vip 0 port 443 -> backend 3 new
Off by default and at every start; costs nothing measurable while off.")]
    Trace {
        /// on or off; without it, shows the current setting.
        switch: Option<TraceSwitch>,
    },

    /// Show the data plane's counters and per-VIP and per-backend traffic
    #[command(after_help = "\
Examples:
  sluice stats
  sluice stats --json | jq '.global.drop_no_backend'")]
    Stats,

    /// Show recent control-plane events (drain completions, health changes, ...)
    #[command(after_help = "Example:\n  sluice events")]
    Events,

    /// Print a shell completion script
    #[command(after_help = "\
Examples:
  sluice completions bash > /etc/bash_completion.d/sluice
  sluice completions zsh > \"${fpath[1]}/_sluice\"
  sluice completions fish > ~/.config/fish/completions/sluice.fish")]
    Completions {
        #[arg(value_enum)]
        shell: Shell,
    },

    /// Read an exporter page the way the daemon's scraper does, and print what Sluice takes
    /// from it (to check an exporter and a GPU or model selection before configuring it)
    #[command(after_help = "\
Examples:
  curl -s http://10.1.0.1:9400/metrics | sluice telemetry dcgm - --gpu 0 --gpu 1
  sluice telemetry vllm vllm-metrics.txt --model llama-3-70b
  sluice --json telemetry sglang page.txt")]
    Telemetry {
        #[arg(value_enum)]
        kind: PageKind,
        /// The page (Prometheus text); - reads standard input.
        file: PathBuf,
        /// dcgm: GPUs to select by their `gpu` label (default: all on the page).
        #[arg(long = "gpu")]
        gpus: Vec<String>,
        /// dcgm: GPUs to select by their `UUID` label.
        #[arg(long = "uuid")]
        uuids: Vec<String>,
        /// vllm/sglang: the `model_name` to select.
        #[arg(long)]
        model: Option<String>,
    },

    /// Remove a pinned data plane left behind by a daemon (detaches its XDP programs)
    #[command(after_help = "\
Examples:
  sluice cleanup
  sluice cleanup --bpffs /sys/fs/bpf/sluice-test

Refuses while a daemon answers on the admin socket: stop it first. With --force the data
plane is removed anyway and the VIPs' traffic stops being steered.")]
    Cleanup {
        /// The directory the data plane is pinned in (the daemon's daemon.bpffs).
        #[arg(long, value_name = "DIR", default_value = "/sys/fs/bpf/sluice")]
        bpffs: PathBuf,
        /// Remove it even though a daemon answers on the admin socket.
        #[arg(long)]
        force: bool,
    },
}

#[derive(Subcommand, Debug)]
pub enum VipCommand {
    /// List the VIPs with their backend counts, active flows and traffic
    #[command(after_help = "Example:\n  sluice vip list")]
    List,

    /// Add a VIP, optionally with its backends
    #[command(after_help = "\
Examples:
  sluice vip add chat --address 10.0.0.1 --port 443 --backend 10.1.0.1 --backend 10.1.0.2:50
  sluice vip add embed --address fd00::10 --port 8080 --hash source --affinity-window 10m \\
      --backend '[fd00:1::1]:100' --backend fd00:1::2

Changes made here survive daemon restarts until the configuration file changes: a changed
file (on SIGHUP or restart) sets the VIPs and backends to exactly what it lists.")]
    Add(VipAdd),

    /// Remove a VIP and its backends (its flows stop being steered at once)
    #[command(after_help = "Example:\n  sluice vip remove chat")]
    Remove {
        /// The VIP's name.
        name: String,
    },
}

#[derive(clap::Args, Debug)]
pub struct VipAdd {
    /// The VIP's name: 1-32 characters from a-z, 0-9, '-' and '_'.
    pub(super) name: String,
    /// The address clients connect to.
    #[arg(long, value_name = "IP")]
    pub(super) address: IpAddr,
    /// The port clients connect to; 0 means every port.
    #[arg(long)]
    pub(super) port: u16,
    /// The transport protocol.
    #[arg(long, default_value = "tcp", value_parser = serde_enum::<Protocol>(&["tcp", "udp"]))]
    pub(super) protocol: Protocol,
    /// five-tuple spreads each connection; source keeps a client's connections together.
    #[arg(long, default_value = "five-tuple", value_parser = serde_enum::<HashMode>(&["five-tuple", "source"]))]
    pub(super) hash: HashMode,
    /// Keep sending a client to the same backend for this long after its last packet
    /// (e.g. 10m, at most 24h); off by default.
    #[arg(long, value_name = "DURATION", value_parser = parse_secs)]
    pub(super) affinity_window: Option<u32>,
    /// Priority class for admission control, 0 (highest) to 7.
    #[arg(long, value_name = "N")]
    pub(super) priority: Option<u32>,
    /// Maglev ring slots, a prime (default 65537; smaller rings rebuild faster).
    #[arg(long, value_name = "N")]
    pub(super) ring_size: Option<u32>,
    /// Where TCP flow state lives: table (the LB's connection table) or second-chance (the
    /// backends, which must run sluice_decap; see docs/design.md).
    #[arg(long, default_value = "table", value_parser = serde_enum::<FlowState>(&["table", "second-chance"]))]
    pub(super) flow_state: FlowState,
    /// QUIC routing of a UDP VIP: off, or cid (by the server ID in the connection ID; add
    /// its backends with `sluice backend add --quic-server-id`).
    #[arg(long, default_value = "off", value_parser = serde_enum::<QuicMode>(&["off", "cid"]))]
    pub(super) quic: QuicMode,
    /// Octets of a QUIC-LB server ID, 1 to 8 (default 2).
    #[arg(long, value_name = "N")]
    pub(super) quic_server_id_len: Option<u8>,
    /// The config rotation codepoint of the VIP's connection IDs, 0 to 6 (default 0).
    #[arg(long, value_name = "N")]
    pub(super) quic_config_rotation: Option<u8>,
    /// A backend, with an optional weight (default 100); write IPv6 with a weight in
    /// brackets: [fd00::1]:50. Repeat for more backends.
    #[arg(long = "backend", value_name = "ADDR[:WEIGHT]", value_parser = parse_backend)]
    pub(super) backends: Vec<BackendSpec>,
}

#[derive(Subcommand, Debug)]
pub enum BackendCommand {
    /// List a VIP's backends: weight, state, drain deadline, active flows and traffic
    #[command(after_help = "Example:\n  sluice backend list chat")]
    List {
        /// The VIP's name.
        vip: String,
    },

    /// Add a backend to a VIP
    #[command(after_help = "\
Examples:
  sluice backend add chat 10.1.0.3
  sluice backend add chat 10.1.0.4 --weight 50 --label zone=b --label gpu=h100 --max-sessions 64
  sluice backend add chat-quic 10.1.0.5 --quic-server-id 0a05

Like `sluice vip add`, the change lasts until the configuration file changes.")]
    Add {
        /// The VIP's name.
        vip: String,
        /// The backend's address.
        address: IpAddr,
        /// Maglev weight, 0 to 65535 (default 100); 0 keeps its flows but takes no new ones.
        #[arg(long, value_name = "N")]
        weight: Option<u32>,
        /// A label (KEY=VALUE) shown in listings; repeat for more.
        #[arg(long = "label", value_name = "KEY=VALUE", value_parser = parse_label)]
        labels: Vec<(String, String)>,
        /// At most this many concurrent sessions (admission control); 0 means no limit.
        #[arg(long, value_name = "N")]
        max_sessions: Option<u32>,
        /// Its QUIC-LB server ID in hex (required on a quic = "cid" VIP), e.g. 0a01.
        #[arg(long, value_name = "HEX")]
        quic_server_id: Option<String>,
    },

    /// Remove a backend now (its flows re-steer to the others; drain first to let them end)
    #[command(after_help = "Example:\n  sluice backend remove chat 10.1.0.1")]
    Remove {
        /// The VIP's name.
        vip: String,
        /// The backend's address.
        address: IpAddr,
    },

    /// Change a backend's weight (its share of new flows)
    #[command(after_help = "Example:\n  sluice backend set-weight chat 10.1.0.1 50")]
    SetWeight {
        /// The VIP's name.
        vip: String,
        /// The backend's address.
        address: IpAddr,
        /// The new weight, 0 to 65535.
        weight: u32,
    },

    /// Drain a backend: no new flows; it is removed when its flows end, or at the deadline
    #[command(after_help = "\
Examples:
  sluice backend drain chat 10.1.0.1
  sluice backend drain chat 10.1.0.1 --deadline 10m

Established flows keep going to the backend until they end. `sluice backend undrain`
takes it back before it is removed.")]
    Drain {
        /// The VIP's name.
        vip: String,
        /// The backend's address.
        address: IpAddr,
        /// Remove it this long from now even if flows are left (they re-steer), e.g. 10m.
        #[arg(long, value_name = "DURATION", value_parser = parse_duration)]
        deadline: Option<String>,
    },

    /// Stop draining a backend: it takes new flows again
    #[command(after_help = "Example:\n  sluice backend undrain chat 10.1.0.1")]
    Undrain {
        /// The VIP's name.
        vip: String,
        /// The backend's address.
        address: IpAddr,
    },
}

#[derive(Clone, Copy, Debug, ValueEnum)]
pub enum Shell {
    Bash,
    Zsh,
    Fish,
}

/// A value parser for an enum of the state module, by its serde names (the API's).
fn serde_enum<T: DeserializeOwned + Clone + Send + Sync + 'static>(
    names: &'static [&'static str],
) -> impl TypedValueParser<Value = T> {
    PossibleValuesParser::new(names)
        .map(|s| serde_json::from_value(Value::String(s)).expect("the listed names are the enum's"))
}

fn parse_duration(s: &str) -> Result<String, String> {
    crate::config::rules::duration(s).map(|_| s.to_string())
}

fn parse_secs(s: &str) -> Result<u32, String> {
    let d = humantime::parse_duration(s).map_err(|e| format!("{e} (use e.g. 30s, 10m, 1h)"))?;
    u32::try_from(d.as_secs()).map_err(|_| "too long".to_string())
}

fn parse_label(s: &str) -> Result<(String, String), String> {
    match s.split_once('=') {
        Some((k, v)) if !k.is_empty() => Ok((k.to_string(), v.to_string())),
        _ => Err("use KEY=VALUE".into()),
    }
}

/// `ADDR`, `ADDR:WEIGHT` or `[IPv6]:WEIGHT`.
fn parse_backend(s: &str) -> Result<BackendSpec, String> {
    let bad = || format!("{s:?} is not ADDR or ADDR:WEIGHT (IPv6 with a weight: [fd00::1]:50)");
    if let Ok(addr) = s.parse() {
        return Ok(backend_spec(addr));
    }
    let (addr, weight) = s.rsplit_once(':').ok_or_else(bad)?;
    let addr = addr
        .strip_prefix('[')
        .and_then(|a| a.strip_suffix(']'))
        .unwrap_or(addr);
    let mut b = backend_spec(addr.parse().map_err(|_| bad())?);
    b.weight = weight.parse().map_err(|_| bad())?;
    Ok(b)
}

/// A backend with the API's defaults for everything but its address.
pub(super) fn backend_spec(address: IpAddr) -> BackendSpec {
    serde_json::from_value(json!({ "address": address }))
        .expect("the address is the only required field")
}

#[derive(Clone, Copy, Debug, ValueEnum)]
pub enum TraceSwitch {
    On,
    Off,
}

/// Exporter pages `sluice telemetry` reads.
#[derive(Clone, Copy, Debug, ValueEnum)]
pub enum PageKind {
    Dcgm,
    Vllm,
    Sglang,
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn backends_parse_with_optional_weights() {
        let b = parse_backend("10.1.0.1:50").unwrap();
        assert_eq!((b.address.to_string(), b.weight), ("10.1.0.1".into(), 50));
        let b = parse_backend("[fd00::1]:50").unwrap();
        assert_eq!((b.address.to_string(), b.weight), ("fd00::1".into(), 50));
        let b = parse_backend("fd00::1").unwrap();
        assert_eq!((b.address.to_string(), b.weight), ("fd00::1".into(), 100));
        assert!(parse_backend("10.1.0.1:heavy").is_err());
    }
}
