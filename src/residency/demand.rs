//! Writing demand: how autoscalers, routers and the CLI ask a residency to
//! load or unload a model.
//!
//! `spec.demand` is a map from model name to the time of its last request,
//! so each is one JSON merge patch of one key, without a read and without
//! a precondition: concurrent writers never drop each other's keys (the
//! API server merges each patch into the object as it is), and a writer
//! never needs a second round trip.
//! - a load sets the model's key to the request time:
//!   `{"spec":{"demand":{"zimage":"<time>"}}}`;
//! - an unload removes the key: `{"spec":{"demand":{"zimage":null}}}`.
//!
//! Server-side apply works too: a map's keys are owned one by one, so an
//! autoscaler can apply only its own keys with its own field manager.

use crate::api::ModelResidency;
use k8s_openapi::jiff::Timestamp;
use kube::api::{Api, Patch, PatchParams};
use serde_json::{Value, json};

/// The merge patch that sets (or, with `None`, removes) one demand key.
pub fn patch(model: &str, at: Option<Timestamp>) -> Value {
    let value = at.map_or(Value::Null, |t| Value::String(t.to_string()));
    json!({ "spec": { "demand": { model: value } } })
}

/// Requests `model` at time `at` (normally now): one write. Returns the
/// residency as the write left it.
pub async fn load(
    api: &Api<ModelResidency>,
    residency: &str,
    model: &str,
    at: Timestamp,
) -> Result<ModelResidency, kube::Error> {
    let body = patch(model, Some(at));
    api.patch(residency, &PatchParams::default(), &Patch::Merge(&body))
        .await
}

/// Stops demanding `model`, which unloads it: one write (removing a key
/// that is not there changes nothing).
pub async fn unload(
    api: &Api<ModelResidency>,
    residency: &str,
    model: &str,
) -> Result<ModelResidency, kube::Error> {
    let body = patch(model, None);
    api.patch(residency, &PatchParams::default(), &Patch::Merge(&body))
        .await
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_request_and_an_unload_are_one_key_each() {
        let at: Timestamp = "2026-11-30T03:00:00.5Z".parse().unwrap();
        assert_eq!(
            patch("zimage", Some(at)),
            json!({"spec": {"demand": {"zimage": "2026-11-30T03:00:00.5Z"}}})
        );
        assert_eq!(
            patch("zimage", None),
            json!({"spec": {"demand": {"zimage": null}}})
        );
    }
}
