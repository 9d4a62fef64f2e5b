//! The HTTP side: parse and check a request, admit it to the queue, tokenise its prompt, queue
//! it for the engine and turn the engine's events into an OpenAI response, streamed
//! (server-sent events ending with `data: [DONE]`) or whole.

use std::convert::Infallible;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use crate::accept::Acceptor;
use crate::attach::Attached;
use axum::extract::ws::rejection::WebSocketUpgradeRejection;
use axum::extract::ws::WebSocketUpgrade;
use engine_core::link::secure::wire_limit;
use engine_core::link::ws::PageOrigin;

use super::helper_socket::SocketLink;
use axum::body::Bytes;
use axum::extract::rejection::BytesRejection;
use axum::extract::{ConnectInfo, DefaultBodyLimit, Path, Request, State};
use axum::http::{header, HeaderMap, HeaderValue, StatusCode};
use axum::middleware::{self, Next};
use axum::response::sse::{Event as Sse, KeepAlive};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::{Json, Router};
use engine_core::tokenizer::Tokenizer;
use futures_util::stream;
use serde_json::{json, Value};
use tokio::sync::mpsc::{unbounded_channel, UnboundedReceiver};
use tokio::sync::Semaphore;

use super::api::{self, ApiError, ChatRequest, CompletionRequest, Prompt, Settings};
use super::connections;
use super::cross_site::{self, Cors};
use super::memory::{self, Footprint};
use super::metrics::Metrics;
use super::page;
use super::queue::{Admission, Event, Finish, Job, Queue, Refused, Ticket};
use super::telemetry::{self, Hub};

/// Largest request body: a whole long context of text, with room to spare.
const MAX_BODY: usize = 64 << 20;

/// Bytes of text per position of the context a prompt may have before it is tokenised: four
/// times English prose's average, so only text of long single-token runs that would fit is
/// refused, and a prompt that cannot fit is refused without tokenising megabytes first.
const PROMPT_BYTES_PER_TOKEN: usize = 16;

/// What every handler shares.
pub struct App {
    /// The model id clients name in `model`.
    pub name: String,
    pub created: u64,
    pub tokenizer: Tokenizer,
    pub vocab: usize,
    /// Positions a request may use: prompt plus completion.
    pub ctx: usize,
    /// Positions of the context whose KV the helper holds (its offer), for `/health`.
    pub ctx_on_helper: usize,
    /// What the context costs, for `/health`.
    pub footprint: Footprint,
    pub queue: Arc<Queue>,
    /// Tokenisations that may run at once (one per core): each holds many times its text in
    /// memory while it runs.
    pub tokenisers: Semaphore,
    pub cors: Arc<Cors>,
    pub metrics: Arc<Metrics>,
    /// Where helpers that dial `/helper` come in (`--accept-helpers` with no address).
    pub acceptor: Option<Arc<std::sync::OnceLock<Acceptor>>>,
    /// The helpers' frame limit (`--max-frame`).
    pub helper_frame: usize,
    /// The helpers and their links' traffic, with `--helper` or `--accept-helpers`.
    pub helpers: Option<Arc<std::sync::Mutex<Vec<Attached>>>>,
    pub timeout: Duration,
    pub next_id: AtomicU64,
    /// The split as it runs, for `/v1/telemetry`.
    pub hub: Arc<Hub>,
}

pub fn router(app: Arc<App>) -> Router {
    let page = page::paths().fold(Router::new(), |r, p| r.route(p, get(page::file)));
    page.route("/v1/chat/completions", post(chat))
        .route("/v1/completions", post(completions))
        .route("/v1/models", get(models))
        .route("/v1/models/{id}", get(model))
        .route("/health", get(health))
        .route("/metrics", get(metrics))
        .route("/v1/telemetry", get(watch))
        .route("/helper", get(helper))
        .route("/helper/", get(lend))
        .route("/helper/{*file}", get(lend))
        .route("/weights/{*tensor}", get(lend))
        .fallback(|| async { ApiError::not_found("no such endpoint").with_code("unknown_url") })
        .method_not_allowed_fallback(|| async {
            ApiError::new(
                StatusCode::METHOD_NOT_ALLOWED,
                "invalid_request_error",
                "this endpoint does not take that method",
            )
        })
        // Innermost: a body is parsed only once it is known to be JSON, and counted.
        .layer(middleware::from_fn(|req, next| {
            connections::body_in_time(MAX_BODY, req, next)
        }))
        .layer(middleware::from_fn(|req, next| {
            cross_site::require_json(MAX_BODY, req, next)
        }))
        .layer(middleware::from_fn_with_state(app.clone(), count))
        .layer(DefaultBodyLimit::max(MAX_BODY))
        .layer(middleware::from_fn_with_state(
            app.cors.clone(),
            cross_site::cors,
        ))
        .with_state(app)
}

