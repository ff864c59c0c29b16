//! Preconditions of the lab, and the commands it runs (bounded in time).

use std::{
    collections::HashMap,
    io::Read,
    path::{Path, PathBuf},
    process::{Command, Stdio},
    sync::{mpsc, OnceLock},
    thread,
    time::{Duration, Instant},
};

use anyhow::{anyhow, bail, Context, Result};

use super::CMD_TIMEOUT;

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

pub(super) fn shown(cmd: &Command) -> String {
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
