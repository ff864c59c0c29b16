//! The desired steering state and the operations that change it.
//!
//! Pure: no maps, no clock. Every operation validates against a copy and returns the new
//! state, so a rejected request changes nothing and an accepted one is applied whole.

use std::{collections::BTreeMap, net::IpAddr, time::Duration};

use lb_common::{TenantLimits, MAX_BACKENDS, MAX_TENANTS};
use serde::{Deserialize, Serialize};

use crate::{
    config::{self, rules, Cidr, TenantConfig, TenantList, TenantOverride},
    maglev,
};

// One model of a VIP's keywords: the configuration file's, with its spellings and words.
pub use crate::config::{FlowState, HashMode, Protocol, QuicMode};

/// A VIP as an operator describes it (config file or admin API).
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct VipSpec {
    pub name: String,
    pub address: IpAddr,
    /// 0 = every port.
    pub port: u16,
    pub protocol: Protocol,
    #[serde(default)]
    pub hash: HashMode,
    /// Client-affinity window; 0 = off.
    #[serde(default)]
    pub affinity_secs: u32,
    #[serde(default)]
    pub priority: u32,
    #[serde(default = "default_ring")]
    pub ring_size: u32,
    #[serde(default)]
    pub flow_state: FlowState,
    /// In-band signals from the clients' ACKs (`VIP_F_INBAND`).
    #[serde(default)]
    pub inband: bool,
    /// QUIC connection-ID routing (`VIP_F_QUIC_CID`); UDP only. The QUIC keys are left out
    /// of the JSON at their defaults, so a state file or fleet table without QUIC reads the
    /// same as before they existed (and a host of the previous version still reads it).
    #[serde(default, skip_serializing_if = "is_off")]
    pub quic: QuicMode,
    /// Octets of its backends' QUIC-LB server IDs, 1..=8.
    #[serde(
        default = "default_quic_len",
        skip_serializing_if = "is_default_quic_len"
    )]
    pub quic_server_id_len: u8,
    /// The config rotation codepoint of its connection IDs, 0..=6.
    #[serde(default, skip_serializing_if = "is_zero")]
    pub quic_config_rotation: u8,
    /// Its `[[vip.tenant]]` overrides of the tenants' limits.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub tenants: Vec<TenantOverride>,
}

fn default_quic_len() -> u8 {
    rules::QUIC_SERVER_ID_LEN_DEFAULT
}

fn is_off(q: &QuicMode) -> bool {
    *q == QuicMode::Off
}

fn is_default_quic_len(n: &u8) -> bool {
    *n == rules::QUIC_SERVER_ID_LEN_DEFAULT
}

fn is_zero(n: &u8) -> bool {
    *n == 0
}

fn default_ring() -> u32 {
    maglev::DEFAULT_RING_SIZE
}

#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct BackendSpec {
    pub address: IpAddr,
    #[serde(default = "default_weight")]
    pub weight: u32,
    #[serde(default)]
    pub labels: BTreeMap<String, String>,
    /// Concurrent-session cap for admission control; 0 = none.
    #[serde(default)]
    pub max_sessions: u32,
    /// QUIC-LB server ID (hex): set exactly on the backends of a `quic = "cid"` VIP.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub quic_server_id: Option<String>,
}

fn default_weight() -> u32 {
    rules::WEIGHT_DEFAULT
}

/// What the operator asked of a backend.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase", tag = "state")]
pub enum Admin {
    Active,
    /// No new flows; removed when its flows reach zero or at the deadline (unix ms).
    Draining {
        since_ms: u64,
        deadline_ms: Option<u64>,
    },
}

#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Backend {
    pub id: u32,
    pub spec: BackendSpec,
    pub admin: Admin,
    /// Set by health checks; a down backend takes no flows and its flows re-steer.
    #[serde(default = "yes")]
    pub healthy: bool,
}

fn yes() -> bool {
    true
}

/// The data-plane state a backend is written with.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum PlaneState {
    Active,
    Draining,
    Down,
}

impl Backend {
    pub fn plane_state(&self) -> PlaneState {
        if !self.healthy {
            PlaneState::Down
        } else if matches!(self.admin, Admin::Draining { .. }) {
            PlaneState::Draining
        } else {
            PlaneState::Active
        }
    }
}

#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Vip {
    pub id: u32,
    pub spec: VipSpec,
    pub backends: BTreeMap<IpAddr, Backend>,
}

impl Vip {
    /// Backends and weights that make up the Maglev table: active ones with weight > 0.
    /// `weight_of` lets adaptive steering scale the configured weight.
    pub fn table(
        &self,
        seed: u32,
        weight_of: impl Fn(&Backend) -> u32,
    ) -> Result<Vec<u32>, maglev::MaglevError> {
        let keys: Vec<(u32, String, u32)> = self
            .backends
            .values()
            .filter(|b| b.plane_state() == PlaneState::Active)
            .map(|b| (b.id, b.spec.address.to_string(), weight_of(b)))
            .collect();
        let mb: Vec<maglev::MaglevBackend> = keys
            .iter()
            .map(|(id, key, weight)| maglev::MaglevBackend {
                id: *id,
                key,
                weight: *weight,
            })
            .collect();
        maglev::build(&mb, self.spec.ring_size, seed)
    }
}

#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct State {
    pub vips: BTreeMap<String, Vip>,
    /// Next backend id to hand out; ids are not reused until the space wraps, so a stale
    /// connection entry never points at a different backend.
    pub next_backend_id: u32,
    /// The tenants and their data-plane ids (none: no tenant isolation). Left out of the
    /// JSON when empty, so a state file without tenants reads as before.
    #[serde(default, skip_serializing_if = "Tenants::is_empty")]
    pub tenants: Tenants,
}

/// The `[[tenant]]` tables in force and the data-plane id of each named tenant.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct Tenants {
    pub list: Vec<TenantConfig>,
    /// Name → id in `1..MAX_TENANTS`; the default tenant is id 0 and not listed. An id is
    /// kept while its name exists, so its counters and rate state persist.
    pub ids: BTreeMap<String, u32>,
}

impl Tenants {
    pub fn is_empty(&self) -> bool {
        self.list.is_empty()
    }

    /// The data-plane id of a tenant name (`"default"`: 0).
    pub fn id(&self, name: &str) -> Option<u32> {
        if name == rules::DEFAULT_TENANT {
            return Some(0);
        }
        self.ids.get(name).copied()
    }

    /// Every tenant with its id, the default tenant first (its table, or one without
    /// limits).
    pub fn with_ids(&self) -> Vec<(u32, TenantConfig)> {
        let default = self
            .list
            .iter()
            .find(|t| t.name == rules::DEFAULT_TENANT)
            .cloned()
            .unwrap_or_else(TenantConfig::unlimited_default);
        let named = self
            .list
            .iter()
            .filter_map(|t| Some((self.ids.get(&t.name).copied()?, t.clone())));
        std::iter::once((0, default)).chain(named).collect()
    }
}

