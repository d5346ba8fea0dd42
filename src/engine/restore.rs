//! Restoring an engine from what status recorded: residents in their
//! recency order, sleeping models, and each model's value and rate state,
//! so a restarted operator decides as the one before it would have.

use super::*;

impl super::Engine {
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

    /// Carries the lag over from an earlier run (see [`Engine::lag`]).
    pub fn resume_lag(&mut self, lag: f64) {
        if lag.is_finite() {
            self.lag = lag;
        }
    }
}
