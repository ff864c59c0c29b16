//! `sluice-bench tokens`: a load generator of LLM token streams against OpenAI-compatible
//! servers (sluice-accel, or a VIP in front of them).
//!
//! Open loop (`--rate`): conversations arrive as a Poisson process at `rate / mean turns`
//! per second, so requests arrive at about `rate` per second. Closed loop (`--users N`): N
//! users each run one conversation after another. Every turn of a conversation is a new TCP
//! connection from the conversation's source address (sources are dealt round robin), so a
//! source-affinity VIP keeps a conversation on one accelerator. The run starts no request
//! after `--duration` or `--max-requests`, and every request ends within `--timeout-s`, so
//! the run stops by itself. See [`workload`] for the workload's defaults and their sources.
//!
//! Output: `--json` the summary ([`stats::Summary`] plus the configuration and, with
//! `--state`, the KV imbalance), `--records` one JSON line per request ([`Record`]).

pub mod client;
pub mod stats;
pub mod workload;

use std::{
    io::{IsTerminal, Write as _},
    net::{IpAddr, SocketAddr},
    path::PathBuf,
    sync::{
        atomic::{AtomicU64, Ordering},
        Arc,
    },
    time::Duration,
};

use anyhow::{bail, Context, Result};
use clap::Parser;
use serde::Serialize;
use serde_json::json;
use sluice::telemetry::{http::Client as PageClient, target::HttpUrl};
use tokio::{sync::mpsc, task::JoinSet, time::Instant};

use self::{
    client::{Ask, Outcome},
    stats::{nearest_rank, r3, Summary},
    workload::{Generator, Shape, Turn},
};

/// One request, as `--records` writes it.
#[derive(Clone, Debug, Default, PartialEq, Serialize)]
pub struct Record {
    /// When the request started, ms from the run's start.
    pub start_ms: f64,
    /// The source address it came from ("" when the OS chose).
    pub client: String,
    pub conversation: u64,
    /// 0 for a conversation's first turn.
    pub turn: u32,
    /// The x-sluice-backend header of the answer; null when there was none.
    pub backend: Option<String>,
    pub ttft_ms: Option<f64>,
    pub itl_ms_p50: Option<f64>,
    pub itl_ms_p99: Option<f64>,
    pub itl_ms_max: Option<f64>,
    pub e2e_ms: Option<f64>,
    pub tokens: u32,
    /// null, or why the stream broke: connect, reset, timeout, no_done, status.
    pub broken: Option<String>,
}

/// Offered load.
#[derive(Clone, Debug, PartialEq)]
pub enum Load {
    /// Open loop: requests per second (conversations arrive at rate / mean turns).
    Rate(f64),
    /// Closed loop: concurrent users.
    Users(u32),
}

#[derive(Clone, Debug)]
pub struct Config {
    pub targets: Vec<SocketAddr>,
    pub load: Load,
    pub duration: Duration,
    pub max_requests: u64,
    pub seed: u64,
    pub sources: Vec<IpAddr>,
    pub shape: Shape,
    pub timeout: Duration,
    /// The API path requested.
    pub path: String,
    /// `http://host:port/state` URLs of the accelerators' control listeners, sampled for the
    /// KV imbalance; empty: no imbalance figure.
    pub state_urls: Vec<HttpUrl>,
    pub progress: bool,
}

/// A run's outcome.
#[derive(Clone, Debug)]
pub struct Report {
    pub summary: Summary,
    pub records: Vec<Record>,
    /// Wall time from the start to the end of the last request, seconds.
    pub elapsed_s: f64,
    /// Mean over time of max/mean of the accelerators' KV use (with `state_urls`).
    pub imbalance: Option<f64>,
    /// KV use samples: (ms from start, one value per state URL).
    pub kv_samples: Vec<(f64, Vec<f64>)>,
}

/// Shared by the tasks of a run.
struct Run {
    cfg: Config,
    clock: quanta::Clock,
    t0: quanta::Instant,
    /// tokio's view of the end of the arrival window.
    stop_at: Instant,
    started: AtomicU64,
    done: AtomicU64,
    broken: AtomicU64,
    tx: mpsc::UnboundedSender<(Record, Vec<f64>)>,
}

impl Run {
    fn ms_since_start(&self) -> f64 {
        (self.clock.now() - self.t0).as_secs_f64() * 1000.0
    }

