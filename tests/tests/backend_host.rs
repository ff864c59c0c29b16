//! The backend host's daemon end to end: `sluice backend-host run` on every backend of the
//! daemon lab (started as its systemd unit starts it, readiness through `$NOTIFY_SOCKET`;
//! see `sluice_tests::backend_host`) decapsulates the LB's traffic, so real token streams
//! flow through it; a `kill -9` leaves decapsulation running, the restart re-adopts it, and
//! SIGTERM detaches it and takes the VIPs off lo. Needs root, `ip`, `ethtool`, `nsenter`, a
//! bpffs and the `sluice` binary; fails, never skips.

use std::{
    fs,
    net::{IpAddr, SocketAddr},
    process::Command,
    time::Duration,
};

use sluice_tests::{
    backend_host::config_text,
    daemon_lab::{tally, wait_for, DaemonLab, DaemonLabOptions, Running, VipDef},
    netns::{Netns, DEV, TCP_PORT, VIP4, VIP6},
};

const SERVER: &str = env!("CARGO_BIN_EXE_sluice-testsrv");
const VIP: &str = "chat";
const BACKENDS: usize = 2;
const DECAP_OK: &str = r#"sluice_dataplane_events_total{event="decap_ok"}"#;

fn vip() -> SocketAddr {
    SocketAddr::new(VIP4.into(), TCP_PORT)
}

fn start() -> DaemonLab {
    let opts = DaemonLabOptions::new(SERVER, BACKENDS, vec![VipDef::tcp(VIP, vip(), BACKENDS)]);
    DaemonLab::start(opts).unwrap_or_else(|e| panic!("starting the daemon lab: {e:#}"))
}

/// Streams until backend `i` has at least two (at most 30 streams).
fn streams_on(lab: &DaemonLab, i: usize, tokens: u32, interval_ms: u32) -> Vec<Running> {
    let name = &lab.topo.backends[i].name;
    let mut streams: Vec<Running> = Vec::new();
    while tally(streams.iter().map(|s| &s.backend))
        .get(name)
        .copied()
        .unwrap_or(0)
        < 2
    {
        assert!(streams.len() < 30, "30 streams put fewer than 2 on {name}");
        streams.push(
            lab.stream(vip(), tokens, interval_ms)
                .unwrap_or_else(|e| panic!("opening a stream: {e:#}")),
        );
    }
    streams
}

fn finish_all(streams: Vec<Running>, what: &str) {
    let n = streams.len();
    let failures: Vec<String> = streams.into_iter().filter_map(Running::broken).collect();
    assert!(
        failures.is_empty(),
        "{what}: {} of {n} streams did not complete:\n{}",
        failures.len(),
        failures.join("\n")
    );
}

fn has_xdp(ns: &Netns) -> bool {
    ns.ip(&["link", "show", DEV])
        .unwrap_or_else(|e| panic!("ip link show: {e:#}"))
        .contains("xdp")
}

fn on_lo(ns: &Netns, a: IpAddr) -> bool {
    ns.ip(&["addr", "show", "dev", "lo"])
        .unwrap_or_else(|e| panic!("ip addr show: {e:#}"))
        .contains(&format!(" {a}/"))
}

/// `sluice <args>` in namespace `ns` (nsenter --net: the host's /sys/fs/bpf stays visible):
/// (exit code, stdout, stderr).
fn sluice_in(lab: &DaemonLab, ns: &Netns, args: &[&str]) -> (i32, String, String) {
    let out = Command::new("nsenter")
        .arg(format!("--net={}", ns.path().display()))
        .arg("--")
        .arg(&lab.sluice)
        .args(args)
        .output()
        .expect("running sluice with nsenter");
    (
        out.status.code().unwrap_or(-1),
        String::from_utf8_lossy(&out.stdout).into(),
        String::from_utf8_lossy(&out.stderr).into(),
    )
}

