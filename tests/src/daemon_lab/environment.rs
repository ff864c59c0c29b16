//! What a lab needs from the host and what it leaves there: the `sluice` binaries, the
//! prerequisites, lab ids, and the sweep of what dead runs left.

use std::{
    fs,
    path::{Path, PathBuf},
    sync::{
        atomic::{AtomicUsize, Ordering},
        OnceLock,
    },
    time::SystemTime,
};

use anyhow::{anyhow, bail, Context, Result};
use sluice::dataplane::remove_pinned;

use super::PREFIX;
use crate::netns::tool;

static LAB_COUNTER: AtomicUsize = AtomicUsize::new(0);

/// The `sluice` binary next to the test executable (`target/<profile>/sluice`). Fails with
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
/// test server (the namespace prerequisites are checked by
/// [`Topology::build`](crate::netns::Topology::build)).
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
