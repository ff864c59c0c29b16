//! `sluice-bench xdp`: per-packet cost of the real `sluice_xdp` through BPF_PROG_TEST_RUN,
//! against the XDP_PASS baseline `sluice_pass` measured the same way in the same run.
//!
//! # Method
//!
//! - Every call is `BPF_PROG_TEST_RUN` with `repeat = 1` on a fresh copy of the input frame
//!   (the kernel copies `data_in` on every call), for every case including the baseline: with
//!   `repeat > 1` a rewritten (encapsulated) packet would carry over into the next repeat.
//! - Two figures per call: the kernel-reported duration (`TestRunResult::duration`: the
//!   program plus the test-run harness's fixed bh-disable and clock-read overhead) and the
//!   wall-clock time of the whole batch of syscalls divided by the calls
//!   ("syscall-inclusive": frame copy in and out, the syscall, buffer allocation).
//! - Rounds: every round runs one batch of every (next-hop variant, case) pair, in an order
//!   shuffled per round, so slow drift on a noisy VM spreads over all cases. Per case the
//!   report gives the median, minimum and 90th percentile over rounds of the batch means,
//!   and the ratio to its baseline's median.
//! - The thread is pinned to one CPU; the benchmark runs in fresh network namespaces:
//!   `fallback`, empty (forwarding off, so `bpf_fib_lookup` fails at once and the configured
//!   fallback MAC is used: XDP_TX), and `fib`, with a route and permanent neighbours for the
//!   backends and forwarding on (`bpf_fib_lookup` succeeds: XDP_REDIRECT through the devmap,
//!   the production path). The data-plane counters of every batch confirm the path taken.
//! - Every loop is bounded in calls and in time.
//! - Second chance: the `sc_*` cases send the same traffic to the same VIPs in
//!   `second-chance` mode (a fourth data plane), so the two modes compare within one run; the
//!   `backend_*` cases run `sluice_decap` on that LB's GUE output (`fib` variant only: the
//!   socket and FIB lookups happen there) against `sluice_pass` on the same frame.

mod cases;
mod lab;
mod measure;
mod report;
mod stages;
mod traffic;

use std::{path::PathBuf, time::Instant};

use anyhow::{anyhow, bail, Context, Result};
use lb_common::CONN_TABLE_SIZE;
use serde_json::{json, Value};
use sluice::{
    dataplane::{Dataplane, PROG_PASS, PROG_XDP},
    object::BPF_OBJECT,
};
use sluice_tests::frames::Mac;

use self::{
    cases::{case, CaseId, Dp, Variant, CASES},
    lab::{backend_frames, check_paths, mtu_check, populate, Lab},
    measure::{case_results, case_sources, measure_rounds, warm_up},
    traffic::TestFrames,
};
use crate::{out, sys};

/// Where `cargo xtask bench xdp --stages` builds the stage objects (from the workspace root,
/// the benchmark's working directory).
const STAGES_DIR: &str = "target/bpf/stages";

const XDP_PASS: u32 = 2;
const XDP_TX: u32 = 3;
const XDP_REDIRECT: u32 = 4;

const LB_MAC: Mac = [0x02, 0, 0, 0, 0, 0x01];
const CLIENT_MAC: Mac = [0x02, 0, 0, 0, 0, 0x02];
/// Egress MTU in the `fib` namespace: room for the 20/40 encapsulation bytes on full-size
/// client packets.
const FIB_MTU: u32 = 9000;
const FIB_DEV_MAC: Mac = [0x02, 0, 0, 0, 0x0a, 0x0a];
const VIP4: &str = "10.200.0.1";
const VIP6: &str = "fd00:200::1";
const NON_VIP4: &str = "10.201.0.9";
const CLIENT4: &str = "192.0.2.10";
const CLIENT6: &str = "2001:db8:c::10";
const VIP_PORT: u16 = 443;
/// The in-band VIP: the IPv4 VIP's address on another port, its own backend ids.
const INBAND_PORT: u16 = 8443;
const BACKENDS_INBAND: [(u32, &str); 2] = [(21, "10.2.0.1"), (22, "10.2.0.2")];
/// The UDP VIPs, on the IPv4 VIP's address: a plain one (its flows pinned by the table) and
/// a QUIC one routing by connection ID, with their own backend ids on `BACKENDS4`'s hosts.
const UDP_PORT: u16 = 4433;
const BACKENDS_UDP: [(u32, &str); 2] = [(31, "10.1.0.1"), (32, "10.1.0.2")];
const QUIC_PORT: u16 = 443;
const BACKENDS_QUIC: [(u32, &str); 2] = [(41, "10.1.0.3"), (42, "10.1.0.4")];
/// The QUIC VIP's server IDs (two octets, config rotation 0), by backend of `BACKENDS_QUIC`.
const QUIC_SIDS: [[u8; 2]; 2] = [[0x0a, 0x01], [0x0a, 0x02]];
/// The tenants' VIP: the IPv4 VIP's address on another port, with `VIP_F_TENANTS`, its own
/// backend ids on `BACKENDS4`'s hosts.
const TENANT_PORT: u16 = 9443;
const BACKENDS_TENANT: [(u32, &str); 4] = [
    (51, "10.1.0.1"),
    (52, "10.1.0.2"),
    (53, "10.1.0.3"),
    (54, "10.1.0.4"),
];
const BACKENDS4: [(u32, &str); 4] = [
    (1, "10.1.0.1"),
    (2, "10.1.0.2"),
    (3, "10.1.0.3"),
    (4, "10.1.0.4"),
];
const BACKENDS6: [(u32, &str); 4] = [
    (11, "fd00:1::1"),
    (12, "fd00:1::2"),
    (13, "fd00:1::3"),
    (14, "fd00:1::4"),
];

