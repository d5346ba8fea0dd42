//! The operator end to end: the real controller against a real API server,
//! with the kubelet stand-in playing the GPU node. Every scenario drives the
//! cluster through demand patches and checks status, pods and events.

mod anticipation;
mod faults;
mod gangs;
mod gpu_claims;
mod gpu_health;
mod gpus_pods_and_events;
mod specs;
mod warm;

use crate::support::cluster::eventually;
use crate::support::operator::{Harness, Model};
use crate::support::seed::{MI, SEED, SEED_CASES, assert_matches_the_engine, seed_engine};
use futures::TryStreamExt;
use k8s_openapi::api::core::v1::Pod;
use k8s_openapi::api::events::v1::Event;
use kube::api::{Api, DeleteParams, ListParams, Patch, PatchParams};
use kube::runtime::{WatchStreamExt, watcher};
use model_residency::api::{ModelResidency, ModelState, ModelStatus};
use model_residency::controller::pods::pod_name;
use model_residency::local::kubelet::fail_pod;
use model_residency::metrics::{API_REQUESTS, RECONCILES};
use serde_json::json;
use std::collections::{BTreeMap, BTreeSet};
use std::sync::{Arc, Mutex};

fn model<'a>(r: &'a ModelResidency, name: &str) -> &'a ModelStatus {
    r.status
        .as_ref()
        .and_then(|s| s.model(name))
        .unwrap_or_else(|| panic!("no status for {name}: {:?}", r.status))
}

fn condition<'a>(
    r: &'a ModelResidency,
    type_: &str,
) -> &'a k8s_openapi::apimachinery::pkg::apis::meta::v1::Condition {
    r.status
        .as_ref()
        .and_then(|s| s.conditions.iter().find(|c| c.type_ == type_))
        .unwrap_or_else(|| panic!("no {type_} condition"))
}

async fn events_for(h: &Harness, name: &str) -> Vec<(String, String)> {
    let api: Api<Event> = Api::namespaced(h.env.client.clone(), &h.env.namespace);
    api.list(&ListParams::default())
        .await
        .unwrap()
        .items
        .into_iter()
        .filter(|e| e.regarding.as_ref().and_then(|r| r.name.as_deref()) == Some(name))
        .map(|e| (e.reason.unwrap_or_default(), e.note.unwrap_or_default()))
        .collect()
}

#[tokio::test]
#[ignore = "needs the local control plane: scripts/test.sh runs it with --include-ignored"]
async fn seed_cases_through_demand_patches_match_the_engine() {
    let h = Harness::start("seed-cases").await;
    let cases = SEED_CASES;
    let mut budgets = BTreeMap::new();
    for (i, (budget, _)) in cases.iter().enumerate() {
        budgets.insert(format!("case-{i}"), budget * MI);
    }
    let watcher = h.budget_watcher(budgets);
    for (i, (budget, requests)) in cases.iter().enumerate() {
        let name = format!("case-{i}");
        h.create(&name, &format!("{budget}Mi"), SEED).await;
        let mut engine = seed_engine(*budget);
        let mut last = None;
        for req in *requests {
            engine.request_named(req);
            last = Some(h.request(&name, req).await);
        }
        let r = last.unwrap();
        assert_matches_the_engine(&h, &name, &r, &engine).await;
        let s = r.status.as_ref().unwrap();
        let want: BTreeSet<String> = engine
            .residents()
            .iter()
            .map(|&id| engine.name(id).to_owned())
            .collect();
        let resident: BTreeSet<String> = s
            .models
            .iter()
            .filter(|m| m.is_resident())
            .map(|m| m.name.to_string())
            .collect();
        assert_eq!(resident, want, "{name} resident set");
        assert_eq!(
            s.used.as_deref(),
            Some(model_residency::quantity::format_bytes(engine.used()).as_str())
        );
        assert_eq!(
            s.peak.as_deref(),
            Some(model_residency::quantity::format_bytes(engine.peak()).as_str())
        );
    }
    assert!(
        *watcher.events.lock().unwrap() > 0,
        "the budget watcher saw nothing"
    );
    assert_eq!(
        watcher.violations.lock().unwrap().clone(),
        Vec::<String>::new()
    );
}

