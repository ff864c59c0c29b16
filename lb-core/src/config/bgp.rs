//! `[bgp]`: the BGP speaker this host drives (BIRD 2) and how often the announcement is
//! re-decided.

use std::{
    path::{Path, PathBuf},
    time::Duration,
};

use serde::{Deserialize, Serialize};

use super::{Checker, KeyPath};

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

/// The section written as `[bgp]` with no keys.
impl Default for BgpConfig {
    fn default() -> Self {
        BgpConfig {
            control_socket: PathBuf::from(Self::DEFAULT_SOCKET),
            routes_file: PathBuf::from(Self::DEFAULT_ROUTES),
            interval: Self::DEFAULT_INTERVAL,
        }
    }
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

/// Checks `[bgp]` at `p`, recording every problem in `c`.
pub(super) fn bgp(c: &mut Checker, p: &KeyPath, r: RawBgp) -> Option<BgpConfig> {
    let control_socket = c.abs_path(
        &p.key("control_socket"),
        r.control_socket.as_deref(),
        Path::new(BgpConfig::DEFAULT_SOCKET),
    );
    let routes_file = c.abs_path(
        &p.key("routes_file"),
        r.routes_file.as_deref(),
        Path::new(BgpConfig::DEFAULT_ROUTES),
    );
    let interval = c.duration_in(
        &p.key("interval"),
        r.interval.as_deref(),
        BgpConfig::DEFAULT_INTERVAL,
        Duration::from_millis(10)..=Duration::from_secs(60),
        "1s",
    );
    Some(BgpConfig {
        control_socket: control_socket?,
        routes_file: routes_file?,
        interval: interval?,
    })
}
