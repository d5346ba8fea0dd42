//! Which model a request is for: from the path (KServe v2 / Triton), the
//! JSON body's `model` field (OpenAI-compatible `POST /v1/...`), or the
//! `X-Model` header for anything else.

use bytes::Bytes;
use http::{HeaderMap, Method};

/// The header that names the model when neither path nor body do (and for
/// bodies that are not JSON, such as multipart audio uploads).
pub const MODEL_HEADER: &str = "x-model";

/// Why a request names no usable model: the 400's message.
#[derive(Debug, PartialEq, Eq, thiserror::Error)]
pub enum BadRequest {
    #[error(
        "the request body is not JSON ({0}); send JSON or name the model in the X-Model header"
    )]
    NotJson(String),
    #[error(
        "the request body is JSON but not an object; send an object with a \"model\" field or name the model in the X-Model header"
    )]
    NotObject,
    #[error("the request body has more than one \"model\" field")]
    TwoModels,
    #[error("the request body has no \"model\" field")]
    NoModel,
    #[error("\"model\" must be a string, not {0}")]
    ModelNotString(&'static str),
    #[error("\"model\" is empty")]
    EmptyModel,
    #[error(
        "no model named: {method} {path} is routed by the X-Model header (or POST /v1/... with a JSON \"model\", or /v2/models/<name>/...)"
    )]
    Unrouted { method: String, path: String },
    #[error("the request body is larger than {limit} bytes (--max-body)")]
    TooLarge { limit: usize },
    #[error("the X-Model header is not valid text")]
    BadHeader,
    #[error("the request has more than one X-Model header")]
    TwoModelHeaders,
    #[error(
        "CONNECT {target} is not served: the router forwards HTTP requests to model pods, not tunnels"
    )]
    Connect { target: String },
}

/// Where the request's model is named, so the router knows whether it must
/// read the body before it can route.
#[derive(Debug, PartialEq, Eq)]
pub enum Named {
    /// In the path or a header: routable without reading the body.
    Known(String),
    /// In the JSON body's `model` field.
    InBody,
}

/// Where `method path` (with `headers`) names its model.
pub fn locate(method: &Method, path: &str, headers: &HeaderMap) -> Result<Named, BadRequest> {
    // Two headers are two answers to one question, as two `model` fields
    // are: neither is taken.
    if headers.get_all(MODEL_HEADER).iter().nth(1).is_some() {
        return Err(BadRequest::TwoModelHeaders);
    }
    if let Some(rest) = path.strip_prefix("/v2/models/") {
        let name = rest.split('/').next().unwrap_or_default();
        if !name.is_empty() {
            return Ok(Named::Known(name.to_owned()));
        }
    }
    let header = match headers.get(MODEL_HEADER) {
        Some(v) => Some(v.to_str().map_err(|_| BadRequest::BadHeader)?),
        None => None,
    };
    if method == Method::POST && path.starts_with("/v1/") {
        return Ok(Named::InBody);
    }
    match header {
        Some(h) if !h.trim().is_empty() => Ok(Named::Known(h.trim().to_owned())),
        _ => Err(BadRequest::Unrouted {
            method: method.to_string(),
            path: path.to_owned(),
        }),
    }
}

/// The model an OpenAI-style body names. A body that is not JSON falls
/// back to the `X-Model` header (multipart uploads carry the model as a
/// form field, which the router does not parse).
pub fn from_body(body: &Bytes, headers: &HeaderMap) -> Result<String, BadRequest> {
    #[derive(serde::Deserialize)]
    struct Body {
        // Only `model` is kept; the rest of the body is skipped unparsed
        // into values.
        #[serde(default)]
        model: Option<serde_json::Value>,
    }
    let header = headers
        .get(MODEL_HEADER)
        .and_then(|v| v.to_str().ok())
        .map(str::trim)
        .filter(|h| !h.is_empty());
    // serde reads a JSON array into a struct field by field, so only an
    // object may go to `Body` (`[1,2]` is not a body with model 1).
    let object = body.iter().find(|b| !b.is_ascii_whitespace()) == Some(&b'{');
    let parsed: Result<Body, BadRequest> = if object {
        serde_json::from_slice(body).map_err(|e| {
            if e.to_string().starts_with("duplicate field `model`") {
                BadRequest::TwoModels
            } else {
                BadRequest::NotJson(e.to_string())
            }
        })
    } else {
        match serde_json::from_slice::<serde::de::IgnoredAny>(body) {
            Ok(_) => Err(BadRequest::NotObject),
            Err(e) => Err(BadRequest::NotJson(e.to_string())),
        }
    };
    let parsed = match parsed {
        Ok(b) => b,
        Err(e) => return header.map(str::to_owned).ok_or(e),
    };
    let Some(raw) = parsed.model else {
        return header.map(str::to_owned).ok_or(BadRequest::NoModel);
    };
    match raw {
        serde_json::Value::String(s) if s.is_empty() => Err(BadRequest::EmptyModel),
        serde_json::Value::String(s) => Ok(s),
        other => Err(BadRequest::ModelNotString(json_kind(&other))),
    }
}

