//! `[bgp]`: the BGP speaker this host drives (BIRD 2) and how often the announcement is
//! re-decided. Parsed and checked here; config.rs only hooks the section in.

use std::{path::PathBuf, time::Duration};

use serde::{Deserialize, Serialize};

use super::rules;

/// `[bgp]`, validated.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub struct BgpConfig {
    /// BIRD's control socket (`bird -s`; Debian: /run/bird/bird.ctl).
    pub control_socket: PathBuf,
    /// The file Sluice writes its static routes into; bird.conf must `include` it.
    pub routes_file: PathBuf,
    /// How often the announcement is re-decided (also at once after every change).
    #[serde(serialize_with = "humantime_str")]
    pub interval: Duration,
}

impl BgpConfig {
    pub const DEFAULT_SOCKET: &str = "/run/bird/bird.ctl";
    pub const DEFAULT_ROUTES: &str = "/var/lib/sluice/bird-vips.conf";
    pub const DEFAULT_INTERVAL: Duration = Duration::from_secs(1);
}

fn humantime_str<S: serde::Serializer>(d: &Duration, s: S) -> Result<S::Ok, S::Error> {
    s.collect_str(&humantime::format_duration(*d))
}

/// `[bgp]` as written.
#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RawBgp {
    control_socket: Option<String>,
    routes_file: Option<String>,
    interval: Option<String>,
}

fn abs(key: &str, v: Option<&str>, default: &str) -> Result<PathBuf, (String, String)> {
    let s = v.unwrap_or(default);
    if s.starts_with('/') {
        Ok(PathBuf::from(s))
    } else {
        Err((
            key.into(),
            format!("{s:?} is not an absolute path; allowed: an absolute path, e.g. {default:?}"),
        ))
    }
}

impl RawBgp {
    /// The section, or every (key, problem) found.
    pub fn validate(self) -> Result<BgpConfig, Vec<(String, String)>> {
        let socket = abs(
            "control_socket",
            self.control_socket.as_deref(),
            BgpConfig::DEFAULT_SOCKET,
        );
        let routes = abs(
            "routes_file",
            self.routes_file.as_deref(),
            BgpConfig::DEFAULT_ROUTES,
        );
        let interval = match self.interval.as_deref() {
            None => Ok(BgpConfig::DEFAULT_INTERVAL),
            Some(s) => match rules::duration(s) {
                Ok(d) if d >= Duration::from_millis(10) && d <= Duration::from_secs(60) => Ok(d),
                Ok(_) => Err((
                    "interval".to_string(),
                    format!("{s:?} is out of range; allowed: 10ms..=60s, e.g. \"1s\""),
                )),
                Err(e) => Err(("interval".to_string(), e)),
            },
        };
        match (socket, routes, interval) {
            (Ok(control_socket), Ok(routes_file), Ok(interval)) => Ok(BgpConfig {
                control_socket,
                routes_file,
                interval,
            }),
            (a, b, c) => Err([a.err(), b.err(), c.err()].into_iter().flatten().collect()),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn raw(text: &str) -> RawBgp {
        toml::from_str(text).unwrap()
    }

    #[test]
    fn defaults_and_every_problem_named() {
        let d = raw("").validate().unwrap();
        assert_eq!(d.control_socket, PathBuf::from("/run/bird/bird.ctl"));
        assert_eq!(d.interval, Duration::from_secs(1));
        let errs = raw("control_socket = \"bird.ctl\"\ninterval = \"5ms\"")
            .validate()
            .unwrap_err();
        let keys: Vec<&str> = errs.iter().map(|(k, _)| k.as_str()).collect();
        assert_eq!(keys, ["control_socket", "interval"]);
        assert!(errs[1].1.contains("10ms..=60s"), "{errs:?}");
        assert!(toml::from_str::<RawBgp>("speaker = \"x\"").is_err());
    }
}
