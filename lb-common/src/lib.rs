//! Types shared by Sluice's eBPF programs and its userspace.
//!
//! Every type here is `#[repr(C)]` with explicit padding: the kernel object is compiled for
//! the host target and retargeted to BPF, and userspace reads the same bytes, so layouts must
//! not depend on implicit padding. Addresses and ports are stored in network byte order, as
//! they appear on the wire; an IPv4 address sits in `addr[0]` with the other words zero.
#![no_std]

pub mod hash;
pub mod trace;

/// Bumped whenever a map's key or value layout changes, or the counter list does (`STATS`
/// is read by index); pinned maps carry it so a newer program refuses to reuse maps it
/// cannot read.
pub const LAYOUT_VERSION: u32 = 9;

pub const MAX_VIPS: u32 = 128;
/// Backend ids index the backend array; id 0 is the "unset" sentinel (a ring slot or
/// connection entry holding 0 is never forwarded).
pub const MAX_BACKENDS: u32 = 4096;
// Ring slots store backend ids in 16 bits.
const _: () = assert!(MAX_BACKENDS <= 1 << 16);
/// Largest (and default) Maglev ring, a prime. Each VIP owns two rings of this stride in
/// `MAGLEV_RINGS` (the active one and the one being rewritten), so a VIP's table is
/// replaced by flipping `VipMeta::active_ring` after the new one is complete.
pub const RING_SIZE_MAX: u32 = 65537;
pub const RINGS_PER_VIP: u32 = 2;
/// Default connection-table capacity; the loader may override it.
pub const CONN_TABLE_SIZE: u32 = 1 << 20;
pub const AFFINITY_TABLE_SIZE: u32 = 1 << 18;
/// Ring positions a new flow tries before giving up (the first is its Maglev slot). Bounded
/// so the verifier accepts the loop and a flow's choice stays deterministic.
pub const MAX_PROBES: u32 = 4;
/// Interfaces reachable through the redirect devmap.
pub const MAX_TX_PORTS: u32 = 64;

pub const FAMILY_V4: u8 = 4;
pub const FAMILY_V6: u8 = 6;

pub const PROTO_ICMP: u8 = 1;
pub const PROTO_IPIP: u8 = 4;
pub const PROTO_TCP: u8 = 6;
pub const PROTO_UDP: u8 = 17;
pub const PROTO_IPV6: u8 = 41;
pub const PROTO_ICMPV6: u8 = 58;

/// Hash on the source address only: every connection of a client, and its reconnections,
/// reach the same backend while the table does not change.
pub const VIP_F_SRC_HASH: u32 = 1 << 0;
/// Admission control sheds this VIP's new sessions (its priority class is below the level
/// the overloaded pool still admits). Established flows are not affected.
pub const VIP_F_SHED: u32 = 1 << 1;
/// Shed TCP sessions with a RST (clients fail fast) instead of dropping the SYN (clients
/// back off and retry).
pub const VIP_F_SHED_RST: u32 = 1 << 2;
/// Second-chance mode: TCP flows are steered by the ring alone, with no connection-table
/// lookup or entry; every backend gets GUE naming its slot's previous backend, and the
/// backend program passes a packet it has no socket for to that one. UDP keeps the table.
pub const VIP_F_SECOND_CHANCE: u32 = 1 << 3;
/// In-band signals: the data plane reads the client's sequence and acknowledgement numbers
/// of this VIP's TCP flows and folds time to first byte and delivery into `InbandStats`
/// (see `lb-ebpf/src/inband.rs`). Needs the connection table (not with second chance).
pub const VIP_F_INBAND: u32 = 1 << 4;
/// Admission control is configured: a new session whose probes find only full backends is
/// shed (`SHED_FULL`). Without it a full backend is only less preferred: such a session
/// goes to the first active backend of its probes (`FULL_FALLBACK`).
pub const VIP_F_ADMISSION: u32 = 1 << 5;
/// QUIC connection-ID routing (a UDP VIP's `quic = "cid"`): a packet whose destination
/// connection ID the server chose carries the server's ID in the QUIC-LB unencrypted layout
/// (see [`quic`]), and goes to the backend with that ID without a connection-table entry, so
/// a client that changes address or port stays on its server. Every other packet takes the
/// 5-tuple path.
pub const VIP_F_QUIC_CID: u32 = 1 << 6;
/// Tenants are configured: a new session of this VIP is matched to its client's tenant
/// (`TENANT_PREFIXES`, longest prefix; tenant 0 when none matches) and refused while that
/// tenant is over a limit here (`TenantLimits`). Packets of established flows never look.
pub const VIP_F_TENANTS: u32 = 1 << 7;

/// Key of the VIP hash map. `port` 0 matches every port of the address and protocol.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub struct VipKey {
    pub addr: [u32; 4],
    pub port: u16,
    pub proto: u8,
    pub family: u8,
}

