//! The daemon's TOML configuration: schema, parsing and validation.
//!
//! [`load`] / [`parse`] turn a file into a validated [`Config`]; every field of the result is
//! in range and consistent with the others, so the daemon can program the data plane from it
//! without further checks. The schema is documented key by key in `configs/sluice.toml`.
//!
//! Parsing runs in three stages:
//!
//! 1. TOML syntax. The first syntax error is reported with its line and column.
//! 2. Shape, with serde and `deny_unknown_fields` on every table: unknown keys and values of
//!    the wrong TOML type. Each section, each `[[vip]]` and each `[[vip.backend]]` is read on
//!    its own, so one mistake per table is reported, for every table.
//! 3. Semantics: ranges, formats, uniqueness and cross-key rules. All violations are
//!    collected.
//!
//! Every reported problem is one line of the form
//! `FILE:LINE:COLUMN: KEY.PATH: VALUE problem; allowed: what is accepted`, where the key path
//! uses array indexes (`vip[1].backend[0].weight`) and the line and column point at the
//! offending value (or, for a missing key, at the table that lacks it). Problems that do not
//! stop the daemon from working (a Maglev ring that is small for its backends, say) are
//! returned separately as warnings by [`parse_with_warnings`] / [`load_with_warnings`].
//!
//! Overlapping VIPs: a VIP with `port = 0` (all ports) may share its address and protocol
//! with VIPs on specific ports. The data plane looks up the exact (address, port, protocol)
//! first and falls back to the address's port-0 VIP, so the specific VIPs take their ports
//! and the port-0 VIP takes the rest. Only identical (address, port, protocol) triples are
//! rejected.
//!
//! [`Config`] implements `Serialize` in the same shape as the file (durations as humantime
//! strings, addresses and prefixes as strings), so `toml::to_string(&config)` parses back to
//! an equal `Config`; it also implements `Deserialize`, which runs the same validation (e.g.
//! for state persisted as JSON).

use std::{
    collections::{BTreeMap, HashMap},
    fmt,
    net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr},
    ops::Range,
    path::{Path, PathBuf},
    str::FromStr,
    time::Duration,
};

use lb_common::{
    LbConfig, VipKey, AFFINITY_TABLE_SIZE, CONN_TABLE_SIZE, FAMILY_V4, FAMILY_V6, MAX_BACKENDS,
    MAX_VIPS, PROTO_TCP, PROTO_UDP, RING_SIZE_MAX, VIP_F_SECOND_CHANCE, VIP_F_SRC_HASH,
};
use serde::{de, Deserialize, Serialize, Serializer};
use toml::{
    de::{DeTable, DeValue, ValueDeserializer},
    Spanned,
};

use crate::{
    addr::to_words,
    maglev::{is_prime, DEFAULT_RING_SIZE},
};

pub mod rules;

// ------------------------------------------------------------------------------------------
// Public types
// ------------------------------------------------------------------------------------------

/// A validated configuration. Every section but `dataplane` may be absent from the file and
/// then takes its `Default`.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct Config {
    pub daemon: DaemonConfig,
    pub admin: AdminConfig,
    pub metrics: MetricsConfig,
    pub dataplane: DataplaneConfig,
    /// The `[[vip]]` tables, in file order.
    #[serde(rename = "vip")]
    pub vips: Vec<VipConfig>,
    pub health: HealthConfig,
    pub telemetry: TelemetryConfig,
    pub policy: PolicyConfig,
}

/// `[daemon]`
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub struct DaemonConfig {
    /// Directory (on a bpffs mount) where programs and maps are pinned. Absolute.
    pub bpffs: PathBuf,
    /// Runtime state written by the daemon. Absolute.
    pub state_file: PathBuf,
    /// On SIGTERM, leave XDP attached and maps pinned so a restart or upgrade takes over
    /// without dropping traffic.
    pub keep_dataplane_on_exit: bool,
    pub log_format: LogFormat,
    pub log_level: LogLevel,
}

impl Default for DaemonConfig {
    fn default() -> Self {
        Self {
            bpffs: PathBuf::from("/sys/fs/bpf/sluice"),
            state_file: PathBuf::from("/var/lib/sluice/state.json"),
            keep_dataplane_on_exit: false,
            log_format: LogFormat::Human,
            log_level: LogLevel::Info,
        }
    }
}

/// `[admin]`: the local control socket.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub struct AdminConfig {
    /// Unix socket path. Absolute, at most 107 bytes.
    pub socket: PathBuf,
    /// Permission bits of the socket. Never grants read or write to others; grants
    /// group bits only when `group` is set.
    pub mode: SocketMode,
    /// Group owning the socket (a name, resolved at runtime).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub group: Option<String>,
    /// Append-only JSON-lines log of admin commands. Absolute.
    pub audit_log: PathBuf,
}

impl Default for AdminConfig {
    fn default() -> Self {
        Self {
            socket: PathBuf::from("/run/sluice/admin.sock"),
            mode: SocketMode(0o600),
            group: None,
            audit_log: PathBuf::from("/var/log/sluice/audit.jsonl"),
        }
    }
}

/// `[metrics]`: the Prometheus endpoint.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub struct MetricsConfig {
    pub enabled: bool,
    /// Port is never 0.
    pub listen: SocketAddr,
}

impl Default for MetricsConfig {
    fn default() -> Self {
        Self {
            enabled: true,
            listen: SocketAddr::from(([127, 0, 0, 1], 9464)),
        }
    }
}

/// `[dataplane]` (required).
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub struct DataplaneConfig {
    /// At least one; names unique.
    pub interfaces: Vec<InterfaceConfig>,
    /// Seed of the flow hash; must be the same on every LB host.
    pub hash_seed: u32,
    /// Outer IPv4 source prefix for IPIP to IPv4 backends (prefix length 8..=32). Present
    /// whenever some backend is IPv4.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub encap_source_v4: Option<Cidr>,
    /// Outer IPv6 source prefix for encapsulation to IPv6 backends (prefix length
    /// 96..=128). Present whenever some backend is IPv6.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub encap_source_v6: Option<Cidr>,
    /// Next-hop MAC when the FIB has no neighbour; unicast. `None`: drop instead.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub fallback_mac: Option<Mac>,
    /// 1024..=16777216.
    pub conn_table_size: u32,
    /// 1024..=16777216.
    pub affinity_table_size: u32,
    /// 1..=128 (`lb_common::MAX_VIPS`); at least the number of `[[vip]]` tables.
    pub max_vips: u32,
    /// New flows per second per CPU above which the flood guard bypasses the connection
    /// table; 0 = off.
    pub flood_new_flows_per_sec: u32,
    /// A connection seen within this long counts as active (drain completion, session
    /// counts for admission control). Token streams pause between tokens, so not too short.
    #[serde(with = "duration_str")]
    pub flow_idle_timeout: Duration,
}

impl DataplaneConfig {
    pub const DEFAULT_MAX_VIPS: u32 = 16;

    /// The data plane's global settings (element 0 of the `CONFIG` map).
    pub fn lb_config(&self) -> LbConfig {
        let (v4, v4_mask) = match self.encap_source_v4 {
            Some(c) => (c.addr_words()[0], c.hostmask_last_word()),
            None => (0, 0),
        };
        let (v6, v6_mask) = match self.encap_source_v6 {
            Some(c) => (c.addr_words(), c.hostmask_last_word()),
            None => ([0; 4], 0),
        };
        LbConfig {
            encap_src_v4: v4,
            encap_src_v4_hostmask: v4_mask,
            encap_src_v6: v6,
            encap_src_v6_hostmask: v6_mask,
            hash_seed: self.hash_seed,
            fallback_mac: self.fallback_mac.map_or([0; 6], |m| m.octets()),
            flood_new_flows_per_sec: self.flood_new_flows_per_sec,
            ..LbConfig::default()
        }
    }
}

/// One entry of `dataplane.interfaces`.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub struct InterfaceConfig {
    /// Linux interface name: 1..=15 bytes, no `/`, `:` or whitespace, not `.` or `..`.
    pub name: String,
    pub mode: AttachMode,
}

/// One `[[vip]]`.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub struct VipConfig {
    /// Unique; 1..=32 characters of `a-z 0-9 - _`.
    pub name: String,
    /// Unicast IPv4 or IPv6 address.
    pub address: IpAddr,
    /// 0 = every port of the address and protocol not taken by a specific-port VIP.
    pub port: u16,
    pub protocol: Protocol,
    pub hash: HashMode,
    /// How long a client's reconnections stay on its backend; whole seconds in 0s..=24h,
    /// `Duration::ZERO` = off.
    #[serde(with = "duration_str")]
    pub affinity_window: Duration,
    /// Admission class, 0 (highest) ..= 7.
    pub priority: u8,
    /// Maglev ring size: a prime <= 65537 and >= the number of backends.
    pub ring_size: u32,
    /// Where TCP flows' state lives: the LB's connection table, or the backends (second
    /// chance; every backend must run `sluice_decap`).
    pub flow_state: FlowState,
    /// The `[[vip.backend]]` tables, in file order; addresses unique.
    #[serde(rename = "backend")]
    pub backends: Vec<BackendConfig>,
}

impl VipConfig {
    /// `lb_common::FAMILY_V4` or `FAMILY_V6`.
    pub fn family(&self) -> u8 {
        family_of(self.address)
    }

    /// The key of this VIP in the data plane's VIP map (port in network order).
    pub fn vip_key(&self) -> VipKey {
        vip_key(self.address, self.port, self.protocol)
    }

    /// `VipMeta::flags` for this VIP.
    pub fn flags(&self) -> u32 {
        self.hash.vip_flags() | self.flow_state.vip_flags()
    }

    /// `VipMeta::affinity_secs` (0 = off).
    pub fn affinity_secs(&self) -> u32 {
        // Validation bounds the window to 24h.
        rules::secs_u32(self.affinity_window)
    }
}

/// One `[[vip.backend]]`.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub struct BackendConfig {
    /// Same family as the VIP, or IPv6 for an IPv4 VIP (IPv4-in-IPv6).
    pub address: IpAddr,
    /// 0..=65535; 0 takes no new flows.
    pub weight: u32,
    /// Keys and values non-empty, of `A-Z a-z 0-9 _ . -`.
    pub labels: BTreeMap<String, String>,
    /// Admission cap on concurrent sessions; 0 = no cap.
    pub max_sessions: u32,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub dcgm: Option<DcgmConfig>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub engine: Option<EngineConfig>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub roce: Option<RoceConfig>,
    /// Always resolved: the file's value, or TCP on the VIP's port.
    pub health: HealthCheck,
}

impl BackendConfig {
    pub const DEFAULT_WEIGHT: u32 = rules::WEIGHT_DEFAULT;

    /// `lb_common::FAMILY_V4` or `FAMILY_V6` (the outer header's family).
    pub fn family(&self) -> u8 {
        family_of(self.address)
    }
}

/// DCGM exporter scraped for this backend's GPUs.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub struct DcgmConfig {
    /// http:// URL of the exporter's metrics.
    pub url: String,
    /// Values of the `gpu` label to select (empty: every GPU the exporter reports).
    pub gpus: Vec<String>,
    /// Values of the `UUID` label to select (empty: no UUID filter).
    pub uuids: Vec<String>,
}

/// Inference engine metrics endpoint for this backend.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub struct EngineConfig {
    /// http:// URL of the engine's Prometheus metrics.
    pub url: String,
    pub kind: EngineKind,
    /// Value of the `model_name` label to select; `None` = all models.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub model: Option<String>,
}

