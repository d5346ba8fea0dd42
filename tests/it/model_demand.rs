//! ModelDemand and its /scale subresource on the real API server: what
//! `kubectl scale`, HPA and KEDA do to it, and what they read back.

use crate::support::cluster::eventually;
use crate::support::operator::Harness;
use kube::api::{Api, DeleteParams, Patch, PatchParams, PostParams};
use model_residency::api::{ModelDemand, ModelResidency, ModelState};
use serde_json::{Value, json};

fn new_demand(name: &str, residency: &str, model: &str, replicas: i32) -> ModelDemand {
    serde_json::from_value(json!({
        "apiVersion": "residency.dev/v1alpha1", "kind": "ModelDemand",
        "metadata": {"name": name},
        "spec": {"residency": residency, "model": model, "replicas": replicas},
    }))
    .unwrap()
}

/// Waits until ModelDemand `name`'s status says `replicas` with Ready's
/// reason `reason`.
async fn until_mirrored(
    api: &Api<ModelDemand>,
    name: &str,
    replicas: i32,
    reason: &str,
) -> ModelDemand {
    eventually(
        30,
        &format!("{name} to show {replicas} ({reason})"),
        || async {
            let md = api.get(name).await.unwrap();
            let st = md.status.as_ref()?;
            let ready = st.conditions.iter().find(|c| c.type_ == "Ready")?;
            (st.replicas == replicas && ready.reason == reason).then_some(md)
        },
    )
    .await
}