#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct VipMeta {
    /// Index into per-VIP arrays (rings, statistics); 0..MAX_VIPS.
    pub id: u32,
    pub flags: u32,
    /// Prime number of slots in this VIP's rings, at most `RING_SIZE_MAX`.
    pub ring_size: u32,
    /// Which of the VIP's two rings is live (0 or 1).
    pub active_ring: u32,
    /// Client-affinity window in seconds, counted from the client's last packet to the
    /// entry's backend; 0 disables the affinity table for this VIP.
    pub affinity_secs: u32,
    /// With `VIP_F_QUIC_CID`: the config rotation codepoint (0..=6) the VIP's connection IDs
    /// carry in the top three bits of their first octet.
    pub quic_rotation: u8,
    /// With `VIP_F_QUIC_CID`: the length of a server ID in octets (1..=`quic::SERVER_ID_LEN_MAX`).
    pub quic_server_id_len: u8,
    pub _pad: [u8; 2],
}

/// Previous owners a ring slot remembers, and a GUE packet names: a flow survives this many
/// changes of its slot while it lives. Sized by `sluice-bench history`: under adaptive
/// steering one previous owner lost up to 6.5% of 30-second streams, two 2.1%, three 0.1%.
pub const RING_HISTORY: usize = 3;

/// One slot of a VIP's Maglev ring: its backend, the distinct backends that held it before
/// (most recent first) and the VIP table generation of its last change. A flow that began
/// before a change is still on one of `previous`, which is what second-chance forwarding
/// needs to find it. The history depends only on the sequence of tables published for the
/// VIP, so LB hosts that publish the same tables hold the same rings.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct RingSlot {
    /// Backend id; 0 = unset. 16 bits keep the slot at 12 bytes (`MAX_BACKENDS` fits).
    pub backend: u16,
    /// The backends that held the slot before, most recent first, none equal to `backend`
    /// or to each other; 0 = none (trailing).
    pub previous: [u16; RING_HISTORY],
    /// Table generation in which `backend` took the slot: 0 is the VIP's first table, and
    /// each later table that changes any slot is the next generation.
    pub changed: u32,
}

/// `BackendEntry::state` (an entry never written holds 0, which serves nothing).
/// Takes new flows and keeps its established ones.
pub const BACKEND_ACTIVE: u8 = 1;
/// Takes no new flows; established flows continue.
pub const BACKEND_DRAINING: u8 = 2;
/// Takes no new flows; its established flows are re-steered to the table's current choice.
pub const BACKEND_DOWN: u8 = 3;

/// `BackendEntry::flags`: at its session cap or saturated; new flows probe past it. A
/// client's fresh affinity entry still brings it a new session unless it is also
/// `BACKEND_F_CAPPED`: a conversation's next turn finds its prefix cached there, and being
/// busy steers new clients away, not the next turn.
pub const BACKEND_F_FULL: u8 = 1 << 0;
/// `BackendEntry::flags`: the backend runs `sluice_decap`, so it is sent GUE (which names the
/// flow's previous backend for second-chance forwarding) instead of IPIP.
pub const BACKEND_F_GUE: u8 = 1 << 1;
/// `Backend::flags`: weight 0 by the operator, down, moved away by the policy for a fault
/// (throttled, congested, slow, refusing; at weight 0 or a reduced one), or requests wait in its
/// queue: a client's affinity entry brings it no new session; only its ring slots do. A
/// saturation move is no fault.
pub const BACKEND_F_NO_AFFINITY: u8 = 1 << 2;
/// `BackendEntry::flags`: at the session cap the operator set (`max_sessions`); always with
/// `BACKEND_F_FULL`. Affinity yields to it: the cap is a hard limit.
pub const BACKEND_F_CAPPED: u8 = 1 << 3;

/// UDP destination port of GUE tunnel packets (the port Linux's GUE examples use).
pub const GUE_PORT: u16 = 6080;
/// Outer UDP source ports of GUE packets: `GUE_SPORT_BASE | (flow_hash & GUE_SPORT_MASK)`,
/// so every packet of a flow carries one port and a backend NIC's RSS spreads flows.
pub const GUE_SPORT_BASE: u16 = 0xc000;
pub const GUE_SPORT_MASK: u16 = 0x3fff;
/// Sluice's GUE private data (after the 4-byte GUE base header): a kind byte, a hop-count
/// byte, two reserved bytes, then `RING_HISTORY` previous backends' addresses in the outer
/// family (4 or 16 bytes each, most recent first, all zero where there is none).
pub const GUE_PRIV_KIND: u8 = 0x53;
/// GUE private-data length without the addresses.
pub const GUE_PRIV_HDR_LEN: usize = 4;

#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct BackendEntry {
    pub addr: [u32; 4],
    pub family: u8,
    pub state: u8,
    pub flags: u8,
    pub _pad: u8,
    /// The VIP this backend serves (backends are per VIP so drains and weights are per VIP).
    pub vip: u32,
}

/// Tenants, including the default tenant 0 (clients no configured prefix matches).
pub const MAX_TENANTS: u32 = 64;
/// The element of a (VIP, tenant) in the per-(VIP, tenant) arrays (`TENANT_LIMITS`,
/// `TENANT_BUCKETS`, `TENANT_STATS`): the tenant is masked to `MAX_TENANTS`, so the index
/// stays among its VIP's own elements.
#[inline(always)]
pub const fn tenant_index(vip: u32, tenant: u32) -> u32 {
    vip * MAX_TENANTS + (tenant & (MAX_TENANTS - 1))
}

