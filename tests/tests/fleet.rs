//! A fleet of LB hosts behind an ECMP router (see `sluice_tests::fleet_lab`): each host's
//! `sluice run` announces the VIP through its own BIRD 2 over BGP with BFD, the router (BIRD
//! too) installs one next hop per announcing host and hashes flows over them by their ports.
//! Needs root, `ip`, `ethtool`, `nsenter`, a bpffs, the `sluice` binary and BIRD 2 (`bird2`);
//! fails, never skips.
//!
//! Streams are real token streams through the router: every token is checked to come in
//! order from the backend that greeted, to `[DONE]`. Which host carries a stream is read from
//! the hosts' connection tables (the entry that saw the flow last).
//!
//! The last test runs the same lab as one fleet on a single-node etcd (`sluice_tests::etcd`,
//! Debian `etcd-server`): the BGP side and the shared state together.

use std::{
    collections::{BTreeMap, BTreeSet},
    net::Ipv4Addr,
    time::{Duration, Instant},
};

use serde_json::Value;
use sluice_tests::{
    daemon_lab::{wait_for, Running},
    etcd::EtcdCluster,
    fleet_lab::{bfd_detect, fleet_host, require_bird, FleetLab, CLIENT_SOURCES},
};

const SERVER: &str = env!("CARGO_BIN_EXE_sluice-testsrv");
/// Streams per test: enough that every host carries some (a host gets none with odds of
/// (2/3)^24, about 6e-5).
const STREAMS: usize = 24;
/// Tokens per stream and the interval: 12 s, longer than any change a test makes.
const TOKENS: u32 = 120;
const INTERVAL_MS: u32 = 100;
/// A connection-table entry this fresh means the host carries the flow now.
const FRESH: Duration = Duration::from_millis(600);

fn start(hosts: usize, running: usize) -> FleetLab {
    require_bird().unwrap_or_else(|e| panic!("{e:#}"));
    FleetLab::start(SERVER.as_ref(), hosts, running)
        .unwrap_or_else(|e| panic!("starting the fleet lab: {e:#}"))
}

/// Kills host `victim` and checks the router withdrew it within the BFD time (plus the
/// margin of a loaded machine); returns how long that took.
fn kill_and_withdraw(fleet: &mut FleetLab, victim: usize, rest: &[usize]) -> Duration {
    let t = Instant::now();
    fleet.kill_host(victim).unwrap();
    let killed = t.elapsed();
    fleet
        .wait_nexthops(&hops(fleet, rest), Duration::from_secs(5))
        .unwrap();
    let withdrawn = t.elapsed();
    eprintln!(
        "host {victim} killed in {killed:?}; the router withdrew it {withdrawn:?} after its link \
         went down (BFD detection {:?})",
        bfd_detect()
    );
    assert!(
        withdrawn <= bfd_detect() + Duration::from_millis(700),
        "the router took {withdrawn:?} to withdraw the dead host (BFD detection {:?})",
        bfd_detect()
    );
    withdrawn
}

fn open(fleet: &FleetLab) -> Vec<Running> {
    (0..STREAMS)
        .map(|i| {
            fleet
                .stream(i, TOKENS, INTERVAL_MS)
                .unwrap_or_else(|e| panic!("opening stream {i}: {e:#}"))
        })
        .collect()
}

/// The host carrying each of `streams` that some host saw within [`FRESH`].
fn seen(fleet: &FleetLab, streams: &[Running]) -> Result<BTreeMap<String, usize>, String> {
    let c = fleet.carriers(FRESH).map_err(|e| format!("{e:#}"))?;
    Ok(streams
        .iter()
        .filter_map(|s| {
            c.get(&s.local.to_string())
                .map(|k| (s.local.to_string(), *k))
        })
        .collect())
}

/// Which host carries each stream (by its client address), once every stream is seen.
fn carriers(fleet: &FleetLab, streams: &[Running]) -> BTreeMap<String, usize> {
    wait_for(
        "every stream seen on a host",
        Duration::from_secs(10),
        || {
            let mine = seen(fleet, streams)?;
            if mine.len() == streams.len() {
                Ok(Some(mine))
            } else {
                Err(format!(
                    "{} of {} streams seen: {mine:?}",
                    mine.len(),
                    streams.len()
                ))
            }
        },
    )
    .unwrap()
}

fn per_host(c: &BTreeMap<String, usize>) -> BTreeMap<usize, usize> {
    let mut m = BTreeMap::new();
    for k in c.values() {
        *m.entry(*k).or_default() += 1;
    }
    m
}

