//! `sluice backend-host`: the backend (accelerator) host's side of Sluice.
//!
//! The LB sends a VIP's packets to a backend inside an outer IPv4/IPv6 header and the backend
//! answers the client directly (DSR). `sluice backend-host run` makes a host ready for that:
//! it attaches `sluice_decap` to the configured interfaces (pinned under `bpffs`, so a
//! restart or a crash leaves decapsulation running and the next start re-adopts it), puts the
//! VIPs on `lo`, reports what would break DSR ([`dsr`]), and serves its counters as
//! Prometheus metrics. SIGTERM detaches it and removes the VIPs from `lo` (unless
//! `keep_dataplane_on_exit`).

pub mod cli;
pub mod config;
pub mod dsr;

use std::{
    io::Write,
    net::IpAddr,
    path::Path,
    process::Command,
    sync::atomic::{AtomicU64, Ordering},
    sync::{Arc, Mutex},
    time::Instant,
};

use anyhow::{anyhow, bail, Context, Result};
use lb_common::{maps, stat};
use prometheus_client::{
    encoding::prometheus_text,
    metrics::{gauge::Gauge, info::Info},
    registry::{Registry, Unit},
};
use tokio::signal::unix::SignalKind;

use self::{config::HostConfig, dsr::Finding};
use crate::{
    daemon::{attach_interfaces, ifindex, init_logging, undo},
    dataplane::{remove_pinned, Dataplane, LoadOptions, PROG_DECAP},
    notify,
    object::BPF_OBJECT,
    prom_text::{counters as counters_family, dataplane_counters, gauges},
};

/// The counters of `sluice_decap` (the rest of `lb_common::stat` belongs to the LB).
pub const DECAP_COUNTERS: [stat::Counter; 3] = [
    stat::DECAP_OK,
    stat::DECAP_PASS_NOT_ENCAP,
    stat::DECAP_PASS_BAD_LEN,
];

/// The `/128` or `/32` of a VIP on `lo`.
fn host_prefix(vip: &IpAddr) -> String {
    match vip {
        IpAddr::V4(a) => format!("{a}/32"),
        IpAddr::V6(a) => format!("{a}/128"),
    }
}

/// Runs `ip <args>` (iproute2); fails with its message.
fn ip(args: &[&str]) -> Result<()> {
    let out = Command::new("ip")
        .args(args)
        .output()
        .context("running `ip` (iproute2 must be installed)")?;
    if !out.status.success() {
        bail!(
            "`ip {}` failed: {}",
            args.join(" "),
            String::from_utf8_lossy(&out.stderr).trim()
        );
    }
    Ok(())
}

/// Puts every VIP on `lo` (`replace`: a VIP already there is kept as is).
fn add_vips(vips: &[IpAddr]) -> Result<()> {
    for v in vips {
        ip(&["addr", "replace", &host_prefix(v), "dev", "lo"])
            .with_context(|| format!("putting VIP {v} on lo"))?;
    }
    Ok(())
}

/// Takes the VIPs off `lo`; a VIP already gone is no error.
fn remove_vips(vips: &[IpAddr]) {
    for v in vips {
        if let Err(e) = ip(&["addr", "del", &host_prefix(v), "dev", "lo"]) {
            tracing::warn!(vip = %v, error = %format!("{e:#}"), "taking the VIP off lo");
        }
    }
}

/// The file the host's QUIC servers read their server IDs from: `{"vips": [{"vip",
/// "quic_server_id", "quic_server_id_len", "quic_config_rotation"}, ...]}`, one entry per VIP
/// with a server ID (an empty list when none has).
pub fn quic_file_text(quic: &[config::QuicServer]) -> String {
    let mut s = serde_json::to_string_pretty(&serde_json::json!({ "vips": quic }))
        .expect("plain values serialize");
    s.push('\n');
    s
}