/// Client prefixes all tenants together may name.
pub const MAX_TENANT_PREFIXES: u32 = 16384;

/// The data of a `TENANT_PREFIXES` key (after the LPM key's prefix length, which counts 32
/// bits for `family` and its padding, then the address's): one trie holds both families,
/// an IPv4 prefix never matching an IPv6 client. `addr` as `FlowKey::src` holds it.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub struct TenantPrefix {
    pub family: u8,
    pub _pad: [u8; 3],
    pub addr: [u32; 4],
}

/// Bits of a `TENANT_PREFIXES` key before the address: `TenantPrefix::family` and padding.
pub const TENANT_PREFIX_FAMILY_BITS: u32 = 32;

/// Words of `TENANT_V4`: one byte per IPv4 /24 (2^24 of them), eight to a word.
pub const TENANT_V4_WORDS: u32 = 1 << 21;

/// The `TENANT_V4` byte that sends an IPv4 client on to `TENANT_PREFIXES`: a prefix longer
/// than /24 lies inside its /24 (or the table was never written). Any other byte is the
/// tenant + 1.
pub const TENANT_V4_ASK_TRIE: u8 = 0;

/// The `TENANT_V4` word, and the shift of the byte in it, that hold the /24 of an IPv4
/// address (host order): byte `b` of a word is bits `8b..8b+8` of its value.
#[inline(always)]
pub const fn tenant_v4_slot(addr: u32) -> (u32, u32) {
    let block = addr >> 8;
    (block >> 3, (block & 7) * 8)
}

/// A tenant's limits on one VIP: element `vip_id * MAX_TENANTS + tenant` of `TENANT_LIMITS`,
/// written by the controller. All zero: no limit.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct TenantLimits {
    /// New sessions per second as a generic cell rate: one new session per `interval_ns`
    /// sustained; 0 = no rate limit.
    pub interval_ns: u64,
    /// How far ahead of the sustained rate a burst may run: `burst * interval_ns`, so a
    /// tenant idle for long enough opens `burst` sessions at once.
    pub burst_ns: u64,
    /// `TENANT_F_*` bits, set by the controller from the connection table's counts.
    pub flags: u32,
    pub _pad: u32,
}

/// `TenantLimits::flags`: the tenant's sessions on this VIP reached its `max_sessions`.
pub const TENANT_F_CAPPED: u32 = 1 << 0;
/// `TenantLimits::flags`: the VIP's pool is full and this tenant holds more than its
/// weighted share of it: its new sessions are refused before any class is shed, so the room
/// that frees up goes to the tenants under their share.
pub const TENANT_F_OVER_SHARE: u32 = 1 << 1;

/// A tenant's rate state on one VIP (`TENANT_BUCKETS`, same index as `TenantLimits`,
/// shared by the CPUs): the theoretical arrival time of the next new session (GCRA). Two
/// CPUs admitting at the same instant may both take the last token: the rate is exact to
/// within one session per CPU.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct TenantBucket {
    pub tat_ns: u64,
}

/// A tenant's new sessions on one VIP (`TENANT_STATS`, per CPU, same index): admitted by its
/// limits (a session admitted here may still be shed by the pool's admission), and refused
/// for each limit.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct TenantStats {
    pub admitted: u64,
    pub refused_sessions: u64,
    pub refused_share: u64,
    pub refused_rate: u64,
}

impl TenantStats {
    /// The sum of two CPUs' counters.
    pub fn merged(self, o: &TenantStats) -> TenantStats {
        TenantStats {
            admitted: self.admitted + o.admitted,
            refused_sessions: self.refused_sessions + o.refused_sessions,
            refused_share: self.refused_share + o.refused_share,
            refused_rate: self.refused_rate + o.refused_rate,
        }
    }
}

/// Key of `QUIC_SERVERS`: a VIP and one of its backends' QUIC-LB server IDs (value: the
/// backend id, `u32`).
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub struct QuicServerKey {
    pub vip: u32,
    pub _pad: u32,
    /// The server ID's octets read as a big-endian integer ([`quic::server_id_value`]).
    pub id: u64,
}

/// The QUIC facts the data plane routes by: RFC 8999's invariants, RFC 9000's and RFC 9369's
/// version-specific long-header types, and the QUIC-LB draft's connection-ID layout
/// (draft-ietf-quic-load-balancers, unencrypted mode).
///
/// A QUIC-LB connection ID is: one octet whose top three bits are the config rotation
/// codepoint (the low five are the server's: random, or the CID length less one), then the
/// server ID (`quic_server_id_len` octets), then the server's nonce (at least four octets).
pub mod quic {
    /// The header-form bit of a packet's first octet: set for a long header.
    pub const LONG_HEADER: u8 = 0x80;
    /// QUIC version 1 (RFC 9000).
    pub const VERSION_1: u32 = 0x0000_0001;
    /// QUIC version 2 (RFC 9369), whose long-header types are numbered differently.
    pub const VERSION_2: u32 = 0x6b33_43cf;
    /// The long-header type of a Handshake packet (bits 4-5 of the first octet): in v1 and
    /// v2 the only long-header type a client sends to a connection ID its server chose.
    /// Initial and 0-RTT packets carry the ID the client chose.
    pub const HANDSHAKE_V1: u8 = 2;
    pub const HANDSHAKE_V2: u8 = 3;
    /// Longest connection ID in versions 1 and 2.
    pub const MAX_CID_LEN: usize = 20;
    /// Longest server ID the data plane reads (the draft allows up to 15 octets; eight keep
    /// the lookup key one word).
    pub const SERVER_ID_LEN_MAX: u8 = 8;
    /// Shortest nonce a QUIC-LB server writes after its server ID.
    pub const NONCE_LEN_MIN: usize = 4;
    /// Config rotation codepoints in the first octet's top three bits; `0b111` marks a
    /// connection ID that follows no configuration (QUIC-LB's "unroutable"), never configured.
    pub const ROTATION_SHIFT: u32 = 5;
    pub const ROTATION_UNROUTABLE: u8 = 0b111;

