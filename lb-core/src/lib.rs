//! Sluice's steering logic with no I/O: everything here takes its inputs, the time included, as
//! parameters, so it runs on a simulated clock in tests and in the benchmarks' simulators. The
//! shells that read sockets, maps and exporters live in the `sluice` crate (lb-userspace), which
//! depends on this one and never the reverse.
//!
//! - [`config`]: the configuration model, its parser and every validation rule;
//! - [`state`]: the desired state of the data plane (VIPs, backends, weights, drains) and its
//!   changes, built from a configuration by `State::for_config`;
//! - [`maglev`] and [`ring_history`]: the lookup tables the XDP program reads;
//! - [`policy`]: adaptive steering (weights, move-aways, admission, health state machines);
//! - [`telemetry`]: the exporters' pages parsed into one sample per backend, and the hub that
//!   merges them; [`addr`], [`clock`]: address words and time units.

pub mod addr;
pub mod clock;
pub mod config;
pub mod maglev;
pub mod policy;
pub mod ring_history;
pub mod state;
pub mod telemetry;
/// A unit test's temporary directory, shared with the shells' tests (compiled always: a
/// `cfg(test)` item of this crate is invisible to another crate's tests).
#[doc(hidden)]
pub mod test_dir;
