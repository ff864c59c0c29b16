//! Writes a `State` into the data plane's maps, in an order the XDP program can read at any
//! moment: backends exist before a ring names them, each ring flips whole, and backends
//! leave only after no live ring names them.

use anyhow::{Context, Result};
use lb_common::{
    maps, BackendEntry, VipKey, VipMeta, BACKEND_ACTIVE, BACKEND_DOWN, BACKEND_DRAINING,
    BACKEND_F_CAPPED, BACKEND_F_FULL, BACKEND_F_GUE, BACKEND_F_NO_AFFINITY, VIP_F_ADMISSION,
    VIP_F_INBAND, VIP_F_SHED, VIP_F_SHED_RST, VIP_F_TENANTS,
};

use crate::{
    addr::to_words,
    controller::Overlay,
    dataplane::Dataplane,
    flowwalk::FlowWalker,
    state::{Backend, FlowState, PlaneState, QuicMode, State, Vip},
};

pub fn vip_key(v: &Vip) -> VipKey {
    crate::config::vip_key(v.spec.address, v.spec.port, v.spec.protocol)
}

fn plane_backend(vip: &Vip, b: &Backend, overlay: &Overlay) -> BackendEntry {
    let (addr, family) = to_words(b.spec.address);
    let state = match b.plane_state() {
        PlaneState::Active => BACKEND_ACTIVE,
        PlaneState::Draining => BACKEND_DRAINING,
        PlaneState::Down => BACKEND_DOWN,
    };
    BackendEntry {
        addr,
        family,
        state,
        flags: backend_flags(vip, b, overlay),
        _pad: 0,
        vip: vip.id,
    }
}

fn backend_flags(vip: &Vip, b: &Backend, overlay: &Overlay) -> u8 {
    let mut f = 0;
    if overlay.full.contains(&b.id) {
        f |= BACKEND_F_FULL;
    }
    if overlay.capped.contains(&b.id) {
        f |= BACKEND_F_FULL | BACKEND_F_CAPPED;
    }
    // A second-chance VIP's backends run the backend program: they are sent GUE, which
    // names the flow's previous backend.
    if vip.spec.flow_state == FlowState::SecondChance {
        f |= BACKEND_F_GUE;
    }
    // Weight 0 by the operator, or what the policy says breaks affinity (down, a fault, a
    // queue); its weight 0 for saturation keeps its clients' next turns (`BACKEND_F_FULL`
    // steers new clients away).
    if b.spec.weight == 0 || overlay.no_affinity.contains(&b.id) {
        f |= BACKEND_F_NO_AFFINITY;
    }
    f
}

/// A VIP's QUIC settings in its `VipMeta` (all zero unless `quic = "cid"`).
fn quic_meta(vip: &Vip) -> VipMeta {
    match vip.spec.quic {
        QuicMode::Cid => VipMeta {
            quic_rotation: vip.spec.quic_config_rotation,
            quic_server_id_len: vip.spec.quic_server_id_len,
            ..Default::default()
        },
        QuicMode::Off => VipMeta::default(),
    }
}

fn vip_flags(vip: &Vip, overlay: &Overlay, tenants: bool) -> u32 {
    let mut f =
        vip.spec.hash.vip_flags() | vip.spec.flow_state.vip_flags() | vip.spec.quic.vip_flags();
    if vip.spec.inband {
        f |= VIP_F_INBAND;
    }
    if tenants {
        f |= VIP_F_TENANTS;
    }
    if overlay.shed.contains(&vip.spec.name) {
        f |= VIP_F_SHED;
    }
    if overlay.admission.contains(&vip.spec.name) {
        f |= VIP_F_ADMISSION;
    }
    if overlay.rst {
        f |= VIP_F_SHED_RST;
    }
    f
}

/// What one apply wrote, for logs and tests.
#[derive(Debug, Default, Clone, PartialEq, Eq)]
pub struct Applied {
    pub ring_slots: usize,
    pub backends: usize,
    pub vips_removed: usize,
    /// `QUIC_SERVERS` entries written or deleted.
    pub quic_servers: usize,
    /// Tenant map entries written or deleted.
    pub tenant_entries: usize,
}

/// The tenant ids `new` assigns to a name `old` did not give them: their rate state and
/// counters start from zero.
fn fresh_tenant_ids(old: &State, new: &State) -> Vec<u32> {
    new.tenants
        .ids
        .iter()
        .filter(|(name, id)| old.tenants.ids.get(*name) != Some(id))
        .map(|(_, id)| *id)
        .collect()
}

