//! Anticipation on real production traces (#69): the ServeGen m-mid
//! series (`../shared/data/servegen/m-mid-traces.tgz`, 109 clients over 14
//! days) drawn as the arrivals of 109 models (one per client) on 4 GPUs, idle models
//! unloaded after 10 minutes (`spec.keepAlive: 10m`)
//! ([`model_residency::simulate::servegen`], sizes and load times by
//! [`model_residency::simulate::timeline::servegen_models`]), replayed in
//! time under four policies per seed: the seed's `lru`, today's best online
//! policy (`rate` + the warm tier), `anticipate`, and the clairvoyant
//! reference that also pre-loads.
//!
//! Run: `cargo bench --bench anticipation [-- --seeds 1,2,3 --days 14
//! --models 109 --gpus 4 --budget 80Gi --host-budget 64Gi --cap 0.1
//! --keep-alive 600 --traces PATH]` (`--keep-alive 0`: none). Prints a row per policy and seed, then per seed the
//! share of the gap between `rate+warm` and the reference that
//! `anticipate` closes, its p99 against `rate+warm`'s, and the share of
//! its work ahead that was wasted.

use model_residency::engine::anticipation::Limits;
use model_residency::quantity::parse_bytes;
use model_residency::simulate::servegen::{Drawing, arrivals, read};
use model_residency::simulate::timeline::{Policy, Setup, TimelineReport, replay, servegen_models};
use std::path::PathBuf;
use std::time::Instant;

fn arg(args: &[String], name: &str, default: &str) -> String {
    args.iter()
        .position(|a| a == name)
        .and_then(|i| args.get(i + 1))
        .cloned()
        .unwrap_or_else(|| default.to_owned())
}

fn row(seed: u64, r: &TimelineReport, secs: f64) {
    println!(
        "{seed:>4} {:<20} {:>12.0} {:>8.2} {:>8.2} {:>8.2} {:>8.2} {:>8.3} {:>7.3}% {:>7.3}% {:>7} {:>7} {:>9.0} {:>7} {:>6} {:>6} {:>6}/{:<6} {:>6}/{:<6} {:>6.1}",
        r.policy,
        r.requests,
        r.p50_wait,
        r.p99_wait,
        r.p999_wait,
        r.p9999_wait,
        r.mean_wait,
        100.0 * r.within_1s,
        100.0 * r.within_10s,
        r.loads,
        r.wakes,
        r.load_seconds,
        r.ahead_loads + r.ahead_wakes,
        r.ahead_used,
        r.ahead_wasted,
        r.quiet_hits,
        r.quiet_returns,
        r.daily_hits,
        r.daily_returns,
        secs,
    );
}

fn main() {
    let args: Vec<String> = std::env::args().collect();
    let traces = PathBuf::from(arg(
        &args,
        "--traces",
        concat!(
            env!("CARGO_MANIFEST_DIR"),
            "/../shared/data/servegen/m-mid-traces.tgz"
        ),
    ));
    let seeds: Vec<u64> = arg(&args, "--seeds", "1,2,3")
        .split(',')
        .map(|s| s.parse().expect("--seeds: numbers"))
        .collect();
    let days: f64 = arg(&args, "--days", "14").parse().unwrap();
    let models: usize = arg(&args, "--models", "109").parse().unwrap();
    let gpus: usize = arg(&args, "--gpus", "4").parse().unwrap();
    let cap: f64 = arg(&args, "--cap", "0.1").parse().unwrap();
    let budget = parse_bytes(&arg(&args, "--budget", "80Gi")).unwrap();
    let host_budget = parse_bytes(&arg(&args, "--host-budget", "64Gi")).unwrap();
    let defaults = Limits::default();
    let limits = Limits {
        min_chance: arg(&args, "--min-chance", &defaults.min_chance.to_string())
            .parse()
            .unwrap(),
        hold: arg(&args, "--hold", &defaults.hold.to_string())
            .parse()
            .unwrap(),
        margin: arg(&args, "--margin", &defaults.margin.to_string())
            .parse()
            .unwrap(),
        ..defaults
    };
    let clients = read(&traces).unwrap_or_else(|e| panic!("{e}"));
    let setup = Setup {
        gpus,
        budget,
        host_budget,
        models: servegen_models(models, gpus),
        tick: 60.0,
        quiet: 3600.0,
        keep_alive: match arg(&args, "--keep-alive", "600").parse::<f64>().unwrap() {
            k if k > 0.0 => Some(k),
            _ => None,
        },
    };
    println!(
        "{} clients as {models} models on {gpus} GPUs of {} (host {} each), {days} days, drawn at most {cap}/s per client",
        clients.len(),
        arg(&args, "--budget", "80Gi"),
        arg(&args, "--host-budget", "64Gi"),
    );
    println!(
        "seed policy                   requests      p50      p99    p99.9   p99.99     mean  <=1s     <=10s     loads   wakes  load-s   ahead   used wasted quiet-hit    daily-hit     s"
    );
    let mut summary = Vec::new();
    for &seed in &seeds {
        let drawing = Drawing {
            models,
            cap,
            seed,
            until: Some(days * 86_400.0),
        };
        let started = Instant::now();
        let a = arrivals(&clients, &drawing);
        println!(
            "     ({} arrivals drawn in {:.1} s)",
            a.len(),
            started.elapsed().as_secs_f64()
        );
        let mut reports = Vec::new();
        for policy in [
            Policy::Lru,
            Policy::Rate,
            Policy::Anticipate(limits),
            Policy::Clairvoyant,
        ] {
            let started = Instant::now();
            let r = replay(&setup, policy, &a);
            row(seed, &r, started.elapsed().as_secs_f64());
            reports.push(r);
        }
        summary.push((seed, reports));
    }
    println!();
    println!(
        "seed  gap closed  p99.9 vs rate+warm  p99.99 vs rate+warm  wait vs rate+warm  wasted  daily first-request hits"
    );
    for (seed, r) in &summary {
        let (rate, ahead, best) = (&r[1], &r[2], &r[3]);
        let gap = rate.wait_total() - best.wait_total();
        let closed = if gap > 0.0 {
            (rate.wait_total() - ahead.wait_total()) / gap
        } else {
            f64::NAN
        };
        println!(
            "{seed:>4}  {:>9.1}%  {:>17.2}x  {:>18.2}x  {:>16.2}x  {:>5.1}%  {:>5.1}%",
            100.0 * closed,
            ahead.p999_wait / rate.p999_wait,
            ahead.p9999_wait / rate.p9999_wait,
            ahead.wait_total() / rate.wait_total(),
            100.0 * ahead.wasted_share(),
            100.0 * ahead.daily_hits as f64 / ahead.daily_returns.max(1) as f64,
        );
    }
}
