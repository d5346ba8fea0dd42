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
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};

type Body = BoxBody<Bytes, std::io::Error>;

/// 256 KiB of a repeating pattern, and its sha256.
pub fn weights() -> Vec<u8> {
    (0..256 * 1024).map(|i| (i % 251) as u8).collect()
}

pub fn sha256_hex(data: &[u8]) -> String {
    model_residency::node_agent::fetch::encode_hex(
        ring::digest::digest(&ring::digest::SHA256, data).as_ref(),
    )
}

/// The artifact server: `/weights.bin`, `/config.json`, `/missing` (404),
/// `/cut` (declares 256 KiB, sends 64 KiB, then breaks the connection),
/// `/endless` (streams without end), `/slow` (3 MiB over about 4.8 s),
/// `/ranged/weights.bin` (the weights, and the rest of them for a `Range:
/// bytes=N-` request, as a 206; 416 past the end), `/flaky/weights.bin`
/// (the first request gets 64 KiB of the weights and a broken connection,
/// later ones what `/ranged/` gets). `/slow` honours ranges too. Counts the
/// requests it got.
pub async fn serve() -> (SocketAddr, Arc<AtomicUsize>) {
    let (addr, requests, _) = serve_logged().await;
    (addr, requests)
}

/// [`serve`], with a log of each request as `<path> <range header or ->`.
pub async fn serve_logged() -> (SocketAddr, Arc<AtomicUsize>, Arc<Mutex<Vec<String>>>) {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let requests = Arc::new(AtomicUsize::new(0));
    let log = Arc::new(Mutex::new(Vec::new()));
    let flaky = Arc::new(AtomicUsize::new(0));
    let (counter, log_w) = (requests.clone(), log.clone());
    tokio::spawn(model_residency::http::accept_loop(
        listener,
        move |stream| {
            let (counter, log, flaky) = (counter.clone(), log_w.clone(), flaky.clone());
            tokio::spawn(async move {
                let service = hyper::service::service_fn(move |req: Request<Incoming>| {
                    counter.fetch_add(1, Ordering::Relaxed);
                    let path = req.uri().path().to_owned();
                    let range = req
                        .headers()
                        .get(header::RANGE)
                        .and_then(|v| v.to_str().ok())
                        .map(str::to_owned);
                    log.lock()
                        .unwrap()
                        .push(format!("{path} {}", range.as_deref().unwrap_or("-")));
                    let first_flaky =
                        path == "/flaky/weights.bin" && flaky.fetch_add(1, Ordering::Relaxed) == 0;
                    async move { Ok::<_, Infallible>(answer(&path, range.as_deref(), first_flaky)) }
                });
                let _ = hyper::server::conn::http1::Builder::new()
                    .serve_connection(hyper_util::rt::TokioIo::new(stream), service)
                    .await;
            });
        },
    ));
    (addr, requests, log)
}

/// The offset of a `bytes=N-` range.
fn range_start(range: Option<&str>) -> Option<usize> {
    range?
        .strip_prefix("bytes=")?
        .strip_suffix('-')?
        .parse()
        .ok()
}

/// `content` as a 200, or from a range's start as a 206 (416 past its
/// end), sent in chunks of `chunk` bytes `pause` apart.
fn ranged(
    content: Vec<u8>,
    range: Option<&str>,
    chunk: usize,
    pause: std::time::Duration,
) -> Response<Body> {
    let len = content.len();
    let from = range_start(range).unwrap_or(0);
    if from >= len && range.is_some() {
        let mut r = Response::new(
            Full::new(Bytes::new())
                .map_err(|never| match never {})
                .boxed(),
        );
        *r.status_mut() = StatusCode::RANGE_NOT_SATISFIABLE;
        r.headers_mut().insert(
            header::CONTENT_RANGE,
            format!("bytes */{len}").parse().unwrap(),
        );
        return r;
    }
    let rest = Bytes::from(content).slice(from..);
    let pieces: Vec<Bytes> = rest.chunks(chunk).map(|c| rest.slice_ref(c)).collect();
    let chunks = futures::stream::iter(pieces).then(move |c| async move {
        tokio::time::sleep(pause).await;
        Ok(Frame::data(c))
    });
    let mut r = Response::new(BodyExt::boxed(StreamBody::new(chunks)));
    r.headers_mut()
        .insert(header::CONTENT_LENGTH, (len - from).into());
    if range.is_some() {
        *r.status_mut() = StatusCode::PARTIAL_CONTENT;
        r.headers_mut().insert(
            header::CONTENT_RANGE,
            format!("bytes {from}-{}/{len}", len - 1).parse().unwrap(),
        );
    }
    r
}