    /// Claims the next request slot, unless the run is over.
    fn claim(&self) -> bool {
        Instant::now() < self.stop_at
            && self.started.fetch_add(1, Ordering::SeqCst) < self.cfg.max_requests
    }
}

/// Runs the load and gathers the records.
pub async fn run(cfg: Config) -> Result<Report> {
    cfg.shape.validate().map_err(anyhow::Error::msg)?;
    if cfg.targets.is_empty() {
        bail!("no --target given: name at least one ADDR:PORT to send requests to");
    }
    let mut gen = Generator::new(cfg.shape.clone(), cfg.seed).map_err(anyhow::Error::msg)?;
    let (tx, mut rx) = mpsc::unbounded_channel();
    let clock = quanta::Clock::new();
    let start = Instant::now();
    let run = Arc::new(Run {
        t0: clock.now(),
        clock,
        stop_at: start + cfg.duration,
        started: AtomicU64::new(0),
        done: AtomicU64::new(0),
        broken: AtomicU64::new(0),
        tx,
        cfg,
    });
    let bar = progress_bar(&run);
    let sampler = (!run.cfg.state_urls.is_empty()).then(|| tokio::spawn(sample_kv(run.clone())));
    let mut tasks = JoinSet::new();
    match run.cfg.load {
        Load::Rate(rate) => {
            let conv_rate = rate / run.cfg.shape.turns_mean;
            let mut at = 0.0;
            let mut conv = 0u64;
            loop {
                at += gen.arrival_gap_s(conv_rate);
                let when = start + Duration::from_secs_f64(at);
                if when >= run.stop_at || run.started.load(Ordering::SeqCst) >= run.cfg.max_requests
                {
                    break;
                }
                let turns = gen.conversation();
                tokio::time::sleep_until(when).await;
                tasks.spawn(conversation(run.clone(), conv, turns));
                conv += 1;
            }
        }
        Load::Users(n) => {
            for user in 0..n {
                let run = run.clone();
                let seed = run.cfg.seed ^ (u64::from(user) + 1).wrapping_mul(0x9e37_79b9_7f4a_7c15);
                let mut gen =
                    Generator::new(run.cfg.shape.clone(), seed).map_err(anyhow::Error::msg)?;
                tasks.spawn(async move {
                    // Conversation ids: user u's k-th is k * n + u, unique across users.
                    let mut k = 0u64;
                    while Instant::now() < run.stop_at
                        && run.started.load(Ordering::SeqCst) < run.cfg.max_requests
                    {
                        let turns = gen.conversation();
                        conversation(run.clone(), k * u64::from(n) + u64::from(user), turns).await;
                        k += 1;
                    }
                });
            }
        }
    }
    // Every request ends within the timeout; the margin covers think time cut short.
    let hard_stop = run.stop_at + run.cfg.timeout + Duration::from_secs(5);
    while tokio::time::timeout_at(hard_stop, tasks.join_next())
        .await
        .ok()
        .flatten()
        .is_some()
    {}
    tasks.abort_all();
    let elapsed_s = run.ms_since_start() / 1000.0;
    let kv_samples = match sampler {
        Some(h) => {
            h.abort();
            h.await.unwrap_or_default()
        }
        None => Vec::new(),
    };
    if let Some(b) = bar {
        b.finish_and_clear();
    }
    drop(run);
    let (mut records, mut gaps) = (Vec::new(), Vec::new());
    while let Some((r, g)) = rx.recv().await {
        records.push(r);
        gaps.extend(g);
    }
    records.sort_by(|a, b| a.start_ms.total_cmp(&b.start_ms));
    let summary = stats::summarise(&records, &gaps, elapsed_s);
    let samples: Vec<Vec<f64>> = kv_samples.iter().map(|(_, v)| v.clone()).collect();
    Ok(Report {
        summary,
        records,
        elapsed_s: r3(elapsed_s),
        imbalance: stats::imbalance(&samples),
        kv_samples,
    })
}

