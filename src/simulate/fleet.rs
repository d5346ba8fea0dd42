//! Several GPUs and copies of a model (`simulate --gpus N`): the same
//! engine per GPU, the router's rules for where a request goes, and the
//! operator's copy policy ([`crate::engine::copies`]) ticking over the
//! trace's time.
//!
//! What it models: each request is in flight for `service` seconds (plus
//! the load or wake it waited for); a model resident awake on several GPUs
//! serves on the one with the fewest in flight; one resident nowhere is
//! placed as the router places it (a GPU where it sleeps, else one where it
//! fits, the most free first, else the one whose evictions were used
//! longest ago). Every `tick` the copy policy sees each model's requests in
//! flight and adds copies (a wake, room, or idle models only: none in flight
//! on that GPU, none used there within the scale-down delay) or removes
//! one (the copy used longest ago: to sleep when it can, else unloaded, as
//! the operator retires it). What it leaves out: a copy's load is
//! counted (loads, wakes) but no request waits for it; a removed copy's
//! requests finish where they are.

use super::trace::{TraceError, TraceReader};
use crate::engine::copies::{CopyPolicy, CopyScaler, Step};
use crate::engine::{Admission, Engine, ModelId};
use serde::Serialize;
use std::collections::{BTreeMap, HashMap};

/// How the fleet runs.
#[derive(Clone, Copy, Debug)]
pub struct FleetOptions {
    pub gpus: usize,
    /// Seconds a request is in flight once its model serves it.
    pub service: f64,
    /// Seconds between two decisions of the copy policy.
    pub tick: f64,
    pub policy: CopyPolicy,
}

/// The outcome of a fleet replay. Field names are the `--output json` keys.
#[derive(Clone, Debug, Default, PartialEq, Serialize)]
pub struct FleetReport {
    pub gpus: usize,
    pub requests: u64,
    pub hits: u64,
    pub loads: u64,
    pub wakes: u64,
    pub sleeps: u64,
    pub evictions: u64,
    pub refusals: u64,
    /// Seconds requests waited: each load's load time and each wake's wake
    /// time, for the requests that caused them.
    pub wait_seconds: f64,
    pub copies_added: u64,
    pub copies_removed: u64,
    /// Per model: the most copies it had at once.
    pub most_copies: BTreeMap<String, usize>,
    /// Steps after which a GPU's used VRAM or host memory was over its
    /// budget: expected to stay 0.
    pub over_budget_steps: u64,
}

impl FleetReport {
    /// The table `simulate --output text` prints.
    pub fn to_text(&self) -> String {
        let mut rows = vec![
            ("gpus", self.gpus.to_string()),
            ("requests", self.requests.to_string()),
            ("hits", self.hits.to_string()),
            ("loads", self.loads.to_string()),
            ("wakes", self.wakes.to_string()),
            ("sleeps", self.sleeps.to_string()),
            ("evictions", self.evictions.to_string()),
            ("refusals", self.refusals.to_string()),
            ("waiting", format!("{:.1}s", self.wait_seconds)),
            ("copies added", self.copies_added.to_string()),
            ("copies removed", self.copies_removed.to_string()),
            ("over-budget steps", self.over_budget_steps.to_string()),
        ];
        let most: Vec<String> = self
            .most_copies
            .iter()
            .filter(|&(_, &n)| n > 1)
            .map(|(m, n)| format!("{m} {n}"))
            .collect();
        rows.push((
            "most copies",
            if most.is_empty() {
                "1 each".into()
            } else {
                most.join(", ")
            },
        ));
        rows.iter().map(|(k, v)| format!("{k:<18} {v}\n")).collect()
    }
}

/// The fleet as the replay goes.
struct Fleet {
    gpus: Vec<Engine>,
    options: FleetOptions,
    /// When each request in flight ends, per (GPU, model).
    in_flight: HashMap<(usize, ModelId), Vec<f64>>,
    last_use: HashMap<(usize, ModelId), f64>,
    scalers: HashMap<ModelId, CopyScaler>,
    report: FleetReport,
}

impl Fleet {
    fn count(&self, gpu: usize, id: ModelId, now: f64) -> usize {
        self.in_flight
            .get(&(gpu, id))
            .map_or(0, |ends| ends.iter().filter(|&&e| e > now).count())
    }

    fn total(&self, id: ModelId, now: f64) -> usize {
        (0..self.gpus.len()).map(|g| self.count(g, id, now)).sum()
    }

    /// The GPUs where `id` is resident and awake.
    fn holders(&self, id: ModelId) -> Vec<usize> {
        (0..self.gpus.len())
            .filter(|&g| self.gpus[g].is_resident(id) && !self.gpus[g].is_asleep(id))
            .collect()
    }

