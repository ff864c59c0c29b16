//! Decision traces from the data plane: aya-log records (`lb_common::trace`) read from the
//! `AYA_LOGS` ring buffer with the `aya-log` crate and logged through `tracing` (target
//! `sluice::dataplane`, level info). Tracing is off by default and switched at run time
//! (`sluice trace on|off`, which sets `LB_F_TRACE` in the live CONFIG map).

use std::future::Future;

use aya_log::EbpfLogger;
use tokio::io::unix::AsyncFd;

/// Forwards aya-log's records to `tracing`.
pub struct TraceLog;

impl log::Log for TraceLog {
    fn enabled(&self, _: &log::Metadata) -> bool {
        true
    }

    fn log(&self, record: &log::Record) {
        tracing::info!(target: "sluice::dataplane", "{}", record.args());
    }

    fn flush(&self) {}
}

/// Reads traces until `shutdown` completes: the ring buffer's descriptor is readable when
/// records wait.
pub async fn run(reader: EbpfLogger<TraceLog>, shutdown: impl Future<Output = ()>) {
    // SAFETY: the logger owns the ring buffer's descriptor, which stays open and the same
    // until the logger (moved into the AsyncFd) is dropped.
    let mut fd = match unsafe { AsyncFd::register(reader) } {
        Ok(fd) => fd,
        Err(e) => {
            let e = e.into_parts().1;
            tracing::error!(error = %e, "cannot wait on the decision-trace ring buffer; traces are not read");
            return;
        }
    };
    tokio::pin!(shutdown);
    loop {
        tokio::select! {
            ready = fd.readable_mut() => match ready {
                Ok(mut guard) => {
                    guard.get_inner_mut().flush();
                    guard.clear_ready();
                }
                Err(e) => {
                    tracing::error!(error = %e, "waiting on the decision-trace ring buffer failed");
                    return;
                }
            },
            _ = &mut shutdown => return,
        }
    }
}

#[cfg(test)]
mod tests {
    use serde_json::json;

    use crate::admin::testing::TestServer;

    #[test]
    fn the_api_switches_tracing_in_the_plane() {
        let srv = TestServer::start();
        let c = srv.client();
        assert_eq!(
            c.request("GET", "/v1/trace", None).unwrap(),
            (200, json!({"enabled": false}))
        );
        let on = json!({"enabled": true});
        assert_eq!(
            c.request("PUT", "/v1/trace", Some(&on)).unwrap(),
            (200, json!({"enabled": true}))
        );
        assert!(srv.ctl.blocking_lock().plane().trace);
        let (st, v) = c
            .request("PUT", "/v1/trace", Some(&json!({"enable": true})))
            .unwrap();
        assert_eq!(st, 400, "{v}");
        assert!(
            srv.ctl.blocking_lock().plane().trace,
            "a bad request changes nothing"
        );
        let off = json!({"enabled": false});
        c.request("PUT", "/v1/trace", Some(&off)).unwrap();
        assert!(!srv.ctl.blocking_lock().plane().trace);
    }
}
