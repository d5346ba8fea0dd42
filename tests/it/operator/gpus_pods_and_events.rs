//! What a black-box test by a new user and an SRE found, each case on the
//! real API server: a GPU claimed twice, request times from the future, a
//! template the API server rejects, colliding pod names, a residency that
//! moves, a template that changes, demand written before its model, events
//! that did not match the counters, and status people could not read.

use crate::support::cluster::eventually;
use crate::support::operator::Harness;
use k8s_openapi::api::core::v1::{Pod, ResourceQuota};
use k8s_openapi::api::events::v1::Event;
use kube::api::{Api, DeleteParams, ListParams, Patch, PatchParams, PostParams};
use model_residency::api::{ModelResidency, ModelState, ModelStatus};
use model_residency::controller::pods::pod_name;
use model_residency::residency::demand;
use serde_json::json;
use std::collections::BTreeMap;

fn model<'r>(r: &'r ModelResidency, name: &str) -> &'r ModelStatus {
    let status = r.status.as_ref().expect("a status");
    status.model(name).expect("the model")
}

fn condition(r: &ModelResidency, type_: &str) -> (String, String, String) {
    let status = r.status.as_ref().expect("a status");
    let c = status.conditions.iter().find(|c| c.type_ == type_).unwrap();
    (c.status.clone(), c.reason.clone(), c.message.clone())
}

/// Events about residency `name`, by reason.
async fn event_counts(h: &Harness, name: &str) -> BTreeMap<String, u64> {
    let api: Api<Event> = Api::namespaced(h.env.client.clone(), &h.env.namespace);
    let mut counts = BTreeMap::new();
    for e in api.list(&ListParams::default()).await.unwrap().items {
        if e.regarding.as_ref().and_then(|r| r.name.as_deref()) == Some(name) {
            *counts.entry(e.reason.unwrap_or_default()).or_default() += 1;
        }
    }
    counts
}

async fn wait_event(h: &Harness, name: &str, reason: &str) {
    eventually(15, &format!("a {reason} event"), || async {
        (event_counts(h, name)
            .await
            .get(reason)
            .copied()
            .unwrap_or(0)
            > 0)
        .then_some(())
    })
    .await;
}

/// Live (not deleting) pods of a residency.
async fn live_pods(h: &Harness, residency: &str) -> Vec<Pod> {
    let lp = ListParams::default().labels(&format!("residency.dev/residency={residency}"));
    let pods = h.pods.list(&lp).await.unwrap().items;
    pods.into_iter()
        .filter(|p| p.metadata.deletion_timestamp.is_none())
        .collect()
}

