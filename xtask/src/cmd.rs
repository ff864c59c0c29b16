//! Running external commands and small process/path helpers shared by the tasks.
//!
//! Every command is printed (`$ ...`, with its directory and the environment it sets) before
//! it runs, so the output of a task is also a transcript of what it did.

use std::{
    env,
    ffi::OsStr,
    fs,
    path::{Path, PathBuf},
    process::Command,
};

use anyhow::{bail, Context, Result};

/// The workspace root (the directory above `xtask/`).
pub fn workspace_root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .parent()
        .expect("xtask/ lives inside the workspace")
        .to_path_buf()
}

/// Prints the heading of a step.
pub fn step(what: &str) {
    println!("\n==> {what}");
}

/// Whether the effective user is root (from `/proc/self/status`, `Uid: real effective ...`).
pub fn is_root() -> bool {
    fs::read_to_string("/proc/self/status")
        .ok()
        .and_then(|status| {
            let line = status.lines().find(|l| l.starts_with("Uid:"))?;
            line.split_whitespace().nth(2).map(|euid| euid == "0")
        })
        .unwrap_or(false)
}

/// `cargo`, the same binary (and so the same toolchain) that runs this xtask.
pub fn cargo() -> Command {
    Command::new(env::var_os("CARGO").unwrap_or_else(|| "cargo".into()))
}

/// A `cargo` whose environment carries nothing from the outer `cargo xtask` invocation or the
/// user's shell that would change how a nested, self-contained build is compiled: the eBPF
/// crate must be built with exactly the flags in `build.rs`, and `cargo install` must not
/// pick up a target directory, target triple or flags meant for the workspace.
///
/// Removed: `RUSTFLAGS`, `RUSTDOCFLAGS`, `CARGO_ENCODED_*FLAGS`, `RUSTC_WORKSPACE_WRAPPER`
/// and every `CARGO_*` variable except the ones that only say where cargo lives, how it
/// reaches registries and how it prints (`CARGO_HOME`, `CARGO_NET_*`, `CARGO_HTTP_*`,
/// `CARGO_REGISTRIES_*`, `CARGO_REGISTRY_*`, `CARGO_TERM_*`, `CARGO_LOG`).
pub fn clean_cargo() -> Command {
    let mut cmd = cargo();
    for (key, _) in env::vars_os() {
        let Some(key) = key.to_str() else { continue };
        if cargo_var_interferes(key) {
            cmd.env_remove(key);
        }
    }
    cmd
}

fn cargo_var_interferes(key: &str) -> bool {
    const KEEP: &[&str] = &[
        "CARGO_HOME",
        "CARGO_NET_",
        "CARGO_HTTP_",
        "CARGO_REGISTRIES_",
        "CARGO_REGISTRY_",
        "CARGO_TERM_",
        "CARGO_LOG",
    ];
    match key {
        "RUSTFLAGS" | "RUSTDOCFLAGS" | "RUSTC_WORKSPACE_WRAPPER" => true,
        "CARGO" => false,
        _ if key.starts_with("CARGO_") => !KEEP.iter().any(|keep| key.starts_with(keep)),
        _ => false,
    }
}

/// Prints, then runs `cmd`, failing unless it exits with status 0.
pub fn run(cmd: &mut Command) -> Result<()> {
    let shown = display(cmd);
    println!("{shown}");
    let status = cmd
        .status()
        .with_context(|| format!("could not start `{}`", cmd.get_program().to_string_lossy()))?;
    if !status.success() {
        bail!("command failed ({status}): {shown}");
    }
    Ok(())
}

/// Runs `cmd` quietly (a query, not an action) and returns its stdout; fails on non-zero exit.
pub fn output(cmd: &mut Command) -> Result<String> {
    let out = cmd
        .output()
        .with_context(|| format!("could not start `{}`", cmd.get_program().to_string_lossy()))?;
    if !out.status.success() {
        bail!(
            "command failed ({}): {}\n{}",
            out.status,
            display(cmd),
            String::from_utf8_lossy(&out.stderr).trim_end()
        );
    }
    Ok(String::from_utf8_lossy(&out.stdout).into_owned())
}

