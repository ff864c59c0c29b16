//! Health probes: the I/O half of health checking. Each probe's result feeds the pure
//! rise/fall state machine in [`sluice_core::policy::health`].

use std::{
    net::{IpAddr, SocketAddr},
    time::Duration,
};

use http_body_util::Empty;
use hyper::{body::Bytes, header, Request};
use hyper_util::rt::TokioIo;
use tokio::{net::TcpStream, time::timeout};

use crate::{
    config::HealthCheck,
    policy::health::{connect_error, CheckError},
};

/// Runs the backend's configured check against `addr` within `limit`.
pub async fn check(addr: IpAddr, hc: &HealthCheck, limit: Duration) -> Result<(), CheckError> {
    let target = SocketAddr::new(addr, hc.port());
    let probe = async {
        match hc {
            HealthCheck::Tcp { .. } => tcp(target).await,
            HealthCheck::Http {
                path,
                expect_status,
                ..
            } => http(target, path, *expect_status, limit).await,
        }
    };
    timeout(limit, probe)
        .await
        .map_err(|_| CheckError::Timeout(limit))?
}

async fn tcp(target: SocketAddr) -> Result<(), CheckError> {
    TcpStream::connect(target)
        .await
        .map(drop)
        .map_err(connect_error)
}

async fn http(
    target: SocketAddr,
    path: &str,
    expected: u16,
    limit: Duration,
) -> Result<(), CheckError> {
    let stream = TcpStream::connect(target).await.map_err(connect_error)?;
    let (mut send, conn) = hyper::client::conn::http1::handshake(TokioIo::new(stream))
        .await
        .map_err(|e| CheckError::Http(e.to_string()))?;
    // Drives the connection; bounded, so a backend that stalls mid-response leaks nothing.
    tokio::spawn(timeout(limit, conn));
    let req = Request::get(path)
        .header(header::HOST, target.to_string())
        .header(header::CONNECTION, "close")
        .body(Empty::<Bytes>::new())
        .expect("a path validated by the config is a valid URI");
    let got = send
        .send_request(req)
        .await
        .map_err(|e| CheckError::Http(e.to_string()))?
        .status()
        .as_u16();
    if got == expected {
        Ok(())
    } else {
        Err(CheckError::Status { got, expected })
    }
}

#[cfg(test)]
mod tests {
    use std::net::Ipv4Addr;

    use tokio::{
        io::{AsyncReadExt, AsyncWriteExt},
        net::TcpListener,
        sync::oneshot,
    };

    use super::*;

    const LOCAL: IpAddr = IpAddr::V4(Ipv4Addr::LOCALHOST);
    const S: Duration = Duration::from_secs(1);

    #[tokio::test]
    async fn tcp_check_connects_or_fails() {
        let l = TcpListener::bind((LOCAL, 0)).await.unwrap();
        let port = l.local_addr().unwrap().port();
        check(LOCAL, &HealthCheck::Tcp { port }, S).await.unwrap();
        drop(l);
        let err = check(LOCAL, &HealthCheck::Tcp { port }, S).await;
        assert!(matches!(err, Err(CheckError::Connect(_))), "{err:?}");
    }

    /// Answers one request with `status`, after `delay`. The request it read comes back
    /// through the receiver, for the test to check (a panic in the spawned task would not
    /// reach the test).
    async fn serve(status: u16, delay: Duration) -> (u16, oneshot::Receiver<Vec<u8>>) {
        let l = TcpListener::bind((LOCAL, 0)).await.unwrap();
        let port = l.local_addr().unwrap().port();
        let (tx, rx) = oneshot::channel();
        tokio::spawn(async move {
            let (mut s, _) = l.accept().await.unwrap();
            let mut buf = [0; 1024];
            let n = s.read(&mut buf).await.unwrap();
            let _ = tx.send(buf[..n].to_vec());
            tokio::time::sleep(delay).await;
            let resp = format!("HTTP/1.1 {status} X\r\ncontent-length: 0\r\n\r\n");
            let _ = s.write_all(resp.as_bytes()).await;
        });
        (port, rx)
    }

    /// The request the server of [`serve`] read: a GET of the health path.
    async fn assert_health_get(request: oneshot::Receiver<Vec<u8>>) {
        let got = request.await.expect("the server read no request");
        assert!(
            got.starts_with(b"GET /health HTTP/1.1\r\n"),
            "{:?}",
            String::from_utf8_lossy(&got)
        );
    }

    fn http_check(port: u16) -> HealthCheck {
        HealthCheck::Http {
            port,
            path: "/health".into(),
            expect_status: 200,
        }
    }

    #[tokio::test]
    async fn http_check_wants_the_expected_status_within_the_timeout() {
        let (port, req) = serve(200, Duration::ZERO).await;
        check(LOCAL, &http_check(port), S).await.unwrap();
        assert_health_get(req).await;
        let (port, req) = serve(503, Duration::ZERO).await;
        let err = check(LOCAL, &http_check(port), S).await;
        assert_health_get(req).await;
        assert!(
            matches!(
                err,
                Err(CheckError::Status {
                    got: 503,
                    expected: 200
                })
            ),
            "{err:?}"
        );
        let (port, req) = serve(200, 2 * S).await;
        let err = check(LOCAL, &http_check(port), Duration::from_millis(100)).await;
        assert_health_get(req).await;
        assert!(matches!(err, Err(CheckError::Timeout(_))), "{err:?}");
    }
}