/// A change requested through the admin API (also what the audit log records).
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(tag = "op", rename_all = "kebab-case", deny_unknown_fields)]
pub enum Op {
    AddVip {
        vip: VipSpec,
        #[serde(default)]
        backends: Vec<BackendSpec>,
    },
    RemoveVip {
        vip: String,
    },
    AddBackend {
        vip: String,
        backend: BackendSpec,
    },
    RemoveBackend {
        vip: String,
        address: IpAddr,
    },
    SetWeight {
        vip: String,
        address: IpAddr,
        weight: u32,
    },
    /// `deadline_ms` is absolute (unix ms); the API turns "--deadline 10m" into it.
    Drain {
        vip: String,
        address: IpAddr,
        deadline_ms: Option<u64>,
    },
    Undrain {
        vip: String,
        address: IpAddr,
    },
    SetHealth {
        vip: String,
        address: IpAddr,
        healthy: bool,
    },
    /// Replaces the `[[tenant]]` tables (`{"op": "set-tenants", "tenant": [...]}`).
    SetTenants(TenantList),
}

#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum OpError {
    #[error("{0}")]
    NotFound(String),
    #[error("{0}")]
    Conflict(String),
    #[error("{0}")]
    Invalid(String),
}

impl OpError {
    pub fn http_status(&self) -> u16 {
        match self {
            OpError::NotFound(_) => 404,
            OpError::Conflict(_) => 409,
            OpError::Invalid(_) => 400,
        }
    }
}

pub struct Limits {
    pub max_vips: u32,
}

impl State {
    pub fn vip(&self, name: &str) -> Result<&Vip, OpError> {
        self.vips.get(name).ok_or_else(|| {
            OpError::NotFound(format!(
                "no VIP named {name:?}; `sluice vip list` shows the VIPs"
            ))
        })
    }

    fn vip_mut(&mut self, name: &str) -> Result<&mut Vip, OpError> {
        self.vip(name)?;
        Ok(self.vips.get_mut(name).expect("checked"))
    }

    /// Sets a backend's health verdict in place (a round of verdicts changes one copy).
    pub fn set_health(&mut self, vip: &str, addr: IpAddr, healthy: bool) -> Result<(), OpError> {
        self.backend_mut(vip, addr)?.healthy = healthy;
        Ok(())
    }

    fn backend_mut(&mut self, vip: &str, addr: IpAddr) -> Result<&mut Backend, OpError> {
        self.vip_mut(vip)?.backends.get_mut(&addr).ok_or_else(|| {
            OpError::NotFound(format!(
                "VIP {vip:?} has no backend {addr}; `sluice backend list {vip}` shows its backends"
            ))
        })
    }

    pub fn backend(&self, vip: &str, addr: IpAddr) -> Result<&Backend, OpError> {
        self.vip(vip)?.backends.get(&addr).ok_or_else(|| {
            OpError::NotFound(format!(
                "VIP {vip:?} has no backend {addr}; `sluice backend list {vip}` shows its backends"
            ))
        })
    }

    fn alloc_vip_id(&self, limits: &Limits) -> Result<u32, OpError> {
        (0..limits.max_vips)
            .find(|id| !self.vips.values().any(|v| v.id == *id))
            .ok_or_else(|| {
                OpError::Conflict(format!(
                    "all {} VIP slots are in use; remove a VIP or raise dataplane.max_vips (needs a data-plane restart)",
                    limits.max_vips
                ))
            })
    }

    fn alloc_backend_id(&mut self) -> Result<u32, OpError> {
        let used: std::collections::BTreeSet<u32> = self
            .vips
            .values()
            .flat_map(|v| v.backends.values().map(|b| b.id))
            .collect();
        let start = self.next_backend_id.clamp(1, MAX_BACKENDS - 1);
        let id = (start..MAX_BACKENDS)
            .chain(1..start)
            .find(|id| !used.contains(id))
            .ok_or_else(|| {
                OpError::Conflict(format!("all {} backend ids are in use", MAX_BACKENDS - 1))
            })?;
        self.next_backend_id = id + 1;
        Ok(id)
    }

    fn check_vip(&self, spec: &VipSpec) -> Result<(), OpError> {
        rules::vip_name(&spec.name).map_err(OpError::Invalid)?;
        rules::vip_address(spec.address)
            .map_err(|e| OpError::Invalid(format!("VIP address {e}")))?;
        if let Some(v) = self
            .vips
            .values()
            .find(|v| v.backends.contains_key(&spec.address))
        {
            return Err(OpError::Invalid(format!(
                "VIP address \"{}\" is a backend of VIP {:?}; allowed: an address that is no \
                 backend's (packets to that backend would come back here)",
                spec.address, v.spec.name
            )));
        }
        if self.vips.contains_key(&spec.name) {
            return Err(OpError::Conflict(format!(
                "a VIP named {:?} exists already",
                spec.name
            )));
        }
        if let Some(other) = self.vips.values().find(|v| {
            v.spec.address == spec.address
                && v.spec.port == spec.port
                && v.spec.protocol == spec.protocol
        }) {
            return Err(OpError::Conflict(format!(
                "{} {}:{} is already VIP {:?}",
                spec.protocol, spec.address, spec.port, other.spec.name
            )));
        }
        // The configuration file's rules, in its words.
        let invalid = |key: &str, e: String| OpError::Invalid(format!("{key}: {e}"));
        rules::ring_size(spec.ring_size.into()).map_err(|e| invalid("ring_size", e))?;
        rules::priority(spec.priority.into()).map_err(|e| invalid("priority", e))?;
        let secs = spec.affinity_secs;
        rules::affinity_window(Duration::from_secs(secs.into()), &format!("{secs}s"))
            .map_err(|e| invalid("affinity_window", e))?;
        rules::quic_mode(spec.quic == QuicMode::Cid, spec.protocol == Protocol::Udp)
            .map_err(|e| invalid("quic", e))?;
        rules::quic_server_id_len(spec.quic_server_id_len.into())
            .map_err(|e| invalid("quic_server_id_len", e))?;
        rules::quic_config_rotation(spec.quic_config_rotation.into())
            .map_err(|e| invalid("quic_config_rotation", e))?;
        Self::check_overrides(spec, &self.tenants.list)
    }

    /// A VIP's tenant overrides against the tenant tables, as the configuration file checks
    /// them.
    fn check_overrides(spec: &VipSpec, tenants: &[TenantConfig]) -> Result<(), OpError> {
        for (j, o) in spec.tenants.iter().enumerate() {
            rules::tenant_override(o, tenants).map_err(|(key, e)| {
                OpError::Invalid(format!("VIP {:?}: tenant[{j}].{key}: {e}", spec.name))
            })?;
        }
        Ok(())
    }

