//! Requests in time on several GPUs (#69): each load and wake takes its
//! model's declared seconds, a request waits for what it needs to finish,
//! and work can be done ahead of demand. The arrivals are timed (ServeGen's
//! series drawn by [`super::servegen`]), each model is declared on one GPU
//! (model `i` on GPU `i mod gpus`, a residency per GPU as the operator
//! runs them), and four policies are compared on the same arrivals:
//!
//! - `lru`: the seed's policy, reacting to requests;
//! - `rate`: the `rate` eviction with the warm tier (models sleep to host
//!   memory instead of leaving): today's best online policy;
//! - `anticipate`: `rate` and the warm tier, plus the engine's work ahead
//!   of demand ([`crate::engine::anticipation`]) from each model's
//!   [`Forecast`], learnt from the requests as they come, looked at every
//!   `tick` seconds;
//! - `clairvoyant`: the reference at the limit. It knows every future
//!   arrival: a request that must make room evicts the model needed
//!   farthest ahead, and after every request and at every tick each GPU
//!   loads the model needed soonest whenever it has room, or can make room
//!   by evicting models needed later than it. No warm tier (each load is a
//!   full load): it bounds what knowing the future is worth, not what
//!   sleeping is.
//!
//! What it leaves out: loads on one GPU run side by side (no shared disk
//! or PCIe bandwidth); a request queued behind loads waits until the
//! earliest finishes and the GPU's state moves to that time for it (the
//! next arrivals there see it); a request is served the moment its model
//! is ready (service time is not modelled: only waiting for models is).

use super::clairvoyant::Clairvoyant;
use super::servegen::Arrival;
use super::tally::Tally;
use crate::engine::anticipation::{Limits, Outlook, plan};
use crate::engine::forecast::Forecast;
use crate::engine::{Admission, Bytes, Costs, Engine, Eviction, ModelId, Sleep};
use serde::Serialize;
use std::collections::HashMap;

/// One model as the replay declares it.
#[derive(Clone, Debug, PartialEq)]
pub struct ModelSpec {
    pub name: String,
    pub size: Bytes,
    /// Seconds a cold load takes, and a wake.
    pub load: f64,
    pub wake: f64,
    /// What it keeps in VRAM asleep, and in host memory.
    pub sleeping_size: Bytes,
    pub host_memory: Bytes,
}

/// A replay's policy.
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum Policy {
    Lru,
    Rate,
    Anticipate(Limits),
    Clairvoyant,
}

impl Policy {
    pub fn name(&self) -> &'static str {
        match self {
            Policy::Lru => "lru",
            Policy::Rate => "rate+warm",
            Policy::Anticipate(_) => "anticipate",
            Policy::Clairvoyant => "clairvoyant+preload",
        }
    }
}

/// How the GPUs are set up.
#[derive(Clone, Debug)]
pub struct Setup {
    pub gpus: usize,
    /// Each GPU's VRAM budget, and its host memory for sleeping models
    /// (0: no warm tier; `lru` never sleeps).
    pub budget: Bytes,
    pub host_budget: Bytes,
    pub models: Vec<ModelSpec>,
    /// Seconds between two looks ahead (anticipation, clairvoyant preload).
    pub tick: f64,
    /// A model silent this long before a request: that request is a
    /// return after a quiet period.
    pub quiet: f64,
    /// Idle unload (`spec.keepAlive`): a resident model not asked for this
    /// long is unloaded at the next look (asleep or awake, as the operator
    /// does); `None`: models stay until evicted.
    pub keep_alive: Option<f64>,
}

