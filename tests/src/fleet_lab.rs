//! The fleet lab: several LB hosts behind a router that spreads each VIP over them with ECMP,
//! the routes learned over BGP from the BIRD 2 speaker each host's `sluice run` drives.
//!
//! ```text
//!                switch namespace <id>-sw: bridge br0 10.111.0.1 = the router
//!                bird (AS 65000): BGP + BFD with every LB host, ECMP routes into the kernel
//!                (merge paths; net.ipv4.fib_multipath_hash_policy = 1: L4 hash)
//!        v-client     v-lb (.2)      v-lb1 (.3)     v-lb2 (.4)      v-b0 v-b1 v-b2
//!           |            |              |              |              |    |    |
//!        client       lb: sluice run + bird (AS 65001), each         backends (decap,
//!        VIP route    with [bgp] and BFD; identical configurations   token servers)
//!        via .1
//! ```
//!
//! Built on the daemon lab ([`DaemonLab`]: topology, backend hosts, token servers, the first
//! LB host's daemon) with two more LB hosts (`Topology::add_lb_host`) whose configuration is
//! the first one's with their own paths: the same VIPs, backends and hash seed, so every host
//! builds the same Maglev tables and a flow that ECMP moves keeps its backend. The client
//! reaches the VIPs through the router, from [`CLIENT_SOURCES`] source addresses; backends
//! answer the client directly (DSR).
//!
//! Every BIRD and every extra daemon is started and stopped by the lab; dropping it (also
//! while a test panics) stops the daemons, removes their pins and the lab's directory, and
//! the topology's drop kills the BIRDs and deletes the namespaces.

use std::{
    collections::{BTreeMap, BTreeSet},
    fs::{self, File},
    io::Write,
    net::{IpAddr, Ipv4Addr, SocketAddr},
    path::{Path, PathBuf},
    process::{Child, Command},
    thread,
    time::{Duration, Instant},
};

use anyhow::{anyhow, bail, Context, Result};
use serde_json::Value;
use sluice::{
    announce::bird,
    client::Client,
    dataplane::{remove_pinned, Dataplane, LoadOptions, PROG_PASS},
    object::BPF_OBJECT,
};

use crate::{
    backend_host::{signal_and_wait, spawn_as_unit, NotifySocket},
    daemon_lab::{
        next_lab_id, tail, write_atomic, DaemonLab, DaemonLabOptions, Running, VipDef, CLI_TIMEOUT,
        START_TIMEOUT,
    },
    etcd::EtcdCluster,
    netns::{
        attach_native, run_output, tool, CmdOutput, Host, ProcId, DEV, GATEWAY_V4, TCP_PORT, VIP4,
        VIP_NET_V4,
    },
};

/// The lab's VIP: TCP on [`VIP4`].
pub const VIP: SocketAddr = SocketAddr::new(IpAddr::V4(VIP4), TCP_PORT);
/// BFD on both sides: 100 ms, 5 missed: a dead host is noticed within 500 ms.
pub const BFD_INTERVAL_MS: u64 = 100;
pub const BFD_MULTIPLIER: u64 = 5;
pub const ROUTER_AS: u32 = 65000;
pub const LB_AS: u32 = 65001;
/// Source addresses of the client behind the router.
pub const CLIENT_SOURCES: u8 = 16;
/// Bound on BGP sessions coming up and routes converging at start.
pub const CONVERGE_TIMEOUT: Duration = Duration::from_secs(30);
/// `[fleet]` of a lab on etcd: its key prefix and timers (a dead leader is replaced in 2 s).
pub const FLEET_PREFIX: &str = "/sluice-fleet-lab";
pub const FLEET_LEASE_TTL: &str = "2s";
pub const FLEET_REQUEST_TIMEOUT: &str = "500ms";

/// Host `k`'s name in the fleet (`[fleet] host`).
pub fn fleet_host(k: usize) -> String {
    format!("fleet-lb{k}")
}

fn fleet_host_line(k: usize) -> String {
    format!("host = {:?}", fleet_host(k))
}

fn endpoints_value(urls: &[String]) -> String {
    let q: Vec<String> = urls.iter().map(|u| format!("{u:?}")).collect();
    format!("[{}]", q.join(", "))
}

/// The BFD detection time the lab configures.
pub fn bfd_detect() -> Duration {
    Duration::from_millis(BFD_INTERVAL_MS * BFD_MULTIPLIER)
}

