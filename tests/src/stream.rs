//! The lab's token-stream protocol (an LLM-style server-sent-events stream over minimal
//! HTTP/1.1) and UDP echo, with the client side used by the namespace tests and the demo.
//! The server side is `sluice-testsrv serve` (src/bin/sluice-testsrv.rs).
//!
//! Request: `GET /v1/stream?tokens=<n>&interval_ms=<ms> HTTP/1.1` and headers. Response:
//!
//! ```text
//! HTTP/1.1 200 OK                       (headers, X-Sluice-Backend: <name>)
//!
//! event: hello
//! data: {"backend":"b0","conn":3,"tokens":30,"interval_ms":5}
//!
//! data: {"i":1,"backend":"b0","token":"Sluice"}      (one event per token, every interval)
//! ...
//! data: [DONE]
//! ```
//!
//! so `curl -N 'http://10.111.100.1:8000/v1/stream?tokens=5&interval_ms=200'` run in the
//! client namespace works too. UDP: every datagram is answered with `<backend> <datagram>`.

use std::{
    io::{BufRead, BufReader, Write},
    net::{IpAddr, Shutdown, SocketAddr, TcpStream, UdpSocket},
    time::{Duration, Instant},
};

use anyhow::{anyhow, bail, Context, Result};
use lb_common::{FlowKey, PROTO_TCP, PROTO_UDP};

use crate::{flow, netns::Netns};

/// Largest stream a server accepts, in tokens and in milliseconds between tokens.
pub const MAX_TOKENS: u32 = 1_000_000;
pub const MAX_INTERVAL_MS: u32 = 10_000;
/// Request headers a server reads at most (lines).
pub const MAX_HEADER_LINES: usize = 64;
pub const DONE: &str = "[DONE]";

/// Words the servers stream, in turn.
pub const WORDS: [&str; 16] = [
    "Sluice",
    " steers",
    " every",
    " new",
    " flow",
    " with",
    " Maglev",
    " and",
    " keeps",
    " it",
    " pinned",
    " while",
    " replies",
    " bypass",
    " the",
    " balancer.",
];

/// The request line and headers asking for `tokens` tokens, one every `interval_ms`.
pub fn request(tokens: u32, interval_ms: u32) -> String {
    format!(
        "GET /v1/stream?tokens={tokens}&interval_ms={interval_ms} HTTP/1.1\r\n\
         Host: sluice-lab\r\nAccept: text/event-stream\r\n\r\n"
    )
}

/// (tokens, interval_ms) from a request line; absent parameters take the defaults; values
/// are capped at [`MAX_TOKENS`] and [`MAX_INTERVAL_MS`].
pub fn parse_request(line: &str, default_tokens: u32, default_interval: u32) -> Option<(u32, u32)> {
    let mut parts = line.split_whitespace();
    if parts.next()? != "GET" {
        return None;
    }
    let target = parts.next()?;
    let (path, query) = target.split_once('?').unwrap_or((target, ""));
    if path != "/v1/stream" {
        return None;
    }
    let (mut tokens, mut interval) = (default_tokens, default_interval);
    for kv in query.split('&').filter(|s| !s.is_empty()) {
        let (k, v) = kv.split_once('=')?;
        let v: u32 = v.parse().ok()?;
        match k {
            "tokens" => tokens = v,
            "interval_ms" => interval = v,
            _ => {}
        }
    }
    Some((tokens.min(MAX_TOKENS), interval.min(MAX_INTERVAL_MS)))
}

pub fn response_head(backend: &str) -> String {
    format!(
        "HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nCache-Control: no-cache\r\n\
         X-Sluice-Backend: {backend}\r\nConnection: close\r\n\r\n"
    )
}

pub fn hello_event(backend: &str, conn: u64, tokens: u32, interval_ms: u32) -> String {
    format!(
        "event: hello\ndata: {{\"backend\":\"{backend}\",\"conn\":{conn},\"tokens\":{tokens},\
         \"interval_ms\":{interval_ms}}}\n\n"
    )
}

pub fn token_event(backend: &str, i: u32) -> String {
    let word = WORDS[(i as usize - 1) % WORDS.len()];
    format!("data: {{\"i\":{i},\"backend\":\"{backend}\",\"token\":\"{word}\"}}\n\n")
}

pub fn done_event() -> String {
    format!("data: {DONE}\n\n")
}

