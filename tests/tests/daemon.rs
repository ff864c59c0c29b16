//! The control plane end to end: `sluice run` in the namespace lab's LB namespace, operated
//! with the `sluice` CLI and the admin API while token streams run through the XDP data
//! plane (see `sluice_tests::daemon_lab`). Needs root, `ip`, `ethtool`, `nsenter`, a bpffs
//! and the `sluice` binary (`cargo build -p lb-userspace --bin sluice`), and for the upgrade
//! test the second one `cargo xtask build` makes; fails, never skips.
//!
//! Streams are real: every token of a stream is checked to come in order from the backend
//! that greeted, and the stream must end with `[DONE]` and the server's close.

use std::{
    collections::BTreeMap,
    fs,
    io::ErrorKind,
    net::{IpAddr, SocketAddr},
    path::{Path, PathBuf},
    thread,
    time::{Duration, Instant},
};

use serde_json::json;
use sluice_tests::{
    daemon_lab::{tally, upgrade_binary, wait_for, DaemonLab, DaemonLabOptions, Running, VipDef},
    netns::{lab_namespaces, TCP_PORT, VIP4, VIP6},
    stream::io_kind,
};

const SERVER: &str = env!("CARGO_BIN_EXE_sluice-testsrv");
const VIP: &str = "chat";
const BACKENDS: usize = 3;

fn vip() -> SocketAddr {
    SocketAddr::new(VIP4.into(), TCP_PORT)
}

fn options() -> DaemonLabOptions {
    DaemonLabOptions::new(SERVER, BACKENDS, vec![VipDef::tcp(VIP, vip(), BACKENDS)])
}

fn start(opts: DaemonLabOptions) -> DaemonLab {
    DaemonLab::start(opts).unwrap_or_else(|e| panic!("starting the daemon lab: {e:#}"))
}

/// Opens streams until every backend has at least `min` (at most `max` streams).
fn open_spread(lab: &DaemonLab, min: usize, tokens: u32, interval_ms: u32) -> Vec<Running> {
    let max = 40;
    let mut streams: Vec<Running> = Vec::new();
    loop {
        let counts = tally(streams.iter().map(|s| &s.backend));
        let names = lab.topo.backends.iter().map(|b| &b.name);
        if names
            .clone()
            .all(|n| counts.get(n).copied().unwrap_or(0) >= min)
        {
            return streams;
        }
        assert!(
            streams.len() < max,
            "{max} streams did not put {min} on every backend: {counts:?}"
        );
        streams.push(
            lab.stream(vip(), tokens, interval_ms)
                .unwrap_or_else(|e| panic!("opening a stream: {e:#}")),
        );
    }
}

/// Waits for every stream: each must have completed (all tokens, in order, from the backend
/// that greeted). Returns the greeting backends.
fn finish_all(streams: Vec<Running>, what: &str) -> Vec<String> {
    let mut failures = Vec::new();
    let mut backends = Vec::new();
    let n = streams.len();
    for s in streams {
        let (backend, local, tokens) = (s.backend.clone(), s.local, s.tokens);
        match s.finish() {
            Ok(got) if got == tokens => backends.push(backend),
            Ok(got) => failures.push(format!("{local} on {backend}: {got} of {tokens} tokens")),
            Err(e) => failures.push(format!("{local} on {backend}: {e:#}")),
        }
    }
    assert!(
        failures.is_empty(),
        "{what}: {} of {n} streams did not complete:\n{}",
        failures.len(),
        failures.join("\n")
    );
    backends
}

fn has_event(lab: &DaemonLab, kind: &str, backend: &str) -> bool {
    lab.events()
        .iter()
        .any(|e| e["kind"] == kind && e["backend"] == backend)
}

#[test]
fn drain_mid_stream_finishes_the_backends_streams_sends_new_sessions_elsewhere_then_removes_it() {
    let lab = start(options());
    let drained = lab.topo.backends[1].clone();
    let addr = drained.v4.to_string();
    // 4 s streams, at least two on every backend.
    let streams = open_spread(&lab, 2, 40, 100);
    let on_drained = streams.iter().filter(|s| s.backend == drained.name).count();
    eprintln!(
        "{} streams open: {:?}",
        streams.len(),
        tally(streams.iter().map(|s| &s.backend))
    );

    let out = lab.cli_ok(&["backend", "drain", VIP, &addr]);
    assert!(out.contains("draining backend"), "drain said: {out}");
    let b = lab
        .backend(VIP, drained.v4.into())
        .expect("listed while draining");
    assert_eq!(b["state"], "draining", "{b}");
    assert!(b["drain_since_ms"].is_u64(), "{b}");

    // New sessions after the drain never reach it.
    let new = lab.sessions(vip(), 30);
    eprintln!("30 sessions after the drain: {new:?}");
    assert_eq!(
        new.get(&drained.name),
        None,
        "new sessions reached the draining backend: {new:?}"
    );
    assert!(
        lab.backend(VIP, drained.v4.into()).is_some(),
        "removed while {on_drained} of its streams still run"
    );

    // Its streams finish on it, complete.
    let t = Instant::now();
    let backends = finish_all(streams, "streams open before the drain");
    assert_eq!(
        backends.iter().filter(|b| **b == drained.name).count(),
        on_drained
    );
    let ended = Instant::now();

    // Then it is removed: gone from the list, drain-complete in the events.
    wait_for(
        "the drained backend to be removed",
        Duration::from_secs(20),
        || match lab.backend(VIP, drained.v4.into()) {
            None => Ok(Some(())),
            Some(b) => Err(format!("{b}")),
        },
    )
    .unwrap();
    eprintln!(
        "streams ended {:?} after the drain; the backend was removed {:?} after they ended \
         (flow_idle_timeout 3s)",
        ended - t,
        ended.elapsed()
    );
    assert!(
        has_event(&lab, "drain-complete", &addr),
        "no drain-complete event for {addr}: {}",
        lab.cli_ok(&["events"])
    );
    let list = lab.cli_ok(&["backend", "list", VIP]);
    assert!(!list.contains(&addr), "{list}");
}

