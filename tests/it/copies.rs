//! Copies of a model across its GPUs, driven by the routers' in-flight
//! counts: the operator's copy scaler against the real control plane, the
//! kubelet stand-in's fake model servers and an in-process router.

use crate::support::cluster::eventually;
use crate::support::operator::Harness;
use crate::support::router::RouterUnderTest;
use k8s_openapi::jiff::Timestamp;
use model_residency::api::{ModelResidency, ModelState};
use model_residency::controller::copies::CopiesConfig;
use model_residency::engine::copies::CopyPolicy;
use model_residency::local::model_server::SLEEP_ANNOTATION;
use model_residency::residency::labels::{DRAINING_LABEL, SERVING_LABEL};
use model_residency::router::Config;
use serde_json::json;
use std::net::SocketAddr;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::time::{Duration, Instant};

const GPUS: usize = 4;

/// Four GPUs listing `chat` (at most 3 copies, 4 in flight each, a 6 s
/// delay) and `other`.
pub(crate) async fn four_gpus(h: &Harness) {
    for i in 0..GPUS {
        let r: ModelResidency = serde_json::from_value(json!({
            "apiVersion": "residency.dev/v1alpha1", "kind": "ModelResidency",
            "metadata": {"name": format!("gpu-{i}")},
            "spec": {"nodeName": h.node, "device": i.to_string(), "budget": "8Gi", "gpu": {"mode": "env"},
                "models": [
                    {"name": "chat", "size": "4Gi", "template": (h.template)("chat"),
                     "copies": {"max": 3, "targetInFlight": 4, "scaleDownDelay": "6s"}},
                    {"name": "other", "size": "4Gi", "template": (h.template)("other")}]},
        }))
        .unwrap();
        h.api.create(&Default::default(), &r).await.unwrap();
    }
}

/// [`four_gpus`] (in env mode), a router over them, and the operator
/// started again to read that router's counts every `tick` with
/// `defaults`, a copy drained for 300 ms before it is retired.
pub(crate) async fn four_gpus_and_a_router(
    h: &mut Harness,
    tick: Duration,
    defaults: CopyPolicy,
) -> RouterUnderTest {
    h.gpu_mode = Some("env");
    four_gpus(h).await;
    let router = RouterUnderTest::start(h, Config::default()).await;
    restart_with(
        h,
        CopiesConfig {
            routers: vec![router.addr],
            tick,
            drain_grace: Duration::from_millis(300),
            defaults,
            ..CopiesConfig::default()
        },
    )
    .await;
    router
}

/// Starts the operator again with its copy scaler ticking every `tick_ms`
/// and draining for `grace_ms`, no router named (ModelCopies own counts).
pub(crate) async fn restart_with_scaler(h: &mut Harness, tick_ms: u64, grace_ms: u64) {
    let config = CopiesConfig {
        tick: Duration::from_millis(tick_ms),
        drain_grace: Duration::from_millis(grace_ms),
        ..CopiesConfig::default()
    };
    restart_with(h, config).await;
}

/// Starts the operator again with its copy scaler on, every `tick_ms`,
/// reading one stand-in router: any loopback server that counts its
/// requests (its 404s make the round incomplete and decide nothing; a
/// model's `copies.min` decides). How many reads it had.
pub(crate) async fn restart_with_a_stand_in_router(
    h: &mut Harness,
    tick_ms: u64,
) -> Arc<AtomicUsize> {
    let (addr, polls) = crate::support::artifact_server::serve().await;
    let config = CopiesConfig {
        routers: vec![addr],
        tick: Duration::from_millis(tick_ms),
        ..CopiesConfig::default()
    };
    restart_with(h, config).await;
    polls
}

/// Starts the operator again with the copy scaler's `config`.
pub(crate) async fn restart_with(h: &mut Harness, config: CopiesConfig) {
    h.stop_operator().await;
    h.copies = config;
    h.start_operator();
}

/// Creates the ModelCopies `chat` owning the model's count, at `replicas`.
pub(crate) async fn model_copies(
    h: &Harness,
    replicas: i32,
) -> kube::Api<model_residency::api::ModelCopies> {
    let api = kube::Api::namespaced(h.env.client.clone(), &h.env.namespace);
    let mc = serde_json::from_value(json!({
        "apiVersion": "residency.dev/v1alpha1", "kind": "ModelCopies",
        "metadata": {"name": "chat"}, "spec": {"model": "chat", "replicas": replicas}}))
    .unwrap();
    api.create(&Default::default(), &mc).await.unwrap();
    api
}

/// The residencies where `chat` is Loaded.
pub(crate) async fn loaded(h: &Harness) -> Vec<String> {
    let list = h.api.list(&Default::default()).await.unwrap();
    list.items
        .iter()
        .filter(|r| r.model_state("chat") == ModelState::Loaded)
        .map(kube::ResourceExt::name_any)
        .collect()
}

/// `clients` loops of streamed requests (about 1 s each) until `stop`;
/// each answer's status is counted in `ok` or `failed`.
pub(crate) fn load(
    addr: SocketAddr,
    clients: usize,
    stop: Arc<AtomicBool>,
    tally: Arc<(AtomicUsize, AtomicUsize)>,
) -> Vec<tokio::task::JoinHandle<()>> {
    (0..clients)
        .map(|_| {
            let (stop, tally) = (stop.clone(), tally.clone());
            tokio::spawn(async move {
                let body = json!({"model": "chat", "stream": true, "max_tokens": 50,
                    "messages": [{"role": "user", "content": "hi"}]})
                .to_string();
                // Bounded: at most 200 requests a client.
                for _ in 0..200 {
                    if stop.load(Ordering::Relaxed) {
                        break;
                    }
                    let a =
                        model_residency::http::send(addr, "POST", "/v1/chat/completions", &body)
                            .await;
                    match a {
                        Ok(a) if a.status == 200 && a.body.contains("[DONE]") => {
                            tally.0.fetch_add(1, Ordering::Relaxed)
                        }
                        other => {
                            let what = other
                                .map(|a| (a.status, a.body.chars().take(300).collect::<String>()));
                            eprintln!("a request failed: {what:?}");
                            tally.1.fetch_add(1, Ordering::Relaxed)
                        }
                    };
                }
            })
        })
        .collect()
}

