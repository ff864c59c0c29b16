//! The I/O shell around the model: the serving listeners (OpenAI API, health, telemetry),
//! the control listener (faults, state) and the engine loop that runs the model's steps on
//! the wall clock and hands their tokens to the waiting responses.

use std::{
    collections::HashMap,
    convert::Infallible,
    net::SocketAddr,
    pin::Pin,
    sync::{Arc, Mutex, MutexGuard},
    task::{Context, Poll},
    time::{Duration, SystemTime, UNIX_EPOCH},
};

use anyhow::{Context as _, Result};
use bytes::Bytes;
use http_body_util::{combinators::BoxBody, BodyExt, Full, Limited};
use hyper::{
    body::{Body, Frame, Incoming},
    header::{HeaderValue, CONTENT_TYPE},
    server::conn::http1,
    service::service_fn,
    Method, Request, Response, StatusCode,
};
use hyper_util::rt::TokioIo;
use serde_json::json;
use tokio::{
    net::TcpListener,
    sync::{mpsc, Notify},
    time::Instant,
};

use crate::{
    fault::{FaultRequest, Faults},
    model::{Engine, Event, Params, SeqId},
    openai::{self, Api, Writer},
    telemetry::{self, Fabric, Recent, Snapshot},
};

/// The header naming the backend on every response.
pub const BACKEND_HEADER: &str = "x-sluice-backend";
/// Largest request body read.
const MAX_BODY_BYTES: usize = 1 << 20;
/// Exit status after a `kill` fault.
pub const KILLED_EXIT_STATUS: i32 = 3;

#[derive(Clone, Debug)]
pub struct Config {
    pub name: String,
    pub listen: Vec<SocketAddr>,
    pub control: SocketAddr,
    /// Start-up speed factor (`--slow`), 1.0 for a healthy accelerator.
    pub base_speed: f64,
    pub seed: u64,
    pub model: String,
    pub params: Params,
}

/// What a response waits for.
enum Out {
    Token {
        index: u32,
        last: bool,
    },
    /// The end; `cached_tokens` of the prompt came from the prefix cache.
    Done {
        cached_tokens: u32,
    },
}

struct Waiter {
    tx: mpsc::UnboundedSender<Out>,
    max_tokens: u32,
}

struct State {
    engine: Engine,
    waiters: HashMap<SeqId, Waiter>,
    faults: Faults,
    fabric: Fabric,
    recent: Recent,
    /// The pages as they were when `freeze` began.
    frozen: Option<[String; 3]>,
    /// What the pages show while they lie: idle, with the counters of when `lie` began.
    lying: Option<Snapshot>,
    next_id: SeqId,
    dying: bool,
}

struct Shared {
    cfg: Config,
    state: Mutex<State>,
    /// Wakes the idle engine loop (a new request, a fault cleared).
    wake: Notify,
    /// Wakes hung handlers when the hang is cleared.
    unhang: Notify,
    start: Instant,
    gpu_uuids: Vec<String>,
}

impl Shared {
    fn lock(&self) -> MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }

    fn now_s(&self) -> f64 {
        self.start.elapsed().as_secs_f64()
    }

    fn snapshot(&self, st: &State) -> Snapshot {
        Snapshot {
            name: self.cfg.name.clone(),
            model: self.cfg.model.clone(),
            gpu_uuids: self.gpu_uuids.clone(),
            running: st.engine.running(),
            waiting: st.engine.waiting(),
            kv_fraction: st.engine.kv_used_fraction(),
            totals: st.engine.totals().clone(),
            utilisation: st.recent.utilisation(self.now_s()),
            throttle: st.faults.throttle_at(self.now_s()),
            fabric: st.fabric.clone(),
        }
    }

    fn pages(&self, st: &State) -> [String; 3] {
        let s = st.lying.clone().unwrap_or_else(|| self.snapshot(st));
        [
            telemetry::vllm_page(&s),
            telemetry::dcgm_page(&s),
            telemetry::roce_page(&s),
        ]
    }

    fn state_json(&self, st: &State) -> serde_json::Value {
        let now = self.now_s();
        json!({
            "name": self.cfg.name,
            "running": st.engine.running(),
            "waiting": st.engine.waiting(),
            "kv_used_fraction": st.engine.kv_used_fraction(),
            "tokens_per_s": st.recent.tokens_per_s(now),
            "step_ms": st.engine.last_step_s() * 1000.0,
            "fault": st.faults.describe(),
            "speed": st.faults.speed(self.cfg.base_speed, now),
            "utilisation": st.recent.utilisation(now),
            "finished": st.engine.totals().finished,
            "preemptions": st.engine.totals().preemptions,
            "prefix_cache_queries": st.engine.totals().prefix_cache_queries,
            "prefix_cache_hits": st.engine.totals().prefix_cache_hits,
        })
    }
}

