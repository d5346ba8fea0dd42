//! Copies following the load: one model ramped from 1 to 64 concurrent
//! streaming clients and back, through the real router to four GPUs of the
//! stand-in's node that also hold a model each of their own, with the
//! operator's copy scaler reading the router's in-flight counts.
//!
//! The fake servers model a GPU's batch: up to `batch` streams decode at
//! the stream delay per chunk, more slow every stream down in proportion
//! (`kubelet-standin.residency.dev/batch`), so one copy under 64 streams is
//! slower and copies are what brings latency back.
//!
//! Printed: the copies over time; the p99 latency at the plateau against
//! the same plateau on four copies fixed in advance (`copies.min: 4`),
//! measured in the same run; the other models' requests (none may fail);
//! additions followed by a removal within one delay (flaps, goal 0).
//!
//! `cargo bench --bench copies` (`-- --step-secs N --plateau-secs N
//! --routers N`: with 2 routers the load is split over two replicas, and
//! the copy counts must be the same, the signal being summed).

mod support;

use kube::api::{Api, PostParams};
use model_residency::api::{ModelResidency, ModelState};
use model_residency::controller::Context;
use model_residency::controller::copies::CopiesConfig;
use model_residency::engine::copies::CopyPolicy;
use model_residency::local::kubelet::{FakeKubelet, KubeletConfig};
use model_residency::local::model_server::BATCH_ANNOTATION;
use model_residency::router::{Config, Router};
use serde_json::json;
use std::net::SocketAddr;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::time::{Duration, Instant};
use support::*;

const NODE: &str = "node-copies";
const GPUS: u32 = 4;
/// Streams one copy decodes at full speed; the scaler's target per copy.
const BATCH: u32 = 16;
const DELAY_SECS: u64 = 20;

fn residency(i: u32, min: u32) -> ModelResidency {
    let template = |model: &str| {
        json!({
        "metadata": {"annotations": {BATCH_ANNOTATION: BATCH.to_string()}},
        "spec": {"containers": [{"name": "server", "image": format!("example/{model}:1")}]}})
    };
    serde_json::from_value(json!({
        "apiVersion": "residency.dev/v1alpha1", "kind": "ModelResidency",
        "metadata": {"name": format!("gpu-{i}")},
        "spec": {"nodeName": NODE, "device": i.to_string(), "budget": "16Gi", "gpu": {"mode": "env"},
            "models": [
                {"name": "chat", "size": "8Gi", "template": template("chat"),
                 "copies": {"min": min, "max": GPUS, "targetInFlight": BATCH, "scaleDownDelay": format!("{DELAY_SECS}s")}},
                {"name": format!("other-{i}"), "size": "4Gi", "template": template("other")}]},
    }))
    .unwrap()
}

/// Latencies of finished requests, with the time each finished.
type Samples = Arc<std::sync::Mutex<Vec<(Instant, Duration)>>>;

/// A client looping streamed requests for `model` through `routers` (in
/// turn) while `active` and not `stop`.
fn client(
    routers: Vec<SocketAddr>,
    model: String,
    active: Arc<AtomicBool>,
    stop: Arc<AtomicBool>,
    samples: Samples,
    failed: Arc<AtomicUsize>,
) -> tokio::task::JoinHandle<()> {
    tokio::spawn(async move {
        let body = json!({"model": model, "stream": true, "max_tokens": 20,
            "messages": [{"role": "user", "content": "hi"}]})
        .to_string();
        // Bounded: 100,000 requests at most, whatever the times.
        for k in 0..100_000usize {
            if stop.load(Ordering::Relaxed) {
                return;
            }
            if !active.load(Ordering::Relaxed) {
                tokio::time::sleep(Duration::from_millis(50)).await;
                continue;
            }
            let addr = routers[k % routers.len()];
            let t = Instant::now();
            match model_residency::http::send(addr, "POST", "/v1/chat/completions", &body).await {
                Ok(a) if a.status == 200 && a.body.contains("[DONE]") => {
                    samples.lock().unwrap().push((Instant::now(), t.elapsed()));
                }
                _ => {
                    failed.fetch_add(1, Ordering::Relaxed);
                }
            }
        }
    })
}

