//! What the router's watches show, rebuilt after each change into one
//! immutable value: for each model, the residencies that list it (its
//! homes) and its Ready pods (its endpoints). Requests read the latest
//! snapshot without a lock; waiting requests wake when a new one is
//! published.

use super::errors::Refusal;
use super::recency::Key;
use crate::api::{AdapterSpec, LoraSpec, ModelResidency, ModelSpec, ModelState, ModelStatus};
use crate::residency::labels::{
    ADAPTERS_REFUSED_ANNOTATION, DRAINING_LABEL, MODEL_LABEL, RESIDENCY_LABEL, serving_port,
};
use crate::residency::names;
use crate::residency::placement::residency_key;
use crate::residency::reasons::Reason;
use http::HeaderValue;
use k8s_openapi::api::core::v1::Pod;
use kube::ResourceExt;
use std::collections::HashMap;
use std::net::{IpAddr, SocketAddr};
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

/// A Ready model pod a request can be sent to, with what the hit path
/// needs made once per snapshot rather than per request.
#[derive(Clone, Debug)]
pub struct Endpoint {
    /// Index into [`Snapshot::residencies`].
    pub residency: usize,
    /// `<namespace>/<pod>`.
    pub pod: Arc<str>,
    /// The pod's UID: a pod replaced under the same name is another
    /// server, holding no adapters.
    pub uid: Arc<str>,
    pub addr: SocketAddr,
    /// (namespace, residency, model): its recency bookkeeping's key.
    pub key: Key,
    /// The `X-Residency` and `X-Model-Pod` answer headers.
    pub residency_header: HeaderValue,
    pub pod_header: HeaderValue,
    /// Requests being proxied to this pod now: one counter per pod that
    /// outlives snapshots (the router hands it in, [`Snapshot::count_with`]),
    /// so the hit path counts with an atomic, not a lock both workers share.
    pub in_flight: Arc<AtomicUsize>,
    /// Adapters this pod started without (their files failed on its
    /// node), with the node's words: refused in it, unsent.
    pub refused_adapters: Option<Arc<HashMap<String, String>>>,
}

impl Endpoint {
    /// Why this pod cannot serve `adapter`, if it cannot.
    pub fn refuses(&self, adapter: &str) -> Option<&str> {
        self.refused_adapters
            .as_ref()?
            .get(adapter)
            .map(String::as_str)
    }

    /// An endpoint that is only a name and a counter (balancing's tests).
    #[cfg(test)]
    pub fn for_tests(pod: &str, in_flight: Arc<AtomicUsize>) -> Self {
        Endpoint {
            residency: 0,
            pod: pod.into(),
            uid: pod.into(),
            addr: SocketAddr::from(([127, 0, 0, 1], 8080)),
            key: Arc::new((String::new(), String::new(), String::new())),
            residency_header: HeaderValue::from_static("test"),
            pod_header: HeaderValue::from_static("test"),
            in_flight,
            refused_adapters: None,
        }
    }
}

#[derive(Debug, Default)]
pub struct ModelView {
    /// Indexes into [`Snapshot::residencies`] whose registry lists it.
    pub homes: Vec<usize>,
    pub ready: Vec<Endpoint>,
    /// The namespace of its homes when they are all in one, else empty:
    /// the namespace its requests are counted under (the copy scaler's
    /// signal is per namespace; a name served from several says nothing
    /// of whose model it is).
    pub namespace: String,
}

#[derive(Debug, Default)]
pub struct Snapshot {
    /// Both watches have listed everything once.
    pub synced: bool,
    /// Sorted by namespace/name.
    pub residencies: Vec<Arc<ModelResidency>>,
    pub models: HashMap<String, ModelView>,
    /// Copies being removed (their pod labelled draining): no request is
    /// sent to them, and no recency is written for them, since a write
    /// after the copy scaler took their demand key away would ask for the
    /// copy again.
    pub draining: std::collections::HashSet<Key>,
    /// LoRA adapters by name: what a request naming one is served by.
    pub adapters: HashMap<String, Arc<AdapterView>>,
    /// Residencies whose ModelCatalog cannot be read now: a model no
    /// registry lists may be one of theirs, so it is not said not to exist.
    pub catalogs_unreadable: usize,
    /// `GET /v1/models`'s body, built once per snapshot when first asked
    /// (`router::catalog::models_list`).
    pub model_list: tokio::sync::OnceCell<bytes::Bytes>,
}

