//! Loading the eBPF object and typed access to its maps (the map writer).
//!
//! Everything that touches a map goes through here, so the rest of the library deals in
//! plain Rust values.

use std::collections::HashMap as StdHashMap;

use anyhow::{anyhow, bail, Context, Result};
use aya::{
    maps::{Array, DevMapHash, HashMap, MapData, PerCpuArray},
    programs::{Xdp, XdpMode},
    Ebpf, EbpfLoader,
};
use lb_common::{
    stat, Backend, ConnEntry, FlowKey, LbConfig, TrafficStats, VipKey, VipMeta,
    AFFINITY_TABLE_SIZE, CONN_TABLE_SIZE, MAX_VIPS, RINGS_PER_VIP, RING_SIZE_MAX,
};

use crate::maglev;

/// Program names in the object.
pub const PROG_XDP: &str = "sluice_xdp";
pub const PROG_DECAP: &str = "sluice_decap";
pub const PROG_PASS: &str = "sluice_pass";

/// Map capacities chosen at load time.
#[derive(Clone, Debug)]
pub struct LoadOptions {
    pub conn_table_size: u32,
    pub affinity_table_size: u32,
    /// VIPs the ring array has room for (each costs 2 × 65537 × 4 bytes of kernel memory).
    pub max_vips: u32,
}

impl Default for LoadOptions {
    fn default() -> Self {
        Self {
            conn_table_size: CONN_TABLE_SIZE,
            affinity_table_size: AFFINITY_TABLE_SIZE,
            max_vips: MAX_VIPS,
        }
    }
}

impl LoadOptions {
    /// For hosts that only decapsulate: the steering maps shrink to a token size.
    pub fn decap_only() -> Self {
        Self {
            conn_table_size: 1,
            affinity_table_size: 1,
            max_vips: 1,
        }
    }
}

/// What the data plane holds in each of a VIP's two rings, so a new table is written as
/// the slots that differ from the inactive ring before the flip.
struct RingShadow {
    rings: [Vec<u32>; 2],
}

pub struct Dataplane {
    ebpf: Ebpf,
    max_vips: u32,
    /// The maps were pinned by an earlier run and reused.
    reused: bool,
    shadows: StdHashMap<u32, RingShadow>,
}

/// Sum of a per-CPU value over all CPUs.
fn sum_u64(v: &aya::maps::PerCpuValues<u64>) -> u64 {
    v.iter().sum()
}

impl Dataplane {
    /// Loads (verifies) every program of `object`; nothing is attached yet.
    pub fn load(object: &[u8], opts: &LoadOptions) -> Result<Self> {
        if opts.max_vips == 0 || opts.max_vips > MAX_VIPS {
            bail!(
                "max_vips must be between 1 and {MAX_VIPS}, got {}",
                opts.max_vips
            );
        }
        let mut ebpf = EbpfLoader::new()
            .map_max_entries("CONNS", opts.conn_table_size)
            .map_max_entries("AFFINITY", opts.affinity_table_size)
            .map_max_entries(
                "MAGLEV_RINGS",
                opts.max_vips * RINGS_PER_VIP * RING_SIZE_MAX,
            )
            .load(object)
            .context("loading the eBPF object (are you root, with bpffs and BPF enabled?)")?;
        for name in [PROG_XDP, PROG_DECAP, PROG_PASS] {
            let prog: &mut Xdp = ebpf
                .program_mut(name)
                .ok_or_else(|| anyhow!("program {name} missing from the eBPF object"))?
                .try_into()?;
            prog.load()
                .with_context(|| format!("verifier rejected {name}"))?;
        }
        Ok(Self {
            ebpf,
            max_vips: opts.max_vips,
            reused: false,
            shadows: StdHashMap::new(),
        })
    }

    pub fn program(&mut self, name: &str) -> Result<&mut Xdp> {
        Ok(self
            .ebpf
            .program_mut(name)
            .ok_or_else(|| anyhow!("program {name} missing from the eBPF object"))?
            .try_into()?)
    }