/// One LB host: its namespace, its daemon (the daemon lab's own for host 0) and its BIRD.
pub struct LbHost {
    pub host: Host,
    /// Configuration, admin socket, BIRD files and logs of this host.
    pub dir: PathBuf,
    pub socket: PathBuf,
    pub config: PathBuf,
    pub bpffs: PathBuf,
    daemon: Option<Child>,
    starts: usize,
    pub bird: Option<ProcId>,
}

impl LbHost {
    pub fn bird_socket(&self) -> PathBuf {
        self.dir.join("bird.ctl")
    }
    fn log_path(&self) -> PathBuf {
        self.dir
            .join(format!("daemon-{}.log", self.starts.saturating_sub(1)))
    }
    pub fn log(&self) -> String {
        fs::read_to_string(self.log_path()).unwrap_or_default()
    }
}

pub struct FleetLab {
    /// The client's source addresses ([`CLIENT_SOURCES`] of them).
    pub sources: Vec<IpAddr>,
    /// `hosts[0]` is the daemon lab's LB (its daemon is the lab's).
    pub hosts: Vec<LbHost>,
    pub router_bird: ProcId,
    /// The fleet's own directory (`sluice-lab-<pid>-<n>-fleet`).
    pub dir: PathBuf,
    /// `sluice_pass` on the extra hosts' switch ports.
    _edge: Dataplane,
    pub lab: DaemonLab,
}

fn bird_lb_conf(h: &Host, routes: &Path) -> String {
    format!(
        "# fleet lab: LB host {name}\n\
         router id {me};\n\
         protocol device {{ scan time 1; }}\n\
         include \"{routes}\";\n\
         protocol bfd {{\n  interface \"{DEV}\" {{ min rx interval {BFD_INTERVAL_MS} ms; \
         min tx interval {BFD_INTERVAL_MS} ms; multiplier {BFD_MULTIPLIER}; }};\n}}\n\
         protocol bgp uplink {{\n  local {me} as {LB_AS};\n  neighbor {GATEWAY_V4} as {ROUTER_AS};\n  \
         bfd on;\n  connect retry time 1;\n  error wait time 1, 2;\n  \
         ipv4 {{ import none; export where proto = \"{p4}\"; }};\n}}\n",
        name = h.name,
        me = h.v4,
        routes = routes.display(),
        p4 = bird::PROTO_V4,
    )
}

fn bird_router_conf(peers: &[Ipv4Addr]) -> String {
    let mut s = format!(
        "# fleet lab: the router\n\
         router id {GATEWAY_V4};\n\
         protocol device {{ scan time 1; }}\n\
         protocol kernel {{\n  ipv4 {{ import none; export all; }};\n  merge paths on limit 16;\n}}\n\
         protocol bfd {{\n  interface \"br0\" {{ min rx interval {BFD_INTERVAL_MS} ms; \
         min tx interval {BFD_INTERVAL_MS} ms; multiplier {BFD_MULTIPLIER}; }};\n}}\n\
         template bgp lb {{\n  local {GATEWAY_V4} as {ROUTER_AS};\n  bfd on;\n  \
         connect retry time 1;\n  error wait time 1, 2;\n  \
         ipv4 {{ import all; export none; }};\n}}\n"
    );
    for (i, p) in peers.iter().enumerate() {
        s += &format!("protocol bgp lb{i} from lb {{ neighbor {p} as {LB_AS}; }}\n");
    }
    s
}

impl FleetLab {
    /// Builds the lab with `hosts` LB hosts (1 to 3) and starts `running` of them (daemon and
    /// BIRD; the others can be started later with [`FleetLab::start_host`]). Waits until the
    /// router has a route to the VIP through every running host.
    pub fn start(server: &Path, hosts: usize, running: usize) -> Result<FleetLab> {
        Self::start_in(server, hosts, running, None)
    }

    /// [`FleetLab::start`] with every LB host in one fleet (`[fleet]`, host `k` named
    /// [`fleet_host`]`(k)`) on `etcd`, which each host's namespace is linked to.
    pub fn start_with_etcd(
        server: &Path,
        hosts: usize,
        running: usize,
        etcd: &mut EtcdCluster,
    ) -> Result<FleetLab> {
        Self::start_in(server, hosts, running, Some(etcd))
    }

