//! Decision tracing: with `LB_F_TRACE` set, each steering decision is written to the
//! `AYA_LOGS` ring buffer as an aya-log record (`lb_common::trace`), which the daemon reads
//! with the `aya-log` crate into its log. A full ring drops the record (the packet is not
//! affected).

use aya_ebpf::{macros::map, maps::RingBuf};
use lb_common::{
    trace::{DecisionRecord, ESTABLISHED, NEW},
    FlowKey, FAMILY_V4,
};

/// The name aya-log's userspace reader looks for.
#[map]
pub static AYA_LOGS: RingBuf = RingBuf::with_byte_size(1 << 18, 0);

#[inline(always)]
pub fn decision(key: &FlowKey, vip: u32, backend: u32, new_flow: bool) {
    let Some(mut entry) = AYA_LOGS.reserve::<DecisionRecord>(0) else {
        return;
    };
    let r = entry.as_mut_ptr();
    // IPv4 clients as IPv4-mapped IPv6 addresses: one layout for both families.
    let mut client = [0u8; 16];
    if key.family == FAMILY_V4 {
        client[10] = 0xff;
        client[11] = 0xff;
        client[12..].copy_from_slice(&key.src[0].to_ne_bytes());
    } else {
        for (i, w) in key.src.iter().enumerate() {
            client[i * 4..i * 4 + 4].copy_from_slice(&w.to_ne_bytes());
        }
    }
    // SAFETY: `r` points at a reserved entry of the record's size; fields are written by
    // value (the struct is packed, no references are taken).
    unsafe {
        r.write(DecisionRecord::TEMPLATE);
        (*r).client.value = client;
        (*r).sport.value = u16::from_be(key.sport).to_ne_bytes();
        (*r).vip.value = vip.to_ne_bytes();
        (*r).dport.value = u16::from_be(key.dport).to_ne_bytes();
        (*r).backend.value = backend.to_ne_bytes();
        (*r).kind.value = if new_flow { NEW } else { ESTABLISHED };
    }
    entry.submit(0);
}