/// Count every response by route and status, for `/metrics`.
async fn count(State(app): State<Arc<App>>, req: Request, next: Next) -> Response {
    let route = match req.uri().path() {
        "/v1/chat/completions" => "/v1/chat/completions",
        "/v1/completions" => "/v1/completions",
        p if p.starts_with("/v1/models") => "/v1/models",
        "/health" => "/health",
        "/metrics" => "/metrics",
        "/v1/telemetry" => "/v1/telemetry",
        p if page::paths().any(|q| q == p) => "/",
        _ => "other",
    };
    let r = next.run(req).await;
    app.metrics.response(route, r.status().as_u16());
    r
}

pub fn unix_now() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_secs())
}

fn body_error(rejection: BytesRejection) -> ApiError {
    ApiError::new(
        rejection.status(),
        "invalid_request_error",
        rejection.body_text(),
    )
}

async fn chat(State(app): State<Arc<App>>, body: Result<Bytes, BytesRejection>) -> Response {
    let run = async {
        let body = body.map_err(body_error)?;
        let req: ChatRequest = api::parse(&body)?;
        app.check_model(&req.common.model)?;
        let settings = req.common.validate()?;
        let messages = req.chat_messages()?;
        let text = messages.iter().map(|m| m.content.len()).sum();
        let admission = app.admit("messages", body.len(), text)?;
        // Only the messages are needed from here on.
        drop((body, req));
        let tok = app.tokenizer.clone();
        let (prompt, breaks) = app
            .tokenise("messages", move || {
                let prompt = tok.encode_chat(&messages, true)?;
                let breaks = tok.chat_breaks(&messages, &prompt);
                Ok((prompt, breaks))
            })
            .await?;
        app.submit(admission, true, prompt, breaks, settings).await
    };
    run.await.unwrap_or_else(IntoResponse::into_response)
}

async fn completions(State(app): State<Arc<App>>, body: Result<Bytes, BytesRejection>) -> Response {
    let run = async {
        let body = body.map_err(body_error)?;
        let req: CompletionRequest = api::parse(&body)?;
        app.check_model(&req.common.model)?;
        let settings = req.common.validate()?;
        let prompt = req.prompt()?;
        let text = match &prompt {
            Prompt::Text(t) => t.len(),
            Prompt::Ids(_) => 0,
        };
        let admission = app.admit("prompt", body.len(), text)?;
        // Only the prompt is needed from here on.
        drop((body, req));
        let prompt = match prompt {
            Prompt::Ids(ids) => ids,
            Prompt::Text(text) => {
                let tok = app.tokenizer.clone();
                app.tokenise("prompt", move || tok.encode_text(&text))
                    .await?
            }
        };
        app.submit(admission, false, prompt, Vec::new(), settings)
            .await
    };
    run.await.unwrap_or_else(IntoResponse::into_response)
}

impl App {
    /// Refuse a prompt whose `text` bytes cannot fit the context (before any is tokenised),
    /// then take a place in the queue for the request.
    fn admit(&self, param: &str, body: usize, text: usize) -> Result<Admission, ApiError> {
        let max = self.ctx.saturating_mul(PROMPT_BYTES_PER_TOKEN);
        if text > max {
            return Err(ApiError::param(
                param,
                format!(
                    "The prompt has {text} bytes of text; this server tokenises at most {max} \
                     ({PROMPT_BYTES_PER_TOKEN} per position of its {}-token context). Please \
                     reduce the length of the {param}.",
                    self.ctx
                ),
            )
            .with_code("context_length_exceeded"));
        }
        self.queue
            .admit(memory::request_bytes(body, self.ctx))
            .map_err(|r| self.refused(r))
    }

    /// The 503 for a request the queue refused.
    fn refused(&self, r: Refused) -> ApiError {
        match r {
            Refused::Full => {
                self.metrics.rejected();
                let load = self.queue.load();
                ApiError::unavailable(
                    format!(
                        "the server is busy ({} requests waiting, holding {} of {} KiB); retry later",
                        load.waiting,
                        load.bytes >> 10,
                        load.budget >> 10
                    ),
                    self.metrics.retry_after(load.waiting),
                )
                .with_code("queue_full")
            }
            Refused::Closed => {
                ApiError::unavailable("the engine has stopped", 60).with_code("engine_stopped")
            }
        }
    }

