//! Sluice userspace: the steering logic as a library, and the shells around it.

pub mod addr;
pub mod admin;
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
pub mod flowwalk;
pub mod limits;
pub mod maglev;
pub mod manpages;
pub mod metrics;
pub mod notify;
pub mod object;
pub mod policy;
pub mod private_file;
pub mod ring_history;
pub mod state;
pub mod steering;
pub mod telemetry;
pub mod trace;
