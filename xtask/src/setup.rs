//! `cargo xtask setup`: installs or checks what building and testing Sluice need. Idempotent:
//! everything already in place is reported as present and left alone.
//!
//! - bpf-linker, built against rustc's own LLVM (see [`ensure_bpf_linker`]);
//! - cargo-deb, which `cargo xtask package` builds the Debian package with;
//! - bpffs mounted at /sys/fs/bpf (pinned maps);
//! - the Debian packages the tests and the demo call ([`DEB_PACKAGES`]);
//! - a check that we run as root (loading BPF programs and creating namespaces need it).

use std::{
    env, fs,
    io::ErrorKind,
    os::unix::fs::symlink,
    path::{Path, PathBuf},
    process::Command,
};

use anyhow::{bail, Context, Result};

use crate::cmd::{self, step};

/// Debian packages the packet/namespace tests and the demo use.
pub const DEB_PACKAGES: &[&str] = &[
    // `ip`: network namespaces, veth pairs, bridges, addresses, routes, neighbours.
    "iproute2",
    // `ethtool -K <dev> tx off`: veth tx checksum offload breaks packets rewritten in XDP.
    "ethtool",
    // `sysctl`: forwarding and rp_filter in the test namespaces.
    "procps",
    // `nsenter`: the daemon tests run `sluice run` in the LB namespace without remounting
    // /sys (which `ip netns exec` does, hiding /sys/fs/bpf).
    "util-linux",
    // The README's admin-API examples (`curl --unix-socket`).
    "curl",
    // `systemd-analyze verify` of the packaged units (the package test).
    "systemd",
    // `man`: systemd-analyze verify resolves the units' `Documentation=man:...` pages.
    "man-db",
    // `gzip -9n` of the man pages (`cargo xtask package`).
    "gzip",
    // CPU load beside the suite, to show it passes on a loaded machine (docs/tests.md).
    "stress-ng",
    // `bpftool map dump`: the readable-maps test shows the connection table by field name.
    "bpftool",
    // `bird` and `birdc`: the BGP speaker `[bgp]` drives on each LB host, and the router of
    // the fleet lab (BGP with BFD, ECMP into the kernel).
    "bird2",
    // `etcd`: the fleet tests run a real three-member cluster (tests/src/etcd.rs).
    "etcd-server",
];

/// cargo-deb builds the .deb (`cargo xtask package`); the version that was tested.
const CARGO_DEB_VERSION: &str = "3.8.0";

const BPFFS: &str = "/sys/fs/bpf";

/// What setup found and did, for the closing summary.
#[derive(Default)]
struct Report {
    present: Vec<String>,
    done: Vec<String>,
    warnings: Vec<String>,
}

impl Report {
    fn present(&mut self, what: String) {
        println!("present: {what}");
        self.present.push(what);
    }
    fn done(&mut self, what: String) {
        println!("done: {what}");
        self.done.push(what);
    }
    fn warn(&mut self, what: String) {
        println!("WARNING: {what}");
        self.warnings.push(what);
    }
}

pub fn run() -> Result<()> {
    step("setup");
    let mut report = Report::default();
    let root = cmd::is_root();
    if root {
        report.present("running as root".into());
    } else {
        report.warn(
            "not running as root: the packet (BPF_PROG_TEST_RUN) and network-namespace tests, \
             the demo and the benchmarks need root; mounting bpffs and installing Debian \
             packages are skipped"
                .into(),
        );
    }
    ensure_packages(root, &mut report)?;
    ensure_bpffs(root, &mut report)?;
    ensure_bpf_linker(&mut report)?;
    ensure_cargo_deb(&mut report)?;

    println!();
    if report.done.is_empty() {
        println!(
            "setup: everything was already present ({} checks)",
            report.present.len()
        );
    } else {
        println!(
            "setup: did {}: {}",
            report.done.len(),
            report.done.join("; ")
        );
    }
    for w in &report.warnings {
        println!("setup: WARNING: {w}");
    }
    Ok(())
}

