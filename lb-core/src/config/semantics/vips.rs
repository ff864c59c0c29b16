//! `[[vip]]` and its backends: addresses, weights, health checks and telemetry sources, and
//! the rules across VIPs.

use super::*;

pub(in crate::config) fn vips(
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
pub(in crate::config) struct VipParts {
    name: Option<String>,
    key: Option<(IpAddr, u16, Protocol)>,
    /// (index, address) of every backend whose address is valid.
    backend_addrs: Vec<(usize, IpAddr)>,
    config: Option<VipConfig>,
}

pub(in crate::config) fn vip(c: &mut Checker, p: &KeyPath, r: RawVip) -> VipParts {
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
    let mut backends_ok_quic = true;
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

    let quic = c.keyword(&p.key("quic"), r.quic.as_deref(), QuicMode::Off);
    if let (Some(q), Some(proto)) = (quic, protocol) {
        if !c.rule(
            &p.key("quic"),
            rules::quic_mode(q == QuicMode::Cid, proto == Protocol::Udp),
        ) {
            backends_ok_quic = false;
        }
    }
    let quic_server_id_len = match r.quic_server_id_len {
        None => Some(rules::QUIC_SERVER_ID_LEN_DEFAULT),
        Some(Int(v)) => rules::quic_server_id_len(v)
            .map_err(|e| c.err(&p.key("quic_server_id_len"), e))
            .ok(),
    };
    let quic_config_rotation = match r.quic_config_rotation {
        None => Some(0),
        Some(Int(v)) => rules::quic_config_rotation(v)
            .map_err(|e| c.err(&p.key("quic_config_rotation"), e))
            .ok(),
    };

    let tenants = vip_tenants(c, p, r.tenant);
    let n = r.backend.len();
    let (backends, backend_addrs) = vip_backends(
        c,
        p,
        r.backend,
        (address, port),
        quic.zip(quic_server_id_len),
    );
    let ring_ok = ring_size.is_none_or(|rs| ring_fits(c, &rs_path, rs, n));
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
            quic: quic.filter(|_| backends_ok_quic)?,
            quic_server_id_len: quic_server_id_len?,
            quic_config_rotation: quic_config_rotation?,
            backends: backends?,
            tenants: tenants?,
        })
    })();
    VipParts {
        name,
        key,
        backend_addrs,
        config,
    }
}

/// A VIP's backends, each checked, with the addresses of those whose address is valid;
/// `None` for the list when any backend is refused or listed twice.
fn vip_backends(
    c: &mut Checker,
    p: &KeyPath,
    raw: Vec<RawBackend>,
    (address, port): (Option<IpAddr>, Option<u16>),
    quic: Option<(QuicMode, u8)>,
) -> (Option<Vec<BackendConfig>>, Vec<(usize, IpAddr)>) {
    let mut backends = Vec::new();
    let mut backends_ok = true;
    let mut backend_addrs = Vec::new();
    let mut seen: HashMap<IpAddr, usize> = HashMap::new();
    let mut server_ids: HashMap<u64, usize> = HashMap::new();
    for (j, mut b) in raw.into_iter().enumerate() {
        let bp = p.key("backend").idx(j);
        let sid = quic_server_id(
            c,
            &bp.key("quic_server_id"),
            b.quic_server_id.take(),
            quic,
            (j, &mut server_ids),
        );
        let (addr, config) = backend(c, &bp, b, address, port);
        let config = config.zip(sid).map(|(b, sid)| BackendConfig {
            quic_server_id: sid,
            ..b
        });
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
    (backends_ok.then_some(backends), backend_addrs)
}

/// Whether a ring of `rs` slots gives each of `n` backends one (an error otherwise); warns
/// when they get fewer than 100 each.
fn ring_fits(c: &mut Checker, rs_path: &KeyPath, rs: u32, n: usize) -> bool {
    let n32 = n as u32;
    if n32 > rs {
        c.err(
            rs_path,
            format!(
                "{rs} is smaller than the VIP's {n} backends, so some would get no slot; \
                 allowed: a prime of at least {n}, and at least 100 per backend is \
                 recommended, e.g. {}",
                prime_at_least((100 * n32).min(RING_SIZE_MAX))
            ),
        );
        return false;
    }
    // With more than 655 backends even the largest ring gives fewer than 100 each.
    let recommended = (100 * n32).min(RING_SIZE_MAX);
    if n > 0 && rs < recommended {
        c.warn(
            rs_path,
            format!(
                "{rs} slots for {n} backends is fewer than 100 per backend, so their shares \
                 may be off by more than 1%; use a prime of at least {recommended}, e.g. {}",
                prime_at_least(recommended)
            ),
        );
    }
    true
}

pub(in crate::config) fn backend(
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
            quic_server_id: None,
        })
    })();
    (address, config)
}

