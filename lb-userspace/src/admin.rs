//! The admin API: HTTP/1.1 and JSON on a Unix socket.
//!
//! Every change goes through `Controller::submit` with the caller's SO_PEERCRED, so the
//! audit log names who made it. Reads are answered from a snapshot copied under the
//! controller lock and formatted after it is released.

mod conns;
mod socket;
mod views;

use std::{
    convert::Infallible, error::Error as StdError, fs, future::Future, net::IpAddr,
    os::unix::fs::MetadataExt, sync::Arc, time::Instant,
};

use anyhow::{Context, Result};
use http_body_util::{BodyExt, Full, LengthLimitError, Limited};
use hyper::{
    body::{Body, Bytes},
    header,
    service::service_fn,
    Method, Request, Response, StatusCode,
};
use serde::{de::DeserializeOwned, Deserialize, Serialize};
use serde_json::{json, Value};
use tokio::{
    net::UnixListener,
    sync::{Mutex, MutexGuard},
};

pub use self::socket::{bind, AdminSocket};
pub(crate) use self::{
    socket::group_name,
    views::{Snapshot, TenantRow},
};
use self::{
    socket::{may_administer, supplementary_groups},
    views::{flows, stats, vip_detail, BackendView, VipView},
};
use crate::{
    clock::now_ms,
    config::{rules, TenantList},
    controller::{Controller, Peer, Plane},
    http_server::{json_response, serve_connections, serve_http, within, ApiError},
    limits::{ListenerLimits, Refused},
    state::{BackendSpec, Op, OpError, VipSpec},
    telemetry::{Hub, Sample},
};

/// What `GET /v1/status` reports about the daemon itself.
#[derive(Clone, Debug)]
pub struct DaemonInfo {
    pub version: String,
    pub started: Instant,
    /// (interface, XDP mode) as attached.
    pub interfaces: Vec<(String, String)>,
    pub pin_dir: String,
    /// The data plane was re-adopted from pinned maps (a restart or upgrade), not created.
    pub reused: bool,
    /// Where pushed telemetry samples go (the same hub the scrapers feed).
    pub telemetry: Arc<std::sync::Mutex<Hub>>,
    /// Connections each listener closed at its caps.
    pub refused: Arc<Refused>,
    /// How long the last drain check and policy step took together, in ns (0: none yet).
    pub policy_step_ns: Arc<std::sync::atomic::AtomicU64>,
    /// The route announcer (`[bgp]`); None when the host announces nothing.
    pub announce: Option<Arc<crate::announce::Announcer>>,
    /// Set with `[fleet]`: changes go to etcd, and the status shows the fleet.
    pub fleet: Option<Arc<crate::fleet::Fleet<crate::fleet::gateway::Gateway>>>,
}

/// Requests larger than this are refused with 413.
pub const MAX_BODY: usize = 64 * 1024;

/// Body of `POST /v1/vips`.
#[derive(Clone, Debug, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct NewVip {
    pub vip: VipSpec,
    #[serde(default)]
    pub backends: Vec<BackendSpec>,
}

/// Body of `PUT /v1/vips/{name}/backends/{addr}/weight`.
#[derive(Clone, Debug, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct WeightChange {
    pub weight: u32,
}

/// Body of `POST .../drain` (optional).
#[derive(Clone, Debug, Default, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct DrainRequest {
    /// A duration from now, e.g. "10m"; the backend is removed then even with flows left.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub deadline: Option<String>,
}

struct Api<P: Plane> {
    ctl: Arc<Mutex<Controller<P>>>,
    info: Arc<DaemonInfo>,
    owner_uid: u32,
    group_gid: u32,
}

