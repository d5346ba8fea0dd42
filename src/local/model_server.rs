//! The fake model server the kubelet stand-in runs for each pod it starts,
//! so that tests and the demo carry real HTTP traffic to model pods.
//!
//! What it fakes: an OpenAI-compatible model server that has "loaded" its
//! model. It listens on the pod's own loopback address (127.0.0.0/8 is all
//! local, so every pod can use the same container port) from the moment
//! the stand-in marks the pod Ready until the pod is deleted or failed, and
//! answers:
//! - `POST /v1/embeddings`: one 8-number vector per input, in OpenAI's
//!   embedding list shape;
//! - `POST /v1/completions`: a text completion (`choices[].text`);
//! - any other `POST /v1/...` and `POST /v2/models/<name>/...`: a chat
//!   completion (`choices[].message`);
//! - each of them names the model and the pod (`model`, `pod`, and the
//!   text `"<model> on <pod>"`), with the `id`, `created` and `usage` an
//!   OpenAI client reads; with `"stream": true` in the body, three
//!   server-sent-event chunks of the same kind `stream_delay` apart, then
//!   `data: [DONE]`;
//! - `GET /v1/models`: the one model; `GET /healthz`: ok.
//! - vLLM's sleep mode endpoints: `POST /sleep?level=N` (answers after
//!   the pod's declared sleep delay, then sleeps), `POST /wake_up` (after
//!   its wake delay), `GET /is_sleeping` (`{"is_sleeping": bool}`). While
//!   it sleeps every inference request gets a 503 with an OpenAI-style
//!   error saying the model sleeps (what a vLLM server without its
//!   weights answers is not reproduced here; the router never sends one
//!   there). The pod annotation `kubelet-standin.residency.dev/sleep`
//!   declares the delays and faults: `sleep=200ms,wake=50ms`, and
//!   `mode=missing` (no sleep endpoints: 404), `mode=lies` (answers 200 and
//!   does not sleep) or `mode=slow` (the sleep never answers).
//! - `GET /fake/stats`: `{"asleep", "sleep_requests", "sleeps", "wakes",
//!   "inference_while_asleep"}`, for tests to check that nothing was sent
//!   to a sleeping server (`sleep_requests` counts those received, answered
//!   or not).
//!
//! Every response carries `x-model-pod: <pod>`. No inference happens, and
//! nothing else a model server does (batching, limits, GPU memory) is
//! faked.

use bytes::Bytes;
use futures::StreamExt;
use http::{Method, Request, Response, StatusCode, header};
use http_body_util::{BodyExt, Full, StreamBody, combinators::BoxBody};
use hyper::body::{Frame, Incoming};
use hyper::server::conn::http1;
use hyper::service::service_fn;
use hyper_util::rt::TokioIo;
use serde_json::{Value, json};
use std::convert::Infallible;
use std::net::{Ipv4Addr, SocketAddr};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU32, AtomicU64, Ordering};
use std::time::Duration;
use tokio::net::TcpListener;
use tokio::task::JoinHandle;

/// The largest request body the fake server reads.
const MAX_BODY: usize = 1 << 20;

/// A loopback address no other pod of this process has: 127.1.0.0/16 and
/// up (127.0.0.0/16 is left to everything else), starting at an offset of
/// this process's own, so two local clusters on one machine seldom meet
/// (and the kubelet stand-in skips an address that is taken).
pub fn next_pod_ip() -> Ipv4Addr {
    static NEXT: AtomicU32 = AtomicU32::new(0);
    let start = (std::process::id() % 1024) << 13;
    let n = (start + NEXT.fetch_add(1, Ordering::Relaxed)) % ((1 << 23) - 1) + 1;
    Ipv4Addr::from(0x7f01_0000 + n)
}

/// Who a fake server says it is.
#[derive(Clone, Debug)]
pub struct Identity {
    pub model: String,
    pub pod: String,
}

/// Pod annotation declaring the fake server's sleep delays and faults
/// (module docs).
pub const SLEEP_ANNOTATION: &str = "kubelet-standin.residency.dev/sleep";

