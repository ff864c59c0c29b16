//! A fleet of three LB hosts sharing their desired state and steering through a real
//! three-member etcd: each host is a daemon lab (its own LB namespace running `sluice run`,
//! its own backends at the same addresses), linked to etcd's namespace (`sluice_tests::etcd`).
//!
//! One test walks the fleet through its life, checking after every change that all hosts
//! applied the same table-set version with equal ring digests: changes made on different
//! hosts, a backend removed under live streams on the others, the steering leader killed,
//! one etcd member stopped, one host cut off from etcd, and etcd stopped (static stability)
//! and started again.

use std::{
    net::SocketAddr,
    time::{Duration, Instant},
};

use serde_json::Value;
use sluice_tests::{
    daemon_lab::{wait_for, DaemonLab, DaemonLabOptions, Running, VipDef},
    etcd::EtcdCluster,
    netns::{TCP_PORT, VIP4},
};

const SERVER: &str = env!("CARGO_BIN_EXE_sluice-testsrv");
const LEASE_TTL: Duration = Duration::from_secs(2);
const CONVERGE: Duration = Duration::from_secs(15);

fn vip() -> SocketAddr {
    SocketAddr::new(VIP4.into(), TCP_PORT)
}

fn host(name: &str, etcd: &mut EtcdCluster) -> DaemonLab {
    let mut o = DaemonLabOptions::new(SERVER, 3, vec![VipDef::tcp("api", vip(), 2)]);
    let urls: Vec<String> = etcd
        .next_link_urls()
        .iter()
        .map(|u| format!("{u:?}"))
        .collect();
    o.set("fleet", "endpoints", &format!("[{}]", urls.join(", ")))
        .set("fleet", "host", &format!("{name:?}"))
        .set("fleet", "prefix", "\"/sluice-test\"")
        .set("fleet", "lease_ttl", "\"2s\"")
        .set("fleet", "request_timeout", "\"500ms\"");
    let lab = DaemonLab::start(o).unwrap_or_else(|e| panic!("starting LB host {name}: {e:#}"));
    etcd.link(&lab.topo.lb.ns)
        .unwrap_or_else(|e| panic!("linking {name} to etcd: {e:#}"));
    lab
}

fn fleet(lab: &DaemonLab) -> Result<Value, String> {
    match lab.api("GET", "/v1/status", None) {
        Ok((200, v)) => Ok(v["fleet"].clone()),
        other => Err(format!("{}: status {other:?}", lab.id)),
    }
}

/// Waits until every running host has etcd up, the same version (at least `min`) and equal,
/// non-empty ring digests; returns the version.
fn converged(labs: &[&DaemonLab], min: u64, what: &str) -> u64 {
    wait_for(what, CONVERGE, || {
        let f: Vec<Value> = labs.iter().map(|l| fleet(l)).collect::<Result<_, _>>()?;
        let seen = format!(
            "{:?}",
            f.iter()
                .map(|f| (&f["host"], &f["etcd_up"], &f["version"], &f["digests"]))
                .collect::<Vec<_>>()
        );
        let v = f[0]["version"].as_u64().unwrap_or(0);
        let same = f.iter().all(|x| {
            x["etcd_up"] == true
                && x["version"].as_u64() == Some(v)
                && x["digests"] == f[0]["digests"]
                && x["digests"].as_object().is_some_and(|d| !d.is_empty())
        });
        if same && v >= min {
            Ok(Some(v))
        } else {
            Err(seen)
        }
    })
    .unwrap_or_else(|e| panic!("{e:#}"))
}

fn leaders(labs: &[&DaemonLab]) -> Vec<String> {
    labs.iter()
        .filter_map(|l| fleet(l).ok())
        .filter(|f| f["is_leader"] == true)
        .map(|f| f["host"].as_str().unwrap_or_default().to_string())
        .collect()
}

/// Streams on every host; (host, stream).
fn streams(labs: &[&DaemonLab], per_host: usize, tokens: u32) -> Vec<(usize, Running)> {
    let mut out = vec![];
    for (i, lab) in labs.iter().enumerate() {
        for _ in 0..per_host {
            let s = lab
                .stream(vip(), tokens, 50)
                .unwrap_or_else(|e| panic!("opening a stream on host {i}: {e:#}"));
            out.push((i, s));
        }
    }
    out
}