/// Binds every listener, then serves until killed. `ready` gets the bound addresses (serving
/// listeners first, the control listener last) once all accept.
pub async fn run(cfg: Config, ready: impl FnOnce(&[SocketAddr], SocketAddr)) -> Result<()> {
    let mut engine = Engine::new(cfg.params.clone()).map_err(anyhow::Error::msg)?;
    engine.set_speed(cfg.base_speed);
    let mut serving = Vec::new();
    for addr in &cfg.listen {
        serving.push(
            TcpListener::bind(addr)
                .await
                .with_context(|| format!("binding the serving listener {addr}"))?,
        );
    }
    let control = TcpListener::bind(cfg.control)
        .await
        .with_context(|| format!("binding the control listener {}", cfg.control))?;
    let bound: Vec<SocketAddr> = serving
        .iter()
        .map(|l| l.local_addr())
        .collect::<Result<_, _>>()?;
    // Stable per name and seed, distinct per GPU.
    let gpu_uuids = (0..telemetry::GPUS)
        .map(|i| {
            format!(
                "GPU-{:08x}-{i:04x}-4000-8000-{:012x}",
                cfg.seed as u32,
                openai::fnv(&cfg.name) & 0xffff_ffff_ffff
            )
        })
        .collect();
    let shared = Arc::new(Shared {
        state: Mutex::new(State {
            engine,
            waiters: HashMap::new(),
            faults: Faults::default(),
            fabric: Fabric::default(),
            recent: Recent::default(),
            frozen: None,
            lying: None,
            next_id: 0,
            dying: false,
        }),
        cfg,
        wake: Notify::new(),
        unhang: Notify::new(),
        start: Instant::now(),
        gpu_uuids,
    });
    for l in serving {
        tokio::spawn(accept_loop(l, shared.clone(), false));
    }
    ready(&bound, control.local_addr()?);
    tokio::spawn(accept_loop(control, shared.clone(), true));
    engine_loop(shared).await;
    Ok(())
}

async fn accept_loop(listener: TcpListener, sh: Arc<Shared>, control: bool) {
    loop {
        let stream = match listener.accept().await {
            Ok((s, _)) => s,
            Err(e) => {
                // EMFILE and the like: back off instead of spinning.
                eprintln!("accept: {e}");
                tokio::time::sleep(Duration::from_millis(50)).await;
                continue;
            }
        };
        let _ = stream.set_nodelay(true);
        let sh = sh.clone();
        tokio::spawn(async move {
            let svc = service_fn(move |req| {
                let sh = sh.clone();
                async move {
                    let mut resp = if control {
                        control_request(req, &sh).await
                    } else {
                        serving_request(req, &sh).await
                    };
                    if let Ok(v) = HeaderValue::from_str(&sh.cfg.name) {
                        resp.headers_mut().insert(BACKEND_HEADER, v);
                    }
                    Ok::<_, Infallible>(resp)
                }
            });
            // Errors here are clients going away mid-response: nothing to do.
            let _ = http1::Builder::new()
                .serve_connection(TokioIo::new(stream), svc)
                .await;
        });
    }
}

type Resp = Response<BoxBody<Bytes, Infallible>>;

fn full(status: StatusCode, content_type: &str, body: impl Into<Bytes>) -> Resp {
    let mut r = Response::new(Full::new(body.into()).boxed());
    *r.status_mut() = status;
    if let Ok(v) = HeaderValue::from_str(content_type) {
        r.headers_mut().insert(CONTENT_TYPE, v);
    }
    r
}