    /// Where a model with no awake copy goes (the router's rule), or a copy
    /// (the scaler's: never queued, idle victims only); `None`: nowhere.
    fn place(&self, id: ModelId, now: f64, copy: bool) -> Option<usize> {
        let mut best: Option<((u8, f64), usize)> = None;
        for (g, engine) in self.gpus.iter().enumerate() {
            if engine.is_resident(id) && !engine.is_asleep(id) {
                continue;
            }
            let Ok(Some(victims)) = engine.plan_load(id) else {
                continue;
            };
            let idle = |v: &ModelId| {
                self.count(g, *v, now) == 0
                    && self
                        .last_use
                        .get(&(g, *v))
                        .is_none_or(|&t| now - t >= self.options.policy.scale_down_delay)
            };
            if copy && !victims.iter().all(idle) {
                continue;
            }
            let newest = victims
                .iter()
                .filter_map(|v| self.last_use.get(&(g, *v)).copied())
                .fold(f64::NEG_INFINITY, f64::max);
            let rank = if engine.is_asleep(id) {
                (0, newest)
            } else if victims.is_empty() {
                (1, -((engine.budget() - engine.used()) as f64))
            } else {
                (2, newest)
            };
            if best.is_none_or(|(r, _)| rank < r) {
                best = Some((rank, g));
            }
        }
        best.map(|(_, g)| g)
    }

    /// A request for `id` on `gpu` at `now`: what it waited, or `None` when
    /// refused.
    fn serve_on(&mut self, gpu: usize, id: ModelId, now: f64) -> Option<f64> {
        let costs = self.gpus[gpu].costs(id);
        let waited = match self.gpus[gpu].request(id) {
            Admission::Hit | Admission::Queued { .. } => 0.0,
            Admission::Loaded { .. } => costs.load,
            Admission::Woken { .. } => costs.wake,
            Admission::Refused(_) => return None,
        };
        self.last_use.insert((gpu, id), now);
        Some(waited)
    }

    fn request(&mut self, id: ModelId, now: f64) {
        self.report.requests += 1;
        let holders = self.holders(id);
        let gpu = match holders.iter().min_by_key(|&&g| self.count(g, id, now)) {
            Some(&g) => {
                self.report.hits += 1;
                Some(g)
            }
            None => self.place(id, now, false),
        };
        let Some(gpu) = gpu else {
            self.report.refusals += 1;
            return;
        };
        match self.serve_on(gpu, id, now) {
            Some(waited) => {
                self.report.wait_seconds += waited;
                let ends = self.in_flight.entry((gpu, id)).or_default();
                ends.retain(|&e| e > now);
                ends.push(now + waited + self.options.service);
            }
            None => self.report.refusals += 1,
        }
    }

    /// One decision of the copy policy for every model seen.
    fn tick(&mut self, now: f64, models: &[ModelId]) {
        let policy = self.options.policy;
        for &id in models {
            let load = self.total(id, now) as f64;
            let copies = self.holders(id);
            let scaler = self.scalers.entry(id).or_default();
            scaler.observe(&policy, now, load);
            let done = match scaler.decide(&policy, now, copies.len() as u32) {
                Step::Hold => false,
                Step::Add(n) => (0..n).fold(false, |added, _| match self.place(id, now, true) {
                    Some(g) if self.serve_on(g, id, now).is_some() => {
                        self.report.copies_added += 1;
                        true
                    }
                    _ => added,
                }),
                Step::Remove => {
                    let oldest = copies.iter().copied().min_by(|&a, &b| {
                        let t = |g| self.last_use.get(&(g, id)).copied().unwrap_or(0.0);
                        t(a).total_cmp(&t(b))
                    });
                    oldest.is_some_and(|g| {
                        self.report.copies_removed += 1;
                        // As the operator retires it: to sleep when it
                        // can, else unloaded.
                        let gpu = &mut self.gpus[g];
                        gpu.retire(id).is_some() || gpu.unload(id)
                    })
                }
            };
            if done {
                self.scalers
                    .get_mut(&id)
                    .expect("entered above")
                    .changed(now);
            }
            let (name, now_held) = (self.gpus[0].name(id).to_owned(), self.holders(id).len());
            let most = self.report.most_copies.entry(name).or_default();
            *most = (*most).max(now_held);
        }
    }

    fn check_budgets(&mut self) {
        let over = self
            .gpus
            .iter()
            .any(|e| e.used() > e.budget() || e.host_used() > e.host_budget());
        if over {
            self.report.over_budget_steps += 1;
        }
    }
}

