//! The HTTP routes: OpenAI's completions, chat completions, embeddings and models, plus
//! health and metrics; and the middleware every request passes (API key, panic → 500,
//! request counting).

use super::api::{self, GenRequest, Limits, PromptIn};
use super::app::{App, Ready};
use super::error::ApiError;
use super::reply::{collect, stream, Kind, Reply};
use super::scheduler::{EmbedJob, Event, GenJob, Work};
use axum::body::Bytes;
use axum::extract::rejection::BytesRejection;
use axum::extract::{MatchedPath, Path, Request, State};
use axum::http::{header, HeaderMap, StatusCode};
use axum::middleware::Next;
use axum::response::{IntoResponse, Response};
use futures_util::FutureExt;
use serde_json::value::RawValue;
use serde_json::{json, Value};
use std::panic::AssertUnwindSafe;
use std::sync::atomic::Ordering::Relaxed;
use std::sync::Arc;
use std::time::{Instant, SystemTime, UNIX_EPOCH};
use tokio::sync::mpsc::UnboundedReceiver;

type AppState = State<Arc<App>>;

fn now_secs() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_secs())
        .unwrap_or(0)
}

fn request_id(prefix: &str) -> String {
    static N: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(1);
    let n = N.fetch_add(1, Relaxed);
    format!("{prefix}-{:x}{n:06x}", now_secs())
}

/// The whole body, read within the body time-out: a client that sends half a body and
/// stops is answered 408 rather than holding the connection.
async fn read_body(app: &App, req: Request) -> Result<Request, ApiError> {
    let (parts, body) = req.into_parts();
    let limit = app.cfg.max_body_bytes;
    let wait = app.cfg.timeouts.body;
    let bytes = match tokio::time::timeout(wait, axum::body::to_bytes(body, limit)).await {
        Err(_) => {
            return Err(ApiError::new(
                StatusCode::REQUEST_TIMEOUT,
                "invalid_request_error",
                format!(
                    "the request body did not arrive within {} s",
                    wait.as_secs_f64()
                ),
            ))
        }
        Ok(Err(e)) => {
            let declared = parts
                .headers
                .get(header::CONTENT_LENGTH)
                .and_then(|v| v.to_str().ok()?.parse::<u64>().ok());
            let mut err = ApiError::invalid(format!("could not read the request body: {e}"));
            if declared.is_none_or(|n| n > limit as u64) {
                err = ApiError::new(
                    StatusCode::PAYLOAD_TOO_LARGE,
                    "invalid_request_error",
                    format!("the request body is larger than this server's limit of {limit} bytes"),
                );
            }
            return Err(err);
        }
        Ok(Ok(b)) => b,
    };
    Ok(Request::from_parts(parts, axum::body::Body::from(bytes)))
}

/// API key, body time-out, panics and request counting, around every route.
pub async fn guard(State(app): AppState, req: Request, next: Next) -> Response {
    let route = req
        .extensions()
        .get::<MatchedPath>()
        .map(|p| p.as_str().to_string())
        .unwrap_or_else(|| "unmatched".into());
    let checked = match check_key(&app, req.headers(), &route) {
        Ok(()) => read_body(&app, req).await,
        Err(e) => Err(e),
    };
    let resp = match checked {
        Err(e) => e.into_response(),
        Ok(req) => match AssertUnwindSafe(next.run(req)).catch_unwind().await {
            Ok(r) => r,
            Err(panic) => {
                let msg = panic
                    .downcast_ref::<String>()
                    .cloned()
                    .or_else(|| panic.downcast_ref::<&str>().map(|s| s.to_string()))
                    .unwrap_or_else(|| "unknown panic".into());
                ApiError::internal(format!("internal error while handling {route}: {msg}"))
                    .into_response()
            }
        },
    };
    app.metrics.count_request(&route, resp.status().as_u16());
    resp
}

