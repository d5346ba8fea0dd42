//! Replays request sequences through the engine and reports what happened:
//! the `simulate` command's core, shared by the CLI and the benchmark.

pub mod trace;

use crate::engine::{Bytes, Engine};
use crate::quantity::format_bytes;
use serde::Serialize;
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

/// Replays a trace. A row's size registers or resizes its model; a model
/// neither registered nor sized is an error. `progress` is called every
/// 64Ki rows with the reader, for a progress display.
pub fn replay_trace(
    engine: &mut Engine,
    trace: &mut TraceReader,
    mut progress: impl FnMut(&TraceReader),
) -> Result<Report, TraceError> {
    let mut replay = Replay::default();
    loop {
        let (id, line) = {
            let Some(row) = trace.next_row()? else { break };
            let line = row.line;
            match (engine.id(row.model), row.size) {
                (Some(id), None) => (id, line),
                (Some(id), Some(size)) => {
                    if engine.size(id) != size {
                        engine.resize(id, size).expect("size checked positive");
                    }
                    (id, line)
                }
                (None, Some(size)) => {
                    let id = engine
                        .register(row.model, size, false)
                        .expect("new name, positive size");
                    (id, line)
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
        engine.request(id);
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
        let report = replay_trace(&mut engine, &mut trace, |_| {}).unwrap();
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
        let err = replay_trace(&mut Engine::new(10), &mut trace, |_| {}).unwrap_err();
        assert_eq!(
            err.to_string(),
            "t.csv:2: model \"b\" is not in the registry and the row gives no size"
        );
    }
}
