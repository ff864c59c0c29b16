//! `GET /v1/conns?vip=NAME&backend=ADDR&limit=N`: connection-table entries (client, VIP,
//! backend, idle time), filtered and bounded, as `sluice flows` lists them.

use std::{
    collections::{BTreeMap, BTreeSet},
    net::{IpAddr, SocketAddr},
};

use serde_json::{json, Value};
use tokio::sync::Mutex;

use super::{decode_segment, path_addr, ApiError};
use crate::{
    addr::from_words,
    controller::{Controller, FlowEntry, Plane},
};

pub(super) const DEFAULT_LIMIT: usize = 100;
/// The most entries one request returns (a JSON body stays a few MB).
pub(super) const MAX_LIMIT: usize = 100_000;

#[derive(Debug, Default, PartialEq, Eq)]
pub(super) struct ConnQuery {
    pub vip: Option<String>,
    pub backend: Option<IpAddr>,
    pub limit: usize,
}

impl ConnQuery {
    pub(super) fn parse(query: Option<&str>) -> Result<ConnQuery, ApiError> {
        let mut q = ConnQuery {
            limit: DEFAULT_LIMIT,
            ..Default::default()
        };
        for pair in query
            .unwrap_or_default()
            .split('&')
            .filter(|p| !p.is_empty())
        {
            let (k, v) = pair.split_once('=').unwrap_or((pair, ""));
            let v = decode_segment(v)?;
            match k {
                "vip" => q.vip = Some(v),
                "backend" => q.backend = Some(path_addr(&v)?),
                "limit" => {
                    q.limit = v
                        .parse()
                        .ok()
                        .filter(|n| (1..=MAX_LIMIT).contains(n))
                        .ok_or_else(|| {
                            ApiError::new(
                                400,
                                format!("limit {v:?} is not a number from 1 to {MAX_LIMIT}"),
                            )
                        })?
                }
                _ => {
                    return Err(ApiError::new(
                        400,
                        format!("unknown parameter {k:?}; /v1/conns takes vip, backend and limit"),
                    ))
                }
            }
        }
        Ok(q)
    }
}

fn proto_name(p: u8) -> Value {
    match p {
        lb_common::PROTO_TCP => json!("tcp"),
        lb_common::PROTO_UDP => json!("udp"),
        n => json!(n),
    }
}

