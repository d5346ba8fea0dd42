//! What the copy scaler writes: a copy's demand key, the draining label
//! and retire time of a copy that goes, its events.

use crate::api::{ModelResidency, ModelState};
use crate::controller::Context;
use crate::residency::labels::{DRAINING_LABEL, RETIRE_ANNOTATION, SERVING_LABEL};
use k8s_openapi::api::core::v1::Pod;
use k8s_openapi::jiff::Timestamp;
use kube::ResourceExt;
use kube::api::{Api, Patch, PatchParams};
use kube::runtime::reflector::{ObjectRef, Store};
use std::time::{Duration, Instant};

/// Writes `model`'s demand key on `r` now; whether it landed.
pub(super) async fn request(ctx: &Context, r: &ModelResidency, model: &str) -> bool {
    let api: Api<ModelResidency> =
        Api::namespaced(ctx.client.clone(), &r.namespace().unwrap_or_default());
    let result = crate::residency::demand::load(&api, &r.name_any(), model, Timestamp::now()).await;
    ctx.metrics.api_request("patch", "modelresidencies");
    match result {
        Ok(_) => {
            tracing::info!(residency = %r.name_any(), model, "copies: a copy added");
            true
        }
        Err(e) => {
            tracing::warn!(residency = %r.name_any(), model, error = %e, "copies: could not add a copy");
            false
        }
    }
}

/// Takes the copy out of the routers, waits `grace`, asks its residency to
/// retire it (to sleep when it can, else unloaded: the pod's retire time;
/// its demand key stays, so an unload is not undone), and takes the label
/// and the time off once the model is no longer loaded there.
pub(super) async fn drain_and_retire(
    ctx: &Context,
    store: &Store<ModelResidency>,
    key: &(String, String, String),
    grace: Duration,
) {
    let (ns, residency, model) = key;
    let pod = crate::controller::pods::pod_name(residency, model);
    // Out of the routers and out of its InferencePool at once: a gateway
    // gets the same drain window as the routers (the serving label went
    // at the pools' next tick, up to after the copy was retired).
    let drain = serde_json::json!({"metadata": {"labels": {
        DRAINING_LABEL: "true", SERVING_LABEL: null}}});
    patch_pod(ctx, ns, &pod, &drain).await;
    tokio::time::sleep(grace).await;
    let retire = serde_json::json!({"metadata": {"annotations": {
        RETIRE_ANNOTATION: Timestamp::now().to_string()}}});
    if patch_pod(ctx, ns, &pod, &retire).await {
        tracing::info!(%residency, %model, "copies: a copy retired");
    }
    // Until the residency has acted, as the operator's cache shows it (a
    // pod deleted needs nothing taken off; a sleeping one does: the
    // routers skip it while it sleeps anyway, and its next request must
    // find it listed again once it is awake).
    let cached = ObjectRef::<ModelResidency>::new(residency).within(ns);
    let deadline = Instant::now() + Duration::from_secs(60);
    while Instant::now() < deadline {
        let state = store
            .get(&cached)
            .map(|r| crate::controller::cached::unpacked(r).model_state(model));
        if state != Some(ModelState::Loaded) {
            break;
        }
        tokio::time::sleep(Duration::from_millis(250)).await;
    }
    release(ctx, ns, &pod).await;
}

/// Takes a copy's draining label and retire time off.
pub(super) async fn release(ctx: &Context, ns: &str, pod: &str) {
    let patch = serde_json::json!({"metadata": {
        "labels": {DRAINING_LABEL: null}, "annotations": {RETIRE_ANNOTATION: null}}});
    patch_pod(ctx, ns, pod, &patch).await;
}

/// An event on the model's first home: `warning` when a wanted copy has
/// no home, normal when it has again.
pub(super) async fn publish(ctx: &Context, r: &ModelResidency, warning: bool, note: String) {
    use kube::runtime::events::EventType;
    let (type_, reason) = if warning {
        (EventType::Warning, "CopyUnplaced")
    } else {
        (EventType::Normal, "CopyPlaced")
    };
    crate::controller::publish_event(ctx, r, type_, reason, "ScaleCopies", note).await;
}

/// A Warning event on `r`.
pub(super) async fn warn(ctx: &Context, r: &ModelResidency, reason: &str, note: String) {
    use kube::runtime::events::EventType;
    crate::controller::publish_event(ctx, r, EventType::Warning, reason, "ScaleCopies", note).await;
}

/// Sets `label` to "true" on a model pod, or takes it off: the draining
/// and serving labels.
pub(super) async fn set_label(ctx: &Context, ns: &str, pod: &str, label: &str, on: bool) {
    let value = if on {
        serde_json::json!("true")
    } else {
        serde_json::Value::Null
    };
    let patch = serde_json::json!({"metadata": {"labels": {label: value}}});
    patch_pod(ctx, ns, pod, &patch).await;
}

/// One merge patch of a model pod's metadata; whether it landed (a pod
/// that is gone needs nothing, and says false).
async fn patch_pod(ctx: &Context, ns: &str, pod: &str, patch: &serde_json::Value) -> bool {
    let api: Api<Pod> = Api::namespaced(ctx.client.clone(), ns);
    ctx.metrics.api_request("patch", "pods");
    match api
        .patch(pod, &PatchParams::default(), &Patch::Merge(patch))
        .await
    {
        Ok(_) => true,
        Err(kube::Error::Api(s)) if s.code == 404 => false,
        Err(e) => {
            tracing::warn!(%pod, error = %e, "copies: could not patch the pod");
            false
        }
    }
}
