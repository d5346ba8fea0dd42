use super::*;
use crate::engine::{Costs, Eviction, Sleep};

/// The warm-tier trace of docs/performance.md, smaller: 20 models of
/// 14-18 GiB under a 64 GiB budget, Zipf(1) popularity, loads of
/// 30-90 s and wakes of 0.5-6 s (or 60 s and 3 s for all with
/// `same_costs`), sleeping at 1-2 GiB with their size in host memory.
type WarmModel = (String, Bytes, Costs, Sleep);

fn warm_trace(same_costs: bool) -> (Vec<WarmModel>, Vec<String>) {
    let mut state = 0x5eed_u64;
    let mut next = move || {
        state = state.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = state;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        ((z ^ (z >> 31)) >> 11) as f64 / (1u64 << 53) as f64
    };
    let models: Vec<_> = (0..20)
        .map(|i| {
            let size = (14 + (next() * 5.0) as u64) << 30;
            let costs = if same_costs {
                Costs {
                    load: 60.0,
                    wake: 3.0,
                }
            } else {
                Costs {
                    load: 30.0 + 60.0 * next(),
                    wake: 0.5 + 5.5 * next(),
                }
            };
            let sleep = Sleep {
                sleeping_size: (1 + (next() * 2.0) as u64) << 30,
                host_memory: size,
            };
            (format!("m{i}"), size, costs, sleep)
        })
        .collect();
    let total: f64 = (1..=20).map(|r| 1.0 / r as f64).sum();
    let requests = (0..30_000)
        .map(|_| {
            let mut u = next() * total;
            let mut rank = 0;
            while rank < 19 && u > 1.0 / (rank + 1) as f64 {
                u -= 1.0 / (rank + 1) as f64;
                rank += 1;
            }
            format!("m{}", (rank * 7) % 20)
        })
        .collect();
    (models, requests)
}

fn waiting(same_costs: bool, host_budget: Option<Bytes>, eviction: Eviction) -> Report {
    let (models, requests) = warm_trace(same_costs);
    let mut engine = Engine::new(64 << 30);
    engine.set_eviction(eviction);
    for (name, size, costs, sleep) in models {
        let id = engine.register(&name, size, false).unwrap();
        engine.set_costs(id, costs);
        if host_budget.is_some() {
            engine.set_sleep(id, Some(sleep)).unwrap();
        }
    }
    engine.set_host_budget(host_budget.unwrap_or(0));
    replay_names(&mut engine, &requests).unwrap()
}

#[test]
fn the_warm_tier_with_cost_waits_five_times_less_than_the_seeds_lru() {
    for same_costs in [false, true] {
        let lru = waiting(same_costs, None, Eviction::Lru);
        let cost = waiting(same_costs, None, Eviction::Cost);
        let warm_lru = waiting(same_costs, Some(256 << 30), Eviction::Lru);
        let warm_cost = waiting(same_costs, Some(256 << 30), Eviction::Cost);
        let ratio = |r: &Report| lru.wait_seconds / r.wait_seconds;
        eprintln!(
            "same costs {same_costs}: lru {:.0}s, cost {:.2}x, warm lru {:.2}x, warm cost {:.2}x",
            lru.wait_seconds,
            ratio(&cost),
            ratio(&warm_lru),
            ratio(&warm_cost)
        );
        assert_eq!((lru.sleeps, lru.wakes), (0, 0));
        assert_eq!(lru.over_budget_steps + warm_cost.over_budget_steps, 0);
        assert!(
            ratio(&cost) >= 1.0,
            "cost waits longer than lru without the warm tier"
        );
        assert!(ratio(&warm_lru) > 1.0, "the warm tier does not help lru");
        assert!(
            ratio(&warm_cost) >= 5.0,
            "warm cost: {:.2}x",
            ratio(&warm_cost)
        );
    }
}

