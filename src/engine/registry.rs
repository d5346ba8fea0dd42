//! The registry side of the engine: models registered, resized, pinned and
//! removed, and the budgets and settings it runs under. A change that
//! leaves less room evicts as a request would (the budget outranks a load
//! in progress).

use super::*;

impl super::Engine {
    /// Chooses victims by `eviction` from now on.
    pub fn set_eviction(&mut self, eviction: Eviction) {
        self.eviction = eviction;
    }

    /// Sets the host memory sleeping models may hold. A shrink drops
    /// sleeping models (least valuable first, pinned ones last) until they
    /// fit; returns them.
    pub fn set_host_budget(&mut self, budget: Bytes) -> &[ModelId] {
        self.host_budget = budget;
        self.evicted.clear();
        if self.host_used > budget {
            // Pinned sleeping models last: the budget outranks pinning, as
            // in a VRAM budget shrink.
            let pinned: Vec<u32> = self
                .pinned
                .iter(&self.slots)
                .filter(|&v| self.slots.0[v as usize].asleep)
                .collect();
            let mut order = self.sleeping_candidates(None).chain(pinned);
            while self.host_used > self.host_budget {
                let v = order
                    .next()
                    .expect("host memory is held by sleeping models");
                self.evict(ModelId(v));
            }
        }
        &self.evicted
    }

    /// Says how a model sleeps (`None`: it cannot). A sleeping model that
    /// can no longer sleep is unloaded.
    pub fn set_sleep(&mut self, id: ModelId, sleep: Option<Sleep>) -> Result<(), RegistryError> {
        let slot = &self.slots.0[id.index()];
        if sleep.is_some_and(|s| s.sleeping_size >= slot.size) {
            return Err(RegistryError::SleepingSize(slot.name.to_string()));
        }
        if sleep.is_none() && slot.resident && slot.asleep {
            self.unload(id);
        }
        let slot = &mut self.slots.0[id.index()];
        match (slot.sleep.is_some(), sleep.is_some()) {
            (false, true) => self.sleepers += 1,
            (true, false) => self.sleepers -= 1,
            _ => {}
        }
        if slot.asleep {
            // Same state, other figures: account the difference.
            let (old_vram, old_host) = (slot.footprint(), slot.host());
            slot.sleep = sleep;
            let (vram, host) = (slot.footprint(), slot.host());
            let pinned = slot.pinned;
            self.used = self.used - old_vram + vram;
            self.host_used = self.host_used - old_host + host;
            if pinned {
                self.pinned_used = self.pinned_used - old_vram + vram;
            }
        } else {
            slot.sleep = sleep;
        }
        Ok(())
    }

    /// What bringing a model back costs (used by [`Eviction::Cost`]).
    pub fn set_costs(&mut self, id: ModelId, costs: Costs) {
        self.slots.0[id.index()].costs = costs;
    }

    /// Adds a model to the registry (not resident).
    pub fn register(
        &mut self,
        name: &str,
        size: Bytes,
        pinned: bool,
    ) -> Result<ModelId, RegistryError> {
        if name.is_empty() {
            return Err(RegistryError::EmptyName);
        }
        if size == 0 {
            return Err(RegistryError::ZeroSize(name.to_owned()));
        }
        if self.names.contains_key(name) {
            return Err(RegistryError::Duplicate(name.to_owned()));
        }
        let id = ModelId(u32::try_from(self.slots.0.len()).expect("fewer than 2^32 models"));
        self.slots.0.push(Slot {
            name: name.into(),
            size,
            pinned,
            resident: false,
            loading: false,
            sleep: None,
            asleep: false,
            costs: Costs::default(),
            uses: 0,
            base: 0.0,
            registered: true,
            last_used: 0,
            unloaded: false,
            rate: 0.0,
            rate_at: 0,
            known: None,
            links: Links::default(),
        });
        self.names.insert(name.into(), id);
        Ok(id)
    }

    /// Removes a model from the registry, unloading it if resident.
    /// Returns whether it was resident.
    pub fn deregister(&mut self, id: ModelId) -> bool {
        let was_resident = self.unload(id);
        let slot = &mut self.slots.0[id.index()];
        slot.registered = false;
        if slot.sleep.take().is_some() {
            self.sleepers -= 1;
        }
        let name = std::mem::take(&mut slot.name);
        self.names.remove(&name);
        was_resident
    }