#[test]
fn streams_flow_through_the_backend_host_and_survive_its_kill_9_and_restart_then_sigterm_detaches()
{
    let mut lab = start();
    let ns = lab.topo.backends[0].ns.clone();
    assert!(has_xdp(&ns), "the backend host attached nothing to {DEV}");
    assert!(on_lo(&ns, VIP4.into()), "VIP {VIP4} is not on lo");

    // 10 s streams: they outlive the crash and the restart of backend 0's host.
    let streams = streams_on(&lab, 0, 100, 100);
    let h = &mut lab.backend_hosts[0];
    let before = wait_for(
        "decap_ok to count the streams",
        Duration::from_secs(5),
        || match h.metric(DECAP_OK) {
            Ok(n) if n > 0 => Ok(Some(n)),
            Ok(n) => Err(format!("decap_ok {n}")),
            Err(e) => Err(format!("{e:#}")),
        },
    )
    .unwrap();

    h.kill9().unwrap();
    assert!(
        h.bpffs.join(format!("link_{DEV}")).exists(),
        "the pinned link is gone"
    );
    assert!(
        has_xdp(&ns),
        "decapsulation detached with the killed daemon"
    );
    // New sessions still reach backend 0 through the orphaned (pinned) program.
    let greeted: Vec<String> = (0..12)
        .map(|_| {
            lab.greet(vip(), Duration::from_secs(5))
                .expect("a session with the backend host dead")
        })
        .collect();
    assert!(
        greeted.contains(&lab.topo.backends[0].name),
        "12 sessions, none on {}: {greeted:?}",
        lab.topo.backends[0].name
    );

    let h = &mut lab.backend_hosts[0];
    h.start().unwrap();
    let log = h.log();
    assert!(
        log.contains("decapsulation ready reused=true"),
        "the restarted backend host did not re-adopt its pinned data plane:\n{log}"
    );
    // The pinned counters carried over and keep counting the streams.
    wait_for(
        "decap_ok to grow after the restart",
        Duration::from_secs(5),
        || match h.metric(DECAP_OK) {
            Ok(n) if n > before => Ok(Some(n)),
            Ok(n) => Err(format!("decap_ok {n}, before the crash {before}")),
            Err(e) => Err(format!("{e:#}")),
        },
    )
    .unwrap();
    finish_all(
        streams,
        "streams across the backend host's kill -9 and restart",
    );

    // SIGTERM: detached, unpinned, VIPs off lo.
    let h = &mut lab.backend_hosts[0];
    assert!(h.stop().unwrap().success(), "{}", h.log());
    assert!(!h.bpffs.exists(), "{} is still pinned", h.bpffs.display());
    assert!(!has_xdp(&ns), "SIGTERM left decapsulation attached");
    assert!(!on_lo(&ns, VIP4.into()), "SIGTERM left VIP {VIP4} on lo");
    let log = h.log();
    assert!(
        log.contains("decapsulation detached and unpinned, VIPs taken off lo"),
        "{log}"
    );
}

