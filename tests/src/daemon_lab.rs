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

mod cli;
mod config;
mod environment;
mod traffic;
mod util;

use std::{
    fs::{self, File},
    net::{IpAddr, Ipv4Addr, SocketAddr, TcpListener},
    path::{Path, PathBuf},
    process::{Child, ExitStatus},
    thread,
    time::{Duration, Instant},
};

use anyhow::{anyhow, bail, Context, Result};
use serde_json::Value;
use sluice::dataplane::remove_pinned;

use self::util::strip_ansi;
pub use self::{
    config::{
        hex, lab_quic_server_id, Accel, DaemonLabOptions, FakeTelemetry, QuicCid, QuicServe,
        TenantDef, VipDef,
    },
    environment::{
        next_lab_id, require_daemon_prerequisites, require_sluice_daemon_prerequisites,
        sluice_binary, sweep_stale, upgrade_binary, UPGRADE_TARGET_DIR,
    },
    traffic::Running,
    util::{http_exchange, tail, tally, wait_for, write_atomic},
};
use crate::{
    backend_host::{signal_and_wait, spawn_as_unit, start_all, BackendHost, NotifySocket},
    netns::{switch_port, ProcId, Topology, CLIENT_V4, DEV, PREFIX_LEN_V4, TCP_PORT, VIP4, VIP6},
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
        lab.give_backend_hosts_quic_ids()?;
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

    /// With [`DaemonLabOptions::quic`]: every backend host's VIP table gives the QUIC VIPs
    /// this backend's server ID ([`lab_quic_server_id`]), and the host writes them to its
    /// `quic_file` (restarted: `quic_file` is read at start; waits until the file is there).
    fn give_backend_hosts_quic_ids(&mut self) -> Result<()> {
        let Some(q) = self.opts.quic.clone() else {
            return Ok(());
        };
        for (i, h) in self.backend_hosts.iter_mut().enumerate() {
            let mut text = fs::read_to_string(&h.config)
                .with_context(|| format!("reading {}", h.config.display()))?;
            let id = hex(&lab_quic_server_id(i, q.cid.server_id_len));
            let mut vips: Vec<IpAddr> = q.listen.iter().map(|a| a.ip()).collect();
            vips.dedup();
            for v in vips {
                let plain = format!("\"{v}\"");
                if !text.contains(&plain) {
                    bail!("{}: VIP {v} is not in the backend host's vips", h.name);
                }
                text = text.replacen(
                    &plain,
                    &format!(
                        "{{ address = \"{v}\", quic_server_id = \"{id}\", quic_server_id_len = \
                         {}, quic_config_rotation = {} }}",
                        q.cid.server_id_len, q.cid.rotation
                    ),
                    1,
                );
            }
            let file = h.quic_file();
            let _ = fs::remove_file(&file);
            text = text.replacen(
                "\n[metrics]",
                &format!("quic_file = \"{}\"\n\n[metrics]", file.display()),
                1,
            );
            write_atomic(&h.config, &text)?;
            h.stop()?;
            h.start()?;
            wait_for(
                &format!("{} to write {}", h.name, file.display()),
                Duration::from_secs(10),
                || Ok(file.exists().then_some(())),
            )?;
        }
        Ok(())
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
            if let Some(q) = &self.opts.quic {
                for a in &q.listen {
                    args.push("--quic".into());
                    args.push(a.to_string());
                }
                // The server ID as a deployed server learns it: from its backend host.
                args.push("--quic-id-file".into());
                args.push(self.backend_hosts[i].quic_file().display().to_string());
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
