//! Network-namespace lab: a one-armed load balancer with direct server return on a shared L2
//! segment, as in production, built from namespaces and veth pairs.
//!
//! ```text
//!                      switch namespace  <id>-sw
//!            br0 (10.111.0.1, fd00:111::1: the segment's router, the fallback next hop)
//!        v-client        v-lb  (sluice_pass)         v-b0      v-b1     v-b2 ...
//!           |             |                           |         |        |
//!    eth0 10.111.0.10  eth0 10.111.0.2             eth0 .11  eth0 .12  eth0 .13
//!    <id>-client       <id>-lb (sluice_xdp, native)   <id>-b0   <id>-b1   <id>-b2
//!    VIP routes via    forwarding on                  VIP on lo, sluice_decap (native),
//!    the LB            (bpf_fib_lookup needs it)      server process
//! ```
//!
//! Client packets to a VIP go to the LB, whose XDP program encapsulates them (IPIP or IPv6 in
//! IPv6) and sends them back out of the same port (XDP_TX) to a backend; the backend's XDP
//! program strips the outer header and the stack delivers the client's packet to the VIP on
//! `lo`; the reply goes from the backend straight to the client.
//!
//! Every device lives inside a lab namespace (veth pairs are created with both ends already in
//! their namespaces), so nothing is added to the root namespace and deleting the namespaces
//! removes everything. [`Topology`] deletes its namespaces and kills the processes it started
//! when dropped, also while a test panics; [`sweep_stale`] (run by [`Topology::build`])
//! removes what a crashed earlier run left. Names are `sl<pid>-<n>-<host>`: unique per run
//! and per lab, and the pid says whether the run that made them is still alive.
//!
//! The test process stays in the root namespace: work inside a namespace happens on a thread
//! that entered it ([`Netns::run`], [`Netns::spawn`], [`Netns::enter`]), or in a command run
//! with `ip netns exec` ([`Netns::command`]). Sockets keep the namespace they were made in, so
//! a socket connected inside the client namespace can be read from any thread.
//!
//! `net_lab::NetLab` puts the data planes on top: Sluice on the LB, decapsulation on every backend,
//! an XDP_PASS program on the LB's switch port (native XDP_TX on a veth is only delivered when
//! the peer has an XDP program), the VIPs, the servers, and resolved neighbours.

use std::{
    collections::HashMap,
    ffi::{CString, OsStr},
    fs::{self, File},
    io::{BufRead, BufReader, Read},
    marker::PhantomData,
    net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr, UdpSocket},
    os::{fd::AsRawFd, unix::process::CommandExt},
    path::{Path, PathBuf},
    process::{Child, Command, Stdio},
    sync::{
        atomic::{AtomicUsize, Ordering},
        mpsc::{self, Receiver, RecvTimeoutError},
        OnceLock,
    },
    thread,
    time::{Duration, Instant},
};

use anyhow::{anyhow, bail, Context, Result};
use aya::programs::XdpMode;
use sluice::{
    dataplane::{Dataplane, LoadOptions, PROG_PASS},
    object::BPF_OBJECT,
};

/// First characters of every lab namespace name (`sl<pid>-<n>-<host>`).
pub const NS_PREFIX: &str = "sl";
/// The interface of every host namespace (client, LB, backends) on the segment.
pub const DEV: &str = "eth0";
/// The bridge in the switch namespace.
pub const BRIDGE: &str = "br0";

/// The segment: 10.111.0.0/24 and fd00:111::/64, used only inside the lab's namespaces.
pub const PREFIX_LEN_V4: u8 = 24;
pub const PREFIX_LEN_V6: u8 = 64;
/// The switch namespace's address on the bridge: the segment's router, whose MAC is the data
/// plane's fallback next hop.
pub const GATEWAY_V4: Ipv4Addr = Ipv4Addr::new(10, 111, 0, 1);
pub const GATEWAY_V6: Ipv6Addr = Ipv6Addr::new(0xfd00, 0x111, 0, 0, 0, 0, 0, 1);
pub const LB_V4: Ipv4Addr = Ipv4Addr::new(10, 111, 0, 2);
pub const LB_V6: Ipv6Addr = Ipv6Addr::new(0xfd00, 0x111, 0, 0, 0, 0, 0, 2);
pub const CLIENT_V4: Ipv4Addr = Ipv4Addr::new(10, 111, 0, 10);
pub const CLIENT_V6: Ipv6Addr = Ipv6Addr::new(0xfd00, 0x111, 0, 0, 0, 0, 0, 0x10);
/// Backend `i` is 10.111.0.(11 + i) and fd00:111::(11 + i) (the same digits).
pub const BACKEND_V4_BASE: u8 = 11;

/// The VIPs (on every backend's `lo`) and the prefixes the client routes through the LB.
pub const VIP4: Ipv4Addr = Ipv4Addr::new(10, 111, 100, 1);
pub const VIP6: Ipv6Addr = Ipv6Addr::new(0xfd00, 0x111, 0x100, 0, 0, 0, 0, 1);
pub const VIP_NET_V4: &str = "10.111.100.0/24";
pub const VIP_NET_V6: &str = "fd00:111:100::/64";
/// The MTU of the client's VIP routes: a client packet plus the 40-byte IPv6 outer header
/// still fits the segment's 1500 (in production the LB-backend fabric has the larger MTU).
pub const VIP_ROUTE_MTU: u32 = 1400;
/// The token-stream (TCP) and echo (UDP) service ports of the default VIPs.
pub const TCP_PORT: u16 = 8000;
pub const UDP_PORT: u16 = 8001;

/// Outer source addresses, in the style of the packet tests: a base and a host mask filled
/// from the flow hash.
pub const ENCAP_SRC_V4: Ipv4Addr = Ipv4Addr::new(172, 16, 0, 0);
pub const ENCAP_SRC_V4_HOSTMASK: [u8; 4] = [0, 0, 0xff, 0xff];
pub const ENCAP_SRC_V6: Ipv6Addr = Ipv6Addr::new(0xfd00, 5, 1, 0, 0, 0, 0, 0);
pub const RING: u32 = 65537;
pub const SEED: u32 = 0x5eed;

