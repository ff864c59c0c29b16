//! The capacity model of one accelerator serving an LLM with continuous batching, on a clock
//! the caller supplies (seconds as `f64`), so tests drive it on a simulated clock and the
//! server on the wall clock.
//!
//! # The model
//!
//! The engine runs one forward pass ("step") after another while it has work, as vLLM's V1
//! scheduler does. Each step:
//!
//! 1. every running sequence that is decoding processes its one newest token (one unit of
//!    the step's token budget and one KV slot each); when the KV cache has no room for what
//!    the running sequences have yet to process, the most recently admitted one is preempted
//!    (its KV freed, it goes back to the head of the waiting queue and later recomputes its
//!    whole context), as vLLM's recompute preemption does;
//! 2. waiting requests are admitted in FIFO order while `running < max_num_seqs` and the head
//!    request's whole context (prompt, plus what it generated before a preemption) fits in
//!    the free KV cache; the head that does not fit blocks those behind it. An admitted
//!    request first takes what the prefix cache holds of its context (below): those tokens
//!    count as computed and need no prefill;
//! 3. the rest of the budget (`max_batched_tokens`) prefills admitted sequences in admission
//!    order, in chunks (chunked prefill);
//! 4. a sequence whose context is fully processed at the end of the step emits a token (its
//!    first one after a prefill); a sequence that reached `max_tokens` finishes and frees its
//!    KV.
//!
//! # Automatic prefix caching
//!
//! As vLLM V1 does by default (docs.vllm.ai, "Automatic Prefix Caching", design/prefix_caching;
//! `hash_block_tokens` in vllm/v1/core/kv_cache_utils.py, `get_computed_blocks` in
//! vllm/v1/core/kv_cache_manager.py, the free block queue in vllm/v1/core/block_pool.py):
//!
//! - a request's tokens (prompt, then answer) fall into blocks of [`BLOCK_TOKENS`]; each full
//!   block is named by a hash of its parent block's hash and its own token ids, so a block's
//!   hash stands for every token up to its end;
//! - on admission the longest run of leading blocks whose hashes are cached is reused: those
//!   tokens are computed without prefill work or step time. The run stops short of the last
//!   token of the context (vLLM's `max_cache_hit_length = num_tokens - 1`), which is always
//!   computed, so the first token is sampled from a forward pass;
//! - when a sequence leaves the running set (finished, cancelled or preempted) its full
//!   computed blocks, prompt and generated tokens alike, stay cached with no holder. Such
//!   blocks count as free KV (as in vLLM's `kv_cache_usage_perc`): admission ignores them,
//!   and they are evicted least recently freed first when running or admitted sequences need
//!   the room; of one sequence's blocks the last is evicted first (vLLM frees a request's
//!   blocks in reverse order). A cached block taken by a running sequence is not evictable
//!   and its tokens count once, however many sequences hold it;
//! - `prefix_cache_queries` and `prefix_cache_hits` count, in tokens, each request's context
//!   and its hit at its first admission (vLLM V1 counts a preempted request's later lookups
//!   apart).
//!
//! Simplification: vLLM caches a block as soon as it is full, so requests running at the
//! same time share a prefix; here a sequence's blocks are cached when it leaves the running
//! set, which is when a conversation's next turn (sent after the answer) can use them.
//! Requests given as a token count only (no ids) have no hashable content and never hit.
//!
//! A step lasts
//!
//! ```text
//! step = (base + per_seq * n + per_ktoken * kv_tokens / 1000 + prefill_tokens / prefill_rate) / speed
//! ```
//!
//! where `n` is the number of sequences in the step, `kv_tokens` the KV cache in use after it
//! (decode is memory-bandwidth bound: each step reads the weights once, `base`, and every
//! sequence's KV cache, `per_ktoken`), `prefill_tokens` the prompt tokens it processed and
//! `speed` the product of the fault factors (1.0 when healthy; 0.4 = throttled to 40 %).
//! Tokens taken from the prefix cache are neither prefill tokens nor steps. Time to first
//! token is therefore the FIFO wait plus the prefill steps of what was not cached, and inter-token
//! latency grows with the batch and with the KV it reads.
//!
//! # Parameters and where their order of magnitude comes from
//!
//! The defaults describe a 70B-class model in fp8 on a pair of H100s (tensor parallel 2).
//! NVIDIA's NIM benchmarking guide (docs.nvidia.com/nim/benchmarking/llm/1.0.0/performance,
//! "Llama-3.3-70b-instruct, version 1.8.0, 2 x H100 80G, fp8 TP2") reports, for 5000 input /
//! 500 output tokens: TTFT 406.77 ms and ITL 18.58 ms at concurrency 1, ITL 38.75 ms at 25,
//! 59.73 ms at 50, and a plateau near 93 ms from 100 on (where TTFT explodes: the batch is
//! full and requests queue); for 500 input / 2000 output tokens, TTFT 47.77 ms and ITL
//! 18.91 ms at concurrency 1. Fitting the formula to those rows:
//!
//! | parameter | default | from |
//! |---|---|---|
//! | `step_base_ms` | 17.7 | ITL at concurrency 1 (18.58 ms with 5000-token contexts, 18.91 ms with 500), less one sequence's terms |
//! | `step_per_ktoken_ms` | 0.14 | ITL grows by 0.84 ms per added 5000-in / 500-out request (20.17 ms from 1 to 25, 20.98 ms from 25 to 50); less `step_per_seq_ms`, that is 0.74 ms per ~5300 KV tokens |
//! | `step_per_seq_ms` | 0.1 | assumption (sampling and per-sequence overhead); small next to the KV term |
//! | `prefill_tokens_per_s` | 14000 | TTFT 406.77 ms for 5000 prompt tokens at concurrency 1, less the three chunked steps' other costs (3 x ~18 ms): 5000 / 0.353 s = 14.2k tokens/s |
//! | `max_batched_tokens` | 2048 | assumption: a common chunked-prefill token budget |
//! | `max_num_seqs` | 32 | lab scale (vLLM's default is larger; see below) |
//! | `kv_capacity_tokens` | 16384 | lab scale (see below) |
//!
//! With these values the model gives 412 ms TTFT for the 5000-token prompt (published 406.77),
//! 54 ms for a 500-token one (47.77), and inter-token latencies of 18.5, 38.7 and 59.9 ms at
//! concurrency 1, 25 and 50 (18.58, 38.75, 59.73): see the test
//! `reproduces_the_published_h100_figures`. The published ITL includes other requests'
//! prefill chunks; the KV term absorbs that interference as well.
//!
//! Lab scale: a real 2 x H100 node with a 70B fp8 model holds on the order of 500k KV tokens
//! (about 160 KiB per token for 80 layers x 8 KV heads x 128 x K and V in fp8, in roughly
//! 80 GB left after the weights), far more than a lab on a two-core machine can stream to. The
//! simulated accelerator keeps the real per-token pace (tens of milliseconds per token) and
//! shrinks the batch and the KV cache instead, so a few dozen concurrent streams per
//! accelerator load it fully: a one-minute benchmark sees queues, preemptions and slow
//! accelerators at realistic latencies.
//!
//! The engine never sleeps; [`Engine::step`] says how long a step takes and the caller waits.

