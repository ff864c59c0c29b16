//! The tenant maps of a loaded data plane, written and read straight from a test: a test
//! plays the controller (prefixes, limits with its flags) and reads what the data plane
//! counted and left in the rate buckets.

use std::net::IpAddr;

use anyhow::{anyhow, Context, Result};
use aya::maps::{
    lpm_trie::{Key, LpmTrie},
    Array, Map, MapData, MapInfo, PerCpuArray,
};
use lb_common::{
    maps, tenant_index, TenantBucket, TenantLimits, TenantPrefix, TenantStats,
    TENANT_PREFIX_FAMILY_BITS,
};
use sluice::{
    addr::to_words,
    dataplane::{Dataplane, PROG_XDP},
};

/// The four tenant maps of one data plane.
pub struct TenantMaps {
    prefixes: LpmTrie<MapData, TenantPrefix, u32>,
    limits: Array<MapData, TenantLimits>,
    buckets: Array<MapData, TenantBucket>,
    stats: PerCpuArray<MapData, TenantStats>,
}

impl TenantMaps {
    /// Opens the tenant maps `sluice_xdp` of `dp` uses, by the map ids the kernel lists for
    /// the program (the `Dataplane` keeps its map handles to itself).
    pub fn open(dp: &mut Dataplane) -> Result<TenantMaps> {
        let ids = dp
            .program(PROG_XDP)?
            .info()?
            .map_ids()?
            .context("the kernel lists no map ids of the program")?;
        let find = |name: &str| -> Result<Map> {
            for id in &ids {
                if MapInfo::from_id(*id)?.name_as_str() == Some(name) {
                    return Ok(Map::from_map_data(MapData::from_id(*id)?)?);
                }
            }
            Err(anyhow!("{PROG_XDP} uses no map named {name}"))
        };
        Ok(TenantMaps {
            prefixes: LpmTrie::try_from(find(maps::TENANT_PREFIXES)?)?,
            limits: Array::try_from(find(maps::TENANT_LIMITS)?)?,
            buckets: Array::try_from(find(maps::TENANT_BUCKETS)?)?,
            stats: PerCpuArray::try_from(find(maps::TENANT_STATS)?)?,
        })
    }

    /// Gives the clients of `cidr` (`"10.0.2.0/24"`, `"2001:db8::/32"`) to `tenant`.
    pub fn set_prefix(&mut self, cidr: &str, tenant: u32) -> Result<()> {
        self.prefixes
            .insert(&prefix_key(cidr)?, tenant, 0)
            .with_context(|| format!("writing prefix {cidr}"))
    }

    pub fn set_limits(&mut self, vip: u32, tenant: u32, limits: TenantLimits) -> Result<()> {
        Ok(self.limits.set(tenant_index(vip, tenant), limits, 0)?)
    }

    pub fn bucket(&self, vip: u32, tenant: u32) -> Result<u64> {
        Ok(self.buckets.get(&tenant_index(vip, tenant), 0)?.tat_ns)
    }

    pub fn set_bucket(&mut self, vip: u32, tenant: u32, tat_ns: u64) -> Result<()> {
        Ok(self
            .buckets
            .set(tenant_index(vip, tenant), TenantBucket { tat_ns }, 0)?)
    }

    /// A tenant's counters on a VIP, summed over the CPUs.
    pub fn stats(&self, vip: u32, tenant: u32) -> Result<TenantStats> {
        let v = self.stats.get(&tenant_index(vip, tenant), 0)?;
        Ok(v.iter()
            .fold(TenantStats::default(), |acc, s| acc.merged(s)))
    }
}

/// The `TENANT_PREFIXES` key of a CIDR: the family's 32 bits, then the prefix's own.
pub fn prefix_key(cidr: &str) -> Result<Key<TenantPrefix>> {
    let (addr, len) = cidr
        .split_once('/')
        .with_context(|| format!("{cidr:?} is not a CIDR"))?;
    let addr: IpAddr = addr.parse().with_context(|| format!("address of {cidr}"))?;
    let len: u32 = len.parse().with_context(|| format!("length of {cidr}"))?;
    let (words, family) = to_words(addr);
    Ok(Key::new(
        TENANT_PREFIX_FAMILY_BITS + len,
        TenantPrefix {
            family,
            _pad: [0; 3],
            addr: words,
        },
    ))
}

/// The data plane's clock, `bpf_ktime_get_coarse_ns`: CLOCK_MONOTONIC_COARSE.
pub fn coarse_now_ns() -> u64 {
    let mut ts = libc::timespec {
        tv_sec: 0,
        tv_nsec: 0,
    };
    let rc = unsafe { libc::clock_gettime(libc::CLOCK_MONOTONIC_COARSE, &mut ts) };
    assert_eq!(rc, 0, "clock_gettime(CLOCK_MONOTONIC_COARSE)");
    ts.tv_sec as u64 * 1_000_000_000 + ts.tv_nsec as u64
}
