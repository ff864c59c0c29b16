//! A real etcd (Debian `etcd-server`) for the fleet tests: a cluster of `members` in a
//! network namespace of its own, with data in a temporary directory, linked to LB host
//! namespaces by veth pairs.
//!
//! The namespace is `sl<pid>-etcd<n>` (swept like the labs' if a run dies); each member `m`
//! serves clients on `10.250.0.0/16` port `2379 + 100 m` (every link's address) and peers on
//! loopback. [`EtcdCluster::link`] connects a namespace: link `k` is `10.250.k.1/30` on the
//! etcd side and `10.250.k.2/30` on the other. Dropping the cluster stops the members
//! (SIGTERM, then SIGKILL), deletes the namespace (and with it the links) and the data.

use std::{
    fs,
    net::{Ipv4Addr, SocketAddr},
    path::PathBuf,
    process::{Child, Command, Stdio},
    sync::atomic::{AtomicUsize, Ordering},
    thread,
    time::{Duration, Instant},
};

use anyhow::{anyhow, bail, Context, Result};

use crate::{
    daemon_lab::http_exchange,
    netns::{ip, tool, Netns, NS_PREFIX},
};

static COUNTER: AtomicUsize = AtomicUsize::new(0);

/// How long a member may take to answer `/health` after it is started.
pub const START_TIMEOUT: Duration = Duration::from_secs(20);

pub struct EtcdCluster {
    pub ns: Netns,
    pub dir: PathBuf,
    pub members: usize,
    etcd: PathBuf,
    children: Vec<Option<Child>>,
    links: usize,
}

/// The client port of member `m`.
pub fn client_port(m: usize) -> u16 {
    2379 + 100 * m as u16
}

impl EtcdCluster {
    /// Starts `members` members (fails saying what is missing when etcd is not installed)
    /// and waits until each answers `/health`.
    pub fn start(members: usize) -> Result<EtcdCluster> {
        let etcd =
            tool("etcd").context("etcd is missing: `cargo xtask setup` installs etcd-server")?;
        let n = COUNTER.fetch_add(1, Ordering::SeqCst);
        let name = format!("{NS_PREFIX}{}-etcd{n}", std::process::id());
        let _ = ip(&["netns", "del", &name]);
        ip(&["netns", "add", &name])?;
        let ns = Netns::existing(&name);
        let dir = std::env::temp_dir().join(format!("sluice-etcd-{}-{n}", std::process::id()));
        let _ = fs::remove_dir_all(&dir);
        let mut c = EtcdCluster {
            ns,
            dir,
            members,
            etcd,
            children: (0..members).map(|_| None).collect(),
            links: 0,
        };
        c.ns.ip(&["link", "set", "lo", "up"])?;
        fs::create_dir_all(&c.dir).with_context(|| format!("creating {}", c.dir.display()))?;
        for m in 0..members {
            c.start_member(m)?;
        }
        c.wait_healthy()?;
        Ok(c)
    }

    fn peer_url(m: usize) -> String {
        format!("http://127.0.0.1:{}", 2380 + 100 * m)
    }

    fn start_member(&mut self, m: usize) -> Result<()> {
        let cluster: Vec<String> = (0..self.members)
            .map(|i| format!("m{i}={}", Self::peer_url(i)))
            .collect();
        let port = client_port(m);
        let log = fs::File::create(self.dir.join(format!("m{m}.log")))?;
        let child = Command::new("ip")
            .args(["netns", "exec", self.ns.name()])
            .arg(&self.etcd)
            .args(["--name", &format!("m{m}")])
            .arg("--data-dir")
            .arg(self.dir.join(format!("m{m}.data")))
            .args(["--listen-client-urls", &format!("http://0.0.0.0:{port}")])
            .args([
                "--advertise-client-urls",
                &format!("http://127.0.0.1:{port}"),
            ])
            .args(["--listen-peer-urls", &Self::peer_url(m)])
            .args(["--initial-advertise-peer-urls", &Self::peer_url(m)])
            .args(["--initial-cluster", &cluster.join(",")])
            .args(["--initial-cluster-token", self.ns.name()])
            .args(["--initial-cluster-state", "new"])
            // Short elections: a lost member is noticed quickly in tests.
            .args(["--heartbeat-interval", "100", "--election-timeout", "1000"])
            .stdin(Stdio::null())
            .stdout(log.try_clone()?)
            .stderr(log)
            .spawn()
            .context("starting etcd")?;
        self.children[m] = Some(child);
        Ok(())
    }

