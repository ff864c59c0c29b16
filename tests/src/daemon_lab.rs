//! The namespace lab with the load balancer run by the real daemon: `sluice run --config`
//! in the LB namespace, driven through the `sluice` CLI and the admin API as an operator
//! would.
//!
//! [`DaemonLab::start`] builds the [`Topology`] (see `netns`), attaches `sluice_pass` to the
//! LB's switch port ([`switch_port`]), starts `sluice backend-host run` on every backend as its
//! systemd unit would ([`BackendHost`]: decapsulation on eth0, the VIPs on lo, readiness
//! through `$NOTIFY_SOCKET`), starts a token server on every backend (on the VIPs, and on the backend's own
//! addresses for the health checks), optionally a fake Prometheus exporter per backend
//! (`sluice-testsrv serve --metrics`, whose page a test rewrites at run time), writes a
//! configuration and starts the daemon with `nsenter --net=/run/netns/<lb>` (not
//! `ip netns exec`, which remounts /sys and would hide the host's /sys/fs/bpf).
//!
//! Every lab has its own pin directory (`/sys/fs/bpf/sluice-lab-<pid>-<n>`) and temporary
//! directory (`$TMPDIR/sluice-lab-<pid>-<n>`: configuration, state file, audit log, admin
//! socket, one log file per daemon start). Dropping the lab, also while a test panics,
//! stops the daemon (SIGTERM, then SIGKILL), removes the pins and the temporary directory
//! (after printing the end of the daemon's log if the test failed), then the data planes
//! and namespaces. [`DaemonLab::start`] removes what a crashed earlier run left.
//!
//! With [`DaemonLabOptions::accel`] every backend runs a simulated accelerator
//! (`sluice-accel`: OpenAI-style streams paced by a batching model) instead of the token
//! server; it serves its own dcgm, vLLM and RoCE pages, which the daemon scrapes, and takes
//! faults on a control listener ([`DaemonLab::accel_request`]).
//!
//! Timings are fast so tests are short: health every 200 ms (rise 2, fall 2), telemetry every
//! 250 ms (stale after 1 s), policy cooldown 2 s and slow start 2 s, flows idle after 3 s;
//! [`DaemonLabOptions::set`] changes any key.

use std::{
    collections::BTreeMap,
    fs::{self, File},
    io::{Read, Write},
    net::{IpAddr, Ipv4Addr, SocketAddr, TcpListener, TcpStream},
    path::{Path, PathBuf},
    process::{Child, Command, ExitStatus},
    sync::{
        atomic::{AtomicUsize, Ordering},
        OnceLock,
    },
    thread,
    time::{Duration, Instant, SystemTime},
};

use anyhow::{anyhow, bail, Context, Result};
use serde_json::Value;
use sluice::{client::Client, dataplane::remove_pinned};

use crate::{
    backend_host::{signal_and_wait, spawn_as_unit, start_all, BackendHost, NotifySocket},
    netns::{
        mac_string, run_output, switch_port, tool, CmdOutput, ProcId, Topology, TopologySpec,
        CLIENT_V4, DEV, ENCAP_SRC_V4, ENCAP_SRC_V6, PREFIX_LEN_V4, SEED, TCP_PORT, VIP4, VIP6,
    },
    stream::TokenStream,
};

/// Client source addresses on the segment ([`DaemonLab::add_client_sources`]).
pub const SEGMENT_CLIENT_SOURCES: u16 = 180;
/// The most client source addresses a lab has: the segment's, then [`EXTRA_CLIENT_NET`]'s.
pub const MAX_CLIENT_SOURCES: u16 = 1000;
/// Where client sources beyond the segment's come from (outside the segment and the VIPs).
pub const EXTRA_CLIENT_NET: &str = "10.111.4.0/22";

/// First characters of every lab's pin and temporary directory (`sluice-lab-<pid>-<n>`).
pub const PREFIX: &str = "sluice-lab-";
/// The port of the fake exporters on the backends' own addresses.
pub const EXPORTER_PORT: u16 = 9400;
/// The backends' health-check port: their token servers also listen on their own addresses.
pub const HEALTH_PORT: u16 = TCP_PORT;
/// The control listener of a simulated accelerator, on the backend's own IPv4 address.
pub const ACCEL_CONTROL_PORT: u16 = 9500;
/// Bound on every CLI command.
pub const CLI_TIMEOUT: Duration = Duration::from_secs(30);
/// How long the daemon may take to answer on its admin socket after it is started.
pub const START_TIMEOUT: Duration = Duration::from_secs(30);

static LAB_COUNTER: AtomicUsize = AtomicUsize::new(0);

/// A VIP of the daemon's configuration.
#[derive(Clone, Debug)]
pub struct VipDef {
    pub name: String,
    pub addr: SocketAddr,
    /// "tcp" or "udp".
    pub protocol: &'static str,
    pub priority: u8,
    /// Topology backend indexes; addressed over the VIP's family.
    pub backends: Vec<usize>,
    pub weight: u32,
    /// 0: no cap.
    pub max_sessions: u32,
    /// dcgm, engine (vllm) and roce sources on the backend's fake exporter (needs
    /// [`DaemonLabOptions::exporters`]) or simulated accelerator.
    pub telemetry: bool,
    /// The flow hash: "five-tuple" or "source" (client affinity).
    pub hash: &'static str,
    /// In-band signals (`inband = true`).
    pub inband: bool,
    /// `flow_state`: "table" (the default) or "second-chance".
    pub flow_state: &'static str,
    /// `affinity_window` in seconds (0: the daemon's default, none).
    pub affinity_secs: u32,
}

impl VipDef {
    /// A TCP VIP on every backend of a `backends`-backend topology, weight 100, no cap.
    pub fn tcp(name: &str, addr: SocketAddr, backends: usize) -> VipDef {
        VipDef {
            name: name.into(),
            addr,
            protocol: "tcp",
            priority: 0,
            backends: (0..backends).collect(),
            weight: 100,
            max_sessions: 0,
            telemetry: false,
            hash: "five-tuple",
            inband: false,
            flow_state: "table",
            affinity_secs: 0,
        }
    }
}

/// What [`DaemonLab::start`] builds.
#[derive(Clone, Debug)]
pub struct DaemonLabOptions {
    pub topology: TopologySpec,
    pub vips: Vec<VipDef>,
    /// Where every backend's token server listens, besides its own addresses on
    /// [`HEALTH_PORT`]. Default: TCP on [`VIP4`] and [`VIP6`] port [`TCP_PORT`].
    pub serve: Vec<SocketAddr>,
    /// More VIP addresses to put on every backend's `lo` (besides [`VIP4`] and [`VIP6`]).
    pub backend_vips: Vec<IpAddr>,
    /// A fake exporter per backend on `<backend v4>:`[`EXPORTER_PORT`], serving the page
    /// [`DaemonLab::set_telemetry`] writes ([`FakeTelemetry::default`] at start).
    pub exporters: bool,
    /// Servers exit on their own after this long.
    pub server_lifetime: Duration,
    /// The `sluice-testsrv` binary.
    pub server: PathBuf,
    /// Configuration keys by section, as raw TOML values; [`DaemonLabOptions::set`].
    pub settings: BTreeMap<String, BTreeMap<String, String>>,
    /// The `sluice` binary of both daemons and the CLI; default: the one built next to the
    /// tests ([`sluice_binary`]). The package test names the installed one.
    pub sluice: Option<PathBuf>,
    /// Put before the binary when a daemon (LB or backend host) starts, e.g. `setpriv` with
    /// a systemd unit's capabilities; empty by default.
    pub prefix: Vec<String>,
    /// Simulated accelerators instead of token servers (see the module docs).
    pub accel: Option<Accel>,
}

