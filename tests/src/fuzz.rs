//! Fuzzing the real `sluice_xdp` through BPF_PROG_TEST_RUN: random and mutated frames (cut at
//! every header, lying length and IHL fields, long, looping and truncated IPv6 extension
//! chains, stacked VLAN tags, fragments, IP options, ICMP errors quoting garbage, padding,
//! jumbo sizes), each checked against an oracle written apart from the program ([`check`]):
//!
//! - every frame ends in exactly one outcome counter (a pass, a drop, or a frame sent), of the
//!   kind its XDP action says, and `rx` counts it;
//! - a passed frame is byte-identical; traffic not addressed to a VIP address always passes;
//! - a sent frame is the input's IP packet, byte-identical and without what followed it,
//!   behind an outer header whose lengths, checksum, protocol, TTL, traffic class and source
//!   prefix are exact, addressed to an active backend of a VIP at the packet's destination
//!   (through the fallback MAC for the first half of a run, through the FIB, a 1500-byte
//!   segment, for the second), or the exact "too big" reply, or the exact RST of a shed VIP;
//! - at the end the outcome counters add up to the frames run.
//!
//! A run is replayed from its seed (`SLUICE_FUZZ_SEED`).

use std::{
    collections::BTreeMap,
    net::IpAddr,
    time::{Duration, Instant, SystemTime, UNIX_EPOCH},
};

use anyhow::{bail, ensure, Context, Result};
use lb_common::{
    stat::{self, Kind},
    BACKEND_ACTIVE, BACKEND_DOWN, PROTO_ICMP, PROTO_ICMPV6, PROTO_IPIP, PROTO_IPV6, PROTO_TCP,
    PROTO_UDP, VIP_F_SHED, VIP_F_SHED_RST,
};
use sluice::dataplane::PROG_XDP;

use crate::{
    fib_neighbour_mac, fib_segment, frames::*, run_prog, Lab, FALLBACK_MAC, FIB_LOCAL_MAC,
};

/// Frames a run in the test suite sends.
pub const SUITE_FRAMES: u64 = 100_000;

const XDP_DROP: u32 = 1;
const XDP_PASS: u32 = 2;
const XDP_TX: u32 = 3;
const XDP_REDIRECT: u32 = 4;

const LB_MAC: Mac = [0x02, 0, 0, 0, 0, 0x01];
const CLIENT_MAC: Mac = [0x02, 0, 0, 0, 0, 0x02];
/// The largest frame sent: a 9000-byte IP packet behind three VLAN tags, plus padding.
const JUMBO: usize = 9000;

/// The seed of a run: `SLUICE_FUZZ_SEED` (decimal or 0x-hex) to replay one, else the clock.
pub fn seed_from_env() -> Result<u64> {
    match std::env::var("SLUICE_FUZZ_SEED") {
        Ok(s) => {
            let s = s.trim();
            let v = match s.strip_prefix("0x") {
                Some(hex) => u64::from_str_radix(hex, 16),
                None => s.parse(),
            };
            v.with_context(|| format!("SLUICE_FUZZ_SEED={s:?} is not a number (decimal or 0x-hex)"))
        }
        Err(_) => Ok(SystemTime::now().duration_since(UNIX_EPOCH)?.as_nanos() as u64),
    }
}

/// Frames to run: `SLUICE_FUZZ_FRAMES`, else `default`.
pub fn frames_from_env(default: u64) -> Result<u64> {
    match std::env::var("SLUICE_FUZZ_FRAMES") {
        Ok(s) => s
            .trim()
            .parse()
            .with_context(|| format!("SLUICE_FUZZ_FRAMES={s:?} is not a whole number")),
        Err(_) => Ok(default),
    }
}

/// SplitMix64: small, fast, and the same sequence on every machine for a seed.
pub struct Rng(u64);

impl Rng {
    pub fn new(seed: u64) -> Rng {
        Rng(seed)
    }

    fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^ (z >> 31)
    }

    /// Uniform in `0..n` (n > 0).
    fn below(&mut self, n: usize) -> usize {
        (self.next() % n as u64) as usize
    }

    /// True `pct` times in a hundred.
    fn chance(&mut self, pct: usize) -> bool {
        self.below(100) < pct
    }

    fn pick<T: Copy>(&mut self, xs: &[T]) -> T {
        xs[self.below(xs.len())]
    }

    fn bytes(&mut self, n: usize) -> Vec<u8> {
        (0..n).map(|_| self.next() as u8).collect()
    }
}

/// A VIP of the fuzz lab and its backends: (address, active).
struct Vip {
    addr: IpAddr,
    port: u16,
    proto: u8,
    backends: Vec<(IpAddr, bool)>,
    /// Backend ids, in the order of `backends`.
    ids: Vec<u32>,
    /// New sessions are shed, TCP ones answered with a RST.
    shed_rst: bool,
}

/// Flips the first backend of a VIP with several between active and down.
fn toggle_backend(lab: &mut Lab, vips: &mut [Vip], rng: &mut Rng) {
    let many: Vec<usize> = (0..vips.len()).filter(|&i| vips[i].ids.len() > 1).collect();
    let v = &mut vips[rng.pick(&many)];
    let active = !v.backends[0].1;
    lab.set_state(v.ids[0], if active { BACKEND_ACTIVE } else { BACKEND_DOWN });
    v.backends[0].1 = active;
}

/// (VIP id, address, port, protocol, flags, backends as (id, address)).
type VipSpec = (
    u32,
    &'static str,
    u16,
    u8,
    u32,
    &'static [(u32, &'static str)],
);

