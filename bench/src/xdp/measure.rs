//! Measurement: the batches of every (variant, case) pair, warm-up and the shuffled rounds.

use std::{
    collections::BTreeMap,
    sync::Barrier,
    time::{Duration, Instant},
};

use anyhow::{bail, Context, Result};
use aya::{
    maps::{HashMap as BpfHashMap, MapData},
    programs::{TestRun, TestRunOptions, Xdp},
};
use lb_common::{ConnEntry, FlowKey};

use super::{
    cases::{case, expected_action, fib_only, CaseId, Dp, Variant},
    lab::{counters, stats_delta, BackendFrames, Lab},
    traffic::{gen_key, Frames, TestFrames},
    Opts, BLOCK_MANY, BLOCK_SYN, BLOCK_SYN_FULL,
};
use crate::sys;

/// Each case's frames, one source per CPU that runs its batches.
pub(super) type Sources = Vec<(CaseId, Vec<Frames>)>;

/// How a batch runs: on these CPUs at once, up to `calls` calls on each, for at most `limit`.
#[derive(Clone, Copy)]
pub(super) struct Run<'a> {
    pub(super) cpus: &'a [usize],
    pub(super) calls: usize,
    pub(super) limit: Duration,
}

#[derive(Clone, Debug)]
pub struct Batch {
    pub calls: usize,
    /// Wall-clock ns per call over the batch (syscall-inclusive).
    pub syscall_ns: f64,
    /// Mean of the kernel-reported per-call durations.
    pub kernel_ns: f64,
    /// Median of the kernel-reported per-call durations.
    pub kernel_call_median_ns: f64,
    /// Calls whose action was not the expected one, by action.
    pub wrong_actions: BTreeMap<u32, usize>,
}

fn measure_on(
    prog: &Xdp,
    frames: &mut Frames,
    calls: usize,
    limit: Duration,
    expect: u32,
    out: &mut [u8],
    kern: &mut Vec<u32>,
) -> Result<Batch> {
    kern.clear();
    let mut wrong: BTreeMap<u32, usize> = BTreeMap::new();
    let mut done = 0usize;
    let t0 = Instant::now();
    while done < calls {
        let chunk = (calls - done).min(1024);
        for _ in 0..chunk {
            let r = prog.test_run(TestRunOptions {
                data_in: Some(frames.next()),
                data_out: Some(&mut *out),
                ..Default::default()
            })?;
            if r.return_value != expect {
                *wrong.entry(r.return_value).or_default() += 1;
            }
            kern.push(r.duration.as_nanos() as u32);
        }
        done += chunk;
        if t0.elapsed() >= limit {
            break;
        }
    }
    let wall = t0.elapsed();
    let mean = kern.iter().map(|&d| d as f64).sum::<f64>() / done as f64;
    let mid = done / 2;
    let (_, med, _) = kern.select_nth_unstable(mid);
    Ok(Batch {
        calls: done,
        syscall_ns: wall.as_nanos() as f64 / done as f64,
        kernel_ns: mean,
        kernel_call_median_ns: *med as f64,
        wrong_actions: wrong,
    })
}

/// One batch on every CPU of `cpus` at once, each sending its own `frames` (the thread
/// itself is pinned to the first): the calls of all of them make the batch.
pub(super) fn measure(
    prog: &Xdp,
    frames: &mut [Frames],
    run: Run,
    expect: u32,
    out: &mut [u8],
    kern: &mut Vec<u32>,
) -> Result<Batch> {
    let Run { cpus, calls, limit } = run;
    let [first, others @ ..] = frames else {
        bail!("a case without frames");
    };
    if others.is_empty() {
        return measure_on(prog, first, calls, limit, expect, out, kern);
    }
    let start = Barrier::new(1 + others.len());
    let (own, theirs) = std::thread::scope(|s| {
        let threads: Vec<_> = others
            .iter_mut()
            .zip(&cpus[1..])
            .map(|(f, &cpu)| {
                let start = &start;
                let out_len = out.len();
                // The thread starts in this thread's network namespace (the variant's).
                s.spawn(move || -> Result<(Batch, Vec<u32>)> {
                    let pinned = sys::pin_cpu(cpu);
                    start.wait();
                    pinned?;
                    let (mut out, mut kern) = (vec![0u8; out_len], Vec::with_capacity(calls));
                    let b = measure_on(prog, f, calls, limit, expect, &mut out, &mut kern)?;
                    Ok((b, kern))
                })
            })
            .collect();
        start.wait();
        let own = measure_on(prog, first, calls, limit, expect, out, kern);
        let theirs: Vec<_> = threads
            .into_iter()
            .map(|t| t.join().expect("a measuring thread panicked"))
            .collect();
        (own, theirs)
    });
    let mut batches = vec![own?];
    for t in theirs {
        let (b, k) = t?;
        kern.extend(k);
        batches.push(b);
    }
    Ok(merged(&batches, kern))
}

