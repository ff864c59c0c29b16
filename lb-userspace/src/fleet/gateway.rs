//! etcd's v3 JSON gateway (`/v3/kv/*`, `/v3/lease/*`, `/v3/watch`) over plain HTTP/1.1 with
//! the hyper client the daemon already has: no gRPC stack, no protoc at build time (see
//! docs/design.md). Keys and values are base64 in JSON; 64-bit integers are strings.

use std::time::Duration;

use http_body_util::{BodyExt, Full};
use hyper::{body::Bytes, client::conn::http1, header, Request, StatusCode};
use hyper_util::rt::TokioIo;
use serde_json::{json, Value};
use tokio::{net::TcpStream, sync::mpsc};

use super::store::{Kv, Range, Store, StoreError, Watch, WatchEvent};
use crate::config::HttpUrl;

/// Largest unary answer read (etcd's own request limit is 1.5 MiB; base64 adds a third).
const MAX_ANSWER: usize = 4 << 20;

pub struct Gateway {
    endpoints: Vec<HttpUrl>,
    timeout: Duration,
}

impl Gateway {
    pub fn new(endpoints: &[HttpUrl], timeout: Duration) -> Gateway {
        Gateway {
            endpoints: endpoints.to_vec(),
            timeout,
        }
    }

    /// POSTs `body` to the first endpoint that answers; the response's JSON.
    async fn call(&self, path: &str, body: Value) -> Result<Value, StoreError> {
        let mut why = vec![];
        for url in &self.endpoints {
            let exchange = async {
                let response = send(url, path, &body).await?;
                let status = response.status();
                let bytes = http_body_util::Limited::new(response.into_body(), MAX_ANSWER)
                    .collect()
                    .await
                    .map_err(|e| StoreError::Unreachable(format!("reading the answer: {e}")))?
                    .to_bytes();
                let v: Value = serde_json::from_slice(&bytes).map_err(|e| {
                    StoreError::Refused(format!("{path}: answer is not JSON ({e})"))
                })?;
                if status != StatusCode::OK {
                    return Err(answer_error(&v, status));
                }
                Ok(v)
            };
            match tokio::time::timeout(self.timeout, exchange).await {
                Ok(Ok(v)) => return Ok(v),
                // etcd answered: another member would say the same.
                Ok(Err(e @ StoreError::Refused(_))) => return Err(e),
                Ok(Err(StoreError::Unreachable(e))) => why.push(format!("{}: {e}", url.authority)),
                Err(_) => why.push(format!(
                    "{}: no answer within {:?}",
                    url.authority, self.timeout
                )),
            }
        }
        Err(StoreError::Unreachable(why.join("; ")))
    }
}

fn answer_error(v: &Value, status: StatusCode) -> StoreError {
    let msg = v
        .get("message")
        .or_else(|| v.get("error"))
        .and_then(Value::as_str)
        .unwrap_or("no message");
    // A member without a leader (partitioned, or the cluster lost quorum) is as good as
    // unreachable for writes; another member may have one.
    if msg.contains("no leader") || msg.contains("timed out") || status.is_server_error() {
        StoreError::Unreachable(format!("HTTP {status}: {msg}"))
    } else {
        StoreError::Refused(format!("HTTP {status}: {msg}"))
    }
}

async fn send(
    url: &HttpUrl,
    path: &str,
    body: &Value,
) -> Result<hyper::Response<hyper::body::Incoming>, StoreError> {
    let unreachable = |e: String| StoreError::Unreachable(e);
    let stream = TcpStream::connect((url.host.as_str(), url.port))
        .await
        .map_err(|e| unreachable(format!("connect: {e}")))?;
    stream
        .set_nodelay(true)
        .map_err(|e| unreachable(format!("connect: {e}")))?;
    let (mut sender, conn) = http1::handshake(TokioIo::new(stream))
        .await
        .map_err(|e| unreachable(format!("handshake: {e}")))?;
    // The connection ends with the response body (one request per connection: the fleet's
    // request rate is a few per second per host).
    tokio::spawn(async move {
        let _ = conn.await;
    });
    let request = Request::post(path)
        .header(header::HOST, &url.authority)
        .header(header::CONTENT_TYPE, "application/json")
        .body(Full::new(Bytes::from(body.to_string())))
        .map_err(|e| StoreError::Refused(format!("bad request: {e}")))?;
    sender
        .send_request(request)
        .await
        .map_err(|e| unreachable(format!("request: {e}")))
}

