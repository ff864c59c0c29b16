//! Sluice userspace: the steering logic as a library, and the shells around it.

pub mod maglev;
pub mod object;
