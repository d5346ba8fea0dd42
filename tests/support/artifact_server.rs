//! The artifact server the node agent's tests fetch from: real HTTP on a
//! loopback port, with files, a 404, a connection cut mid-body, an endless
//! body and a slow one, counting the requests it gets per path.

use bytes::Bytes;
use futures::StreamExt;
use http::{Request, Response, StatusCode, header};
use http_body_util::{BodyExt, Full, StreamBody, combinators::BoxBody};
use hyper::body::{Frame, Incoming};
use std::convert::Infallible;
use std::net::SocketAddr;
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};

type Body = BoxBody<Bytes, std::io::Error>;

/// 256 KiB of a repeating pattern, and its sha256.
pub fn weights() -> Vec<u8> {
    (0..256 * 1024).map(|i| (i % 251) as u8).collect()
}

pub fn sha256_hex(data: &[u8]) -> String {
    ring::digest::digest(&ring::digest::SHA256, data)
        .as_ref()
        .iter()
        .map(|b| format!("{b:02x}"))
        .collect()
}

/// The artifact server: `/weights.bin`, `/config.json`, `/missing` (404),
/// `/cut` (declares 256 KiB, sends 64 KiB, then breaks the connection),
/// `/endless` (streams without end). Counts the requests it got.
pub async fn serve() -> (SocketAddr, Arc<AtomicUsize>) {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let requests = Arc::new(AtomicUsize::new(0));
    let counter = requests.clone();
    tokio::spawn(model_residency::http::accept_loop(
        listener,
        move |stream| {
            let counter = counter.clone();
            tokio::spawn(async move {
                let service = hyper::service::service_fn(move |req: Request<Incoming>| {
                    counter.fetch_add(1, Ordering::Relaxed);
                    async move { Ok::<_, Infallible>(answer(req.uri().path())) }
                });
                let _ = hyper::server::conn::http1::Builder::new()
                    .serve_connection(hyper_util::rt::TokioIo::new(stream), service)
                    .await;
            });
        },
    ));
    (addr, requests)
}

fn answer(path: &str) -> Response<Body> {
    let full = |b: Vec<u8>| {
        Full::new(Bytes::from(b))
            .map_err(|never| match never {})
            .boxed()
    };
    let mut response = match path {
        "/weights.bin" => Response::new(full(weights())),
        "/config.json" => Response::new(full(br#"{"layers": 2}"#.to_vec())),
        "/cut" => {
            let chunks = futures::stream::iter([
                Ok(Frame::data(Bytes::from(vec![1u8; 64 * 1024]))),
                Err(std::io::Error::other("the server went away")),
            ]);
            let mut r = Response::new(BodyExt::boxed(StreamBody::new(chunks)));
            r.headers_mut()
                .insert(header::CONTENT_LENGTH, (256 * 1024).into());
            r
        }
        "/slow" => {
            // 256 KiB over about 2.5 s.
            let chunks = futures::stream::iter(0..10).then(|_| async {
                tokio::time::sleep(std::time::Duration::from_millis(250)).await;
                Ok(Frame::data(Bytes::from(vec![3u8; 26 * 1024])))
            });
            Response::new(BodyExt::boxed(StreamBody::new(chunks)))
        }
        "/endless" => {
            let chunks = futures::stream::repeat(())
                .map(|_| Ok(Frame::data(Bytes::from(vec![7u8; 64 * 1024]))));
            Response::new(BodyExt::boxed(StreamBody::new(chunks)))
        }
        _ => {
            let mut r = Response::new(full(b"no such file".to_vec()));
            *r.status_mut() = StatusCode::NOT_FOUND;
            r
        }
    };
    response.headers_mut().insert(
        header::CONTENT_TYPE,
        "application/octet-stream".parse().unwrap(),
    );
    response
}
