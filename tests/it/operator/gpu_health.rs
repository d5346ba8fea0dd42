//! A GPU that fails or is taken away (#70) on the real API server: DRA
//! device taints on the node's ResourceSlice (as a driver or an admin
//! writes them) and a cordoned node, read by the operator.

use crate::support::cluster::eventually;
use crate::support::operator::Harness;
use k8s_openapi::api::core::v1::Node;
use kube::api::{Api, Patch, PatchParams};
use model_residency::api::{ModelResidency, ModelState};
use model_residency::local::kubelet::set_gpu_taints;
use serde_json::json;

fn condition(r: &ModelResidency, type_: &str) -> Option<(String, String)> {
    let c = r
        .status
        .as_ref()?
        .conditions
        .iter()
        .find(|c| c.type_ == type_)?;
    Some((c.status.clone(), c.reason.clone()))
}

async fn until_condition(
    h: &Harness,
    name: &str,
    type_: &str,
    want: (&str, &str),
) -> ModelResidency {
    let what = format!("{type_}={want:?}");
    super::gpu_claims::until_condition(&h.api, name, type_, &what, |c| {
        c.status == want.0 && c.reason == want.1
    })
    .await
}

/// `failing` (GPU 0) and `other` (GPU 1) both list x, y and z; the three
/// are loaded on `failing`.
async fn three_on_failing_beside_other(h: &Harness) {
    let models = [
        ("x", "2Gi", false),
        ("y", "2Gi", false),
        ("z", "2Gi", false),
    ];
    h.create("failing", "10Gi", &models).await;
    h.create("other", "10Gi", &models).await;
    for m in ["x", "y", "z"] {
        h.request("failing", m).await;
    }
}

#[tokio::test]
#[ignore = "needs the local control plane (scripts/control-plane.sh)"]
async fn a_tainted_gpu_gives_up_its_models_or_takes_no_new_ones_and_a_cordoned_node_too() {
    let h = Harness::start("gpu-health").await;
    three_on_failing_beside_other(&h).await;
    h.request("other", "x").await;
    let client = &h.env.client;

    // NoExecute (an XID error): every model there unloaded at once, not
    // evicted; the other GPU keeps its own.
    let xid = json!([{"key": "gpu.nvidia.com/xid", "value": "79", "effect": "NoExecute"}]);
    set_gpu_taints(client, &h.node, 0, xid).await.unwrap();
    let r = until_condition(&h, "failing", "GpuHealthy", ("False", "NoExecute")).await;
    let status = r.status.as_ref().unwrap();
    assert_eq!(
        condition(&r, "Ready"),
        Some(("False".into(), "GpuTainted".into()))
    );
    for m in ["x", "y", "z"] {
        let st = status.model(m).unwrap();
        assert_eq!(
            (st.state, st.reason.as_deref()),
            (ModelState::Unloaded, Some("GpuTainted"))
        );
    }
    assert_eq!(status.counters.evictions, 0);
    eventually(30, "failing's pods gone", || async {
        (h.pods_of("failing").await.0.is_empty()).then_some(())
    })
    .await;
    let other = h.api.get("other").await.unwrap();
    assert_eq!(
        other.status.unwrap().model("x").unwrap().state,
        ModelState::Loaded
    );
    assert!(condition(&h.api.get("other").await.unwrap(), "GpuHealthy").is_none());

    // The taint goes: held off first (a toggling GPU takes nothing new).
    set_gpu_taints(client, &h.node, 0, json!([])).await.unwrap();
    until_condition(&h, "failing", "GpuHealthy", ("True", "HeldOff")).await;

    // NoSchedule (maintenance announced): what is there stays and serves,
    // nothing new comes.
    let maintenance = json!([{"key": "example.com/maintenance", "effect": "NoSchedule"}]);
    set_gpu_taints(client, &h.node, 1, maintenance)
        .await
        .unwrap();
    until_condition(&h, "other", "GpuHealthy", ("False", "NoSchedule")).await;
    let r = h.request("other", "x").await;
    assert_eq!(
        r.status.as_ref().unwrap().model("x").unwrap().state,
        ModelState::Loaded
    );
    let r = h.request("other", "y").await;
    let y = r.status.as_ref().unwrap().model("y").unwrap().clone();
    assert_eq!(
        (y.state, y.reason.as_deref()),
        (ModelState::Refused, Some("GpuTainted")),
        "{y:?}"
    );
    assert_eq!(h.pods_of("other").await.0.len(), 1);
    set_gpu_taints(client, &h.node, 1, json!([])).await.unwrap();

    // A cordoned node: the same for every GPU on it.
    let nodes: Api<Node> = Api::all(client.clone());
    let cordon = |on: bool| json!({"spec": {"unschedulable": on}});
    let pp = PatchParams::default();
    nodes
        .patch(&h.node, &pp, &Patch::Merge(cordon(true)))
        .await
        .unwrap();
    until_condition(&h, "other", "GpuHealthy", ("False", "Cordoned")).await;
    nodes
        .patch(&h.node, &pp, &Patch::Merge(cordon(false)))
        .await
        .unwrap();
    until_condition(&h, "other", "GpuHealthy", ("True", "HeldOff")).await;
}

