//! The lab: the data planes' configuration and loading, the namespaces of the next-hop
//! variants, the pre-populated flows and the checks that every path acts as the case says.

use std::{collections::BTreeMap, os::fd::OwnedFd, time::Instant};

use anyhow::{anyhow, bail, Context, Result};
use aya::{
    maps::{HashMap as BpfHashMap, Map, MapData, PerCpuArray},
    programs::{TestRun, TestRunOptions},
};
use lb_common::{
    maps, quic, stat, BackendEntry, ConnEntry, FlowKey, LbConfig, QuicServerKey, TenantLimits,
    VipKey, VipMeta, AFFINITY_TABLE_SIZE, BACKEND_ACTIVE, BACKEND_F_GUE, PROTO_TCP, PROTO_UDP,
    VIP_F_INBAND, VIP_F_QUIC_CID, VIP_F_SECOND_CHANCE, VIP_F_TENANTS,
};
use serde_json::{json, Value};
use sluice::{
    addr::to_words,
    config::Cidr,
    dataplane::{Dataplane, LoadOptions, PROG_DECAP, PROG_XDP},
    maglev::{self, MaglevBackend},
};
use sluice_tests::{
    frames::{Mac, ACK, SYN},
    tenants::TenantMaps,
    FALLBACK_MAC, RING, SEED,
};

use super::{
    cases::{Dp, Variant},
    traffic::{patch_v4, v4_tcp_frame, TestFrames},
    Opts, BACKENDS4, BACKENDS6, BACKENDS_INBAND, BACKENDS_QUIC, BACKENDS_TENANT, BACKENDS_UDP,
    BLOCK_MANY, BLOCK_SYN_FULL, FIB_DEV_MAC, FIB_MTU, FULL_TABLE_PER_CPU, INBAND_PORT, QUIC_PORT,
    QUIC_SIDS, TENANT_PORT, UDP_PORT, VIP4, VIP6, VIP_PORT, XDP_PASS, XDP_REDIRECT, XDP_TX,
};
use crate::sys;

fn config() -> LbConfig {
    let (src4, _) = to_words("172.16.0.0".parse().unwrap());
    let (src6, _) = to_words("fd00:5:1::".parse().unwrap());
    LbConfig {
        encap_src_v4: src4[0],
        encap_src_v4_hostmask: u32::from_ne_bytes([0, 0, 0xff, 0xff]),
        encap_src_v6: src6,
        encap_src_v6_hostmask: u32::MAX,
        hash_seed: SEED,
        fallback_mac: FALLBACK_MAC,
        // Off: the new-flow cases measure the insert path, not the flood bypass.
        flood_new_flows_per_sec: 0,
        ..Default::default()
    }
}

/// Adds a VIP with `backends`. A second-chance VIP's backends run the backend program
/// (GUE), and its ring is published twice, the second table moving every slot to the next
/// backend, so every slot names a previous owner and every packet carries one.
fn add_vip(
    dp: &mut Dataplane,
    id: u32,
    (addr, port, proto): (&str, u16, u8),
    flags: u32,
    backends: &[(u32, &str)],
) -> Result<()> {
    let second_chance = flags & VIP_F_SECOND_CHANCE != 0;
    let (a, family) = to_words(addr.parse()?);
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
        affinity_secs: 0,
        quic_server_id_len: QUIC_SIDS[0].len() as u8,
        ..Default::default()
    };
    for (bid, baddr) in backends {
        let (ba, bf) = to_words(baddr.parse()?);
        dp.set_backend(
            *bid,
            &BackendEntry {
                addr: ba,
                family: bf,
                state: BACKEND_ACTIVE,
                flags: if second_chance { BACKEND_F_GUE } else { 0 },
                vip: id,
                ..Default::default()
            },
        )?;
    }
    let mb: Vec<MaglevBackend> = backends
        .iter()
        .map(|(id, key)| MaglevBackend {
            id: *id,
            key,
            weight: 1,
        })
        .collect();
    let table = maglev::build(&mb, RING, SEED).map_err(|e| anyhow!("maglev: {e:?}"))?;
    if second_chance {
        let ids: Vec<u32> = backends.iter().map(|(id, _)| *id).collect();
        let rotated: Vec<u32> = table
            .iter()
            .map(|b| {
                let i = ids.iter().position(|x| x == b).expect("a table backend");
                ids[(i + 1) % ids.len()]
            })
            .collect();
        dp.publish(&key, meta, &rotated)?;
    }
    dp.publish(&key, meta, &table)?;
    Ok(())
}

