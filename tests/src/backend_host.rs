//! `sluice backend-host run` on a lab backend, started the way its systemd unit starts it:
//! the same arguments, in the backend's network namespace (`nsenter --net`, which keeps the
//! host's /sys/fs/bpf), optionally behind a command prefix (the package test reduces the
//! capabilities with `setpriv` to the unit's set), and with `$NOTIFY_SOCKET` pointing at a
//! datagram socket the lab reads: a start is complete when the daemon sends `READY=1`, as
//! for a `Type=notify` unit.
//!
//! Dropping it stops the daemon (SIGTERM, then SIGKILL) and removes its pins.

use std::{
    fs::{self, File},
    io::{Read, Write},
    net::{IpAddr, SocketAddr, TcpStream},
    os::unix::{net::UnixDatagram, process::CommandExt},
    path::{Path, PathBuf},
    process::{Child, Command, ExitStatus, Stdio},
    thread,
    time::{Duration, Instant},
};

use anyhow::{anyhow, bail, Context, Result};
use aya::maps::{Map, MapData, PerCpuArray};
use lb_common::{maps, stat};
use sluice::dataplane::remove_pinned;

use crate::netns::{tool, Netns, Topology, DEV};

/// How long a start may take until `READY=1`.
pub const READY_TIMEOUT: Duration = Duration::from_secs(30);
/// Where every lab backend host serves metrics (each in its own namespace).
pub const METRICS: &str = "127.0.0.1:9465";

/// One backend host daemon of a lab backend.
pub struct BackendHost {
    /// The backend's name (for messages).
    pub name: String,
    pub ns: Netns,
    /// The `sluice` binary.
    pub sluice: PathBuf,
    /// Put before the binary (e.g. `setpriv ...`); empty for none.
    pub prefix: Vec<String>,
    pub config: PathBuf,
    pub bpffs: PathBuf,
    /// Logs (`backend-host-<name>-<k>.log`) and the notify socket.
    pub dir: PathBuf,
    child: Option<Child>,
    starts: usize,
}

/// The configuration the lab gives a backend host: decapsulation on eth0 (native), `vips`
/// on lo, the given pin directory, metrics on [`METRICS`].
pub fn config_text(vips: &[IpAddr], bpffs: &Path) -> String {
    let vips: Vec<String> = vips.iter().map(|v| format!("\"{v}\"")).collect();
    format!(
        "interfaces = [{{ name = \"{DEV}\", mode = \"native\" }}]\nvips = [{}]\nbpffs = \"{}\"\n\
         keep_dataplane_on_exit = false\nclient_mtu = 1400\n\n[metrics]\nlisten = \"{METRICS}\"\n",
        vips.join(", "),
        bpffs.display()
    )
}

/// Sends `sig` to the daemon in `child` (`what` names it in errors) and waits until it exits
/// (at most `timeout`); the slot is emptied once it has.
pub fn signal_and_wait(
    child: &mut Option<Child>,
    what: &str,
    sig: i32,
    timeout: Duration,
) -> Result<ExitStatus> {
    let c = child
        .as_mut()
        .ok_or_else(|| anyhow!("{what} is not running"))?;
    // SAFETY: a plain kill(2) of our own child.
    unsafe { libc::kill(c.id() as i32, sig) };
    let deadline = Instant::now() + timeout;
    loop {
        if let Some(s) = c.try_wait()? {
            *child = None;
            return Ok(s);
        }
        if Instant::now() >= deadline {
            bail!("{what} did not exit within {timeout:?} of signal {sig}");
        }
        thread::sleep(Duration::from_millis(10));
    }
}

/// Starts `<prefix> sluice <args> --config <config>` in `ns` as its systemd unit would: in
/// the namespace through nsenter, readiness over `notify`'s `$NOTIFY_SOCKET`, output to `log`,
/// in its own process group; it dies with the test thread that started it.
pub fn spawn_as_unit(
    ns: &Netns,
    prefix: &[String],
    sluice: &Path,
    args: &[&str],
    config: &Path,
    notify: &NotifySocket,
    log: File,
) -> Result<Child> {
    let mut cmd = Command::new(tool("nsenter")?);
    cmd.arg(format!("--net={}", ns.path().display()))
        .arg("--")
        .args(prefix)
        .arg(sluice)
        .args(args)
        .arg("--config")
        .arg(config)
        .env("NOTIFY_SOCKET", &notify.path)
        .env("NO_COLOR", "1")
        .env_remove("RUST_LOG")
        .stdin(Stdio::null())
        .stdout(log.try_clone()?)
        .stderr(log)
        .process_group(0);
    // SAFETY: prctl is async-signal-safe; nsenter (and setpriv) exec in the same process,
    // which keeps the signal: the daemon dies with the test thread that started it.
    unsafe {
        cmd.pre_exec(|| {
            if libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGKILL) != 0 {
                return Err(std::io::Error::last_os_error());
            }
            Ok(())
        });
    }
    Ok(cmd.spawn()?)
}

