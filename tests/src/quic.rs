//! The lab's QUIC token streams (quinn on both ends): the server `sluice-testsrv serve --quic`
//! runs on every backend, on the VIP address, with connection IDs that carry its QUIC-LB
//! server ID (`sluice_quic_lb`); the client opens K connections to a VIP, one token stream
//! each, and moves every connection to a new UDP socket (a new port, and for some a new
//! source address) in the middle of its stream, as a NAT rebinding or a roaming phone would.
//!
//! Protocol, on one bidirectional stream per request:
//!
//! ```text
//! client: tokens=<n> interval_ms=<ms>\n     (then finishes its side)
//! server: hello <name> <conn>\n
//!         token <i> <name>\n                 (i = 1..=n, one every <ms>)
//!         done\n                             (then finishes its side)
//! ```
//!
//! Every line names the server, so a client tells a stream that stayed on its backend from
//! one that moved (which a QUIC connection cannot survive: another backend has no state for
//! it and drops its packets).
//!
//! The server's certificate is self-signed and made at start; the client does not verify it
//! (test code only: [`SkipServerVerification`]).

use std::{
    collections::BTreeMap,
    net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr, UdpSocket},
    sync::{Arc, Mutex},
    thread,
    time::{Duration, Instant},
};

use anyhow::{anyhow, bail, Context, Result};
use quinn::{
    crypto::rustls::{QuicClientConfig, QuicServerConfig},
    ClientConfig, Endpoint, EndpointConfig, ServerConfig, TokioRuntime, TransportConfig,
};
use rustls::{
    client::danger::{HandshakeSignatureValid, ServerCertVerified, ServerCertVerifier},
    crypto::CryptoProvider,
    pki_types::{CertificateDer, PrivateKeyDer, PrivatePkcs8KeyDer, ServerName, UnixTime},
    DigitallySignedStruct, SignatureScheme,
};
use sluice_quic_lb::QuicLbCids;
use tokio::io::{AsyncBufReadExt, BufReader};

/// The application protocol both ends announce.
pub const ALPN: &[u8] = b"sluice-tokens";
/// The name the client asks for (the certificate's subject).
pub const SERVER_NAME: &str = "sluice-lab";
/// The lab's QUIC VIP port.
pub const QUIC_PORT: u16 = 8443;
/// Largest stream a server accepts, in tokens and in milliseconds between tokens.
pub const MAX_TOKENS: u32 = 100_000;
pub const MAX_INTERVAL_MS: u32 = 10_000;
/// A connection closes after this long without packets (either end).
pub const IDLE_TIMEOUT: Duration = Duration::from_secs(10);

/// rustls with ring (the workspace builds no aws-lc); ring has no post-quantum key exchange,
/// which a test lab does not need.
#[allow(deprecated)]
fn provider() -> Arc<CryptoProvider> {
    Arc::new(rustls::crypto::ring::default_provider())
}

fn transport() -> Result<Arc<TransportConfig>> {
    let mut t = TransportConfig::default();
    t.max_idle_timeout(Some(IDLE_TIMEOUT.try_into()?));
    t.keep_alive_interval(Some(Duration::from_secs(1)));
    Ok(Arc::new(t))
}

/// The server's TLS and transport configuration: a fresh self-signed certificate for
/// [`SERVER_NAME`], TLS 1.3 with ring, [`ALPN`], client migration allowed (quinn's default,
/// set here so it is said).
pub fn server_config() -> Result<ServerConfig> {
    let key = rcgen::generate_simple_self_signed(vec![SERVER_NAME.to_string()])
        .context("making a self-signed certificate")?;
    let cert = key.cert.der().clone();
    let pkcs8 = PrivateKeyDer::Pkcs8(PrivatePkcs8KeyDer::from(key.signing_key.serialize_der()));
    let mut tls = rustls::ServerConfig::builder_with_provider(provider())
        .with_protocol_versions(&[&rustls::version::TLS13])?
        .with_no_client_auth()
        .with_single_cert(vec![cert], pkcs8)?;
    tls.alpn_protocols = vec![ALPN.to_vec()];
    let mut cfg = ServerConfig::with_crypto(Arc::new(QuicServerConfig::try_from(tls)?));
    cfg.transport_config(transport()?);
    cfg.migration(true);
    Ok(cfg)
}