/// Moves the data plane from `old` to `new`, with the adaptive `overlay` (weights, full
/// backends, shed VIPs).
pub fn apply(
    dp: &mut Dataplane,
    old: &State,
    new: &State,
    seed: u32,
    overlay: &Overlay,
) -> Result<Applied> {
    let mut done = Applied::default();
    let wildcard = |s: &State| s.vips.values().any(|v| v.spec.port == 0);
    // On before an all-ports VIP appears, off only after the last one is gone.
    if wildcard(new) {
        dp.set_wildcard_vips(true)?;
    }
    // Before the VIPs are flagged to look tenants up.
    done.tenant_entries = dp
        .sync_tenants(
            &new.tenant_prefixes(),
            &new.tenant_limits(&overlay.tenant_flags),
            &fresh_tenant_ids(old, new),
        )
        .context("writing the tenants")?;
    let tenants = !new.tenants.is_empty();
    for vip in new.vips.values() {
        for b in vip.backends.values() {
            dp.set_backend(b.id, &plane_backend(vip, b, overlay))?;
            done.backends += 1;
        }
        let table = vip
            .table(seed, |b| overlay.weight(b))
            .with_context(|| format!("building the Maglev table of VIP {:?}", vip.spec.name))?;
        let meta = VipMeta {
            id: vip.id,
            flags: vip_flags(vip, overlay, tenants),
            ring_size: vip.spec.ring_size,
            active_ring: 0,
            affinity_secs: vip.spec.affinity_secs,
            ..quic_meta(vip)
        };
        done.ring_slots += dp
            .publish(&vip_key(vip), meta, &table)
            .with_context(|| format!("publishing the table of VIP {:?}", vip.spec.name))?;
    }
    // After every backend it names is written, and before a removed backend is let go: an
    // entry never names a backend id the data plane does not hold for it.
    done.quic_servers = dp
        .sync_quic_servers(&new.quic_servers())
        .context("writing the QUIC server IDs")?;
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
                let mut gone = plane_backend(vip, b, overlay);
                gone.state = BACKEND_DOWN;
                dp.set_backend(b.id, &gone)?;
            }
        }
    }
    if !wildcard(new) {
        dp.set_wildcard_vips(false)?;
    }
    Ok(done)
}

/// The controller's plane: the real maps.
pub struct MapPlane {
    pub dp: Dataplane,
    pub seed: u32,
    /// Counts the connection table in the background (reads take its latest count).
    walker: FlowWalker,
    /// Connection-table entries found by the latest walk (active or not), for the fill level.
    pub conn_entries: u64,
    /// When the latest count used was taken, and its walk's duration.
    counted: crate::controller::FlowCount,
}

impl MapPlane {
    /// Starts the flow walker on the connection table (one walk before returning).
    pub fn new(mut dp: Dataplane, seed: u32, idle: std::time::Duration) -> Result<Self> {
        let walker = FlowWalker::start(dp.conns_fd()?, idle)?;
        Ok(MapPlane {
            dp,
            seed,
            walker,
            conn_entries: 0,
            counted: Default::default(),
        })
    }
}

impl crate::controller::Plane for MapPlane {
    fn apply(&mut self, old: &State, new: &State, overlay: &Overlay) -> Result<()> {
        let done = apply(&mut self.dp, old, new, self.seed, overlay)?;
        if old.tenants.list != new.tenants.list || old.tenants.ids != new.tenants.ids {
            self.walker.set_tenants(&new.tenant_prefixes());
        }
        tracing::debug!(?done, "data plane updated");
        Ok(())
    }

    fn tenant_flows(
        &mut self,
        idle: std::time::Duration,
    ) -> Result<std::collections::BTreeMap<(u32, u32), u64>> {
        Ok(self.walker.latest(idle)?.tenants)
    }

    fn tenant_stats(
        &mut self,
        indexes: &[u32],
    ) -> Result<std::collections::BTreeMap<u32, lb_common::TenantStats>> {
        indexes
            .iter()
            .map(|&i| Ok((i, self.dp.tenant_stats(i)?)))
            .collect()
    }

    fn active_flows(
        &mut self,
        idle: std::time::Duration,
    ) -> Result<std::collections::BTreeMap<u32, u64>> {
        let c = self.walker.latest(idle)?;
        self.conn_entries = c.entries;
        self.counted = crate::controller::FlowCount {
            taken_ms: c.taken_ms,
            walk: c.walk,
        };
        Ok(c.active)
    }

