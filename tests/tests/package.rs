//! The Debian package as an operator gets it: `cargo xtask package` builds it, `dpkg -i`
//! installs it on this machine, `sluice check` accepts the installed default configuration,
//! `systemd-analyze verify` accepts the installed units (binaries and man pages included),
//! and both daemons run from the installed binary the way their units start them, with only
//! the units' capabilities, in the namespace lab: a token stream flows through the LB host to
//! the backend hosts. The package is purged at the end, also when the test fails.
//!
//! This machine has no systemd as PID 1, so `systemctl start` cannot run here. What stands in
//! for it: the units' `ExecStart` arguments (`run --config FILE`, `backend-host run --config
//! FILE`, read from the installed units), `setpriv` reducing the bounding, inheritable and
//! ambient capability sets to the unit's `CapabilityBoundingSet` (with no_new_privs, as
//! `NoNewPrivileges=yes`), `nsenter --net` for the lab's namespaces, and `$NOTIFY_SOCKET` read
//! by the lab for `Type=notify` readiness. The units' file-system sandboxing is not exercised.
//!
//! Needs root, dpkg, cargo-deb, systemd-analyze, man-db and setpriv (`cargo xtask setup`);
//! fails, never skips. Refuses to run while a `sluice` package is installed already.

use std::{
    fs,
    net::SocketAddr,
    path::{Path, PathBuf},
    process::Command,
};

use sluice_tests::{
    daemon_lab::{DaemonLab, DaemonLabOptions, VipDef},
    netns::{TCP_PORT, VIP4},
    require_root,
};

const SERVER: &str = env!("CARGO_BIN_EXE_sluice-testsrv");
const UNITS: [&str; 2] = [
    "/lib/systemd/system/sluice.service",
    "/lib/systemd/system/sluice-backend-host.service",
];
const BIN: &str = "/usr/bin/sluice";

/// Purges the package when dropped.
struct Installed;

impl Drop for Installed {
    fn drop(&mut self) {
        match Command::new("dpkg").args(["--purge", "sluice"]).output() {
            Ok(o) if o.status.success() => {}
            Ok(o) => eprintln!(
                "dpkg --purge sluice failed: {}",
                String::from_utf8_lossy(&o.stderr)
            ),
            Err(e) => eprintln!("dpkg --purge sluice: {e}"),
        }
    }
}

fn run(cmd: &mut Command) -> (i32, String, String) {
    let out = cmd
        .output()
        .unwrap_or_else(|e| panic!("running {cmd:?}: {e}"));
    (
        out.status.code().unwrap_or(-1),
        String::from_utf8_lossy(&out.stdout).into(),
        String::from_utf8_lossy(&out.stderr).into(),
    )
}

/// `cargo xtask package`; returns the .deb it reports.
fn build_package() -> PathBuf {
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("..");
    let mut cmd = Command::new(std::env::var_os("CARGO").unwrap_or_else(|| "cargo".into()));
    cmd.current_dir(&root).args(["xtask", "package"]);
    // What `cargo test` set for this test must not steer the nested build.
    for (k, _) in std::env::vars_os() {
        let k = k.to_string_lossy();
        if (k.starts_with("CARGO_") && k != "CARGO_HOME") || k == "RUSTFLAGS" {
            cmd.env_remove(&*k);
        }
    }
    let (code, out, err) = run(&mut cmd);
    assert_eq!(code, 0, "cargo xtask package failed:\n{out}\n{err}");
    let deb = out
        .lines()
        .find_map(|l| l.strip_prefix("package: "))
        .unwrap_or_else(|| panic!("cargo xtask package named no package:\n{out}"));
    PathBuf::from(deb)
}

/// A unit's `Key=` value.
fn unit_value(unit: &str, key: &str) -> String {
    let text = fs::read_to_string(unit).unwrap_or_else(|e| panic!("reading {unit}: {e}"));
    text.lines()
        .find_map(|l| l.strip_prefix(&format!("{key}=")))
        .unwrap_or_else(|| panic!("{unit} has no {key}="))
        .to_string()
}

/// `CAP_BPF CAP_NET_ADMIN` → `-all,+bpf,+net_admin` (setpriv's spelling).
fn setpriv_caps(bounding: &str) -> String {
    let mut s = "-all".to_string();
    for c in bounding.split_whitespace() {
        s.push_str(",+");
        s.push_str(&c.trim_start_matches("CAP_").to_lowercase());
    }
    s
}

/// The capability bits of `CAP_...` names (linux/capability.h numbers).
fn cap_mask(bounding: &str) -> u64 {
    bounding
        .split_whitespace()
        .map(|c| match c {
            "CAP_CHOWN" => 0,
            "CAP_NET_ADMIN" => 12,
            "CAP_NET_RAW" => 13,
            "CAP_SYS_ADMIN" => 21,
            "CAP_SYS_RESOURCE" => 24,
            "CAP_PERFMON" => 38,
            "CAP_BPF" => 39,
            other => panic!("the test does not know {other}: add its number"),
        })
        .fold(0, |m, bit| m | 1 << bit)
}

/// The effective capabilities of process `pid`.
fn cap_eff(pid: u32) -> u64 {
    let status = fs::read_to_string(format!("/proc/{pid}/status")).unwrap();
    let hex = status
        .lines()
        .find_map(|l| l.strip_prefix("CapEff:"))
        .unwrap()
        .trim();
    u64::from_str_radix(hex, 16).unwrap()
}

