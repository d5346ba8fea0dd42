//! What the reconciler knows of its model pods, kept from one watch of the
//! pods that carry the residency label, instead of a pod list per reconcile.
//!
//! A list per reconcile was an API round trip on every request, and on the
//! API server a label-selected list is served from etcd by reading every pod
//! in the namespace, so reconciles got slower as residencies grew. The cache
//! holds only [`ModelPod`] summaries (a few hundred bytes a pod), never whole
//! pods.
//!
//! A watch lags the writes. The budget gate must never miss a pod that
//! holds VRAM, so the reconciler also records its own writes here: a pod it
//! created is added from the create response unless the watch has already
//! gone past it (events arrive in resourceVersion order, so a watch that has
//! seen a later version has delivered this pod too, and maybe its deletion),
//! and a pod it deleted is marked terminating. A pod missing from a stale
//! view can only be one created by someone else, which the watch delivers
//! moments later.

use super::pods::ModelPod;
use crate::api::ModelResidency;
use crate::residency::gangs::{GANG_MEMBERS_ANNOTATION, pod_members};
use crate::residency::labels::RESIDENCY_LABEL;
use k8s_openapi::api::core::v1::Pod;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta;
use kube::runtime::reflector::ObjectRef;
use kube::runtime::watcher;
use std::collections::HashMap;
use std::sync::Mutex;

/// (namespace, residency name).
type Key = (Box<str>, Box<str>);

#[derive(Clone, Debug)]
struct Entry {
    pod: ModelPod,
    /// Uid of this residency as the pod's owner references name it.
    owner: Option<Box<str>>,
    /// A gang's pod seen from a member other than the one its residency
    /// label names: visited once, from that one.
    secondary: bool,
}

/// A residency has a handful of pods, so a vector (one slot each) rather
/// than a map (a B-tree node is eleven slots, about 3 KiB, for one pod).
type Pods = HashMap<Key, Vec<Entry>>;

#[derive(Default)]
struct Inner {
    live: Pods,
    /// Pods listed since the watch (re)started, until the list is complete.
    relisting: Option<Pods>,
    /// The highest resourceVersion the watch has delivered.
    seen: u64,
}

/// The operator's view of its model pods, per residency.
pub struct PodCache {
    inner: Mutex<Inner>,
    ready: tokio::sync::watch::Sender<bool>,
}

impl Default for PodCache {
    fn default() -> Self {
        PodCache {
            inner: Mutex::default(),
            ready: tokio::sync::watch::Sender::new(false),
        }
    }
}

/// A pod's resourceVersion as a number. The API treats it as opaque, but
/// every etcd-backed API server (this operator's only kind) hands out etcd's
/// revision, a number that grows with every write; comparing it as one is
/// what lets a create response be ordered against the watch. An unreadable
/// value counts as 0 (older than anything the watch delivered).
fn resource_version(pod: &Pod) -> u64 {
    resource_version_of(&pod.metadata)
}

/// [`resource_version`] of any object.
pub(super) fn resource_version_of(meta: &ObjectMeta) -> u64 {
    meta.resource_version
        .as_deref()
        .and_then(|v| v.parse().ok())
        .unwrap_or(0)
}

/// The residencies a pod belongs to, with its summary: the one its
/// residency label names and, for a gang's pod, every other member its
/// [`GANG_MEMBERS_ANNOTATION`] names (the pod holds VRAM on each member's
/// GPU, so each member's budget gate must see it). Empty for pods the
/// operator does not read (no residency or model label, no name).
fn entries(pod: &Pod) -> Vec<(Key, Entry)> {
    let Some(residency) = pod
        .metadata
        .labels
        .as_ref()
        .and_then(|l| l.get(RESIDENCY_LABEL))
    else {
        return Vec::new();
    };
    let (Some(namespace), Some(summary)) =
        (pod.metadata.namespace.as_deref(), ModelPod::from_pod(pod))
    else {
        return Vec::new();
    };
    let owner_named = |name: &str| {
        pod.metadata
            .owner_references
            .iter()
            .flatten()
            .find(|o| o.kind == "ModelResidency" && o.name == name)
            .map(|o| o.uid.as_str().into())
    };
    let gang = pod
        .metadata
        .annotations
        .as_ref()
        .and_then(|a| a.get(GANG_MEMBERS_ANNOTATION));
    let mut out = vec![(
        (namespace.into(), residency.as_str().into()),
        Entry {
            pod: summary.clone(),
            owner: owner_named(residency),
            secondary: false,
        },
    )];
    for member in gang.map(|g| pod_members(g)).into_iter().flatten() {
        if member != residency.as_str() {
            let entry = Entry {
                pod: summary.clone(),
                owner: owner_named(member),
                secondary: true,
            };
            out.push(((namespace.into(), member.into()), entry));
        }
    }
    out
}

