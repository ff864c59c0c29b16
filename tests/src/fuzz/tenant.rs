//! Tenants in the fuzz lab, and the oracle's model of them: which client prefix names which
//! tenant (longest prefix, read by the oracle's own matcher), each tenant's limits per VIP,
//! and a GCRA bucket kept apart from the data plane's for each rate.
//!
//! For every frame: at most one tenant counter moves, by one, and only for a packet that
//! opens a session (a UDP packet, or a TCP SYN without ACK; not an ICMP error) on a VIP with
//! tenants that reached the connection table's miss path (a TCP SYN on an entry whose
//! handshake had completed, the client's next session on the same 5-tuple, is steered as a
//! miss there); should such a SYN ever be steered by its entry (the oracle reads the entry
//! before the frame), it must still pass the limits; every such packet moves exactly
//! one, of the tenant the oracle matches, for the reason its limits give (capped, then over
//! share, then the rate, else admitted). A refusal is counted under its own `shed_tenant_*`
//! counter and ends in a RST (TCP on a VIP shedding by RST) or `drop_shed`; an admitted
//! session never does. A refused session leaves its bucket alone. The counters of the
//! frame's own tenant are read after each new session; all of them are compared with the
//! oracle's every [`AUDIT_FRAMES`] frames, which catches a counter moved by any other frame.

use std::{collections::BTreeMap, net::IpAddr};

use anyhow::{ensure, Result};
use lb_common::{
    stat, FlowKey, TenantLimits, TenantStats, CONN_F_HANDSHAKE, PROTO_TCP, PROTO_UDP,
    TENANT_F_CAPPED, TENANT_F_OVER_SHARE,
};

use super::{oracle::l3_start, Vip};
use crate::{
    flow,
    frames::{ETH_IP, ETH_IPV6},
    tenants::TenantMaps,
    Lab,
};

const NS: u64 = 1_000_000_000;
/// Frames between two comparisons of every tenant counter with the oracle's.
pub(super) const AUDIT_FRAMES: u64 = 64;

/// Client prefixes and their tenants: the generator's clients 192.0.2.10 and 2001:db8:c::10
/// and ::11 are tenant 1, 192.0.2.11 (a /32 inside tenant 1's /24) and 198.51.100.7 tenant
/// 2, 2001:db8:d::1 tenant 3, the others the default tenant 0. Written as the controller
/// writes them, so 192.0.2.0/24 is left to the trie and the other IPv4 clients' /24s are
/// answered by the IPv4 table.
const PREFIXES: [(&str, u32); 5] = [
    ("192.0.2.0/24", 1),
    ("192.0.2.11/32", 2),
    ("198.51.100.0/22", 2),
    ("2001:db8:c::/48", 1),
    ("2001:db8:d::/48", 3),
];

/// What a tenant's limits on a VIP say about its next new session.
#[derive(Clone, Copy, Debug)]
enum Limit {
    Capped,
    OverShare,
    /// New sessions a second and burst.
    Rate(u64, u64),
}

/// The limits of the lab's tenants: (VIP id, tenant, limit). VIP 0 (IPv4 TCP, refusing by
/// RST), 1 (IPv4 UDP), 2 (IPv6 TCP, refusing by drop), 4 (all ports) and 6 (shedding every
/// new session by RST: a tenant over its limit is refused for it first) have tenants.
/// Rates are low enough that the generator runs past them and high enough that buckets
/// refill during a run.
const LIMITS: [(u32, u32, Limit); 7] = [
    (0, 1, Limit::Capped),
    (0, 2, Limit::Rate(200, 3)),
    (1, 1, Limit::Rate(100, 2)),
    (2, 1, Limit::OverShare),
    (2, 3, Limit::Rate(50, 1)),
    (4, 0, Limit::OverShare),
    (6, 1, Limit::Capped),
];

