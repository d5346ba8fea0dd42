//! A small HTTP/1.1 client for tests, on hyper: one request per
//! connection, the answer's status, headers, body, and when each body
//! chunk arrived (to check streaming).

use bytes::Bytes;
use http::{HeaderMap, Request};
use http_body_util::{BodyExt, Full};
use hyper_util::rt::TokioIo;
use std::net::SocketAddr;
use std::time::{Duration, Instant};

pub struct Answer {
    pub status: u16,
    pub headers: HeaderMap,
    pub body: String,
    /// Each data chunk with the time it arrived, from the request's start.
    pub chunks: Vec<(Duration, Bytes)>,
}

/// Sends `method path` with a JSON `body` (empty for none) to `addr`.
pub async fn send(addr: SocketAddr, method: &str, path: &str, body: &str) -> Answer {
    let t0 = Instant::now();
    let stream = tokio::net::TcpStream::connect(addr)
        .await
        .unwrap_or_else(|e| panic!("connect {addr}: {e}"));
    let (mut sender, connection) = hyper::client::conn::http1::handshake(TokioIo::new(stream))
        .await
        .expect("HTTP handshake");
    tokio::spawn(connection);
    let request = Request::builder()
        .method(method)
        .uri(path)
        .header("host", addr.to_string())
        .header("content-type", "application/json")
        .body(Full::new(Bytes::from(body.to_owned())))
        .unwrap();
    let response = sender.send_request(request).await.expect("a response");
    let status = response.status().as_u16();
    let headers = response.headers().clone();
    let mut incoming = response.into_body();
    let mut chunks = Vec::new();
    while let Some(frame) = incoming.frame().await {
        if let Ok(data) = frame.expect("a body frame").into_data() {
            chunks.push((t0.elapsed(), data));
        }
    }
    let body = chunks
        .iter()
        .map(|(_, c)| String::from_utf8_lossy(c).into_owned())
        .collect();
    Answer {
        status,
        headers,
        body,
        chunks,
    }
}