/// Serves the admin API on `listener` (from `bind`) until `shutdown` completes.
pub async fn serve<P: Plane + 'static>(
    listener: UnixListener,
    ctl: Arc<Mutex<Controller<P>>>,
    info: Arc<DaemonInfo>,
    limits: ListenerLimits,
    shutdown: impl Future<Output = ()>,
) -> Result<()> {
    let addr = listener.local_addr()?;
    let path = addr
        .as_pathname()
        .context("the admin listener is not bound to a path")?;
    // Who may call is decided by the socket file's ownership, as for the kernel's check.
    let meta = fs::metadata(path).with_context(|| format!("reading {}", path.display()))?;
    let api = Arc::new(Api {
        ctl,
        info,
        owner_uid: meta.uid(),
        group_gid: meta.gid(),
    });
    let (listener, api) = (&listener, &api);
    let refused = &api.info.refused.admin;
    serve_connections(
        limits,
        refused,
        "admin",
        move || async move {
            let (stream, _) = listener.accept().await?;
            let peer = match stream.peer_cred() {
                Ok(c) => Peer {
                    uid: c.uid(),
                    gid: c.gid(),
                    pid: c.pid().unwrap_or(0),
                },
                Err(e) => {
                    tracing::warn!(error = %e, "no peer credentials; closing the connection");
                    return Ok(None);
                }
            };
            // Counted per uid: one user cannot take every slot.
            Ok(Some((peer.uid, stream, peer)))
        },
        move |peer, stream| {
            let api = Arc::clone(api);
            async move {
                let service = service_fn(move |req| {
                    let api = Arc::clone(&api);
                    async move {
                        Ok::<_, Infallible>(
                            within(limits.request_timeout, handle(&api, peer, req)).await,
                        )
                    }
                });
                serve_http(stream, service, limits).await
            }
        },
        shutdown,
    )
    .await;
    Ok(())
}

impl From<OpError> for ApiError {
    fn from(e: OpError) -> Self {
        ApiError::new(e.http_status(), e.to_string())
    }
}

impl From<anyhow::Error> for ApiError {
    fn from(e: anyhow::Error) -> Self {
        ApiError::new(500, format!("{e:#}"))
    }
}

type Reply = Result<Response<Full<Bytes>>, ApiError>;

fn reply(status: StatusCode, body: &impl Serialize) -> Reply {
    Ok(json_response(status, body))
}

fn no_content() -> Reply {
    let mut r = Response::new(Full::default());
    *r.status_mut() = StatusCode::NO_CONTENT;
    Ok(r)
}

/// The API's endpoints, parsed from the path.
enum Route {
    Status,
    Vips,
    Vip(String),
    Backends(String),
    Backend(String, IpAddr),
    Weight(String, IpAddr),
    Drain(String, IpAddr),
    Undrain(String, IpAddr),
    Telemetry(String, IpAddr),
    Flows,
    Conns,
    Trace,
    Stats,
    Events,
    /// `/v1/lb`, `/v1/lb/drain`, `/v1/lb/undrain`: this host's route announcement.
    Lb(Option<&'static str>),
    Tenants,
}

impl Route {
    fn parse(path: &str) -> Result<Route, ApiError> {
        let not_found = || {
            ApiError::new(
                404,
                format!(
                    "no endpoint {path}; the API has /v1/status, /v1/vips, /v1/flows, /v1/conns, /v1/trace, /v1/stats, /v1/events, /v1/lb and /v1/tenants"
                ),
            )
        };
        let rest = path.strip_prefix("/v1/").ok_or_else(not_found)?;
        let segs = rest
            .strip_suffix('/')
            .unwrap_or(rest)
            .split('/')
            .map(decode_segment)
            .collect::<Result<Vec<_>, _>>()?;
        let segs: Vec<&str> = segs.iter().map(String::as_str).collect();
        let s = |v: &str| v.to_string();
        Ok(match segs.as_slice() {
            ["status"] => Route::Status,
            ["vips"] => Route::Vips,
            ["vips", v] => Route::Vip(s(v)),
            ["vips", v, "backends"] => Route::Backends(s(v)),
            ["vips", v, "backends", a] => Route::Backend(s(v), path_addr(a)?),
            ["vips", v, "backends", a, "weight"] => Route::Weight(s(v), path_addr(a)?),
            ["vips", v, "backends", a, "drain"] => Route::Drain(s(v), path_addr(a)?),
            ["vips", v, "backends", a, "undrain"] => Route::Undrain(s(v), path_addr(a)?),
            ["vips", v, "backends", a, "telemetry"] => Route::Telemetry(s(v), path_addr(a)?),
            ["flows"] => Route::Flows,
            ["conns"] => Route::Conns,
            ["trace"] => Route::Trace,
            ["stats"] => Route::Stats,
            ["events"] => Route::Events,
            ["lb"] => Route::Lb(None),
            ["lb", "drain"] => Route::Lb(Some("drain")),
            ["lb", "undrain"] => Route::Lb(Some("undrain")),
            ["tenants"] => Route::Tenants,
            _ => return Err(not_found()),
        })
    }