mod prefix_cache;

use std::collections::{BTreeMap, HashMap, VecDeque};

use self::prefix_cache::{block_hashes, Cached};

/// A request's id, chosen by the caller.
pub type SeqId = u64;
/// A token id (the caller's tokenizer chooses them).
pub type TokenId = u64;
/// Tokens per KV block: vLLM's default `block_size` on CUDA.
pub const BLOCK_TOKENS: u32 = 16;

/// The capacity model's parameters (see the module documentation for their sources).
#[derive(Clone, Debug, PartialEq)]
pub struct Params {
    pub prefill_tokens_per_s: f64,
    pub step_base_ms: f64,
    pub step_per_seq_ms: f64,
    pub step_per_ktoken_ms: f64,
    pub kv_capacity_tokens: u64,
    pub max_num_seqs: usize,
    pub max_batched_tokens: u64,
}

impl Default for Params {
    fn default() -> Self {
        Params {
            prefill_tokens_per_s: 14_000.0,
            step_base_ms: 17.7,
            step_per_seq_ms: 0.1,
            step_per_ktoken_ms: 0.14,
            kv_capacity_tokens: 16_384,
            max_num_seqs: 32,
            max_batched_tokens: 2048,
        }
    }
}

impl Params {
    /// Checks that every parameter is usable; the error names each bad one.
    pub fn validate(&self) -> Result<(), String> {
        let mut bad = Vec::new();
        let positive = [
            ("prefill_tokens_per_s", self.prefill_tokens_per_s),
            ("step_base_ms", self.step_base_ms),
        ];
        for (name, v) in positive {
            if !(v.is_finite() && v > 0.0) {
                bad.push(format!("{name} = {v} must be a finite number > 0"));
            }
        }
        for (name, v) in [
            ("step_per_seq_ms", self.step_per_seq_ms),
            ("step_per_ktoken_ms", self.step_per_ktoken_ms),
        ] {
            if !(v.is_finite() && v >= 0.0) {
                bad.push(format!("{name} = {v} must be a finite number >= 0"));
            }
        }
        if self.kv_capacity_tokens < 2 {
            bad.push(format!(
                "kv_capacity_tokens = {} must be at least 2",
                self.kv_capacity_tokens
            ));
        }
        if self.max_num_seqs == 0 {
            bad.push("max_num_seqs must be at least 1".into());
        }
        if self.max_batched_tokens < self.max_num_seqs as u64 {
            bad.push(format!(
                "max_batched_tokens = {} must be at least max_num_seqs = {} (every decoding \
                 sequence takes one token of the budget)",
                self.max_batched_tokens, self.max_num_seqs
            ));
        }
        if bad.is_empty() {
            Ok(())
        } else {
            Err(bad.join("; "))
        }
    }
}

