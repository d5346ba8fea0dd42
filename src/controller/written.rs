//! Statuses this operator wrote that its cache of residencies may not show
//! yet. A reconcile that runs before the watch delivers the operator's own
//! status write would decide again from the older status, and announce the
//! same transitions twice (events 7-45 ms apart with the same text, seen in
//! request storms). The reconciler records each status it writes with the
//! resourceVersion the write produced, and reads it back instead of an
//! older cached one; an entry goes as soon as the cache has caught up.

use super::pod_cache::resource_version_of;
use crate::api::ModelResidency;
use std::collections::HashMap;
use std::sync::{Arc, Mutex};

use super::relist::Key;

#[derive(Debug, Default)]
pub struct WrittenStatuses(Mutex<HashMap<Key, Arc<ModelResidency>>>);

use super::relist::key_of as key;

impl WrittenStatuses {
    /// Records the object a status write returned (the whole object: its
    /// spec is as new as its status).
    pub fn record(&self, mut written: ModelResidency) {
        super::cached::compact(&mut written);
        let k = key(&written);
        self.0
            .lock()
            .expect("written lock")
            .insert(k, Arc::new(written));
    }

    /// `r` as the reconciler should see it: the object its last status
    /// write returned when the cached copy predates that write.
    pub fn fresher(&self, r: Arc<ModelResidency>) -> Arc<ModelResidency> {
        let mut written = self.0.lock().expect("written lock");
        let k = key(&r);
        let Some(newer) = written.get(&k) else {
            return r;
        };
        if resource_version_of(&r.metadata) >= resource_version_of(&newer.metadata) {
            written.remove(&k);
            return r;
        }
        newer.clone()
    }

    /// How many writes the cache has not caught up with (drains to zero
    /// once the watch delivers them).
    pub fn pending(&self) -> usize {
        self.0.lock().expect("written lock").len()
    }

    /// Forgets every residency but those in `present` (see
    /// [`super::relist`]).
    pub fn keep_only(&self, present: &std::collections::HashSet<Key>) {
        self.0
            .lock()
            .expect("written lock")
            .retain(|k, _| present.contains(k));
    }

    /// Forgets a deleted residency.
    pub fn forget(&self, r: &ModelResidency) {
        self.0.lock().expect("written lock").remove(&key(r));
    }
}
