//! Gangs: models that span several GPUs of one node (`gpus: N`: tensor
//! parallel N). Each GPU stays its own [`Engine`] with its own budget, and
//! a gang is registered on every GPU that may hold it under its name, at
//! its per-GPU size (what it holds on each member, as an engine's
//! `--gpu-memory-utilization` is per GPU). [`NodeGpus`] keeps each gang
//! resident on exactly N of a node's GPUs or on none:
//!
//! - **All or nothing.** A request for a gang that is not resident picks N
//!   GPUs (where it sleeps, then where it fits without evicting, the most
//!   free first, then where its evictions were used longest ago) and plans
//!   each without changing anything; only when every one of the N can make
//!   room now is anything evicted or loaded. Fewer than N GPUs that could
//!   ever hold it: refused, with each GPU's reason ([`GangRefused`]);
//!   enough, but not now (room held by loading models): queued, nothing
//!   evicted anywhere. Where the node's GPUs are in groups (an NVLink
//!   domain, a PCIe root: [`NodeGpus::set_groups`]), the N are of one
//!   group, the group whose costliest chosen member costs least.
//! - **One recency.** A request touches every member at once.
//! - **Leaves as one.** A gang that one member evicts (a victim of a
//!   request or a budget change there) is evicted from every member; one
//!   that a member puts to sleep to make room sleeps on every member (or,
//!   where a member's host memory cannot hold it, is evicted from all); an
//!   unload or a retirement takes every member.
//!
//! A gang's load, wake, sleep, eviction, unload and hit count once in
//! [`NodeGpus::counters`] (each GPU's own counters count it there). The
//! invariant is each GPU's: `used <= budget` on every member after every
//! operation, which the engines keep and the property tests check. Pure,
//! as the engine: no kube, no I/O.

use super::{Admission, Bytes, Counters, Engine, ModelId, RefuseReason};
use std::collections::BTreeMap;

/// A node's GPUs and the gangs that span them.
#[derive(Clone, Debug)]
pub struct NodeGpus {
    gpus: Vec<Engine>,
    /// Each gang's width and the GPUs that hold it now (empty: none).
    gangs: BTreeMap<String, Gang>,
    /// What the GPUs' own counters count more than once: a gang's event on
    /// N members is one event.
    overcount: Counters,
    /// The node's clock: a step per operation, for comparing victims'
    /// recency across GPUs (each engine's own clock counts its requests).
    clock: u64,
    /// When each (GPU, model) was last requested, by the node's clock.
    touched: BTreeMap<(usize, String), u64>,
    /// Gangs refused: no GPU's engine saw those requests.
    refusals: u64,
    /// Each GPU's group (its NVLink domain, PCIe root, ...: GPUs a gang
    /// may span together), when the driver publishes one: a gang's
    /// members all share one (GPUs without one only go with each other).
    /// Empty: any GPUs of the node go together.
    groups: Vec<Option<String>>,
}

/// What placing a gang on a GPU costs, lowest first: where it sleeps (0),
/// fits (1, the most free room first) or must evict (2, the newest use
/// among its victims, older cheaper).
type Cost = (u8, u64, i128);

/// A group's GPUs that could hold a gang now (with what each costs), and
/// how many more could once the models loading there are ready.
type Candidates = (Vec<(Cost, usize)>, usize);

#[derive(Clone, Debug)]
struct Gang {
    width: usize,
    members: Vec<usize>,
}

/// Why a gang can never be placed on this node.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[error("{}", describe(self))]
pub struct GangRefused {
    /// The GPUs it needs at once.
    pub width: usize,
    /// The node's GPUs that could ever hold it.
    pub could: usize,
    /// The others, each with its reason (a GPU where it is not declared:
    /// `UnknownModel`).
    pub why: Vec<(usize, RefuseReason)>,
    /// The node's GPUs are in groups a gang may not span (`could` is then
    /// the most of one group).
    pub grouped: bool,
}

