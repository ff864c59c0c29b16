//! RoCE congestion counters, read from sysfs or a node_exporter page, turned into rates.
//!
//! The counters are the RDMA `hw_counters` of one device port
//! (`/sys/class/infiniband/<dev>/ports/<port>/hw_counters/`). NVIDIA mlx5 and Broadcom
//! bnxt_re name them differently, and bnxt_re renamed its own in later kernels; every
//! spelling in [`COUNTERS`] is read where present. Rates need two readings, so a
//! [`RateTracker`] per port remembers the last one.
//!
//! From a Prometheus endpoint, node_exporter's `infiniband` collector names are accepted
//! (see [`EXPORTER_NAMES`]), selecting the `device` and `port` labels.

use std::{collections::BTreeMap, io, path::Path, time::Instant};

use super::{prom::Page, reading, Sample};

/// What a counter says about the fabric.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Kind {
    /// ECN-marked RoCE packets received (congestion seen on the way in).
    Ecn,
    /// Congestion notification packets sent or handled.
    Cnp,
    /// Transport trouble (drops, retransmits, ignored CNPs): logged, not steered on.
    Error,
}

/// The `hw_counters` file names read, with what they count.
pub const COUNTERS: &[(&str, Kind)] = &[
    // mlx5
    ("np_ecn_marked_roce_packets", Kind::Ecn),
    ("np_cnp_sent", Kind::Cnp),
    ("rp_cnp_handled", Kind::Cnp),
    ("rp_cnp_ignored", Kind::Error),
    ("out_of_buffer", Kind::Error),
    ("out_of_sequence", Kind::Error),
    ("packet_seq_err", Kind::Error),
    ("local_ack_timeout_err", Kind::Error),
    // bnxt_re (its later kernels use the mlx5 names above, plus np_cnp_pkts)
    ("rx_ecn_marked_pkts", Kind::Ecn),
    ("tx_cnp_pkts", Kind::Cnp),
    ("rx_cnp_pkts", Kind::Cnp),
    ("np_cnp_pkts", Kind::Cnp),
    ("rx_out_of_buffer", Kind::Error),
];

/// node_exporter's names for the mlx5 counters (its `infiniband` collector, labels `device`
/// and `port`).
pub const EXPORTER_NAMES: &[(&str, &str)] = &[
    (
        "node_infiniband_np_ecn_marked_roce_packets_received_total",
        "np_ecn_marked_roce_packets",
    ),
    ("node_infiniband_np_cnp_packets_sent_total", "np_cnp_sent"),
    (
        "node_infiniband_rp_cnp_packets_handled_total",
        "rp_cnp_handled",
    ),
    (
        "node_infiniband_rp_cnp_ignored_packets_received_total",
        "rp_cnp_ignored",
    ),
    ("node_infiniband_out_of_buffer_drops_total", "out_of_buffer"),
    (
        "node_infiniband_out_of_sequence_packets_received_total",
        "out_of_sequence",
    ),
    (
        "node_infiniband_packet_sequence_errors_total",
        "packet_seq_err",
    ),
    (
        "node_infiniband_local_ack_timeout_errors_total",
        "local_ack_timeout_err",
    ),
];

/// Counter values by `hw_counters` name. f64 because exporters send floats; exact below
/// 2^53 packets.
pub type Counters = BTreeMap<&'static str, f64>;

/// Per-second rates by `hw_counters` name.
pub type Rates = BTreeMap<&'static str, f64>;

/// Reads the known counters under `root` (a `hw_counters` directory); files that do not
/// exist are skipped, as each driver has its own set.
pub fn read_sysfs(root: &Path) -> Result<Counters, String> {
    let mut out = Counters::new();
    for &(name, _) in COUNTERS {
        let path = root.join(name);
        let text = match std::fs::read_to_string(&path) {
            Ok(t) => t,
            Err(e) if e.kind() == io::ErrorKind::NotFound => continue,
            Err(e) => return Err(format!("{}: {e}", path.display())),
        };
        let v: u64 = text
            .trim()
            .parse()
            .map_err(|_| format!("{}: {:?} is not a counter", path.display(), text.trim()))?;
        out.insert(name, v as f64);
    }
    check(out, || format!("under {}", root.display()))
}

