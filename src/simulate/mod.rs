//! Replays request sequences through the engine and reports what happened:
//! the `simulate` command's core, shared by the CLI and the benchmark.

pub mod trace;

use crate::engine::{Admission, Bytes, Engine, ModelId};
use crate::quantity::format_bytes;
use serde::Serialize;
use std::collections::HashMap;
use trace::{TraceError, TraceReader};

/// The outcome of a replay. Field names are the `--output json` keys.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize)]
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
        ];
        rows.iter().map(|(k, v)| format!("{k:<18} {v}\n")).collect()
    }
}

/// Counts requests and checks the budget invariant after each step.
#[derive(Default)]
struct Replay {
    requests: u64,
    over_budget_steps: u64,
}

impl Replay {
    fn step(&mut self, engine: &Engine) {
        self.requests += 1;
        if engine.used() > engine.budget() {
            self.over_budget_steps += 1;
        }
    }

    fn report(&self, engine: &Engine) -> Report {
        let c = engine.counters();
        Report {
            requests: self.requests,
            hits: c.hits,
            loads: c.loads,
            evictions: c.evictions,
            refusals: c.refusals,
            unloads: c.unloads,
            peak_bytes: engine.peak(),
            budget_bytes: engine.budget(),
            over_budget_steps: self.over_budget_steps,
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
        engine.request(id);
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

/// Replays a trace. A row's size registers or resizes its model; a model
/// neither registered nor sized is an error. With `keep_alive`, a model not
/// requested for that long (trace time units) is unloaded first, as the
/// operator's `spec.keepAlive` does. `progress` is called every 64Ki rows
/// with the reader, for a progress display.
pub fn replay_trace(
    engine: &mut Engine,
    trace: &mut TraceReader,
    keep_alive: Option<f64>,
    mut progress: impl FnMut(&TraceReader),
) -> Result<Report, TraceError> {
    let mut replay = Replay::default();
    let mut idle = keep_alive.map(|idle| KeepAlive {
        idle,
        last_use: HashMap::new(),
    });
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
        if let Some(idle) = &mut idle {
            idle.expire(engine, time);
        }
        let used = !matches!(engine.request(id), Admission::Refused(_));
        if let (Some(idle), true) = (&mut idle, used) {
            idle.last_use.insert(id, time);
        }
        replay.step(engine);
        if line.is_multiple_of(65536) {
            progress(trace);
        }
    }
    Ok(replay.report(engine))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn keep_alive_unloads_idle_models_before_the_next_request() {
        // a at 0, b at 1, a again at 3, c at 20, a at 21; all fit.
        let text = "time,model,size\n0,a,1\n1,b,1\n3,a\n20,c,1\n21,a\n";
        let run = |keep_alive| {
            let mut engine = Engine::new(10);
            let reader = Box::new(std::io::Cursor::new(text.to_owned()));
            let mut trace = TraceReader::from_reader(reader, "t.csv");
            replay_trace(&mut engine, &mut trace, keep_alive, |_| {}).unwrap()
        };
        let kept = run(None);
        assert_eq!((kept.hits, kept.loads, kept.unloads), (2, 3, 0));
        // With 10: a and b are idle at 20 (a last used at 3), so a loads again at 21.
        let idle = run(Some(10.0));
        assert_eq!((idle.hits, idle.loads, idle.unloads), (1, 4, 2));
    }

    #[test]
    fn text_report_lists_every_figure() {
        let mut engine = Engine::new(9000 << 20);
        for m in ["small-a", "small-b", "small-c"] {
            engine.register(m, 4000 << 20, false).unwrap();
        }
        let report = replay_names(
            &mut engine,
            &["small-a", "small-b", "small-a", "small-c", "small-a"],
        )
        .unwrap();
        let text = report.to_text();
        for want in [
            "budget             9000Mi",
            "requests           5",
            "hits               2",
            "loads              3",
            "evictions          1",
            "refusals           0",
            "peak               8000Mi",
            "hit ratio          40.00%",
            "over-budget steps  0",
        ] {
            assert!(text.contains(want), "{text} lacks {want}");
        }
    }

    #[test]
    fn unknown_names_are_errors_not_refusals() {
        let mut engine = Engine::new(1);
        let err = replay_names(&mut engine, &["nope"]).unwrap_err();
        assert_eq!(err.position, 1);
        assert!(err.to_string().contains("\"nope\""));
    }

    #[test]
    fn trace_sizes_register_and_resize_models() {
        let text = "time,model,size\n0,a,6\n1,b,4\n2,a\n3,b,7\n";
        let mut trace = TraceReader::from_reader(Box::new(text.as_bytes()), "t.csv");
        let mut engine = Engine::new(10);
        let report = replay_trace(&mut engine, &mut trace, None, |_| {}).unwrap();
        // a(6) load, b(4) load, a hit, b grows to 7: a is evicted, b hit.
        assert_eq!(
            (report.requests, report.loads, report.hits, report.evictions),
            (4, 2, 2, 1)
        );
        assert_eq!(report.peak_bytes, 10);
        assert_eq!(engine.used(), 7);
    }

    #[test]
    fn trace_rows_without_size_for_unknown_models_fail_at_their_line() {
        let text = "0,a,6\n1,b\n";
        let mut trace = TraceReader::from_reader(Box::new(text.as_bytes()), "t.csv");
        let err = replay_trace(&mut Engine::new(10), &mut trace, None, |_| {}).unwrap_err();
        assert_eq!(
            err.to_string(),
            "t.csv:2: model \"b\" is not in the registry and the row gives no size"
        );
    }
}