/// The simulated accelerators of a lab.
#[derive(Clone, Debug)]
pub struct Accel {
    /// The `sluice-accel` binary.
    pub binary: PathBuf,
    /// More arguments for backend `i` (e.g. `--slow 0.5`), where given.
    pub args: Vec<Vec<String>>,
}

impl DaemonLabOptions {
    /// A lab of `backends` backends with the given VIPs and the fast test timings.
    pub fn new(server: impl Into<PathBuf>, backends: usize, vips: Vec<VipDef>) -> Self {
        let mut o = DaemonLabOptions {
            topology: TopologySpec::with_backends(backends),
            vips,
            serve: vec![
                SocketAddr::new(VIP4.into(), TCP_PORT),
                SocketAddr::new(VIP6.into(), TCP_PORT),
            ],
            backend_vips: Vec::new(),
            exporters: false,
            server_lifetime: Duration::from_secs(180),
            server: server.into(),
            settings: BTreeMap::new(),
            sluice: None,
            prefix: Vec::new(),
            accel: None,
        };
        for (section, key, value) in [
            ("daemon", "keep_dataplane_on_exit", "false"),
            ("daemon", "log_level", "\"info\""),
            ("dataplane", "flow_idle_timeout", "\"3s\""),
            ("dataplane", "conn_table_size", "65536"),
            ("dataplane", "affinity_table_size", "4096"),
            ("dataplane", "max_vips", "8"),
            ("health", "interval", "\"200ms\""),
            ("health", "timeout", "\"150ms\""),
            ("health", "rise", "2"),
            ("health", "fall", "2"),
            ("telemetry", "scrape_interval", "\"250ms\""),
            ("telemetry", "scrape_timeout", "\"200ms\""),
            ("telemetry", "stale_after", "\"1s\""),
            ("policy", "cooldown_base", "\"2s\""),
            ("policy", "slow_start", "\"2s\""),
        ] {
            o.set(section, key, value);
        }
        o
    }

    /// Sets `key` of `[section]` to `value`, written as is (TOML: quote strings).
    pub fn set(&mut self, section: &str, key: &str, value: &str) -> &mut Self {
        self.settings
            .entry(section.into())
            .or_default()
            .insert(key.into(), value.into());
        self
    }
}

/// What a backend's fake exporter reports: a dcgm-exporter, vLLM and node_exporter
/// (infiniband) page in one.
#[derive(Clone, Debug, PartialEq)]
pub struct FakeTelemetry {
    /// DCGM_FI_DEV_GPU_UTIL, 0..=100.
    pub gpu_util_pct: f64,
    pub gpu_temp_c: f64,
    /// vllm:kv_cache_usage_perc, 0..=1.
    pub kv_cache: f64,
    /// vllm:num_requests_waiting.
    pub queue: u32,
    /// ECN-marked RoCE packets per second (the counter grows at this rate).
    pub ecn_per_s: f64,
}

impl Default for FakeTelemetry {
    /// A calm backend: far below every threshold of the default policy.
    fn default() -> Self {
        FakeTelemetry {
            gpu_util_pct: 20.0,
            gpu_temp_c: 40.0,
            kv_cache: 0.2,
            queue: 0,
            ecn_per_s: 0.0,
        }
    }
}

impl FakeTelemetry {
    /// The exporter page, in the exporters' formats (see the fixtures under
    /// lb-core/tests/fixtures/telemetry/).
    pub fn page(&self) -> String {
        let gpu = r#"gpu="0",UUID="GPU-1d3b8c4a-9f62-4e0b-a7c5-2b81e0f3d6a9",device="nvidia0",modelName="NVIDIA H100 80GB HBM3",Hostname="lab""#;
        let model = r#"model_name="meta-llama/Llama-3.1-8B-Instruct",engine="0""#;
        let ib = r#"device="mlx5_0",port="1""#;
        format!(
            "# HELP DCGM_FI_DEV_GPU_UTIL GPU utilization (in %).\n\
             # TYPE DCGM_FI_DEV_GPU_UTIL gauge\n\
             DCGM_FI_DEV_GPU_UTIL{{{gpu}}} {}\n\
             # HELP DCGM_FI_DEV_FB_FREE Framebuffer memory free (in MiB).\n\
             # TYPE DCGM_FI_DEV_FB_FREE gauge\n\
             DCGM_FI_DEV_FB_FREE{{{gpu}}} 40000\n\
             # HELP DCGM_FI_DEV_FB_USED Framebuffer memory used (in MiB).\n\
             # TYPE DCGM_FI_DEV_FB_USED gauge\n\
             DCGM_FI_DEV_FB_USED{{{gpu}}} 41559\n\
             # HELP DCGM_FI_DEV_GPU_TEMP GPU temperature (in C).\n\
             # TYPE DCGM_FI_DEV_GPU_TEMP gauge\n\
             DCGM_FI_DEV_GPU_TEMP{{{gpu}}} {}\n\
             # HELP DCGM_FI_DEV_POWER_USAGE Power draw (in W).\n\
             # TYPE DCGM_FI_DEV_POWER_USAGE gauge\n\
             DCGM_FI_DEV_POWER_USAGE{{{gpu}}} 350.000000\n\
             # HELP DCGM_FI_DEV_CLOCKS_EVENT_REASONS Current clock event reasons (bitmask).\n\
             # TYPE DCGM_FI_DEV_CLOCKS_EVENT_REASONS gauge\n\
             DCGM_FI_DEV_CLOCKS_EVENT_REASONS{{{gpu}}} 0\n\
             # HELP vllm:num_requests_running Number of requests in model execution batches.\n\
             # TYPE vllm:num_requests_running gauge\n\
             vllm:num_requests_running{{{model}}} 4.0\n\
             # HELP vllm:num_requests_waiting Number of requests waiting to be processed.\n\
             # TYPE vllm:num_requests_waiting gauge\n\
             vllm:num_requests_waiting{{{model}}} {}.0\n\
             # HELP vllm:kv_cache_usage_perc KV-cache usage. 1 means 100 percent usage.\n\
             # TYPE vllm:kv_cache_usage_perc gauge\n\
             vllm:kv_cache_usage_perc{{{model}}} {}\n\
             # HELP node_infiniband_np_ecn_marked_roce_packets_received_total Number of ECN marked RoCEv2 packets received.\n\
             # TYPE node_infiniband_np_ecn_marked_roce_packets_received_total counter\n\
             node_infiniband_np_ecn_marked_roce_packets_received_total{{{ib}}} {{{{counter:{}}}}}\n\
             # HELP node_infiniband_np_cnp_packets_sent_total Number of CNP packets sent.\n\
             # TYPE node_infiniband_np_cnp_packets_sent_total counter\n\
             node_infiniband_np_cnp_packets_sent_total{{{ib}}} 0\n",
            self.gpu_util_pct, self.gpu_temp_c, self.queue, self.kv_cache, self.ecn_per_s
        )
    }
}

