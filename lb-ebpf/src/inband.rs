//! In-band signals: what the client's own packets say about its backend's answers.
//!
//! In DSR the LB never sees the server's packets, but it sees every packet the client sends,
//! and the client's acknowledgement numbers count the server's bytes as they arrive. Per
//! flow (state in the connection entry, see `lb_common::InbandFlow`):
//! - a request is new client data (sequence end above the flow's next sequence number)
//!   arriving while no request waits for its answer; more data while one waits is the same
//!   request, data below the next sequence number a retransmission;
//! - the first byte of its answer is the first acknowledgement above the highest one seen
//!   (the request packet's own acknowledgement covers the previous answer): time to first
//!   byte is the gap, folded into a log2 histogram;
//! - every advance of the cumulative acknowledgement is delivered server bytes (wrap-around
//!   by serial-number comparison; duplicate, reordered and SACK-carrying ACKs that do not
//!   move it add nothing), and the gaps between advances during an answer are streaming
//!   time, so bytes over streaming time is the per-stream delivery rate;
//! - a stall is an answer that resumes after `INBAND_STALL_UNITS` without progress, or a
//!   client packet arriving that long after a request still without its first byte.
//!
//! A flow that never sends a request (server speaks first) only counts delivered bytes.
//! Aggregates are per backend and per CPU (`INBAND_STATS`).

use aya_ebpf::programs::XdpContext;
use lb_common::{
    stat, ConnEntry, InbandStats, INBAND_F_ANSWERING, INBAND_F_SEEN, INBAND_F_STALLED,
    INBAND_F_WAITING, INBAND_HIST_BUCKETS, INBAND_STALL_UNITS, INBAND_TIME_SHIFT,
};

use crate::{
    hdr::{TCP_ACK, TCP_RST, TCP_SYN},
    maps::INBAND_STATS,
    parse::{at, u8_at, Parsed},
    stats::count,
};

/// Serial-number order (RFC 1982): positive when `a` is after `b`, across wrap-around.
#[inline(always)]
fn after(a: u32, b: u32) -> i32 {
    a.wrapping_sub(b) as i32
}

#[inline(always)]
fn be32(p: usize) -> u32 {
    u32::from_be(unsafe { core::ptr::read_unaligned(p as *const u32) })
}

/// Updates the flow's in-band state from one client TCP packet of an established flow and
/// folds what it completes into the backend's aggregates.
#[inline(always)]
pub fn observe(ctx: &XdpContext, p: &Parsed, e: *mut ConnEntry, backend: u32, now: u64) {
    let flags = p.tcp_flags;
    // The handshake's SYN says nothing about the server's bytes; a RST ends the flow.
    if flags & (TCP_SYN | TCP_RST) != 0 {
        return;
    }
    let Some(h) = at(ctx, p.l4_off, 20) else {
        count(stat::INBAND_SKIPPED);
        return;
    };
    let seq = be32(h + 4);
    let ack = be32(h + 8);
    let doff = (unsafe { u8_at(h + 12) } >> 4) as usize * 4;
    let payload = (p.l3_off + p.l3_len).saturating_sub(p.l4_off + doff) as u32;
    let t = (now >> INBAND_TIME_SHIFT) as u32;
    let f = unsafe { &mut (*e).inband };
    if f.flags & INBAND_F_SEEN == 0 {
        if flags & TCP_ACK == 0 {
            return;
        }
        // The first ACK (normally the handshake's last packet) sets the baselines.
        f.ack = ack;
        f.client_next = seq;
        f.progress_t = t;
        f.flags = INBAND_F_SEEN;
    }
    if flags & TCP_ACK != 0 {
        let adv = after(ack, f.ack);
        if adv > 0 {
            if let Some(s) = INBAND_STATS.get_ptr_mut(backend) {
                let s = unsafe { &mut *s };
                progress(f, s, t, adv as u32);
            }
            f.ack = ack;
            f.progress_t = t;
        } else if adv < 0 || payload == 0 {
            count(stat::INBAND_ACK_STALE);
        }
    }
    if payload > 0 {
        let end = seq.wrapping_add(payload);
        if after(end, f.client_next) <= 0 {
            count(stat::INBAND_RETRANSMIT);
        } else {
            if f.flags & INBAND_F_WAITING == 0 {
                if let Some(s) = INBAND_STATS.get_ptr_mut(backend) {
                    unsafe { (*s).requests += 1 };
                }
                f.request_t = t;
                f.progress_t = t;
                f.flags = INBAND_F_SEEN | INBAND_F_WAITING;
            }
            f.client_next = end;
        }
    }
    // The client still sends while its request waits: a stall once it has waited too long.
    if f.flags & (INBAND_F_WAITING | INBAND_F_STALLED) == INBAND_F_WAITING
        && t.wrapping_sub(f.request_t) >= INBAND_STALL_UNITS
    {
        if let Some(s) = INBAND_STATS.get_ptr_mut(backend) {
            unsafe { (*s).stalls += 1 };
        }
        f.flags |= INBAND_F_STALLED;
    }
}

/// The cumulative acknowledgement moved `adv` bytes at time `t`.
#[inline(always)]
fn progress(f: &mut lb_common::InbandFlow, s: &mut InbandStats, t: u32, adv: u32) {
    s.acked_bytes += adv as u64;
    if f.flags & INBAND_F_WAITING != 0 {
        let ttfb = t.wrapping_sub(f.request_t);
        s.first_bytes += 1;
        s.ttfb_units += ttfb as u64;
        let b = if ttfb == 0 {
            0
        } else {
            (32 - ttfb.leading_zeros() as usize).min(INBAND_HIST_BUCKETS - 1)
        };
        if let Some(c) = s.ttfb_hist.get_mut(b) {
            *c += 1;
        }
        f.flags = (f.flags & !INBAND_F_WAITING) | INBAND_F_ANSWERING;
    } else if f.flags & INBAND_F_ANSWERING != 0 {
        let gap = t.wrapping_sub(f.progress_t);
        if gap >= INBAND_STALL_UNITS {
            if f.flags & INBAND_F_STALLED == 0 {
                s.stalls += 1;
                f.flags |= INBAND_F_STALLED;
            }
            s.stream_units += INBAND_STALL_UNITS as u64;
        } else {
            s.stream_units += gap as u64;
        }
    }
}
