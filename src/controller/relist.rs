//! Residencies deleted while the watch was down. The watch then never
//! delivers their deletion: it lists again, and what the list leaves out
//! is gone. [`Relist`] gathers the residencies a list delivers, so that
//! what the operator keeps per residency outside the cache (metrics, the
//! statuses it wrote) can be kept to them.

use crate::api::ModelResidency;
use kube::ResourceExt;
use kube::runtime::watcher;
use std::collections::HashSet;

/// A residency by namespace and name.
pub type Key = (String, String);

pub fn key_of(r: &ModelResidency) -> Key {
    (r.namespace().unwrap_or_default(), r.name_any())
}

/// The residencies of the list in progress, if one is.
#[derive(Debug, Default)]
pub struct Relist(Option<HashSet<Key>>);

impl Relist {
    /// Follows the watch; at the end of a list, the residencies that exist
    /// now (everything else was deleted).
    pub fn record(&mut self, event: &watcher::Event<ModelResidency>) -> Option<HashSet<Key>> {
        match event {
            watcher::Event::Init => self.0 = Some(HashSet::new()),
            watcher::Event::InitApply(r) => {
                self.0.get_or_insert_with(HashSet::new).insert(key_of(r));
            }
            watcher::Event::InitDone => return Some(self.0.take().unwrap_or_default()),
            watcher::Event::Apply(_) | watcher::Event::Delete(_) => {}
        }
        None
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::metrics::Metrics;

    fn residency(name: &str) -> ModelResidency {
        serde_json::from_value(serde_json::json!({
            "apiVersion": "residency.dev/v1alpha1", "kind": "ModelResidency",
            "metadata": {"name": name, "namespace": "ns"},
            "spec": {"nodeName": "n", "device": "0", "budget": "1Gi", "models": []},
        }))
        .unwrap()
    }

    #[test]
    fn a_relist_tells_what_was_deleted_while_the_watch_was_down() {
        let metrics = Metrics::new();
        let usage = crate::residency::state::Usage::default();
        for name in ["kept", "gone"] {
            metrics.observe("ns", name, &usage, Default::default());
        }
        let mut relist = Relist::default();
        assert_eq!(
            relist.record(&watcher::Event::Apply(residency("kept"))),
            None
        );
        assert_eq!(relist.record(&watcher::Event::Init), None);
        assert_eq!(
            relist.record(&watcher::Event::InitApply(residency("kept"))),
            None
        );
        let present = relist.record(&watcher::Event::InitDone).unwrap();
        assert_eq!(present, HashSet::from([("ns".into(), "kept".into())]));
        metrics.keep_only(&present);
        let text = metrics.encode();
        assert!(text.contains(r#"residency="kept""#), "{text}");
        assert!(!text.contains(r#"residency="gone""#), "{text}");
        // An empty list: nothing is left.
        relist.record(&watcher::Event::Init);
        let present = relist.record(&watcher::Event::InitDone).unwrap();
        assert!(present.is_empty());
    }
}
