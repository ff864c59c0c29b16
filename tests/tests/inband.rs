//! In-band signals measured by the real `sluice_xdp` through BPF_PROG_TEST_RUN on crafted
//! client packets of one TCP flow: requests, the first byte of an answer, delivery
//! progress, stalls, sequence wrap-around and retransmissions, read back from the
//! per-backend `INBAND_STATS` map and the counters; and the handshakes every TCP VIP with a
//! connection table counts (started by a SYN, completed by the client's first ACK), read
//! back from the per-backend and per-VIP traffic counters.
//!
//! Times are not slept: the test ages the flow's in-band timestamps in its connection entry
//! (as if the request had been sent that long ago), so every figure below is exact or lies
//! in one histogram bucket whatever the machine's speed.

use lb_common::{
    stat, FlowKey, InbandStats, INBAND_STALL_UNITS, PROTO_TCP, VIP_F_INBAND, VIP_F_SECOND_CHANCE,
};
use sluice_tests::{flow, frames::*, Lab};

const XDP_TX: u32 = 3;
const LB_MAC: Mac = [0x02, 0, 0, 0, 0, 0x01];
const CLIENT_MAC: Mac = [0x02, 0, 0, 0, 0, 0x02];
const VIP: &str = "10.200.0.1";
const CLIENT: &str = "192.0.2.10";
const SYN: u8 = 0x02;
const RST: u8 = 0x04;
const ACK: u8 = 0x10;
const FIN_ACK: u8 = 0x11;
const PSH_ACK: u8 = 0x18;

/// 300 ms in in-band units (2^20 ns): bucket 9 holds [256, 512) units.
const UNITS_300MS: u32 = 286;

struct Flow {
    lab: Lab,
    key: FlowKey,
    sport: u16,
    backend: u32,
}

impl Flow {
    /// A lab with one VIP (in-band signals on or off) and a flow whose SYN has created its
    /// connection entry.
    fn open(inband: bool, sport: u16, client_isn: u32) -> Flow {
        let mut f = Flow::new(if inband { VIP_F_INBAND } else { 0 }, sport);
        f.send(SYN, client_isn, 0, b"");
        f
    }

    /// A lab with one VIP of `flags` (id 1, two backends) and a flow that has sent nothing.
    fn new(flags: u32, sport: u16) -> Flow {
        let mut lab = Lab::new();
        let vip = lab.vip(1, VIP, 80, PROTO_TCP, flags, 0);
        lab.backends(&vip, &[(1, "10.1.0.1", 1), (2, "10.1.0.2", 1)]);
        let key = flow(CLIENT, sport, VIP, 80, PROTO_TCP);
        let backend = lab.ring_choice(&vip, &key, false);
        Flow {
            lab,
            key,
            sport,
            backend,
        }
    }

    /// Sends one client segment; every one must be forwarded.
    fn send(&mut self, flags: u8, seq: u32, ack: u32, payload: &[u8]) {
        self.send_with_options(flags, seq, ack, &[], payload);
    }

    fn send_with_options(&mut self, flags: u8, seq: u32, ack: u32, opts: &[u8], payload: &[u8]) {
        assert_eq!(opts.len() % 4, 0);
        let mut t = tcp(self.sport, 80, flags, b"");
        t[4..8].copy_from_slice(&seq.to_be_bytes());
        t[8..12].copy_from_slice(&ack.to_be_bytes());
        t[12] = (((20 + opts.len()) / 4) << 4) as u8;
        t.extend_from_slice(opts);
        t.extend_from_slice(payload);
        let l3 = V4::new(CLIENT, VIP, PROTO_TCP).build(&t);
        let (action, _) = self.lab.run(&eth(LB_MAC, CLIENT_MAC, ETH_IP, &l3));
        assert_eq!(action, XDP_TX, "segment seq {seq} ack {ack} not forwarded");
    }

    fn stats(&mut self) -> InbandStats {
        self.lab.dp.inband_stats(self.backend).unwrap()
    }

    /// (started, completed) handshakes of the flow's backend, of the other backend and of
    /// the VIP.
    fn handshakes(&mut self) -> [(u64, u64); 3] {
        let other = 3 - self.backend;
        [
            self.lab.dp.backend_stats(self.backend).unwrap(),
            self.lab.dp.backend_stats(other).unwrap(),
            self.lab.dp.vip_stats(1).unwrap(),
        ]
        .map(|t| (t.handshakes, t.handshakes_completed))
    }