/// Writes [`quic_file_text`] to `path` (0644 in a 0755 directory: readable by a QUIC server
/// that runs as another user), replacing the file whole. A host without server IDs writes
/// nothing unless the file is there already (it then lists none).
fn write_quic_file(path: &Path, quic: &[config::QuicServer]) -> Result<()> {
    if quic.is_empty() && !path.exists() {
        return Ok(());
    }
    if let Some(dir) = path.parent() {
        use std::os::unix::fs::DirBuilderExt;
        std::fs::DirBuilder::new()
            .recursive(true)
            .mode(0o755)
            .create(dir)
            .with_context(|| format!("creating {}", dir.display()))?;
    }
    crate::private_file::write_mode(path, quic_file_text(quic).as_bytes(), 0o644)
        .with_context(|| format!("writing the QUIC server IDs to {}", path.display()))
}

/// Logs each finding as a warning.
fn log_findings(findings: &[Finding]) {
    for f in findings {
        tracing::warn!(check = f.check, interface = %f.interface, fix = %f.fix, "DSR: {}", f.problem);
    }
}

/// What the metrics endpoint reads per scrape.
struct Live {
    dp: Mutex<Dataplane>,
    cfg: HostConfig,
    started: Instant,
    /// Metrics connections refused over the listener's caps.
    refused: AtomicU64,
}

/// The exposition text: the decapsulation counters, the DSR findings per check (read
/// afresh: a fixed sysctl shows at the next scrape), the VIPs served, uptime and version.
fn render(
    counters: &[(stat::Counter, u64)],
    refused: u64,
    cfg: &HostConfig,
    findings: &[Finding],
    up: f64,
) -> String {
    let mut reg = Registry::with_prefix("sluice");
    dataplane_counters(&mut reg, counters.iter().copied());
    counters_family(
        &mut reg,
        "listener_refused_connections",
        "Connections answered 503 and closed at once because the listener or the peer was at its cap",
        vec![(vec![("listener", "metrics".into())], refused)],
    );
    gauges(
        &mut reg,
        "backend_host_dsr_problems",
        "Problems that break direct server return on this host, by check (see `sluice \
         backend-host check`)",
        dsr::CHECKS
            .iter()
            .map(|c| {
                let n = findings.iter().filter(|f| f.check == *c).count();
                (vec![("check", c.to_string())], n as i64)
            })
            .collect(),
    );
    gauges(
        &mut reg,
        "backend_host_vips",
        "VIPs this host serves (on lo)",
        vec![(vec![], cfg.vips.len() as i64)],
    );
    gauges(
        &mut reg,
        "backend_host_quic_server_id_info",
        "1 for each VIP this host has a QUIC-LB server ID for, labelled with it (hex)",
        cfg.quic
            .iter()
            .map(|q| {
                (
                    vec![
                        ("vip", q.vip.to_string()),
                        ("quic_server_id", q.quic_server_id.clone()),
                    ],
                    1,
                )
            })
            .collect(),
    );
    let uptime = Gauge::<f64, std::sync::atomic::AtomicU64>::default();
    uptime.set(up);
    reg.register_with_unit(
        "uptime",
        "Time since the daemon started",
        Unit::Seconds,
        uptime,
    );
    reg.register(
        "build",
        "The daemon's version",
        Info::new(vec![("version", env!("CARGO_PKG_VERSION").to_string())]),
    );
    let mut out = String::new();
    prometheus_text::encode(&mut out, &reg).expect("writing to a String cannot fail");
    out
}

/// The decapsulation counters of a data plane, by name.
fn read_counters(dp: &mut Dataplane) -> Result<Vec<(stat::Counter, u64)>> {
    let all = dp.stats()?;
    Ok(DECAP_COUNTERS
        .iter()
        .map(|&c| (c, all[c.index()]))
        .collect())
}