#[tokio::test]
#[ignore = "needs the local control plane: scripts/test.sh runs it with --include-ignored"]
async fn two_residencies_on_one_gpu_share_one_budget() {
    let mut h = Harness::start("bb-gpu-twice").await;
    // The declared modes' check (claim mode leaves it to the scheduler:
    // gpu_claims.rs).
    h.gpu_mode = Some("env");
    let ns = h.env.namespace.clone();
    h.create_on("older", "16Gi", &[("a", "10Gi", false)], "0")
        .await;
    h.request("older", "a").await;
    // Same node and GPU, created later (same second or not: "older" also
    // sorts first by name).
    h.create_on("younger", "16Gi", &[("b", "10Gi", false)], "0")
        .await;
    h.request_nowait("younger", "b").await;
    let r = eventually(30, "younger to report the conflict", || async {
        let r = h.api.get("younger").await.unwrap();
        (r.status.as_ref().is_some() && condition(&r, "Ready").1 == "GpuConflict").then_some(r)
    })
    .await;
    let (status, _, message) = condition(&r, "Ready");
    assert_eq!(status, "False");
    assert!(message.contains(&format!("{ns}/older")), "{message}");
    assert!(
        live_pods(&h, "younger").await.is_empty(),
        "two budgets on one GPU"
    );
    wait_event(&h, "younger", "GpuConflict").await;
    // A request for b meanwhile: its only GPU is another's for now, which
    // can pass (a 503 to retry, with Retry-After, not model_refused).
    let router = crate::support::router::RouterUnderTest::start(&h, Default::default()).await;
    let a = router.chat("b").await;
    assert_eq!(a.status, 503, "{}", a.body);
    assert!(a.body.contains("model_unavailable"), "{}", a.body);
    assert!(a.headers.contains_key("retry-after"), "{:?}", a.headers);
    drop(router);
    let metrics = h.ctx.metrics.encode();
    let line =
        format!("model_residency_gpu_conflict{{namespace=\"{ns}\",residency=\"younger\"}} 1");
    assert!(metrics.contains(&line), "{metrics}");
    // The holder goes: the claim is released and the pending request loads.
    h.api
        .delete("older", &DeleteParams::default())
        .await
        .unwrap();
    let r = h.until_state("younger", "b", ModelState::Loaded, 30).await;
    assert_eq!(condition(&r, "Ready").0, "True");
    // One GPU per object: `all`, `none`, lists and empty are refused.
    for device in ["all", "none", "0,1", ""] {
        let bad: ModelResidency = serde_json::from_value(json!({
            "apiVersion": "residency.dev/v1alpha1", "kind": "ModelResidency",
            "metadata": {"name": "bad-device"},
            "spec": {"nodeName": h.node, "device": device, "budget": "1Gi", "models": []},
        }))
        .unwrap();
        let err = h
            .api
            .create(&PostParams::default(), &bad)
            .await
            .unwrap_err();
        assert!(
            matches!(err, kube::Error::Api(s) if s.code == 422),
            "device {device:?}"
        );
    }
}

#[tokio::test]
#[ignore = "needs the local control plane: scripts/test.sh runs it with --include-ignored"]
async fn a_request_from_the_year_2200_shadows_nothing() {
    let h = Harness::start("bb-future").await;
    h.create("gpu", "10Gi", &[("a", "6Gi", false), ("b", "6Gi", false)])
        .await;
    let future = "2200-01-01T00:00:00Z".parse().unwrap();
    demand::load(&h.api, "gpu", "a", future).await.unwrap();
    let r = h.until_state("gpu", "a", ModelState::Loaded, 30).await;
    let used = model(&r, "a").last_used.clone().unwrap();
    assert!(&*used < "2100", "the LRU key kept the future time: {used}");
    wait_event(&h, "gpu", "ClockSkew").await;
    // b evicts a; a real request for a later loads it again.
    h.request("gpu", "b").await;
    let r = h.request("gpu", "a").await;
    assert_eq!(
        model(&r, "a").state,
        ModelState::Loaded,
        "2200 shadowed a later request"
    );
    assert_eq!(model(&r, "b").state, ModelState::Evicted);
}

#[tokio::test]
#[ignore = "needs the local control plane: scripts/test.sh runs it with --include-ignored"]
async fn a_template_the_api_server_rejects_evicts_nothing_and_is_reported() {
    let h = Harness::start("bb-template").await;
    h.create(
        "gpu",
        "10Gi",
        &[("good", "6Gi", false), ("bad", "6Gi", false)],
    )
    .await;
    h.request("gpu", "good").await;
    // A container without an image: only the API server says it is wrong.
    let r = h.api.get("gpu").await.unwrap();
    let mut models = serde_json::to_value(&r.spec.models).unwrap();
    models[1]["template"] = json!({"spec": {"containers": [{"name": "server"}]}});
    h.patch_spec("gpu", json!({"models": models})).await;
    // Reported before anyone requests it.
    let r = eventually(30, "the bad template to be reported", || async {
        let r = h.api.get("gpu").await.unwrap();
        (model(&r, "bad").reason.as_deref() == Some("InvalidTemplate")).then_some(r)
    })
    .await;
    assert_eq!(condition(&r, "Degraded").0, "True");
    h.request_nowait("gpu", "bad").await;
    let r = h.until_state("gpu", "bad", ModelState::Failed, 30).await;
    let bad = model(&r, "bad");
    assert!(bad.message.as_deref().unwrap().contains("image"), "{bad:?}");
    assert_eq!(
        model(&r, "good").state,
        ModelState::Loaded,
        "good was evicted for nothing"
    );
    assert_eq!(r.status.as_ref().unwrap().counters.evictions, 0);
    assert_eq!(live_pods(&h, "gpu").await.len(), 1);
    wait_event(&h, "gpu", "LoadFailed").await;
    // A new object whose only template is bad still gets a status.
    let fresh: ModelResidency = serde_json::from_value(json!({
        "apiVersion": "residency.dev/v1alpha1", "kind": "ModelResidency",
        "metadata": {"name": "fresh"},
        "spec": {"nodeName": h.node, "device": "15", "budget": "10Gi", "models": [
            {"name": "x", "size": "1Gi", "template": {"spec": {"containers": [{"name": "s"}]}}}
        ], "demand": {"x": "2026-11-30T00:00:00Z"}},
    }))
    .unwrap();
    h.api.create(&PostParams::default(), &fresh).await.unwrap();
    h.until_state("fresh", "x", ModelState::Failed, 30).await;
}

