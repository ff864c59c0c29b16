//! Why a packet is not forwarded, shared by the steering decision and the tenant limits it
//! applies.

use lb_common::stat::Counter;

/// Why a packet is not forwarded: dropped for a reason, or a new session shed by admission
/// control (which may be answered with a RST). Each carries its counter.
pub enum Refusal {
    Drop(Counter),
    Shed(Counter),
}

impl From<Counter> for Refusal {
    fn from(counter: Counter) -> Self {
        Refusal::Drop(counter)
    }
}
