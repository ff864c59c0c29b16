//! Prometheus metrics over HTTP (`GET /metrics`).
//!
//! The registry is built per scrape from a snapshot taken under the controller lock, so the
//! metrics always describe one consistent state and encoding never holds the lock.

use std::{
    convert::Infallible,
    future::Future,
    net::{IpAddr, SocketAddr},
    sync::{atomic::AtomicU64, Arc},
};

use anyhow::{Context, Result};
use http_body_util::Full;
use hyper::{body::Bytes, header, service::service_fn, Method, Request, Response, StatusCode};
use lb_common::stat;
use prometheus_client::{
    encoding::prometheus_text,
    metrics::{gauge::Gauge, info::Info},
    registry::{Registry, Unit},
};
use tokio::{net::TcpListener, sync::Mutex};

use crate::{
    admin::{DaemonInfo, Snapshot, TenantRow},
    controller::{Controller, Plane},
    http_server::{serve_connections, serve_http, within},
    limits::{ScrapePeer, METRICS},
    policy::BackendDecision,
    prom_text::{counters, dataplane_counters, float_gauges, gauges, Labels},
    state::{Backend, FlowState, PlaneState, QuicMode, Vip},
};

/// Binds the metrics address; done at start, before anything is served, so a port in use
/// stops the start (and rolls back the data plane) instead of failing later in a task.
pub fn bind(addr: SocketAddr) -> Result<TcpListener> {
    let std = std::net::TcpListener::bind(addr).with_context(|| {
        format!("binding the metrics address {addr}: is it in use, or not an address of this host?")
    })?;
    std.set_nonblocking(true)?;
    Ok(TcpListener::from_std(std)?)
}

/// Serves `GET /metrics` on `listener` (from [`bind`]) until `shutdown` completes.
pub async fn serve<P: Plane + 'static>(
    listener: TcpListener,
    ctl: Arc<Mutex<Controller<P>>>,
    info: Arc<DaemonInfo>,
    shutdown: impl Future<Output = ()>,
) -> Result<()> {
    let refused = Arc::clone(&info.refused);
    serve_page(
        listener,
        &refused.metrics,
        move || {
            let (ctl, info) = (Arc::clone(&ctl), Arc::clone(&info));
            async move { Ok(render(&Snapshot::take(&ctl).await?, &info)) }
        },
        shutdown,
    )
    .await
}

/// Serves the exposition text `page` makes, fresh per scrape, as `GET /metrics` on
/// `listener` until `shutdown` completes (the LB daemon's and the backend host's endpoint),
/// within the metrics listener's limits; connections over them are counted in `refused`.
pub(crate) async fn serve_page<F, Fut>(
    listener: TcpListener,
    refused: &AtomicU64,
    page: F,
    shutdown: impl Future<Output = ()>,
) -> Result<()>
where
    F: Fn() -> Fut + Clone + Send + Sync + 'static,
    Fut: Future<Output = Result<String>> + Send,
{
    let limits = METRICS;
    let (listener, page) = (&listener, &page);
    serve_connections(
        limits,
        refused,
        "metrics",
        move || async move {
            let (stream, peer) = listener.accept().await?;
            // Without its local address (never seen on a connected socket) the peer is
            // still counted by its own.
            let local = stream
                .local_addr()
                .map_or(IpAddr::from([0, 0, 0, 0]), |a| a.ip());
            Ok(Some((ScrapePeer::of(peer.ip(), local), stream, ())))
        },
        move |(), stream| {
            let page = page.clone();
            let service = service_fn(move |req| {
                let page = page.clone();
                async move {
                    Ok::<_, Infallible>(within(limits.request_timeout, respond(req, page)).await)
                }
            });
            serve_http(stream, service, limits)
        },
        shutdown,
    )
    .await;
    Ok(())
}