struct Run {
    /// (seconds since start, copies) at each change.
    changes: Vec<(f64, usize)>,
    plateau_p99: Duration,
    plateau_p50: Duration,
    failed_chat: usize,
    failed_other: usize,
    other_served: usize,
    flaps: usize,
    max_copies: usize,
}

async fn copies_now(api: &Api<ModelResidency>) -> usize {
    let list = api.list(&Default::default()).await.unwrap();
    list.items
        .iter()
        .filter(|r| r.model_state("chat") == ModelState::Loaded)
        .count()
}

/// Ramps chat's clients 1, 2, 4 .. 64 (a step each `step`), holds 64 for
/// `plateau`, ramps back to 1 and holds 1 for three delays; the other
/// models get one client each throughout.
async fn ramp(
    client_api: &kube::Client,
    ns: &str,
    routers: &[SocketAddr],
    (step, plateau): (Duration, Duration),
    fixed: bool,
) -> Run {
    let api: Api<ModelResidency> = Api::namespaced(client_api.clone(), ns);
    for i in 0..GPUS {
        api.create(
            &PostParams::default(),
            &residency(i, if fixed { GPUS } else { 1 }),
        )
        .await
        .unwrap();
    }
    // The first requests load chat once and each other model on its GPU.
    for i in 0..GPUS {
        let a = model_residency::http::send(
            routers[0],
            "POST",
            "/v1/chat/completions",
            &json!({"model": format!("other-{i}"), "messages": []}).to_string(),
        )
        .await
        .unwrap();
        assert_eq!(a.status, 200, "{}", a.body);
    }
    let a = model_residency::http::send(
        routers[0],
        "POST",
        "/v1/chat/completions",
        &json!({"model": "chat", "messages": []}).to_string(),
    )
    .await
    .unwrap();
    assert_eq!(a.status, 200, "{}", a.body);
    let stop = Arc::new(AtomicBool::new(false));
    let (chat_samples, other_samples): (Samples, Samples) = Default::default();
    let (chat_failed, other_failed) =
        (Arc::new(AtomicUsize::new(0)), Arc::new(AtomicUsize::new(0)));
    let mut tasks = Vec::new();
    for i in 0..GPUS {
        tasks.push(client(
            routers.to_vec(),
            format!("other-{i}"),
            Arc::new(AtomicBool::new(true)),
            stop.clone(),
            other_samples.clone(),
            other_failed.clone(),
        ));
    }
    let switches: Vec<Arc<AtomicBool>> =
        (0..64).map(|_| Arc::new(AtomicBool::new(false))).collect();
    for s in &switches {
        tasks.push(client(
            routers.to_vec(),
            "chat".into(),
            s.clone(),
            stop.clone(),
            chat_samples.clone(),
            chat_failed.clone(),
        ));
    }
    let started = Instant::now();
    let mut changes = vec![(0.0, copies_now(&api).await)];
    let mut plan: Vec<(usize, Duration)> =
        [1, 2, 4, 8, 16, 32].iter().map(|&n| (n, step)).collect();
    plan.push((64, plateau));
    plan.extend([32, 16, 8, 4, 2].iter().map(|&n| (n, step)));
    plan.push((1, Duration::from_secs(3 * DELAY_SECS)));
    let mut plateau_window = (started, started);
    for (clients, hold) in plan {
        for (k, s) in switches.iter().enumerate() {
            s.store(k < clients, Ordering::Relaxed);
        }
        let from = Instant::now();
        while from.elapsed() < hold {
            let n = copies_now(&api).await;
            if n != changes.last().unwrap().1 {
                changes.push((started.elapsed().as_secs_f64(), n));
            }
            tokio::time::sleep(Duration::from_millis(250)).await;
        }
        if clients == 64 {
            // The plateau's second half: copies have had the first to come.
            plateau_window = (from + hold / 2, Instant::now());
        }
    }
    stop.store(true, Ordering::Relaxed);
    futures::future::join_all(tasks).await;
    let mut plateau: Vec<Duration> = chat_samples
        .lock()
        .unwrap()
        .iter()
        .filter(|(at, _)| *at >= plateau_window.0 && *at <= plateau_window.1)
        .map(|(_, d)| *d)
        .collect();
    plateau.sort();
    // A flap: a removal less than a delay after the change before it (the
    // status shows a change a little after it is decided: 5 % slack).
    let flaps = changes
        .windows(2)
        .filter(|w| w[1].1 < w[0].1 && w[1].0 - w[0].0 < DELAY_SECS as f64 * 0.95)
        .count();
    let max_copies = changes.iter().map(|c| c.1).max().unwrap_or(0);
    for i in 0..GPUS {
        api.delete(&format!("gpu-{i}"), &Default::default())
            .await
            .unwrap();
    }
    Run {
        changes,
        plateau_p99: percentile(&plateau, 0.99),
        plateau_p50: percentile(&plateau, 0.50),
        failed_chat: chat_failed.load(Ordering::Relaxed),
        failed_other: other_failed.load(Ordering::Relaxed),
        other_served: other_samples.lock().unwrap().len(),
        flaps,
        max_copies,
    }
}