/// Where this backend's RoCE congestion counters (ECN marks, CNPs) come from.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
#[serde(untagged)]
pub enum RoceConfig {
    /// Read locally from a `hw_counters` directory (the backend is this host).
    Sysfs { sysfs: PathBuf },
    /// Scraped from an exporter, selecting one device and port.
    Exporter {
        url: String,
        device: String,
        port: String,
    },
}

/// How a backend's liveness is probed.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
#[serde(tag = "kind", rename_all = "lowercase")]
pub enum HealthCheck {
    /// TCP connect to `port`.
    Tcp { port: u16 },
    /// HTTP GET `path` on `port`, healthy when the status is `expect_status`.
    Http {
        port: u16,
        path: String,
        expect_status: u16,
    },
}

impl HealthCheck {
    pub fn port(&self) -> u16 {
        match *self {
            HealthCheck::Tcp { port } | HealthCheck::Http { port, .. } => port,
        }
    }
}

/// `[health]`: probe timing shared by all backends.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub struct HealthConfig {
    /// > 0.
    #[serde(with = "duration_str")]
    pub interval: Duration,
    /// > 0 and < `interval`.
    #[serde(with = "duration_str")]
    pub timeout: Duration,
    /// Consecutive successes to mark a backend up, 1..=10.
    pub rise: u32,
    /// Consecutive failures to mark a backend down, 1..=10.
    pub fall: u32,
}

impl Default for HealthConfig {
    fn default() -> Self {
        Self {
            interval: Duration::from_secs(1),
            timeout: Duration::from_millis(500),
            rise: 2,
            fall: 2,
        }
    }
}

/// `[telemetry]`: scraping of the backends' dcgm/engine/roce endpoints.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub struct TelemetryConfig {
    /// > 0.
    #[serde(with = "duration_str")]
    pub scrape_interval: Duration,
    /// > 0 and < `scrape_interval`.
    #[serde(with = "duration_str")]
    pub scrape_timeout: Duration,
    /// A sample older than this is ignored; > `scrape_interval`.
    #[serde(with = "duration_str")]
    pub stale_after: Duration,
    /// 1..=256.
    pub max_concurrent_scrapes: u32,
}

impl Default for TelemetryConfig {
    fn default() -> Self {
        Self {
            scrape_interval: Duration::from_secs(1),
            scrape_timeout: Duration::from_millis(500),
            stale_after: Duration::from_secs(3),
            max_concurrent_scrapes: 16,
        }
    }
}

/// `[policy]`: adaptive steering.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct PolicyConfig {
    /// Smoothing factor of the signal EWMAs, 0 < a <= 1.
    pub ewma_alpha: f64,
    /// Number of weight steps between 0 and full, 2..=64.
    pub weight_levels: u32,
    /// Relative change a signal must make to move a level, 0 <= h < 0.5.
    pub hysteresis: f64,
    /// GPU utilisation (0..1] at or above which a GPU counts as busy (scored only for a
    /// backend without engine metrics).
    pub gpu_util_high: f64,
    /// KV-cache usage (0..1] at which a backend counts as saturated.
    pub kv_cache_high: f64,
    /// Waiting requests at which a backend counts as saturated, >= 1.
    pub queue_depth_high: u32,
    /// GPU temperature (°C) above which a backend counts as throttling, 0 < t <= 150.
    pub temp_high_c: f64,
    /// ECN-marked packets per second above which a backend's fabric counts as congested.
    pub ecn_rate_high: f64,
    /// CNPs per second above which a backend's fabric counts as congested.
    pub cnp_rate_high: f64,
    /// First cooldown after a backend is demoted, > 0.
    #[serde(with = "duration_str")]
    pub cooldown_base: Duration,
    /// Cap of the exponential cooldown, >= `cooldown_base`.
    #[serde(with = "duration_str")]
    pub cooldown_max: Duration,
    /// Window in which repeated demotions count as flapping, > 0.
    #[serde(with = "duration_str")]
    pub flap_window: Duration,
    /// Healthy time after which a backend's cooldown resets, > 0.
    #[serde(with = "duration_str")]
    pub stable_period: Duration,
    /// Ramp from 0 to full weight for a backend coming up; 0 = off.
    #[serde(with = "duration_str")]
    pub slow_start: Duration,
    pub shed: ShedMode,
}

impl Default for PolicyConfig {
    fn default() -> Self {
        Self {
            ewma_alpha: 0.3,
            weight_levels: 8,
            hysteresis: 0.1,
            gpu_util_high: 0.95,
            kv_cache_high: 0.8,
            queue_depth_high: 5,
            temp_high_c: 85.0,
            ecn_rate_high: 1000.0,
            cnp_rate_high: 500.0,
            cooldown_base: Duration::from_secs(10),
            cooldown_max: Duration::from_secs(600),
            flap_window: Duration::from_secs(300),
            stable_period: Duration::from_secs(120),
            slow_start: Duration::from_secs(30),
            shed: ShedMode::Drop,
        }
    }
}

/// A keyword-valued setting: parses from and displays as its TOML spelling.
pub trait Keyword: Sized + Copy + 'static {
    /// Every value, in documentation order.
    const ALL: &'static [Self];
    fn as_str(self) -> &'static str;
}

/// Error of a keyword's `FromStr`: the input and the accepted spellings.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct UnknownKeyword {
    pub input: String,
    /// As [`allowed_keywords`] renders them.
    pub allowed: String,
}

impl fmt::Display for UnknownKeyword {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "{:?} is not recognised; allowed: {}",
            self.input, self.allowed
        )
    }
}

impl std::error::Error for UnknownKeyword {}

macro_rules! keyword_enum {
    ($(#[$m:meta])* $name:ident { $($(#[$vm:meta])* $var:ident = $s:literal),+ $(,)? }) => {
        $(#[$m])*
        #[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
        pub enum $name {
            $($(#[$vm])* $var),+
        }

        impl Keyword for $name {
            const ALL: &'static [Self] = &[$($name::$var),+];
            fn as_str(self) -> &'static str {
                match self {
                    $($name::$var => $s),+
                }
            }
        }

        impl fmt::Display for $name {
            fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                f.write_str(self.as_str())
            }
        }

        impl FromStr for $name {
            type Err = UnknownKeyword;
            fn from_str(s: &str) -> Result<Self, UnknownKeyword> {
                match s {
                    $($s => Ok($name::$var),)+
                    _ => Err(UnknownKeyword { input: s.to_owned(), allowed: allowed_keywords::<$name>() }),
                }
            }
        }

        impl Serialize for $name {
            fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
                s.serialize_str(self.as_str())
            }
        }

        // The admin API and the state file read the same spellings, with the same words for
        // a wrong one.
        impl<'de> Deserialize<'de> for $name {
            fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
                String::deserialize(d)?.parse().map_err(de::Error::custom)
            }
        }
    };
}

keyword_enum!(
    /// `daemon.log_format`
    LogFormat { Human = "human", Json = "json" }
);
keyword_enum!(
    /// `daemon.log_level`
    LogLevel { Error = "error", Warn = "warn", Info = "info", Debug = "debug", Trace = "trace" }
);
keyword_enum!(
    /// XDP attach mode of an interface.
    AttachMode {
        /// Native (driver) mode when the driver supports it, else generic.
        Auto = "auto",
        Native = "native",
        Generic = "generic",
    }
);
keyword_enum!(
    /// L4 protocol of a VIP.
    Protocol { Tcp = "tcp", Udp = "udp" }
);
keyword_enum!(
    /// What a VIP's Maglev lookup hashes.
    #[derive(Default)]
    HashMode {
        /// The 5-tuple: each connection is placed independently.
        #[default]
        FiveTuple = "five-tuple",
        /// The client address: all of a client's connections reach one backend.
        Source = "source",
    }
);
keyword_enum!(
    /// Where a VIP's TCP flow state lives.
    #[derive(Default)]
    FlowState {
        /// The LB's connection table pins each flow.
        #[default]
        Table = "table",
        /// The ring with its history; backends pass on what they have no socket for.
        SecondChance = "second-chance",
    }
);
keyword_enum!(
    /// Inference engine of an `engine` endpoint.
    EngineKind { Vllm = "vllm", Sglang = "sglang" }
);
keyword_enum!(
    /// How new sessions are refused when admission control is saturated.
    ShedMode {
        /// Drop the first packet (the client retries).
        Drop = "drop",
        /// Answer TCP with RST (fails fast; UDP falls back to drop).
        Rst = "rst",
    }
);

impl HashMode {
    /// Its `VIP_F_*` bit.
    pub fn vip_flags(self) -> u32 {
        match self {
            HashMode::FiveTuple => 0,
            HashMode::Source => VIP_F_SRC_HASH,
        }
    }
}

impl FlowState {
    /// Its `VIP_F_*` bit.
    pub fn vip_flags(self) -> u32 {
        match self {
            FlowState::Table => 0,
            FlowState::SecondChance => VIP_F_SECOND_CHANCE,
        }
    }
}

/// The data plane's key of a VIP.
pub fn vip_key(address: IpAddr, port: u16, protocol: Protocol) -> VipKey {
    let (addr, family) = to_words(address);
    VipKey {
        addr,
        port: port.to_be(),
        proto: protocol.number(),
        family,
    }
}

impl Protocol {
    /// IP protocol number (`lb_common::PROTO_TCP` / `PROTO_UDP`).
    pub fn number(self) -> u8 {
        match self {
            Protocol::Tcp => PROTO_TCP,
            Protocol::Udp => PROTO_UDP,
        }
    }
}

/// The spellings of a keyword type, quoted: `"tcp", "udp"`.
pub fn allowed_keywords<K: Keyword>() -> String {
    K::ALL
        .iter()
        .map(|k| format!("{:?}", k.as_str()))
        .collect::<Vec<_>>()
        .join(", ")
}

/// Unix permission bits of the admin socket. Parses from and displays as four octal digits
/// (`"0600"`).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct SocketMode(pub u32);

impl SocketMode {
    pub fn bits(self) -> u32 {
        self.0
    }
}

impl fmt::Display for SocketMode {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{:04o}", self.0)
    }
}

impl FromStr for SocketMode {
    type Err = String;
    /// Three or four octal digits, at most 0777 (no setuid, setgid or sticky bits).
    fn from_str(s: &str) -> Result<Self, String> {
        let ok = (3..=4).contains(&s.len())
            && s.bytes().all(|b| (b'0'..=b'7').contains(&b))
            && (s.len() == 3 || s.starts_with('0'));
        if !ok {
            return Err(format!("{s:?} is not an octal mode"));
        }
        Ok(SocketMode(
            u32::from_str_radix(s, 8).expect("checked digits"),
        ))
    }
}

impl Serialize for SocketMode {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        s.collect_str(self)
    }
}

/// An IP prefix with zero host bits, written `ADDRESS/LENGTH`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct Cidr {
    pub addr: IpAddr,
    pub prefix: u8,
}

/// Why a string is not a [`Cidr`].
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum CidrError {
    /// Not `ADDRESS/LENGTH`.
    Syntax,
    /// The length exceeds the family's bits.
    PrefixTooLong { prefix: u32, max: u8 },
    /// Bits below the prefix are set; `network` is the prefix with them cleared.
    HostBits { network: Cidr },
}

impl fmt::Display for CidrError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            CidrError::Syntax => f.write_str("not ADDRESS/LENGTH"),
            CidrError::PrefixTooLong { prefix, max } => {
                write!(f, "prefix length {prefix} exceeds {max}")
            }
            CidrError::HostBits { network } => {
                write!(f, "host bits are set (the network is {network})")
            }
        }
    }
}

impl std::error::Error for CidrError {}

