//! A gang on the real node: four GPUs from the fake DRA plugin, a
//! residency's claim on each, and a TP-2 model whose one pod references
//! two members' claims: the container gets both devices through CDI (the
//! plugin's per-device variables, which add up over a pod's claims) and
//! the gang's own environment, while single-GPU models load and are
//! evicted around it in real containers, the budget watcher charging the
//! gang's pod to both GPUs.

use super::{container_of, inside, uuids_on_node};
use crate::support::cluster::eventually;
use crate::support::lane::real_harness;
use k8s_openapi::api::core::v1::Pod;
use model_residency::api::ModelState;
use model_residency::residency::gangs::placements;
use serde_json::json;

const GPUS: [&str; 4] = ["gang-0", "gang-1", "gang-2", "gang-3"];

#[tokio::test]
#[ignore = "needs the real node's lane (scripts/test.sh runs it)"]
async fn a_gangs_pod_gets_both_gpus_through_cdi_and_singles_load_and_leave_around_it() {
    let h = real_harness("real-node-gang", 4).await;
    let model = |n: &str, gpus: u8| json!({"name": n, "size": if gpus > 1 { "30Gi" } else { "20Gi" }, "gpus": gpus, "template": (h.template)(n)});
    let models = json!([model("a", 1), model("b", 1), model("tp", 2)]);
    for gpu in GPUS {
        h.create(gpu, "40Gi", &[]).await;
        h.patch_spec(gpu, json!({ "models": models })).await;
    }
    let budgets = GPUS.iter().map(|g| (g.to_string(), 40u64 << 30)).collect();
    let watcher = h.budget_watcher(budgets);
    // A single on every GPU, oldest first on gang-0 and gang-1.
    for (gpu, m) in [
        ("gang-0", "a"),
        ("gang-1", "b"),
        ("gang-2", "a"),
        ("gang-3", "b"),
    ] {
        h.request(gpu, m).await;
    }
    // The gang needs two GPUs that all evict: the two used longest ago.
    h.request_nowait("gang-0", "tp").await;
    let r0 = h.until_state("gang-0", "tp", ModelState::Loaded, 120).await;
    let r1 = h.until_state("gang-1", "tp", ModelState::Loaded, 120).await;
    assert_eq!(placements(&r0)["tp"].names(), "gang-0,gang-1");
    assert_eq!(model_state(&r0, "a"), ModelState::Evicted);
    assert_eq!(model_state(&r1, "b"), ModelState::Evicted);
    let pod_name = r0
        .status
        .as_ref()
        .unwrap()
        .model("tp")
        .unwrap()
        .pod
        .clone()
        .unwrap();
    let pod: Pod = eventually(60, "the gang's pod Running", || async {
        let p = h.pods.get_opt(&pod_name).await.ok()??;
        (container_of(&p).2 == "Running").then_some(p)
    })
    .await;
    assert!(container_of(&pod).0.starts_with("containerd://"));

    // Inside its container: both members' devices, as the plugin prepared
    // them for their two claims, and the gang's own environment.
    let devices: Vec<String> = [&r0, &r1]
        .iter()
        .map(|r| {
            r.status
                .as_ref()
                .unwrap()
                .gpu
                .as_ref()
                .unwrap()
                .device
                .clone()
                .unwrap()
        })
        .collect();
    let uuids = uuids_on_node(&h.env.client).await;
    let seen = inside(&pod, "/fake/container").await;
    let env = &seen["env"];
    for device in &devices {
        let var = format!(
            "FAKE_GPU_DEVICE_{}",
            device.to_uppercase().replace('-', "_")
        );
        assert_eq!(
            env[&var].as_str(),
            Some(uuids[device].as_str()),
            "{var}: the CDI edits of {device}'s claim in the container: {seen}"
        );
    }
    assert_eq!(env["RESIDENCY_GANG_SIZE"], "2", "{seen}");
    assert_eq!(
        env["RESIDENCY_GANG_DEVICES"],
        devices.join(",").as_str(),
        "{seen}"
    );

    // A single asked for on gang-1 evicts the gang there: it leaves
    // gang-0 too, and its container goes.
    h.request_nowait("gang-1", "a").await;
    h.until_state("gang-1", "a", ModelState::Loaded, 120).await;
    h.until_state("gang-0", "tp", ModelState::Unloaded, 60)
        .await;
    eventually(60, "the gang's pod to be gone from the node", || async {
        h.pods
            .get_opt(&pod_name)
            .await
            .ok()?
            .is_none()
            .then_some(())
    })
    .await;
    let violations = watcher.violations.lock().unwrap().clone();
    assert!(violations.is_empty(), "over budget: {violations:?}");
}

fn model_state(r: &model_residency::api::ModelResidency, m: &str) -> ModelState {
    r.status.as_ref().unwrap().model(m).unwrap().state
}
