//! What an operator sees of live traffic: `sluice flows` lists a running stream's
//! connection-table entry (client, VIP, backend), `--watch` redraws a read command in place
//! and `sluice top` shows the backends, against the real daemon in the namespace lab. Needs
//! root, `ip`, `ethtool`, `nsenter`, a bpffs and the `sluice` binary; fails, never skips.

use std::{
    io::Read,
    net::SocketAddr,
    process::{Command, Stdio},
    thread,
    time::Duration,
};

use serde_json::Value;
use sluice_tests::{
    daemon_lab::{wait_for, DaemonLab, DaemonLabOptions, VipDef},
    netns::{TCP_PORT, VIP4},
};

const SERVER: &str = env!("CARGO_BIN_EXE_sluice-testsrv");
const VIP: &str = "chat";
const BACKENDS: usize = 3;

fn vip() -> SocketAddr {
    SocketAddr::new(VIP4.into(), TCP_PORT)
}

/// Runs `sluice ARGS` (a command that redraws until interrupted) for `run`, then kills it:
/// what it printed.
fn live_output(lab: &DaemonLab, args: &[&str], run: Duration) -> String {
    let mut child = Command::new(&lab.sluice)
        .arg("--socket")
        .arg(&lab.socket)
        .args(args)
        .stdout(Stdio::piped())
        .stderr(Stdio::null())
        .spawn()
        .expect("starting sluice");
    thread::sleep(run);
    let _ = child.kill();
    let mut out = String::new();
    child
        .stdout
        .take()
        .expect("piped")
        .read_to_string(&mut out)
        .expect("reading its output");
    let _ = child.wait();
    out
}

#[test]
fn flows_lists_a_running_streams_entry_and_the_live_views_show_it() {
    let lab = DaemonLab::start(DaemonLabOptions::new(
        SERVER,
        BACKENDS,
        vec![VipDef::tcp(VIP, vip(), BACKENDS)],
    ))
    .unwrap_or_else(|e| panic!("starting the daemon lab: {e:#}"));
    // 6 s of tokens: the stream's entry stays live through the checks.
    let s = lab
        .stream(vip(), 60, 100)
        .unwrap_or_else(|e| panic!("opening a stream: {e:#}"));
    let backend = lab
        .topo
        .backends
        .iter()
        .find(|b| b.name == s.backend)
        .expect("the greeting backend is in the lab");
    let addr = backend.v4.to_string();
    let other = lab
        .topo
        .backends
        .iter()
        .find(|b| b.name != s.backend)
        .unwrap()
        .v4
        .to_string();

    let v = lab.cli_json(&["flows", "--vip", VIP]);
    let mine: Vec<&Value> = v["flows"]
        .as_array()
        .expect("a flows list")
        .iter()
        .filter(|f| f["client"] == s.local.to_string().as_str())
        .collect();
    assert_eq!(mine.len(), 1, "the stream's entry once: {v}");
    let f = mine[0];
    assert_eq!(f["vip"], VIP, "{f}");
    assert_eq!(f["vip_address"], vip().to_string().as_str(), "{f}");
    assert_eq!(f["protocol"], "tcp", "{f}");
    assert_eq!(f["backend"], addr.as_str(), "{f}");
    assert!(f["idle_ms"].as_u64().unwrap() < 5_000, "{f}");

    let text = lab.cli_ok(&["flows", "--backend", &addr]);
    assert!(text.starts_with("CLIENT "), "{text}");
    assert!(text.contains(&s.local.to_string()), "{text}");
    let text = lab.cli_ok(&["flows", "--backend", &other]);
    assert!(!text.contains(&s.local.to_string()), "{text}");

    // The background count catches up within a walk period.
    wait_for(
        "the stream in the active-flow count",
        Duration::from_secs(5),
        || {
            let n = lab
                .backend(VIP, backend.v4.into())
                .and_then(|b| b["active_flows"].as_u64())
                .unwrap_or(0);
            if n >= 1 {
                Ok(Some(()))
            } else {
                Err(format!("{n} active flows"))
            }
        },
    )
    .unwrap();

    let watched = live_output(
        &lab,
        &["--watch", "200ms", "backend", "list", VIP],
        Duration::from_millis(1500),
    );
    assert!(watched.starts_with("\x1b[2J\x1b[HADDRESS"), "{watched:?}");
    assert!(
        watched.matches("\x1b[H").count() >= 2,
        "redrawn at least twice: {watched:?}"
    );
    assert!(watched.contains(&addr), "{watched:?}");

    let top = live_output(
        &lab,
        &["top", "--every", "300ms"],
        Duration::from_millis(1500),
    );
    assert!(top.contains("PKT/S"), "{top:?}");
    let row = top
        .lines()
        .find(|l| l.starts_with(VIP) && l.contains(&addr))
        .unwrap_or_else(|| panic!("no row for {addr}: {top:?}"));
    assert!(row.contains(" active "), "{row}");

    let got = s.finish().unwrap_or_else(|e| panic!("the stream: {e:#}"));
    assert_eq!(got, 60);
}

