//! Second-chance forwarding on the backend: a mid-connection TCP packet that arrives in
//! Sluice's GUE but has no socket on this host is passed on to the first previous backend
//! the tunnel still names (the owners of the flow's ring slot before its changes, most
//! recent first).
//!
//! Each pass-on takes the first name off the list (the rest move up, the last becomes zero)
//! and adds one to the hop count, so a packet is passed on at most `RING_HISTORY` times in
//! all and at most once by each host it reaches: with no name left it is delivered to the
//! stack, which resets it. The hop count tells a packet that ran out of names
//! (`decap_history_short`) from one the LB sent without any (`decap_no_second_hop`).

use aya_ebpf::{
    bindings::{bpf_fib_lookup, bpf_sock, bpf_sock_tuple, xdp_action, BPF_FIB_LKUP_RET_SUCCESS},
    helpers::{
        bpf_fib_lookup as fib_lookup, bpf_redirect, bpf_sk_release, bpf_skc_lookup_tcp,
        bpf_tcp_check_syncookie,
    },
    programs::XdpContext,
    EbpfContext,
};
use lb_common::{stat, PROTO_TCP, RING_HISTORY};

use crate::{
    csum::{add_all, fold},
    hdr::{ETH_HLEN, ETH_P_IP, IPV4_HLEN, IPV6_HLEN, TCP_ACK, TCP_HLEN, TCP_SYN},
    parse::{at, u8_at},
    stats::count,
};

const AF_INET: u8 = 2;
const AF_INET6: u8 = 10;
/// `BPF_F_CURRENT_NETNS`: look sockets up in the namespace of the receiving device.
const CURRENT_NETNS: u64 = u64::MAX;
const TCP_LISTEN: u32 = 10;

/// What the tunnel told us: where its private data sits and how often the packet was
/// passed on already.
pub struct Tunnel {
    /// Offset of Sluice's private data (kind, hop count, reserved, previous addresses).
    pub priv_off: usize,
    pub hops: u8,
}

/// For a GUE packet with an outer header of `WORDS`-word addresses right after an untagged
/// Ethernet header: `Some(action)` when it was passed on to a previous backend, `None`
/// when it is for this host (a socket is here, it opens a connection, it is not TCP, or there
/// is nowhere to pass it). Every `None` for a missing socket is counted.
#[inline(always)]
pub fn forward<const WORDS: usize>(
    ctx: &XdpContext,
    l3: usize,
    t: &Tunnel,
    inner_off: usize,
    inner_eth: u16,
) -> Option<u32> {
    if has_socket(ctx, inner_off, inner_eth)? {
        return None;
    }
    let outer_ip = if WORDS == 1 { IPV4_HLEN } else { IPV6_HLEN };
    // Only the LB's own layout is rewritten in place: no VLAN tag, no IPv4 options.
    if l3 != ETH_HLEN || t.priv_off != ETH_HLEN + outer_ip + 12 {
        count(stat::DECAP_NO_SECOND_HOP);
        return None;
    }
    let names = ETH_HLEN + outer_ip + 16;
    let a = at(ctx, names, 4 * WORDS)?;
    let mut next = [0u32; 4];
    for (i, w) in next.iter_mut().take(WORDS).enumerate() {
        *w = unsafe { core::ptr::read_unaligned((a + 4 * i) as *const u32) };
    }
    // (A count at the limit with a name left is no packet of ours: not passed on either.)
    if next == [0; 4] || t.hops as usize >= RING_HISTORY {
        if t.hops == 0 {
            count(stat::DECAP_NO_SECOND_HOP);
        } else {
            // The previous backends named have no socket either: the flow's slot changed
            // more often than the ring remembers (or the connection is gone).
            count(stat::DECAP_HISTORY_SHORT);
        }
        return None;
    }
    let ip = at(ctx, ETH_HLEN, outer_ip)?;
    let mut f: bpf_fib_lookup = unsafe { core::mem::zeroed() };
    let ingress = unsafe { (*ctx.ctx).ingress_ifindex };
    f.ifindex = ingress;
    unsafe {
        if WORDS == 1 {
            f.family = AF_INET;
            f.__bindgen_anon_1.tot_len =
                u16::from_be(core::ptr::read_unaligned((ip + 2) as *const u16));
            f.__bindgen_anon_3.ipv4_src = core::ptr::read_unaligned((ip + 12) as *const u32);
            f.__bindgen_anon_4.ipv4_dst = next[0];
        } else {
            f.family = AF_INET6;
            f.__bindgen_anon_1.tot_len =
                u16::from_be(core::ptr::read_unaligned((ip + 4) as *const u16)) + IPV6_HLEN as u16;
            f.__bindgen_anon_3.ipv6_src = core::ptr::read_unaligned((ip + 8) as *const [u32; 4]);
            f.__bindgen_anon_4.ipv6_dst = next;
        }
    }
    let rc = unsafe {
        fib_lookup(
            ctx.as_ptr(),
            &mut f as *mut _,
            core::mem::size_of::<bpf_fib_lookup>() as i32,
            0,
        )
    };
    if rc != BPF_FIB_LKUP_RET_SUCCESS as i64 {
        count(stat::DECAP_SECOND_HOP_NO_ROUTE);
        return None;
    }
    // Readdress the tunnel to that backend, take its name off the list and count the hop.
    let hdr = at(ctx, 0, names + 4 * WORDS * RING_HISTORY)?;
    unsafe {
        core::ptr::write_unaligned(hdr as *mut [u8; 6], f.dmac);
        core::ptr::write_unaligned((hdr + 6) as *mut [u8; 6], f.smac);
        let ip = hdr + ETH_HLEN;
        if WORDS == 1 {
            core::ptr::write_unaligned((ip + 16) as *mut u32, next[0]);
            core::ptr::write_unaligned((ip + 10) as *mut u16, 0);
            let words = core::ptr::read_unaligned(ip as *const [u32; 5]);
            core::ptr::write_unaligned((ip + 10) as *mut u16, fold(add_all(0, &words)));
        } else {
            core::ptr::write_unaligned((ip + 24) as *mut [u32; 4], next);
        }
        core::ptr::write_unaligned((hdr + names - 3) as *mut u8, t.hops + 1);
        let list = hdr + names;
        for i in 0..WORDS * (RING_HISTORY - 1) {
            let w = core::ptr::read_unaligned((list + 4 * (WORDS + i)) as *const u32);
            core::ptr::write_unaligned((list + 4 * i) as *mut u32, w);
        }
        for i in WORDS * (RING_HISTORY - 1)..WORDS * RING_HISTORY {
            core::ptr::write_unaligned((list + 4 * i) as *mut u32, 0);
        }
    }
    count(stat::DECAP_SECOND_HOP);
    if t.hops > 0 {
        count(stat::DECAP_HOP_FURTHER);
    }
    if f.ifindex == ingress {
        return Some(xdp_action::XDP_TX);
    }
    Some(unsafe { bpf_redirect(f.ifindex, 0) } as u32)
}