/// What a replay measured. Requests are counted at their weight (the
/// requests each drawn arrival stands for).
#[derive(Clone, Debug, Default, PartialEq, Serialize)]
pub struct TimelineReport {
    pub policy: String,
    pub requests: f64,
    /// Arrivals drawn (each of `weight` requests).
    pub drawn: u64,
    pub p50_wait: f64,
    pub p99_wait: f64,
    /// At 2.9 billion requests, 99% are hits under every policy: the
    /// 99.9th and 99.99th percentiles show the waits.
    pub p999_wait: f64,
    pub p9999_wait: f64,
    pub mean_wait: f64,
    /// Shares of requests served within 1 s and within 10 s.
    pub within_1s: f64,
    pub within_10s: f64,
    pub loads: u64,
    pub wakes: u64,
    pub evictions: u64,
    pub refused: f64,
    /// GPU time spent loading and waking, in seconds.
    pub load_seconds: f64,
    /// VRAM held by resident models over the replay, in GiB-hours.
    pub resident_gib_hours: f64,
    /// Bytes brought into VRAM (loads in full, wakes what they add).
    pub bytes_moved: u128,
    /// Work ahead of demand: loads and wakes made, those a request used
    /// while the model was still there, those evicted or put to sleep
    /// unused (the rest were still waiting at the end).
    pub ahead_loads: u64,
    pub ahead_wakes: u64,
    pub ahead_used: u64,
    pub ahead_wasted: u64,
    /// Requests after a quiet period, and those served without waiting;
    /// the same for those whose model was also used the day before within
    /// half an hour of that time (a daily pattern).
    pub quiet_returns: u64,
    pub quiet_hits: u64,
    pub daily_returns: u64,
    pub daily_hits: u64,
    /// Steps after which a GPU held more than its budget (expected 0).
    pub over_budget_steps: u64,
    /// Models unloaded idle (keep-alive), and those anticipation kept
    /// past it (counted at each look that kept one).
    pub idle_unloads: u64,
    pub kept_past_idle: u64,
}

impl TimelineReport {
    /// Waiting in all, request-seconds.
    pub fn wait_total(&self) -> f64 {
        self.mean_wait * self.requests
    }

    /// The share of work ahead of demand that was evicted unused.
    pub fn wasted_share(&self) -> f64 {
        let made = (self.ahead_loads + self.ahead_wakes) as f64;
        if made == 0.0 {
            0.0
        } else {
            self.ahead_wasted as f64 / made
        }
    }
}

/// Replays `arrivals` (in time order) under `policy`.
pub fn replay(setup: &Setup, policy: Policy, arrivals: &[Arrival]) -> TimelineReport {
    let mut report = match policy {
        Policy::Clairvoyant => Clairvoyant::new(setup, arrivals).run(),
        _ => Engines::new(setup, policy).run(arrivals),
    };
    report.policy = policy.name().to_owned();
    report
}

/// One GPU under an engine policy.
struct Gpu {
    engine: Engine,
    /// Loading (or waking) models and when they are ready.
    ready_at: HashMap<ModelId, f64>,
    /// Models brought in ahead of demand and not used yet.
    ahead: HashMap<ModelId, ()>,
    /// When each model was last asked for (or brought in ahead).
    last_use: HashMap<ModelId, f64>,
    /// The replay's model index of each engine id.
    models: Vec<usize>,
}

/// The engine policies: a [`Gpu`] each.
struct Engines<'s> {
    setup: &'s Setup,
    policy: Policy,
    gpus: Vec<Gpu>,
    /// Each model's GPU and id there.
    place: Vec<(usize, ModelId)>,
    forecasts: Vec<Forecast>,
    tally: Tally<'s>,
}

/// One GPU's models as the forecasts see them at one time.
struct GpuOutlook<'a> {
    forecasts: &'a [Forecast],
    models: &'a [usize],
    now: f64,
}

impl Outlook for GpuOutlook<'_> {
    fn chance_within(&self, id: ModelId, seconds: f64) -> f64 {
        self.forecasts[self.models[id.index()]].chance_within(self.now, seconds)
    }
}

impl<'s> Engines<'s> {
    fn new(setup: &'s Setup, policy: Policy) -> Self {
        let warm = policy != Policy::Lru && setup.host_budget > 0;
        let mut gpus: Vec<Gpu> = (0..setup.gpus)
            .map(|_| {
                let mut engine = Engine::new(setup.budget);
                if policy != Policy::Lru {
                    engine.set_eviction(Eviction::Rate);
                }
                if warm {
                    engine.set_host_budget(setup.host_budget);
                }
                Gpu {
                    engine,
                    ready_at: HashMap::new(),
                    ahead: HashMap::new(),
                    last_use: HashMap::new(),
                    models: Vec::new(),
                }
            })
            .collect();
        let place = setup
            .models
            .iter()
            .enumerate()
            .map(|(i, m)| {
                let g = i % setup.gpus;
                let gpu = &mut gpus[g];
                let id = gpu
                    .engine
                    .register(&m.name, m.size, false)
                    .expect("a model's name and size");
                gpu.engine.set_costs(
                    id,
                    Costs {
                        load: m.load,
                        wake: m.wake,
                    },
                );
                if warm {
                    let sleep = Sleep {
                        sleeping_size: m.sleeping_size,
                        host_memory: m.host_memory,
                    };
                    let _ = gpu.engine.set_sleep(id, Some(sleep));
                }
                gpu.models.push(i);
                (g, id)
            })
            .collect();
        Engines {
            setup,
            policy,
            gpus,
            place,
            forecasts: vec![Forecast::default(); setup.models.len()],
            tally: Tally::new(setup),
        }
    }

