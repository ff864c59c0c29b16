//! A backend server for the namespace lab, run inside a backend namespace with
//! `ip netns exec <ns> sluice-testsrv serve --name b0 --tcp 10.111.100.1:8000 ...`.
//!
//! - `--tcp ADDR` (repeatable): token streams (see `sluice_tests::stream`): per connection a
//!   greeting naming this backend, then tokens at the requested rate, then `[DONE]`.
//! - `--udp ADDR` (repeatable): answers every datagram with `<name> <datagram>`.
//! - `--quic ADDR` (repeatable): QUIC token streams (see `sluice_tests::quic`), quinn with a
//!   self-signed certificate. With `--quic-server-id HEX` (e.g. `0a01`) its connection IDs
//!   carry that QUIC-LB server ID (`--quic-rotation N`, default 0; `--quic-nonce-len N`,
//!   default 6), so a load balancer with `quic = "cid"` routes them here; without, quinn's
//!   random ones. With `--quic-id-file FILE` instead, each `--quic` address takes the ID and
//!   rotation that `sluice backend-host` wrote for its VIP to its `quic_file`
//!   (`{"vips": [{"vip": ..., "quic_server_id": "0a01", "quic_config_rotation": 0, ...}]}`),
//!   as a QUIC server deployed behind Sluice would.
//! - `--metrics ADDR=FILE` (repeatable): a fake Prometheus exporter (dcgm-exporter, vLLM,
//!   node_exporter...): `GET /metrics` on ADDR answers the content of FILE, read again for
//!   every request, so a test changes the values at run time by rewriting the file (write a
//!   temporary file and rename it over FILE, so no request sees half a page). In the page,
//!   `{{counter:RATE}}` becomes a counter growing by RATE per second since the server
//!   started (a congestion counter such as ECN marks at a steady rate). HTTP/1.1 with
//!   keep-alive, as Prometheus and Sluice's scraper use it; a missing file answers 503.
//!
//! Prints `READY <name>` once every socket is bound. Bounded: it exits after `--max-seconds`
//! (default 300), serves at most `--max-conns` concurrent connections (default 1024, others
//! are refused with 503), and every socket operation has a timeout.

use std::{
    io::{BufRead, BufReader, Write},
    net::{SocketAddr, TcpListener, TcpStream, UdpSocket},
    path::{Path, PathBuf},
    process::exit,
    sync::{
        atomic::{AtomicU64, AtomicUsize, Ordering},
        Arc,
    },
    thread,
    time::{Duration, Instant},
};

use sluice_quic_lb::QuicLbCids;
use sluice_tests::{
    quic,
    stream::{
        done_event, hello_event, parse_request, response_head, token_event, MAX_HEADER_LINES,
    },
};

struct Opts {
    name: String,
    tcp: Vec<SocketAddr>,
    udp: Vec<SocketAddr>,
    quic: Vec<SocketAddr>,
    quic_server_id: Option<Vec<u8>>,
    quic_id_file: Option<PathBuf>,
    quic_rotation: u8,
    quic_nonce_len: usize,
    metrics: Vec<(SocketAddr, PathBuf)>,
    max_seconds: u64,
    max_conns: usize,
    default_tokens: u32,
    default_interval_ms: u32,
}

const USAGE: &str = "usage: sluice-testsrv serve --name NAME [--tcp ADDR:PORT]... \
[--udp ADDR:PORT]... [--quic ADDR:PORT]... [--quic-server-id HEX] [--quic-rotation N] \
[--quic-nonce-len N] [--quic-id-file FILE] [--metrics ADDR:PORT=FILE]... [--max-seconds N] [--max-conns N] \
[--tokens N] [--interval-ms N]";