/// Whether this host holds the connection of the inner TCP packet at `off`: `None` when the
/// packet is not a candidate at all (not TCP, a SYN, a fragment), otherwise whether an
/// established or request socket, or a listener that accepts its SYN cookie, is here.
#[inline(always)]
fn has_socket(ctx: &XdpContext, off: usize, inner_eth: u16) -> Option<bool> {
    let mut tuple: bpf_sock_tuple = unsafe { core::mem::zeroed() };
    let (iph_len, th_off, size) = if inner_eth == ETH_P_IP {
        let i = at(ctx, off, IPV4_HLEN)?;
        let ihl = ((unsafe { u8_at(i) } & 0x0f) as usize) * 4;
        let frag = u16::from_be(unsafe { core::ptr::read_unaligned((i + 6) as *const u16) });
        if unsafe { u8_at(i + 9) } != PROTO_TCP || ihl < IPV4_HLEN || frag & 0x1fff != 0 {
            return None;
        }
        unsafe {
            tuple.__bindgen_anon_1.ipv4.saddr = core::ptr::read_unaligned((i + 12) as *const u32);
            tuple.__bindgen_anon_1.ipv4.daddr = core::ptr::read_unaligned((i + 16) as *const u32);
        }
        (IPV4_HLEN as u32, off + ihl, 12u32)
    } else {
        let i = at(ctx, off, IPV6_HLEN)?;
        // Extension headers are left to the stack: only the LB's own traffic is passed on.
        if unsafe { u8_at(i + 6) } != PROTO_TCP {
            return None;
        }
        unsafe {
            tuple.__bindgen_anon_1.ipv6.saddr =
                core::ptr::read_unaligned((i + 8) as *const [u32; 4]);
            tuple.__bindgen_anon_1.ipv6.daddr =
                core::ptr::read_unaligned((i + 24) as *const [u32; 4]);
        }
        (IPV6_HLEN as u32, off + IPV6_HLEN, 36u32)
    };
    let th = at(ctx, th_off, TCP_HLEN)?;
    let flags = unsafe { u8_at(th + 13) };
    // A SYN opens a connection here; it is never passed on.
    if flags & TCP_SYN != 0 {
        return None;
    }
    let ports = unsafe { core::ptr::read_unaligned(th as *const [u16; 2]) };
    if inner_eth == ETH_P_IP {
        tuple.__bindgen_anon_1.ipv4.sport = ports[0];
        tuple.__bindgen_anon_1.ipv4.dport = ports[1];
    } else {
        tuple.__bindgen_anon_1.ipv6.sport = ports[0];
        tuple.__bindgen_anon_1.ipv6.dport = ports[1];
    }
    let sk = unsafe { bpf_skc_lookup_tcp(ctx.as_ptr(), &mut tuple, size, CURRENT_NETNS, 0) };
    if sk.is_null() {
        return Some(false);
    }
    let state = unsafe { (*(sk as *const bpf_sock)).state };
    let here = if state != TCP_LISTEN {
        // Established, a request socket (the handshake's last ACK), or TIME_WAIT.
        true
    } else if flags & TCP_ACK != 0 {
        // Only a listener matched: the handshake's last ACK of a SYN-cookie connection is
        // this host's if the cookie is its own.
        let iph = at(ctx, off, iph_len as usize);
        match iph {
            Some(iph) => unsafe {
                bpf_tcp_check_syncookie(
                    sk as *mut _,
                    iph as *mut _,
                    iph_len,
                    th as *mut _,
                    TCP_HLEN as u32,
                ) == 0
            },
            None => false,
        }
    } else {
        false
    };
    unsafe { bpf_sk_release(sk as *mut _) };
    Some(here)
}