/// The client's configuration: TLS 1.3 with ring, [`ALPN`], the server's certificate not
/// verified.
pub fn client_config() -> Result<ClientConfig> {
    let mut tls = rustls::ClientConfig::builder_with_provider(provider())
        .with_protocol_versions(&[&rustls::version::TLS13])?
        .dangerous()
        .with_custom_certificate_verifier(Arc::new(SkipServerVerification(provider())))
        .with_no_client_auth();
    tls.alpn_protocols = vec![ALPN.to_vec()];
    let mut cfg = ClientConfig::new(Arc::new(QuicClientConfig::try_from(tls)?));
    cfg.transport_config(transport()?);
    Ok(cfg)
}

/// Accepts any server certificate (the lab's are self-signed and made at start); handshake
/// signatures are still checked.
#[derive(Debug)]
pub struct SkipServerVerification(Arc<CryptoProvider>);

impl ServerCertVerifier for SkipServerVerification {
    fn verify_server_cert(
        &self,
        _end_entity: &CertificateDer<'_>,
        _intermediates: &[CertificateDer<'_>],
        _server_name: &ServerName<'_>,
        _ocsp: &[u8],
        _now: UnixTime,
    ) -> Result<ServerCertVerified, rustls::Error> {
        Ok(ServerCertVerified::assertion())
    }

    fn verify_tls12_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &DigitallySignedStruct,
    ) -> Result<HandshakeSignatureValid, rustls::Error> {
        rustls::crypto::verify_tls12_signature(
            message,
            cert,
            dss,
            &self.0.signature_verification_algorithms,
        )
    }

    fn verify_tls13_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &DigitallySignedStruct,
    ) -> Result<HandshakeSignatureValid, rustls::Error> {
        rustls::crypto::verify_tls13_signature(
            message,
            cert,
            dss,
            &self.0.signature_verification_algorithms,
        )
    }

    fn supported_verify_schemes(&self) -> Vec<SignatureScheme> {
        self.0.signature_verification_algorithms.supported_schemes()
    }
}

fn nonblocking(s: UdpSocket) -> Result<UdpSocket> {
    s.set_nonblocking(true)?;
    Ok(s)
}

/// A server endpoint on `socket` whose connection IDs come from `cids` (None: quinn's random
/// ones). Call inside a tokio runtime.
pub fn server_endpoint(socket: UdpSocket, cids: Option<&QuicLbCids>) -> Result<Endpoint> {
    let mut ec = EndpointConfig::default();
    if let Some(c) = cids {
        ec.cid_generator(c.factory());
    }
    Endpoint::new(
        ec,
        Some(server_config()?),
        nonblocking(socket)?,
        Arc::new(TokioRuntime),
    )
    .context("making the QUIC server endpoint")
}

/// Serves token streams on `endpoint` until it is closed: every connection, every
/// bidirectional stream.
pub async fn serve(endpoint: Endpoint, name: Arc<str>) {
    let mut conns = 0u64;
    while let Some(incoming) = endpoint.accept().await {
        conns += 1;
        let (name, n) = (name.clone(), conns);
        tokio::spawn(async move {
            let Ok(conn) = incoming.await else { return };
            while let Ok((send, recv)) = conn.accept_bi().await {
                let name = name.clone();
                tokio::spawn(async move {
                    if let Err(e) = serve_stream(send, recv, &name, n).await {
                        let text = format!("{e:#}");
                        if text.contains("bad request") {
                            eprintln!("sluice-testsrv {name}: quic connection {n}: {text}");
                        }
                    }
                });
            }
        });
    }
}