/// A LoRA adapter as the registries declare it (`spec.models[].lora`).
#[derive(Debug, PartialEq)]
pub struct AdapterView {
    pub name: String,
    /// Its base model: the model whose pods serve it.
    pub base: String,
    /// Where the base's server reads it.
    pub path: String,
    pub rank: u32,
    pub pinned: bool,
    /// The adapters a pod of the base holds at once.
    pub capacity: u32,
    /// Why it is never sent to a server (a rank past the base's maxRank,
    /// a name two bases declare differently), in words for the client.
    pub refused: Option<String>,
}

impl AdapterView {
    fn of(models: &[ModelSpec], base: &str, lora: &LoraSpec, a: &AdapterSpec) -> Self {
        let refused = crate::residency::adapters::refusal(models, base, lora, a);
        AdapterView {
            name: a.name.clone(),
            base: base.to_owned(),
            path: a.path(),
            rank: a.rank,
            pinned: a.pinned,
            capacity: lora.capacity(),
            refused,
        }
    }

    /// The same adapter in every respect but the refusal.
    fn same_as(&self, other: &AdapterView) -> bool {
        (
            &self.base,
            &self.path,
            self.rank,
            self.pinned,
            self.capacity,
        ) == (
            &other.base,
            &other.path,
            other.rank,
            other.pinned,
            other.capacity,
        )
    }
}

impl Snapshot {
    pub fn build(
        synced: bool,
        mut residencies: Vec<Arc<ModelResidency>>,
        pods: &[Arc<Pod>],
    ) -> Self {
        residencies.sort_by_key(|r| (r.namespace(), r.name_any()));
        // A name resolves in one namespace: its first owner's
        // (`residency::names`); other namespaces' entries of it are not
        // this router's to reach.
        let owners = names::owners(residencies.iter().map(|r| &**r));
        let owned = |name: &str, ns: &str| owners.get(name).is_none_or(|o| o.1 == ns);
        let mut models: HashMap<String, ModelView> = HashMap::new();
        let mut by_uid = HashMap::new();
        for (i, r) in residencies.iter().enumerate() {
            by_uid.insert(r.uid().unwrap_or_default(), i);
            let ns = r.namespace().unwrap_or_default();
            for m in r.spec.models.iter().filter(|m| owned(&m.name, &ns)) {
                let view = models.entry(m.name.clone()).or_default();
                if view.homes.is_empty() {
                    view.namespace = ns.clone();
                } else if view.namespace != ns {
                    view.namespace.clear();
                }
                view.homes.push(i);
            }
        }
        let mut adapters: HashMap<String, Arc<AdapterView>> = HashMap::new();
        for r in &residencies {
            let ns = r.namespace().unwrap_or_default();
            for m in &r.spec.models {
                let Some(lora) = &m.lora else { continue };
                for a in lora.adapters.iter().filter(|a| owned(&a.name, &ns)) {
                    let view = AdapterView::of(&r.spec.models, &m.name, lora, a);
                    match adapters.get(&a.name) {
                        None => {
                            adapters.insert(a.name.clone(), Arc::new(view));
                        }
                        Some(first) if first.same_as(&view) => {}
                        Some(first) => {
                            // Two declarations that differ: which one a
                            // request means is nobody's guess.
                            let refused = format!(
                                "the adapter `{}` is declared differently by base models `{}` and `{}` (or two residencies): rename one",
                                a.name, first.base, m.name
                            );
                            let view = AdapterView {
                                refused: Some(refused),
                                ..AdapterView::of(&r.spec.models, &first.base, lora, a)
                            };
                            adapters.insert(a.name.clone(), Arc::new(view));
                        }
                    }
                }
            }
        }
        // A model's name is the model's: an adapter of that name is
        // unreachable (the operator reports it on the residency).
        adapters.retain(|name, _| !models.contains_key(name));
        let mut draining = std::collections::HashSet::new();
        for pod in pods {
            let Some((i, model)) = owner(pod, &by_uid, &residencies) else {
                continue;
            };
            let r = &residencies[i];
            if pod.labels().contains_key(DRAINING_LABEL) {
                // A copy being removed: what it serves finishes, nothing new.
                let key = (
                    r.namespace().unwrap_or_default(),
                    r.name_any(),
                    model.to_owned(),
                );
                draining.insert(Arc::new(key));
                continue;
            }
            let Some(addr) = serving(pod, r, model) else {
                continue;
            };
            // Only a pod of one of the name's homes serves it (another
            // namespace's model of that name is not the name's).
            let Some(view) = models.get_mut(model).filter(|v| v.homes.contains(&i)) else {
                continue;
            };
            let (ns, name) = (pod.namespace().unwrap_or_default(), pod.name_any());
            let residency = residency_key(r);
            let (Ok(residency_header), Ok(pod_header)) = (
                HeaderValue::from_str(&residency),
                HeaderValue::from_str(&name),
            ) else {
                continue;
            };
            view.ready.push(Endpoint {
                residency: i,
                pod: format!("{ns}/{name}").into(),
                uid: pod.uid().unwrap_or_default().into(),
                addr,
                key: Arc::new((
                    r.namespace().unwrap_or_default(),
                    r.name_any(),
                    model.to_owned(),
                )),
                residency_header,
                pod_header,
                in_flight: Arc::default(),
                refused_adapters: pod
                    .annotations()
                    .get(ADAPTERS_REFUSED_ANNOTATION)
                    .and_then(|a| serde_json::from_str(a).ok())
                    .map(Arc::new),
            });
        }
        // A GPU that takes no new models (tainted, cordoned: it is going)
        // serves a model only while no other GPU has it Ready: once the
        // copy the operator moved ahead is Ready, new requests go there and
        // what is in flight finishes.
        let leaving: Vec<bool> = residencies
            .iter()
            .map(|r| crate::residency::placement::takes_no_new_models(r))
            .collect();
        for view in models.values_mut() {
            if view.ready.iter().any(|e| !leaving[e.residency]) {
                view.ready.retain(|e| !leaving[e.residency]);
            }
        }
        Snapshot {
            synced,
            residencies,
            models,
            draining,
            adapters,
            catalogs_unreadable: 0,
            model_list: Default::default(),
        }
    }

