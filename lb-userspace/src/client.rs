//! A small blocking HTTP/1.1 client for the admin socket: one request per connection,
//! which is all the CLI needs.

use std::{
    io::{self, Read, Write},
    os::unix::{fs::MetadataExt, net::UnixStream},
    path::{Path, PathBuf},
    time::Duration,
};

use anyhow::{anyhow, bail, Context, Result};
use serde_json::Value;

use crate::admin::group_name;

/// Long enough for a listing that scans a full connection table.
const TIMEOUT: Duration = Duration::from_secs(60);

pub struct Client {
    socket: PathBuf,
    retries: u32,
}

/// How one try went wrong, which decides whether another is safe.
enum Failure {
    /// Nothing received the request (no socket, nothing listening): any request may be
    /// sent again.
    NotDelivered(anyhow::Error),
    /// The connection closed before a single byte of answer: the daemon may have acted
    /// on the request, so only a request that changes nothing more when repeated is sent
    /// again.
    NoAnswer(anyhow::Error),
    /// Anything else (a partial or malformed answer, a timeout, no permission).
    Final(anyhow::Error),
}

impl Failure {
    fn error(self) -> anyhow::Error {
        match self {
            Failure::NotDelivered(e) | Failure::NoAnswer(e) | Failure::Final(e) => e,
        }
    }
}

/// The most tries `--retry` may ask for beyond the first.
pub const MAX_RETRIES: u32 = 10;
/// The wait before the first retry; each further one waits twice as long, up to
/// [`RETRY_WAIT_MAX`] (so ten retries wait 15.1 s in all at most).
const RETRY_WAIT_FIRST: Duration = Duration::from_millis(100);
const RETRY_WAIT_MAX: Duration = Duration::from_secs(2);

/// The wait before retry number `n` (0 for the first).
fn retry_wait(n: u32) -> Duration {
    RETRY_WAIT_FIRST
        .saturating_mul(1 << n.min(16))
        .min(RETRY_WAIT_MAX)
}

impl Client {
    pub fn new(socket: impl Into<PathBuf>) -> Self {
        Client {
            socket: socket.into(),
            retries: 0,
        }
    }

    /// Retries a request up to `n` times (at most [`MAX_RETRIES`]) when the daemon
    /// answers 503 with Retry-After (its connection caps: nothing was done) or when the
    /// request reached nobody; when the connection closes before any answer, only GET and
    /// PUT (repeating them changes nothing more) are retried.
    pub fn with_retries(mut self, n: u32) -> Self {
        self.retries = n.min(MAX_RETRIES);
        self
    }

    pub fn socket(&self) -> &Path {
        &self.socket
    }

    /// Sends a request with an optional JSON body: the status and the JSON answered
    /// (`Null` for an empty body).
    pub fn request(&self, method: &str, path: &str, body: Option<&Value>) -> Result<(u16, Value)> {
        let body = body.map(serde_json::to_vec).transpose()?;
        self.send(method, path, body.as_deref())
    }

    /// As `request`, but a status of 400 or more becomes an error with the API's message.
    pub fn call(&self, method: &str, path: &str, body: Option<&Value>) -> Result<Value> {
        let (status, value) = self.request(method, path, body)?;
        if status >= 400 {
            let message = value["error"].as_str().map_or_else(
                || format!("the daemon answered {status}: {value}"),
                str::to_owned,
            );
            bail!(crate::escape::text(&message).into_owned());
        }
        Ok(value)
    }

    /// Sends raw body bytes (any content, for tests of what the daemon refuses), retrying
    /// as [`Client::with_retries`] says.
    pub fn send(&self, method: &str, path: &str, body: Option<&[u8]>) -> Result<(u16, Value)> {
        let repeatable = matches!(method, "GET" | "PUT");
        let mut tried = 0;
        loop {
            let last = tried == self.retries;
            match self.send_once(method, path, body) {
                Ok((503, _, true)) if !last => {}
                Ok((status, value, _)) => return Ok((status, value)),
                Err(Failure::NotDelivered(_)) if !last => {}
                Err(Failure::NoAnswer(_)) if !last && repeatable => {}
                Err(f) => return Err(f.error()),
            }
            std::thread::sleep(retry_wait(tried));
            tried += 1;
        }
    }

