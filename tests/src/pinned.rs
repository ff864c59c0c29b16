//! A pinned data plane seen from outside the process that runs it, as the upgrade tests see
//! it while one program replaces another: its counters and the program behind its pinned
//! link, read from bpffs, and frames handed to the interface it is attached to.

use std::{
    ffi::CString,
    os::fd::{AsRawFd, FromRawFd, OwnedFd},
    path::Path,
};

use aya::{
    maps::{Map, MapData, PerCpuArray},
    programs::links::{FdLink, PinnedLink},
};
use lb_common::stat::Counter;

/// The ifindex of interface `name` in the calling thread's namespace; panics if there is none.
pub fn ifindex(name: &str) -> u32 {
    let c = CString::new(name).unwrap();
    // SAFETY: a plain call with a NUL-terminated name.
    let i = unsafe { libc::if_nametoindex(c.as_ptr()) };
    assert_ne!(i, 0, "no interface {name}");
    i
}

/// Sends frames out of one interface through a raw packet socket (the socket keeps the
/// namespace it was opened in, so it may be used from any thread).
pub struct Injector {
    fd: OwnedFd,
    to: libc::sockaddr_ll,
}

impl Injector {
    pub fn new(ifindex: u32) -> Self {
        // SAFETY: socket(2); the result is checked before it is owned.
        let fd = unsafe { libc::socket(libc::AF_PACKET, libc::SOCK_RAW, 0) };
        assert!(
            fd >= 0,
            "packet socket: {}",
            std::io::Error::last_os_error()
        );
        // SAFETY: sockaddr_ll is plain data; all zeroes is a valid value.
        let mut to: libc::sockaddr_ll = unsafe { std::mem::zeroed() };
        to.sll_family = libc::AF_PACKET as u16;
        to.sll_ifindex = ifindex as i32;
        to.sll_halen = 6;
        Injector {
            // SAFETY: fd is a fresh descriptor owned by nothing else.
            fd: unsafe { OwnedFd::from_raw_fd(fd) },
            to,
        }
    }

    /// Whether the frame was handed to the peer (a full queue refuses it: ENOBUFS).
    pub fn send(&self, frame: &[u8]) -> bool {
        // SAFETY: the buffer and the address outlive the call.
        let n = unsafe {
            libc::sendto(
                self.fd.as_raw_fd(),
                frame.as_ptr().cast(),
                frame.len(),
                0,
                (&self.to as *const libc::sockaddr_ll).cast(),
                std::mem::size_of::<libc::sockaddr_ll>() as u32,
            )
        };
        n == frame.len() as isize
    }
}

/// Global counter `c` summed over CPUs, from the `STATS` map pinned in `dir` (shared by every
/// program that has used these maps).
pub fn counter(dir: &Path, c: Counter) -> u64 {
    let m = MapData::from_pin(dir.join("STATS"))
        .unwrap_or_else(|e| panic!("{}/STATS: {e}", dir.display()));
    let a: PerCpuArray<MapData, u64> = PerCpuArray::try_from(Map::PerCpuArray(m)).unwrap();
    a.get(&(c.index() as u32), 0).unwrap().iter().sum()
}

/// The program attached through the link pinned at `pin`: (program id, tag).
pub fn linked_program(pin: &Path) -> (u32, u64) {
    let link = PinnedLink::from_pin(pin).unwrap_or_else(|e| panic!("link {}: {e}", pin.display()));
    let id = FdLink::from(link).info().unwrap().program_id();
    let tag = aya::programs::loaded_programs()
        .filter_map(Result::ok)
        .find(|p| p.id() == id)
        .unwrap_or_else(|| panic!("program {id} of the link is not loaded"))
        .tag();
    (id, tag)
}
