//! One streamed request on a new TCP connection from a given source address: what it
//! measures and how a broken stream is told apart.

use std::{io, net::SocketAddr, time::Duration};

use bytes::{Buf, BytesMut};
use http_body_util::{BodyExt, Full};
use hyper::{
    body::Bytes,
    client::conn::http1,
    header::{CONTENT_TYPE, HOST},
    Request,
};
use hyper_util::rt::TokioIo;
use tokio::net::{TcpSocket, TcpStream};

/// The header that names the backend.
pub const BACKEND_HEADER: &str = "x-sluice-backend";

/// What one request saw. Times are ms from the request's start (before connecting).
#[derive(Clone, Debug, Default, PartialEq)]
pub struct Outcome {
    pub backend: Option<String>,
    pub ttft_ms: Option<f64>,
    /// Gaps between successive chunks that carried tokens, ms.
    pub gaps_ms: Vec<f64>,
    pub e2e_ms: Option<f64>,
    pub tokens: u32,
    pub broken: Option<&'static str>,
}

/// Reasons a stream broke, as the records name them.
pub const CONNECT: &str = "connect";
pub const RESET: &str = "reset";
pub const TIMEOUT: &str = "timeout";
pub const NO_DONE: &str = "no_done";
/// The server answered with a status other than 200.
pub const STATUS: &str = "status";

/// Server-sent events read so far: complete events are taken off the front.
#[derive(Default)]
pub struct SseReader {
    buf: BytesMut,
}

/// What a chunk of the body held.
#[derive(Debug, Default, PartialEq, Eq)]
pub struct Chunk {
    pub tokens: u32,
    pub done: bool,
}

impl SseReader {
    /// Feeds bytes; counts the complete `data:` events among them (each is one token, apart
    /// from `data: [DONE]`). Events after `[DONE]` are ignored.
    pub fn feed(&mut self, bytes: &[u8]) -> Chunk {
        self.buf.extend_from_slice(bytes);
        let mut out = Chunk::default();
        while let Some(end) = find(&self.buf, b"\n\n") {
            let event = self.buf.split_to(end);
            self.buf.advance(2);
            if out.done {
                continue;
            }
            for line in event[..].split(|&b| b == b'\n') {
                let Some(data) = line.strip_prefix(b"data:") else {
                    continue;
                };
                let data = data.trim_ascii();
                if data == b"[DONE]" {
                    out.done = true;
                } else if !data.is_empty() {
                    out.tokens += 1;
                }
            }
        }
        out
    }
}

fn find(hay: &[u8], needle: &[u8]) -> Option<usize> {
    hay.windows(needle.len()).position(|w| w == needle)
}

/// A request to send.
pub struct Ask<'a> {
    pub target: SocketAddr,
    pub source: Option<std::net::IpAddr>,
    pub path: &'a str,
    pub body: String,
    pub timeout: Duration,
}

/// Sends `ask` on a new connection and reads the stream to `[DONE]`, bounded by its timeout.
pub async fn stream(ask: Ask<'_>, clock: &quanta::Clock) -> Outcome {
    let start = clock.now();
    let ms = |t: quanta::Instant| (t - start).as_secs_f64() * 1000.0;
    let mut out = Outcome::default();
    let work = async {
        let conn = match connect(ask.target, ask.source).await {
            Ok(c) => c,
            Err(_) => return Some(CONNECT),
        };
        let (mut sender, driver) = match http1::handshake(TokioIo::new(conn)).await {
            Ok(x) => x,
            Err(e) => return Some(classify(&e)),
        };
        let driver = tokio::spawn(driver);
        let _abort = AbortOnDrop(driver);
        let req = Request::post(ask.path)
            .header(HOST, ask.target.to_string())
            .header(CONTENT_TYPE, "application/json")
            .body(Full::new(Bytes::from(ask.body)))
            .expect("a static request is well formed");
        let resp = match sender.send_request(req).await {
            Ok(r) => r,
            Err(e) => return Some(classify(&e)),
        };
        out.backend = resp
            .headers()
            .get(BACKEND_HEADER)
            .and_then(|v| v.to_str().ok())
            .map(str::to_owned);
        if resp.status() != hyper::StatusCode::OK {
            return Some(STATUS);
        }
        let mut body = resp.into_body();
        let mut sse = SseReader::default();
        let mut last: Option<quanta::Instant> = None;
        loop {
            let frame = match body.frame().await {
                None => return Some(NO_DONE),
                Some(Err(e)) => return Some(classify(&e)),
                Some(Ok(f)) => f,
            };
            let Some(data) = frame.data_ref() else {
                continue;
            };
            let now = clock.now();
            let chunk = sse.feed(data);
            if chunk.tokens > 0 {
                match last {
                    None => out.ttft_ms = Some(ms(now)),
                    Some(prev) => out.gaps_ms.push((now - prev).as_secs_f64() * 1000.0),
                }
                last = Some(now);
                out.tokens += chunk.tokens;
            }
            if chunk.done {
                out.e2e_ms = Some(ms(now));
                return None;
            }
        }
    };
    out.broken = tokio::time::timeout(ask.timeout, work)
        .await
        .unwrap_or(Some(TIMEOUT));
    out
}

struct AbortOnDrop(tokio::task::JoinHandle<Result<(), hyper::Error>>);

impl Drop for AbortOnDrop {
    fn drop(&mut self) {
        self.0.abort();
    }
}

/// A new connection from `source` (any port), so that every turn of a conversation comes
/// from the same client address.
async fn connect(target: SocketAddr, source: Option<std::net::IpAddr>) -> io::Result<TcpStream> {
    let sock = if target.is_ipv4() {
        TcpSocket::new_v4()?
    } else {
        TcpSocket::new_v6()?
    };
    if let Some(src) = source {
        sock.bind(SocketAddr::new(src, 0))?;
    }
    let s = sock.connect(target).await?;
    s.set_nodelay(true)?;
    Ok(s)
}

/// A reset peer (RST, an aborted or broken connection) is `reset`; any other failure of a
/// started exchange (the peer closed mid-answer, a malformed answer) is `no_done`.
fn classify(e: &hyper::Error) -> &'static str {
    let mut src: Option<&(dyn std::error::Error + 'static)> = std::error::Error::source(e);
    while let Some(s) = src {
        if let Some(io) = s.downcast_ref::<io::Error>() {
            if matches!(
                io.kind(),
                io::ErrorKind::ConnectionReset
                    | io::ErrorKind::ConnectionAborted
                    | io::ErrorKind::BrokenPipe
            ) {
                return RESET;
            }
        }
        src = s.source();
    }
    NO_DONE
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sse_events_split_across_reads() {
        let mut r = SseReader::default();
        assert_eq!(
            r.feed(b"data: {\"a\":1}\n\nda"),
            Chunk {
                tokens: 1,
                done: false
            }
        );
        assert_eq!(r.feed(b"ta: {\"a\":2}\n"), Chunk::default());
        assert_eq!(
            r.feed(b"\ndata: {\"a\":3}\n\ndata: [DONE]\n\ndata: late\n\n"),
            Chunk {
                tokens: 2,
                done: true
            }
        );
        // Comments, other fields and empty data are not tokens.
        let mut r = SseReader::default();
        assert_eq!(
            r.feed(b": keep-alive\n\nevent: x\ndata:\n\nid: 3\ndata:[DONE]\n\n"),
            Chunk {
                tokens: 0,
                done: true
            }
        );
    }
}
