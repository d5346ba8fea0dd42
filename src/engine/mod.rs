//! The residency engine: which models one GPU holds, within its VRAM budget.
//!
//! Pure policy, no kube, no async, no I/O. Everything else (the `simulate`
//! command, the reconciler, the benchmarks, the property tests) drives this
//! one implementation.
//!
//! For a request for model `m`:
//! 1. `m` resident: a **hit**; `m` becomes the most recently used.
//! 2. `size(m) > budget`: **refused** (`LargerThanBudget`), nothing evicted.
//! 3. `m` could only fit by evicting pinned models: **refused**
//!    (`NoEvictableRoom`), nothing evicted.
//! 4. `m` could only fit by evicting models that are still **loading** (see
//!    [`Engine::set_loading`]): **queued**, nothing evicted, nothing counted;
//!    the caller asks again once one of them is ready.
//! 5. otherwise evict least-recently-used unpinned, ready residents until
//!    `used + size(m) <= budget`, then **load** `m` as the most recently used.
//!
//! A loading model is never a victim of a request: held requests for more
//! models than fit would otherwise evict each other's models before any of
//! them is ready, for ever. Budget shrinks and resizes still evict them (the
//! budget outranks a load in progress). A caller that never marks a model
//! loading gets the seed's policy exactly.
//!
//! Invariant: `used <= budget` after every operation. Resident models live in
//! two intrusive recency lists (unpinned, pinned), so a hit is O(1) and each
//! victim O(1) plus the loading models skipped on the way.

mod recency;

use recency::{Linked, Links, RecencyList};
use rustc_hash::FxHashMap;

/// VRAM sizes are whole bytes.
pub type Bytes = u64;

/// A model registered with an [`Engine`]. Only meaningful for that engine.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct ModelId(u32);

impl ModelId {
    /// The dense index of this model (registration order).
    fn index(self) -> usize {
        self.0 as usize
    }
}

/// Why a model was not admitted.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum RefuseReason {
    /// The model alone needs more than the whole budget.
    LargerThanBudget { size: Bytes, budget: Bytes },
    /// The model fits the budget, but only by evicting pinned models.
    NoEvictableRoom {
        size: Bytes,
        budget: Bytes,
        pinned: Bytes,
    },
    /// The request named a model that is not in the registry.
    UnknownModel,
}

impl RefuseReason {
    /// The reason as a CamelCase word, as used in conditions and events.
    pub fn as_str(&self) -> &'static str {
        match self {
            RefuseReason::LargerThanBudget { .. } => "LargerThanBudget",
            RefuseReason::NoEvictableRoom { .. } => "NoEvictableRoom",
            RefuseReason::UnknownModel => "UnknownModel",
        }
    }
}

/// What a request did.
#[derive(Debug, PartialEq, Eq)]
pub enum Admission<'a> {
    /// Already resident; now the most recently used.
    Hit,
    /// Loaded, after evicting these models (least recently used first).
    Loaded { evicted: &'a [ModelId] },
    /// Fits, but only by evicting models that are still loading: nothing
    /// changed and nothing was counted; ask again when one is ready.
    /// `loading` is the VRAM those models hold.
    Queued { loading: Bytes },
    /// Not admitted; nothing was evicted.
    Refused(RefuseReason),
}

/// What a size change in the registry did.
#[derive(Debug, PartialEq, Eq)]
pub enum Resize<'a> {
    /// The model was not resident; only its registered size changed.
    NotResident,
    /// The model stays resident (keeping its recency) after these evictions.
    Kept { evicted: &'a [ModelId] },
    /// The model no longer fits and was dropped, counted as a refusal.
    Dropped(RefuseReason),
}

/// Errors in registry edits.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum RegistryError {
    #[error("model {0:?} is already registered")]
    Duplicate(String),
    #[error("model {0:?} has size 0; a model needs a positive VRAM size")]
    ZeroSize(String),
    #[error("model names must not be empty")]
    EmptyName,
}

/// Running totals since the engine was created. The same type is the
/// residency status's `counters` (hence the serde and schema derives, which
/// bring no kube or I/O into the engine).
#[derive(
    Clone,
    Copy,
    Debug,
    Default,
    PartialEq,
    Eq,
    serde::Serialize,
    serde::Deserialize,
    schemars::JsonSchema,
)]
pub struct Counters {
    /// Requests for a model that was already resident.
    pub hits: u64,
    /// Models loaded.
    pub loads: u64,
    /// Models evicted to make room or by a budget shrink.
    pub evictions: u64,
    /// Requests refused.
    pub refusals: u64,
    /// Models unloaded by demand or registry removal (not evictions).
    pub unloads: u64,
}

