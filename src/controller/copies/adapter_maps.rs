//! llm-d's adapter maps (`--llm-d-adapter-maps`, with `--inference-pools`):
//! one ConfigMap per base model with LoRA adapters and namespace, in the
//! shape llm-d's payload processor reads (the label
//! `inference.llm-d.ai/ipp-managed: "true"`, the keys `baseModel` and
//! `adapters`, a YAML list), so a gateway running it sends a request that
//! names an adapter to its base model's InferencePool. Named
//! `<model>-adapters`, owned (not controlled) by every residency listing
//! the model, like its pool; deleted when no registry of its namespace
//! declares adapters for the model any more. A ConfigMap of that name the
//! operator did not make is left alone, and said in the log.

use super::{ModelKey, Scaler};
use crate::api::ModelResidency;
use crate::residency::labels::MANAGER;
use k8s_openapi::api::core::v1::ConfigMap;
use kube::ResourceExt;
use kube::api::{Api, ListParams, Patch, PatchParams};
use std::collections::{BTreeMap, BTreeSet};
use std::sync::Arc;

/// The label llm-d's payload processor watches ConfigMaps by.
pub const IPP_MANAGED_LABEL: &str = "inference.llm-d.ai/ipp-managed";
/// Label on an adapter map the operator keeps: the base model it is for.
pub const ADAPTER_MAP_LABEL: &str = "residency.dev/adapter-map-of";

/// A base model's adapters in one namespace (every registry's, together)
/// and the residencies that list the model.
#[derive(Default)]
struct BaseModel {
    adapters: BTreeSet<String>,
    homes: Vec<Arc<ModelResidency>>,
}

/// The ConfigMap's name for `model`'s adapters.
pub fn map_name(model: &str) -> String {
    format!("{model}-adapters")
}

/// The base models with adapters, by namespace and model, from one look
/// at each residency's registry (its catalog's included).
fn base_models(
    all: &BTreeMap<ModelKey, Vec<Arc<ModelResidency>>>,
    catalogs: &crate::residency::catalog::Catalogs,
) -> BTreeMap<ModelKey, BaseModel> {
    let mut seen = BTreeSet::new();
    let mut out: BTreeMap<ModelKey, BaseModel> = BTreeMap::new();
    for r in all.values().flatten() {
        let ns = r.namespace().unwrap_or_default();
        if !seen.insert((ns.clone(), r.name_any())) {
            continue;
        }
        let Ok(declared) = catalogs.with_models(r, |models| {
            models
                .iter()
                .filter_map(|m| {
                    let lora = m.lora.as_deref()?;
                    let names: Vec<String> = lora.adapters.iter().map(|a| a.name.clone()).collect();
                    (!names.is_empty()).then(|| (m.name.clone(), names))
                })
                .collect::<Vec<_>>()
        }) else {
            continue;
        };
        for (model, names) in declared {
            let base = out.entry((ns.clone(), model)).or_default();
            base.adapters.extend(names);
            base.homes.push(r.clone());
        }
    }
    out
}

/// The ConfigMap llm-d's payload processor reads for `model`.
fn map_for(model: &str, ns: &str, base: &BaseModel) -> ConfigMap {
    let adapters: String = base
        .adapters
        .iter()
        .map(|a| format!("- \"{a}\"\n"))
        .collect();
    let mut map = ConfigMap {
        data: Some(BTreeMap::from([
            ("baseModel".to_owned(), model.to_owned()),
            ("adapters".to_owned(), adapters),
        ])),
        ..ConfigMap::default()
    };
    map.metadata.name = Some(map_name(model));
    map.metadata.namespace = Some(ns.to_owned());
    map.metadata.labels = Some(BTreeMap::from([
        (IPP_MANAGED_LABEL.to_owned(), "true".to_owned()),
        (ADAPTER_MAP_LABEL.to_owned(), model.to_owned()),
    ]));
    map.metadata.owner_references = Some(super::as_owners(&base.homes));
    map
}

impl Scaler {
    /// Applies each base model's map where it differs, deletes the maps of
    /// models that declare no adapters any more.
    pub(super) async fn adapter_maps_round(
        &self,
        all: &BTreeMap<ModelKey, Vec<Arc<ModelResidency>>>,
    ) {
        let api: Api<ConfigMap> =
            crate::cluster::api_in(&self.ctx.client, self.namespace.as_deref());
        self.ctx.metrics.api_request("list", "configmaps");
        let existing = match api
            .list(&ListParams::default().labels(ADAPTER_MAP_LABEL))
            .await
        {
            Ok(list) => list.items,
            Err(e) => {
                tracing::warn!(error = %e, "adapter maps: cannot list ConfigMaps");
                return;
            }
        };
        let wanted: Vec<ConfigMap> = base_models(all, &self.ctx.catalogs)
            .iter()
            .map(|((ns, model), base)| map_for(model, ns, base))
            .collect();
        for map in &wanted {
            let ns = map.namespace().unwrap_or_default();
            let name = map.name_any();
            let ours = existing
                .iter()
                .find(|e| e.namespace().as_deref() == Some(&*ns) && e.name_any() == name);
            if ours.is_some_and(|e| {
                e.data == map.data
                    && e.labels() == map.labels()
                    && e.metadata.owner_references == map.metadata.owner_references
            }) {
                continue;
            }
            let api: Api<ConfigMap> = Api::namespaced(self.ctx.client.clone(), &ns);
            if ours.is_none() {
                // Someone else's of that name: an apply would take it over.
                self.ctx.metrics.api_request("get", "configmaps");
                if let Ok(Some(_)) = api.get_opt(&name).await {
                    tracing::warn!(configmap = %name, namespace = %ns, "adapter maps: a ConfigMap of this name that the operator did not make is in the way; its model's adapters are not published for llm-d");
                    continue;
                }
            }
            self.ctx.metrics.api_request("patch", "configmaps");
            if let Err(e) = api
                .patch(&name, &PatchParams::apply(MANAGER), &Patch::Apply(map))
                .await
            {
                tracing::warn!(configmap = %name, error = %e, "adapter maps: could not apply");
            }
        }
        self.delete_unwanted(&existing, &wanted, "configmaps").await;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_map_is_in_the_shape_llm_ds_payload_processor_reads() {
        let r: ModelResidency = serde_json::from_value(serde_json::json!({
            "apiVersion": "residency.dev/v1alpha1", "kind": "ModelResidency",
            "metadata": {"name": "gpu-0", "namespace": "ml", "uid": "u-1"},
            "spec": {"device": "0", "budget": "10Gi", "models": []}}))
        .unwrap();
        let base = BaseModel {
            adapters: ["true".to_owned(), "sql-lora".to_owned()].into(),
            homes: vec![Arc::new(r)],
        };
        let map = map_for("qwen", "ml", &base);
        assert_eq!(map.metadata.name.as_deref(), Some("qwen-adapters"));
        assert_eq!(map.labels()[IPP_MANAGED_LABEL], "true");
        let data = map.data.unwrap();
        assert_eq!(data["baseModel"], "qwen");
        // A YAML list of strings, quoted: `true` is a name, not a boolean.
        assert_eq!(data["adapters"], "- \"sql-lora\"\n- \"true\"\n");
        let owner = &map.metadata.owner_references.unwrap()[0];
        assert_eq!(
            (owner.name.as_str(), owner.controller),
            ("gpu-0", Some(false))
        );
    }
}
