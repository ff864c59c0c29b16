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
    config::{rules, AttachMode, InterfaceConfig, LogFormat, LogLevel},
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
    /// The QUIC-LB server IDs of this host, one per VIP that has one (a VIP of `vips` with
    /// `quic = "cid"` on the load balancers), in file order.
    pub quic: Vec<QuicServer>,
    /// Where the QUIC server IDs are written for the host's QUIC servers (JSON). Absolute.
    pub quic_file: PathBuf,
    /// `None`: no metrics endpoint.
    pub metrics: Option<SocketAddr>,
    pub log_format: LogFormat,
    pub log_level: LogLevel,
}

/// This host's QUIC-LB server ID for one VIP: what its QUIC servers put in the connection IDs
/// they choose, so the load balancers route those connections here.
#[derive(Clone, Debug, PartialEq, Eq, serde::Serialize)]
pub struct QuicServer {
    pub vip: IpAddr,
    /// Lowercase hex, `2 * quic_server_id_len` digits, not all zero.
    pub quic_server_id: String,
    /// Octets of the server ID, 1..=8: the load balancers' `quic_server_id_len` of the VIP.
    pub quic_server_id_len: u8,
    /// The config rotation codepoint, 0..=6: the load balancers' `quic_config_rotation`.
    pub quic_config_rotation: u8,
}

pub const DEFAULT_PATH: &str = "/etc/sluice/backend-host.toml";
pub const DEFAULT_QUIC_FILE: &str = "/run/sluice-backend/quic.json";
pub const DEFAULT_BPFFS: &str = "/sys/fs/bpf/sluice-backend";
pub const DEFAULT_METRICS: &str = "127.0.0.1:9465";

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct Raw {
    interfaces: Vec<RawInterface>,
    #[serde(default)]
    vips: Vec<RawVip>,
    bpffs: Option<String>,
    quic_file: Option<String>,
    #[serde(default)]
    keep_dataplane_on_exit: bool,
    client_mtu: Option<u32>,
    #[serde(default)]
    metrics: RawMetrics,
    log_format: Option<String>,
    log_level: Option<String>,
}

/// A VIP: its address, or a table with its address and this host's QUIC-LB server ID.
enum RawVip {
    Address(String),
    Quic(RawQuicVip),
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct RawQuicVip {
    address: String,
    quic_server_id: Option<String>,
    quic_server_id_len: Option<i64>,
    quic_config_rotation: Option<i64>,
}

impl<'de> Deserialize<'de> for RawVip {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct V;
        impl<'de> serde::de::Visitor<'de> for V {
            type Value = RawVip;
            fn expecting(&self, f: &mut std::fmt::Formatter) -> std::fmt::Result {
                f.write_str(
                    "an address, or a table { address = \"...\", quic_server_id = \"...\" }",
                )
            }
            fn visit_str<E>(self, v: &str) -> Result<RawVip, E> {
                Ok(RawVip::Address(v.to_owned()))
            }
            fn visit_map<A: serde::de::MapAccess<'de>>(self, m: A) -> Result<RawVip, A::Error> {
                RawQuicVip::deserialize(serde::de::value::MapAccessDeserializer::new(m))
                    .map(RawVip::Quic)
            }
        }
        d.deserialize_any(V)
    }
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
    let mut p = Problems {
        origin,
        list: Vec::new(),
    };
    let interfaces = interfaces(&raw.interfaces, &mut p);
    let (vips, quic) = vips(&raw.vips, &mut p);

    let bpffs = PathBuf::from(raw.bpffs.as_deref().unwrap_or(DEFAULT_BPFFS));
    if !bpffs.is_absolute() {
        p.bad(
            "bpffs",
            format!("{} is not an absolute path", bpffs.display()),
        );
    }

    let quic_file = PathBuf::from(raw.quic_file.as_deref().unwrap_or(DEFAULT_QUIC_FILE));
    if !quic_file.is_absolute() || quic_file.file_name().is_none() {
        p.bad(
            "quic_file",
            format!("{} is not an absolute path of a file", quic_file.display()),
        );
    }

    let client_mtu = raw.client_mtu.unwrap_or(1500);
    if !(576..=65535).contains(&client_mtu) {
        p.bad(
            "client_mtu",
            format!("{client_mtu} is out of range; allowed: 576 to 65535"),
        );
    }

    let metrics = if raw.metrics.enabled.unwrap_or(true) {
        let listen = raw.metrics.listen.as_deref().unwrap_or(DEFAULT_METRICS);
        match listen.parse::<SocketAddr>() {
            Ok(a) if a.port() != 0 => Some(a),
            _ => {
                p.bad(
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
            p.bad("log_format", e.to_string());
            LogFormat::Human
        }
    };
    let log_level = match raw.log_level.as_deref().map(str::parse::<LogLevel>) {
        None => LogLevel::Info,
        Some(Ok(l)) => l,
        Some(Err(e)) => {
            p.bad("log_level", e.to_string());
            LogLevel::Info
        }
    };

    if !p.list.is_empty() {
        return Err(Refused(p.list));
    }
    Ok(HostConfig {
        interfaces,
        vips,
        quic,
        quic_file,
        bpffs,
        keep_dataplane_on_exit: raw.keep_dataplane_on_exit,
        client_mtu,
        metrics,
        log_format,
        log_level,
    })
}

/// The problems found in one file, each a line prefixed with its origin and key.
struct Problems<'a> {
    origin: &'a str,
    list: Vec<String>,
}

