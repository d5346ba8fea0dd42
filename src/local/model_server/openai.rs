//! The fake's OpenAI-style answers: chat, completions and embeddings,
//! whole or streamed, held while the server sleeps and cut short by an
//! aborting sleep, as vLLM does ([`super::sleep`]).

use super::sleep::Running;
use super::{Body, Identity, JSON, Server, full, read_body, respond};
use bytes::Bytes;
use futures::SinkExt;
use http::{Method, Request, Response, StatusCode};
use http_body_util::{BodyExt, StreamBody};
use hyper::body::{Frame, Incoming};
use serde_json::{Value, json};
use std::convert::Infallible;
use std::sync::Arc;
use std::sync::atomic::Ordering;

/// The longest stream a request may ask for (`max_tokens`).
const MAX_CHUNKS: u64 = 10_000;

pub(super) async fn answer(req: Request<Incoming>, server: &Arc<Server>) -> Response<Body> {
    let id = &server.id;
    let state = &server.state;
    let (method, path) = (req.method().clone(), req.uri().path().to_owned());
    let inference = path.starts_with("/v1/") || path.starts_with("/v2/models/");
    let error =
        |status: StatusCode, body: Value| respond(status, JSON, full(body.to_string()), &id.pod);
    match (method, path.as_str()) {
        (Method::GET, "/health" | "/healthz") => {
            respond(StatusCode::OK, "text/plain", full("ok\n"), &id.pod)
        }
        (Method::GET, "/v1/models") => {
            let body = super::lora::models(server);
            respond(StatusCode::OK, JSON, full(body.to_string()), &id.pod)
        }
        (Method::POST, _) if inference => {
            let Some(body) = read_body(req).await else {
                let e = json!({"error": {"message": "body too large or unreadable"}});
                return error(StatusCode::BAD_REQUEST, e);
            };
            let request: Value = serde_json::from_slice(&body).unwrap_or(Value::Null);
            // The base model, or one of its loaded adapters, answers.
            let mut answering = id.clone();
            if let Some(named) = request["model"].as_str().filter(|m| *m != id.model) {
                if !server.adapters.as_ref().is_some_and(|a| a.has(named)) {
                    let e = json!({"error": {"message": format!("The model `{named}` does not exist. Valid aliases: {}", id.model), "type": "NotFoundError", "code": 404}});
                    return error(StatusCode::NOT_FOUND, e);
                }
                answering.model = named.to_owned();
            }
            // A sleeping vLLM holds the request and answers it after the
            // wake (it never answers 503).
            if state.asleep() {
                state.inference_while_asleep.fetch_add(1, Ordering::SeqCst);
                state.until_awake().await;
            }
            if let Some(cache) = &server.prefix
                && let Some(prefix) = super::cached_prefix(&request)
            {
                tokio::time::sleep(cache.prefill(&prefix)).await;
            }
            let garbage = state.weights_lost();
            if garbage {
                state.garbage.fetch_add(1, Ordering::SeqCst);
            }
            let kind = Kind::of(&path);
            if request["stream"] == Value::Bool(true) && kind != Kind::Embeddings {
                let chunks = request["max_tokens"]
                    .as_u64()
                    .unwrap_or(3)
                    .clamp(1, MAX_CHUNKS);
                let body = stream(server.clone(), answering, kind, chunks, garbage);
                respond(StatusCode::OK, "text/event-stream", body, &id.pod)
            } else {
                let answer = match kind {
                    Kind::Embeddings => embeddings(&answering, &request["input"]),
                    Kind::Text | Kind::Chat => completion(&answering, kind, garbage),
                };
                respond(StatusCode::OK, JSON, full(answer.to_string()), &id.pod)
            }
        }
        _ => error(
            StatusCode::NOT_FOUND,
            json!({"error": {"message": format!("no route for {path}")}}),
        ),
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

/// The text of an answer: the model and the pod, or marked as garbage
/// when the weights were discarded and not loaded again.
fn text(id: &Identity, garbage: bool) -> String {
    if garbage {
        format!("garbage: {} woke without its weights", id.model)
    } else {
        format!("{} on {}", id.model, id.pod)
    }
}

fn completion(id: &Identity, kind: Kind, garbage: bool) -> Value {
    let text = text(id, garbage);
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

/// One SSE chunk: `part` with `finish` (`None` while it goes on).
fn chunk(id: &Identity, kind: Kind, part: &str, finish: Option<&str>) -> Bytes {
    let mut chunk = match kind {
        Kind::Text => envelope(
            id,
            "text_completion",
            json!([{"index": 0, "text": part, "logprobs": null, "finish_reason": finish}]),
        ),
        _ => envelope(
            id,
            "chat.completion.chunk",
            json!([{"index": 0, "delta": {"content": part}, "finish_reason": finish}]),
        ),
    };
    chunk.as_object_mut().map(|c| c.remove("usage"));
    Bytes::from(format!("data: {chunk}\n\n"))
}

/// `chunks` SSE chunks the server's stream delay apart, then the end
/// marker; a sleep that aborts ends it at once, as vLLM's `mode=abort`
/// does: a last chunk with `finish_reason: "abort"`, a 200 all the same.
/// Counted as running until it ends.
fn stream(server: Arc<Server>, id: Identity, kind: Kind, chunks: u64, garbage: bool) -> Body {
    let aborts_at_start = server.state.aborts();
    // Counted as running from here until the stream ends or its client
    // goes (the channel closes).
    let running = Running::new(server.clone());
    let (mut frames, body) = futures::channel::mpsc::channel::<Result<Frame<Bytes>, Infallible>>(1);
    tokio::spawn(async move {
        let _running = running;
        let id = &id;
        for i in 0..chunks {
            if i > 0 {
                tokio::time::sleep(server.chunk_delay()).await;
            }
            if server.state.aborts() != aborts_at_start {
                server.state.aborted.fetch_add(1, Ordering::SeqCst);
                let last = chunk(id, kind, "", Some("abort"));
                let _ = frames.send(Ok(Frame::data(last))).await;
                break;
            }
            let part = if garbage {
                text(id, true)
            } else {
                format!("part {i}")
            };
            let finish = (i + 1 == chunks).then_some("stop");
            if frames
                .send(Ok(Frame::data(chunk(id, kind, &part, finish))))
                .await
                .is_err()
            {
                return;
            }
        }
        // The end marker a delay later too: four events for three chunks,
        // evenly apart (tests time the spread of a streamed answer).
        tokio::time::sleep(server.stream_delay).await;
        let done = Bytes::from_static(b"data: [DONE]\n\n");
        let _ = frames.send(Ok(Frame::data(done))).await;
    });
    BodyExt::boxed(StreamBody::new(body))
}
