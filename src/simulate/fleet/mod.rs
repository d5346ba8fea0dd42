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
//!
//! Gangs (`--gang NAME=N`): a model that spans N GPUs at once, placed and
//! evicted all or nothing by [`crate::engine::gangs`] (its size is what it
//! holds on each); it waits for its load once. A gang has one copy: the
//! copy policy leaves it alone. `--dedicated` gives each gang GPUs of its
//! own (the first N, then the next) that nothing else may use, and the
//! single models the rest: what a system without shared budgets does.
//!
//! GPUs that fail or go to maintenance (`--gpu-failure`,
//! `--gpu-maintenance`): [`outages`].

mod outages;
pub use outages::{Outage, parse_failure, parse_maintenance};

use super::trace::{TraceError, TraceReader};
use crate::engine::copies::{CopyPolicy, CopyScaler, Step};
use crate::engine::gangs::{NodeAdmission, NodeGpus};
use crate::engine::{Engine, ModelId};
use serde::Serialize;
use std::collections::{BTreeMap, HashMap};

/// How the fleet runs.
#[derive(Clone, Debug)]
pub struct FleetOptions {
    pub gpus: usize,
    /// Seconds a request is in flight once its model serves it.
    pub service: f64,
    /// Seconds between two decisions of the copy policy.
    pub tick: f64,
    pub policy: CopyPolicy,
    /// Each gang's GPUs its own (the rest for the single models).
    pub dedicated: bool,
    /// GPUs that fail or go to maintenance, and whether hot models are
    /// moved off a GPU in maintenance before it goes.
    pub outages: Vec<Outage>,
    pub pre_move: bool,
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
    /// Each GPU's most VRAM held at once, in bytes.
    pub peaks: Vec<u64>,
    /// Seconds requests for gangs waited (part of `wait_seconds`).
    pub gang_wait_seconds: f64,
    /// With outages: requests in flight on a GPU when it went, and
    /// models loaded elsewhere before their GPU went (the pre-move).
    pub failed_requests: u64,
    pub moved_ahead: u64,
    pub outages: usize,
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
            (
                "peak per GPU",
                self.peaks
                    .iter()
                    .map(|&p| crate::quantity::format_bytes(p))
                    .collect::<Vec<_>>()
                    .join(", "),
            ),
        ];
        if self.gang_wait_seconds > 0.0 {
            rows.insert(
                9,
                ("gangs waiting", format!("{:.1}s", self.gang_wait_seconds)),
            );
        }
        if self.outages > 0 {
            rows.push(("failed requests", self.failed_requests.to_string()));
            rows.push(("moved ahead", self.moved_ahead.to_string()));
        }
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
    node: NodeGpus,
    /// The registry every GPU's started from: names and costs by id.
    template: Engine,
    options: FleetOptions,
    /// When each request in flight ends, per (GPU, model).
    in_flight: HashMap<(usize, ModelId), Vec<f64>>,
    last_use: HashMap<(usize, ModelId), f64>,
    scalers: HashMap<ModelId, CopyScaler>,
    report: FleetReport,
    /// Each GPU's state through its outages.
    states: Vec<outages::GpuState>,
}

impl Fleet {
    fn count(&self, gpu: usize, id: ModelId, now: f64) -> usize {
        self.in_flight
            .get(&(gpu, id))
            .map_or(0, |ends| ends.iter().filter(|&&e| e > now).count())
    }

    fn total(&self, id: ModelId, now: f64) -> usize {
        (0..self.gpus().len()).map(|g| self.count(g, id, now)).sum()
    }

    fn gpus(&self) -> &[Engine] {
        self.node.gpus()
    }

    /// The GPUs where `id` is resident and awake (it is registered there:
    /// with `--dedicated` a GPU registers only some models).
    fn holders(&self, id: ModelId) -> Vec<usize> {
        (0..self.gpus().len())
            .filter(|&g| {
                let e = &self.gpus()[g];
                self.states[g] != outages::GpuState::Gone
                    && registered(e, id)
                    && e.is_resident(id)
                    && !e.is_asleep(id)
            })
            .collect()
    }

