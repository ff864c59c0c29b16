//! `sluice-bench xdp`: per-packet cost of the real `sluice_xdp` through BPF_PROG_TEST_RUN,
//! against the XDP_PASS baseline `sluice_pass` measured the same way in the same run.
//!
//! # Method
//!
//! - Every call is `BPF_PROG_TEST_RUN` with `repeat = 1` on a fresh copy of the input frame
//!   (the kernel copies `data_in` on every call), for every case including the baseline: with
//!   `repeat > 1` a rewritten (encapsulated) packet would carry over into the next repeat.
//! - Two figures per call: the kernel-reported duration (`TestRunResult::duration`: the
//!   program plus the test-run harness's fixed bh-disable and clock-read overhead) and the
//!   wall-clock time of the whole batch of syscalls divided by the calls
//!   ("syscall-inclusive": frame copy in and out, the syscall, buffer allocation).
//! - Rounds: every round runs one batch of every (next-hop variant, case) pair, in an order
//!   shuffled per round, so slow drift on a noisy VM spreads over all cases. Per case the
//!   report gives the median, minimum and 90th percentile over rounds of the batch means,
//!   and the ratio to its baseline's median.
//! - The thread is pinned to one CPU; the benchmark runs in fresh network namespaces:
//!   `fallback`, empty (forwarding off, so `bpf_fib_lookup` fails at once and the configured
//!   fallback MAC is used: XDP_TX), and `fib`, with a route and permanent neighbours for the
//!   backends and forwarding on (`bpf_fib_lookup` succeeds: XDP_REDIRECT through the devmap,
//!   the production path). The data-plane counters of every batch confirm the path taken.
//! - Every loop is bounded in calls and in time.
//! - Second chance: the `sc_*` cases send the same traffic to the same VIPs in
//!   `second-chance` mode (a fourth data plane), so the two modes compare within one run; the
//!   `backend_*` cases run `sluice_decap` on that LB's GUE output (`fib` variant only: the
//!   socket and FIB lookups happen there) against `sluice_pass` on the same frame.

mod report;

use std::{
    collections::BTreeMap,
    os::fd::OwnedFd,
    path::PathBuf,
    time::{Duration, Instant},
};

use anyhow::{anyhow, bail, Context, Result};
use aya::{
    maps::{HashMap as BpfHashMap, Map, MapData, PerCpuArray},
    programs::{TestRun, TestRunOptions, Xdp},
};
use lb_common::{
    maps, stat, BackendEntry, ConnEntry, FlowKey, LbConfig, VipKey, VipMeta, AFFINITY_TABLE_SIZE,
    BACKEND_ACTIVE, BACKEND_F_GUE, CONN_TABLE_SIZE, FAMILY_V4, PROTO_TCP, VIP_F_INBAND,
    VIP_F_SECOND_CHANCE,
};
use serde_json::{json, Value};
use sluice::{
    addr::to_words,
    dataplane::{Dataplane, LoadOptions, PROG_DECAP, PROG_PASS, PROG_XDP},
    maglev::{self, MaglevBackend},
    object::BPF_OBJECT,
};
use sluice_tests::{
    flow,
    frames::{self, eth, ipv6, tcp, Mac, ACK, ETH_IP, ETH_IPV6, PSH, SYN, V4},
    FALLBACK_MAC, RING, SEED,
};

use crate::{out, sys};

const XDP_PASS: u32 = 2;
const XDP_TX: u32 = 3;
const XDP_REDIRECT: u32 = 4;

const LB_MAC: Mac = [0x02, 0, 0, 0, 0, 0x01];
const CLIENT_MAC: Mac = [0x02, 0, 0, 0, 0, 0x02];
/// Egress MTU in the `fib` namespace: room for the 20/40 encapsulation bytes on full-size
/// client packets.
const FIB_MTU: u32 = 9000;
const FIB_DEV_MAC: Mac = [0x02, 0, 0, 0, 0x0a, 0x0a];
const VIP4: &str = "10.200.0.1";
const VIP6: &str = "fd00:200::1";
const NON_VIP4: &str = "10.201.0.9";
const CLIENT4: &str = "192.0.2.10";
const CLIENT6: &str = "2001:db8:c::10";
const VIP_PORT: u16 = 443;
/// The in-band VIP: the IPv4 VIP's address on another port, its own backend ids.
const INBAND_PORT: u16 = 8443;
const BACKENDS_INBAND: [(u32, &str); 2] = [(21, "10.2.0.1"), (22, "10.2.0.2")];
const BACKENDS4: [(u32, &str); 4] = [
    (1, "10.1.0.1"),
    (2, "10.1.0.2"),
    (3, "10.1.0.3"),
    (4, "10.1.0.4"),
];
const BACKENDS6: [(u32, &str); 4] = [
    (11, "fd00:1::1"),
    (12, "fd00:1::2"),
    (13, "fd00:1::3"),
    (14, "fd00:1::4"),
];

/// Client address blocks (host order) of the generated flows: each family of flows gets its
/// own block of 2^20 addresses inside 100.64.0.0/10; the source port carries the rest.
const BLOCK_MANY: u32 = 0x6440_0000; // 100.64.0.0: the pre-populated established flows
const BLOCK_SYN: u32 = 0x6450_0000; // 100.80.0.0: new flows (table with room)
const BLOCK_SYN_FULL: u32 = 0x6460_0000; // 100.96.0.0: new flows into a full table
const BLOCK_BITS: u32 = 20;

/// Per-CPU capacity of the conn table of the "full table" case: small, so it is kept full
/// and every new flow evicts.
const FULL_TABLE_PER_CPU: u32 = 4096;

struct Opts {
    rounds: usize,
    calls: usize,
    flows: usize,
    batch_secs: f64,
    max_secs: f64,
    cpu: usize,
    out: PathBuf,
    svg: PathBuf,
    variants: Vec<Variant>,
    /// Only these cases (baselines are always measured).
    cases: Option<Vec<CaseId>>,
    /// A BPF object to load instead of the embedded one (A/B of data-plane changes).
    object: Option<PathBuf>,
    /// Conn-table capacity of the established and new-flow data planes.
    conn_table: u32,
}