/// The tenants' VIP id.
const TENANT_VIP: u32 = 5;
/// The tenant of the generated new flows (100.80.0.0/12, inside tenant 3's 100.64.0.0/10)
/// and of the established flow's client (192.0.2.0/24).
const TENANT_NEW: u32 = 7;
const TENANT_ESTABLISHED: u32 = 9;

pub(super) const TENANTS_DESCRIBED: &str = "10.200.0.1:9443/tcp with VIP_F_TENANTS (4 backends, as the IPv4 VIP) on every data plane; the controller's write (Dataplane::sync_tenants) puts 1,000 prefixes in TENANT_PREFIXES and the IPv4 /24 table TENANT_V4: 498 IPv4 (/8 to /28) and 498 IPv6 (/24 to /64) spread over tenants 1..=63, 100.64.0.0/10 (tenant 3), 100.80.0.0/12 inside it (tenant 7: the new flows' clients, whose /24s the table answers), 192.0.2.0/24 (tenant 9: the established flow's client) and 2001:db8:c::/48; every tenant's limits on the VIP admit: a rate of 1e9 new sessions/s with a burst of 1e9 (the GCRA bucket is read and written on every new session), no flags. syn_new_flow_tenants sends syn_new_flow's generated SYNs to this port; established_tenants an ACK of a flow the VIP admitted";

/// Gives the tenants 1,000 prefixes of both families (a fixed pseudo-random spread, none
/// overlapping the clients' 100.64.0.0/10, 192.0.2.0/24, 2001:db8:c::/48) and every tenant
/// limits on the tenants' VIP that admit, written as the controller writes them.
fn add_tenants(dp: &mut Dataplane) -> Result<()> {
    let mut seen = std::collections::BTreeSet::new();
    let mut x: u64 = 0x5eed_7e4a;
    let mut next = || {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        x
    };
    let mut fixed = vec![
        ("100.64.0.0/10".to_string(), 3),
        ("100.80.0.0/12".to_string(), TENANT_NEW),
        ("192.0.2.0/24".to_string(), TENANT_ESTABLISHED),
        ("2001:db8:c::/48".to_string(), TENANT_ESTABLISHED),
    ];
    let mut v4 = 0;
    while v4 < 498 {
        let len = 8 + (next() % 21) as u32;
        let addr = (next() as u32) & (u32::MAX << (32 - len));
        let first = addr >> 24;
        // Not 100/8 nor 192/8: the clients' prefixes stay the longest match of theirs.
        if first == 100 || first == 192 || !seen.insert((4, addr as u128, len)) {
            continue;
        }
        let a = std::net::Ipv4Addr::from(addr);
        fixed.push((format!("{a}/{len}"), 1 + (next() % 63) as u32));
        v4 += 1;
    }
    let mut v6 = 0;
    while v6 < 498 {
        let len = 24 + (next() % 41) as u32;
        // Inside 2400::/8..2fff::/8: never 2001:db8::/32.
        let hi = (0x24u128 + (next() % 12) as u128) << 120;
        let addr = (hi | ((next() as u128) << 56)) & (u128::MAX << (128 - len));
        if !seen.insert((6, addr, len)) {
            continue;
        }
        let a = std::net::Ipv6Addr::from(addr);
        fixed.push((format!("{a}/{len}"), 1 + (next() % 63) as u32));
        v6 += 1;
    }
    let prefixes: BTreeMap<Cidr, u32> = fixed
        .iter()
        .map(|(cidr, tenant)| Ok((cidr.parse()?, *tenant)))
        .collect::<Result<_>>()?;
    let admit = TenantLimits {
        interval_ns: 1,
        burst_ns: 1_000_000_000,
        ..Default::default()
    };
    let limits = (0..lb_common::MAX_TENANTS)
        .map(|tenant| (lb_common::tenant_index(TENANT_VIP, tenant), admit))
        .collect();
    dp.sync_tenants(&prefixes, &limits, &[])?;
    Ok(())
}