impl Problems<'_> {
    fn bad(&mut self, key: &str, msg: String) {
        self.list.push(format!("{}: {key}: {msg}", self.origin));
    }
}

fn interfaces(raw: &[RawInterface], p: &mut Problems) -> Vec<InterfaceConfig> {
    let mut interfaces = Vec::new();
    let mut names = BTreeSet::new();
    if raw.is_empty() {
        p.bad(
            "interfaces",
            "at least one interface is needed (the one the LB's encapsulated packets arrive on)"
                .into(),
        );
    }
    for (i, itf) in raw.iter().enumerate() {
        let key = format!("interfaces[{i}]");
        let n = &itf.name;
        if n.is_empty()
            || n.len() > 15
            || n == "."
            || n == ".."
            || n.contains(['/', ':'])
            || n.contains(char::is_whitespace)
        {
            p.bad(
                &format!("{key}.name"),
                format!("{n:?} is not a Linux interface name (1-15 bytes, no '/', ':' or spaces)"),
            );
        }
        if !names.insert(n.clone()) {
            p.bad(&format!("{key}.name"), format!("{n:?} is listed twice"));
        }
        let mode = match itf.mode.as_deref().map(str::parse::<AttachMode>) {
            None => AttachMode::Auto,
            Some(Ok(m)) => m,
            Some(Err(e)) => {
                p.bad(&format!("{key}.mode"), e.to_string());
                AttachMode::Auto
            }
        };
        interfaces.push(InterfaceConfig {
            name: n.clone(),
            mode,
        });
    }
    interfaces
}

/// The VIP addresses, and this host's QUIC server IDs of those written as tables.
fn vips(raw: &[RawVip], p: &mut Problems) -> (Vec<IpAddr>, Vec<QuicServer>) {
    let mut vips = Vec::new();
    let mut quic = Vec::new();
    for (i, v) in raw.iter().enumerate() {
        let v = match v {
            RawVip::Address(a) => a,
            RawVip::Quic(q) => {
                quic.extend(quic_server(&format!("vips[{i}]"), q, p));
                &q.address
            }
        };
        match v.parse::<IpAddr>() {
            Ok(a) if a.is_unspecified() || a.is_multicast() || a.is_loopback() => p.bad(
                &format!("vips[{i}]"),
                format!("{a} cannot be a VIP (unspecified, multicast or loopback)"),
            ),
            Ok(a) if vips.contains(&a) => {
                p.bad(&format!("vips[{i}]"), format!("{a} is listed twice"))
            }
            Ok(a) => vips.push(a),
            Err(_) => p.bad(
                &format!("vips[{i}]"),
                format!("{v:?} is not an IP address (a VIP is an address, e.g. \"10.0.0.1\")"),
            ),
        }
    }
    (vips, quic)
}