impl Cidr {
    /// `lb_common::FAMILY_V4` or `FAMILY_V6`.
    pub fn family(&self) -> u8 {
        family_of(self.addr)
    }

    /// The address as the data plane's words (wire bytes in each word).
    pub fn addr_words(&self) -> [u32; 4] {
        to_words(self.addr).0
    }

    /// Mask of the host bits that fall in the address's last 32 bits, as the data plane
    /// stores words (network byte order in memory): `LbConfig::encap_src_v4_hostmask` /
    /// `encap_src_v6_hostmask`. E.g. `172.16.0.0/16` gives the bytes `00 00 ff ff`, `/32`
    /// gives 0, and an IPv6 `/96` gives `ff ff ff ff`.
    pub fn hostmask_last_word(&self) -> u32 {
        let bits = self.max_prefix() as u32;
        // Prefix bits that lie within the last word.
        let in_last = (self.prefix as u32 + 32).saturating_sub(bits);
        let mask = u32::MAX.checked_shr(in_last).unwrap_or(0);
        u32::from_ne_bytes(mask.to_be_bytes())
    }

    fn max_prefix(&self) -> u8 {
        match self.addr {
            IpAddr::V4(_) => 32,
            IpAddr::V6(_) => 128,
        }
    }
}

impl fmt::Display for Cidr {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}/{}", self.addr, self.prefix)
    }
}

impl FromStr for Cidr {
    type Err = CidrError;
    fn from_str(s: &str) -> Result<Self, CidrError> {
        let (a, p) = s.split_once('/').ok_or(CidrError::Syntax)?;
        let addr: IpAddr = a.parse().map_err(|_| CidrError::Syntax)?;
        if p.is_empty() || p.len() > 3 || !p.bytes().all(|b| b.is_ascii_digit()) {
            return Err(CidrError::Syntax);
        }
        let prefix: u32 = p.parse().map_err(|_| CidrError::Syntax)?;
        let max = match addr {
            IpAddr::V4(_) => 32,
            IpAddr::V6(_) => 128,
        };
        if prefix > max as u32 {
            return Err(CidrError::PrefixTooLong { prefix, max });
        }
        let prefix = prefix as u8;
        let network = match addr {
            IpAddr::V4(v4) => {
                let mask = u32::MAX.checked_shl(32 - prefix as u32).unwrap_or(0);
                IpAddr::V4(Ipv4Addr::from(u32::from(v4) & mask))
            }
            IpAddr::V6(v6) => {
                let mask = u128::MAX.checked_shl(128 - prefix as u32).unwrap_or(0);
                IpAddr::V6(Ipv6Addr::from(u128::from(v6) & mask))
            }
        };
        if network != addr {
            return Err(CidrError::HostBits {
                network: Cidr {
                    addr: network,
                    prefix,
                },
            });
        }
        Ok(Cidr { addr, prefix })
    }
}

impl Serialize for Cidr {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        s.collect_str(self)
    }
}

/// An Ethernet address, written as six colon-separated hex octets.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct Mac(pub [u8; 6]);

impl Mac {
    pub fn octets(&self) -> [u8; 6] {
        self.0
    }

    /// Group bit set (includes broadcast).
    pub fn is_multicast(&self) -> bool {
        self.0[0] & 1 != 0
    }

    pub fn is_zero(&self) -> bool {
        self.0 == [0; 6]
    }
}

impl fmt::Display for Mac {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let o = self.0;
        write!(
            f,
            "{:02x}:{:02x}:{:02x}:{:02x}:{:02x}:{:02x}",
            o[0], o[1], o[2], o[3], o[4], o[5]
        )
    }
}

impl FromStr for Mac {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        let mut o = [0u8; 6];
        let mut parts = s.split(':');
        for byte in &mut o {
            let p = parts.next().unwrap_or("");
            if p.len() != 2 || !p.bytes().all(|b| b.is_ascii_hexdigit()) {
                return Err(format!("{s:?} is not a MAC address"));
            }
            *byte = u8::from_str_radix(p, 16).expect("checked digits");
        }
        if parts.next().is_some() {
            return Err(format!("{s:?} is not a MAC address"));
        }
        Ok(Mac(o))
    }
}

impl Serialize for Mac {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        s.collect_str(self)
    }
}

fn family_of(ip: IpAddr) -> u8 {
    match ip {
        IpAddr::V4(_) => FAMILY_V4,
        IpAddr::V6(_) => FAMILY_V6,
    }
}

/// Serializes a `Duration` as a humantime string (`"1s 500ms"`).
mod duration_str {
    use std::time::Duration;

    use serde::Serializer;

    pub fn serialize<S: Serializer>(d: &Duration, s: S) -> Result<S::Ok, S::Error> {
        s.collect_str(&humantime::format_duration(*d))
    }
}

// ------------------------------------------------------------------------------------------
// Errors
// ------------------------------------------------------------------------------------------

/// One problem found in a configuration.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Issue {
    /// 1-based position of the offending value (or of the table lacking a key); `None` when
    /// unknown (I/O errors, configurations not read from TOML text).
    pub line: Option<usize>,
    pub column: Option<usize>,
    /// Key path such as `vip[1].backend[0].weight`; empty for whole-file problems.
    pub key: String,
    /// The offending value, what is wrong with it and what is allowed.
    pub message: String,
}

impl Issue {
    /// The issue as one line: `ORIGIN[:LINE:COLUMN]: [KEY: ]MESSAGE`.
    pub fn render(&self, origin: &str) -> String {
        let mut s = origin.to_owned();
        if let (Some(l), Some(c)) = (self.line, self.column) {
            s += &format!(":{l}:{c}");
        }
        s += ": ";
        if !self.key.is_empty() {
            s += &self.key;
            s += ": ";
        }
        s += &self.message;
        s
    }
}

/// Everything wrong with a configuration; displays one issue per line.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ConfigError {
    /// File path (or the `origin` given to [`parse`]).
    pub origin: String,
    /// At least one.
    pub issues: Vec<Issue>,
}

impl ConfigError {
    /// The issues as rendered lines (what `Display` prints, split).
    pub fn messages(&self) -> Vec<String> {
        self.issues.iter().map(|i| i.render(&self.origin)).collect()
    }
}

impl fmt::Display for ConfigError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.messages().join("\n"))
    }
}

impl std::error::Error for ConfigError {}

// ------------------------------------------------------------------------------------------
// Entry points
// ------------------------------------------------------------------------------------------

/// Reads and validates the file at `path`; errors name the file as `path.display()`.
pub fn load(path: &Path) -> Result<Config, ConfigError> {
    load_with_warnings(path).map(|(c, _)| c)
}

/// [`load`], also returning the warnings (rendered like errors, one per entry).
pub fn load_with_warnings(path: &Path) -> Result<(Config, Vec<String>), ConfigError> {
    let origin = path.display().to_string();
    match std::fs::read_to_string(path) {
        Ok(text) => parse_with_warnings(&text, &origin),
        Err(e) => Err(ConfigError {
            origin,
            issues: vec![Issue {
                line: None,
                column: None,
                key: String::new(),
                message: format!("cannot read the configuration: {e}"),
            }],
        }),
    }
}

/// Parses and validates TOML `text`; `origin` (usually the file name) prefixes every error.
pub fn parse(text: &str, origin: &str) -> Result<Config, ConfigError> {
    parse_with_warnings(text, origin).map(|(c, _)| c)
}

/// [`parse`], also returning the warnings (rendered like errors, one per entry).
pub fn parse_with_warnings(text: &str, origin: &str) -> Result<(Config, Vec<String>), ConfigError> {
    let doc = Doc { text };
    // Problems are listed in file order; those without a position come last.
    let fail = |mut issues: Vec<Issue>| {
        issues.sort_by_key(|i| (i.line.is_none(), i.line, i.column));
        ConfigError {
            origin: origin.to_owned(),
            issues,
        }
    };
    let root = match DeTable::parse(text) {
        Ok(root) => root,
        Err(e) => {
            let (line, column) = e.span().map(|s| doc.position(s.start)).unzip();
            return Err(fail(vec![Issue {
                line,
                column,
                key: String::new(),
                message: format!("TOML syntax error: {}", e.message()),
            }]));
        }
    };
    let mut shape = Vec::new();
    let raw = raw_from_document(&root, &mut shape);
    if !shape.is_empty() {
        let issues = shape
            .into_iter()
            .map(|(span, key, message)| {
                let (line, column) = doc.position(span.start);
                Issue {
                    line: Some(line),
                    column: Some(column),
                    key,
                    message,
                }
            })
            .collect();
        return Err(fail(issues));
    }
    let locate = |(path, message): (KeyPath, String)| {
        let (line, column) = span_of(&root, &path).map(|s| doc.position(s.start)).unzip();
        Issue {
            line,
            column,
            key: path.to_string(),
            message,
        }
    };
    let (config, issues, warnings) = validate(raw);
    match config {
        Some(c) if issues.is_empty() => {
            let mut warnings: Vec<Issue> = warnings.into_iter().map(locate).collect();
            warnings.sort_by_key(|i| (i.line.is_none(), i.line, i.column));
            let warnings = warnings.iter().map(|w| w.render(origin)).collect();
            Ok((c, warnings))
        }
        _ => Err(fail(issues.into_iter().map(locate).collect())),
    }
}

impl<'de> Deserialize<'de> for Config {
    /// Validates like [`parse`] (errors carry key paths but no positions).
    fn deserialize<D: de::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        let raw = RawConfig::deserialize(d)?;
        let (config, issues, _) = validate(raw);
        match config {
            Some(c) if issues.is_empty() => Ok(c),
            _ => {
                let err = ConfigError {
                    origin: "config".to_owned(),
                    issues: issues
                        .into_iter()
                        .map(|(path, message)| Issue {
                            line: None,
                            column: None,
                            key: path.to_string(),
                            message,
                        })
                        .collect(),
                };
                Err(de::Error::custom(err))
            }
        }
    }
}

// ------------------------------------------------------------------------------------------
// Positions and key paths
// ------------------------------------------------------------------------------------------

struct Doc<'a> {
    text: &'a str,
}

impl Doc<'_> {
    /// 1-based line and column (in characters) of byte `offset`.
    fn position(&self, offset: usize) -> (usize, usize) {
        let mut offset = offset.min(self.text.len());
        while !self.text.is_char_boundary(offset) {
            offset -= 1;
        }
        let before = &self.text[..offset];
        let line = before.matches('\n').count() + 1;
        let start = before.rfind('\n').map_or(0, |i| i + 1);
        (line, before[start..].chars().count() + 1)
    }
}

#[derive(Clone, Debug, PartialEq, Eq)]
enum Seg {
    Key(String),
    Index(usize),
}

/// A key path such as `vip[1].backend[0].weight`.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
struct KeyPath(Vec<Seg>);

impl KeyPath {
    fn key(&self, k: &str) -> KeyPath {
        let mut p = self.clone();
        p.0.push(Seg::Key(k.to_owned()));
        p
    }

    fn idx(&self, i: usize) -> KeyPath {
        let mut p = self.clone();
        p.0.push(Seg::Index(i));
        p
    }
}

impl fmt::Display for KeyPath {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        for (i, seg) in self.0.iter().enumerate() {
            match seg {
                Seg::Key(k) => {
                    if i > 0 {
                        f.write_str(".")?;
                    }
                    let bare = !k.is_empty()
                        && k.bytes()
                            .all(|b| b.is_ascii_alphanumeric() || b == b'_' || b == b'-');
                    if bare {
                        f.write_str(k)?;
                    } else {
                        write!(f, "{k:?}")?;
                    }
                }
                Seg::Index(n) => write!(f, "[{n}]")?,
            }
        }
        Ok(())
    }
}