async fn serve_stream(
    mut send: quinn::SendStream,
    recv: quinn::RecvStream,
    name: &str,
    conn: u64,
) -> Result<()> {
    let mut r = BufReader::new(recv);
    let mut line = String::new();
    tokio::time::timeout(Duration::from_secs(10), r.read_line(&mut line))
        .await
        .context("reading the request")??;
    let Some((tokens, interval)) = parse_request(line.trim_end()) else {
        send.write_all(b"error bad request\n").await?;
        send.finish()?;
        bail!("bad request {:?}", line.trim_end());
    };
    send.write_all(format!("hello {name} {conn}\n").as_bytes())
        .await?;
    let start = tokio::time::Instant::now();
    for i in 1..=tokens {
        // Paced from the start, so a slow write does not stretch the stream.
        tokio::time::sleep_until(start + Duration::from_millis(interval as u64 * i as u64)).await;
        send.write_all(format!("token {i} {name}\n").as_bytes())
            .await?;
    }
    send.write_all(b"done\n").await?;
    send.finish()?;
    // Until the client has every byte (or stopped the stream).
    let _ = send.stopped().await;
    Ok(())
}

/// The request line asking for `tokens` tokens, one every `interval_ms`.
pub fn request(tokens: u32, interval_ms: u32) -> String {
    format!("tokens={tokens} interval_ms={interval_ms}\n")
}

/// `tokens=<n> interval_ms=<ms>`, capped at [`MAX_TOKENS`] and [`MAX_INTERVAL_MS`].
pub fn parse_request(line: &str) -> Option<(u32, u32)> {
    let (mut tokens, mut interval) = (None, None);
    for kv in line.split_whitespace() {
        let (k, v) = kv.split_once('=')?;
        let v: u32 = v.parse().ok()?;
        match k {
            "tokens" => tokens = Some(v.min(MAX_TOKENS)),
            "interval_ms" => interval = Some(v.min(MAX_INTERVAL_MS)),
            _ => return None,
        }
    }
    Some((tokens?, interval?))
}

/// What [`QuicStreams::start`] opens.
#[derive(Clone, Debug)]
pub struct StreamsSpec {
    pub vip: SocketAddr,
    /// Connections, one stream each, each from its own UDP socket (its own source port).
    pub connections: usize,
    pub tokens: u32,
    pub interval_ms: u32,
    /// After this many tokens a stream's connection moves to a new UDP socket (a new source
    /// port); None: it stays.
    pub rebind_after: Option<u32>,
    /// With `rebind_after`: streams of odd index move to this source address (and a new port)
    /// instead, a client that changed networks.
    pub rebind_address: Option<IpAddr>,
    /// After the move the old socket stays open but takes nothing any more (it is connected
    /// to another address), as when a NAT's old mapping is gone: the server must follow the
    /// client to its new address. quinn keeps reading its previous socket until a packet
    /// arrives on the new one, so without this a server that never hears from the moved
    /// client could still deliver the rest of a short stream to the old address.
    pub forget_old_path: bool,
    /// A stream that waits longer than this for its next line is broken.
    pub read_timeout: Duration,
}

impl StreamsSpec {
    pub fn new(vip: SocketAddr, connections: usize, tokens: u32, interval_ms: u32) -> Self {
        StreamsSpec {
            vip,
            connections,
            tokens,
            interval_ms,
            rebind_after: None,
            rebind_address: None,
            forget_old_path: true,
            read_timeout: Duration::from_secs(3),
        }
    }

    /// The whole streams' duration plus slack for a loaded machine.
    fn deadline(&self) -> Duration {
        Duration::from_millis(self.tokens as u64 * self.interval_ms as u64) * 2
            + self.read_timeout * 2
            + Duration::from_secs(10)
    }
}

/// How one stream went.
#[derive(Clone, Debug, Default)]
pub struct StreamOutcome {
    pub index: usize,
    /// The connection's source address at the start, and after its rebind.
    pub local: Option<SocketAddr>,
    pub rebound_to: Option<SocketAddr>,
    /// The servers that sent it lines (hello, tokens), in order of their first line.
    pub servers: Vec<String>,
    /// Tokens received (in order: a token out of order is an error).
    pub tokens: u32,
    pub expected: u32,
    pub done: bool,
    /// Why the stream broke: an error, a timeout, a line out of order.
    pub error: Option<String>,
}