impl Live {
    fn page(&self) -> Result<String> {
        let counters = read_counters(&mut self.dp.lock().expect("data plane lock"))?;
        let findings = dsr::evaluate(&self.cfg, &dsr::read_facts(&self.cfg));
        Ok(render(
            &counters,
            self.refused.load(Ordering::Relaxed),
            &self.cfg,
            &findings,
            self.started.elapsed().as_secs_f64(),
        ))
    }
}

/// `sluice backend-host run`: attach, put the VIPs up, serve metrics until SIGTERM/SIGINT;
/// SIGHUP re-reads the file and applies its VIPs.
pub async fn run(path: &Path) -> Result<()> {
    let cfg = config::load(path)?;
    init_logging(cfg.log_level, cfg.log_format);
    log_findings(&dsr::evaluate(&cfg, &dsr::read_facts(&cfg)));
    // What the host can refuse is refused before anything is loaded or attached.
    for itf in &cfg.interfaces {
        ifindex(&itf.name)?;
    }
    write_quic_file(&cfg.quic_file, &cfg.quic)?;
    let metrics_listener = match cfg.metrics {
        Some(addr) => Some(crate::metrics::bind(addr)?),
        None => None,
    };
    let opts = LoadOptions {
        pin_dir: Some(cfg.bpffs.clone()),
        ..LoadOptions::decap_only()
    };
    let mut dp = Dataplane::load(BPF_OBJECT, &opts)?;
    let reused = dp.reused();
    let mut undone = Vec::new();
    let attached = attach_interfaces(
        &mut dp,
        PROG_DECAP,
        &cfg.interfaces,
        &cfg.bpffs,
        &mut undone,
    )
    .and_then(|a| add_vips(&cfg.vips).map(|()| a));
    let attached = match attached {
        Ok(a) => a,
        // A failed first start leaves nothing behind; a re-adopted data plane gets back the
        // links the earlier run left (still decapsulating).
        Err(e) if !reused => {
            drop(dp);
            if let Err(c) = remove_pinned(&cfg.bpffs) {
                tracing::error!(error = %format!("{c:#}"), "removing the partly started data plane");
            }
            remove_vips(&cfg.vips);
            return Err(e);
        }
        Err(e) => {
            undo(&mut dp, undone);
            return Err(e);
        }
    };
    tracing::info!(
        reused,
        pin_dir = %cfg.bpffs.display(),
        vips = ?cfg.vips,
        quic_server_ids = ?cfg.quic.iter().map(|q| format!("{}={}", q.vip, q.quic_server_id)).collect::<Vec<_>>(),
        interfaces = ?attached.iter().map(|(n, _, m)| format!("{n} ({m})")).collect::<Vec<_>>(),
        "decapsulation ready"
    );
    let live = Arc::new(Live {
        dp: Mutex::new(dp),
        cfg: cfg.clone(),
        started: Instant::now(),
        refused: AtomicU64::new(0),
    });
    let (stop_tx, stop_rx) = tokio::sync::watch::channel(false);
    let metrics_task = metrics_listener.map(|listener| {
        tracing::info!(addr = ?listener.local_addr().ok(), "metrics listening");
        let live = live.clone();
        let mut rx = stop_rx.clone();
        tokio::spawn(async move {
            let page = {
                let live = live.clone();
                move || {
                    let live = live.clone();
                    async move { live.page() }
                }
            };
            crate::metrics::serve_page(listener, &live.refused, page, async move {
                let _ = rx.wait_for(|s| *s).await;
            })
            .await
        })
    });
    let mut term = tokio::signal::unix::signal(SignalKind::terminate())?;
    let mut int = tokio::signal::unix::signal(SignalKind::interrupt())?;
    let mut hup = tokio::signal::unix::signal(SignalKind::hangup())?;
    notify::ready("decapsulating");
    let mut served = (cfg.vips.clone(), cfg.quic.clone());
    loop {
        tokio::select! {
            _ = term.recv() => break,
            _ = int.recv() => break,
            _ = hup.recv() => served = reload(path, &cfg, served),
        }
    }
    let vips = served.0;
    tracing::info!("stopping");
    notify::stopping();
    let _ = stop_tx.send(true);
    if let Some(t) = metrics_task {
        match t.await {
            Ok(Err(e)) => tracing::error!(error = %format!("{e:#}"), "metrics endpoint failed"),
            Err(e) => tracing::error!(error = %e, "metrics task failed"),
            Ok(Ok(())) => {}
        }
    }
    drop(live);
    if cfg.keep_dataplane_on_exit {
        tracing::info!(pin_dir = %cfg.bpffs.display(), "keeping decapsulation and the VIPs (keep_dataplane_on_exit)");
    } else {
        remove_pinned(&cfg.bpffs)?;
        remove_vips(&vips);
        tracing::info!("decapsulation detached and unpinned, VIPs taken off lo");
    }
    Ok(())
}

