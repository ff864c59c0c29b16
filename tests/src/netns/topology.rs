//! The lab's segment: the switch, the hosts plugged into it, their addresses and routes, and
//! the processes started in their namespaces.

use std::{
    ffi::OsStr,
    io::{BufRead, BufReader},
    net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr, UdpSocket},
    os::unix::process::CommandExt,
    path::Path,
    process::{Child, Stdio},
    sync::{
        atomic::{AtomicUsize, Ordering},
        mpsc::{self, Receiver, RecvTimeoutError},
    },
    thread,
    time::{Duration, Instant},
};

use anyhow::{anyhow, bail, Context, Result};

use super::{
    cmd::{ip, require_lab_prerequisites, shown, tool},
    namespace::{sweep_stale, Netns},
    BACKEND_V4_BASE, BRIDGE, CLIENT_V4, CLIENT_V6, DEV, GATEWAY_V4, GATEWAY_V6, LB_V4, LB_V6,
    NS_PREFIX, PREFIX_LEN_V4, PREFIX_LEN_V6, VIP4, VIP6, VIP_NET_V4, VIP_NET_V6, VIP_ROUTE_MTU,
};

static LAB_COUNTER: AtomicUsize = AtomicUsize::new(0);

/// A host on the segment: its own namespace with `eth0`, plugged into the bridge through the
/// switch-side veth `port`.
#[derive(Clone, Debug)]
pub struct Host {
    /// `client`, `lb` or the backend's name.
    pub name: String,
    pub ns: Netns,
    pub v4: Ipv4Addr,
    pub v6: Ipv6Addr,
    pub mac: [u8; 6],
    /// The bridge port (in the switch namespace) this host's `eth0` is paired with.
    pub port: String,
}

impl Host {
    pub fn addr(&self, v6: bool) -> IpAddr {
        if v6 {
            self.v6.into()
        } else {
            self.v4.into()
        }
    }

    pub fn ifindex(&self) -> Result<u32> {
        self.ns.ifindex(DEV)
    }

    pub fn mac_string(&self) -> String {
        mac_string(&self.mac)
    }
}

pub fn mac_string(m: &[u8; 6]) -> String {
    m.iter()
        .map(|b| format!("{b:02x}"))
        .collect::<Vec<_>>()
        .join(":")
}

/// What [`Topology::build`] makes.
#[derive(Clone, Debug)]
pub struct TopologySpec {
    /// Backend names: short (1 to 8 characters, ASCII letters and digits), unique.
    pub backends: Vec<String>,
    /// MTU of every link of the segment (the bridge takes its ports' MTU).
    pub mtu: u32,
    /// MTU of the client's routes to the VIPs.
    pub vip_route_mtu: u32,
}

impl Default for TopologySpec {
    fn default() -> Self {
        Self::with_backends(3)
    }
}

impl TopologySpec {
    /// Backends named b0, b1, ...
    pub fn with_backends(n: usize) -> Self {
        Self {
            backends: (0..n).map(|i| format!("b{i}")).collect(),
            mtu: 1500,
            vip_route_mtu: VIP_ROUTE_MTU,
        }
    }
}

/// Identifies a process started by [`Topology::spawn`].
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct ProcId(usize);

struct Proc {
    label: String,
    child: Child,
    lines: Receiver<String>,
    /// Lines received while waiting for another one.
    seen: Vec<String>,
}

/// The namespaces, links and addresses of the lab, and the processes started in it. Dropping
/// it kills those processes (SIGTERM, then SIGKILL after 2 s) and deletes every namespace.
pub struct Topology {
    /// `sl<pid>-<n>`: the prefix of every namespace name of this lab.
    pub id: String,
    /// The switch: bridge `br0`, with the router addresses [`GATEWAY_V4`]/[`GATEWAY_V6`].
    pub switch: Netns,
    pub gateway_mac: [u8; 6],
    pub client: Host,
    pub lb: Host,
    pub backends: Vec<Host>,
    /// Link MTU and the client's VIP-route MTU (from the spec).
    mtu: u32,
    vip_route_mtu: u32,
    namespaces: Vec<Netns>,
    procs: Vec<Proc>,
}

