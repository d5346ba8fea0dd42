//! Sending a request on to a model pod and streaming its answer back:
//! pooled keep-alive connections (hyper-util's client), headers passed
//! through except hop-by-hop ones, and a guard that counts the request as
//! in flight until its answer's last byte has gone out.

use bytes::Bytes;
use http::{HeaderMap, HeaderName, Request, Response, header};
use http_body_util::Full;
use hyper::body::{Body, Frame, Incoming, SizeHint};
use hyper_util::client::legacy::Client;
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::rt::TokioExecutor;
use std::net::SocketAddr;
use std::pin::Pin;
use std::task::{Context, Poll};
use std::time::Duration;

pub type Upstream = Client<HttpConnector, Full<Bytes>>;

thread_local! {
    /// This thread's pool: a router worker (one thread, one runtime) keeps
    /// its connections to model pods to itself, as an nginx worker does,
    /// so a request never waits on another thread's connection.
    static POOL: Upstream = upstream();
    /// This thread's client for a request sent again (see [`send`]): it
    /// keeps no connection, so the second try never meets another one the
    /// pod closed.
    static FRESH: Upstream = fresh_upstream();
}

/// This thread's pool of connections to model pods (a cheap handle).
pub fn thread_upstream() -> Upstream {
    POOL.with(Upstream::clone)
}

/// One pool for all model pods: idle connections are kept per pod address.
pub fn upstream() -> Upstream {
    Client::builder(TokioExecutor::new())
        .pool_idle_timeout(Duration::from_secs(90))
        .pool_max_idle_per_host(256)
        .build(connector())
}

/// A client that opens a connection per request and keeps none.
fn fresh_upstream() -> Upstream {
    Client::builder(TokioExecutor::new())
        .pool_max_idle_per_host(0)
        .build(connector())
}

fn connector() -> HttpConnector {
    let mut connector = HttpConnector::new();
    connector.set_nodelay(true);
    connector.set_connect_timeout(Some(Duration::from_secs(5)));
    connector
}

/// Headers that belong to one connection, not to the request (RFC 9110
/// 7.6.1), `host`, which the client sets for the pod, and `expect`: the
/// router has read the whole body already, so a `100-continue` was met on
/// this hop and would only make the pod wait to say go on.
fn hop_by_hop(name: &HeaderName) -> bool {
    name == header::CONNECTION
        || name == header::HOST
        || name == header::EXPECT
        || name == header::TE
        || name == header::TRAILER
        || name == header::TRANSFER_ENCODING
        || name == header::UPGRADE
        || name == header::PROXY_AUTHORIZATION
        || name == header::PROXY_AUTHENTICATE
        || name.as_str() == "keep-alive"
        || name.as_str() == "proxy-connection"
}

/// Copies headers across the proxy (a request's to the pod, the pod's
/// answer's to the client), leaving the hop-by-hop ones: the fixed set and
/// those the `Connection` header names for this hop.
pub fn copy_headers(from: &HeaderMap, to: &mut HeaderMap) {
    // Read once (and nothing allocated when, as usual, there is none).
    let named: Vec<&str> = from
        .get_all(header::CONNECTION)
        .iter()
        .filter_map(|v| v.to_str().ok())
        .flat_map(|v| v.split(','))
        .map(str::trim)
        .collect();
    for (name, value) in from {
        let listed = named.iter().any(|t| name.as_str().eq_ignore_ascii_case(t));
        if !hop_by_hop(name) && !listed {
            to.append(name.clone(), value.clone());
        }
    }
}

/// Why a request did not reach its pod.
#[derive(Debug)]
pub enum SendError {
    /// No connection could be made: nothing was sent, so it may be sent
    /// elsewhere.
    Connect(String),
    /// The connection broke after the request may have been sent.
    Other(String),
}

/// Sends `parts` with `body` to `addr` and returns the pod's answer, its
/// body unread.
///
/// A request whose connection closed before any answer came is sent once
/// more, on a new connection. A kept-alive connection can close under a
/// request just sent on it: the pod closed it as idle (a server stopping:
/// its pod was deleted, and the router had not seen that yet) before the
/// request reached it, and the pool had not yet seen the close. Nothing
/// was answered, and a completion has no effect beyond its answer, so
/// sending it again is what the client would do. The second try keeps no
/// pooled connection: to a server that is gone it fails to connect, and
/// the caller re-resolves the model as for any pod it cannot reach; a
/// second failure of any other kind is final.
pub async fn send(
    client: &Upstream,
    addr: SocketAddr,
    parts: &http::request::Parts,
    body: Bytes,
) -> Result<Response<Incoming>, SendError> {
    match send_once(client, addr, parts, body.clone()).await {
        Err(Failure::Client(e)) if closed_unanswered(&e) => {
            tracing::debug!(%addr, error = %e, "connection closed before an answer; sending again");
            let fresh = FRESH.with(Upstream::clone);
            send_once(&fresh, addr, parts, body)
                .await
                .map_err(sent_error)
        }
        other => other.map_err(sent_error),
    }
}