fn json_resp(status: StatusCode, v: &serde_json::Value) -> Resp {
    full(status, "application/json", v.to_string())
}

async fn read_body(req: Request<Incoming>) -> Result<Bytes, Resp> {
    match Limited::new(req.into_body(), MAX_BODY_BYTES)
        .collect()
        .await
    {
        Ok(b) => Ok(b.to_bytes()),
        Err(e) => Err(json_resp(
            StatusCode::BAD_REQUEST,
            &openai::error(
                &format!("reading the request body: {e} (the limit is {MAX_BODY_BYTES} bytes)"),
                "invalid_request_error",
            ),
        )),
    }
}

/// Waits while the accelerator is hung (for ever, unless the hang is cleared).
async fn hang_while_hung(sh: &Shared) {
    loop {
        let notified = sh.unhang.notified();
        if !sh.lock().faults.hang {
            return;
        }
        notified.await;
    }
}

async fn serving_request(req: Request<Incoming>, sh: &Arc<Shared>) -> Resp {
    hang_while_hung(sh).await;
    let page = |i: usize| {
        let st = sh.lock();
        let text = match &st.frozen {
            Some(p) => p[i].clone(),
            None => sh.pages(&st)[i].clone(),
        };
        full(
            StatusCode::OK,
            "text/plain; version=0.0.4; charset=utf-8",
            text,
        )
    };
    match (req.method(), req.uri().path()) {
        (&Method::POST, "/v1/completions") => completion(req, sh, Api::Completions).await,
        (&Method::POST, "/v1/chat/completions") => completion(req, sh, Api::Chat).await,
        (&Method::GET, "/health") => full(StatusCode::OK, "text/plain", "ok\n"),
        (&Method::GET, "/metrics") => page(0),
        (&Method::GET, "/dcgm") => page(1),
        (&Method::GET, "/roce") => page(2),
        (m, p) => json_resp(
            StatusCode::NOT_FOUND,
            &openai::error(
                &format!(
                    "no route {m} {p}; served: POST /v1/completions, POST \
                     /v1/chat/completions, GET /health, /metrics, /dcgm, /roce"
                ),
                "not_found",
            ),
        ),
    }
}

async fn completion(req: Request<Incoming>, sh: &Arc<Shared>, api: Api) -> Resp {
    let body = match read_body(req).await {
        Ok(b) => b,
        Err(r) => return r,
    };
    let job = match openai::parse(api, &body) {
        Ok(j) => j,
        Err(e) => {
            return json_resp(
                StatusCode::BAD_REQUEST,
                &openai::error(&e, "invalid_request_error"),
            )
        }
    };
    let (tx, mut rx) = mpsc::unbounded_channel();
    let created = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_secs());
    let model = job.model.as_deref().unwrap_or(&sh.cfg.model);
    let (id, writer) = {
        let mut st = sh.lock();
        let id = st.next_id;
        let writer = Writer::new(api, &sh.cfg.name, id, model, created, sh.cfg.seed);
        // With content, the engine learns the answer's tokens too: its blocks stay cached
        // for the next turn, which sends the answer back.
        let submitted = match &job.prompt_ids {
            Some(ids) => {
                let output = writer.token_ids(job.max_tokens);
                st.engine.submit_tokens(id, ids, &output, sh.now_s())
            }
            None => st
                .engine
                .submit(id, job.prompt_tokens, job.max_tokens, sh.now_s()),
        };
        if let Err(e) = submitted {
            return json_resp(
                StatusCode::BAD_REQUEST,
                &openai::error(&e.to_string(), "invalid_request_error"),
            );
        }
        st.next_id += 1;
        st.waiters.insert(
            id,
            Waiter {
                tx,
                max_tokens: job.max_tokens,
            },
        );
        (id, writer)
    };
    sh.wake.notify_one();
    let guard = CancelOnDrop { sh: sh.clone(), id };
    if job.stream {
        let mut r = Response::new(
            SseBody {
                rx,
                writer,
                usage: job.stream_usage.then_some(job.prompt_tokens),
                tokens: 0,
                done: false,
                _guard: guard,
            }
            .boxed(),
        );
        let h = r.headers_mut();
        h.insert(CONTENT_TYPE, HeaderValue::from_static("text/event-stream"));
        h.insert("cache-control", HeaderValue::from_static("no-cache"));
        return r;
    }
    let (mut tokens, mut cached) = (0, 0);
    while let Some(out) = rx.recv().await {
        match out {
            Out::Token { index, .. } => tokens = index,
            Out::Done { cached_tokens } => {
                cached = cached_tokens;
                break;
            }
        }
    }
    drop(guard);
    json_resp(
        StatusCode::OK,
        &writer.whole(job.prompt_tokens, tokens, cached),
    )
}