    /// Moves the flow's request and progress times `units` into the past.
    fn age(&mut self, request: u32, progress: u32) {
        let mut e = self
            .lab
            .dp
            .conn(&self.key)
            .unwrap()
            .expect("the flow's entry");
        e.inband.request_t = e.inband.request_t.wrapping_sub(request);
        e.inband.progress_t = e.inband.progress_t.wrapping_sub(progress);
        self.lab.dp.set_conn(&self.key, &e).unwrap();
    }
}

fn hist_with(bucket: usize) -> [u64; lb_common::INBAND_HIST_BUCKETS] {
    let mut h = [0; lb_common::INBAND_HIST_BUCKETS];
    h[bucket] = 1;
    h
}

#[test]
fn request_then_first_byte_gives_time_to_first_byte() {
    let (c, s) = (5000u32, 70_000u32);
    let mut f = Flow::open(true, 40001, c);
    f.send(ACK, c + 1, s + 1, b"");
    assert_eq!(
        f.stats(),
        InbandStats::default(),
        "the handshake is no request"
    );
    f.send(PSH_ACK, c + 1, s + 1, &[b'q'; 100]);
    assert_eq!(f.stats().requests, 1);
    f.age(UNITS_300MS, UNITS_300MS);
    f.send(ACK, c + 101, s + 1 + 700, b"");
    let st = f.stats();
    assert_eq!(st.requests, 1);
    assert_eq!(st.first_bytes, 1);
    assert_eq!(st.acked_bytes, 700);
    assert_eq!(
        st.ttfb_hist,
        hist_with(9),
        "300 ms lies in bucket [256, 512) units"
    );
    assert!(
        (UNITS_300MS as u64..512).contains(&st.ttfb_units),
        "time to first byte {} units",
        st.ttfb_units
    );
    assert_eq!(st.stalls, 0);
    // The other backend saw nothing.
    let other = 3 - f.backend;
    assert_eq!(
        f.lab.dp.inband_stats(other).unwrap(),
        InbandStats::default()
    );
}

#[test]
fn acknowledgement_progress_counts_bytes_and_streaming_time() {
    let (c, s) = (1u32, 9_000u32);
    let mut f = Flow::open(true, 40002, c);
    f.send(ACK, c + 1, s + 1, b"");
    f.send(PSH_ACK, c + 1, s + 1, &[b'q'; 50]);
    f.send(ACK, c + 51, s + 1001, b"");
    let stale = f.lab.stat(stat::INBAND_ACK_STALE);
    for i in 2..=5u32 {
        f.age(0, 100);
        f.send(ACK, c + 51, s + 1 + 1000 * i, b"");
    }
    // A duplicate ACK moves nothing.
    f.send(ACK, c + 51, s + 5001, b"");
    let st = f.stats();
    assert_eq!(st.acked_bytes, 5000);
    assert_eq!(st.first_bytes, 1);
    assert!(
        (400..400 + 4 * 50).contains(&st.stream_units),
        "four gaps of 100 units (plus at most the run's own time): {}",
        st.stream_units
    );
    assert_eq!(st.stalls, 0);
    assert_eq!(f.lab.stat(stat::INBAND_ACK_STALE), stale + 1);
}

#[test]
fn an_answer_that_stops_and_resumes_is_a_stall_counted_once() {
    let (c, s) = (100u32, 200u32);
    let mut f = Flow::open(true, 40003, c);
    f.send(ACK, c + 1, s + 1, b"");
    f.send(PSH_ACK, c + 1, s + 1, &[b'q'; 10]);
    f.send(ACK, c + 11, s + 101, b"");
    f.age(0, 3 * INBAND_STALL_UNITS);
    f.send(ACK, c + 11, s + 201, b"");
    f.age(0, 3 * INBAND_STALL_UNITS);
    f.send(ACK, c + 11, s + 301, b"");
    let st = f.stats();
    assert_eq!(st.stalls, 1, "one stall per request");
    assert_eq!(
        st.stream_units,
        2 * INBAND_STALL_UNITS as u64,
        "each gap is capped at the stall threshold"
    );
    assert_eq!(st.acked_bytes, 300);
}