/// Client address blocks (host order) of the generated flows: each family of flows gets its
/// own block of 2^20 addresses inside 100.64.0.0/10; the source port carries the rest.
const BLOCK_MANY: u32 = 0x6440_0000; // 100.64.0.0: the pre-populated established flows
const BLOCK_SYN: u32 = 0x6450_0000; // 100.80.0.0: new flows (table with room)
const BLOCK_SYN_FULL: u32 = 0x6460_0000; // 100.96.0.0: new flows into a full table
const BLOCK_BITS: u32 = 20;

/// Per-CPU capacity of the conn table of the "full table" case: small, so it is kept full
/// and every new flow evicts.
const FULL_TABLE_PER_CPU: u32 = 4096;

struct Opts {
    rounds: usize,
    calls: usize,
    flows: usize,
    batch_secs: f64,
    max_secs: f64,
    /// The CPUs that run every batch at once, each pinned; the thread itself runs on the
    /// first.
    cpus: Vec<usize>,
    out: PathBuf,
    svg: PathBuf,
    variants: Vec<Variant>,
    /// Only these cases (baselines are always measured).
    cases: Option<Vec<CaseId>>,
    /// A BPF object to load instead of the embedded one (A/B of data-plane changes).
    object: Option<PathBuf>,
    /// Conn-table capacity of the established and new-flow data planes.
    conn_table: u32,
    /// The per-stage breakdown instead of the cases (see `stages`).
    stages: bool,
}

/// `sluice-bench xdp --help`.
#[derive(clap::Parser, Debug)]
#[command(
    name = "sluice-bench xdp",
    about = "Per-packet cost of sluice_xdp (BPF_PROG_TEST_RUN, repeat 1 per call on a fresh \
             frame) against the XDP_PASS baseline sluice_pass, in fresh network namespaces"
)]
struct Args {
    /// Rounds; each runs one batch of every case, shuffled (default 11; 3 with --quick).
    #[arg(long)]
    rounds: Option<usize>,
    /// Calls per batch (default 200000; 20000 with --quick).
    #[arg(long)]
    calls: Option<usize>,
    /// Distinct established flows of the many-flows case (default 200000; 20000 with --quick).
    #[arg(long)]
    flows: Option<usize>,
    /// Time bound of one batch, in seconds.
    #[arg(long = "batch-secs", default_value_t = 1.0)]
    batch_secs: f64,
    /// Time bound of the measuring phase in seconds; later rounds are skipped (default 90;
    /// 900 with --stages).
    #[arg(long = "max-secs")]
    max_secs: Option<f64>,
    /// CPU to pin to (default: the last online CPU).
    #[arg(long)]
    cpu: Option<usize>,
    /// CPUs that run every batch at once, each with its own flows (the second is the lowest
    /// other online CPU): with 2, new flows insert into the connection table from two CPUs,
    /// which a one-CPU figure does not show.
    #[arg(long, default_value_t = 1, value_parser = clap::value_parser!(u8).range(1..=2))]
    cpus: u8,
    /// Next-hop variants, comma separated.
    #[arg(long, value_enum, value_delimiter = ',', default_values_t = [Variant::Fallback, Variant::Fib])]
    variants: Vec<Variant>,
    /// Only these cases (comma separated keys; baselines always run).
    #[arg(long, value_delimiter = ',')]
    cases: Option<Vec<String>>,
    /// Load this BPF object instead of the embedded target/bpf/sluice.bpf.o (to compare a
    /// data-plane change; its maps must keep the layout).
    #[arg(long)]
    object: Option<PathBuf>,
    /// Conn-table capacity of the established/new-flow data planes (default
    /// lb_common::CONN_TABLE_SIZE, the production default).
    #[arg(long = "conn-table", default_value_t = CONN_TABLE_SIZE)]
    conn_table: u32,
    /// --rounds 3 --calls 20000 --flows 20000 (each unless given).
    #[arg(long)]
    quick: bool,
    /// The cost of each stage of the established, new-flow and IPv6 paths in both modes,
    /// measured against builds with the stage taken out (target/bpf/stages/, built by
    /// `cargo xtask bench xdp --stages`) in the `fib` namespace; writes xdp-stages.json.
    /// Its paths, variant, CPU and objects are its own: the options that choose those
    /// elsewhere are refused beside it.
    #[arg(long, conflicts_with_all = ["cases", "variants", "cpus", "object", "flows", "svg"])]
    stages: bool,
    /// JSON results (default target/bench/xdp.json).
    #[arg(long)]
    out: Option<PathBuf>,
    /// SVG chart (default: the JSON path with .svg).
    #[arg(long)]
    svg: Option<PathBuf>,
    #[arg(long, help = out::RECORD_HELP)]
    record: bool,
}

