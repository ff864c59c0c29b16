//! One streamed request on a new TCP connection from a given source address: what it
//! measures, how a broken stream is told apart, and the retries of a refused connection.

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
use rand::{Rng, RngExt};
use tokio::net::{TcpSocket, TcpStream};

/// The header that names the backend.
pub const BACKEND_HEADER: &str = "x-sluice-backend";

/// What one request saw. Times are ms from the request's start (its first attempt's, before
/// connecting): a user who was refused waited through the backoff.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct Outcome {
    pub backend: Option<String>,
    pub ttft_ms: Option<f64>,
    /// Gaps between successive chunks that carried tokens, ms.
    pub gaps_ms: Vec<f64>,
    pub e2e_ms: Option<f64>,
    pub tokens: u32,
    /// The answer's text as received (the tokens' text, in order).
    pub text: String,
    /// Prompt tokens the server took from its prefix cache (`usage.prompt_tokens_details.
    /// cached_tokens` of the usage chunk); None when it sent none.
    pub cached_tokens: Option<u32>,
    pub broken: Option<&'static str>,
    /// Connections tried: 1, plus one per retry.
    pub attempts: u32,
    /// When the last attempt refused before any response byte started; `None` when none was.
    pub last_refused_ms: Option<f64>,
}

/// The retry policy of the official OpenAI Python SDK (openai/openai-python,
/// `src/openai/_constants.py`: `DEFAULT_MAX_RETRIES = 2`, `INITIAL_RETRY_DELAY = 0.5`,
/// `MAX_RETRY_DELAY = 8.0`; `src/openai/_base_client.py`, `_calculate_retry_timeout`:
/// `min(INITIAL_RETRY_DELAY * 2 ** retries_taken, MAX_RETRY_DELAY) * (1 - 0.25 * random())`,
/// a `Retry-After` header of up to 60 s taking precedence; it retries connection errors and
/// timeouts, and the statuses 408, 409, 429 and 5xx). No server in this lab answers with a
/// retryable status or `Retry-After` (the simulator's only errors are 400 and 404; the data
/// plane refuses with a RST), so only refused or reset connections are retried here.
pub const DEFAULT_RETRIES: u32 = 2;
const INITIAL_RETRY_DELAY_S: f64 = 0.5;
const MAX_RETRY_DELAY_S: f64 = 8.0;

/// The wait before a retry, after `retries_taken` earlier retries, with `unit` a uniform
/// draw in [0, 1): 0.375-0.5 s, then 0.75-1 s, doubling up to 6-8 s.
pub fn retry_delay(retries_taken: u32, unit: f64) -> Duration {
    // Capped as the SDK caps it: 2^1000 is still a finite f64.
    let base =
        (INITIAL_RETRY_DELAY_S * 2f64.powi(retries_taken.min(1000) as i32)).min(MAX_RETRY_DELAY_S);
    Duration::from_secs_f64(base * (1.0 - 0.25 * unit.clamp(0.0, 1.0)))
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
    /// The tokens' text: a completion choice's `text` or a chat choice's `delta.content`.
    pub text: String,
    /// From a usage chunk (`stream_options.include_usage`).
    pub cached_tokens: Option<u32>,
    pub done: bool,
}

impl SseReader {
    /// Feeds bytes; counts the complete `data:` events among them (each is one token, apart
    /// from `data: [DONE]` and the usage chunk, which has no choices). Events after `[DONE]`
    /// are ignored.
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
                    continue;
                } else if data.is_empty() {
                    continue;
                }
                let v: serde_json::Value = serde_json::from_slice(data).unwrap_or_default();
                let choices = &v["choices"];
                if choices.as_array().is_some_and(Vec::is_empty) && v["usage"].is_object() {
                    out.cached_tokens = v["usage"]["prompt_tokens_details"]["cached_tokens"]
                        .as_u64()
                        .and_then(|n| u32::try_from(n).ok());
                    continue;
                }
                out.tokens += 1;
                let text = choices[0]["text"]
                    .as_str()
                    .or_else(|| choices[0]["delta"]["content"].as_str());
                out.text.push_str(text.unwrap_or_default());
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
    /// Bounds the whole request: every attempt and the backoff between them.
    pub timeout: Duration,
    /// Bounds each wait for the exchange's next step (the connection, the response head,
    /// each chunk of the stream): an HTTP client's read timeout, which the OpenAI SDK sets to
    /// 600 s. A stream that is still flowing, however slowly, never reaches it.
    pub stall: Duration,
    /// Retries of an attempt refused or reset before any response byte ([`retry_delay`]
    /// apart); 0: one attempt.
    pub retries: u32,
}

