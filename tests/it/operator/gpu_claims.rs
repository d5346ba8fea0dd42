//! Claim mode on the real scheduler and resource claim controller: one
//! ResourceClaim per residency, allocated when its holder pod is scheduled,
//! shared by every model pod; what happens when the device is taken or
//! missing; the claim's lifecycle. The kubelet stand-in publishes the
//! node's GPUs as the NVIDIA DRA driver does.

use super::*;
use k8s_openapi::api::resource::v1::ResourceClaim;
use kube::api::PostParams;
use model_residency::local::kubelet::fake_gpu_uuid;
use model_residency::residency::labels::GPU_HOLDER_LABEL;
use std::time::Duration;

/// A claim-mode residency (the default mode) from its spec's JSON.
async fn create(h: &Harness, name: &str, spec: serde_json::Value) -> ModelResidency {
    let r: ModelResidency = serde_json::from_value(json!({
        "apiVersion": "residency.dev/v1alpha1", "kind": "ModelResidency",
        "metadata": {"name": name}, "spec": spec,
    }))
    .unwrap();
    h.api.create(&PostParams::default(), &r).await.unwrap()
}

fn models(names: &[&str]) -> serde_json::Value {
    let all: Vec<_> = names
        .iter()
        .map(|n| {
            json!({"name": n, "size": "6Gi", "template": {"spec": {
                "containers": [{"name": "server", "image": format!("example/{n}:1")}]}}})
        })
        .collect();
    json!(all)
}

fn claims(h: &Harness) -> Api<ResourceClaim> {
    Api::namespaced(h.env.client.clone(), &h.env.namespace)
}

/// Waits until residency `name` says Ready=`status` with `reason`.
async fn until_ready(h: &Harness, name: &str, status: &str, reason: &str) -> ModelResidency {
    until_ready_in(&h.api, name, status, reason).await
}

/// [`until_ready`] for a residency of `api`'s namespace.
async fn until_ready_in(
    api: &Api<ModelResidency>,
    name: &str,
    status: &str,
    reason: &str,
) -> ModelResidency {
    let what = format!("Ready={status} {reason}");
    until_condition(api, name, "Ready", &what, |c| {
        c.status == status && c.reason == reason
    })
    .await
}

/// Waits until residency `name`'s condition `type_` is as `ok` wants it.
pub(super) async fn until_condition(
    api: &Api<ModelResidency>,
    name: &str,
    type_: &str,
    what: &str,
    ok: impl Fn(&k8s_openapi::apimachinery::pkg::apis::meta::v1::Condition) -> bool,
) -> ModelResidency {
    eventually(60, &format!("{name} {what}"), || async {
        let r = api.get(name).await.ok()?;
        let c = r
            .status
            .as_ref()?
            .conditions
            .iter()
            .find(|c| c.type_ == type_)?;
        ok(c).then_some(r.clone())
    })
    .await
}

fn gpu(r: &ModelResidency) -> &model_residency::api::GpuStatus {
    r.status
        .as_ref()
        .and_then(|s| s.gpu.as_ref())
        .expect("status.gpu")
}

