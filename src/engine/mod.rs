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

pub mod adapters;
mod admission;
pub mod anticipation;
pub mod copies;
pub mod forecast;
pub mod gangs;
mod queries;
mod recency;
mod registry;
mod restore;
mod sleeping;
mod valuation;
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
    pub fn index(self) -> usize {
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
    /// Models loaded or woken ahead of demand (`spec.anticipate`).
    #[serde(default, skip_serializing_if = "is_zero")]
    pub anticipated: u64,
    /// Of those, the ones a request used before they left the GPU or fell
    /// asleep...
    #[serde(default, rename = "anticipatedUsed", skip_serializing_if = "is_zero")]
    pub anticipated_used: u64,
    /// ...and the ones that left or fell asleep unused.
    #[serde(default, rename = "anticipatedWasted", skip_serializing_if = "is_zero")]
    pub anticipated_wasted: u64,
}

fn is_zero(n: &u64) -> bool {
    *n == 0
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
}

#[cfg(test)]
mod tests;
