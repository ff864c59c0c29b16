//! Pinned maps: a second load reuses the first one's maps (flows survive a restart), and
//! maps of another layout are refused with a message instead of being misread.

use std::path::PathBuf;

use lb_common::{maps, BACKEND_ACTIVE, LAYOUT_VERSION, PROTO_TCP};
use sluice::{
    addr::to_words,
    dataplane::{remove_pinned, Dataplane, LoadOptions},
    object::BPF_OBJECT,
};
use sluice_tests::{flow, frames::*, require_root, run_prog};

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
        (2, 1, 1),
        "slot 7 names the owner it had before the restart"
    );
    assert_eq!((ring[8].backend, ring[8].previous), (1, 0));
    let meta = dp.vip(&vip_key).unwrap().unwrap();
    assert_eq!(
        dp.publish(&vip_key, meta, &vec![1; 65537]).unwrap(),
        1,
        "the ring read back is known: only slot 7 (back to 1, naming 2) is written"
    );
    let ring = dp.live_ring(&vip_key).unwrap().unwrap();
    assert_eq!(
        (ring[7].backend, ring[7].previous, ring[7].changed),
        (1, 2, 2)
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
    // Partial state is refused too.
    std::fs::remove_file(dir.0.join(maps::CONNS)).unwrap();
    let err = format!(
        "{:#}",
        Dataplane::load(BPF_OBJECT, &opts(&dir))
            .err()
            .expect("must refuse")
    );
    assert!(
        err.contains("holds only some of Sluice's pinned maps"),
        "{err}"
    );
}