    /// The answer for a model no registry lists: 404, unless a residency's
    /// catalog cannot be read now (then the model may be one of its, and
    /// the client is told to come back: 503 with Retry-After, never a 404
    /// for a model whose pods may be running).
    pub fn not_listed(&self, model: &str) -> Refusal {
        if self.catalogs_unreadable > 0 {
            return Refusal::ModelUnavailable {
                message: format!(
                    "the model `{}` is not listed by any registry the router can read now: {} residency(ies) name a ModelCatalog that cannot be read; try again",
                    super::echo(model),
                    self.catalogs_unreadable
                ),
                retry_after: Duration::from_secs(5),
            };
        }
        Refusal::ModelNotFound(format!(
            "the model `{}` does not exist: no ModelResidency this router serves lists it",
            super::echo(model)
        ))
    }

    /// Gives every endpoint the counter `counter(pod)` returns for its pod.
    pub fn count_with(&mut self, mut counter: impl FnMut(&Arc<str>) -> Arc<AtomicUsize>) {
        for view in self.models.values_mut() {
            for e in &mut view.ready {
                e.in_flight = counter(&e.pod);
            }
        }
    }

    /// The keys of the models with requests in flight now.
    pub fn busy(&self) -> Vec<Key> {
        self.models
            .values()
            .flat_map(|v| &v.ready)
            .filter(|e| e.in_flight.load(Ordering::Relaxed) > 0)
            .map(|e| e.key.clone())
            .collect()
    }

    /// `<namespace>/<name>` of residency `i`.
    pub fn residency_name(&self, i: usize) -> String {
        let r = &self.residencies[i];
        residency_key(r)
    }

    /// The model's entry in residency `i`'s status.
    pub fn model_status(&self, i: usize, model: &str) -> Option<&ModelStatus> {
        let status = self.residencies[i].status.as_ref()?;
        status.model(model)
    }

    /// The model's state on residency `i` (Unloaded when status has none).
    pub fn state(&self, i: usize, model: &str) -> ModelState {
        self.model_status(i, model)
            .map(|m| m.state)
            .unwrap_or_default()
    }
}

