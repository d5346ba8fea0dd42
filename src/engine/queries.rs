//! What the engine holds, read without changing it.

use super::*;

impl super::Engine {
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

    /// Whether `id` is registered (not deregistered since).
    pub fn is_registered(&self, id: ModelId) -> bool {
        self.slots.0.get(id.index()).is_some_and(|s| s.registered)
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
}