/// A drain whose deadline passes with flows left: at the deadline the backend is removed
/// with a drain-deadline event, its remaining streams re-steer to the others (which know
/// nothing of them and reset them), and the other streams complete.
#[test]
fn drain_deadline_reached_with_flows_left_removes_the_backend_and_resteers_its_flows() {
    let lab = start(options());
    let drained = lab.topo.backends[2].clone();
    let addr = drained.v4.to_string();
    // 15 s streams, far past the 2 s deadline and the 10 s wait below (so the drain cannot
    // complete by its flows ending); at least one on every backend.
    let streams = open_spread(&lab, 1, 300, 50);
    let before = lab.counters()["conn_resteer_down"];
    let out = lab.cli_ok(&["backend", "drain", VIP, &addr, "--deadline", "2s"]);
    assert!(out.contains("draining backend"), "drain said: {out}");

    wait_for(
        "the drained backend to be removed at its deadline",
        Duration::from_secs(10),
        || match lab.backend(VIP, drained.v4.into()) {
            None => Ok(Some(())),
            Some(b) => Err(format!("{b}")),
        },
    )
    .unwrap();
    assert!(
        has_event(&lab, "drain-deadline", &addr),
        "no drain-deadline event for {addr}: {}",
        lab.cli_ok(&["events"])
    );

    let (theirs, others): (Vec<Running>, Vec<Running>) =
        streams.into_iter().partition(|s| s.backend == drained.name);
    let cut = theirs.len();
    for s in theirs {
        let local = s.local;
        match s.finish() {
            Ok(n) => panic!(
                "stream {local} on the drained backend completed ({n} tokens) past the \
                 deadline: its flows did not re-steer"
            ),
            Err(e) => assert_eq!(
                io_kind(&e),
                Some(ErrorKind::ConnectionReset),
                "stream {local} on the drained backend: {e:#}"
            ),
        }
    }
    finish_all(others, "streams on the other backends");
    let resteered = lab.counters()["conn_resteer_down"] - before;
    eprintln!("{cut} streams cut at the drain deadline; conn_resteer_down +{resteered}");
    assert!(
        resteered >= cut as u64,
        "conn_resteer_down grew by {resteered}, fewer than the {cut} flows left at the deadline"
    );
}

#[test]
fn undrain_puts_a_draining_backend_back_into_rotation() {
    let lab = start(options());
    let b = lab.topo.backends[0].clone();
    let addr = b.v4.to_string();
    // Streams keep the drain from completing while the test runs: 20 s, far more than the
    // drain-to-undrain steps take on a loaded machine (checked below, not assumed).
    let keep = open_spread(&lab, 1, 200, 100);
    lab.cli_ok(&["backend", "drain", VIP, &addr]);
    let during = lab.sessions(vip(), 12);
    assert_eq!(during.get(&b.name), None, "{during:?}");
    assert!(
        keep.iter().any(|s| s.backend == b.name && !s.is_finished()),
        "no stream of {} runs any more: the drain could have completed",
        b.name
    );
    let out = lab.cli_ok(&["backend", "undrain", VIP, &addr]);
    assert!(out.contains("takes new flows again"), "{out}");
    assert_eq!(lab.backend(VIP, b.v4.into()).unwrap()["state"], "active");
    let after = lab.sessions(vip(), 30);
    eprintln!("while draining: {during:?}; after undrain: {after:?}");
    assert!(
        after.get(&b.name).copied().unwrap_or(0) > 0,
        "no new session reached the undrained backend: {after:?}"
    );
    finish_all(keep, "streams open across drain and undrain");
}

#[test]
fn kill_9_mid_stream_keeps_streams_and_new_sessions_and_the_restart_readopts_the_pinned_plane() {
    let mut lab = start(options());
    // A runtime change through the API before the crash.
    let b2 = lab.topo.backends[2].v4.to_string();
    let (status, v) = lab
        .api(
            "PUT",
            &format!("/v1/vips/{VIP}/backends/{b2}/weight"),
            Some(&json!({ "weight": 50 })),
        )
        .unwrap();
    assert_eq!((status, &v["weight"]), (200, &json!(50)), "{v}");

    // 12 s streams: they outlive the crash and the restart.
    let streams = open_spread(&lab, 2, 120, 100);
    let want = tally(streams.iter().map(|s| &s.backend))
        .into_iter()
        .map(|(k, v)| (k, v as u64))
        .collect::<BTreeMap<_, _>>();
    let before = wait_for(
        "sluice flows to count the open streams",
        Duration::from_secs(5),
        || {
            let f = lab.flows(VIP);
            let f: BTreeMap<_, _> = f.into_iter().filter(|(_, n)| *n > 0).collect();
            if f == want {
                Ok(Some(f))
            } else {
                Err(format!("{f:?}, streams {want:?}"))
            }
        },
    )
    .unwrap();
    eprintln!("flows before the crash: {before:?}");

    let t = Instant::now();
    lab.kill9().unwrap();
    assert!(
        lab.bpffs.join("link_eth0").exists(),
        "the pinned link is gone"
    );
    assert!(lab.lb_has_xdp().unwrap(), "XDP detached with the daemon");
    // The data plane keeps steering with no daemon.
    let dead = lab.sessions(vip(), 12);
    eprintln!("12 sessions with the daemon dead: {dead:?}");

    lab.start_daemon().unwrap();
    eprintln!("restarted {:?} after the crash", t.elapsed());
    let log = lab.log();
    assert!(
        log.contains("data plane ready reused=true"),
        "the restarted daemon did not re-adopt the pinned data plane:\n{log}"
    );
    let w = lab.backend(VIP, lab.topo.backends[2].v4.into()).unwrap();
    assert_eq!(w["weight"], 50, "the weight change was lost: {w}");

    // The same long-lived flows per backend (the sessions opened while the daemon was dead
    // age out of the count after flow_idle_timeout).
    let after = wait_for(
        "the restarted daemon to show the same flows",
        Duration::from_secs(8),
        || {
            let f = lab.flows(VIP);
            let f: BTreeMap<_, _> = f.into_iter().filter(|(_, n)| *n > 0).collect();
            if f == before {
                Ok(Some(f))
            } else {
                Err(format!("{f:?}, before the crash {before:?}"))
            }
        },
    )
    .unwrap();
    eprintln!("flows after the restart: {after:?}");
    let status = lab.cli_ok(&["status"]);
    assert!(
        status.contains(&lab.bpffs.display().to_string()),
        "{status}"
    );

    let backends = finish_all(streams, "streams across kill -9 and restart");
    eprintln!("all {} streams completed", backends.len());
    assert!(lab.stop().unwrap().success());
}

