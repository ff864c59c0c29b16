//! `cargo xtask demo`: the namespace-lab demo (still to come).

use anyhow::Result;

use crate::{
    build::{self, Profile},
    cmd::step,
    setup,
};

pub fn run() -> Result<()> {
    setup::run()?;
    build::run(Profile::Release)?;
    namespace_lab_demo_placeholder()
}

/// Placeholder for the namespace-lab demo (client, Sluice, GPU-backend namespaces streaming
/// tokens), which comes in a later change.
fn namespace_lab_demo_placeholder() -> Result<()> {
    step("demo");
    println!("the namespace-lab demo is coming in a later change; nothing to run yet");
    Ok(())
}
