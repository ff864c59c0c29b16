//! The GPU part of a sample from an NVIDIA dcgm-exporter page.
//!
//! GPUs are selected by the `gpu` label (the GPU index) and the `UUID` label; an empty list
//! does not filter. Every selected GPU named in the configuration must be on the page: a
//! GPU that vanished from the exporter (fallen off the bus, say) makes the source fail,
//! which the hub turns into "unknown" rather than a healthy-looking partial view. MIG and
//! per-pod series of one GPU carry extra labels and count as separate readings.

use std::collections::{BTreeMap, BTreeSet};

use super::{prom::Page, prom::Series, reading, Sample, THROTTLE_MASK};

pub const GPU_UTIL: &str = "DCGM_FI_DEV_GPU_UTIL";
pub const FB_USED: &str = "DCGM_FI_DEV_FB_USED";
pub const FB_FREE: &str = "DCGM_FI_DEV_FB_FREE";
pub const GPU_TEMP: &str = "DCGM_FI_DEV_GPU_TEMP";
pub const POWER_USAGE: &str = "DCGM_FI_DEV_POWER_USAGE";
pub const CLOCKS_EVENT_REASONS: &str = "DCGM_FI_DEV_CLOCKS_EVENT_REASONS";
/// The name of `CLOCKS_EVENT_REASONS` before DCGM 3.2.
pub const CLOCK_THROTTLE_REASONS: &str = "DCGM_FI_DEV_CLOCK_THROTTLE_REASONS";

const USED: [&str; 7] = [
    GPU_UTIL,
    FB_USED,
    FB_FREE,
    GPU_TEMP,
    POWER_USAGE,
    CLOCKS_EVENT_REASONS,
    CLOCK_THROTTLE_REASONS,
];

/// `gpus` and `uuids` select by the `gpu` and `UUID` labels; empty selects every GPU.
pub fn extract(page: &Page<'_>, gpus: &[String], uuids: &[String]) -> Result<Sample, String> {
    let selected = |s: &&Series<'_>| {
        let pick = |list: &[String], label| {
            list.is_empty() || s.label(label).is_some_and(|v| list.iter().any(|x| x == v))
        };
        pick(gpus, "gpu") && pick(uuids, "UUID")
    };
    let values = |name| {
        page.get(name)
            .filter(selected)
            .filter_map(|s| reading(s.value))
    };

    let on_page: Vec<&Series<'_>> = USED.iter().flat_map(|n| page.get(n)).collect();
    if on_page.is_empty() {
        return Err(format!(
            "no GPU metrics on the page (looked for {})",
            USED.join(", ")
        ));
    }
    let seen = |label| -> BTreeSet<&str> {
        on_page
            .iter()
            .filter(|s| selected(s))
            .filter_map(|s| s.label(label))
            .collect()
    };
    let (seen_gpus, seen_uuids) = (seen("gpu"), seen("UUID"));
    let missing: Vec<String> = (gpus.iter().filter(|g| !seen_gpus.contains(g.as_str())))
        .map(|g| format!("gpu={g:?}"))
        .chain(
            (uuids.iter().filter(|u| !seen_uuids.contains(u.as_str())))
                .map(|u| format!("UUID={u:?}")),
        )
        .collect();
    if !missing.is_empty() {
        let listed: BTreeSet<String> = on_page
            .iter()
            .map(|s| {
                format!(
                    "{} ({})",
                    s.label("gpu").unwrap_or("?"),
                    s.label("UUID").unwrap_or("?")
                )
            })
            .collect();
        let both = if gpus.is_empty() || uuids.is_empty() {
            ""
        } else {
            " (a GPU must match both gpus and uuids)"
        };
        return Err(format!(
            "no GPU on the page has {}{both}; GPUs on the page: {}",
            missing.join(", "),
            listed.into_iter().collect::<Vec<_>>().join(", ")
        ));
    }

    let throttle_name = if page.has(CLOCKS_EVENT_REASONS) {
        CLOCKS_EVENT_REASONS
    } else {
        CLOCK_THROTTLE_REASONS
    };
    let sample = Sample {
        gpu_util: values(GPU_UTIL)
            .reduce(f64::max)
            .map(|u| (u / 100.0).min(1.0)),
        fb_used: fb_used(page, &selected),
        gpu_temp_c: values(GPU_TEMP).reduce(f64::max),
        power_w: values(POWER_USAGE).reduce(|a, b| a + b),
        throttle: values(throttle_name)
            .filter(|v| v.fract() == 0.0)
            .map(|v| v as u64 & THROTTLE_MASK)
            .reduce(|a, b| a | b),
        ..Sample::default()
    };
    // All NaN, negative or blank: the exporter answered but said nothing, which must not
    // count as a fresh (and empty, so unloaded-looking) reading.
    if sample == Sample::default() {
        return Err(format!(
            "no valid value (finite, >= 0, not a DCGM blank) for the selected GPUs in {}",
            USED.join(", ")
        ));
    }
    Ok(sample)
}