    /// Attaches `prog` to the interface with this index (in the caller's network namespace).
    pub fn attach(&mut self, prog: &str, ifindex: u32, mode: XdpMode) -> Result<()> {
        self.program(prog)?
            .attach_to_if_index(ifindex, mode)
            .with_context(|| format!("attaching {prog} to ifindex {ifindex} in {mode:?} mode"))?;
        Ok(())
    }

    fn map(&mut self, name: &str) -> Result<&mut aya::maps::Map> {
        self.ebpf
            .map_mut(name)
            .ok_or_else(|| anyhow!("map {name} missing from the eBPF object"))
    }

    pub fn set_config(&mut self, cfg: &LbConfig) -> Result<()> {
        let mut a: Array<&mut MapData, LbConfig> = Array::try_from(self.map("CONFIG")?)?;
        a.set(0, cfg, 0).context("writing CONFIG")?;
        Ok(())
    }

    /// Adds an egress interface for XDP_REDIRECT.
    pub fn add_tx_port(&mut self, ifindex: u32) -> Result<()> {
        let mut m: DevMapHash<&mut MapData> = DevMapHash::try_from(self.map("TX_PORTS")?)?;
        m.insert(ifindex, ifindex, None, 0)
            .with_context(|| format!("adding tx port {ifindex}"))?;
        Ok(())
    }

    pub fn set_backend(&mut self, id: u32, b: &Backend) -> Result<()> {
        let mut a: Array<&mut MapData, Backend> = Array::try_from(self.map("BACKENDS")?)?;
        a.set(id, b, 0)
            .with_context(|| format!("writing backend {id}"))?;
        Ok(())
    }

    pub fn backend(&mut self, id: u32) -> Result<Backend> {
        let a: Array<&mut MapData, Backend> = Array::try_from(self.map("BACKENDS")?)?;
        Ok(a.get(&id, 0)?)
    }

    pub fn set_vip(&mut self, key: &VipKey, meta: &VipMeta) -> Result<()> {
        if meta.id >= self.max_vips {
            bail!(
                "VIP id {} is beyond the {} VIPs this data plane was loaded for",
                meta.id,
                self.max_vips
            );
        }
        let mut m: HashMap<&mut MapData, VipKey, VipMeta> = HashMap::try_from(self.map("VIPS")?)?;
        m.insert(key, meta, 0).context("writing VIPS")?;
        Ok(())
    }

    pub fn vip(&mut self, key: &VipKey) -> Result<Option<VipMeta>> {
        let m: HashMap<&mut MapData, VipKey, VipMeta> = HashMap::try_from(self.map("VIPS")?)?;
        match m.get(key, 0) {
            Ok(v) => Ok(Some(v)),
            Err(aya::maps::MapError::KeyNotFound) => Ok(None),
            Err(e) => Err(e.into()),
        }
    }

    pub fn remove_vip(&mut self, key: &VipKey) -> Result<()> {
        let mut m: HashMap<&mut MapData, VipKey, VipMeta> = HashMap::try_from(self.map("VIPS")?)?;
        // The rings keep their contents and their shadows, so a VIP that later reuses the id
        // is still written as a diff against what the kernel really holds.
        m.remove(key).context("removing from VIPS")?;
        Ok(())
    }