/// An LB host forwards (bpf_fib_lookup needs it) and sends no redirects.
const LB_SYSCTLS: [(&str, &str); 4] = [
    ("net/ipv4/ip_forward", "1"),
    ("net/ipv6/conf/all/forwarding", "1"),
    ("net/ipv4/conf/all/send_redirects", "0"),
    ("net/ipv4/conf/default/send_redirects", "0"),
];

const MAC_BASE: [u8; 5] = [0x02, 0x5c, 0x00, 0x00, 0x00];

fn host_mac(last: u8) -> [u8; 6] {
    let mut m = [0; 6];
    m[..5].copy_from_slice(&MAC_BASE);
    m[5] = last;
    m
}

impl Topology {
    /// Builds the namespaces, bridge, veth pairs, addresses, routes and sysctls; no XDP yet.
    /// On error, what was built is removed.
    pub fn build(spec: &TopologySpec) -> Result<Topology> {
        require_lab_prerequisites()?;
        if spec.backends.is_empty() || spec.backends.len() > 64 {
            bail!("a lab has 1 to 64 backends, not {}", spec.backends.len());
        }
        for (i, n) in spec.backends.iter().enumerate() {
            if n.is_empty()
                || n.len() > 8
                || !n.bytes().all(|b| b.is_ascii_alphanumeric())
                || ["client", "lb", "sw"].contains(&n.as_str())
                || spec.backends[..i].contains(n)
            {
                bail!("bad backend name {n:?}: 1 to 8 letters/digits, unique, not client/lb/sw");
            }
        }
        let swept = sweep_stale();
        if !swept.is_empty() {
            eprintln!(
                "netns lab: removed {} namespaces left by a dead run: {}",
                swept.len(),
                swept.join(" ")
            );
        }
        let id = format!(
            "{NS_PREFIX}{}-{}",
            std::process::id(),
            LAB_COUNTER.fetch_add(1, Ordering::Relaxed)
        );
        let ns = |short: &str| Netns {
            name: format!("{id}-{short}"),
        };
        let host = |name: &str, v4: Ipv4Addr, v6: Ipv6Addr, mac_last: u8| Host {
            name: name.to_string(),
            ns: ns(name),
            v4,
            v6,
            mac: host_mac(mac_last),
            port: format!("v-{name}"),
        };
        let backends = spec
            .backends
            .iter()
            .enumerate()
            .map(|(i, n)| {
                let last = BACKEND_V4_BASE + i as u8;
                host(
                    n,
                    Ipv4Addr::new(10, 111, 0, last),
                    // fd00:111::<the same digits>
                    format!("fd00:111::{last}").parse().unwrap(),
                    last,
                )
            })
            .collect();
        let mut t = Topology {
            switch: ns("sw"),
            gateway_mac: host_mac(1),
            client: host("client", CLIENT_V4, CLIENT_V6, 10),
            lb: host("lb", LB_V4, LB_V6, 2),
            backends,
            id,
            mtu: spec.mtu,
            vip_route_mtu: spec.vip_route_mtu,
            namespaces: Vec::new(),
            procs: Vec::new(),
        };
        t.wire()
            .with_context(|| format!("building the namespace lab {}", t.id))?;
        Ok(t)
    }

    fn add_ns(&mut self, ns: &Netns) -> Result<()> {
        ip(&["netns", "add", ns.name()])?;
        self.namespaces.push(ns.clone());
        // Addresses are usable at once (no duplicate address detection on a lab segment),
        // and no router advertisements change routes behind a test's back.
        for (k, v) in [
            ("net/ipv6/conf/all/accept_dad", "0"),
            ("net/ipv6/conf/default/accept_dad", "0"),
            ("net/ipv6/conf/all/accept_ra", "0"),
            ("net/ipv6/conf/default/accept_ra", "0"),
        ] {
            ns.sysctl(k, v)?;
        }
        ns.ip(&["link", "set", "lo", "up"])?;
        Ok(())
    }