    fn start_in(
        server: &Path,
        hosts: usize,
        running: usize,
        etcd: Option<&mut EtcdCluster>,
    ) -> Result<FleetLab> {
        if !(1..=3).contains(&hosts) || running > hosts || running == 0 {
            bail!("a fleet lab has 1 to 3 LB hosts and runs 1 to all of them");
        }
        let bird =
            tool("bird").context("the fleet lab runs BIRD 2 (Debian bird2; cargo xtask setup)")?;
        let started = Instant::now();
        let dir = std::env::temp_dir().join(format!("{}-fleet", next_lab_id()));
        let _ = fs::remove_dir_all(&dir);
        let mut opts = DaemonLabOptions::new(server, 3, vec![VipDef::tcp("chat", VIP, 3)]);
        let lb0 = dir.join("lb");
        fs::create_dir_all(&lb0).with_context(|| format!("creating {}", lb0.display()))?;
        let q = |p: PathBuf| format!("\"{}\"", p.display());
        opts.set("bgp", "control_socket", &q(lb0.join("bird.ctl")));
        opts.set("bgp", "routes_file", &q(lb0.join("routes.conf")));
        opts.set("bgp", "interval", "\"200ms\"");
        // Host 0's daemon starts before its namespace is linked to etcd: it configures the
        // URLs the link will give and catches up once linked.
        let urls0 = etcd.as_ref().map(|e| e.next_link_urls());
        if let Some(urls) = &urls0 {
            opts.set("fleet", "endpoints", &endpoints_value(urls))
                .set("fleet", "host", &format!("{:?}", fleet_host(0)))
                .set("fleet", "prefix", &format!("{FLEET_PREFIX:?}"))
                .set("fleet", "lease_ttl", &format!("{FLEET_LEASE_TTL:?}"))
                .set(
                    "fleet",
                    "request_timeout",
                    &format!("{FLEET_REQUEST_TIMEOUT:?}"),
                );
        }
        let mut lab = DaemonLab::start(opts).inspect_err(|_| {
            let _ = fs::remove_dir_all(&dir);
        })?;
        let r = Self::build(&mut lab, &dir, &bird, hosts, etcd);
        let (hosts_v, router_bird, edge) = match r {
            Ok(v) => v,
            Err(e) => {
                let _ = fs::remove_dir_all(&dir);
                return Err(e);
            }
        };
        let sources = lab.add_client_sources(CLIENT_SOURCES.into())?;
        let mut fleet = FleetLab {
            sources,
            hosts: hosts_v,
            router_bird,
            dir,
            _edge: edge,
            lab,
        };
        let router_ctl = fleet.dir.join("router-bird.ctl");
        fleet.wait_bird(fleet.router_bird, &router_ctl)?;
        fleet.start_bird(0)?;
        for k in 1..running {
            fleet.start_host(k)?;
        }
        let want: BTreeSet<Ipv4Addr> = (0..running).map(|k| fleet.hosts[k].host.v4).collect();
        fleet.wait_nexthops(&want, CONVERGE_TIMEOUT)?;
        eprintln!(
            "fleet lab {} up in {:?}: {running} of {hosts} LB hosts announce {VIP4}",
            fleet.dir.display(),
            started.elapsed()
        );
        Ok(fleet)
    }

