//! Loading the eBPF object and typed access to its maps (the map writer).
//!
//! Everything that touches a map goes through here, so the rest of the library deals in
//! plain Rust values.

use std::{
    collections::{BTreeMap, HashMap as StdHashMap},
    fs,
    mem::size_of,
    os::fd::{AsFd, AsRawFd, OwnedFd},
    path::{Path, PathBuf},
};

use anyhow::{anyhow, bail, Context, Result};
use aya::{
    maps::{
        lpm_trie::Key, Array, DevMapHash, HashMap, LpmTrie, MapData, MapError, MapInfo, PerCpuArray,
    },
    programs::{
        links::{FdLink, PinnedLink},
        xdp::XdpLink,
        ProgramFd, Xdp, XdpMode,
    },
    Ebpf, EbpfLoader, Pod,
};
use lb_common::{
    maps, stat, AffinityEntry, AffinityKey, BackendEntry, ConnEntry, FloodWindow, FlowKey,
    InbandStats, LbConfig, NextHop, QuicServerKey, RingSlot, TenantBucket, TenantLimits,
    TenantPrefix, TenantStats, TrafficStats, VipKey, VipMeta, AFFINITY_TABLE_SIZE, CONN_TABLE_SIZE,
    LAYOUT_VERSION, LB_F_TRACE, LB_F_WILDCARD_VIPS, MAX_BACKENDS, MAX_TENANTS, MAX_TENANT_PREFIXES,
    MAX_VIPS, RINGS_PER_VIP, RING_SIZE_MAX, TENANT_PREFIX_FAMILY_BITS, TENANT_V4_WORDS,
};

use crate::{config::Cidr, maglev, ring_history, state};

mod tenant_v4;
use tenant_v4::TenantV4Map;

/// Program names in the object.
pub const PROG_XDP: &str = "sluice_xdp";
pub const PROG_DECAP: &str = "sluice_decap";
pub const PROG_PASS: &str = "sluice_pass";

/// Map capacities chosen at load time.
#[derive(Clone, Debug)]
pub struct LoadOptions {
    pub conn_table_size: u32,
    pub affinity_table_size: u32,
    /// VIPs the ring array has room for (each costs 2 × 65537 × 8 bytes of kernel memory).
    pub max_vips: u32,
    /// bpffs directory to pin the maps in; maps already pinned there are reused (after a
    /// layout check), which is what keeps flows through a restart.
    pub pin_dir: Option<PathBuf>,
}

impl Default for LoadOptions {
    fn default() -> Self {
        Self {
            conn_table_size: CONN_TABLE_SIZE,
            affinity_table_size: AFFINITY_TABLE_SIZE,
            max_vips: MAX_VIPS,
            pin_dir: None,
        }
    }
}