#[test]
fn removing_a_backend_resteers_its_flows_and_new_sessions_to_the_others() {
    let lab = start(options());
    let gone = lab.topo.backends[2].clone();
    let addr = gone.v4.to_string();
    let streams = open_spread(&lab, 2, 60, 100);
    let before = lab.counters()["conn_resteer_down"];

    let out = lab.cli_ok(&["backend", "remove", VIP, &addr]);
    assert!(out.contains("removed backend"), "{out}");
    let list = lab.cli_ok(&["backend", "list", VIP]);
    assert!(!list.contains(&addr), "still listed:\n{list}");
    let audit = fs::read_to_string(&lab.audit_log).unwrap();
    assert!(
        audit.lines().any(|l| l.contains("\"remove-backend\"")
            && l.contains(&addr)
            && l.contains("\"result\":\"ok\"")),
        "no audit line for the removal:\n{audit}"
    );

    let new = lab.sessions(vip(), 30);
    eprintln!("30 sessions after the removal: {new:?}");
    assert_eq!(new.get(&gone.name), None, "{new:?}");

    // Its streams' packets now go to another backend, which knows nothing of them: they
    // are reset. The others complete.
    let (theirs, others): (Vec<Running>, Vec<Running>) =
        streams.into_iter().partition(|s| s.backend == gone.name);
    let cut = theirs.len();
    for s in theirs {
        let local = s.local;
        match s.finish() {
            Ok(n) => panic!(
                "stream {local} on the removed backend completed ({n} tokens): its packets \
                 still reach it"
            ),
            Err(e) => assert_eq!(
                io_kind(&e),
                Some(ErrorKind::ConnectionReset),
                "stream {local} on the removed backend ended otherwise than by a reset from \
                 the backend its packets went to: {e:#}"
            ),
        }
    }
    finish_all(others, "streams on the remaining backends");
    let resteered = lab.counters()["conn_resteer_down"] - before;
    eprintln!("{cut} streams on the removed backend were cut; conn_resteer_down +{resteered}");
    assert!(
        resteered >= cut as u64,
        "conn_resteer_down grew by {resteered}, fewer than the {cut} flows of the removed backend"
    );
}

/// The `sluice ...` lines of the README's worked example.
fn worked_example() -> Vec<String> {
    let path = Path::new(env!("CARGO_MANIFEST_DIR")).join("../README.md");
    let text = fs::read_to_string(&path).unwrap();
    let start = text
        .find("<!-- worked-example:start -->")
        .unwrap_or_else(|| {
            panic!(
                "{}: no <!-- worked-example:start --> marker",
                path.display()
            )
        });
    let end = text[start..]
        .find("<!-- worked-example:end -->")
        .map(|e| start + e)
        .expect("no <!-- worked-example:end --> marker after the start");
    let block = &text[start..end];
    let body = block
        .split_once("```sh")
        .and_then(|(_, rest)| rest.split_once("```"))
        .map(|(body, _)| body)
        .expect("no ```sh block between the worked-example markers");
    let lines: Vec<String> = body
        .lines()
        .map(str::trim)
        .filter(|l| l.starts_with("sluice "))
        .map(str::to_string)
        .collect();
    assert!(
        !lines.is_empty(),
        "the worked example has no sluice commands"
    );
    lines
}

#[test]
fn readme_worked_example_runs_against_the_daemon() {
    let commands = worked_example();
    // The example creates its VIPs itself: the backends serve what its `vip add` lines name.
    let mut opts = DaemonLabOptions::new(SERVER, BACKENDS, vec![]);
    for line in commands.iter().filter(|l| l.starts_with("sluice vip add ")) {
        let words: Vec<&str> = line.split_whitespace().collect();
        let arg = |flag: &str| {
            let i = words.iter().position(|w| *w == flag)?;
            words.get(i + 1).copied()
        };
        let addr: IpAddr = arg("--address")
            .and_then(|a| a.parse().ok())
            .unwrap_or_else(|| panic!("{line}: no --address"));
        let port: u16 = arg("--port")
            .and_then(|p| p.parse().ok())
            .unwrap_or_else(|| panic!("{line}: no --port"));
        if addr != IpAddr::from(VIP4) && addr != IpAddr::from(VIP6) {
            opts.backend_vips.push(addr);
        }
        opts.serve.push(SocketAddr::new(addr, port));
    }
    opts.serve.sort();
    opts.serve.dedup();
    let lab = start(opts);
    // What the example's commands should have set up so far: per VIP, backend address ->
    // (weight, state), kept from the commands themselves so the README can change.
    let mut want: BTreeMap<String, BTreeMap<String, (u64, &str)>> = BTreeMap::new();
    for line in &commands {
        let words: Vec<&str> = line.split_whitespace().skip(1).collect();
        assert!(
            !line.contains(['\'', '"', '\\', '$', '|', '>']),
            "{line}: the worked example must be plain words (no quoting or shell syntax)"
        );
        let (code, out, err) = lab.cli(&words);
        eprintln!("$ {line}\n{out}{err}");
        assert_eq!(code, 0, "`{line}` failed: {err}{out}");
        assert!(!out.trim().is_empty(), "`{line}` printed nothing");
        let flag = |f: &str| words.iter().position(|w| *w == f).map(|i| words[i + 1]);
        match words[..] {
            ["vip", "add", name, ..] => {
                let bs = want.entry(name.to_string()).or_default();
                for (i, _) in words.iter().enumerate().filter(|(_, w)| **w == "--backend") {
                    let (a, w) = words[i + 1]
                        .split_once(':')
                        .unwrap_or((words[i + 1], "100"));
                    bs.insert(a.to_string(), (w.parse().unwrap(), "active"));
                }
            }
            ["backend", "add", name, addr, ..] => {
                let w = flag("--weight").map_or(100, |w| w.parse().unwrap());
                want.entry(name.to_string())
                    .or_default()
                    .insert(addr.to_string(), (w, "active"));
            }
            ["backend", "drain", name, addr, ..] => {
                want.get_mut(name).unwrap().get_mut(addr).unwrap().1 = "draining";
            }
            // The printed table: a row per backend so far, with its weight and state. A
            // drained backend without flows is removed at the daemon's next step (a
            // drain-complete event), so its row may be gone already.
            ["backend", "list", name] => {
                let bs = &want[name];
                let rows: Vec<Vec<&str>> = out
                    .lines()
                    .skip(1)
                    .map(|l| l.split_whitespace().collect())
                    .collect();
                for (addr, (_, st)) in bs {
                    if !rows.iter().any(|r| r[0] == addr) {
                        assert!(
                            *st == "draining" && has_event(&lab, "drain-complete", addr),
                            "`{line}`: no row for {addr}, which is not a completed drain:\n{out}"
                        );
                    }
                }
                for r in &rows {
                    let (w, st) = bs
                        .get(r[0])
                        .unwrap_or_else(|| panic!("`{line}`: unexpected row {r:?}"));
                    assert_eq!((r[2], r[4]), (w.to_string().as_str(), *st), "{out}");
                }
            }
            _ => {}
        }
    }
    // The same state through the API, with the drain deadline (a completed drain: gone).
    for (name, bs) in &want {
        for (addr, (w, st)) in bs {
            let Some(b) = lab.backend(name, addr.parse().unwrap()) else {
                assert!(
                    *st == "draining" && has_event(&lab, "drain-complete", addr),
                    "{name}: backend {addr} missing"
                );
                continue;
            };
            assert_eq!((&b["weight"], &b["state"]), (&json!(w), &json!(st)), "{b}");
            if *st == "draining" {
                let span = b["drain_deadline_ms"].as_u64().unwrap()
                    - b["drain_since_ms"].as_u64().unwrap();
                assert_eq!(span, 600_000, "--deadline 10m: {b}");
            }
        }
    }
    // What it set up serves: a session through the VIP it added.
    let vips = lab.cli_json(&["vip", "list"]);
    let vip = &vips["vips"][0];
    let addr = SocketAddr::new(
        vip["address"].as_str().unwrap().parse().unwrap(),
        vip["port"].as_u64().unwrap() as u16,
    );
    let b = lab
        .greet(addr, Duration::from_secs(5))
        .unwrap_or_else(|e| panic!("a session to the example's VIP {addr}: {e:#}"));
    eprintln!("a session to {addr} was served by {b}");
    let page = lab.metrics_page().unwrap();
    let name = vip["name"].as_str().unwrap();
    assert!(
        page.starts_with("HTTP/1.1 200")
            && page.contains(&format!("sluice_vip_packets_total{{vip=\"{name}\"}}")),
        "the metrics endpoint does not show the example's VIP:\n{page}"
    );
}