/// Why a request cannot be served at all.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Reject {
    /// prompt + max_tokens exceeds the KV cache: it could never run to the end.
    TooLong { tokens: u64, capacity: u64 },
    /// max_tokens of 0.
    NoOutput,
}

impl std::fmt::Display for Reject {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Reject::TooLong { tokens, capacity } => write!(
                f,
                "prompt plus max_tokens is {tokens} tokens; this accelerator's KV cache holds \
                 {capacity}: shorten the prompt or lower max_tokens"
            ),
            Reject::NoOutput => f.write_str("max_tokens must be at least 1"),
        }
    }
}

/// What a step produced, in the order it happened; effective at the end of the step.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Event {
    /// The `index`-th (1-based) output token of a request.
    Token { id: SeqId, index: u32 },
    /// The request emitted its last token and left the engine; `cached_tokens` of its prompt
    /// came from the prefix cache at its first admission.
    Finished { id: SeqId, cached_tokens: u32 },
}

/// One step: how long it takes and what it produces.
#[derive(Clone, Debug, PartialEq)]
pub struct Step {
    pub duration_s: f64,
    pub events: Vec<Event>,
    /// Sequences in the step.
    pub batch: usize,
    /// Tokens processed: one per decoding sequence plus the prefill chunks.
    pub tokens: u64,
    pub prefill_tokens: u64,
}

#[derive(Clone, Debug)]
struct Seq {
    id: SeqId,
    prompt: u32,
    max_tokens: u32,
    generated: u32,
    /// Context tokens whose KV is computed (held in the cache), the first `BLOCK_TOKENS *
    /// held` of them in cached blocks it shares.
    computed: u32,
    /// The hashes of the full blocks of prompt + answer, in order; empty when the tokens are
    /// unknown.
    hashes: Vec<u64>,
    /// Leading cached blocks it holds (`hashes[..held]`), taken at admission.
    held: usize,
    /// Prompt tokens the prefix cache gave it at its first admission (None before).
    cached: Option<u32>,
    arrived_s: f64,
    first_token_s: Option<f64>,
    /// When its latest token was emitted.
    last_token_s: Option<f64>,
}