/// (map, key size, value size, required entries or 0) as this build reads them.
fn map_layouts(opts: &LoadOptions) -> [(&'static str, usize, usize, u32); 20] {
    let u32s = size_of::<u32>();
    [
        (maps::META, u32s, u32s, 1),
        (maps::CONFIG, u32s, size_of::<LbConfig>(), 1),
        (maps::VIPS, size_of::<VipKey>(), size_of::<VipMeta>(), 0),
        (
            maps::BACKENDS,
            u32s,
            size_of::<BackendEntry>(),
            MAX_BACKENDS,
        ),
        (
            maps::MAGLEV_RINGS,
            u32s,
            size_of::<RingSlot>(),
            opts.max_vips * RINGS_PER_VIP * RING_SIZE_MAX,
        ),
        (maps::CONNS, size_of::<FlowKey>(), size_of::<ConnEntry>(), 0),
        (
            maps::AFFINITY,
            size_of::<AffinityKey>(),
            size_of::<AffinityEntry>(),
            0,
        ),
        (maps::TX_PORTS, u32s, 0, 0),
        (maps::STATS, u32s, size_of::<u64>(), stat::COUNT),
        (maps::VIP_STATS, u32s, size_of::<TrafficStats>(), MAX_VIPS),
        (
            maps::BACKEND_STATS,
            u32s,
            size_of::<TrafficStats>(),
            MAX_BACKENDS,
        ),
        (maps::FLOOD, u32s, size_of::<FloodWindow>(), 1),
        (maps::NEXTHOPS, u32s, size_of::<NextHop>(), MAX_BACKENDS),
        (
            maps::INBAND_STATS,
            u32s,
            size_of::<InbandStats>(),
            MAX_BACKENDS,
        ),
        (maps::QUIC_SERVERS, size_of::<QuicServerKey>(), u32s, 0),
        (
            maps::TENANT_PREFIXES,
            size_of::<Key<TenantPrefix>>(),
            u32s,
            MAX_TENANT_PREFIXES,
        ),
        (maps::TENANT_V4, u32s, size_of::<u64>(), TENANT_V4_WORDS),
        (
            maps::TENANT_LIMITS,
            u32s,
            size_of::<TenantLimits>(),
            TENANT_SLOTS,
        ),
        (
            maps::TENANT_BUCKETS,
            u32s,
            size_of::<TenantBucket>(),
            TENANT_SLOTS,
        ),
        (
            maps::TENANT_STATS,
            u32s,
            size_of::<TenantStats>(),
            TENANT_SLOTS,
        ),
    ]
}

/// Entries of each per-(VIP, tenant) map.
const TENANT_SLOTS: u32 = MAX_VIPS * MAX_TENANTS;

/// The `TENANT_PREFIXES` key of a client prefix.
fn tenant_key(c: &Cidr) -> Key<TenantPrefix> {
    Key::new(
        TENANT_PREFIX_FAMILY_BITS + u32::from(c.prefix),
        TenantPrefix {
            family: c.family(),
            _pad: [0; 3],
            addr: c.addr_words(),
        },
    )
}

/// The client prefix of a `TENANT_PREFIXES` key.
fn tenant_cidr(k: &Key<TenantPrefix>) -> Option<Cidr> {
    let d = k.data();
    if d.family != lb_common::FAMILY_V4 && d.family != lb_common::FAMILY_V6 {
        return None;
    }
    let addr = crate::addr::from_words(d.addr, d.family);
    let prefix = u8::try_from(k.prefix_len().checked_sub(TENANT_PREFIX_FAMILY_BITS)?).ok()?;
    Some(Cidr { addr, prefix })
}

/// A delete's outcome where a missing key is no error: a delete of a missing key fails with
/// ENOENT, not `KeyNotFound`, so a failed delete asks the map (`get`) whether the key is there.
fn gone<V>(
    removed: Result<(), MapError>,
    get: impl FnOnce() -> Result<V, MapError>,
) -> Result<(), MapError> {
    match removed {
        Err(_) if matches!(get(), Err(MapError::KeyNotFound)) => Ok(()),
        r => r,
    }
}

/// What the tenant maps hold, as this process last wrote or read them.
#[derive(Clone, Debug, Default)]
struct TenantShadow {
    prefixes: BTreeMap<Cidr, u32>,
    /// `TENANT_LIMITS` entries that are not all zero.
    limits: BTreeMap<u32, TenantLimits>,
}

/// Checks maps pinned in `dir` by an earlier run: all or none must be there, and each must
/// have the layout this build reads. Returns whether they are there.
fn check_pinned(dir: &Path, opts: &LoadOptions) -> Result<bool> {
    let layouts = map_layouts(opts);
    let present: Vec<_> = layouts
        .iter()
        .filter(|(n, ..)| dir.join(n).exists())
        .collect();
    if present.is_empty() {
        return Ok(false);
    }
    let incompatible = |what: String| {
        anyhow!(
            "the data plane pinned in {} was created by an incompatible Sluice ({what}); this \
             build (layout {LAYOUT_VERSION}) will not reuse it. Stop it with `sluice cleanup` \
             (established flows lose their pinning) or run the matching Sluice version",
            dir.display()
        )
    };
    // A newer or older layout may have another set of maps: its version says so first.
    let version = || -> Result<u32> {
        let meta: Array<MapData, u32> = Array::try_from(aya::maps::Map::Array(
            MapData::from_pin(dir.join(maps::META)).context("opening pinned META")?,
        ))?;
        Ok(meta.get(&0, 0)?)
    };
    if present.len() != layouts.len() {
        if dir.join(maps::META).exists() {
            let v = version()?;
            if v != LAYOUT_VERSION {
                return Err(incompatible(format!("layout version {v}")));
            }
        }
        bail!(
            "{} holds only some of Sluice's pinned maps ({} of {}): it was left by a failed \
             start or another program; remove it (`sluice cleanup`) and start again",
            dir.display(),
            present.len(),
            layouts.len()
        );
    }
    for (name, key, value, entries) in layouts {
        let info = MapInfo::from_pin(dir.join(name))
            .with_context(|| format!("reading pinned map {}", dir.join(name).display()))?;
        if info.key_size() as usize != key || (value != 0 && info.value_size() as usize != value) {
            return Err(incompatible(format!(
                "map {name} has key/value sizes {}/{}, expected {key}/{value}",
                info.key_size(),
                info.value_size()
            )));
        }
        if entries != 0 && info.max_entries() < entries {
            return Err(incompatible(format!(
                "map {name} has {} entries, this configuration needs {entries}",
                info.max_entries()
            )));
        }
    }
    let v = version()?;
    if v != LAYOUT_VERSION {
        return Err(incompatible(format!("layout version {v}")));
    }
    Ok(true)
}

/// Makes the link pinned at `pin` run `prog` again (BPF_LINK_UPDATE, atomic like the
/// replacement it undoes).
pub fn relink(pin: &Path, prog: &ProgramFd) -> Result<()> {
    const BPF_OBJ_GET: libc::c_long = 7;
    const BPF_LINK_UPDATE: libc::c_long = 29;
    #[repr(C)]
    struct ObjGetAttr {
        pathname: u64,
        bpf_fd: u32,
        file_flags: u32,
    }
    #[repr(C)]
    struct LinkUpdateAttr {
        link_fd: u32,
        new_prog_fd: u32,
        flags: u32,
        old_prog_fd: u32,
    }
    let sys = |cmd: libc::c_long, attr: *const libc::c_void, size: usize| {
        // SAFETY: `attr` points at a live attribute of `size` bytes for this command.
        let rc = unsafe { libc::syscall(libc::SYS_bpf, cmd, attr, size) };
        if rc < 0 {
            Err(std::io::Error::last_os_error())
        } else {
            Ok(rc)
        }
    };
    let path = std::ffi::CString::new(pin.as_os_str().as_encoded_bytes())
        .map_err(|_| anyhow!("{} contains NUL", pin.display()))?;
    let get = ObjGetAttr {
        pathname: path.as_ptr() as u64,
        bpf_fd: 0,
        file_flags: 0,
    };
    let fd = sys(
        BPF_OBJ_GET,
        (&get as *const ObjGetAttr).cast(),
        size_of::<ObjGetAttr>(),
    )
    .with_context(|| format!("opening pinned link {}", pin.display()))?;
    // SAFETY: BPF_OBJ_GET returned a new descriptor that nothing else owns.
    let link_fd = unsafe { <OwnedFd as std::os::fd::FromRawFd>::from_raw_fd(fd as i32) };
    let attr = LinkUpdateAttr {
        link_fd: link_fd.as_raw_fd() as u32,
        new_prog_fd: prog.as_fd().as_raw_fd() as u32,
        flags: 0,
        old_prog_fd: 0,
    };
    sys(
        BPF_LINK_UPDATE,
        (&attr as *const LinkUpdateAttr).cast(),
        size_of::<LinkUpdateAttr>(),
    )
    .with_context(|| format!("giving link {} its previous program back", pin.display()))?;
    Ok(())
}

/// Removes a pinned data plane: the XDP links (detaching the program) and the maps.
pub fn remove_pinned(dir: &Path) -> Result<()> {
    if !dir.exists() {
        return Ok(());
    }
    for entry in fs::read_dir(dir).with_context(|| format!("reading {}", dir.display()))? {
        let p = entry?.path();
        fs::remove_file(&p).with_context(|| format!("unpinning {}", p.display()))?;
    }
    fs::remove_dir(dir).with_context(|| format!("removing {}", dir.display()))?;
    Ok(())
}

impl LoadOptions {
    /// For hosts that only decapsulate: the steering maps shrink to a token size.
    pub fn decap_only() -> Self {
        Self {
            conn_table_size: 1,
            affinity_table_size: 1,
            max_vips: 1,
            pin_dir: None,
        }
    }
}

/// What the data plane holds in each of a VIP's two rings, so a new table is written as
/// the slots that differ from the inactive ring before the flip, and so the live ring's
/// history is at hand for the next table.
struct RingShadow {
    rings: [Vec<RingSlot>; 2],
}

/// Stands for a slot of a pinned map whose content is not known: it differs from every
/// slot a table can give, so it is always rewritten.
const UNKNOWN_SLOT: RingSlot = RingSlot {
    backend: u16::MAX,
    previous: [u16::MAX; lb_common::RING_HISTORY],
    changed: u32::MAX,
};

pub struct Dataplane {
    ebpf: Ebpf,
    max_vips: u32,
    /// The maps were pinned by an earlier run and reused.
    reused: bool,
    shadows: StdHashMap<u32, RingShadow>,
    /// Rings a previous daemon saved (`ring_store`): a VIP's first table in fresh maps
    /// continues its history instead of starting without one.
    saved_rings: StdHashMap<VipKey, Vec<RingSlot>>,
    /// What `QUIC_SERVERS` holds, as this process last wrote or read it; `None` until it is
    /// read (a pinned map holds a previous run's entries) or after a failed write.
    quic_shadow: Option<BTreeMap<state::QuicServerKey, u32>>,
    /// Likewise for `TENANT_PREFIXES` and `TENANT_LIMITS`.
    tenant_shadow: Option<TenantShadow>,
    /// `TENANT_V4`, mapped into memory (it knows the prefixes it was written for).
    tenant_v4: TenantV4Map,
}

/// Sum of a per-CPU value over all CPUs.
fn sum_u64(v: &aya::maps::PerCpuValues<u64>) -> u64 {
    v.iter().sum()
}

impl Dataplane {
    /// Loads (verifies) every program of `object`; nothing is attached yet.
    pub fn load(object: &[u8], opts: &LoadOptions) -> Result<Self> {
        if opts.max_vips == 0 || opts.max_vips > MAX_VIPS {
            bail!(
                "max_vips must be between 1 and {MAX_VIPS}, got {}",
                opts.max_vips
            );
        }
        let mut loader = EbpfLoader::new();
        loader
            .map_max_entries(maps::CONNS, opts.conn_table_size)
            .map_max_entries(maps::AFFINITY, opts.affinity_table_size)
            .map_max_entries(
                maps::MAGLEV_RINGS,
                opts.max_vips * RINGS_PER_VIP * RING_SIZE_MAX,
            );
        let mut reused = false;
        if let Some(dir) = &opts.pin_dir {
            fs::create_dir_all(dir).with_context(|| {
                format!(
                    "creating pin directory {} (is bpffs mounted?)",
                    dir.display()
                )
            })?;
            reused = check_pinned(dir, opts)?;
            for (name, ..) in map_layouts(opts) {
                loader.map_pin_path(name, dir.join(name));
            }
        }
        let mut ebpf = loader
            .load(object)
            .context("loading the eBPF object (are you root, with bpffs and BPF enabled?)")?;
        for name in [PROG_XDP, PROG_DECAP, PROG_PASS] {
            let prog: &mut Xdp = ebpf
                .program_mut(name)
                .ok_or_else(|| anyhow!("program {name} missing from the eBPF object"))?
                .try_into()?;
            prog.load()
                .with_context(|| format!("verifier rejected {name}"))?;
        }
        let tenant_v4 = match ebpf.map(maps::TENANT_V4) {
            Some(aya::maps::Map::Array(m)) => TenantV4Map::map(&m.fd().as_fd())?,
            _ => bail!("the eBPF object has no {} array", maps::TENANT_V4),
        };
        let mut dp = Self {
            ebpf,
            max_vips: opts.max_vips,
            reused,
            shadows: StdHashMap::new(),
            saved_rings: StdHashMap::new(),
            quic_shadow: None,
            tenant_shadow: None,
            tenant_v4,
        };
        if !reused {
            let mut meta: Array<&mut MapData, u32> = Array::try_from(dp.map(maps::META)?)?;
            meta.set(0, LAYOUT_VERSION, 0).context("writing META")?;
        }
        Ok(dp)
    }

    /// Whether the maps came from an earlier run (a restart or upgrade).
    pub fn reused(&self) -> bool {
        self.reused
    }

    pub fn program(&mut self, name: &str) -> Result<&mut Xdp> {
        Ok(self
            .ebpf
            .program_mut(name)
            .ok_or_else(|| anyhow!("program {name} missing from the eBPF object"))?
            .try_into()?)
    }

    /// Attaches `prog` to the interface with this index (in the caller's network namespace).
    pub fn attach(&mut self, prog: &str, ifindex: u32, mode: XdpMode) -> Result<()> {
        self.program(prog)?
            .attach_to_if_index(ifindex, mode)
            .with_context(|| format!("attaching {prog} to ifindex {ifindex} in {mode:?} mode"))?;
        Ok(())
    }

    /// Attaches `prog` to `ifindex` through a bpf_link pinned at `pin`, so the program keeps
    /// running when this process exits. If a link is pinned there already, its program is
    /// replaced atomically (BPF_LINK_UPDATE): no packet sees the interface without a program.
    /// Returns true when an existing link was updated.
    pub fn attach_pinned(
        &mut self,
        prog: &str,
        ifindex: u32,
        mode: XdpMode,
        pin: &Path,
    ) -> Result<bool> {
        if pin.exists() {
            let link = PinnedLink::from_pin(pin)
                .with_context(|| format!("opening pinned link {}", pin.display()))?;
            let link = XdpLink::try_from(FdLink::from(link))
                .with_context(|| format!("{} is not an XDP link", pin.display()))?;
            self.program(prog)?
                .attach_to_link(link)
                .with_context(|| format!("replacing the program of link {}", pin.display()))?;
            return Ok(true);
        }
        let p = self.program(prog)?;
        let id = p
            .attach_to_if_index(ifindex, mode)
            .with_context(|| format!("attaching {prog} to ifindex {ifindex} in {mode:?} mode"))?;
        let link = FdLink::try_from(p.take_link(id)?)
            .context("the kernel attached XDP without a bpf_link; pinning needs Linux >= 5.9")?;
        link.pin(pin)
            .with_context(|| format!("pinning the XDP link at {}", pin.display()))?;
        Ok(false)
    }

    /// The program the link pinned at `pin` runs now, held so that a start that replaced it
    /// and then failed can give it back ([`relink`]).
    pub fn linked_program(pin: &Path) -> Result<ProgramFd> {
        let link = PinnedLink::from_pin(pin)
            .with_context(|| format!("opening pinned link {}", pin.display()))?;
        let id = FdLink::from(link)
            .info()
            .with_context(|| format!("reading pinned link {}", pin.display()))?
            .program_id();
        aya::programs::loaded_programs()
            .filter_map(Result::ok)
            .find(|p| p.id() == id)
            .ok_or_else(|| anyhow!("program {id} of link {} is gone", pin.display()))?
            .fd()
            .with_context(|| format!("opening program {id} of link {}", pin.display()))
    }

    /// A map's capacity (max_entries) as created.
    pub fn capacity(&mut self, name: &str) -> Result<u32> {
        let m = self.map(name)?;
        let info = match m {
            aya::maps::Map::LruHashMap(d)
            | aya::maps::Map::HashMap(d)
            | aya::maps::Map::LpmTrie(d) => d.info()?,
            _ => bail!("map {name} is not a hash map or trie"),
        };
        Ok(info.max_entries())
    }

    fn map(&mut self, name: &str) -> Result<&mut aya::maps::Map> {
        self.ebpf
            .map_mut(name)
            .ok_or_else(|| anyhow!("map {name} missing from the eBPF object"))
    }

    /// Sets or clears `LB_F_WILDCARD_VIPS` in the live CONFIG (the other settings stay).
    pub fn set_wildcard_vips(&mut self, on: bool) -> Result<()> {
        self.set_config_flag(LB_F_WILDCARD_VIPS, on)
    }

    /// Switches decision tracing (`LB_F_TRACE`) in the live CONFIG.
    pub fn set_trace(&mut self, on: bool) -> Result<()> {
        self.set_config_flag(LB_F_TRACE, on)
    }

    fn set_config_flag(&mut self, flag: u32, on: bool) -> Result<()> {
        let mut a: Array<&mut MapData, LbConfig> = Array::try_from(self.map(maps::CONFIG)?)?;
        let mut cfg = a.get(&0, 0)?;
        let flags = if on {
            cfg.flags | flag
        } else {
            cfg.flags & !flag
        };
        if flags != cfg.flags {
            cfg.flags = flags;
            a.set(0, cfg, 0).context("writing CONFIG")?;
        }
        Ok(())
    }

    /// The global settings as the data plane holds them.
    pub fn config(&mut self) -> Result<LbConfig> {
        let a: Array<&mut MapData, LbConfig> = Array::try_from(self.map(maps::CONFIG)?)?;
        Ok(a.get(&0, 0)?)
    }

    /// Writes the global settings, keeping the flags the map writer maintains.
    pub fn set_config(&mut self, cfg: &LbConfig) -> Result<()> {
        let mut a: Array<&mut MapData, LbConfig> = Array::try_from(self.map(maps::CONFIG)?)?;
        let live = a.get(&0, 0)?;
        let cfg = LbConfig {
            flags: cfg.flags | (live.flags & LB_F_WILDCARD_VIPS),
            ..*cfg
        };
        a.set(0, cfg, 0).context("writing CONFIG")?;
        Ok(())
    }

    /// The reader of the data plane's decision traces (`AYA_LOGS`), writing to `logger`;
    /// taken once per load.
    pub fn trace_reader<T: log::Log>(&mut self, logger: T) -> Result<aya_log::EbpfLogger<T>> {
        aya_log::EbpfLogger::init_with_logger(&mut self.ebpf, logger)
            .context("opening the AYA_LOGS ring buffer of decision traces")
    }

    /// Adds an egress interface for XDP_REDIRECT.
    pub fn add_tx_port(&mut self, ifindex: u32) -> Result<()> {
        let mut m: DevMapHash<&mut MapData> = DevMapHash::try_from(self.map(maps::TX_PORTS)?)?;
        m.insert(ifindex, ifindex, None, 0)
            .with_context(|| format!("adding tx port {ifindex}"))?;
        Ok(())
    }

    /// Whether `ifindex` is an egress interface for XDP_REDIRECT.
    pub fn has_tx_port(&mut self, ifindex: u32) -> Result<bool> {
        let m: DevMapHash<&mut MapData> = DevMapHash::try_from(self.map(maps::TX_PORTS)?)?;
        match m.get(ifindex, 0) {
            Ok(_) => Ok(true),
            Err(aya::maps::MapError::KeyNotFound) => Ok(false),
            Err(e) => Err(e).with_context(|| format!("reading tx port {ifindex}")),
        }
    }

    /// Removes an egress interface [`Dataplane::add_tx_port`] added.
    pub fn remove_tx_port(&mut self, ifindex: u32) -> Result<()> {
        let mut m: DevMapHash<&mut MapData> = DevMapHash::try_from(self.map(maps::TX_PORTS)?)?;
        m.remove(ifindex)
            .with_context(|| format!("removing tx port {ifindex}"))
    }

    /// Forgets the cached next hops of these backends on every CPU, so the next packet asks
    /// the FIB (after a routing change that should take effect before the cache's TTL).
    pub fn flush_next_hops(&mut self, ids: impl IntoIterator<Item = u32>) -> Result<()> {
        let mut a: PerCpuArray<&mut MapData, NextHop> =
            PerCpuArray::try_from(self.map(maps::NEXTHOPS)?)?;
        let cpus = aya::util::nr_cpus().map_err(|(_, e)| anyhow!("counting CPUs: {e}"))?;
        for id in ids {
            let empty = aya::maps::PerCpuValues::try_from(vec![NextHop::default(); cpus])?;
            a.set(id, empty, 0)
                .with_context(|| format!("clearing the next hop of {id}"))?;
        }
        Ok(())
    }

    pub fn set_backend(&mut self, id: u32, b: &BackendEntry) -> Result<()> {
        let mut a: Array<&mut MapData, BackendEntry> = Array::try_from(self.map(maps::BACKENDS)?)?;
        a.set(id, b, 0)
            .with_context(|| format!("writing backend {id}"))?;
        Ok(())
    }

    pub fn backend(&mut self, id: u32) -> Result<BackendEntry> {
        let a: Array<&mut MapData, BackendEntry> = Array::try_from(self.map(maps::BACKENDS)?)?;
        Ok(a.get(&id, 0)?)
    }

    pub fn set_vip(&mut self, key: &VipKey, meta: &VipMeta) -> Result<()> {
        if meta.id >= self.max_vips {
            bail!(
                "VIP id {} is beyond the {} VIPs this data plane was loaded for",
                meta.id,
                self.max_vips
            );
        }
        self.hash_set(maps::VIPS, key, meta)
    }

    pub fn vip(&mut self, key: &VipKey) -> Result<Option<VipMeta>> {
        self.hash_get(maps::VIPS, key)
    }

    /// One entry of the hash map `name`; `None` where the key is absent.
    fn hash_get<K: Pod, V: Pod>(&mut self, name: &str, key: &K) -> Result<Option<V>> {
        let m: HashMap<&mut MapData, K, V> = HashMap::try_from(self.map(name)?)?;
        match m.get(key, 0) {
            Ok(v) => Ok(Some(v)),
            Err(aya::maps::MapError::KeyNotFound) => Ok(None),
            Err(e) => Err(e).with_context(|| format!("reading {name}")),
        }
    }

    /// Writes one entry of the hash map `name`.
    fn hash_set<K: Pod, V: Pod>(&mut self, name: &str, key: &K, value: &V) -> Result<()> {
        let mut m: HashMap<&mut MapData, K, V> = HashMap::try_from(self.map(name)?)?;
        m.insert(key, value, 0)
            .with_context(|| format!("writing {name}"))
    }

    /// Every entry of `QUIC_SERVERS` as the kernel holds it: (VIP id, server ID) → backend id.
    pub fn quic_servers(&mut self) -> Result<BTreeMap<state::QuicServerKey, u32>> {
        let m: HashMap<&mut MapData, QuicServerKey, u32> =
            HashMap::try_from(self.map(maps::QUIC_SERVERS)?)?;
        m.iter()
            .map(|r| r.map(|(k, v)| ((k.vip, k.id), v)))
            .collect::<Result<_, _>>()
            .context("reading QUIC_SERVERS")
    }

    /// Brings `QUIC_SERVERS` to exactly `desired` ([`state::quic_server_changes`]): new and
    /// changed entries are written, the others deleted, leftovers of a previous run
    /// included. Returns the entries written and deleted.
    pub fn sync_quic_servers(
        &mut self,
        desired: &BTreeMap<state::QuicServerKey, u32>,
    ) -> Result<usize> {
        let current = match self.quic_shadow.take() {
            Some(s) => s,
            None => self.quic_servers()?,
        };
        let changes = state::quic_server_changes(&current, desired);
        if changes.is_empty() {
            self.quic_shadow = Some(current);
            return Ok(0);
        }
        let key = |(vip, id): state::QuicServerKey| QuicServerKey { vip, _pad: 0, id };
        // On failure the shadow stays unset, so the next sync reads the map again.
        for &(k, backend) in &changes.write {
            self.set_quic_server(&key(k), backend)
                .with_context(|| format!("VIP {}, server ID {:#x}", k.0, k.1))?;
        }
        for &k in &changes.delete {
            self.remove_quic_server(&key(k))
                .with_context(|| format!("VIP {}, server ID {:#x}", k.0, k.1))?;
        }
        self.quic_shadow = Some(desired.clone());
        Ok(changes.write.len() + changes.delete.len())
    }

    /// Every entry of `TENANT_PREFIXES` as the kernel holds it: client prefix → tenant id.
    pub fn tenant_prefixes(&mut self) -> Result<BTreeMap<Cidr, u32>> {
        let m: LpmTrie<&mut MapData, TenantPrefix, u32> =
            LpmTrie::try_from(self.map(maps::TENANT_PREFIXES)?)?;
        let mut out = BTreeMap::new();
        for r in m.iter() {
            let (k, v) = r.context("reading TENANT_PREFIXES")?;
            // A key no prefix of ours makes is no entry this build wrote: left alone.
            if let Some(c) = tenant_cidr(&k) {
                out.insert(c, v);
            }
        }
        Ok(out)
    }

    /// The `TENANT_LIMITS` entries that are not all zero, by index.
    pub fn tenant_limits(&mut self) -> Result<BTreeMap<u32, TenantLimits>> {
        let a: Array<&mut MapData, TenantLimits> = Array::try_from(self.map(maps::TENANT_LIMITS)?)?;
        let mut out = BTreeMap::new();
        for i in 0..TENANT_SLOTS {
            let l = a.get(&i, 0).context("reading TENANT_LIMITS")?;
            if l != TenantLimits::default() {
                out.insert(i, l);
            }
        }
        Ok(out)
    }

    /// One tenant's new sessions on one VIP (index `vip_id * MAX_TENANTS + tenant`),
    /// summed over CPUs.
    pub fn tenant_stats(&mut self, index: u32) -> Result<TenantStats> {
        let a: PerCpuArray<&mut MapData, TenantStats> =
            PerCpuArray::try_from(self.map(maps::TENANT_STATS)?)?;
        let v = a.get(&index, 0).context("reading TENANT_STATS")?;
        Ok(v.iter()
            .fold(TenantStats::default(), |acc, s| acc.merged(s)))
    }

    /// Brings the tenant maps to `prefixes` and `limits` (non-zero `TENANT_LIMITS` entries
    /// by index), leftovers of a previous run included. The rate state and counters of the
    /// ids in `fresh` (assigned to a new name) are zeroed first, then the limits are
    /// written, then the prefixes (the trie, then the IPv4 table's words), and limits no
    /// longer wanted are zeroed last: a client is never sent to an id before its limits are
    /// there. Returns the entries and words written or deleted.
    pub fn sync_tenants(
        &mut self,
        prefixes: &BTreeMap<Cidr, u32>,
        limits: &BTreeMap<u32, TenantLimits>,
        fresh: &[u32],
    ) -> Result<usize> {
        let current = match self.tenant_shadow.take() {
            Some(s) => s,
            None => TenantShadow {
                prefixes: self.tenant_prefixes()?,
                limits: self.tenant_limits()?,
            },
        };
        // On failure the shadow stays unset, so the next sync reads the maps again.
        let mut n = 0;
        for &id in fresh {
            self.reset_tenant(id)?;
        }
        {
            let mut a: Array<&mut MapData, TenantLimits> =
                Array::try_from(self.map(maps::TENANT_LIMITS)?)?;
            for (&i, l) in limits {
                if current.limits.get(&i) != Some(l) {
                    a.set(i, l, 0)
                        .with_context(|| format!("writing TENANT_LIMITS[{i}]"))?;
                    n += 1;
                }
            }
        }
        {
            let mut m: LpmTrie<&mut MapData, TenantPrefix, u32> =
                LpmTrie::try_from(self.map(maps::TENANT_PREFIXES)?)?;
            for (c, &id) in prefixes {
                if current.prefixes.get(c) != Some(&id) {
                    m.insert(&tenant_key(c), id, 0)
                        .with_context(|| format!("writing the tenant prefix {c}"))?;
                    n += 1;
                }
            }
            for c in current
                .prefixes
                .keys()
                .filter(|c| !prefixes.contains_key(c))
            {
                let k = tenant_key(c);
                gone(m.remove(&k), || m.get(&k, 0))
                    .with_context(|| format!("removing the tenant prefix {c}"))?;
                n += 1;
            }
        }
        // After the trie, which holds every prefix: a /24 the table sends to the trie finds
        // its longer prefix there.
        n += self.tenant_v4.sync(prefixes);
        {
            let mut a: Array<&mut MapData, TenantLimits> =
                Array::try_from(self.map(maps::TENANT_LIMITS)?)?;
            for &i in current.limits.keys().filter(|i| !limits.contains_key(i)) {
                a.set(i, TenantLimits::default(), 0)
                    .with_context(|| format!("clearing TENANT_LIMITS[{i}]"))?;
                n += 1;
            }
        }
        self.tenant_shadow = Some(TenantShadow {
            prefixes: prefixes.clone(),
            limits: limits.clone(),
        });
        Ok(n)
    }

    /// Zeroes a tenant id's rate state and counters on every VIP.
    fn reset_tenant(&mut self, tenant: u32) -> Result<()> {
        let cpus = aya::util::nr_cpus().map_err(|(_, e)| anyhow!("counting CPUs: {e}"))?;
        let indexes: Vec<u32> = (0..MAX_VIPS)
            .map(|v| lb_common::tenant_index(v, tenant))
            .collect();
        let mut b: Array<&mut MapData, TenantBucket> =
            Array::try_from(self.map(maps::TENANT_BUCKETS)?)?;
        for &i in &indexes {
            b.set(i, TenantBucket::default(), 0)
                .with_context(|| format!("clearing TENANT_BUCKETS[{i}]"))?;
        }
        let mut st: PerCpuArray<&mut MapData, TenantStats> =
            PerCpuArray::try_from(self.map(maps::TENANT_STATS)?)?;
        for &i in &indexes {
            let zero = aya::maps::PerCpuValues::try_from(vec![TenantStats::default(); cpus])?;
            st.set(i, zero, 0)
                .with_context(|| format!("clearing TENANT_STATS[{i}]"))?;
        }
        Ok(())
    }

    pub fn remove_vip(&mut self, key: &VipKey) -> Result<()> {
        let mut m: HashMap<&mut MapData, VipKey, VipMeta> =
            HashMap::try_from(self.map(maps::VIPS)?)?;
        // The rings keep their contents and their shadows, so a VIP that later reuses the id
        // is still written as a diff against what the kernel really holds.
        m.remove(key).context("removing from VIPS")?;
        Ok(())
    }

    /// Makes `table` the live ring of the VIP at `key` and writes its settings. The ring
    /// keeps each slot's history (`ring_history::next`) from the live ring, unless the VIP is
    /// new or its ring size or id changed. Only the slots that differ from what its inactive
    /// ring holds are written, then `active_ring` flips in the same VIPS update, so the XDP
    /// program sees the old ring or the new one, never a mix. A table equal to the live one
    /// writes nothing. Returns the slots written.
    pub fn publish(&mut self, key: &VipKey, mut meta: VipMeta, table: &[u32]) -> Result<usize> {
        if table.len() != meta.ring_size as usize {
            bail!(
                "table has {} slots but the VIP's ring size is {}",
                table.len(),
                meta.ring_size
            );
        }
        let live = self.vip(key)?;
        let active = live.map(|m| m.active_ring & 1);
        if !self.shadows.contains_key(&meta.id) {
            // Maps this process created start zeroed. Reused (pinned) maps are unknown: the
            // live ring is read back, so its history survives a restart of the daemon, and
            // the inactive one is written in full.
            let mut rings = [0, 1].map(|_| vec![RingSlot::default(); RING_SIZE_MAX as usize]);
            if self.reused {
                for (ring, r) in (0..).zip(rings.iter_mut()) {
                    if live.is_some_and(|m| m.id == meta.id) && active == Some(ring) {
                        *r = self.read_ring(meta.id, ring)?;
                    } else {
                        r.fill(UNKNOWN_SLOT);
                    }
                }
            }
            self.shadows.insert(meta.id, RingShadow { rings });
        }
        let shadow = self.shadows.get_mut(&meta.id).expect("inserted above");
        let len = table.len();
        let slots = match (active, live) {
            (Some(a), Some(m)) if m.id == meta.id && m.ring_size == meta.ring_size => {
                let slots = ring_history::next(&shadow.rings[a as usize][..len], table);
                let same_settings = VipMeta {
                    active_ring: a,
                    ..meta
                } == m;
                if same_settings && shadow.rings[a as usize][..len] == *slots {
                    return Ok(0);
                }
                slots
            }
            _ => match self.saved_rings.remove(key) {
                Some(saved) if saved.len() == len => ring_history::next(&saved, table),
                _ => ring_history::first(table),
            },
        };
        let next = active.map_or(0, |a| a ^ 1);
        let base = (meta.id * RINGS_PER_VIP + next) * RING_SIZE_MAX;
        let old = &mut shadow.rings[next as usize];
        let changes: Vec<(u32, RingSlot)> = maglev::diff(&old[..len], &slots).collect();
        let map = self
            .ebpf
            .map_mut(maps::MAGLEV_RINGS)
            .ok_or_else(|| anyhow!("map MAGLEV_RINGS missing"))?;
        let mut rings: Array<&mut MapData, RingSlot> = Array::try_from(map)?;
        for &(slot, s) in &changes {
            // On failure the inactive ring is half-written but not live; the shadow records
            // what landed, so the next attempt writes the rest.
            rings
                .set(base + slot, s, 0)
                .with_context(|| format!("writing ring slot {slot}"))?;
            old[slot as usize] = s;
        }
        meta.active_ring = next;
        self.set_vip(key, &meta)?;
        Ok(changes.len())
    }

    /// Rings saved by a previous daemon (`ring_store`), for this one's first tables: a VIP
    /// whose ring is not in these maps yet continues the saved ring's history when its slot
    /// count matches.
    pub fn seed_rings(&mut self, rings: crate::ring_store::Rings) {
        self.saved_rings.extend(rings);
    }

    /// Every VIP's live ring, as [`Dataplane::live_ring`] reads it.
    pub fn live_rings(&mut self) -> Result<crate::ring_store::Rings> {
        let keys: Vec<VipKey> = {
            let m: HashMap<&mut MapData, VipKey, VipMeta> =
                HashMap::try_from(self.map(maps::VIPS)?)?;
            m.keys().collect::<Result<_, _>>().context("reading VIPS")?
        };
        let mut rings = Vec::new();
        for key in keys {
            if let Some(ring) = self.live_ring(&key)? {
                rings.push((key, ring));
            }
        }
        Ok(rings)
    }

    /// The live ring of the VIP at `key` as the kernel holds it (`ring_size` slots), or
    /// `None` if there is no such VIP.
    pub fn live_ring(&mut self, key: &VipKey) -> Result<Option<Vec<RingSlot>>> {
        let Some(m) = self.vip(key)? else {
            return Ok(None);
        };
        let mut ring = self.read_ring(m.id, m.active_ring & 1)?;
        ring.truncate(m.ring_size as usize);
        Ok(Some(ring))
    }

    /// All `RING_SIZE_MAX` slots of one of a VIP's rings, read from the kernel.
    fn read_ring(&mut self, vip_id: u32, ring: u32) -> Result<Vec<RingSlot>> {
        let rings: Array<&mut MapData, RingSlot> = Array::try_from(self.map(maps::MAGLEV_RINGS)?)?;
        let base = (vip_id * RINGS_PER_VIP + ring) * RING_SIZE_MAX;
        (base..base + RING_SIZE_MAX)
            .map(|i| {
                rings
                    .get(&i, 0)
                    .with_context(|| format!("reading ring slot {}", i - base))
            })
            .collect()
    }

    pub fn conn(&mut self, key: &FlowKey) -> Result<Option<ConnEntry>> {
        self.hash_get(maps::CONNS, key)
    }

    /// Writes one connection-table entry (tests age a flow's in-band times with it).
    pub fn set_conn(&mut self, key: &FlowKey, e: &ConnEntry) -> Result<()> {
        self.hash_set(maps::CONNS, key, e)
    }

    /// A client's affinity entry for one VIP.
    pub fn affinity(&mut self, key: &AffinityKey) -> Result<Option<AffinityEntry>> {
        self.hash_get(maps::AFFINITY, key)
    }

    /// Writes one affinity entry (tests age a client's entry with it).
    pub fn set_affinity(&mut self, key: &AffinityKey, e: &AffinityEntry) -> Result<()> {
        self.hash_set(maps::AFFINITY, key, e)
    }

    /// Routes a VIP's QUIC-LB server ID to backend `id`.
    pub fn set_quic_server(&mut self, key: &QuicServerKey, id: u32) -> Result<()> {
        self.hash_set(maps::QUIC_SERVERS, key, &id)
    }

    /// Stops routing a server ID; one that is not there is no error.
    pub fn remove_quic_server(&mut self, key: &QuicServerKey) -> Result<()> {
        let mut m: HashMap<&mut MapData, QuicServerKey, u32> =
            HashMap::try_from(self.map(maps::QUIC_SERVERS)?)?;
        gone(m.remove(key), || m.get(key, 0)).context("removing from QUIC_SERVERS")
    }

    /// Every connection-table entry (a snapshot; entries may change while it is taken).
    pub fn conns(&mut self) -> Result<Vec<(FlowKey, ConnEntry)>> {
        let fd = self.conns_fd()?;
        let mut out = vec![];
        crate::flowwalk::walk(fd.as_fd(), |k, v| {
            out.push((*k, *v));
            true
        })?;
        Ok(out)
    }

    /// A descriptor of its own for the connection table, for readers on other threads (the
    /// flow walker).
    pub fn conns_fd(&mut self) -> Result<OwnedFd> {
        let data = match self.map(maps::CONNS)? {
            aya::maps::Map::LruHashMap(d) | aya::maps::Map::HashMap(d) => d,
            _ => bail!("map CONNS is not a hash map"),
        };
        data.fd()
            .as_fd()
            .try_clone_to_owned()
            .context("duplicating the connection table's descriptor")
    }

    pub fn clear_conns(&mut self) -> Result<()> {
        let keys: Vec<FlowKey> = self.conns()?.into_iter().map(|(k, _)| k).collect();
        let mut m: HashMap<&mut MapData, FlowKey, ConnEntry> =
            HashMap::try_from(self.map(maps::CONNS)?)?;
        for k in keys {
            let _ = m.remove(&k);
        }
        Ok(())
    }

    /// Global counters summed over CPUs, indexed by `lb_common::stat`.
    pub fn stats(&mut self) -> Result<Vec<u64>> {
        let a: PerCpuArray<&mut MapData, u64> = PerCpuArray::try_from(self.map(maps::STATS)?)?;
        (0..stat::COUNT)
            .map(|i| Ok(sum_u64(&a.get(&i, 0)?)))
            .collect()
    }

    fn traffic(&mut self, map: &str, id: u32) -> Result<TrafficStats> {
        let a: PerCpuArray<&mut MapData, TrafficStats> = PerCpuArray::try_from(self.map(map)?)?;
        let v = a.get(&id, 0)?;
        Ok(v.iter()
            .fold(TrafficStats::default(), |acc, s| acc.merged(s)))
    }

    pub fn vip_stats(&mut self, vip_id: u32) -> Result<TrafficStats> {
        self.traffic(maps::VIP_STATS, vip_id)
    }

    pub fn backend_stats(&mut self, backend_id: u32) -> Result<TrafficStats> {
        self.traffic(maps::BACKEND_STATS, backend_id)
    }

    /// A backend's in-band aggregates summed over CPUs.
    pub fn inband_stats(&mut self, backend_id: u32) -> Result<InbandStats> {
        let a: PerCpuArray<&mut MapData, InbandStats> =
            PerCpuArray::try_from(self.map(maps::INBAND_STATS)?)?;
        let v = a.get(&backend_id, 0)?;
        Ok(v.iter()
            .fold(InbandStats::default(), |acc, s| acc.merged(s)))
    }
}
