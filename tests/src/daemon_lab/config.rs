//! The lab's options and the daemon configuration written from them.

use std::{
    collections::BTreeMap,
    net::{IpAddr, SocketAddr},
    path::PathBuf,
    time::Duration,
};

use anyhow::Result;

use super::{util::write_atomic, DaemonLab, HEALTH_PORT};
use crate::netns::{
    mac_string, TopologySpec, DEV, ENCAP_SRC_V4, ENCAP_SRC_V6, SEED, TCP_PORT, VIP4, VIP6,
};

/// A VIP of the daemon's configuration.
#[derive(Clone, Debug)]
pub struct VipDef {
    pub name: String,
    pub addr: SocketAddr,
    /// "tcp" or "udp".
    pub protocol: &'static str,
    pub priority: u8,
    /// Topology backend indexes; addressed over the VIP's family.
    pub backends: Vec<usize>,
    pub weight: u32,
    /// 0: no cap.
    pub max_sessions: u32,
    /// dcgm, engine (vllm) and roce sources on the backend's fake exporter (needs
    /// [`DaemonLabOptions::exporters`]) or simulated accelerator.
    pub telemetry: bool,
    /// The flow hash: "five-tuple" or "source" (client affinity).
    pub hash: &'static str,
    /// In-band signals (`inband = true`).
    pub inband: bool,
    /// `flow_state`: "table" (the default) or "second-chance".
    pub flow_state: &'static str,
    /// `affinity_window` in seconds (0: the daemon's default, none).
    pub affinity_secs: u32,
    /// `quic = "cid"` (a UDP VIP) with `quic_server_id` `base + i` (four hex digits) on the
    /// backend of topology index `i`; `None`: quic off (unless `quic` is given).
    pub quic_id_base: Option<u16>,
    /// QUIC connection-ID routing (`quic = "cid"`, a UDP VIP) with these settings written out:
    /// backend `i` gets the server ID [`lab_quic_server_id`]`(i, server_id_len)`, as the
    /// lab's QUIC servers ([`QuicServe`]) issue. Takes precedence over `quic_id_base`.
    pub quic: Option<QuicCid>,
}

/// A VIP's QUIC-LB settings: `quic_server_id_len` and `quic_config_rotation`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct QuicCid {
    pub server_id_len: u8,
    pub rotation: u8,
}

/// The QUIC servers of a lab (`sluice-testsrv serve --quic`): where every backend's server
/// listens, and the QUIC-LB connection IDs it issues (backend `i`: server ID
/// [`lab_quic_server_id`]`(i, server_id_len)`).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct QuicServe {
    pub listen: Vec<SocketAddr>,
    pub cid: QuicCid,
}

/// The QUIC-LB server ID of backend `index` in the lab: `0a` then zeros then `index + 1`,
/// `len` octets (`0a01`, `0a02`... for two; `01`, `02`... for one).
pub fn lab_quic_server_id(index: usize, len: u8) -> Vec<u8> {
    let mut id = vec![0u8; len as usize];
    if let Some(last) = id.last_mut() {
        *last = index as u8 + 1;
    }
    if len > 1 {
        id[0] = 0x0a;
    }
    id
}

/// Octets in hex, as the configuration writes a server ID.
pub fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

impl VipDef {
    /// A TCP VIP on every backend of a `backends`-backend topology, weight 100, no cap.
    pub fn tcp(name: &str, addr: SocketAddr, backends: usize) -> VipDef {
        VipDef {
            name: name.into(),
            addr,
            protocol: "tcp",
            priority: 0,
            backends: (0..backends).collect(),
            weight: 100,
            max_sessions: 0,
            telemetry: false,
            hash: "five-tuple",
            inband: false,
            flow_state: "table",
            affinity_secs: 0,
            quic_id_base: None,
            quic: None,
        }
    }

    /// A UDP VIP on every backend, weight 100, no cap, with QUIC connection-ID routing if
    /// `quic` is given (else plain 5-tuple steering).
    pub fn udp(name: &str, addr: SocketAddr, backends: usize, quic: Option<QuicCid>) -> VipDef {
        VipDef {
            protocol: "udp",
            quic,
            ..VipDef::tcp(name, addr, backends)
        }
    }
}

