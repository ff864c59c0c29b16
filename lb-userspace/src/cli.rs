//! The `sluice` command line: the daemon (`run`) and the admin API's client commands.

mod flows;
mod lb;
mod live;
mod print;

use std::{
    collections::BTreeMap,
    io::Write,
    net::IpAddr,
    path::{Path, PathBuf},
    process::ExitCode,
    time::Duration,
};

use anyhow::{anyhow, bail, Context, Result};
use clap::{
    builder::{PossibleValuesParser, TypedValueParser},
    CommandFactory, Parser, Subcommand, ValueEnum,
};
use serde::de::DeserializeOwned;
use serde_json::{json, Value};

use self::print::{
    cell, event_row, host_port, items, print_backends, print_events, print_flows, print_sample,
    print_stats, print_status, print_vips, table, timestamp, EVENT_COLUMNS,
};

use crate::{
    admin::{DrainRequest, NewVip, WeightChange},
    client::{path_segment, Client},
    config::EngineKind,
    escape,
    state::{BackendSpec, FlowState, HashMode, Protocol, VipSpec},
};

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
    name: String,
    /// The address clients connect to.
    #[arg(long, value_name = "IP")]
    address: IpAddr,
    /// The port clients connect to; 0 means every port.
    #[arg(long)]
    port: u16,
    /// The transport protocol.
    #[arg(long, default_value = "tcp", value_parser = serde_enum::<Protocol>(&["tcp", "udp"]))]
    protocol: Protocol,
    /// five-tuple spreads each connection; source keeps a client's connections together.
    #[arg(long, default_value = "five-tuple", value_parser = serde_enum::<HashMode>(&["five-tuple", "source"]))]
    hash: HashMode,
    /// Keep sending a client to the same backend for this long after its last packet
    /// (e.g. 10m, at most 24h); off by default.
    #[arg(long, value_name = "DURATION", value_parser = parse_secs)]
    affinity_window: Option<u32>,
    /// Priority class for admission control, 0 (highest) to 7.
    #[arg(long, value_name = "N")]
    priority: Option<u32>,
    /// Maglev ring slots, a prime (default 65537; smaller rings rebuild faster).
    #[arg(long, value_name = "N")]
    ring_size: Option<u32>,
    /// Where TCP flow state lives: table (the LB's connection table) or second-chance (the
    /// backends, which must run sluice_decap; see docs/design.md).
    #[arg(long, default_value = "table", value_parser = serde_enum::<FlowState>(&["table", "second-chance"]))]
    flow_state: FlowState,
    /// A backend, with an optional weight (default 100); write IPv6 with a weight in
    /// brackets: [fd00::1]:50. Repeat for more backends.
    #[arg(long = "backend", value_name = "ADDR[:WEIGHT]", value_parser = parse_backend)]
    backends: Vec<BackendSpec>,
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
fn backend_spec(address: IpAddr) -> BackendSpec {
    serde_json::from_value(json!({ "address": address }))
        .expect("the address is the only required field")
}

/// Parses the process's arguments and runs the command; usage errors exit with 2 (clap).
pub fn main() -> ExitCode {
    let cli = Cli::parse();
    // Not a held StdoutLock: `run` lasts as long as the daemon, and its threads may print.
    let mut out = Stdout::default();
    let result = execute(&cli, &mut out);
    exit_code(result, out.reader_left)
}

/// The exit status of a command's `result`. A broken pipe on standard output (`sluice
/// stats | head`: the reader left) is no failure; any other error, a broken admin socket
/// included, is.
fn exit_code(result: Result<()>, reader_left: bool) -> ExitCode {
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(_) if reader_left => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("error: {e:#}");
            ExitCode::from(1)
        }
    }
}

/// Standard output that remembers whether its reader left.
#[derive(Default)]
struct Stdout {
    reader_left: bool,
}

impl Stdout {
    fn note<T>(&mut self, r: std::io::Result<T>) -> std::io::Result<T> {
        if let Err(e) = &r {
            self.reader_left |= e.kind() == std::io::ErrorKind::BrokenPipe;
        }
        r
    }
}

impl Write for Stdout {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        let r = std::io::stdout().write(buf);
        self.note(r)
    }

    fn flush(&mut self) -> std::io::Result<()> {
        let r = std::io::stdout().flush();
        self.note(r)
    }
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