#[tokio::test]
#[ignore = "needs the local control plane: scripts/test.sh runs it with --include-ignored"]
async fn oversized_model_is_refused_with_sizes_no_pod_and_an_event() {
    let h = Harness::start("oversized").await;
    h.create("gpu", "16000Mi", SEED).await;
    h.request("gpu", "zimage").await;
    let r = h.request("gpu", "oversized").await;
    let m = model(&r, "oversized");
    assert_eq!(m.state, ModelState::Refused);
    assert_eq!(m.reason.as_deref(), Some("LargerThanBudget"));
    let refused = condition(&r, "Refused");
    assert_eq!(
        (refused.status.as_str(), refused.reason.as_str()),
        ("True", "LargerThanBudget")
    );
    assert!(
        refused.message.contains("20000Mi") && refused.message.contains("16000Mi"),
        "{}",
        refused.message
    );
    // Nothing evicted, no pod for it.
    assert_eq!(model(&r, "zimage").state, ModelState::Loaded);
    assert_eq!(r.status.as_ref().unwrap().counters.evictions, 0);
    assert_eq!(
        h.pods_of("gpu").await.0,
        BTreeSet::from(["zimage".to_owned()])
    );
    eventually(10, "a Refused event", || async {
        events_for(&h, "gpu")
            .await
            .into_iter()
            .find(|(reason, note)| reason == "Refused" && note.contains("20000Mi"))
    })
    .await;
    // kubectl shows the refusal count.
    let out = h.env.kubectl(&["get", "mres", "gpu", "--no-headers"]);
    let line = String::from_utf8_lossy(&out.stdout).to_string();
    let cols: Vec<&str> = line.split_whitespace().collect();
    // Used, resident, loading, refused.
    assert_eq!(cols[4..8], ["10900Mi", "1", "0", "1"], "{line}");
}

#[tokio::test]
#[ignore = "needs the local control plane: scripts/test.sh runs it with --include-ignored"]
async fn pinned_models_are_never_evicted() {
    let h = Harness::start("pinned").await;
    h.create(
        "gpu",
        "10Gi",
        &[
            ("base", "6Gi", true),
            ("a", "3Gi", false),
            ("b", "3Gi", false),
            ("big", "5Gi", false),
        ],
    )
    .await;
    h.request("gpu", "base").await;
    h.request("gpu", "a").await;
    let r = h.request("gpu", "b").await; // evicts a, never base
    assert_eq!(model(&r, "a").state, ModelState::Evicted);
    assert_eq!(model(&r, "base").state, ModelState::Loaded);
    let r = h.request("gpu", "big").await; // would need base's room
    let m = model(&r, "big");
    assert_eq!(
        (m.state, m.reason.as_deref()),
        (ModelState::Refused, Some("NoEvictableRoom"))
    );
    assert_eq!(model(&r, "base").state, ModelState::Loaded);
    assert_eq!(
        model(&r, "b").state,
        ModelState::Loaded,
        "a refusal evicts nothing"
    );
    assert_eq!(condition(&r, "Refused").reason, "NoEvictableRoom");
}