#[tokio::test]
#[ignore = "needs the local control plane: scripts/test.sh runs it with --include-ignored"]
async fn one_claim_is_allocated_shared_by_every_model_pod_and_goes_after_them() {
    let h = Harness::start("claim-shared").await;
    create(
        &h,
        "gpu",
        json!({"nodeName": h.node, "device": "2", "budget": "20Gi", "models": models(&["a", "b"])}),
    )
    .await;
    h.request("gpu", "a").await;
    let r = h.request("gpu", "b").await;
    assert_eq!(model(&r, "a").state, ModelState::Loaded);
    let g = gpu(&r);
    assert_eq!(g.node.as_deref(), Some(h.node.as_str()));
    assert_eq!(g.device.as_deref(), Some("gpu-2"));
    assert_eq!(g.uuid.as_deref(), Some(fake_gpu_uuid(&h.node, 2).as_str()));
    assert_eq!(g.memory.as_deref(), Some("80Gi"));
    assert_eq!(g.claim.as_deref(), Some("gpu-gpu"));
    assert_eq!(g.budget_source.as_deref(), Some("spec"));
    // One claim, for exactly that device, reserved for the holder and both
    // model pods.
    let claim = claims(&h).get("gpu-gpu").await.unwrap();
    let status = claim.status.unwrap();
    let result = &status.allocation.unwrap().devices.unwrap().results.unwrap()[0];
    assert_eq!(
        (result.pool.as_str(), result.device.as_str()),
        (h.node.as_str(), "gpu-2")
    );
    let mut reserved: Vec<String> = status
        .reserved_for
        .unwrap()
        .into_iter()
        .map(|c| c.name)
        .collect();
    reserved.sort();
    let mut want = vec![
        pod_name("gpu", "a"),
        pod_name("gpu", "b"),
        "gpu-gpu-holder".to_owned(),
    ];
    want.sort();
    assert_eq!(reserved, want);
    for m in ["a", "b"] {
        let pod = h.pods.get(&pod_name("gpu", m)).await.unwrap();
        let spec = pod.spec.unwrap();
        assert_eq!(
            spec.node_name.as_deref(),
            Some(h.node.as_str()),
            "bound by the scheduler"
        );
        let refs = spec.resource_claims.unwrap();
        assert_eq!(refs[0].resource_claim_name.as_deref(), Some("gpu-gpu"));
        let c = &spec.containers[0];
        assert!(
            c.env
                .iter()
                .flatten()
                .all(|e| e.name != "NVIDIA_VISIBLE_DEVICES"),
            "{:?}",
            c.env
        );
        assert_eq!(
            c.resources.as_ref().unwrap().claims.as_ref().unwrap()[0].name,
            "gpu"
        );
    }
    // kubectl shows where the GPU is.
    let out = h.env.kubectl(&["get", "mres", "gpu", "-o", "wide"]);
    let table = String::from_utf8_lossy(&out.stdout);
    assert!(
        table.contains("gpu-2") && table.contains(&fake_gpu_uuid(&h.node, 2)),
        "{table}"
    );
    // Deleted: the pods go, then the claim (the scheduler's finalizer holds
    // it while a pod still uses it).
    h.api.delete("gpu", &DeleteParams::default()).await.unwrap();
    let order = eventually(60, "the claim to go", || async {
        let claim = claims(&h).get_opt("gpu-gpu").await.unwrap();
        let pods = h
            .pods
            .list(&ListParams::default())
            .await
            .unwrap()
            .items
            .len();
        match claim {
            None => Some(pods),
            Some(_) => None,
        }
    })
    .await;
    assert_eq!(order, 0, "the claim went while pods still used it");
}

#[tokio::test]
#[ignore = "needs the local control plane: scripts/test.sh runs it with --include-ignored"]
async fn without_a_node_or_a_budget_the_scheduler_and_the_device_decide() {
    let h = Harness::start("claim-anywhere").await;
    // Its uuid names one GPU of one node in the whole cluster.
    let uuid = fake_gpu_uuid(&h.node, 5);
    create(&h, "gpu", json!({"device": uuid, "models": models(&["a"])})).await;
    let r = h.request("gpu", "a").await;
    assert_eq!(model(&r, "a").state, ModelState::Loaded);
    let s = r.status.as_ref().unwrap();
    assert_eq!(
        s.budget.as_deref(),
        Some("72Gi"),
        "0.9 of the device's 80Gi"
    );
    let g = gpu(&r);
    assert_eq!(g.node.as_deref(), Some(h.node.as_str()));
    assert_eq!(g.device.as_deref(), Some("gpu-5"));
    assert_eq!(g.budget_source.as_deref(), Some("device"));
    // A budget larger than the device is cut to it, and said.
    h.patch_spec("gpu", json!({"budget": "100Gi"})).await;
    let r = eventually(30, "the budget to be cut", || async {
        let r = h.api.get("gpu").await.unwrap();
        (r.status.as_ref()?.budget.as_deref() == Some("80Gi")).then_some(r)
    })
    .await;
    let c = condition(&r, "BudgetExceedsDevice");
    assert_eq!(c.status, "True");
    assert!(
        c.message
            .contains("100Gi is more than the device's memory 80Gi"),
        "{}",
        c.message
    );
    assert_eq!(gpu(&r).budget_source.as_deref(), Some("deviceLimit"));
}