#[tokio::test]
#[ignore = "needs the local control plane: scripts/test.sh runs it with --include-ignored"]
async fn copies_follow_the_load_up_and_down_and_lose_no_request() {
    let mut h = Harness::start("copies").await;
    // The operator reads the router's counts twice a second.
    let defaults = CopyPolicy {
        window: 3.0,
        ..CopyPolicy::default()
    };
    let router = four_gpus_and_a_router(&mut h, Duration::from_millis(500), defaults).await;
    // The first request loads one copy (the router's cold path).
    assert_eq!(router.chat("chat").await.status, 200);
    eventually(10, "one copy of chat", || async {
        (loaded(&h).await.len() == 1).then_some(())
    })
    .await;

    // 12 streams at once, 4 per copy wanted: three copies (the max), and
    // `other` is left where it is.
    let stop = Arc::new(AtomicBool::new(false));
    let tally = Arc::new((AtomicUsize::new(0), AtomicUsize::new(0)));
    let heavy = load(router.addr, 12, stop.clone(), tally.clone());
    let t0 = Instant::now();
    eventually(30, "three copies of chat", || async {
        (loaded(&h).await.len() == 3).then_some(())
    })
    .await;
    let up = t0.elapsed();
    let copies = |h: &Harness| {
        h.ctx
            .metrics
            .sum_where("model_residency_model_copies", r#"model="chat""#)
    };
    eventually(5, "the copies metric", || async {
        (copies(&h) == 3).then_some(())
    })
    .await;
    // Never a fourth: max 3.
    tokio::time::sleep(Duration::from_secs(2)).await;
    assert_eq!(loaded(&h).await.len(), 3);
    stop.store(true, Ordering::Relaxed);
    futures::future::join_all(heavy).await;

    // Two streams go on (one copy's worth): one copy less per 6 s, never
    // the last, and every request answered whole while they go.
    let stop = Arc::new(AtomicBool::new(false));
    let light = load(router.addr, 2, stop.clone(), tally.clone());
    let mut seen = vec![(Instant::now(), 3)];
    let deadline = Instant::now() + Duration::from_secs(40);
    while Instant::now() < deadline {
        let n = loaded(&h).await.len();
        if n != seen.last().unwrap().1 {
            seen.push((Instant::now(), n));
        }
        if n == 1 {
            break;
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    // A moment more: nothing below one copy.
    tokio::time::sleep(Duration::from_secs(3)).await;
    stop.store(true, Ordering::Relaxed);
    futures::future::join_all(light).await;
    let counts: Vec<usize> = seen.iter().map(|s| s.1).collect();
    assert_eq!(counts, [3, 2, 1], "one copy at a time");
    let gap = seen[2].0 - seen[1].0;
    assert!(
        gap >= Duration::from_secs(5),
        "removals {gap:?} apart, the delay is 6 s"
    );
    assert_eq!(
        loaded(&h).await.len(),
        1,
        "the last copy stays while it has traffic"
    );
    let (ok, failed) = (
        tally.0.load(Ordering::Relaxed),
        tally.1.load(Ordering::Relaxed),
    );
    assert_eq!(failed, 0, "{failed} of {} requests failed", ok + failed);
    // No pod is left out of the routers.
    eventually(10, "no draining label left", || async {
        let pods = h
            .pods
            .list(&kube::api::ListParams::default().labels(DRAINING_LABEL))
            .await
            .unwrap();
        pods.items.is_empty().then_some(())
    })
    .await;
    println!("copies: 1 -> 3 in {up:?}; {ok} streamed requests answered whole, 0 lost");
}

#[tokio::test]
#[ignore = "needs the local control plane: scripts/test.sh runs it with --include-ignored"]
async fn model_copies_scales_a_model_0_1_3_0_through_its_scale_subresource() {
    use kube::api::{Patch, PatchParams};
    let mut h = Harness::start("copies-owned").await;
    four_gpus(&h).await;
    // No router: the built-in signal is off; the object owns the count.
    restart_with_scaler(&mut h, 300, 200).await;
    let api = model_copies(&h, 0).await;
    for n in [1usize, 3, 0] {
        let scale = json!({"spec": {"replicas": n}});
        api.patch_scale("chat", &PatchParams::default(), &Patch::Merge(&scale))
            .await
            .unwrap();
        eventually(30, &format!("{n} copies, Ready in status"), || async {
            let ready = api.get_scale("chat").await.ok()?.status?.replicas;
            (loaded(&h).await.len() == n && ready == n as i32).then_some(())
        })
        .await;
    }
    let scale = api.get_scale("chat").await.unwrap();
    assert_eq!(
        scale.status.unwrap().selector.as_deref(),
        Some("residency.dev/model=chat"),
        "HPA finds the model's pods by it"
    );
    // Asking for more copies than GPUs list the model: all four, and the
    // status says why not five.
    api.patch_scale(
        "chat",
        &PatchParams::default(),
        &Patch::Merge(&json!({"spec": {"replicas": 5}})),
    )
    .await
    .unwrap();
    let message = eventually(30, "four copies and a message", || async {
        let status = api.get("chat").await.ok()?.status?;
        (loaded(&h).await.len() == 4 && status.replicas == 4).then_some(status.message?)
    })
    .await;
    assert!(message.contains("holds a copy"), "{message}");
}

/// The selector's pods: those carrying every label of the pool's selector.
async fn selected(h: &Harness, pool: &model_residency::api::InferencePool) -> Vec<String> {
    let selector: Vec<String> = pool
        .spec
        .selector
        .match_labels
        .iter()
        .map(|(k, v)| format!("{k}={v}"))
        .collect();
    let params = kube::api::ListParams::default().labels(&selector.join(","));
    let mut names: Vec<String> = h
        .pods
        .list(&params)
        .await
        .unwrap()
        .items
        .iter()
        .map(kube::ResourceExt::name_any)
        .collect();
    names.sort();
    names
}

/// The model pods of the residencies where `chat` is Loaded.
async fn serving_pods(h: &Harness) -> Vec<String> {
    let mut names: Vec<String> = loaded(h)
        .await
        .iter()
        .map(|r| model_residency::controller::pods::pod_name(r, "chat"))
        .collect();
    names.sort();
    names
}

#[tokio::test]
#[ignore = "needs the local control plane: scripts/test.sh runs it with --include-ignored"]
async fn inference_pools_select_exactly_the_copies_that_serve() {
    use kube::ResourceExt;
    use kube::api::{Api, Patch, PatchParams};
    use model_residency::api::{EndpointPickerRef, InferencePool};
    // The extension's own released CRD (v1.6: the picker optional, its
    // port an object, defaults the API server fills in).
    let mut h = Harness::start("copies-pools").await;
    install_inference_crd(h.env.plane, "v1.6.0");
    // A tenant's own pool named after a model: never the operator's to
    // rewrite, own or delete.
    let pools: Api<InferencePool> = Api::namespaced(h.env.client.clone(), &h.env.namespace);
    let theirs: InferencePool = serde_json::from_value(json!({
        "apiVersion": "inference.networking.k8s.io/v1", "kind": "InferencePool",
        "metadata": {"name": "big"},
        "spec": {"selector": {"matchLabels": {"app": "theirs"}}, "targetPorts": [{"number": 38080}]}}))
    .unwrap();
    pools.create(&Default::default(), &theirs).await.unwrap();
    // Four GPUs whose chat can sleep (the warm tier), with a big model
    // that takes a copy's room.
    for i in 0..GPUS {
        let mut chat = (h.template)("chat");
        chat["metadata"]["annotations"] = json!({SLEEP_ANNOTATION: "sleep=30ms,wake=30ms"});
        let r: ModelResidency = serde_json::from_value(json!({
            "apiVersion": "residency.dev/v1alpha1", "kind": "ModelResidency",
            "metadata": {"name": format!("gpu-{i}")},
            "spec": {"nodeName": h.node, "device": i.to_string(), "budget": "8Gi",
                "gpu": {"mode": "env"}, "warm": {"hostBudget": "8Gi"},
                "models": [
                    {"name": "chat", "size": "4Gi", "template": chat,
                     "sleep": {"preset": "vllm", "sleepingSize": "1Gi"}},
                    {"name": "other", "size": "4Gi", "template": (h.template)("other"),
                     "lora": {"adapters": [{"name": format!("o{}", i % 2), "rank": 8}]}},
                    {"name": "big", "size": "6Gi", "template": (h.template)("big")}]},
        }))
        .unwrap();
        h.api.create(&Default::default(), &r).await.unwrap();
    }
    restart_with(
        &mut h,
        CopiesConfig {
            tick: Duration::from_millis(300),
            drain_grace: Duration::from_millis(200),
            pools: Some(model_residency::controller::copies::PoolConfig {
                endpoint_picker: Some(EndpointPickerRef::service("epp".into(), 9002)),
                routes: None,
                adapter_maps: true,
            }),
            ..CopiesConfig::default()
        },
    )
    .await;
    // Watched throughout: a copy being removed is never still selected
    // by its pool (draining and serving at once).
    let both = Arc::new(AtomicUsize::new(0));
    let watcher = {
        let (pods, both) = (h.pods.clone(), both.clone());
        tokio::spawn(async move {
            // Bounded: 20 polls a second for at most 3 minutes.
            for _ in 0..3600 {
                if let Ok(list) = pods.list(&Default::default()).await {
                    for p in list.items {
                        let labels = p.metadata.labels.unwrap_or_default();
                        if labels.contains_key(DRAINING_LABEL)
                            && labels.get(SERVING_LABEL).map(String::as_str) == Some("true")
                        {
                            both.fetch_add(1, Ordering::Relaxed);
                        }
                    }
                }
                tokio::time::sleep(Duration::from_millis(50)).await;
            }
        })
    };
    let copies = model_copies(&h, 2).await;
    for n in [2usize, 3, 1] {
        copies
            .patch_scale(
                "chat",
                &PatchParams::default(),
                &Patch::Merge(&json!({"spec": {"replicas": n}})),
            )
            .await
            .unwrap();
        let (pool, serving) = eventually(30, &format!("the pool selecting {n} copies"), || async {
            let pool = pools.get_opt("chat").await.ok()??;
            let serving = serving_pods(&h).await;
            (serving.len() == n && selected(&h, &pool).await == serving).then_some((pool, serving))
        })
        .await;
        assert_eq!(pool.spec.target_ports[0].number, 8080);
        assert_eq!(serving.len(), n);
        if n == 2 {
            // big takes one copy's GPU: that copy sleeps on its pod, out of
            // the pool, and the operator adds one elsewhere (2 asked for).
            let home = serving_pods(&h).await[0].clone();
            let home = loaded(&h)
                .await
                .into_iter()
                .find(|r| model_residency::controller::pods::pod_name(r, "chat") == home)
                .unwrap();
            h.request(&home, "big").await;
            eventually(30, "the pool without the sleeping copy", || async {
                let pool = pools.get_opt("chat").await.ok()??;
                let serving = serving_pods(&h).await;
                let asleep =
                    h.api.get(&home).await.ok()?.model_state("chat") == ModelState::Sleeping;
                let chosen = selected(&h, &pool).await;
                (asleep && serving.len() == 2 && chosen == serving).then_some(())
            })
            .await;
            let pod = model_residency::controller::pods::pod_name(&home, "chat");
            assert!(
                h.pods.get_opt(&pod).await.unwrap().is_some(),
                "the sleeping copy keeps its pod"
            );
        }
    }
    // 3 -> 1: the two copies removed went to sleep (the warm tier had
    // room), beside the one big put to sleep: three asleep, none selected.
    eventually(30, "the removed copies asleep", || async {
        let list = h.api.list(&Default::default()).await.ok()?;
        let asleep = list
            .items
            .iter()
            .filter(|r| r.model_state("chat") == ModelState::Sleeping)
            .count();
        (asleep == 3).then_some(())
    })
    .await;
    let pool = pools.get("chat").await.unwrap();
    assert_eq!(selected(&h, &pool).await, serving_pods(&h).await);
    assert_eq!(serving_pods(&h).await.len(), 1);
    watcher.abort();
    assert_eq!(
        both.load(Ordering::Relaxed),
        0,
        "a draining copy kept its serving label"
    );
    // What is stored after the API server's defaulting is what the
    // operator writes: ten quiet ticks apply nothing.
    let patches = || {
        h.ctx.metrics.sum_where(
            "model_residency_api_requests_total",
            r#"verb="patch",resource="inferencepools""#,
        )
    };
    let map_patches = || {
        h.ctx.metrics.sum_where(
            "model_residency_api_requests_total",
            r#"verb="patch",resource="configmaps""#,
        )
    };
    let before = (patches(), map_patches());
    tokio::time::sleep(Duration::from_secs(3)).await;
    assert_eq!(
        (patches(), map_patches()),
        before,
        "pools or adapter maps applied at steady state"
    );
    // other's adapters, from every registry, for llm-d's payload
    // processor: one ConfigMap in its shape, owned by every home.
    let maps: Api<k8s_openapi::api::core::v1::ConfigMap> =
        Api::namespaced(h.env.client.clone(), &h.env.namespace);
    let map = maps.get("other-adapters").await.unwrap();
    assert_eq!(map.labels()["inference.llm-d.ai/ipp-managed"], "true");
    let data = map.data.clone().unwrap();
    assert_eq!(data["baseModel"], "other");
    assert_eq!(data["adapters"], "- \"o0\"\n- \"o1\"\n");
    assert_eq!(map.metadata.owner_references.map(|o| o.len()), Some(GPUS));
    assert!(maps.get_opt("chat-adapters").await.unwrap().is_none());
    // The tenant's pool is as they made it, and the clash is said.
    let big = pools.get("big").await.unwrap();
    assert_eq!(big.spec, theirs.spec);
    assert!(big.metadata.owner_references.is_none());
    let clash = h.events_of("gpu-0").await;
    assert!(
        clash.iter().any(|e| e.contains("InferencePoolClash")),
        "{clash:#?}"
    );
    // Every model has its pool, owned by the residencies that list it.
    let other = pools.get("other").await.unwrap();
    assert_eq!(
        other.metadata.owner_references.as_ref().map(Vec::len),
        Some(GPUS)
    );
    assert!(
        selected(&h, &other).await.is_empty(),
        "other serves nowhere"
    );
    // A model no residency lists any more loses its pool.
    for i in 0..GPUS {
        let patch = json!({"spec": {"models": [{"name": "chat", "size": "4Gi", "template": (h.template)("chat")}]}});
        h.api
            .patch(
                &format!("gpu-{i}"),
                &PatchParams::default(),
                &Patch::Merge(&patch),
            )
            .await
            .unwrap();
    }
    eventually(30, "other's pool and adapter map gone", || async {
        let pool = pools.get_opt("other").await.ok()?;
        let map = maps.get_opt("other-adapters").await.ok()?;
        (pool.is_none() && map.is_none()).then_some(())
    })
    .await;
}

/// Applies the extension's released InferencePool CRD of `version` (from
/// `scripts/inference-extension.sh`) to `plane`, and waits until it serves.
fn install_inference_crd(
    plane: &model_residency::local::control_plane::ControlPlane,
    version: &str,
) {
    install_crds(
        plane,
        &format!("{version}.yaml"),
        "crd/inferencepools.inference.networking.k8s.io",
    );
}

/// Applies `file` of `scripts/inference-extension.sh`'s folder to `plane`
/// and waits until `crd` is Established.
fn install_crds(
    plane: &model_residency::local::control_plane::ControlPlane,
    file: &str,
    crd: &str,
) {
    let dir = std::env::var("MODEL_RESIDENCY_INFERENCE_CRDS").expect(
        "MODEL_RESIDENCY_INFERENCE_CRDS: scripts/test.sh sets it (scripts/inference-extension.sh)",
    );
    let kubectl = |args: &[&str]| {
        let out = std::process::Command::new(model_residency::local::control_plane::kubectl())
            .env("KUBECONFIG", plane.kubeconfig())
            .args(args)
            .output()
            .unwrap();
        assert!(
            out.status.success(),
            "kubectl {args:?}: {}",
            String::from_utf8_lossy(&out.stderr)
        );
    };
    let file = format!("{dir}/{file}");
    kubectl(&["apply", "--server-side", "--force-conflicts", "-f", &file]);
    kubectl(&["wait", "--for=condition=Established", "--timeout=30s", crd]);
}

/// Against the extension's v1.5 CRD (its picker required): the pool the
/// operator writes with `--endpoint-picker` is taken and, once stored
/// (defaulted), not written again. Its own control plane: the shared one
/// has v1.6's CRD of the same name.
#[tokio::test]
#[ignore = "needs the local control plane: scripts/test.sh runs it with --include-ignored"]
async fn inference_pools_are_taken_by_the_extensions_v1_5_crd() {
    use kube::api::Api;
    use model_residency::api::{EndpointPickerRef, InferencePool};
    use model_residency::local::control_plane::ControlPlane;
    use model_residency::local::kubelet::{FakeKubelet, KubeletConfig};
    let plane = ControlPlane::start().expect("a control plane of the test's own");
    install_inference_crd(&plane, "v1.5.0");
    let client = plane.client().await.unwrap();
    model_residency::local::install_crd(&client).await.unwrap();
    crate::support::cluster::create_namespace(&client, "pools").await;
    let _kubelet = FakeKubelet::start(client.clone(), KubeletConfig::instant(&["node-p"]))
        .await
        .unwrap();
    let api: Api<ModelResidency> = Api::namespaced(client.clone(), "pools");
    let r = serde_json::from_value(json!({
        "apiVersion": "residency.dev/v1alpha1", "kind": "ModelResidency",
        "metadata": {"name": "gpu"},
        "spec": {"nodeName": "node-p", "device": "0", "budget": "8Gi", "gpu": {"mode": "env"},
                 "models": [{"name": "chat", "size": "4Gi",
                             "template": crate::support::operator::server_template("chat")}],
                 "demand": {"chat": "2026-01-01T00:00:00Z"}}}))
    .unwrap();
    api.create(&Default::default(), &r).await.unwrap();
    let mut ctx = model_residency::controller::Context::new(client.clone());
    Arc::get_mut(&mut ctx).unwrap().copies = CopiesConfig {
        tick: Duration::from_millis(200),
        pools: Some(model_residency::controller::copies::PoolConfig {
            endpoint_picker: Some(EndpointPickerRef::service("epp".into(), 9002)),
            routes: None,
            adapter_maps: false,
        }),
        ..CopiesConfig::default()
    };
    let metrics = ctx.metrics.clone();
    let operator = model_residency::operator::spawn_with(ctx, "pools");
    let pools: Api<InferencePool> = Api::namespaced(client.clone(), "pools");
    let pool = eventually(30, "chat's pool", || async {
        pools.get_opt("chat").await.ok()?
    })
    .await;
    let picker = pool.spec.endpoint_picker_ref.unwrap();
    assert_eq!(picker.port.map(|p| p.number), Some(9002));
    let patches = || {
        metrics.sum_where(
            "model_residency_api_requests_total",
            r#"verb="patch",resource="inferencepools""#,
        )
    };
    let before = patches();
    tokio::time::sleep(Duration::from_secs(2)).await;
    assert_eq!(patches() - before, 0, "pools applied at steady state");
    operator.abort();
}

#[tokio::test]
#[ignore = "needs the local control plane: scripts/test.sh runs it with --include-ignored"]
async fn the_copy_scaler_stops_with_its_operators_term() {
    let mut h = Harness::start("copies-term").await;
    // The scaler's reads of the stand-in router are what is counted.
    let polls = restart_with_a_stand_in_router(&mut h, 100).await;
    eventually(30, "the copy scaler to read the router", || async {
        (polls.load(Ordering::SeqCst) >= 3).then_some(())
    })
    .await;
    // Its 404 is an unread router, and said so (no copy is removed while
    // one is unread): it was a debug line only.
    assert_eq!(
        h.ctx
            .metrics
            .sum_where("model_residency_copies_routers_unread", ""),
        1
    );
    // A lost lease aborts the leader's controller task; the copy scaler it
    // started (and its removals) must end with it, or the old leader goes
    // on adding and removing copies beside the new one.
    h.abort_operator().await;
    let at_abort = polls.load(Ordering::SeqCst);
    tokio::time::sleep(Duration::from_secs(1)).await;
    let after = polls.load(Ordering::SeqCst);
    assert!(
        after <= at_abort + 1,
        "the copy scaler read the router {} more times in the second after its term ended (a tick is 100 ms)",
        after - at_abort
    );
}

/// Two tenants, one model name: tenant A asks for three copies of its
/// `shared` on its one GPU; tenant B lists an unrelated `shared` (no
/// copies) on two GPUs with `bidle` loaded there; a third namespace has a
/// ModelCopies for `shared` and no residency. Neither's spec moves the
/// other's models (the scaler grouped homes by name across namespaces and
/// loaded B's `shared` over B's `bidle`), and the ModelCopies elsewhere
/// does not switch off B's own signal once B asks for copies. An operator
/// over every namespace needs a control plane of the test's own.
#[tokio::test]
#[ignore = "needs the local control plane: scripts/test.sh runs it with --include-ignored"]
async fn one_tenants_copies_never_move_another_tenants_models() {
    use kube::api::{Api, Patch, PatchParams};
    use model_residency::local::control_plane::ControlPlane;
    use model_residency::local::kubelet::{FakeKubelet, KubeletConfig};
    let plane = ControlPlane::start().expect("a control plane of the test's own");
    let client = plane.client().await.unwrap();
    model_residency::local::install_crd(&client).await.unwrap();
    for ns in ["tenant-a", "tenant-b", "tenant-c"] {
        crate::support::cluster::create_namespace(&client, ns).await;
    }
    let mut config = KubeletConfig::instant(&["node-t"]);
    config.nodes[0].gpus = 3;
    let _kubelet = FakeKubelet::start(client.clone(), config).await.unwrap();
    let template = crate::support::operator::server_template;
    let gpu = |name: &str, device: u32, models: serde_json::Value, demand: serde_json::Value| {
        serde_json::from_value::<ModelResidency>(json!({
            "apiVersion": "residency.dev/v1alpha1", "kind": "ModelResidency",
            "metadata": {"name": name},
            "spec": {"nodeName": "node-t", "device": device.to_string(), "budget": "8Gi",
                     "gpu": {"mode": "env"}, "models": models, "demand": demand}}))
        .unwrap()
    };
    let a: Api<ModelResidency> = Api::namespaced(client.clone(), "tenant-a");
    let b: Api<ModelResidency> = Api::namespaced(client.clone(), "tenant-b");
    let long_ago = "2026-01-01T00:00:00Z";
    a.create(
        &Default::default(),
        &gpu(
            "a-gpu",
            0,
            json!([{"name": "shared", "size": "4Gi", "template": template("shared"),
                    "copies": {"min": 3}}]),
            json!({"shared": long_ago}),
        ),
    )
    .await
    .unwrap();
    let b_models = |copies: serde_json::Value| {
        json!([{"name": "shared", "size": "4Gi", "template": template("shared"), "copies": copies},
               {"name": "bidle", "size": "6Gi", "template": template("bidle")}])
    };
    for i in 0..2 {
        let r = gpu(
            &format!("b-gpu-{i}"),
            i + 1,
            b_models(serde_json::Value::Null),
            json!({"bidle": long_ago}),
        );
        b.create(&Default::default(), &r).await.unwrap();
    }
    let copies: Api<model_residency::api::ModelCopies> =
        Api::namespaced(client.clone(), "tenant-c");
    let mc = serde_json::from_value(json!({
        "apiVersion": "residency.dev/v1alpha1", "kind": "ModelCopies",
        "metadata": {"name": "shared"}, "spec": {"model": "shared", "replicas": 0}}))
    .unwrap();
    copies.create(&Default::default(), &mc).await.unwrap();

    // The operator over every namespace, its copy scaler on (a loopback
    // server stands in for the router: the counts do not matter, min does).
    let (router, _) = crate::support::artifact_server::serve().await;
    let ctx = model_residency::controller::Context::new(client.clone());
    let mut ctx = ctx;
    Arc::get_mut(&mut ctx).unwrap().copies = CopiesConfig {
        routers: vec![router],
        tick: Duration::from_millis(300),
        drain_grace: Duration::from_millis(200),
        ..CopiesConfig::default()
    };
    let operator = tokio::spawn(model_residency::operator::run(
        ctx,
        None,
        std::future::pending(),
        Default::default(),
    ));
    let state = |api: &Api<ModelResidency>, name: &str, model: &str| {
        let (api, name, model) = (api.clone(), name.to_owned(), model.to_owned());
        async move { api.get(&name).await.ok().map(|r| r.model_state(&model)) }
    };
    eventually(30, "A's shared and B's bidle loaded", || async {
        let mut up = state(&a, "a-gpu", "shared").await == Some(ModelState::Loaded);
        for i in 0..2 {
            up &= state(&b, &format!("b-gpu-{i}"), "bidle").await == Some(ModelState::Loaded);
        }
        up.then_some(())
    })
    .await;
    // Many ticks: B's GPUs keep bidle and never get A's model name.
    tokio::time::sleep(Duration::from_secs(4)).await;
    for i in 0..2 {
        let r = b.get(&format!("b-gpu-{i}")).await.unwrap();
        assert!(
            !r.spec.demand.contains_key("shared"),
            "A's copies wrote shared into B's demand on b-gpu-{i}"
        );
        assert_eq!(r.model_state("bidle"), ModelState::Loaded, "b-gpu-{i}");
    }
    let status = copies.get("shared").await.unwrap().status.unwrap();
    assert!(
        status
            .message
            .as_deref()
            .is_some_and(|m| m.contains("no ModelResidency in this namespace")),
        "{status:?}"
    );

    // B asks for two copies of its own shared: its signal is its own (the
    // ModelCopies in tenant-c does not stand for it), and A is untouched.
    for i in 0..2 {
        let patch =
            json!({"spec": {"models": b_models(json!({"min": 2, "scaleDownDelay": "1s"}))}});
        b.patch(
            &format!("b-gpu-{i}"),
            &PatchParams::default(),
            &Patch::Merge(&patch),
        )
        .await
        .unwrap();
    }
    // Its first copy by a request, as a router's would be.
    model_residency::residency::demand::load(&b, "b-gpu-0", "shared", Timestamp::now())
        .await
        .unwrap();
    eventually(30, "B's two copies of its shared", || async {
        let mut up = true;
        for i in 0..2 {
            up &= state(&b, &format!("b-gpu-{i}"), "shared").await == Some(ModelState::Loaded);
        }
        up.then_some(())
    })
    .await;
    let r = a.get("a-gpu").await.unwrap();
    assert_eq!(r.spec.demand.keys().collect::<Vec<_>>(), ["shared"]);
    operator.abort();
}

/// CopyPlaced/CopyUnplaced events of the test's namespace, series counted.
async fn copy_events(h: &Harness) -> u32 {
    let api: kube::Api<k8s_openapi::api::events::v1::Event> =
        kube::Api::namespaced(h.env.client.clone(), &h.env.namespace);
    let list = api.list(&Default::default()).await.unwrap();
    list.items
        .iter()
        .filter(|e| matches!(e.reason.as_deref(), Some("CopyPlaced" | "CopyUnplaced")))
        .map(|e| e.series.as_ref().map_or(1, |s| s.count as u32))
        .sum()
}

/// Two ModelCopies for one model (3 and 1): the older holds it and the
/// other stands aside with a condition (they fought for ever, copies added
/// and removed each tick); at steady state the scaler announces nothing
/// (a CopyPlaced event was written every tick).
#[tokio::test]
#[ignore = "needs the local control plane: scripts/test.sh runs it with --include-ignored"]
async fn a_second_model_copies_for_one_model_stands_aside_and_a_steady_state_is_quiet() {
    let mut h = Harness::start("copies-dup").await;
    four_gpus(&h).await;
    restart_with_scaler(&mut h, 200, 100).await;
    let api = model_copies(&h, 3).await;
    // Created a second later: the younger.
    tokio::time::sleep(Duration::from_millis(1100)).await;
    let second = serde_json::from_value(json!({
        "apiVersion": "residency.dev/v1alpha1", "kind": "ModelCopies",
        "metadata": {"name": "chat-b"}, "spec": {"model": "chat", "replicas": 1}}))
    .unwrap();
    api.create(&Default::default(), &second).await.unwrap();
    let condition = eventually(30, "three copies and chat-b aside", || async {
        let b = api.get("chat-b").await.ok()?.status?;
        let ready = b.conditions.iter().find(|c| c.type_ == "Ready")?.clone();
        (loaded(&h).await.len() == 3 && ready.reason == "DuplicateModelCopies").then_some(ready)
    })
    .await;
    assert_eq!(condition.status, "False");
    assert!(
        condition.message.contains("\"chat\""),
        "{}",
        condition.message
    );
    let holder = api.get("chat").await.unwrap().status.unwrap();
    assert_eq!(holder.conditions[0].reason, "CopiesKept");
    // A quiet stretch (15 ticks): no copy moves, no event is written.
    let events = copy_events(&h).await;
    let mut seen = std::collections::BTreeSet::new();
    for _ in 0..15 {
        seen.insert(loaded(&h).await);
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    assert_eq!(seen.len(), 1, "the copies moved: {seen:?}");
    assert_eq!(
        copy_events(&h).await - events,
        0,
        "copy events written at steady state"
    );
    // The holder goes: the other takes over, and its 1 decides.
    api.delete("chat", &Default::default()).await.unwrap();
    eventually(30, "chat-b holds the model: one copy", || async {
        let b = api.get("chat-b").await.ok()?.status?;
        (loaded(&h).await.len() == 1 && b.conditions.first()?.reason == "CopiesKept").then_some(())
    })
    .await;
}

/// A copy makes room from idle models only: `slow`, held at 1 by a
/// ModelDemand, is never a copy's victim (a copy evicted it 8 s after it
/// was Ready, and it stayed evicted with its ModelDemand at 1).
#[tokio::test]
#[ignore = "needs the local control plane: scripts/test.sh runs it with --include-ignored"]
async fn a_copy_never_evicts_a_model_a_model_demand_holds() {
    let mut h = Harness::start("copies-held").await;
    h.gpu_mode = Some("env");
    for i in 0..2 {
        let r: ModelResidency = serde_json::from_value(json!({
            "apiVersion": "residency.dev/v1alpha1", "kind": "ModelResidency",
            "metadata": {"name": format!("gpu-{i}")},
            "spec": {"nodeName": h.node, "device": i.to_string(), "budget": "8Gi", "gpu": {"mode": "env"},
                "models": [
                    {"name": "chat", "size": "4Gi", "template": (h.template)("chat"),
                     "copies": {"min": 2, "scaleDownDelay": "1s"}},
                    {"name": "slow", "size": "6Gi", "template": (h.template)("slow")}]},
        }))
        .unwrap();
        h.api.create(&Default::default(), &r).await.unwrap();
    }
    let demands: kube::Api<model_residency::api::ModelDemand> =
        kube::Api::namespaced(h.env.client.clone(), &h.env.namespace);
    let md = serde_json::from_value(json!({
        "apiVersion": "residency.dev/v1alpha1", "kind": "ModelDemand",
        "metadata": {"name": "slow"}, "spec": {"residency": "gpu-1", "model": "slow", "replicas": 1}}))
    .unwrap();
    demands.create(&Default::default(), &md).await.unwrap();
    h.until_state("gpu-1", "slow", ModelState::Loaded, 30).await;
    h.request("gpu-0", "chat").await;
    // The copy scaler on (a stand-in router: min decides), well past the
    // scale-down delay of everything.
    restart_with_a_stand_in_router(&mut h, 200).await;
    tokio::time::sleep(Duration::from_secs(4)).await;
    let r = h.api.get("gpu-1").await.unwrap();
    assert_eq!(
        r.model_state("slow"),
        ModelState::Loaded,
        "{:?}",
        h.events_of("gpu-1").await
    );
    assert!(
        !r.spec.demand.contains_key("chat"),
        "a copy of chat was asked on gpu-1"
    );
    assert!(
        h.ctx
            .metrics
            .sum_where("model_residency_model_copies_unplaced", r#"model="chat""#)
            == 1,
        "the wanted copy is said to have no home"
    );
    // Held no more: the copy may take its room now.
    demands
        .patch(
            "slow",
            &kube::api::PatchParams::default(),
            &kube::api::Patch::Merge(&json!({"spec": {"replicas": 0}})),
        )
        .await
        .unwrap();
    eventually(30, "chat's second copy on gpu-1", || async {
        (loaded(&h).await.len() == 2).then_some(())
    })
    .await;
}

/// Applies the Gateway API's standard CRDs (GatewayClass, Gateway,
/// HTTPRoute, from `scripts/inference-extension.sh`) to `plane`.
fn install_gateway_crds(plane: &model_residency::local::control_plane::ControlPlane) {
    install_crds(
        plane,
        "gateway-api-v1.6.3.yaml",
        "crd/httproutes.gateway.networking.k8s.io",
    );
}

#[tokio::test]
#[ignore = "needs the local control plane: scripts/test.sh runs it with --include-ignored"]
async fn gateway_routes_send_serving_models_to_their_pools_and_the_rest_to_the_router() {
    use kube::api::{Api, ApiResource, DynamicObject};
    use kube::core::GroupVersionKind;
    use model_residency::controller::copies::PoolConfig;
    use model_residency::controller::copies::routes::{MODEL_HEADER, ROUTER_ROUTE, RouteConfig};
    let mut h = Harness::start("copies-routes").await;
    install_inference_crd(h.env.plane, "v1.6.0");
    install_gateway_crds(h.env.plane);
    for i in 0..2 {
        let r: ModelResidency = serde_json::from_value(json!({
            "apiVersion": "residency.dev/v1alpha1", "kind": "ModelResidency",
            "metadata": {"name": format!("gpu-{i}")},
            "spec": {"nodeName": h.node, "device": i.to_string(), "budget": "8Gi",
                "gpu": {"mode": "env"},
                "models": [
                    {"name": "chat", "size": "4Gi", "template": (h.template)("chat")},
                    {"name": "other", "size": "4Gi", "template": (h.template)("other")}]},
        }))
        .unwrap();
        h.api.create(&Default::default(), &r).await.unwrap();
    }
    let ns = h.env.namespace.clone();
    let routes_config = RouteConfig::parse(
        "infra/inference-gateway",
        &format!("{ns}/model-residency-router:80"),
    )
    .unwrap();
    restart_with(
        &mut h,
        CopiesConfig {
            tick: Duration::from_millis(300),
            pools: Some(PoolConfig {
                endpoint_picker: None,
                routes: Some(routes_config),
                adapter_maps: false,
            }),
            ..CopiesConfig::default()
        },
    )
    .await;
    let resource = ApiResource::from_gvk_with_plural(
        &GroupVersionKind::gvk("gateway.networking.k8s.io", "v1", "HTTPRoute"),
        "httproutes",
    );
    let routes: Api<DynamicObject> = Api::namespaced_with(h.env.client.clone(), &ns, &resource);
    // Nothing serves yet: only the catch-all, toward the router Service.
    let all = eventually(30, "the catch-all route", || async {
        routes.get_opt(ROUTER_ROUTE).await.ok()?
    })
    .await;
    let rule = &all.data["spec"]["rules"][0];
    assert_eq!(rule["backendRefs"][0]["kind"], "Service");
    assert_eq!(rule["backendRefs"][0]["name"], "model-residency-router");
    assert_eq!(rule["backendRefs"][0]["port"], 80);
    assert_eq!(
        all.data["spec"]["parentRefs"][0]["name"],
        "inference-gateway"
    );
    assert_eq!(all.data["spec"]["parentRefs"][0]["namespace"], "infra");
    assert!(
        routes.get_opt("chat").await.unwrap().is_none(),
        "chat serves nowhere yet"
    );
    // chat loads: its route, toward its pool, matched by its header.
    h.request("gpu-0", "chat").await;
    let chat = eventually(30, "chat's route", || async {
        routes.get_opt("chat").await.ok()?
    })
    .await;
    let rule = &chat.data["spec"]["rules"][0];
    assert_eq!(rule["matches"][0]["headers"][0]["name"], MODEL_HEADER);
    assert_eq!(rule["matches"][0]["headers"][0]["value"], "chat");
    assert_eq!(rule["matches"][0]["path"]["value"], "/");
    assert_eq!(rule["backendRefs"][0]["kind"], "InferencePool");
    assert_eq!(
        rule["backendRefs"][0]["group"],
        "inference.networking.k8s.io"
    );
    assert_eq!(rule["backendRefs"][0]["name"], "chat");
    // Owned by both residencies that list chat: it goes with the last.
    assert_eq!(
        chat.metadata.owner_references.as_ref().map(Vec::len),
        Some(2)
    );
    assert!(routes.get_opt("other").await.unwrap().is_none());
    // What the API server stored (with its defaults) is what the operator
    // wrote: quiet ticks apply nothing.
    let patches = || {
        h.ctx.metrics.sum_where(
            "model_residency_api_requests_total",
            r#"verb="patch",resource="httproutes""#,
        )
    };
    let before = patches();
    tokio::time::sleep(Duration::from_secs(2)).await;
    assert_eq!(patches() - before, 0, "routes applied at steady state");
    // chat unloaded: its route goes (its requests reach the router, which
    // loads it again); the catch-all stays.
    model_residency::residency::demand::unload(&h.api, "gpu-0", "chat")
        .await
        .unwrap();
    eventually(30, "chat's route gone", || async {
        routes.get_opt("chat").await.ok()?.is_none().then_some(())
    })
    .await;
    assert!(routes.get_opt(ROUTER_ROUTE).await.unwrap().is_some());
}
