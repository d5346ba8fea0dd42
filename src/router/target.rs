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

/// The OpenAI-compatible endpoints the router forwards (POST, the model in
/// the JSON body, or in `X-Model` for a body that is not JSON).
pub const OPENAI_PATHS: &[&str] = &[
    "/v1/chat/completions",
    "/v1/completions",
    "/v1/embeddings",
    "/v1/responses",
    "/v1/moderations",
    "/v1/images/generations",
    "/v1/images/edits",
    "/v1/images/variations",
    "/v1/audio/transcriptions",
    "/v1/audio/translations",
    "/v1/audio/speech",
    "/v1/rerank",
    "/v1/score",
];

/// Why a path is not forwarded: the router sends model servers their
/// inference APIs only, never their control endpoints (vLLM's `/sleep`,
/// `/wake_up`, `/collective_rpc`; SGLang's `/release_memory_occupation`):
/// through a router every client reaches every tenant's servers, and a
/// sleep sent behind the operator's back left a model Loaded in status and
/// answering nothing.
#[derive(Debug, PartialEq, Eq)]
pub enum NotForwarded {
    /// 404: not an inference path.
    Path,
    /// 405: an inference path, another method (`Allow` names it).
    Method(&'static str),
}

/// Model servers' control endpoints: a `--forward-path` may not name one
/// (the operator alone sleeps, wakes and loads adapters).
const CONTROL_PATHS: &[&str] = &[
    "/sleep",
    "/wake_up",
    "/is_sleeping",
    "/collective_rpc",
    "/reset_prefix_cache",
    "/release_memory_occupation",
    "/resume_memory_occupation",
    "/update_weights_from_disk",
    "/v1/load_lora_adapter",
    "/v1/unload_lora_adapter",
    "/load_lora_adapter",
    "/unload_lora_adapter",
    "/start_profile",
    "/stop_profile",
];

/// Words that mark a model server's control endpoint, whatever its
/// spelling (vLLM's `/sleep`, `/wake_up`, `/pause`, `/resume`,
/// `/scale_elastic_ep`, `/collective_rpc`; SGLang's
/// `/release_memory_occupation`, `/init_weights_update_group`,
/// `/update_weights_from_distributed`, `/flush_cache`, `/abort_request`;
/// adapters' and profilers' endpoints): a segment containing one is
/// refused, so a server's next control endpoint of a known kind is refused
/// before anyone lists it.
pub const CONTROL_WORDS: &[&str] = &[
    "sleep",
    "wake",
    "pause",
    "resume",
    "collective",
    "rpc",
    "prefix_cache",
    "flush",
    "abort",
    "memory_occupation",
    "weights",
    "lora",
    "adapter",
    "profile",
    "scale_elastic",
    "shutdown",
    "kill",
    "restart",
    "reload",
    "config",
    "admin",
    "debug",
];

/// Checks a `--forward-path`: a plain absolute path (lower-case letters,
/// digits, `-`, `_` and `.` in non-empty segments, no `.` or `..`
/// segment, no encoding, no trailing `/`: what a request must then name
/// exactly), that names no control endpoint (a segment containing a
/// [`CONTROL_WORDS`] word).
pub fn check_forward_path(path: &str) -> Result<(), String> {
    let plain = |seg: &str| {
        !seg.is_empty()
            && seg != "."
            && seg != ".."
            && seg
                .bytes()
                .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b"-_.".contains(&b))
    };
    let Some(rest) = path.strip_prefix('/') else {
        return Err(format!(
            "--forward-path {path:?}: give an absolute path without a query, such as /generate"
        ));
    };
    if !rest.split('/').all(plain) {
        return Err(format!(
            "--forward-path {path:?}: give a plain absolute path (lower-case letters, digits, '-', '_' and '.' between single slashes, no '.' or '..' segment, no %-encoding, no query, no trailing slash), such as /generate"
        ));
    }
    let control = CONTROL_PATHS.contains(&path)
        || rest
            .split('/')
            .any(|seg| CONTROL_WORDS.iter().any(|w| seg.contains(w)));
    if control {
        return Err(format!(
            "--forward-path {path}: a model server's control endpoint is never forwarded (the operator alone sleeps, wakes and loads)"
        ));
    }
    Ok(())
}