#[tokio::test]
#[ignore = "needs the local control plane: scripts/test.sh runs it with --include-ignored"]
async fn two_claims_for_one_device_the_scheduler_gives_it_to_one_and_the_other_waits() {
    let h = Harness::start("claim-taken").await;
    let spec = |m: &str| json!({"nodeName": h.node, "device": "1", "budget": "20Gi", "models": models(&[m])});
    create(&h, "first", spec("a")).await;
    h.request("first", "a").await;
    create(&h, "second", spec("b")).await;
    h.request_nowait("second", "b").await;
    let r = until_ready(&h, "second", "False", "GpuUnavailable").await;
    let ready = condition(&r, "Ready");
    assert!(
        ready.message.contains("the scheduler says"),
        "{}",
        ready.message
    );
    assert!(
        ready.message.contains("cannot allocate all claims"),
        "{}",
        ready.message
    );
    assert_eq!(
        h.pods_of("second").await.0,
        BTreeSet::new(),
        "loads nothing"
    );
    assert_eq!(model(&r, "b").state, ModelState::Unloaded);
    // The GPU is freed: the second takes it and loads on the next request.
    h.api
        .delete("first", &DeleteParams::default())
        .await
        .unwrap();
    until_ready(&h, "second", "True", "AllResidentModelsReady").await;
    let r = h.request("second", "b").await;
    assert_eq!(model(&r, "b").state, ModelState::Loaded);
    assert_eq!(gpu(&r).device.as_deref(), Some("gpu-1"));
}

#[tokio::test]
#[ignore = "needs the local control plane: scripts/test.sh runs it with --include-ignored"]
async fn a_claim_deleted_by_hand_is_made_again_and_its_pods_go_first() {
    let h = Harness::start("claim-deleted").await;
    create(
        &h,
        "gpu",
        json!({"nodeName": h.node, "device": "0", "budget": "20Gi", "models": models(&["a"])}),
    )
    .await;
    h.request("gpu", "a").await;
    let old = claims(&h).get("gpu-gpu").await.unwrap().metadata.uid;
    claims(&h)
        .delete("gpu-gpu", &DeleteParams::default())
        .await
        .unwrap();
    eventually(60, "a new claim", || async {
        let c = claims(&h).get_opt("gpu-gpu").await.unwrap()?;
        (c.metadata.uid != old && c.metadata.deletion_timestamp.is_none()).then_some(())
    })
    .await;
    let r = until_ready(&h, "gpu", "True", "AllResidentModelsReady").await;
    assert_eq!(
        model(&r, "a").state,
        ModelState::Unloaded,
        "its pod lost the GPU"
    );
    let r = h.request("gpu", "a").await;
    assert_eq!(model(&r, "a").state, ModelState::Loaded);
    let events = events_for(&h, "gpu").await;
    assert!(
        events.iter().any(|(reason, _)| reason == "GpuUnavailable"),
        "{events:?}"
    );
}

