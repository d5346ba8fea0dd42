//! The processes' HTTP endpoints: `/healthz`, `/readyz`, `/metrics`, served
//! with hyper (HTTP/1.1, keep-alive, a 5 s header timeout); and [`send`], a
//! one-request hyper client for the demo and the tests.
//!
//! Read-only by construction: only `GET` (and `HEAD`) of these three paths
//! are answered; anything else gets 404 or 405.

use bytes::Bytes;
use http::{Method, Request, Response, StatusCode, header};
use http_body_util::{BodyExt, Full};
use hyper::body::Incoming;
use hyper::server::conn::http1;
use hyper::service::service_fn;
use hyper_util::rt::{TokioIo, TokioTimer};
use std::convert::Infallible;
use std::net::SocketAddr;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;
use tokio::net::{TcpListener, TcpStream};

/// Whether a process is ready: set by the process once its first watch
/// lists are in (and, for the controller with leader election, while it
/// stands by: a standby is ready to take over), read by its `/readyz`.
/// One flag behind a cloneable handle, never unset: a latch, not a copy
/// kept in step by polling.
/// The same handle carries liveness: a task of the process that keeps
/// failing ([`crate::supervise`]) says so here, and `/healthz` then fails,
/// so Kubernetes restarts the pod (and a leader's Lease moves).
#[derive(Clone, Debug, Default)]
pub struct Readiness(Arc<AtomicBool>, Arc<std::sync::Mutex<Option<String>>>);

impl Readiness {
    pub fn set(&self) {
        self.0.store(true, Ordering::Relaxed);
    }

    pub fn is_ready(&self) -> bool {
        self.0.load(Ordering::Relaxed)
    }

    /// The process is not healthy any more, for `why`.
    pub fn fail(&self, why: String) {
        *self.1.lock().expect("liveness lock") = Some(why);
    }

    /// Why the process is not healthy, if it is not.
    pub fn failing(&self) -> Option<String> {
        self.1.lock().expect("liveness lock").clone()
    }
}

/// What the endpoints serve: readiness and the metrics.
pub struct Endpoints {
    ready: Readiness,
    /// The metrics' exposition text, made at each scrape.
    encode: Box<dyn Fn() -> String + Send + Sync>,
}

impl Endpoints {
    /// `/readyz` answers `ready`, `/metrics` answers `encode()`.
    pub fn new(ready: Readiness, encode: impl Fn() -> String + Send + Sync + 'static) -> Self {
        Endpoints {
            ready,
            encode: Box::new(encode),
        }
    }
}

/// A long-running process's admin server (`/healthz`, `/readyz`,
/// `/metrics`) on `addr`, serving until the returned task is aborted.
pub async fn serve_admin(
    addr: SocketAddr,
    ready: Readiness,
    encode: impl Fn() -> String + Send + Sync + 'static,
) -> std::io::Result<tokio::task::JoinHandle<()>> {
    let listener = TcpListener::bind(addr).await?;
    tracing::info!(addr = %listener.local_addr()?, "serving /healthz, /readyz, /metrics");
    let endpoints = Arc::new(Endpoints::new(ready, encode));
    Ok(tokio::spawn(serve(listener, endpoints)))
}

/// Serves until the task is dropped.
pub async fn serve(listener: TcpListener, endpoints: Arc<Endpoints>) {
    accept_loop(listener, |stream| {
        let endpoints = endpoints.clone();
        tokio::spawn(async move {
            let service = service_fn(move |req: Request<Incoming>| {
                let response = respond(&req, &endpoints);
                async move { Ok::<_, Infallible>(response) }
            });
            let connection = http1::Builder::new()
                .timer(TokioTimer::new())
                .header_read_timeout(Duration::from_secs(5))
                .serve_connection(TokioIo::new(stream), service);
            // A scrape is quick; a connection held open longer is dropped.
            let _ = tokio::time::timeout(Duration::from_secs(60), connection).await;
        });
    })
    .await
}

/// Accepts connections until the task is dropped, handing each to
/// `connection` (which spawns its own task).
pub async fn accept_loop(listener: TcpListener, mut connection: impl FnMut(TcpStream)) {
    loop {
        match listener.accept().await {
            Ok((stream, _)) => {
                let _ = stream.set_nodelay(true);
                connection(stream)
            }
            Err(e) => {
                // Out of file descriptors, most likely: retrying at once
                // would spin a core until one frees up.
                tracing::warn!(error = %e, "accepting a connection failed; pausing");
                tokio::time::sleep(Duration::from_millis(100)).await;
            }
        }
    }
}

fn respond<B>(req: &Request<B>, endpoints: &Endpoints) -> Response<Full<Bytes>> {
    if req.uri().path() == "/healthz"
        && let Some(why) = endpoints.ready.failing()
    {
        return text_response(StatusCode::SERVICE_UNAVAILABLE, TEXT, format!("{why}\n"));
    }
    probe(req, endpoints.ready.is_ready(), || (endpoints.encode)())
        .unwrap_or_else(|| text_response(StatusCode::NOT_FOUND, TEXT, "not found\n".to_owned()))
}

const TEXT: &str = "text/plain; charset=utf-8";

fn text_response(
    status: StatusCode,
    content_type: &'static str,
    body: String,
) -> Response<Full<Bytes>> {
    let mut response = Response::new(Full::new(Bytes::from(body)));
    *response.status_mut() = status;
    response.headers_mut().insert(
        header::CONTENT_TYPE,
        header::HeaderValue::from_static(content_type),
    );
    response
}

