//! `sluice-bench history`: how often a ring slot changes owner under adaptive steering, and so
//! how deep a slot's history must be for second-chance forwarding to find every stream.
//!
//! Replays the weights a steer benchmark run recorded (its `steer.json`, one sample
//! of every backend's weight and state per second of each run) through the Maglev builder and
//! `ring_history::next`, as the daemon publishes them, and counts per slot the owner changes.
//! A stream of length L that starts at t on a slot's owner x survives with history depth d if
//! at every second of (t, t + L] x is the slot's owner or one of the owners its last d changes
//! replaced (a slot that goes back to x finds the stream again); the share of (slot, start
//! second) pairs where that fails is the share of such streams a depth-d history loses. The
//! samples are a second apart, so changes within one second count as one (a lower bound on
//! the daemon's tables).

use std::path::PathBuf;

use anyhow::{anyhow, Context, Result};
use lb_common::RING_HISTORY;
use serde_json::{json, Value};
use sluice::{
    maglev::{self, MaglevBackend},
    ring_history,
};
use sluice_tests::{RING, SEED};

use crate::out;

/// `sluice-bench history --help`.
#[derive(clap::Parser, Debug)]
#[command(
    name = "sluice-bench history",
    about = "Owner changes per ring slot when the steer benchmark's weight sequences are \
             published, and the share of streams of 10/20/30 s that a history of 1, 2 or 3 \
             previous owners per slot would lose, and what the shipped ring (3) loses"
)]
struct Args {
    /// Steer results to replay (default target/bench/steer.json, where `sluice-bench steer`
    /// writes without --record).
    #[arg(long)]
    steer: Option<PathBuf>,
    /// JSON results (default target/bench/ring-history.json; bench/results/ring-history.json
    /// with --record).
    #[arg(long)]
    out: Option<PathBuf>,
    #[arg(long, help = out::RECORD_HELP)]
    record: bool,
}

/// Stream lengths (seconds) and history depths reported.
const LENGTHS: [usize; 3] = [10, 20, 30];
const DEPTHS: [u32; 3] = [1, 2, 3];

pub fn main(args: &[String]) -> Result<()> {
    let Some(a) = crate::cli_args::<Args>("sluice-bench history", args)? else {
        return Ok(());
    };
    let steer = a
        .steer
        .unwrap_or_else(|| out::default_path(false, "steer.json"));
    let out_path = a
        .out
        .unwrap_or_else(|| out::default_path(a.record, "ring-history.json"));
    let doc: Value = serde_json::from_str(
        &std::fs::read_to_string(&steer).with_context(|| format!("reading {}", steer.display()))?,
    )?;
    let cells = doc["cells"]
        .as_array()
        .ok_or_else(|| anyhow!("{}: no cells", steer.display()))?;
    let mut rows = Vec::new();
    println!(
        "{:<14} {:<20} {:>6} {:>7} {:>14}  lost streams (share) by length and depth 1/2/3; shipped",
        "scenario", "policy", "span s", "tables", "slot chg/h"
    );
    for c in cells {
        let row = replay(c).with_context(|| format!("cell {} {}", c["scenario"], c["policy"]))?;
        println!(
            "{:<14} {:<20} {:>6.0} {:>7} {:>14.1}  {}",
            row["scenario"].as_str().unwrap_or(""),
            row["policy"].as_str().unwrap_or(""),
            row["span_s"].as_f64().unwrap_or(0.0),
            row["tables_published"],
            row["changes_per_slot_per_hour"].as_f64().unwrap_or(0.0),
            row["lost_share"]
                .as_object()
                .map(|m| m
                    .iter()
                    .map(|(k, v)| format!("{k}: {v}"))
                    .collect::<Vec<_>>()
                    .join("  "))
                .unwrap_or_default(),
        );
        println!(
            "{:<66}shipped depth {RING_HISTORY}: {}",
            "", row["lost_share_shipped"]
        );
        rows.push(row);
    }
    let report = json!({
        "benchmark": "history",
        "command_line": std::env::args().collect::<Vec<_>>().join(" "),
        "source": steer.display().to_string(),
        "source_git_head": doc["git_head"],
        "ring_size": RING,
        "method": "every ~1 s sample of the steer run's weights (a backend not active counts as weight 0) is published as a Maglev table through ring_history::next when it differs from the last; per slot, its owners over time. lost_share[L s] = [depth 1, 2, 3]: share of (slot, start second t) whose owner x at t is, at some second of (t, t+L], neither the slot's owner nor among the owners its last d changes replaced, i.e. of streams of L seconds that a history of d previous owners per slot cannot find (d = 1 and 2 are what shallower rings would lose). lost_share_shipped[L s]: the same share measured on the ring's own slot history as ring_history::next builds it (the shipped depth, distinct owners, most recent first)",
        "shipped_depth": RING_HISTORY,
        "cells": rows,
    });
    out::write_json(&out_path, &report)
}