/// The string value of `"key":"..."` in a flat JSON object.
fn json_str<'a>(s: &'a str, key: &str) -> Option<&'a str> {
    let pat = format!("\"{key}\":\"");
    let start = s.find(&pat)? + pat.len();
    let len = s[start..].find('"')?;
    Some(&s[start..start + len])
}

fn json_u64(s: &str, key: &str) -> Option<u64> {
    let pat = format!("\"{key}\":");
    let start = s.find(&pat)? + pat.len();
    let digits: String = s[start..]
        .chars()
        .take_while(|c| c.is_ascii_digit())
        .collect();
    digits.parse().ok()
}

/// Connects to `addr` from inside `ns`, bounded by `timeout`.
pub fn connect_in(ns: &Netns, addr: SocketAddr, timeout: Duration) -> Result<TcpStream> {
    ns.run(move || TcpStream::connect_timeout(&addr, timeout))?
        .with_context(|| format!("connecting to {addr} from {}", ns.name()))
}

/// Connects to `addr` from `src`, one of `ns`'s IPv4 addresses (a client with many source
/// addresses), bounded by `timeout` (SO_SNDTIMEO bounds connect(2) on Linux).
pub fn connect_from(
    ns: &Netns,
    src: IpAddr,
    addr: SocketAddr,
    timeout: Duration,
) -> Result<TcpStream> {
    use std::{io, mem::size_of, os::fd::FromRawFd};
    let (IpAddr::V4(from), SocketAddr::V4(to)) = (src, addr) else {
        bail!("connect_from: IPv4 source and destination only, not {src} -> {addr}");
    };
    let sockaddr = |ip: std::net::Ipv4Addr, port: u16| libc::sockaddr_in {
        sin_family: libc::AF_INET as libc::sa_family_t,
        sin_port: port.to_be(),
        sin_addr: libc::in_addr {
            s_addr: u32::from_ne_bytes(ip.octets()),
        },
        sin_zero: [0; 8],
    };
    let len = size_of::<libc::sockaddr_in>() as libc::socklen_t;
    ns.run(move || -> io::Result<TcpStream> {
        // SAFETY: plain socket calls on a descriptor the TcpStream owns from its creation on
        // (closed on every error path), with properly sized arguments.
        unsafe {
            let fd = libc::socket(libc::AF_INET, libc::SOCK_STREAM | libc::SOCK_CLOEXEC, 0);
            if fd < 0 {
                return Err(io::Error::last_os_error());
            }
            let stream = TcpStream::from_raw_fd(fd);
            let tv = libc::timeval {
                tv_sec: timeout.as_secs() as libc::time_t,
                tv_usec: timeout.subsec_micros() as libc::suseconds_t,
            };
            let ok = |r: libc::c_int| {
                if r == 0 {
                    Ok(())
                } else {
                    Err(io::Error::last_os_error())
                }
            };
            ok(libc::setsockopt(
                fd,
                libc::SOL_SOCKET,
                libc::SO_SNDTIMEO,
                (&tv as *const libc::timeval).cast(),
                size_of::<libc::timeval>() as libc::socklen_t,
            ))?;
            let local = sockaddr(from, 0);
            ok(libc::bind(
                fd,
                (&local as *const libc::sockaddr_in).cast(),
                len,
            ))?;
            let remote = sockaddr(*to.ip(), to.port());
            ok(libc::connect(
                fd,
                (&remote as *const libc::sockaddr_in).cast(),
                len,
            ))?;
            Ok(stream)
        }
    })?
    .with_context(|| format!("connecting to {addr} from {src} in {}", ns.name()))
}

/// One event of a stream.
#[derive(Debug, PartialEq, Eq)]
pub enum Event {
    Token { i: u32, backend: String },
    Done,
}

/// A token stream being read by a client.
pub struct TokenStream {
    reader: BufReader<TcpStream>,
    /// From the greeting (the hello event).
    pub backend: String,
    /// The connection number the backend gave it.
    pub conn: u64,
    pub expected: u32,
    pub received: u32,
    pub done: bool,
    pub local: SocketAddr,
    pub peer: SocketAddr,
    pub opened: Instant,
}

impl TokenStream {
    /// Connects from `ns` to `vip`, asks for `tokens` tokens every `interval_ms`, and reads the
    /// response head and the greeting. Every read is bounded by `read_timeout`.
    pub fn open(
        ns: &Netns,
        vip: SocketAddr,
        tokens: u32,
        interval_ms: u32,
        read_timeout: Duration,
    ) -> Result<TokenStream> {
        Self::open_from(ns, None, vip, tokens, interval_ms, read_timeout)
    }

