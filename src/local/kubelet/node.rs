//! The stand-in's node and its GPUs: the Node object it registers, the
//! DeviceClass and the ResourceSlice it publishes (as the NVIDIA DRA
//! driver would), and whether a pod's claims are ready for it.

use super::*;

pub(super) async fn register_node(nodes: &Api<Node>, node: &FakeNode) -> Result<(), kube::Error> {
    let now = kube_time_now();
    let capacity = json!({
        "cpu": "16", "memory": "64Gi", "pods": "110", "nvidia.com/gpu": node.gpus.to_string(),
    });
    let body = json!({
        "apiVersion": "v1", "kind": "Node",
        "metadata": {"name": node.name, "labels": {
            "kubernetes.io/hostname": node.name, FAKE_NODE_LABEL: "true",
        }},
    });
    let pp = PatchParams::apply(MANAGER).force();
    nodes.patch(&node.name, &pp, &Patch::Apply(&body)).await?;
    let status = json!({
        "apiVersion": "v1", "kind": "Node",
        "status": {
            "capacity": capacity, "allocatable": capacity,
            "conditions": [{
                "type": "Ready", "status": "True", "reason": "KubeletReady",
                "message": "kubelet stand-in (no containers run)",
                "lastHeartbeatTime": now, "lastTransitionTime": now,
            }],
        },
    });
    nodes
        .patch_status(&node.name, &pp, &Patch::Apply(&status))
        .await?;
    // The API server taints a new node not-ready (NoSchedule); the node
    // lifecycle controller takes the taint off once the node reports
    // Ready. That controller is not run here (without kubelet heartbeats it
    // would declare every node unreachable), so the stand-in does its part.
    let registered = nodes.get(&node.name).await?;
    let taints = registered.spec.and_then(|s| s.taints).unwrap_or_default();
    if taints.iter().any(|t| t.key == NOT_READY_TAINT) {
        let kept: Vec<_> = taints
            .into_iter()
            .filter(|t| t.key != NOT_READY_TAINT)
            .collect();
        let patch = json!({"spec": {"taints": kept}});
        nodes
            .patch(&node.name, &PatchParams::default(), &Patch::Merge(&patch))
            .await?;
    }
    Ok(())
}

/// The DeviceClass of the NVIDIA DRA driver's chart, when it is missing
/// (left alone when present: a test may share the control plane).
pub async fn install_device_class(client: &kube::Client) -> Result<(), kube::Error> {
    use k8s_openapi::api::resource::v1::DeviceClass;
    let classes: Api<DeviceClass> = Api::all(client.clone());
    let class: DeviceClass = serde_json::from_value(json!({
        "apiVersion": "resource.k8s.io/v1", "kind": "DeviceClass",
        "metadata": {"name": GPU_DRIVER},
        "spec": {"selectors": [{"cel": {"expression":
            "device.driver == 'gpu.nvidia.com' && device.attributes['gpu.nvidia.com'].type == 'gpu'"}}]},
    }))
    .expect("a DeviceClass");
    match classes
        .create(&kube::api::PostParams::default(), &class)
        .await
    {
        Ok(_) => Ok(()),
        Err(kube::Error::Api(s)) if s.code == 409 => Ok(()),
        Err(e) => Err(e),
    }
}

use crate::controller::gpu::inventory::PCIE_ROOT_ATTRIBUTE;

/// The driver the stand-in plays.
pub const GPU_DRIVER: &str = "gpu.nvidia.com";

/// The name of fake node `node`'s ResourceSlice.
pub fn slice_name(node: &str) -> String {
    format!("{node}-{GPU_DRIVER}")
}

/// Publishes the node's GPUs as the NVIDIA DRA driver does.
pub(super) async fn publish_gpus(
    client: &kube::Client,
    node: &FakeNode,
) -> Result<(), kube::Error> {
    use k8s_openapi::api::resource::v1::ResourceSlice;
    let slices: Api<ResourceSlice> = Api::all(client.clone());
    let devices: Vec<_> = (0..node.gpus)
        .map(|i| {
            let mut device = json!({
                "name": format!("gpu-{i}"),
                "attributes": {
                    "type": {"string": "gpu"},
                    "index": {"int": i},
                    "minor": {"int": i},
                    "uuid": {"string": fake_gpu_uuid(&node.name, i)},
                    "productName": {"string": FAKE_PRODUCT},
                },
                "capacity": {"memory": {"value": node.gpu_memory.to_string()}},
            });
            if let Some(k) = node.gpus_per_pcie_root.filter(|&k| k > 0) {
                device["attributes"][PCIE_ROOT_ATTRIBUTE] =
                    json!({"string": format!("pci0000:{:02x}", i / k)});
            }
            device
        })
        .collect();
    let body = json!({
        "apiVersion": "resource.k8s.io/v1", "kind": "ResourceSlice",
        "metadata": {"name": slice_name(&node.name)},
        "spec": {
            "driver": GPU_DRIVER, "nodeName": node.name,
            "pool": {"name": node.name, "generation": 1, "resourceSliceCount": 1},
            "devices": devices,
        },
    });
    let pp = PatchParams::apply(MANAGER).force();
    slices
        .patch(&slice_name(&node.name), &pp, &Patch::Apply(&body))
        .await?;
    Ok(())
}

/// Sets the taints of fake node `node`'s GPU `gpu-<index>` (DRA device
/// taints, as a driver publishes them for a failing GPU or an admin for
/// maintenance): `taints` as the API takes them (`key`, `value`,
/// `effect`); empty removes them. The devices are an atomic list, so the
/// slice is read and replaced whole.
pub async fn set_gpu_taints(
    client: &kube::Client,
    node: &str,
    index: u32,
    taints: serde_json::Value,
) -> Result<(), kube::Error> {
    use k8s_openapi::api::resource::v1::{DeviceTaint, ResourceSlice};
    let slices: Api<ResourceSlice> = Api::all(client.clone());
    let mut slice = slices.get(&slice_name(node)).await?;
    let name = format!("gpu-{index}");
    let taints: Vec<DeviceTaint> =
        serde_json::from_value(taints).map_err(kube::Error::SerdeError)?;
    for d in slice.spec.devices.iter_mut().flatten() {
        if d.name == name {
            d.taints = (!taints.is_empty()).then(|| taints.clone());
        }
    }
    slices
        .replace(&slice_name(node), &Default::default(), &slice)
        .await?;
    Ok(())
}

/// Whether every claim `pod` references is allocated and reserved for it;
/// `Err` names the first that is not.
pub(super) async fn claims_ready(client: &kube::Client, pod: &Pod) -> Result<(), String> {
    use k8s_openapi::api::resource::v1::ResourceClaim;
    let ns = pod.metadata.namespace.as_deref().unwrap_or_default();
    let claims: Api<ResourceClaim> = Api::namespaced(client.clone(), ns);
    let uid = pod.metadata.uid.as_deref().unwrap_or_default();
    let referenced = pod
        .spec
        .iter()
        .flat_map(|s| s.resource_claims.iter().flatten())
        .filter_map(|c| c.resource_claim_name.as_deref());
    for name in referenced {
        let claim = claims.get_opt(name).await.map_err(|e| e.to_string())?;
        let status = claim.as_ref().and_then(|c| c.status.as_ref());
        let allocated = status.is_some_and(|s| s.allocation.is_some());
        let reserved = status
            .and_then(|s| s.reserved_for.as_ref())
            .is_some_and(|r| r.iter().any(|c| c.uid == uid));
        if !(allocated && reserved) {
            return Err(format!(
                "claim {name} is not allocated and reserved for the pod"
            ));
        }
    }
    Ok(())
}