impl Seq {
    fn context(&self) -> u32 {
        self.prompt + self.generated
    }

    /// Computed tokens not in shared cached blocks: its own KV.
    fn private(&self) -> u64 {
        (self.computed - BLOCK_TOKENS * self.held as u32) as u64
    }
}

/// Counters since start, as vLLM exports them.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct Totals {
    pub prompt_tokens: u64,
    pub generation_tokens: u64,
    pub finished: u64,
    pub cancelled: u64,
    pub preemptions: u64,
    /// Prefix cache lookups and hits, in tokens (vLLM's `vllm:prefix_cache_queries` and
    /// `vllm:prefix_cache_hits`).
    pub prefix_cache_queries: u64,
    pub prefix_cache_hits: u64,
    pub steps: u64,
    pub busy_s: f64,
    /// Time to first token of every request that got one: a histogram over [`TTFT_BUCKETS`]
    /// (cumulative counts are made when rendering), its sum and count.
    pub ttft_buckets: Vec<u64>,
    pub ttft_sum_s: f64,
    pub ttft_count: u64,
    /// The gap before every output token after a request's first (what vLLM's
    /// `vllm:inter_token_latency_seconds` observes): a histogram over [`ITL_BUCKETS`], its sum
    /// and count.
    pub itl_buckets: Vec<u64>,
    pub itl_sum_s: f64,
    pub itl_count: u64,
}

/// vLLM's `vllm:time_to_first_token_seconds` bucket bounds (seconds).
pub const TTFT_BUCKETS: [f64; 18] = [
    0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
    20.0, 40.0,
];

/// vLLM's `vllm:inter_token_latency_seconds` (and `vllm:time_per_output_token_seconds`) bucket
/// bounds (seconds).
pub const ITL_BUCKETS: [f64; 19] = [
    0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0,
    40.0, 80.0,
];

/// The engine of one accelerator.
#[derive(Debug)]
pub struct Engine {
    params: Params,
    /// Product of the fault factors: step durations are divided by it.
    speed: f64,
    waiting: VecDeque<Seq>,
    /// In admission order.
    running: Vec<Seq>,
    /// KV of the running sequences: their own computed tokens plus the cached blocks they
    /// hold, each once. Evictable cached blocks are not in it.
    kv_used: u64,
    /// Cached blocks by hash.
    cache: HashMap<u64, Cached>,
    /// Evictable blocks' hashes by stamp: the first is evicted first.
    lru: BTreeMap<u64, u64>,
    next_stamp: u64,
    totals: Totals,
    last_step_s: f64,
}

impl Engine {
    pub fn new(params: Params) -> Result<Engine, String> {
        params.validate()?;
        Ok(Engine {
            params,
            speed: 1.0,
            waiting: VecDeque::new(),
            running: Vec::new(),
            kv_used: 0,
            cache: HashMap::new(),
            lru: BTreeMap::new(),
            next_stamp: 0,
            totals: Totals {
                ttft_buckets: vec![0; TTFT_BUCKETS.len()],
                itl_buckets: vec![0; ITL_BUCKETS.len()],
                ..Totals::default()
            },
            last_step_s: 0.0,
        })
    }

    pub fn params(&self) -> &Params {
        &self.params
    }

    /// Sets the speed factor (> 0; 1.0 is healthy).
    pub fn set_speed(&mut self, speed: f64) {
        assert!(speed.is_finite() && speed > 0.0, "speed {speed}");
        self.speed = speed;
    }

    pub fn speed(&self) -> f64 {
        self.speed
    }

    /// Queues a request given as a token count: no content, so the prefix cache never hits
    /// it and keeps none of its blocks. It waits until the engine admits it.
    pub fn submit(
        &mut self,
        id: SeqId,
        prompt_tokens: u32,
        max_tokens: u32,
        now_s: f64,
    ) -> Result<(), Reject> {
        self.enqueue(id, prompt_tokens, max_tokens, Vec::new(), now_s)
    }