/// Bound on every command the lab runs (`ip`, `ethtool`).
pub const CMD_TIMEOUT: Duration = Duration::from_secs(10);

static LAB_COUNTER: AtomicUsize = AtomicUsize::new(0);

// ---------------------------------------------------------------------------------------
// Preconditions and commands
// ---------------------------------------------------------------------------------------

/// Fails with what is missing and how to get it: root, `ip`, `ethtool`, /run/netns support.
pub fn require_lab_prerequisites() -> Result<()> {
    if unsafe { libc::geteuid() } != 0 {
        bail!(
            "the namespace lab needs root (it creates network namespaces, loads BPF programs \
             and attaches XDP); run as root, e.g. `cargo xtask test`"
        );
    }
    tool("ip")?;
    tool("ethtool")?;
    if !Path::new("/proc/thread-self/ns/net").exists() {
        bail!("/proc/thread-self/ns/net is missing: the lab needs Linux >= 3.17 with /proc");
    }
    Ok(())
}

/// Full path of a tool the lab runs: `PATH` first, then the sbin directories (a non-login
/// root shell may not have them on `PATH`).
pub fn tool(name: &str) -> Result<PathBuf> {
    static FOUND: OnceLock<std::sync::Mutex<HashMap<String, PathBuf>>> = OnceLock::new();
    let cache = FOUND.get_or_init(Default::default);
    if let Some(p) = cache.lock().unwrap().get(name) {
        return Ok(p.clone());
    }
    let path_dirs = std::env::var_os("PATH")
        .map(|p| std::env::split_paths(&p).collect::<Vec<_>>())
        .unwrap_or_default();
    let extra = ["/usr/sbin", "/sbin", "/usr/bin", "/bin"].map(PathBuf::from);
    let found = path_dirs
        .iter()
        .chain(extra.iter())
        .map(|d| d.join(name))
        .find(|p| p.is_file())
        .ok_or_else(|| {
            anyhow!(
                "`{name}` not found (PATH and /usr/sbin, /sbin): the namespace lab needs the \
                 iproute2 and ethtool Debian packages; `cargo xtask setup` installs them"
            )
        })?;
    cache
        .lock()
        .unwrap()
        .insert(name.to_string(), found.clone());
    Ok(found)
}

/// `ip <args>`.
pub fn ip(args: &[&str]) -> Result<String> {
    run_cmd(Command::new(tool("ip")?).args(args), CMD_TIMEOUT)
}

fn shown(cmd: &Command) -> String {
    let mut s = cmd.get_program().to_string_lossy().into_owned();
    for a in cmd.get_args() {
        s.push(' ');
        s.push_str(&a.to_string_lossy());
    }
    s
}

/// Runs `cmd` to completion within `timeout` (killed after it) and returns its stdout; fails
/// with the command line and its stderr unless it exits with status 0.
pub fn run_cmd(cmd: &mut Command, timeout: Duration) -> Result<String> {
    let line = shown(cmd);
    let out = run_output(cmd, timeout)?;
    if !out.status.success() {
        bail!(
            "`{line}` failed ({}): {}",
            out.status,
            out.stderr.trim_end()
        );
    }
    Ok(out.stdout)
}

/// What a command run by [`run_output`] left: its exit status and its output.
#[derive(Clone, Debug)]
pub struct CmdOutput {
    pub status: std::process::ExitStatus,
    pub stdout: String,
    pub stderr: String,
}

/// Runs `cmd` to completion within `timeout` (killed after it) and returns its status and
/// output whatever the status; fails only if it cannot start or does not finish in time.
pub fn run_output(cmd: &mut Command, timeout: Duration) -> Result<CmdOutput> {
    let line = shown(cmd);
    cmd.stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped());
    let mut child = cmd.spawn().with_context(|| format!("starting `{line}`"))?;
    let drain = |r: Option<Box<dyn Read + Send>>| {
        let (tx, rx) = mpsc::channel();
        if let Some(mut r) = r {
            thread::spawn(move || {
                let mut buf = Vec::new();
                let _ = r.read_to_end(&mut buf);
                let _ = tx.send(String::from_utf8_lossy(&buf).into_owned());
            });
        }
        rx
    };
    let out = drain(child.stdout.take().map(|r| Box::new(r) as _));
    let err = drain(child.stderr.take().map(|r| Box::new(r) as _));
    let deadline = Instant::now() + timeout;
    let mut nap = Duration::from_micros(500);
    let status = loop {
        if let Some(status) = child.try_wait().context("waiting for a command")? {
            break status;
        }
        if Instant::now() >= deadline {
            let _ = child.kill();
            let _ = child.wait();
            bail!("`{line}` did not finish within {timeout:?} and was killed");
        }
        thread::sleep(nap);
        nap = (nap * 2).min(Duration::from_millis(20));
    };
    // A grandchild could keep a pipe open: the output is waited for, but not forever.
    let stdout = out.recv_timeout(Duration::from_secs(2)).unwrap_or_default();
    let stderr = err.recv_timeout(Duration::from_secs(2)).unwrap_or_default();
    Ok(CmdOutput {
        status,
        stdout,
        stderr,
    })
}

// ---------------------------------------------------------------------------------------
// Namespaces
// ---------------------------------------------------------------------------------------

/// A named network namespace (`/run/netns/<name>`, as `ip netns` makes them). Cloning it
/// copies the name; the namespace is owned (and deleted) by the [`Topology`] that made it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Netns {
    name: String,
}

/// Restores the current thread's original network namespace when dropped.
pub struct NsGuard {
    original: File,
    // setns is per thread: the guard must be dropped on the thread that entered.
    _not_send: PhantomData<*const ()>,
}