/// Loads one data plane with the benchmark's VIPs (IPv4 and IPv6, 4 backends each, full
/// 65537-slot Maglev rings, in table or second-chance mode) and a conn table of
/// `conn_table_size`.
pub(super) fn load_dp(
    object: &[u8],
    conn_table_size: u32,
    second_chance: bool,
) -> Result<Dataplane> {
    let opts = LoadOptions {
        conn_table_size,
        affinity_table_size: AFFINITY_TABLE_SIZE,
        max_vips: 6,
        ..Default::default()
    };
    let mut dp = Dataplane::load(object, &opts).context("loading the data plane")?;
    dp.set_config(&config())?;
    let sc = if second_chance {
        VIP_F_SECOND_CHANCE
    } else {
        0
    };
    add_vip(&mut dp, 0, (VIP4, VIP_PORT, PROTO_TCP), sc, &BACKENDS4)?;
    add_vip(&mut dp, 1, (VIP6, VIP_PORT, PROTO_TCP), sc, &BACKENDS6)?;
    add_vip(
        &mut dp,
        2,
        (VIP4, INBAND_PORT, PROTO_TCP),
        VIP_F_INBAND,
        &BACKENDS_INBAND,
    )?;
    add_vip(&mut dp, 3, (VIP4, UDP_PORT, PROTO_UDP), 0, &BACKENDS_UDP)?;
    add_vip(
        &mut dp,
        4,
        (VIP4, QUIC_PORT, PROTO_UDP),
        VIP_F_QUIC_CID,
        &BACKENDS_QUIC,
    )?;
    for ((id, _), sid) in BACKENDS_QUIC.iter().zip(QUIC_SIDS) {
        let key = QuicServerKey {
            vip: 4,
            _pad: 0,
            id: quic::server_id_value(&sid),
        };
        dp.set_quic_server(&key, *id)?;
    }
    add_vip(
        &mut dp,
        TENANT_VIP,
        (VIP4, TENANT_PORT, PROTO_TCP),
        VIP_F_TENANTS,
        &BACKENDS_TENANT,
    )?;
    add_tenants(&mut dp)?;
    Ok(dp)
}

/// The conn table of a loaded data plane, a typed handle of its own (the `Dataplane` API
/// clears it only as a whole; the new-flow case deletes exactly the flows it inserted).
pub(super) fn conn_map(dp: &mut Dataplane) -> Result<BpfHashMap<MapData, FlowKey, ConnEntry>> {
    let data = MapData::from_fd(dp.conns_fd()?)?;
    Ok(BpfHashMap::try_from(Map::LruHashMap(data))?)
}

/// One of `sluice_xdp`'s maps, found by name through the kernel's program info.
fn map_by_name(dp: &mut Dataplane, name: &str) -> Result<MapData> {
    let info = dp.program(PROG_XDP)?.info()?;
    let ids = info
        .map_ids()?
        .ok_or_else(|| anyhow!("kernel does not report program map ids"))?;
    for id in ids {
        let data = MapData::from_id(id)?;
        if data.info()?.name_as_str() == Some(name) {
            return Ok(data);
        }
    }
    bail!("no {name} map among sluice_xdp's maps")
}