    /// Queues a request given as token ids: its prompt and the answer it will generate
    /// (`output.len()` is its `max_tokens`), whose blocks the prefix cache can hold and hit.
    pub fn submit_tokens(
        &mut self,
        id: SeqId,
        prompt: &[TokenId],
        output: &[TokenId],
        now_s: f64,
    ) -> Result<(), Reject> {
        let max_tokens = u32::try_from(output.len()).unwrap_or(u32::MAX);
        let prompt_tokens = u32::try_from(prompt.len()).unwrap_or(u32::MAX);
        // An empty prompt is a lone start-of-sequence token, which has no id here.
        let hashes = if prompt.is_empty() {
            Vec::new()
        } else {
            block_hashes(&[prompt, output].concat())
        };
        self.enqueue(id, prompt_tokens, max_tokens, hashes, now_s)
    }

    fn enqueue(
        &mut self,
        id: SeqId,
        prompt_tokens: u32,
        max_tokens: u32,
        hashes: Vec<u64>,
        now_s: f64,
    ) -> Result<(), Reject> {
        if max_tokens == 0 {
            return Err(Reject::NoOutput);
        }
        // A prompt of 0 tokens still has a start-of-sequence token.
        let prompt = prompt_tokens.max(1);
        let tokens = prompt as u64 + max_tokens as u64;
        if tokens > self.params.kv_capacity_tokens {
            return Err(Reject::TooLong {
                tokens,
                capacity: self.params.kv_capacity_tokens,
            });
        }
        self.totals.prompt_tokens += prompt as u64;
        self.waiting.push_back(Seq {
            id,
            prompt,
            max_tokens,
            generated: 0,
            computed: 0,
            hashes,
            held: 0,
            cached: None,
            arrived_s: now_s,
            first_token_s: None,
            last_token_s: None,
        });
        Ok(())
    }

    /// Drops a request (its client went away); true if it was there.
    pub fn cancel(&mut self, id: SeqId) -> bool {
        if let Some(i) = self.waiting.iter().position(|s| s.id == id) {
            self.waiting.remove(i);
        } else if let Some(i) = self.running.iter().position(|s| s.id == id) {
            let mut s = self.running.remove(i);
            self.release(&mut s);
        } else {
            return false;
        }
        self.totals.cancelled += 1;
        true
    }

