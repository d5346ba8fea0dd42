//! `spec.eviction: cost` and `rate`: the order victims are taken in by
//! what bringing each back would cost, or by its request rate, and the
//! bound on how far either may lag the seed's LRU.

use super::*;

impl super::Engine {
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

    /// Whether the seed's LRU, with this budget, would hold `id` now: the
    /// models used since its last use and itself fit the budget (its stack
    /// distance, in bytes). Never used: no.
    pub(super) fn lru_would_hold(&self, id: ModelId) -> bool {
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
    pub(super) fn weigh_against_lru(&mut self, lru_holds: Option<bool>, ours: f64) {
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

    /// Lowest value first; ties least recently used first.
    pub(super) fn sort_by_value(&self, order: &mut [u32]) {
        let slots = &self.slots.0;
        order.sort_by(|&a, &b| {
            let (a, b) = (&slots[a as usize], &slots[b as usize]);
            a.value()
                .total_cmp(&b.value())
                .then(a.last_used.cmp(&b.last_used))
        });
    }

    /// [`Eviction::Rate`]'s decayed request rate of `slot` now.
    pub(super) fn rate_of(&self, slot: &Slot) -> f64 {
        warm::decayed(slot.rate, self.served.saturating_sub(slot.rate_at))
    }

    /// What [`Eviction::Rate`]'s keys take as a model's rate: its decayed
    /// rate, or what a ceiling measurement knows instead.
    pub(super) fn outlook(&self, slot: &Slot) -> f64 {
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
    pub(super) fn count_rate(&mut self, id: ModelId) {
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
    pub(super) fn sort_by_rate(&self, order: &mut [u32], host: bool) {
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
    pub(super) fn note_victim(&mut self, v: ModelId) {
        if self.eviction == Eviction::Cost {
            self.inflation = self.inflation.max(self.slots.0[v.index()].value());
        }
    }
}