/// SIGHUP: applies the file's VIPs (added ones go up, removed ones come off `lo`) and their
/// QUIC server IDs (the QUIC file is rewritten); a bad file, or one that changes anything
/// else (which needs a restart), changes nothing. Returns the VIPs and server IDs now served.
fn reload(
    path: &Path,
    running: &HostConfig,
    (vips, quic): (Vec<IpAddr>, Vec<config::QuicServer>),
) -> (Vec<IpAddr>, Vec<config::QuicServer>) {
    let new = match config::load(path) {
        Ok(c) => c,
        Err(e) => {
            tracing::error!(error = %e, "reload: configuration rejected, nothing changed");
            return (vips, quic);
        }
    };
    let same_rest = HostConfig {
        vips: running.vips.clone(),
        quic: running.quic.clone(),
        ..new.clone()
    } == *running;
    if !same_rest {
        tracing::error!(
            "reload: only `vips` changes on SIGHUP; restart for the other keys (nothing changed)"
        );
        return (vips, quic);
    }
    if let Err(e) = write_quic_file(&new.quic_file, &new.quic) {
        tracing::error!(error = %format!("{e:#}"), "reload: nothing changed");
        return (vips, quic);
    }
    if let Err(e) = add_vips(&new.vips) {
        tracing::error!(error = %format!("{e:#}"), "reload: adding VIPs failed");
        // The file names what is served: the previous IDs.
        let _ = write_quic_file(&new.quic_file, &quic);
        return (vips, quic);
    }
    let gone: Vec<IpAddr> = vips.into_iter().filter(|v| !new.vips.contains(v)).collect();
    remove_vips(&gone);
    tracing::info!(vips = ?new.vips, "configuration reloaded");
    (new.vips, new.quic)
}

/// `sluice backend-host check`: validates the file and reports the DSR findings, reading the
/// host and changing nothing. Fails when the file is refused or a finding is made.
pub fn check(path: &Path, json: bool, out: &mut dyn Write) -> Result<()> {
    let cfg = config::load(path)?;
    let findings = dsr::evaluate(&cfg, &dsr::read_facts(&cfg));
    if json {
        writeln!(
            out,
            "{}",
            serde_json::to_string_pretty(&serde_json::json!({
                "config": path.display().to_string(),
                "findings": findings,
            }))?
        )?;
    } else {
        writeln!(
            out,
            "{}: valid ({} interface(s), {} VIP(s))",
            path.display(),
            cfg.interfaces.len(),
            cfg.vips.len()
        )?;
        for f in &findings {
            writeln!(
                out,
                "DSR problem ({}): {}\n  fix: {}",
                f.check, f.problem, f.fix
            )?;
        }
    }
    if !findings.is_empty() {
        bail!(
            "{} problem(s) would break direct server return on this host",
            findings.len()
        );
    }
    Ok(())
}