async fn respond<F, Fut, B>(req: Request<B>, page: F) -> Response<Full<Bytes>>
where
    F: Fn() -> Fut,
    Fut: Future<Output = Result<String>>,
{
    if req.uri().path() != "/metrics" {
        return text(
            StatusCode::NOT_FOUND,
            "not found; metrics are at /metrics\n".into(),
        );
    }
    if req.method() != Method::GET {
        let mut r = text(StatusCode::METHOD_NOT_ALLOWED, "use GET\n".into());
        r.headers_mut()
            .insert(header::ALLOW, header::HeaderValue::from_static("GET"));
        return r;
    }
    match page().await {
        Ok(body) => {
            let mut r = text(StatusCode::OK, body);
            r.headers_mut().insert(
                header::CONTENT_TYPE,
                header::HeaderValue::from_static(prometheus_text::CONTENT_TYPE),
            );
            r
        }
        Err(e) => text(StatusCode::INTERNAL_SERVER_ERROR, format!("{e:#}\n")),
    }
}

fn text(status: StatusCode, body: String) -> Response<Full<Bytes>> {
    let mut r = Response::new(Full::new(Bytes::from(body)));
    *r.status_mut() = status;
    r
}

/// The exposition text of `snap`: the families in the order a scrape lists them.
pub(crate) fn render(snap: &Snapshot, info: &DaemonInfo) -> String {
    let mut reg = Registry::with_prefix("sluice");
    listener_families(&mut reg, info);
    vip_families(&mut reg, snap);
    backend_families(&mut reg, snap);
    quic_families(&mut reg, snap);
    steering_families(&mut reg, snap);
    tenant_families(&mut reg, snap);
    map_families(&mut reg, snap);
    event_families(&mut reg, snap);
    daemon_families(&mut reg, snap, info);

    let mut out = String::new();
    prometheus_text::encode(&mut out, &reg).expect("writing to a String cannot fail");
    out
}

/// A traffic counter of a VIP or backend, for the families that export one each.
type Field = fn(crate::controller::Traffic) -> u64;

fn vip_labels(v: &Vip) -> Labels {
    vec![("vip", v.spec.name.clone())]
}

/// Each backend of each VIP with its `{vip, backend}` labels.
fn backends(snap: &Snapshot) -> impl Iterator<Item = (&Backend, Labels)> {
    snap.state.vips.values().flat_map(|v| {
        v.backends.values().map(move |b| {
            (
                b,
                vec![
                    ("vip", v.spec.name.clone()),
                    ("backend", b.spec.address.to_string()),
                ],
            )
        })
    })
}

/// Connections each listener refused at its caps.
fn listener_families(reg: &mut Registry, info: &DaemonInfo) {
    let (admin, metrics) = info.refused.get();
    counters(
        reg,
        "listener_refused_connections",
        "Connections answered 503 and closed at once because the listener or the peer was at its cap",
        vec![
            (vec![("listener", "admin".into())], admin),
            (vec![("listener", "metrics".into())], metrics),
        ],
    );
}

/// Traffic per VIP and where each VIP keeps its flow state.
fn vip_families(reg: &mut Registry, snap: &Snapshot) {
    let vips = || snap.state.vips.values();
    let per_vip = |f: Field| {
        vips()
            .map(|v| (vip_labels(v), f(snap.vip_traffic(v))))
            .collect()
    };
    let families: [(&str, &str, Field); 5] = [
        ("vip_packets", "Packets steered to the VIP", |t| t.packets),
        ("vip_bytes", "Bytes steered to the VIP", |t| t.bytes),
        ("vip_new_flows", "New flows to the VIP", |t| t.new_flows),
        (
            "vip_handshakes",
            "TCP handshakes started at the VIP (client SYNs of new flows, once per flow)",
            |t| t.handshakes,
        ),
        (
            "vip_handshakes_completed",
            "TCP handshakes at the VIP whose client sent its first ACK",
            |t| t.handshakes_completed,
        ),
    ];
    for (name, help, field) in families {
        counters(reg, name, help, per_vip(field));
    }

    gauges(
        reg,
        "vip_flow_state",
        "1 for where the VIP's TCP flow state lives (table: the LB's connection table; \
         second-chance: the backends, found through the ring's history), 0 for the other",
        vips()
            .flat_map(|v| {
                [FlowState::Table, FlowState::SecondChance].map(|m| {
                    let name = serde_json::to_value(m).expect("a plain enum serializes");
                    let mut l = vip_labels(v);
                    l.push(("flow_state", name.as_str().unwrap_or_default().to_string()));
                    (l, i64::from(v.spec.flow_state == m))
                })
            })
            .collect(),
    );
}

