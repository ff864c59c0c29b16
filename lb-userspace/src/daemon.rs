//! `sluice run`: the daemon shell. Loads (or re-adopts) the pinned data plane, attaches it,
//! restores state, then serves the admin socket and metrics until a signal.

mod tasks;

use std::{
    collections::hash_map::DefaultHasher,
    ffi::CString,
    hash::{Hash, Hasher},
    path::{Path, PathBuf},
    sync::Arc,
    time::Instant,
};

use anyhow::{anyhow, bail, Context, Result};
use aya::programs::{ProgramFd, XdpMode};
use lb_common::LbConfig;
use tokio::{
    signal::unix::SignalKind,
    sync::{watch, Mutex},
    task::JoinHandle,
};

use self::tasks::{start_health, start_scraper, start_ticker, stopped, Live, Restartable};
use crate::{
    admin::{self, AdminSocket, DaemonInfo},
    apply::MapPlane,
    check::{check_file, Checked},
    clock::now_ms,
    config::{self, Config},
    controller::{Controller, HashKind, Persisted, Plane, Settings},
    dataplane::{relink, remove_pinned, Dataplane, LoadOptions, PROG_XDP},
    fleet, limits, metrics, notify,
    object::BPF_OBJECT,
    policy::Policy,
    ring_store,
    state::{specs, Limits, State},
    telemetry::{self, Hub},
};

/// 64-bit FNV-1a over the configuration's bytes: a fixed function, so a state file written
/// by one build is recognised by the next (Rust's `DefaultHasher` makes no such promise).
pub fn config_hash(text: &str) -> u64 {
    text.bytes().fold(0xcbf2_9ce4_8422_2325, |h, b| {
        (h ^ u64::from(b)).wrapping_mul(0x0000_0100_0000_01b3)
    })
}

/// Whether `p` was built from the configuration `text`. Files written before the hash was
/// FNV-1a hold a `DefaultHasher` value: it is recomputed with this build's, which matches
/// across an upgrade as long as Rust has not changed that hasher; when it has, the file is
/// merged like one of a changed configuration (drains and ids kept, other runtime changes
/// replaced by the file's), and a warning says so.
fn same_config(p: &Persisted, text: &str, path: &Path) -> bool {
    match p.hash {
        HashKind::Fnv1a => p.config_hash == config_hash(text),
        HashKind::Legacy => {
            let mut h = DefaultHasher::new();
            text.hash(&mut h);
            let same = p.config_hash == h.finish();
            if !same {
                tracing::warn!(
                    path = %path.display(),
                    "the state file predates stable config hashes and does not match this \
                     configuration (changed, or hashed differently by an older build): runtime \
                     changes other than drains are replaced by the configuration"
                );
            }
            same
        }
    }
}

pub(crate) fn init_logging(level: config::LogLevel, format: config::LogFormat) {
    let filter = tracing_subscriber::EnvFilter::try_from_default_env()
        .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new(level.to_string()));
    let builder = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(std::io::stderr);
    let _ = if format == config::LogFormat::Json {
        builder.json().try_init()
    } else {
        builder.try_init()
    };
}

pub(crate) fn ifindex(name: &str) -> Result<u32> {
    let c = CString::new(name).map_err(|_| anyhow!("interface name {name:?} contains NUL"))?;
    // SAFETY: a valid C string.
    match unsafe { libc::if_nametoindex(c.as_ptr()) } {
        0 => bail!("interface {name:?} does not exist in this network namespace (see `ip link`)"),
        i => Ok(i),
    }
}

/// One change a start made to a data plane it re-adopted, taken back if the start fails
/// later ([`undo`]).
pub(crate) enum Undo {
    /// The global settings the data plane held.
    Config(LbConfig),
    /// A link this start created and pinned.
    NewLink(PathBuf),
    /// A pinned link whose program this start replaced, and that program.
    Relinked(PathBuf, ProgramFd),
    /// An egress interface this start added.
    TxPort(u32),
}

