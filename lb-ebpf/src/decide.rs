//! The steering decision: VIP, connection table, client affinity, Maglev ring with bounded
//! probing past backends that take no new flows.

use aya_ebpf::helpers::bpf_ktime_get_coarse_ns;
use lb_common::{
    hash, stat, AffinityEntry, AffinityKey, BackendEntry, ConnEntry, FlowKey, InbandFlow, LbConfig,
    VipKey, VipMeta, BACKEND_ACTIVE, BACKEND_DRAINING, BACKEND_F_CAPPED, BACKEND_F_FULL,
    BACKEND_F_GUE, BACKEND_F_NO_AFFINITY, CONN_F_CLOSED, CONN_F_HANDSHAKE, LB_F_WILDCARD_VIPS,
    MAX_PROBES, PROTO_TCP, RINGS_PER_VIP, RING_HISTORY, RING_SIZE_MAX, VIP_F_ADMISSION,
    VIP_F_SECOND_CHANCE, VIP_F_SHED, VIP_F_SRC_HASH, VIP_F_TENANTS,
};

use crate::{
    ablate,
    hdr::{TCP_ACK, TCP_FIN, TCP_RST, TCP_SYN},
    maps::{AFFINITY, BACKENDS, CONNS, FLOOD, MAGLEV_RINGS, VIPS},
    refusal::Refusal,
    stats::{count, HANDSHAKE_COMPLETED, HANDSHAKE_STARTED},
    tenant,
};

const NS_PER_SEC: u64 = 1_000_000_000;

const _: () = assert!(HANDSHAKE_STARTED == CONN_F_HANDSHAKE);

/// What [`decide`] chose for a packet, and what the encapsulation and counters need of it.
pub struct Decision {
    pub backend_id: u32,
    /// The backend's entry in `BACKENDS` (a reference, not a copy: the steering path's stack
    /// is close to the verifier's 512 bytes).
    pub backend: &'static BackendEntry,
    pub new_flow: bool,
    pub hash: u32,
    /// The coarse clock read once per packet (connection ages, next-hop cache).
    pub now: u64,
    /// The index in `MAGLEV_RINGS` of the ring slot that chose the backend, whose history
    /// names the backends a GUE backend may pass on a packet it has no socket for (see
    /// [`second_hops`]); `NO_SLOT` when no slot did (an established flow, affinity, QUIC).
    /// An index, not the addresses: they are read where the tunnel header is written, so no
    /// copy of them lives on the steering path's stack.
    pub slot: u32,
    /// The flow's connection entry when it was found on its backend (for in-band signals
    /// and the handshake's completion).
    pub conn: Option<*mut ConnEntry>,
    /// `HANDSHAKE_STARTED` when this SYN started a handshake on `backend_id`,
    /// `HANDSHAKE_COMPLETED` when this ACK completed one.
    pub handshake: u8,
}

/// Exact (address, port, protocol) first, then, if any VIP takes every port, the address's
/// all-ports VIP.
#[inline(always)]
pub fn vip(key: &FlowKey, cfg: &LbConfig) -> Option<VipMeta> {
    let mut vk = VipKey {
        addr: key.dst,
        port: key.dport,
        proto: key.proto,
        family: key.family,
    };
    if let Some(m) = unsafe { VIPS.get(vk) } {
        return Some(*m);
    }
    if cfg.flags & LB_F_WILDCARD_VIPS == 0 {
        return None;
    }
    vk.port = 0;
    unsafe { VIPS.get(vk) }.copied()
}

#[inline(always)]
fn backend(id: u32, vip: &VipMeta) -> Option<&'static BackendEntry> {
    let b = BACKENDS.get(id)?;
    // A backend id reused for another VIP since the entry was written is not this flow's.
    if b.vip != vip.id {
        return None;
    }
    Some(b)
}