/// How each VIP routes QUIC, and the server ID of each backend of a `quic = "cid"` VIP.
fn quic_families(reg: &mut Registry, snap: &Snapshot) {
    gauges(
        reg,
        "vip_quic",
        "1 for how the VIP routes QUIC packets (off: by the 5-tuple; cid: by the server ID in \
         the destination connection ID), 0 for the other",
        snap.state
            .vips
            .values()
            .flat_map(|v| {
                [QuicMode::Off, QuicMode::Cid].map(|m| {
                    let mut l = vip_labels(v);
                    l.push(("quic", m.to_string()));
                    (l, i64::from(v.spec.quic == m))
                })
            })
            .collect(),
    );
    gauges(
        reg,
        "backend_quic_server_id_info",
        "1 for each backend of a quic = \"cid\" VIP, labelled with its QUIC-LB server ID (hex)",
        backends(snap)
            .filter_map(|(b, mut l)| {
                l.push(("quic_server_id", b.spec.quic_server_id.clone()?));
                Some((l, 1))
            })
            .collect(),
    );
}

/// Traffic, flows, weight and state per backend.
fn backend_families(reg: &mut Registry, snap: &Snapshot) {
    let per_backend = |f: Field| {
        backends(snap)
            .map(|(b, l)| (l, f(snap.backend_traffic(b))))
            .collect()
    };
    let families: [(&str, &str, Field); 5] = [
        ("backend_packets", "Packets sent to the backend", |t| {
            t.packets
        }),
        ("backend_bytes", "Bytes sent to the backend", |t| t.bytes),
        (
            "backend_new_flows",
            "New flows steered to the backend",
            |t| t.new_flows,
        ),
        (
            "backend_handshakes",
            "TCP handshakes started on the backend (client SYNs of new flows, once per flow)",
            |t| t.handshakes,
        ),
        (
            "backend_handshakes_completed",
            "TCP handshakes on the backend whose client sent its first ACK; the rest never \
             completed (refused, unanswered or abandoned)",
            |t| t.handshakes_completed,
        ),
    ];
    for (name, help, field) in families {
        counters(reg, name, help, per_backend(field));
    }
    gauges(
        reg,
        "backend_active_flows",
        "Connection-table entries of the backend seen recently",
        backends(snap)
            .map(|(b, l)| (l, snap.backend_flows(b) as i64))
            .collect(),
    );
    gauges(
        reg,
        "backend_weight",
        "Maglev weight the backend is steered with now (after adaptive scaling)",
        backends(snap)
            .map(|(b, l)| (l, i64::from(snap.effective[&b.id])))
            .collect(),
    );
    gauges(
        reg,
        "backend_state",
        "1 for the backend's state (active, draining or down), 0 for the others",
        backends(snap)
            .flat_map(|(b, l)| {
                [PlaneState::Active, PlaneState::Draining, PlaneState::Down].map(|s| {
                    let name = serde_json::to_value(s).expect("a plain enum serializes");
                    let mut l = l.clone();
                    l.push(("state", name.as_str().unwrap_or_default().to_string()));
                    (l, i64::from(b.plane_state() == s))
                })
            })
            .collect(),
    );
}

