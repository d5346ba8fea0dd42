//! InferencePools (`--inference-pools`): one per model and namespace,
//! named after the model, selecting exactly the copies that serve. Each
//! tick the model pods' [`SERVING_LABEL`] is set on the pods that serve
//! (the model Loaded on their residency, the pod Ready, not draining, not
//! terminating) and taken off the others, and each pool is applied when it
//! differs from what is there. A pool is owned (not controlled) by every
//! residency listing its model, so it goes with the last of them; a model
//! no residency lists any more loses its pool. The pods are read from the
//! operator's pod cache (its watch of the model pods), not listed each
//! tick: at thousands of model pods a list every tick was thousands of
//! pods serialized by the API server every few seconds.

use super::{ModelKey, Scaler};
use crate::api::{
    EndpointPickerRef, InferencePool, InferencePoolSpec, ModelResidency, ModelState, PoolPort,
    PoolSelector,
};
use crate::controller::pod_cache::PodCache;
use crate::controller::pods::{ModelPod, PodPhase};
use crate::residency::labels::{MANAGER, MODEL_LABEL, POOL_MODEL_LABEL, SERVING_LABEL};
use kube::ResourceExt;
use kube::api::{Api, ListParams, Patch, PatchParams};
use std::collections::{BTreeMap, HashMap, HashSet};
use std::sync::Arc;

/// What the pools say beyond their pods.
#[derive(Clone, Debug, Default)]
pub struct PoolConfig {
    /// The endpoint picker every pool names (none: the gateway picks).
    pub endpoint_picker: Option<EndpointPickerRef>,
    /// HTTPRoutes toward the pools and the router (`--gateway-routes`).
    pub routes: Option<super::routes::RouteConfig>,
    /// llm-d's adapter maps beside the pools (`--llm-d-adapter-maps`).
    pub adapter_maps: bool,
}

/// Whether a pod that is `up` serves `model` now, as `residency` says.
fn serves(up: bool, model: &str, residency: Option<&ModelResidency>) -> bool {
    up && residency.is_some_and(|r| r.model_state(model) == ModelState::Loaded)
}

/// What the pod itself says of serving: Ready, not finished, not
/// draining, not terminating.
fn up(pod: &ModelPod) -> bool {
    pod.phase == PodPhase::Live && pod.ready_since.is_some() && !pod.draining && !pod.deleting
}

/// The pool `model` should have in `ns`, owned by its `homes` there.
fn pool_for(
    model: &str,
    ns: &str,
    homes: &[&Arc<ModelResidency>],
    port: u16,
    picker: Option<&EndpointPickerRef>,
) -> InferencePool {
    let mut pool = InferencePool::new(
        model,
        InferencePoolSpec {
            selector: PoolSelector {
                match_labels: BTreeMap::from([
                    (MODEL_LABEL.to_owned(), model.to_owned()),
                    (SERVING_LABEL.to_owned(), "true".to_owned()),
                ]),
            },
            target_ports: vec![PoolPort { number: port }],
            endpoint_picker_ref: picker.cloned(),
        },
    );
    pool.metadata.namespace = Some(ns.to_owned());
    pool.metadata.labels = Some(BTreeMap::from([(
        POOL_MODEL_LABEL.to_owned(),
        model.to_owned(),
    )]));
    pool.metadata.owner_references = Some(super::as_owners(homes.iter().copied()));
    pool
}

/// A model pod's serving label to set (`true`) or take off, by namespace.
type LabelChange = (String, String, bool);

/// What a round needs of one model pod, copied out of the pod cache so
/// that its lock is held only to copy (statuses are unpacked after).
struct Seen {
    ns: Box<str>,
    residency: Box<str>,
    name: Box<str>,
    model: Box<str>,
    port: u16,
    up: bool,
    labelled: bool,
}

/// The serving label changes the pods need, as their residencies say, and
/// a serving port of each model in each namespace (the first pod's by
/// name, as a list would give it: the same each round).
fn survey(
    cache: &PodCache,
    residencies: &HashMap<(String, String), &Arc<ModelResidency>>,
) -> Option<(Vec<LabelChange>, Ports, HashSet<ModelKey>)> {
    let mut seen = Vec::new();
    let ready = cache.each(|ns, residency, pod| {
        seen.push(Seen {
            ns: ns.into(),
            residency: residency.into(),
            name: pod.name.clone(),
            model: pod.model.clone(),
            port: pod.port,
            up: up(pod),
            labelled: pod.serving_label,
        });
    });
    if !ready {
        return None;
    }
    seen.sort_by(|a, b| (&a.ns, &a.name).cmp(&(&b.ns, &b.name)));
    let mut changes = Vec::new();
    let mut ports = Ports::new();
    let mut serving = HashSet::new();
    // Each residency's status unpacked once a round, not once per pod.
    let mut loaded: HashMap<(String, String), Option<Arc<ModelResidency>>> = HashMap::new();
    for s in seen {
        ports
            .entry((s.ns.to_string(), s.model.to_string()))
            .or_insert(s.port);
        let key = (s.ns.to_string(), s.residency.to_string());
        let owner = loaded.entry(key).or_insert_with_key(|key| {
            residencies
                .get(key)
                .map(|&r| crate::controller::cached::unpacked(r.clone()))
        });
        let want = serves(s.up, &s.model, owner.as_deref());
        if want {
            serving.insert((s.ns.to_string(), s.model.to_string()));
        }
        if want != s.labelled {
            changes.push((s.ns.into(), s.name.into(), want));
        }
    }
    Some((changes, ports, serving))
}