/// `sluice-bench xdp --help`.
#[derive(clap::Parser, Debug)]
#[command(
    name = "sluice-bench xdp",
    about = "Per-packet cost of sluice_xdp (BPF_PROG_TEST_RUN, repeat 1 per call on a fresh \
             frame) against the XDP_PASS baseline sluice_pass, in fresh network namespaces"
)]
struct Args {
    /// Rounds; each runs one batch of every case, shuffled (default 11; 3 with --quick).
    #[arg(long)]
    rounds: Option<usize>,
    /// Calls per batch (default 200000; 20000 with --quick).
    #[arg(long)]
    calls: Option<usize>,
    /// Distinct established flows of the many-flows case (default 200000; 20000 with --quick).
    #[arg(long)]
    flows: Option<usize>,
    /// Time bound of one batch, in seconds.
    #[arg(long = "batch-secs", default_value_t = 1.0)]
    batch_secs: f64,
    /// Time bound of the measuring phase in seconds; later rounds are skipped.
    #[arg(long = "max-secs", default_value_t = 90.0)]
    max_secs: f64,
    /// CPU to pin to (default: the last online CPU).
    #[arg(long)]
    cpu: Option<usize>,
    /// Next-hop variants, comma separated.
    #[arg(long, value_enum, value_delimiter = ',', default_values_t = [Variant::Fallback, Variant::Fib])]
    variants: Vec<Variant>,
    /// Only these cases (comma separated keys; baselines always run).
    #[arg(long, value_delimiter = ',')]
    cases: Option<Vec<String>>,
    /// Load this BPF object instead of the embedded target/bpf/sluice.bpf.o (to compare a
    /// data-plane change; its maps must keep the layout).
    #[arg(long)]
    object: Option<PathBuf>,
    /// Conn-table capacity of the established/new-flow data planes (default
    /// lb_common::CONN_TABLE_SIZE, the production default).
    #[arg(long = "conn-table", default_value_t = CONN_TABLE_SIZE)]
    conn_table: u32,
    /// --rounds 3 --calls 20000 --flows 20000 (each unless given).
    #[arg(long)]
    quick: bool,
    /// JSON results (default target/bench/xdp.json).
    #[arg(long)]
    out: Option<PathBuf>,
    /// SVG chart (default: the JSON path with .svg).
    #[arg(long)]
    svg: Option<PathBuf>,
    #[arg(long, help = out::RECORD_HELP)]
    record: bool,
}

fn parse_opts(args: &[String]) -> Result<Option<Opts>> {
    let Some(a) = crate::cli_args::<Args>("sluice-bench xdp", args)? else {
        return Ok(None);
    };
    let cases = match &a.cases {
        None => None,
        Some(keys) => Some(
            keys.iter()
                .map(|k| {
                    CASES
                        .iter()
                        .find(|c| c.key == k)
                        .map(|c| c.id)
                        .ok_or_else(|| {
                            anyhow!(
                                "unknown case {k}; cases: {}",
                                CASES.iter().map(|c| c.key).collect::<Vec<_>>().join(", ")
                            )
                        })
                })
                .collect::<Result<Vec<_>>>()?,
        ),
    };
    let out_path = a
        .out
        .unwrap_or_else(|| out::default_path(a.record, "xdp.json"));
    let o = Opts {
        rounds: a.rounds.unwrap_or(if a.quick { 3 } else { 11 }),
        calls: a.calls.unwrap_or(if a.quick { 20_000 } else { 200_000 }),
        flows: a.flows.unwrap_or(if a.quick { 20_000 } else { 200_000 }),
        batch_secs: a.batch_secs,
        max_secs: a.max_secs,
        cpu: a
            .cpu
            .unwrap_or_else(|| sys::online_cpus().saturating_sub(1)),
        svg: a.svg.unwrap_or_else(|| out_path.with_extension("svg")),
        out: out_path,
        variants: a.variants,
        cases,
        object: a.object,
        conn_table: a.conn_table,
    };
    if o.rounds == 0 || o.calls == 0 || o.variants.is_empty() {
        bail!("--rounds, --calls and --variants must be non-empty");
    }
    if o.flows == 0 || o.flows > 1 << BLOCK_BITS {
        bail!("--flows must be between 1 and {}", 1u32 << BLOCK_BITS);
    }
    Ok(Some(o))
}

#[derive(Clone, Copy, PartialEq, Eq, Debug, clap::ValueEnum)]
pub enum Variant {
    Fallback,
    Fib,
}

impl Variant {
    pub fn name(self) -> &'static str {
        match self {
            Variant::Fallback => "fallback",
            Variant::Fib => "fib",
        }
    }
    pub fn describe(self) -> &'static str {
        match self {
            Variant::Fallback => "fallback MAC: fresh empty netns, forwarding off, so bpf_fib_lookup fails at once (FWD_DISABLED) and the configured fallback MAC is used; action XDP_TX",
            Variant::Fib => "FIB: netns with a connected route and permanent neighbours for every backend, forwarding on; bpf_fib_lookup succeeds and the packet is redirected through the TX_PORTS devmap (production path); action XDP_REDIRECT",
        }
    }
    fn steered_action(self) -> u32 {
        match self {
            Variant::Fallback => XDP_TX,
            Variant::Fib => XDP_REDIRECT,
        }
    }
}

#[derive(Clone, Copy, PartialEq, Eq, Debug)]
pub enum CaseId {
    Pass,
    Pass1500,
    SynNew,
    SynFull,
    Established,
    Established200k,
    NonVip,
    Established1500,
    EstablishedV6,
    /// Second-chance VIPs: the same traffic steered by the ring alone (GUE to the backend).
    ScSynNew,
    ScEstablished,
    ScEstablished200k,
    ScEstablishedV6,
    /// The backend program (`sluice_decap`) on the LB's GUE output, and its baseline.
    PassGue,
    BackendSocket,
    BackendForward,
    EstablishedInband,
}

/// Which loaded data plane (and so which conn table) a case runs against.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Dp {
    /// Established flows (single, many, 1500 bytes, IPv6), non-VIP, baselines.
    Main = 0,
    /// New flows; the flows inserted by each batch are deleted after it, so the table
    /// always has room (no eviction).
    New = 1,
    /// New flows into a small table kept full: every insert evicts.
    Full = 2,
    /// Second-chance VIPs and GUE backends whose every ring slot names a previous owner (the
    /// most work: each packet carries a second-hop address); also the backend-program cases.
    Sc = 3,
}

pub struct CaseDef {
    pub id: CaseId,
    pub key: &'static str,
    pub label: &'static str,
    dp: Dp,
    pub prog: &'static str,
    pub baseline: Option<CaseId>,
    /// Aimed-for ratio to the baseline (total cost per call).
    pub aim: Option<f64>,
    /// Katran's ratio on this machine kind with the same harness (anchors.md).
    pub katran: Option<f64>,
    /// Katran's cost net of the 60 ns baseline, ns (anchors.md).
    pub katran_net_ns: Option<f64>,
    pub headline: bool,
}

