//! Summaries of the xdp benchmark: the stdout table, the JSON document and the SVG chart.

use std::{collections::BTreeMap, fmt::Write as _};

use serde_json::{json, Value};

use crate::{
    summary::{r1, Summary},
    xdp::{
        cases::{case, CaseDef, CaseId, Variant, CASES},
        measure::{Batch, CaseResult},
    },
};

fn r3(x: f64) -> f64 {
    (x * 1000.0).round() / 1000.0
}

/// The XDP_PASS baseline of Katran's figures in anchors.md.
const KATRAN_BASELINE_NS: f64 = 60.0;

/// Cases whose cost is an increment over another case's: (case, against). Their report adds
/// the per-round difference, each round's two batches having run close together in time, so
/// the drift between rounds on a loaded machine cancels (the in-band path's cost is about
/// 10 ns, less than that drift).
const PAIRED: [(&str, &str); 1] = [("established_inband", "established")];

/// Per-round differences `a - b` of one measure: their summary, 10th percentile and largest,
/// a distribution-free 95% confidence interval of the median (the order statistics
/// `n/2 -+ 0.98 sqrt(n)`), and the values.
fn difference(a: &[f64], b: &[f64]) -> Value {
    let d: Vec<f64> = a.iter().zip(b).map(|(x, y)| x - y).collect();
    let mut sorted = d.clone();
    sorted.sort_by(f64::total_cmp);
    let mut v = Summary::of(&d).json();
    if let (Some(first), Some(last)) = (sorted.first(), sorted.last()) {
        let n = sorted.len();
        let at = |rank: f64| sorted[(rank.round().max(0.0) as usize).min(n - 1)];
        let half = 0.98 * (n as f64).sqrt();
        v["p10"] = json!(r1(at(0.1 * n as f64 - 0.5)));
        v["max"] = json!(r1(*last));
        v["min"] = json!(r1(*first));
        v["median_ci95"] = json!([
            r1(at(n as f64 / 2.0 - half - 0.5)),
            r1(at(n as f64 / 2.0 + half - 0.5))
        ]);
    }
    v["rounds"] = json!(d.iter().map(|x| r1(*x)).collect::<Vec<_>>());
    v
}

pub struct Row {
    pub variant: Variant,
    pub def: &'static CaseDef,
    pub frame_bytes: usize,
    pub calls: usize,
    pub rounds: usize,
    pub kernel: Summary,
    pub kernel_call_median: Summary,
    pub syscall: Summary,
    pub ratio_kernel: Option<f64>,
    pub ratio_syscall: Option<f64>,
    pub ratio_kernel_rounds: Option<f64>,
    pub ratio_syscall_rounds: Option<f64>,
    pub net_kernel: Option<f64>,
    pub net_syscall: Option<f64>,
    pub counters: BTreeMap<&'static str, u64>,
    pub wrong_actions: BTreeMap<u32, usize>,
    /// Batch values in round order.
    pub kernel_rounds: Vec<f64>,
    pub kernel_call_rounds: Vec<f64>,
    pub syscall_rounds: Vec<f64>,
}

pub struct Report {
    meta: Value,
    variants: Vec<Variant>,
    rows: Vec<Row>,
}