/// What `/slow` serves: 3 MiB (the fetcher writes to disk a MiB at a
/// time, so a download cut short leaves some on disk).
pub fn slow_content() -> Vec<u8> {
    (0..3 << 20).map(|i| (i % 253) as u8).collect()
}

fn answer(path: &str, range: Option<&str>, first_flaky: bool) -> Response<Body> {
    let full = |b: Vec<u8>| {
        Full::new(Bytes::from(b))
            .map_err(|never| match never {})
            .boxed()
    };
    let redirect = |to: &str| {
        let mut r = Response::new(full(Vec::new()));
        *r.status_mut() = StatusCode::FOUND;
        r.headers_mut()
            .insert(header::LOCATION, to.parse().unwrap());
        r
    };
    let mut response = match path {
        "/weights.bin" => Response::new(full(weights())),
        // A store that redirects: into /store/ (relative and absolute
        // forms), out of it, in a loop.
        "/store/moved.bin" => redirect("/store/blobs/weights.bin"),
        "/store/hop.bin" => redirect("moved.bin"),
        "/store/blobs/weights.bin" => Response::new(full(weights())),
        "/store/away.bin" => redirect("/weights.bin"),
        "/store/loop.bin" => redirect("/store/loop.bin"),
        "/store/nowhere.bin" => {
            let mut r = Response::new(full(Vec::new()));
            *r.status_mut() = StatusCode::TEMPORARY_REDIRECT;
            r
        }
        "/config.json" => Response::new(full(br#"{"layers": 2}"#.to_vec())),
        // The weights with their first bytes made from the name: a file of
        // its own content per name.
        p if p.starts_with("/distinct/") => {
            let mut w = weights();
            w[..p.len()].copy_from_slice(p.as_bytes());
            Response::new(full(w))
        }
        "/flaky/weights.bin" if first_flaky => {
            // The break comes after the bytes are on their way.
            let chunks = futures::stream::iter([
                Ok(Frame::data(Bytes::from(weights()[..64 * 1024].to_vec()))),
                Err(std::io::Error::other("the server went away")),
            ])
            .then(|item| async {
                if item.is_err() {
                    tokio::time::sleep(std::time::Duration::from_millis(200)).await;
                }
                item
            });
            let mut r = Response::new(BodyExt::boxed(StreamBody::new(chunks)));
            r.headers_mut()
                .insert(header::CONTENT_LENGTH, weights().len().into());
            r
        }
        "/ranged/weights.bin" | "/flaky/weights.bin" => {
            ranged(weights(), range, 64 * 1024, std::time::Duration::ZERO)
        }
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
        // 3 MiB over about 4.8 s.
        "/slow" => ranged(
            slow_content(),
            range,
            64 * 1024,
            std::time::Duration::from_millis(100),
        ),
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

/// A file server over `dir`: `GET /<path>` answers the file at that path
/// under it (no `..`), else 404. What the adapter tests' node agent
/// fetches an adapter's files from.
pub async fn serve_dir(dir: std::path::PathBuf) -> SocketAddr {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    tokio::spawn(model_residency::http::accept_loop(
        listener,
        move |stream| {
            let dir = dir.clone();
            tokio::spawn(async move {
                let service = hyper::service::service_fn(move |req: Request<Incoming>| {
                    let rel = req.uri().path().trim_start_matches('/').to_owned();
                    let file = (!rel.split('/').any(|s| s == ".." || s.is_empty()))
                        .then(|| std::fs::read(dir.join(&rel)).ok())
                        .flatten();
                    async move {
                        let mut r =
                            Response::new(Full::new(Bytes::from(file.clone().unwrap_or_default())));
                        if file.is_none() {
                            *r.status_mut() = StatusCode::NOT_FOUND;
                        }
                        Ok::<_, Infallible>(r)
                    }
                });
                let _ = hyper::server::conn::http1::Builder::new()
                    .serve_connection(hyper_util::rt::TokioIo::new(stream), service)
                    .await;
            });
        },
    ));
    addr
}
