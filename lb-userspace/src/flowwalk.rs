//! Reading the connection table in bulk, and the background walker that keeps the active-flow
//! counts, so `sluice backend list`, a metrics scrape and a policy step cost the same with a
//! million flows as with none.
//!
//! A walk reads the table with `BPF_MAP_LOOKUP_BATCH` (thousands of entries per syscall; one
//! entry per syscall made a 1M-entry walk take seconds, see `cargo xtask bench reads`). The
//! walker repeats walks on its own thread and publishes each result; readers take the latest.
//! Walks are paced by the CPU time they take so they use at most 1/`DUTY` of a core: a table
//! whose walk costs 100 ms of CPU is walked every 4 s, a small one every second. Counts kept by the data plane itself could
//! not say which flows are still active (idle entries leave the LRU only when evicted).

use std::{
    collections::{BTreeMap, HashMap},
    mem::size_of,
    net::IpAddr,
    os::fd::{AsFd, AsRawFd, BorrowedFd, OwnedFd},
    sync::{
        atomic::{AtomicBool, AtomicU64, Ordering},
        Arc, Mutex,
    },
    thread::JoinHandle,
    time::{Duration, Instant},
};

use anyhow::{bail, Context, Result};
use lb_common::{ConnEntry, FlowKey, CONN_F_CLOSED, MAX_BACKENDS};

use crate::config::Cidr;

/// Entries asked for per syscall. Must exceed the longest hash bucket (the kernel answers
/// ENOSPC otherwise; buckets hold a handful of entries).
const CHUNK: usize = 4096;
/// The walker uses at most 1/DUTY of a core.
const DUTY: u32 = 40;
/// Walks are at least this far apart, so counts lag by about this much on small tables.
const MIN_PERIOD: Duration = Duration::from_secs(1);

const BPF_MAP_LOOKUP_BATCH: libc::c_long = 24;

/// The `batch` member of `union bpf_attr`.
#[repr(C)]
#[derive(Default)]
struct BatchAttr {
    in_batch: u64,
    out_batch: u64,
    keys: u64,
    values: u64,
    count: u32,
    map_fd: u32,
    elem_flags: u64,
    flags: u64,
}

/// Calls `f` on every entry of the connection table `fd` (a hash map of `FlowKey` →
/// `ConnEntry`), a chunk per syscall, until `f` returns false. Entries may change during the
/// walk: each is seen at most once, ones added meanwhile may be missed.
pub fn walk(fd: BorrowedFd<'_>, mut f: impl FnMut(&FlowKey, &ConnEntry) -> bool) -> Result<()> {
    let mut keys = vec![FlowKey::default(); CHUNK];
    let mut values = vec![ConnEntry::default(); CHUNK];
    // The hash map's batch cursor is a bucket index.
    let (mut cursor_in, mut cursor_out) = (0u32, 0u32);
    let mut first = true;
    loop {
        let mut attr = BatchAttr {
            in_batch: if first {
                0
            } else {
                &mut cursor_in as *mut u32 as u64
            },
            out_batch: &mut cursor_out as *mut u32 as u64,
            keys: keys.as_mut_ptr() as u64,
            values: values.as_mut_ptr() as u64,
            count: CHUNK as u32,
            map_fd: fd.as_raw_fd() as u32,
            ..Default::default()
        };
        // SAFETY: the attribute points at buffers of `count` keys and values of the map's
        // sizes (checked by the callers' layout check) and at two u32 cursors, all alive
        // across the call.
        let rc = unsafe {
            libc::syscall(
                libc::SYS_bpf,
                BPF_MAP_LOOKUP_BATCH,
                &mut attr as *mut BatchAttr,
                size_of::<BatchAttr>(),
            )
        };
        let err = (rc < 0).then(std::io::Error::last_os_error);
        let done = match &err {
            None => false,
            // ENOENT: the walk reached the end; `count` says what the last call copied.
            Some(e) if e.raw_os_error() == Some(libc::ENOENT) => true,
            Some(e) => bail!("BPF_MAP_LOOKUP_BATCH on the connection table: {e}"),
        };
        let n = attr.count as usize;
        for (k, v) in keys[..n].iter().zip(&values[..n]) {
            if !f(k, v) {
                return Ok(());
            }
        }
        if done {
            return Ok(());
        }
        cursor_in = cursor_out;
        first = false;
    }
}

/// The tenant of a client address by longest prefix match, as the data plane's
/// `TENANT_PREFIXES` trie finds it (0, the default tenant, where no prefix matches).
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct TenantMatcher {
    /// Per prefix length, longest first: the prefixes of that length (address bits above
    /// it) and their tenant.
    v4: Vec<(u32, HashMap<u32, u32>)>,
    v6: Vec<(u32, HashMap<u128, u32>)>,
}