    /// Where a model with no awake copy goes (the router's rule), or a copy
    /// (the scaler's: never queued, idle victims only); `None`: nowhere.
    fn place(&self, id: ModelId, now: f64, copy: bool) -> Option<usize> {
        let mut best: Option<((u8, f64), usize)> = None;
        for (g, engine) in self.gpus().iter().enumerate() {
            if self.states[g] != outages::GpuState::Up
                || !registered(engine, id)
                || (engine.is_resident(id) && !engine.is_asleep(id))
            {
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

    /// A request for `id` on `gpu` (a gang: on the GPUs the node picks) at
    /// `now`: where it is served and what it waited, or `None` when
    /// refused.
    fn serve_on(&mut self, gpu: usize, id: ModelId, now: f64) -> Option<(usize, f64)> {
        let name = self.template.name(id).to_owned();
        let costs = self.template.costs(id);
        let (gpus, waited) = match self.node.request(gpu, &name) {
            NodeAdmission::Hit { gpus } => (gpus, 0.0),
            NodeAdmission::Loaded { gpus, .. } => (gpus, costs.load),
            NodeAdmission::Woken { gpus, .. } => (gpus, costs.wake),
            NodeAdmission::Queued => (vec![gpu], 0.0),
            NodeAdmission::Refused(_) | NodeAdmission::GangRefused(_) => return None,
        };
        for &g in &gpus {
            self.last_use.insert((g, id), now);
        }
        Some((gpus[0], waited))
    }

    fn request(&mut self, id: ModelId, now: f64) {
        self.report.requests += 1;
        let name = self.template.name(id).to_owned();
        let gang = self.node.width(&name).is_some();
        let gpu = if gang {
            // The node places it (and counts a hit as one).
            let members = self.node.members(&name);
            if members.iter().all(|&g| !self.gpus()[g].is_asleep(id)) && !members.is_empty() {
                self.report.hits += 1;
            }
            Some(0)
        } else {
            let holders = self.holders(id);
            // A GPU that takes no new models serves only while no other
            // copy can (the router's rule).
            let leaving = |g: usize| self.states[g] != outages::GpuState::Up;
            match holders
                .iter()
                .min_by_key(|&&g| (leaving(g), self.count(g, id, now)))
            {
                Some(&g) => {
                    self.report.hits += 1;
                    Some(g)
                }
                None => self.place(id, now, false),
            }
        };
        let Some(gpu) = gpu else {
            self.report.refusals += 1;
            return;
        };
        match self.serve_on(gpu, id, now) {
            Some((at, waited)) => {
                self.report.wait_seconds += waited;
                if gang {
                    self.report.gang_wait_seconds += waited;
                }
                let ends = self.in_flight.entry((at, id)).or_default();
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
            if self.node.width(self.template.name(id)).is_some() {
                continue; // a gang has one copy
            }
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
                    // A copy on a GPU that is going first (the operator's
                    // rule), then the one used longest ago.
                    let oldest = copies.iter().copied().min_by(|&a, &b| {
                        let t = |g| self.last_use.get(&(g, id)).copied().unwrap_or(0.0);
                        let up = |g: usize| self.states[g] == outages::GpuState::Up;
                        up(a).cmp(&up(b)).then(t(a).total_cmp(&t(b)))
                    });
                    oldest.is_some_and(|g| {
                        self.report.copies_removed += 1;
                        // As the operator retires it: to sleep when it
                        // can, else unloaded.
                        let name = self.template.name(id).to_owned();
                        self.node.retire(g, &name) || self.node.unload_on(g, &name)
                    })
                }
            };
            if done {
                self.scalers
                    .get_mut(&id)
                    .expect("entered above")
                    .changed(now);
            }
            let (name, now_held) = (self.template.name(id).to_owned(), self.holders(id).len());
            let most = self.report.most_copies.entry(name).or_default();
            *most = (*most).max(now_held);
        }
    }

    fn check_budgets(&mut self) {
        let over = self
            .gpus()
            .iter()
            .any(|e| e.used() > e.budget() || e.host_used() > e.host_budget());
        if over {
            self.report.over_budget_steps += 1;
        }
    }
}

/// Whether `id` (an id of the template every GPU's registry started from)
/// is registered on `e`.
fn registered(e: &Engine, id: ModelId) -> bool {
    e.is_registered(id)
}

/// Replays a trace over `options.gpus` copies of `template` (its budget,
/// registry, eviction and warm tier), with `gangs` (name, GPUs) spanning
/// several of them. Every model must be in the registry (a row's size
/// must match it: the GPUs share one registry).
pub fn replay_fleet(
    template: &Engine,
    gangs: &[(String, usize)],
    trace: &mut TraceReader,
    options: FleetOptions,
) -> Result<FleetReport, TraceError> {
    let count = options.gpus.max(1);
    let mut gpus = vec![template.clone(); count];
    if options.dedicated {
        dedicate(&mut gpus, gangs);
    }
    let outages = options.outages.len();
    let mut fleet = Fleet {
        node: NodeGpus::new(gpus, gangs.iter().cloned()),
        template: template.clone(),
        options: options.clone(),
        in_flight: HashMap::new(),
        last_use: HashMap::new(),
        scalers: HashMap::new(),
        report: FleetReport {
            gpus: count,
            outages,
            ..FleetReport::default()
        },
        states: vec![outages::GpuState::Up; count],
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
            fleet.outages_until(at);
            fleet.tick(at, &models);
            at += options.tick;
        }
        next_tick = Some(at);
        fleet.outages_until(now);
        fleet.request(id, now);
        fleet.check_budgets();
    }
    // A gang's load, wake, sleep and eviction count once.
    let c = fleet.node.counters();
    fleet.report.loads = c.loads;
    fleet.report.wakes = c.wakes;
    fleet.report.sleeps = c.sleeps;
    fleet.report.evictions = c.evictions;
    fleet.report.peaks = fleet.gpus().iter().map(Engine::peak).collect();
    Ok(fleet.report)
}

/// Each gang its own GPUs, in order (the first `N` for the first gang),
/// holding nothing else; the GPUs left hold the single models. Models are
/// deregistered where they may not go (their ids stay the template's).
fn dedicate(gpus: &mut [Engine], gangs: &[(String, usize)]) {
    let mut next = 0;
    let mut own: Vec<Option<&str>> = vec![None; gpus.len()];
    for (name, width) in gangs {
        for slot in own.iter_mut().skip(next).take(*width) {
            *slot = Some(name);
        }
        next += width;
    }
    for (e, owner) in gpus.iter_mut().zip(own) {
        let all: Vec<ModelId> = e.models().collect();
        for id in all {
            let name = e.name(id).to_owned();
            let gang = gangs.iter().any(|(g, _)| *g == name);
            let keep = match owner {
                Some(o) => o == name,
                None => !gang,
            };
            if !keep {
                e.deregister(id);
            }
        }
    }
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
            dedicated: false,
            outages: Vec::new(),
            pre_move: true,
        }
    }

    /// `chat` once every 10 s for an hour: one copy (GPU 0, the first
    /// placed), never more.
    fn steady_chat() -> TraceReader {
        let mut text = String::from("time,model\n");
        for s in (0..3600).step_by(10) {
            writeln!(text, "{s},chat").unwrap();
        }
        TraceReader::from_reader(Box::new(std::io::Cursor::new(text.into_bytes())), "steady")
    }

    #[test]
    fn a_gpu_in_maintenance_hands_its_hot_model_over_first_and_a_failure_loses_what_is_in_flight() {
        let run = |outage: Outage, pre_move: bool| {
            let mut o = options(2);
            o.outages = vec![outage];
            o.pre_move = pre_move;
            replay_fleet(&template(), &[], &mut steady_chat(), o).unwrap()
        };
        let maintenance = parse_maintenance("0@1000+300").unwrap();
        let moved = run(maintenance.clone(), true);
        let cold = run(maintenance, false);
        // The first load only (60 s) with the pre-move; a second cold
        // load when GPU 0 goes without it.
        assert_eq!((moved.moved_ahead, moved.wait_seconds), (1, 60.0));
        assert_eq!((cold.moved_ahead, cold.wait_seconds), (0, 120.0));
        assert_eq!((moved.failed_requests, cold.failed_requests), (0, 0));
        assert_eq!(moved.over_budget_steps, 0);
        // A failure at 1001 s: the request of 1000 s, in flight for 2 s,
        // is lost; the next one loads elsewhere.
        let failed = run(parse_failure("0@1001").unwrap(), true);
        assert_eq!(
            (
                failed.failed_requests,
                failed.moved_ahead,
                failed.wait_seconds
            ),
            (1, 0, 120.0)
        );
        assert!(moved.to_text().contains("failed requests"));
    }

    #[test]
    fn a_hot_model_gets_copies_within_budgets_and_loses_them_when_it_cools() {
        // 20 a second for 10 minutes, 2 s each: 40 in flight, 4 copies.
        let report = replay_fleet(&template(), &[], &mut trace(20, 600), options(4)).unwrap();
        assert_eq!(report.over_budget_steps, 0, "{report:?}");
        assert_eq!(report.most_copies["chat"], 4, "{report:?}");
        // Down to one again, one removal per delay, nothing removed twice.
        assert_eq!(report.copies_added, 3, "{report:?}");
        assert_eq!(report.copies_removed, 3, "{report:?}");
        assert_eq!(report.refusals, 0);
    }

    #[test]
    fn one_gpu_has_one_copy_and_the_same_requests() {
        let report = replay_fleet(&template(), &[], &mut trace(20, 600), options(1)).unwrap();
        assert_eq!(report.most_copies["chat"], 1);
        assert_eq!(report.copies_added, 0);
        let four = replay_fleet(&template(), &[], &mut trace(20, 600), options(4)).unwrap();
        assert_eq!(report.requests, four.requests);
    }

    #[test]
    fn a_model_outside_the_registry_is_an_error_at_its_line() {
        let text = "time,model\n0,chat\n1,nope\n";
        let mut t = TraceReader::from_reader(
            Box::new(std::io::Cursor::new(text.as_bytes().to_vec())),
            "t.csv",
        );
        let e = replay_fleet(&template(), &[], &mut t, options(2)).unwrap_err();
        assert_eq!(e.line, 3, "{e}");
        assert!(
            e.to_string().contains("\"nope\" is not in the registry"),
            "{e}"
        );
    }

    /// A TP-2 model of 12 GiB a GPU and eight singles of 10 GiB on four
    /// GPUs of 24 GiB, loads of 30 s: the TP-2 model every 10 s, six
    /// singles in turn every 5 s, the other two once in 50 steps.
    fn gang_case(dedicated: bool) -> FleetReport {
        let mut e = Engine::new(24 * GIB);
        let tp = e.register("tp2", 12 * GIB, false).unwrap();
        e.set_costs(
            tp,
            Costs {
                load: 30.0,
                wake: 3.0,
            },
        );
        for k in 0..8 {
            let id = e.register(&format!("m{k}"), 10 * GIB, false).unwrap();
            e.set_costs(
                id,
                Costs {
                    load: 30.0,
                    wake: 3.0,
                },
            );
        }
        let mut text = String::from("time,model\n");
        for t in 0..720 {
            if t % 2 == 0 {
                writeln!(text, "{},tp2", t * 5).unwrap();
            }
            let single = if t % 50 == 49 { 6 + t % 2 } else { t % 6 };
            writeln!(text, "{}.5,m{single}", t * 5).unwrap();
        }
        let mut trace =
            TraceReader::from_reader(Box::new(std::io::Cursor::new(text.into_bytes())), "t");
        let mut o = options(4);
        o.dedicated = dedicated;
        o.policy.max = 1;
        replay_fleet(&e, &[("tp2".into(), 2)], &mut trace, o).unwrap()
    }

    #[test]
    fn a_gang_shares_the_gpus_budgets_and_stays_within_them() {
        let shared = gang_case(false);
        assert_eq!(shared.over_budget_steps, 0, "{shared:?}");
        assert_eq!(shared.refusals, 0);
        assert!(shared.peaks.iter().all(|&p| p <= 24 * GIB), "{shared:?}");
        // Shared: GPUs hold the gang beside a single (12 + 10 of 24).
        assert!(
            shared.peaks.iter().filter(|&&p| p == 22 * GIB).count() >= 2,
            "{shared:?}"
        );
        let dedicated = gang_case(true);
        assert_eq!(dedicated.over_budget_steps, 0);
        // Its own GPUs: loaded once, never waited for again; the eight
        // singles thrash over two GPUs instead of four.
        assert_eq!(dedicated.gang_wait_seconds, 30.0, "{dedicated:?}");
        assert_eq!(dedicated.peaks[..2], [12 * GIB, 12 * GIB]);
        assert!(
            shared.wait_seconds < dedicated.wait_seconds,
            "shared {} s, dedicated {} s",
            shared.wait_seconds,
            dedicated.wait_seconds
        );
        assert!(shared.to_text().contains("gangs waiting"));
    }
}