/// The lab: IPv4 and IPv6 VIPs over TCP and UDP, an all-ports VIP, IPv4 carried over IPv6
/// backends, a VIP without backends (drops), VIPs shedding new sessions (by RST, by drop),
/// and one backend down in each table (probed past, its flows re-steered).
fn setup(lab: &mut Lab) -> Vec<Vip> {
    let specs: [VipSpec; 8] = [
        (
            0,
            "10.200.0.1",
            443,
            PROTO_TCP,
            0,
            &[(1, "10.1.0.1"), (2, "10.1.0.2"), (3, "10.1.0.3")],
        ),
        (
            1,
            "10.200.0.1",
            443,
            PROTO_UDP,
            0,
            &[(4, "fd00:1::4"), (5, "fd00:1::5")],
        ),
        (
            2,
            "fd00:200::1",
            443,
            PROTO_TCP,
            0,
            &[(6, "fd00:1::6"), (7, "fd00:1::7"), (8, "fd00:1::8")],
        ),
        (3, "fd00:200::1", 4433, PROTO_UDP, 0, &[(9, "fd00:1::9")]),
        (
            4,
            "10.200.0.2",
            0,
            PROTO_TCP,
            0,
            &[(10, "10.1.0.10"), (11, "10.1.0.11")],
        ),
        (5, "10.200.0.3", 80, PROTO_TCP, 0, &[]),
        (
            6,
            "10.200.0.5",
            443,
            PROTO_TCP,
            VIP_F_SHED | VIP_F_SHED_RST,
            &[(12, "10.1.0.12"), (13, "10.1.0.13")],
        ),
        (
            7,
            "fd00:200::5",
            0,
            PROTO_TCP,
            VIP_F_SHED | VIP_F_SHED_RST,
            &[(14, "fd00:1::14")],
        ),
    ];
    let mut vips = vec![];
    for (id, addr, port, proto, flags, backends) in specs {
        let key = lab.vip(id, addr, port, proto, flags, 0);
        let list: Vec<(u32, &str, u32)> = backends.iter().map(|(b, a)| (*b, *a, 1)).collect();
        if !list.is_empty() {
            lab.backends(&key, &list);
        }
        // The first backend of every table with more than one is down.
        let mut bs = vec![];
        for (i, (b, a)) in backends.iter().enumerate() {
            let down = i == 0 && backends.len() > 1;
            if down {
                lab.set_state(*b, BACKEND_DOWN);
            }
            bs.push((a.parse().unwrap(), !down));
        }
        vips.push(Vip {
            addr: addr.parse().unwrap(),
            port,
            proto,
            backends: bs,
            ids: backends.iter().map(|(b, _)| *b).collect(),
            shed_rst: flags & VIP_F_SHED_RST != 0,
        });
    }
    vips
}

/// What a run saw.
#[derive(Debug)]
pub struct Summary {
    pub frames: u64,
    pub seed: u64,
    pub elapsed: Duration,
    /// Frames per outcome counter (`pass_*`, `drop_*`, `tx`, ...), and the events seen.
    pub counters: BTreeMap<&'static str, u64>,
}

impl Summary {
    pub fn outcomes(&self, kind: Kind) -> u64 {
        self.counters
            .iter()
            .filter(|(n, _)| stat::KINDS[index(n)] == kind)
            .map(|(_, v)| v)
            .sum()
    }
}

fn index(name: &str) -> usize {
    stat::NAMES.iter().position(|&n| n == name).unwrap()
}

/// Runs `frames` fuzzed frames from `seed` through `sluice_xdp` in a fresh lab (this thread
/// moves to a new network namespace) and checks each; the first frame the oracle refuses
/// fails the run with its index, the seed and the frame's bytes.
pub fn run(frames: u64, seed: u64) -> Result<Summary> {
    let mut lab = Lab::with_max_vips(8);
    let mut vips = setup(&mut lab);
    let mut rng = Rng::new(seed);
    let start = Instant::now();
    let mut before = lab.dp.stats()?;
    for i in 0..frames {
        // Halfway, the backends become reachable through the FIB on a 1500-byte segment: next
        // hops come from it (XDP_REDIRECT), and larger packets get "too big" replies.
        if i == frames / 2 {
            let all: Vec<IpAddr> = vips
                .iter()
                .flat_map(|v| v.backends.iter().map(|b| b.0))
                .collect();
            let ifindex = fib_segment(1500, &all);
            lab.dp.add_tx_port(ifindex)?;
        }
        // Now and then a backend goes down or comes back: its flows are re-steered.
        if i % 997 == 996 {
            toggle_backend(&mut lab, &mut vips, &mut rng);
            before = lab.dp.stats()?;
        }
        let frame = frame(&mut rng, &vips);
        let (action, out) = run_prog(&mut lab.dp, PROG_XDP, &frame)
            .with_context(|| format!("frame {i} (seed {seed:#x}): {}", hex(&frame)))?;
        let after = lab.dp.stats()?;
        check(&lab, &vips, &frame, action, &out, &before, &after).with_context(|| {
            format!(
                "frame {i} (seed {seed:#x}, replay with SLUICE_FUZZ_SEED={seed:#x}): action {action}\n  in:  {}\n  out: {}",
                hex(&frame),
                hex(&out)
            )
        })?;
        before = after;
    }
    let elapsed = start.elapsed();
    let total = lab.dp.stats()?;
    ensure!(
        total[stat::RX.index()] == frames,
        "rx counted {} of {frames} frames",
        total[stat::RX.index()]
    );
    let outcomes: u64 = total
        .iter()
        .zip(stat::KINDS)
        .filter(|(_, k)| matches!(k, Kind::Pass | Kind::Drop | Kind::Sent))
        .map(|(v, _)| v)
        .sum();
    ensure!(
        outcomes == frames,
        "outcome counters add up to {outcomes}, not the {frames} frames run"
    );
    let counters = stat::NAMES
        .iter()
        .zip(&total)
        .filter(|(_, v)| **v != 0)
        .map(|(n, v)| (*n, *v))
        .collect();
    Ok(Summary {
        frames,
        seed,
        elapsed,
        counters,
    })
}

