//! Every map of the data plane, in one place (Katran's layout: VIPs hash, backends array,
//! one flat array of all rings, connection LRU, per-CPU statistics).
//!
//! The maps an operator reads (`CONFIG`, `VIPS`, `BACKENDS`, `CONNS`, `AFFINITY`) are
//! BTF-defined, so `bpftool map dump` shows their keys and values by field name (a legacy
//! `#[map]` carries no key/value types). The rest stay legacy maps: rings of ids, counters
//! and caches, whose raw dump says as much. Userspace opens each by its name in
//! `lb_common::maps`.

use aya_ebpf::{
    btf_maps,
    macros::{btf_map, map},
    maps::{Array, DevMapHash, PerCpuArray},
};
use lb_common::{
    AffinityEntry, AffinityKey, BackendEntry, ConnEntry, FloodWindow, FlowKey, InbandStats,
    LbConfig, NextHop, QuicServerKey, RingSlot, TenantBucket, TenantLimits, TenantPrefix,
    TenantStats, TrafficStats, VipKey, VipMeta, AFFINITY_TABLE_SIZE, CONN_TABLE_SIZE, MAX_BACKENDS,
    MAX_TENANTS, MAX_TENANT_PREFIXES, MAX_TX_PORTS, MAX_VIPS, RINGS_PER_VIP, RING_SIZE_MAX,
    TENANT_V4_WORDS,
};

/// Per-CPU LRU lists: each CPU evicts from its own list, so flows steered by RSS to one CPU
/// never contend on a global LRU lock, while the hash table stays shared (userspace reads one
/// map, and a flow that moves CPU is still found).
const BPF_F_NO_COMMON_LRU: u32 = 1 << 1;
/// An array userspace may mmap: the controller rewrites a table of 16 MiB in place.
const BPF_F_MMAPABLE: u32 = 1 << 10;

/// Element 0 holds `lb_common::LAYOUT_VERSION` of the program that created the maps, so a
/// later program can tell whether pinned maps are readable by it.
#[map]
pub static META: Array<u32> = Array::with_max_entries(1, 0);

/// Global settings (`LbConfig`), element 0.
#[btf_map]
pub static CONFIG: btf_maps::Array<LbConfig, 1> = btf_maps::Array::new();

/// The VIPs, looked up per packet (exact port first, then port 0).
#[btf_map]
pub static VIPS: btf_maps::HashMap<VipKey, VipMeta, { MAX_VIPS as usize }> =
    btf_maps::HashMap::new();

/// Every VIP's backends, by id (0 is never used).
#[btf_map]
pub static BACKENDS: btf_maps::Array<BackendEntry, { MAX_BACKENDS as usize }> =
    btf_maps::Array::new();

/// Slot `(vip_id * RINGS_PER_VIP + ring) * RING_SIZE_MAX + i` of a VIP's ring: its backend id
/// (0 = unset) and the slot's history.
#[map]
pub static MAGLEV_RINGS: Array<RingSlot> =
    Array::with_max_entries(MAX_VIPS * RINGS_PER_VIP * RING_SIZE_MAX, 0);

/// The connection table: a flow's backend, so established flows survive table changes.
#[btf_map]
pub static CONNS: btf_maps::LruHashMap<
    FlowKey,
    ConnEntry,
    { CONN_TABLE_SIZE as usize },
    { BPF_F_NO_COMMON_LRU as usize },
> = btf_maps::LruHashMap::new();

/// Client affinity: a client's last backend per VIP, for `affinity_secs`.
#[btf_map]
pub static AFFINITY: btf_maps::LruHashMap<
    AffinityKey,
    AffinityEntry,
    { AFFINITY_TABLE_SIZE as usize },
    { BPF_F_NO_COMMON_LRU as usize },
> = btf_maps::LruHashMap::new();

/// Egress interfaces for XDP_REDIRECT, keyed by ifindex.
#[map]
pub static TX_PORTS: DevMapHash = DevMapHash::with_max_entries(MAX_TX_PORTS, 0);

/// The `lb_common::stat` counters, by index.
#[map]
pub static STATS: PerCpuArray<u64> = PerCpuArray::with_max_entries(lb_common::stat::COUNT, 0);

/// Traffic per VIP id.
#[map]
pub static VIP_STATS: PerCpuArray<TrafficStats> = PerCpuArray::with_max_entries(MAX_VIPS, 0);

/// Traffic per backend id.
#[map]
pub static BACKEND_STATS: PerCpuArray<TrafficStats> =
    PerCpuArray::with_max_entries(MAX_BACKENDS, 0);

/// Next hops learnt from the FIB, per backend id (see `NEXTHOP_TTL_NS`).
#[map]
pub static NEXTHOPS: PerCpuArray<NextHop> = PerCpuArray::with_max_entries(MAX_BACKENDS, 0);

/// The flood guard's new-flow window.
#[map]
pub static FLOOD: PerCpuArray<FloodWindow> = PerCpuArray::with_max_entries(1, 0);

/// In-band aggregates per backend id (time to first byte, delivered bytes, stalls).
#[map]
pub static INBAND_STATS: PerCpuArray<InbandStats> = PerCpuArray::with_max_entries(MAX_BACKENDS, 0);

/// The backend of each QUIC-LB server ID, per VIP (`quic = "cid"` VIPs only).
#[btf_map]
pub static QUIC_SERVERS: btf_maps::HashMap<QuicServerKey, u32, { MAX_BACKENDS as usize }> =
    btf_maps::HashMap::new();

/// The tenant of each client prefix (longest prefix wins; no match: tenant 0).
#[btf_map]
pub static TENANT_PREFIXES: btf_maps::LpmTrie<TenantPrefix, u32, { MAX_TENANT_PREFIXES as usize }> =
    btf_maps::LpmTrie::new();

/// The tenant of each IPv4 /24 that `TENANT_PREFIXES` answers alike for all its clients,
/// eight /24s to a word (`lb_common::tenant_v4_slot`); 0 sends the client on to the trie.
#[map]
pub static TENANT_V4: Array<u64> = Array::with_max_entries(TENANT_V4_WORDS, BPF_F_MMAPABLE);

/// Each tenant's limits per VIP, element `vip_id * MAX_TENANTS + tenant`.
#[btf_map]
pub static TENANT_LIMITS: btf_maps::Array<TenantLimits, { (MAX_VIPS * MAX_TENANTS) as usize }> =
    btf_maps::Array::new();

/// Each tenant's new-session rate state per VIP (shared by the CPUs), same index.
#[map]
pub static TENANT_BUCKETS: Array<TenantBucket> = Array::with_max_entries(MAX_VIPS * MAX_TENANTS, 0);

/// Each tenant's admitted and refused new sessions per VIP, same index.
#[map]
pub static TENANT_STATS: PerCpuArray<TenantStats> =
    PerCpuArray::with_max_entries(MAX_VIPS * MAX_TENANTS, 0);