/// Lists the entries matching `q`, at most `q.limit`, in table order. An entry whose backend
/// is no longer configured (it was removed; the entry re-steers on its next packet) shows
/// without a VIP or backend and only when no filter is given.
pub(super) async fn list<P: Plane>(
    ctl: &Mutex<Controller<P>>,
    q: &ConnQuery,
) -> Result<Value, ApiError> {
    let mut ctl = ctl.lock().await;
    let state = ctl.state();
    if let Some(v) = &q.vip {
        state.vip(v)?;
    }
    // Backend id → (VIP name, backend address), for the backends the filter keeps.
    let known: BTreeMap<u32, (String, IpAddr)> = state
        .vips
        .values()
        .flat_map(|v| {
            v.backends
                .values()
                .map(move |b| (b.id, (v.spec.name.clone(), b.spec.address)))
        })
        .collect();
    let wanted: BTreeSet<u32> = known
        .iter()
        .filter(|(_, (v, a))| {
            q.vip.as_ref().is_none_or(|w| w == v) && q.backend.is_none_or(|w| w == *a)
        })
        .map(|(id, _)| *id)
        .collect();
    let filtered = q.vip.is_some() || q.backend.is_some();
    let mut flows = vec![];
    let mut more = false;
    ctl.flow_entries(&mut |e: FlowEntry| {
        if filtered && !wanted.contains(&e.backend) {
            return true;
        }
        if flows.len() == q.limit {
            more = true;
            return false;
        }
        let k = &e.key;
        let client = SocketAddr::new(from_words(k.src, k.family), u16::from_be(k.sport));
        let vip_addr = SocketAddr::new(from_words(k.dst, k.family), u16::from_be(k.dport));
        let (vip, backend) = match known.get(&e.backend) {
            Some((v, a)) => (json!(v), json!(a)),
            None => (Value::Null, Value::Null),
        };
        flows.push(json!({
            "client": client.to_string(),
            "vip": vip,
            "vip_address": vip_addr.to_string(),
            "protocol": proto_name(k.proto),
            "backend": backend,
            "backend_id": e.backend,
            "idle_ms": e.idle.as_millis() as u64,
        }));
        true
    })?;
    Ok(json!({ "flows": flows, "truncated": more }))
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use lb_common::{FlowKey, FAMILY_V4, PROTO_TCP};

    use super::*;
    use crate::{
        addr::to_words,
        admin::testing::TestServer,
        controller::Peer,
        state::{
            testing::{be, vip},
            Op,
        },
    };

    fn entry(client: &str, sport: u16, backend: u32, idle_ms: u64) -> FlowEntry {
        FlowEntry {
            key: FlowKey {
                src: to_words(client.parse().unwrap()).0,
                dst: to_words("10.0.0.1".parse().unwrap()).0,
                sport: sport.to_be(),
                dport: 443u16.to_be(),
                proto: PROTO_TCP,
                family: FAMILY_V4,
                _pad: [0; 2],
            },
            backend,
            idle: Duration::from_millis(idle_ms),
        }
    }

    #[test]
    fn lists_entries_with_filters_and_a_limit() {
        let srv = TestServer::start();
        let (b1, b2) = {
            let mut c = srv.ctl.blocking_lock();
            let op = Op::AddVip {
                vip: vip("chat", "10.0.0.1"),
                backends: vec![be("10.1.0.1"), be("10.1.0.2")],
            };
            c.submit(op, Peer::default(), 1).unwrap();
            let id = |a: &str| c.state().backend("chat", a.parse().unwrap()).unwrap().id;
            let (b1, b2) = (id("10.1.0.1"), id("10.1.0.2"));
            c.plane().entries = vec![
                entry("192.0.2.1", 1000, b1, 1500),
                entry("192.0.2.2", 1001, b2, 20),
                entry("192.0.2.3", 1002, b1, 0),
                // A backend removed since: shown only without filters.
                entry("192.0.2.4", 1003, 999, 5),
            ];
            (b1, b2)
        };
        let c = srv.client();
        let (st, v) = c.request("GET", "/v1/conns", None).unwrap();
        assert_eq!(st, 200);
        assert_eq!(v["truncated"], false);
        assert_eq!(v["flows"].as_array().unwrap().len(), 4);
        assert_eq!(
            v["flows"][0],
            json!({"client": "192.0.2.1:1000", "vip": "chat", "vip_address": "10.0.0.1:443",
                   "protocol": "tcp", "backend": "10.1.0.1", "backend_id": b1, "idle_ms": 1500})
        );
        assert_eq!(v["flows"][3]["backend"], Value::Null);

        let (_, v) = c
            .request("GET", "/v1/conns?backend=10.1.0.1", None)
            .unwrap();
        let clients: Vec<_> = v["flows"]
            .as_array()
            .unwrap()
            .iter()
            .map(|f| f["client"].as_str().unwrap().to_string())
            .collect();
        assert_eq!(clients, ["192.0.2.1:1000", "192.0.2.3:1002"]);

        let (_, v) = c
            .request("GET", "/v1/conns?vip=chat&limit=2", None)
            .unwrap();
        assert_eq!(v["flows"].as_array().unwrap().len(), 2);
        assert_eq!(v["flows"][1]["backend_id"], b2);
        assert_eq!(v["truncated"], true);

        let (st, v) = c.request("GET", "/v1/conns?vip=nope", None).unwrap();
        assert_eq!(st, 404, "{v}");
        let (st, _) = c.request("GET", "/v1/conns?limit=0", None).unwrap();
        assert_eq!(st, 400);
    }

    #[test]
    fn parses_filters_and_refuses_bad_ones() {
        assert_eq!(
            ConnQuery::parse(None).unwrap(),
            ConnQuery {
                limit: DEFAULT_LIMIT,
                ..Default::default()
            }
        );
        assert_eq!(
            ConnQuery::parse(Some("vip=chat&backend=fd00%3A%3A1&limit=5")).unwrap(),
            ConnQuery {
                vip: Some("chat".into()),
                backend: Some("fd00::1".parse().unwrap()),
                limit: 5
            }
        );
        for (q, err) in [
            ("limit=0", "limit \"0\" is not a number from 1 to 100000"),
            ("limit=x", "limit \"x\" is not a number from 1 to 100000"),
            ("backend=gpu0", "\"gpu0\" is not an IP address"),
            (
                "vips=chat",
                "unknown parameter \"vips\"; /v1/conns takes vip, backend and limit",
            ),
        ] {
            let e = ConnQuery::parse(Some(q)).unwrap_err();
            assert_eq!((e.status.as_u16(), e.message.as_str()), (400, err), "{q}");
        }
    }
}