/// Span of the value at `path`, or of its deepest ancestor present in the document.
fn span_of(root: &Spanned<DeTable>, path: &KeyPath) -> Option<Range<usize>> {
    let mut span = None;
    let mut table = Some(root.get_ref());
    let mut value: Option<&DeValue> = None;
    for seg in &path.0 {
        let next = match (seg, table, value) {
            (Seg::Key(k), Some(t), _) => t.get(k.as_str()),
            (Seg::Key(k), None, Some(DeValue::Table(t))) => t.get(k.as_str()),
            (Seg::Index(i), None, Some(DeValue::Array(a))) => a.get(*i),
            _ => None,
        };
        let Some(next) = next else { break };
        span = Some(next.span());
        table = None;
        value = Some(next.get_ref());
    }
    span
}

/// The key path whose key or value has the smallest span containing `offset`.
fn path_at(root: &Spanned<DeTable>, offset: usize) -> KeyPath {
    fn consider(span: Range<usize>, offset: usize, path: &[Seg], best: &mut (usize, Vec<Seg>)) {
        let inside = span.contains(&offset) || (span.is_empty() && span.start == offset);
        if inside && span.len() <= best.0 {
            *best = (span.len(), path.to_vec());
        }
    }
    fn walk(v: &DeValue, offset: usize, path: &mut Vec<Seg>, best: &mut (usize, Vec<Seg>)) {
        match v {
            DeValue::Table(t) => {
                for (k, val) in t.iter() {
                    path.push(Seg::Key(k.get_ref().to_string()));
                    consider(k.span(), offset, path, best);
                    consider(val.span(), offset, path, best);
                    walk(val.get_ref(), offset, path, best);
                    path.pop();
                }
            }
            DeValue::Array(a) => {
                for (i, val) in a.iter().enumerate() {
                    path.push(Seg::Index(i));
                    consider(val.span(), offset, path, best);
                    walk(val.get_ref(), offset, path, best);
                    path.pop();
                }
            }
            _ => {}
        }
    }
    let mut best = (usize::MAX, Vec::new());
    let mut path = Vec::new();
    for (k, val) in root.get_ref().iter() {
        path.push(Seg::Key(k.get_ref().to_string()));
        consider(k.span(), offset, &path, &mut best);
        consider(val.span(), offset, &path, &mut best);
        walk(val.get_ref(), offset, &mut path, &mut best);
        path.pop();
    }
    KeyPath(best.1)
}

// ------------------------------------------------------------------------------------------
// Stage 2: shape (serde)
// ------------------------------------------------------------------------------------------

/// An integer of any TOML/JSON size (range checks come later, with better messages).
#[derive(Clone, Copy, Debug)]
struct Int(i64);

impl<'de> Deserialize<'de> for Int {
    fn deserialize<D: de::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct V;
        impl de::Visitor<'_> for V {
            type Value = Int;
            fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
                f.write_str("an integer")
            }
            fn visit_i64<E>(self, v: i64) -> Result<Int, E> {
                Ok(Int(v))
            }
            fn visit_u64<E>(self, v: u64) -> Result<Int, E> {
                Ok(Int(i64::try_from(v).unwrap_or(i64::MAX)))
            }
        }
        d.deserialize_any(V)
    }
}

/// A number: integer or float.
#[derive(Clone, Copy, Debug)]
struct Num(f64);

impl<'de> Deserialize<'de> for Num {
    fn deserialize<D: de::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct V;
        impl de::Visitor<'_> for V {
            type Value = Num;
            fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
                f.write_str("a number")
            }
            fn visit_i64<E>(self, v: i64) -> Result<Num, E> {
                Ok(Num(v as f64))
            }
            fn visit_u64<E>(self, v: u64) -> Result<Num, E> {
                Ok(Num(v as f64))
            }
            fn visit_f64<E>(self, v: f64) -> Result<Num, E> {
                Ok(Num(v))
            }
        }
        d.deserialize_any(V)
    }
}

/// A duration string (parsed later, so a bad one is reported with the others).
#[derive(Clone, Debug)]
struct DurStr(String);

impl std::ops::Deref for DurStr {
    type Target = str;
    fn deref(&self) -> &str {
        &self.0
    }
}

impl<'de> Deserialize<'de> for DurStr {
    fn deserialize<D: de::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct V;
        impl de::Visitor<'_> for V {
            type Value = DurStr;
            fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
                f.write_str("a duration string such as \"10s\"")
            }
            fn visit_str<E>(self, v: &str) -> Result<DurStr, E> {
                Ok(DurStr(v.to_owned()))
            }
        }
        d.deserialize_str(V)
    }
}

/// `admin.mode`: an octal string, or a TOML integer such as `0o600`.
#[derive(Clone, Debug)]
enum RawMode {
    Str(String),
    Int(i64),
}

impl<'de> Deserialize<'de> for RawMode {
    fn deserialize<D: de::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct V;
        impl de::Visitor<'_> for V {
            type Value = RawMode;
            fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
                f.write_str("an octal mode string such as \"0600\"")
            }
            fn visit_str<E>(self, v: &str) -> Result<RawMode, E> {
                Ok(RawMode::Str(v.to_owned()))
            }
            fn visit_i64<E>(self, v: i64) -> Result<RawMode, E> {
                Ok(RawMode::Int(v))
            }
            fn visit_u64<E>(self, v: u64) -> Result<RawMode, E> {
                Ok(RawMode::Int(i64::try_from(v).unwrap_or(i64::MAX)))
            }
        }
        d.deserialize_any(V)
    }
}

#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
struct RawConfig {
    daemon: Option<RawDaemon>,
    admin: Option<RawAdmin>,
    metrics: Option<RawMetrics>,
    dataplane: Option<RawDataplane>,
    #[serde(default)]
    vip: Vec<RawVip>,
    health: Option<RawHealth>,
    telemetry: Option<RawTelemetry>,
    policy: Option<RawPolicy>,
}

const SECTIONS: &str = "daemon, admin, metrics, dataplane, vip, health, telemetry, policy";

#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
struct RawDaemon {
    bpffs: Option<String>,
    state_file: Option<String>,
    keep_dataplane_on_exit: Option<bool>,
    log_format: Option<String>,
    log_level: Option<String>,
}

#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
struct RawAdmin {
    socket: Option<String>,
    mode: Option<RawMode>,
    group: Option<String>,
    audit_log: Option<String>,
}

#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
struct RawMetrics {
    enabled: Option<bool>,
    listen: Option<String>,
}

#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
struct RawDataplane {
    interfaces: Option<Vec<RawInterface>>,
    hash_seed: Option<Int>,
    encap_source_v4: Option<String>,
    encap_source_v6: Option<String>,
    fallback_mac: Option<String>,
    conn_table_size: Option<Int>,
    affinity_table_size: Option<Int>,
    max_vips: Option<Int>,
    flood_new_flows_per_sec: Option<Int>,
    flow_idle_timeout: Option<String>,
}

#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
struct RawInterface {
    name: Option<String>,
    mode: Option<String>,
}

#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
struct RawVip {
    name: Option<String>,
    address: Option<String>,
    port: Option<Int>,
    protocol: Option<String>,
    hash: Option<String>,
    affinity_window: Option<DurStr>,
    priority: Option<Int>,
    ring_size: Option<Int>,
    flow_state: Option<String>,
    #[serde(default)]
    backend: Vec<RawBackend>,
}

#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
struct RawBackend {
    address: Option<String>,
    weight: Option<Int>,
    labels: Option<BTreeMap<String, String>>,
    max_sessions: Option<Int>,
    dcgm: Option<RawDcgm>,
    engine: Option<RawEngine>,
    roce: Option<RawRoce>,
    health: Option<RawHealthCheck>,
}

#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
struct RawDcgm {
    url: Option<String>,
    gpus: Option<Vec<String>>,
    uuids: Option<Vec<String>>,
}

#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
struct RawEngine {
    url: Option<String>,
    kind: Option<String>,
    model: Option<String>,
}

#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
struct RawRoce {
    sysfs: Option<String>,
    url: Option<String>,
    device: Option<String>,
    port: Option<String>,
}

#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
struct RawHealthCheck {
    kind: Option<String>,
    port: Option<Int>,
    path: Option<String>,
    expect_status: Option<Int>,
}

#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
struct RawHealth {
    interval: Option<DurStr>,
    timeout: Option<DurStr>,
    rise: Option<Int>,
    fall: Option<Int>,
}

#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
struct RawTelemetry {
    scrape_interval: Option<DurStr>,
    scrape_timeout: Option<DurStr>,
    stale_after: Option<DurStr>,
    max_concurrent_scrapes: Option<Int>,
}

#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
struct RawPolicy {
    ewma_alpha: Option<Num>,
    weight_levels: Option<Int>,
    hysteresis: Option<Num>,
    gpu_util_high: Option<Num>,
    kv_cache_high: Option<Num>,
    queue_depth_high: Option<Int>,
    temp_high_c: Option<Num>,
    ecn_rate_high: Option<Num>,
    cnp_rate_high: Option<Num>,
    cooldown_base: Option<DurStr>,
    cooldown_max: Option<DurStr>,
    flap_window: Option<DurStr>,
    stable_period: Option<DurStr>,
    slow_start: Option<DurStr>,
    shed: Option<String>,
}

/// (span, key path, message) of a shape error.
type ShapeIssue = (Range<usize>, String, String);

/// Reads the document table by table, so a shape error in one table does not hide those in
/// the others.
fn raw_from_document(root: &Spanned<DeTable>, issues: &mut Vec<ShapeIssue>) -> RawConfig {
    let mut raw = RawConfig::default();
    for (k, v) in root.get_ref().iter() {
        match k.get_ref().as_ref() {
            "daemon" => raw.daemon = read(root, v, issues),
            "admin" => raw.admin = read(root, v, issues),
            "metrics" => raw.metrics = read(root, v, issues),
            "dataplane" => raw.dataplane = read(root, v, issues),
            "health" => raw.health = read(root, v, issues),
            "telemetry" => raw.telemetry = read(root, v, issues),
            "policy" => raw.policy = read(root, v, issues),
            "vip" => match v.get_ref() {
                DeValue::Array(vips) => {
                    for vip in vips.iter() {
                        if let Some(r) = read_vip(root, vip, issues) {
                            raw.vip.push(r);
                        }
                    }
                }
                _ => issues.push((
                    v.span(),
                    "vip".to_owned(),
                    format!(
                        "invalid type: {}, expected an array of tables ([[vip]])",
                        v.get_ref().type_str()
                    ),
                )),
            },
            other => issues.push((
                k.span(),
                KeyPath::default().key(other).to_string(),
                format!("unknown section `{other}`, expected one of {SECTIONS}"),
            )),
        }
    }

    raw
}

/// Deserializes one table, recording a shape error with its span and key path.
fn read<T: de::DeserializeOwned>(
    root: &Spanned<DeTable>,
    v: &Spanned<DeValue>,
    issues: &mut Vec<ShapeIssue>,
) -> Option<T> {
    match T::deserialize(ValueDeserializer::from(v.clone())) {
        Ok(t) => Some(t),
        Err(e) => {
            let span = e.span().unwrap_or_else(|| v.span());
            let key = path_at(root, span.start).to_string();
            issues.push((span, key, e.message().to_owned()));
            None
        }
    }
}

