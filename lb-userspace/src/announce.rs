//! Route announcement: each VIP's /32 or /128 is announced to the routers through a BGP
//! speaker on this host (BIRD 2) only while the host can serve it, and withdrawn otherwise
//! (see [`decide`]). `sluice lb drain` puts the host in maintenance: every route is withdrawn
//! and the host reports when the flows it still carried have moved (no active flow in a
//! count taken after the withdrawal).
//!
//! [`Announcer`] holds what the admin API, `sluice status` and the metrics read; [`run`]
//! re-decides every `[bgp] interval` and at once when woken (a drain, an undrain), writes the
//! routes file and has BIRD re-read it only when the routes changed (or the last attempt
//! failed), and withdraws everything when the daemon stops, before the data plane goes.

pub mod bird;
/// `[bgp]`: its types and validation live with the rest of the configuration.
pub use crate::config::bgp as config;
pub mod decide;

use std::{collections::BTreeSet, net::IpAddr, sync::Arc, time::Duration};

use serde::Serialize;
use tokio::sync::{Mutex, Notify};

use crate::{
    clock::now_ms,
    controller::{Controller, Event, Plane},
};

use self::{bird::Session, config::BgpConfig, decide::Decision};

/// How long BIRD may take to answer one command.
const SPEAKER_TIMEOUT: Duration = Duration::from_secs(5);

/// What `GET /v1/lb` and `sluice status` show.
#[derive(Clone, Debug, Default, Serialize)]
pub struct Status {
    /// The host is in maintenance since (unix ms).
    pub maintenance_since_ms: Option<u64>,
    /// The maintenance withdrawal reached BIRD at (unix ms).
    pub withdrawn_ms: Option<u64>,
    /// A flow count taken after the withdrawal found no active flow (unix ms).
    pub drained_ms: Option<u64>,
    /// Active flows in the latest count (None: not counted yet).
    pub active_flows: Option<u64>,
    pub vips: Vec<Decision>,
    /// The routes BIRD was last told to announce.
    pub announced: BTreeSet<IpAddr>,
    /// The last time BIRD took the routes file (unix ms).
    pub applied_ms: Option<u64>,
    /// Why the last attempt to reach BIRD failed (None: it worked).
    pub speaker_error: Option<String>,
    pub speaker_errors: u64,
    /// BIRD's BGP sessions as `show protocols` listed them in the last round.
    pub sessions: Vec<Session>,
}

#[derive(Debug)]
pub struct Announcer {
    pub cfg: BgpConfig,
    status: std::sync::Mutex<Status>,
    wake: Notify,
}

/// Whether a host in maintenance has drained: a count of active flows taken after the
/// withdrawal reached the speaker found none. A count from before it could miss a flow that
/// arrived in between.
pub fn drained(withdrawn_ms: Option<u64>, counted_ms: u64, active: u64) -> bool {
    withdrawn_ms.is_some_and(|w| counted_ms > w && active == 0)
}

impl Announcer {
    pub fn new(cfg: BgpConfig) -> Arc<Announcer> {
        Arc::new(Announcer {
            cfg,
            status: Default::default(),
            wake: Notify::new(),
        })
    }

    #[cfg(test)]
    pub(crate) fn set_status(&self, s: Status) {
        *self.status.lock().expect("announce status lock") = s;
    }

    pub fn status(&self) -> Status {
        self.status.lock().expect("announce status lock").clone()
    }

    /// Puts the host in maintenance (again: keeps the first time). Returns whether it
    /// already was.
    pub fn drain(&self, now_ms: u64) -> bool {
        let was = {
            let mut s = self.status.lock().expect("announce status lock");
            let was = s.maintenance_since_ms.is_some();
            if !was {
                s.maintenance_since_ms = Some(now_ms);
                s.withdrawn_ms = None;
                s.drained_ms = None;
            }
            was
        };
        self.wake.notify_one();
        was
    }