    /// [`TokenStream::open`] from source address `src` of `ns` (None: the kernel's choice).
    pub fn open_from(
        ns: &Netns,
        src: Option<IpAddr>,
        vip: SocketAddr,
        tokens: u32,
        interval_ms: u32,
        read_timeout: Duration,
    ) -> Result<TokenStream> {
        let opened = Instant::now();
        let s = match src {
            None => connect_in(ns, vip, read_timeout)?,
            Some(a) => connect_from(ns, a, vip, read_timeout)?,
        };
        s.set_read_timeout(Some(read_timeout))?;
        s.set_write_timeout(Some(read_timeout))?;
        s.set_nodelay(true)?;
        let local = s.local_addr()?;
        let peer = s.peer_addr()?;
        (&s).write_all(request(tokens, interval_ms).as_bytes())
            .context("sending the request")?;
        let mut reader = BufReader::new(s);
        let what = format!("stream {local} -> {vip}");
        let status = read_line(&mut reader).with_context(|| format!("{what}: status line"))?;
        if !status.starts_with("HTTP/1.1 200") {
            bail!("{what}: unexpected status line {status:?}");
        }
        for _ in 0..MAX_HEADER_LINES {
            if read_line(&mut reader)
                .with_context(|| format!("{what}: headers"))?
                .is_empty()
            {
                break;
            }
        }
        let ev = read_line(&mut reader).with_context(|| format!("{what}: greeting"))?;
        let data = read_line(&mut reader).with_context(|| format!("{what}: greeting"))?;
        let _blank = read_line(&mut reader)?;
        if ev != "event: hello" {
            bail!("{what}: expected the hello event, got {ev:?}");
        }
        let backend = json_str(&data, "backend")
            .ok_or_else(|| anyhow!("{what}: no backend in greeting {data:?}"))?
            .to_string();
        let conn = json_u64(&data, "conn").unwrap_or(0);
        let expected = json_u64(&data, "tokens").unwrap_or(tokens as u64) as u32;
        Ok(TokenStream {
            reader,
            backend,
            conn,
            expected,
            received: 0,
            done: false,
            local,
            peer,
            opened,
        })
    }

    /// The next event (bounded by the read timeout).
    pub fn next_event(&mut self) -> Result<Event> {
        loop {
            let line = read_line(&mut self.reader)
                .with_context(|| format!("stream {} from {}", self.local, self.backend))?;
            let Some(data) = line.strip_prefix("data: ") else {
                continue;
            };
            if data == DONE {
                self.done = true;
                return Ok(Event::Done);
            }
            let i = json_u64(data, "i").ok_or_else(|| anyhow!("bad token event {data:?}"))?;
            let backend = json_str(data, "backend").unwrap_or("").to_string();
            self.received += 1;
            return Ok(Event::Token {
                i: i as u32,
                backend,
            });
        }
    }

    /// Reads the rest of the stream, checking every token comes in order from the greeting's
    /// backend, until [DONE] and the server's close; at most until `deadline`. Returns the
    /// tokens received in all.
    pub fn read_to_end(&mut self, deadline: Instant) -> Result<u32> {
        while !self.done {
            if Instant::now() >= deadline {
                bail!(
                    "stream {} from {}: only {} of {} tokens before the deadline",
                    self.local,
                    self.backend,
                    self.received,
                    self.expected
                );
            }
            if let Event::Token { i, backend } = self.next_event()? {
                if i != self.received || backend != self.backend {
                    bail!(
                        "stream {} from {}: token {i} from {backend:?} out of order \
                         (expected {} from {})",
                        self.local,
                        self.backend,
                        self.received,
                        self.backend
                    );
                }
            }
        }
        // The server closes after [DONE] and its blank line: end of file, not a timeout.
        for _ in 0..2 {
            let mut rest = String::new();
            if self.reader.read_line(&mut rest)? == 0 {
                break;
            }
            if !rest.trim().is_empty() {
                bail!("stream {}: data after [DONE]: {rest:?}", self.local);
            }
        }
        let mut rest = String::new();
        if self.reader.read_line(&mut rest)? != 0 {
            bail!("stream {}: data after [DONE]: {rest:?}", self.local);
        }
        if self.received != self.expected {
            bail!(
                "stream {} from {}: {} tokens, expected {}",
                self.local,
                self.backend,
                self.received,
                self.expected
            );
        }
        Ok(self.received)
    }

