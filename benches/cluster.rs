//! The operator against the local control plane: latency, scale, memory.
//!
//! Run: `cargo bench --bench cluster -- <latency|scale|memory> [options]`
//! (needs `bash scripts/control-plane.sh` once). Prints its figures; the
//! ones in docs/performance.md came from these commands.
//!
//! - `latency [--samples N]`: apply-to-status (a demand patch until the
//!   status shows it processed, seen through a watch) against the floor
//!   measured in the same run (a ConfigMap annotation patch until a watch
//!   sees it, the same for a one-model ModelResidency and for a copy of the
//!   measured one); p50, p99 and their ratios.
//! - `scale [--counts 10,100,1000] [--models 20] [--nodes 100] [--steady S]`:
//!   N residencies on fake nodes, a demand storm, time to converge, API
//!   requests per reconcile, 409s, writes during S seconds of steady state;
//!   then the same storm alone, on copies no operator watches, with the
//!   operator stopped (the API server's own cost for it).
//! - `memory [--counts 1000,10000]`: `model-residency run` as a separate
//!   process; its RSS once N residencies and their pods have converged.
//! - `--catalog` (scale and memory): the residencies name one ModelCatalog
//!   of the models (each residency its first `--models`) instead of
//!   listing them inline; each model then has one size everywhere. Scale
//!   prints the bytes of one residency object as the API server returns it.
//! - `set [--nodes 100] [--gpus 10] [--load]`: one ResidencySet over the
//!   GPUs the fake nodes publish in their ResourceSlices (nodes x gpus, at
//!   most 128 a node), stamping a residency of 3 catalog models per GPU:
//!   time until every residency is stamped and Ready, the operator's RSS
//!   then (with `--load`, also once one model is loaded on each, as the
//!   memory mode's fleet), the time from one more GPU appearing in a
//!   slice to its residency Ready, and a restart over them (ready time,
//!   peak RSS, RSS 5 s after ready and 30 s after its start, when every
//!   residency has been reconciled again).
//! - `gang [--samples 30] [--load-ms 0]`: apply-to-status of a TP-2 gang's
//!   request beside a single model's, cold and as a hit
//!   (`benches/cluster/gangs.rs`).

use futures::StreamExt;
use k8s_openapi::api::core::v1::ConfigMap;
use k8s_openapi::jiff::Timestamp;
use kube::ResourceExt;
use kube::api::{Api, PostParams};
use kube::runtime::{WatchStreamExt, watcher};
use model_residency::api::{ModelResidency, ModelState};
use model_residency::controller::{self, Context};
use model_residency::local::control_plane::ControlPlane;
use model_residency::local::kubelet::{FakeKubelet, KubeletConfig};
use model_residency::metrics::{API_REQUESTS, RECONCILES};
use model_residency::residency::demand;
use serde_json::json;
use std::sync::Arc;
use std::time::{Duration, Instant};

mod support;

#[path = "cluster/gangs.rs"]
mod gangs;

use support::{
    CountedRuntime, arg, bench_args, copy_as_floor, copy_residency, create_namespace, ms,
    percentile, poke, runtime, start_plane, watch_named, watch_poke,
};

const NS: &str = "bench";
/// Where the ModelResidency floor object lives: no operator watches it.
const FLOOR_NS: &str = "bench-floor";
/// Where a copy of the measured residency (spec and status) lives, for the
/// round trip of an object of its size; no operator watches it either.
const SHAPED_FLOOR_NS: &str = "bench-floor-shaped";
/// Where the scale rounds' storm is sent again, to copies of the
/// residencies that no operator watches: the storm's own cost.
const STORM_FLOOR_NS: &str = "bench-storm-floor";

/// `--catalog`: the fleets name a ModelCatalog instead of inline models.
static CATALOG: std::sync::atomic::AtomicBool = std::sync::atomic::AtomicBool::new(false);
/// The catalog's name and how many models it holds.
const FLEET_CATALOG: &str = "fleet";
const CATALOG_MODELS: usize = 20;

fn catalog_mode() -> bool {
    CATALOG.load(std::sync::atomic::Ordering::Relaxed)
}

fn main() {
    let args = bench_args();
    if args.iter().any(|a| a == "--catalog") {
        CATALOG.store(true, std::sync::atomic::Ordering::Relaxed);
    }
    let mode = args.first().cloned().unwrap_or_else(|| "latency".into());
    let plane = start_plane();
    let rt = runtime();
    rt.block_on(async {
        let client = plane.client().await.unwrap();
        setup(&client).await;
        match mode.as_str() {
            "latency" => latency(&client, arg(&args, "--samples", "1000").parse().unwrap()).await,
            "scale" => {
                let counts: Vec<usize> = arg(&args, "--counts", "10,100,1000")
                    .split(',')
                    .map(|c| c.parse().unwrap())
                    .collect();
                let models: usize = arg(&args, "--models", "20").parse().unwrap();
                let nodes: usize = arg(&args, "--nodes", "100").parse().unwrap();
                let steady: u64 = arg(&args, "--steady", "60").parse().unwrap();
                scale(&plane, &client, &counts, models, nodes, steady).await
            }
            "memory" => {
                let counts: Vec<usize> = arg(&args, "--counts", "1000,10000")
                    .split(',')
                    .map(|c| c.parse().unwrap())
                    .collect();
                memory(&plane, &client, &counts).await
            }
            "set" => {
                let nodes: usize = arg(&args, "--nodes", "100").parse().unwrap();
                let gpus: u32 = arg(&args, "--gpus", "10").parse().unwrap();
                let load = args.iter().any(|a| a == "--load");
                stamped_set(&plane, &client, nodes, gpus, load).await
            }
            "gang" => {
                let samples = arg(&args, "--samples", "30").parse().unwrap();
                let load = Duration::from_millis(arg(&args, "--load-ms", "0").parse().unwrap());
                gangs::gang(&client, samples, load).await
            }
            other => panic!("unknown mode {other}: latency, scale, memory, set or gang"),
        }
    });
    println!(
        "control plane RSS at the end: {} MiB (etcd, apiserver, controller manager, scheduler)",
        plane.rss_bytes() >> 20
    );
}