fn parse_args() -> Result<Opts, String> {
    let mut args = std::env::args().skip(1);
    if args.next().as_deref() != Some("serve") {
        return Err(USAGE.into());
    }
    let mut o = Opts {
        name: String::new(),
        tcp: vec![],
        udp: vec![],
        quic: vec![],
        quic_server_id: None,
        quic_id_file: None,
        quic_rotation: 0,
        quic_nonce_len: 6,
        metrics: vec![],
        max_seconds: 300,
        max_conns: 1024,
        default_tokens: 20,
        default_interval_ms: 50,
    };
    while let Some(flag) = args.next() {
        let v = args
            .next()
            .ok_or_else(|| format!("{flag} needs a value\n{USAGE}"))?;
        let bad = |e: &dyn std::fmt::Display| format!("{flag} {v}: {e}");
        match flag.as_str() {
            "--name" => o.name = v,
            "--tcp" => o.tcp.push(v.parse().map_err(|e| bad(&e))?),
            "--udp" => o.udp.push(v.parse().map_err(|e| bad(&e))?),
            "--quic" => o.quic.push(v.parse().map_err(|e| bad(&e))?),
            "--quic-server-id" => {
                o.quic_server_id = Some(
                    sluice_quic_lb::parse_server_id(&v)
                        .ok_or_else(|| bad(&"expected 1 to 8 octets in hex"))?,
                )
            }
            "--quic-id-file" => o.quic_id_file = Some(PathBuf::from(v)),
            "--quic-rotation" => o.quic_rotation = v.parse().map_err(|e| bad(&e))?,
            "--quic-nonce-len" => o.quic_nonce_len = v.parse().map_err(|e| bad(&e))?,
            "--metrics" => {
                let (addr, file) = v
                    .split_once('=')
                    .ok_or_else(|| bad(&"expected ADDR:PORT=FILE"))?;
                o.metrics
                    .push((addr.parse().map_err(|e| bad(&e))?, PathBuf::from(file)));
            }
            "--max-seconds" => o.max_seconds = v.parse().map_err(|e| bad(&e))?,
            "--max-conns" => o.max_conns = v.parse().map_err(|e| bad(&e))?,
            "--tokens" => o.default_tokens = v.parse().map_err(|e| bad(&e))?,
            "--interval-ms" => o.default_interval_ms = v.parse().map_err(|e| bad(&e))?,
            _ => return Err(format!("unknown flag {flag}\n{USAGE}")),
        }
    }
    if o.name.is_empty() || o.name.contains(char::is_whitespace) {
        return Err(format!("--name is required (no spaces)\n{USAGE}"));
    }
    if o.quic_server_id.is_some() && o.quic_id_file.is_some() {
        return Err(format!(
            "--quic-server-id and --quic-id-file exclude each other\n{USAGE}"
        ));
    }
    if o.tcp.is_empty() && o.udp.is_empty() && o.quic.is_empty() && o.metrics.is_empty() {
        return Err(format!(
            "nothing to serve: give --tcp, --udp, --quic or --metrics\n{USAGE}"
        ));
    }
    Ok(o)
}

const IO_TIMEOUT: Duration = Duration::from_secs(10);

fn main() {
    let o = match parse_args() {
        Ok(o) => o,
        Err(e) => {
            eprintln!("sluice-testsrv: {e}");
            exit(2);
        }
    };
    let deadline = Instant::now() + Duration::from_secs(o.max_seconds);
    // The hard bound on the process's life, whatever its threads are doing.
    let max = o.max_seconds;
    thread::spawn(move || {
        thread::sleep(Duration::from_secs(max));
        exit(0);
    });

    let name: Arc<str> = o.name.clone().into();
    let conns = Arc::new(AtomicU64::new(0));
    let active = Arc::new(AtomicUsize::new(0));
    let mut threads = Vec::new();
    for addr in &o.tcp {
        let l = match TcpListener::bind(addr) {
            Ok(l) => l,
            Err(e) => {
                eprintln!("sluice-testsrv {}: binding tcp {addr}: {e}", o.name);
                exit(1);
            }
        };
        let (name, conns, active) = (name.clone(), conns.clone(), active.clone());
        let (max_conns, dt, di) = (o.max_conns, o.default_tokens, o.default_interval_ms);
        threads.push(thread::spawn(move || {
            for s in l.incoming() {
                let Ok(s) = s else { continue };
                let n = conns.fetch_add(1, Ordering::Relaxed) + 1;
                if active.fetch_add(1, Ordering::AcqRel) >= max_conns {
                    active.fetch_sub(1, Ordering::AcqRel);
                    let _ = (&s).write_all(b"HTTP/1.1 503 Service Unavailable\r\n\r\n");
                    continue;
                }
                let (name, active) = (name.clone(), active.clone());
                thread::spawn(move || {
                    if let Err(e) = stream(s, &name, n, dt, di, deadline) {
                        // A client that went away mid-stream is normal in the demo; a
                        // malformed request is worth a line.
                        if e.kind() == std::io::ErrorKind::InvalidData {
                            eprintln!("sluice-testsrv {name}: connection {n}: {e}");
                        }
                    }
                    active.fetch_sub(1, Ordering::AcqRel);
                });
            }
        }));
    }
    for addr in &o.udp {
        let s = match UdpSocket::bind(addr) {
            Ok(s) => s,
            Err(e) => {
                eprintln!("sluice-testsrv {}: binding udp {addr}: {e}", o.name);
                exit(1);
            }
        };
        let name = name.clone();
        threads.push(thread::spawn(move || echo(s, &name, deadline)));
    }
    if !o.quic.is_empty() {
        threads.push(start_quic(&o, name.clone()));
    }
    let started = Instant::now();
    for (addr, file) in &o.metrics {
        let l = match TcpListener::bind(addr) {
            Ok(l) => l,
            Err(e) => {
                eprintln!("sluice-testsrv {}: binding metrics {addr}: {e}", o.name);
                exit(1);
            }
        };
        let file: Arc<Path> = file.as_path().into();
        threads.push(thread::spawn(move || {
            for s in l.incoming() {
                let Ok(s) = s else { continue };
                let file = file.clone();
                thread::spawn(move || {
                    let _ = exporter(s, &file, started);
                });
            }
        }));
    }
    println!("READY {}", o.name);
    let _ = std::io::stdout().flush();
    for t in threads {
        let _ = t.join();
    }
}