/// How an attempt failed.
enum Fail {
    /// Before any response byte: nothing was served, so sending again loses nothing.
    Refused(&'static str),
    /// A stream that had begun, or an answer that was not a stream: never retried, since a
    /// retry would hide the breakage.
    Broken(&'static str),
}

/// Sends `ask` on a new connection and reads the stream to `[DONE]`, on a new connection
/// from the same source again after a refusal (up to `ask.retries` times, the backoff's
/// jitter drawn from `rng`), all bounded by its timeout, and each step by its stall limit
/// (a stalled request is broken `timeout` and not sent again).
pub async fn stream(ask: Ask<'_>, clock: &quanta::Clock, rng: &mut impl Rng) -> Outcome {
    let start = clock.now();
    let ms = |t: quanta::Instant| (t - start).as_secs_f64() * 1000.0;
    let body = Bytes::from(ask.body.clone());
    let mut out = Outcome::default();
    let work = async {
        loop {
            let tried = clock.now();
            out.attempts += 1;
            match attempt(&ask, body.clone(), clock, start, &mut out).await {
                Ok(()) => return None,
                Err(Fail::Broken(why)) => return Some(why),
                Err(Fail::Refused(why)) => {
                    out.last_refused_ms = Some(ms(tried));
                    if out.attempts > ask.retries {
                        return Some(why);
                    }
                    tokio::time::sleep(retry_delay(out.attempts - 1, rng.random())).await;
                }
            }
        }
    };
    out.broken = tokio::time::timeout(ask.timeout, work)
        .await
        .unwrap_or(Some(TIMEOUT));
    out
}

/// One connection: fills `out` (times from `start`) as the answer streams in.
async fn attempt(
    ask: &Ask<'_>,
    body: Bytes,
    clock: &quanta::Clock,
    start: quanta::Instant,
    out: &mut Outcome,
) -> Result<(), Fail> {
    let ms = |t: quanta::Instant| (t - start).as_secs_f64() * 1000.0;
    let conn = within(ask.stall, connect(ask.target, ask.source))
        .await?
        .map_err(|_| Fail::Refused(CONNECT))?;
    // Until the response head is in, a reset has served nothing: it is a refusal.
    let refused = |e: hyper::Error| match classify(&e) {
        RESET => Fail::Refused(RESET),
        why => Fail::Broken(why),
    };
    let (mut sender, driver) = within(ask.stall, http1::handshake(TokioIo::new(conn)))
        .await?
        .map_err(refused)?;
    let driver = tokio::spawn(driver);
    let _abort = AbortOnDrop(driver);
    let req = Request::post(ask.path)
        .header(HOST, ask.target.to_string())
        .header(CONTENT_TYPE, "application/json")
        .body(Full::new(body))
        .expect("a static request is well formed");
    let resp = within(ask.stall, sender.send_request(req))
        .await?
        .map_err(refused)?;
    out.backend = resp
        .headers()
        .get(BACKEND_HEADER)
        .and_then(|v| v.to_str().ok())
        .map(str::to_owned);
    if resp.status() != hyper::StatusCode::OK {
        return Err(Fail::Broken(STATUS));
    }
    let mut body = resp.into_body();
    let mut sse = SseReader::default();
    let mut last: Option<quanta::Instant> = None;
    loop {
        let frame = match within(ask.stall, body.frame()).await? {
            None => return Err(Fail::Broken(NO_DONE)),
            Some(Err(e)) => return Err(Fail::Broken(classify(&e))),
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
            out.text.push_str(&chunk.text);
        }
        if chunk.cached_tokens.is_some() {
            out.cached_tokens = chunk.cached_tokens;
        }
        if chunk.done {
            out.e2e_ms = Some(ms(now));
            return Ok(());
        }
    }
}

/// One step of an exchange, broken `timeout` when it waits longer than `stall`.
async fn within<T>(stall: Duration, step: impl std::future::Future<Output = T>) -> Result<T, Fail> {
    tokio::time::timeout(stall, step)
        .await
        .map_err(|_| Fail::Broken(TIMEOUT))
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
    fn backoff_is_the_sdks() {
        let s = |n, u| retry_delay(n, u).as_secs_f64();
        // No jitter (a draw of 0), then the most (a draw near 1: x0.75).
        assert_eq!(
            [s(0, 0.0), s(1, 0.0), s(2, 0.0), s(3, 0.0)],
            [0.5, 1.0, 2.0, 4.0]
        );
        assert_eq!(
            [s(4, 0.0), s(5, 0.0), s(1000, 0.0), s(u32::MAX, 0.0)],
            [8.0; 4]
        );
        assert_eq!([s(0, 1.0), s(1, 0.5), s(9, 1.0)], [0.375, 0.875, 6.0]);
    }

    #[test]
    fn sse_events_split_across_reads() {
        let mut r = SseReader::default();
        assert_eq!(
            r.feed(b"data: {\"a\":1}\n\nda"),
            Chunk {
                tokens: 1,
                ..Chunk::default()
            }
        );
        assert_eq!(r.feed(b"ta: {\"a\":2}\n"), Chunk::default());
        assert_eq!(
            r.feed(b"\ndata: {\"a\":3}\n\ndata: [DONE]\n\ndata: late\n\n"),
            Chunk {
                tokens: 2,
                done: true,
                ..Chunk::default()
            }
        );
        // Comments, other fields and empty data are not tokens.
        let mut r = SseReader::default();
        assert_eq!(
            r.feed(b": keep-alive\n\nevent: x\ndata:\n\nid: 3\ndata:[DONE]\n\n"),
            Chunk {
                done: true,
                ..Chunk::default()
            }
        );
    }

    #[test]
    fn sse_text_and_the_usage_chunk() {
        let mut r = SseReader::default();
        let got = r.feed(
            br#"data: {"choices":[{"index":0,"text":" Sluice","finish_reason":null}]}

data: {"choices":[{"index":0,"delta":{"content":" steers"}}]}

data: {"choices":[],"usage":{"prompt_tokens":9,"prompt_tokens_details":{"cached_tokens":16}}}

data: [DONE]

"#,
        );
        assert_eq!(
            got,
            Chunk {
                tokens: 2,
                text: " Sluice steers".into(),
                cached_tokens: Some(16),
                done: true
            }
        );
    }
}