    fn wire(&mut self) -> Result<()> {
        // The switch: a bridge without STP or multicast snooping (neighbour discovery's
        // multicast is flooded), which is also the segment's router.
        let sw = self.switch.clone();
        self.add_ns(&sw)?;
        for (k, v) in [
            ("net/ipv4/ip_forward", "1"),
            ("net/ipv6/conf/all/forwarding", "1"),
            ("net/ipv4/conf/all/send_redirects", "0"),
            ("net/ipv4/conf/default/send_redirects", "0"),
        ] {
            sw.sysctl(k, v)?;
        }
        let gw_mac = mac_string(&self.gateway_mac);
        sw.ip(&[
            "link",
            "add",
            BRIDGE,
            "address",
            &gw_mac,
            "type",
            "bridge",
            "stp_state",
            "0",
            "mcast_snooping",
            "0",
        ])?;
        sw.ip(&[
            "addr",
            "add",
            &format!("{GATEWAY_V4}/{PREFIX_LEN_V4}"),
            "dev",
            BRIDGE,
        ])?;
        sw.ip(&[
            "addr",
            "add",
            &format!("{GATEWAY_V6}/{PREFIX_LEN_V6}"),
            "dev",
            BRIDGE,
            "nodad",
        ])?;
        sw.ip(&["link", "set", BRIDGE, "up"])?;

        let mut hosts = vec![self.client.clone(), self.lb.clone()];
        hosts.extend(self.backends.iter().cloned());
        for h in &hosts {
            self.add_ns(&h.ns)?;
            // Before the link exists, so eth0 inherits the defaults.
            if h.name == "lb" {
                for (k, v) in LB_SYSCTLS {
                    h.ns.sysctl(k, v)?;
                }
            }
            self.plug(h)?;
        }

        // The client reaches the VIPs through the LB.
        let c = &self.client.ns;
        let mtu = self.vip_route_mtu.to_string();
        for (net, via) in [
            (VIP_NET_V4, IpAddr::from(LB_V4)),
            (VIP_NET_V6, IpAddr::from(LB_V6)),
        ] {
            c.ip(&[
                "route",
                "add",
                net,
                "via",
                &via.to_string(),
                "dev",
                DEV,
                "mtu",
                &mtu,
            ])?;
        }

        // Backends: the VIPs on lo; answer ARP only for eth0's own address and announce it
        // (never a VIP); no reverse-path filter (decapsulated packets come from anywhere).
        for b in self.backends.clone() {
            for (k, v) in [
                ("net/ipv4/conf/all/rp_filter", "0"),
                ("net/ipv4/conf/default/rp_filter", "0"),
                ("net/ipv4/conf/lo/rp_filter", "0"),
                ("net/ipv4/conf/eth0/rp_filter", "0"),
                ("net/ipv4/conf/all/arp_ignore", "1"),
                ("net/ipv4/conf/all/arp_announce", "2"),
            ] {
                b.ns.sysctl(k, v)?;
            }
            for vip in [IpAddr::from(VIP4), IpAddr::from(VIP6)] {
                self.add_backend_vip(&b, vip)?;
            }
        }
        Ok(())
    }

