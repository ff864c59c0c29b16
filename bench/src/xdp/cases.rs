//! The measured cases: next-hop variants, case definitions and the action each must take.

use sluice::dataplane::{PROG_DECAP, PROG_PASS, PROG_XDP};

use super::{XDP_PASS, XDP_REDIRECT, XDP_TX};

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
    /// UDP: a flow of a plain VIP pinned by the table, and a QUIC short header routed by its
    /// connection ID (no table).
    EstablishedUdp,
    QuicCid,
    /// A VIP with tenants: a new session (its client's tenant looked up in a trie of 1,000
    /// prefixes, its limits checked and its rate bucket moved), and an established flow.
    SynNewTenants,
    EstablishedTenants,
}

/// Which loaded data plane (and so which conn table) a case runs against.
#[derive(Clone, Copy, PartialEq, Eq)]
pub(super) enum Dp {
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
    pub(super) dp: Dp,
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
        id: CaseId::SynNewTenants,
        key: "syn_new_flow_tenants",
        label: "SYN, new flow, VIP with tenants",
        dp: Dp::New,
        prog: PROG_XDP,
        baseline: Some(CaseId::Pass),
        aim: Some(8.0),
        katran: None,
        katran_net_ns: None,
        headline: false,
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
        id: CaseId::EstablishedTenants,
        key: "established_tenants",
        label: "established flow, VIP with tenants",
        dp: Dp::Main,
        prog: PROG_XDP,
        baseline: Some(CaseId::Pass),
        aim: Some(2.5),
        katran: None,
        katran_net_ns: None,
        headline: false,
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
    CaseDef {
        id: CaseId::EstablishedUdp,
        key: "established_udp",
        label: "established UDP flow (conn hit)",
        dp: Dp::Main,
        prog: PROG_XDP,
        baseline: Some(CaseId::Pass),
        aim: Some(2.5),
        katran: None,
        katran_net_ns: None,
        headline: false,
    },
    CaseDef {
        id: CaseId::QuicCid,
        key: "quic_cid",
        label: "QUIC short header, by connection ID",
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

pub(super) fn fib_only(id: CaseId) -> bool {
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

pub(super) fn expected_action(id: CaseId, v: Variant) -> u32 {
    match id {
        CaseId::Pass
        | CaseId::Pass1500
        | CaseId::PassGue
        | CaseId::NonVip
        | CaseId::BackendSocket => XDP_PASS,
        _ => v.steered_action(),
    }
}
