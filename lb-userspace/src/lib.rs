//! Sluice userspace: the shells around the steering logic of [`sluice_core`], and the `sluice`
//! binary's commands.
//!
//! The pure half (configuration, desired state, Maglev, policy, exporter parsers) lives in
//! `sluice_core` and is re-exported here under its own module names, so `sluice::config` and
//! `sluice_core::config` are one module; nothing in `sluice_core` can reach a shell.
//!
//! Where things are (a packet's path is in `lb-ebpf`; `docs/design.md` opens with the map of
//! the crates):
//!
//! - maps: names and layouts in `lb_common` (`lb_common::maps`), loading and typed access in
//!   [`dataplane`], the compiled object in [`object`]; the Maglev tables kept across a daemon
//!   replaced without pins in [`ring_store`];
//! - desired state and its changes: [`controller`] owns a `state::State`, audits, and drives a
//!   [`controller::Plane`]; [`apply`] writes a state into the maps in an order the XDP program
//!   can read at any moment;
//! - steering: [`scheduler`] runs health [`probe`]s and the policy's steps;
//! - telemetry: [`scrape`] (the exporter scrape loop and its HTTP client), [`flowwalk`]
//!   (connection-table counts), [`metrics`] (Prometheus; the exposition helpers every page
//!   shares are in [`prom_text`]), [`trace`] (decision traces);
//! - configuration checks: [`check`]; the daemon shell: [`daemon`], [`notify`],
//!   [`private_file`];
//! - the API: [`admin`] over [`http_server`] (shared with [`metrics`]), [`client`],
//!   [`cli`] and its [`manpages`], [`escape`] (the daemon's text made safe for a terminal),
//!   [`limits`]; the backend side: [`backend_host`].
//! - the fleet: [`announce`] (VIP routes through BIRD, `sluice lb drain`) and [`fleet`] (one
//!   versioned table set in etcd, the steering leader, static stability).

#[cfg(test)]
use sluice_core::test_dir;
pub use sluice_core::{addr, clock, config, maglev, policy, ring_history, state, telemetry};

pub mod admin;
pub mod announce;
pub mod apply;
pub mod backend_host;
pub mod check;
pub mod cli;
pub mod client;
pub mod controller;
pub mod daemon;
pub mod dataplane;
pub mod escape;
pub mod fleet;
pub mod flowwalk;
pub mod http_server;
pub mod limits;
pub mod manpages;
pub mod metrics;
pub mod notify;
pub mod object;
pub mod private_file;
pub mod probe;
pub mod prom_text;
pub mod ring_store;
pub mod scheduler;
pub mod scrape;
pub mod trace;