impl Drop for NsGuard {
    fn drop(&mut self) {
        if unsafe { libc::setns(self.original.as_raw_fd(), libc::CLONE_NEWNET) } != 0 {
            // A thread left in a lab namespace would run later work (sockets, map writes of
            // devmaps, attaches) in the wrong place: stop rather than continue wrongly.
            eprintln!(
                "FATAL: could not restore this thread's network namespace: {}",
                std::io::Error::last_os_error()
            );
            std::process::abort();
        }
    }
}

fn setns_path(path: &Path) -> Result<()> {
    let f = File::open(path).with_context(|| format!("opening {}", path.display()))?;
    if unsafe { libc::setns(f.as_raw_fd(), libc::CLONE_NEWNET) } != 0 {
        return Err(std::io::Error::last_os_error())
            .with_context(|| format!("setns({}) for this thread", path.display()));
    }
    Ok(())
}

impl Netns {
    /// A handle on an existing namespace (made elsewhere; not deleted by this handle).
    pub fn existing(name: &str) -> Netns {
        Netns {
            name: name.to_string(),
        }
    }

    pub fn name(&self) -> &str {
        &self.name
    }

    pub fn path(&self) -> PathBuf {
        Path::new("/run/netns").join(&self.name)
    }

    /// Moves the *current thread* into this namespace until the guard is dropped (it must be
    /// dropped on this thread). For short sections such as attaching XDP by ifindex.
    pub fn enter(&self) -> Result<NsGuard> {
        let original =
            File::open("/proc/thread-self/ns/net").context("opening /proc/thread-self/ns/net")?;
        setns_path(&self.path())?;
        Ok(NsGuard {
            original,
            _not_send: PhantomData,
        })
    }

    /// Runs `f` on a new thread inside this namespace and returns its result (a panic in `f`
    /// is resumed here). The calling thread does not move.
    pub fn run<T: Send>(&self, f: impl FnOnce() -> T + Send) -> Result<T> {
        let path = self.path();
        thread::scope(|s| {
            let h = s.spawn(move || -> Result<T> {
                setns_path(&path)?;
                Ok(f())
            });
            match h.join() {
                Ok(r) => r,
                Err(p) => std::panic::resume_unwind(p),
            }
        })
    }

    /// Starts a thread that lives in this namespace (for a client that connects and reads).
    /// If entering fails, the thread returns that error.
    pub fn spawn<T: Send + 'static>(
        &self,
        f: impl FnOnce() -> Result<T> + Send + 'static,
    ) -> thread::JoinHandle<Result<T>> {
        let path = self.path();
        thread::spawn(move || {
            setns_path(&path)?;
            f()
        })
    }

    /// `ip -n <ns> <args>`.
    pub fn ip(&self, args: &[&str]) -> Result<String> {
        let mut a = vec!["-n", self.name.as_str()];
        a.extend_from_slice(args);
        ip(&a)
    }

    /// `ip netns exec <ns> <program>`: the program runs in this namespace (with its own /sys
    /// remounted by `ip`). Add arguments and spawn, or pass it to [`run_cmd`].
    pub fn command(&self, program: impl AsRef<OsStr>) -> Command {
        let mut c = Command::new(tool("ip").unwrap_or_else(|_| PathBuf::from("ip")));
        c.args(["netns", "exec", &self.name]).arg(program);
        c
    }

    /// Runs a program in this namespace to completion (bounded by [`CMD_TIMEOUT`]).
    pub fn exec(&self, program: impl AsRef<OsStr>, args: &[&str]) -> Result<String> {
        run_cmd(self.command(program).args(args), CMD_TIMEOUT)
    }

    /// Writes a sysctl of this namespace, e.g. `net/ipv4/ip_forward` (slashes, so interface
    /// names with dots stay unambiguous).
    pub fn sysctl(&self, key: &str, value: &str) -> Result<()> {
        let path = Path::new("/proc/sys").join(key);
        self.run(|| fs::write(&path, value))?
            .with_context(|| format!("{}: writing {value} to {}", self.name, path.display()))
    }

    pub fn read_sysctl(&self, key: &str) -> Result<String> {
        let path = Path::new("/proc/sys").join(key);
        Ok(self
            .run(|| fs::read_to_string(&path))?
            .with_context(|| format!("{}: reading {}", self.name, path.display()))?
            .trim()
            .to_string())
    }

    /// The index of `dev` in this namespace.
    pub fn ifindex(&self, dev: &str) -> Result<u32> {
        let c = CString::new(dev)?;
        let idx = self.run(|| unsafe { libc::if_nametoindex(c.as_ptr()) })?;
        if idx == 0 {
            bail!("no interface {dev} in namespace {}", self.name);
        }
        Ok(idx)
    }

    /// Interface counters of `dev` (from this namespace's /proc/net/dev).
    pub fn link_counters(&self, dev: &str) -> Result<LinkCounters> {
        let text = self
            .run(|| fs::read_to_string("/proc/thread-self/net/dev"))?
            .context("reading /proc/thread-self/net/dev")?;
        LinkCounters::parse(&text, dev)
            .ok_or_else(|| anyhow!("no {dev} in /proc/net/dev of namespace {}", self.name))
    }

    /// The link-layer address the kernel resolved for `addr` on `dev`, if its neighbour entry
    /// is usable (REACHABLE, STALE, DELAY, PROBE or PERMANENT).
    pub fn neighbour(&self, addr: IpAddr, dev: &str) -> Result<Option<String>> {
        let out = self.ip(&["neigh", "show", "to", &addr.to_string(), "dev", dev])?;
        for line in out.lines() {
            let words: Vec<&str> = line.split_whitespace().collect();
            let usable = ["REACHABLE", "STALE", "DELAY", "PROBE", "PERMANENT"]
                .iter()
                .any(|s| words.contains(s));
            if let Some(i) = words.iter().position(|w| *w == "lladdr") {
                if usable {
                    return Ok(words.get(i + 1).map(|s| s.to_string()));
                }
            }
        }
        Ok(None)
    }

    /// Pids of the processes whose network namespace this is (`ip netns pids`).
    pub fn pids(&self) -> Result<Vec<i32>> {
        Ok(ip(&["netns", "pids", &self.name])?
            .split_whitespace()
            .filter_map(|p| p.parse().ok())
            .collect())
    }
}