    /// One try: the status, the JSON answered, and whether it says to retry later.
    fn send_once(
        &self,
        method: &str,
        path: &str,
        body: Option<&[u8]>,
    ) -> Result<(u16, Value, bool), Failure> {
        let mut stream = self.connect()?;
        let at = || self.socket.display();
        let set = stream
            .set_read_timeout(Some(TIMEOUT))
            .and_then(|()| stream.set_write_timeout(Some(TIMEOUT)));
        set.map_err(|e| Failure::Final(anyhow!("setting timeouts on {}: {e}", at())))?;
        let mut msg =
            format!("{method} {path} HTTP/1.1\r\nHost: localhost\r\nConnection: close\r\n");
        if let Some(b) = body {
            msg += &format!(
                "Content-Type: application/json\r\nContent-Length: {}\r\n",
                b.len()
            );
        }
        msg += "\r\n";
        let mut msg = msg.into_bytes();
        msg.extend_from_slice(body.unwrap_or_default());
        // The daemon may answer (413) before reading all of a large body: its answer counts.
        let sent = stream.write_all(&msg);
        let mut raw = Vec::new();
        let read = stream.read_to_end(&mut raw);
        let timed_out = |r: &io::Result<usize>| {
            r.as_ref().is_err_and(|e| {
                matches!(
                    e.kind(),
                    io::ErrorKind::WouldBlock | io::ErrorKind::TimedOut
                )
            })
        };
        if raw.is_empty() && timed_out(&read) {
            return Err(Failure::Final(anyhow!(
                "the daemon at {} did not answer within {TIMEOUT:?}; the request may or may \
                 not have been applied: check with a listing",
                at()
            )));
        }
        if raw.is_empty() {
            let why = match (sent, read) {
                (Err(e), _) => format!("sending the request failed: {e}"),
                (_, Err(e)) => format!("reading the answer failed: {e}"),
                _ => "the connection closed".into(),
            };
            return Err(Failure::NoAnswer(anyhow!(
                "the daemon at {} closed the connection without answering ({why}); the request \
                 may or may not have been applied: check with a listing",
                at()
            )));
        }
        let answer = parse_response(&raw).map_err(|e| {
            let e = match read {
                Err(r) => e.context(format!("reading the answer from {} failed: {r}", at())),
                Ok(_) => e,
            };
            Failure::Final(e.context(
                "the daemon's answer is incomplete or malformed; the request may or may not \
                 have been applied: check with a listing",
            ))
        })?;
        Ok(answer)
    }

    fn connect(&self) -> Result<UnixStream, Failure> {
        UnixStream::connect(&self.socket).map_err(|e| {
            let path = self.socket.display();
            match e.kind() {
                io::ErrorKind::NotFound => Failure::NotDelivered(anyhow!(
                    "cannot connect to {path}: is `sluice run` running? (the socket does not exist; \
                     --socket or SLUICE_SOCKET name another)"
                )),
                io::ErrorKind::ConnectionRefused => Failure::NotDelivered(anyhow!(
                    "cannot connect to {path}: is `sluice run` running? (nothing listens on the socket)"
                )),
                io::ErrorKind::PermissionDenied => Failure::Final(anyhow!(
                    "cannot connect to {path}: permission denied ({}); run as root or as a member of its group",
                    describe_socket(&self.socket)
                )),
                _ => Failure::Final(anyhow!("cannot connect to {path}: {e}")),
            }
        })
    }
}

/// "the socket is mode 0660, group sluice", as far as it can be read.
fn describe_socket(path: &Path) -> String {
    match std::fs::metadata(path) {
        Ok(m) => format!(
            "the socket is mode {:04o}, group {}",
            m.mode() & 0o7777,
            group_name(m.gid()).unwrap_or_else(|| m.gid().to_string())
        ),
        Err(_) => "the socket's directory is not readable".into(),
    }
}

