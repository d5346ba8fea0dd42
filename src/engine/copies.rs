//! How many copies of one model to keep across its GPUs, from the requests
//! in flight for it. Pure: times come in as seconds from any fixed origin,
//! so the operator (wall clock) and `simulate` (trace time) share it.
//!
//! The signal is the model's requests in flight, held ones included,
//! summed over every router and sampled once a tick; its mean over
//! `window` gives the wanted copies, `ceil(mean / target_in_flight)`
//! within `[min, max]`:
//! - **up at once**, at most doubling in one step: a load takes a GPU's
//!   room for tens of seconds, and one spike must not evict eight GPUs'
//!   models before the first new copy has shown what it serves;
//! - **down one copy per `scale_down_delay`**, once the wanted count has
//!   stayed below the current one for that long and the last change is
//!   that long ago, so no copy is added and removed again within a delay;
//! - **never the last copy**: a model with one copy keeps it while it has
//!   traffic, and idleness unloads it as any model (keepAlive, LRU); and
//!   never a first copy: a model resident nowhere is loaded by its first
//!   request (the router's cold path), not by this policy.

use std::collections::VecDeque;

/// One model's scaling settings.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct CopyPolicy {
    /// The fewest copies kept while the model is resident at all.
    pub min: u32,
    /// The most copies (never more than the GPUs that list the model).
    pub max: u32,
    /// Requests in flight one copy is meant to carry.
    pub target_in_flight: f64,
    /// Seconds of samples the mean is taken over.
    pub window: f64,
    /// Seconds between two removals, and from an addition to a removal.
    pub scale_down_delay: f64,
}

impl Default for CopyPolicy {
    /// min 1, max unbounded (every GPU that lists the model), 100 in flight
    /// per copy (KubeAI's default target: a vLLM server batches up to 256
    /// sequences, and latency climbs well before that), a 30 s window (a
    /// ramp is seen within a window, where KubeAI's 10 min one takes
    /// minutes), a 120 s scale-down delay (twice a 60 s load: a copy is kept
    /// at least as long as two of its loads cost).
    fn default() -> Self {
        CopyPolicy {
            min: 1,
            max: u32::MAX,
            target_in_flight: 100.0,
            window: 30.0,
            scale_down_delay: 120.0,
        }
    }
}

impl CopyPolicy {
    /// The copies the mean `in_flight` asks for, within `[min, max]` and
    /// at least one.
    pub fn wanted(&self, in_flight: f64) -> u32 {
        let target = self.target_in_flight.max(f64::MIN_POSITIVE);
        let raw = (in_flight.max(0.0) / target).ceil();
        // `as` saturates: a huge mean is `u32::MAX`, clamped below.
        (raw as u32).clamp(self.min.max(1), self.max.max(self.min).max(1))
    }
}

/// What to do now.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Step {
    Hold,
    /// Add this many copies.
    Add(u32),
    /// Remove one copy.
    Remove,
}

/// One model's samples and the times of its changes.
#[derive(Clone, Debug, Default)]
pub struct CopyScaler {
    /// (time, in flight), oldest first, within the window.
    samples: VecDeque<(f64, f64)>,
    /// When copies were last added or removed.
    last_change: Option<f64>,
    /// Since when the wanted count has been below the current one.
    below_since: Option<f64>,
}

impl CopyScaler {
    /// Records `in_flight` at `now`; samples older than the window go.
    /// A clock that runs backwards drops the samples it passed.
    pub fn observe(&mut self, policy: &CopyPolicy, now: f64, in_flight: f64) {
        while self
            .samples
            .back()
            .is_some_and(|&(t, _)| t > now || !t.is_finite())
        {
            self.samples.pop_back();
        }
        self.samples.push_back((now, in_flight.max(0.0)));
        while self
            .samples
            .front()
            .is_some_and(|&(t, _)| now - t > policy.window)
        {
            self.samples.pop_front();
        }
    }

    /// The mean of the samples in the window (0 with none).
    pub fn mean(&self) -> f64 {
        if self.samples.is_empty() {
            return 0.0;
        }
        self.samples.iter().map(|&(_, n)| n).sum::<f64>() / self.samples.len() as f64
    }

    /// The step for a model with `current` copies (serving or loading) at
    /// `now`. It changes nothing: the caller says [`CopyScaler::changed`]
    /// once a step is carried out (an addition with no home to go to is
    /// not one).
    pub fn decide(&mut self, policy: &CopyPolicy, now: f64, current: u32) -> Step {
        if current == 0 {
            self.below_since = None;
            return Step::Hold;
        }
        let wanted = policy.wanted(self.mean());
        if wanted > current {
            self.below_since = None;
            return Step::Add((wanted - current).min(current));
        }
        if wanted == current || current <= 1 {
            self.below_since = None;
            return Step::Hold;
        }
        let since = *self.below_since.get_or_insert(now);
        let calm = |t: f64| now - t >= policy.scale_down_delay;
        if calm(since) && self.last_change.is_none_or(calm) {
            Step::Remove
        } else {
            Step::Hold
        }
    }

