//! The clairvoyant reference of the timed replay ([`super::timeline`]'s
//! docs say what it knows and does): its own small GPUs, no engine.

use super::servegen::Arrival;
use super::tally::Tally;
use super::timeline::{Setup, TimelineReport};
use crate::engine::Bytes;
use std::collections::HashMap;

/// The clairvoyant reference (module docs): its own small GPUs.
pub(super) struct Clairvoyant<'s> {
    setup: &'s Setup,
    arrivals: &'s [Arrival],
    /// Each arrival's model's next arrival time after it.
    next_after: Vec<f64>,
    /// Each model's next arrival, as the replay stands.
    next_of: Vec<f64>,
    /// Per GPU: resident models and when each is ready; bytes used.
    resident: Vec<HashMap<usize, f64>>,
    used: Vec<Bytes>,
    /// Models brought in before their request came.
    ahead: Vec<bool>,
    /// When each model was last asked for (or brought in).
    last_use: Vec<f64>,
    tally: Tally<'s>,
}

impl<'s> Clairvoyant<'s> {
    pub(super) fn new(setup: &'s Setup, arrivals: &'s [Arrival]) -> Self {
        let models = setup.models.len();
        let mut next_after = vec![f64::INFINITY; arrivals.len()];
        let mut seen = vec![f64::INFINITY; models];
        for (i, a) in arrivals.iter().enumerate().rev() {
            next_after[i] = seen[a.model as usize];
            seen[a.model as usize] = a.time;
        }
        Clairvoyant {
            setup,
            arrivals,
            next_after,
            next_of: seen,
            resident: vec![HashMap::new(); setup.gpus],
            used: vec![0; setup.gpus],
            ahead: vec![false; models],
            last_use: vec![f64::NEG_INFINITY; models],
            tally: Tally::new(setup),
        }
    }

    fn gpu_of(&self, m: usize) -> usize {
        m % self.setup.gpus
    }

    fn evict(&mut self, g: usize, m: usize) {
        self.resident[g].remove(&m);
        self.used[g] -= self.setup.models[m].size;
        self.tally.report.evictions += 1;
        if std::mem::take(&mut self.ahead[m]) {
            self.tally.report.ahead_wasted += 1;
        }
    }

    fn load(&mut self, g: usize, m: usize, now: f64) -> f64 {
        let spec = &self.setup.models[m];
        let ready = now + spec.load;
        self.resident[g].insert(m, ready);
        self.used[g] += spec.size;
        self.tally.report.loads += 1;
        self.tally.report.load_seconds += spec.load;
        self.tally.report.bytes_moved += spec.size as u128;
        if self.used[g] > self.setup.budget {
            self.tally.report.over_budget_steps += 1;
        }
        ready
    }

    /// Ready residents of `g`, farthest next use first, except `keep`.
    fn victims(&self, g: usize, now: f64, keep: usize) -> Vec<usize> {
        let mut v: Vec<usize> = self.resident[g]
            .iter()
            .filter(|(m, ready)| **m != keep && **ready <= now)
            .map(|(m, _)| *m)
            .collect();
        v.sort_by(|a, b| self.next_of[*b].total_cmp(&self.next_of[*a]).then(a.cmp(b)));
        v
    }

    pub(super) fn run(mut self) -> TimelineReport {
        let arrivals = self.arrivals;
        let mut next_tick = arrivals.first().map_or(0.0, |a| a.time);
        for (i, a) in arrivals.iter().enumerate() {
            while next_tick <= a.time {
                for g in 0..self.setup.gpus {
                    let used = self.used[g];
                    self.tally.resident(g, used, next_tick);
                    self.idle_unloads(g, next_tick);
                    self.preload(g, next_tick);
                }
                next_tick += self.setup.tick;
            }
            let m = a.model as usize;
            self.last_use[m] = a.time;
            let g = self.gpu_of(m);
            let used = self.used[g];
            self.tally.resident(g, used, a.time);
            let wait = self.request(g, m, a.time);
            self.next_of[m] = self.next_after[i];
            match wait {
                Some(w) => self.tally.served(a, w),
                None => self.tally.report.refused += a.weight as f64,
            }
            self.preload(g, a.time);
        }
        let end = arrivals.last().map_or(0.0, |a| a.time);
        for g in 0..self.setup.gpus {
            let used = self.used[g];
            self.tally.resident(g, used, end);
        }
        self.tally.finish()
    }