fn main() {
    let args = bench_args();
    let step = Duration::from_secs(arg(&args, "--step-secs", "8").parse().unwrap());
    let plateau = Duration::from_secs(arg(&args, "--plateau-secs", "40").parse().unwrap());
    let replicas: usize = arg(&args, "--routers", "1").parse().unwrap();
    let plane = start_plane();
    let rt = runtime();
    rt.block_on(async {
        let client = client_with(&plane, &[]).await;
        let mut config = KubeletConfig::instant(&[NODE]);
        config.nodes[0].gpus = GPUS;
        let _kubelet = FakeKubelet::start(client.clone(), config).await.unwrap();
        let mut results = Vec::new();
        for (ns, fixed) in [("copies-scaled", false), ("copies-fixed", true)] {
            create_namespace(&client, ns).await;
            let mut routers = Vec::new();
            let mut serving = Vec::new();
            for _ in 0..replicas {
                let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
                routers.push(listener.local_addr().unwrap());
                let router = Router::start(client.clone(), Config { namespace: Some(ns.into()), ..Config::default() });
                serving.push((router.clone(), tokio::spawn(router.clone().serve(listener))));
                while !router.ready() {
                    tokio::time::sleep(Duration::from_millis(20)).await;
                }
            }
            let mut ctx = Context::new(client.clone());
            Arc::get_mut(&mut ctx).unwrap().copies = CopiesConfig {
                routers: routers.clone(),
                tick: Duration::from_secs(1),
                drain_grace: Duration::from_millis(500),
                defaults: CopyPolicy { window: 10.0, ..CopyPolicy::default() },
                ..CopiesConfig::default()
            };
            let operator = model_residency::operator::spawn_with(ctx, ns);
            let run = ramp(&client, ns, &routers, (step, plateau), fixed).await;
            operator.abort();
            for (_, s) in serving {
                s.abort();
            }
            let label = if fixed { "fixed 4 copies" } else { "scaled copies" };
            println!("== {label} ({replicas} router replica(s)): copies over time (s, copies): {:?}", run.changes);
            println!("   plateau (64 clients) p50 {:.1} ms, p99 {:.1} ms; chat failed {}, other models served {} failed {}; flaps {}; most copies {}",
                ms(run.plateau_p50), ms(run.plateau_p99), run.failed_chat, run.other_served, run.failed_other, run.flaps, run.max_copies);
            results.push(run);
        }
        let (scaled, fixed) = (&results[0], &results[1]);
        println!("scaled / fixed: plateau p99 {:.2}x (goal <= 1.2x), p50 {:.2}x",
            ms(scaled.plateau_p99) / ms(fixed.plateau_p99), ms(scaled.plateau_p50) / ms(fixed.plateau_p50));
    });
}
