//! vLLM's runtime LoRA adapter endpoints, as vLLM 0.32 for CPU answers them
//! (started with `--enable-lora` and `VLLM_ALLOW_RUNTIME_LORA_UPDATING=True`;
//! `tests/it/real_servers.rs` runs the same scenario against both):
//!
//! - `POST /v1/load_lora_adapter {"lora_name", "lora_path"}`: 200 and a
//!   sentence; 400 `InvalidUserInput` for an empty name or path, a name
//!   that is the base model's, or a name already loaded (unless
//!   `load_inplace`); 404 `NotFoundError` for a path with no
//!   `adapter_config.json` (read from the disk: the fake reads the same
//!   file vLLM does); 500 `InternalServerError` for an adapter whose rank
//!   (`r` in that file) exceeds `--max-lora-rank`, in vLLM's words (its
//!   engine refuses it; the server goes on serving).
//! - `POST /v1/unload_lora_adapter {"lora_name"}`: 200 and a sentence; 404
//!   `NotFoundError` for a name not loaded.
//! - `GET /v1/models`: the base model, then each adapter in the order it
//!   was loaded, with `parent` the base model and `root` its path.
//! - A request whose `model` is a loaded adapter is answered by it (the
//!   text names the adapter); once unloaded, vLLM's 404.
//!
//! What it fakes: no weights are read (only the config), and vLLM's GPU
//! and host slots (`--max-loras`, `--max-cpu-loras`) bound what its engine
//! keeps, not what its API accepts (seen on the real server: three adapters
//! accepted with two host slots), so the fake accepts any number too.
//! Without `--enable-lora` the endpoints are vLLM's 404.

use super::{Body, JSON, Server, full, read_body, respond};
use http::{Method, Request, Response, StatusCode};
use hyper::body::Incoming;
use serde_json::{Value, json};
use std::sync::Arc;
use std::sync::Mutex;

/// A fake server's adapters, when it serves them.
#[derive(Debug)]
pub struct Adapters {
    /// `--max-lora-rank`: a larger rank is refused.
    max_rank: u64,
    /// Name and path, in the order they were loaded.
    loaded: Mutex<Vec<(String, String)>>,
}

impl Adapters {
    pub fn new(max_rank: u64) -> Self {
        Adapters {
            max_rank,
            loaded: Mutex::default(),
        }
    }

    /// The loaded adapters' names and paths, in the order they were loaded.
    pub fn loaded(&self) -> Vec<(String, String)> {
        self.loaded.lock().expect("adapters lock").clone()
    }

    /// Whether `name` is a loaded adapter.
    pub fn has(&self, name: &str) -> bool {
        let loaded = self.loaded.lock().expect("adapters lock");
        loaded.iter().any(|(n, _)| n == name)
    }
}

/// vLLM's error body.
fn error(status: StatusCode, kind: &str, message: &str) -> (StatusCode, Value) {
    let body = json!({"error": {"message": message, "type": kind, "param": null, "code": status.as_u16()}});
    (status, body)
}

/// Answers the adapter endpoints, or hands the request back.
pub(super) async fn endpoint(
    req: Request<Incoming>,
    server: &Arc<Server>,
) -> Result<Response<Body>, Request<Incoming>> {
    let load = match (req.method(), req.uri().path()) {
        (&Method::POST, "/v1/load_lora_adapter") => true,
        (&Method::POST, "/v1/unload_lora_adapter") => false,
        _ => return Err(req),
    };
    let pod = server.id.pod.clone();
    let Some(adapters) = &server.adapters else {
        // The routes exist only with runtime updating enabled (FastAPI's 404).
        let body = json!({"detail": "Not Found"}).to_string();
        return Ok(respond(StatusCode::NOT_FOUND, JSON, full(body), &pod));
    };
    let request: Value = read_body(req)
        .await
        .and_then(|b| serde_json::from_slice(&b).ok())
        .unwrap_or(Value::Null);
    let answer = if load {
        load_adapter(adapters, &server.id.model, &request)
    } else {
        unload_adapter(adapters, &request)
    };
    Ok(match answer {
        Ok(sentence) => respond(StatusCode::OK, "text/plain", full(sentence), &pod),
        Err((status, body)) => respond(status, JSON, full(body.to_string()), &pod),
    })
}