#[tokio::test]
#[ignore = "needs the local control plane (scripts/control-plane.sh)"]
async fn a_hot_model_is_loaded_elsewhere_before_its_gpu_goes() {
    let h = Harness::start("gpu-premove").await;
    let models = [("hot", "4Gi", false), ("cold", "4Gi", false)];
    h.create("leaving", "10Gi", &models).await;
    h.create("staying", "10Gi", &models).await;
    h.request("leaving", "hot").await;
    let client = &h.env.client;

    // Maintenance announced: the GPU takes no new models, and its hot
    // model is loaded on the other GPU that lists it while it still
    // serves here.
    let maintenance = json!([{"key": "example.com/maintenance", "effect": "NoSchedule"}]);
    set_gpu_taints(client, &h.node, 0, maintenance)
        .await
        .unwrap();
    let staying = h
        .until_state("staying", "hot", ModelState::Loaded, 30)
        .await;
    let leaving = h.api.get("leaving").await.unwrap();
    let hot = leaving.status.as_ref().unwrap().model("hot").unwrap();
    assert_eq!(hot.state, ModelState::Loaded, "still serving where it was");
    assert!(
        staying
            .status
            .as_ref()
            .unwrap()
            .model("cold")
            .is_none_or(|m| m.state != ModelState::Loaded),
        "only what was requested moves"
    );
    let events = h.events_of("leaving").await;
    assert!(
        events
            .iter()
            .any(|e| e.contains("MovedAhead") && e.contains("hot is loaded on staying")),
        "{events:#?}"
    );
    // New requests go to the copy that stays; the leaving GPU serves only
    // what it had in flight.
    let router = crate::support::router::RouterUnderTest::exact(&h).await;
    for _ in 0..3 {
        let answer = router.chat("hot").await;
        crate::support::router::assert_served_by(&answer, "hot");
        let residency = answer.headers["x-residency"].to_str().unwrap();
        assert!(residency.ends_with("/staying"), "{residency}");
    }

    // The GPU goes: nothing needs a cold load, the copy serves.
    let gone = json!([{"key": "example.com/maintenance", "effect": "NoExecute"}]);
    set_gpu_taints(client, &h.node, 0, gone).await.unwrap();
    h.until_state("leaving", "hot", ModelState::Unloaded, 30)
        .await;
    let staying = h.api.get("staying").await.unwrap();
    assert_eq!(
        staying.status.unwrap().model("hot").unwrap().state,
        ModelState::Loaded
    );
}

#[tokio::test]
#[ignore = "needs the local control plane (scripts/control-plane.sh)"]
async fn requests_across_a_no_execute_taint_all_succeed_on_the_other_gpu() {
    use crate::support::router::{RouterUnderTest, assert_served_by};
    // Loads that take a second, so requests are held through them.
    let h = Harness::start_with("taint-router", std::time::Duration::from_secs(1)).await;
    three_on_failing_beside_other(&h).await;
    let router = RouterUnderTest::exact(&h).await;
    let gone = json!([{"key": "gpu.nvidia.com/xid", "value": "79", "effect": "NoExecute"}]);
    set_gpu_taints(&h.env.client, &h.node, 0, gone)
        .await
        .unwrap();
    // Twenty requests as the GPU goes: each answered, by one model's pod.
    let router = std::sync::Arc::new(router);
    let mut sent = tokio::task::JoinSet::new();
    for i in 0..20 {
        let router = router.clone();
        let model = ["x", "y", "z"][i % 3];
        sent.spawn(async move { (model, router.chat(model).await) });
    }
    let mut on_other = 0;
    while let Some(done) = sent.join_next().await {
        let (model, answer) = done.unwrap();
        assert_served_by(&answer, model);
        let residency = answer.headers["x-residency"].to_str().unwrap().to_owned();
        on_other += usize::from(residency.ends_with("/other"));
    }
    // What came after the taint was served where the models went.
    until_condition(&h, "failing", "GpuHealthy", ("False", "NoExecute")).await;
    for m in ["x", "y", "z"] {
        let answer = router.chat(m).await;
        assert_served_by(&answer, m);
        assert!(
            answer.headers["x-residency"]
                .to_str()
                .unwrap()
                .ends_with("/other")
        );
    }
    println!("{on_other} of 20 requests sent as the taint landed were served by the other GPU");
}
