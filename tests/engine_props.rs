//! Property tests: the engine agrees with the naive reference
//! (tests/support/reference.rs) step by step on random registries, budgets
//! (including shrinks) and request/unload/resize/pin/loading sequences of up
//! to 10^4 steps: same outcome, same victims, same counters, `used <=
//! budget`, a refused or queued request changes nothing, and no request
//! evicts a loading model.

#[path = "it/support/reference.rs"]
mod reference;

use model_residency::engine::{Admission, Engine, ModelId, RefuseReason, Resize};
use proptest::prelude::*;
use reference::{Outcome, Reference};

#[derive(Clone, Debug)]
enum Op {
    Request(usize),
    Unload(usize),
    SetBudget(u64),
    Resize(usize, u64),
    SetPinned(usize, bool),
    SetLoading(usize, bool),
}

fn op(models: usize) -> impl Strategy<Value = Op> {
    prop_oneof![
        12 => (0..models).prop_map(Op::Request),
        2 => (0..models).prop_map(Op::Unload),
        1 => (1u64..=120).prop_map(Op::SetBudget),
        1 => (0..models, 1u64..=60).prop_map(|(m, s)| Op::Resize(m, s)),
        1 => (0..models, proptest::bool::weighted(0.2)).prop_map(|(m, p)| Op::SetPinned(m, p)),
        4 => (0..models, any::<bool>()).prop_map(|(m, l)| Op::SetLoading(m, l)),
    ]
}

fn scenario() -> impl Strategy<Value = (u64, Vec<(u64, bool)>, Vec<Op>)> {
    (1usize..24).prop_flat_map(|n| {
        (
            1u64..=120,
            prop::collection::vec((1u64..=60, proptest::bool::weighted(0.15)), n),
            prop::collection::vec(op(n), 1..10_000),
        )
    })
}

fn reason(r: RefuseReason) -> &'static str {
    r.as_str()
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 96, ..ProptestConfig::default() })]

    #[test]
    fn engine_matches_the_naive_reference((budget, models, ops) in scenario()) {
        let mut engine = Engine::new(budget);
        let handles: Vec<ModelId> = models
            .iter()
            .enumerate()
            .map(|(i, &(size, pinned))| engine.register(&format!("m{i}"), size, pinned).unwrap())
            .collect();
        let mut reference = Reference::new(budget, &models);
        // The reference names models by registration index.
        let ids = |v: &[ModelId]| -> Vec<usize> {
            v.iter().map(|id| handles.iter().position(|h| h == id).unwrap()).collect()
        };

        for (step, op) in ops.iter().enumerate() {
            let before = engine.residents();
            match *op {
                Op::Request(m) => {
                    let want = reference.request(m);
                    let loading: Vec<ModelId> =
                        before.iter().copied().filter(|&id| engine.is_loading(id)).collect();
                    let got = match engine.request(handles[m]) {
                        Admission::Hit => Outcome::Hit,
                        Admission::Loaded { evicted } => Outcome::Loaded(ids(evicted)),
                        Admission::Queued { loading } => Outcome::Queued(loading),
                        Admission::Refused(r) => Outcome::Refused(reason(r)),
                    };
                    prop_assert_eq!(&got, &want, "step {}: {:?}", step, op);
                    if matches!(got, Outcome::Refused(_) | Outcome::Queued(_)) {
                        prop_assert_eq!(engine.residents(), before.clone(), "a refusal or queue evicted something");
                    }
                    let after = engine.residents();
                    for id in loading {
                        prop_assert!(after.contains(&id), "step {}: a request evicted a loading model", step);
                    }
                }
                Op::Unload(m) => {
                    prop_assert_eq!(engine.unload(handles[m]), reference.unload(m));
                }
                Op::SetBudget(b) => {
                    let got = ids(engine.set_budget(b));
                    prop_assert_eq!(got, reference.set_budget(b), "step {}: {:?}", step, op);
                }
                Op::Resize(m, s) => {
                    let want = reference.resize(m, s);
                    let got = match engine.resize(handles[m], s).unwrap() {
                        Resize::NotResident => Ok(vec![]),
                        Resize::Kept { evicted } => Ok(ids(evicted)),
                        Resize::Dropped(r) => Err(reason(r)),
                    };
                    prop_assert_eq!(got, want, "step {}: {:?}", step, op);
                }
                Op::SetPinned(m, p) => {
                    engine.set_pinned(handles[m], p);
                    reference.set_pinned(m, p);
                }
                Op::SetLoading(m, l) => {
                    engine.set_loading(handles[m], l);
                    reference.set_loading(m, l);
                }
            }
            prop_assert!(engine.used() <= engine.budget(), "step {}: over budget", step);
            prop_assert_eq!(engine.used(), reference.used());
            prop_assert_eq!(engine.loading_used(), reference.loading_used());
            prop_assert_eq!(ids(&engine.residents()), reference.residents(), "step {}", step);
            let c = engine.counters();
            let t = &reference.totals;
            prop_assert_eq!(
                (c.hits, c.loads, c.evictions, c.refusals, c.unloads),
                (t.hits, t.loads, t.evictions, t.refusals, t.unloads)
            );
            prop_assert_eq!(engine.peak(), reference.peak);
        }
    }
}