#[tokio::test]
#[ignore = "needs the local control plane: scripts/test.sh runs it with --include-ignored"]
async fn removing_demand_unloads_and_is_not_an_eviction() {
    let h = Harness::start("unload").await;
    h.create("gpu", "16000Mi", SEED).await;
    h.request("gpu", "zimage").await;
    h.request("gpu", "qwen-llm").await;
    let r = model_residency::residency::demand::unload(&h.api, "gpu", "zimage")
        .await
        .unwrap();
    assert!(!r.spec.demand.contains_key("zimage"));
    let r = h
        .until_state("gpu", "zimage", ModelState::Unloaded, 30)
        .await;
    let c = r.status.as_ref().unwrap().counters;
    assert_eq!((c.unloads, c.evictions), (1, 0));
    h.converged("gpu").await;
    assert_eq!(
        h.pods_of("gpu").await.0,
        BTreeSet::from(["qwen-llm".to_owned()])
    );
    eventually(10, "an Unloaded event", || async {
        events_for(&h, "gpu")
            .await
            .into_iter()
            .find(|(reason, _)| reason == "Unloaded")
    })
    .await;
}

#[tokio::test]
#[ignore = "needs the local control plane: scripts/test.sh runs it with --include-ignored"]
async fn rate_eviction_remembers_requests_across_an_unload_and_reconciles() {
    let h = Harness::start("rate").await;
    let models = [
        ("a", "4Gi", false),
        ("b", "4Gi", false),
        ("c", "4Gi", false),
    ];
    h.create("gpu", "8Gi", &models).await;
    h.patch_spec("gpu", json!({"eviction": "rate"})).await;
    // Every request is decided in a reconcile of its own, on an engine
    // rebuilt from the status: the rates live there.
    for m in ["a", "b", "a", "b", "a"] {
        h.request("gpu", m).await;
    }
    model_residency::residency::demand::unload(&h.api, "gpu", "a")
        .await
        .unwrap();
    let r = h.until_state("gpu", "a", ModelState::Unloaded, 30).await;
    let kept = model(&r, "a")
        .rate
        .expect("an unloaded model keeps its rate");
    assert!(
        (1.7..1.81).contains(&kept),
        "a: 1 + 0.4 + 0.4, decayed: {kept}"
    );
    h.request("gpu", "a").await;
    h.request("gpu", "b").await;
    let r = h.request("gpu", "c").await;
    let s = r.status.as_ref().unwrap();
    assert_eq!(s.served, Some(8), "eight requests served");
    let (a, b) = (model(&r, "a"), model(&r, "b"));
    // a: 1.8 kept through its unload, plus a fifth (one request later);
    // b: 1.4 plus three fifths (three later). Counted at 6 and 7 of the
    // served clock, each decayed by the requests served since its last.
    assert_eq!((a.rate_at, b.rate_at), (Some(6), Some(7)), "{s:#?}");
    let (ra, rb) = (a.rate.unwrap(), b.rate.unwrap());
    assert!(
        (1.98..2.0).contains(&ra) && (1.98..2.0).contains(&rb),
        "{ra} {rb}"
    );
    // The victim is the one whose absence waits least per GiB: rate (as
    // of now) times its measured load; the stand-in's loads take 0-1 s,
    // so that decides as often as the rates do. Equal: LRU (a).
    let now =
        |rate: f64, at: u64| rate * (-((8 - at) as f64) * std::f64::consts::LN_2 / 500.0).exp();
    let wait_a = now(ra, 6) * a.load_seconds.unwrap();
    let wait_b = now(rb, 7) * b.load_seconds.unwrap();
    let (gone, kept) = if wait_b < wait_a {
        ("b", "a")
    } else {
        ("a", "b")
    };
    assert_eq!(
        model(&r, gone).state,
        ModelState::Evicted,
        "{wait_a} {wait_b}: {s:#?}"
    );
    assert_eq!(model(&r, kept).state, ModelState::Loaded, "{s:#?}");
    assert_eq!(model(&r, "c").state, ModelState::Loaded, "{s:#?}");
}

