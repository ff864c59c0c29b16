//! `sluice-accel`: a simulated LLM accelerator for Sluice's token-stream lab.
//!
//! One process stands for one accelerator behind Sluice: an OpenAI-compatible server whose
//! pace comes from a continuous-batching capacity model ([`model`]), with its own telemetry in
//! the formats Sluice scrapes ([`telemetry`]) and faults that can be switched on at run time
//! ([`fault`]). [`openai`] reads requests and writes answers; [`server`] is the I/O shell.
//! See docs/token-lab.md.

pub mod fault;
pub mod model;
pub mod openai;
pub mod server;
pub mod telemetry;