fn describe(r: &GangRefused) -> String {
    let gpus: Vec<String> = r
        .why
        .iter()
        .map(|(g, reason)| {
            let detail = match reason {
                RefuseReason::LargerThanBudget { size, budget } => {
                    format!("{size} bytes per GPU over its budget of {budget}")
                }
                RefuseReason::NoEvictableRoom {
                    size,
                    budget,
                    pinned,
                } => format!("{size} bytes per GPU beside {pinned} pinned of {budget}"),
                RefuseReason::UnknownModel => "not declared there".into(),
            };
            format!("GPU {g}: {} ({detail})", reason.as_str())
        })
        .collect();
    format!(
        "needs {} GPUs of one node at once and {}{}{} could ever hold it{}{}",
        r.width,
        if r.grouped { "at most " } else { "" },
        r.could,
        if r.grouped { " of one group" } else { "" },
        if gpus.is_empty() { "" } else { "; " },
        gpus.join("; ")
    )
}

/// What a request did on the node. `evicted` names every model that left
/// a GPU for it, by GPU (a gang once per member).
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum NodeAdmission {
    /// Resident on these GPUs; now the most recently used there.
    Hit { gpus: Vec<usize> },
    /// Loaded on these GPUs (a gang: woken on some and loaded on the
    /// others counts as a load).
    Loaded {
        gpus: Vec<usize>,
        evicted: Vec<(usize, String)>,
    },
    /// Was sleeping on these GPUs; woken.
    Woken {
        gpus: Vec<usize>,
        evicted: Vec<(usize, String)>,
    },
    /// Room is held by loading models: nothing changed anywhere.
    Queued,
    /// A single model refused on its GPU.
    Refused(RefuseReason),
    /// A gang that no N of the node's GPUs could ever hold.
    GangRefused(GangRefused),
}

impl NodeGpus {
    /// The node's GPUs (each with its registry: a gang is registered under
    /// its name on each GPU that may hold it) and its gangs by name and
    /// width (2 or more).
    pub fn new(gpus: Vec<Engine>, gangs: impl IntoIterator<Item = (String, usize)>) -> Self {
        let gangs = gangs
            .into_iter()
            .map(|(name, width)| {
                let width = width.max(2);
                (
                    name,
                    Gang {
                        width,
                        members: Vec::new(),
                    },
                )
            })
            .collect();
        NodeGpus {
            gpus,
            gangs,
            overcount: Counters::default(),
            clock: 0,
            touched: BTreeMap::new(),
            refusals: 0,
            groups: Vec::new(),
        }
    }

    /// Each GPU's group, by index (see [`NodeGpus`]'s `groups`): from now
    /// on a gang is placed only on GPUs of one group.
    pub fn set_groups(&mut self, groups: Vec<Option<String>>) {
        self.groups = groups;
    }

    fn group(&self, gpu: usize) -> Option<&str> {
        self.groups.get(gpu).and_then(|g| g.as_deref())
    }

    /// Records when `name` was last used on `gpu`, on a scale of the
    /// caller's (a replay's node clock, or nanoseconds of recorded times):
    /// what ranks GPUs by the recency of the models a gang would evict
    /// there, for a node rebuilt from its GPUs' statuses.
    pub fn used_at(&mut self, gpu: usize, name: &str, at: u64) {
        self.clock = self.clock.max(at);
        self.touched.insert((gpu, name.to_owned()), at);
    }

    pub fn gpus(&self) -> &[Engine] {
        &self.gpus
    }

    /// Whether `name` is a gang, and its width.
    pub fn width(&self, name: &str) -> Option<usize> {
        self.gangs.get(name).map(|g| g.width)
    }

    /// The GPUs a gang is resident on (empty: none; a single model: its
    /// GPUs where resident).
    pub fn members(&self, name: &str) -> Vec<usize> {
        match self.gangs.get(name) {
            Some(g) => g.members.clone(),
            None => (0..self.gpus.len())
                .filter(|&g| {
                    self.id(g, name)
                        .is_some_and(|id| self.gpus[g].is_resident(id))
                })
                .collect(),
        }
    }