    fn build(
        lab: &mut DaemonLab,
        dir: &Path,
        bird: &Path,
        hosts: usize,
        mut etcd: Option<&mut EtcdCluster>,
    ) -> Result<(Vec<LbHost>, ProcId, Dataplane)> {
        let base = lab.config_text();
        let topo = &mut lab.topo;
        let mut urls0 = vec![];
        if let Some(e) = etcd.as_deref_mut() {
            let want = e.next_link_urls();
            urls0 = e.link(&topo.lb.ns).context("linking host 0 to etcd")?;
            if urls0 != want {
                bail!("host 0 was configured with etcd at {want:?} but linked to {urls0:?}");
            }
        }
        // The router: ECMP over the LB hosts with an L4 hash; the client routes the VIPs
        // through it.
        topo.switch
            .sysctl("net/ipv4/fib_multipath_hash_policy", "1")?;
        topo.client.ns.ip(&[
            "route",
            "replace",
            VIP_NET_V4,
            "via",
            &GATEWAY_V4.to_string(),
            "dev",
            DEV,
            "mtu",
            "1400",
        ])?;
        let mut list = vec![LbHost {
            host: topo.lb.clone(),
            dir: dir.join("lb"),
            socket: lab.socket.clone(),
            config: lab.config.clone(),
            bpffs: lab.bpffs.clone(),
            daemon: None,
            starts: 0,
            bird: None,
        }];
        // Native XDP_TX from an LB host's eth0 is delivered only if its switch port runs XDP
        // (the daemon lab put one on the first host's).
        let mut edge = Dataplane::load(BPF_OBJECT, &LoadOptions::decap_only())
            .context("loading the switch ports' data plane")?;
        for k in 1..hosts {
            let name = format!("lb{k}");
            let h = topo.add_lb_host(&name, 2 + k as u8)?;
            attach_native(&mut edge, PROG_PASS, &topo.switch, &h.port)?;
            let hdir = dir.join(&name);
            fs::create_dir_all(&hdir)?;
            let bpffs = PathBuf::from(format!("{}-{name}", lab.bpffs.display()));
            // The first host's configuration with this host's paths: the same VIPs,
            // backends and seed, so the same Maglev tables.
            let mut text = base
                .replace(
                    &format!("{}/", dir.join("lb").display()),
                    &format!("{}/", hdir.display()),
                )
                .replace(
                    &format!("{}/", lab.dir.display()),
                    &format!("{}/", hdir.display()),
                )
                .replace(
                    &format!("\"{}\"", lab.bpffs.display()),
                    &format!("\"{}\"", bpffs.display()),
                );
            // In a fleet: this host's name and its own link's etcd URLs.
            if let Some(e) = etcd.as_deref_mut() {
                let urls = e
                    .link(&h.ns)
                    .with_context(|| format!("linking {name} to etcd"))?;
                text = text
                    .replace(&fleet_host_line(0), &fleet_host_line(k))
                    .replace(&endpoints_value(&urls0), &endpoints_value(&urls));
                if !text.contains(&fleet_host_line(k)) || !text.contains(&endpoints_value(&urls)) {
                    bail!("{name}'s configuration did not get its [fleet] host and endpoints");
                }
            }
            let config = hdir.join("sluice.toml");
            write_atomic(&config, &text)?;
            list.push(LbHost {
                host: h,
                socket: hdir.join("admin.sock"),
                config,
                bpffs,
                dir: hdir,
                daemon: None,
                starts: 0,
                bird: None,
            });
        }
        for h in &list[1..] {
            let targets: Vec<IpAddr> = topo.backends.iter().map(|b| b.addr(false)).collect();
            topo.resolve_neighbours(&h.host, &targets, Duration::from_secs(5))?;
        }
        let peers: Vec<Ipv4Addr> = list.iter().map(|h| h.host.v4).collect();
        let conf = dir.join("router-bird.conf");
        write_atomic(&conf, &bird_router_conf(&peers))?;
        let sw = topo.switch.clone();
        let args = bird_args(&conf, &dir.join("router-bird.ctl"));
        let router_bird = topo.spawn(&sw, "bird (router)", bird, &args)?;
        Ok((list, router_bird, edge))
    }

    /// Starts host `k`'s BIRD (its routes file empty until its daemon writes it).
    pub fn start_bird(&mut self, k: usize) -> Result<()> {
        let h = &self.hosts[k];
        let routes = h.dir.join("routes.conf");
        // Only if the daemon has not written it yet, and never through the temporary name
        // the daemon's own writes use (a rename of ours could race one of its).
        match fs::OpenOptions::new()
            .write(true)
            .create_new(true)
            .open(&routes)
        {
            Ok(mut f) => f
                .write_all(bird::render(&BTreeSet::new()).as_bytes())
                .with_context(|| format!("writing {}", routes.display()))?,
            Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists => {}
            Err(e) => return Err(e).with_context(|| format!("creating {}", routes.display())),
        }
        let conf = h.dir.join("bird.conf");
        write_atomic(&conf, &bird_lb_conf(&h.host, &routes))?;
        let _ = fs::remove_file(h.bird_socket());
        let args = bird_args(&conf, &h.bird_socket());
        let ns = h.host.ns.clone();
        let label = format!("bird ({})", h.host.name);
        let bird = tool("bird")?;
        let id = self.lab.topo.spawn(&ns, &label, bird, &args)?;
        self.hosts[k].bird = Some(id);
        self.wait_bird(id, &self.hosts[k].bird_socket())
    }

