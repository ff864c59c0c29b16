//! `cargo xtask build [--debug]`: the eBPF object, then the workspace ([`run`]), then the
//! upgrade test's second `sluice` ([`build_upgrade_binary`]).
//!
//! # The stable-toolchain eBPF recipe
//!
//! The usual aya recipe (`cargo +nightly build -Z build-std=core --target bpfel-unknown-none`)
//! needs nightly and the `rust-src` component; neither is available here. Instead:
//!
//! 1. `lb-ebpf` (a `no_std` `staticlib`, outside the workspace) is compiled for the *host*
//!    target with `-C linker-plugin-lto`, so its objects carry LLVM bitcode. libcore's
//!    precompiled objects carry embedded bitcode too, so no core source is needed. The explicit
//!    `--target` keeps [`EBPF_RUSTFLAGS`] off build scripts and proc-macros.
//! 2. bpf-linker (built against rustc's own LLVM by `cargo xtask setup`) links that bitcode and
//!    generates BPF code, exporting every program and map (see `exports.rs`).
//!
//! Consequences for the eBPF code: `cfg(target_arch = "bpf")` is false while it compiles (so
//! aya-log-ebpf does not work), and kernel/user shared types must be `#[repr(C)]` with explicit
//! padding (x86_64 and bpfel are both 64-bit little endian).

use std::{
    fs,
    path::{Path, PathBuf},
    process::Command,
    time::SystemTime,
};

use anyhow::{bail, Context, Result};

use crate::{
    cmd::{self, step},
    exports::{self, Kind},
    setup, verify,
};

/// The host target the eBPF crate is compiled for before bpf-linker retargets it to BPF.
pub const EBPF_HOST_TARGET: &str = "x86_64-unknown-linux-gnu";

/// RUSTFLAGS for the eBPF crate (and only it).
pub const EBPF_RUSTFLAGS: &[&str] = &[
    // Emit LLVM bitcode into the staticlib: bpf-linker links bitcode, not x86 machine code.
    "-C",
    "linker-plugin-lto",
    // BPF cannot unwind.
    "-C",
    "panic=abort",
    // No GOT/PLT or position-independent code in BPF.
    "-C",
    "relocation-model=static",
    // No unwind tables to carry into the BPF object.
    "-C",
    "force-unwind-tables=no",
    // DWARF is what bpf-linker's --btf turns into .BTF/.BTF.ext (without it, --btf silently
    // emits nothing).
    "-C",
    "debuginfo=2",
];

/// bpf-linker flags besides the exports.
pub const BPF_LINKER_FLAGS: &[&str] = &[
    "--target",
    "bpfel",
    // v3: ALU32 and 32-bit jumps; smaller programs, less verifier work (kernel >= 5.1).
    "--cpu",
    "v3",
    // Not `+allows-misaligned-mem-access`: it also lets LLVM copy 4-aligned stack structs
    // with 8-byte moves, which the verifier rejects ("misaligned stack access").
    // Without it, key zeroing and 16-byte address copies become calls to byte-loop
    // memset/memmove (measured: 916 -> 679 instructions, verifier work 10,048 -> 1,794).
    "--disable-expand-memcpy-in-order",
    // Emit BTF (needs -C debuginfo=2 above).
    "--btf",
];

/// Where the BPF object goes; lb-userspace/build.rs embeds it from here.
pub fn object_path() -> PathBuf {
    cmd::workspace_root().join("target/bpf/sluice.bpf.o")
}

/// Sources the object is built from; an object older than any of them is stale (the same
/// list as lb-userspace/build.rs).
const OBJECT_INPUTS: &[&str] = &[
    "lb-ebpf/src",
    "lb-ebpf/Cargo.toml",
    "lb-common/src",
    "lb-common/Cargo.toml",
];

#[derive(Clone, Copy, PartialEq, Eq)]
pub enum Profile {
    Debug,
    Release,
}

pub fn run(profile: Profile) -> Result<()> {
    build_ebpf()?;
    build_workspace(profile)
}

/// Builds lb-ebpf and links `target/bpf/sluice.bpf.o`; returns its path.
pub fn build_ebpf() -> Result<PathBuf> {
    step("build the eBPF object");
    let root = cmd::workspace_root();
    let ebpf = EbpfBuild::scan()?;
    let staticlib = ebpf.compile(&[], &root.join("lb-ebpf/target"))?;
    let out = object_path();
    ebpf.link(&staticlib, BPF_LINKER_FLAGS, &out)?;

    // The upgrade test needs a newer build whose program differs from this one: the same
    // bitcode linked for BPF CPU v2 (no 32-bit jumps) gives other instructions and another
    // program tag, with the same maps, and no test code in the data plane.
    let flags: Vec<&str> = BPF_LINKER_FLAGS
        .iter()
        .map(|f| if *f == "v3" { "v2" } else { *f })
        .collect();
    ebpf.link(&staticlib, &flags, &upgrade_variant_path())?;
    Ok(out)
}