/// The oracle for one frame.
fn check(
    lab: &Lab,
    vips: &[Vip],
    frame: &[u8],
    action: u32,
    out: &[u8],
    before: &[u64],
    after: &[u64],
) -> Result<()> {
    let delta: Vec<u64> = after.iter().zip(before).map(|(a, b)| a - b).collect();
    ensure!(
        delta[stat::RX.index()] == 1,
        "rx moved by {}",
        delta[stat::RX.index()]
    );
    let moved: Vec<(usize, u64)> = delta
        .iter()
        .enumerate()
        .filter(|(i, d)| {
            **d != 0 && matches!(stat::KINDS[*i], Kind::Pass | Kind::Drop | Kind::Sent)
        })
        .map(|(i, d)| (i, *d))
        .collect();
    let names: Vec<&str> = moved.iter().map(|(i, _)| stat::NAMES[*i]).collect();
    ensure!(
        moved.len() == 1 && moved[0].1 == 1,
        "exactly one outcome counter must move by one, moved: {names:?}"
    );
    let (counter, _) = moved[0];
    let kind = stat::KINDS[counter];
    let ip = ip_packet(frame);
    let to_vip_addr = ip
        .as_ref()
        .is_some_and(|p| vips.iter().any(|v| v.addr == p.dst));
    match action {
        XDP_PASS => {
            ensure!(kind == Kind::Pass, "XDP_PASS counted as {names:?}");
            ensure!(out == frame, "a passed frame must be byte-identical");
        }
        XDP_DROP => {
            ensure!(kind == Kind::Drop, "XDP_DROP counted as {names:?}");
            ensure!(to_vip_addr, "a frame not addressed to a VIP was dropped");
        }
        XDP_TX | XDP_REDIRECT => {
            let Some(ip) = ip else {
                bail!("a frame without an IP packet was sent")
            };
            ensure!(to_vip_addr, "a frame not addressed to a VIP was sent");
            if counter == stat::REDIRECT.index() {
                ensure!(
                    action == XDP_REDIRECT,
                    "redirect counted for action {action}"
                );
                encapsulation(lab, vips, frame, &ip, out, true)?;
                return Ok(());
            }
            ensure!(action == XDP_TX, "action {action} counted as {names:?}");
            if counter == stat::ICMP_TOO_BIG_SENT.index() {
                too_big_reply(vips, frame, &ip, out)?;
            } else if counter == stat::SHED_RST_SENT.index() {
                ensure!(
                    vips.iter().any(|v| v.addr == ip.dst && v.shed_rst),
                    "a RST from {}, which sheds nothing",
                    ip.dst
                );
                rst_reply(frame, &ip, out)?;
            } else {
                ensure!(counter == stat::TX.index(), "XDP_TX counted as {names:?}");
                encapsulation(lab, vips, frame, &ip, out, false)?;
            }
        }
        a => bail!("unexpected XDP action {a}"),
    }
    Ok(())
}

/// The IP packet of a frame as the oracle reads it: after up to two VLAN tags, an IPv4 or
/// IPv6 header whose version matches the ethertype and whose length fits the frame.
struct IpPacket {
    /// Offset of the IP header in the frame.
    off: usize,
    /// Length from the header's own length field.
    len: usize,
    v4: bool,
    dst: IpAddr,
    tos: u8,
}

fn ip_packet(frame: &[u8]) -> Option<IpPacket> {
    let mut off = 12;
    let mut ty = u16::from_be_bytes([frame[12], frame[13]]);
    for _ in 0..2 {
        if ty != 0x8100 && ty != 0x88a8 {
            break;
        }
        ty = u16::from_be_bytes(frame.get(off + 4..off + 6)?.try_into().ok()?);
        off += 4;
    }
    let l3 = off + 2;
    let h = frame.get(l3..)?;
    let (len, v4, dst, tos) = match ty {
        ETH_IP if h.len() >= 20 && h[0] >> 4 == 4 => {
            let dst: [u8; 4] = h[16..20].try_into().unwrap();
            (
                u16::from_be_bytes([h[2], h[3]]) as usize,
                true,
                IpAddr::from(dst),
                h[1],
            )
        }
        ETH_IPV6 if h.len() >= 40 && h[0] >> 4 == 6 => {
            let dst: [u8; 16] = h[24..40].try_into().unwrap();
            (
                u16::from_be_bytes([h[4], h[5]]) as usize + 40,
                false,
                IpAddr::from(dst),
                (u16::from_be_bytes([h[0], h[1]]) >> 4) as u8,
            )
        }
        _ => return None,
    };
    (len <= h.len()).then_some(IpPacket {
        off: l3,
        len,
        v4,
        dst,
        tos,
    })
}