impl TenantMatcher {
    pub fn new(prefixes: &BTreeMap<Cidr, u32>) -> TenantMatcher {
        let mut v4: BTreeMap<u32, HashMap<u32, u32>> = BTreeMap::new();
        let mut v6: BTreeMap<u32, HashMap<u128, u32>> = BTreeMap::new();
        for (c, &id) in prefixes {
            let len = u32::from(c.prefix);
            match c.addr {
                IpAddr::V4(a) => v4.entry(len).or_default().insert(a.into(), id),
                IpAddr::V6(a) => v6.entry(len).or_default().insert(a.into(), id),
            };
        }
        TenantMatcher {
            v4: v4.into_iter().rev().collect(),
            v6: v6.into_iter().rev().collect(),
        }
    }

    pub fn is_empty(&self) -> bool {
        self.v4.is_empty() && self.v6.is_empty()
    }

    /// The tenant of a client as `FlowKey` holds it (`family`, `src`).
    pub fn tenant(&self, family: u8, src: &[u32; 4]) -> u32 {
        let found = match crate::addr::from_words(*src, family) {
            IpAddr::V4(a) => {
                let a = u32::from(a);
                self.v4
                    .iter()
                    .find_map(|(len, m)| m.get(&(a & u32::MAX.checked_shl(32 - len).unwrap_or(0))))
            }
            IpAddr::V6(a) => {
                let a = u128::from(a);
                self.v6.iter().find_map(|(len, m)| {
                    m.get(&(a & u128::MAX.checked_shl(128 - len).unwrap_or(0)))
                })
            }
        };
        found.copied().unwrap_or(0)
    }
}

/// Active connection-table entries per backend, from one walk.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct FlowCounts {
    /// Backend id → entries seen within the idle timeout.
    pub active: BTreeMap<u32, u64>,
    /// (backend id, tenant id) → entries seen within the idle timeout that their client has
    /// not closed (`CONN_F_CLOSED`), where tenants are configured (the client's tenant by
    /// [`TenantMatcher`]).
    pub tenants: BTreeMap<(u32, u32), u64>,
    /// Every entry found, active or not (the table's fill).
    pub entries: u64,
    /// Unix ms when the walk began: flows that arrived after it may be missing.
    pub taken_ms: u64,
    /// How long the walk took (wall clock).
    pub walk: Duration,
    /// CPU time the walk took (this thread's, system time included): what paces walks.
    pub cpu: Duration,
}

/// Active entries per (backend id, tenant id).
type TenantCounts = HashMap<(u32, u32), u64>;

/// Counts entries into a [`FlowCounts`]: an entry is active when it was seen within `idle`
/// of `now_ns` (CLOCK_MONOTONIC, the data plane's clock).
pub struct Tally {
    now_ns: u64,
    idle_ns: u64,
    /// Indexed by backend id (ids are below `MAX_BACKENDS`): no map lookup per entry.
    active: Vec<u64>,
    tenants: Option<(Arc<TenantMatcher>, TenantCounts)>,
    counts: FlowCounts,
}

impl Tally {
    /// With `tenants`, active entries are also counted per (backend, client's tenant).
    pub fn new(
        now_ns: u64,
        idle: Duration,
        taken_ms: u64,
        tenants: Option<Arc<TenantMatcher>>,
    ) -> Tally {
        Tally {
            now_ns,
            idle_ns: crate::config::rules::nanos(idle),
            active: vec![0; MAX_BACKENDS as usize],
            tenants: tenants.map(|m| (m, HashMap::new())),
            counts: FlowCounts {
                taken_ms,
                ..Default::default()
            },
        }
    }

    pub fn add(&mut self, k: &FlowKey, e: &ConnEntry) {
        self.counts.entries += 1;
        if self.now_ns.saturating_sub(e.last_seen_ns) <= self.idle_ns {
            // An id out of range is no backend's (never written by the data plane).
            if let Some(n) = self.active.get_mut(e.backend as usize) {
                *n += 1;
                // A flow its client has closed is no longer its tenant's session: a tenant's
                // cap counts open streams, not the ones ended within the idle timeout.
                if let Some((m, counts)) = self
                    .tenants
                    .as_mut()
                    .filter(|_| e.flags & CONN_F_CLOSED == 0)
                {
                    let t = m.tenant(k.family, &k.src);
                    *counts.entry((e.backend, t)).or_default() += 1;
                }
            }
        }
    }

