//! Builds for the per-packet cost breakdown (`cargo xtask bench xdp --stages`). Each
//! `ablate-*` feature takes one stage out of the path and each `stop-after-*` feature ends the
//! program after one, so the benchmark measures every stage by difference against the whole
//! program on the same frames. The production object is built with none of them: every
//! constant below is then `false` and the code it guards is folded away.

/// No per-CPU counter is written (outcome counters and VIP/backend traffic).
pub const NO_COUNTERS: bool = cfg!(feature = "ablate-counters");
/// The outer IPv4 header's checksum is left zero.
pub const NO_CSUM: bool = cfg!(feature = "ablate-csum");
/// No next hop is looked up (cache or FIB): the packet goes back out of its ingress
/// interface to the fallback MAC, with `XDP_TX`.
pub const NO_NEXT_HOP: bool = cfg!(feature = "ablate-next-hop");
/// The looked-up next hop is used, but the packet leaves with `XDP_TX` instead of the devmap
/// redirect.
pub const NO_REDIRECT: bool = cfg!(feature = "ablate-redirect");
/// New flows take a constant steering hash in place of the flow's.
pub const NO_HASH: bool = cfg!(feature = "ablate-hash");
/// New sessions skip tenant admission.
pub const NO_TENANTS: bool = cfg!(feature = "ablate-tenants");
/// New flows are not inserted into the connection table.
pub const NO_INSERT: bool = cfg!(feature = "ablate-insert");
/// A GUE packet names no previous backend (the ring slot's history is not read).
pub const NO_HISTORY: bool = cfg!(feature = "ablate-history");

/// The program returns `XDP_PASS` once the packet is parsed.
pub const STOP_AFTER_PARSE: bool = cfg!(feature = "stop-after-parse");
/// ... once its VIP is looked up.
pub const STOP_AFTER_VIP: bool = cfg!(feature = "stop-after-vip");
/// ... once its backend is decided (connection table, ring, admission).
pub const STOP_AFTER_DECIDE: bool = cfg!(feature = "stop-after-decide");