/// The VIPs with tenants (`VIP_F_TENANTS`).
pub(super) const TENANT_VIPS: [u32; 5] = [0, 1, 2, 4, 6];
const TENANTS: u32 = 4;

/// The lab's tenants as written to the maps, and the oracle's model of them.
pub(super) struct Tenants {
    maps: TenantMaps,
    prefixes: Vec<(IpAddr, u32, u32)>,
    /// The theoretical arrival time of each rate-limited (VIP, tenant)'s next session.
    tat: BTreeMap<(u32, u32), u64>,
    /// What each (VIP, tenant)'s counters must hold.
    stats: BTreeMap<(u32, u32), TenantStats>,
    /// The frame about to run is a TCP SYN on a connection entry whose handshake completed.
    syn_on_finished_entry: bool,
}

impl Tenants {
    pub(super) fn setup(lab: &mut Lab) -> Result<Tenants> {
        let mut prefixes = vec![];
        let mut written = BTreeMap::new();
        for (cidr, tenant) in PREFIXES {
            written.insert(cidr.parse()?, tenant);
            let (a, len) = cidr.split_once('/').unwrap();
            prefixes.push((a.parse()?, len.parse()?, tenant));
        }
        lab.dp.sync_tenants(&written, &BTreeMap::new(), &[])?;
        let mut maps = TenantMaps::open(&mut lab.dp)?;
        let mut tat = BTreeMap::new();
        for (vip, tenant, limit) in LIMITS {
            let l = match limit {
                Limit::Capped => TenantLimits {
                    flags: TENANT_F_CAPPED,
                    ..Default::default()
                },
                Limit::OverShare => TenantLimits {
                    flags: TENANT_F_OVER_SHARE,
                    ..Default::default()
                },
                Limit::Rate(per_sec, burst) => {
                    tat.insert((vip, tenant), 0);
                    TenantLimits {
                        interval_ns: NS / per_sec,
                        burst_ns: burst * (NS / per_sec),
                        ..Default::default()
                    }
                }
            };
            maps.set_limits(vip, tenant, l)?;
        }
        let mut t = Tenants {
            maps,
            prefixes,
            tat,
            stats: BTreeMap::new(),
            syn_on_finished_entry: false,
        };
        t.stats = t.read_stats()?;
        Ok(t)
    }

    fn read_stats(&self) -> Result<BTreeMap<(u32, u32), TenantStats>> {
        let mut m = BTreeMap::new();
        for vip in TENANT_VIPS {
            for tenant in 0..TENANTS {
                m.insert((vip, tenant), self.maps.stats(vip, tenant)?);
            }
        }
        Ok(m)
    }

    /// The tenant of a client: its longest matching prefix of the same family, else 0.
    fn tenant_of(&self, client: IpAddr) -> u32 {
        self.prefixes
            .iter()
            .filter(|(net, len, _)| same_prefix(*net, client, *len))
            .max_by_key(|(_, len, _)| *len)
            .map_or(0, |(_, _, t)| *t)
    }

    /// Every tenant counter holds what the oracle expects.
    pub(super) fn audit(&self) -> Result<()> {
        let held = self.read_stats()?;
        let wrong: Vec<_> = held
            .iter()
            .filter(|(k, v)| self.stats[*k] != **v)
            .map(|(k, v)| (k, v, self.stats[k]))
            .collect();
        ensure!(
            wrong.is_empty(),
            "tenant counters ((VIP, tenant), held, expected) differ: {wrong:?}"
        );
        Ok(())
    }

    /// Reads what the oracle needs before `frame` runs: the connection entry of a TCP SYN to
    /// a VIP with tenants.
    pub(super) fn before(&mut self, lab: &mut Lab, vips: &[Vip], frame: &[u8]) -> Result<()> {
        self.syn_on_finished_entry = match opening(vips, frame) {
            Some(o) if o.tcp => lab
                .dp
                .conn(&o.key)?
                .is_some_and(|e| e.flags & CONN_F_HANDSHAKE == 0),
            _ => false,
        };
        Ok(())
    }

