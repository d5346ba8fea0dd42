//! Throughput of the residency engine and of `simulate` end to end.
//!
//! Run: `cargo bench --bench simulate [-- --requests N --models M --budget Q]`
//! (defaults: 10,000,000 requests over 1,000 Zipf-popular models, sizes
//! 256Mi..2Gi, budget 80Gi).
//!
//! Prints three figures measured in the same run on the same requests:
//! - end to end: a CSV trace file (`time,model,size`) read, parsed and
//!   replayed by the same code the `simulate --trace` command runs;
//! - engine alone: the requests pre-resolved to model ids;
//! - the naive O(n) reference from tests/it/support (the seed's algorithm),
//!   with the engine's speed-up over it.
//!
//! The counters of all three are compared, so a fast wrong engine fails.
//!
//! `cargo bench --bench simulate -- gangs [--requests N]` (default 20,000)
//! prints instead the gang table of docs/performance.md: a node of 4 GPUs
//! of 40Gi serving one tensor-parallel-2 model (30Gi on each of its GPUs,
//! 90 s loads) and eight single-GPU models (8Gi..22Gi, 30 s loads) on a
//! Zipf(1) trace, one request every 3 s on average, 2 s each; the TP-2
//! model at popularity rank 1, 5 and 9. Each row replays the same trace
//! twice in the same run: the TP-2 model a gang in the four GPUs' shared
//! budgets, and given two GPUs of its own (the singles on the other two,
//! as systems without shared budgets place it).

#[path = "../tests/it/support/reference.rs"]
mod reference;

use model_residency::engine::{Engine, ModelId};
use model_residency::quantity::{format_bytes, parse_bytes};
use model_residency::simulate::trace::TraceReader;
use model_residency::simulate::{ReplayOptions, replay_trace};
use std::io::{BufWriter, Write};
use std::time::Instant;

/// splitmix64: a small, good-enough PRNG so the bench needs no extra crate.
struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^ (z >> 31)
    }
    /// Uniform in [0, 1).
    fn unit(&mut self) -> f64 {
        (self.next() >> 11) as f64 / (1u64 << 53) as f64
    }
}

/// Zipf(s = 1) popularity over `n` models: rank r has weight 1/r.
struct Zipf {
    cdf: Vec<f64>,
}

impl Zipf {
    fn new(n: usize) -> Self {
        let mut acc = 0.0;
        let mut cdf: Vec<f64> = (1..=n)
            .map(|r| {
                acc += 1.0 / r as f64;
                acc
            })
            .collect();
        for c in &mut cdf {
            *c /= acc;
        }
        Zipf { cdf }
    }
    fn sample(&self, rng: &mut Rng) -> usize {
        let u = rng.unit();
        self.cdf.partition_point(|&c| c < u).min(self.cdf.len() - 1)
    }
}

struct Config {
    requests: usize,
    models: usize,
    budget: u64,
    reference: bool,
}

fn parse_args() -> Config {
    let mut cfg = Config {
        requests: 10_000_000,
        models: 1_000,
        budget: 80 << 30,
        reference: true,
    };
    let mut args = std::env::args().skip(1);
    while let Some(a) = args.next() {
        let mut value = || args.next().unwrap_or_else(|| panic!("{a} needs a value"));
        match a.as_str() {
            "--requests" => cfg.requests = value().parse().expect("--requests N"),
            "--models" => cfg.models = value().parse().expect("--models M"),
            "--budget" => cfg.budget = parse_bytes(&value()).expect("--budget Q"),
            "--no-reference" => cfg.reference = false,
            "--bench" => {} // passed by `cargo bench`
            other => panic!("unknown argument {other}"),
        }
    }
    cfg
}

fn rate(n: usize, secs: f64) -> String {
    format!(
        "{:>7.2} M requests/s ({:.1} ns/request)",
        n as f64 / secs / 1e6,
        secs * 1e9 / n as f64
    )
}