/// Runs one command, printing to `out`; an error is a refused request or a failure. With
/// `--watch`, a read command is redrawn in place until interrupted.
pub fn execute(cli: &Cli, out: &mut dyn Write) -> Result<()> {
    let Some(every) = cli.watch else {
        return execute_once(cli, out);
    };
    let reads = matches!(
        &cli.command,
        Command::Status
            | Command::Vip(VipCommand::List)
            | Command::Backend(BackendCommand::List { .. })
            | Command::Flows(_)
            | Command::Stats
            | Command::Events
    );
    if !reads {
        bail!("--watch repeats read commands only: status, vip list, backend list, flows, stats, events");
    }
    live::repeat(out, every, None, |w| execute_once(cli, w))
}

fn execute_once(cli: &Cli, out: &mut dyn Write) -> Result<()> {
    let client = Client::new(&cli.socket).with_retries(cli.retry);
    let mut out = Output {
        json: cli.json,
        out,
    };
    match &cli.command {
        Command::Run { config } => run_daemon(config),
        Command::Check { config } => crate::check::command(config, out.json, out.out),
        Command::BackendHost(cmd) => crate::backend_host::cli::execute(cmd, out.json, out.out),
        Command::Manpages { dir } => crate::manpages::write(Cli::command(), dir, out.out),
        Command::Status => out.show(&client.call("GET", "/v1/status", None)?, print_status),
        Command::Lb(cmd) => lb::run(cmd, &client, &mut out),
        Command::Vip(cmd) => vip(cmd, &client, &mut out),
        Command::Backend(cmd) => backend(cmd, &client, &mut out),
        Command::Flows(args) => flows::run(args, &client, &mut out),
        Command::Top { every, events } => {
            let mut prev = None;
            live::repeat(out.out, *every, None, |w| {
                let cur = live::Sample::take(&client)?;
                live::render_top(w, prev.as_ref(), &cur, *events)?;
                prev = Some(cur);
                Ok(())
            })
        }
        Command::Trace { switch } => {
            let v = match switch {
                None => client.call("GET", "/v1/trace", None)?,
                Some(s) => {
                    let body = json!({ "enabled": matches!(s, TraceSwitch::On) });
                    client.call("PUT", "/v1/trace", Some(&body))?
                }
            };
            out.show(&v, |out, v| {
                let on = v["enabled"] == true;
                Ok(writeln!(
                    out,
                    "decision tracing is {}",
                    if on { "on" } else { "off" }
                )?)
            })
        }
        Command::Stats => out.show(&client.call("GET", "/v1/stats", None)?, print_stats),
        Command::Events => out.show(&client.call("GET", "/v1/events", None)?, print_events),
        Command::Telemetry {
            kind,
            file,
            gpus,
            uuids,
            model,
        } => {
            let text = if file.as_os_str() == "-" {
                std::io::read_to_string(std::io::stdin()).context("reading standard input")?
            } else {
                std::fs::read_to_string(file)
                    .with_context(|| format!("reading {}", file.display()))?
            };
            let page = crate::telemetry::prom::parse(&text).map_err(|e| anyhow!("{e}"))?;
            let sample = match kind {
                PageKind::Dcgm => crate::telemetry::dcgm::extract(&page, gpus, uuids),
                PageKind::Vllm => {
                    crate::telemetry::engine::extract(&page, EngineKind::Vllm, model.as_deref())
                }
                PageKind::Sglang => {
                    crate::telemetry::engine::extract(&page, EngineKind::Sglang, model.as_deref())
                }
            }
            .map_err(|e| anyhow!("{e}"))?;
            out.show(&serde_json::to_value(&sample)?, print_sample)
        }
        Command::Completions { shell } => {
            let shell = match shell {
                Shell::Bash => clap_complete::Shell::Bash,
                Shell::Zsh => clap_complete::Shell::Zsh,
                Shell::Fish => clap_complete::Shell::Fish,
            };
            clap_complete::generate(shell, &mut Cli::command(), "sluice", out.out);
            Ok(())
        }
        Command::Cleanup { bpffs, force } => cleanup(&client, bpffs, *force, out.out),
    }
}

/// Where a command's answer goes: the API's JSON with --json, else the human form.
struct Output<'a> {
    json: bool,
    out: &'a mut dyn Write,
}

impl Output<'_> {
    fn show(
        &mut self,
        v: &Value,
        human: impl FnOnce(&mut dyn Write, &Value) -> Result<()>,
    ) -> Result<()> {
        if !self.json {
            return human(self.out, v);
        }
        // A removal answers 204 with no body: nothing to print.
        if !v.is_null() {
            let text = serde_json::to_string_pretty(v)?;
            writeln!(self.out, "{}", escape::json(&text))?;
        }
        Ok(())
    }
}