fn ensure_packages(root: bool, report: &mut Report) -> Result<()> {
    if cmd::find_on_path("dpkg-query").is_none() {
        report.warn(format!(
            "dpkg-query not found (not Debian?): make sure these are installed: {}",
            DEB_PACKAGES.join(", ")
        ));
        return Ok(());
    }
    let mut missing = Vec::new();
    for &pkg in DEB_PACKAGES {
        // `${Status}` is "install ok installed" for an installed package; dpkg-query fails
        // for a package it has never heard of.
        let status = Command::new("dpkg-query")
            .args(["-W", "-f=${Status}", pkg])
            .output()
            .context("running dpkg-query")?;
        if status.status.success()
            && String::from_utf8_lossy(&status.stdout).ends_with(" installed")
        {
            report.present(format!("Debian package {pkg}"));
        } else {
            missing.push(pkg);
        }
    }
    if missing.is_empty() {
        return Ok(());
    }
    if !root {
        report.warn(format!(
            "missing Debian packages (need root to install): {}",
            missing.join(" ")
        ));
        return Ok(());
    }
    cmd::run(
        Command::new("apt-get")
            .env("DEBIAN_FRONTEND", "noninteractive")
            .arg("update"),
    )?;
    cmd::run(
        Command::new("apt-get")
            .env("DEBIAN_FRONTEND", "noninteractive")
            .args(["install", "-y", "--no-install-recommends"])
            .args(&missing),
    )?;
    report.done(format!("installed Debian packages {}", missing.join(" ")));
    Ok(())
}

fn bpffs_mounted() -> Result<bool> {
    let mounts = fs::read_to_string("/proc/mounts").context("reading /proc/mounts")?;
    Ok(mounts.lines().any(|line| {
        let mut fields = line.split_whitespace();
        let (_dev, mountpoint, fstype) = (fields.next(), fields.next(), fields.next());
        mountpoint == Some(BPFFS) && fstype == Some("bpf")
    }))
}

fn ensure_bpffs(root: bool, report: &mut Report) -> Result<()> {
    if bpffs_mounted()? {
        report.present(format!("bpffs mounted at {BPFFS}"));
        return Ok(());
    }
    if !root {
        report.warn(format!(
            "bpffs is not mounted at {BPFFS} (need root to mount it)"
        ));
        return Ok(());
    }
    println!("$ mkdir -p {BPFFS}");
    fs::create_dir_all(BPFFS).with_context(|| format!("creating {BPFFS}"))?;
    cmd::run(Command::new("mount").args(["-t", "bpf", "bpf", BPFFS]))?;
    if !bpffs_mounted()? {
        bail!("mounted bpffs at {BPFFS}, but /proc/mounts does not show it");
    }
    report.done(format!("mounted bpffs at {BPFFS}"));
    Ok(())
}

/// bpf-linker on `PATH`, else in cargo's bin directory.
pub fn find_bpf_linker() -> Option<PathBuf> {
    cmd::find_on_path("bpf-linker").or_else(|| {
        let p = cmd::cargo_home()?.join("bin/bpf-linker");
        cmd::is_executable(&p).then_some(p)
    })
}

/// bpf-linker links the eBPF crate's LLVM bitcode, so it must use the LLVM that produced the
/// bitcode: rustc's own. rustc ships it as a shared library in its sysroot, and bpf-linker
/// can be built against that library instead of a system LLVM (see [`install_bpf_linker`]).
///
/// An installed bpf-linker is kept if `--version` runs and, when it links libLLVM
/// dynamically, it is the same library file name rustc ships now (a rustc update that changes
/// LLVM triggers a rebuild).
fn ensure_cargo_deb(report: &mut Report) -> Result<()> {
    let installed = cmd::cargo_home()
        .map(|h| h.join("bin/cargo-deb"))
        .filter(|p| cmd::is_executable(p))
        .or_else(|| cmd::find_on_path("cargo-deb"));
    if let Some(path) = installed {
        if let Ok(out) = Command::new(&path).arg("--version").output() {
            if out.status.success() {
                let v = String::from_utf8_lossy(&out.stdout).trim().to_string();
                report.present(format!("{v} at {}", path.display()));
                return Ok(());
            }
        }
    }
    cmd::run(cmd::clean_cargo().args([
        "install",
        "--locked",
        "cargo-deb",
        "--version",
        CARGO_DEB_VERSION,
    ]))?;
    report.done(format!("installed cargo-deb {CARGO_DEB_VERSION}"));
    Ok(())
}

