//! The per-packet cost breakdown (`sluice-bench xdp --stages`): the whole program and one
//! build per stage taken out or cut after (lb-ebpf/src/ablate.rs), each loaded into data
//! planes of its own, measured on the same frames in the same shuffled rounds, in the `fib`
//! namespace (the production next-hop path).
//!
//! A stage's cost is a paired difference within each round, then the median over rounds:
//! the whole program less the build without that stage, or, for the path's prefixes, the
//! build that stops after a stage less the one that stops before it (the first less the
//! `sluice_pass` baseline).

use std::{path::Path, time::Duration};

use anyhow::{bail, Context, Result};
use aya::maps::{HashMap as BpfHashMap, MapData};
use lb_common::{ConnEntry, FlowKey};
use serde_json::{json, Value};
use sluice::{dataplane::Dataplane, object::BPF_OBJECT};

use super::{
    cases::{case, CaseId, Dp},
    lab::{conn_map, enter_variant, load_dp, run_once, setup_fib_netns},
    measure::{case_sources, delete_fresh, fresh_start, measure, shuffle, Run, Sources},
    traffic::TestFrames,
    Opts, FULL_TABLE_PER_CPU, XDP_PASS, XDP_REDIRECT, XDP_TX,
};
use crate::{out, sys};

/// How a build differs from the whole program.
#[derive(Clone, Copy, PartialEq)]
enum Cut {
    /// One stage taken out; its cost is the whole program's less this build's.
    Without,
    /// The program ends (`XDP_PASS`) after this stage; the stage costs this build less the
    /// previous prefix.
    StopAfter,
}

struct Stage {
    /// The lb-ebpf feature, and the object's name under the stages directory.
    feature: &'static str,
    stage: &'static str,
    cut: Cut,
    /// The action of every steered call (the whole program redirects through the devmap).
    action: u32,
}

/// In path order; the prefixes first.
const STAGES: &[Stage] = &[
    Stage {
        feature: "stop-after-parse",
        stage: "receive and parse (Ethernet, IP, TCP/UDP; the RX counter)",
        cut: Cut::StopAfter,
        action: XDP_PASS,
    },
    Stage {
        feature: "stop-after-vip",
        stage: "configuration and VIP lookup",
        cut: Cut::StopAfter,
        action: XDP_PASS,
    },
    Stage {
        feature: "stop-after-decide",
        stage: "decision: connection table, hash, admission, ring and backend reads, insert",
        cut: Cut::StopAfter,
        action: XDP_PASS,
    },
    Stage {
        feature: "ablate-hash",
        stage: "steering hash of a new flow",
        cut: Cut::Without,
        action: XDP_REDIRECT,
    },
    Stage {
        feature: "ablate-tenants",
        stage: "tenant admission (IPv4 table or prefix trie, limits, rate bucket, counters)",
        cut: Cut::Without,
        action: XDP_REDIRECT,
    },
    Stage {
        feature: "ablate-insert",
        stage: "connection-table insert",
        cut: Cut::Without,
        action: XDP_REDIRECT,
    },
    Stage {
        feature: "ablate-history",
        stage: "ring history: previous backends named in GUE",
        cut: Cut::Without,
        action: XDP_REDIRECT,
    },
    Stage {
        feature: "ablate-counters",
        stage: "per-CPU counters (outcomes, VIP and backend traffic)",
        cut: Cut::Without,
        action: XDP_REDIRECT,
    },
    Stage {
        feature: "ablate-csum",
        stage: "outer IPv4 header checksum",
        cut: Cut::Without,
        action: XDP_REDIRECT,
    },
    Stage {
        feature: "ablate-next-hop",
        stage: "next hop (per-CPU cache, FIB on a miss) and the devmap redirect",
        cut: Cut::Without,
        action: XDP_TX,
    },
    Stage {
        feature: "ablate-redirect",
        stage: "devmap redirect (XDP_TX in its place)",
        cut: Cut::Without,
        action: XDP_TX,
    },
];

/// The paths broken down: established, new flow and IPv6, in both flow-state modes.
const PATHS: &[CaseId] = &[
    CaseId::Established,
    CaseId::EstablishedV6,
    CaseId::SynNew,
    CaseId::SynNewTenants,
    CaseId::ScEstablished,
    CaseId::ScEstablishedV6,
    CaseId::ScSynNew,
];

const WHOLE: &str = "whole";
const WHOLE_AGAIN: &str = "whole-again";