#[test]
fn check_and_status_report_the_host_and_the_metrics_show_a_dsr_problem() {
    let lab = start();
    let b = &lab.topo.backends[1];
    let cfg = lab.backend_hosts[1].config.display().to_string();

    // The lab sets backends up for DSR: nothing to report.
    let (code, out, err) = sluice_in(&lab, &b.ns, &["backend-host", "check", "--config", &cfg]);
    assert_eq!(code, 0, "{out}{err}");
    let (code, out, err) = sluice_in(&lab, &b.ns, &["backend-host", "status", "--config", &cfg]);
    assert_eq!(code, 0, "{out}{err}");
    assert!(
        out.contains(&format!("interface      {DEV}: attached (pinned link)")),
        "{out}"
    );
    assert!(
        out.contains(&format!("vip            {VIP4}: on lo")),
        "{out}"
    );
    assert!(out.lines().any(|l| l.starts_with("decap_ok ")), "{out}");

    // Strict reverse-path filtering on eth0: found by check (exit 1, with the fix) and
    // exported at the next scrape.
    b.ns.sysctl(&format!("net/ipv4/conf/{DEV}/rp_filter"), "1")
        .unwrap();
    let (code, out, err) = sluice_in(&lab, &b.ns, &["backend-host", "check", "--config", &cfg]);
    assert_eq!(code, 1, "{out}{err}");
    assert!(out.contains("DSR problem (rp_filter)"), "{out}");
    assert!(
        out.contains(&format!(
            "fix: sysctl -w net.ipv4.conf.all.rp_filter=2 net.ipv4.conf.{DEV}.rp_filter=2"
        )),
        "{out}"
    );
    assert_eq!(
        lab.backend_hosts[1]
            .metric(r#"sluice_backend_host_dsr_problems{check="rp_filter"}"#)
            .unwrap(),
        1
    );
    b.ns.sysctl(&format!("net/ipv4/conf/{DEV}/rp_filter"), "0")
        .unwrap();
    assert_eq!(
        lab.backend_hosts[1]
            .metric(r#"sluice_backend_host_dsr_problems{check="rp_filter"}"#)
            .unwrap(),
        0
    );

    // SIGHUP applies the file's VIPs: one more goes up on lo, then comes off again.
    let h = &lab.backend_hosts[1];
    let extra: IpAddr = "10.111.100.9".parse().unwrap();
    let base = [IpAddr::from(VIP4), IpAddr::from(VIP6)];
    for (vips, up) in [
        (vec![base[0], base[1], extra], true),
        (base.to_vec(), false),
    ] {
        fs::write(&h.config, config_text(&vips, &h.bpffs)).unwrap();
        h.reload().unwrap();
        wait_for(
            "the reload to apply the VIPs",
            Duration::from_secs(5),
            || {
                if on_lo(&b.ns, extra) == up {
                    Ok(Some(()))
                } else {
                    Err(format!("{extra} on lo: {}", !up))
                }
            },
        )
        .unwrap();
    }
    assert!(on_lo(&b.ns, VIP4.into()), "the reload took {VIP4} off lo");
    assert!(h.log().contains("configuration reloaded"), "{}", h.log());
}

/// A VIP table with a QUIC-LB server ID: the backend host writes it to its `quic_file` at
/// start and again on SIGHUP, and shows it in `status` and its metrics.
#[test]
fn quic_server_ids_are_written_for_the_hosts_quic_servers_and_follow_a_reload() {
    let mut lab = start();
    let h = &mut lab.backend_hosts[1];
    let quic_file = h.dir.join(format!("quic-{}.json", h.name));
    let bpffs = h.bpffs.clone();
    let text = |id: &str| {
        config_text(&[VIP4.into(), VIP6.into()], &bpffs)
            .replace(
                &format!("\"{VIP6}\""),
                &format!("{{ address = \"{VIP6}\", quic_server_id = \"{id}\", quic_config_rotation = 1 }}"),
            )
            .replace(
                "\n[metrics]",
                &format!("quic_file = \"{}\"\n\n[metrics]", quic_file.display()),
            )
    };
    fs::write(&h.config, text("0A02")).unwrap();
    h.stop().unwrap();
    h.start().unwrap();
    let want = |id: &str| {
        serde_json::json!({"vips": [{
            "vip": VIP6.to_string(),
            "quic_server_id": id,
            "quic_server_id_len": 2,
            "quic_config_rotation": 1,
        }]})
    };
    let read = || -> serde_json::Value {
        serde_json::from_str(&fs::read_to_string(&quic_file).unwrap()).unwrap()
    };
    assert_eq!(read(), want("0a02"));
    use std::os::unix::fs::PermissionsExt;
    let mode = fs::metadata(&quic_file).unwrap().permissions().mode() & 0o777;
    assert_eq!(mode, 0o644, "QUIC servers of another user read it");
    assert_eq!(
        h.metric(&format!(
            r#"sluice_backend_host_quic_server_id_info{{vip="{VIP6}",quic_server_id="0a02"}}"#
        ))
        .unwrap(),
        1
    );

    fs::write(&h.config, text("0a03")).unwrap();
    h.reload().unwrap();
    wait_for(
        "the reload to rewrite the QUIC file",
        Duration::from_secs(5),
        || {
            let got = read();
            if got == want("0a03") {
                Ok(Some(()))
            } else {
                Err(format!("{got}"))
            }
        },
    )
    .unwrap();
    let cfg = h.config.display().to_string();
    let ns = &lab.topo.backends[1].ns;
    let (code, out, err) = sluice_in(&lab, ns, &["backend-host", "status", "--config", &cfg]);
    assert_eq!(code, 0, "{out}{err}");
    assert!(
        out.contains(&format!(
            "quic           {VIP6}: server ID 0a03 (2 octets, config rotation 1)"
        )),
        "{out}"
    );
}