pub const CASES: &[CaseDef] = &[
    CaseDef {
        id: CaseId::Pass,
        key: "pass",
        label: "baseline sluice_pass, 54 B",
        dp: Dp::Main,
        prog: PROG_PASS,
        baseline: None,
        aim: None,
        katran: None,
        katran_net_ns: None,
        headline: false,
    },
    CaseDef {
        id: CaseId::Pass1500,
        key: "pass_1500",
        label: "baseline sluice_pass, 1514 B",
        dp: Dp::Main,
        prog: PROG_PASS,
        baseline: None,
        aim: None,
        katran: None,
        katran_net_ns: None,
        headline: false,
    },
    CaseDef {
        id: CaseId::SynNew,
        key: "syn_new_flow",
        label: "SYN, new flow (miss + insert)",
        dp: Dp::New,
        prog: PROG_XDP,
        baseline: Some(CaseId::Pass),
        aim: Some(8.0),
        katran: Some(10.0),
        katran_net_ns: Some(540.0),
        headline: true,
    },
    CaseDef {
        id: CaseId::SynFull,
        key: "syn_new_flow_full_table",
        label: "SYN, new flow, full table (evicts)",
        dp: Dp::Full,
        prog: PROG_XDP,
        baseline: Some(CaseId::Pass),
        aim: Some(8.0),
        katran: None,
        katran_net_ns: None,
        headline: false,
    },
    CaseDef {
        id: CaseId::Established,
        key: "established",
        label: "established flow (conn hit)",
        dp: Dp::Main,
        prog: PROG_XDP,
        baseline: Some(CaseId::Pass),
        aim: Some(2.5),
        katran: Some(3.3),
        katran_net_ns: Some(138.0),
        headline: true,
    },
    CaseDef {
        id: CaseId::Established200k,
        key: "established_many",
        label: "established, cycling N flows",
        dp: Dp::Main,
        prog: PROG_XDP,
        baseline: Some(CaseId::Pass),
        aim: Some(2.5),
        katran: None,
        katran_net_ns: None,
        headline: false,
    },
    CaseDef {
        id: CaseId::NonVip,
        key: "non_vip",
        label: "non-VIP packet (XDP_PASS)",
        dp: Dp::Main,
        prog: PROG_XDP,
        baseline: Some(CaseId::Pass),
        aim: Some(1.6),
        katran: Some(1.9),
        katran_net_ns: Some(50.0),
        headline: true,
    },
    CaseDef {
        id: CaseId::Established1500,
        key: "established_1500",
        label: "established, 1514 B frame",
        dp: Dp::Main,
        prog: PROG_XDP,
        baseline: Some(CaseId::Pass1500),
        aim: Some(2.5),
        katran: None,
        katran_net_ns: None,
        headline: false,
    },
    CaseDef {
        id: CaseId::EstablishedV6,
        key: "established_v6",
        label: "established IPv6 flow",
        dp: Dp::Main,
        prog: PROG_XDP,
        baseline: Some(CaseId::Pass),
        aim: Some(2.5),
        katran: None,
        katran_net_ns: None,
        headline: false,
    },
    sc_case(
        CaseId::ScSynNew,
        "sc_syn_new_flow",
        "second chance: SYN, new flow",
    ),
    sc_case(
        CaseId::ScEstablished,
        "sc_established",
        "second chance: established",
    ),
    sc_case(
        CaseId::ScEstablished200k,
        "sc_established_many",
        "second chance: cycling N flows",
    ),
    sc_case(
        CaseId::ScEstablishedV6,
        "sc_established_v6",
        "second chance: IPv6",
    ),
    CaseDef {
        id: CaseId::PassGue,
        key: "pass_gue",
        label: "baseline sluice_pass, GUE frame",
        dp: Dp::Sc,
        prog: PROG_PASS,
        baseline: None,
        aim: None,
        katran: None,
        katran_net_ns: None,
        headline: false,
    },
    CaseDef {
        id: CaseId::EstablishedInband,
        key: "established_inband",
        label: "established, in-band VIP, ACK advancing",
        dp: Dp::Main,
        prog: PROG_XDP,
        baseline: Some(CaseId::Pass),
        aim: Some(2.5),
        katran: None,
        katran_net_ns: None,
        headline: false,
    },
    backend_case(
        CaseId::BackendSocket,
        "backend_socket_found",
        "backend: socket here, decap",
    ),
    backend_case(
        CaseId::BackendForward,
        "backend_forwarded",
        "backend: no socket, passed on",
    ),
];

const fn sc_case(id: CaseId, key: &'static str, label: &'static str) -> CaseDef {
    CaseDef {
        id,
        key,
        label,
        dp: Dp::Sc,
        prog: PROG_XDP,
        baseline: Some(CaseId::Pass),
        aim: None,
        katran: None,
        katran_net_ns: None,
        headline: false,
    }
}

/// A case of the backend program. Its frames are the LB's GUE output and it looks up
/// sockets and next hops in the `fib` namespace, so it runs in that variant only.
const fn backend_case(id: CaseId, key: &'static str, label: &'static str) -> CaseDef {
    CaseDef {
        id,
        key,
        label,
        dp: Dp::Sc,
        prog: PROG_DECAP,
        baseline: Some(CaseId::PassGue),
        aim: None,
        katran: None,
        katran_net_ns: None,
        headline: false,
    }
}

fn fib_only(id: CaseId) -> bool {
    matches!(
        id,
        CaseId::PassGue | CaseId::BackendSocket | CaseId::BackendForward
    )
}

pub fn case(id: CaseId) -> &'static CaseDef {
    CASES
        .iter()
        .find(|c| c.id == id)
        .expect("every id has a def")
}

fn expected_action(id: CaseId, v: Variant) -> u32 {
    match id {
        CaseId::Pass
        | CaseId::Pass1500
        | CaseId::PassGue
        | CaseId::NonVip
        | CaseId::BackendSocket => XDP_PASS,
        _ => v.steered_action(),
    }
}

// ---------------------------------------------------------------------------------------
// Frames

fn v4_tcp_frame(
    src: &str,
    sport: u16,
    dst: &str,
    dport: u16,
    flags: u8,
    payload: &[u8],
) -> Vec<u8> {
    let l3 = V4::new(src, dst, PROTO_TCP).build(&tcp(sport, dport, flags, payload));
    eth(LB_MAC, CLIENT_MAC, ETH_IP, &l3)
}