/// The `sluice` binary next to the test executable (target/<profile>/sluice). Fails with
/// what to do when it is missing or older than the daemon's sources. Checked once per test
/// process, so sources edited while the tests run do not fail the later tests.
pub fn sluice_binary() -> Result<PathBuf> {
    static CHECKED: OnceLock<Result<PathBuf, String>> = OnceLock::new();
    CHECKED
        .get_or_init(|| check_sluice_binary().map_err(|e| format!("{e:#}")))
        .clone()
        .map_err(|e| anyhow!(e))
}

fn check_sluice_binary() -> Result<PathBuf> {
    let exe = std::env::current_exe().context("locating the test executable")?;
    // target/<profile>/deps/<test> or target/<profile>/<bin>.
    let mut dir = exe.parent().map(Path::to_path_buf).unwrap_or_default();
    if dir.ends_with("deps") {
        dir.pop();
    }
    check_fresh(
        dir.join("sluice"),
        "`cargo build -p lb-userspace --bin sluice` (`cargo test --workspace` builds it too)",
    )
}

/// The directory, under the workspace's `target/`, where `cargo xtask build` builds the
/// second `sluice` binary of the upgrade test (the same as xtask's `UPGRADE_TARGET_DIR`).
pub const UPGRADE_TARGET_DIR: &str = "upgrade";

/// The newer `sluice` of the upgrade test: the same sources built with the eBPF object linked
/// for BPF CPU v2 embedded (`SLUICE_BPF_OBJECT` at build time), so its program differs from
/// [`sluice_binary`]'s while its maps are the same. `cargo xtask build` (and `cargo xtask
/// test`) build it into `target/upgrade/debug/sluice`. Fails with what to do when it is
/// missing or older than the daemon's sources or that object.
pub fn upgrade_binary() -> Result<PathBuf> {
    let target = Path::new(env!("CARGO_MANIFEST_DIR")).join("../target");
    let rebuild = "`cargo xtask build` (or `cargo xtask build --debug`)";
    let bin = check_fresh(
        target.join(UPGRADE_TARGET_DIR).join("debug/sluice"),
        rebuild,
    )?;
    let object = target.join("bpf/sluice-cpu-v2.bpf.o");
    if mtime(&object)? > mtime(&bin)? {
        bail!(
            "{} is older than the object it embeds, {}: rebuild it with {rebuild}",
            bin.display(),
            object.display()
        );
    }
    Ok(bin)
}

fn mtime(p: &Path) -> Result<SystemTime> {
    fs::metadata(p)
        .and_then(|m| m.modified())
        .with_context(|| format!("reading {}", p.display()))
}

/// `bin` if it exists and is not older than the daemon's sources (both userspace crates); otherwise what to do
/// (`rebuild`).
fn check_fresh(bin: PathBuf, rebuild: &str) -> Result<PathBuf> {
    let built = fs::metadata(&bin).and_then(|m| m.modified()).map_err(|_| {
        anyhow!(
            "the sluice binary {} does not exist: build it with {rebuild}",
            bin.display()
        )
    })?;
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("..");
    let newest = ["lb-userspace/src", "lb-core/src"]
        .iter()
        .filter_map(|dir| newest_file(&root.join(dir)))
        .max_by_key(|(_, t)| *t);
    if let Some((newer, _)) = newest.filter(|(_, t)| *t > built) {
        bail!(
            "the sluice binary {} is older than {}: rebuild it with {rebuild}",
            bin.display(),
            newer.display()
        );
    }
    Ok(bin)
}

fn newest_file(dir: &Path) -> Option<(PathBuf, SystemTime)> {
    let mut best: Option<(PathBuf, SystemTime)> = None;
    for e in fs::read_dir(dir).ok()?.flatten() {
        let p = e.path();
        let found = if p.is_dir() {
            newest_file(&p)
        } else {
            e.metadata()
                .and_then(|m| m.modified())
                .ok()
                .map(|t| (p.clone(), t))
        };
        if let Some((p, t)) = found {
            if best.as_ref().is_none_or(|(_, b)| t > *b) {
                best = Some((p, t));
            }
        }
    }
    best
}

/// Whether process `pid` is alive (not a zombie).
fn pid_alive(pid: u32) -> bool {
    fs::read_to_string(format!("/proc/{pid}/stat")).is_ok_and(|s| {
        s.rsplit_once(')')
            .and_then(|(_, rest)| rest.split_whitespace().next())
            .is_some_and(|st| st != "Z" && st != "X")
    })
}

/// Removes pin directories and temporary directories of labs whose test process is gone.
pub fn sweep_stale() {
    for root in [PathBuf::from("/sys/fs/bpf"), std::env::temp_dir()] {
        let Ok(entries) = fs::read_dir(&root) else {
            continue;
        };
        for e in entries.flatten() {
            let name = e.file_name().to_string_lossy().into_owned();
            let Some(pid) = name
                .strip_prefix(PREFIX)
                .and_then(|r| r.split_once('-'))
                .and_then(|(p, _)| p.parse::<u32>().ok())
            else {
                continue;
            };
            if pid == std::process::id() || pid_alive(pid) {
                continue;
            }
            let p = e.path();
            let r = if root.starts_with("/sys/fs/bpf") {
                remove_pinned(&p)
            } else {
                fs::remove_dir_all(&p).map_err(Into::into)
            };
            match r {
                Ok(()) => eprintln!("daemon lab: removed {} left by a dead run", p.display()),
                Err(e) => eprintln!("daemon lab: could not remove {}: {e:#}", p.display()),
            }
        }
    }
}

/// A fresh lab id, `sluice-lab-<pid>-<n>`: its pin and temporary directories are swept by
/// [`sweep_stale`] once this process is gone.
pub fn next_lab_id() -> String {
    format!(
        "{PREFIX}{}-{}",
        std::process::id(),
        LAB_COUNTER.fetch_add(1, Ordering::Relaxed)
    )
}

/// Fails with what is missing: the `sluice` binary, `nsenter`, a bpffs at /sys/fs/bpf, the
/// test server (the namespace prerequisites are checked by [`Topology::build`]).
pub fn require_daemon_prerequisites(server: &Path) -> Result<PathBuf> {
    let sluice = require_sluice_daemon_prerequisites()?;
    if !server.is_file() {
        bail!("the test server {} does not exist", server.display());
    }
    Ok(sluice)
}

/// What running the `sluice` daemons in the lab needs (also the backend hosts of the
/// namespace lab): the binary, `nsenter`, a bpffs at /sys/fs/bpf.
pub fn require_sluice_daemon_prerequisites() -> Result<PathBuf> {
    crate::netns::require_lab_prerequisites()?;
    tool("nsenter").context("the labs start the sluice daemons with nsenter (util-linux)")?;
    let mounts = fs::read_to_string("/proc/self/mounts").context("reading /proc/self/mounts")?;
    if !mounts
        .lines()
        .any(|l| l.split_whitespace().nth(1) == Some("/sys/fs/bpf") && l.contains(" bpf "))
    {
        bail!("no bpffs at /sys/fs/bpf: `mount -t bpf bpf /sys/fs/bpf` (cargo xtask setup does)");
    }
    sluice_binary()
}