#[test]
fn sigterm_detaches_and_unpins_unless_keep_dataplane_on_exit() {
    let mut opts = options();
    opts.set("daemon", "keep_dataplane_on_exit", "true");
    let mut lab = start(opts);
    assert!(lab.lb_has_xdp().unwrap());
    lab.greet(vip(), Duration::from_secs(5)).unwrap();

    // keep_dataplane_on_exit = true: the pins stay and traffic still flows.
    let status = lab.stop().unwrap();
    assert!(status.success(), "the daemon exited with {status}");
    assert!(
        lab.bpffs.join("link_eth0").exists(),
        "keep_dataplane_on_exit: the pins were removed"
    );
    assert!(
        lab.lb_has_xdp().unwrap(),
        "keep_dataplane_on_exit: XDP detached"
    );
    let served = lab.sessions(vip(), 6);
    eprintln!("6 sessions with the daemon stopped, data plane kept: {served:?}");

    // keep_dataplane_on_exit = false: a restart re-adopts, SIGTERM detaches and unpins.
    lab.reconfigure(|o| {
        o.set("daemon", "keep_dataplane_on_exit", "false");
    })
    .unwrap();
    lab.start_daemon().unwrap();
    assert!(
        lab.log().contains("data plane ready reused=true"),
        "{}",
        lab.log()
    );
    let status = lab.stop().unwrap();
    assert!(status.success(), "the daemon exited with {status}");
    assert!(
        !lab.bpffs.exists(),
        "{} is still there after SIGTERM",
        lab.bpffs.display()
    );
    assert!(
        !lab.lb_has_xdp().unwrap(),
        "XDP still attached after SIGTERM:\n{}",
        lab.topo.lb.ns.ip(&["link", "show", "eth0"]).unwrap()
    );
    assert!(lab.log().contains("data plane detached and unpinned"));
    // Nothing steers the VIP any more.
    let e = lab
        .connect(vip(), Duration::from_millis(500))
        .expect_err("a connection to the VIP was answered with the data plane gone");
    // The LB's kernel routes the SYN like any packet; no router of the lab knows the VIP,
    // so an ICMP network-unreachable comes back (not a backend's answer, not a timeout).
    assert_eq!(
        e.kind(),
        ErrorKind::NetworkUnreachable,
        "connect to the VIP with the data plane gone: {e}"
    );
}

#[test]
fn a_daemon_lab_dropped_by_a_panicking_test_leaves_nothing_behind() {
    let (tx, rx) = std::sync::mpsc::channel();
    let h = thread::spawn(move || {
        let lab = start(options());
        tx.send((
            lab.topo.id.clone(),
            lab.bpffs.clone(),
            lab.dir.clone(),
            lab.daemon_pid().unwrap(),
        ))
        .unwrap();
        panic!("a deliberate panic with the daemon running");
    });
    assert!(h.join().is_err(), "the thread was meant to panic");
    let (id, bpffs, dir, pid) = rx.recv().unwrap();
    let left: Vec<String> = lab_namespaces()
        .into_iter()
        .filter(|n| n.starts_with(&format!("{id}-")))
        .collect();
    assert!(left.is_empty(), "namespaces left: {left:?}");
    assert!(!bpffs.exists(), "{} left", bpffs.display());
    assert!(!dir.exists(), "{} left", dir.display());
    assert!(
        !Path::new(&format!("/proc/{pid}")).exists(),
        "the daemon (pid {pid}) still runs"
    );
}

