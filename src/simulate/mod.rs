//! Replays request sequences through the engine and reports what happened:
//! the `simulate` command's core, shared by the CLI and the benchmark.

mod clairvoyant;
pub mod disk;
pub mod fleet;
pub mod foresight;
pub mod servegen;
mod tally;
pub mod timeline;
pub mod trace;

use crate::engine::{Admission, Bytes, Engine, ModelId};
use crate::quantity::format_bytes;
use serde::Serialize;
use std::cmp::Reverse;
use std::collections::{BinaryHeap, HashMap, HashSet};
use trace::{TraceError, TraceReader};

/// The outcome of a replay. Field names are the `--output json` keys.
#[derive(Clone, Copy, Debug, Default, PartialEq, Serialize)]
pub struct Report {
    pub requests: u64,
    pub hits: u64,
    pub loads: u64,
    pub evictions: u64,
    pub refusals: u64,
    pub unloads: u64,
    pub peak_bytes: Bytes,
    pub budget_bytes: Bytes,
    /// Steps after which `used > budget`: an independent check of the
    /// engine's invariant, expected to stay 0.
    pub over_budget_steps: u64,
    /// Requests written to the residency (demand writes). Every request
    /// without a recency resolution; fewer with one, whose `hits` then
    /// count requests that found their model resident.
    pub demand_writes: u64,
    /// Awake models put to sleep to make room (the warm tier).
    pub sleeps: u64,
    /// Requests that woke a sleeping model.
    pub wakes: u64,
    /// Seconds requests would wait: each load's load time plus each
    /// wake's wake time (the model's costs), as if nothing overlapped.
    pub wait_seconds: f64,
    /// Host memory for sleeping models, and the most they held at once.
    pub host_budget_bytes: Bytes,
    pub host_peak_bytes: Bytes,
    /// With a disk tier (`--disk-budget`): its size, the loads whose
    /// artifact had to be fetched first, and the seconds those fetches
    /// added (part of `wait_seconds`).
    pub disk_budget_bytes: Bytes,
    pub fetches: u64,
    pub fetch_seconds: f64,
}

impl Report {
    pub fn hit_ratio(&self) -> f64 {
        if self.requests == 0 {
            0.0
        } else {
            self.hits as f64 / self.requests as f64
        }
    }

    /// The human-readable table printed by `simulate --output text`.
    pub fn to_text(&self) -> String {
        let rows = [
            ("budget", format_bytes(self.budget_bytes)),
            ("requests", self.requests.to_string()),
            ("hits", self.hits.to_string()),
            ("loads", self.loads.to_string()),
            ("evictions", self.evictions.to_string()),
            ("refusals", self.refusals.to_string()),
            ("unloads", self.unloads.to_string()),
            ("peak", format_bytes(self.peak_bytes)),
            ("hit ratio", format!("{:.2}%", 100.0 * self.hit_ratio())),
            ("over-budget steps", self.over_budget_steps.to_string()),
            ("demand writes", self.demand_writes.to_string()),
            ("sleeps", self.sleeps.to_string()),
            ("wakes", self.wakes.to_string()),
            ("waiting", format!("{:.1}s", self.wait_seconds)),
            ("host budget", format_bytes(self.host_budget_bytes)),
            ("host peak", format_bytes(self.host_peak_bytes)),
            ("disk budget", format_bytes(self.disk_budget_bytes)),
            ("fetches", self.fetches.to_string()),
            ("fetching", format!("{:.1}s", self.fetch_seconds)),
        ];
        rows.iter().map(|(k, v)| format!("{k:<18} {v}\n")).collect()
    }
}

/// Counts requests and checks the budget invariant after each step.
#[derive(Default)]
struct Replay {
    requests: u64,
    over_budget_steps: u64,
    wait_seconds: f64,
    /// With a recency resolution: requests that found their model
    /// resident, and the writes made.
    resolved: Option<(u64, u64)>,
    /// With a disk tier: its budget, fetches and their seconds.
    fetched: (Bytes, u64, f64),
}

impl Replay {
    fn step(&mut self, engine: &Engine) {
        self.requests += 1;
        if engine.used() > engine.budget() || engine.host_used() > engine.host_budget() {
            self.over_budget_steps += 1;
        }
    }