/// `out` must be `ip`, byte-identical and alone, in an exact outer header to an active
/// backend of a VIP at the packet's destination; through the FIB's next hop when `fib`, else
/// through the fallback MAC.
fn encapsulation(
    lab: &Lab,
    vips: &[Vip],
    frame: &[u8],
    ip: &IpPacket,
    out: &[u8],
    fib: bool,
) -> Result<()> {
    ensure!(out.len() >= 14, "output shorter than Ethernet");
    let inner_proto = if ip.v4 { PROTO_IPIP } else { PROTO_IPV6 };
    let ety = u16::from_be_bytes([out[12], out[13]]);
    let (hlen, backend) = match ety {
        ETH_IP => {
            ensure!(out.len() >= 34, "outer IPv4 header cut");
            let h = &out[14..34];
            ensure!(h[0] == 0x45, "outer version/IHL {:#x}", h[0]);
            ensure!(h[1] == ip.tos, "outer TOS {:#x}, inner {:#x}", h[1], ip.tos);
            let tot = u16::from_be_bytes([h[2], h[3]]) as usize;
            ensure!(
                tot == out.len() - 14,
                "outer total length {tot}, frame carries {}",
                out.len() - 14
            );
            ensure!(h[4..8] == [0, 0, 0, 0], "outer id/fragment fields not zero");
            ensure!(
                h[8] == 64 && h[9] == inner_proto,
                "outer TTL {} protocol {}",
                h[8],
                h[9]
            );
            ensure!(csum(h) == 0, "outer header checksum is wrong");
            let src = u32::from_be_bytes(h[12..16].try_into().unwrap());
            let want = u32::from_be_bytes(lab.cfg.encap_src_v4.to_ne_bytes());
            let mask = u32::from_be_bytes(lab.cfg.encap_src_v4_hostmask.to_ne_bytes());
            ensure!(
                src & !mask == want & !mask,
                "outer source outside the encap prefix"
            );
            let dst: [u8; 4] = h[16..20].try_into().unwrap();
            (20, IpAddr::from(dst))
        }
        ETH_IPV6 => {
            ensure!(out.len() >= 54, "outer IPv6 header cut");
            let h = &out[14..54];
            let w = u32::from_be_bytes(h[0..4].try_into().unwrap());
            ensure!(w >> 28 == 6, "outer version");
            ensure!((w >> 20) as u8 == ip.tos, "outer traffic class");
            let plen = u16::from_be_bytes([h[4], h[5]]) as usize;
            ensure!(
                plen == out.len() - 54,
                "outer payload length {plen}, frame carries {}",
                out.len() - 54
            );
            ensure!(
                h[6] == inner_proto && h[7] == 64,
                "outer next header {} hop limit {}",
                h[6],
                h[7]
            );
            let prefix: Vec<u8> = lab.cfg.encap_src_v6[..3]
                .iter()
                .flat_map(|w| w.to_ne_bytes())
                .collect();
            ensure!(
                h[8..20] == prefix[..],
                "outer source outside the encap prefix"
            );
            let dst: [u8; 16] = h[24..40].try_into().unwrap();
            (40, IpAddr::from(dst))
        }
        t => bail!("outer ethertype {t:#x}"),
    };
    ensure!(
        out[14 + hlen..] == frame[ip.off..ip.off + ip.len],
        "the inner packet differs from the client's IP packet ({} bytes carried, {} expected)",
        out.len() - 14 - hlen,
        ip.len
    );
    ensure!(
        vips.iter()
            .filter(|v| v.addr == ip.dst)
            .any(|v| v.backends.contains(&(backend, true))),
        "{backend} is not an active backend of a VIP at {}",
        ip.dst
    );
    let (dmac, smac) = if fib {
        (fib_neighbour_mac(backend), FIB_LOCAL_MAC)
    } else {
        (FALLBACK_MAC, frame[0..6].try_into().unwrap())
    };
    ensure!(
        out[0..6] == dmac && out[6..12] == smac,
        "outer MACs {:02x?} -> {:02x?}, expected {smac:02x?} -> {dmac:02x?} (fib {fib})",
        &out[6..12],
        &out[0..6]
    );
    Ok(())
}

/// `out` must be the exact ICMP "fragmentation needed" / ICMPv6 "packet too big" from the VIP
/// to the client for `ip`, announcing what fits the 1500-byte backend segment once
/// encapsulated for the VIP's backends.
fn too_big_reply(vips: &[Vip], frame: &[u8], ip: &IpPacket, out: &[u8]) -> Result<()> {
    ensure!(ip.off == 14, "a tagged frame was answered");
    let p = &frame[ip.off..ip.off + ip.len];
    let proto = if ip.v4 { p[9] } else { p[6] };
    let vip = vips
        .iter()
        .find(|v| v.addr == ip.dst && v.proto == proto)
        .context("no VIP for the answered packet")?;
    let outer = if vip.backends[0].0.is_ipv4() { 20 } else { 40 };
    let mtu = 1500 - outer;
    let (client, macs) = (
        frame[6..12].try_into().unwrap(),
        frame[0..6].try_into().unwrap(),
    );
    let want = if ip.v4 {
        ensure!(p[6] & 0x40 != 0, "answered a packet without DF");
        let h = V4 {
            src: <[u8; 4]>::try_from(&p[16..20]).unwrap().into(),
            dst: <[u8; 4]>::try_from(&p[12..16]).unwrap().into(),
            proto: PROTO_ICMP,
            tos: 0,
            ttl: 64,
            frag: 0,
            options: vec![],
        };
        let msg = icmp_checksummed(icmp_error(3, 4, mtu, &p[..28]), None);
        eth(client, macs, ETH_IP, &h.build(&msg))
    } else {
        let src = IpAddr::from(<[u8; 16]>::try_from(&p[24..40]).unwrap()).to_string();
        let dst = IpAddr::from(<[u8; 16]>::try_from(&p[8..24]).unwrap()).to_string();
        let msg = icmp_checksummed(
            icmp_error(2, 0, mtu.max(1280), &p[..48]),
            Some((&src, &dst)),
        );
        eth(
            client,
            macs,
            ETH_IPV6,
            &ipv6(&src, &dst, PROTO_ICMPV6, 0, 0, &msg),
        )
    };
    ensure!(
        out == want,
        "the too-big reply differs from\n  want: {}",
        hex(&want)
    );
    Ok(())
}

