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

use std::{
    collections::{hash_map::Entry, BTreeMap, HashMap, VecDeque},
    hash::{DefaultHasher, Hash, Hasher},
};

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

/// The hashes of a token sequence's full blocks, each chained over the one before, as vLLM's
/// `hash_block_tokens(parent_block_hash, curr_block_token_ids)`; the first block's parent is
/// a fixed root (vLLM's `NONE_HASH`).
fn block_hashes(tokens: &[TokenId]) -> Vec<u64> {
    let mut parent = 0u64;
    tokens
        .chunks_exact(BLOCK_TOKENS as usize)
        .map(|block| {
            let mut h = DefaultHasher::new();
            (parent, block).hash(&mut h);
            parent = h.finish();
            parent
        })
        .collect()
}

/// A cached block.
#[derive(Debug)]
struct Cached {
    /// Running sequences holding it; 0: evictable, with its place in the LRU order.
    refs: u32,
    stamp: u64,
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

    /// The leading blocks of `s`'s context that are cached, short of its last token; and how
    /// many of them are evictable (taking those adds to the KV in use).
    fn cache_hit(&self, s: &Seq) -> (usize, usize) {
        let most = ((s.context() - 1) / BLOCK_TOKENS) as usize;
        let mut revived = 0;
        let hit = s
            .hashes
            .iter()
            .take(most)
            .map_while(|h| self.cache.get(h))
            .inspect(|c| revived += usize::from(c.refs == 0))
            .count();
        (hit, revived)
    }

    /// Takes `s`'s first `hit` blocks from the cache: they count as computed.
    fn take_cached(&mut self, s: &mut Seq, hit: usize) {
        for h in &s.hashes[..hit] {
            let c = self.cache.get_mut(h).expect("a hit is cached");
            if c.refs == 0 {
                self.lru.remove(&c.stamp);
                self.kv_used += BLOCK_TOKENS as u64;
            }
            c.refs += 1;
        }
        s.held = hit;
        s.computed = BLOCK_TOKENS * hit as u32;
        if s.cached.is_none() {
            s.cached = Some(s.computed);
            self.totals.prefix_cache_queries += s.context() as u64;
            self.totals.prefix_cache_hits += s.computed as u64;
        }
    }

    /// `s` leaves the running set: its KV is freed, its full computed blocks stay cached
    /// and evictable, the last first in the LRU order.
    fn release(&mut self, s: &mut Seq) {
        self.kv_used -= s.private();
        let full = ((s.computed / BLOCK_TOKENS) as usize).min(s.hashes.len());
        for (i, &h) in s.hashes[..full].iter().enumerate().rev() {
            let stamp = self.next_stamp;
            if i < s.held {
                let c = self.cache.get_mut(&h).expect("a held block is cached");
                c.refs -= 1;
                if c.refs > 0 {
                    continue;
                }
                c.stamp = stamp;
                self.kv_used -= BLOCK_TOKENS as u64;
            } else if let Entry::Vacant(e) = self.cache.entry(h) {
                e.insert(Cached { refs: 0, stamp });
            } else {
                // Another sequence cached the same block meanwhile: this copy is freed.
                continue;
            }
            self.lru.insert(stamp, h);
            self.next_stamp += 1;
        }
        s.computed = 0;
        s.held = 0;
    }

