//! Pools: the VIPs that share accelerators, and so share admission.

use std::collections::{BTreeMap, BTreeSet};
use std::net::IpAddr;

use super::BackendInput;

/// Joins the names of a pool's VIPs (VIP names cannot contain it).
pub(super) const POOL_SEP: char = '+';

/// Each VIP's pool: the VIPs connected by sharing a backend address (the same accelerator
/// host serves them all), named by their sorted names.
pub(super) fn pools(inputs: &[BackendInput]) -> BTreeMap<String, String> {
    let mut pool_of: BTreeMap<&str, BTreeSet<&str>> = BTreeMap::new();
    for i in inputs {
        pool_of
            .entry(i.vip)
            .or_insert_with(|| BTreeSet::from([i.vip]));
    }
    // Merge until stable: VIP counts are small (at most MAX_VIPS).
    let mut hosts: BTreeMap<IpAddr, BTreeSet<&str>> = BTreeMap::new();
    for i in inputs {
        hosts.entry(i.address).or_default().insert(i.vip);
    }
    loop {
        let mut changed = false;
        for shared in hosts.values() {
            let union: BTreeSet<&str> = shared
                .iter()
                .flat_map(|v| pool_of[v].iter().copied())
                .collect();
            for v in &union {
                let p = pool_of.get_mut(v).expect("every VIP has a pool");
                if p.len() != union.len() {
                    *p = union.clone();
                    changed = true;
                }
            }
        }
        if !changed {
            break;
        }
    }
    pool_of
        .into_iter()
        .map(|(v, p)| {
            (
                v.to_owned(),
                p.into_iter()
                    .collect::<Vec<_>>()
                    .join(&POOL_SEP.to_string()),
            )
        })
        .collect()
}