async fn send_once(
    client: &Upstream,
    addr: SocketAddr,
    parts: &http::request::Parts,
    body: Bytes,
) -> Result<Response<Incoming>, Failure> {
    let path = parts.uri.path_and_query().map_or("/", |p| p.as_str());
    let uri = format!("http://{addr}{path}");
    let mut request = Request::builder()
        .method(parts.method.clone())
        .uri(uri)
        .body(Full::new(body))
        .map_err(|e| Failure::Request(e.to_string()))?;
    copy_headers(&parts.headers, request.headers_mut());
    client.request(request).await.map_err(Failure::Client)
}

enum Failure {
    Request(String),
    Client(hyper_util::client::legacy::Error),
}

/// Whether the connection ended before the pod's answer began (hyper's
/// "connection closed before message completed", or a request cancelled
/// with its connection).
fn closed_unanswered(e: &hyper_util::client::legacy::Error) -> bool {
    let mut source = std::error::Error::source(e);
    while let Some(s) = source {
        if let Some(h) = s.downcast_ref::<hyper::Error>() {
            return h.is_incomplete_message() || h.is_canceled();
        }
        source = s.source();
    }
    false
}

fn sent_error(e: Failure) -> SendError {
    match e {
        Failure::Request(e) => SendError::Other(e),
        Failure::Client(e) if e.is_connect() => SendError::Connect(e.to_string()),
        Failure::Client(e) => SendError::Other(e.to_string()),
    }
}

/// The largest answer read whole before it is sent on.
const WHOLE_ANSWER_MAX: u64 = 64 << 10;

/// Whether an answer declares a length of at most `WHOLE_ANSWER_MAX`
/// and is not an event stream.
pub fn small_and_whole(headers: &HeaderMap) -> bool {
    let len = headers
        .get(header::CONTENT_LENGTH)
        .and_then(|v| v.to_str().ok()?.parse::<u64>().ok());
    let streaming = headers
        .get(header::CONTENT_TYPE)
        .is_some_and(|v| v.as_bytes().starts_with(b"text/event-stream"));
    len.is_some_and(|n| n <= WHOLE_ANSWER_MAX) && !streaming
}

/// An answer's body streamed frame by frame as the pod sends it, holding
/// `guard` until the body ends or the client goes away.
pub struct Tracked<G> {
    inner: Incoming,
    _guard: G,
}

impl<G> Tracked<G> {
    pub fn new(inner: Incoming, guard: G) -> Self {
        Tracked {
            inner,
            _guard: guard,
        }
    }
}

impl<G: Unpin> Body for Tracked<G> {
    type Data = Bytes;
    type Error = hyper::Error;