fn check_key(app: &App, headers: &HeaderMap, route: &str) -> Result<(), ApiError> {
    let Some(key) = &app.cfg.api_key else {
        return Ok(());
    };
    if !route.starts_with("/v1/") {
        return Ok(());
    }
    // The scheme is case-insensitive (RFC 9110 §11.1): `bearer KEY` is as good.
    let given = headers
        .get(header::AUTHORIZATION)
        .and_then(|v| v.to_str().ok())
        .map(|v| {
            let v = v.trim();
            match v.split_once(|c: char| c.is_ascii_whitespace()) {
                Some((scheme, rest)) if scheme.eq_ignore_ascii_case("bearer") => rest.trim(),
                _ => v,
            }
        });
    match given {
        None => Err(ApiError::unauthorized(
            "missing API key: send the header `Authorization: Bearer <key>`",
        )),
        Some(g) if g == key => Ok(()),
        Some(_) => Err(ApiError::unauthorized("incorrect API key provided")),
    }
}

pub async fn health(State(app): AppState) -> Response {
    if app.ready.get().is_some() {
        return (StatusCode::OK, axum::Json(json!({"status": "ok"}))).into_response();
    }
    match app.load_error.get() {
        Some(e) => ApiError::unavailable(format!("loading the model failed: {e}"))
            .code("model_load_failed"),
        None => ApiError::unavailable("Loading model").code("model_loading"),
    }
    .into_response()
}

pub async fn metrics(State(app): AppState) -> Response {
    (
        [(
            header::CONTENT_TYPE,
            "text/plain; version=0.0.4; charset=utf-8",
        )],
        app.metrics.render(),
    )
        .into_response()
}

fn model_card(app: &App) -> Value {
    json!({"id": app.name, "object": "model", "created": app.created, "owned_by": "mamba3"})
}

pub async fn models(State(app): AppState) -> Response {
    axum::Json(json!({"object": "list", "data": [model_card(&app)]})).into_response()
}

pub async fn model(State(app): AppState, Path(id): Path<String>) -> Response {
    if id == app.name {
        axum::Json(model_card(&app)).into_response()
    } else {
        unknown_model(&app, &id).into_response()
    }
}

fn unknown_model(app: &App, id: &str) -> ApiError {
    ApiError::not_found(format!(
        "the model `{id}` does not exist: this server serves `{}`",
        app.name
    ))
    .code("model_not_found")
}

pub async fn not_found(req: Request) -> Response {
    ApiError::not_found(format!(
        "no route for {} {}",
        req.method(),
        req.uri().path()
    ))
    .into_response()
}

/// A route that exists, asked with another method: the same error body as every error.
pub async fn method_not_allowed(req: Request) -> Response {
    ApiError::method_not_allowed(format!(
        "{} is not allowed on {}",
        req.method(),
        req.uri().path()
    ))
    .into_response()
}

pub async fn panic_route() -> Response {
    panic!("a test panic from /debug/panic");
}

/// The body bytes, or an OpenAI-style error for a body that could not be read.
fn body_of(body: Result<Bytes, BytesRejection>) -> Result<Bytes, ApiError> {
    body.map_err(|e| {
        let mut err = ApiError::invalid(format!(
            "could not read the request body: {}",
            e.body_text()
        ));
        err.status = e.status();
        err
    })
}

fn check_model(app: &App, model: &Option<String>) -> Result<(), ApiError> {
    match model.as_deref() {
        None | Some("") => Ok(()),
        Some(m) if m == app.name => Ok(()),
        Some(m) => Err(unknown_model(app, m)),
    }
}

fn limits(app: &App) -> Limits {
    let max_token_bytes = app.ready.get().map_or(usize::MAX, |r| r.max_token_bytes);
    Limits {
        max_tokens: app.cfg.max_tokens_limit,
        max_prompt_tokens: app.cfg.max_prompt_tokens,
        max_prompt_bytes: app.cfg.max_prompt_tokens.saturating_mul(max_token_bytes),
    }
}

/// Run `f` (parsing a large body, tokenizing prompts: CPU work of up to a few seconds) on
/// tokio's blocking pool, off the async workers, so that `/health` and the other clients'
/// streams do not wait for it.
async fn off_workers<T: Send + 'static>(
    f: impl FnOnce() -> Result<T, ApiError> + Send + 'static,
) -> Result<T, ApiError> {
    tokio::task::spawn_blocking(f)
        .await
        .map_err(|e| ApiError::internal(format!("internal error while reading the request: {e}")))?
}