fn load_adapter(
    adapters: &Adapters,
    base: &str,
    request: &Value,
) -> Result<String, (StatusCode, Value)> {
    let name = request["lora_name"].as_str().unwrap_or_default();
    let path = request["lora_path"].as_str().unwrap_or_default();
    let invalid = |message: String| error(StatusCode::BAD_REQUEST, "InvalidUserInput", &message);
    if name.is_empty() || path.is_empty() {
        return Err(invalid(
            "Both 'lora_name' and 'lora_path' must be provided.".into(),
        ));
    }
    if name == base {
        return Err(invalid(format!(
            "The lora adapter '{name}' conflicts with a served base model."
        )));
    }
    let in_place = request["load_inplace"].as_bool().unwrap_or(false);
    if !in_place && adapters.has(name) {
        return Err(invalid(format!(
            "The lora adapter '{name}' has already been loaded. If you want to load the \
             adapter in place, set 'load_inplace' to True."
        )));
    }
    let config = std::path::Path::new(path).join("adapter_config.json");
    let Some(config) = std::fs::read(&config)
        .ok()
        .and_then(|b| serde_json::from_slice::<Value>(&b).ok())
    else {
        return Err(error(
            StatusCode::NOT_FOUND,
            "NotFoundError",
            &format!("Loading lora {name} failed: No adapter found for {path}"),
        ));
    };
    let rank = config["r"].as_u64().unwrap_or(0);
    if rank > adapters.max_rank {
        return Err(error(
            StatusCode::INTERNAL_SERVER_ERROR,
            "InternalServerError",
            // The engine's worker refuses it; the API server passes its
            // words on.
            &format!(
                "Call to add_lora method failed: Worker failed with error 'LoRA rank {rank} is \
                 greater than max_lora_rank {}.', please check the stack trace above for the \
                 root cause",
                adapters.max_rank
            ),
        ));
    }
    let mut loaded = adapters.loaded.lock().expect("adapters lock");
    match loaded.iter_mut().find(|(n, _)| n == name) {
        Some(entry) => entry.1 = path.to_owned(),
        None => loaded.push((name.to_owned(), path.to_owned())),
    }
    Ok(format!(
        "Success: LoRA adapter '{name}' added successfully."
    ))
}

fn unload_adapter(adapters: &Adapters, request: &Value) -> Result<String, (StatusCode, Value)> {
    let name = request["lora_name"].as_str().unwrap_or_default();
    if name.is_empty() {
        return Err(error(
            StatusCode::BAD_REQUEST,
            "InvalidUserInput",
            "'lora_name' needs to be provided to unload a LoRA adapter.",
        ));
    }
    let mut loaded = adapters.loaded.lock().expect("adapters lock");
    let Some(i) = loaded.iter().position(|(n, _)| n == name) else {
        return Err(error(
            StatusCode::NOT_FOUND,
            "NotFoundError",
            &format!("The lora adapter '{name}' cannot be found."),
        ));
    };
    loaded.remove(i);
    Ok(format!(
        "Success: LoRA adapter '{name}' removed successfully."
    ))
}

/// `GET /v1/models`: the base model and the adapters.
pub(super) fn models(server: &Server) -> Value {
    let mut data = vec![json!({"id": server.id.model, "object": "model"})];
    if let Some(adapters) = &server.adapters {
        for (name, path) in adapters.loaded() {
            data.push(
                json!({"id": name, "object": "model", "root": path, "parent": server.id.model}),
            );
        }
    }
    json!({"object": "list", "data": data})
}