    /// The methods the endpoint answers (the Allow header of a 405).
    fn allow(&self) -> &'static str {
        match self {
            Route::Status
            | Route::Flows
            | Route::Conns
            | Route::Stats
            | Route::Events
            | Route::Lb(None) => "GET",
            Route::Vips | Route::Backends(_) => "GET, POST",
            Route::Vip(_) | Route::Backend(..) => "GET, DELETE",
            Route::Weight(..) => "PUT",
            Route::Trace | Route::Tenants => "GET, PUT",
            Route::Drain(..) | Route::Undrain(..) | Route::Telemetry(..) | Route::Lb(Some(_)) => {
                "POST"
            }
        }
    }
}

/// Undoes percent-encoding in one path segment (clients may encode an IPv6 address's ':').
fn decode_segment(seg: &str) -> Result<String, ApiError> {
    let bad = || ApiError::new(400, format!("bad percent-encoding in path segment {seg:?}"));
    let bytes = seg.as_bytes();
    let mut out = Vec::with_capacity(bytes.len());
    let mut i = 0;
    while i < bytes.len() {
        if bytes[i] == b'%' {
            let hex = bytes.get(i + 1..i + 3).ok_or_else(bad)?;
            let hex = std::str::from_utf8(hex).map_err(|_| bad())?;
            if !hex.bytes().all(|c| c.is_ascii_hexdigit()) {
                return Err(bad());
            }
            out.push(u8::from_str_radix(hex, 16).map_err(|_| bad())?);
            i += 3;
        } else {
            out.push(bytes[i]);
            i += 1;
        }
    }
    String::from_utf8(out).map_err(|_| bad())
}

/// A backend address as it appears in a path: `fd00::1`, or bracketed `[fd00::1]`.
fn path_addr(seg: &str) -> Result<IpAddr, ApiError> {
    let bare = seg
        .strip_prefix('[')
        .and_then(|s| s.strip_suffix(']'))
        .unwrap_or(seg);
    bare.parse()
        .map_err(|_| ApiError::new(400, format!("{seg:?} is not an IP address")))
}

async fn handle<P: Plane, B>(api: &Api<P>, peer: Peer, req: Request<B>) -> Response<Full<Bytes>>
where
    B: Body,
    B::Error: Into<Box<dyn StdError + Send + Sync>>,
{
    let (method, path) = (req.method().clone(), req.uri().path().to_owned());
    let resp = respond(api, peer, req)
        .await
        .unwrap_or_else(ApiError::into_response);
    tracing::debug!(%method, %path, status = resp.status().as_u16(), uid = peer.uid, pid = peer.pid, "admin request");
    resp
}

