//! The latest telemetry of every backend, merged and judged for staleness.
//!
//! Pure: every method that depends on time takes it as a parameter.
//!
//! Staleness is about the *configured* sources of a backend (those its configuration
//! scrapes, plus [`Source::Push`] where the caller configures it): a backend is stale when
//! any of them is older than `stale_after`, or has never reported (one that has only failed
//! so far gets `stale_after` from its first failure, as a reported part does: a slow first
//! scrape of a starting daemon is not evidence of anything). Stale means "unknown":
//! the policy treats the backend as saturated for new sessions, never as dead. A part older
//! than `stale_after` is left out of the merged sample, configured or not, so a dead exporter
//! cannot pin a backend's weight with old numbers.

use std::{
    collections::{BTreeMap, BTreeSet},
    time::{Duration, Instant},
};

use serde::Serialize;

use super::{BackendKey, Sample, Source};

/// What the policy and the admin API see of one backend.
#[derive(Clone, Debug, Default, PartialEq, Serialize)]
pub struct BackendTelemetry {
    /// The fresh parts merged, later sources overriding earlier ones ([`Source`] order).
    pub sample: Sample,
    /// Age of the oldest configured source's latest part; None when a configured source
    /// has never reported, or none is configured.
    #[serde(with = "opt_secs")]
    pub age: Option<Duration>,
    /// A configured source is older than `stale_after` or has never reported.
    pub stale: bool,
    /// The last error of each source that failed since its last good part, as
    /// "source: message (N.Ns ago)".
    pub errors: Vec<String>,
}

#[derive(Debug)]
pub struct Hub {
    stale_after: Duration,
    backends: BTreeMap<BackendKey, Backend>,
}

#[derive(Debug, Default)]
struct Backend {
    configured: BTreeSet<Source>,
    parts: BTreeMap<Source, (Sample, Instant)>,
    errors: BTreeMap<Source, (String, Instant)>,
    /// When each source that has never reported first failed.
    failing_since: BTreeMap<Source, Instant>,
}

impl Hub {
    pub fn new(stale_after: Duration) -> Self {
        Hub {
            stale_after,
            backends: BTreeMap::new(),
        }
    }

    /// A reloaded `telemetry.stale_after`, judged from the next view on.
    pub fn set_stale_after(&mut self, stale_after: Duration) {
        self.stale_after = stale_after;
    }

    /// Sets the sources expected for `key`, keeping what was received from them (and any
    /// push) so a reload does not reset fresh telemetry.
    pub fn configure(&mut self, key: BackendKey, mut sources: BTreeSet<Source>) {
        let b = self.backends.entry(key).or_default();
        let keep = |s: &Source| sources.contains(s) || *s == Source::Push;
        b.parts.retain(|s, _| keep(s));
        b.errors.retain(|s, _| keep(s));
        b.failing_since.retain(|s, _| keep(s));
        if b.configured.contains(&Source::Push) {
            sources.insert(Source::Push);
        }
        b.configured = sources;
    }

    /// Records a pushed sample. A backend that pushes is from then on expected to keep
    /// pushing: when its pushes stop it goes stale like a scraped source would.
    pub fn push(&mut self, key: &BackendKey, part: Sample, at: Instant) {
        self.backend(key).configured.insert(Source::Push);
        self.update(key, Source::Push, part, at);
    }

    /// Forgets the backends for which `keep` is false (removed from the configuration).
    pub fn retain(&mut self, mut keep: impl FnMut(&BackendKey) -> bool) {
        self.backends.retain(|k, _| keep(k));
    }

    /// Records a part of `key`'s sample, taken at `at`; clears that source's error.
    pub fn update(&mut self, key: &BackendKey, source: Source, part: Sample, at: Instant) {
        let b = self.backend(key);
        b.parts.insert(source, (part, at));
        b.errors.remove(&source);
        b.failing_since.remove(&source);
    }

    /// Records a failure of `source` for `key` at `at`. Its last good part stays in use
    /// until it goes stale: one failed scrape does not make a backend unknown.
    pub fn record_error(
        &mut self,
        key: &BackendKey,
        source: Source,
        msg: impl Into<String>,
        at: Instant,
    ) {
        let b = self.backend(key);
        b.errors.insert(source, (msg.into(), at));
        if !b.parts.contains_key(&source) {
            b.failing_since.entry(source).or_insert(at);
        }
    }