    fn flows_counted(&self) -> Option<crate::controller::FlowCount> {
        Some(self.counted)
    }

    fn set_trace(&mut self, on: bool) -> Result<()> {
        self.dp.set_trace(on)
    }

    fn flow_entries(
        &mut self,
        f: &mut dyn FnMut(crate::controller::FlowEntry) -> bool,
    ) -> Result<()> {
        let fd = self.dp.conns_fd()?;
        let now = crate::clock::monotonic_ns();
        crate::flowwalk::walk(std::os::fd::AsFd::as_fd(&fd), |k, e| {
            f(crate::controller::FlowEntry {
                key: *k,
                backend: e.backend,
                idle: std::time::Duration::from_nanos(now.saturating_sub(e.last_seen_ns)),
            })
        })
    }

    fn inband(
        &mut self,
        ids: &[u32],
    ) -> Result<std::collections::BTreeMap<u32, lb_common::InbandStats>> {
        ids.iter()
            .map(|&id| Ok((id, self.dp.inband_stats(id)?)))
            .collect()
    }

    fn backend_traffic(
        &mut self,
        ids: &[u32],
    ) -> Result<std::collections::BTreeMap<u32, crate::controller::Traffic>> {
        ids.iter()
            .map(|&id| Ok((id, self.dp.backend_stats(id)?.into())))
            .collect()
    }

    fn counters(&mut self, state: &State) -> Result<crate::controller::Counters> {
        let global = self.dp.stats()?;
        let mut c = crate::controller::Counters::default();
        for (i, v) in global.into_iter().enumerate() {
            c.global.insert(lb_common::stat::NAMES[i].to_string(), v);
        }
        c.maps.insert(
            "conns".into(),
            (self.conn_entries, self.dp.capacity(maps::CONNS)?.into()),
        );
        c.maps.insert(
            "vips".into(),
            (
                state.vips.len() as u64,
                self.dp.capacity(maps::VIPS)?.into(),
            ),
        );
        c.maps.insert(
            "quic_servers".into(),
            (
                state.quic_servers().len() as u64,
                self.dp.capacity(maps::QUIC_SERVERS)?.into(),
            ),
        );
        c.maps.insert(
            "tenant_prefixes".into(),
            (
                state.tenant_prefixes().len() as u64,
                self.dp.capacity(maps::TENANT_PREFIXES)?.into(),
            ),
        );
        let backends = state.vips.values().map(|v| v.backends.len() as u64).sum();
        c.maps.insert(
            "backends".into(),
            (backends, u64::from(lb_common::MAX_BACKENDS - 1)),
        );
        for vip in state.vips.values() {
            c.vips.insert(vip.id, self.dp.vip_stats(vip.id)?.into());
            for b in vip.backends.values() {
                c.backends.insert(b.id, self.dp.backend_stats(b.id)?.into());
            }
        }
        Ok(c)
    }
}

#[cfg(test)]
mod tests {
    use lb_common::VIP_F_SECOND_CHANCE;

    use super::*;

    #[test]
    fn rst_mode_marks_every_vip_so_full_pools_answer_with_rst_too() {
        let vip = Vip {
            id: 0,
            spec: crate::state::testing::vip("chat", "10.0.0.1"),
            backends: Default::default(),
        };
        let mut o = Overlay::default();
        assert_eq!(vip_flags(&vip, &o, false), 0);
        // Not shed by priority, but its SYNs refused by full backends get a RST.
        o.rst = true;
        assert_eq!(vip_flags(&vip, &o, false), VIP_F_SHED_RST);
        o.shed.insert("chat".into());
        assert_eq!(vip_flags(&vip, &o, false), VIP_F_SHED | VIP_F_SHED_RST);
        o.rst = false;
        assert_eq!(vip_flags(&vip, &o, false), VIP_F_SHED);
        o.admission.insert("chat".into());
        assert_eq!(vip_flags(&vip, &o, false), VIP_F_SHED | VIP_F_ADMISSION);
    }

    #[test]
    fn vips_look_tenants_up_while_tenants_are_configured() {
        let vip = Vip {
            id: 0,
            spec: crate::state::testing::vip("chat", "10.0.0.1"),
            backends: Default::default(),
        };
        let o = Overlay::default();
        assert_eq!(vip_flags(&vip, &o, true), VIP_F_TENANTS);
    }