/// #39: `rate` with the warm tier against the seed's LRU and `cost`
/// with the warm tier, on the same built-in trace.
#[test]
fn the_warm_tier_with_rate_waits_less_than_with_cost() {
    for same_costs in [false, true] {
        let lru = waiting(same_costs, None, Eviction::Lru);
        let warm_cost = waiting(same_costs, Some(256 << 30), Eviction::Cost);
        let warm_rate = waiting(same_costs, Some(256 << 30), Eviction::Rate);
        let rate = waiting(same_costs, None, Eviction::Rate);
        let vs_lru = lru.wait_seconds / warm_rate.wait_seconds;
        let vs_cost = warm_cost.wait_seconds / warm_rate.wait_seconds;
        eprintln!(
            "same costs {same_costs}: warm rate {vs_lru:.2}x lru, {vs_cost:.2}x warm cost; rate alone {:.2}x lru",
            lru.wait_seconds / rate.wait_seconds
        );
        assert_eq!(warm_rate.over_budget_steps + rate.over_budget_steps, 0);
        assert!(vs_lru >= 8.0, "warm rate: {vs_lru:.2}x the seed's LRU");
        assert!(vs_cost >= 1.1, "warm rate: {vs_cost:.2}x warm cost");
        assert!(
            rate.wait_seconds < lru.wait_seconds,
            "rate waits longer than lru without the warm tier"
        );
    }
}

#[test]
fn keep_alive_unloads_idle_models_before_the_next_request() {
    // a at 0, b at 1, a again at 3, c at 20, a at 21; all fit.
    let text = "time,model,size\n0,a,1\n1,b,1\n3,a\n20,c,1\n21,a\n";
    let run = |keep_alive| {
        let mut engine = Engine::new(10);
        let reader = Box::new(std::io::Cursor::new(text.to_owned()));
        let mut trace = TraceReader::from_reader(reader, "t.csv");
        let options = ReplayOptions {
            keep_alive,
            ..Default::default()
        };
        replay_trace(&mut engine, &mut trace, options, |_| {}).unwrap()
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
    let report = replay_trace(&mut engine, &mut trace, ReplayOptions::default(), |_| {}).unwrap();
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
    let err = replay_trace(
        &mut Engine::new(10),
        &mut trace,
        ReplayOptions::default(),
        |_| {},
    )
    .unwrap_err();
    assert_eq!(
        err.to_string(),
        "t.csv:2: model \"b\" is not in the registry and the row gives no size"
    );
}

#[test]
fn a_recency_resolution_folds_hits_into_fewer_writes() {
    // a and b fit together; c needs a's room. Hits on a at 1..4 fold
    // into one write at 5; b at 2 and 6; c at 7 evicts the least
    // recently *written*: b (6) is newer than a's folded write (5).
    let text = "time,model,size\n0,a,4\n1,a\n2,b,4\n3,a\n4,a\n6,b\n7,c,4\n8,a\n";
    let run = |recency_resolution| {
        let mut engine = Engine::new(8);
        let mut trace = TraceReader::from_reader(Box::new(text.as_bytes()), "t.csv");
        let options = ReplayOptions {
            recency_resolution,
            ..Default::default()
        };
        replay_trace(&mut engine, &mut trace, options, |_| {}).unwrap()
    };
    let exact = run(None);
    assert_eq!(run(Some(0.0)), exact, "a zero resolution is exact");
    assert_eq!(exact.demand_writes, 8);
    let coarse = run(Some(5.0));
    // Writes: a@0 (load), b@2 (load), a@5 (hits at 1, 3, 4 folded),
    // b@7 (the hit at 6, due a resolution after b@2), c@7 (load,
    // evicts a: written at 5, before b's 7), a@8 (load, evicts b).
    assert_eq!(coarse.demand_writes, 6, "{coarse:?}");
    assert_eq!(
        (coarse.hits, coarse.loads, coarse.evictions),
        (4, 4, 2),
        "{coarse:?}"
    );
    assert_eq!(
        (exact.hits, exact.loads, exact.evictions),
        (4, 4, 2),
        "{exact:?}"
    );

    // Where it changes the outcome: a's hit at 3 is not written by 4,
    // so c evicts a (written at 0) instead of b (written at 2).
    let text = "time,model,size\n0,a,4\n2,b,4\n3,a\n4,c,4\n";
    let resident_after = |recency_resolution| {
        let mut engine = Engine::new(8);
        let mut trace = TraceReader::from_reader(Box::new(text.as_bytes()), "t.csv");
        let options = ReplayOptions {
            recency_resolution,
            ..Default::default()
        };
        replay_trace(&mut engine, &mut trace, options, |_| {}).unwrap();
        let a = engine.id("a").unwrap();
        engine.is_resident(a)
    };
    assert!(resident_after(None));
    assert!(!resident_after(Some(5.0)));
}
