//! Hostile local users and failed starts against the real daemon: `sluice run` in the
//! namespace lab's LB namespace (see `sluice_tests::daemon_lab`). Needs root, `ip`,
//! `ethtool`, `nsenter`, a bpffs and the `sluice` binary; fails, never skips.

use std::{
    fs,
    io::Write,
    net::{SocketAddr, TcpStream},
    os::unix::{fs::MetadataExt, net::UnixStream},
    path::PathBuf,
    sync::{
        atomic::{AtomicBool, Ordering},
        Arc,
    },
    thread,
    time::{Duration, Instant},
};

use serde_json::json;
use sluice_tests::{
    daemon_lab::{tally, DaemonLab, DaemonLabOptions, Running, VipDef},
    netns::{TCP_PORT, VIP4},
    stream::connect_from,
};

const SERVER: &str = env!("CARGO_BIN_EXE_sluice-testsrv");
const VIP: &str = "chat";
const BACKENDS: usize = 3;
/// nobody / nogroup.
const NOBODY: u32 = 65534;

fn vip() -> SocketAddr {
    SocketAddr::new(VIP4.into(), TCP_PORT)
}

fn options() -> DaemonLabOptions {
    DaemonLabOptions::new(SERVER, BACKENDS, vec![VipDef::tcp(VIP, vip(), BACKENDS)])
}

fn start(opts: DaemonLabOptions) -> DaemonLab {
    DaemonLab::start(opts).unwrap_or_else(|e| panic!("starting the daemon lab: {e:#}"))
}

/// Each backend's (state, healthy), by address.
fn backend_states(lab: &DaemonLab) -> Vec<(String, String, bool)> {
    lab.backends(VIP)
        .iter()
        .map(|b| {
            (
                b["address"].as_str().unwrap_or_default().to_string(),
                b["state"].as_str().unwrap_or_default().to_string(),
                b["healthy"].as_bool().unwrap_or(false),
            )
        })
        .collect()
}

/// Becomes nobody on this thread only: the raw system calls change the calling thread's
/// credentials (glibc's wrappers would change every thread of the test process).
fn become_nobody() -> std::io::Result<()> {
    // SAFETY: plain system calls on this thread's credentials.
    unsafe {
        let r = [
            libc::syscall(libc::SYS_setgroups, 0, std::ptr::null::<libc::gid_t>()),
            libc::syscall(libc::SYS_setresgid, NOBODY, NOBODY, NOBODY),
            libc::syscall(libc::SYS_setresuid, NOBODY, NOBODY, NOBODY),
        ];
        if r.iter().any(|&r| r != 0) {
            return Err(std::io::Error::last_os_error());
        }
    }
    Ok(())
}

/// Runs `f` with this process's soft RLIMIT_NOFILE at `soft` (children inherit it), then
/// restores it.
fn with_soft_nofile<T>(soft: u64, f: impl FnOnce() -> T) -> T {
    let mut old = libc::rlimit {
        rlim_cur: 0,
        rlim_max: 0,
    };
    // SAFETY: valid pointers to rlimits.
    unsafe {
        assert_eq!(libc::getrlimit(libc::RLIMIT_NOFILE, &mut old), 0);
        let low = libc::rlimit {
            rlim_cur: soft,
            rlim_max: old.rlim_max,
        };
        assert_eq!(libc::setrlimit(libc::RLIMIT_NOFILE, &low), 0);
    }
    let out = std::panic::catch_unwind(std::panic::AssertUnwindSafe(f));
    // SAFETY: as above.
    unsafe { assert_eq!(libc::setrlimit(libc::RLIMIT_NOFILE, &old), 0) };
    out.unwrap_or_else(|p| std::panic::resume_unwind(p))
}

/// The soft "Max open files" of process `pid`.
fn soft_nofile_of(pid: u32) -> u64 {
    let limits = fs::read_to_string(format!("/proc/{pid}/limits")).unwrap();
    limits
        .lines()
        .find_map(|l| l.strip_prefix("Max open files"))
        .and_then(|l| l.split_whitespace().next())
        .and_then(|n| n.parse().ok())
        .unwrap_or_else(|| panic!("no open-file limit in\n{limits}"))
}

/// What the attacker managed: connections opened to each listener.
#[derive(Debug, Default)]
struct Attack {
    admin: usize,
    metrics: usize,
}

