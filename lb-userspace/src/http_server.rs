//! The HTTP/1.1 serving loop both listeners share (the admin API and `/metrics`): connection
//! caps per listener and peer (a connection over them is answered 503), the request
//! timeout, and JSON error replies.

use std::{
    collections::HashMap,
    error::Error as StdError,
    fmt,
    future::Future,
    hash::Hash,
    io,
    pin::pin,
    sync::{
        atomic::{AtomicU64, Ordering},
        Arc,
    },
    time::Duration,
};

use http_body_util::Full;
use hyper::{
    body::{Bytes, Incoming},
    header,
    server::conn::http1,
    service::HttpService,
    Response, StatusCode,
};
use hyper_util::rt::{TokioIo, TokioTimer};
use serde::Serialize;
use serde_json::json;
use tokio::{
    io::{AsyncRead, AsyncWrite},
    task::JoinSet,
};

use crate::limits::ListenerLimits;

/// Open connections per peer: the pure part of a listener's caps.
#[derive(Debug)]
pub(crate) struct Slots<K> {
    open: HashMap<K, usize>,
    total: usize,
}

impl<K> Default for Slots<K> {
    fn default() -> Self {
        Slots {
            open: HashMap::new(),
            total: 0,
        }
    }
}

impl<K: Eq + Hash + Clone> Slots<K> {
    /// Takes a slot for `peer`, or says why not: the connections open in all and of `peer`.
    pub(crate) fn take(&mut self, limits: &ListenerLimits, peer: &K) -> Result<(), (usize, usize)> {
        let mine = self.open.get(peer).copied().unwrap_or(0);
        if self.total >= limits.max_connections || mine >= limits.max_per_peer {
            return Err((self.total, mine));
        }
        *self.open.entry(peer.clone()).or_default() += 1;
        self.total += 1;
        Ok(())
    }

    /// Gives back a slot `take` gave `peer`.
    pub(crate) fn give_back(&mut self, peer: &K) {
        if let Some(n) = self.open.get_mut(peer) {
            *n -= 1;
            self.total -= 1;
            if *n == 0 {
                self.open.remove(peer);
            }
        }
    }
}

/// A just-accepted connection that can be answered without waiting: a refusal is a few
/// non-blocking calls, so a flood of refused connections costs no more than closing them.
pub(crate) trait Refusable {
    fn try_write(&self, buf: &[u8]) -> io::Result<usize>;
    fn try_read(&self, buf: &mut [u8]) -> io::Result<usize>;
}

impl Refusable for tokio::net::UnixStream {
    fn try_write(&self, buf: &[u8]) -> io::Result<usize> {
        tokio::net::UnixStream::try_write(self, buf)
    }
    fn try_read(&self, buf: &mut [u8]) -> io::Result<usize> {
        tokio::net::UnixStream::try_read(self, buf)
    }
}

impl Refusable for tokio::net::TcpStream {
    fn try_write(&self, buf: &[u8]) -> io::Result<usize> {
        tokio::net::TcpStream::try_write(self, buf)
    }
    fn try_read(&self, buf: &mut [u8]) -> io::Result<usize> {
        tokio::net::TcpStream::try_read(self, buf)
    }
}

/// The answer to a connection over the caps: `503` with a JSON error and `Retry-After`,
/// built once per listener.
fn busy_answer(listener: &str) -> Vec<u8> {
    let body = format!(
        "{{\"error\": \"the {listener} listener is at its connection cap (for all peers or for \
         this one); nothing was done; retry shortly\"}}\n"
    );
    format!(
        "HTTP/1.1 503 Service Unavailable\r\ncontent-type: application/json\r\n\
         content-length: {}\r\nretry-after: 1\r\nconnection: close\r\n\r\n{body}",
        body.len()
    )
    .into_bytes()
}

/// Answers a refused connection with `answer` if its socket takes it at once, and reads
/// what of the request has already arrived (at most 4 KiB): closing a TCP socket with
/// unread data resets it, which can discard the answer at the client. Nothing here waits.
fn refuse(conn: &impl Refusable, answer: &[u8]) {
    let _ = conn.try_write(answer);
    let mut buf = [0u8; 1024];
    for _ in 0..4 {
        if !matches!(conn.try_read(&mut buf), Ok(n) if n > 0) {
            break;
        }
    }
}