async fn respond<P: Plane, B>(api: &Api<P>, peer: Peer, req: Request<B>) -> Reply
where
    B: Body,
    B::Error: Into<Box<dyn StdError + Send + Sync>>,
{
    check_caller(api, &peer)?;
    if let Some(refused) = refuse_declared_too_large(&req) {
        return Ok(refused);
    }
    let route = Route::parse(req.uri().path())?;
    let (parts, body) = req.into_parts();
    match (route, parts.method) {
        (Route::Status, Method::GET) => reply(StatusCode::OK, &status(api).await),
        (Route::Vips, Method::GET) => list_vips(api).await,
        (Route::Vips, Method::POST) => add_vip(api, peer, &read_body(body).await?).await,
        (Route::Vip(name), Method::GET) => show_vip(api, &name).await,
        (Route::Vip(name), Method::DELETE) => {
            drop(submit(api, peer, Op::RemoveVip { vip: name }).await?);
            no_content()
        }
        (Route::Backends(name), Method::GET) => list_backends(api, &name).await,
        (Route::Backends(vip), Method::POST) => {
            add_backend(api, peer, vip, &read_body(body).await?).await
        }
        (Route::Backend(vip, address), Method::GET) => show_backend(api, &vip, address).await,
        (Route::Backend(vip, address), Method::DELETE) => {
            drop(submit(api, peer, Op::RemoveBackend { vip, address }).await?);
            no_content()
        }
        (Route::Weight(vip, address), Method::PUT) => {
            let op = weight_op(&vip, address, &read_body(body).await?)?;
            let ctl = submit(api, peer, op).await?;
            backend_reply(StatusCode::OK, &ctl, &vip, address)
        }
        (Route::Telemetry(vip, address), Method::POST) => {
            push_telemetry(api, vip, address, &read_body(body).await?).await
        }
        (Route::Drain(vip, address), Method::POST) => {
            let body = read_body(body).await?;
            let now = now_ms();
            let ctl = submit_at(api, peer, drain_op(&vip, address, &body, now)?, now).await?;
            backend_reply(StatusCode::OK, &ctl, &vip, address)
        }
        (Route::Undrain(vip, address), Method::POST) => {
            let op = Op::Undrain {
                vip: vip.clone(),
                address,
            };
            let ctl = submit(api, peer, op).await?;
            backend_reply(StatusCode::OK, &ctl, &vip, address)
        }
        (Route::Flows, Method::GET) => {
            reply(StatusCode::OK, &flows(&Snapshot::take(&api.ctl).await?))
        }
        (Route::Conns, Method::GET) => {
            let q = conns::ConnQuery::parse(parts.uri.query())?;
            reply(StatusCode::OK, &conns::list(&api.ctl, &q).await?)
        }
        (Route::Trace, Method::GET) => {
            let on = api.ctl.lock().await.trace();
            reply(StatusCode::OK, &json!({ "enabled": on }))
        }
        (Route::Trace, Method::PUT) => set_trace(api, peer, &read_body(body).await?).await,
        (Route::Stats, Method::GET) => {
            reply(StatusCode::OK, &stats(&Snapshot::take(&api.ctl).await?))
        }
        (Route::Events, Method::GET) => events(api).await,
        (Route::Lb(None), Method::GET) => reply(StatusCode::OK, &announcer(api)?.status()),
        (Route::Lb(Some(action)), Method::POST) => lb_action(api, peer, action).await,
        (Route::Tenants, Method::GET) => {
            let mut ctl = api.ctl.lock().await;
            reply(StatusCode::OK, &views::tenants_view(&mut ctl)?)
        }
        (Route::Tenants, Method::PUT) => set_tenants(api, peer, &read_body(body).await?).await,
        (route, method) => Err(ApiError {
            allow: Some(route.allow()),
            ..ApiError::new(
                405,
                format!("{method} is not allowed here; use {}", route.allow()),
            )
        }),
    }
}

/// Refuses a caller who is neither root, the socket's owner nor in its group.
fn check_caller<P: Plane>(api: &Api<P>, peer: &Peer) -> Result<(), ApiError> {
    if may_administer(peer, api.owner_uid, api.group_gid, || {
        supplementary_groups(peer.pid)
    }) {
        return Ok(());
    }
    let group = group_name(api.group_gid).unwrap_or_else(|| api.group_gid.to_string());
    Err(ApiError::new(
        403,
        format!(
            "uid {} may not use the admin API: run as root or as a member of group {group}",
            peer.uid
        ),
    ))
}

