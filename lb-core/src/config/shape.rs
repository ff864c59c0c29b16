//! Stage 2: the shape of every table, read with serde into raw types.

use super::*;

// ------------------------------------------------------------------------------------------
// Stage 2: shape (serde)
// ------------------------------------------------------------------------------------------

/// An integer of any TOML/JSON size (range checks come later, with better messages).
#[derive(Clone, Copy, Debug)]
pub(super) struct Int(pub(super) i64);

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
pub(super) struct Num(pub(super) f64);

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
pub(super) struct DurStr(pub(super) String);

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
pub(super) enum RawMode {
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
pub(super) struct RawConfig {
    pub(super) daemon: Option<RawDaemon>,
    pub(super) admin: Option<RawAdmin>,
    pub(super) metrics: Option<RawMetrics>,
    pub(super) dataplane: Option<RawDataplane>,
    #[serde(default)]
    pub(super) vip: Vec<RawVip>,
    pub(super) health: Option<RawHealth>,
    pub(super) telemetry: Option<RawTelemetry>,
    pub(super) policy: Option<RawPolicy>,
    pub(super) bgp: Option<super::bgp::RawBgp>,
    pub(super) fleet: Option<super::fleet::RawFleet>,
    #[serde(default)]
    pub(super) tenant: Vec<RawTenant>,
}

pub(super) const SECTIONS: &str =
    "daemon, admin, metrics, dataplane, vip, health, telemetry, policy, bgp, fleet, tenant";

/// One `[[tenant]]`.
#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub(super) struct RawTenant {
    pub(super) name: Option<String>,
    pub(super) prefixes: Option<Vec<String>>,
    pub(super) weight: Option<Int>,
    pub(super) max_sessions: Option<Int>,
    pub(super) new_sessions_per_sec: Option<Int>,
    pub(super) burst: Option<Int>,
}

/// One `[[vip.tenant]]`.
#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub(super) struct RawVipTenant {
    pub(super) name: Option<String>,
    pub(super) weight: Option<Int>,
    pub(super) max_sessions: Option<Int>,
    pub(super) new_sessions_per_sec: Option<Int>,
    pub(super) burst: Option<Int>,
}

/// What `PUT /v1/tenants` and `sluice tenant set` send: the `[[tenant]]` tables.
#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub(super) struct RawTenantList {
    #[serde(default)]
    pub(super) tenant: Vec<RawTenant>,
}

#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub(super) struct RawDaemon {
    pub(super) bpffs: Option<String>,
    pub(super) state_file: Option<String>,
    pub(super) keep_dataplane_on_exit: Option<bool>,
    pub(super) log_format: Option<String>,
    pub(super) log_level: Option<String>,
}

#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub(super) struct RawAdmin {
    pub(super) socket: Option<String>,
    pub(super) mode: Option<RawMode>,
    pub(super) group: Option<String>,
    pub(super) audit_log: Option<String>,
}

#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub(super) struct RawMetrics {
    pub(super) enabled: Option<bool>,
    pub(super) listen: Option<String>,
}

#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub(super) struct RawDataplane {
    pub(super) interfaces: Option<Vec<RawInterface>>,
    pub(super) hash_seed: Option<Int>,
    pub(super) encap_source_v4: Option<String>,
    pub(super) encap_source_v6: Option<String>,
    pub(super) fallback_mac: Option<String>,
    pub(super) conn_table_size: Option<Int>,
    pub(super) affinity_table_size: Option<Int>,
    pub(super) max_vips: Option<Int>,
    pub(super) flood_new_flows_per_sec: Option<Int>,
    pub(super) flow_idle_timeout: Option<String>,
}

#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub(super) struct RawInterface {
    pub(super) name: Option<String>,
    pub(super) mode: Option<String>,
}

#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub(super) struct RawVip {
    pub(super) name: Option<String>,
    pub(super) address: Option<String>,
    pub(super) port: Option<Int>,
    pub(super) protocol: Option<String>,
    pub(super) hash: Option<String>,
    pub(super) affinity_window: Option<DurStr>,
    pub(super) priority: Option<Int>,
    pub(super) ring_size: Option<Int>,
    pub(super) flow_state: Option<String>,
    pub(super) inband: Option<bool>,
    pub(super) quic: Option<String>,
    pub(super) quic_server_id_len: Option<Int>,
    pub(super) quic_config_rotation: Option<Int>,
    #[serde(default)]
    pub(super) backend: Vec<RawBackend>,
    #[serde(default)]
    pub(super) tenant: Vec<RawVipTenant>,
}