    /// Ends maintenance. Returns whether the host was in it.
    pub fn undrain(&self) -> bool {
        let was = {
            let mut s = self.status.lock().expect("announce status lock");
            let was = s.maintenance_since_ms.take().is_some();
            s.withdrawn_ms = None;
            s.drained_ms = None;
            was
        };
        self.wake.notify_one();
        was
    }

    fn host_event(kind: &str, reason: String) -> Event {
        Event {
            time_ms: now_ms(),
            kind: kind.into(),
            vip: String::new(),
            backend: None,
            reason,
        }
    }

    /// One round: decide, tell BIRD if the routes changed, record what flipped, and follow a
    /// drain. `attached` is false for the last round, when the daemon stops.
    async fn round<P: Plane>(&self, ctl: &Mutex<Controller<P>>, attached: bool) {
        let (maintenance, before, announced, failed) = {
            let s = self.status.lock().expect("announce status lock");
            (
                s.maintenance_since_ms.is_some(),
                s.vips.clone(),
                s.announced.clone(),
                s.speaker_error.is_some() || s.applied_ms.is_none(),
            )
        };
        let vips: Vec<_> = {
            let c = ctl.lock().await;
            c.state().vips.values().map(decide::vip_input).collect()
        };
        let now = decide::decide(&decide::inputs(vips, attached, maintenance));
        let routes = decide::routes(&now);
        let mut events = vec![];
        let mut applied = None;
        let mut error = None;
        if routes != announced || failed {
            let r = async {
                bird::write_routes(&self.cfg.routes_file, &routes)?;
                bird::configure(&self.cfg.control_socket, SPEAKER_TIMEOUT).await
            }
            .await;
            match r {
                Ok(()) => applied = Some(now_ms()),
                Err(e) => error = Some(format!("{e:#}")),
            }
        }
        let sessions = bird::command(&self.cfg.control_socket, "show protocols", SPEAKER_TIMEOUT)
            .await
            .map(|r| bird::sessions(&r));
        if applied.is_some() {
            for d in decide::changes(&before, &now) {
                let kind = if d.announce {
                    "vip-announced"
                } else {
                    "vip-withdrawn"
                };
                events.push(Event {
                    time_ms: now_ms(),
                    kind: kind.into(),
                    vip: d.vip.clone(),
                    backend: None,
                    reason: format!("{} ({})", d.reason.text(), d.address),
                });
            }
        }
        let (counted, withdrawn) = {
            let mut s = self.status.lock().expect("announce status lock");
            if let Some(t) = applied {
                s.announced = routes.clone();
                s.applied_ms = Some(t);
                s.vips = now;
                if s.maintenance_since_ms.is_some() && routes.is_empty() && s.withdrawn_ms.is_none()
                {
                    s.withdrawn_ms = Some(t);
                }
            } else if error.is_none() {
                s.vips = now;
            }
            if let Some(e) = &error {
                s.speaker_errors += 1;
                if s.speaker_error.is_none() {
                    events.push(Self::host_event("bgp-speaker-error", e.clone()));
                }
            } else if s.speaker_error.is_some() && applied.is_some() {
                events.push(Self::host_event(
                    "bgp-speaker-ok",
                    "BIRD took the routes file again".into(),
                ));
            }
            if error.is_some() || applied.is_some() {
                s.speaker_error = error;
            }
            if let Ok(sessions) = sessions {
                s.sessions = sessions;
            }
            (s.drained_ms.is_some(), s.withdrawn_ms)
        };
        let mut c = ctl.lock().await;
        if withdrawn.is_some() && !counted {
            match c.active_flows() {
                Ok(flows) => {
                    let active: u64 = flows.values().sum();
                    let taken = c.flows_counted().map_or(now_ms(), |f| f.taken_ms);
                    let mut s = self.status.lock().expect("announce status lock");
                    s.active_flows = Some(active);
                    if drained(s.withdrawn_ms, taken, active) {
                        s.drained_ms = Some(now_ms());
                        events.push(Self::host_event(
                            "host-drained",
                            "routes withdrawn and no active flow left: the host can be taken down"
                                .into(),
                        ));
                    }
                }
                Err(e) => tracing::warn!(error = %format!("{e:#}"), "counting flows for the drain"),
            }
        }
        for e in events {
            c.record(e);
        }
    }
}