impl Report {
    pub fn new(meta: Value, variants: &[Variant], results: &[CaseResult]) -> Report {
        let find = |v: Variant, id| results.iter().find(|r| r.variant == v && r.id == id);
        let mut rows = Vec::new();
        for r in results {
            let def = case(r.id);
            let k: Vec<f64> = r.batches.iter().map(|b| b.kernel_ns).collect();
            let kc: Vec<f64> = r.batches.iter().map(|b| b.kernel_call_median_ns).collect();
            let s: Vec<f64> = r.batches.iter().map(|b| b.syscall_ns).collect();
            let kernel = Summary::of(&k);
            let syscall = Summary::of(&s);
            let base = def.baseline.and_then(|b| find(r.variant, b));
            let (mut rk, mut rs, mut rkr, mut rsr, mut nk, mut ns) =
                (None, None, None, None, None, None);
            if let Some(b) = base {
                let bk = Summary::of(&b.batches.iter().map(|x| x.kernel_ns).collect::<Vec<_>>());
                let bs = Summary::of(&b.batches.iter().map(|x| x.syscall_ns).collect::<Vec<_>>());
                rk = Some(kernel.median / bk.median);
                rs = Some(syscall.median / bs.median);
                nk = Some(kernel.median - bk.median);
                ns = Some(syscall.median - bs.median);
                // Per-round ratios (batches of one round ran close together in time).
                let per = |f: fn(&Batch) -> f64| {
                    let v: Vec<f64> = r
                        .batches
                        .iter()
                        .zip(&b.batches)
                        .map(|(x, y)| f(x) / f(y))
                        .collect();
                    Summary::of(&v).median
                };
                rkr = Some(per(|b| b.kernel_ns));
                rsr = Some(per(|b| b.syscall_ns));
            }
            rows.push(Row {
                variant: r.variant,
                def,
                frame_bytes: r.frame_bytes,
                calls: r.batches.iter().map(|b| b.calls).sum(),
                rounds: r.batches.len(),
                kernel,
                kernel_call_median: Summary::of(&kc),
                syscall,
                ratio_kernel: rk,
                ratio_syscall: rs,
                ratio_kernel_rounds: rkr,
                ratio_syscall_rounds: rsr,
                net_kernel: nk,
                net_syscall: ns,
                counters: r.counters.clone(),
                wrong_actions: r.batches.iter().fold(BTreeMap::new(), |mut m, b| {
                    for (a, n) in &b.wrong_actions {
                        *m.entry(*a).or_default() += n;
                    }
                    m
                }),
                kernel_rounds: k.iter().map(|x| r1(*x)).collect(),
                kernel_call_rounds: kc.iter().map(|x| r1(*x)).collect(),
                syscall_rounds: s.iter().map(|x| r1(*x)).collect(),
            });
        }
        Report {
            meta,
            variants: variants.to_vec(),
            rows,
        }
    }

    fn rows_of(&self, v: Variant) -> impl Iterator<Item = &Row> {
        self.rows.iter().filter(move |r| r.variant == v)
    }

    /// `r`'s per-round difference from the case [`PAIRED`] names for it, if both ran.
    fn paired(&self, r: &Row) -> Option<Value> {
        let (_, against) = PAIRED.iter().find(|(k, _)| *k == r.def.key)?;
        let b = self.rows_of(r.variant).find(|b| b.def.key == *against)?;
        Some(json!({
            "against": against,
            "kernel_ns": difference(&r.kernel_rounds, &b.kernel_rounds),
            // Each batch's median call: a call the scheduler interrupted moves it little.
            "kernel_call_median_ns": difference(&r.kernel_call_rounds, &b.kernel_call_rounds),
            "syscall_ns": difference(&r.syscall_rounds, &b.syscall_rounds),
        }))
    }

