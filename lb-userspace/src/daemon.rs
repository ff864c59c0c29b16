//! `sluice run`: the daemon shell. Loads (or re-adopts) the pinned data plane, attaches it,
//! restores state, then serves the admin socket and metrics until a signal.

use std::{
    collections::hash_map::DefaultHasher,
    ffi::CString,
    hash::{Hash, Hasher},
    path::{Path, PathBuf},
    sync::Arc,
    time::Instant,
};

use anyhow::{anyhow, bail, Context, Result};
use aya::programs::XdpMode;
use tokio::{signal::unix::SignalKind, sync::Mutex};

use crate::{
    admin::{self, now_ms, AdminSocket, DaemonInfo},
    apply::MapPlane,
    config::{self, Config},
    controller::{Controller, Persisted, Settings},
    dataplane::{remove_pinned, Dataplane, LoadOptions, PROG_XDP},
    metrics,
    object::BPF_OBJECT,
    policy::Policy,
    state::{BackendSpec, FlowState, HashMode, Limits, Protocol, State, VipSpec},
    steering,
    telemetry::{self, Hub},
};

/// The VIPs and backends a configuration asks for.
pub fn specs(cfg: &Config) -> Vec<(VipSpec, Vec<BackendSpec>)> {
    cfg.vips
        .iter()
        .map(|v| {
            let spec = VipSpec {
                name: v.name.clone(),
                address: v.address,
                port: v.port,
                protocol: match v.protocol {
                    config::Protocol::Tcp => Protocol::Tcp,
                    config::Protocol::Udp => Protocol::Udp,
                },
                hash: match v.hash {
                    config::HashMode::FiveTuple => HashMode::FiveTuple,
                    config::HashMode::Source => HashMode::Source,
                },
                affinity_secs: v.affinity_window.as_secs() as u32,
                priority: v.priority.into(),
                ring_size: v.ring_size,
                flow_state: match v.flow_state {
                    config::FlowState::Table => FlowState::Table,
                    config::FlowState::SecondChance => FlowState::SecondChance,
                },
            };
            let backends = v
                .backends
                .iter()
                .map(|b| BackendSpec {
                    address: b.address,
                    weight: b.weight,
                    labels: b.labels.clone(),
                    max_sessions: b.max_sessions,
                })
                .collect();
            (spec, backends)
        })
        .collect()
}

fn config_hash(text: &str) -> u64 {
    let mut h = DefaultHasher::new();
    text.hash(&mut h);
    h.finish()
}

fn init_logging(cfg: &Config) {
    let filter = tracing_subscriber::EnvFilter::try_from_default_env()
        .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new(cfg.daemon.log_level.to_string()));
    let builder = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(std::io::stderr);
    let _ = if cfg.daemon.log_format == config::LogFormat::Json {
        builder.json().try_init()
    } else {
        builder.try_init()
    };
}

fn ifindex(name: &str) -> Result<u32> {
    let c = CString::new(name).map_err(|_| anyhow!("interface name {name:?} contains NUL"))?;
    // SAFETY: a valid C string.
    match unsafe { libc::if_nametoindex(c.as_ptr()) } {
        0 => bail!("interface {name:?} does not exist in this network namespace (see `ip link`)"),
        i => Ok(i),
    }
}

/// Attaches to every configured interface; returns (name, mode used).
fn attach(dp: &mut Dataplane, cfg: &Config, pin_dir: &Path) -> Result<Vec<(String, String)>> {
    let mut out = vec![];
    for itf in &cfg.dataplane.interfaces {
        let idx = ifindex(&itf.name)?;
        let pin = pin_dir.join(format!("link_{}", itf.name));
        let modes: &[(XdpMode, &str)] = match itf.mode {
            config::AttachMode::Native => &[(XdpMode::Driver, "native")],
            config::AttachMode::Generic => &[(XdpMode::Skb, "generic")],
            config::AttachMode::Auto => &[(XdpMode::Driver, "native"), (XdpMode::Skb, "generic")],
        };
        let mut last = None;
        for (mode, label) in modes {
            match dp.attach_pinned(PROG_XDP, idx, *mode, &pin) {
                Ok(replaced) => {
                    tracing::info!(interface = %itf.name, mode = label, replaced, "XDP attached");
                    out.push((itf.name.clone(), label.to_string()));
                    last = None;
                    break;
                }
                Err(e) => {
                    tracing::warn!(interface = %itf.name, mode = label, error = %format!("{e:#}"), "attach failed");
                    last = Some(e);
                }
            }
        }
        if let Some(e) = last {
            return Err(e.context(match itf.mode {
                config::AttachMode::Native => format!(
                    "native XDP is not supported on {} (driver without XDP?): use mode = \"generic\" or \"auto\"",
                    itf.name
                ),
                _ => format!("cannot attach XDP to {}", itf.name),
            }));
        }
        dp.add_tx_port(idx)?;
    }
    Ok(out)
}

