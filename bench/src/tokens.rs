//! `sluice-bench tokens`: a load generator of LLM token streams against OpenAI-compatible
//! servers (sluice-accel, or a VIP in front of them).
//!
//! Open loop (`--rate`): conversations arrive as a Poisson process at `rate / mean turns`
//! per second, so requests arrive at about `rate` per second once conversations are under
//! way (a later turn waits for the previous answer and the think time). Closed loop (`--users N`): N
//! users each run one conversation after another. Every turn of a conversation is a new TCP
//! connection from the conversation's source address (sources are dealt round robin), so a
//! source-affinity VIP keeps a conversation on one accelerator. Each turn's prompt is text:
//! the previous turn's prompt, the answer as received and the new message (seeded words, one
//! token each to sluice-accel), so the accelerator that served the previous turn finds it in
//! its prefix cache; the records carry the `cached_tokens` it reports. A connection refused or
//! reset before any response byte is tried again from the same address, up to `--retries`
//! times with the OpenAI Python SDK's backoff ([`client::retry_delay`]); a stream that broke
//! after its first byte is never retried. The run starts no request after `--duration` or
//! `--max-requests`, and every request (with its retries) ends within `--timeout-s`, so the
//! run stops by itself. See [`workload`] for the workload's defaults and their sources.
//!
//! Output: `--json` the summary ([`stats::Summary`] plus the configuration and, with
//! `--state`, the KV imbalance), `--records` one JSON line per request ([`Record`]).

mod cli;
pub mod client;
pub mod stats;
mod turns;
pub mod workload;

use std::{
    collections::BTreeMap,
    io::{IsTerminal, Write as _},
    net::{IpAddr, SocketAddr},
    sync::{
        atomic::{AtomicU64, Ordering},
        Arc,
    },
    time::Duration,
};

use anyhow::{bail, Context, Result};
use serde::Serialize;
use serde_json::json;
use sluice::{config::HttpUrl, scrape::http::Client as PageClient};
use tokio::{sync::mpsc, task::JoinSet, time::Instant};

use self::{
    cli::{config, Cli},
    stats::{r3, Summary},
    turns::conversation,
    workload::{Generator, Shape},
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
    /// What was asked: prompt tokens (with the conversation so far) and answer tokens.
    pub prompt_tokens: u32,
    pub max_tokens: u32,
    /// The x-sluice-backend header of the answer; null when there was none.
    pub backend: Option<String>,
    pub ttft_ms: Option<f64>,
    pub itl_ms_p50: Option<f64>,
    pub itl_ms_p99: Option<f64>,
    pub itl_ms_max: Option<f64>,
    pub e2e_ms: Option<f64>,
    pub tokens: u32,
    /// Prompt tokens the accelerator took from its prefix cache (the usage chunk's
    /// `prompt_tokens_details.cached_tokens`); null when it said nothing.
    pub cached_tokens: Option<u32>,
    /// null, or why the stream broke: connect, reset, timeout, no_done, status.
    pub broken: Option<String>,
    /// Connections tried: 1, plus one per retry of a refusal.
    pub attempts: u32,
    /// When the last attempt refused before any response byte (connect or reset) started,
    /// ms from the run's start; null when none was.
    pub last_refused_ms: Option<f64>,
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
    /// The longest wait for a request's next step ([`client::Ask::stall`]).
    pub stall: Duration,
    /// Retries of a connection refused or reset before any response byte.
    pub retries: u32,
    /// The API path requested.
    pub path: String,
    /// `http://host:port/state` URLs of the accelerators' control listeners, sampled for the
    /// KV imbalance; empty: no imbalance figure.
    pub state_urls: Vec<HttpUrl>,
    pub progress: bool,
    /// A moment (ms from the start) whose streams in flight the report follows.
    pub mark_ms: Option<f64>,
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
    /// With `mark_ms`: per backend, its streams in flight at the mark.
    pub in_flight: Option<BTreeMap<String, stats::InFlight>>,
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
    check_sources(&cfg.sources)?;
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
                let seed = sub_seed(run.cfg.seed, u64::from(user) + 1);
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
    // Every request has ended or been aborted: what they sent is all there is. (Not
    // `recv`, which would wait for the progress task to drop its sender.)
    let mut sent = Vec::new();
    while let Ok(rg) = rx.try_recv() {
        sent.push(rg);
    }
    sent.sort_by(|(a, _), (b, _)| a.start_ms.total_cmp(&b.start_ms));
    let (records, gaps): (Vec<Record>, Vec<Vec<f64>>) = sent.into_iter().unzip();
    let summary = stats::summarise(&records, &gaps, elapsed_s);
    let in_flight = run
        .cfg
        .mark_ms
        .map(|mark| stats::in_flight(&records, &gaps, mark));
    let samples: Vec<Vec<f64>> = kv_samples.iter().map(|(_, v)| v.clone()).collect();
    Ok(Report {
        summary,
        records,
        elapsed_s: r3(elapsed_s),
        imbalance: stats::imbalance(&samples),
        kv_samples,
        in_flight,
    })
}