    /// Creates the veth pair for `h` (switch port and `eth0`, each made directly in its
    /// namespace), addresses eth0 and turns tx checksum offload off on both ends.
    fn plug(&self, h: &Host) -> Result<()> {
        let sw = &self.switch;
        let mac = h.mac_string();
        sw.ip(&[
            "link",
            "add",
            &h.port,
            "type",
            "veth",
            "peer",
            "name",
            DEV,
            "netns",
            h.ns.name(),
            "address",
            &mac,
        ])?;
        let mtu = self.mtu.to_string();
        sw.ip(&["link", "set", &h.port, "mtu", &mtu])?;
        h.ns.ip(&["link", "set", DEV, "mtu", &mtu])?;
        sw.ip(&["link", "set", &h.port, "master", BRIDGE, "up"])?;
        h.ns.ip(&[
            "addr",
            "add",
            &format!("{}/{PREFIX_LEN_V4}", h.v4),
            "dev",
            DEV,
        ])?;
        h.ns.ip(&[
            "addr",
            "add",
            &format!("{}/{PREFIX_LEN_V6}", h.v6),
            "dev",
            DEV,
            "nodad",
        ])?;
        h.ns.ip(&["link", "set", DEV, "up"])?;
        // With tx checksumming on, veth hands on CHECKSUM_PARTIAL packets whose checksum is
        // never filled in once XDP has rewritten them.
        let ethtool = tool("ethtool")?;
        let ethtool = ethtool.to_string_lossy();
        h.ns.exec(ethtool.as_ref(), &["-K", DEV, "tx", "off"])?;
        sw.exec(ethtool.as_ref(), &["-K", &h.port, "tx", "off"])?;
        Ok(())
    }

    /// Adds another load-balancer host `name` on the segment (10.111.0.`last`,
    /// fd00:111::`last`, forwarding on, like [`Topology::lb`]); removed with the topology.
    /// The fleet lab runs several LB hosts behind the router.
    pub fn add_lb_host(&mut self, name: &str, last: u8) -> Result<Host> {
        let h = Host {
            name: name.to_string(),
            ns: Netns {
                name: format!("{}-{name}", self.id),
            },
            v4: Ipv4Addr::new(10, 111, 0, last),
            v6: format!("fd00:111::{last}").parse()?,
            mac: host_mac(last),
            port: format!("v-{name}"),
        };
        self.add_ns(&h.ns)?;
        for (k, v) in LB_SYSCTLS {
            h.ns.sysctl(k, v)?;
        }
        self.plug(&h)?;
        Ok(h)
    }

    /// Puts `vip` on backend `b`'s `lo` (IPv4 /32 or IPv6 /128).
    pub fn add_backend_vip(&self, b: &Host, vip: IpAddr) -> Result<()> {
        let cidr = match vip {
            IpAddr::V4(a) => format!("{a}/32"),
            IpAddr::V6(a) => format!("{a}/128"),
        };
        b.ns.ip(&["addr", "add", &cidr, "dev", "lo"])?;
        Ok(())
    }

    pub fn backend(&self, name: &str) -> Option<&Host> {
        self.backends.iter().find(|b| b.name == name)
    }

    /// Every namespace of the lab, the switch first.
    pub fn namespaces(&self) -> &[Netns] {
        &self.namespaces
    }

    /// Makes `from` resolve the link-layer addresses of `targets` (as a ping would): sends a
    /// datagram to the discard port of each until the neighbour entry is usable, for at most
    /// `timeout`. `bpf_fib_lookup` only returns next hops the kernel has resolved.
    pub fn resolve_neighbours(
        &self,
        from: &Host,
        targets: &[IpAddr],
        timeout: Duration,
    ) -> Result<()> {
        let deadline = Instant::now() + timeout;
        let mut pending: Vec<IpAddr> = targets.to_vec();
        while !pending.is_empty() {
            let probe = pending.clone();
            from.ns.run(move || -> Result<()> {
                for a in probe {
                    let bind: SocketAddr = if a.is_ipv4() {
                        (Ipv4Addr::UNSPECIFIED, 0).into()
                    } else {
                        (Ipv6Addr::UNSPECIFIED, 0).into()
                    };
                    let s = UdpSocket::bind(bind)?;
                    // The discard port: nothing listens, the backend answers port unreachable.
                    let _ = s.send_to(b"sluice neighbour probe", (a, 9));
                }
                Ok(())
            })??;
            let step_end = (Instant::now() + Duration::from_millis(300)).min(deadline);
            loop {
                let mut still = Vec::new();
                for a in &pending {
                    if from.ns.neighbour(*a, DEV)?.is_none() {
                        still.push(*a);
                    }
                }
                pending = still;
                if pending.is_empty() || Instant::now() >= step_end {
                    break;
                }
                thread::sleep(Duration::from_millis(10));
            }
            if !pending.is_empty() && Instant::now() >= deadline {
                bail!(
                    "{} did not resolve the link-layer address of {:?} within {timeout:?}",
                    from.name,
                    pending
                );
            }
        }
        Ok(())
    }

