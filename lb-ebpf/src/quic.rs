//! QUIC connection-ID routing: parsing a UDP payload as QUIC (RFC 8999's invariants) apart
//! from finding the server its connection ID names.
//!
//! A QUIC connection survives a change of the client's address or port (RFC 9000 §9), so its
//! 5-tuple cannot keep it on its server; the server ID that the server wrote into the
//! connection IDs it chose can (draft-ietf-quic-load-balancers, unencrypted mode). Only packets
//! that carry such an ID are routed by it: short-header packets and Handshake packets. A
//! client's Initial and 0-RTT packets carry an ID the client chose, and a version this program
//! does not know may number its types otherwise: those, like every packet whose ID names no
//! server that takes it, take the 5-tuple path, each counted under its own counter.

use aya_ebpf::programs::XdpContext;
use lb_common::{
    hash,
    quic::{
        HANDSHAKE_V1, HANDSHAKE_V2, LONG_HEADER, MAX_CID_LEN, NONCE_LEN_MIN, ROTATION_SHIFT,
        SERVER_ID_LEN_MAX, VERSION_1, VERSION_2,
    },
    stat::{self, Counter},
    QuicServerKey, VipMeta,
};

use crate::{
    hdr::UDP_HLEN,
    maps::QUIC_SERVERS,
    parse::{at, raw32_at, u8_at, Parsed},
};

/// A long header's fixed part: first octet, version, destination connection-ID length.
const LONG_FIXED: usize = 6;
/// Octets read from a connection ID at once: its first octet and the eight after it, which
/// hold any server ID this program reads (`SERVER_ID_LEN_MAX`); those past the server ID are
/// masked off.
const CID_READ: usize = 9;

/// The start of a connection ID its server chose: its first octet, and the eight octets after
/// it as a big-endian integer.
struct ServerCid {
    first: u8,
    next: u64,
}

/// The backend id named by the server-chosen connection ID of a QUIC packet to `vip`, with
/// the ID's hash (`hash::cid_hash`), or the counter of the reason the packet takes the 5-tuple
/// path. Whether that backend still takes packets is for the caller to check.
#[inline(always)]
pub fn server(
    ctx: &XdpContext,
    p: &Parsed,
    vip: &VipMeta,
    seed: u32,
) -> Result<(u32, u32), Counter> {
    let sid_len = vip.quic_server_id_len as usize;
    // The controller writes 1..=SERVER_ID_LEN_MAX; the check also bounds the shift below.
    if sid_len == 0 || sid_len > SERVER_ID_LEN_MAX as usize {
        return Err(stat::QUIC_UNKNOWN_SERVER);
    }
    let cid = server_cid(ctx, p, sid_len)?;
    if cid.first >> ROTATION_SHIFT != vip.quic_rotation {
        return Err(stat::QUIC_UNKNOWN_ROTATION);
    }
    let key = QuicServerKey {
        vip: vip.id,
        _pad: 0,
        id: cid.next >> (64 - 8 * sid_len as u32),
    };
    let id = match unsafe { QUIC_SERVERS.get(key) } {
        Some(id) => *id,
        None => return Err(stat::QUIC_UNKNOWN_SERVER),
    };
    // The server ID and the nonce's first four octets (a nonce has at least four) are the
    // same in every packet of the connection; octets after them may be the packet number.
    let stable = (sid_len + NONCE_LEN_MIN).min(8) as u32;
    Ok((id, hash::cid_hash(cid.next >> (64 - 8 * stable), seed)))
}

/// Finds the connection ID the server chose in a UDP payload: right after a short header's
/// first octet, or after a Handshake packet's fixed long header. Everything read lies inside
/// the IP packet (`Parsed::l3_len`), except octets past the server ID, which are masked off.
#[inline(always)]
fn server_cid(ctx: &XdpContext, p: &Parsed, sid_len: usize) -> Result<ServerCid, Counter> {
    let payload = p.l4_off + UDP_HLEN;
    let end = p.l3_off + p.l3_len;
    let h = at(ctx, payload, 1).ok_or(stat::QUIC_MALFORMED)?;
    if payload + 1 > end {
        return Err(stat::QUIC_MALFORMED);
    }
    let first = unsafe { u8_at(h) };
    let cid = if first & LONG_HEADER == 0 {
        payload + 1
    } else {
        let h = at(ctx, payload, LONG_FIXED).ok_or(stat::QUIC_MALFORMED)?;
        if payload + LONG_FIXED > end {
            return Err(stat::QUIC_MALFORMED);
        }
        let version = u32::from_be(unsafe { raw32_at(h + 1) });
        let kind = (first >> 4) & 3;
        let server_chose = (version == VERSION_1 && kind == HANDSHAKE_V1)
            || (version == VERSION_2 && kind == HANDSHAKE_V2);
        if !server_chose {
            return Err(stat::QUIC_CLIENT_CID);
        }
        let len = unsafe { u8_at(h + 5) } as usize;
        if len > MAX_CID_LEN || len < 1 + sid_len || payload + LONG_FIXED + len > end {
            return Err(stat::QUIC_MALFORMED);
        }
        payload + LONG_FIXED
    };
    if cid + 1 + sid_len > end {
        return Err(stat::QUIC_MALFORMED);
    }
    // A QUIC packet always has more than nine octets from its connection ID on (a packet
    // number and an AEAD tag follow): a frame without them is no packet to route.
    let c = at(ctx, cid, CID_READ).ok_or(stat::QUIC_MALFORMED)?;
    Ok(ServerCid {
        first: unsafe { u8_at(c) },
        next: u64::from_be(unsafe { core::ptr::read_unaligned((c + 1) as *const u64) }),
    })
}
