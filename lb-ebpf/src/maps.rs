//! Every map of the data plane, in one place (Katran's layout: VIPs hash, backends array,
//! one flat array of all rings, connection LRU, per-CPU statistics).

use aya_ebpf::{
    macros::map,
    maps::{Array, DevMapHash, HashMap, LruHashMap, PerCpuArray},
};
use lb_common::{
    AffinityEntry, AffinityKey, Backend, ConnEntry, FloodWindow, FlowKey, LbConfig, NextHop,
    RingSlot, TrafficStats, VipKey, VipMeta, AFFINITY_TABLE_SIZE, CONN_TABLE_SIZE, MAX_BACKENDS,
    MAX_TX_PORTS, MAX_VIPS, RINGS_PER_VIP, RING_SIZE_MAX,
};

/// Per-CPU LRU lists: each CPU evicts from its own list, so flows steered by RSS to one CPU
/// never contend on a global LRU lock, while the hash table stays shared (userspace reads one
/// map, and a flow that moves CPU is still found).
const BPF_F_NO_COMMON_LRU: u32 = 1 << 1;

/// Element 0 holds `lb_common::LAYOUT_VERSION` of the program that created the maps, so a
/// later program can tell whether pinned maps are readable by it.
#[map]
pub static META: Array<u32> = Array::with_max_entries(1, 0);

#[map]
pub static CONFIG: Array<LbConfig> = Array::with_max_entries(1, 0);

#[map]
pub static VIPS: HashMap<VipKey, VipMeta> = HashMap::with_max_entries(MAX_VIPS, 0);

#[map]
pub static BACKENDS: Array<Backend> = Array::with_max_entries(MAX_BACKENDS, 0);

/// Slot `(vip_id * RINGS_PER_VIP + ring) * RING_SIZE_MAX + i` of a VIP's ring: its backend id
/// (0 = unset) and the slot's history.
#[map]
pub static MAGLEV_RINGS: Array<RingSlot> =
    Array::with_max_entries(MAX_VIPS * RINGS_PER_VIP * RING_SIZE_MAX, 0);

#[map]
pub static CONNS: LruHashMap<FlowKey, ConnEntry> =
    LruHashMap::with_max_entries(CONN_TABLE_SIZE, BPF_F_NO_COMMON_LRU);

#[map]
pub static AFFINITY: LruHashMap<AffinityKey, AffinityEntry> =
    LruHashMap::with_max_entries(AFFINITY_TABLE_SIZE, BPF_F_NO_COMMON_LRU);

/// Egress interfaces for XDP_REDIRECT, keyed by ifindex.
#[map]
pub static TX_PORTS: DevMapHash = DevMapHash::with_max_entries(MAX_TX_PORTS, 0);

#[map]
pub static STATS: PerCpuArray<u64> = PerCpuArray::with_max_entries(lb_common::stat::COUNT, 0);

#[map]
pub static VIP_STATS: PerCpuArray<TrafficStats> = PerCpuArray::with_max_entries(MAX_VIPS, 0);

#[map]
pub static BACKEND_STATS: PerCpuArray<TrafficStats> =
    PerCpuArray::with_max_entries(MAX_BACKENDS, 0);

#[map]
pub static NEXTHOPS: PerCpuArray<NextHop> = PerCpuArray::with_max_entries(MAX_BACKENDS, 0);

#[map]
pub static FLOOD: PerCpuArray<FloodWindow> = PerCpuArray::with_max_entries(1, 0);
