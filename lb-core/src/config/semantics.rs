//! Stage 3: ranges, formats, uniqueness and cross-key rules, on the raw tables.

use std::ops::RangeInclusive;

use super::*;

mod host;
mod steering;
mod tenants;
mod vips;

pub(super) use self::tenants::tenants;
use self::{host::*, steering::*, tenants::*, vips::*};

// ------------------------------------------------------------------------------------------
// Stage 3: semantics
// ------------------------------------------------------------------------------------------

/// Collected problems, each with its key path.
#[derive(Default)]
pub(super) struct Checker {
    issues: Found,
    warnings: Found,
}

pub(super) const DURATION_ALLOWED: &str =
    "allowed: a number and a unit (ns, us, ms, s, m, h, d), e.g. \"500ms\", \"10s\", \"5m\"";

impl Checker {
    /// The errors and the warnings found.
    pub(super) fn into_found(self) -> (Found, Found) {
        (self.issues, self.warnings)
    }

    pub(super) fn err(&mut self, path: &KeyPath, msg: impl Into<String>) {
        self.issues.push((path.clone(), msg.into()));
    }

    pub(super) fn warn(&mut self, path: &KeyPath, msg: impl Into<String>) {
        self.warnings.push((path.clone(), msg.into()));
    }

    pub(super) fn missing(&mut self, path: &KeyPath, allowed: &str) {
        self.err(path, format!("missing (required); allowed: {allowed}"));
    }

    /// An integer in `lo..=hi`; `None` (after recording why) when out of range.
    pub(super) fn int<T: TryFrom<i64>>(
        &mut self,
        path: &KeyPath,
        v: Option<Int>,
        default: T,
        lo: i64,
        hi: i64,
        note: &str,
    ) -> Option<T> {
        let Some(Int(v)) = v else {
            return Some(default);
        };
        if let Err(e) = rules::in_range(v, lo, hi, note) {
            self.err(path, e);
            return None;
        }
        // Every caller's range lies within T.
        T::try_from(v).ok()
    }

    /// A finite number accepted by `ok`.
    pub(super) fn num(
        &mut self,
        path: &KeyPath,
        v: Option<Num>,
        default: f64,
        ok: impl Fn(f64) -> bool,
        allowed: &str,
    ) -> Option<f64> {
        let Some(Num(v)) = v else {
            return Some(default);
        };
        if v.is_finite() && ok(v) {
            Some(v)
        } else {
            self.err(path, format!("{v:?} is out of range; allowed: {allowed}"));
            None
        }
    }

    pub(super) fn duration(
        &mut self,
        path: &KeyPath,
        v: Option<&str>,
        default: Duration,
    ) -> Option<Duration> {
        let Some(s) = v else {
            return Some(default);
        };
        match humantime::parse_duration(s) {
            Ok(d) => match rules::bounded(d) {
                Ok(d) => Some(d),
                Err(e) => {
                    self.err(path, format!("{s:?} {e}"));
                    None
                }
            },
            Err(_) => {
                self.err(path, format!("{s:?} is not a duration; {DURATION_ALLOWED}"));
                None
            }
        }
    }

    /// A duration strictly greater than zero.
    pub(super) fn positive(
        &mut self,
        path: &KeyPath,
        v: Option<&str>,
        default: Duration,
    ) -> Option<Duration> {
        let d = self.duration(path, v, default)?;
        if d.is_zero() {
            self.err(
                path,
                format!(
                    "{:?} is zero; allowed: a duration greater than 0s, e.g. \"1s\"",
                    v.unwrap_or("0s")
                ),
            );
            return None;
        }
        Some(d)
    }

    pub(super) fn keyword<K: Keyword + FromStr<Err = UnknownKeyword>>(
        &mut self,
        path: &KeyPath,
        v: Option<&str>,
        default: K,
    ) -> Option<K> {
        let Some(s) = v else {
            return Some(default);
        };
        match s.parse::<K>() {
            Ok(k) => Some(k),
            Err(e) => {
                self.err(path, e.to_string());
                None
            }
        }
    }

    pub(super) fn abs_path(
        &mut self,
        path: &KeyPath,
        v: Option<&str>,
        default: &Path,
    ) -> Option<PathBuf> {
        let Some(s) = v else {
            return Some(default.to_owned());
        };
        if s.starts_with('/') {
            Some(PathBuf::from(s))
        } else {
            self.err(
                path,
                format!("{s:?} is not an absolute path; allowed: a path starting with \"/\""),
            );
            None
        }
    }

    /// A unicast IP address.
    pub(super) fn ip(&mut self, path: &KeyPath, v: Option<&str>, example: &str) -> Option<IpAddr> {
        let Some(s) = v else {
            self.missing(
                path,
                &format!("an IPv4 or IPv6 address such as {example:?}"),
            );
            return None;
        };
        let Ok(ip) = s.parse::<IpAddr>() else {
            self.err(
                path,
                format!(
                    "{s:?} is not an IP address; allowed: an IPv4 or IPv6 address such as \
                     {example:?}"
                ),
            );
            return None;
        };
        match rules::unicast(ip) {
            Ok(()) => Some(ip),
            Err(e) => {
                self.err(path, e);
                None
            }
        }
    }

    /// Records `r`'s error at `path`; whether it passed.
    pub(super) fn rule(&mut self, path: &KeyPath, r: Result<(), String>) -> bool {
        r.map_err(|e| self.err(path, e)).is_ok()
    }

