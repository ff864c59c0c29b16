//! Files only the daemon's user may read and nobody else may redirect: the audit log (who
//! changed what, when), the state file (every VIP and backend, with runtime changes) and the
//! saved rings beside it.
//!
//! The daemon writes them as root, so a link or file another user planted at one of their
//! names must not turn a write into one of some other file. Each write opens the file's
//! directory once, without following a link, and refuses one that another user can write
//! ([`trust`]); a file is replaced through a temporary created there exclusively (never
//! through an existing name) and renamed within that directory; the audit log is appended to
//! only when it is a regular file of ours with one name. Every such file is 0600, whatever
//! the umask, and an existing one with group or other bits is narrowed to 0600.

use std::{
    ffi::{CString, OsStr},
    fs::{DirBuilder, File, Permissions},
    io::{self, Write},
    os::{
        fd::{AsRawFd, FromRawFd, OwnedFd},
        unix::{
            ffi::OsStrExt,
            fs::{DirBuilderExt, MetadataExt, PermissionsExt},
        },
    },
    path::{Path, PathBuf},
};

/// The mode of every private file.
pub const MODE: u32 = 0o600;

/// Why a directory is not safe to keep private files in, or None: it must be owned by root
/// or by us, not writable by others (sticky or not: a sticky directory still lets anyone
/// create a name not taken yet), and group-writable only by root's group or ours.
pub fn trust(dir: &Path, meta: &std::fs::Metadata) -> Result<(), String> {
    // SAFETY: geteuid and getegid cannot fail.
    let (uid, gid) = unsafe { (libc::geteuid(), libc::getegid()) };
    let mode = meta.mode() & 0o7777;
    let why = if meta.uid() != 0 && meta.uid() != uid {
        format!("is owned by uid {}", meta.uid())
    } else if mode & 0o002 != 0 {
        "is writable by every user".to_string()
    } else if mode & 0o020 != 0 && meta.gid() != 0 && meta.gid() != gid {
        format!("is writable by group {}", meta.gid())
    } else {
        return Ok(());
    };
    Err(format!(
        "{} {why} (mode {mode:04o}): a link or file another user plants there could redirect \
         the daemon's writes; use a directory only root or the daemon's user can write \
         (e.g. chmod go-w, chown root, or the default under /var/lib/sluice)",
        dir.display()
    ))
}

/// [`trust`] for the directory that holds `file`, or, while it does not exist yet, for the
/// nearest one above it that does (the daemon creates the rest 0700).
pub fn check_dir(file: &Path) -> Result<(), String> {
    let mut dir = parent(file);
    loop {
        match std::fs::symlink_metadata(&dir) {
            Ok(meta) => return trust(&dir, &meta),
            Err(e) if e.kind() == io::ErrorKind::NotFound => match dir.parent() {
                Some(up) if !up.as_os_str().is_empty() => dir = up.to_path_buf(),
                _ => return Ok(()),
            },
            Err(e) => return Err(format!("{}: {e}", dir.display())),
        }
    }
}

fn parent(file: &Path) -> PathBuf {
    match file.parent() {
        Some(p) if !p.as_os_str().is_empty() => p.to_path_buf(),
        _ => PathBuf::from("."),
    }
}

fn cstr(name: &OsStr) -> io::Result<CString> {
    CString::new(name.as_bytes()).map_err(|_| io::Error::other("a file name with a NUL byte"))
}

fn cvt(r: libc::c_int) -> io::Result<libc::c_int> {
    if r < 0 {
        Err(io::Error::last_os_error())
    } else {
        Ok(r)
    }
}

/// The directory of `file`, opened once (created 0700 when missing, never through a link)
/// and trusted, with the file's name in it.
fn open_dir(file: &Path) -> io::Result<(OwnedFd, CString)> {
    let name = file
        .file_name()
        .ok_or_else(|| io::Error::other(format!("{} names no file", file.display())))?;
    let dir = parent(file);
    DirBuilder::new().recursive(true).mode(0o700).create(&dir)?;
    let path = cstr(dir.as_os_str())?;
    // SAFETY: a valid C string; the descriptor is owned below.
    let fd = cvt(unsafe {
        libc::open(
            path.as_ptr(),
            libc::O_RDONLY | libc::O_DIRECTORY | libc::O_NOFOLLOW | libc::O_CLOEXEC,
        )
    })
    .map_err(|e| io::Error::new(e.kind(), format!("opening {}: {e}", dir.display())))?;
    // SAFETY: a descriptor just opened and owned by nobody else.
    let fd = unsafe { OwnedFd::from_raw_fd(fd) };
    let meta = File::from(fd.try_clone()?).metadata()?;
    trust(&dir, &meta).map_err(io::Error::other)?;
    Ok((fd, cstr(name)?))
}