    /// Evicts cached blocks, least recently freed first, until `needed` more tokens fit.
    fn evict_for(&mut self, needed: u64) {
        let cap = self.params.kv_capacity_tokens;
        while self.kv_used + needed + self.evictable_tokens() > cap {
            let Some((_, h)) = self.lru.pop_first() else {
                break;
            };
            self.cache.remove(&h);
        }
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
mod tests {
    use super::*;

    /// Runs the engine on a simulated clock until `until_s` or idle; returns (time, event).
    fn run(e: &mut Engine, now: &mut f64, until_s: f64) -> Vec<(f64, Event)> {
        let mut out = Vec::new();
        while *now < until_s {
            let Some(step) = e.step(*now) else { break };
            *now += step.duration_s;
            out.extend(step.events.into_iter().map(|ev| (*now, ev)));
        }
        out
    }

    fn first_token_time(events: &[(f64, Event)], id: SeqId) -> f64 {
        events
            .iter()
            .find(|(_, e)| *e == Event::Token { id, index: 1 })
            .map(|(t, _)| *t)
            .unwrap_or_else(|| panic!("request {id} got no first token"))
    }

    fn small() -> Params {
        Params {
            kv_capacity_tokens: 4096,
            max_num_seqs: 8,
            ..Params::default()
        }
    }

    #[test]
    fn one_request_prefills_then_decodes_at_the_base_step() {
        let mut e = Engine::new(Params::default()).unwrap();
        e.submit(1, 1400, 3, 0.0).unwrap();
        let mut now = 0.0;
        let ev = run(&mut e, &mut now, 100.0);
        let tokens: Vec<_> = ev.iter().map(|(_, e)| *e).collect();
        assert_eq!(
            tokens,
            vec![
                Event::Token { id: 1, index: 1 },
                Event::Token { id: 1, index: 2 },
                Event::Token { id: 1, index: 3 },
                Event::Finished {
                    id: 1,
                    cached_tokens: 0
                },
            ]
        );
        // Prefill: 1400 tokens at 14000/s = 100 ms, plus one step's base, sequence and KV terms.
        let ttft = first_token_time(&ev, 1);
        let want = 0.1 + (17.7 + 0.1 + 0.14 * 1.4) / 1000.0;
        assert!((ttft - want).abs() < 1e-9, "ttft {ttft} want {want}");
        // Decode steps read 1401 and 1402 KV tokens.
        let gap = ev[1].0 - ev[0].0;
        assert!(
            (gap - (17.7 + 0.1 + 0.14 * 1.401) / 1000.0).abs() < 1e-9,
            "{gap}"
        );
        assert_eq!((e.running(), e.waiting(), e.kv_used_tokens()), (0, 0, 0));
        assert_eq!(e.totals().finished, 1);
        assert_eq!(e.totals().generation_tokens, 3);
        assert_eq!(e.totals().ttft_count, 1);
        // The inter-token histogram holds the two gaps after the first token, each a step.
        let t = e.totals();
        assert_eq!(t.itl_count, 2);
        assert!((t.itl_sum_s - (ev[2].0 - ev[0].0)).abs() < 1e-12);
        assert_eq!(t.itl_buckets[1], 2, "18 ms gaps are in the 25 ms bucket");
        assert!(e.step(now).is_none(), "idle engine takes no step");
    }

    /// The defaults against NVIDIA's NIM table for Llama-3.3-70B fp8 on 2 x H100 (see the
    /// module documentation): TTFT at concurrency 1 and inter-token latency at 1, 25 and 50
    /// concurrent 5000-in / 500-out requests, within 5 %. The cache and batch are lifted to
    /// the real node's scale for this.
    #[test]
    fn reproduces_the_published_h100_figures() {
        let real = Params {
            kv_capacity_tokens: 500_000,
            max_num_seqs: 256,
            ..Params::default()
        };
        let within = |got: f64, want: f64| {
            assert!(
                (got / want - 1.0).abs() <= 0.05,
                "model {got:.2} ms vs published {want} ms"
            )
        };
        // TTFT, one request alone.
        let mut e = Engine::new(real.clone()).unwrap();
        e.submit(0, 5000, 500, 0.0).unwrap();
        let mut now = 0.0;
        let ev = run(&mut e, &mut now, 1000.0);
        within(first_token_time(&ev, 0) * 1000.0, 406.77);
        // ITL: the median gap of request 0 among n concurrent ones.
        for (n, want) in [(1u64, 18.58), (25, 38.75), (50, 59.73)] {
            let mut e = Engine::new(real.clone()).unwrap();
            for id in 0..n {
                e.submit(id, 5000, 500, 0.0).unwrap();
            }
            let mut now = 0.0;
            let ev = run(&mut e, &mut now, 10_000.0);
            let t: Vec<f64> = ev
                .iter()
                .filter(|(_, e)| matches!(e, Event::Token { id: 0, .. }))
                .map(|(t, _)| *t)
                .collect();
            let mut gaps: Vec<f64> = t.windows(2).map(|w| (w[1] - w[0]) * 1000.0).collect();
            gaps.sort_by(f64::total_cmp);
            within(gaps[gaps.len() / 2], want);
        }
    }

    #[test]
    fn long_prompts_are_prefilled_in_chunks_of_the_budget() {
        let mut e = Engine::new(Params::default()).unwrap();
        e.submit(1, 5000, 1, 0.0).unwrap();
        let steps: Vec<Step> = std::iter::from_fn(|| e.step(0.0)).collect();
        let chunks: Vec<u64> = steps.iter().map(|s| s.prefill_tokens).collect();
        assert_eq!(chunks, vec![2048, 2048, 904]);
        assert_eq!(
            steps[2].events,
            vec![
                Event::Token { id: 1, index: 1 },
                Event::Finished {
                    id: 1,
                    cached_tokens: 0
                }
            ]
        );
    }

    #[test]
    fn step_time_grows_with_the_batch() {
        // Same prompts and outputs; n concurrent requests; the mean decode gap grows with n.
        let gap_with = |n: u64| {
            let mut e = Engine::new(Params::default()).unwrap();
            for id in 0..n {
                e.submit(id, 200, 50, 0.0).unwrap();
            }
            let mut now = 0.0;
            let ev = run(&mut e, &mut now, 1000.0);
            let times: Vec<f64> = ev
                .iter()
                .filter(|(_, e)| matches!(e, Event::Token { id: 0, .. }))
                .map(|(t, _)| *t)
                .collect();
            assert_eq!(times.len(), 50);
            // From the 10th token on, the other requests' prefills (chunks of the budget,
            // 6400 tokens for 32 requests) are over: pure decode steps.
            (times[49] - times[9]) / 40.0
        };
        let (g1, g8, g32) = (gap_with(1), gap_with(8), gap_with(32));
        assert!(g1 < g8 && g8 < g32, "gaps {g1} {g8} {g32}");
        // 32 sequences of ~225 tokens: 17.7 + 3.2 + 0.14 * 7.2 = 21.9 ms.
        assert!((g32 * 1000.0 - 21.9).abs() < 0.3, "{g32}");
        assert!((g1 * 1000.0 - 17.83).abs() < 0.05, "{g1}");
    }

    #[test]
    fn ttft_grows_with_the_queue() {
        // max_num_seqs 8: the 9th request onwards waits for a slot; each later batch of 8
        // waits for a whole earlier one to finish.
        let mut e = Engine::new(small()).unwrap();
        for id in 0..24 {
            e.submit(id, 100, 20, 0.0).unwrap();
        }
        let mut now = 0.0;
        let ev = run(&mut e, &mut now, 1000.0);
        let ttft: Vec<f64> = (0..24).map(|id| first_token_time(&ev, id)).collect();
        let batch_max =
            |r: std::ops::Range<usize>| ttft[r].iter().copied().fold(f64::NEG_INFINITY, f64::max);
        let batch_min =
            |r: std::ops::Range<usize>| ttft[r].iter().copied().fold(f64::INFINITY, f64::min);
        assert!(batch_max(0..8) < 0.1, "{ttft:?}");
        // 20 tokens at ~18 ms before a slot frees: at least 0.35 s of waiting.
        assert!(batch_min(8..16) > batch_max(0..8) + 0.35, "{ttft:?}");
        assert!(batch_min(16..24) > batch_max(8..16) + 0.35, "{ttft:?}");
        // FIFO: first tokens come in submission order.
        assert!(ttft.windows(2).all(|w| w[0] <= w[1]), "{ttft:?}");
        assert_eq!(e.totals().finished, 24);
    }

    #[test]
    fn kv_admission_is_fifo_and_the_head_blocks() {
        // 4096 KV tokens: request 0 holds ~3000; request 1 (2000 prompt) cannot fit and
        // blocks request 2 (10 tokens) behind it, which would fit.
        let mut e = Engine::new(small()).unwrap();
        e.submit(0, 3000, 40, 0.0).unwrap();
        e.submit(1, 2000, 5, 0.0).unwrap();
        e.submit(2, 10, 5, 0.0).unwrap();
        let mut now = 0.0;
        let step = e.step(now).unwrap();
        now += step.duration_s;
        assert_eq!((e.running(), e.waiting()), (1, 2));
        let ev = run(&mut e, &mut now, 1000.0);
        let done0 = ev
            .iter()
            .find(|(_, e)| matches!(e, Event::Finished { id: 0, .. }))
            .unwrap()
            .0;
        let (t1, t2) = (first_token_time(&ev, 1), first_token_time(&ev, 2));
        assert!(t1 > done0 && t2 > done0, "{done0} {t1} {t2}");
        assert!(t1 <= t2);
        assert!(e.totals().preemptions == 0);
    }

    #[test]
    fn a_full_cache_preempts_the_newest_and_it_recomputes() {
        // Two requests that fit at admission but not to the end: the newer one is preempted,
        // returns to the head of the queue and finishes after the older one, with all tokens.
        let p = Params {
            kv_capacity_tokens: 1000,
            ..small()
        };
        let mut e = Engine::new(p).unwrap();
        e.submit(0, 400, 300, 0.0).unwrap();
        e.submit(1, 400, 300, 0.0).unwrap();
        let mut now = 0.0;
        let ev = run(&mut e, &mut now, 1000.0);
        assert!(e.totals().preemptions >= 1);
        let count = |id| {
            ev.iter()
                .filter(|(_, e)| matches!(e, Event::Token { id: i, .. } if *i == id))
                .count()
        };
        assert_eq!((count(0), count(1)), (300, 300));
        let idx: Vec<u32> = ev
            .iter()
            .filter_map(|(_, e)| match e {
                Event::Token { id: 1, index } => Some(*index),
                _ => None,
            })
            .collect();
        assert_eq!(
            idx,
            (1..=300).collect::<Vec<_>>(),
            "no token repeated or lost"
        );
        assert_eq!(e.kv_used_tokens(), 0);
    }

    #[test]
    fn max_num_seqs_caps_the_batch() {
        let mut e = Engine::new(small()).unwrap();
        for id in 0..20 {
            e.submit(id, 10, 100, 0.0).unwrap();
        }
        let mut now = 0.0;
        for _ in 0..50 {
            let s = e.step(now).unwrap();
            now += s.duration_s;
            assert!(s.batch <= 8 && e.running() <= 8);
        }
        assert_eq!(e.waiting(), 12);
    }

    #[test]
    fn speed_divides_every_step() {
        let time_to_finish = |speed: f64| {
            let mut e = Engine::new(Params::default()).unwrap();
            e.set_speed(speed);
            e.submit(1, 500, 100, 0.0).unwrap();
            let mut now = 0.0;
            run(&mut e, &mut now, 1000.0);
            now
        };
        let (full, throttled) = (time_to_finish(1.0), time_to_finish(0.4));
        assert!((throttled / full - 2.5).abs() < 1e-9, "{full} {throttled}");
    }

    #[test]
    fn cancel_frees_the_cache_and_unknown_requests_are_refused() {
        let mut e = Engine::new(small()).unwrap();
        e.submit(1, 100, 50, 0.0).unwrap();
        e.submit(2, 100, 50, 0.0).unwrap();
        e.step(0.0).unwrap();
        assert!(e.kv_used_tokens() > 0);
        assert!(e.cancel(1) && e.cancel(2) && !e.cancel(3));
        assert_eq!((e.kv_used_tokens(), e.running(), e.waiting()), (0, 0, 0));
        assert_eq!(e.totals().cancelled, 2);
        assert_eq!(
            e.submit(4, 4000, 200, 0.0),
            Err(Reject::TooLong {
                tokens: 4200,
                capacity: 4096
            })
        );
        assert_eq!(e.submit(5, 10, 0, 0.0), Err(Reject::NoOutput));
    }

    /// Token ids `from..from + n`: distinct runs for distinct `from`s.
    fn ids(from: u64, n: u64) -> Vec<TokenId> {
        (from..from + n).collect()
    }

    /// Submits `prompt` with `out` tokens of answer and runs the engine until idle; returns
    /// its TTFT (from submission) and the cached tokens its `Finished` event reports.
    fn serve(e: &mut Engine, now: &mut f64, id: SeqId, prompt: &[TokenId], out: u64) -> (f64, u32) {
        let start = *now;
        e.submit_tokens(id, prompt, &ids(1 << 40, out), start)
            .unwrap();
        let ev = run(e, now, start + 1000.0);
        let cached = ev
            .iter()
            .find_map(|(_, ev)| match ev {
                Event::Finished {
                    id: i,
                    cached_tokens,
                } if *i == id => Some(*cached_tokens),
                _ => None,
            })
            .unwrap_or_else(|| panic!("request {id} did not finish"));
        (first_token_time(&ev, id) - start, cached)
    }

    #[test]
    fn a_shared_prefix_skips_the_prefill_of_its_full_blocks() {
        // A conversation's first turn: 1000 prompt tokens, a 40-token answer.
        let first = ids(0, 1000);
        let answer = ids(1 << 40, 40);
        let mut e = Engine::new(Params::default()).unwrap();
        let mut now = 0.0;
        let (_, cached) = serve(&mut e, &mut now, 1, &first, 40);
        assert_eq!(cached, 0, "an empty cache hits nothing");
        // Its next turn: the same prompt, the answer, 30 new tokens (1070). The first turn
        // computed 1039 tokens (the last answer token is never processed): 64 full blocks.
        let next = [first.clone(), answer, ids(5000, 30)].concat();
        let (ttft_hit, cached) = serve(&mut e, &mut now, 2, &next, 5);
        assert_eq!(cached, 64 * 16);
        // The same shape with another first token: every chained block hash differs.
        let mut other = next.clone();
        other[0] = 99_999;
        let (ttft_miss, cached) = serve(&mut e, &mut now, 3, &other, 5);
        assert_eq!(cached, 0);
        // Both are one step reading the same KV: the hit saves exactly the prefill of the
        // 1024 shared tokens.
        let saved = ttft_miss - ttft_hit;
        assert!((saved - 1024.0 / 14_000.0).abs() < 1e-9, "saved {saved}");
        let t = e.totals();
        assert_eq!(
            (t.prefix_cache_queries, t.prefix_cache_hits),
            (1000 + 1070 + 1070, 1024)
        );
        // Cached blocks are free KV: the idle engine holds none, yet remembers them.
        assert_eq!(e.kv_used_tokens(), 0);
        assert!(e.evictable_tokens() >= 1024);
    }

    #[test]
    fn a_prompt_fully_cached_still_computes_its_last_token() {
        let mut e = Engine::new(Params::default()).unwrap();
        let mut now = 0.0;
        let prompt = ids(0, 1024);
        serve(&mut e, &mut now, 1, &prompt, 1);
        // 64 blocks cached, but the last one holds the last prompt token: 63 are reused.
        let (ttft, cached) = serve(&mut e, &mut now, 2, &prompt, 1);
        assert_eq!(cached, 63 * 16);
        let want = 16.0 / 14_000.0 + (17.7 + 0.1 + 0.14 * 1.024) / 1000.0;
        assert!((ttft - want).abs() < 1e-9, "{ttft} {want}");
        // A request given as a count has no content: no hit, nothing cached.
        let before = e.evictable_tokens();
        e.submit(3, 1024, 1, now).unwrap();
        let until = now + 100.0;
        let ev = run(&mut e, &mut now, until);
        assert!(ev.contains(&(
            ev.last().unwrap().0,
            Event::Finished {
                id: 3,
                cached_tokens: 0
            }
        )));
        assert_eq!(e.evictable_tokens(), before);
        assert_eq!(e.totals().prefix_cache_hits, 63 * 16);
        assert_eq!(e.totals().prefix_cache_queries, 3 * 1024);
    }

    #[test]
    fn cached_blocks_are_evicted_lru_and_never_block_admission() {
        // 4096 KV tokens. A (2000) then B (1000) finish: 125 + 62 blocks stay cached.
        let mut e = Engine::new(small()).unwrap();
        let mut now = 0.0;
        let (a, b, c) = (ids(0, 2000), ids(10_000, 1000), ids(20_000, 3000));
        serve(&mut e, &mut now, 1, &a, 1);
        serve(&mut e, &mut now, 2, &b, 1);
        assert_eq!((e.kv_used_tokens(), e.evictable_tokens()), (0, 2992));
        // C needs 3009 tokens: admitted at once, and the room comes out of the cache, least
        // recently freed first (A's), the last block of a sequence first.
        e.submit_tokens(3, &c, &ids(1 << 40, 10), now).unwrap();
        now += e.step(now).unwrap().duration_s;
        assert_eq!((e.running(), e.waiting()), (1, 0));
        assert_eq!(e.evictable_tokens(), 68 * 16, "1096 tokens left free");
        let until = now + 100.0;
        run(&mut e, &mut now, until);
        // B's blocks all stayed; of A's only the first 6 did.
        assert_eq!(serve(&mut e, &mut now, 4, &b, 1).1, 62 * 16);
        let (_, a_hit) = serve(&mut e, &mut now, 5, &a, 1);
        assert!(a_hit > 0 && a_hit <= 6 * 16, "{a_hit}");
        assert_eq!(e.totals().preemptions, 0);
        assert!(e.kv_used_tokens() + e.evictable_tokens() <= 4096);
    }

    #[test]
    fn a_preempted_sequence_recomputes_from_its_cached_blocks() {
        // As a_full_cache_preempts_the_newest_and_it_recomputes, with token ids: the
        // preempted sequence's blocks stay cached and its recompute hits them.
        let p = Params {
            kv_capacity_tokens: 1000,
            ..small()
        };
        let mut e = Engine::new(p).unwrap();
        e.submit_tokens(0, &ids(0, 400), &ids(1 << 40, 300), 0.0)
            .unwrap();
        e.submit_tokens(1, &ids(5000, 400), &ids(1 << 41, 300), 0.0)
            .unwrap();
        let mut now = 0.0;
        let ev = run(&mut e, &mut now, 1000.0);
        assert!(e.totals().preemptions >= 1);
        let tokens = |id| {
            ev.iter()
                .filter(|(_, e)| matches!(e, Event::Token { id: i, .. } if *i == id))
                .count()
        };
        assert_eq!((tokens(0), tokens(1)), (300, 300));
        // Only first admissions count: both prompts queried once, neither hit then.
        assert_eq!(
            (
                e.totals().prefix_cache_queries,
                e.totals().prefix_cache_hits
            ),
            (800, 0)
        );
        assert_eq!(e.kv_used_tokens(), 0);
    }

    #[test]
    fn bad_parameters_are_named() {
        let p = Params {
            prefill_tokens_per_s: 0.0,
            max_num_seqs: 64,
            max_batched_tokens: 16,
            ..Params::default()
        };
        let e = Engine::new(p).unwrap_err();
        assert!(e.contains("prefill_tokens_per_s = 0"), "{e}");
        assert!(e.contains("max_batched_tokens = 16"), "{e}");
    }
}