    fn poll_frame(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, hyper::Error>>> {
        Pin::new(&mut self.get_mut().inner).poll_frame(cx)
    }

    fn is_end_stream(&self) -> bool {
        self.inner.is_end_stream()
    }

    fn size_hint(&self) -> SizeHint {
        self.inner.size_hint()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use http::HeaderValue;

    #[test]
    fn hop_by_hop_headers_and_those_connection_names_stay_behind() {
        let mut from = HeaderMap::new();
        for (k, v) in [
            ("connection", "keep-alive, X-Hop"),
            ("x-hop", "1"),
            ("keep-alive", "timeout=5"),
            ("transfer-encoding", "chunked"),
            ("host", "router"),
            ("authorization", "Bearer t"),
            ("expect", "100-continue"),
            ("x-request-id", "abc"),
        ] {
            from.append(k, HeaderValue::from_static(v));
        }
        let mut to = HeaderMap::new();
        copy_headers(&from, &mut to);
        let mut kept: Vec<&str> = to.keys().map(|k| k.as_str()).collect();
        kept.sort();
        assert_eq!(kept, ["authorization", "x-request-id"]);
    }

    /// Reads one request (headers and a `content-length` body) from `s`.
    async fn read_request(s: &mut tokio::net::TcpStream) -> bool {
        use tokio::io::AsyncReadExt;
        let mut got = Vec::new();
        let mut buf = [0u8; 1024];
        loop {
            if let Some(end) = got.windows(4).position(|w| w == b"\r\n\r\n") {
                let head = String::from_utf8_lossy(&got[..end]).to_ascii_lowercase();
                let len: usize = head
                    .lines()
                    .find_map(|l| l.strip_prefix("content-length:"))
                    .map_or(0, |v| v.trim().parse().unwrap());
                if got.len() >= end + 4 + len {
                    return true;
                }
            }
            match s.read(&mut buf).await {
                Ok(0) | Err(_) => return false,
                Ok(n) => got.extend_from_slice(&buf[..n]),
            }
        }
    }

    async fn answer(s: &mut tokio::net::TcpStream, body: &str) {
        use tokio::io::AsyncWriteExt;
        let head = format!("HTTP/1.1 200 OK\r\ncontent-length: {}\r\n\r\n", body.len());
        s.write_all(format!("{head}{body}").as_bytes())
            .await
            .unwrap();
    }

    /// A server that refuses a body before it has all of it (a 413 for a
    /// too-large upload) answers and closes: its answer is the client's,
    /// not a 502 of the router's own.
    #[tokio::test]
    async fn an_early_answer_before_the_body_is_sent_is_passed_through() {
        use tokio::io::{AsyncReadExt, AsyncWriteExt};
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let server = tokio::spawn(async move {
            let (mut s, _) = listener.accept().await.unwrap();
            let mut head = [0u8; 4096];
            let _ = s.read(&mut head).await.unwrap();
            let body = r#"{"error":"too large"}"#;
            let answer = format!(
                "HTTP/1.1 413 Payload Too Large\r\ncontent-length: {}\r\nconnection: close\r\n\r\n{body}",
                body.len()
            );
            s.write_all(answer.as_bytes()).await.unwrap();
            // Closed with most of the upload unread, as a server that
            // stops reading does.
            drop(s);
        });
        let (parts, _) = Request::post("/v1/completions")
            .header("content-length", 32 << 20)
            .body(())
            .unwrap()
            .into_parts();
        let body = Bytes::from(vec![b'x'; 32 << 20]);
        let answer = send(&upstream(), addr, &parts, body).await;
        server.await.unwrap();
        let answer = match answer {
            Ok(a) => a,
            Err(SendError::Connect(e) | SendError::Other(e)) => panic!("no answer: {e}"),
        };
        assert_eq!(answer.status(), 413);
        use http_body_util::BodyExt;
        let text = answer.into_body().collect().await.unwrap().to_bytes();
        assert_eq!(text, r#"{"error":"too large"}"#);
    }

    #[tokio::test]
    async fn a_kept_alive_connection_closed_under_a_request_sends_it_once_more_on_a_new_one() {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        // The first connection answers one request, then closes as the
        // second arrives, unanswered (a stopping server's idle keep-alive);
        // every later connection answers.
        let server = tokio::spawn(async move {
            let (mut first, _) = listener.accept().await.unwrap();
            assert!(read_request(&mut first).await);
            answer(&mut first, "one").await;
            assert!(
                read_request(&mut first).await,
                "the second request came on the kept connection"
            );
            drop(first);
            let mut later = 0;
            while let Ok(Ok((mut s, _))) =
                tokio::time::timeout(Duration::from_secs(2), listener.accept()).await
            {
                later += 1;
                if read_request(&mut s).await {
                    answer(&mut s, "two").await;
                }
            }
            later
        });
        let client = upstream();
        let (parts, _) = Request::post("/v1/completions")
            .body(())
            .unwrap()
            .into_parts();
        let text = |r: Response<Incoming>| async move {
            use http_body_util::BodyExt;
            r.into_body().collect().await.unwrap().to_bytes()
        };
        let one = send(&client, addr, &parts, Bytes::from_static(b"{}")).await;
        assert_eq!(text(one.ok().unwrap()).await, "one");
        let two = send(&client, addr, &parts, Bytes::from_static(b"{}")).await;
        let two = match two {
            Ok(r) => text(r).await,
            Err(e) => panic!("the request was not sent again: {e:?}"),
        };
        assert_eq!(two, "two");
        assert_eq!(
            server.await.unwrap(),
            1,
            "one new connection for the second try"
        );
    }

    #[tokio::test]
    async fn a_pod_that_closes_every_connection_unanswered_fails_after_the_second_try() {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let server = tokio::spawn(async move {
            let mut tries = 0;
            while let Ok(Ok((mut s, _))) =
                tokio::time::timeout(Duration::from_secs(2), listener.accept()).await
            {
                tries += usize::from(read_request(&mut s).await);
            }
            tries
        });
        let (parts, _) = Request::post("/v1/completions")
            .body(())
            .unwrap()
            .into_parts();
        let sent = send(&upstream(), addr, &parts, Bytes::from_static(b"{}")).await;
        assert!(matches!(sent, Err(SendError::Other(_))), "{sent:?}");
        assert_eq!(server.await.unwrap(), 2, "sent twice, no more");
    }
}
