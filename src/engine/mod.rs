//! The residency engine: which models one GPU holds, within its VRAM budget
//! (and, in [`copies`], how many GPUs hold copies of one model).
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

pub mod copies;
mod recency;
mod warm;

use recency::{Linked, Links, RecencyList};
use rustc_hash::FxHashMap;
pub use warm::{Costs, Eviction, Known, Sleep};

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
    /// Loaded, after evicting these models (least recently used first, or
    /// least valuable first under [`Eviction::Cost`]); the models put to
    /// sleep to make room are [`Engine::last_slept`].
    Loaded { evicted: &'a [ModelId] },
    /// Was sleeping; woken, after making room as a load does.
    Woken { evicted: &'a [ModelId] },
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
    #[error("model {0:?}: its sleeping size must be smaller than its size")]
    SleepingSize(String),
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
    /// Awake models put to sleep to make room (not evictions).
    #[serde(default)]
    pub sleeps: u64,
    /// Requests for a sleeping model, which woke it.
    #[serde(default)]
    pub wakes: u64,
}

#[derive(Clone, Debug)]
struct Slot {
    name: Box<str>,
    size: Bytes,
    pinned: bool,
    resident: bool,
    /// Resident and still loading: no request evicts it.
    loading: bool,
    /// How it sleeps, if it can.
    sleep: Option<Sleep>,
    /// Resident and sleeping: it holds its sleeping size, not its size.
    asleep: bool,
    costs: Costs,
    /// Requests served since it became resident (GDSF's frequency).
    uses: u64,
    /// The inflation at its last use (GDSF's `L` in its value).
    base: f64,
    registered: bool,
    /// Engine clock at the model's last request (0: never).
    last_used: u64,
    /// Unloaded (not evicted) since its last request: the seed's LRU
    /// would not hold it either ([`Engine::lag`]).
    unloaded: bool,
    /// [`Eviction::Rate`]'s request rate: requests served, each decayed
    /// by its age in requests, as of `rate_at`. Kept across evictions.
    rate: f64,
    rate_at: u64,
    /// What a ceiling measurement knows of its future (`simulate` only):
    /// it replaces the rate in [`Eviction::Rate`]'s keys.
    known: Option<Known>,
    links: Links,
}

impl Slot {
    /// The VRAM it holds while resident.
    fn footprint(&self) -> Bytes {
        match self.sleep {
            Some(s) if self.asleep => s.sleeping_size,
            _ => self.size,
        }
    }

    /// Host memory it holds while resident.
    fn host(&self) -> Bytes {
        match self.sleep {
            Some(s) if self.asleep => s.host_memory,
            _ => 0,
        }
    }

    /// Its value under [`Eviction::Cost`] as it is now.
    fn value(&self) -> f64 {
        let (cost, room) = warm::cost_and_room(self.size, self.sleep, self.asleep, self.costs);
        warm::value(self.base, self.uses, cost, room)
    }
}

#[derive(Clone, Debug, Default)]
struct Slots(Vec<Slot>);

impl Linked for Slots {
    fn links(&mut self, slot: u32) -> &mut Links {
        &mut self.0[slot as usize].links
    }
    fn links_of(&self, slot: u32) -> Links {
        self.0[slot as usize].links
    }
}

/// Requests over which `cost` and `rate` weigh their loads against the
/// seed's LRU's ([`Engine::lag`]). 256 and a limit of 0.5 load: on the
/// three thrash shapes (scripts/thrash-traces.py) `rate` made 12 / 68 /
/// 3,023 loads to LRU's 8 / 40 / 3,001 (379 / 2,325 / 5,998 unbounded);
/// on the seven traces of scripts/traces.py its waiting moved by 0.5% at
/// most (64 and a limit of 4: 16 / 111 / 3,410).
const LAG_WINDOW: f64 = 256.0;

/// Loads `cost` and `rate` may lag LRU by, recently, before their victims
/// are taken least recently used first.
const LAG_LIMIT: f64 = 0.5;

/// One GPU's residency state: a registry of models and the resident subset.
#[derive(Clone, Debug)]
pub struct Engine {
    budget: Bytes,
    /// VRAM held: awake sizes plus sleeping sizes.
    used: Bytes,
    /// Host memory the sleeping models may hold together, and hold.
    host_budget: Bytes,
    host_used: Bytes,
    /// The most host memory sleeping models ever held at once.
    host_peak: Bytes,
    eviction: Eviction,
    /// GDSF's `L`: the value of the last victim.
    inflation: f64,
    /// Registered models that can sleep: with none, and LRU, room is made
    /// by the seed's loop.
    sleepers: usize,
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
    /// The models the current operation put to sleep.
    slept: Vec<ModelId>,
    /// Scratch for the candidates of a warm or cost-aware room-making.
    order: Vec<u32>,
    /// Requests served (hits, wakes, loads) under [`Eviction::Rate`]: its
    /// clock.
    served: u64,
    /// `cost` and `rate`: how many more loads they made than the seed's
    /// LRU would have on the same requests, recently (decayed over
    /// [`LAG_WINDOW`] requests; a wake counts as its share of a load).
    /// Past [`LAG_LIMIT`] victims are taken least recently used first
    /// until it falls back: the bound that keeps them near LRU where
    /// their keys mislead them (module docs of `warm`).
    lag: f64,
    /// The request a ceiling measurement is at, for [`Known::NextRequest`].
    known_at: u64,
}

impl Engine {
    /// An empty engine with the given VRAM budget.
    pub fn new(budget: Bytes) -> Self {
        Engine {
            budget,
            used: 0,
            host_budget: 0,
            host_used: 0,
            host_peak: 0,
            eviction: Eviction::Lru,
            inflation: 0.0,
            sleepers: 0,
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
            slept: Vec::new(),
            order: Vec::new(),
            served: 0,
            lag: 0.0,
            known_at: 0,
        }
    }

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

    /// Places a model that is not resident as the most recently used one
    /// in the recency order only (no residency, no request counted): for
    /// rebuilding what the seed's LRU would hold ([`Engine::lag`]) from a
    /// status, in the order of the models' last uses, residents restored
    /// in between.
    pub fn restore_recency(&mut self, id: ModelId) {
        if self.slots.0[id.index()].resident {
            return;
        }
        self.clock += 1;
        let slot = &mut self.slots.0[id.index()];
        slot.last_used = self.clock;
        slot.unloaded = false;
    }

    /// [`Engine::restore`] for a model that is sleeping. Fails, changing
    /// nothing, when it cannot sleep or would break either budget.
    pub fn restore_asleep(&mut self, id: ModelId) -> Result<(), RefuseReason> {
        let slot = &self.slots.0[id.index()];
        let Some(sleep) = slot.sleep else {
            return self.restore(id);
        };
        if slot.resident {
            return Ok(());
        }
        let over_vram = self.used + sleep.sleeping_size > self.budget;
        if over_vram || self.host_used + sleep.host_memory > self.host_budget {
            return Err(RefuseReason::NoEvictableRoom {
                size: sleep.sleeping_size,
                budget: self.budget,
                pinned: self.pinned_used,
            });
        }
        self.clock += 1;
        self.slots.0[id.index()].asleep = true;
        self.make_resident(id);
        self.host_used += sleep.host_memory;
        self.host_peak = self.host_peak.max(self.host_used);
        Ok(())
    }

    /// Carries a resident model's use count and its value's base over from
    /// an earlier run ([`Eviction::Cost`]'s state), and the inflation.
    pub fn resume_value(&mut self, id: ModelId, uses: u64, base: f64) {
        let slot = &mut self.slots.0[id.index()];
        slot.uses = uses;
        slot.base = if base.is_finite() { base } else { 0.0 };
    }

    /// Carries a model's [`Eviction::Rate`] state over from an earlier run:
    /// its rate as counted at `at` requests served (see
    /// [`Engine::rate_state`]). Call [`Engine::resume_served`] first: an
    /// `at` past the clock is taken as now, a rate that is not a finite
    /// non-negative number as none.
    pub fn resume_rate(&mut self, id: ModelId, rate: f64, at: u64) {
        let slot = &mut self.slots.0[id.index()];
        slot.rate = if rate.is_finite() && rate > 0.0 {
            rate
        } else {
            0.0
        };
        slot.rate_at = at.min(self.served);
    }

    /// Tells [`Eviction::Rate`] what is known of a model's future, in place
    /// of its rate (a ceiling measurement in `simulate`: what the policy's
    /// keys would do with better foresight than the past). `None` goes
    /// back to the rate.
    pub fn set_known(&mut self, id: ModelId, known: Option<Known>) {
        self.slots.0[id.index()].known = known;
    }

    /// What a ceiling measurement told of `id`'s future, if anything.
    pub fn known(&self, id: ModelId) -> Option<Known> {
        self.slots.0[id.index()].known
    }

    /// The request a ceiling measurement is at (its trace's row, from 0):
    /// what [`Known::NextRequest`] counts from.
    pub fn set_known_at(&mut self, request: u64) {
        self.known_at = request;
    }

    /// Carries [`Eviction::Rate`]'s clock over (see [`Engine::served`]).
    pub fn resume_served(&mut self, served: u64) {
        self.served = self.served.max(served);
    }

    /// Carries the inflation over (see [`Engine::resume_value`]).
    pub fn resume_inflation(&mut self, inflation: f64) {
        if inflation.is_finite() {
            self.inflation = self.inflation.max(inflation);
        }
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
    /// Resident and sleeping.
    pub fn is_asleep(&self, id: ModelId) -> bool {
        let slot = &self.slots.0[id.index()];
        slot.resident && slot.asleep
    }
    pub fn sleep_of(&self, id: ModelId) -> Option<Sleep> {
        self.slots.0[id.index()].sleep
    }
    pub fn costs(&self, id: ModelId) -> Costs {
        self.slots.0[id.index()].costs
    }
    /// Requests served since it became resident, and its value's base.
    pub fn value_state(&self, id: ModelId) -> (u64, f64) {
        let slot = &self.slots.0[id.index()];
        (slot.uses, slot.base)
    }
    /// Its value under [`Eviction::Cost`] now (module docs of `warm`).
    pub fn value(&self, id: ModelId) -> f64 {
        self.slots.0[id.index()].value()
    }
    /// [`Eviction::Rate`]'s state of a model: its rate as last counted and
    /// the clock ([`Engine::served`]) it was counted at.
    pub fn rate_state(&self, id: ModelId) -> (f64, u64) {
        let slot = &self.slots.0[id.index()];
        (slot.rate, slot.rate_at)
    }
    /// A model's [`Eviction::Rate`] rate now: its requests served, each
    /// decayed by how many requests were served since.
    pub fn rate(&self, id: ModelId) -> f64 {
        self.rate_of(&self.slots.0[id.index()])
    }
    /// Requests served (hits, wakes and loads) under [`Eviction::Rate`]:
    /// its clock.
    pub fn served(&self) -> u64 {
        self.served
    }
    pub fn inflation(&self) -> f64 {
        self.inflation
    }
    pub fn eviction(&self) -> Eviction {
        self.eviction
    }
    pub fn host_budget(&self) -> Bytes {
        self.host_budget
    }
    /// Host memory the sleeping models hold.
    pub fn host_used(&self) -> Bytes {
        self.host_used
    }
    /// The most host memory sleeping models ever held at once (within a
    /// step too: a victim sleeps before the model it made room for wakes).
    pub fn host_peak(&self) -> Bytes {
        self.host_peak
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

    /// Whether `id` at `size` can fit at all: alone, and beside the pinned
    /// models other than itself.
    fn check_fit(&self, id: ModelId, size: Bytes) -> Result<(), RefuseReason> {
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
    fn must_queue(&self, id: ModelId, need: Bytes) -> bool {
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
    fn used_now(&mut self, id: ModelId) {
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
    fn make_room(&mut self, need: Bytes, keep: Option<ModelId>) {
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

    /// Whether the seed's LRU, with this budget, would hold `id` now: the
    /// models used since its last use and itself fit the budget (its stack
    /// distance, in bytes). Never used: no.
    fn lru_would_hold(&self, id: ModelId) -> bool {
        let me = &self.slots.0[id.index()];
        if me.last_used == 0 || me.unloaded {
            return false;
        }
        let mut bytes = me.size;
        for s in &self.slots.0 {
            if s.registered && !s.unloaded && s.last_used > me.last_used {
                bytes = bytes.saturating_add(s.size);
                if bytes > self.budget {
                    return false;
                }
            }
        }
        true
    }

    /// Counts one request against the seed's LRU: `ours` is what it cost
    /// here in loads (1 a load, a wake its share of one, 0 a hit), against
    /// a load where LRU would not have held it.
    fn weigh_against_lru(&mut self, lru_holds: Option<bool>, ours: f64) {
        let Some(holds) = lru_holds else {
            return;
        };
        let theirs = if holds { 0.0 } else { 1.0 };
        self.lag = self.lag * (1.0 - 1.0 / LAG_WINDOW) + ours - theirs;
    }

    /// How far `cost` or `rate` lags the seed's LRU recently, in loads
    /// (carried in status, as the rate's clock is).
    pub fn lag(&self) -> f64 {
        self.lag
    }

    /// Carries the lag over from an earlier run (see [`Engine::lag`]).
    pub fn resume_lag(&mut self, lag: f64) {
        if lag.is_finite() {
            self.lag = lag;
        }
    }

    /// Lowest value first; ties least recently used first.
    fn sort_by_value(&self, order: &mut [u32]) {
        let slots = &self.slots.0;
        order.sort_by(|&a, &b| {
            let (a, b) = (&slots[a as usize], &slots[b as usize]);
            a.value()
                .total_cmp(&b.value())
                .then(a.last_used.cmp(&b.last_used))
        });
    }

    /// [`Eviction::Rate`]'s decayed request rate of `slot` now.
    fn rate_of(&self, slot: &Slot) -> f64 {
        warm::decayed(slot.rate, self.served.saturating_sub(slot.rate_at))
    }

    /// What [`Eviction::Rate`]'s keys take as a model's rate: its decayed
    /// rate, or what a ceiling measurement knows instead.
    fn outlook(&self, slot: &Slot) -> f64 {
        match slot.known {
            None => self.rate_of(slot),
            Some(known) => known.rate(self.known_at),
        }
    }

    /// One request served for `id`: the clock ticks and its rate counts it
    /// (a fraction of one when it follows its last request closely: a
    /// burst is one wake's worth of demand, not one per request). Only
    /// under [`Eviction::Rate`]: the other policies' hot path stays as it
    /// was (an exponential per request is not free at millions a second).
    fn count_rate(&mut self, id: ModelId) {
        if self.eviction != Eviction::Rate {
            return;
        }
        self.served += 1;
        let slot = &self.slots.0[id.index()];
        let add = warm::rate_increment(slot.rate_at, self.served);
        let rate = self.rate_of(slot) + add;
        let slot = &mut self.slots.0[id.index()];
        slot.rate = rate;
        slot.rate_at = self.served;
    }

    /// [`Eviction::Rate`]'s order: the least expected waiting per GiB
    /// freed first (per GiB of host memory freed when `host`), ties least
    /// recently used first.
    fn sort_by_rate(&self, order: &mut [u32], host: bool) {
        let slots = &self.slots.0;
        let key = |v: u32| {
            let s = &slots[v as usize];
            let (cost, room) = if host {
                ((s.costs.load - s.costs.wake).max(0.0), s.host())
            } else {
                warm::cost_and_room(s.size, s.sleep, s.asleep, s.costs)
            };
            warm::expected_wait(self.outlook(s), cost, room)
        };
        order.sort_by(|&a, &b| {
            key(a).total_cmp(&key(b)).then(
                slots[a as usize]
                    .last_used
                    .cmp(&slots[b as usize].last_used),
            )
        });
    }

    /// GDSF's inflation rises to each victim's value.
    fn note_victim(&mut self, v: ModelId) {
        if self.eviction == Eviction::Cost {
            self.inflation = self.inflation.max(self.slots.0[v.index()].value());
        }
    }

    /// Sleeping unpinned models other than `keep`, least valuable first.
    fn sleeping_candidates(&self, keep: Option<ModelId>) -> std::vec::IntoIter<u32> {
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
    fn try_sleep(&mut self, v: ModelId, keep: Option<ModelId>) -> bool {
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
    fn worth_host_room(&self, v: ModelId, sleeping: &[u32], host: Bytes) -> bool {
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
    fn put_to_sleep(&mut self, id: ModelId) {
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
    fn wake(&mut self, id: ModelId) {
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

    fn remove_resident(&mut self, id: ModelId) {
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

    fn evict(&mut self, id: ModelId) {
        debug_assert!(self.slots.0[id.index()].resident, "evicting a non-resident");
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
