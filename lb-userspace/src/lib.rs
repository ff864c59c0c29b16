//! Sluice userspace: the steering logic as a library, and the shells around it.
//!
//! Where things are (a packet's path is in `lb-ebpf`; `docs/design.md` opens with the map of
//! both crates):
//!
//! - decision per packet: `lb-ebpf/src/decide.rs`; the tables it reads are built here by
//!   [`maglev`] and [`ring_history`] (kept across a daemon replaced without pins by
//!   [`ring_store`]);
//! - maps: names and layouts in `lb_common` (`lb_common::maps`), loading and typed access in
//!   [`dataplane`], the compiled object in [`object`], address words in [`addr`];
//! - desired state and its changes: [`state`] (pure), [`controller`] (owns it, audits, and
//!   drives a [`controller::Plane`]);
//! - map writes: [`apply`] (a `State` into the maps, in an order the XDP program can read at
//!   any moment);
//! - policy: [`policy`] (pure adaptive steering: weights, move-aways, admission) and
//!   [`scheduler`] (the shell that runs health checks and policy steps);
//! - telemetry: [`telemetry`] (accelerator, engine and in-band signals per backend), [`flowwalk`]
//!   (connection-table counts), [`metrics`] (Prometheus; the exposition helpers every page
//!   shares are in [`prom_text`]), [`trace`] (decision traces);
//! - configuration: [`config`], [`check`]; the daemon shell: [`daemon`], [`clock`],
//!   [`notify`], [`private_file`];
//! - the API: [`admin`] over [`http_server`] (shared with [`metrics`]), [`client`],
//!   [`cli`] and its [`manpages`], [`escape`] (the daemon's text made safe for a terminal),
//!   [`limits`]; the backend side: [`backend_host`].
//! - the fleet: [`announce`] (VIP routes through BIRD, `sluice lb drain`) and [`fleet`] (one
//!   versioned table set in etcd, the steering leader, static stability).

pub mod addr;
pub mod admin;
pub mod announce;
pub mod apply;
pub mod backend_host;
pub mod check;
pub mod cli;
pub mod client;
pub mod clock;
pub mod config;
pub mod controller;
pub mod daemon;
pub mod dataplane;
pub mod escape;
pub mod fleet;
pub mod flowwalk;
pub mod http_server;
pub mod limits;
pub mod maglev;
pub mod manpages;
pub mod metrics;
pub mod notify;
pub mod object;
pub mod policy;
pub mod private_file;
pub mod prom_text;
pub mod ring_history;
pub mod ring_store;
pub mod scheduler;
pub mod state;
pub mod telemetry;
#[cfg(test)]
mod test_dir;
pub mod trace;
