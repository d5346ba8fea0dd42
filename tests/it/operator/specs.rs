//! Objects the schema admits but that cannot be served as asked: each one
//! becomes a status condition (and no crash, no lost data, nothing over
//! budget), through the real operator.

use crate::support::cluster::eventually;
use crate::support::operator::Harness;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::Condition;
use kube::api::PostParams;
use model_residency::api::{ModelResidency, ModelState};
use serde_json::json;

fn condition(r: &ModelResidency, type_: &str) -> Condition {
    r.status
        .as_ref()
        .and_then(|s| s.conditions.iter().find(|c| c.type_ == type_))
        .cloned()
        .unwrap_or_else(|| panic!("no {type_} condition in {:?}", r.status))
}

fn state(r: &ModelResidency, model: &str) -> (ModelState, Option<String>) {
    let m = r
        .status
        .as_ref()
        .and_then(|s| s.model(model))
        .unwrap_or_else(|| panic!("no status for {model}"));
    (m.state, m.reason.as_deref().map(str::to_owned))
}

#[tokio::test]
#[ignore = "needs the local control plane: scripts/test.sh runs it with --include-ignored"]
async fn pinned_models_that_exceed_the_budget_are_refused() {
    let h = Harness::start("bad-pinned").await;
    h.create(
        "gpu",
        "10Gi",
        &[
            ("p1", "6Gi", true),
            ("p2", "6Gi", true),
            ("huge", "11Gi", true),
        ],
    )
    .await;
    h.request("gpu", "p1").await;
    let r = h.request("gpu", "p2").await;
    assert_eq!(
        state(&r, "p2"),
        (ModelState::Refused, Some("NoEvictableRoom".into()))
    );
    let r = h.request("gpu", "huge").await;
    assert_eq!(
        state(&r, "huge"),
        (ModelState::Refused, Some("LargerThanBudget".into()))
    );
    assert_eq!(state(&r, "p1").0, ModelState::Loaded);
    let c = condition(&r, "Refused");
    assert!(
        c.message.contains("pinned models hold 6Gi"),
        "{}",
        c.message
    );
}

#[tokio::test]
#[ignore = "needs the local control plane: scripts/test.sh runs it with --include-ignored"]
async fn a_node_that_does_not_exist_leaves_the_model_loading_and_counted() {
    let h = Harness::start("bad-node").await;
    h.create("gpu", "10Gi", &[("a", "1Gi", false)]).await;
    // In env mode nothing but the scheduler can tell (claim mode names the
    // missing node's devices: gpu_claims.rs).
    h.patch_spec(
        "gpu",
        json!({"nodeName": "no-such-node", "gpu": {"mode": "env"}}),
    )
    .await;
    h.request_nowait("gpu", "a").await;
    let r = h.until_state("gpu", "a", ModelState::Loading, 30).await;
    // Loading is normal, not a reason to be unready; it is counted, and the
    // model's message names its pod (and, after 30 s without any status,
    // that no kubelet reports on it: a unit test of decide checks that).
    let ready = condition(&r, "Ready");
    assert_eq!(
        (ready.status.as_str(), ready.reason.as_str()),
        ("True", "Converging")
    );
    assert!(ready.message.contains("loading a"), "{}", ready.message);
    assert_eq!(r.status.as_ref().unwrap().loading, 1);
}

#[tokio::test]
#[ignore = "needs the local control plane: scripts/test.sh runs it with --include-ignored"]
async fn a_template_without_containers_fails_the_load_and_degrades() {
    let h = Harness::start("bad-template").await;
    h.create("gpu", "10Gi", &[("a", "1Gi", false)]).await;
    h.patch_spec(
        "gpu",
        json!({"models": [
            {"name": "a", "size": "1Gi", "template": {"spec": {"containers": []}}}]}),
    )
    .await;
    h.request_nowait("gpu", "a").await;
    let r = h.until_state("gpu", "a", ModelState::Failed, 30).await;
    assert_eq!(state(&r, "a").1.as_deref(), Some("InvalidTemplate"));
    let degraded = condition(&r, "Degraded");
    assert_eq!(degraded.status, "True");
    assert!(
        degraded.message.contains("no containers"),
        "{}",
        degraded.message
    );
    assert!(h.pods_of("gpu").await.0.is_empty());
}