/// The adaptive policy's view of each backend.
fn steering_families(reg: &mut Registry, snap: &Snapshot) {
    let steering = |f: fn(&BackendDecision) -> f64| -> Vec<(Labels, f64)> {
        backends(snap)
            .filter_map(|(b, l)| snap.steering.get(&b.id).map(|d| (l, f(d))))
            .collect()
    };
    float_gauges(
        reg,
        "backend_load_score",
        "Smoothed load score of the backend (0 idle, 1 at a threshold)",
        steering(|d| d.score),
    );
    float_gauges(
        reg,
        "backend_cooldown_seconds",
        "Cooldown left before a moved-away backend may take new sessions again",
        steering(|d| d.cooldown_left.as_secs_f64()),
    );
    float_gauges(
        reg,
        "backend_telemetry_age_seconds",
        "Age of the backend's oldest telemetry source (absent: none reported)",
        backends(snap)
            .filter_map(|(b, l)| {
                let age = snap.steering.get(&b.id)?.telemetry_age?;
                Some((l, age.as_secs_f64()))
            })
            .collect(),
    );
    float_gauges(
        reg,
        "backend_inband_ttfb_seconds",
        "In-band mean time to first byte over the last window, from the clients' ACKs",
        backends(snap)
            .filter_map(|(b, l)| Some((l, snap.steering.get(&b.id)?.ttfb_s?)))
            .collect(),
    );
    float_gauges(
        reg,
        "backend_inband_delivery_bytes_per_second",
        "In-band delivery rate per stream over the last window, from the clients' ACKs",
        backends(snap)
            .filter_map(|(b, l)| Some((l, snap.steering.get(&b.id)?.delivery_bps?)))
            .collect(),
    );
    gauges(
        reg,
        "backend_moved_away",
        "1 while adaptive steering keeps new sessions off the backend, by reason",
        backends(snap)
            .filter_map(|(b, l)| {
                let d = snap.steering.get(&b.id)?;
                let mut l = l;
                let reason = d
                    .reason
                    .map(|r| serde_json::to_value(r).unwrap_or_default());
                let reason = reason.as_ref().and_then(|r| r.as_str()).unwrap_or("none");
                l.push(("reason", reason.to_string()));
                Some((l, i64::from(d.moved_away)))
            })
            .collect(),
    );
    gauges(
        reg,
        "backend_full",
        "1 while the backend is at its session cap or saturated (new sessions probe past it)",
        steering(|d| f64::from(u8::from(d.full)))
            .into_iter()
            .map(|(l, v)| (l, v as i64))
            .collect(),
    );
}

/// Each tenant's sessions, admissions, refusals and limit state per VIP, and its weight.
fn tenant_families(reg: &mut Registry, snap: &Snapshot) {
    let rows = &snap.tenants;
    let labels = |t: &TenantRow| vec![("tenant", t.tenant.clone()), ("vip", t.vip.clone())];
    gauges(
        reg,
        "tenant_sessions",
        "Active sessions of the tenant's clients on the VIP (the connection table's flows;          none on a second-chance VIP)",
        rows.iter().map(|t| (labels(t), t.sessions as i64)).collect(),
    );
    counters(
        reg,
        "tenant_admitted",
        "New sessions of the tenant on the VIP admitted by its limits",
        rows.iter().map(|t| (labels(t), t.admitted)).collect(),
    );
    counters(
        reg,
        "tenant_refused",
        "New sessions of the tenant on the VIP refused, by the limit that refused them          (sessions: at max_sessions; share: over its share of a busy or full pool; rate: over          new_sessions_per_sec)",
        rows.iter()
            .flat_map(|t| {
                [
                    ("sessions", t.refused.sessions),
                    ("share", t.refused.share),
                    ("rate", t.refused.rate),
                ]
                .map(|(reason, n)| {
                    let mut l = labels(t);
                    l.push(("reason", reason.to_owned()));
                    (l, n)
                })
            })
            .collect(),
    );
    gauges(
        reg,
        "tenant_limited",
        "1 while the tenant's new sessions on the VIP are refused for a limit (sessions: at          max_sessions; share: over its share of a busy or full pool), else 0",
        rows.iter()
            .flat_map(|t| {
                [("sessions", "capped"), ("share", "over-share")].map(|(limit, state)| {
                    let mut l = labels(t);
                    l.push(("limit", limit.to_owned()));
                    (l, i64::from(t.state == state))
                })
            })
            .collect(),
    );
    gauges(
        reg,
        "tenant_info",
        "1 for each configured tenant, labelled with its weight",
        snap.state
            .tenants
            .list
            .iter()
            .map(|t| {
                (
                    vec![("tenant", t.name.clone()), ("weight", t.weight.to_string())],
                    1,
                )
            })
            .collect(),
    );
}