/// A serving port per (namespace, model).
type Ports = HashMap<(String, String), u16>;

impl Scaler {
    /// One tick of the pools: the serving labels, then the pools.
    pub(super) async fn pools_round(
        &self,
        all: &BTreeMap<ModelKey, Vec<Arc<ModelResidency>>>,
        config: &PoolConfig,
    ) {
        let residencies: HashMap<(String, String), &Arc<ModelResidency>> = all
            .values()
            .flatten()
            .map(|r| ((r.namespace().unwrap_or_default(), r.name_any()), r))
            .collect();
        let Some((changes, ports, serving)) = survey(&self.ctx.pods, &residencies) else {
            // The pod cache's first list is not in (a new leader): an
            // empty view would take every pool's port back to the default.
            return;
        };
        for (ns, pod, want) in changes {
            super::enact::set_label(&self.ctx, &ns, &pod, SERVING_LABEL, want).await;
        }
        self.apply_pools(all, &ports, config).await;
        if let Some(routes) = &config.routes {
            self.apply_routes(all, &serving, routes).await;
        }
    }

    /// Applies each model's pool where it differs, deletes the pools of
    /// models no residency lists.
    async fn apply_pools(
        &self,
        all: &BTreeMap<ModelKey, Vec<Arc<ModelResidency>>>,
        ports: &Ports,
        config: &PoolConfig,
    ) {
        let api: Api<InferencePool> =
            crate::cluster::api_in(&self.ctx.client, self.namespace.as_deref());
        // Every pool, the operator's (its label) and others': one list a
        // tick, not a read per pool that is not the operator's.
        let (existing, others): (Vec<InferencePool>, Vec<InferencePool>) = match api
            .list(&ListParams::default())
            .await
        {
            Ok(list) => list
                .items
                .into_iter()
                .partition(|p| p.labels().contains_key(POOL_MODEL_LABEL)),
            Err(e) => {
                tracing::warn!(error = %e, "pools: cannot list InferencePools (is the Gateway API Inference Extension's CRD installed?)");
                return;
            }
        };
        let mut wanted: Vec<InferencePool> = Vec::new();
        for (key, homes) in all {
            let (ns, model) = key;
            let port = ports
                .get(key)
                .copied()
                .unwrap_or(crate::residency::labels::DEFAULT_MODEL_PORT);
            let homes: Vec<&Arc<ModelResidency>> = homes.iter().collect();
            wanted.push(pool_for(
                model,
                ns,
                &homes,
                port,
                config.endpoint_picker.as_ref(),
            ));
        }
        let mut clashes = HashSet::new();
        for pool in &wanted {
            let ns = pool.namespace().unwrap_or_default();
            let ours = existing
                .iter()
                .find(|e| e.namespace() == pool.namespace() && e.name_any() == pool.name_any());
            if ours.is_some_and(|e| {
                e.spec == pool.spec && e.metadata.owner_references == pool.metadata.owner_references
            }) {
                continue;
            }
            // Not one the operator made: a pool of that name that is there
            // is someone else's, and an apply would take it over (its
            // selector rewritten, an owner reference that deletes it with
            // the residency). Left alone, and said.
            let theirs = ours.is_none()
                && others
                    .iter()
                    .any(|o| o.namespace() == pool.namespace() && o.name_any() == pool.name_any());
            if theirs {
                clashes.insert((ns, pool.name_any()));
                continue;
            }
            let api: Api<InferencePool> = Api::namespaced(self.ctx.client.clone(), &ns);
            self.ctx.metrics.api_request("patch", "inferencepools");
            let params = PatchParams::apply(MANAGER);
            if let Err(e) = api
                .patch(&pool.name_any(), &params, &Patch::Apply(pool))
                .await
            {
                tracing::warn!(pool = %pool.name_any(), error = %e, "pools: could not apply an InferencePool");
            }
        }
        self.say_clashes(all, clashes).await;
        self.delete_unwanted(&existing, &wanted, "inferencepools")
            .await;
    }
}