/// Sets the namespace's pod quota to `pods`. No quota controller runs on
/// the test control plane, so the test writes the status admission counts
/// against (`used` is kept: admission adds each pod it lets in).
async fn pod_quota(h: &Harness, pods: u32) {
    let api: Api<ResourceQuota> = Api::namespaced(h.env.client.clone(), &h.env.namespace);
    let hard = json!({"pods": pods.to_string()});
    if api.get_opt("pods").await.unwrap().is_none() {
        let q =
            serde_json::from_value(json!({"metadata": {"name": "pods"}, "spec": {"hard": hard}}));
        api.create(&PostParams::default(), &q.unwrap())
            .await
            .unwrap();
        let status = json!({"status": {"hard": hard, "used": {"pods": "0"}}});
        api.patch_status("pods", &PatchParams::default(), &Patch::Merge(&status))
            .await
            .unwrap();
    } else {
        let both = json!({"spec": {"hard": hard}, "status": {"hard": hard}});
        api.patch("pods", &PatchParams::default(), &Patch::Merge(&both))
            .await
            .unwrap();
        api.patch_status("pods", &PatchParams::default(), &Patch::Merge(&both))
            .await
            .unwrap();
    }
}

#[tokio::test]
#[ignore = "needs the local control plane: scripts/test.sh runs it with --include-ignored"]
async fn a_pod_one_residency_may_not_create_fails_no_other_and_loads_once_it_may() {
    let mut h = Harness::start("bb-quota").await;
    // Env mode: in claim mode each residency's GPU holder pod counts
    // against the pod quota too (docs/concepts.md).
    h.gpu_mode = Some("env");
    pod_quota(&h, 1).await;
    // Three GPUs with one registry: the same template for x on each.
    for gpu in ["gpu-a", "gpu-b"] {
        h.create(gpu, "10Gi", &[("x", "1Gi", false)]).await;
    }
    h.request("gpu-a", "x").await;
    h.until_state("gpu-a", "x", ModelState::Loaded, 30).await;
    // gpu-b's pod would be the namespace's second: the quota rejects it.
    h.request_nowait("gpu-b", "x").await;
    let b = h.until_state("gpu-b", "x", ModelState::Failed, 30).await;
    let message = model(&b, "x").message.clone().unwrap_or_default();
    assert!(message.contains("exceeded quota"), "{message}");
    // That rejection was gpu-b's. Before, it was kept for the template in
    // the whole namespace for the operator's life: gpu-a's loaded x was
    // reported as a template that cannot make a pod, and a new GPU's x
    // failed before anyone asked for it.
    h.request("gpu-a", "x").await;
    let a = h.converged("gpu-a").await;
    assert_eq!(model(&a, "x").state, ModelState::Loaded);
    assert_eq!(model(&a, "x").reason, None, "{:?}", model(&a, "x"));
    assert_eq!(condition(&a, "Degraded").0, "False");
    h.create("gpu-c", "10Gi", &[("x", "1Gi", false)]).await;
    let c = h.converged("gpu-c").await;
    assert_eq!(
        (model(&c, "x").state, model(&c, "x").reason.as_deref()),
        (ModelState::Unloaded, None)
    );
    assert_eq!(condition(&c, "Degraded").0, "False");
    // The quota is raised: gpu-b's standing request loads x once its
    // rejection is asked again (after 5 s, doubling), with no new request.
    pod_quota(&h, 3).await;
    let b = h.until_state("gpu-b", "x", ModelState::Loaded, 60).await;
    assert_eq!(condition(&b, "Degraded").0, "False");
}

