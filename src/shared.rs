//! Values kept once: every holder of an equal value gets the same `Arc`
//! (the residency cache's pod templates and catalog references, the
//! devices the ResourceSlices publish and their field names). At 10,000
//! residencies or GPUs each copy not kept is 10,000 allocations fewer.

use std::collections::HashSet;
use std::hash::Hash;
use std::sync::Arc;

/// The values handed out, one copy of each.
pub struct Shared<T: ?Sized> {
    known: HashSet<Arc<T>>,
    /// How many were still in use at the last sweep.
    kept: usize,
}

impl<T: ?Sized> Default for Shared<T> {
    fn default() -> Self {
        Shared {
            known: HashSet::new(),
            kept: 0,
        }
    }
}

impl<T: Eq + Hash + ?Sized> Shared<T> {
    /// The shared copy of `t` (`t` itself the first time).
    pub fn share(&mut self, t: &Arc<T>) -> Arc<T> {
        if let Some(known) = self.known.get(t) {
            return known.clone();
        }
        // Those no holder has any more (only this set does) go once the set
        // has doubled since the last sweep: bounded by twice what is in
        // use, at an amortised constant cost per value.
        if self.known.len() >= 2 * self.kept.max(32) {
            self.known.retain(|k| Arc::strong_count(k) > 1);
            self.kept = self.known.len();
        }
        self.known.insert(t.clone());
        t.clone()
    }

    /// How many it keeps (those in use and those not swept yet).
    pub fn len(&self) -> usize {
        self.known.len()
    }

    pub fn is_empty(&self) -> bool {
        self.known.is_empty()
    }
}
