//! Weighted Maglev consistent hashing (Eisenbud et al., "Maglev", NSDI 2016, §3.4).
//!
//! Each backend walks its own permutation of the ring, `offset + j * skip (mod M)`, derived
//! from its key alone, and backends take turns claiming their next preferred free slot until
//! the ring is full. Because a backend's preferences ignore the other backends, adding or
//! removing one mostly moves only the slots it gains or loses.
//!
//! Weights: turns are scheduled in virtual time instead of strict round-robin. Backend `i`'s
//! `t`-th turn (t = 1, 2, ...) falls at time `t / weight_i`, and turns run in time order, ties
//! broken by key. Every turn claims exactly one slot, so backend `i` ends with between
//! `M * w_i / W - 1` and `(M + N) * w_i / W` slots (`W` = sum of weights): the shares of
//! Katran's MaglevHashV2 credit rounds, but driven by a heap so skewed weights cost no idle
//! rounds. With equal weights this is exactly Maglev's round-robin.

use std::cmp::Ordering;
use std::collections::BinaryHeap;

use lb_common::hash::hash_bytes;
use lb_common::{MAX_BACKENDS, RING_SIZE_MAX};

pub const DEFAULT_RING_SIZE: u32 = RING_SIZE_MAX;

/// Perturbs the seed for the skip hash so offset and skip come from independent hashes.
const SKIP_SEED_XOR: u32 = 0x9e37_79b9;

/// One backend as the builder sees it. `id` is the data-plane backend id (1..MAX_BACKENDS) that
/// the ring slots hold; `key` is a stable identity (e.g. "10.0.0.1" or "10.0.0.1:8000") used to
/// derive the permutation, so the table depends only on the set of (key, weight), never on ids
/// or insertion order.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct MaglevBackend<'a> {
    pub id: u32,
    pub key: &'a str,
    /// Relative share of the ring; 0 excludes the backend (draining).
    pub weight: u32,
}

#[derive(Debug, PartialEq, Eq, thiserror::Error)]
pub enum MaglevError {
    #[error(
        "ring size {0} is not prime; Maglev needs a prime ring size no larger than {max}, \
         e.g. the default {default}",
        max = RING_SIZE_MAX,
        default = DEFAULT_RING_SIZE
    )]
    RingSizeNotPrime(u32),
    #[error(
        "ring size {0} exceeds the data plane's maximum of {max}; use a smaller prime, \
         e.g. the default {default}",
        max = RING_SIZE_MAX,
        default = DEFAULT_RING_SIZE
    )]
    RingSizeTooLarge(u32),
    #[error(
        "{backends} backends have positive weight but the ring has only {ring_size} slots, \
         so some would get none; use a prime ring size of at least 100 × backends \
         (at most {max}) or fewer backends",
        max = RING_SIZE_MAX
    )]
    RingTooSmall { backends: usize, ring_size: u32 },
    #[error("backend key {0:?} is listed more than once; each backend needs a unique key")]
    DuplicateKey(String),
    #[error("backends {first:?} and {second:?} share id {id}; give each backend its own id")]
    DuplicateId {
        id: u32,
        first: String,
        second: String,
    },
    #[error("backend {key:?} has id 0, which marks unset ring slots; ids start at 1")]
    ZeroId { key: String },
    #[error(
        "backend {key:?} has id {id}, but the data plane's backend array holds ids 1..={max}; \
         use a smaller id",
        max = MAX_BACKENDS - 1
    )]
    IdOutOfRange { key: String, id: u32 },
}

/// A backend's next turn, at virtual time `n / weight`; ordered so `BinaryHeap` (a max-heap)
/// pops the earliest, ties going to the lower rank (key order).
#[derive(Debug, PartialEq, Eq)]
struct Turn {
    n: u32,
    weight: u32,
    rank: u32,
}

impl Ord for Turn {
    fn cmp(&self, other: &Self) -> Ordering {
        // n <= M + 1 < 2^17 and weight < 2^32, so the cross products fit in u64.
        let lhs = u64::from(self.n) * u64::from(other.weight);
        let rhs = u64::from(other.n) * u64::from(self.weight);
        rhs.cmp(&lhs).then(other.rank.cmp(&self.rank))
    }
}

impl PartialOrd for Turn {
    fn partial_cmp(&self, other: &Self) -> Option<Ordering> {
        Some(self.cmp(other))
    }
}