#[tokio::test]
#[ignore = "needs the local control plane: scripts/test.sh runs it with --include-ignored"]
async fn pod_names_never_collide_and_pods_of_others_are_never_touched() {
    let h = Harness::start("bb-names").await;
    h.create("gpu", "10Gi", &[("a-b", "1Gi", false)]).await;
    h.create("gpu-a", "10Gi", &[("b", "1Gi", false)]).await;
    h.request("gpu", "a-b").await;
    let r = h.request("gpu-a", "b").await;
    assert_eq!(model(&r, "b").state, ModelState::Loaded);
    assert_ne!(pod_name("gpu", "a-b"), pod_name("gpu-a", "b"));
    // Unloading one leaves the other's pod alone.
    demand::unload(&h.api, "gpu-a", "b").await.unwrap();
    h.until_state("gpu-a", "b", ModelState::Unloaded, 30).await;
    h.converged("gpu-a").await;
    let r = h.converged("gpu").await;
    assert_eq!(model(&r, "a-b").state, ModelState::Loaded);
    assert_eq!(live_pods(&h, "gpu").await.len(), 1);
}

#[tokio::test]
#[ignore = "needs the local control plane: scripts/test.sh runs it with --include-ignored"]
async fn a_moved_residency_and_a_new_template_replace_the_pods() {
    let mut h = Harness::start("bb-move").await;
    // A move keeps the models in env mode (a claim-mode move replaces the
    // claim: gpu_claims.rs).
    h.gpu_mode = Some("env");
    h.create_on(
        "gpu",
        "10Gi",
        &[("a", "2Gi", false), ("b", "2Gi", false)],
        "3",
    )
    .await;
    h.request("gpu", "a").await;
    h.request("gpu", "b").await;
    let before = live_pods(&h, "gpu").await;
    h.patch_spec("gpu", json!({"device": "4"})).await;
    eventually(30, "the pods to move to GPU 4", || async {
        let pods = live_pods(&h, "gpu").await;
        let moved = pods.len() == 2
            && pods.iter().all(|p| {
                let env = p.spec.as_ref().unwrap().containers[0]
                    .env
                    .clone()
                    .unwrap_or_default();
                env.iter()
                    .any(|e| e.name == "NVIDIA_VISIBLE_DEVICES" && e.value.as_deref() == Some("4"))
            });
        moved.then_some(())
    })
    .await;
    let r = h.converged("gpu").await;
    for m in ["a", "b"] {
        assert_eq!(model(&r, m).state, ModelState::Loaded);
    }
    let uids: Vec<_> = before.iter().map(|p| p.metadata.uid.clone()).collect();
    assert!(
        live_pods(&h, "gpu")
            .await
            .iter()
            .all(|p| !uids.contains(&p.metadata.uid))
    );
    assert_eq!(event_counts(&h, "gpu").await.get("Moved"), Some(&2));
    let c = r.status.as_ref().unwrap().counters;
    assert_eq!(
        (c.loads, c.evictions),
        (2, 0),
        "a move is not a load or an eviction"
    );
    // A new image for a: its pod is replaced, b's is not.
    let b_uid = h
        .pods
        .get(&pod_name("gpu", "b"))
        .await
        .unwrap()
        .metadata
        .uid;
    let mut models = serde_json::to_value(&r.spec.models).unwrap();
    models[0]["template"]["spec"]["containers"][0]["image"] = json!("example/a:2");
    h.patch_spec("gpu", json!({"models": models})).await;
    eventually(30, "a's pod to run the new image", || async {
        let p = h.pods.get_opt(&pod_name("gpu", "a")).await.unwrap()?;
        let image = p.spec.as_ref()?.containers[0].image.clone();
        (image.as_deref() == Some("example/a:2") && p.metadata.deletion_timestamp.is_none())
            .then_some(())
    })
    .await;
    let r = h.converged("gpu").await;
    assert_eq!(model(&r, "a").state, ModelState::Loaded);
    assert_eq!(
        h.pods
            .get(&pod_name("gpu", "b"))
            .await
            .unwrap()
            .metadata
            .uid,
        b_uid
    );
    wait_event(&h, "gpu", "TemplateChanged").await;
}