/// The lab (see the module docs). Fields drop in order after [`Drop`] has stopped the daemon:
/// the helper data planes, then the topology (servers, namespaces).
pub struct DaemonLab {
    pub opts: DaemonLabOptions,
    /// `sluice-lab-<pid>-<n>`.
    pub id: String,
    pub dir: PathBuf,
    pub bpffs: PathBuf,
    pub socket: PathBuf,
    pub config: PathBuf,
    pub audit_log: PathBuf,
    pub state_file: PathBuf,
    /// The daemon's metrics endpoint (inside the LB namespace).
    pub metrics: SocketAddr,
    pub sluice: PathBuf,
    daemon: Option<Child>,
    /// Daemon starts so far; start `k` logs to `daemon-<k>.log`.
    starts: usize,
    /// The token server of each backend.
    pub servers: Vec<ProcId>,
    /// The fake exporter of each backend (with [`DaemonLabOptions::exporters`]).
    pub exporters: Vec<ProcId>,
    /// `sluice backend-host run` per backend (index as in `topo.backends`).
    pub backend_hosts: Vec<BackendHost>,
    /// `sluice_pass` on the LB's switch port.
    pub edge_dp: sluice::dataplane::Dataplane,
    pub topo: Topology,
}

impl DaemonLab {
    pub fn start(opts: DaemonLabOptions) -> Result<DaemonLab> {
        let t = Instant::now();
        let server = opts.accel.as_ref().map_or(&opts.server, |a| &a.binary);
        let built = require_daemon_prerequisites(server)?;
        let sluice = opts.sluice.clone().unwrap_or(built);
        sweep_stale();
        let topo = Topology::build(&opts.topology)?;
        let edge_dp = switch_port(&topo)?;
        let id = next_lab_id();
        let dir = std::env::temp_dir().join(&id);
        let _ = fs::remove_dir_all(&dir);
        fs::create_dir_all(&dir).with_context(|| format!("creating {}", dir.display()))?;
        let bpffs = Path::new("/sys/fs/bpf").join(&id);
        // Each backend host puts the lab's VIPs on its lo (Topology put VIP4 and VIP6 there
        // already; the daemon keeps an address that is there).
        let mut vips = vec![IpAddr::from(VIP4), IpAddr::from(VIP6)];
        vips.extend(opts.backend_vips.iter().copied());
        let backend_hosts = match start_all(&topo, &sluice, &opts.prefix, &vips, &id, &dir) {
            Ok(h) => h,
            Err(e) => {
                let _ = fs::remove_dir_all(&dir);
                return Err(e);
            }
        };
        let port = topo
            .lb
            .ns
            .run(|| TcpListener::bind((Ipv4Addr::LOCALHOST, 0)).and_then(|l| l.local_addr()))?
            .context("finding a free port for the metrics endpoint")?
            .port();
        let mut lab = DaemonLab {
            socket: dir.join("admin.sock"),
            config: dir.join("sluice.toml"),
            audit_log: dir.join("audit.jsonl"),
            state_file: dir.join("state.json"),
            metrics: SocketAddr::new(Ipv4Addr::LOCALHOST.into(), port),
            sluice,
            daemon: None,
            starts: 0,
            servers: Vec::new(),
            exporters: Vec::new(),
            id,
            dir,
            bpffs,
            opts,
            backend_hosts,
            edge_dp,
            topo,
        };
        lab.start_servers()?;
        lab.topo
            .resolve_backend_neighbours(Duration::from_secs(5))?;
        lab.write_config()?;
        lab.start_daemon()?;
        eprintln!(
            "daemon lab {} ({}) up in {:?}",
            lab.id,
            lab.topo.id,
            t.elapsed()
        );
        Ok(lab)
    }

    fn start_servers(&mut self) -> Result<()> {
        if let Some(accel) = self.opts.accel.clone() {
            return self.start_accels(&accel);
        }
        let lifetime = self.opts.server_lifetime;
        for i in 0..self.topo.backends.len() {
            let b = self.topo.backends[i].clone();
            let mut args = Vec::new();
            let own = [
                SocketAddr::new(b.addr(false), HEALTH_PORT),
                SocketAddr::new(b.addr(true), HEALTH_PORT),
            ];
            for a in self.opts.serve.iter().chain(own.iter()) {
                args.push("--tcp".to_string());
                args.push(a.to_string());
            }
            let id =
                self.topo
                    .start_server(i, &self.opts.server.clone(), &b.name, lifetime, &args)?;
            self.servers.push(id);
            if self.opts.exporters {
                let file = self.metrics_file(i);
                write_atomic(&file, &FakeTelemetry::default().page())?;
                let args = vec![
                    "--metrics".to_string(),
                    format!("{}={}", self.exporter_addr(i), file.display()),
                ];
                let name = format!("{}-exporter", b.name);
                let id =
                    self.topo
                        .start_server(i, &self.opts.server.clone(), &name, lifetime, &args)?;
                self.exporters.push(id);
            }
        }
        Ok(())
    }

    /// `sluice-accel` on every backend, serving the VIPs and the backend's own addresses.
    fn start_accels(&mut self, accel: &Accel) -> Result<()> {
        if !accel.binary.is_file() {
            bail!(
                "the simulated accelerator {} does not exist: build the workspace",
                accel.binary.display()
            );
        }
        for i in 0..self.topo.backends.len() {
            let b = self.topo.backends[i].clone();
            let mut args = vec!["--name".to_string(), b.name.clone()];
            let own = [
                SocketAddr::new(b.addr(false), HEALTH_PORT),
                SocketAddr::new(b.addr(true), HEALTH_PORT),
            ];
            for a in self.opts.serve.iter().chain(own.iter()) {
                args.push("--listen".into());
                args.push(a.to_string());
            }
            args.push("--control".into());
            args.push(self.accel_control(i).to_string());
            args.push("--seed".into());
            args.push(i.to_string());
            args.extend(accel.args.get(i).cloned().unwrap_or_default());
            let label = format!("sluice-accel {}", b.name);
            let id = self.topo.spawn(&b.ns, &label, &accel.binary, &args)?;
            self.topo
                .wait_line(id, "sluice-accel", Duration::from_secs(10))?;
            self.servers.push(id);
        }
        Ok(())
    }

    /// Backend `i`'s accelerator control listener.
    pub fn accel_control(&self, i: usize) -> SocketAddr {
        SocketAddr::new(self.topo.backends[i].addr(false), ACCEL_CONTROL_PORT)
    }

    /// One request to backend `i`'s accelerator control listener (`POST /fault`, `GET
    /// /state`): (status, JSON body).
    pub fn accel_request(
        &self,
        i: usize,
        method: &str,
        path: &str,
        body: Option<&Value>,
    ) -> Result<(u16, Value)> {
        let addr = self.accel_control(i);
        let body = body.map(Value::to_string).unwrap_or_default();
        let req = format!(
            "{method} {path} HTTP/1.1\r\nHost: {addr}\r\nConnection: close\r\n\
             Content-Type: application/json\r\nContent-Length: {}\r\n\r\n{body}",
            body.len()
        );
        let (status, text) = self.topo.backends[i]
            .ns
            .run(move || http_exchange(addr, &req, Duration::from_secs(5)))?
            .with_context(|| format!("{method} http://{addr}{path}"))?;
        let json = serde_json::from_str(&text).unwrap_or(Value::String(text));
        Ok((status, json))
    }