/// Put the sequences in the engine's queue, or refuse with 429 when it is full.
fn submit(
    app: &App,
    prompts: Vec<Vec<u32>>,
    params: crate::text::GenParams,
) -> Result<UnboundedReceiver<Event>, ApiError> {
    let n = prompts.len();
    let max = app.cfg.max_queue;
    if n > max {
        // More than the queue holds at all: waiting would never help.
        return Err(ApiError::param(
            "n",
            format!(
                "the request has {n} sequences (prompts × n) and this server queues at most \
                 {max} (--max-queue)"
            ),
        ));
    }
    if app
        .shared
        .queued
        .fetch_update(Relaxed, Relaxed, |q| (q + n <= max).then_some(q + n))
        .is_err()
    {
        return Err(ApiError::overloaded(format!(
            "the server is busy: {max} sequences are already waiting (--max-queue); retry later"
        )));
    }
    let (tx, rx) = tokio::sync::mpsc::unbounded_channel();
    let arrived = Instant::now();
    for (index, prompt) in prompts.into_iter().enumerate() {
        let job = GenJob {
            prompt,
            params: params.clone(),
            index,
            events: tx.clone(),
            arrived,
        };
        if app.work.send(Work::Generate(job)).is_err() {
            app.shared.queued.fetch_sub(n - index, Relaxed);
            return Err(ApiError::unavailable("the engine has stopped"));
        }
    }
    Ok(rx)
}

fn ready(app: &App) -> Result<&Ready, ApiError> {
    app.ready
        .get()
        .ok_or_else(|| ApiError::unavailable("the model is still loading; retry shortly"))
}

/// The token lists of request field `field` (a string, a token list, or a list of either),
/// each checked against the vocabulary and the limits; an error when it is missing.
fn token_lists(
    app: &App,
    r: &Ready,
    field: &str,
    raw: Option<&RawValue>,
) -> Result<Vec<Vec<u32>>, ApiError> {
    let raw = raw.ok_or_else(|| ApiError::param(field, format!("`{field}` is missing")))?;
    api::prompts(field, raw)?
        .iter()
        .map(|p| {
            api::tokens_of(
                field,
                p,
                r.tokenizer.as_deref(),
                true,
                r.vocab_size,
                &limits(app),
            )
        })
        .collect()
}

async fn generate(
    app: &App,
    kind: Kind,
    req: GenRequest,
    prompts: Vec<Vec<u32>>,
    default_max: usize,
) -> Result<Response, ApiError> {
    let r = ready(app)?;
    let params = api::gen_params(
        &req,
        kind == Kind::Chat,
        &limits(app),
        default_max,
        r.vocab_size,
        r.tokenizer.is_some(),
    )?;
    let reply = Reply {
        kind,
        id: request_id(if kind == Kind::Chat {
            "chatcmpl"
        } else {
            "cmpl"
        }),
        created: now_secs(),
        model: app.name.clone(),
        prompt_tokens: prompts.iter().map(Vec::len).sum(),
        n: prompts.len(),
        stream: req.stream.unwrap_or(false),
        include_usage: req
            .stream_options
            .as_ref()
            .and_then(|o| o.include_usage)
            .unwrap_or(false),
        return_ids: req.return_token_ids.unwrap_or(r.tokenizer.is_none()),
        logprobs: params.sampling.logprobs.is_some(),
    };
    let rx = submit(app, prompts, params)?;
    if reply.stream {
        Ok(stream(reply, rx))
    } else {
        collect(&reply, rx).await
    }
}

pub async fn completions(State(app): AppState, body: Result<Bytes, BytesRejection>) -> Response {
    let run = async {
        let body = body_of(body)?;
        ready(&app)?;
        let a = app.clone();
        let (req, prompts) = off_workers(move || {
            let r = ready(&a)?;
            let req: GenRequest = api::parse_body(&body)?;
            check_model(&a, &req.model)?;
            let prompts = token_lists(&a, r, "prompt", req.prompt.as_deref())?;
            Ok((req, prompts))
        })
        .await?;
        generate(
            &app,
            Kind::Completion,
            req,
            prompts,
            app.cfg.default_max_tokens,
        )
        .await
    };
    run.await.unwrap_or_else(|e| e.into_response())
}