/// Steers one packet of a VIP flow. `track` is false for ICMP errors: they follow a flow
/// but never create one. `opens` is true for a packet that starts a session (a TCP SYN, or
/// any UDP packet without a connection entry): only those are subject to admission
/// control, so an established stream whose entry was evicted is never shed. `tcp` is a TCP
/// packet's flags (0 for an ICMP error or another protocol): the first acknowledgement
/// without SYN or RST of a flow whose SYN was counted completes its handshake, and a FIN or
/// RST marks its entry closed. `server` is the backend a QUIC packet's connection ID
/// names (high word; 0: none) and the hash of that ID (low word), one word so that it costs
/// one stack slot: the backend takes the packet while it takes its flows; otherwise the
/// 5-tuple path does.
#[inline(always)]
pub fn decide(
    key: &FlowKey,
    vip: &VipMeta,
    cfg: &LbConfig,
    server: u64,
    track: bool,
    opens: bool,
    tcp: u8,
) -> Result<Decision, Refusal> {
    // A QUIC packet whose connection ID names a backend that still takes the flows it has
    // (active or draining) goes there, with no connection-table entry.
    let id = (server >> 32) as u32;
    if id != 0 {
        match backend(id, vip) {
            Some(b) if takes(b, false) => {
                count(stat::QUIC_CID_ROUTED);
                return Ok(Decision {
                    backend_id: id,
                    backend: b,
                    new_flow: false,
                    hash: server as u32,
                    now: unsafe { bpf_ktime_get_coarse_ns() },
                    slot: NO_SLOT,
                    conn: None,
                    handshake: 0,
                });
            }
            _ => count(stat::QUIC_SERVER_DOWN),
        }
    }

    // CLOCK_MONOTONIC at tick resolution: a precise read costs ~30 ns per packet here, and
    // connection ages only need seconds.
    let now = unsafe { bpf_ktime_get_coarse_ns() };

    // Second chance: the backends hold TCP's per-flow state, the ring's history finds it.
    let second_chance = vip.flags & VIP_F_SECOND_CHANCE != 0 && key.proto == PROTO_TCP;
    if second_chance {
        count(stat::SECOND_CHANCE_STEERED);
    } else if let Some(e) = CONNS.get_ptr_mut(key) {
        // A SYN on a 5-tuple whose entry outlived its connection (the client reused the
        // port) opens a new session.
        let reopens = opens && track && key.proto == PROTO_TCP;
        if let Some(d) = established(key, vip, e, now, reopens, tcp) {
            count(stat::CONN_HIT);
            return Ok(d);
        }
        if !reopens {
            // Its backend is down (or gone): re-steer to the table's current choice and
            // keep the flow pinned there from now on.
            count(stat::CONN_RESTEER_DOWN);
            return resteer(key, vip, e, now);
        }
        // The stale entry goes, and the SYN is steered as a miss is.
        count(stat::CONN_REOPEN_RESTEER);
        let _ = CONNS.remove(key);
    } else {
        count(stat::CONN_MISS);
    }
    // One call site for every flow steered as new: the verifier sees admission once.
    let mut d = steer_new(key, vip, cfg, now, opens && track)?;
    if !second_chance {
        pin(key, &mut d, cfg, now, track, opens && track);
    }
    Ok(d)
}

/// A flow with no per-flow state here: the ring (and its history) picks the backend, and
/// admission refuses a new session over its tenant's limits (before any class rule: a full
/// pool sheds the tenants over their share first) or of a shedding VIP.
#[inline(always)]
fn steer_new(
    key: &FlowKey,
    vip: &VipMeta,
    cfg: &LbConfig,
    now: u64,
    opens: bool,
) -> Result<Decision, Refusal> {
    let h = steering_hash(key, vip, cfg);
    if opens && vip.flags & VIP_F_TENANTS != 0 && !ablate::NO_TENANTS {
        tenant::admit(key, vip, now)?;
    }
    if opens && vip.flags & VIP_F_SHED != 0 {
        return Err(Refusal::Shed(stat::SHED_PRIORITY));
    }
    let (id, b, slot) = choose(key, vip, h, now, opens)?;
    Ok(Decision {
        backend_id: id,
        backend: b,
        new_flow: opens,
        hash: h,
        now,
        slot,
        conn: None,
        handshake: 0,
    })
}