/// One interface's counters from /proc/net/dev.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct LinkCounters {
    pub rx_bytes: u64,
    pub rx_packets: u64,
    pub rx_dropped: u64,
    pub tx_bytes: u64,
    pub tx_packets: u64,
    pub tx_dropped: u64,
}

impl LinkCounters {
    fn parse(text: &str, dev: &str) -> Option<LinkCounters> {
        text.lines().find_map(|l| {
            let (name, rest) = l.split_once(':')?;
            if name.trim() != dev {
                return None;
            }
            let f: Vec<u64> = rest
                .split_whitespace()
                .map(|x| x.parse().unwrap_or(0))
                .collect();
            if f.len() < 16 {
                return None;
            }
            Some(LinkCounters {
                rx_bytes: f[0],
                rx_packets: f[1],
                rx_dropped: f[3],
                tx_bytes: f[8],
                tx_packets: f[9],
                tx_dropped: f[11],
            })
        })
    }

    /// Counters accumulated since `before`.
    pub fn since(&self, before: &LinkCounters) -> LinkCounters {
        LinkCounters {
            rx_bytes: self.rx_bytes.saturating_sub(before.rx_bytes),
            rx_packets: self.rx_packets.saturating_sub(before.rx_packets),
            rx_dropped: self.rx_dropped.saturating_sub(before.rx_dropped),
            tx_bytes: self.tx_bytes.saturating_sub(before.tx_bytes),
            tx_packets: self.tx_packets.saturating_sub(before.tx_packets),
            tx_dropped: self.tx_dropped.saturating_sub(before.tx_dropped),
        }
    }
}

/// Namespaces named `sl<pid>-...` whose pid is not a live process: left by a run that
/// crashed or was killed. Kills what still runs in them and deletes them; returns their names.
/// Namespaces of live runs (including this process) are left alone.
pub fn sweep_stale() -> Vec<String> {
    let own = std::process::id();
    let Ok(entries) = fs::read_dir("/run/netns") else {
        return Vec::new();
    };
    let mut swept = Vec::new();
    for e in entries.flatten() {
        let name = e.file_name().to_string_lossy().into_owned();
        let Some(pid) = lab_pid(&name) else { continue };
        if pid == own || creator_alive(pid, &e.path()) {
            continue;
        }
        let ns = Netns::existing(&name);
        for p in ns.pids().unwrap_or_default() {
            unsafe { libc::kill(p, libc::SIGKILL) };
        }
        if ip(&["netns", "del", &name]).is_ok() {
            swept.push(name);
        }
    }
    swept
}

/// Whether the process that made the namespace at `ns_path` (pid `pid`) still runs: a live
/// process (not a zombie) with that pid that started before the namespace was made (a later
/// start means the pid was reused).
fn creator_alive(pid: u32, ns_path: &Path) -> bool {
    let Ok(stat) = fs::read_to_string(format!("/proc/{pid}/stat")) else {
        return false;
    };
    // Fields after the command name (which may contain spaces), from field 3 (state) on.
    let Some((_, rest)) = stat.rsplit_once(')') else {
        return true;
    };
    let fields: Vec<&str> = rest.split_whitespace().collect();
    if matches!(fields.first(), Some(&"Z") | Some(&"X") | Some(&"x")) {
        return false;
    }
    let (Some(start_ticks), Some(boot), Ok(made)) = (
        fields.get(19).and_then(|f| f.parse::<u64>().ok()),
        boot_time(),
        fs::metadata(ns_path).and_then(|m| m.modified()),
    ) else {
        return true;
    };
    let hz = unsafe { libc::sysconf(libc::_SC_CLK_TCK) }.max(1) as u64;
    let started = boot + Duration::from_millis(start_ticks * 1000 / hz);
    // Whole-second boot time: a second of slack.
    started <= made + Duration::from_secs(1)
}

fn boot_time() -> Option<std::time::SystemTime> {
    let stat = fs::read_to_string("/proc/stat").ok()?;
    let secs: u64 = stat
        .lines()
        .find_map(|l| l.strip_prefix("btime "))?
        .trim()
        .parse()
        .ok()?;
    Some(std::time::UNIX_EPOCH + Duration::from_secs(secs))
}

/// The pid in a lab namespace name `sl<pid>-...`.
fn lab_pid(name: &str) -> Option<u32> {
    let rest = name.strip_prefix(NS_PREFIX)?;
    let (digits, _) = rest.split_once('-')?;
    if digits.is_empty() || !digits.bytes().all(|b| b.is_ascii_digit()) {
        return None;
    }
    digits.parse().ok()
}

/// Lab namespaces (of any run) present now.
pub fn lab_namespaces() -> Vec<String> {
    let Ok(entries) = fs::read_dir("/run/netns") else {
        return Vec::new();
    };
    let mut v: Vec<String> = entries
        .flatten()
        .map(|e| e.file_name().to_string_lossy().into_owned())
        .filter(|n| lab_pid(n).is_some())
        .collect();
    v.sort();
    v
}

// ---------------------------------------------------------------------------------------
// Topology
// ---------------------------------------------------------------------------------------

/// A host on the segment: its own namespace with `eth0`, plugged into the bridge through the
/// switch-side veth `port`.
#[derive(Clone, Debug)]
pub struct Host {
    /// `client`, `lb` or the backend's name.
    pub name: String,
    pub ns: Netns,
    pub v4: Ipv4Addr,
    pub v6: Ipv6Addr,
    pub mac: [u8; 6],
    /// The bridge port (in the switch namespace) this host's `eth0` is paired with.
    pub port: String,
}

impl Host {
    pub fn addr(&self, v6: bool) -> IpAddr {
        if v6 {
            self.v6.into()
        } else {
            self.v4.into()
        }
    }

    pub fn ifindex(&self) -> Result<u32> {
        self.ns.ifindex(DEV)
    }

