//! Ring slots that remember: how a VIP's published ring carries each slot's previous
//! backends into the next table.
//!
//! When a slot changes owner, its old owner goes to the front of `previous` (the new owner
//! and duplicates leave it, the oldest falls off beyond `RING_HISTORY`) and the slot is
//! stamped with the VIP's next table generation. The result depends only on the sequence of
//! tables, never on clocks or ids of the host, so LB hosts that publish the same tables hold
//! the same history. A flow survives `RING_HISTORY` changes of its slot while it lives
//! (more, when the slot comes back to an owner it remembers).

use lb_common::{RingSlot, RING_HISTORY};

/// The generation of a ring: that of its most recent change (0 for a VIP's first table).
pub fn generation(ring: &[RingSlot]) -> u32 {
    ring.iter().map(|s| s.changed).max().unwrap_or(0)
}

/// A VIP's first table (or one whose slots mean something else than the live ring's, after
/// a ring-size change): no slot has a history.
pub fn first(table: &[u32]) -> Vec<RingSlot> {
    table
        .iter()
        .map(|&id| RingSlot {
            backend: slot_id(id),
            ..RingSlot::default()
        })
        .collect()
}

/// The ring that follows `live` when `table` is published: unchanged slots keep their
/// history; a slot with a new owner puts its old one first in `previous`, stamped with the
/// next generation. A table equal to the live one gives back the live ring unchanged.
pub fn next(live: &[RingSlot], table: &[u32]) -> Vec<RingSlot> {
    debug_assert_eq!(live.len(), table.len());
    let gen = generation(live).wrapping_add(1);
    live.iter()
        .zip(table)
        .map(|(s, &id)| {
            if u32::from(s.backend) == id {
                *s
            } else {
                RingSlot {
                    backend: slot_id(id),
                    previous: remembered(s, slot_id(id)),
                    changed: gen,
                }
            }
        })
        .collect()
}

/// The previous owners of slot `s` once `new` takes it: its owner, then its own previous
/// ones, without `new`, unset ids or repeats (a backend named twice would waste a hop).
fn remembered(s: &RingSlot, new: u16) -> [u16; RING_HISTORY] {
    let mut out = [0; RING_HISTORY];
    let mut n = 0;
    for id in core::iter::once(s.backend).chain(s.previous) {
        if n < RING_HISTORY && id != 0 && id != new && !out[..n].contains(&id) {
            out[n] = id;
            n += 1;
        }
    }
    out
}

/// Backend ids are below `MAX_BACKENDS` (checked when the Maglev table is built), which
/// fits the slot's 16 bits.
fn slot_id(id: u32) -> u16 {
    debug_assert!(id < lb_common::MAX_BACKENDS);
    id as u16
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::maglev::{build, MaglevBackend};

    fn slot(backend: u16, previous: [u16; 3], changed: u32) -> RingSlot {
        RingSlot {
            backend,
            previous,
            changed,
        }
    }

    #[test]
    fn a_first_table_has_no_history() {
        assert_eq!(
            first(&[1, 2, 0]),
            vec![slot(1, [0; 3], 0), slot(2, [0; 3], 0), slot(0, [0; 3], 0)]
        );
        assert_eq!(generation(&first(&[1, 2])), 0);
    }

    #[test]
    fn a_changed_slot_names_its_old_owner_and_the_new_generation() {
        let g0 = first(&[1, 2, 3]);
        let g1 = next(&g0, &[1, 4, 3]);
        assert_eq!(
            g1,
            vec![
                slot(1, [0; 3], 0),
                slot(4, [2, 0, 0], 1),
                slot(3, [0; 3], 0)
            ]
        );
        assert_eq!(generation(&g1), 1);
        // The next change of another slot keeps this one's history.
        let g2 = next(&g1, &[5, 4, 3]);
        assert_eq!(
            g2,
            vec![
                slot(5, [1, 0, 0], 2),
                slot(4, [2, 0, 0], 1),
                slot(3, [0; 3], 0)
            ]
        );
        // Each further change of a slot puts its old owner first; beyond three the oldest
        // is forgotten.
        let g3 = next(&g2, &[5, 6, 3]);
        assert_eq!(g3[1], slot(6, [4, 2, 0], 3));
        let g4 = next(&g3, &[5, 7, 3]);
        assert_eq!(g4[1], slot(7, [6, 4, 2], 4));
        let g5 = next(&g4, &[5, 8, 3]);
        assert_eq!(
            g5[1],
            slot(8, [7, 6, 4], 5),
            "2, four owners ago, is forgotten"
        );
    }

    #[test]
    fn an_unchanged_table_is_the_same_ring_and_the_same_generation() {
        let g1 = next(&first(&[1, 2]), &[2, 2]);
        assert_eq!(next(&g1, &[2, 2]), g1);
        assert_eq!(generation(&next(&g1, &[2, 2])), 1);
    }

    #[test]
    fn a_slot_that_flaps_back_names_the_owner_it_just_had() {
        // Flows that began under 2 are on 2; those from before are on 1 and were already
        // reached through 2's previous until now, so 2 is the owner worth naming.
        let g1 = next(&first(&[1]), &[2]);
        assert_eq!(next(&g1, &[1]), vec![slot(1, [2, 0, 0], 2)]);
    }

    #[test]
    fn a_slot_names_each_backend_once_and_never_its_owner() {
        // 1 -> 2 -> 3 -> 1 -> 2: the owner leaves the list, a returning one moves to the
        // front, so three distinct owners fit where five changes happened.
        let mut ring = first(&[1]);
        for id in [2, 3, 1, 2] {
            ring = next(&ring, &[id]);
        }
        assert_eq!(ring, vec![slot(2, [1, 3, 0], 4)]);
        // A slot emptied (0) and refilled names no unset backend.
        let r = next(&next(&first(&[1]), &[0]), &[2]);
        assert_eq!(r, vec![slot(2, [1, 0, 0], 2)]);
    }

    #[test]
    fn hosts_publishing_the_same_tables_hold_the_same_rings() {
        let keys: Vec<String> = (0..6).map(|i| format!("10.0.0.{i}:8000")).collect();
        let tables: Vec<Vec<u32>> = (0..6)
            .map(|round| {
                let bs: Vec<MaglevBackend> = (1..)
                    .zip(&keys)
                    .map(|(id, key)| MaglevBackend {
                        id,
                        key,
                        // Weights shift every round, one backend drains in round 3.
                        weight: if round == 3 && id == 2 {
                            0
                        } else {
                            1 + (id + round) % 3
                        },
                    })
                    .collect();
                build(&bs, 251, 7).unwrap()
            })
            .collect();
        let replay = |from: usize| {
            let mut ring = first(&tables[from]);
            for t in &tables[from + 1..] {
                ring = next(&ring, t);
            }
            ring
        };
        let a = replay(0);
        assert_eq!(
            a,
            replay(0),
            "the history is a function of the tables alone"
        );
        assert_eq!(generation(&a), 5);
        // Every slot's owner is the last table's, and every changed slot names first the
        // owner it had in the table before its change, and never its own owner.
        for (i, s) in a.iter().enumerate() {
            assert_eq!(u32::from(s.backend), tables[5][i]);
            if s.changed > 0 {
                let before = &tables[s.changed as usize - 1];
                assert_eq!(u32::from(s.previous[0]), before[i], "slot {i}");
                assert!(!s.previous.contains(&s.backend), "slot {i}");
            }
        }
        // A host that starts later has history only from its own first table.
        assert_ne!(replay(2), a);
        assert_eq!(generation(&replay(2)), 3);
    }
}