    /// The node's counters: each GPU's summed, a gang's event counted once.
    pub fn counters(&self) -> Counters {
        let mut c = Counters::default();
        for e in &self.gpus {
            let g = e.counters();
            c.hits += g.hits;
            c.loads += g.loads;
            c.evictions += g.evictions;
            c.refusals += g.refusals;
            c.unloads += g.unloads;
            c.sleeps += g.sleeps;
            c.wakes += g.wakes;
        }
        let o = self.overcount;
        c.hits -= o.hits;
        c.loads -= o.loads;
        c.evictions -= o.evictions;
        c.refusals = c.refusals - o.refusals + self.refusals;
        c.unloads -= o.unloads;
        c.sleeps -= o.sleeps;
        c.wakes -= o.wakes;
        c
    }

    fn id(&self, gpu: usize, name: &str) -> Option<ModelId> {
        self.gpus.get(gpu)?.id(name)
    }

    /// A request for the single model `name` on `gpu` (the router's or the
    /// copy scaler's choice), or for the gang `name` (on the GPUs it picks:
    /// `gpu` is not used).
    pub fn request(&mut self, gpu: usize, name: &str) -> NodeAdmission {
        self.clock += 1;
        if self.gangs.contains_key(name) {
            return self.request_gang(name);
        }
        let Some(id) = self.id(gpu, name) else {
            return NodeAdmission::Refused(RefuseReason::UnknownModel);
        };
        self.touched.insert((gpu, name.to_owned()), self.clock);
        let mut evicted = Vec::new();
        let outcome = match self.gpus[gpu].request(id) {
            Admission::Hit => return NodeAdmission::Hit { gpus: vec![gpu] },
            Admission::Queued { .. } => return NodeAdmission::Queued,
            Admission::Refused(r) => return NodeAdmission::Refused(r),
            Admission::Loaded { evicted: e } => {
                let e = e.to_vec();
                let slept = self.gpus[gpu].last_slept().to_vec();
                self.settle(gpu, &e, &slept, &mut evicted);
                true
            }
            Admission::Woken { evicted: e } => {
                let e = e.to_vec();
                let slept = self.gpus[gpu].last_slept().to_vec();
                self.settle(gpu, &e, &slept, &mut evicted);
                false
            }
        };
        let gpus = vec![gpu];
        if outcome {
            NodeAdmission::Loaded { gpus, evicted }
        } else {
            NodeAdmission::Woken { gpus, evicted }
        }
    }

    fn request_gang(&mut self, name: &str) -> NodeAdmission {
        let gang = self.gangs[name].clone();
        let members = gang.members.clone();
        if !members.is_empty() {
            let awake = members.iter().all(|&g| {
                let id = self.id(g, name).expect("a member has it registered");
                !self.gpus[g].is_asleep(id)
            });
            if awake {
                for &g in &members {
                    let id = self.id(g, name).expect("registered");
                    let hit = self.gpus[g].request(id);
                    debug_assert_eq!(hit, Admission::Hit);
                    self.touched.insert((g, name.to_owned()), self.clock);
                }
                self.overcount.hits += members.len() as u64 - 1;
                return NodeAdmission::Hit { gpus: members };
            }
            // Asleep: woken on its members, all of them or none.
            let plans: Vec<_> = members
                .iter()
                .map(|&g| self.gpus[g].plan_load(self.id(g, name).expect("registered")))
                .collect();
            if plans.iter().any(|p| matches!(p, Ok(None))) {
                return NodeAdmission::Queued;
            }
            if plans.iter().all(|p| p.is_ok()) {
                return self.admit_gang(name, &members);
            }
            // A member can no longer hold it (its budget shrank): the
            // sleeping gang is dropped and placed afresh.
            self.unload(name);
        }
        let width = gang.width;
        let mut never = Vec::new();
        let mut now: Vec<(Cost, usize)> = Vec::new();
        let mut later = Vec::new();
        for g in 0..self.gpus.len() {
            let Some(id) = self.id(g, name) else {
                never.push((g, RefuseReason::UnknownModel));
                continue;
            };
            let engine = &self.gpus[g];
            match engine.plan_load(id) {
                Err(reason) => never.push((g, reason)),
                Ok(None) => later.push(g),
                Ok(Some(victims)) => {
                    // Newest use among its victims, by the node's clock:
                    // older is cheaper.
                    let newest = victims
                        .iter()
                        .filter_map(|&v| self.touched.get(&(g, engine.name(v).to_owned())).copied())
                        .max()
                        .unwrap_or(0);
                    let free = i128::from(engine.budget()) - i128::from(engine.used());
                    let rank = if engine.is_asleep(id) {
                        (0, 0, 0)
                    } else if victims.is_empty() {
                        (1, 0, -free)
                    } else {
                        (2, newest, -free)
                    };
                    now.push((rank, g));
                }
            }
        }
        now.sort();
        // Each group's candidates: the GPUs that may hold it now (best
        // first) and how many more could once loads finish.
        let mut groups: BTreeMap<Option<&str>, Candidates> = BTreeMap::new();
        for &(rank, g) in &now {
            groups.entry(self.group(g)).or_default().0.push((rank, g));
        }
        for &g in &later {
            groups.entry(self.group(g)).or_default().1 += 1;
        }
        let could = groups
            .values()
            .map(|(now, later)| now.len() + later)
            .max()
            .unwrap_or(0);
        let grouped = groups.len() > 1;
        if could < width {
            self.refusals += 1;
            return NodeAdmission::GangRefused(GangRefused {
                width,
                could,
                why: never,
                grouped,
            });
        }
        // The group whose chosen members cost least: compared by its
        // costliest member first.
        let best = groups
            .values()
            .filter(|(now, _)| now.len() >= width)
            .map(|(now, _)| {
                let mut ranks: Vec<_> = now.iter().take(width).copied().collect();
                ranks.reverse();
                ranks
            })
            .min();
        let Some(best) = best else {
            return NodeAdmission::Queued;
        };
        let mut chosen: Vec<usize> = best.iter().map(|&(_, g)| g).collect();
        chosen.sort_unstable();
        self.admit_gang(name, &chosen)
    }