/// Max over GPUs of used / (used + free), pairing the two by identical label sets.
fn fb_used(page: &Page<'_>, selected: &dyn Fn(&&Series<'_>) -> bool) -> Option<f64> {
    fn key<'s>(s: &'s Series<'_>) -> Vec<(&'s str, &'s str)> {
        let mut k: Vec<_> = s.labels.iter().map(|(n, v)| (*n, v.as_ref())).collect();
        k.sort_unstable();
        k
    }
    let free: BTreeMap<_, f64> = page
        .get(FB_FREE)
        .filter(selected)
        .filter_map(|s| Some((key(s), reading(s.value)?)))
        .collect();
    page.get(FB_USED)
        .filter(selected)
        .filter_map(|s| {
            let used = reading(s.value)?;
            let total = used + free.get(&key(s))?;
            (total > 0.0).then(|| (used / total).min(1.0))
        })
        .reduce(f64::max)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::telemetry::prom::parse;

    const FIXTURE: &str = include_str!(concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/tests/fixtures/telemetry/dcgm-exporter.prom"
    ));

    fn strings(v: &[&str]) -> Vec<String> {
        v.iter().map(|s| s.to_string()).collect()
    }

    fn run(gpus: &[&str], uuids: &[&str]) -> Result<Sample, String> {
        extract(&parse(FIXTURE).unwrap(), &strings(gpus), &strings(uuids))
    }

    /// Pages of a real H200 read through NVML (tests/gpu/run.sh), idle and under a bf16
    /// matrix-multiply load: what the policy sees from a real accelerator.
    #[test]
    fn a_real_h200_idle_and_under_load() {
        fn page(name: &str) -> Sample {
            let dir = concat!(env!("CARGO_MANIFEST_DIR"), "/tests/fixtures/telemetry/");
            let text = std::fs::read_to_string(format!("{dir}{name}")).unwrap();
            extract(&parse(&text).unwrap(), &[], &[]).unwrap()
        }
        let (idle, load) = (page("h200-nvml-idle.prom"), page("h200-nvml-load.prom"));
        assert_eq!((idle.gpu_util, load.gpu_util), (Some(0.0), Some(1.0)));
        assert_eq!((idle.gpu_temp_c, load.gpu_temp_c), (Some(36.0), Some(52.0)));
        assert!(load.power_w.unwrap() > 3.0 * idle.power_w.unwrap());
        assert!(load.fb_used.unwrap() > idle.fb_used.unwrap());
        assert_eq!(load.throttle, Some(0));
    }

    #[test]
    fn all_gpus_on_the_page() {
        // Four H100s: util 87/92/45/0 %, FB used/free per GPU, GPU 3's memory temperature
        // blank (DCGM's not-supported sentinel), GPU 1 throttled by hw slowdown + sw power cap.
        assert_eq!(
            run(&[], &[]).unwrap(),
            Sample {
                gpu_util: Some(0.92),
                fb_used: Some(74_112.0 / 81_559.0),
                gpu_temp_c: Some(71.0),
                power_w: Some(612.5 + 688.25 + 402.0 + 70.125),
                throttle: Some(0x8),
                ..Sample::default()
            }
        );
    }

    #[test]
    fn select_by_gpu_index() {
        let s = run(&["2", "3"], &[]).unwrap();
        assert_eq!(s.gpu_util, Some(0.45));
        assert_eq!(s.fb_used, Some(40_960.0 / 81_559.0));
        assert_eq!(s.gpu_temp_c, Some(58.0));
        assert_eq!(s.power_w, Some(402.0 + 70.125));
        assert_eq!(s.throttle, Some(0));
    }

    #[test]
    fn select_by_uuid_and_both() {
        let uuid1 = "GPU-5a5c7b1e-31c1-2f4e-7c0d-6a0b3f7b9e21";
        let s = run(&[], &[uuid1]).unwrap();
        assert_eq!((s.gpu_util, s.throttle), (Some(0.92), Some(0x8)));
        // Both filters apply: GPU 0 is not that UUID.
        let e = run(&["0"], &[uuid1]).unwrap_err();
        let want =
            format!("no GPU on the page has gpu=\"0\", UUID=\"{uuid1}\" (a GPU must match both");
        assert!(e.starts_with(&want), "{e}");
        assert_eq!(run(&["1"], &[uuid1]).unwrap(), s);
    }

    #[test]
    fn a_missing_gpu_fails_the_source() {
        let e = run(&["0", "1", "7"], &[]).unwrap_err();
        assert!(
            e.starts_with("no GPU on the page has gpu=\"7\"; GPUs on the page: 0 (GPU-"),
            "{e}"
        );
        let e = run(&[], &["GPU-nope"]).unwrap_err();
        assert!(
            e.starts_with("no GPU on the page has UUID=\"GPU-nope\";"),
            "{e}"
        );
    }

    #[test]
    fn pages_without_gpu_metrics() {
        let page = parse("# TYPE go_goroutines gauge\ngo_goroutines 12\n").unwrap();
        let e = extract(&page, &[], &[]).unwrap_err();
        assert!(e.starts_with("no GPU metrics on the page (looked for DCGM_FI_DEV_GPU_UTIL"));
    }

    /// An all-NaN page is not a fresh, empty sample, and -1000 °C is not a reading.
    #[test]
    fn nan_negative_and_infinite_values_are_not_readings() {
        let page = parse(
            "DCGM_FI_DEV_GPU_UTIL{gpu=\"0\"} NaN\n\
             DCGM_FI_DEV_GPU_TEMP{gpu=\"0\"} NaN\n\
             DCGM_FI_DEV_POWER_USAGE{gpu=\"0\"} NaN\n\
             DCGM_FI_DEV_FB_USED{gpu=\"0\"} NaN\n\
             DCGM_FI_DEV_FB_FREE{gpu=\"0\"} NaN\n",
        )
        .unwrap();
        let e = extract(&page, &[], &[]).unwrap_err();
        assert!(
            e.starts_with("no valid value (finite, >= 0, not a DCGM blank)"),
            "{e}"
        );
        let page = parse(
            "DCGM_FI_DEV_GPU_TEMP{gpu=\"0\"} -1000\n\
             DCGM_FI_DEV_GPU_UTIL{gpu=\"0\"} -Inf\n\
             DCGM_FI_DEV_POWER_USAGE{gpu=\"0\"} -300\n",
        )
        .unwrap();
        assert!(extract(&page, &[], &[]).is_err());
        // One GPU's bad values are dropped; the other's stand, not a sum with a negative.
        let page = parse(
            "DCGM_FI_DEV_GPU_TEMP{gpu=\"0\"} -1000\n\
             DCGM_FI_DEV_GPU_TEMP{gpu=\"1\"} 65\n\
             DCGM_FI_DEV_POWER_USAGE{gpu=\"0\"} -300\n\
             DCGM_FI_DEV_POWER_USAGE{gpu=\"1\"} 400\n\
             DCGM_FI_DEV_GPU_UTIL{gpu=\"0\"} +Inf\n\
             DCGM_FI_DEV_GPU_UTIL{gpu=\"1\"} 50\n\
             DCGM_FI_DEV_FB_USED{gpu=\"0\"} -10\n\
             DCGM_FI_DEV_FB_FREE{gpu=\"0\"} 100\n",
        )
        .unwrap();
        assert_eq!(
            extract(&page, &[], &[]).unwrap(),
            Sample {
                gpu_util: Some(0.5),
                gpu_temp_c: Some(65.0),
                power_w: Some(400.0),
                ..Sample::default()
            }
        );
    }

    #[test]
    fn older_exporters_and_partial_pages() {
        // Pre-3.2 throttle name, no FB_FREE (no fb_used), a blank temperature.
        let page = parse(
            "DCGM_FI_DEV_GPU_UTIL{gpu=\"0\",UUID=\"GPU-a\"} 100\n\
             DCGM_FI_DEV_FB_USED{gpu=\"0\",UUID=\"GPU-a\"} 1000\n\
             DCGM_FI_DEV_GPU_TEMP{gpu=\"0\",UUID=\"GPU-a\"} 9223372036854775794\n\
             DCGM_FI_DEV_CLOCK_THROTTLE_REASONS{gpu=\"0\",UUID=\"GPU-a\"} 69\n",
        )
        .unwrap();
        assert_eq!(
            extract(&page, &strings(&["0"]), &[]).unwrap(),
            Sample {
                gpu_util: Some(1.0),
                throttle: Some(0x40),
                ..Sample::default()
            }
        );
    }
}