#[tokio::test]
#[ignore = "needs the local control plane: scripts/test.sh runs it with --include-ignored"]
async fn a_one_byte_budget_refuses_everything() {
    let h = Harness::start("bad-budget").await;
    h.create("gpu", "1", &[("a", "1Gi", false)]).await;
    let r = h.request("gpu", "a").await;
    assert_eq!(
        state(&r, "a"),
        (ModelState::Refused, Some("LargerThanBudget".into()))
    );
    assert!(condition(&r, "Refused").message.contains("budget is 1"));
}

#[tokio::test]
#[ignore = "needs the local control plane: scripts/test.sh runs it with --include-ignored"]
async fn a_name_too_long_for_labels_is_an_invalid_spec() {
    let h = Harness::start("bad-name").await;
    let name = "g".repeat(70);
    let r: ModelResidency = serde_json::from_value(json!({
        "apiVersion": "residency.dev/v1alpha1", "kind": "ModelResidency",
        "metadata": {"name": name},
        "spec": {"nodeName": h.node, "device": "0", "budget": "1Gi", "models": [{"name": "a", "size": "1"}]},
    }))
    .unwrap();
    h.api.create(&PostParams::default(), &r).await.unwrap();
    let r = eventually(30, "an InvalidSpec condition", || async {
        let r = h.api.get(&name).await.unwrap();
        r.status.is_some().then_some(r)
    })
    .await;
    let ready = condition(&r, "Ready");
    assert_eq!(
        (ready.status.as_str(), ready.reason.as_str()),
        ("False", "InvalidSpec")
    );
    assert!(
        ready.message.contains("longer than 63"),
        "{}",
        ready.message
    );
}

#[tokio::test]
#[ignore = "needs the local control plane: scripts/test.sh runs it with --include-ignored"]
async fn a_registry_of_a_thousand_models_keeps_its_status() {
    // 1000 is the schema's maxItems: the most a registry may hold, so the
    // object with its status stays under etcd's request limit (at 10,001
    // models v1.37 refused the status write, 2.37 MB against 2 MiB).
    let h = Harness::start("bad-many").await;
    let models: Vec<_> = (0..999)
        .map(|i| json!({"name": format!("m{i}"), "size": "1Gi"}))
        .chain(std::iter::once(json!({"name": "served", "size": "1Gi",
            "template": {"spec": {"containers": [{"name": "s", "image": "i"}]}}})))
        .collect();
    let r: ModelResidency = serde_json::from_value(json!({
        "apiVersion": "residency.dev/v1alpha1", "kind": "ModelResidency",
        "metadata": {"name": "gpu"},
        "spec": {"nodeName": h.node, "device": "0", "budget": "80Gi", "models": models},
    }))
    .unwrap();
    h.api.create(&PostParams::default(), &r).await.unwrap();
    let r = h.request("gpu", "served").await;
    let s = r.status.as_ref().unwrap();
    assert_eq!(s.models.len(), 1000);
    assert_eq!(state(&r, "served").0, ModelState::Loaded);
    assert_eq!(condition(&r, "Ready").status, "True");
}

#[tokio::test]
#[ignore = "needs the local control plane: scripts/test.sh runs it with --include-ignored"]
async fn a_keep_alive_of_eleven_million_years_keeps_the_model_and_the_controller() {
    let h = Harness::start("bad-keepalive").await;
    h.create("gpu", "10Gi", &[("a", "1Gi", false)]).await;
    h.create("other", "10Gi", &[("b", "1Gi", false)]).await;
    // lastUsed + keepAlive is past the last time there is: before, the
    // reconcile panicked, which ended the controller for every residency.
    h.patch_spec("gpu", json!({"keepAlive": "99999999999h"}))
        .await;
    h.request("gpu", "a").await;
    let r = h.until_state("gpu", "a", ModelState::Loaded, 30).await;
    assert_eq!(condition(&r, "Ready").status, "True");
    h.request("other", "b").await;
    h.until_state("other", "b", ModelState::Loaded, 30).await;
    h.request("gpu", "a").await;
    let r = h.converged("gpu").await;
    assert_eq!(state(&r, "a").0, ModelState::Loaded);
}