#[test]
fn a_request_waiting_while_the_client_retransmits_is_a_stall() {
    let (c, s) = (7u32, 8u32);
    let mut f = Flow::open(true, 40004, c);
    f.send(ACK, c + 1, s + 1, b"");
    f.send(PSH_ACK, c + 1, s + 1, &[b'q'; 64]);
    let retrans = f.lab.stat(stat::INBAND_RETRANSMIT);
    f.age(INBAND_STALL_UNITS + 1, INBAND_STALL_UNITS + 1);
    f.send(PSH_ACK, c + 1, s + 1, &[b'q'; 64]);
    let st = f.stats();
    assert_eq!(f.lab.stat(stat::INBAND_RETRANSMIT), retrans + 1);
    assert_eq!(st.requests, 1, "a retransmitted request is not a new one");
    assert_eq!(st.stalls, 1);
    assert_eq!(st.first_bytes, 0);
}

#[test]
fn sequence_and_acknowledgement_numbers_wrap_around() {
    let c = u32::MAX - 40; // the request crosses 2^32
    let s = u32::MAX - 256; // the answer crosses 2^32
    let mut f = Flow::open(true, 40005, c);
    f.send(ACK, c.wrapping_add(1), s.wrapping_add(1), b"");
    f.send(PSH_ACK, c.wrapping_add(1), s.wrapping_add(1), &[b'q'; 100]);
    f.send(ACK, c.wrapping_add(101), s.wrapping_add(1 + 512), b"");
    f.send(ACK, c.wrapping_add(101), s.wrapping_add(1 + 1024), b"");
    // The request again, after the wrap: a retransmission.
    f.send(
        PSH_ACK,
        c.wrapping_add(1),
        s.wrapping_add(1 + 1024),
        &[b'q'; 100],
    );
    let st = f.stats();
    assert_eq!(st.requests, 1);
    assert_eq!(st.first_bytes, 1);
    assert_eq!(st.acked_bytes, 1024);
}

#[test]
fn retransmissions_reordered_and_sack_acks_add_nothing() {
    let (c, s) = (1_000u32, 2_000u32);
    let mut f = Flow::open(true, 40006, c);
    f.send(ACK, c + 1, s + 1, b"");
    f.send(PSH_ACK, c + 1, s + 1, &[b'q'; 20]);
    f.send(ACK, c + 21, s + 1001, b"");
    let stale = f.lab.stat(stat::INBAND_ACK_STALE);
    let retrans = f.lab.stat(stat::INBAND_RETRANSMIT);
    // An older ACK arriving late.
    f.send(ACK, c + 21, s + 501, b"");
    // A duplicate ACK with a SACK block for bytes past a hole: nothing until the hole fills.
    let mut sack = vec![1, 1, 5, 10];
    sack.extend_from_slice(&(s + 2001).to_be_bytes());
    sack.extend_from_slice(&(s + 3001).to_be_bytes());
    f.send_with_options(ACK, c + 21, s + 1001, &sack, b"");
    // The request retransmitted.
    f.send(PSH_ACK, c + 1, s + 1001, &[b'q'; 20]);
    let st = f.stats();
    assert_eq!(st.acked_bytes, 1000);
    assert_eq!(st.requests, 1);
    assert_eq!(f.lab.stat(stat::INBAND_ACK_STALE), stale + 2);
    assert_eq!(f.lab.stat(stat::INBAND_RETRANSMIT), retrans + 1);
    // The hole fills: the cumulative ACK jumps past the SACKed block.
    f.send(ACK, c + 21, s + 3001, b"");
    assert_eq!(f.stats().acked_bytes, 3000);
}

#[test]
fn keep_alive_requests_each_get_their_first_byte() {
    let (c, s) = (10u32, 20u32);
    let mut f = Flow::open(true, 40007, c);
    f.send(ACK, c + 1, s + 1, b"");
    f.send(PSH_ACK, c + 1, s + 1, &[b'q'; 30]);
    f.send(ACK, c + 31, s + 401, b"");
    f.send(PSH_ACK, c + 31, s + 401, &[b'r'; 30]);
    f.age(UNITS_300MS, UNITS_300MS);
    f.send(ACK, c + 61, s + 801, b"");
    let st = f.stats();
    assert_eq!(st.requests, 2);
    assert_eq!(st.first_bytes, 2);
    assert_eq!(st.acked_bytes, 800);
    assert_eq!(st.ttfb_hist[9], 1, "the second answer took 300 ms");
}