/// The QUIC servers (one endpoint per `--quic` address) on a thread with a tokio runtime;
/// exits the process if one cannot start (before READY is printed).
fn start_quic(o: &Opts, name: Arc<str>) -> thread::JoinHandle<()> {
    let fail = |e: String| -> ! {
        eprintln!("sluice-testsrv {}: {e}", o.name);
        exit(2);
    };
    let file = o.quic_id_file.as_ref().map(|f| {
        std::fs::read_to_string(f).unwrap_or_else(|e| fail(format!("{}: {e}", f.display())))
    });
    // The connection IDs of each --quic address.
    let cids: Vec<Option<QuicLbCids>> = o
        .quic
        .iter()
        .map(|addr| {
            let (rotation, id) = match (&o.quic_server_id, &file) {
                (Some(id), _) => (o.quic_rotation, id.clone()),
                (None, Some(text)) => quic::id_from_backend_host_file(text, addr.ip())
                    .unwrap_or_else(|e| fail(format!("--quic-id-file: {e:#}"))),
                (None, None) => return None,
            };
            Some(
                QuicLbCids::new(rotation, &id, o.quic_nonce_len)
                    .unwrap_or_else(|e| fail(format!("QUIC server ID for {addr}: {e}"))),
            )
        })
        .collect();
    let mut sockets = Vec::new();
    for addr in &o.quic {
        match UdpSocket::bind(addr) {
            Ok(s) => sockets.push(s),
            Err(e) => {
                eprintln!("sluice-testsrv {}: binding quic {addr}: {e}", o.name);
                exit(1);
            }
        }
    }
    let rt = match tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
    {
        Ok(rt) => rt,
        Err(e) => {
            eprintln!("sluice-testsrv {}: starting tokio: {e}", o.name);
            exit(1);
        }
    };
    let mut endpoints = Vec::new();
    for (s, cids) in sockets.into_iter().zip(&cids) {
        let _guard = rt.enter();
        match quic::server_endpoint(s, cids.as_ref()) {
            Ok(ep) => endpoints.push(ep),
            Err(e) => {
                eprintln!("sluice-testsrv {}: quic: {e:#}", o.name);
                exit(1);
            }
        }
    }
    thread::spawn(move || {
        rt.block_on(async move {
            let mut tasks = Vec::new();
            for ep in endpoints {
                tasks.push(tokio::spawn(quic::serve(ep, name.clone())));
            }
            for t in tasks {
                let _ = t.await;
            }
        })
    })
}

/// Serves one token stream.
fn stream(
    s: TcpStream,
    name: &str,
    n: u64,
    default_tokens: u32,
    default_interval: u32,
    deadline: Instant,
) -> std::io::Result<()> {
    s.set_read_timeout(Some(IO_TIMEOUT))?;
    s.set_write_timeout(Some(IO_TIMEOUT))?;
    s.set_nodelay(true)?;
    let mut r = BufReader::new(s.try_clone()?);
    let mut line = String::new();
    if r.read_line(&mut line)? == 0 {
        // Closed before asking for anything: a TCP health check.
        return Ok(());
    }
    let invalid = |m: String| std::io::Error::new(std::io::ErrorKind::InvalidData, m);
    let Some((tokens, interval)) = parse_request(line.trim_end(), default_tokens, default_interval)
    else {
        let _ = (&s).write_all(b"HTTP/1.1 400 Bad Request\r\nConnection: close\r\n\r\n");
        return Err(invalid(format!("bad request line {:?}", line.trim_end())));
    };
    for _ in 0..MAX_HEADER_LINES {
        line.clear();
        if r.read_line(&mut line)? == 0 || line.trim_end().is_empty() {
            break;
        }
    }
    let mut w = &s;
    w.write_all(response_head(name).as_bytes())?;
    w.write_all(hello_event(name, n, tokens, interval).as_bytes())?;
    let start = Instant::now();
    for i in 1..=tokens {
        // Paced from the start, so a slow write does not stretch the stream.
        let due = start + Duration::from_millis(interval as u64 * i as u64);
        if due >= deadline {
            return Err(invalid(
                "the server's lifetime ends before the stream".into(),
            ));
        }
        if let Some(wait) = due.checked_duration_since(Instant::now()) {
            thread::sleep(wait);
        }
        w.write_all(token_event(name, i).as_bytes())?;
    }
    w.write_all(done_event().as_bytes())?;
    s.shutdown(std::net::Shutdown::Write)?;
    // Wait (bounded) for the client to close, so the close is the client's.
    let mut rest = Vec::new();
    let _ = std::io::Read::read_to_end(&mut r, &mut rest);
    Ok(())
}