/// The answer to `/healthz`, `/readyz` or `/metrics` (read-only: other
/// methods get 405), or `None` for any other path. Shared by the operator
/// and the router.
pub fn probe<B>(
    req: &Request<B>,
    ready: bool,
    metrics: impl FnOnce() -> String,
) -> Option<Response<Full<Bytes>>> {
    const OPENMETRICS: &str = "application/openmetrics-text; version=1.0.0; charset=utf-8";
    let path = req.uri().path();
    if !matches!(path, "/healthz" | "/readyz" | "/metrics") {
        return None;
    }
    let (status, content_type, body) =
        if req.method() != Method::GET && req.method() != Method::HEAD {
            (
                StatusCode::METHOD_NOT_ALLOWED,
                TEXT,
                "read-only endpoint\n".to_owned(),
            )
        } else {
            match path {
                "/healthz" => (StatusCode::OK, TEXT, "ok\n".to_owned()),
                "/readyz" if ready => (StatusCode::OK, TEXT, "ok\n".to_owned()),
                "/readyz" => (
                    StatusCode::SERVICE_UNAVAILABLE,
                    TEXT,
                    "waiting for the first watch sync\n".to_owned(),
                ),
                _ => (StatusCode::OK, OPENMETRICS, metrics()),
            }
        };
    Some(text_response(status, content_type, body))
}

/// An answer read by [`send`].
pub struct Answer {
    pub status: u16,
    pub headers: http::HeaderMap,
    pub body: String,
    /// Each body chunk with the time it arrived, from the request's start.
    pub chunks: Vec<(Duration, Bytes)>,
}

/// Sends one HTTP/1.1 request (`method path`, a JSON `body`) to `addr` on
/// its own connection, with hyper, and reads the whole answer, noting when
/// each chunk arrived. The client the demo and the tests talk to the
/// operator's endpoints and to model pods with.
pub async fn send(
    addr: SocketAddr,
    method: &str,
    path: &str,
    body: &str,
) -> std::io::Result<Answer> {
    send_capped(addr, method, path, body, usize::MAX).await
}

/// [`send`], reading at most `limit` bytes of the answer's body: a longer
/// one is an error, what came so far dropped (a model pod's answer must not
/// take the operator's memory).
pub async fn send_capped(
    addr: SocketAddr,
    method: &str,
    path: &str,
    body: &str,
    limit: usize,
) -> std::io::Result<Answer> {
    let other = |e: hyper::Error| std::io::Error::other(e.to_string());
    let t0 = std::time::Instant::now();
    let stream = tokio::net::TcpStream::connect(addr).await?;
    let (mut sender, connection) = hyper::client::conn::http1::handshake(TokioIo::new(stream))
        .await
        .map_err(other)?;
    tokio::spawn(connection);
    let request = Request::builder()
        .method(method)
        .uri(path)
        .header(header::HOST, addr.to_string())
        .header(header::CONTENT_TYPE, "application/json")
        .body(Full::new(Bytes::from(body.to_owned())))
        .map_err(std::io::Error::other)?;
    let response = sender.send_request(request).await.map_err(other)?;
    let status = response.status().as_u16();
    let headers = response.headers().clone();
    let mut incoming = response.into_body();
    let mut chunks = Vec::new();
    let mut read = 0usize;
    while let Some(frame) = incoming.frame().await {
        if let Ok(data) = frame.map_err(other)?.into_data() {
            read = read.saturating_add(data.len());
            if read > limit {
                return Err(std::io::Error::other(format!(
                    "its answer is longer than {limit} bytes"
                )));
            }
            chunks.push((t0.elapsed(), data));
        }
    }
    let body = chunks
        .iter()
        .map(|(_, c)| String::from_utf8_lossy(c).into_owned())
        .collect();
    Ok(Answer {
        status,
        headers,
        body,
        chunks,
    })
}

/// `s` with every byte but RFC 3986's unreserved ones percent-encoded: a
/// query parameter's value (a PromQL expression in a Prometheus query).
pub fn percent_encode(s: &str) -> String {
    s.bytes()
        .map(|b| match b {
            b'A'..=b'Z' | b'a'..=b'z' | b'0'..=b'9' | b'-' | b'_' | b'.' | b'~' => {
                (b as char).to_string()
            }
            _ => format!("%{b:02X}"),
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_query_value_keeps_only_unreserved_bytes() {
        assert_eq!(
            percent_encode(r#"sum(rate(x{a="b c"}[5m])) / 2~_.-"#),
            "sum%28rate%28x%7Ba%3D%22b%20c%22%7D%5B5m%5D%29%29%20%2F%202~_.-"
        );
    }

    #[tokio::test]
    async fn answers_only_reads_of_the_three_endpoints() {
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let metrics = Arc::new(crate::metrics::Metrics::default());
        let ready = Readiness::default();
        let endpoints = Arc::new(Endpoints::new(ready.clone(), move || metrics.encode()));
        tokio::spawn(serve(listener, endpoints));
        let status = |m: &'static str, p: &'static str| async move {
            send(addr, m, p, "").await.unwrap().status
        };
        assert_eq!(status("GET", "/healthz").await, 200);
        assert_eq!(status("GET", "/readyz").await, 503);
        ready.set();
        assert_eq!(status("GET", "/readyz").await, 200);
        let metrics = send(addr, "GET", "/metrics", "").await.unwrap();
        assert!(
            metrics
                .body
                .contains("model_residency_reconcile_duration_seconds"),
            "{}",
            metrics.body
        );
        assert!(
            metrics.headers["content-type"]
                .to_str()
                .unwrap()
                .starts_with("application/openmetrics-text")
        );
        for (m, p) in [
            ("POST", "/metrics"),
            ("DELETE", "/readyz"),
            ("PUT", "/healthz"),
        ] {
            assert_eq!(status(m, p).await, 405, "{m} {p}");
        }
        assert_eq!(status("GET", "/debug").await, 404);
    }
}