/// Whether `method path` is an inference API the router forwards: the
/// OpenAI endpoints above (POST); KServe v2's `/v2/models/<name>` and
/// `/versions/<v>` metadata (GET), `infer`, `generate` and
/// `generate_stream` (POST); and the exact paths of `extra`
/// (`--forward-path`, GET or POST, the model in `X-Model`).
pub fn forwarded(method: &Method, path: &str, extra: &[String]) -> Result<(), NotForwarded> {
    let want = |allowed: &'static str| {
        if method.as_str() == allowed {
            Ok(())
        } else {
            Err(NotForwarded::Method(allowed))
        }
    };
    if OPENAI_PATHS.contains(&path) {
        return want("POST");
    }
    if extra.iter().any(|p| p == path) {
        return match *method {
            Method::GET | Method::POST => Ok(()),
            _ => Err(NotForwarded::Method("GET, POST")),
        };
    }
    let Some(rest) = path.strip_prefix("/v2/models/") else {
        return Err(NotForwarded::Path);
    };
    let segment = |s: &str| !s.is_empty() && !s.contains('/');
    let (name, rest) = rest.split_once('/').unwrap_or((rest, ""));
    if !segment(name) {
        return Err(NotForwarded::Path);
    }
    let rest = match rest.strip_prefix("versions/") {
        Some(v) => {
            let (version, tail) = v.split_once('/').unwrap_or((v, ""));
            if !segment(version) {
                return Err(NotForwarded::Path);
            }
            tail
        }
        None => rest,
    };
    match rest {
        "" => want("GET"),
        "infer" | "generate" | "generate_stream" => want("POST"),
        _ => Err(NotForwarded::Path),
    }
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
    fn only_the_inference_apis_are_forwarded() {
        let ok = |m: Method, p: &str| forwarded(&m, p, &[]);
        for p in OPENAI_PATHS {
            assert_eq!(ok(Method::POST, p), Ok(()), "{p}");
            assert_eq!(ok(Method::GET, p), Err(NotForwarded::Method("POST")));
        }
        for p in [
            "/v2/models/resnet/infer",
            "/v2/models/resnet/versions/3/infer",
            "/v2/models/llm/generate",
            "/v2/models/llm/generate_stream",
        ] {
            assert_eq!(ok(Method::POST, p), Ok(()), "{p}");
        }
        assert_eq!(ok(Method::GET, "/v2/models/resnet"), Ok(()));
        assert_eq!(ok(Method::GET, "/v2/models/resnet/versions/3"), Ok(()));
        assert_eq!(
            ok(Method::DELETE, "/v2/models/resnet"),
            Err(NotForwarded::Method("GET"))
        );
        // Model servers' control endpoints, and anything not listed.
        for p in CONTROL_PATHS.iter().chain(&[
            "/v1/anything",
            "/v2/models/resnet/sleep",
            "/v2/models//infer",
            "/v2/models/a/versions//infer",
            "/v2/repository/index",
            "/generate",
        ]) {
            assert_eq!(ok(Method::POST, p), Err(NotForwarded::Path), "{p}");
            if CONTROL_PATHS.contains(p) {
                assert!(check_forward_path(p).is_err(), "{p}");
            }
        }
        assert!(check_forward_path("generate").is_err());
        // The black-box round's finding 11: spellings of control endpoints
        // that reach the same handler, and other servers' control
        // endpoints, are refused; plain inference paths are not.
        for p in [
            "/sleep/",
            "/SLEEP",
            "//sleep",
            "/./sleep",
            "/v1/../sleep",
            "/%73leep",
            "/wake_up/",
            "/pause",
            "/resume",
            "/scale_elastic_ep",
            "/init_weights_update_group",
            "/update_weights_from_distributed",
            "/flush_cache",
            "/abort_request",
            "/",
            "/generate?x=1",
        ] {
            assert!(check_forward_path(p).is_err(), "{p} was accepted");
        }
        for p in [
            "/generate",
            "/v1/tokenize",
            "/detokenize",
            "/v1/chat/completions_v2",
        ] {
            assert!(check_forward_path(p).is_ok(), "{p} was refused");
        }
        let extra = ["/generate".to_owned()];
        assert_eq!(forwarded(&Method::POST, "/generate", &extra), Ok(()));
        assert_eq!(
            forwarded(&Method::PUT, "/generate", &extra),
            Err(NotForwarded::Method("GET, POST"))
        );
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