pub async fn chat(State(app): AppState, body: Result<Bytes, BytesRejection>) -> Response {
    let run = async {
        let body = body_of(body)?;
        ready(&app)?;
        let a = app.clone();
        let (req, tokens) = off_workers(move || {
            let r = ready(&a)?;
            let req: GenRequest = api::parse_body(&body)?;
            check_model(&a, &req.model)?;
            let msgs = api::messages(req.messages.as_ref())?;
            let lim = limits(&a);
            let bytes: usize = msgs.iter().map(|m| m.content.len()).sum();
            if bytes > lim.max_prompt_bytes {
                return Err(api::too_long("messages", bytes, &lim));
            }
            let Some(template) = &r.chat else {
                return Err(ApiError::invalid(format!(
                    "the model `{}` has no chat template and no tokenizer to render one with: \
                     use /v1/completions with token ids",
                    a.name
                ))
                .code("no_chat_template"));
            };
            let text = template
                .render(&msgs, req.add_generation_prompt.unwrap_or(true))
                .map_err(|e| ApiError::param("messages", e.to_string()))?;
            // The template writes the special tokens itself (BOS included).
            let tokens = api::tokens_of(
                "messages",
                &PromptIn::Text(text),
                r.tokenizer.as_deref(),
                false,
                r.vocab_size,
                &lim,
            )?;
            Ok((req, tokens))
        })
        .await?;
        let default_max = app.cfg.max_tokens_limit;
        generate(&app, Kind::Chat, req, vec![tokens], default_max).await
    };
    run.await.unwrap_or_else(|e| e.into_response())
}

pub async fn embeddings(State(app): AppState, body: Result<Bytes, BytesRejection>) -> Response {
    let run = async {
        let body = body_of(body)?;
        let r = ready(&app)?;
        let a = app.clone();
        let (req, inputs) = off_workers(move || {
            let r = ready(&a)?;
            let req: api::EmbedRequest = api::parse_body(&body)?;
            check_model(&a, &req.model)?;
            let inputs = token_lists(&a, r, "input", req.input.as_deref())?;
            Ok((req, inputs))
        })
        .await?;
        if req.dimensions.is_some() {
            return Err(ApiError::param(
                "dimensions",
                format!(
                    "`dimensions` is not supported: embeddings have the model's width ({})",
                    r.d_model
                ),
            ));
        }
        let base64 = match req.encoding_format.as_deref() {
            None | Some("float") => false,
            Some("base64") => true,
            Some(other) => {
                return Err(ApiError::param(
                    "encoding_format",
                    format!("`encoding_format` is {other:?}: expected \"float\" or \"base64\""),
                ))
            }
        };
        let pooling = api::pooling(&req.pooling)?;
        let tokens: usize = inputs.iter().map(Vec::len).sum();
        let (tx, rx) = tokio::sync::oneshot::channel();
        app.work
            .send(Work::Embed(EmbedJob {
                inputs,
                pooling,
                reply: tx,
            }))
            .map_err(|_| ApiError::unavailable("the engine has stopped"))?;
        let vecs = rx
            .await
            .map_err(|_| ApiError::internal("the engine dropped the request"))?
            .map_err(ApiError::internal)?;
        let data: Vec<Value> = vecs
            .iter()
            .enumerate()
            .map(|(i, v)| {
                let emb = if base64 {
                    json!(api::base64_f32(v))
                } else {
                    json!(v)
                };
                json!({"object": "embedding", "index": i, "embedding": emb})
            })
            .collect();
        Ok(axum::Json(json!({
            "object": "list",
            "data": data,
            "model": app.name,
            "usage": {"prompt_tokens": tokens, "total_tokens": tokens},
        }))
        .into_response())
    };
    run.await.unwrap_or_else(|e: ApiError| e.into_response())
}