/// Takes back `steps`, last first. Each is tried: one that fails is logged and the others
/// still go back.
pub(crate) fn undo(dp: &mut Dataplane, steps: Vec<Undo>) {
    for step in steps.into_iter().rev() {
        let r = match &step {
            Undo::Config(c) => dp.set_config(c),
            Undo::NewLink(pin) => std::fs::remove_file(pin)
                .with_context(|| format!("unpinning the new link {}", pin.display())),
            Undo::Relinked(pin, prog) => relink(pin, prog),
            Undo::TxPort(idx) => dp.remove_tx_port(*idx),
        };
        if let Err(e) = r {
            tracing::error!(error = %format!("{e:#}"), "undoing a failed start");
        }
    }
}

/// Attaches `prog` to every interface through a link pinned in `pin_dir` (`link_<name>`),
/// replacing the program of a link an earlier run pinned; returns (name, ifindex, mode used)
/// and records in `undone` how to take each attachment back.
pub(crate) fn attach_interfaces(
    dp: &mut Dataplane,
    prog: &str,
    interfaces: &[config::InterfaceConfig],
    pin_dir: &Path,
    undone: &mut Vec<Undo>,
) -> Result<Vec<(String, u32, String)>> {
    let mut out = vec![];
    for itf in interfaces {
        let idx = ifindex(&itf.name)?;
        let pin = pin_dir.join(format!("link_{}", itf.name));
        // The program a pinned link runs now, to give back if the start fails later.
        let mut previous = match pin.exists() {
            true => Some(Dataplane::linked_program(&pin)?),
            false => None,
        };
        let modes: &[(XdpMode, &str)] = match itf.mode {
            config::AttachMode::Native => &[(XdpMode::Driver, "native")],
            config::AttachMode::Generic => &[(XdpMode::Skb, "generic")],
            config::AttachMode::Auto => &[(XdpMode::Driver, "native"), (XdpMode::Skb, "generic")],
        };
        let mut last = None;
        for (mode, label) in modes {
            match dp.attach_pinned(prog, idx, *mode, &pin) {
                Ok(replaced) => {
                    tracing::info!(interface = %itf.name, program = prog, mode = label, replaced, "XDP attached");
                    undone.push(match previous.take() {
                        Some(p) if replaced => Undo::Relinked(pin.clone(), p),
                        _ => Undo::NewLink(pin.clone()),
                    });
                    out.push((itf.name.clone(), idx, label.to_string()));
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
    }
    Ok(out)
}

/// Writes the global settings and attaches the steering program to every configured
/// interface, each also an egress port for XDP_REDIRECT; returns (name, mode used) and
/// records in `undone` how to take each change back.
fn take_over(
    dp: &mut Dataplane,
    cfg: &Config,
    pin_dir: &Path,
    undone: &mut Vec<Undo>,
) -> Result<Vec<(String, String)>> {
    let previous = dp.config()?;
    dp.set_config(&cfg.dataplane.lb_config())?;
    undone.push(Undo::Config(previous));
    let mut out = vec![];
    let attached = attach_interfaces(dp, PROG_XDP, &cfg.dataplane.interfaces, pin_dir, undone)?;
    for (name, idx, mode) in attached {
        if !dp.has_tx_port(idx)? {
            dp.add_tx_port(idx)?;
            undone.push(Undo::TxPort(idx));
        }
        out.push((name, mode));
    }
    Ok(out)
}

/// A file removed when dropped: the admin socket goes with the daemon, also when its start
/// fails after the socket was bound.
struct RemovedOnDrop(PathBuf);

impl Drop for RemovedOnDrop {
    fn drop(&mut self) {
        let _ = std::fs::remove_file(&self.0);
    }
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

/// Undoes what a failed start did to the data plane: armed once the load succeeded, it acts
/// when dropped on an early return. A data plane this start created is detached and unpinned, as if the start
/// had not happened (`keep_dataplane_on_exit` is for a daemon that ran, not one that never
/// served). One re-adopted from pinned maps was forwarding before this start and keeps
/// forwarding.
struct Rollback {
    pin_dir: PathBuf,
    created: bool,
    armed: bool,
}

impl Drop for Rollback {
    fn drop(&mut self) {
        if !self.armed {
            return;
        }
        if !self.created {
            tracing::warn!(pin_dir = %self.pin_dir.display(), "start failed; the re-adopted data plane keeps running as the previous daemon left it");
            return;
        }
        match remove_pinned(&self.pin_dir) {
            Ok(()) => {
                tracing::warn!(pin_dir = %self.pin_dir.display(), "start failed; the data plane it attached is detached and unpinned")
            }
            Err(e) => {
                tracing::error!(pin_dir = %self.pin_dir.display(), error = %format!("{e:#}"), "start failed and the data plane could not be removed: run `sluice cleanup`")
            }
        }
    }
}

/// `sluice run`: prepares what can fail without the data plane, then loads and applies it
/// (undone if that fails), serves until SIGTERM or SIGINT and shuts down.
pub async fn run(config_path: &Path) -> Result<()> {
    let mut p = prepare(config_path)?;
    // The admin socket's file goes when `run` returns, whether the start failed or not.
    let _socket_file = p.listeners.socket_file;
    let started = load_and_apply(&p.cfg, p.hash, p.persisted.as_ref(), p.desired, p.limits)?;
    let (admin, metrics) = (p.listeners.admin, p.listeners.metrics);
    let (serving, live) = serve(p.cfg, started, admin, metrics, p.targets, p.fleet);
    // The data plane is attached and the admin socket accepts: a Type=notify unit is up.
    notify::ready("steering");
    let live = wait_for_signals(&mut p.signals, config_path, &serving, live).await;
    shut_down(serving, live).await
}

/// The signals the daemon answers, registered before the data plane is touched.
struct Signals {
    term: tokio::signal::unix::Signal,
    int: tokio::signal::unix::Signal,
    hup: tokio::signal::unix::Signal,
}

/// The admin socket and metrics port, bound before anything is loaded.
struct Listeners {
    admin: tokio::net::UnixListener,
    socket_file: RemovedOnDrop,
    metrics: Option<(std::net::SocketAddr, tokio::net::TcpListener)>,
}

/// What a start checks, binds and decides before it touches the data plane.
struct Prepared {
    cfg: Config,
    hash: u64,
    signals: Signals,
    targets: Vec<telemetry::target::Target>,
    fleet: Option<Arc<fleet::Fleet<fleet::gateway::Gateway>>>,
    listeners: Listeners,
    persisted: Option<Persisted>,
    /// The state this start runs.
    desired: State,
    limits: Limits,
}

/// Everything that can fail without the data plane, done before it is touched.
fn prepare(config_path: &Path) -> Result<Prepared> {
    // Whatever the file can be refused for is refused here, before anything is attached,
    // with the messages of `sluice check`.
    let Checked {
        config: cfg,
        text,
        warnings,
    } = check_file(config_path)?;
    init_logging(cfg.daemon.log_level, cfg.daemon.log_format);
    for w in warnings {
        tracing::warn!("{w}");
    }
    // What can fail without the data plane is checked before it is touched.
    let signals = Signals {
        term: tokio::signal::unix::signal(SignalKind::terminate())?,
        int: tokio::signal::unix::signal(SignalKind::interrupt())?,
        hup: tokio::signal::unix::signal(SignalKind::hangup())?,
    };
    let targets = telemetry::target::targets(&cfg);
    let fleet = cfg.fleet.as_ref().map(|f| {
        let store = fleet::gateway::Gateway::new(&f.endpoints, f.request_timeout);
        let limits = Limits {
            max_vips: cfg.dataplane.max_vips,
        };
        Arc::new(fleet::Fleet::new(
            store,
            f.clone(),
            limits,
            cfg.dataplane.hash_seed,
        ))
    });
    let fds = limits::raise_nofile(&cfg).context("raising the open-file limit")?;
    tracing::info!(limit = fds, "open-file limit");
    let hash = config_hash(&text);
    let limits = Limits {
        max_vips: cfg.dataplane.max_vips,
    };
    let listeners = bind_listeners(&cfg)?;

    // The state this start runs, from the file and the persisted runtime state (the same
    // decision a reload makes), also before anything is touched.
    let persisted = read_persisted(&cfg.daemon.state_file);
    let same_file = persisted
        .as_ref()
        .is_some_and(|p| same_config(p, &text, &cfg.daemon.state_file));
    if same_file {
        tracing::info!("restoring state (config plus runtime changes)");
    }
    let desired = persisted
        .as_ref()
        .map(|p| p.state.clone())
        .unwrap_or_default()
        .for_config(same_file, &specs(&cfg), &cfg.tenants, &limits)
        .map_err(|e| anyhow!("configuration: {e}"))?;
    Ok(Prepared {
        cfg,
        hash,
        signals,
        targets,
        fleet,
        listeners,
        persisted,
        desired,
        limits,
    })
}

/// What the host can refuse is refused before anything is loaded or attached: a missing
/// interface, an admin socket that cannot be bound (or where a daemon answers: a second
/// daemon must not take over the pinned data plane) and a metrics port that cannot be had.
fn bind_listeners(cfg: &Config) -> Result<Listeners> {
    for itf in &cfg.dataplane.interfaces {
        ifindex(&itf.name)?;
    }
    let admin = admin::bind(&AdminSocket {
        path: cfg.admin.socket.clone(),
        mode: cfg.admin.mode.bits(),
        group: cfg.admin.group.clone(),
    })?;
    let socket_file = RemovedOnDrop(cfg.admin.socket.clone());
    let metrics = match cfg.metrics.enabled.then_some(cfg.metrics.listen) {
        Some(addr) => Some((addr, metrics::bind(addr)?)),
        None => None,
    };
    Ok(Listeners {
        admin,
        socket_file,
        metrics,
    })
}

/// The data plane a start runs, loaded (or re-adopted) and written.
struct Started {
    ctl: Controller<MapPlane>,
    /// (interface, XDP mode) as attached.
    interfaces: Vec<(String, String)>,
    reused: bool,
    traces: aya_log::EbpfLogger<crate::trace::TraceLog>,
    /// Where the rings' history is saved for the next daemon.
    ring_file: PathBuf,
}

/// Loads (or re-adopts) the data plane and writes `desired`, the settings and the
/// attachments. A failure changes nothing: a data plane this start created is removed whole,
/// and each write to a re-adopted one is undone.
fn load_and_apply(
    cfg: &Config,
    hash: u64,
    persisted: Option<&Persisted>,
    desired: State,
    limits: Limits,
) -> Result<Started> {
    let pin_dir = cfg.daemon.bpffs.clone();
    let opts = LoadOptions {
        conn_table_size: cfg.dataplane.conn_table_size,
        affinity_table_size: cfg.dataplane.affinity_table_size,
        max_vips: cfg.dataplane.max_vips,
        pin_dir: Some(pin_dir.clone()),
    };
    // Declared before the data plane so that on an early return it drops after it (and
    // after the controller holding it): unpinning comes when nothing of ours holds the maps.
    let mut rollback = Rollback {
        pin_dir: pin_dir.clone(),
        created: false,
        armed: false,
    };
    // Loading re-adopts pinned maps without writing to them.
    let mut dp = Dataplane::load(BPF_OBJECT, &opts)?;
    let reused = dp.reused();
    rollback.created = !reused;
    rollback.armed = true;
    // Fresh maps: continue the rings a daemon that unpinned its maps saved, so second-chance
    // VIPs still find the streams whose slots moved before it. The file goes once the start
    // succeeds: a later start must not continue rings older than its maps.
    let ring_file = ring_store::path_for(&cfg.daemon.state_file);
    if !reused {
        match ring_store::load(&ring_file) {
            Ok(Some(rings)) => {
                tracing::info!(vips = rings.len(), path = %ring_file.display(), "continuing the saved rings' history");
                dp.seed_rings(rings);
            }
            Ok(None) => {}
            Err(e) => tracing::warn!(error = %format!("{e:#}"), "ignoring the saved rings"),
        }
    }
    // What the maps hold now: the persisted state if we re-adopt pinned maps.
    let in_plane = match (persisted, reused) {
        (Some(p), true) => p.state.clone(),
        (None, true) => {
            tracing::warn!(
                "pinned maps found without a state file: rewriting them from the configuration"
            );
            State::default()
        }
        _ => State::default(),
    };
    let settings = Settings {
        limits,
        seed: cfg.dataplane.hash_seed,
        flow_idle: cfg.dataplane.flow_idle_timeout,
        state_file: Some(cfg.daemon.state_file.clone()),
        audit_log: Some(cfg.admin.audit_log.clone()),
        config_hash: hash,
    };
    let traces = dp.trace_reader(crate::trace::TraceLog)?;
    let plane = MapPlane::new(dp, cfg.dataplane.hash_seed, cfg.dataplane.flow_idle_timeout)?;

    // A re-adopted plane's state file is first rewritten with its own bytes: one that cannot
    // be written fails the start here, before any map write, rather than after the maps were
    // written and while they are written back (streams on a backend the new file removes
    // would meet that window).
    if reused {
        rewrite_in_place(&cfg.daemon.state_file)?;
    }
    // The writes, each undone if a later one fails: a re-adopted data plane was forwarding
    // before this start and keeps forwarding exactly as it was, with its state file (a
    // created one is removed whole by the rollback). The state file comes last.
    let mut ctl = Controller::new(desired, &in_plane, plane, settings)?;
    let mut undone = Vec::new();
    let taken = take_over(&mut ctl.plane().dp, cfg, &pin_dir, &mut undone)
        .and_then(|interfaces| ctl.persist().map(|()| interfaces));
    let interfaces = match taken {
        Ok(i) => i,
        Err(e) => {
            if reused {
                undo(&mut ctl.plane().dp, undone);
                let now = ctl.state().clone();
                if let Err(back) = ctl.plane().apply(&now, &in_plane, &Default::default()) {
                    tracing::error!(error = %format!("{back:#}"), "undoing a failed start's state");
                }
            }
            return Err(e);
        }
    };
    tracing::info!(reused, pin_dir = %pin_dir.display(), "data plane ready");
    let _ = std::fs::remove_file(&ring_file);
    // Nothing after this can fail before the daemon serves.
    rollback.armed = false;
    Ok(Started {
        ctl,
        interfaces,
        reused,
        traces,
        ring_file,
    })
}

/// Writes `path` again with the bytes it holds (nothing when it does not exist), through the
/// same private-file writer as the state itself, to prove it can be written.
fn rewrite_in_place(path: &Path) -> Result<()> {
    match std::fs::read(path) {
        Ok(bytes) => crate::private_file::write(path, &bytes)
            .with_context(|| format!("writing {}", path.display())),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(()),
        Err(e) => Err(e).with_context(|| format!("reading {}", path.display())),
    }
}

/// The running daemon's shared parts and tasks, stopped in order by `shut_down`.
struct Serving {
    /// The configuration the daemon started with.
    cfg: Arc<Config>,
    ctl: Arc<Mutex<Controller<MapPlane>>>,
    hub: Arc<std::sync::Mutex<Hub>>,
    epoch: Instant,
    ring_file: PathBuf,
    /// Stops the listeners and the trace reader.
    stop: watch::Sender<bool>,
    admin: JoinHandle<Result<()>>,
    metrics: Option<JoinHandle<Result<()>>>,
    tracer: JoinHandle<()>,
    announcer: Option<Restartable>,
    ticker: Restartable,
    follower: Option<Restartable>,
}

/// Starts the listeners and the daemon's tasks over the started data plane. Nothing here can
/// fail.
fn serve(
    cfg: Config,
    started: Started,
    listener: tokio::net::UnixListener,
    metrics_listener: Option<(std::net::SocketAddr, tokio::net::TcpListener)>,
    targets: Vec<telemetry::target::Target>,
    fleet: Option<Arc<fleet::Fleet<fleet::gateway::Gateway>>>,
) -> (Serving, Live) {
    let Started {
        ctl,
        interfaces,
        reused,
        traces,
        ring_file,
    } = started;
    let ctl = Arc::new(Mutex::new(ctl));
    let hub = Arc::new(std::sync::Mutex::new(Hub::new(cfg.telemetry.stale_after)));
    let info = Arc::new(DaemonInfo {
        version: env!("CARGO_PKG_VERSION").to_string(),
        started: Instant::now(),
        interfaces,
        pin_dir: cfg.daemon.bpffs.display().to_string(),
        reused,
        telemetry: hub.clone(),
        refused: Arc::default(),
        policy_step_ns: Default::default(),
        announce: cfg.bgp.clone().map(crate::announce::Announcer::new),
        fleet: fleet.clone(),
    });
    let cfg = Arc::new(cfg);

    let (stop_tx, stop_rx) = watch::channel(false);
    tracing::info!(socket = %cfg.admin.socket.display(), "admin API listening");
    let admin_task = tokio::spawn(admin::serve(
        listener,
        ctl.clone(),
        info.clone(),
        limits::ADMIN,
        stopped(stop_rx.clone()),
    ));
    let metrics_task = metrics_listener.map(|(addr, listener)| {
        tracing::info!(%addr, "metrics listening");
        tokio::spawn(metrics::serve(
            listener,
            ctl.clone(),
            info.clone(),
            stopped(stop_rx.clone()),
        ))
    });
    let tracer = tokio::spawn(crate::trace::run(traces, stopped(stop_rx.clone())));
    let epoch = Instant::now();
    let (settings_tx, settings_rx) = watch::channel(cfg.clone());
    let live = Live {
        scraper: start_scraper(&cfg, targets, &hub, epoch),
        health: start_health(&cfg, &ctl, epoch),
        settings: settings_tx,
        cfg: cfg.clone(),
    };
    let announcer = info.announce.clone().map(|a| {
        let ctl = ctl.clone();
        Restartable::spawn(move |stop| crate::announce::run(a, ctl, stop))
    });
    // In a fleet, the steering rounds (lease and report; the leader's policy step and drain
    // completion) replace the local ticker, and a follower applies the fleet's table sets.
    let (ticker, follower) = match &fleet {
        None => (start_ticker(settings_rx, &ctl, &hub, &info, epoch), None),
        Some(f) => {
            let steering = fleet::run::Steering {
                ctl: ctl.clone(),
                hub: hub.clone(),
                policy: Policy::new(cfg.policy.clone()),
                inband: telemetry::inband::Tracker::default(),
                shed_rst: cfg.policy.shed == Some(config::ShedMode::Rst),
                scrape_interval: cfg.telemetry.scrape_interval,
                scrape_timeout: cfg.telemetry.scrape_timeout,
                epoch,
            };
            let (f1, f2, c) = (f.clone(), f.clone(), ctl.clone());
            (
                Restartable::spawn(move |stop| fleet::run::steer(f1, steering, stop)),
                Some(Restartable::spawn(move |stop| {
                    fleet::run::follow(f2, c, stop)
                })),
            )
        }
    };
    let serving = Serving {
        cfg,
        ctl,
        hub,
        epoch,
        ring_file,
        stop: stop_tx,
        admin: admin_task,
        metrics: metrics_task,
        tracer,
        announcer,
        ticker,
        follower,
    };
    (serving, live)
}

/// Serves until SIGTERM or SIGINT; each SIGHUP reloads the configuration.
async fn wait_for_signals(
    signals: &mut Signals,
    config_path: &Path,
    serving: &Serving,
    mut live: Live,
) -> Live {
    let Serving {
        ctl, hub, epoch, ..
    } = serving;
    loop {
        tokio::select! {
            _ = signals.term.recv() => break,
            _ = signals.int.recv() => break,
            _ = signals.hup.recv() => live = reload(config_path, ctl, hub, *epoch, live).await,
        }
    }
    live
}

/// Stops the daemon: its routes first, then the listeners and tasks, then the data plane
/// unless `keep_dataplane_on_exit` keeps it forwarding.
async fn shut_down(serving: Serving, live: Live) -> Result<()> {
    let Serving {
        cfg,
        ctl,
        ring_file,
        stop,
        admin,
        metrics,
        tracer,
        announcer,
        ticker,
        follower,
        ..
    } = serving;
    tracing::info!("stopping");
    notify::stopping();
    // Routes go first, while the data plane still forwards what the routers send meanwhile.
    if let Some(a) = announcer {
        a.stop().await;
    }
    let _ = stop.send(true);
    let _ = admin.await;
    if let Some(t) = metrics {
        let _ = t.await;
    }
    ticker.stop().await;
    if let Some(f) = follower {
        f.stop().await;
    }
    live.health.stop().await;
    live.scraper.stop().await;
    let _ = tracer.await;
    if !cfg.daemon.keep_dataplane_on_exit {
        // The rings go with the pins: their history is kept for the next daemon.
        let rings = ctl.lock().await.plane().dp.live_rings();
        match rings.and_then(|r| ring_store::save(&ring_file, &r)) {
            Ok(()) => {
                tracing::info!(path = %ring_file.display(), "rings saved for the next daemon")
            }
            Err(e) => tracing::warn!(error = %format!("{e:#}"), "the rings' history is not saved"),
        }
    }
    // Drop the maps and programs before unpinning, so nothing of ours holds them.
    drop(ctl);
    let pin_dir = &cfg.daemon.bpffs;
    if cfg.daemon.keep_dataplane_on_exit {
        tracing::info!(pin_dir = %pin_dir.display(), "keeping the data plane running (keep_dataplane_on_exit)");
    } else {
        remove_pinned(pin_dir)?;
        tracing::info!("data plane detached and unpinned");
    }
    Ok(())
}

/// The keys of `old` and `new` that differ among the sections a reload cannot apply (the data
/// plane's maps and attachment, the listeners, files and logging are set up at start).
pub fn restart_keys(old: &Config, new: &Config) -> Vec<String> {
    let sections = [
        (
            "daemon",
            serde_json::to_value(&old.daemon),
            serde_json::to_value(&new.daemon),
        ),
        (
            "admin",
            serde_json::to_value(&old.admin),
            serde_json::to_value(&new.admin),
        ),
        (
            "metrics",
            serde_json::to_value(&old.metrics),
            serde_json::to_value(&new.metrics),
        ),
        (
            "dataplane",
            serde_json::to_value(&old.dataplane),
            serde_json::to_value(&new.dataplane),
        ),
        // The announcer starts with the daemon.
        (
            "bgp",
            serde_json::to_value(&old.bgp),
            serde_json::to_value(&new.bgp),
        ),
        (
            "fleet",
            serde_json::to_value(&old.fleet),
            serde_json::to_value(&new.fleet),
        ),
    ];
    let mut out = Vec::new();
    for (name, a, b) in sections {
        let (Ok(a), Ok(b)) = (a, b) else {
            out.push(name.to_string());
            continue;
        };
        let empty = serde_json::Map::new();
        let (a, b) = (
            a.as_object().unwrap_or(&empty),
            b.as_object().unwrap_or(&empty),
        );
        let keys: std::collections::BTreeSet<&String> = a.keys().chain(b.keys()).collect();
        out.extend(
            keys.into_iter()
                .filter(|k| a.get(*k) != b.get(*k))
                .map(|k| format!("{name}.{k}")),
        );
    }
    out
}

/// SIGHUP: re-reads the configuration and applies the VIPs and backends, `[health]`,
/// `[telemetry]` (and each backend's sources) and `[policy]`; keys that need a restart keep
/// their running values and are named. A bad file, or VIPs the controller refuses, change
/// nothing.
async fn reload(
    path: &Path,
    ctl: &Arc<Mutex<Controller<MapPlane>>>,
    hub: &Arc<std::sync::Mutex<Hub>>,
    epoch: Instant,
    live: Live,
) -> Live {
    // The same validation as a start and `sluice check`.
    let Checked {
        config: new, text, ..
    } = match check_file(path) {
        Ok(c) => c,
        Err(e) => {
            tracing::error!(error = %e, "reload: configuration rejected, nothing changed");
            return live;
        }
    };
    let targets = telemetry::target::targets(&new);
    let old = &live.cfg;
    let restart = restart_keys(old, &new);
    // What runs: the new file, but the running values of what needs a restart.
    let running = Arc::new(Config {
        daemon: old.daemon.clone(),
        admin: old.admin.clone(),
        metrics: old.metrics.clone(),
        dataplane: old.dataplane.clone(),
        bgp: old.bgp.clone(),
        fleet: old.fleet.clone(),
        ..new
    });
    // In a fleet the VIPs and backends live in etcd: the file's are not applied.
    if running.fleet.is_some() && running.vips != old.vips {
        tracing::warn!("reload: [[vip]] changes are not applied in a fleet; change the fleet's VIPs through the admin API (they live in etcd)");
    } else if let Err(e) = ctl.lock().await.reload(
        &specs(&running),
        &running.tenants,
        config_hash(&text),
        now_ms(),
    ) {
        tracing::error!(error = %e, "reload refused, nothing changed");
        return live;
    }
    let mut applied = Vec::new();
    if running.vips != old.vips {
        applied.push("vip");
    }
    if running.tenants != old.tenants {
        applied.push("tenant");
    }
    let health_changed = running.health != old.health;
    let telemetry_changed = running.telemetry != old.telemetry || running.vips != old.vips;
    let Live {
        mut scraper,
        mut health,
        settings,
        ..
    } = live;
    if health_changed || running.vips != old.vips {
        health.stop().await;
        health = start_health(&running, ctl, epoch);
        if health_changed {
            applied.push("health");
        }
    }
    if telemetry_changed {
        scraper.stop().await;
        scraper = start_scraper(&running, targets, hub, epoch);
        if running.telemetry != old.telemetry {
            applied.push("telemetry");
        }
    }
    if running.policy != old.policy {
        applied.push("policy");
    }
    let _ = settings.send(running.clone());
    if restart.is_empty() {
        tracing::info!(
            vips = running.vips.len(),
            ?applied,
            "configuration reloaded"
        );
    } else {
        tracing::warn!(
            vips = running.vips.len(),
            ?applied,
            needs_restart = %restart.join(", "),
            "configuration reloaded except keys that need a restart (`systemctl restart sluice`); they keep their running values"
        );
    }
    Live {
        cfg: running,
        scraper,
        health,
        settings,
    }
}

/// Default pin directory, for `sluice cleanup`.
pub fn default_pin_dir() -> PathBuf {
    PathBuf::from("/sys/fs/bpf/sluice")
}

#[cfg(test)]
mod tests {
    use super::*;

    const BASE: &str = "[dataplane]\ninterfaces = [{ name = \"eth0\" }]\nhash_seed = 1\n";

    #[test]
    fn the_config_hash_is_fnv1a_64() {
        // Reference values of 64-bit FNV-1a.
        assert_eq!(config_hash(""), 0xcbf2_9ce4_8422_2325);
        assert_eq!(config_hash("a"), 0xaf63_dc4c_8601_ec8c);
        assert_eq!(config_hash("foobar"), 0x8594_4171_f739_67e8);
    }

    #[test]
    fn state_files_old_and_new_are_recognised() {
        let path = Path::new("/var/lib/sluice/state.json");
        let mut h = DefaultHasher::new();
        BASE.hash(&mut h);
        let p = |config_hash, hash| Persisted {
            layout: lb_common::LAYOUT_VERSION,
            config_hash,
            hash,
            state: State::default(),
        };
        assert!(same_config(
            &p(config_hash(BASE), HashKind::Fnv1a),
            BASE,
            path
        ));
        assert!(!same_config(
            &p(config_hash(BASE), HashKind::Fnv1a),
            "x",
            path
        ));
        // A file of an earlier release: no `hash` field, a DefaultHasher value.
        let old = format!(
            r#"{{"layout": {}, "config_hash": {}, "state": {{"vips": {{}}, "next_backend_id": 1}}}}"#,
            lb_common::LAYOUT_VERSION,
            h.finish()
        );
        let old: Persisted = serde_json::from_str(&old).unwrap();
        assert_eq!(old.hash, HashKind::Legacy);
        assert!(same_config(&old, BASE, path));
        assert!(!same_config(&old, "x", path));
        let new = serde_json::to_value(p(1, HashKind::Fnv1a)).unwrap();
        assert_eq!(new["hash"], "fnv1a");
    }

    #[test]
    fn reload_names_the_keys_that_need_a_restart() {
        let old = config::parse(BASE, "t").unwrap();
        let same = config::parse(
            &format!("{BASE}[health]\ninterval = \"3s\"\n[policy]\ncooldown_base = \"20s\"\n"),
            "t",
        )
        .unwrap();
        assert_eq!(restart_keys(&old, &same), Vec::<String>::new());
        let new = config::parse(
            "[dataplane]\ninterfaces = [{ name = \"eth1\" }]\nhash_seed = 1\n\
             conn_table_size = 4096\n[metrics]\nlisten = \"127.0.0.1:9999\"\n",
            "t",
        )
        .unwrap();
        assert_eq!(
            restart_keys(&old, &new),
            [
                "metrics.listen",
                "dataplane.conn_table_size",
                "dataplane.interfaces"
            ]
        );
    }
}