fn parse_opts(args: &[String]) -> Result<Option<Opts>> {
    let Some(a) = crate::cli_args::<Args>("sluice-bench xdp", args)? else {
        return Ok(None);
    };
    let cases = match &a.cases {
        None => None,
        Some(keys) => Some(
            keys.iter()
                .map(|k| {
                    CASES
                        .iter()
                        .find(|c| c.key == k)
                        .map(|c| c.id)
                        .ok_or_else(|| {
                            anyhow!(
                                "unknown case {k}; cases: {}",
                                CASES.iter().map(|c| c.key).collect::<Vec<_>>().join(", ")
                            )
                        })
                })
                .collect::<Result<Vec<_>>>()?,
        ),
    };
    let name = if a.stages {
        "xdp-stages.json"
    } else {
        "xdp.json"
    };
    let out_path = a.out.unwrap_or_else(|| out::default_path(a.record, name));
    let o = Opts {
        rounds: a.rounds.unwrap_or(if a.quick { 3 } else { 11 }),
        calls: a.calls.unwrap_or(if a.quick { 20_000 } else { 200_000 }),
        flows: a.flows.unwrap_or(if a.quick { 20_000 } else { 200_000 }),
        batch_secs: a.batch_secs,
        max_secs: a.max_secs.unwrap_or(if a.stages { 900.0 } else { 90.0 }),
        cpus: cpus(a.cpu, a.cpus)?,
        svg: a.svg.unwrap_or_else(|| out_path.with_extension("svg")),
        out: out_path,
        variants: a.variants,
        cases,
        object: a.object,
        conn_table: a.conn_table,
        stages: a.stages,
    };
    if o.rounds == 0 || o.calls == 0 || o.variants.is_empty() {
        bail!("--rounds, --calls and --variants must be non-empty");
    }
    if o.flows == 0 || o.flows > 1 << BLOCK_BITS {
        bail!("--flows must be between 1 and {}", 1u32 << BLOCK_BITS);
    }
    Ok(Some(o))
}

/// The CPUs of a run: `--cpu` (default the last online one), then as many others as asked.
fn cpus(cpu: Option<usize>, n: u8) -> Result<Vec<usize>> {
    let online = sys::online_cpus();
    let first = cpu.unwrap_or_else(|| online.saturating_sub(1));
    let mut cpus = vec![first];
    cpus.extend((0..online).filter(|&c| c != first).take(usize::from(n) - 1));
    if cpus.len() < usize::from(n) {
        bail!("--cpus {n}: this machine has {online} online CPUs");
    }
    Ok(cpus)
}

