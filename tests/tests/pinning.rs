//! Pinned maps: a second load reuses the first one's maps (flows survive a restart), a newer
//! build's program replaces the running one through the pinned link with no frame unseen, and
//! maps of another layout are refused with a message instead of being misread.

use std::path::PathBuf;

use aya::programs::XdpMode;
use lb_common::{maps, BACKEND_ACTIVE, LAYOUT_VERSION, PROTO_TCP};
use sluice::{
    addr::to_words,
    dataplane::{remove_pinned, Dataplane, LoadOptions, PROG_XDP},
    object::BPF_OBJECT,
};
use sluice_tests::{
    flow,
    frames::*,
    pinned::{counter, ifindex, linked_program, Injector},
    require_root, run_prog,
};

struct PinDir(PathBuf);

impl PinDir {
    fn new(tag: &str) -> Self {
        require_root();
        let mounted = std::fs::read_to_string("/proc/mounts")
            .unwrap()
            .lines()
            .any(|l| l.contains(" /sys/fs/bpf bpf "));
        assert!(
            mounted,
            "bpffs is not mounted at /sys/fs/bpf: run `cargo xtask setup`"
        );
        let p = PathBuf::from(format!(
            "/sys/fs/bpf/sluice-test-{tag}-{}",
            std::process::id()
        ));
        remove_pinned(&p).unwrap();
        PinDir(p)
    }
}

impl Drop for PinDir {
    fn drop(&mut self) {
        let _ = remove_pinned(&self.0);
    }
}

fn opts(dir: &PinDir) -> LoadOptions {
    LoadOptions {
        conn_table_size: 4096,
        affinity_table_size: 1024,
        max_vips: 2,
        pin_dir: Some(dir.0.clone()),
    }
}

#[test]
fn a_second_load_reuses_pinned_maps_and_keeps_flows() {
    let dir = PinDir::new("reuse");
    assert_eq!(unsafe { libc::unshare(libc::CLONE_NEWNET) }, 0);
    let vip_key;
    {
        let mut dp = Dataplane::load(BPF_OBJECT, &opts(&dir)).unwrap();
        assert!(!dp.reused());
        let (a, family) = to_words("10.200.0.1".parse().unwrap());
        vip_key = lb_common::VipKey {
            addr: a,
            port: 443u16.to_be(),
            proto: PROTO_TCP,
            family,
        };
        let meta = lb_common::VipMeta {
            id: 0,
            ring_size: 65537,
            ..Default::default()
        };
        let (b, bf) = to_words("10.1.0.1".parse().unwrap());
        dp.set_backend(
            1,
            &lb_common::BackendEntry {
                addr: b,
                family: bf,
                state: BACKEND_ACTIVE,
                vip: 0,
                ..Default::default()
            },
        )
        .unwrap();
        dp.set_config(&lb_common::LbConfig {
            fallback_mac: [2, 0, 0, 0, 0, 9],
            ..Default::default()
        })
        .unwrap();
        dp.publish(&vip_key, meta, &vec![1; 65537]).unwrap();
        let syn = eth(
            [2, 0, 0, 0, 0, 1],
            [2, 0, 0, 0, 0, 2],
            ETH_IP,
            &V4::new("192.0.2.1", "10.200.0.1", PROTO_TCP).build(&tcp(5000, 443, SYN, b"")),
        );
        assert_eq!(
            run_prog(&mut dp, sluice::dataplane::PROG_XDP, &syn)
                .unwrap()
                .0,
            3
        );
    }
    let mut dp = Dataplane::load(BPF_OBJECT, &opts(&dir)).unwrap();
    assert!(dp.reused());
    let c = dp
        .conn(&flow("192.0.2.1", 5000, "10.200.0.1", 443, PROTO_TCP))
        .unwrap();
    assert_eq!(
        c.map(|c| c.backend),
        Some(1),
        "the connection entry survived the reload"
    );
    assert!(dp.vip(&vip_key).unwrap().is_some());
    // The first publish after a reuse reads the live ring back: an unchanged table writes
    // nothing, and a changed one carries the history the earlier run published.
    let meta = dp.vip(&vip_key).unwrap().unwrap();
    assert_eq!(
        dp.publish(&vip_key, meta, &vec![1; 65537]).unwrap(),
        0,
        "an unchanged table is not rewritten"
    );
    let mut table = vec![1; 65537];
    table[7] = 2;
    let meta = dp.vip(&vip_key).unwrap().unwrap();
    // The inactive ring's content is unknown after a reuse, so it is written in full.
    assert_eq!(dp.publish(&vip_key, meta, &table).unwrap(), 65537);
    let ring = dp.live_ring(&vip_key).unwrap().unwrap();
    assert_eq!(
        (ring[7].backend, ring[7].previous, ring[7].changed),
        (2, [1, 0, 0], 1),
        "slot 7 names the owner it had before the restart"
    );
    assert_eq!((ring[8].backend, ring[8].previous), (1, [0; 3]));
    let meta = dp.vip(&vip_key).unwrap().unwrap();
    assert_eq!(
        dp.publish(&vip_key, meta, &vec![1; 65537]).unwrap(),
        1,
        "the ring read back is known: only slot 7 (back to 1, naming 2) is written"
    );
    let ring = dp.live_ring(&vip_key).unwrap().unwrap();
    assert_eq!(
        (ring[7].backend, ring[7].previous, ring[7].changed),
        (1, [2, 0, 0], 2)
    );
    table[7] = 3;
    let meta = dp.vip(&vip_key).unwrap().unwrap();
    assert_eq!(
        dp.publish(&vip_key, meta, &table).unwrap(),
        1,
        "once both rings are known, only changed slots are written"
    );
}