/// One `[[vip]]`: its own keys, then each `[[vip.backend]]` separately.
fn read_vip(
    root: &Spanned<DeTable>,
    vip: &Spanned<DeValue>,
    issues: &mut Vec<ShapeIssue>,
) -> Option<RawVip> {
    let DeValue::Table(t) = vip.get_ref() else {
        return read(root, vip, issues);
    };
    // The backends are read one by one, after the VIP's own keys.
    let mut own = DeTable::new();
    let mut backends = None;
    for (k, v) in t.iter() {
        if k.get_ref() == "backend" {
            backends = Some(v);
        } else {
            own.insert(k.clone(), v.clone());
        }
    }
    let own = Spanned::new(vip.span(), DeValue::Table(own));
    let mut raw: Option<RawVip> = read(root, &own, issues);
    let mut list = Vec::new();
    match backends.map(|b| (b, b.get_ref())) {
        None => {}
        Some((_, DeValue::Array(a))) => {
            for b in a.iter() {
                if let Some(b) = read(root, b, issues) {
                    list.push(b);
                }
            }
        }
        Some((b, other)) => {
            let span = b.span();
            issues.push((
                span.clone(),
                path_at(root, span.start).to_string(),
                format!(
                    "invalid type: {}, expected an array of tables ([[vip.backend]])",
                    other.type_str()
                ),
            ));
        }
    }
    if let Some(r) = &mut raw {
        r.backend = list;
    }
    raw
}

// ------------------------------------------------------------------------------------------
// Stage 3: semantics
// ------------------------------------------------------------------------------------------

/// Collected problems, each with its key path.
#[derive(Default)]
struct Checker {
    issues: Found,
    warnings: Found,
}

const DURATION_ALLOWED: &str =
    "allowed: a number and a unit (ns, us, ms, s, m, h, d), e.g. \"500ms\", \"10s\", \"5m\"";

impl Checker {
    fn err(&mut self, path: &KeyPath, msg: impl Into<String>) {
        self.issues.push((path.clone(), msg.into()));
    }

    fn warn(&mut self, path: &KeyPath, msg: impl Into<String>) {
        self.warnings.push((path.clone(), msg.into()));
    }

    fn missing(&mut self, path: &KeyPath, allowed: &str) {
        self.err(path, format!("missing (required); allowed: {allowed}"));
    }

    /// An integer in `lo..=hi`; `None` (after recording why) when out of range.
    fn int<T: TryFrom<i64>>(
        &mut self,
        path: &KeyPath,
        v: Option<Int>,
        default: T,
        lo: i64,
        hi: i64,
        note: &str,
    ) -> Option<T> {
        let Some(Int(v)) = v else {
            return Some(default);
        };
        if let Err(e) = rules::in_range(v, lo, hi, note) {
            self.err(path, e);
            return None;
        }
        // Every caller's range lies within T.
        T::try_from(v).ok()
    }

    /// A finite number accepted by `ok`.
    fn num(
        &mut self,
        path: &KeyPath,
        v: Option<Num>,
        default: f64,
        ok: impl Fn(f64) -> bool,
        allowed: &str,
    ) -> Option<f64> {
        let Some(Num(v)) = v else {
            return Some(default);
        };
        if v.is_finite() && ok(v) {
            Some(v)
        } else {
            self.err(path, format!("{v:?} is out of range; allowed: {allowed}"));
            None
        }
    }

    fn duration(&mut self, path: &KeyPath, v: Option<&str>, default: Duration) -> Option<Duration> {
        let Some(s) = v else {
            return Some(default);
        };
        match humantime::parse_duration(s) {
            Ok(d) => match rules::bounded(d) {
                Ok(d) => Some(d),
                Err(e) => {
                    self.err(path, format!("{s:?} {e}"));
                    None
                }
            },
            Err(_) => {
                self.err(path, format!("{s:?} is not a duration; {DURATION_ALLOWED}"));
                None
            }
        }
    }

    /// A duration strictly greater than zero.
    fn positive(&mut self, path: &KeyPath, v: Option<&str>, default: Duration) -> Option<Duration> {
        let d = self.duration(path, v, default)?;
        if d.is_zero() {
            self.err(
                path,
                format!(
                    "{:?} is zero; allowed: a duration greater than 0s, e.g. \"1s\"",
                    v.unwrap_or("0s")
                ),
            );
            return None;
        }
        Some(d)
    }

    fn keyword<K: Keyword + FromStr<Err = UnknownKeyword>>(
        &mut self,
        path: &KeyPath,
        v: Option<&str>,
        default: K,
    ) -> Option<K> {
        let Some(s) = v else {
            return Some(default);
        };
        match s.parse::<K>() {
            Ok(k) => Some(k),
            Err(e) => {
                self.err(path, e.to_string());
                None
            }
        }
    }

    fn abs_path(&mut self, path: &KeyPath, v: Option<&str>, default: &Path) -> Option<PathBuf> {
        let Some(s) = v else {
            return Some(default.to_owned());
        };
        if s.starts_with('/') {
            Some(PathBuf::from(s))
        } else {
            self.err(
                path,
                format!("{s:?} is not an absolute path; allowed: a path starting with \"/\""),
            );
            None
        }
    }

    /// A unicast IP address.
    fn ip(&mut self, path: &KeyPath, v: Option<&str>, example: &str) -> Option<IpAddr> {
        let Some(s) = v else {
            self.missing(
                path,
                &format!("an IPv4 or IPv6 address such as {example:?}"),
            );
            return None;
        };
        let Ok(ip) = s.parse::<IpAddr>() else {
            self.err(
                path,
                format!(
                    "{s:?} is not an IP address; allowed: an IPv4 or IPv6 address such as \
                     {example:?}"
                ),
            );
            return None;
        };
        match rules::unicast(ip) {
            Ok(()) => Some(ip),
            Err(e) => {
                self.err(path, e);
                None
            }
        }
    }

    /// Records `r`'s error at `path`; whether it passed.
    fn rule(&mut self, path: &KeyPath, r: Result<(), String>) -> bool {
        r.map_err(|e| self.err(path, e)).is_ok()
    }

    fn url(&mut self, path: &KeyPath, v: Option<&str>) -> Option<String> {
        const ALLOWED: &str = "allowed: an http:// URL such as \
                               \"http://10.1.0.1:9400/metrics\"";
        let Some(s) = v else {
            self.missing(path, &ALLOWED["allowed: ".len()..]);
            return None;
        };
        if s.starts_with("https://") {
            // Refused here rather than scraped with TLS: exporters (dcgm-exporter, vLLM,
            // SGLang, node_exporter) serve plain HTTP on the backend network, and a URL that
            // passed here but failed in the scraper once stopped `sluice run` after the XDP
            // attach.
            self.err(
                path,
                format!(
                    "{s:?} is https, which the telemetry scraper does not speak; {ALLOWED} \
                     (the exporter's plain-HTTP port, or a local proxy in front of a TLS one)"
                ),
            );
            None
        } else if valid_url(s) {
            Some(s.to_owned())
        } else {
            self.err(path, format!("{s:?} is not a valid URL; {ALLOWED}"));
            None
        }
    }
}

/// `http://`, a non-empty host, an optional numeric port, no whitespace.
fn valid_url(s: &str) -> bool {
    let Some(rest) = s.strip_prefix("http://") else {
        return false;
    };
    if s.chars().any(|c| c.is_whitespace() || c.is_control()) {
        return false;
    }
    let authority = rest.split(['/', '?', '#']).next().unwrap_or("");
    let (host, port) = if let Some(v6) = authority.strip_prefix('[') {
        match v6.split_once(']') {
            Some((h, p)) if h.parse::<Ipv6Addr>().is_ok() => (h, p.strip_prefix(':')),
            _ => return false,
        }
    } else {
        match authority.rsplit_once(':') {
            Some((h, p)) => (h, Some(p)),
            None => (authority, None),
        }
    };
    let port_ok = port.is_none_or(|p| matches!(p.parse::<u16>(), Ok(n) if n > 0));
    !host.is_empty() && !host.contains('@') && port_ok
}

/// Smallest prime >= n, capped at the largest ring.
fn prime_at_least(n: u32) -> u32 {
    (n..RING_SIZE_MAX)
        .find(|&p| is_prime(p))
        .unwrap_or(RING_SIZE_MAX)
}

/// Problems found, each with its key path.
type Found = Vec<(KeyPath, String)>;

/// The configuration (when every part is valid), its errors and its warnings.
fn validate(raw: RawConfig) -> (Option<Config>, Found, Found) {
    let mut c = Checker::default();
    let root = KeyPath::default();
    let daemon = daemon(&mut c, &root.key("daemon"), raw.daemon.unwrap_or_default());
    let admin = admin(&mut c, &root.key("admin"), raw.admin.unwrap_or_default());
    let metrics = metrics(
        &mut c,
        &root.key("metrics"),
        raw.metrics.unwrap_or_default(),
    );
    // What the VIP checks need from [dataplane], taken before it is validated so they run
    // even when some other dataplane key is wrong.
    let raw_max_vips = raw.dataplane.as_ref().and_then(|d| match d.max_vips {
        None => Some(DataplaneConfig::DEFAULT_MAX_VIPS),
        Some(Int(v)) => u32::try_from(v).ok().filter(|v| (1..=MAX_VIPS).contains(v)),
    });
    let encap_present = raw.dataplane.as_ref().map_or((false, false), |d| {
        (d.encap_source_v4.is_some(), d.encap_source_v6.is_some())
    });
    let dataplane = match raw.dataplane {
        Some(d) => dataplane(&mut c, &root.key("dataplane"), d),
        None => {
            c.err(
                &root.key("dataplane"),
                "missing (required); allowed: a [dataplane] table with at least `interfaces` \
                 and `hash_seed`",
            );
            None
        }
    };
    let max_vips = match &dataplane {
        Some(d) => Some(d.max_vips),
        None => raw_max_vips,
    };
    let vips = vips(&mut c, &root, raw.vip, max_vips, encap_present);
    let health = health(&mut c, &root.key("health"), raw.health.unwrap_or_default());
    let telemetry = telemetry(
        &mut c,
        &root.key("telemetry"),
        raw.telemetry.unwrap_or_default(),
    );
    let policy = policy(&mut c, &root.key("policy"), raw.policy.unwrap_or_default());
    let config = (|| {
        Some(Config {
            daemon: daemon?,
            admin: admin?,
            metrics: metrics?,
            dataplane: dataplane?,
            vips: vips?,
            health: health?,
            telemetry: telemetry?,
            policy: policy?,
        })
    })();
    (config, c.issues, c.warnings)
}

fn daemon(c: &mut Checker, p: &KeyPath, r: RawDaemon) -> Option<DaemonConfig> {
    let d = DaemonConfig::default();
    let bpffs = c.abs_path(&p.key("bpffs"), r.bpffs.as_deref(), &d.bpffs);
    let state_file = c.abs_path(&p.key("state_file"), r.state_file.as_deref(), &d.state_file);
    let log_format = c.keyword(&p.key("log_format"), r.log_format.as_deref(), d.log_format);
    let log_level = c.keyword(&p.key("log_level"), r.log_level.as_deref(), d.log_level);
    Some(DaemonConfig {
        bpffs: bpffs?,
        state_file: state_file?,
        keep_dataplane_on_exit: r.keep_dataplane_on_exit.unwrap_or(d.keep_dataplane_on_exit),
        log_format: log_format?,
        log_level: log_level?,
    })
}

/// `sockaddr_un::sun_path` holds 108 bytes including the terminating NUL.
const SUN_PATH_MAX: usize = 107;