/// `sluice backend-host status`: what is attached and pinned, the VIPs on `lo`, the counters
/// and the DSR findings (root: it opens the pinned maps).
pub fn status(path: &Path, json: bool, out: &mut dyn Write) -> Result<()> {
    let cfg = config::load(path)?;
    let findings = dsr::evaluate(&cfg, &dsr::read_facts(&cfg));
    let links: Vec<(String, bool)> = cfg
        .interfaces
        .iter()
        .map(|i| {
            let pinned = cfg.bpffs.join(format!("link_{}", i.name)).exists();
            (i.name.clone(), pinned)
        })
        .collect();
    let counters = if cfg.bpffs.join(maps::STATS).exists() {
        Some(read_pinned_counters(&cfg.bpffs)?)
    } else {
        None
    };
    let on_lo = vips_on_lo()?;
    if json {
        let v = serde_json::json!({
            "pin_dir": cfg.bpffs.display().to_string(),
            "attached": links.iter().map(|(n, p)| serde_json::json!({"interface": n, "pinned_link": p})).collect::<Vec<_>>(),
            "vips": cfg.vips.iter().map(|v| serde_json::json!({"vip": v, "on_lo": on_lo.contains(v)})).collect::<Vec<_>>(),
            "quic": cfg.quic,
            "quic_file": cfg.quic_file.display().to_string(),
            "counters": counters.as_ref().map(|c| c.iter().map(|(k, v)| (k.to_string(), serde_json::Value::from(*v))).collect::<serde_json::Map<_, _>>()),
            "findings": findings,
        });
        writeln!(out, "{}", serde_json::to_string_pretty(&v)?)?;
        return Ok(());
    }
    writeln!(out, "pin directory  {}", cfg.bpffs.display())?;
    for (n, p) in &links {
        let state = if *p {
            "attached (pinned link)"
        } else {
            "not attached"
        };
        writeln!(out, "interface      {n}: {state}")?;
    }
    for v in &cfg.vips {
        let state = if on_lo.contains(v) {
            "on lo"
        } else {
            "NOT on lo"
        };
        writeln!(out, "vip            {v}: {state}")?;
    }
    for q in &cfg.quic {
        writeln!(
            out,
            "quic           {}: server ID {} ({} octets, config rotation {})",
            q.vip, q.quic_server_id, q.quic_server_id_len, q.quic_config_rotation
        )?;
    }
    if !cfg.quic.is_empty() {
        writeln!(out, "quic file      {}", cfg.quic_file.display())?;
    }
    match &counters {
        Some(c) => {
            for (k, v) in c {
                writeln!(out, "{k:<22} {v}")?;
            }
        }
        None => writeln!(out, "counters       none (nothing pinned: not running)")?,
    }
    for f in &findings {
        writeln!(
            out,
            "DSR problem ({}): {}\n  fix: {}",
            f.check, f.problem, f.fix
        )?;
    }
    Ok(())
}

/// The decapsulation counters from a pinned STATS map (while the daemon runs or after it).
fn read_pinned_counters(dir: &Path) -> Result<Vec<(&'static str, u64)>> {
    use aya::maps::{MapData, PerCpuArray};
    let data = MapData::from_pin(dir.join(maps::STATS))
        .with_context(|| format!("opening {}/STATS (are you root?)", dir.display()))?;
    let a: PerCpuArray<MapData, u64> = PerCpuArray::try_from(aya::maps::Map::PerCpuArray(data))?;
    DECAP_COUNTERS
        .iter()
        .map(|&c| {
            let v = a
                .get(&c.0, 0)
                .map_err(|e| anyhow!("reading counter {}: {e}", c.0))?;
            Ok((c.name(), v.iter().sum()))
        })
        .collect()
}