/// The batches of CPUs that ran at once as one: calls added, per-call figures over every
/// call (`kern` holds all their kernel durations), wall clock per call averaged over CPUs.
fn merged(batches: &[Batch], kern: &mut [u32]) -> Batch {
    let calls: usize = batches.iter().map(|b| b.calls).sum();
    let mut wrong: BTreeMap<u32, usize> = BTreeMap::new();
    for b in batches {
        for (a, n) in &b.wrong_actions {
            *wrong.entry(*a).or_default() += n;
        }
    }
    let mean = kern.iter().map(|&d| d as f64).sum::<f64>() / kern.len() as f64;
    let mid = kern.len() / 2;
    let (_, med, _) = kern.select_nth_unstable(mid);
    Batch {
        calls,
        syscall_ns: batches.iter().map(|b| b.syscall_ns).sum::<f64>() / batches.len() as f64,
        kernel_ns: mean,
        kernel_call_median_ns: *med as f64,
        wrong_actions: wrong,
    }
}

pub struct CaseResult {
    pub variant: Variant,
    pub id: CaseId,
    pub frame_bytes: usize,
    pub batches: Vec<Batch>,
    /// Data-plane counter deltas over every batch of this case (name -> count).
    pub counters: BTreeMap<&'static str, u64>,
}

/// Deterministic shuffle (xorshift64*), so runs are reproducible.
pub(super) fn shuffle<T>(v: &mut [T], seed: u64) {
    let mut s = seed.wrapping_mul(0x9e37_79b9_7f4a_7c15) | 1;
    for i in (1..v.len()).rev() {
        s ^= s >> 12;
        s ^= s << 25;
        s ^= s >> 27;
        let r = s.wrapping_mul(0x2545_f491_4f6c_dd1d);
        v.swap(i, (r % (i as u64 + 1)) as usize);
    }
}