#[test]
fn pinned_maps_of_another_layout_are_refused_with_a_clear_message() {
    let dir = PinDir::new("layout");
    {
        let dp = Dataplane::load(BPF_OBJECT, &opts(&dir)).unwrap();
        drop(dp);
    }
    // Pretend an older Sluice wrote these maps.
    {
        let m = aya::maps::MapData::from_pin(dir.0.join(maps::META)).unwrap();
        let mut a: aya::maps::Array<aya::maps::MapData, u32> =
            aya::maps::Array::try_from(aya::maps::Map::Array(m)).unwrap();
        a.set(0, LAYOUT_VERSION + 1, 0).unwrap();
    }
    let err = format!(
        "{:#}",
        Dataplane::load(BPF_OBJECT, &opts(&dir))
            .err()
            .expect("must refuse")
    );
    assert!(err.contains("incompatible Sluice (layout version"), "{err}");
    assert!(err.contains("sluice cleanup"), "{err}");
    // Another layout may have another set of maps (an older one lacks the newer maps): its
    // version, not the missing maps, is what the operator is told.
    std::fs::remove_file(dir.0.join(maps::TENANT_STATS)).unwrap();
    let refusal = || {
        format!(
            "{:#}",
            Dataplane::load(BPF_OBJECT, &opts(&dir))
                .err()
                .expect("must refuse")
        )
    };
    let err = refusal();
    assert!(err.contains("incompatible Sluice (layout version"), "{err}");
    // Partial state of this layout is refused as such.
    {
        let m = aya::maps::MapData::from_pin(dir.0.join(maps::META)).unwrap();
        let mut a: aya::maps::Array<aya::maps::MapData, u32> =
            aya::maps::Array::try_from(aya::maps::Map::Array(m)).unwrap();
        a.set(0, LAYOUT_VERSION, 0).unwrap();
    }
    let err = refusal();
    assert!(
        err.contains("holds only some of Sluice's pinned maps"),
        "{err}"
    );
}

/// The object a newer Sluice would bring: `cargo xtask build` links the same sources for BPF
/// CPU v2 too, so its instructions and program tag differ from [`BPF_OBJECT`]'s while its
/// maps are the same.
fn newer_object() -> Vec<u8> {
    let p =
        std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../target/bpf/sluice-cpu-v2.bpf.o");
    let o = std::fs::read(&p)
        .unwrap_or_else(|e| panic!("{}: {e}: run `cargo xtask build`", p.display()));
    assert_ne!(o, BPF_OBJECT, "{} is the object itself", p.display());
    o
}

fn sh(c: &str) {
    let out = std::process::Command::new("sh")
        .arg("-c")
        .arg(c)
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{c}: {}",
        String::from_utf8_lossy(&out.stderr)
    );
}

