//! Decision tracing: with tracing switched on in the live CONFIG map, `sluice_xdp` (run
//! through BPF_PROG_TEST_RUN) writes each steering decision to `AYA_LOGS`, and the userspace
//! `aya-log` crate reads it back as a log record; with tracing off, nothing is written.

use std::sync::{Arc, Mutex};

use lb_common::PROTO_TCP;
use sluice_tests::{flow, frames::*, Lab};

const VIP4: &str = "10.200.0.1";
const CLIENT4: &str = "192.0.2.10";
const CLIENT6: &str = "2001:db8:c::10";
const VIP6: &str = "fd00:200::1";

/// Keeps what aya-log hands it.
#[derive(Clone, Default)]
struct Captured(Arc<Mutex<Vec<(log::Level, String, String)>>>);

impl log::Log for Captured {
    fn enabled(&self, _: &log::Metadata) -> bool {
        true
    }
    fn log(&self, r: &log::Record) {
        self.0
            .lock()
            .unwrap()
            .push((r.level(), r.target().to_string(), r.args().to_string()));
    }
    fn flush(&self) {}
}

fn frame_v4(sport: u16, flags: u8) -> Vec<u8> {
    let l3 = V4::new(CLIENT4, VIP4, PROTO_TCP).build(&tcp(sport, 443, flags, b""));
    eth([2, 0, 0, 0, 0, 1], [2, 0, 0, 0, 0, 2], ETH_IP, &l3)
}

#[test]
fn a_traced_decision_arrives_through_aya_log_and_nothing_while_tracing_is_off() {
    let mut lab = Lab::new();
    let vip = lab.vip(0, VIP4, 443, PROTO_TCP, 0, 0);
    lab.backends(&vip, &[(1, "10.1.0.1", 1), (2, "10.1.0.2", 1)]);
    let vip6 = lab.vip(1, VIP6, 443, PROTO_TCP, 0, 0);
    lab.backends(&vip6, &[(11, "fd00:1::1", 1)]);
    let seen = Captured::default();
    let mut reader = lab
        .dp
        .trace_reader(seen.clone())
        .expect("the AYA_LOGS ring");

    // Off (the default): a decision is made, nothing is written.
    lab.run(&frame_v4(40000, SYN));
    reader.flush();
    assert!(seen.0.lock().unwrap().is_empty());

    lab.dp.set_trace(true).unwrap();
    let want = lab.ring_choice(&vip, &flow(CLIENT4, 40001, VIP4, 443, PROTO_TCP), false);
    lab.run(&frame_v4(40001, SYN));
    lab.run(&frame_v4(40001, ACK));
    let l3 = ipv6(CLIENT6, VIP6, PROTO_TCP, 0, 0, &tcp(40002, 443, SYN, b""));
    lab.run(&eth([2, 0, 0, 0, 0, 1], [2, 0, 0, 0, 0, 2], ETH_IPV6, &l3));
    reader.flush();
    let got = seen.0.lock().unwrap().clone();
    let lines: Vec<&str> = got.iter().map(|(_, _, m)| m.as_str()).collect();
    assert_eq!(
        lines,
        [
            format!("flow ::ffff:192.0.2.10:40001 to vip 0 port 443 -> backend {want} new"),
            format!("flow ::ffff:192.0.2.10:40001 to vip 0 port 443 -> backend {want} est"),
            "flow 2001:db8:c::10:40002 to vip 1 port 443 -> backend 11 new".to_string(),
        ]
    );
    assert!(got
        .iter()
        .all(|(l, t, _)| *l == log::Level::Info && t == "sluice::dataplane"));

    // Off again: nothing more.
    lab.dp.set_trace(false).unwrap();
    lab.run(&frame_v4(40003, SYN));
    reader.flush();
    assert_eq!(seen.0.lock().unwrap().len(), 3);
}