impl StreamOutcome {
    /// Every token, then `done`, with no error.
    pub fn completed(&self) -> bool {
        self.error.is_none() && self.done && self.tokens == self.expected
    }

    /// The first server that answered.
    pub fn server(&self) -> Option<&str> {
        self.servers.first().map(String::as_str)
    }

    fn saw(&mut self, server: &str) {
        if !self.servers.iter().any(|s| s == server) {
            self.servers.push(server.to_string());
        }
    }
}

impl std::fmt::Display for StreamOutcome {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "stream {} from {} (rebound to {}) on {:?}: {} of {} tokens{}",
            self.index,
            self.local.map_or("?".into(), |a| a.to_string()),
            self.rebound_to.map_or("-".into(), |a| a.to_string()),
            self.servers,
            self.tokens,
            self.expected,
            match &self.error {
                Some(e) => format!(", broken: {e}"),
                None if self.done => ", done".into(),
                None => String::new(),
            }
        )
    }
}

/// Makes a UDP socket bound to the address given (None: the unspecified address of the
/// VIP's family) and port 0; for the lab, inside the client namespace.
pub type SocketMaker = dyn Fn(Option<IpAddr>, bool) -> Result<UdpSocket> + Send + Sync;

/// Token streams running on their own thread (with their own tokio runtime).
pub struct QuicStreams {
    progress: Arc<Mutex<Vec<StreamOutcome>>>,
    handle: Option<thread::JoinHandle<Result<Vec<StreamOutcome>>>>,
}

impl QuicStreams {
    /// Opens `spec.connections` connections to `spec.vip` with sockets from `sockets` (made
    /// now, the rebind sockets too), starts a stream on each and reads them on a thread of
    /// its own.
    pub fn start(spec: StreamsSpec, sockets: &SocketMaker) -> Result<QuicStreams> {
        let v6 = spec.vip.is_ipv6();
        let mut first = Vec::new();
        let mut later = Vec::new();
        for i in 0..spec.connections {
            first.push(nonblocking(sockets(None, v6)?)?);
            if spec.rebind_after.is_some() {
                let addr = if i % 2 == 1 {
                    spec.rebind_address
                } else {
                    None
                };
                later.push(Some(nonblocking(sockets(addr, v6)?)?));
            } else {
                later.push(None);
            }
        }
        let progress = Arc::new(Mutex::new(
            (0..spec.connections)
                .map(|index| StreamOutcome {
                    index,
                    expected: spec.tokens,
                    ..Default::default()
                })
                .collect::<Vec<_>>(),
        ));
        let shared = progress.clone();
        let handle = thread::Builder::new().name("quic-client".into()).spawn(
            move || -> Result<Vec<StreamOutcome>> {
                let rt = tokio::runtime::Builder::new_multi_thread()
                    .worker_threads(2)
                    .enable_all()
                    .build()?;
                let p = shared.clone();
                rt.block_on(async move {
                    let client = client_config()?;
                    let mut tasks = Vec::new();
                    for (i, (s, r)) in first.into_iter().zip(later).enumerate() {
                        let (spec, p, client) = (spec.clone(), p.clone(), client.clone());
                        tasks.push(tokio::spawn(async move {
                            let deadline = spec.deadline();
                            let res = tokio::time::timeout(
                                deadline,
                                one_stream(i, &spec, client, s, r, &p),
                            )
                            .await
                            .unwrap_or_else(|_| Err(anyhow!("not done within {deadline:?}")));
                            if let Err(e) = res {
                                p.lock().unwrap()[i].error = Some(format!("{e:#}"));
                            }
                        }));
                    }
                    for t in tasks {
                        t.await?;
                    }
                    anyhow::Ok(())
                })?;
                let out = shared.lock().unwrap().clone();
                Ok(out)
            },
        )?;
        Ok(QuicStreams {
            progress,
            handle: Some(handle),
        })
    }

    /// How the streams are going now.
    pub fn snapshot(&self) -> Vec<StreamOutcome> {
        self.progress.lock().unwrap().clone()
    }