/// Use and capacity of the data-plane maps.
fn map_families(reg: &mut Registry, snap: &Snapshot) {
    gauges(
        reg,
        "map_entries",
        "Entries in use in a data-plane map",
        snap.counters
            .maps
            .iter()
            .map(|(m, (used, _))| (vec![("map", m.clone())], *used as i64))
            .collect(),
    );
    gauges(
        reg,
        "map_capacity",
        "Capacity of a data-plane map",
        snap.counters
            .maps
            .iter()
            .map(|(m, (_, cap))| (vec![("map", m.clone())], *cap as i64))
            .collect(),
    );
}

/// The data plane's global counters and the control plane's events.
fn event_families(reg: &mut Registry, snap: &Snapshot) {
    dataplane_counters(
        reg,
        (0..stat::COUNT).map(stat::Counter).map(|c| {
            let v = snap.counters.global.get(c.name());
            (c, v.copied().unwrap_or(0))
        }),
    );
    counters(
        reg,
        "control_events",
        "Control-plane events (drain completions, health changes, ...), by kind",
        snap.event_counts
            .iter()
            .map(|(k, v)| (vec![("kind", k.clone())], *v))
            .collect(),
    );
}

/// The daemon itself: uptime, background work, announcer, fleet and build.
fn daemon_families(reg: &mut Registry, snap: &Snapshot, info: &DaemonInfo) {
    let uptime = Gauge::<f64, std::sync::atomic::AtomicU64>::default();
    uptime.set(info.started.elapsed().as_secs_f64());
    reg.register_with_unit(
        "uptime",
        "Time since the daemon started",
        Unit::Seconds,
        uptime,
    );
    if let Some(c) = snap.flows_counted {
        let age = Gauge::<f64, std::sync::atomic::AtomicU64>::default();
        age.set(crate::clock::now_ms().saturating_sub(c.taken_ms) as f64 / 1e3);
        reg.register_with_unit(
            "active_flows_age",
            "Age of the active-flow counts (the connection table is counted in the background)",
            Unit::Seconds,
            age,
        );
        let walk = Gauge::<f64, std::sync::atomic::AtomicU64>::default();
        walk.set(c.walk.as_secs_f64());
        reg.register_with_unit(
            "active_flows_walk_duration",
            "How long the latest background walk of the connection table took",
            Unit::Seconds,
            walk,
        );
    }
    if let Some(a) = &info.announce {
        crate::announce::register_metrics(reg, &a.status());
    }
    let step_ns = info
        .policy_step_ns
        .load(std::sync::atomic::Ordering::Relaxed);
    if step_ns > 0 {
        let step = Gauge::<f64, std::sync::atomic::AtomicU64>::default();
        step.set(step_ns as f64 / 1e9);
        reg.register_with_unit(
            "policy_step_duration",
            "How long the last drain check and adaptive-policy step took",
            Unit::Seconds,
            step,
        );
    }
    if let Some(f) = &info.fleet {
        crate::fleet::metrics(reg, &f.status());
    }
    reg.register(
        "build",
        "The daemon's version",
        Info::new(vec![("version", info.version.clone())]),
    );
}

#[cfg(test)]
mod dashboard;

#[cfg(test)]
mod tests {
    use std::io::{Read, Write};

    use super::*;
    use crate::{
        admin::testing::{controller, info},
        controller::{Event, Peer, Traffic},
        state::{
            testing::{be, vip},
            Op,
        },
    };