    #[test]
    fn a_tenant_id_given_to_another_name_starts_from_zero() {
        let t = |name: &str, p: &str| crate::config::TenantConfig {
            prefixes: vec![p.parse().unwrap()],
            ..crate::config::TenantConfig {
                name: name.into(),
                ..crate::config::TenantConfig::unlimited_default()
            }
        };
        let a = State::default()
            .with_tenants(&[t("a", "10.0.1.0/24"), t("b", "10.0.2.0/24")])
            .unwrap();
        assert_eq!(fresh_tenant_ids(&State::default(), &a), vec![1, 2]);
        assert!(fresh_tenant_ids(&a, &a).is_empty());
        // "a" leaves and "c" takes its id 1; "b" keeps 2 and its counters.
        let c = a
            .with_tenants(&[t("b", "10.0.2.0/24"), t("c", "10.0.3.0/24")])
            .unwrap();
        assert_eq!(fresh_tenant_ids(&a, &c), vec![1]);
    }

    #[test]
    fn second_chance_vip_is_flagged_and_its_backends_are_sent_gue() {
        let mut vip = Vip {
            id: 0,
            spec: crate::state::testing::vip("chat", "10.0.0.1"),
            backends: Default::default(),
        };
        let b = Backend {
            id: 3,
            spec: crate::state::BackendSpec {
                address: "10.1.0.3".parse().unwrap(),
                weight: 1,
                labels: Default::default(),
                max_sessions: 0,
                quic_server_id: None,
            },
            admin: crate::state::Admin::Active,
            healthy: true,
        };
        let mut o = Overlay::default();
        assert_eq!(vip_flags(&vip, &o, false), 0);
        assert_eq!(backend_flags(&vip, &b, &o), 0, "table mode keeps IPIP");
        vip.spec.flow_state = FlowState::SecondChance;
        assert_eq!(vip_flags(&vip, &o, false), VIP_F_SECOND_CHANCE);
        assert_eq!(backend_flags(&vip, &b, &o), BACKEND_F_GUE);
        o.full.insert(3);
        assert_eq!(backend_flags(&vip, &b, &o), BACKEND_F_GUE | BACKEND_F_FULL);
        // Moved away (weight 0, or reduced): its clients' affinity entries must not bring
        // new sessions.
        o.no_affinity.insert(3);
        assert_eq!(
            backend_flags(&vip, &b, &o),
            BACKEND_F_GUE | BACKEND_F_FULL | BACKEND_F_NO_AFFINITY
        );
        o.no_affinity.clear();
        // The policy's weight 0 without a fault (a saturation move): its clients' next turns
        // still find it; the operator's weight 0 sends them where the ring says.
        o.weights.insert(3, 0);
        assert_eq!(backend_flags(&vip, &b, &o), BACKEND_F_GUE | BACKEND_F_FULL);
        let mut off = b.clone();
        off.spec.weight = 0;
        assert_eq!(
            backend_flags(&vip, &off, &o),
            BACKEND_F_GUE | BACKEND_F_FULL | BACKEND_F_NO_AFFINITY
        );
        // At the operator's cap: full, and capped (affinity yields to the cap).
        o.capped.insert(3);
        assert_eq!(
            backend_flags(&vip, &b, &o),
            BACKEND_F_GUE | BACKEND_F_FULL | BACKEND_F_CAPPED
        );
        o.full.clear();
        assert_eq!(
            backend_flags(&vip, &b, &o),
            BACKEND_F_GUE | BACKEND_F_FULL | BACKEND_F_CAPPED,
            "capped implies full"
        );
        o.capped.clear();
        vip.spec.flow_state = FlowState::Table;
        vip.spec.inband = true;
        assert_eq!(vip_flags(&vip, &o, false), VIP_F_INBAND);
    }

    #[test]
    fn a_cid_vip_is_flagged_with_its_rotation_and_server_id_length() {
        let mut vip = Vip {
            id: 0,
            spec: crate::state::testing::quic_vip("chat-quic", "10.0.0.1"),
            backends: Default::default(),
        };
        vip.spec.quic_server_id_len = 3;
        vip.spec.quic_config_rotation = 5;
        let o = Overlay::default();
        assert_eq!(vip_flags(&vip, &o, false), lb_common::VIP_F_QUIC_CID);
        let m = quic_meta(&vip);
        assert_eq!((m.quic_rotation, m.quic_server_id_len), (5, 3));
        vip.spec.quic = QuicMode::Off;
        assert_eq!(vip_flags(&vip, &o, false), 0);
        assert_eq!(quic_meta(&vip), VipMeta::default());
    }
}