/// The counters of one device port from a node_exporter page.
pub fn exporter_counters(page: &Page<'_>, device: &str, port: &str) -> Result<Counters, String> {
    let mut out = Counters::new();
    for &(metric, name) in EXPORTER_NAMES {
        let hit = page
            .get(metric)
            .find(|s| s.label("device") == Some(device) && s.label("port") == Some(port));
        if let Some(v) = hit.and_then(|s| reading(s.value)) {
            out.insert(name, v);
        }
    }
    check(out, || format!("for device={device:?} port={port:?}"))
}

/// A reading without ECN or CNP counters cannot drive steering: report what was missing.
fn check(c: Counters, place: impl Fn() -> String) -> Result<Counters, String> {
    let congestion = c.keys().any(|n| kind(n).is_some_and(|k| k != Kind::Error));
    if congestion {
        Ok(c)
    } else {
        Err(format!(
            "no ECN or CNP counters {} (looked for {})",
            place(),
            COUNTERS
                .iter()
                .filter(|(_, k)| *k != Kind::Error)
                .map(|(n, _)| *n)
                .collect::<Vec<_>>()
                .join(", ")
        ))
    }
}

fn kind(name: &str) -> Option<Kind> {
    COUNTERS.iter().find(|(n, _)| *n == name).map(|(_, k)| *k)
}

/// Turns successive readings of one port into per-second rates.
#[derive(Debug, Default)]
pub struct RateTracker {
    last: Option<(Counters, Instant)>,
}

impl RateTracker {
    /// Rates since the previous reading; None for the first one (or one not after it). A
    /// counter that went down (reset, or a 32-bit wrap) restarts from its new value and has
    /// no rate this time; rates are never negative.
    pub fn observe(&mut self, now: Counters, at: Instant) -> Option<Rates> {
        let rates = match &self.last {
            Some((_, then)) if at <= *then => return None,
            Some((prev, then)) => {
                let secs = (at - *then).as_secs_f64();
                let rates = now
                    .iter()
                    .filter_map(|(name, v)| {
                        let p = prev.get(name)?;
                        (v >= p).then(|| (*name, (v - p) / secs))
                    })
                    .collect();
                Some(rates)
            }
            None => None,
        };
        self.last = Some((now, at));
        rates
    }
}

/// The fabric part of a sample. A signal is reported only when every counter of its kind
/// that the port has produced a rate, so a reset of one does not under-count the sum.
pub fn sample(counters: &Counters, rates: &Rates) -> Sample {
    let sum = |want: Kind| -> Option<f64> {
        let names: Vec<&str> = counters
            .keys()
            .copied()
            .filter(|n| kind(n) == Some(want))
            .collect();
        if names.is_empty() {
            return None;
        }
        names.iter().map(|n| rates.get(n)).sum()
    };
    Sample {
        ecn_rate: sum(Kind::Ecn),
        cnp_rate: sum(Kind::Cnp),
        ..Sample::default()
    }
}

/// The transport error rates (Kind::Error) that are non-zero, for logs.
pub fn errors(rates: &Rates) -> Vec<(&'static str, f64)> {
    rates
        .iter()
        .filter(|(n, r)| kind(n) == Some(Kind::Error) && **r > 0.0)
        .map(|(n, r)| (*n, *r))
        .collect()
}

#[cfg(test)]
mod tests {
    use std::{fs, time::Duration};

    use super::*;
    use crate::{telemetry::prom::parse, test_dir::TestDir};

