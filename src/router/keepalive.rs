//! A streaming client held through a cold load hears something. A request
//! that asked to stream (`"stream": true`) for a model with no Ready pod is
//! answered at once: `200` with `text/event-stream`, and an SSE comment
//! (`: waiting for <model> to load`) every `--stream-keepalive` while the
//! router holds it, so neither the client nor a proxy between (many close
//! an idle connection at 30-60 s) gives up on a load that takes minutes.
//! Once the model serves, its server's stream follows on the same answer;
//! if it cannot (refused, failed, timed out, or the server answered an
//! error), one `data:` event carries the OpenAI-shaped error the router
//! would have answered, and the stream ends. The first comment says the
//! load's expected time where a GPU has measured it (its `loadSeconds`),
//! as does the `X-Model-Load-Expected` header (seconds). A model unknown,
//! refused everywhere or with no usable GPU gets its error status at once,
//! as without a stream.

use super::{Buffered, ProxyBody, Router};
use bytes::Bytes;
use http::{Response, StatusCode, header};
use http_body_util::{BodyExt, StreamBody};
use hyper::body::Frame;
use std::sync::Arc;
use std::time::Instant;

/// Whether the request asked for a streamed answer (OpenAI's `stream`).
pub fn wants_stream(body: &[u8]) -> bool {
    serde_json::from_slice::<serde_json::Value>(body)
        .ok()
        .and_then(|v| v.get("stream")?.as_bool())
        .unwrap_or(false)
}

/// An SSE comment line: ignored by every SSE client, but bytes on the wire.
fn comment(text: &str) -> Bytes {
    Bytes::from(format!(": {text}\n\n"))
}

/// An error as the one `data:` event of a stream that cannot go on.
fn error_event(status: StatusCode, body: &[u8]) -> Bytes {
    let body = String::from_utf8_lossy(body);
    let error = if body.trim().is_empty() {
        format!(
            r#"{{"error":{{"message":"the model's server answered {status}","type":"server_error","code":"upstream_error"}}}}"#
        )
    } else {
        body.trim().to_owned()
    };
    Bytes::from(format!("data: {error}\n\n"))
}

/// A request held through its model's load, with its body's share of
/// `--max-buffered-bytes` (released when the request ends).
pub(super) struct Held {
    pub parts: http::request::Parts,
    pub body: Bytes,
    pub buffered: Buffered,
    pub start: Instant,
}

impl Router {
    /// The expected load time of `model`, where a GPU has measured it: the
    /// shortest `loadSeconds` among its homes.
    fn expected_load(&self, model: &str) -> Option<f64> {
        let snap = self.snapshot.borrow().clone();
        let view = snap.models.get(model)?;
        view.homes
            .iter()
            .filter_map(|&i| snap.model_status(i, model)?.load_seconds)
            .min_by(f64::total_cmp)
    }

    /// Whether `model` (or the base of the adapter it names) has no Ready
    /// pod now and a GPU would take its load: a request for it would be
    /// held. A model unknown, refused everywhere or with no usable GPU gets
    /// its error status at once, as without a stream.
    pub(super) fn held_for_a_load(&self, model: &str) -> bool {
        use crate::residency::placement::{Placement, place};
        let snap = self.snapshot.borrow().clone();
        let target = snap.adapters.get(model).map_or(model, |a| a.base.as_str());
        let Some(view) = snap.models.get(target) else {
            return false;
        };
        if !view.ready.is_empty() {
            return false;
        }
        let homes: Vec<&crate::api::ModelResidency> =
            view.homes.iter().map(|&i| &*snap.residencies[i]).collect();
        matches!(place(target, &homes, &[]), Placement::On(_))
    }

    /// Answers a streaming request for a cold model at once and keeps the
    /// client alive until the model's own stream follows (see the module).
    pub(super) fn keep_alive_through_load(
        self: &Arc<Self>,
        model: String,
        request: Held,
    ) -> Response<ProxyBody> {
        let every = self.config.stream_keepalive;
        let Held {
            parts,
            body,
            buffered,
            start,
        } = request;
        let (tx, rx) = tokio::sync::mpsc::channel::<Result<Frame<Bytes>, hyper::Error>>(16);
        let expected = self.expected_load(&model);
        let router = self.clone();
        let first = match expected {
            Some(s) => format!("waiting for {model} to load (about {s:.0}s)"),
            None => format!("waiting for {model} to load"),
        };
        tokio::spawn(async move {
            let _buffered = buffered;
            if tx.send(Ok(Frame::data(comment(&first)))).await.is_err() {
                return;
            }
            let served = router.serve_model(&model, &parts, body, start);
            tokio::pin!(served);
            let mut ticks = tokio::time::interval_at(tokio::time::Instant::now() + every, every);
            let answer = loop {
                tokio::select! {
                    answer = &mut served => break answer,
                    _ = ticks.tick() => {
                        let waiting = comment(&format!("waiting for {model} to load"));
                        // The client went away: the held request goes too.
                        if tx.send(Ok(Frame::data(waiting))).await.is_err() {
                            return;
                        }
                    }
                }
            };
            match answer {
                Ok(response) if response.status().is_success() => {
                    let mut upstream = response.into_body();
                    while let Some(frame) = upstream.frame().await {
                        if tx.send(frame).await.is_err() {
                            return;
                        }
                    }
                }
                Ok(response) => {
                    let _ = tx.send(Ok(Frame::data(event_of(response).await))).await;
                }
                Err(refusal) => {
                    let answer = refusal.response::<http_body_util::Full<Bytes>>();
                    let _ = tx.send(Ok(Frame::data(event_of(answer).await))).await;
                }
            }
        });
        let body = StreamBody::new(tokio_stream_of(rx)).boxed();
        let mut response = Response::new(body);
        let headers = response.headers_mut();
        headers.insert(
            header::CONTENT_TYPE,
            header::HeaderValue::from_static("text/event-stream"),
        );
        headers.insert(
            header::CACHE_CONTROL,
            header::HeaderValue::from_static("no-cache"),
        );
        if let Some(s) = expected
            && let Ok(v) = header::HeaderValue::from_str(&format!("{s:.1}"))
        {
            headers.insert("x-model-load-expected", v);
        }
        response
    }
}

/// An answer that ends the stream (the server's error, or the refusal the
/// router would have answered), as one `data:` event.
async fn event_of<B: hyper::body::Body>(response: Response<B>) -> Bytes {
    let status = response.status();
    let bytes = response
        .into_body()
        .collect()
        .await
        .map(|b| b.to_bytes())
        .unwrap_or_default();
    error_event(status, &bytes)
}

/// The channel's frames as a stream.
fn tokio_stream_of(
    mut rx: tokio::sync::mpsc::Receiver<Result<Frame<Bytes>, hyper::Error>>,
) -> impl futures::Stream<Item = Result<Frame<Bytes>, hyper::Error>> + Send + Sync + 'static {
    futures::stream::poll_fn(move |cx| rx.poll_recv(cx))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_a_body_asking_to_stream_is_kept_alive() {
        assert!(wants_stream(br#"{"model":"a","stream":true}"#));
        assert!(!wants_stream(br#"{"model":"a","stream":false}"#));
        assert!(!wants_stream(br#"{"model":"a"}"#));
        assert!(!wants_stream(b"not json"));
        assert_eq!(&comment("x")[..], b": x\n\n");
        let e = error_event(
            StatusCode::SERVICE_UNAVAILABLE,
            br#"{"error":{"code":"model_refused"}}"#,
        );
        assert_eq!(
            &e[..],
            b"data: {\"error\":{\"code\":\"model_refused\"}}\n\n"
        );
    }
}