/// Takes a request out of the engine when its answer is dropped before the end (the client
/// went away), so an abandoned request neither waits in the queue nor holds KV cache. After
/// the end it finds nothing to do.
struct CancelOnDrop {
    sh: Arc<Shared>,
    id: SeqId,
}

impl Drop for CancelOnDrop {
    fn drop(&mut self) {
        let mut st = self.sh.lock();
        if st.waiters.remove(&self.id).is_some() {
            st.engine.cancel(self.id);
        }
    }
}

/// A streaming answer: each token the engine hands over becomes an SSE chunk; tokens that
/// arrived together go out in one write.
struct SseBody {
    rx: mpsc::UnboundedReceiver<Out>,
    writer: Writer,
    /// The prompt's tokens, when the usage chunk is asked for.
    usage: Option<u32>,
    /// Tokens sent so far.
    tokens: u32,
    done: bool,
    _guard: CancelOnDrop,
}

impl Body for SseBody {
    type Data = Bytes;
    type Error = Infallible;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, Infallible>>> {
        if self.done {
            return Poll::Ready(None);
        }
        let mut text = String::new();
        let mut add = |this: &mut SseBody, out: Out| match out {
            Out::Token { index, last } => {
                this.tokens = index;
                text.push_str(&this.writer.chunk(index, last));
            }
            Out::Done { cached_tokens } => {
                if let Some(prompt) = this.usage {
                    text.push_str(&this.writer.usage_chunk(prompt, this.tokens, cached_tokens));
                }
                text.push_str(openai::DONE);
                this.done = true;
            }
        };
        match self.rx.poll_recv(cx) {
            Poll::Pending => return Poll::Pending,
            // The engine dropped the request (the process is dying): end without [DONE].
            Poll::Ready(None) => return Poll::Ready(None),
            Poll::Ready(Some(out)) => add(&mut self, out),
        }
        while !self.done {
            match self.rx.try_recv() {
                Ok(out) => add(&mut self, out),
                Err(_) => break,
            }
        }
        Poll::Ready(Some(Ok(Frame::data(Bytes::from(text)))))
    }
}

async fn control_request(req: Request<Incoming>, sh: &Arc<Shared>) -> Resp {
    match (req.method(), req.uri().path()) {
        (&Method::GET, "/state") => {
            let st = sh.lock();
            json_resp(StatusCode::OK, &sh.state_json(&st))
        }
        (&Method::POST, "/fault") => {
            let body = match read_body(req).await {
                Ok(b) => b,
                Err(r) => return r,
            };
            let fault: FaultRequest = match serde_json::from_slice(&body) {
                Ok(f) => f,
                Err(e) => {
                    return json_resp(
                        StatusCode::BAD_REQUEST,
                        &json!({"error": format!(
                            "{e}; expected {{\"kind\": \"throttle\"|\"congest\"|\"slow\", \
                             \"factor\": 0..1}}, {{\"kind\": \"flap\", \"factor\": 0..1, \
                             \"period_s\": SECONDS}} or {{\"kind\": \
                             \"hang\"|\"freeze\"|\"lie\"|\"kill\"|\"clear\"}}"
                        )}),
                    )
                }
            };
            apply_fault(sh, &fault)
        }
        (m, p) => json_resp(
            StatusCode::NOT_FOUND,
            &json!({"error": format!("no route {m} {p}; control serves GET /state, POST /fault")}),
        ),
    }
}