/// A VIP table's QUIC server ID, checked by the rules the LB's configuration follows; `None`
/// when something is wrong (and said in `p`) or the address is (its problem is said apart).
fn quic_server(key: &str, q: &RawQuicVip, p: &mut Problems) -> Option<QuicServer> {
    let len = match q.quic_server_id_len {
        None => Some(rules::QUIC_SERVER_ID_LEN_DEFAULT),
        Some(n) => rules::quic_server_id_len(n)
            .map_err(|e| p.bad(&format!("{key}.quic_server_id_len"), e))
            .ok(),
    };
    let rotation = match q.quic_config_rotation {
        None => Some(0),
        Some(n) => rules::quic_config_rotation(n)
            .map_err(|e| p.bad(&format!("{key}.quic_config_rotation"), e))
            .ok(),
    };
    let id = match (&q.quic_server_id, len) {
        (None, _) => {
            p.bad(
                &format!("{key}.quic_server_id"),
                "missing (required in a VIP table); allowed: this host's server ID \
                 for the VIP in hex, e.g. \"0a01\" (write the VIP as a plain \
                 address when it has none)"
                    .into(),
            );
            None
        }
        (Some(s), Some(len)) => rules::quic_server_id(s, len)
            .map_err(|e| p.bad(&format!("{key}.quic_server_id"), e))
            .ok()
            .map(|_| s.to_ascii_lowercase()),
        (Some(_), None) => None,
    };
    Some(QuicServer {
        vip: q.address.parse::<IpAddr>().ok()?,
        quic_server_id: id?,
        quic_server_id_len: len?,
        quic_config_rotation: rotation?,
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
    fn a_vip_table_carries_this_hosts_quic_server_id() {
        let c = parse(
            r#"
interfaces = [{ name = "eth0" }]
vips = [
  "10.0.0.1",
  { address = "10.0.0.2", quic_server_id = "0A01" },
  { address = "fd00::2", quic_server_id = "000a01", quic_server_id_len = 3, quic_config_rotation = 6 },
]
quic_file = "/run/q/quic.json"
"#,
            "h.toml",
        )
        .unwrap();
        let ip = |s: &str| s.parse::<IpAddr>().unwrap();
        assert_eq!(c.vips, [ip("10.0.0.1"), ip("10.0.0.2"), ip("fd00::2")]);
        assert_eq!(
            c.quic,
            [
                QuicServer {
                    vip: ip("10.0.0.2"),
                    quic_server_id: "0a01".into(),
                    quic_server_id_len: 2,
                    quic_config_rotation: 0,
                },
                QuicServer {
                    vip: ip("fd00::2"),
                    quic_server_id: "000a01".into(),
                    quic_server_id_len: 3,
                    quic_config_rotation: 6,
                },
            ]
        );
        assert_eq!(c.quic_file, PathBuf::from("/run/q/quic.json"));
        let e = parse(
            r#"
interfaces = [{ name = "eth0" }]
vips = [
  { address = "10.0.0.2", quic_server_id = "0000" },
  { address = "10.0.0.3", quic_server_id = "0a01", quic_server_id_len = 9 },
  { address = "10.0.0.4", quic_server_id = "0a01", quic_config_rotation = 7 },
  { address = "10.0.0.5" },
  { address = "10.0.0.6", quic_server_id = "a01" },
]
quic_file = "quic.json"
"#,
            "h.toml",
        )
        .unwrap_err();
        assert_eq!(
            e.0,
            [
                r#"h.toml: vips[0].quic_server_id: "0000" is all zero; allowed: 4 hex digits (quic_server_id_len = 2 octets), not all zero, unique within the VIP, e.g. "0a01""#,
                "h.toml: vips[1].quic_server_id_len: 9 is out of range; allowed: 1..=8 octets",
                r#"h.toml: vips[2].quic_config_rotation: 7 is QUIC-LB's reserved "unroutable" codepoint; allowed: 0..=6"#,
                r#"h.toml: vips[3].quic_server_id: missing (required in a VIP table); allowed: this host's server ID for the VIP in hex, e.g. "0a01" (write the VIP as a plain address when it has none)"#,
                r#"h.toml: vips[4].quic_server_id: "a01" is not 2 octets of hex; allowed: 4 hex digits (quic_server_id_len = 2 octets), not all zero, unique within the VIP, e.g. "0a01""#,
                "h.toml: quic_file: quic.json is not an absolute path of a file",
            ]
        );
        let e = parse(
            "interfaces = [{ name = \"eth0\" }]\nvips = [{ address = \"10.0.0.2\", quic_id = \"0a01\" }]\n",
            "h.toml",
        )
        .unwrap_err();
        assert!(e.0[0].contains("unknown field `quic_id`"), "{e}");
    }

    #[test]
    fn an_unknown_key_is_refused_with_its_position() {
        let e = parse("interfaces = []\nvip = []\n", "h.toml").unwrap_err();
        assert_eq!(e.0.len(), 1);
        assert!(e.0[0].starts_with("h.toml:2:1: unknown field `vip`"), "{e}");
    }
}