/// A `[[tenant]]` table of the daemon's configuration (0: the key's default, no limit).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct TenantDef {
    pub name: String,
    pub prefixes: Vec<String>,
    pub weight: u32,
    pub max_sessions: u32,
    pub new_sessions_per_sec: u32,
    pub burst: u32,
}

/// What [`DaemonLab::start`] builds.
#[derive(Clone, Debug)]
pub struct DaemonLabOptions {
    pub topology: TopologySpec,
    pub vips: Vec<VipDef>,
    /// Where every backend's token server listens, besides its own addresses on
    /// [`HEALTH_PORT`]. Default: TCP on [`VIP4`] and [`VIP6`] port [`TCP_PORT`].
    pub serve: Vec<SocketAddr>,
    /// More VIP addresses to put on every backend's `lo` (besides [`VIP4`] and [`VIP6`]).
    pub backend_vips: Vec<IpAddr>,
    /// A fake exporter per backend on `<backend v4>:`[`EXPORTER_PORT`](super::EXPORTER_PORT),
    /// serving the page [`DaemonLab::set_telemetry`] writes ([`FakeTelemetry::default`] at
    /// start).
    pub exporters: bool,
    /// Servers exit on their own after this long.
    pub server_lifetime: Duration,
    /// The `sluice-testsrv` binary.
    pub server: PathBuf,
    /// Configuration keys by section, as raw TOML values; [`DaemonLabOptions::set`].
    pub settings: BTreeMap<String, BTreeMap<String, String>>,
    /// The `sluice` binary of both daemons and the CLI; default: the one built next to the
    /// tests ([`sluice_binary`](super::sluice_binary)). The package test names the installed
    /// one.
    pub sluice: Option<PathBuf>,
    /// Put before the binary when a daemon (LB or backend host) starts, e.g. `setpriv` with
    /// a systemd unit's capabilities; empty by default.
    pub prefix: Vec<String>,
    /// Simulated accelerators instead of token servers (see the module docs).
    pub accel: Option<Accel>,
    /// QUIC token servers on every backend, in the token server's process.
    pub quic: Option<QuicServe>,
    /// `[[tenant]]` tables, as raw TOML written at the end of the file ([`TenantDef::table`]
    /// writes one).
    pub tenants: String,
}

/// The simulated accelerators of a lab.
#[derive(Clone, Debug)]
pub struct Accel {
    /// The `sluice-accel` binary.
    pub binary: PathBuf,
    /// More arguments for backend `i` (e.g. `--slow 0.5`), where given.
    pub args: Vec<Vec<String>>,
}

impl DaemonLabOptions {
    /// A lab of `backends` backends with the given VIPs and the fast test timings.
    pub fn new(server: impl Into<PathBuf>, backends: usize, vips: Vec<VipDef>) -> Self {
        let mut o = DaemonLabOptions {
            topology: TopologySpec::with_backends(backends),
            vips,
            serve: vec![
                SocketAddr::new(VIP4.into(), TCP_PORT),
                SocketAddr::new(VIP6.into(), TCP_PORT),
            ],
            backend_vips: Vec::new(),
            exporters: false,
            server_lifetime: Duration::from_secs(180),
            server: server.into(),
            settings: BTreeMap::new(),
            sluice: None,
            prefix: Vec::new(),
            accel: None,
            quic: None,
            tenants: String::new(),
        };
        for (section, key, value) in [
            ("daemon", "keep_dataplane_on_exit", "false"),
            ("daemon", "log_level", "\"info\""),
            ("dataplane", "flow_idle_timeout", "\"3s\""),
            ("dataplane", "conn_table_size", "65536"),
            ("dataplane", "affinity_table_size", "4096"),
            ("dataplane", "max_vips", "8"),
            ("health", "interval", "\"200ms\""),
            ("health", "timeout", "\"150ms\""),
            ("health", "rise", "2"),
            ("health", "fall", "2"),
            ("telemetry", "scrape_interval", "\"250ms\""),
            ("telemetry", "scrape_timeout", "\"200ms\""),
            ("telemetry", "stale_after", "\"1s\""),
            ("policy", "cooldown_base", "\"2s\""),
            ("policy", "slow_start", "\"2s\""),
        ] {
            o.set(section, key, value);
        }
        o
    }

