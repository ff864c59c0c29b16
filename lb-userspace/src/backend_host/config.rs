//! The backend host's configuration file (`/etc/sluice/backend-host.toml`): which interfaces
//! decapsulate, which VIPs this host serves, where the data plane is pinned, and metrics.

use std::{
    collections::BTreeSet,
    net::{IpAddr, SocketAddr},
    path::{Path, PathBuf},
};

use serde::Deserialize;

use crate::{
    check::Refused,
    config::{AttachMode, InterfaceConfig, LogFormat, LogLevel},
};

/// A validated backend-host configuration.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct HostConfig {
    /// Interfaces that receive the LB's encapsulated packets; `sluice_decap` is attached to each.
    pub interfaces: Vec<InterfaceConfig>,
    /// The VIPs this host serves: put on `lo` at start (the decapsulated packets are addressed
    /// to them).
    pub vips: Vec<IpAddr>,
    /// bpffs directory of the pinned maps and links. Absolute.
    pub bpffs: PathBuf,
    /// On SIGTERM, leave the decapsulation attached and the VIPs on `lo` (as `kill -9` does).
    pub keep_dataplane_on_exit: bool,
    /// The largest packet clients send (their path MTU), for the MTU headroom check.
    pub client_mtu: u32,
    /// `None`: no metrics endpoint.
    pub metrics: Option<SocketAddr>,
    pub log_format: LogFormat,
    pub log_level: LogLevel,
}

