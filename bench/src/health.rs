//! `sluice-bench health`: what health checking costs at 100, 1,000 and 4,095 backends, and
//! how fast it acts. The daemon's own checker (`scheduler::run_health`) and controller run
//! in this process, in a network namespace of its own where 10.77.0.0/16 is local (so
//! backends are addresses of `lo`, and nothing leaves the namespace); the controller's
//! plane builds every VIP's Maglev table on each change as the map writer does, writes no
//! map, and the state file and audit log are written as the daemon writes them. Each
//! backend is a TCP listener in a child process; killing the child that holds all but
//! `--survivors` of them is the mass failure (their ports refuse). Per size it reports the
//! checker's CPU (this process's, the listeners' excluded) with every backend up, while the
//! failure is marked and after; the time from the failure to the last backend marked down;
//! and the time the checker takes to return once stopped, the stop sent `interval × fall`
//! after a second mass failure (while the marks are applied).

use std::{
    io::{BufRead, BufReader, Read},
    net::Ipv4Addr,
    path::PathBuf,
    process::{Child, Command, Stdio},
    sync::Arc,
    time::{Duration, Instant},
};

use anyhow::{bail, Context, Result};
use serde_json::json;
use sluice::{
    check,
    config::HealthConfig,
    controller::{Controller, Counters, FlowEntry, Overlay, Plane, Settings},
    scheduler::run_health,
    state::{specs, Limits, State},
};
use tokio::sync::{oneshot, Mutex};

use crate::{out, summary::r1, sys};

const PORT: u16 = 8000;
const VIP: &str = "10.200.0.1";

/// `sluice-bench health --help`.
#[derive(clap::Parser, Debug)]
#[command(
    name = "sluice-bench health",
    about = "The health checker's CPU, time to mark a mass failure and time to stop, per \
             number of backends (namespace, loopback listeners)"
)]
struct Args {
    /// Numbers of backends to measure (comma-separated, each at most 4095).
    #[arg(long = "backends", value_delimiter = ',', default_values_t = [100, 1000, 4095])]
    sizes: Vec<usize>,
    /// Backends that keep listening through the mass failure.
    #[arg(long, default_value_t = 3)]
    survivors: usize,
    /// Seconds of each CPU window with every backend up and after the failure.
    #[arg(long = "steady-secs", default_value_t = 5)]
    steady_secs: u64,
    /// Seconds to wait at most for the failure to be marked, and for the checker to stop.
    #[arg(long = "max-wait-secs", default_value_t = 120)]
    max_wait_secs: u64,
    /// Where the result goes (default: health.json under target/bench/, or under
    /// bench/results/ with --record).
    #[arg(long)]
    out: Option<PathBuf>,
    #[arg(long, help = out::RECORD_HELP)]
    record: bool,
}

/// The `i`th backend's address (in 10.77.0.0/16, local in the bench's namespace).
fn backend(i: usize) -> Ipv4Addr {
    Ipv4Addr::new(10, 77, 1 + (i / 200) as u8, 1 + (i % 200) as u8)
}

/// A plane that does the map writer's table work (every VIP's Maglev table on each change)
/// without maps.
struct TablePlane {
    seed: u32,
    applies: u64,
}

impl Plane for TablePlane {
    fn apply(&mut self, _old: &State, new: &State, overlay: &Overlay) -> Result<()> {
        for v in new.vips.values() {
            std::hint::black_box(v.table(self.seed, |b| overlay.weight(b))?);
        }
        self.applies += 1;
        Ok(())
    }
    fn active_flows(&mut self, _: Duration) -> Result<std::collections::BTreeMap<u32, u64>> {
        Ok(Default::default())
    }
    fn counters(&mut self, _: &State) -> Result<Counters> {
        Ok(Counters::default())
    }
    fn flow_entries(&mut self, _: &mut dyn FnMut(FlowEntry) -> bool) -> Result<()> {
        Ok(())
    }
    fn set_trace(&mut self, _: bool) -> Result<()> {
        Ok(())
    }
}

/// CPU seconds (user + system) this process has used.
fn cpu_secs() -> f64 {
    let mut u: libc::rusage = unsafe { std::mem::zeroed() };
    // SAFETY: a valid pointer to an rusage.
    unsafe { libc::getrusage(libc::RUSAGE_SELF, &mut u) };
    let t = |tv: libc::timeval| tv.tv_sec as f64 + tv.tv_usec as f64 / 1e6;
    t(u.ru_utime) + t(u.ru_stime)
}

/// Listeners for backends `first..first + count` in a child process (this binary in
/// `--serve` mode), ready when this returns; it exits when killed or when this process's
/// end of its stdin closes.
fn listeners(first: usize, count: usize) -> Result<Child> {
    let mut child = Command::new(std::env::current_exe()?)
        .args(["health", "--serve", &first.to_string(), &count.to_string()])
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .spawn()
        .context("starting the listeners")?;
    let mut line = String::new();
    BufReader::new(child.stdout.take().expect("piped"))
        .read_line(&mut line)
        .context("waiting for the listeners")?;
    if line.trim() != "ready" {
        let _ = child.kill();
        let _ = child.wait();
        bail!("the listeners did not start: {line:?}");
    }
    Ok(child)
}

