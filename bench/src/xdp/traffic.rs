//! Test frames: the TCP frames of every case, the generated flows of the many-flows and
//! new-flow cases, and what a batch sends.

use lb_common::{FlowKey, FAMILY_V4, PROTO_TCP, PROTO_UDP};
use sluice::addr::to_words;
use sluice_tests::{
    flow,
    frames::{self, eth, ipv6, tcp, udp, ACK, ETH_IP, ETH_IPV6, PSH, SYN, V4},
};

use super::{
    BLOCK_BITS, BLOCK_SYN, CLIENT4, CLIENT6, CLIENT_MAC, INBAND_PORT, LB_MAC, NON_VIP4, QUIC_PORT,
    QUIC_SIDS, TENANT_PORT, UDP_PORT, VIP4, VIP6, VIP_PORT,
};

pub(super) fn v4_tcp_frame(
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

fn v4_udp_frame(sport: u16, dport: u16, payload: &[u8]) -> Vec<u8> {
    let l3 = V4::new(CLIENT4, VIP4, PROTO_UDP).build(&udp(sport, dport, payload));
    eth(LB_MAC, CLIENT_MAC, ETH_IP, &l3)
}

/// A 12-octet QUIC short header: first octet, an 8-octet connection ID of config rotation 0
/// (the server ID, then the nonce), a packet number and the start of the sealed payload.
fn quic_short_header(sid: [u8; 2]) -> Vec<u8> {
    let mut p = vec![0x41, 0x07];
    p.extend_from_slice(&sid);
    p.extend_from_slice(&[0x9c, 0x11, 0x5e, 0xa0, 0x2b, 0x01, 0x3f, 0x77]);
    p
}

fn v6_tcp_frame(src: &str, sport: u16, dst: &str, dport: u16, flags: u8) -> Vec<u8> {
    let l3 = ipv6(src, dst, PROTO_TCP, 0, 0, &tcp(sport, dport, flags, b""));
    eth(LB_MAC, CLIENT_MAC, ETH_IPV6, &l3)
}

/// Source ports of each CPU's new flows when a case runs on several CPUs: up to this many
/// times 2^BLOCK_BITS flows per CPU, more than any run sends.
const FRESH_PER_CPU: u64 = 16_384;

/// Client (address, port) of generated flow `n` in `block`.
fn gen_flow(block: u32, n: u64) -> (u32, u16) {
    let addr = block + (n as u32 & ((1 << BLOCK_BITS) - 1));
    let port = 1024 + (n >> BLOCK_BITS) as u16;
    (addr, port)
}

/// The data plane's key of generated flow `n` of `block` to `VIP4`:`dport`.
pub(super) fn gen_key(block: u32, n: u64, dport: u16) -> FlowKey {
    let (addr, port) = gen_flow(block, n);
    let (dst, _) = to_words(VIP4.parse().unwrap());
    FlowKey {
        src: [u32::from_ne_bytes(addr.to_be_bytes()), 0, 0, 0],
        dst,
        sport: port.to_be(),
        dport: dport.to_be(),
        proto: PROTO_TCP,
        family: FAMILY_V4,
        _pad: [0; 2],
    }
}

/// Rewrites an untagged IPv4/TCP frame for flow `n` of `block`: source address and port, and
/// the IP header checksum (the data plane does not check it, but the frames stay valid).
pub(super) fn patch_v4(frame: &mut [u8], block: u32, n: u64) {
    let (addr, port) = gen_flow(block, n);
    frame[26..30].copy_from_slice(&addr.to_be_bytes());
    frame[34..36].copy_from_slice(&port.to_be_bytes());
    frame[24..26].copy_from_slice(&[0, 0]);
    let c = frames::csum(&frame[14..34]);
    frame[24..26].copy_from_slice(&c.to_be_bytes());
}

pub(super) enum Frames {
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
    pub(super) fn next(&mut self) -> &[u8] {
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

    /// The frames the `k`th of `n` CPUs sends when a case runs on several at once: the same
    /// fixed frame, or other flows of the same kind, so that no generated flow is sent from
    /// two CPUs (a new flow stays new, and the many cycled flows are met at other points).
    pub(super) fn for_cpu(&self, k: u64, n: u64) -> Frames {
        match self {
            Frames::Fixed(f) => Frames::Fixed(f.clone()),
            Frames::Cycle {
                frame,
                block,
                next,
                count,
            } => Frames::Cycle {
                frame: frame.clone(),
                block: *block,
                next: next + k * count / n,
                count: *count,
            },
            Frames::Fresh { frame, block, next } => Frames::Fresh {
                frame: frame.clone(),
                block: *block,
                // Each CPU's flows get their own source ports (see `gen_flow`).
                next: next + k * (FRESH_PER_CPU << BLOCK_BITS),
            },
            Frames::Acking { frame, ack } => Frames::Acking {
                frame: frame.clone(),
                ack: *ack,
            },
        }
    }

    pub(super) fn len(&self) -> usize {
        match self {
            Frames::Fixed(f)
            | Frames::Cycle { frame: f, .. }
            | Frames::Fresh { frame: f, .. }
            | Frames::Acking { frame: f, .. } => f.len(),
        }
    }
}

/// The frames the cases send and the flows they are built from.
pub(super) struct TestFrames {
    pub(super) syn4: Vec<u8>,
    pub(super) ack4: Vec<u8>,
    pub(super) syn1500: Vec<u8>,
    pub(super) data1500: Vec<u8>,
    pub(super) syn6: Vec<u8>,
    pub(super) ack6: Vec<u8>,
    pub(super) non_vip: Vec<u8>,
    pub(super) syn_ib: Vec<u8>,
    pub(super) ack_ib: Vec<u8>,
    pub(super) req_ib: Vec<u8>,
    pub(super) many_tpl: Vec<u8>,
    pub(super) syn_tpl: Vec<u8>,
    /// The tenants' VIP: new flows (generated as `syn_tpl`'s, to its port), and an
    /// established flow's SYN and ACK.
    pub(super) syn_tenant_tpl: Vec<u8>,
    pub(super) syn_tenant: Vec<u8>,
    pub(super) ack_tenant: Vec<u8>,
    /// A datagram of the plain UDP VIP's flow, and a QUIC short header whose connection ID
    /// names the QUIC VIP's second backend (both 54-byte frames, as `ack4`).
    pub(super) udp4: Vec<u8>,
    pub(super) quic4: Vec<u8>,
}

impl TestFrames {
    pub(super) fn build() -> TestFrames {
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
                gen_key(BLOCK_SYN, 5 + (3 << BLOCK_BITS), VIP_PORT),
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
            syn_tenant_tpl: v4_tcp_frame("100.80.0.0", 1024, VIP4, TENANT_PORT, SYN, b""),
            syn_tenant: v4_tcp_frame(CLIENT4, 40005, VIP4, TENANT_PORT, SYN, b""),
            ack_tenant: v4_tcp_frame(CLIENT4, 40005, VIP4, TENANT_PORT, ACK, b""),
            udp4: v4_udp_frame(40003, UDP_PORT, &[0x5a; 12]),
            quic4: v4_udp_frame(40004, QUIC_PORT, &quic_short_header(QUIC_SIDS[1])),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn cpus_running_a_case_at_once_send_different_flows() {
        let fresh = Frames::Fresh {
            frame: vec![0; 54],
            block: BLOCK_SYN,
            next: 7,
        };
        let (Frames::Fresh { next: a, .. }, Frames::Fresh { next: b, .. }) =
            (fresh.for_cpu(0, 2), fresh.for_cpu(1, 2))
        else {
            panic!("fresh frames stay fresh");
        };
        assert_eq!(a, 7);
        // A run's flows never reach the other CPU's: its first flow has another source port.
        assert_ne!(gen_flow(BLOCK_SYN, a + 1_000_000), gen_flow(BLOCK_SYN, b));
        assert!(gen_flow(BLOCK_SYN, b).1 > gen_flow(BLOCK_SYN, a + 10_000_000).1);
        let cycle = Frames::Cycle {
            frame: vec![0; 54],
            block: BLOCK_SYN,
            next: 0,
            count: 200_000,
        };
        let Frames::Cycle { next, .. } = cycle.for_cpu(1, 2) else {
            panic!("cycled frames stay cycled");
        };
        assert_eq!(next, 100_000);
    }
}
