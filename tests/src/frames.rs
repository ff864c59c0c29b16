//! Frame builders for packet fixtures: each header is written field by field, so expected
//! output frames are built independently of the code under test.

use std::net::{IpAddr, Ipv4Addr, Ipv6Addr};

pub const ETH_IP: u16 = 0x0800;
pub const ETH_IPV6: u16 = 0x86dd;
pub const ETH_ARP: u16 = 0x0806;

pub type Mac = [u8; 6];

pub fn eth(dst: Mac, src: Mac, ethertype: u16, payload: &[u8]) -> Vec<u8> {
    let mut f = Vec::with_capacity(14 + payload.len());
    f.extend_from_slice(&dst);
    f.extend_from_slice(&src);
    f.extend_from_slice(&ethertype.to_be_bytes());
    f.extend_from_slice(payload);
    f
}

/// Inserts an 802.1Q (or 802.1ad with `tpid` 0x88a8) tag after the MAC addresses.
pub fn vlan_tag(frame: &[u8], tpid: u16, vid: u16) -> Vec<u8> {
    let mut f = frame[..12].to_vec();
    f.extend_from_slice(&tpid.to_be_bytes());
    f.extend_from_slice(&vid.to_be_bytes());
    f.extend_from_slice(&frame[12..]);
    f
}

pub fn csum(data: &[u8]) -> u16 {
    let mut s: u32 = 0;
    for c in data.chunks(2) {
        s += u16::from_be_bytes([c[0], *c.get(1).unwrap_or(&0)]) as u32;
    }
    while s > 0xffff {
        s = (s & 0xffff) + (s >> 16);
    }
    !(s as u16)
}

pub struct V4 {
    pub src: Ipv4Addr,
    pub dst: Ipv4Addr,
    pub proto: u8,
    pub tos: u8,
    pub ttl: u8,
    pub frag: u16,
    pub options: Vec<u8>,
}

impl V4 {
    pub fn new(src: &str, dst: &str, proto: u8) -> Self {
        Self {
            src: src.parse().unwrap(),
            dst: dst.parse().unwrap(),
            proto,
            tos: 0,
            ttl: 64,
            frag: 0x4000,
            options: vec![],
        }
    }

    pub fn build(&self, payload: &[u8]) -> Vec<u8> {
        assert!(self.options.len().is_multiple_of(4));
        let hl = 20 + self.options.len();
        let mut h = vec![0u8; hl];
        h[0] = 0x40 | (hl / 4) as u8;
        h[1] = self.tos;
        h[2..4].copy_from_slice(&((hl + payload.len()) as u16).to_be_bytes());
        h[6..8].copy_from_slice(&self.frag.to_be_bytes());
        h[8] = self.ttl;
        h[9] = self.proto;
        h[12..16].copy_from_slice(&self.src.octets());
        h[16..20].copy_from_slice(&self.dst.octets());
        h[20..].copy_from_slice(&self.options);
        let c = csum(&h);
        h[10..12].copy_from_slice(&c.to_be_bytes());
        h.extend_from_slice(payload);
        h
    }
}

pub fn ipv6(src: &str, dst: &str, next: u8, tclass: u8, flow: u32, payload: &[u8]) -> Vec<u8> {
    let src: Ipv6Addr = src.parse().unwrap();
    let dst: Ipv6Addr = dst.parse().unwrap();
    let mut h = vec![0u8; 40];
    let w = 0x6000_0000u32 | (tclass as u32) << 20 | (flow & 0xfffff);
    h[0..4].copy_from_slice(&w.to_be_bytes());
    h[4..6].copy_from_slice(&(payload.len() as u16).to_be_bytes());
    h[6] = next;
    h[7] = 64;
    h[8..24].copy_from_slice(&src.octets());
    h[24..40].copy_from_slice(&dst.octets());
    h.extend_from_slice(payload);
    h
}

pub const FIN: u8 = 0x01;
pub const SYN: u8 = 0x02;
pub const RST: u8 = 0x04;
pub const ACK: u8 = 0x10;
pub const PSH: u8 = 0x08;

