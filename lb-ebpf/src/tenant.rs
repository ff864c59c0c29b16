//! Tenant limits on new sessions: the client's tenant by longest prefix, then its limits on
//! the VIP (the controller's session and share flags, and a rate checked here).

use aya_ebpf::btf_maps::lpm_trie::Key;
use lb_common::{
    stat, FlowKey, TenantPrefix, VipMeta, MAX_TENANTS, TENANT_F_CAPPED, TENANT_F_OVER_SHARE,
    TENANT_PREFIX_FAMILY_BITS,
};

use crate::{
    maps::{TENANT_BUCKETS, TENANT_LIMITS, TENANT_PREFIXES, TENANT_STATS},
    refusal::Refusal,
};

/// Admits or refuses a new session of `vip` from `key.src`'s tenant, and counts it.
#[inline(always)]
pub fn admit(key: &FlowKey, vip: &VipMeta, now: u64) -> Result<(), Refusal> {
    let prefix = Key::new(
        TENANT_PREFIX_FAMILY_BITS
            + if key.family == lb_common::FAMILY_V4 {
                32
            } else {
                128
            },
        TenantPrefix {
            family: key.family,
            _pad: [0; 3],
            addr: key.src,
        },
    );
    let tenant = TENANT_PREFIXES.get(&prefix).copied().unwrap_or(0);
    let index = vip.id * MAX_TENANTS + (tenant & (MAX_TENANTS - 1));
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
