//! What the operator keeps of a residency in its cache of residencies (and
//! of the copies its own status writes return): the object without the
//! parts nothing here reads, without spare capacity, and with its status's
//! models and conditions deflated. At 10,000 residencies every byte a
//! cached copy keeps is 10 KB of the operator's memory (`cargo bench
//! --bench heap` measures what is left).
//!
//! The models and conditions are most of a cached copy (three models'
//! entries and three conditions: about 1.7 KB of structs and strings,
//! about 400 bytes deflated), and only a reconcile, or the copy scaler
//! acting on a model, reads them: each unpacks the copies it reads with
//! [`unpacked`] (debug builds check that no packed status is read).

use crate::api::{
    CatalogRef, ModelResidency, ModelResidencyStatus, ModelStatus, PackedDetail, PodTemplate,
};
use crate::residency::labels::{SET_DEVICE_ANNOTATION, SET_LABEL, set_owner};
use crate::shared::Shared;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::Condition;
use std::io::{Read, Write};
use std::sync::{Arc, LazyLock, Mutex};

/// The annotation `kubectl apply` keeps its last applied copy in.
const LAST_APPLIED: &str = "kubectl.kubernetes.io/last-applied-configuration";

/// Trims `r` to what the cache keeps.
pub fn compact(r: &mut ModelResidency) {
    let meta = &mut r.metadata;
    // managedFields and kubectl's last-applied copy are the largest parts of
    // a stored object (the second a copy of the spec). Set to None rather
    // than cleared: a cleared vector keeps its buffer (room for four
    // entries of ~170 bytes), and a B-tree emptied by a removal keeps its
    // first node (~540 bytes).
    meta.managed_fields = None;
    if let Some(annotations) = &mut meta.annotations {
        annotations.remove(LAST_APPLIED);
        // For people (which GPU a stamped residency is); nothing here reads
        // it, and its map was a fifth of a stamped residency's cached bytes.
        annotations.remove(SET_DEVICE_ANNOTATION);
        if annotations.is_empty() {
            meta.annotations = None;
        }
    }
    // A stamped residency's one label names its controlling set, which
    // its owner reference names too: kept as an empty map (no allocation;
    // `labels::set_label` reads it), not a B-tree node of ~540 bytes.
    let only_its_set = r
        .metadata
        .labels
        .as_ref()
        .is_some_and(|l| l.len() == 1 && l.get(SET_LABEL).map(String::as_str) == set_owner(r));
    let meta = &mut r.metadata;
    if only_its_set {
        meta.labels = Some(Default::default());
    }
    // A JSON list is read into a vector that grows by doubling from four
    // slots, so three models take four slots and twenty take thirty-two.
    if let Some(v) = &mut meta.finalizers {
        v.shrink_to_fit();
    }
    if let Some(v) = &mut meta.owner_references {
        v.shrink_to_fit();
    }
    r.spec.models.shrink_to_fit();
    if let Some(c) = &mut r.spec.catalog {
        *c = CATALOG_REFS.lock().expect("catalog refs lock").share(c);
    }
    let mut templates = TEMPLATES.lock().expect("templates lock");
    for t in r.spec.models.iter_mut().filter_map(|m| m.template.as_mut()) {
        *t = PodTemplate::of_shared(templates.share(t.shared()));
    }
    drop(templates);
    if let Some(status) = &mut r.status {
        pack(status);
    }
}

/// The catalog references the cache holds (`spec.catalog`), one copy of
/// each: the residencies a set stamps all name its catalog the same way.
static CATALOG_REFS: LazyLock<Mutex<Shared<CatalogRef>>> = LazyLock::new(Mutex::default);

/// The pod templates' texts the cache holds, one copy of each.
static TEMPLATES: LazyLock<Mutex<Shared<str>>> = LazyLock::new(Mutex::default);

/// Deflates `status`'s models and conditions into `packed` (left as they
/// are if that fails, which JSON of these types cannot).
fn pack(status: &mut ModelResidencyStatus) {
    if status.packed.is_some() || (status.models.is_empty() && status.conditions.is_empty()) {
        return;
    }
    let detail = (&status.models, &status.conditions);
    let deflated = serde_json::to_vec(&detail).ok().and_then(|json| {
        let mut z = flate2::write::DeflateEncoder::new(Vec::new(), flate2::Compression::fast());
        z.write_all(&json).ok()?;
        z.finish().ok()
    });
    if let Some(bytes) = deflated {
        status.packed = Some(PackedDetail(bytes.into_boxed_slice()));
        status.models = Vec::new();
        status.conditions = Vec::new();
    }
}

