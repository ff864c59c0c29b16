//! Client traffic through the lab: token streams, short sessions, connection attempts, and
//! the daemon's metrics page.

use std::{
    collections::BTreeMap,
    io::{Read, Write},
    net::{IpAddr, SocketAddr, TcpStream},
    thread,
    time::{Duration, Instant},
};

use anyhow::{anyhow, Context, Result};

use super::{util::tally, DaemonLab};
use crate::stream::TokenStream;

impl DaemonLab {
    /// Opens a token stream from the client to `vip` (`tokens` tokens, one every
    /// `interval_ms`) and reads it to the end on its own thread: see [`Running`].
    pub fn stream(&self, vip: SocketAddr, tokens: u32, interval_ms: u32) -> Result<Running> {
        self.stream_from(None, vip, tokens, interval_ms)
    }

    /// [`DaemonLab::stream`] from client address `src` ([`DaemonLab::add_client_sources`]).
    pub fn stream_from(
        &self,
        src: Option<IpAddr>,
        vip: SocketAddr,
        tokens: u32,
        interval_ms: u32,
    ) -> Result<Running> {
        self.stream_waiting(src, vip, tokens, interval_ms, Duration::from_secs(5))
    }

    /// [`DaemonLab::stream_from`] whose reads wait up to `read_timeout` for the next token
    /// (5 s there). For streams across a gap in the data plane: the client's ACKs are lost
    /// while nothing steers them, so the server, its window full, resends on its doubling
    /// retransmission timer (from 200 ms: at 0.2, 0.6, 1.4, 3.0, 6.2, 12.6 s), and a gap of
    /// a little over 3 s stalls the stream about 6 s, which is slow, not broken.
    pub fn stream_waiting(
        &self,
        src: Option<IpAddr>,
        vip: SocketAddr,
        tokens: u32,
        interval_ms: u32,
        read_timeout: Duration,
    ) -> Result<Running> {
        let s = TokenStream::open_from(
            &self.topo.client.ns,
            src,
            vip,
            tokens,
            interval_ms,
            read_timeout,
        )?;
        let backend = s.backend.clone();
        let local = s.local;
        // Generous: the whole stream's duration plus slack for a loaded machine.
        let deadline = Instant::now()
            + Duration::from_millis(tokens as u64 * interval_ms as u64) * 2
            + Duration::from_secs(15);
        let h = thread::spawn(move || {
            let mut s = s;
            let r = s.read_to_end(deadline);
            let received = s.received;
            s.close();
            // Context, not a new error: a caller can still find the io::Error (a reset).
            r.map(|_| received)
                .with_context(|| format!("{received} tokens received"))
        });
        Ok(Running {
            backend,
            local,
            tokens,
            handle: Some(h),
        })
    }

    /// A short session: connects to `vip`, reads a one-token stream and returns the backend
    /// that greeted.
    pub fn greet(&self, vip: SocketAddr, timeout: Duration) -> Result<String> {
        let mut s = TokenStream::open(&self.topo.client.ns, vip, 1, 1, timeout)?;
        s.read_to_end(Instant::now() + timeout)?;
        let b = s.backend.clone();
        s.close();
        Ok(b)
    }

    /// `n` short sessions opened now, 6 at a time: all must succeed; returns how many each
    /// backend greeted.
    pub fn sessions(&self, vip: SocketAddr, n: usize) -> BTreeMap<String, usize> {
        let results = self.greet_many(vip, n, 6);
        let errors: Vec<String> = results
            .iter()
            .filter_map(|r| r.as_ref().err().map(|e| format!("{e:#}")))
            .collect();
        assert!(
            errors.is_empty(),
            "{} of {n} new sessions failed:\n{}",
            errors.len(),
            errors.join("\n")
        );
        tally(results.iter().filter_map(|r| r.as_ref().ok()))
    }

    /// `n` short sessions, `parallel` at a time: the greeting backend (or the error) of each.
    pub fn greet_many(&self, vip: SocketAddr, n: usize, parallel: usize) -> Vec<Result<String>> {
        let mut out = Vec::with_capacity(n);
        let ns = self.topo.client.ns.clone();
        while out.len() < n {
            let batch = parallel.min(n - out.len());
            let hs: Vec<_> = (0..batch)
                .map(|_| {
                    let ns = ns.clone();
                    thread::spawn(move || -> Result<String> {
                        let t = Duration::from_secs(5);
                        let mut s = TokenStream::open(&ns, vip, 1, 1, t)?;
                        s.read_to_end(Instant::now() + t)?;
                        let b = s.backend.clone();
                        s.close();
                        Ok(b)
                    })
                })
                .collect();
            for h in hs {
                out.push(
                    h.join()
                        .unwrap_or_else(|_| Err(anyhow!("session thread panicked"))),
                );
            }
        }
        out
    }

    /// A TCP connection attempt from the client namespace, bounded by `timeout`.
    pub fn connect(&self, vip: SocketAddr, timeout: Duration) -> std::io::Result<TcpStream> {
        self.topo
            .client
            .ns
            .run(move || TcpStream::connect_timeout(&vip, timeout))
            .map_err(std::io::Error::other)?
    }

    /// Binds the daemon's metrics address in the LB namespace, so that a daemon start fails
    /// on it while the listener lives.
    pub fn take_metrics_port(&self) -> Result<std::net::TcpListener> {
        let addr = self.metrics;
        self.topo
            .lb
            .ns
            .run(move || std::net::TcpListener::bind(addr))?
            .with_context(|| format!("binding {addr}"))
    }

    /// GET of the daemon's metrics page (from inside the LB namespace).
    pub fn metrics_page(&self) -> Result<String> {
        let addr = self.metrics;
        self.topo.lb.ns.run(move || -> Result<String> {
            let mut s = TcpStream::connect_timeout(&addr, Duration::from_secs(5))?;
            s.set_read_timeout(Some(Duration::from_secs(10)))?;
            s.write_all(b"GET /metrics HTTP/1.1\r\nHost: lab\r\nConnection: close\r\n\r\n")?;
            let mut out = String::new();
            s.read_to_string(&mut out)?;
            Ok(out)
        })?
    }
}

/// A stream being read to its end on its own thread.
pub struct Running {
    /// The backend that greeted.
    pub backend: String,
    pub local: SocketAddr,
    pub tokens: u32,
    handle: Option<thread::JoinHandle<Result<u32>>>,
}

impl Running {
    /// Waits for the stream's end: Ok(tokens) when it completed in order from its backend.
    pub fn finish(mut self) -> Result<u32> {
        self.handle
            .take()
            .expect("finished once")
            .join()
            .unwrap_or_else(|_| Err(anyhow!("stream thread panicked")))
    }

    pub fn is_finished(&self) -> bool {
        self.handle.as_ref().is_none_or(|h| h.is_finished())
    }

    /// Waits for the stream's end: None when every token came, else what went wrong, naming
    /// the stream and its backend.
    pub fn broken(self) -> Option<String> {
        let (backend, local, tokens) = (self.backend.clone(), self.local, self.tokens);
        match self.finish() {
            Ok(got) if got == tokens => None,
            Ok(got) => Some(format!("{local} on {backend}: {got} of {tokens} tokens")),
            Err(e) => Some(format!("{local} on {backend}: {e:#}")),
        }
    }
}