fn read_persisted(path: &Path) -> Option<Persisted> {
    let bytes = std::fs::read(path).ok()?;
    match serde_json::from_slice::<Persisted>(&bytes) {
        Ok(p) if p.layout == lb_common::LAYOUT_VERSION => Some(p),
        Ok(p) => {
            tracing::warn!(path = %path.display(), layout = p.layout, "ignoring state of another layout");
            None
        }
        Err(e) => {
            tracing::warn!(path = %path.display(), error = %e, "ignoring unreadable state file");
            None
        }
    }
}

pub async fn run(config_path: &Path) -> Result<()> {
    let text = std::fs::read_to_string(config_path)
        .with_context(|| format!("reading {}", config_path.display()))?;
    let (cfg, warnings) = config::parse_with_warnings(&text, &config_path.display().to_string())
        .map_err(|e| anyhow!("{e}"))?;
    init_logging(&cfg);
    for w in warnings {
        tracing::warn!("{w}");
    }
    let hash = config_hash(&text);
    let pin_dir = cfg.daemon.bpffs.clone();
    let limits = Limits {
        max_vips: cfg.dataplane.max_vips,
    };

    let opts = LoadOptions {
        conn_table_size: cfg.dataplane.conn_table_size,
        affinity_table_size: cfg.dataplane.affinity_table_size,
        max_vips: cfg.dataplane.max_vips,
        pin_dir: Some(pin_dir.clone()),
    };
    let mut dp = Dataplane::load(BPF_OBJECT, &opts)?;
    let persisted = read_persisted(&cfg.daemon.state_file);
    // What the maps hold now: the persisted state if we re-adopt pinned maps.
    let in_plane = match (&persisted, dp.reused()) {
        (Some(p), true) => p.state.clone(),
        (None, true) => {
            tracing::warn!(
                "pinned maps found without a state file: rewriting them from the configuration"
            );
            State::default()
        }
        _ => State::default(),
    };
    let base = persisted
        .as_ref()
        .map(|p| p.state.clone())
        .unwrap_or_default();
    let desired = match &persisted {
        Some(p) if p.config_hash == hash => {
            tracing::info!(
                vips = p.state.vips.len(),
                "restoring state (config plus runtime changes)"
            );
            p.state.clone()
        }
        _ => base
            .with_specs(&specs(&cfg), &limits)
            .map_err(|e| anyhow!("configuration: {e}"))?,
    };
    dp.set_config(&cfg.dataplane.lb_config())?;
    let interfaces = attach(&mut dp, &cfg, &pin_dir)?;
    let reused = dp.reused();
    tracing::info!(reused, pin_dir = %pin_dir.display(), "data plane ready");

    let settings = Settings {
        limits,
        seed: cfg.dataplane.hash_seed,
        flow_idle: cfg.dataplane.flow_idle_timeout,
        state_file: Some(cfg.daemon.state_file.clone()),
        audit_log: Some(cfg.admin.audit_log.clone()),
        config_hash: hash,
    };
    let plane = MapPlane::new(dp, cfg.dataplane.hash_seed);
    let ctl = Arc::new(Mutex::new(Controller::new(
        desired, &in_plane, plane, settings,
    )?));
    let hub = Arc::new(std::sync::Mutex::new(Hub::new(cfg.telemetry.stale_after)));
    {
        let mut h = hub.lock().expect("telemetry hub lock");
        for (key, sources) in telemetry::target::sources(&cfg) {
            h.configure(key, sources);
        }
    }
    let targets = telemetry::target::targets(&cfg).map_err(|e| anyhow!("telemetry: {e}"))?;
    let info = Arc::new(DaemonInfo {
        version: env!("CARGO_PKG_VERSION").to_string(),
        started: Instant::now(),
        interfaces,
        pin_dir: pin_dir.display().to_string(),
        reused,
        telemetry: hub.clone(),
    });
    let cfg = Arc::new(cfg);

    let (stop_tx, stop_rx) = tokio::sync::watch::channel(false);
    let stopped = |mut rx: tokio::sync::watch::Receiver<bool>| async move {
        let _ = rx.wait_for(|s| *s).await;
    };
    let listener = admin::bind(&AdminSocket {
        path: cfg.admin.socket.clone(),
        mode: cfg.admin.mode.bits(),
        group: cfg.admin.group.clone(),
    })?;
    tracing::info!(socket = %cfg.admin.socket.display(), "admin API listening");
    let admin_task = tokio::spawn(admin::serve(
        listener,
        ctl.clone(),
        info.clone(),
        stopped(stop_rx.clone()),
    ));
    let metrics_task = match cfg.metrics.enabled.then_some(cfg.metrics.listen) {
        Some(addr) => {
            tracing::info!(%addr, "metrics listening");
            Some(tokio::spawn(metrics::serve(
                addr,
                ctl.clone(),
                info.clone(),
                stopped(stop_rx.clone()),
            )))
        }
        None => None,
    };
    let epoch = Instant::now();
    let scraper = tokio::spawn(telemetry::scrape::run(
        targets,
        hub.clone(),
        cfg.telemetry.clone(),
        stopped(stop_rx.clone()),
    ));
    let health = tokio::spawn(steering::run_health(
        ctl.clone(),
        cfg.clone(),
        epoch,
        stopped(stop_rx.clone()),
    ));
    // Drains and the adaptive policy step together, once per telemetry interval.
    let ticker = {
        let (ctl, hub, cfg) = (ctl.clone(), hub.clone(), cfg.clone());
        let mut rx = stop_rx.clone();
        tokio::spawn(async move {
            let mut policy = Policy::new(cfg.policy.clone());
            let rst = cfg.policy.shed == config::ShedMode::Rst;
            // The first step comes one interval after the start, not at once: by then the
            // scrapers' first round (bounded by scrape_timeout < scrape_interval) has
            // reported. Stepping at once would see every scraped backend as stale ("never
            // scraped") and move half of each pool away for a cooldown and a slow start at
            // every daemon start and restart.
            let period = cfg.telemetry.scrape_interval;
            let mut every = tokio::time::interval_at(tokio::time::Instant::now() + period, period);
            every.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
            loop {
                tokio::select! {
                    _ = every.tick() => {}
                    _ = rx.wait_for(|s| *s) => break,
                }
                if let Err(e) = ctl.lock().await.tick(now_ms()) {
                    tracing::error!(error = %format!("{e:#}"), "drain check failed");
                }
                if let Err(e) = steering::step(&ctl, &hub, &mut policy, rst, epoch.elapsed()).await
                {
                    tracing::error!(error = %format!("{e:#}"), "steering step failed");
                }
            }
        })
    };

    let mut term = tokio::signal::unix::signal(SignalKind::terminate())?;
    let mut int = tokio::signal::unix::signal(SignalKind::interrupt())?;
    let mut hup = tokio::signal::unix::signal(SignalKind::hangup())?;
    loop {
        tokio::select! {
            _ = term.recv() => break,
            _ = int.recv() => break,
            _ = hup.recv() => reload(config_path, &ctl).await,
        }
    }
    tracing::info!("stopping");
    let _ = stop_tx.send(true);
    let _ = admin_task.await;
    if let Some(t) = metrics_task {
        let _ = t.await;
    }
    let _ = ticker.await;
    let _ = health.await;
    let _ = scraper.await;
    let _ = std::fs::remove_file(&cfg.admin.socket);
    // Drop the maps and programs before unpinning, so nothing of ours holds them.
    drop(ctl);
    if cfg.daemon.keep_dataplane_on_exit {
        tracing::info!(pin_dir = %pin_dir.display(), "keeping the data plane running (keep_dataplane_on_exit)");
    } else {
        remove_pinned(&pin_dir)?;
        tracing::info!("data plane detached and unpinned");
    }
    Ok(())
}

/// SIGHUP: re-read the configuration; a bad file changes nothing.
async fn reload(path: &Path, ctl: &Arc<Mutex<Controller<MapPlane>>>) {
    let text = match std::fs::read_to_string(path) {
        Ok(t) => t,
        Err(e) => {
            return tracing::error!(path = %path.display(), error = %e, "reload: cannot read config")
        }
    };
    let cfg = match config::parse(&text, &path.display().to_string()) {
        Ok(c) => c,
        Err(e) => {
            return tracing::error!(error = %e, "reload: configuration rejected, nothing changed")
        }
    };
    match ctl
        .lock()
        .await
        .reload(&specs(&cfg), config_hash(&text), now_ms())
    {
        Ok(()) => tracing::info!(vips = cfg.vips.len(), "configuration reloaded"),
        Err(e) => tracing::error!(error = %e, "reload refused, nothing changed"),
    }
}

/// Default pin directory, for `sluice cleanup`.
pub fn default_pin_dir() -> PathBuf {
    PathBuf::from("/sys/fs/bpf/sluice")
}