#[tokio::test]
#[ignore = "needs the local control plane: scripts/test.sh runs it with --include-ignored"]
async fn demand_written_before_its_model_loads_once_the_model_is_added() {
    let h = Harness::start("bb-early").await;
    h.create("gpu", "10Gi", &[("a", "1Gi", false)]).await;
    let r = h.request("gpu", "late").await;
    assert_eq!(model(&r, "late").reason.as_deref(), Some("UnknownModel"));
    let mut models = serde_json::to_value(&r.spec.models).unwrap();
    let mut late = models[0].clone();
    late["name"] = json!("late");
    models.as_array_mut().unwrap().push(late);
    h.patch_spec("gpu", json!({"models": models})).await;
    let r = h.until_state("gpu", "late", ModelState::Loaded, 30).await;
    assert_eq!(condition(&r, "Refused").0, "False");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "needs the local control plane: scripts/test.sh runs it with --include-ignored"]
async fn events_match_the_counters_after_a_storm() {
    let h = Harness::start("bb-events").await;
    let models = [
        ("a", "3Gi", false),
        ("b", "4Gi", false),
        ("c", "5Gi", false),
        ("d", "6Gi", false),
        ("big", "20Gi", false),
    ];
    h.create("gpu", "10Gi", &models).await;
    // Concurrent requests and unloads, as an autoscaler would send them.
    let mut writers = Vec::new();
    for w in 0..4usize {
        let api = h.api.clone();
        writers.push(tokio::spawn(async move {
            for i in 0..15usize {
                let model = models[(w * 7 + i * 3) % models.len()].0;
                if (w + i) % 5 == 0 {
                    let _ = demand::unload(&api, "gpu", model).await;
                } else {
                    let now = k8s_openapi::jiff::Timestamp::now();
                    let _ = demand::load(&api, "gpu", model, now).await;
                }
            }
        }));
    }
    for w in writers {
        w.await.unwrap();
    }
    h.drained("gpu").await;
    // Whether the storm itself evicts depends on timing (a queued request
    // waits out a fresh model's grace, and an unload may make room first):
    // the four small models in turn (18Gi on 10Gi) evict at least once.
    for (model, _, _) in &models[..4] {
        h.request("gpu", model).await;
    }
    let r = h.drained("gpu").await;
    let c = r.status.as_ref().unwrap().counters;
    let want = BTreeMap::from([
        ("Loaded".to_owned(), c.loads),
        ("Evicted".to_owned(), c.evictions),
        ("Unloaded".to_owned(), c.unloads),
        ("Refused".to_owned(), c.refusals),
    ]);
    // Events are published right after the status write: give the last
    // ones a moment, then compare.
    let deadline = tokio::time::Instant::now() + std::time::Duration::from_secs(15);
    let got = loop {
        let counts = event_counts(&h, "gpu").await;
        let got: BTreeMap<String, u64> = want
            .keys()
            .map(|k| (k.clone(), counts.get(k).copied().unwrap_or(0)))
            .collect();
        if got == want || tokio::time::Instant::now() > deadline {
            break got;
        }
        tokio::time::sleep(std::time::Duration::from_millis(200)).await;
    };
    let failed = h.ctx.metrics.sum_where(
        "model_residency_reconcile_errors_total",
        r#"reason="publish_event""#,
    );
    assert_eq!(
        got, want,
        "events by reason (left) and the counters (right); {failed} publishes failed"
    );
    assert!(got["Loaded"] >= 3 && got["Evicted"] >= 1, "{got:?}");
}