fn run_daemon(config: &Path) -> Result<()> {
    tokio::runtime::Runtime::new()
        .context("starting the async runtime")?
        .block_on(crate::daemon::run(config))
}

fn cleanup(client: &Client, bpffs: &Path, force: bool, out: &mut dyn Write) -> Result<()> {
    if !force {
        if let Ok((_, status)) = client.request("GET", "/v1/status", None) {
            bail!(
                "a sluice daemon (pid {}) answers on {}: stop it first, or pass --force to remove \
                 its data plane anyway (the VIPs' traffic then stops being steered)",
                status["pid"],
                client.socket().display()
            );
        }
    }
    if !bpffs.exists() {
        writeln!(out, "nothing is pinned at {}", bpffs.display())?;
        return Ok(());
    }
    crate::dataplane::remove_pinned(bpffs)?;
    writeln!(
        out,
        "removed the data plane pinned at {} (its XDP programs are detached)",
        bpffs.display()
    )?;
    Ok(())
}

fn vip(cmd: &VipCommand, client: &Client, out: &mut Output) -> Result<()> {
    match cmd {
        VipCommand::List => out.show(&client.call("GET", "/v1/vips", None)?, print_vips),
        VipCommand::Add(a) => {
            let mut spec: VipSpec = serde_json::from_value(json!({
                "name": a.name, "address": a.address, "port": a.port, "protocol": a.protocol,
                "hash": a.hash,
            }))
            .expect("the required fields are given");
            spec.affinity_secs = a.affinity_window.unwrap_or(spec.affinity_secs);
            spec.priority = a.priority.unwrap_or(spec.priority);
            spec.ring_size = a.ring_size.unwrap_or(spec.ring_size);
            spec.flow_state = a.flow_state;
            let body = serde_json::to_value(NewVip {
                vip: spec,
                backends: a.backends.clone(),
            })?;
            let v = client.call("POST", "/v1/vips", Some(&body))?;
            out.show(&v, |out, v| {
                let vip = &v["vip"];
                writeln!(
                    out,
                    "added VIP {}: {} {}, {} backends",
                    cell(&vip["name"]),
                    cell(&vip["protocol"]),
                    host_port(vip),
                    cell(&vip["backend_count"])
                )?;
                Ok(())
            })
        }
        VipCommand::Remove { name } => {
            let v = client.call("DELETE", &format!("/v1/vips/{}", path_segment(name)), None)?;
            out.show(&v, |out, _| Ok(writeln!(out, "removed VIP {name}")?))
        }
    }
}

