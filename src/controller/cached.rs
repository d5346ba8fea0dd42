//! What the operator keeps of a residency in its cache of residencies (and
//! of the copies its own status writes return): the object without the
//! parts nothing here reads, and without spare capacity. At 10,000
//! residencies every byte a cached copy keeps is 10 KB of the operator's
//! memory (`cargo bench --bench heap` measures what is left).

use crate::api::ModelResidency;

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
        if annotations.is_empty() {
            meta.annotations = None;
        }
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
    if let Some(status) = &mut r.status {
        status.models.shrink_to_fit();
        status.conditions.shrink_to_fit();
    }
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
        assert_eq!(r.status, before.status);
        assert_eq!(r.spec.models.capacity(), 3);
        assert_eq!(r.status.as_ref().unwrap().models.capacity(), 1);

        let mut kept = before.clone();
        kept.metadata.annotations = Some([("team".to_owned(), "a".to_owned())].into());
        compact(&mut kept);
        assert_eq!(kept.metadata.annotations.unwrap().len(), 1);
    }
}