    /// Adds `n` client addresses to the client's interface, for a load generator with many
    /// sources; returns them. The first [`SEGMENT_CLIENT_SOURCES`] are on the segment
    /// (10.111.0.75 on, above the 64 backends a topology may have); the rest come from
    /// [`EXTRA_CLIENT_NET`], which each backend reaches through the client (its answers go
    /// straight back, not through the load balancer).
    pub fn add_client_sources(&self, n: u16) -> Result<Vec<IpAddr>> {
        if n > MAX_CLIENT_SOURCES {
            bail!("at most {MAX_CLIENT_SOURCES} client sources, not {n}");
        }
        let mut out = Vec::new();
        let mut batch = String::new();
        for k in 0..n {
            let (a, prefix) = match u8::try_from(k) {
                Ok(k) if u16::from(k) < SEGMENT_CLIENT_SOURCES => {
                    (Ipv4Addr::new(10, 111, 0, 75 + k), PREFIX_LEN_V4)
                }
                _ => {
                    let j = k - SEGMENT_CLIENT_SOURCES;
                    (Ipv4Addr::new(10, 111, 4 + (j >> 8) as u8, j as u8), 32)
                }
            };
            batch.push_str(&format!("addr add {a}/{prefix} dev {DEV}\n"));
            out.push(IpAddr::V4(a));
        }
        // One `ip` for all of them: a thousand processes would take seconds per lab.
        let file = self.dir.join("client-sources.batch");
        std::fs::write(&file, batch).with_context(|| format!("writing {}", file.display()))?;
        let path = file.display().to_string();
        self.topo.client.ns.ip(&["-batch", &path])?;
        if n > SEGMENT_CLIENT_SOURCES {
            for b in &self.topo.backends {
                b.ns.ip(&[
                    "route",
                    "add",
                    EXTRA_CLIENT_NET,
                    "via",
                    &CLIENT_V4.to_string(),
                    "dev",
                    DEV,
                ])?;
            }
        }
        Ok(out)
    }

    /// The file backend `i`'s fake exporter serves.
    pub fn metrics_file(&self, i: usize) -> PathBuf {
        self.dir
            .join(format!("exporter-{}.prom", self.topo.backends[i].name))
    }

    pub fn exporter_addr(&self, i: usize) -> SocketAddr {
        SocketAddr::new(self.topo.backends[i].addr(false), EXPORTER_PORT)
    }

    /// Makes backend `i`'s exporter report `t` from its next scrape on.
    pub fn set_telemetry(&self, i: usize, t: &FakeTelemetry) -> Result<()> {
        write_atomic(&self.metrics_file(i), &t.page())
    }

    /// The configuration the daemon runs with (written to `self.config`).
    pub fn config_text(&self) -> String {
        let o = &self.opts;
        let mut s = BTreeMap::<String, BTreeMap<String, String>>::new();
        let mut put = |sec: &str, k: &str, v: String| {
            s.entry(sec.into()).or_default().insert(k.into(), v);
        };
        put(
            "daemon",
            "bpffs",
            toml_str(&self.bpffs.display().to_string()),
        );
        put(
            "daemon",
            "state_file",
            toml_str(&self.state_file.display().to_string()),
        );
        put(
            "admin",
            "socket",
            toml_str(&self.socket.display().to_string()),
        );
        put(
            "admin",
            "audit_log",
            toml_str(&self.audit_log.display().to_string()),
        );
        put("metrics", "enabled", "true".into());
        put("metrics", "listen", toml_str(&self.metrics.to_string()));
        put(
            "dataplane",
            "interfaces",
            format!("[{{ name = \"{DEV}\", mode = \"native\" }}]"),
        );
        put("dataplane", "hash_seed", format!("{SEED:#x}"));
        put(
            "dataplane",
            "encap_source_v4",
            toml_str(&format!("{ENCAP_SRC_V4}/16")),
        );
        put(
            "dataplane",
            "encap_source_v6",
            toml_str(&format!("{ENCAP_SRC_V6}/96")),
        );
        put(
            "dataplane",
            "fallback_mac",
            toml_str(&mac_string(&self.topo.gateway_mac)),
        );
        for (sec, kv) in &o.settings {
            for (k, v) in kv {
                put(sec, k, v.clone());
            }
        }
        let mut text = format!("# daemon lab {} (generated)\n", self.id);
        for sec in ["daemon", "admin", "metrics", "dataplane"] {
            section(&mut text, sec, s.get(sec));
        }
        for v in &o.vips {
            text += &format!(
                "\n[[vip]]\nname = {}\naddress = \"{}\"\nport = {}\nprotocol = \"{}\"\n\
                 priority = {}\nring_size = 4099\nhash = \"{}\"\n",
                toml_str(&v.name),
                v.addr.ip(),
                v.addr.port(),
                v.protocol,
                v.priority,
                v.hash
            );
            if v.inband {
                text += "inband = true\n";
            }
            if v.flow_state != "table" {
                text += &format!("flow_state = \"{}\"\n", v.flow_state);
            }
            if v.affinity_secs > 0 {
                text += &format!("affinity_window = \"{}s\"\n", v.affinity_secs);
            }
            for &i in &v.backends {
                let b = &self.topo.backends[i];
                text += &format!(
                    "\n  [[vip.backend]]\n  address = \"{}\"\n  weight = {}\n  \
                     max_sessions = {}\n  labels = {{ host = \"{}\" }}\n  \
                     health = {{ kind = \"tcp\", port = {HEALTH_PORT} }}\n",
                    b.addr(v.addr.is_ipv6()),
                    v.weight,
                    v.max_sessions,
                    b.name
                );
                if v.telemetry {
                    // A simulated accelerator serves one page per exporter; the fake
                    // exporter serves them all on one.
                    let [dcgm, engine, roce] = if self.opts.accel.is_some() {
                        let at = SocketAddr::new(b.addr(false), HEALTH_PORT);
                        ["dcgm", "metrics", "roce"].map(|p| format!("http://{at}/{p}"))
                    } else {
                        [(); 3].map(|_| format!("http://{}/metrics", self.exporter_addr(i)))
                    };
                    text += &format!(
                        "  dcgm = {{ url = \"{dcgm}\" }}\n  \
                         engine = {{ url = \"{engine}\", kind = \"vllm\" }}\n  \
                         roce = {{ url = \"{roce}\", device = \"mlx5_0\", port = \"1\" }}\n"
                    );
                }
            }
        }
        for sec in s.keys() {
            if !["daemon", "admin", "metrics", "dataplane"].contains(&sec.as_str()) {
                section(&mut text, sec, s.get(sec));
            }
        }
        text
    }

    fn write_config(&self) -> Result<()> {
        write_atomic(&self.config, &self.config_text())
    }

