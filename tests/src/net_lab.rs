//! The namespace lab with Sluice in it: the [`Topology`] of `netns` plus Sluice on the LB,
//! `sluice backend-host` on every backend, an XDP_PASS program on the LB's switch port (native
//! XDP_TX on a veth is only delivered when the peer has an XDP program), the VIPs, the servers,
//! and resolved neighbours.

use std::{
    net::{IpAddr, SocketAddr},
    path::{Path, PathBuf},
    time::Duration,
};

use crate::{
    backend_host::{start_all, BackendHost, TempDir},
    daemon_lab,
    netns::*,
};
use anyhow::{anyhow, Context, Result};
use lb_common::{
    BackendEntry, FlowKey, LbConfig, VipKey, VipMeta, BACKEND_ACTIVE, FAMILY_V4, PROTO_TCP,
    PROTO_UDP,
};
use sluice::{
    addr::to_words,
    dataplane::{Dataplane, LoadOptions, PROG_XDP},
    maglev::{self, MaglevBackend},
    object::BPF_OBJECT,
};

/// A VIP of the lab and its backends.
#[derive(Clone, Debug)]
pub struct Service {
    pub key: VipKey,
    pub meta: VipMeta,
    pub addr: SocketAddr,
    pub proto: u8,
    /// `backend_ids[i]` is the data-plane id of backend `i` of the topology for this VIP.
    pub backend_ids: Vec<u32>,
}

impl Service {
    /// The index of the topology backend with this data-plane id.
    pub fn backend_index(&self, id: u32) -> Option<usize> {
        self.backend_ids.iter().position(|b| *b == id)
    }
}

/// What [`NetLab::start`] builds.
#[derive(Clone, Debug)]
pub struct LabOptions {
    pub topology: TopologySpec,
    /// The `sluice-testsrv` binary: one `serve` process per backend, streaming tokens on
    /// [`TCP_PORT`] and echoing on [`UDP_PORT`] of both VIPs. None: no servers.
    pub server: Option<PathBuf>,
    /// Servers exit on their own after this long (a bound if a cleanup is ever missed).
    pub server_lifetime: Duration,
    /// Conntrack capacity of the LB's data plane.
    pub conn_table_size: u32,
}

impl Default for LabOptions {
    fn default() -> Self {
        Self {
            topology: TopologySpec::default(),
            server: None,
            server_lifetime: Duration::from_secs(300),
            conn_table_size: 1 << 16,
        }
    }
}

/// The data-plane id of backend `index` for VIP `vip_id`.
pub fn backend_id(vip_id: u32, index: usize) -> u32 {
    vip_id * 64 + index as u32 + 1
}

/// The topology plus Sluice: `sluice_xdp` (native) on the LB's eth0, `sluice_pass` (native) on
/// the LB's switch port, `sluice backend-host run` on every backend (`sluice_decap`, native,
/// on eth0; see [`BackendHost`]), the default VIPs (TCP and UDP on [`VIP4`] and [`VIP6`],
/// every backend, equal weights), the servers, and the LB's neighbour entries for every
/// backend.
///
/// Fields drop in order: the data planes (detaching XDP) and backend hosts, their
/// directory, then the topology.
pub struct NetLab {
    /// Sluice on the LB.
    pub lb_dp: Dataplane,
    pub cfg: LbConfig,
    /// `sluice_pass` on the LB's switch port: accepts the LB's XDP_TX frames, and its `RX`
    /// counter counts every frame the LB namespace sends.
    pub edge_dp: Dataplane,
    /// The backend host daemon per backend (index as in `topo.backends`): its `DECAP_OK`
    /// counts the encapsulated packets the backend received.
    pub backend_hosts: Vec<BackendHost>,
    /// The backend hosts' configurations and logs.
    pub dir: TempDir,
    /// tcp4, tcp6, udp4, udp6 (VIP ids 0 to 3).
    pub services: Vec<Service>,
    /// The server process of each backend (if started).
    pub servers: Vec<ProcId>,
    pub topo: Topology,
}