/// An unprivileged user holding a few hundred connections to the metrics port must not run
/// the daemon out of descriptors (its health checks would fail with EMFILE, every backend go
/// down and every stream break). Here `nobody` (in the admin socket's group, so it may connect
/// there too) opens and holds connections to both listeners, and sends headers and half a
/// body on the admin ones, for the whole life of the streams.
#[test]
fn an_unprivileged_user_holding_connections_to_both_listeners_breaks_no_stream() {
    let mut opts = options();
    opts.set("admin", "mode", "\"0660\"");
    opts.set("admin", "group", &format!("\"{NOBODY}\""));
    // The daemon starts with a soft open-file limit of 512 (below what it needs, as under
    // a small LimitNOFILE) and must raise it.
    let lab = with_soft_nofile(512, || start(opts));
    let limit = soft_nofile_of(lab.daemon_pid().unwrap());
    assert!(
        limit > 512,
        "the daemon kept a soft open-file limit of {limit}"
    );
    let before = backend_states(&lab);
    assert!(
        before.iter().all(|(_, s, h)| s == "active" && *h),
        "{before:?}"
    );
    let pid = lab.daemon_pid().unwrap();

    // 8 s streams on every backend.
    let mut streams: Vec<Running> = Vec::new();
    while tally(streams.iter().map(|s| &s.backend)).len() < BACKENDS || streams.len() < 9 {
        assert!(streams.len() < 40, "40 streams did not reach every backend");
        streams.push(lab.stream(vip(), 80, 100).expect("opening a stream"));
    }

    let stop = Arc::new(AtomicBool::new(false));
    let (socket, metrics) = (lab.socket.clone(), lab.metrics);
    let attacker = lab.topo.lb.ns.spawn({
        let stop = stop.clone();
        move || -> anyhow::Result<Attack> {
            become_nobody()?;
            let mut held_admin: Vec<UnixStream> = Vec::new();
            let mut held_metrics: Vec<TcpStream> = Vec::new();
            let mut got = Attack::default();
            // Bounded: 100 rounds of 100 ms, 30 new connections to each listener a round,
            // at most 600 held to each (the oldest let go).
            for _ in 0..100 {
                if stop.load(Ordering::Relaxed) {
                    break;
                }
                for _ in 0..30 {
                    if let Ok(mut s) = UnixStream::connect(&socket) {
                        let _ = s.write_all(
                            b"POST /v1/vips HTTP/1.1\r\nHost: x\r\nContent-Length: 1000\r\n\r\n{",
                        );
                        got.admin += 1;
                        held_admin.push(s);
                    }
                    if let Ok(s) = TcpStream::connect_timeout(&metrics, Duration::from_millis(200))
                    {
                        got.metrics += 1;
                        held_metrics.push(s);
                    }
                }
                for held in [held_admin.len(), held_metrics.len()] {
                    assert!(held <= 600 + 30);
                }
                if held_admin.len() > 600 {
                    held_admin.drain(..30);
                }
                if held_metrics.len() > 600 {
                    held_metrics.drain(..30);
                }
                thread::sleep(Duration::from_millis(100));
            }
            Ok(got)
        }
    });

    // While it holds them: the operator is answered within a second, every time.
    thread::sleep(Duration::from_secs(2));
    for _ in 0..5 {
        let t = Instant::now();
        let status = lab.cli_ok(&["status"]);
        let took = t.elapsed();
        assert!(status.contains("backends    3"), "{status}");
        assert!(
            took < Duration::from_secs(1),
            "`sluice status` took {took:?}"
        );
        thread::sleep(Duration::from_millis(500));
    }
    // The daemon's descriptors stay bounded (both listeners full, plus its own).
    let fds = fs::read_dir(format!("/proc/{pid}/fd")).unwrap().count();
    assert!(fds < 400, "the daemon holds {fds} descriptors");

    let mut failures = Vec::new();
    let n = streams.len();
    for s in streams {
        let (backend, tokens) = (s.backend.clone(), s.tokens);
        match s.finish() {
            Ok(got) if got == tokens => {}
            Ok(got) => failures.push(format!("{backend}: {got} of {tokens} tokens")),
            Err(e) => failures.push(format!("{backend}: {e:#}")),
        }
    }
    stop.store(true, Ordering::Relaxed);
    let attack = attacker.join().unwrap().expect("the attacker thread");
    eprintln!("attacker opened {attack:?}; daemon fds {fds}");
    assert!(
        failures.is_empty(),
        "{} of {n} streams broke:\n{}",
        failures.len(),
        failures.join("\n")
    );
    assert!(
        attack.admin > 64 && attack.metrics > 64,
        "the attack did not happen: {attack:?}"
    );

    assert_eq!(backend_states(&lab), before, "a backend changed state");
    let flips: Vec<_> = lab
        .events()
        .into_iter()
        .filter(|e| e["kind"] == "down" || e["kind"] == "up")
        .collect();
    assert!(flips.is_empty(), "health flips: {flips:?}");
    let page = lab.metrics_page().unwrap();
    let refused = |listener: &str| -> u64 {
        let prefix =
            format!("sluice_listener_refused_connections_total{{listener=\"{listener}\"}} ");
        page.lines()
            .find_map(|l| l.strip_prefix(&prefix))
            .and_then(|v| v.trim().parse().ok())
            .unwrap_or_else(|| panic!("no {prefix} in\n{page}"))
    };
    assert!(refused("admin") > 0 && refused("metrics") > 0, "{page}");
    assert!(lab
        .log()
        .contains("connection answered 503: the listener or this peer is at its cap"));
}

