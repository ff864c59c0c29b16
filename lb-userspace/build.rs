//! Embeds the BPF object built by `cargo xtask build` (`target/bpf/sluice.bpf.o`, or the file
//! named by `SLUICE_BPF_OBJECT`) into the library: copies it to `$OUT_DIR/sluice.bpf.o`, which
//! `src/object.rs` includes.
//!
//! The object is compiled by `cargo xtask build` (cargo cannot build the eBPF crate itself:
//! it needs its own flags and bpf-linker), so this script only checks that it exists and is
//! not older than the sources it is built from, and fails with the command to run otherwise.

use std::{
    env, fs,
    path::{Path, PathBuf},
    process::exit,
    time::SystemTime,
};

const OBJECT_ENV: &str = "SLUICE_BPF_OBJECT";
/// The git revision `sluice --version` shows: this variable when set (a build from a source
/// archive), else `git describe --always` of the tree, else "unknown".
const REV_ENV: &str = "SLUICE_GIT_REV";

/// Sources the default object is built from (relative to the workspace root); the same list
/// as `OBJECT_INPUTS` in xtask/src/build.rs.
const INPUTS: &[&str] = &[
    "lb-ebpf/src",
    "lb-ebpf/Cargo.toml",
    "lb-common/src",
    "lb-common/Cargo.toml",
];

fn main() {
    let manifest_dir = PathBuf::from(env::var_os("CARGO_MANIFEST_DIR").expect("set by cargo"));
    let workspace = manifest_dir
        .parent()
        .expect("lb-userspace is in the workspace");
    let out_dir = PathBuf::from(env::var_os("OUT_DIR").expect("set by cargo"));

    println!("cargo::rerun-if-env-changed={OBJECT_ENV}");
    println!("cargo::rustc-env={REV_ENV}={}", git_rev(workspace));
    for input in INPUTS {
        // A directory is scanned recursively by cargo.
        println!(
            "cargo::rerun-if-changed={}",
            workspace.join(input).display()
        );
    }

    let object = match env::var_os(OBJECT_ENV).filter(|v| !v.is_empty()) {
        // An explicitly named object may come from elsewhere (a package build, another
        // tree): it is used as is, without the staleness check.
        Some(path) => {
            let path = PathBuf::from(path);
            println!("cargo::rerun-if-changed={}", path.display());
            if !path.is_file() {
                fail(&format!("{OBJECT_ENV}={} does not exist", path.display()));
            }
            path
        }
        None => {
            let path = workspace.join("target/bpf/sluice.bpf.o");
            println!("cargo::rerun-if-changed={}", path.display());
            check_fresh(workspace, &path);
            path
        }
    };
    let dest = out_dir.join("sluice.bpf.o");
    if let Err(e) = fs::copy(&object, &dest) {
        fail(&format!(
            "copying {} to {}: {e}",
            object.display(),
            dest.display()
        ));
    }
}

/// Fails unless `object` exists and is newer than every file (and directory) in INPUTS.
fn check_fresh(workspace: &Path, object: &Path) {
    let built = match fs::metadata(object).and_then(|m| m.modified()) {
        Ok(t) => t,
        Err(_) => fail(&format!(
            "the BPF object {} does not exist: run `cargo xtask build` (or `cargo xtask setup` \
             first on a new machine)",
            object.display()
        )),
    };
    let mut newest: Option<(SystemTime, PathBuf)> = None;
    for input in INPUTS {
        newest_mtime(&workspace.join(input), &mut newest);
    }
    if let Some((time, path)) = newest {
        if time > built {
            fail(&format!(
                "the BPF object {} is older than {}: run `cargo xtask build`",
                object.display(),
                path.strip_prefix(workspace).unwrap_or(&path).display()
            ));
        }
    }
}

fn newest_mtime(path: &Path, newest: &mut Option<(SystemTime, PathBuf)>) {
    let Ok(meta) = fs::metadata(path) else { return };
    if let Ok(time) = meta.modified() {
        if newest.as_ref().is_none_or(|(t, _)| time > *t) {
            *newest = Some((time, path.to_path_buf()));
        }
    }
    if meta.is_dir() {
        if let Ok(entries) = fs::read_dir(path) {
            for entry in entries.flatten() {
                newest_mtime(&entry.path(), newest);
            }
        }
    }
}

/// `git describe --always` of the workspace (the commit checked out; uncommitted edits are
/// not marked: the script reruns only when HEAD moves).
fn git_rev(workspace: &Path) -> String {
    println!("cargo::rerun-if-env-changed={REV_ENV}");
    if let Some(rev) = env::var_os(REV_ENV).filter(|v| !v.is_empty()) {
        return rev.to_string_lossy().into_owned();
    }
    let git = |args: &[&str]| {
        std::process::Command::new("git")
            .arg("-C")
            .arg(workspace)
            .args(args)
            .output()
            .ok()
            .filter(|o| o.status.success())
            .map(|o| String::from_utf8_lossy(&o.stdout).trim().to_string())
    };
    // A worktree's HEAD and its log live in the worktree's own git directory.
    for file in ["HEAD", "logs/HEAD"] {
        if let Some(p) = git(&["rev-parse", "--git-path", file]) {
            let p = workspace.join(p);
            if p.exists() {
                println!("cargo::rerun-if-changed={}", p.display());
            }
        }
    }
    git(&["describe", "--always", "--abbrev=12"]).unwrap_or_else(|| "unknown".into())
}

fn fail(msg: &str) -> ! {
    println!("cargo::error={msg}");
    exit(1);
}