fn replay(cell: &Value) -> Result<Value> {
    let names: Vec<String> = cell["backends"]
        .as_array()
        .ok_or_else(|| anyhow!("no backends"))?
        .iter()
        .map(|b| b.as_str().unwrap_or("").to_string())
        .collect();
    let timeline = cell["timeline"]
        .as_array()
        .ok_or_else(|| anyhow!("no timeline"))?;
    let mut live: Option<Vec<lb_common::RingSlot>> = None;
    let mut last: Option<Vec<u32>> = None;
    // Per slot, (sample index, owner) from the first table on, one entry per owner change.
    // Per slot, (sample index, owner, the ring's previous owners) from the first table on,
    // one entry per owner change.
    let mut owners: Vec<Vec<(usize, u16, [u16; RING_HISTORY])>> = vec![Vec::new(); RING as usize];
    let mut first = 0;
    let mut tables = 0;
    for (i, s) in timeline.iter().enumerate() {
        let weights: Vec<u32> = (0..names.len())
            .map(|b| {
                let active = s["state"][b].as_str() == Some("active");
                let w = s["weight"][b].as_f64().unwrap_or(0.0).round() as u32;
                if active {
                    w
                } else {
                    0
                }
            })
            .collect();
        if last.as_ref() == Some(&weights) || weights.iter().all(|&w| w == 0) {
            continue;
        }
        last = Some(weights.clone());
        let mb: Vec<MaglevBackend> = names
            .iter()
            .zip(&weights)
            .enumerate()
            .map(|(b, (key, &weight))| MaglevBackend {
                id: b as u32 + 1,
                key,
                weight,
            })
            .collect();
        let table = maglev::build(&mb, RING, SEED).map_err(|e| anyhow!("maglev: {e:?}"))?;
        let next = match &live {
            None => {
                first = i;
                let n = ring_history::first(&table);
                for (o, s) in owners.iter_mut().zip(&n) {
                    o.push((i, s.backend, s.previous));
                }
                n
            }
            Some(l) => {
                tables += 1;
                let n = ring_history::next(l, &table);
                for (o, s) in owners.iter_mut().zip(&n) {
                    if o.last().map(|x| x.1) != Some(s.backend) {
                        o.push((i, s.backend, s.previous));
                    }
                }
                n
            }
        };
        live = Some(next);
    }
    let span = timeline
        .last()
        .and_then(|s| s["t_s"].as_f64())
        .unwrap_or(0.0);
    let changes = |o: &Vec<(usize, u16, [u16; RING_HISTORY])>| o.len().saturating_sub(1);
    let total: usize = owners.iter().map(changes).sum();
    let samples = timeline.len();
    let mut lost = serde_json::Map::new();
    let mut lost_shipped = serde_json::Map::new();
    for l in LENGTHS {
        if first + l >= samples {
            continue;
        }
        let starts = first..samples - l;
        let mut over = [0u64; DEPTHS.len()];
        let mut over_shipped = 0u64;
        for o in &owners {
            // The entries in force at second u: those with index <= u.
            let upto = |u: usize| o.partition_point(|e| e.0 <= u);
            for t in starts.clone() {
                let x = o[upto(t) - 1].1;
                for (k, &d) in DEPTHS.iter().enumerate() {
                    let found = (t + 1..=t + l).all(|u| {
                        let n = upto(u);
                        o[n.saturating_sub(d as usize + 1)..n]
                            .iter()
                            .any(|e| e.1 == x)
                    });
                    if !found {
                        over[k] += 1;
                    }
                }
                // The ring as shipped: the owner or one of the slot's previous owners.
                let found = (t + 1..=t + l).all(|u| {
                    let e = &o[upto(u) - 1];
                    e.1 == x || e.2.contains(&x)
                });
                if !found {
                    over_shipped += 1;
                }
            }
        }
        let pairs = (starts.len() * RING as usize) as f64;
        lost.insert(
            format!("{l}s"),
            json!(over.map(|o| (o as f64 / pairs * 1e4).round() / 1e4)),
        );
        lost_shipped.insert(
            format!("{l}s"),
            json!((over_shipped as f64 / pairs * 1e4).round() / 1e4),
        );
    }
    let max_per_slot = owners.iter().map(changes).max().unwrap_or(0);
    Ok(json!({
        "scenario": cell["scenario"],
        "policy": cell["policy"],
        "span_s": span,
        "samples": samples,
        "tables_published": tables,
        "slot_changes": total,
        "changes_per_slot_per_hour": if span > 0.0 { total as f64 / RING as f64 / span * 3600.0 } else { 0.0 },
        "max_changes_of_one_slot": max_per_slot,
        "slots_changed_twice_or_more": owners.iter().filter(|o| changes(o) >= 2).count(),
        "lost_share": lost,
        "lost_share_shipped": lost_shipped,
    }))
}