impl NetLab {
    pub fn start(opts: &LabOptions) -> Result<NetLab> {
        let topo = Topology::build(&opts.topology)?;
        let lb_opts = LoadOptions {
            conn_table_size: opts.conn_table_size,
            affinity_table_size: 1 << 12,
            max_vips: 8,
            ..LoadOptions::default()
        };
        let mut lb_dp =
            Dataplane::load(BPF_OBJECT, &lb_opts).context("loading the LB's data plane")?;
        let (src4, _) = to_words(ENCAP_SRC_V4.into());
        let (src6, _) = to_words(ENCAP_SRC_V6.into());
        let cfg = LbConfig {
            encap_src_v4: src4[0],
            encap_src_v4_hostmask: u32::from_ne_bytes(ENCAP_SRC_V4_HOSTMASK),
            encap_src_v6: src6,
            encap_src_v6_hostmask: u32::MAX,
            hash_seed: SEED,
            // The segment's router: it routes what the FIB could not resolve.
            fallback_mac: topo.gateway_mac,
            ..Default::default()
        };
        lb_dp.set_config(&cfg)?;

        let edge_dp = switch_port(&topo)?;
        let sluice = daemon_lab::require_sluice_daemon_prerequisites()?;
        daemon_lab::sweep_stale();
        let id = daemon_lab::next_lab_id();
        let dir = TempDir::create(std::env::temp_dir().join(&id))?;
        let backend_hosts = start_all(
            &topo,
            &sluice,
            &[],
            &[IpAddr::from(VIP4), IpAddr::from(VIP6)],
            &id,
            &dir.0,
        )?;
        attach_native(&mut lb_dp, PROG_XDP, &topo.lb.ns, DEV)?;

        let mut lab = NetLab {
            lb_dp,
            cfg,
            edge_dp,
            backend_hosts,
            dir,
            services: Vec::new(),
            servers: Vec::new(),
            topo,
        };
        let all: Vec<usize> = (0..lab.topo.backends.len()).collect();
        lab.add_service(0, SocketAddr::new(VIP4.into(), TCP_PORT), PROTO_TCP, &all)?;
        lab.add_service(1, SocketAddr::new(VIP6.into(), TCP_PORT), PROTO_TCP, &all)?;
        lab.add_service(2, SocketAddr::new(VIP4.into(), UDP_PORT), PROTO_UDP, &all)?;
        lab.add_service(3, SocketAddr::new(VIP6.into(), UDP_PORT), PROTO_UDP, &all)?;

        if let Some(server) = &opts.server {
            lab.start_servers(server, opts.server_lifetime)?;
        }
        lab.topo
            .resolve_backend_neighbours(Duration::from_secs(5))?;
        Ok(lab)
    }

    /// Adds VIP `id` at `addr` (a port of 0: every port) served by the topology backends at
    /// `backends` (indexes), all active with equal weights; backends of an IPv6 VIP are
    /// addressed over IPv6, of an IPv4 VIP over IPv4. The VIP address must be on the
    /// backends' `lo` ([`Topology::add_backend_vip`]; [`VIP4`] and [`VIP6`] are).
    pub fn add_service(
        &mut self,
        id: u32,
        addr: SocketAddr,
        proto: u8,
        backends: &[usize],
    ) -> Result<&Service> {
        let (a, family) = to_words(addr.ip());
        let key = VipKey {
            addr: a,
            port: addr.port().to_be(),
            proto,
            family,
        };
        let meta = VipMeta {
            id,
            flags: 0,
            ring_size: RING,
            active_ring: 0,
            affinity_secs: 0,
            ..Default::default()
        };
        let mut ids = vec![0; self.topo.backends.len()];
        let mut keys = Vec::new();
        for &i in backends {
            let host = self
                .topo
                .backends
                .get(i)
                .ok_or_else(|| anyhow!("no backend {i}"))?;
            let baddr = host.addr(family != FAMILY_V4);
            let (w, f) = to_words(baddr);
            let bid = backend_id(id, i);
            self.lb_dp.set_backend(
                bid,
                &BackendEntry {
                    addr: w,
                    family: f,
                    state: BACKEND_ACTIVE,
                    vip: id,
                    ..Default::default()
                },
            )?;
            ids[i] = bid;
            keys.push((bid, baddr.to_string()));
        }
        let mb: Vec<MaglevBackend> = keys
            .iter()
            .map(|(id, k)| MaglevBackend {
                id: *id,
                key: k,
                weight: 1,
            })
            .collect();
        let table = maglev::build(&mb, RING, SEED)?;
        self.lb_dp.publish(&key, meta, &table)?;
        self.services.push(Service {
            key,
            meta,
            addr,
            proto,
            backend_ids: ids,
        });
        Ok(self.services.last().unwrap())
    }

