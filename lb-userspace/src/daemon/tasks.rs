//! The daemon's background tasks that a reload restarts or hands new settings: the
//! telemetry scrapers, the health checks and the steering ticker.

use std::{future::Future, sync::Arc, time::Instant};

use tokio::{
    sync::{watch, Mutex},
    task::JoinHandle,
};

use crate::{
    admin::DaemonInfo,
    apply::MapPlane,
    clock::now_ms,
    config::{self, Config},
    controller::Controller,
    policy::Policy,
    scheduler, scrape,
    telemetry::{self, Hub},
};

/// A task a reload restarts with new settings; it has its own stop signal.
pub(super) struct Restartable {
    stop: watch::Sender<bool>,
    task: JoinHandle<()>,
}

impl Restartable {
    pub(super) fn spawn<F>(make: impl FnOnce(Stopped) -> F) -> Restartable
    where
        F: Future<Output = ()> + Send + 'static,
    {
        let (stop, rx) = watch::channel(false);
        Restartable {
            stop,
            task: tokio::spawn(make(stopped(rx))),
        }
    }

    pub(super) async fn stop(self) {
        let _ = self.stop.send(true);
        let _ = self.task.await;
    }
}

pub(super) type Stopped = std::pin::Pin<Box<dyn Future<Output = ()> + Send>>;

pub(super) fn stopped(mut rx: watch::Receiver<bool>) -> Stopped {
    Box::pin(async move {
        let _ = rx.wait_for(|s| *s).await;
    })
}

/// The parts of the daemon that follow `[health]`, `[telemetry]`, `[policy]` and the
/// VIPs' telemetry sources, and that a SIGHUP reload hands new settings.
pub(super) struct Live {
    pub(super) cfg: Arc<Config>,
    pub(super) scraper: Restartable,
    pub(super) health: Restartable,
    /// The steering ticker reads its settings from here at every tick, keeping the policy's
    /// per-backend memory across a reload.
    pub(super) settings: watch::Sender<Arc<Config>>,
}

/// Starts the scrapers for `targets` and configures the hub for `cfg`'s sources.
pub(super) fn start_scraper(
    cfg: &Arc<Config>,
    targets: Vec<telemetry::target::Target>,
    hub: &Arc<std::sync::Mutex<Hub>>,
    epoch: Instant,
) -> Restartable {
    {
        let mut h = hub.lock().expect("telemetry hub lock");
        h.set_stale_after(cfg.telemetry.stale_after);
        let sources = telemetry::target::sources(cfg);
        h.retain(|k| sources.contains_key(k));
        for (key, sources) in sources {
            h.configure(key, sources);
        }
    }
    let (hub, tcfg) = (hub.clone(), cfg.telemetry.clone());
    Restartable::spawn(move |stop| scrape::run(targets, hub, tcfg, epoch, stop))
}

pub(super) fn start_health(
    cfg: &Arc<Config>,
    ctl: &Arc<Mutex<Controller<MapPlane>>>,
    epoch: Instant,
) -> Restartable {
    let (ctl, cfg) = (ctl.clone(), cfg.clone());
    Restartable::spawn(move |stop| scheduler::run_health(ctl, cfg, epoch, stop))
}

/// Drains and the adaptive policy step together, once per telemetry interval.
pub(super) fn start_ticker(
    settings: watch::Receiver<Arc<Config>>,
    ctl: &Arc<Mutex<Controller<MapPlane>>>,
    hub: &Arc<std::sync::Mutex<Hub>>,
    info: &Arc<DaemonInfo>,
    epoch: Instant,
) -> Restartable {
    let (ctl, hub, info) = (ctl.clone(), hub.clone(), info.clone());
    Restartable::spawn(move |mut stop| async move {
        let mut settings = settings;
        let cfg = settings.borrow_and_update().clone();
        let mut policy = Policy::new(cfg.policy.clone());
        let mut inband = telemetry::inband::Tracker::default();
        let mut rst = cfg.policy.shed == Some(config::ShedMode::Rst);
        // Steps tick with the scrape rounds ([`scrape::rounds`]) and each waits
        // for its round to report (at most scrape_timeout), so the policy decides on
        // telemetry milliseconds old. Stepping on a tick of its own would race the round's
        // scrapes and lose, deciding every time on telemetry a whole period old. The first
        // step is on the first round after the start, not at once: stepping before any round
        // would see every scraped backend as stale ("never scraped") and move half of each
        // pool away for a cooldown and a slow start at every daemon start.
        let rounds = |period| scrape::rounds(epoch, period);
        let mut period = cfg.telemetry.scrape_interval;
        let mut timeout = cfg.telemetry.scrape_timeout;
        let mut every = rounds(period);
        loop {
            let round = tokio::select! {
                t = every.tick() => t.into_std(),
                _ = &mut stop => break,
            };
            if settings.has_changed().unwrap_or(false) {
                let cfg = settings.borrow_and_update().clone();
                policy.set_config(cfg.policy.clone());
                rst = cfg.policy.shed == Some(config::ShedMode::Rst);
                timeout = cfg.telemetry.scrape_timeout;
                if cfg.telemetry.scrape_interval != period {
                    period = cfg.telemetry.scrape_interval;
                    every = rounds(period);
                }
            }
            tokio::select! {
                _ = scrape::round_in(&hub, round, round + timeout) => {}
                _ = &mut stop => break,
            }
            let started = Instant::now();
            if let Err(e) = ctl.lock().await.tick(now_ms()) {
                tracing::error!(error = %format!("{e:#}"), "drain check failed");
            }
            let step = scheduler::step(&ctl, &hub, &mut policy, &mut inband, rst, epoch.elapsed());
            if let Err(e) = step.await {
                tracing::error!(error = %format!("{e:#}"), "steering step failed");
            }
            // Drains and the policy step together (the metric the reads bench reads).
            let took = started.elapsed().as_nanos().max(1) as u64;
            info.policy_step_ns
                .store(took, std::sync::atomic::Ordering::Relaxed);
        }
    })
}