/// The 413 answer to a body declared larger than the limit, which is refused before it is
/// read: hyper sends `100 Continue` only once the body is polled, so a client that waits for
/// it sends nothing more.
fn refuse_declared_too_large<B>(req: &Request<B>) -> Option<Response<Full<Bytes>>> {
    let len = req.headers().get(header::CONTENT_LENGTH)?.to_str().ok()?;
    if len.parse::<u64>().ok()? <= MAX_BODY as u64 {
        return None;
    }
    let mut r = too_large().into_response();
    r.headers_mut().insert(
        header::CONNECTION,
        header::HeaderValue::from_static("close"),
    );
    Some(r)
}

async fn list_vips<P: Plane>(api: &Api<P>) -> Reply {
    let snap = Snapshot::take(&api.ctl).await?;
    let vips: Vec<_> = snap
        .state
        .vips
        .values()
        .map(|v| VipView::new(v, Some(snap.vip_live(v))))
        .collect();
    reply(StatusCode::OK, &json!({ "vips": vips }))
}

async fn add_vip<P: Plane>(api: &Api<P>, peer: Peer, body: &[u8]) -> Reply {
    let req: NewVip = parse_json(body, NEW_VIP_SHAPE)?;
    let name = req.vip.name.clone();
    let op = Op::AddVip {
        vip: req.vip,
        backends: req.backends,
    };
    let ctl = submit(api, peer, op).await?;
    let vip = ctl.state().vip(&name)?;
    let backends = vip
        .backends
        .values()
        .map(|b| BackendView::new(b, ctl.effective_weight(b), None))
        .collect();
    reply(StatusCode::CREATED, &vip_detail(vip, backends, None))
}

async fn show_vip<P: Plane>(api: &Api<P>, name: &str) -> Reply {
    let snap = Snapshot::take(&api.ctl).await?;
    let vip = snap.state.vip(name)?;
    let backends = vip
        .backends
        .values()
        .map(|b| snap.backend_view(b))
        .collect();
    reply(
        StatusCode::OK,
        &vip_detail(vip, backends, Some(snap.vip_live(vip))),
    )
}

async fn list_backends<P: Plane>(api: &Api<P>, vip: &str) -> Reply {
    let snap = Snapshot::take(&api.ctl).await?;
    let backends: Vec<_> = snap
        .state
        .vip(vip)?
        .backends
        .values()
        .map(|b| snap.backend_view(b))
        .collect();
    reply(StatusCode::OK, &json!({ "backends": backends }))
}

async fn add_backend<P: Plane>(api: &Api<P>, peer: Peer, vip: String, body: &[u8]) -> Reply {
    let backend: BackendSpec = parse_json(body, BACKEND_SHAPE)?;
    let address = backend.address;
    let ctl = submit(
        api,
        peer,
        Op::AddBackend {
            vip: vip.clone(),
            backend,
        },
    )
    .await?;
    backend_reply(StatusCode::CREATED, &ctl, &vip, address)
}

async fn show_backend<P: Plane>(api: &Api<P>, vip: &str, address: IpAddr) -> Reply {
    let snap = Snapshot::take(&api.ctl).await?;
    let b = snap.state.backend(vip, address)?;
    reply(StatusCode::OK, &snap.backend_view(b))
}