/// The global counters summed over CPUs, indexed by `lb_common::stat`. Read directly (not
/// through `Dataplane::stats`) so an object from another build, with more or fewer counters,
/// can be measured with `--object`: the counters both know are read.
pub(super) fn counters(dp: &mut Dataplane) -> Result<Vec<u64>> {
    let data = map_by_name(dp, maps::STATS)?;
    let n = data.info()?.max_entries().min(stat::COUNT);
    let a: PerCpuArray<MapData, u64> = PerCpuArray::try_from(Map::PerCpuArray(data))?;
    (0..n).map(|i| Ok(a.get(&i, 0)?.iter().sum())).collect()
}

pub(super) fn stats_delta(before: &[u64], after: &[u64], into: &mut BTreeMap<&'static str, u64>) {
    for (i, (a, b)) in after.iter().zip(before).enumerate() {
        if a > b {
            *into.entry(stat::NAMES[i]).or_default() += a - b;
        }
    }
}

/// Configures the `fib` namespace (this thread must be in it): a veth whose segment holds
/// the backends, with permanent neighbours, and forwarding on (also on `lo`, the ingress
/// device of BPF_PROG_TEST_RUN).
pub(super) fn setup_fib_netns() -> Result<u32> {
    sys::sh("ip link set lo up && ip link add fibA type veth peer name fibB && ip link set fibA address 02:00:00:00:0a:0a && ip link set fibA up && ip link set fibB up")?;
    sys::sh("ip addr add 10.1.0.254/24 dev fibA && ip -6 addr add fd00:1::fe/64 dev fibA nodad")?;
    let mut neigh = String::new();
    for (id, a) in BACKENDS4 {
        neigh += &format!(
            "ip neigh replace {a} lladdr 02:00:00:00:0b:{id:02x} nud permanent dev fibA && "
        );
    }
    for (id, a) in BACKENDS6 {
        neigh += &format!(
            "ip -6 neigh replace {a} lladdr 02:00:00:00:0b:{id:02x} nud permanent dev fibA && "
        );
    }
    neigh += "true";
    sys::sh(&neigh)?;
    sys::sh("sysctl -qw net.ipv4.conf.all.forwarding=1 net.ipv4.conf.lo.forwarding=1 net.ipv6.conf.all.forwarding=1 net.ipv6.conf.lo.forwarding=1")?;
    sys::ifindex("fibA")
}

/// Enters a variant's namespace. The data plane caches next hops per backend for a second;
/// a cache learnt in the other namespace would hide this one's path, so it is flushed.
pub(super) fn enter_variant(ns: &OwnedFd, dps: &mut [Dataplane]) -> Result<()> {
    sys::enter_netns(ns)?;
    let ids = BACKENDS4
        .iter()
        .chain(&BACKENDS6)
        .chain(&BACKENDS_UDP)
        .chain(&BACKENDS_QUIC)
        .chain(&BACKENDS_TENANT)
        .map(|(id, _)| *id);
    for dp in dps.iter_mut() {
        dp.flush_next_hops(ids.clone())?;
    }
    Ok(())
}

pub(super) fn run_once(
    dp: &mut Dataplane,
    prog: &str,
    frame: &[u8],
    out: &mut [u8],
) -> Result<(u32, usize)> {
    let r = dp.program(prog)?.test_run(TestRunOptions {
        data_in: Some(frame),
        data_out: Some(out),
        ..Default::default()
    })?;
    Ok((r.return_value, r.data_size_out as usize))
}

/// The namespaces of the measured variants and the four data planes.
pub(super) struct Lab {
    netns: Vec<(Variant, OwnedFd)>,
    /// Held for the whole run: the namespace the thread returns to after writing the devmap.
    _ns_fallback: OwnedFd,
    ns_fib: OwnedFd,
    pub(super) dps: [Dataplane; 4],
    pub(super) new_conns: BpfHashMap<MapData, FlowKey, ConnEntry>,
}

