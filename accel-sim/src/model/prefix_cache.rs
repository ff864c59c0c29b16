//! The prefix cache: full KV blocks keyed by their chained hashes, shared by the running
//! sequences that hold them and evicted least recently freed first, as vLLM's.

use std::{
    collections::hash_map::Entry,
    hash::{DefaultHasher, Hash, Hasher},
};

use super::{Engine, Seq, TokenId, BLOCK_TOKENS};

/// The hashes of a token sequence's full blocks, each chained over the one before, as vLLM's
/// `hash_block_tokens(parent_block_hash, curr_block_token_ids)`; the first block's parent is
/// a fixed root (vLLM's `NONE_HASH`).
pub(super) fn block_hashes(tokens: &[TokenId]) -> Vec<u64> {
    let mut parent = 0u64;
    tokens
        .chunks_exact(BLOCK_TOKENS as usize)
        .map(|block| {
            let mut h = DefaultHasher::new();
            (parent, block).hash(&mut h);
            parent = h.finish();
            parent
        })
        .collect()
}

/// A cached block.
#[derive(Debug)]
pub(super) struct Cached {
    /// Running sequences holding it; 0: evictable, with its place in the LRU order.
    refs: u32,
    stamp: u64,
}

impl Engine {
    /// The leading blocks of `s`'s context that are cached, short of its last token; and how
    /// many of them are evictable (taking those adds to the KV in use).
    pub(super) fn cache_hit(&self, s: &Seq) -> (usize, usize) {
        let most = ((s.context() - 1) / BLOCK_TOKENS) as usize;
        let mut revived = 0;
        let hit = s
            .hashes
            .iter()
            .take(most)
            .map_while(|h| self.cache.get(h))
            .inspect(|c| revived += usize::from(c.refs == 0))
            .count();
        (hit, revived)
    }

    /// Takes `s`'s first `hit` blocks from the cache: they count as computed.
    pub(super) fn take_cached(&mut self, s: &mut Seq, hit: usize) {
        for h in &s.hashes[..hit] {
            let c = self.cache.get_mut(h).expect("a hit is cached");
            if c.refs == 0 {
                self.lru.remove(&c.stamp);
                self.kv_used += BLOCK_TOKENS as u64;
            }
            c.refs += 1;
        }
        s.held = hit;
        s.computed = BLOCK_TOKENS * hit as u32;
        if s.cached.is_none() {
            s.cached = Some(s.computed);
            self.totals.prefix_cache_queries += s.context() as u64;
            self.totals.prefix_cache_hits += s.computed as u64;
        }
    }

    /// `s` leaves the running set: its KV is freed, its full computed blocks stay cached
    /// and evictable, the last first in the LRU order.
    pub(super) fn release(&mut self, s: &mut Seq) {
        self.kv_used -= s.private();
        let full = ((s.computed / BLOCK_TOKENS) as usize).min(s.hashes.len());
        for (i, &h) in s.hashes[..full].iter().enumerate().rev() {
            let stamp = self.next_stamp;
            if i < s.held {
                let c = self.cache.get_mut(&h).expect("a held block is cached");
                c.refs -= 1;
                if c.refs > 0 {
                    continue;
                }
                c.stamp = stamp;
                self.kv_used -= BLOCK_TOKENS as u64;
            } else if let Entry::Vacant(e) = self.cache.entry(h) {
                e.insert(Cached { refs: 0, stamp });
            } else {
                // Another sequence cached the same block meanwhile: this copy is freed.
                continue;
            }
            self.lru.insert(stamp, h);
            self.next_stamp += 1;
        }
        s.computed = 0;
        s.held = 0;
    }

    /// Evicts cached blocks, least recently freed first, until `needed` more tokens fit.
    pub(super) fn evict_for(&mut self, needed: u64) {
        let cap = self.params.kv_capacity_tokens;
        while self.kv_used + needed + self.evictable_tokens() > cap {
            let Some((_, h)) = self.lru.pop_first() else {
                break;
            };
            self.cache.remove(&h);
        }
    }
}
