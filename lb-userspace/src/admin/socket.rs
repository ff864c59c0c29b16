//! The admin socket: creating it with its mode and group, and who may use it.

use std::{
    ffi::{CStr, CString},
    fs, io,
    os::unix::fs::{FileTypeExt, PermissionsExt},
    path::{Path, PathBuf},
};

use anyhow::{bail, Context, Result};
use tokio::net::UnixListener;

use crate::controller::Peer;

/// Where and how the admin socket is created.
#[derive(Clone, Debug)]
pub struct AdminSocket {
    pub path: PathBuf,
    /// Permission bits, e.g. 0o660.
    pub mode: u32,
    /// Group given the socket (a name or a gid); its members may use the API.
    pub group: Option<String>,
}

/// Creates the socket: parent directory, stale socket removed, mode and group set.
pub fn bind(sock: &AdminSocket) -> Result<UnixListener> {
    let path = &sock.path;
    if let Some(dir) = path.parent() {
        fs::create_dir_all(dir).with_context(|| {
            format!(
                "creating {} for the admin socket: run as root or choose a writable socket path",
                dir.display()
            )
        })?;
    }
    remove_stale(path)?;
    let listener = UnixListener::bind(path).with_context(|| {
        format!(
            "binding the admin socket {}: run as root or choose a writable socket path",
            path.display()
        )
    })?;
    fs::set_permissions(path, fs::Permissions::from_mode(sock.mode))
        .with_context(|| format!("setting mode {:04o} on {}", sock.mode, path.display()))?;
    if let Some(group) = &sock.group {
        let gid = group_gid(group)?;
        std::os::unix::fs::chown(path, None, Some(gid)).with_context(|| {
            format!(
                "giving {} to group {group:?}: the daemon must run as root or be a member of it",
                path.display()
            )
        })?;
    }
    Ok(listener)
}

/// Removes a socket left by a daemon that is gone; refuses while one still listens.
fn remove_stale(path: &Path) -> Result<()> {
    let meta = match fs::symlink_metadata(path) {
        Ok(m) => m,
        Err(e) if e.kind() == io::ErrorKind::NotFound => return Ok(()),
        Err(e) => return Err(e).with_context(|| format!("checking {}", path.display())),
    };
    if !meta.file_type().is_socket() {
        bail!(
            "{} exists and is not a socket: remove it or choose another admin socket path",
            path.display()
        );
    }
    match std::os::unix::net::UnixStream::connect(path) {
        Ok(_) => bail!(
            "a daemon is already listening on {}: stop it first (`sluice status` shows it)",
            path.display()
        ),
        Err(e) if e.kind() == io::ErrorKind::ConnectionRefused => fs::remove_file(path)
            .with_context(|| format!("removing the stale socket {}", path.display())),
        Err(e) => bail!(
            "cannot tell whether a daemon listens on {} ({e}); remove it if none does",
            path.display()
        ),
    }
}

/// The gid of `group`, a name or a number.
fn group_gid(group: &str) -> Result<u32> {
    if let Ok(gid) = group.parse() {
        return Ok(gid);
    }
    let name = CString::new(group).context("the group name contains a NUL byte")?;
    lookup_group(&|grp, buf, len, res| {
        // SAFETY: every pointer is valid for the call; `len` is the length of `buf`.
        unsafe { libc::getgrnam_r(name.as_ptr(), grp, buf, len, res) }
    })
    .with_context(|| format!("looking up group {group:?}"))?
    .map(|(gid, _)| gid)
    .with_context(|| {
        format!(
            "group {group:?} does not exist: create it (groupadd --system {group}) or change the admin socket's group"
        )
    })
}

/// The name of group `gid`, if it has one.
pub(crate) fn group_name(gid: u32) -> Option<String> {
    lookup_group(&|grp, buf, len, res| {
        // SAFETY: every pointer is valid for the call; `len` is the length of `buf`.
        unsafe { libc::getgrgid_r(gid, grp, buf, len, res) }
    })
    .ok()
    .flatten()
    .map(|(_, name)| name)
}

type GetGroup<'a> =
    dyn Fn(*mut libc::group, *mut libc::c_char, usize, *mut *mut libc::group) -> libc::c_int + 'a;