    pub fn print_table(&self) {
        let m = &self.meta;
        println!();
        println!(
            "sluice xdp benchmark  {}  kernel {}  {}  CPU {} at once  rounds {}",
            m["date_utc"].as_str().unwrap_or(""),
            m["kernel"].as_str().unwrap_or(""),
            m["cpu_model"].as_str().unwrap_or(""),
            m["cpus_at_once"],
            m["method"]["rounds_completed"]
        );
        println!("per call, BPF_PROG_TEST_RUN repeat 1 on a fresh frame; median [min p90] over rounds; x = ratio to the sluice_pass baseline of the same frame size");
        for &v in &self.variants {
            println!("\n[{}] {}", v.name(), v.describe());
            println!(
                "{:<36} {:>5} | {:>7} {:>7} {:>7} {:>6} | {:>7} {:>7} {:>7} {:>6} | {:>5} {:>6} | path",
                "case", "bytes", "kern ns", "min", "p90", "x", "sys ns", "min", "p90", "x", "aim", "katran"
            );
            for r in self.rows_of(v) {
                let x = |o: Option<f64>| o.map(|x| format!("{x:.2}")).unwrap_or_else(|| "1".into());
                let opt = |o: Option<f64>| o.map(|x| format!("{x}")).unwrap_or_default();
                println!(
                    "{:<36} {:>5} | {:>7.1} {:>7.1} {:>7.1} {:>6} | {:>7.1} {:>7.1} {:>7.1} {:>6} | {:>5} {:>6} | {}",
                    r.def.label,
                    r.frame_bytes,
                    r.kernel.median,
                    r.kernel.min,
                    r.kernel.p90,
                    x(r.ratio_kernel),
                    r.syscall.median,
                    r.syscall.min,
                    r.syscall.p90,
                    x(r.ratio_syscall),
                    opt(r.def.aim),
                    opt(r.def.katran),
                    path_summary(r),
                );
            }
            for r in self.rows_of(v) {
                if let Some(d) = self.paired(r) {
                    let (k, c) = (&d["kernel_ns"], &d["kernel_call_median_ns"]);
                    println!(
                        "{} - {} per round: kernel {} ns median (95% CI {}) [p10 {} p90 {}], \
                         median call {} ns [p10 {} p90 {}], syscall {} ns median",
                        r.def.key,
                        d["against"],
                        k["median"],
                        k["median_ci95"],
                        k["p10"],
                        k["p90"],
                        c["median"],
                        c["p10"],
                        c["p90"],
                        d["syscall_ns"]["median"]
                    );
                }
            }
        }
        println!("\nheadline (aims: established <= 2.5x, new flow <= 8x, non-VIP <= 1.6x; Katran here: 3.3x, 10x, 1.9x):");
        for r in self.rows.iter().filter(|r| r.def.headline) {
            let aim = r.def.aim.unwrap_or(f64::NAN);
            let verdict = |x: Option<f64>| match x {
                Some(x) if x <= aim => format!("{x:.2}x meets {aim}x"),
                Some(x) => format!("{x:.2}x MISSES {aim}x"),
                None => "-".into(),
            };
            let nk = r.net_kernel.unwrap_or(f64::NAN);
            println!(
                "  [{:<8}] {:<30} syscall-incl. {:<18} | kernel {:<18} | net {:>5.1} ns kernel (Katran {:>3} ns), {:.2}x at Katran's 60 ns baseline",
                r.variant.name(),
                r.def.label,
                verdict(r.ratio_syscall),
                verdict(r.ratio_kernel),
                nk,
                r.def.katran_net_ns.unwrap_or(f64::NAN),
                (nk + KATRAN_BASELINE_NS) / KATRAN_BASELINE_NS,
            );
        }
        println!(
            "\nsecond chance against table mode, same run (net kernel ns; second chance / table):"
        );
        let pairs = [
            (CaseId::Established, CaseId::ScEstablished),
            (CaseId::SynNew, CaseId::ScSynNew),
            (CaseId::Established200k, CaseId::ScEstablished200k),
            (CaseId::EstablishedV6, CaseId::ScEstablishedV6),
        ];
        for &v in &self.variants {
            for (t, sc) in pairs {
                let net = |id| {
                    self.rows_of(v)
                        .find(|r| r.def.id == id)
                        .and_then(|r| r.net_kernel)
                };
                if let (Some(t), Some(s)) = (net(t), net(sc)) {
                    println!(
                        "  [{:<8}] {:<36} table {t:>6.1}  second chance {s:>6.1}  {:.2}x",
                        v.name(),
                        case(sc).label,
                        s / t
                    );
                }
            }
        }
    }