async fn setup(client: &kube::Client) {
    model_residency::local::install_crd(client).await.unwrap();
    create_namespace(client, NS).await;
    if catalog_mode() || bench_args().first().is_some_and(|m| m == "set") {
        let models: Vec<_> = (0..CATALOG_MODELS)
            .map(|m| model_json(&format!("model-{m}"), &format!("{}Gi", 1 + (m * 7) % 4)))
            .collect();
        let catalog: model_residency::api::ModelCatalog = serde_json::from_value(json!({
            "apiVersion": "residency.dev/v1alpha1", "kind": "ModelCatalog",
            "metadata": {"name": FLEET_CATALOG}, "spec": {"models": models},
        }))
        .unwrap();
        Api::<model_residency::api::ModelCatalog>::namespaced(client.clone(), NS)
            .create(&PostParams::default(), &catalog)
            .await
            .unwrap();
    }
}

fn model_json(name: &str, size: &str) -> serde_json::Value {
    json!({"name": name, "size": size,
        "template": {"spec": {"containers": [{"name": "server", "image": format!("example/{name}:1")}]}}})
}

fn residency(name: &str, node: &str, budget: &str, models: &[(String, String)]) -> ModelResidency {
    if catalog_mode() {
        // The same models by name, from the catalog.
        let names: Vec<&str> = models.iter().map(|(n, _)| n.as_str()).collect();
        return serde_json::from_value(json!({
            "apiVersion": "residency.dev/v1alpha1", "kind": "ModelResidency",
            "metadata": {"name": name},
            "spec": {"nodeName": node, "device": gpu_of(name), "budget": budget,
                     "catalog": {"name": FLEET_CATALOG, "models": names}, "gpu": {"mode": "env"}},
        }))
        .unwrap();
    }
    let models: Vec<_> = models.iter().map(|(n, s)| model_json(n, s)).collect();
    serde_json::from_value(json!({
        "apiVersion": "residency.dev/v1alpha1", "kind": "ModelResidency",
        "metadata": {"name": name},
        // Env mode: the scale figures stay comparable with earlier runs (a
        // GPU of its own per residency, by a uuid no slice publishes); claim
        // mode's cost per load is the router bench's claim/env comparison.
        "spec": {"nodeName": node, "device": gpu_of(name), "budget": budget, "models": models,
                 "gpu": {"mode": "env"}},
    }))
    .unwrap()
}

/// A GPU of its own for each residency (two residencies on one GPU
/// conflict): a `GPU-` UUID made of the name's bytes in hex.
fn gpu_of(name: &str) -> String {
    let hex: String = name.bytes().map(|b| format!("{b:02x}")).collect();
    format!("GPU-{hex}")
}

fn start_operator(client: &kube::Client) -> (Arc<Context>, tokio::task::JoinHandle<()>) {
    model_residency::operator::spawn_for_namespace(client.clone(), NS)
}

async fn latency(client: &kube::Client, samples: usize) {
    let _kubelet = FakeKubelet::start(client.clone(), KubeletConfig::instant(&["node-l"]))
        .await
        .unwrap();
    let api: Api<ModelResidency> = Api::namespaced(client.clone(), NS);
    let models = [
        ("a".to_owned(), "1Gi".to_owned()),
        ("b".to_owned(), "1Gi".to_owned()),
    ];
    api.create(
        &PostParams::default(),
        &residency("lat", "node-l", "4Gi", &models),
    )
    .await
    .unwrap();
    // Watch the residency: latest (model -> lastRequested) seen in status.
    let seen_rx = watch_named(api.clone(), "lat", |r: ModelResidency| {
        let st = r
            .status
            .filter(|s| s.observed_generation == r.metadata.generation)?;
        Some(
            st.models
                .iter()
                .map(|m| {
                    (
                        m.name.to_string(),
                        m.last_requested.clone().unwrap_or_default(),
                    )
                })
                .collect::<Vec<_>>(),
        )
    });
    // The floor: a ConfigMap annotation through the same kind of watch.
    let cms: Api<ConfigMap> = Api::namespaced(client.clone(), NS);
    cms.create(
        &PostParams::default(),
        &serde_json::from_value(json!({"metadata": {"name": "floor"}})).unwrap(),
    )
    .await
    .unwrap();
    // A second floor for the kind of object the operator writes: a
    // ModelResidency annotation, in a namespace no operator watches.
    create_namespace(client, FLOOR_NS).await;
    let crs: Api<ModelResidency> = Api::namespaced(client.clone(), FLOOR_NS);
    crs.create(
        &PostParams::default(),
        &residency("floor", "node-l", "4Gi", &models),
    )
    .await
    .unwrap();
    create_namespace(client, SHAPED_FLOOR_NS).await;
    let shaped: Api<ModelResidency> = Api::namespaced(client.clone(), SHAPED_FLOOR_NS);
    let floors = Floors {
        cms: cms.clone(),
        cm_seen: watch_poke(cms),
        crs: crs.clone(),
        cr_seen: watch_poke(crs),
        shaped: shaped.clone(),
        shaped_seen: watch_poke(shaped),
    };
    // The same samples through each reconcile path the operator has, one
    // operator at a time, each path with its own floors.
    for (path, slots) in [
        ("kube-runtime's controller only (fast lane off)", 0),
        (
            "with the fast lane (the default)",
            controller::fast_lane::FAST_LANE_SLOTS,
        ),
    ] {
        let mut ctx = Context::new(client.clone());
        Arc::get_mut(&mut ctx).unwrap().fast_lane_slots = slots;
        let operator = model_residency::operator::spawn_with(ctx, NS);
        latency_samples(&api, &floors, seen_rx.clone(), samples, path).await;
        operator.abort();
        let _ = operator.await;
    }
}

