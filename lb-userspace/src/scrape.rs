//! The scrape loop: every `scrape_interval`, fetch each endpoint (at most
//! `max_concurrent_scrapes` at once, each within `scrape_timeout`), read every target's part
//! from it and hand the parts, or the errors, to the hub. Failures are recorded, never fatal.
//!
//! Rounds start on one schedule for the daemon's life ([`round_at`]): the policy ticker keeps
//! it too and steps once the round has reported, on telemetry milliseconds old, not a round
//! old.

use std::{
    collections::BTreeMap,
    future::Future,
    path::PathBuf,
    sync::{Arc, Mutex, PoisonError},
    time::{Duration, Instant},
};

use tokio::{
    sync::Semaphore,
    task::JoinSet,
    time::{interval_at, Interval, MissedTickBehavior},
};
use tracing::{debug, info, warn};

use self::http::Client;
use crate::{
    config::TelemetryConfig,
    telemetry::{
        dcgm, engine,
        prom::{self, Page},
        roce::{self, Counters, RateTracker},
        target::{Endpoint, Reader, Target},
        Hub, Sample,
    },
};

pub mod http;

/// The first scrape round at or after `now`: rounds start at `epoch` + a whole number of
/// `period`s, so a restarted scraper (a reload) keeps the schedule the ticker steps on.
pub fn round_at(epoch: Instant, period: Duration, now: Instant) -> Instant {
    let since = now.saturating_duration_since(epoch).as_nanos();
    let period_ns = period.as_nanos().max(1);
    let rounds = since.div_ceil(period_ns);
    epoch + Duration::from_nanos((rounds * period_ns) as u64)
}

/// A ticker on the rounds of [`round_at`], from the first one at or after now. Skip keeps a
/// late round's successors on the schedule (Delay would shift them).
pub fn rounds(epoch: Instant, period: Duration) -> Interval {
    let mut every = interval_at(round_at(epoch, period, Instant::now()).into(), period);
    every.set_missed_tick_behavior(MissedTickBehavior::Skip);
    every
}

/// Until the scrape round that began at `round` has reported ([`Hub::reported_since`]), or
/// `deadline`, when its slowest scrape has timed out. Polls: a round reports within
/// milliseconds, and the hub stays a plain structure behind its lock.
pub async fn round_in(hub: &Mutex<Hub>, round: Instant, deadline: Instant) {
    const POLL: Duration = Duration::from_millis(2);
    while Instant::now() < deadline
        && !hub
            .lock()
            .expect("telemetry hub lock")
            .reported_since(round)
    {
        tokio::time::sleep(POLL).await;
    }
}

/// Polls `targets` on the rounds of [`round_at`] until `shutdown` completes. Targets sharing
/// an endpoint share its fetch.
pub async fn run(
    targets: Vec<Target>,
    hub: Arc<Mutex<Hub>>,
    cfg: TelemetryConfig,
    epoch: Instant,
    shutdown: impl Future<Output = ()>,
) {
    let permits = Arc::new(Semaphore::new(cfg.max_concurrent_scrapes as usize));
    let mut groups: BTreeMap<Endpoint, Vec<Target>> = BTreeMap::new();
    for t in targets {
        groups.entry(t.endpoint.clone()).or_default().push(t);
    }
    let mut tasks = JoinSet::new();
    for (endpoint, targets) in groups {
        tasks.spawn(poll(
            endpoint,
            targets,
            hub.clone(),
            cfg.clone(),
            epoch,
            permits.clone(),
        ));
    }
    shutdown.await;
    tasks.shutdown().await;
}

enum Fetch {
    Http(Client),
    Sysfs(PathBuf),
}

enum Data {
    Page(String),
    Counters(Counters),
}

/// The targets of one endpoint, each with its counter history and failure state (for
/// logging a failure once, not every round).
struct Watched {
    target: Target,
    rates: RateTracker,
    tpot: engine::TpotTracker,
    failing: bool,
}

