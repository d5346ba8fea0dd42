//! The seed's self-test cases (design.md, "The policy"), counters exact.
//! Sizes are the seed's MB read as Mi.

use model_residency::engine::{Admission, Counters, Engine, RefuseReason};

const MI: u64 = 1 << 20;

fn seed_engine(budget_mb: u64) -> Engine {
    let mut e = Engine::new(budget_mb * MI);
    for (name, mb) in [
        ("zimage", 10900),
        ("qwen-llm", 3000),
        ("sdxl", 6000),
        ("oversized", 20000),
        ("small-a", 4000),
        ("small-b", 4000),
        ("small-c", 4000),
    ] {
        e.register(name, mb * MI, false).unwrap();
    }
    e
}

/// Replays the requests, checking the invariant after every step.
fn run(budget_mb: u64, requests: &[&str]) -> Engine {
    let mut e = seed_engine(budget_mb);
    for r in requests {
        e.request_named(r);
        assert!(e.used() <= e.budget(), "over budget after {r}");
    }
    e
}

fn counters(hits: u64, loads: u64, evictions: u64, refusals: u64) -> Counters {
    Counters {
        hits,
        loads,
        evictions,
        refusals,
        unloads: 0,
        sleeps: 0,
        wakes: 0,
        ..Counters::default()
    }
}

#[test]
fn t2_two_models_fit_then_hit() {
    let e = run(14000, &["zimage", "zimage", "qwen-llm"]);
    assert_eq!(e.counters(), counters(1, 2, 0, 0));
    assert_eq!(e.used(), 13900 * MI);
}

#[test]
fn t3_thrash_when_two_do_not_fit() {
    let e = run(11000, &["zimage", "qwen-llm", "zimage", "qwen-llm"]);
    assert_eq!(e.counters(), counters(0, 4, 3, 0));
}

#[test]
fn t4_oversized_is_refused_not_force_loaded() {
    let mut e = seed_engine(16000);
    let zimage = e.id("zimage").unwrap();
    e.request(zimage);
    let outcome = e.request_named("oversized");
    assert_eq!(
        outcome,
        Admission::Refused(RefuseReason::LargerThanBudget {
            size: 20000 * MI,
            budget: 16000 * MI
        })
    );
    // Nothing was evicted to make room for a model that can never fit.
    assert!(e.is_resident(zimage));
    assert_eq!(e.counters(), counters(0, 1, 0, 1));

    let e = run(16000, &["oversized"]);
    assert_eq!(e.counters(), counters(0, 0, 0, 1));
    assert_eq!(e.used(), 0);
}

#[test]
fn t5_lru_keeps_the_hot_model() {
    let e = run(
        9000,
        &["small-a", "small-b", "small-a", "small-c", "small-a"],
    );
    assert_eq!(e.counters(), counters(2, 3, 1, 0));
    // small-b (least recently used at the time) was the victim.
    let names: Vec<&str> = e.residents().iter().map(|&id| e.name(id)).collect();
    assert_eq!(names, ["small-c", "small-a"]);
}

#[test]
fn neg1_never_over_budget() {
    let e = run(16000, &["zimage", "sdxl", "qwen-llm", "zimage", "sdxl"]);
    assert!(e.peak() <= 16000 * MI);
    assert_eq!(e.peak(), 13900 * MI); // zimage + qwen-llm
}

#[test]
fn exact_fit_is_admitted() {
    let mut e = Engine::new(10);
    let a = e.register("a", 4, false).unwrap();
    let b = e.register("b", 6, false).unwrap();
    e.request(a);
    assert_eq!(e.request(b), Admission::Loaded { evicted: &[] });
    assert_eq!(e.used(), 10);
}