/// How a fake server sleeps and wakes.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct SleepBehaviour {
    pub sleep_delay: Duration,
    pub wake_delay: Duration,
    pub mode: SleepMode,
}

impl Default for SleepBehaviour {
    fn default() -> Self {
        SleepBehaviour {
            sleep_delay: Duration::from_millis(20),
            wake_delay: Duration::from_millis(20),
            mode: SleepMode::Honest,
        }
    }
}

/// The faults a fake server's sleep endpoints can have.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum SleepMode {
    Honest,
    /// No sleep endpoints (404).
    Missing,
    /// Answers 200 to a sleep and does not sleep.
    Lies,
    /// A sleep never answers.
    Slow,
}

impl SleepBehaviour {
    /// Reads the annotation's `key=value` list; unknown keys or values are
    /// ignored (a stand-in, not an API).
    pub fn parse(text: &str) -> Self {
        let mut b = SleepBehaviour::default();
        for part in text.split(',') {
            let Some((key, value)) = part.split_once('=') else {
                continue;
            };
            let delay = crate::quantity::parse_duration(value.trim());
            match (key.trim(), value.trim()) {
                ("sleep", _) => b.sleep_delay = delay.unwrap_or(b.sleep_delay),
                ("wake", _) => b.wake_delay = delay.unwrap_or(b.wake_delay),
                ("mode", "missing") => b.mode = SleepMode::Missing,
                ("mode", "lies") => b.mode = SleepMode::Lies,
                ("mode", "slow") => b.mode = SleepMode::Slow,
                _ => {}
            }
        }
        b
    }
}

/// A fake server's sleep state and what it counted.
#[derive(Debug, Default)]
struct SleepState {
    asleep: AtomicBool,
    /// Sleep requests received, answered or not.
    sleep_requests: AtomicU64,
    sleeps: AtomicU64,
    wakes: AtomicU64,
    inference_while_asleep: AtomicU64,
}

/// A running fake model server; stops when dropped.
#[derive(Debug)]
pub struct FakeModelServer {
    pub addr: SocketAddr,
    task: JoinHandle<()>,
}

impl Drop for FakeModelServer {
    fn drop(&mut self) {
        self.task.abort();
    }
}

impl FakeModelServer {
    /// Binds `addr` and serves until dropped.
    pub async fn start(
        addr: SocketAddr,
        identity: Identity,
        stream_delay: Duration,
        sleep: SleepBehaviour,
    ) -> std::io::Result<Self> {
        let listener = TcpListener::bind(addr).await?;
        let addr = listener.local_addr()?;
        let identity = Arc::new((identity, sleep, SleepState::default()));
        let task = tokio::spawn(async move {
            loop {
                let Ok((stream, _)) = listener.accept().await else {
                    tokio::time::sleep(Duration::from_millis(50)).await;
                    continue;
                };
                let identity = identity.clone();
                tokio::spawn(async move {
                    let service = service_fn(move |req| {
                        let identity = identity.clone();
                        async move {
                            let (id, sleep, state) = &*identity;
                            let answer = match sleep_endpoint(&req, id, *sleep, state).await {
                                Some(a) => a,
                                None => answer(req, id, stream_delay, state).await,
                            };
                            Ok::<_, Infallible>(answer)
                        }
                    });
                    let _ = http1::Builder::new()
                        .serve_connection(TokioIo::new(stream), service)
                        .await;
                });
            }
        });
        Ok(FakeModelServer { addr, task })
    }
}

type Body = BoxBody<Bytes, Infallible>;

fn full(body: impl Into<Bytes>) -> Body {
    Full::new(body.into()).boxed()
}

fn respond(
    status: StatusCode,
    content_type: &'static str,
    body: Body,
    pod: &str,
) -> Response<Body> {
    let mut response = Response::new(body);
    *response.status_mut() = status;
    let headers = response.headers_mut();
    headers.insert(
        header::CONTENT_TYPE,
        header::HeaderValue::from_static(content_type),
    );
    if let Ok(pod) = header::HeaderValue::from_str(pod) {
        headers.insert("x-model-pod", pod);
    }
    response
}