    fn run(mut self, arrivals: &[Arrival]) -> TimelineReport {
        let mut next_tick = arrivals.first().map_or(0.0, |a| a.time);
        for a in arrivals {
            while next_tick <= a.time {
                self.tick(next_tick);
                next_tick += self.setup.tick;
            }
            self.request(a);
        }
        let end = arrivals.last().map_or(0.0, |a| a.time);
        for g in 0..self.gpus.len() {
            let used = self.gpus[g].engine.used();
            self.tally.resident(g, used, end);
        }
        self.tally.finish()
    }

    /// Loads and wakes on GPU `g` finished by `t`.
    fn finish_loads(&mut self, g: usize, t: f64) {
        let gpu = &mut self.gpus[g];
        let done: Vec<ModelId> = gpu
            .ready_at
            .iter()
            .filter(|(_, r)| **r <= t)
            .map(|(id, _)| *id)
            .collect();
        for id in done {
            gpu.ready_at.remove(&id);
            gpu.engine.set_loading(id, false);
        }
    }

    /// After an admission on `g`: what left (evicted or put to sleep) and
    /// what came in (`id`, taking `seconds`, from `now`).
    fn admitted(
        &mut self,
        g: usize,
        id: ModelId,
        evicted: Vec<ModelId>,
        now: f64,
        seconds: f64,
        wake: bool,
    ) {
        let gpu = &mut self.gpus[g];
        let slept = gpu.engine.last_slept().to_vec();
        for v in evicted.iter().chain(&slept) {
            if gpu.ahead.remove(v).is_some() {
                self.tally.report.ahead_wasted += 1;
            }
        }
        self.tally.report.evictions += evicted.len() as u64;
        gpu.engine.set_loading(id, true);
        gpu.ready_at.insert(id, now + seconds);
        let spec = &self.setup.models[gpu.models[id.index()]];
        self.tally.report.load_seconds += seconds;
        self.tally.report.bytes_moved += if wake {
            (spec.size - spec.sleeping_size) as u128
        } else {
            spec.size as u128
        };
        if wake {
            self.tally.report.wakes += 1;
        } else {
            self.tally.report.loads += 1;
        }
        if gpu.engine.used() > gpu.engine.budget() {
            self.tally.report.over_budget_steps += 1;
        }
    }

    fn request(&mut self, a: &Arrival) {
        let m = a.model as usize;
        let (g, id) = self.place[m];
        self.forecasts[m].request(a.time);
        self.gpus[g].last_use.insert(id, a.time);
        let used = self.gpus[g].engine.used();
        self.tally.resident(g, used, a.time);
        self.finish_loads(g, a.time);
        let spec = &self.setup.models[m];
        let (load, wake) = (spec.load, spec.wake);
        let mut now = a.time;
        let wait = loop {
            let gpu = &mut self.gpus[g];
            if gpu.ahead.remove(&id).is_some() {
                self.tally.report.ahead_used += 1;
            }
            let admission = match gpu.engine.request(id) {
                Admission::Hit => None,
                Admission::Loaded { evicted } => Some((evicted.to_vec(), load, false)),
                Admission::Woken { evicted } => Some((evicted.to_vec(), wake, true)),
                Admission::Queued { .. } => {
                    // Behind loads: wait for the earliest to finish.
                    let Some(next) = gpu.ready_at.values().copied().reduce(f64::min) else {
                        self.tally.report.refused += a.weight as f64;
                        return;
                    };
                    now = now.max(next);
                    self.finish_loads(g, now);
                    continue;
                }
                Admission::Refused(_) => {
                    self.tally.report.refused += a.weight as f64;
                    return;
                }
            };
            match admission {
                None => {
                    let ready = gpu.ready_at.get(&id).copied().unwrap_or(now);
                    break ready.max(now) - a.time;
                }
                Some((evicted, seconds, woke)) => {
                    self.admitted(g, id, evicted, now, seconds, woke);
                    break now + seconds - a.time;
                }
            }
        };
        self.tally.served(a, wait);
    }

