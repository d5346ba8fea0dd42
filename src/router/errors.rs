//! The router's own answers when it cannot proxy a request: OpenAI-shaped
//! errors (`{"error": {"message", "type", "code"}}`), so OpenAI clients show
//! the message as is.

use bytes::Bytes;
use http::{HeaderValue, Response, StatusCode, header};
use serde_json::json;
use std::time::Duration;

/// A JSON answer of the router's own.
pub fn json_response<B: From<Bytes>>(status: StatusCode, body: &serde_json::Value) -> Response<B> {
    let mut response = Response::new(B::from(Bytes::from(body.to_string())));
    *response.status_mut() = status;
    response.headers_mut().insert(
        header::CONTENT_TYPE,
        HeaderValue::from_static("application/json"),
    );
    response
}

/// Why a request was not proxied.
#[derive(Debug, PartialEq, Eq)]
pub enum Refusal {
    /// 400: the request names no usable model, or its body is unusable.
    BadRequest(String),
    /// 404: no watched residency's registry has the model.
    ModelNotFound(String),
    /// 400 to a readiness question (KServe v2 reads any 4xx as "not
    /// ready"): the model has no Ready pod now.
    NotReady(String),
    /// 503 without Retry-After: the model can never load where it is
    /// served (waiting will not help).
    ModelRefused(String),
    /// 503 with Retry-After: the load failed or took longer than
    /// `--load-timeout`.
    ModelUnavailable {
        message: String,
        retry_after: Duration,
    },
    /// 429 with Retry-After: too many requests already wait for loads.
    TooManyPending {
        message: String,
        retry_after: Duration,
    },
    /// 502: the model's pod could not be reached.
    Upstream(String),
    /// 502: the base model's server did not load the adapter the request
    /// names (its words said), so nothing was sent to it.
    AdapterLoadFailed(String),
    /// 408 (and the connection closed): the request's body paused longer
    /// than `--body-timeout`, or was not whole within `--body-deadline`.
    BodyTimeout { after: Duration, whole: bool },
    /// 400 (and the connection closed): a `CONNECT`, whose next bytes would
    /// be a tunnel's, not HTTP.
    Tunnel(String),
    /// 404: not an inference path the router forwards.
    PathNotForwarded(String),
    /// 405: an inference path asked with another method; `Allow` says which.
    MethodNotAllowed {
        message: String,
        allow: &'static str,
    },
    /// 429 with Retry-After: the bodies the router holds would pass
    /// `--max-buffered-bytes`.
    TooMuchBuffered(String),
}

impl Refusal {
    pub fn status(&self) -> StatusCode {
        match self {
            Refusal::BadRequest(_) | Refusal::NotReady(_) | Refusal::Tunnel(_) => {
                StatusCode::BAD_REQUEST
            }
            Refusal::ModelNotFound(_) | Refusal::PathNotForwarded(_) => StatusCode::NOT_FOUND,
            Refusal::MethodNotAllowed { .. } => StatusCode::METHOD_NOT_ALLOWED,
            Refusal::TooMuchBuffered(_) => StatusCode::TOO_MANY_REQUESTS,
            Refusal::ModelRefused(_) | Refusal::ModelUnavailable { .. } => {
                StatusCode::SERVICE_UNAVAILABLE
            }
            Refusal::TooManyPending { .. } => StatusCode::TOO_MANY_REQUESTS,
            Refusal::Upstream(_) | Refusal::AdapterLoadFailed(_) => StatusCode::BAD_GATEWAY,
            Refusal::BodyTimeout { .. } => StatusCode::REQUEST_TIMEOUT,
        }
    }