fn apply_fault(sh: &Arc<Shared>, fault: &FaultRequest) -> Resp {
    let mut st = sh.lock();
    if *fault == FaultRequest::Kill {
        st.dying = true;
        let body = json!({"name": sh.cfg.name, "fault": "kill"});
        // Answer first, then die: the caller learns the kill was taken.
        tokio::spawn(async {
            tokio::time::sleep(Duration::from_millis(20)).await;
            die();
        });
        return json_resp(StatusCode::OK, &body);
    }
    let was_frozen = st.faults.freeze;
    let now = sh.now_s();
    if let Err(e) = st.faults.apply(fault, now) {
        return json_resp(StatusCode::BAD_REQUEST, &json!({ "error": e }));
    }
    let speed = st.faults.speed(sh.cfg.base_speed, now);
    st.engine.set_speed(speed);
    if st.faults.lie && st.lying.is_none() {
        st.lying = Some(sh.snapshot(&st).idle());
    } else if !st.faults.lie {
        st.lying = None;
    }
    if st.faults.freeze && !was_frozen {
        st.frozen = Some(sh.pages(&st));
    } else if !st.faults.freeze {
        st.frozen = None;
    }
    if !st.faults.hang {
        sh.unhang.notify_waiters();
        sh.wake.notify_one();
    }
    json_resp(StatusCode::OK, &sh.state_json(&st))
}

/// Exits at once with every TCP connection reset, as a crashed server's peers see it: each
/// socket gets SO_LINGER 0, so closing it (at exit) sends RST instead of FIN.
fn die() -> ! {
    if let Ok(dir) = std::fs::read_dir("/proc/self/fd") {
        let linger = libc::linger {
            l_onoff: 1,
            l_linger: 0,
        };
        for fd in dir
            .flatten()
            .filter_map(|e| e.file_name().to_str()?.parse().ok())
        {
            // Fails harmlessly (ENOTSOCK) on descriptors that are not sockets.
            // SAFETY: setsockopt reads `linger` for its size; a bad fd is an error return.
            unsafe {
                libc::setsockopt(
                    fd,
                    libc::SOL_SOCKET,
                    libc::SO_LINGER,
                    (&linger as *const libc::linger).cast(),
                    std::mem::size_of::<libc::linger>() as libc::socklen_t,
                );
            }
        }
    }
    std::process::exit(KILLED_EXIT_STATUS);
}

/// Runs the model's steps on the wall clock: plan a step, wait its duration, hand out its
/// tokens. Idle (or hung) it waits for a wake-up.
async fn engine_loop(sh: Arc<Shared>) {
    loop {
        let start_s = sh.now_s();
        let step = {
            let mut st = sh.lock();
            if st.faults.hang || st.dying {
                None
            } else {
                // A flap changes the speed on its own schedule: each step takes the
                // speed in force when it starts.
                let speed = st.faults.speed(sh.cfg.base_speed, start_s);
                st.engine.set_speed(speed);
                st.engine.step(start_s)
            }
        };
        let Some(step) = step else {
            sh.wake.notified().await;
            continue;
        };
        let end_s = start_s + step.duration_s;
        tokio::time::sleep_until(sh.start + Duration::from_secs_f64(end_s)).await;
        let mut st = sh.lock();
        if st.dying {
            continue;
        }
        let congest = st.faults.congest;
        st.fabric.on_step(step.tokens, congest);
        let emitted = step
            .events
            .iter()
            .filter(|e| matches!(e, Event::Token { .. }))
            .count() as u64;
        st.recent.push(start_s, end_s, emitted);
        for ev in step.events {
            match ev {
                Event::Token { id, index } => {
                    let Some(w) = st.waiters.get(&id) else {
                        continue;
                    };
                    let last = index >= w.max_tokens;
                    if w.tx.send(Out::Token { index, last }).is_err() {
                        // The client went away: free its place in the engine.
                        st.waiters.remove(&id);
                        st.engine.cancel(id);
                    }
                }
                Event::Finished { id, cached_tokens } => {
                    if let Some(w) = st.waiters.remove(&id) {
                        let _ = w.tx.send(Out::Done { cached_tokens });
                    }
                }
            }
        }
    }
}
