//! `cargo xtask package`: the Debian package (`target/package/sluice_<version>_<arch>.deb`),
//! built with cargo-deb from the release build: the `sluice` binary, the two systemd units
//! (`packaging/systemd/`), the default configurations (`packaging/sluice.toml`, which steers
//! nothing until edited, and `packaging/backend-host.toml`, which serves no VIP), the example
//! configurations, man pages rendered from the CLI (clap_mangen, `sluice manpages`) and shell
//! completions (`sluice completions`). The file list is `[package.metadata.deb]` in
//! lb-userspace/Cargo.toml; the generated files go to `packaging/generated/` first (git
//! ignores it; cargo-deb takes only its own binaries from under `target/`).

use std::{
    fs,
    path::{Path, PathBuf},
    process::Command,
};

use anyhow::{bail, Context, Result};

use crate::{
    build::{self, Profile},
    cmd::{self, step},
};

/// Where the .deb goes.
pub fn out_dir() -> PathBuf {
    cmd::target_dir().join("package")
}

/// Where the generated man pages and completions go (the asset paths in
/// lb-userspace/Cargo.toml name this directory).
pub fn generated_dir() -> PathBuf {
    cmd::workspace_root().join("packaging/generated")
}

/// Builds (release), generates the man pages and completions, and runs cargo-deb; returns
/// the package's path.
pub fn run() -> Result<PathBuf> {
    if cmd::find_on_path("cargo-deb").is_none()
        && !cmd::cargo_home().is_some_and(|h| cmd::is_executable(&h.join("bin/cargo-deb")))
    {
        bail!("cargo-deb is not installed: run `cargo xtask setup` (it installs it)");
    }
    build::run(Profile::Release)?;
    let out = out_dir();
    let gen = generated_dir();
    let sluice = cmd::target_dir().join("release/sluice");

    step("man pages and shell completions");
    for sub in ["man", "completions"] {
        let d = gen.join(sub);
        if d.exists() {
            fs::remove_dir_all(&d).with_context(|| format!("removing {}", d.display()))?;
        }
    }
    let man = gen.join("man");
    cmd::run(Command::new(&sluice).arg("manpages").arg(&man))?;
    let mut pages: Vec<PathBuf> = fs::read_dir(&man)?
        .map(|e| e.map(|e| e.path()))
        .collect::<std::io::Result<_>>()?;
    pages.sort();
    // -n: no name or time stamp inside, so the same pages give the same package.
    cmd::run(Command::new("gzip").arg("-9nf").args(&pages))?;
    let completions = gen.join("completions");
    fs::create_dir_all(&completions)?;
    for (shell, file) in [
        ("bash", "sluice"),
        ("zsh", "_sluice"),
        ("fish", "sluice.fish"),
    ] {
        let text = cmd::output(Command::new(&sluice).args(["completions", shell]))?;
        write(&completions.join(file), &text)?;
    }

    step("Debian package (cargo-deb)");
    // Old packages would make the path printed below ambiguous.
    fs::create_dir_all(&out)?;
    for e in fs::read_dir(&out)? {
        let p = e?.path();
        if p.extension().is_some_and(|x| x == "deb") {
            fs::remove_file(&p)?;
        }
    }
    cmd::run(
        cmd::cargo()
            .current_dir(cmd::workspace_root())
            .args(["deb", "-p", "lb-userspace", "--no-build", "--output"])
            .arg(&out),
    )?;
    let deb = fs::read_dir(&out)?
        .filter_map(|e| e.ok().map(|e| e.path()))
        .find(|p| p.extension().is_some_and(|x| x == "deb"))
        .context("cargo-deb wrote no .deb")?;
    println!("\npackage: {}", deb.display());
    Ok(deb)
}

fn write(path: &Path, text: &str) -> Result<()> {
    fs::write(path, text).with_context(|| format!("writing {}", path.display()))
}