fn ensure_bpf_linker(report: &mut Report) -> Result<()> {
    // Needed to install; for an installed bpf-linker only to compare LLVMs.
    let llvm = RustcLlvm::detect();
    let reason = match find_bpf_linker() {
        None => "bpf-linker is not installed (not on PATH or in cargo's bin directory)".into(),
        Some(path) => match Command::new(&path).arg("--version").output() {
            Ok(out) if out.status.success() => {
                let version = String::from_utf8_lossy(&out.stdout).trim().to_string();
                let ours = llvm.as_ref().ok().map(RustcLlvm::lib_name);
                match (linked_llvm(&path), ours) {
                    (Some(linked), Some(ours)) if linked != ours => format!(
                        "{} ({version}) is built against {linked}, but rustc now ships {ours}",
                        path.display(),
                    ),
                    (linked, _) => {
                        let llvm = linked
                            .map(|l| format!(", linked to {l}"))
                            .unwrap_or_default();
                        report.present(format!("{version} at {}{llvm}", path.display()));
                        return Ok(());
                    }
                }
            }
            Ok(out) => format!(
                "`{} --version` fails ({}): {}",
                path.display(),
                out.status,
                String::from_utf8_lossy(&out.stderr).trim()
            ),
            Err(e) => format!("cannot run {}: {e}", path.display()),
        },
    };
    println!("bpf-linker: {reason}; installing it against rustc's LLVM");
    let llvm = llvm?;
    install_bpf_linker(&llvm)?;
    report.done(format!("installed bpf-linker against {}", llvm.lib_name()));
    Ok(())
}

/// rustc's LLVM: the major version and the shared library in the sysroot.
pub struct RustcLlvm {
    pub major: u32,
    pub lib: PathBuf,
}

impl RustcLlvm {
    pub fn detect() -> Result<Self> {
        let rustc = env::var_os("RUSTC").unwrap_or_else(|| "rustc".into());
        let vv = cmd::output(Command::new(&rustc).arg("-vV"))?;
        let major = parse_llvm_major(&vv)?;
        let sysroot = cmd::output(Command::new(&rustc).args(["--print", "sysroot"]))?;
        let lib = find_llvm_dylib(&Path::new(sysroot.trim()).join("lib"), major)?;
        Ok(Self { major, lib })
    }

    fn lib_name(&self) -> String {
        file_name(&self.lib)
    }
}

fn file_name(path: &Path) -> String {
    path.file_name()
        .map(|n| n.to_string_lossy().into_owned())
        .unwrap_or_default()
}

/// The major of `LLVM version: 22.1.2` in `rustc -vV`.
pub fn parse_llvm_major(rustc_vv: &str) -> Result<u32> {
    let version = rustc_vv
        .lines()
        .find_map(|l| l.strip_prefix("LLVM version:"))
        .context("`rustc -vV` prints no `LLVM version:` line")?
        .trim();
    version
        .split('.')
        .next()
        .and_then(|m| m.parse().ok())
        .with_context(|| format!("cannot read the LLVM major from `LLVM version: {version}`"))
}

/// Finds rustc's LLVM shared library, `libLLVM.so.<ver>-rust-<ver>`, in the sysroot's lib/.
/// (The sysroot also holds `libLLVM-<major>-rust-<ver>.so`, a tiny linker script naming that
/// file; only the real `libLLVM.so.*` is wanted.)
pub fn find_llvm_dylib(libdir: &Path, major: u32) -> Result<PathBuf> {
    let entries =
        fs::read_dir(libdir).with_context(|| format!("reading rustc's {}", libdir.display()))?;
    let mut found = Vec::new();
    for entry in entries {
        let path = entry?.path();
        if file_name(&path).starts_with("libLLVM.so.") && path.is_file() {
            found.push(path);
        }
    }
    found.sort();
    if found.len() > 1 {
        let prefix = format!("libLLVM.so.{major}.");
        found.retain(|p| file_name(p).starts_with(&prefix));
    }
    match found.as_slice() {
        [one] => Ok(one.clone()),
        [] => bail!(
            "no libLLVM.so.* in {}: bpf-linker must be built against rustc's own LLVM, which \
             rustup toolchains ship there",
            libdir.display()
        ),
        many => bail!(
            "several LLVM {major} libraries in {}: {:?}",
            libdir.display(),
            many.iter().map(|p| file_name(p)).collect::<Vec<_>>()
        ),
    }
}

