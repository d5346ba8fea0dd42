//! Ceilings for `--eviction rate` (#39): the replay tells the policy more
//! of the future than its past can, so that the waiting left can be split
//! into what the rate estimate loses and what the keys themselves do.
//!
//! - **Known rates** (`--known-rates FILE`): each model's share of the
//!   requests as the trace's generator drew them (`scripts/traces.py`
//!   writes them beside each trace). A policy that estimated its rates
//!   perfectly would do this well with the same keys.
//! - **Clairvoyant** (`--clairvoyant`): each model's next request, read
//!   from the trace itself (Belady's farthest-next-use, weighed by cost per
//!   GiB). No online policy can know it; with Poisson arrivals it is
//!   luck, not a rate. It bounds what any choice of victims by these keys
//!   could gain.
//!
//! Neither exists in the operator: both are measurements.

use super::trace::{TraceError, TraceReader};
use crate::engine::{Engine, Known, ModelId};
use std::collections::HashMap;
use std::path::Path;

/// What a ceiling replay knows, and where it is in the trace.
#[derive(Debug)]
pub enum Foresight {
    /// Each row's next row asking for the same model (`u64::MAX`: never).
    Clairvoyant(Vec<u64>),
    /// Share changes, by row; the next one to apply.
    Rates(Vec<RateChange>, usize, Pending),
}

/// Known shares of models not registered yet (a trace row's size registers
/// its model at its first request), by name: the row the model was first
/// named at (what an error points to) and its latest share. Each is
/// applied when its model's first row comes.
pub type Pending = HashMap<String, (u64, f64)>;

/// From trace row `row` (from 0) on, `model` is a `share` of the requests.
#[derive(Clone, Debug, PartialEq)]
pub struct RateChange {
    pub row: u64,
    pub model: String,
    pub share: f64,
}

impl Foresight {
    /// The clairvoyant ceiling of the trace at `path`: a first pass reads
    /// every row's model (12 bytes a row while it is read, 8 kept).
    pub fn clairvoyant(path: &Path) -> Result<Foresight, TraceError> {
        let mut trace = TraceReader::open(path)?;
        let mut names: HashMap<String, u32> = HashMap::new();
        let mut rows: Vec<u32> = Vec::new();
        while let Some(row) = trace.next_row()? {
            let n = names.len() as u32;
            rows.push(*names.entry(row.model.to_owned()).or_insert(n));
        }
        let mut next = vec![u64::MAX; rows.len()];
        let mut seen = vec![u64::MAX; names.len()];
        for (i, &m) in rows.iter().enumerate().rev() {
            next[i] = seen[m as usize];
            seen[m as usize] = i as u64;
        }
        Ok(Foresight::Clairvoyant(next))
    }

    /// Known rates from a CSV file `row,model,share` (a header row whose
    /// first field is `row` is skipped): rows non-decreasing, shares in
    /// [0, 1].
    pub fn rates(path: &Path) -> Result<Foresight, String> {
        let text = std::fs::read_to_string(path)
            .map_err(|e| format!("{}: cannot read: {e}", path.display()))?;
        let changes = parse_rates(&text).map_err(|e| format!("{}:{e}", path.display()))?;
        Ok(Foresight::Rates(changes, 0, Pending::new()))
    }

    /// Tells `engine` what is known at trace row `row`, before the row's
    /// request for `id` (registered by then). A share for a model not
    /// registered yet waits for its first row ([`Foresight::finish`]
    /// refuses one whose model never came).
    pub fn at(&mut self, engine: &mut Engine, row: u64, id: ModelId) {
        engine.set_known_at(row);
        match self {
            Foresight::Clairvoyant(next) => {
                let known = match next.get(row as usize) {
                    Some(&u64::MAX) | None => Known::Never,
                    Some(&at) => Known::NextRequest(at),
                };
                engine.set_known(id, Some(known));
            }
            Foresight::Rates(changes, applied, pending) => {
                while let Some(c) = changes.get(*applied).filter(|c| c.row <= row) {
                    match engine.id(&c.model) {
                        Some(m) => engine.set_known(m, Some(Known::Share(c.share))),
                        None => {
                            pending
                                .entry(c.model.clone())
                                .and_modify(|(_, share)| *share = c.share)
                                .or_insert((c.row, c.share));
                        }
                    }
                    *applied += 1;
                }
                // Only a row's own model can have been registered since.
                if !pending.is_empty()
                    && let Some((_, share)) = pending.remove(engine.name(id))
                {
                    engine.set_known(id, Some(Known::Share(share)));
                }
            }
        }
    }