    /// A server ID's octets as the integer `QuicServerKey::id` holds (big endian, so
    /// `0a01` is `0x0a01`). `bytes` is at most `SERVER_ID_LEN_MAX` long.
    pub fn server_id_value(bytes: &[u8]) -> u64 {
        bytes.iter().fold(0u64, |v, b| v << 8 | *b as u64)
    }
}

/// Connection-table key: the client's 5-tuple as it arrives.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub struct FlowKey {
    pub src: [u32; 4],
    pub dst: [u32; 4],
    pub sport: u16,
    pub dport: u16,
    pub proto: u8,
    pub family: u8,
    pub _pad: [u8; 2],
}

#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct ConnEntry {
    pub backend: u32,
    /// The flow's steering hash, kept so an established packet need not hash again (it
    /// picks the outer source address and IPv6 flow label).
    pub hash: u32,
    /// `bpf_ktime_get_coarse_ns` (CLOCK_MONOTONIC) of the last packet.
    pub last_seen_ns: u64,
    /// In-band state, written only on `VIP_F_INBAND` VIPs (zero elsewhere).
    pub inband: InbandFlow,
    /// `CONN_F_*` bits.
    pub flags: u8,
    pub _pad: [u8; 3],
}

/// `ConnEntry::flags`: the flow's SYN counted a handshake started on its backend
/// (`TrafficStats::handshakes`) and no ACK of the client has completed it yet. A SYN
/// retransmitted while it is set counts nothing more; the first ACK clears it and counts
/// `handshakes_completed`. Set only by a SYN that creates the entry or reopens it.
pub const CONN_F_HANDSHAKE: u8 = 1 << 0;
/// `ConnEntry::flags`: the client has sent a FIN or RST on this flow, so it no longer counts
/// as its tenant's session; its packets still follow the entry until it idles out. A SYN
/// that reopens the entry clears it.
pub const CONN_F_CLOSED: u8 = 1 << 1;

/// In-band times are `CLOCK_MONOTONIC >> INBAND_TIME_SHIFT`: units of 2^20 ns (about
/// 1.05 ms), a shift instead of a division on the packet path, 32 bits wrap after 52 days.
pub const INBAND_TIME_SHIFT: u32 = 20;
/// No acknowledgement progress for this long (in-band units, about 2.1 s) while a request
/// waits for its first byte or an answer is under way counts the flow as stalled, once per
/// request.
pub const INBAND_STALL_UNITS: u32 = 2048;
/// Log2 buckets of time to first byte: bucket 0 is under one unit, bucket `k` holds
/// `[2^(k-1), 2^k)` units, the last one everything above.
pub const INBAND_HIST_BUCKETS: usize = 20;

/// `InbandFlow::flags`: the flow's acknowledgement and client sequence baselines are set.
pub const INBAND_F_SEEN: u8 = 1 << 0;
/// A request waits for the first byte of its answer.
pub const INBAND_F_WAITING: u8 = 1 << 1;
/// The current request's stall has been counted.
pub const INBAND_F_STALLED: u8 = 1 << 2;
/// The answer to the last request has begun (flows that never sent a request only count
/// delivered bytes, no streaming time or stalls).
pub const INBAND_F_ANSWERING: u8 = 1 << 3;

/// Per-flow in-band state (inside the connection entry: no second lookup per packet).
/// The LB sees only the client's packets: its sequence numbers delimit requests, its
/// acknowledgement numbers count the server's bytes as they arrive.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct InbandFlow {
    /// The time (in-band units) of the outstanding request, while `INBAND_F_WAITING`.
    pub request_t: u32,
    /// The time of the last acknowledgement progress (or of the request).
    pub progress_t: u32,
    /// Highest acknowledgement number seen (host order): server bytes delivered so far.
    pub ack: u32,
    /// The client's next sequence number (host order): data below it is a retransmission.
    pub client_next: u32,
    /// `INBAND_F_*` bits.
    pub flags: u8,
    pub _pad: [u8; 3],
}