const B64: &[u8; 64] = b"ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/";

pub fn b64(data: &[u8]) -> String {
    let mut out = String::with_capacity(data.len().div_ceil(3) * 4);
    for c in data.chunks(3) {
        let n = (u32::from(c[0]) << 16)
            | (u32::from(*c.get(1).unwrap_or(&0)) << 8)
            | u32::from(*c.get(2).unwrap_or(&0));
        for i in 0..4 {
            if i <= c.len() {
                out.push(B64[(n >> (18 - 6 * i)) as usize & 63] as char);
            } else {
                out.push('=');
            }
        }
    }
    out
}

pub fn unb64(s: &str) -> Result<Vec<u8>, String> {
    let mut out = Vec::with_capacity(s.len() / 4 * 3);
    let (mut acc, mut bits) = (0u32, 0);
    for ch in s.bytes().filter(|&b| b != b'=') {
        let v = B64
            .iter()
            .position(|&b| b == ch)
            .ok_or_else(|| format!("{ch:?} is not base64"))? as u32;
        acc = (acc << 6) | v;
        bits += 6;
        if bits >= 8 {
            bits -= 8;
            out.push((acc >> bits) as u8);
        }
    }
    Ok(out)
}

/// The key after every key starting with `prefix`.
fn range_end(prefix: &str) -> Vec<u8> {
    let mut end = prefix.as_bytes().to_vec();
    while let Some(last) = end.pop() {
        if last < 0xff {
            end.push(last + 1);
            return end;
        }
    }
    vec![0]
}

fn int(v: &Value, field: &str) -> i64 {
    match v.get(field) {
        Some(Value::String(s)) => s.parse().unwrap_or(0),
        Some(Value::Number(n)) => n.as_i64().unwrap_or(0),
        _ => 0,
    }
}

fn kv(v: &Value) -> Result<Kv, StoreError> {
    let field = |f: &str| {
        unb64(v.get(f).and_then(Value::as_str).unwrap_or_default())
            .map_err(|e| StoreError::Refused(format!("kv.{f}: {e}")))
    };
    Ok(Kv {
        key: String::from_utf8(field("key")?)
            .map_err(|_| StoreError::Refused("a key is not UTF-8".into()))?,
        value: field("value")?,
        mod_revision: int(v, "mod_revision"),
    })
}

fn events(result: &Value) -> Result<Vec<WatchEvent>, StoreError> {
    let Some(evs) = result.get("events").and_then(Value::as_array) else {
        return Ok(vec![]);
    };
    evs.iter()
        .map(|e| {
            let kv = kv(e.get("kv").unwrap_or(&Value::Null))?;
            Ok(match e.get("type").and_then(Value::as_str) {
                Some("DELETE") => WatchEvent::Delete {
                    key: kv.key,
                    mod_revision: kv.mod_revision,
                },
                _ => WatchEvent::Put(kv),
            })
        })
        .collect()
}

impl Store for Gateway {
    async fn list(&self, prefix: &str) -> Result<Range, StoreError> {
        let v = self
            .call(
                "/v3/kv/range",
                json!({"key": b64(prefix.as_bytes()), "range_end": b64(&range_end(prefix))}),
            )
            .await?;
        let kvs = v
            .get("kvs")
            .and_then(Value::as_array)
            .map(|a| a.iter().map(kv).collect::<Result<Vec<_>, _>>())
            .transpose()?
            .unwrap_or_default();
        Ok(Range {
            kvs,
            revision: int(v.get("header").unwrap_or(&Value::Null), "revision"),
        })
    }

    async fn put_if(
        &self,
        key: &str,
        value: Vec<u8>,
        mod_revision: i64,
        lease: i64,
    ) -> Result<bool, StoreError> {
        let k = b64(key.as_bytes());
        let v = self
            .call(
                "/v3/kv/txn",
                json!({
                    "compare": [{"key": k, "target": "MOD", "result": "EQUAL",
                                 "mod_revision": mod_revision.to_string()}],
                    "success": [{"request_put": {"key": k, "value": b64(&value),
                                                 "lease": lease.to_string()}}],
                }),
            )
            .await?;
        Ok(v.get("succeeded").and_then(Value::as_bool).unwrap_or(false))
    }