    pub fn finish(mut self) -> FlowCounts {
        self.counts.active = (0u32..).zip(self.active).filter(|&(_, n)| n > 0).collect();
        if let Some((_, counts)) = self.tenants {
            self.counts.tenants = counts.into_iter().collect();
        }
        self.counts
    }
}

/// Time to wait after a walk that took `took` of CPU before the next one.
pub fn pause_after(took: Duration) -> Duration {
    (took * DUTY).max(MIN_PERIOD)
}

/// Walks the table `fd` once and counts it.
fn count(
    fd: BorrowedFd<'_>,
    idle: Duration,
    tenants: Option<Arc<TenantMatcher>>,
) -> Result<FlowCounts> {
    let (started, cpu0) = (Instant::now(), thread_cpu());
    let now = crate::clock::monotonic_ns();
    let mut t = Tally::new(now, idle, crate::clock::now_ms(), tenants);
    walk(fd, |k, e| {
        t.add(k, e);
        true
    })?;
    Ok(FlowCounts {
        walk: started.elapsed(),
        cpu: thread_cpu().saturating_sub(cpu0),
        ..t.finish()
    })
}

/// CPU time of the calling thread, user and system.
fn thread_cpu() -> Duration {
    let mut ts = libc::timespec {
        tv_sec: 0,
        tv_nsec: 0,
    };
    // SAFETY: clock_gettime writes the struct we pass.
    unsafe { libc::clock_gettime(libc::CLOCK_THREAD_CPUTIME_ID, &mut ts) };
    Duration::new(ts.tv_sec as u64, ts.tv_nsec as u32)
}

struct Shared {
    latest: Mutex<Result<FlowCounts, String>>,
    idle_ns: AtomicU64,
    /// The tenants' prefixes, where tenants are configured.
    tenants: Mutex<Option<Arc<TenantMatcher>>>,
    stop: AtomicBool,
}

/// The background walker: counts the connection table on its own thread, paced by
/// [`pause_after`]; stopped (and its file descriptor closed) when dropped.
pub struct FlowWalker {
    shared: Arc<Shared>,
    thread: Option<JoinHandle<()>>,
}

impl FlowWalker {
    /// Counts once before returning (so the first reads are exact), then keeps counting.
    pub fn start(fd: OwnedFd, idle: Duration) -> Result<FlowWalker> {
        let first = count(fd.as_fd(), idle, None).context("counting the connection table")?;
        let mut took = first.cpu;
        let shared = Arc::new(Shared {
            latest: Mutex::new(Ok(first)),
            idle_ns: AtomicU64::new(crate::config::rules::nanos(idle)),
            tenants: Mutex::new(None),
            stop: AtomicBool::new(false),
        });
        let s = shared.clone();
        let thread = std::thread::Builder::new()
            .name("sluice-flowwalk".into())
            .spawn(move || {
                loop {
                    // Sleep in slices so a drop does not wait out a long pause.
                    let wake = Instant::now() + pause_after(took);
                    while Instant::now() < wake {
                        if s.stop.load(Ordering::Relaxed) {
                            return;
                        }
                        std::thread::sleep(
                            wake.saturating_duration_since(Instant::now())
                                .min(Duration::from_millis(100)),
                        );
                    }
                    let idle = Duration::from_nanos(s.idle_ns.load(Ordering::Relaxed));
                    let tenants = s.tenants.lock().expect("tenant matcher lock").clone();
                    let r = count(fd.as_fd(), idle, tenants).map_err(|e| format!("{e:#}"));
                    match &r {
                        Ok(c) => took = c.cpu,
                        Err(e) => tracing::warn!(error = %e, "counting active flows failed"),
                    }
                    *s.latest.lock().expect("flow count lock") = r;
                }
            })
            .context("starting the flow-walker thread")?;
        Ok(FlowWalker {
            shared,
            thread: Some(thread),
        })
    }

    /// Counts per tenant from the next walk on, with these prefixes (empty: no tenants,
    /// no per-tenant counts).
    pub fn set_tenants(&self, prefixes: &BTreeMap<Cidr, u32>) {
        let m = TenantMatcher::new(prefixes);
        let m = (!m.is_empty()).then(|| Arc::new(m));
        *self.shared.tenants.lock().expect("tenant matcher lock") = m;
    }

    /// The latest counts; `idle` applies from the next walk on.
    pub fn latest(&self, idle: Duration) -> Result<FlowCounts> {
        self.shared
            .idle_ns
            .store(crate::config::rules::nanos(idle), Ordering::Relaxed);
        self.shared
            .latest
            .lock()
            .expect("flow count lock")
            .clone()
            .map_err(anyhow::Error::msg)
    }
}