#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub(super) struct RawBackend {
    pub(super) address: Option<String>,
    pub(super) weight: Option<Int>,
    pub(super) labels: Option<BTreeMap<String, String>>,
    pub(super) max_sessions: Option<Int>,
    pub(super) dcgm: Option<RawDcgm>,
    pub(super) engine: Option<RawEngine>,
    pub(super) roce: Option<RawRoce>,
    pub(super) health: Option<RawHealthCheck>,
    pub(super) quic_server_id: Option<String>,
}

#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub(super) struct RawDcgm {
    pub(super) url: Option<String>,
    pub(super) gpus: Option<Vec<String>>,
    pub(super) uuids: Option<Vec<String>>,
}

#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub(super) struct RawEngine {
    pub(super) url: Option<String>,
    pub(super) kind: Option<String>,
    pub(super) model: Option<String>,
}

#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub(super) struct RawRoce {
    pub(super) sysfs: Option<String>,
    pub(super) url: Option<String>,
    pub(super) device: Option<String>,
    pub(super) port: Option<String>,
}

#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub(super) struct RawHealthCheck {
    pub(super) kind: Option<String>,
    pub(super) port: Option<Int>,
    pub(super) path: Option<String>,
    pub(super) expect_status: Option<Int>,
}

#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub(super) struct RawHealth {
    pub(super) interval: Option<DurStr>,
    pub(super) timeout: Option<DurStr>,
    pub(super) rise: Option<Int>,
    pub(super) fall: Option<Int>,
}

#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub(super) struct RawTelemetry {
    pub(super) scrape_interval: Option<DurStr>,
    pub(super) scrape_timeout: Option<DurStr>,
    pub(super) stale_after: Option<DurStr>,
    pub(super) max_concurrent_scrapes: Option<Int>,
}

#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub(super) struct RawPolicy {
    pub(super) ewma_alpha: Option<Num>,
    pub(super) weight_levels: Option<Int>,
    pub(super) hysteresis: Option<Num>,
    pub(super) gpu_util_high: Option<Num>,
    pub(super) kv_cache_high: Option<Num>,
    pub(super) queue_depth_high: Option<Int>,
    pub(super) temp_high_c: Option<Num>,
    pub(super) ecn_rate_high: Option<Num>,
    pub(super) cnp_rate_high: Option<Num>,
    pub(super) cooldown_base: Option<DurStr>,
    pub(super) cooldown_max: Option<DurStr>,
    pub(super) flap_window: Option<DurStr>,
    pub(super) stable_period: Option<DurStr>,
    pub(super) slow_start: Option<DurStr>,
    pub(super) shed: Option<String>,
    pub(super) tenant_busy_fraction: Option<Num>,
}

/// (span, key path, message) of a shape error.
pub(super) type ShapeIssue = (Range<usize>, String, String);

/// Reads the document table by table, so a shape error in one table does not hide those in
/// the others.
pub(super) fn raw_from_document(
    root: &Spanned<DeTable>,
    issues: &mut Vec<ShapeIssue>,
) -> RawConfig {
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
            "bgp" => raw.bgp = read(root, v, issues),
            "fleet" => raw.fleet = read(root, v, issues),
            "vip" => raw.vip = read_tables(v, "vip", issues, |t, issues| read_vip(root, t, issues)),
            "tenant" => {
                raw.tenant = read_tables(v, "tenant", issues, |t, issues| read(root, t, issues))
            }
            other => issues.push((
                k.span(),
                KeyPath::default().key(other).to_string(),
                format!("unknown section `{other}`, expected one of {SECTIONS}"),
            )),
        }
    }

    raw
}

/// Reads an array of tables (`[[name]]`) with `each`, recording a shape error for anything
/// else.
fn read_tables<T>(
    v: &Spanned<DeValue>,
    name: &str,
    issues: &mut Vec<ShapeIssue>,
    mut each: impl FnMut(&Spanned<DeValue>, &mut Vec<ShapeIssue>) -> Option<T>,
) -> Vec<T> {
    match v.get_ref() {
        DeValue::Array(tables) => tables.iter().filter_map(|t| each(t, issues)).collect(),
        _ => {
            issues.push((
                v.span(),
                name.to_owned(),
                format!(
                    "invalid type: {}, expected an array of tables ([[{name}]])",
                    v.get_ref().type_str()
                ),
            ));
            Vec::new()
        }
    }
}

/// Deserializes one table, recording a shape error with its span and key path.
pub(super) fn read<T: de::DeserializeOwned>(
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
pub(super) fn read_vip(
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