/// Percent-encodes a path segment, so a name can never reach another endpoint.
pub fn path_segment(s: &str) -> String {
    s.bytes()
        .map(|c| match c {
            b'a'..=b'z' | b'A'..=b'Z' | b'0'..=b'9' | b'-' | b'_' | b'.' | b'~' | b':' => {
                (c as char).to_string()
            }
            _ => format!("%{c:02X}"),
        })
        .collect()
}

/// A complete HTTP/1.x answer: its status, its JSON body (`Null` when empty) and whether
/// it asks to be retried later (a 503 with Retry-After). The body must be framed (a
/// Content-Length it matches, or a chunked body through its last chunk), so an answer cut
/// short is an error, never a shorter success.
fn parse_response(raw: &[u8]) -> Result<(u16, Value, bool)> {
    let end = raw
        .windows(4)
        .position(|w| w == b"\r\n\r\n")
        .context("the daemon's answer ends within its headers")?;
    let head = std::str::from_utf8(&raw[..end]).context("the daemon's headers are not UTF-8")?;
    let mut lines = head.split("\r\n");
    let status_line = lines.next().unwrap_or_default();
    let status: u16 = status_line
        .strip_prefix("HTTP/1.1 ")
        .or_else(|| status_line.strip_prefix("HTTP/1.0 "))
        .and_then(|rest| rest.get(..3))
        .and_then(|s| s.parse().ok())
        .filter(|s| (100..600).contains(s))
        .with_context(|| {
            format!(
                "the daemon's status line {} is not HTTP",
                crate::escape::text(&format!("{status_line:?}"))
            )
        })?;
    let mut length = None;
    let mut chunked = false;
    let mut retry_after = false;
    for line in lines {
        let (name, value) = line
            .split_once(':')
            .with_context(|| format!("the daemon sent a header line without a colon: {line:?}"))?;
        let value = value.trim();
        if name.eq_ignore_ascii_case("content-length") {
            let len: usize = value
                .parse()
                .with_context(|| format!("bad Content-Length {value:?} from the daemon"))?;
            if length.is_some_and(|l| l != len) {
                bail!("the daemon sent two different Content-Lengths");
            }
            length = Some(len);
        } else if name.eq_ignore_ascii_case("transfer-encoding") {
            if !value.eq_ignore_ascii_case("chunked") {
                bail!(
                    "the daemon answered with Transfer-Encoding {}, which this client does not read",
                    crate::escape::text(value)
                );
            }
            chunked = true;
        } else if name.eq_ignore_ascii_case("retry-after") {
            retry_after = true;
        }
    }
    let rest = &raw[end + 4..];
    let no_body = status < 200 || status == 204 || status == 304;
    let body = match (chunked, length) {
        (true, _) => dechunk(rest)?,
        (false, Some(len)) => {
            if rest.len() < len {
                bail!(
                    "the daemon's answer ({status}) was cut short: {} of {len} body bytes",
                    rest.len()
                );
            }
            if rest.len() > len {
                bail!("the daemon's answer ({status}) runs past its Content-Length");
            }
            rest.to_vec()
        }
        (false, None) if no_body && rest.is_empty() => Vec::new(),
        (false, None) => bail!(
            "the daemon's answer ({status}) has neither Content-Length nor chunked encoding, so \
             whether it is complete cannot be told"
        ),
    };
    let retry = status == 503 && retry_after;
    if body.is_empty() {
        return Ok((status, Value::Null, retry));
    }
    let value = serde_json::from_slice(&body).with_context(|| {
        format!(
            "the daemon's answer ({status}) is not JSON: {}",
            crate::escape::text(&String::from_utf8_lossy(&body))
        )
    })?;
    Ok((status, value, retry))
}

