//! One conversation: its turns in order, each a request whose outcome becomes a [`Record`].

use std::{
    net::IpAddr,
    sync::{atomic::Ordering, Arc},
    time::Duration,
};

use rand::{rngs::StdRng, RngExt, SeedableRng};
use serde_json::json;
use tokio::time::Instant;

use super::{
    client::{self, Ask, Outcome},
    stats::{nearest_rank, r3},
    sub_seed,
    workload::Turn,
    Record, Run,
};

/// Words of the users' messages: a stream of its own per conversation (apart from the
/// workload's and the backoff's streams, so that the text changes neither).
const WORDS_STREAM: u64 = 0x776f_7264;

/// A user message of `n` words (one token each to the simulator's tokenizer), drawn from
/// `rng`: random 32-bit hex words, so conversations share no prefix.
fn message(rng: &mut StdRng, n: u32) -> impl Iterator<Item = String> + '_ {
    (0..n).map(|_| format!("{:08x}", rng.random::<u32>()))
}

pub(super) async fn conversation(run: Arc<Run>, id: u64, turns: Vec<Turn>) {
    let cfg = &run.cfg;
    let source = (!cfg.sources.is_empty()).then(|| cfg.sources[id as usize % cfg.sources.len()]);
    let target = cfg.targets[id as usize % cfg.targets.len()];
    let mut words = StdRng::seed_from_u64(sub_seed(cfg.seed ^ WORDS_STREAM, id));
    // The conversation so far, as a chat client resends it: the previous turn's prompt,
    // then the answer's text as received.
    let mut history: Vec<String> = Vec::new();
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
        // History plus the new message, the oldest words dropped past the workload's cap:
        // then the prefix changes and hits nothing, as when a front end truncates.
        let mut prompt = std::mem::take(&mut history);
        prompt.extend(message(&mut words, turn.message_tokens));
        let cut = prompt.len().saturating_sub(turn.prompt_tokens as usize);
        prompt.drain(..cut);
        let text = prompt.join(" ");
        let start_ms = run.ms_since_start();
        let mut body = json!({
            "model": "sluice-sim",
            "max_tokens": turn.max_tokens,
            "stream": true,
            "stream_options": {"include_usage": true},
        });
        if cfg.path.ends_with("/chat/completions") {
            body["messages"] = json!([{"role": "user", "content": text}]);
        } else {
            body["prompt"] = json!(text);
        }
        let body = body.to_string();
        let ask = Ask {
            target,
            source,
            path: &cfg.path,
            body,
            timeout: cfg.timeout,
            stall: cfg.stall,
            retries: cfg.retries,
        };
        // The backoff's jitter: one stream of draws per request, so that runs of a seed
        // repeat whatever order the requests' tasks run in.
        let mut rng = StdRng::seed_from_u64(sub_seed(cfg.seed, id) ^ (k as u64).rotate_left(32));
        let out = client::stream(ask, &run.clock, &mut rng).await;
        let broken = out.broken.is_some();
        let record = Record {
            prompt_tokens: turn.prompt_tokens,
            max_tokens: turn.max_tokens,
            ..record(start_ms, source, id, k as u32, &out)
        };
        run.done.fetch_add(1, Ordering::Relaxed);
        run.broken.fetch_add(broken as u64, Ordering::Relaxed);
        if broken {
            let _ = run.tx.send((record, out.gaps_ms));
            // A user whose answer broke does not go on with that conversation.
            return;
        }
        history = prompt;
        history.extend(out.text.split_whitespace().map(str::to_owned));
        let _ = run.tx.send((record, out.gaps_ms));
    }
}

pub(super) fn record(
    start_ms: f64,
    source: Option<IpAddr>,
    conv: u64,
    turn: u32,
    out: &Outcome,
) -> Record {
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
        cached_tokens: out.cached_tokens,
        broken: out.broken.map(str::to_owned),
        attempts: out.attempts,
        last_refused_ms: out.last_refused_ms.map(|t| r3(start_ms + t)),
        ..Record::default()
    }
}