/// `[in DIR] VAR=value ... $ program args`, quoted so it can be pasted into a shell.
pub fn display(cmd: &Command) -> String {
    let mut s = String::new();
    // The directory, unless it is the workspace root.
    if let Some(dir) = cmd.get_current_dir() {
        let dir = dir.strip_prefix(workspace_root()).unwrap_or(dir);
        if !dir.as_os_str().is_empty() {
            s.push_str(&format!("(in {}) ", dir.display()));
        }
    }
    s.push_str("$ ");
    for (key, value) in cmd.get_envs() {
        if let Some(value) = value {
            s.push_str(&format!("{}={} ", key.to_string_lossy(), quote(value)));
        }
    }
    let program = Path::new(cmd.get_program());
    // Show `cargo` rather than the toolchain's full path taken from $CARGO.
    let program = match program.file_name() {
        Some(name) if name == "cargo" => name,
        _ => program.as_os_str(),
    };
    s.push_str(&quote(program));
    for arg in cmd.get_args() {
        s.push(' ');
        s.push_str(&quote(arg));
    }
    s
}

fn quote(s: &OsStr) -> String {
    let s = s.to_string_lossy();
    let plain = |c: char| c.is_ascii_alphanumeric() || "-_./=:,+@%^".contains(c);
    if !s.is_empty() && s.chars().all(plain) {
        s.into_owned()
    } else {
        format!("'{}'", s.replace('\'', r"'\''"))
    }
}

/// Looks for an executable named `name` on `PATH`.
pub fn find_on_path(name: &str) -> Option<PathBuf> {
    env::split_paths(&env::var_os("PATH")?)
        .map(|dir| dir.join(name))
        .find(|p| is_executable(p))
}

pub fn is_executable(path: &Path) -> bool {
    use std::os::unix::fs::PermissionsExt;
    fs::metadata(path).is_ok_and(|m| m.is_file() && m.permissions().mode() & 0o111 != 0)
}

/// Cargo's home (`$CARGO_HOME`, else `~/.cargo`).
pub fn cargo_home() -> Option<PathBuf> {
    env::var_os("CARGO_HOME")
        .filter(|h| !h.is_empty())
        .map(PathBuf::from)
        .or_else(|| home().map(|h| h.join(".cargo")))
}

pub fn home() -> Option<PathBuf> {
    env::var_os("HOME")
        .filter(|h| !h.is_empty())
        .map(PathBuf::from)
}

/// The workspace's cargo target directory, taken from where this xtask binary was built
/// (`<target>/<profile>/xtask`), so `CARGO_TARGET_DIR` and `build.target-dir` are honoured.
pub fn target_dir() -> PathBuf {
    std::env::current_exe()
        .ok()
        .and_then(|exe| Some(exe.parent()?.parent()?.to_path_buf()))
        .filter(|dir| dir.join("CACHEDIR.TAG").exists())
        .unwrap_or_else(|| workspace_root().join("target"))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn outer_cargo_build_env_is_dropped() {
        for key in [
            "RUSTFLAGS",
            "CARGO_ENCODED_RUSTFLAGS",
            "CARGO_TARGET_DIR",
            "CARGO_BUILD_TARGET",
            "CARGO_BUILD_RUSTFLAGS",
            "CARGO_TARGET_X86_64_UNKNOWN_LINUX_GNU_RUSTFLAGS",
            "CARGO_PROFILE_RELEASE_LTO",
            "CARGO_MANIFEST_DIR",
            "CARGO_PKG_NAME",
        ] {
            assert!(cargo_var_interferes(key), "{key}");
        }
        for key in [
            "CARGO_HOME",
            "CARGO_NET_OFFLINE",
            "CARGO_TERM_COLOR",
            "PATH",
            "HOME",
        ] {
            assert!(!cargo_var_interferes(key), "{key}");
        }
    }

    #[test]
    fn commands_are_shown_shell_quoted() {
        let mut cmd = Command::new("echo");
        cmd.env("RUSTFLAGS", "-C a -C b").args(["x", "it's"]);
        assert_eq!(display(&cmd), r#"$ RUSTFLAGS='-C a -C b' echo x 'it'\''s'"#);
    }
}