    pub fn view(&self, key: &BackendKey, now: Instant) -> BackendTelemetry {
        let Some(b) = self.backends.get(key) else {
            return BackendTelemetry::default();
        };
        let age_of = |s: &Source| {
            b.parts
                .get(s)
                .map(|(_, at)| now.saturating_duration_since(*at))
        };
        let mut sample = Sample::default();
        for (source, (part, _)) in &b.parts {
            if age_of(source).is_some_and(|a| a <= self.stale_after) {
                sample.overlay(part);
            }
        }
        let ages: Option<Vec<Duration>> = b.configured.iter().map(age_of).collect();
        let age = ages.and_then(|a| a.into_iter().max());
        let stale = b.configured.iter().any(|s| match age_of(s) {
            Some(a) => a > self.stale_after,
            None => b
                .failing_since
                .get(s)
                .is_none_or(|t| now.saturating_duration_since(*t) > self.stale_after),
        });
        BackendTelemetry {
            sample,
            age,
            stale,
            errors: b
                .errors
                .iter()
                .map(|(s, (e, at))| {
                    let ago = now.saturating_duration_since(*at).as_secs_f64();
                    format!("{s}: {e} ({ago:.1}s ago)")
                })
                .collect(),
        }
    }

    /// Every configured scraped source has reported, a part or an error, at or after `t`:
    /// the scrape round that began at `t` is in. Pushes come when they come; no round waits
    /// for them.
    pub fn reported_since(&self, t: Instant) -> bool {
        self.backends.values().all(|b| {
            b.configured
                .iter()
                .filter(|s| **s != Source::Push)
                .all(|s| {
                    let since = |at: &Instant| *at >= t;
                    b.parts.get(s).is_some_and(|(_, at)| since(at))
                        || b.errors.get(s).is_some_and(|(_, at)| since(at))
                })
        })
    }

    /// Every backend the hub knows, configured or pushed to.
    pub fn keys(&self) -> impl Iterator<Item = &BackendKey> {
        self.backends.keys()
    }

    fn backend(&mut self, key: &BackendKey) -> &mut Backend {
        self.backends.entry(key.clone()).or_default()
    }
}

/// `Option<Duration>` as seconds (a float) or null.
mod opt_secs {
    use std::time::Duration;

    use serde::Serializer;

    pub fn serialize<S: Serializer>(d: &Option<Duration>, s: S) -> Result<S::Ok, S::Error> {
        match d {
            Some(d) => s.serialize_some(&d.as_secs_f64()),
            None => s.serialize_none(),
        }
    }
}

#[cfg(test)]
mod tests {
    use std::net::IpAddr;

    use super::*;

    const STALE: Duration = Duration::from_secs(3);

    #[test]
    fn a_failed_first_scrape_is_not_stale_until_stale_after_from_the_failure() {
        let t0 = Instant::now();
        let mut hub = Hub::new(STALE);
        let k = key("10.0.0.1");
        hub.configure(k.clone(), BTreeSet::from([Source::Dcgm]));
        assert!(hub.view(&k, t0).stale, "not yet scraped: unknown");
        hub.record_error(&k, Source::Dcgm, "no complete response within 200ms", t0);
        hub.record_error(
            &k,
            Source::Dcgm,
            "no complete response within 200ms",
            secs(t0, 2.0),
        );
        assert!(!hub.view(&k, secs(t0, 2.5)).stale, "failing for 2.5 s of 3");
        assert!(hub.view(&k, secs(t0, 3.5)).stale, "failing for 3.5 s of 3");
        hub.update(&k, Source::Dcgm, gpu(50.0), secs(t0, 4.0));
        assert!(!hub.view(&k, secs(t0, 4.0)).stale);
    }

    fn key(addr: &str) -> BackendKey {
        ("chat".to_owned(), addr.parse::<IpAddr>().unwrap())
    }

    fn secs(t0: Instant, s: f64) -> Instant {
        t0 + Duration::from_secs_f64(s)
    }

    fn gpu(util: f64) -> Sample {
        Sample {
            gpu_util: Some(util),
            gpu_temp_c: Some(60.0),
            ..Sample::default()
        }
    }