/// An upgrade to a newer `sluice` binary, as `systemctl restart` after installing a new
/// package does it (`keep_dataplane_on_exit = true`). Build A runs with streams open and
/// frames arriving; it stops, and build B (`cargo xtask build`'s second binary: the same
/// sources with the eBPF object linked for BPF CPU v2, so another program on the same maps)
/// starts, re-adopts the pinned maps and moves the pinned link to its program
/// (`BPF_LINK_UPDATE`). No frame goes uncounted across the swap, the program's tag changed,
/// every stream completes. Then B restarts with a configuration whose maps the pinned ones
/// cannot hold (twice the VIP rings): refused with a message naming the map, while the
/// running program keeps forwarding.
#[test]
fn upgrade_to_a_newer_binary_swaps_the_program_with_no_frame_lost_and_refuses_another_layout() {
    use lb_common::stat;
    use sluice_tests::{
        frames::{eth, V4},
        pinned::{counter, ifindex, linked_program, Injector},
    };
    use std::sync::{
        atomic::{AtomicBool, Ordering},
        Arc,
    };
    let newer = upgrade_binary().unwrap_or_else(|e| panic!("{e:#}"));
    let mut opts = options();
    opts.set("daemon", "keep_dataplane_on_exit", "true");
    let mut lab = start(opts);
    let pins = lab.bpffs.clone();
    let link = pins.join("link_eth0");
    let old = linked_program(&link);
    // 30 s streams: they outlive the upgrade.
    let streams = open_spread(&lab, 2, 300, 100);

    // Probe frames from the switch straight into the LB's eth0: an IPv4 header whose length
    // claims more than the frame holds, counted `pass_bad_ip_len` and dropped by the kernel.
    // Nothing else in the lab sends one.
    let mut packet = V4::new("10.111.0.10", "10.111.0.2", 17).build(&[0u8; 26]);
    packet[2..4].copy_from_slice(&1500u16.to_be_bytes());
    let probe = eth([0xff; 6], [2, 0, 0, 0, 0, 0x0c], 0x0800, &packet);
    let port = lab.topo.lb.port.clone();
    let injector = lab
        .topo
        .switch
        .run(move || Injector::new(ifindex(&port)))
        .unwrap();
    let start_count = counter(&pins, stat::PASS_BAD_IP_LEN);
    assert_eq!(start_count, 0, "pass_bad_ip_len before any probe");
    let stop = Arc::new(AtomicBool::new(false));
    // Paced (bursts of 20, then 1 ms) so the streams and the daemons keep their share of the
    // two cores; bounded in frames and time.
    let sender = {
        let (stop, probe) = (stop.clone(), probe.clone());
        thread::spawn(move || {
            let (t, mut sent) = (Instant::now(), 0u64);
            while !stop.load(Ordering::Relaxed)
                && sent < 2_000_000
                && t.elapsed() < Duration::from_secs(120)
            {
                for _ in 0..20 {
                    if injector.send(&probe) {
                        sent += 1;
                    }
                }
                thread::sleep(Duration::from_millis(1));
            }
            (sent, injector)
        })
    };
    let reach = |n: u64, what: &str| {
        wait_for(what, Duration::from_secs(30), || {
            let c = counter(&pins, stat::PASS_BAD_IP_LEN);
            if c >= n {
                Ok(Some(c))
            } else if sender.is_finished() {
                Err(format!("{c} probes counted, and the sender stopped"))
            } else {
                Err(format!("{c} probes counted"))
            }
        })
        .unwrap()
    };
    let under_a = reach(1_000, "probes counted by build A's program");

    assert!(lab.stop().unwrap().success(), "build A's exit status");
    assert_eq!(
        linked_program(&link),
        old,
        "keep_dataplane_on_exit: build A's program stays linked"
    );
    let no_daemon = reach(under_a + 1_000, "probes counted with no daemon running");

    lab.sluice = newer.clone();
    lab.start_daemon()
        .unwrap_or_else(|e| panic!("starting build B ({}): {e:#}", newer.display()));
    let log = lab.log();
    assert!(
        log.contains("data plane ready reused=true"),
        "build B did not re-adopt the pinned data plane:\n{log}"
    );
    let open = streams.iter().filter(|s| !s.is_finished()).count();
    assert_eq!(
        open,
        streams.len(),
        "streams ended before build B took over: the upgrade was not tested under them"
    );
    let new = linked_program(&link);
    let swapped = counter(&pins, stat::PASS_BAD_IP_LEN);
    let under_b = reach(swapped + 1_000, "probes counted by build B's program");
    stop.store(true, Ordering::Relaxed);
    let (mut sent, injector) = sender.join().unwrap();
    eprintln!(
        "{sent} probes sent; counted: {under_a} under A, {no_daemon} with no daemon, \
         {swapped} once B was ready, {under_b} under B; program (id, tag) {old:x?} -> {new:x?}"
    );
    let settled = |sent: u64, what: &str| {
        let c = wait_for(what, Duration::from_secs(15), || {
            let c = counter(&pins, stat::PASS_BAD_IP_LEN);
            if c == sent {
                Ok(Some(c))
            } else {
                Err(format!("{c} of {sent} probes counted"))
            }
        })
        .unwrap();
        thread::sleep(Duration::from_millis(200));
        assert_eq!(
            counter(&pins, stat::PASS_BAD_IP_LEN),
            c,
            "{what}: more probes counted than sent"
        );
    };
    settled(sent, "every probe counted by one program or the other");
    assert_ne!(new.0, old.0, "the link runs another program");
    assert_ne!(new.1, old.1, "build B's program differs from A's (its tag)");
    assert_eq!(
        linked_program(&link),
        new,
        "build B's program is the one linked"
    );
    let after = lab.sessions(vip(), 12);
    eprintln!("12 sessions under build B: {after:?}");
    finish_all(streams, "streams across the upgrade");

    // A configuration that needs larger maps than the pinned ones: refused, nothing touched.
    assert!(lab.stop().unwrap().success(), "build B's exit status");
    lab.reconfigure(|o| {
        o.set("dataplane", "max_vips", "16");
    })
    .unwrap();
    let err = lab
        .start_daemon()
        .expect_err("a daemon whose maps the pinned ones cannot hold must refuse to start");
    let log = lab.log();
    let (rings, need) = (
        8 * lb_common::RINGS_PER_VIP * lb_common::RING_SIZE_MAX,
        16 * lb_common::RINGS_PER_VIP * lb_common::RING_SIZE_MAX,
    );
    assert!(
        log.contains(&format!(
            "map MAGLEV_RINGS has {rings} entries, this configuration needs {need}"
        )) && log.contains("sluice cleanup"),
        "the refusal does not name the map and the way out: {err:#}\n{log}"
    );
    assert_eq!(
        linked_program(&link),
        new,
        "the refused start replaced the running program"
    );
    for _ in 0..1_000 {
        let mut tries = 0;
        while !injector.send(&probe) {
            tries += 1;
            assert!(tries < 1_000, "the switch port refuses probes");
            thread::sleep(Duration::from_millis(1));
        }
        sent += 1;
    }
    settled(sent, "probes after the refused start");
    let dead = lab.sessions(vip(), 6);
    eprintln!("6 sessions after the refused start: {dead:?}");

    lab.reconfigure(|o| {
        o.set("dataplane", "max_vips", "8");
    })
    .unwrap();
    lab.start_daemon().unwrap();
    assert!(
        lab.log().contains("data plane ready reused=true"),
        "build B did not re-adopt the plane after the refusal:\n{}",
        lab.log()
    );
    assert!(lab.stop().unwrap().success());
}

/// Waits until the daemon's log holds `n` reloads ("configuration reloaded").
fn wait_reloaded(lab: &DaemonLab, n: usize) {
    wait_for("the reload to be logged", Duration::from_secs(10), || {
        let log = lab.log();
        match log.matches("configuration reloaded").count() {
            c if c >= n => Ok(Some(())),
            c => Err(format!("{c} reloads logged:\n{log}")),
        }
    })
    .unwrap();
}