    /// An `http://` URL, fetched as `by` says. Refused here rather
    /// than fetched with TLS: exporters (dcgm-exporter, vLLM, SGLang, node_exporter) and etcd's
    /// gateway serve plain HTTP on the backend network, and a URL that passed here but failed
    /// later would stop `sluice run` after the XDP attach.
    pub(super) fn url(&mut self, path: &KeyPath, v: Option<&str>, by: &UrlUse) -> Option<HttpUrl> {
        let allowed = format!("allowed: an http:// URL such as {:?}", by.example);
        let Some(s) = v else {
            self.missing(path, &allowed["allowed: ".len()..]);
            return None;
        };
        match HttpUrl::parse(s) {
            Ok(url) => Some(url),
            Err(UrlError::Https) => {
                self.err(
                    path,
                    format!(
                        "{s:?} is https, which {} does not speak; {allowed} ({} plain-HTTP \
                         port, or a local proxy in front of a TLS one)",
                        by.client, by.server
                    ),
                );
                None
            }
            Err(UrlError::Invalid) => {
                self.err(path, format!("{s:?} is not a valid URL; {allowed}"));
                None
            }
        }
    }

    /// A duration within `range` (`example` shows one).
    pub(super) fn duration_in(
        &mut self,
        path: &KeyPath,
        v: Option<&str>,
        default: Duration,
        range: RangeInclusive<Duration>,
        example: &str,
    ) -> Option<Duration> {
        let d = self.duration(path, v, default)?;
        if range.contains(&d) {
            return Some(d);
        }
        self.err(
            path,
            format!(
                "{:?} is out of range; allowed: {}..={}, e.g. {example:?}",
                v.unwrap_or_default(),
                humantime::format_duration(*range.start()),
                humantime::format_duration(*range.end())
            ),
        );
        None
    }
}

/// Who fetches a URL key's value and from what, with an example value (for the messages).
pub(super) struct UrlUse {
    pub(super) client: &'static str,
    pub(super) server: &'static str,
    pub(super) example: &'static str,
}

/// Smallest prime >= n, capped at the largest ring.
pub(super) fn prime_at_least(n: u32) -> u32 {
    (n..RING_SIZE_MAX)
        .find(|&p| is_prime(p))
        .unwrap_or(RING_SIZE_MAX)
}

/// Problems found, each with its key path.
pub(super) type Found = Vec<(KeyPath, String)>;

/// The configuration (when every part is valid), its errors and its warnings.
pub(super) fn validate(raw: RawConfig) -> (Option<Config>, Found, Found) {
    let mut c = Checker::default();
    let root = KeyPath::default();
    let daemon = daemon(&mut c, &root.key("daemon"), raw.daemon.unwrap_or_default());
    let admin = admin(&mut c, &root.key("admin"), raw.admin.unwrap_or_default());
    let metrics = metrics(
        &mut c,
        &root.key("metrics"),
        raw.metrics.unwrap_or_default(),
    );
    // What the VIP checks need from [dataplane], taken before it is validated so they run
    // even when some other dataplane key is wrong.
    let raw_max_vips = raw.dataplane.as_ref().and_then(|d| match d.max_vips {
        None => Some(DataplaneConfig::DEFAULT_MAX_VIPS),
        Some(Int(v)) => u32::try_from(v).ok().filter(|v| (1..=MAX_VIPS).contains(v)),
    });
    let encap_present = raw.dataplane.as_ref().map_or((false, false), |d| {
        (d.encap_source_v4.is_some(), d.encap_source_v6.is_some())
    });
    let dataplane = match raw.dataplane {
        Some(d) => dataplane(&mut c, &root.key("dataplane"), d),
        None => {
            c.err(
                &root.key("dataplane"),
                "missing (required); allowed: a [dataplane] table with at least `interfaces` \
                 and `hash_seed`",
            );
            None
        }
    };
    let max_vips = match &dataplane {
        Some(d) => Some(d.max_vips),
        None => raw_max_vips,
    };
    let vips = vips(&mut c, &root, raw.vip, max_vips, encap_present);
    let health = health(&mut c, &root.key("health"), raw.health.unwrap_or_default());
    let telemetry = telemetry(
        &mut c,
        &root.key("telemetry"),
        raw.telemetry.unwrap_or_default(),
    );
    let policy = policy(&mut c, &root.key("policy"), raw.policy.unwrap_or_default());
    let bgp = raw
        .bgp
        .map(|r| super::bgp::bgp(&mut c, &root.key("bgp"), r));
    let fleet = raw
        .fleet
        .map(|r| super::fleet::fleet(&mut c, &root.key("fleet"), r));
    let tenants = tenants(&mut c, &root, raw.tenant);
    let overrides_ok = match (&vips, &tenants) {
        (Some(v), Some(t)) => overrides_known(&mut c, &root, v, t),
        _ => true,
    };
    let config = (|| {
        Some(Config {
            daemon: daemon?,
            admin: admin?,
            metrics: metrics?,
            dataplane: dataplane?,
            vips: vips?,
            health: health?,
            telemetry: telemetry?,
            policy: policy?,
            // An absent section is None; an invalid one fails the whole file.
            bgp: match bgp {
                Some(b) => Some(b?),
                None => None,
            },
            fleet: match fleet {
                Some(f) => Some(f?),
                None => None,
            },
            tenants: tenants.filter(|_| overrides_ok)?,
        })
    })();
    (config, c.issues, c.warnings)
}
