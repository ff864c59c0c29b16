//! The flow hash, shared so userspace (tests, tools) computes exactly what the data plane does.
//!
//! Murmur3's 32-bit mixing over fixed 32-bit words: cheap in BPF (no loops over bytes, no
//! tables) and well spread, which Maglev's fairness relies on.

use crate::{FlowKey, FAMILY_V4};

const C1: u32 = 0xcc9e_2d51;
const C2: u32 = 0x1b87_3593;

#[inline(always)]
fn mix(h: u32, k: u32) -> u32 {
    let k = k.wrapping_mul(C1).rotate_left(15).wrapping_mul(C2);
    (h ^ k)
        .rotate_left(13)
        .wrapping_mul(5)
        .wrapping_add(0xe654_6b64)
}

#[inline(always)]
pub fn fmix(mut h: u32) -> u32 {
    h ^= h >> 16;
    h = h.wrapping_mul(0x85eb_ca6b);
    h ^= h >> 13;
    h = h.wrapping_mul(0xc2b2_ae35);
    h ^ (h >> 16)
}

/// Hash of a whole 5-tuple (the default steering key).
#[inline(always)]
pub fn flow_hash(k: &FlowKey, seed: u32) -> u32 {
    let mut h = seed;
    h = mix(h, k.src[0]);
    if k.family != FAMILY_V4 {
        h = mix(h, k.src[1]);
        h = mix(h, k.src[2]);
        h = mix(h, k.src[3]);
    }
    h = mix(h, k.dst[0]);
    if k.family != FAMILY_V4 {
        h = mix(h, k.dst[1]);
        h = mix(h, k.dst[2]);
        h = mix(h, k.dst[3]);
    }
    h = mix(h, (k.sport as u32) << 16 | k.dport as u32);
    h = mix(h, k.proto as u32);
    fmix(h ^ 40)
}

/// Hash of the client address alone (client affinity).
#[inline(always)]
pub fn src_hash(k: &FlowKey, seed: u32) -> u32 {
    let mut h = seed;
    h = mix(h, k.src[0]);
    if k.family != FAMILY_V4 {
        h = mix(h, k.src[1]);
        h = mix(h, k.src[2]);
        h = mix(h, k.src[3]);
    }
    fmix(h ^ 16)
}

/// Hash of a QUIC connection ID's stable part (its server ID and the first nonce octets, as
/// the eight octets after its first, big endian, masked): the outer header of a connection
/// routed by its ID keeps one source however the client's address changes.
#[inline(always)]
pub fn cid_hash(stable: u64, seed: u32) -> u32 {
    fmix(mix(mix(seed, stable as u32), (stable >> 32) as u32) ^ 8)
}

/// Step between the ring positions a new flow probes: in 1..ring_size, so with a prime ring
/// every probe lands on a distinct slot.
#[inline(always)]
pub fn probe_step(h: u32, ring_size: u32) -> u32 {
    fmix(h ^ 0x9e37_79b9) % (ring_size - 1) + 1
}

/// Slot of probe `i` (0 = the flow's Maglev slot).
#[inline(always)]
pub fn probe_slot(h: u32, i: u32, ring_size: u32) -> u32 {
    ((h % ring_size) as u64 + i as u64 * probe_step(h, ring_size) as u64) as u32 % ring_size
}

/// Generic hash of a byte string (userspace: Maglev permutations, ids).
pub fn hash_bytes(bytes: &[u8], seed: u32) -> u32 {
    let mut h = seed;
    let mut chunks = bytes.chunks_exact(4);
    for c in &mut chunks {
        h = mix(h, u32::from_le_bytes([c[0], c[1], c[2], c[3]]));
    }
    let mut tail = [0u8; 4];
    tail[..chunks.remainder().len()].copy_from_slice(chunks.remainder());
    h = mix(h, u32::from_le_bytes(tail));
    fmix(h ^ bytes.len() as u32)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn probe_slots_are_distinct_and_in_range() {
        for h in [0u32, 1, 12345, u32::MAX] {
            let m = 65537;
            let s: [u32; 4] = core::array::from_fn(|i| probe_slot(h, i as u32, m));
            for (i, a) in s.iter().enumerate() {
                assert!(*a < m);
                for b in &s[i + 1..] {
                    assert_ne!(a, b);
                }
            }
        }
    }

    #[test]
    fn v4_hash_ignores_unused_words_only() {
        let mut k = FlowKey {
            family: FAMILY_V4,
            proto: 6,
            sport: 1,
            dport: 2,
            ..Default::default()
        };
        k.src[0] = 0x0100_000a;
        let a = flow_hash(&k, 7);
        k.sport = 3;
        assert_ne!(a, flow_hash(&k, 7));
        assert_eq!(src_hash(&k, 7), {
            k.sport = 1;
            src_hash(&k, 7)
        });
    }
}