    /// Idle unloads at `t` on GPU `g`: a model idle for the keep-alive is
    /// unloaded, unless anticipation expects it within its horizon (it is
    /// kept past its idle unload).
    fn idle_unloads(&mut self, g: usize, t: f64) {
        let Some(keep_alive) = self.setup.keep_alive else {
            return;
        };
        let gpu = &mut self.gpus[g];
        for id in gpu.engine.residents() {
            let idle = gpu.last_use.get(&id).is_none_or(|u| u + keep_alive <= t);
            if !idle || gpu.ready_at.contains_key(&id) || gpu.engine.is_pinned(id) {
                continue;
            }
            if let Policy::Anticipate(limits) = self.policy {
                let m = gpu.models[id.index()];
                let spec = &self.setup.models[m];
                if keeps(&self.forecasts[m], &limits, t, spec.load) {
                    self.tally.report.kept_past_idle += 1;
                    continue;
                }
            }
            gpu.engine.unload(id);
            self.tally.report.idle_unloads += 1;
            if gpu.ahead.remove(&id).is_some() {
                self.tally.report.ahead_wasted += 1;
            }
        }
    }

    /// A look at `t` on every GPU: idle unloads, and work ahead
    /// (anticipation only).
    fn tick(&mut self, t: f64) {
        for f in &mut self.forecasts {
            f.advance(t);
        }
        for g in 0..self.gpus.len() {
            self.finish_loads(g, t);
            let used = self.gpus[g].engine.used();
            self.tally.resident(g, used, t);
            self.idle_unloads(g, t);
        }
        let Policy::Anticipate(limits) = self.policy else {
            return;
        };
        for g in 0..self.gpus.len() {
            let gpu = &self.gpus[g];
            let in_flight = gpu
                .ahead
                .keys()
                .filter(|id| gpu.ready_at.contains_key(id))
                .count();
            let outlook = GpuOutlook {
                forecasts: &self.forecasts,
                models: &gpu.models,
                now: t,
            };
            let moves = plan(&gpu.engine, &outlook, &limits, in_flight);
            for mv in moves {
                let gpu = &mut self.gpus[g];
                let spec = &self.setup.models[gpu.models[mv.id.index()]];
                let (load, wake) = (spec.load, spec.wake);
                let evicted = match gpu.engine.anticipate(mv.id) {
                    Admission::Loaded { evicted } | Admission::Woken { evicted } => {
                        evicted.to_vec()
                    }
                    _ => continue,
                };
                let used = gpu.engine.used();
                self.tally.resident(g, used, t);
                self.admitted(
                    g,
                    mv.id,
                    evicted,
                    t,
                    if mv.wake { wake } else { load },
                    mv.wake,
                );
                let gpu = &mut self.gpus[g];
                gpu.ahead.insert(mv.id, ());
                gpu.last_use.insert(mv.id, t);
                if mv.wake {
                    self.tally.report.ahead_wakes += 1;
                } else {
                    self.tally.report.ahead_loads += 1;
                }
            }
        }
    }
}

/// Whether anticipation keeps a model past its idle unload: its chance
/// of a request within the horizon a move would look at is at least half
/// what a move needs (below what brings a model in, so that a model is
/// not unloaded and brought back at every other look).
fn keeps(f: &Forecast, limits: &Limits, t: f64, load: f64) -> bool {
    let horizon = limits.hold.max(load + limits.ahead);
    f.chance_within(t, horizon) >= limits.min_chance / 2.0
}

