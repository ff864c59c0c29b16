//! `cargo xtask test`: setup, build, then every test in the workspace, one layer at a time,
//! and how long each layer took.

use std::{fs, time::Instant};

use anyhow::{bail, Context, Result};

use crate::{
    build::{self, Profile},
    cmd::{self, step},
    setup,
};

/// The test layers of sluice-tests: each integration test file (tests/tests/NAME.rs) and the
/// layer it belongs to. A file in none of them fails the run, so none is silently left out.
const LAYERS: &[(&str, &[&str])] = &[
    (
        "packet tests (BPF_PROG_TEST_RUN)",
        &["packet", "inband", "pinning", "fuzz", "trace", "readable"],
    ),
    (
        "namespace tests (XDP on veth, real streams)",
        &["netns", "backend_host", "second_chance"],
    ),
    (
        "daemon-lab tests (`sluice run` in the namespace lab)",
        &[
            "daemon",
            "adaptive",
            "hostile",
            "observe",
            "inband_lab",
            "quic",
            "tenants_lab",
        ],
    ),
    (
        "fleet tests (three LB hosts behind a BIRD router with ECMP and BFD)",
        &["fleet"],
    ),
    (
        "fleet-state tests (three `sluice run` hosts sharing state through a real etcd)",
        &["fleet_state"],
    ),
    (
        "package test (the .deb installed, both daemons run as their units would)",
        &["package"],
    ),
];

pub fn run() -> Result<()> {
    if !cmd::is_root() {
        bail!(
            "`cargo xtask test` must run as root: the packet (BPF_PROG_TEST_RUN) and \
             network-namespace tests in sluice-tests load BPF programs, create namespaces and \
             attach XDP. Run it as root (e.g. `sudo -E cargo xtask test`)."
        );
    }
    setup::run()?;
    // Debug: the test profile reuses the dev profile's dependencies.
    build::run(Profile::Debug)?;
    build::build_upgrade_binary()?;

    let root = cmd::workspace_root();
    check_layers(&test_files(&root.join("tests/tests"))?)?;
    // The unit layer also runs sluice-tests' own modules (library and binaries). One command
    // at a time in the other layers: those tests share bpffs, interfaces and namespaces.
    let mut runs: Vec<(&str, Vec<Vec<&str>>)> = vec![(
        "unit tests (workspace, and sluice-tests' own modules)",
        vec![
            vec!["test", "--workspace", "--exclude", "sluice-tests"],
            vec!["test", "-p", "sluice-tests", "--lib", "--bins"],
        ],
    )];
    for (name, files) in LAYERS {
        let mut args = vec!["test", "-p", "sluice-tests"];
        for f in *files {
            args.extend(["--test", f]);
        }
        args.extend(["--", "--test-threads=1"]);
        runs.push((name, vec![args]));
    }

    let mut failed = Vec::new();
    let mut took = Vec::new();
    for (name, commands) in runs {
        step(name);
        let t = Instant::now();
        let mut ok = true;
        for args in commands {
            if let Err(e) = cmd::run(cmd::cargo().current_dir(&root).args(args)) {
                println!("FAILED: {e:#}");
                ok = false;
            }
        }
        if !ok {
            failed.push(name);
        }
        took.push((name, t.elapsed(), ok));
    }

    println!("\n==> time per test layer");
    for (name, d, ok) in &took {
        let verdict = if *ok { "ok" } else { "FAILED" };
        println!("{:>8.1} s  {verdict:<6}  {name}", d.as_secs_f64());
    }
    if !failed.is_empty() {
        bail!("failed: {}", failed.join(", "));
    }
    println!("\nall tests passed");
    Ok(())
}

/// The integration test files of sluice-tests (their names, without `.rs`).
fn test_files(dir: &std::path::Path) -> Result<Vec<String>> {
    let mut names = Vec::new();
    for e in fs::read_dir(dir).with_context(|| format!("listing {}", dir.display()))? {
        let name = e?.file_name().to_string_lossy().into_owned();
        if let Some(stem) = name.strip_suffix(".rs") {
            names.push(stem.to_string());
        }
    }
    names.sort();
    Ok(names)
}

/// Every test file is in exactly one layer, and every layer's file exists.
fn check_layers(files: &[String]) -> Result<()> {
    let listed: Vec<&str> = LAYERS
        .iter()
        .flat_map(|(_, fs)| fs.iter().copied())
        .collect();
    let missing: Vec<&String> = files
        .iter()
        .filter(|f| !listed.contains(&f.as_str()))
        .collect();
    if !missing.is_empty() {
        bail!(
            "tests/tests has {missing:?}, which no test layer runs: add each to a layer in \
             xtask/src/test.rs (LAYERS)"
        );
    }
    if let Some(gone) = listed.iter().find(|l| !files.iter().any(|f| f == *l)) {
        bail!("xtask/src/test.rs (LAYERS) names tests/tests/{gone}.rs, which does not exist");
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_test_file_of_sluice_tests_is_in_a_layer() {
        let dir = cmd::workspace_root().join("tests/tests");
        check_layers(&test_files(&dir).unwrap()).unwrap();
    }

    #[test]
    fn an_unlisted_or_missing_test_file_is_an_error() {
        let mut files: Vec<String> = LAYERS
            .iter()
            .flat_map(|(_, fs)| fs.iter().map(|f| f.to_string()))
            .collect();
        check_layers(&files).unwrap();
        files.push("new".into());
        let e = check_layers(&files).unwrap_err().to_string();
        assert!(e.contains("\"new\""), "{e}");
        files.retain(|f| f != "new" && f != "netns");
        let e = check_layers(&files).unwrap_err().to_string();
        assert!(e.contains("tests/tests/netns.rs"), "{e}");
    }
}