    pub fn mac_string(&self) -> String {
        mac_string(&self.mac)
    }
}

pub fn mac_string(m: &[u8; 6]) -> String {
    m.iter()
        .map(|b| format!("{b:02x}"))
        .collect::<Vec<_>>()
        .join(":")
}

/// What [`Topology::build`] makes.
#[derive(Clone, Debug)]
pub struct TopologySpec {
    /// Backend names: short (1 to 8 characters, ASCII letters and digits), unique.
    pub backends: Vec<String>,
    /// MTU of every link of the segment (the bridge takes its ports' MTU).
    pub mtu: u32,
    /// MTU of the client's routes to the VIPs.
    pub vip_route_mtu: u32,
}

impl Default for TopologySpec {
    fn default() -> Self {
        Self::with_backends(3)
    }
}

impl TopologySpec {
    /// Backends named b0, b1, ...
    pub fn with_backends(n: usize) -> Self {
        Self {
            backends: (0..n).map(|i| format!("b{i}")).collect(),
            mtu: 1500,
            vip_route_mtu: VIP_ROUTE_MTU,
        }
    }
}

/// Identifies a process started by [`Topology::spawn`].
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct ProcId(usize);

struct Proc {
    label: String,
    child: Child,
    lines: Receiver<String>,
    /// Lines received while waiting for another one.
    seen: Vec<String>,
}

/// The namespaces, links and addresses of the lab, and the processes started in it. Dropping
/// it kills those processes (SIGTERM, then SIGKILL after 2 s) and deletes every namespace.
pub struct Topology {
    /// `sl<pid>-<n>`: the prefix of every namespace name of this lab.
    pub id: String,
    /// The switch: bridge `br0`, with the router addresses [`GATEWAY_V4`]/[`GATEWAY_V6`].
    pub switch: Netns,
    pub gateway_mac: [u8; 6],
    pub client: Host,
    pub lb: Host,
    pub backends: Vec<Host>,
    /// Link MTU and the client's VIP-route MTU (from the spec).
    mtu: u32,
    vip_route_mtu: u32,
    namespaces: Vec<Netns>,
    procs: Vec<Proc>,
}

/// An LB host forwards (bpf_fib_lookup needs it) and sends no redirects.
const LB_SYSCTLS: [(&str, &str); 4] = [
    ("net/ipv4/ip_forward", "1"),
    ("net/ipv6/conf/all/forwarding", "1"),
    ("net/ipv4/conf/all/send_redirects", "0"),
    ("net/ipv4/conf/default/send_redirects", "0"),
];

const MAC_BASE: [u8; 5] = [0x02, 0x5c, 0x00, 0x00, 0x00];

fn host_mac(last: u8) -> [u8; 6] {
    let mut m = [0; 6];
    m[..5].copy_from_slice(&MAC_BASE);
    m[5] = last;
    m
}

impl Topology {
    /// Builds the namespaces, bridge, veth pairs, addresses, routes and sysctls; no XDP yet.
    /// On error, what was built is removed.
    pub fn build(spec: &TopologySpec) -> Result<Topology> {
        require_lab_prerequisites()?;
        if spec.backends.is_empty() || spec.backends.len() > 64 {
            bail!("a lab has 1 to 64 backends, not {}", spec.backends.len());
        }
        for (i, n) in spec.backends.iter().enumerate() {
            if n.is_empty()
                || n.len() > 8
                || !n.bytes().all(|b| b.is_ascii_alphanumeric())
                || ["client", "lb", "sw"].contains(&n.as_str())
                || spec.backends[..i].contains(n)
            {
                bail!("bad backend name {n:?}: 1 to 8 letters/digits, unique, not client/lb/sw");
            }
        }
        let swept = sweep_stale();
        if !swept.is_empty() {
            eprintln!(
                "netns lab: removed {} namespaces left by a dead run: {}",
                swept.len(),
                swept.join(" ")
            );
        }
        let id = format!(
            "{NS_PREFIX}{}-{}",
            std::process::id(),
            LAB_COUNTER.fetch_add(1, Ordering::Relaxed)
        );
        let ns = |short: &str| Netns {
            name: format!("{id}-{short}"),
        };
        let host = |name: &str, v4: Ipv4Addr, v6: Ipv6Addr, mac_last: u8| Host {
            name: name.to_string(),
            ns: ns(name),
            v4,
            v6,
            mac: host_mac(mac_last),
            port: format!("v-{name}"),
        };
        let backends = spec
            .backends
            .iter()
            .enumerate()
            .map(|(i, n)| {
                let last = BACKEND_V4_BASE + i as u8;
                host(
                    n,
                    Ipv4Addr::new(10, 111, 0, last),
                    // fd00:111::<the same digits>
                    format!("fd00:111::{last}").parse().unwrap(),
                    last,
                )
            })
            .collect();
        let mut t = Topology {
            switch: ns("sw"),
            gateway_mac: host_mac(1),
            client: host("client", CLIENT_V4, CLIENT_V6, 10),
            lb: host("lb", LB_V4, LB_V6, 2),
            backends,
            id,
            mtu: spec.mtu,
            vip_route_mtu: spec.vip_route_mtu,
            namespaces: Vec::new(),
            procs: Vec::new(),
        };
        t.wire()
            .with_context(|| format!("building the namespace lab {}", t.id))?;
        Ok(t)
    }

    fn add_ns(&mut self, ns: &Netns) -> Result<()> {
        ip(&["netns", "add", ns.name()])?;
        self.namespaces.push(ns.clone());
        // Addresses are usable at once (no duplicate address detection on a lab segment),
        // and no router advertisements change routes behind a test's back.
        for (k, v) in [
            ("net/ipv6/conf/all/accept_dad", "0"),
            ("net/ipv6/conf/default/accept_dad", "0"),
            ("net/ipv6/conf/all/accept_ra", "0"),
            ("net/ipv6/conf/default/accept_ra", "0"),
        ] {
            ns.sysctl(k, v)?;
        }
        ns.ip(&["link", "set", "lo", "up"])?;
        Ok(())
    }