fn residency_ref(key: &Key) -> ObjectRef<ModelResidency> {
    ObjectRef::new(&key.1).within(&key.0)
}

fn insert(pods: &mut Pods, key: Key, e: Entry) {
    let list = pods.entry(key).or_default();
    match list.iter_mut().find(|old| old.pod.name == e.pod.name) {
        Some(old) => *old = e,
        // Room for exactly one more: a vector's first push makes room for
        // four, and a residency almost always has one pod.
        None => {
            list.reserve_exact(1);
            list.push(e);
        }
    }
}

fn remove(pods: &mut Pods, key: &Key, name: &str) {
    if let Some(list) = pods.get_mut(key) {
        list.retain(|e| &*e.pod.name != name);
        if list.is_empty() {
            pods.remove(key);
        }
    }
}

impl PodCache {
    /// Forgets everything: a new watch is about to start.
    pub fn reset(&self) {
        *self.inner.lock().unwrap() = Inner::default();
        self.ready.send_replace(false);
    }

    /// Waits until the first complete list is in.
    pub async fn wait_ready(&self) {
        let mut rx = self.ready.subscribe();
        let _ = rx.wait_for(|r| *r).await;
    }

    /// Records one watch event; returns the residencies to reconcile.
    pub fn record(&self, event: &watcher::Event<Pod>) -> Vec<ObjectRef<ModelResidency>> {
        let mut inner = self.inner.lock().unwrap();
        let mut touched = Vec::new();
        match event {
            watcher::Event::Apply(pod) | watcher::Event::Delete(pod) => {
                inner.seen = inner.seen.max(resource_version(pod));
                for (key, e) in entries(pod) {
                    touched.push(residency_ref(&key));
                    if matches!(event, watcher::Event::Apply(_)) {
                        insert(&mut inner.live, key, e);
                    } else {
                        remove(&mut inner.live, &key, &e.pod.name);
                    }
                }
            }
            watcher::Event::Init => inner.relisting = Some(Pods::new()),
            watcher::Event::InitApply(pod) => {
                inner.seen = inner.seen.max(resource_version(pod));
                for (key, e) in entries(pod) {
                    touched.push(residency_ref(&key));
                    let buffer = inner.relisting.get_or_insert_with(Pods::new);
                    insert(buffer, key.clone(), e.clone());
                    // Newer than what the live view holds; pods gone since
                    // the last watch are dropped when the list completes.
                    insert(&mut inner.live, key, e);
                }
            }
            watcher::Event::InitDone => {
                let listed = inner.relisting.take().unwrap_or_default();
                let old = std::mem::replace(&mut inner.live, listed);
                // Residencies that lost pods while the watch was down get no
                // other event for it.
                touched.extend(
                    old.into_iter()
                        .filter(|(k, pods)| {
                            inner.live.get(k).is_none_or(|now| {
                                pods.iter()
                                    .any(|e| now.iter().all(|n| n.pod.name != e.pod.name))
                            })
                        })
                        .map(|(k, _)| residency_ref(&k)),
                );
                drop(inner);
                self.ready.send_replace(true);
            }
        }
        touched
    }

    /// Visits every model pod it holds with its namespace and residency
    /// (the copy scaler's InferencePool pass, instead of a list of every
    /// model pod each tick), under the cache's lock: `visit` should only
    /// copy what it needs (reconciles and the pod watch wait on the lock).
    /// `false`, visiting nothing, until the first complete list is in: an
    /// empty view then is not an empty cluster.
    pub fn each(&self, mut visit: impl FnMut(&str, &str, &ModelPod)) -> bool {
        if !*self.ready.borrow() {
            return false;
        }
        let inner = self.inner.lock().unwrap();
        for ((namespace, residency), pods) in &inner.live {
            for e in pods.iter().filter(|e| !e.secondary) {
                visit(namespace, residency, &e.pod);
            }
        }
        true
    }

    /// The model pods of residency `name` in `namespace` owned by `uid`.
    pub fn owned(&self, namespace: &str, name: &str, uid: &str) -> Vec<ModelPod> {
        let inner = self.inner.lock().unwrap();
        inner
            .live
            .get(&(namespace.into(), name.into()))
            .map(|pods| {
                pods.iter()
                    .filter(|e| e.owner.as_deref() == Some(uid))
                    .map(|e| e.pod.clone())
                    .collect()
            })
            .unwrap_or_default()
    }

    /// Whether any model pod of residency `name` in `namespace` is left
    /// (of whichever uid: a deleted residency's pods).
    pub fn has_pods(&self, namespace: &str, name: &str) -> bool {
        let inner = self.inner.lock().unwrap();
        inner
            .live
            .get(&(namespace.into(), name.into()))
            .is_some_and(|pods| !pods.is_empty())
    }