/// One object's data planes (indexed by [`Dp`]).
struct Build {
    name: &'static str,
    stage: Option<&'static Stage>,
    dps: [Dataplane; 4],
    /// The new-flow data plane's connection table.
    new_conns: BpfHashMap<MapData, FlowKey, ConnEntry>,
}

impl Build {
    fn load(
        name: &'static str,
        stage: Option<&'static Stage>,
        object: &[u8],
        opts: &Opts,
        possible: usize,
        fib_ifindex: u32,
    ) -> Result<Build> {
        let full = FULL_TABLE_PER_CPU * possible as u32;
        let load = |size, sc| load_dp(object, size, sc).with_context(|| format!("build {name}"));
        let mut dps = [
            load(opts.conn_table, false)?,
            load(opts.conn_table, false)?,
            load(full, false)?,
            load(full, true)?,
        ];
        for dp in dps.iter_mut() {
            dp.add_tx_port(fib_ifindex)?;
        }
        let new_conns = conn_map(&mut dps[Dp::New as usize])?;
        Ok(Build {
            name,
            stage,
            dps,
            new_conns,
        })
    }

    /// Whether a new flow of this build leaves an entry to delete after its batch: not
    /// without the insert, nor where the program ends before the decision.
    fn inserts(&self) -> bool {
        !self.stage.is_some_and(|s| {
            matches!(
                s.feature,
                "ablate-insert" | "stop-after-parse" | "stop-after-vip"
            )
        })
    }

    fn expected(&self, id: CaseId) -> u32 {
        match (id, self.stage) {
            (CaseId::Pass, _) => XDP_PASS,
            (_, Some(s)) => s.action,
            (_, None) => XDP_REDIRECT,
        }
    }
}

/// Loads every stage object from `dir` (built by `cargo xtask bench xdp --stages`).
fn stage_objects(dir: &Path) -> Result<Vec<(&'static Stage, Vec<u8>)>> {
    STAGES
        .iter()
        .map(|s| {
            let p = dir.join(format!("{}.bpf.o", s.feature));
            let bytes = std::fs::read(&p).with_context(|| {
                format!(
                    "reading {}: the stage objects are built by `cargo xtask bench xdp --stages`",
                    p.display()
                )
            })?;
            Ok((s, bytes))
        })
        .collect()
}

pub(super) fn run(opts: &Opts, dir: &Path, possible: usize, command_line: String) -> Result<()> {
    let objects = stage_objects(dir)?;
    let ns = sys::new_netns()?;
    sys::enter_netns(&ns)?;
    let fib_ifindex = setup_fib_netns().context("setting up the fib namespace")?;
    // The whole program twice: the second copy's difference from the first (its own maps,
    // its own JIT image) is the floor below which a stage's figure says nothing.
    let mut builds = Vec::new();
    for name in [WHOLE, WHOLE_AGAIN] {
        builds.push(Build::load(
            name,
            None,
            BPF_OBJECT,
            opts,
            possible,
            fib_ifindex,
        )?);
    }
    for (s, bytes) in &objects {
        builds.push(Build::load(
            s.feature,
            Some(s),
            bytes,
            opts,
            possible,
            fib_ifindex,
        )?);
    }
    println!("loaded {} builds, 4 data planes each", builds.len());
    let frames = TestFrames::build();
    let mut out = vec![0u8; 2048];
    populate(&mut builds, &frames, &mut out)?;
    for b in builds.iter_mut() {
        enter_variant(&ns, &mut b.dps)?;
    }

    let mut sources: Sources = case_sources(&frames, 0, 1, None, 1);
    sources.retain(|(id, _)| *id == CaseId::Pass || PATHS.contains(id));
    // (build, case) pairs; the baseline runs on the whole program only (a build without
    // counters has another sluice_pass).
    let mut pairs: Vec<(usize, CaseId)> = vec![(0, CaseId::Pass)];
    for b in 0..builds.len() {
        pairs.extend(PATHS.iter().map(|&id| (b, id)));
    }
    let limit = Duration::from_secs_f64(opts.batch_secs);
    let mut kern = Vec::with_capacity(opts.calls);
    let cpus = &opts.cpus[..1];
    let warm = Run {
        cpus,
        calls: (opts.calls / 10).clamp(1, 10_000),
        limit,
    };
    for &(b, id) in &pairs {
        batch(&mut builds[b], id, &mut sources, warm, &mut out, &mut kern)?;
    }
    // means[pair][round]: kernel ns per call, batch mean.
    let mut means: Vec<Vec<f64>> = vec![Vec::new(); pairs.len()];
    let mut order: Vec<usize> = (0..pairs.len()).collect();
    let run = Run {
        cpus,
        calls: opts.calls,
        limit,
    };
    let started = std::time::Instant::now();
    for round in 0..opts.rounds {
        if started.elapsed().as_secs_f64() >= opts.max_secs {
            println!("time bound reached after {round} rounds");
            break;
        }
        shuffle(&mut order, round as u64 + 1);
        for &i in &order {
            let (b, id) = pairs[i];
            let ns = batch(&mut builds[b], id, &mut sources, run, &mut out, &mut kern)?;
            means[i].push(ns);
        }
        eprint!("\rround {}/{} done", round + 1, opts.rounds);
    }
    eprintln!();
    let doc = report(&builds, &pairs, &means, opts, command_line);
    out::write_json(&opts.out, &doc)?;
    Ok(())
}

