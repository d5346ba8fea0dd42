//! The seed's policy: a request's admission (hit, refusal, queue, load),
//! the least recently used victims it evicts, unloads, and the resident
//! lists' upkeep.

use super::*;

impl super::Engine {
    /// A request refused outside this engine (a gang the node's GPUs can
    /// never hold together): counted as a refusal, nothing else changes.
    pub fn count_refusal(&mut self) {
        self.clock += 1;
        self.counters.refusals += 1;
    }

    /// A request for a model by name; unknown names are refused.
    pub fn request_named(&mut self, name: &str) -> Admission<'_> {
        match self.id(name) {
            Some(id) => self.request(id),
            None => {
                self.clock += 1;
                self.counters.refusals += 1;
                Admission::Refused(RefuseReason::UnknownModel)
            }
        }
    }

    /// A request for a registered model: hit, wake or load (making room),
    /// queue, or refuse.
    pub fn request(&mut self, id: ModelId) -> Admission<'_> {
        // Whether the seed's LRU would hold it now: before this request
        // moves it to the front.
        let lru_holds = (self.eviction != Eviction::Lru).then(|| self.lru_would_hold(id));
        self.clock += 1;
        self.evicted.clear();
        self.slept.clear();
        let slot = &self.slots.0[id.index()];
        debug_assert!(slot.registered, "request for a deregistered model");
        let (size, resident, asleep) = (slot.size, slot.resident, slot.asleep);
        if resident && !asleep {
            self.counters.hits += 1;
            self.used_now(id);
            self.weigh_against_lru(lru_holds, 0.0);
            return Admission::Hit;
        }
        if let Err(reason) = self.check_fit(id, size) {
            self.counters.refusals += 1;
            return Admission::Refused(reason);
        }
        // What it adds: all of it, or what waking adds to its sleeping size.
        let need = size - if asleep { slot.footprint() } else { 0 };
        if self.must_queue(id, need) {
            return Admission::Queued {
                loading: self.loading_used,
            };
        }
        self.make_room(need, Some(id));
        if asleep {
            let c = self.slots.0[id.index()].costs;
            let share = if c.load > 0.0 {
                (c.wake / c.load).min(1.0)
            } else {
                1.0
            };
            self.weigh_against_lru(lru_holds, share);
            self.wake(id);
            self.counters.wakes += 1;
            self.used_now(id);
            return Admission::Woken {
                evicted: &self.evicted,
            };
        }
        self.weigh_against_lru(lru_holds, 1.0);
        self.make_resident(id);
        self.counters.loads += 1;
        self.count_rate(id);
        let slot = &mut self.slots.0[id.index()];
        slot.uses = 1;
        slot.base = self.inflation;
        Admission::Loaded {
            evicted: &self.evicted,
        }
    }

    /// The models the last request put to sleep to make room (they stay
    /// resident, sleeping).
    pub fn last_slept(&self) -> &[ModelId] {
        &self.slept
    }

    /// Marks a resident model as loading (its server is not ready yet: no
    /// request evicts it) or ready (an ordinary LRU resident again). A model
    /// that is not resident is left as it is; leaving residency clears it.
    pub fn set_loading(&mut self, id: ModelId, loading: bool) {
        let slot = &mut self.slots.0[id.index()];
        if !slot.resident || slot.asleep || slot.loading == loading {
            return;
        }
        slot.loading = loading;
        if slot.pinned {
            return;
        }
        if loading {
            self.loading_used += slot.size;
        } else {
            self.loading_used -= slot.size;
        }
    }

    /// Unloads a resident model (autoscaler scale-down). Not an eviction.
    /// Returns whether it was resident.
    pub fn unload(&mut self, id: ModelId) -> bool {
        if !self.slots.0[id.index()].resident {
            return false;
        }
        self.remove_resident(id);
        self.counters.unloads += 1;
        self.slots.0[id.index()].unloaded = true;
        true
    }

    /// Sends the resident, awake `id` off the GPU's full size: to sleep when
    /// it can sleep and the host budget has room for it (made by dropping
    /// sleeping models, least valuable first, as a request's room is),
    /// returning the models dropped for that room; `None`, changing
    /// nothing, when it cannot sleep (the caller unloads it). For a copy of
    /// a model that the copy scaler removes: adding it back is then a wake.
    pub fn retire(&mut self, id: ModelId) -> Option<&[ModelId]> {
        let slot = &self.slots.0[id.index()];
        if !slot.resident || slot.asleep || slot.sleep.is_none() {
            return None;
        }
        self.evicted.clear();
        self.slept.clear();
        if !self.try_sleep(id, Some(id)) {
            return None;
        }
        self.counters.sleeps += 1;
        Some(&self.evicted)
    }

    /// What a request for `id` would do, without doing it: the models it
    /// would evict (`Ok(empty)` for a hit or a load that fits), `Ok(None)`
    /// when it would be queued behind loading models, or the refusal.
    pub fn plan_load(&self, id: ModelId) -> Result<Option<Vec<ModelId>>, RefuseReason> {
        let slot = &self.slots.0[id.index()];
        if slot.resident && !slot.asleep {
            return Ok(Some(Vec::new()));
        }
        if slot.asleep || self.sleepers > 0 || self.eviction != Eviction::Lru {
            // The rule is the request's; run it on a copy.
            let mut copy = self.clone();
            return match copy.request(id) {
                Admission::Hit => Ok(Some(Vec::new())),
                Admission::Loaded { evicted } | Admission::Woken { evicted } => {
                    Ok(Some(evicted.to_vec()))
                }
                Admission::Queued { .. } => Ok(None),
                Admission::Refused(reason) => Err(reason),
            };
        }
        self.check_fit(id, slot.size)?;
        if self.must_queue(id, slot.size) {
            return Ok(None);
        }
        let mut freed = self.budget - self.used;
        let mut victims = Vec::new();
        let mut lru = self.ready_residents();
        while freed < slot.size {
            let v = lru.next().expect("room checked");
            freed += self.slots.0[v as usize].size;
            victims.push(ModelId(v));
        }
        Ok(Some(victims))
    }

    /// Whether `id` at `size` can fit at all: alone, and beside the pinned
    /// models other than itself.
    pub(super) fn check_fit(&self, id: ModelId, size: Bytes) -> Result<(), RefuseReason> {
        if size > self.budget {
            return Err(RefuseReason::LargerThanBudget {
                size,
                budget: self.budget,
            });
        }
        let slot = &self.slots.0[id.index()];
        let own = if slot.resident && slot.pinned {
            slot.footprint()
        } else {
            0
        };
        let pinned = self.pinned_used - own;
        if pinned + size > self.budget {
            return Err(RefuseReason::NoEvictableRoom {
                size,
                budget: self.budget,
                pinned,
            });
        }
        Ok(())
    }

    /// Whether `need` more bytes for `id` could only be found by evicting
    /// pinned or loading models (or `id` itself), none of which a request
    /// evicts.
    pub(super) fn must_queue(&self, id: ModelId, need: Bytes) -> bool {
        let slot = &self.slots.0[id.index()];
        let own = if slot.resident && !slot.pinned {
            slot.footprint()
        } else {
            0
        };
        self.pinned_used + self.loading_used + own + need > self.budget
    }

    /// A request's use of a resident model: most recently used, one use
    /// more, its value's base the inflation now.
    pub(super) fn used_now(&mut self, id: ModelId) {
        self.count_rate(id);
        let slot = &mut self.slots.0[id.index()];
        slot.last_used = self.clock;
        slot.unloaded = false;
        slot.uses += 1;
        slot.base = self.inflation;
        let (list, slots) = self.list_of(id);
        list.touch(slots, id.0);
    }

    /// Frees `need` bytes beyond what is free, from the ready unpinned
    /// residents other than `keep`, in the policy's order: an awake victim
    /// that can sleep sleeps (if the host budget has or can be given room),
    /// any other is evicted. If sleeping them was not enough, the models
    /// slept here are evicted too, in the same order. The caller checked
    /// that the room can be made.
    pub(super) fn make_room(&mut self, need: Bytes, keep: Option<ModelId>) {
        if self.used + need <= self.budget {
            return;
        }
        if self.sleepers == 0 && self.eviction == Eviction::Lru {
            // The seed's loop, allocation-free.
            while self.used + need > self.budget {
                let victim = self
                    .ready_residents()
                    .find(|&v| Some(ModelId(v)) != keep)
                    .expect("room checked");
                self.evict(ModelId(victim));
            }
            return;
        }
        let mut order = std::mem::take(&mut self.order);
        order.clear();
        order.extend(self.ready_residents().filter(|&v| Some(ModelId(v)) != keep));
        match self.eviction {
            // Lagging LRU: its order (ready_residents' own) until it
            // catches up.
            _ if self.lag > LAG_LIMIT => {}
            Eviction::Cost => self.sort_by_value(&mut order),
            Eviction::Rate => self.sort_by_rate(&mut order, false),
            Eviction::Lru => {}
        }
        for &v in &order {
            if self.used + need <= self.budget {
                break;
            }
            let v = ModelId(v);
            if !self.slots.0[v.index()].resident {
                continue; // dropped to give another sleeper host room
            }
            self.note_victim(v);
            if !self.slots.0[v.index()].asleep && self.try_sleep(v, keep) {
                self.slept.push(v);
                continue;
            }
            self.evict(v);
        }
        // Some slept here may have been dropped since, for another's host room.
        let slots = &self.slots.0;
        self.slept.retain(|v| slots[v.index()].asleep);
        let mut slept = 0;
        while self.used + need > self.budget {
            let v = *self.slept.get(slept).expect("room checked");
            slept += 1;
            self.evict(v);
        }
        self.slept.drain(..slept);
        self.counters.sleeps += self.slept.len() as u64;
        self.order = order;
    }

    /// Unpinned residents that are not loading (a request's victims), least
    /// recently used first.
    pub(super) fn ready_residents(&self) -> impl Iterator<Item = u32> + '_ {
        self.evictable
            .iter(&self.slots)
            .filter(|&v| !self.slots.0[v as usize].loading)
    }

    /// The recency list `id` belongs in, with the slots it links through.
    pub(super) fn list_of(&mut self, id: ModelId) -> (&mut RecencyList, &mut Slots) {
        let list = if self.slots.0[id.index()].pinned {
            &mut self.pinned
        } else {
            &mut self.evictable
        };
        (list, &mut self.slots)
    }

    pub(super) fn make_resident(&mut self, id: ModelId) {
        let slot = &mut self.slots.0[id.index()];
        slot.resident = true;
        slot.last_used = self.clock;
        slot.unloaded = false;
        let (size, pinned) = (slot.footprint(), slot.pinned);
        self.used += size;
        if pinned {
            self.pinned_used += size;
        }
        let (list, slots) = self.list_of(id);
        list.push_mru(slots, id.0);
        self.note_peak();
    }

    pub(super) fn remove_resident(&mut self, id: ModelId) {
        let (list, slots) = self.list_of(id);
        list.unlink(slots, id.0);
        let slot = &mut self.slots.0[id.index()];
        slot.resident = false;
        let held = slot.footprint();
        self.used -= held;
        self.host_used -= slot.host();
        if slot.pinned {
            self.pinned_used -= held;
        } else if slot.loading {
            self.loading_used -= slot.size;
        }
        slot.loading = false;
        slot.asleep = false;
        slot.uses = 0;
    }

    /// Evicts the resident `id` because its gang left another GPU (a
    /// victim there, [`super::gangs`]): counted as an eviction here, not
    /// among the last operation's victims. Whether it was resident.
    pub fn evict_member(&mut self, id: ModelId) -> bool {
        if !self.slots.0[id.index()].resident {
            return false;
        }
        self.remove_resident(id);
        self.counters.evictions += 1;
        true
    }

    pub(super) fn evict(&mut self, id: ModelId) {
        debug_assert!(self.slots.0[id.index()].resident, "evicting a non-resident");
        self.remove_resident(id);
        self.counters.evictions += 1;
        self.evicted.push(id);
    }

    pub(super) fn note_peak(&mut self) {
        self.peak = self.peak.max(self.used);
    }
}