/// Per-backend in-band aggregates (a per-CPU array indexed by backend id; userspace sums
/// the CPUs and differentiates over its own clock).
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct InbandStats {
    /// Requests seen (new client data after the answer to the previous one began).
    pub requests: u64,
    /// Requests whose answer's first byte was acknowledged.
    pub first_bytes: u64,
    /// Sum of the times to first byte, in-band units.
    pub ttfb_units: u64,
    /// Server bytes acknowledged (cumulative ACK advance; SACKed bytes count once the hole
    /// is filled).
    pub acked_bytes: u64,
    /// Flow-time during which answers were under way (gaps between ACK advances, each
    /// capped at `INBAND_STALL_UNITS`), in-band units: `acked_bytes / stream_units` is the
    /// mean per-stream delivery rate.
    pub stream_units: u64,
    /// Requests whose flow stalled (see `INBAND_STALL_UNITS`).
    pub stalls: u64,
    /// Log2 histogram of time to first byte (see `INBAND_HIST_BUCKETS`).
    pub ttfb_hist: [u64; INBAND_HIST_BUCKETS],
}

impl InbandStats {
    /// The sum of two CPUs' (or two reads') aggregates.
    pub fn merged(mut self, o: &InbandStats) -> InbandStats {
        self.requests += o.requests;
        self.first_bytes += o.first_bytes;
        self.ttfb_units += o.ttfb_units;
        self.acked_bytes += o.acked_bytes;
        self.stream_units += o.stream_units;
        self.stalls += o.stalls;
        for (a, b) in self.ttfb_hist.iter_mut().zip(o.ttfb_hist.iter()) {
            *a += b;
        }
        self
    }
}

#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub struct AffinityKey {
    pub addr: [u32; 4],
    pub vip: u32,
}

#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct AffinityEntry {
    pub backend: u32,
    pub _pad: u32,
    /// `bpf_ktime_get_coarse_ns` of the client's last new session, or of its last packet
    /// to `backend` (refreshed once a second).
    pub last_seen_ns: u64,
}

/// Global data-plane settings, element 0 of the `CONFIG` array.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct LbConfig {
    /// Outer IPv4 source: `encap_src_v4 | (flow_hash & encap_src_v4_hostmask)`, so a backend
    /// NIC's RSS spreads flows while every packet of one flow carries the same source.
    pub encap_src_v4: u32,
    pub encap_src_v4_hostmask: u32,
    /// Outer IPv6 source; the flow hash fills the bits of the last word's host mask.
    pub encap_src_v6: [u32; 4],
    pub encap_src_v6_hostmask: u32,
    /// Seed of the flow hash; the same on every LB host so they all steer alike.
    pub hash_seed: u32,
    /// Next-hop MAC used when the FIB has no neighbour entry; all zero means "drop instead".
    pub fallback_mac: [u8; 6],
    pub _pad: [u8; 2],
    /// New flows per second per CPU above which flows are steered by hash alone and not
    /// inserted into the connection table, so a SYN flood cannot evict live flows. 0 = off.
    pub flood_new_flows_per_sec: u32,
    /// `LB_F_*` bits.
    pub flags: u32,
}

/// Per-VIP and per-backend traffic counters (per-CPU arrays; userspace sums the CPUs).
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct TrafficStats {
    pub packets: u64,
    pub bytes: u64,
    pub new_flows: u64,
    /// TCP handshakes started: client SYNs that created a connection entry, or reopened one
    /// whose handshake had completed, counted once per flow however often the SYN is
    /// retransmitted. Connection-table VIPs only: a second-chance VIP keeps no per-flow
    /// state at the balancer, and a flow the flood guard leaves out of the table is not
    /// counted.
    pub handshakes: u64,
    /// Of `handshakes`: those whose client sent its first ACK. The difference is handshakes
    /// that never completed (the backend refused or never answered, or the client gave up).
    pub handshakes_completed: u64,
}

impl TrafficStats {
    /// The sum of two CPUs' counters.
    pub fn merged(self, o: &TrafficStats) -> TrafficStats {
        TrafficStats {
            packets: self.packets + o.packets,
            bytes: self.bytes + o.bytes,
            new_flows: self.new_flows + o.new_flows,
            handshakes: self.handshakes + o.handshakes,
            handshakes_completed: self.handshakes_completed + o.handshakes_completed,
        }
    }
}

/// `LbConfig::flags`: some VIP listens on every port, so an address whose exact-port lookup
/// misses must also be looked up with port 0. Without it non-VIP traffic pays one lookup.
pub const LB_F_WILDCARD_VIPS: u32 = 1 << 0;
/// `LbConfig::flags`: write every steering decision to the `AYA_LOGS` ring buffer
/// (`trace::DecisionRecord`). Off by default; the check costs one bit test of a value the
/// program has already loaded.
pub const LB_F_TRACE: u32 = 1 << 1;

/// How long a next hop learnt from the FIB is reused before asking again. The FIB lookup
/// costs as much as the rest of an established flow's path; a neighbour change is seen
/// within this time.
pub const NEXTHOP_TTL_NS: u64 = 1_000_000_000;

/// Per-CPU next-hop cache entry, indexed by backend id.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct NextHop {
    pub expires_ns: u64,
    pub ifindex: u32,
    /// The ingress interface the entry was learnt for.
    pub ingress: u32,
    /// Egress MTU: a packet whose encapsulation would exceed it asks the FIB again.
    pub mtu: u32,
    pub smac: [u8; 6],
    pub dmac: [u8; 6],
}

