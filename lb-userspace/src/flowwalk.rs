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
    collections::BTreeMap,
    mem::size_of,
    os::fd::{AsFd, AsRawFd, BorrowedFd, OwnedFd},
    sync::{
        atomic::{AtomicBool, AtomicU64, Ordering},
        Arc, Mutex,
    },
    thread::JoinHandle,
    time::{Duration, Instant},
};

use anyhow::{bail, Context, Result};
use lb_common::{ConnEntry, FlowKey, MAX_BACKENDS};

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

/// Active connection-table entries per backend, from one walk.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct FlowCounts {
    /// Backend id → entries seen within the idle timeout.
    pub active: BTreeMap<u32, u64>,
    /// Every entry found, active or not (the table's fill).
    pub entries: u64,
    /// Unix ms when the walk began: flows that arrived after it may be missing.
    pub taken_ms: u64,
    /// How long the walk took (wall clock).
    pub walk: Duration,
    /// CPU time the walk took (this thread's, system time included): what paces walks.
    pub cpu: Duration,
}

/// Counts entries into a [`FlowCounts`]: an entry is active when it was seen within `idle`
/// of `now_ns` (CLOCK_MONOTONIC, the data plane's clock).
pub struct Tally {
    now_ns: u64,
    idle_ns: u64,
    /// Indexed by backend id (ids are below `MAX_BACKENDS`): no map lookup per entry.
    active: Vec<u64>,
    counts: FlowCounts,
}

impl Tally {
    pub fn new(now_ns: u64, idle: Duration, taken_ms: u64) -> Tally {
        Tally {
            now_ns,
            idle_ns: crate::config::rules::nanos(idle),
            active: vec![0; MAX_BACKENDS as usize],
            counts: FlowCounts {
                taken_ms,
                ..Default::default()
            },
        }
    }

    pub fn add(&mut self, e: &ConnEntry) {
        self.counts.entries += 1;
        if self.now_ns.saturating_sub(e.last_seen_ns) <= self.idle_ns {
            // An id out of range is no backend's (never written by the data plane).
            if let Some(n) = self.active.get_mut(e.backend as usize) {
                *n += 1;
            }
        }
    }

    pub fn finish(mut self) -> FlowCounts {
        self.counts.active = (0u32..).zip(self.active).filter(|&(_, n)| n > 0).collect();
        self.counts
    }
}

/// Time to wait after a walk that took `took` of CPU before the next one.
pub fn pause_after(took: Duration) -> Duration {
    (took * DUTY).max(MIN_PERIOD)
}

/// Walks the table `fd` once and counts it.
fn count(fd: BorrowedFd<'_>, idle: Duration) -> Result<FlowCounts> {
    let (started, cpu0) = (Instant::now(), thread_cpu());
    let mut t = Tally::new(crate::clock::monotonic_ns(), idle, crate::clock::now_ms());
    walk(fd, |_, e| {
        t.add(e);
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
        let first = count(fd.as_fd(), idle).context("counting the connection table")?;
        let mut took = first.cpu;
        let shared = Arc::new(Shared {
            latest: Mutex::new(Ok(first)),
            idle_ns: AtomicU64::new(crate::config::rules::nanos(idle)),
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
                    let r = count(fd.as_fd(), idle).map_err(|e| format!("{e:#}"));
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
        let mut t = Tally::new(now, idle, 7);
        es.iter().for_each(|e| t.add(e));
        let c = t.finish();
        assert_eq!(c.entries, 6);
        assert_eq!(c.active, BTreeMap::from([(1, 2), (2, 1), (3, 1)]));
        assert_eq!(c.taken_ms, 7);
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