    /// This state with the tenant tables `list` (checked already, as `TenantList` reads
    /// them): the VIPs' overrides must still name tenants; a tenant that stays keeps its id,
    /// a new one takes the lowest free id.
    pub fn with_tenants(&self, list: &[TenantConfig]) -> Result<State, OpError> {
        for v in self.vips.values() {
            Self::check_overrides(&v.spec, list)?;
        }
        let mut ids: BTreeMap<String, u32> = self
            .tenants
            .ids
            .iter()
            .filter(|(name, _)| list.iter().any(|t| &t.name == *name))
            .map(|(n, id)| (n.clone(), *id))
            .collect();
        for t in list {
            if t.name == rules::DEFAULT_TENANT || ids.contains_key(&t.name) {
                continue;
            }
            let id = (1..MAX_TENANTS)
                .find(|id| !ids.values().any(|used| used == id))
                .ok_or_else(|| {
                    OpError::Invalid(format!(
                        "tenant {:?}: all {} tenant ids are in use; allowed: at most {} named \
                         tenants",
                        t.name,
                        MAX_TENANTS - 1,
                        MAX_TENANTS - 1
                    ))
                })?;
            ids.insert(t.name.clone(), id);
        }
        let mut s = self.clone();
        s.tenants = Tenants {
            list: list.to_vec(),
            ids,
        };
        Ok(s)
    }

    /// A backend's QUIC-LB server ID on `vip`, as the configuration file checks it:
    /// required on a `quic = "cid"` VIP, refused elsewhere, unique within the VIP.
    fn check_quic_server_id(vip: &Vip, b: &BackendSpec) -> Result<(), OpError> {
        let invalid =
            |e: String| OpError::Invalid(format!("backend {}: quic_server_id: {e}", b.address));
        let len = vip.spec.quic_server_id_len;
        match (&b.quic_server_id, vip.spec.quic) {
            (None, QuicMode::Off) => Ok(()),
            (None, QuicMode::Cid) => Err(invalid(format!(
                "missing (required: VIP {:?} has quic = \"cid\"); allowed: {} hex digits \
                 (quic_server_id_len = {len} octets), not all zero, unique within the VIP",
                vip.spec.name,
                2 * len
            ))),
            (Some(s), QuicMode::Off) => Err(invalid(format!(
                "{} is set but VIP {:?} has quic = \"off\"; allowed: no server ID",
                rules::quoted(s),
                vip.spec.name
            ))),
            (Some(s), QuicMode::Cid) => {
                let v = rules::quic_server_id(s, len).map_err(invalid)?;
                if let Some(other) = vip.backends.values().find(|o| {
                    o.spec.address != b.address
                        && o.spec
                            .quic_server_id
                            .as_deref()
                            .and_then(rules::quic_server_id_value)
                            == Some(v)
                }) {
                    return Err(OpError::Conflict(format!(
                        "backend {}: quic_server_id {s:?} is already the server ID of backend \
                         {} of VIP {:?}; allowed: a server ID unique within the VIP",
                        b.address, other.spec.address, vip.spec.name
                    )));
                }
                Ok(())
            }
        }
    }

    fn check_backend(&self, vip: &Vip, b: &BackendSpec) -> Result<(), OpError> {
        if vip.backends.contains_key(&b.address) {
            return Err(OpError::Conflict(format!(
                "VIP {:?} already has backend {}",
                vip.spec.name, b.address
            )));
        }
        rules::backend_address(b.address, vip.spec.address)
            .and_then(|()| {
                let vips = self
                    .vips
                    .values()
                    .map(|v| (v.spec.name.as_str(), v.spec.address));
                rules::backend_not_a_vip(b.address, vips)
            })
            .map_err(|e| OpError::Invalid(format!("backend address {e}")))?;
        rules::labels(&b.labels)
            .map_err(|e| OpError::Invalid(format!("backend {}: {e}", b.address)))?;
        Self::check_weight(b.weight)?;
        Self::check_quic_server_id(vip, b)?;
        if vip.backends.len() + 1 > vip.spec.ring_size as usize {
            return Err(OpError::Invalid(format!(
                "VIP {:?} would have more backends than its {} ring slots",
                vip.spec.name, vip.spec.ring_size
            )));
        }
        Ok(())
    }

    fn check_weight(w: u32) -> Result<(), OpError> {
        rules::weight(w.into()).map_err(|e| OpError::Invalid(format!("weight: {e}")))
    }

    fn add_backend(&mut self, vip: &str, mut spec: BackendSpec) -> Result<(), OpError> {
        self.check_backend(self.vip(vip)?, &spec)?;
        if let Some(id) = &mut spec.quic_server_id {
            id.make_ascii_lowercase();
        }
        let id = self.alloc_backend_id()?;
        let v = self.vip_mut(vip)?;
        v.backends.insert(
            spec.address,
            Backend {
                id,
                spec,
                admin: Admin::Active,
                healthy: true,
            },
        );
        Ok(())
    }

    /// The state a start or a reload runs, decided from the configuration's VIPs and
    /// backends and the runtime state (`self`: the persisted state at a start, the running
    /// one at a reload). While the file is the one that state was built from (`same_file`),
    /// the runtime state is kept whole: backends added, weights set, drains and health
    /// survive until the file changes. A changed file gives its own VIPs, backends and
    /// tenants, with the ids, drains and health of those that stay ([`State::with_specs`],
    /// [`State::with_tenants`]).
    pub fn for_config(
        &self,
        same_file: bool,
        specs: &[(VipSpec, Vec<BackendSpec>)],
        tenants: &[TenantConfig],
        limits: &Limits,
    ) -> Result<State, OpError> {
        if same_file {
            Ok(self.clone())
        } else {
            self.with_specs(specs, limits)?.with_tenants(tenants)
        }
    }

    /// The state a changed configuration asks for: exactly these VIPs and backends, with
    /// the ids, drains and health of those that already exist kept, so connection entries
    /// stay valid and operator drains survive a reload.
    pub fn with_specs(
        &self,
        specs: &[(VipSpec, Vec<BackendSpec>)],
        limits: &Limits,
    ) -> Result<State, OpError> {
        // The tenants stay as they are: their overrides are checked with the tenants the
        // caller sets next ([`State::with_tenants`]).
        let mut s = State {
            vips: BTreeMap::new(),
            next_backend_id: self.next_backend_id,
            tenants: self.tenants.clone(),
        };
        // Keep ids of the VIPs that stay before handing out new ones.
        let kept = |spec: &VipSpec| {
            self.vips.get(&spec.name).filter(|v| {
                v.spec.address == spec.address
                    && v.spec.port == spec.port
                    && v.spec.protocol == spec.protocol
            })
        };
        for (spec, _) in specs {
            if let Some(old) = kept(spec) {
                s.vips.insert(
                    spec.name.clone(),
                    Vip {
                        id: old.id,
                        spec: spec.clone(),
                        backends: BTreeMap::new(),
                    },
                );
            }
        }
        for (spec, backends) in specs {
            if kept(spec).is_none() {
                s.check_vip(spec)?;
                let id = s.alloc_vip_id(limits)?;
                s.vips.insert(
                    spec.name.clone(),
                    Vip {
                        id,
                        spec: spec.clone(),
                        backends: BTreeMap::new(),
                    },
                );
            }
            let old = kept(spec);
            // Reserve the kept backend ids first so new ones never collide with them.
            for b in backends {
                if let Some(ob) = old.and_then(|o| o.backends.get(&b.address)) {
                    let v = s.vips.get_mut(&spec.name).expect("inserted above");
                    if v.backends.contains_key(&b.address) {
                        return Err(OpError::Conflict(format!(
                            "VIP {:?} lists backend {} twice",
                            spec.name, b.address
                        )));
                    }
                    v.backends.insert(
                        b.address,
                        Backend {
                            spec: b.clone(),
                            ..ob.clone()
                        },
                    );
                }
            }
        }
        for (spec, backends) in specs {
            let old = kept(spec);
            for b in backends {
                if old.and_then(|o| o.backends.get(&b.address)).is_none() {
                    s.add_backend(&spec.name, b.clone())?;
                }
            }
        }
        Ok(s)
    }