/// The body of a chunked answer, which must run through its last (empty) chunk.
fn dechunk(mut rest: &[u8]) -> Result<Vec<u8>> {
    let cut = || anyhow!("the daemon's chunked answer was cut short");
    let mut body = Vec::new();
    loop {
        let eol = rest.windows(2).position(|w| w == b"\r\n").ok_or_else(cut)?;
        let size = std::str::from_utf8(&rest[..eol])
            .ok()
            .map(|l| l.split(';').next().unwrap_or_default().trim())
            .and_then(|h| usize::from_str_radix(h, 16).ok())
            .context("the daemon's chunked answer has a bad chunk size")?;
        rest = &rest[eol + 2..];
        if size == 0 {
            // Trailers (ignored) end with an empty line.
            if rest.starts_with(b"\r\n") || rest.windows(4).any(|w| w == b"\r\n\r\n") {
                return Ok(body);
            }
            return Err(cut());
        }
        let chunk = rest.get(..size).ok_or_else(cut)?;
        body.extend_from_slice(chunk);
        rest = rest[size..].strip_prefix(b"\r\n").ok_or_else(cut)?;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn responses_parse_with_and_without_bodies() {
        let r = b"HTTP/1.1 201 Created\r\ncontent-type: application/json\r\ncontent-length: 8\r\n\r\n{\"a\": 1}";
        assert_eq!(
            parse_response(r).unwrap(),
            (201, serde_json::json!({"a": 1}), false)
        );
        let r = b"HTTP/1.1 204 No Content\r\n\r\n";
        assert_eq!(parse_response(r).unwrap(), (204, Value::Null, false));
        let r = b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n3\r\n{\"a\r\n5;x=y\r\n\": 1}\r\n0\r\n\r\n";
        assert_eq!(
            parse_response(r).unwrap(),
            (200, serde_json::json!({"a": 1}), false)
        );
        let r =
            b"HTTP/1.1 503 Service Unavailable\r\nretry-after: 1\r\ncontent-length: 2\r\n\r\n{}";
        assert_eq!(
            parse_response(r).unwrap(),
            (503, serde_json::json!({}), true)
        );
        assert!(parse_response(b"garbage").is_err());
    }

    /// An answer cut anywhere before its end is an error, never a success with less.
    #[test]
    fn truncated_answers_are_errors() {
        let full: &[u8] = b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: 12\r\n\r\n{\"ok\": true}";
        assert!(parse_response(full).is_ok());
        for cut in 0..full.len() {
            assert!(parse_response(&full[..cut]).is_err(), "cut at {cut}");
        }
        let chunked: &[u8] = b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n4\r\n{\"a\"\r\n3\r\n: 1\r\n1\r\n}\r\n0\r\n\r\n";
        assert!(parse_response(chunked).is_ok());
        for cut in 0..chunked.len() {
            assert!(parse_response(&chunked[..cut]).is_err(), "cut at {cut}");
        }
        // Without framing a close cannot be told from a cut.
        let unframed = b"HTTP/1.1 200 OK\r\n\r\n{\"ok\": true}";
        let e = parse_response(unframed).unwrap_err();
        assert!(
            e.to_string().contains("neither Content-Length nor chunked"),
            "{e}"
        );
    }

    #[test]
    fn retry_waits_double_up_to_a_bound() {
        let waits: Vec<_> = (0..MAX_RETRIES).map(retry_wait).collect();
        assert_eq!(waits[0], Duration::from_millis(100));
        assert_eq!(waits[1], Duration::from_millis(200));
        assert_eq!(waits[5], Duration::from_secs(2));
        assert!(waits.iter().sum::<Duration>() <= Duration::from_millis(15_100));
        assert_eq!(retry_wait(u32::MAX), Duration::from_secs(2));
    }

    #[test]
    fn a_missing_socket_says_what_to_check() {
        let e = Client::new("/nonexistent/sluice.sock")
            .request("GET", "/v1/status", None)
            .unwrap_err();
        assert_eq!(
            e.to_string(),
            "cannot connect to /nonexistent/sluice.sock: is `sluice run` running? (the socket \
             does not exist; --socket or SLUICE_SOCKET name another)"
        );
    }

    #[test]
    fn path_segments_cannot_escape() {
        assert_eq!(path_segment("fd00::1"), "fd00::1");
        assert_eq!(path_segment("chat/backends"), "chat%2Fbackends");
        assert_eq!(path_segment("a b"), "a%20b");
    }
}