    /// Makes the LB resolve the link-layer addresses (IPv4 and IPv6) of every backend, so
    /// `bpf_fib_lookup` finds them ([`Topology::resolve_neighbours`]).
    pub fn resolve_backend_neighbours(&self, timeout: Duration) -> Result<()> {
        let targets: Vec<IpAddr> = self
            .backends
            .iter()
            .flat_map(|b| [b.addr(false), b.addr(true)])
            .collect();
        self.resolve_neighbours(&self.lb, &targets, timeout)
    }

    /// Starts `sluice-testsrv serve --name <name> --max-seconds <lifetime> <args>` on backend
    /// `index` and waits (10 s at most) until it prints READY.
    pub fn start_server(
        &mut self,
        index: usize,
        server: &Path,
        name: &str,
        lifetime: Duration,
        args: &[String],
    ) -> Result<ProcId> {
        if !server.is_file() {
            bail!("server binary {} does not exist", server.display());
        }
        let host = self
            .backends
            .get(index)
            .ok_or_else(|| anyhow!("no backend {index}"))?;
        let ns = host.ns.clone();
        let label = format!("server {name} on {}", host.name);
        let mut all: Vec<String> = vec![
            "serve".into(),
            "--name".into(),
            name.into(),
            "--max-seconds".into(),
            lifetime.as_secs().max(1).to_string(),
        ];
        all.extend_from_slice(args);
        let id = self.spawn(&ns, &label, server, &all)?;
        self.wait_line(id, "READY", Duration::from_secs(10))?;
        Ok(id)
    }