async fn conversation(run: Arc<Run>, id: u64, turns: Vec<Turn>) {
    let cfg = &run.cfg;
    let source = (!cfg.sources.is_empty()).then(|| cfg.sources[id as usize % cfg.sources.len()]);
    let target = cfg.targets[id as usize % cfg.targets.len()];
    for (k, turn) in turns.iter().enumerate() {
        if turn.think_ms > 0.0 {
            let wake = Instant::now() + Duration::from_secs_f64(turn.think_ms / 1000.0);
            if wake >= run.stop_at {
                return;
            }
            tokio::time::sleep_until(wake).await;
        }
        if !run.claim() {
            return;
        }
        let start_ms = run.ms_since_start();
        let body = json!({
            "model": "sluice-sim",
            "messages": [{"role": "user", "content": format!("conversation {id} turn {k}")}],
            "prompt_tokens": turn.prompt_tokens,
            "max_tokens": turn.max_tokens,
            "stream": true,
        })
        .to_string();
        let ask = Ask {
            target,
            source,
            path: &cfg.path,
            body,
            timeout: cfg.timeout,
        };
        let out = client::stream(ask, &run.clock).await;
        let broken = out.broken.is_some();
        let record = record(start_ms, source, id, k as u32, &out);
        run.done.fetch_add(1, Ordering::Relaxed);
        run.broken.fetch_add(broken as u64, Ordering::Relaxed);
        let _ = run.tx.send((record, out.gaps_ms));
        if broken {
            // A user whose answer broke does not go on with that conversation.
            return;
        }
    }
}

fn record(start_ms: f64, source: Option<IpAddr>, conv: u64, turn: u32, out: &Outcome) -> Record {
    let mut gaps = out.gaps_ms.clone();
    gaps.sort_by(f64::total_cmp);
    Record {
        start_ms: r3(start_ms),
        client: source.map(|s| s.to_string()).unwrap_or_default(),
        conversation: conv,
        turn,
        backend: out.backend.clone(),
        ttft_ms: out.ttft_ms.map(r3),
        itl_ms_p50: nearest_rank(&gaps, 0.5).map(r3),
        itl_ms_p99: nearest_rank(&gaps, 0.99).map(r3),
        itl_ms_max: gaps.last().copied().map(r3),
        e2e_ms: out.e2e_ms.map(r3),
        tokens: out.tokens,
        broken: out.broken.map(str::to_owned),
    }
}

/// Samples every accelerator's `/state` twice a second until aborted; an accelerator that
/// does not answer (killed, say) counts as 0.
async fn sample_kv(run: Arc<Run>) -> Vec<(f64, Vec<f64>)> {
    let mut clients: Vec<PageClient> = run
        .cfg
        .state_urls
        .iter()
        .cloned()
        .map(PageClient::new)
        .collect();
    let mut out = Vec::new();
    let mut tick = tokio::time::interval(Duration::from_millis(500));
    while Instant::now() < run.stop_at {
        tick.tick().await;
        let at = run.ms_since_start();
        let mut row = Vec::new();
        for c in clients.iter_mut() {
            let kv = c
                .get(Duration::from_millis(250))
                .await
                .ok()
                .and_then(|t| serde_json::from_str::<serde_json::Value>(&t).ok())
                .and_then(|v| v["kv_used_fraction"].as_f64())
                .unwrap_or(0.0);
            row.push(kv);
        }
        out.push((r3(at), row));
    }
    out
}

fn progress_bar(run: &Arc<Run>) -> Option<indicatif::ProgressBar> {
    if !(run.cfg.progress || std::io::stderr().is_terminal()) {
        return None;
    }
    let secs = run.cfg.duration.as_secs().max(1);
    let bar = indicatif::ProgressBar::new(secs);
    if let Ok(style) = indicatif::ProgressStyle::with_template("{bar:40} {pos}/{len} s  {msg}") {
        bar.set_style(style);
    }
    let (b, run) = (bar.clone(), run.clone());
    tokio::spawn(async move {
        let mut tick = tokio::time::interval(Duration::from_millis(250));
        loop {
            tick.tick().await;
            b.set_position(((run.ms_since_start() / 1000.0) as u64).min(secs));
            b.set_message(format!(
                "{} started, {} done, {} broken",
                run.started
                    .load(Ordering::Relaxed)
                    .min(run.cfg.max_requests),
                run.done.load(Ordering::Relaxed),
                run.broken.load(Ordering::Relaxed)
            ));
            if b.is_finished() {
                return;
            }
        }
    });
    Some(bar)
}

