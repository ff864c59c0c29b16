//! The fleet's logic against an in-memory etcd ([`FakeStore`]) with a simulated lease
//! clock, and controllers over fake planes: each "host" is a `Fleet` plus a controller.

use std::{
    collections::BTreeMap,
    net::IpAddr,
    sync::Arc,
    time::{Duration, Instant},
};

use tokio::sync::{watch, Mutex};

use super::{run::Campaign, store::fake::FakeStore, *};
use crate::{
    admin::testing::controller,
    config::PolicyConfig,
    controller::{fake::FakePlane, Peer},
    policy::{Policy, Reason},
    state::{BackendSpec, HashMode, Protocol, VipSpec},
    telemetry::{inband::Tracker, Hub},
};

struct Host {
    fleet: Arc<Fleet<FakeStore>>,
    ctl: Arc<Mutex<Controller<FakePlane>>>,
    stop: watch::Sender<bool>,
}

impl Drop for Host {
    fn drop(&mut self) {
        let _ = self.stop.send(true);
    }
}

fn cfg(host: &str) -> FleetConfig {
    config_for_tests("http://127.0.0.1:2379", host, Duration::from_secs(3))
}

/// A host that follows the fleet's table set (the daemon's `follow` task).
fn host(etcd: &FakeStore, name: &str) -> Host {
    let fleet = Arc::new(Fleet::new(
        etcd.client(),
        cfg(name),
        Limits { max_vips: 4 },
        1,
    ));
    let ctl = Arc::new(Mutex::new(controller()));
    let (stop, mut rx) = watch::channel(false);
    tokio::spawn(run::follow(fleet.clone(), ctl.clone(), async move {
        let _ = rx.wait_for(|s| *s).await;
    }));
    Host { fleet, ctl, stop }
}

fn ip(s: &str) -> IpAddr {
    s.parse().unwrap()
}

fn add_vip() -> Op {
    Op::AddVip {
        vip: VipSpec {
            name: "api".into(),
            address: ip("10.0.0.1"),
            port: 80,
            protocol: Protocol::Tcp,
            hash: HashMode::FiveTuple,
            affinity_secs: 0,
            priority: 0,
            ring_size: 251,
            flow_state: Default::default(),
            inband: false,
            quic: Default::default(),
            quic_server_id_len: 2,
            quic_config_rotation: 0,
            tenants: Vec::new(),
        },
        backends: ["10.1.0.1", "10.1.0.2", "10.1.0.3"]
            .iter()
            .map(|a| BackendSpec {
                address: ip(a),
                weight: 100,
                labels: BTreeMap::new(),
                max_sessions: 0,
                quic_server_id: None,
            })
            .collect(),
    }
}