fn kubectl_ok(h: &Harness, args: &[&str]) -> String {
    let out = h.env.kubectl(args);
    let text = String::from_utf8_lossy(&out.stdout).to_string();
    assert!(
        out.status.success(),
        "kubectl {args:?}: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    text
}

#[tokio::test]
#[ignore = "needs the local control plane: scripts/test.sh runs it with --include-ignored"]
async fn kubectl_scale_loads_and_unloads_a_model_and_scale_reads_it_back() {
    let h = Harness::start("mdem-scale").await;
    h.create(
        "gpu",
        "16000Mi",
        &[("zimage", "10900Mi", false), ("sdxl", "6000Mi", false)],
    )
    .await;
    let mds: Api<ModelDemand> = Api::namespaced(h.env.client.clone(), &h.env.namespace);
    mds.create(&PostParams::default(), &new_demand("z", "gpu", "zimage", 0))
        .await
        .unwrap();
    kubectl_ok(&h, &["scale", "modeldemand/z", "--replicas=1"]);
    h.until_state("gpu", "zimage", ModelState::Loaded, 30).await;
    until_mirrored(&mds, "z", 1, "ModelLoaded").await;
    // What HPA reads: autoscaling/v1 Scale with replicas and the selector.
    let raw = kubectl_ok(
        &h,
        &[
            "get",
            "--raw",
            &format!(
                "/apis/residency.dev/v1alpha1/namespaces/{}/modeldemands/z/scale",
                h.env.namespace
            ),
        ],
    );
    let scale: Value = serde_json::from_str(&raw).unwrap();
    assert_eq!(scale["kind"], "Scale");
    assert_eq!(scale["spec"]["replicas"], 1);
    assert_eq!(scale["status"]["replicas"], 1);
    assert_eq!(
        scale["status"]["selector"],
        "residency.dev/residency=gpu,residency.dev/model=zimage"
    );
    // Another model evicts it: status replicas 0, with the reason.
    let r = h.request("gpu", "sdxl").await;
    assert_eq!(
        r.status.as_ref().unwrap().models[0].state,
        ModelState::Evicted
    );
    let md = until_mirrored(&mds, "z", 0, "MadeRoom").await;
    assert_eq!(md.status.unwrap().state.as_deref(), Some("Evicted"));
    // A standing request is not renewed at once: still evicted, nothing
    // written (it is asked again REASK_AFTER, 30 s, after its request).
    let key = h.api.get("gpu").await.unwrap().spec.demand["zimage"].clone();
    tokio::time::sleep(std::time::Duration::from_secs(1)).await;
    assert_eq!(h.api.get("gpu").await.unwrap().spec.demand["zimage"], key);
    // 0: the key goes (an unload; it was evicted already).
    kubectl_ok(&h, &["scale", "modeldemand/z", "--replicas=0"]);
    eventually(30, "the demand key to go", || async {
        (!h.api
            .get("gpu")
            .await
            .unwrap()
            .spec
            .demand
            .contains_key("zimage"))
        .then_some(())
    })
    .await;
    // 1 again: a new request at that moment; it loads and evicts sdxl.
    kubectl_ok(&h, &["scale", "modeldemand/z", "--replicas=1"]);
    let r = h.until_state("gpu", "zimage", ModelState::Loaded, 30).await;
    assert!(r.spec.demand["zimage"] > key, "not a new request");
    until_mirrored(&mds, "z", 1, "ModelLoaded").await;
    // Deleted: its key goes with it, and so does the object (finalizer).
    mds.delete("z", &DeleteParams::default()).await.unwrap();
    eventually(30, "the ModelDemand and its key to go", || async {
        let gone = mds.get_opt("z").await.unwrap().is_none();
        let keyless = !h
            .api
            .get("gpu")
            .await
            .unwrap()
            .spec
            .demand
            .contains_key("zimage");
        (gone && keyless).then_some(())
    })
    .await;
    h.until_state("gpu", "zimage", ModelState::Unloaded, 30)
        .await;
    let c = h.converged("gpu").await.status.unwrap().counters;
    assert_eq!((c.loads, c.evictions, c.unloads), (3, 2, 1), "{c:?}");
}

#[tokio::test]
#[ignore = "needs the local control plane: scripts/test.sh runs it with --include-ignored"]
async fn a_demand_for_a_missing_residency_or_model_is_a_condition_not_a_loop() {
    let h = Harness::start("mdem-missing").await;
    let mds: Api<ModelDemand> = Api::namespaced(h.env.client.clone(), &h.env.namespace);
    mds.create(
        &PostParams::default(),
        &new_demand("early", "later", "a", 1),
    )
    .await
    .unwrap();
    until_mirrored(&mds, "early", 0, "ResidencyNotFound").await;
    h.create("gpu", "1Gi", &[("a", "1Mi", false)]).await;
    mds.create(&PostParams::default(), &new_demand("typo", "gpu", "b", 1))
        .await
        .unwrap();
    until_mirrored(&mds, "typo", 0, "ModelNotFound").await;
    let r: ModelResidency = h.api.get("gpu").await.unwrap();
    assert!(
        !r.spec.demand.contains_key("b"),
        "a key for a model the registry lacks"
    );
    // The residency it names appears: the residency watch wakes it, and the
    // standing request is sent.
    h.create("later", "1Gi", &[("a", "1Mi", false)]).await;
    h.until_state("later", "a", ModelState::Loaded, 30).await;
    until_mirrored(&mds, "early", 1, "ModelLoaded").await;
    // Waiting was not an error loop: neither the demand write nor the status
    // write ever failed. (A finalizer patch may lose one race against a
    // reconcile started from a cache behind it; that is retried, and is at
    // most one per object.)
    let errors = |step: &str| {
        h.ctx.metrics.sum_where(
            "model_residency_reconcile_errors_total",
            &format!(r#"reason="{step}""#),
        )
    };
    assert_eq!(errors("demand_write_demand"), 0);
    assert_eq!(errors("demand_patch_status"), 0);
    assert!(
        errors("demand_finalizer") <= 2,
        "{}",
        errors("demand_finalizer")
    );
}

#[tokio::test]
#[ignore = "needs the local control plane: scripts/test.sh runs it with --include-ignored"]
async fn a_second_demand_for_one_model_is_a_condition_until_the_first_goes() {
    let h = Harness::start("mdem-dup").await;
    h.create("gpu", "16000Mi", &[("zimage", "10900Mi", false)])
        .await;
    let mds: Api<ModelDemand> = Api::namespaced(h.env.client.clone(), &h.env.namespace);
    // The older one (by creation time, then name) holds the model's key.
    mds.create(
        &PostParams::default(),
        &new_demand("a-first", "gpu", "zimage", 1),
    )
    .await
    .unwrap();
    h.until_state("gpu", "zimage", ModelState::Loaded, 30).await;
    until_mirrored(&mds, "a-first", 1, "ModelLoaded").await;
    mds.create(
        &PostParams::default(),
        &new_demand("b-second", "gpu", "zimage", 0),
    )
    .await
    .unwrap();
    let second = until_mirrored(&mds, "b-second", 0, "DuplicateModelDemand").await;
    let ready = &second.status.unwrap().conditions[0];
    assert!(ready.message.contains("a-first"), "{}", ready.message);
    // Its 0 did not unload the model the first one asks for.
    let r: ModelResidency = h.api.get("gpu").await.unwrap();
    assert!(r.spec.demand.contains_key("zimage"), "{:?}", r.spec.demand);
    let state = r
        .status
        .as_ref()
        .and_then(|s| s.model("zimage"))
        .map(|m| m.state);
    assert_eq!(state, Some(ModelState::Loaded));
    // The first goes: the second takes the key over, and its 0 unloads.
    mds.delete("a-first", &DeleteParams::default())
        .await
        .unwrap();
    h.until_state("gpu", "zimage", ModelState::Unloaded, 30)
        .await;
    until_mirrored(&mds, "b-second", 0, "DemandRemoved").await;
    let r: ModelResidency = h.api.get("gpu").await.unwrap();
    assert!(!r.spec.demand.contains_key("zimage"), "{:?}", r.spec.demand);
}

#[tokio::test]
#[ignore = "needs the local control plane: scripts/test.sh runs it with --include-ignored"]
async fn a_demand_moved_to_another_model_leaves_no_request_behind() {
    let h = Harness::start("mdem-move").await;
    h.create(
        "gpu",
        "16000Mi",
        &[("zimage", "10900Mi", false), ("sdxl", "4000Mi", false)],
    )
    .await;
    let mds: Api<ModelDemand> = Api::namespaced(h.env.client.clone(), &h.env.namespace);
    mds.create(&PostParams::default(), &new_demand("d", "gpu", "zimage", 1))
        .await
        .unwrap();
    h.until_state("gpu", "zimage", ModelState::Loaded, 30).await;
    until_mirrored(&mds, "d", 1, "ModelLoaded").await;
    kubectl_ok(
        &h,
        &[
            "patch",
            "modeldemand/d",
            "--type=merge",
            "-p",
            r#"{"spec":{"model":"sdxl"}}"#,
        ],
    );
    // The key it drove goes (an unload), the new one is a request now.
    h.until_state("gpu", "zimage", ModelState::Unloaded, 30)
        .await;
    h.until_state("gpu", "sdxl", ModelState::Loaded, 30).await;
    let md = until_mirrored(&mds, "d", 1, "ModelLoaded").await;
    assert_eq!(md.status.unwrap().model.as_deref(), Some("sdxl"));
    let r: ModelResidency = h.api.get("gpu").await.unwrap();
    let keys: Vec<&String> = r.spec.demand.keys().collect();
    assert_eq!(keys, ["sdxl"]);
}

async fn scale(mds: &Api<ModelDemand>, name: &str, replicas: i32) -> ModelDemand {
    let body = json!({"spec": {"replicas": replicas}});
    let md = mds
        .patch(name, &PatchParams::default(), &Patch::Merge(&body))
        .await
        .unwrap();
    let generation = md.metadata.generation;
    eventually(30, &format!("{name} at {replicas} to be seen"), || async {
        let md = mds.get(name).await.unwrap();
        let st = md.status.as_ref()?;
        let seen =
            st.observed_generation == generation && st.requested_at.is_some() == (replicas == 1);
        seen.then_some(md)
    })
    .await
}

#[tokio::test]
#[ignore = "needs the local control plane: scripts/test.sh runs it with --include-ignored"]
async fn a_demand_at_zero_withdraws_its_own_request_and_never_vetoes_traffic() {
    let h = Harness::start("mdem-veto").await;
    h.create("gpu", "16000Mi", &[("zimage", "10900Mi", false)])
        .await;
    let mds: Api<ModelDemand> = Api::namespaced(h.env.client.clone(), &h.env.namespace);
    mds.create(&PostParams::default(), &new_demand("z", "gpu", "zimage", 0))
        .await
        .unwrap();
    // Traffic (a demand write, as the router makes) loads the model while
    // the ModelDemand is at 0. Before, the ModelDemand removed the key
    // again at once, and the router's held requests waited out their
    // load timeout.
    h.request("gpu", "zimage").await;
    h.until_state("gpu", "zimage", ModelState::Loaded, 30).await;
    until_mirrored(&mds, "z", 1, "ModelLoaded").await;
    let r: ModelResidency = h.api.get("gpu").await.unwrap();
    assert!(r.spec.demand.contains_key("zimage"), "{:?}", r.spec.demand);
    // 1 then 0 with nothing in between: its own request is withdrawn.
    let md = scale(&mds, "z", 1).await;
    let own = md.status.unwrap().requested_at.unwrap();
    eventually(30, "the key to hold the ModelDemand's request", || async {
        let r: ModelResidency = h.api.get("gpu").await.unwrap();
        (r.spec.demand.get("zimage") == Some(&own)).then_some(())
    })
    .await;
    scale(&mds, "z", 0).await;
    h.until_state("gpu", "zimage", ModelState::Unloaded, 30)
        .await;
    // 1, then traffic, then 0: the traffic's later request stands.
    scale(&mds, "z", 1).await;
    h.until_state("gpu", "zimage", ModelState::Loaded, 30).await;
    h.request("gpu", "zimage").await;
    scale(&mds, "z", 0).await;
    let r = h.converged("gpu").await;
    assert!(r.spec.demand.contains_key("zimage"), "{:?}", r.spec.demand);
    let state = r
        .status
        .as_ref()
        .and_then(|s| s.model("zimage"))
        .map(|m| m.state);
    assert_eq!(state, Some(ModelState::Loaded));
}