/// Waits until every one of `streams` is carried by a host not in `gone`.
fn moved(fleet: &FleetLab, streams: &[Running], gone: &[usize]) -> BTreeMap<String, usize> {
    wait_for(
        "the streams carried by the other hosts",
        Duration::from_secs(10),
        || {
            let mine = seen(fleet, streams)?;
            if mine.len() == streams.len() && mine.values().all(|k| !gone.contains(k)) {
                Ok(Some(mine))
            } else {
                Err(format!("{mine:?}"))
            }
        },
    )
    .unwrap()
}

/// Streams from more than one client address were opened and carried.
fn sources(c: &BTreeMap<String, usize>) -> usize {
    c.keys()
        .filter_map(|a| a.rsplit_once(':').map(|(ip, _)| ip))
        .collect::<BTreeSet<_>>()
        .len()
}

fn finish_all(streams: Vec<Running>) {
    let n = streams.len();
    let broken: Vec<String> = streams
        .into_iter()
        .filter_map(|s| {
            let local = s.local;
            match s.finish() {
                Ok(t) if t == TOKENS => None,
                Ok(t) => Some(format!("{local}: {t} tokens")),
                Err(e) => Some(format!("{local}: {e:#}")),
            }
        })
        .collect();
    assert!(
        broken.is_empty(),
        "{} of {n} streams broke: {broken:#?}",
        broken.len()
    );
}

fn hops(fleet: &FleetLab, hosts: &[usize]) -> BTreeSet<Ipv4Addr> {
    hosts.iter().map(|k| fleet.hosts[*k].host.v4).collect()
}

#[test]
fn flows_spread_and_a_killed_host_breaks_no_stream() {
    let mut fleet = start(3, 3);
    let streams = open(&fleet);
    let before = carriers(&fleet, &streams);
    let spread = per_host(&before);
    assert_eq!(spread.len(), 3, "every host carries streams: {spread:?}");
    assert_eq!(
        sources(&before),
        usize::from(CLIENT_SOURCES),
        "streams from every client address: {before:?}"
    );
    let victim = 1;
    let victims: Vec<&String> = before
        .iter()
        .filter(|(_, k)| **k == victim)
        .map(|(c, _)| c)
        .collect();
    eprintln!("host {victim} carries {} streams", victims.len());
    kill_and_withdraw(&mut fleet, victim, &[0, 2]);
    let after = moved(&fleet, &streams, &[victim]);
    for c in &victims {
        assert_ne!(after[*c], victim, "{c} still on the dead host");
    }
    finish_all(streams);
}

#[test]
fn a_host_added_mid_stream_breaks_no_stream() {
    let mut fleet = start(3, 2);
    let streams = open(&fleet);
    let before = carriers(&fleet, &streams);
    assert_eq!(
        per_host(&before).keys().copied().collect::<Vec<_>>(),
        [0, 1],
        "two hosts carry the streams"
    );
    fleet.start_host(2).unwrap();
    let took = fleet
        .wait_nexthops(&hops(&fleet, &[0, 1, 2]), Duration::from_secs(15))
        .unwrap();
    eprintln!("host 2 announced; the router added it within {took:?}");
    let after = wait_for(
        "streams moved to the new host",
        Duration::from_secs(10),
        || {
            let c = carriers(&fleet, &streams);
            if c.values().any(|k| *k == 2) {
                Ok(Some(c))
            } else {
                Err(format!("{:?}", per_host(&c)))
            }
        },
    )
    .unwrap();
    eprintln!("after the addition: {:?}", per_host(&after));
    finish_all(streams);
}

#[test]
fn drain_withdraws_the_host_and_reports_when_empty() {
    let fleet = start(3, 3);
    let streams = open(&fleet);
    let before = carriers(&fleet, &streams);
    assert!(
        per_host(&before).contains_key(&0),
        "host 0 carries streams: {before:?}"
    );
    let t = Instant::now();
    let out = fleet.cli(0, &["lb", "drain", "--deadline", "60s"]).unwrap();
    let took = t.elapsed();
    assert!(
        out.status.success() && out.stdout.contains("drained in"),
        "sluice lb drain: {out:?}"
    );
    eprintln!("drain reported empty after {took:?}:\n{}", out.stdout);
    assert_eq!(fleet.nexthops().unwrap(), hops(&fleet, &[1, 2]));
    let after = moved(&fleet, &streams, &[0]);
    assert!(after.values().all(|k| *k != 0));
    let status = fleet.api(0, "GET", "/v1/lb").unwrap();
    assert!(status["drained_ms"].is_u64(), "{status}");
    assert_eq!(status["announced"], serde_json::json!([]), "{status}");
    assert_eq!(status["vips"][0]["reason"], "maintenance", "{status}");
    let events = fleet.api(0, "GET", "/v1/events").unwrap();
    let kinds: Vec<&str> = events["events"]
        .as_array()
        .into_iter()
        .flatten()
        .filter_map(|e| e["kind"].as_str())
        .collect();
    for k in ["host-maintenance", "vip-withdrawn", "host-drained"] {
        assert!(kinds.contains(&k), "no {k} event in {kinds:?}");
    }
    let shown = fleet.cli(0, &["status"]).unwrap();
    assert!(
        shown.stdout.contains("maintenance, drained")
            && shown.stdout.contains("announced   nothing"),
        "sluice status: {shown:?}"
    );
    let page = fleet.lab.metrics_page().unwrap();
    assert!(page.contains("sluice_bgp_maintenance 2"), "{page}");
    assert!(
        page.contains("sluice_bgp_vip_announced{vip=\"chat\",address=\"10.111.100.1\"} 0"),
        "{page}"
    );

    let out = fleet.cli(0, &["lb", "undrain"]).unwrap();
    assert!(out.status.success(), "sluice lb undrain: {out:?}");
    fleet
        .wait_nexthops(&hops(&fleet, &[0, 1, 2]), Duration::from_secs(10))
        .unwrap();
    finish_all(streams);
}