const JSON: &str = "application/json";

/// vLLM's sleep endpoints and the stand-in's stats; `None` for any other
/// request.
async fn sleep_endpoint(
    req: &Request<Incoming>,
    id: &Identity,
    b: SleepBehaviour,
    state: &SleepState,
) -> Option<Response<Body>> {
    let ok = |body: Value| respond(StatusCode::OK, JSON, full(body.to_string()), &id.pod);
    let path = req.uri().path();
    let sleep_path = matches!(path, "/sleep" | "/wake_up" | "/is_sleeping");
    if sleep_path && b.mode == SleepMode::Missing {
        let error = json!({"error": {"message": format!("no route for {path}")}});
        return Some(respond(
            StatusCode::NOT_FOUND,
            JSON,
            full(error.to_string()),
            &id.pod,
        ));
    }
    match (req.method(), path) {
        (&Method::POST, "/sleep") => {
            state.sleep_requests.fetch_add(1, Ordering::SeqCst);
            if b.mode == SleepMode::Slow {
                std::future::pending::<()>().await;
            }
            tokio::time::sleep(b.sleep_delay).await;
            if b.mode != SleepMode::Lies {
                state.asleep.store(true, Ordering::SeqCst);
                state.sleeps.fetch_add(1, Ordering::SeqCst);
            }
            Some(ok(json!({})))
        }
        (&Method::POST, "/wake_up") => {
            tokio::time::sleep(b.wake_delay).await;
            if state.asleep.swap(false, Ordering::SeqCst) {
                state.wakes.fetch_add(1, Ordering::SeqCst);
            }
            Some(ok(json!({})))
        }
        (&Method::GET, "/is_sleeping") => Some(ok(
            json!({"is_sleeping": state.asleep.load(Ordering::SeqCst)}),
        )),
        (&Method::GET, "/fake/stats") => Some(ok(json!({
            "asleep": state.asleep.load(Ordering::SeqCst),
            "sleep_requests": state.sleep_requests.load(Ordering::SeqCst),
            "sleeps": state.sleeps.load(Ordering::SeqCst),
            "wakes": state.wakes.load(Ordering::SeqCst),
            "inference_while_asleep": state.inference_while_asleep.load(Ordering::SeqCst),
        }))),
        _ => None,
    }
}

async fn answer(
    req: Request<Incoming>,
    id: &Identity,
    stream_delay: Duration,
    state: &SleepState,
) -> Response<Body> {
    let (method, path) = (req.method().clone(), req.uri().path().to_owned());
    let inference = path.starts_with("/v1/") || path.starts_with("/v2/models/");
    if inference && state.asleep.load(Ordering::SeqCst) {
        state.inference_while_asleep.fetch_add(1, Ordering::SeqCst);
        let error = json!({"error": {
            "message": format!("{} is sleeping: wake it up first", id.model),
            "type": "ServiceUnavailableError", "code": 503}});
        return respond(
            StatusCode::SERVICE_UNAVAILABLE,
            JSON,
            full(error.to_string()),
            &id.pod,
        );
    }
    match (method, path.as_str()) {
        (Method::GET, "/healthz") => respond(StatusCode::OK, "text/plain", full("ok\n"), &id.pod),
        (Method::GET, "/v1/models") => {
            let body = json!({"object": "list", "data": [{"id": id.model, "object": "model"}]});
            respond(StatusCode::OK, JSON, full(body.to_string()), &id.pod)
        }
        (Method::POST, _) if inference => {
            let body = match http_body_util::Limited::new(req.into_body(), MAX_BODY)
                .collect()
                .await
            {
                Ok(b) => b.to_bytes(),
                Err(_) => {
                    let error = json!({"error": {"message": "body too large or unreadable"}});
                    return respond(
                        StatusCode::BAD_REQUEST,
                        JSON,
                        full(error.to_string()),
                        &id.pod,
                    );
                }
            };
            let request: Value = serde_json::from_slice(&body).unwrap_or(Value::Null);
            let kind = Kind::of(&path);
            if request["stream"] == Value::Bool(true) && kind != Kind::Embeddings {
                respond(
                    StatusCode::OK,
                    "text/event-stream",
                    stream(id, kind, stream_delay),
                    &id.pod,
                )
            } else {
                let answer = match kind {
                    Kind::Embeddings => embeddings(id, &request["input"]),
                    Kind::Text | Kind::Chat => completion(id, kind),
                };
                respond(StatusCode::OK, JSON, full(answer.to_string()), &id.pod)
            }
        }
        _ => {
            let error = json!({"error": {"message": format!("no route for {path}")}});
            respond(
                StatusCode::NOT_FOUND,
                JSON,
                full(error.to_string()),
                &id.pod,
            )
        }
    }
}