    pub fn json(&self) -> Value {
        let mut doc = self.meta.clone();
        let variants: Vec<Value> = self
            .variants
            .iter()
            .map(|&v| {
                let cases: Vec<Value> = self
                    .rows_of(v)
                    .map(|r| {
                        let per_call = |n: u64| r3(n as f64 / r.calls.max(1) as f64);
                        let counters: serde_json::Map<String, Value> = r
                            .counters
                            .iter()
                            .map(|(k, n)| (k.to_string(), json!({ "total": n, "per_call": per_call(*n) })))
                            .collect();
                        json!({
                            "case": r.def.key,
                            "label": r.def.label,
                            "program": r.def.prog,
                            "frame_bytes": r.frame_bytes,
                            "baseline": r.def.baseline.map(|b| case(b).key),
                            "rounds": r.rounds,
                            "calls_total": r.calls,
                            "kernel_ns": r.kernel.json(),
                            "kernel_call_median_ns": r.kernel_call_median.json(),
                            "syscall_ns": r.syscall.json(),
                            "ratio_syscall": r.ratio_syscall.map(r3),
                            "ratio_kernel": r.ratio_kernel.map(r3),
                            "ratio_syscall_per_round_median": r.ratio_syscall_rounds.map(r3),
                            "ratio_kernel_per_round_median": r.ratio_kernel_rounds.map(r3),
                            "net_of_baseline_kernel_ns": r.net_kernel.map(r1),
                            "net_of_baseline_syscall_ns": r.net_syscall.map(r1),
                            "aim_ratio": r.def.aim,
                            "meets_aim_syscall": r.def.aim.zip(r.ratio_syscall).map(|(a, x)| x <= a),
                            "meets_aim_kernel": r.def.aim.zip(r.ratio_kernel).map(|(a, x)| x <= a),
                            "katran_ratio": r.def.katran,
                            "katran_net_of_baseline_kernel_ns": r.def.katran_net_ns,
                            "kernel_ratio_at_katran_60ns_baseline": r.net_kernel.map(|n| r3((n + KATRAN_BASELINE_NS) / KATRAN_BASELINE_NS)),
                            "headline": r.def.headline,
                            "path": path_summary(r),
                            "counters": counters,
                            "unexpected_actions": r.wrong_actions.iter().map(|(a, n)| (a.to_string(), json!(n))).collect::<serde_json::Map<_, _>>(),
                            "per_round": {
                                "kernel_ns": r.kernel_rounds,
                                "syscall_ns": r.syscall_rounds,
                            },
                            "paired_difference": self.paired(r),
                        })
                    })
                    .collect();
                json!({ "variant": v.name(), "next_hop": v.describe(), "cases": cases })
            })
            .collect();
        doc["variants"] = Value::Array(variants);
        doc
    }

