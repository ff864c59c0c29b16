//! Files only the daemon's user may read: the audit log (who changed what, when) and the
//! state file (every VIP and backend, with runtime changes). Both are created 0600, and an
//! existing one with group or other bits (written by an older release as 0644) is narrowed
//! to 0600 when next written.

use std::{
    fs::{File, OpenOptions, Permissions},
    io::{self, Write},
    os::unix::fs::{OpenOptionsExt, PermissionsExt},
    path::Path,
};

/// The mode of every private file.
pub const MODE: u32 = 0o600;

fn narrow(f: &File) -> io::Result<()> {
    if f.metadata()?.permissions().mode() & 0o777 != MODE {
        f.set_permissions(Permissions::from_mode(MODE))?;
    }
    Ok(())
}

/// Creates or replaces `path` with `bytes`.
pub fn write(path: &Path, bytes: &[u8]) -> io::Result<()> {
    let mut f = OpenOptions::new()
        .write(true)
        .create(true)
        .truncate(true)
        .mode(MODE)
        .open(path)?;
    narrow(&f)?;
    f.write_all(bytes)
}

/// Opens `path` for appending, creating it.
pub fn append(path: &Path) -> io::Result<File> {
    let f = OpenOptions::new()
        .create(true)
        .append(true)
        .mode(MODE)
        .open(path)?;
    narrow(&f)?;
    Ok(f)
}

#[cfg(test)]
mod tests {
    use std::{fs, os::unix::fs::MetadataExt};

    use super::*;

    #[test]
    fn created_and_existing_files_end_up_0600() {
        let dir = crate::test_dir::TestDir::new("private");
        let (a, b) = (dir.join("state.json"), dir.join("audit.jsonl"));
        write(&a, b"{}").unwrap();
        writeln!(append(&b).unwrap(), "x").unwrap();
        for p in [&a, &b] {
            assert_eq!(
                fs::metadata(p).unwrap().mode() & 0o777,
                0o600,
                "{}",
                p.display()
            );
            fs::set_permissions(p, Permissions::from_mode(0o644)).unwrap();
        }
        write(&a, b"{}").unwrap();
        writeln!(append(&b).unwrap(), "y").unwrap();
        for p in [&a, &b] {
            assert_eq!(
                fs::metadata(p).unwrap().mode() & 0o777,
                0o600,
                "{}",
                p.display()
            );
        }
        assert_eq!(fs::read_to_string(&b).unwrap(), "x\ny\n");
    }
}
