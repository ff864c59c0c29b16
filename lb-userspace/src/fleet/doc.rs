//! What the fleet keeps in etcd, and the ring digest that shows two hosts hold the same
//! tables.
//!
//! Keys under the prefix:
//! - `tables`: the one versioned table set ([`Tables`]): VIPs, backends, drains, weights and
//!   the steering leader's overlay. Every change, an operator's or the leader's, is a
//!   compare-and-put of version + 1, so the versions form one sequence and every host that
//!   applied version N holds the same Maglev tables.
//! - `leader`: the steering leader's host name, attached to its lease.
//! - `hosts/<host>`: each host's report ([`HostReport`]), attached to its lease.

use std::collections::BTreeMap;

use serde::{Deserialize, Serialize};

use crate::{controller::Overlay, state::State};

#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct Tables {
    pub version: u64,
    /// The fleet's VIPs and backends; `healthy` is always true here: health is each
    /// host's own verdict, laid over when a host applies the set.
    pub state: State,
    /// The steering leader's latest decision.
    pub overlay: Overlay,
    /// Who published this version and why (an admin request, a steering decision).
    pub by: String,
    pub reason: String,
}

/// What each host tells the leader, refreshed every steering interval.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct HostReport {
    /// The table-set version this host applied.
    pub version: u64,
    /// Active flows per backend id on this host.
    pub flows: BTreeMap<u32, u64>,
    /// When the flows were counted (unix ms).
    pub taken_ms: u64,
}

pub struct Keys {
    pub tables: String,
    pub leader: String,
    pub hosts: String,
    pub prefix: String,
}

impl Keys {
    pub fn new(prefix: &str) -> Keys {
        Keys {
            tables: format!("{prefix}/tables"),
            leader: format!("{prefix}/leader"),
            hosts: format!("{prefix}/hosts/"),
            prefix: format!("{prefix}/"),
        }
    }

    pub fn host(&self, host: &str) -> String {
        format!("{}{host}", self.hosts)
    }
}

/// 64-bit FNV-1a of each VIP's ring, slot by slot, by backend address (not id), so hosts
/// compare what they steer to. Empty for a VIP whose table cannot be built.
pub fn ring_digests(state: &State, overlay: &Overlay, seed: u32) -> BTreeMap<String, String> {
    state
        .vips
        .values()
        .filter_map(|v| {
            let ring = v.table(seed, |b| overlay.weight(b)).ok()?;
            let addr: BTreeMap<u32, String> = v
                .backends
                .values()
                .map(|b| (b.id, b.spec.address.to_string()))
                .collect();
            let mut h: u64 = 0xcbf2_9ce4_8422_2325;
            for id in ring {
                let a = addr.get(&id).map_or("", String::as_str);
                for b in a.bytes().chain([b';']) {
                    h = (h ^ u64::from(b)).wrapping_mul(0x0000_0100_0000_01b3);
                }
            }
            Some((v.spec.name.clone(), format!("{h:016x}")))
        })
        .collect()
}
