//! The operator's HTTP endpoints: `/healthz`, `/readyz`, `/metrics`, served
//! with hyper (HTTP/1.1, keep-alive, a 5 s header timeout).
//!
//! Read-only by construction: only `GET` (and `HEAD`) of these three paths
//! are answered; anything else gets 404 or 405.

use crate::metrics::Metrics;
use bytes::Bytes;
use http::{Method, Request, Response, StatusCode, header};
use http_body_util::Full;
use hyper::body::Incoming;
use hyper::server::conn::http1;
use hyper::service::service_fn;
use hyper_util::rt::{TokioIo, TokioTimer};
use std::convert::Infallible;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;
use tokio::net::TcpListener;

/// What the endpoints serve: readiness and the metrics.
#[derive(Default)]
pub struct Endpoints {
    /// Set once the controller's first watch list has been synced (and,
    /// with leader election, also while standing by: a standby is ready to
    /// take over).
    pub ready: AtomicBool,
    pub metrics: Arc<Metrics>,
}

/// Serves until the task is dropped.
pub async fn serve(listener: TcpListener, endpoints: Arc<Endpoints>) {
    loop {
        let stream = match listener.accept().await {
            Ok((stream, _)) => stream,
            Err(e) => {
                // Out of file descriptors, most likely: retrying at once
                // would spin a core until one frees up.
                tracing::warn!(error = %e, "accepting a connection failed; pausing");
                tokio::time::sleep(Duration::from_millis(100)).await;
                continue;
            }
        };
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
    }
}

fn respond<B>(req: &Request<B>, endpoints: &Endpoints) -> Response<Full<Bytes>> {
    const TEXT: &str = "text/plain; charset=utf-8";
    const OPENMETRICS: &str = "application/openmetrics-text; version=1.0.0; charset=utf-8";
    let path = req.uri().path();
    let (status, content_type, body) = if !matches!(path, "/healthz" | "/readyz" | "/metrics") {
        (StatusCode::NOT_FOUND, TEXT, "not found\n".to_owned())
    } else if req.method() != Method::GET && req.method() != Method::HEAD {
        (
            StatusCode::METHOD_NOT_ALLOWED,
            TEXT,
            "read-only endpoint\n".to_owned(),
        )
    } else {
        match path {
            "/healthz" => (StatusCode::OK, TEXT, "ok\n".to_owned()),
            "/readyz" if endpoints.ready.load(Ordering::Relaxed) => {
                (StatusCode::OK, TEXT, "ok\n".to_owned())
            }
            "/readyz" => (
                StatusCode::SERVICE_UNAVAILABLE,
                TEXT,
                "waiting for the first watch sync\n".to_owned(),
            ),
            _ => (StatusCode::OK, OPENMETRICS, endpoints.metrics.encode()),
        }
    };
    let mut response = Response::new(Full::new(Bytes::from(body)));
    *response.status_mut() = status;
    response.headers_mut().insert(
        header::CONTENT_TYPE,
        header::HeaderValue::from_static(content_type),
    );
    response
}

#[cfg(test)]
mod tests {
    use super::*;

    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    use tokio::net::TcpStream;

    async fn get(addr: std::net::SocketAddr, request: &str) -> String {
        let mut s = TcpStream::connect(addr).await.unwrap();
        s.write_all(request.as_bytes()).await.unwrap();
        let mut out = String::new();
        s.read_to_string(&mut out).await.unwrap();
        out
    }

    #[tokio::test]
    async fn answers_only_reads_of_the_three_endpoints() {
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let health = Arc::new(Endpoints::default());
        tokio::spawn(serve(listener, health.clone()));
        let req =
            |m: &str, p: &str| format!("{m} {p} HTTP/1.1\r\nhost: x\r\nconnection: close\r\n\r\n");
        assert!(
            get(addr, &req("GET", "/healthz"))
                .await
                .starts_with("HTTP/1.1 200")
        );
        assert!(
            get(addr, &req("GET", "/readyz"))
                .await
                .starts_with("HTTP/1.1 503")
        );
        health.ready.store(true, Ordering::Relaxed);
        assert!(
            get(addr, &req("GET", "/readyz"))
                .await
                .starts_with("HTTP/1.1 200")
        );
        let metrics = get(addr, &req("GET", "/metrics")).await;
        assert!(
            metrics.contains("model_residency_reconcile_duration_seconds"),
            "{metrics}"
        );
        for (m, p) in [
            ("POST", "/metrics"),
            ("DELETE", "/readyz"),
            ("PUT", "/healthz"),
        ] {
            assert!(
                get(addr, &req(m, p)).await.starts_with("HTTP/1.1 405"),
                "{m} {p}"
            );
        }
        assert!(
            get(addr, &req("GET", "/debug"))
                .await
                .starts_with("HTTP/1.1 404")
        );
    }
}