/// Answers datagrams with `<name> <datagram>` until the deadline (at most 10 million).
fn echo(s: UdpSocket, name: &str, deadline: Instant) {
    let _ = s.set_read_timeout(Some(Duration::from_millis(200)));
    // Room for a jumbo datagram (the MTU-9000 lab).
    let mut buf = vec![0u8; 65536];
    let mut out = Vec::with_capacity(65536);
    for _ in 0..10_000_000u64 {
        if Instant::now() >= deadline {
            return;
        }
        let Ok((n, from)) = s.recv_from(&mut buf) else {
            continue;
        };
        out.clear();
        out.extend_from_slice(name.as_bytes());
        out.push(b' ');
        out.extend_from_slice(&buf[..n]);
        let _ = s.send_to(&out, from);
    }
}

/// Serves `GET /metrics` requests on one kept-alive connection with the content of `file`.
fn exporter(s: TcpStream, file: &Path, started: Instant) -> std::io::Result<()> {
    // An idle scraper connection is closed after a while; the scraper reconnects.
    s.set_read_timeout(Some(Duration::from_secs(30)))?;
    s.set_write_timeout(Some(IO_TIMEOUT))?;
    s.set_nodelay(true)?;
    let mut r = BufReader::new(s.try_clone()?);
    let mut w = &s;
    // At most this many requests per connection (a bound, not a limit a scraper reaches).
    for _ in 0..1_000_000u32 {
        let mut line = String::new();
        if r.read_line(&mut line)? == 0 {
            return Ok(());
        }
        let mut close = false;
        for _ in 0..MAX_HEADER_LINES {
            let mut h = String::new();
            if r.read_line(&mut h)? == 0 || h.trim_end().is_empty() {
                break;
            }
            let h = h.to_ascii_lowercase();
            close |= h.starts_with("connection:") && h.contains("close");
        }
        let mut parts = line.split_whitespace();
        let (method, path) = (parts.next().unwrap_or(""), parts.next().unwrap_or(""));
        let (status, body) = if method != "GET" || path.split('?').next() != Some("/metrics") {
            ("404 Not Found", "only GET /metrics here\n".to_string())
        } else {
            match std::fs::read_to_string(file) {
                Ok(text) => ("200 OK", expand(&text, started.elapsed())),
                Err(e) => (
                    "503 Service Unavailable",
                    format!("{}: {e}\n", file.display()),
                ),
            }
        };
        let head = format!(
            "HTTP/1.1 {status}\r\nContent-Type: text/plain; version=0.0.4; charset=utf-8\r\n\
             Content-Length: {}\r\n{}\r\n",
            body.len(),
            if close { "Connection: close\r\n" } else { "" }
        );
        w.write_all(head.as_bytes())?;
        w.write_all(body.as_bytes())?;
        if close {
            return Ok(());
        }
    }
    Ok(())
}

/// Replaces every `{{counter:RATE}}` with `RATE * elapsed seconds`, rounded down.
fn expand(text: &str, elapsed: Duration) -> String {
    const OPEN: &str = "{{counter:";
    let mut out = String::with_capacity(text.len());
    let mut rest = text;
    while let Some(i) = rest.find(OPEN) {
        out.push_str(&rest[..i]);
        let after = &rest[i + OPEN.len()..];
        match after
            .find("}}")
            .map(|j| (after[..j].trim().parse::<f64>(), j))
        {
            Some((Ok(rate), j)) => {
                out.push_str(&format!("{}", (rate * elapsed.as_secs_f64()).floor()));
                rest = &after[j + 2..];
            }
            // Not a template after all: keep it as written.
            _ => {
                out.push_str(OPEN);
                rest = after;
            }
        }
    }
    out.push_str(rest);
    out
}