/// Builds a `ring_size`-slot table of backend ids. Backends of weight 0 are left out; if none
/// has positive weight the table is all 0 ("unset"). Hosts given the same backends and `seed`
/// build identical tables.
pub fn build(
    backends: &[MaglevBackend],
    ring_size: u32,
    seed: u32,
) -> Result<Vec<u32>, MaglevError> {
    if ring_size > RING_SIZE_MAX {
        return Err(MaglevError::RingSizeTooLarge(ring_size));
    }
    if !is_prime(ring_size) {
        return Err(MaglevError::RingSizeNotPrime(ring_size));
    }
    let mut sorted: Vec<&MaglevBackend> = backends.iter().collect();
    sorted.sort_unstable_by_key(|b| b.key);
    validate(&sorted)?;

    let active: Vec<&MaglevBackend> = sorted.into_iter().filter(|b| b.weight > 0).collect();
    if active.len() > ring_size as usize {
        return Err(MaglevError::RingTooSmall {
            backends: active.len(),
            ring_size,
        });
    }
    let m = ring_size;
    let mut table = vec![0u32; m as usize];
    if active.is_empty() {
        return Ok(table);
    }

    // Walking the permutation incrementally (pos += skip) avoids materialising N × M entries.
    let mut pos: Vec<u32> = active
        .iter()
        .map(|b| hash_bytes(b.key.as_bytes(), seed) % m)
        .collect();
    let skip: Vec<u32> = active
        .iter()
        .map(|b| hash_bytes(b.key.as_bytes(), seed ^ SKIP_SEED_XOR) % (m - 1) + 1)
        .collect();
    let mut turns: BinaryHeap<Turn> = (0u32..)
        .zip(&active)
        .map(|(rank, b)| Turn {
            n: 1,
            weight: b.weight,
            rank,
        })
        .collect();

    // Each turn claims one free slot, so exactly M turns fill the table. M is prime and
    // 0 < skip < M, so every permutation visits all slots and a free one is always found.
    for _ in 0..m {
        let mut turn = turns.peek_mut().expect("at least one active backend");
        let i = turn.rank as usize;
        let mut p = pos[i];
        while table[p as usize] != 0 {
            p = advance(p, skip[i], m);
        }
        table[p as usize] = active[i].id;
        pos[i] = advance(p, skip[i], m);
        turn.n += 1;
    }
    Ok(table)
}

fn advance(p: u32, skip: u32, m: u32) -> u32 {
    let next = p + skip;
    if next >= m {
        next - m
    } else {
        next
    }
}

/// Checks ids and keys of all backends, draining ones included: they still own their ids.
fn validate(sorted_by_key: &[&MaglevBackend]) -> Result<(), MaglevError> {
    for b in sorted_by_key {
        if b.id == 0 {
            return Err(MaglevError::ZeroId {
                key: b.key.to_owned(),
            });
        }
        if b.id >= MAX_BACKENDS {
            return Err(MaglevError::IdOutOfRange {
                key: b.key.to_owned(),
                id: b.id,
            });
        }
    }
    if let Some(w) = sorted_by_key.windows(2).find(|w| w[0].key == w[1].key) {
        return Err(MaglevError::DuplicateKey(w[0].key.to_owned()));
    }
    let mut by_id = sorted_by_key.to_vec();
    by_id.sort_by_key(|b| b.id);
    if let Some(w) = by_id.windows(2).find(|w| w[0].id == w[1].id) {
        return Err(MaglevError::DuplicateId {
            id: w[0].id,
            first: w[0].key.to_owned(),
            second: w[1].key.to_owned(),
        });
    }
    Ok(())
}

/// Trial division: at most ~32k steps for a u32, and only called once per build.
pub fn is_prime(n: u32) -> bool {
    if n < 4 {
        return n >= 2;
    }
    if n.is_multiple_of(2) {
        return false;
    }
    let n = u64::from(n);
    (3u64..)
        .step_by(2)
        .take_while(|d| d * d <= n)
        .all(|d| !n.is_multiple_of(d))
}

