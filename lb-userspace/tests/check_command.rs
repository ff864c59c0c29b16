//! `sluice check` as an operator runs it: the exit status, and the same messages as `sluice
//! run`, which refuses the same files before anything is attached.

use std::{
    path::{Path, PathBuf},
    process::{Command, Output},
};

fn sluice(args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_sluice"))
        .args(args)
        .env_remove("NOTIFY_SOCKET")
        .output()
        .expect("running the sluice binary")
}

fn repo(path: &str) -> String {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("..")
        .join(path)
        .display()
        .to_string()
}

/// A file in a fresh temporary directory; the directory is returned for the pin path.
fn write_temp(name: &str, text: &str) -> (PathBuf, PathBuf) {
    let dir = std::env::temp_dir().join(format!("sluice-check-{}-{name}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    let file = dir.join("sluice.toml");
    std::fs::write(&file, text).unwrap();
    (dir, file)
}

#[test]
fn the_example_configurations_are_valid() {
    for f in ["configs/sluice.toml", "configs/minimal.toml"] {
        let out = sluice(&["check", "--config", &repo(f)]);
        let stdout = String::from_utf8_lossy(&out.stdout);
        assert_eq!(out.status.code(), Some(0), "{f}: {out:?}");
        assert!(stdout.contains(": valid ("), "{stdout}");
    }
}

#[test]
fn a_refused_file_exits_1_with_the_messages_run_gives_and_run_attaches_nothing() {
    // Valid TOML and keys, but an https telemetry endpoint the scraper cannot use: found by
    // the shared validation, not by the parser alone. The pin directory is a plain
    // temporary path, so the test can see whether `run` created it.
    let pins = std::env::temp_dir().join(format!("sluice-check-pins-{}", std::process::id()));
    let text = format!(
        r#"[daemon]
bpffs = "{}"
[dataplane]
interfaces = [{{ name = "eth0" }}]
hash_seed = 1
encap_source_v4 = "172.16.0.0/16"
[[vip]]
name = "chat"
address = "10.0.0.1"
port = 443
backend = [{{ address = "10.1.0.1", dcgm = {{ url = "https://10.1.0.1:9400/metrics" }} }}]
"#,
        pins.display()
    );
    let (dir, file) = write_temp("https", &text);
    let file = file.display().to_string();
    let check = sluice(&["check", "--config", &file]);
    let run = sluice(&["run", "--config", &file]);
    let expected = format!(
        "error: {file}:11:51: vip[0].backend[0].dcgm.url: \"https://10.1.0.1:9400/metrics\" is \
         https, which the telemetry scraper does not speak; allowed: an http:// URL such as \
         \"http://10.1.0.1:9400/metrics\" (the exporter's plain-HTTP port, or a local proxy in \
         front of a TLS one)\n"
    );
    assert_eq!(check.status.code(), Some(1), "{check:?}");
    assert_eq!(String::from_utf8_lossy(&check.stderr), expected);
    assert_eq!(run.status.code(), Some(1), "{run:?}");
    assert_eq!(String::from_utf8_lossy(&run.stderr), expected);
    assert!(
        !pins.exists(),
        "run created {} before refusing",
        pins.display()
    );
    std::fs::remove_dir_all(dir).unwrap();
}

#[test]
fn every_problem_is_one_line_and_a_syntax_error_has_its_position() {
    let (dir, file) = write_temp("syntax", "[dataplane\n");
    let out = sluice(&["check", "--config", &file.display().to_string()]);
    assert_eq!(out.status.code(), Some(1));
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        stderr.starts_with(&format!("error: {}:1:", file.display())),
        "{stderr}"
    );
    std::fs::remove_dir_all(dir).unwrap();
}

#[test]
fn bad_usage_exits_2_and_version_names_the_git_revision() {
    assert_eq!(
        sluice(&["check", "--no-such-option"]).status.code(),
        Some(2)
    );
    assert_eq!(sluice(&["no-such-command"]).status.code(), Some(2));
    let v = sluice(&["--version"]);
    let v = String::from_utf8_lossy(&v.stdout);
    assert!(
        v.starts_with(&format!("sluice {} (git ", env!("CARGO_PKG_VERSION"))),
        "{v}"
    );
    assert!(!v.contains("(git unknown)"), "built in a git tree: {v}");
}

#[test]
fn the_backend_host_example_is_valid_and_a_bad_one_is_refused() {
    // `check` also judges this machine's DSR settings, which vary: exit 0 or 1 with findings,
    // but the file itself must be valid.
    let out = sluice(&[
        "backend-host",
        "check",
        "--config",
        &repo("packaging/backend-host.toml"),
    ]);
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        stdout.contains("backend-host.toml: valid (1 interface(s), 0 VIP(s))"),
        "{out:?}"
    );
    let (dir, file) = write_temp("host", "interfaces = []\n");
    let out = sluice(&[
        "backend-host",
        "check",
        "--config",
        &file.display().to_string(),
    ]);
    assert_eq!(out.status.code(), Some(1));
    assert_eq!(
        String::from_utf8_lossy(&out.stderr),
        format!(
            "error: {}: interfaces: at least one interface is needed (the one the LB's \
             encapsulated packets arrive on)\n",
            file.display()
        )
    );
    std::fs::remove_dir_all(dir).unwrap();
}

#[test]
fn run_refuses_a_missing_interface_before_it_loads_or_binds_anything() {
    let pins = std::env::temp_dir().join(format!("sluice-run-pins-{}", std::process::id()));
    let (dir, _) = write_temp("noif", "");
    let socket = dir.join("admin.sock");
    let text = format!(
        r#"[daemon]
bpffs = "{}"
[admin]
socket = "{}"
[dataplane]
interfaces = [{{ name = "sluice-none0" }}]
hash_seed = 1
"#,
        pins.display(),
        socket.display()
    );
    let file = dir.join("sluice.toml");
    std::fs::write(&file, text).unwrap();
    let file = file.display().to_string();
    assert_eq!(sluice(&["check", "--config", &file]).status.code(), Some(0));
    let run = sluice(&["run", "--config", &file]);
    let stderr = String::from_utf8_lossy(&run.stderr);
    assert_eq!(run.status.code(), Some(1), "{stderr}");
    assert!(
        stderr.ends_with(
            "error: interface \"sluice-none0\" does not exist in this network namespace (see `ip link`)\n"
        ),
        "{stderr}"
    );
    assert!(
        !pins.exists(),
        "run created {} before refusing",
        pins.display()
    );
    assert!(!socket.exists(), "run left {}", socket.display());
    std::fs::remove_dir_all(dir).unwrap();
}