#[derive(Debug)]
struct Slot {
    name: Box<str>,
    size: Bytes,
    pinned: bool,
    resident: bool,
    /// Resident and still loading: no request evicts it.
    loading: bool,
    registered: bool,
    /// Engine clock at the model's last request (0: never).
    last_used: u64,
    links: Links,
}

#[derive(Debug, Default)]
struct Slots(Vec<Slot>);

impl Linked for Slots {
    fn links(&mut self, slot: u32) -> &mut Links {
        &mut self.0[slot as usize].links
    }
    fn links_of(&self, slot: u32) -> Links {
        self.0[slot as usize].links
    }
}

/// One GPU's residency state: a registry of models and the resident subset.
#[derive(Debug)]
pub struct Engine {
    budget: Bytes,
    used: Bytes,
    /// VRAM held by resident pinned models: what no eviction can free.
    pinned_used: Bytes,
    /// VRAM held by resident unpinned models that are still loading: what
    /// no request may evict either.
    loading_used: Bytes,
    peak: Bytes,
    clock: u64,
    counters: Counters,
    slots: Slots,
    names: FxHashMap<Box<str>, ModelId>,
    evictable: RecencyList,
    pinned: RecencyList,
    /// Scratch for the victims of the current operation, reused to keep the
    /// hot path allocation-free.
    evicted: Vec<ModelId>,
}

impl Engine {
    /// An empty engine with the given VRAM budget.
    pub fn new(budget: Bytes) -> Self {
        Engine {
            budget,
            used: 0,
            pinned_used: 0,
            loading_used: 0,
            peak: 0,
            clock: 0,
            counters: Counters::default(),
            slots: Slots::default(),
            names: FxHashMap::default(),
            evictable: RecencyList::default(),
            pinned: RecencyList::default(),
            evicted: Vec::new(),
        }
    }

    // ---- registry -------------------------------------------------------

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
            registered: true,
            last_used: 0,
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
        let (resident, size, last_used) = (slot.resident, slot.size, slot.last_used);
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

    // ---- requests -------------------------------------------------------

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

