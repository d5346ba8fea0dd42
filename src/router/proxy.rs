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
}

/// This thread's pool of connections to model pods (a cheap handle).
pub fn thread_upstream() -> Upstream {
    POOL.with(Upstream::clone)
}

/// One pool for all model pods: idle connections are kept per pod address.
pub fn upstream() -> Upstream {
    let mut connector = HttpConnector::new();
    connector.set_nodelay(true);
    connector.set_connect_timeout(Some(Duration::from_secs(5)));
    Client::builder(TokioExecutor::new())
        .pool_idle_timeout(Duration::from_secs(90))
        .pool_max_idle_per_host(256)
        .build(connector)
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
pub async fn send(
    client: &Upstream,
    addr: SocketAddr,
    parts: &http::request::Parts,
    body: Bytes,
) -> Result<Response<Incoming>, SendError> {
    let path = parts.uri.path_and_query().map_or("/", |p| p.as_str());
    let uri = format!("http://{addr}{path}");
    let mut request = Request::builder()
        .method(parts.method.clone())
        .uri(uri)
        .body(Full::new(body))
        .map_err(|e| SendError::Other(e.to_string()))?;
    copy_headers(&parts.headers, request.headers_mut());
    client.request(request).await.map_err(|e| {
        if e.is_connect() {
            SendError::Connect(e.to_string())
        } else {
            SendError::Other(e.to_string())
        }
    })
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
}
