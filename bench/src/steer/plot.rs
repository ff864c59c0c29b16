//! SVG plots of the steer benchmark: TTFT CDF per policy, and a cell's timeline (each
//! backend's weight, steering state and KV use, with the faults marked).

use std::fmt::Write;

const W: f64 = 720.0;
const LEFT: f64 = 70.0;
const RIGHT: f64 = 20.0;
const COLORS: [&str; 4] = ["#d62728", "#1f77b4", "#2ca02c", "#9467bd"];

/// One timeline sample of one backend.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct Point {
    /// Effective weight; `None`: not read.
    pub weight: Option<f64>,
    /// Steering state (`active`, `moved-away`, ...).
    pub state: Option<String>,
    /// KV-cache use 0..1 (`None`: the accelerator did not answer).
    pub kv: Option<f64>,
    /// Full for new sessions (at its cap, or KV or queue at the threshold): probed past.
    pub full: bool,
    /// At the operator's session cap: probed past by an affinity entry's turn too.
    pub capped: bool,
    /// Down or moved away for a fault: an affinity entry brings it no new session.
    pub no_affinity: bool,
    /// Active sessions as the daemon counts them (its connection table).
    pub sessions: Option<u64>,
    /// Age of the telemetry the daemon's last policy step decided on, in seconds: how late
    /// its view of the engine (and so `full`) is.
    pub telemetry_age_s: Option<f64>,
    /// The engine's running and waiting requests.
    pub running: Option<u64>,
    pub waiting: Option<u64>,
}

/// Samples at `t` seconds, one point per backend.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct Sample {
    pub t: f64,
    pub points: Vec<Point>,
}

fn esc(s: &str) -> String {
    s.replace('&', "&amp;")
        .replace('<', "&lt;")
        .replace('>', "&gt;")
}

fn header(h: f64, title: &str) -> String {
    format!(
        "<svg xmlns=\"http://www.w3.org/2000/svg\" width=\"{W}\" height=\"{h}\" \
         font-family=\"sans-serif\" font-size=\"11\">\n\
         <rect width=\"100%\" height=\"100%\" fill=\"white\"/>\n\
         <text x=\"{LEFT}\" y=\"18\" font-size=\"14\">{}</text>\n",
        esc(title)
    )
}

fn polyline(points: &[(f64, f64)], color: &str, width: f64) -> String {
    if points.is_empty() {
        return String::new();
    }
    let pts: Vec<String> = points
        .iter()
        .map(|(x, y)| format!("{x:.1},{y:.1}"))
        .collect();
    format!(
        "<polyline fill=\"none\" stroke=\"{color}\" stroke-width=\"{width}\" points=\"{}\"/>\n",
        pts.join(" ")
    )
}

/// TTFT CDFs (ms, log axis) of several policies in one scenario.
pub fn cdf(title: &str, series: &[(String, Vec<f64>)]) -> String {
    let (h, top, bottom) = (380.0, 30.0, 50.0);
    let max = series
        .iter()
        .flat_map(|(_, v)| v.iter().copied())
        .fold(10.0, f64::max);
    let (lo, hi) = (1.0_f64, 10f64.powf(max.log10().ceil()));
    let pw = W - LEFT - RIGHT;
    let ph = h - top - bottom;
    let x = |ms: f64| LEFT + pw * (ms.max(lo).log10() - lo.log10()) / (hi.log10() - lo.log10());
    let y = |f: f64| top + ph * (1.0 - f);
    let mut s = header(h, title);
    let mut decade = lo;
    while decade <= hi {
        let _ = writeln!(
            s,
            "<line x1=\"{0:.1}\" y1=\"{top}\" x2=\"{0:.1}\" y2=\"{1}\" stroke=\"#ddd\"/>\
             <text x=\"{0:.1}\" y=\"{2}\" text-anchor=\"middle\">{decade} ms</text>",
            x(decade),
            top + ph,
            top + ph + 15.0
        );
        decade *= 10.0;
    }
    for f in [0.0, 0.5, 0.9, 0.99, 1.0] {
        let _ = writeln!(
            s,
            "<line x1=\"{LEFT}\" y1=\"{0:.1}\" x2=\"{1}\" y2=\"{0:.1}\" stroke=\"#eee\"/>\
             <text x=\"{2}\" y=\"{0:.1}\" text-anchor=\"end\">{f}</text>",
            y(f),
            LEFT + pw,
            LEFT - 5.0
        );
    }
    let _ = writeln!(
        s,
        "<text x=\"{}\" y=\"{}\" text-anchor=\"middle\">time to first token (log)</text>",
        LEFT + pw / 2.0,
        h - 12.0
    );
    for (k, (name, v)) in series.iter().enumerate() {
        let mut sorted = v.clone();
        sorted.sort_by(f64::total_cmp);
        let n = sorted.len() as f64;
        let pts: Vec<(f64, f64)> = sorted
            .iter()
            .enumerate()
            .map(|(i, ms)| (x(*ms), y((i + 1) as f64 / n)))
            .collect();
        let color = COLORS[k % COLORS.len()];
        s += &polyline(&pts, color, 1.8);
        let _ = writeln!(
            s,
            "<text x=\"{}\" y=\"{}\" fill=\"{color}\">{} (n={})</text>",
            LEFT + 10.0,
            top + 15.0 + 14.0 * k as f64,
            esc(name),
            v.len()
        );
    }
    s + "</svg>\n"
}