    /// A request for a registered model: hit, load (with evictions) or refuse.
    pub fn request(&mut self, id: ModelId) -> Admission<'_> {
        self.clock += 1;
        let slot = &mut self.slots.0[id.index()];
        debug_assert!(slot.registered, "request for a deregistered model");
        let size = slot.size;
        if slot.resident {
            slot.last_used = self.clock;
            self.counters.hits += 1;
            let (list, slots) = self.list_of(id);
            list.touch(slots, id.0);
            return Admission::Hit;
        }
        if let Err(reason) = self.check_fit(size) {
            self.counters.refusals += 1;
            return Admission::Refused(reason);
        }
        if self.must_queue(size) {
            return Admission::Queued {
                loading: self.loading_used,
            };
        }
        self.evicted.clear();
        while self.used + size > self.budget {
            let victim = self.ready_residents().next().expect("room checked");
            self.evict(ModelId(victim));
        }
        self.make_resident(id);
        self.counters.loads += 1;
        Admission::Loaded {
            evicted: &self.evicted,
        }
    }

    /// Marks a resident model as loading (its server is not ready yet: no
    /// request evicts it) or ready (an ordinary LRU resident again). A model
    /// that is not resident is left as it is; leaving residency clears it.
    pub fn set_loading(&mut self, id: ModelId, loading: bool) {
        let slot = &mut self.slots.0[id.index()];
        if !slot.resident || slot.loading == loading {
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
        true
    }

    /// Places a model as the most recently used resident without counting a
    /// request: for rebuilding a known state (e.g. from a status) in LRU
    /// order. Fails, changing nothing, when it would break the budget.
    pub fn restore(&mut self, id: ModelId) -> Result<(), RefuseReason> {
        let slot = &self.slots.0[id.index()];
        if slot.resident {
            return Ok(());
        }
        if self.used + slot.size > self.budget {
            return Err(RefuseReason::NoEvictableRoom {
                size: slot.size,
                budget: self.budget,
                pinned: self.pinned_used,
            });
        }
        self.clock += 1;
        self.make_resident(id);
        Ok(())
    }

    /// What a request for `id` would do, without doing it: the models it
    /// would evict (`Ok(empty)` for a hit or a load that fits), `Ok(None)`
    /// when it would be queued behind loading models, or the refusal.
    pub fn plan_load(&self, id: ModelId) -> Result<Option<Vec<ModelId>>, RefuseReason> {
        let slot = &self.slots.0[id.index()];
        if slot.resident {
            return Ok(Some(Vec::new()));
        }
        self.check_fit(slot.size)?;
        if self.must_queue(slot.size) {
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

    // ---- queries --------------------------------------------------------

    pub fn id(&self, name: &str) -> Option<ModelId> {
        self.names.get(name).copied()
    }
    pub fn name(&self, id: ModelId) -> &str {
        &self.slots.0[id.index()].name
    }
    pub fn size(&self, id: ModelId) -> Bytes {
        self.slots.0[id.index()].size
    }
    pub fn is_pinned(&self, id: ModelId) -> bool {
        self.slots.0[id.index()].pinned
    }
    pub fn is_resident(&self, id: ModelId) -> bool {
        self.slots.0[id.index()].resident
    }
    /// Resident and still loading (see [`Engine::set_loading`]).
    pub fn is_loading(&self, id: ModelId) -> bool {
        let slot = &self.slots.0[id.index()];
        slot.resident && slot.loading
    }
    /// The engine clock of the model's last request or restore (0: never).
    pub fn last_used(&self, id: ModelId) -> u64 {
        self.slots.0[id.index()].last_used
    }
    pub fn budget(&self) -> Bytes {
        self.budget
    }
    pub fn used(&self) -> Bytes {
        self.used
    }
    /// VRAM held by resident pinned models.
    #[cfg(test)]
    pub fn pinned_used(&self) -> Bytes {
        self.pinned_used
    }
    /// VRAM held by resident unpinned models that are still loading.
    pub fn loading_used(&self) -> Bytes {
        self.loading_used
    }
    /// The most VRAM ever used at once.
    pub fn peak(&self) -> Bytes {
        self.peak
    }
    pub fn counters(&self) -> Counters {
        self.counters
    }
    /// Registered models, in registration order.
    pub fn models(&self) -> impl Iterator<Item = ModelId> + '_ {
        self.slots
            .0
            .iter()
            .enumerate()
            .filter(|(_, s)| s.registered)
            .map(|(i, _)| ModelId(i as u32))
    }
    /// Resident models, least recently used first (pinned and unpinned
    /// merged by recency).
    pub fn residents(&self) -> Vec<ModelId> {
        let mut out: Vec<ModelId> = self
            .evictable
            .iter(&self.slots)
            .chain(self.pinned.iter(&self.slots))
            .map(ModelId)
            .collect();
        out.sort_by_key(|&id| self.last_used(id));
        out
    }

    // ---- internals ------------------------------------------------------

    fn check_fit(&self, size: Bytes) -> Result<(), RefuseReason> {
        if size > self.budget {
            return Err(RefuseReason::LargerThanBudget {
                size,
                budget: self.budget,
            });
        }
        if self.pinned_used + size > self.budget {
            return Err(RefuseReason::NoEvictableRoom {
                size,
                budget: self.budget,
                pinned: self.pinned_used,
            });
        }
        Ok(())
    }

    /// Whether a load of `size` could only fit by evicting pinned or
    /// loading models, neither of which a request evicts.
    fn must_queue(&self, size: Bytes) -> bool {
        self.pinned_used + self.loading_used + size > self.budget
    }

    /// Unpinned residents that are not loading (a request's victims), least
    /// recently used first.
    fn ready_residents(&self) -> impl Iterator<Item = u32> + '_ {
        self.evictable
            .iter(&self.slots)
            .filter(|&v| !self.slots.0[v as usize].loading)
    }

    /// The recency list `id` belongs in, with the slots it links through.
    fn list_of(&mut self, id: ModelId) -> (&mut RecencyList, &mut Slots) {
        let list = if self.slots.0[id.index()].pinned {
            &mut self.pinned
        } else {
            &mut self.evictable
        };
        (list, &mut self.slots)
    }

    fn make_resident(&mut self, id: ModelId) {
        let slot = &mut self.slots.0[id.index()];
        slot.resident = true;
        slot.last_used = self.clock;
        let (size, pinned) = (slot.size, slot.pinned);
        self.used += size;
        if pinned {
            self.pinned_used += size;
        }
        let (list, slots) = self.list_of(id);
        list.push_mru(slots, id.0);
        self.note_peak();
    }

    fn remove_resident(&mut self, id: ModelId) {
        let (list, slots) = self.list_of(id);
        list.unlink(slots, id.0);
        let slot = &mut self.slots.0[id.index()];
        slot.resident = false;
        self.used -= slot.size;
        if slot.pinned {
            self.pinned_used -= slot.size;
        } else if slot.loading {
            self.loading_used -= slot.size;
        }
        slot.loading = false;
    }

    fn evict(&mut self, id: ModelId) {
        self.remove_resident(id);
        self.counters.evictions += 1;
        self.evicted.push(id);
    }

    fn note_peak(&mut self) {
        self.peak = self.peak.max(self.used);
    }
}

#[cfg(test)]
mod tests;
