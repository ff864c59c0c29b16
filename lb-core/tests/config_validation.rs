//! The configuration's contract: every validation rule has a case here asserting the exact
//! messages it produces (file, line:column, key path, value and what is allowed), the
//! example configurations in `configs/` parse, and the golden files under
//! `tests/fixtures/config/` pin the output for whole files with several mistakes.
//!
//! To update a golden file after a deliberate message change, run the tests with
//! `SLUICE_BLESS=1` and review the diff.

use std::{
    collections::BTreeMap,
    fs,
    net::IpAddr,
    path::{Path, PathBuf},
    time::Duration,
};

use lb_common::{FAMILY_V4, FAMILY_V6, PROTO_TCP, PROTO_UDP, VIP_F_SRC_HASH};
use sluice_core::config::{
    self, AttachMode, BackendConfig, Cidr, CidrError, Config, DataplaneConfig, EngineKind,
    HashMode, HealthCheck, HttpUrl, InterfaceConfig, Mac, Protocol, RoceConfig, SocketMode,
};

/// Prepended to cases with `base: true`: the smallest valid file with both encapsulation
/// sources, so a case only adds what it tests. Five lines, so their lines start at 6.
const BASE: &str = r#"[dataplane]
interfaces = [{ name = "eth0" }]
hash_seed = 1
encap_source_v4 = "172.16.0.0/16"
encap_source_v6 = "fd00:5:1::/96"
"#;

struct Case {
    name: &'static str,
    /// Prepend `BASE`.
    base: bool,
    text: &'static str,
    /// Every message, in order, as `ConfigError::messages` renders them (origin "t.toml").
    errors: &'static [&'static str],
}

fn text_of(c: &Case) -> String {
    if c.base {
        format!("{BASE}{}", c.text)
    } else {
        c.text.to_owned()
    }
}

fn workspace() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .parent()
        .expect("lb-userspace is in the workspace")
        .to_owned()
}

fn fixtures() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/config")
}