    fn wire(&mut self) -> Result<()> {
        // The switch: a bridge without STP or multicast snooping (neighbour discovery's
        // multicast is flooded), which is also the segment's router.
        let sw = self.switch.clone();
        self.add_ns(&sw)?;
        for (k, v) in [
            ("net/ipv4/ip_forward", "1"),
            ("net/ipv6/conf/all/forwarding", "1"),
            ("net/ipv4/conf/all/send_redirects", "0"),
            ("net/ipv4/conf/default/send_redirects", "0"),
        ] {
            sw.sysctl(k, v)?;
        }
        let gw_mac = mac_string(&self.gateway_mac);
        sw.ip(&[
            "link",
            "add",
            BRIDGE,
            "address",
            &gw_mac,
            "type",
            "bridge",
            "stp_state",
            "0",
            "mcast_snooping",
            "0",
        ])?;
        sw.ip(&[
            "addr",
            "add",
            &format!("{GATEWAY_V4}/{PREFIX_LEN_V4}"),
            "dev",
            BRIDGE,
        ])?;
        sw.ip(&[
            "addr",
            "add",
            &format!("{GATEWAY_V6}/{PREFIX_LEN_V6}"),
            "dev",
            BRIDGE,
            "nodad",
        ])?;
        sw.ip(&["link", "set", BRIDGE, "up"])?;

        let mut hosts = vec![self.client.clone(), self.lb.clone()];
        hosts.extend(self.backends.iter().cloned());
        for h in &hosts {
            self.add_ns(&h.ns)?;
            // Before the link exists, so eth0 inherits the defaults.
            if h.name == "lb" {
                for (k, v) in LB_SYSCTLS {
                    h.ns.sysctl(k, v)?;
                }
            }
            self.plug(h)?;
        }

        // The client reaches the VIPs through the LB.
        let c = &self.client.ns;
        let mtu = self.vip_route_mtu.to_string();
        for (net, via) in [
            (VIP_NET_V4, IpAddr::from(LB_V4)),
            (VIP_NET_V6, IpAddr::from(LB_V6)),
        ] {
            c.ip(&[
                "route",
                "add",
                net,
                "via",
                &via.to_string(),
                "dev",
                DEV,
                "mtu",
                &mtu,
            ])?;
        }

        // Backends: the VIPs on lo; answer ARP only for eth0's own address and announce it
        // (never a VIP); no reverse-path filter (decapsulated packets come from anywhere).
        for b in self.backends.clone() {
            for (k, v) in [
                ("net/ipv4/conf/all/rp_filter", "0"),
                ("net/ipv4/conf/default/rp_filter", "0"),
                ("net/ipv4/conf/lo/rp_filter", "0"),
                ("net/ipv4/conf/eth0/rp_filter", "0"),
                ("net/ipv4/conf/all/arp_ignore", "1"),
                ("net/ipv4/conf/all/arp_announce", "2"),
            ] {
                b.ns.sysctl(k, v)?;
            }
            for vip in [IpAddr::from(VIP4), IpAddr::from(VIP6)] {
                self.add_backend_vip(&b, vip)?;
            }
        }
        Ok(())
    }

    /// Creates the veth pair for `h` (switch port and `eth0`, each made directly in its
    /// namespace), addresses eth0 and turns tx checksum offload off on both ends.
    fn plug(&self, h: &Host) -> Result<()> {
        let sw = &self.switch;
        let mac = h.mac_string();
        sw.ip(&[
            "link",
            "add",
            &h.port,
            "type",
            "veth",
            "peer",
            "name",
            DEV,
            "netns",
            h.ns.name(),
            "address",
            &mac,
        ])?;
        let mtu = self.mtu.to_string();
        sw.ip(&["link", "set", &h.port, "mtu", &mtu])?;
        h.ns.ip(&["link", "set", DEV, "mtu", &mtu])?;
        sw.ip(&["link", "set", &h.port, "master", BRIDGE, "up"])?;
        h.ns.ip(&[
            "addr",
            "add",
            &format!("{}/{PREFIX_LEN_V4}", h.v4),
            "dev",
            DEV,
        ])?;
        h.ns.ip(&[
            "addr",
            "add",
            &format!("{}/{PREFIX_LEN_V6}", h.v6),
            "dev",
            DEV,
            "nodad",
        ])?;
        h.ns.ip(&["link", "set", DEV, "up"])?;
        // With tx checksumming on, veth hands on CHECKSUM_PARTIAL packets whose checksum is
        // never filled in once XDP has rewritten them.
        let ethtool = tool("ethtool")?;
        let ethtool = ethtool.to_string_lossy();
        h.ns.exec(ethtool.as_ref(), &["-K", DEV, "tx", "off"])?;
        sw.exec(ethtool.as_ref(), &["-K", &h.port, "tx", "off"])?;
        Ok(())
    }

    /// Adds another load-balancer host `name` on the segment (10.111.0.`last`,
    /// fd00:111::`last`, forwarding on, like [`Topology::lb`]); removed with the topology.
    /// The fleet lab runs several LB hosts behind the router.
    pub fn add_lb_host(&mut self, name: &str, last: u8) -> Result<Host> {
        let h = Host {
            name: name.to_string(),
            ns: Netns {
                name: format!("{}-{name}", self.id),
            },
            v4: Ipv4Addr::new(10, 111, 0, last),
            v6: format!("fd00:111::{last}").parse()?,
            mac: host_mac(last),
            port: format!("v-{name}"),
        };
        self.add_ns(&h.ns)?;
        for (k, v) in LB_SYSCTLS {
            h.ns.sysctl(k, v)?;
        }
        self.plug(&h)?;
        Ok(h)
    }