    /// Waits until every running member answers `/health` with `true`.
    pub fn wait_healthy(&self) -> Result<()> {
        let deadline = Instant::now() + START_TIMEOUT;
        for m in (0..self.members).filter(|m| self.children[*m].is_some()) {
            let addr = SocketAddr::new(Ipv4Addr::LOCALHOST.into(), client_port(m));
            loop {
                let r = self.ns.run(|| {
                    http_exchange(
                        addr,
                        "GET /health HTTP/1.1\r\nHost: etcd\r\nConnection: close\r\n\r\n",
                        Duration::from_secs(1),
                    )
                })?;
                match r {
                    Ok((200, body)) if body.contains("true") => break,
                    other if Instant::now() >= deadline => bail!(
                        "etcd member m{m} not healthy within {START_TIMEOUT:?}: {other:?}; its log:\n{}",
                        self.log(m)
                    ),
                    _ => thread::sleep(Duration::from_millis(100)),
                }
            }
        }
        Ok(())
    }

    pub fn log(&self, m: usize) -> String {
        fs::read_to_string(self.dir.join(format!("m{m}.log"))).unwrap_or_default()
    }

    /// The client URLs the next [`EtcdCluster::link`] will give (to configure a daemon
    /// before its namespace exists).
    pub fn next_link_urls(&self) -> Vec<String> {
        Self::urls(self.links + 1, self.members)
    }

    fn urls(k: usize, members: usize) -> Vec<String> {
        (0..members)
            .map(|m| format!("http://10.250.{k}.1:{}", client_port(m)))
            .collect()
    }

    /// Links `other` to the etcd namespace; the client URLs of every member, as seen from it.
    pub fn link(&mut self, other: &Netns) -> Result<Vec<String>> {
        let k = self.links + 1;
        if k > 250 {
            bail!("too many links");
        }
        self.links = k;
        let (a, b) = (self.link_dev(k, 'a'), self.link_dev(k, 'b'));
        ip(&["link", "add", &a, "type", "veth", "peer", "name", &b])?;
        ip(&["link", "set", &a, "netns", self.ns.name()])?;
        ip(&["link", "set", &b, "netns", other.name()])?;
        self.ns
            .ip(&["addr", "add", &format!("10.250.{k}.1/30"), "dev", &a])?;
        self.ns.ip(&["link", "set", &a, "up"])?;
        other.ip(&["addr", "add", &format!("10.250.{k}.2/30"), "dev", &b])?;
        other.ip(&["link", "set", &b, "up"])?;
        Ok(Self::urls(k, self.members))
    }

    /// The veth end `end` ('a': in the etcd namespace, 'b': in the linked one) of link `k`:
    /// `fe<n>x<k><end>`, where `<n>` ends the etcd namespace's name (interface names are
    /// short, and unique per lab).
    fn link_dev(&self, k: usize, end: char) -> String {
        let n = self.ns.name().rsplit("etcd").next().unwrap_or("0");
        format!("fe{n}x{k}{end}")
    }

    /// Cuts (or restores) link `k` (1-based, in the order linked) by setting its etcd-side
    /// end down (or up): the other namespace loses (or regains) every member at once.
    pub fn cut(&self, k: usize, cut: bool) -> Result<()> {
        let dev = self.link_dev(k, 'a');
        self.ns
            .ip(&["link", "set", &dev, if cut { "down" } else { "up" }])
            .map(drop)
    }

    /// Stops member `m` (SIGTERM, then SIGKILL after 5 s).
    pub fn stop_member(&mut self, m: usize) -> Result<()> {
        let Some(mut child) = self.children[m].take() else {
            return Ok(());
        };
        unsafe { libc::kill(child.id() as i32, libc::SIGTERM) };
        let deadline = Instant::now() + Duration::from_secs(5);
        while child.try_wait()?.is_none() {
            if Instant::now() >= deadline {
                child.kill()?;
                child.wait()?;
                break;
            }
            thread::sleep(Duration::from_millis(20));
        }
        Ok(())
    }

    pub fn stop(&mut self) -> Result<()> {
        for m in 0..self.members {
            self.stop_member(m)?;
        }
        Ok(())
    }

    /// Starts the stopped members again on their data and waits until they are healthy.
    pub fn restart(&mut self) -> Result<()> {
        for m in 0..self.members {
            if self.children[m].is_none() {
                self.start_member(m)?;
            }
        }
        self.wait_healthy()
            .map_err(|e| anyhow!("restarting etcd: {e:#}"))
    }
}

impl Drop for EtcdCluster {
    fn drop(&mut self) {
        if let Err(e) = self.stop() {
            eprintln!("etcd {}: stopping: {e:#}", self.ns.name());
        }
        if thread::panicking() {
            for m in 0..self.members {
                eprintln!(
                    "etcd member m{m}, the end of its log:\n{}",
                    crate::daemon_lab::tail(&self.log(m), 20)
                );
            }
        }
        if let Err(e) = ip(&["netns", "del", self.ns.name()]) {
            eprintln!("etcd: deleting namespace {}: {e:#}", self.ns.name());
        }
        let _ = fs::remove_dir_all(&self.dir);
    }
}