    /// Starts `sluice-testsrv serve` on every backend and waits until each is listening.
    pub fn start_servers(&mut self, server: &Path, lifetime: Duration) -> Result<()> {
        let mut listen = Vec::new();
        for s in &self.services {
            let flag = if s.proto == PROTO_TCP {
                "--tcp"
            } else {
                "--udp"
            };
            listen.push(flag.to_string());
            listen.push(s.addr.to_string());
        }
        for i in 0..self.topo.backends.len() {
            let name = self.topo.backends[i].name.clone();
            let id = self
                .topo
                .start_server(i, server, &name, lifetime, &listen)?;
            self.servers.push(id);
        }
        Ok(())
    }

    pub fn service(&self, addr: SocketAddr, proto: u8) -> Option<&Service> {
        self.services
            .iter()
            .find(|s| s.addr == addr && s.proto == proto)
    }

    /// The backend name the LB's connection table holds for `flow`, if it has an entry.
    pub fn conn_backend(&mut self, flow: &FlowKey) -> Result<Option<String>> {
        let Some(e) = self.lb_dp.conn(flow)? else {
            return Ok(None);
        };
        Ok(self.backend_name(e.backend))
    }

    /// The topology name of the backend with this data-plane id.
    pub fn backend_name(&self, id: u32) -> Option<String> {
        self.services
            .iter()
            .find_map(|s| s.backend_index(id))
            .map(|i| self.topo.backends[i].name.clone())
    }

    /// A snapshot of every counter the lab keeps (see [`Counters`]).
    pub fn counters(&mut self) -> Result<Counters> {
        let lb = self.lb_dp.stats()?;
        let edge = self.edge_dp.stats()?;
        let mut decap = Vec::new();
        for h in &self.backend_hosts {
            decap.push(h.stats()?);
        }
        let mut vip_packets = 0;
        for s in &self.services {
            vip_packets += self.lb_dp.vip_stats(s.meta.id)?.packets;
        }
        Ok(Counters {
            lb,
            edge,
            decap,
            vip_packets,
            client_link: self.topo.client.ns.link_counters(DEV)?,
            lb_link: self.topo.lb.ns.link_counters(DEV)?,
        })
    }
}

/// Counters of the lab at one moment; [`Counters::since`] gives the traffic in between.
#[derive(Clone, Debug, Default)]
pub struct Counters {
    /// `sluice_xdp` on the LB, indexed by `lb_common::stat`.
    pub lb: Vec<u64>,
    /// `sluice_pass` on the LB's switch port: `stat::RX` = frames the LB namespace sent.
    pub edge: Vec<u64>,
    /// `sluice_decap` per backend (its backend host's pinned counters).
    pub decap: Vec<Vec<u64>>,
    /// Packets of every lab VIP seen by the LB (sum of VIP_STATS).
    pub vip_packets: u64,
    pub client_link: LinkCounters,
    pub lb_link: LinkCounters,
}

fn sub(a: &[u64], b: &[u64]) -> Vec<u64> {
    a.iter()
        .zip(b.iter().chain(std::iter::repeat(&0)))
        .map(|(x, y)| x.saturating_sub(*y))
        .collect()
}

impl Counters {
    pub fn since(&self, before: &Counters) -> Counters {
        Counters {
            lb: sub(&self.lb, &before.lb),
            edge: sub(&self.edge, &before.edge),
            decap: self
                .decap
                .iter()
                .zip(before.decap.iter())
                .map(|(a, b)| sub(a, b))
                .collect(),
            vip_packets: self.vip_packets.saturating_sub(before.vip_packets),
            client_link: self.client_link.since(&before.client_link),
            lb_link: self.lb_link.since(&before.lb_link),
        }
    }
}
