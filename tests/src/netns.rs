//! Network-namespace lab: a one-armed load balancer with direct server return on a shared L2
//! segment, as in production, built from namespaces and veth pairs.
//!
//! ```text
//!                      switch namespace  <id>-sw
//!            br0 (10.111.0.1, fd00:111::1: the segment's router, the fallback next hop)
//!        v-client        v-lb  (sluice_pass)         v-b0      v-b1     v-b2 ...
//!           |             |                           |         |        |
//!    eth0 10.111.0.10  eth0 10.111.0.2             eth0 .11  eth0 .12  eth0 .13
//!    <id>-client       <id>-lb (sluice_xdp, native)   <id>-b0   <id>-b1   <id>-b2
//!    VIP routes via    forwarding on                  VIP on lo, sluice_decap (native),
//!    the LB            (bpf_fib_lookup needs it)      server process
//! ```
//!
//! Client packets to a VIP go to the LB, whose XDP program encapsulates them (IPIP or IPv6 in
//! IPv6) and sends them back out of the same port (XDP_TX) to a backend; the backend's XDP
//! program strips the outer header and the stack delivers the client's packet to the VIP on
//! `lo`; the reply goes from the backend straight to the client.
//!
//! Every device lives inside a lab namespace (veth pairs are created with both ends already in
//! their namespaces), so nothing is added to the root namespace and deleting the namespaces
//! removes everything. [`Topology`] deletes its namespaces and kills the processes it started
//! when dropped, also while a test panics; [`sweep_stale`] (run by [`Topology::build`])
//! removes what a crashed earlier run left. Names are `sl<pid>-<n>-<host>`: unique per run
//! and per lab, and the pid says whether the run that made them is still alive.
//!
//! The test process stays in the root namespace: work inside a namespace happens on a thread
//! that entered it ([`Netns::run`], [`Netns::spawn`], [`Netns::enter`]), or in a command run
//! with `ip netns exec` ([`Netns::command`]). Sockets keep the namespace they were made in, so
//! a socket connected inside the client namespace can be read from any thread.
//!
//! `net_lab::NetLab` puts the data planes on top: Sluice on the LB, decapsulation on every backend,
//! an XDP_PASS program on the LB's switch port (native XDP_TX on a veth is only delivered when
//! the peer has an XDP program), the VIPs, the servers, and resolved neighbours.

mod cmd;
mod namespace;
mod topology;

use std::{
    ffi::CString,
    net::{Ipv4Addr, Ipv6Addr},
    time::Duration,
};

use anyhow::{bail, Context, Result};
use aya::programs::XdpMode;
use sluice::{
    dataplane::{Dataplane, LoadOptions, PROG_PASS},
    object::BPF_OBJECT,
};

pub use self::{
    cmd::{ip, require_lab_prerequisites, run_cmd, run_output, tool, CmdOutput},
    namespace::{lab_namespaces, sweep_stale, LinkCounters, Netns, NsGuard},
    topology::{mac_string, Host, ProcId, Topology, TopologySpec},
};

/// First characters of every lab namespace name (`sl<pid>-<n>-<host>`).
pub const NS_PREFIX: &str = "sl";
/// The interface of every host namespace (client, LB, backends) on the segment.
pub const DEV: &str = "eth0";
/// The bridge in the switch namespace.
pub const BRIDGE: &str = "br0";

/// The segment: 10.111.0.0/24 and fd00:111::/64, used only inside the lab's namespaces.
pub const PREFIX_LEN_V4: u8 = 24;
pub const PREFIX_LEN_V6: u8 = 64;
/// The switch namespace's address on the bridge: the segment's router, whose MAC is the data
/// plane's fallback next hop.
pub const GATEWAY_V4: Ipv4Addr = Ipv4Addr::new(10, 111, 0, 1);
pub const GATEWAY_V6: Ipv6Addr = Ipv6Addr::new(0xfd00, 0x111, 0, 0, 0, 0, 0, 1);
pub const LB_V4: Ipv4Addr = Ipv4Addr::new(10, 111, 0, 2);
pub const LB_V6: Ipv6Addr = Ipv6Addr::new(0xfd00, 0x111, 0, 0, 0, 0, 0, 2);
pub const CLIENT_V4: Ipv4Addr = Ipv4Addr::new(10, 111, 0, 10);
pub const CLIENT_V6: Ipv6Addr = Ipv6Addr::new(0xfd00, 0x111, 0, 0, 0, 0, 0, 0x10);
/// Backend `i` is 10.111.0.(11 + i) and fd00:111::(11 + i) (the same digits).
pub const BACKEND_V4_BASE: u8 = 11;

/// The VIPs (on every backend's `lo`) and the prefixes the client routes through the LB.
pub const VIP4: Ipv4Addr = Ipv4Addr::new(10, 111, 100, 1);
pub const VIP6: Ipv6Addr = Ipv6Addr::new(0xfd00, 0x111, 0x100, 0, 0, 0, 0, 1);
pub const VIP_NET_V4: &str = "10.111.100.0/24";
pub const VIP_NET_V6: &str = "fd00:111:100::/64";
/// The MTU of the client's VIP routes: a client packet plus the 40-byte IPv6 outer header
/// still fits the segment's 1500 (in production the LB-backend fabric has the larger MTU).
pub const VIP_ROUTE_MTU: u32 = 1400;
/// The token-stream (TCP) and echo (UDP) service ports of the default VIPs.
pub const TCP_PORT: u16 = 8000;
pub const UDP_PORT: u16 = 8001;

/// Outer source addresses, in the style of the packet tests: a base and a host mask filled
/// from the flow hash.
pub const ENCAP_SRC_V4: Ipv4Addr = Ipv4Addr::new(172, 16, 0, 0);
pub const ENCAP_SRC_V4_HOSTMASK: [u8; 4] = [0, 0, 0xff, 0xff];
pub const ENCAP_SRC_V6: Ipv6Addr = Ipv6Addr::new(0xfd00, 5, 1, 0, 0, 0, 0, 0);
pub const RING: u32 = 65537;
pub const SEED: u32 = 0x5eed;

/// Bound on every command the lab runs (`ip`, `ethtool`).
pub const CMD_TIMEOUT: Duration = Duration::from_secs(10);

// ---------------------------------------------------------------------------------------
// XDP on the lab's ports
// ---------------------------------------------------------------------------------------

/// Attaches `prog` of `dp` in native (driver) mode to `dev` in namespace `ns`.
pub fn attach_native(dp: &mut Dataplane, prog: &str, ns: &Netns, dev: &str) -> Result<()> {
    let _in = ns.enter()?;
    let c = CString::new(dev)?;
    let idx = unsafe { libc::if_nametoindex(c.as_ptr()) };
    if idx == 0 {
        bail!("no interface {dev} in namespace {}", ns.name());
    }
    dp.attach(prog, idx, XdpMode::Driver)
        .with_context(|| format!("attaching {prog} to {}/{dev}", ns.name()))
}

/// `sluice_pass` (native) on the LB's switch port: native XDP_TX frames on a veth are
/// delivered only when the peer runs XDP. Its `RX` counts every frame the LB namespace sends.
pub fn switch_port(topo: &Topology) -> Result<Dataplane> {
    let mut edge_dp = Dataplane::load(BPF_OBJECT, &LoadOptions::decap_only())
        .context("loading the switch port's data plane")?;
    attach_native(&mut edge_dp, PROG_PASS, &topo.switch, &topo.lb.port)?;
    Ok(edge_dp)
}
