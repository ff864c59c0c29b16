//! Answers a shed SYN with a RST, in place, so the client fails fast instead of retrying
//! into an overloaded pool. Only plain headers (IPv4 without options, IPv6 without
//! extension headers) are answered; anything else is dropped instead.

use aya_ebpf::{
    bindings::xdp_action,
    helpers::{bpf_xdp_adjust_tail, bpf_xdp_get_buff_len},
    programs::XdpContext,
    EbpfContext,
};
use lb_common::{FAMILY_V4, PROTO_TCP};

use crate::{
    csum::{add32, add_all, fold},
    hdr::{IPV4_HLEN, IPV6_HLEN, TCP_ACK, TCP_HLEN, TCP_RST, TTL},
    parse::{at, raw32_at, Parsed},
};

/// Rewrites the SYN in `p` into a RST|ACK back to its sender; returns XDP_TX, or `None`
/// when the headers are not plain enough to answer.
#[inline(always)]
pub fn reply(ctx: &XdpContext, p: &Parsed) -> Option<u32> {
    let v4 = p.key.family == FAMILY_V4;
    let ip_hlen = if v4 { IPV4_HLEN } else { IPV6_HLEN };
    if p.key.proto != PROTO_TCP || p.l4_off != p.l3_off + ip_hlen || p.l3_off > 22 {
        return None;
    }
    let l3 = p.l3_off;
    let t = at(ctx, l3 + ip_hlen, TCP_HLEN)?;
    let seq = u32::from_be(unsafe { raw32_at(t + 4) });
    let doff = ((unsafe { *((t + 12) as *const u8) } >> 4) as usize) * 4;
    // The RST acknowledges the SYN and any data it carried (RFC 9293 3.10.7.1).
    let seg_len = (p.l3_len - ip_hlen).saturating_sub(doff) as u32 + 1;
    // The helper, not data_end - data: LLVM may do that subtraction in 32 bits, which the
    // verifier refuses on packet pointers.
    let len = unsafe { bpf_xdp_get_buff_len(ctx.as_ptr() as *mut _) } as usize;
    let keep = l3 + ip_hlen + TCP_HLEN;
    if unsafe { bpf_xdp_adjust_tail(ctx.as_ptr() as *mut _, keep as i32 - len as i32) } != 0 {
        return None;
    }
    let e = at(ctx, 0, 12)?;
    unsafe {
        let macs = core::ptr::read_unaligned(e as *const [[u8; 6]; 2]);
        core::ptr::write_unaligned(e as *mut [[u8; 6]; 2], [macs[1], macs[0]]);
    }
    let mut sum: u32 = 0;
    if v4 {
        let ip = at(ctx, l3, IPV4_HLEN)?;
        unsafe {
            let src = raw32_at(ip + 12);
            let dst = raw32_at(ip + 16);
            let w = ip as *mut u16;
            core::ptr::write_unaligned(w.add(1), ((IPV4_HLEN + TCP_HLEN) as u16).to_be());
            core::ptr::write_unaligned(w.add(2), 0);
            core::ptr::write_unaligned(w.add(3), 0x4000u16.to_be());
            core::ptr::write_unaligned(w.add(4), ((TTL as u16) << 8 | PROTO_TCP as u16).to_be());
            core::ptr::write_unaligned(w.add(5), 0);
            core::ptr::write_unaligned((ip + 12) as *mut u32, dst);
            core::ptr::write_unaligned((ip + 16) as *mut u32, src);
            let hw = core::ptr::read_unaligned(ip as *const [u32; 5]);
            core::ptr::write_unaligned(w.add(5), fold(add_all(0, &hw)));
            sum = add32(add32(sum, src), dst);
        }
    } else {
        let ip = at(ctx, l3, IPV6_HLEN)?;
        unsafe {
            let src = core::ptr::read_unaligned((ip + 8) as *const [u32; 4]);
            let dst = core::ptr::read_unaligned((ip + 24) as *const [u32; 4]);
            core::ptr::write_unaligned((ip + 4) as *mut u16, (TCP_HLEN as u16).to_be());
            *((ip + 7) as *mut u8) = TTL;
            core::ptr::write_unaligned((ip + 8) as *mut [u32; 4], dst);
            core::ptr::write_unaligned((ip + 24) as *mut [u32; 4], src);
            for i in 0..4 {
                sum = add32(add32(sum, src[i]), dst[i]);
            }
        }
    }
    // Pseudo-header: protocol and TCP length, as the big-endian words they are on the wire
    // (the addresses are summed above; swapping them does not change the sum). Words are
    // summed as they lie in memory: the one's-complement sum is byte-order independent.
    sum += (PROTO_TCP as u16).to_be() as u32 + (TCP_HLEN as u16).to_be() as u32;
    let t = at(ctx, l3 + ip_hlen, TCP_HLEN)?;
    unsafe {
        let sport = core::ptr::read_unaligned(t as *const u16);
        let dport = core::ptr::read_unaligned((t + 2) as *const u16);
        let hdr: [u16; 10] = [
            dport,
            sport,
            0,
            0,
            ((seq.wrapping_add(seg_len)) >> 16) as u16,
            (seq.wrapping_add(seg_len) as u16),
            (0x5000u16 | (TCP_RST | TCP_ACK) as u16),
            0,
            0,
            0,
        ];
        // Words 4 and 5 (ack) and 6 (offset/flags) are host values: store them big-endian.
        let mut out = hdr;
        out[4] = hdr[4].to_be();
        out[5] = hdr[5].to_be();
        out[6] = hdr[6].to_be();
        for w in out {
            sum += w as u32;
        }
        out[8] = fold(sum);
        core::ptr::write_unaligned(t as *mut [u16; 10], out);
    }
    Some(xdp_action::XDP_TX)
}