fn state_color(state: &str) -> &'static str {
    match state {
        "active" => "#c7e9c0",
        "slow-start" => "#e5f5e0",
        "guarded" => "#fee391",
        "moved-away" => "#fdae6b",
        "down" => "#fb6a4a",
        _ => "#eeeeee",
    }
}

/// A cell's timeline: one lane per backend with its steering state as the background, its
/// weight (blue, 0..`max_weight`) and KV use (purple, 0..1); faults as vertical lines.
pub fn timeline(
    title: &str,
    secs: f64,
    backends: &[String],
    samples: &[Sample],
    faults: &[(f64, String)],
    max_weight: f64,
) -> String {
    let (top, lane, gap, bottom) = (40.0, 70.0, 12.0, 40.0);
    let h = top + backends.len() as f64 * (lane + gap) + bottom;
    let pw = W - LEFT - RIGHT;
    let x = |t: f64| LEFT + pw * (t / secs.max(1e-9)).clamp(0.0, 1.0);
    let mut s = header(h, title);
    let _ = writeln!(
        s,
        "<text x=\"{}\" y=\"32\" fill=\"#1f77b4\">weight</text>\
         <text x=\"{}\" y=\"32\" fill=\"#9467bd\">KV use</text>\
         <text x=\"{}\" y=\"32\">background: steering state (green active, yellow guarded, \
         orange moved away, red down)</text>",
        LEFT,
        LEFT + 50.0,
        LEFT + 100.0
    );
    for (b, name) in backends.iter().enumerate() {
        let y0 = top + b as f64 * (lane + gap);
        let _ = writeln!(
            s,
            "<text x=\"{}\" y=\"{:.1}\" text-anchor=\"end\">{}</text>",
            LEFT - 6.0,
            y0 + lane / 2.0,
            esc(name)
        );
        // Each sample's state holds until the next sample (the last one to the end).
        for (k, smp) in samples.iter().enumerate() {
            let end = samples.get(k + 1).map_or(secs, |n| n.t);
            let st = smp.points.get(b).and_then(|p| p.state.as_deref());
            let _ = writeln!(
                s,
                "<rect x=\"{:.1}\" y=\"{y0:.1}\" width=\"{:.1}\" height=\"{lane}\" fill=\"{}\"/>",
                x(smp.t),
                (x(end) - x(smp.t)).max(0.5),
                state_color(st.unwrap_or(""))
            );
        }
        let ly = |f: f64| y0 + lane * (1.0 - f.clamp(0.0, 1.0));
        let pts = |f: &dyn Fn(&Point) -> Option<f64>| -> Vec<(f64, f64)> {
            samples
                .iter()
                .filter_map(|smp| smp.points.get(b).and_then(f).map(|v| (x(smp.t), ly(v))))
                .collect()
        };
        s += &polyline(
            &pts(&|p: &Point| p.weight.map(|w| w / max_weight.max(1.0))),
            "#1f77b4",
            1.6,
        );
        s += &polyline(&pts(&|p: &Point| p.kv), "#9467bd", 1.2);
    }
    let bottom_y = top + backends.len() as f64 * (lane + gap);
    for (t, label) in faults {
        let _ = writeln!(
            s,
            "<line x1=\"{0:.1}\" y1=\"{top}\" x2=\"{0:.1}\" y2=\"{bottom_y:.1}\" \
             stroke=\"black\" stroke-dasharray=\"4 3\"/>\
             <text x=\"{1:.1}\" y=\"{2:.1}\">{3}</text>",
            x(*t),
            x(*t) + 3.0,
            bottom_y + 12.0,
            esc(label)
        );
    }
    let _ = writeln!(
        s,
        "<text x=\"{}\" y=\"{}\" text-anchor=\"middle\">seconds (0 .. {secs:.0})</text>",
        LEFT + pw / 2.0,
        h - 8.0
    );
    s + "</svg>\n"
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn plots_are_svg_with_every_series_and_fault() {
        let c = cdf(
            "throttled",
            &[
                ("maglev".into(), vec![50.0, 3000.0]),
                ("adaptive".into(), vec![40.0]),
            ],
        );
        assert!(c.starts_with("<svg") && c.ends_with("</svg>\n"));
        assert!(c.contains("maglev (n=2)") && c.contains("adaptive (n=1)"));
        assert!(c.contains("1000 ms"));
        let p = |w, st: &str| Point {
            weight: Some(w),
            state: Some(st.into()),
            kv: Some(0.5),
            ..Point::default()
        };
        let t = timeline(
            "throttled / adaptive",
            30.0,
            &["b0".into(), "b1".into()],
            &[
                Sample {
                    t: 0.0,
                    points: vec![p(100.0, "active"), p(100.0, "active")],
                },
                Sample {
                    t: 10.0,
                    points: vec![p(100.0, "active"), p(0.0, "moved-away")],
                },
            ],
            &[(10.0, "b1 throttled".into())],
            100.0,
        );
        assert!(t.contains("b1 throttled") && t.contains("#fdae6b") && t.contains("<polyline"));
    }
}
