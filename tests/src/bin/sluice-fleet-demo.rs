//! `cargo xtask demo fleet`: three LB hosts (each `sluice run` with BIRD 2) behind a BIRD
//! router that spreads the VIP over them with ECMP (`sluice_tests::fleet_lab`); token streams
//! run through the router; a third of the way in, one LB host dies (its link goes down, its
//! daemon, BIRD and data plane are killed); the router's BFD withdraws it and its streams move
//! to the other hosts, which send them to the same backends. Every second a line shows which
//! host carries how many streams and the router's next hops; a summary ends it (streams
//! completed and broken, how long the router took). The lab is removed at the end.
//!
//! `sluice-fleet-demo [--seconds N] [--streams N]` (as root).

use std::{
    collections::BTreeMap,
    process::ExitCode,
    time::{Duration, Instant},
};

use anyhow::{bail, Context, Result};
use sluice_tests::{
    daemon_lab::Running,
    fleet_lab::{bfd_detect, require_bird, FleetLab, VIP},
};

const INTERVAL_MS: u32 = 100;

struct Opts {
    seconds: u64,
    streams: usize,
}

fn parse_args() -> Result<Opts> {
    let mut o = Opts {
        seconds: 15,
        streams: 24,
    };
    let mut args = std::env::args().skip(1);
    while let Some(a) = args.next() {
        let mut val = |what: &str| args.next().with_context(|| format!("{a} needs {what}"));
        match a.as_str() {
            "--seconds" => o.seconds = val("a number of seconds")?.parse()?,
            "--streams" => o.streams = val("a number of streams")?.parse()?,
            _ => bail!(
                "usage: sluice-fleet-demo [--seconds N (default 15)] [--streams N (default 24)]"
            ),
        }
    }
    if !(5..=3600).contains(&o.seconds) || !(1..=200).contains(&o.streams) {
        bail!("--seconds must be 5 to 3600 and --streams 1 to 200");
    }
    Ok(o)
}

fn line(fleet: &FleetLab, streams: &[Running], t: Duration) -> Result<()> {
    let c = fleet.carriers(Duration::from_millis(600))?;
    let mut per: BTreeMap<String, usize> = BTreeMap::new();
    for s in streams.iter().filter(|s| !s.is_finished()) {
        let host = c
            .get(&s.local.to_string())
            .map_or("?".to_string(), |k| fleet.hosts[*k].host.name.clone());
        *per.entry(host).or_default() += 1;
    }
    let hops: Vec<String> = fleet.nexthops()?.iter().map(|h| h.to_string()).collect();
    println!(
        "{:>5.1}s  streams per LB host {per:?}  router next hops [{}]",
        t.as_secs_f64(),
        hops.join(", ")
    );
    Ok(())
}

fn run(o: &Opts) -> Result<bool> {
    require_bird()?;
    let server = std::env::current_exe()?
        .parent()
        .context("locating sluice-testsrv")?
        .join("sluice-testsrv");
    let mut fleet = FleetLab::start(&server, 3, 3)?;
    let tokens = (o.seconds * 1000 / INTERVAL_MS as u64) as u32;
    let streams: Vec<Running> = (0..o.streams)
        .map(|i| fleet.stream(i, tokens, INTERVAL_MS))
        .collect::<Result<_>>()?;
    println!(
        "{} streams of {tokens} tokens (one every {INTERVAL_MS} ms) from {} client addresses \
         through the router to {VIP}",
        o.streams,
        fleet.sources.len()
    );
    let t = Instant::now();
    let kill_at = Duration::from_secs(o.seconds / 3);
    let mut killed = None;
    let mut next = Duration::ZERO;
    while streams.iter().any(|s| !s.is_finished())
        && t.elapsed() < Duration::from_secs(o.seconds + 30)
    {
        if killed.is_none() && t.elapsed() >= kill_at {
            println!("-- lb1 dies: link down, daemon, BIRD and data plane killed");
            let k = Instant::now();
            fleet.kill_host(1)?;
            let want = [0, 2].iter().map(|k| fleet.hosts[*k].host.v4).collect();
            fleet.wait_nexthops(&want, Duration::from_secs(5))?;
            let took = k.elapsed();
            println!(
                "-- the router withdrew lb1 after {took:?} (BFD detection {:?})",
                bfd_detect()
            );
            killed = Some(took);
        }
        if t.elapsed() >= next {
            line(&fleet, &streams, t.elapsed())?;
            next += Duration::from_secs(1);
        }
        std::thread::sleep(Duration::from_millis(100));
    }
    let n = streams.len();
    let mut broken = vec![];
    for s in streams {
        let local = s.local;
        match s.finish() {
            Ok(got) if got == tokens => {}
            Ok(got) => broken.push(format!("{local}: {got} of {tokens} tokens")),
            Err(e) => broken.push(format!("{local}: {e:#}")),
        }
    }
    println!(
        "\nsummary: {} of {n} streams completed, {} broken; lb1 withdrawn by the router after {}",
        n - broken.len(),
        broken.len(),
        killed.map_or("(never killed)".to_string(), |d| format!("{d:?}"))
    );
    for b in &broken {
        println!("  broken: {b}");
    }
    Ok(broken.is_empty())
}

fn main() -> ExitCode {
    let opts = match parse_args() {
        Ok(o) => o,
        Err(e) => {
            eprintln!("{e:#}");
            return ExitCode::from(2);
        }
    };
    match run(&opts) {
        Ok(true) => ExitCode::SUCCESS,
        Ok(false) => ExitCode::FAILURE,
        Err(e) => {
            eprintln!("fleet demo failed: {e:#}");
            ExitCode::FAILURE
        }
    }
}