/// `out` must be the exact RST|ACK answering the TCP segment in `ip`: same L2 header with the
/// MACs swapped, addresses and ports swapped, acknowledging the segment, checksums valid.
fn rst_reply(frame: &[u8], ip: &IpPacket, out: &[u8]) -> Result<()> {
    let hlen = if ip.v4 { 20 } else { 40 };
    let (l3, t) = (ip.off, ip.off + hlen);
    ensure!(
        out.len() == t + 20,
        "RST frame of {} bytes, expected {}",
        out.len(),
        t + 20
    );
    ensure!(
        out[0..6] == frame[6..12] && out[6..12] == frame[0..6] && out[12..l3] == frame[12..l3],
        "RST L2 header: MACs not swapped or tags changed"
    );
    let (o, i) = (&out[l3..], &frame[l3..]);
    let mut pseudo = vec![];
    if ip.v4 {
        ensure!(o[0] == 0x45 && o[1] == i[1], "RST version/IHL/TOS");
        ensure!(
            o[2..10] == [0, 40, 0, 0, 0x40, 0, 64, PROTO_TCP],
            "RST IPv4 fields"
        );
        ensure!(
            o[12..16] == i[16..20] && o[16..20] == i[12..16],
            "RST addresses not swapped"
        );
        ensure!(csum(&o[..20]) == 0, "RST IPv4 header checksum");
        pseudo.extend_from_slice(&o[12..20]);
        pseudo.extend_from_slice(&[0, PROTO_TCP, 0, 20]);
    } else {
        ensure!(o[0..4] == i[0..4], "RST version/class/flow label");
        ensure!(o[4..8] == [0, 20, PROTO_TCP, 64], "RST IPv6 fields");
        ensure!(
            o[8..24] == i[24..40] && o[24..40] == i[8..24],
            "RST addresses not swapped"
        );
        pseudo.extend_from_slice(&o[8..40]);
        pseudo.extend_from_slice(&[0, 0, 0, 20, 0, 0, 0, PROTO_TCP]);
    }
    let (ot, it) = (&out[t..], &frame[t..]);
    ensure!(
        ot[0..2] == it[2..4] && ot[2..4] == it[0..2],
        "RST ports not swapped"
    );
    let seq = u32::from_be_bytes(it[4..8].try_into().unwrap());
    let doff = (it[12] >> 4) as usize * 4;
    let data = (ip.len - hlen).saturating_sub(doff) as u32;
    let ack = seq.wrapping_add(data).wrapping_add(1);
    ensure!(ot[4..8] == [0; 4], "RST sequence number");
    ensure!(
        ot[8..12] == ack.to_be_bytes(),
        "RST acknowledges {:?}, not {ack}",
        &ot[8..12]
    );
    ensure!(
        ot[12..14] == [0x50, 0x14] && ot[14..16] == [0, 0] && ot[18..20] == [0, 0],
        "RST flags, window, urgent"
    );
    pseudo.extend_from_slice(ot);
    ensure!(csum(&pseudo) == 0, "RST TCP checksum");
    Ok(())
}

fn hex(b: &[u8]) -> String {
    let shown: String = b.iter().take(160).map(|x| format!("{x:02x}")).collect();
    if b.len() > 160 {
        format!("{shown}... ({} bytes)", b.len())
    } else {
        shown
    }
}

const CLIENTS4: [&str; 4] = ["192.0.2.10", "192.0.2.11", "198.51.100.7", "203.0.113.99"];
const CLIENTS6: [&str; 4] = [
    "2001:db8:c::10",
    "2001:db8:c::11",
    "2001:db8:d::1",
    "2001:db8:e::2",
];
const OTHERS4: [&str; 3] = ["10.9.9.9", "10.200.0.4", "127.0.0.1"];
const OTHERS6: [&str; 3] = ["fd00:200::2", "ff02::1", "fe80::1"];

/// One fuzzed frame: a well-formed packet of some kind, wrapped in VLAN tags, then mutated.
fn frame(rng: &mut Rng, vips: &[Vip]) -> Vec<u8> {
    let l3 = match rng.below(12) {
        0..=4 => to_vip(rng, vips),
        5 => icmp_error_packet(rng, vips),
        6 => fragment(rng, vips),
        7 => other_host(rng),
        8 => {
            // Bytes that claim to be IP.
            let n = rng.below(80) + 1;
            let mut b = rng.bytes(n);
            b[0] = (rng.pick(&[4u8, 6, 5, 0]) << 4) | (b[0] & 0x0f);
            b
        }
        _ => to_vip(rng, vips),
    };
    let ety = match l3[0] >> 4 {
        _ if rng.chance(2) => rng.pick(&[ETH_ARP, 0x88cc, ETH_IP, ETH_IPV6]),
        4 => ETH_IP,
        _ => ETH_IPV6,
    };
    let mut f = eth(LB_MAC, CLIENT_MAC, ety, &l3);
    let mut l3_off = 14;
    for _ in 0..rng.pick(&[0, 0, 0, 0, 0, 1, 1, 2, 2, 3]) {
        f = vlan_tag(
            &f,
            rng.pick(&[0x8100, 0x8100, 0x8100, 0x88a8, 0x88a8, 0x9100]),
            rng.below(4096) as u16,
        );
        l3_off += 4;
    }
    for _ in 0..rng.pick(&[0, 0, 1, 1, 2, 3]) {
        mutate(rng, &mut f, l3_off);
    }
    f
}