#[tokio::test]
#[ignore = "needs the local control plane: scripts/test.sh runs it with --include-ignored"]
async fn a_claim_that_cannot_be_allocated_names_what_is_missing_and_makes_no_model_pod() {
    let h = Harness::start("claim-missing").await;
    let cases = [
        (
            "no-class",
            json!({"nodeName": h.node, "device": "0", "gpu": {"deviceClassName": "no-such-class"}}),
            "DeviceClassMissing",
            "DeviceClass no-such-class does not exist",
        ),
        (
            "no-device",
            json!({"nodeName": h.node, "device": "99"}),
            "NoSuchGpu",
            "has index or uuid 99",
        ),
        (
            "no-driver",
            json!({"nodeName": "no-such-node", "device": "0"}),
            "NoGpuDriver",
            "node no-such-node publishes no gpu.nvidia.com devices",
        ),
        (
            "taken-name",
            json!({"nodeName": h.node, "device": "3"}),
            "ClaimMissing",
            "is not this residency's",
        ),
        (
            "no-existing",
            json!({"nodeName": h.node, "device": "3", "gpu": {"existingClaim": "nowhere"}}),
            "ClaimMissing",
            "no such ResourceClaim",
        ),
    ];
    // Someone else's claim has the name the operator would give.
    let squatter: ResourceClaim = serde_json::from_value(json!({
        "metadata": {"name": "taken-name-gpu"},
        "spec": {"devices": {"requests": [{"name": "gpu", "exactly": {"deviceClassName": "gpu.nvidia.com"}}]}},
    }))
    .unwrap();
    claims(&h)
        .create(&PostParams::default(), &squatter)
        .await
        .unwrap();
    for (name, mut spec, _, _) in cases.clone() {
        spec["budget"] = json!("10Gi");
        spec["models"] = models(&["a"]);
        create(&h, name, spec).await;
        h.request_nowait(name, "a").await;
    }
    for (name, _, reason, words) in cases {
        let r = until_ready(&h, name, "False", reason).await;
        let ready = condition(&r, "Ready");
        assert!(ready.message.contains(words), "{name}: {}", ready.message);
        assert_eq!(h.pods_of(name).await.0, BTreeSet::new(), "{name}");
    }
    // The squatter's claim is not the operator's to touch.
    assert!(
        claims(&h)
            .get_opt("taken-name-gpu")
            .await
            .unwrap()
            .is_some()
    );
    let all = h
        .pods
        .list(&ListParams::default().labels(RESIDENCY_LABEL_SELECTOR))
        .await
        .unwrap();
    assert!(
        all.items.is_empty(),
        "a model pod was made: {:?}",
        all.items
            .iter()
            .map(|p| &p.metadata.name)
            .collect::<Vec<_>>()
    );
}

const RESIDENCY_LABEL_SELECTOR: &str = "residency.dev/model";

/// Makes, as someone else would, claim `name` for GPU `index` of the test's
/// node (by its uuid).
async fn claim_for_gpu(h: &Harness, name: &str, index: u32) {
    let selector = format!(
        "device.attributes['gpu.nvidia.com'].uuid == '{}'",
        fake_gpu_uuid(&h.node, index)
    );
    let claim: ResourceClaim = serde_json::from_value(json!({
        "metadata": {"name": name},
        "spec": {"devices": {"requests": [{"name": "gpu", "exactly": {
            "deviceClassName": "gpu.nvidia.com",
            "selectors": [{"cel": {"expression": selector}}],
        }}]}},
    }))
    .unwrap();
    claims(h)
        .create(&PostParams::default(), &claim)
        .await
        .unwrap();
}

#[tokio::test]
#[ignore = "needs the local control plane: scripts/test.sh runs it with --include-ignored"]
async fn an_existing_claim_is_shared_and_left_alone() {
    let h = Harness::start("claim-existing").await;
    claim_for_gpu(&h, "team-gpu", 4).await;
    create(&h, "gpu", json!({"device": "4", "budget": "20Gi", "gpu": {"existingClaim": "team-gpu"}, "models": models(&["a"])})).await;
    let r = h.request("gpu", "a").await;
    assert_eq!(model(&r, "a").state, ModelState::Loaded);
    assert_eq!(gpu(&r).claim.as_deref(), Some("team-gpu"));
    assert_eq!(gpu(&r).device.as_deref(), Some("gpu-4"));
    h.api.delete("gpu", &DeleteParams::default()).await.unwrap();
    eventually(60, "the residency's pods to go", || async {
        let pods = h.pods.list(&ListParams::default()).await.unwrap();
        pods.items.is_empty().then_some(())
    })
    .await;
    let c = claims(&h).get("team-gpu").await.unwrap();
    assert!(
        c.metadata.deletion_timestamp.is_none(),
        "someone else's claim was deleted"
    );
}