    /// Starts `program args...` in `ns` (`ip netns exec`), in its own process group (a
    /// terminal's Ctrl-C reaches only the test or demo, which then cleans up). Its stdout is
    /// read line by line ([`Topology::wait_line`]); stderr is inherited. The process gets
    /// SIGKILL if the thread that spawned it exits (so spawn from the thread that owns the
    /// topology), and is stopped when the topology is dropped.
    pub fn spawn(
        &mut self,
        ns: &Netns,
        label: &str,
        program: impl AsRef<OsStr>,
        args: &[String],
    ) -> Result<ProcId> {
        let mut cmd = ns.command(program);
        cmd.args(args)
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::inherit())
            .process_group(0);
        unsafe {
            cmd.pre_exec(|| {
                if libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGKILL) != 0 {
                    return Err(std::io::Error::last_os_error());
                }
                Ok(())
            });
        }
        let line = shown(&cmd);
        let mut child = cmd.spawn().with_context(|| format!("starting `{line}`"))?;
        let (tx, rx) = mpsc::channel();
        let out = child.stdout.take().expect("piped");
        thread::spawn(move || {
            for l in BufReader::new(out).lines() {
                let Ok(l) = l else { break };
                if tx.send(l).is_err() {
                    break;
                }
            }
        });
        self.procs.push(Proc {
            label: label.to_string(),
            child,
            lines: rx,
            seen: Vec::new(),
        });
        Ok(ProcId(self.procs.len() - 1))
    }

    /// Waits (at most `timeout`) for a line of the process's stdout that starts with
    /// `prefix`, and returns it. Fails if the process exits first.
    pub fn wait_line(&mut self, id: ProcId, prefix: &str, timeout: Duration) -> Result<String> {
        let deadline = Instant::now() + timeout;
        let p = &mut self.procs[id.0];
        if let Some(i) = p.seen.iter().position(|l| l.starts_with(prefix)) {
            return Ok(p.seen.remove(i));
        }
        loop {
            let left = deadline.saturating_duration_since(Instant::now());
            match p.lines.recv_timeout(left.min(Duration::from_millis(100))) {
                Ok(l) if l.starts_with(prefix) => return Ok(l),
                Ok(l) => p.seen.push(l),
                Err(RecvTimeoutError::Timeout) => {}
                Err(RecvTimeoutError::Disconnected) => {
                    let status = p.child.try_wait().ok().flatten();
                    bail!(
                        "{} closed its output (exit: {status:?}) before printing {prefix:?}",
                        p.label
                    );
                }
            }
            if Instant::now() >= deadline {
                bail!("{} did not print {prefix:?} within {timeout:?}", p.label);
            }
        }
    }

    pub fn pid(&self, id: ProcId) -> u32 {
        self.procs[id.0].child.id()
    }

    /// Sends `signal` (e.g. `libc::SIGKILL` for a crash) to the process.
    pub fn signal(&mut self, id: ProcId, signal: i32) -> Result<()> {
        let pid = self.pid(id) as i32;
        if unsafe { libc::kill(pid, signal) } != 0 {
            return Err(std::io::Error::last_os_error())
                .with_context(|| format!("kill({pid}, {signal})"));
        }
        Ok(())
    }

    /// Whether the process has exited, with its status (reaps it).
    pub fn try_wait(&mut self, id: ProcId) -> Result<Option<std::process::ExitStatus>> {
        Ok(self.procs[id.0].child.try_wait()?)
    }

    /// Waits at most `timeout` for the process to exit.
    pub fn wait_exit(&mut self, id: ProcId, timeout: Duration) -> Result<std::process::ExitStatus> {
        let deadline = Instant::now() + timeout;
        loop {
            if let Some(s) = self.procs[id.0].child.try_wait()? {
                return Ok(s);
            }
            if Instant::now() >= deadline {
                bail!("{} did not exit within {timeout:?}", self.procs[id.0].label);
            }
            thread::sleep(Duration::from_millis(10));
        }
    }

    /// Stops every process (SIGTERM, SIGKILL after 2 s) and deletes every namespace. Called by
    /// drop; call it directly to see the errors.
    pub fn teardown(&mut self) -> Result<()> {
        let mut errors = Vec::new();
        for p in &mut self.procs {
            if let Ok(None) = p.child.try_wait() {
                unsafe { libc::kill(p.child.id() as i32, libc::SIGTERM) };
            }
        }
        let deadline = Instant::now() + Duration::from_secs(2);
        for p in &mut self.procs {
            loop {
                match p.child.try_wait() {
                    Ok(Some(_)) | Err(_) => break,
                    Ok(None) if Instant::now() >= deadline => {
                        let _ = p.child.kill();
                        let _ = p.child.wait();
                        break;
                    }
                    Ok(None) => thread::sleep(Duration::from_millis(5)),
                }
            }
        }
        self.procs.clear();
        for ns in self.namespaces.drain(..).rev() {
            // Anything else still running in it (a daemon's children, a leaked helper).
            for pid in ns.pids().unwrap_or_default() {
                unsafe { libc::kill(pid, libc::SIGKILL) };
            }
            if let Err(e) = ip(&["netns", "del", ns.name()]) {
                errors.push(format!("{e:#}"));
            }
        }
        if !errors.is_empty() {
            bail!("tearing down the lab: {}", errors.join("; "));
        }
        Ok(())
    }
}

impl Drop for Topology {
    fn drop(&mut self) {
        if let Err(e) = self.teardown() {
            eprintln!("netns lab {}: {e:#}", self.id);
        }
    }
}