/// The established flows (IPv4 and IPv6 ACKs) sent once as SYNs through the whole program;
/// every other build gets the same entries written from userspace (a build that stops
/// before the insert makes none).
fn populate(builds: &mut [Build], fr: &TestFrames, out: &mut [u8]) -> Result<()> {
    let (whole, others) = builds
        .split_first_mut()
        .expect("the whole program is loaded");
    let main = &mut whole.dps[Dp::Main as usize];
    for f in [&fr.syn4, &fr.syn6] {
        let (a, _) = run_once(main, sluice::dataplane::PROG_XDP, f, out)?;
        if a != XDP_REDIRECT {
            bail!("populating an established flow: action {a}, expected XDP_REDIRECT");
        }
    }
    let entries: Vec<(FlowKey, ConnEntry)> = conn_map(main)?
        .iter()
        .collect::<Result<_, _>>()
        .context("reading the whole program's connection table")?;
    if entries.len() != 2 {
        bail!(
            "populating: {} connection entries, expected 2",
            entries.len()
        );
    }
    for b in others.iter_mut() {
        let mut m = conn_map(&mut b.dps[Dp::Main as usize])?;
        for (k, e) in &entries {
            m.insert(k, e, 0)
                .with_context(|| format!("writing an established flow into build {}", b.name))?;
        }
    }
    Ok(())
}

/// One batch of a case on a build; returns its mean kernel ns per call. Every call must take
/// the build's action; the flows a new-flow batch inserted are deleted after it.
fn batch(
    b: &mut Build,
    id: CaseId,
    sources: &mut Sources,
    run: Run,
    out: &mut [u8],
    kern: &mut Vec<u32>,
) -> Result<f64> {
    let def = case(id);
    let (_, frames) = sources
        .iter_mut()
        .find(|(c, _)| *c == id)
        .expect("every path has frames");
    let starts: Vec<u64> = frames.iter().map(fresh_start).collect();
    let expect = b.expected(id);
    let dp = &mut b.dps[def.dp as usize];
    let r = measure(dp.program(def.prog)?, frames, run, expect, out, kern)?;
    if !r.wrong_actions.is_empty() {
        bail!(
            "{} on build {}: actions {:?} where {expect} was expected",
            def.key,
            b.name,
            r.wrong_actions
        );
    }
    if def.dp == Dp::New {
        let inserted = b.inserts();
        for (f, start) in frames.iter().zip(starts) {
            delete_fresh(&mut b.new_conns, f, start, inserted)?;
        }
    }
    Ok(r.kernel_ns)
}

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    let n = v.len();
    if n == 0 {
        f64::NAN
    } else if n % 2 == 1 {
        v[n / 2]
    } else {
        (v[n / 2 - 1] + v[n / 2]) / 2.0
    }
}

/// A difference over rounds: the median and quartiles of `a − b`, paired within each round.
struct Diff {
    median: f64,
    q1: f64,
    q3: f64,
}

fn paired(a: &[f64], b: &[f64]) -> Diff {
    let mut d: Vec<f64> = a.iter().zip(b).map(|(x, y)| x - y).collect();
    d.sort_by(f64::total_cmp);
    let q = |p: f64| d.get(((d.len() - 1) as f64 * p).round() as usize).copied();
    Diff {
        median: median(d.clone()),
        q1: q(0.25).unwrap_or(f64::NAN),
        q3: q(0.75).unwrap_or(f64::NAN),
    }
}