async fn poll(
    endpoint: Endpoint,
    targets: Vec<Target>,
    hub: Arc<Mutex<Hub>>,
    cfg: TelemetryConfig,
    epoch: Instant,
    permits: Arc<Semaphore>,
) {
    let mut fetch = match &endpoint {
        Endpoint::Http(url) => Fetch::Http(Client::new(url.clone())),
        Endpoint::Sysfs(path) => Fetch::Sysfs(path.clone()),
    };
    let mut watched: Vec<Watched> = targets
        .into_iter()
        .map(|target| Watched {
            target,
            rates: RateTracker::default(),
            tpot: engine::TpotTracker::default(),
            failing: false,
        })
        .collect();
    let mut ticker = rounds(epoch, cfg.scrape_interval);
    loop {
        ticker.tick().await;
        let fetched = {
            let Ok(_permit) = permits.acquire().await else {
                return;
            };
            match &mut fetch {
                Fetch::Http(client) => client.get(cfg.scrape_timeout).await.map(Data::Page),
                Fetch::Sysfs(path) => read_sysfs(path.clone(), &cfg).await.map(Data::Counters),
            }
        };
        let at = Instant::now();
        let data = match &fetched {
            Err(e) => Err(e.clone()),
            Ok(Data::Page(text)) => prom::parse(text)
                .map(Parsed::Page)
                .map_err(|e| format!("bad page: {e}")),
            Ok(Data::Counters(c)) => Ok(Parsed::Counters(c)),
        };
        let mut hub = hub.lock().unwrap_or_else(PoisonError::into_inner);
        for w in &mut watched {
            let part = data
                .as_ref()
                .map_err(Clone::clone)
                .and_then(|d| part(w, d, at));
            let (key, source) = (&w.target.key, w.target.source());
            match part {
                Ok(part) => {
                    if w.failing {
                        info!(vip = %key.0, backend = %key.1, %source, %endpoint, "telemetry recovered");
                    }
                    w.failing = false;
                    if let Some(part) = part {
                        hub.update(key, source, part, at);
                    }
                }
                Err(e) => {
                    if !w.failing {
                        warn!(vip = %key.0, backend = %key.1, %source, %endpoint, error = %e, "telemetry failing");
                    }
                    w.failing = true;
                    hub.record_error(key, source, e, at);
                }
            }
        }
    }
}

