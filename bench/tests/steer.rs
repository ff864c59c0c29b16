//! The short end-to-end steer run: the `throttled` scenario (one accelerator throttled to
//! 0.4x over the middle third) under plain Maglev and under adaptive steering, in the
//! namespace lab with the real daemon and simulated accelerators. Adaptive must give a lower
//! p99 time to first token and break no stream. Needs root and the built workspace
//! (`cargo xtask build --debug`: the sluice, sluice-accel and sluice-testsrv binaries next
//! to sluice-bench); fails saying what is missing otherwise.

use std::process::Command;

use serde_json::Value;

#[test]
fn throttled_adaptive_beats_maglev_and_breaks_no_stream() {
    let dir = std::env::temp_dir().join(format!("sluice-steer-test-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let out = dir.join("steer.json");
    let run = Command::new(env!("CARGO_BIN_EXE_sluice-bench"))
        .args([
            "steer",
            "--scenarios",
            "throttled",
            "--policies",
            "maglev,adaptive",
        ])
        .args(["--duration", "15", "--out"])
        .arg(&out)
        .arg("--plots")
        .arg(dir.join("plots"))
        .output()
        .expect("running sluice-bench steer");
    let text =
        String::from_utf8_lossy(&run.stdout).into_owned() + &String::from_utf8_lossy(&run.stderr);
    assert!(run.status.success(), "sluice-bench steer failed:\n{text}");
    let doc: Value = serde_json::from_str(&std::fs::read_to_string(&out).unwrap()).unwrap();
    let _ = std::fs::remove_dir_all(&dir);
    let cell = |p: &str| {
        doc["cells"]
            .as_array()
            .unwrap()
            .iter()
            .find(|c| c["policy"] == p)
            .unwrap_or_else(|| panic!("no {p} cell in {doc}"))
            .clone()
    };
    let (m, a) = (cell("maglev"), cell("adaptive"));
    let p99 = |c: &Value| c["ttft_ms"]["p99"].as_f64().unwrap();
    assert!(
        p99(&a) < p99(&m),
        "adaptive p99 TTFT {} ms is not below maglev's {} ms\n{text}",
        p99(&a),
        p99(&m)
    );
    assert_eq!(a["sessions"]["broken"], 0, "adaptive broke streams: {a}");
    assert!(a["sessions"]["completed"].as_u64().unwrap() > 20, "{a}");
}