/// The frames of every measured case.
pub(super) fn case_sources(
    fr: &TestFrames,
    full_next: u64,
    flows: usize,
    backend: Option<&BackendFrames>,
    cpus: usize,
) -> Sources {
    let fresh = |block, next| Frames::Fresh {
        frame: fr.syn_tpl.clone(),
        block,
        next,
    };
    let many = || Frames::Cycle {
        frame: fr.many_tpl.clone(),
        block: BLOCK_MANY,
        next: 0,
        count: flows as u64,
    };
    let mut sources: Vec<(CaseId, Frames)> = vec![
        (CaseId::Pass, Frames::Fixed(fr.ack4.clone())),
        (CaseId::Pass1500, Frames::Fixed(fr.data1500.clone())),
        (CaseId::SynNew, fresh(BLOCK_SYN, 0)),
        (
            CaseId::SynNewTenants,
            Frames::Fresh {
                frame: fr.syn_tenant_tpl.clone(),
                block: BLOCK_SYN,
                next: 0,
            },
        ),
        (CaseId::SynFull, fresh(BLOCK_SYN_FULL, full_next)),
        (CaseId::Established, Frames::Fixed(fr.ack4.clone())),
        (
            CaseId::EstablishedTenants,
            Frames::Fixed(fr.ack_tenant.clone()),
        ),
        (CaseId::Established200k, many()),
        (CaseId::NonVip, Frames::Fixed(fr.non_vip.clone())),
        (CaseId::Established1500, Frames::Fixed(fr.data1500.clone())),
        (CaseId::EstablishedV6, Frames::Fixed(fr.ack6.clone())),
        (CaseId::ScSynNew, fresh(BLOCK_SYN, 0)),
        (CaseId::ScEstablished, Frames::Fixed(fr.ack4.clone())),
        (CaseId::ScEstablished200k, many()),
        (CaseId::ScEstablishedV6, Frames::Fixed(fr.ack6.clone())),
        (CaseId::EstablishedUdp, Frames::Fixed(fr.udp4.clone())),
        (CaseId::QuicCid, Frames::Fixed(fr.quic4.clone())),
        (
            CaseId::EstablishedInband,
            Frames::Acking {
                frame: fr.ack_ib.clone(),
                ack: 1,
            },
        ),
    ];
    if let Some(b) = backend {
        sources.push((CaseId::PassGue, Frames::Fixed(b.elsewhere.clone())));
        sources.push((CaseId::BackendSocket, Frames::Fixed(b.here.clone())));
        sources.push((CaseId::BackendForward, Frames::Fixed(b.elsewhere.clone())));
    }
    if cpus > 1 {
        // Its acknowledgement numbers must advance one call after another: one CPU's case.
        sources.retain(|(id, _)| *id != CaseId::EstablishedInband);
    }
    let n = cpus as u64;
    sources
        .into_iter()
        .map(|(id, f)| (id, (0..n).map(|k| f.for_cpu(k, n)).collect()))
        .collect()
}

/// An empty result for every (variant, case) pair that is measured.
pub(super) fn case_results(variants: &[Variant], sources: &Sources) -> Vec<CaseResult> {
    let mut results: Vec<CaseResult> = Vec::new();
    for &v in variants {
        for (id, f) in sources {
            if v == Variant::Fallback && fib_only(*id) {
                continue;
            }
            // The in-band case is a paired difference from `established`, taken in the
            // fallback netns only: the fib netns has no route to the in-band VIP's backends.
            if v == Variant::Fib && *id == CaseId::EstablishedInband {
                continue;
            }
            results.push(CaseResult {
                variant: v,
                id: *id,
                frame_bytes: f[0].len(),
                batches: Vec::new(),
                counters: BTreeMap::new(),
            });
        }
    }
    results
}

/// One short batch of every case, not recorded.
pub(super) fn warm_up(
    lab: &mut Lab,
    results: &[CaseResult],
    sources: &mut Sources,
    opts: &Opts,
    out: &mut [u8],
    kern: &mut Vec<u32>,
) -> Result<()> {
    let limit = Duration::from_secs_f64(opts.batch_secs);
    let warm = (opts.calls / 10).clamp(1, 10_000);
    for r in results {
        let (_, frames) = sources.iter_mut().find(|(id, _)| *id == r.id).unwrap();
        let run = Run {
            cpus: &opts.cpus,
            calls: warm,
            limit,
        };
        let (b, _, _) = run_batch(lab, r, frames, run, out, kern)?;
        if !b.wrong_actions.is_empty() {
            bail!(
                "warm-up of {} [{}]: unexpected actions {:?}",
                case(r.id).key,
                r.variant.name(),
                b.wrong_actions
            );
        }
    }
    Ok(())
}