fn admin(c: &mut Checker, p: &KeyPath, r: RawAdmin) -> Option<AdminConfig> {
    let d = AdminConfig::default();
    let socket = c.abs_path(&p.key("socket"), r.socket.as_deref(), &d.socket);
    let socket = socket.and_then(|s| {
        let len = s.as_os_str().len();
        if len > SUN_PATH_MAX {
            c.err(
                &p.key("socket"),
                format!(
                    "{:?} is {len} bytes long; allowed: at most {SUN_PATH_MAX} bytes (the \
                     kernel's limit for a Unix socket path)",
                    s.display().to_string()
                ),
            );
            return None;
        }
        Some(s)
    });
    let group_set = r.group.is_some();
    let group = r.group.and_then(|g| {
        let ok = (1..=32).contains(&g.len())
            && !g.starts_with('-')
            && g.bytes()
                .all(|b| b.is_ascii_alphanumeric() || matches!(b, b'_' | b'.' | b'-'));
        if ok {
            Some(g)
        } else {
            c.err(
                &p.key("group"),
                format!(
                    "{g:?} is not a valid group name; allowed: 1 to 32 of A-Z, a-z, 0-9, \"_\", \
                     \".\" and \"-\", not starting with \"-\""
                ),
            );
            None
        }
    });
    let mode_path = p.key("mode");
    let mode = match r.mode {
        None => Some(d.mode),
        Some(RawMode::Str(s)) => match s.parse::<SocketMode>() {
            Ok(m) => check_mode(c, &mode_path, m, &format!("{s:?}"), group_set),
            Err(_) => {
                c.err(
                    &mode_path,
                    format!(
                        "{s:?} is not an octal mode; allowed: 3 or 4 octal digits up to \"0777\", \
                         e.g. \"0600\""
                    ),
                );
                None
            }
        },
        Some(RawMode::Int(i)) if (0..=0o777).contains(&i) => check_mode(
            c,
            &mode_path,
            SocketMode(i as u32),
            &format!("0o{i:o}"),
            group_set,
        ),
        Some(RawMode::Int(i)) => {
            c.err(
                &mode_path,
                format!(
                    "{i} is out of range; allowed: a mode up to 0o777, best written as a string \
                     such as \"0600\""
                ),
            );
            None
        }
    };
    let audit_log = c.abs_path(&p.key("audit_log"), r.audit_log.as_deref(), &d.audit_log);
    if let (Some(_), Some(m)) = (&group, mode) {
        if m.0 & 0o060 == 0 {
            c.warn(
                &mode_path,
                format!(
                    "\"{m}\" gives admin.group no access; use e.g. \"0660\" so the group can use \
                     the socket"
                ),
            );
        }
    }
    Some(AdminConfig {
        socket: socket?,
        mode: mode?,
        group,
        audit_log: audit_log?,
    })
}

/// World and group access rules of the admin socket's mode.
fn check_mode(
    c: &mut Checker,
    path: &KeyPath,
    m: SocketMode,
    shown: &str,
    group_set: bool,
) -> Option<SocketMode> {
    let mut ok = true;
    if m.0 & 0o006 != 0 {
        c.err(
            path,
            format!(
                "{shown} lets other users read or write the admin socket; allowed: no read or \
                 write bits for others (o+rw), e.g. \"0600\", or \"0660\" with admin.group"
            ),
        );
        ok = false;
    }
    if m.0 & 0o070 != 0 && !group_set {
        c.err(
            path,
            format!(
                "{shown} grants group access but admin.group is not set; allowed: no group bits \
                 (e.g. \"0600\"), or set admin.group to the group meant to use the socket"
            ),
        );
        ok = false;
    }
    ok.then_some(m)
}

fn metrics(c: &mut Checker, p: &KeyPath, r: RawMetrics) -> Option<MetricsConfig> {
    let d = MetricsConfig::default();
    let listen = match r.listen {
        None => Some(d.listen),
        Some(s) => match s.parse::<SocketAddr>() {
            Ok(a) if a.port() != 0 => Some(a),
            Ok(_) => {
                c.err(
                    &p.key("listen"),
                    format!("{s:?} has port 0; allowed: a port from 1 to 65535"),
                );
                None
            }
            Err(_) => {
                c.err(
                    &p.key("listen"),
                    format!(
                        "{s:?} is not a socket address; allowed: IP:PORT such as \
                         \"127.0.0.1:9464\" or \"[::1]:9464\""
                    ),
                );
                None
            }
        },
    };
    Some(MetricsConfig {
        enabled: r.enabled.unwrap_or(d.enabled),
        listen: listen?,
    })
}

/// Linux's `dev_valid_name`: 1..=15 bytes, not "." or "..", no '/', ':' or whitespace.
fn valid_ifname(s: &str) -> bool {
    (1..=15).contains(&s.len())
        && s != "."
        && s != ".."
        && !s
            .chars()
            .any(|ch| ch == '/' || ch == ':' || ch.is_whitespace() || ch.is_control())
}

fn dataplane(c: &mut Checker, p: &KeyPath, r: RawDataplane) -> Option<DataplaneConfig> {
    let interfaces = match r.interfaces {
        None => {
            c.missing(
                &p.key("interfaces"),
                "a list of interfaces such as [{ name = \"eth0\", mode = \"auto\" }]",
            );
            None
        }
        Some(list) if list.is_empty() => {
            c.err(
                &p.key("interfaces"),
                "[] is empty; allowed: at least one interface, e.g. [{ name = \"eth0\" }]",
            );
            None
        }
        Some(list) => {
            let mut out = Vec::new();
            let mut seen: HashMap<String, usize> = HashMap::new();
            let mut ok = true;
            for (i, ifc) in list.into_iter().enumerate() {
                let ip = p.key("interfaces").idx(i);
                let mode = c.keyword(&ip.key("mode"), ifc.mode.as_deref(), AttachMode::Auto);
                let name = match ifc.name {
                    None => {
                        c.missing(&ip.key("name"), "an interface name such as \"eth0\"");
                        None
                    }
                    Some(n) if !valid_ifname(&n) => {
                        c.err(
                            &ip.key("name"),
                            format!(
                                "{n:?} is not a valid interface name; allowed: 1 to 15 bytes \
                                 without \"/\", \":\" or whitespace, other than \".\" and \"..\""
                            ),
                        );
                        None
                    }
                    Some(n) => {
                        if let Some(first) = seen.get(&n) {
                            c.err(
                                &ip.key("name"),
                                format!(
                                    "{n:?} is already dataplane.interfaces[{first}]; allowed: \
                                     each interface once"
                                ),
                            );
                            None
                        } else {
                            seen.insert(n.clone(), i);
                            Some(n)
                        }
                    }
                };
                match (name, mode) {
                    (Some(name), Some(mode)) => out.push(InterfaceConfig { name, mode }),
                    _ => ok = false,
                }
            }
            ok.then_some(out)
        }
    };
    let hash_seed = match r.hash_seed {
        None => {
            c.missing(
                &p.key("hash_seed"),
                "an integer 0..=4294967295, the same on every LB host, e.g. 0x5eed",
            );
            None
        }
        s => c.int(&p.key("hash_seed"), s, 0u32, 0, u32::MAX as i64, ""),
    };
    let v4 = cidr(c, &p.key("encap_source_v4"), r.encap_source_v4, true);
    let v6 = cidr(c, &p.key("encap_source_v6"), r.encap_source_v6, false);
    let fallback_mac = match r.fallback_mac {
        None => Some(None),
        Some(s) => mac(c, &p.key("fallback_mac"), &s).map(Some),
    };
    let table = |c: &mut Checker, key: &str, v, default| {
        c.int(&p.key(key), v, default, 1024, 16_777_216, "")
    };
    let conn_table_size = table(c, "conn_table_size", r.conn_table_size, CONN_TABLE_SIZE);
    let affinity_table_size = table(
        c,
        "affinity_table_size",
        r.affinity_table_size,
        AFFINITY_TABLE_SIZE,
    );
    let max_vips = c.int(
        &p.key("max_vips"),
        r.max_vips,
        DataplaneConfig::DEFAULT_MAX_VIPS,
        1,
        MAX_VIPS as i64,
        " (the data plane's MAX_VIPS)",
    );
    let flood = c.int(
        &p.key("flood_new_flows_per_sec"),
        r.flood_new_flows_per_sec,
        0u32,
        0,
        u32::MAX as i64,
        " (0 = off)",
    );
    let flow_idle_timeout = c.positive(
        &p.key("flow_idle_timeout"),
        r.flow_idle_timeout.as_deref(),
        Duration::from_secs(60),
    );
    Some(DataplaneConfig {
        interfaces: interfaces?,
        hash_seed: hash_seed?,
        encap_source_v4: v4?,
        encap_source_v6: v6?,
        fallback_mac: fallback_mac?,
        conn_table_size: conn_table_size?,
        affinity_table_size: affinity_table_size?,
        max_vips: max_vips?,
        flood_new_flows_per_sec: flood?,
        flow_idle_timeout: flow_idle_timeout?,
    })
}

/// A unicast MAC.
fn mac(c: &mut Checker, path: &KeyPath, s: &str) -> Option<Mac> {
    let problem = match s.parse::<Mac>() {
        Err(_) => format!(
            "{s:?} is not a MAC address; allowed: six hex octets separated by \":\", e.g. \
             \"02:00:00:00:00:01\""
        ),
        Ok(m) if m.is_zero() => format!(
            "{s:?} is all zero; allowed: a unicast MAC, or no fallback_mac to drop packets whose \
             next hop is unresolved"
        ),
        Ok(m) if m.is_multicast() => format!(
            "{s:?} is a multicast address; allowed: a unicast MAC (lowest bit of the first octet \
             clear), e.g. \"02:00:00:00:00:01\""
        ),
        Ok(m) => return Some(m),
    };
    c.err(path, problem);
    None
}

/// An encapsulation source prefix: `Some(None)` when absent, `None` when invalid.
fn cidr(c: &mut Checker, path: &KeyPath, v: Option<String>, v4: bool) -> Option<Option<Cidr>> {
    let Some(s) = v else { return Some(None) };
    let (family, lo, hi, example) = if v4 {
        ("IPv4", 8, 32, "172.16.0.0/16")
    } else {
        ("IPv6", 96, 128, "fd00:5:1::/96")
    };
    let allowed = format!("allowed: an {family} prefix of length {lo}..={hi}, e.g. {example:?}");
    // Family and length first: a host-bits hint for a prefix that is wrong anyway misleads.
    let (parsed, host_bits) = match s.parse::<Cidr>() {
        Ok(cidr) => (Some(cidr), false),
        Err(CidrError::HostBits { network }) => (Some(network), true),
        Err(_) => (None, false),
    };
    let problem = match parsed {
        None => format!("{s:?} is not ADDRESS/LENGTH; {allowed}"),
        Some(cidr) if (cidr.family() == FAMILY_V4) != v4 => {
            let other = if v4 { "IPv6" } else { "IPv4" };
            format!("{s:?} is an {other} prefix; {allowed}")
        }
        Some(cidr) if !(lo..=hi).contains(&cidr.prefix) => {
            format!("{s:?} has prefix length {}; {allowed}", cidr.prefix)
        }
        Some(cidr) if host_bits => format!(
            "{s:?} has bits set below the prefix length; allowed: the network address, {:?}",
            cidr.to_string()
        ),
        Some(cidr) => return Some(Some(cidr)),
    };
    c.err(path, problem);
    None
}