#[tokio::test]
#[ignore = "needs the local control plane: scripts/test.sh runs it with --include-ignored"]
async fn budget_shrink_evicts_lru_until_it_fits() {
    let h = Harness::start("shrink").await;
    h.create("gpu", "12000Mi", SEED).await;
    for m in ["small-a", "small-b", "small-c", "small-a"] {
        h.request("gpu", m).await;
    }
    // LRU order is now b, c, a: shrinking to 8000Mi evicts b.
    h.patch_spec("gpu", json!({"budget": "8000Mi"})).await;
    let r = eventually(30, "the shrink to apply", || async {
        let r = h.api.get("gpu").await.unwrap();
        (r.status.as_ref()?.budget.as_deref() == Some("8000Mi")).then_some(r)
    })
    .await;
    let b = model(&r, "small-b");
    assert_eq!(
        (b.state, b.reason.as_deref()),
        (ModelState::Evicted, Some("BudgetShrunk"))
    );
    h.converged("gpu").await;
    assert_eq!(
        h.pods_of("gpu").await.0,
        BTreeSet::from(["small-a".to_owned(), "small-c".to_owned()])
    );
}

#[tokio::test]
#[ignore = "needs the local control plane: scripts/test.sh runs it with --include-ignored"]
async fn a_grown_model_is_readmitted_and_a_removed_one_unloaded() {
    let h = Harness::start("registry-edit").await;
    h.create(
        "gpu",
        "10Gi",
        &[
            ("a", "3Gi", false),
            ("b", "3Gi", false),
            ("c", "3Gi", false),
        ],
    )
    .await;
    for m in ["a", "b", "c"] {
        h.request("gpu", m).await;
    }
    // c grows to 6Gi: the LRU (a) makes room; c restarts with its new size.
    let r = h.api.get("gpu").await.unwrap();
    let mut models = serde_json::to_value(&r.spec.models).unwrap();
    models[2]["size"] = json!("6Gi");
    h.patch_spec("gpu", json!({"models": models})).await;
    let r = eventually(30, "c to be re-admitted at 6Gi", || async {
        let r = h.api.get("gpu").await.unwrap();
        (model(&r, "c").size.as_deref() == Some("6Gi")
            && model(&r, "c").state == ModelState::Loaded)
            .then_some(r)
    })
    .await;
    assert_eq!(model(&r, "a").state, ModelState::Evicted);
    let pod = h.pods.get(&pod_name("gpu", "c")).await.unwrap();
    assert_eq!(
        pod.metadata.annotations.unwrap()["residency.dev/size"],
        (6u64 << 30).to_string()
    );
    // b is removed from the registry: unloaded, its pod deleted.
    let models = json!([r.spec.models[0], r.spec.models[2]]);
    h.patch_spec("gpu", json!({"models": models})).await;
    let r = h.converged("gpu").await;
    // Still demanded, so it keeps a status entry saying what happened.
    let b = model(&r, "b");
    assert_eq!(
        (b.state, b.reason.as_deref()),
        (ModelState::Unloaded, Some("RemovedFromRegistry"))
    );
    assert_eq!(r.status.as_ref().unwrap().counters.unloads, 1);
    assert_eq!(h.pods_of("gpu").await.0, BTreeSet::from(["c".to_owned()]));
}

