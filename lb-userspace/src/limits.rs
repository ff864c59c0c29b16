//! What a local user can take from the daemon is bounded: connections per listener and per
//! peer, the time a request and an idle keep-alive connection may hold one, and the
//! open-file limit is raised at start to what the configuration needs, so that no number
//! of metrics or admin clients can leave the health checks without a descriptor.

use std::{
    sync::atomic::{AtomicU64, Ordering},
    time::Duration,
};

use anyhow::{bail, Result};

use crate::config::Config;

/// The bounds of one listener.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ListenerLimits {
    /// Open connections at once; more are accepted and closed at once (and counted).
    pub max_connections: usize,
    /// Open connections of one peer (a uid on the admin socket, an address on the metrics
    /// port), so one user cannot take every slot.
    pub max_per_peer: usize,
    /// A request's headers must arrive within this, and its body and answer within this
    /// again (a client that sends headers and part of a body is cut off); also how long a
    /// keep-alive connection may sit idle between requests.
    pub request_timeout: Duration,
}

/// The admin socket: operators and their tools, a handful at a time.
pub const ADMIN: ListenerLimits = ListenerLimits {
    max_connections: 64,
    max_per_peer: 16,
    request_timeout: Duration::from_secs(10),
};

/// The metrics port (every local user can reach it): a few Prometheus servers.
pub const METRICS: ListenerLimits = ListenerLimits {
    max_connections: 64,
    max_per_peer: 16,
    request_timeout: Duration::from_secs(10),
};

/// Connections refused by a listener's caps, per listener (exported as
/// `sluice_listener_refused_connections_total`).
#[derive(Debug, Default)]
pub struct Refused {
    pub admin: AtomicU64,
    pub metrics: AtomicU64,
}

impl Refused {
    pub fn get(&self) -> (u64, u64) {
        (
            self.admin.load(Ordering::Relaxed),
            self.metrics.load(Ordering::Relaxed),
        )
    }
}

/// Descriptors the daemon needs at most with `cfg`: a fixed part (maps, programs, links,
/// the runtime, log and state files), both listeners full, one health probe per backend at
/// once, and the scrapers (one kept-alive connection per endpoint plus one in flight per
/// concurrent scrape). Doubled for what this does not see (DNS, a slow close).
pub fn fds_needed(cfg: &Config) -> u64 {
    const FIXED: u64 = 256;
    let backends: usize = cfg.vips.iter().map(|v| v.backends.len()).sum();
    let endpoints: usize = cfg
        .vips
        .iter()
        .flat_map(|v| &v.backends)
        .map(|b| {
            usize::from(b.dcgm.is_some())
                + usize::from(b.engine.is_some())
                + usize::from(b.roce.is_some())
        })
        .sum();
    let listeners = ADMIN.max_connections + METRICS.max_connections + 2;
    let n = listeners + backends + endpoints + cfg.telemetry.max_concurrent_scrapes as usize;
    2 * (FIXED + n as u64)
}

/// The soft limit to set: at least `needed`, within the hard limit (which root may raise).
/// Never lowers a limit already above what is needed.
pub fn nofile_target(needed: u64, soft: u64, hard: u64, may_raise_hard: bool) -> (u64, u64) {
    let hard = if hard < needed && may_raise_hard {
        needed
    } else {
        hard
    };
    (soft.max(needed.min(hard)), hard)
}

/// Raises RLIMIT_NOFILE to what `cfg` needs (systemd's default soft limit is 1024);
/// returns the soft limit now in force. Fails when the hard limit is too low and cannot be
/// raised, saying what to set.
pub fn raise_nofile(cfg: &Config) -> Result<u64> {
    let needed = fds_needed(cfg);
    let mut lim = libc::rlimit {
        rlim_cur: 0,
        rlim_max: 0,
    };
    // SAFETY: a valid pointer to an rlimit.
    if unsafe { libc::getrlimit(libc::RLIMIT_NOFILE, &mut lim) } != 0 {
        bail!("getrlimit: {}", std::io::Error::last_os_error());
    }
    // SAFETY: no arguments.
    let root = unsafe { libc::geteuid() } == 0;
    let (soft, hard) = nofile_target(needed, lim.rlim_cur, lim.rlim_max, root);
    if (soft, hard) != (lim.rlim_cur, lim.rlim_max) {
        let new = libc::rlimit {
            rlim_cur: soft,
            rlim_max: hard,
        };
        // SAFETY: a valid pointer to an rlimit.
        if unsafe { libc::setrlimit(libc::RLIMIT_NOFILE, &new) } != 0 {
            bail!(
                "setting RLIMIT_NOFILE to {soft} (hard {hard}): {}",
                std::io::Error::last_os_error()
            );
        }
    }
    if soft < needed {
        bail!(
            "this configuration needs up to {needed} open files but the hard limit is {hard}: \
             raise it (LimitNOFILE={needed} in the systemd unit, or `ulimit -Hn {needed}`)"
        );
    }
    Ok(soft)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn nofile_is_raised_within_the_hard_limit_and_never_lowered() {
        assert_eq!(nofile_target(1000, 1024, 524_288, false), (1024, 524_288));
        assert_eq!(nofile_target(4000, 1024, 524_288, false), (4000, 524_288));
        assert_eq!(nofile_target(4000, 1024, 2048, false), (2048, 2048));
        assert_eq!(nofile_target(4000, 1024, 2048, true), (4000, 4000));
        assert_eq!(nofile_target(4000, 65_536, 65_536, false), (65_536, 65_536));
    }

    #[test]
    fn needs_grow_with_the_configuration() {
        let base = crate::config::parse(
            "[dataplane]\ninterfaces = [{ name = \"eth0\" }]\nhash_seed = 1\n",
            "t.toml",
        )
        .unwrap();
        let mut more = base.clone();
        let example = crate::config::load(std::path::Path::new(concat!(
            env!("CARGO_MANIFEST_DIR"),
            "/../configs/sluice.toml"
        )))
        .unwrap();
        more.vips = example.vips;
        assert!(fds_needed(&more) > fds_needed(&base));
        // Both listeners full fit with room to spare under systemd's 1024.
        assert!(fds_needed(&base) < 1024, "{}", fds_needed(&base));
    }
}