/// Every source address must be one of this host's (or namespace's): otherwise each request
/// from it would fail to connect and the run would measure nothing.
fn check_sources(sources: &[IpAddr]) -> Result<()> {
    let missing: Vec<String> = sources
        .iter()
        .filter(|a| std::net::UdpSocket::bind(SocketAddr::new(**a, 0)).is_err())
        .map(|a| a.to_string())
        .collect();
    if !missing.is_empty() {
        bail!(
            "source addresses not on any interface here: {}; add them to the client's \
             interface (ip addr add ADDR/32 dev DEV) or leave them out",
            missing.join(", ")
        );
    }
    Ok(())
}

/// A seed of its own for the `n`-th of a run's independent random streams (a closed-loop
/// user's workload, a request's backoff jitter): spread by the 64-bit golden ratio so that
/// neighbouring `n` give unrelated streams.
fn sub_seed(seed: u64, n: u64) -> u64 {
    seed ^ n.wrapping_mul(0x9e37_79b9_7f4a_7c15)
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
            "stall_s": cfg.stall.as_secs_f64(),
            "retries": cfg.retries,
            "path": cfg.path,
        },
        "elapsed_s": report.elapsed_s,
        "summary": report.summary,
        "imbalance": report.imbalance,
        "kv_samples": report.kv_samples,
        "in_flight_at_mark": report.in_flight.as_ref().map(|b| json!({
            "mark_ms": cfg.mark_ms,
            "per_backend": b,
        })),
    })
}