    /// A request for `m` on `g` at `t`: its wait (`None`: it can never fit).
    fn request(&mut self, g: usize, m: usize, t: f64) -> Option<f64> {
        let size = self.setup.models[m].size;
        if size > self.setup.budget {
            return None;
        }
        if let Some(&ready) = self.resident[g].get(&m) {
            if std::mem::take(&mut self.ahead[m]) {
                self.tally.report.ahead_used += 1;
            }
            return Some((ready - t).max(0.0));
        }
        let mut now = t;
        loop {
            for v in self.victims(g, now, m) {
                if self.used[g] + size <= self.setup.budget {
                    break;
                }
                self.evict(g, v);
            }
            if self.used[g] + size <= self.setup.budget {
                let ready = self.load(g, m, now);
                return Some(ready - t);
            }
            // Only loading models stand in the way: wait for the first.
            now = self.resident[g]
                .values()
                .copied()
                .filter(|r| *r > now)
                .reduce(f64::min)?;
        }
    }

    /// Idle unloads at `now` on `g`, as the keep-alive says, except of a
    /// model needed again before a reload would be done by the next look.
    fn idle_unloads(&mut self, g: usize, now: f64) {
        let Some(keep_alive) = self.setup.keep_alive else {
            return;
        };
        let idle: Vec<usize> = self.resident[g]
            .iter()
            .filter(|(m, ready)| {
                **ready <= now
                    && self.last_use[**m] + keep_alive <= now
                    && self.next_of[**m] - now > self.setup.models[**m].load + self.setup.tick
            })
            .map(|(m, _)| *m)
            .collect();
        for m in idle {
            self.resident[g].remove(&m);
            self.used[g] -= self.setup.models[m].size;
            self.tally.report.idle_unloads += 1;
            if std::mem::take(&mut self.ahead[m]) {
                self.tally.report.ahead_wasted += 1;
            }
        }
    }

    /// Loads on `g` at `now` the models needed soonest while there is room,
    /// or room made of models needed later than each. With a keep-alive,
    /// only models needed before a load started at the next look would be
    /// done (just in time: the keep-alive is what frees GPUs, and holding
    /// a model for longer would undo it).
    fn preload(&mut self, g: usize, now: f64) {
        let gpus = self.setup.gpus;
        loop {
            let soon = |m: usize| match self.setup.keep_alive {
                Some(_) => self.next_of[m] - now <= self.setup.models[m].load + self.setup.tick,
                None => self.next_of[m].is_finite(),
            };
            let candidate = (g..self.setup.models.len())
                .step_by(gpus)
                .filter(|m| !self.resident[g].contains_key(m) && soon(*m))
                .min_by(|a, b| self.next_of[*a].total_cmp(&self.next_of[*b]));
            let Some(c) = candidate else { return };
            let size = self.setup.models[c].size;
            if size > self.setup.budget {
                return;
            }
            let need_by = self.next_of[c];
            let victims: Vec<usize> = self
                .victims(g, now, c)
                .into_iter()
                .filter(|v| self.next_of[*v] > need_by)
                .collect();
            let mut free = self.setup.budget - self.used[g];
            let mut chosen = Vec::new();
            for v in victims {
                if free >= size {
                    break;
                }
                free += self.setup.models[v].size;
                chosen.push(v);
            }
            if free < size {
                return;
            }
            for v in chosen {
                self.evict(g, v);
            }
            self.load(g, c, now);
            self.last_use[c] = now;
            self.ahead[c] = true;
            self.tally.report.ahead_loads += 1;
        }
    }
}