fn v6_tcp_frame(src: &str, sport: u16, dst: &str, dport: u16, flags: u8) -> Vec<u8> {
    let l3 = ipv6(src, dst, PROTO_TCP, 0, 0, &tcp(sport, dport, flags, b""));
    eth(LB_MAC, CLIENT_MAC, ETH_IPV6, &l3)
}

/// Client (address, port) of generated flow `n` in `block`.
fn gen_flow(block: u32, n: u64) -> (u32, u16) {
    let addr = block + (n as u32 & ((1 << BLOCK_BITS) - 1));
    let port = 1024 + (n >> BLOCK_BITS) as u16;
    (addr, port)
}

fn gen_key(block: u32, n: u64) -> FlowKey {
    let (addr, port) = gen_flow(block, n);
    let (dst, _) = to_words(VIP4.parse().unwrap());
    FlowKey {
        src: [u32::from_ne_bytes(addr.to_be_bytes()), 0, 0, 0],
        dst,
        sport: port.to_be(),
        dport: VIP_PORT.to_be(),
        proto: PROTO_TCP,
        family: FAMILY_V4,
        _pad: [0; 2],
    }
}

/// Rewrites an untagged IPv4/TCP frame for flow `n` of `block`: source address and port, and
/// the IP header checksum (the data plane does not check it, but the frames stay valid).
fn patch_v4(frame: &mut [u8], block: u32, n: u64) {
    let (addr, port) = gen_flow(block, n);
    frame[26..30].copy_from_slice(&addr.to_be_bytes());
    frame[34..36].copy_from_slice(&port.to_be_bytes());
    frame[24..26].copy_from_slice(&[0, 0]);
    let c = frames::csum(&frame[14..34]);
    frame[24..26].copy_from_slice(&c.to_be_bytes());
}

enum Frames {
    /// The same frame on every call.
    Fixed(Vec<u8>),
    /// Flows `next % count` of `block`, cycling (the many-established-flows case).
    Cycle {
        frame: Vec<u8>,
        block: u32,
        next: u64,
        count: u64,
    },
    /// A flow never sent before on every call.
    Fresh {
        frame: Vec<u8>,
        block: u32,
        next: u64,
    },
    /// One flow's ACK whose acknowledgement number advances a segment per call (an in-band
    /// VIP's answer under way: every call takes the progress path).
    Acking { frame: Vec<u8>, ack: u32 },
}

impl Frames {
    #[inline(always)]
    fn next(&mut self) -> &[u8] {
        match self {
            Frames::Fixed(f) => f,
            Frames::Cycle {
                frame,
                block,
                next,
                count,
            } => {
                patch_v4(frame, *block, *next % *count);
                *next += 1;
                frame
            }
            Frames::Fresh { frame, block, next } => {
                patch_v4(frame, *block, *next);
                *next += 1;
                frame
            }
            Frames::Acking { frame, ack } => {
                *ack = ack.wrapping_add(1448);
                frame[42..46].copy_from_slice(&ack.to_be_bytes());
                frame
            }
        }
    }

    fn len(&self) -> usize {
        match self {
            Frames::Fixed(f)
            | Frames::Cycle { frame: f, .. }
            | Frames::Fresh { frame: f, .. }
            | Frames::Acking { frame: f, .. } => f.len(),
        }
    }
}

