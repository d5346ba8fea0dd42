//! A deliberately naive reference for the residency policy: a direct O(n)
//! translation of the seed's `mx_run` (a resident array, a linear scan for
//! the least recently used), extended with pinned models, unload, budget
//! change, resize and loading models exactly as documented for the engine. The engine is
//! checked against it; it is never used by the product.

#![allow(dead_code)]

#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Outcome {
    Hit,
    Loaded(Vec<usize>),
    /// Waits behind loading models holding this much.
    Queued(u64),
    /// "LargerThanBudget" or "NoEvictableRoom".
    Refused(&'static str),
}

#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Totals {
    pub hits: u64,
    pub loads: u64,
    pub evictions: u64,
    pub refusals: u64,
    pub unloads: u64,
}

pub struct Reference {
    pub budget: u64,
    pub sizes: Vec<u64>,
    pub pinned: Vec<bool>,
    /// Marked loading (meaningful while resident).
    pub loading: Vec<bool>,
    /// (model, last used); order of the array is irrelevant.
    pub resident: Vec<(usize, u64)>,
    pub clock: u64,
    pub totals: Totals,
    pub peak: u64,
}

impl Reference {
    pub fn new(budget: u64, models: &[(u64, bool)]) -> Self {
        Reference {
            budget,
            sizes: models.iter().map(|m| m.0).collect(),
            pinned: models.iter().map(|m| m.1).collect(),
            loading: vec![false; models.len()],
            resident: Vec::new(),
            clock: 0,
            totals: Totals::default(),
            peak: 0,
        }
    }

    pub fn used(&self) -> u64 {
        self.resident.iter().map(|&(m, _)| self.sizes[m]).sum()
    }

    fn pinned_used_except(&self, except: Option<usize>) -> u64 {
        self.resident
            .iter()
            .filter(|&&(m, _)| self.pinned[m] && Some(m) != except)
            .map(|&(m, _)| self.sizes[m])
            .sum()
    }

    /// VRAM of resident unpinned models marked loading.
    pub fn loading_used(&self) -> u64 {
        self.resident
            .iter()
            .filter(|&&(m, _)| self.loading[m] && !self.pinned[m])
            .map(|&(m, _)| self.sizes[m])
            .sum()
    }

    /// Index in `resident` of the LRU model passing `filter`.
    fn lru(&self, filter: impl Fn(usize) -> bool) -> Option<usize> {
        let mut best: Option<usize> = None;
        for (i, &(m, t)) in self.resident.iter().enumerate() {
            if filter(m) && best.is_none_or(|b| t < self.resident[b].1) {
                best = Some(i);
            }
        }
        best
    }

    fn evict_at(&mut self, i: usize, out: &mut Vec<usize>) {
        let (m, _) = self.resident.remove(i);
        self.loading[m] = false;
        self.totals.evictions += 1;
        out.push(m);
    }

    fn refusal(&self, model: usize, size: u64) -> Option<&'static str> {
        if size > self.budget {
            Some("LargerThanBudget")
        } else if self.pinned_used_except(Some(model)) + size > self.budget {
            Some("NoEvictableRoom")
        } else {
            None
        }
    }

    pub fn request(&mut self, m: usize) -> Outcome {
        self.clock += 1;
        if let Some(i) = self.resident.iter().position(|&(r, _)| r == m) {
            self.totals.hits += 1;
            self.resident[i].1 = self.clock;
            return Outcome::Hit;
        }
        if let Some(reason) = self.refusal(m, self.sizes[m]) {
            self.totals.refusals += 1;
            return Outcome::Refused(reason);
        }
        let loading = self.loading_used();
        if self.pinned_used_except(None) + loading + self.sizes[m] > self.budget {
            return Outcome::Queued(loading);
        }
        let mut evicted = Vec::new();
        while self.used() + self.sizes[m] > self.budget {
            let i = self
                .lru(|r| !self.pinned[r] && !self.loading[r])
                .expect("room checked");
            self.evict_at(i, &mut evicted);
        }
        self.resident.push((m, self.clock));
        self.totals.loads += 1;
        self.peak = self.peak.max(self.used());
        Outcome::Loaded(evicted)
    }

    pub fn unload(&mut self, m: usize) -> bool {
        match self.resident.iter().position(|&(r, _)| r == m) {
            Some(i) => {
                self.resident.remove(i);
                self.loading[m] = false;
                self.totals.unloads += 1;
                true
            }
            None => false,
        }
    }

    pub fn set_budget(&mut self, budget: u64) -> Vec<usize> {
        self.budget = budget;
        let mut evicted = Vec::new();
        while self.used() > self.budget {
            let i = self
                .lru(|r| !self.pinned[r])
                .or_else(|| self.lru(|_| true))
                .unwrap();
            self.evict_at(i, &mut evicted);
        }
        evicted
    }

    /// `Ok(evicted)` if kept or not resident, `Err(reason)` if dropped.
    pub fn resize(&mut self, m: usize, size: u64) -> Result<Vec<usize>, &'static str> {
        let Some(pos) = self.resident.iter().position(|&(r, _)| r == m) else {
            self.sizes[m] = size;
            return Ok(Vec::new());
        };
        if let Some(reason) = self.refusal(m, size) {
            self.resident.remove(pos);
            self.loading[m] = false;
            self.sizes[m] = size;
            self.totals.refusals += 1;
            return Err(reason);
        }
        self.sizes[m] = size;
        let mut evicted = Vec::new();
        while self.used() > self.budget {
            let i = self.lru(|r| !self.pinned[r] && r != m).unwrap();
            self.evict_at(i, &mut evicted);
        }
        self.peak = self.peak.max(self.used());
        Ok(evicted)
    }

    pub fn set_pinned(&mut self, m: usize, pinned: bool) {
        self.pinned[m] = pinned;
    }

    pub fn set_loading(&mut self, m: usize, loading: bool) {
        if self.resident.iter().any(|&(r, _)| r == m) {
            self.loading[m] = loading;
        }
    }

    /// Resident models, least recently used first.
    pub fn residents(&self) -> Vec<usize> {
        let mut r = self.resident.clone();
        r.sort_by_key(|&(_, t)| t);
        r.into_iter().map(|(m, _)| m).collect()
    }
}