#[test]
fn the_package_installs_verifies_and_runs_both_daemons_with_the_units_capabilities() {
    require_root();
    let (code, ..) = run(Command::new("dpkg").args(["-s", "sluice"]));
    assert_ne!(
        code, 0,
        "a sluice package is installed already; this test installs and purges it: \
         `dpkg --purge sluice` first"
    );
    let deb = build_package();
    let (code, out, err) = run(Command::new("dpkg").arg("-i").arg(&deb));
    let _installed = Installed;
    assert_eq!(code, 0, "dpkg -i {}:\n{out}\n{err}", deb.display());

    // The installed binary is the one just built, with its git revision.
    let (_, version, _) = run(Command::new(BIN).arg("--version"));
    let built = Path::new(env!("CARGO_MANIFEST_DIR")).join("../target/release/sluice");
    let (_, built_version, _) = run(Command::new(&built).arg("--version"));
    assert!(version.starts_with("sluice 0.1.0 (git "), "{version}");
    assert_eq!(version, built_version);

    // The default configurations: valid, and harmless (no VIPs).
    let (code, out, err) =
        run(Command::new(BIN).args(["check", "--config", "/etc/sluice/sluice.toml"]));
    assert_eq!(code, 0, "{out}{err}");
    assert!(out.contains("valid (0 VIP(s), 0 backend(s)"), "{out}");
    let (_, out, err) = run(Command::new(BIN).args([
        "backend-host",
        "check",
        "--config",
        "/etc/sluice/backend-host.toml",
    ]));
    // Exit 1 is allowed: the DSR checks judge this machine's own interfaces.
    assert!(
        out.contains("backend-host.toml: valid (1 interface(s), 0 VIP(s))"),
        "{out}{err}"
    );

    // The units, their binaries and their man pages.
    let (code, out, err) = run(Command::new("systemd-analyze").arg("verify").args(UNITS));
    assert_eq!(code, 0, "systemd-analyze verify:\n{out}{err}");
    assert_eq!(err.trim(), "", "systemd-analyze verify warned");
    for page in [
        "sluice",
        "sluice-check",
        "sluice-run",
        "sluice-backend-host-run",
    ] {
        let p = format!("/usr/share/man/man1/{page}.1.gz");
        assert!(Path::new(&p).exists(), "{p} is not installed");
    }
    assert!(Path::new("/usr/share/bash-completion/completions/sluice").exists());

    // What the units run, with the units' capabilities.
    assert_eq!(
        unit_value(UNITS[0], "ExecStart"),
        "/usr/bin/sluice run --config /etc/sluice/sluice.toml"
    );
    assert_eq!(
        unit_value(UNITS[1], "ExecStart"),
        "/usr/bin/sluice backend-host run --config /etc/sluice/backend-host.toml"
    );
    assert_eq!(unit_value(UNITS[0], "Type"), "notify");
    assert_eq!(unit_value(UNITS[1], "Type"), "notify");
    let caps = unit_value(UNITS[0], "CapabilityBoundingSet");
    assert_eq!(caps, unit_value(UNITS[1], "CapabilityBoundingSet"));
    assert_eq!(unit_value(UNITS[0], "AmbientCapabilities"), caps);
    assert_eq!(unit_value(UNITS[0], "NoNewPrivileges"), "yes");
    let set = setpriv_caps(&caps);
    let prefix = vec![
        "setpriv".to_string(),
        "--no-new-privs".into(),
        format!("--inh-caps={set}"),
        format!("--ambient-caps={set}"),
        format!("--bounding-set={set}"),
        "--".into(),
    ];
    // The LB unit checks the file first (ExecStartPre), with the same capabilities.
    let vip = SocketAddr::new(VIP4.into(), TCP_PORT);
    let mut opts = DaemonLabOptions::new(SERVER, 2, vec![VipDef::tcp("chat", vip, 2)]);
    opts.sluice = Some(BIN.into());
    opts.prefix = prefix.clone();
    let lab = DaemonLab::start(opts).unwrap_or_else(|e| panic!("starting the lab: {e:#}"));
    let (code, out, err) = run(Command::new(&prefix[0])
        .args(&prefix[1..])
        .arg(BIN)
        .args(["check", "--config"])
        .arg(&lab.config));
    assert_eq!(code, 0, "{out}{err}");

    let want = cap_mask(&caps);
    let lb_pid = lab.daemon_pid().expect("the LB daemon runs");
    assert_eq!(
        fs::read_link(format!("/proc/{lb_pid}/exe")).unwrap(),
        Path::new(BIN)
    );
    assert_eq!(
        cap_eff(lb_pid),
        want,
        "the LB daemon's effective capabilities"
    );
    for h in &lab.backend_hosts {
        let pid = h.pid().expect("the backend host runs");
        assert_eq!(
            fs::read_link(format!("/proc/{pid}/exe")).unwrap(),
            Path::new(BIN)
        );
        assert_eq!(cap_eff(pid), want, "{}'s effective capabilities", h.name);
    }

    // Token streams through both installed daemons, to both backends.
    let mut greeted = std::collections::BTreeSet::new();
    for _ in 0..24 {
        let s = lab.stream(vip, 20, 20).expect("opening a stream");
        greeted.insert(s.backend.clone());
        assert_eq!(s.finish().expect("the stream completes"), 20);
        if greeted.len() == 2 {
            break;
        }
    }
    assert_eq!(greeted.len(), 2, "streams reached only {greeted:?}");
    let status = lab.cli_ok(&["status"]);
    assert!(status.contains("0.1.0"), "{status}");
}