    /// Records a pod the reconciler just created (the create response),
    /// unless the watch has already delivered it.
    pub fn created(&self, pod: &Pod) {
        let mut inner = self.inner.lock().unwrap();
        if resource_version(pod) > inner.seen {
            for (key, e) in entries(pod) {
                insert(&mut inner.live, key, e);
            }
        }
    }

    /// Records that the reconciler deleted this pod: until the watch says
    /// more, it is terminating (and still holds VRAM).
    pub fn deleting(&self, namespace: &str, residency: &str, pod: &str) {
        let mut inner = self.inner.lock().unwrap();
        let gang = inner
            .live
            .get(&(namespace.into(), residency.into()))
            .and_then(|list| list.iter().find(|e| &*e.pod.name == pod))
            .and_then(|e| e.pod.gang.clone());
        // A gang's pod is every member's: terminating for each of them.
        let members: Vec<Box<str>> = match &gang {
            Some(g) => pod_members(g).map(Into::into).collect(),
            None => vec![residency.into()],
        };
        for member in members {
            if let Some(e) = inner
                .live
                .get_mut(&(namespace.into(), member))
                .and_then(|list| list.iter_mut().find(|e| &*e.pod.name == pod))
            {
                e.pod.deleting = true;
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn pod(name: &str, residency: &str, rv: u64, deleting: bool) -> Pod {
        let mut meta = json!({
            "name": name, "namespace": "ns", "resourceVersion": rv.to_string(), "uid": format!("p-{name}"),
            "labels": {RESIDENCY_LABEL: residency, crate::residency::labels::MODEL_LABEL: "m"},
            "ownerReferences": [{"apiVersion": "residency.dev/v1alpha1", "kind": "ModelResidency",
                "name": residency, "uid": "owner", "controller": true}],
        });
        if deleting {
            meta["deletionTimestamp"] = json!("2026-01-01T00:00:00Z");
        }
        serde_json::from_value(json!({"metadata": meta})).unwrap()
    }

    fn names(c: &PodCache, residency: &str) -> Vec<(String, bool)> {
        c.owned("ns", residency, "owner")
            .into_iter()
            .map(|p| (p.name.into(), p.deleting))
            .collect()
    }

    #[test]
    fn a_created_pod_counts_until_the_watch_says_otherwise() {
        let c = PodCache::default();
        assert!(futures::FutureExt::now_or_never(c.wait_ready()).is_none());
        c.record(&watcher::Event::Init);
        c.record(&watcher::Event::InitDone);
        assert!(
            futures::FutureExt::now_or_never(c.wait_ready()).is_some(),
            "ready once the list is complete"
        );
        c.created(&pod("r-a", "r", 10, false));
        assert_eq!(names(&c, "r"), [("r-a".to_owned(), false)]);
        c.deleting("ns", "r", "r-a");
        assert_eq!(names(&c, "r"), [("r-a".to_owned(), true)]);
        // The watch catches up: created, then deleted.
        c.record(&watcher::Event::Apply(pod("r-a", "r", 10, false)));
        c.record(&watcher::Event::Delete(pod("r-a", "r", 12, true)));
        assert!(names(&c, "r").is_empty());
        assert!(c.owned("ns", "r", "someone-else").is_empty());
    }

    #[test]
    fn a_create_response_the_watch_has_passed_is_not_revived() {
        let c = PodCache::default();
        c.record(&watcher::Event::Apply(pod("r-a", "r", 10, false)));
        c.record(&watcher::Event::Delete(pod("r-a", "r", 11, true)));
        c.created(&pod("r-a", "r", 10, false));
        assert!(names(&c, "r").is_empty());
    }

    #[test]
    fn a_relist_drops_pods_deleted_meanwhile_and_names_their_residency() {
        let c = PodCache::default();
        c.record(&watcher::Event::Apply(pod("r-a", "r", 1, false)));
        c.record(&watcher::Event::Apply(pod("s-a", "s", 2, false)));
        c.record(&watcher::Event::Init);
        let touched = c.record(&watcher::Event::InitApply(pod("s-a", "s", 3, false)));
        assert_eq!(touched, [ObjectRef::new("s").within("ns")]);
        // Until the list completes, the last complete view stands.
        assert_eq!(names(&c, "r").len(), 1);
        let touched = c.record(&watcher::Event::InitDone);
        assert_eq!(touched, [ObjectRef::new("r").within("ns")]);
        assert!(names(&c, "r").is_empty());
        assert_eq!(names(&c, "s").len(), 1);
    }
}
