//! Balancing among a model's copies: `least-in-flight` against
//! `prefix-hash` (src/router/balance.rs), through the real router to four
//! copies of one model on four GPUs of the stand-in's node, whose fake
//! model servers keep a KV cache of prompt prefixes (eight slots; a cached
//! prefix answers after 5 ms, another after 60 ms, as a server with prefix
//! caching prefills faster).
//!
//! The workload: 48 system prompts of 120 characters, chosen with a Zipf
//! popularity (weight 1/rank), each followed by a user message of its own;
//! 16 clients at once, 50 requests each, the same sequence for both
//! strategies (each run has prompts of its own, so neither finds the
//! other's cache warm). Printed: the prefix-cache hit rate (the servers'
//! own counts), p50 and p99 latency, requests per second, and the ratios
//! of prefix-hash to least-in-flight in the same run.
//!
//! Then adapter affinity: four copies of a base model with LoRA adapters
//! (24 of them, three held per pod, the fake speaking vLLM's adapter API),
//! requests naming adapters with a Zipf popularity, the same sequence
//! through a router that sends a request to a copy holding its adapter
//! first (the router as it ships) and one that balances by in-flight
//! requests alone. Printed: the adapter loads and evictions per request
//! (the router's counts) and p50/p99 latency; each load is a call to the
//! server (vLLM's is milliseconds for the tiny model, `benches/adapters.rs`,
//! more for larger adapters; the fake's is immediate, so the latencies
//! here show the router's side only).
//!
//! `cargo bench --bench balance` (`-- --clients N --requests N --prompts N`).

mod support;

use k8s_openapi::api::core::v1::Pod;
use kube::api::{Api, ListParams, PostParams};
use model_residency::api::{ModelResidency, ModelState};
use model_residency::local::kubelet::{FakeKubelet, KubeletConfig};
use model_residency::local::model_server::PREFIX_CACHE_ANNOTATION;
use model_residency::router::balance::Strategy;
use model_residency::router::{Config, Router};
use serde_json::json;
use std::net::SocketAddr;
use std::time::{Duration, Instant};
use support::*;

const NS: &str = "balance";
const NODE: &str = "node-balance";
const COPIES: u32 = 4;

/// The adapters of the base model `tuned`.
const ADAPTERS: usize = 24;

fn residency(i: u32, adapters: &std::path::Path) -> ModelResidency {
    let declared: Vec<_> = (0..ADAPTERS)
        .map(|a| json!({"name": format!("t{a:02}"), "rank": 8, "path": adapters.join(format!("t{a:02}"))}))
        .collect();
    serde_json::from_value(json!({
        "apiVersion": "residency.dev/v1alpha1", "kind": "ModelResidency",
        "metadata": {"name": format!("gpu-{i}")},
        "spec": {"nodeName": NODE, "device": i.to_string(), "budget": "64Gi", "models": [
            {"name": "chat", "size": "8Gi", "template": {
                "metadata": {"annotations": {PREFIX_CACHE_ANNOTATION: "slots=8,hit=5ms,miss=60ms"}},
                "spec": {"containers": [{"name": "server", "image": "example/chat:1"}]}}},
            {"name": "tuned", "size": "8Gi",
                "lora": {"slots": 2, "hostSlots": 3, "maxRank": 16, "adapters": declared},
                "template": {"spec": {"containers": [{"name": "server", "image": "example/tuned:1"}]}}}]},
    }))
    .unwrap()
}

/// A small deterministic generator (xorshift).
fn rng(seed: u64) -> impl FnMut() -> u64 {
    let mut x = seed | 1;
    move || {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        x
    }
}

/// Prompt ranks for every request, Zipf (1/rank) over `prompts`.
fn ranks(n: usize, prompts: usize) -> Vec<usize> {
    let weights: Vec<f64> = (1..=prompts).map(|r| 1.0 / r as f64).collect();
    let total: f64 = weights.iter().sum();
    let mut next = rng(0xba1a);
    (0..n)
        .map(|_| {
            let mut u = (next() % 1_000_000) as f64 / 1_000_000.0 * total;
            weights
                .iter()
                .position(|w| {
                    u -= w;
                    u < 0.0
                })
                .unwrap_or(prompts - 1)
        })
        .collect()
}

/// The copies' prefix-cache counts, summed: (hits, misses).
async fn cache_counts(pods: &[SocketAddr]) -> (u64, u64) {
    let (mut hits, mut misses) = (0, 0);
    for pod in pods {
        let a = model_residency::http::send(*pod, "GET", "/fake/stats", "")
            .await
            .unwrap();
        let v: serde_json::Value = serde_json::from_str(&a.body).unwrap();
        hits += v["prefix_hits"].as_u64().unwrap();
        misses += v["prefix_misses"].as_u64().unwrap();
    }
    (hits, misses)
}