/// Waits (bounded) until every host applied `version`; panics with what each holds.
async fn converged(hosts: &[&Host], version: u64) {
    let deadline = Instant::now() + Duration::from_secs(5);
    loop {
        let st: Vec<FleetStatus> = hosts.iter().map(|h| h.fleet.status()).collect();
        if st.iter().all(|s| s.version == version) {
            return;
        }
        assert!(
            Instant::now() < deadline,
            "not all hosts reached version {version} within 5 s: {:?}",
            st.iter().map(|s| (&s.host, s.version)).collect::<Vec<_>>()
        );
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
}

#[tokio::test]
async fn a_change_on_one_host_is_applied_by_all_with_equal_rings() {
    let etcd = FakeStore::default();
    let (a, b, c) = (host(&etcd, "a"), host(&etcd, "b"), host(&etcd, "c"));
    // The first host to find the fleet empty seeds it (an empty state here).
    converged(&[&a, &b, &c], 1).await;
    let mut events = vec![];
    let t = a
        .fleet
        .submit(&add_vip(), 1_000, &mut events)
        .await
        .unwrap();
    assert_eq!(t.version, 2);
    converged(&[&a, &b, &c], 2).await;
    let op = Op::SetWeight {
        vip: "api".into(),
        address: ip("10.1.0.2"),
        weight: 20,
    };
    drop(
        run::submit(&b.fleet, &b.ctl, op, Peer::default(), 2_000)
            .await
            .unwrap(),
    );
    converged(&[&a, &b, &c], 3).await;
    let digests: Vec<_> = [&a, &b, &c]
        .iter()
        .map(|h| h.fleet.status().digests)
        .collect();
    assert_eq!(digests[0].len(), 1);
    assert_eq!(digests[0], digests[1]);
    assert_eq!(digests[0], digests[2]);
    // The weight is the fleet's on every host.
    for h in [&a, &b, &c] {
        let ctl = h.ctl.lock().await;
        let be = ctl.state().backend("api", ip("10.1.0.2")).unwrap();
        assert_eq!(be.spec.weight, 20, "on {}", h.fleet.cfg.host);
    }
    // A refused request changes nothing anywhere.
    let e = a
        .fleet
        .submit(&Op::RemoveVip { vip: "nope".into() }, 3_000, &mut events)
        .await
        .unwrap_err();
    assert_eq!(e.http_status(), 404, "{e}");
    assert_eq!(a.fleet.read().await.unwrap().0.unwrap().version, 3);
}

#[tokio::test]
async fn versions_only_move_forward() {
    let etcd = FakeStore::default();
    let fleet = Fleet::new(etcd.client(), cfg("a"), Limits { max_vips: 4 }, 1);
    let mut ctl = controller();
    let mut events = vec![];
    fleet.seed(&State::default(), 0, &mut events).await.unwrap();
    let v2 = fleet.submit(&add_vip(), 1, &mut events).await.unwrap();
    let v3 = fleet
        .submit(
            &Op::RemoveBackend {
                vip: "api".into(),
                address: ip("10.1.0.3"),
            },
            2,
            &mut events,
        )
        .await
        .unwrap();
    assert!(fleet.apply(&mut ctl, &v3, 3));
    // The older set arriving late (a slow watch, a reply after the watch) is ignored.
    assert!(!fleet.apply(&mut ctl, &v2, 4));
    assert!(!fleet.apply(&mut ctl, &v3, 4));
    assert_eq!(fleet.status().version, 3);
    assert_eq!(ctl.state().vip("api").unwrap().backends.len(), 2);
}

#[tokio::test]
async fn concurrent_writers_form_one_sequence() {
    let etcd = FakeStore::default();
    let (a, b) = (
        Fleet::new(etcd.client(), cfg("a"), Limits { max_vips: 4 }, 1),
        Fleet::new(etcd.client(), cfg("b"), Limits { max_vips: 4 }, 1),
    );
    let mut events = vec![];
    a.seed(&State::default(), 0, &mut events).await.unwrap();
    // b seeding finds a's set and keeps it.
    assert!(b
        .seed(&State::default(), 0, &mut events)
        .await
        .unwrap()
        .is_none());
    a.submit(&add_vip(), 1, &mut events).await.unwrap();
    let w1 = Op::SetWeight {
        vip: "api".into(),
        address: ip("10.1.0.1"),
        weight: 7,
    };
    let w2 = Op::SetWeight {
        vip: "api".into(),
        address: ip("10.1.0.2"),
        weight: 9,
    };
    let (mut ea, mut eb) = (vec![], vec![]);
    let (wa, wb) = tokio::join!(a.submit(&w1, 2, &mut ea), b.submit(&w2, 2, &mut eb));
    let mut versions = [wa.unwrap().version, wb.unwrap().version];
    versions.sort();
    assert_eq!(versions, [3, 4]);
    // Neither change was lost.
    let t = a.read().await.unwrap().0.unwrap();
    let w = |addr: &str| t.state.backend("api", ip(addr)).unwrap().spec.weight;
    assert_eq!((w("10.1.0.1"), w("10.1.0.2")), (7, 9));
}

#[tokio::test]
async fn the_leader_is_replaced_when_its_lease_expires() {
    let etcd = FakeStore::default();
    let a = Fleet::new(etcd.client(), cfg("a"), Limits { max_vips: 4 }, 1);
    let b = Fleet::new(etcd.client(), cfg("b"), Limits { max_vips: 4 }, 1);
    let (mut ca, mut cb) = (Campaign::default(), Campaign::default());
    assert_eq!(ca.round(&a).await.unwrap(), (Some("a".into()), true));
    assert_eq!(cb.round(&b).await.unwrap(), (Some("a".into()), false));
    // Rounds every TTL/3 keep a's lease alive.
    for _ in 0..5 {
        etcd.advance(1_000);
        assert_eq!(ca.round(&a).await.unwrap(), (Some("a".into()), true));
        assert_eq!(cb.round(&b).await.unwrap(), (Some("a".into()), false));
    }
    // a dies: no more keep-alives. Within the TTL nobody else leads...
    etcd.advance(2_999);
    assert_eq!(cb.round(&b).await.unwrap(), (Some("a".into()), false));
    // ...and once it has passed, b takes over.
    etcd.advance(1);
    assert_eq!(cb.round(&b).await.unwrap(), (Some("b".into()), true));
    // a comes back: its lease is gone, it gets a new one and follows b.
    assert_eq!(ca.round(&a).await.unwrap(), (Some("b".into()), false));
}

#[tokio::test]
async fn static_stability_when_etcd_is_unreachable() {
    let etcd = FakeStore::default();
    let (a, b) = (host(&etcd, "a"), host(&etcd, "b"));
    converged(&[&a, &b], 1).await;
    a.fleet.submit(&add_vip(), 1, &mut vec![]).await.unwrap();
    converged(&[&a, &b], 2).await;
    let digest = a.fleet.status().digests;

    // a loses etcd.
    a.fleet.store.cut(true);
    let e = run::submit(
        &a.fleet,
        &a.ctl,
        Op::SetWeight {
            vip: "api".into(),
            address: ip("10.1.0.1"),
            weight: 5,
        },
        Peer::default(),
        10,
    )
    .await
    .err()
    .expect("a write without etcd fails");
    assert_eq!(e.http_status(), 503);
    let msg = e.to_string();
    assert!(
        msg.contains("cannot be reached") && msg.contains("version 2") && msg.contains("retry"),
        "{msg}"
    );
    let st = a.fleet.status();
    assert!(!st.etcd_up);
    assert_eq!((st.version, st.outages), (2, 1));
    assert_eq!(st.digests, digest, "the tables stay as they were");
    {
        let c = a.ctl.lock().await;
        let kinds: Vec<&str> = c.events().map(|e| e.kind.as_str()).collect();
        assert!(kinds.contains(&"fleet-etcd-unreachable"), "{kinds:?}");
    }
    // Its health checks still count: a dead backend leaves its table.
    a.ctl
        .lock()
        .await
        .submit(
            Op::SetHealth {
                vip: "api".into(),
                address: ip("10.1.0.3"),
                healthy: false,
            },
            Peer::default(),
            11,
        )
        .unwrap();
    {
        let c = a.ctl.lock().await;
        let ring = c
            .state()
            .vip("api")
            .unwrap()
            .table(1, |b| c.overlay().weight(b))
            .unwrap();
        let dead = c.state().backend("api", ip("10.1.0.3")).unwrap().id;
        assert!(!ring.contains(&dead));
    }
    // Meanwhile the rest of the fleet changes.
    b.fleet
        .submit(
            &Op::SetWeight {
                vip: "api".into(),
                address: ip("10.1.0.2"),
                weight: 50,
            },
            12,
            &mut vec![],
        )
        .await
        .unwrap();
    converged(&[&b], 3).await;
    assert_eq!(a.fleet.status().version, 2);

    // etcd is back: a catches up, keeping its own health verdict.
    a.fleet.store.cut(false);
    converged(&[&a, &b], 3).await;
    assert!(a.fleet.status().etcd_up);
    let c = a.ctl.lock().await;
    assert!(!c.state().backend("api", ip("10.1.0.3")).unwrap().healthy);
    assert_eq!(
        c.state()
            .backend("api", ip("10.1.0.2"))
            .unwrap()
            .spec
            .weight,
        50
    );
    let kinds: Vec<&str> = c.events().map(|e| e.kind.as_str()).collect();
    assert!(kinds.contains(&"fleet-etcd-up"), "{kinds:?}");
}

#[test]
fn drains_complete_on_the_fleets_flows() {
    let t = Tables {
        version: 5,
        state: State::default()
            .apply(&add_vip(), 0, &Limits { max_vips: 4 })
            .unwrap()
            .apply(
                &Op::Drain {
                    vip: "api".into(),
                    address: ip("10.1.0.1"),
                    deadline_ms: Some(10_000),
                },
                1_000,
                &Limits { max_vips: 4 },
            )
            .unwrap(),
        ..Default::default()
    };
    let id = t.state.backend("api", ip("10.1.0.1")).unwrap().id;
    let report = |flows: u64, taken_ms: u64| HostReport {
        version: 5,
        flows: [(id, flows)].into(),
        taken_ms,
    };
    let reports = |a, b| -> BTreeMap<String, HostReport> {
        [("a".to_string(), a), ("b".to_string(), b)].into()
    };
    // One host still carries a flow: not done.
    assert!(drains_done(&t, &reports(report(0, 2_000), report(1, 2_000)), 2_000).is_empty());
    // A report taken before the drain began cannot tell: not done.
    assert!(drains_done(&t, &reports(report(0, 2_000), report(0, 500)), 2_000).is_empty());
    // No host reported (all leases gone): nothing to go by.
    assert!(drains_done(&t, &BTreeMap::new(), 2_000).is_empty());
    // Empty everywhere.
    let done = drains_done(&t, &reports(report(0, 2_000), report(0, 2_000)), 2_000);
    assert_eq!(done.len(), 1);
    assert!(done[0].2.contains("no active flows left on 2 hosts"));
    // The deadline ends it whatever is left.
    let done = drains_done(&t, &reports(report(3, 10_000), report(1, 10_000)), 10_000);
    assert!(
        done[0].2.contains("deadline reached with 4 active flows"),
        "{done:?}"
    );
}

/// The table set's size in etcd grows with the backends: it must stay under etcd's default
/// request limit (1.5 MiB) at the data plane's backend limit (4,095 ids): 64 VIPs × 63 backends.
#[test]
fn table_set_size_for_thousands_of_backends() {
    let limits = Limits { max_vips: 512 };
    let mut state = State::default();
    for v in 0..64u32 {
        let Op::AddVip { mut vip, .. } = add_vip() else {
            unreachable!()
        };
        vip.name = format!("vip-{v}");
        vip.address = IpAddr::from([10, 0, (v / 256) as u8, (v % 256) as u8]);
        let backends = (0..63u32)
            .map(|b| BackendSpec {
                address: IpAddr::from([10, 1 + (v / 256) as u8, (v % 256) as u8, b as u8]),
                weight: 100,
                labels: [("zone".to_string(), "a".to_string())].into(),
                max_sessions: 64,
                quic_server_id: None,
            })
            .collect();
        state = state
            .apply(&Op::AddVip { vip, backends }, 0, &limits)
            .unwrap();
    }
    let overlay = Overlay {
        weights: state
            .vips
            .values()
            .flat_map(|v| v.backends.values().map(|b| (b.id, 50)))
            .collect(),
        ..Default::default()
    };
    let t = Tables {
        version: 1,
        state,
        overlay,
        by: "lb-1".into(),
        reason: "sizing".into(),
    };
    let bytes = serde_json::to_vec(&t).unwrap().len();
    eprintln!("table set of 64 VIPs x 63 backends: {bytes} bytes");
    assert!(
        bytes < 1536 * 1024,
        "{bytes} bytes: over etcd's request limit"
    );
}

#[tokio::test]
async fn the_leaders_policy_step_sees_in_band_signals() {
    let etcd = FakeStore::default();
    let a = host(&etcd, "a");
    converged(&[&a], 1).await;
    let mut op = add_vip();
    if let Op::AddVip { vip, .. } = &mut op {
        vip.inband = true;
    }
    a.fleet.submit(&op, 1_000, &mut vec![]).await.unwrap();
    converged(&[&a], 2).await;
    let ids: Vec<u32> = {
        let c = a.ctl.lock().await;
        ["10.1.0.1", "10.1.0.2", "10.1.0.3"]
            .iter()
            .map(|b| c.state().backend("api", ip(b)).unwrap().id)
            .collect()
    };
    let mut s = run::Steering {
        ctl: a.ctl.clone(),
        hub: Arc::new(std::sync::Mutex::new(Hub::new(Duration::from_secs(3)))),
        policy: Policy::new(PolicyConfig::default()),
        inband: Tracker::default(),
        shed_rst: false,
        scrape_interval: Duration::from_secs(1),
        scrape_timeout: Duration::from_millis(500),
        epoch: Instant::now(),
    };
    let mut campaign = Campaign::default();
    // Cumulative aggregates: a baseline, then a second of streaming per backend, the third
    // delivering a quarter of what the others do.
    for (round, bytes) in [(0, [0, 0, 0]), (1, [4000, 4000, 1000])] {
        {
            let mut c = a.ctl.lock().await;
            for (id, b) in ids.iter().zip(bytes) {
                let units = if round == 0 { 0 } else { 1024 };
                c.plane().inband.insert(
                    *id,
                    lb_common::InbandStats {
                        acked_bytes: b,
                        stream_units: units,
                        ..Default::default()
                    },
                );
            }
        }
        let now = 2_000 + round;
        run::lease_round(&a.fleet, &a.ctl, &mut campaign, now, &mut vec![])
            .await
            .unwrap();
        run::step(&a.fleet, &mut s, now, &mut vec![]).await.unwrap();
    }
    assert!(a.fleet.status().is_leader);
    let c = a.ctl.lock().await;
    let reasons: Vec<_> = ids
        .iter()
        .map(|id| c.decision(*id).and_then(|d| d.reason))
        .collect();
    assert_eq!(reasons, [None, None, Some(Reason::Slow)]);
    assert_eq!(c.decision(ids[2]).unwrap().weight, 0);
}