/// Per-CPU flood-guard window.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct FloodWindow {
    pub start_ns: u64,
    pub new_flows: u64,
}

/// The names of the data plane's maps (the symbols in `lb-ebpf/src/maps.rs`, and the files
/// under the pin directory), for the daemon, the bench and the tests alike.
pub mod maps {
    /// `[u32; 1]`: the `LAYOUT_VERSION` of the program that created the pinned maps.
    pub const META: &str = "META";
    /// `[LbConfig; 1]`: global settings.
    pub const CONFIG: &str = "CONFIG";
    /// `VipKey → VipMeta`: the VIPs, looked up per packet.
    pub const VIPS: &str = "VIPS";
    /// `[Backend; MAX_BACKENDS]`: every VIP's backends, by id.
    pub const BACKENDS: &str = "BACKENDS";
    /// `[RingSlot]`: two Maglev rings per VIP, each `RING_SIZE_MAX` slots apart.
    pub const MAGLEV_RINGS: &str = "MAGLEV_RINGS";
    /// `FlowKey → ConnEntry` (LRU): the connection table.
    pub const CONNS: &str = "CONNS";
    /// `AffinityKey → AffinityEntry` (LRU): client affinity per VIP.
    pub const AFFINITY: &str = "AFFINITY";
    /// ifindex → ifindex (devmap): interfaces `XDP_REDIRECT` may send to.
    pub const TX_PORTS: &str = "TX_PORTS";
    /// `[u64; stat::COUNT]` per CPU: the `stat` counters.
    pub const STATS: &str = "STATS";
    /// `[TrafficStats; MAX_VIPS]` per CPU: traffic per VIP.
    pub const VIP_STATS: &str = "VIP_STATS";
    /// `[TrafficStats; MAX_BACKENDS]` per CPU: traffic per backend.
    pub const BACKEND_STATS: &str = "BACKEND_STATS";
    /// `[NextHop; MAX_BACKENDS]` per CPU: next hops learnt from the FIB.
    pub const NEXTHOPS: &str = "NEXTHOPS";
    /// `[FloodWindow; 1]` per CPU: the new-flow rate of the flood guard.
    pub const FLOOD: &str = "FLOOD";
    /// `[InbandStats; MAX_BACKENDS]` per CPU: in-band TTFB, delivery and stalls per backend.
    pub const INBAND_STATS: &str = "INBAND_STATS";
    /// `QuicServerKey → u32` (hash): the backend of a VIP's QUIC-LB server ID.
    pub const QUIC_SERVERS: &str = "QUIC_SERVERS";
    /// `Key<TenantPrefix> → u32` (LPM trie): the tenant of a client prefix.
    pub const TENANT_PREFIXES: &str = "TENANT_PREFIXES";
    /// `[u64; TENANT_V4_WORDS]` (memory-mapped array): the tenant of every IPv4 /24 that
    /// `TENANT_PREFIXES` answers alike for all its clients, one array read instead of a
    /// walk of the trie (`tenant_v4_slot`, `TENANT_V4_ASK_TRIE`).
    pub const TENANT_V4: &str = "TENANT_V4";
    /// `[TenantLimits; MAX_VIPS * MAX_TENANTS]`: each tenant's limits per VIP.
    pub const TENANT_LIMITS: &str = "TENANT_LIMITS";
    /// `[TenantBucket; MAX_VIPS * MAX_TENANTS]`: each tenant's new-session rate state per VIP.
    pub const TENANT_BUCKETS: &str = "TENANT_BUCKETS";
    /// `[TenantStats; MAX_VIPS * MAX_TENANTS]` per CPU: each tenant's new sessions per VIP.
    pub const TENANT_STATS: &str = "TENANT_STATS";
    /// Ring buffer of `trace::DecisionRecord`s (aya-log's map name).
    pub const AYA_LOGS: &str = "AYA_LOGS";
}

/// Indexes of the global per-CPU counter array: every pass, drop and fallback has one.
///
/// Each counter is declared once, with its index, exported name and [`stat::Kind`]: the kind
/// says which exported family it belongs to and lets a test check that every frame ends in
/// exactly one outcome.
pub mod stat {
    /// What a counter counts.
    #[derive(Clone, Copy, Debug, PartialEq, Eq)]
    pub enum Kind {
        /// Every frame the program sees.
        Received,
        /// An outcome: the frame goes to the kernel untouched, for this reason.
        Pass,
        /// An outcome: the frame is dropped, for this reason.
        Drop,
        /// An outcome: a frame leaves (encapsulated, or a reply built from it).
        Sent,
        /// Something that happened on the way to an outcome (a table hit, a fallback).
        Event,
    }

    /// One counter of the array, by index. A type of its own so that a counter carried in a
    /// `Result` or a parameter cannot be mistaken for an XDP action or any other `u32`.
    #[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
    #[repr(transparent)]
    pub struct Counter(pub u32);

    impl Counter {
        /// Its index in the counter array (and in `NAMES` and `KINDS`).
        pub const fn index(self) -> usize {
            self.0 as usize
        }

        /// Its exported name.
        pub const fn name(self) -> &'static str {
            NAMES[self.index()]
        }