#[tokio::test]
#[ignore = "needs the local control plane: scripts/test.sh runs it with --include-ignored"]
async fn device_plugin_mode_requests_the_resource_from_the_scheduler() {
    let h = Harness::start("device-plugin").await;
    create(&h, "gpu", json!({"nodeName": h.node, "device": "0", "budget": "20Gi", "gpu": {"mode": "devicePlugin"}, "models": models(&["a"])})).await;
    let r = h.request("gpu", "a").await;
    assert_eq!(model(&r, "a").state, ModelState::Loaded);
    let pod = h.pods.get(&pod_name("gpu", "a")).await.unwrap();
    let c = &pod.spec.as_ref().unwrap().containers[0];
    let limits = c.resources.as_ref().unwrap().limits.as_ref().unwrap();
    assert_eq!(limits["nvidia.com/gpu"].0, "1");
    assert!(pod.spec.as_ref().unwrap().resource_claims.is_none());
    assert!(
        claims(&h)
            .list(&ListParams::default())
            .await
            .unwrap()
            .items
            .is_empty()
    );
    // The same spec in env mode: the pod is replaced by one with only the
    // variable.
    h.patch_spec("gpu", json!({"gpu": {"mode": "env"}})).await;
    h.request("gpu", "a").await;
    let pod = h.pods.get(&pod_name("gpu", "a")).await.unwrap();
    let c = &pod.spec.as_ref().unwrap().containers[0];
    assert!(
        c.resources
            .as_ref()
            .and_then(|r| r.limits.as_ref())
            .is_none()
    );
    let env = c.env.as_ref().unwrap();
    assert!(
        env.iter()
            .any(|e| e.name == "NVIDIA_VISIBLE_DEVICES" && e.value.as_deref() == Some("0"))
    );
}

/// Measured on the real resource claim controller: a claim that no pod
/// references any more is deallocated, so the device is free for another
/// claim between two loads. This is why each residency keeps a holder pod.
#[tokio::test]
#[ignore = "needs the local control plane: scripts/test.sh runs it with --include-ignored"]
async fn a_claim_without_consumers_is_deallocated_so_a_holder_keeps_it() {
    let h = Harness::start("claim-measure").await;
    claim_for_gpu(&h, "bare", 7).await;
    let pod: Pod = serde_json::from_value(json!({
        "metadata": {"name": "user"},
        "spec": {"containers": [{"name": "c", "image": "i"}],
                 "resourceClaims": [{"name": "gpu", "resourceClaimName": "bare"}]},
    }))
    .unwrap();
    h.pods.create(&PostParams::default(), &pod).await.unwrap();
    eventually(30, "the claim to be allocated", || async {
        let c = claims(&h).get("bare").await.unwrap();
        c.status?.allocation.map(|_| ())
    })
    .await;
    let started = std::time::Instant::now();
    h.pods
        .delete("user", &DeleteParams::default())
        .await
        .unwrap();
    eventually(60, "the claim to be deallocated", || async {
        let c = claims(&h).get("bare").await.unwrap();
        c.status
            .is_none_or(|s| s.allocation.is_none())
            .then_some(())
    })
    .await;
    eprintln!(
        "a claim with no consumer was deallocated {:?} after its last pod was deleted",
        started.elapsed()
    );
    // With the operator: between loads (no model resident) the holder keeps
    // the claim allocated and reserved.
    create(
        &h,
        "gpu",
        json!({"nodeName": h.node, "device": "6", "budget": "20Gi", "models": models(&["a"])}),
    )
    .await;
    until_ready(&h, "gpu", "True", "AllResidentModelsReady").await;
    let c = claims(&h).get("gpu-gpu").await.unwrap();
    let status = c.status.unwrap();
    assert!(status.allocation.is_some());
    let reserved: Vec<String> = status
        .reserved_for
        .unwrap()
        .into_iter()
        .map(|r| r.name)
        .collect();
    assert_eq!(reserved, ["gpu-gpu-holder"]);
    let holder = h.pods.get("gpu-gpu-holder").await.unwrap();
    assert_eq!(holder.metadata.labels.unwrap()[GPU_HOLDER_LABEL], "gpu");
}

