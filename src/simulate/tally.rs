//! What the timed replays ([`super::timeline`]) count: each request's
//! wait at its weight (percentiles, shares within an SLO), returns after a
//! quiet period, and VRAM held over time.

use super::servegen::Arrival;
use super::timeline::{Setup, TimelineReport};
use crate::engine::Bytes;
use crate::engine::forecast::SLOT_SECONDS;

/// Waits, weighted: their percentiles and shares.
#[derive(Default)]
pub(super) struct Waits {
    zero: f64,
    waited: Vec<(f32, f32)>,
    total: f64,
    sum: f64,
}

impl Waits {
    fn add(&mut self, wait: f64, weight: f64) {
        self.total += weight;
        self.sum += wait * weight;
        if wait <= 0.0 {
            self.zero += weight;
        } else {
            self.waited.push((wait as f32, weight as f32));
        }
    }

    pub(super) fn finish(&mut self, r: &mut TimelineReport) {
        self.waited.sort_by(|a, b| a.0.total_cmp(&b.0));
        let quantile = |q: f64| {
            let target = q * self.total;
            let mut seen = self.zero;
            if seen >= target {
                return 0.0;
            }
            for &(w, weight) in &self.waited {
                seen += weight as f64;
                if seen >= target {
                    return w as f64;
                }
            }
            self.waited.last().map_or(0.0, |w| w.0 as f64)
        };
        let within = |limit: f64| {
            let late: f64 = self
                .waited
                .iter()
                .filter(|w| w.0 as f64 > limit)
                .map(|w| w.1 as f64)
                .sum();
            if self.total == 0.0 {
                1.0
            } else {
                1.0 - late / self.total
            }
        };
        r.requests = self.total;
        r.p50_wait = quantile(0.5);
        r.p99_wait = quantile(0.99);
        r.p999_wait = quantile(0.999);
        r.p9999_wait = quantile(0.9999);
        r.mean_wait = if self.total > 0.0 {
            self.sum / self.total
        } else {
            0.0
        };
        r.within_1s = within(1.0);
        r.within_10s = within(10.0);
    }
}

/// Per model: when it was last asked, and which slots of the replay had a
/// request (the day-before check).
pub(super) struct History {
    last: Vec<Option<f64>>,
    slots: Vec<Vec<u64>>,
}

impl History {
    pub(super) fn new(models: usize) -> Self {
        History {
            last: vec![None; models],
            slots: vec![Vec::new(); models],
        }
    }

    fn active(&self, m: usize, slot: u64) -> bool {
        let bits = &self.slots[m];
        let (i, b) = ((slot / 64) as usize, slot % 64);
        bits.get(i).is_some_and(|w| w & (1 << b) != 0)
    }

    /// A request for `m` at `t`: whether it returns after `quiet`, and
    /// whether its model was used the day before about then.
    fn request(&mut self, m: usize, t: f64, quiet: f64) -> (bool, bool) {
        let returns = self.last[m].is_some_and(|l| t - l >= quiet);
        let daily = returns && {
            let day_before = t - 86_400.0;
            day_before >= 0.0 && {
                let s = (day_before / SLOT_SECONDS) as u64;
                (s.saturating_sub(3)..=s + 3).any(|s| self.active(m, s))
            }
        };
        self.last[m] = Some(t);
        let slot = (t / SLOT_SECONDS) as u64;
        let (i, b) = ((slot / 64) as usize, slot % 64);
        let bits = &mut self.slots[m];
        if bits.len() <= i {
            bits.resize(i + 1, 0);
        }
        bits[i] |= 1 << b;
        (returns, daily)
    }
}

/// What the replays share: counting a request's wait and its return.
pub(super) struct Tally<'s> {
    pub(super) setup: &'s Setup,
    waits: Waits,
    history: History,
    pub(super) report: TimelineReport,
    /// Per GPU: when its resident bytes were last counted.
    area_at: Vec<f64>,
}

impl<'s> Tally<'s> {
    pub(super) fn new(setup: &'s Setup) -> Self {
        Tally {
            setup,
            waits: Waits::default(),
            history: History::new(setup.models.len()),
            report: TimelineReport::default(),
            area_at: vec![0.0; setup.gpus],
        }
    }

    pub(super) fn served(&mut self, a: &Arrival, wait: f64) {
        let m = a.model as usize;
        let (returns, daily) = self.history.request(m, a.time, self.setup.quiet);
        let hit = wait <= 0.0;
        if returns {
            self.report.quiet_returns += 1;
            self.report.quiet_hits += hit as u64;
        }
        if daily {
            self.report.daily_returns += 1;
            self.report.daily_hits += hit as u64;
        }
        self.waits.add(wait.max(0.0), a.weight as f64);
        self.report.drawn += 1;
    }

    /// Counts GPU `g`'s resident bytes `used` up to `t`.
    pub(super) fn resident(&mut self, g: usize, used: Bytes, t: f64) {
        let dt = (t - self.area_at[g]).max(0.0);
        self.report.resident_gib_hours += used as f64 / (1u64 << 30) as f64 * dt / 3600.0;
        self.area_at[g] = self.area_at[g].max(t);
    }

    pub(super) fn finish(mut self) -> TimelineReport {
        self.waits.finish(&mut self.report);
        self.report
    }
}