/// The announcement's metrics: per VIP whether it is announced, maintenance, BIRD's BGP
/// sessions that are up, and failed attempts to reach BIRD.
pub(crate) fn register_metrics(reg: &mut prometheus_client::registry::Registry, s: &Status) {
    use crate::prom_text::{counters, gauges};
    gauges(
        reg,
        "bgp_vip_announced",
        "1 while this host announces the VIP's address to its routers, 0 while withdrawn",
        s.vips
            .iter()
            .map(|d| {
                (
                    vec![("vip", d.vip.clone()), ("address", d.address.to_string())],
                    i64::from(d.announce),
                )
            })
            .collect(),
    );
    gauges(
        reg,
        "bgp_maintenance",
        "1 while the host is in maintenance (sluice lb drain), 2 once drained, 0 in service",
        vec![(
            vec![],
            match (s.maintenance_since_ms, s.drained_ms) {
                (None, _) => 0,
                (Some(_), None) => 1,
                (Some(_), Some(_)) => 2,
            },
        )],
    );
    gauges(
        reg,
        "bgp_sessions_established",
        "BIRD's BGP sessions in state Established (show protocols)",
        vec![(
            vec![],
            s.sessions
                .iter()
                .filter(|x| x.info.starts_with("Established"))
                .count() as i64,
        )],
    );
    counters(
        reg,
        "bgp_speaker_errors",
        "Attempts to write the routes file or have BIRD re-read it that failed",
        vec![(vec![], s.speaker_errors)],
    );
}

/// Announces until `stop` completes, then withdraws every route.
pub async fn run<P: Plane>(
    a: Arc<Announcer>,
    ctl: Arc<Mutex<Controller<P>>>,
    mut stop: impl std::future::Future<Output = ()> + Unpin,
) {
    let mut every = tokio::time::interval(a.cfg.interval);
    every.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        tokio::select! {
            _ = every.tick() => {}
            _ = a.wake.notified() => {}
            _ = &mut stop => break,
        }
        a.round(&ctl, true).await;
    }
    a.round(&ctl, false).await;
    if let Some(e) = a.status().speaker_error {
        tracing::error!(error = %e, "could not withdraw the routes at stop: BIRD still announces them");
    } else {
        tracing::info!("routes withdrawn");
    }
}

#[cfg(test)]
mod tests {
    use std::sync::atomic::{AtomicUsize, Ordering};

    use serde_json::json;
    use tokio::{
        io::{AsyncBufReadExt, AsyncWriteExt, BufReader},
        net::UnixListener,
    };

    use super::*;
    use crate::{
        admin::testing::controller,
        controller::{fake::FakePlane, Peer},
        state::Op,
    };

    /// A BIRD control socket that counts `configure` commands and lists one established
    /// BGP session.
    fn fake_bird(path: &std::path::Path) -> Arc<AtomicUsize> {
        let configures = Arc::new(AtomicUsize::new(0));
        let l = UnixListener::bind(path).unwrap();
        let n = configures.clone();
        tokio::spawn(async move {
            while let Ok((s, _)) = l.accept().await {
                let (r, mut w) = s.into_split();
                w.write_all(b"0001 BIRD 2.0.12 ready.\n").await.unwrap();
                let mut line = String::new();
                BufReader::new(r).read_line(&mut line).await.unwrap();
                let reply: &[u8] = if line == "configure\n" {
                    n.fetch_add(1, Ordering::SeqCst);
                    b"0002-Reading configuration from bird.conf\n0003 Reconfigured\n"
                } else {
                    b"2002-Name Proto Table State Since Info\n\
                      1002-uplink BGP --- up 11:00:00.000 Established\n0000 \n"
                };
                w.write_all(reply).await.unwrap();
            }
        });
        configures
    }