    pub(super) async fn snapshot() -> Snapshot {
        let mut c = controller();
        let op = Op::AddVip {
            vip: vip("chat", "10.0.0.1"),
            backends: vec![be("10.1.0.1"), be("fd00::1")],
        };
        c.submit(op, Peer::default(), 1).unwrap();
        let quic = Op::AddVip {
            vip: crate::state::testing::quic_vip("chat-quic", "10.0.0.7"),
            backends: vec![crate::state::testing::quic_be("10.1.0.5", "0A05")],
        };
        c.submit(quic, Peer::default(), 1).unwrap();
        let tenants = serde_json::json!({"op": "set-tenants", "tenant": [
            {"name": "acme", "prefixes": ["10.0.2.0/24"], "weight": 3}
        ]});
        c.submit(serde_json::from_value(tenants).unwrap(), Peer::default(), 1)
            .unwrap();
        let drain = Op::Drain {
            vip: "chat".into(),
            address: "10.1.0.1".parse().unwrap(),
            deadline_ms: None,
        };
        c.submit(drain, Peer::default(), 2).unwrap();
        c.record(Event {
            time_ms: 3,
            kind: "drain-complete".into(),
            vip: "chat".into(),
            backend: None,
            reason: String::new(),
        });
        let id = c
            .state()
            .backend("chat", "10.1.0.1".parse().unwrap())
            .unwrap()
            .id;
        c.plane().flows.insert(id, 4);
        let mut snap = Snapshot::take(&Mutex::new(c)).await.unwrap();
        let vip_id = snap.state.vips["chat"].id;
        snap.counters.vips.insert(
            vip_id,
            Traffic {
                packets: 10,
                bytes: 1500,
                new_flows: 2,
                handshakes: 3,
                handshakes_completed: 2,
            },
        );
        snap.counters.backends.insert(
            id,
            Traffic {
                packets: 7,
                bytes: 700,
                new_flows: 1,
                handshakes: 2,
                handshakes_completed: 1,
            },
        );
        snap.counters.global.insert("drop_no_backend".into(), 3);
        snap.counters
            .global
            .insert("decap_pass_not_encap".into(), 5);
        snap.counters.global.insert("conn_hit".into(), 9);
        snap.counters.maps.insert("conns".into(), (12, 1 << 20));
        snap.steering.insert(
            id,
            BackendDecision {
                vip: "chat".into(),
                address: "10.1.0.1".parse().unwrap(),
                id,
                weight: 0,
                state: crate::policy::SteerState::MovedAway,
                moved_away: true,
                reason: Some(crate::policy::Reason::Congestion),
                cooldown_left: std::time::Duration::from_secs(20),
                full: false,
                capped: false,
                breaks_affinity: true,
                score: 0.75,
                sessions: 4,
                max_sessions: 0,
                telemetry_age: Some(std::time::Duration::from_millis(500)),
                ttfb_s: Some(0.25),
                delivery_bps: Some(4000.0),
                handshakes: None,
            },
        );
        snap
    }