#[test]
fn a_flow_without_a_request_counts_only_delivered_bytes() {
    let (c, s) = (50u32, 60u32);
    let mut f = Flow::open(true, 40008, c);
    f.send(ACK, c + 1, s + 1, b"");
    f.age(0, 3 * INBAND_STALL_UNITS);
    f.send(ACK, c + 1, s + 1 + 4096, b"");
    let st = f.stats();
    assert_eq!(
        st,
        InbandStats {
            acked_bytes: 4096,
            ..Default::default()
        }
    );
}

#[test]
fn a_vip_without_inband_signals_measures_nothing() {
    let (c, s) = (1u32, 2u32);
    let mut f = Flow::open(false, 40009, c);
    f.send(ACK, c + 1, s + 1, b"");
    f.send(PSH_ACK, c + 1, s + 1, &[b'q'; 10]);
    f.send(ACK, c + 11, s + 1001, b"");
    assert_eq!(f.stats(), InbandStats::default());
    let e = f.lab.dp.conn(&f.key).unwrap().unwrap();
    assert_eq!(e.inband, Default::default());
}

#[test]
fn a_syn_then_its_ack_is_one_handshake_started_and_completed() {
    for inband in [false, true] {
        let (c, s) = (300u32, 400u32);
        let mut f = Flow::open(inband, 40010, c);
        assert_eq!(f.handshakes(), [(1, 0), (0, 0), (1, 0)], "inband {inband}");
        f.send(ACK, c + 1, s + 1, b"");
        assert_eq!(f.handshakes(), [(1, 1), (0, 0), (1, 1)], "inband {inband}");
        // The rest of the flow counts nothing more.
        f.send(PSH_ACK, c + 1, s + 1, &[b'q'; 10]);
        f.send(ACK, c + 11, s + 501, b"");
        f.send(FIN_ACK, c + 11, s + 501, b"");
        assert_eq!(f.handshakes(), [(1, 1), (0, 0), (1, 1)], "inband {inband}");
    }
}

#[test]
fn a_retransmitted_syn_without_ack_is_one_handshake_never_completed() {
    let c = 77u32;
    let mut f = Flow::open(false, 40011, c);
    f.send(SYN, c, 0, b"");
    f.send(SYN, c, 0, b"");
    assert_eq!(f.handshakes(), [(1, 0), (0, 0), (1, 0)]);
    // The client gives up with a RST (its SYN-ACK came too late): no completion either.
    f.send(RST, c + 1, 0, b"");
    assert_eq!(f.handshakes(), [(1, 0), (0, 0), (1, 0)]);
}

#[test]
fn a_reused_port_after_a_completed_handshake_starts_another() {
    let (c, s) = (1_000u32, 2_000u32);
    let mut f = Flow::open(false, 40012, c);
    f.send(ACK, c + 1, s + 1, b"");
    // The same 5-tuple opens again while its entry lives (the backend keeps its clients).
    let c2 = 900_000u32;
    f.send(SYN, c2, 0, b"");
    f.send(SYN, c2, 0, b"");
    assert_eq!(f.handshakes(), [(2, 1), (0, 0), (2, 1)]);
    f.send(ACK, c2 + 1, s + 1, b"");
    assert_eq!(f.handshakes(), [(2, 2), (0, 0), (2, 2)]);
}

#[test]
fn a_flow_first_seen_mid_stream_counts_no_handshake() {
    // An ACK without an entry (evicted, or the LB restarted without its maps) creates one.
    let mut f = Flow::new(0, 40013);
    f.send(ACK, 5, 6, b"");
    f.send(PSH_ACK, 5, 6, &[b'q'; 10]);
    assert_eq!(f.handshakes(), [(0, 0), (0, 0), (0, 0)]);
}

#[test]
fn a_second_chance_vip_keeps_no_flow_and_counts_no_handshake() {
    let mut f = Flow::new(VIP_F_SECOND_CHANCE, 40014);
    f.send(SYN, 10, 0, b"");
    f.send(ACK, 11, 21, b"");
    assert_eq!(f.handshakes(), [(0, 0), (0, 0), (0, 0)]);
    assert_eq!(f.lab.stat(stat::SECOND_CHANCE_STEERED), 2);
}
