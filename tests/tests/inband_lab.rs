//! A real slowed server found by its clients' ACKs alone: the daemon lab with four simulated
//! accelerators (`sluice-accel`) behind an in-band VIP, streams from the client namespace, and
//! one accelerator's exporter frozen before it is slowed, so its telemetry keeps saying what
//! it said while it was well. The in-band signals must move it away (reason `slow`) and flag
//! the exporter (`telemetry-mismatch`), while the others stay in rotation.

use std::{
    net::SocketAddr,
    path::PathBuf,
    sync::{
        atomic::{AtomicBool, Ordering},
        Arc,
    },
    thread,
    time::{Duration, Instant},
};

use serde_json::{json, Value};
use sluice_tests::{
    daemon_lab::{wait_for, Accel, DaemonLab, DaemonLabOptions, VipDef},
    netns::{TCP_PORT, VIP4},
    openai::{ChatStream, Event},
};

const SERVER: &str = env!("CARGO_BIN_EXE_sluice-testsrv");
const VIP: &str = "chat";
const BACKENDS: usize = 4;
const SLOW: usize = 1;
/// Streams kept open at once by the clients, and their length: enough answers per backend
/// for the in-band window (four per 8 s) at the lab's pace.
const CLIENTS: usize = 8;
const TOKENS: u32 = 24;

/// The `sluice-accel` binary next to the test executables (`cargo build --workspace`, which
/// `cargo xtask test` runs, builds it).
fn accel_binary() -> PathBuf {
    let exe = std::env::current_exe().unwrap();
    let dir = exe.parent().unwrap();
    let dir = if dir.ends_with("deps") {
        dir.parent().unwrap()
    } else {
        dir
    };
    let bin = dir.join("sluice-accel");
    assert!(
        bin.is_file(),
        "{} is missing: build it with `cargo build -p sluice-accel` (`cargo xtask test` does)",
        bin.display()
    );
    bin
}

fn steering(bs: &[Value]) -> Vec<String> {
    bs.iter()
        .map(|b| {
            format!(
                "{} {} {} inband={}/{}",
                b["address"].as_str().unwrap_or("?"),
                b["steering"]["state"],
                b["steering"]["reason"],
                b["steering"]["ttfb_s"],
                b["steering"]["delivery_bps"]
            )
        })
        .collect()
}

#[test]
fn a_slowed_accelerator_with_a_frozen_exporter_is_moved_away_by_in_band_signals() {
    let vip = SocketAddr::new(VIP4.into(), TCP_PORT);
    let mut v = VipDef::tcp(VIP, vip, BACKENDS);
    v.telemetry = true;
    v.inband = true;
    let mut opts = DaemonLabOptions::new(SERVER, BACKENDS, vec![v]);
    opts.accel = Some(Accel {
        binary: accel_binary(),
        args: vec![
            ["--max-num-seqs", "16", "--kv-capacity-tokens", "8192"]
                .map(String::from)
                .to_vec();
            BACKENDS
        ],
    });
    let lab = DaemonLab::start(opts).unwrap_or_else(|e| panic!("starting the daemon lab: {e:#}"));
    let slow_addr = lab.backend_addr(SLOW, vip).to_string();

    // Streams from the client namespace until told to stop (each bounded by its timeout).
    let stop = Arc::new(AtomicBool::new(false));
    let client = lab.topo.client.ns.clone();
    let workers: Vec<_> = (0..CLIENTS)
        .map(|_| {
            let (stop, ns) = (stop.clone(), client.clone());
            thread::spawn(move || {
                let mut done = 0u32;
                let started = Instant::now();
                while !stop.load(Ordering::Relaxed) && started.elapsed() < Duration::from_secs(120)
                {
                    let Ok(mut s) = ChatStream::open(&ns, vip, 64, TOKENS, Duration::from_secs(10))
                    else {
                        continue;
                    };
                    while let Ok(Event::Token) = s.next_event() {}
                    done += 1;
                }
                done
            })
        })
        .collect();

    // In-band readings for every backend first: the signals work on healthy ones.
    wait_for(
        "in-band readings on every backend",
        Duration::from_secs(30),
        || {
            let bs = lab.backends(VIP);
            if bs.len() == BACKENDS && bs.iter().all(|b| b["steering"]["ttfb_s"].is_f64()) {
                Ok(Some(()))
            } else {
                Err(format!("{:?}", steering(&bs)))
            }
        },
    )
    .unwrap();

    // Freeze the exporter, then slow the accelerator 4x.
    for body in [
        json!({"kind": "freeze"}),
        json!({"kind": "throttle", "factor": 0.25}),
    ] {
        let (code, text) = lab
            .accel_request(SLOW, "POST", "/fault", Some(&body))
            .unwrap();
        assert_eq!(code, 200, "fault {body}: {text}");
    }
    let t = Instant::now();
    let moved = wait_for(
        "the slowed accelerator moved away for being slow",
        Duration::from_secs(40),
        || {
            let bs = lab.backends(VIP);
            let b = bs.iter().find(|b| b["address"] == slow_addr.as_str());
            match b {
                Some(b) if b["steering"]["reason"] == "slow" => Ok(Some(bs.clone())),
                _ => Err(format!("{:?}", steering(&bs))),
            }
        },
    )
    .unwrap();
    eprintln!("moved away {:?} after the slowdown", t.elapsed());
    stop.store(true, Ordering::Relaxed);
    let streams: u32 = workers.into_iter().map(|w| w.join().unwrap()).sum();
    eprintln!("{streams} streams completed");

    // No healthy backend was called slow.
    for b in &moved {
        if b["address"] != slow_addr.as_str() {
            assert_ne!(b["steering"]["reason"], "slow", "{:?}", steering(&moved));
        }
    }
    // The exporter said nothing was wrong: flagged.
    let mismatch: Vec<Value> = lab
        .events()
        .into_iter()
        .filter(|e| e["kind"] == "telemetry-mismatch")
        .collect();
    assert_eq!(mismatch.len(), 1, "{mismatch:?}");
    assert_eq!(mismatch[0]["backend"], slow_addr.as_str(), "{mismatch:?}");
}