/// A start that fails over a re-adopted data plane (`keep_dataplane_on_exit`) changes
/// nothing, whether it fails before the load (the metrics port is taken) or after the attach
/// (the state file cannot be written): with a backend removed from the file, the daemon exits
/// non-zero, the link runs the previous daemon's program, the removed backend's streams keep
/// flowing, new sessions still go to every backend the running state steers to, the state
/// files keep their bytes, and a runtime drain is still there when a daemon later starts with
/// the old file.
#[test]
fn a_failed_start_over_a_readopted_data_plane_changes_nothing() {
    use sluice_tests::pinned::linked_program;
    let mut opts = DaemonLabOptions::new(SERVER, 4, vec![VipDef::tcp(VIP, vip(), 4)]);
    opts.set("daemon", "keep_dataplane_on_exit", "true");
    let mut lab = start(opts);
    // 40 s streams on every backend: they outlive the starts, and the one on the drained
    // backend keeps its drain from completing.
    let streams = open_spread(&lab, 1, 400, 100);
    let (removed, drained) = (&lab.topo.backends[2], &lab.topo.backends[3]);
    let (removed, drained) = (removed.name.clone(), drained.v4);
    lab.cli_ok(&["backend", "drain", VIP, &drained.to_string()]);
    assert!(lab.stop().unwrap().success());
    let link = lab.bpffs.join("link_eth0");
    let program = linked_program(&link);
    let rings = lab.state_file.with_extension("rings");
    // The state file is JSON: a difference reads as text.
    let files = |lab: &DaemonLab| {
        (
            fs::read_to_string(&lab.state_file).ok(),
            fs::read(&rings).ok(),
        )
    };
    let before = files(&lab);
    assert!(before.0.is_some(), "no state file after the stop");
    let unchanged = |lab: &DaemonLab, when: &str| {
        assert!(lab.lb_has_xdp().unwrap(), "{when}: XDP detached");
        assert_eq!(
            linked_program(&link),
            program,
            "{when}: the link runs another program"
        );
        assert_eq!(files(lab), before, "{when}: the state files changed");
        // Every backend the old state steers to (the removed one too), none to the drained one.
        let after = lab.sessions(vip(), 30);
        eprintln!("30 sessions {when}: {after:?}");
        for b in &lab.topo.backends[..3] {
            assert!(
                after.get(&b.name).copied().unwrap_or(0) > 0,
                "{when}: no new session reached {}: {after:?}",
                b.name
            );
        }
        assert_eq!(after.get(&lab.topo.backends[3].name), None, "{after:?}");
    };

    // The file loses backend 2; the metrics port is taken.
    lab.reconfigure(|o| o.vips[0].backends = vec![0, 1, 3])
        .unwrap();
    let taken = lab.take_metrics_port().unwrap();
    let e = format!("{:#}", lab.start_daemon().unwrap_err());
    assert!(
        e.contains("binding the metrics address") && e.contains("exit status: 1"),
        "{e}"
    );
    unchanged(&lab, "after a start that failed on the metrics port");
    drop(taken);

    // The same file; the state file cannot be written (a directory where its temporary file
    // goes): the start fails before it writes a map or replaces the link's program, so no
    // stream meets a moment of the new file's tables.
    let tmp = PathBuf::from(format!("{}.tmp", lab.state_file.display()));
    fs::create_dir(&tmp).unwrap();
    let e = format!("{:#}", lab.start_daemon().unwrap_err());
    assert!(
        e.contains("exit status: 1") && e.contains(&lab.state_file.display().to_string()),
        "{e}"
    );
    let log = lab.log();
    assert!(
        !log.contains("XDP attached"),
        "the start replaced the link's program before it failed:\n{log}"
    );
    unchanged(&lab, "after a start that failed writing the state file");
    fs::remove_dir(&tmp).unwrap();

    // The old file again: the drain is still there.
    lab.reconfigure(|o| o.vips[0].backends = vec![0, 1, 2, 3])
        .unwrap();
    lab.start_daemon().unwrap();
    let log = lab.log();
    assert!(
        log.contains("data plane ready reused=true") && log.contains("restoring state"),
        "{log}"
    );
    let b = lab.backend(VIP, drained.into()).unwrap();
    assert_eq!(b["state"], "draining", "the drain was lost: {b}");
    let done = finish_all(streams, "streams across the failed starts");
    assert!(done.contains(&removed), "{done:?}");
}

/// Runtime changes survive a reload of the unchanged file as they survive a restart: a
/// backend added and a weight set through the CLI are there after SIGHUP (and steered to),
/// and after a restart.
#[test]
fn a_reload_of_the_unchanged_file_keeps_runtime_changes_like_a_restart() {
    let two = VipDef {
        backends: vec![0, 1],
        ..VipDef::tcp(VIP, vip(), BACKENDS)
    };
    let mut lab = start(DaemonLabOptions::new(SERVER, BACKENDS, vec![two]));
    let (b0, b2) = (lab.topo.backends[0].v4, lab.topo.backends[2].v4);
    lab.cli_ok(&["backend", "add", VIP, &b2.to_string()]);
    lab.cli_ok(&["backend", "set-weight", VIP, &b0.to_string(), "50"]);
    let check = |lab: &DaemonLab, when: &str| {
        assert!(
            lab.backend(VIP, b2.into()).is_some(),
            "{when}: the added backend is gone: {:?}",
            lab.backends(VIP)
        );
        let w = lab.backend(VIP, b0.into()).unwrap();
        assert_eq!(w["weight"], 50, "{when}: the weight set is lost: {w}");
    };
    check(&lab, "before the reload");
    lab.sighup().unwrap();
    wait_reloaded(&lab, 1);
    check(&lab, "after a reload of the unchanged file");
    let served = lab.sessions(vip(), 24);
    assert!(
        served.contains_key(&lab.topo.backends[2].name),
        "no new session reached the added backend after the reload: {served:?}"
    );
    lab.restart().unwrap();
    check(&lab, "after a restart");
}

/// `QUIC_SERVERS` (pinned under the lab's bpffs) as (VIP id, server ID) → backend id.
fn quic_servers(lab: &DaemonLab) -> BTreeMap<(u32, u64), u32> {
    use aya::maps::{HashMap, Map, MapData};
    let m = MapData::from_pin(lab.bpffs.join(lb_common::maps::QUIC_SERVERS)).unwrap();
    let m: HashMap<_, lb_common::QuicServerKey, u32> = HashMap::try_from(Map::HashMap(m)).unwrap();
    m.iter()
        .map(|r| r.map(|(k, v)| ((k.vip, k.id), v)).unwrap())
        .collect()
}

/// What `QUIC_SERVERS` should hold for the lab's VIP `name`, from the API: each backend's
/// `quic_server_id` → its id.
fn quic_servers_by_api(lab: &DaemonLab, name: &str) -> BTreeMap<(u32, u64), u32> {
    let (_, v) = lab.api("GET", &format!("/v1/vips/{name}"), None).unwrap();
    let vip = v["vip"]["id"].as_u64().unwrap() as u32;
    lab.backends(name)
        .iter()
        .map(|b| {
            let id = b["quic_server_id"].as_str().unwrap();
            (
                (vip, u64::from_str_radix(id, 16).unwrap()),
                b["id"].as_u64().unwrap() as u32,
            )
        })
        .collect()
}