/// The prefix bpf-linker's build is pointed at (`LLVM_PREFIX`): `<cache>/sluice/llvm`.
fn llvm_prefix() -> Result<PathBuf> {
    let cache = env::var_os("XDG_CACHE_HOME")
        .filter(|c| !c.is_empty())
        .map(PathBuf::from)
        .or_else(|| cmd::home().map(|h| h.join(".cache")))
        .context("neither XDG_CACHE_HOME nor HOME is set")?;
    Ok(cache.join("sluice/llvm"))
}

/// Makes `<prefix>/lib` hold two symlinks to `lib`: `libLLVM.so` (what bpf-linker's build
/// links with `-lLLVM`) and the file's own name (the soname the built binary loads at run
/// time, through the rpath to `<prefix>/lib`). Replaces links that point elsewhere.
pub fn link_llvm_prefix(prefix: &Path, lib: &Path) -> Result<()> {
    let libdir = prefix.join("lib");
    fs::create_dir_all(&libdir).with_context(|| format!("creating {}", libdir.display()))?;
    for name in ["libLLVM.so".to_string(), file_name(lib)] {
        let link = libdir.join(&name);
        match fs::read_link(&link) {
            Ok(target) if target == lib => {
                println!("present: {} -> {}", link.display(), lib.display());
                continue;
            }
            Ok(_) => fs::remove_file(&link)?,
            Err(e) if e.kind() == ErrorKind::NotFound => {}
            // Exists but is not a symlink.
            Err(_) => fs::remove_file(&link)
                .with_context(|| format!("replacing {} with a symlink", link.display()))?,
        }
        println!("$ ln -s {} {}", lib.display(), link.display());
        symlink(lib, &link).with_context(|| format!("creating {}", link.display()))?;
    }
    Ok(())
}

fn install_bpf_linker(llvm: &RustcLlvm) -> Result<()> {
    let prefix = llvm_prefix()?;
    link_llvm_prefix(&prefix, &llvm.lib)?;
    // `--no-default-features` drops bpf-linker's default LLVM (a system or downloaded one);
    // `llvm-NN` selects the LLVM C API version matching rustc's LLVM; LLVM_PREFIX points the
    // build at the prefix above. About a minute on two cores. `--force` replaces a broken or
    // mismatched install.
    cmd::run(
        cmd::clean_cargo()
            .env("LLVM_PREFIX", &prefix)
            .args([
                "install",
                "bpf-linker",
                "--force",
                "--no-default-features",
                "--features",
            ])
            .arg(format!("llvm-{}", llvm.major)),
    )?;
    let linker = find_bpf_linker().context(
        "`cargo install bpf-linker` succeeded but bpf-linker is neither on PATH nor in \
         cargo's bin directory",
    )?;
    let version = cmd::output(Command::new(&linker).arg("--version"))?;
    println!("installed: {} at {}", version.trim(), linker.display());
    Ok(())
}