pub const DEFAULT_PATH: &str = "/etc/sluice/backend-host.toml";
pub const DEFAULT_BPFFS: &str = "/sys/fs/bpf/sluice-backend";
pub const DEFAULT_METRICS: &str = "127.0.0.1:9465";

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct Raw {
    interfaces: Vec<RawInterface>,
    #[serde(default)]
    vips: Vec<String>,
    bpffs: Option<String>,
    #[serde(default)]
    keep_dataplane_on_exit: bool,
    client_mtu: Option<u32>,
    #[serde(default)]
    metrics: RawMetrics,
    log_format: Option<String>,
    log_level: Option<String>,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct RawInterface {
    name: String,
    mode: Option<String>,
}

#[derive(Deserialize, Default)]
#[serde(deny_unknown_fields)]
struct RawMetrics {
    enabled: Option<bool>,
    listen: Option<String>,
}

/// Reads and validates the file at `path`.
pub fn load(path: &Path) -> Result<HostConfig, Refused> {
    let origin = path.display().to_string();
    let text = std::fs::read_to_string(path).map_err(|e| {
        Refused(vec![format!(
            "{origin}: cannot read the configuration: {e}"
        )])
    })?;
    parse(&text, &origin)
}

/// Parses and validates `text`; every problem is one line prefixed with `origin`.
pub fn parse(text: &str, origin: &str) -> Result<HostConfig, Refused> {
    let raw: Raw = toml::from_str(text).map_err(|e| {
        let at = e
            .span()
            .map(|s| {
                let before = &text[..s.start.min(text.len())];
                let line = before.matches('\n').count() + 1;
                let col = before.len() - before.rfind('\n').map_or(0, |i| i + 1) + 1;
                format!(":{line}:{col}")
            })
            .unwrap_or_default();
        Refused(vec![format!("{origin}{at}: {}", e.message())])
    })?;
    let mut problems = Vec::new();
    let mut bad = |key: &str, msg: String| problems.push(format!("{origin}: {key}: {msg}"));

    let mut interfaces = Vec::new();
    let mut names = BTreeSet::new();
    if raw.interfaces.is_empty() {
        bad(
            "interfaces",
            "at least one interface is needed (the one the LB's encapsulated packets arrive on)"
                .into(),
        );
    }
    for (i, itf) in raw.interfaces.iter().enumerate() {
        let key = format!("interfaces[{i}]");
        let n = &itf.name;
        if n.is_empty()
            || n.len() > 15
            || n == "."
            || n == ".."
            || n.contains(['/', ':'])
            || n.contains(char::is_whitespace)
        {
            bad(
                &format!("{key}.name"),
                format!("{n:?} is not a Linux interface name (1-15 bytes, no '/', ':' or spaces)"),
            );
        }
        if !names.insert(n.clone()) {
            bad(&format!("{key}.name"), format!("{n:?} is listed twice"));
        }
        let mode = match itf.mode.as_deref().map(str::parse::<AttachMode>) {
            None => AttachMode::Auto,
            Some(Ok(m)) => m,
            Some(Err(e)) => {
                bad(&format!("{key}.mode"), e.to_string());
                AttachMode::Auto
            }
        };
        interfaces.push(InterfaceConfig {
            name: n.clone(),
            mode,
        });
    }

    let mut vips = Vec::new();
    for (i, v) in raw.vips.iter().enumerate() {
        match v.parse::<IpAddr>() {
            Ok(a) if a.is_unspecified() || a.is_multicast() || a.is_loopback() => bad(
                &format!("vips[{i}]"),
                format!("{a} cannot be a VIP (unspecified, multicast or loopback)"),
            ),
            Ok(a) if vips.contains(&a) => {
                bad(&format!("vips[{i}]"), format!("{a} is listed twice"))
            }
            Ok(a) => vips.push(a),
            Err(_) => bad(
                &format!("vips[{i}]"),
                format!("{v:?} is not an IP address (a VIP is an address, e.g. \"10.0.0.1\")"),
            ),
        }
    }

    let bpffs = PathBuf::from(raw.bpffs.as_deref().unwrap_or(DEFAULT_BPFFS));
    if !bpffs.is_absolute() {
        bad(
            "bpffs",
            format!("{} is not an absolute path", bpffs.display()),
        );
    }

    let client_mtu = raw.client_mtu.unwrap_or(1500);
    if !(576..=65535).contains(&client_mtu) {
        bad(
            "client_mtu",
            format!("{client_mtu} is out of range; allowed: 576 to 65535"),
        );
    }

    let metrics = if raw.metrics.enabled.unwrap_or(true) {
        let listen = raw.metrics.listen.as_deref().unwrap_or(DEFAULT_METRICS);
        match listen.parse::<SocketAddr>() {
            Ok(a) if a.port() != 0 => Some(a),
            _ => {
                bad(
                    "metrics.listen",
                    format!("{listen:?} is not ADDRESS:PORT with a port other than 0"),
                );
                None
            }
        }
    } else {
        None
    };

    let log_format = match raw.log_format.as_deref().map(str::parse::<LogFormat>) {
        None => LogFormat::Human,
        Some(Ok(f)) => f,
        Some(Err(e)) => {
            bad("log_format", e.to_string());
            LogFormat::Human
        }
    };
    let log_level = match raw.log_level.as_deref().map(str::parse::<LogLevel>) {
        None => LogLevel::Info,
        Some(Ok(l)) => l,
        Some(Err(e)) => {
            bad("log_level", e.to_string());
            LogLevel::Info
        }
    };

    if !problems.is_empty() {
        return Err(Refused(problems));
    }
    Ok(HostConfig {
        interfaces,
        vips,
        bpffs,
        keep_dataplane_on_exit: raw.keep_dataplane_on_exit,
        client_mtu,
        metrics,
        log_format,
        log_level,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    const EXAMPLE: &str = include_str!("../../../packaging/backend-host.toml");

    #[test]
    fn the_example_configuration_parses() {
        let c = parse(EXAMPLE, "backend-host.toml").unwrap();
        assert_eq!(c.interfaces[0].name, "eth0");
        assert_eq!(c.interfaces[0].mode, AttachMode::Auto);
        assert!(c.vips.is_empty(), "the example serves no VIP until edited");
        assert_eq!(c.bpffs, PathBuf::from(DEFAULT_BPFFS));
        assert_eq!(c.metrics, Some(DEFAULT_METRICS.parse().unwrap()));
    }

    #[test]
    fn every_problem_is_one_line_naming_its_key() {
        let e = parse(
            r#"
interfaces = [{ name = "eth0", mode = "fast" }, { name = "eth0" }]
vips = ["10.0.0.1", "nope", "127.0.0.1"]
bpffs = "relative"
client_mtu = 100
metrics = { listen = "localhost" }
log_level = "loud"
"#,
            "h.toml",
        )
        .unwrap_err();
        assert_eq!(
            e.0,
            [
                r#"h.toml: interfaces[0].mode: "fast" is not recognised; allowed: "auto", "native", "generic""#,
                r#"h.toml: interfaces[1].name: "eth0" is listed twice"#,
                r#"h.toml: vips[1]: "nope" is not an IP address (a VIP is an address, e.g. "10.0.0.1")"#,
                "h.toml: vips[2]: 127.0.0.1 cannot be a VIP (unspecified, multicast or loopback)",
                "h.toml: bpffs: relative is not an absolute path",
                "h.toml: client_mtu: 100 is out of range; allowed: 576 to 65535",
                r#"h.toml: metrics.listen: "localhost" is not ADDRESS:PORT with a port other than 0"#,
                r#"h.toml: log_level: "loud" is not recognised; allowed: "error", "warn", "info", "debug", "trace""#,
            ]
        );
    }

    #[test]
    fn an_unknown_key_is_refused_with_its_position() {
        let e = parse("interfaces = []\nvip = []\n", "h.toml").unwrap_err();
        assert_eq!(e.0.len(), 1);
        assert!(e.0[0].starts_with("h.toml:2:1: unknown field `vip`"), "{e}");
    }
}