/// Replays a trace over `options.gpus` copies of `template` (its budget,
/// registry, eviction and warm tier). Every model must be in the registry
/// (a row's size must match it: the GPUs share one registry).
pub fn replay_fleet(
    template: &Engine,
    trace: &mut TraceReader,
    options: FleetOptions,
) -> Result<FleetReport, TraceError> {
    let mut fleet = Fleet {
        gpus: vec![template.clone(); options.gpus.max(1)],
        options,
        in_flight: HashMap::new(),
        last_use: HashMap::new(),
        scalers: HashMap::new(),
        report: FleetReport {
            gpus: options.gpus.max(1),
            ..FleetReport::default()
        },
    };
    let mut models: Vec<ModelId> = Vec::new();
    let mut next_tick: Option<f64> = None;
    loop {
        let (now, found) = {
            let Some(row) = trace.next_row()? else { break };
            let found = template.id(row.model).ok_or_else(|| {
                format!(
                    "model {:?} is not in the registry (with --gpus every model must be)",
                    row.model
                )
            });
            (row.time, found)
        };
        let id = found.map_err(|problem| trace.error(problem))?;
        if !models.contains(&id) {
            models.push(id);
        }
        let mut at = *next_tick.get_or_insert(now);
        while at <= now {
            fleet.tick(at, &models);
            at += options.tick;
        }
        next_tick = Some(at);
        fleet.request(id, now);
        fleet.check_budgets();
    }
    for e in &fleet.gpus {
        let c = e.counters();
        fleet.report.loads += c.loads;
        fleet.report.wakes += c.wakes;
        fleet.report.sleeps += c.sleeps;
        fleet.report.evictions += c.evictions;
    }
    Ok(fleet.report)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::engine::Costs;
    use std::fmt::Write;

    const GIB: u64 = 1 << 30;

    /// Four models of 8 GiB on GPUs of 16 GiB, loads of 60 s.
    fn template() -> Engine {
        let mut e = Engine::new(16 * GIB);
        for m in ["chat", "a", "b", "c"] {
            let id = e.register(m, 8 * GIB, false).unwrap();
            e.set_costs(
                id,
                Costs {
                    load: 60.0,
                    wake: 3.0,
                },
            );
        }
        e
    }

    /// `chat` at `rate` per second from 0 to `until`, then one request a
    /// minute for an hour; a, b and c once a minute throughout.
    fn trace(rate: u32, until: u32) -> TraceReader {
        let mut text = String::from("time,model\n");
        let mut rows: Vec<(f64, &str)> = Vec::new();
        for s in 0..until {
            for k in 0..rate {
                rows.push((f64::from(s) + f64::from(k) / f64::from(rate), "chat"));
            }
        }
        for m in 0..(until / 60 + 60) {
            let t = f64::from(m * 60);
            rows.push((t + 0.5, "a"));
            rows.push((t + 20.5, "b"));
            rows.push((t + 40.5, "c"));
            if t >= f64::from(until) {
                rows.push((t + 10.5, "chat"));
            }
        }
        rows.sort_by(|x, y| x.0.total_cmp(&y.0));
        for (t, m) in rows {
            writeln!(text, "{t},{m}").unwrap();
        }
        TraceReader::from_reader(Box::new(std::io::Cursor::new(text.into_bytes())), "test")
    }

    fn options(gpus: usize) -> FleetOptions {
        FleetOptions {
            gpus,
            service: 2.0,
            tick: 5.0,
            policy: CopyPolicy {
                target_in_flight: 10.0,
                window: 30.0,
                scale_down_delay: 120.0,
                ..CopyPolicy::default()
            },
        }
    }

    #[test]
    fn a_hot_model_gets_copies_within_budgets_and_loses_them_when_it_cools() {
        // 20 a second for 10 minutes, 2 s each: 40 in flight, 4 copies.
        let report = replay_fleet(&template(), &mut trace(20, 600), options(4)).unwrap();
        assert_eq!(report.over_budget_steps, 0, "{report:?}");
        assert_eq!(report.most_copies["chat"], 4, "{report:?}");
        // Down to one again, one removal per delay, nothing removed twice.
        assert_eq!(report.copies_added, 3, "{report:?}");
        assert_eq!(report.copies_removed, 3, "{report:?}");
        assert_eq!(report.refusals, 0);
    }

    #[test]
    fn one_gpu_has_one_copy_and_the_same_requests() {
        let report = replay_fleet(&template(), &mut trace(20, 600), options(1)).unwrap();
        assert_eq!(report.most_copies["chat"], 1);
        assert_eq!(report.copies_added, 0);
        let four = replay_fleet(&template(), &mut trace(20, 600), options(4)).unwrap();
        assert_eq!(report.requests, four.requests);
    }

    #[test]
    fn a_model_outside_the_registry_is_an_error_at_its_line() {
        let text = "time,model\n0,chat\n1,nope\n";
        let mut t = TraceReader::from_reader(
            Box::new(std::io::Cursor::new(text.as_bytes().to_vec())),
            "t.csv",
        );
        let e = replay_fleet(&template(), &mut t, options(2)).unwrap_err();
        assert_eq!(e.line, 3, "{e}");
        assert!(
            e.to_string().contains("\"nope\" is not in the registry"),
            "{e}"
        );
    }
}