    /// Puts `vip` on backend `b`'s `lo` (IPv4 /32 or IPv6 /128).
    pub fn add_backend_vip(&self, b: &Host, vip: IpAddr) -> Result<()> {
        let cidr = match vip {
            IpAddr::V4(a) => format!("{a}/32"),
            IpAddr::V6(a) => format!("{a}/128"),
        };
        b.ns.ip(&["addr", "add", &cidr, "dev", "lo"])?;
        Ok(())
    }

    pub fn backend(&self, name: &str) -> Option<&Host> {
        self.backends.iter().find(|b| b.name == name)
    }

    /// Every namespace of the lab, the switch first.
    pub fn namespaces(&self) -> &[Netns] {
        &self.namespaces
    }

    /// Makes `from` resolve the link-layer addresses of `targets` (as a ping would): sends a
    /// datagram to the discard port of each until the neighbour entry is usable, for at most
    /// `timeout`. `bpf_fib_lookup` only returns next hops the kernel has resolved.
    pub fn resolve_neighbours(
        &self,
        from: &Host,
        targets: &[IpAddr],
        timeout: Duration,
    ) -> Result<()> {
        let deadline = Instant::now() + timeout;
        let mut pending: Vec<IpAddr> = targets.to_vec();
        while !pending.is_empty() {
            let probe = pending.clone();
            from.ns.run(move || -> Result<()> {
                for a in probe {
                    let bind: SocketAddr = if a.is_ipv4() {
                        (Ipv4Addr::UNSPECIFIED, 0).into()
                    } else {
                        (Ipv6Addr::UNSPECIFIED, 0).into()
                    };
                    let s = UdpSocket::bind(bind)?;
                    // The discard port: nothing listens, the backend answers port unreachable.
                    let _ = s.send_to(b"sluice neighbour probe", (a, 9));
                }
                Ok(())
            })??;
            let step_end = (Instant::now() + Duration::from_millis(300)).min(deadline);
            loop {
                let mut still = Vec::new();
                for a in &pending {
                    if from.ns.neighbour(*a, DEV)?.is_none() {
                        still.push(*a);
                    }
                }
                pending = still;
                if pending.is_empty() || Instant::now() >= step_end {
                    break;
                }
                thread::sleep(Duration::from_millis(10));
            }
            if !pending.is_empty() && Instant::now() >= deadline {
                bail!(
                    "{} did not resolve the link-layer address of {:?} within {timeout:?}",
                    from.name,
                    pending
                );
            }
        }
        Ok(())
    }

    /// Makes the LB resolve the link-layer addresses (IPv4 and IPv6) of every backend, so
    /// `bpf_fib_lookup` finds them ([`Topology::resolve_neighbours`]).
    pub fn resolve_backend_neighbours(&self, timeout: Duration) -> Result<()> {
        let targets: Vec<IpAddr> = self
            .backends
            .iter()
            .flat_map(|b| [b.addr(false), b.addr(true)])
            .collect();
        self.resolve_neighbours(&self.lb, &targets, timeout)
    }

    /// Starts `sluice-testsrv serve --name <name> --max-seconds <lifetime> <args>` on backend
    /// `index` and waits (10 s at most) until it prints READY.
    pub fn start_server(
        &mut self,
        index: usize,
        server: &Path,
        name: &str,
        lifetime: Duration,
        args: &[String],
    ) -> Result<ProcId> {
        if !server.is_file() {
            bail!("server binary {} does not exist", server.display());
        }
        let host = self
            .backends
            .get(index)
            .ok_or_else(|| anyhow!("no backend {index}"))?;
        let ns = host.ns.clone();
        let label = format!("server {name} on {}", host.name);
        let mut all: Vec<String> = vec![
            "serve".into(),
            "--name".into(),
            name.into(),
            "--max-seconds".into(),
            lifetime.as_secs().max(1).to_string(),
        ];
        all.extend_from_slice(args);
        let id = self.spawn(&ns, &label, server, &all)?;
        self.wait_line(id, "READY", Duration::from_secs(10))?;
        Ok(id)
    }

