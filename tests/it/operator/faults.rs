//! Faults under load: the API server killed and restarted, the operator
//! killed and replaced, and writers racing the reconciler. Each scenario
//! runs its own control plane (the API server restart needs one of its own),
//! an independent budget watcher, and checks that nothing was lost.

use crate::support::rng;
use k8s_openapi::api::core::v1::Pod;
use kube::api::{Api, ListParams, Patch, PatchParams, PostParams};
use model_residency::api::{ModelResidency, ModelState};
use model_residency::controller::Context;
use model_residency::engine::Engine;
use model_residency::local::control_plane::ControlPlane;
use model_residency::local::kubelet::{FakeKubelet, KubeletConfig};
use model_residency::metrics::{API_REQUESTS, RECONCILES};
use model_residency::residency::demand;
use model_residency::residency::labels::{MODEL_LABEL, RESIDENCY_LABEL};
use serde_json::json;
use std::collections::{BTreeMap, BTreeSet};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::{Duration, Instant};

const NS: &str = "faults";
const GI: u64 = 1 << 30;
/// (name, size in GiB); budget 12 GiB.
const MODELS: &[(&str, u64)] = &[
    ("m1", 3),
    ("m2", 5),
    ("m3", 2),
    ("m4", 7),
    ("m5", 4),
    ("m6", 1),
];
const BUDGET_GI: u64 = 12;

/// A control plane of the test's own.
fn own_plane() -> ControlPlane {
    ControlPlane::start().unwrap_or_else(|e| panic!("the control plane could not start: {e}"))
}

struct Rig {
    client: kube::Client,
    api: Api<ModelResidency>,
    pods: Api<Pod>,
    _kubelet: FakeKubelet,
}

async fn rig(plane: &ControlPlane) -> Rig {
    let client = plane.client().await.unwrap();
    model_residency::local::install_crd(&client).await.unwrap();
    let nss: Api<k8s_openapi::api::core::v1::Namespace> = Api::all(client.clone());
    nss.create(
        &PostParams::default(),
        &serde_json::from_value(json!({"metadata": {"name": NS}})).unwrap(),
    )
    .await
    .unwrap();
    let api: Api<ModelResidency> = Api::namespaced(client.clone(), NS);
    let models: Vec<_> = MODELS
        .iter()
        .map(|(n, s)| {
            json!({"name": n, "size": format!("{s}Gi"),
            "template": {"spec": {"containers": [{"name": "s", "image": "i"}]}}})
        })
        .collect();
    let r: ModelResidency = serde_json::from_value(json!({
        "apiVersion": "residency.dev/v1alpha1", "kind": "ModelResidency",
        "metadata": {"name": "gpu"},
        "spec": {"nodeName": "node-f", "device": "0", "budget": format!("{BUDGET_GI}Gi"), "models": models},
    }))
    .unwrap();
    api.create(&PostParams::default(), &r).await.unwrap();
    let mut cfg = KubeletConfig::instant(&["node-f"]);
    cfg.load_delay = Duration::from_millis(20);
    let kubelet = FakeKubelet::start(client.clone(), cfg).await.unwrap();
    Rig {
        pods: Api::namespaced(client.clone(), NS),
        api,
        client,
        _kubelet: kubelet,
    }
}

fn start_operator(client: kube::Client) -> (Arc<Context>, tokio::task::JoinHandle<()>) {
    model_residency::operator::spawn_for_namespace(client, NS)
}

/// Random loads and unloads until `stop`; errors (an API server that is
/// down) are retried by moving on, as an autoscaler would.
fn storm(
    api: Api<ModelResidency>,
    seed: u64,
    stop: Arc<AtomicBool>,
    ok: Arc<AtomicU64>,
) -> tokio::task::JoinHandle<()> {
    tokio::spawn(async move {
        let mut next = rng(seed);
        while !stop.load(Ordering::Relaxed) {
            let m = MODELS[(next() % MODELS.len() as u64) as usize].0;
            let result = if next().is_multiple_of(5) {
                demand::unload(&api, "gpu", m).await
            } else {
                demand::load(&api, "gpu", m, k8s_openapi::jiff::Timestamp::now()).await
            };
            if result.is_ok() {
                ok.fetch_add(1, Ordering::Relaxed);
            }
            tokio::time::sleep(Duration::from_millis(next() % 30)).await;
        }
    })
}