    fn engine(queue: f64) -> Sample {
        Sample {
            queue_depth: Some(queue),
            kv_cache: Some(0.5),
            ..Sample::default()
        }
    }

    fn hub_with(sources: &[Source]) -> Hub {
        let mut hub = Hub::new(STALE);
        hub.configure(key("10.1.0.1"), sources.iter().copied().collect());
        hub
    }

    #[test]
    fn a_round_is_in_when_every_scraped_source_reported_a_part_or_an_error_since_it_began() {
        let t0 = Instant::now();
        let round = secs(t0, 1.0);
        let (a, b) = (key("10.1.0.1"), key("10.1.0.2"));
        let mut hub = Hub::new(STALE);
        hub.configure(a.clone(), BTreeSet::from([Source::Dcgm, Source::Engine]));
        hub.configure(b.clone(), BTreeSet::from([Source::Roce]));
        // The round before: all in, but older than the round.
        hub.update(&a, Source::Dcgm, gpu(0.5), t0);
        hub.update(&a, Source::Engine, engine(1.0), t0);
        hub.update(&b, Source::Roce, Sample::default(), t0);
        assert!(hub.reported_since(t0));
        assert!(!hub.reported_since(round), "nothing of the round yet");
        hub.update(&a, Source::Dcgm, gpu(0.6), secs(t0, 1.01));
        hub.record_error(&b, Source::Roce, "connection refused", secs(t0, 1.02));
        assert!(!hub.reported_since(round), "a's engine has not reported");
        hub.update(&a, Source::Engine, engine(2.0), secs(t0, 1.03));
        assert!(hub.reported_since(round), "a failure reports too");
        // A backend that pushes is not waited for.
        hub.push(&key("10.1.0.3"), gpu(0.1), t0);
        assert!(hub.reported_since(round));
    }

    #[test]
    fn never_reported_is_stale_and_ageless() {
        let t0 = Instant::now();
        let hub = hub_with(&[Source::Dcgm, Source::Engine]);
        let v = hub.view(&key("10.1.0.1"), t0);
        assert_eq!(
            v,
            BackendTelemetry {
                stale: true,
                ..Default::default()
            }
        );
    }

    #[test]
    fn merge_age_and_staleness() {
        let t0 = Instant::now();
        let k = key("10.1.0.1");
        let mut hub = hub_with(&[Source::Dcgm, Source::Engine]);
        hub.update(&k, Source::Dcgm, gpu(0.9), secs(t0, 0.0));
        // One of two sources: still stale, no age (the engine has never reported).
        let v = hub.view(&k, secs(t0, 0.5));
        assert!(v.stale);
        assert_eq!(v.age, None);
        assert_eq!(v.sample, gpu(0.9));

        hub.update(&k, Source::Engine, engine(4.0), secs(t0, 1.0));
        let v = hub.view(&k, secs(t0, 2.0));
        assert!(!v.stale);
        assert_eq!(v.age, Some(Duration::from_secs(2)));
        let mut both = gpu(0.9);
        both.overlay(&engine(4.0));
        assert_eq!(v.sample, both);

        // At exactly stale_after the DCGM part is still fresh; just past it, it is dropped
        // from the sample and the backend is stale.
        assert!(!hub.view(&k, secs(t0, 3.0)).stale);
        let v = hub.view(&k, secs(t0, 3.5));
        assert!(v.stale);
        assert_eq!(v.age, Some(Duration::from_secs_f64(3.5)));
        assert_eq!(v.sample, engine(4.0));
    }

    #[test]
    fn a_backend_that_pushed_goes_stale_when_pushes_stop_even_after_a_reload() {
        let t0 = Instant::now();
        let k = key("10.1.0.9");
        let mut hub = hub_with(&[]);
        hub.push(&k, gpu(0.4), t0);
        let v = hub.view(&k, secs(t0, 0.5));
        assert_eq!((v.stale, v.sample), (false, gpu(0.4)));
        hub.configure(k.clone(), BTreeSet::new());
        assert!(hub.view(&k, secs(t0, 60.0)).stale, "pushes stopped: stale");
    }

