//! The command line: `sluice-bench tokens --help` and the run's configuration from it.

use std::{
    net::{IpAddr, SocketAddr},
    path::PathBuf,
    time::Duration,
};

use anyhow::{bail, Context, Result};
use clap::Parser;
use sluice::config::HttpUrl;

use super::{client, workload::Shape, Config, Load};

/// `sluice-bench tokens --help`.
#[derive(Parser, Debug)]
#[command(
    name = "sluice-bench tokens",
    about = "Load generator of OpenAI-style token streams: Poisson or closed-loop conversations \
             from many source addresses; TTFT, inter-token latency, goodput, broken streams, \
             per-backend shares and affinity as JSON"
)]
pub(super) struct Cli {
    /// Server or VIP to send to (ADDR:PORT); repeatable, conversations are dealt round robin.
    #[arg(long = "target", required = true)]
    targets: Vec<SocketAddr>,
    /// Open loop: requests per second (Poisson).
    #[arg(long, conflicts_with = "users", required_unless_present = "users")]
    rate: Option<f64>,
    /// Closed loop: concurrent users.
    #[arg(long)]
    users: Option<u32>,
    /// Seconds during which requests start.
    #[arg(long)]
    duration: f64,
    /// Most requests started.
    #[arg(long)]
    max_requests: u64,
    #[arg(long, default_value_t = 1)]
    seed: u64,
    /// Client source address (bound before connecting); repeatable.
    #[arg(long = "source")]
    sources: Vec<IpAddr>,
    /// File of source addresses, one per line (# comments).
    #[arg(long)]
    sources_file: Option<PathBuf>,
    /// Median turns per conversation (geometric); the default is a mean of 2.0 (LMSYS-Chat-1M).
    #[arg(long, conflicts_with = "turns_mean")]
    turns_median: Option<f64>,
    /// Mean turns per conversation (geometric).
    #[arg(long)]
    turns_mean: Option<f64>,
    /// Mean think time between turns, ms (exponential).
    #[arg(long, default_value_t = Shape::default().think_ms)]
    think_ms: f64,
    /// Median new prompt tokens per turn (log-normal).
    #[arg(long, default_value_t = Shape::default().prompt_median)]
    prompt_median: f64,
    #[arg(long, default_value_t = Shape::default().prompt_sigma)]
    prompt_sigma: f64,
    /// Median answer tokens (log-normal).
    #[arg(long, default_value_t = Shape::default().output_median)]
    output_median: f64,
    #[arg(long, default_value_t = Shape::default().output_sigma)]
    output_sigma: f64,
    /// Largest prompt + answer of one request, tokens.
    #[arg(long, default_value_t = Shape::default().max_context)]
    max_context: u32,
    /// Largest answer, tokens (draws above are cut to it).
    #[arg(long, default_value_t = Shape::default().max_output)]
    max_output: u32,
    /// Seconds a request may take in all before it counts as broken (timeout): bounds the run.
    #[arg(long, default_value_t = 60.0)]
    timeout_s: f64,
    /// Seconds a request may wait for its next step (the connection, the response head, the
    /// next chunk) before it counts as broken (timeout), as an HTTP client's read timeout
    /// (the OpenAI SDK's is 600 s); at most --timeout-s.
    #[arg(long, default_value_t = 60.0)]
    stall_s: f64,
    /// Retries of a connection refused or reset before any response byte, from the same
    /// source address, with the OpenAI Python SDK's backoff (0.5 s doubling, x0.75-1 jitter);
    /// the default is the SDK's. 0: a refusal breaks the request.
    #[arg(long, default_value_t = client::DEFAULT_RETRIES)]
    retries: u32,
    /// API path.
    #[arg(long, default_value = "/v1/chat/completions")]
    path: String,
    /// An accelerator's control listener (ADDR:PORT) whose GET /state is sampled for the KV
    /// imbalance; repeatable.
    #[arg(long = "state")]
    states: Vec<SocketAddr>,
    /// Summary JSON file.
    #[arg(long)]
    pub(super) json: PathBuf,
    /// Per-request JSON lines file.
    #[arg(long)]
    pub(super) records: Option<PathBuf>,
    /// Draw a progress bar (drawn only when stderr is a terminal, which also turns it on).
    #[arg(long)]
    progress: bool,
    /// Report, per backend, the streams in flight at this moment (ms from the start) and
    /// the p99 inter-token latency their later gaps alone set (the steer benchmark passes
    /// its first fault's start).
    #[arg(long)]
    mark_ms: Option<f64>,
}