/// Opens `name` in `dir` with `flags` (never following a link, never blocking on a FIFO).
fn open_at(dir: &OwnedFd, name: &CString, flags: libc::c_int) -> io::Result<File> {
    // SAFETY: a valid directory descriptor and C string; the descriptor is owned below.
    let fd = cvt(unsafe {
        libc::openat(
            dir.as_raw_fd(),
            name.as_ptr(),
            flags | libc::O_NOFOLLOW | libc::O_NONBLOCK | libc::O_CLOEXEC,
            MODE as libc::c_uint,
        )
    })?;
    // SAFETY: a descriptor just opened and owned by nobody else.
    Ok(unsafe { File::from_raw_fd(fd) })
}

fn narrow(f: &File) -> io::Result<()> {
    if f.metadata()?.permissions().mode() & 0o777 != MODE {
        f.set_permissions(Permissions::from_mode(MODE))?;
    }
    Ok(())
}

/// Creates or replaces `path` with `bytes`, through `<name>.tmp` beside it, so a reader sees
/// the old file or the new one, never half of one.
pub fn write(path: &Path, bytes: &[u8]) -> io::Result<()> {
    write_mode(path, bytes, MODE)
}

/// [`write()`] with another mode, for a file others read (the backend host's QUIC server IDs,
/// read by the host's QUIC servers), written as safely.
pub fn write_mode(path: &Path, bytes: &[u8], mode: u32) -> io::Result<()> {
    let (dir, name) = open_dir(path)?;
    let mut tmp = name.as_bytes().to_vec();
    tmp.extend_from_slice(b".tmp");
    let tmp = CString::new(tmp).expect("no NUL in a name that had none");
    // A temporary left by a crash, or planted: unlinkat removes the name (a link itself,
    // not its target), and O_EXCL then creates a new file or fails.
    // SAFETY: a valid directory descriptor and C string.
    if let Err(e) = cvt(unsafe { libc::unlinkat(dir.as_raw_fd(), tmp.as_ptr(), 0) }) {
        if e.kind() != io::ErrorKind::NotFound {
            return Err(e);
        }
    }
    let mut f = open_at(&dir, &tmp, libc::O_WRONLY | libc::O_CREAT | libc::O_EXCL)?;
    // The umask may have taken bits from the mode; the file gets exactly it.
    f.set_permissions(Permissions::from_mode(mode))?;
    f.write_all(bytes)?;
    drop(f);
    // SAFETY: a valid directory descriptor and C strings.
    cvt(unsafe {
        libc::renameat(
            dir.as_raw_fd(),
            tmp.as_ptr(),
            dir.as_raw_fd(),
            name.as_ptr(),
        )
    })?;
    Ok(())
}

/// Opens `path` for appending, creating it; refuses anything but a regular file of ours
/// with one name (a hard link to another file is not appended to).
pub fn append(path: &Path) -> io::Result<File> {
    let (dir, name) = open_dir(path)?;
    let f = open_at(&dir, &name, libc::O_WRONLY | libc::O_APPEND | libc::O_CREAT)?;
    let meta = f.metadata()?;
    // SAFETY: geteuid cannot fail.
    let uid = unsafe { libc::geteuid() };
    if !meta.file_type().is_file() || meta.uid() != uid || meta.nlink() != 1 {
        return Err(io::Error::other(format!(
            "{} is not a regular file of uid {uid} with one name (uid {}, {} names); \
             move it away and the daemon creates its own",
            path.display(),
            meta.uid(),
            meta.nlink()
        )));
    }
    narrow(&f)?;
    Ok(f)
}

#[cfg(test)]
mod tests {
    use std::{fs, os::unix::fs::symlink};

    use super::*;
    use crate::test_dir::TestDir;

    fn mode(p: &Path) -> u32 {
        fs::symlink_metadata(p).unwrap().mode() & 0o7777
    }