    #[tokio::test]
    async fn scrape_shows_each_tenants_sessions_refusals_limits_and_weight() {
        let mut c = controller();
        let op = Op::AddVip {
            vip: vip("chat", "10.0.0.1"),
            backends: vec![be("10.1.0.1")],
        };
        c.submit(op, Peer::default(), 1).unwrap();
        let list = serde_json::json!({"op": "set-tenants", "tenant": [
            {"name": "acme", "prefixes": ["10.0.2.0/24"], "weight": 3, "max_sessions": 2}
        ]});
        c.submit(serde_json::from_value(list).unwrap(), Peer::default(), 2)
            .unwrap();
        let chat = c.state().vips["chat"].clone();
        let b = chat.backends.values().next().unwrap().id;
        c.plane().tenant_flows.insert((b, 1), 2);
        c.plane().tenant_stats.insert(
            lb_common::tenant_index(chat.id, 1),
            lb_common::TenantStats {
                admitted: 5,
                refused_sessions: 3,
                refused_share: 0,
                refused_rate: 1,
            },
        );
        c.set_tenant_decisions(vec![crate::policy::TenantDecision {
            vip: "chat".into(),
            tenant: "acme".into(),
            sessions: 2,
            capped: true,
            over_share: false,
            share: None,
            admitted_per_sec: 0.5,
        }]);
        let mut snap = Snapshot::take(&Mutex::new(c)).await.unwrap();
        snap.counters
            .maps
            .insert("tenant_prefixes".into(), (1, 16384));
        let text = render(&snap, &info());
        for line in [
            r#"sluice_tenant_sessions{tenant="acme",vip="chat"} 2"#,
            r#"sluice_tenant_sessions{tenant="default",vip="chat"} 0"#,
            r#"sluice_tenant_admitted_total{tenant="acme",vip="chat"} 5"#,
            r#"sluice_tenant_refused_total{tenant="acme",vip="chat",reason="sessions"} 3"#,
            r#"sluice_tenant_refused_total{tenant="acme",vip="chat",reason="share"} 0"#,
            r#"sluice_tenant_refused_total{tenant="acme",vip="chat",reason="rate"} 1"#,
            r#"sluice_tenant_limited{tenant="acme",vip="chat",limit="sessions"} 1"#,
            r#"sluice_tenant_limited{tenant="acme",vip="chat",limit="share"} 0"#,
            r#"sluice_tenant_info{tenant="acme",weight="3"} 1"#,
            r#"sluice_map_entries{map="tenant_prefixes"} 1"#,
            r#"sluice_dataplane_events_total{event="shed_tenant_sessions"} 0"#,
        ] {
            assert!(
                text.lines().any(|l| l == line),
                "missing {line:?} in\n{text}"
            );
        }
    }