    /// Tokenise an admitted prompt off the async workers, at most one per core at a time. Its
    /// errors (a template that raised, text the vocabulary cannot hold) are the request's
    /// fault, reported against `param`.
    async fn tokenise<T: Send + 'static>(
        &self,
        param: &str,
        f: impl FnOnce() -> engine_core::Result<T> + Send + 'static,
    ) -> Result<T, ApiError> {
        let _turn = self
            .tokenisers
            .acquire()
            .await
            .map_err(|e| ApiError::server(format!("tokenising failed: {e}")))?;
        let t = Instant::now();
        let out = tokio::task::spawn_blocking(f)
            .await
            .map_err(|e| ApiError::server(format!("tokenising failed: {e}")))?
            .map_err(|e| ApiError::invalid(e.to_string()).with_param(param));
        self.metrics.tokenised(t.elapsed().as_secs_f64());
        out
    }

    fn check_model(&self, model: &str) -> Result<(), ApiError> {
        if model == self.name {
            Ok(())
        } else {
            Err(ApiError::not_found(format!(
                "The model `{model}` does not exist; this server serves `{}`",
                self.name
            ))
            .with_param("model")
            .with_code("model_not_found"))
        }
    }

    /// Check the prompt against the vocabulary and the context, queue it, and answer.
    async fn submit(
        &self,
        admission: Admission,
        chat: bool,
        prompt: Vec<u32>,
        breaks: Vec<usize>,
        s: Settings,
    ) -> Result<Response, ApiError> {
        let param = if chat { "messages" } else { "prompt" };
        if prompt.is_empty() {
            return Err(ApiError::param(param, "the prompt is empty"));
        }
        if let Some(&id) = prompt.iter().find(|&&t| t as usize >= self.vocab) {
            return Err(ApiError::param(
                param,
                format!(
                    "token id {id} is outside the vocabulary (size {})",
                    self.vocab
                ),
            ));
        }
        let too_long = |completion: usize| {
            ApiError::param(
                param,
                format!(
                    "This model's maximum context length is {} tokens. However, you requested {} tokens \
                     ({} in the {param}, {completion} in the completion). Please reduce the length of the {param} or completion.",
                    self.ctx,
                    prompt.len().saturating_add(completion),
                    prompt.len()
                ),
            )
            .with_code("context_length_exceeded")
        };
        let room = self.ctx.saturating_sub(prompt.len());
        if room == 0 {
            return Err(too_long(1));
        }
        let max_tokens = match s.max_tokens {
            None => room,
            Some(m) if m <= room => m,
            Some(m) => return Err(too_long(m)),
        };
        let id = self.next_id.fetch_add(1, Ordering::Relaxed);
        let (events, rx) = unbounded_channel();
        let cancel = Arc::new(AtomicBool::new(false));
        let deadline = Instant::now() + self.timeout;
        let job = Job {
            id,
            prompt,
            breaks,
            max_tokens,
            sampling: s.sampling,
            stop: s.stop,
            deadline,
            cancel: cancel.clone(),
            events,
        };
        self.queue
            .push(job, admission)
            .map_err(|r| self.refused(r))?;
        let events = Events {
            rx,
            deadline: Some(deadline),
            timeout_s: self.timeout.as_secs(),
            ticket: Ticket {
                id,
                cancel,
                queue: self.queue.clone(),
                metrics: self.metrics.clone(),
            },
        };
        let meta = Meta {
            chat,
            id: format!("{}-{id}", if chat { "chatcmpl" } else { "cmpl" }),
            created: unix_now(),
            model: self.name.clone(),
            include_usage: s.include_usage,
        };
        if s.stream {
            Ok(stream_response(events, meta))
        } else {
            whole_response(events, meta).await
        }
    }
}

/// A queued request's events, with its place in the queue: dropping this (the client left)
/// cancels the request.
struct Events {
    rx: UnboundedReceiver<Event>,
    /// While the request may still be waiting in the queue: when the time limit runs out there
    /// it is taken out and answered with a timeout. Once running, the engine keeps the limit.
    deadline: Option<Instant>,
    timeout_s: u64,
    ticket: Ticket,
}

impl Events {
    async fn next(&mut self) -> Event {
        loop {
            let ev = match self.deadline {
                Some(d) => match tokio::time::timeout_at(d.into(), self.rx.recv()).await {
                    Ok(ev) => ev,
                    Err(_) => {
                        self.deadline = None;
                        if self.ticket.queue.remove(self.ticket.id) {
                            self.ticket.metrics.timed_out();
                            return Event::Failed(ApiError::timeout(self.timeout_s));
                        }
                        continue;
                    }
                },
                None => self.rx.recv().await,
            };
            return ev.unwrap_or_else(|| {
                Event::Failed(ApiError::server(
                    "the engine stopped before the request finished",
                ))
            });
        }
    }
}