/// Slots that differ between two tables or rings (for writing only changed entries), as
/// (slot, new value). Slots of `new` beyond the end of `old` count as changed.
pub fn diff<'a, T: PartialEq + Copy>(
    old: &'a [T],
    new: &'a [T],
) -> impl Iterator<Item = (u32, T)> + 'a {
    (0u32..)
        .zip(new)
        .filter(move |&(slot, v)| old.get(slot as usize) != Some(v))
        .map(|(slot, &v)| (slot, v))
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::HashMap;

    fn keys(n: usize) -> Vec<String> {
        (0..n)
            .map(|i| format!("10.0.{}.{}:8000", i / 256, i % 256))
            .collect()
    }

    fn equal(keys: &[String]) -> Vec<MaglevBackend<'_>> {
        (1..)
            .zip(keys)
            .map(|(id, key)| MaglevBackend { id, key, weight: 1 })
            .collect()
    }

    fn counts(table: &[u32]) -> HashMap<u32, u64> {
        let mut c = HashMap::new();
        for &id in table {
            *c.entry(id).or_insert(0) += 1;
        }
        c
    }

    /// Deterministic Fisher-Yates (xorshift), to avoid a rand dependency.
    fn shuffle<T>(v: &mut [T], mut state: u64) {
        for i in (1..v.len()).rev() {
            state ^= state << 13;
            state ^= state >> 7;
            state ^= state << 17;
            v.swap(i, (state % (i as u64 + 1)) as usize);
        }
    }

    /// Maglev paper §3.4: choosing M > 100·N keeps the backends' shares within 1% of each
    /// other. Round-robin turns make it tighter: shares differ by at most one slot.
    #[test]
    fn equal_weights_shares_differ_by_one_slot_so_within_1pct_when_m_over_100n() {
        let cases = [
            (10, 1009),
            (100, 10007),
            (1, 65537),
            (2, 65537),
            (10, 65537),
        ]
        .into_iter()
        .chain([37, 100, 250, 655].map(|n| (n, 65537)));
        for (n, m) in cases {
            assert!(m > 100 * n);
            let k = keys(n as usize);
            let table = build(&equal(&k), m, 7).unwrap();
            let c = counts(&table);
            assert_eq!(c.len(), n as usize, "every backend gets slots, none stay 0");
            let (min, max) = (*c.values().min().unwrap(), *c.values().max().unwrap());
            assert!(max - min <= 1, "n={n} m={m}: min {min} max {max}");
            assert!((max - min) as f64 <= 0.01 * min as f64, "n={n} m={m}");
        }
    }

    fn assert_shares_proportional(weights: &[u32], m: u32) {
        let k = keys(weights.len());
        let backends: Vec<_> = (1..)
            .zip(&k)
            .zip(weights)
            .map(|((id, key), &weight)| MaglevBackend { id, key, weight })
            .collect();
        let table = build(&backends, m, 3).unwrap();
        let c = counts(&table);
        let total: f64 = weights.iter().map(|&w| f64::from(w)).sum();
        let n = weights.len() as f64;
        for b in &backends {
            let share = f64::from(b.weight) / total;
            let expected = f64::from(m) * share;
            let got = c.get(&b.id).copied().unwrap_or(0) as f64;
            // The bound proven in the module doc.
            assert!(
                got >= expected - 1.0 - 1e-9 && got <= expected + n * share + 1e-9,
                "{weights:?}: id {} got {got}, expected {expected}",
                b.id
            );
            if expected >= 100.0 {
                assert!((got - expected).abs() <= 0.01 * expected);
            }
        }
    }

    #[test]
    fn weights_give_proportional_shares_within_1pct() {
        assert_shares_proportional(&[1, 2, 3, 4], 65537);
        assert_shares_proportional(&[4, 3, 2, 1], 1009);
        assert_shares_proportional(&[1, 1000, 7, 50, 123_456], 65537);
        assert_shares_proportional(&[u32::MAX, 1, u32::MAX / 2, u32::MAX], 65537);
        let mut state = 0x1234_5678u32;
        let random: Vec<u32> = (0..500)
            .map(|_| {
                state = state.wrapping_mul(1_664_525).wrapping_add(1_013_904_223);
                state % 100 + 1
            })
            .collect();
        assert_shares_proportional(&random, 65537);
    }

    /// (slots changed, slots passed from one surviving backend to another).
    fn churn(old: &[u32], new: &[u32], survivors: &[u32]) -> (usize, usize) {
        let changed = diff(old, new).count();
        let among_survivors = old
            .iter()
            .zip(new)
            .filter(|(o, n)| o != n && survivors.contains(o) && survivors.contains(n))
            .count();
        (changed, among_survivors)
    }

    /// Maglev is not minimally disruptive: besides the removed backend's 1/N of the slots,
    /// some slots swap between survivors. Asserted: total changed <= 1/N + 2% of M, of which
    /// changes between survivors <= 2% of M, and at least 0.95/N of M (the removed
    /// backend's own slots) move. Measured at M = 65537: survivor churn 0.3% at
    /// N = 10, 0.6% at N = 100, peaking near 1.0% at N ~ 400, 0.2% at N = 4000.
    #[test]
    fn removing_one_of_n_backends_moves_about_1_over_n_of_the_slots() {
        let m = 65537;
        for n in [10, 50, 100, 500] {
            let k = keys(n);
            let all = equal(&k);
            let before = build(&all, m, 11).unwrap();
            for removed in [0, n / 2, n - 1] {
                let rest: Vec<_> = all
                    .iter()
                    .copied()
                    .filter(|b| b.id != all[removed].id)
                    .collect();
                let after = build(&rest, m, 11).unwrap();
                assert!(!after.contains(&all[removed].id));
                let ids: Vec<u32> = rest.iter().map(|b| b.id).collect();
                let (changed, among) = churn(&before, &after, &ids);
                let frac = changed as f64 / f64::from(m);
                assert!(frac <= 1.0 / n as f64 + 0.02, "n={n}: changed {frac}");
                // Every slot of the removed backend moves, and it had its ~1/N share.
                let had = before.iter().filter(|&&b| b == all[removed].id).count();
                assert!(changed >= had, "n={n}: changed {changed} < its {had} slots");
                assert!(frac >= 0.95 / n as f64, "n={n}: changed only {frac}");
                assert!(
                    among as f64 <= 0.02 * f64::from(m),
                    "n={n}: among survivors {among}"
                );
            }
        }
    }

    /// Mirror of the removal case: the new backend takes ~1/(N+1) and survivors swap <= 2%.
    #[test]
    fn adding_one_backend_moves_about_1_over_n_of_the_slots() {
        let m = 65537;
        for n in [10, 50, 100, 500] {
            let k = keys(n + 1);
            let all = equal(&k);
            let before = build(&all[..n], m, 11).unwrap();
            let after = build(&all, m, 11).unwrap();
            let ids: Vec<u32> = all[..n].iter().map(|b| b.id).collect();
            let (changed, among) = churn(&before, &after, &ids);
            let frac = changed as f64 / f64::from(m);
            assert!(frac <= 1.0 / (n + 1) as f64 + 0.02, "n={n}: changed {frac}");
            // The new backend takes its ~1/(N+1) share, every slot of it a change.
            let took = after.iter().filter(|&&b| b == all[n].id).count();
            assert!(
                changed >= took,
                "n={n}: changed {changed} < its {took} slots"
            );
            assert!(frac >= 0.95 / (n + 1) as f64, "n={n}: changed only {frac}");
            assert!(
                among as f64 <= 0.02 * f64::from(m),
                "n={n}: among survivors {among}"
            );
        }
    }

    #[test]
    fn table_ignores_input_order() {
        let k = keys(200);
        let mut backends: Vec<_> = (1..)
            .zip(&k)
            .map(|(id, key)| MaglevBackend {
                id,
                key,
                weight: id % 5 + 1,
            })
            .collect();
        let reference = build(&backends, 65537, 5).unwrap();
        for state in [1, 42, 0xdead_beef] {
            shuffle(&mut backends, state);
            assert_eq!(build(&backends, 65537, 5).unwrap(), reference);
        }
    }

    fn key_of<'a>(backends: &[MaglevBackend<'a>]) -> HashMap<u32, &'a str> {
        backends.iter().map(|b| (b.id, b.key)).collect()
    }

    #[test]
    fn table_depends_on_keys_not_ids() {
        let k = keys(100);
        let a = equal(&k);
        let mut ids: Vec<u32> = a.iter().map(|b| b.id + 1000).collect();
        shuffle(&mut ids, 9);
        let b: Vec<_> = a
            .iter()
            .zip(&ids)
            .map(|(x, &id)| MaglevBackend { id, ..*x })
            .collect();
        let (ka, kb) = (key_of(&a), key_of(&b));
        let ta = build(&a, 65537, 1).unwrap();
        let tb = build(&b, 65537, 1).unwrap();
        assert!(ta.iter().zip(&tb).all(|(x, y)| ka[x] == kb[y]));
    }

    #[test]
    fn same_seed_same_table_other_seed_other_table() {
        let k = keys(20);
        let b = equal(&k);
        assert_eq!(build(&b, 65537, 1).unwrap(), build(&b, 65537, 1).unwrap());
        assert_ne!(build(&b, 65537, 1).unwrap(), build(&b, 65537, 2).unwrap());
    }

    #[test]
    fn weight_zero_backends_are_excluded() {
        let k = keys(10);
        let mut b = equal(&k);
        let without: Vec<_> = b.iter().copied().filter(|x| x.id % 3 != 0).collect();
        for x in b.iter_mut().filter(|x| x.id % 3 == 0) {
            x.weight = 0;
        }
        let table = build(&b, 65537, 4).unwrap();
        assert!(table.iter().all(|id| id % 3 != 0));
        assert_eq!(table, build(&without, 65537, 4).unwrap());
    }

    #[test]
    fn all_zero_weights_or_no_backends_give_all_zero_table() {
        let k = keys(5);
        let mut b = equal(&k);
        b.iter_mut().for_each(|x| x.weight = 0);
        assert_eq!(build(&b, 1009, 0).unwrap(), vec![0; 1009]);
        assert_eq!(build(&[], 65537, 0).unwrap(), vec![0; 65537]);
    }

    #[test]
    fn rejects_ring_sizes_not_prime_or_too_large() {
        for m in [0, 1, 4, 65536, 65535] {
            assert_eq!(build(&[], m, 0), Err(MaglevError::RingSizeNotPrime(m)));
        }
        for m in [65539, 131071, u32::MAX] {
            assert_eq!(build(&[], m, 0), Err(MaglevError::RingSizeTooLarge(m)));
        }
        let msg = MaglevError::RingSizeNotPrime(4).to_string();
        assert!(msg.contains("not prime") && msg.contains("65537"), "{msg}");
    }

    #[test]
    fn rejects_more_active_backends_than_slots() {
        let k = keys(8);
        let mut b = equal(&k);
        assert_eq!(
            build(&b, 7, 0),
            Err(MaglevError::RingTooSmall {
                backends: 8,
                ring_size: 7
            })
        );
        b[0].weight = 0;
        assert_eq!(counts(&build(&b, 7, 0).unwrap()).len(), 7);
    }

    #[test]
    fn rejects_duplicate_keys_and_ids() {
        let b = |id, key| MaglevBackend { id, key, weight: 1 };
        assert_eq!(
            build(&[b(1, "a"), b(2, "b"), b(3, "a")], 1009, 0),
            Err(MaglevError::DuplicateKey("a".into()))
        );
        // Draining backends still own their ids, so they count too.
        assert_eq!(
            build(
                &[
                    b(2, "b"),
                    MaglevBackend {
                        weight: 0,
                        ..b(5, "c")
                    },
                    b(5, "a")
                ],
                1009,
                0
            ),
            Err(MaglevError::DuplicateId {
                id: 5,
                first: "a".into(),
                second: "c".into()
            })
        );
    }

    #[test]
    fn rejects_id_zero_and_ids_beyond_max_backends() {
        let b = |id| {
            [MaglevBackend {
                id,
                key: "k",
                weight: 1,
            }]
        };
        assert_eq!(
            build(&b(0), 1009, 0),
            Err(MaglevError::ZeroId { key: "k".into() })
        );
        assert_eq!(
            build(&b(MAX_BACKENDS), 1009, 0),
            Err(MaglevError::IdOutOfRange {
                key: "k".into(),
                id: MAX_BACKENDS
            })
        );
        assert!(build(&b(MAX_BACKENDS - 1), 1009, 0).is_ok());
    }

    #[test]
    fn is_prime_matches_a_sieve_and_known_values() {
        const LIMIT: usize = 100_000;
        let mut sieve = vec![true; LIMIT];
        sieve[0] = false;
        sieve[1] = false;
        for i in 2..LIMIT {
            if sieve[i] {
                (i * i..LIMIT).step_by(i).for_each(|j| sieve[j] = false);
            }
        }
        for (n, &p) in sieve.iter().enumerate() {
            assert_eq!(is_prime(n as u32), p, "{n}");
        }
        assert!(is_prime(4_294_967_291)); // largest u32 prime
        assert!(!is_prime(u32::MAX));
        assert!(!is_prime(65_521 * 65_519)); // product of two large primes
    }

    #[test]
    fn diff_yields_exactly_the_changed_slots() {
        let old = [1, 2, 3, 4, 5];
        let new = [1, 9, 3, 4, 7];
        assert_eq!(diff(&old, &new).collect::<Vec<_>>(), [(1, 9), (4, 7)]);
        assert_eq!(diff(&old, &old).count(), 0);
        assert_eq!(
            diff(&old[..3], &new).collect::<Vec<_>>(),
            [(1, 9), (3, 4), (4, 7)]
        );

        let k = keys(30);
        let all = equal(&k);
        let before = build(&all, 65537, 2).unwrap();
        let after = build(&all[1..], 65537, 2).unwrap();
        let mut patched = before.clone();
        for (slot, id) in diff(&before, &after) {
            assert_ne!(before[slot as usize], id);
            patched[slot as usize] = id;
        }
        assert_eq!(patched, after);
    }
}