    /// Changes a model's registered size. A resident model is re-admitted
    /// under the same rules as a request: it keeps its recency, evicting
    /// unpinned LRU residents if it grew, or is dropped (a refusal) when it
    /// can no longer fit.
    pub fn resize(&mut self, id: ModelId, size: Bytes) -> Result<Resize<'_>, RegistryError> {
        let slot = &self.slots.0[id.index()];
        if size == 0 {
            return Err(RegistryError::ZeroSize(slot.name.to_string()));
        }
        let (old, pinned) = (slot.size, slot.pinned);
        if slot.sleep.is_some_and(|s| s.sleeping_size >= size) {
            // It could not sleep at this size: it no longer sleeps.
            self.set_sleep(id, None)
                .expect("clearing is always allowed");
        }
        let slot = &self.slots.0[id.index()];
        if slot.asleep {
            // Its sleeping server is of the old size: it goes.
            self.unload(id);
        }
        let slot = &self.slots.0[id.index()];
        if !slot.resident {
            self.slots.0[id.index()].size = size;
            return Ok(Resize::NotResident);
        }
        self.evicted.clear();
        // What stays whatever we evict: pinned residents other than this one.
        let other_pinned = self.pinned_used - if pinned { old } else { 0 };
        let refusal = if size > self.budget {
            Some(RefuseReason::LargerThanBudget {
                size,
                budget: self.budget,
            })
        } else if other_pinned + size > self.budget {
            Some(RefuseReason::NoEvictableRoom {
                size,
                budget: self.budget,
                pinned: other_pinned,
            })
        } else {
            None
        };
        if let Some(reason) = refusal {
            self.remove_resident(id);
            self.slots.0[id.index()].size = size;
            self.counters.refusals += 1;
            return Ok(Resize::Dropped(reason));
        }
        self.used = self.used - old + size;
        if pinned {
            self.pinned_used = self.pinned_used - old + size;
        } else if self.slots.0[id.index()].loading {
            self.loading_used = self.loading_used - old + size;
        }
        self.slots.0[id.index()].size = size;
        while self.used > self.budget {
            // Cannot be `id` itself unless it is the only unpinned resident,
            // which the checks above rule out (it then fits alone).
            let victim = match self.evictable.lru() {
                Some(v) if v == id.0 => self.slots.0[v as usize].links.next,
                Some(v) => v,
                None => unreachable!("fit checked above"),
            };
            self.evict(ModelId(victim));
        }
        self.note_peak();
        Ok(Resize::Kept {
            evicted: &self.evicted,
        })
    }

    /// Pins or unpins a model. Pinning never evicts (the model's VRAM is
    /// already counted); the model keeps its recency. O(residents) because it
    /// re-inserts the model in order into the other list: an admin edit, not
    /// a hot path. The reconciler does not need it (it registers every
    /// model with the spec's flag when it restores its engine); a long-lived
    /// engine does, and the property tests check it against the reference.
    pub fn set_pinned(&mut self, id: ModelId, pinned: bool) {
        let slot = &self.slots.0[id.index()];
        if slot.pinned == pinned {
            return;
        }
        let (resident, size, last_used) = (slot.resident, slot.footprint(), slot.last_used);
        if resident {
            let (list, slots) = self.list_of(id);
            list.unlink(slots, id.0);
        }
        self.slots.0[id.index()].pinned = pinned;
        if resident {
            let list = if pinned { self.pinned } else { self.evictable };
            let before = list
                .iter(&self.slots)
                .find(|&s| self.slots.0[s as usize].last_used > last_used)
                .unwrap_or(recency::NIL);
            let (list, slots) = self.list_of(id);
            list.insert_before(slots, id.0, before);
            let loading = if self.slots.0[id.index()].loading {
                size
            } else {
                0
            };
            if pinned {
                self.pinned_used += size;
                self.loading_used -= loading;
            } else {
                self.pinned_used -= size;
                self.loading_used += loading;
            }
        }
    }

    /// Changes the budget. A shrink evicts least-recently-used unpinned
    /// residents until `used <= budget`; if pinned residents alone exceed the
    /// new budget, they are evicted too (LRU first): the invariant outranks
    /// pinning. Returns the victims in eviction order.
    pub fn set_budget(&mut self, budget: Bytes) -> &[ModelId] {
        self.budget = budget;
        self.evicted.clear();
        while self.used > self.budget {
            let victim = self
                .evictable
                .lru()
                .or_else(|| self.pinned.lru())
                .expect("used > 0 means something is resident");
            self.evict(ModelId(victim));
        }
        &self.evicted
    }

    /// Carries totals over from an earlier run (e.g. a stored status), so a
    /// rebuilt engine keeps counting where the last one stopped.
    pub fn resume(&mut self, counters: Counters, peak: Bytes) {
        self.counters = counters;
        self.peak = self.peak.max(peak);
    }
}