    /// Loads or wakes the gang on `gpus`, every one of which planned room
    /// now (evictions on one only free room on the others: none of them
    /// can turn into a queue or a refusal).
    fn admit_gang(&mut self, name: &str, gpus: &[usize]) -> NodeAdmission {
        let mut evicted = Vec::new();
        let (mut loads, mut wakes) = (0u64, 0u64);
        for &g in gpus {
            let id = self.id(g, name).expect("registered");
            self.touched.insert((g, name.to_owned()), self.clock);
            let (e, loaded) = match self.gpus[g].request(id) {
                Admission::Loaded { evicted } => (evicted.to_vec(), true),
                Admission::Woken { evicted } => (evicted.to_vec(), false),
                Admission::Hit => (Vec::new(), false),
                other => unreachable!("a member planned room and got {other:?}"),
            };
            if loaded {
                loads += 1;
            } else {
                wakes += 1;
            }
            let slept = self.gpus[g].last_slept().to_vec();
            self.settle(g, &e, &slept, &mut evicted);
        }
        if let Some(gang) = self.gangs.get_mut(name) {
            gang.members = gpus.to_vec();
        }
        let gpus = gpus.to_vec();
        if loads > 0 {
            // One load; the members woken count as part of it.
            self.overcount.loads += loads - 1;
            self.overcount.wakes += wakes;
            NodeAdmission::Loaded { gpus, evicted }
        } else {
            self.overcount.wakes += wakes - 1;
            NodeAdmission::Woken { gpus, evicted }
        }
    }