#[tokio::test]
#[ignore = "needs the local control plane: scripts/test.sh runs it with --include-ignored"]
async fn a_residency_naming_anothers_claim_is_a_conflict_not_a_second_budget() {
    let h = Harness::start("claim-twice").await;
    create(
        &h,
        "first",
        json!({"nodeName": h.node, "device": "5", "budget": "16Gi", "models": models(&["a"])}),
    )
    .await;
    let r = h.request("first", "a").await;
    let claim = gpu(&r).claim.clone().expect("first's claim");
    // The black-box round: each loaded 10Gi+ of one 16Gi device.
    create(
        &h,
        "second",
        json!({"nodeName": h.node, "device": "5", "budget": "16Gi",
               "gpu": {"existingClaim": claim}, "models": models(&["b"])}),
    )
    .await;
    h.request_nowait("second", "b").await;
    let r = until_ready(&h, "second", "False", "GpuConflict").await;
    let conditions = &r.status.as_ref().unwrap().conditions;
    let holder = format!("{}/first", h.env.namespace);
    assert!(
        conditions.iter().any(|c| c.message.contains(&holder)),
        "{conditions:?}"
    );
    let (live, _) = h.pods_of("second").await;
    assert!(live.is_empty(), "a second budget on one device: {live:?}");
    // first keeps its model and its one budget.
    let r = h.api.get("first").await.unwrap();
    assert_eq!(model(&r, "a").state, ModelState::Loaded);
}