    /// After the last row: a known share whose model never came (not in
    /// the registry, never in the trace) is an error, as it is most likely
    /// a misspelt name whose model ran on its estimate without a word.
    pub fn finish(&self) -> Result<(), String> {
        let Foresight::Rates(_, _, pending) = self else {
            return Ok(());
        };
        let mut never: Vec<(&String, &(u64, f64))> = pending.iter().collect();
        never.sort_by_key(|(_, (row, _))| *row);
        match never.first() {
            None => Ok(()),
            Some((model, (row, _))) => Err(format!(
                "model {model:?} of the known rates (from row {row}) is neither in the registry nor in the trace"
            )),
        }
    }
}

/// The rows of a known-rates file; an error names its line.
fn parse_rates(text: &str) -> Result<Vec<RateChange>, String> {
    let mut changes: Vec<RateChange> = Vec::new();
    for (i, line) in text.lines().enumerate() {
        let line = line.trim();
        if line.is_empty() || (i == 0 && line.starts_with("row")) {
            continue;
        }
        let bad = |problem: String| format!("{}: {problem}", i + 1);
        let fields: Vec<&str> = line.split(',').collect();
        let [row, model, share] = fields[..] else {
            return Err(bad(format!(
                "expected row,model,share, got {} fields",
                fields.len()
            )));
        };
        let row: u64 = row
            .trim()
            .parse()
            .map_err(|_| bad(format!("row {row:?} is not a whole number")))?;
        let share: f64 = share
            .trim()
            .parse()
            .map_err(|_| bad(format!("share {share:?} is not a number")))?;
        if !(0.0..=1.0).contains(&share) {
            return Err(bad(format!("share {share} is not between 0 and 1")));
        }
        if changes.last().is_some_and(|c| c.row > row) {
            return Err(bad(format!("row {row} comes after a later row")));
        }
        let model = model.trim();
        if model.is_empty() {
            return Err(bad("the model is empty".to_owned()));
        }
        changes.push(RateChange {
            row,
            model: model.to_owned(),
            share,
        });
    }
    Ok(changes)
}

#[cfg(test)]
mod tests {
    use super::super::{ReplayOptions, Report, replay_trace};
    use super::*;
    use crate::engine::Eviction;

    const GIB: u64 = 1 << 30;

    #[test]
    fn rates_parse_with_a_header_and_refuse_what_is_wrong_by_line() {
        let ok = parse_rates("row,model,share\n0,a,0.5\n0,b,0.5\n\n7,a,0\n").unwrap();
        assert_eq!(ok.len(), 3);
        assert_eq!(
            ok[2],
            RateChange {
                row: 7,
                model: "a".into(),
                share: 0.0
            }
        );
        for (text, problem) in [
            ("0,a\n", "1: expected row,model,share, got 2 fields"),
            ("x,a,0.1\n", "1: row \"x\" is not a whole number"),
            ("0,a,y\n", "1: share \"y\" is not a number"),
            ("0,a,1.5\n", "1: share 1.5 is not between 0 and 1"),
            ("0,a,NaN\n", "1: share NaN is not between 0 and 1"),
            ("5,a,0.1\n2,b,0.1\n", "2: row 2 comes after a later row"),
            ("0, ,0.1\n", "1: the model is empty"),
        ] {
            assert_eq!(parse_rates(text).unwrap_err(), problem, "{text:?}");
        }
    }