/// In a namespace of the calling thread's own: veth `upa` (where the data plane is attached)
/// and its peer `upb` (where frames are sent from). Returns (upa, upb) ifindexes.
fn veth_pair() -> (u32, u32) {
    assert_eq!(unsafe { libc::unshare(libc::CLONE_NEWNET) }, 0);
    sh("ip link add upa type veth peer name upb && ip link set upa up && ip link set upb up");
    (ifindex("upa"), ifindex("upb"))
}

/// A frame no IP stack takes (local experimental ethertype): the data plane passes it as
/// `pass_not_ip`, and nothing else in the namespace sends one.
fn probe_frame() -> Vec<u8> {
    eth([0xff; 6], [2, 0, 0, 0, 0, 0x0b], 0x88b5, &[0x5a; 46])
}

/// `pass_not_ip` summed over CPUs, from the pinned counters (shared by every program that
/// has used these maps).
fn not_ip(dir: &PinDir) -> u64 {
    counter(&dir.0, lb_common::stat::PASS_NOT_IP)
}

/// Waits (at most 10 s) until `not_ip` reaches `want`, and checks it goes no further.
fn settled_at(dir: &PinDir, want: u64) {
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(10);
    while not_ip(dir) < want && std::time::Instant::now() < deadline {
        std::thread::sleep(std::time::Duration::from_millis(20));
    }
    std::thread::sleep(std::time::Duration::from_millis(100));
    assert_eq!(
        not_ip(dir),
        want,
        "every frame handed to the attached interface is counted by one program or the other"
    );
}

/// Upgrading to a build whose program differs replaces the program through the pinned
/// bpf_link (BPF_LINK_UPDATE) while frames keep arriving: every frame sent before, during and
/// after the swap is counted by the old program or the new one, none passes unseen.
#[test]
fn upgrade_to_a_changed_program_swaps_it_with_no_frame_unseen() {
    use std::sync::{
        atomic::{AtomicBool, Ordering},
        Arc,
    };
    use std::time::{Duration, Instant};
    let newer = newer_object();
    let dir = PinDir::new("upgrade");
    let (upa, upb) = veth_pair();
    let link = dir.0.join("link-upa");
    {
        let mut dp = Dataplane::load(BPF_OBJECT, &opts(&dir)).unwrap();
        let updated = dp
            .attach_pinned(PROG_XDP, upa, XdpMode::Driver, &link)
            .unwrap();
        assert!(!updated);
    }
    // The first process has exited: the pinned link keeps its program running.
    let old = linked_program(&link);
    let stop = Arc::new(AtomicBool::new(false));
    let injector = Injector::new(upb);
    let sender = {
        let stop = stop.clone();
        std::thread::spawn(move || {
            let frame = probe_frame();
            let (t, mut sent) = (Instant::now(), 0u64);
            while !stop.load(Ordering::Relaxed)
                && sent < 20_000_000
                && t.elapsed() < Duration::from_secs(30)
            {
                if injector.send(&frame) {
                    sent += 1;
                } else {
                    std::thread::yield_now();
                }
            }
            sent
        })
    };
    let reach = |n: u64, what: &str| {
        let deadline = Instant::now() + Duration::from_secs(15);
        loop {
            let c = not_ip(&dir);
            if c >= n {
                return c;
            }
            assert!(
                Instant::now() < deadline && !sender.is_finished(),
                "{what}: {c} frames counted"
            );
            std::thread::sleep(Duration::from_millis(5));
        }
    };
    let before = reach(2_000, "frames reaching the old program");
    let mut dp = Dataplane::load(&newer, &opts(&dir)).unwrap();
    assert!(dp.reused(), "the newer build reuses the pinned maps");
    let swapped_at = not_ip(&dir);
    assert!(
        dp.attach_pinned(PROG_XDP, upa, XdpMode::Driver, &link)
            .unwrap(),
        "the pinned link is updated, not a new one attached"
    );
    let after = reach(swapped_at + 2_000, "frames reaching the new program");
    stop.store(true, Ordering::Relaxed);
    let sent = sender.join().unwrap();
    eprintln!(
        "{sent} frames sent; counted: {before} before the load, {swapped_at} at the swap, \
         {after} after it"
    );
    settled_at(&dir, sent);
    let new = linked_program(&link);
    eprintln!("program (id, tag): {old:x?} -> {new:x?}");
    assert_ne!(new.0, old.0, "the link runs another program");
    assert_ne!(
        new.1, old.1,
        "the new program's instructions differ (its tag)"
    );
    let shown = std::process::Command::new("ip")
        .args(["link", "show", "upa"])
        .output()
        .unwrap();
    let shown = String::from_utf8_lossy(&shown.stdout);
    assert!(
        shown.contains(&format!("prog/xdp id {} ", new.0)),
        "upa runs the new program: {shown}"
    );
}