#[test]
fn trace_on_logs_each_decision_of_a_session_and_trace_off_stops_it() {
    let lab = DaemonLab::start(DaemonLabOptions::new(
        SERVER,
        BACKENDS,
        vec![VipDef::tcp(VIP, vip(), BACKENDS)],
    ))
    .unwrap_or_else(|e| panic!("starting the daemon lab: {e:#}"));
    assert_eq!(lab.cli_ok(&["trace"]), "decision tracing is off\n");
    let s = lab
        .stream(vip(), 3, 50)
        .unwrap_or_else(|e| panic!("opening a stream: {e:#}"));
    s.finish().unwrap_or_else(|e| panic!("the stream: {e:#}"));
    assert!(!lab.log().contains("sluice::dataplane"), "traced while off");

    assert_eq!(lab.cli_ok(&["trace", "on"]), "decision tracing is on\n");
    let s = lab
        .stream(vip(), 3, 50)
        .unwrap_or_else(|e| panic!("opening a stream: {e:#}"));
    let client = format!("flow ::ffff:{} to vip ", s.local);
    let backend = lab
        .topo
        .backends
        .iter()
        .find(|b| b.name == s.backend)
        .expect("the greeting backend is in the lab");
    s.finish().unwrap_or_else(|e| panic!("the stream: {e:#}"));
    let traced = wait_for(
        "the session's decisions in the log",
        Duration::from_secs(5),
        || {
            let log = lab.log();
            let lines: Vec<String> = log
                .lines()
                .filter(|l| l.contains("sluice::dataplane") && l.contains(&client))
                .map(str::to_string)
                .collect();
            if lines.iter().any(|l| l.ends_with(" new")) && lines.len() >= 2 {
                Ok(Some(lines))
            } else {
                Err(format!("{} lines so far", lines.len()))
            }
        },
    )
    .unwrap();
    let id = lab
        .backend(VIP, backend.v4.into())
        .and_then(|b| b["id"].as_u64())
        .unwrap();
    let want = format!(" -> backend {id} ");
    assert!(traced.iter().all(|l| l.contains(&want)), "{traced:#?}");

    assert_eq!(lab.cli_ok(&["trace", "off"]), "decision tracing is off\n");
    let before = lab.log().matches("sluice::dataplane").count();
    let s = lab
        .stream(vip(), 3, 50)
        .unwrap_or_else(|e| panic!("opening a stream: {e:#}"));
    s.finish().unwrap_or_else(|e| panic!("the stream: {e:#}"));
    // Reading is asynchronous: give a late record the time a traced one took to appear.
    thread::sleep(Duration::from_millis(500));
    assert_eq!(lab.log().matches("sluice::dataplane").count(), before);
}