fn backend(cmd: &BackendCommand, client: &Client, out: &mut Output) -> Result<()> {
    let base = |vip: &str| format!("/v1/vips/{}/backends", path_segment(vip));
    let one = |vip: &str, address: &IpAddr| {
        format!("{}/{}", base(vip), path_segment(&address.to_string()))
    };
    match cmd {
        BackendCommand::List { vip } => {
            out.show(&client.call("GET", &base(vip), None)?, print_backends)
        }
        BackendCommand::Add {
            vip,
            address,
            weight,
            labels,
            max_sessions,
        } => {
            let mut spec = backend_spec(*address);
            spec.weight = weight.unwrap_or(spec.weight);
            spec.labels = labels.iter().cloned().collect::<BTreeMap<_, _>>();
            spec.max_sessions = max_sessions.unwrap_or(spec.max_sessions);
            let v = client.call("POST", &base(vip), Some(&serde_json::to_value(spec)?))?;
            out.show(&v, |out, v| {
                Ok(writeln!(
                    out,
                    "added backend {address} to {vip} (id {}, weight {})",
                    cell(&v["id"]),
                    cell(&v["weight"])
                )?)
            })
        }
        BackendCommand::Remove { vip, address } => {
            let v = client.call("DELETE", &one(vip, address), None)?;
            out.show(&v, |out, _| {
                Ok(writeln!(out, "removed backend {address} from {vip}")?)
            })
        }
        BackendCommand::SetWeight {
            vip,
            address,
            weight,
        } => {
            let body = serde_json::to_value(WeightChange { weight: *weight })?;
            let v = client.call("PUT", &format!("{}/weight", one(vip, address)), Some(&body))?;
            out.show(&v, |out, v| {
                Ok(writeln!(
                    out,
                    "backend {address} of {vip}: weight {}",
                    cell(&v["weight"])
                )?)
            })
        }
        BackendCommand::Drain {
            vip,
            address,
            deadline,
        } => {
            let body = serde_json::to_value(DrainRequest {
                deadline: deadline.clone(),
            })?;
            let v = client.call("POST", &format!("{}/drain", one(vip, address)), Some(&body))?;
            out.show(&v, |out, v| {
                let until = match v["drain_deadline_ms"].as_u64() {
                    Some(ms) => format!("when its flows end, or at {}", timestamp(ms)),
                    None => "when its flows end".into(),
                };
                Ok(writeln!(
                    out,
                    "draining backend {address} of {vip}: no new flows; removed {until}"
                )?)
            })
        }
        BackendCommand::Undrain { vip, address } => {
            let v = client.call("POST", &format!("{}/undrain", one(vip, address)), None)?;
            out.show(&v, |out, _| {
                Ok(writeln!(
                    out,
                    "backend {address} of {vip} takes new flows again"
                )?)
            })
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::admin::testing::TestServer;

    /// Runs `sluice ARGS` against `srv`: what it printed, or its error message.
    fn sluice(srv: &TestServer, args: &[&str]) -> Result<String, String> {
        let socket = srv.socket.to_str().unwrap();
        let argv = ["sluice", "--socket", socket]
            .into_iter()
            .chain(args.iter().copied());
        let cli = Cli::try_parse_from(argv).map_err(|e| e.to_string())?;
        let mut out = Vec::new();
        execute(&cli, &mut out).map_err(|e| format!("{e:#}"))?;
        Ok(String::from_utf8(out).unwrap())
    }

    #[test]
    fn telemetry_reads_an_exporter_page_as_the_scraper_does() {
        let srv = TestServer::start();
        let fixture = concat!(
            env!("CARGO_MANIFEST_DIR"),
            "/tests/fixtures/telemetry/dcgm-exporter.prom"
        );
        let out = sluice(&srv, &["telemetry", "dcgm", fixture, "--gpu", "0"]).unwrap();
        assert!(
            out.lines()
                .any(|l| l.starts_with("gpu_util") && l.ends_with("0.87")),
            "{out}"
        );
        let err = sluice(&srv, &["telemetry", "dcgm", fixture, "--gpu", "9"]).unwrap_err();
        assert!(err.contains('9'), "{err}");
    }

    #[test]
    fn vip_add_then_list() {
        let srv = TestServer::start();
        let out = sluice(
            &srv,
            &[
                "vip",
                "add",
                "chat",
                "--address",
                "10.0.0.1",
                "--port",
                "443",
                "--hash",
                "source",
                "--affinity-window",
                "10m",
                "--flow-state",
                "second-chance",
                "--backend",
                "10.1.0.1",
                "--backend",
                "10.1.0.2:50",
            ],
        )
        .unwrap();
        assert_eq!(out, "added VIP chat: tcp 10.0.0.1:443, 2 backends\n");
        let vip = srv.state().vips["chat"].clone();
        assert_eq!(vip.spec.affinity_secs, 600);
        assert_eq!(vip.spec.hash, HashMode::Source);
        assert_eq!(vip.spec.flow_state, FlowState::SecondChance);
        assert_eq!(vip.backends[&"10.1.0.2".parse().unwrap()].spec.weight, 50);

        let out = sluice(&srv, &["vip", "list"]).unwrap();
        assert_eq!(
            out,
            "NAME  PROTO  ADDRESS       HASH    AFFINITY  PRIO  BACKENDS  FLOWS  PACKETS  BYTES\n\
             chat  tcp    10.0.0.1:443  source  10m       0     2         0      0        0\n"
        );

        let e = sluice(
            &srv,
            &["vip", "add", "chat", "--address", "10.0.0.2", "--port", "1"],
        )
        .unwrap_err();
        assert_eq!(e, "a VIP named \"chat\" exists already");
    }

    #[test]
    fn backend_drain_then_list() {
        let srv = TestServer::start();
        sluice(
            &srv,
            &[
                "vip",
                "add",
                "chat",
                "--address",
                "10.0.0.1",
                "--port",
                "443",
                "--backend",
                "10.1.0.1",
            ],
        )
        .unwrap();
        sluice(
            &srv,
            &[
                "backend", "add", "chat", "10.1.0.2", "--weight", "5", "--label", "zone=b",
            ],
        )
        .unwrap();
        let out = sluice(
            &srv,
            &["backend", "drain", "chat", "10.1.0.1", "--deadline", "10m"],
        )
        .unwrap();
        assert!(out.starts_with("draining backend 10.1.0.1 of chat: no new flows; removed when its flows end, or at 20"), "{out}");

        let out = sluice(&srv, &["backend", "list", "chat"]).unwrap();
        let lines: Vec<&str> = out.lines().collect();
        assert_eq!(lines.len(), 3, "{out}");
        assert!(
            lines[0].starts_with(
                "ADDRESS   ID  WEIGHT  EFFECTIVE  STATE     STEERING  SCORE  COOLDOWN  TELEMETRY  INBAND  HANDSHAKES  HEALTHY  FLOWS  PACKETS  BYTES  DRAIN"
            ),
            "{out}"
        );
        assert!(lines[1].starts_with("10.1.0.1  1   100     100        draining  -         -      -         -          -       -           yes      0      0        0      since 0s ago, deadline in 9m 59s"), "{out}");
        assert!(
            lines[2].starts_with(
                "10.1.0.2  2   5       5          active    -         -      -         -          -       -           yes      0      0        0      -"
            ),
            "{out}"
        );
        assert!(lines[2].ends_with("zone=b"), "{out}");

        let e = sluice(&srv, &["backend", "drain", "chat", "10.1.0.9"]).unwrap_err();
        assert_eq!(
            e,
            "VIP \"chat\" has no backend 10.1.0.9; `sluice backend list chat` shows its backends"
        );
        sluice(&srv, &["backend", "undrain", "chat", "10.1.0.1"]).unwrap();
        sluice(&srv, &["backend", "set-weight", "chat", "10.1.0.1", "7"]).unwrap();
        assert_eq!(
            srv.state()
                .backend("chat", "10.1.0.1".parse().unwrap())
                .unwrap()
                .spec
                .weight,
            7
        );
        assert_eq!(
            sluice(&srv, &["backend", "remove", "chat", "10.1.0.1"]).unwrap(),
            "removed backend 10.1.0.1 from chat\n"
        );
    }

    #[test]
    fn stats_json_is_the_api_answer() {
        let srv = TestServer::start();
        sluice(
            &srv,
            &[
                "vip",
                "add",
                "chat",
                "--address",
                "fd00::1",
                "--port",
                "0",
                "--protocol",
                "udp",
                "--backend",
                "[fd00:1::1]:30",
            ],
        )
        .unwrap();
        let out = sluice(&srv, &["stats", "--json"]).unwrap();
        let v: Value = serde_json::from_str(&out).unwrap();
        assert_eq!(v, srv.client().call("GET", "/v1/stats", None).unwrap());
        assert_eq!(v["vips"][0]["vip"], "chat");
        assert_eq!(v["vips"][0]["backends"][0]["address"], "fd00:1::1");
        let human = sluice(&srv, &["stats"]).unwrap();
        assert!(human.starts_with("COUNTER"), "{human}");
        assert!(
            human.contains("chat  fd00:1::1  0        0      0"),
            "{human}"
        );
        // Removals print nothing with --json (the API answers 204).
        assert_eq!(
            sluice(&srv, &["--json", "vip", "remove", "chat"]).unwrap(),
            ""
        );
    }

    #[test]
    fn the_other_read_commands_print_tables() {
        let srv = TestServer::start();
        sluice(
            &srv,
            &[
                "vip",
                "add",
                "chat",
                "--address",
                "10.0.0.1",
                "--port",
                "443",
                "--backend",
                "10.1.0.1",
            ],
        )
        .unwrap();
        let status = sluice(&srv, &["status"]).unwrap();
        assert!(status.contains("interfaces  eth0 (native)\n"), "{status}");
        assert!(status.contains("vips        1\n"), "{status}");
        assert_eq!(
            sluice(&srv, &["flows", "--summary"]).unwrap(),
            "VIP   BACKEND   FLOWS\nchat  (all)     0\nchat  10.1.0.1  0\n"
        );
        assert_eq!(
            sluice(&srv, &["events"]).unwrap(),
            "TIME  KIND  VIP  BACKEND  REASON\n"
        );
    }

    #[test]
    fn run_reports_a_missing_config() {
        let cli =
            Cli::try_parse_from(["sluice", "run", "--config", "/nonexistent/sluice.toml"]).unwrap();
        let e = execute(&cli, &mut Vec::new()).unwrap_err();
        assert!(
            format!("{e:#}").contains("/nonexistent/sluice.toml"),
            "{e:#}"
        );
    }

    /// Whatever a daemon sends, the listing stays one row per backend with no control
    /// character in it: escape sequences must not reach root's terminal through
    /// `sluice backend list`, nor a newline forge a table row.
    #[test]
    fn server_strings_are_escaped_in_every_listing() {
        let hostile = "r1\x1b]0;owned\x07\n10.6.6.6  9  100\u{9b}2J\u{202e}";
        let answer = json!({"backends": [{
            "address": hostile,
            "id": 1,
            "labels": {hostile: hostile},
            "state": hostile,
            "steering": {"state": hostile, "reason": hostile},
        }]});
        let clean = |text: &str, lines: usize| {
            assert_eq!(text.lines().count(), lines, "{text}");
            assert!(
                !text
                    .chars()
                    .any(|c| c != '\n' && escape::text(&c.to_string()) != c.to_string()),
                "{text:?}"
            );
        };
        let mut out = Vec::new();
        print_backends(&mut out, &answer).unwrap();
        let text = String::from_utf8(out).unwrap();
        clean(&text, 2);
        assert!(
            text.contains("r1\\u{1b}]0;owned\\u{7}\\n10.6.6.6"),
            "{text}"
        );
        let mut out = Vec::new();
        print_status(
            &mut out,
            &json!({"interfaces": [{"name": hostile, "mode": hostile}], "version": hostile}),
        )
        .unwrap();
        clean(&String::from_utf8(out).unwrap(), 8);
        let mut out = Vec::new();
        Output {
            json: true,
            out: &mut out,
        }
        .show(&answer, print_backends)
        .unwrap();
        let text = String::from_utf8(out).unwrap();
        assert!(!text.contains(['\u{9b}', '\u{202e}']), "{text:?}");
        assert_eq!(serde_json::from_str::<Value>(&text).unwrap(), answer);
        // A deadline no RFC 3339 date can hold is shown, not a panic.
        assert_eq!(timestamp(u64::MAX), format!("{} ms after 1970", u64::MAX));
    }

    #[test]
    fn usage_errors_exit_2_and_help_reads() {
        Cli::command().debug_assert();
        let e = Cli::try_parse_from([
            "sluice",
            "backend",
            "drain",
            "chat",
            "10.1.0.1",
            "--deadline",
            "soon",
        ])
        .unwrap_err();
        assert_eq!(e.exit_code(), 2);
        assert!(
            e.to_string().contains("e.g. \"500ms\", \"10s\", \"5m\""),
            "{e}"
        );
        let e = Cli::try_parse_from([
            "sluice",
            "backend",
            "drain",
            "chat",
            "10.1.0.1",
            "--deadline",
            "18446744073709552s",
        ])
        .unwrap_err();
        assert!(e.to_string().contains("is longer than 365d"), "{e}");
        let e = Cli::try_parse_from([
            "sluice",
            "vip",
            "add",
            "x",
            "--address",
            "10.0.0.1",
            "--port",
            "1",
            "--protocol",
            "sctp",
        ])
        .unwrap_err();
        assert_eq!(e.exit_code(), 2);
        // Every command's help renders, with its examples.
        let mut cmd = Cli::command();
        for sub in cmd.get_subcommands_mut().filter(|c| c.get_name() != "help") {
            let help = sub.render_long_help().to_string();
            assert!(
                help.contains("Example"),
                "{} has no examples:\n{help}",
                sub.get_name()
            );
            for leaf in sub.get_subcommands_mut().filter(|c| c.get_name() != "help") {
                let help = leaf.render_long_help().to_string();
                assert!(
                    help.contains("Example"),
                    "{} has no examples:\n{help}",
                    leaf.get_name()
                );
            }
        }
    }

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

    #[test]
    fn cleanup_refuses_while_a_daemon_answers() {
        let srv = TestServer::start();
        let dir = srv.dir.join("bpffs");
        std::fs::create_dir_all(&dir).unwrap();
        let e = sluice(&srv, &["cleanup", "--bpffs", dir.to_str().unwrap()]).unwrap_err();
        assert!(e.starts_with("a sluice daemon (pid "), "{e}");
        assert!(dir.exists());
        let out = sluice(
            &srv,
            &["cleanup", "--force", "--bpffs", dir.to_str().unwrap()],
        )
        .unwrap();
        assert!(out.starts_with("removed the data plane pinned at"), "{out}");
        assert!(!dir.exists());
    }
}