pub fn main(args: &[String]) -> Result<()> {
    let Some(opts) = parse_opts(args)? else {
        return Ok(());
    };
    sys::require_root()?;
    let started = Instant::now();
    let command_line = std::env::args().collect::<Vec<_>>().join(" ");
    sys::pin_cpu(opts.cpus[0])?;
    let possible = sys::possible_cpus();
    check_fit(&opts, possible)?;
    println!(
        "sluice-bench xdp: batches on CPU {:?} at once, {} possible CPUs",
        opts.cpus, possible
    );
    if opts.stages {
        return stages::run(
            &opts,
            std::path::Path::new(STAGES_DIR),
            possible,
            command_line,
        );
    }

    let external = match &opts.object {
        Some(p) => Some(std::fs::read(p).with_context(|| format!("reading {}", p.display()))?),
        None => None,
    };
    let object: &[u8] = external.as_deref().unwrap_or(BPF_OBJECT);
    let mut lab = Lab::new(&opts, object, possible)?;
    let frames = TestFrames::build();
    let mut out = vec![0u8; 2048];
    let full_next = populate(&mut lab, &frames, opts.flows, &mut out)?;
    check_paths(&mut lab, &opts.variants, &frames.ack4, &mut out)?;
    let mtu_check = if opts.variants.contains(&Variant::Fib) {
        mtu_check(&mut lab, &frames.data1500, &mut out)?
    } else {
        Value::Null
    };
    // The sockets of the backend cases live until the end of the run.
    let backend = if opts.variants.contains(&Variant::Fib) {
        Some(backend_frames(&mut lab, &frames.ack4, &mut out)?)
    } else {
        None
    };

    let mut sources = case_sources(
        &frames,
        full_next,
        opts.flows,
        backend.as_ref(),
        opts.cpus.len(),
    );
    if let Some(only) = &opts.cases {
        sources.retain(|(id, _)| case(*id).baseline.is_none() || only.contains(id));
    }
    let mut results = case_results(&opts.variants, &sources);
    let mut kern: Vec<u32> = Vec::with_capacity(opts.calls);
    warm_up(&mut lab, &results, &mut sources, &opts, &mut out, &mut kern)?;
    let rounds_done = measure_rounds(
        &mut lab,
        &mut results,
        &mut sources,
        &opts,
        &mut out,
        &mut kern,
    )?;

    let run = RunFacts {
        command_line,
        possible,
        object,
        rounds_done,
        mtu_check,
        started,
    };
    let meta = run_meta(&mut lab, &opts, run)?;
    let rep = report::Report::new(meta, &opts.variants, &results);
    rep.print_table();
    println!();
    out::write_json(&opts.out, &rep.json())?;
    if let Some(dir) = opts.svg.parent() {
        std::fs::create_dir_all(dir).with_context(|| format!("creating {}", dir.display()))?;
    }
    std::fs::write(&opts.svg, rep.svg())
        .with_context(|| format!("writing {}", opts.svg.display()))?;
    println!("wrote {}", opts.svg.display());
    drop(backend);
    Ok(())
}

/// A per-CPU LRU gives each possible CPU max_entries / possible entries, all used by the
/// pinned CPU here: the populated flows and one batch of new flows must fit, or the LRU
/// evicts and the cases measure something else.
fn check_fit(opts: &Opts, possible: usize) -> Result<()> {
    let per_cpu = opts.conn_table as usize / possible;
    if opts.flows + 4 > per_cpu || opts.calls > per_cpu {
        bail!(
            "--flows {} / --calls {} do not fit the {per_cpu} conn-table entries per CPU (--conn-table {} over {possible} possible CPUs)",
            opts.flows,
            opts.calls,
            opts.conn_table
        );
    }
    Ok(())
}

/// What the report's metadata needs from the run besides the options.
struct RunFacts<'a> {
    command_line: String,
    possible: usize,
    object: &'a [u8],
    rounds_done: usize,
    mtu_check: Value,
    started: Instant,
}

/// The programs' sizes as the kernel reports them.
fn prog_info(dp: &mut Dataplane) -> Result<Value> {
    let mut m = serde_json::Map::new();
    for name in [PROG_XDP, PROG_PASS] {
        let info = dp.program(name)?.info()?;
        m.insert(
            name.to_string(),
            json!({
                "xlated_insns": info.size_translated().map(|b| b / 8),
                "jited_bytes": info.size_jitted(),
                "verified_insns": info.verified_instruction_count(),
                "tag": format!("{:016x}", info.tag()),
            }),
        );
    }
    Ok(Value::Object(m))
}