    /// Waits (5 s at most) until a BIRD answers on its control socket; fails at once if it
    /// exits (a configuration it refused).
    fn wait_bird(&mut self, id: ProcId, socket: &Path) -> Result<()> {
        let deadline = Instant::now() + Duration::from_secs(5);
        loop {
            if let Some(s) = self.lab.topo.try_wait(id)? {
                bail!("BIRD exited ({s}) at start: see its messages above");
            }
            if std::os::unix::net::UnixStream::connect(socket).is_ok() {
                return Ok(());
            }
            if Instant::now() >= deadline {
                bail!("BIRD did not open {} within 5s", socket.display());
            }
            thread::sleep(Duration::from_millis(20));
        }
    }

    /// Starts host `k` (not host 0, whose daemon the daemon lab runs): its daemon, waiting
    /// for READY=1 and an answer on its admin socket, then its BIRD.
    pub fn start_host(&mut self, k: usize) -> Result<()> {
        if k == 0 {
            bail!("host 0's daemon is the daemon lab's");
        }
        let h = &mut self.hosts[k];
        let log_path = h.dir.join(format!("daemon-{}.log", h.starts));
        h.starts += 1;
        let log = File::create(&log_path)?;
        let mut notify = NotifySocket::bind(h.dir.join("notify.sock"))?;
        let child = spawn_as_unit(
            &h.host.ns,
            &[],
            &self.lab.sluice,
            &["run"],
            &h.config,
            &notify,
            log,
        )?;
        h.daemon = Some(child);
        let deadline = Instant::now() + START_TIMEOUT;
        loop {
            let answers = Client::new(&h.socket)
                .call("GET", "/v1/status", None)
                .is_ok();
            if notify.ready() && answers {
                break;
            }
            if let Some(s) = h.daemon.as_mut().and_then(|c| c.try_wait().ok().flatten()) {
                h.daemon = None;
                bail!(
                    "{}'s daemon exited ({s}); its log:\n{}",
                    h.host.name,
                    tail(&h.log(), 40)
                );
            }
            if Instant::now() >= deadline {
                bail!(
                    "{}'s daemon did not become ready within {START_TIMEOUT:?}; its log:\n{}",
                    h.host.name,
                    tail(&h.log(), 40)
                );
            }
            thread::sleep(Duration::from_millis(50));
        }
        self.start_bird(k)
    }

    /// Host `k` dies: its link goes down first (it vanishes from the network, so the router
    /// can only notice through BFD), then its daemon and BIRD are killed and its data plane
    /// removed. Returns when that is done.
    pub fn kill_host(&mut self, k: usize) -> Result<()> {
        let h = &self.hosts[k];
        h.host.ns.ip(&["link", "set", DEV, "down"])?;
        if let Some(id) = self.hosts[k].bird.take() {
            self.lab.topo.signal(id, libc::SIGKILL)?;
            self.lab.topo.wait_exit(id, Duration::from_secs(10))?;
        }
        if k == 0 {
            self.lab.kill9()?;
        } else {
            signal_and_wait(
                &mut self.hosts[k].daemon,
                "the LB daemon",
                libc::SIGKILL,
                Duration::from_secs(10),
            )?;
        }
        remove_pinned(&self.hosts[k].bpffs)?;
        Ok(())
    }

    /// Token stream `i` through the router, from client source `i` mod [`CLIENT_SOURCES`].
    pub fn stream(&self, i: usize, tokens: u32, interval_ms: u32) -> Result<Running> {
        let src = self.sources[i % self.sources.len()];
        self.lab.stream_from(Some(src), VIP, tokens, interval_ms)
    }

    /// `sluice --socket <host k's socket> <args>`.
    pub fn cli(&self, k: usize, args: &[&str]) -> Result<CmdOutput> {
        let mut cmd = Command::new(&self.lab.sluice);
        cmd.arg("--socket").arg(&self.hosts[k].socket).args(args);
        run_output(&mut cmd, CLI_TIMEOUT)
    }

    /// An admin API request to host `k`.
    pub fn api(&self, k: usize, method: &str, path: &str) -> Result<Value> {
        Client::new(&self.hosts[k].socket).call(method, path, None)
    }

