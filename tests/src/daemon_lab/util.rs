//! Helpers of the lab and its tests: polling, counting, plain HTTP, files, log text.

use std::{
    collections::BTreeMap,
    fs,
    io::{Read, Write},
    net::{SocketAddr, TcpStream},
    path::Path,
    thread,
    time::{Duration, Instant},
};

use anyhow::{anyhow, bail, Context, Result};

/// Polls `f` until it returns `Some`, at most `timeout`; fails naming `what` and the last
/// state `f` reported.
pub fn wait_for<T>(
    what: &str,
    timeout: Duration,
    mut f: impl FnMut() -> Result<Option<T>, String>,
) -> Result<T> {
    let deadline = Instant::now() + timeout;
    let mut last = String::new();
    loop {
        match f() {
            Ok(Some(v)) => return Ok(v),
            Ok(None) => {}
            Err(state) => last = state,
        }
        if Instant::now() >= deadline {
            bail!("{what}: not within {timeout:?}; last seen: {last}");
        }
        thread::sleep(Duration::from_millis(100));
    }
}

/// Counts of each distinct value.
pub fn tally<'a>(names: impl IntoIterator<Item = &'a String>) -> BTreeMap<String, usize> {
    let mut m = BTreeMap::new();
    for n in names {
        *m.entry(n.clone()).or_default() += 1;
    }
    m
}

/// Sends `req` (a whole HTTP/1.1 request with `Connection: close`) to `addr` and reads the
/// answer: (status, body), the body de-chunked.
pub fn http_exchange(addr: SocketAddr, req: &str, timeout: Duration) -> Result<(u16, String)> {
    let mut s = TcpStream::connect_timeout(&addr, timeout)?;
    s.set_read_timeout(Some(timeout))?;
    s.write_all(req.as_bytes())?;
    let mut raw = Vec::new();
    s.read_to_end(&mut raw)?;
    let text = String::from_utf8_lossy(&raw);
    let (head, body) = text
        .split_once("\r\n\r\n")
        .ok_or_else(|| anyhow!("no end of headers in {} bytes", raw.len()))?;
    let status = head
        .split_whitespace()
        .nth(1)
        .and_then(|c| c.parse().ok())
        .ok_or_else(|| anyhow!("bad status line: {}", head.lines().next().unwrap_or("")))?;
    let chunked = head
        .to_ascii_lowercase()
        .contains("transfer-encoding: chunked");
    Ok((status, if chunked { dechunk(body) } else { body.into() }))
}

/// The data of a chunked body (sizes in hex, each chunk followed by CRLF).
fn dechunk(mut body: &str) -> String {
    let mut out = String::new();
    while let Some((size, rest)) = body.split_once("\r\n") {
        let n = usize::from_str_radix(size.split(';').next().unwrap_or("").trim(), 16).unwrap_or(0);
        if n == 0 || rest.len() < n {
            break;
        }
        out.push_str(&rest[..n]);
        body = rest[n..].trim_start_matches("\r\n");
    }
    out
}

/// Writes `path` through a temporary file and a rename, so no reader sees half of it.
pub fn write_atomic(path: &Path, text: &str) -> Result<()> {
    let tmp = path.with_extension("tmp");
    fs::write(&tmp, text).with_context(|| format!("writing {}", tmp.display()))?;
    fs::rename(&tmp, path).with_context(|| format!("renaming to {}", path.display()))?;
    Ok(())
}

/// The last `n` lines of `text`.
pub fn tail(text: &str, n: usize) -> String {
    let lines: Vec<&str> = text.lines().collect();
    lines[lines.len().saturating_sub(n)..].join("\n")
}

pub(super) fn strip_ansi(s: &str) -> String {
    let mut out = String::with_capacity(s.len());
    let mut chars = s.chars();
    while let Some(c) = chars.next() {
        if c == '\u{1b}' {
            // CSI: ESC [ ... final byte in @..~
            if chars.next() == Some('[') {
                for c in chars.by_ref() {
                    if ('@'..='~').contains(&c) {
                        break;
                    }
                }
            }
            continue;
        }
        out.push(c);
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn chunked_bodies_are_joined() {
        assert_eq!(
            dechunk("4\r\n{\"a\"\r\n3\r\n: 1\r\n1\r\n}\r\n0\r\n\r\n"),
            "{\"a\": 1}"
        );
    }

    #[test]
    fn ansi_codes_are_stripped() {
        assert_eq!(
            strip_ansi("\u{1b}[2m2026\u{1b}[0m \u{1b}[32m INFO\u{1b}[0m ready"),
            "2026  INFO ready"
        );
    }
}