/// Where [`build_stage_objects`] puts its objects (`<feature>.bpf.o`); `sluice-bench xdp
/// --stages` loads them from here.
pub fn stages_dir() -> PathBuf {
    cmd::workspace_root().join("target/bpf/stages")
}

/// The stage-ablation objects of the per-packet cost breakdown: one per `ablate-*` or
/// `stop-after-*` feature of lb-ebpf/Cargo.toml, each built alone, in a target directory of
/// their own so the production build is not rebuilt after them.
pub fn build_stage_objects() -> Result<()> {
    step("build the stage-ablation objects");
    let root = cmd::workspace_root();
    let manifest = root.join("lb-ebpf/Cargo.toml");
    let text =
        fs::read_to_string(&manifest).with_context(|| format!("reading {}", manifest.display()))?;
    let features: Vec<&str> = text
        .lines()
        .filter_map(|l| l.split_once(" = []").map(|(name, _)| name.trim()))
        .filter(|f| f.starts_with("ablate-") || f.starts_with("stop-after-"))
        .collect();
    if features.is_empty() {
        bail!(
            "{} declares no ablate-* or stop-after-* feature",
            manifest.display()
        );
    }
    let ebpf = EbpfBuild::scan()?;
    let dir = stages_dir();
    fs::create_dir_all(&dir).with_context(|| format!("creating {}", dir.display()))?;
    for f in features {
        let staticlib = ebpf.compile(&[f], &root.join("target/bpf-stages"))?;
        ebpf.link(
            &staticlib,
            BPF_LINKER_FLAGS,
            &dir.join(format!("{f}.bpf.o")),
        )?;
    }
    Ok(())
}

/// What compiling and linking the eBPF crate needs: bpf-linker and the crate's exports.
struct EbpfBuild {
    linker: PathBuf,
    exports: Vec<exports::Export>,
}

impl EbpfBuild {
    fn scan() -> Result<EbpfBuild> {
        let root = cmd::workspace_root();
        let linker = setup::find_bpf_linker()
            .context("bpf-linker is not installed: run `cargo xtask setup`")?;
        let exports = exports::scan_dir(&root.join("lb-ebpf/src"))?;
        let list = |kind| {
            exports
                .iter()
                .filter(|e| e.kind == kind)
                .map(|e| e.name.as_str())
                .collect::<Vec<_>>()
        };
        println!(
            "programs found in lb-ebpf/src: {}",
            list(Kind::Program).join(", ")
        );
        println!(
            "maps found in lb-ebpf/src:     {}",
            list(Kind::Map).join(", ")
        );
        if list(Kind::Program).is_empty() {
            bail!("no program (#[xdp], #[classifier], ...) found in lb-ebpf/src");
        }
        Ok(EbpfBuild { linker, exports })
    }

    /// Compiles lb-ebpf with `features` into `target_dir`; returns its bitcode staticlib.
    fn compile(&self, features: &[&str], target_dir: &Path) -> Result<PathBuf> {
        // lb-ebpf is excluded from the workspace and has its own Cargo.lock; clean_cargo()
        // drops RUSTFLAGS, CARGO_TARGET_DIR, CARGO_BUILD_TARGET etc. inherited from the outer
        // cargo or the shell, so only the flags below apply.
        let mut cargo = cmd::clean_cargo();
        cargo
            .current_dir(cmd::workspace_root().join("lb-ebpf"))
            .env("RUSTFLAGS", EBPF_RUSTFLAGS.join(" "))
            .arg("build")
            .arg("--target-dir")
            .arg(target_dir)
            .args(["--release", "--target", EBPF_HOST_TARGET]);
        if !features.is_empty() {
            cargo.args(["--features", &features.join(",")]);
        }
        cmd::run(&mut cargo)?;
        let staticlib = target_dir.join(format!("{EBPF_HOST_TARGET}/release/liblb_ebpf.a"));
        if !staticlib.is_file() {
            bail!("the eBPF build did not produce {}", staticlib.display());
        }
        Ok(staticlib)
    }