/// The result file's metadata: provenance, the programs, and the method in words.
fn run_meta(lab: &mut Lab, opts: &Opts, run: RunFacts) -> Result<Value> {
    let prog_info = prog_info(&mut lab.dps[0])?;
    let conns_main = lab.dp(Dp::Main).conns().map(|c| c.len()).ok();

    // The in-band case must have taken the progress path on every call: its backends'
    // acknowledged bytes are 1448 per call (warm-up included).
    let inband_acked: u64 = BACKENDS_INBAND
        .iter()
        .map(|(id, _)| Ok(lab.dp(Dp::Main).inband_stats(*id)?.acked_bytes))
        .sum::<Result<u64>>()?;
    println!("in-band case: {inband_acked} bytes acknowledged in the data plane's aggregates");

    // Every new session of the tenant case was looked up and admitted (warm-up included).
    let tenant_admitted = lab.tenant_admitted()?;
    println!("tenant case: {tenant_admitted} new sessions admitted by the tenant's limits");

    let possible = run.possible;
    let object = run.object;
    let (git_head, dirty) = sys::git_state();
    Ok(json!({
        "inband_acked_bytes": inband_acked,
        "benchmark": "xdp",
        "command_line": run.command_line,
        "invoked_by": sys::parent_cmdline(),
        "date_utc": sys::utc_now(),
        "kernel": sys::kernel_release(),
        "cpu_model": sys::cpu_model(),
        "online_cpus": sys::online_cpus(),
        "possible_cpus": possible,
        "pinned_cpu": opts.cpus[0],
        "cpus_at_once": opts.cpus,
        "clocksource": sys::clocksource(),
        "git_head": git_head,
        "dataplane_sources_differ_from_head": dirty,
        "bpf_object": opts.object.as_ref().map(|p| p.display().to_string()).unwrap_or_else(|| "embedded (target/bpf/sluice.bpf.o at build time)".into()),
        "bpf_object_bytes": object.len(),
        "bpf_object_fnv64": format!("{:016x}", sys::fnv64(object)),
        "programs": prog_info,
        "method": {
            "harness": "BPF_PROG_TEST_RUN through aya Xdp::test_run, repeat 1 per call; the kernel copies data_in on every call, so every call sees a fresh frame",
            "kernel_ns": "mean over a batch of TestRunResult.duration (repeat 1: the program plus the harness's bh-disable and clock-read overhead); the table gives median/min/p90 over rounds",
            "kernel_call_median_ns": "median of the per-call kernel durations within a batch, then median over rounds",
            "syscall_ns": "wall clock of a batch of calls / calls, including the syscall, the frame copies and, for generated flows, rewriting the source address/port and IP checksum in userspace (a few ns)",
            "ratio": "median(case) / median(its baseline) in the same variant; the baseline is sluice_pass measured the same way on a frame of the same size",
            "rounds_requested": opts.rounds,
            "rounds_completed": run.rounds_done,
            "calls_per_batch": opts.calls,
            "batch_time_limit_s": opts.batch_secs,
            "order": "each round runs every (variant, case) batch once, in an order shuffled per round; one unrecorded warm-up batch per case first",
            "cpus_at_once": "with more than one CPU, every batch runs on each at once (threads pinned, started together), each with its own generated flows; a batch's figures are over the calls of all of them (syscall_ns: the mean of each CPU's wall clock per call); established_inband runs on one CPU only",
            "conn_table": format!("LRU hash, BPF_F_NO_COMMON_LRU, {} entries ({} per possible CPU) for the established and new-flow cases; the new-flow case deletes the flows each batch inserted after the batch (table always has room); the full-table case uses {FULL_TABLE_PER_CPU} entries per CPU kept full, so every insert evicts", opts.conn_table, opts.conn_table as usize / possible),
            "many_flows": opts.flows,
            "conn_entries_main_after_run": conns_main,
            "fib_egress_mtu": FIB_MTU,
            "mtu_check_1514B_frame_fib_netns": run.mtu_check,
            "vips": "IPv4 10.200.0.1:443/tcp and IPv6 fd00:200::1:443/tcp, 4 backends each, 65537-slot Maglev rings, no affinity, flood guard off",
            "tenants": lab::TENANTS_DESCRIBED,
            "tenant_admitted_new_sessions": tenant_admitted,
            "second_chance": "sc_* cases: the same VIPs with flow_state second-chance on a fourth data plane, backends marked as running the backend program (GUE); the ring was published twice, the second table moving every slot, so every packet's GUE names a previous backend (the most work). No conn-table lookup or insert for TCP",
            "backend": "backend_* cases (fib variant only): sluice_decap on the second-chance LB's GUE output, in the fib namespace with the VIP on lo: backend_socket_found carries an ACK of a TCP connection open on that host (bpf_skc_lookup_tcp finds it: decap, XDP_PASS); backend_forwarded an ACK for which only the VIP's listener is there (SYN-cookie check fails) and is readdressed to the previous backend (FIB lookup, XDP_REDIRECT). Baseline pass_gue: sluice_pass on the same GUE frame",
            "frames": "untagged Ethernet; TCP without options; 54 B (IPv4), 74 B (IPv6), 1514 B (IPv4, 1460 B payload)",
        },
        "elapsed_s": run.started.elapsed().as_secs_f64(),
    }))
}
