//! `sluice-bench maglev`: what a table change costs the control plane. Build time of weighted
//! Maglev tables (M = 65537) for 10, 100 and 1000 backends, the slots one backend's removal
//! changes, and the time to publish a table into the real map: in full (a VIP's first table)
//! and as the diff against what the inactive ring holds (every later change).

use std::time::Instant;

use anyhow::Result;
use lb_common::{BackendEntry, VipKey, VipMeta, BACKEND_ACTIVE, PROTO_TCP};
use serde_json::{json, Value};
use sluice::{
    addr::to_words,
    dataplane::{Dataplane, LoadOptions},
    maglev::{self, MaglevBackend},
    object::BPF_OBJECT,
};

use crate::{out, summary::Summary, sys};

const M: u32 = maglev::DEFAULT_RING_SIZE;
const SEED: u32 = 0x5eed;

fn backends(n: u32, weighted: bool) -> (Vec<String>, Vec<u32>) {
    let keys = (0..n)
        .map(|i| format!("10.{}.{}.{}", i / 65536, (i / 256) % 256, i % 256))
        .collect();
    let weights = (0..n)
        .map(|i| if weighted { 1 + (i * 37) % 100 } else { 100 })
        .collect();
    (keys, weights)
}

fn build(keys: &[String], weights: &[u32], skip: Option<usize>) -> Result<Vec<u32>> {
    let b: Vec<MaglevBackend> = keys
        .iter()
        .zip(weights)
        .enumerate()
        .filter(|(i, _)| Some(*i) != skip)
        .map(|(i, (k, w))| MaglevBackend {
            id: i as u32 + 1,
            key: k,
            weight: *w,
        })
        .collect();
    Ok(maglev::build(&b, M, SEED)?)
}

fn ms(f: impl Fn() -> Result<()>, runs: usize) -> Result<Summary> {
    let mut t = Vec::with_capacity(runs);
    for _ in 0..runs {
        let s = Instant::now();
        f()?;
        t.push(s.elapsed().as_secs_f64() * 1e3);
    }
    Ok(Summary::of(&t))
}

fn summary(s: Summary) -> Value {
    json!({"median": s.median, "min": s.min, "p90": s.p90})
}

/// `sluice-bench maglev --help`.
#[derive(clap::Parser, Debug)]
#[command(
    name = "sluice-bench maglev",
    about = "Maglev table build time for 10 to 1000 backends and the cost of publishing a change"
)]
struct Args {
    /// Runs of each measurement.
    #[arg(long, default_value_t = 21)]
    runs: usize,
    #[arg(long, help = out::RECORD_HELP)]
    record: bool,
}

pub fn main(args: &[String]) -> Result<()> {
    let Some(Args { runs, record }) = crate::cli_args::<Args>("sluice-bench maglev", args)? else {
        return Ok(());
    };
    sys::require_root()?;
    let mut builds = vec![];
    println!("Maglev table build, M = {M}, {runs} runs each (ms: median [min p90])");
    for n in [10u32, 100, 1000] {
        for weighted in [false, true] {
            let (keys, weights) = backends(n, weighted);
            let s = ms(|| build(&keys, &weights, None).map(drop), runs)?;
            println!(
                "  {n:>5} backends, {:<13} {:>8.2} [{:.2} {:.2}]",
                if weighted {
                    "weights 1-100"
                } else {
                    "equal weights"
                },
                s.median,
                s.min,
                s.p90
            );
            builds.push(json!({"backends": n, "weighted": weighted, "build_ms": summary(s)}));
        }
    }

    // Publishing into the real map, in a fresh namespace and data plane.
    let _ns = sys::new_netns()?;
    let mut dp = Dataplane::load(
        BPF_OBJECT,
        &LoadOptions {
            conn_table_size: 1024,
            affinity_table_size: 1024,
            max_vips: 1,
            pin_dir: None,
        },
    )?;
    let (keys, weights) = backends(1000, false);
    for (i, k) in keys.iter().enumerate() {
        let (addr, family) = to_words(k.parse()?);
        dp.set_backend(
            i as u32 + 1,
            &BackendEntry {
                addr,
                family,
                state: BACKEND_ACTIVE,
                vip: 0,
                ..Default::default()
            },
        )?;
    }
    let (vaddr, family) = to_words("10.200.0.1".parse()?);
    let key = VipKey {
        addr: vaddr,
        port: 443u16.to_be(),
        proto: PROTO_TCP,
        family,
    };
    let meta = VipMeta {
        id: 0,
        ring_size: M,
        ..Default::default()
    };
    let full = build(&keys, &weights, None)?;
    let less = build(&keys, &weights, Some(500))?;
    let changed = maglev::diff(&full, &less).count();
    let t = Instant::now();
    let first = dp.publish(&key, meta, &full)?;
    let first_ms = t.elapsed().as_secs_f64() * 1e3;
    // The second publish fills the other ring in full too; from then on each change (here a
    // different backend leaving each time) writes the diff against the table two changes
    // back, which that ring still holds.
    let live = dp.vip(&key)?.expect("published above");
    dp.publish(&key, live, &less)?;
    let mut incremental = vec![];
    let mut slots = vec![];
    for i in 0..runs {
        let table = build(&keys, &weights, Some(i))?;
        let live = dp.vip(&key)?.expect("published above");
        let t = Instant::now();
        slots.push(dp.publish(&key, live, &table)?);
        incremental.push(t.elapsed().as_secs_f64() * 1e3);
    }
    let inc = Summary::of(&incremental);
    println!("Publish into MAGLEV_RINGS, 1000 backends:");
    println!("  first table (every slot): {first} slots in {first_ms:.1} ms");
    println!(
        "  one backend removed: {changed} slots change ({:.2}% of M); a change publishes in {:.2} ms [{:.2} {:.2}], writing {} to {} slots",
        100.0 * changed as f64 / M as f64,
        inc.median,
        inc.min,
        inc.p90,
        slots.iter().min().unwrap_or(&0),
        slots.iter().max().unwrap_or(&0)
    );
    let (git_revision, git_dirty) = sys::git_state();
    let doc = json!({
        "benchmark": "maglev",
        "command_line": std::env::args().collect::<Vec<_>>().join(" "),
        "git_revision": git_revision,
        "git_dirty": git_dirty,
        "date_utc": sys::utc_now(),
        "kernel": sys::kernel_release(),
        "cpu_model": sys::cpu_model(),
        "ring_size": M,
        "runs": runs,
        "builds": builds,
        "publish": {
            "backends": 1000,
            "first_table": {"slots_written": first, "ms": first_ms},
            "one_backend_removed": {
                "slots_changed": changed,
                "fraction_of_ring": changed as f64 / M as f64,
            },
            "successive_changes": {
                "what": "each publish removes a different backend from the full set; the inactive ring holds the table of two changes back",
                "publish_ms": summary(inc),
                "slots_written_min_max": [slots.iter().min(), slots.iter().max()],
            },
        },
    });
    out::write_json(&out::default_path(record, "maglev.json"), &doc)
}