    /// Links `staticlib` with `flags` into `dest`. Every program and map must be exported:
    /// bpf-linker internalizes the rest, which drops programs and leaves maps LOCAL (aya:
    /// `error parsing map`).
    fn link(&self, staticlib: &Path, flags: &[&str], dest: &Path) -> Result<()> {
        let dir = dest.parent().expect("object path has a parent");
        fs::create_dir_all(dir).with_context(|| format!("creating {}", dir.display()))?;
        let tmp = dest.with_extension("o.tmp");
        cmd::run(
            Command::new(&self.linker)
                .args(flags)
                .args(
                    self.exports
                        .iter()
                        .flat_map(|e| ["--export", e.name.as_str()]),
                )
                .arg("-o")
                .arg(&tmp)
                .arg(staticlib),
        )?;
        verify::verify_object(&tmp, &self.exports)?;
        replace_if_changed(&tmp, dest)
    }
}

/// The object the upgrade test swaps in: [`build_ebpf`] links it for BPF CPU v2.
pub fn upgrade_variant_path() -> PathBuf {
    cmd::workspace_root().join("target/bpf/sluice-cpu-v2.bpf.o")
}

/// Where, under `target/`, [`build_upgrade_binary`] builds (tests/src/daemon_lab.rs reads it
/// from there).
const UPGRADE_TARGET_DIR: &str = "upgrade";

/// The newer `sluice` of the daemon upgrade test (`target/upgrade/debug/sluice`, a debug build
/// whatever the profile of the rest: only the tests run it): the same sources with
/// [`upgrade_variant_path`] embedded instead of the default object (lb-userspace/build.rs
/// reads `SLUICE_BPF_OBJECT` at build time only), so it runs another program on the same
/// maps. Its own target directory keeps the two builds from replacing each other's `sluice`.
/// `cargo xtask build` and `cargo xtask test` build it; the commands that only need the
/// release binaries (package, bench, demo) do not.
pub fn build_upgrade_binary() -> Result<()> {
    step("build the upgrade test's second sluice (CPU v2 object embedded)");
    let root = cmd::workspace_root();
    let mut cargo = cmd::cargo();
    cargo
        .current_dir(&root)
        .env("SLUICE_BPF_OBJECT", upgrade_variant_path())
        .env(
            "CARGO_TARGET_DIR",
            root.join("target").join(UPGRADE_TARGET_DIR),
        )
        .args(["build", "-p", "lb-userspace", "--bin", "sluice"]);
    cmd::run(&mut cargo)
}

/// Moves `tmp` over `out`, unless `out` has the same bytes and is still newer than every
/// source (keeping its mtime spares lb-userspace a rebuild).
fn replace_if_changed(tmp: &Path, out: &Path) -> Result<()> {
    let same = fs::read(out).is_ok_and(|old| fs::read(tmp).is_ok_and(|new| old == new));
    let fresh = || -> Result<bool> {
        let built = fs::metadata(out)?.modified()?;
        Ok(newest_input()? <= built)
    };
    if same && fresh().unwrap_or(false) {
        fs::remove_file(tmp)?;
        println!("{} is unchanged", out.display());
    } else {
        fs::rename(tmp, out).with_context(|| format!("writing {}", out.display()))?;
        println!("wrote {}", out.display());
    }
    Ok(())
}

fn newest_input() -> Result<SystemTime> {
    let root = cmd::workspace_root();
    let mut newest = SystemTime::UNIX_EPOCH;
    for input in OBJECT_INPUTS {
        newest = newest.max(newest_mtime(&root.join(input))?);
    }
    Ok(newest)
}

fn newest_mtime(path: &Path) -> Result<SystemTime> {
    let meta = fs::metadata(path).with_context(|| format!("reading {}", path.display()))?;
    let mut newest = meta.modified()?;
    if meta.is_dir() {
        for entry in fs::read_dir(path)? {
            newest = newest.max(newest_mtime(&entry?.path())?);
        }
    }
    Ok(newest)
}

/// `cargo build` of the workspace (release unless `--debug`). xtask itself is skipped: it is
/// already built, it is what is running.
pub fn build_workspace(profile: Profile) -> Result<()> {
    step("build the workspace");
    let mut cargo = cmd::cargo();
    cargo
        .current_dir(cmd::workspace_root())
        .args(["build", "--workspace", "--exclude", "xtask"]);
    if profile == Profile::Release {
        cargo.arg("--release");
    }
    cmd::run(&mut cargo)
}