const CASES: &[Case] = &[
    Case {
        name: "syntax error",
        base: false,
        text: r#"
[dataplane
interfaces = []
"#,
        errors: &[
            "t.toml:2:11: TOML syntax error: unclosed table, expected `]`",
        ],
    },
    Case {
        name: "unknown key",
        base: true,
        text: r#"[daemon]
colour = "blue"
"#,
        errors: &[
            "t.toml:7:1: daemon.colour: unknown field `colour`, expected one of `bpffs`, `state_file`, `keep_dataplane_on_exit`, `log_format`, `log_level`",
        ],
    },
    Case {
        name: "unknown section",
        base: true,
        text: r#"[bogus]
x = 1
"#,
        errors: &[
            "t.toml:6:2: bogus: unknown section `bogus`, expected one of daemon, admin, metrics, dataplane, vip, health, telemetry, policy, bgp, fleet, tenant",
        ],
    },
    Case {
        name: "wrong type",
        base: true,
        text: r#"[[vip]]
name = "a"
address = "10.200.0.1"
port = "443"
"#,
        errors: &[
            "t.toml:9:8: vip[0].port: invalid type: string \"443\", expected an integer",
        ],
    },
    Case {
        name: "vip not array",
        base: false,
        text: r#"vip = 3
[dataplane]
interfaces = [{ name = "eth0" }]
hash_seed = 1
"#,
        errors: &[
            "t.toml:1:7: vip: invalid type: integer, expected an array of tables ([[vip]])",
        ],
    },
    Case {
        name: "shape errors in several tables",
        base: true,
        text: r#"[daemon]
log_levl = "info"
[[vip]]
name = "a"
adress = "10.0.0.1"
[[vip]]
name = "b"
address = "10.0.0.2"
port = 1
  [[vip.backend]]
  address = "10.1.0.1"
  wieght = 1
"#,
        errors: &[
            "t.toml:7:1: daemon.log_levl: unknown field `log_levl`, expected one of `bpffs`, `state_file`, `keep_dataplane_on_exit`, `log_format`, `log_level`",
            "t.toml:10:1: vip[0].adress: unknown field `adress`, expected one of `name`, `address`, `port`, `protocol`, `hash`, `affinity_window`, `priority`, `ring_size`, `flow_state`, `inband`, `quic`, `quic_server_id_len`, `quic_config_rotation`, `backend`, `tenant`",
            "t.toml:17:3: vip[1].backend[0].wieght: unknown field `wieght`, expected one of `address`, `weight`, `labels`, `max_sessions`, `dcgm`, `engine`, `roce`, `health`, `quic_server_id`",
        ],
    },
    Case {
        name: "missing dataplane",
        base: false,
        text: r#"# nothing
"#,
        errors: &[
            "t.toml: dataplane: missing (required); allowed: a [dataplane] table with at least `interfaces` and `hash_seed`",
        ],
    },
    Case {
        name: "missing dataplane keys",
        base: false,
        text: r#"[dataplane]
"#,
        errors: &[
            "t.toml:1:1: dataplane.interfaces: missing (required); allowed: a list of interfaces such as [{ name = \"eth0\", mode = \"auto\" }]",
            "t.toml:1:1: dataplane.hash_seed: missing (required); allowed: an integer 0..=4294967295, the same on every LB host, e.g. 0x5eed",
        ],
    },
    Case {
        name: "empty interfaces",
        base: false,
        text: r#"[dataplane]
interfaces = []
hash_seed = 1
"#,
        errors: &[
            "t.toml:2:14: dataplane.interfaces: [] is empty; allowed: at least one interface, e.g. [{ name = \"eth0\" }]",
        ],
    },
    Case {
        name: "bad interface name",
        base: false,
        text: r#"[dataplane]
interfaces = [{ name = "eth0/1" }, { name = "averyveryverylongname" }, { name = "" }]
hash_seed = 1
"#,
        errors: &[
            "t.toml:2:24: dataplane.interfaces[0].name: \"eth0/1\" is not a valid interface name; allowed: 1 to 15 bytes without \"/\", \":\" or whitespace, other than \".\" and \"..\"",
            "t.toml:2:45: dataplane.interfaces[1].name: \"averyveryverylongname\" is not a valid interface name; allowed: 1 to 15 bytes without \"/\", \":\" or whitespace, other than \".\" and \"..\"",
            "t.toml:2:81: dataplane.interfaces[2].name: \"\" is not a valid interface name; allowed: 1 to 15 bytes without \"/\", \":\" or whitespace, other than \".\" and \"..\"",
        ],
    },
    Case {
        name: "duplicate interface",
        base: false,
        text: r#"[dataplane]
interfaces = [{ name = "eth0" }, { name = "eth1" }, { name = "eth0" }]
hash_seed = 1
"#,
        errors: &[
            "t.toml:2:62: dataplane.interfaces[2].name: \"eth0\" is already dataplane.interfaces[0]; allowed: each interface once",
        ],
    },
    Case {
        name: "bad interface mode",
        base: false,
        text: r#"[dataplane]
interfaces = [{ name = "eth0", mode = "offload" }]
hash_seed = 1
"#,
        errors: &[
            "t.toml:2:39: dataplane.interfaces[0].mode: \"offload\" is not recognised; allowed: \"auto\", \"native\", \"generic\"",
        ],
    },
    Case {
        name: "hash_seed out of range",
        base: false,
        text: r#"[dataplane]
interfaces = [{ name = "eth0" }]
hash_seed = -1
"#,
        errors: &[
            "t.toml:3:13: dataplane.hash_seed: -1 is out of range; allowed: 0..=4294967295",
        ],
    },
    Case {
        name: "relative path",
        base: true,
        text: r#"[daemon]
bpffs = "sys/fs/bpf/sluice"
state_file = ""
[admin]
audit_log = "audit.jsonl"
"#,
        errors: &[
            "t.toml:7:9: daemon.bpffs: \"sys/fs/bpf/sluice\" is not an absolute path; allowed: a path starting with \"/\"",
            "t.toml:8:14: daemon.state_file: \"\" is not an absolute path; allowed: a path starting with \"/\"",
            "t.toml:10:13: admin.audit_log: \"audit.jsonl\" is not an absolute path; allowed: a path starting with \"/\"",
        ],
    },
    Case {
        name: "bad log level and format",
        base: true,
        text: r#"[daemon]
log_level = "verbose"
log_format = "xml"
"#,
        errors: &[
            "t.toml:7:13: daemon.log_level: \"verbose\" is not recognised; allowed: \"error\", \"warn\", \"info\", \"debug\", \"trace\"",
            "t.toml:8:14: daemon.log_format: \"xml\" is not recognised; allowed: \"human\", \"json\"",
        ],
    },
    Case {
        name: "bad mode",
        base: true,
        text: r#"[admin]
mode = "rw-------"
"#,
        errors: &[
            "t.toml:7:8: admin.mode: \"rw-------\" is not an octal mode; allowed: 3 or 4 octal digits up to \"0777\", e.g. \"0600\"",
        ],
    },
    Case {
        name: "setuid mode",
        base: true,
        text: r#"[admin]
mode = "4600"
"#,
        errors: &[
            "t.toml:7:8: admin.mode: \"4600\" is not an octal mode; allowed: 3 or 4 octal digits up to \"0777\", e.g. \"0600\"",
        ],
    },
    Case {
        name: "world-accessible socket mode",
        base: true,
        text: r#"[admin]
mode = "0604"
group = "sluice"
"#,
        errors: &[
            "t.toml:7:8: admin.mode: \"0604\" lets other users read or write the admin socket; allowed: no read or write bits for others (o+rw), e.g. \"0600\", or \"0660\" with admin.group",
        ],
    },
    Case {
        name: "world-writable socket mode without group",
        base: true,
        text: r#"[admin]
mode = "0666"
"#,
        errors: &[
            "t.toml:7:8: admin.mode: \"0666\" lets other users read or write the admin socket; allowed: no read or write bits for others (o+rw), e.g. \"0600\", or \"0660\" with admin.group",
            "t.toml:7:8: admin.mode: \"0666\" grants group access but admin.group is not set; allowed: no group bits (e.g. \"0600\"), or set admin.group to the group meant to use the socket",
        ],
    },
    Case {
        name: "group bits without group",
        base: true,
        text: r#"[admin]
mode = "0660"
"#,
        errors: &[
            "t.toml:7:8: admin.mode: \"0660\" grants group access but admin.group is not set; allowed: no group bits (e.g. \"0600\"), or set admin.group to the group meant to use the socket",
        ],
    },
    Case {
        name: "integer mode",
        base: true,
        text: r#"[admin]
mode = 0o660
"#,
        errors: &[
            "t.toml:7:8: admin.mode: 0o660 grants group access but admin.group is not set; allowed: no group bits (e.g. \"0600\"), or set admin.group to the group meant to use the socket",
        ],
    },
    Case {
        name: "relative socket",
        base: true,
        text: r#"[admin]
socket = "admin.sock"
"#,
        errors: &[
            "t.toml:7:10: admin.socket: \"admin.sock\" is not an absolute path; allowed: a path starting with \"/\"",
        ],
    },
    Case {
        name: "socket path too long",
        base: true,
        text: r#"[admin]
socket = "/run/sluice/aaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaa.sock"
"#,
        errors: &[
            "t.toml:7:10: admin.socket: \"/run/sluice/aaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaa.sock\" is 117 bytes long; allowed: at most 107 bytes (the kernel's limit for a Unix socket path)",
        ],
    },
    Case {
        name: "bad group",
        base: true,
        text: r#"[admin]
mode = "0660"
group = "-wheel"
"#,
        errors: &[
            "t.toml:8:9: admin.group: \"-wheel\" is not a valid group name; allowed: 1 to 32 of A-Z, a-z, 0-9, \"_\", \".\" and \"-\", not starting with \"-\"",
        ],
    },
    Case {
        name: "bad metrics listen",
        base: true,
        text: r#"[metrics]
listen = "localhost:9464"
"#,
        errors: &[
            "t.toml:7:10: metrics.listen: \"localhost:9464\" is not a socket address; allowed: IP:PORT such as \"127.0.0.1:9464\" or \"[::1]:9464\"",
        ],
    },
    Case {
        name: "metrics port 0",
        base: true,
        text: r#"[metrics]
listen = "127.0.0.1:0"
"#,
        errors: &[
            "t.toml:7:10: metrics.listen: \"127.0.0.1:0\" has port 0; allowed: a port from 1 to 65535",
        ],
    },
    Case {
        name: "bad CIDR prefix v4",
        base: false,
        text: r#"[dataplane]
interfaces = [{ name = "eth0" }]
hash_seed = 1
encap_source_v4 = "172.0.0.0/4"
"#,
        errors: &[
            "t.toml:4:19: dataplane.encap_source_v4: \"172.0.0.0/4\" has prefix length 4; allowed: an IPv4 prefix of length 8..=32, e.g. \"172.16.0.0/16\"",
        ],
    },
    Case {
        name: "bad CIDR prefix v6",
        base: false,
        text: r#"[dataplane]
interfaces = [{ name = "eth0" }]
hash_seed = 1
encap_source_v6 = "fd00:5::/64"
"#,
        errors: &[
            "t.toml:4:19: dataplane.encap_source_v6: \"fd00:5::/64\" has prefix length 64; allowed: an IPv6 prefix of length 96..=128, e.g. \"fd00:5:1::/96\"",
        ],
    },
    Case {
        name: "CIDR wrong family",
        base: false,
        text: r#"[dataplane]
interfaces = [{ name = "eth0" }]
hash_seed = 1
encap_source_v4 = "fd00:5:1::/96"
encap_source_v6 = "172.16.0.0/16"
"#,
        errors: &[
            "t.toml:4:19: dataplane.encap_source_v4: \"fd00:5:1::/96\" is an IPv6 prefix; allowed: an IPv4 prefix of length 8..=32, e.g. \"172.16.0.0/16\"",
            "t.toml:5:19: dataplane.encap_source_v6: \"172.16.0.0/16\" is an IPv4 prefix; allowed: an IPv6 prefix of length 96..=128, e.g. \"fd00:5:1::/96\"",
        ],
    },
    Case {
        name: "CIDR host bits",
        base: false,
        text: r#"[dataplane]
interfaces = [{ name = "eth0" }]
hash_seed = 1
encap_source_v4 = "172.16.1.0/16"
"#,
        errors: &[
            "t.toml:4:19: dataplane.encap_source_v4: \"172.16.1.0/16\" has bits set below the prefix length; allowed: the network address, \"172.16.0.0/16\"",
        ],
    },
    Case {
        name: "CIDR syntax",
        base: false,
        text: r#"[dataplane]
interfaces = [{ name = "eth0" }]
hash_seed = 1
encap_source_v4 = "172.16.0.0"
encap_source_v6 = "fd00::/129"
"#,
        errors: &[
            "t.toml:4:19: dataplane.encap_source_v4: \"172.16.0.0\" is not ADDRESS/LENGTH; allowed: an IPv4 prefix of length 8..=32, e.g. \"172.16.0.0/16\"",
            "t.toml:5:19: dataplane.encap_source_v6: \"fd00::/129\" is not ADDRESS/LENGTH; allowed: an IPv6 prefix of length 96..=128, e.g. \"fd00:5:1::/96\"",
        ],
    },
    Case {
        name: "missing encap source",
        base: false,
        text: r#"[dataplane]
interfaces = [{ name = "eth0" }]
hash_seed = 1
[[vip]]
name = "a"
address = "10.200.0.1"
port = 80
  [[vip.backend]]
  address = "10.1.0.1"
  [[vip.backend]]
  address = "fd00::1"
"#,
        errors: &[
            "t.toml:1:1: dataplane.encap_source_v4: missing, but vip[0].backend[0] (10.1.0.1) is IPv4 and packets to it are encapsulated from this prefix; allowed: an IPv4 prefix such as \"172.16.0.0/16\"",
            "t.toml:1:1: dataplane.encap_source_v6: missing, but vip[0].backend[1] (fd00::1) is IPv6 and packets to it are encapsulated from this prefix; allowed: an IPv6 prefix such as \"fd00:5:1::/96\"",
        ],
    },
    Case {
        name: "bad MAC",
        base: false,
        text: r#"[dataplane]
interfaces = [{ name = "eth0" }]
hash_seed = 1
fallback_mac = "02:00:00:00:01"
"#,
        errors: &[
            "t.toml:4:16: dataplane.fallback_mac: \"02:00:00:00:01\" is not a MAC address; allowed: six hex octets separated by \":\", e.g. \"02:00:00:00:00:01\"",
        ],
    },
    Case {
        name: "multicast MAC",
        base: false,
        text: r#"[dataplane]
interfaces = [{ name = "eth0" }]
hash_seed = 1
fallback_mac = "01:00:5e:00:00:01"
"#,
        errors: &[
            "t.toml:4:16: dataplane.fallback_mac: \"01:00:5e:00:00:01\" is a multicast address; allowed: a unicast MAC (lowest bit of the first octet clear), e.g. \"02:00:00:00:00:01\"",
        ],
    },
    Case {
        name: "zero MAC",
        base: false,
        text: r#"[dataplane]
interfaces = [{ name = "eth0" }]
hash_seed = 1
fallback_mac = "00:00:00:00:00:00"
"#,
        errors: &[
            "t.toml:4:16: dataplane.fallback_mac: \"00:00:00:00:00:00\" is all zero; allowed: a unicast MAC, or no fallback_mac to drop packets whose next hop is unresolved",
        ],
    },
    Case {
        name: "table sizes out of range",
        base: false,
        text: r#"[dataplane]
interfaces = [{ name = "eth0" }]
hash_seed = 1
conn_table_size = 100
affinity_table_size = 33554432
max_vips = 129
flood_new_flows_per_sec = -5
"#,
        errors: &[
            "t.toml:4:19: dataplane.conn_table_size: 100 is out of range; allowed: 1024..=16777216",
            "t.toml:5:23: dataplane.affinity_table_size: 33554432 is out of range; allowed: 1024..=16777216",
            "t.toml:6:12: dataplane.max_vips: 129 is out of range; allowed: 1..=128 (the data plane's MAX_VIPS)",
            "t.toml:7:27: dataplane.flood_new_flows_per_sec: -5 is out of range; allowed: 0..=4294967295 (0 = off)",
        ],
    },
    Case {
        name: "too many VIPs",
        base: false,
        text: r#"[dataplane]
interfaces = [{ name = "eth0" }]
hash_seed = 1
max_vips = 1
[[vip]]
name = "a"
address = "10.200.0.1"
port = 80
[[vip]]
name = "b"
address = "10.200.0.2"
port = 80
"#,
        errors: &[
            "t.toml:5:1: vip: 2 VIPs are configured; allowed: at most dataplane.max_vips = 1 (raise max_vips, up to 128)",
        ],
    },
    Case {
        name: "bad VIP name",
        base: true,
        text: r#"[[vip]]
name = "Chat!"
address = "10.200.0.1"
port = 80
"#,
        errors: &[
            "t.toml:7:8: vip[0].name: \"Chat!\" is not a valid VIP name; allowed: 1 to 32 of a-z, 0-9, \"-\" and \"_\"",
        ],
    },
    Case {
        name: "duplicate VIP name",
        base: true,
        text: r#"[[vip]]
name = "a"
address = "10.200.0.1"
port = 80
[[vip]]
name = "a"
address = "10.200.0.2"
port = 80
"#,
        errors: &[
            "t.toml:11:8: vip[1].name: \"a\" is already the name of vip[0]; allowed: a name unique among VIPs",
        ],
    },
    Case {
        name: "duplicate VIP",
        base: true,
        text: r#"[[vip]]
name = "a"
address = "10.200.0.1"
port = 443
[[vip]]
name = "b"
address = "10.200.0.1"
port = 443
protocol = "tcp"
"#,
        errors: &[
            "t.toml:10:1: vip[1]: 10.200.0.1 tcp/443 is already served by vip[0] (\"a\"); allowed: one VIP per (address, port, protocol) (a port-0 VIP may share an address with specific ports)",
        ],
    },
    Case {
        name: "duplicate v6 VIP spelled differently",
        base: true,
        text: r#"[[vip]]
name = "a"
address = "2001:db8::1"
port = 443
[[vip]]
name = "b"
address = "2001:db8:0:0::1"
port = 443
"#,
        errors: &[
            "t.toml:10:1: vip[1]: 2001:db8::1 tcp/443 is already served by vip[0] (\"a\"); allowed: one VIP per (address, port, protocol) (a port-0 VIP may share an address with specific ports)",
        ],
    },
    Case {
        name: "missing VIP keys",
        base: true,
        text: r#"[[vip]]
protocol = "udp"
"#,
        errors: &[
            "t.toml:6:1: vip[0].name: missing (required); allowed: a unique name of a-z, 0-9, \"-\" and \"_\"",
            "t.toml:6:1: vip[0].address: missing (required); allowed: an IPv4 or IPv6 address such as \"10.200.0.1\"",
            "t.toml:6:1: vip[0].port: missing (required); allowed: 0..=65535 (0 = all ports)",
        ],
    },
    Case {
        name: "bad VIP address",
        base: true,
        text: r#"[[vip]]
name = "a"
address = "10.200.0.300"
port = 80
[[vip]]
name = "b"
address = "224.0.0.1"
port = 80
[[vip]]
name = "c"
address = "::"
port = 80
"#,
        errors: &[
            "t.toml:8:11: vip[0].address: \"10.200.0.300\" is not an IP address; allowed: an IPv4 or IPv6 address such as \"10.200.0.1\"",
            "t.toml:12:11: vip[1].address: \"224.0.0.1\" is a multicast address; allowed: a unicast address",
            "t.toml:16:11: vip[2].address: \"::\" is the unspecified address; allowed: a unicast address",
        ],
    },
    Case {
        // The same rules as the admin API (config::rules).
        name: "hostile backends, labels and durations",
        base: true,
        text: r#"[[vip]]
name = "a"
address = "10.200.0.1"
port = 80
affinity_window = "18446744073709552s"
[[vip.backend]]
address = "255.255.255.255"
[[vip.backend]]
address = "10.200.0.1"
[[vip.backend]]
address = "127.0.0.1"
[[vip.backend]]
address = "10.1.0.1"
labels = { rack = "r1\u001b[2J", "a b" = "x", zone = "ZZZZZZZZZZZZZZZZZZZZZZZZZZZZZZZZZZZZZZZZZZZZZZZZZZZZZZZZZZZZZZZZZZZZZZZZZZZZZZZZZZZZZZZZZZZZZZZZZZZZZZZZZZZZZZZZZZZZZZZZZZZZZZZZZZZZZZZZZZZZZZZZZZZZZZZZZZZZZZZZZZZZZZZZZZZZZZZZZZZZZZZZZZZZZZZZZZZZZZZZZZZZZZZZZZZZZZZZZZZZZZZZZZZZZZZZZZZZZZZZZZZZZZZZZZZZZZZZZZZZZZ" }
[[vip]]
name = "b"
address = "fd00::10"
port = 80
[[vip.backend]]
address = "::ffff:10.1.0.2"
[health]
interval = "18446744073709552s"
"#,
        errors: &[
            "t.toml:10:19: vip[0].affinity_window: \"18446744073709552s\" is longer than 365d; allowed: a duration up to 365d",
            "t.toml:12:11: vip[0].backend[0].address: \"255.255.255.255\" is the broadcast address; allowed: a unicast address",
            "t.toml:14:11: vip[0].backend[1].address: \"10.200.0.1\" is the VIP's own address; allowed: an address of the backend host",
            "t.toml:16:11: vip[0].backend[2].address: \"127.0.0.1\" is a loopback address; allowed: an address of the backend host",
            "t.toml:19:19: vip[0].backend[3].labels.rack: \"r1\\u{1b}[2J\" is not a valid label value; allowed: 1 to 255 of A-Z, a-z, 0-9, \"_\", \".\" and \"-\"",
            "t.toml:19:42: vip[0].backend[3].labels.\"a b\": \"a b\" is not a valid label name; allowed: 1 to 63 of A-Z, a-z, 0-9, \"_\", \".\" and \"-\"",
            "t.toml:19:54: vip[0].backend[3].labels.zone: \"ZZZZZZZZZZZZZZZZZZZZZZZZZZZZZZZZZZZZZZZZZZZZZZZZZZZZZZZZZZZZZZZZZZZZZZZZZZZZZZZZ\"... (262 bytes) is not a valid label value; allowed: 1 to 255 of A-Z, a-z, 0-9, \"_\", \".\" and \"-\"",
            "t.toml:25:11: vip[1].backend[0].address: \"::ffff:10.1.0.2\" is an IPv4-mapped IPv6 address; allowed: the IPv4 address itself (10.1.0.2)",
            "t.toml:27:12: health.interval: \"18446744073709552s\" is longer than 365d; allowed: a duration up to 365d",
        ],
    },
    Case {
        name: "addresses that route nowhere or back to the LB",
        base: true,
        text: r#"[[vip]]
name = "a"
address = "10.200.0.1"
port = 80
[[vip.backend]]
address = "240.0.0.1"
[[vip.backend]]
address = "169.254.0.5"
[[vip.backend]]
address = "10.200.0.2"
[[vip]]
name = "b"
address = "10.200.0.2"
port = 80
[[vip.backend]]
address = "fe80::1"
[[vip.backend]]
address = "64:ff9b::102:304"
[[vip]]
name = "lo"
address = "127.0.0.1"
port = 80
"#,
        errors: &[
            "t.toml:11:11: vip[0].backend[0].address: \"240.0.0.1\" is in 240.0.0.0/4 (reserved); allowed: an address of the backend host",
            "t.toml:13:11: vip[0].backend[1].address: \"169.254.0.5\" is link-local (169.254.0.0/16), which names no interface; allowed: an address of the backend host",
            "t.toml:15:11: vip[0].backend[2].address: \"10.200.0.2\" is the address of VIP \"b\"; allowed: an address of the backend host",
            "t.toml:21:11: vip[1].backend[0].address: \"fe80::1\" is link-local (fe80::/10), which names no interface; allowed: an address of the backend host",
            "t.toml:23:11: vip[1].backend[1].address: \"64:ff9b::102:304\" is in the NAT64 prefix 64:ff9b::/96; allowed: an address of the backend host",
            "t.toml:26:11: vip[2].address: \"127.0.0.1\" is a loopback address; allowed: an address clients reach through the attached interfaces",
        ],
    },
    Case {
        name: "port out of range",
        base: true,
        text: r#"[[vip]]
name = "a"
address = "10.200.0.1"
port = 65536
"#,
        errors: &[
            "t.toml:9:8: vip[0].port: 65536 is out of range; allowed: 0..=65535 (0 = all ports)",
        ],
    },
    Case {
        name: "unknown protocol",
        base: true,
        text: r#"[[vip]]
name = "a"
address = "10.200.0.1"
port = 80
protocol = "sctp"
"#,
        errors: &[
            "t.toml:10:12: vip[0].protocol: \"sctp\" is not recognised; allowed: \"tcp\", \"udp\"",
        ],
    },
    Case {
        name: "unknown hash",
        base: true,
        text: r#"[[vip]]
name = "a"
address = "10.200.0.1"
port = 80
hash = "round-robin"
"#,
        errors: &[
            "t.toml:10:8: vip[0].hash: \"round-robin\" is not recognised; allowed: \"five-tuple\", \"source\"",
        ],
    },
    Case {
        name: "bad duration",
        base: true,
        text: r#"[[vip]]
name = "a"
address = "10.200.0.1"
port = 80
affinity_window = "ten minutes"
"#,
        errors: &[
            "t.toml:10:19: vip[0].affinity_window: \"ten minutes\" is not a duration; allowed: a number and a unit (ns, us, ms, s, m, h, d), e.g. \"500ms\", \"10s\", \"5m\"",
        ],
    },
    Case {
        name: "affinity window too long",
        base: true,
        text: r#"[[vip]]
name = "a"
address = "10.200.0.1"
port = 80
affinity_window = "25h"
"#,
        errors: &[
            "t.toml:10:19: vip[0].affinity_window: \"25h\" is longer than 24h; allowed: 0s..=24h (0s = off)",
        ],
    },
    Case {
        name: "affinity window fractional",
        base: true,
        text: r#"[[vip]]
name = "a"
address = "10.200.0.1"
port = 80
affinity_window = "1500ms"
"#,
        errors: &[
            "t.toml:10:19: vip[0].affinity_window: \"1500ms\" is not a whole number of seconds; allowed: whole seconds from 0s to 24h (0s = off)",
        ],
    },
    Case {
        name: "priority out of range",
        base: true,
        text: r#"[[vip]]
name = "a"
address = "10.200.0.1"
port = 80
priority = 8
"#,
        errors: &[
            "t.toml:10:12: vip[0].priority: 8 is out of range; allowed: 0..=7 (0 = highest)",
        ],
    },
    Case {
        name: "ring_size not prime",
        base: true,
        text: r#"[[vip]]
name = "a"
address = "10.200.0.1"
port = 80
ring_size = 65536
"#,
        errors: &[
            "t.toml:10:13: vip[0].ring_size: 65536 is not prime; allowed: a prime no larger than 65537, e.g. 65537 (the default), 16381, 4093 or 1021",
        ],
    },
    Case {
        name: "ring_size too large",
        base: true,
        text: r#"[[vip]]
name = "a"
address = "10.200.0.1"
port = 80
ring_size = 70001
"#,
        errors: &[
            "t.toml:10:13: vip[0].ring_size: 70001 is out of range; allowed: a prime no larger than 65537, e.g. 65537 (the default), 16381, 4093 or 1021",
        ],
    },
    Case {
        name: "ring_size < backends",
        base: true,
        text: r#"[[vip]]
name = "a"
address = "10.200.0.1"
port = 80
ring_size = 2
  [[vip.backend]]
  address = "10.1.0.1"
  [[vip.backend]]
  address = "10.1.0.2"
  [[vip.backend]]
  address = "10.1.0.3"
"#,
        errors: &[
            "t.toml:10:13: vip[0].ring_size: 2 is smaller than the VIP's 3 backends, so some would get no slot; allowed: a prime of at least 3, and at least 100 per backend is recommended, e.g. 307",
        ],
    },
    Case {
        name: "duplicate backend",
        base: true,
        text: r#"[[vip]]
name = "a"
address = "10.200.0.1"
port = 80
  [[vip.backend]]
  address = "10.1.0.1"
  [[vip.backend]]
  address = "10.1.0.2"
  [[vip.backend]]
  address = "10.1.0.1"
"#,
        errors: &[
            "t.toml:15:13: vip[0].backend[2].address: \"10.1.0.1\" is already backend[0] of this VIP; allowed: each backend address once per VIP",
        ],
    },
    Case {
        name: "v4 backend on v6 VIP",
        base: true,
        text: r#"[[vip]]
name = "a"
address = "2001:db8::1"
port = 80
  [[vip.backend]]
  address = "10.1.0.1"
"#,
        errors: &[
            "t.toml:11:13: vip[0].backend[0].address: \"10.1.0.1\" is IPv4 but the VIP 2001:db8::1 is IPv6; allowed: an IPv6 backend (IPv6 cannot be encapsulated in IPv4)",
        ],
    },
    Case {
        name: "bad backend address",
        base: true,
        text: r#"[[vip]]
name = "a"
address = "10.200.0.1"
port = 80
  [[vip.backend]]
  address = "backend-1"
  [[vip.backend]]
  weight = 1
"#,
        errors: &[
            "t.toml:11:13: vip[0].backend[0].address: \"backend-1\" is not an IP address; allowed: an IPv4 or IPv6 address such as \"10.1.0.1\"",
            "t.toml:12:3: vip[0].backend[1].address: missing (required); allowed: an IPv4 or IPv6 address such as \"10.1.0.1\"",
        ],
    },
    Case {
        name: "weight out of range",
        base: true,
        text: r#"[[vip]]
name = "a"
address = "10.200.0.1"
port = 80
  [[vip.backend]]
  address = "10.1.0.1"
  weight = 70000
  [[vip.backend]]
  address = "10.1.0.2"
  weight = -1
"#,
        errors: &[
            "t.toml:12:12: vip[0].backend[0].weight: 70000 is out of range; allowed: 0..=65535 (0 = no new flows)",
            "t.toml:15:12: vip[0].backend[1].weight: -1 is out of range; allowed: 0..=65535 (0 = no new flows)",
        ],
    },
    Case {
        name: "labels invalid",
        base: true,
        text: r#"[[vip]]
name = "a"
address = "10.200.0.1"
port = 80
  [[vip.backend]]
  address = "10.1.0.1"
  labels = { "bad key" = "x", pool = "", tenant = "a/b" }
"#,
        errors: &[
            "t.toml:12:26: vip[0].backend[0].labels.\"bad key\": \"bad key\" is not a valid label name; allowed: 1 to 63 of A-Z, a-z, 0-9, \"_\", \".\" and \"-\"",
            "t.toml:12:38: vip[0].backend[0].labels.pool: \"\" is not a valid label value; allowed: 1 to 255 of A-Z, a-z, 0-9, \"_\", \".\" and \"-\"",
            "t.toml:12:51: vip[0].backend[0].labels.tenant: \"a/b\" is not a valid label value; allowed: 1 to 255 of A-Z, a-z, 0-9, \"_\", \".\" and \"-\"",
        ],
    },
    Case {
        name: "max_sessions out of range",
        base: true,
        text: r#"[[vip]]
name = "a"
address = "10.200.0.1"
port = 80
  [[vip.backend]]
  address = "10.1.0.1"
  max_sessions = 5000000000
"#,
        errors: &[
            "t.toml:12:18: vip[0].backend[0].max_sessions: 5000000000 is out of range; allowed: 0..=4294967295 (0 = no cap)",
        ],
    },
    Case {
        name: "bad telemetry endpoints",
        base: true,
        text: r#"[[vip]]
name = "a"
address = "10.200.0.1"
port = 80
  [[vip.backend]]
  address = "10.1.0.1"
  dcgm = { url = "10.1.0.1:9400/metrics", gpus = ["0", ""] }
  engine = { url = "http://10.1.0.1:99999/metrics", kind = "tgi" }
"#,
        errors: &[
            "t.toml:12:18: vip[0].backend[0].dcgm.url: \"10.1.0.1:9400/metrics\" is not a valid URL; allowed: an http:// URL such as \"http://10.1.0.1:9400/metrics\"",
            "t.toml:12:56: vip[0].backend[0].dcgm.gpus[1]: \"\" is not a valid gpu label value; allowed: a non-empty value without whitespace",
            "t.toml:13:20: vip[0].backend[0].engine.url: \"http://10.1.0.1:99999/metrics\" is not a valid URL; allowed: an http:// URL such as \"http://10.1.0.1:9400/metrics\"",
            "t.toml:13:60: vip[0].backend[0].engine.kind: \"tgi\" is not recognised; allowed: \"vllm\", \"sglang\"",
        ],
    },
    Case {
        name: "engine missing keys",
        base: true,
        text: r#"[[vip]]
name = "a"
address = "10.200.0.1"
port = 80
  [[vip.backend]]
  address = "10.1.0.1"
  engine = { model = "" }
"#,
        errors: &[
            "t.toml:12:12: vip[0].backend[0].engine.url: missing (required); allowed: an http:// URL such as \"http://10.1.0.1:9400/metrics\"",
            "t.toml:12:12: vip[0].backend[0].engine.kind: missing (required); allowed: \"vllm\", \"sglang\"",
            "t.toml:12:22: vip[0].backend[0].engine.model: \"\" is not a valid model name; allowed: a non-empty model_name label value",
        ],
    },
    Case {
        name: "roce both",
        base: true,
        text: r#"[[vip]]
name = "a"
address = "10.200.0.1"
port = 80
  [[vip.backend]]
  address = "10.1.0.1"
  roce = { sysfs = "/sys/class/infiniband/mlx5_0/ports/1/hw_counters", device = "mlx5_0" }
"#,
        errors: &[
            "t.toml:12:10: vip[0].backend[0].roce: sets both `sysfs` and exporter keys (url, device, port); allowed: { sysfs = \"/sys/class/infiniband/DEV/ports/N/hw_counters\" } or { url = \"http://...\", device = \"mlx5_0\", port = \"1\" }",
        ],
    },
    Case {
        name: "roce empty",
        base: true,
        text: r#"[[vip]]
name = "a"
address = "10.200.0.1"
port = 80
  [[vip.backend]]
  address = "10.1.0.1"
  roce = {}
"#,
        errors: &[
            "t.toml:12:10: vip[0].backend[0].roce: {} is empty; allowed: { sysfs = \"/sys/class/infiniband/DEV/ports/N/hw_counters\" } or { url = \"http://...\", device = \"mlx5_0\", port = \"1\" }",
        ],
    },
    Case {
        name: "roce exporter incomplete",
        base: true,
        text: r#"[[vip]]
name = "a"
address = "10.200.0.1"
port = 80
  [[vip.backend]]
  address = "10.1.0.1"
  roce = { url = "http://10.1.0.1:9401/metrics", port = "one" }
  [[vip.backend]]
  address = "10.1.0.2"
  roce = { sysfs = "sys/class/infiniband" }
"#,
        errors: &[
            "t.toml:12:10: vip[0].backend[0].roce.device: missing (required); allowed: an RDMA device name such as \"mlx5_0\"",
            "t.toml:12:57: vip[0].backend[0].roce.port: \"one\" is not a port number; allowed: \"1\"..=\"65535\"",
            "t.toml:15:20: vip[0].backend[1].roce.sysfs: \"sys/class/infiniband\" is not an absolute path; allowed: a path starting with \"/\"",
        ],
    },
    Case {
        name: "health required on port-0 VIP",
        base: true,
        text: r#"[[vip]]
name = "a"
address = "10.200.0.1"
port = 0
  [[vip.backend]]
  address = "10.1.0.1"
  [[vip.backend]]
  address = "10.1.0.2"
  health = { kind = "http" }
"#,
        errors: &[
            "t.toml:10:3: vip[0].backend[0].health: missing, but the VIP's port is 0 (all ports) so there is no default port; allowed: { kind = \"tcp\", port = N } or { kind = \"http\", port = N, path = \"/health\" }",
            "t.toml:14:12: vip[0].backend[1].health.port: missing (required); allowed: 1..=65535 (the VIP's port is 0, so there is no default)",
        ],
    },
    Case {
        name: "bad health checks",
        base: true,
        text: r#"[[vip]]
name = "a"
address = "10.200.0.1"
port = 80
  [[vip.backend]]
  address = "10.1.0.1"
  health = { kind = "tcp", path = "/health" }
  [[vip.backend]]
  address = "10.1.0.2"
  health = { kind = "http", path = "health", expect_status = 700, port = 0 }
  [[vip.backend]]
  address = "10.1.0.3"
  health = { kind = "icmp" }
"#,
        errors: &[
            "t.toml:12:35: vip[0].backend[0].health.path: \"/health\" is set but kind is \"tcp\"; allowed: `path` only with kind = \"http\"",
            "t.toml:15:36: vip[0].backend[1].health.path: \"health\" is not an HTTP path; allowed: a path starting with \"/\" without whitespace, e.g. \"/health\"",
            "t.toml:15:62: vip[0].backend[1].health.expect_status: 700 is out of range; allowed: 100..=599",
            "t.toml:15:74: vip[0].backend[1].health.port: 0 is out of range; allowed: 1..=65535",
            "t.toml:18:21: vip[0].backend[2].health.kind: \"icmp\" is not recognised; allowed: \"tcp\", \"http\"",
        ],
    },
    Case {
        name: "timeout >= interval",
        base: true,
        text: r#"[health]
interval = "1s"
timeout = "1000ms"
rise = 0
fall = 11
"#,
        errors: &[
            "t.toml:8:11: health.timeout: \"1000ms\" is not shorter than health.interval = \"1s\"; allowed: a timeout shorter than the interval",
            "t.toml:9:8: health.rise: 0 is out of range; allowed: 1..=10",
            "t.toml:10:8: health.fall: 11 is out of range; allowed: 1..=10",
        ],
    },
    Case {
        name: "zero interval",
        base: true,
        text: r#"[health]
interval = "0s"
"#,
        errors: &[
            "t.toml:7:12: health.interval: \"0s\" is zero; allowed: a duration greater than 0s, e.g. \"1s\"",
        ],
    },
    Case {
        name: "telemetry timing",
        base: true,
        text: r#"[telemetry]
scrape_interval = "2s"
scrape_timeout = "2s"
stale_after = "2s"
max_concurrent_scrapes = 0
"#,
        errors: &[
            "t.toml:8:18: telemetry.scrape_timeout: \"2s\" is not shorter than telemetry.scrape_interval = \"2s\"; allowed: a timeout shorter than the scrape interval",
            "t.toml:9:15: telemetry.stale_after: \"2s\" is not longer than telemetry.scrape_interval = \"2s\"; allowed: longer than the scrape interval, e.g. 3 intervals",
            "t.toml:10:26: telemetry.max_concurrent_scrapes: 0 is out of range; allowed: 1..=256",
        ],
    },
    Case {
        name: "policy ranges",
        base: true,
        text: r#"[policy]
ewma_alpha = 0
weight_levels = 1
hysteresis = 0.5
gpu_util_high = 1.5
kv_cache_high = nan
queue_depth_high = 0
temp_high_c = 200
ecn_rate_high = -1.0
cnp_rate_high = inf
tenant_busy_fraction = 0
"#,
        errors: &[
            "t.toml:7:14: policy.ewma_alpha: 0.0 is out of range; allowed: 0 < ewma_alpha <= 1",
            "t.toml:8:17: policy.weight_levels: 1 is out of range; allowed: 2..=64",
            "t.toml:9:14: policy.hysteresis: 0.5 is out of range; allowed: 0 <= hysteresis < 0.5",
            "t.toml:10:17: policy.gpu_util_high: 1.5 is out of range; allowed: 0 < gpu_util_high <= 1",
            "t.toml:11:17: policy.kv_cache_high: NaN is out of range; allowed: 0 < kv_cache_high <= 1",
            "t.toml:12:20: policy.queue_depth_high: 0 is out of range; allowed: 1..=4294967295",
            "t.toml:13:15: policy.temp_high_c: 200.0 is out of range; allowed: 0 < temp_high_c <= 150",
            "t.toml:14:17: policy.ecn_rate_high: -1.0 is out of range; allowed: a number > 0 (marked packets per second)",
            "t.toml:15:17: policy.cnp_rate_high: inf is out of range; allowed: a number > 0 (CNPs per second)",
            "t.toml:16:24: policy.tenant_busy_fraction: 0.0 is out of range; allowed: 0 < tenant_busy_fraction <= 1",
        ],
    },
    Case {
        name: "policy durations",
        base: true,
        text: r#"[policy]
cooldown_base = "1m"
cooldown_max = "30s"
flap_window = "0s"
slow_start = "soon"
shed = "reject"
"#,
        errors: &[
            "t.toml:8:16: policy.cooldown_max: \"30s\" is shorter than policy.cooldown_base = \"1m\"; allowed: at least cooldown_base",
            "t.toml:9:15: policy.flap_window: \"0s\" is zero; allowed: a duration greater than 0s, e.g. \"1s\"",
            "t.toml:10:14: policy.slow_start: \"soon\" is not a duration; allowed: a number and a unit (ns, us, ms, s, m, h, d), e.g. \"500ms\", \"10s\", \"5m\"",
            "t.toml:11:8: policy.shed: \"reject\" is not recognised; allowed: \"drop\", \"rst\"",
        ],
    },
    Case {
        name: "policy wrong type",
        base: true,
        text: r#"[policy]
ewma_alpha = "0.3"
"#,
        errors: &[
            "t.toml:7:14: policy.ewma_alpha: invalid type: string \"0.3\", expected a number",
        ],
    },
    Case {
        name: "quic settings of a VIP",
        base: true,
        text: r#"[[vip]]
name = "a"
address = "10.200.0.1"
port = 443
quic = "cid"
quic_server_id_len = 9
quic_config_rotation = 7

[[vip]]
name = "b"
address = "10.200.0.2"
port = 443
protocol = "udp"
quic = "quic"
quic_server_id_len = 0
quic_config_rotation = -1
"#,
        errors: &[
            "t.toml:10:8: vip[0].quic: \"cid\" needs protocol = \"udp\" (QUIC runs over UDP); allowed: \"off\" on a tcp VIP",
            "t.toml:11:22: vip[0].quic_server_id_len: 9 is out of range; allowed: 1..=8 octets",
            "t.toml:12:24: vip[0].quic_config_rotation: 7 is QUIC-LB's reserved \"unroutable\" codepoint; allowed: 0..=6",
            "t.toml:19:8: vip[1].quic: \"quic\" is not recognised; allowed: \"off\", \"cid\"",
            "t.toml:20:22: vip[1].quic_server_id_len: 0 is out of range; allowed: 1..=8 octets",
            "t.toml:21:24: vip[1].quic_config_rotation: -1 is out of range; allowed: 0..=6",
        ],
    },
    Case {
        name: "quic server IDs of backends",
        base: true,
        text: r#"[[vip]]
name = "a"
address = "10.200.0.1"
port = 443
protocol = "udp"
quic = "cid"

[[vip.backend]]
address = "10.1.0.1"
quic_server_id = "0a01"

[[vip.backend]]
address = "10.1.0.2"

[[vip.backend]]
address = "10.1.0.3"
quic_server_id = "0A01"

[[vip.backend]]
address = "10.1.0.4"
quic_server_id = "0000"

[[vip.backend]]
address = "10.1.0.5"
quic_server_id = "a01"

[[vip.backend]]
address = "10.1.0.6"
quic_server_id = "0a0g"

[[vip]]
name = "b"
address = "10.200.0.2"
port = 443
protocol = "udp"

[[vip.backend]]
address = "10.1.0.1"
quic_server_id = "0a01"
"#,
        errors: &[
            "t.toml:17:1: vip[0].backend[1].quic_server_id: missing (required); allowed: 4 hex digits (quic_server_id_len = 2 octets), not all zero, unique within the VIP (every backend of a quic = \"cid\" VIP has one)",
            "t.toml:22:18: vip[0].backend[2].quic_server_id: \"0A01\" is already the server ID of backend[0] of this VIP; allowed: a server ID unique within the VIP",
            "t.toml:26:18: vip[0].backend[3].quic_server_id: \"0000\" is all zero; allowed: 4 hex digits (quic_server_id_len = 2 octets), not all zero, unique within the VIP, e.g. \"0a01\"",
            "t.toml:30:18: vip[0].backend[4].quic_server_id: \"a01\" is not 2 octets of hex; allowed: 4 hex digits (quic_server_id_len = 2 octets), not all zero, unique within the VIP, e.g. \"0a01\"",
            "t.toml:34:18: vip[0].backend[5].quic_server_id: \"0a0g\" is not 2 octets of hex; allowed: 4 hex digits (quic_server_id_len = 2 octets), not all zero, unique within the VIP, e.g. \"0a01\"",
            "t.toml:44:18: vip[1].backend[0].quic_server_id: \"0a01\" is set but the VIP's quic is \"off\"; allowed: quic_server_id only on the backends of a quic = \"cid\" VIP",
        ],
    },
    Case {
        name: "tenant names and prefixes",
        base: true,
        text: r#"[[tenant]]
name = "Acme"
prefixes = ["10.0.2.0/24"]
[[tenant]]
name = "beta"
[[tenant]]
name = "gamma"
prefixes = []
[[tenant]]
name = "default"
prefixes = ["10.9.0.0/16"]
[[tenant]]
name = "delta"
prefixes = ["10.0.3.1/24", "2001:db8:2::/48", "10.0.4.0", "10.0.5.0/33"]
"#,
        errors: &[
            "t.toml:7:8: tenant[0].name: \"Acme\" is not a valid tenant name; allowed: 1 to 32 of a-z, 0-9, \"-\" and \"_\"",
            "t.toml:9:1: tenant[1].prefixes: missing (required); allowed: a non-empty list of client prefixes such as [\"10.0.2.0/24\"]",
            "t.toml:13:12: tenant[2].prefixes: [] is empty; allowed: a non-empty list of client prefixes such as [\"10.0.2.0/24\"]",
            "t.toml:16:12: tenant[3].prefixes: \"10.9.0.0/16\" is set on the \"default\" tenant, which holds the clients no prefix matches; allowed: no prefixes on \"default\" (give them a named tenant)",
            "t.toml:19:13: tenant[4].prefixes[0]: \"10.0.3.1/24\" has bits set below the prefix length; allowed: the network address, \"10.0.3.0/24\"",
            "t.toml:19:47: tenant[4].prefixes[2]: \"10.0.4.0\" is not a prefix (not ADDRESS/LENGTH); allowed: an IPv4 or IPv6 network such as \"10.0.2.0/24\" or \"2001:db8:2::/48\"",
            "t.toml:19:59: tenant[4].prefixes[3]: \"10.0.5.0/33\" is not a prefix (prefix length 33 exceeds 32); allowed: an IPv4 or IPv6 network such as \"10.0.2.0/24\" or \"2001:db8:2::/48\"",
        ],
    },
    Case {
        name: "tenant duplicates",
        base: true,
        text: r#"[[tenant]]
name = "acme"
prefixes = ["10.0.2.0/24", "2001:db8:2::/48"]
[[tenant]]
name = "acme"
prefixes = ["10.0.3.0/24"]
[[tenant]]
name = "beta"
prefixes = ["10.0.0.0/8", "2001:db8:2::/48"]
[[tenant]]
name = "default"
[[tenant]]
name = "default"
"#,
        errors: &[
            "t.toml:10:8: tenant[1].name: \"acme\" is already the name of tenant[0]; allowed: a name unique among tenants",
            "t.toml:14:27: tenant[2].prefixes[1]: \"2001:db8:2::/48\" is already a prefix of tenant[0] (\"acme\"); allowed: each prefix in one tenant (a longer prefix inside another tenant's is fine: the longest match wins)",
            "t.toml:18:8: tenant[4].name: \"default\" is already the name of tenant[3]; allowed: a name unique among tenants",
        ],
    },
    Case {
        name: "tenant limits",
        base: true,
        text: r#"[[tenant]]
name = "acme"
prefixes = ["10.0.2.0/24"]
weight = 0
max_sessions = -1
new_sessions_per_sec = 1000001
[[tenant]]
name = "beta"
prefixes = ["10.0.3.0/24"]
weight = 1001
burst = 10
"#,
        errors: &[
            "t.toml:9:10: tenant[0].weight: 0 is out of range; allowed: 1..=1000 (a share of a busy or full pool)",
            "t.toml:10:16: tenant[0].max_sessions: -1 is out of range; allowed: 0..=4294967295 (0 = no limit)",
            "t.toml:11:24: tenant[0].new_sessions_per_sec: 1000001 is out of range; allowed: 0..=1000000 (0 = no limit)",
            "t.toml:15:10: tenant[1].weight: 1001 is out of range; allowed: 1..=1000 (a share of a busy or full pool)",
            "t.toml:16:9: tenant[1].burst: 10 is set without new_sessions_per_sec; allowed: a burst only with a rate (set new_sessions_per_sec, or leave burst out)",
        ],
    },
    Case {
        name: "vip tenant shape",
        base: true,
        text: r#"[[tenant]]
name = "acme"
prefixes = ["10.0.2.0/24"]
[[vip]]
name = "chat"
address = "10.200.0.1"
port = 443
  [[vip.tenant]]
  name = "acme"
  max_sessions = 4
  [[vip.tenant]]
  name = "acme"
  colour = "red"
"#,
        errors: &[
            "t.toml:18:3: vip[0].tenant[1].colour: unknown field `colour`, expected one of `name`, `weight`, `max_sessions`, `new_sessions_per_sec`, `burst`",
        ],
    },
    Case {
        name: "vip tenant overrides",
        base: true,
        text: r#"[[tenant]]
name = "acme"
prefixes = ["10.0.2.0/24"]
[[vip]]
name = "chat"
address = "10.200.0.1"
port = 443
  [[vip.tenant]]
  name = "acme"
  max_sessions = 4
  [[vip.tenant]]
  name = "acme"
  [[vip.tenant]]
  name = "default"
  weight = 0
"#,
        errors: &[
            "t.toml:17:10: vip[0].tenant[1].name: \"acme\" is already overridden by tenant[0] of this VIP; allowed: one override per tenant and VIP",
            "t.toml:20:12: vip[0].tenant[2].weight: 0 is out of range; allowed: 1..=1000 (a share of a busy or full pool)",
        ],
    },
    Case {
        name: "vip tenant overrides naming no tenant",
        base: true,
        text: r#"[[tenant]]
name = "acme"
prefixes = ["10.0.2.0/24"]
[[vip]]
name = "chat"
address = "10.200.0.1"
port = 443
  [[vip.tenant]]
  name = "acme"
  burst = 5
  [[vip.tenant]]
  name = "nobody"
  [[vip.tenant]]
  name = "default"
  burst = 2
  new_sessions_per_sec = 1
"#,
        errors: &[
            "t.toml:15:11: vip[0].tenant[0].burst: 5 is set without new_sessions_per_sec; allowed: a burst only with a rate (set new_sessions_per_sec, or leave burst out)",
            "t.toml:17:10: vip[0].tenant[1].name: \"nobody\" names no [[tenant]]; allowed: the name of a [[tenant]] table or \"default\" (the tenants are \"acme\")",
        ],
    },
];

#[test]
fn config_invalid_cases_report_exact_messages() {
    let mut failures = Vec::new();
    for case in CASES {
        match config::parse(&text_of(case), "t.toml") {
            Ok(_) => failures.push(format!("{}: parsed, expected errors", case.name)),
            Err(e) => {
                let got = e.messages();
                if got != case.errors {
                    failures.push(format!(
                        "{}:\n  expected:\n    {}\n  got:\n    {}",
                        case.name,
                        case.errors.join("\n    "),
                        got.join("\n    ")
                    ));
                }
            }
        }
    }
    assert!(failures.is_empty(), "{}", failures.join("\n"));
}

#[test]
fn config_error_display_is_one_issue_per_line() {
    for case in CASES {
        let e = config::parse(&text_of(case), "t.toml").unwrap_err();
        assert_eq!(e.to_string(), case.errors.join("\n"), "{}", case.name);
        assert_eq!(e.origin, "t.toml");
        assert_eq!(e.issues.len(), case.errors.len(), "{}", case.name);
        for issue in &e.issues {
            assert!(!issue.message.contains('\n'), "{}", case.name);
        }
    }
}

#[test]
fn config_issue_fields() {
    let text = format!("{BASE}[[vip]]\nname = \"a\"\naddress = \"10.200.0.1\"\nport = 80\n  [[vip.backend]]\n  address = \"10.1.0.1\"\n  weight = 70000\n");
    let e = config::parse(&text, "x.toml").unwrap_err();
    assert_eq!(e.issues.len(), 1);
    let i = &e.issues[0];
    assert_eq!((i.line, i.column), (Some(12), Some(12)));
    assert_eq!(i.key, "vip[0].backend[0].weight");
    assert_eq!(
        i.message,
        "70000 is out of range; allowed: 0..=65535 (0 = no new flows)"
    );
}

#[test]
fn config_several_errors_are_all_reported() {
    // One file, one mistake in each of several sections and VIPs.
    let text = format!(
        "{BASE}[daemon]\nlog_level = \"loud\"\n[[vip]]\nname = \"a\"\naddress = \"10.200.0.1\"\n\
         port = 80\nring_size = 4\n  [[vip.backend]]\n  address = \"10.1.0.1\"\n  weight = -3\n\
         [[vip]]\nname = \"a\"\naddress = \"10.200.0.1\"\nport = 80\n[health]\ntimeout = \"5s\"\n"
    );
    let e = config::parse(&text, "t.toml").unwrap_err();
    assert_eq!(
        e.messages(),
        [
            "t.toml:7:13: daemon.log_level: \"loud\" is not recognised; allowed: \"error\", \"warn\", \"info\", \"debug\", \"trace\"",
            "t.toml:12:13: vip[0].ring_size: 4 is not prime; allowed: a prime no larger than 65537, e.g. 65537 (the default), 16381, 4093 or 1021",
            "t.toml:15:12: vip[0].backend[0].weight: -3 is out of range; allowed: 0..=65535 (0 = no new flows)",
            "t.toml:16:1: vip[1]: 10.200.0.1 tcp/80 is already served by vip[0] (\"a\"); allowed: one VIP per (address, port, protocol) (a port-0 VIP may share an address with specific ports)",
            "t.toml:17:8: vip[1].name: \"a\" is already the name of vip[0]; allowed: a name unique among VIPs",
            "t.toml:21:11: health.timeout: \"5s\" is not shorter than health.interval = \"1s\"; allowed: a timeout shorter than the interval",
        ]
    );
}

#[test]
fn config_fixtures_match_golden_output() {
    let bless = std::env::var_os("SLUICE_BLESS").is_some();
    let mut seen = 0;
    let mut entries: Vec<_> = fs::read_dir(fixtures())
        .unwrap()
        .map(|e| e.unwrap().path())
        .filter(|p| p.extension().is_some_and(|x| x == "toml"))
        .collect();
    entries.sort();
    for path in entries {
        let name = path.file_name().unwrap().to_str().unwrap().to_owned();
        let text = fs::read_to_string(&path).unwrap();
        let got = match config::parse(&text, &name) {
            Ok(_) => panic!("{name}: fixture parsed, but fixtures are invalid configurations"),
            Err(e) => format!("{e}\n"),
        };
        let golden = path.with_extension("expected");
        if bless {
            fs::write(&golden, &got).unwrap();
        }
        let want =
            fs::read_to_string(&golden).unwrap_or_else(|e| panic!("{}: {e}", golden.display()));
        assert_eq!(got, want, "{name} (rerun with SLUICE_BLESS=1 to update)");
        seen += 1;
    }
    assert!(
        seen >= 3,
        "expected the fixtures under {}",
        fixtures().display()
    );
}

#[test]
fn config_warnings_are_returned_separately() {
    let text = format!(
        "{BASE}[admin]\nmode = \"0600\"\ngroup = \"sluice\"\n[[vip]]\nname = \"a\"\n\
         address = \"10.200.0.1\"\nport = 80\nring_size = 101\n  [[vip.backend]]\n\
         address = \"10.1.0.1\"\n  [[vip.backend]]\n  address = \"10.1.0.2\"\n[[vip]]\n\
         name = \"b\"\naddress = \"10.200.0.1\"\nport = 0\n"
    );
    let (cfg, warnings) = config::parse_with_warnings(&text, "t.toml").unwrap();
    assert_eq!(
        warnings,
        [
            "t.toml:7:8: admin.mode: \"0600\" gives admin.group no access; use e.g. \"0660\" so the group can use the socket",
            "t.toml:13:13: vip[0].ring_size: 101 slots for 2 backends is fewer than 100 per backend, so their shares may be off by more than 1%; use a prime of at least 200, e.g. 211",
            "t.toml:18:1: vip[1]: has no backends, so its packets are dropped until backends are added",
        ]
    );
    // `parse` gives the same configuration and drops the warnings.
    assert_eq!(config::parse(&text, "t.toml").unwrap(), cfg);
    assert_eq!(cfg.vips[0].ring_size, 101);
}

#[test]
fn config_port0_vip_may_overlap_specific_ports() {
    // The data plane tries the exact (address, port, protocol) first, then the address's
    // port-0 VIP, so these three coexist.
    let text = format!(
        "{BASE}[[vip]]\nname = \"all\"\naddress = \"10.200.0.1\"\nport = 0\n  [[vip.backend]]\n\
         address = \"10.1.0.1\"\n  health = {{ port = 8000 }}\n[[vip]]\nname = \"https\"\n\
         address = \"10.200.0.1\"\nport = 443\n  [[vip.backend]]\n  address = \"10.1.0.2\"\n\
         [[vip]]\nname = \"quic\"\naddress = \"10.200.0.1\"\nport = 443\nprotocol = \"udp\"\n\
         [[vip.backend]]\n  address = \"10.1.0.2\"\n"
    );
    let cfg = config::parse(&text, "t.toml").unwrap();
    let keys: Vec<_> = cfg.vips.iter().map(|v| (v.port, v.protocol)).collect();
    assert_eq!(
        keys,
        [
            (0, Protocol::Tcp),
            (443, Protocol::Tcp),
            (443, Protocol::Udp)
        ]
    );
    // A port-0 VIP's backends are probed where the file says; the others default to the
    // VIP's port over TCP.
    assert_eq!(
        cfg.vips[0].backends[0].health,
        HealthCheck::Tcp { port: 8000 }
    );
    assert_eq!(
        cfg.vips[1].backends[0].health,
        HealthCheck::Tcp { port: 443 }
    );
}

#[test]
fn config_ipv6_backend_on_ipv4_vip_is_allowed() {
    let text = format!(
        "{BASE}[[vip]]\nname = \"a\"\naddress = \"10.200.0.1\"\nport = 443\n  [[vip.backend]]\n\
         address = \"fd00:1::1\"\n"
    );
    let cfg = config::parse(&text, "t.toml").unwrap();
    assert_eq!(cfg.vips[0].family(), FAMILY_V4);
    assert_eq!(cfg.vips[0].backends[0].family(), FAMILY_V6);
}

fn examples() -> Vec<PathBuf> {
    let mut v: Vec<_> = fs::read_dir(workspace().join("configs"))
        .unwrap()
        .map(|e| e.unwrap().path())
        .filter(|p| p.extension().is_some_and(|x| x == "toml"))
        .collect();
    v.sort();
    v
}

#[test]
fn config_examples_parse_without_warnings() {
    let examples = examples();
    let names: Vec<_> = examples
        .iter()
        .map(|p| p.file_name().unwrap().to_str().unwrap())
        .collect();
    assert!(
        names.contains(&"sluice.toml") && names.contains(&"minimal.toml"),
        "{names:?}"
    );
    for path in &examples {
        match config::load_with_warnings(path) {
            Ok((_, warnings)) => assert!(warnings.is_empty(), "{}: {warnings:?}", path.display()),
            Err(e) => panic!("{e}"),
        }
    }
}

#[test]
fn config_sluice_example_contents() {
    let cfg = config::load(&workspace().join("configs/sluice.toml")).unwrap();
    assert!(cfg.daemon.keep_dataplane_on_exit);
    assert_eq!(cfg.admin.mode, SocketMode(0o660));
    assert_eq!(cfg.admin.group.as_deref(), Some("sluice"));
    assert_eq!(
        cfg.dataplane.interfaces,
        [
            InterfaceConfig {
                name: "eth0".into(),
                mode: AttachMode::Native
            },
            InterfaceConfig {
                name: "eth1".into(),
                mode: AttachMode::Native
            },
        ]
    );
    assert_eq!(cfg.dataplane.hash_seed, 0x5eed);
    assert_eq!(cfg.dataplane.fallback_mac, Some(Mac([2, 0, 0, 0, 0, 1])));

    let names: Vec<_> = cfg.vips.iter().map(|v| v.name.as_str()).collect();
    assert_eq!(names, ["chat", "chat-quic", "embed-v6"]);

    let chat = &cfg.vips[0];
    assert_eq!(
        (chat.port, chat.protocol, chat.hash),
        (443, Protocol::Tcp, HashMode::FiveTuple)
    );
    assert_eq!(chat.backends.len(), 3);
    assert!(chat
        .backends
        .iter()
        .all(|b| b.dcgm.is_some() && b.engine.as_ref().map(|e| e.kind) == Some(EngineKind::Vllm)));
    assert_eq!(
        chat.backends[0].dcgm.as_ref().unwrap().gpus,
        ["0", "1", "2", "3"]
    );
    assert_eq!(
        chat.backends[1].roce,
        Some(RoceConfig::Exporter {
            url: HttpUrl::parse("http://10.1.0.2:9401/metrics").unwrap(),
            device: "mlx5_0".into(),
            port: "1".into(),
        })
    );
    assert_eq!(
        chat.backends[0].labels,
        BTreeMap::from([
            ("pool".into(), "h100".into()),
            ("rack".into(), "r12".into())
        ])
    );
    assert_eq!(chat.backends[2].weight, 50);
    assert_eq!(
        chat.backends[2].health,
        HealthCheck::Http {
            port: 8000,
            path: "/health".into(),
            expect_status: 200
        }
    );

    let quic = &cfg.vips[1];
    assert_eq!(
        (quic.port, quic.protocol, quic.hash),
        (443, Protocol::Udp, HashMode::Source)
    );
    assert_eq!(quic.affinity_window, Duration::from_secs(600));
    assert_eq!(quic.affinity_secs(), 600);
    assert_eq!(quic.flags(), VIP_F_SRC_HASH);
    assert_eq!(quic.backends[0].weight, BackendConfig::DEFAULT_WEIGHT);

    let v6 = &cfg.vips[2];
    assert_eq!(v6.family(), FAMILY_V6);
    assert_eq!(v6.ring_size, 16381);
    assert!(v6.backends.iter().all(|b| b.family() == FAMILY_V6));
    assert_eq!(cfg.health.fall, 3);
}

#[test]
fn config_minimal_takes_defaults() {
    let cfg = config::load(&workspace().join("configs/minimal.toml")).unwrap();
    assert_eq!(
        cfg,
        Config {
            daemon: Default::default(),
            admin: Default::default(),
            metrics: Default::default(),
            dataplane: DataplaneConfig {
                interfaces: vec![InterfaceConfig {
                    name: "eth0".into(),
                    mode: AttachMode::Auto
                }],
                hash_seed: 1,
                encap_source_v4: None,
                encap_source_v6: None,
                fallback_mac: None,
                conn_table_size: lb_common::CONN_TABLE_SIZE,
                affinity_table_size: lb_common::AFFINITY_TABLE_SIZE,
                max_vips: DataplaneConfig::DEFAULT_MAX_VIPS,
                flood_new_flows_per_sec: 0,
                flow_idle_timeout: std::time::Duration::from_secs(60),
            },
            vips: vec![],
            health: Default::default(),
            telemetry: Default::default(),
            policy: Default::default(),
            bgp: None,
            fleet: None,
            tenants: vec![],
        }
    );
    assert_eq!(cfg.daemon.bpffs, Path::new("/sys/fs/bpf/sluice"));
    assert_eq!(cfg.admin.mode, SocketMode(0o600));
    assert_eq!(cfg.metrics.listen.to_string(), "127.0.0.1:9464");
    assert_eq!(cfg.health.timeout, Duration::from_millis(500));
    assert_eq!(cfg.policy.cooldown_max, Duration::from_secs(600));
}

#[test]
fn config_round_trips_through_toml_and_json() {
    for path in examples() {
        let cfg = config::load(&path).unwrap();
        let toml_text = toml::to_string(&cfg).unwrap();
        let back = config::parse(&toml_text, "serialized.toml")
            .unwrap_or_else(|e| panic!("{}:\n{e}\n{toml_text}", path.display()));
        assert_eq!(back, cfg, "{}", path.display());

        let json = serde_json::to_string(&cfg).unwrap();
        let back: Config = serde_json::from_str(&json).unwrap();
        assert_eq!(back, cfg, "{}", path.display());
    }
}

#[test]
fn config_deserialize_validates() {
    let cfg = config::load(&workspace().join("configs/sluice.toml")).unwrap();
    let mut json: serde_json::Value = serde_json::to_value(&cfg).unwrap();
    json["vip"][0]["backend"][1]["weight"] = 70000.into();
    json["admin"]["mode"] = "0666".into();
    let err = serde_json::from_value::<Config>(json)
        .unwrap_err()
        .to_string();
    assert_eq!(
        err,
        "config: admin.mode: \"0666\" lets other users read or write the admin socket; allowed: no read or write bits for others (o+rw), e.g. \"0600\", or \"0660\" with admin.group\n\
         config: vip[0].backend[1].weight: 70000 is out of range; allowed: 0..=65535 (0 = no new flows)"
    );
}

#[test]
fn config_dataplane_settings_and_vip_keys() {
    let cfg = config::load(&workspace().join("configs/sluice.toml")).unwrap();
    let lb = cfg.dataplane.lb_config();
    assert_eq!(lb.encap_src_v4.to_ne_bytes(), [172, 16, 0, 0]);
    assert_eq!(lb.encap_src_v4_hostmask.to_ne_bytes(), [0, 0, 0xff, 0xff]);
    assert_eq!(lb.encap_src_v6[0].to_ne_bytes(), [0xfd, 0, 0, 5]);
    assert_eq!(lb.encap_src_v6[1].to_ne_bytes(), [0, 1, 0, 0]);
    assert_eq!(lb.encap_src_v6[3], 0);
    assert_eq!(lb.encap_src_v6_hostmask, u32::MAX);
    assert_eq!(lb.hash_seed, 0x5eed);
    assert_eq!(lb.fallback_mac, [2, 0, 0, 0, 0, 1]);
    assert_eq!(lb.flood_new_flows_per_sec, 200_000);

    let key = cfg.vips[0].vip_key();
    assert_eq!(key.addr[0].to_ne_bytes(), [10, 200, 0, 1]);
    assert_eq!(key.port, 443u16.to_be());
    assert_eq!((key.proto, key.family), (PROTO_TCP, FAMILY_V4));
    assert_eq!(cfg.vips[1].vip_key().proto, PROTO_UDP);
    assert_eq!(cfg.vips[0].flags(), 0);
    assert_eq!(cfg.vips[0].affinity_secs(), 0);
    let v6 = cfg.vips[2].vip_key();
    assert_eq!(v6.family, FAMILY_V6);
    assert_eq!(v6.addr[0].to_ne_bytes(), [0x20, 0x01, 0x0d, 0xb8]);

    // Without sources or MAC everything is zero ("drop instead").
    let minimal = config::load(&workspace().join("configs/minimal.toml")).unwrap();
    let lb = minimal.dataplane.lb_config();
    assert_eq!(
        (
            lb.encap_src_v4,
            lb.encap_src_v4_hostmask,
            lb.encap_src_v6_hostmask
        ),
        (0, 0, 0)
    );
    assert_eq!(lb.fallback_mac, [0; 6]);
}

#[test]
fn config_cidr_mac_and_mode_types() {
    let mask = |s: &str| {
        s.parse::<Cidr>()
            .unwrap()
            .hostmask_last_word()
            .to_ne_bytes()
    };
    assert_eq!(mask("10.0.0.0/8"), [0, 0xff, 0xff, 0xff]);
    assert_eq!(mask("172.16.0.0/16"), [0, 0, 0xff, 0xff]);
    assert_eq!(mask("172.16.0.0/20"), [0, 0, 0x0f, 0xff]);
    assert_eq!(mask("172.16.0.1/32"), [0; 4]);
    assert_eq!(mask("fd00::/64"), [0xff; 4]);
    assert_eq!(mask("fd00:5:1::/96"), [0xff; 4]);
    assert_eq!(mask("fd00:5:1::/112"), [0, 0, 0xff, 0xff]);
    assert_eq!(mask("fd00:5:1::1/128"), [0; 4]);

    let c: Cidr = "fd00:5:1::/96".parse().unwrap();
    assert_eq!(c.addr, "fd00:5:1::".parse::<IpAddr>().unwrap());
    assert_eq!((c.prefix, c.family()), (96, FAMILY_V6));
    assert_eq!(c.to_string(), "fd00:5:1::/96");
    assert_eq!("10.0.0.0".parse::<Cidr>(), Err(CidrError::Syntax));
    assert_eq!("10.0.0.0/+8".parse::<Cidr>(), Err(CidrError::Syntax));
    assert_eq!(
        "10.0.0.0/33".parse::<Cidr>(),
        Err(CidrError::PrefixTooLong {
            prefix: 33,
            max: 32
        })
    );
    assert_eq!(
        "10.1.0.0/8".parse::<Cidr>().unwrap_err().to_string(),
        "host bits are set (the network is 10.0.0.0/8)"
    );

    let m: Mac = "02:AB:cd:00:00:01".parse().unwrap();
    assert_eq!(m.octets(), [2, 0xab, 0xcd, 0, 0, 1]);
    assert_eq!(m.to_string(), "02:ab:cd:00:00:01");
    assert!(!m.is_multicast() && !m.is_zero());
    assert!("ff:ff:ff:ff:ff:ff".parse::<Mac>().unwrap().is_multicast());
    for bad in [
        "02:00:00:00:00",
        "02:00:00:00:00:01:02",
        "02-00-00-00-00-01",
        "2:0:0:0:0:1",
        "",
    ] {
        assert!(bad.parse::<Mac>().is_err(), "{bad}");
    }

    assert_eq!("0640".parse::<SocketMode>(), Ok(SocketMode(0o640)));
    assert_eq!("600".parse::<SocketMode>(), Ok(SocketMode(0o600)));
    assert_eq!(SocketMode(0o600).to_string(), "0600");
    for bad in ["0o600", "1600", "0800", "60", "00600"] {
        assert!(bad.parse::<SocketMode>().is_err(), "{bad}");
    }
    assert_eq!("five-tuple".parse::<HashMode>(), Ok(HashMode::FiveTuple));
    assert_eq!(
        "sctp".parse::<Protocol>().unwrap_err().to_string(),
        "\"sctp\" is not recognised; allowed: \"tcp\", \"udp\""
    );
}

#[test]
fn config_load_reports_unreadable_file() {
    let path = fixtures().join("does-not-exist.toml");
    let e = config::load(&path).unwrap_err();
    assert_eq!(
        e.to_string(),
        format!(
            "{}: cannot read the configuration: No such file or directory (os error 2)",
            path.display()
        )
    );
}

/// A VIP with `n` backends 10.1.x.y (and no other keys), as `[[vip]]` text.
fn vip_with_backends(name: &str, addr: &str, n: usize) -> String {
    let mut t = format!("[[vip]]\nname = \"{name}\"\naddress = \"{addr}\"\nport = 80\n");
    for i in 0..n {
        t += &format!(
            "[[vip.backend]]\naddress = \"10.1.{}.{}\"\n",
            i / 250,
            i % 250 + 1
        );
    }
    t
}

#[test]
fn config_backend_total_is_bounded_by_the_backend_table() {
    // 4095 backends (ids 1..=4095) fit; with 700 per VIP even the largest ring gives fewer
    // than 100 slots each, which is not worth a warning.
    let ok = format!(
        "{BASE}{}{}",
        vip_with_backends("a", "10.200.0.1", 700),
        vip_with_backends("b", "10.200.0.2", 3395)
    );
    let (cfg, warnings) = config::parse_with_warnings(&ok, "t.toml").unwrap();
    assert_eq!(cfg.vips[1].backends.len(), 3395);
    assert_eq!(warnings, Vec::<String>::new());

    let over = format!(
        "{BASE}{}{}",
        vip_with_backends("a", "10.200.0.1", 700),
        vip_with_backends("b", "10.200.0.2", 3396)
    );
    assert_eq!(
        config::parse(&over, "t.toml").unwrap_err().messages(),
        ["t.toml:6:1: vip: 4096 backends are configured over all VIPs; allowed: at most 4095 (the data plane's backend table)"]
    );
}

#[test]
fn config_flow_state_defaults_to_table_and_takes_second_chance() {
    let vip = |extra: &str| {
        format!(
            "{BASE}[[vip]]\nname = \"chat\"\naddress = \"10.200.0.1\"\nport = 443\n{extra}\n\
             [[vip.backend]]\naddress = \"10.1.0.1\"\n"
        )
    };
    let cfg = config::parse(&vip(""), "t.toml").unwrap();
    assert_eq!(cfg.vips[0].flow_state, config::FlowState::Table);
    let cfg = config::parse(&vip("flow_state = \"second-chance\""), "t.toml").unwrap();
    assert_eq!(cfg.vips[0].flow_state, config::FlowState::SecondChance);
    let err = config::parse(&vip("flow_state = \"backends\""), "t.toml")
        .unwrap_err()
        .to_string();
    assert!(err.contains("vip[0].flow_state"), "{err}");
    assert!(err.contains("second-chance"), "{err}");
}

#[test]
fn config_bgp_section_is_checked_with_key_paths() {
    let text = format!("{BASE}[bgp]\ncontrol_socket = \"bird.ctl\"\ninterval = \"2m\"\n");
    let e = config::parse(&text, "t.toml").unwrap_err();
    assert_eq!(
        e.messages(),
        [
            "t.toml:7:18: bgp.control_socket: \"bird.ctl\" is not an absolute path; allowed: a path starting with \"/\"",
            "t.toml:8:12: bgp.interval: \"2m\" is out of range; allowed: 10ms..=1m, e.g. \"1s\"",
        ]
    );
    let cfg = config::parse(&format!("{BASE}[bgp]\ninterval = \"200ms\"\n"), "t.toml").unwrap();
    let bgp = cfg.bgp.as_ref().unwrap();
    assert_eq!(bgp.interval, Duration::from_millis(200));
    assert_eq!(bgp.routes_file, Path::new("/var/lib/sluice/bird-vips.conf"));
    let empty = config::parse(&format!("{BASE}[bgp]\n"), "t.toml").unwrap();
    assert_eq!(empty.bgp, Some(config::bgp::BgpConfig::default()));
    let back = config::parse(&toml::to_string(&cfg).unwrap(), "again.toml").unwrap();
    assert_eq!(back, cfg);
}

#[test]
fn fleet_section_is_validated_with_its_key_paths() {
    let text = format!(
        "{BASE}[fleet]\nendpoints = [\"https://etcd:2379\", \"http://[x]:1\"]\nhost = \"\"\n\
         prefix = \"sluice/\"\nlease_ttl = \"2s\"\nrequest_timeout = \"1500ms\"\n"
    );
    let e = config::parse(&text, "t.toml").unwrap_err().messages();
    assert_eq!(
        e,
        [
            "t.toml:7:14: fleet.endpoints[0]: \"https://etcd:2379\" is https, which the fleet's etcd client does not speak; allowed: an http:// URL such as \"http://10.0.0.1:2379\" (etcd's plain-HTTP port, or a local proxy in front of a TLS one)",
            "t.toml:7:35: fleet.endpoints[1]: \"http://[x]:1\" is not a valid URL; allowed: an http:// URL such as \"http://10.0.0.1:2379\"",
            "t.toml:8:8: fleet.host: \"\": allowed: this host's unique name in the fleet, 1 to 63 of [A-Za-z0-9._-] (required)",
            "t.toml:9:10: fleet.prefix: \"sluice/\": allowed: a key path starting with `/`, not ending with one, e.g. \"/sluice/edge-1\"",
            "t.toml:11:19: fleet.request_timeout: 1s 500ms is more than half of lease_ttl (2s): a leader could lose its lease while one request waits; allowed: at most lease_ttl / 2",
        ],
        "{e:#?}"
    );
    let short = format!("{BASE}[fleet]\nendpoints = []\nhost = \"lb-1\"\nlease_ttl = \"1s\"\n");
    let e = config::parse(&short, "t.toml").unwrap_err().messages();
    assert_eq!(
        e,
        [
            "t.toml:7:13: fleet.endpoints: missing (required); allowed: a list of etcd client URLs such as [\"http://10.0.0.1:2379\"]",
            "t.toml:9:13: fleet.lease_ttl: \"1s\" is out of range; allowed: 2s..=1m, e.g. \"5s\"",
        ],
        "{e:#?}"
    );
    let ok = format!("{BASE}[fleet]\nendpoints = [\"http://10.0.0.1:2379\"]\nhost = \"lb-1\"\n");
    let cfg = config::parse(&ok, "t.toml").unwrap();
    let f = cfg.fleet.unwrap();
    assert_eq!((f.host.as_str(), f.prefix.as_str()), ("lb-1", "/sluice"));
    assert_eq!(
        (f.lease_ttl, f.request_timeout),
        (Duration::from_secs(5), Duration::from_secs(1))
    );
    assert_eq!(f.endpoints[0].to_string(), "http://10.0.0.1:2379/");
    assert_eq!(config::parse(BASE, "t.toml").unwrap().fleet, None);
}

#[test]
fn config_inband_defaults_off_and_needs_the_connection_table() {
    let vip = |extra: &str| {
        format!(
            "{BASE}[[vip]]\nname = \"chat\"\naddress = \"10.200.0.1\"\nport = 443\n{extra}\n\
             [[vip.backend]]\naddress = \"10.1.0.1\"\n"
        )
    };
    assert!(!config::parse(&vip(""), "t.toml").unwrap().vips[0].inband);
    assert!(config::parse(&vip("inband = true"), "t.toml").unwrap().vips[0].inband);
    let err = config::parse(
        &vip("inband = true\nflow_state = \"second-chance\""),
        "t.toml",
    )
    .unwrap_err()
    .to_string();
    assert!(err.contains("vip[0].inband"), "{err}");
    assert!(
        err.contains("set flow_state = \"table\" or inband = false"),
        "{err}"
    );
}

#[test]
fn config_quic_defaults_off_and_cid_takes_server_ids() {
    let vip = |extra: &str, backends: &str| {
        format!(
            "{BASE}[[vip]]\nname = \"chat-quic\"\naddress = \"10.200.0.1\"\nport = 443\n\
             protocol = \"udp\"\n{extra}\n{backends}"
        )
    };
    let cfg = config::parse(
        &vip("", "[[vip.backend]]\naddress = \"10.1.0.1\"\n"),
        "t.toml",
    )
    .unwrap();
    let v = &cfg.vips[0];
    assert_eq!(v.quic, config::QuicMode::Off);
    assert_eq!((v.quic_server_id_len, v.quic_config_rotation), (2, 0));
    assert_eq!(v.flags() & lb_common::VIP_F_QUIC_CID, 0);
    assert_eq!(v.backends[0].quic_server_id, None);

    let two = "[[vip.backend]]\naddress = \"10.1.0.1\"\nquic_server_id = \"0A0B0C\"\n\
               [[vip.backend]]\naddress = \"10.1.0.2\"\nquic_server_id = \"000001\"\n";
    let cfg = config::parse(
        &vip(
            "quic = \"cid\"\nquic_server_id_len = 3\nquic_config_rotation = 6",
            two,
        ),
        "t.toml",
    )
    .unwrap();
    let v = &cfg.vips[0];
    assert_eq!(v.quic, config::QuicMode::Cid);
    assert_eq!((v.quic_server_id_len, v.quic_config_rotation), (3, 6));
    assert_ne!(v.flags() & lb_common::VIP_F_QUIC_CID, 0);
    assert_eq!(
        v.backends[0].quic_server_id.as_deref(),
        Some("0a0b0c"),
        "kept in lowercase"
    );
    assert_eq!(v.backends[1].quic_server_id.as_deref(), Some("000001"));
    // A server ID of the wrong length for the VIP's quic_server_id_len.
    let e = config::parse(&vip("quic = \"cid\"", two), "t.toml").unwrap_err();
    assert_eq!(e.issues.len(), 2, "{e}");
    assert!(
        e.issues[0]
            .message
            .starts_with("\"0A0B0C\" is not 2 octets of hex"),
        "{e}"
    );
    // Round trip, as the state and `sluice check` see it.
    let text = toml::to_string(&cfg).unwrap();
    assert_eq!(config::parse(&text, "again.toml").unwrap(), cfg);
}

const TENANTS: &str = r#"[[tenant]]
name = "acme"
prefixes = ["10.0.2.0/24", "2001:db8:2::/48"]
weight = 3
max_sessions = 100
new_sessions_per_sec = 50
burst = 200
[[tenant]]
name = "default"
max_sessions = 10
[[vip]]
name = "chat"
address = "10.200.0.1"
port = 443
  [[vip.tenant]]
  name = "acme"
  max_sessions = 40
"#;

#[test]
fn config_tenants_take_vip_overrides_and_round_trip() {
    let cfg = config::parse(&format!("{BASE}{TENANTS}"), "t.toml").unwrap();
    let acme = &cfg.tenants[0];
    assert_eq!(
        acme.prefixes,
        vec![
            "10.0.2.0/24".parse::<Cidr>().unwrap(),
            "2001:db8:2::/48".parse().unwrap()
        ]
    );
    let on_chat = acme.limits_on(&cfg.vips[0].tenants);
    assert_eq!((on_chat.max_sessions, on_chat.weight), (40, 3));
    assert_eq!(on_chat.gcra_ns(), (20_000_000, 200 * 20_000_000));
    let default = &cfg.tenants[1];
    assert!(default.prefixes.is_empty());
    assert_eq!(default.limits_on(&[]).gcra_ns(), (0, 0));
    let text = toml::to_string(&cfg).unwrap();
    assert_eq!(config::parse(&text, "again").unwrap(), cfg);
}

#[test]
fn config_tenant_burst_defaults_to_the_rate() {
    let cfg = config::parse(
        &format!("{BASE}[[tenant]]\nname = \"a\"\nprefixes = [\"10.0.0.0/8\"]\nnew_sessions_per_sec = 4\n"),
        "t.toml",
    )
    .unwrap();
    assert_eq!(
        cfg.tenants[0].limits_on(&[]).gcra_ns(),
        (250_000_000, 1_000_000_000)
    );
}

#[test]
fn config_refuses_more_tenants_than_the_data_plane_has_ids() {
    let mut text = BASE.to_owned();
    for i in 0..lb_common::MAX_TENANTS {
        text += &format!("[[tenant]]\nname = \"t{i}\"\nprefixes = [\"10.{i}.0.0/16\"]\n");
    }
    text += "[[tenant]]\nname = \"default\"\n";
    let e = config::parse(&text, "t.toml").unwrap_err();
    assert_eq!(
        e.messages(),
        vec!["t.toml:6:1: tenant: 64 tenants are configured besides \"default\"; allowed: at most 63 (the data plane's tenant ids)"]
    );
    // 63 named tenants and the default fit.
    let fits = text.replacen(
        "[[tenant]]\nname = \"t0\"\nprefixes = [\"10.0.0.0/16\"]\n",
        "",
        1,
    );
    assert!(config::parse(&fits, "t.toml").is_ok());
}

#[test]
fn config_refuses_more_tenant_prefixes_than_the_trie_holds() {
    let n = lb_common::MAX_TENANT_PREFIXES + 1;
    let list: Vec<String> = (0..n)
        .map(|i| format!("\"10.{}.{}.0/24\"", i / 256, i % 256))
        .collect();
    let text = format!(
        "{BASE}[[tenant]]\nname = \"a\"\nprefixes = [{}]\n",
        list.join(", ")
    );
    let e = config::parse(&text, "t.toml").unwrap_err();
    assert_eq!(e.issues.len(), 1, "{e}");
    assert_eq!(
        e.issues[0].message,
        "16385 prefixes are configured over all tenants; allowed: at most 16384 (the data plane's prefix table)"
    );
}

#[test]
fn config_warns_that_second_chance_vips_count_no_tenant_sessions() {
    let text = format!(
        "{BASE}{}",
        TENANTS.replace(
            "port = 443\n",
            "port = 443\nflow_state = \"second-chance\"\n"
        )
    );
    let (_, warnings) = config::parse_with_warnings(&text, "t.toml").unwrap();
    assert!(
        warnings.iter().any(|w| w.contains("vip[0].flow_state")
            && w.contains("tenants' max_sessions and shares do not apply")),
        "{warnings:?}"
    );
    let (_, none) = config::parse_with_warnings(&format!("{BASE}{TENANTS}"), "t.toml").unwrap();
    assert!(none.iter().all(|w| !w.contains("tenants'")), "{none:?}");
}

#[test]
fn tenant_list_from_json_runs_the_file_checks() {
    let good: config::TenantList = serde_json::from_value(serde_json::json!({
        "tenant": [{"name": "acme", "prefixes": ["10.0.2.0/24"], "weight": 2}]
    }))
    .unwrap();
    assert_eq!(good.tenants[0].weight, 2);
    assert_eq!(good.tenants[0].max_sessions, 0);
    let bad = serde_json::from_value::<config::TenantList>(serde_json::json!({
        "tenant": [
            {"name": "acme", "prefixes": ["10.0.2.1/24"]},
            {"name": "acme", "prefixes": ["10.0.3.0/24"], "burst": 3}
        ]
    }))
    .unwrap_err()
    .to_string();
    assert_eq!(
        bad,
        "tenants: tenant[0].prefixes[0]: \"10.0.2.1/24\" has bits set below the prefix length; allowed: the network address, \"10.0.2.0/24\"\n\
         tenants: tenant[1].burst: 3 is set without new_sessions_per_sec; allowed: a burst only with a rate (set new_sessions_per_sec, or leave burst out)"
    );
}