    /// Applies `op` to a copy: the new state, or why it was refused (nothing changed).
    pub fn apply(&self, op: &Op, now_ms: u64, limits: &Limits) -> Result<State, OpError> {
        let mut s = self.clone();
        match op {
            Op::AddVip { vip, backends } => {
                s.check_vip(vip)?;
                let id = s.alloc_vip_id(limits)?;
                s.vips.insert(
                    vip.name.clone(),
                    Vip {
                        id,
                        spec: vip.clone(),
                        backends: BTreeMap::new(),
                    },
                );
                for b in backends {
                    s.add_backend(&vip.name, b.clone())?;
                }
            }
            Op::RemoveVip { vip } => {
                s.vip(vip)?;
                s.vips.remove(vip);
            }
            Op::AddBackend { vip, backend } => s.add_backend(vip, backend.clone())?,
            Op::RemoveBackend { vip, address } => {
                s.backend(vip, *address)?;
                s.vip_mut(vip)?.backends.remove(address);
            }
            Op::SetWeight {
                vip,
                address,
                weight,
            } => {
                Self::check_weight(*weight)?;
                s.backend_mut(vip, *address)?.spec.weight = *weight;
            }
            Op::Drain {
                vip,
                address,
                deadline_ms,
            } => {
                if let Some(d) = deadline_ms {
                    if *d <= now_ms {
                        return Err(OpError::Invalid("the drain deadline is in the past".into()));
                    }
                }
                let b = s.backend_mut(vip, *address)?;
                if let Admin::Draining { .. } = b.admin {
                    return Err(OpError::Conflict(format!(
                        "backend {address} of {vip:?} is already draining"
                    )));
                }
                b.admin = Admin::Draining {
                    since_ms: now_ms,
                    deadline_ms: *deadline_ms,
                };
            }
            Op::Undrain { vip, address } => {
                let b = s.backend_mut(vip, *address)?;
                if b.admin == Admin::Active {
                    return Err(OpError::Conflict(format!(
                        "backend {address} of {vip:?} is not draining"
                    )));
                }
                b.admin = Admin::Active;
            }
            Op::SetHealth {
                vip,
                address,
                healthy,
            } => s.set_health(vip, *address, *healthy)?,
            Op::SetTenants(list) => s = s.with_tenants(&list.tenants)?,
        }
        Ok(s)
    }
}

/// The VIPs and backends a configuration asks for.
pub fn specs(cfg: &config::Config) -> Vec<(VipSpec, Vec<BackendSpec>)> {
    cfg.vips
        .iter()
        .map(|v| {
            let spec = VipSpec {
                name: v.name.clone(),
                address: v.address,
                port: v.port,
                protocol: v.protocol,
                hash: v.hash,
                affinity_secs: v.affinity_secs(),
                priority: v.priority.into(),
                ring_size: v.ring_size,
                flow_state: v.flow_state,
                inband: v.inband,
                quic: v.quic,
                quic_server_id_len: v.quic_server_id_len,
                quic_config_rotation: v.quic_config_rotation,
                tenants: v.tenants.clone(),
            };
            let backends = v
                .backends
                .iter()
                .map(|b| BackendSpec {
                    address: b.address,
                    weight: b.weight,
                    labels: b.labels.clone(),
                    max_sessions: b.max_sessions,
                    quic_server_id: b.quic_server_id.clone(),
                })
                .collect();
            (spec, backends)
        })
        .collect()
}

/// A key of the data plane's `QUIC_SERVERS` map: (VIP id, server ID as
/// `lb_common::quic::server_id_value` reads it).
pub type QuicServerKey = (u32, u64);

impl State {
    /// What `QUIC_SERVERS` holds for this state: the backend id of every server ID of a
    /// `quic = "cid"` VIP's backends, whatever their state (the data plane checks that
    /// itself, so a draining backend keeps its connections until it is removed).
    pub fn quic_servers(&self) -> BTreeMap<QuicServerKey, u32> {
        self.vips
            .values()
            .filter(|v| v.spec.quic == QuicMode::Cid)
            .flat_map(|v| {
                v.backends.values().filter_map(move |b| {
                    let id = b.spec.quic_server_id.as_deref()?;
                    Some(((v.id, rules::quic_server_id_value(id)?), b.id))
                })
            })
            .collect()
    }
}

impl State {
    /// What `TENANT_PREFIXES` holds for this state: each named tenant's prefixes and its id.
    pub fn tenant_prefixes(&self) -> BTreeMap<Cidr, u32> {
        self.tenants
            .list
            .iter()
            .filter_map(|t| Some((self.tenants.ids.get(&t.name).copied()?, t)))
            .flat_map(|(id, t)| t.prefixes.iter().map(move |p| (*p, id)))
            .collect()
    }

    /// What `TENANT_LIMITS` holds for this state, by index `vip_id * MAX_TENANTS + tenant`:
    /// each tenant's rate on each VIP, with `flags` (`TENANT_F_*` by the same index) laid
    /// over. Entries left out are all zero (no limit).
    pub fn tenant_limits(&self, flags: &BTreeMap<u32, u32>) -> BTreeMap<u32, TenantLimits> {
        if self.tenants.is_empty() {
            return BTreeMap::new();
        }
        let tenants = self.tenants.with_ids();
        let mut out = BTreeMap::new();
        for v in self.vips.values() {
            for (id, t) in &tenants {
                let index = lb_common::tenant_index(v.id, *id);
                let (interval_ns, burst_ns) = t.limits_on(&v.spec.tenants).gcra_ns();
                let l = TenantLimits {
                    interval_ns,
                    burst_ns,
                    flags: flags.get(&index).copied().unwrap_or(0),
                    _pad: 0,
                };
                if l != TenantLimits::default() {
                    out.insert(index, l);
                }
            }
        }
        out
    }
}