fn mutate(rng: &mut Rng, f: &mut Vec<u8>, l3: usize) {
    match rng.below(7) {
        // Ethernet padding, or junk after the packet.
        0 | 1 => {
            let n = rng.pick(&[1, 2, 6, 18, 46, 64]);
            let pad = if rng.chance(50) {
                vec![0; n]
            } else {
                rng.bytes(n)
            };
            f.extend_from_slice(&pad);
        }
        // Cut, mostly near a header boundary.
        2 => {
            let at = if rng.chance(70) {
                let b = rng.pick(&[14, 18, 22, 26, 34, 38, 42, 54, 58, 62, 74, 82, 94, 102]);
                b + rng.below(9) - 4
            } else {
                14 + rng.below(f.len())
            };
            f.truncate(at.clamp(14, f.len()));
        }
        // A lying IP length field (IPv4 total length or IPv6 payload length).
        3 if f.len() >= l3 + 6 => {
            let v4 = f[l3] >> 4 == 4;
            let field = if v4 { l3 + 2 } else { l3 + 4 };
            let cur = u16::from_be_bytes([f[field], f[field + 1]]) as i64;
            let v = match rng.below(4) {
                0 => rng.below(65536) as i64,
                1 => cur + rng.below(41) as i64 - 20,
                2 => rng.pick(&[0, 8, 20, 28, 40, 48]),
                _ => (f.len() - l3) as i64 - if v4 { 0 } else { 40 },
            };
            f[field..field + 2].copy_from_slice(&(v.clamp(0, 65535) as u16).to_be_bytes());
        }
        // A lying IHL.
        4 if f.len() > l3 && f[l3] >> 4 == 4 => {
            f[l3] = 0x40 | rng.below(16) as u8;
        }
        // Any byte of the headers.
        _ => {
            let end = f.len().min(l3 + 100);
            if end > 12 {
                let i = 12 + rng.below(end - 12);
                f[i] = rng.next() as u8;
            }
        }
    }
}

fn payload(rng: &mut Rng) -> Vec<u8> {
    let n = match rng.below(100) {
        0 => JUMBO - rng.below(200) - 100,
        1..=3 => 1400 + rng.below(200),
        4..=20 => rng.below(600),
        _ => rng.below(24),
    };
    rng.bytes(n)
}

fn l4(rng: &mut Rng, proto: u8, sport: u16, dport: u16) -> Vec<u8> {
    let data = payload(rng);
    if proto == PROTO_TCP {
        tcp(
            sport,
            dport,
            rng.pick(&[SYN, SYN, ACK, ACK | PSH, 0x11, 0x04, 0x12]),
            &data,
        )
    } else {
        udp(sport, dport, &data)
    }
}

/// TCP or UDP to a VIP address (usually its port and protocol), from a small pool of clients
/// so flows repeat (connection-table hits, re-steering past the down backend).
fn to_vip(rng: &mut Rng, vips: &[Vip]) -> Vec<u8> {
    let v = &vips[rng.below(vips.len())];
    let proto = if rng.chance(90) {
        v.proto
    } else {
        rng.pick(&[PROTO_TCP, PROTO_UDP])
    };
    let dport = if v.port != 0 && rng.chance(90) {
        v.port
    } else {
        rng.below(65536) as u16
    };
    let sport = 40000 + rng.below(64) as u16;
    let seg = l4(rng, proto, sport, dport);
    let dst = v.addr.to_string();
    if v.addr.is_ipv4() {
        let mut h = V4::new(rng.pick(&CLIENTS4), &dst, proto);
        h.tos = rng.pick(&[0, 0x28, 0xb8, 0x03]);
        h.frag = rng.pick(&[0x4000, 0]);
        if rng.chance(20) {
            h.options = options(rng);
        }
        h.build(&seg)
    } else {
        let (next, body) = if rng.chance(30) {
            ext_chain(rng, proto, &seg)
        } else {
            (proto, seg)
        };
        ipv6(
            rng.pick(&CLIENTS6),
            &dst,
            next,
            rng.pick(&[0, 0x28, 0xb8]),
            rng.below(1 << 20) as u32,
            &body,
        )
    }
}

/// IPv4 options: NOPs, an end-of-list, a record-route-shaped option, random bytes.
fn options(rng: &mut Rng) -> Vec<u8> {
    let words = rng.below(10) + 1;
    let mut o = match rng.below(3) {
        0 => vec![1; words * 4],
        1 => {
            let mut o = vec![7, (words * 4) as u8, 4];
            o.resize(words * 4, 0);
            o
        }
        _ => rng.bytes(words * 4),
    };
    o.truncate(40);
    o
}

/// An IPv6 extension-header chain ending in `proto`: long (past the program's limit),
/// repeating, with fragment headers, or with a header type the program does not walk.
fn ext_chain(rng: &mut Rng, proto: u8, seg: &[u8]) -> (u8, Vec<u8>) {
    let n = rng.below(7) + 1;
    let types: Vec<u8> = (0..n)
        .map(|_| rng.pick(&[0, 43, 60, 60, 44, 51, 59]))
        .collect();
    let mut body = vec![];
    for (i, _) in types.iter().enumerate() {
        let next = types.get(i + 1).copied().unwrap_or(proto);
        let len = rng.pick(&[0u8, 0, 1, 3]);
        let mut h = vec![next, len];
        h.extend(rng.bytes(6 + len as usize * 8));
        body.extend(h);
    }
    body.extend_from_slice(seg);
    (types[0], body)
}

