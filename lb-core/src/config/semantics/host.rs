//! The host's own sections: `[daemon]`, `[admin]`, `[metrics]` and `[dataplane]`.

use super::*;

pub(in crate::config) fn daemon(
    c: &mut Checker,
    p: &KeyPath,
    r: RawDaemon,
) -> Option<DaemonConfig> {
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
pub(in crate::config) const SUN_PATH_MAX: usize = 107;

pub(in crate::config) fn admin(c: &mut Checker, p: &KeyPath, r: RawAdmin) -> Option<AdminConfig> {
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
pub(in crate::config) fn check_mode(
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

pub(in crate::config) fn metrics(
    c: &mut Checker,
    p: &KeyPath,
    r: RawMetrics,
) -> Option<MetricsConfig> {
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
pub(in crate::config) fn valid_ifname(s: &str) -> bool {
    (1..=15).contains(&s.len())
        && s != "."
        && s != ".."
        && !s
            .chars()
            .any(|ch| ch == '/' || ch == ':' || ch.is_whitespace() || ch.is_control())
}

pub(in crate::config) fn dataplane(
    c: &mut Checker,
    p: &KeyPath,
    r: RawDataplane,
) -> Option<DataplaneConfig> {
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
pub(in crate::config) fn mac(c: &mut Checker, path: &KeyPath, s: &str) -> Option<Mac> {
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
pub(in crate::config) fn cidr(
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