    /// A request for `id`, and the wait it costs.
    fn request(&mut self, engine: &mut Engine, id: ModelId) -> bool {
        let costs = engine.costs(id);
        match engine.request(id) {
            Admission::Loaded { .. } => self.wait_seconds += costs.load,
            Admission::Woken { .. } => self.wait_seconds += costs.wake,
            Admission::Refused(_) => return false,
            Admission::Hit | Admission::Queued { .. } => {}
        }
        true
    }

    fn report(&self, engine: &Engine) -> Report {
        let c = engine.counters();
        let (hits, demand_writes) = self.resolved.unwrap_or((c.hits, self.requests));
        Report {
            requests: self.requests,
            hits,
            demand_writes,
            loads: c.loads,
            evictions: c.evictions,
            refusals: c.refusals,
            unloads: c.unloads,
            peak_bytes: engine.peak(),
            budget_bytes: engine.budget(),
            over_budget_steps: self.over_budget_steps,
            sleeps: c.sleeps,
            wakes: c.wakes,
            wait_seconds: self.wait_seconds,
            host_budget_bytes: engine.host_budget(),
            host_peak_bytes: engine.host_peak(),
            disk_budget_bytes: self.fetched.0,
            fetches: self.fetched.1,
            fetch_seconds: self.fetched.2,
        }
    }
}

/// An error in a request given on the command line.
#[derive(Debug, thiserror::Error)]
#[error(
    "model {model:?} (request {position}) is not in the registry; pass --registry with it or use a trace with sizes"
)]
pub struct UnknownModelError {
    pub model: String,
    pub position: usize,
}

/// Replays named requests, in order, against registered models.
pub fn replay_names<S: AsRef<str>>(
    engine: &mut Engine,
    models: &[S],
) -> Result<Report, UnknownModelError> {
    let mut replay = Replay::default();
    for (i, m) in models.iter().enumerate() {
        let id = engine.id(m.as_ref()).ok_or_else(|| UnknownModelError {
            model: m.as_ref().to_owned(),
            position: i + 1,
        })?;
        replay.request(engine, id);
        replay.step(engine);
    }
    Ok(replay.report(engine))
}

/// Idle unload in a replay: a resident model not requested for `idle`
/// (in the trace's time unit) is unloaded before the next request, as the
/// operator's keepAlive does. Pinned models stay.
struct KeepAlive {
    idle: f64,
    last_use: HashMap<ModelId, f64>,
}

impl KeepAlive {
    fn expire(&mut self, engine: &mut Engine, now: f64) {
        for id in engine.residents() {
            let idle_since = self.last_use.get(&id).copied().unwrap_or(now);
            if !engine.is_pinned(id) && idle_since + self.idle <= now {
                engine.unload(id);
            }
        }
    }
}

/// How a trace is replayed, in the trace's time unit.
#[derive(Debug, Default)]
pub struct ReplayOptions {
    /// Unload a model not requested for this long first, as the operator's
    /// `spec.keepAlive` does.
    pub keep_alive: Option<f64>,
    /// Write requests as the router does with `--recency-resolution`: a
    /// request for a model that is not resident is written at once; a hit
    /// is written only if the model's last write is this old, else folded
    /// into one write a resolution after the last (if the model is still
    /// resident then).
    pub recency_resolution: Option<f64>,
    /// The node's disk tier: a load whose artifact is not on disk waits
    /// for its fetch too (see [`disk`]).
    pub disk: Option<disk::DiskOptions>,
    /// A ceiling measurement for `--eviction rate`: what the replay tells
    /// the policy of the future (see [`foresight`]).
    pub foresight: Option<foresight::Foresight>,
}

/// The router's recency resolution in a replay: the writes it defers.
struct Resolution {
    resolution: f64,
    last_write: HashMap<ModelId, f64>,
    /// Deferred refreshes, by due time.
    due: BinaryHeap<Reverse<(Time, ModelId)>>,
    deferred: HashSet<ModelId>,
    hits: u64,
    writes: u64,
}

/// A trace time, ordered (times are finite: the reader checks).
#[derive(Clone, Copy, Debug, PartialEq)]
struct Time(f64);

impl Eq for Time {}

impl PartialOrd for Time {
    fn partial_cmp(&self, other: &Self) -> Option<std::cmp::Ordering> {
        Some(self.cmp(other))
    }
}

impl Ord for Time {
    fn cmp(&self, other: &Self) -> std::cmp::Ordering {
        self.0.total_cmp(&other.0)
    }
}