/// Runs a getgr*_r call with a buffer that grows until the entry fits: (gid, name).
fn lookup_group(call: &GetGroup<'_>) -> io::Result<Option<(u32, String)>> {
    let mut buf: Vec<libc::c_char> = vec![0; 1024];
    loop {
        // SAFETY: `group` is plain data; all-zero is a valid value the call overwrites.
        let mut grp: libc::group = unsafe { std::mem::zeroed() };
        let mut res = std::ptr::null_mut();
        match call(&mut grp, buf.as_mut_ptr(), buf.len(), &mut res) {
            0 if res.is_null() => return Ok(None),
            0 => {
                // SAFETY: on success gr_name points to a NUL-terminated string in `buf`.
                let name = unsafe { CStr::from_ptr(grp.gr_name) };
                return Ok(Some((grp.gr_gid, name.to_string_lossy().into_owned())));
            }
            libc::ENOENT | libc::ESRCH => return Ok(None),
            libc::ERANGE if buf.len() < 1 << 20 => buf.resize(buf.len() * 2, 0),
            e => return Err(io::Error::from_raw_os_error(e)),
        }
    }
}

/// The API's second line of defence after the socket's mode: root, the socket's owner (the
/// daemon's user) and members of the socket's group. `groups` lists the peer's
/// supplementary groups; it is only read when the rest does not decide.
pub(super) fn may_administer(
    peer: &Peer,
    owner_uid: u32,
    group_gid: u32,
    groups: impl FnOnce() -> Vec<u32>,
) -> bool {
    peer.uid == 0 || peer.uid == owner_uid || peer.gid == group_gid || groups().contains(&group_gid)
}

/// Supplementary groups of process `pid`: SO_PEERCRED carries only the primary one.
pub(super) fn supplementary_groups(pid: i32) -> Vec<u32> {
    fs::read_to_string(format!("/proc/{pid}/status"))
        .ok()
        .and_then(|s| {
            s.lines().find_map(|l| {
                l.strip_prefix("Groups:").map(|g| {
                    g.split_whitespace()
                        .filter_map(|n| n.parse().ok())
                        .collect()
                })
            })
        })
        .unwrap_or_default()
}

#[cfg(test)]
mod tests {
    use std::os::unix::fs::MetadataExt;

    use super::*;
    use crate::test_dir::TestDir;

    #[test]
    fn bind_replaces_only_a_dead_socket() {
        let rt = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .unwrap();
        let _guard = rt.enter();
        let dir = TestDir::new("bind");
        let sock = AdminSocket {
            path: dir.join("a.sock"),
            mode: 0o600,
            group: None,
        };
        let live = bind(&sock).unwrap();
        assert_eq!(fs::metadata(&sock.path).unwrap().mode() & 0o777, 0o600);
        let e = bind(&sock).unwrap_err().to_string();
        assert!(e.starts_with("a daemon is already listening on"), "{e}");
        // A socket nobody listens on any more is replaced.
        drop(live);
        bind(&sock).unwrap();
        let file = AdminSocket {
            path: dir.join("file"),
            mode: 0o600,
            group: None,
        };
        fs::write(&file.path, "x").unwrap();
        let e = bind(&file).unwrap_err().to_string();
        assert!(
            e.ends_with(
                "exists and is not a socket: remove it or choose another admin socket path"
            ),
            "{e}"
        );
        let e = format!(
            "{:#}",
            bind(&AdminSocket {
                group: Some("no-such-group-sluice".into()),
                ..sock
            })
            .unwrap_err()
        );
        assert!(
            e.contains("group \"no-such-group-sluice\" does not exist: create it"),
            "{e}"
        );
    }

    #[test]
    fn who_may_administer() {
        let peer = |uid, gid| Peer { uid, gid, pid: 1 };
        let none = Vec::new;
        assert!(may_administer(&peer(0, 0), 500, 600, none), "root");
        assert!(
            may_administer(&peer(500, 1), 500, 600, none),
            "the socket's owner"
        );
        assert!(
            may_administer(&peer(1000, 600), 500, 600, none),
            "primary group"
        );
        assert!(
            may_administer(&peer(1000, 1000), 500, 600, || vec![27, 600]),
            "supplementary group"
        );
        assert!(
            !may_administer(&peer(1000, 1000), 500, 600, || vec![27]),
            "anyone else"
        );
    }
}