    #[test]
    fn errors_keep_the_last_good_part_until_stale() {
        let t0 = Instant::now();
        let k = key("10.1.0.1");
        let mut hub = hub_with(&[Source::Dcgm]);
        hub.update(&k, Source::Dcgm, gpu(0.5), t0);
        hub.record_error(&k, Source::Dcgm, "HTTP 500 Internal Server Error", t0);
        let v = hub.view(&k, secs(t0, 1.0));
        assert_eq!((v.stale, v.sample), (false, gpu(0.5)));
        assert_eq!(
            v.errors,
            vec!["dcgm: HTTP 500 Internal Server Error (1.0s ago)"]
        );
        let v = hub.view(&k, secs(t0, 4.0));
        assert!(v.stale);
        assert_eq!(v.sample, Sample::default());
        // A good part clears the error.
        hub.update(&k, Source::Dcgm, gpu(0.6), secs(t0, 4.0));
        let v = hub.view(&k, secs(t0, 4.0));
        assert_eq!((v.stale, v.errors.len()), (false, 0));
    }

    #[test]
    fn push_overrides_and_is_only_expected_when_configured() {
        let t0 = Instant::now();
        let k = key("10.1.0.1");
        let mut hub = hub_with(&[Source::Dcgm]);
        hub.update(&k, Source::Dcgm, gpu(0.5), t0);
        hub.update(&k, Source::Push, gpu(0.95), t0);
        assert_eq!(hub.view(&k, t0).sample.gpu_util, Some(0.95));
        // Unconfigured, an old push drops out of the sample without making the backend stale.
        hub.update(&k, Source::Dcgm, gpu(0.5), secs(t0, 5.0));
        let v = hub.view(&k, secs(t0, 5.0));
        assert_eq!((v.stale, v.sample.gpu_util), (false, Some(0.5)));
        assert_eq!(v.age, Some(Duration::ZERO));
        // Configured, it is expected like a scraped source.
        hub.configure(k.clone(), [Source::Dcgm, Source::Push].into());
        assert!(hub.view(&k, secs(t0, 5.0)).stale);
    }

    #[test]
    fn push_to_an_unconfigured_backend() {
        let t0 = Instant::now();
        let k = key("2001:db8::1");
        let mut hub = Hub::new(STALE);
        assert_eq!(hub.view(&k, t0), BackendTelemetry::default());
        hub.update(&k, Source::Push, engine(2.0), t0);
        let v = hub.view(&k, secs(t0, 1.0));
        assert_eq!((v.sample, v.stale, v.age), (engine(2.0), false, None));
        assert_eq!(hub.keys().collect::<Vec<_>>(), vec![&k]);
    }

    #[test]
    fn reconfigure_keeps_fresh_parts_and_drops_removed_sources() {
        let t0 = Instant::now();
        let k = key("10.1.0.1");
        let mut hub = hub_with(&[Source::Dcgm, Source::Engine]);
        hub.update(&k, Source::Dcgm, gpu(0.5), t0);
        hub.update(&k, Source::Engine, engine(1.0), t0);
        hub.update(&k, Source::Push, Sample::default(), t0);
        hub.record_error(&k, Source::Engine, "timeout", t0);
        hub.configure(k.clone(), [Source::Dcgm].into());
        let v = hub.view(&k, t0);
        assert_eq!((v.sample, v.stale, v.errors.len()), (gpu(0.5), false, 0));
        hub.retain(|key| key.1 != k.1);
        assert_eq!(hub.keys().count(), 0);
    }

    #[test]
    fn a_part_from_the_future_counts_as_fresh() {
        let t0 = Instant::now();
        let k = key("10.1.0.1");
        let mut hub = hub_with(&[Source::Roce]);
        hub.update(&k, Source::Roce, Sample::default(), secs(t0, 2.0));
        assert_eq!(hub.view(&k, t0).age, Some(Duration::ZERO));
    }

    #[test]
    fn serializes_age_in_seconds() {
        let v = BackendTelemetry {
            age: Some(Duration::from_millis(1500)),
            errors: vec!["engine: timeout".into()],
            ..Default::default()
        };
        let json = serde_json::to_value(&v).unwrap();
        assert_eq!(json["age"], 1.5);
        assert_eq!(json["stale"], false);
        assert_eq!(json["errors"][0], "engine: timeout");
        assert!(json["sample"]["gpu_util"].is_null());
    }
}
