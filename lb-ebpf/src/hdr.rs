//! Wire headers: their lengths, the constants of their fields, and the layouts the programs
//! write (and read fields of, by `offset_of!`). One set for every program, as Katran's
//! `balancer_consts.h`.

pub const ETH_HLEN: usize = 14;
pub const ETH_P_IP: u16 = 0x0800;
pub const ETH_P_IPV6: u16 = 0x86dd;
pub const ETH_P_8021Q: u16 = 0x8100;
pub const ETH_P_8021AD: u16 = 0x88a8;
/// An IPv4 header without options (the only kind the programs write).
pub const IPV4_HLEN: usize = 20;
pub const IPV6_HLEN: usize = 40;
/// A TCP header without options (a RST reply, a second-hop packet's minimum).
pub const TCP_HLEN: usize = 20;
pub const UDP_HLEN: usize = 8;
pub const ICMP_HLEN: usize = 8;
/// The GUE base header: version 0, no control bit, `Hlen`, protocol, no flags.
pub const GUE_HLEN: usize = 4;
/// TTL / hop limit of every header the programs build (tunnels, RST and ICMP replies).
pub const TTL: u8 = 64;

pub const TCP_FIN: u8 = 0x01;
pub const TCP_SYN: u8 = 0x02;
pub const TCP_RST: u8 = 0x04;
pub const TCP_ACK: u8 = 0x10;

#[repr(C)]
pub struct EthHdr {
    pub dst: [u8; 6],
    pub src: [u8; 6],
    pub proto: u16,
}

#[repr(C)]
pub struct Ipv4Hdr {
    pub vihl: u8,
    pub tos: u8,
    pub tot_len: u16,
    pub id: u16,
    pub frag: u16,
    pub ttl: u8,
    pub proto: u8,
    pub csum: u16,
    pub src: u32,
    pub dst: u32,
}

#[repr(C)]
pub struct Ipv6Hdr {
    pub vtc_flow: u32,
    pub payload_len: u16,
    pub next: u8,
    pub hop_limit: u8,
    pub src: [u32; 4],
    pub dst: [u32; 4],
}

const _: () = assert!(size_of::<EthHdr>() == ETH_HLEN);
const _: () = assert!(size_of::<Ipv4Hdr>() == IPV4_HLEN);
const _: () = assert!(size_of::<Ipv6Hdr>() == IPV6_HLEN);