/// The lab's side of systemd's readiness protocol: a datagram socket whose path a daemon
/// gets as `$NOTIFY_SOCKET`. Removed when dropped.
pub struct NotifySocket {
    pub path: PathBuf,
    sock: UnixDatagram,
    ready: bool,
}

impl NotifySocket {
    pub fn bind(path: PathBuf) -> Result<NotifySocket> {
        let _ = fs::remove_file(&path);
        let sock =
            UnixDatagram::bind(&path).with_context(|| format!("binding {}", path.display()))?;
        sock.set_read_timeout(Some(Duration::from_millis(100)))?;
        Ok(NotifySocket {
            path,
            sock,
            ready: false,
        })
    }

    /// Whether `READY=1` has arrived (waits up to 100 ms for a datagram).
    pub fn ready(&mut self) -> bool {
        let mut buf = [0u8; 512];
        while !self.ready {
            let Ok(n) = self.sock.recv(&mut buf) else {
                break;
            };
            self.ready = String::from_utf8_lossy(&buf[..n])
                .lines()
                .any(|l| l == "READY=1");
        }
        self.ready
    }
}

impl Drop for NotifySocket {
    fn drop(&mut self) {
        let _ = fs::remove_file(&self.path);
    }
}

impl BackendHost {
    /// Writes the configuration (see [`config_text`]) into `dir`; starts nothing.
    pub fn new(
        name: &str,
        ns: Netns,
        sluice: &Path,
        vips: &[IpAddr],
        bpffs: PathBuf,
        dir: &Path,
    ) -> Result<BackendHost> {
        let config = dir.join(format!("backend-host-{name}.toml"));
        fs::write(&config, config_text(vips, &bpffs))
            .with_context(|| format!("writing {}", config.display()))?;
        Ok(BackendHost {
            name: name.into(),
            ns,
            sluice: sluice.into(),
            prefix: Vec::new(),
            config,
            bpffs,
            dir: dir.into(),
            child: None,
            starts: 0,
        })
    }

    /// Where the lab has this host write its QUIC server IDs (`quic_file`), when it does.
    pub fn quic_file(&self) -> PathBuf {
        self.dir.join(format!("quic-{}.json", self.name))
    }

    pub fn log_path(&self) -> PathBuf {
        self.dir.join(format!(
            "backend-host-{}-{}.log",
            self.name,
            self.starts.saturating_sub(1)
        ))
    }

    /// The latest start's log.
    pub fn log(&self) -> String {
        fs::read_to_string(self.log_path()).unwrap_or_default()
    }

    /// Starts `sluice backend-host run --config <file>` and waits for its `READY=1`.
    pub fn start(&mut self) -> Result<()> {
        if self.running() {
            bail!("the backend host of {} is already running", self.name);
        }
        let mut notify = NotifySocket::bind(self.dir.join(format!("notify-{}.sock", self.name)))?;
        let log_path = self
            .dir
            .join(format!("backend-host-{}-{}.log", self.name, self.starts));
        self.starts += 1;
        let log =
            File::create(&log_path).with_context(|| format!("creating {}", log_path.display()))?;
        self.child = Some(
            spawn_as_unit(
                &self.ns,
                &self.prefix,
                &self.sluice,
                &["backend-host", "run"],
                &self.config,
                &notify,
                log,
            )
            .context("starting the backend host with nsenter")?,
        );
        let deadline = Instant::now() + READY_TIMEOUT;
        loop {
            if notify.ready() {
                return Ok(());
            }
            if let Some(status) = self
                .child
                .as_mut()
                .and_then(|c| c.try_wait().ok().flatten())
            {
                self.child = None;
                bail!(
                    "the backend host of {} exited ({status}) before READY=1; its log:\n{}",
                    self.name,
                    self.log()
                );
            }
            if Instant::now() >= deadline {
                bail!(
                    "the backend host of {} sent no READY=1 within {READY_TIMEOUT:?}; its log:\n{}",
                    self.name,
                    self.log()
                );
            }
        }
    }

    /// SIGHUP (`systemctl reload`).
    pub fn reload(&self) -> Result<()> {
        let pid = self
            .pid()
            .ok_or_else(|| anyhow!("the backend host of {} is not running", self.name))?;
        // SAFETY: a plain kill(2) of our own child.
        if unsafe { libc::kill(pid as i32, libc::SIGHUP) } != 0 {
            bail!("SIGHUP to {pid}: {}", std::io::Error::last_os_error());
        }
        Ok(())
    }