    /// Starts `program args...` in `ns` (`ip netns exec`), in its own process group (a
    /// terminal's Ctrl-C reaches only the test or demo, which then cleans up). Its stdout is
    /// read line by line ([`Topology::wait_line`]); stderr is inherited. The process gets
    /// SIGKILL if the thread that spawned it exits (so spawn from the thread that owns the
    /// topology), and is stopped when the topology is dropped.
    pub fn spawn(
        &mut self,
        ns: &Netns,
        label: &str,
        program: impl AsRef<OsStr>,
        args: &[String],
    ) -> Result<ProcId> {
        let mut cmd = ns.command(program);
        cmd.args(args)
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::inherit())
            .process_group(0);
        unsafe {
            cmd.pre_exec(|| {
                if libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGKILL) != 0 {
                    return Err(std::io::Error::last_os_error());
                }
                Ok(())
            });
        }
        let line = shown(&cmd);
        let mut child = cmd.spawn().with_context(|| format!("starting `{line}`"))?;
        let (tx, rx) = mpsc::channel();
        let out = child.stdout.take().expect("piped");
        thread::spawn(move || {
            for l in BufReader::new(out).lines() {
                let Ok(l) = l else { break };
                if tx.send(l).is_err() {
                    break;
                }
            }
        });
        self.procs.push(Proc {
            label: label.to_string(),
            child,
            lines: rx,
            seen: Vec::new(),
        });
        Ok(ProcId(self.procs.len() - 1))
    }

    /// Waits (at most `timeout`) for a line of the process's stdout that starts with
    /// `prefix`, and returns it. Fails if the process exits first.
    pub fn wait_line(&mut self, id: ProcId, prefix: &str, timeout: Duration) -> Result<String> {
        let deadline = Instant::now() + timeout;
        let p = &mut self.procs[id.0];
        if let Some(i) = p.seen.iter().position(|l| l.starts_with(prefix)) {
            return Ok(p.seen.remove(i));
        }
        loop {
            let left = deadline.saturating_duration_since(Instant::now());
            match p.lines.recv_timeout(left.min(Duration::from_millis(100))) {
                Ok(l) if l.starts_with(prefix) => return Ok(l),
                Ok(l) => p.seen.push(l),
                Err(RecvTimeoutError::Timeout) => {}
                Err(RecvTimeoutError::Disconnected) => {
                    let status = p.child.try_wait().ok().flatten();
                    bail!(
                        "{} closed its output (exit: {status:?}) before printing {prefix:?}",
                        p.label
                    );
                }
            }
            if Instant::now() >= deadline {
                bail!("{} did not print {prefix:?} within {timeout:?}", p.label);
            }
        }
    }

    pub fn pid(&self, id: ProcId) -> u32 {
        self.procs[id.0].child.id()
    }

    /// Sends `signal` (e.g. `libc::SIGKILL` for a crash) to the process.
    pub fn signal(&mut self, id: ProcId, signal: i32) -> Result<()> {
        let pid = self.pid(id) as i32;
        if unsafe { libc::kill(pid, signal) } != 0 {
            return Err(std::io::Error::last_os_error())
                .with_context(|| format!("kill({pid}, {signal})"));
        }
        Ok(())
    }

    /// Whether the process has exited, with its status (reaps it).
    pub fn try_wait(&mut self, id: ProcId) -> Result<Option<std::process::ExitStatus>> {
        Ok(self.procs[id.0].child.try_wait()?)
    }

    /// Waits at most `timeout` for the process to exit.
    pub fn wait_exit(&mut self, id: ProcId, timeout: Duration) -> Result<std::process::ExitStatus> {
        let deadline = Instant::now() + timeout;
        loop {
            if let Some(s) = self.procs[id.0].child.try_wait()? {
                return Ok(s);
            }
            if Instant::now() >= deadline {
                bail!("{} did not exit within {timeout:?}", self.procs[id.0].label);
            }
            thread::sleep(Duration::from_millis(10));
        }
    }

    /// Stops every process (SIGTERM, SIGKILL after 2 s) and deletes every namespace. Called by
    /// drop; call it directly to see the errors.
    pub fn teardown(&mut self) -> Result<()> {
        let mut errors = Vec::new();
        for p in &mut self.procs {
            if let Ok(None) = p.child.try_wait() {
                unsafe { libc::kill(p.child.id() as i32, libc::SIGTERM) };
            }
        }
        let deadline = Instant::now() + Duration::from_secs(2);
        for p in &mut self.procs {
            loop {
                match p.child.try_wait() {
                    Ok(Some(_)) | Err(_) => break,
                    Ok(None) if Instant::now() >= deadline => {
                        let _ = p.child.kill();
                        let _ = p.child.wait();
                        break;
                    }
                    Ok(None) => thread::sleep(Duration::from_millis(5)),
                }
            }
        }
        self.procs.clear();
        for ns in self.namespaces.drain(..).rev() {
            // Anything else still running in it (a daemon's children, a leaked helper).
            for pid in ns.pids().unwrap_or_default() {
                unsafe { libc::kill(pid, libc::SIGKILL) };
            }
            if let Err(e) = ip(&["netns", "del", ns.name()]) {
                errors.push(format!("{e:#}"));
            }
        }
        if !errors.is_empty() {
            bail!("tearing down the lab: {}", errors.join("; "));
        }
        Ok(())
    }
}

impl Drop for Topology {
    fn drop(&mut self) {
        if let Err(e) = self.teardown() {
            eprintln!("netns lab {}: {e:#}", self.id);
        }
    }
}

// ---------------------------------------------------------------------------------------
// XDP on the lab's ports
// ---------------------------------------------------------------------------------------

/// Attaches `prog` of `dp` in native (driver) mode to `dev` in namespace `ns`.
pub fn attach_native(dp: &mut Dataplane, prog: &str, ns: &Netns, dev: &str) -> Result<()> {
    let _in = ns.enter()?;
    let c = CString::new(dev)?;
    let idx = unsafe { libc::if_nametoindex(c.as_ptr()) };
    if idx == 0 {
        bail!("no interface {dev} in namespace {}", ns.name());
    }
    dp.attach(prog, idx, XdpMode::Driver)
        .with_context(|| format!("attaching {prog} to {}/{dev}", ns.name()))
}

/// `sluice_pass` (native) on the LB's switch port: native XDP_TX frames on a veth are
/// delivered only when the peer runs XDP. Its `RX` counts every frame the LB namespace sends.
pub fn switch_port(topo: &Topology) -> Result<Dataplane> {
    let mut edge_dp = Dataplane::load(BPF_OBJECT, &LoadOptions::decap_only())
        .context("loading the switch port's data plane")?;
    attach_native(&mut edge_dp, PROG_PASS, &topo.switch, &topo.lb.port)?;
    Ok(edge_dp)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn lab_names_carry_the_pid() {
        assert_eq!(lab_pid("sl1234-0-lb"), Some(1234));
        assert_eq!(lab_pid("sl1234-12-b0"), Some(1234));
        assert_eq!(lab_pid("slx-0-lb"), None);
        assert_eq!(lab_pid("sl-0-lb"), None);
        assert_eq!(lab_pid("other"), None);
        assert_eq!(lab_pid("sl1234"), None);
    }

    #[test]
    fn proc_net_dev_is_parsed() {
        let text = "Inter-|   Receive                                                |  Transmit\n \
face |bytes    packets errs drop fifo frame compressed multicast|bytes    packets errs drop fifo colls carrier compressed\n    \
lo:       0       0    0    0    0     0          0         0        0       0    0    0    0     0       0          0\n  \
eth0:    1000      10    0    2    0     0          0         0     3000      30    0    4    0     0       0          0\n";
        let c = LinkCounters::parse(text, "eth0").unwrap();
        assert_eq!(
            c,
            LinkCounters {
                rx_bytes: 1000,
                rx_packets: 10,
                rx_dropped: 2,
                tx_bytes: 3000,
                tx_packets: 30,
                tx_dropped: 4
            }
        );
        assert!(LinkCounters::parse(text, "eth1").is_none());
    }
}