    /// Runs one step starting at `now_s`; None when there is nothing to do. The state
    /// afterwards is the state at `now_s + duration_s`.
    pub fn step(&mut self, now_s: f64) -> Option<Step> {
        // A copy: releasing a sequence's blocks below needs the engine mutably.
        let p = self.params.clone();
        // 1. Every running sequence needs KV for what it has yet to process (one slot when
        // decoding, the rest of its context when prefilling); preempt the newest until that
        // fits, so a step never runs out of cache half-way.
        let need = |running: &[Seq]| -> u64 {
            running
                .iter()
                .map(|s| (s.context() - s.computed) as u64)
                .sum()
        };
        while self.kv_used + need(&self.running) > p.kv_capacity_tokens {
            let mut s = self.running.pop().expect("a lone request always fits");
            self.release(&mut s);
            self.waiting.push_front(s);
            self.totals.preemptions += 1;
        }
        // 2. FIFO admission: the head's whole context must fit next to what runs; its cached
        // blocks are there already, but taking evictable ones makes them count.
        let mut reserved = self.kv_used + need(&self.running);
        while self.running.len() < p.max_num_seqs {
            let Some(head) = self.waiting.front() else {
                break;
            };
            let (hit, revived) = self.cache_hit(head);
            let need = (head.context() - BLOCK_TOKENS * hit as u32) as u64
                + BLOCK_TOKENS as u64 * revived as u64;
            if reserved + need > p.kv_capacity_tokens {
                break;
            }
            reserved += need;
            let mut s = self.waiting.pop_front().expect("head exists");
            self.take_cached(&mut s, hit);
            self.running.push(s);
        }
        // Room for what the running sequences will process comes out of the cached blocks.
        self.evict_for(need(&self.running));
        if self.running.is_empty() {
            return None;
        }
        // 3. The token budget: decodes first, then prefill chunks in admission order.
        let mut budget = p.max_batched_tokens;
        let mut processed = vec![0u32; self.running.len()];
        for (i, s) in self.running.iter().enumerate() {
            if is_decoding(s) {
                processed[i] = 1;
                budget -= 1;
            }
        }
        let mut prefill_tokens = 0u64;
        for (i, s) in self.running.iter().enumerate() {
            if is_decoding(s) || budget == 0 {
                continue;
            }
            let chunk = ((s.context() - s.computed) as u64).min(budget);
            processed[i] = chunk as u32;
            budget -= chunk;
            prefill_tokens += chunk;
        }
        let batch = processed.iter().filter(|&&n| n > 0).count();
        if batch == 0 {
            return None;
        }
        for (s, n) in self.running.iter_mut().zip(&processed) {
            s.computed += n;
        }
        let tokens = processed.iter().map(|&n| n as u64).sum::<u64>();
        self.kv_used += tokens;
        let duration_s = (p.step_base_ms
            + p.step_per_seq_ms * batch as f64
            + p.step_per_ktoken_ms * self.kv_used as f64 / 1000.0)
            / 1000.0
            / self.speed
            + prefill_tokens as f64 / p.prefill_tokens_per_s / self.speed;
        let end_s = now_s + duration_s;
        // 4. Sequences with their whole context processed emit a token.
        let mut events = Vec::new();
        let mut i = 0;
        while i < self.running.len() {
            let s = &mut self.running[i];
            if processed[i] > 0 && s.computed == s.context() {
                s.generated += 1;
                self.totals.generation_tokens += 1;
                events.push(Event::Token {
                    id: s.id,
                    index: s.generated,
                });
                if s.first_token_s.is_none() {
                    s.first_token_s = Some(end_s);
                    let ttft = end_s - s.arrived_s;
                    self.totals.ttft_sum_s += ttft;
                    self.totals.ttft_count += 1;
                    if let Some(b) = TTFT_BUCKETS.iter().position(|&le| ttft <= le) {
                        self.totals.ttft_buckets[b] += 1;
                    }
                }
                if let Some(last) = s.last_token_s {
                    let gap = end_s - last;
                    self.totals.itl_sum_s += gap;
                    self.totals.itl_count += 1;
                    if let Some(b) = ITL_BUCKETS.iter().position(|&le| gap <= le) {
                        self.totals.itl_buckets[b] += 1;
                    }
                }
                s.last_token_s = Some(end_s);
                if s.generated >= s.max_tokens {
                    events.push(Event::Finished {
                        id: s.id,
                        cached_tokens: s.cached.unwrap_or(0),
                    });
                    self.totals.finished += 1;
                    let mut s = self.running.remove(i);
                    self.release(&mut s);
                    processed.remove(i);
                    continue;
                }
            }
            i += 1;
        }
        self.totals.steps += 1;
        self.totals.busy_s += duration_s;
        self.last_step_s = duration_s;
        Some(Step {
            duration_s,
            events,
            batch,
            tokens,
            prefill_tokens,
        })
    }

    pub fn running(&self) -> usize {
        self.running.len()
    }

    pub fn waiting(&self) -> usize {
        self.waiting.len()
    }

    pub fn kv_used_tokens(&self) -> u64 {
        self.kv_used
    }

    /// Tokens in cached blocks that no running sequence holds: free KV that still hits.
    pub fn evictable_tokens(&self) -> u64 {
        self.lru.len() as u64 * BLOCK_TOKENS as u64
    }

    /// 0..=1.
    pub fn kv_used_fraction(&self) -> f64 {
        self.kv_used as f64 / self.params.kv_capacity_tokens as f64
    }

    pub fn totals(&self) -> &Totals {
        &self.totals
    }

    /// Duration of the latest step, seconds (0 before the first).
    pub fn last_step_s(&self) -> f64 {
        self.last_step_s
    }
}

/// A running sequence that has processed all but its newest token.
fn is_decoding(s: &Seq) -> bool {
    s.generated > 0 && s.computed + 1 == s.context()
}

#[cfg(test)]
mod tests;