/// The floors' objects and their watches.
struct Floors {
    cms: Api<ConfigMap>,
    cm_seen: tokio::sync::watch::Receiver<String>,
    crs: Api<ModelResidency>,
    cr_seen: tokio::sync::watch::Receiver<String>,
    /// A copy of the measured residency with its status.
    shaped: Api<ModelResidency>,
    shaped_seen: tokio::sync::watch::Receiver<String>,
}

/// Loads both models, then takes `samples` apply-to-status samples
/// interleaved with the floors' and prints them.
async fn latency_samples(
    api: &Api<ModelResidency>,
    floors: &Floors,
    mut seen_rx: tokio::sync::watch::Receiver<Vec<(String, Box<str>)>>,
    samples: usize,
    path: &str,
) {
    for m in ["a", "b"] {
        demand::load(api, "lat", m, Timestamp::now()).await.unwrap();
    }
    // Wait until both models are loaded.
    loop {
        let r = api.get("lat").await.unwrap();
        let loaded = r.status.as_ref().map(|s| {
            s.models
                .iter()
                .filter(|m| m.state == ModelState::Loaded)
                .count()
        });
        if loaded == Some(2)
            && r.status.as_ref().map(|s| s.observed_generation) == Some(r.metadata.generation)
        {
            break;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    copy_as_floor(api, "lat", &floors.shaped).await;
    let demanded = ["a", "b"];
    let mut shaped_floor = Vec::with_capacity(samples);
    let mut apply = Vec::with_capacity(samples);
    let mut floor = Vec::with_capacity(samples);
    let mut cr_floor = Vec::with_capacity(samples);
    let mut patched = Vec::with_capacity(samples);
    for i in 0..samples {
        // Floor samples: a ConfigMap, then a ModelResidency no one watches.
        let value = format!("{path}{i}");
        floor.push(poke(&floors.cms, &floors.cm_seen, &value).await);
        cr_floor.push(poke(&floors.crs, &floors.cr_seen, &value).await);
        shaped_floor.push(poke(&floors.shaped, &floors.shaped_seen, &value).await);

        // Apply-to-status sample: one merge patch (a request, a hit), then
        // the status seen with the new generation and lastRequested.
        let model = demanded[i % 2];
        let at = Timestamp::now();
        let t0 = Instant::now();
        demand::load(api, "lat", model, at).await.unwrap();
        patched.push(t0.elapsed());
        let want = at.to_string();
        seen_rx
            .wait_for(|v| v.iter().any(|(m, t)| m == model && **t == *want))
            .await
            .unwrap();
        apply.push(t0.elapsed());
    }
    for v in [
        &mut apply,
        &mut floor,
        &mut cr_floor,
        &mut shaped_floor,
        &mut patched,
    ] {
        v.sort();
    }
    let p = |v: &[Duration]| (ms(percentile(v, 0.5)), ms(percentile(v, 0.99)));
    let ((a50, a99), (f50, f99)) = (p(&apply), p(&floor));
    println!("latency over {samples} samples each (interleaved), {path}:");
    println!("  floor (ConfigMap patch -> watch event):         p50 {f50:.2} ms  p99 {f99:.2} ms");
    let (c50, c99) = p(&cr_floor);
    println!("  ModelResidency annotation patch -> watch event: p50 {c50:.2} ms  p99 {c99:.2} ms");
    let (s50, s99) = p(&shaped_floor);
    println!(
        "  the same for a copy of the residency (status too): p50 {s50:.2} ms  p99 {s99:.2} ms"
    );
    let (d50, d99) = p(&patched);
    println!("  demand patch, until its response:               p50 {d50:.2} ms  p99 {d99:.2} ms");
    println!("  apply-to-status (demand patch -> status):       p50 {a50:.2} ms  p99 {a99:.2} ms");
    println!(
        "  ratio to the floor: p50 {:.2}x (goal <= 2x), p99 {:.2}x (goal <= 3x); to the ModelResidency round trip: p50 {:.2}x (goal <= 2.6x), p99 {:.2}x",
        a50 / f50,
        a99 / f99,
        a50 / c50,
        a99 / c99
    );
    println!(
        "  ratio to the round trip of a copy of the residency: p50 {:.2}x (goal <= 2.6x), p99 {:.2}x",
        a50 / s50,
        a99 / s99
    );
    // A request is two writes of this residency in series (the demand
    // patch, then the operator's status write), each a round trip of an
    // object its size: the issue's "1.3x the two writes a request needs".
    println!(
        "  ratio to the two writes a request needs (twice the copy's round trip, p50 {:.2} ms): p50 {:.2}x (goal <= 1.3x)",
        2.0 * s50,
        a50 / (2.0 * s50)
    );
}

/// Waits until every residency's status reflects its spec, every demand
/// entry is processed and nothing is loading. Reads a watch cache, not
/// repeated lists, so that checking does not load the API server.
async fn wait_converged(api: &Api<ModelResidency>, count: usize) -> Duration {
    let t0 = Instant::now();
    let (reader, writer) = kube::runtime::reflector::store();
    let feed = kube::runtime::reflector(
        writer,
        watcher(api.clone(), watcher::Config::default()).default_backoff(),
    );
    let task = tokio::spawn(feed.for_each(|_| futures::future::ready(())));
    let _ = reader.wait_until_ready().await;
    loop {
        let items = reader.state();
        let done = items.len() == count
            && items.iter().all(|r| {
                let Some(s) = &r.status else { return false };
                s.observed_generation == r.metadata.generation
                    && s.models.iter().all(|m| m.state != ModelState::Loading)
                    && r.spec.demand.iter().all(|(model, at)| {
                        s.model(model).is_some_and(|m| {
                            m.last_requested
                                .as_deref()
                                .and_then(|t| t.parse::<Timestamp>().ok())
                                == at.parse::<Timestamp>().ok()
                        })
                    })
            });
        if done {
            task.abort();
            return t0.elapsed();
        }
        if t0.elapsed() > Duration::from_secs(1800) {
            panic!("no convergence in 30 minutes");
        }
        tokio::time::sleep(Duration::from_millis(500)).await;
    }
}

async fn create_all(api: &Api<ModelResidency>, objects: Vec<ModelResidency>) {
    futures::stream::iter(objects)
        .for_each_concurrent(16, |r| {
            let api = api.clone();
            async move {
                api.create(&PostParams::default(), &r).await.unwrap();
            }
        })
        .await;
}

fn fleet(prefix: &str, count: usize, models: usize, nodes: usize) -> Vec<ModelResidency> {
    (0..count)
        .map(|i| {
            let ms: Vec<(String, String)> = (0..models)
                .map(|m| (format!("model-{m}"), format!("{}Gi", 1 + (m * 7 + i) % 4)))
                .collect();
            residency(
                &format!("{prefix}-{i}"),
                &format!("node-{}", i % nodes),
                "8Gi",
                &ms,
            )
        })
        .collect()
}

/// Copies the residencies `names` of `from` (spec and status) into `to`.
async fn copy_fleet(from: &Api<ModelResidency>, names: &[String], to: &Api<ModelResidency>) {
    let all = from.list(&Default::default()).await.unwrap();
    let wanted: std::collections::HashSet<&str> = names.iter().map(String::as_str).collect();
    futures::stream::iter(
        all.items
            .iter()
            .filter(|r| wanted.contains(r.name_any().as_str())),
    )
    .for_each_concurrent(
        16,
        |r| async move { copy_residency(r, to, &r.name_any()).await },
    )
    .await;
}

/// Five random requests per residency, concurrently across residencies.
async fn storm(api: &Api<ModelResidency>, names: &[String], models: usize) {
    futures::stream::iter(names.iter().enumerate())
        .for_each_concurrent(16, |(i, name)| {
            let api = api.clone();
            async move {
                for k in 0..5 {
                    let m = format!("model-{}", (i * 31 + k * 17) % models);
                    demand::load(&api, name, &m, Timestamp::now())
                        .await
                        .unwrap();
                }
            }
        })
        .await;
}

async fn scale(
    plane: &ControlPlane,
    client: &kube::Client,
    counts: &[usize],
    models: usize,
    nodes: usize,
    steady: u64,
) {
    // The operator on a runtime of its own, whose threads' CPU is counted,
    // with a client made there (a client's requests run on the runtime
    // it was made on).
    let operator_rt = CountedRuntime::new(2);
    let kubeconfig = plane.kubeconfig().to_owned();
    let operator_client = operator_rt
        .rt
        .spawn(async move {
            let kc = kube::config::Kubeconfig::read_from(&kubeconfig).unwrap();
            let options = kube::config::KubeConfigOptions::default();
            let config = kube::Config::from_custom_kubeconfig(kc, &options)
                .await
                .unwrap();
            kube::Client::try_from(config).unwrap()
        })
        .await
        .unwrap();
    let node_names: Vec<String> = (0..nodes).map(|n| format!("node-{n}")).collect();
    let node_refs: Vec<&str> = node_names.iter().map(String::as_str).collect();
    let _kubelet = FakeKubelet::start(client.clone(), KubeletConfig::instant(&node_refs))
        .await
        .unwrap();
    let api: Api<ModelResidency> = Api::namespaced(client.clone(), NS);
    println!("scale: {models} models per residency, {nodes} fake nodes, 5 requests per residency");
    println!(
        "  count | create s | storm s | converge s from storm start | after its last write | requests/reconcile | reconciles | creates/deletes/status/events | 409s | writes in steady state"
    );
    create_namespace(client, STORM_FLOOR_NS).await;
    let mut storm_alone = Vec::new();
    let mut storms = Vec::new();
    for (round, &count) in counts.iter().enumerate() {
        let (ctx, op) = {
            let _on = operator_rt.rt.enter();
            start_operator(&operator_client)
        };
        let prefix = format!("r{round}");
        let objects = fleet(&prefix, count, models, nodes);
        let names: Vec<String> = objects.iter().map(|r| r.name_any()).collect();
        let t0 = Instant::now();
        create_all(&api, objects).await;
        let created = t0.elapsed();
        if round == 0 {
            let one = api.get(&names[0]).await.unwrap();
            let mut bare = one.clone();
            bare.metadata.managed_fields = None;
            println!(
                "  one residency object ({}): {} bytes as returned, {} without managedFields",
                if catalog_mode() {
                    "over the catalog"
                } else {
                    "inline models"
                },
                serde_json::to_vec(&one).unwrap().len(),
                serde_json::to_vec(&bare).unwrap().len()
            );
        }
        let scoped: Api<ModelResidency> = api.clone();
        let total_before: usize = counts[..round].iter().sum();
        wait_converged(&scoped, total_before + count).await;
        // The residencies as the storm finds them, copied (spec and status)
        // where no operator watches, for the storm alone below.
        let copies: Api<ModelResidency> = Api::namespaced(client.clone(), STORM_FLOOR_NS);
        copy_fleet(&api, &names, &copies).await;
        let requests = |verb: &str, resource: &str| {
            let labels = format!(r#"verb="{verb}",resource="{resource}""#);
            ctx.metrics.sum_where(API_REQUESTS, &labels)
        };
        let writes = || {
            [
                requests("create", "pods"),
                requests("delete", "pods"),
                requests("patch", "modelresidencies/status"),
                requests("create", "events"),
            ]
        };
        let (writes0, op_cpu0, plane_cpu0) =
            (writes(), operator_rt.cpu_seconds(), plane.cpu_seconds());
        let t1 = Instant::now();
        storm(&api, &names, models).await;
        let stormed = t1.elapsed();
        let after_storm = wait_converged(&scoped, total_before + count).await;
        let converged = after_storm + stormed;
        let (writes1, op_cpu1, plane_cpu1) =
            (writes(), operator_rt.cpu_seconds(), plane.cpu_seconds());
        let storm_writes: [u64; 4] = std::array::from_fn(|i| writes1[i] - writes0[i]);
        storms.push(StormCost {
            count,
            requests: count * 5,
            writes: storm_writes,
            operator_cpu: op_cpu1 - op_cpu0,
            apiserver_cpu: plane_cpu1.0 - plane_cpu0.0,
            etcd_cpu: plane_cpu1.1 - plane_cpu0.1,
        });
        let [c, d, p, e] = writes1;
        let breakdown = format!("{c}/{d}/{p}/{e}");
        let reconciles = ctx.metrics.sum(RECONCILES).max(1);
        let per = ctx.metrics.sum(API_REQUESTS) as f64 / reconciles as f64;
        let conflicts = ctx.metrics.sum_where(
            "model_residency_reconcile_errors_total",
            r#"reason="conflict""#,
        );
        let before = ctx.metrics.sum(API_REQUESTS);
        let wait = if count >= 1000 {
            steady
        } else {
            steady.min(10)
        };
        tokio::time::sleep(Duration::from_secs(wait)).await;
        let steady_writes = ctx.metrics.sum(API_REQUESTS) - before;
        event_repeats(client, &prefix).await;
        println!(
            "  {count:>5} | {:>8.2} | {:>7.2} | {:>26.2} | {:>20.2} | {per:>18.2} | {reconciles:>10} | {breakdown:>29} | {conflicts:>4} | {steady_writes} in {wait} s",
            created.as_secs_f64(),
            stormed.as_secs_f64(),
            converged.as_secs_f64(),
            after_storm.as_secs_f64(),
        );
        op.abort();
        // The same storm again, on the copies, with no operator running:
        // what the API server alone needs for its writes on this machine,
        // a floor under "converged from the storm's start".
        let t2 = Instant::now();
        storm(&copies, &names, models).await;
        storm_alone.push((count, t2.elapsed()));
        copies
            .delete_collection(&Default::default(), &Default::default())
            .await
            .unwrap();
    }
    for (count, alone) in storm_alone {
        println!(
            "  {count:>5} | the same storm alone (copies with their status, no operator running): {:.2} s",
            alone.as_secs_f64()
        );
    }
    println!(
        "  storm to converged: writes per storm request (pod creates/deletes/status patches/events), goal <= 4; operator CPU s / (API server + etcd CPU s), goal <= 0.25"
    );
    for s in storms {
        let total: u64 = s.writes.iter().sum();
        let [c, d, p, e] = s.writes;
        println!(
            "  {:>5} | {} requests | {:.2} writes per request ({c}/{d}/{p}/{e}) | operator {:.1} s / (API server {:.1} s + etcd {:.1} s) = {:.3}",
            s.count,
            s.requests,
            total as f64 / s.requests as f64,
            s.operator_cpu,
            s.apiserver_cpu,
            s.etcd_cpu,
            s.operator_cpu / (s.apiserver_cpu + s.etcd_cpu).max(f64::MIN_POSITIVE),
        );
    }
    api_server_time(client).await;
    operator_rt.rt.shutdown_background();
}

/// What one round's storm cost, from its first write to converged.
struct StormCost {
    count: usize,
    requests: usize,
    /// Pod creates, pod deletes, status patches, events.
    writes: [u64; 4],
    operator_cpu: f64,
    apiserver_cpu: f64,
    etcd_cpu: f64,
}

/// How many of a round's events an event series would fold: events that
/// repeat one residency, reason and model (what a series is keyed by,
/// `regarding`, `reason` and `related`) would patch the first one's series
/// instead of creating an object. Printed as events / distinct keys.
async fn event_repeats(client: &kube::Client, prefix: &str) {
    use k8s_openapi::api::events::v1::Event;
    let events: Api<Event> = Api::namespaced(client.clone(), NS);
    let Ok(list) = events.list(&Default::default()).await else {
        println!("    (events not listable)");
        return;
    };
    let mut keys = std::collections::HashSet::new();
    let mut by_reason = std::collections::BTreeMap::<String, usize>::new();
    let mut total = 0usize;
    for e in &list.items {
        let regarding = e.regarding.as_ref().and_then(|r| r.name.clone());
        if !regarding.as_deref().is_some_and(|n| n.starts_with(prefix)) {
            continue;
        }
        total += 1;
        *by_reason
            .entry(e.reason.clone().unwrap_or_default())
            .or_default() += 1;
        let related = e.related.as_ref().and_then(|r| r.name.clone());
        keys.insert((regarding, e.reason.clone(), related));
    }
    println!(
        "    events: {total}, distinct (residency, reason, model): {} -> a series would fold {} ({:.1} %) into patches of existing objects",
        keys.len(),
        total - keys.len(),
        100.0 * (total - keys.len()) as f64 / total.max(1) as f64
    );
    println!("    events by reason: {by_reason:?}");
}

/// Where the API server spent its request time during the run, from its
/// own `apiserver_request_duration_seconds` histogram: the top verb and
/// resource pairs by total seconds.
async fn api_server_time(client: &kube::Client) {
    let req = http::Request::get("/metrics").body(Vec::new()).unwrap();
    let Ok(text) = client.request_text(req).await else {
        println!("(API server metrics not readable)");
        return;
    };
    let label = |line: &str, key: &str| {
        line.split(&format!("{key}=\"")[..])
            .nth(1)
            .and_then(|r| r.split('"').next())
            .unwrap_or("")
            .to_owned()
    };
    let mut rows: std::collections::HashMap<(String, String), (f64, f64)> = Default::default();
    for line in text.lines() {
        let sum = line.starts_with("apiserver_request_duration_seconds_sum{");
        let count = line.starts_with("apiserver_request_duration_seconds_count{");
        if !(sum || count) || label(line, "verb") == "WATCH" {
            continue;
        }
        let value: f64 = line
            .rsplit(' ')
            .next()
            .and_then(|v| v.parse().ok())
            .unwrap_or(0.0);
        let (resource, sub) = (label(line, "resource"), label(line, "subresource"));
        let resource = if sub.is_empty() {
            resource
        } else {
            format!("{resource}/{sub}")
        };
        let key = (label(line, "verb"), resource);
        let e = rows.entry(key).or_default();
        if sum { e.0 += value } else { e.1 += value }
    }
    let mut rows: Vec<_> = rows.into_iter().collect();
    rows.sort_by(|a, b| b.1.0.total_cmp(&a.1.0));
    println!("API server request time, all rounds (verb resource: requests, total s, mean ms):");
    for ((verb, resource), (secs, n)) in rows.iter().take(10) {
        println!(
            "  {verb:<7} {resource:<28} {n:>8} {secs:>8.1} {:>8.2}",
            secs / n.max(1.0) * 1e3
        );
    }
}

fn mib(bytes: u64) -> f64 {
    bytes as f64 / f64::from(1 << 20)
}

/// RSS, and what it is made of.
fn footprint(pid: u32) -> String {
    format!(
        "operator RSS {:.1} MiB ({:.1} MiB heap and stacks, {:.1} MiB mapped files: the binary's code and libc)",
        mib(rss_of(pid)),
        mib(status_bytes(pid, "RssAnon:")),
        mib(status_bytes(pid, "RssFile:"))
    )
}

/// Resident KiB per mapped file (the binary, libc, ...), largest first:
/// `RssFile` split by where the pages come from.
fn file_pages(pid: u32) -> String {
    let smaps = std::fs::read_to_string(format!("/proc/{pid}/smaps")).unwrap_or_default();
    let mut by_file = std::collections::BTreeMap::<String, u64>::new();
    let mut file = String::new();
    for line in smaps.lines() {
        let fields: Vec<&str> = line.split_whitespace().collect();
        match fields.as_slice() {
            ["Rss:", kib, ..] if file.starts_with('/') => {
                *by_file.entry(file.clone()).or_default() += kib.parse::<u64>().unwrap_or(0)
            }
            [range, _, _, _, _, rest @ ..] if range.contains('-') => file = rest.join(" "),
            [range, ..] if range.contains('-') => file.clear(),
            _ => {}
        }
    }
    let mut rows: Vec<_> = by_file.into_iter().collect();
    rows.sort_by_key(|r| std::cmp::Reverse(r.1));
    rows.iter()
        .take(3)
        .map(|(f, kib)| format!("{} {} KiB", f.rsplit('/').next().unwrap_or(f), kib))
        .collect::<Vec<_>>()
        .join(", ")
}

fn rss_of(pid: u32) -> u64 {
    status_bytes(pid, "VmRSS:")
}

/// A size field of `/proc/<pid>/status` (`VmRSS:`, or `VmHWM:`, the peak
/// RSS), in bytes.
fn status_bytes(pid: u32, field: &str) -> u64 {
    std::fs::read_to_string(format!("/proc/{pid}/status"))
        .ok()
        .and_then(|s| {
            s.lines()
                .find(|l| l.starts_with(field))
                .and_then(|l| l.split_whitespace().nth(1))
                .and_then(|k| k.parse::<u64>().ok())
        })
        .unwrap_or(0)
        * 1024
}

async fn memory(plane: &ControlPlane, client: &kube::Client, counts: &[usize]) {
    let nodes: Vec<String> = (0..100).map(|n| format!("node-{n}")).collect();
    let node_refs: Vec<&str> = nodes.iter().map(String::as_str).collect();
    let _kubelet = FakeKubelet::start(client.clone(), KubeletConfig::instant(&node_refs))
        .await
        .unwrap();
    let mut op = operator_process(plane).await;
    println!(
        "memory: `model-residency run` RSS, residencies with 3 models and one resident model (one pod) each"
    );
    println!("  idle: {}", footprint(op.id()));
    println!("    file pages: {}", file_pages(op.id()));
    let api: Api<ModelResidency> = Api::namespaced(client.clone(), NS);
    let mut total = 0;
    for (round, &count) in counts.iter().enumerate() {
        let add = count - total;
        let objects = fleet(&format!("m{round}"), add, 3, nodes.len());
        let names: Vec<String> = objects.iter().map(|r| r.name_any()).collect();
        let t0 = Instant::now();
        create_all(&api, objects).await;
        load_first_model(&api, names).await;
        wait_converged(&api, count).await;
        total = count;
        let converged = t0.elapsed();
        tokio::time::sleep(Duration::from_secs(5)).await;
        println!(
            "  {count:>6} residencies + {count} pods: {} (converged in {:.0} s), peak {:.1} MiB; control plane {} MiB",
            footprint(op.id()),
            converged.as_secs_f64(),
            mib(status_bytes(op.id(), "VmHWM:")),
            plane.rss_bytes() >> 20
        );
        println!("    file pages: {}", file_pages(op.id()));
        // The allocator returns freed pages to the system only after its
        // decay time (jemalloc's default: 10 s): the same again once the
        // garbage of the convergence is surely returned.
        tokio::time::sleep(Duration::from_secs(25)).await;
        println!("    30 s after converging: {}", footprint(op.id()));
    }
    let _ = op.kill();
    let _ = op.wait();
    // A restart at the last count: the initial list of every residency and
    // pod, as a plain list and as a streaming list (watch-list with
    // sendInitialEvents), one after the other in the same run.
    for streaming in [false, true] {
        restart(plane, total, streaming).await;
    }
}

/// `model-residency run` over the bench namespace as a process of its own
/// (it dies with the benchmark, however that ends), two seconds in.
async fn operator_process(plane: &ControlPlane) -> std::process::Child {
    let mut cmd = std::process::Command::new(env!("CARGO_BIN_EXE_model-residency"));
    cmd.env("KUBECONFIG", plane.kubeconfig())
        .args(["run", "--namespace", NS, "--http-addr", "127.0.0.1:0"])
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::null());
    let op = model_residency::local::control_plane::spawn_owned(cmd).unwrap();
    tokio::time::sleep(Duration::from_secs(2)).await;
    op
}

/// Starts `model-residency run` over `count` converged residencies and
/// reports the time until `/readyz` (its first lists are in) and its peak
/// RSS by then.
async fn restart(plane: &ControlPlane, count: usize, streaming: bool) {
    let port = std::net::TcpListener::bind("127.0.0.1:0")
        .and_then(|l| l.local_addr())
        .unwrap()
        .port();
    let mut cmd = std::process::Command::new(env!("CARGO_BIN_EXE_model-residency"));
    cmd.env("KUBECONFIG", plane.kubeconfig())
        .args([
            "run",
            "--namespace",
            NS,
            "--http-addr",
            &format!("127.0.0.1:{port}"),
        ])
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::null());
    cmd.env("INITIAL_LIST", if streaming { "stream" } else { "list" });
    let t0 = Instant::now();
    let mut op = model_residency::local::control_plane::spawn_owned(cmd).unwrap();
    let addr = std::net::SocketAddr::from(([127, 0, 0, 1], port));
    let ready = loop {
        let answer = model_residency::http::send(addr, "GET", "/readyz", "").await;
        if answer.is_ok_and(|a| a.status == 200) {
            break t0.elapsed();
        }
        if t0.elapsed() > Duration::from_secs(300) {
            println!("  restart: not ready in 300 s");
            break t0.elapsed();
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    };
    tokio::time::sleep(Duration::from_secs(5)).await;
    println!(
        "  restart over {count} residencies ({}): ready in {:.2} s, peak {:.1} MiB, then {}",
        if streaming { "streaming list" } else { "list" },
        ready.as_secs_f64(),
        mib(status_bytes(op.id(), "VmHWM:")),
        footprint(op.id()),
    );
    // Converged again: 30 s after the start (every residency is
    // reconciled once after the list; that took 10-13 s here), read
    // before the reconciles are counted: a scrape of /metrics at 10,000
    // residencies builds a text of about 20 MB, which a heap profile found
    // still held when scraped every 500 ms.
    tokio::time::sleep(Duration::from_secs(30).saturating_sub(t0.elapsed())).await;
    let settled = footprint(op.id());
    let reconciles = model_residency::http::send(addr, "GET", "/metrics", "")
        .await
        .map_or(0, |a| {
            model_residency::exposition::sum_where(
                &a.body,
                model_residency::metrics::RECONCILES,
                "",
            )
        });
    println!(
        "    30 s after its start, {reconciles} reconciles started (of {count} residencies): {settled}"
    );
    let _ = op.kill();
    let _ = op.wait();
}

/// Asks for `model-0` on each named residency (its demand, 16 at a time).
async fn load_first_model(api: &Api<ModelResidency>, names: Vec<String>) {
    futures::stream::iter(names)
        .for_each_concurrent(16, |name| {
            let api = api.clone();
            async move {
                demand::load(&api, &name, "model-0", Timestamp::now())
                    .await
                    .unwrap();
            }
        })
        .await;
}

/// A ResidencySet over `nodes` fake nodes' `gpus` GPUs each: see the
/// module's `set`.
async fn stamped_set(
    plane: &ControlPlane,
    client: &kube::Client,
    nodes: usize,
    gpus: u32,
    load: bool,
) {
    use k8s_openapi::api::resource::v1::ResourceSlice;
    use kube::api::{Patch, PatchParams};
    use model_residency::api::ResidencySet;
    use model_residency::local::kubelet::{FakeNode, slice_name};
    let names: Vec<String> = (0..nodes).map(|n| format!("node-{n}")).collect();
    let mut config = KubeletConfig::instant(&[]);
    config.nodes = names.iter().map(|n| FakeNode::new(n, gpus)).collect();
    let _kubelet = FakeKubelet::start(client.clone(), config).await.unwrap();
    let mut op = operator_process(plane).await;
    let count = nodes * gpus as usize;
    println!(
        "set: one ResidencySet over {nodes} nodes x {gpus} GPUs ({count} residencies of 3 catalog models)"
    );
    println!("  idle: {}", footprint(op.id()));
    let set: ResidencySet = serde_json::from_value(json!({
        "apiVersion": "residency.dev/v1alpha1", "kind": "ResidencySet",
        "metadata": {"name": "fleet"},
        "spec": {
            "devices": {"deviceClassName": model_residency::local::kubelet::GPU_DRIVER},
            "catalog": {"name": FLEET_CATALOG, "models": ["model-0", "model-1", "model-2"]},
            "residency": {"budget": "12Gi", "gpu": {"mode": "env"}},
        },
    }))
    .unwrap();
    let sets: Api<ResidencySet> = Api::namespaced(client.clone(), NS);
    let t0 = Instant::now();
    sets.create(&PostParams::default(), &set).await.unwrap();
    let stamped = until_set(&sets, "stamped", |s| s.residencies as usize == count).await;
    let ready = until_set(&sets, "Ready", |s| s.ready as usize == count).await;
    println!(
        "  {count} residencies stamped in {:.1} s, all Ready in {:.1} s; RSS {}, peak {:.1} MiB; control plane {} MiB",
        (stamped - t0).as_secs_f64(),
        (ready - t0).as_secs_f64(),
        footprint(op.id()),
        mib(status_bytes(op.id(), "VmHWM:")),
        plane.rss_bytes() >> 20
    );
    if load {
        // One resident model (one pod) on each, as the memory mode's fleet.
        let api: Api<ModelResidency> = Api::namespaced(client.clone(), NS);
        let names: Vec<String> = api
            .list(&Default::default())
            .await
            .unwrap()
            .items
            .iter()
            .map(|r| r.name_any())
            .collect();
        let t = Instant::now();
        load_first_model(&api, names).await;
        wait_converged(&api, count).await;
        tokio::time::sleep(Duration::from_secs(5)).await;
        println!(
            "  {count} stamped residencies + {count} pods: {} (converged in {:.0} s), peak {:.1} MiB",
            footprint(op.id()),
            t.elapsed().as_secs_f64(),
            mib(status_bytes(op.id(), "VmHWM:")),
        );
    }
    // One more GPU in node-0's slice: appeared to its residency Ready.
    let slices: Api<ResourceSlice> = Api::all(client.clone());
    let mut slice = slices.get(&slice_name("node-0")).await.unwrap();
    let mut extra = serde_json::to_value(&slice.spec.devices.as_ref().unwrap()[0]).unwrap();
    extra["name"] = json!(format!("gpu-{gpus}"));
    extra["attributes"]["index"] = json!({"int": gpus});
    extra["attributes"]["minor"] = json!({"int": gpus});
    extra["attributes"]["uuid"] =
        json!({"string": format!("GPU-0000e57a-0000-0000-0000-{gpus:012x}")});
    slice
        .spec
        .devices
        .get_or_insert_default()
        .push(serde_json::from_value(extra).unwrap());
    slice.metadata.managed_fields = None;
    let t1 = Instant::now();
    slices
        .patch(
            &slice_name("node-0"),
            &PatchParams::default(),
            &Patch::Merge(&json!({"spec": {"devices": slice.spec.devices}})),
        )
        .await
        .unwrap();
    let appeared = until_set(&sets, "the new GPU's residency Ready", |s| {
        s.ready as usize == count + 1
    })
    .await;
    println!(
        "  a GPU appearing in a slice to its residency Ready: {:.2} s",
        (appeared - t1).as_secs_f64()
    );
    let _ = op.kill();
    let _ = op.wait();
    for streaming in [false, true] {
        restart(plane, count + 1, streaming).await;
    }
}

/// When the set's status first satisfies `done` (polled every 100 ms, for
/// at most 30 minutes).
async fn until_set(
    sets: &Api<model_residency::api::ResidencySet>,
    what: &str,
    done: impl Fn(&model_residency::api::ResidencySetStatus) -> bool,
) -> Instant {
    let t0 = Instant::now();
    loop {
        let status = sets.get("fleet").await.ok().and_then(|s| s.status);
        if status.as_ref().is_some_and(&done) {
            return Instant::now();
        }
        if t0.elapsed() > Duration::from_secs(1800) {
            panic!("the set not {what} in 30 minutes: {status:?}");
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}