/// The breakdown: per path, the whole program's net cost and each stage's share of it.
fn report(
    builds: &[Build],
    pairs: &[(usize, CaseId)],
    means: &[Vec<f64>],
    opts: &Opts,
    command_line: String,
) -> Value {
    let of = |name: &str, id: CaseId| -> &[f64] {
        let i = pairs
            .iter()
            .position(|&(b, c)| builds[b].name == name && c == id)
            .expect("every build measured every path");
        &means[i]
    };
    let pass = of(WHOLE, CaseId::Pass);
    let mut rows = Vec::new();
    println!(
        "\nper-packet cost by stage, ns: median over rounds of paired differences (± half the interquartile range)"
    );
    let header: Vec<&str> = PATHS.iter().map(|&id| case(id).key).collect();
    println!("| stage | {} |", header.join(" | "));
    println!("|---|{}", "---|".repeat(PATHS.len()));
    let mut row = |stage: &str, build: Option<&str>, d: Vec<Diff>| {
        print_row(stage, &d);
        rows.push(json!({"stage": stage, "build": build, "ns": cells(&d)}));
    };
    let whole = PATHS
        .iter()
        .map(|&id| paired(of(WHOLE, id), pass))
        .collect();
    row("whole program, net of sluice_pass", None, whole);
    let again = PATHS
        .iter()
        .map(|&id| paired(of(WHOLE, id), of(WHOLE_AGAIN, id)))
        .collect();
    row(
        "the whole program less itself loaded again (the method's floor)",
        Some(WHOLE_AGAIN),
        again,
    );
    let mut before: Option<&str> = None;
    for s in STAGES {
        let costs = PATHS
            .iter()
            .map(|&id| match s.cut {
                Cut::Without => paired(of(WHOLE, id), of(s.feature, id)),
                Cut::StopAfter => paired(of(s.feature, id), before.map_or(pass, |p| of(p, id))),
            })
            .collect();
        if s.cut == Cut::StopAfter {
            before = Some(s.feature);
        }
        row(s.stage, Some(s.feature), costs);
    }
    if let Some(last) = before {
        let rest = PATHS
            .iter()
            .map(|&id| paired(of(WHOLE, id), of(last, id)))
            .collect();
        row(
            "after the decision: in-band, encapsulation, next hop, counters, redirect",
            None,
            rest,
        );
    }
    let (git_head, dirty) = sys::git_state();
    json!({
        "benchmark": "xdp-stages",
        "command_line": command_line,
        "date_utc": sys::utc_now(),
        "kernel": sys::kernel_release(),
        "cpu_model": sys::cpu_model(),
        "git_head": git_head,
        "dataplane_sources_differ_from_head": dirty,
        "paths": header,
        "rounds_completed": means[0].len(),
        "calls_per_batch": opts.calls,
        "stages": rows,
        "baseline_ns": median(pass.to_vec()),
        "cells": "per path: [first quartile, median, third quartile] over rounds of the paired differences, ns",
        "method": "every build (the whole program, and one per lb-ebpf ablate-*/stop-after-* feature) loaded into its own data planes in the fib namespace; every round runs one batch of each (build, path) pair in a shuffled order; a batch's figure is the mean kernel ns per call (BPF_PROG_TEST_RUN, repeat 1); rows of `stop-after-*` builds are prefix differences (the first less sluice_pass), rows of `ablate-*` builds the whole program less the build without the stage; median over rounds of differences paired within a round. Stages overlap only where a build's description says so (next hop includes the redirect)",
    })
}

fn cells(v: &[Diff]) -> Value {
    let r = |x: f64| (x * 10.0).round() / 10.0;
    PATHS
        .iter()
        .zip(v)
        .map(|(&id, d)| {
            let q = json!([r(d.q1), r(d.median), r(d.q3)]);
            (case(id).key.to_string(), q)
        })
        .collect::<serde_json::Map<_, _>>()
        .into()
}

/// A markdown row: each path's median, and in brackets half its interquartile range.
fn print_row(stage: &str, v: &[Diff]) {
    let cells: Vec<String> = v
        .iter()
        .map(|d| format!("{:.0} (±{:.0})", d.median, (d.q3 - d.q1) / 2.0))
        .collect();
    println!("| {stage} | {} |", cells.join(" | "));
}