/// The black-box round's findings 1 and 2, on a control plane of the
/// test's own (an operator over every namespace): one 80Gi GPU named three
/// ways in three namespaces (by index and by uuid in env mode, by index in
/// claim mode) is one budget, held by the oldest; a ResidencySet keeps the
/// GPU it stamped first when another tenant names it afterwards, through
/// the set's next reconciles. The budget watcher charges every pod of
/// every namespace to the physical GPU (through the ResourceSlices).
#[tokio::test]
#[ignore = "needs the local control plane: scripts/test.sh runs it with --include-ignored"]
async fn one_gpu_however_named_from_any_namespace_is_one_budget() {
    use crate::support::operator::PhysicalBudgetWatcher;
    use model_residency::api::{ModelCatalog, ResidencySet};
    use model_residency::local::control_plane::ControlPlane;
    use model_residency::local::kubelet::{FakeKubelet, KubeletConfig};
    let plane = ControlPlane::start().expect("a control plane of the test's own");
    let client = plane.client().await.unwrap();
    model_residency::local::install_crd(&client).await.unwrap();
    for ns in ["t1", "t2", "t3", "tenant-a", "tenant-b"] {
        crate::support::cluster::create_namespace(&client, ns).await;
    }
    let mut config = KubeletConfig::instant(&["node-f", "node-e"]);
    config.nodes[0].gpus = 3;
    config.nodes[1].gpus = 5;
    let _kubelet = FakeKubelet::start(client.clone(), config).await.unwrap();
    let watcher = PhysicalBudgetWatcher::start(client.clone());
    let _operator = tokio::spawn(model_residency::operator::run(
        model_residency::controller::Context::new(client.clone()),
        None,
        std::future::pending(),
        Default::default(),
    ));
    let api = |ns: &str| Api::<ModelResidency>::namespaced(client.clone(), ns);
    // A request for m50 on residency `name` of `ns`, as a router writes one.
    let request = |ns: &str, name: &str| {
        let (api, name) = (api(ns), name.to_owned());
        async move {
            let now = k8s_openapi::jiff::Timestamp::now().to_string();
            let demand = json!({"spec": {"demand": {"m50": now}}});
            api.patch(&name, &PatchParams::default(), &Patch::Merge(&demand))
                .await
                .unwrap();
        }
    };
    let m50 = json!([{"name": "m50", "size": "50Gi", "template": {"spec": {
        "containers": [{"name": "server", "image": "example/m50:1"}]}}}]);
    let residency = |name: &str, device: &str, mode: &str| -> ModelResidency {
        serde_json::from_value(json!({
            "apiVersion": "residency.dev/v1alpha1", "kind": "ModelResidency",
            "metadata": {"name": name},
            "spec": {"nodeName": "node-f", "device": device, "budget": "72Gi",
                     "gpu": {"mode": mode}, "models": m50}}))
        .unwrap()
    };
    let uuid = fake_gpu_uuid("node-f", 2);
    let made = [
        ("t1", "by-index", "2", "env"),
        ("t2", "by-uuid", uuid.as_str(), "env"),
        ("t3", "by-claim", "2", "claim"),
    ];
    for (ns, name, device, mode) in made {
        api(ns)
            .create(&PostParams::default(), &residency(name, device, mode))
            .await
            .unwrap();
        // Creation times a second apart: the oldest is by-index.
        tokio::time::sleep(Duration::from_millis(1100)).await;
    }
    for (ns, name, _, _) in made {
        request(ns, name).await;
    }
    let ready = |ns: &str, name: &'static str, status: &'static str, reason: &'static str| {
        let api = api(ns);
        async move { until_ready_in(&api, name, status, reason).await }
    };
    let r = ready("t1", "by-index", "True", "AllResidentModelsReady").await;
    assert_eq!(r.model_state("m50"), ModelState::Loaded);
    for (ns, name) in [("t2", "by-uuid"), ("t3", "by-claim")] {
        let r = ready(ns, name, "False", "GpuConflict").await;
        let ready = condition(&r, "Ready");
        assert!(ready.message.contains("t1/by-index"), "{}", ready.message);
        assert_ne!(r.model_state("m50"), ModelState::Loaded);
    }
    // Finding 5: `m50` is listed in three namespaces; it is t1's (listed
    // first), and each residency's NameShadowed says so.
    let shadowed = |ns: &str, name: &'static str, status: &'static str, owner: &'static str| {
        let api = api(ns);
        async move {
            let what = format!("NameShadowed={status} naming {owner}");
            until_condition(&api, name, "NameShadowed", &what, |c| {
                c.status == status && c.message.contains(owner)
            })
            .await
        }
    };
    shadowed("t2", "by-uuid", "True", "m50 (listed first by t1/by-index)").await;
    shadowed(
        "t3",
        "by-claim",
        "True",
        "m50 (listed first by t1/by-index)",
    )
    .await;
    shadowed(
        "t1",
        "by-index",
        "False",
        "m50 (also listed by t2/by-uuid, t3/by-claim)",
    )
    .await;
    // The oldest goes: the next oldest (by uuid) takes the GPU, the claim
    // still waits.
    api("t1")
        .delete("by-index", &DeleteParams::default())
        .await
        .unwrap();
    request("t2", "by-uuid").await;
    eventually(60, "by-uuid loads m50", || async {
        let r = api("t2").get("by-uuid").await.ok()?;
        (r.model_state("m50") == ModelState::Loaded).then_some(())
    })
    .await;
    let r = ready("t3", "by-claim", "False", "GpuConflict").await;
    assert!(condition(&r, "Ready").message.contains("t2/by-uuid"));
    // The name is t2's now.
    shadowed("t3", "by-claim", "True", "m50 (listed first by t2/by-uuid)").await;
    shadowed("t2", "by-uuid", "False", "m50 (also listed by t3/by-claim)").await;

    // Finding 2: tenant A's set stamps node-e's GPU 4 and loads a model
    // there; tenant B names that GPU afterwards.
    let catalog: ModelCatalog = serde_json::from_value(json!({
        "apiVersion": "residency.dev/v1alpha1", "kind": "ModelCatalog",
        "metadata": {"name": "models"}, "spec": {"models": m50}}))
    .unwrap();
    Api::<ModelCatalog>::namespaced(client.clone(), "tenant-a")
        .create(&PostParams::default(), &catalog)
        .await
        .unwrap();
    let set: ResidencySet = serde_json::from_value(json!({
        "apiVersion": "residency.dev/v1alpha1", "kind": "ResidencySet",
        "metadata": {"name": "fleet"},
        "spec": {"devices": {"nodeSelector": {"kubernetes.io/hostname": "node-e"},
                "selectors": [{"cel": {"expression": "device.attributes['gpu.nvidia.com'].index == 4"}}]},
            "catalog": {"name": "models"}, "residency": {"budget": "72Gi"}}}))
    .unwrap();
    let sets = Api::<ResidencySet>::namespaced(client.clone(), "tenant-a");
    sets.create(&PostParams::default(), &set).await.unwrap();
    let stamp = eventually(60, "the set's stamp", || async {
        let all = api("tenant-a").list(&Default::default()).await.ok()?;
        all.items.into_iter().next()
    })
    .await;
    let stamp = stamp.metadata.name.unwrap();
    request("tenant-a", &stamp).await;
    eventually(60, "the stamp loads m50", || async {
        let r = api("tenant-a").get(&stamp).await.ok()?;
        (r.model_state("m50") == ModelState::Loaded).then_some(())
    })
    .await;
    let mut theirs = residency("mine", "4", "claim");
    theirs.spec.node_name = Some("node-e".into());
    api("tenant-b")
        .create(&PostParams::default(), &theirs)
        .await
        .unwrap();
    request("tenant-b", "mine").await;
    // The set's next reconciles (a label edit wakes it; so would a slice
    // update or a restart).
    for i in 0..3 {
        let label = json!({"metadata": {"labels": {"poke": i.to_string()}}});
        sets.patch("fleet", &PatchParams::default(), &Patch::Merge(&label))
            .await
            .unwrap();
        tokio::time::sleep(Duration::from_secs(2)).await;
    }
    let r = api("tenant-a").get(&stamp).await.unwrap();
    assert_eq!(
        r.model_state("m50"),
        ModelState::Loaded,
        "the set kept its GPU"
    );
    assert!(!kube::ResourceExt::labels(&r).contains_key("residency.dev/draining"));
    let theirs = api("tenant-b").get("mine").await.unwrap();
    assert_ne!(theirs.model_state("m50"), ModelState::Loaded);
    let seen = *watcher.events.lock().unwrap();
    assert!(
        seen.0 > 5 && seen.1 >= 50 << 30,
        "the watcher saw the loads: {seen:?}"
    );
    assert_eq!(*watcher.violations.lock().unwrap(), Vec::<String>::new());
    assert!(watcher.unmapped.lock().unwrap().is_empty());
}

/// A restarted operator (a new leader) decides nothing before it has
/// listed the claims and devices: it once found no claim in its empty
/// cache, made it again (a conflict), and unloaded every model as if the
/// GPU were new.
#[tokio::test]
#[ignore = "needs the local control plane (scripts/control-plane.sh)"]
async fn a_restarted_operator_unloads_nothing_in_claim_mode() {
    let mut h = Harness::start("claim-restart").await;
    h.create(
        "gpu",
        "10Gi",
        &[
            ("a", "2Gi", false),
            ("b", "2Gi", false),
            ("c", "2Gi", false),
        ],
    )
    .await;
    h.request("gpu", "a").await;
    h.request("gpu", "b").await;
    for round in 0..10 {
        h.stop_operator().await;
        h.start_operator();
        // A request the new operator processes: it has reconciled.
        let r = h.request("gpu", "c").await;
        let status = r.status.as_ref().unwrap();
        for m in ["a", "b", "c"] {
            assert_eq!(
                status.model(m).unwrap().state,
                ModelState::Loaded,
                "round {round}: {m}: {:#?}",
                h.events_of("gpu").await
            );
        }
        assert_eq!(status.counters.unloads, 0, "round {round}");
    }
}
