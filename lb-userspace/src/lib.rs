//! Sluice userspace: the steering logic as a library, and the shells around it.

pub mod addr;
pub mod admin;
pub mod apply;
pub mod cli;
pub mod client;
pub mod config;
pub mod controller;
pub mod daemon;
pub mod dataplane;
pub mod maglev;
pub mod metrics;
pub mod object;
pub mod policy;
pub mod ring_history;
pub mod state;
pub mod steering;
pub mod telemetry;