/// `PUT .../weight`: the change the body asks for.
fn weight_op(vip: &str, address: IpAddr, body: &[u8]) -> Result<Op, ApiError> {
    let w: WeightChange = parse_json(body, r#"{"weight": 0-65535}"#)?;
    Ok(Op::SetWeight {
        vip: vip.to_owned(),
        address,
        weight: w.weight,
    })
}

/// A sample from a source Sluice does not scrape: it joins the scraped ones and ages like
/// them (stale after telemetry.stale_after).
async fn push_telemetry<P: Plane>(
    api: &Api<P>,
    vip: String,
    address: IpAddr,
    body: &[u8],
) -> Reply {
    let sample: Sample = parse_json(body, SAMPLE_SHAPE)?;
    sample.validate().map_err(|e| ApiError::new(400, e))?;
    api.ctl.lock().await.state().backend(&vip, address)?;
    let key = (vip, address);
    let mut hub = api.info.telemetry.lock().expect("telemetry hub lock");
    hub.push(&key, sample, Instant::now());
    no_content()
}

/// `POST .../drain`: a drain until the body's deadline from `now`, or with none when there
/// is no body.
fn drain_op(vip: &str, address: IpAddr, body: &[u8], now: u64) -> Result<Op, ApiError> {
    let req: DrainRequest = if body.trim_ascii().is_empty() {
        DrainRequest::default()
    } else {
        parse_json(body, r#"{"deadline": "10m"} or no body"#)?
    };
    let deadline_ms = match req.deadline {
        None => None,
        Some(d) => {
            let d = rules::duration(&d).map_err(|e| ApiError::new(400, format!("deadline {e}")))?;
            Some(now.saturating_add(rules::millis(d)))
        }
    };
    Ok(Op::Drain {
        vip: vip.to_owned(),
        address,
        deadline_ms,
    })
}

async fn set_trace<P: Plane>(api: &Api<P>, peer: Peer, body: &[u8]) -> Reply {
    #[derive(Deserialize)]
    #[serde(deny_unknown_fields)]
    struct Switch {
        enabled: bool,
    }
    let s: Switch = parse_json(body, r#"{"enabled": true|false}"#)?;
    let mut ctl = api.ctl.lock().await;
    ctl.set_trace(s.enabled, peer, now_ms())?;
    reply(StatusCode::OK, &json!({ "enabled": ctl.trace() }))
}

/// `PUT /v1/tenants`: the whole `[[tenant]]` list, checked as the configuration file's;
/// answers with what `GET` shows.
async fn set_tenants<P: Plane>(api: &Api<P>, peer: Peer, body: &[u8]) -> Reply {
    const SHAPE: &str = r#"{"tenant": [{"name": "acme", "prefixes": ["10.0.2.0/24"], "weight": 1, "max_sessions": 0, "new_sessions_per_sec": 0, "burst": 0}]}"#;
    let value: Value = parse_json(body, SHAPE)?;
    let list = TenantList::deserialize(value).map_err(|e| ApiError::new(400, e.to_string()))?;
    let mut ctl = submit(api, peer, Op::SetTenants(list)).await?;
    reply(StatusCode::OK, &views::tenants_view(&mut ctl)?)
}

async fn events<P: Plane>(api: &Api<P>) -> Reply {
    let ctl = api.ctl.lock().await;
    let events: Vec<_> = ctl.events().cloned().collect();
    let counts = ctl.event_counts().clone();
    drop(ctl);
    reply(
        StatusCode::OK,
        &json!({ "events": events, "counts": counts }),
    )
}

/// `sluice lb drain|undrain`: withdraws or announces this host's routes, and records the
/// change as an event when it changed anything.
async fn lb_action<P: Plane>(api: &Api<P>, peer: Peer, action: &str) -> Reply {
    let a = announcer(api)?;
    let was = if action == "drain" {
        a.drain(now_ms())
    } else {
        !a.undrain()
    };
    if !was {
        let (kind, what) = match action {
            "drain" => ("host-maintenance", "withdrawing every route"),
            _ => ("host-undrained", "announcing the served VIPs again"),
        };
        api.ctl.lock().await.record(crate::controller::Event {
            time_ms: now_ms(),
            kind: kind.into(),
            vip: String::new(),
            backend: None,
            reason: format!("sluice lb {action} by uid {}: {what}", peer.uid),
        });
    }
    reply(StatusCode::OK, &a.status())
}

const SAMPLE_SHAPE: &str = r#"{"gpu_util": 0.0-1.0, "kv_cache": 0.0-1.0, "queue_depth": n, "ecn_rate": n, ...} (fields of a telemetry sample, all optional)"#;
const NEW_VIP_SHAPE: &str = r#"{"vip": {"name", "address", "port", "protocol", ...}, "backends": [{"address", "weight", ...}]}"#;
const BACKEND_SHAPE: &str =
    r#"{"address": "10.1.0.1", "weight": 100, "labels": {...}, "max_sessions": 0}"#;

fn too_large() -> ApiError {
    ApiError::new(
        413,
        format!("the request body is larger than {} KiB", MAX_BODY / 1024),
    )
}

async fn read_body<B>(body: B) -> Result<Bytes, ApiError>
where
    B: Body,
    B::Error: Into<Box<dyn StdError + Send + Sync>>,
{
    match Limited::new(body, MAX_BODY).collect().await {
        Ok(c) => Ok(c.to_bytes()),
        Err(e) if e.is::<LengthLimitError>() => Err(too_large()),
        Err(e) => Err(ApiError::new(400, format!("reading the request body: {e}"))),
    }
}

fn parse_json<T: DeserializeOwned>(bytes: &[u8], shape: &str) -> Result<T, ApiError> {
    if bytes.trim_ascii().is_empty() {
        return Err(ApiError::new(
            400,
            format!("missing JSON body; expected {shape}"),
        ));
    }
    serde_json::from_slice(bytes)
        .map_err(|e| ApiError::new(400, format!("invalid JSON body: {e}; expected {shape}")))
}

async fn submit<P: Plane>(
    api: &Api<P>,
    peer: Peer,
    op: Op,
) -> Result<MutexGuard<'_, Controller<P>>, ApiError> {
    submit_at(api, peer, op, now_ms()).await
}

/// Submits `op`; the guard lets the caller answer with the result before anyone else changes it.
async fn submit_at<P: Plane>(
    api: &Api<P>,
    peer: Peer,
    op: Op,
    now_ms: u64,
) -> Result<MutexGuard<'_, Controller<P>>, ApiError> {
    if let Some(fleet) = &api.info.fleet {
        return crate::fleet::run::submit(fleet, &api.ctl, op, peer, now_ms)
            .await
            .map_err(|e| ApiError::new(e.http_status(), e.to_string()));
    }
    let mut ctl = api.ctl.lock().await;
    ctl.submit(op, peer, now_ms)
        .map_err(|e| ApiError::new(e.http_status(), e.to_string()))?;
    Ok(ctl)
}

fn backend_reply<P: Plane>(
    status: StatusCode,
    ctl: &Controller<P>,
    vip: &str,
    address: IpAddr,
) -> Reply {
    let b = ctl.state().backend(vip, address)?;
    reply(status, &BackendView::new(b, ctl.effective_weight(b), None))
}

fn announcer<P: Plane>(api: &Api<P>) -> Result<&crate::announce::Announcer, ApiError> {
    api.info.announce.as_deref().ok_or_else(|| {
        ApiError::new(
            409,
            "this host announces no routes: add a [bgp] section to the configuration and \
             restart sluice",
        )
    })
}

async fn status<P: Plane>(api: &Api<P>) -> Value {
    let (vips, backends) = {
        let ctl = api.ctl.lock().await;
        let s = ctl.state();
        (
            s.vips.len(),
            s.vips.values().map(|v| v.backends.len()).sum::<usize>(),
        )
    };
    let info = &api.info;
    let interfaces: Vec<_> = info
        .interfaces
        .iter()
        .map(|(name, mode)| json!({ "name": name, "mode": mode }))
        .collect();
    json!({
        "version": info.version,
        "pid": std::process::id(),
        "uptime_s": info.started.elapsed().as_secs(),
        "interfaces": interfaces,
        "pin_dir": info.pin_dir,
        "dataplane_reused": info.reused,
        "vips": vips,
        "backends": backends,
        "announce": info.announce.as_ref().map(|a| a.status()),
        "fleet": info.fleet.as_ref().map(|f| f.status()),
    })
}

#[cfg(test)]
pub(crate) mod testing {
    //! An admin server over a FakePlane on a temporary socket, run on its own thread so
    //! tests can call it with the blocking client.
    use std::{path::PathBuf, time::Duration};

    use super::*;
    use crate::{
        client::Client,
        controller::{fake::FakePlane, Settings},
        state::{Limits, State},
        test_dir::TestDir,
    };

    pub(crate) fn controller() -> Controller<FakePlane> {
        controller_auditing(None)
    }

    /// A controller that appends its audit lines to `audit_log`.
    pub(crate) fn controller_auditing(audit_log: Option<PathBuf>) -> Controller<FakePlane> {
        let settings = Settings {
            limits: Limits { max_vips: 4 },
            seed: 1,
            flow_idle: Duration::from_secs(30),
            state_file: None,
            audit_log,
            config_hash: 0,
        };
        Controller::new(
            State::default(),
            &State::default(),
            FakePlane::default(),
            settings,
        )
        .unwrap()
    }

    pub(crate) fn info() -> DaemonInfo {
        DaemonInfo {
            version: "test".into(),
            started: Instant::now(),
            interfaces: vec![("eth0".into(), "native".into())],
            pin_dir: "/sys/fs/bpf/sluice".into(),
            reused: false,
            telemetry: Arc::new(std::sync::Mutex::new(Hub::new(Duration::from_secs(3)))),
            refused: Arc::default(),
            policy_step_ns: Default::default(),
            announce: None,
            fleet: None,
        }
    }

    pub(crate) struct TestServer {
        pub socket: PathBuf,
        pub ctl: Arc<Mutex<Controller<FakePlane>>>,
        pub info: Arc<DaemonInfo>,
        stop: Option<tokio::sync::oneshot::Sender<()>>,
        thread: Option<std::thread::JoinHandle<()>>,
        // Last: removed after Drop below has stopped the server's thread.
        pub dir: TestDir,
    }

    impl TestServer {
        pub(crate) fn start() -> TestServer {
            TestServer::start_with(crate::limits::ADMIN)
        }

        pub(crate) fn start_with(limits: ListenerLimits) -> TestServer {
            let dir = TestDir::new("admin");
            let info = Arc::new(info());
            // A directory that does not exist yet: bind creates it.
            let socket = dir.join("run/admin.sock");
            let ctl = Arc::new(Mutex::new(controller_auditing(Some(
                dir.join("audit.jsonl"),
            ))));
            let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
            let (ready_tx, ready) = std::sync::mpsc::channel();
            let thread = std::thread::spawn({
                let (ctl, socket, info) = (Arc::clone(&ctl), socket.clone(), info.clone());
                move || {
                    let rt = tokio::runtime::Builder::new_current_thread()
                        .enable_all()
                        .build()
                        .unwrap();
                    rt.block_on(async move {
                        let sock = AdminSocket {
                            path: socket,
                            mode: 0o660,
                            group: None,
                        };
                        let listener = bind(&sock).unwrap();
                        // Spawned, as the daemon does: this checks the future is Send.
                        let task = tokio::spawn(serve(listener, ctl, info, limits, async {
                            let _ = stopped.await;
                        }));
                        ready_tx.send(()).unwrap();
                        task.await.unwrap().unwrap();
                    });
                }
            });
            ready.recv().unwrap();
            TestServer {
                dir,
                socket,
                ctl,
                info,
                stop: Some(stop),
                thread: Some(thread),
            }
        }

        pub(crate) fn client(&self) -> Client {
            Client::new(&self.socket)
        }

        pub(crate) fn state(&self) -> State {
            self.ctl.blocking_lock().state().clone()
        }
    }

    impl Drop for TestServer {
        fn drop(&mut self) {
            let _ = self.stop.take().unwrap().send(());
            let _ = self.thread.take().unwrap().join();
        }
    }
}

#[cfg(test)]
mod tests;
