//! Prometheus text-exposition helpers: families built from (labels, value) samples, shared by
//! every page that exposes metrics (the LB daemon's, the backend host's) and by the shells
//! that add their own families to it (the announcer, the fleet).

use lb_common::stat::{self, Kind};
use prometheus_client::{
    metrics::{counter::Counter, family::Family, gauge::Gauge},
    registry::Registry,
};

/// A sample's labels, in the order they are exposed.
pub(crate) type Labels = Vec<(&'static str, String)>;

pub(crate) fn counters(reg: &mut Registry, name: &str, help: &str, samples: Vec<(Labels, u64)>) {
    let family = Family::<Labels, Counter>::default();
    for (labels, v) in samples {
        family.get_or_create(&labels).inc_by(v);
    }
    reg.register(name, help, family);
}

pub(crate) fn gauges(reg: &mut Registry, name: &str, help: &str, samples: Vec<(Labels, i64)>) {
    let family = Family::<Labels, Gauge>::default();
    for (labels, v) in samples {
        family.get_or_create(&labels).set(v);
    }
    reg.register(name, help, family);
}

pub(crate) fn float_gauges(
    reg: &mut Registry,
    name: &str,
    help: &str,
    samples: Vec<(Labels, f64)>,
) {
    let family = Family::<Labels, Gauge<f64, std::sync::atomic::AtomicU64>>::default();
    for (labels, v) in samples {
        family.get_or_create(&labels).set(v);
    }
    reg.register(name, help, family);
}

/// The family a global data-plane counter is exported in.
#[derive(Debug, PartialEq, Eq)]
enum Dataplane {
    /// `sluice_dataplane_drops_total{reason}`
    Drops,
    /// `sluice_dataplane_passes_total{reason}`: packets handed to the kernel.
    Passes,
    /// `sluice_dataplane_events_total{event}`
    Events,
}

/// The family of a global counter comes from the kind it is declared with in
/// `lb_common::stat`; the label drops the word the family already says
/// (`decap_pass_not_encap` → "decap_not_encap").
fn dataplane_family(name: &str, kind: Kind) -> (Dataplane, String) {
    let (family, word) = match kind {
        Kind::Drop => (Dataplane::Drops, "drop_"),
        Kind::Pass => (Dataplane::Passes, "pass_"),
        Kind::Received | Kind::Sent | Kind::Event => return (Dataplane::Events, name.to_string()),
    };
    let label = match name.strip_prefix(word) {
        Some(reason) => reason.to_string(),
        None => name.replacen(&format!("_{word}"), "_", 1),
    };
    (family, label)
}

/// `sluice_dataplane_{drops,passes,events}_total` from (counter, value) pairs.
pub(crate) fn dataplane_counters(
    reg: &mut Registry,
    values: impl Iterator<Item = (stat::Counter, u64)>,
) {
    let mut drops = vec![];
    let mut passes = vec![];
    let mut events = vec![];
    for (c, v) in values {
        match dataplane_family(c.name(), c.kind()) {
            (Dataplane::Drops, r) => drops.push((vec![("reason", r)], v)),
            (Dataplane::Passes, r) => passes.push((vec![("reason", r)], v)),
            (Dataplane::Events, e) => events.push((vec![("event", e)], v)),
        }
    }
    counters(
        reg,
        "dataplane_drops",
        "Packets the data plane dropped, by reason",
        drops,
    );
    counters(
        reg,
        "dataplane_passes",
        "Packets the data plane passed to the kernel, by reason",
        passes,
    );
    counters(
        reg,
        "dataplane_events",
        "Data-plane steering events",
        events,
    );
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn dataplane_counters_are_sorted_into_families() {
        let f = |n: &str| {
            let i = stat::NAMES.iter().position(|&m| m == n).unwrap();
            dataplane_family(n, stat::KINDS[i])
        };
        assert_eq!(
            f("drop_no_nexthop"),
            (Dataplane::Drops, "no_nexthop".into())
        );
        assert_eq!(f("pass_fragment"), (Dataplane::Passes, "fragment".into()));
        assert_eq!(
            f("decap_pass_not_encap"),
            (Dataplane::Passes, "decap_not_encap".into())
        );
        assert_eq!(
            f("flood_bypass"),
            (Dataplane::Events, "flood_bypass".into())
        );
        assert_eq!(
            f("pass_short_ip_len"),
            (Dataplane::Passes, "short_ip_len".into())
        );
        assert_eq!(
            f("decap_pass_bad_len"),
            (Dataplane::Passes, "decap_bad_len".into())
        );
        assert_eq!(
            f("padding_trimmed"),
            (Dataplane::Events, "padding_trimmed".into())
        );
        assert_eq!(
            f("affinity_hit_saturated"),
            (Dataplane::Events, "affinity_hit_saturated".into())
        );
        // A shed session is an event (why) followed by one outcome: a drop, or a RST sent.
        // Its drops are in the drops family, where a dashboard of drops finds them.
        assert_eq!(f("drop_shed"), (Dataplane::Drops, "shed".into()));
        assert_eq!(
            f("shed_priority"),
            (Dataplane::Events, "shed_priority".into())
        );
        assert_eq!(f("shed_full"), (Dataplane::Events, "shed_full".into()));
        assert_eq!(
            f("shed_rst_sent"),
            (Dataplane::Events, "shed_rst_sent".into())
        );
        // Every pass or drop loses its word in the label, so no label repeats the family.
        for (name, kind) in stat::NAMES.into_iter().zip(stat::KINDS) {
            let (_, label) = dataplane_family(name, kind);
            if matches!(kind, Kind::Pass | Kind::Drop) {
                assert!(
                    !label.contains("pass_") && !label.contains("drop_"),
                    "{name}"
                );
            }
        }
    }
}
