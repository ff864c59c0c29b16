//! Which VIP addresses this host announces, decided from what it knows (pure: no I/O, no
//! clock). A VIP is announced only while the host can serve it: the data plane is attached,
//! the VIP has at least one usable backend, and the host is not in maintenance.

use std::{collections::BTreeSet, net::IpAddr};

use serde::Serialize;

use crate::state::{PlaneState, Vip};

/// What the decision reads.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Inputs {
    /// The data plane is attached (false while the daemon starts and after it stops).
    pub attached: bool,
    /// `sluice lb drain`: the host is out for maintenance.
    pub maintenance: bool,
    pub vips: Vec<VipInput>,
}

#[derive(Clone, Debug, PartialEq, Eq)]
pub struct VipInput {
    pub name: String,
    pub address: IpAddr,
    pub usable_backends: usize,
}

/// Why a VIP is or is not announced (in `sluice status`, the API and the event log).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
#[serde(rename_all = "kebab-case")]
pub enum Reason {
    Serving,
    Detached,
    Maintenance,
    NoUsableBackend,
}

impl Reason {
    pub fn text(self) -> &'static str {
        match self {
            Reason::Serving => "serving: data plane attached, usable backends",
            Reason::Detached => "the data plane is not attached",
            Reason::Maintenance => "the host is in maintenance (sluice lb drain)",
            Reason::NoUsableBackend => "no usable backend (all down, draining or weight 0)",
        }
    }
}

#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub struct Decision {
    pub vip: String,
    pub address: IpAddr,
    pub announce: bool,
    pub reason: Reason,
}

/// Backends that can take a new flow: healthy, not draining, weight above zero.
pub fn usable_backends(vip: &Vip) -> usize {
    vip.backends
        .values()
        .filter(|b| b.plane_state() == PlaneState::Active && b.spec.weight > 0)
        .count()
}

pub fn inputs(
    vips: impl IntoIterator<Item = VipInput>,
    attached: bool,
    maintenance: bool,
) -> Inputs {
    Inputs {
        attached,
        maintenance,
        vips: vips.into_iter().collect(),
    }
}

pub fn vip_input(vip: &Vip) -> VipInput {
    VipInput {
        name: vip.spec.name.clone(),
        address: vip.spec.address,
        usable_backends: usable_backends(vip),
    }
}

/// One decision per VIP, in input order. Host-wide reasons come first: a detached data
/// plane, then maintenance.
pub fn decide(i: &Inputs) -> Vec<Decision> {
    i.vips
        .iter()
        .map(|v| {
            let reason = if !i.attached {
                Reason::Detached
            } else if i.maintenance {
                Reason::Maintenance
            } else if v.usable_backends == 0 {
                Reason::NoUsableBackend
            } else {
                Reason::Serving
            };
            Decision {
                vip: v.name.clone(),
                address: v.address,
                announce: reason == Reason::Serving,
                reason,
            }
        })
        .collect()
}

/// The host routes to announce: one /32 or /128 per address. VIPs on one address (other
/// ports) share the route, so it stays while any of them is served.
pub fn routes(d: &[Decision]) -> BTreeSet<IpAddr> {
    d.iter().filter(|d| d.announce).map(|d| d.address).collect()
}

/// What changed between two rounds, as (VIP, now announced, reason) for the event log.
pub fn changes<'a>(before: &[Decision], after: &'a [Decision]) -> Vec<&'a Decision> {
    after
        .iter()
        .filter(|a| {
            before
                .iter()
                .find(|b| b.vip == a.vip)
                .map_or(a.announce, |b| b.announce != a.announce)
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn vip(name: &str, addr: &str, usable: usize) -> VipInput {
        VipInput {
            name: name.into(),
            address: addr.parse().unwrap(),
            usable_backends: usable,
        }
    }

    fn reasons(i: &Inputs) -> Vec<Reason> {
        decide(i).iter().map(|d| d.reason).collect()
    }

    #[test]
    fn a_vip_is_announced_only_when_attached_served_and_not_in_maintenance() {
        let vips = vec![vip("chat", "10.0.0.1", 2), vip("empty", "10.0.0.2", 0)];
        let on = inputs(vips.clone(), true, false);
        assert_eq!(reasons(&on), [Reason::Serving, Reason::NoUsableBackend]);
        assert_eq!(
            routes(&decide(&on)),
            BTreeSet::from(["10.0.0.1".parse().unwrap()])
        );
        let off = inputs(vips.clone(), false, false);
        assert_eq!(reasons(&off), [Reason::Detached, Reason::Detached]);
        assert!(routes(&decide(&off)).is_empty());
        let maint = inputs(vips, true, true);
        assert_eq!(reasons(&maint), [Reason::Maintenance, Reason::Maintenance]);
        assert!(routes(&decide(&maint)).is_empty());
    }

    #[test]
    fn vips_sharing_an_address_keep_its_route_while_one_is_served() {
        let i = inputs(
            vec![vip("a", "fd00::1", 0), vip("b", "fd00::1", 1)],
            true,
            false,
        );
        assert_eq!(
            routes(&decide(&i)),
            BTreeSet::from(["fd00::1".parse().unwrap()])
        );
    }

    #[test]
    fn changes_name_only_the_vips_that_flipped() {
        let before = decide(&inputs(
            vec![vip("a", "10.0.0.1", 1), vip("b", "10.0.0.2", 1)],
            true,
            false,
        ));
        let after = decide(&inputs(
            vec![
                vip("a", "10.0.0.1", 1),
                vip("b", "10.0.0.2", 0),
                vip("c", "10.0.0.3", 1),
            ],
            true,
            false,
        ));
        let flipped: Vec<(&str, bool)> = changes(&before, &after)
            .iter()
            .map(|d| (d.vip.as_str(), d.announce))
            .collect();
        assert_eq!(flipped, [("b", false), ("c", true)]);
        // A VIP seen for the first time and not announced is no change.
        assert!(changes(
            &[],
            &decide(&inputs(vec![vip("x", "10.0.0.9", 0)], true, false))
        )
        .is_empty());
    }
}