impl Lab {
    pub(super) fn new(opts: &Opts, object: &[u8], possible: usize) -> Result<Lab> {
        // Namespaces: `fallback` is empty, `fib` has routes and neighbours for the backends.
        let mut netns: Vec<(Variant, OwnedFd)> = Vec::new();
        let ns_fallback = sys::new_netns()?;
        let ns_fib = sys::new_netns()?;
        let fib_ifindex = setup_fib_netns().context("setting up the fib namespace")?;
        for v in &opts.variants {
            let fd = match v {
                Variant::Fallback => ns_fallback.try_clone()?,
                Variant::Fib => ns_fib.try_clone()?,
            };
            netns.push((*v, fd));
        }

        // Data planes. The main one uses the production conn-table size; a per-CPU LRU gives
        // each possible CPU max_entries / possible_cpus entries, all on the pinned CPU here.
        let t = Instant::now();
        let full_size = FULL_TABLE_PER_CPU * possible as u32;
        let mut dps = [
            load_dp(object, opts.conn_table, false)?,
            load_dp(object, opts.conn_table, false)?,
            load_dp(object, full_size, false)?,
            // Second chance keeps no TCP flows: the smallest table.
            load_dp(object, full_size, true)?,
        ];
        // The devmap resolves ifindexes in the writer's namespace: write it from `fib`.
        sys::enter_netns(&ns_fib)?;
        for dp in dps.iter_mut() {
            dp.add_tx_port(fib_ifindex)?;
        }
        sys::enter_netns(&ns_fallback)?;
        println!(
            "loaded 4 data planes (conn tables {}, {}, {full_size}, second chance) in {:.2} s",
            opts.conn_table,
            opts.conn_table,
            t.elapsed().as_secs_f64()
        );
        let new_conns = conn_map(&mut dps[Dp::New as usize])?;
        Ok(Lab {
            netns,
            _ns_fallback: ns_fallback,
            ns_fib,
            dps,
            new_conns,
        })
    }

    pub(super) fn enter(&mut self, v: Variant) -> Result<()> {
        let ns = &self
            .netns
            .iter()
            .find(|(x, _)| *x == v)
            .expect("variant has a namespace")
            .1;
        enter_variant(ns, &mut self.dps)
    }

    pub(super) fn dp(&mut self, which: Dp) -> &mut Dataplane {
        &mut self.dps[which as usize]
    }

    /// New sessions of the new-flow tenant admitted on the new-flow data plane.
    pub(super) fn tenant_admitted(&mut self) -> Result<u64> {
        let t = TenantMaps::open(self.dp(Dp::New))?;
        Ok(t.stats(TENANT_VIP, TENANT_NEW)?.admitted)
    }
}