    /// Waits (at most `timeout`) until every stream has been greeted or has broken; returns
    /// the greeting server of each (None: broken first).
    pub fn wait_greeted(&self, timeout: Duration) -> Result<Vec<Option<String>>> {
        let deadline = Instant::now() + timeout;
        loop {
            let s = self.snapshot();
            if s.iter().all(|o| !o.servers.is_empty() || o.error.is_some()) {
                return Ok(s.iter().map(|o| o.server().map(String::from)).collect());
            }
            if Instant::now() >= deadline {
                bail!(
                    "not every stream was greeted within {timeout:?}:\n{}",
                    lines(&s)
                );
            }
            thread::sleep(Duration::from_millis(20));
        }
    }

    /// Waits for every stream's end (each is bounded) and returns how each went.
    pub fn finish(mut self) -> Result<Vec<StreamOutcome>> {
        self.handle
            .take()
            .expect("finished once")
            .join()
            .map_err(|_| anyhow!("the QUIC client thread panicked"))?
    }
}

/// One line per stream.
pub fn lines(outcomes: &[StreamOutcome]) -> String {
    outcomes
        .iter()
        .map(|o| o.to_string())
        .collect::<Vec<_>>()
        .join("\n")
}

/// How many streams each server greeted.
pub fn per_server(outcomes: &[StreamOutcome]) -> BTreeMap<String, usize> {
    let mut m = BTreeMap::new();
    for o in outcomes {
        if let Some(s) = o.server() {
            *m.entry(s.to_string()).or_default() += 1;
        }
    }
    m
}

/// [`QuicStreams::start`] and [`QuicStreams::finish`].
pub fn run_streams(spec: StreamsSpec, sockets: &SocketMaker) -> Result<Vec<StreamOutcome>> {
    QuicStreams::start(spec, sockets)?.finish()
}

async fn one_stream(
    i: usize,
    spec: &StreamsSpec,
    client: ClientConfig,
    socket: UdpSocket,
    rebind: Option<UdpSocket>,
    progress: &Mutex<Vec<StreamOutcome>>,
) -> Result<()> {
    let update = |f: &mut dyn FnMut(&mut StreamOutcome)| f(&mut progress.lock().unwrap()[i]);
    let local = socket.local_addr()?;
    update(&mut |o| o.local = Some(local));
    // The same socket, to cut the old path after the move.
    let old = socket.try_clone()?;
    let mut endpoint = Endpoint::new(
        EndpointConfig::default(),
        None,
        socket,
        Arc::new(TokioRuntime),
    )?;
    endpoint.set_default_client_config(client);
    let t = spec.read_timeout;
    let conn = tokio::time::timeout(t * 2, endpoint.connect(spec.vip, SERVER_NAME)?)
        .await
        .context("connecting: timed out")?
        .context("connecting")?;
    let (mut send, recv) = conn.open_bi().await.context("opening a stream")?;
    send.write_all(request(spec.tokens, spec.interval_ms).as_bytes())
        .await?;
    send.finish()?;
    let mut r = BufReader::new(recv);
    let mut rebind = rebind;
    let mut line = String::new();
    let mut greeted = false;
    loop {
        line.clear();
        let n = tokio::time::timeout(t, r.read_line(&mut line))
            .await
            .map_err(|_| anyhow!("no line for {t:?}"))?
            .context("reading")?;
        if n == 0 {
            bail!("the stream ended without done");
        }
        let words: Vec<&str> = line.split_whitespace().collect();
        match words.as_slice() {
            ["hello", server, _conn] if !greeted => {
                greeted = true;
                update(&mut |o| o.saw(server));
            }
            ["token", k, server] if greeted => {
                let k: u32 = k.parse().context("token number")?;
                let mut expected = 0;
                update(&mut |o| {
                    o.saw(server);
                    expected = o.tokens + 1;
                    if k == expected {
                        o.tokens = k;
                    }
                });
                if k != expected {
                    bail!("token {k} from {server}, expected {expected}");
                }
                if spec.rebind_after == Some(k) {
                    if let Some(s) = rebind.take() {
                        let to = s.local_addr()?;
                        endpoint.rebind(s).context("rebinding")?;
                        if spec.forget_old_path {
                            // Nothing comes from the discard port of the VIP's address.
                            old.connect(SocketAddr::new(spec.vip.ip(), 9))
                                .context("cutting the old path")?;
                        }
                        update(&mut |o| o.rebound_to = Some(to));
                    }
                }
            }
            ["done"] if greeted => {
                update(&mut |o| o.done = true);
                break;
            }
            _ => bail!("unexpected line {:?}", line.trim_end()),
        }
    }
    let mut rest = String::new();
    if tokio::time::timeout(t, r.read_line(&mut rest))
        .await
        .map_err(|_| anyhow!("no end of stream after done for {t:?}"))??
        != 0
    {
        bail!("data after done: {rest:?}");
    }
    conn.close(0u32.into(), b"done");
    // Let the close go out; bounded.
    let _ = tokio::time::timeout(Duration::from_secs(1), endpoint.wait_idle()).await;
    Ok(())
}

