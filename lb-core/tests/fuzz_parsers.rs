//! Property tests of the parsers that take outside input: the configuration file and the
//! Prometheus text format (the admin API's request parsing is fuzzed in `admin::tests`).
//! Inputs are random bytes and random mutations of real files; case counts are bounded so the
//! suite stays fast (`PROPTEST_CASES` raises them for a long run).
//!
//! Properties: nothing panics; what is accepted meets the rules (config) or carries no
//! value that could lie a backend healthy (telemetry); an accepted config round-trips.

use std::path::Path;

use proptest::prelude::*;
use sluice_core::{
    config::{self, rules, EngineKind},
    telemetry::{dcgm, engine, prom, Sample},
};

const CONFIG: &str = include_str!("../../configs/sluice.toml");
const PAGES: &[&str] = &[
    include_str!("fixtures/telemetry/dcgm-exporter.prom"),
    include_str!("fixtures/telemetry/vllm.prom"),
    include_str!("fixtures/telemetry/sglang.prom"),
    include_str!("fixtures/telemetry/node-exporter-roce.prom"),
];

/// One edit of a text: a byte replaced, inserted or removed, or a cut.
#[derive(Clone, Debug)]
enum Edit {
    Set(usize, u8),
    Insert(usize, Vec<u8>),
    Remove(usize, usize),
    Cut(usize),
}

fn edit() -> impl Strategy<Value = Edit> {
    // Bytes that matter to the formats, plus any byte.
    let byte = prop_oneof![
        prop::sample::select(b"\"'=[]{}#\\\n\r\t ,.:-+0123456789eEnaNIf\x00\x1b\x7f".to_vec()),
        any::<u8>(),
    ];
    let snippet = prop_oneof![
        prop::collection::vec(byte.clone(), 1..8),
        prop::sample::select(vec![
            b"NaN".to_vec(),
            b"-Inf".to_vec(),
            b"-1000".to_vec(),
            b"1e308".to_vec(),
            b"18446744073709552s".to_vec(),
            b"255.255.255.255".to_vec(),
            b"::ffff:10.0.0.1".to_vec(),
            b"https://".to_vec(),
            b"\\u001b[2J".to_vec(),
            b"[[vip.backend]]\naddress = \"10.1.0.9\"\n".to_vec(),
        ]),
    ];
    prop_oneof![
        (any::<usize>(), byte).prop_map(|(i, b)| Edit::Set(i, b)),
        (any::<usize>(), snippet).prop_map(|(i, s)| Edit::Insert(i, s)),
        (any::<usize>(), 1usize..64).prop_map(|(i, n)| Edit::Remove(i, n)),
        any::<usize>().prop_map(Edit::Cut),
    ]
}

fn mutate(text: &str, edits: &[Edit]) -> String {
    let mut b = text.as_bytes().to_vec();
    for e in edits {
        let at = |i: usize, len: usize| if len == 0 { 0 } else { i % (len + 1) };
        match e {
            Edit::Set(i, v) if !b.is_empty() => {
                let i = i % b.len();
                b[i] = *v;
            }
            Edit::Set(..) => {}
            Edit::Insert(i, s) => {
                let i = at(*i, b.len());
                b.splice(i..i, s.iter().copied());
            }
            Edit::Remove(i, n) => {
                let i = at(*i, b.len());
                let end = (i + n).min(b.len());
                b.drain(i..end);
            }
            Edit::Cut(i) => b.truncate(at(*i, b.len())),
        }
    }
    String::from_utf8_lossy(&b).into_owned()
}

/// What an accepted configuration must satisfy, whatever the file said.
fn check_config(cfg: &config::Config) {
    for v in &cfg.vips {
        rules::vip_name(&v.name).unwrap();
        rules::unicast(v.address).unwrap();
        for b in &v.backends {
            rules::backend_address(b.address, v.address).unwrap();
            rules::labels(&b.labels).unwrap();
        }
    }
    for d in [
        cfg.health.interval,
        cfg.health.timeout,
        cfg.telemetry.scrape_interval,
        cfg.telemetry.stale_after,
        cfg.dataplane.flow_idle_timeout,
    ] {
        rules::bounded(d).unwrap();
    }
    let text = toml::to_string(cfg).unwrap();
    let back = config::parse(&text, "round-trip").unwrap_or_else(|e| panic!("{e}\n{text}"));
    assert_eq!(&back, cfg);
}

/// No field of a sample taken from a page may be negative, NaN or infinite.
fn check_sample(s: &Sample) {
    for v in [
        s.gpu_util,
        s.fb_used,
        s.gpu_temp_c,
        s.power_w,
        s.queue_depth,
        s.running,
        s.kv_cache,
        s.tpot_s,
        s.ecn_rate,
        s.cnp_rate,
    ]
    .into_iter()
    .flatten()
    {
        assert!(v.is_finite() && v >= 0.0, "{s:?}");
    }
    s.validate().unwrap();
}

fn check_page(text: &str) {
    let Ok(page) = prom::parse(text) else {
        return;
    };
    for s in &page.series {
        assert!(!s.name.is_empty());
    }
    for kind in [EngineKind::Vllm, EngineKind::Sglang] {
        if let Ok(mut s) = engine::extract(&page, kind, None) {
            // The page's inter-token totals as the second of two scrapes, after an empty one.
            let mut tracker = engine::TpotTracker::default();
            let zero = engine::TpotTotals {
                sum_s: 0.0,
                count: 0.0,
            };
            tracker.observe(Some(zero));
            s.tpot_s = tracker.observe(engine::tpot_totals(&page, kind, None));
            check_sample(&s);
        }
    }
    if let Ok(s) = dcgm::extract(&page, &[], &[]) {
        check_sample(&s);
        assert_ne!(s, Sample::default(), "an empty reading was accepted");
    }
}

// proptest's default of 256 cases per property; PROPTEST_CASES overrides it.
proptest! {
    #[test]
    fn config_mutations_never_panic_and_what_passes_meets_the_rules(
        edits in prop::collection::vec(edit(), 1..6)
    ) {
        let text = mutate(CONFIG, &edits);
        if let Ok(cfg) = config::parse(&text, "fuzz.toml") {
            check_config(&cfg);
        }
    }

    #[test]
    fn config_from_random_bytes_never_panics(bytes in prop::collection::vec(any::<u8>(), 0..512)) {
        let text = String::from_utf8_lossy(&bytes);
        if let Ok(cfg) = config::parse(&text, "fuzz.toml") {
            check_config(&cfg);
        }
    }

    #[test]
    fn exporter_page_mutations_never_panic_or_yield_a_lying_value(
        page in 0..PAGES.len(),
        edits in prop::collection::vec(edit(), 1..8)
    ) {
        check_page(&mutate(PAGES[page], &edits));
    }

    #[test]
    fn exporter_pages_from_random_bytes_never_panic(
        bytes in prop::collection::vec(any::<u8>(), 0..512)
    ) {
        check_page(&String::from_utf8_lossy(&bytes));
    }
}

#[test]
fn the_unmutated_inputs_pass() {
    check_config(
        &config::load(Path::new(concat!(
            env!("CARGO_MANIFEST_DIR"),
            "/../configs/sluice.toml"
        )))
        .unwrap(),
    );
    for p in PAGES {
        prom::parse(p).unwrap();
        check_page(p);
    }
}