    /// The oracle for one frame, sent to the program between coarse-clock reads `t0` and
    /// `t1`; `delta` is how the `stat` counters moved.
    pub(super) fn check(
        &mut self,
        vips: &[Vip],
        frame: &[u8],
        delta: &[u64],
        t0: u64,
        t1: u64,
    ) -> Result<()> {
        let shed = [
            delta[stat::SHED_TENANT_SESSIONS.index()],
            delta[stat::SHED_TENANT_SHARE.index()],
            delta[stat::SHED_TENANT_RATE.index()],
        ];
        let missed = delta[stat::CONN_MISS.index()] + delta[stat::CONN_REOPEN_RESTEER.index()];
        let reopened = self.syn_on_finished_entry && delta[stat::CONN_HIT.index()] != 0;
        let expect = match opening(vips, frame) {
            Some(o) if missed != 0 || reopened => Some((o.vip, self.tenant_of(o.client), o.tcp)),
            _ => None,
        };
        let Some((vip, tenant, tcp)) = expect else {
            ensure!(
                shed == [0; 3],
                "shed_tenant_* counters moved for a packet that opens no session on a VIP \
                 with tenants: {shed:?}"
            );
            return Ok(());
        };
        // 0 admitted, then the refusal reasons in `TenantStats`' order.
        let reason = match LIMITS
            .iter()
            .find(|(v, t, _)| (*v, *t) == (vip.id, tenant))
            .map(|l| l.2)
        {
            None => 0,
            Some(Limit::Capped) => 1,
            Some(Limit::OverShare) => 2,
            Some(Limit::Rate(per_sec, burst)) => {
                self.rate(vip.id, tenant, per_sec, burst, t0, t1)?
            }
        };
        let key = (vip.id, tenant);
        let mut want = self.stats[&key];
        *[
            &mut want.admitted,
            &mut want.refused_sessions,
            &mut want.refused_share,
            &mut want.refused_rate,
        ][reason] += 1;
        let held = self.maps.stats(vip.id, tenant)?;
        ensure!(
            held == want,
            "a new session of tenant {tenant} on VIP {}: its counters hold {held:?}, expected \
             {want:?}",
            vip.id
        );
        self.stats.insert(key, want);
        let mut want_shed = [0u64; 3];
        if reason != 0 {
            want_shed[reason - 1] = 1;
        }
        ensure!(
            shed == want_shed,
            "shed_tenant_* counters moved {shed:?}, expected {want_shed:?}"
        );
        let (rst, dropped) = (
            delta[stat::SHED_RST_SENT.index()],
            delta[stat::DROP_SHED.index()],
        );
        if reason != 0 {
            // The RST needs a TCP segment to answer and a VIP shedding by RST.
            ensure!(
                rst + dropped == 1 && (rst == 0 || (tcp && vip.shed_rst)),
                "a refused session ends in a RST ({rst}) or drop_shed ({dropped})"
            );
        }
        Ok(())
    }

    /// GCRA for a session of a rate-limited tenant arriving between `t0` and `t1`: whether it
    /// is refused (3) or admitted (0), where the clock's tick left both possible the
    /// program's choice, and the bucket it must leave.
    fn rate(
        &mut self,
        vip: u32,
        tenant: u32,
        per_sec: u64,
        burst: u64,
        t0: u64,
        t1: u64,
    ) -> Result<usize> {
        let (interval, burst_ns) = (NS / per_sec, burst * (NS / per_sec));
        let tat = self.tat[&(vip, tenant)];
        let admits = |now: u64| tat.max(now) + interval - now <= burst_ns;
        let bucket = self.maps.bucket(vip, tenant)?;
        // Later is never worse: admitted at t0 means admitted, refused at t1 refused.
        let admitted = if admits(t0) {
            true
        } else if !admits(t1) {
            false
        } else {
            bucket != tat
        };
        if admitted {
            let (lo, hi) = (tat.max(t0) + interval, tat.max(t1) + interval);
            ensure!(
                (lo..=hi).contains(&bucket),
                "an admitted session left the bucket at {bucket}, expected {lo}..={hi}"
            );
            self.tat.insert((vip, tenant), bucket);
            Ok(0)
        } else {
            ensure!(
                bucket == tat,
                "a refused session moved the bucket from {tat} to {bucket}"
            );
            Ok(3)
        }
    }
}