    /// Bar chart of the ratios (kernel-reported and syscall-inclusive panels), one bar per
    /// variant per case, with the aims (red) and Katran's ratios (grey) as marks.
    pub fn svg(&self) -> String {
        let cases: Vec<&CaseDef> = CASES.iter().filter(|c| c.baseline.is_some()).collect();
        let max_ratio = self
            .rows
            .iter()
            .flat_map(|r| [r.ratio_kernel, r.ratio_syscall])
            .flatten()
            .chain(cases.iter().flat_map(|c| [c.aim, c.katran]).flatten())
            .fold(1.0f64, f64::max);
        let (w, left, right) = (980.0, 60.0, 20.0);
        let group_w = (w - left - right) / cases.len() as f64;
        let g = Chart {
            w,
            top: 100.0,
            left,
            right,
            panel_h: 300.0,
            label_h: 80.0,
            ymax: (max_ratio * 1.1).ceil().max(2.0),
            group_w,
            bar_w: (group_w * 0.7) / self.variants.len().max(1) as f64,
        };
        let h = g.top + 2.0 * g.panel_h + g.label_h + 50.0;
        let mut s = String::new();
        let _ = writeln!(
            s,
            r#"<svg xmlns="http://www.w3.org/2000/svg" width="{w}" height="{h}" viewBox="0 0 {w} {h}" font-family="sans-serif" font-size="11">"#
        );
        let _ = writeln!(s, r#"<rect width="{w}" height="{h}" fill="white"/>"#);
        self.svg_heading(&mut s, g.left);
        for (p, (title, kernel)) in [
            ("syscall-inclusive (wall clock per call) / baseline: the headline ratio", false),
            ("kernel-reported duration / baseline (what Katran's 60 ns-baseline figures compare)", true),
        ]
        .iter()
        .enumerate()
        {
            let y0 = g.top + p as f64 * (g.panel_h + g.label_h);
            self.svg_panel(&mut s, &g, &cases, y0, title, *kernel);
        }
        s.push_str("</svg>\n");
        s
    }

    /// The chart's title, the run it shows, and the legend.
    fn svg_heading(&self, s: &mut String, left: f64) {
        let _ = writeln!(
            s,
            r#"<text x="{left}" y="20" font-size="14" font-weight="bold">Sluice sluice_xdp cost per packet / sluice_pass baseline (BPF_PROG_TEST_RUN, repeat 1, median of {} rounds)</text>"#,
            self.meta["method"]["rounds_completed"]
        );
        let _ = writeln!(
            s,
            r##"<text x="{left}" y="36" fill="#555">{} | kernel {} | {} | {}</text>"##,
            esc(self.meta["date_utc"].as_str().unwrap_or("")),
            esc(self.meta["kernel"].as_str().unwrap_or("")),
            esc(self.meta["cpu_model"].as_str().unwrap_or("")),
            esc(self.meta["git_head"]
                .as_str()
                .map(|h| &h[..h.len().min(12)])
                .unwrap_or(""))
        );
        let mut lx = left;
        for (i, v) in self.variants.iter().enumerate() {
            let _ = writeln!(
                s,
                r#"<rect x="{lx}" y="46" width="12" height="12" fill="{}"/><text x="{}" y="56">{} next hop</text>"#,
                COLORS[i % 2],
                lx + 16.0,
                v.name()
            );
            lx += 130.0;
        }
        let _ = writeln!(
            s,
            r##"<line x1="{lx}" y1="52" x2="{}" y2="52" stroke="#d62728" stroke-width="2" stroke-dasharray="5,3"/><text x="{}" y="56">aim</text>"##,
            lx + 24.0,
            lx + 28.0
        );
        lx += 70.0;
        let _ = writeln!(
            s,
            r##"<line x1="{lx}" y1="52" x2="{}" y2="52" stroke="#777" stroke-width="2" stroke-dasharray="2,2"/><text x="{}" y="56">Katran on this machine kind</text>"##,
            lx + 24.0,
            lx + 28.0
        );
    }

    /// One panel from `y0` down: its title, the ratio axis and grid, and per case a bar per
    /// variant with the aim and Katran's figure, labelled under the group.
    fn svg_panel(
        &self,
        s: &mut String,
        g: &Chart,
        cases: &[&CaseDef],
        y0: f64,
        title: &str,
        kernel: bool,
    ) {
        let (left, panel_h, ymax, bar_w) = (g.left, g.panel_h, g.ymax, g.bar_w);
        let nv = self.variants.len().max(1);
        let y = |r: f64| y0 + panel_h - (r / ymax) * panel_h;
        let _ = writeln!(
            s,
            r#"<text x="{left}" y="{}" font-size="12" font-weight="bold">{}</text>"#,
            y0 - 14.0,
            esc(title)
        );
        // Axis and grid.
        let step = if ymax > 12.0 { 2.0 } else { 1.0 };
        let mut t = 0.0;
        while t <= ymax + 1e-9 {
            let _ = writeln!(
                s,
                r##"<line x1="{left}" y1="{:.1}" x2="{}" y2="{:.1}" stroke="{}" stroke-width="1"/><text x="{}" y="{:.1}" text-anchor="end">{t}x</text>"##,
                y(t),
                g.w - g.right,
                y(t),
                if t == 0.0 { "#000" } else { "#e5e5e5" },
                left - 6.0,
                y(t) + 4.0
            );
            t += step;
        }
        for (gi, c) in cases.iter().enumerate() {
            let gx = left + gi as f64 * g.group_w + g.group_w * 0.15;
            for (vi, v) in self.variants.iter().enumerate() {
                let Some(r) = self
                    .rows
                    .iter()
                    .find(|r| r.variant == *v && r.def.id == c.id)
                else {
                    continue;
                };
                let Some(ratio) = (if kernel {
                    r.ratio_kernel
                } else {
                    r.ratio_syscall
                }) else {
                    continue;
                };
                let x = gx + vi as f64 * bar_w;
                let _ = writeln!(
                    s,
                    r#"<rect x="{x:.1}" y="{:.1}" width="{:.1}" height="{:.1}" fill="{}"><title>{} [{}]: {ratio:.2}x</title></rect><text x="{:.1}" y="{:.1}" text-anchor="middle" font-size="10">{ratio:.2}</text>"#,
                    y(ratio),
                    bar_w - 2.0,
                    (ratio / ymax) * panel_h,
                    COLORS[vi % 2],
                    esc(c.label),
                    v.name(),
                    x + (bar_w - 2.0) / 2.0,
                    y(ratio) - 3.0
                );
            }
            let (x1, x2) = (gx - 4.0, gx + nv as f64 * bar_w + 2.0);
            if let Some(a) = c.aim {
                let _ = writeln!(
                    s,
                    r##"<line x1="{x1:.1}" y1="{:.1}" x2="{x2:.1}" y2="{:.1}" stroke="#d62728" stroke-width="2" stroke-dasharray="5,3"><title>aim {a}x</title></line>"##,
                    y(a),
                    y(a)
                );
            }
            if let Some(k) = c.katran {
                let _ = writeln!(
                    s,
                    r##"<line x1="{x1:.1}" y1="{:.1}" x2="{x2:.1}" y2="{:.1}" stroke="#777" stroke-width="2" stroke-dasharray="2,2"><title>Katran {k}x</title></line>"##,
                    y(k),
                    y(k)
                );
            }
            // Case label under the group, wrapped on commas / parentheses.
            let cx = left + gi as f64 * g.group_w + g.group_w / 2.0;
            for (li, line) in wrap(c.label, 20).iter().enumerate() {
                let _ = writeln!(
                    s,
                    r#"<text x="{cx:.1}" y="{:.1}" text-anchor="middle">{}</text>"#,
                    y0 + panel_h + 14.0 + li as f64 * 12.0,
                    esc(line)
                );
            }
        }
    }
}

/// The bar colours of the first and second variant.
const COLORS: [&str; 2] = ["#4e79a7", "#f28e2b"];

/// The chart's geometry (pixels) and ratio scale.
struct Chart {
    w: f64,
    top: f64,
    left: f64,
    right: f64,
    panel_h: f64,
    label_h: f64,
    /// The top of the ratio axis.
    ymax: f64,
    /// Width of one case's group of bars, and of one bar.
    group_w: f64,
    bar_w: f64,
}

/// Which next hop and steering path (table, second chance, connection ID) the counters show,
/// per call.
fn path_summary(r: &Row) -> String {
    let n = r.calls.max(1) as f64;
    let keys = [
        "conn_hit",
        "conn_miss",
        "fib_fallback_mac",
        "tx",
        "redirect",
        "pass_not_vip",
        "second_chance_steered",
        "quic_cid_routed",
        "decap_ok",
        "decap_second_hop",
    ];
    let parts: Vec<String> = keys
        .iter()
        .filter_map(|k| {
            r.counters
                .get(k)
                .map(|c| format!("{k} {:.2}", *c as f64 / n))
        })
        .collect();
    if parts.is_empty() {
        "-".into()
    } else {
        parts.join(", ")
    }
}

fn wrap(text: &str, width: usize) -> Vec<String> {
    let mut lines = vec![String::new()];
    for word in text.split(' ') {
        let cur = lines.last_mut().unwrap();
        if !cur.is_empty() && cur.len() + 1 + word.len() > width {
            lines.push(word.to_string());
        } else {
            if !cur.is_empty() {
                cur.push(' ');
            }
            cur.push_str(word);
        }
    }
    lines
}

fn esc(s: &str) -> String {
    s.replace('&', "&amp;")
        .replace('<', "&lt;")
        .replace('>', "&gt;")
}