/// The map writes that take `QUIC_SERVERS` from `current` to `desired`.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct QuicServerChanges {
    /// Entries new or pointing at another backend.
    pub write: Vec<(QuicServerKey, u32)>,
    /// Entries no longer desired.
    pub delete: Vec<QuicServerKey>,
}

impl QuicServerChanges {
    pub fn is_empty(&self) -> bool {
        self.write.is_empty() && self.delete.is_empty()
    }
}

/// Reconciles `QUIC_SERVERS`: what `current` (what the map holds, a pinned map's leftovers
/// included) lacks or holds differently from `desired` is written, and what `desired` lacks
/// is deleted.
pub fn quic_server_changes(
    current: &BTreeMap<QuicServerKey, u32>,
    desired: &BTreeMap<QuicServerKey, u32>,
) -> QuicServerChanges {
    QuicServerChanges {
        write: desired
            .iter()
            .filter(|(k, v)| current.get(k) != Some(v))
            .map(|(k, v)| (*k, *v))
            .collect(),
        delete: current
            .keys()
            .filter(|k| !desired.contains_key(k))
            .copied()
            .collect(),
    }
}

/// Specs for tests, here and in the shells' crate (compiled always: a `cfg(test)` item is
/// invisible to another crate's tests).
#[doc(hidden)]
pub mod testing {
    use super::*;

    /// A TCP/443 five-tuple VIP.
    pub fn vip(name: &str, addr: &str) -> VipSpec {
        VipSpec {
            name: name.into(),
            address: addr.parse().unwrap(),
            port: 443,
            protocol: Protocol::Tcp,
            hash: HashMode::FiveTuple,
            affinity_secs: 0,
            priority: 0,
            ring_size: maglev::DEFAULT_RING_SIZE,
            flow_state: FlowState::Table,
            inband: false,
            quic: QuicMode::Off,
            quic_server_id_len: rules::QUIC_SERVER_ID_LEN_DEFAULT,
            quic_config_rotation: 0,
            tenants: Vec::new(),
        }
    }

    /// A backend of weight 100 without labels or session cap.
    pub fn be(addr: &str) -> BackendSpec {
        BackendSpec {
            address: addr.parse().unwrap(),
            weight: 100,
            labels: BTreeMap::new(),
            max_sessions: 0,
            quic_server_id: None,
        }
    }

    /// A UDP/443 VIP with QUIC connection-ID routing (2-octet server IDs, rotation 0).
    pub fn quic_vip(name: &str, addr: &str) -> VipSpec {
        VipSpec {
            protocol: Protocol::Udp,
            quic: QuicMode::Cid,
            ..vip(name, addr)
        }
    }

    /// [`be`] with a QUIC-LB server ID.
    pub fn quic_be(addr: &str, id: &str) -> BackendSpec {
        BackendSpec {
            quic_server_id: Some(id.into()),
            ..be(addr)
        }
    }
}

#[cfg(test)]
mod tests {
    use super::{
        testing::{be, quic_be, quic_vip, vip},
        *,
    };

    const L: Limits = Limits { max_vips: 4 };

    fn base() -> State {
        State::default()
            .apply(
                &Op::AddVip {
                    vip: vip("chat", "10.0.0.1"),
                    backends: vec![be("10.1.0.1"), be("10.1.0.2")],
                },
                0,
                &L,
            )
            .unwrap()
    }

    #[test]
    fn rejected_ops_leave_the_state_unchanged() {
        let s = base();
        let bad = [
            Op::AddVip {
                vip: vip("chat", "10.0.0.2"),
                backends: vec![],
            },
            Op::AddVip {
                vip: vip("other", "10.0.0.1"),
                backends: vec![],
            },
            Op::AddVip {
                vip: vip("Bad Name", "10.0.0.3"),
                backends: vec![],
            },
            // The second backend is invalid: the VIP must not be half-added.
            Op::AddVip {
                vip: vip("new", "10.0.0.9"),
                backends: vec![be("10.1.0.1"), be("10.1.0.1")],
            },
            Op::AddBackend {
                vip: "chat".into(),
                backend: be("10.1.0.1"),
            },
            Op::AddBackend {
                vip: "nope".into(),
                backend: be("10.1.0.9"),
            },
            Op::SetWeight {
                vip: "chat".into(),
                address: "10.1.0.1".parse().unwrap(),
                weight: 70000,
            },
            Op::RemoveBackend {
                vip: "chat".into(),
                address: "10.9.9.9".parse().unwrap(),
            },
            Op::Undrain {
                vip: "chat".into(),
                address: "10.1.0.1".parse().unwrap(),
            },
        ];
        for op in bad {
            assert!(s.apply(&op, 0, &L).is_err(), "{op:?} should be refused");
        }
        assert_eq!(s, base());
    }

    #[test]
    fn v4_backend_on_v6_vip_is_refused_with_reason() {
        let s = State::default()
            .apply(
                &Op::AddVip {
                    vip: vip("v6", "fd00::1"),
                    backends: vec![],
                },
                0,
                &L,
            )
            .unwrap();
        let e = s
            .apply(
                &Op::AddBackend {
                    vip: "v6".into(),
                    backend: be("10.1.0.1"),
                },
                0,
                &L,
            )
            .unwrap_err();
        assert_eq!(
            e.to_string(),
            "backend address \"10.1.0.1\" is IPv4 but the VIP fd00::1 is IPv6; allowed: an IPv6 \
             backend (IPv6 cannot be encapsulated in IPv4)"
        );
        assert_eq!(e.http_status(), 400);
    }

    #[test]
    fn backend_ids_are_not_reused_right_after_removal() {
        let s = base();
        let a: IpAddr = "10.1.0.2".parse().unwrap();
        let old = s.backend("chat", a).unwrap().id;
        let s = s
            .apply(
                &Op::RemoveBackend {
                    vip: "chat".into(),
                    address: a,
                },
                0,
                &L,
            )
            .unwrap();
        let s = s
            .apply(
                &Op::AddBackend {
                    vip: "chat".into(),
                    backend: be("10.1.0.3"),
                },
                0,
                &L,
            )
            .unwrap();
        assert_ne!(
            s.backend("chat", "10.1.0.3".parse().unwrap()).unwrap().id,
            old
        );
    }

    #[test]
    fn draining_backend_leaves_the_table_and_undrain_restores_it() {
        let s = base();
        let a: IpAddr = "10.1.0.1".parse().unwrap();
        let id = s.backend("chat", a).unwrap().id;
        let d = s
            .apply(
                &Op::Drain {
                    vip: "chat".into(),
                    address: a,
                    deadline_ms: Some(10),
                },
                1,
                &L,
            )
            .unwrap();
        assert_eq!(
            d.backend("chat", a).unwrap().plane_state(),
            PlaneState::Draining
        );
        assert!(!d
            .vip("chat")
            .unwrap()
            .table(1, |b| b.spec.weight)
            .unwrap()
            .contains(&id));
        assert!(d
            .apply(
                &Op::Drain {
                    vip: "chat".into(),
                    address: a,
                    deadline_ms: None
                },
                1,
                &L
            )
            .is_err());
        let u = d
            .apply(
                &Op::Undrain {
                    vip: "chat".into(),
                    address: a,
                },
                2,
                &L,
            )
            .unwrap();
        assert_eq!(u, s);
        let past = s.apply(
            &Op::Drain {
                vip: "chat".into(),
                address: a,
                deadline_ms: Some(5),
            },
            9,
            &L,
        );
        assert_eq!(
            past.unwrap_err().to_string(),
            "the drain deadline is in the past"
        );
    }

