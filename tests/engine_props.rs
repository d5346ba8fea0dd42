//! Property tests: the engine agrees with the naive reference
//! (tests/support/reference.rs) step by step on random registries, budgets
//! (including shrinks) and request/unload/resize/pin/loading sequences of up
//! to 10^4 steps: same outcome, same victims, same counters, `used <=
//! budget`, a refused or queued request changes nothing, and no request
//! evicts a loading model. With the warm tier and either policy: both
//! budgets hold after every step, recounted from each model's state; a
//! request evicts or sleeps no loading or pinned model, and keeps the model
//! it is for.

#[path = "it/support/reference.rs"]
mod reference;

use model_residency::engine::{
    Admission, Bytes, Costs, Engine, Eviction, ModelId, RefuseReason, Resize, Sleep,
};
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
                        Admission::Woken { .. } => unreachable!("no model sleeps here"),
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

#[derive(Clone, Debug)]
enum WarmOp {
    Request(usize),
    Unload(usize),
    SetBudget(u64),
    SetHostBudget(u64),
    Resize(usize, u64),
    SetPinned(usize, bool),
    SetLoading(usize, bool),
}

fn warm_op(models: usize) -> impl Strategy<Value = WarmOp> {
    prop_oneof![
        12 => (0..models).prop_map(WarmOp::Request),
        2 => (0..models).prop_map(WarmOp::Unload),
        1 => (1u64..=120).prop_map(WarmOp::SetBudget),
        1 => (0u64..=80).prop_map(WarmOp::SetHostBudget),
        1 => (0..models, 1u64..=60).prop_map(|(m, s)| WarmOp::Resize(m, s)),
        1 => (0..models, proptest::bool::weighted(0.2)).prop_map(|(m, p)| WarmOp::SetPinned(m, p)),
        4 => (0..models, any::<bool>()).prop_map(|(m, l)| WarmOp::SetLoading(m, l)),
    ]
}

/// A model: size, pinned, how it sleeps (sleeping size as a share of the
/// size, host memory), load and wake seconds.
type WarmModel = (u64, bool, Option<(u64, u64)>, (u32, u32));

fn warm_scenario() -> impl Strategy<Value = (u64, u64, Eviction, Vec<WarmModel>, Vec<WarmOp>)> {
    (1usize..20).prop_flat_map(|n| {
        (
            1u64..=120,
            0u64..=80,
            prop_oneof![
                Just(Eviction::Lru),
                Just(Eviction::Cost),
                Just(Eviction::Rate)
            ],
            prop::collection::vec(
                (
                    1u64..=60,
                    proptest::bool::weighted(0.1),
                    proptest::option::weighted(0.6, (0u64..=99, 0u64..=40)),
                    (1u32..=90, 1u32..=10),
                ),
                n,
            ),
            prop::collection::vec(warm_op(n), 1..4_000),
        )
    })
}

/// What the models hold, recounted from their states: VRAM, host memory.
fn recount(e: &Engine, ids: &[ModelId]) -> (Bytes, Bytes) {
    ids.iter()
        .filter(|&&id| e.is_resident(id))
        .map(|&id| match e.sleep_of(id) {
            Some(s) if e.is_asleep(id) => (s.sleeping_size, s.host_memory),
            _ => (e.size(id), 0),
        })
        .fold((0, 0), |(v, h), (a, b)| (v + a, h + b))
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 96, ..ProptestConfig::default() })]

    #[test]
    fn the_warm_tier_keeps_both_budgets_under_every_policy(
        (budget, host_budget, eviction, models, ops) in warm_scenario()
    ) {
        let mut e = Engine::new(budget);
        e.set_eviction(eviction);
        e.set_host_budget(host_budget);
        let ids: Vec<ModelId> = models
            .iter()
            .enumerate()
            .map(|(i, &(size, pinned, sleep, (load, wake)))| {
                let id = e.register(&format!("m{i}"), size, pinned).unwrap();
                if let Some((share, host)) = sleep {
                    let sleeping_size = size * share / 100;
                    if sleeping_size < size {
                        e.set_sleep(id, Some(Sleep { sleeping_size, host_memory: host })).unwrap();
                    }
                }
                e.set_costs(id, Costs { load: f64::from(load), wake: f64::from(wake) });
                id
            })
            .collect();
        for (step, op) in ops.iter().enumerate() {
            let before: Vec<(ModelId, bool)> =
                e.residents().into_iter().map(|id| (id, e.is_asleep(id))).collect();
            let counters = e.counters();
            match *op {
                WarmOp::Request(m) => {
                    let id = ids[m];
                    let protected: Vec<ModelId> = before
                        .iter()
                        .map(|&(r, _)| r)
                        .filter(|&r| e.is_loading(r) || e.is_pinned(r))
                        .collect();
                    let outcome = match e.request(id) {
                        Admission::Hit => "hit",
                        Admission::Loaded { .. } => "loaded",
                        Admission::Woken { .. } => "woken",
                        Admission::Queued { .. } => "queued",
                        Admission::Refused(_) => "refused",
                    };
                    let after: Vec<(ModelId, bool)> =
                        e.residents().into_iter().map(|r| (r, e.is_asleep(r))).collect();
                    if matches!(outcome, "queued" | "refused" | "hit") {
                        let mut a = after.clone();
                        let mut b = before.clone();
                        a.sort();
                        b.sort();
                        prop_assert_eq!(a, b, "step {}: a {} changed residents", step, outcome);
                    } else {
                        prop_assert!(e.is_resident(id) && !e.is_asleep(id), "step {}: {} but not awake", step, outcome);
                    }
                    for r in protected {
                        let kept = after.iter().any(|&(a, asleep)| a == r && (!asleep || before.contains(&(r, true))));
                        prop_assert!(kept || r == id, "step {}: a request took a loading or pinned model", step);
                    }
                    let c = e.counters();
                    let woke = u64::from(outcome == "woken");
                    prop_assert_eq!(c.wakes, counters.wakes + woke);
                    prop_assert_eq!(c.sleeps - counters.sleeps, e.last_slept().len() as u64);
                    for &s in e.last_slept() {
                        prop_assert!(e.is_asleep(s), "step {}: a slept model is not asleep", step);
                    }
                }
                WarmOp::Unload(m) => {
                    e.unload(ids[m]);
                }
                WarmOp::SetBudget(b) => {
                    e.set_budget(b);
                }
                WarmOp::SetHostBudget(b) => {
                    e.set_host_budget(b);
                }
                WarmOp::Resize(m, s) => {
                    e.resize(ids[m], s).unwrap();
                }
                WarmOp::SetPinned(m, p) => e.set_pinned(ids[m], p),
                WarmOp::SetLoading(m, l) => e.set_loading(ids[m], l),
            }
            let (vram, host) = recount(&e, &ids);
            prop_assert_eq!(e.used(), vram, "step {}: {:?}", step, op);
            prop_assert_eq!(e.host_used(), host, "step {}: {:?}", step, op);
            prop_assert!(vram <= e.budget(), "step {}: over the VRAM budget", step);
            prop_assert!(host <= e.host_budget(), "step {}: over the host budget", step);
            prop_assert!(e.peak() >= vram);
        }
    }
}