    /// What an operation on `gpu` evicted and slept, carried to the other
    /// members of each gang among them: evicted there too, or slept there
    /// too (evicted from all where a member cannot hold it asleep).
    fn settle(
        &mut self,
        gpu: usize,
        evicted: &[ModelId],
        slept: &[ModelId],
        out: &mut Vec<(usize, String)>,
    ) {
        let mut work: Vec<(usize, Vec<ModelId>, Vec<ModelId>)> =
            vec![(gpu, evicted.to_vec(), slept.to_vec())];
        while let Some((g, evicted, slept)) = work.pop() {
            for v in evicted {
                let name = self.gpus[g].name(v).to_owned();
                out.push((g, name.clone()));
                let Some(gang) = self.gangs.get_mut(&name) else {
                    continue;
                };
                let others: Vec<usize> = std::mem::take(&mut gang.members)
                    .into_iter()
                    .filter(|&m| m != g)
                    .collect();
                for m in others {
                    if let Some(id) = self.gpus[m].id(&name)
                        && self.gpus[m].evict_member(id)
                    {
                        self.overcount.evictions += 1;
                        out.push((m, name.clone()));
                    }
                }
            }
            for s in slept {
                let name = self.gpus[g].name(s).to_owned();
                let Some(gang) = self.gangs.get(&name) else {
                    continue;
                };
                let others: Vec<usize> = gang.members.iter().copied().filter(|&m| m != g).collect();
                let mut all_asleep = true;
                for &m in &others {
                    let id = self.gpus[m].id(&name).expect("registered");
                    if self.gpus[m].is_asleep(id) {
                        continue;
                    }
                    match self.gpus[m].retire(id) {
                        Some(dropped) => {
                            let dropped = dropped.to_vec();
                            self.overcount.sleeps += 1;
                            work.push((m, dropped, Vec::new()));
                        }
                        None => all_asleep = false,
                    }
                }
                if !all_asleep {
                    // A member cannot hold it asleep: it leaves them all.
                    let members = self
                        .gangs
                        .get_mut(&name)
                        .map(|g| std::mem::take(&mut g.members))
                        .unwrap_or_default();
                    for (k, m) in members.into_iter().enumerate() {
                        let id = self.gpus[m].id(&name).expect("registered");
                        if self.gpus[m].evict_member(id) {
                            if k > 0 {
                                self.overcount.evictions += 1;
                            }
                            out.push((m, name.clone()));
                        }
                    }
                }
            }
        }
    }

    /// Unloads `name` (a gang: from every member; a single model: from
    /// every GPU it is on). Whether it was resident anywhere.
    pub fn unload(&mut self, name: &str) -> bool {
        let members = self.members(name);
        let mut any = 0u64;
        for &g in &members {
            let id = self.id(g, name).expect("registered");
            if self.gpus[g].unload(id) {
                any += 1;
            }
        }
        if let Some(gang) = self.gangs.get_mut(name) {
            gang.members.clear();
            self.overcount.unloads += any.saturating_sub(1);
        }
        any > 0
    }

    /// Unloads the single model `name` from `gpu` (a gang: from all its
    /// members, as [`NodeGpus::unload`]).
    pub fn unload_on(&mut self, gpu: usize, name: &str) -> bool {
        if self.gangs.contains_key(name) {
            return self.unload(name);
        }
        self.id(gpu, name)
            .is_some_and(|id| self.gpus[gpu].unload(id))
    }

    /// Puts `name` to sleep on `gpu` (a gang: on every member, or, where
    /// one cannot hold it asleep, unloads it from all); whether it sleeps.
    pub fn retire(&mut self, gpu: usize, name: &str) -> bool {
        self.clock += 1;
        let members = match self.gangs.get(name) {
            Some(g) => g.members.clone(),
            None => vec![gpu],
        };
        let mut slept = 0u64;
        let mut evicted = Vec::new();
        for &g in &members {
            let Some(id) = self.id(g, name) else { continue };
            match self.gpus[g].retire(id) {
                Some(dropped) => {
                    let dropped = dropped.to_vec();
                    slept += 1;
                    self.settle(g, &dropped, &[], &mut evicted);
                }
                None => {
                    if self.gangs.contains_key(name) {
                        self.overcount.sleeps += slept.saturating_sub(1);
                        self.unload(name);
                    }
                    return false;
                }
            }
        }
        if self.gangs.contains_key(name) {
            self.overcount.sleeps += slept.saturating_sub(1);
        }
        slept > 0
    }

    /// Sets `gpu`'s budget; what it evicts leaves every GPU it spans.
    pub fn set_budget(&mut self, gpu: usize, budget: Bytes) -> Vec<(usize, String)> {
        self.clock += 1;
        let dropped = self.gpus[gpu].set_budget(budget).to_vec();
        let mut out = Vec::new();
        self.settle(gpu, &dropped, &[], &mut out);
        out
    }

    /// Marks `name` loading or ready on every GPU it is resident on.
    pub fn set_loading(&mut self, name: &str, loading: bool) {
        for g in self.members(name) {
            let id = self.id(g, name).expect("registered");
            self.gpus[g].set_loading(id, loading);
        }
    }
}

#[cfg(test)]
#[path = "gangs_tests.rs"]
mod tests;