/// A server on loopback for tests without the lab: binds `addr`, serves on a thread of its
/// own until dropped.
pub struct LocalServer {
    pub addr: SocketAddr,
    stop: Option<tokio::sync::oneshot::Sender<()>>,
    handle: Option<thread::JoinHandle<()>>,
}

impl LocalServer {
    pub fn start(addr: SocketAddr, name: &str, cids: Option<QuicLbCids>) -> Result<LocalServer> {
        let socket = UdpSocket::bind(addr).with_context(|| format!("binding {addr}"))?;
        let addr = socket.local_addr()?;
        let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
        let (ready_tx, ready) = std::sync::mpsc::channel::<Result<()>>();
        let name: Arc<str> = name.into();
        let handle = thread::spawn(move || {
            let rt = match tokio::runtime::Builder::new_current_thread()
                .enable_all()
                .build()
            {
                Ok(rt) => rt,
                Err(e) => {
                    let _ = ready_tx.send(Err(e.into()));
                    return;
                }
            };
            rt.block_on(async move {
                let ep = match server_endpoint(socket, cids.as_ref()) {
                    Ok(ep) => ep,
                    Err(e) => {
                        let _ = ready_tx.send(Err(e));
                        return;
                    }
                };
                let _ = ready_tx.send(Ok(()));
                tokio::select! {
                    _ = serve(ep.clone(), name) => {}
                    _ = stopped => ep.close(0u32.into(), b"stop"),
                }
            });
        });
        ready
            .recv()
            .map_err(|_| anyhow!("the server thread ended"))??;
        Ok(LocalServer {
            addr,
            stop: Some(stop),
            handle: Some(handle),
        })
    }
}

impl Drop for LocalServer {
    fn drop(&mut self) {
        if let Some(s) = self.stop.take() {
            let _ = s.send(());
        }
        if let Some(h) = self.handle.take() {
            let _ = h.join();
        }
    }
}

/// The config rotation codepoint and server ID `sluice backend-host` wrote for `vip` in its
/// `quic_file` (`{"vips": [{"vip": "10.0.0.2", "quic_server_id": "0a01",
/// "quic_server_id_len": 2, "quic_config_rotation": 0}]}`).
pub fn id_from_backend_host_file(text: &str, vip: IpAddr) -> Result<(u8, Vec<u8>)> {
    let v: serde_json::Value = serde_json::from_str(text).context("not JSON")?;
    let entry = v["vips"]
        .as_array()
        .ok_or_else(|| anyhow!("no \"vips\" array"))?
        .iter()
        .find(|e| {
            e["vip"]
                .as_str()
                .and_then(|a| a.parse::<IpAddr>().ok())
                .is_some_and(|a| a == vip)
        })
        .ok_or_else(|| anyhow!("no entry for {vip}"))?;
    let hex = entry["quic_server_id"]
        .as_str()
        .ok_or_else(|| anyhow!("{vip}: no quic_server_id"))?;
    let id = sluice_quic_lb::parse_server_id(hex)
        .ok_or_else(|| anyhow!("{vip}: quic_server_id {hex:?} is not 1 to 8 octets of hex"))?;
    if let Some(len) = entry["quic_server_id_len"].as_u64() {
        if len != id.len() as u64 {
            bail!("{vip}: quic_server_id {hex:?} is not quic_server_id_len = {len} octets");
        }
    }
    let rotation = entry["quic_config_rotation"].as_u64().unwrap_or(0);
    let rotation = u8::try_from(rotation).context("quic_config_rotation")?;
    Ok((rotation, id))
}