/// A backend's `quic_server_id` under its VIP's `quic` mode and server-ID length (`None`
/// when either is invalid): required with `quic = "cid"`, refused otherwise, unique within
/// the VIP (`seen`: the value of each earlier backend's). `None` after recording why;
/// `Some(id)` with the ID in lowercase.
pub(in crate::config) fn quic_server_id(
    c: &mut Checker,
    p: &KeyPath,
    raw: Option<String>,
    quic: Option<(QuicMode, u8)>,
    (j, seen): (usize, &mut HashMap<u64, usize>),
) -> Option<Option<String>> {
    match (raw, quic) {
        (None, Some((QuicMode::Cid, len))) => {
            c.missing(
                p,
                &format!(
                    "{} hex digits (quic_server_id_len = {len} octets), not all zero, unique \
                     within the VIP (every backend of a quic = \"cid\" VIP has one)",
                    2 * len
                ),
            );
            None
        }
        (None, _) => Some(None),
        (Some(s), Some((QuicMode::Off, _))) => {
            c.err(
                p,
                format!(
                    "{} is set but the VIP's quic is \"off\"; allowed: quic_server_id only on \
                     the backends of a quic = \"cid\" VIP",
                    rules::quoted(&s)
                ),
            );
            None
        }
        (Some(s), Some((QuicMode::Cid, len))) => {
            let v = rules::quic_server_id(&s, len)
                .map_err(|e| c.err(p, e))
                .ok()?;
            if let Some(first) = seen.get(&v) {
                c.err(
                    p,
                    format!(
                        "{s:?} is already the server ID of backend[{first}] of this VIP; \
                         allowed: a server ID unique within the VIP"
                    ),
                );
                return None;
            }
            seen.insert(v, j);
            Some(Some(s.to_ascii_lowercase()))
        }
        // The VIP's quic settings are wrong (reported there).
        (Some(s), None) => Some(Some(s.to_ascii_lowercase())),
    }
}

pub(in crate::config) fn nonempty_list(
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

const SCRAPED: UrlUse = UrlUse {
    client: "the telemetry scraper",
    server: "the exporter's",
    example: "http://10.1.0.1:9400/metrics",
};

pub(in crate::config) fn dcgm(c: &mut Checker, p: &KeyPath, r: RawDcgm) -> Option<DcgmConfig> {
    let url = c.url(&p.key("url"), r.url.as_deref(), &SCRAPED);
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

pub(in crate::config) fn engine(
    c: &mut Checker,
    p: &KeyPath,
    r: RawEngine,
) -> Option<EngineConfig> {
    let url = c.url(&p.key("url"), r.url.as_deref(), &SCRAPED);
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

pub(in crate::config) fn roce(c: &mut Checker, p: &KeyPath, r: RawRoce) -> Option<RoceConfig> {
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
            let url = c.url(&p.key("url"), url.as_deref(), &SCRAPED);
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

pub(in crate::config) fn health_check(
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