/// Whether the first `len` bits of `a` and `b` agree (the same family only).
fn same_prefix(a: IpAddr, b: IpAddr, len: u32) -> bool {
    let (a, b, bits) = match (a, b) {
        (IpAddr::V4(a), IpAddr::V4(b)) => (u32::from(a) as u128, u32::from(b) as u128, 32),
        (IpAddr::V6(a), IpAddr::V6(b)) => (u128::from(a), u128::from(b), 128),
        _ => return false,
    };
    len == 0 || (a ^ b) >> (bits - len) == 0
}

/// A frame that opens a session on a VIP with tenants, as the oracle reads it.
struct Opening<'a> {
    vip: &'a Vip,
    client: IpAddr,
    tcp: bool,
    key: FlowKey,
}

/// For a frame that opens a session (a UDP datagram, or a TCP segment with SYN and without
/// ACK, not a fragment) to a VIP with tenants: that VIP, the client, whether it is TCP and
/// its flow key. Read by the oracle's own parser, which walks IPv4 options and the IPv6
/// extension headers that carry no fragment; `None` for every other frame.
fn opening<'a>(vips: &'a [Vip], frame: &[u8]) -> Option<Opening<'a>> {
    let (l3, ty) = l3_start(frame)?;
    let h = frame.get(l3..)?;
    let (src, dst, mut next, mut l4) = match ty {
        ETH_IP if h.len() >= 20 && h[0] >> 4 == 4 => {
            if u16::from_be_bytes([h[6], h[7]]) & 0x3fff != 0 {
                return None;
            }
            let src: [u8; 4] = h[12..16].try_into().unwrap();
            let dst: [u8; 4] = h[16..20].try_into().unwrap();
            (
                IpAddr::from(src),
                IpAddr::from(dst),
                h[9],
                4 * (h[0] & 0x0f) as usize,
            )
        }
        ETH_IPV6 if h.len() >= 40 && h[0] >> 4 == 6 => {
            let src: [u8; 16] = h[8..24].try_into().unwrap();
            let dst: [u8; 16] = h[24..40].try_into().unwrap();
            (IpAddr::from(src), IpAddr::from(dst), h[6], 40)
        }
        _ => return None,
    };
    if ty == ETH_IPV6 {
        // Hop-by-hop, routing, destination options (8-octet units) and AH (4-octet units).
        for _ in 0..8 {
            let len = match next {
                0 | 43 | 60 => (*h.get(l4 + 1)? as usize + 1) * 8,
                51 => (*h.get(l4 + 1)? as usize + 2) * 4,
                _ => break,
            };
            next = *h.get(l4)?;
            l4 += len;
        }
    }
    let sport = u16::from_be_bytes(h.get(l4..l4 + 2)?.try_into().ok()?);
    let dport = u16::from_be_bytes(h.get(l4 + 2..l4 + 4)?.try_into().ok()?);
    let opens = match next {
        PROTO_UDP => true,
        PROTO_TCP => h.get(l4 + 13)? & 0x12 == 0x02,
        _ => false,
    };
    if !opens {
        return None;
    }
    let at = |port: u16| {
        vips.iter()
            .find(|v| v.addr == dst && v.proto == next && v.port == port)
    };
    let vip = at(dport).or_else(|| at(0))?;
    vip.tenants.then(|| Opening {
        vip,
        client: src,
        tcp: next == PROTO_TCP,
        key: flow(&src.to_string(), sport, &dst.to_string(), dport, next),
    })
}