        pub const fn kind(self) -> Kind {
            KINDS[self.index()]
        }
    }

    /// Declares the counters in order: `NAME = "exported_name", Kind;` gives `pub const NAME`
    /// (a [`Counter`]), and the `COUNT`, `NAMES` and `KINDS` tables.
    macro_rules! counters {
        ($($(#[$doc:meta])* $id:ident = $name:literal, $kind:ident;)*) => {
            counters!(@index 0u32; $($(#[$doc])* $id,)*);
            pub const COUNT: u32 = [$($name),*].len() as u32;
            /// Names as exported (Prometheus label values, CLI); index = counter.
            pub const NAMES: [&str; COUNT as usize] = [$($name),*];
            /// Kind of each counter; index = counter.
            pub const KINDS: [Kind; COUNT as usize] = [$(Kind::$kind),*];
        };
        (@index $n:expr; $(#[$doc:meta])* $id:ident, $($rest:tt)*) => {
            $(#[$doc])*
            pub const $id: Counter = Counter($n);
            counters!(@index $n + 1; $($rest)*);
        };
        (@index $n:expr;) => {};
    }

    counters! {
        RX = "rx", Received;
        PASS_NOT_IP = "pass_not_ip", Pass;
        PASS_NOT_VIP = "pass_not_vip", Pass;
        PASS_TRUNCATED_L2 = "pass_truncated_l2", Pass;
        PASS_TRUNCATED_L3 = "pass_truncated_l3", Pass;
        PASS_TRUNCATED_L4 = "pass_truncated_l4", Pass;
        /// The IP length field claims more than the frame holds, or less than its own header.
        PASS_BAD_IP_LEN = "pass_bad_ip_len", Pass;
        PASS_FRAGMENT = "pass_fragment", Pass;
        PASS_UNSUPPORTED_L4 = "pass_unsupported_l4", Pass;
        PASS_EXT_HDR_LIMIT = "pass_ext_hdr_limit", Pass;
        PASS_ICMP_NOT_VIP = "pass_icmp_not_vip", Pass;
        ICMP_TOO_BIG_STEERED = "icmp_too_big_steered", Event;
        CONN_HIT = "conn_hit", Event;
        CONN_MISS = "conn_miss", Event;
        CONN_RESTEER_DOWN = "conn_resteer_down", Event;
        FLOOD_BYPASS = "flood_bypass", Event;
        AFFINITY_HIT = "affinity_hit", Event;
        PROBE_SKIP = "probe_skip", Event;
        DROP_NO_BACKEND = "drop_no_backend", Drop;
        DROP_BAD_BACKEND = "drop_bad_backend", Drop;
        DROP_ADJUST_HEAD = "drop_adjust_head", Drop;
        FIB_FALLBACK_MAC = "fib_fallback_mac", Event;
        DROP_NO_NEXTHOP = "drop_no_nexthop", Drop;
        TX = "tx", Sent;
        REDIRECT = "redirect", Sent;
        DECAP_OK = "decap_ok", Event;
        DECAP_PASS_NOT_ENCAP = "decap_pass_not_encap", Pass;
        /// A new session shed by priority; followed by `SHED_RST_SENT` or `DROP_SHED`.
        SHED_PRIORITY = "shed_priority", Event;
        /// A new session shed because every backend it may use is full; followed by
        /// `SHED_RST_SENT` or `DROP_SHED`.
        SHED_FULL = "shed_full", Event;
        /// A new session of a VIP without admission control whose probes found only full
        /// backends, sent to the first active one of them.
        FULL_FALLBACK = "full_fallback", Event;
        SHED_RST_SENT = "shed_rst_sent", Sent;
        DROP_FRAG_NEEDED = "drop_frag_needed", Drop;
        ICMP_TOO_BIG_SENT = "icmp_too_big_sent", Sent;
        /// The IP length ends inside a header that the frame holds (an extension header, the
        /// L4 header, an ICMP error's quote): the length lies, and the frame is not steered
        /// on bytes that are not part of its packet.
        PASS_SHORT_IP_LEN = "pass_short_ip_len", Pass;
        /// Bytes after the IP packet (Ethernet padding) cut before encapsulation, so the
        /// tunnel carries exactly the client's packet.
        PADDING_TRIMMED = "padding_trimmed", Event;
        /// A tunnel packet whose outer length disagrees with the frame or with the inner
        /// packet's own length: not stripped.
        DECAP_PASS_BAD_LEN = "decap_pass_bad_len", Pass;
        /// A shed session dropped (not answered with a RST): with `SHED_RST_SENT`, every
        /// shed frame ends in exactly one outcome.
        DROP_SHED = "drop_shed", Drop;
        /// A UDP packet to the GUE port that is not Sluice's GUE (another version, control
        /// message, flags or private data): left to the kernel.
        DECAP_PASS_BAD_GUE = "decap_pass_bad_gue", Pass;
        /// A mid-connection TCP packet without a socket here, passed on to the first
        /// previous backend the tunnel still names (second-chance forwarding).
        DECAP_SECOND_HOP = "decap_second_hop", Sent;
        /// Of `DECAP_SECOND_HOP`: a packet that a previous backend passes on again, to the
        /// slot's second or third previous owner.
        DECAP_HOP_FURTHER = "decap_hop_further", Event;
        /// A packet already passed on finds no socket here either and the tunnel names no
        /// further backend: the flow's ring slot changed more often than its history
        /// remembers (or the connection is gone). Delivered to the stack, which resets it.
        DECAP_HISTORY_SHORT = "decap_history_short", Event;
        /// No socket here and no previous backend named (or a tunnel layout not rewritten
        /// in place): delivered to the stack.
        DECAP_NO_SECOND_HOP = "decap_no_second_hop", Event;
        /// No route to the previous backend: delivered to the stack.
        DECAP_SECOND_HOP_NO_ROUTE = "decap_second_hop_no_route", Event;
        /// A TCP packet of a second-chance VIP, steered by the ring without the
        /// connection table.
        SECOND_CHANCE_STEERED = "second_chance_steered", Event;
        /// An in-band VIP's TCP packet whose header was not readable for sequence numbers
        /// (should not happen after parsing): not measured, still forwarded.
        INBAND_SKIPPED = "inband_skipped", Event;
        /// A client data packet below its flow's next sequence number (a retransmission):
        /// not a new request.
        INBAND_RETRANSMIT = "inband_retransmit", Event;
        /// A client acknowledgement not above the highest seen (a duplicate or reordered
        /// ACK, e.g. one carrying SACK blocks): no progress counted.
        INBAND_ACK_STALE = "inband_ack_stale", Event;
        /// Of `AFFINITY_HIT`: a new session on a backend that is full by saturation, not at
        /// its cap, kept there by the client's affinity entry (new clients probe past it).
        AFFINITY_HIT_SATURATED = "affinity_hit_saturated", Event;
        /// A TCP SYN whose 5-tuple still has a connection entry, to a backend that no longer
        /// keeps its clients (draining, moved away, down or gone): the entry is removed and
        /// the SYN steered as a miss is (shedding, affinity, ring, a new entry unless the
        /// flood guard holds). Not also counted as a miss.
        CONN_REOPEN_RESTEER = "conn_reopen_resteer", Event;
        /// A packet of a `quic = "cid"` VIP sent to the backend its connection ID names,
        /// without the connection table.
        QUIC_CID_ROUTED = "quic_cid_routed", Event;
        /// A long-header packet of a `quic = "cid"` VIP whose destination connection ID the
        /// client chose (Initial, 0-RTT) or of a version the data plane does not know
        /// (version negotiation included): the 5-tuple path.
        QUIC_CLIENT_CID = "quic_client_cid", Event;
        /// A connection ID whose config rotation codepoint is not the VIP's (a stateless
        /// reset's random octets, an old configuration, `0b111`): the 5-tuple path.
        QUIC_UNKNOWN_ROTATION = "quic_unknown_rotation", Event;
        /// A connection ID whose server ID no backend of the VIP has: the 5-tuple path.
        QUIC_UNKNOWN_SERVER = "quic_unknown_server", Event;
        /// A connection ID of a backend that takes no packets (down, or its entry gone): the
        /// 5-tuple path.
        QUIC_SERVER_DOWN = "quic_server_down", Event;
        /// A UDP payload too short for a QUIC header and the server ID, or a long header whose
        /// connection-ID length is over 20 octets, shorter than a server ID, or runs past the
        /// packet: the 5-tuple path.
        QUIC_MALFORMED = "quic_malformed", Event;
        /// A new session refused because its tenant holds its `max_sessions` on the VIP;
        /// followed by `SHED_RST_SENT` or `DROP_SHED`.
        SHED_TENANT_SESSIONS = "shed_tenant_sessions", Event;
        /// A new session refused because the VIP's pool is full and its tenant is over its
        /// weighted share; followed by `SHED_RST_SENT` or `DROP_SHED`.
        SHED_TENANT_SHARE = "shed_tenant_share", Event;
        /// A new session refused because its tenant opens sessions faster than its rate and
        /// burst allow; followed by `SHED_RST_SENT` or `DROP_SHED`.
        SHED_TENANT_RATE = "shed_tenant_rate", Event;
    }
}

#[cfg(feature = "user")]
mod pod {
    use super::*;
    // SAFETY: all of these are repr(C), contain only integers and have explicit padding.
    unsafe impl aya::Pod for VipKey {}
    unsafe impl aya::Pod for VipMeta {}
    unsafe impl aya::Pod for BackendEntry {}
    unsafe impl aya::Pod for FlowKey {}
    unsafe impl aya::Pod for ConnEntry {}
    unsafe impl aya::Pod for AffinityKey {}
    unsafe impl aya::Pod for AffinityEntry {}
    unsafe impl aya::Pod for LbConfig {}
    unsafe impl aya::Pod for TrafficStats {}
    unsafe impl aya::Pod for FloodWindow {}
    unsafe impl aya::Pod for NextHop {}
    unsafe impl aya::Pod for RingSlot {}
    unsafe impl aya::Pod for InbandFlow {}
    unsafe impl aya::Pod for InbandStats {}
    unsafe impl aya::Pod for QuicServerKey {}
    unsafe impl aya::Pod for TenantPrefix {}
    unsafe impl aya::Pod for TenantLimits {}
    unsafe impl aya::Pod for TenantBucket {}
    unsafe impl aya::Pod for TenantStats {}
}