/// Whether the residency's status has `model` sleeping, going to sleep or
/// waking: its pod stays Ready, and answers nothing but its wake.
fn asleep(r: &ModelResidency, model: &str) -> bool {
    r.status
        .as_ref()
        .and_then(|s| s.model(model))
        .is_some_and(|m| {
            m.state == ModelState::Sleeping
                || (m.state == ModelState::Loading
                    && m.reason.as_deref().is_some_and(|r| {
                        r == Reason::Waking.as_str() || r == Reason::WakeFailed.as_str()
                    }))
        })
}

/// A model pod of a watched residency: owned by it (labels alone can be
/// forged by anyone who may create pods) and labelled for it; not
/// terminating. Its residency's index and its model.
fn owner<'p>(
    pod: &'p Pod,
    by_uid: &HashMap<String, usize>,
    residencies: &[Arc<ModelResidency>],
) -> Option<(usize, &'p str)> {
    if pod.metadata.deletion_timestamp.is_some() {
        return None;
    }
    let labels = pod.metadata.labels.as_ref()?;
    let model = labels.get(MODEL_LABEL)?;
    let owner = pod
        .owner_references()
        .iter()
        .find(|o| o.controller == Some(true))?;
    let &i = by_uid.get(&owner.uid)?;
    if labels.get(RESIDENCY_LABEL) != Some(&residencies[i].name_any()) {
        return None;
    }
    Some((i, model))
}