    /// Changes the options and rewrites the configuration (the daemon reads it at its next
    /// start).
    pub fn reconfigure(&mut self, f: impl FnOnce(&mut DaemonLabOptions)) -> Result<()> {
        f(&mut self.opts);
        self.write_config()
    }

    /// The log of the latest daemon start.
    pub fn log_path(&self) -> PathBuf {
        self.dir
            .join(format!("daemon-{}.log", self.starts.saturating_sub(1)))
    }

    /// The latest daemon start's log, without terminal colours.
    pub fn log(&self) -> String {
        strip_ansi(&fs::read_to_string(self.log_path()).unwrap_or_default())
    }

    /// Starts `sluice run --config` in the LB namespace and waits until it has sent
    /// `READY=1` over `$NOTIFY_SOCKET` (as for its Type=notify unit) and answers on the
    /// admin socket.
    pub fn start_daemon(&mut self) -> Result<()> {
        if self.daemon_running() {
            bail!("the daemon is already running");
        }
        let log_path = self.dir.join(format!("daemon-{}.log", self.starts));
        self.starts += 1;
        let log =
            File::create(&log_path).with_context(|| format!("creating {}", log_path.display()))?;
        // The daemon's readiness, as a Type=notify unit reports it.
        let mut notify = NotifySocket::bind(self.dir.join("notify-lb.sock"))?;
        let child = spawn_as_unit(
            &self.topo.lb.ns,
            &self.opts.prefix,
            &self.sluice,
            &["run"],
            &self.config,
            &notify,
            log,
        )
        .context("starting the daemon with nsenter")?;
        self.daemon = Some(child);
        let deadline = Instant::now() + START_TIMEOUT;
        loop {
            // Ready only once it told "systemd" so and answers on its admin socket.
            if notify.ready() && matches!(self.api("GET", "/v1/status", None), Ok((200, _))) {
                return Ok(());
            }
            if let Some(status) = self
                .daemon
                .as_mut()
                .and_then(|c| c.try_wait().ok().flatten())
            {
                self.daemon = None;
                bail!(
                    "the daemon exited ({status}) before answering on {}; its log:\n{}",
                    self.socket.display(),
                    tail(&self.log(), 40)
                );
            }
            if Instant::now() >= deadline {
                bail!(
                    "the daemon did not send READY=1 (got it: {}) and answer on {} within \
                     {START_TIMEOUT:?}; its log:\n{}",
                    notify.ready(),
                    self.socket.display(),
                    tail(&self.log(), 40)
                );
            }
            thread::sleep(Duration::from_millis(50));
        }
    }

    pub fn daemon_running(&mut self) -> bool {
        match self.daemon.as_mut().map(|c| c.try_wait()) {
            Some(Ok(None)) => true,
            Some(_) => {
                self.daemon = None;
                false
            }
            None => false,
        }
    }

    pub fn daemon_pid(&self) -> Option<u32> {
        self.daemon.as_ref().map(Child::id)
    }

    fn signal_and_wait(&mut self, sig: i32, timeout: Duration) -> Result<ExitStatus> {
        signal_and_wait(&mut self.daemon, "the daemon", sig, timeout)
    }

    /// SIGHUP: the daemon re-reads its configuration file.
    pub fn sighup(&self) -> Result<()> {
        let pid = self
            .daemon_pid()
            .ok_or_else(|| anyhow!("the daemon is not running"))?;
        // SAFETY: a plain kill(2) of our own child.
        if unsafe { libc::kill(pid as i32, libc::SIGHUP) } != 0 {
            bail!("SIGHUP to {pid}: {}", std::io::Error::last_os_error());
        }
        Ok(())
    }

    /// A crash: SIGKILL, and wait until the process is gone.
    pub fn kill9(&mut self) -> Result<()> {
        self.signal_and_wait(libc::SIGKILL, Duration::from_secs(10))
            .map(drop)
    }

    /// SIGTERM and wait (15 s at most) for the daemon to exit; returns its exit status.
    pub fn stop(&mut self) -> Result<ExitStatus> {
        self.signal_and_wait(libc::SIGTERM, Duration::from_secs(15))
    }

    /// Stops the daemon if it runs (SIGTERM) and starts it again with the configuration file.
    pub fn restart(&mut self) -> Result<()> {
        if self.daemon_running() {
            self.stop()?;
        }
        self.start_daemon()
    }

    /// Runs `sluice --socket <lab socket> <args>`: (exit code, stdout, stderr).
    pub fn cli(&self, args: &[&str]) -> (i32, String, String) {
        let out = self
            .cli_output(args)
            .unwrap_or_else(|e| panic!("running sluice {args:?}: {e:#}"));
        (out.status.code().unwrap_or(-1), out.stdout, out.stderr)
    }

    /// `sluice --socket <lab socket> <args>` without panicking: its exit status and output.
    pub fn cli_output(&self, args: &[&str]) -> Result<CmdOutput> {
        let mut cmd = Command::new(&self.sluice);
        cmd.arg("--socket").arg(&self.socket).args(args);
        run_output(&mut cmd, CLI_TIMEOUT)
    }

    /// `sluice <args>`, which must succeed: its stdout.
    pub fn cli_ok(&self, args: &[&str]) -> String {
        let (code, out, err) = self.cli(args);
        assert_eq!(
            code,
            0,
            "`sluice {}` failed with {code}: {err}{out}",
            args.join(" ")
        );
        out
    }

    /// `sluice --json <args>`, which must succeed: its JSON.
    pub fn cli_json(&self, args: &[&str]) -> Value {
        let mut all = vec!["--json"];
        all.extend_from_slice(args);
        let out = self.cli_ok(&all);
        serde_json::from_str(&out)
            .unwrap_or_else(|e| panic!("`sluice {}`: not JSON ({e}): {out}", all.join(" ")))
    }

    /// One admin API request on the lab's socket: (status, JSON).
    pub fn api(&self, method: &str, path: &str, body: Option<&Value>) -> Result<(u16, Value)> {
        Client::new(&self.socket).request(method, path, body)
    }

    /// `sluice backend list <vip> --json`'s backends.
    pub fn backends(&self, vip: &str) -> Vec<Value> {
        self.cli_json(&["backend", "list", vip])["backends"]
            .as_array()
            .cloned()
            .unwrap_or_default()
    }

    /// The backend entry of `addr` in `sluice backend list <vip> --json`.
    pub fn backend(&self, vip: &str, addr: IpAddr) -> Option<Value> {
        let a = addr.to_string();
        self.backends(vip)
            .into_iter()
            .find(|b| b["address"].as_str() == Some(&a))
    }

    /// Active flows per backend name of `vip`, from `sluice flows --json`.
    pub fn flows(&self, vip: &str) -> BTreeMap<String, u64> {
        let v = self.cli_json(&["flows", "--summary"]);
        let mut out = BTreeMap::new();
        for x in v["vips"].as_array().into_iter().flatten() {
            if x["vip"].as_str() != Some(vip) {
                continue;
            }
            for b in x["backends"].as_array().into_iter().flatten() {
                let name = b["address"]
                    .as_str()
                    .and_then(|a| a.parse().ok())
                    .and_then(|a| self.backend_name(a))
                    .unwrap_or_else(|| b["address"].to_string());
                out.insert(name, b["active_flows"].as_u64().unwrap_or(0));
            }
        }
        out
    }