/// The models a ServeGen replay declares, as `simulate --servegen` and
/// `cargo bench --bench anticipation` state them: `n` models whose sizes
/// cycle through 4, 8, 12 and 20 GiB (small to mid-sized models) across
/// each GPU's models (model `i` on GPU `i mod gpus` is the
/// `(i / gpus) mod 4`-th size: every GPU gets every size), a load
/// of 10 s plus 2 s per GiB (18-50 s: weights from a node's disk), a wake
/// of 1 s plus 0.1 s per GiB; asleep each keeps 512 MiB of VRAM and its
/// full size in host memory.
pub fn servegen_models(n: usize, gpus: usize) -> Vec<ModelSpec> {
    const GIB: Bytes = 1 << 30;
    (0..n)
        .map(|i| {
            let gib = [2u64, 4, 6, 8][(i / gpus.max(1)) % 4];
            ModelSpec {
                name: format!("m{i}"),
                size: gib * GIB,
                load: 10.0 + 2.0 * gib as f64,
                wake: 1.0 + 0.1 * gib as f64,
                sleeping_size: GIB / 2,
                host_memory: gib * GIB,
            }
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    const GIB: Bytes = 1 << 30;

    fn setup(models: usize, size_gib: u64) -> Setup {
        Setup {
            gpus: 1,
            budget: 40 * GIB,
            host_budget: 64 * GIB,
            models: (0..models)
                .map(|i| ModelSpec {
                    name: format!("m{i}"),
                    size: size_gib * GIB,
                    load: 30.0,
                    wake: 2.0,
                    sleeping_size: GIB / 2,
                    host_memory: size_gib * GIB,
                })
                .collect(),
            tick: 60.0,
            quiet: 3600.0,
            keep_alive: None,
        }
    }

    fn at(time: f64, model: u32) -> Arrival {
        Arrival {
            time,
            model,
            weight: 1.0,
        }
    }

    #[test]
    fn a_request_during_a_load_waits_for_what_is_left_of_it() {
        let s = setup(1, 10);
        let r = replay(&s, Policy::Lru, &[at(0.0, 0), at(10.0, 0), at(40.0, 0)]);
        assert_eq!(r.loads, 1);
        assert_eq!(r.mean_wait, (30.0 + 20.0) / 3.0);
        assert_eq!(r.p50_wait, 20.0);
        assert!((r.within_1s - 1.0 / 3.0).abs() < 1e-9);
        assert_eq!(r.over_budget_steps, 0);
    }

    #[test]
    fn a_model_back_each_morning_is_loaded_before_it_comes_by_anticipation() {
        // Two 30Gi models on a 40Gi GPU: m0 every morning at 9:00 for 10
        // minutes, m1 busy all day in between.
        let s = setup(2, 30);
        let mut arrivals = Vec::new();
        for d in 0..10 {
            let day = d as f64 * 86_400.0;
            for k in 0..10 {
                arrivals.push(at(day + 9.0 * 3600.0 + k as f64 * 60.0, 0));
            }
            for k in 0..40 {
                arrivals.push(at(day + 12.0 * 3600.0 + k as f64 * 60.0, 1));
            }
        }
        let rate = replay(&s, Policy::Rate, &arrivals);
        let ahead = replay(&s, Policy::Anticipate(Limits::default()), &arrivals);
        let best = replay(&s, Policy::Clairvoyant, &arrivals);
        // Each model's first request is no return: 2 x 9.
        assert_eq!(rate.quiet_returns, 18);
        // Reacting, every return waits (a wake at best).
        assert_eq!(rate.quiet_hits, 0);
        // Learnt after a few days, the mornings are ready.
        assert!(ahead.daily_hits >= 12, "{ahead:?}");
        assert!(ahead.wait_total() < rate.wait_total(), "{ahead:?} {rate:?}");
        assert!(best.wait_total() <= ahead.wait_total());
        assert!(best.quiet_hits >= 17, "{best:?}");
        for r in [&rate, &ahead, &best] {
            assert_eq!(r.over_budget_steps, 0);
        }
    }

    #[test]
    fn the_same_arrivals_replay_the_same() {
        let s = setup(3, 15);
        let arrivals: Vec<_> = (0..500)
            .map(|i| at(i as f64 * 97.0, (i * 7 % 3) as u32))
            .collect();
        for p in [
            Policy::Lru,
            Policy::Rate,
            Policy::Anticipate(Limits::default()),
            Policy::Clairvoyant,
        ] {
            assert_eq!(replay(&s, p, &arrivals), replay(&s, p, &arrivals));
        }
    }
}
