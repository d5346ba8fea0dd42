//! What the router answers itself, from its snapshot: the OpenAI model list
//! and model objects, and KServe v2's health, metadata and model-readiness
//! endpoints. None of them is proxied, loads a model or refreshes its
//! recency: monitors and client libraries poll them, and a poll that
//! loaded its model would keep every model it asks about resident.

use super::errors::{Refusal, json_response};
use super::snapshot::Snapshot;
use crate::api::{ModelResidency, ModelState};
use crate::residency::placement::{Placement, Restored, place_with};
use bytes::Bytes;
use http::{Method, Response, StatusCode};
use http_body_util::Full;
use serde_json::{Value, json};

/// A question the router answers itself.
#[derive(Debug, PartialEq, Eq)]
pub enum Question<'a> {
    /// `GET /v1/models`: every model, OpenAI's list format.
    Models,
    /// `GET /v1/models/<id>`: one model object, or 404.
    Model(&'a str),
    /// `GET /v2/models/<name>/ready` (and `/versions/<v>/ready`): 200 when
    /// the model has a Ready pod, else 400.
    ModelReady(&'a str),
    /// `GET /v2/health/live`: the router is up.
    ServerLive,
    /// `GET /v2/health/ready`: the router has listed what it serves.
    ServerReady,
    /// `GET /v2`: KServe v2 server metadata.
    ServerMetadata,
}

/// The question `method path` asks, if the router answers it itself.
pub fn question<'a>(method: &Method, path: &'a str) -> Option<Question<'a>> {
    if method != Method::GET {
        return None;
    }
    // Model names are DNS labels: one path segment, never empty.
    let one_segment = |s: &'a str| (!s.is_empty() && !s.contains('/')).then_some(s);
    match path {
        "/v1/models" => Some(Question::Models),
        "/v2/health/live" => Some(Question::ServerLive),
        "/v2/health/ready" => Some(Question::ServerReady),
        "/v2" => Some(Question::ServerMetadata),
        _ => {
            if let Some(id) = path.strip_prefix("/v1/models/") {
                return one_segment(id).map(Question::Model);
            }
            let rest = path.strip_prefix("/v2/models/")?.strip_suffix("/ready")?;
            let name = match rest.split_once("/versions/") {
                Some((name, version)) => one_segment(version).and(one_segment(name))?,
                None => one_segment(rest)?,
            };
            Some(Question::ModelReady(name))
        }
    }
}

/// The answer to `q`; `router_ready` is whether both watches have listed.
pub fn answer(q: Question<'_>, snap: &Snapshot, router_ready: bool) -> Response<Full<Bytes>> {
    match q {
        // Built off the serving threads, once per snapshot ([`models_list`]).
        Question::Models => ok(model_list(snap)),
        Question::Model(id) if snap.adapters.contains_key(id) => {
            ok(adapter(snap, id, &mut Restored::default()))
        }
        Question::Model(id) | Question::ModelReady(id) if !snap.models.contains_key(id) => {
            snap.not_listed(id).response()
        }
        Question::Model(id) => ok(model(snap, id, &mut Restored::default())),
        Question::ModelReady(name) => {
            let view = &snap.models[name];
            if view.ready.is_empty() {
                let states: Vec<String> = view
                    .homes
                    .iter()
                    .map(|&i| format!("{:?} on {}", snap.state(i, name), snap.residency_name(i)))
                    .collect();
                Refusal::NotReady(format!(
                    "{name} has no Ready pod ({}); a request for it loads it",
                    states.join(", ")
                ))
                .response()
            } else {
                empty(StatusCode::OK)
            }
        }
        Question::ServerLive => empty(StatusCode::OK),
        Question::ServerReady if router_ready => empty(StatusCode::OK),
        Question::ServerReady => Refusal::NotReady(
            "the router has not listed the residencies and pods it serves yet".into(),
        )
        .response(),
        Question::ServerMetadata => ok(json!({
            "name": "model-residency",
            "version": env!("CARGO_PKG_VERSION"),
            "extensions": [],
        })),
    }
}

/// A model as OpenAI's model object, with where it stands: its best state
/// (Loaded before Loading/Fetching/Queued before Failed) and the residency
/// that has it; where none has it, the residency a request would load it
/// on (the placement rule), or none and `Refused` when every one would
/// refuse it; then every residency that lists it.
fn model(snap: &Snapshot, name: &str, restored: &mut Restored) -> Value {
    let view = &snap.models[name];
    let places: Vec<(String, ModelState)> = view
        .homes
        .iter()
        .map(|&i| (snap.residency_name(i), snap.state(i, name)))
        .collect();
    let rank = |s: ModelState| match s {
        ModelState::Loaded => Some(0),
        ModelState::Loading | ModelState::Fetching | ModelState::Queued | ModelState::Sleeping => {
            Some(1)
        }
        ModelState::Failed => Some(2),
        _ => None,
    };
    let admitted = places
        .iter()
        .filter_map(|(r, s)| Some((rank(*s)?, r.clone(), *s)))
        .min_by_key(|(rank, _, _)| *rank)
        .map(|(_, r, s)| (Some(r), s));
    let (residency, state) = admitted.unwrap_or_else(|| {
        let homes: Vec<&ModelResidency> =
            view.homes.iter().map(|&i| &*snap.residencies[i]).collect();
        match place_with(name, &homes, &[], restored) {
            Placement::On(j) => (Some(places[j].0.clone()), places[j].1),
            Placement::Nowhere { .. } => (None, ModelState::Refused),
        }
    });
    // OpenAI's `created` (Unix seconds): when the first residency that
    // lists the model was created.
    let created = view
        .homes
        .iter()
        .filter_map(|&i| snap.residencies[i].metadata.creation_timestamp.as_ref())
        .map(|t| t.0.as_second())
        .min()
        .unwrap_or(0);
    json!({
        "id": name,
        "object": "model",
        "created": created,
        "owned_by": "model-residency",
        "state": format!("{state:?}"),
        "residency": residency,
        "residencies": places.iter().map(|(r, s)| json!({"residency": r, "state": format!("{s:?}")})).collect::<Vec<_>>(),
    })
}

