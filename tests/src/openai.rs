//! A blocking client for one OpenAI-style streaming completion (`POST /v1/chat/completions`
//! with `"stream": true`), as the demo's stream slots use it: it connects from a namespace,
//! reads the answer's `x-sluice-backend` header, then one server-sent event per token until
//! `data: [DONE]`, timing the first token. (The load generator, `sluice-bench tokens`, has its
//! own asynchronous client for many streams at once.)

use std::{
    io::{Read, Write},
    net::{SocketAddr, TcpStream},
    time::{Duration, Instant},
};

use anyhow::{anyhow, bail, Context, Result};

use crate::netns::Netns;

/// The header that names the accelerator that answered.
pub const BACKEND_HEADER: &str = "x-sluice-backend";

/// What [`ChatStream::next_event`] read.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Event {
    Token,
    Done,
}

/// One streaming completion being read.
pub struct ChatStream {
    sock: TcpStream,
    /// The accelerator that answered.
    pub backend: String,
    /// From the request to the first token.
    pub ttft: Option<Duration>,
    /// Tokens (content events) received so far.
    pub tokens: u32,
    started: Instant,
    /// Bytes read and not yet de-chunked.
    raw: Vec<u8>,
    chunked: bool,
    /// De-chunked body bytes not yet split into events.
    body: Vec<u8>,
}

impl ChatStream {
    /// Connects from `ns` to `addr`, asks for `max_tokens` tokens after a `prompt_tokens`
    /// prompt, and reads the answer's head. `timeout` bounds the connect and every read.
    pub fn open(
        ns: &Netns,
        addr: SocketAddr,
        prompt_tokens: u32,
        max_tokens: u32,
        timeout: Duration,
    ) -> Result<ChatStream> {
        let sock = ns
            .run(move || TcpStream::connect_timeout(&addr, timeout))?
            .with_context(|| format!("connecting to {addr}"))?;
        sock.set_read_timeout(Some(timeout))?;
        sock.set_nodelay(true)?;
        let body = format!(
            "{{\"model\":\"sluice-sim\",\"messages\":[{{\"role\":\"user\",\"content\":\"demo\"}}],\
             \"prompt_tokens\":{prompt_tokens},\"max_tokens\":{max_tokens},\"stream\":true}}"
        );
        let req = format!(
            "POST /v1/chat/completions HTTP/1.1\r\nHost: {addr}\r\nContent-Type: application/json\r\n\
             Content-Length: {}\r\nConnection: close\r\n\r\n{body}",
            body.len()
        );
        let started = Instant::now();
        let mut s = ChatStream {
            sock,
            backend: String::new(),
            ttft: None,
            tokens: 0,
            started,
            raw: Vec::new(),
            chunked: false,
            body: Vec::new(),
        };
        s.sock.write_all(req.as_bytes())?;
        let head = loop {
            if let Some(end) = find(&s.raw, b"\r\n\r\n") {
                let head = String::from_utf8_lossy(&s.raw[..end]).into_owned();
                s.raw.drain(..end + 4);
                break head;
            }
            if s.fill()? == 0 {
                bail!("the connection closed before the answer's headers");
            }
        };
        let mut lines = head.lines();
        let status = lines.next().unwrap_or("");
        if status.split_whitespace().nth(1) != Some("200") {
            bail!("the answer is {status:?}, not 200");
        }
        for l in lines {
            let Some((k, v)) = l.split_once(':') else {
                continue;
            };
            let (k, v) = (k.trim().to_ascii_lowercase(), v.trim());
            if k == BACKEND_HEADER {
                s.backend = v.to_owned();
            } else if k == "transfer-encoding" && v.eq_ignore_ascii_case("chunked") {
                s.chunked = true;
            }
        }
        if s.backend.is_empty() {
            bail!("the answer has no {BACKEND_HEADER} header");
        }
        Ok(s)
    }

    /// Reads more bytes into `raw`; 0 at the end of the connection.
    fn fill(&mut self) -> Result<usize> {
        let mut buf = [0u8; 4096];
        let n = self.sock.read(&mut buf).context("reading the stream")?;
        self.raw.extend_from_slice(&buf[..n]);
        Ok(n)
    }

    /// Moves complete chunks (or everything, unchunked) from `raw` to `body`.
    fn dechunk(&mut self) -> Result<()> {
        if !self.chunked {
            self.body.append(&mut self.raw);
            return Ok(());
        }
        while let Some(eol) = find(&self.raw, b"\r\n") {
            let size = std::str::from_utf8(&self.raw[..eol])
                .ok()
                .and_then(|s| usize::from_str_radix(s.split(';').next()?.trim(), 16).ok())
                .ok_or_else(|| anyhow!("bad chunk size line"))?;
            if self.raw.len() < eol + 2 + size + 2 {
                break;
            }
            self.body
                .extend_from_slice(&self.raw[eol + 2..eol + 2 + size]);
            self.raw.drain(..eol + 2 + size + 2);
        }
        Ok(())
    }

    /// The next event: a token, or the end (`data: [DONE]`). Fails on a closed connection
    /// without `[DONE]`, a reset or a read timeout.
    pub fn next_event(&mut self) -> Result<Event> {
        loop {
            self.dechunk()?;
            if let Some(end) = find(&self.body, b"\n\n") {
                let ev = String::from_utf8_lossy(&self.body[..end]).into_owned();
                self.body.drain(..end + 2);
                let data = ev.trim().strip_prefix("data:").map(str::trim).unwrap_or("");
                if data == "[DONE]" {
                    return Ok(Event::Done);
                }
                if data.contains("\"choices\"") {
                    self.tokens += 1;
                    self.ttft.get_or_insert_with(|| self.started.elapsed());
                    return Ok(Event::Token);
                }
                continue;
            }
            if self.fill()? == 0 {
                bail!(
                    "the stream from {} ended without [DONE] after {} tokens",
                    self.backend,
                    self.tokens
                );
            }
        }
    }
}

fn find(hay: &[u8], needle: &[u8]) -> Option<usize> {
    hay.windows(needle.len()).position(|w| w == needle)
}