impl Drop for FlowWalker {
    fn drop(&mut self) {
        self.shared.stop.store(true, Ordering::Relaxed);
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn entry(backend: u32, last_seen_ns: u64) -> ConnEntry {
        ConnEntry {
            backend,
            hash: 0,
            last_seen_ns,
            ..ConnEntry::default()
        }
    }

    #[test]
    fn counts_only_entries_seen_within_the_idle_timeout() {
        let now = 100_000_000_000;
        let idle = Duration::from_secs(60);
        let es = [
            entry(1, now),
            entry(1, now - 60_000_000_000),
            entry(1, now - 60_000_000_001),
            entry(2, now - 1),
            // Stamped after `now` was read (the walk races the data plane): active.
            entry(3, now + 5),
            // No backend has this id: an entry, but nobody's flow.
            entry(MAX_BACKENDS, now),
        ];
        let mut t = Tally::new(now, idle, 7, None);
        es.iter().for_each(|e| t.add(&FlowKey::default(), e));
        let c = t.finish();
        assert_eq!(c.entries, 6);
        assert_eq!(c.active, BTreeMap::from([(1, 2), (2, 1), (3, 1)]));
        assert_eq!(c.taken_ms, 7);
    }

    fn client(ip: &str) -> FlowKey {
        let (src, family) = crate::addr::to_words(ip.parse().unwrap());
        FlowKey {
            src,
            family,
            ..FlowKey::default()
        }
    }

    #[test]
    fn tenant_sessions_are_counted_by_the_longest_prefix_of_the_client() {
        let prefixes: BTreeMap<Cidr, u32> = [
            ("10.0.0.0/8", 1),
            ("10.0.2.0/24", 2),
            ("10.0.2.7/32", 3),
            ("2001:db8:2::/48", 2),
            ("::/0", 4),
        ]
        .into_iter()
        .map(|(c, id)| (c.parse().unwrap(), id))
        .collect();
        let m = TenantMatcher::new(&prefixes);
        let of = |ip: &str| {
            let k = client(ip);
            m.tenant(k.family, &k.src)
        };
        assert_eq!(of("10.9.9.9"), 1);
        assert_eq!(of("10.0.2.1"), 2);
        assert_eq!(of("10.0.2.7"), 3);
        assert_eq!(of("192.0.2.1"), 0, "no prefix: the default tenant");
        assert_eq!(of("2001:db8:2:ffff::1"), 2);
        assert_eq!(
            of("2001:db8:3::1"),
            4,
            "an IPv6 /0 never takes an IPv4 client"
        );

        let now = 100_000_000_000;
        let mut t = Tally::new(now, Duration::from_secs(60), 0, Some(Arc::new(m)));
        t.add(&client("10.0.2.1"), &entry(5, now));
        t.add(&client("10.0.2.9"), &entry(5, now));
        t.add(&client("10.1.0.1"), &entry(5, now));
        t.add(&client("192.0.2.1"), &entry(6, now));
        // Idle: counted for nobody.
        t.add(&client("10.0.2.1"), &entry(5, now - 61_000_000_000));
        let c = t.finish();
        assert_eq!(
            c.tenants,
            BTreeMap::from([((5, 2), 2), ((5, 1), 1), ((6, 0), 1)])
        );
        assert_eq!(c.active, BTreeMap::from([(5, 3), (6, 1)]));
    }

    #[test]
    fn a_flow_its_client_closed_is_its_backends_but_no_longer_its_tenants_session() {
        let prefixes: BTreeMap<Cidr, u32> = [("10.0.0.0/8".parse().unwrap(), 1)].into();
        let m = TenantMatcher::new(&prefixes);
        let now = 100_000_000_000;
        let mut t = Tally::new(now, Duration::from_secs(60), 0, Some(Arc::new(m)));
        t.add(&client("10.0.0.1"), &entry(5, now));
        let mut closed = entry(5, now);
        closed.flags = CONN_F_CLOSED;
        t.add(&client("10.0.0.2"), &closed);
        let c = t.finish();
        assert_eq!(c.tenants, BTreeMap::from([((5, 1), 1)]));
        // Its packets still reach the backend until the flow idles out (a drain waits for it).
        assert_eq!(c.active, BTreeMap::from([(5, 2)]));
    }

    #[test]
    fn walks_are_paced_to_a_fortieth_of_a_core_and_at_most_once_a_second() {
        assert_eq!(pause_after(Duration::from_millis(2)), MIN_PERIOD);
        assert_eq!(pause_after(Duration::from_millis(25)), MIN_PERIOD);
        assert_eq!(
            pause_after(Duration::from_millis(100)),
            Duration::from_secs(4)
        );
    }
}