enum Parsed<'a> {
    Page(Page<'a>),
    Counters(&'a Counters),
}

/// `w`'s part of the data; None when the source reported nothing usable this round. A first
/// counter reading has no rates yet: its part is empty, but the source has answered, so the
/// backend is not taken for stale ("never scraped") until its second round.
fn part(w: &mut Watched, data: &Parsed<'_>, at: Instant) -> Result<Option<Sample>, String> {
    let counters = match (&w.target.reader, data) {
        (Reader::Dcgm { gpus, uuids }, Parsed::Page(p)) => {
            return dcgm::extract(p, gpus, uuids).map(Some)
        }
        (Reader::Engine { kind, model }, Parsed::Page(p)) => {
            let model = model.as_deref();
            let mut sample = engine::extract(p, *kind, model)?;
            sample.tpot_s = w.tpot.observe(engine::tpot_totals(p, *kind, model));
            return Ok(Some(sample));
        }
        (Reader::RoceExporter { device, port }, Parsed::Page(p)) => {
            roce::exporter_counters(p, device, port)?
        }
        (Reader::RoceSysfs, Parsed::Counters(c)) => (*c).clone(),
        (reader, _) => return Err(format!("{reader:?} cannot read {}", w.target.endpoint)),
    };
    let Some(rates) = w.rates.observe(counters.clone(), at) else {
        return Ok(Some(Sample::default()));
    };
    let errors = roce::errors(&rates);
    if !errors.is_empty() {
        let key = &w.target.key;
        debug!(vip = %key.0, backend = %key.1, ?errors, "RoCE transport errors per second");
    }
    Ok(Some(roce::sample(&counters, &rates)))
}

/// sysfs reads of `hw_counters` query the NIC's firmware; keep them off the async threads.
async fn read_sysfs(path: PathBuf, cfg: &TelemetryConfig) -> Result<Counters, String> {
    let read = tokio::task::spawn_blocking(move || roce::read_sysfs(&path));
    match tokio::time::timeout(cfg.scrape_timeout, read).await {
        Ok(Ok(result)) => result,
        Ok(Err(e)) => Err(format!("sysfs read failed: {e}")),
        Err(_) => Err(format!("sysfs read took over {:?}", cfg.scrape_timeout)),
    }
}

#[cfg(test)]
mod tests {
    use std::{
        net::SocketAddr,
        sync::atomic::{AtomicUsize, Ordering},
        time::Duration,
    };

    use tokio::{
        io::{AsyncReadExt, AsyncWriteExt},
        net::{TcpListener, TcpStream},
        sync::oneshot,
    };

    use super::*;
    use crate::{
        config::EngineKind,
        config::HttpUrl,
        telemetry::{BackendKey, BackendTelemetry, Source},
    };

    const DCGM: &str = include_str!(concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/../lb-core/tests/fixtures/telemetry/dcgm-exporter.prom"
    ));
    const VLLM: &str = include_str!(concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/../lb-core/tests/fixtures/telemetry/vllm.prom"
    ));
    const NODE: &str = include_str!(concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/../lb-core/tests/fixtures/telemetry/node-exporter-roce.prom"
    ));

    /// What the test server answers for a path: status, body, delay.
    type Route = fn(&str) -> (u16, String, Duration);

    fn routes(path: &str) -> (u16, String, Duration) {
        let ok = |body: &str| (200, body.to_owned(), Duration::ZERO);
        match path {
            "/dcgm" => ok(DCGM),
            "/vllm" => ok(VLLM),
            "/node" => ok(NODE),
            "/slow" => (200, VLLM.to_owned(), Duration::from_secs(5)),
            "/garbage" => ok("vllm:num_requests_waiting{model_name=\"m\" 3\n"),
            "/huge" => ok(&"x 1\n".repeat(MAX_BODY / 4 + 1)),
            p if p.starts_with("/delay") => (200, VLLM.to_owned(), Duration::from_millis(40)),
            _ => (500, "oops".to_owned(), Duration::ZERO),
        }
    }

    const MAX_BODY: usize = super::http::MAX_BODY_BYTES;

    #[derive(Default)]
    struct Stats {
        connections: AtomicUsize,
        requests: AtomicUsize,
        in_flight: AtomicUsize,
        max_in_flight: AtomicUsize,
    }

    /// A keep-alive HTTP/1.1 server on 127.0.0.1 answering from `route`.
    async fn serve(route: Route) -> (SocketAddr, Arc<Stats>) {
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let stats = Arc::new(Stats::default());
        let s = stats.clone();
        tokio::spawn(async move {
            while let Ok((conn, _)) = listener.accept().await {
                s.connections.fetch_add(1, Ordering::SeqCst);
                tokio::spawn(answer(conn, route, s.clone()));
            }
        });
        (addr, stats)
    }

    async fn answer(mut conn: TcpStream, route: Route, stats: Arc<Stats>) {
        let mut buf = Vec::new();
        loop {
            let head_end = loop {
                if let Some(i) = buf.windows(4).position(|w| w == b"\r\n\r\n") {
                    break i + 4;
                }
                let mut chunk = [0u8; 4096];
                match conn.read(&mut chunk).await {
                    Ok(0) | Err(_) => return,
                    Ok(n) => buf.extend_from_slice(&chunk[..n]),
                }
            };
            let head = String::from_utf8_lossy(&buf[..head_end]).into_owned();
            buf.drain(..head_end);
            let path = head.split(' ').nth(1).unwrap_or("/").to_owned();
            stats.requests.fetch_add(1, Ordering::SeqCst);
            let now = stats.in_flight.fetch_add(1, Ordering::SeqCst) + 1;
            stats.max_in_flight.fetch_max(now, Ordering::SeqCst);
            let (status, body, delay) = route(&path);
            tokio::time::sleep(delay).await;
            stats.in_flight.fetch_sub(1, Ordering::SeqCst);
            let reply = format!(
                "HTTP/1.1 {status} X\r\nContent-Type: text/plain; version=0.0.4\r\n\
                 Content-Length: {}\r\n\r\n{body}",
                body.len()
            );
            if conn.write_all(reply.as_bytes()).await.is_err() {
                return;
            }
        }
    }

    fn key(n: u8) -> BackendKey {
        ("chat".to_owned(), format!("10.1.0.{n}").parse().unwrap())
    }

    fn http(addr: SocketAddr, path: &str) -> Endpoint {
        Endpoint::Http(HttpUrl::parse(&format!("http://{addr}{path}")).unwrap())
    }

    fn cfg(max_concurrent_scrapes: u32) -> TelemetryConfig {
        TelemetryConfig {
            scrape_interval: Duration::from_millis(200),
            scrape_timeout: Duration::from_millis(150),
            // Long enough that one slow round on a loaded machine does not make a test flap.
            stale_after: Duration::from_secs(2),
            max_concurrent_scrapes,
        }
    }

    /// Runs the scraper until `done` holds for the hub's views of `keys` (or 5 s pass).
    async fn scrape_until(
        targets: Vec<Target>,
        cfg: TelemetryConfig,
        keys: &[BackendKey],
        done: impl Fn(&[BackendTelemetry]) -> bool,
    ) -> Vec<BackendTelemetry> {
        let mut hub = Hub::new(cfg.stale_after);
        for t in &targets {
            hub.configure(t.key.clone(), [t.source()].into());
        }
        let hub = Arc::new(Mutex::new(hub));
        let (stop, stopped) = oneshot::channel::<()>();
        let task = tokio::spawn(run(targets, hub.clone(), cfg, Instant::now(), async {
            let _ = stopped.await;
        }));
        let deadline = Instant::now() + Duration::from_secs(5);
        let views = loop {
            let views: Vec<_> = {
                let hub = hub.lock().unwrap();
                keys.iter().map(|k| hub.view(k, Instant::now())).collect()
            };
            if done(&views) || Instant::now() > deadline {
                break views;
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        };
        stop.send(()).unwrap();
        tokio::time::timeout(Duration::from_secs(2), task)
            .await
            .expect("run stops on shutdown")
            .unwrap();
        views
    }

    #[test]
    fn rounds_keep_one_schedule_from_the_epoch() {
        let (epoch, p) = (Instant::now(), Duration::from_secs(1));
        let ms = |n: u64| epoch + Duration::from_millis(n);
        assert_eq!(round_at(epoch, p, epoch), epoch);
        assert_eq!(round_at(epoch, p, ms(1)), ms(1000));
        assert_eq!(round_at(epoch, p, ms(1000)), ms(1000));
        assert_eq!(round_at(epoch, p, ms(2500)), ms(3000));
        assert_eq!(
            round_at(epoch, Duration::from_millis(300), ms(1000)),
            ms(1200)
        );
    }

    #[tokio::test]
    async fn scrapes_fixtures_into_the_hub() {
        let (addr, stats) = serve(routes).await;
        let targets = vec![
            Target {
                key: key(1),
                endpoint: http(addr, "/dcgm"),
                reader: Reader::Dcgm {
                    gpus: vec!["2".into()],
                    uuids: vec![],
                },
            },
            Target {
                key: key(1),
                endpoint: http(addr, "/vllm"),
                reader: Reader::Engine {
                    kind: EngineKind::Vllm,
                    model: None,
                },
            },
            // Two backends sharing one exporter page: fetched once per round.
            Target {
                key: key(2),
                endpoint: http(addr, "/dcgm"),
                reader: Reader::Dcgm {
                    gpus: vec![],
                    uuids: vec![],
                },
            },
            Target {
                key: key(1),
                endpoint: http(addr, "/node"),
                reader: Reader::RoceExporter {
                    device: "mlx5_0".into(),
                    port: "1".into(),
                },
            },
        ];
        let views = scrape_until(targets, cfg(16), &[key(1), key(2)], |v| {
            // The RoCE part needs two readings.
            v[0].sample.ecn_rate.is_some() && v.iter().all(|v| !v.stale && v.errors.is_empty())
        })
        .await;
        let (one, two) = (&views[0], &views[1]);
        assert_eq!(one.errors, Vec::<String>::new());
        assert!(!one.stale, "{one:?}");
        assert_eq!(one.sample.gpu_util, Some(0.45));
        assert_eq!(one.sample.queue_depth, Some(7.0));
        assert_eq!(one.sample.kv_cache, Some(0.8125));
        // The fixture does not change between scrapes.
        assert_eq!(
            (one.sample.ecn_rate, one.sample.cnp_rate),
            (Some(0.0), Some(0.0))
        );
        assert_eq!(two.sample.gpu_util, Some(0.92));
        // Keep-alive: connections are reused across rounds (one per endpoint unless a round
        // timed out).
        let requests = stats.requests.load(Ordering::SeqCst);
        let connections = stats.connections.load(Ordering::SeqCst);
        assert!(requests >= 6, "{requests} requests");
        assert!(
            connections >= 3 && connections < requests,
            "{connections} connections"
        );
    }

    #[tokio::test]
    async fn failures_are_recorded_not_fatal() {
        let (addr, _) = serve(routes).await;
        let target = |n, path: &str| Target {
            key: key(n),
            endpoint: http(addr, path),
            reader: Reader::Engine {
                kind: EngineKind::Vllm,
                model: None,
            },
        };
        let targets = vec![
            target(1, "/slow"),
            target(2, "/error"),
            target(3, "/garbage"),
            target(4, "/huge"),
            target(5, "/vllm"),
            Target {
                key: key(6),
                endpoint: Endpoint::Http(HttpUrl::parse("http://127.0.0.1:1/metrics").unwrap()),
                reader: Reader::Dcgm {
                    gpus: vec![],
                    uuids: vec![],
                },
            },
        ];
        let keys: Vec<_> = (1..=6).map(key).collect();
        // Time enough to move the 8 MiB body on a loaded test machine; "/slow" takes 5 s.
        let slow = TelemetryConfig {
            scrape_interval: Duration::from_secs(2),
            scrape_timeout: Duration::from_millis(1500),
            stale_after: Duration::from_secs(4),
            max_concurrent_scrapes: 16,
        };
        let views = scrape_until(targets, slow, &keys, |v| {
            v.iter()
                .enumerate()
                .all(|(i, v)| (i == 4) == v.errors.is_empty())
        })
        .await;
        let err = |i: usize| views[i].errors.first().cloned().unwrap_or_default();
        assert!(
            err(0).starts_with("engine: no complete response within 1.5s"),
            "{}",
            err(0)
        );
        assert!(
            err(1).starts_with("engine: HTTP 500 Internal Server Error"),
            "{}",
            err(1)
        );
        assert!(
            err(2).starts_with("engine: bad page: line 1: expected `,` or `}`"),
            "{}",
            err(2)
        );
        assert!(
            err(3).starts_with("engine: response body is over 8388608 bytes"),
            "{}",
            err(3)
        );
        assert!(
            err(5).starts_with("dcgm: connect to 127.0.0.1:1:"),
            "{}",
            err(5)
        );
        // Failures alone make a backend stale only `stale_after` after the first one (the
        // hub's tests pin that down on a simulated clock); the healthy one is fresh.
        assert!(!views[4].stale, "{:?}", views[4]);
        assert_eq!(views[4].sample.queue_depth, Some(7.0));
    }

    #[tokio::test]
    async fn at_most_max_concurrent_scrapes() {
        let (addr, stats) = serve(routes).await;
        let targets: Vec<Target> = (1..=6)
            .map(|n| Target {
                key: key(n),
                endpoint: http(addr, &format!("/delay{n}")),
                reader: Reader::Engine {
                    kind: EngineKind::Vllm,
                    model: None,
                },
            })
            .collect();
        let keys: Vec<_> = (1..=6).map(key).collect();
        let views = scrape_until(targets, cfg(2), &keys, |v| v.iter().all(|v| !v.stale)).await;
        assert!(views.iter().all(|v| !v.stale), "{views:?}");
        assert_eq!(stats.max_in_flight.load(Ordering::SeqCst), 2);
    }

    #[tokio::test]
    async fn sysfs_counters_become_rates() {
        let dir = crate::test_dir::TestDir::new("scrape-roce");
        std::fs::write(dir.join("np_ecn_marked_roce_packets"), "0\n").unwrap();
        std::fs::write(dir.join("np_cnp_sent"), "0\n").unwrap();
        let targets = vec![Target {
            key: key(1),
            endpoint: Endpoint::Sysfs(dir.to_path_buf()),
            reader: Reader::RoceSysfs,
        }];
        // Counters that keep growing: each round sees a positive rate once the writer moves.
        let writer_dir = dir.to_path_buf();
        let writer = tokio::spawn(async move {
            for i in 1..=100u64 {
                tokio::time::sleep(Duration::from_millis(25)).await;
                let _ = std::fs::write(
                    writer_dir.join("np_ecn_marked_roce_packets"),
                    format!("{}\n", i * 100),
                );
            }
        });
        let views = scrape_until(targets, cfg(4), &[key(1)], |v| {
            v[0].sample.ecn_rate.is_some_and(|r| r > 0.0) && v[0].errors.is_empty()
        })
        .await;
        writer.abort();
        let s = &views[0].sample;
        assert!(s.ecn_rate.is_some_and(|r| r > 0.0), "{s:?}");
        assert_eq!(s.cnp_rate, Some(0.0));
        assert_eq!(views[0].errors, Vec::<String>::new());
    }

    #[test]
    fn a_first_counter_reading_is_an_empty_part_not_nothing() {
        let mut w = Watched {
            target: Target {
                key: key(1),
                endpoint: Endpoint::Sysfs("/sys/x".into()),
                reader: Reader::RoceSysfs,
            },
            rates: RateTracker::default(),
            tpot: engine::TpotTracker::default(),
            failing: false,
        };
        let counters = Counters::from([("np_ecn_marked_roce_packets", 10.0)]);
        let t0 = Instant::now();
        let first = part(&mut w, &Parsed::Counters(&counters), t0).unwrap();
        assert_eq!(first, Some(Sample::default()));
        let later = Counters::from([("np_ecn_marked_roce_packets", 110.0)]);
        let second = part(
            &mut w,
            &Parsed::Counters(&later),
            t0 + Duration::from_secs(1),
        );
        assert_eq!(second.unwrap().unwrap().ecn_rate, Some(100.0));
    }

    #[test]
    fn a_reader_on_the_wrong_endpoint_is_an_error() {
        let mut w = Watched {
            target: Target {
                key: key(1),
                endpoint: Endpoint::Sysfs("/sys/x".into()),
                reader: Reader::Engine {
                    kind: EngineKind::Sglang,
                    model: None,
                },
            },
            rates: RateTracker::default(),
            tpot: engine::TpotTracker::default(),
            failing: false,
        };
        let counters = Counters::new();
        let e = part(&mut w, &Parsed::Counters(&counters), Instant::now()).unwrap_err();
        assert_eq!(e, "Engine { kind: Sglang, model: None } cannot read /sys/x");
        assert_eq!(w.target.source(), Source::Engine);
    }
}