/// Host `k`'s `/v1/status` fleet section.
fn fleet_status(fleet: &FleetLab, k: usize) -> Result<Value, String> {
    fleet
        .api(k, "GET", "/v1/status")
        .map(|v| v["fleet"].clone())
        .map_err(|e| format!("host {k}: {e:#}"))
}

/// Waits until `hosts` all reach etcd and applied the same table-set version (at least
/// `min`) with equal, non-empty ring digests; returns (version, digests).
fn agreed(fleet: &FleetLab, hosts: &[usize], min: u64, what: &str) -> (u64, Value) {
    wait_for(what, Duration::from_secs(20), || {
        let f: Vec<Value> = hosts
            .iter()
            .map(|k| fleet_status(fleet, *k))
            .collect::<Result<_, _>>()?;
        let v = f[0]["version"].as_u64().unwrap_or(0);
        let same = f.iter().zip(hosts).all(|(x, k)| {
            x["host"] == fleet_host(*k).as_str()
                && x["etcd_up"] == true
                && x["version"].as_u64() == Some(v)
                && x["digests"] == f[0]["digests"]
                && x["digests"].as_object().is_some_and(|d| !d.is_empty())
        });
        if same && v >= min {
            Ok(Some((v, f[0]["digests"].clone())))
        } else {
            Err(format!(
                "{:?}",
                f.iter()
                    .map(|f| (&f["host"], &f["etcd_up"], &f["version"], &f["digests"]))
                    .collect::<Vec<_>>()
            ))
        }
    })
    .unwrap_or_else(|e| panic!("{e:#}"))
}

/// The fleet lab whole: the three LB hosts announce over BGP and share one state
/// through a single-node etcd. They agree on one table-set version and ring digest, the
/// router spreads the streams over them, and one host killed mid-stream breaks none while
/// the other two still agree.
#[test]
fn a_fleet_on_etcd_agrees_and_a_killed_host_breaks_no_stream() {
    let t0 = Instant::now();
    require_bird().unwrap_or_else(|e| panic!("{e:#}"));
    let mut etcd = EtcdCluster::start(1).unwrap_or_else(|e| panic!("starting etcd: {e:#}"));
    let mut fleet = FleetLab::start_with_etcd(SERVER.as_ref(), 3, 3, &mut etcd)
        .unwrap_or_else(|e| panic!("starting the fleet lab on etcd: {e:#}"));
    let (v, digests) = agreed(&fleet, &[0, 1, 2], 1, "the three hosts on one version");
    eprintln!(
        "fleet on etcd up in {:?}: version {v}, digests {digests}",
        t0.elapsed()
    );

    let streams = open(&fleet);
    let before = carriers(&fleet, &streams);
    let spread = per_host(&before);
    assert_eq!(spread.len(), 3, "every host carries streams: {spread:?}");
    let victim = 1;
    eprintln!("streams per host: {spread:?}");
    kill_and_withdraw(&mut fleet, victim, &[0, 2]);
    let after = moved(&fleet, &streams, &[victim]);
    eprintln!("after the kill: {:?}", per_host(&after));
    let (v2, digests2) = agreed(&fleet, &[0, 2], v, "the two remaining hosts on one version");
    finish_all(streams);
    eprintln!(
        "0 of {STREAMS} streams broke; the remaining hosts on version {v2} (digests {}); \
         test took {:?}",
        if digests2 == digests {
            "unchanged"
        } else {
            "changed"
        },
        t0.elapsed()
    );
}