/// Runs connections from `accept` with `serve` until `shutdown` completes; then stops
/// accepting and drops the open connections (admin and metrics requests are short).
/// `accept` yields each connection with the peer it is counted for (a uid, an address) and
/// what `serve` needs to know of its client, or nothing when it already closed it. Beyond
/// `limits`' caps a connection is answered `503` at once, closed and counted in `refused`.
pub(crate) async fn serve_connections<A, S, W, C, K>(
    limits: ListenerLimits,
    refused: &AtomicU64,
    listener: &'static str,
    mut accept: impl FnMut() -> A,
    mut serve: impl FnMut(W, S) -> C,
    shutdown: impl Future<Output = ()>,
) where
    A: Future<Output = io::Result<Option<(K, S, W)>>>,
    S: Refusable,
    C: Future<Output = ()> + Send + 'static,
    K: Eq + Hash + Clone + fmt::Debug + Send + 'static,
{
    /// One open connection of `peer`: counted while it lives.
    struct Slot<K: Eq + Hash + Clone> {
        slots: Arc<std::sync::Mutex<Slots<K>>>,
        peer: K,
    }
    impl<K: Eq + Hash + Clone> Drop for Slot<K> {
        fn drop(&mut self) {
            let mut slots = self.slots.lock().expect("connection count lock");
            slots.give_back(&self.peer);
        }
    }
    let busy = busy_answer(listener);
    let slots: Arc<std::sync::Mutex<Slots<K>>> = Arc::default();
    let mut conns = JoinSet::new();
    let mut shutdown = pin!(shutdown);
    loop {
        tokio::select! {
            () = &mut shutdown => return,
            Some(_) = conns.join_next() => {}
            r = accept() => match r {
                Ok(None) => {}
                Ok(Some((peer, stream, who))) => {
                    let taken = slots.lock().expect("connection count lock").take(&limits, &peer);
                    if let Err((total, mine)) = taken {
                        // Counted before the answer, so whoever sees the answer sees the count.
                        let n = refused.fetch_add(1, Ordering::Relaxed) + 1;
                        refuse(&stream, &busy);
                        drop(stream);
                        // Logged at 1, 2, 4, 8... refusals: a flood cannot flood the log.
                        if n.is_power_of_two() {
                            tracing::warn!(listener, ?peer, open = total, peer_open = mine, refused = n, "connection answered 503: the listener or this peer is at its cap");
                        }
                        continue;
                    }
                    let conn = serve(who, stream);
                    let slot = Slot { slots: slots.clone(), peer };
                    conns.spawn(async move {
                        let _slot = slot;
                        conn.await
                    });
                }
                Err(e) => {
                    // Out of descriptors and the like: back off instead of spinning.
                    tracing::warn!(listener, error = %e, "accepting a connection failed");
                    tokio::time::sleep(Duration::from_millis(100)).await;
                }
            },
        }
    }
}

/// Serves one HTTP/1.1 connection. Headers must arrive within the request timeout, which
/// hyper also applies to the wait for the next request, so an idle keep-alive connection
/// is closed after it too.
pub(crate) async fn serve_http<I, S>(io: I, service: S, limits: ListenerLimits)
where
    I: AsyncRead + AsyncWrite + Unpin,
    S: HttpService<Incoming, ResBody = Full<Bytes>>,
    S::Error: Into<Box<dyn StdError + Send + Sync>>,
{
    let conn = http1::Builder::new()
        .timer(TokioTimer::new())
        .header_read_timeout(limits.request_timeout)
        .serve_connection(TokioIo::new(io), service);
    if let Err(e) = conn.await {
        tracing::debug!(error = %e, "HTTP connection ended with an error");
    }
}

/// Answers `respond` within `limit`, else 408: a body sent slowly, or not at all after its
/// headers, holds the connection no longer than that.
pub(crate) async fn within(
    limit: Duration,
    respond: impl Future<Output = Response<Full<Bytes>>>,
) -> Response<Full<Bytes>> {
    match tokio::time::timeout(limit, respond).await {
        Ok(r) => r,
        Err(_) => {
            let mut r = ApiError::new(
                408,
                format!("the request was not complete within {limit:?}"),
            )
            .into_response();
            r.headers_mut().insert(
                header::CONNECTION,
                header::HeaderValue::from_static("close"),
            );
            r
        }
    }
}

/// A refused request: its status and the message sent as `{"error": ...}`.
#[derive(Debug)]
pub(crate) struct ApiError {
    pub(crate) status: StatusCode,
    pub(crate) message: String,
    pub(crate) allow: Option<&'static str>,
}

impl ApiError {
    pub(crate) fn new(status: u16, message: impl Into<String>) -> Self {
        ApiError {
            status: StatusCode::from_u16(status).unwrap_or(StatusCode::INTERNAL_SERVER_ERROR),
            message: message.into(),
            allow: None,
        }
    }

    pub(crate) fn into_response(self) -> Response<Full<Bytes>> {
        let mut r = json_response(self.status, &json!({ "error": self.message }));
        if let Some(allow) = self.allow {
            r.headers_mut()
                .insert(header::ALLOW, header::HeaderValue::from_static(allow));
        }
        r
    }
}

pub(crate) fn json_response(status: StatusCode, body: &impl Serialize) -> Response<Full<Bytes>> {
    let mut text = serde_json::to_vec_pretty(body).expect("API values serialize");
    text.push(b'\n');
    let mut r = Response::new(Full::new(Bytes::from(text)));
    *r.status_mut() = status;
    r.headers_mut().insert(
        header::CONTENT_TYPE,
        header::HeaderValue::from_static("application/json"),
    );
    r
}
