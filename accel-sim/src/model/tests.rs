//! The capacity model on a simulated clock: its steps, admission, preemption, prefix cache
//! and the published figures it reproduces.

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
