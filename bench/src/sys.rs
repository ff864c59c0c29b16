//! Process and host helpers: CPU pinning, network namespaces, facts about the machine.

use std::{
    fs,
    os::fd::{AsRawFd, OwnedFd},
    process::Command,
    sync::atomic::{AtomicBool, Ordering},
    time::{SystemTime, UNIX_EPOCH},
};

use anyhow::{bail, Context, Result};

static INTERRUPTED: AtomicBool = AtomicBool::new(false);

extern "C" fn on_signal(_: libc::c_int) {
    INTERRUPTED.store(true, Ordering::SeqCst);
}

/// From now on SIGINT, SIGTERM and SIGHUP only raise a flag that [`interrupted`] reports: a
/// benchmark that checks it returns an error, and its labs' drops tear down the namespaces,
/// processes and pins they made, which the signals' default action would leave behind.
pub fn catch_interrupts() {
    for sig in [libc::SIGINT, libc::SIGTERM, libc::SIGHUP] {
        unsafe { libc::signal(sig, on_signal as *const () as libc::sighandler_t) };
    }
}

/// An error once a signal caught by [`catch_interrupts`] has arrived.
pub fn interrupted() -> Result<()> {
    if INTERRUPTED.load(Ordering::SeqCst) {
        bail!("interrupted by a signal: the lab is torn down");
    }
    Ok(())
}

pub fn require_root() -> Result<()> {
    if unsafe { libc::geteuid() } != 0 {
        bail!("this benchmark loads BPF programs and creates network namespaces: run it as root (`cargo xtask bench xdp`)");
    }
    Ok(())
}

/// Pins the calling thread (the only one that runs programs) to `cpu`, so every test run
/// uses the same per-CPU LRU list and counters and the scheduler does not migrate it.
pub fn pin_cpu(cpu: usize) -> Result<()> {
    unsafe {
        let mut set: libc::cpu_set_t = std::mem::zeroed();
        libc::CPU_SET(cpu, &mut set);
        if libc::sched_setaffinity(0, std::mem::size_of::<libc::cpu_set_t>(), &set) != 0 {
            bail!(
                "sched_setaffinity(cpu {cpu}): {}",
                std::io::Error::last_os_error()
            );
        }
    }
    Ok(())
}

pub fn online_cpus() -> usize {
    std::thread::available_parallelism()
        .map(|n| n.get())
        .unwrap_or(1)
}

/// Number of possible CPUs: a per-CPU LRU map gives each of them `max_entries / possible`.
pub fn possible_cpus() -> usize {
    fs::read_to_string("/sys/devices/system/cpu/possible")
        .ok()
        .and_then(|s| {
            let s = s.trim();
            let last = s.rsplit([',', '-']).next()?;
            last.parse::<usize>().ok().map(|n| n + 1)
        })
        .unwrap_or_else(online_cpus)
}

/// Moves this thread into a new, empty network namespace and returns a handle to it.
pub fn new_netns() -> Result<OwnedFd> {
    if unsafe { libc::unshare(libc::CLONE_NEWNET) } != 0 {
        bail!("unshare(CLONE_NEWNET): {}", std::io::Error::last_os_error());
    }
    let f = fs::File::open("/proc/thread-self/ns/net").context("opening this thread's netns")?;
    Ok(f.into())
}

/// Moves this thread into the namespace `ns` (from [`new_netns`]).
pub fn enter_netns(ns: &OwnedFd) -> Result<()> {
    if unsafe { libc::setns(ns.as_raw_fd(), libc::CLONE_NEWNET) } != 0 {
        bail!("setns: {}", std::io::Error::last_os_error());
    }
    Ok(())
}

/// Runs a shell command (it inherits this thread's network namespace); fails on non-zero exit.
pub fn sh(cmd: &str) -> Result<()> {
    let st = Command::new("sh")
        .arg("-c")
        .arg(cmd)
        .status()
        .with_context(|| format!("running `{cmd}`"))?;
    if !st.success() {
        bail!("`{cmd}` failed: {st}");
    }
    Ok(())
}

pub fn ifindex(name: &str) -> Result<u32> {
    let c = std::ffi::CString::new(name)?;
    let i = unsafe { libc::if_nametoindex(c.as_ptr()) };
    if i == 0 {
        bail!("no interface {name} in this namespace");
    }
    Ok(i)
}

pub fn kernel_release() -> String {
    unsafe {
        let mut u: libc::utsname = std::mem::zeroed();
        if libc::uname(&mut u) != 0 {
            return "unknown".into();
        }
        std::ffi::CStr::from_ptr(u.release.as_ptr())
            .to_string_lossy()
            .into_owned()
    }
}

pub fn cpu_model() -> String {
    fs::read_to_string("/proc/cpuinfo")
        .ok()
        .and_then(|s| {
            s.lines()
                .find(|l| l.starts_with("model name"))
                .and_then(|l| l.split_once(':'))
                .map(|(_, v)| v.trim().to_string())
        })
        .unwrap_or_else(|| "unknown".into())
}

pub fn clocksource() -> String {
    fs::read_to_string("/sys/devices/system/clocksource/clocksource0/current_clocksource")
        .map(|s| s.trim().to_string())
        .unwrap_or_else(|_| "unknown".into())
}

/// The command line of the parent process (`cargo xtask bench ...` runs this through xtask).
pub fn parent_cmdline() -> Option<String> {
    let ppid = unsafe { libc::getppid() };
    let raw = fs::read(format!("/proc/{ppid}/cmdline")).ok()?;
    let parts: Vec<String> = raw
        .split(|b| *b == 0)
        .filter(|p| !p.is_empty())
        .map(|p| String::from_utf8_lossy(p).into_owned())
        .collect();
    (!parts.is_empty()).then(|| parts.join(" "))
}

/// `git rev-parse HEAD` and whether the data-plane sources differ from it.
pub fn git_state() -> (Option<String>, Option<bool>) {
    let head = Command::new("git")
        .args(["rev-parse", "HEAD"])
        .output()
        .ok()
        .filter(|o| o.status.success())
        .map(|o| String::from_utf8_lossy(&o.stdout).trim().to_string());
    let dirty = Command::new("git")
        .args([
            "status",
            "--porcelain",
            "--",
            "lb-ebpf/src",
            "lb-common/src",
        ])
        .output()
        .ok()
        .filter(|o| o.status.success())
        .map(|o| !o.stdout.is_empty());
    (head, dirty)
}

/// Now as `YYYY-MM-DDTHH:MM:SSZ` (UTC).
pub fn utc_now() -> String {
    let secs = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_secs())
        .unwrap_or(0) as i64;
    let (days, rem) = (secs.div_euclid(86_400), secs.rem_euclid(86_400));
    // Howard Hinnant's civil_from_days.
    let z = days + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z - era * 146_097;
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let d = doy - (153 * mp + 2) / 5 + 1;
    let m = if mp < 10 { mp + 3 } else { mp - 9 };
    let y = yoe + era * 400 + if m <= 2 { 1 } else { 0 };
    format!(
        "{y:04}-{m:02}-{d:02}T{:02}:{:02}:{:02}Z",
        rem / 3600,
        rem % 3600 / 60,
        rem % 60
    )
}

/// FNV-1a of the embedded object, to tell runs of different builds apart.
pub fn fnv64(bytes: &[u8]) -> u64 {
    let mut h: u64 = 0xcbf2_9ce4_8422_2325;
    for b in bytes {
        h ^= *b as u64;
        h = h.wrapping_mul(0x0000_0100_0000_01b3);
    }
    h
}
