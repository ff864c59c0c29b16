//! The validated configuration: the public types `load` and `parse` return.

use super::*;

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
    /// `[bgp]`: announce the VIPs through BIRD (absent: nothing is announced).
    pub bgp: Option<super::bgp::BgpConfig>,
    /// `[fleet]`: shared state in etcd (`crate::fleet`); none: a single host.
    pub fleet: Option<super::fleet::FleetConfig>,
    /// The `[[tenant]]` tables, in file order (empty: no tenant isolation).
    #[serde(rename = "tenant", skip_serializing_if = "Vec::is_empty")]
    pub tenants: Vec<TenantConfig>,
}

/// One `[[tenant]]`: a named set of client prefixes and its limits on every VIP.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct TenantConfig {
    /// Unique; 1..=32 characters of `a-z 0-9 - _`; `"default"` names the clients no prefix
    /// matches.
    pub name: String,
    /// Client prefixes (host bits zero), each in one tenant only; empty exactly for
    /// `"default"`.
    pub prefixes: Vec<Cidr>,
    /// The tenant's share of a busy or full pool, 1..=1000.
    pub weight: u32,
    /// Concurrent sessions per VIP; 0 = no limit.
    pub max_sessions: u32,
    /// Sustained new sessions per second per VIP; 0 = no limit.
    pub new_sessions_per_sec: u32,
    /// New sessions at once after idling; 0 = `max(1, new_sessions_per_sec)`. Set only with
    /// a rate.
    pub burst: u32,
}

/// The limits a tenant has on one VIP: its `[[tenant]]` values with the VIP's
/// `[[vip.tenant]]` override applied.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
pub struct TenantLimitsConfig {
    pub weight: u32,
    pub max_sessions: u32,
    pub new_sessions_per_sec: u32,
    pub burst: u32,
}

impl TenantConfig {
    /// This tenant's limits on a VIP whose overrides are `overrides`.
    pub fn limits_on(&self, overrides: &[TenantOverride]) -> TenantLimitsConfig {
        let o = overrides.iter().find(|o| o.name == self.name);
        let pick = |v: Option<u32>, d: u32| v.unwrap_or(d);
        TenantLimitsConfig {
            weight: pick(o.and_then(|o| o.weight), self.weight),
            max_sessions: pick(o.and_then(|o| o.max_sessions), self.max_sessions),
            new_sessions_per_sec: pick(
                o.and_then(|o| o.new_sessions_per_sec),
                self.new_sessions_per_sec,
            ),
            burst: pick(o.and_then(|o| o.burst), self.burst),
        }
    }

    /// The default tenant with no limits, for a VIP when no `"default"` table is given.
    pub fn unlimited_default() -> Self {
        TenantConfig {
            name: rules::DEFAULT_TENANT.to_owned(),
            prefixes: Vec::new(),
            weight: 1,
            max_sessions: 0,
            new_sessions_per_sec: 0,
            burst: 0,
        }
    }
}

impl TenantLimitsConfig {
    /// `TenantLimits::interval_ns` and `burst_ns`: the GCRA's emission interval and
    /// tolerance (both 0 without a rate).
    pub fn gcra_ns(&self) -> (u64, u64) {
        if self.new_sessions_per_sec == 0 {
            return (0, 0);
        }
        let interval = 1_000_000_000 / u64::from(self.new_sessions_per_sec);
        let burst = if self.burst == 0 {
            self.new_sessions_per_sec.max(1)
        } else {
            self.burst
        };
        (interval, u64::from(burst) * interval)
    }
}

/// One `[[vip.tenant]]`: a VIP's own values for a tenant; unset keys come from the
/// `[[tenant]]` table.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct TenantOverride {
    /// A `[[tenant]]`'s name, or `"default"`; once per VIP.
    pub name: String,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub weight: Option<u32>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub max_sessions: Option<u32>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub new_sessions_per_sec: Option<u32>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub burst: Option<u32>,
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
    /// Measure time to first byte and delivery from the clients' ACKs (`inband = true`);
    /// needs the connection table (`flow_state = "table"`).
    pub inband: bool,
    /// QUIC connection-ID routing (`quic = "cid"`, UDP only): packets go to the backend whose
    /// server ID their destination connection ID carries.
    pub quic: QuicMode,
    /// Octets of a QUIC-LB server ID, 1..=8 (used with `quic = "cid"`).
    pub quic_server_id_len: u8,
    /// The config rotation codepoint of the VIP's connection IDs, 0..=6 (used with
    /// `quic = "cid"`).
    pub quic_config_rotation: u8,
    /// The `[[vip.backend]]` tables, in file order; addresses unique.
    #[serde(rename = "backend")]
    pub backends: Vec<BackendConfig>,
    /// The `[[vip.tenant]]` overrides, each naming a `[[tenant]]` once.
    #[serde(rename = "tenant", skip_serializing_if = "Vec::is_empty")]
    pub tenants: Vec<TenantOverride>,
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
        self.hash.vip_flags() | self.flow_state.vip_flags() | self.quic.vip_flags()
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
    /// The QUIC-LB server ID (lowercase hex, `2 * quic_server_id_len` digits, not all zero,
    /// unique within the VIP): set exactly on the backends of a `quic = "cid"` VIP.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub quic_server_id: Option<String>,
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
    pub url: HttpUrl,
    /// Values of the `gpu` label to select (empty: every GPU the exporter reports).
    pub gpus: Vec<String>,
    /// Values of the `UUID` label to select (empty: no UUID filter).
    pub uuids: Vec<String>,
}

/// Inference engine metrics endpoint for this backend.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub struct EngineConfig {
    /// http:// URL of the engine's Prometheus metrics.
    pub url: HttpUrl,
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
        url: HttpUrl,
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
    /// How refused sessions are refused. Set, it turns admission on for every VIP; unset,
    /// only VIPs with a `max_sessions` cap on a backend refuse (by drop), and elsewhere a
    /// backend full by telemetry is only probed past.
    pub shed: Option<ShedMode>,
    /// The part (0, 1] of a VIP's backends' session caps its sessions fill when its pool is
    /// busy for tenants' shares: from there a tenant over its share that presses its limits
    /// is refused new sessions, before any backend is full.
    pub tenant_busy_fraction: f64,
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
            shed: None,
            tenant_busy_fraction: 0.25,
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
    /// How a UDP VIP routes QUIC packets.
    #[derive(Default)]
    QuicMode {
        /// As any UDP flow (the 5-tuple).
        #[default]
        Off = "off",
        /// By the server ID in the destination connection ID (QUIC-LB), so a connection
        /// survives the client's address changes.
        Cid = "cid",
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

impl QuicMode {
    /// Its `VIP_F_*` bit.
    pub fn vip_flags(self) -> u32 {
        match self {
            QuicMode::Off => 0,
            QuicMode::Cid => VIP_F_QUIC_CID,
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
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
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

impl<'de> Deserialize<'de> for Cidr {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        let s = String::deserialize(d)?;
        s.parse()
            .map_err(|e: CidrError| de::Error::custom(format!("{s:?}: {e}")))
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
pub(crate) mod duration_str {
    use std::time::Duration;

    use serde::Serializer;

    pub fn serialize<S: Serializer>(d: &Duration, s: S) -> Result<S::Ok, S::Error> {
        s.collect_str(&humantime::format_duration(*d))
    }
}
