//! Named network namespaces: entering them, running work and commands inside, reading
//! their counters and neighbours; and the sweep of namespaces that dead runs left.

use std::{
    ffi::{CString, OsStr},
    fs::{self, File},
    marker::PhantomData,
    net::IpAddr,
    os::fd::AsRawFd,
    path::{Path, PathBuf},
    process::Command,
    thread,
    time::Duration,
};

use anyhow::{anyhow, bail, Context, Result};

use super::{
    cmd::{ip, run_cmd, tool},
    CMD_TIMEOUT, NS_PREFIX,
};

/// A named network namespace (`/run/netns/<name>`, as `ip netns` makes them). Cloning it
/// copies the name; the namespace is owned (and deleted) by the [`Topology`](super::Topology)
/// that made it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Netns {
    pub(super) name: String,
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