/// Pre-populates the established flows (each sent once as a SYN) and fills the small table;
/// returns the next fresh flow of the full-table case.
pub(super) fn populate(
    lab: &mut Lab,
    fr: &TestFrames,
    flows: usize,
    out: &mut [u8],
) -> Result<u64> {
    let t = Instant::now();
    {
        let dp = lab.dp(Dp::Main);
        for f in [
            &fr.syn4,
            &fr.syn1500,
            &fr.syn6,
            &fr.syn_ib,
            &fr.ack_ib,
            &fr.req_ib,
            &fr.udp4,
            &fr.syn_tenant,
        ] {
            let (a, _) = run_once(dp, PROG_XDP, f, out)?;
            if a != XDP_TX {
                bail!("populating an established flow: action {a}, expected XDP_TX");
            }
        }
        let mut f = fr.many_tpl.clone();
        f[47] = SYN;
        for n in 0..flows as u64 {
            patch_v4(&mut f, BLOCK_MANY, n);
            let (a, _) = run_once(dp, PROG_XDP, &f, out)?;
            if a != XDP_TX {
                bail!("populating flow {n}: action {a}");
            }
        }
        // The QUIC frame must be routed by its connection ID, never by the table.
        let before = counters(dp)?;
        let (a, _) = run_once(dp, PROG_XDP, &fr.quic4, out)?;
        let after = counters(dp)?;
        let routed = stat::QUIC_CID_ROUTED.index();
        if a != XDP_TX || after.get(routed).copied() != before.get(routed).map(|n| n + 1) {
            bail!("the QUIC frame was not routed by its connection ID (action {a})");
        }
        let s = counters(dp)?;
        let want = flows as u64 + 6;
        // (An object built without the miss counter shows 0 misses: not an error.)
        let misses = s[stat::CONN_MISS.index()];
        if misses != want && misses != 0 {
            bail!("populating: {misses} misses (expected {want})");
        }
        // The tenants' VIP looked its client's tenant up: the established flow is admitted.
        let admitted = TenantMaps::open(dp)?
            .stats(TENANT_VIP, TENANT_ESTABLISHED)?
            .admitted;
        if admitted != 1 {
            bail!(
                "populating: tenant {TENANT_ESTABLISHED} admitted {admitted} sessions, expected 1"
            );
        }
    }
    let mut full_next: u64 = 0;
    {
        let dp = lab.dp(Dp::Full);
        let mut f = fr.syn_tpl.clone();
        for _ in 0..2 * FULL_TABLE_PER_CPU as u64 {
            patch_v4(&mut f, BLOCK_SYN_FULL, full_next);
            full_next += 1;
            run_once(dp, PROG_XDP, &f, out)?;
        }
    }
    println!(
        "populated {} established flows (+6) and filled the {}-entry-per-CPU table in {:.2} s",
        flows,
        FULL_TABLE_PER_CPU,
        t.elapsed().as_secs_f64()
    );
    Ok(full_next)
}

/// Checks the path of each variant once before measuring.
pub(super) fn check_paths(
    lab: &mut Lab,
    variants: &[Variant],
    ack4: &[u8],
    out: &mut [u8],
) -> Result<()> {
    for &v in variants {
        lab.enter(v)?;
        let dp = lab.dp(Dp::Main);
        let before = counters(dp)?;
        let (a, len) = run_once(dp, PROG_XDP, ack4, out)?;
        let after = counters(dp)?;
        let mut d = BTreeMap::new();
        stats_delta(&before, &after, &mut d);
        let dmac: Mac = out[0..6].try_into().unwrap();
        let smac: Mac = out[6..12].try_into().unwrap();
        println!(
            "path check [{}]: action {a}, {len} B out, dst MAC {}, src MAC {}, counters {:?}",
            v.name(),
            mac_str(&dmac),
            mac_str(&smac),
            d
        );
        let ok = match v {
            // The action and the MACs decide (the counters are shown, and an object built
            // without some counters is still measurable).
            Variant::Fallback => a == XDP_TX && dmac == FALLBACK_MAC,
            Variant::Fib => {
                a == XDP_REDIRECT && smac == FIB_DEV_MAC && dmac[..5] == [0x02, 0, 0, 0, 0x0b]
            }
        };
        if !ok {
            bail!("variant {} did not take its next-hop path", v.name());
        }
    }
    Ok(())
}

/// The FIB path of a full-size packet: with a 1500-byte egress MTU the encapsulated packet
/// (1520 bytes of L3) does not fit, and bpf_fib_lookup says FRAG_NEEDED. Records what the
/// data plane does then, and leaves a 9000-byte underlay MTU to measure with (what IPIP with
/// full-size client packets needs anyway).
pub(super) fn mtu_check(lab: &mut Lab, data1500: &[u8], out: &mut [u8]) -> Result<Value> {
    sys::enter_netns(&lab.ns_fib)?;
    let dp = lab.dp(Dp::Main);
    let at1500 = mtu_row(1500, dp, data1500, out)?;
    let at9000 = mtu_row(FIB_MTU, dp, data1500, out)?;
    Ok(json!([at1500, at9000]))
}