fn vips(
    c: &mut Checker,
    root: &KeyPath,
    raw: Vec<RawVip>,
    max_vips: Option<u32>,
    (have_v4, have_v6): (bool, bool),
) -> Option<Vec<VipConfig>> {
    let n = raw.len();
    if let Some(max) = max_vips {
        if n > max as usize {
            c.err(
                &root.key("vip"),
                format!(
                    "{n} VIPs are configured; allowed: at most dataplane.max_vips = {max} \
                     (raise max_vips, up to {MAX_VIPS})"
                ),
            );
        }
    }
    let total: usize = raw.iter().map(|v| v.backend.len()).sum();
    let max_backends = MAX_BACKENDS as usize - 1;
    if total > max_backends {
        c.err(
            &root.key("vip"),
            format!(
                "{total} backends are configured over all VIPs; allowed: at most {max_backends} \
                 (the data plane's backend table)"
            ),
        );
    }

    let mut out = Vec::new();
    let mut ok = true;
    let mut names: HashMap<String, usize> = HashMap::new();
    let mut keys: HashMap<(IpAddr, u16, Protocol), (usize, Option<String>)> = HashMap::new();
    // First backend of each family, for the encapsulation-source check.
    let mut first_v4 = None;
    let mut first_v6 = None;
    for (i, r) in raw.into_iter().enumerate() {
        let p = root.key("vip").idx(i);
        let parts = vip(c, &p, r);
        if let Some(name) = &parts.name {
            if let Some(first) = names.get(name) {
                c.err(
                    &p.key("name"),
                    format!(
                        "{name:?} is already the name of vip[{first}]; allowed: a name unique \
                         among VIPs"
                    ),
                );
                ok = false;
            } else {
                names.insert(name.clone(), i);
            }
        }
        if let Some(key @ (address, port, protocol)) = parts.key {
            if let Some((first, first_name)) = keys.get(&key) {
                let named = first_name
                    .as_ref()
                    .map_or(String::new(), |n| format!(" ({n:?})"));
                c.err(
                    &p,
                    format!(
                        "{address} {protocol}/{port} is already served by vip[{first}]{named}; \
                         allowed: one VIP per (address, port, protocol) (a port-0 VIP may share \
                         an address with specific ports)"
                    ),
                );
                ok = false;
            } else {
                keys.insert(key, (i, parts.name.clone()));
            }
        }
        for &(j, addr) in &parts.backend_addrs {
            let first = if addr.is_ipv4() {
                &mut first_v4
            } else {
                &mut first_v6
            };
            first.get_or_insert((i, j, addr));
        }
        match parts.config {
            Some(v) => out.push(v),
            None => ok = false,
        }
    }

    // Every backend family needs its encapsulation source.
    for (first, have, key, fam, example) in [
        (
            first_v4,
            have_v4,
            "encap_source_v4",
            "IPv4",
            "172.16.0.0/16",
        ),
        (
            first_v6,
            have_v6,
            "encap_source_v6",
            "IPv6",
            "fd00:5:1::/96",
        ),
    ] {
        if let (false, Some((i, j, addr))) = (have, first) {
            c.err(
                &root.key("dataplane").key(key),
                format!(
                    "missing, but vip[{i}].backend[{j}] ({addr}) is {fam} and packets to it are \
                     encapsulated from this prefix; allowed: an {fam} prefix such as {example:?}"
                ),
            );
            ok = false;
        }
    }
    ok.then_some(out)
}

/// What validating one VIP yielded, valid or not: the parts that checks across VIPs need.
struct VipParts {
    name: Option<String>,
    key: Option<(IpAddr, u16, Protocol)>,
    /// (index, address) of every backend whose address is valid.
    backend_addrs: Vec<(usize, IpAddr)>,
    config: Option<VipConfig>,
}

fn vip(c: &mut Checker, p: &KeyPath, r: RawVip) -> VipParts {
    let name = match r.name {
        None => {
            c.missing(&p.key("name"), "a unique name of a-z, 0-9, \"-\" and \"_\"");
            None
        }
        Some(n) => c.rule(&p.key("name"), rules::vip_name(&n)).then_some(n),
    };
    let address = c.ip(&p.key("address"), r.address.as_deref(), "10.200.0.1");
    let port = match r.port {
        None => {
            c.missing(&p.key("port"), "0..=65535 (0 = all ports)");
            None
        }
        v => c.int(&p.key("port"), v, 0u16, 0, 65535, " (0 = all ports)"),
    };
    let protocol = c.keyword(&p.key("protocol"), r.protocol.as_deref(), Protocol::Tcp);
    let hash = c.keyword(&p.key("hash"), r.hash.as_deref(), HashMode::FiveTuple);
    let flow_state = c.keyword(
        &p.key("flow_state"),
        r.flow_state.as_deref(),
        FlowState::Table,
    );
    let aw_path = p.key("affinity_window");
    let affinity_window = c
        .duration(&aw_path, r.affinity_window.as_deref(), Duration::ZERO)
        .and_then(|d| {
            let s = r.affinity_window.as_deref().unwrap_or("0s");
            c.rule(&aw_path, rules::affinity_window(d, s)).then_some(d)
        });
    let priority = c.int(
        &p.key("priority"),
        r.priority,
        0u8,
        0,
        rules::PRIORITY_MAX as i64,
        " (0 = highest)",
    );
    let rs_path = p.key("ring_size");
    let ring_size = match r.ring_size {
        None => Some(DEFAULT_RING_SIZE),
        Some(Int(v)) => rules::ring_size(v).map_err(|e| c.err(&rs_path, e)).ok(),
    };

    let mut backends = Vec::new();
    let mut backends_ok = true;
    let mut backend_addrs = Vec::new();
    let mut seen: HashMap<IpAddr, usize> = HashMap::new();
    let n = r.backend.len();
    for (j, b) in r.backend.into_iter().enumerate() {
        let bp = p.key("backend").idx(j);
        let (addr, config) = backend(c, &bp, b, address, port);
        if let Some(addr) = addr {
            if let Some(first) = seen.get(&addr) {
                c.err(
                    &bp.key("address"),
                    format!(
                        "\"{addr}\" is already backend[{first}] of this VIP; allowed: each \
                         backend address once per VIP"
                    ),
                );
                backends_ok = false;
            } else {
                seen.insert(addr, j);
            }
            backend_addrs.push((j, addr));
        }
        match config {
            Some(b) => backends.push(b),
            None => backends_ok = false,
        }
    }

    let mut ring_ok = true;
    if let Some(rs) = ring_size {
        let n32 = n as u32;
        if n32 > rs {
            c.err(
                &rs_path,
                format!(
                    "{rs} is smaller than the VIP's {n} backends, so some would get no slot; \
                     allowed: a prime of at least {n}, and at least 100 per backend is \
                     recommended, e.g. {}",
                    prime_at_least((100 * n32).min(RING_SIZE_MAX))
                ),
            );
            ring_ok = false;
        }
        // With more than 655 backends even the largest ring gives fewer than 100 each.
        let recommended = (100 * n32).min(RING_SIZE_MAX);
        if ring_ok && n > 0 && rs < recommended {
            c.warn(
                &rs_path,
                format!(
                    "{rs} slots for {n} backends is fewer than 100 per backend, so their shares \
                     may be off by more than 1%; use a prime of at least {recommended}, e.g. {}",
                    prime_at_least(recommended)
                ),
            );
        }
    }
    if n == 0 {
        c.warn(
            p,
            "has no backends, so its packets are dropped until backends are added",
        );
    }

    let key = match (address, port, protocol) {
        (Some(a), Some(p), Some(proto)) => Some((a, p, proto)),
        _ => None,
    };
    let config = (|| {
        Some(VipConfig {
            name: name.clone()?,
            address: address?,
            port: port?,
            protocol: protocol?,
            hash: hash?,
            affinity_window: affinity_window?,
            priority: priority?,
            ring_size: ring_size.filter(|_| ring_ok)?,
            flow_state: flow_state?,
            backends: backends_ok.then_some(backends)?,
        })
    })();
    VipParts {
        name,
        key,
        backend_addrs,
        config,
    }
}

fn backend(
    c: &mut Checker,
    p: &KeyPath,
    r: RawBackend,
    vip_addr: Option<IpAddr>,
    vip_port: Option<u16>,
) -> (Option<IpAddr>, Option<BackendConfig>) {
    let a_path = p.key("address");
    let address = c
        .ip(&a_path, r.address.as_deref(), "10.1.0.1")
        .and_then(|a| match vip_addr {
            Some(vip) => c.rule(&a_path, rules::backend_address(a, vip)).then_some(a),
            None => Some(a),
        });
    let weight = c.int(
        &p.key("weight"),
        r.weight,
        rules::WEIGHT_DEFAULT,
        0,
        rules::WEIGHT_MAX as i64,
        " (0 = no new flows)",
    );
    let labels = r.labels.unwrap_or_default();
    let mut labels_ok = c.rule(&p.key("labels"), rules::label_count(labels.len()));
    for (k, v) in &labels {
        labels_ok &= c.rule(&p.key("labels").key(k), rules::label(k, v));
    }
    let max_sessions = c.int(
        &p.key("max_sessions"),
        r.max_sessions,
        0u32,
        0,
        u32::MAX as i64,
        " (0 = no cap)",
    );
    let dcgm = match r.dcgm {
        None => Some(None),
        Some(d) => dcgm(c, &p.key("dcgm"), d).map(Some),
    };
    let engine = match r.engine {
        None => Some(None),
        Some(e) => engine(c, &p.key("engine"), e).map(Some),
    };
    let roce = match r.roce {
        None => Some(None),
        Some(x) => roce(c, &p.key("roce"), x).map(Some),
    };
    let health = health_check(c, &p.key("health"), r.health, vip_port);
    let config = (|| {
        Some(BackendConfig {
            address: address?,
            weight: weight?,
            labels: labels_ok.then_some(labels)?,
            max_sessions: max_sessions?,
            dcgm: dcgm?,
            engine: engine?,
            roce: roce?,
            health: health?,
        })
    })();
    (address, config)
}

fn nonempty_list(
    c: &mut Checker,
    p: &KeyPath,
    list: Vec<String>,
    what: &str,
) -> Option<Vec<String>> {
    let mut ok = true;
    for (i, s) in list.iter().enumerate() {
        if s.is_empty() || s.chars().any(|ch| ch.is_whitespace() || ch.is_control()) {
            c.err(
                &p.idx(i),
                format!(
                    "{s:?} is not a valid {what}; allowed: a non-empty value without whitespace"
                ),
            );
            ok = false;
        }
    }
    ok.then_some(list)
}

fn dcgm(c: &mut Checker, p: &KeyPath, r: RawDcgm) -> Option<DcgmConfig> {
    let url = c.url(&p.key("url"), r.url.as_deref());
    let gpus = nonempty_list(
        c,
        &p.key("gpus"),
        r.gpus.unwrap_or_default(),
        "gpu label value",
    );
    let uuids = nonempty_list(c, &p.key("uuids"), r.uuids.unwrap_or_default(), "GPU UUID");
    Some(DcgmConfig {
        url: url?,
        gpus: gpus?,
        uuids: uuids?,
    })
}

fn engine(c: &mut Checker, p: &KeyPath, r: RawEngine) -> Option<EngineConfig> {
    let url = c.url(&p.key("url"), r.url.as_deref());
    let kind = match r.kind {
        None => {
            c.missing(&p.key("kind"), &allowed_keywords::<EngineKind>());
            None
        }
        k => c.keyword(&p.key("kind"), k.as_deref(), EngineKind::Vllm),
    };
    let model = match r.model {
        Some(m) if m.is_empty() || m.chars().any(char::is_control) => {
            c.err(
                &p.key("model"),
                format!(
                    "{m:?} is not a valid model name; allowed: a non-empty model_name label value"
                ),
            );
            None
        }
        m => Some(m),
    };
    Some(EngineConfig {
        url: url?,
        kind: kind?,
        model: model?,
    })
}