/// The addresses on `lo` (`ip -j addr show dev lo`).
fn vips_on_lo() -> Result<Vec<IpAddr>> {
    let out = Command::new("ip")
        .args(["-j", "addr", "show", "dev", "lo"])
        .output()
        .context("running `ip` (iproute2 must be installed)")?;
    let v: serde_json::Value =
        serde_json::from_slice(&out.stdout).context("reading `ip -j` output")?;
    Ok(v.as_array()
        .into_iter()
        .flatten()
        .flat_map(|l| l["addr_info"].as_array().cloned().unwrap_or_default())
        .filter_map(|a| a["local"].as_str().and_then(|s| s.parse().ok()))
        .collect())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_page_has_the_decap_counters_and_every_check() {
        let cfg = config::parse(
            "interfaces = [{ name = \"eth0\" }]\nvips = [\"10.0.0.1\"]\n",
            "t",
        )
        .unwrap();
        let findings = vec![Finding {
            check: "rp_filter",
            interface: "eth0".into(),
            problem: "p".into(),
            fix: "f".into(),
        }];
        let page = render(
            &[
                (stat::DECAP_OK, 7),
                (stat::DECAP_PASS_NOT_ENCAP, 3),
                (stat::DECAP_PASS_BAD_LEN, 0),
            ],
            0,
            &cfg,
            &findings,
            1.5,
        );
        for line in [
            r#"sluice_dataplane_events_total{event="decap_ok"} 7"#,
            r#"sluice_dataplane_passes_total{reason="decap_not_encap"} 3"#,
            r#"sluice_dataplane_passes_total{reason="decap_bad_len"} 0"#,
            r#"sluice_backend_host_dsr_problems{check="rp_filter"} 1"#,
            r#"sluice_backend_host_dsr_problems{check="mtu"} 0"#,
            "sluice_backend_host_vips 1",
            "sluice_uptime_seconds 1.5",
        ] {
            assert!(page.lines().any(|l| l == line), "{line} missing:\n{page}");
        }
    }

    #[test]
    fn quic_server_ids_are_on_the_page_and_in_the_file() {
        let cfg = config::parse(
            "interfaces = [{ name = \"eth0\" }]\n\
             vips = [\"10.0.0.1\", { address = \"10.0.0.2\", quic_server_id = \"0a01\" }]\n",
            "t",
        )
        .unwrap();
        let page = render(&[], 0, &cfg, &[], 1.0);
        assert!(
            page.lines().any(|l| l
                == r#"sluice_backend_host_quic_server_id_info{vip="10.0.0.2",quic_server_id="0a01"} 1"#),
            "{page}"
        );
        let v: serde_json::Value = serde_json::from_str(&quic_file_text(&cfg.quic)).unwrap();
        assert_eq!(
            v,
            serde_json::json!({"vips": [{
                "vip": "10.0.0.2",
                "quic_server_id": "0a01",
                "quic_server_id_len": 2,
                "quic_config_rotation": 0,
            }]})
        );
        let dir = crate::test_dir::TestDir::new("quic-file");
        let path = dir.join("sub/quic.json");
        write_quic_file(&path, &cfg.quic).unwrap();
        use std::os::unix::fs::PermissionsExt;
        let mode = std::fs::metadata(&path).unwrap().permissions().mode() & 0o777;
        assert_eq!(mode, 0o644);
        assert_eq!(
            std::fs::read_to_string(&path).unwrap(),
            quic_file_text(&cfg.quic)
        );
        write_quic_file(&path, &[]).unwrap();
        assert!(!dir.join("other.json").exists());
        write_quic_file(&dir.join("other.json"), &[]).unwrap();
        assert!(!dir.join("other.json").exists(), "no server IDs, no file");
        assert_eq!(
            std::fs::read_to_string(&path).unwrap(),
            "{\n  \"vips\": []\n}\n"
        );
    }

    #[test]
    fn vips_take_a_host_prefix() {
        assert_eq!(host_prefix(&"10.0.0.1".parse().unwrap()), "10.0.0.1/32");
        assert_eq!(host_prefix(&"fd00::1".parse().unwrap()), "fd00::1/128");
    }
}