/// The connection entry's backend, while it still takes the flow. The entry brings a
/// reopening SYN its old backend as an affinity entry would, only while that backend keeps
/// its clients: one draining, moved away or down gets no new session from a stale entry. (A
/// retransmitted SYN whose backend left meanwhile moves too; its half-open connection there
/// times out.) On a VIP that refuses new sessions (tenant limits, class shedding) a SYN on an
/// entry whose handshake completed is steered as a miss, through admission: it opens the
/// client's next session, and a stale entry must not let it skip the limits.
#[inline(always)]
fn established(
    key: &FlowKey,
    vip: &VipMeta,
    e: *mut ConnEntry,
    now: u64,
    reopens: bool,
    tcp: u8,
) -> Option<Decision> {
    let id = unsafe { (*e).backend };
    let b = backend(id, vip)?;
    let flags = unsafe { (*e).flags };
    let pending = flags & CONN_F_HANDSHAKE;
    if !takes(b, false) || (reopens && !keeps_affinity(b, true)) {
        return None;
    }
    if reopens && pending == 0 && vip.flags & (VIP_F_TENANTS | VIP_F_SHED) != 0 {
        return None;
    }
    // The coarse clock moves once a tick: most packets leave the line clean.
    unsafe {
        if (*e).last_seen_ns != now {
            // Once a second per flow: the affinity window counts from the client's last
            // packet, not its last new session, so a conversation's next turn, a think time
            // after a long answer, still finds its entry.
            if vip.affinity_secs != 0 && (*e).last_seen_ns / NS_PER_SEC != now / NS_PER_SEC {
                refresh_affinity(key, vip, id, now);
            }
            (*e).last_seen_ns = now;
        }
    }
    // A SYN on an entry whose handshake is pending is a retransmission: the handshake
    // counts once. One on a completed entry starts a new one. The first ACK completes it.
    // Toggling the bit: `HANDSHAKE_STARTED` is `CONN_F_HANDSHAKE`. A client's FIN or RST
    // closes the entry, a reopening SYN opens it again. Both bits are computed and written
    // at once, so the entry's state adds one branch (the write) and every later packet of a
    // settled flow pays a compare of the entry it already read; a branch per flag would
    // split the verifier's paths through everything after it (docs/design.md, "The
    // verifier's budget").
    let handshake = if reopens {
        pending ^ HANDSHAKE_STARTED
    } else if pending != 0 && tcp & (TCP_SYN | TCP_RST | TCP_ACK) == TCP_ACK {
        HANDSHAKE_COMPLETED
    } else {
        0
    };
    let toggle = if handshake != 0 { CONN_F_HANDSHAKE } else { 0 };
    let open = if reopens { CONN_F_CLOSED } else { 0 };
    let closes = if tcp & (TCP_FIN | TCP_RST) != 0 {
        CONN_F_CLOSED
    } else {
        0
    };
    let next = ((flags ^ toggle) & !open) | closes;
    if next != flags {
        unsafe { (*e).flags = next };
    }
    Some(Decision {
        backend_id: id,
        backend: b,
        new_flow: false,
        hash: unsafe { (*e).hash },
        now,
        slot: NO_SLOT,
        conn: Some(e),
        handshake,
    })
}

/// An entry whose backend is down or gone: the flow moves to the ring's current choice and
/// its entry follows.
#[inline(always)]
fn resteer(key: &FlowKey, vip: &VipMeta, e: *mut ConnEntry, now: u64) -> Result<Decision, Refusal> {
    let h = unsafe { (*e).hash };
    let (id, b, slot) = choose(key, vip, h, now, false)?;
    unsafe {
        (*e).backend = id;
        (*e).last_seen_ns = now;
        // The new backend never saw the SYN: its ACK completes nothing there.
        (*e).flags = 0;
    }
    Ok(Decision {
        backend_id: id,
        backend: b,
        new_flow: true,
        hash: h,
        now,
        slot,
        conn: None,
        handshake: 0,
    })
}

/// A flow without an entry in table mode, steered as new: pinned by an entry unless it is an
/// ICMP error (`track` false) or the flood guard bypasses the table.
#[inline(always)]
fn pin(key: &FlowKey, d: &mut Decision, cfg: &LbConfig, now: u64, track: bool, opens: bool) {
    // New to the table even when it opens no session (an entry evicted mid-stream).
    d.new_flow = true;
    if !track {
        // Nothing to pin.
    } else if flood_guard(cfg, now) {
        count(stat::FLOOD_BYPASS);
    } else {
        // Only a flow with an entry can tell its SYN's retransmission and its first ACK
        // apart: a handshake counts where the entry is made.
        if opens && key.proto == PROTO_TCP {
            d.handshake = HANDSHAKE_STARTED;
        }
        let e = ConnEntry {
            backend: d.backend_id,
            hash: d.hash,
            last_seen_ns: now,
            inband: InbandFlow::default(),
            // The same bit: a started handshake is pending until the flow's first ACK.
            flags: d.handshake,
            _pad: [0; 3],
        };
        // An LRU insert evicts rather than fails: the kernel refuses one only when this CPU
        // already holds the bucket's lock (-EBUSY, a tracing program re-entering the map),
        // which no packet can cause. The flow then follows the ring, as a bypassed one does.
        if !ablate::NO_INSERT {
            let _ = CONNS.insert(key, e, 0);
        }
    }
}