/// Where an [`owner`]-checked pod of `r` serves `model`, if it serves:
/// Ready, not asleep, with an IP. Its port is its first container's first
/// `containerPort`.
fn serving(pod: &Pod, r: &ModelResidency, model: &str) -> Option<SocketAddr> {
    let status = pod.status.as_ref()?;
    let ready = status
        .conditions
        .iter()
        .flatten()
        .any(|c| c.type_ == "Ready" && c.status == "True");
    if !ready || asleep(r, model) {
        return None;
    }
    let ip: IpAddr = status.pod_ip.as_deref()?.parse().ok()?;
    Some(SocketAddr::new(ip, serving_port(pod)))
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn residency(name: &str, uid: &str, models: &[&str]) -> Arc<ModelResidency> {
        Arc::new(
            serde_json::from_value(json!({
                "apiVersion": "residency.dev/v1alpha1", "kind": "ModelResidency",
                "metadata": {"name": name, "namespace": "ns", "uid": uid},
                "spec": {"nodeName": "n", "device": "0", "budget": "8Gi",
                         "models": models.iter().map(|m| json!({"name": m, "size": "1Gi"})).collect::<Vec<_>>()},
            }))
            .unwrap(),
        )
    }

    fn pod(
        name: &str,
        residency: &str,
        owner: &str,
        model: &str,
        ready: bool,
        ip: &str,
    ) -> Arc<Pod> {
        Arc::new(
            serde_json::from_value(json!({
                "metadata": {"name": name, "namespace": "ns",
                    "labels": {MODEL_LABEL: model, RESIDENCY_LABEL: residency},
                    "ownerReferences": [{"apiVersion": "residency.dev/v1alpha1", "kind": "ModelResidency",
                                         "name": residency, "uid": owner, "controller": true}]},
                "spec": {"containers": [{"name": "server", "ports": [{"containerPort": 9000}]}]},
                "status": {"podIP": ip, "conditions": [{"type": "Ready", "status": if ready {"True"} else {"False"}}]},
            }))
            .unwrap(),
        )
    }

    #[test]
    fn only_ready_pods_owned_by_a_watched_residency_serve() {
        let rs = vec![
            residency("b", "u-b", &["x"]),
            residency("a", "u-a", &["x", "y"]),
        ];
        let pods = [
            pod("a-x", "a", "u-a", "x", true, "10.0.0.1"),
            pod("a-y", "a", "u-a", "y", false, "10.0.0.2"),
            // Labels that claim residency a, owned by something else.
            pod("forged", "a", "u-other", "x", true, "10.0.0.3"),
            // Owned by b but labelled for a.
            pod("mislabelled", "a", "u-b", "x", true, "10.0.0.4"),
        ];
        let s = Snapshot::build(true, rs, &pods);
        assert_eq!(s.residency_name(0), "ns/a");
        let x = &s.models["x"];
        assert_eq!(x.homes, vec![0, 1]);
        assert_eq!(x.ready.len(), 1);
        assert_eq!(&*x.ready[0].pod, "ns/a-x");
        assert_eq!(x.ready[0].addr, "10.0.0.1:9000".parse().unwrap());
        assert!(s.models["y"].ready.is_empty());
        assert!(s.draining.is_empty());
    }

    #[test]
    fn a_draining_copy_serves_nothing_and_is_known_as_draining_only_when_owned() {
        let rs = vec![residency("a", "u-a", &["x"]), residency("b", "u-b", &["x"])];
        let mut draining = pod("a-x", "a", "u-a", "x", true, "10.0.0.1");
        let mut forged = pod("forged", "b", "u-other", "x", true, "10.0.0.3");
        for p in [&mut draining, &mut forged] {
            Arc::make_mut(p)
                .labels_mut()
                .insert(DRAINING_LABEL.into(), "true".into());
        }
        let pods = [
            draining,
            forged,
            pod("b-x", "b", "u-b", "x", true, "10.0.0.2"),
        ];
        let s = Snapshot::build(true, rs, &pods);
        let ready: Vec<&str> = s.models["x"].ready.iter().map(|e| &*e.pod).collect();
        assert_eq!(ready, ["ns/b-x"]);
        let key = |r: &str| Arc::new(("ns".to_owned(), r.to_owned(), "x".to_owned()));
        assert!(s.draining.contains(&key("a")));
        assert!(
            !s.draining.contains(&key("b")),
            "a forged label stops nothing"
        );
    }

    /// The black-box round's finding 5: tenant B lists a model `base` like
    /// tenant A's (and a plain model named as A's adapter); half of A's
    /// requests reached B's server. The name is A's (the oldest lister):
    /// B's pods never serve it, B's adapter clash does not refuse A's.
    #[test]
    fn a_name_two_namespaces_list_resolves_in_its_first_owners_only() {
        let in_ns = |ns: &str, name: &str, uid: &str, created: i64, models: serde_json::Value| {
            let mut r: ModelResidency = serde_json::from_value(json!({
                "apiVersion": "residency.dev/v1alpha1", "kind": "ModelResidency",
                "metadata": {"name": name, "namespace": ns, "uid": uid},
                "spec": {"nodeName": "n", "device": "0", "budget": "8Gi", "models": models},
            }))
            .unwrap();
            r.metadata.creation_timestamp =
                Some(k8s_openapi::apimachinery::pkg::apis::meta::v1::Time(
                    k8s_openapi::jiff::Timestamp::from_second(created).unwrap(),
                ));
            Arc::new(r)
        };
        let a = in_ns(
            "a",
            "gpu",
            "u-a",
            100,
            json!([{"name": "base", "size": "1Gi", "lora": {"adapters": [
                {"name": "a2", "rank": 8}, {"name": "a3", "rank": 8}]}}]),
        );
        let b = in_ns(
            "b",
            "gpu",
            "u-b",
            200,
            json!([{"name": "base", "size": "1Gi", "lora": {"adapters": [{"name": "a3", "rank": 4}]}},
                   {"name": "a2", "size": "1Gi"}, {"name": "own", "size": "1Gi"}]),
        );
        let in_ns_pod = |ns: &str, name: &str, uid: &str, model: &str, ip: &str| {
            let mut p = pod(name, "gpu", uid, model, true, ip);
            Arc::make_mut(&mut p).metadata.namespace = Some(ns.into());
            p
        };
        let pods = [
            in_ns_pod("a", "gpu-base", "u-a", "base", "10.0.0.1"),
            in_ns_pod("b", "gpu-base", "u-b", "base", "10.0.0.2"),
            in_ns_pod("b", "gpu-a2", "u-b", "a2", "10.0.0.3"),
            in_ns_pod("b", "gpu-own", "u-b", "own", "10.0.0.4"),
        ];
        let s = Snapshot::build(true, vec![b, a], &pods);
        let ready = |m: &str| -> Vec<String> {
            s.models
                .get(m)
                .map(|v| v.ready.iter().map(|e| e.pod.to_string()).collect())
                .unwrap_or_default()
        };
        assert_eq!(ready("base"), ["a/gpu-base"], "A's base only");
        assert_eq!(s.models["base"].homes.len(), 1);
        assert!(
            !s.models.contains_key("a2"),
            "B's plain a2 does not take A's adapter"
        );
        assert_eq!(s.adapters["a2"].base, "base");
        assert_eq!(s.adapters["a3"].refused, None, "B's a3 does not refuse A's");
        assert_eq!(ready("own"), ["b/gpu-own"], "B's own names are B's");
    }
}