fn mtu_row(mtu: u32, dp: &mut Dataplane, data1500: &[u8], out: &mut [u8]) -> Result<Value> {
    sys::sh(&format!(
        "ip link set fibA mtu {mtu} && ip link set fibB mtu {mtu}"
    ))?;
    // The cached next hop remembers the old MTU for up to a second.
    dp.flush_next_hops(BACKENDS4.iter().map(|(id, _)| *id))?;
    let before = counters(dp)?;
    let (a, len) = run_once(dp, PROG_XDP, data1500, out)?;
    let after = counters(dp)?;
    let mut d = BTreeMap::new();
    stats_delta(&before, &after, &mut d);
    let dmac: Mac = out[0..6].try_into().unwrap();
    println!(
        "1514 B frame, fib netns, egress MTU {mtu}: action {a}, {len} B out, dst MAC {}, counters {:?}",
        mac_str(&dmac),
        d
    );
    Ok(
        json!({ "egress_mtu": mtu, "action": a, "bytes_out": len, "dst_mac": mac_str(&dmac), "counters": d }),
    )
}

/// The backend program's frames, and the sockets that make `here` a connection on this host.
pub(super) struct BackendFrames {
    pub(super) here: Vec<u8>,
    pub(super) elsewhere: Vec<u8>,
    _sockets: (
        std::net::TcpListener,
        std::net::TcpStream,
        std::net::TcpStream,
    ),
}

/// The backend program's frames: the LB's own GUE output (second-chance data plane, `fib`
/// namespace) for a flow whose connection is on this host, and for one whose is not (only
/// the VIP's listener is here and the ACK carries no cookie of its, so it is passed on to
/// the previous owner the LB named).
pub(super) fn backend_frames(lab: &mut Lab, ack4: &[u8], out: &mut [u8]) -> Result<BackendFrames> {
    enter_variant(&lab.ns_fib, &mut lab.dps)?;
    sys::sh(&format!("ip addr add {VIP4}/32 dev lo"))?;
    let listener = std::net::TcpListener::bind((VIP4, VIP_PORT))?;
    let client = std::net::TcpStream::connect((VIP4, VIP_PORT))?;
    let (server, _) = listener.accept()?;
    let c = client.local_addr()?;
    let dp = lab.dp(Dp::Sc);
    let here = lb_gue(
        dp,
        &v4_tcp_frame(&c.ip().to_string(), c.port(), VIP4, VIP_PORT, ACK, b""),
        out,
    )?;
    let elsewhere = lb_gue(dp, ack4, out)?;
    for (f, want, what) in [
        (&here, XDP_PASS, "a packet of a connection here"),
        (&elsewhere, XDP_REDIRECT, "a packet without a socket here"),
    ] {
        let (a, _) = run_once(dp, PROG_DECAP, f, out)?;
        if a != want {
            bail!("backend program on {what}: action {a}, expected {want}");
        }
    }
    Ok(BackendFrames {
        here,
        elsewhere,
        _sockets: (listener, client, server),
    })
}

/// The second-chance LB's GUE output for `inner`.
fn lb_gue(dp: &mut Dataplane, inner: &[u8], out: &mut [u8]) -> Result<Vec<u8>> {
    let (a, len) = run_once(dp, PROG_XDP, inner, out)?;
    let f = out[..len].to_vec();
    // UDP to the GUE port, and a previous backend named.
    if a != XDP_REDIRECT || f[23] != 17 || f[36..38] != lb_common::GUE_PORT.to_be_bytes() {
        bail!("the second-chance LB did not send GUE: action {a}, {len} B");
    }
    if f[50..54] == [0; 4] {
        bail!("the LB's GUE names no previous backend");
    }
    Ok(f)
}

fn mac_str(m: &Mac) -> String {
    m.iter()
        .map(|b| format!("{b:02x}"))
        .collect::<Vec<_>>()
        .join(":")
}
