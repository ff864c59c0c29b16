//! Shared helpers for the packet (BPF_PROG_TEST_RUN) and namespace tests. Both need root and
//! the eBPF object built by `cargo xtask build`; they fail, never skip, when either is missing.

pub mod backend_host;
pub mod daemon_lab;
pub mod etcd;
pub mod fleet_lab;
pub mod frames;
pub mod fuzz;
pub mod net_lab;
pub mod netns;
pub mod openai;
pub mod pinned;
pub mod quic;
pub mod stream;
pub mod tenants;

use std::net::IpAddr;

use anyhow::{bail, Context, Result};
use aya::programs::{TestRun, TestRunOptions};
use lb_common::{
    hash, BackendEntry, FlowKey, LbConfig, VipKey, VipMeta, BACKEND_ACTIVE, MAX_PROBES,
};
use sluice::{
    addr::{from_words, to_words},
    dataplane::{Dataplane, LoadOptions, PROG_XDP},
    maglev::{self, MaglevBackend},
    object::BPF_OBJECT,
};

/// Fails with a message saying what is missing when the process cannot do BPF.
pub fn require_root() {
    if unsafe { libc::geteuid() } != 0 {
        panic!("this test loads BPF programs and needs root (CAP_BPF, CAP_NET_ADMIN, CAP_PERFMON); run `cargo xtask test` as root");
    }
}

pub const RING: u32 = 65537;
pub const SEED: u32 = 0x5eed;
pub const FALLBACK_MAC: [u8; 6] = [0x02, 0xfa, 0x11, 0xba, 0xc4, 0x00];

/// A loaded data plane with the settings the fixtures assume.
pub struct Lab {
    pub dp: Dataplane,
    pub cfg: LbConfig,
    tables: std::collections::HashMap<u32, Vec<u32>>,
}

impl Lab {
    /// Loads a fresh data plane in a fresh network namespace for this thread, so the FIB is
    /// empty and next hops come from the fallback MAC unless a test adds routes.
    // Not `Default`: it moves the calling thread into a new namespace and loads BPF.
    #[allow(clippy::new_without_default)]
    pub fn new() -> Lab {
        Lab::with_max_vips(4)
    }

    /// [`Lab::new`] with room for `max_vips` VIPs.
    pub fn with_max_vips(max_vips: u32) -> Lab {
        require_root();
        if unsafe { libc::unshare(libc::CLONE_NEWNET) } != 0 {
            panic!(
                "unshare(CLONE_NEWNET) failed: {}",
                std::io::Error::last_os_error()
            );
        }
        let opts = LoadOptions {
            conn_table_size: 1 << 16,
            affinity_table_size: 1 << 12,
            max_vips,
            pin_dir: None,
        };
        let mut dp = Dataplane::load(BPF_OBJECT, &opts).expect("load the data plane");
        let (src4, _) = to_words("172.16.0.0".parse().unwrap());
        let (src6, _) = to_words("fd00:5:1::".parse().unwrap());
        let cfg = LbConfig {
            encap_src_v4: src4[0],
            encap_src_v4_hostmask: u32::from_ne_bytes([0, 0, 0xff, 0xff]),
            encap_src_v6: src6,
            encap_src_v6_hostmask: u32::MAX,
            hash_seed: SEED,
            fallback_mac: FALLBACK_MAC,
            ..Default::default()
        };
        dp.set_config(&cfg).unwrap();
        Lab {
            dp,
            cfg,
            tables: Default::default(),
        }
    }

    pub fn vip(
        &mut self,
        id: u32,
        addr: &str,
        port: u16,
        proto: u8,
        flags: u32,
        affinity_secs: u32,
    ) -> VipKey {
        let (a, family) = to_words(addr.parse().unwrap());
        let key = VipKey {
            addr: a,
            port: port.to_be(),
            proto,
            family,
        };
        let meta = VipMeta {
            id,
            flags,
            ring_size: RING,
            active_ring: 0,
            affinity_secs,
            ..Default::default()
        };
        if port == 0 {
            self.dp.set_wildcard_vips(true).unwrap();
        }
        self.dp.set_vip(&key, &meta).unwrap();
        key
    }

    /// Writes the backends (all active) and publishes the VIP's Maglev table built from them.
    pub fn backends(&mut self, vip: &VipKey, list: &[(u32, &str, u32)]) {
        let meta = self.dp.vip(vip).unwrap().unwrap();
        for (id, addr, _) in list {
            let (a, family) = to_words(addr.parse().unwrap());
            let b = BackendEntry {
                addr: a,
                family,
                state: BACKEND_ACTIVE,
                vip: meta.id,
                ..Default::default()
            };
            self.dp.set_backend(*id, &b).unwrap();
        }
        let mb: Vec<MaglevBackend> = list
            .iter()
            .map(|(id, key, weight)| MaglevBackend {
                id: *id,
                key,
                weight: *weight,
            })
            .collect();
        let table = maglev::build(&mb, RING, SEED).unwrap();
        self.dp.publish(vip, meta, &table).unwrap();
        self.tables.insert(meta.id, table);
    }

    pub fn set_flags(&mut self, id: u32, flags: u8) {
        let mut b = self.dp.backend(id).unwrap();
        b.flags = flags;
        self.dp.set_backend(id, &b).unwrap();
    }

    pub fn set_state(&mut self, id: u32, state: u8) {
        let mut b = self.dp.backend(id).unwrap();
        b.state = state;
        self.dp.set_backend(id, &b).unwrap();
    }

    /// The backend the ring gives this flow (first probe), as the data plane computes it.
    pub fn ring_choice(&mut self, vip: &VipKey, key: &FlowKey, src_only: bool) -> u32 {
        let meta = self.dp.vip(vip).unwrap().unwrap();
        let h = self.flow_hash(key, src_only);
        self.tables[&meta.id][hash::probe_slot(h, 0, RING) as usize]
    }