/// `sluice-bench tokens --help`.
#[derive(Parser, Debug)]
#[command(
    name = "sluice-bench tokens",
    about = "Load generator of OpenAI-style token streams: Poisson or closed-loop conversations \
             from many source addresses; TTFT, inter-token latency, goodput, broken streams, \
             per-backend shares and affinity as JSON"
)]
struct Cli {
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
    /// Seconds a request may take in all before it counts as broken (timeout).
    #[arg(long, default_value_t = 60.0)]
    timeout_s: f64,
    /// API path.
    #[arg(long, default_value = "/v1/chat/completions")]
    path: String,
    /// An accelerator's control listener (ADDR:PORT) whose GET /state is sampled for the KV
    /// imbalance; repeatable.
    #[arg(long = "state")]
    states: Vec<SocketAddr>,
    /// Summary JSON file.
    #[arg(long)]
    json: PathBuf,
    /// Per-request JSON lines file.
    #[arg(long)]
    records: Option<PathBuf>,
    /// Draw a progress bar (drawn only when stderr is a terminal, which also turns it on).
    #[arg(long)]
    progress: bool,
}

fn config(cli: &Cli) -> Result<Config> {
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
        path: cli.path.clone(),
        state_urls,
        progress: cli.progress,
    })
}

/// The summary document: the command line, the configuration, the run's figures.
pub fn summary_json(cfg: &Config, report: &Report) -> serde_json::Value {
    let (rate, users) = match cfg.load {
        Load::Rate(r) => (Some(r), None),
        Load::Users(n) => (None, Some(n)),
    };
    json!({
        "command_line": std::env::args().collect::<Vec<_>>().join(" "),
        "config": {
            "targets": cfg.targets.iter().map(|t| t.to_string()).collect::<Vec<_>>(),
            "rate": rate,
            "users": users,
            "duration_s": cfg.duration.as_secs_f64(),
            "max_requests": cfg.max_requests,
            "seed": cfg.seed,
            "sources": cfg.sources.len(),
            "prompt_median": cfg.shape.prompt_median,
            "prompt_sigma": cfg.shape.prompt_sigma,
            "output_median": cfg.shape.output_median,
            "output_sigma": cfg.shape.output_sigma,
            "turns_mean": r3(cfg.shape.turns_mean),
            "think_ms": cfg.shape.think_ms,
            "max_context": cfg.shape.max_context,
            "max_output": cfg.shape.max_output,
            "timeout_s": cfg.timeout.as_secs_f64(),
            "path": cfg.path,
        },
        "elapsed_s": report.elapsed_s,
        "summary": report.summary,
        "imbalance": report.imbalance,
        "kv_samples": report.kv_samples,
    })
}

pub fn main(args: &[String]) -> Result<()> {
    let cli = match Cli::try_parse_from(
        std::iter::once("sluice-bench tokens".to_string()).chain(args.iter().cloned()),
    ) {
        Ok(c) => c,
        Err(e) if !e.use_stderr() => {
            // --help, --version
            print!("{e}");
            return Ok(());
        }
        Err(e) => bail!("{e}"),
    };
    let cfg = config(&cli)?;
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .context("starting the runtime")?;
    let report = rt.block_on(run(cfg.clone()))?;
    let doc = summary_json(&cfg, &report);
    std::fs::write(&cli.json, serde_json::to_string_pretty(&doc)? + "\n")
        .with_context(|| format!("writing {}", cli.json.display()))?;
    if let Some(path) = &cli.records {
        let mut f = std::io::BufWriter::new(
            std::fs::File::create(path).with_context(|| format!("creating {}", path.display()))?,
        );
        for r in &report.records {
            serde_json::to_writer(&mut f, r)?;
            f.write_all(b"\n")?;
        }
        f.flush()
            .with_context(|| format!("writing {}", path.display()))?;
    }
    let s = &report.summary;
    println!(
        "{} requests in {:.1} s: {} completed, {} broken {:?}; TTFT p50 {:?} p99 {:?} ms; \
         inter-token p50 {:?} p99 {:?} ms; goodput {} tokens/s; affinity {:?}; imbalance {:?}",
        s.requests,
        report.elapsed_s,
        s.completed,
        s.broken,
        s.broken_by_reason,
        s.ttft_ms.p50,
        s.ttft_ms.p99,
        s.itl_ms.p50,
        s.itl_ms.p99,
        s.goodput_tokens_per_s,
        s.affinity.fraction,
        report.imbalance,
    );
    for (name, b) in &s.backends {
        println!(
            "  {name}: {} sessions, {} broken, {} tokens/s, TTFT p99 {:?} ms",
            b.sessions, b.broken, b.tokens_per_s, b.ttft_ms.p99
        );
    }
    println!("wrote {}", cli.json.display());
    Ok(())
}