impl Scaler {
    /// A Warning event (`InferencePoolClash`) on a model's first home when
    /// an InferencePool of its name that the operator did not make is in
    /// the way, once per clash (and a log line each round it lasts).
    async fn say_clashes(
        &self,
        all: &BTreeMap<ModelKey, Vec<Arc<ModelResidency>>>,
        now: HashSet<ModelKey>,
    ) {
        let new: Vec<ModelKey> = {
            let mut known = self.pool_clashes.lock().expect("clashes lock");
            let new = now.difference(&known).cloned().collect();
            *known = now;
            new
        };
        for key in new {
            let Some(first) = all.get(&key).and_then(|homes| homes.first()) else {
                continue;
            };
            let (ns, model) = &key;
            tracing::warn!(namespace = %ns, pool = %model, "pools: an InferencePool of this name is not the operator's; left alone");
            let note = format!(
                "InferencePool {model} in {ns} was not made by the operator (no {POOL_MODEL_LABEL} label): it is left as it is and {model} gets no pool here; rename one of them"
            );
            super::enact::warn(&self.ctx, first, "InferencePoolClash", note).await;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::residency::labels::{DRAINING_LABEL, RESIDENCY_LABEL};
    use serde_json::json;

    fn residency(state: &str) -> ModelResidency {
        serde_json::from_value(json!({
            "apiVersion": "residency.dev/v1alpha1", "kind": "ModelResidency",
            "metadata": {"name": "gpu-0", "namespace": "ns", "uid": "u-0"},
            "spec": {"nodeName": "n", "device": "0", "budget": "8Gi",
                     "models": [{"name": "chat", "size": "4Gi"}]},
            "status": {"models": [{"name": "chat", "state": state}]},
        }))
        .unwrap()
    }

    /// A model pod as the pod cache holds it.
    fn pod(labels: serde_json::Value, ready: &str) -> ModelPod {
        let pod: k8s_openapi::api::core::v1::Pod = serde_json::from_value(json!({
            "metadata": {"name": "p", "namespace": "ns", "labels": labels},
            "spec": {"containers": [{"name": "s", "ports": [{"containerPort": 8001}]}]},
            "status": {"conditions": [{"type": "Ready", "status": ready}]},
        }))
        .unwrap();
        ModelPod::from_pod(&pod).unwrap()
    }

    fn serves_pod(pod: &ModelPod, r: Option<&ModelResidency>) -> bool {
        serves(up(pod), &pod.model, r)
    }

    #[test]
    fn a_pod_serves_while_loaded_ready_and_not_draining() {
        let labels = json!({MODEL_LABEL: "chat", RESIDENCY_LABEL: "gpu-0"});
        let loaded = residency("Loaded");
        assert!(serves_pod(&pod(labels.clone(), "True"), Some(&loaded)));
        assert!(!serves_pod(&pod(labels.clone(), "False"), Some(&loaded)));
        // Asleep: its pod stays Ready and answers nothing but its wake.
        assert!(!serves_pod(
            &pod(labels.clone(), "True"),
            Some(&residency("Sleeping"))
        ));
        assert!(!serves_pod(&pod(labels, "True"), None));
        let draining =
            json!({MODEL_LABEL: "chat", RESIDENCY_LABEL: "gpu-0", DRAINING_LABEL: "true"});
        assert!(!serves_pod(&pod(draining, "True"), Some(&loaded)));
        let mut terminating = pod(json!({MODEL_LABEL: "chat"}), "True");
        terminating.deleting = true;
        assert!(!serves_pod(&terminating, Some(&loaded)));
        // What the pools and the labels read from the pod itself.
        let marked = pod(json!({MODEL_LABEL: "chat", SERVING_LABEL: "true"}), "True");
        assert!(marked.serving_label && !marked.draining);
        assert_eq!(marked.port, 8001);
        assert!(!pod(json!({MODEL_LABEL: "chat", SERVING_LABEL: "false"}), "True").serving_label);
    }

    #[test]
    fn a_pool_selects_the_serving_copies_and_is_owned_by_every_home() {
        let a = Arc::new(residency("Loaded"));
        let picker = EndpointPickerRef::service("epp".into(), 9002);
        let pool = pool_for("chat", "ns", &[&a], 8000, Some(&picker));
        let v = serde_json::to_value(&pool).unwrap();
        assert_eq!(v["apiVersion"], "inference.networking.k8s.io/v1");
        assert_eq!(
            v["spec"],
            json!({"selector": {"matchLabels": {MODEL_LABEL: "chat", SERVING_LABEL: "true"}},
                   "targetPorts": [{"number": 8000}],
                   "endpointPickerRef": {"group": "", "kind": "Service", "name": "epp",
                                         "port": {"number": 9002}, "failureMode": "FailClose"}})
        );
        assert_eq!(v["metadata"]["ownerReferences"][0]["controller"], false);
    }
}
