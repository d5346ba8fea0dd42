//! The adapter audit: what LoRA adapters each model pod holds, as its
//! server says (`GET /v1/models`, the entries whose `parent` is the model),
//! written on the pod ([`ADAPTERS_ANNOTATION`]) and from there into the
//! model's status (`status.models[].adapters`). The routers load and unload
//! adapters (`crate::router::adapters`); the server is the truth of what it
//! holds, whatever any router recorded: a restarted container holds none.
//!
//! Runs with the sleep audit, every `--sleep-audit-interval` (leader only),
//! over the Loaded models that declare adapters.

use super::Context;
use super::cached;
use super::pods::{ModelPod, pod_name};
use super::sleep_audit::ReadyPods;
use crate::api::{ModelResidency, ModelState};
use crate::residency::labels::ADAPTERS_ANNOTATION;
use k8s_openapi::api::core::v1::Pod;
use kube::ResourceExt;
use kube::api::{Api, Patch, PatchParams};
use kube::runtime::reflector::Store;

/// The longest model list read: 128 adapters of a few hundred bytes each.
const LIST_LIMIT: usize = 256 << 10;

/// One round over every residency in the cache.
pub async fn audit(ctx: &Context, store: &Store<ModelResidency>, pods: &ReadyPods) {
    for r in store.state() {
        let adapters = ctx
            .catalogs
            .with_models(&r, |models| models.iter().any(|m| m.lora.is_some()));
        if adapters != Ok(true) {
            continue;
        }
        let r = cached::unpacked(r);
        let Ok(r) = ctx.catalogs.resolve(r) else {
            continue;
        };
        let ns = r.namespace().unwrap_or_default();
        for m in r.spec.models.iter().filter(|m| m.lora.is_some()) {
            if r.model_state(&m.name) != ModelState::Loaded {
                continue;
            }
            let Some(pod) = pods.get(&(ns.clone(), pod_name(&r.name_any(), &m.name))) else {
                continue;
            };
            let Some(held) = held(ctx, pod, &m.name).await else {
                continue;
            };
            if pod.adapters.as_deref().unwrap_or_default() != held {
                record(ctx, &ns, pod, &held).await;
            }
        }
    }
}

/// The adapters the pod's server lists, comma-separated; None when it
/// cannot be asked or gives no list.
async fn held(ctx: &Context, pod: &ModelPod, model: &str) -> Option<String> {
    let call = crate::http::send_capped(pod.addr?, "GET", "/v1/models", "", LIST_LIMIT);
    let answer = tokio::time::timeout(ctx.pod_call_timeout_max, call)
        .await
        .ok()?
        .ok()?;
    if answer.status != 200 {
        return None;
    }
    listed(&answer.body, model)
}

/// The ids whose parent is `model` in an OpenAI model list.
fn listed(body: &str, model: &str) -> Option<String> {
    let v: serde_json::Value = serde_json::from_str(body).ok()?;
    let ids: Vec<&str> = v
        .get("data")?
        .as_array()?
        .iter()
        .filter(|m| m.get("parent").and_then(|p| p.as_str()) == Some(model))
        .filter_map(|m| m.get("id")?.as_str())
        .collect();
    Some(ids.join(","))
}

/// Writes what the server said on its pod (the pod watch then reconciles
/// the residency, which puts it in status).
async fn record(ctx: &Context, ns: &str, pod: &ModelPod, held: &str) {
    let api: Api<Pod> = Api::namespaced(ctx.client.clone(), ns);
    let patch = serde_json::json!({"metadata": {"annotations": {ADAPTERS_ANNOTATION: held}}});
    if let Err(e) = api
        .patch(&pod.name, &PatchParams::default(), &Patch::Merge(&patch))
        .await
    {
        tracing::debug!(pod = %pod.name, error = %e, "recording the adapters a pod holds");
    }
}

#[cfg(test)]
mod tests {
    #[test]
    fn the_adapters_are_the_entries_whose_parent_is_the_model() {
        let vllm = r#"{"object":"list","data":[{"id":"tiny","parent":null},{"id":"a2","parent":"tiny","root":"/x/a2"},{"id":"p","parent":"tiny"},{"id":"other","parent":"big"}]}"#;
        assert_eq!(super::listed(vllm, "tiny").as_deref(), Some("a2,p"));
        assert_eq!(super::listed("not json", "tiny"), None);
    }
}
