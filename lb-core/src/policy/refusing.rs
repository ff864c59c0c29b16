//! Refused handshakes: a backend whose clients' TCP handshakes fail far more often than its
//! peers' gets a [`Reason::Refusing`] trigger and goes through the usual cooldown.
//!
//! The data plane sees every client packet but, in DSR, none of the backend's: a backend
//! that resets or ignores connections on its serving port while its health port answers (a
//! crashed worker behind a healthy sidecar) shows only as SYNs that no ACK follows. The data
//! plane counts, per backend, handshakes started (a SYN that opens a flow, once however often
//! it is retransmitted) and completed (the flow's first ACK); the policy keeps the deltas of
//! the last [`WINDOW`] per backend on its own clock.
//!
//! Outlier detection as Envoy does it from responses, here from handshakes. A backend's
//! sample is its newest handshakes, step by step back until there are at least
//! [`MIN_HANDSHAKES`], within [`WINDOW`]: at a few handshakes a second a refusing backend is
//! judged on the last step or two. It departs when the share of its sample that never
//! completed is at least [`MARGIN`] above that of its peers pooled (the VIP's other backends
//! in rotation with a sample of their own) and the difference is at least [`Z`] standard
//! errors of a two-proportion test: a small sample that fails a little more than its peers
//! is noise, not a refusing backend. Peers, not a threshold alone: clients abandon
//! handshakes (timeouts, scanners, a SYN flood under the flood guard's limit) at the same
//! rate whichever backend the hash gives them, so a fleet that loses many handshakes
//! everywhere moves nobody; most backends of a VIP refusing at once is an outage, not an
//! outlier, and is left to health checks and the operator.
//!
//! A backend moved away gets no new handshakes: its sample reaches back to the failures
//! that moved it, and it stays out until they leave the window (or its cooldown ends, if
//! later); back in rotation, it is judged on its new handshakes.

use std::{collections::VecDeque, time::Duration};

use serde::Serialize;

use super::{Reason, Trigger, Work};

/// How far back a backend's sample may reach.
pub const WINDOW: Duration = Duration::from_secs(10);
/// Handshakes a sample needs before its failures are evidence.
pub const MIN_HANDSHAKES: u64 = 10;
/// The least excess of a departing backend's failed share over its peers' (30 points).
pub const MARGIN: f64 = 0.3;
/// Standard errors the excess must span: in simulation, four kept a fleet whose clients
/// abandon 30% of their handshakes free of moves for hours while a backend refusing all of
/// its handshakes moved at its first sample of ten.
pub const Z: f64 = 4.0;

/// TCP handshakes of one backend: cumulative as the data plane counts them, or over a window.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize)]
pub struct Handshakes {
    pub started: u64,
    pub completed: u64,
}

impl Handshakes {
    /// Handshakes that never completed (completions of SYNs before the sample may make
    /// `completed` the larger).
    fn failed(&self) -> u64 {
        self.started.saturating_sub(self.completed)
    }

    fn plus(self, o: &Handshakes) -> Handshakes {
        Handshakes {
            started: self.started + o.started,
            completed: self.completed + o.completed,
        }
    }
}

/// One backend's handshake deltas over the last [`WINDOW`].
#[derive(Debug, Default)]
pub(super) struct Window {
    last: Option<Handshakes>,
    deltas: VecDeque<(Duration, Handshakes)>,
}

impl Window {
    /// Records the cumulative counters at `now` (None: the backend has none, e.g. its VIP
    /// keeps no connection table) and returns its sample: the newest deltas summed until
    /// they hold [`MIN_HANDSHAKES`], or all of the window's when they never do. Counters
    /// that went backwards (the data plane was replaced, the id reused) restart the window.
    pub(super) fn observe(&mut self, now: Duration, cur: Option<Handshakes>) -> Handshakes {
        if let Some(cur) = cur {
            match self.last {
                Some(l) if cur.started < l.started || cur.completed < l.completed => {
                    self.deltas.clear()
                }
                Some(l) => self.deltas.push_back((
                    now,
                    Handshakes {
                        started: cur.started - l.started,
                        completed: cur.completed - l.completed,
                    },
                )),
                None => {}
            }
            self.last = Some(cur);
        }
        // A delta covers the step before it: the window holds the deltas younger than it.
        while self
            .deltas
            .front()
            .is_some_and(|(at, _)| now.saturating_sub(*at) >= WINDOW)
        {
            self.deltas.pop_front();
        }
        let mut sample = Handshakes::default();
        for (_, d) in self.deltas.iter().rev() {
            sample = sample.plus(d);
            if sample.started >= MIN_HANDSHAKES {
                break;
            }
        }
        sample
    }
}

/// Why `i` departs from its peers (`rotating[j]`: backend `j` is in rotation), if it does.
fn departs(work: &[Work], rotating: &[bool], i: usize) -> Option<String> {
    let me = &work[i];
    let own = me.handshakes;
    if own.started < MIN_HANDSHAKES {
        return None;
    }
    let peers = work
        .iter()
        .zip(rotating)
        .enumerate()
        .filter(|&(j, (w, &rot))| j != i && rot && w.eligible && w.input.vip == me.input.vip)
        .map(|(_, (w, _))| w.handshakes)
        .filter(|h| h.started >= MIN_HANDSHAKES)
        .fold(None, |acc: Option<Handshakes>, h| {
            Some(acc.unwrap_or_default().plus(&h))
        })?;
    let (n, m) = (own.started as f64, peers.started as f64);
    let (f, p) = (own.failed() as f64 / n, peers.failed() as f64 / m);
    if f - p < MARGIN {
        return None;
    }
    // Both shares estimate one failure rate if the backend is like its peers.
    let pooled = (own.failed() + peers.failed()) as f64 / (n + m);
    let se = (pooled * (1.0 - pooled) * (1.0 / n + 1.0 / m)).sqrt();
    (f - p >= Z * se).then(|| {
        format!(
            "{} of its last {} TCP handshakes never completed ({:.0}%), its peers' {:.0}% of {}",
            own.failed(),
            own.started,
            f * 100.0,
            p * 100.0,
            peers.started
        )
    })
}

/// Adds the `Refusing` triggers. `in_rotation` says whether a backend (by id) is in
/// rotation: only those are peers (a moved-away one's window says what it did before it was
/// emptied).
pub(super) fn refusing(work: &mut [Work], in_rotation: impl Fn(u32) -> bool) {
    let rotating: Vec<bool> = work.iter().map(|w| in_rotation(w.input.id)).collect();
    let found: Vec<(usize, String)> = (0..work.len())
        .filter(|&i| work[i].eligible)
        .filter_map(|i| departs(work, &rotating, i).map(|d| (i, d)))
        .collect();
    for (i, detail) in found {
        work[i].conditions.push(Trigger {
            reason: Reason::Refusing,
            detail,
        });
    }
}
