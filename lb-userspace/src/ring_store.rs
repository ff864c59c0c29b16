//! The rings' slot history across a daemon replaced without its pinned maps.
//!
//! Second-chance VIPs keep no per-flow state at the LB: what finds a stream after its slot
//! moved is the slot's history, which lives in the ring map. A daemon that exits with
//! `keep_dataplane_on_exit = false` unpins that map, and the next one would start every
//! ring without history, so streams whose slot moved before the replacement would be lost.
//! So the exiting daemon writes each VIP's live ring to a file beside its state file, and a
//! daemon that starts with fresh maps publishes its first table of a VIP as the next table
//! after the saved ring (`ring_history::next`), then removes the file (a file left from an
//! older run must not seed a later start).
//!
//! The format is this build's own (checked by a header with `LAYOUT_VERSION`): per VIP its
//! key, slot count and slots, little endian.

use std::path::{Path, PathBuf};

use anyhow::{bail, Context, Result};
use lb_common::{RingSlot, VipKey, LAYOUT_VERSION, RING_HISTORY, RING_SIZE_MAX};

const MAGIC: &[u8; 8] = b"SLRINGS\n";

/// Each VIP's key and live ring.
pub type Rings = Vec<(VipKey, Vec<RingSlot>)>;

/// Where the rings of a daemon whose state file is `state_file` are kept.
pub fn path_for(state_file: &Path) -> PathBuf {
    state_file.with_extension("rings")
}

/// Writes `rings` to `path`, a private file (`private_file::write`).
pub fn save(path: &Path, rings: &Rings) -> Result<()> {
    let mut out = MAGIC.to_vec();
    out.extend_from_slice(&LAYOUT_VERSION.to_le_bytes());
    out.extend_from_slice(&(rings.len() as u32).to_le_bytes());
    for (key, ring) in rings {
        for w in key.addr {
            out.extend_from_slice(&w.to_le_bytes());
        }
        out.extend_from_slice(&key.port.to_le_bytes());
        out.extend_from_slice(&[key.proto, key.family]);
        out.extend_from_slice(&(ring.len() as u32).to_le_bytes());
        for s in ring {
            out.extend_from_slice(&s.backend.to_le_bytes());
            for p in s.previous {
                out.extend_from_slice(&p.to_le_bytes());
            }
            out.extend_from_slice(&s.changed.to_le_bytes());
        }
    }
    crate::private_file::write(path, &out).with_context(|| format!("writing {}", path.display()))
}

/// Reads what [`save`] wrote; `Ok(None)` when there is no such file.
pub fn load(path: &Path) -> Result<Option<Rings>> {
    let bytes = match std::fs::read(path) {
        Ok(b) => b,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(None),
        Err(e) => return Err(e).with_context(|| format!("reading {}", path.display())),
    };
    parse(&bytes)
        .map(Some)
        .with_context(|| format!("{} is not a ring file of this build", path.display()))
}

fn parse(bytes: &[u8]) -> Result<Rings> {
    let mut r = Reader(bytes);
    if r.take(MAGIC.len())? != MAGIC {
        bail!("no ring file header");
    }
    let layout = r.u32()?;
    if layout != LAYOUT_VERSION {
        bail!("layout version {layout}, this build reads {LAYOUT_VERSION}");
    }
    let n = r.u32()?;
    let mut rings = Vec::new();
    for _ in 0..n {
        let mut key = VipKey::default();
        for w in key.addr.iter_mut() {
            *w = r.u32()?;
        }
        key.port = r.u16()?;
        key.proto = r.take(1)?[0];
        key.family = r.take(1)?[0];
        let len = r.u32()?;
        if len > RING_SIZE_MAX {
            bail!("a ring of {len} slots (at most {RING_SIZE_MAX})");
        }
        let mut ring = Vec::with_capacity(len as usize);
        for _ in 0..len {
            let backend = r.u16()?;
            let mut previous = [0; RING_HISTORY];
            for p in previous.iter_mut() {
                *p = r.u16()?;
            }
            ring.push(RingSlot {
                backend,
                previous,
                changed: r.u32()?,
            });
        }
        rings.push((key, ring));
    }
    if !r.0.is_empty() {
        bail!("{} bytes after the last ring", r.0.len());
    }
    Ok(rings)
}

