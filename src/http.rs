//! The operator's HTTP endpoints: `/healthz`, `/readyz`, `/metrics`.
//!
//! Read-only by construction: only `GET` (and `HEAD`) of these three paths
//! are answered; anything else gets 404 or 405. A hand-written HTTP/1.0-style
//! responder (one request per connection, 8 KiB request limit, 5 s timeout)
//! keeps a web framework out of the dependency tree for three fixed pages.

use crate::metrics::Metrics;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};

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
pub async fn serve(listener: TcpListener, health: Arc<Endpoints>) {
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
        let health = health.clone();
        tokio::spawn(async move {
            let _ = tokio::time::timeout(Duration::from_secs(5), answer(stream, &health)).await;
        });
    }
}

async fn answer(mut stream: TcpStream, health: &Endpoints) -> std::io::Result<()> {
    let mut buf = vec![0u8; 8192];
    let mut len = 0;
    // Read until the end of the headers (or the limit).
    while len < buf.len() {
        let n = stream.read(&mut buf[len..]).await?;
        if n == 0 {
            break;
        }
        len += n;
        if buf[..len].windows(4).any(|w| w == b"\r\n\r\n") {
            break;
        }
    }
    let head = String::from_utf8_lossy(&buf[..len]);
    let mut parts = head.split_whitespace();
    let (method, path) = (parts.next().unwrap_or(""), parts.next().unwrap_or(""));
    let (status, content_type, body) = route(method, path, health);
    let response = format!(
        "HTTP/1.1 {status}\r\ncontent-type: {content_type}\r\ncontent-length: {}\r\nconnection: close\r\n\r\n",
        body.len()
    );
    stream.write_all(response.as_bytes()).await?;
    if method != "HEAD" {
        stream.write_all(body.as_bytes()).await?;
    }
    stream.shutdown().await
}

fn route(method: &str, path: &str, health: &Endpoints) -> (&'static str, &'static str, String) {
    const TEXT: &str = "text/plain; charset=utf-8";
    let path = path.split('?').next().unwrap_or("");
    let known = matches!(path, "/healthz" | "/readyz" | "/metrics");
    if !known {
        return ("404 Not Found", TEXT, "not found\n".into());
    }
    if method != "GET" && method != "HEAD" {
        return (
            "405 Method Not Allowed",
            TEXT,
            "read-only endpoint\n".into(),
        );
    }
    match path {
        "/healthz" => ("200 OK", TEXT, "ok\n".into()),
        "/readyz" if health.ready.load(Ordering::Relaxed) => ("200 OK", TEXT, "ok\n".into()),
        "/readyz" => (
            "503 Service Unavailable",
            TEXT,
            "waiting for the first watch sync\n".into(),
        ),
        _ => (
            "200 OK",
            "application/openmetrics-text; version=1.0.0; charset=utf-8",
            health.metrics.encode(),
        ),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

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
        let req = |m: &str, p: &str| format!("{m} {p} HTTP/1.1\r\nhost: x\r\n\r\n");
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