    /// `sluice events --json`'s events.
    pub fn events(&self) -> Vec<Value> {
        self.cli_json(&["events"])["events"]
            .as_array()
            .cloned()
            .unwrap_or_default()
    }

    /// The data plane's global counters from `sluice stats --json`.
    pub fn counters(&self) -> BTreeMap<String, u64> {
        self.cli_json(&["stats"])["global"]
            .as_object()
            .map(|m| {
                m.iter()
                    .map(|(k, v)| (k.clone(), v.as_u64().unwrap_or(0)))
                    .collect()
            })
            .unwrap_or_default()
    }

    /// The topology name of the backend with this address (v4 or v6).
    pub fn backend_name(&self, addr: IpAddr) -> Option<String> {
        self.topo
            .backends
            .iter()
            .find(|b| b.addr(false) == addr || b.addr(true) == addr)
            .map(|b| b.name.clone())
    }

    /// Backend `i`'s address in the family of `vip`.
    pub fn backend_addr(&self, i: usize, vip: SocketAddr) -> IpAddr {
        self.topo.backends[i].addr(vip.is_ipv6())
    }

    /// Whether an XDP program is attached to the LB's eth0: `ip link show` prints a
    /// `prog/xdp id N` line (`prog/xdpgeneric` in generic mode) for an attached program.
    pub fn lb_has_xdp(&self) -> Result<bool> {
        let out = self.topo.lb.ns.ip(&["link", "show", DEV])?;
        Ok(out.lines().any(|l| l.trim_start().starts_with("prog/xdp")))
    }

    /// Opens a token stream from the client to `vip` (`tokens` tokens, one every
    /// `interval_ms`) and reads it to the end on its own thread: see [`Running`].
    pub fn stream(&self, vip: SocketAddr, tokens: u32, interval_ms: u32) -> Result<Running> {
        self.stream_from(None, vip, tokens, interval_ms)
    }

    /// [`DaemonLab::stream`] from client address `src` ([`DaemonLab::add_client_sources`]).
    pub fn stream_from(
        &self,
        src: Option<IpAddr>,
        vip: SocketAddr,
        tokens: u32,
        interval_ms: u32,
    ) -> Result<Running> {
        self.stream_waiting(src, vip, tokens, interval_ms, Duration::from_secs(5))
    }

    /// [`DaemonLab::stream_from`] whose reads wait up to `read_timeout` for the next token
    /// (5 s there). For streams across a gap in the data plane: the client's ACKs are lost
    /// while nothing steers them, so the server, its window full, resends on its doubling
    /// retransmission timer (from 200 ms: at 0.2, 0.6, 1.4, 3.0, 6.2, 12.6 s), and a gap of
    /// a little over 3 s stalls the stream about 6 s, which is slow, not broken.
    pub fn stream_waiting(
        &self,
        src: Option<IpAddr>,
        vip: SocketAddr,
        tokens: u32,
        interval_ms: u32,
        read_timeout: Duration,
    ) -> Result<Running> {
        let s = TokenStream::open_from(
            &self.topo.client.ns,
            src,
            vip,
            tokens,
            interval_ms,
            read_timeout,
        )?;
        let backend = s.backend.clone();
        let local = s.local;
        // Generous: the whole stream's duration plus slack for a loaded machine.
        let deadline = Instant::now()
            + Duration::from_millis(tokens as u64 * interval_ms as u64) * 2
            + Duration::from_secs(15);
        let h = thread::spawn(move || {
            let mut s = s;
            let r = s.read_to_end(deadline);
            let received = s.received;
            s.close();
            // Context, not a new error: a caller can still find the io::Error (a reset).
            r.map(|_| received)
                .with_context(|| format!("{received} tokens received"))
        });
        Ok(Running {
            backend,
            local,
            tokens,
            handle: Some(h),
        })
    }

    /// A short session: connects to `vip`, reads a one-token stream and returns the backend
    /// that greeted.
    pub fn greet(&self, vip: SocketAddr, timeout: Duration) -> Result<String> {
        let mut s = TokenStream::open(&self.topo.client.ns, vip, 1, 1, timeout)?;
        s.read_to_end(Instant::now() + timeout)?;
        let b = s.backend.clone();
        s.close();
        Ok(b)
    }

    /// `n` short sessions opened now, 6 at a time: all must succeed; returns how many each
    /// backend greeted.
    pub fn sessions(&self, vip: SocketAddr, n: usize) -> BTreeMap<String, usize> {
        let results = self.greet_many(vip, n, 6);
        let errors: Vec<String> = results
            .iter()
            .filter_map(|r| r.as_ref().err().map(|e| format!("{e:#}")))
            .collect();
        assert!(
            errors.is_empty(),
            "{} of {n} new sessions failed:\n{}",
            errors.len(),
            errors.join("\n")
        );
        tally(results.iter().filter_map(|r| r.as_ref().ok()))
    }

    /// `n` short sessions, `parallel` at a time: the greeting backend (or the error) of each.
    pub fn greet_many(&self, vip: SocketAddr, n: usize, parallel: usize) -> Vec<Result<String>> {
        let mut out = Vec::with_capacity(n);
        let ns = self.topo.client.ns.clone();
        while out.len() < n {
            let batch = parallel.min(n - out.len());
            let hs: Vec<_> = (0..batch)
                .map(|_| {
                    let ns = ns.clone();
                    thread::spawn(move || -> Result<String> {
                        let t = Duration::from_secs(5);
                        let mut s = TokenStream::open(&ns, vip, 1, 1, t)?;
                        s.read_to_end(Instant::now() + t)?;
                        let b = s.backend.clone();
                        s.close();
                        Ok(b)
                    })
                })
                .collect();
            for h in hs {
                out.push(
                    h.join()
                        .unwrap_or_else(|_| Err(anyhow!("session thread panicked"))),
                );
            }
        }
        out
    }

    /// A TCP connection attempt from the client namespace, bounded by `timeout`.
    pub fn connect(&self, vip: SocketAddr, timeout: Duration) -> std::io::Result<TcpStream> {
        self.topo
            .client
            .ns
            .run(move || TcpStream::connect_timeout(&vip, timeout))
            .map_err(std::io::Error::other)?
    }

    /// Binds the daemon's metrics address in the LB namespace, so that a daemon start fails
    /// on it while the listener lives.
    pub fn take_metrics_port(&self) -> Result<std::net::TcpListener> {
        let addr = self.metrics;
        self.topo
            .lb
            .ns
            .run(move || std::net::TcpListener::bind(addr))?
            .with_context(|| format!("binding {addr}"))
    }

    /// GET of the daemon's metrics page (from inside the LB namespace).
    pub fn metrics_page(&self) -> Result<String> {
        let addr = self.metrics;
        self.topo.lb.ns.run(move || -> Result<String> {
            let mut s = TcpStream::connect_timeout(&addr, Duration::from_secs(5))?;
            s.set_read_timeout(Some(Duration::from_secs(10)))?;
            s.write_all(b"GET /metrics HTTP/1.1\r\nHost: lab\r\nConnection: close\r\n\r\n")?;
            let mut out = String::new();
            s.read_to_string(&mut out)?;
            Ok(out)
        })?
    }
}