    /// Sets `key` of `[section]` to `value`, written as is (TOML: quote strings).
    pub fn set(&mut self, section: &str, key: &str, value: &str) -> &mut Self {
        self.settings
            .entry(section.into())
            .or_default()
            .insert(key.into(), value.into());
        self
    }
}

/// What a backend's fake exporter reports: a dcgm-exporter, vLLM and node_exporter
/// (infiniband) page in one.
#[derive(Clone, Debug, PartialEq)]
pub struct FakeTelemetry {
    /// DCGM_FI_DEV_GPU_UTIL, 0..=100.
    pub gpu_util_pct: f64,
    pub gpu_temp_c: f64,
    /// vllm:kv_cache_usage_perc, 0..=1.
    pub kv_cache: f64,
    /// vllm:num_requests_waiting.
    pub queue: u32,
    /// ECN-marked RoCE packets per second (the counter grows at this rate).
    pub ecn_per_s: f64,
}

impl Default for FakeTelemetry {
    /// A calm backend: far below every threshold of the default policy.
    fn default() -> Self {
        FakeTelemetry {
            gpu_util_pct: 20.0,
            gpu_temp_c: 40.0,
            kv_cache: 0.2,
            queue: 0,
            ecn_per_s: 0.0,
        }
    }
}

impl FakeTelemetry {
    /// The exporter page, in the exporters' formats (see the fixtures under
    /// lb-core/tests/fixtures/telemetry/).
    pub fn page(&self) -> String {
        let gpu = r#"gpu="0",UUID="GPU-1d3b8c4a-9f62-4e0b-a7c5-2b81e0f3d6a9",device="nvidia0",modelName="NVIDIA H100 80GB HBM3",Hostname="lab""#;
        let model = r#"model_name="meta-llama/Llama-3.1-8B-Instruct",engine="0""#;
        let ib = r#"device="mlx5_0",port="1""#;
        format!(
            "# HELP DCGM_FI_DEV_GPU_UTIL GPU utilization (in %).\n\
             # TYPE DCGM_FI_DEV_GPU_UTIL gauge\n\
             DCGM_FI_DEV_GPU_UTIL{{{gpu}}} {}\n\
             # HELP DCGM_FI_DEV_FB_FREE Framebuffer memory free (in MiB).\n\
             # TYPE DCGM_FI_DEV_FB_FREE gauge\n\
             DCGM_FI_DEV_FB_FREE{{{gpu}}} 40000\n\
             # HELP DCGM_FI_DEV_FB_USED Framebuffer memory used (in MiB).\n\
             # TYPE DCGM_FI_DEV_FB_USED gauge\n\
             DCGM_FI_DEV_FB_USED{{{gpu}}} 41559\n\
             # HELP DCGM_FI_DEV_GPU_TEMP GPU temperature (in C).\n\
             # TYPE DCGM_FI_DEV_GPU_TEMP gauge\n\
             DCGM_FI_DEV_GPU_TEMP{{{gpu}}} {}\n\
             # HELP DCGM_FI_DEV_POWER_USAGE Power draw (in W).\n\
             # TYPE DCGM_FI_DEV_POWER_USAGE gauge\n\
             DCGM_FI_DEV_POWER_USAGE{{{gpu}}} 350.000000\n\
             # HELP DCGM_FI_DEV_CLOCKS_EVENT_REASONS Current clock event reasons (bitmask).\n\
             # TYPE DCGM_FI_DEV_CLOCKS_EVENT_REASONS gauge\n\
             DCGM_FI_DEV_CLOCKS_EVENT_REASONS{{{gpu}}} 0\n\
             # HELP vllm:num_requests_running Number of requests in model execution batches.\n\
             # TYPE vllm:num_requests_running gauge\n\
             vllm:num_requests_running{{{model}}} 4.0\n\
             # HELP vllm:num_requests_waiting Number of requests waiting to be processed.\n\
             # TYPE vllm:num_requests_waiting gauge\n\
             vllm:num_requests_waiting{{{model}}} {}.0\n\
             # HELP vllm:kv_cache_usage_perc KV-cache usage. 1 means 100 percent usage.\n\
             # TYPE vllm:kv_cache_usage_perc gauge\n\
             vllm:kv_cache_usage_perc{{{model}}} {}\n\
             # HELP node_infiniband_np_ecn_marked_roce_packets_received_total Number of ECN marked RoCEv2 packets received.\n\
             # TYPE node_infiniband_np_ecn_marked_roce_packets_received_total counter\n\
             node_infiniband_np_ecn_marked_roce_packets_received_total{{{ib}}} {{{{counter:{}}}}}\n\
             # HELP node_infiniband_np_cnp_packets_sent_total Number of CNP packets sent.\n\
             # TYPE node_infiniband_np_cnp_packets_sent_total counter\n\
             node_infiniband_np_cnp_packets_sent_total{{{ib}}} 0\n",
            self.gpu_util_pct, self.gpu_temp_c, self.queue, self.kv_cache, self.ecn_per_s
        )
    }
}

