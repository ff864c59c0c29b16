//! `TENANT_V4`: the tenant of every IPv4 /24 that the client prefixes answer alike for all of
//! its clients, so that a new IPv4 session finds its tenant in one array read. A /24 with a
//! longer prefix inside is left to the trie (`TENANT_V4_ASK_TRIE`), which keeps every prefix.

use std::{collections::BTreeMap, net::IpAddr, os::fd::AsRawFd, ptr::NonNull};

use crate::config::Cidr;
use anyhow::{bail, Result};
use lb_common::{TENANT_V4_ASK_TRIE, TENANT_V4_WORDS};

/// IPv4 /24s: the table's bytes.
const BLOCKS: usize = 1 << 24;
const BYTES: usize = TENANT_V4_WORDS as usize * 8;

/// The table for these prefixes, a byte per /24 (`lb_common::tenant_v4_slot` orders them):
/// the tenant + 1 of the longest prefix of /24 or shorter that covers it (the default tenant
/// 0 where none does), or `TENANT_V4_ASK_TRIE` where a longer prefix lies inside it.
fn table(prefixes: &BTreeMap<Cidr, u32>) -> Vec<u8> {
    let v4: Vec<(u32, u8, u32)> = prefixes
        .iter()
        .filter_map(|(c, &tenant)| match c.addr {
            IpAddr::V4(a) => Some((u32::from(a), c.prefix, tenant)),
            IpAddr::V6(_) => None,
        })
        .collect();
    let mut t = vec![1u8; BLOCKS];
    // Shorter prefixes first, so a longer one inside overwrites its part.
    for len in 0..=24 {
        for &(addr, _, tenant) in v4.iter().filter(|p| p.1 == len) {
            let first = (addr >> 8) as usize;
            let byte = (tenant & (lb_common::MAX_TENANTS - 1)) as u8 + 1;
            t[first..first + (1 << (24 - len))].fill(byte);
        }
    }
    for &(addr, _, _) in v4.iter().filter(|p| p.1 > 24) {
        t[(addr >> 8) as usize] = TENANT_V4_ASK_TRIE;
    }
    t
}

/// The map, memory-mapped: the table is 16 MiB, and only the words that change are written.
pub struct TenantV4Map {
    words: NonNull<u64>,
    /// The prefixes the mapped table was last written for: a sync with the same ones (every
    /// change of weights or flags brings the tenants along) writes nothing and computes
    /// nothing.
    written_for: Option<BTreeMap<Cidr, u32>>,
}

// The mapping is owned by this value alone and only written through `&mut self`.
unsafe impl Send for TenantV4Map {}

impl TenantV4Map {
    /// Maps the array behind `fd` (created with `BPF_F_MMAPABLE`, `TENANT_V4_WORDS` words).
    pub fn map(fd: &impl AsRawFd) -> Result<TenantV4Map> {
        let p = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                BYTES,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_SHARED,
                fd.as_raw_fd(),
                0,
            )
        };
        if p == libc::MAP_FAILED {
            bail!(
                "mapping TENANT_V4 into memory: {}",
                std::io::Error::last_os_error()
            );
        }
        Ok(TenantV4Map {
            words: NonNull::new(p.cast()).expect("mmap never returns null on success"),
            written_for: None,
        })
    }

    /// Brings the mapped table to [`table`]`(prefixes)`; returns the words written. The
    /// first sync compares every word (a reused map holds a previous run's table).
    pub fn sync(&mut self, prefixes: &BTreeMap<Cidr, u32>) -> usize {
        if self.written_for.as_ref() == Some(prefixes) {
            return 0;
        }
        let n = self.write(&table(prefixes));
        self.written_for = Some(prefixes.clone());
        n
    }

    /// Writes `table`; returns the words written. Each word is one aligned 8-byte store, so
    /// the data plane reads a /24's byte as it was or as it is, never torn.
    fn write(&mut self, table: &[u8]) -> usize {
        assert_eq!(table.len(), BYTES, "a TENANT_V4 table has a byte per /24");
        let mut n = 0;
        for (i, chunk) in table.chunks_exact(8).enumerate() {
            let want = u64::from_le_bytes(chunk.try_into().expect("chunks of 8"));
            // In bounds: `BYTES / 8` words are mapped.
            let w = unsafe { self.words.as_ptr().add(i) };
            if unsafe { w.read_volatile() } != want {
                unsafe { w.write_volatile(want) };
                n += 1;
            }
        }
        n
    }
}

impl Drop for TenantV4Map {
    fn drop(&mut self) {
        unsafe { libc::munmap(self.words.as_ptr().cast(), BYTES) };
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use lb_common::tenant_v4_slot;

    fn prefixes(list: &[(&str, u32)]) -> BTreeMap<Cidr, u32> {
        list.iter().map(|(c, t)| (c.parse().unwrap(), *t)).collect()
    }

    /// The byte the data plane reads for `addr`, as it reads it: word, then shift.
    fn lookup(t: &[u8], addr: &str) -> u8 {
        let a: std::net::Ipv4Addr = addr.parse().unwrap();
        let (word, shift) = tenant_v4_slot(u32::from(a));
        let w = u64::from_le_bytes(t[word as usize * 8..][..8].try_into().unwrap());
        (w >> shift) as u8
    }

    #[test]
    fn each_slash_24_holds_its_longest_covering_prefixs_tenant_plus_one() {
        let t = table(&prefixes(&[
            ("10.0.0.0/8", 1),
            ("10.7.0.0/16", 2),
            ("10.7.3.0/24", 3),
            ("0.0.0.0/1", 4),
        ]));
        assert_eq!(lookup(&t, "10.1.2.3"), 2, "the /8");
        assert_eq!(lookup(&t, "10.7.9.5"), 3, "the /16 inside it");
        assert_eq!(lookup(&t, "10.7.3.200"), 4, "the /24 inside that");
        assert_eq!(lookup(&t, "99.1.1.1"), 5, "the /1");
        assert_eq!(lookup(&t, "192.0.2.1"), 1, "no prefix: the default tenant");
    }

    #[test]
    fn a_slash_24_with_a_longer_prefix_inside_asks_the_trie_and_its_neighbours_do_not() {
        let t = table(&prefixes(&[("10.7.0.0/16", 2), ("10.7.3.16/28", 3)]));
        assert_eq!(lookup(&t, "10.7.3.20"), TENANT_V4_ASK_TRIE);
        assert_eq!(
            lookup(&t, "10.7.3.200"),
            TENANT_V4_ASK_TRIE,
            "the rest of that /24 too"
        );
        assert_eq!(lookup(&t, "10.7.2.255"), 3);
        assert_eq!(lookup(&t, "10.7.4.0"), 3);
    }

    #[test]
    fn ipv6_prefixes_leave_the_table_to_the_default_tenant() {
        let t = table(&prefixes(&[("2001:db8::/32", 2), ("::/0", 3)]));
        assert!(t.iter().all(|&b| b == 1));
    }
}
