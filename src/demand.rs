//! Writing demand: how autoscalers, routers and the CLI ask a residency to
//! load or unload a model.
//!
//! Both are JSON patches guarded by a `test` of the entry they touch, and
//! retried when the list moved underneath (another writer got there
//! first), so concurrent writers never lose each other's entries:
//! - a load sets the model's `lastRequested` (adding the entry if needed);
//! - an unload removes the entry.
//!
//! Why not server-side apply: a server that types custom resources' lists
//! as atomic (as the v1.20 API server used by the tests does) would let one
//! writer's apply drop every other writer's entries. On newer clusters an
//! autoscaler may still server-side apply its own entries with its own
//! field manager (see the README); the list is a list-map keyed by model.

use crate::api::ModelResidency;
use k8s_openapi::jiff::Timestamp;
use kube::api::{Api, Patch, PatchParams};
use serde_json::{Value, json};

/// How often a guarded patch is retried when the list changed under it.
const ATTEMPTS: u32 = 8;

/// Applies the patch `build` makes from the current object; `None` means
/// nothing to do. Retries when a `test` fails because the list moved.
async fn guarded_patch(
    api: &Api<ModelResidency>,
    residency: &str,
    build: impl Fn(&ModelResidency) -> Option<Value>,
) -> Result<bool, kube::Error> {
    let mut attempt = 0;
    loop {
        let current = api.get(residency).await?;
        let Some(ops) = build(&current) else {
            return Ok(false);
        };
        let patch: json_patch::Patch = serde_json::from_value(ops).expect("well-formed patch");
        match api
            .patch(
                residency,
                &PatchParams::default(),
                &Patch::<()>::Json(patch),
            )
            .await
        {
            Ok(_) => return Ok(true),
            Err(kube::Error::Api(s)) if (s.code == 422 || s.code == 409) && attempt < ATTEMPTS => {
                attempt += 1;
            }
            Err(e) => return Err(e),
        }
    }
}

/// Requests `model` at time `at` (normally now).
pub async fn load(
    api: &Api<ModelResidency>,
    residency: &str,
    model: &str,
    at: Timestamp,
) -> Result<(), kube::Error> {
    let entry = json!({"model": model, "lastRequested": at.to_string()});
    guarded_patch(api, residency, |r| {
        let demand = &r.spec.demand;
        Some(match demand.iter().position(|d| d.model == model) {
            Some(i) => json!([
                {"op": "test", "path": format!("/spec/demand/{i}/model"), "value": model},
                {"op": "replace", "path": format!("/spec/demand/{i}/lastRequested"), "value": at.to_string()},
            ]),
            None if demand.is_empty() => json!([
                // Fails (and is retried) if someone added a list meanwhile.
                {"op": "test", "path": "/metadata/resourceVersion", "value": r.metadata.resource_version},
                {"op": "add", "path": "/spec/demand", "value": [entry]},
            ]),
            None => json!([
                {"op": "test", "path": format!("/spec/demand/{}/model", demand.len() - 1), "value": demand[demand.len() - 1].model},
                {"op": "add", "path": "/spec/demand/-", "value": entry},
            ]),
        })
    })
    .await
    .map(|_| ())
}

/// Removes `model`'s demand entry. Returns whether there was one.
pub async fn unload(
    api: &Api<ModelResidency>,
    residency: &str,
    model: &str,
) -> Result<bool, kube::Error> {
    guarded_patch(api, residency, |r| {
        let i = r.spec.demand.iter().position(|d| d.model == model)?;
        Some(json!([
            {"op": "test", "path": format!("/spec/demand/{i}/model"), "value": model},
            {"op": "remove", "path": format!("/spec/demand/{i}")},
        ]))
    })
    .await
}