    /// Three models of 10 GiB on a 20 GiB GPU, no warm tier: c's load
    /// must evict a or b. The rate estimate keeps a, asked for more often
    /// so far; both ceilings keep b, the one asked for from then on.
    #[test]
    fn the_ceilings_keep_the_model_the_future_asks_for() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("trace.csv");
        let rows = ["a", "a", "a", "b", "c", "b", "b", "b"];
        let csv: String = rows
            .iter()
            .enumerate()
            .map(|(i, m)| format!("{i},{m}\n"))
            .collect();
        std::fs::write(&path, csv).unwrap();
        let rates_path = dir.path().join("rates.csv");
        std::fs::write(&rates_path, "row,model,share\n0,a,0.1\n0,b,0.8\n0,c,0.1\n").unwrap();
        let replay = |foresight: Option<Foresight>| {
            let mut engine = Engine::new(20 * GIB);
            engine.set_eviction(Eviction::Rate);
            for m in ["a", "b", "c"] {
                engine.register(m, 10 * GIB, false).unwrap();
            }
            let mut trace = TraceReader::open(&path).unwrap();
            let options = ReplayOptions {
                foresight,
                ..Default::default()
            };
            let r = replay_trace(&mut engine, &mut trace, options, |_| {}).unwrap();
            (r.loads, r.hits)
        };
        // Estimated: c evicts b, b's return evicts c: a, b, c, b loaded.
        assert_eq!(replay(None), (4, 4));
        // Both ceilings: c evicts a, and b stays for its three requests.
        assert_eq!(replay(Some(Foresight::clairvoyant(&path).unwrap())), (3, 5));
        assert_eq!(replay(Some(Foresight::rates(&rates_path).unwrap())), (3, 5));
    }

    /// A 20 GiB GPU under `--eviction rate` where model `a` (10 GiB) is
    /// registered.
    fn rate_engine() -> Engine {
        let mut engine = Engine::new(20 * GIB);
        engine.set_eviction(Eviction::Rate);
        engine.register("a", 10 * GIB, false).unwrap();
        engine
    }

    /// `trace` replayed on [`rate_engine`] with the known rates `rates`.
    fn replay_known(trace: &str, rates: &str) -> Result<Report, TraceError> {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("trace.csv");
        std::fs::write(&path, trace).unwrap();
        let rates_path = dir.path().join("rates.csv");
        std::fs::write(&rates_path, rates).unwrap();
        let mut engine = rate_engine();
        let mut trace = TraceReader::open(&path).unwrap();
        let options = ReplayOptions {
            foresight: Some(Foresight::rates(&rates_path).unwrap()),
            ..Default::default()
        };
        replay_trace(&mut engine, &mut trace, options, |_| {})
    }

    #[test]
    fn a_known_rate_for_a_model_not_in_the_registry_is_an_error() {
        // Named twice: the error points to the first row that names it.
        let e = replay_known("0,a\n1,a\n", "0,a,0.5\n0,ghost,0.5\n1,ghost,0.3\n").unwrap_err();
        assert!(
            e.to_string().contains(
                "model \"ghost\" of the known rates (from row 0) is neither in the registry nor in the trace"
            ),
            "{e}"
        );
    }

    /// A model the trace registers (its first row gives a size) takes the
    /// share the rates gave it before that row, from its first request on.
    #[test]
    fn a_known_rate_waits_for_the_row_that_registers_its_model() {
        let rates = "0,a,0.5\n0,late,0.2\n1,late,0.4\n";
        let dir = tempfile::tempdir().unwrap();
        let rates_path = dir.path().join("rates.csv");
        std::fs::write(&rates_path, rates).unwrap();
        let mut engine = rate_engine();
        let mut foresight = Foresight::rates(&rates_path).unwrap();
        let a = engine.id("a").unwrap();
        foresight.at(&mut engine, 0, a);
        foresight.at(&mut engine, 1, a);
        assert!(foresight.finish().is_err(), "late not seen yet");
        let late = engine.register("late", 10 * GIB, false).unwrap();
        assert_eq!(engine.known(late), None);
        foresight.at(&mut engine, 2, late);
        assert_eq!(engine.known(late), Some(Known::Share(0.4)));
        assert_eq!(foresight.finish(), Ok(()));
        // And through the replay itself.
        let r = replay_known("0,a\n1,a\n2,late,10Gi\n", rates).unwrap();
        assert_eq!(r.loads, 2);
    }
}
