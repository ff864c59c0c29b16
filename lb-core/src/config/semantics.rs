//! Stage 3: ranges, formats, uniqueness and cross-key rules, on the raw tables.

use super::*;

// ------------------------------------------------------------------------------------------
// Stage 3: semantics
// ------------------------------------------------------------------------------------------

/// Collected problems, each with its key path.
#[derive(Default)]
pub(super) struct Checker {
    issues: Found,
    warnings: Found,
}

pub(super) const DURATION_ALLOWED: &str =
    "allowed: a number and a unit (ns, us, ms, s, m, h, d), e.g. \"500ms\", \"10s\", \"5m\"";

impl Checker {
    pub(super) fn err(&mut self, path: &KeyPath, msg: impl Into<String>) {
        self.issues.push((path.clone(), msg.into()));
    }

    pub(super) fn warn(&mut self, path: &KeyPath, msg: impl Into<String>) {
        self.warnings.push((path.clone(), msg.into()));
    }

    pub(super) fn missing(&mut self, path: &KeyPath, allowed: &str) {
        self.err(path, format!("missing (required); allowed: {allowed}"));
    }

    /// An integer in `lo..=hi`; `None` (after recording why) when out of range.
    pub(super) fn int<T: TryFrom<i64>>(
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
    pub(super) fn num(
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

    pub(super) fn duration(
        &mut self,
        path: &KeyPath,
        v: Option<&str>,
        default: Duration,
    ) -> Option<Duration> {
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
    pub(super) fn positive(
        &mut self,
        path: &KeyPath,
        v: Option<&str>,
        default: Duration,
    ) -> Option<Duration> {
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

    pub(super) fn keyword<K: Keyword + FromStr<Err = UnknownKeyword>>(
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

    pub(super) fn abs_path(
        &mut self,
        path: &KeyPath,
        v: Option<&str>,
        default: &Path,
    ) -> Option<PathBuf> {
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
    pub(super) fn ip(&mut self, path: &KeyPath, v: Option<&str>, example: &str) -> Option<IpAddr> {
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
    pub(super) fn rule(&mut self, path: &KeyPath, r: Result<(), String>) -> bool {
        r.map_err(|e| self.err(path, e)).is_ok()
    }

    pub(super) fn url(&mut self, path: &KeyPath, v: Option<&str>) -> Option<String> {
        const ALLOWED: &str = "allowed: an http:// URL such as \
                               \"http://10.1.0.1:9400/metrics\"";
        let Some(s) = v else {
            self.missing(path, &ALLOWED["allowed: ".len()..]);
            return None;
        };
        if s.starts_with("https://") {
            // Refused here rather than scraped with TLS: exporters (dcgm-exporter, vLLM,
            // SGLang, node_exporter) serve plain HTTP on the backend network, and a URL that
            // passed here but failed in the scraper would stop `sluice run` after the XDP
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
pub(super) fn valid_url(s: &str) -> bool {
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
pub(super) fn prime_at_least(n: u32) -> u32 {
    (n..RING_SIZE_MAX)
        .find(|&p| is_prime(p))
        .unwrap_or(RING_SIZE_MAX)
}

/// Problems found, each with its key path.
pub(super) type Found = Vec<(KeyPath, String)>;

/// The configuration (when every part is valid), its errors and its warnings.
pub(super) fn validate(raw: RawConfig) -> (Option<Config>, Found, Found) {
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
    let bgp = raw.bgp.map(|r| {
        r.validate().map_err(|found| {
            for (k, msg) in found {
                c.err(&root.key("bgp").key(&k), msg);
            }
        })
    });
    let fleet = raw.fleet.map(|r| {
        super::fleet::validate(r).map_err(|errs| {
            for (key, msg) in errs {
                c.err(&root.key("fleet").key(key), msg);
            }
        })
    });
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
            bgp: bgp.transpose().ok()?,
            fleet: fleet.transpose().ok()?,
        })
    })();
    (config, c.issues, c.warnings)
}

pub(super) fn daemon(c: &mut Checker, p: &KeyPath, r: RawDaemon) -> Option<DaemonConfig> {
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
pub(super) const SUN_PATH_MAX: usize = 107;

pub(super) fn admin(c: &mut Checker, p: &KeyPath, r: RawAdmin) -> Option<AdminConfig> {
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
pub(super) fn check_mode(
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

pub(super) fn metrics(c: &mut Checker, p: &KeyPath, r: RawMetrics) -> Option<MetricsConfig> {
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
pub(super) fn valid_ifname(s: &str) -> bool {
    (1..=15).contains(&s.len())
        && s != "."
        && s != ".."
        && !s
            .chars()
            .any(|ch| ch == '/' || ch == ':' || ch.is_whitespace() || ch.is_control())
}

pub(super) fn dataplane(c: &mut Checker, p: &KeyPath, r: RawDataplane) -> Option<DataplaneConfig> {
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
pub(super) fn mac(c: &mut Checker, path: &KeyPath, s: &str) -> Option<Mac> {
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
pub(super) fn cidr(
    c: &mut Checker,
    path: &KeyPath,
    v: Option<String>,
    v4: bool,
) -> Option<Option<Cidr>> {
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

pub(super) fn vips(
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
    // Every VIP's name and address, and every backend's place and address: no backend may
    // be any VIP's address.
    let mut vip_addrs: Vec<(String, IpAddr)> = Vec::new();
    let mut backend_places: Vec<(KeyPath, IpAddr)> = Vec::new();
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
        if let Some((address, ..)) = parts.key {
            let name = parts.name.clone().unwrap_or_else(|| format!("vip[{i}]"));
            vip_addrs.push((name, address));
        }
        for &(j, addr) in &parts.backend_addrs {
            backend_places.push((p.key("backend").idx(j).key("address"), addr));
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

    for (path, addr) in &backend_places {
        let vips = vip_addrs.iter().map(|(n, a)| (n.as_str(), *a));
        ok &= c.rule(path, rules::backend_not_a_vip(*addr, vips));
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
pub(super) struct VipParts {
    name: Option<String>,
    key: Option<(IpAddr, u16, Protocol)>,
    /// (index, address) of every backend whose address is valid.
    backend_addrs: Vec<(usize, IpAddr)>,
    config: Option<VipConfig>,
}

pub(super) fn vip(c: &mut Checker, p: &KeyPath, r: RawVip) -> VipParts {
    let name = match r.name {
        None => {
            c.missing(&p.key("name"), "a unique name of a-z, 0-9, \"-\" and \"_\"");
            None
        }
        Some(n) => c.rule(&p.key("name"), rules::vip_name(&n)).then_some(n),
    };
    let a_path = p.key("address");
    let address = c
        .ip(&a_path, r.address.as_deref(), "10.200.0.1")
        .filter(|&a| c.rule(&a_path, rules::vip_address(a)));
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
    let inband = r.inband.unwrap_or(false);
    if inband && flow_state == Some(FlowState::SecondChance) {
        c.err(
            &p.key("inband"),
            "in-band signals live in the connection table, which a second-chance VIP does \
             not use; set flow_state = \"table\" or inband = false"
                .to_string(),
        );
    }
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
            inband,
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

pub(super) fn backend(
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

pub(super) fn nonempty_list(
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

pub(super) fn dcgm(c: &mut Checker, p: &KeyPath, r: RawDcgm) -> Option<DcgmConfig> {
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

pub(super) fn engine(c: &mut Checker, p: &KeyPath, r: RawEngine) -> Option<EngineConfig> {
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

pub(super) fn roce(c: &mut Checker, p: &KeyPath, r: RawRoce) -> Option<RoceConfig> {
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

pub(super) fn health_check(
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
pub(super) fn below(
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

pub(super) fn health(c: &mut Checker, p: &KeyPath, r: RawHealth) -> Option<HealthConfig> {
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

pub(super) fn telemetry(c: &mut Checker, p: &KeyPath, r: RawTelemetry) -> Option<TelemetryConfig> {
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

pub(super) fn policy(c: &mut Checker, p: &KeyPath, r: RawPolicy) -> Option<PolicyConfig> {
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
    let shed = match r.shed.as_deref() {
        None => Some(d.shed),
        s => c.keyword(&p.key("shed"), s, ShedMode::Drop).map(Some),
    };
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