    #[test]
    fn vip_slots_are_limited() {
        let mut s = State::default();
        for i in 0..4 {
            s = s
                .apply(
                    &Op::AddVip {
                        vip: vip(&format!("v{i}"), &format!("10.0.0.{i}")),
                        backends: vec![],
                    },
                    0,
                    &L,
                )
                .unwrap();
        }
        let e = s
            .apply(
                &Op::AddVip {
                    vip: vip("v9", "10.0.0.9"),
                    backends: vec![],
                },
                0,
                &L,
            )
            .unwrap_err();
        assert_eq!(e.http_status(), 409);
    }

    #[test]
    fn reloading_specs_keeps_ids_and_drains_of_what_stays() {
        let s = base();
        let a: IpAddr = "10.1.0.1".parse().unwrap();
        let s = s
            .apply(
                &Op::Drain {
                    vip: "chat".into(),
                    address: a,
                    deadline_ms: None,
                },
                1,
                &L,
            )
            .unwrap();
        let specs = vec![
            (vip("new", "10.0.0.5"), vec![be("10.2.0.1")]),
            (
                vip("chat", "10.0.0.1"),
                vec![be("10.1.0.1"), be("10.1.0.3")],
            ),
        ];
        let r = s.with_specs(&specs, &L).unwrap();
        assert_eq!(r.vips["chat"].id, s.vips["chat"].id);
        let kept = &r.vips["chat"].backends[&a];
        assert_eq!(kept.id, s.vips["chat"].backends[&a].id);
        assert!(matches!(kept.admin, Admin::Draining { .. }));
        assert!(!r.vips["chat"]
            .backends
            .contains_key(&"10.1.0.2".parse::<IpAddr>().unwrap()));
        let ids: std::collections::BTreeSet<u32> = r
            .vips
            .values()
            .flat_map(|v| v.backends.values().map(|b| b.id))
            .collect();
        assert_eq!(ids.len(), 3, "ids stay unique");
        assert_ne!(r.vips["new"].id, r.vips["chat"].id);
        assert_eq!(
            r.with_specs(&specs, &L).unwrap(),
            r,
            "reloading the same specs changes nothing"
        );
    }

    #[test]
    fn an_unchanged_file_keeps_the_runtime_state_and_a_changed_one_keeps_ids_and_drains() {
        let (a, b, c): (IpAddr, IpAddr, IpAddr) = (
            "10.1.0.1".parse().unwrap(),
            "10.1.0.2".parse().unwrap(),
            "10.1.0.3".parse().unwrap(),
        );
        // The file's state, then runtime changes: a backend added, a weight set, a drain.
        let file = vec![(
            vip("chat", "10.0.0.1"),
            vec![be("10.1.0.1"), be("10.1.0.2")],
        )];
        let ops = [
            Op::AddBackend {
                vip: "chat".into(),
                backend: be("10.1.0.3"),
            },
            Op::SetWeight {
                vip: "chat".into(),
                address: a,
                weight: 7,
            },
            Op::Drain {
                vip: "chat".into(),
                address: b,
                deadline_ms: None,
            },
        ];
        let runtime = ops.iter().fold(base(), |s, op| s.apply(op, 1, &L).unwrap());
        assert_eq!(
            runtime.for_config(true, &file, &[], &L).unwrap(),
            runtime,
            "the file it was built from: every runtime change stays"
        );
        // A changed file (backend 10.1.0.2 removed from it, another VIP added).
        let changed = vec![
            (
                vip("chat", "10.0.0.1"),
                vec![be("10.1.0.1"), be("10.1.0.2")],
            ),
            (vip("new", "10.0.0.5"), vec![be("10.2.0.1")]),
        ];
        let r = runtime.for_config(false, &changed, &[], &L).unwrap();
        let chat = &r.vips["chat"];
        assert_eq!(chat.id, runtime.vips["chat"].id);
        assert!(!chat.backends.contains_key(&c), "the file's backends only");
        assert_eq!(chat.backends[&a].spec.weight, 100, "the file's weight");
        assert_eq!(chat.backends[&a].id, runtime.vips["chat"].backends[&a].id);
        assert!(matches!(chat.backends[&b].admin, Admin::Draining { .. }));
        assert!(r.vips.contains_key("new"));
        // The same decision whoever asks: what a restart runs after a reload is what the
        // reload ran.
        assert_eq!(r.for_config(true, &changed, &[], &L).unwrap(), r);
    }

    #[test]
    fn ops_round_trip_as_json() {
        let op = Op::Drain {
            vip: "chat".into(),
            address: "10.1.0.1".parse().unwrap(),
            deadline_ms: Some(5),
        };
        let j = serde_json::to_string(&op).unwrap();
        assert_eq!(
            j,
            r#"{"op":"drain","vip":"chat","address":"10.1.0.1","deadline_ms":5}"#
        );
        assert_eq!(serde_json::from_str::<Op>(&j).unwrap(), op);
    }

    fn quic_state() -> State {
        State::default()
            .apply(
                &Op::AddVip {
                    vip: quic_vip("chat-quic", "10.0.0.7"),
                    backends: vec![quic_be("10.1.0.1", "0A01"), quic_be("10.1.0.2", "0a02")],
                },
                0,
                &L,
            )
            .unwrap()
    }