/// `r` with its status's models and conditions unpacked (`r` itself when
/// they are not packed).
pub fn unpacked(r: Arc<ModelResidency>) -> Arc<ModelResidency> {
    let Some(packed) = r.status.as_ref().and_then(|s| s.packed.as_ref()) else {
        return r;
    };
    let detail = inflate(&packed.0);
    let mut full = (*r).clone();
    let status = full.status.get_or_insert_default();
    status.packed = None;
    match detail {
        Ok((models, conditions)) => {
            status.models = models;
            status.conditions = conditions;
        }
        // Bytes `pack` wrote always read back (a unit test holds it); were
        // they ever not, the status would read as empty rather than stop
        // the operator.
        Err(e) => tracing::error!(error = %e, "a cached status could not be unpacked"),
    }
    Arc::new(full)
}

fn inflate(bytes: &[u8]) -> Result<(Vec<ModelStatus>, Vec<Condition>), String> {
    let mut json = Vec::new();
    flate2::read::DeflateDecoder::new(bytes)
        .read_to_end(&mut json)
        .map_err(|e| e.to_string())?;
    serde_json::from_slice(&json).map_err(|e| e.to_string())
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn drops_managed_fields_and_the_last_applied_copy_and_keeps_the_rest() {
        let mut r: ModelResidency = serde_json::from_value(json!({
            "apiVersion": "residency.dev/v1alpha1", "kind": "ModelResidency",
            "metadata": {"name": "gpu", "namespace": "ns", "uid": "u",
                "annotations": {LAST_APPLIED: "{}"},
                "managedFields": [{"manager": "kubectl", "operation": "Update"}]},
            "spec": {"nodeName": "n", "device": "0", "budget": "1Gi",
                "models": [{"name": "a", "size": "1"}, {"name": "b", "size": "1"}, {"name": "c", "size": "1"}]},
            "status": {"models": [{"name": "a", "state": "Loaded"}]},
        }))
        .unwrap();
        let before = r.clone();
        compact(&mut r);
        assert_eq!(r.metadata.managed_fields, None);
        assert_eq!(r.metadata.annotations, None);
        assert_eq!(r.spec, before.spec);
        assert_eq!(r.spec.models.capacity(), 3);
        let packed = r.status.as_ref().unwrap();
        assert!(packed.packed.is_some() && packed.models.is_empty());
        let back = unpacked(Arc::new(r));
        assert_eq!(back.status, before.status);

        let mut kept = before.clone();
        kept.status = None;
        kept.metadata.annotations = Some([("team".to_owned(), "a".to_owned())].into());
        compact(&mut kept);
        assert_eq!(kept.metadata.annotations.unwrap().len(), 1);
    }

    #[test]
    fn a_stamped_residency_keeps_its_set_through_its_owner_and_other_labels_stay() {
        use crate::residency::labels::set_label;
        let stamped = |labels: serde_json::Value, owner: &str| {
            let mut r: ModelResidency = serde_json::from_value(json!({
                "apiVersion": "residency.dev/v1alpha1", "kind": "ModelResidency",
                "metadata": {"name": "fleet-node-0-gpu-0", "namespace": "ns", "labels": labels,
                    "annotations": {SET_DEVICE_ANNOTATION: "node-0/gpu-0", "team": "a"},
                    "ownerReferences": [{"apiVersion": "residency.dev/v1alpha1",
                        "kind": "ResidencySet", "name": owner, "uid": "u", "controller": true}]},
                "spec": {"device": "0"},
            }))
            .unwrap();
            compact(&mut r);
            r
        };
        // Its only label, naming its controlling set: no map kept, the same
        // answer.
        let r = stamped(json!({SET_LABEL: "fleet"}), "fleet");
        assert_eq!(r.metadata.labels, Some(Default::default()));
        assert_eq!(set_label(&r), Some("fleet"));
        let annotations = r.metadata.annotations.unwrap();
        assert_eq!(annotations.keys().collect::<Vec<_>>(), ["team"]);
        // A label naming another set, another label beside it, or none at
        // all: kept as they are, so the set controller sees them differ.
        let r = stamped(json!({SET_LABEL: "other"}), "fleet");
        assert_eq!(set_label(&r), Some("other"));
        let r = stamped(json!({SET_LABEL: "fleet", "team": "a"}), "fleet");
        assert_eq!(r.metadata.labels.as_ref().unwrap().len(), 2);
        assert_eq!(set_label(&r), Some("fleet"));
        let r = stamped(json!(null), "fleet");
        assert_eq!(r.metadata.labels, None);
        assert_eq!(set_label(&r), None);
    }

    #[test]
    fn residencies_naming_one_catalog_alike_share_one_reference() {
        let residency = |models: serde_json::Value| {
            let mut r: ModelResidency = serde_json::from_value(json!({
                "apiVersion": "residency.dev/v1alpha1", "kind": "ModelResidency",
                "metadata": {"name": "gpu", "namespace": "ns"},
                "spec": {"device": "0", "catalog": {"name": "shared-fleet", "models": models}},
            }))
            .unwrap();
            compact(&mut r);
            r.spec.catalog.unwrap()
        };
        let (a, b) = (
            residency(json!(["m0", "m1"])),
            residency(json!(["m0", "m1"])),
        );
        assert!(Arc::ptr_eq(&a, &b));
        let other = residency(json!(["m0"]));
        assert!(!Arc::ptr_eq(&a, &other));
        assert_eq!(other.models.as_deref(), Some(&["m0".to_owned()][..]));
    }

    #[test]
    fn one_template_text_is_kept_once_and_forgotten_when_unused() {
        let residency = |image: &str| {
            let mut r: ModelResidency = serde_json::from_value(json!({
                "apiVersion": "residency.dev/v1alpha1", "kind": "ModelResidency",
                "metadata": {"name": "gpu", "namespace": "ns"},
                "spec": {"device": "0", "models": [{"name": "a", "size": "1Gi",
                    "template": {"spec": {"containers": [{"name": "s", "image": image}]}}}]},
            }))
            .unwrap();
            compact(&mut r);
            r
        };
        let text =
            |r: &ModelResidency| r.spec.models[0].template.as_ref().unwrap().shared().clone();
        let (a, b) = (residency("one-of-a-kind:1"), residency("one-of-a-kind:1"));
        assert!(Arc::ptr_eq(&text(&a), &text(&b)), "one copy for both");
        assert!(!Arc::ptr_eq(&text(&a), &text(&residency("another:1"))));
        // Unused texts are swept once the set has doubled.
        let mut pool = Shared::<str>::default();
        for i in 0..200 {
            let t = PodTemplate::from(
                json!({"spec": {"containers": [{"image": format!("passing:{i}")}]}}),
            );
            drop(pool.share(t.shared()));
        }
        assert!(pool.len() <= 64, "{} texts kept", pool.len());
    }

    #[test]
    fn a_packed_status_unpacks_to_what_it_was_field_for_field() {
        let condition = |t: &str, s: &str| {
            json!({"type": t, "status": s, "reason": "R", "message": "m ü",
                "lastTransitionTime": "2026-11-30T07:00:02Z", "observedGeneration": 2})
        };
        let mut r: ModelResidency = serde_json::from_value(json!({
            "apiVersion": "residency.dev/v1alpha1", "kind": "ModelResidency",
            "metadata": {"name": "gpu", "namespace": "ns", "uid": "u", "resourceVersion": "7"},
            "spec": {"nodeName": "n", "device": "0", "budget": "8Gi",
                "models": [{"name": "a", "size": "1Gi"}, {"name": "b", "size": "1Gi"}]},
            "status": {"observedGeneration": 2, "budget": "8Gi", "used": "1Gi", "served": 12,
                "gpu": {"mode": "env", "node": "n", "device": "0"},
                "models": [
                    {"name": "a", "state": "Loaded", "size": "1Gi", "lastRequested": "2026-11-30T07:00:01.123456Z",
                     "lastUsed": "2026-11-30T07:00:01.123456Z", "loadedAt": "2026-11-30T07:00:02Z",
                     "pod": "gpu-a", "reason": "Loaded", "message": "ready", "loadSeconds": 31.5,
                     "wakeSeconds": 0.25, "uses": 4, "valueBase": 1.5, "rate": 2.75, "rateAt": 11},
                    {"name": "b", "state": "Sleeping", "sleptAt": "2026-11-30T07:00:03Z", "failures": 2,
                     "retryAt": "2026-11-30T07:01:00Z"}],
                "counters": {"hits": 5, "loads": 3, "evictions": 1, "refusals": 0, "unloads": 1,
                    "sleeps": 1, "wakes": 0},
                "conditions": [condition("Ready", "True"), condition("Degraded", "False")]},
        }))
        .unwrap();
        let before = r.status.clone();
        compact(&mut r);
        let packed = r.status.as_ref().unwrap();
        assert!(packed.models.is_empty() && packed.conditions.is_empty());
        assert_eq!(
            packed.counters,
            before.as_ref().unwrap().counters,
            "the rest stays"
        );
        let back = unpacked(Arc::new(r));
        assert_eq!(back.status, before);
        // Unpacked already: the same object, not a copy.
        assert!(Arc::ptr_eq(&back, &unpacked(back.clone())));
        // Nothing of it reaches the wire.
        let json = serde_json::to_value(&*back).unwrap();
        assert!(json["status"].get("packed").is_none());
    }
}
