//! The HTTP/1.1 serving loop both listeners share (the admin API and `/metrics`): connection
//! caps per listener and peer, the request timeout, and JSON error replies.

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

/// Runs connections from `accept` until `shutdown` completes; then stops accepting and
/// drops the open connections (admin and metrics requests are short). `accept` yields each
/// connection with its peer (a uid, an address), or nothing when it already closed it.
/// Beyond `limits`' caps a connection is closed at once and counted in `refused`.
pub(crate) async fn serve_connections<A, C, K>(
    limits: ListenerLimits,
    refused: &AtomicU64,
    listener: &'static str,
    mut accept: impl FnMut() -> A,
    shutdown: impl Future<Output = ()>,
) where
    A: Future<Output = io::Result<Option<(K, C)>>>,
    C: Future<Output = ()> + Send + 'static,
    K: Eq + Hash + Clone + fmt::Debug + Send + 'static,
{
    /// One open connection of `peer`: counted while it lives.
    struct Slot<K: Eq + Hash> {
        open: Arc<std::sync::Mutex<HashMap<K, usize>>>,
        peer: K,
    }
    impl<K: Eq + Hash> Drop for Slot<K> {
        fn drop(&mut self) {
            let mut open = self.open.lock().expect("connection count lock");
            if let Some(n) = open.get_mut(&self.peer) {
                *n -= 1;
                if *n == 0 {
                    open.remove(&self.peer);
                }
            }
        }
    }
    let open: Arc<std::sync::Mutex<HashMap<K, usize>>> = Arc::default();
    let mut conns = JoinSet::new();
    let mut shutdown = pin!(shutdown);
    loop {
        tokio::select! {
            () = &mut shutdown => return,
            Some(_) = conns.join_next() => {}
            r = accept() => match r {
                Ok(None) => {}
                Ok(Some((peer, conn))) => {
                    let mut counts = open.lock().expect("connection count lock");
                    let total: usize = counts.values().sum();
                    let mine = counts.get(&peer).copied().unwrap_or(0);
                    if total >= limits.max_connections || mine >= limits.max_per_peer {
                        drop(counts);
                        // Counted before the close, so whoever sees the close sees the count.
                        let n = refused.fetch_add(1, Ordering::Relaxed) + 1;
                        drop(conn);
                        // Logged at 1, 2, 4, 8... refusals: a flood cannot flood the log.
                        if n.is_power_of_two() {
                            tracing::warn!(listener, ?peer, open = total, peer_open = mine, refused = n, "connection closed: the listener or this peer is at its cap");
                        }
                        continue;
                    }
                    *counts.entry(peer.clone()).or_default() += 1;
                    drop(counts);
                    let slot = Slot { open: open.clone(), peer };
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
