//! Readable maps: the connection table is BTF-defined, so `bpftool map dump` shows an entry
//! by field name (a legacy map dumps as raw bytes). Needs root, the BPF object and `bpftool`
//! (`cargo xtask setup` installs it); fails, never skips.

use std::{os::fd::AsRawFd, process::Command};

use lb_common::PROTO_TCP;
use serde_json::Value;
use sluice_tests::{flow, frames::*, Lab};

/// The kernel's id of the map behind `fd`, from /proc/self/fdinfo.
fn map_id(fd: &impl AsRawFd) -> u32 {
    let info = std::fs::read_to_string(format!("/proc/self/fdinfo/{}", fd.as_raw_fd()))
        .expect("reading fdinfo");
    info.lines()
        .find_map(|l| l.strip_prefix("map_id:"))
        .and_then(|v| v.trim().parse().ok())
        .unwrap_or_else(|| panic!("no map_id in fdinfo:\n{info}"))
}

#[test]
fn bpftool_dumps_the_connection_table_by_field_name() {
    let mut lab = Lab::new();
    let vip = lab.vip(0, "10.200.0.1", 443, PROTO_TCP, 0, 0);
    lab.backends(&vip, &[(1, "10.1.0.1", 1), (2, "10.1.0.2", 1)]);
    let key = flow("192.0.2.10", 40000, "10.200.0.1", 443, PROTO_TCP);
    let want = lab.ring_choice(&vip, &key, false);
    let l3 = V4::new("192.0.2.10", "10.200.0.1", PROTO_TCP).build(&tcp(40000, 443, SYN, b""));
    lab.run(&eth([2, 0, 0, 0, 0, 1], [2, 0, 0, 0, 0, 2], ETH_IP, &l3));

    let fd = lab.dp.conns_fd().unwrap();
    let id = map_id(&fd);
    let out = Command::new("bpftool")
        .args(["-j", "map", "dump", "id", &id.to_string()])
        .output()
        .unwrap_or_else(|e| {
            panic!("running bpftool ({e}): install it with `cargo xtask setup` (package bpftool)")
        });
    assert!(
        out.status.success(),
        "bpftool: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    let dump: Value = serde_json::from_slice(&out.stdout).expect("bpftool -j prints JSON");
    let entries = dump.as_array().expect("a list of entries");
    assert_eq!(entries.len(), 1, "{dump}");
    let f = &entries[0]["formatted"];
    assert_eq!(f["value"]["backend"], want, "{dump}");
    // Stored in network byte order, shown as the host reads it.
    assert_eq!(f["key"]["sport"], 40000u16.to_be(), "{dump}");
    assert_eq!(f["key"]["proto"], PROTO_TCP, "{dump}");
    assert!(f["value"]["last_seen_ns"].as_u64().unwrap() > 0, "{dump}");
}