/// Budget watcher (see tests/support/operator.rs): declared sizes of live
/// pods never above the budget, checked after every pod event.
fn watch_budget(pods: Api<Pod>) -> crate::support::operator::BudgetWatcher {
    crate::support::operator::BudgetWatcher::start(
        pods,
        BTreeMap::from([("gpu".to_owned(), BUDGET_GI * GI)]),
    )
}

/// After a storm and a fault: two more requests, each waited for, whose
/// sizes fill the budget exactly, so the resident set is determined
/// whatever came before. The cluster must agree with the engine replaying
/// them from the converged state.
async fn final_requests(rig: &Rig) {
    let r = rig.api.get("gpu").await.unwrap();
    let mut engine = Engine::new(BUDGET_GI * GI);
    for (n, size) in MODELS {
        engine.register(n, size * GI, false).unwrap();
    }
    let s = r.status.unwrap();
    let mut residents: Vec<_> = s.models.iter().filter(|m| m.is_resident()).collect();
    residents.sort_by_key(|m| m.last_used.clone());
    for m in residents {
        engine.restore(engine.id(&m.name).unwrap()).unwrap();
    }
    for model in ["m4", "m2"] {
        let at = k8s_openapi::jiff::Timestamp::now();
        demand::load(&rig.api, "gpu", model, at).await.unwrap();
        engine.request_named(model);
        let want = at.to_string();
        let t0 = Instant::now();
        loop {
            let r = rig.api.get("gpu").await.unwrap();
            let seen = r
                .status
                .as_ref()
                .and_then(|s| s.model(model))
                .and_then(|m| m.last_requested.clone());
            if seen.as_deref() == Some(want.as_str()) {
                break;
            }
            assert!(
                t0.elapsed() < Duration::from_secs(30),
                "{model} not processed"
            );
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }
    check_converged(rig, Duration::from_secs(60), true).await;
    let r = rig.api.get("gpu").await.unwrap();
    let loaded: BTreeSet<String> = r
        .status
        .unwrap()
        .models
        .iter()
        .filter(|m| m.state == ModelState::Loaded)
        .map(|m| m.name.to_string())
        .collect();
    let replay: BTreeSet<String> = engine
        .residents()
        .iter()
        .map(|&id| engine.name(id).to_owned())
        .collect();
    assert_eq!(
        loaded, replay,
        "the cluster and the engine disagree after the final requests"
    );
    assert_eq!(loaded, BTreeSet::from(["m2".to_owned(), "m4".to_owned()]));
}

/// The residency's model pods (its claim's holder carries another label).
async fn residency_pods(rig: &Rig) -> kube::api::ObjectList<Pod> {
    let of_gpu = format!("{RESIDENCY_LABEL}=gpu");
    rig.pods
        .list(&ListParams::default().labels(&of_gpu))
        .await
        .unwrap()
}

/// The residency's live pods that are on no node and that no scheduler has
/// said anything of (no condition), by name; empty when any other pod is
/// not Ready yet.
async fn unplaced_pods(rig: &Rig) -> Vec<String> {
    let pods = residency_pods(rig).await;
    let mut unplaced = Vec::new();
    for p in pods
        .items
        .iter()
        .filter(|p| p.metadata.deletion_timestamp.is_none())
    {
        let conditions = p.status.as_ref().and_then(|s| s.conditions.as_ref());
        let ready = conditions
            .into_iter()
            .flatten()
            .any(|c| c.type_ == "Ready" && c.status == "True");
        if ready {
            continue;
        }
        let bound = p.spec.as_ref().is_some_and(|s| s.node_name.is_some());
        if bound || conditions.is_some_and(|c| !c.is_empty()) {
            return Vec::new();
        }
        unplaced.push(p.metadata.name.clone().unwrap_or_default());
    }
    unplaced
}

/// Each pod's name, phase, node and conditions, for a failure's message:
/// whether a pod that never turned Ready was scheduled, started or seen.
fn describe_pods(pods: &[Pod]) -> String {
    let one = |p: &Pod| {
        let status = p.status.as_ref();
        let conditions: Vec<String> = status
            .and_then(|s| s.conditions.as_ref())
            .into_iter()
            .flatten()
            .map(|c| {
                format!(
                    "{}={}{}",
                    c.type_,
                    c.status,
                    c.reason
                        .as_deref()
                        .map(|r| format!("({r})"))
                        .unwrap_or_default()
                )
            })
            .collect();
        format!(
            "{} {} on {} created {} deleting {} [{}]",
            p.metadata.name.as_deref().unwrap_or("?"),
            status.and_then(|s| s.phase.as_deref()).unwrap_or("-"),
            p.spec
                .as_ref()
                .and_then(|s| s.node_name.as_deref())
                .unwrap_or("-"),
            p.metadata
                .creation_timestamp
                .as_ref()
                .map(|t| t.0.to_string())
                .unwrap_or_default(),
            p.metadata.deletion_timestamp.is_some(),
            conditions.join(" ")
        )
    };
    pods.iter().map(one).collect::<Vec<_>>().join("; ")
}

/// Waits for convergence and checks the end state: status matches spec,
/// every demand entry processed, one live pod per Loaded model and nothing
/// else, and (with `demanded_only`) only demanded models resident.
async fn check_converged(rig: &Rig, within: Duration, demanded_only: bool) -> Duration {
    converge(rig, within, demanded_only)
        .await
        .unwrap_or_else(|e| panic!("{e}"))
}

/// [`check_converged`], with no convergence in time as an `Err` that says
/// what was seen last (its other checks still panic).
async fn converge(rig: &Rig, within: Duration, demanded_only: bool) -> Result<Duration, String> {
    let t0 = Instant::now();
    let mut last = String::new();
    loop {
        if t0.elapsed() >= within {
            return Err(format!("no convergence within {within:?}; last: {last}"));
        }
        let r = rig.api.get("gpu").await.unwrap();
        let pods = residency_pods(rig).await;
        let live: Vec<String> = pods
            .items
            .iter()
            .filter(|p| p.metadata.deletion_timestamp.is_none())
            .filter(|p| p.status.as_ref().and_then(|s| s.phase.as_deref()) != Some("Failed"))
            .map(|p| p.metadata.labels.as_ref().unwrap()["residency.dev/model"].clone())
            .collect();
        let terminating = pods.items.len() - live.len();
        let Some(s) = r.status.clone() else {
            tokio::time::sleep(Duration::from_millis(100)).await;
            continue;
        };
        let loaded: BTreeSet<String> = s
            .models
            .iter()
            .filter(|m| m.state == ModelState::Loaded)
            .map(|m| m.name.to_string())
            .collect();
        let settled = s.observed_generation == r.metadata.generation
            // A queued request is still to be decided (it may wait out a
            // fresh model's grace after every pod is Ready).
            && s.models
                .iter()
                .all(|m| !matches!(m.state, ModelState::Loading | ModelState::Queued))
            && terminating == 0
            && live.iter().cloned().collect::<BTreeSet<_>>() == loaded;
        last = format!(
            "generation {:?}, status {:?}, live pods {live:?}; pods: {}",
            r.metadata.generation,
            s,
            describe_pods(&pods.items)
        );
        if settled {
            let unique: BTreeSet<&String> = live.iter().collect();
            assert_eq!(unique.len(), live.len(), "duplicate model pods: {live:?}");
            // Every demand entry was processed: the status has seen its
            // time or a later one (two writers' times can reach the API
            // server out of order; an older time than one processed is
            // ignored, as the README says).
            for (model, at) in &r.spec.demand {
                let st = s.model(model).expect("status for demanded model");
                let seen: k8s_openapi::jiff::Timestamp =
                    st.last_requested.as_deref().unwrap().parse().unwrap();
                let want: k8s_openapi::jiff::Timestamp = at.parse().unwrap();
                assert!(
                    seen >= want,
                    "demand for {model} lost: processed {seen}, requested {want}"
                );
            }
            if !demanded_only {
                return Ok(t0.elapsed());
            }
            // Every resident model is still demanded (a removed entry
            // unloads). The exact set depends on the order the storm's
            // requests were processed in, so the deterministic end state is
            // checked by `final_requests` instead.
            let demanded: BTreeSet<String> = r.spec.demand.keys().cloned().collect();
            assert!(
                loaded.is_subset(&demanded),
                "{loaded:?} not all demanded: {demanded:?}"
            );
            return Ok(t0.elapsed());
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "needs the local control plane: scripts/test.sh runs it with --include-ignored"]
async fn api_server_restart_mid_storm() {
    let plane = own_plane();
    let rig = rig(&plane).await;
    let watcher = watch_budget(rig.pods.clone());
    let (ctx, _operator) = start_operator(rig.client.clone());
    let stop = Arc::new(AtomicBool::new(false));
    let ok = Arc::new(AtomicU64::new(0));
    let storm = storm(rig.api.clone(), 7, stop.clone(), ok.clone());
    tokio::time::sleep(Duration::from_secs(3)).await;

    // kill -9 and start again on the same etcd and port.
    let (mut plane, down) = tokio::task::spawn_blocking(move || {
        let mut plane = plane;
        let down = plane.restart_apiserver().expect("restart the API server");
        (plane, down)
    })
    .await
    .unwrap();
    let before = ctx.metrics.sum(RECONCILES);
    tokio::time::sleep(Duration::from_secs(3)).await;
    stop.store(true, Ordering::Relaxed);
    storm.await.unwrap();
    let converged = match converge(&rig, Duration::from_secs(60), true).await {
        Ok(t) => t,
        Err(stalled) => {
            // kube-scheduler has placed none of the pods made just after
            // the API server came back, and said nothing of them, for
            // minutes (once in CI and once in three parallel runs of the
            // suite here on 12-05; never in sixteen runs of this test
            // alone). That is Kubernetes' own; the operator's part
            // is to say so in status, and to converge once an admin
            // restarts the scheduler.
            let unplaced = unplaced_pods(&rig).await;
            assert!(
                !unplaced.is_empty(),
                "{stalled}\nthe control plane:\n{}",
                plane.report()
            );
            let s = rig.api.get("gpu").await.unwrap().status.unwrap();
            for m in s.models.iter().filter(|m| m.state == ModelState::Loading) {
                let message = m.message.as_deref().unwrap_or_default();
                assert!(
                    message.contains("no scheduler has said why"),
                    "{} waits for an unplaced pod and does not say so: {m:?}",
                    m.name
                );
            }
            eprintln!(
                "kube-scheduler placed none of {unplaced:?} in 60 s; restarted. The control plane:\n{}",
                plane.report()
            );
            plane.restart_scheduler().expect("restart kube-scheduler");
            let again = converge(&rig, Duration::from_secs(60), true).await;
            let again = again.unwrap_or_else(|e| {
                panic!(
                    "{e}\nafter kube-scheduler's restart; the control plane:\n{}",
                    plane.report()
                )
            });
            Duration::from_secs(60) + again
        }
    };
    // Its watches list again once they reconnect, which reconciles every
    // residency; they retry with a backoff of up to 4 s, so on a busy
    // machine that can come after the status had settled (it failed the
    // run twice when asserted at once).
    let t = std::time::Instant::now();
    while ctx.metrics.sum(RECONCILES) <= before && t.elapsed() < Duration::from_secs(30) {
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    assert!(
        ctx.metrics.sum(RECONCILES) > before,
        "the operator never reconnected (30 s after the restart's storm)"
    );
    eprintln!(
        "api server restart: down {:.2} s; {} demand writes succeeded; converged {:.2} s after the storm",
        down.as_secs_f64(),
        ok.load(Ordering::Relaxed),
        converged.as_secs_f64()
    );
    assert!(*watcher.events.lock().unwrap() > 10);
    assert_eq!(
        watcher.violations.lock().unwrap().clone(),
        Vec::<String>::new()
    );
    drop(plane);
}

/// kube-scheduler down: a demanded model's pod is placed nowhere and no
/// scheduler speaks of it; after 30 s the model's message says so (the
/// operator has nothing else to go on), and once the scheduler is back the
/// model loads with no help from anyone. The same path as the fallback of
/// [`api_server_restart_mid_storm`], made on purpose.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "needs the local control plane: scripts/test.sh runs it with --include-ignored"]
async fn kube_scheduler_down_the_model_says_so_and_loads_once_it_is_back() {
    let mut plane = own_plane();
    let rig = rig(&plane).await;
    let _operator = start_operator(rig.client.clone());
    // The GPU's claim first: its holder pod is placed by the scheduler too
    // (without it the residency says `GpuPending`, naming the holder).
    let t0 = Instant::now();
    loop {
        let r = rig.api.get("gpu").await.unwrap();
        let ready = r
            .status
            .iter()
            .flat_map(|s| &s.conditions)
            .any(|c| c.type_ == "Ready" && c.status == "True");
        if ready {
            break;
        }
        assert!(t0.elapsed() < Duration::from_secs(60), "{:?}", r.status);
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    plane.stop_scheduler();
    demand::load(&rig.api, "gpu", "m1", k8s_openapi::jiff::Timestamp::now())
        .await
        .unwrap();
    let t0 = Instant::now();
    let said = loop {
        let r = rig.api.get("gpu").await.unwrap();
        let m1 = r.status.as_ref().and_then(|s| s.model("m1")).cloned();
        if let Some(m) = m1.filter(|m| {
            m.message
                .as_deref()
                .is_some_and(|t| t.contains("no scheduler has said why"))
        }) {
            assert_eq!(m.state, ModelState::Loading, "{m:?}");
            break m.message.unwrap();
        }
        assert!(
            t0.elapsed() < Duration::from_secs(90),
            "m1 never said its pod is unplaced: {:?}",
            r.status
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    };
    let pods = rig
        .pods
        .list(&ListParams::default().labels(&format!("{MODEL_LABEL}=m1")))
        .await
        .unwrap();
    assert_eq!(pods.items.len(), 1, "{}", describe_pods(&pods.items));
    let pod = pods.items[0].metadata.name.clone().unwrap();
    assert!(
        said.contains(&pod),
        "the message names the pod {pod}: {said}"
    );
    assert_eq!(unplaced_pods(&rig).await, vec![pod]);
    plane.restart_scheduler().unwrap();
    check_converged(&rig, Duration::from_secs(60), true).await;
    let r = rig.api.get("gpu").await.unwrap();
    let m1 = r.status.unwrap().model("m1").cloned().unwrap();
    assert_eq!(m1.state, ModelState::Loaded, "{m1:?}");
    drop(plane);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "needs the local control plane: scripts/test.sh runs it with --include-ignored"]
async fn operator_killed_mid_storm_and_replaced() {
    let plane = own_plane();
    let rig = rig(&plane).await;
    let watcher = watch_budget(rig.pods.clone());
    let (_, first) = start_operator(rig.client.clone());
    let stop = Arc::new(AtomicBool::new(false));
    let ok = Arc::new(AtomicU64::new(0));
    let storm = storm(rig.api.clone(), 11, stop.clone(), ok.clone());
    tokio::time::sleep(Duration::from_secs(3)).await;
    first.abort(); // no cleanup, as a killed process gets
    tokio::time::sleep(Duration::from_secs(1)).await;
    let killed_for = Instant::now();
    let (second, _task) = start_operator(plane.client().await.unwrap());
    tokio::time::sleep(Duration::from_secs(2)).await;
    stop.store(true, Ordering::Relaxed);
    storm.await.unwrap();
    let converged = check_converged(&rig, Duration::from_secs(60), true).await;
    assert!(
        second.metrics.sum(API_REQUESTS) > 0,
        "the replacement did nothing"
    );
    final_requests(&rig).await;
    eprintln!(
        "operator kill: replacement running {:.2} s later; converged {:.2} s after the storm ended",
        (killed_for.elapsed() - converged).as_secs_f64(),
        converged.as_secs_f64()
    );
    assert_eq!(
        watcher.violations.lock().unwrap().clone(),
        Vec::<String>::new()
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "needs the local control plane: scripts/test.sh runs it with --include-ignored"]
async fn autoscaler_and_admin_race_the_reconciler() {
    let plane = own_plane();
    let rig = rig(&plane).await;
    let (ctx, _operator) = start_operator(rig.client.clone());
    // The budget moves between 9 and 14Gi: live pods never hold more than
    // the largest.
    let watcher = crate::support::operator::BudgetWatcher::start(
        rig.pods.clone(),
        BTreeMap::from([("gpu".to_owned(), 14 * GI)]),
    );
    let stop = Arc::new(AtomicBool::new(false));
    let ok = Arc::new(AtomicU64::new(0));
    // Two autoscalers...
    let a = storm(rig.api.clone(), 21, stop.clone(), ok.clone());
    let b = storm(rig.api.clone(), 22, stop.clone(), ok.clone());
    // ...and an admin editing the budget and a model's size (merge patches
    // of fields no autoscaler writes), also racing the status writes.
    let admin = {
        let api = rig.api.clone();
        let stop = stop.clone();
        tokio::spawn(async move {
            let mut next = rng(23);
            let mut edits = 0;
            while !stop.load(Ordering::Relaxed) {
                let budget = format!("{}Gi", 9 + next() % 6);
                let edit = api
                    .patch(
                        "gpu",
                        &PatchParams::default(),
                        &Patch::Merge(json!({"spec": {"budget": budget}})),
                    )
                    .await;
                edits += u64::from(edit.is_ok());
                tokio::time::sleep(Duration::from_millis(150)).await;
            }
            // Leave it as the test expects.
            api.patch(
                "gpu",
                &PatchParams::default(),
                &Patch::Merge(json!({"spec": {"budget": format!("{BUDGET_GI}Gi")}})),
            )
            .await
            .unwrap();
            edits
        })
    };
    tokio::time::sleep(Duration::from_secs(5)).await;
    stop.store(true, Ordering::Relaxed);
    a.await.unwrap();
    b.await.unwrap();
    let edits = admin.await.unwrap();
    check_converged(&rig, Duration::from_secs(60), false).await;
    let r = rig.api.get("gpu").await.unwrap();
    let s = r.status.unwrap();
    assert_eq!(s.budget.as_deref(), Some(format!("{BUDGET_GI}Gi").as_str()));
    let (demand_writes, reconciles, writes) = (
        ok.load(Ordering::Relaxed),
        ctx.metrics.sum(RECONCILES),
        ctx.metrics.sum(API_REQUESTS),
    );
    eprintln!(
        "races: {demand_writes} demand writes, {edits} budget edits, {reconciles} reconciles, {writes} writes"
    );
    // The race happened: both kinds of writes went in, and the operator
    // worked through them.
    assert!(
        demand_writes >= 20 && edits >= 5,
        "too few racing writes: {demand_writes} demand, {edits} budget"
    );
    assert!(
        reconciles >= 10 && writes > 0,
        "{reconciles} reconciles, {writes} writes"
    );
    assert!(
        s.counters.loads > 0 && s.counters.evictions > 0,
        "{:?}",
        s.counters
    );
    assert_eq!(
        watcher.violations.lock().unwrap().clone(),
        Vec::<String>::new()
    );
    assert!(
        *watcher.events.lock().unwrap() > 0,
        "the watcher saw no pod"
    );
}