/// A LoRA adapter as vLLM lists one: its base model is its `parent` and
/// its directory its `root`; where it stands is its base model's state.
fn adapter(snap: &Snapshot, name: &str, restored: &mut Restored) -> Value {
    let a = &snap.adapters[name];
    let base = snap
        .models
        .contains_key(&a.base)
        .then(|| model(snap, &a.base, restored));
    let field = |f: &str| base.as_ref().and_then(|b| b.get(f)).cloned();
    let state = if a.refused.is_some() {
        json!("Refused")
    } else {
        field("state").unwrap_or(Value::Null)
    };
    json!({
        "id": name,
        "object": "model",
        "created": field("created").unwrap_or(json!(0)),
        "owned_by": "model-residency",
        "root": a.path,
        "parent": a.base,
        "state": state,
        "residency": field("residency").unwrap_or(Value::Null),
    })
}

/// `GET /v1/models`'s body: every model and adapter, each home's engine
/// restored once for all of them.
fn model_list(snap: &Snapshot) -> Value {
    let mut restored = Restored::default();
    let mut names: Vec<&String> = snap.models.keys().collect();
    names.sort();
    let mut data: Vec<Value> = names
        .into_iter()
        .map(|n| model(snap, n, &mut restored))
        .collect();
    let mut adapters: Vec<&String> = snap.adapters.keys().collect();
    adapters.sort();
    data.extend(
        adapters
            .into_iter()
            .map(|n| adapter(snap, n, &mut restored)),
    );
    json!({"object": "list", "data": data})
}

/// `GET /v1/models`, answered from the snapshot's one copy of the list: the
/// first asker after a change builds it on a blocking thread, never on a
/// serving thread (a list of 1,000 models on 4 GPUs took 2.7 s of CPU
/// there, and every request on that thread waited), and every other asker
/// of that snapshot waits for that one build.
pub async fn models_list(snap: &std::sync::Arc<Snapshot>) -> Response<Full<Bytes>> {
    let body = snap
        .model_list
        .get_or_init(|| {
            let snap = snap.clone();
            async move {
                tokio::task::spawn_blocking(move || {
                    Bytes::from(serde_json::to_vec(&model_list(&snap)).unwrap_or_default())
                })
                .await
                .unwrap_or_default()
            }
        })
        .await;
    let mut response = Response::new(Full::new(body.clone()));
    response.headers_mut().insert(
        http::header::CONTENT_TYPE,
        http::HeaderValue::from_static("application/json"),
    );
    response
}

fn ok(body: Value) -> Response<Full<Bytes>> {
    json_response(StatusCode::OK, &body)
}

fn empty(status: StatusCode) -> Response<Full<Bytes>> {
    let mut response = Response::new(Full::new(Bytes::new()));
    *response.status_mut() = status;
    response
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_gets_of_the_catalog_paths_are_answered_here() {
        let get = |p| question(&Method::GET, p);
        assert_eq!(get("/v1/models"), Some(Question::Models));
        assert_eq!(get("/v1/models/qwen"), Some(Question::Model("qwen")));
        assert_eq!(
            get("/v2/models/qwen/ready"),
            Some(Question::ModelReady("qwen"))
        );
        assert_eq!(
            get("/v2/models/qwen/versions/3/ready"),
            Some(Question::ModelReady("qwen"))
        );
        assert_eq!(get("/v2/health/live"), Some(Question::ServerLive));
        assert_eq!(get("/v2/health/ready"), Some(Question::ServerReady));
        assert_eq!(get("/v2"), Some(Question::ServerMetadata));
        // Proxied: inference, model metadata, anything not a GET.
        for p in [
            "/v1/models/",
            "/v1/models/a/b",
            "/v2/models/qwen",
            "/v2/models/qwen/infer",
            "/v2/models//ready",
            "/v2/models/qwen/versions//ready",
            "/v2/models/ready",
        ] {
            assert_eq!(get(p), None, "{p}");
        }
        assert_eq!(question(&Method::POST, "/v2/models/qwen/ready"), None);
        assert_eq!(question(&Method::POST, "/v1/models"), None);
    }
}