/// Binds a UDP socket on `addr` (None: the unspecified address) and port 0, in the calling
/// thread's namespace.
pub fn bind_here(addr: Option<IpAddr>, v6: bool) -> Result<UdpSocket> {
    let ip = addr.unwrap_or(if v6 {
        Ipv6Addr::UNSPECIFIED.into()
    } else {
        Ipv4Addr::UNSPECIFIED.into()
    });
    UdpSocket::bind((ip, 0)).with_context(|| format!("binding {ip}:0"))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn server_ids_come_from_the_backend_hosts_file() {
        let text = r#"{"vips": [{"vip": "10.0.0.2", "quic_server_id": "0a01",
            "quic_server_id_len": 2, "quic_config_rotation": 3},
            {"vip": "fd00::2", "quic_server_id": "0b", "quic_server_id_len": 1}]}"#;
        let v4: IpAddr = "10.0.0.2".parse().unwrap();
        let v6: IpAddr = "fd00::2".parse().unwrap();
        assert_eq!(
            id_from_backend_host_file(text, v4).unwrap(),
            (3, vec![0x0a, 0x01])
        );
        assert_eq!(
            id_from_backend_host_file(text, v6).unwrap(),
            (0, vec![0x0b])
        );
        let e = id_from_backend_host_file(text, "10.0.0.3".parse().unwrap()).unwrap_err();
        assert!(e.to_string().contains("no entry for 10.0.0.3"), "{e}");
        let bad =
            r#"{"vips": [{"vip": "10.0.0.2", "quic_server_id": "0a01", "quic_server_id_len": 3}]}"#;
        assert!(id_from_backend_host_file(bad, v4).is_err());
    }

    #[test]
    fn requests_round_trip_and_are_capped() {
        assert_eq!(parse_request(request(30, 5).trim_end()), Some((30, 5)));
        assert_eq!(
            parse_request("tokens=99999999 interval_ms=99999999"),
            Some((MAX_TOKENS, MAX_INTERVAL_MS))
        );
        assert_eq!(parse_request("tokens=3"), None);
        assert_eq!(parse_request("tokens=3 interval_ms=x"), None);
        assert_eq!(parse_request("GET / HTTP/1.1"), None);
    }

    fn loopback(addr: Option<IpAddr>, _v6: bool) -> Result<UdpSocket> {
        bind_here(Some(addr.unwrap_or(Ipv4Addr::LOCALHOST.into())), false)
    }

    /// Over loopback without a load balancer: streams complete across a rebind to a new port
    /// (and for half of them a new source address, 127.0.0.2), each on the one server, and
    /// every connection ID the server issued carries its server ID.
    #[test]
    fn streams_survive_a_rebind_over_loopback() {
        let cids = QuicLbCids::new(1, &[0x0a, 0x01], 6).unwrap();
        let server = LocalServer::start("127.0.0.1:0".parse().unwrap(), "s1", Some(cids)).unwrap();
        let mut spec = StreamsSpec::new(server.addr, 6, 30, 10);
        spec.rebind_after = Some(10);
        spec.rebind_address = Some(Ipv4Addr::new(127, 0, 0, 2).into());
        let t = Instant::now();
        let out = run_streams(spec, &loopback).unwrap();
        eprintln!("{} in {:?}", lines(&out), t.elapsed());
        for o in &out {
            assert!(o.completed(), "{o}");
            assert_eq!(o.servers, ["s1"], "{o}");
            let (from, to) = (o.local.unwrap(), o.rebound_to.unwrap());
            assert_ne!(from.port(), to.port(), "{o}");
            let want: IpAddr = if o.index % 2 == 1 {
                Ipv4Addr::new(127, 0, 0, 2).into()
            } else {
                Ipv4Addr::LOCALHOST.into()
            };
            assert_eq!(to.ip(), want, "{o}");
        }
    }

    /// A UDP relay on loopback between clients and one server (one upstream socket per client
    /// address, as a NAT would), recording the destination connection ID of every
    /// short-header packet a client sends.
    struct Relay {
        addr: SocketAddr,
        dcids: Arc<Mutex<Vec<Vec<u8>>>>,
        stop: Arc<std::sync::atomic::AtomicBool>,
    }

    impl Relay {
        fn start(server: SocketAddr, cid_len: usize) -> Relay {
            use std::{collections::HashMap, sync::atomic::Ordering};
            let front = UdpSocket::bind("127.0.0.1:0").unwrap();
            front
                .set_read_timeout(Some(Duration::from_millis(50)))
                .unwrap();
            let addr = front.local_addr().unwrap();
            let dcids = Arc::new(Mutex::new(Vec::new()));
            let stop = Arc::new(std::sync::atomic::AtomicBool::new(false));
            let (d, st) = (dcids.clone(), stop.clone());
            thread::spawn(move || {
                let front = Arc::new(front);
                let mut up: HashMap<SocketAddr, UdpSocket> = HashMap::new();
                let mut buf = [0u8; 2048];
                while !st.load(Ordering::Relaxed) {
                    let Ok((n, client)) = front.recv_from(&mut buf) else {
                        continue;
                    };
                    let p = &buf[..n];
                    if p[0] & 0x80 == 0 && n > cid_len {
                        d.lock().unwrap().push(p[1..1 + cid_len].to_vec());
                    }
                    let u = up.entry(client).or_insert_with(|| {
                        let u = UdpSocket::bind("127.0.0.1:0").unwrap();
                        u.connect(server).unwrap();
                        u.set_read_timeout(Some(Duration::from_millis(50))).unwrap();
                        let (u2, f, st) = (u.try_clone().unwrap(), front.clone(), st.clone());
                        thread::spawn(move || {
                            let mut buf = [0u8; 2048];
                            while !st.load(Ordering::Relaxed) {
                                if let Ok(n) = u2.recv(&mut buf) {
                                    let _ = f.send_to(&buf[..n], client);
                                }
                            }
                        });
                        u
                    });
                    let _ = u.send(p);
                }
            });
            Relay { addr, dcids, stop }
        }
    }

    impl Drop for Relay {
        fn drop(&mut self) {
            self.stop.store(true, std::sync::atomic::Ordering::Relaxed);
        }
    }

    /// On the wire: every short-header packet the clients send, before and after their move,
    /// carries a connection ID with the server's rotation codepoint and server ID, and the
    /// clients switch to a fresh one when they move (quinn does on a local address change).
    #[test]
    fn clients_send_to_connection_ids_that_name_the_server() {
        let cids = QuicLbCids::new(3, &[0x0a, 0x01], 6).unwrap();
        let len = cids.len();
        let server = LocalServer::start("127.0.0.1:0".parse().unwrap(), "s1", Some(cids)).unwrap();
        let relay = Relay::start(server.addr, len);
        let mut spec = StreamsSpec::new(relay.addr, 4, 20, 10);
        spec.rebind_after = Some(10);
        let out = run_streams(spec, &loopback).unwrap();
        for o in &out {
            assert!(o.completed(), "{o}");
        }
        let dcids = relay.dcids.lock().unwrap().clone();
        assert!(dcids.len() > 40, "{} short-header packets", dcids.len());
        for d in &dcids {
            assert_eq!(
                sluice_quic_lb::server_id_of(d, 2),
                Some((3, &[0x0a, 0x01][..])),
                "{d:02x?}"
            );
        }
        let distinct: std::collections::HashSet<&Vec<u8>> = dcids.iter().collect();
        assert!(
            distinct.len() >= 2 * out.len(),
            "{} connection IDs for {} connections that moved",
            distinct.len(),
            out.len()
        );
    }
}