    /// The router's next hops for the VIP's /32 (empty: no route).
    pub fn nexthops(&self) -> Result<BTreeSet<Ipv4Addr>> {
        let out = self
            .lab
            .topo
            .switch
            .ip(&["-j", "route", "show", &format!("{VIP4}/32")])?;
        let v: Value = serde_json::from_str(out.trim()).unwrap_or(Value::Array(vec![]));
        let mut hops = BTreeSet::new();
        for r in v.as_array().into_iter().flatten() {
            if let Some(g) = r["gateway"].as_str() {
                hops.insert(g.parse()?);
            }
            for n in r["nexthops"].as_array().into_iter().flatten() {
                if let Some(g) = n["gateway"].as_str() {
                    hops.insert(g.parse()?);
                }
            }
        }
        Ok(hops)
    }

    /// Waits until the router's next hops for the VIP are exactly `want`; returns how long
    /// that took.
    pub fn wait_nexthops(&self, want: &BTreeSet<Ipv4Addr>, timeout: Duration) -> Result<Duration> {
        let t = Instant::now();
        let deadline = t + timeout;
        loop {
            let have = self.nexthops()?;
            if &have == want {
                return Ok(t.elapsed());
            }
            if Instant::now() >= deadline {
                let sessions = self
                    .lab
                    .topo
                    .switch
                    .exec(
                        "birdc",
                        &[
                            "-s",
                            &self.dir.join("router-bird.ctl").display().to_string(),
                            "show",
                            "protocols",
                        ],
                    )
                    .unwrap_or_else(|e| format!("{e:#}"));
                bail!(
                    "the router's next hops for {VIP4} are {have:?}, not {want:?}, after \
                     {timeout:?}; its BIRD says:\n{sessions}"
                );
            }
            thread::sleep(Duration::from_millis(10));
        }
    }

    /// The host whose connection table saw `client` (ip:port) most recently, within the last
    /// `fresh`: the host that carries that flow now.
    pub fn carriers(&self, fresh: Duration) -> Result<BTreeMap<String, usize>> {
        let mut best: BTreeMap<String, (u64, usize)> = BTreeMap::new();
        for (k, h) in self.hosts.iter().enumerate() {
            if !h.socket.exists() {
                continue;
            }
            let Ok(v) = self.api(k, "GET", "/v1/conns?limit=100000") else {
                continue;
            };
            for f in v["flows"].as_array().into_iter().flatten() {
                let (Some(c), Some(idle)) = (f["client"].as_str(), f["idle_ms"].as_u64()) else {
                    continue;
                };
                if idle > fresh.as_millis() as u64 {
                    continue;
                }
                let e = best.entry(c.to_string()).or_insert((idle, k));
                if idle < e.0 {
                    *e = (idle, k);
                }
            }
        }
        Ok(best.into_iter().map(|(c, (_, k))| (c, k)).collect())
    }
}

fn bird_args(conf: &Path, socket: &Path) -> Vec<String> {
    vec![
        "-f".into(),
        "-c".into(),
        conf.display().to_string(),
        "-s".into(),
        socket.display().to_string(),
    ]
}

impl Drop for FleetLab {
    fn drop(&mut self) {
        for h in self.hosts.iter_mut().skip(1) {
            if thread::panicking() && h.starts > 0 {
                eprintln!(
                    "fleet lab: the end of {}'s daemon log:\n{}",
                    h.host.name,
                    tail(&h.log(), 40)
                );
            }
            if h.daemon.is_some()
                && signal_and_wait(
                    &mut h.daemon,
                    "an LB daemon",
                    libc::SIGTERM,
                    Duration::from_secs(15),
                )
                .is_err()
            {
                let _ = signal_and_wait(
                    &mut h.daemon,
                    "an LB daemon",
                    libc::SIGKILL,
                    Duration::from_secs(5),
                );
            }
            if let Err(e) = remove_pinned(&h.bpffs) {
                eprintln!("fleet lab: {e:#}");
            }
        }
        if let Err(e) = fs::remove_dir_all(&self.dir) {
            eprintln!("fleet lab: removing {}: {e}", self.dir.display());
        }
    }
}

/// Fails when BIRD is missing, naming the package.
pub fn require_bird() -> Result<()> {
    tool("bird").and(tool("birdc")).map(drop).map_err(|e| {
        anyhow!(
            "{e:#}: the fleet lab needs BIRD 2 (`apt-get install bird2`, or `cargo xtask setup`)"
        )
    })
}