/// A pinned map of another layout (as an older or newer build leaves it) is refused with a
/// message naming the map and both layouts, and nothing is touched: the running program keeps
/// counting every frame through its pinned link. Capacity, value size and key size in turn.
#[test]
fn a_build_with_another_map_layout_is_refused_and_the_running_plane_keeps_forwarding() {
    use aya::maps::{HashMap, MapData};
    use lb_common::{ConnEntry, FlowKey, VipKey, VipMeta};
    use std::mem::size_of;
    let dir = PinDir::new("relayout");
    let (upa, upb) = veth_pair();
    let link = dir.0.join("link-upa");
    {
        let mut dp = Dataplane::load(BPF_OBJECT, &opts(&dir)).unwrap();
        dp.attach_pinned(PROG_XDP, upa, XdpMode::Driver, &link)
            .unwrap();
    }
    let running = linked_program(&link);
    let injector = Injector::new(upb);
    let mut sent = 0;
    let forwarding = |sent: &mut u64| {
        for _ in 0..100 {
            assert!(injector.send(&probe_frame()));
        }
        *sent += 100;
        settled_at(&dir, *sent);
        assert_eq!(
            linked_program(&link),
            running,
            "the running program was replaced"
        );
    };
    forwarding(&mut sent);
    let refused = |o: LoadOptions| {
        format!(
            "{:#}",
            Dataplane::load(BPF_OBJECT, &o)
                .err()
                .expect("an incompatible layout must be refused")
        )
    };

    // Capacity: a configuration that needs more ring slots than the pinned map has.
    let mut more_vips = opts(&dir);
    more_vips.max_vips = 4;
    let err = refused(more_vips);
    eprintln!("{err}");
    assert!(
        err.contains(&format!(
            "map MAGLEV_RINGS has {} entries, this configuration needs {}",
            2 * lb_common::RINGS_PER_VIP * lb_common::RING_SIZE_MAX,
            4 * lb_common::RINGS_PER_VIP * lb_common::RING_SIZE_MAX
        )),
        "{err}"
    );
    assert!(err.contains("sluice cleanup"), "{err}");
    forwarding(&mut sent);

    // Value size: connection entries 8 bytes longer.
    std::fs::remove_file(dir.0.join("CONNS")).unwrap();
    HashMap::<MapData, FlowKey, [u8; size_of::<ConnEntry>() + 8]>::create(4096, 0)
        .unwrap()
        .pin(dir.0.join("CONNS"))
        .unwrap();
    let err = refused(opts(&dir));
    eprintln!("{err}");
    let (k, v) = (size_of::<FlowKey>(), size_of::<ConnEntry>());
    assert!(
        err.contains(&format!(
            "map CONNS has key/value sizes {k}/{}, expected {k}/{v}",
            v + 8
        )),
        "{err}"
    );
    forwarding(&mut sent);

    // Key size: VIP keys 4 bytes longer (checked before CONNS).
    std::fs::remove_file(dir.0.join("VIPS")).unwrap();
    HashMap::<MapData, [u8; size_of::<VipKey>() + 4], VipMeta>::create(16, 0)
        .unwrap()
        .pin(dir.0.join("VIPS"))
        .unwrap();
    let err = refused(opts(&dir));
    eprintln!("{err}");
    let (k, v) = (size_of::<VipKey>(), size_of::<VipMeta>());
    assert!(
        err.contains(&format!(
            "map VIPS has key/value sizes {}/{v}, expected {k}/{v}",
            k + 4
        )),
        "{err}"
    );
    forwarding(&mut sent);
}