#[inline(always)]
fn steering_hash(key: &FlowKey, vip: &VipMeta, cfg: &LbConfig) -> u32 {
    if ablate::NO_HASH {
        cfg.hash_seed
    } else if vip.flags & VIP_F_SRC_HASH != 0 {
        hash::src_hash(key, cfg.hash_seed)
    } else {
        hash::flow_hash(key, cfg.hash_seed)
    }
}

/// A backend takes this flow: for a new session, it is active and not at its cap; for a
/// packet of a session under way, it is active or draining (a draining backend keeps its
/// sessions, and the ring may still name it while its drain is being published).
#[inline(always)]
fn takes(b: &BackendEntry, new_session: bool) -> bool {
    if new_session {
        b.state == BACKEND_ACTIVE && b.flags & BACKEND_F_FULL == 0
    } else {
        b.state == BACKEND_ACTIVE || b.state == BACKEND_DRAINING
    }
}

/// A client's affinity entry brings its backend this flow: for a new session, the backend is
/// active and not at the operator's cap, full by saturation or not (the conversation's next
/// turn finds its prefix cached there; busy steers new clients away, not the next turn); and
/// it is not flagged `BACKEND_F_NO_AFFINITY` (one moved away for a fault or at weight 0 keeps
/// its sessions, not its clients).
#[inline(always)]
fn keeps_affinity(b: &BackendEntry, new_session: bool) -> bool {
    let open = if new_session {
        b.state == BACKEND_ACTIVE && b.flags & BACKEND_F_CAPPED == 0
    } else {
        takes(b, false)
    };
    open && b.flags & BACKEND_F_NO_AFFINITY == 0
}