#[test]
fn fleet_of_three_hosts_shares_one_state() {
    let t0 = Instant::now();
    let mut etcd = EtcdCluster::start(3).unwrap_or_else(|e| panic!("starting etcd: {e:#}"));
    let names = ["lb-a", "lb-b", "lb-c"];
    let mut labs: Vec<DaemonLab> = names.iter().map(|n| host(n, &mut etcd)).collect();
    let v = converged(&all(&labs), 1, "the fleet seeded and applied by all");
    let l = wait_for("one steering leader", CONVERGE, || {
        let l = leaders(&all(&labs));
        if l.len() == 1 {
            Ok(Some(l))
        } else {
            Err(format!("{l:?}"))
        }
    })
    .unwrap();
    eprintln!("fleet up in {:?}: version {v}, leader {l:?}", t0.elapsed());
    let addr = |i: usize| labs[0].backend_addr(i, vip()).to_string();
    let (b0, b1, b2) = (addr(0), addr(1), addr(2));

    // A change made on one host: all apply it.
    let asked = Instant::now();
    labs[0].cli_ok(&["backend", "add", "api", &b2]);
    let answered = asked.elapsed();
    let v = converged(&all(&labs), v + 1, "lb-a's backend add on every host");
    // For docs/fleet.md: the write's answer (compare-and-put in etcd, then applied on the
    // host asked) and the time until every host showed it (polled every 100 ms).
    eprintln!(
        "a change: answered after {answered:?}, on all 3 hosts after {:?}",
        asked.elapsed()
    );
    for lab in &labs {
        assert_eq!(lab.backends("api").len(), 3, "{}", lab.id);
    }
    // One on another.
    labs[1].cli_ok(&["backend", "set-weight", "api", &b0, "50"]);
    let v = converged(&all(&labs), v + 1, "lb-b's weight change on every host");
    for lab in &labs {
        let w = lab.backend("api", b0.parse().unwrap()).unwrap()["weight"].clone();
        assert_eq!(w, 50, "{}", lab.id);
    }

    // A backend removed on a third host while streams run on every host: none of the
    // streams on the other backends breaks, on any host.
    let running = streams(&all(&labs), 6, 60);
    let removed = labs[0].backend_name(b1.parse().unwrap()).unwrap();
    labs[2].cli_ok(&["backend", "remove", "api", &b1]);
    let v = converged(&all(&labs), v + 1, "lb-c's backend removal on every host");
    let (mut others, mut broken) = (0, vec![]);
    for (i, s) in running {
        if s.backend == removed {
            let _ = s.finish();
            continue;
        }
        others += 1;
        let backend = s.backend.clone();
        if let Err(e) = s.finish() {
            broken.push(format!("host {i}, backend {backend}: {e:#}"));
        }
    }
    assert!(others > 0, "no stream ran on the remaining backends");
    assert_eq!(
        broken,
        Vec::<String>::new(),
        "{others} streams on other backends"
    );
    eprintln!("backend removed under {others} streams on other backends: 0 broken");

    // The steering leader killed: another host takes over within the lease TTL (plus one
    // steering round, TTL/3, to notice), and its decisions go on: it completes a drain.
    let leader = leaders(&all(&labs));
    assert_eq!(leader.len(), 1, "{leader:?}");
    let li = names.iter().position(|h| *h == leader[0]).unwrap();
    let killed = Instant::now();
    labs[li].kill9().unwrap();
    let rest: Vec<&DaemonLab> = (0..3).filter(|i| *i != li).map(|i| &labs[i]).collect();
    let new = wait_for("a new steering leader", LEASE_TTL * 3, || {
        let l = leaders(&rest);
        if l.len() == 1 {
            Ok(Some(l[0].clone()))
        } else {
            Err(format!("{l:?}"))
        }
    })
    .unwrap();
    let took = killed.elapsed();
    eprintln!(
        "leader {} killed; {new} took over after {took:?} (lease TTL {LEASE_TTL:?})",
        leader[0]
    );
    assert!(
        took <= LEASE_TTL + LEASE_TTL / 3 + Duration::from_secs(1),
        "takeover took {took:?}"
    );
    rest[0].cli_ok(&["backend", "add", "api", &b1]);
    rest[1].cli_ok(&["backend", "drain", "api", &b1]);
    wait_for("the new leader completing the drain", CONVERGE, || {
        let n: Vec<usize> = rest.iter().map(|l| l.backends("api").len()).collect();
        if n.iter().all(|n| *n == 2) {
            Ok(Some(()))
        } else {
            Err(format!("{n:?}"))
        }
    })
    .unwrap();
    let events = rest[0].events();
    assert!(
        events.iter().any(|e| e["kind"] == "fleet-apply"
            && e["reason"]
                .as_str()
                .is_some_and(|r| r.contains(&new) && r.contains("remove-backend"))),
        "no drain completion published by {new}: {events:?}"
    );
    // The killed host comes back and catches up.
    labs[li].start_daemon().unwrap();
    let v = converged(&all(&labs), v + 3, "the restarted host caught up");

    // One etcd member stopped (every host's first endpoint): the other two hold quorum and
    // the fleet goes on.
    etcd.stop_member(0).unwrap();
    labs[1].cli_ok(&["backend", "set-weight", "api", &b0, "60"]);
    let v = converged(&all(&labs), v + 1, "a change with one etcd member down");
    etcd.restart().unwrap();

    // lb-c cut off from etcd: it says so and keeps its version while the others go on;
    // when the link is back it catches up.
    etcd.cut(3, true).unwrap();
    let vc = wait_for("lb-c saying etcd is unreachable", CONVERGE, || {
        let f = fleet(&labs[2])?;
        if f["etcd_up"] == false {
            Ok(Some(f["version"].as_u64().unwrap_or(0)))
        } else {
            Err(f.to_string())
        }
    })
    .unwrap();
    labs[0].cli_ok(&["backend", "set-weight", "api", &b0, "80"]);
    let v = converged(
        &all(&labs)[..2],
        v + 1,
        "the change on the hosts that reach etcd",
    );
    assert_eq!(
        fleet(&labs[2]).unwrap()["version"],
        vc,
        "lb-c moved while cut off"
    );
    assert!(vc < v);
    etcd.cut(3, false).unwrap();
    converged(&all(&labs), v, "lb-c caught up after the partition");

    // etcd stopped: forwarding, the read API and local health checks go on; writes are
    // refused with a clear error. Each host keeps the last version it saw: a steering
    // decision committed just before the stop may have reached only some of them, and they
    // agree again once etcd is back.
    let running = streams(&all(&labs), 4, 60);
    etcd.stop().unwrap();
    let seen = wait_for("every host saying etcd is unreachable", CONVERGE, || {
        let f: Vec<Value> = labs.iter().map(fleet).collect::<Result<_, _>>()?;
        if f.iter().all(|f| f["etcd_up"] == false) {
            Ok(Some(
                f.iter()
                    .map(|f| f["version"].as_u64().unwrap_or(0))
                    .collect::<Vec<u64>>(),
            ))
        } else {
            Err(format!("{f:?}"))
        }
    })
    .unwrap();
    assert!(
        seen.iter().all(|s| *s >= v),
        "a host went back while etcd stopped: {seen:?} (was {v})"
    );
    let v = *seen.iter().max().unwrap();
    let (code, _, err) = labs[1].cli(&["backend", "set-weight", "api", &b0, "70"]);
    assert_ne!(code, 0);
    assert!(
        err.contains("cannot be reached") && err.contains(&format!("version {}", seen[1])),
        "{err}"
    );
    for lab in &labs {
        assert_eq!(lab.backends("api").len(), 2, "read API on {}", lab.id);
        let out = lab.cli_ok(&["status"]);
        assert!(out.contains("UNREACHABLE"), "{out}");
    }
    let mut broken = vec![];
    for (i, s) in running {
        let backend = s.backend.clone();
        if let Err(e) = s.finish() {
            broken.push(format!("host {i}, backend {backend}: {e:#}"));
        }
    }
    assert_eq!(broken, Vec::<String>::new(), "streams while etcd is down");
    // A backend dies while etcd is down: every host's own health checks avoid it.
    a_backend_dies(&all(&labs), 2);
    wait_for(
        "the dead backend marked down on every host",
        CONVERGE,
        || {
            let h: Vec<Value> = labs
                .iter()
                .map(|l| {
                    l.backend("api", b2.parse().unwrap())
                        .map_or(Value::Null, |b| b["healthy"].clone())
                })
                .collect();
            if h.iter().all(|h| *h == false) {
                Ok(Some(()))
            } else {
                Err(format!("{h:?}"))
            }
        },
    )
    .unwrap();
    let dead = labs[0].backend_name(b2.parse().unwrap()).unwrap();
    for lab in &labs {
        for g in lab.greet_many(vip(), 12, 4) {
            let g = g.unwrap_or_else(|e| panic!("a session on {} with etcd down: {e:#}", lab.id));
            assert_ne!(g, dead, "{} sent a session to the dead backend", lab.id);
        }
    }

    // etcd back: the fleet converges on one version.
    etcd.restart().unwrap();
    converged(&all(&labs), v, "the fleet after etcd's return");
    for lab in &labs {
        let events = lab.events();
        for kind in ["fleet-etcd-unreachable", "fleet-etcd-up"] {
            assert!(
                events.iter().any(|e| e["kind"] == kind),
                "{}: no {kind} event",
                lab.id
            );
        }
    }
    eprintln!("fleet test took {:?}", t0.elapsed());
}

fn all(labs: &[DaemonLab]) -> Vec<&DaemonLab> {
    labs.iter().collect()
}

/// Stops backend `i`'s token server on every host (it served the health checks too).
fn a_backend_dies(labs: &[&DaemonLab], i: usize) {
    for lab in labs {
        let pid = lab.topo.pid(lab.servers[i]);
        unsafe { libc::kill(pid as i32, libc::SIGKILL) };
    }
}