/// An ICMP error towards a VIP address (or not), quoting a VIP flow's reply, part of one,
/// or garbage.
fn icmp_error_packet(rng: &mut Rng, vips: &[Vip]) -> Vec<u8> {
    let v = &vips[rng.below(vips.len())];
    let proto = if rng.chance(80) { v.proto } else { PROTO_ICMP };
    let port = if v.port == 0 { 443 } else { v.port };
    let sport = 40000 + rng.below(64) as u16;
    let to_vip = rng.chance(85);
    if v.addr.is_ipv4() {
        let client = rng.pick(&CLIENTS4);
        let mut quoted = V4::new(&v.addr.to_string(), client, proto);
        if rng.chance(20) {
            quoted.options = options(rng);
        }
        let mut q = quoted.build(&l4(rng, proto, port, sport));
        let keep = rng.pick(&[28, 28, 28 + quoted.options.len(), 20, 24, 64, q.len()]);
        q.truncate(keep.min(q.len()));
        if rng.chance(15) {
            q = rng.bytes(q.len());
        }
        if rng.chance(10) {
            q[0] = 0x40 | rng.below(16) as u8;
        }
        let (ty, code) = if rng.chance(85) {
            (3, 4)
        } else {
            (rng.pick(&[3, 11, 5, 0]), rng.below(16) as u8)
        };
        let dst = if to_vip {
            v.addr.to_string()
        } else {
            rng.pick(&OTHERS4).to_string()
        };
        V4::new("198.51.100.1", &dst, PROTO_ICMP).build(&icmp_error(ty, code, 1400, &q))
    } else {
        let client = rng.pick(&CLIENTS6);
        let mut q = ipv6(
            &v.addr.to_string(),
            client,
            proto,
            0,
            0,
            &l4(rng, proto, port, sport),
        );
        let keep = rng.pick(&[48, 48, 40, 44, 100, q.len()]);
        q.truncate(keep.min(q.len()));
        if rng.chance(15) {
            q = rng.bytes(q.len());
        }
        let ty = if rng.chance(85) {
            2
        } else {
            rng.pick(&[1, 3, 4, 128, 135])
        };
        let dst = if to_vip {
            v.addr.to_string()
        } else {
            rng.pick(&OTHERS6).to_string()
        };
        ipv6(
            "2001:db8:ff::1",
            &dst,
            PROTO_ICMPV6,
            0,
            0,
            &icmp_error(ty, 0, 1400, &q),
        )
    }
}

/// A fragment of a VIP flow: IPv4 first or later fragments, IPv6 with a fragment header.
fn fragment(rng: &mut Rng, vips: &[Vip]) -> Vec<u8> {
    let v = &vips[rng.below(vips.len())];
    let sport = 40000 + rng.below(64) as u16;
    let seg = l4(rng, v.proto, sport, v.port.max(1));
    if v.addr.is_ipv4() {
        let mut h = V4::new(rng.pick(&CLIENTS4), &v.addr.to_string(), v.proto);
        h.frag = rng.pick(&[0x2000, 0x2010, 0x0010, 0x1fff, 0x6000]);
        h.build(&seg)
    } else {
        let mut body = vec![v.proto, 0];
        body.extend_from_slice(&rng.pick(&[[0u8, 1], [0, 0], [1, 0]]));
        body.extend(rng.bytes(4));
        body.extend_from_slice(&seg);
        ipv6(rng.pick(&CLIENTS6), &v.addr.to_string(), 44, 0, 0, &body)
    }
}

/// Traffic for other hosts, which must pass untouched.
fn other_host(rng: &mut Rng) -> Vec<u8> {
    let proto = rng.pick(&[PROTO_TCP, PROTO_UDP]);
    let sport = 1000 + rng.below(100) as u16;
    let dport = rng.pick(&[443, 80, 4433]);
    let seg = l4(rng, proto, sport, dport);
    if rng.chance(50) {
        V4::new(rng.pick(&CLIENTS4), rng.pick(&OTHERS4), proto).build(&seg)
    } else {
        ipv6(rng.pick(&CLIENTS6), rng.pick(&OTHERS6), proto, 0, 0, &seg)
    }
}

/// Writes a run's result as JSON (for `bench/results/fuzz.json`), with the command line
/// from `SLUICE_FUZZ_COMMAND`.
pub fn record(s: &Summary, path: &std::path::Path) -> Result<()> {
    let kernel = std::fs::read_to_string("/proc/sys/kernel/osrelease").unwrap_or_default();
    let kinds: BTreeMap<&str, u64> = [
        ("pass", s.outcomes(Kind::Pass)),
        ("drop", s.outcomes(Kind::Drop)),
        ("sent", s.outcomes(Kind::Sent)),
    ]
    .into();
    let v = serde_json::json!({
        "what": "sluice_xdp under fuzzed frames through BPF_PROG_TEST_RUN, every frame checked by the oracle in tests/src/fuzz.rs",
        "command": std::env::var("SLUICE_FUZZ_COMMAND").unwrap_or_default(),
        "frames": s.frames,
        "seed": format!("{:#x}", s.seed),
        "duration_s": (s.elapsed.as_secs_f64() * 10.0).round() / 10.0,
        "outcome": "passed: every frame met the oracle; outcome counters add up to the frames run",
        "outcomes": kinds,
        "counters": s.counters,
        "kernel": kernel.trim(),
        "recorded_unix_s": SystemTime::now().duration_since(UNIX_EPOCH)?.as_secs(),
    });
    std::fs::write(path, serde_json::to_string_pretty(&v)? + "\n")
        .with_context(|| format!("writing {}", path.display()))
}

/// Runs `frames` fuzzed tunnel frames from `seed` through `sluice_decap` and checks each: the
/// frame always passes; it is decapsulated exactly when its outer header is a plain tunnel
/// header whose length the inner packet fills exactly (the output then is the inner packet,
/// byte-identical and alone, behind the frame's own MACs), and is byte-identical otherwise;
/// exactly one decap counter moves. Returns the counters.
pub fn run_decap(frames: u64, seed: u64) -> Result<BTreeMap<&'static str, u64>> {
    let mut lab = Lab::new();
    let mut rng = Rng::new(seed ^ 0xdeca_0000_0000_0000);
    let outcomes = [
        stat::DECAP_OK,
        stat::DECAP_PASS_NOT_ENCAP,
        stat::DECAP_PASS_BAD_LEN,
        stat::DECAP_PASS_BAD_GUE,
    ];
    let mut before = lab.dp.stats()?;
    for i in 0..frames {
        let frame = tunnel_frame(&mut rng);
        let (action, out) = run_prog(&mut lab.dp, sluice::dataplane::PROG_DECAP, &frame)?;
        let after = lab.dp.stats()?;
        let check = || -> Result<()> {
            ensure!(action == XDP_PASS, "sluice_decap returned {action}");
            let moved: Vec<&str> = outcomes
                .iter()
                .filter(|&&c| after[c.index()] != before[c.index()])
                .map(|&c| c.name())
                .collect();
            ensure!(
                moved.len() == 1
                    && outcomes
                        .iter()
                        .map(|&c| after[c.index()] - before[c.index()])
                        .sum::<u64>()
                        == 1,
                "exactly one decap counter must move by one: {moved:?}"
            );
            match decap_expected(&frame) {
                Some(want) => {
                    ensure!(
                        moved == ["decap_ok"],
                        "a well-formed tunnel frame counted {moved:?}"
                    );
                    ensure!(out == want, "decapsulated frame differs");
                }
                None => {
                    ensure!(
                        moved != ["decap_ok"],
                        "a malformed tunnel frame was decapsulated"
                    );
                    ensure!(out == frame, "a frame left alone must be byte-identical");
                }
            }
            Ok(())
        };
        check().with_context(|| {
            format!(
                "decap frame {i} (seed {seed:#x}):\n  in:  {}\n  out: {}",
                hex(&frame),
                hex(&out)
            )
        })?;
        before = after;
    }
    Ok(stat::NAMES
        .iter()
        .zip(&before)
        .filter(|(_, v)| **v != 0)
        .map(|(n, v)| (*n, *v))
        .collect())
}