    const NODE_EXPORTER: &str = include_str!(concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/tests/fixtures/telemetry/node-exporter-roce.prom"
    ));

    /// A fake `hw_counters` directory, removed on drop.
    struct Tree(TestDir);

    impl Tree {
        fn new(name: &str) -> Tree {
            Tree(TestDir::new(&format!("roce-{name}")))
        }

        fn set(&self, counters: &[(&str, &str)]) {
            for (n, v) in counters {
                fs::write(self.0.join(n), format!("{v}\n")).unwrap();
            }
        }
    }

    fn c(pairs: &[(&'static str, f64)]) -> Counters {
        pairs.iter().copied().collect()
    }

    #[test]
    fn sysfs_mlx5_tree_to_rates() {
        let t = Tree::new("mlx5");
        // Counters sluice does not read are ignored.
        t.set(&[
            ("np_ecn_marked_roce_packets", "1000"),
            ("np_cnp_sent", "200"),
            ("rp_cnp_handled", "50"),
            ("out_of_sequence", "7"),
            ("rx_atomic_requests", "3"),
        ]);
        let first = read_sysfs(&t.0).unwrap();
        assert_eq!(
            first,
            c(&[
                ("np_ecn_marked_roce_packets", 1000.0),
                ("np_cnp_sent", 200.0),
                ("rp_cnp_handled", 50.0),
                ("out_of_sequence", 7.0),
            ])
        );
        let t0 = Instant::now();
        let mut tracker = RateTracker::default();
        assert_eq!(tracker.observe(first, t0), None);

        t.set(&[
            ("np_ecn_marked_roce_packets", "3000"),
            ("np_cnp_sent", "600"),
            ("rp_cnp_handled", "150"),
            ("out_of_sequence", "9"),
        ]);
        let second = read_sysfs(&t.0).unwrap();
        let rates = tracker
            .observe(second.clone(), t0 + Duration::from_millis(500))
            .unwrap();
        assert_eq!(
            sample(&second, &rates),
            Sample {
                ecn_rate: Some(4000.0),
                cnp_rate: Some(1000.0),
                ..Sample::default()
            }
        );
        assert_eq!(errors(&rates), vec![("out_of_sequence", 4.0)]);
    }

    #[test]
    fn sysfs_broadcom_names() {
        let t = Tree::new("bnxt");
        t.set(&[
            ("rx_ecn_marked_pkts", "10"),
            ("tx_cnp_pkts", "20"),
            ("rx_cnp_pkts", "30"),
        ]);
        let mut tracker = RateTracker::default();
        let t0 = Instant::now();
        tracker.observe(read_sysfs(&t.0).unwrap(), t0);
        t.set(&[
            ("rx_ecn_marked_pkts", "30"),
            ("tx_cnp_pkts", "25"),
            ("rx_cnp_pkts", "40"),
        ]);
        let now = read_sysfs(&t.0).unwrap();
        let rates = tracker
            .observe(now.clone(), t0 + Duration::from_secs(2))
            .unwrap();
        let s = sample(&now, &rates);
        assert_eq!((s.ecn_rate, s.cnp_rate), (Some(10.0), Some(7.5)));
    }

    #[test]
    fn sysfs_errors() {
        let t = Tree::new("errors");
        let e = read_sysfs(&t.0).unwrap_err();
        assert!(e.starts_with("no ECN or CNP counters under /"), "{e}");
        assert!(e.contains("np_ecn_marked_roce_packets, np_cnp_sent"), "{e}");
        t.set(&[("out_of_buffer", "5")]);
        assert!(read_sysfs(&t.0)
            .unwrap_err()
            .starts_with("no ECN or CNP counters"));
        t.set(&[("np_cnp_sent", "12abc")]);
        let e = read_sysfs(&t.0).unwrap_err();
        assert!(
            e.ends_with("np_cnp_sent: \"12abc\" is not a counter"),
            "{e}"
        );
        t.set(&[("np_cnp_sent", "-1")]);
        assert!(read_sysfs(&t.0).is_err());
        let missing = t.0.join("nope");
        assert!(read_sysfs(&missing)
            .unwrap_err()
            .starts_with("no ECN or CNP counters"));
    }

    #[test]
    fn resets_and_wraps_restart_the_baseline() {
        let t0 = Instant::now();
        let at = |s: u64| t0 + Duration::from_secs(s);
        let mut tr = RateTracker::default();
        let counters = |ecn, cnp| c(&[("np_ecn_marked_roce_packets", ecn), ("np_cnp_sent", cnp)]);
        assert_eq!(tr.observe(counters(100.0, 10.0), at(0)), None);
        // ECN wrapped (32-bit counter) or reset: no rate for it, never negative.
        let now = counters(5.0, 30.0);
        let rates = tr.observe(now.clone(), at(1)).unwrap();
        assert_eq!(rates, c(&[("np_cnp_sent", 20.0)]));
        let s = sample(&now, &rates);
        assert_eq!((s.ecn_rate, s.cnp_rate), (None, Some(20.0)));
        // The next reading counts from the new baseline.
        let rates = tr.observe(counters(15.0, 30.0), at(2)).unwrap();
        assert_eq!(
            rates,
            c(&[("np_ecn_marked_roce_packets", 10.0), ("np_cnp_sent", 0.0)])
        );
        // A reading not after the last one gives no rate and keeps the baseline.
        assert_eq!(tr.observe(counters(99.0, 99.0), at(2)), None);
        assert_eq!(
            tr.observe(counters(25.0, 40.0), at(3)).unwrap(),
            c(&[("np_ecn_marked_roce_packets", 10.0), ("np_cnp_sent", 10.0)])
        );
    }

    #[test]
    fn one_reset_cnp_counter_hides_the_cnp_sum() {
        let counters = c(&[("np_cnp_sent", 1.0), ("rp_cnp_handled", 1.0)]);
        let rates = c(&[("np_cnp_sent", 5.0)]);
        assert_eq!(sample(&counters, &rates).cnp_rate, None);
    }

    #[test]
    fn node_exporter_page() {
        let page = parse(NODE_EXPORTER).unwrap();
        assert_eq!(
            exporter_counters(&page, "mlx5_0", "1").unwrap(),
            c(&[
                ("np_ecn_marked_roce_packets", 1_843_221.0),
                ("np_cnp_sent", 402_117.0),
                ("rp_cnp_handled", 388_910.0),
                ("rp_cnp_ignored", 0.0),
                ("out_of_buffer", 12.0),
                ("out_of_sequence", 3.0),
                ("packet_seq_err", 0.0),
                ("local_ack_timeout_err", 1.0),
            ])
        );
        assert_eq!(
            exporter_counters(&page, "mlx5_1", "1").unwrap()["np_ecn_marked_roce_packets"],
            0.0
        );
        let e = exporter_counters(&page, "mlx5_0", "2").unwrap_err();
        assert!(
            e.starts_with("no ECN or CNP counters for device=\"mlx5_0\" port=\"2\""),
            "{e}"
        );
    }

    /// Negative, NaN and infinite counters are not readings; a page of nothing else fails the
    /// source (the backend goes stale) instead of giving a fresh empty reading.
    #[test]
    fn negative_nan_and_infinite_exporter_counters_are_dropped() {
        let line = |metric: &str, v: &str| {
            format!("node_infiniband_{metric}{{device=\"mlx5_0\",port=\"1\"}} {v}\n")
        };
        let text = line("np_ecn_marked_roce_packets_received_total", "-1000")
            + &line("np_cnp_packets_sent_total", "NaN")
            + &line("rp_cnp_packets_handled_total", "+Inf")
            + &line("out_of_buffer_drops_total", "5");
        let e = exporter_counters(&parse(&text).unwrap(), "mlx5_0", "1").unwrap_err();
        assert!(e.starts_with("no ECN or CNP counters"), "{e}");
        let text = text + &line("np_cnp_packets_sent_total", "7");
        let page = parse(&text).unwrap();
        // The first series of a metric decides; a later duplicate does not resurrect it.
        let e = exporter_counters(&page, "mlx5_0", "1").unwrap_err();
        assert!(e.starts_with("no ECN or CNP counters"), "{e}");
        let text = line("np_ecn_marked_roce_packets_received_total", "-1")
            + &line("np_cnp_packets_sent_total", "7");
        assert_eq!(
            exporter_counters(&parse(&text).unwrap(), "mlx5_0", "1").unwrap(),
            c(&[("np_cnp_sent", 7.0)])
        );
    }
}