/// The measurement rounds, each one batch of every case in a shuffled order, until
/// `--rounds` or `--max-secs`; returns the rounds completed.
pub(super) fn measure_rounds(
    lab: &mut Lab,
    results: &mut [CaseResult],
    sources: &mut Sources,
    opts: &Opts,
    out: &mut [u8],
    kern: &mut Vec<u32>,
) -> Result<usize> {
    println!(
        "measuring: {} rounds x {} (variant, case) batches of up to {} calls ({} s per batch at most, {} s in all)",
        opts.rounds,
        results.len(),
        opts.calls,
        opts.batch_secs,
        opts.max_secs
    );
    let limit = Duration::from_secs_f64(opts.batch_secs);
    let measure_start = Instant::now();
    let mut rounds_done = 0;
    let mut order: Vec<usize> = (0..results.len()).collect();
    for round in 0..opts.rounds {
        if measure_start.elapsed().as_secs_f64() >= opts.max_secs {
            println!("time bound reached after {round} rounds");
            break;
        }
        shuffle(&mut order, round as u64 + 1);
        for &i in &order {
            let r = &mut results[i];
            let (_, frames) = sources.iter_mut().find(|(id, _)| *id == r.id).unwrap();
            let run = Run {
                cpus: &opts.cpus,
                calls: opts.calls,
                limit,
            };
            measure_batch(lab, r, frames, run, out, kern)?;
        }
        rounds_done += 1;
        eprint!(
            "\rround {}/{} done ({:.0} s)",
            round + 1,
            opts.rounds,
            measure_start.elapsed().as_secs_f64()
        );
    }
    eprintln!();
    Ok(rounds_done)
}

/// One batch of a case's frames in its variant's namespace, with the data plane's counters
/// before and after it; the flows a new-flow batch inserted are deleted after it.
fn run_batch(
    lab: &mut Lab,
    r: &CaseResult,
    frames: &mut [Frames],
    run: Run,
    out: &mut [u8],
    kern: &mut Vec<u32>,
) -> Result<(Batch, Vec<u64>, Vec<u64>)> {
    lab.enter(r.variant)?;
    let def = case(r.id);
    let starts: Vec<u64> = frames.iter().map(fresh_start).collect();
    let dp = lab.dp(def.dp);
    let before = counters(dp)?;
    let b = measure(
        dp.program(def.prog)?,
        frames,
        run,
        expected_action(r.id, r.variant),
        out,
        kern,
    )?;
    let after = counters(dp)?;
    if def.dp == Dp::New {
        for (f, start) in frames.iter().zip(starts) {
            delete_fresh(&mut lab.new_conns, f, start, true)?;
        }
    }
    Ok((b, before, after))
}

/// One recorded batch of a case, with its counter deltas; a path that changed is an error.
fn measure_batch(
    lab: &mut Lab,
    r: &mut CaseResult,
    frames: &mut [Frames],
    run: Run,
    out: &mut [u8],
    kern: &mut Vec<u32>,
) -> Result<()> {
    let (b, before, after) = run_batch(lab, r, frames, run, out, kern)?;
    stats_delta(&before, &after, &mut r.counters);
    let wrong: usize = b.wrong_actions.values().sum();
    if wrong != 0 {
        let key = case(r.id).key;
        eprintln!(
            "\nwarning: {key} [{}]: {wrong} of {} calls returned another action (action: calls) {:?}; counters of this batch {:?}",
            r.variant.name(),
            b.calls,
            b.wrong_actions,
            {
                let mut d = BTreeMap::new();
                stats_delta(&before, &after, &mut d);
                d
            }
        );
        // A few odd calls are reported; a path that changed is an error.
        if wrong * 1000 > b.calls {
            bail!(
                "{key} [{}]: more than 0.1% of calls took another path",
                r.variant.name()
            );
        }
    }
    r.batches.push(b);
    Ok(())
}

pub(super) fn fresh_start(f: &Frames) -> u64 {
    match f {
        Frames::Fresh { next, .. } => *next,
        _ => 0,
    }
}

/// Deletes the flows a new-flow batch inserted (outside the timed region), so every batch
/// inserts into a table with room. `inserted`: every flow must have been (a build without
/// the insert, or that stops before it, has none to delete).
pub(super) fn delete_fresh(
    m: &mut BpfHashMap<MapData, FlowKey, ConnEntry>,
    f: &Frames,
    start: u64,
    inserted: bool,
) -> Result<()> {
    if let Frames::Fresh { frame, block, next } = f {
        let dport = u16::from_be_bytes([frame[36], frame[37]]);
        for n in start..*next {
            let removed = m.remove(&gen_key(*block, n, dport));
            if inserted {
                removed.with_context(|| format!("deleting new flow {n}: was it inserted?"))?;
            }
        }
    }
    Ok(())
}