struct Run {
    hit_rate: f64,
    p50: Duration,
    p99: Duration,
    per_sec: f64,
}

/// A router of `config` serving on a loopback port once its watches have
/// listed: its address, itself and its serving task.
async fn start_router(
    client: &kube::Client,
    config: Config,
) -> (
    SocketAddr,
    std::sync::Arc<Router>,
    tokio::task::JoinHandle<()>,
) {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let router = Router::start(client.clone(), config);
    let serving = tokio::spawn(router.clone().serve(listener));
    while !router.ready() {
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    (addr, router, serving)
}

/// A chat completion to `addr`: the answer and its time.
async fn chat(
    addr: SocketAddr,
    body: &serde_json::Value,
) -> (model_residency::http::Answer, Duration) {
    let t = Instant::now();
    let a = model_residency::http::send(addr, "POST", "/v1/chat/completions", &body.to_string())
        .await
        .unwrap();
    (a, t.elapsed())
}

async fn run(
    client: &kube::Client,
    strategy: Strategy,
    pods: &[SocketAddr],
    (clients, requests, prompts): (usize, usize, usize),
) -> Run {
    let config = Config {
        namespace: Some(NS.into()),
        balance: strategy,
        ..Config::default()
    };
    let (addr, _router, serving) = start_router(client, config).await;
    let before = cache_counts(pods).await;
    let order = ranks(clients * requests, prompts);
    let started = Instant::now();
    let mut tasks = Vec::new();
    for c in 0..clients {
        let mine: Vec<usize> = order[c * requests..(c + 1) * requests].to_vec();
        tasks.push(tokio::spawn(async move {
            let mut times = Vec::with_capacity(mine.len());
            for (k, rank) in mine.into_iter().enumerate() {
                // 120 characters, the first 100 of them the key.
                let system = format!("{strategy:?} system prompt {rank:03} ").repeat(5);
                let body = json!({"model": "chat", "messages": [
                    {"role": "system", "content": &system[..120]},
                    {"role": "user", "content": format!("question {c}-{k}")}]});
                let (a, took) = chat(addr, &body).await;
                assert_eq!(a.status, 200, "{}", a.body);
                times.push(took);
            }
            times
        }));
    }
    let mut times = Vec::new();
    for t in tasks {
        times.extend(t.await.unwrap());
    }
    let elapsed = started.elapsed();
    serving.abort();
    let after = cache_counts(pods).await;
    times.sort();
    let (hits, misses) = (after.0 - before.0, after.1 - before.1);
    Run {
        hit_rate: hits as f64 / (hits + misses).max(1) as f64,
        p50: percentile(&times, 0.50),
        p99: percentile(&times, 0.99),
        per_sec: times.len() as f64 / elapsed.as_secs_f64(),
    }
}

struct AdapterRun {
    /// Requests answered 503: every slot of the pod busy serving.
    busy: u64,
    loads: u64,
    evictions: u64,
    p50: Duration,
    p99: Duration,
}

/// The same Zipf sequence of adapter requests through a router with or
/// without adapter affinity.
async fn adapter_run(
    client: &kube::Client,
    affinity: bool,
    (clients, requests): (usize, usize),
    dir: &std::path::Path,
) -> AdapterRun {
    let config = Config {
        namespace: Some(NS.into()),
        adapter_affinity: affinity,
        ..Config::default()
    };
    let (addr, router, serving) = start_router(client, config).await;
    let order = ranks(clients * requests, ADAPTERS);
    let mut tasks = Vec::new();
    for c in 0..clients {
        let mine: Vec<usize> = order[c * requests..(c + 1) * requests].to_vec();
        let dir = dir.to_owned();
        tasks.push(tokio::spawn(async move {
            let mut times = Vec::with_capacity(mine.len());
            let mut busy = 0u64;
            for rank in mine {
                let body = json!({"model": format!("t{rank:02}"), "max_tokens": 1,
                    "messages": [{"role": "user", "content": "hello"}]});
                let (a, took) = chat(addr, &body).await;
                // Every slot of the chosen pod busy serving: 503 with
                // Retry-After, counted.
                if a.status == 503 {
                    busy += 1;
                    continue;
                }
                assert_eq!(
                    a.status,
                    200,
                    "{} (its config on disk: {})",
                    a.body,
                    dir.join(format!("t{rank:02}/adapter_config.json")).exists()
                );
                times.push(took);
            }
            (times, busy)
        }));
    }
    let (mut times, mut busy) = (Vec::new(), 0);
    for t in tasks {
        let (t, b) = t.await.unwrap();
        times.extend(t);
        busy += b;
    }
    serving.abort();
    times.sort();
    AdapterRun {
        busy,
        loads: router
            .metrics
            .sum_where("model_residency_router_adapter_loads_total", ""),
        evictions: router
            .metrics
            .sum_where("model_residency_router_adapter_evictions_total", ""),
        p50: percentile(&times, 0.50),
        p99: percentile(&times, 0.99),
    }
}

fn main() {
    let args = bench_args();
    let clients: usize = arg(&args, "--clients", "16").parse().unwrap();
    let requests: usize = arg(&args, "--requests", "50").parse().unwrap();
    let prompts: usize = arg(&args, "--prompts", "48").parse().unwrap();
    let plane = start_plane();
    let rt = runtime();
    rt.block_on(async {
        let client = client_with(&plane, &[NS]).await;
        let mut config = KubeletConfig::instant(&[NODE]);
        config.nodes[0].gpus = COPIES;
        let _kubelet = FakeKubelet::start(client.clone(), config).await.unwrap();
        let (_ctx, _operator) = model_residency::operator::spawn_for_namespace(client.clone(), NS);
        let api: Api<ModelResidency> = Api::namespaced(client.clone(), NS);
        let adapters = tempfile::tempdir().unwrap();
        let files: Vec<(String, u64, u64)> =
            (0..ADAPTERS).map(|a| (format!("t{a:02}"), 8, a as u64)).collect();
        let files: Vec<(&str, u64, u64)> = files.iter().map(|(n, r, s)| (n.as_str(), *r, *s)).collect();
        model_residency::local::vllm::write_adapters(adapters.path(), "tuned", &files).unwrap();
        for i in 0..COPIES {
            api.create(&PostParams::default(), &residency(i, adapters.path())).await.unwrap();
            let name = format!("gpu-{i}");
            for model in ["chat", "tuned"] {
                model_residency::residency::demand::load(&api, &name, model, k8s_openapi::jiff::Timestamp::now())
                    .await
                    .unwrap();
            }
        }
        for i in 0..COPIES {
            for model in ["chat", "tuned"] {
                until_state_of(&api, &format!("gpu-{i}"), model, ModelState::Loaded, Duration::from_secs(60)).await;
            }
        }
        let pods: Api<Pod> = Api::namespaced(client.clone(), NS);
        let addrs: Vec<SocketAddr> = pods
            .list(&ListParams::default().labels("residency.dev/model=chat"))
            .await
            .unwrap()
            .items
            .into_iter()
            .filter_map(|p| format!("{}:8080", p.status?.pod_ip?).parse().ok())
            .collect();
        assert_eq!(addrs.len(), COPIES as usize, "one copy per GPU");
        println!(
            "== {COPIES} copies of one model; {clients} clients x {requests} requests, {prompts} system prompts (Zipf); prefix cache 8 slots per copy, 5 ms hit, 60 ms miss"
        );
        println!("{:<16} {:>9} {:>9} {:>9} {:>12}", "strategy", "hit rate", "p50 ms", "p99 ms", "requests/s");
        let mut results = Vec::new();
        for strategy in [Strategy::LeastInFlight, Strategy::PrefixHash] {
            let r = run(&client, strategy, &addrs, (clients, requests, prompts)).await;
            println!(
                "{:<16} {:>8.1}% {:>9.1} {:>9.1} {:>12.1}",
                format!("{strategy:?}"),
                r.hit_rate * 100.0,
                ms(r.p50),
                ms(r.p99),
                r.per_sec
            );
            results.push(r);
        }
        let (base, prefix) = (&results[0], &results[1]);
        println!(
            "prefix-hash / least-in-flight: hit rate {:.2}x, p50 {:.2}x, p99 {:.2}x, throughput {:.2}x",
            prefix.hit_rate / base.hit_rate.max(1e-9),
            ms(prefix.p50) / ms(base.p50),
            ms(prefix.p99) / ms(base.p99),
            prefix.per_sec / base.per_sec
        );
        let total = clients * requests;
        println!(
            "== adapter affinity: {COPIES} copies of a base model, {ADAPTERS} adapters (Zipf), 3 held per pod; {clients} clients x {requests} requests"
        );
        println!("{:<16} {:>14} {:>18} {:>9} {:>9} {:>6}", "router", "loads/request", "evictions/request", "p50 ms", "p99 ms", "busy");
        let mut runs = Vec::new();
        for affinity in [false, true] {
            let r = adapter_run(&client, affinity, (clients, requests), adapters.path()).await;
            println!(
                "{:<16} {:>14.3} {:>18.3} {:>9.2} {:>9.2} {:>6}",
                if affinity { "affinity" } else { "in-flight only" },
                r.loads as f64 / total as f64,
                r.evictions as f64 / total as f64,
                ms(r.p50),
                ms(r.p99),
                r.busy
            );
            runs.push(r);
        }
        println!(
            "affinity / in-flight only: loads {:.2}x, p50 {:.2}x, p99 {:.2}x",
            runs[1].loads as f64 / runs[0].loads.max(1) as f64,
            ms(runs[1].p50) / ms(runs[0].p50),
            ms(runs[1].p99) / ms(runs[0].p99)
        );
    });
}