impl DaemonLab {
    /// The configuration the daemon runs with (written to `self.config`).
    pub fn config_text(&self) -> String {
        let o = &self.opts;
        let mut s = BTreeMap::<String, BTreeMap<String, String>>::new();
        let mut put = |sec: &str, k: &str, v: String| {
            s.entry(sec.into()).or_default().insert(k.into(), v);
        };
        put(
            "daemon",
            "bpffs",
            toml_str(&self.bpffs.display().to_string()),
        );
        put(
            "daemon",
            "state_file",
            toml_str(&self.state_file.display().to_string()),
        );
        put(
            "admin",
            "socket",
            toml_str(&self.socket.display().to_string()),
        );
        put(
            "admin",
            "audit_log",
            toml_str(&self.audit_log.display().to_string()),
        );
        put("metrics", "enabled", "true".into());
        put("metrics", "listen", toml_str(&self.metrics.to_string()));
        put(
            "dataplane",
            "interfaces",
            format!("[{{ name = \"{DEV}\", mode = \"native\" }}]"),
        );
        put("dataplane", "hash_seed", format!("{SEED:#x}"));
        put(
            "dataplane",
            "encap_source_v4",
            toml_str(&format!("{ENCAP_SRC_V4}/16")),
        );
        put(
            "dataplane",
            "encap_source_v6",
            toml_str(&format!("{ENCAP_SRC_V6}/96")),
        );
        put(
            "dataplane",
            "fallback_mac",
            toml_str(&mac_string(&self.topo.gateway_mac)),
        );
        for (sec, kv) in &o.settings {
            for (k, v) in kv {
                put(sec, k, v.clone());
            }
        }
        let mut text = format!("# daemon lab {} (generated)\n", self.id);
        for sec in ["daemon", "admin", "metrics", "dataplane"] {
            section(&mut text, sec, s.get(sec));
        }
        for v in &o.vips {
            text += &format!(
                "\n[[vip]]\nname = {}\naddress = \"{}\"\nport = {}\nprotocol = \"{}\"\n\
                 priority = {}\nring_size = 4099\nhash = \"{}\"\n",
                toml_str(&v.name),
                v.addr.ip(),
                v.addr.port(),
                v.protocol,
                v.priority,
                v.hash
            );
            if v.inband {
                text += "inband = true\n";
            }
            if v.flow_state != "table" {
                text += &format!("flow_state = \"{}\"\n", v.flow_state);
            }
            if v.affinity_secs > 0 {
                text += &format!("affinity_window = \"{}s\"\n", v.affinity_secs);
            }
            if let Some(q) = v.quic {
                text += &format!(
                    "quic = \"cid\"\nquic_server_id_len = {}\nquic_config_rotation = {}\n",
                    q.server_id_len, q.rotation
                );
            } else if v.quic_id_base.is_some() {
                text += "quic = \"cid\"\n";
            }
            for &i in &v.backends {
                let b = &self.topo.backends[i];
                text += &format!(
                    "\n  [[vip.backend]]\n  address = \"{}\"\n  weight = {}\n  \
                     max_sessions = {}\n  labels = {{ host = \"{}\" }}\n  \
                     health = {{ kind = \"tcp\", port = {HEALTH_PORT} }}\n",
                    b.addr(v.addr.is_ipv6()),
                    v.weight,
                    v.max_sessions,
                    b.name
                );
                if let Some(q) = v.quic {
                    text += &format!(
                        "  quic_server_id = \"{}\"\n",
                        hex(&lab_quic_server_id(i, q.server_id_len))
                    );
                } else if let Some(base) = v.quic_id_base {
                    text += &format!("  quic_server_id = \"{:04x}\"\n", base + i as u16);
                }
                if v.telemetry {
                    // A simulated accelerator serves one page per exporter; the fake
                    // exporter serves them all on one.
                    let [dcgm, engine, roce] = if self.opts.accel.is_some() {
                        let at = SocketAddr::new(b.addr(false), HEALTH_PORT);
                        ["dcgm", "metrics", "roce"].map(|p| format!("http://{at}/{p}"))
                    } else {
                        [(); 3].map(|_| format!("http://{}/metrics", self.exporter_addr(i)))
                    };
                    text += &format!(
                        "  dcgm = {{ url = \"{dcgm}\" }}\n  \
                         engine = {{ url = \"{engine}\", kind = \"vllm\" }}\n  \
                         roce = {{ url = \"{roce}\", device = \"mlx5_0\", port = \"1\" }}\n"
                    );
                }
            }
        }
        for sec in s.keys() {
            if !["daemon", "admin", "metrics", "dataplane"].contains(&sec.as_str()) {
                section(&mut text, sec, s.get(sec));
            }
        }
        text += &o.tenants;
        text
    }