fn main() {
    if std::env::args().nth(1).as_deref() == Some("gangs") {
        return gangs();
    }
    let cfg = parse_args();
    let mut rng = Rng(0x5eed);
    let sizes: Vec<u64> = (0..cfg.models)
        .map(|_| (256 + rng.next() % (2048 - 256 + 1)) << 20)
        .collect();
    let zipf = Zipf::new(cfg.models);
    let requests: Vec<u32> = (0..cfg.requests)
        .map(|_| zipf.sample(&mut rng) as u32)
        .collect();
    println!(
        "simulate bench: {} requests, {} Zipf(1) models of 256Mi..2Gi, budget {}",
        cfg.requests,
        cfg.models,
        format_bytes(cfg.budget)
    );

    // The trace file, as a user would hand it to `simulate --trace`.
    let dir = tempfile::tempdir().expect("temp dir");
    let path = dir.path().join("trace.csv");
    {
        let mut w = BufWriter::with_capacity(1 << 20, std::fs::File::create(&path).unwrap());
        writeln!(w, "time,model,size").unwrap();
        for (t, &m) in requests.iter().enumerate() {
            writeln!(w, "{t},model-{m},{}", sizes[m as usize]).unwrap();
        }
    }
    let trace_bytes = std::fs::metadata(&path).unwrap().len();

    // End to end: file -> parse -> engine.
    let start = Instant::now();
    let mut engine = Engine::new(cfg.budget);
    let mut trace = TraceReader::open(&path).expect("open trace");
    let report = replay_trace(&mut engine, &mut trace, ReplayOptions::default(), |_| {})
        .expect("valid trace");
    let e2e = start.elapsed().as_secs_f64();
    assert_eq!(report.requests as usize, cfg.requests);
    assert_eq!(report.over_budget_steps, 0);

    // Engine alone, same requests, ids resolved up front.
    let mut engine = Engine::new(cfg.budget);
    let ids: Vec<ModelId> = sizes
        .iter()
        .enumerate()
        .map(|(i, &s)| engine.register(&format!("model-{i}"), s, false).unwrap())
        .collect();
    let start = Instant::now();
    for &m in &requests {
        engine.request(ids[m as usize]);
    }
    let alone = start.elapsed().as_secs_f64();
    let c = engine.counters();
    assert_eq!(
        (c.hits, c.loads, c.evictions),
        (report.hits, report.loads, report.evictions),
        "engine alone disagrees with the trace replay"
    );

    println!(
        "  trace file        {:.1} MiB",
        trace_bytes as f64 / (1u64 << 20) as f64
    );
    println!(
        "  hits {} loads {} evictions {} refusals {} hit ratio {:.2}% peak {}",
        c.hits,
        c.loads,
        c.evictions,
        c.refusals,
        100.0 * report.hit_ratio(),
        format_bytes(engine.peak())
    );
    println!(
        "  end to end        {}  [{e2e:.3} s]",
        rate(cfg.requests, e2e)
    );
    println!(
        "  engine alone      {}  [{alone:.3} s]",
        rate(cfg.requests, alone)
    );

    if cfg.reference {
        let models: Vec<(u64, bool)> = sizes.iter().map(|&s| (s, false)).collect();
        let mut naive = reference::Reference::new(cfg.budget, &models);
        let start = Instant::now();
        for &m in &requests {
            naive.request(m as usize);
        }
        let secs = start.elapsed().as_secs_f64();
        let t = &naive.totals;
        assert_eq!(
            (t.hits, t.loads, t.evictions),
            (c.hits, c.loads, c.evictions),
            "engine disagrees with the naive reference"
        );
        println!(
            "  naive reference   {}  [{secs:.3} s]",
            rate(cfg.requests, secs)
        );
        println!("  engine / reference speed-up: {:.1}x", secs / alone);
    }
}

/// The gang table (module docs).
fn gangs() {
    use model_residency::engine::Costs;
    use model_residency::engine::copies::CopyPolicy;
    use model_residency::simulate::fleet::{FleetOptions, replay_fleet};
    let mut requests = 20_000usize;
    let mut args = std::env::args().skip(2);
    while let Some(a) = args.next() {
        match a.as_str() {
            "--requests" => {
                requests = args
                    .next()
                    .and_then(|v| v.parse().ok())
                    .expect("--requests N")
            }
            "--bench" => {}
            other => panic!("unknown argument {other}"),
        }
    }
    const GIB: u64 = 1 << 30;
    let singles: Vec<(String, u64)> = (0..8)
        .map(|k| (format!("m{k}"), (8 + 2 * k) * GIB))
        .collect();
    println!(
        "gang table: 4 GPUs of 40Gi, one TP-2 model (30Gi a GPU, 90 s loads) and eight singles \
         (8Gi..22Gi, 30 s loads); {requests} Zipf(1) requests, 3 s apart on average, 2 s each"
    );
    println!(
        "{:>9} | {:>12} {:>12} {:>6} | {:>12} {:>12} {:>6} | {:>6}",
        "TP-2 rank", "shared wait", "TP-2 wait", "loads", "own GPUs", "TP-2 wait", "loads", "ratio"
    );
    for rank in [1usize, 5, 9] {
        // Popularity order: the TP-2 model at `rank`, the singles around it.
        let mut order: Vec<&str> = singles.iter().map(|(n, _)| n.as_str()).collect();
        order.insert(rank - 1, "tp2");
        let zipf = Zipf::new(order.len());
        let mut rng = Rng(0x9a46 + rank as u64);
        let mut text = String::from("time,model\n");
        let mut t = 0.0f64;
        for _ in 0..requests {
            t += -3.0 * (1.0 - rng.unit()).ln();
            text.push_str(&format!("{t:.3},{}\n", order[zipf.sample(&mut rng)]));
        }
        let mut engine = Engine::new(40 * GIB);
        let tp = engine.register("tp2", 30 * GIB, false).unwrap();
        engine.set_costs(
            tp,
            Costs {
                load: 90.0,
                wake: 5.0,
            },
        );
        for (name, size) in &singles {
            let id = engine.register(name, *size, false).unwrap();
            engine.set_costs(
                id,
                Costs {
                    load: 30.0,
                    wake: 3.0,
                },
            );
        }
        let run = |dedicated: bool| {
            let mut trace = TraceReader::from_reader(
                Box::new(std::io::Cursor::new(text.clone().into_bytes())),
                "zipf",
            );
            let options = FleetOptions {
                gpus: 4,
                service: 2.0,
                tick: 5.0,
                policy: CopyPolicy {
                    max: 1,
                    ..CopyPolicy::default()
                },
                dedicated,
                outages: Vec::new(),
                pre_move: true,
            };
            let r = replay_fleet(&engine, &[("tp2".into(), 2)], &mut trace, options).unwrap();
            assert_eq!(r.over_budget_steps, 0, "a GPU over its budget: {r:?}");
            assert!(r.peaks.iter().all(|&p| p <= 40 * GIB), "{r:?}");
            r
        };
        let (shared, own) = (run(false), run(true));
        println!(
            "{rank:>9} | {:>11.0}s {:>11.0}s {:>6} | {:>11.0}s {:>11.0}s {:>6} | {:>5.2}x",
            shared.wait_seconds,
            shared.gang_wait_seconds,
            shared.loads,
            own.wait_seconds,
            own.gang_wait_seconds,
            own.loads,
            shared.wait_seconds / own.wait_seconds,
        );
    }
    println!(
        "(ratio: waiting with the gang in the shared budgets over waiting with its own GPUs; below 1 is better)"
    );
}
