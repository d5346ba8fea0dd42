//! The fake model server the kubelet stand-in runs for each pod it starts,
//! so that tests and the demo carry real HTTP traffic to model pods.
//!
//! What it fakes: an OpenAI-compatible model server that has "loaded" its
//! model. It listens on the pod's own loopback address (127.0.0.0/8 is all
//! local, so every pod can use the same container port) from the moment
//! the stand-in marks the pod Ready until the pod is deleted or failed, and
//! answers:
//! - `POST /v1/...` and `POST /v2/models/<name>/...`: a JSON completion
//!   naming the model and the pod (`model`, `pod`, and the content
//!   `"<model> on <pod>"`); with `"stream": true` in the body, three
//!   server-sent-event chunks `stream_delay` apart, then `data: [DONE]`;
//! - `GET /v1/models`: the one model; `GET /healthz`: ok.
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
use std::sync::atomic::{AtomicU32, Ordering};
use std::time::Duration;
use tokio::net::TcpListener;
use tokio::task::JoinHandle;

/// The largest request body the fake server reads.
const MAX_BODY: usize = 1 << 20;

/// A loopback address no other pod of this process has: 127.1.0.1,
/// 127.1.0.2, ... (127.0.0.0/16 is left to everything else).
pub fn next_pod_ip() -> Ipv4Addr {
    static NEXT: AtomicU32 = AtomicU32::new(1);
    let n = NEXT.fetch_add(1, Ordering::Relaxed) % (1 << 23);
    Ipv4Addr::from(0x7f01_0000 + n)
}

/// Who a fake server says it is.
#[derive(Clone, Debug)]
pub struct Identity {
    pub model: String,
    pub pod: String,
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
    ) -> std::io::Result<Self> {
        let listener = TcpListener::bind(addr).await?;
        let addr = listener.local_addr()?;
        let identity = Arc::new(identity);
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
                        async move { Ok::<_, Infallible>(answer(req, &identity, stream_delay).await) }
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

async fn answer(req: Request<Incoming>, id: &Identity, stream_delay: Duration) -> Response<Body> {
    const JSON: &str = "application/json";
    let (method, path) = (req.method().clone(), req.uri().path().to_owned());
    let inference = path.starts_with("/v1/") || path.starts_with("/v2/models/");
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
            if request["stream"] == Value::Bool(true) {
                respond(
                    StatusCode::OK,
                    "text/event-stream",
                    stream(id, stream_delay),
                    &id.pod,
                )
            } else {
                respond(
                    StatusCode::OK,
                    JSON,
                    full(completion(id).to_string()),
                    &id.pod,
                )
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

fn completion(id: &Identity) -> Value {
    json!({
        "object": "chat.completion",
        "model": id.model,
        "pod": id.pod,
        "choices": [{"index": 0, "finish_reason": "stop",
                     "message": {"role": "assistant", "content": format!("{} on {}", id.model, id.pod)}}],
    })
}

/// Three SSE chunks `delay` apart, then the end marker.
fn stream(id: &Identity, delay: Duration) -> Body {
    let chunks: Vec<String> = (0..3)
        .map(|i| {
            let chunk = json!({"object": "chat.completion.chunk", "model": id.model, "pod": id.pod,
                               "choices": [{"index": 0, "delta": {"content": format!("part {i}")}}]});
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