fn json_kind(v: &serde_json::Value) -> &'static str {
    match v {
        serde_json::Value::Null => "null",
        serde_json::Value::Bool(_) => "a boolean",
        serde_json::Value::Number(_) => "a number",
        serde_json::Value::String(_) => "a string",
        serde_json::Value::Array(_) => "an array",
        serde_json::Value::Object(_) => "an object",
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn headers(model: Option<&str>) -> HeaderMap {
        let mut h = HeaderMap::new();
        if let Some(m) = model {
            h.insert(MODEL_HEADER, m.parse().unwrap());
        }
        h
    }

    #[test]
    fn the_path_then_the_body_then_the_header_name_the_model() {
        let none = headers(None);
        assert_eq!(
            locate(&Method::POST, "/v2/models/resnet/infer", &none),
            Ok(Named::Known("resnet".into()))
        );
        assert_eq!(
            locate(&Method::GET, "/v2/models/resnet", &none),
            Ok(Named::Known("resnet".into()))
        );
        for path in [
            "/v1/chat/completions",
            "/v1/embeddings",
            "/v1/audio/speech",
            "/v1/anything",
        ] {
            assert_eq!(locate(&Method::POST, path, &none), Ok(Named::InBody));
        }
        assert_eq!(
            locate(&Method::GET, "/generate", &headers(Some("zimage"))),
            Ok(Named::Known("zimage".into()))
        );
        assert!(matches!(
            locate(&Method::GET, "/generate", &none),
            Err(BadRequest::Unrouted { .. })
        ));
        let mut two = headers(Some("a"));
        two.append(MODEL_HEADER, "b".parse().unwrap());
        for path in ["/generate", "/v1/chat/completions", "/v2/models/a/infer"] {
            assert_eq!(
                locate(&Method::POST, path, &two),
                Err(BadRequest::TwoModelHeaders)
            );
        }
    }

    #[test]
    fn a_body_must_name_its_model_as_a_string() {
        let none = headers(None);
        let body = |s: &str| Bytes::from(s.to_owned());
        assert_eq!(
            from_body(&body(r#"{"model":"qwen","messages":[]}"#), &none),
            Ok("qwen".into())
        );
        assert_eq!(
            from_body(&body(r#"{"messages":[]}"#), &none),
            Err(BadRequest::NoModel)
        );
        assert_eq!(
            from_body(&body(r#"{"model":7}"#), &none),
            Err(BadRequest::ModelNotString("a number"))
        );
        assert_eq!(
            from_body(&body(r#"{"model":""}"#), &none),
            Err(BadRequest::EmptyModel)
        );
        assert!(matches!(
            from_body(&body("model=qwen"), &none),
            Err(BadRequest::NotJson(_))
        ));
        // JSON, but not an object: an array is not read field by field.
        for not_object in ["[1,2]", r#"["qwen"]"#, r#" "qwen""#, "7"] {
            assert_eq!(
                from_body(&body(not_object), &none),
                Err(BadRequest::NotObject),
                "{not_object}"
            );
        }
        assert_eq!(
            from_body(&body(r#"{"model":"a","model":"b"}"#), &none),
            Err(BadRequest::TwoModels)
        );
        // A multipart upload names the model in the header.
        assert_eq!(
            from_body(&body("--boundary\r\n..."), &headers(Some("whisper"))),
            Ok("whisper".into())
        );
    }
}