struct Reader<'a>(&'a [u8]);

impl Reader<'_> {
    fn take(&mut self, n: usize) -> Result<&[u8]> {
        if self.0.len() < n {
            bail!("cut short");
        }
        let (head, rest) = self.0.split_at(n);
        self.0 = rest;
        Ok(head)
    }

    fn u16(&mut self) -> Result<u16> {
        Ok(u16::from_le_bytes(self.take(2)?.try_into()?))
    }

    fn u32(&mut self) -> Result<u32> {
        Ok(u32::from_le_bytes(self.take(4)?.try_into()?))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::test_dir::TestDir;

    fn rings() -> Rings {
        let key = VipKey {
            addr: [0x0a00_0001, 0, 0, 0],
            port: 443u16.to_be(),
            proto: 6,
            family: 4,
        };
        let slots = vec![
            RingSlot {
                backend: 3,
                previous: [2, 1, 0],
                changed: 7,
            },
            RingSlot {
                backend: 1,
                previous: [0; RING_HISTORY],
                changed: 0,
            },
        ];
        vec![(key, slots), (VipKey::default(), Vec::new())]
    }

    #[test]
    fn saved_rings_read_back_the_same() {
        let dir = TestDir::new("rings-same");
        let path = path_for(&dir.join("state.json"));
        assert_eq!(path, dir.join("state.rings"));
        assert!(load(&path).unwrap().is_none(), "no file: nothing to seed");
        save(&path, &rings()).unwrap();
        assert_eq!(load(&path).unwrap().unwrap(), rings());
    }

    /// The rings are 0600 like the state file, also where the umask would let anyone read.
    #[test]
    fn saved_rings_are_private_under_any_umask() {
        use std::os::unix::fs::MetadataExt;
        let dir = TestDir::new("rings-umask");
        let path = dir.join("state.rings");
        // SAFETY: umask cannot fail; the previous one is put back.
        let old = unsafe { libc::umask(0) };
        let saved = save(&path, &rings());
        unsafe { libc::umask(old) };
        saved.unwrap();
        assert_eq!(std::fs::metadata(&path).unwrap().mode() & 0o777, 0o600);
    }

    /// A link planted at the temporary does not redirect the write.
    #[test]
    fn a_link_at_the_temporary_is_not_followed() {
        let dir = TestDir::new("rings-link");
        let victim = dir.join("victim");
        std::fs::write(&victim, b"precious").unwrap();
        std::os::unix::fs::symlink(&victim, dir.join("state.rings.tmp")).unwrap();
        save(&dir.join("state.rings"), &rings()).unwrap();
        assert_eq!(std::fs::read(&victim).unwrap(), b"precious");
        assert_eq!(load(&dir.join("state.rings")).unwrap().unwrap(), rings());
    }

    #[test]
    fn a_cut_or_foreign_file_is_refused_whole() {
        let dir = TestDir::new("rings-refused");
        let path = dir.join("state.rings");
        save(&path, &rings()).unwrap();
        let good = std::fs::read(&path).unwrap();
        for (what, bytes) in [
            ("cut", good[..good.len() - 1].to_vec()),
            ("longer", [good.clone(), vec![0]].concat()),
            ("other layout", {
                let mut b = good.clone();
                b[8] = b[8].wrapping_add(1);
                b
            }),
            ("not ours", b"{}".to_vec()),
        ] {
            std::fs::write(&path, &bytes).unwrap();
            let err = format!("{:#}", load(&path).unwrap_err());
            assert!(
                err.contains("not a ring file of this build"),
                "{what}: {err}"
            );
        }
    }
}