/// TCP segment with a zero checksum field (the data plane never reads it; fixtures compare
/// bytes, and the namespace tests use real sockets).
pub fn tcp(sport: u16, dport: u16, flags: u8, payload: &[u8]) -> Vec<u8> {
    let mut t = vec![0u8; 20];
    t[0..2].copy_from_slice(&sport.to_be_bytes());
    t[2..4].copy_from_slice(&dport.to_be_bytes());
    t[4..8].copy_from_slice(&1000u32.to_be_bytes());
    t[12] = 5 << 4;
    t[13] = flags;
    t[14..16].copy_from_slice(&65535u16.to_be_bytes());
    t.extend_from_slice(payload);
    t
}

/// A TCP RST|ACK as a host answers a SYN (seq 0, window 0), checksummed for its pseudo
/// header.
pub fn tcp_rst(src: IpAddr, dst: IpAddr, sport: u16, dport: u16, ack: u32) -> Vec<u8> {
    let mut t = vec![0u8; 20];
    t[0..2].copy_from_slice(&sport.to_be_bytes());
    t[2..4].copy_from_slice(&dport.to_be_bytes());
    t[8..12].copy_from_slice(&ack.to_be_bytes());
    t[12] = 5 << 4;
    t[13] = 0x14;
    let mut pseudo = vec![];
    match (src, dst) {
        (IpAddr::V4(s), IpAddr::V4(d)) => {
            pseudo.extend_from_slice(&s.octets());
            pseudo.extend_from_slice(&d.octets());
            pseudo.extend_from_slice(&[0, 6, 0, 20]);
        }
        (IpAddr::V6(s), IpAddr::V6(d)) => {
            pseudo.extend_from_slice(&s.octets());
            pseudo.extend_from_slice(&d.octets());
            pseudo.extend_from_slice(&[0, 0, 0, 20, 0, 0, 0, 6]);
        }
        _ => panic!("mixed families"),
    }
    pseudo.extend_from_slice(&t);
    let c = csum(&pseudo);
    t[16..18].copy_from_slice(&c.to_be_bytes());
    t
}

pub fn udp(sport: u16, dport: u16, payload: &[u8]) -> Vec<u8> {
    let mut u = vec![0u8; 8];
    u[0..2].copy_from_slice(&sport.to_be_bytes());
    u[2..4].copy_from_slice(&dport.to_be_bytes());
    u[4..6].copy_from_slice(&((8 + payload.len()) as u16).to_be_bytes());
    u.extend_from_slice(payload);
    u
}

/// ICMP error (type, code) quoting `quoted` (an IP packet) after the 8-byte ICMP header;
/// `mtu` goes in the last two bytes of the header as in "fragmentation needed".
pub fn icmp_error(ty: u8, code: u8, mtu: u32, quoted: &[u8]) -> Vec<u8> {
    let mut m = vec![ty, code, 0, 0];
    m.extend_from_slice(&mtu.to_be_bytes());
    m.extend_from_slice(quoted);
    m
}

/// Fills the checksum of an ICMP message (bytes 2..4), over the message alone (ICMPv4) or
/// with the IPv6 pseudo-header (ICMPv6, when `v6` gives the source and destination).
pub fn icmp_checksummed(mut msg: Vec<u8>, v6: Option<(&str, &str)>) -> Vec<u8> {
    msg[2..4].copy_from_slice(&[0, 0]);
    let mut data = vec![];
    if let Some((src, dst)) = v6 {
        data.extend_from_slice(&src.parse::<Ipv6Addr>().unwrap().octets());
        data.extend_from_slice(&dst.parse::<Ipv6Addr>().unwrap().octets());
        data.extend_from_slice(&(msg.len() as u32).to_be_bytes());
        data.extend_from_slice(&[0, 0, 0, 58]);
    }
    data.extend_from_slice(&msg);
    let c = csum(&data);
    msg[2..4].copy_from_slice(&c.to_be_bytes());
    msg
}

pub fn ip(s: &str) -> IpAddr {
    s.parse().unwrap()
}