#[tokio::test]
#[ignore = "needs the local control plane: scripts/test.sh runs it with --include-ignored"]
async fn quantities_in_status_are_readable() {
    let h = Harness::start("bb-units").await;
    h.create(
        "gpu",
        "24Gi",
        &[("a", "8G", false), ("b", "13900Mi", false)],
    )
    .await;
    h.request("gpu", "a").await;
    let r = h.request("gpu", "b").await;
    let s = r.status.as_ref().unwrap();
    assert_eq!(model(&r, "a").size.as_deref(), Some("8G"), "not 7812500Ki");
    let used = s.used.as_deref().unwrap();
    assert_eq!(used, "21.02Gi", "8G + 13900Mi, rounded down");
    let out = h.env.kubectl(&["get", "mres", "gpu", "--no-headers"]);
    let line = String::from_utf8_lossy(&out.stdout).to_string();
    assert!(line.contains("21.02Gi") && line.contains("24Gi"), "{line}");
    assert!(
        !line
            .split_whitespace()
            .any(|w| w.len() > 8 && w.bytes().all(|b| b.is_ascii_digit())),
        "{line}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "needs the local control plane: scripts/test.sh runs it with --include-ignored"]
async fn sixteen_blind_writers_and_a_hundred_models_lose_nothing() {
    let h = Harness::start("demand-map").await;
    let names: Vec<String> = (0..100).map(|i| format!("m{i}")).collect();
    let models: Vec<(&str, &str, bool)> =
        names.iter().map(|n| (n.as_str(), "1Mi", false)).collect();
    h.create("gpu", "10Mi", &models).await;
    // Each writer sends its models' requests as single merge patches, with
    // no read and no precondition, all at once.
    let mut writers = Vec::new();
    for w in 0..16 {
        let api = h.api.clone();
        let mine: Vec<String> = names.iter().skip(w).step_by(16).cloned().collect();
        writers.push(tokio::spawn(async move {
            let mut sent = Vec::new();
            for m in mine {
                let at = k8s_openapi::jiff::Timestamp::now();
                demand::load(&api, "gpu", &m, at).await.unwrap();
                sent.push((m, at.to_string()));
            }
            sent
        }));
    }
    let mut sent = BTreeMap::new();
    for w in writers {
        sent.extend(w.await.unwrap());
    }
    assert_eq!(sent.len(), 100);
    let r = h.api.get("gpu").await.unwrap();
    assert_eq!(r.spec.demand, sent, "a writer's key was lost");
    // The operator processed every one of them. Ten fit at a time: the
    // other 90 queue behind loads, ten at a time, each batch after its
    // predecessors were Ready for FRESH_LOAD_GRACE (5 s; Ready times are
    // whole seconds), so 36-45 s by the rule alone (40.1 s on an idle
    // machine, 12-05, against a limit of 60 s then); the limit leaves
    // room for a busy one.
    let t0 = std::time::Instant::now();
    let r = eventually(120, "every request to be processed", || async {
        let r = h.api.get("gpu").await.unwrap();
        let s = r.status.as_ref()?;
        let done = sent.iter().all(|(m, at)| {
            s.model(m)
                .is_some_and(|st| st.last_requested.as_deref() == Some(at.as_str()))
        });
        done.then_some(r)
    })
    .await;
    println!(
        "100 requests from 16 blind writers processed in {:.1} s",
        t0.elapsed().as_secs_f64()
    );
    let c = r.status.as_ref().unwrap().counters;
    assert_eq!(c.loads + c.hits + c.refusals, 100, "{c:?}");
    // A key that is no model name (no DNS label) is refused at admission,
    // with a sentence that names it; the others stay as they were.
    let err = demand::load(
        &h.api,
        "gpu",
        "Not_A_Model",
        k8s_openapi::jiff::Timestamp::now(),
    )
    .await
    .expect_err("a key that is no model name must be refused");
    assert!(
        matches!(&err, kube::Error::Api(s) if s.code == 422
            && s.message.contains("'Not_A_Model' is not one")),
        "{err}"
    );
    // A model name that is in no registry is admitted (an autoscaler may
    // write it before the registry edit lands) and refused in status.
    demand::load(
        &h.api,
        "gpu",
        "not-yet",
        k8s_openapi::jiff::Timestamp::now(),
    )
    .await
    .unwrap();
    let r = h
        .until_state("gpu", "not-yet", ModelState::Refused, 30)
        .await;
    assert_eq!(model(&r, "not-yet").reason.as_deref(), Some("UnknownModel"));
    // An unload is one write that removes one key.
    let r = demand::unload(&h.api, "gpu", "m7").await.unwrap();
    assert_eq!(r.spec.demand.len(), 100, "m7 gone, not-yet there");
    assert!(!r.spec.demand.contains_key("m7"));
}

#[tokio::test]
#[ignore = "needs the local control plane: scripts/test.sh runs it with --include-ignored"]
async fn the_scheduler_places_model_pods_and_a_node_that_is_not_there_is_said() {
    let mut h = Harness::start("scheduled").await;
    // A model pod's own unschedulable reason (claim mode names a missing
    // node's devices before any model pod is made: gpu_claims.rs).
    h.gpu_mode = Some("env");
    h.create("gpu", "10Gi", &[("a", "2Gi", false)]).await;
    // The real node first: kube-scheduler binds the pod there (the
    // operator set no nodeName, only the affinity).
    let r = h.request("gpu", "a").await;
    assert_eq!(model(&r, "a").state, ModelState::Loaded);
    let pod = h.pods.get(&pod_name("gpu", "a")).await.unwrap();
    assert_eq!(
        pod.spec.as_ref().unwrap().node_name.as_deref(),
        Some(h.node.as_str())
    );
    let scheduled = pod
        .status
        .as_ref()
        .and_then(|s| s.conditions.as_ref())
        .is_some_and(|c| {
            c.iter()
                .any(|c| c.type_ == "PodScheduled" && c.status == "True")
        });
    assert!(scheduled, "{:?}", pod.status);
    // A node no kubelet registered: the pod waits unscheduled, and the
    // status says why in the scheduler's words.
    let gone = h.env.node("nowhere");
    h.patch_spec("gpu", json!({"nodeName": gone})).await;
    let r = eventually(30, "the scheduler's reason in status", || async {
        let r = h.api.get("gpu").await.unwrap();
        let m = r.status.as_ref()?.model("a")?;
        let said = m.state == ModelState::Loading
            && m.message
                .as_deref()
                .is_some_and(|t| t.contains("Unschedulable"));
        said.then_some(r)
    })
    .await;
    let message = model(&r, "a").message.clone().unwrap_or_default();
    assert!(message.contains("NodeAffinity"), "{message}");
    // Back to the real node: the unbound pod is known to be for the other
    // node (its annotation), so it is replaced, and the model loads.
    h.patch_spec("gpu", json!({"nodeName": h.node})).await;
    let r = h.until_state("gpu", "a", ModelState::Loaded, 30).await;
    let pod = h.pods.get(&pod_name("gpu", "a")).await.unwrap();
    assert_eq!(
        pod.spec.as_ref().unwrap().node_name.as_deref(),
        Some(h.node.as_str())
    );
    assert_eq!(event_counts(&h, "gpu").await.get("Moved"), Some(&2));
    let c = r.status.as_ref().unwrap().counters;
    assert_eq!((c.loads, c.evictions), (1, 0));
}
