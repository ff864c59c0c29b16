//! Writes a `State` into the data plane's maps, in an order the XDP program can read at any
//! moment: backends exist before a ring names them, each ring flips whole, and backends
//! leave only after no live ring names them.

use anyhow::{Context, Result};
use lb_common::{
    Backend as PlaneBackend, VipKey, VipMeta, BACKEND_ACTIVE, BACKEND_DOWN, BACKEND_DRAINING,
    VIP_F_SRC_HASH,
};

use crate::{
    addr::to_words,
    dataplane::Dataplane,
    state::{Backend, HashMode, PlaneState, State, Vip},
};

pub fn vip_key(v: &Vip) -> VipKey {
    let (addr, family) = to_words(v.spec.address);
    VipKey {
        addr,
        port: v.spec.port.to_be(),
        proto: v.spec.protocol.number(),
        family,
    }
}

fn plane_backend(vip: &Vip, b: &Backend) -> PlaneBackend {
    let (addr, family) = to_words(b.spec.address);
    let state = match b.plane_state() {
        PlaneState::Active => BACKEND_ACTIVE,
        PlaneState::Draining => BACKEND_DRAINING,
        PlaneState::Down => BACKEND_DOWN,
    };
    PlaneBackend {
        addr,
        family,
        state,
        flags: 0,
        _pad: 0,
        vip: vip.id,
    }
}

/// What one apply wrote, for logs and tests.
#[derive(Debug, Default, Clone, PartialEq, Eq)]
pub struct Applied {
    pub ring_slots: usize,
    pub backends: usize,
    pub vips_removed: usize,
}

/// Moves the data plane from `old` to `new`. `weight_of` gives each active backend's Maglev
/// weight (the configured weight, or the adaptive policy's).
pub fn apply(
    dp: &mut Dataplane,
    old: &State,
    new: &State,
    seed: u32,
    weight_of: &dyn Fn(&Vip, &Backend) -> u32,
) -> Result<Applied> {
    let mut done = Applied::default();
    for vip in new.vips.values() {
        for b in vip.backends.values() {
            dp.set_backend(b.id, &plane_backend(vip, b))?;
            done.backends += 1;
        }
        let table = vip
            .table(seed, |b| weight_of(vip, b))
            .with_context(|| format!("building the Maglev table of VIP {:?}", vip.spec.name))?;
        let meta = VipMeta {
            id: vip.id,
            flags: if vip.spec.hash == HashMode::Source {
                VIP_F_SRC_HASH
            } else {
                0
            },
            ring_size: vip.spec.ring_size,
            active_ring: 0,
            affinity_secs: vip.spec.affinity_secs,
            priority: vip.spec.priority,
        };
        done.ring_slots += dp
            .publish(&vip_key(vip), meta, &table)
            .with_context(|| format!("publishing the table of VIP {:?}", vip.spec.name))?;
    }
    for vip in old.vips.values() {
        let now = new.vips.get(&vip.spec.name);
        if now
            .map(|n| n.id != vip.id || vip_key(n) != vip_key(vip))
            .unwrap_or(true)
        {
            dp.remove_vip(&vip_key(vip))?;
            done.vips_removed += 1;
        }
        for b in vip.backends.values() {
            let kept = now
                .and_then(|n| n.backends.get(&b.spec.address))
                .is_some_and(|n| n.id == b.id);
            if !kept {
                // Its flows re-steer to the table's choice on their next packet.
                let mut gone = plane_backend(vip, b);
                gone.state = BACKEND_DOWN;
                dp.set_backend(b.id, &gone)?;
            }
        }
    }
    Ok(done)
}