/// The audit log and state file are 0600; SIGHUP applies what it can and names what needs a
/// restart; a start that fails on a taken metrics port loads nothing, one that fails after the
/// XDP attach leaves no program attached and nothing pinned, and neither touches the state
/// file or the saved rings.
#[test]
fn files_are_private_reload_says_what_needs_a_restart_and_a_failed_start_rolls_back() {
    // Exporters run on the backends, but the first configuration scrapes none of them.
    let mut opts = options();
    opts.exporters = true;
    let mut lab = start(opts);
    let scraped = |lab: &DaemonLab| {
        lab.backends(VIP)
            .iter()
            .filter(|b| b["steering"]["telemetry_age_s"].is_f64())
            .count()
    };
    assert_eq!(scraped(&lab), 0);
    let b0 = lab.topo.backends[0].v4.to_string();
    let (status, v) = lab
        .api(
            "PUT",
            &format!("/v1/vips/{VIP}/backends/{b0}/weight"),
            Some(&json!({ "weight": 60 })),
        )
        .unwrap();
    assert_eq!(status, 200, "{v}");
    for f in [&lab.audit_log, &lab.state_file] {
        let mode = fs::metadata(f).unwrap().mode() & 0o777;
        assert_eq!(mode, 0o600, "{} is {mode:o}", f.display());
    }

    // A reload with new telemetry endpoints, a health, a policy and a data-plane change.
    lab.reconfigure(|o| {
        o.vips[0].telemetry = true;
        o.set("telemetry", "stale_after", "\"2s\"");
        o.set("health", "interval", "\"300ms\"");
        o.set("policy", "cooldown_base", "\"3s\"");
        o.set("dataplane", "conn_table_size", "32768");
    })
    .unwrap();
    lab.sighup().unwrap();
    let deadline = Instant::now() + Duration::from_secs(10);
    let line = loop {
        let log = lab.log();
        if let Some(l) = log.lines().find(|l| l.contains("configuration reloaded")) {
            break l.to_string();
        }
        assert!(Instant::now() < deadline, "no reload logged:\n{log}");
        thread::sleep(Duration::from_millis(50));
    };
    assert!(line.contains("except keys that need a restart"), "{line}");
    assert!(
        line.contains("needs_restart=dataplane.conn_table_size"),
        "{line}"
    );
    assert!(
        line.contains(r#"applied=["vip", "health", "telemetry", "policy"]"#),
        "{line}"
    );
    assert!(lab.daemon_running(), "the reload stopped the daemon");
    // The new endpoints are scraped: every backend gets a telemetry view.
    let deadline = Instant::now() + Duration::from_secs(10);
    while scraped(&lab) < BACKENDS {
        assert!(
            Instant::now() < deadline,
            "the reloaded telemetry endpoints are not scraped: {:?}",
            lab.backends(VIP)
        );
        thread::sleep(Duration::from_millis(100));
    }
    assert_eq!(lab.cli_json(&["status"])["backends"], 3);

    // Stop (unpins; the rings are saved beside the state file), then a start that fails
    // before the load: the metrics port is taken (bound with the admin socket, before
    // anything is loaded or attached).
    assert!(lab.stop().unwrap().success());
    assert!(!lab.bpffs.join("link_eth0").exists());
    let files = |lab: &DaemonLab| {
        (
            fs::read(&lab.state_file).ok(),
            fs::read(lab.state_file.with_extension("rings")).ok(),
        )
    };
    let saved = files(&lab);
    assert!(
        saved.0.is_some() && saved.1.is_some(),
        "no state file or no saved rings after the stop"
    );
    let taken = lab.take_metrics_port().unwrap();
    let e = format!("{:#}", lab.start_daemon().unwrap_err());
    assert!(e.contains("binding the metrics address"), "{e}");
    let log = lab.log();
    assert!(
        !log.contains("XDP attached"),
        "the start attached before it bound the metrics port:\n{log}"
    );
    assert!(!lab.bpffs.exists(), "the failed start left {:?}", lab.bpffs);
    assert!(!lab.lb_has_xdp().unwrap(), "XDP is attached");
    assert!(
        files(&lab) == saved,
        "the failed start changed the state files"
    );
    drop(taken);

    // A start that fails after the attach: the state file cannot be written (a directory
    // where its temporary file goes).
    let tmp = PathBuf::from(format!("{}.tmp", lab.state_file.display()));
    fs::create_dir(&tmp).unwrap();
    let e = format!("{:#}", lab.start_daemon().unwrap_err());
    assert!(e.contains(&lab.state_file.display().to_string()), "{e}");
    let log = lab.log();
    assert!(
        log.contains("XDP attached"),
        "the start failed before the attach:\n{log}"
    );
    assert!(
        log.contains("start failed; the data plane it attached is detached and unpinned"),
        "{log}"
    );
    assert!(
        !lab.bpffs.join("link_eth0").exists(),
        "the link is still pinned"
    );
    assert!(!lab.lb_has_xdp().unwrap(), "XDP is still attached");
    assert!(
        files(&lab) == saved,
        "the failed start changed the state files"
    );
    fs::remove_dir(&tmp).unwrap();
}

/// A local user connecting to the metrics port from 64 loopback addresses (4 each, four
/// times the listener's cap) holds one peer's 16 slots; the rest are answered 503 at once,
/// and a Prometheus on another host is answered every time.
#[test]
fn loopback_addresses_do_not_starve_a_remote_scraper() {
    let mut lab = start(options());
    let port = lab.metrics.port();
    lab.reconfigure(|o| {
        o.set("metrics", "listen", &format!("\"0.0.0.0:{port}\""));
    })
    .unwrap();
    lab.restart().unwrap();
    let metrics = SocketAddr::new(lab.topo.lb.addr(false), port);
    let local = SocketAddr::new([127, 0, 0, 1].into(), port);
    let held: Vec<TcpStream> = (1..=64u8)
        .flat_map(|a| [a; 4])
        .map(|a| {
            let src = [127, 0, 0, a].into();
            connect_from(&lab.topo.lb.ns, src, local, Duration::from_secs(5))
                .unwrap_or_else(|e| panic!("connecting from {src}: {e:#}"))
        })
        .collect();
    thread::sleep(Duration::from_millis(300));
    let scrapes: Vec<_> = (0..8)
        .map(|_| {
            lab.topo
                .client
                .ns
                .run(move || {
                    sluice_tests::daemon_lab::http_exchange(
                        metrics,
                        "GET /metrics HTTP/1.1\r\nHost: lab\r\nConnection: close\r\n\r\n",
                        Duration::from_secs(5),
                    )
                    .map(|(status, _)| status)
                    .map_err(|e| format!("{e:#}"))
                })
                .unwrap()
        })
        .collect();
    let mut busy = 0;
    for mut s in held.iter() {
        use std::io::Read;
        s.set_read_timeout(Some(Duration::from_millis(200)))
            .unwrap();
        let mut head = [0u8; 12];
        if s.read_exact(&mut head).is_ok() && &head == b"HTTP/1.1 503" {
            busy += 1;
        }
    }
    assert!(
        scrapes.iter().all(|r| r == &Ok(200)),
        "remote scrapes while loopback connections are held: {scrapes:?}"
    );
    assert_eq!(busy, held.len() - 16, "loopback connections answered 503");
}