    pub fn flow_hash(&self, key: &FlowKey, src_only: bool) -> u32 {
        if src_only {
            hash::src_hash(key, SEED)
        } else {
            hash::flow_hash(key, SEED)
        }
    }

    /// Probe positions of a flow, in order (for tests of bounded probing).
    pub fn probes(&mut self, vip: &VipKey, key: &FlowKey) -> Vec<u32> {
        let meta = self.dp.vip(vip).unwrap().unwrap();
        let h = self.flow_hash(key, false);
        (0..MAX_PROBES)
            .map(|i| self.tables[&meta.id][hash::probe_slot(h, i, RING) as usize])
            .collect()
    }

    pub fn backend_addr(&mut self, id: u32) -> IpAddr {
        let b = self.dp.backend(id).unwrap();
        from_words(b.addr, b.family)
    }

    /// Outer source address the data plane derives from the flow hash.
    pub fn outer_src(&self, h: u32, v6: bool) -> IpAddr {
        if v6 {
            let mut w = self.cfg.encap_src_v6;
            w[3] |= h & self.cfg.encap_src_v6_hostmask;
            from_words(w, lb_common::FAMILY_V6)
        } else {
            from_words(
                [
                    self.cfg.encap_src_v4 | (h & self.cfg.encap_src_v4_hostmask),
                    0,
                    0,
                    0,
                ],
                lb_common::FAMILY_V4,
            )
        }
    }

    /// Runs `sluice_xdp` once on `frame`: (XDP action, output frame).
    pub fn run(&mut self, frame: &[u8]) -> (u32, Vec<u8>) {
        run_prog(&mut self.dp, PROG_XDP, frame).unwrap()
    }

    pub fn stat(&mut self, counter: lb_common::stat::Counter) -> u64 {
        self.dp.stats().unwrap()[counter.index()]
    }
}

/// BPF_PROG_TEST_RUN of one program on one frame, with room for the encapsulation header.
pub fn run_prog(dp: &mut Dataplane, prog: &str, frame: &[u8]) -> Result<(u32, Vec<u8>)> {
    let mut out = vec![0u8; frame.len() + 128];
    let r = dp
        .program(prog)?
        .test_run(TestRunOptions {
            data_in: Some(frame),
            data_out: Some(&mut out),
            ..Default::default()
        })
        .with_context(|| format!("BPF_PROG_TEST_RUN of {prog}"))?;
    if r.data_size_out as usize > out.len() {
        bail!("output larger than the buffer");
    }
    out.truncate(r.data_size_out as usize);
    Ok((r.return_value, out))
}

/// The MAC of the LB's side of [`fib_segment`].
pub const FIB_LOCAL_MAC: [u8; 6] = [0x02, 0, 0, 0, 0x0a, 0x0a];

/// The neighbour MAC [`fib_segment`] gives a backend: `02:00:00:00:0b:<last byte>` for IPv4,
/// `02:00:00:00:0b:<0x10 + last byte>` for IPv6.
pub fn fib_neighbour_mac(addr: IpAddr) -> [u8; 6] {
    let last = match addr {
        IpAddr::V4(a) => a.octets()[3],
        IpAddr::V6(a) => 0x10u8.wrapping_add(a.octets()[15]),
    };
    [0x02, 0, 0, 0, 0x0b, last]
}

/// In the calling thread's namespace: a veth `fibA` (MTU `mtu`, addresses in 10.1.0.0/24 and
/// fd00:1::/64) whose neighbour table knows `backends` ([`fib_neighbour_mac`]), with
/// forwarding on, so the FIB gives the data plane next hops. Returns its ifindex.
pub fn fib_segment(mtu: u32, backends: &[IpAddr]) -> u32 {
    let sh = |c: &str| {
        let ok = std::process::Command::new("sh")
            .arg("-c")
            .arg(c)
            .status()
            .unwrap()
            .success();
        assert!(ok, "{c}");
    };
    let mac = |m: [u8; 6]| {
        m.iter()
            .map(|b| format!("{b:02x}"))
            .collect::<Vec<_>>()
            .join(":")
    };
    sh(&format!("ip link add fibA mtu {mtu} type veth peer name fibB && ip link set fibA address {} && ip link set fibA up && ip link set fibB up && ip link set lo up", mac(FIB_LOCAL_MAC)));
    sh("ip -6 addr add fd00:1::fe/64 dev fibA nodad && ip addr add 10.1.0.254/24 dev fibA");
    for b in backends {
        let family = if b.is_ipv4() { "-4" } else { "-6" };
        sh(&format!(
            "ip {family} neigh replace {b} lladdr {} nud permanent dev fibA",
            mac(fib_neighbour_mac(*b))
        ));
    }
    sh("sysctl -qw net.ipv6.conf.all.forwarding=1 net.ipv4.conf.all.forwarding=1 net.ipv4.conf.lo.forwarding=1");
    // /sys shows the namespace it was mounted in, so ask the kernel by name from this thread.
    let name = std::ffi::CString::new("fibA").unwrap();
    let ifindex = unsafe { libc::if_nametoindex(name.as_ptr()) };
    assert_ne!(ifindex, 0);
    ifindex
}

/// The flow key of a client packet, as the data plane builds it.
pub fn flow(src: &str, sport: u16, dst: &str, dport: u16, proto: u8) -> FlowKey {
    let (s, family) = to_words(src.parse().unwrap());
    let (d, _) = to_words(dst.parse().unwrap());
    FlowKey {
        src: s,
        dst: d,
        sport: sport.to_be(),
        dport: dport.to_be(),
        proto,
        family,
        _pad: [0; 2],
    }
}