// ---------------------------------------------------------------------------------------
// Setup

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
    (addr, port): (&str, u16),
    flags: u32,
    backends: &[(u32, &str)],
) -> Result<()> {
    let second_chance = flags & VIP_F_SECOND_CHANCE != 0;
    let (a, family) = to_words(addr.parse()?);
    let key = VipKey {
        addr: a,
        port: port.to_be(),
        proto: PROTO_TCP,
        family,
    };
    let meta = VipMeta {
        id,
        flags,
        ring_size: RING,
        active_ring: 0,
        affinity_secs: 0,
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

/// Loads one data plane with the benchmark's VIPs (IPv4 and IPv6, 4 backends each, full
/// 65537-slot Maglev rings, in table or second-chance mode) and a conn table of
/// `conn_table_size`.
fn load_dp(object: &[u8], conn_table_size: u32, second_chance: bool) -> Result<Dataplane> {
    let opts = LoadOptions {
        conn_table_size,
        affinity_table_size: AFFINITY_TABLE_SIZE,
        max_vips: 3,
        ..Default::default()
    };
    let mut dp = Dataplane::load(object, &opts).context("loading the data plane")?;
    dp.set_config(&config())?;
    let sc = if second_chance {
        VIP_F_SECOND_CHANCE
    } else {
        0
    };
    add_vip(&mut dp, 0, (VIP4, VIP_PORT), sc, &BACKENDS4)?;
    add_vip(&mut dp, 1, (VIP6, VIP_PORT), sc, &BACKENDS6)?;
    add_vip(
        &mut dp,
        2,
        (VIP4, INBAND_PORT),
        VIP_F_INBAND,
        &BACKENDS_INBAND,
    )?;
    Ok(dp)
}

/// The conn table of a loaded data plane, opened by id (the `Dataplane` API clears it only
/// as a whole; the new-flow case deletes exactly the flows it inserted).
fn conn_map(dp: &mut Dataplane) -> Result<BpfHashMap<MapData, FlowKey, ConnEntry>> {
    Ok(BpfHashMap::try_from(Map::LruHashMap(map_by_name(
        dp,
        maps::CONNS,
    )?))?)
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
fn counters(dp: &mut Dataplane) -> Result<Vec<u64>> {
    let data = map_by_name(dp, maps::STATS)?;
    let n = data.info()?.max_entries().min(stat::COUNT);
    let a: PerCpuArray<MapData, u64> = PerCpuArray::try_from(Map::PerCpuArray(data))?;
    (0..n).map(|i| Ok(a.get(&i, 0)?.iter().sum())).collect()
}

/// Configures the `fib` namespace (this thread must be in it): a veth whose segment holds
/// the backends, with permanent neighbours, and forwarding on (also on `lo`, the ingress
/// device of BPF_PROG_TEST_RUN).
fn setup_fib_netns() -> Result<u32> {
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
fn enter_variant(ns: &OwnedFd, dps: &mut [Dataplane]) -> Result<()> {
    sys::enter_netns(ns)?;
    let ids = BACKENDS4.iter().chain(BACKENDS6.iter()).map(|(id, _)| *id);
    for dp in dps.iter_mut() {
        dp.flush_next_hops(ids.clone())?;
    }
    Ok(())
}

fn run_once(dp: &mut Dataplane, prog: &str, frame: &[u8], out: &mut [u8]) -> Result<(u32, usize)> {
    let r = dp.program(prog)?.test_run(TestRunOptions {
        data_in: Some(frame),
        data_out: Some(out),
        ..Default::default()
    })?;
    Ok((r.return_value, r.data_size_out as usize))
}

// ---------------------------------------------------------------------------------------
// Measurement

#[derive(Clone, Debug)]
pub struct Batch {
    pub calls: usize,
    /// Wall-clock ns per call over the batch (syscall-inclusive).
    pub syscall_ns: f64,
    /// Mean of the kernel-reported per-call durations.
    pub kernel_ns: f64,
    /// Median of the kernel-reported per-call durations.
    pub kernel_call_median_ns: f64,
    /// Calls whose action was not the expected one, by action.
    pub wrong_actions: BTreeMap<u32, usize>,
}

fn measure(
    prog: &Xdp,
    frames: &mut Frames,
    calls: usize,
    limit: Duration,
    expect: u32,
    out: &mut [u8],
    kern: &mut Vec<u32>,
) -> Result<Batch> {
    kern.clear();
    let mut wrong: BTreeMap<u32, usize> = BTreeMap::new();
    let mut done = 0usize;
    let t0 = Instant::now();
    while done < calls {
        let chunk = (calls - done).min(1024);
        for _ in 0..chunk {
            let r = prog.test_run(TestRunOptions {
                data_in: Some(frames.next()),
                data_out: Some(&mut *out),
                ..Default::default()
            })?;
            if r.return_value != expect {
                *wrong.entry(r.return_value).or_default() += 1;
            }
            kern.push(r.duration.as_nanos() as u32);
        }
        done += chunk;
        if t0.elapsed() >= limit {
            break;
        }
    }
    let wall = t0.elapsed();
    let mean = kern.iter().map(|&d| d as f64).sum::<f64>() / done as f64;
    let mid = done / 2;
    let (_, med, _) = kern.select_nth_unstable(mid);
    Ok(Batch {
        calls: done,
        syscall_ns: wall.as_nanos() as f64 / done as f64,
        kernel_ns: mean,
        kernel_call_median_ns: *med as f64,
        wrong_actions: wrong,
    })
}

pub struct CaseResult {
    pub variant: Variant,
    pub id: CaseId,
    pub frame_bytes: usize,
    pub batches: Vec<Batch>,
    /// Data-plane counter deltas over every batch of this case (name -> count).
    pub counters: BTreeMap<&'static str, u64>,
}

/// Deterministic shuffle (xorshift64*), so runs are reproducible.
fn shuffle<T>(v: &mut [T], seed: u64) {
    let mut s = seed.wrapping_mul(0x9e37_79b9_7f4a_7c15) | 1;
    for i in (1..v.len()).rev() {
        s ^= s >> 12;
        s ^= s << 25;
        s ^= s >> 27;
        let r = s.wrapping_mul(0x2545_f491_4f6c_dd1d);
        v.swap(i, (r % (i as u64 + 1)) as usize);
    }
}

fn stats_delta(before: &[u64], after: &[u64], into: &mut BTreeMap<&'static str, u64>) {
    for (i, (a, b)) in after.iter().zip(before).enumerate() {
        if a > b {
            *into.entry(stat::NAMES[i]).or_default() += a - b;
        }
    }
}

pub fn main(args: &[String]) -> Result<()> {
    let Some(opts) = parse_opts(args)? else {
        return Ok(());
    };
    sys::require_root()?;
    let started = Instant::now();
    let command_line = std::env::args().collect::<Vec<_>>().join(" ");
    sys::pin_cpu(opts.cpu)?;
    let possible = sys::possible_cpus();
    check_fit(&opts, possible)?;
    println!(
        "sluice-bench xdp: pinned to CPU {}, {} possible CPUs",
        opts.cpu, possible
    );

    let external = match &opts.object {
        Some(p) => Some(std::fs::read(p).with_context(|| format!("reading {}", p.display()))?),
        None => None,
    };
    let object: &[u8] = external.as_deref().unwrap_or(BPF_OBJECT);
    let mut lab = Lab::new(&opts, object, possible)?;
    let frames = TestFrames::build();
    let mut out = vec![0u8; 2048];
    let full_next = populate(&mut lab, &frames, opts.flows, &mut out)?;
    check_paths(&mut lab, &opts.variants, &frames.ack4, &mut out)?;
    let mtu_check = if opts.variants.contains(&Variant::Fib) {
        mtu_check(&mut lab, &frames.data1500, &mut out)?
    } else {
        Value::Null
    };
    // The sockets of the backend cases live until the end of the run.
    let backend = if opts.variants.contains(&Variant::Fib) {
        Some(backend_frames(&mut lab, &frames.ack4, &mut out)?)
    } else {
        None
    };

    let mut sources = case_sources(&frames, full_next, opts.flows, backend.as_ref());
    if let Some(only) = &opts.cases {
        sources.retain(|(id, _)| case(*id).baseline.is_none() || only.contains(id));
    }
    let mut results = case_results(&opts.variants, &sources);
    let mut kern: Vec<u32> = Vec::with_capacity(opts.calls);
    warm_up(&mut lab, &results, &mut sources, &opts, &mut out, &mut kern)?;
    let rounds_done = measure_rounds(
        &mut lab,
        &mut results,
        &mut sources,
        &opts,
        &mut out,
        &mut kern,
    )?;

    let run = RunFacts {
        command_line,
        possible,
        object,
        rounds_done,
        mtu_check,
        started,
    };
    let meta = run_meta(&mut lab, &opts, run)?;
    let rep = report::Report::new(meta, &opts.variants, &results);
    rep.print_table();
    println!();
    out::write_json(&opts.out, &rep.json())?;
    if let Some(dir) = opts.svg.parent() {
        std::fs::create_dir_all(dir).with_context(|| format!("creating {}", dir.display()))?;
    }
    std::fs::write(&opts.svg, rep.svg())
        .with_context(|| format!("writing {}", opts.svg.display()))?;
    println!("wrote {}", opts.svg.display());
    drop(backend);
    Ok(())
}

/// A per-CPU LRU gives each possible CPU max_entries / possible entries, all used by the
/// pinned CPU here: the populated flows and one batch of new flows must fit, or the LRU
/// evicts and the cases measure something else.
fn check_fit(opts: &Opts, possible: usize) -> Result<()> {
    let per_cpu = opts.conn_table as usize / possible;
    if opts.flows + 4 > per_cpu || opts.calls > per_cpu {
        bail!(
            "--flows {} / --calls {} do not fit the {per_cpu} conn-table entries per CPU (--conn-table {} over {possible} possible CPUs)",
            opts.flows,
            opts.calls,
            opts.conn_table
        );
    }
    Ok(())
}

/// The namespaces of the measured variants and the four data planes.
struct Lab {
    netns: Vec<(Variant, OwnedFd)>,
    /// Held for the whole run: the namespace the thread returns to after writing the devmap.
    _ns_fallback: OwnedFd,
    ns_fib: OwnedFd,
    dps: [Dataplane; 4],
    new_conns: BpfHashMap<MapData, FlowKey, ConnEntry>,
}

impl Lab {
    fn new(opts: &Opts, object: &[u8], possible: usize) -> Result<Lab> {
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

    fn enter(&mut self, v: Variant) -> Result<()> {
        let ns = &self
            .netns
            .iter()
            .find(|(x, _)| *x == v)
            .expect("variant has a namespace")
            .1;
        enter_variant(ns, &mut self.dps)
    }

    fn dp(&mut self, which: Dp) -> &mut Dataplane {
        &mut self.dps[which as usize]
    }
}

/// The frames the cases send and the flows they are built from.
struct TestFrames {
    syn4: Vec<u8>,
    ack4: Vec<u8>,
    syn1500: Vec<u8>,
    data1500: Vec<u8>,
    syn6: Vec<u8>,
    ack6: Vec<u8>,
    non_vip: Vec<u8>,
    syn_ib: Vec<u8>,
    ack_ib: Vec<u8>,
    req_ib: Vec<u8>,
    many_tpl: Vec<u8>,
    syn_tpl: Vec<u8>,
}

impl TestFrames {
    fn build() -> TestFrames {
        let data1500 = v4_tcp_frame(CLIENT4, 40001, VIP4, VIP_PORT, ACK | PSH, &[0xab; 1460]);
        assert_eq!(data1500.len(), 1514);
        // The in-band flow: handshake ACK (client seq 1000, server bytes from 1), a request,
        // then ACKs of the answer (the measured frames).
        let mut ack_ib = v4_tcp_frame(CLIENT4, 40002, VIP4, INBAND_PORT, ACK, b"");
        ack_ib[42..46].copy_from_slice(&1u32.to_be_bytes());
        let mut req_ib = v4_tcp_frame(CLIENT4, 40002, VIP4, INBAND_PORT, ACK | PSH, &[b'q'; 100]);
        req_ib[42..46].copy_from_slice(&1u32.to_be_bytes());
        let syn_tpl = v4_tcp_frame("100.80.0.0", 1024, VIP4, VIP_PORT, SYN, b"");
        {
            // The generated keys must be the data plane's keys (deletion relies on it).
            let mut f = syn_tpl.clone();
            patch_v4(&mut f, BLOCK_SYN, 5 + (3 << BLOCK_BITS));
            assert_eq!(
                gen_key(BLOCK_SYN, 5 + (3 << BLOCK_BITS)),
                flow("100.80.0.5", 1027, VIP4, VIP_PORT, PROTO_TCP)
            );
            let want = V4::new("100.80.0.5", VIP4, PROTO_TCP).build(&tcp(1027, VIP_PORT, SYN, b""));
            assert_eq!(
                &f[14..],
                &want[..],
                "patched frame differs from a built one"
            );
        }
        TestFrames {
            syn4: v4_tcp_frame(CLIENT4, 40000, VIP4, VIP_PORT, SYN, b""),
            ack4: v4_tcp_frame(CLIENT4, 40000, VIP4, VIP_PORT, ACK, b""),
            syn1500: v4_tcp_frame(CLIENT4, 40001, VIP4, VIP_PORT, SYN, b""),
            data1500,
            syn6: v6_tcp_frame(CLIENT6, 40000, VIP6, VIP_PORT, SYN),
            ack6: v6_tcp_frame(CLIENT6, 40000, VIP6, VIP_PORT, ACK),
            non_vip: v4_tcp_frame(CLIENT4, 40000, NON_VIP4, 80, ACK, b""),
            syn_ib: v4_tcp_frame(CLIENT4, 40002, VIP4, INBAND_PORT, SYN, b""),
            ack_ib,
            req_ib,
            many_tpl: v4_tcp_frame("100.64.0.0", 1024, VIP4, VIP_PORT, ACK, b""),
            syn_tpl,
        }
    }
}

/// Pre-populates the established flows (each sent once as a SYN) and fills the small table;
/// returns the next fresh flow of the full-table case.
fn populate(lab: &mut Lab, fr: &TestFrames, flows: usize, out: &mut [u8]) -> Result<u64> {
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
        let s = counters(dp)?;
        let want = flows as u64 + 4;
        // (An object built without the miss counter shows 0 misses: not an error.)
        let misses = s[stat::CONN_MISS.index()];
        if misses != want && misses != 0 {
            bail!("populating: {misses} misses (expected {want})");
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
        "populated {} established flows (+4) and filled the {}-entry-per-CPU table in {:.2} s",
        flows,
        FULL_TABLE_PER_CPU,
        t.elapsed().as_secs_f64()
    );
    Ok(full_next)
}

/// Checks the path of each variant once before measuring.
fn check_paths(lab: &mut Lab, variants: &[Variant], ack4: &[u8], out: &mut [u8]) -> Result<()> {
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
fn mtu_check(lab: &mut Lab, data1500: &[u8], out: &mut [u8]) -> Result<Value> {
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
struct BackendFrames {
    here: Vec<u8>,
    elsewhere: Vec<u8>,
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
fn backend_frames(lab: &mut Lab, ack4: &[u8], out: &mut [u8]) -> Result<BackendFrames> {
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

/// The frames of every measured case.
fn case_sources(
    fr: &TestFrames,
    full_next: u64,
    flows: usize,
    backend: Option<&BackendFrames>,
) -> Vec<(CaseId, Frames)> {
    let fresh = |block, next| Frames::Fresh {
        frame: fr.syn_tpl.clone(),
        block,
        next,
    };
    let many = || Frames::Cycle {
        frame: fr.many_tpl.clone(),
        block: BLOCK_MANY,
        next: 0,
        count: flows as u64,
    };
    let mut sources: Vec<(CaseId, Frames)> = vec![
        (CaseId::Pass, Frames::Fixed(fr.ack4.clone())),
        (CaseId::Pass1500, Frames::Fixed(fr.data1500.clone())),
        (CaseId::SynNew, fresh(BLOCK_SYN, 0)),
        (CaseId::SynFull, fresh(BLOCK_SYN_FULL, full_next)),
        (CaseId::Established, Frames::Fixed(fr.ack4.clone())),
        (CaseId::Established200k, many()),
        (CaseId::NonVip, Frames::Fixed(fr.non_vip.clone())),
        (CaseId::Established1500, Frames::Fixed(fr.data1500.clone())),
        (CaseId::EstablishedV6, Frames::Fixed(fr.ack6.clone())),
        (CaseId::ScSynNew, fresh(BLOCK_SYN, 0)),
        (CaseId::ScEstablished, Frames::Fixed(fr.ack4.clone())),
        (CaseId::ScEstablished200k, many()),
        (CaseId::ScEstablishedV6, Frames::Fixed(fr.ack6.clone())),
        (
            CaseId::EstablishedInband,
            Frames::Acking {
                frame: fr.ack_ib.clone(),
                ack: 1,
            },
        ),
    ];
    if let Some(b) = backend {
        sources.push((CaseId::PassGue, Frames::Fixed(b.elsewhere.clone())));
        sources.push((CaseId::BackendSocket, Frames::Fixed(b.here.clone())));
        sources.push((CaseId::BackendForward, Frames::Fixed(b.elsewhere.clone())));
    }
    sources
}

/// An empty result for every (variant, case) pair that is measured.
fn case_results(variants: &[Variant], sources: &[(CaseId, Frames)]) -> Vec<CaseResult> {
    let mut results: Vec<CaseResult> = Vec::new();
    for &v in variants {
        for (id, f) in sources {
            if v == Variant::Fallback && fib_only(*id) {
                continue;
            }
            // The in-band case is a paired difference from `established`, taken in the
            // fallback netns only: the fib netns has no route to the in-band VIP's backends.
            if v == Variant::Fib && *id == CaseId::EstablishedInband {
                continue;
            }
            results.push(CaseResult {
                variant: v,
                id: *id,
                frame_bytes: f.len(),
                batches: Vec::new(),
                counters: BTreeMap::new(),
            });
        }
    }
    results
}

/// One short batch of every case, not recorded.
fn warm_up(
    lab: &mut Lab,
    results: &[CaseResult],
    sources: &mut [(CaseId, Frames)],
    opts: &Opts,
    out: &mut [u8],
    kern: &mut Vec<u32>,
) -> Result<()> {
    let limit = Duration::from_secs_f64(opts.batch_secs);
    let warm = (opts.calls / 10).clamp(1, 10_000);
    for r in results {
        let (_, frames) = sources.iter_mut().find(|(id, _)| *id == r.id).unwrap();
        let (b, _, _) = run_batch(lab, r, frames, warm, limit, out, kern)?;
        if !b.wrong_actions.is_empty() {
            bail!(
                "warm-up of {} [{}]: unexpected actions {:?}",
                case(r.id).key,
                r.variant.name(),
                b.wrong_actions
            );
        }
    }
    Ok(())
}

/// The measurement rounds, each one batch of every case in a shuffled order, until
/// `--rounds` or `--max-secs`; returns the rounds completed.
fn measure_rounds(
    lab: &mut Lab,
    results: &mut [CaseResult],
    sources: &mut [(CaseId, Frames)],
    opts: &Opts,
    out: &mut [u8],
    kern: &mut Vec<u32>,
) -> Result<usize> {
    println!(
        "measuring: {} rounds x {} (variant, case) batches of up to {} calls ({} s per batch at most, {} s in all)",
        opts.rounds,
        results.len(),
        opts.calls,
        opts.batch_secs,
        opts.max_secs
    );
    let limit = Duration::from_secs_f64(opts.batch_secs);
    let measure_start = Instant::now();
    let mut rounds_done = 0;
    let mut order: Vec<usize> = (0..results.len()).collect();
    for round in 0..opts.rounds {
        if measure_start.elapsed().as_secs_f64() >= opts.max_secs {
            println!("time bound reached after {round} rounds");
            break;
        }
        shuffle(&mut order, round as u64 + 1);
        for &i in &order {
            let r = &mut results[i];
            let (_, frames) = sources.iter_mut().find(|(id, _)| *id == r.id).unwrap();
            measure_batch(lab, r, frames, opts.calls, limit, out, kern)?;
        }
        rounds_done += 1;
        eprint!(
            "\rround {}/{} done ({:.0} s)",
            round + 1,
            opts.rounds,
            measure_start.elapsed().as_secs_f64()
        );
    }
    eprintln!();
    Ok(rounds_done)
}

/// One batch of a case's frames in its variant's namespace, with the data plane's counters
/// before and after it; the flows a new-flow batch inserted are deleted after it.
fn run_batch(
    lab: &mut Lab,
    r: &CaseResult,
    frames: &mut Frames,
    calls: usize,
    limit: Duration,
    out: &mut [u8],
    kern: &mut Vec<u32>,
) -> Result<(Batch, Vec<u64>, Vec<u64>)> {
    lab.enter(r.variant)?;
    let def = case(r.id);
    let start = fresh_start(frames);
    let dp = lab.dp(def.dp);
    let before = counters(dp)?;
    let b = measure(
        dp.program(def.prog)?,
        frames,
        calls,
        limit,
        expected_action(r.id, r.variant),
        out,
        kern,
    )?;
    let after = counters(dp)?;
    if def.dp == Dp::New {
        delete_fresh(&mut lab.new_conns, frames, start)?;
    }
    Ok((b, before, after))
}

/// One recorded batch of a case, with its counter deltas; a path that changed is an error.
fn measure_batch(
    lab: &mut Lab,
    r: &mut CaseResult,
    frames: &mut Frames,
    calls: usize,
    limit: Duration,
    out: &mut [u8],
    kern: &mut Vec<u32>,
) -> Result<()> {
    let (b, before, after) = run_batch(lab, r, frames, calls, limit, out, kern)?;
    stats_delta(&before, &after, &mut r.counters);
    let wrong: usize = b.wrong_actions.values().sum();
    if wrong != 0 {
        let key = case(r.id).key;
        eprintln!(
            "\nwarning: {key} [{}]: {wrong} of {} calls returned another action (action: calls) {:?}; counters of this batch {:?}",
            r.variant.name(),
            b.calls,
            b.wrong_actions,
            {
                let mut d = BTreeMap::new();
                stats_delta(&before, &after, &mut d);
                d
            }
        );
        // A few odd calls are reported; a path that changed is an error.
        if wrong * 1000 > b.calls {
            bail!(
                "{key} [{}]: more than 0.1% of calls took another path",
                r.variant.name()
            );
        }
    }
    r.batches.push(b);
    Ok(())
}

/// What the report's metadata needs from the run besides the options.
struct RunFacts<'a> {
    command_line: String,
    possible: usize,
    object: &'a [u8],
    rounds_done: usize,
    mtu_check: Value,
    started: Instant,
}

/// The programs' sizes as the kernel reports them.
fn prog_info(dp: &mut Dataplane) -> Result<Value> {
    let mut m = serde_json::Map::new();
    for name in [PROG_XDP, PROG_PASS] {
        let info = dp.program(name)?.info()?;
        m.insert(
            name.to_string(),
            json!({
                "xlated_insns": info.size_translated().map(|b| b / 8),
                "jited_bytes": info.size_jitted(),
                "verified_insns": info.verified_instruction_count(),
                "tag": format!("{:016x}", info.tag()),
            }),
        );
    }
    Ok(Value::Object(m))
}

/// The result file's metadata: provenance, the programs, and the method in words.
fn run_meta(lab: &mut Lab, opts: &Opts, run: RunFacts) -> Result<Value> {
    let prog_info = prog_info(&mut lab.dps[0])?;
    let conns_main = lab.dp(Dp::Main).conns().map(|c| c.len()).ok();

    // The in-band case must have taken the progress path on every call: its backends'
    // acknowledged bytes are 1448 per call (warm-up included).
    let inband_acked: u64 = BACKENDS_INBAND
        .iter()
        .map(|(id, _)| Ok(lab.dp(Dp::Main).inband_stats(*id)?.acked_bytes))
        .sum::<Result<u64>>()?;
    println!("in-band case: {inband_acked} bytes acknowledged in the data plane's aggregates");

    let possible = run.possible;
    let object = run.object;
    let (git_head, dirty) = sys::git_state();
    Ok(json!({
        "inband_acked_bytes": inband_acked,
        "benchmark": "xdp",
        "command_line": run.command_line,
        "invoked_by": sys::parent_cmdline(),
        "date_utc": sys::utc_now(),
        "kernel": sys::kernel_release(),
        "cpu_model": sys::cpu_model(),
        "online_cpus": sys::online_cpus(),
        "possible_cpus": possible,
        "pinned_cpu": opts.cpu,
        "clocksource": sys::clocksource(),
        "git_head": git_head,
        "dataplane_sources_differ_from_head": dirty,
        "bpf_object": opts.object.as_ref().map(|p| p.display().to_string()).unwrap_or_else(|| "embedded (target/bpf/sluice.bpf.o at build time)".into()),
        "bpf_object_bytes": object.len(),
        "bpf_object_fnv64": format!("{:016x}", sys::fnv64(object)),
        "programs": prog_info,
        "method": {
            "harness": "BPF_PROG_TEST_RUN through aya Xdp::test_run, repeat 1 per call; the kernel copies data_in on every call, so every call sees a fresh frame",
            "kernel_ns": "mean over a batch of TestRunResult.duration (repeat 1: the program plus the harness's bh-disable and clock-read overhead); the table gives median/min/p90 over rounds",
            "kernel_call_median_ns": "median of the per-call kernel durations within a batch, then median over rounds",
            "syscall_ns": "wall clock of a batch of calls / calls, including the syscall, the frame copies and, for generated flows, rewriting the source address/port and IP checksum in userspace (a few ns)",
            "ratio": "median(case) / median(its baseline) in the same variant; the baseline is sluice_pass measured the same way on a frame of the same size",
            "rounds_requested": opts.rounds,
            "rounds_completed": run.rounds_done,
            "calls_per_batch": opts.calls,
            "batch_time_limit_s": opts.batch_secs,
            "order": "each round runs every (variant, case) batch once, in an order shuffled per round; one unrecorded warm-up batch per case first",
            "conn_table": format!("LRU hash, BPF_F_NO_COMMON_LRU, {} entries ({} per possible CPU) for the established and new-flow cases; the new-flow case deletes the flows each batch inserted after the batch (table always has room); the full-table case uses {FULL_TABLE_PER_CPU} entries per CPU kept full, so every insert evicts", opts.conn_table, opts.conn_table as usize / possible),
            "many_flows": opts.flows,
            "conn_entries_main_after_run": conns_main,
            "fib_egress_mtu": FIB_MTU,
            "mtu_check_1514B_frame_fib_netns": run.mtu_check,
            "vips": "IPv4 10.200.0.1:443/tcp and IPv6 fd00:200::1:443/tcp, 4 backends each, 65537-slot Maglev rings, no affinity, flood guard off",
            "second_chance": "sc_* cases: the same VIPs with flow_state second-chance on a fourth data plane, backends marked as running the backend program (GUE); the ring was published twice, the second table moving every slot, so every packet's GUE names a previous backend (the most work). No conn-table lookup or insert for TCP",
            "backend": "backend_* cases (fib variant only): sluice_decap on the second-chance LB's GUE output, in the fib namespace with the VIP on lo: backend_socket_found carries an ACK of a TCP connection open on that host (bpf_skc_lookup_tcp finds it: decap, XDP_PASS); backend_forwarded an ACK for which only the VIP's listener is there (SYN-cookie check fails) and is readdressed to the previous backend (FIB lookup, XDP_REDIRECT). Baseline pass_gue: sluice_pass on the same GUE frame",
            "frames": "untagged Ethernet; TCP without options; 54 B (IPv4), 74 B (IPv6), 1514 B (IPv4, 1460 B payload)",
        },
        "elapsed_s": run.started.elapsed().as_secs_f64(),
    }))
}

fn fresh_start(f: &Frames) -> u64 {
    match f {
        Frames::Fresh { next, .. } => *next,
        _ => 0,
    }
}

/// Deletes the flows a new-flow batch inserted (outside the timed region), so every batch
/// inserts into a table with room.
fn delete_fresh(
    m: &mut BpfHashMap<MapData, FlowKey, ConnEntry>,
    f: &Frames,
    start: u64,
) -> Result<()> {
    if let Frames::Fresh { block, next, .. } = f {
        for n in start..*next {
            m.remove(&gen_key(*block, n))
                .with_context(|| format!("deleting new flow {n}: was it inserted?"))?;
        }
    }
    Ok(())
}

fn mac_str(m: &Mac) -> String {
    m.iter()
        .map(|b| format!("{b:02x}"))
        .collect::<Vec<_>>()
        .join(":")
}