    /// Makes `table` the live ring of the VIP at `key` and writes its settings: only the
    /// slots that differ from what its inactive ring holds are written, then `active_ring`
    /// flips in the same VIPS update, so the XDP program sees the old table or the new one,
    /// never a mix. A table equal to the live one writes nothing. Returns the slots written.
    pub fn publish(&mut self, key: &VipKey, mut meta: VipMeta, table: &[u32]) -> Result<usize> {
        if table.len() != meta.ring_size as usize {
            bail!(
                "table has {} slots but the VIP's ring size is {}",
                table.len(),
                meta.ring_size
            );
        }
        let live = self.vip(key)?;
        let active = live.map(|m| m.active_ring & 1);
        let reused = self.reused;
        let shadow = self.shadows.entry(meta.id).or_insert_with(|| RingShadow {
            // Maps this process created start zeroed; reused (pinned) maps are unknown, so
            // their first table is written in full.
            rings: [0, 1].map(|_| vec![if reused { u32::MAX } else { 0 }; RING_SIZE_MAX as usize]),
        });
        if let (Some(a), Some(m)) = (active, live) {
            let same_settings = VipMeta {
                active_ring: a,
                ..meta
            } == m;
            if same_settings && shadow.rings[a as usize][..table.len()] == *table {
                return Ok(0);
            }
        }
        let next = active.map_or(0, |a| a ^ 1);
        let base = (meta.id * RINGS_PER_VIP + next) * RING_SIZE_MAX;
        let old = &mut shadow.rings[next as usize];
        let changes: Vec<(u32, u32)> = maglev::diff(&old[..table.len()], table).collect();
        let map = self
            .ebpf
            .map_mut("MAGLEV_RINGS")
            .ok_or_else(|| anyhow!("map MAGLEV_RINGS missing"))?;
        let mut rings: Array<&mut MapData, u32> = Array::try_from(map)?;
        for &(slot, id) in &changes {
            // On failure the inactive ring is half-written but not live; the shadow records
            // what landed, so the next attempt writes the rest.
            rings
                .set(base + slot, id, 0)
                .with_context(|| format!("writing ring slot {slot}"))?;
            old[slot as usize] = id;
        }
        meta.active_ring = next;
        self.set_vip(key, &meta)?;
        Ok(changes.len())
    }

    pub fn conn(&mut self, key: &FlowKey) -> Result<Option<ConnEntry>> {
        let m: HashMap<&mut MapData, FlowKey, ConnEntry> = HashMap::try_from(self.map("CONNS")?)?;
        match m.get(key, 0) {
            Ok(v) => Ok(Some(v)),
            Err(aya::maps::MapError::KeyNotFound) => Ok(None),
            Err(e) => Err(e.into()),
        }
    }

    /// Every connection-table entry (a snapshot; entries may change while it is taken).
    pub fn conns(&mut self) -> Result<Vec<(FlowKey, ConnEntry)>> {
        let m: HashMap<&mut MapData, FlowKey, ConnEntry> = HashMap::try_from(self.map("CONNS")?)?;
        Ok(m.iter().filter_map(|r| r.ok()).collect())
    }

    pub fn clear_conns(&mut self) -> Result<()> {
        let keys: Vec<FlowKey> = self.conns()?.into_iter().map(|(k, _)| k).collect();
        let mut m: HashMap<&mut MapData, FlowKey, ConnEntry> =
            HashMap::try_from(self.map("CONNS")?)?;
        for k in keys {
            let _ = m.remove(&k);
        }
        Ok(())
    }

    /// Global counters summed over CPUs, indexed by `lb_common::stat`.
    pub fn stats(&mut self) -> Result<Vec<u64>> {
        let a: PerCpuArray<&mut MapData, u64> = PerCpuArray::try_from(self.map("STATS")?)?;
        (0..stat::COUNT)
            .map(|i| Ok(sum_u64(&a.get(&i, 0)?)))
            .collect()
    }

    fn traffic(&mut self, map: &str, id: u32) -> Result<TrafficStats> {
        let a: PerCpuArray<&mut MapData, TrafficStats> = PerCpuArray::try_from(self.map(map)?)?;
        let v = a.get(&id, 0)?;
        Ok(v.iter()
            .fold(TrafficStats::default(), |acc, s| TrafficStats {
                packets: acc.packets + s.packets,
                bytes: acc.bytes + s.bytes,
                new_flows: acc.new_flows + s.new_flows,
            }))
    }

    pub fn vip_stats(&mut self, vip_id: u32) -> Result<TrafficStats> {
        self.traffic("VIP_STATS", vip_id)
    }

    pub fn backend_stats(&mut self, backend_id: u32) -> Result<TrafficStats> {
        self.traffic("BACKEND_STATS", backend_id)
    }
}