pub fn main(args: &[String]) -> Result<()> {
    let Some(cli) = crate::cli_args::<Cli>("sluice-bench tokens", args)? else {
        return Ok(());
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
    let f = |v: Option<f64>| v.map_or("-".to_string(), |x| format!("{x:.1}"));
    println!(
        "{} requests in {:.1} s: {} completed, {} broken {:?}, {} retried ({} retries); \
         TTFT p50 {} p99 {} ms; inter-token p50 {} p99 {} ms; goodput {:.0} tokens/s; \
         affinity kept {}; imbalance {}",
        s.requests,
        report.elapsed_s,
        s.completed,
        s.broken,
        s.broken_by_reason,
        s.requests_retried,
        s.retries,
        f(s.ttft_ms.p50),
        f(s.ttft_ms.p99),
        f(s.itl_ms.p50),
        f(s.itl_ms.p99),
        s.goodput_tokens_per_s,
        f(s.affinity.fraction),
        report
            .imbalance
            .map_or("-".to_string(), |x| format!("{x:.3}")),
    );
    for (name, b) in &s.backends {
        println!(
            "  {name}: {} sessions, {} broken, {:.0} tokens/s, TTFT p99 {} ms",
            b.sessions,
            b.broken,
            b.tokens_per_s,
            f(b.ttft_ms.p99)
        );
    }
    println!("wrote {}", cli.json.display());
    Ok(())
}

#[cfg(test)]
mod tests {
    use rand::{rngs::StdRng, SeedableRng};
    use sluice_accel::{model::Params, server};

    use super::{client::Ask, turns::record, *};

    /// Starts a simulated accelerator in this runtime; returns its serving and control
    /// addresses. A fast model (1 ms steps) keeps the test short.
    async fn accel(name: &str) -> (SocketAddr, SocketAddr) {
        accel_on(name, "127.0.0.1:0".parse().unwrap()).await
    }

    async fn accel_on(name: &str, listen: SocketAddr) -> (SocketAddr, SocketAddr) {
        let (tx, rx) = tokio::sync::oneshot::channel();
        let cfg = server::Config {
            name: name.into(),
            listen: vec![listen],
            control: "127.0.0.1:0".parse().unwrap(),
            base_speed: 1.0,
            seed: 0,
            model: "m".into(),
            params: Params {
                step_base_ms: 1.0,
                step_per_seq_ms: 0.0,
                step_per_ktoken_ms: 0.0,
                prefill_tokens_per_s: 1e6,
                ..Params::default()
            },
        };
        tokio::spawn(async move {
            server::run(cfg, move |serve, control| {
                let _ = tx.send((serve[0], control));
            })
            .await
            .unwrap();
        });
        rx.await.unwrap()
    }

    #[test]
    fn sources_that_are_not_local_are_refused_up_front() {
        assert!(check_sources(&["127.0.0.9".parse().unwrap()]).is_ok());
        let e = check_sources(&["127.0.0.2".parse().unwrap(), "192.0.2.77".parse().unwrap()])
            .unwrap_err()
            .to_string();
        assert!(
            e.starts_with("source addresses not on any interface here: 192.0.2.77;"),
            "{e}"
        );
    }

    /// Closed loop against two accelerators on loopback: every request completes with the
    /// tokens it asked for, conversations stay on their accelerator and come from their
    /// source address, and the bounds stop the run. Asserts counts, never speed.
    #[test]
    fn closed_loop_against_two_accelerators() {
        let rt = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .unwrap();
        rt.block_on(async {
            let (s0, c0) = accel("gpu0").await;
            let (s1, c1) = accel("gpu1").await;
            let cfg = Config {
                targets: vec![s0, s1],
                load: Load::Users(4),
                duration: Duration::from_secs(30),
                max_requests: 40,
                seed: 5,
                sources: vec!["127.0.0.2".parse().unwrap(), "127.0.0.3".parse().unwrap()],
                shape: Shape {
                    output_median: 20.0,
                    max_output: 60,
                    prompt_median: 30.0,
                    think_ms: 5.0,
                    turns_mean: 3.0,
                    ..Shape::default()
                },
                timeout: Duration::from_secs(20),
                stall: Duration::from_secs(20),
                retries: client::DEFAULT_RETRIES,
                path: "/v1/chat/completions".into(),
                state_urls: [c0, c1]
                    .iter()
                    .map(|c| HttpUrl::parse(&format!("http://{c}/state")).unwrap())
                    .collect(),
                progress: false,
                mark_ms: None,
            };
            let report = run(cfg).await.unwrap();
            let s = &report.summary;
            assert_eq!(s.requests, 40, "{s:#?}");
            assert_eq!((s.completed, s.broken), (40, 0), "{s:#?}");
            for r in &report.records {
                assert_eq!(r.tokens, r.max_tokens, "{r:?}");
                assert!(r.ttft_ms.is_some() && r.e2e_ms.is_some(), "{r:?}");
                assert_eq!(r.itl_ms_p50.is_some(), r.tokens > 1, "{r:?}");
                // Conversation k of user u is k * 4 + u: sources and targets are dealt by it.
                let want_src = if r.conversation % 2 == 0 {
                    "127.0.0.2"
                } else {
                    "127.0.0.3"
                };
                let want_backend = if r.conversation % 2 == 0 {
                    "gpu0"
                } else {
                    "gpu1"
                };
                assert_eq!(
                    (r.client.as_str(), r.backend.as_deref()),
                    (want_src, Some(want_backend))
                );
            }
            // Each later turn resends the conversation so far to the accelerator that served
            // it: its prefix cache holds the earlier prompt and answer.
            let (first, later): (Vec<&Record>, Vec<&Record>) =
                report.records.iter().partition(|r| r.turn == 0);
            assert!(
                first.iter().all(|r| r.cached_tokens == Some(0)),
                "{first:?}"
            );
            for r in &later {
                // The previous turn computed its prompt and all but the last answer token;
                // its full blocks of 16 are reused.
                let prev = report
                    .records
                    .iter()
                    .find(|p| p.conversation == r.conversation && p.turn + 1 == r.turn)
                    .unwrap();
                let want = (prev.prompt_tokens + prev.max_tokens - 1) / 16 * 16;
                assert_eq!(r.cached_tokens, Some(want), "{prev:?} {r:?}");
            }
            assert!(later.iter().any(|r| r.cached_tokens > Some(0)), "{later:?}");
            assert!(s.affinity.later_turns > 0);
            assert_eq!(s.affinity.fraction, Some(1.0));
            assert_eq!(s.backends.len(), 2);
            assert_eq!(s.backends.values().map(|b| b.sessions).sum::<u64>(), 40);
            assert_eq!(
                s.tokens,
                report.records.iter().map(|r| r.tokens as u64).sum::<u64>()
            );
            assert_eq!(s.ttft_ms.count, 40);
        });
    }

    /// A port nothing listens on yet (the kernel refuses a connection with a RST), then an
    /// accelerator on it: the request that was refused is one completed record, on its
    /// second attempt, its TTFT from the first attempt's start (through the backoff). With
    /// no retries it is broken `connect` after one attempt.
    #[test]
    fn a_refused_request_is_retried_after_the_backoff() {
        let rt = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .unwrap();
        rt.block_on(async {
            let free = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
            let target = free.local_addr().unwrap();
            drop(free);
            let clock = quanta::Clock::new();
            let ask = |retries| Ask {
                target,
                source: None,
                path: "/v1/chat/completions",
                body: json!({"prompt_tokens": 10, "max_tokens": 5, "stream": true}).to_string(),
                timeout: Duration::from_secs(10),
                stall: Duration::from_secs(10),
                retries,
            };
            let mut rng = StdRng::seed_from_u64(1);
            let out = client::stream(ask(0), &clock, &mut rng).await;
            assert_eq!((out.broken, out.attempts), (Some(client::CONNECT), 1));
            assert!(out.last_refused_ms.is_some() && out.ttft_ms.is_none());

            // The first retry waits at least 375 ms; the accelerator is up well before.
            let up = tokio::spawn(async move {
                tokio::time::sleep(Duration::from_millis(100)).await;
                accel_on("late", target).await
            });
            let out = client::stream(ask(2), &clock, &mut rng).await;
            up.await.unwrap();
            assert_eq!(out.broken, None, "{out:?}");
            assert_eq!(out.attempts, 2, "{out:?}");
            assert_eq!((out.tokens, out.backend.as_deref()), (5, Some("late")));
            let refused = out.last_refused_ms.unwrap();
            let ttft = out.ttft_ms.unwrap();
            assert!(refused < 100.0 && ttft >= 375.0, "{out:?}");
            assert!(out.e2e_ms.unwrap() >= ttft);
            let r = record(1000.0, None, 3, 0, &out);
            assert_eq!((r.attempts, r.broken, r.ttft_ms), (2, None, Some(r3(ttft))));
            assert_eq!(r.last_refused_ms, Some(r3(1000.0 + refused)));
        });
    }

    /// Accepts one request on `listener`, reads it and answers the head of an SSE stream
    /// (chunked, from backend `b`); the caller writes the chunks.
    async fn answer_head(listener: &tokio::net::TcpListener) -> tokio::net::TcpStream {
        use tokio::io::{AsyncReadExt, AsyncWriteExt};
        let (mut conn, _) = listener.accept().await.unwrap();
        let mut buf = [0u8; 4096];
        let _ = conn.read(&mut buf).await.unwrap();
        conn.write_all(
            b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\n\
              x-sluice-backend: b\r\ntransfer-encoding: chunked\r\n\r\n",
        )
        .await
        .unwrap();
        conn
    }

    /// A stream reset after its first token is broken and never sent again: a retry would
    /// hide the breakage.
    #[test]
    fn a_stream_reset_after_its_first_byte_is_not_retried() {
        use tokio::io::AsyncWriteExt;
        let rt = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .unwrap();
        rt.block_on(async {
            let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
            let target = listener.local_addr().unwrap();
            let server = tokio::spawn(async move {
                let mut conn = answer_head(&listener).await;
                conn.write_all(b"a\r\ndata: {}\n\n\r\n").await.unwrap();
                // Let the client read the head and the token, then reset.
                tokio::time::sleep(Duration::from_millis(200)).await;
                conn.set_zero_linger().unwrap();
                drop(conn);
                // A retry would connect again within the backoff (at most 0.5 s).
                tokio::time::timeout(Duration::from_secs(1), listener.accept())
                    .await
                    .is_err()
            });
            let ask = Ask {
                target,
                source: None,
                path: "/v1/chat/completions",
                body: "{}".into(),
                timeout: Duration::from_secs(10),
                stall: Duration::from_secs(10),
                retries: 2,
            };
            let out =
                client::stream(ask, &quanta::Clock::new(), &mut StdRng::seed_from_u64(1)).await;
            assert_eq!(
                (out.broken, out.attempts),
                (Some(client::RESET), 1),
                "{out:?}"
            );
            assert_eq!((out.tokens, out.last_refused_ms), (1, None));
            assert!(server.await.unwrap(), "the client connected again");
        });
    }

    /// A stream that takes longer in all than the stall limit but never waits that long for
    /// a chunk completes (a slow accelerator's long answer is slow, not broken); one that
    /// waits longer for its next chunk is broken `timeout` within about the stall limit.
    #[test]
    fn a_slow_stream_completes_and_a_stalled_one_times_out() {
        use tokio::io::AsyncWriteExt;
        let rt = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .unwrap();
        rt.block_on(async {
            // Serves one request: the head, then `chunks` token chunks `gap` apart, then
            // [DONE].
            let serve = |chunks: u32, gap: Duration| async move {
                let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
                let target = listener.local_addr().unwrap();
                let server = tokio::spawn(async move {
                    let mut conn = answer_head(&listener).await;
                    for _ in 0..chunks {
                        tokio::time::sleep(gap).await;
                        if conn.write_all(b"a\r\ndata: {}\n\n\r\n").await.is_err() {
                            return;
                        }
                    }
                    let _ = conn.write_all(b"e\r\ndata: [DONE]\n\n\r\n0\r\n\r\n").await;
                });
                (target, server)
            };
            let ask = |target| Ask {
                target,
                source: None,
                path: "/v1/chat/completions",
                body: "{}".into(),
                timeout: Duration::from_secs(10),
                stall: Duration::from_millis(300),
                retries: 0,
            };
            let clock = quanta::Clock::new();
            let mut rng = StdRng::seed_from_u64(1);
            // 6 chunks 100 ms apart: 600 ms in all, twice the stall limit.
            let (target, server) = serve(6, Duration::from_millis(100)).await;
            let out = client::stream(ask(target), &clock, &mut rng).await;
            server.await.unwrap();
            assert_eq!((out.broken, out.tokens), (None, 6), "{out:?}");
            assert!(out.e2e_ms.unwrap() >= 600.0, "{out:?}");
            // The head, then a 2 s silence: broken after the stall limit, not the timeout.
            let (target, server) = serve(2, Duration::from_secs(2)).await;
            let start = std::time::Instant::now();
            let out = client::stream(ask(target), &clock, &mut rng).await;
            let took = start.elapsed();
            server.abort();
            assert_eq!(
                (out.broken, out.tokens),
                (Some(client::TIMEOUT), 0),
                "{out:?}"
            );
            assert!(took < Duration::from_secs(1), "{took:?}");
        });
    }
}