    #[test]
    fn quic_settings_and_server_ids_are_checked_by_the_api_too() {
        let s = quic_state().apply(
            &Op::AddVip {
                vip: vip("chat", "10.0.0.1"),
                backends: vec![be("10.1.0.1")],
            },
            0,
            &L,
        );
        let s = s.unwrap();
        let b = &s.vips["chat-quic"].backends[&"10.1.0.1".parse().unwrap()];
        assert_eq!(b.spec.quic_server_id.as_deref(), Some("0a01"), "lowercase");
        let refused = |op: Op| s.apply(&op, 0, &L).unwrap_err().to_string();
        let add = |vip: &str, backend: BackendSpec| Op::AddBackend {
            vip: vip.into(),
            backend,
        };
        let e = refused(add("chat-quic", be("10.1.0.3")));
        assert!(
            e.starts_with("backend 10.1.0.3: quic_server_id: missing (required: VIP \"chat-quic\""),
            "{e}"
        );
        let e = refused(add("chat-quic", quic_be("10.1.0.3", "0a02")));
        assert!(
            e.contains("\"0a02\" is already the server ID of backend 10.1.0.2"),
            "{e}"
        );
        let e = refused(add("chat-quic", quic_be("10.1.0.3", "0A02")));
        assert!(e.contains("is already the server ID"), "case-blind: {e}");
        let e = refused(add("chat-quic", quic_be("10.1.0.3", "0000")));
        assert!(e.contains("\"0000\" is all zero"), "{e}");
        let e = refused(add("chat-quic", quic_be("10.1.0.3", "0a0102")));
        assert!(e.contains("is not 2 octets of hex"), "{e}");
        let e = refused(add("chat", quic_be("10.1.0.3", "0a03")));
        assert!(
            e.contains("is set but VIP \"chat\" has quic = \"off\""),
            "{e}"
        );
        let tcp = VipSpec {
            protocol: Protocol::Tcp,
            ..quic_vip("t", "10.0.0.8")
        };
        let e = refused(Op::AddVip {
            vip: tcp,
            backends: vec![],
        });
        assert!(
            e.starts_with("quic: \"cid\" needs protocol = \"udp\""),
            "{e}"
        );
        for (len, rot, want) in [
            (0, 0, "quic_server_id_len: 0 is out of range"),
            (9, 0, "quic_server_id_len: 9 is out of range"),
            (2, 7, "quic_config_rotation: 7 is QUIC-LB's reserved"),
        ] {
            let e = refused(Op::AddVip {
                vip: VipSpec {
                    quic_server_id_len: len,
                    quic_config_rotation: rot,
                    ..quic_vip("q2", "10.0.0.8")
                },
                backends: vec![],
            });
            assert!(e.starts_with(want), "{e}");
        }
        // A VIP whose second backend repeats the first one's server ID is not half-added.
        let e = refused(Op::AddVip {
            vip: quic_vip("q2", "10.0.0.8"),
            backends: vec![quic_be("10.1.0.5", "0001"), quic_be("10.1.0.6", "0001")],
        });
        assert!(e.contains("is already the server ID"), "{e}");
        // A good one is taken.
        let t = s.apply(&add("chat-quic", quic_be("10.1.0.3", "ff00")), 0, &L);
        assert!(t.is_ok());
        // The spec reads from the API's JSON with the file's defaults.
        let v: VipSpec = serde_json::from_str(
            r#"{"name":"q","address":"10.0.0.9","port":443,"protocol":"udp","quic":"cid"}"#,
        )
        .unwrap();
        assert_eq!(
            (v.quic, v.quic_server_id_len, v.quic_config_rotation),
            (QuicMode::Cid, 2, 0)
        );
        // Without QUIC the JSON is what it was before the QUIC keys existed.
        let plain = serde_json::to_value(vip("chat", "10.0.0.1")).unwrap();
        assert!(plain.get("quic").is_none(), "{plain}");
        assert!(plain.get("quic_server_id_len").is_none(), "{plain}");
        assert!(plain.get("quic_config_rotation").is_none(), "{plain}");
        let j = serde_json::to_value(VipSpec {
            quic_server_id_len: 3,
            quic_config_rotation: 1,
            ..quic_vip("q", "10.0.0.9")
        })
        .unwrap();
        assert_eq!(j["quic"], "cid");
        assert_eq!(j["quic_server_id_len"], 3);
        assert_eq!(j["quic_config_rotation"], 1);
        let plain = serde_json::to_value(be("10.1.0.1")).unwrap();
        assert!(plain.get("quic_server_id").is_none(), "{plain}");
        let b: BackendSpec =
            serde_json::from_str(r#"{"address":"10.1.0.9","quic_server_id":"0a09"}"#).unwrap();
        assert_eq!(b.quic_server_id.as_deref(), Some("0a09"));
    }

    #[test]
    fn quic_servers_name_every_backend_of_a_cid_vip_whatever_its_state() {
        let s = quic_state();
        let v = &s.vips["chat-quic"];
        let id = |a: &str| v.backends[&a.parse().unwrap()].id;
        let want = BTreeMap::from([
            ((v.id, 0x0a01), id("10.1.0.1")),
            ((v.id, 0x0a02), id("10.1.0.2")),
        ]);
        assert_eq!(s.quic_servers(), want);
        // Draining and down backends keep their IDs.
        let d = s
            .apply(
                &Op::Drain {
                    vip: "chat-quic".into(),
                    address: "10.1.0.1".parse().unwrap(),
                    deadline_ms: None,
                },
                0,
                &L,
            )
            .unwrap();
        let mut d = d;
        d.set_health("chat-quic", "10.1.0.2".parse().unwrap(), false)
            .unwrap();
        assert_eq!(d.quic_servers(), want);
        // Other VIPs have none.
        let plain = d
            .apply(
                &Op::AddVip {
                    vip: vip("chat", "10.0.0.1"),
                    backends: vec![be("10.1.0.3")],
                },
                0,
                &L,
            )
            .unwrap();
        assert_eq!(plain.quic_servers(), want);
        // From a configuration: the file's IDs, and a removed backend's ID is gone.
        let removed = plain
            .apply(
                &Op::RemoveBackend {
                    vip: "chat-quic".into(),
                    address: "10.1.0.1".parse().unwrap(),
                },
                0,
                &L,
            )
            .unwrap();
        assert_eq!(
            removed.quic_servers(),
            BTreeMap::from([((v.id, 0x0a02), id("10.1.0.2"))])
        );
    }

    #[test]
    fn quic_servers_of_a_configuration() {
        let text = r#"
[dataplane]
interfaces = [{ name = "eth0" }]
hash_seed = 1
encap_source_v4 = "172.16.0.0/16"

[[vip]]
name = "chat-quic"
address = "10.200.0.2"
port = 443
protocol = "udp"
quic = "cid"
quic_server_id_len = 3
quic_config_rotation = 1

[[vip.backend]]
address = "10.1.0.1"
quic_server_id = "0a0001"

[[vip.backend]]
address = "10.1.0.2"
quic_server_id = "FF0002"

[[vip]]
name = "dns"
address = "10.200.0.3"
port = 53
protocol = "udp"

[[vip.backend]]
address = "10.1.0.1"
"#;
        let cfg = config::parse(text, "t.toml").unwrap();
        let s = State::default().with_specs(&specs(&cfg), &L).unwrap();
        let q = &s.vips["chat-quic"];
        assert_eq!(q.spec.quic_server_id_len, 3);
        assert_eq!(q.spec.quic_config_rotation, 1);
        let id = |a: &str| q.backends[&a.parse().unwrap()].id;
        assert_eq!(
            s.quic_servers(),
            BTreeMap::from([
                ((q.id, 0x0a_0001), id("10.1.0.1")),
                ((q.id, 0xff_0002), id("10.1.0.2")),
            ])
        );
        // A reload that changes one ID and removes the other backend.
        let changed = text.replace("\"0a0001\"", "\"0a0009\"").replace(
            "[[vip.backend]]\naddress = \"10.1.0.2\"\nquic_server_id = \"FF0002\"\n",
            "",
        );
        let cfg2 = config::parse(&changed, "t.toml").unwrap();
        let s2 = s.with_specs(&specs(&cfg2), &L).unwrap();
        assert_eq!(
            s2.quic_servers(),
            BTreeMap::from([((q.id, 0x0a_0009), id("10.1.0.1"))])
        );
        let c = quic_server_changes(&s.quic_servers(), &s2.quic_servers());
        assert_eq!(c.write, vec![((q.id, 0x0a_0009), id("10.1.0.1"))]);
        assert_eq!(c.delete, vec![(q.id, 0x0a_0001), (q.id, 0xff_0002)]);
    }

    #[test]
    fn quic_server_changes_reconcile_added_removed_changed_and_stale() {
        let cur = BTreeMap::from([
            ((0, 1), 5),  // kept
            ((0, 2), 6),  // moves to backend 7
            ((0, 3), 8),  // removed
            ((9, 1), 40), // a previous run's leftover (pinned map)
        ]);
        let want = BTreeMap::from([((0, 1), 5), ((0, 2), 7), ((1, 4), 9)]);
        let c = quic_server_changes(&cur, &want);
        assert_eq!(c.write, vec![((0, 2), 7), ((1, 4), 9)]);
        assert_eq!(c.delete, vec![(0, 3), (9, 1)]);
        assert!(!c.is_empty());
        assert!(quic_server_changes(&want, &want).is_empty());
        let c = quic_server_changes(&BTreeMap::new(), &want);
        assert_eq!(c.write.len(), 3);
        assert!(c.delete.is_empty());
        let c = quic_server_changes(&want, &BTreeMap::new());
        assert_eq!(c.delete, vec![(0, 1), (0, 2), (1, 4)]);
    }

    fn tenant(name: &str, prefixes: &[&str]) -> TenantConfig {
        TenantConfig {
            name: name.into(),
            prefixes: prefixes.iter().map(|p| p.parse().unwrap()).collect(),
            weight: 1,
            max_sessions: 0,
            new_sessions_per_sec: 0,
            burst: 0,
        }
    }

    fn set_tenants(list: serde_json::Value) -> Result<Op, serde_json::Error> {
        let mut op = serde_json::json!({ "op": "set-tenants" });
        op["tenant"] = list;
        serde_json::from_value(op)
    }

    #[test]
    fn tenant_ids_are_kept_by_name_and_new_names_take_the_lowest_free_id() {
        let s = base()
            .with_tenants(&[tenant("a", &["10.0.1.0/24"]), tenant("b", &["10.0.2.0/24"])])
            .unwrap();
        assert_eq!(
            s.tenants.ids,
            BTreeMap::from([("a".into(), 1), ("b".into(), 2)])
        );
        // "a" goes, "c" comes: "b" keeps 2 and "c" takes the freed 1 (zeroed by the plane).
        let s = s
            .with_tenants(&[tenant("b", &["10.0.2.0/24"]), tenant("c", &["10.0.3.0/24"])])
            .unwrap();
        assert_eq!(
            s.tenants.ids,
            BTreeMap::from([("b".into(), 2), ("c".into(), 1)])
        );
        assert_eq!(s.tenants.id("default"), Some(0));
        assert_eq!(
            s.tenant_prefixes(),
            BTreeMap::from([
                ("10.0.2.0/24".parse().unwrap(), 2),
                ("10.0.3.0/24".parse().unwrap(), 1)
            ])
        );
    }

    #[test]
    fn tenant_limits_hold_each_vips_rate_and_the_controllers_flags() {
        let add_web = Op::AddVip {
            vip: vip("web", "10.0.0.2"),
            backends: vec![],
        };
        let mut s = base().apply(&add_web, 0, &L).unwrap();
        s.vips.get_mut("web").unwrap().spec.tenants = vec![TenantOverride {
            name: "a".into(),
            weight: None,
            max_sessions: None,
            new_sessions_per_sec: Some(10),
            burst: Some(5),
        }];
        let mut a = tenant("a", &["10.0.1.0/24"]);
        a.new_sessions_per_sec = 100;
        let s = s.with_tenants(&[a]).unwrap();
        let web = s.vips["web"].id;
        let idx = lb_common::tenant_index(web, 1);
        let flags = BTreeMap::from([(
            lb_common::tenant_index(web, 0),
            lb_common::TENANT_F_OVER_SHARE,
        )]);
        let l = s.tenant_limits(&flags);
        assert_eq!(l[&idx].interval_ns, 100_000_000);
        assert_eq!(l[&idx].burst_ns, 500_000_000);
        assert_eq!(
            l[&lb_common::tenant_index(web, 0)].flags,
            lb_common::TENANT_F_OVER_SHARE
        );
        assert_eq!(l[&lb_common::tenant_index(web, 0)].interval_ns, 0);
        // The other VIP: the tenant's own rate.
        let chat = s.vips["chat"].id;
        assert_eq!(l[&lb_common::tenant_index(chat, 1)].interval_ns, 10_000_000);
        // No tenants: nothing to write.
        assert!(base().tenant_limits(&flags).is_empty());
    }

    #[test]
    fn set_tenants_refuses_bad_tables_and_tenants_a_vip_still_overrides() {
        let mut s = base()
            .with_tenants(&[tenant("a", &["10.0.1.0/24"])])
            .unwrap();
        s.vips.get_mut("chat").unwrap().spec.tenants = vec![TenantOverride {
            name: "a".into(),
            weight: Some(2),
            max_sessions: None,
            new_sessions_per_sec: None,
            burst: None,
        }];
        let e = set_tenants(serde_json::json!([{"name": "b", "prefixes": ["10.0.1.1/24"]}]))
            .unwrap_err()
            .to_string();
        assert!(
            e.contains("tenant[0].prefixes[0]: \"10.0.1.1/24\" has bits set"),
            "{e}"
        );
        let op =
            set_tenants(serde_json::json!([{"name": "b", "prefixes": ["10.0.2.0/24"]}])).unwrap();
        let e = s.apply(&op, 0, &L).unwrap_err();
        assert_eq!(e.http_status(), 400);
        assert!(
            e.to_string()
                .starts_with("VIP \"chat\": tenant[0].name: \"a\" names no [[tenant]]"),
            "{e}"
        );
        let op = set_tenants(serde_json::json!([
            {"name": "a", "prefixes": ["10.0.1.0/24"]},
            {"name": "b", "prefixes": ["10.0.2.0/24"]}
        ]))
        .unwrap();
        let s2 = s.apply(&op, 0, &L).unwrap();
        assert_eq!(s2.tenants.ids["b"], 2);
        // The op reads back from its JSON (the audit log's record).
        let back: Op = serde_json::from_value(serde_json::to_value(&op).unwrap()).unwrap();
        assert_eq!(back, op);
    }
}
