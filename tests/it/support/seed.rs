//! The seed's registry and its five cases (docs/design.md), shared by the
//! operator's and the router's seed-case tests.

use super::operator::{Harness, Model};
use model_residency::api::ModelResidency;
use model_residency::engine::Engine;
use std::collections::BTreeSet;

pub const MI: u64 = 1 << 20;

pub const SEED: &[Model<'static>] = &[
    ("zimage", "10900Mi", false),
    ("qwen-llm", "3000Mi", false),
    ("sdxl", "6000Mi", false),
    ("oversized", "20000Mi", false),
    ("small-a", "4000Mi", false),
    ("small-b", "4000Mi", false),
    ("small-c", "4000Mi", false),
];

/// The seed's cases: (budget in MiB, requests in order).
pub const SEED_CASES: &[(u64, &[&str])] = &[
    (14000, &["zimage", "zimage", "qwen-llm"]),
    (11000, &["zimage", "qwen-llm", "zimage", "qwen-llm"]),
    (16000, &["oversized"]),
    (
        9000,
        &["small-a", "small-b", "small-a", "small-c", "small-a"],
    ),
    (16000, &["zimage", "sdxl", "qwen-llm", "zimage", "sdxl"]),
];

/// The engine the seed's cases run on, with a budget of `budget_mb` MiB.
pub fn seed_engine(budget_mb: u64) -> Engine {
    let mut e = Engine::new(budget_mb * MI);
    for (n, s, _) in SEED {
        let mb: u64 = s.trim_end_matches("Mi").parse().unwrap();
        e.register(n, mb * MI, false).unwrap();
    }
    e
}

/// The residency `name` as the seed's engine `engine` has it after the same
/// requests: the same counters, and a live pod for exactly its residents.
pub async fn assert_matches_the_engine(
    h: &Harness,
    name: &str,
    r: &ModelResidency,
    engine: &Engine,
) {
    let s = r.status.as_ref().expect("a status");
    let c = engine.counters();
    assert_eq!(
        (
            s.counters.hits,
            s.counters.loads,
            s.counters.evictions,
            s.counters.refusals
        ),
        (c.hits, c.loads, c.evictions, c.refusals),
        "{name} counters"
    );
    let want: BTreeSet<String> = engine
        .residents()
        .iter()
        .map(|&id| engine.name(id).to_owned())
        .collect();
    assert_eq!(h.pods_of(name).await.0, want, "{name} live pods");
}
