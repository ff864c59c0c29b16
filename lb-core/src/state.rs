//! The desired steering state and the operations that change it.
//!
//! Pure: no maps, no clock. Every operation validates against a copy and returns the new
//! state, so a rejected request changes nothing and an accepted one is applied whole.

use std::{collections::BTreeMap, net::IpAddr, time::Duration};

use lb_common::MAX_BACKENDS;
use serde::{Deserialize, Serialize};

use crate::{
    config::{self, rules},
    maglev,
};

// One model of a VIP's keywords: the configuration file's, with its spellings and words.
pub use crate::config::{FlowState, HashMode, Protocol};

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
        Ok(())
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

    fn add_backend(&mut self, vip: &str, spec: BackendSpec) -> Result<(), OpError> {
        self.check_backend(self.vip(vip)?, &spec)?;
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
    /// survive until the file changes. A changed file gives its own VIPs and backends, with
    /// the ids, drains and health of those that stay ([`State::with_specs`]).
    pub fn for_config(
        &self,
        same_file: bool,
        specs: &[(VipSpec, Vec<BackendSpec>)],
        limits: &Limits,
    ) -> Result<State, OpError> {
        if same_file {
            Ok(self.clone())
        } else {
            self.with_specs(specs, limits)
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
        let mut s = State {
            vips: BTreeMap::new(),
            next_backend_id: self.next_backend_id,
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
            };
            let backends = v
                .backends
                .iter()
                .map(|b| BackendSpec {
                    address: b.address,
                    weight: b.weight,
                    labels: b.labels.clone(),
                    max_sessions: b.max_sessions,
                })
                .collect();
            (spec, backends)
        })
        .collect()
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
        }
    }

    /// A backend of weight 100 without labels or session cap.
    pub fn be(addr: &str) -> BackendSpec {
        BackendSpec {
            address: addr.parse().unwrap(),
            weight: 100,
            labels: BTreeMap::new(),
            max_sessions: 0,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::{
        testing::{be, vip},
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
            runtime.for_config(true, &file, &L).unwrap(),
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
        let r = runtime.for_config(false, &changed, &L).unwrap();
        let chat = &r.vips["chat"];
        assert_eq!(chat.id, runtime.vips["chat"].id);
        assert!(!chat.backends.contains_key(&c), "the file's backends only");
        assert_eq!(chat.backends[&a].spec.weight, 100, "the file's weight");
        assert_eq!(chat.backends[&a].id, runtime.vips["chat"].backends[&a].id);
        assert!(matches!(chat.backends[&b].admin, Admin::Draining { .. }));
        assert!(r.vips.contains_key("new"));
        // The same decision whoever asks: what a restart runs after a reload is what the
        // reload ran.
        assert_eq!(r.for_config(true, &changed, &L).unwrap(), r);
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
}