/// The `--serve` mode: accepts and closes connections on its backends' addresses.
fn serve(first: usize, count: usize) -> Result<()> {
    raise_nofile();
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()?;
    rt.block_on(async {
        for i in first..first + count {
            let l = tokio::net::TcpListener::bind((backend(i), PORT))
                .await
                .with_context(|| format!("binding {}:{PORT}", backend(i)))?;
            tokio::spawn(async move {
                while let Ok((s, _)) = l.accept().await {
                    drop(s);
                }
            });
        }
        println!("ready");
        // Ends with the parent: its end of stdin closes when it exits, however it exits.
        // Any outcome of the read (EOF, an error) is the parent gone.
        let _ = tokio::task::spawn_blocking(|| std::io::stdin().read(&mut [0; 1])).await;
        Ok(())
    })
}

fn raise_nofile() {
    let lim = libc::rlimit {
        rlim_cur: 65536,
        rlim_max: 65536,
    };
    // SAFETY: a valid pointer to an rlimit.
    unsafe { libc::setrlimit(libc::RLIMIT_NOFILE, &lim) };
}

/// Backends whose table state is down.
async fn down<P: Plane>(ctl: &Mutex<Controller<P>>) -> usize {
    let c = ctl.lock().await;
    c.state()
        .vips
        .values()
        .flat_map(|v| v.backends.values())
        .filter(|b| !b.healthy)
        .count()
}

/// A controller with `n` backends of one VIP, as `sluice run` starts it from a config.
fn controller(
    n: usize,
    dir: &std::path::Path,
) -> Result<(Controller<TablePlane>, Arc<sluice::config::Config>)> {
    let mut text = format!(
        "[dataplane]\ninterfaces = [{{ name = \"lo\" }}]\nhash_seed = 1\nencap_source_v4 = \"10.78.0.0/16\"\n\
         [daemon]\nstate_file = \"{}\"\n[admin]\naudit_log = \"{}\"\n\
         [[vip]]\nname = \"bench\"\naddress = \"{VIP}\"\nport = {PORT}\n",
        dir.join("state.json").display(),
        dir.join("audit.jsonl").display()
    );
    for i in 0..n {
        text.push_str(&format!("[[vip.backend]]\naddress = \"{}\"\n", backend(i)));
    }
    let cfg = check::check(&text, "bench.toml")?.config;
    let limits = Limits {
        max_vips: cfg.dataplane.max_vips,
    };
    let state = State::default().with_specs(&specs(&cfg), &limits)?;
    let settings = Settings {
        limits,
        seed: 1,
        flow_idle: Duration::from_secs(30),
        state_file: Some(cfg.daemon.state_file.clone()),
        audit_log: Some(cfg.admin.audit_log.clone()),
        config_hash: 0,
    };
    let plane = TablePlane {
        seed: 1,
        applies: 0,
    };
    Ok((
        Controller::new(state, &State::default(), plane, settings)?,
        Arc::new(cfg),
    ))
}