/// The libLLVM a dynamically linked ELF executable needs (`DT_NEEDED`), if any.
fn linked_llvm(exe: &Path) -> Option<String> {
    use object::read::elf::{Dyn, ElfFile64, FileHeader};
    let data = fs::read(exe).ok()?;
    let file = ElfFile64::<object::Endianness>::parse(&*data).ok()?;
    let endian = file.endian();
    let sections = file.elf_header().sections(endian, &*data).ok()?;
    let (dyns, strtab) = sections.dynamic(endian, &*data).ok()??;
    let strings = sections.strings(endian, &*data, strtab).ok()?;
    dyns.iter()
        .filter(|d| d.d_tag(endian) == object::elf::DT_NEEDED)
        .filter_map(|d| d.string(endian, strings).ok())
        .map(|name| String::from_utf8_lossy(name).into_owned())
        .find(|name| name.starts_with("libLLVM"))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::test_dir::TestDir;

    #[test]
    fn llvm_major_from_rustc_vv() {
        let vv = "rustc 1.95.0 (59807616e 2026-04-14)\nbinary: rustc\nhost: x86_64-unknown-linux-gnu\nrelease: 1.95.0\nLLVM version: 22.1.2\n";
        assert_eq!(parse_llvm_major(vv).unwrap(), 22);
        assert!(parse_llvm_major("rustc 1.95.0\n").is_err());
    }

    #[test]
    fn finds_the_real_llvm_library_not_the_linker_script() {
        let sysroot = TestDir::new("sysroot");
        let lib = sysroot.join("lib");
        fs::create_dir_all(&lib).unwrap();
        fs::write(lib.join("libLLVM-22-rust-1.95.0-stable.so"), "INPUT(...)").unwrap();
        fs::write(lib.join("librustc_driver-6108105cd7e839cf.so"), "").unwrap();
        fs::create_dir(lib.join("rustlib")).unwrap();
        assert!(find_llvm_dylib(&lib, 22).is_err());
        fs::write(lib.join("libLLVM.so.22.1-rust-1.95.0-stable"), "elf").unwrap();
        assert_eq!(
            find_llvm_dylib(&lib, 22).unwrap(),
            lib.join("libLLVM.so.22.1-rust-1.95.0-stable")
        );
        // Two majors: the one rustc reports wins.
        fs::write(lib.join("libLLVM.so.21.1-rust-1.90.0-stable"), "elf").unwrap();
        assert_eq!(
            find_llvm_dylib(&lib, 22).unwrap(),
            lib.join("libLLVM.so.22.1-rust-1.95.0-stable")
        );
    }

    #[test]
    fn finds_the_llvm_library_of_the_installed_rustc() {
        let llvm = RustcLlvm::detect().unwrap();
        assert!(llvm.lib.is_file());
        assert!(llvm
            .lib_name()
            .starts_with(&format!("libLLVM.so.{}.", llvm.major)));
    }

    #[test]
    fn prefix_symlinks_are_created_and_repaired() {
        let tmp = TestDir::new("prefix");
        let old = tmp.join("libLLVM.so.21.1-rust-1.90.0-stable");
        let lib = tmp.join("libLLVM.so.22.1-rust-1.95.0-stable");
        fs::write(&old, "old").unwrap();
        fs::write(&lib, "new").unwrap();
        let prefix = tmp.join("cache/sluice/llvm");
        let links = [
            prefix.join("lib/libLLVM.so"),
            prefix.join("lib/libLLVM.so.22.1-rust-1.95.0-stable"),
        ];

        link_llvm_prefix(&prefix, &old).unwrap();
        assert_eq!(fs::read_link(&links[0]).unwrap(), old);
        // A regular file where a link belongs is replaced too.
        fs::write(&links[1], "stray").unwrap();
        link_llvm_prefix(&prefix, &lib).unwrap();
        for link in &links {
            assert_eq!(fs::read_link(link).unwrap(), lib);
            assert_eq!(fs::read_to_string(link).unwrap(), "new");
        }
        // Idempotent.
        link_llvm_prefix(&prefix, &lib).unwrap();
        assert_eq!(fs::read_link(&links[0]).unwrap(), lib);
    }

    #[test]
    fn reads_the_llvm_dependency_of_the_installed_bpf_linker() {
        // setup installs bpf-linker linked against rustc's shared libLLVM; a missing or
        // statically linked one is a machine setup has not prepared.
        let linker = find_bpf_linker()
            .expect("bpf-linker is not on PATH nor in cargo's bin: run `cargo xtask setup`");
        let linked = linked_llvm(&linker).unwrap_or_else(|| {
            panic!(
                "{} links no libLLVM dynamically: not the one `cargo xtask setup` builds",
                linker.display()
            )
        });
        assert!(linked.starts_with("libLLVM.so."), "{linked}");
    }
}
