//! A minimal HTTP/1.1 GET client for metrics pages: plain TCP, one kept-alive connection per
//! endpoint, a deadline on the whole exchange and a bound on the body.

use std::time::Duration;

use http_body_util::{BodyExt, Empty, LengthLimitError, Limited};
use hyper::{body::Bytes, client::conn::http1, header, Request, StatusCode};
use hyper_util::rt::TokioIo;
use tokio::{net::TcpStream, task::JoinHandle};

use crate::{config::HttpUrl, telemetry::prom::MAX_PAGE_BYTES};

/// Largest body read; a page the parser would refuse is not worth reading.
pub const MAX_BODY_BYTES: usize = MAX_PAGE_BYTES;

pub struct Client {
    url: HttpUrl,
    conn: Option<Conn>,
}

struct Conn {
    sender: http1::SendRequest<Empty<Bytes>>,
    driver: JoinHandle<()>,
}

impl Drop for Conn {
    fn drop(&mut self) {
        self.driver.abort();
    }
}

impl Client {
    pub fn new(url: HttpUrl) -> Self {
        Client { url, conn: None }
    }

    /// GETs the page as text. Connection, request and body together must finish within
    /// `timeout`. A failure closes the connection, so the next call starts afresh.
    pub async fn get(&mut self, timeout: Duration) -> Result<String, String> {
        tokio::time::timeout(timeout, self.exchange())
            .await
            .unwrap_or_else(|_| Err(format!("no complete response within {timeout:?}")))
    }

    async fn exchange(&mut self) -> Result<String, String> {
        let mut conn = match self.conn.take() {
            Some(c) if !c.sender.is_closed() => c,
            _ => connect(&self.url).await?,
        };
        conn.sender
            .ready()
            .await
            .map_err(|e| format!("connection: {e}"))?;
        let request = Request::get(&self.url.path)
            .header(header::HOST, &self.url.authority)
            // The classic text format: exporters that also speak OpenMetrics or protobuf
            // pick what was asked for.
            .header(header::ACCEPT, "text/plain;version=0.0.4")
            .header(header::USER_AGENT, "sluice")
            .body(Empty::new())
            .map_err(|e| format!("bad request for {}: {e}", self.url))?;
        let response = conn
            .sender
            .send_request(request)
            .await
            .map_err(|e| format!("request: {e}"))?;
        if response.status() != StatusCode::OK {
            return Err(format!("HTTP {}", response.status()));
        }
        let body = Limited::new(response.into_body(), MAX_BODY_BYTES)
            .collect()
            .await
            .map_err(|e| {
                if e.is::<LengthLimitError>() {
                    format!("response body is over {MAX_BODY_BYTES} bytes")
                } else {
                    format!("reading the body: {e}")
                }
            })?
            .to_bytes();
        let text = String::from_utf8(body.into()).map_err(|_| "body is not UTF-8".to_owned())?;
        self.conn = Some(conn);
        Ok(text)
    }
}

async fn connect(url: &HttpUrl) -> Result<Conn, String> {
    let stream = TcpStream::connect((url.host.as_str(), url.port))
        .await
        .map_err(|e| format!("connect to {}: {e}", url.authority))?;
    // Requests are single small writes; do not let Nagle hold them.
    stream
        .set_nodelay(true)
        .map_err(|e| format!("connect to {}: {e}", url.authority))?;
    let (sender, connection) = http1::handshake(TokioIo::new(stream))
        .await
        .map_err(|e| format!("connect to {}: {e}", url.authority))?;
    let driver = tokio::spawn(async move {
        // Its error also fails the pending request, which reports it.
        let _ = connection.await;
    });
    Ok(Conn { sender, driver })
}
