//! Tenant limits on new sessions: the client's tenant by longest prefix, then its limits on
//! the VIP (the controller's session and share flags, and a rate checked here).
//!
//! An IPv4 client's tenant is first read from its /24's byte in `TENANT_V4`; only where a
//! longer prefix lies inside that /24 (byte 0) is the trie walked, as it is for IPv6.

use aya_ebpf::btf_maps::lpm_trie::Key;
use lb_common::{
    stat, tenant_index, tenant_v4_slot, FlowKey, TenantPrefix, VipMeta, FAMILY_V4, TENANT_F_CAPPED,
    TENANT_F_OVER_SHARE, TENANT_PREFIX_FAMILY_BITS, TENANT_V4_ASK_TRIE,
};

use crate::{
    maps::{TENANT_BUCKETS, TENANT_LIMITS, TENANT_PREFIXES, TENANT_STATS, TENANT_V4},
    refusal::Refusal,
};

/// Admits or refuses a new session of `vip` from `key.src`'s tenant, and counts it.
#[inline(always)]
pub fn admit(key: &FlowKey, vip: &VipMeta, now: u64) -> Result<(), Refusal> {
    let tenant = tenant_of(key);
    let index = tenant_index(vip.id, tenant);
    let Some(stats) = TENANT_STATS.get_ptr_mut(index) else {
        return Ok(());
    };
    let Some(limits) = TENANT_LIMITS.get(index) else {
        return Ok(());
    };
    // The controller's flags first: a refused session takes no token from the rate.
    if limits.flags & TENANT_F_CAPPED != 0 {
        unsafe { (*stats).refused_sessions += 1 };
        return Err(Refusal::Shed(stat::SHED_TENANT_SESSIONS));
    }
    if limits.flags & TENANT_F_OVER_SHARE != 0 {
        unsafe { (*stats).refused_share += 1 };
        return Err(Refusal::Shed(stat::SHED_TENANT_SHARE));
    }
    if limits.interval_ns != 0 {
        if let Some(bucket) = TENANT_BUCKETS.get_ptr_mut(index) {
            // GCRA: the session conforms while the theoretical arrival time after it stays
            // within the burst ahead of now.
            let tat = unsafe { (*bucket).tat_ns }.max(now) + limits.interval_ns;
            if tat - now > limits.burst_ns {
                unsafe { (*stats).refused_rate += 1 };
                return Err(Refusal::Shed(stat::SHED_TENANT_RATE));
            }
            unsafe { (*bucket).tat_ns = tat };
        }
    }
    unsafe { (*stats).admitted += 1 };
    Ok(())
}

/// The tenant of `key.src`: its /24's byte for an IPv4 client where that answers, else the
/// trie's longest prefix (tenant 0 where none matches). One trie call site, so the verifier
/// walks the lookup once.
#[inline(always)]
fn tenant_of(key: &FlowKey) -> u32 {
    let v4 = key.family == FAMILY_V4;
    let mut direct = TENANT_V4_ASK_TRIE as u32;
    if v4 {
        let (word, shift) = tenant_v4_slot(u32::from_be(key.src[0]));
        if let Some(w) = TENANT_V4.get(word) {
            direct = (*w >> shift) as u32 & 0xff;
        }
    }
    if direct != TENANT_V4_ASK_TRIE as u32 {
        return direct - 1;
    }
    let prefix = Key::new(
        TENANT_PREFIX_FAMILY_BITS + if v4 { 32 } else { 128 },
        TenantPrefix {
            family: key.family,
            _pad: [0; 3],
            addr: key.src,
        },
    );
    TENANT_PREFIXES.get(&prefix).copied().unwrap_or(0)
}