    async fn put(&self, key: &str, value: Vec<u8>, lease: i64) -> Result<(), StoreError> {
        self.call(
            "/v3/kv/put",
            json!({"key": b64(key.as_bytes()), "value": b64(&value), "lease": lease.to_string()}),
        )
        .await
        .map(drop)
    }

    async fn grant(&self, ttl_s: i64) -> Result<i64, StoreError> {
        let v = self
            .call("/v3/lease/grant", json!({"TTL": ttl_s.to_string()}))
            .await?;
        match int(&v, "ID") {
            0 => Err(StoreError::Refused(format!("lease grant answered {v}"))),
            id => Ok(id),
        }
    }

    async fn keep_alive(&self, lease: i64) -> Result<bool, StoreError> {
        // A streaming call: the gateway answers one line per request sent.
        let v = self
            .call("/v3/lease/keepalive", json!({"ID": lease.to_string()}))
            .await?;
        Ok(int(v.get("result").unwrap_or(&Value::Null), "TTL") > 0)
    }

    async fn watch(&self, prefix: &str, after: i64) -> Result<Watch, StoreError> {
        let body = json!({"create_request": {
            "key": b64(prefix.as_bytes()),
            "range_end": b64(&range_end(prefix)),
            "start_revision": (after + 1).to_string(),
        }});
        let mut why = vec![];
        for url in &self.endpoints {
            let response =
                match tokio::time::timeout(self.timeout, send(url, "/v3/watch", &body)).await {
                    Ok(Ok(r)) if r.status() == StatusCode::OK => r,
                    Ok(Ok(r)) => {
                        why.push(format!("{}: HTTP {}", url.authority, r.status()));
                        continue;
                    }
                    Ok(Err(e)) => {
                        why.push(format!("{}: {e}", url.authority));
                        continue;
                    }
                    Err(_) => {
                        why.push(format!(
                            "{}: no answer within {:?}",
                            url.authority, self.timeout
                        ));
                        continue;
                    }
                };
            let (tx, rx) = mpsc::channel(64);
            let authority = url.authority.clone();
            tokio::spawn(async move {
                let mut body = response.into_body();
                let mut buf: Vec<u8> = vec![];
                loop {
                    let frame = match body.frame().await {
                        Some(Ok(f)) => f,
                        Some(Err(e)) => {
                            let _ = tx
                                .send(Err(StoreError::Unreachable(format!(
                                    "{authority}: watch stream: {e}"
                                ))))
                                .await;
                            return;
                        }
                        None => {
                            let _ = tx
                                .send(Err(StoreError::Unreachable(format!(
                                    "{authority}: watch stream ended"
                                ))))
                                .await;
                            return;
                        }
                    };
                    let Ok(data) = frame.into_data() else {
                        continue;
                    };
                    buf.extend_from_slice(&data);
                    while let Some(nl) = buf.iter().position(|&b| b == b'\n') {
                        let line: Vec<u8> = buf.drain(..=nl).collect();
                        let parsed = serde_json::from_slice::<Value>(&line)
                            .map_err(|e| StoreError::Refused(format!("watch line: {e}")))
                            .and_then(|v| match v.get("result") {
                                Some(r)
                                    if r.get("canceled").and_then(Value::as_bool) == Some(true) =>
                                {
                                    Err(StoreError::Refused(format!("watch canceled: {r}")))
                                }
                                Some(r) => events(r),
                                None => Err(answer_error(&v, StatusCode::OK)),
                            });
                        let end = parsed.is_err();
                        if tx.send(parsed).await.is_err() || end {
                            return;
                        }
                    }
                }
            });
            return Ok(rx);
        }
        Err(StoreError::Unreachable(why.join("; ")))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn base64_round_trip() {
        for s in ["", "a", "ab", "abc", "abcd", "/sluice/tables"] {
            assert_eq!(unb64(&b64(s.as_bytes())).unwrap(), s.as_bytes());
        }
        assert_eq!(b64(b"/sluice/"), "L3NsdWljZS8=");
        assert_eq!(range_end("/sluice/"), b"/sluice0");
    }
}
