//! The `sluice-accel` binary over loopback: streams, the backend header, telemetry pages,
//! and the faults that only a real process can show (hang, freeze, kill resetting its
//! connections). Every wait is bounded; the child is killed when a test ends, also on failure.

use std::{
    io::{BufRead, BufReader, ErrorKind, Read, Write},
    net::{SocketAddr, TcpStream},
    process::{Child, Command, Stdio},
    time::Duration,
};

struct Accel {
    child: Child,
    serve: SocketAddr,
    control: SocketAddr,
}

impl Drop for Accel {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// Starts the binary on ephemeral ports and reads its ready line.
fn start(extra: &[&str]) -> Accel {
    let mut child = Command::new(env!("CARGO_BIN_EXE_sluice-accel"))
        .args(["--name", "gpu7", "--listen", "127.0.0.1:0"])
        .args(["--control", "127.0.0.1:0"])
        .args(extra)
        .stdout(Stdio::piped())
        .spawn()
        .expect("starting sluice-accel");
    let mut line = String::new();
    BufReader::new(child.stdout.take().unwrap())
        .read_line(&mut line)
        .unwrap();
    // "sluice-accel gpu7 ready: serving ADDR control ADDR"
    let words: Vec<&str> = line.split_whitespace().collect();
    assert_eq!(words.get(2), Some(&"ready:"), "ready line: {line:?}");
    Accel {
        serve: words[4].parse().unwrap(),
        control: words[6].parse().unwrap(),
        child,
    }
}

fn send(addr: SocketAddr, method: &str, path: &str, body: &str) -> TcpStream {
    let mut s = TcpStream::connect(addr).unwrap();
    s.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
    write!(
        s,
        "{method} {path} HTTP/1.1\r\nHost: lab\r\nContent-Type: application/json\r\n\
         Content-Length: {}\r\nConnection: close\r\n\r\n{body}",
        body.len()
    )
    .unwrap();
    s
}

/// The whole response (the server closes after it).
fn exchange(addr: SocketAddr, method: &str, path: &str, body: &str) -> String {
    let mut s = send(addr, method, path, body);
    let mut out = String::new();
    s.read_to_string(&mut out).unwrap();
    out
}

/// A long streaming request, once its first token has come: the stream is established.
fn long_stream(a: &Accel) -> TcpStream {
    let mut s = send(
        a.serve,
        "POST",
        "/v1/completions",
        r#"{"prompt":"abcd","max_tokens":2000,"stream":true}"#,
    );
    let mut buf = [0u8; 4096];
    let mut seen = Vec::new();
    while !String::from_utf8_lossy(&seen).contains("data: {") {
        let n = s.read(&mut buf).expect("reading the stream");
        assert!(n > 0, "stream ended early");
        seen.extend_from_slice(&buf[..n]);
    }
    s
}

fn fault(a: &Accel, body: &str) -> String {
    let r = exchange(a.control, "POST", "/fault", body);
    assert!(r.starts_with("HTTP/1.1 200"), "{r}");
    r
}

#[test]
fn streams_name_the_backend_and_end_with_done() {
    let a = start(&[]);
    let r = exchange(
        a.serve,
        "POST",
        "/v1/chat/completions",
        r#"{"messages":[{"role":"user","content":"hi"}],"max_tokens":5,"stream":true}"#,
    );
    assert!(r.starts_with("HTTP/1.1 200"), "{r}");
    assert!(r.contains("x-sluice-backend: gpu7\r\n"), "{r}");
    assert!(r.contains("content-type: text/event-stream"), "{r}");
    assert_eq!(r.matches("data: {").count(), 5, "{r}");
    assert!(r.contains("\"finish_reason\":\"length\""), "{r}");
    assert!(r.trim_end().ends_with("0"), "chunked body ends: {r}");
    assert!(r.contains("data: [DONE]\n\n"), "{r}");

    // A request that can never fit the KV cache is refused, saying why.
    let r = exchange(
        a.serve,
        "POST",
        "/v1/completions",
        r#"{"prompt":"x","prompt_tokens":20000,"max_tokens":5}"#,
    );
    assert!(r.starts_with("HTTP/1.1 400"), "{r}");
    assert!(r.contains("KV cache holds 16384"), "{r}");
    assert!(r.contains("x-sluice-backend: gpu7\r\n"), "{r}");

    for path in ["/metrics", "/dcgm", "/roce", "/health"] {
        let r = exchange(a.serve, "GET", path, "");
        assert!(r.starts_with("HTTP/1.1 200"), "{path}: {r}");
    }
    let state = exchange(a.control, "GET", "/state", "");
    assert!(state.contains("\"name\":\"gpu7\""), "{state}");
    assert!(state.contains("\"fault\":\"none\""), "{state}");
}

#[test]
fn hang_holds_requests_until_cleared() {
    let a = start(&[]);
    fault(&a, r#"{"kind":"hang"}"#);
    let mut s = send(a.serve, "GET", "/health", "");
    s.set_read_timeout(Some(Duration::from_millis(300)))
        .unwrap();
    let mut buf = [0u8; 64];
    let e = s.read(&mut buf).expect_err("a hung accelerator answered");
    assert!(
        matches!(e.kind(), ErrorKind::WouldBlock | ErrorKind::TimedOut),
        "{e}"
    );
    assert!(exchange(a.control, "GET", "/state", "").contains("\"fault\":\"hang\""));
    fault(&a, r#"{"kind":"clear"}"#);
    s.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
    let mut out = String::new();
    s.read_to_string(&mut out).unwrap();
    assert!(out.starts_with("HTTP/1.1 200"), "{out}");
}

#[test]
fn freeze_keeps_the_pages_while_the_model_goes_on() {
    let a = start(&[]);
    let body = |r: String| r.split("\r\n\r\n").nth(1).unwrap_or_default().to_owned();
    let before = body(exchange(a.serve, "GET", "/metrics", ""));
    fault(&a, r#"{"kind":"freeze"}"#);
    let r = exchange(
        a.serve,
        "POST",
        "/v1/completions",
        r#"{"prompt":"abcd","max_tokens":3}"#,
    );
    assert!(r.contains("\"completion_tokens\":3"), "{r}");
    assert_eq!(body(exchange(a.serve, "GET", "/metrics", "")), before);
    fault(&a, r#"{"kind":"clear"}"#);
    let after = body(exchange(a.serve, "GET", "/metrics", ""));
    assert_ne!(after, before);
    assert!(after.contains("vllm:generation_tokens_total{engine=\"0\",model_name=\"sluice-sim/llama-3.3-70b-fp8\"} 3.0"), "{after}");
}

#[test]
fn lie_shows_an_idle_accelerator_while_the_model_keeps_its_pace() {
    let a = start(&[]);
    let body = |r: String| r.split("\r\n\r\n").nth(1).unwrap_or_default().to_owned();
    fault(&a, r#"{"kind":"lie"}"#);
    fault(&a, r#"{"kind":"throttle","factor":0.4}"#);
    let _stream = long_stream(&a);
    let state = exchange(a.control, "GET", "/state", "");
    assert!(state.contains("\"running\":1"), "{state}");
    assert!(state.contains("\"speed\":0.4"), "{state}");
    let metrics = body(exchange(a.serve, "GET", "/metrics", ""));
    assert!(
        metrics.contains(
            "vllm:num_requests_running{engine=\"0\",model_name=\"sluice-sim/llama-3.3-70b-fp8\"} 0"
        ),
        "{metrics}"
    );
    assert!(
        metrics.contains("vllm:generation_tokens_total{engine=\"0\",model_name=\"sluice-sim/llama-3.3-70b-fp8\"} 0.0"),
        "{metrics}"
    );
    let dcgm = body(exchange(a.serve, "GET", "/dcgm", ""));
    assert!(
        !dcgm.contains("} 91\n"),
        "a lying page shows no throttle heat: {dcgm}"
    );
    fault(&a, r#"{"kind":"clear"}"#);
    let metrics = body(exchange(a.serve, "GET", "/metrics", ""));
    assert!(
        metrics.contains(
            "vllm:num_requests_running{engine=\"0\",model_name=\"sluice-sim/llama-3.3-70b-fp8\"} 1"
        ),
        "{metrics}"
    );
}

#[test]
fn flap_alternates_the_speed_on_its_own_schedule() {
    let a = start(&[]);
    let state = |a: &Accel| {
        let r = exchange(a.control, "GET", "/state", "");
        let body = r.split("\r\n\r\n").nth(1).unwrap().to_owned();
        serde_json::from_str::<serde_json::Value>(&body).unwrap()
    };
    let speed = |a: &Accel| state(a)["speed"].as_f64().unwrap();
    // A stream keeps the engine stepping: its steps show the speed the model runs at.
    let _stream = long_stream(&a);
    fault(&a, r#"{"kind":"flap","factor":0.25,"period_s":0.4}"#);
    // Slowed at once, then full speed and slowed again within two periods: both are seen
    // within a few periods whatever the scheduling delays.
    let (mut seen, mut steps) = (Vec::new(), Vec::new());
    for _ in 0..40 {
        let st = state(&a);
        seen.push(st["speed"].as_f64().unwrap());
        steps.push(st["step_ms"].as_f64().unwrap());
        std::thread::sleep(Duration::from_millis(50));
    }
    assert_eq!(seen[0], 0.25, "{seen:?}");
    assert!(seen.contains(&1.0), "{seen:?}");
    let changes = seen.windows(2).filter(|w| w[0] != w[1]).count();
    assert!(changes >= 3, "{changes} changes in 2 s: {seen:?}");
    // The model's own steps: a quarter of the speed takes four times as long, and after
    // the first slowed step a full-speed one comes.
    let slow = steps.iter().copied().fold(0.0, f64::max);
    let first_slow = steps.iter().position(|&s| s > 0.9 * slow).unwrap();
    let fast = steps[first_slow..].iter().copied().fold(f64::MAX, f64::min);
    assert!(slow / fast > 3.5, "step times {steps:?}");
    let bad = exchange(
        a.control,
        "POST",
        "/fault",
        r#"{"kind":"flap","factor":0.5,"period_s":-1}"#,
    );
    assert!(
        bad.starts_with("HTTP/1.1 400") && bad.contains("period_s"),
        "{bad}"
    );
    fault(&a, r#"{"kind":"clear"}"#);
    assert_eq!(speed(&a), 1.0);
}

#[test]
fn kill_exits_and_resets_open_streams() {
    let mut a = start(&[]);
    let mut s = long_stream(&a);
    let r = exchange(a.control, "POST", "/fault", r#"{"kind":"kill"}"#);
    assert!(r.contains("\"fault\":\"kill\""), "{r}");
    let status = a.child.wait().unwrap();
    assert_eq!(status.code(), Some(3));
    let mut buf = [0u8; 4096];
    let end = loop {
        match s.read(&mut buf) {
            Ok(0) => break Ok(()),
            Ok(_) => continue,
            Err(e) => break Err(e),
        }
    };
    let e = end.expect_err("the stream ended cleanly instead of being reset");
    assert_eq!(e.kind(), ErrorKind::ConnectionReset, "{e}");
}

#[test]
fn slow_and_faults_change_the_speed() {
    let a = start(&["--slow", "0.5"]);
    let state = |a: &Accel| {
        let r = exchange(a.control, "GET", "/state", "");
        let body = r.split("\r\n\r\n").nth(1).unwrap().to_owned();
        serde_json::from_str::<serde_json::Value>(&body).unwrap()
    };
    assert_eq!(state(&a)["speed"], 0.5);
    fault(&a, r#"{"kind":"throttle","factor":0.4}"#);
    assert_eq!(state(&a)["speed"], 0.2);
    assert_eq!(state(&a)["fault"], "throttle 0.4");
    let bad = exchange(
        a.control,
        "POST",
        "/fault",
        r#"{"kind":"throttle","factor":2}"#,
    );
    assert!(
        bad.starts_with("HTTP/1.1 400") && bad.contains("out of range"),
        "{bad}"
    );
    assert_eq!(state(&a)["speed"], 0.2, "a bad request changes nothing");
    fault(&a, r#"{"kind":"clear"}"#);
    assert_eq!(state(&a)["speed"], 0.5, "--slow stays after clear");
}

#[test]
fn a_client_that_goes_away_frees_its_place() {
    let a = start(&[]);
    let s = long_stream(&a);
    assert!(exchange(a.control, "GET", "/state", "").contains("\"running\":1"));
    drop(s);
    // Bounded: the server notices the closed connection at its next write.
    for _ in 0..100 {
        if exchange(a.control, "GET", "/state", "").contains("\"running\":0") {
            let m = exchange(a.serve, "GET", "/metrics", "");
            assert!(
                m.contains(
                    "finished_reason=\"abort\",model_name=\"sluice-sim/llama-3.3-70b-fp8\"} 1.0"
                ),
                "{m}"
            );
            return;
        }
        std::thread::sleep(Duration::from_millis(50));
    }
    panic!("the abandoned request still runs after 5 s");
}
