//! Fuzzing the real `sluice_xdp` through BPF_PROG_TEST_RUN: random and mutated frames (cut at
//! every header, lying length and IHL fields, long, looping and truncated IPv6 extension
//! chains, stacked VLAN tags, fragments, IP options, ICMP errors quoting garbage, padding,
//! jumbo sizes), each checked against an oracle written apart from the program (`check`):
//!
//! - every frame ends in exactly one outcome counter (a pass, a drop, or a frame sent), of the
//!   kind its XDP action says, and `rx` counts it;
//! - a passed frame is byte-identical; traffic not addressed to a VIP address always passes;
//! - a sent frame is the input's IP packet, byte-identical and without what followed it,
//!   behind an outer header whose lengths, checksum, protocol, TTL, traffic class and source
//!   prefix are exact, addressed to an active backend of a VIP at the packet's destination
//!   (through the fallback MAC for the first half of a run, through the FIB, a 1500-byte
//!   segment, for the second), or the exact "too big" reply, or the exact RST of a shed VIP;
//! - a UDP packet to the QUIC VIP whose connection ID, read by the oracle's own QUIC parser,
//!   names a backend that is up goes to that backend and counts `quic_cid_routed`; any other
//!   counts the one reason the oracle reads for it (client's ID, rotation, server, down,
//!   malformed) and takes the 5-tuple path;
//! - a new session on a VIP with tenants moves exactly one tenant counter, of the tenant the
//!   oracle's own prefix match names, for the reason its limits and the oracle's GCRA give
//!   (`tenant`); no other frame moves one;
//! - at the end the outcome counters add up to the frames run.
//!
//! A run is replayed from its seed (`SLUICE_FUZZ_SEED`).

mod decap;
mod generate;
mod oracle;
mod tenant;

use std::{
    collections::BTreeMap,
    net::IpAddr,
    time::{Duration, Instant, SystemTime, UNIX_EPOCH},
};

use anyhow::{ensure, Context, Result};
use lb_common::{
    quic,
    stat::{self, Kind},
    QuicServerKey, BACKEND_ACTIVE, BACKEND_DOWN, PROTO_TCP, PROTO_UDP, VIP_F_QUIC_CID, VIP_F_SHED,
    VIP_F_SHED_RST, VIP_F_TENANTS,
};
use sluice::dataplane::PROG_XDP;

pub use self::decap::run_decap;
use self::{generate::frame, oracle::check, tenant::Tenants};
use crate::{fib_segment, frames::Mac, run_prog, tenants::coarse_now_ns, Lab};

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
    id: u32,
    addr: IpAddr,
    port: u16,
    proto: u8,
    backends: Vec<(IpAddr, bool)>,
    /// Backend ids, in the order of `backends`.
    ids: Vec<u32>,
    /// A refused new session (shed, or over its tenant's limits) is answered with a RST
    /// where it is TCP.
    shed_rst: bool,
    /// Tenants are configured (`VIP_F_TENANTS`).
    tenants: bool,
    /// QUIC connection-ID routing: the rotation codepoint and each backend's server ID
    /// (`QUIC_SID_LEN` octets), in the order of `backends`.
    quic: Option<(u8, Vec<[u8; 2]>)>,
}

/// The server-ID length and config rotation of the fuzz lab's QUIC VIP.
const QUIC_SID_LEN: u8 = 2;
const QUIC_ROTATION: u8 = 2;

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
/// backends, a VIP without backends (drops), VIPs shedding new sessions (by RST, by drop), a
/// QUIC VIP routing by connection ID, tenants on five VIPs (their limits in [`tenant`]), and
/// one backend down in each table (probed past, its flows re-steered; its server ID no
/// longer routes).
fn setup(lab: &mut Lab) -> Vec<Vip> {
    let specs: [VipSpec; 9] = [
        (
            0,
            "10.200.0.1",
            443,
            PROTO_TCP,
            VIP_F_SHED_RST,
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
        (
            8,
            "10.200.0.6",
            443,
            PROTO_UDP,
            VIP_F_QUIC_CID,
            &[(15, "10.1.0.15"), (16, "10.1.0.16"), (17, "10.1.0.17")],
        ),
    ];
    let mut vips = vec![];
    for (id, addr, port, proto, mut flags, backends) in specs {
        if tenant::TENANT_VIPS.contains(&id) {
            flags |= VIP_F_TENANTS;
        }
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
        let quic = (flags & VIP_F_QUIC_CID != 0).then(|| {
            let mut meta = lab.dp.vip(&key).unwrap().unwrap();
            meta.quic_rotation = QUIC_ROTATION;
            meta.quic_server_id_len = QUIC_SID_LEN;
            lab.dp.set_vip(&key, &meta).unwrap();
            let sids: Vec<[u8; 2]> = backends.iter().map(|(b, _)| [0x0f, *b as u8]).collect();
            for ((b, _), sid) in backends.iter().zip(&sids) {
                let k = QuicServerKey {
                    vip: id,
                    _pad: 0,
                    id: quic::server_id_value(sid),
                };
                lab.dp.set_quic_server(&k, *b).unwrap();
            }
            (QUIC_ROTATION, sids)
        });
        vips.push(Vip {
            id,
            addr: addr.parse().unwrap(),
            port,
            proto,
            backends: bs,
            ids: backends.iter().map(|(b, _)| *b).collect(),
            shed_rst: flags & VIP_F_SHED_RST != 0,
            tenants: flags & VIP_F_TENANTS != 0,
            quic,
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
    let mut lab = Lab::with_max_vips(9);
    let mut vips = setup(&mut lab);
    let mut tenants = Tenants::setup(&mut lab)?;
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
        tenants.before(&mut lab, &vips, &frame)?;
        let t0 = coarse_now_ns();
        let (action, out) = run_prog(&mut lab.dp, PROG_XDP, &frame)
            .with_context(|| format!("frame {i} (seed {seed:#x}): {}", hex(&frame)))?;
        let t1 = coarse_now_ns();
        let after = lab.dp.stats()?;
        let delta: Vec<u64> = after.iter().zip(&before).map(|(a, b)| a - b).collect();
        check(&lab, &vips, &frame, action, &out, &before, &after)
            .and_then(|()| tenants.check(&vips, &frame, &delta, t0, t1))
            .with_context(|| {
                format!(
                    "frame {i} (seed {seed:#x}, replay with SLUICE_FUZZ_SEED={seed:#x}): action {action}\n  in:  {}\n  out: {}",
                    hex(&frame),
                    hex(&out)
                )
            })?;
        before = after;
        if i % tenant::AUDIT_FRAMES == tenant::AUDIT_FRAMES - 1 || i + 1 == frames {
            let since = i - i % tenant::AUDIT_FRAMES;
            tenants.audit().with_context(|| {
                format!(
                    "frames {since}..={i} (seed {seed:#x}, replay with SLUICE_FUZZ_SEED={seed:#x})"
                )
            })?;
        }
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

fn hex(b: &[u8]) -> String {
    let shown: String = b.iter().take(160).map(|x| format!("{x:02x}")).collect();
    if b.len() > 160 {
        format!("{shown}... ({} bytes)", b.len())
    } else {
        shown
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
        "what": "sluice_xdp under fuzzed frames through BPF_PROG_TEST_RUN, every frame checked by the oracle in tests/src/fuzz/oracle.rs",
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