    /// A step was carried out at `now`: the next removal waits a delay.
    pub fn changed(&mut self, now: f64) {
        self.last_change = Some(now);
        self.below_since = None;
    }

    /// When copies last changed.
    pub fn last_change(&self) -> Option<f64> {
        self.last_change
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn policy() -> CopyPolicy {
        CopyPolicy {
            min: 1,
            max: 8,
            target_in_flight: 10.0,
            window: 10.0,
            scale_down_delay: 30.0,
        }
    }

    /// Feeds `in_flight` every second from `from` to `to` and carries out
    /// each step; the copies at the end, and every change as (time, copies).
    fn run(
        s: &mut CopyScaler,
        p: &CopyPolicy,
        copies: &mut u32,
        (from, to): (u32, u32),
        in_flight: f64,
    ) -> Vec<(u32, u32)> {
        let mut changes = Vec::new();
        for t in from..to {
            let now = f64::from(t);
            s.observe(p, now, in_flight);
            match s.decide(p, now, *copies) {
                Step::Hold => continue,
                Step::Add(n) => *copies += n,
                Step::Remove => *copies -= 1,
            }
            s.changed(now);
            changes.push((t, *copies));
        }
        changes
    }

    #[test]
    fn wanted_is_the_ceiling_within_min_and_max() {
        let p = policy();
        assert_eq!(p.wanted(0.0), 1);
        assert_eq!(p.wanted(10.0), 1);
        assert_eq!(p.wanted(10.5), 2);
        assert_eq!(p.wanted(1e12), 8);
        assert_eq!(p.wanted(f64::NAN), 1);
        let floor = CopyPolicy { min: 3, ..p };
        assert_eq!(floor.wanted(0.0), 3);
        // A max below min is min: the spec's checks refuse it; this stays sane.
        let odd = CopyPolicy {
            min: 4,
            max: 2,
            ..p
        };
        assert_eq!(odd.wanted(100.0), 4);
    }

    #[test]
    fn up_at_once_doubling_and_down_one_per_delay() {
        let (p, mut s, mut copies) = (policy(), CopyScaler::default(), 1);
        // 80 in flight: 8 wanted once the window's mean says so; each step
        // at most doubles.
        let up = run(&mut s, &p, &mut copies, (0, 20), 80.0);
        assert_eq!(up[..3], [(0, 2), (1, 4), (2, 8)]);
        assert_eq!(copies, 8);
        // Quiet: one copy less per 30 s, never the last one.
        let down = run(&mut s, &p, &mut copies, (20, 400), 0.0);
        let times: Vec<u32> = down.iter().map(|c| c.0).collect();
        assert_eq!(down.last().unwrap().1, 1, "{down:?}");
        assert_eq!(down.len(), 7, "{down:?}");
        for pair in times.windows(2) {
            assert!(pair[1] - pair[0] >= 30, "{down:?}");
        }
        // The first removal waits for the mean to fall and then a delay.
        assert!(times[0] >= 20 + 30, "{down:?}");
    }

    #[test]
    fn a_spike_within_the_delay_never_flaps() {
        let (p, mut s, mut copies) = (policy(), CopyScaler::default(), 1);
        let mut all = run(&mut s, &p, &mut copies, (0, 3), 25.0);
        // Load ebbs and flows around the threshold every few seconds.
        for k in 0..40 {
            let n = if k % 2 == 0 { 5.0 } else { 25.0 };
            all.extend(run(&mut s, &p, &mut copies, (3 + k * 4, 7 + k * 4), n));
        }
        // Every removal comes a delay or more after the change before it.
        let mut before = (0, 1);
        for &(t, c) in &all {
            if c < before.1 {
                assert!(t - before.0 >= 30, "{all:?}");
            }
            before = (t, c);
        }
        let direction_changes = all
            .windows(3)
            .filter(|w| (w[1].1 > w[0].1) != (w[2].1 > w[1].1))
            .count();
        assert!(direction_changes <= 2, "{all:?}");
    }

    #[test]
    fn nothing_is_added_to_a_model_resident_nowhere_and_the_last_copy_stays() {
        let (p, mut s) = (policy(), CopyScaler::default());
        s.observe(&p, 0.0, 500.0);
        assert_eq!(s.decide(&p, 0.0, 0), Step::Hold);
        let mut quiet = CopyScaler::default();
        for t in 0..1000 {
            quiet.observe(&p, f64::from(t), 0.0);
            assert_eq!(quiet.decide(&p, f64::from(t), 1), Step::Hold);
        }
    }

    #[test]
    fn a_clock_that_runs_backwards_drops_the_samples_it_passed() {
        let (p, mut s) = (policy(), CopyScaler::default());
        s.observe(&p, 100.0, 90.0);
        s.observe(&p, 5.0, 10.0);
        assert_eq!(s.mean(), 10.0);
    }
}