/// What `sluice_decap` must make of `frame`, by the oracle's own reading: `None` when it must
/// leave it alone.
fn decap_expected(frame: &[u8]) -> Option<Vec<u8>> {
    let mut off = 12;
    let mut ty = u16::from_be_bytes([frame[12], frame[13]]);
    for _ in 0..2 {
        if ty != 0x8100 && ty != 0x88a8 {
            break;
        }
        ty = u16::from_be_bytes(frame.get(off + 4..off + 6)?.try_into().ok()?);
        off += 4;
    }
    let l3 = off + 2;
    let o = frame.get(l3..)?;
    let (ohl, tot, next) = match ty {
        ETH_IP => {
            let h = o.get(..20)?;
            let ihl = (h[0] & 0x0f) as usize * 4;
            if ihl < 20 || u16::from_be_bytes([h[6], h[7]]) & 0x3fff != 0 {
                return None;
            }
            (ihl, u16::from_be_bytes([h[2], h[3]]) as usize, h[9])
        }
        ETH_IPV6 => {
            let h = o.get(..40)?;
            (40, u16::from_be_bytes([h[4], h[5]]) as usize + 40, h[6])
        }
        _ => return None,
    };
    let inner_ty = match next {
        PROTO_IPIP => ETH_IP,
        PROTO_IPV6 => ETH_IPV6,
        _ => return None,
    };
    let i = o.get(ohl..ohl + 20)?;
    let inner_len = if inner_ty == ETH_IP {
        u16::from_be_bytes([i[2], i[3]]) as usize
    } else {
        u16::from_be_bytes([i[4], i[5]]) as usize + 40
    };
    if (inner_ty == ETH_IP && inner_len < 20) || tot != ohl + inner_len || tot > o.len() {
        return None;
    }
    Some(eth(
        frame[0..6].try_into().unwrap(),
        frame[6..12].try_into().unwrap(),
        inner_ty,
        &o[ohl..tot],
    ))
}

/// A tunnel frame as the LB sends it (IPIP, IPv6-in-IPv6, IPv4-in-IPv6; sometimes tagged, with
/// outer options, or not a tunnel at all), then mutated, or with a lying inner length.
fn tunnel_frame(rng: &mut Rng) -> Vec<u8> {
    let inner = if rng.chance(60) {
        let sport = 40000 + rng.below(64) as u16;
        let seg = l4(rng, PROTO_TCP, sport, 443);
        V4::new(rng.pick(&CLIENTS4), "10.200.0.1", PROTO_TCP).build(&seg)
    } else {
        let sport = 40000 + rng.below(64) as u16;
        let seg = l4(rng, PROTO_UDP, sport, 443);
        ipv6(rng.pick(&CLIENTS6), "fd00:200::1", PROTO_UDP, 0, 0, &seg)
    };
    let next = if inner[0] >> 4 == 4 {
        PROTO_IPIP
    } else {
        PROTO_IPV6
    };
    let next = if rng.chance(5) {
        rng.pick(&[PROTO_TCP, 47, 0])
    } else {
        next
    };
    let outer_v4 = inner[0] >> 4 == 4 && rng.chance(60);
    let mut l3 = if outer_v4 {
        let mut o = V4::new("172.16.1.2", "10.1.0.1", next);
        o.frag = rng.pick(&[0, 0, 0x4000, 0x2000, 0x0008]);
        if rng.chance(10) {
            o.options = options(rng);
        }
        o.build(&inner)
    } else {
        ipv6("fd00:5:1::1", "fd00:1::1", next, 0, 0, &inner)
    };
    if rng.chance(10) {
        // The inner packet's own length lies.
        let at = if outer_v4 {
            (l3[0] & 0x0f) as usize * 4
        } else {
            40
        };
        let field = at + if inner[0] >> 4 == 4 { 2 } else { 4 };
        if field + 2 <= l3.len() {
            let v = rng.below(65536) as u16;
            l3[field..field + 2].copy_from_slice(&v.to_be_bytes());
        }
    }
    let bmac: Mac = [0x02, 0, 0, 0, 0x0b, 0x01];
    let mut f = eth(bmac, LB_MAC, if outer_v4 { ETH_IP } else { ETH_IPV6 }, &l3);
    let mut l3_off = 14;
    for _ in 0..rng.pick(&[0, 0, 0, 0, 1, 2]) {
        f = vlan_tag(&f, rng.pick(&[0x8100, 0x88a8]), rng.below(4096) as u16);
        l3_off += 4;
    }
    for _ in 0..rng.pick(&[0, 0, 1, 1, 2]) {
        mutate(rng, &mut f, l3_off);
    }
    f
}