    fn kinds(c: &Controller<FakePlane>) -> Vec<String> {
        c.events().map(|e| e.kind.clone()).collect()
    }

    #[tokio::test]
    async fn the_shell_reconfigures_bird_on_changes_only_and_follows_a_drain() {
        let dir = crate::test_dir::TestDir::new("announce");
        let cfg = BgpConfig {
            control_socket: dir.join("bird.ctl"),
            routes_file: dir.join("routes.conf"),
            interval: Duration::from_millis(10),
        };
        let configures = fake_bird(&cfg.control_socket);
        let mut c = controller();
        let op: Op = serde_json::from_value(json!({"op": "add-vip",
            "vip": {"name": "chat", "address": "10.0.0.1", "port": 443, "protocol": "tcp"},
            "backends": [{"address": "10.1.0.1"}]}))
        .unwrap();
        c.submit(op, Peer::default(), 1).unwrap();
        let ctl = Mutex::new(c);
        let a = Announcer::new(cfg.clone());
        let routes = || std::fs::read_to_string(&cfg.routes_file).unwrap();

        a.round(&ctl, true).await;
        assert_eq!(configures.load(Ordering::SeqCst), 1);
        assert!(
            routes().contains("route 10.0.0.1/32 blackhole;"),
            "{}",
            routes()
        );
        let s = a.status();
        assert_eq!(s.announced.len(), 1);
        assert_eq!(s.sessions[0].info, "Established");
        assert_eq!(kinds(&*ctl.lock().await), ["vip-announced"]);
        // Nothing changed: BIRD is left alone.
        a.round(&ctl, true).await;
        assert_eq!(configures.load(Ordering::SeqCst), 1);

        assert!(!a.drain(now_ms()));
        a.round(&ctl, true).await;
        assert_eq!(configures.load(Ordering::SeqCst), 2);
        assert!(!routes().contains("route 10.0.0.1"), "{}", routes());
        let s = a.status();
        assert!(s.withdrawn_ms.is_some(), "{s:?}");
        // A count (the fake plane has no flows, counted at once) from after the withdrawal.
        tokio::time::sleep(Duration::from_millis(2)).await;
        a.round(&ctl, true).await;
        assert!(a.status().drained_ms.is_some());
        assert_eq!(
            kinds(&*ctl.lock().await),
            ["vip-announced", "vip-withdrawn", "host-drained"]
        );

        assert!(a.undrain());
        a.round(&ctl, true).await;
        assert!(routes().contains("route 10.0.0.1/32"));
        // The daemon stops: everything withdrawn.
        a.round(&ctl, false).await;
        assert!(!routes().contains("route 10.0.0.1"));
        assert_eq!(a.status().vips[0].reason, decide::Reason::Detached);
        assert_eq!(configures.load(Ordering::SeqCst), 4);

        // BIRD gone: one event, every failure counted, retried on every round.
        std::fs::remove_file(&cfg.control_socket).unwrap();
        a.undrain();
        a.round(&ctl, true).await;
        a.round(&ctl, true).await;
        let s = a.status();
        assert_eq!(s.speaker_errors, 2);
        assert!(s.speaker_error.unwrap().contains("bird.ctl"));
        let k = kinds(&*ctl.lock().await);
        assert_eq!(
            k.iter().filter(|k| *k == "bgp-speaker-error").count(),
            1,
            "{k:?}"
        );
    }

    #[test]
    fn a_drain_completes_only_on_a_count_after_the_withdrawal() {
        assert!(!drained(None, 10, 0), "not withdrawn yet");
        assert!(!drained(Some(10), 10, 0), "count from the same instant");
        assert!(!drained(Some(10), 11, 3), "flows still active");
        assert!(drained(Some(10), 11, 0));
    }
}