/// Which OpenAI answer a path gets.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Kind {
    Chat,
    Text,
    Embeddings,
}

impl Kind {
    fn of(path: &str) -> Kind {
        match path {
            "/v1/completions" => Kind::Text,
            "/v1/embeddings" => Kind::Embeddings,
            _ => Kind::Chat,
        }
    }
}

/// The fields every OpenAI completion object has.
fn envelope(id: &Identity, object: &str, choices: Value) -> Value {
    json!({
        "id": format!("cmpl-{}", id.pod),
        "object": object,
        "created": 0,
        "model": id.model,
        "pod": id.pod,
        "choices": choices,
        "usage": {"prompt_tokens": 1, "completion_tokens": 3, "total_tokens": 4},
    })
}

fn completion(id: &Identity, kind: Kind) -> Value {
    let text = format!("{} on {}", id.model, id.pod);
    match kind {
        Kind::Text => envelope(
            id,
            "text_completion",
            json!([{"index": 0, "text": text, "logprobs": null, "finish_reason": "stop"}]),
        ),
        _ => envelope(
            id,
            "chat.completion",
            json!([{"index": 0, "finish_reason": "stop",
                    "message": {"role": "assistant", "content": text}}]),
        ),
    }
}

/// One vector per input (a string or a list of them), in OpenAI's shape.
fn embeddings(id: &Identity, input: &Value) -> Value {
    let inputs = match input {
        Value::Array(items) => items.len().max(1),
        _ => 1,
    };
    let data: Vec<Value> = (0..inputs)
        .map(|i| {
            let vector: Vec<f64> = (0..8).map(|d| ((i * 8 + d) as f64) / 64.0).collect();
            json!({"object": "embedding", "index": i, "embedding": vector})
        })
        .collect();
    json!({
        "object": "list",
        "data": data,
        "model": id.model,
        "pod": id.pod,
        "usage": {"prompt_tokens": inputs, "total_tokens": inputs},
    })
}

/// Three SSE chunks `delay` apart, then the end marker.
fn stream(id: &Identity, kind: Kind, delay: Duration) -> Body {
    let chunks: Vec<String> = (0..3)
        .map(|i| {
            let part = format!("part {i}");
            let last = (i == 2).then_some("stop");
            let mut chunk = match kind {
                Kind::Text => envelope(
                    id,
                    "text_completion",
                    json!([{"index": 0, "text": part, "logprobs": null, "finish_reason": last}]),
                ),
                _ => envelope(
                    id,
                    "chat.completion.chunk",
                    json!([{"index": 0, "delta": {"content": part}, "finish_reason": last}]),
                ),
            };
            chunk.as_object_mut().map(|c| c.remove("usage"));
            format!("data: {chunk}\n\n")
        })
        .chain(["data: [DONE]\n\n".to_owned()])
        .collect();
    let frames =
        futures::stream::iter(chunks.into_iter().enumerate()).then(move |(i, chunk)| async move {
            if i > 0 {
                tokio::time::sleep(delay).await;
            }
            Ok::<_, Infallible>(Frame::data(Bytes::from(chunk)))
        });
    BodyExt::boxed(StreamBody::new(frames))
}
