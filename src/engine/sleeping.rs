//! The warm tier's moves: which resident sleeps instead of being evicted
//! (while the host budget has room and it is worth it), and the wake that
//! makes a sleeping model resident again.

use super::*;

impl super::Engine {
    /// Sleeping unpinned models other than `keep`, least valuable first.
    pub(super) fn sleeping_candidates(&self, keep: Option<ModelId>) -> std::vec::IntoIter<u32> {
        let mut sleeping: Vec<u32> = self
            .evictable
            .iter(&self.slots)
            .filter(|&v| self.slots.0[v as usize].asleep && Some(ModelId(v)) != keep)
            .collect();
        match self.eviction {
            Eviction::Cost => self.sort_by_value(&mut sleeping),
            Eviction::Rate => self.sort_by_rate(&mut sleeping, true),
            Eviction::Lru => {}
        }
        sleeping.into_iter()
    }

    /// Puts the awake `v` to sleep if it can sleep and the host budget has
    /// room for it, making that room by evicting sleeping models (least
    /// valuable first, never `keep`) when that is enough.
    pub(super) fn try_sleep(&mut self, v: ModelId, keep: Option<ModelId>) -> bool {
        let Some(sleep) = self.slots.0[v.index()].sleep else {
            return false;
        };
        let host = sleep.host_memory;
        if host > self.host_budget {
            return false;
        }
        if self.host_used + host > self.host_budget {
            let sleeping: Vec<u32> = self.sleeping_candidates(keep).collect();
            let droppable: Bytes = sleeping
                .iter()
                .map(|&d| self.slots.0[d as usize].host())
                .sum();
            if self.host_used - droppable + host > self.host_budget {
                return false;
            }
            if self.eviction == Eviction::Rate && !self.worth_host_room(v, &sleeping, host) {
                return false;
            }
            for d in sleeping {
                if self.host_used + host <= self.host_budget {
                    break;
                }
                self.note_victim(ModelId(d));
                self.evict(ModelId(d));
            }
        }
        self.put_to_sleep(v);
        true
    }

    /// [`Eviction::Rate`]'s host admission: `v` sleeps only if the sleepers
    /// dropped for its `host` bytes (from `sleeping`, in order) would cost
    /// less waiting than deleting `v` instead.
    pub(super) fn worth_host_room(&self, v: ModelId, sleeping: &[u32], host: Bytes) -> bool {
        let slot = &self.slots.0[v.index()];
        let gain = self.outlook(slot) * (slot.costs.load - slot.costs.wake).max(0.0);
        let mut used = self.host_used;
        let mut lost = 0.0;
        for &d in sleeping {
            if used + host <= self.host_budget {
                break;
            }
            let d = &self.slots.0[d as usize];
            used -= d.host();
            lost += self.outlook(d) * (d.costs.load - d.costs.wake).max(0.0);
        }
        lost < gain
    }

    /// A resident awake model sleeps: it holds its sleeping size, and its
    /// host memory.
    pub(super) fn put_to_sleep(&mut self, id: ModelId) {
        let slot = &mut self.slots.0[id.index()];
        debug_assert!(slot.resident && !slot.asleep && slot.sleep.is_some());
        let before = slot.footprint();
        if slot.loading {
            slot.loading = false;
            if !slot.pinned {
                self.loading_used -= slot.size;
            }
        }
        slot.asleep = true;
        let (after, host, pinned) = (slot.footprint(), slot.host(), slot.pinned);
        self.used = self.used - before + after;
        self.host_used += host;
        self.host_peak = self.host_peak.max(self.host_used);
        if pinned {
            self.pinned_used = self.pinned_used - before + after;
        }
    }

    /// A resident sleeping model wakes: it holds its size again.
    pub(super) fn wake(&mut self, id: ModelId) {
        let slot = &mut self.slots.0[id.index()];
        debug_assert!(slot.resident && slot.asleep);
        let (before, host) = (slot.footprint(), slot.host());
        slot.asleep = false;
        let (after, pinned) = (slot.footprint(), slot.pinned);
        self.used = self.used - before + after;
        self.host_used -= host;
        if pinned {
            self.pinned_used = self.pinned_used - before + after;
        }
        self.note_peak();
    }
}