impl Drop for DaemonLab {
    fn drop(&mut self) {
        if thread::panicking() {
            eprintln!(
                "daemon lab {}: the end of the daemon's log ({}):\n{}",
                self.id,
                self.log_path().display(),
                tail(&self.log(), 60)
            );
        }
        if self.daemon_running() && self.stop().is_err() {
            let _ = self.kill9();
        }
        if let Err(e) = remove_pinned(&self.bpffs) {
            eprintln!("daemon lab {}: {e:#}", self.id);
        }
        // Stopped (and their logs shown) while their directory is still there.
        self.backend_hosts.clear();
        if let Err(e) = fs::remove_dir_all(&self.dir) {
            eprintln!(
                "daemon lab {}: removing {}: {e}",
                self.id,
                self.dir.display()
            );
        }
    }
}

/// A stream being read to its end on its own thread.
pub struct Running {
    /// The backend that greeted.
    pub backend: String,
    pub local: SocketAddr,
    pub tokens: u32,
    handle: Option<thread::JoinHandle<Result<u32>>>,
}

impl Running {
    /// Waits for the stream's end: Ok(tokens) when it completed in order from its backend.
    pub fn finish(mut self) -> Result<u32> {
        self.handle
            .take()
            .expect("finished once")
            .join()
            .unwrap_or_else(|_| Err(anyhow!("stream thread panicked")))
    }

    pub fn is_finished(&self) -> bool {
        self.handle.as_ref().is_none_or(|h| h.is_finished())
    }

    /// Waits for the stream's end: None when every token came, else what went wrong, naming
    /// the stream and its backend.
    pub fn broken(self) -> Option<String> {
        let (backend, local, tokens) = (self.backend.clone(), self.local, self.tokens);
        match self.finish() {
            Ok(got) if got == tokens => None,
            Ok(got) => Some(format!("{local} on {backend}: {got} of {tokens} tokens")),
            Err(e) => Some(format!("{local} on {backend}: {e:#}")),
        }
    }
}

/// Polls `f` until it returns `Some`, at most `timeout`; fails naming `what` and the last
/// state `f` reported.
pub fn wait_for<T>(
    what: &str,
    timeout: Duration,
    mut f: impl FnMut() -> Result<Option<T>, String>,
) -> Result<T> {
    let deadline = Instant::now() + timeout;
    let mut last = String::new();
    loop {
        match f() {
            Ok(Some(v)) => return Ok(v),
            Ok(None) => {}
            Err(state) => last = state,
        }
        if Instant::now() >= deadline {
            bail!("{what}: not within {timeout:?}; last seen: {last}");
        }
        thread::sleep(Duration::from_millis(100));
    }
}

/// Counts of each distinct value.
pub fn tally<'a>(names: impl IntoIterator<Item = &'a String>) -> BTreeMap<String, usize> {
    let mut m = BTreeMap::new();
    for n in names {
        *m.entry(n.clone()).or_default() += 1;
    }
    m
}

fn toml_str(s: &str) -> String {
    format!("{s:?}")
}

fn section(text: &mut String, name: &str, kv: Option<&BTreeMap<String, String>>) {
    let Some(kv) = kv else { return };
    *text += &format!("\n[{name}]\n");
    for (k, v) in kv {
        *text += &format!("{k} = {v}\n");
    }
}

/// Sends `req` (a whole HTTP/1.1 request with `Connection: close`) to `addr` and reads the
/// answer: (status, body), the body de-chunked.
pub fn http_exchange(addr: SocketAddr, req: &str, timeout: Duration) -> Result<(u16, String)> {
    let mut s = TcpStream::connect_timeout(&addr, timeout)?;
    s.set_read_timeout(Some(timeout))?;
    s.write_all(req.as_bytes())?;
    let mut raw = Vec::new();
    s.read_to_end(&mut raw)?;
    let text = String::from_utf8_lossy(&raw);
    let (head, body) = text
        .split_once("\r\n\r\n")
        .ok_or_else(|| anyhow!("no end of headers in {} bytes", raw.len()))?;
    let status = head
        .split_whitespace()
        .nth(1)
        .and_then(|c| c.parse().ok())
        .ok_or_else(|| anyhow!("bad status line: {}", head.lines().next().unwrap_or("")))?;
    let chunked = head
        .to_ascii_lowercase()
        .contains("transfer-encoding: chunked");
    Ok((status, if chunked { dechunk(body) } else { body.into() }))
}

/// The data of a chunked body (sizes in hex, each chunk followed by CRLF).
fn dechunk(mut body: &str) -> String {
    let mut out = String::new();
    while let Some((size, rest)) = body.split_once("\r\n") {
        let n = usize::from_str_radix(size.split(';').next().unwrap_or("").trim(), 16).unwrap_or(0);
        if n == 0 || rest.len() < n {
            break;
        }
        out.push_str(&rest[..n]);
        body = rest[n..].trim_start_matches("\r\n");
    }
    out
}

/// Writes `path` through a temporary file and a rename, so no reader sees half of it.
pub fn write_atomic(path: &Path, text: &str) -> Result<()> {
    let tmp = path.with_extension("tmp");
    fs::write(&tmp, text).with_context(|| format!("writing {}", tmp.display()))?;
    fs::rename(&tmp, path).with_context(|| format!("renaming to {}", path.display()))?;
    Ok(())
}

/// The last `n` lines of `text`.
pub fn tail(text: &str, n: usize) -> String {
    let lines: Vec<&str> = text.lines().collect();
    lines[lines.len().saturating_sub(n)..].join("\n")
}

fn strip_ansi(s: &str) -> String {
    let mut out = String::with_capacity(s.len());
    let mut chars = s.chars();
    while let Some(c) = chars.next() {
        if c == '\u{1b}' {
            // CSI: ESC [ ... final byte in @..~
            if chars.next() == Some('[') {
                for c in chars.by_ref() {
                    if ('@'..='~').contains(&c) {
                        break;
                    }
                }
            }
            continue;
        }
        out.push(c);
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn chunked_bodies_are_joined() {
        assert_eq!(
            dechunk("4\r\n{\"a\"\r\n3\r\n: 1\r\n1\r\n}\r\n0\r\n\r\n"),
            "{\"a\": 1}"
        );
    }

    #[test]
    fn ansi_codes_are_stripped() {
        assert_eq!(
            strip_ansi("\u{1b}[2m2026\u{1b}[0m \u{1b}[32m INFO\u{1b}[0m ready"),
            "2026  INFO ready"
        );
    }

    #[test]
    fn the_fake_page_has_every_exporter() {
        let p = FakeTelemetry {
            ecn_per_s: 5000.0,
            ..FakeTelemetry::default()
        }
        .page();
        for m in [
            "DCGM_FI_DEV_GPU_UTIL{",
            "vllm:num_requests_waiting{",
            "vllm:kv_cache_usage_perc{",
            "node_infiniband_np_ecn_marked_roce_packets_received_total{device=\"mlx5_0\",port=\"1\"} {{counter:5000}}",
        ] {
            assert!(p.contains(m), "{m} missing from\n{p}");
        }
    }
}