pub(super) fn config(cli: &Cli) -> Result<Config> {
    let load = match (cli.rate, cli.users) {
        (Some(r), None) if r.is_finite() && r > 0.0 => Load::Rate(r),
        (Some(r), None) => bail!("--rate {r} must be a number > 0 (requests per second)"),
        (None, Some(n)) if n > 0 => Load::Users(n),
        _ => bail!("give --rate REQ_PER_S (open loop) or --users N > 0 (closed loop)"),
    };
    if !(cli.duration.is_finite() && cli.duration > 0.0 && cli.duration <= 86_400.0) {
        bail!("--duration {} must be in (0, 86400] seconds", cli.duration);
    }
    if !(cli.timeout_s.is_finite() && cli.timeout_s > 0.0 && cli.timeout_s <= 3600.0) {
        bail!("--timeout-s {} must be in (0, 3600] seconds", cli.timeout_s);
    }
    if !(cli.stall_s.is_finite() && cli.stall_s > 0.0 && cli.stall_s <= cli.timeout_s) {
        bail!(
            "--stall-s {} must be in (0, --timeout-s = {}] seconds",
            cli.stall_s,
            cli.timeout_s
        );
    }
    if cli.max_requests == 0 {
        bail!("--max-requests must be at least 1");
    }
    let mut sources = cli.sources.clone();
    if let Some(path) = &cli.sources_file {
        let text = std::fs::read_to_string(path)
            .with_context(|| format!("reading --sources-file {}", path.display()))?;
        for (i, line) in text.lines().enumerate() {
            let line = line.split('#').next().unwrap_or_default().trim();
            if line.is_empty() {
                continue;
            }
            sources.push(line.parse().with_context(|| {
                format!(
                    "{}:{}: {line:?} is not an IP address",
                    path.display(),
                    i + 1
                )
            })?);
        }
    }
    let turns_mean = match (cli.turns_median, cli.turns_mean) {
        (Some(m), _) if m.is_finite() && m >= 1.0 => Shape::turns_mean_from_median(m),
        (Some(m), _) => bail!("--turns-median {m} must be >= 1"),
        (None, Some(m)) => m,
        (None, None) => Shape::default().turns_mean,
    };
    let shape = Shape {
        prompt_median: cli.prompt_median,
        prompt_sigma: cli.prompt_sigma,
        output_median: cli.output_median,
        output_sigma: cli.output_sigma,
        turns_mean,
        think_ms: cli.think_ms,
        max_context: cli.max_context,
        max_output: cli.max_output,
        ..Shape::default()
    };
    shape.validate().map_err(anyhow::Error::msg)?;
    if let Some(m) = cli.mark_ms.filter(|m| !(m.is_finite() && *m >= 0.0)) {
        bail!("--mark-ms {m} must be a time >= 0 ms from the run's start");
    }
    let state_urls = cli
        .states
        .iter()
        .map(|a| HttpUrl::parse(&format!("http://{a}/state")).map_err(anyhow::Error::msg))
        .collect::<Result<_>>()?;
    Ok(Config {
        targets: cli.targets.clone(),
        load,
        duration: Duration::from_secs_f64(cli.duration),
        max_requests: cli.max_requests,
        seed: cli.seed,
        sources,
        shape,
        timeout: Duration::from_secs_f64(cli.timeout_s),
        stall: Duration::from_secs_f64(cli.stall_s),
        retries: cli.retries,
        path: cli.path.clone(),
        state_urls,
        progress: cli.progress,
        mark_ms: cli.mark_ms,
    })
}
