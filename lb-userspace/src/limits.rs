//! What a local user can take from the daemon is bounded: connections per listener and per
//! peer, the time a request and an idle keep-alive connection may hold one, and the
//! open-file limit is raised at start to what the configuration needs, so that no number
//! of metrics or admin clients can leave the health checks without a descriptor.

use std::{
    net::IpAddr,
    sync::atomic::{AtomicU64, Ordering},
    time::Duration,
};

use anyhow::{bail, Result};

use crate::config::Config;

/// The bounds of one listener.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ListenerLimits {
    /// Open connections at once; more are answered 503 and closed at once (and counted).
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

/// The metrics port (every local user can reach it): a few Prometheus servers. Every
/// connection from this host counts as one peer ([`ScrapePeer`]), so local users together
/// hold at most `max_per_peer` slots and the rest stay for scrapers on other hosts.
pub const METRICS: ListenerLimits = ListenerLimits {
    max_connections: 64,
    max_per_peer: 16,
    request_timeout: Duration::from_secs(10),
};

/// Whom a metrics connection is counted for. A local user can connect from any address
/// of 127.0.0.0/8 (and ::1, and their IPv4-mapped forms) or from the address the listener
/// answers on; counted per address, 64 such sources would take every slot. So all of
/// them are one peer, and each other host is a peer of its own.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum ScrapePeer {
    /// This host: a loopback source, or the connection's own local address.
    Local,
    Remote(IpAddr),
}

impl ScrapePeer {
    /// The peer a connection from `peer` to `local` is counted for.
    pub fn of(peer: IpAddr, local: IpAddr) -> ScrapePeer {
        let peer = peer.to_canonical();
        if peer.is_loopback() || peer == local.to_canonical() {
            ScrapePeer::Local
        } else {
            ScrapePeer::Remote(peer)
        }
    }
}

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

    /// A local user connecting from all of 127.0.0.0/8, ::1, their IPv4-mapped forms and
    /// the listener's own address holds one peer's slots; scrapers on other hosts keep
    /// the rest.
    #[test]
    fn local_users_share_one_metrics_peer() {
        use crate::http_server::Slots;
        let listen: IpAddr = "10.0.0.1".parse().unwrap();
        let mut slots = Slots::default();
        let mut local = 0;
        let sources = (0..=255u8).map(|a| IpAddr::from([127, 0, a, 1])).chain(
            ["::1", "::ffff:127.0.0.9", "10.0.0.1", "::ffff:10.0.0.1"].map(|a| a.parse().unwrap()),
        );
        for src in sources {
            assert_eq!(ScrapePeer::of(src, listen), ScrapePeer::Local, "{src}");
            for _ in 0..METRICS.max_per_peer {
                local += usize::from(slots.take(&METRICS, &ScrapePeer::of(src, listen)).is_ok());
            }
        }
        assert_eq!(local, METRICS.max_per_peer);
        let remote_slots = METRICS.max_connections - METRICS.max_per_peer;
        let mut remote = 0;
        for host in 1..=8u8 {
            let peer = ScrapePeer::of(IpAddr::from([10, 9, 0, host]), listen);
            assert_eq!(peer, ScrapePeer::Remote(IpAddr::from([10, 9, 0, host])));
            for _ in 0..METRICS.max_per_peer {
                remote += usize::from(slots.take(&METRICS, &peer).is_ok());
            }
        }
        assert_eq!(remote, remote_slots);
        // A slot given back is taken again.
        let peer = ScrapePeer::Remote(IpAddr::from([10, 9, 0, 1]));
        slots.give_back(&peer);
        assert!(slots
            .take(&METRICS, &ScrapePeer::Remote(IpAddr::from([10, 9, 0, 7])))
            .is_ok());
        assert_eq!(
            slots.take(&METRICS, &peer),
            Err((METRICS.max_connections, METRICS.max_per_peer - 1))
        );
    }

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