/// A backend for a flow without one: the client's affinity entry while it is fresh and its
/// backend keeps it ([`keeps_affinity`]), otherwise the first of the flow's probe positions
/// in the live ring whose backend takes it, with the slot's previous backends for a GUE
/// backend (see [`second_hops`]). A new session finding only full backends is shed where the
/// VIP has admission control, and otherwise goes to the first active one (full is a
/// preference, not a refusal, there).
#[inline(always)]
fn choose(
    key: &FlowKey,
    vip: &VipMeta,
    h: u32,
    now: u64,
    new_session: bool,
) -> Result<(u32, &'static BackendEntry, u32), Refusal> {
    let akey = AffinityKey {
        addr: key.src,
        vip: vip.id,
    };
    if vip.affinity_secs != 0 {
        if let Some(a) = unsafe { AFFINITY.get(akey) } {
            if now.wrapping_sub(a.last_seen_ns) < vip.affinity_secs as u64 * NS_PER_SEC {
                if let Some(b) = backend(a.backend, vip) {
                    if keeps_affinity(b, new_session) {
                        count(stat::AFFINITY_HIT);
                        if new_session && b.flags & BACKEND_F_FULL != 0 {
                            count(stat::AFFINITY_HIT_SATURATED);
                        }
                        let id = a.backend;
                        remember(&akey, id, now);
                        return Ok((id, b, NO_SLOT));
                    }
                }
            }
        }
    }
    let ring_size = vip.ring_size;
    if !(2..=RING_SIZE_MAX).contains(&ring_size) {
        return Err(stat::DROP_NO_BACKEND.into());
    }
    // The backend that takes the flow, or else the first active (so full) one probed past,
    // with its ring slot's index. One exit reads the slot's history and computes the second
    // hops: the verifier sees that code once, and no history array lives across the probes.
    // The full one is kept in plain integers (id 0: none), not an `Option` of a pair: LLVM
    // selects between the old and new pair on every probe, reading the payload of a `None`,
    // whose stack slot another path may have left a pointer in, which the verifier refuses.
    let mut taken: Option<(u32, &'static BackendEntry, u32)> = None;
    let (mut full_id, mut full_index) = (0u32, 0u32);
    let base = (vip.id * RINGS_PER_VIP + (vip.active_ring & 1)) * RING_SIZE_MAX;
    for i in 0..MAX_PROBES {
        let slot = hash::probe_slot(h, i, ring_size);
        let index = base + slot;
        let id = match MAGLEV_RINGS.get(index) {
            Some(s) if s.backend != 0 => s.backend as u32,
            _ => return Err(stat::DROP_NO_BACKEND.into()),
        };
        match backend(id, vip) {
            Some(b) if takes(b, new_session) => {
                taken = Some((id, b, index));
                break;
            }
            Some(b) => {
                if b.state == BACKEND_ACTIVE && full_id == 0 {
                    (full_id, full_index) = (id, index);
                }
                count(stat::PROBE_SKIP);
            }
            None => count(stat::PROBE_SKIP),
        }
    }
    let (id, b, index) = match taken {
        Some(t) => t,
        None => {
            if full_id == 0 {
                return Err(stat::DROP_NO_BACKEND.into());
            }
            if vip.flags & VIP_F_ADMISSION != 0 {
                return Err(Refusal::Shed(stat::SHED_FULL));
            }
            let b = backend(full_id, vip).ok_or(stat::DROP_NO_BACKEND)?;
            count(stat::FULL_FALLBACK);
            (full_id, b, full_index)
        }
    };
    if vip.affinity_secs != 0 {
        remember(&akey, id, now);
    }
    Ok((id, b, index))
}

/// The addresses of the previous owners of a flow's slot that a GUE backend may pass it on
/// to, most recent first, the named ones before any all-zero one. Addresses, not pointers
/// to the backends' entries: a slot holding a pointer or none would be a different state
/// for the verifier on every path through the encapsulation, three slots eight of them.
pub type SecondHops = [[u32; 4]; RING_HISTORY];
pub const NO_SECOND_HOPS: SecondHops = [[0; 4]; RING_HISTORY];
/// `Decision::slot` when no ring slot chose the backend.
pub const NO_SLOT: u32 = u32::MAX;

/// The previous backends of ring slot `slot` (most recent first) that a GUE backend `b` may
/// pass the flow on to: those that still serve this VIP (active or draining), also run the
/// backend program and have `b`'s address family (they are reached with the same outer
/// header). The others are left out, so the tunnel names only hops worth taking.
#[inline(always)]
pub fn second_hops(b: &BackendEntry, slot: u32) -> SecondHops {
    let mut out = NO_SECOND_HOPS;
    let mut named = 0;
    if b.flags & BACKEND_F_GUE == 0 || slot == NO_SLOT || ablate::NO_HISTORY {
        return out;
    }
    let Some(s) = MAGLEV_RINGS.get(slot) else {
        return out;
    };
    let previous = s.previous;
    for id in previous {
        if id == 0 {
            // The history lists its owners first: nothing follows an unset one.
            break;
        }
        let Some(p) = BACKENDS.get(id as u32) else {
            continue;
        };
        let serves = p.state == BACKEND_ACTIVE || p.state == BACKEND_DRAINING;
        if p.vip != b.vip || !serves || p.flags & BACKEND_F_GUE == 0 || p.family != b.family {
            continue;
        }
        // Constant indexes: the verifier sees three stack slots, not a computed one.
        if named == 0 {
            out[0] = p.addr;
        } else if named == 1 {
            out[1] = p.addr;
        } else {
            out[2] = p.addr;
        }
        named += 1;
    }
    out
}

/// Keeps the client's affinity entry fresh while a flow to the entry's backend is live; an
/// entry naming another backend (the client's newer session went elsewhere) is left alone.
#[inline(always)]
fn refresh_affinity(key: &FlowKey, vip: &VipMeta, id: u32, now: u64) {
    let akey = AffinityKey {
        addr: key.src,
        vip: vip.id,
    };
    if let Some(a) = AFFINITY.get_ptr_mut(akey) {
        unsafe {
            if (*a).backend == id {
                (*a).last_seen_ns = now;
            }
        }
    }
}

#[inline(always)]
fn remember(akey: &AffinityKey, backend: u32, now: u64) {
    let _ = AFFINITY.insert(
        akey,
        AffinityEntry {
            backend,
            _pad: 0,
            last_seen_ns: now,
        },
        0,
    );
}

/// True when this CPU has seen more new flows in the current second than the configured
/// limit: such flows are steered by hash alone so a SYN flood cannot evict live entries.
#[inline(always)]
fn flood_guard(cfg: &LbConfig, now: u64) -> bool {
    if cfg.flood_new_flows_per_sec == 0 {
        return false;
    }
    let Some(w) = FLOOD.get_ptr_mut(0) else {
        return false;
    };
    unsafe {
        if now.wrapping_sub((*w).start_ns) >= NS_PER_SEC {
            (*w).start_ns = now;
            (*w).new_flows = 0;
        }
        (*w).new_flows += 1;
        (*w).new_flows > cfg.flood_new_flows_per_sec as u64
    }
}