/// Polls until `want` backends are down or `max` passes; the time it took, or None.
async fn until_down<P: Plane>(
    ctl: &Mutex<Controller<P>>,
    want: usize,
    max: Duration,
) -> (Option<Duration>, usize) {
    let t = Instant::now();
    loop {
        let d = down(ctl).await;
        if d >= want {
            return (Some(t.elapsed()), d);
        }
        if t.elapsed() > max {
            return (None, d);
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// The state file's and audit log's directory of one size, removed however the size ends.
struct Scratch(PathBuf);

impl Scratch {
    fn new() -> Result<Scratch> {
        let s = Scratch(
            std::env::temp_dir().join(format!("sluice-bench-health-{}", std::process::id())),
        );
        s.empty()?;
        Ok(s)
    }

    fn empty(&self) -> Result<()> {
        let _ = std::fs::remove_dir_all(&self.0);
        std::fs::create_dir_all(&self.0).with_context(|| format!("creating {}", self.0.display()))
    }
}

impl std::ops::Deref for Scratch {
    type Target = std::path::Path;
    fn deref(&self) -> &std::path::Path {
        &self.0
    }
}

impl Drop for Scratch {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

/// One size: a run for CPU and time to mark, then a run for the stop.
async fn measure(n: usize, a: &Args, hc: &HealthConfig) -> Result<serde_json::Value> {
    let dir = Scratch::new()?;
    let failing = n - a.survivors;
    let pct = |cpu: f64, wall: Duration| r1(100.0 * cpu / wall.as_secs_f64());

    // Run 1: CPU with all up, the mass failure, CPU after it.
    let (ctl, cfg) = controller(n, &dir)?;
    let ctl = Arc::new(Mutex::new(ctl));
    let _keep = listeners(failing, a.survivors)?;
    let mut doomed = listeners(0, failing)?;
    let (stop, stopped) = oneshot::channel::<()>();
    let mut task = tokio::spawn(run_health(
        ctl.clone(),
        cfg.clone(),
        Instant::now(),
        async {
            let _ = stopped.await;
        },
    ));
    // Warm up: the first rounds, and nothing may be down.
    tokio::time::sleep(2 * hc.interval).await;
    if down(&ctl).await != 0 {
        bail!("{n} backends: some are marked down while all listen");
    }
    let (c0, t0) = (cpu_secs(), Instant::now());
    tokio::time::sleep(Duration::from_secs(a.steady_secs)).await;
    let cpu_up = pct(cpu_secs() - c0, t0.elapsed());
    sys::interrupted()?;
    let applies_before = ctl.lock().await.plane().applies;
    doomed.kill()?;
    doomed.wait()?;
    let (c0, t0) = (cpu_secs(), Instant::now());
    let (marked, seen) = until_down(&ctl, failing, Duration::from_secs(a.max_wait_secs)).await;
    let cpu_marking = pct(cpu_secs() - c0, t0.elapsed());
    let applies = ctl.lock().await.plane().applies - applies_before;
    sys::interrupted()?;
    let (c0, t0) = (cpu_secs(), Instant::now());
    tokio::time::sleep(Duration::from_secs(a.steady_secs)).await;
    let cpu_failed = pct(cpu_secs() - c0, t0.elapsed());
    let _ = stop.send(());
    // Run 2 measures the stop; here it only must not outlive the run.
    if tokio::time::timeout(Duration::from_secs(a.max_wait_secs), &mut task)
        .await
        .is_err()
    {
        task.abort();
    }
    drop(_keep);

    // Run 2: the stop, sent while a mass failure is being marked.
    dir.empty()?;
    let (ctl, cfg) = controller(n, &dir)?;
    let ctl = Arc::new(Mutex::new(ctl));
    let mut doomed = listeners(0, n)?;
    let (stop, stopped) = oneshot::channel::<()>();
    let mut task = tokio::spawn(run_health(ctl.clone(), cfg, Instant::now(), async {
        let _ = stopped.await;
    }));
    tokio::time::sleep(2 * hc.interval).await;
    doomed.kill()?;
    doomed.wait()?;
    tokio::time::sleep(hc.interval * hc.fall).await;
    let t = Instant::now();
    let _ = stop.send(());
    let stopped_in = tokio::time::timeout(Duration::from_secs(a.max_wait_secs), &mut task).await;
    let stop_s = stopped_in.is_ok().then(|| t.elapsed().as_secs_f64());
    if stopped_in.is_err() {
        // Ended at its next await, so that it takes no CPU from the next size's figures.
        task.abort();
        eprintln!(
            "{n} backends: the checker did not return within {} s of the stop",
            a.max_wait_secs
        );
    }

    let row = json!({
        "backends": n,
        "failing": failing,
        "cpu_pct_all_up": cpu_up,
        "cpu_pct_while_marking": cpu_marking,
        "cpu_pct_after_failure": cpu_failed,
        "mark_failures_s": marked.map(|d| (d.as_secs_f64() * 1000.0).round() / 1000.0),
        "marked_down": seen,
        "table_rebuilds_while_marking": applies,
        "stop_s": stop_s.map(|s| (s * 1000.0).round() / 1000.0),
    });
    println!("{row}");
    Ok(row)
}

pub fn main(args: &[String]) -> Result<()> {
    if args.first().map(String::as_str) == Some("--serve") {
        let first = args.get(1).context("--serve FIRST COUNT")?.parse()?;
        let count = args.get(2).context("--serve FIRST COUNT")?.parse()?;
        return serve(first, count);
    }
    let Some(a) = crate::cli_args::<Args>("sluice-bench health", args)? else {
        return Ok(());
    };
    let path = a
        .out
        .clone()
        .unwrap_or_else(|| out::default_path(a.record, "health.json"));
    if a.sizes.iter().any(|&n| n <= a.survivors || n > 4095) {
        bail!("each of --backends must be above --survivors and at most 4095");
    }
    sys::require_root()?;
    sys::catch_interrupts();
    let (rev, _) = sys::git_state();
    // Everything from here on (threads, listeners) lives in this namespace, which goes away
    // with the last of them.
    let _ns = sys::new_netns()?;
    sys::sh("ip link set lo up && ip route add local 10.77.0.0/16 dev lo")?;
    raise_nofile();
    let hc = HealthConfig::default();
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()?;
    let mut rows = Vec::new();
    for &n in &a.sizes {
        rows.push(rt.block_on(measure(n, &a, &hc))?);
        sys::interrupted()?;
    }
    rt.shutdown_timeout(Duration::from_secs(1));
    let doc = json!({
        "bench": "health",
        "command": std::env::args().collect::<Vec<_>>().join(" "),
        "parent": sys::parent_cmdline(),
        "revision": rev,
        "date": sys::utc_now(),
        "cpus": sys::online_cpus(),
        "cpu_model": sys::cpu_model(),
        "kernel": sys::kernel_release(),
        "health": {
            "interval_s": hc.interval.as_secs_f64(),
            "timeout_s": hc.timeout.as_secs_f64(),
            "rise": hc.rise,
            "fall": hc.fall,
        },
        "survivors": a.survivors,
        "results": rows,
    });
    out::write_json(&path, &doc)
}