    /// The OpenAI error `type` and `code`.
    fn kind(&self) -> (&'static str, &'static str) {
        match self {
            Refusal::BadRequest(_) | Refusal::Tunnel(_) => {
                ("invalid_request_error", "invalid_request")
            }
            Refusal::ModelNotFound(_) => ("invalid_request_error", "model_not_found"),
            Refusal::PathNotForwarded(_) => ("invalid_request_error", "path_not_found"),
            Refusal::MethodNotAllowed { .. } => ("invalid_request_error", "method_not_allowed"),
            Refusal::TooMuchBuffered(_) => ("rate_limit_error", "too_much_buffered"),
            Refusal::NotReady(_) => ("invalid_request_error", "model_not_ready"),
            Refusal::ModelRefused(_) => ("server_error", "model_refused"),
            Refusal::ModelUnavailable { .. } => ("server_error", "model_unavailable"),
            Refusal::TooManyPending { .. } => ("rate_limit_error", "too_many_pending"),
            Refusal::Upstream(_) => ("server_error", "upstream_error"),
            Refusal::AdapterLoadFailed(_) => ("server_error", "adapter_load_failed"),
            Refusal::BodyTimeout { .. } => ("invalid_request_error", "request_timeout"),
        }
    }

    fn message(&self) -> String {
        match self {
            Refusal::BadRequest(m)
            | Refusal::Tunnel(m)
            | Refusal::ModelNotFound(m)
            | Refusal::NotReady(m)
            | Refusal::ModelRefused(m)
            | Refusal::Upstream(m)
            | Refusal::AdapterLoadFailed(m)
            | Refusal::PathNotForwarded(m)
            | Refusal::TooMuchBuffered(m)
            | Refusal::MethodNotAllowed { message: m, .. }
            | Refusal::ModelUnavailable { message: m, .. }
            | Refusal::TooManyPending { message: m, .. } => m.clone(),
            Refusal::BodyTimeout {
                after,
                whole: false,
            } => format!(
                "the request body stopped arriving for {}s (--body-timeout)",
                after.as_secs_f64()
            ),
            Refusal::BodyTimeout { after, whole: true } => format!(
                "the request body did not arrive whole within {}s (--body-deadline)",
                after.as_secs_f64()
            ),
        }
    }

    fn retry_after(&self) -> Option<Duration> {
        match self {
            Refusal::ModelUnavailable { retry_after, .. }
            | Refusal::TooManyPending { retry_after, .. } => Some(*retry_after),
            // The bodies held now are answered within a load's time; a
            // second is a floor, not a promise.
            Refusal::TooMuchBuffered(_) => Some(Duration::from_secs(1)),
            _ => None,
        }
    }

    /// The response the client gets.
    pub fn response<B: From<Bytes>>(&self) -> Response<B> {
        let (type_, code) = self.kind();
        let body = json!({"error": {"message": self.message(), "type": type_, "code": code}});
        let mut response = json_response(self.status(), &body);
        let headers = response.headers_mut();
        if let Some(after) = self.retry_after() {
            // Whole seconds, at least one (a zero would invite a spin).
            let secs = after.as_secs_f64().ceil().max(1.0) as u64;
            headers.insert(header::RETRY_AFTER, HeaderValue::from(secs));
        }
        if let Refusal::MethodNotAllowed { allow, .. } = self {
            headers.insert(header::ALLOW, HeaderValue::from_static(allow));
        }
        if matches!(
            self,
            Refusal::BodyTimeout { .. } | Refusal::Tunnel(_) | Refusal::TooMuchBuffered(_)
        ) {
            // The rest of the body (or a tunnel's bytes) may still come:
            // the connection cannot carry another request.
            headers.insert(header::CONNECTION, HeaderValue::from_static("close"));
        }
        response
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use http_body_util::Full;

    #[test]
    fn errors_are_openai_shaped_and_only_transient_ones_say_when_to_retry() {
        let r: Response<Full<Bytes>> =
            Refusal::ModelRefused("big needs 20Gi, budget is 16Gi".into()).response();
        assert_eq!(r.status(), 503);
        assert!(r.headers().get(header::RETRY_AFTER).is_none());
        let r: Response<Full<Bytes>> = Refusal::ModelUnavailable {
            message: "timed out".into(),
            retry_after: Duration::from_millis(1500),
        }
        .response();
        assert_eq!(r.status(), 503);
        assert_eq!(r.headers()[header::RETRY_AFTER], "2");
        let r: Response<Full<Bytes>> = Refusal::TooManyPending {
            message: "full".into(),
            retry_after: Duration::ZERO,
        }
        .response();
        assert_eq!(
            (r.status().as_u16(), &r.headers()[header::RETRY_AFTER]),
            (429, &HeaderValue::from(1))
        );
    }
}