impl Resolution {
    /// The deferred refreshes due by `now`, in order.
    fn flush(&mut self, engine: &mut Engine, now: f64, idle: &mut Option<KeepAlive>) {
        while let Some(&Reverse((Time(at), id))) = self.due.peek() {
            if at > now {
                break;
            }
            self.due.pop();
            self.deferred.remove(&id);
            // An evicted or sleeping model is not refreshed: that would
            // load or wake it.
            if engine.is_resident(id) && !engine.is_asleep(id) {
                engine.request(id);
                self.writes += 1;
                self.last_write.insert(id, at);
                if let Some(idle) = idle {
                    idle.last_use.insert(id, at);
                }
            }
        }
    }

    /// A request for `id` at `now`: whether it is written now.
    fn request(&mut self, engine: &Engine, id: ModelId, now: f64) -> bool {
        if !engine.is_resident(id) || engine.is_asleep(id) {
            return true;
        }
        self.hits += 1;
        let last = self.last_write.get(&id).copied();
        if last.is_none_or(|l| l + self.resolution <= now) {
            return true;
        }
        if self.deferred.insert(id) {
            let at = last.unwrap_or(now) + self.resolution;
            self.due.push(Reverse((Time(at), id)));
        }
        false
    }
}

/// Replays a trace. A row's size registers or resizes its model; a model
/// neither registered nor sized is an error. `options` add idle unload and
/// the router's recency resolution. `progress` is called every 64Ki rows
/// with the reader, for a progress display.
pub fn replay_trace(
    engine: &mut Engine,
    trace: &mut TraceReader,
    options: ReplayOptions,
    mut progress: impl FnMut(&TraceReader),
) -> Result<Report, TraceError> {
    let mut replay = Replay::default();
    let mut idle = options.keep_alive.map(|idle| KeepAlive {
        idle,
        last_use: HashMap::new(),
    });
    let mut resolution = options.recency_resolution.map(|resolution| Resolution {
        resolution,
        last_write: HashMap::new(),
        due: BinaryHeap::new(),
        deferred: HashSet::new(),
        hits: 0,
        writes: 0,
    });
    let mut disk = options.disk.map(disk::Disk::new);
    let mut foresight = options.foresight;
    // Trace rows read so far: what the foresight's rows count.
    let mut rows_read = 0;
    loop {
        let (id, line, time) = {
            let Some(row) = trace.next_row()? else { break };
            let (line, time) = (row.line, row.time);
            match (engine.id(row.model), row.size) {
                (Some(id), None) => (id, line, time),
                (Some(id), Some(size)) => {
                    if engine.size(id) != size {
                        engine.resize(id, size).expect("size checked positive");
                    }
                    (id, line, time)
                }
                (None, Some(size)) => {
                    let id = engine
                        .register(row.model, size, false)
                        .expect("new name, positive size");
                    (id, line, time)
                }
                (None, None) => {
                    let problem = format!(
                        "model {:?} is not in the registry and the row gives no size",
                        row.model
                    );
                    return Err(trace.error(problem));
                }
            }
        };
        if let Some(f) = &mut foresight {
            f.at(engine, rows_read, id);
        }
        rows_read += 1;
        if let Some(r) = &mut resolution {
            r.flush(engine, time, &mut idle);
        }
        if let Some(idle) = &mut idle {
            idle.expire(engine, time);
        }
        let written = resolution
            .as_mut()
            .is_none_or(|r| r.request(engine, id, time));
        if written {
            let was_resident = engine.is_resident(id);
            let used = replay.request(engine, id);
            if let (Some(disk), true) = (&mut disk, used) {
                let loaded = !was_resident && engine.is_resident(id);
                replay.wait_seconds += disk.served(engine, id, loaded);
            }
            if let (Some(idle), true) = (&mut idle, used) {
                idle.last_use.insert(id, time);
            }
            if let Some(r) = &mut resolution {
                r.writes += 1;
                r.last_write.insert(id, time);
            }
        }
        replay.step(engine);
        if line.is_multiple_of(65536) {
            progress(trace);
        }
    }
    if let Some(f) = &foresight {
        // About the whole trace, not its last line.
        f.finish().map_err(|problem| TraceError {
            line: 0,
            ..trace.error(problem)
        })?;
    }
    replay.resolved = resolution.map(|r| (r.hits, r.writes));
    if let (Some(options), Some(disk)) = (options.disk, disk) {
        replay.fetched = (options.budget, disk.fetches, disk.fetch_seconds);
    }
    Ok(replay.report(engine))
}
#[cfg(test)]
mod tests;