/// The fixed parts of a response and how to build each shape of it.
struct Meta {
    chat: bool,
    id: String,
    created: u64,
    model: String,
    include_usage: bool,
}

fn usage(f: &Finish) -> Value {
    json!({
        "prompt_tokens": f.prompt_tokens,
        "completion_tokens": f.completion_tokens,
        "total_tokens": f.prompt_tokens + f.completion_tokens,
        "prompt_tokens_details": {"cached_tokens": f.cached_tokens},
    })
}

impl Meta {
    fn object(&self, stream: bool) -> &'static str {
        match (self.chat, stream) {
            (true, false) => "chat.completion",
            (true, true) => "chat.completion.chunk",
            (false, _) => "text_completion",
        }
    }

    fn envelope(&self, stream: bool, choices: Value) -> Value {
        json!({
            "id": self.id,
            "object": self.object(stream),
            "created": self.created,
            "model": self.model,
            "choices": choices,
        })
    }

    fn whole(&self, text: String, f: &Finish) -> Value {
        let choice = if self.chat {
            json!({"index": 0, "message": {"role": "assistant", "content": text},
                   "logprobs": null, "finish_reason": f.reason.as_str()})
        } else {
            json!({"index": 0, "text": text, "logprobs": null, "finish_reason": f.reason.as_str()})
        };
        let mut v = self.envelope(false, json!([choice]));
        v["usage"] = usage(f);
        v
    }

    /// One streamed piece; `finish` on the last (with empty text).
    fn chunk(&self, delta: Value, text: &str, finish: Option<&str>) -> Value {
        let choice = if self.chat {
            json!({"index": 0, "delta": delta, "logprobs": null, "finish_reason": finish})
        } else {
            json!({"index": 0, "text": text, "logprobs": null, "finish_reason": finish})
        };
        self.envelope(true, json!([choice]))
    }
}

async fn whole_response(mut events: Events, meta: Meta) -> Result<Response, ApiError> {
    let mut text = String::new();
    loop {
        match events.next().await {
            Event::Text(t) => text.push_str(&t),
            Event::Done(f) => return Ok(Json(meta.whole(text, &f)).into_response()),
            Event::Failed(e) => return Err(e),
        }
    }
}

/// Where a streamed response is.
enum Phase {
    /// Chat streams open with the assistant's role.
    Start,
    Body,
    Usage(Finish),
    Done,
    End,
}

fn data(v: &Value) -> Sse {
    Sse::default().data(v.to_string())
}

fn stream_response(events: Events, meta: Meta) -> Response {
    let s = stream::unfold(
        (events, meta, Phase::Start),
        |(mut events, meta, phase)| async move {
            let (event, next) = match phase {
                Phase::End => return None,
                Phase::Start if meta.chat => (
                    data(&meta.chunk(json!({"role": "assistant", "content": ""}), "", None)),
                    Phase::Body,
                ),
                Phase::Start | Phase::Body => match events.next().await {
                    Event::Text(t) => (
                        data(&meta.chunk(json!({"content": t}), &t, None)),
                        Phase::Body,
                    ),
                    Event::Done(f) => {
                        let last = data(&meta.chunk(json!({}), "", Some(f.reason.as_str())));
                        (
                            last,
                            if meta.include_usage {
                                Phase::Usage(f)
                            } else {
                                Phase::Done
                            },
                        )
                    }
                    // The status line has gone out: the error travels as an event, as OpenAI's does.
                    Event::Failed(e) => (data(&e.body()), Phase::End),
                },
                Phase::Usage(f) => {
                    let mut v = meta.envelope(true, json!([]));
                    v["usage"] = usage(&f);
                    (data(&v), Phase::Done)
                }
                Phase::Done => (Sse::default().data("[DONE]"), Phase::End),
            };
            Some((Ok::<_, Infallible>(event), (events, meta, next)))
        },
    );
    // Comments while the request waits or prefills: writing them is how a client that left is
    // noticed (and its request cancelled) before the first token.
    axum::response::Sse::new(s)
        .keep_alive(KeepAlive::new().interval(Duration::from_secs(1)))
        .into_response()
}

async fn models(State(app): State<Arc<App>>) -> Json<Value> {
    Json(json!({"object": "list", "data": [app.model_card()]}))
}

async fn model(State(app): State<Arc<App>>, Path(id): Path<String>) -> Response {
    match app.check_model(&id) {
        Ok(()) => Json(app.model_card()).into_response(),
        Err(e) => e.into_response(),
    }
}