    #[test]
    fn created_and_existing_files_end_up_0600() {
        let dir = TestDir::new("private");
        let (a, b) = (dir.join("state.json"), dir.join("audit.jsonl"));
        write(&a, b"{}").unwrap();
        writeln!(append(&b).unwrap(), "x").unwrap();
        for p in [&a, &b] {
            assert_eq!(mode(p), 0o600, "{}", p.display());
            fs::set_permissions(p, Permissions::from_mode(0o644)).unwrap();
        }
        write(&a, b"{}").unwrap();
        writeln!(append(&b).unwrap(), "y").unwrap();
        for p in [&a, &b] {
            assert_eq!(mode(p), 0o600, "{}", p.display());
        }
        assert_eq!(fs::read_to_string(&b).unwrap(), "x\ny\n");
    }

    /// Links planted at the temporary and at the audit log point at a victim: the victim
    /// keeps its bytes and mode, the write goes to a file of its own or is refused.
    #[test]
    fn planted_links_never_redirect_a_write() {
        let dir = TestDir::new("private-links");
        let victim = dir.join("victim");
        fs::write(&victim, b"precious").unwrap();
        fs::set_permissions(&victim, Permissions::from_mode(0o644)).unwrap();
        let untouched = |what: &str| {
            assert_eq!(fs::read(&victim).unwrap(), b"precious", "{what}");
            assert_eq!(mode(&victim), 0o644, "{what}");
        };
        let audit = dir.join("audit.jsonl");
        symlink(&victim, &audit).unwrap();
        assert!(
            append(&audit).is_err(),
            "a link at the audit log is refused"
        );
        untouched("audit link");
        fs::remove_file(&audit).unwrap();
        fs::hard_link(&victim, &audit).unwrap();
        let err = append(&audit).unwrap_err().to_string();
        assert!(err.contains("move it away"), "{err}");
        untouched("audit hard link");
        for (file, tmp) in [
            ("state.json", "state.json.tmp"),
            ("state.rings", "state.rings.tmp"),
        ] {
            symlink(&victim, dir.join(tmp)).unwrap();
            write(&dir.join(file), b"new").unwrap();
            untouched(tmp);
            assert_eq!(fs::read(dir.join(file)).unwrap(), b"new");
            assert_eq!(mode(&dir.join(file)), 0o600);
            assert!(!dir.join(tmp).exists(), "{tmp} is renamed away");
        }
        // A link at the file itself is replaced, not followed.
        symlink(&victim, dir.join("swapped.json")).unwrap();
        write(&dir.join("swapped.json"), b"new").unwrap();
        untouched("a link at the file");
        assert!(fs::symlink_metadata(dir.join("swapped.json"))
            .unwrap()
            .is_file());
    }

    #[test]
    fn a_directory_others_can_write_is_refused_saying_what_to_do() {
        let dir = TestDir::new("private-shared");
        let shared = dir.join("shared");
        fs::create_dir(&shared).unwrap();
        for m in [0o777, 0o1777, 0o757] {
            fs::set_permissions(&shared, Permissions::from_mode(m)).unwrap();
            let file = shared.join("state.json");
            let err = check_dir(&file).unwrap_err();
            assert!(err.contains("writable by every user"), "{m:o}: {err}");
            assert!(err.contains("chmod go-w"), "{m:o}: {err}");
            let err = write(&file, b"{}").unwrap_err().to_string();
            assert!(err.contains("writable by every user"), "{m:o}: {err}");
            assert!(append(&shared.join("audit.jsonl")).is_err(), "{m:o}");
            // A directory not created yet is judged by the one it would be created in.
            assert!(check_dir(&shared.join("sub/state.json")).is_err(), "{m:o}");
        }
        fs::set_permissions(&shared, Permissions::from_mode(0o755)).unwrap();
        check_dir(&shared.join("state.json")).unwrap();
        check_dir(&shared.join("sub/deeper/state.json")).unwrap();
        write(&shared.join("sub/state.json"), b"{}").unwrap();
        assert_eq!(
            mode(&shared.join("sub")) & 0o077,
            0,
            "created without group or other bits"
        );
        // A link in place of the directory is not followed.
        symlink(&shared, dir.join("linked")).unwrap();
        assert!(write(&dir.join("linked/state.json"), b"{}").is_err());
    }
}