fn roce(c: &mut Checker, p: &KeyPath, r: RawRoce) -> Option<RoceConfig> {
    const ALLOWED: &str = "allowed: { sysfs = \"/sys/class/infiniband/DEV/ports/N/hw_counters\" } \
                           or { url = \"http://...\", device = \"mlx5_0\", port = \"1\" }";
    match r {
        RawRoce {
            sysfs: Some(s),
            url: None,
            device: None,
            port: None,
        } => {
            let path = c.abs_path(&p.key("sysfs"), Some(&s), Path::new("/"))?;
            Some(RoceConfig::Sysfs { sysfs: path })
        }
        RawRoce {
            sysfs: None,
            url,
            device,
            port,
        } if url.is_some() || device.is_some() || port.is_some() => {
            let url = c.url(&p.key("url"), url.as_deref());
            let device = match device {
                None => {
                    c.missing(&p.key("device"), "an RDMA device name such as \"mlx5_0\"");
                    None
                }
                Some(d) => c
                    .rule(&p.key("device"), rules::token(&d, 64, "device name"))
                    .then_some(d),
            };
            let port = match port {
                None => {
                    c.missing(&p.key("port"), "a port number as a string, e.g. \"1\"");
                    None
                }
                Some(n) if matches!(n.parse::<u16>(), Ok(x) if x > 0) => Some(n),
                Some(n) => {
                    c.err(
                        &p.key("port"),
                        format!("{n:?} is not a port number; allowed: \"1\"..=\"65535\""),
                    );
                    None
                }
            };
            Some(RoceConfig::Exporter {
                url: url?,
                device: device?,
                port: port?,
            })
        }
        RawRoce { sysfs: Some(_), .. } => {
            c.err(
                p,
                format!("sets both `sysfs` and exporter keys (url, device, port); {ALLOWED}"),
            );
            None
        }
        _ => {
            c.err(p, format!("{{}} is empty; {ALLOWED}"));
            None
        }
    }
}

fn health_check(
    c: &mut Checker,
    p: &KeyPath,
    r: Option<RawHealthCheck>,
    vip_port: Option<u16>,
) -> Option<HealthCheck> {
    let r = match r {
        Some(r) => r,
        None => match vip_port {
            Some(0) => {
                c.err(
                    p,
                    "missing, but the VIP's port is 0 (all ports) so there is no default port; \
                     allowed: { kind = \"tcp\", port = N } or { kind = \"http\", port = N, path = \
                     \"/health\" }",
                );
                return None;
            }
            Some(port) => return Some(HealthCheck::Tcp { port }),
            None => return None,
        },
    };
    let kind = r.kind.as_deref().unwrap_or("tcp");
    let port = match r.port {
        None => match vip_port {
            Some(0) => {
                c.missing(
                    &p.key("port"),
                    "1..=65535 (the VIP's port is 0, so there is no default)",
                );
                None
            }
            other => other,
        },
        v => c.int(&p.key("port"), v, 0u16, 1, 65535, ""),
    };
    match kind {
        "tcp" => {
            let stray = [
                ("path", r.path.as_ref().map(|v| format!("{v:?}"))),
                ("expect_status", r.expect_status.map(|Int(v)| v.to_string())),
            ];
            let mut ok = true;
            for (key, value) in stray {
                if let Some(value) = value {
                    c.err(
                        &p.key(key),
                        format!(
                            "{value} is set but kind is \"tcp\"; allowed: `{key}` only with \
                             kind = \"http\""
                        ),
                    );
                    ok = false;
                }
            }
            if !ok {
                return None;
            }
            Some(HealthCheck::Tcp { port: port? })
        }
        "http" => {
            let path = match r.path {
                None => Some("/health".to_owned()),
                Some(s)
                    if s.starts_with('/')
                        && !s.chars().any(|ch| ch.is_whitespace() || ch.is_control()) =>
                {
                    Some(s)
                }
                Some(s) => {
                    c.err(
                        &p.key("path"),
                        format!(
                            "{s:?} is not an HTTP path; allowed: a path starting with \"/\" \
                             without whitespace, e.g. \"/health\""
                        ),
                    );
                    None
                }
            };
            let expect_status = c.int(
                &p.key("expect_status"),
                r.expect_status,
                200u16,
                100,
                599,
                "",
            );
            Some(HealthCheck::Http {
                port: port?,
                path: path?,
                expect_status: expect_status?,
            })
        }
        other => {
            c.err(
                &p.key("kind"),
                format!("{other:?} is not recognised; allowed: \"tcp\", \"http\""),
            );
            None
        }
    }
}

/// `shorter`'s duration must be below `longer`'s.
fn below(
    c: &mut Checker,
    p: &KeyPath,
    shorter: (&str, Option<&str>, Option<Duration>),
    longer: (&str, Option<Duration>),
    relation: &str,
) {
    let (Some(s), Some(l)) = (shorter.2, longer.1) else {
        return;
    };
    if s >= l {
        let shown = shorter
            .1
            .map_or_else(|| humantime::format_duration(s).to_string(), str::to_owned);
        c.err(
            &p.key(shorter.0),
            format!(
                "{shown:?} is not shorter than {p}.{} = \"{}\"; allowed: {relation}",
                longer.0,
                humantime::format_duration(l)
            ),
        );
    }
}

fn health(c: &mut Checker, p: &KeyPath, r: RawHealth) -> Option<HealthConfig> {
    let d = HealthConfig::default();
    let interval = c.positive(&p.key("interval"), r.interval.as_deref(), d.interval);
    let timeout = c.positive(&p.key("timeout"), r.timeout.as_deref(), d.timeout);
    below(
        c,
        p,
        ("timeout", r.timeout.as_deref(), timeout),
        ("interval", interval),
        "a timeout shorter than the interval",
    );
    let rise = c.int(&p.key("rise"), r.rise, d.rise, 1, 10, "");
    let fall = c.int(&p.key("fall"), r.fall, d.fall, 1, 10, "");
    let out = HealthConfig {
        interval: interval?,
        timeout: timeout?,
        rise: rise?,
        fall: fall?,
    };
    (out.timeout < out.interval).then_some(out)
}

fn telemetry(c: &mut Checker, p: &KeyPath, r: RawTelemetry) -> Option<TelemetryConfig> {
    let d = TelemetryConfig::default();
    let interval = c.positive(
        &p.key("scrape_interval"),
        r.scrape_interval.as_deref(),
        d.scrape_interval,
    );
    let timeout = c.positive(
        &p.key("scrape_timeout"),
        r.scrape_timeout.as_deref(),
        d.scrape_timeout,
    );
    let stale = c.positive(
        &p.key("stale_after"),
        r.stale_after.as_deref(),
        d.stale_after,
    );
    below(
        c,
        p,
        ("scrape_timeout", r.scrape_timeout.as_deref(), timeout),
        ("scrape_interval", interval),
        "a timeout shorter than the scrape interval",
    );
    if let (Some(i), Some(s)) = (interval, stale) {
        if s <= i {
            let shown = r.stale_after.as_deref().unwrap_or("3s");
            c.err(
                &p.key("stale_after"),
                format!(
                    "{shown:?} is not longer than {p}.scrape_interval = \"{}\"; allowed: longer \
                     than the scrape interval, e.g. 3 intervals",
                    humantime::format_duration(i)
                ),
            );
        }
    }
    let max = c.int(
        &p.key("max_concurrent_scrapes"),
        r.max_concurrent_scrapes,
        d.max_concurrent_scrapes,
        1,
        256,
        "",
    );
    let out = TelemetryConfig {
        scrape_interval: interval?,
        scrape_timeout: timeout?,
        stale_after: stale?,
        max_concurrent_scrapes: max?,
    };
    (out.scrape_timeout < out.scrape_interval && out.stale_after > out.scrape_interval)
        .then_some(out)
}

fn policy(c: &mut Checker, p: &KeyPath, r: RawPolicy) -> Option<PolicyConfig> {
    let d = PolicyConfig::default();
    let unit = |v: f64| v > 0.0 && v <= 1.0;
    let ewma_alpha = c.num(
        &p.key("ewma_alpha"),
        r.ewma_alpha,
        d.ewma_alpha,
        unit,
        "0 < ewma_alpha <= 1",
    );
    let weight_levels = c.int(
        &p.key("weight_levels"),
        r.weight_levels,
        d.weight_levels,
        2,
        64,
        "",
    );
    let hysteresis = c.num(
        &p.key("hysteresis"),
        r.hysteresis,
        d.hysteresis,
        |v| (0.0..0.5).contains(&v),
        "0 <= hysteresis < 0.5",
    );
    let gpu_util_high = c.num(
        &p.key("gpu_util_high"),
        r.gpu_util_high,
        d.gpu_util_high,
        unit,
        "0 < gpu_util_high <= 1",
    );
    let kv_cache_high = c.num(
        &p.key("kv_cache_high"),
        r.kv_cache_high,
        d.kv_cache_high,
        unit,
        "0 < kv_cache_high <= 1",
    );
    let queue_depth_high = c.int(
        &p.key("queue_depth_high"),
        r.queue_depth_high,
        d.queue_depth_high,
        1,
        u32::MAX as i64,
        "",
    );
    let temp_high_c = c.num(
        &p.key("temp_high_c"),
        r.temp_high_c,
        d.temp_high_c,
        |v| v > 0.0 && v <= 150.0,
        "0 < temp_high_c <= 150",
    );
    let ecn = c.num(
        &p.key("ecn_rate_high"),
        r.ecn_rate_high,
        d.ecn_rate_high,
        |v| v > 0.0,
        "a number > 0 (marked packets per second)",
    );
    let cnp = c.num(
        &p.key("cnp_rate_high"),
        r.cnp_rate_high,
        d.cnp_rate_high,
        |v| v > 0.0,
        "a number > 0 (CNPs per second)",
    );
    let cooldown_base = c.positive(
        &p.key("cooldown_base"),
        r.cooldown_base.as_deref(),
        d.cooldown_base,
    );
    let cooldown_max = c.positive(
        &p.key("cooldown_max"),
        r.cooldown_max.as_deref(),
        d.cooldown_max,
    );
    if let (Some(b), Some(m)) = (cooldown_base, cooldown_max) {
        if m < b {
            let shown = r.cooldown_max.as_deref().unwrap_or("10m");
            c.err(
                &p.key("cooldown_max"),
                format!(
                    "{shown:?} is shorter than {p}.cooldown_base = \"{}\"; allowed: at least \
                     cooldown_base",
                    humantime::format_duration(b)
                ),
            );
        }
    }
    let flap_window = c.positive(
        &p.key("flap_window"),
        r.flap_window.as_deref(),
        d.flap_window,
    );
    let stable_period = c.positive(
        &p.key("stable_period"),
        r.stable_period.as_deref(),
        d.stable_period,
    );
    let slow_start = c.duration(&p.key("slow_start"), r.slow_start.as_deref(), d.slow_start);
    let shed = c.keyword(&p.key("shed"), r.shed.as_deref(), d.shed);
    let out = PolicyConfig {
        ewma_alpha: ewma_alpha?,
        weight_levels: weight_levels?,
        hysteresis: hysteresis?,
        gpu_util_high: gpu_util_high?,
        kv_cache_high: kv_cache_high?,
        queue_depth_high: queue_depth_high?,
        temp_high_c: temp_high_c?,
        ecn_rate_high: ecn?,
        cnp_rate_high: cnp?,
        cooldown_base: cooldown_base?,
        cooldown_max: cooldown_max?,
        flap_window: flap_window?,
        stable_period: stable_period?,
        slow_start: slow_start?,
        shed: shed?,
    };
    (out.cooldown_max >= out.cooldown_base).then_some(out)
}