    /// The LB's connection-table key of this stream.
    pub fn flow_key(&self) -> FlowKey {
        flow(
            &self.local.ip().to_string(),
            self.local.port(),
            &self.peer.ip().to_string(),
            self.peer.port(),
            PROTO_TCP,
        )
    }

    pub fn close(self) {
        let _ = self.reader.get_ref().shutdown(Shutdown::Both);
    }
}

/// One line without its line ending; end of file is an error.
fn read_line(r: &mut BufReader<TcpStream>) -> Result<String> {
    let mut line = String::new();
    if r.read_line(&mut line)? == 0 {
        bail!("connection closed");
    }
    Ok(line.trim_end_matches(['\r', '\n']).to_string())
}

/// The io::Error kind at the root of `e`'s chain, if an io::Error caused it: tells a stream
/// the peer reset (`ConnectionReset`) from one that timed out or closed early.
pub fn io_kind(e: &anyhow::Error) -> Option<std::io::ErrorKind> {
    e.chain()
        .find_map(|c| c.downcast_ref::<std::io::Error>())
        .map(|io| io.kind())
}

/// A UDP socket made inside `ns` and connected to `vip`.
pub fn udp_socket_in(ns: &Netns, vip: SocketAddr) -> Result<UdpSocket> {
    ns.run(move || -> Result<UdpSocket> {
        let bind: SocketAddr = if vip.is_ipv4() {
            "0.0.0.0:0".parse().unwrap()
        } else {
            "[::]:0".parse().unwrap()
        };
        let s = UdpSocket::bind(bind)?;
        s.connect(vip)?;
        Ok(s)
    })?
}

/// Sends `payload` on `s` and waits for the echo, up to `tries` times, `timeout` each.
/// Returns the backend that answered.
pub fn udp_ask(s: &UdpSocket, payload: &str, tries: u32, timeout: Duration) -> Result<String> {
    s.set_read_timeout(Some(timeout))?;
    let mut buf = vec![0u8; 65536];
    for _ in 0..tries.max(1) {
        s.send(payload.as_bytes())?;
        let deadline = Instant::now() + timeout;
        while Instant::now() < deadline {
            match s.recv(&mut buf) {
                Ok(n) => {
                    let text = String::from_utf8_lossy(&buf[..n]);
                    if let Some((name, echoed)) = text.split_once(' ') {
                        if echoed == payload {
                            return Ok(name.to_string());
                        }
                    }
                    // A late answer to an earlier try: keep waiting for this one.
                }
                Err(e)
                    if e.kind() == std::io::ErrorKind::WouldBlock
                        || e.kind() == std::io::ErrorKind::TimedOut =>
                {
                    break
                }
                Err(e) => return Err(e).context("receiving the UDP echo"),
            }
        }
    }
    bail!(
        "no UDP echo of {payload:?} from {:?} after {tries} tries",
        s.peer_addr().ok()
    )
}

/// The LB's connection-table key of a connected UDP socket.
pub fn udp_flow_key(s: &UdpSocket) -> Result<FlowKey> {
    let l = s.local_addr()?;
    let p = s.peer_addr()?;
    Ok(flow(
        &l.ip().to_string(),
        l.port(),
        &p.ip().to_string(),
        p.port(),
        PROTO_UDP,
    ))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn requests_round_trip_and_are_capped() {
        let r = request(30, 5);
        let line = r.lines().next().unwrap();
        assert_eq!(parse_request(line, 1, 1), Some((30, 5)));
        assert_eq!(parse_request("GET /v1/stream HTTP/1.1", 7, 9), Some((7, 9)));
        assert_eq!(
            parse_request(
                "GET /v1/stream?tokens=99999999&interval_ms=99999999 HTTP/1.1",
                1,
                1
            ),
            Some((MAX_TOKENS, MAX_INTERVAL_MS))
        );
        assert_eq!(parse_request("POST /v1/stream HTTP/1.1", 1, 1), None);
        assert_eq!(parse_request("GET /other HTTP/1.1", 1, 1), None);
    }

    #[test]
    fn events_carry_the_backend() {
        let h = hello_event("b1", 4, 10, 20);
        let data = h.lines().nth(1).unwrap();
        assert_eq!(json_str(data, "backend"), Some("b1"));
        assert_eq!(json_u64(data, "conn"), Some(4));
        assert_eq!(json_u64(data, "tokens"), Some(10));
        let t = token_event("b2", 17);
        assert_eq!(json_u64(&t, "i"), Some(17));
        assert_eq!(json_str(&t, "backend"), Some("b2"));
    }
}