#[tokio::test]
#[ignore = "needs the local control plane: scripts/test.sh runs it with --include-ignored"]
async fn a_stray_status_writer_cannot_keep_an_entry_the_operator_drops() {
    let h = Harness::start("stray-status").await;
    h.create("gpu", "10Gi", &[("a", "3Gi", false), ("b", "3Gi", false)])
        .await;
    for m in ["a", "b"] {
        h.request("gpu", m).await;
    }
    // A budget over the device's 80Gi: the BudgetExceedsDevice condition,
    // which is listed only while it holds.
    h.patch_spec("gpu", json!({"budget": "100Gi"})).await;
    eventually(30, "BudgetExceedsDevice", || async {
        let r = h.api.get("gpu").await.unwrap();
        let s = r.status?;
        s.conditions
            .iter()
            .any(|c| c.type_ == "BudgetExceedsDevice")
            .then_some(())
    })
    .await;
    // Someone takes over one field of b's entry, and one of that
    // condition, by server-side apply (a script fixing a counter, a second
    // operator under another name). With lists keyed by name and type this
    // was accepted, and the operator's later write without them left each
    // entry with only its key and that field: refused (state, status and
    // reason are required) at every write after. As atomic lists the
    // partial entries are refused themselves.
    let pp = kube::api::PatchParams::apply("stray-writer").force();
    for status in [
        json!({"models": [{"name": "b", "failures": 3}]}),
        json!({"conditions": [{"type": "BudgetExceedsDevice", "message": "mine"}]}),
    ] {
        let stray = json!({
            "apiVersion": "residency.dev/v1alpha1", "kind": "ModelResidency",
            "metadata": {"name": "gpu"}, "status": status,
        });
        let result = h
            .api
            .patch_status("gpu", &pp, &kube::api::Patch::Apply(&stray))
            .await;
        assert!(
            matches!(&result, Err(kube::Error::Api(s)) if s.code == 422),
            "a partial entry was not refused: {result:?}"
        );
    }
    // The budget fits again and b leaves the registry and its demand: the
    // condition and b's entry go.
    let r = h.api.get("gpu").await.unwrap();
    h.patch_spec(
        "gpu",
        json!({"budget": "10Gi", "models": [r.spec.models[0]], "demand": {"b": null}}),
    )
    .await;
    let r = h.converged("gpu").await;
    let s = r.status.as_ref().unwrap();
    let names: Vec<&str> = s.models.iter().map(|m| &*m.name).collect();
    assert_eq!(names, ["a"]);
    let types: Vec<&str> = s.conditions.iter().map(|c| &*c.type_).collect();
    assert_eq!(types, ["Ready", "Refused", "Degraded"]);
    assert_eq!(h.pods_of("gpu").await.0, BTreeSet::from(["a".to_owned()]));
}

#[tokio::test]
#[ignore = "needs the local control plane: scripts/test.sh runs it with --include-ignored"]
async fn a_deleted_pod_is_recreated_and_a_failed_one_degrades() {
    let h = Harness::start("pod-faults").await;
    h.create("gpu", "16000Mi", SEED).await;
    h.request("gpu", "zimage").await;
    let zimage = pod_name("gpu", "zimage");
    let old = h.pods.get(&zimage).await.unwrap().metadata.uid;
    h.pods
        .delete(&zimage, &DeleteParams::default())
        .await
        .unwrap();
    // Recreated, and running (so that failing it below is a running model
    // server failing, not one that has not started yet).
    eventually(30, "the pod to be recreated and ready", || async {
        let p: Pod = h.pods.get_opt(&zimage).await.unwrap()?;
        let ready = p
            .status
            .and_then(|s| s.conditions)
            .is_some_and(|cs| cs.iter().any(|c| c.type_ == "Ready" && c.status == "True"));
        (p.metadata.uid != old && p.metadata.deletion_timestamp.is_none() && ready).then_some(())
    })
    .await;
    h.converged("gpu").await;

    // Every status from here on, to check Degraded never drops before the
    // model is Loaded again.
    let seen = Arc::new(Mutex::new(Vec::new()));
    let recorder = {
        let (api, seen) = (h.api.clone(), seen.clone());
        tokio::spawn(async move {
            let stream = watcher(api, watcher::Config::default()).applied_objects();
            futures::pin_mut!(stream);
            while let Ok(Some(r)) = stream.try_next().await {
                let r: ModelResidency = r;
                let Some(st) = r.status else { continue };
                let Some(z) = st.model("zimage") else {
                    continue;
                };
                let degraded = st
                    .conditions
                    .iter()
                    .any(|c| c.type_ == "Degraded" && c.status == "True");
                seen.lock().unwrap().push((z.state, degraded));
            }
        })
    };
    fail_pod(&h.pods, &zimage, "CUDA error: out of memory")
        .await
        .unwrap();
    let r = h.until_state("gpu", "zimage", ModelState::Failed, 30).await;
    // The failed pod is kept until the retry replaces it, so its logs say
    // why.
    let failed = h.pods.get(&zimage).await.unwrap();
    assert!(failed.metadata.deletion_timestamp.is_none());
    assert_eq!(
        failed.status.and_then(|s| s.phase).as_deref(),
        Some("Failed")
    );
    let degraded = condition(&r, "Degraded");
    assert_eq!(degraded.status, "True");
    assert!(
        degraded.message.contains("CUDA error"),
        "{}",
        degraded.message
    );
    assert_eq!(model(&r, "zimage").failures, 1);
    eventually(10, "a LoadFailed event", || async {
        events_for(&h, "gpu")
            .await
            .into_iter()
            .find(|(reason, _)| reason == "LoadFailed")
    })
    .await;
    // Retried with backoff: a new pod comes up and the model recovers.
    let r = h.until_state("gpu", "zimage", ModelState::Loaded, 40).await;
    assert_eq!(condition(&r, "Degraded").status, "False");
    recorder.abort();
    let seen = seen.lock().unwrap().clone();
    let after_failure = seen
        .iter()
        .skip_while(|(state, _)| *state != ModelState::Failed)
        .take_while(|(state, _)| *state != ModelState::Loaded);
    for (state, degraded) in after_failure {
        assert!(
            degraded,
            "Degraded dropped while {state:?} before the model was Loaded: {seen:?}"
        );
    }
    assert!(
        seen.iter().any(|(s, _)| *s == ModelState::Loading),
        "the retry was not seen: {seen:?}"
    );
}