    pub(super) fn write_config(&self) -> Result<()> {
        write_atomic(&self.config, &self.config_text())
    }

    /// Changes the options and rewrites the configuration (the daemon reads it at its next
    /// start).
    pub fn reconfigure(&mut self, f: impl FnOnce(&mut DaemonLabOptions)) -> Result<()> {
        f(&mut self.opts);
        self.write_config()
    }
}

impl TenantDef {
    /// The `[[tenant]]` table; keys left at 0 are not written (their defaults).
    pub fn table(&self) -> String {
        let prefixes: Vec<String> = self.prefixes.iter().map(|p| toml_str(p)).collect();
        let mut text = format!("\n[[tenant]]\nname = {}\n", toml_str(&self.name));
        if !prefixes.is_empty() {
            text += &format!("prefixes = [{}]\n", prefixes.join(", "));
        }
        for (key, value) in [
            ("weight", self.weight),
            ("max_sessions", self.max_sessions),
            ("new_sessions_per_sec", self.new_sessions_per_sec),
            ("burst", self.burst),
        ] {
            if value > 0 {
                text += &format!("{key} = {value}\n");
            }
        }
        text
    }
}

fn toml_str(s: &str) -> String {
    format!("{s:?}")
}

fn section(text: &mut String, name: &str, kv: Option<&BTreeMap<String, String>>) {
    let Some(kv) = kv else { return };
    *text += &format!("\n[{name}]\n");
    for (k, v) in kv {
        *text += &format!("{k} = {v}\n");
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_tenant_table_writes_the_keys_it_sets() {
        let t = TenantDef {
            name: "noisy".into(),
            prefixes: vec!["10.111.0.192/27".into(), "2001:db8:2::/48".into()],
            weight: 1,
            max_sessions: 4,
            new_sessions_per_sec: 0,
            burst: 0,
        };
        assert_eq!(
            t.table(),
            "\n[[tenant]]\nname = \"noisy\"\nprefixes = [\"10.111.0.192/27\", \"2001:db8:2::/48\"]\n\
             weight = 1\nmax_sessions = 4\n"
        );
    }

    #[test]
    fn lab_server_ids_are_distinct_and_not_zero() {
        assert_eq!(hex(&lab_quic_server_id(0, 2)), "0a01");
        assert_eq!(hex(&lab_quic_server_id(2, 2)), "0a03");
        assert_eq!(hex(&lab_quic_server_id(1, 1)), "02");
        assert_eq!(hex(&lab_quic_server_id(0, 4)), "0a000001");
    }

    #[test]
    fn the_fake_page_has_every_exporter() {
        let p = FakeTelemetry {
            ecn_per_s: 5000.0,
            ..FakeTelemetry::default()
        }
        .page();
        for m in [
            "DCGM_FI_DEV_GPU_UTIL{",
            "vllm:num_requests_waiting{",
            "vllm:kv_cache_usage_perc{",
            "node_infiniband_np_ecn_marked_roce_packets_received_total{device=\"mlx5_0\",port=\"1\"} {{counter:5000}}",
        ] {
            assert!(p.contains(m), "{m} missing from\n{p}");
        }
    }
}
