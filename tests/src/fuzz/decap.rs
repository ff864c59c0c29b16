//! Fuzzing `sluice_decap` with tunnel frames, against its own oracle.

use std::collections::BTreeMap;

use anyhow::{ensure, Context, Result};
use lb_common::{stat, PROTO_IPIP, PROTO_IPV6, PROTO_TCP, PROTO_UDP};

use super::{
    generate::{l4, mutate, options, CLIENTS4, CLIENTS6},
    hex,
    oracle::l3_start,
    Rng, LB_MAC, XDP_PASS,
};
use crate::{frames::*, run_prog, Lab};

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
    let (l3, ty) = l3_start(frame)?;
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