impl App {
    fn model_card(&self) -> Value {
        json!({"id": self.name, "object": "model", "created": self.created, "owned_by": "tether",
               "context_length": self.ctx})
    }
}

async fn health(State(app): State<Arc<App>>) -> Response {
    if app.queue.is_closed() {
        return (
            StatusCode::SERVICE_UNAVAILABLE,
            Json(json!({"status": "unavailable"})),
        )
            .into_response();
    }
    Json(json!({
        "status": "ok",
        "queued": app.queue.load().waiting,
        "context_tokens": app.ctx,
        "context_tokens_on_helper": app.ctx_on_helper,
        "kv_bytes_per_token": app.footprint.per_token,
        "kv_cache_types": {"k": app.footprint.types.k.name(), "v": app.footprint.types.v.name()},
        "state_bytes": app.footprint.fixed,
    }))
    .into_response()
}

/// A helper dialing this server (`tether-helper --join ws://HOST:PORT/helper`, a browser tab):
/// the WebSocket upgrade, then the secure handshake with the doors of `--accept-helpers`.
async fn helper(
    State(app): State<Arc<App>>,
    ConnectInfo(peer): ConnectInfo<SocketAddr>,
    headers: HeaderMap,
    ws: Result<WebSocketUpgrade, WebSocketUpgradeRejection>,
) -> Response {
    // Only the page this server serves may pair from a browser (engine_core's doors).
    let text = |name| {
        headers
            .get(name)
            .and_then(|v: &HeaderValue| v.to_str().ok())
    };
    let origin = text(header::ORIGIN).map_or(PageOrigin::NotAPage, |o| {
        PageOrigin::of(o, text(header::HOST))
    });
    let Some(acceptor) = app.acceptor.clone().filter(|a| a.get().is_some()) else {
        return ApiError::not_found(
            "this server takes no helpers on its port: start it with --accept-helpers",
        )
        .with_code("no_helpers")
        .into_response();
    };
    // A person opening /helper in a browser gets the tab helper's page.
    let Ok(ws) = ws else {
        return (
            StatusCode::PERMANENT_REDIRECT,
            [(header::LOCATION, "/helper/")],
            "the helper page is at /helper/\n",
        )
            .into_response();
    };
    let limit = wire_limit(app.helper_frame);
    ws.max_message_size(limit)
        .max_frame_size(limit)
        .on_upgrade(move |socket| async move {
            if let Some(acceptor) = acceptor.get() {
                let link = SocketLink::start(socket, limit);
                let close = link.closer();
                acceptor.offer(link, peer, origin, close);
            }
        })
}

/// The tab helper's page and the weights lent to paired tabs (crate::lend), with
/// --accept-helpers.
async fn lend(State(app): State<Arc<App>>, uri: axum::http::Uri) -> Response {
    let Some(acceptor) = app.acceptor.clone().filter(|a| a.get().is_some()) else {
        return ApiError::not_found(
            "this server takes no helpers on its port: start it with --accept-helpers",
        )
        .with_code("no_helpers")
        .into_response();
    };
    let target = uri
        .path_and_query()
        .map_or_else(|| uri.path().to_string(), |p| p.to_string());
    // The first weights request hashes a checkpoint's tensors: not on the async runtime.
    let answer = tokio::task::spawn_blocking(move || {
        acceptor.get().map(|a| a.lender().answer("GET", &target))
    })
    .await;
    let Ok(Some(a)) = answer else {
        return ApiError::unavailable("the helper page could not be answered", 1).into_response();
    };
    let mut r = (
        StatusCode::from_u16(a.status).unwrap_or(StatusCode::OK),
        a.body,
    )
        .into_response();
    for (name, value) in a.headers {
        if let Ok(v) = header::HeaderValue::from_str(&value) {
            r.headers_mut().insert(name, v);
        }
    }
    r
}

/// `GET /v1/telemetry`: the split's events as server-sent events (docs/TELEMETRY.md).
async fn watch(State(app): State<Arc<App>>) -> Response {
    telemetry::stream(&app.hub, app.helpers.clone()).unwrap_or_else(|| {
        ApiError::unavailable("too many clients watch /v1/telemetry; try again later", 5)
            .into_response()
    })
}

async fn metrics(State(app): State<Arc<App>>) -> Response {
    let links = app.helpers.as_ref().map(|h| {
        let list = h.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
        list.iter()
            .map(|a| (a.id, a.stats.snapshot()))
            .collect::<Vec<_>>()
    });
    let body = app.metrics.render(&app.queue.load(), links.as_deref());
    ([(header::CONTENT_TYPE, "text/plain; version=0.0.4")], body).into_response()
}