/// A `quic = "cid"` VIP's server IDs reach `QUIC_SERVERS` at start, follow a reload that
/// changes them and removes a backend, and survive a crash: the restart re-adopts the pinned
/// map and removes what no backend has (a previous run's leftover).
#[test]
fn quic_server_ids_are_written_follow_reloads_and_are_reconciled_after_a_restart() {
    const QUIC: &str = "chat-quic";
    let quic = VipDef {
        protocol: "udp",
        quic_id_base: Some(0x0a01),
        ..VipDef::tcp(QUIC, SocketAddr::new(VIP4.into(), 443), BACKENDS)
    };
    let mut lab = start(DaemonLabOptions::new(SERVER, BACKENDS, vec![quic]));
    let (_, v) = lab.api("GET", &format!("/v1/vips/{QUIC}"), None).unwrap();
    assert_eq!(v["vip"]["quic"], "cid", "{v}");
    let want = quic_servers_by_api(&lab, QUIC);
    let ids: Vec<u64> = want.keys().map(|k| k.1).collect();
    assert_eq!(ids, [0x0a01, 0x0a02, 0x0a03]);
    assert_eq!(quic_servers(&lab), want, "at start");
    let list = lab.cli_ok(&["backend", "list", QUIC]);
    assert!(list.contains("QUIC-ID") && list.contains("0a02"), "{list}");
    // The data plane's QUIC counters reach `sluice stats` and the metrics like every other.
    let counters = lab.counters();
    for c in [
        "quic_cid_routed",
        "quic_client_cid",
        "quic_unknown_rotation",
        "quic_unknown_server",
        "quic_server_down",
        "quic_malformed",
    ] {
        assert!(counters.contains_key(c), "{c} missing: {counters:?}");
    }
    let stats = lab.cli_ok(&["stats"]);
    assert!(stats.contains("quic_cid_routed"), "{stats}");
    let page = lab.metrics_page().unwrap();
    for line in [
        format!(r#"sluice_vip_quic{{vip="{QUIC}",quic="cid"}} 1"#),
        r#"sluice_dataplane_events_total{event="quic_cid_routed"} 0"#.to_string(),
    ] {
        assert!(page.lines().any(|l| l == line), "{line} missing:\n{page}");
    }

    // A changed file: other IDs, and backend 2 gone.
    lab.reconfigure(|o| {
        o.vips[0].quic_id_base = Some(0x0b01);
        o.vips[0].backends = vec![0, 1];
    })
    .unwrap();
    lab.sighup().unwrap();
    wait_reloaded(&lab, 1);
    let want = quic_servers_by_api(&lab, QUIC);
    let ids: Vec<u64> = want.keys().map(|k| k.1).collect();
    assert_eq!(ids, [0x0b01, 0x0b02]);
    assert_eq!(quic_servers(&lab), want, "after the reload");

    // A runtime removal.
    let b1 = lab.topo.backends[1].v4.to_string();
    lab.cli_ok(&["backend", "remove", QUIC, &b1]);
    let want = quic_servers_by_api(&lab, QUIC);
    assert_eq!(want.len(), 1);
    wait_for(
        "the removal to reach QUIC_SERVERS",
        Duration::from_secs(5),
        || {
            let got = quic_servers(&lab);
            if got == want {
                Ok(Some(()))
            } else {
                Err(format!("{got:?}, want {want:?}"))
            }
        },
    )
    .unwrap();

    // A crash, a leftover entry, and a restart over the pinned maps.
    lab.kill9().unwrap();
    {
        use aya::maps::{HashMap, Map, MapData};
        let m = MapData::from_pin(lab.bpffs.join(lb_common::maps::QUIC_SERVERS)).unwrap();
        let mut m: HashMap<_, lb_common::QuicServerKey, u32> =
            HashMap::try_from(Map::HashMap(m)).unwrap();
        let stale = lb_common::QuicServerKey {
            vip: 5,
            _pad: 0,
            id: 0xdead,
        };
        m.insert(stale, 7, 0).unwrap();
    }
    assert_eq!(quic_servers(&lab).len(), 2);
    lab.start_daemon().unwrap();
    let log = lab.log();
    assert!(log.contains("data plane ready reused=true"), "{log}");
    assert_eq!(quic_servers_by_api(&lab, QUIC), want);
    assert_eq!(quic_servers(&lab), want, "after the restart");
    assert!(lab.stop().unwrap().success());
}

/// What the pinned `TENANT_PREFIXES` trie holds: prefix (as text) → tenant id.
fn tenant_prefixes(lab: &DaemonLab) -> BTreeMap<String, u32> {
    use aya::maps::{LpmTrie, Map, MapData};
    let m = MapData::from_pin(lab.bpffs.join(lb_common::maps::TENANT_PREFIXES)).unwrap();
    let m: LpmTrie<_, lb_common::TenantPrefix, u32> = LpmTrie::try_from(Map::LpmTrie(m)).unwrap();
    m.iter()
        .map(|r| {
            let (k, id) = r.unwrap();
            let d = k.data();
            let ip = sluice::addr::from_words(d.addr, d.family);
            let len = k.prefix_len() - lb_common::TENANT_PREFIX_FAMILY_BITS;
            (format!("{ip}/{len}"), id)
        })
        .collect()
}

/// The pinned `TENANT_LIMITS` entry of a VIP (by name, its id from the API) and tenant id.
fn tenant_limits(lab: &DaemonLab, vip: &str, tenant: u32) -> lb_common::TenantLimits {
    use aya::maps::{Array, Map, MapData};
    let (_, v) = lab.api("GET", &format!("/v1/vips/{vip}"), None).unwrap();
    let vip_id = v["vip"]["id"].as_u64().unwrap_or_else(|| panic!("{v}")) as u32;
    let m = MapData::from_pin(lab.bpffs.join(lb_common::maps::TENANT_LIMITS)).unwrap();
    let a: Array<_, lb_common::TenantLimits> = Array::try_from(Map::Array(m)).unwrap();
    a.get(&lb_common::tenant_index(vip_id, tenant), 0).unwrap()
}

/// The VIP's flags as the pinned `VIPS` map holds them.
fn vip_flags(lab: &DaemonLab) -> u32 {
    use aya::maps::{HashMap, Map, MapData};
    let m = MapData::from_pin(lab.bpffs.join(lb_common::maps::VIPS)).unwrap();
    let m: HashMap<_, lb_common::VipKey, lb_common::VipMeta> =
        HashMap::try_from(Map::HashMap(m)).unwrap();
    let key = sluice::config::vip_key(vip().ip(), vip().port(), sluice::config::Protocol::Tcp);
    m.get(&key, 0).unwrap().flags
}

const TENANTS: &str = r#"
[[tenant]]
name = "acme"
prefixes = ["10.0.2.0/24", "2001:db8:2::/48"]
weight = 2
max_sessions = 40
new_sessions_per_sec = 10
[[tenant]]
name = "beta"
prefixes = ["10.0.3.0/24"]
"#;

/// Tenants from the file reach the pinned maps and `sluice tenant list`; a bad
/// `sluice tenant set` changes nothing and says why; a good one and a SIGHUP reload of a
/// changed file change the maps, and a removed tenant's prefixes leave the trie, also a
/// previous run's leftover after a restart over the pinned maps.
#[test]
fn tenants_reach_the_maps_and_follow_api_changes_and_reloads() {
    let mut opts = options();
    opts.tenants = TENANTS.into();
    let mut lab = start(opts);
    let prefixes = |list: &[(&str, u32)]| -> BTreeMap<String, u32> {
        list.iter().map(|(p, id)| (p.to_string(), *id)).collect()
    };
    assert_eq!(
        tenant_prefixes(&lab),
        prefixes(&[
            ("10.0.2.0/24", 1),
            ("2001:db8:2::/48", 1),
            ("10.0.3.0/24", 2)
        ]),
        "at start"
    );
    let acme = tenant_limits(&lab, VIP, 1);
    assert_eq!(
        (acme.interval_ns, acme.burst_ns),
        (100_000_000, 1_000_000_000)
    );
    assert_eq!(
        tenant_limits(&lab, VIP, 2),
        Default::default(),
        "beta has no rate"
    );
    assert_ne!(vip_flags(&lab) & lb_common::VIP_F_TENANTS, 0);
    let list = lab.cli_ok(&["tenant", "list"]);
    assert!(
        list.contains("acme") && list.contains("10.0.2.0/24,2001:db8:2::/48"),
        "{list}"
    );
    assert!(list.lines().any(|l| l.starts_with("beta ")), "{list}");
    let (_, v) = lab.api("GET", "/v1/tenants", None).unwrap();
    assert_eq!(
        v["tenants"].as_array().unwrap().len(),
        3,
        "default, acme, beta: {v}"
    );

    // A bad list: refused whole, with the reason, and the maps keep what they hold.
    let file = lab.dir.join("tenants.toml");
    fs::write(
        &file,
        "[[tenant]]\nname = \"acme\"\nprefixes = [\"10.0.2.1/24\"]\n",
    )
    .unwrap();
    let (code, _, err) = lab.cli(&["tenant", "set", file.to_str().unwrap()]);
    assert_ne!(code, 0);
    assert!(
        err.contains("tenant[0].prefixes[0]: \"10.0.2.1/24\" has bits set"),
        "{err}"
    );
    assert_eq!(
        tenant_prefixes(&lab).len(),
        3,
        "a refused list changes nothing"
    );

    // A good list: beta leaves (its prefix leaves the trie), gamma takes its id.
    fs::write(
        &file,
        "[[tenant]]\nname = \"acme\"\nprefixes = [\"10.0.2.0/24\"]\n\
         [[tenant]]\nname = \"gamma\"\nprefixes = [\"10.0.4.0/24\"]\nnew_sessions_per_sec = 4\n",
    )
    .unwrap();
    lab.cli_ok(&["tenant", "set", file.to_str().unwrap()]);
    assert_eq!(
        tenant_prefixes(&lab),
        prefixes(&[("10.0.2.0/24", 1), ("10.0.4.0/24", 2)]),
        "after the PUT"
    );
    assert_eq!(
        tenant_limits(&lab, VIP, 1),
        Default::default(),
        "acme has no rate now"
    );
    assert_eq!(tenant_limits(&lab, VIP, 2).interval_ns, 250_000_000);
    let audit = fs::read_to_string(&lab.audit_log).unwrap();
    assert!(audit.contains("\"set-tenants\""), "{audit}");

    // A changed file, reloaded: the file's tenants replace the API's.
    lab.reconfigure(|o| {
        o.tenants = "\n[[tenant]]\nname = \"acme\"\nprefixes = [\"10.0.5.0/24\"]\n".into()
    })
    .unwrap();
    lab.sighup().unwrap();
    wait_reloaded(&lab, 1);
    assert_eq!(
        tenant_prefixes(&lab),
        prefixes(&[("10.0.5.0/24", 1)]),
        "after the reload"
    );
    assert_eq!(tenant_limits(&lab, VIP, 2), Default::default());

    // A crash, a leftover prefix, and a restart over the pinned maps: the leftover goes.
    lab.kill9().unwrap();
    {
        use aya::maps::{lpm_trie::Key, LpmTrie, Map, MapData};
        let m = MapData::from_pin(lab.bpffs.join(lb_common::maps::TENANT_PREFIXES)).unwrap();
        let mut m: LpmTrie<_, lb_common::TenantPrefix, u32> =
            LpmTrie::try_from(Map::LpmTrie(m)).unwrap();
        let stale = lb_common::TenantPrefix {
            family: lb_common::FAMILY_V4,
            _pad: [0; 3],
            addr: [u32::from_ne_bytes([10, 9, 0, 0]), 0, 0, 0],
        };
        m.insert(
            &Key::new(lb_common::TENANT_PREFIX_FAMILY_BITS + 16, stale),
            7,
            0,
        )
        .unwrap();
    }
    assert_eq!(tenant_prefixes(&lab).len(), 2);
    lab.start_daemon().unwrap();
    let log = lab.log();
    assert!(log.contains("data plane ready reused=true"), "{log}");
    assert_eq!(
        tenant_prefixes(&lab),
        prefixes(&[("10.0.5.0/24", 1)]),
        "after the restart"
    );

    // No tenants at all: the VIP no longer looks tenants up.
    lab.reconfigure(|o| o.tenants.clear()).unwrap();
    lab.sighup().unwrap();
    wait_reloaded(&lab, 1);
    assert!(tenant_prefixes(&lab).is_empty());
    assert_eq!(vip_flags(&lab) & lb_common::VIP_F_TENANTS, 0);
    assert!(lab.stop().unwrap().success());
}

/// A tenant's established streams are counted as its sessions (the flow walker matches the
/// client to its prefix), its cap flags it `capped` at the next policy step, and the
/// established streams run to their end: a limit never cuts one.
#[test]
fn a_tenants_streams_count_as_its_sessions_and_its_cap_cuts_none() {
    let mut lab = start(options());
    let streams: Vec<Running> = (0..2)
        .map(|_| {
            lab.stream(vip(), 40, 100)
                .unwrap_or_else(|e| panic!("opening a stream: {e:#}"))
        })
        .collect();
    let client = streams[0].local.ip();
    let body = json!({"tenant": [
        {"name": "acme", "prefixes": [format!("{client}/32")], "max_sessions": 2}
    ]});
    let (st, v) = lab.api("PUT", "/v1/tenants", Some(&body)).unwrap();
    assert_eq!(st, 200, "{v}");
    let row = wait_for(
        "the tenant's streams to be counted and its cap to apply",
        Duration::from_secs(10),
        || {
            let (_, v) = lab.api("GET", "/v1/tenants", None).unwrap();
            let acme = v["tenants"]
                .as_array()
                .unwrap()
                .iter()
                .find(|t| t["tenant"] == "acme")
                .cloned()
                .unwrap();
            if acme["sessions"] == 2 && acme["state"] == "capped" {
                Ok(Some(acme))
            } else {
                Err(format!("{v}"))
            }
        },
    )
    .unwrap();
    assert_eq!(row["vip"], VIP);
    let list = lab.cli_ok(&["tenant", "list"]);
    assert!(
        list.lines()
            .any(|l| l.starts_with("acme ") && l.ends_with("capped")),
        "{list}"
    );
    let page = lab.metrics_page().unwrap();
    let line = format!(r#"sluice_tenant_limited{{tenant="acme",vip="{VIP}",limit="sessions"}} 1"#);
    assert!(page.lines().any(|l| l == line), "{line} missing:\n{page}");
    finish_all(streams, "the capped tenant's established streams");
    assert!(lab.stop().unwrap().success());
}
