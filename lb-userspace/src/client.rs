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
}

impl Client {
    pub fn new(socket: impl Into<PathBuf>) -> Self {
        Client {
            socket: socket.into(),
        }
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
            bail!(crate::cli::escape::text(&message).into_owned());
        }
        Ok(value)
    }

    /// Sends raw body bytes (any content, for tests of what the daemon refuses).
    pub fn send(&self, method: &str, path: &str, body: Option<&[u8]>) -> Result<(u16, Value)> {
        let mut stream = self.connect()?;
        stream.set_read_timeout(Some(TIMEOUT))?;
        stream.set_write_timeout(Some(TIMEOUT))?;
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
        if raw.is_empty() {
            sent.with_context(|| format!("sending to {}", self.socket.display()))?;
            read.with_context(|| format!("reading from {}", self.socket.display()))?;
            bail!(
                "the daemon at {} closed the connection without answering",
                self.socket.display()
            );
        }
        parse_response(&raw)
    }

    fn connect(&self) -> Result<UnixStream> {
        UnixStream::connect(&self.socket).map_err(|e| {
            let path = self.socket.display();
            match e.kind() {
                io::ErrorKind::NotFound => anyhow!(
                    "cannot connect to {path}: is `sluice run` running? (the socket does not exist; \
                     --socket or SLUICE_SOCKET name another)"
                ),
                io::ErrorKind::ConnectionRefused => anyhow!(
                    "cannot connect to {path}: is `sluice run` running? (nothing listens on the socket)"
                ),
                io::ErrorKind::PermissionDenied => anyhow!(
                    "cannot connect to {path}: permission denied ({}); run as root or as a member of its group",
                    describe_socket(&self.socket)
                ),
                _ => anyhow!("cannot connect to {path}: {e}"),
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

fn parse_response(raw: &[u8]) -> Result<(u16, Value)> {
    let end = raw
        .windows(4)
        .position(|w| w == b"\r\n\r\n")
        .context("the daemon's answer is not HTTP (no end of headers)")?;
    let head = std::str::from_utf8(&raw[..end]).context("the daemon's headers are not UTF-8")?;
    let mut lines = head.split("\r\n");
    let status_line = lines.next().unwrap_or_default();
    let status: u16 = status_line
        .split(' ')
        .nth(1)
        .and_then(|s| s.parse().ok())
        .with_context(|| format!("the daemon's status line {status_line:?} is not HTTP"))?;
    let mut body = &raw[end + 4..];
    for line in lines {
        let Some((name, value)) = line.split_once(':') else {
            continue;
        };
        let value = value.trim();
        if name.eq_ignore_ascii_case("content-length") {
            let len: usize = value
                .parse()
                .context("bad Content-Length from the daemon")?;
            body = body
                .get(..len)
                .context("the daemon's answer was cut short")?;
        } else if name.eq_ignore_ascii_case("transfer-encoding") {
            bail!(
                "the daemon answered with Transfer-Encoding {}, which this client does not read",
                crate::cli::escape::text(value)
            );
        }
    }
    if body.is_empty() {
        return Ok((status, Value::Null));
    }
    let value = serde_json::from_slice(body).with_context(|| {
        format!(
            "the daemon's answer ({status}) is not JSON: {}",
            String::from_utf8_lossy(body)
        )
    })?;
    Ok((status, value))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn responses_parse_with_and_without_bodies() {
        let r = b"HTTP/1.1 201 Created\r\ncontent-type: application/json\r\ncontent-length: 8\r\n\r\n{\"a\": 1}";
        assert_eq!(
            parse_response(r).unwrap(),
            (201, serde_json::json!({"a": 1}))
        );
        let r = b"HTTP/1.1 204 No Content\r\n\r\n";
        assert_eq!(parse_response(r).unwrap(), (204, Value::Null));
        assert!(parse_response(b"garbage").is_err());
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