#[tokio::test]
#[ignore = "needs the local control plane: scripts/test.sh runs it with --include-ignored"]
async fn unknown_model_demand_gives_its_condition() {
    let h = Harness::start("unknown").await;
    h.create("gpu", "16000Mi", SEED).await;
    let r = h.request("gpu", "ghost").await;
    let m = model(&r, "ghost");
    assert_eq!(
        (m.state, m.reason.as_deref()),
        (ModelState::Refused, Some("UnknownModel"))
    );
    assert_eq!(condition(&r, "Refused").reason, "UnknownModel");
    assert_eq!(r.status.as_ref().unwrap().counters.refusals, 1);
}

#[tokio::test]
#[ignore = "needs the local control plane: scripts/test.sh runs it with --include-ignored"]
async fn a_deleted_residency_takes_its_metrics_with_it() {
    let h = Harness::start("metrics-gone").await;
    h.create("gpu", "16000Mi", SEED).await;
    h.request("gpu", "zimage").await;
    let series = r#"model_residency_loads_total{namespace="NS",residency="gpu"} 1"#
        .replace("NS", &h.env.namespace);
    eventually(10, "the residency's metrics", || async {
        h.ctx.metrics.encode().contains(&series).then_some(())
    })
    .await;
    h.api
        .delete("gpu", &kube::api::DeleteParams::default())
        .await
        .unwrap();
    eventually(10, "the metrics to go with the residency", || async {
        (!h.ctx.metrics.encode().contains(r#"residency="gpu""#)).then_some(())
    })
    .await;
}

#[tokio::test]
#[ignore = "needs the local control plane: scripts/test.sh runs it with --include-ignored"]
async fn a_converged_residency_is_not_written_again() {
    let h = Harness::start("idempotent").await;
    h.create("gpu", "16000Mi", SEED).await;
    h.request("gpu", "zimage").await;
    h.request("gpu", "qwen-llm").await;
    h.request("gpu", "oversized").await;
    h.converged("gpu").await;
    // Waits for the watch to have caught up with every status write the
    // operator made (its record of them empties then), then forces
    // reconciles with metadata changes that do not touch the spec, each
    // waited for.
    eventually(
        10,
        "the watch to catch up with the operator's writes",
        || async { (h.ctx.written.pending() == 0).then_some(()) },
    )
    .await;
    let writes = h.ctx.metrics.sum(API_REQUESTS);
    for i in 0..5 {
        let reconciles = h.ctx.metrics.sum(RECONCILES);
        h.api
            .patch(
                "gpu",
                &PatchParams::default(),
                &Patch::Merge(json!({"metadata": {"annotations": {"poke": i.to_string()}}})),
            )
            .await
            .unwrap();
        eventually(10, "the poke to be reconciled", || async {
            (h.ctx.metrics.sum(RECONCILES) > reconciles).then_some(())
        })
        .await;
    }
    assert_eq!(
        h.ctx.metrics.sum(API_REQUESTS),
        writes,
        "a reconcile with nothing new wrote something"
    );
    // The operator's record of its own status writes is only kept until
    // the watch catches up.
    assert_eq!(
        h.ctx.written.pending(),
        0,
        "status writes kept after the watch caught up"
    );
}

#[tokio::test]
#[ignore = "needs the local control plane: scripts/test.sh runs it with --include-ignored"]
async fn a_random_demand_storm_never_exceeds_the_budget() {
    let h = Harness::start("storm").await;
    let models: &[Model<'static>] = &[
        ("m1", "3Gi", false),
        ("m2", "5Gi", false),
        ("m3", "2Gi", false),
        ("m4", "7Gi", false),
        ("m5", "4Gi", true),
        ("m6", "1Gi", false),
    ];
    h.create("gpu", "12Gi", models).await;
    let watcher = h.budget_watcher(BTreeMap::from([("gpu".to_owned(), 12u64 << 30)]));
    let mut next = crate::support::rng(0x5eed);
    for _ in 0..80 {
        let m = models[(next() % models.len() as u64) as usize].0;
        if next().is_multiple_of(5) {
            model_residency::residency::demand::unload(&h.api, "gpu", m)
                .await
                .unwrap();
        } else {
            h.request_nowait("gpu", m).await;
        }
        tokio::time::sleep(std::time::Duration::from_millis(next() % 40)).await;
    }
    let r = h.converged("gpu").await;
    let s = r.status.as_ref().unwrap();
    let used = model_residency::quantity::parse_bytes(s.used.as_deref().unwrap()).unwrap();
    assert!(used <= 12 << 30);
    assert!(
        *watcher.events.lock().unwrap() > 10,
        "the watcher saw too little"
    );
    assert_eq!(
        watcher.violations.lock().unwrap().clone(),
        Vec::<String>::new()
    );
}

#[tokio::test]
#[ignore = "needs the local control plane: scripts/test.sh runs it with --include-ignored"]
async fn an_idle_model_is_unloaded_after_its_keep_alive() {
    let h = Harness::start("idle").await;
    h.create(
        "gpu",
        "16000Mi",
        &[("zimage", "10900Mi", false), ("qwen-llm", "3000Mi", true)],
    )
    .await;
    h.patch_spec("gpu", json!({"keepAlive": "2s"})).await;
    h.request("gpu", "zimage").await;
    h.request("gpu", "qwen-llm").await;
    let reconciles = h.ctx.metrics.sum(RECONCILES);
    let r = h
        .until_state("gpu", "zimage", ModelState::Unloaded, 20)
        .await;
    let z = model(&r, "zimage");
    assert_eq!(z.reason.as_deref(), Some("Idle"));
    assert_eq!(
        model(&r, "qwen-llm").state,
        ModelState::Loaded,
        "pinned: kept"
    );
    let c = r.status.as_ref().unwrap().counters;
    assert_eq!((c.unloads, c.evictions), (1, 0));
    // Woken at the expiry, not by polling: a handful of reconciles (the
    // unload, its status write and the pod's deletion), not one a tick.
    let spent = h.ctx.metrics.sum(RECONCILES) - reconciles;
    assert!(spent <= 8, "{spent} reconciles while waiting 2 s");
    h.converged("gpu").await;
    assert_eq!(
        h.pods_of("gpu").await.0,
        BTreeSet::from(["qwen-llm".to_owned()])
    );
}

#[tokio::test]
#[ignore = "needs the local control plane: scripts/test.sh runs it with --include-ignored"]
async fn demand_load_from_a_clock_behind_the_last_request_still_loads() {
    let h = Harness::start("cli-clock").await;
    h.create("gpu", "16000Mi", SEED).await;
    // A faster clock (a router, another laptop) requested qwen-llm 30 s
    // ahead of this one (within the operator's skew allowance), and it was
    // unloaded since.
    let ahead = k8s_openapi::jiff::Timestamp::now() + std::time::Duration::from_secs(30);
    model_residency::residency::demand::load(&h.api, "gpu", "qwen-llm", ahead)
        .await
        .unwrap();
    h.until_state("gpu", "qwen-llm", ModelState::Loaded, 30)
        .await;
    model_residency::residency::demand::unload(&h.api, "gpu", "qwen-llm")
        .await
        .unwrap();
    h.until_state("gpu", "qwen-llm", ModelState::Unloaded, 30)
        .await;

    // `demand load` from this clock: its time alone would count as
    // processed already, so it asks again just after the last request.
    let out = std::process::Command::new(env!("CARGO_BIN_EXE_model-residency"))
        .env("KUBECONFIG", h.env.plane.kubeconfig())
        .args(["demand", "load", "gpu", "qwen-llm", "-n", &h.env.namespace])
        .output()
        .unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "{stderr}");
    assert!(stderr.contains("is behind the last request"), "{stderr}");
    let r = h
        .until_state("gpu", "qwen-llm", ModelState::Loaded, 30)
        .await;
    let last = model(&r, "qwen-llm").last_requested.clone().unwrap();
    assert!(
        last.parse::<k8s_openapi::jiff::Timestamp>().unwrap() > ahead,
        "{last}"
    );
}

/// A pod with a model pod's name that the residency does not own (made by
/// hand) is in the way for good: the model says so, naming the pod, and the
/// create is tried again with the templates' backoff, not every 500 ms for
/// ever; once it is gone the model loads.
#[tokio::test]
#[ignore = "needs the local control plane: scripts/test.sh runs it with --include-ignored"]
async fn a_pod_of_a_model_pods_name_that_is_not_ours_is_said_and_waited_out() {
    let h = Harness::start("op-squatter").await;
    h.create("gpu", "8Gi", &[("a", "4Gi", false)]).await;
    let name = pod_name("gpu", "a");
    let theirs: Pod = serde_json::from_value(json!({
        "metadata": {"name": name},
        "spec": {"nodeName": "elsewhere", "containers": [{"name": "c", "image": "i"}]}}))
    .unwrap();
    h.pods.create(&Default::default(), &theirs).await.unwrap();
    h.request_nowait("gpu", "a").await;
    let message = eventually(30, "a's status naming the pod", || async {
        let r = h.api.get("gpu").await.ok()?;
        let m = r.status.as_ref()?.model("a")?.message.clone()?;
        m.contains("does not own").then_some(m.to_string())
    })
    .await;
    assert!(message.contains(&name), "{message}");
    let creates = || {
        h.ctx
            .metrics
            .sum_where(API_REQUESTS, r#"verb="create",resource="pods""#)
    };
    let before = creates();
    tokio::time::sleep(std::time::Duration::from_secs(3)).await;
    assert!(
        creates() - before <= 1,
        "{} creates in 3 s: not backed off",
        creates() - before
    );
    h.pods
        .delete(&name, &DeleteParams::default().grace_period(0))
        .await
        .unwrap();
    h.until_state("gpu", "a", ModelState::Loaded, 60).await;
}