    #[tokio::test]
    async fn scrape_shows_quic_modes_server_ids_and_counters() {
        let mut snap = snapshot().await;
        snap.counters.global.insert("quic_cid_routed".into(), 4);
        let text = render(&snap, &info());
        for line in [
            "# TYPE sluice_vip_quic gauge",
            r#"sluice_vip_quic{vip="chat",quic="off"} 1"#,
            r#"sluice_vip_quic{vip="chat",quic="cid"} 0"#,
            r#"sluice_vip_quic{vip="chat-quic",quic="cid"} 1"#,
            r#"sluice_backend_quic_server_id_info{vip="chat-quic",backend="10.1.0.5",quic_server_id="0a05"} 1"#,
            r#"sluice_dataplane_events_total{event="quic_cid_routed"} 4"#,
            r#"sluice_dataplane_events_total{event="quic_unknown_server"} 0"#,
            r#"sluice_dataplane_events_total{event="quic_malformed"} 0"#,
        ] {
            assert!(
                text.lines().any(|l| l == line),
                "missing {line:?} in\n{text}"
            );
        }
        assert!(
            !text.contains(r#"quic_server_id_info{vip="chat","#),
            "a backend without a server ID has no info line"
        );
    }

    #[tokio::test]
    async fn scrape_describes_the_state() {
        let text = render(&snapshot().await, &info());
        for line in [
            "# TYPE sluice_vip_packets_total counter",
            r#"sluice_vip_packets_total{vip="chat"} 10"#,
            r#"sluice_vip_bytes_total{vip="chat"} 1500"#,
            r#"sluice_vip_new_flows_total{vip="chat"} 2"#,
            r#"sluice_backend_packets_total{vip="chat",backend="10.1.0.1"} 7"#,
            r#"sluice_backend_bytes_total{vip="chat",backend="fd00::1"} 0"#,
            r#"sluice_backend_new_flows_total{vip="chat",backend="10.1.0.1"} 1"#,
            r#"sluice_vip_handshakes_total{vip="chat"} 3"#,
            r#"sluice_vip_handshakes_completed_total{vip="chat"} 2"#,
            r#"sluice_backend_handshakes_total{vip="chat",backend="10.1.0.1"} 2"#,
            r#"sluice_backend_handshakes_completed_total{vip="chat",backend="10.1.0.1"} 1"#,
            "# TYPE sluice_backend_active_flows gauge",
            r#"sluice_backend_active_flows{vip="chat",backend="10.1.0.1"} 4"#,
            r#"sluice_backend_weight{vip="chat",backend="fd00::1"} 100"#,
            r#"sluice_backend_state{vip="chat",backend="10.1.0.1",state="draining"} 1"#,
            r#"sluice_backend_state{vip="chat",backend="10.1.0.1",state="active"} 0"#,
            r#"sluice_backend_state{vip="chat",backend="fd00::1",state="active"} 1"#,
            "# TYPE sluice_vip_flow_state gauge",
            r#"sluice_vip_flow_state{vip="chat",flow_state="table"} 1"#,
            r#"sluice_vip_flow_state{vip="chat",flow_state="second-chance"} 0"#,
            r#"sluice_dataplane_events_total{event="decap_history_short"} 0"#,
            r#"sluice_dataplane_drops_total{reason="no_backend"} 3"#,
            r#"sluice_dataplane_drops_total{reason="adjust_head"} 0"#,
            r#"sluice_dataplane_passes_total{reason="decap_not_encap"} 5"#,
            r#"sluice_dataplane_passes_total{reason="not_ip"} 0"#,
            r#"sluice_dataplane_events_total{event="conn_hit"} 9"#,
            r#"sluice_dataplane_events_total{event="rx"} 0"#,
            r#"sluice_control_events_total{kind="drain-complete"} 1"#,
            r#"sluice_backend_load_score{vip="chat",backend="10.1.0.1"} 0.75"#,
            r#"sluice_backend_cooldown_seconds{vip="chat",backend="10.1.0.1"} 20.0"#,
            r#"sluice_backend_telemetry_age_seconds{vip="chat",backend="10.1.0.1"} 0.5"#,
            r#"sluice_backend_inband_ttfb_seconds{vip="chat",backend="10.1.0.1"} 0.25"#,
            r#"sluice_backend_inband_delivery_bytes_per_second{vip="chat",backend="10.1.0.1"} 4000.0"#,
            r#"sluice_backend_moved_away{vip="chat",backend="10.1.0.1",reason="congestion"} 1"#,
            r#"sluice_backend_full{vip="chat",backend="10.1.0.1"} 0"#,
            r#"sluice_map_entries{map="conns"} 12"#,
            r#"sluice_map_capacity{map="conns"} 1048576"#,
            "# TYPE sluice_uptime_seconds gauge",
            r#"sluice_build_info{version="test"} 1"#,
            r#"sluice_listener_refused_connections_total{listener="metrics"} 0"#,
        ] {
            assert!(
                text.lines().any(|l| l == line),
                "missing {line:?} in\n{text}"
            );
        }
        assert!(text
            .lines()
            .any(|l| l.starts_with("sluice_uptime_seconds ")));
    }

    #[tokio::test]
    async fn serves_metrics_and_nothing_else() {
        // Bound before the server task starts: connections queue in its backlog.
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let ctl = Arc::new(Mutex::new(controller()));
        let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
        let task = tokio::spawn(serve(listener, ctl, Arc::new(info()), async {
            let _ = stopped.await;
        }));
        let get = |path: &'static str| {
            tokio::task::spawn_blocking(move || {
                let t = std::time::Duration::from_secs(5);
                let mut s = std::net::TcpStream::connect_timeout(&addr, t).unwrap();
                s.set_read_timeout(Some(t)).unwrap();
                write!(
                    s,
                    "GET {path} HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n"
                )
                .unwrap();
                let mut r = String::new();
                s.read_to_string(&mut r).unwrap();
                r
            })
        };
        let r = get("/metrics").await.unwrap();
        assert!(r.starts_with("HTTP/1.1 200"), "{r}");
        assert!(r.contains("text/plain; version=0.0.4"), "{r}");
        assert!(r.contains(r#"sluice_build_info{version="test"} 1"#), "{r}");
        assert!(get("/").await.unwrap().starts_with("HTTP/1.1 404"));
        stop.send(()).unwrap();
        task.await.unwrap().unwrap();
    }
}