    /// The daemon's pid (nsenter and a prefix such as setpriv exec it in place).
    pub fn pid(&self) -> Option<u32> {
        self.child.as_ref().map(Child::id)
    }

    pub fn running(&mut self) -> bool {
        match self.child.as_mut().map(|c| c.try_wait()) {
            Some(Ok(None)) => true,
            Some(_) => {
                self.child = None;
                false
            }
            None => false,
        }
    }

    fn signal_and_wait(&mut self, sig: i32, timeout: Duration) -> Result<ExitStatus> {
        let what = format!("the backend host of {}", self.name);
        signal_and_wait(&mut self.child, &what, sig, timeout)
    }

    /// A crash: SIGKILL, and wait until the process is gone.
    pub fn kill9(&mut self) -> Result<()> {
        self.signal_and_wait(libc::SIGKILL, Duration::from_secs(10))
            .map(drop)
    }

    /// SIGTERM and wait (15 s at most); returns the exit status.
    pub fn stop(&mut self) -> Result<ExitStatus> {
        self.signal_and_wait(libc::SIGTERM, Duration::from_secs(15))
    }

    /// `GET /metrics` from the daemon (inside the backend's namespace).
    pub fn metrics(&self) -> Result<String> {
        let addr: SocketAddr = METRICS.parse()?;
        self.ns.run(move || -> Result<String> {
            let mut s = TcpStream::connect_timeout(&addr, Duration::from_secs(5))?;
            s.set_read_timeout(Some(Duration::from_secs(10)))?;
            s.write_all(b"GET /metrics HTTP/1.1\r\nHost: lab\r\nConnection: close\r\n\r\n")?;
            let mut out = String::new();
            s.read_to_string(&mut out)?;
            Ok(out)
        })?
    }

    /// A sample's value on the metrics page (`name{labels}` exactly as written there).
    pub fn metric(&self, sample: &str) -> Result<u64> {
        let page = self.metrics()?;
        page.lines()
            .find_map(|l| l.strip_prefix(sample)?.strip_prefix(' ')?.parse().ok())
            .ok_or_else(|| anyhow!("no sample {sample} on the backend host's page:\n{page}"))
    }
}

/// Starts a backend host on every backend of `topo`, each pinned at
/// `/sys/fs/bpf/<id>-<backend>`, with its files in `dir`; fails (stopping those started)
/// when one does not become ready.
pub fn start_all(
    topo: &Topology,
    sluice: &Path,
    prefix: &[String],
    vips: &[IpAddr],
    id: &str,
    dir: &Path,
) -> Result<Vec<BackendHost>> {
    let mut hosts = Vec::new();
    for b in &topo.backends {
        let mut h = BackendHost::new(
            &b.name,
            b.ns.clone(),
            sluice,
            vips,
            Path::new("/sys/fs/bpf").join(format!("{id}-{}", b.name)),
            dir,
        )?;
        h.prefix = prefix.to_vec();
        h.start()?;
        hosts.push(h);
    }
    Ok(hosts)
}

/// A directory removed when dropped (put it after the [`BackendHost`]s whose files it holds).
pub struct TempDir(pub PathBuf);

impl TempDir {
    pub fn create(path: PathBuf) -> Result<TempDir> {
        let _ = fs::remove_dir_all(&path);
        fs::create_dir_all(&path).with_context(|| format!("creating {}", path.display()))?;
        Ok(TempDir(path))
    }
}

impl Drop for TempDir {
    fn drop(&mut self) {
        if let Err(e) = fs::remove_dir_all(&self.0) {
            eprintln!("removing {}: {e}", self.0.display());
        }
    }
}

impl BackendHost {
    /// Its `sluice_decap` counters, read from the pinned STATS map (indexed by
    /// `lb_common::stat`), whether or not the daemon runs.
    pub fn stats(&self) -> Result<Vec<u64>> {
        let pin = self.bpffs.join(maps::STATS);
        let data = MapData::from_pin(&pin).with_context(|| format!("opening {}", pin.display()))?;
        let a: PerCpuArray<MapData, u64> = PerCpuArray::try_from(Map::PerCpuArray(data))?;
        (0..stat::COUNT)
            .map(|i| Ok(a.get(&i, 0)?.iter().sum()))
            .collect()
    }
}

impl Drop for BackendHost {
    fn drop(&mut self) {
        if thread::panicking() && self.starts > 0 {
            eprintln!(
                "backend host {}: its log ({}):\n{}",
                self.name,
                self.log_path().display(),
                self.log()
            );
        }
        if self.running() && self.stop().is_err() {
            let _ = self.kill9();
        }
        if let Err(e) = remove_pinned(&self.bpffs) {
            eprintln!("backend host {}: {e:#}", self.name);
        }
    }
}
