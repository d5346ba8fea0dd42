//! The two objects claim mode makes per residency (pure): its
//! ResourceClaim, and the GPU holder pod that keeps the claim allocated
//! while no model pod uses it.

use crate::api::ModelResidency;
use crate::controller::pods::require_node;
use crate::residency::gpu::{CLAIM_REQUEST, claim_name, device_selector, holder_name};
use crate::residency::labels::{CLAIM_DEVICE_ANNOTATION, GPU_HOLDER_LABEL, RESIDENCY_LABEL};
use k8s_openapi::api::core::v1::{Pod, PodSpec, PodTemplateSpec};
use k8s_openapi::api::resource::v1::ResourceClaim;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::OwnerReference;
use serde_json::json;

use super::inventory::NVIDIA_DRIVER;

/// The image of the GPU holder pod by default: the pause container, which
/// does nothing and takes a few hundred kilobytes of memory.
pub const DEFAULT_HOLDER_IMAGE: &str = "registry.k8s.io/pause:3.10";

/// What a claim of residency `r` must select, recorded on the claim: its
/// DeviceClass, spec.device and the node it must be on (`*`: any). A claim
/// that says otherwise was made for an older spec and is replaced.
pub fn wanted(r: &ModelResidency) -> String {
    let spec = &r.spec;
    format!(
        "{}/{}@{}",
        spec.gpu.device_class(&spec.device),
        spec.device,
        spec.node_name.as_deref().unwrap_or("*")
    )
}

/// The ResourceClaim of residency `r`: one request for exactly one device
/// of the class, selected by spec.device, owned by the residency (deleted
/// with it, after its pods: the scheduler's finalizer keeps an allocated
/// claim until no pod uses it).
pub fn build_claim(r: &ModelResidency, owner: &OwnerReference) -> ResourceClaim {
    let name = r.metadata.name.clone().unwrap_or_default();
    let spec = &r.spec;
    let class = spec.gpu.device_class(&spec.device);
    serde_json::from_value(json!({
        "apiVersion": "resource.k8s.io/v1", "kind": "ResourceClaim",
        "metadata": {
            "name": claim_name(&name),
            "namespace": r.metadata.namespace,
            "labels": {RESIDENCY_LABEL: name},
            "annotations": {CLAIM_DEVICE_ANNOTATION: wanted(r)},
            "ownerReferences": [owner],
        },
        "spec": {"devices": {"requests": [{
            "name": CLAIM_REQUEST,
            "exactly": {
                "deviceClassName": class,
                "allocationMode": "ExactCount",
                "count": 1,
                "selectors": [{"cel": {"expression": device_selector(NVIDIA_DRIVER, &spec.device)}}],
            },
        }]}},
    }))
    .expect("a ResourceClaim")
}

/// The GPU holder pod of residency `r`: it references the claim, so the
/// scheduler allocates it (to the node the pod lands on) and it stays
/// allocated while no model pod runs; the resource claim controller frees
/// a claim that no pod references. It goes where the model pods may go:
/// spec.nodeName when set, and the first model template's tolerations,
/// node selector, node affinity and priority class. It requests almost
/// nothing and uses no container of the claim (a pod-level reference is
/// enough to reserve it).
pub fn build_holder(r: &ModelResidency, owner: &OwnerReference, image: &str, claim: &str) -> Pod {
    let name = r.metadata.name.clone().unwrap_or_default();
    let template: Option<PodTemplateSpec> = r
        .spec
        .models
        .iter()
        .filter_map(|m| m.template.as_ref())
        .find_map(|t| serde_json::from_str(t.json()).ok());
    let from = template.and_then(|t| t.spec).unwrap_or_default();
    let mut spec: PodSpec = serde_json::from_value(json!({
        "containers": [{
            "name": "holder", "image": image,
            "resources": {"requests": {"cpu": "1m", "memory": "8Mi"}, "limits": {"memory": "32Mi"}},
        }],
        "resourceClaims": [{"name": CLAIM_REQUEST, "resourceClaimName": claim}],
        "terminationGracePeriodSeconds": 0,
        "automountServiceAccountToken": false,
    }))
    .expect("a pod spec");
    spec.tolerations = from.tolerations;
    spec.node_selector = from.node_selector;
    spec.priority_class_name = from.priority_class_name;
    if let Some(node_affinity) = from.affinity.and_then(|a| a.node_affinity) {
        spec.affinity = Some(k8s_openapi::api::core::v1::Affinity {
            node_affinity: Some(node_affinity),
            ..Default::default()
        });
    }
    if let Some(node) = &r.spec.node_name {
        require_node(&mut spec, node);
    }
    let mut pod: Pod = serde_json::from_value(json!({
        "metadata": {
            "name": holder_name(&name),
            "namespace": r.metadata.namespace,
            "labels": {GPU_HOLDER_LABEL: name},
            "ownerReferences": [owner],
        },
    }))
    .expect("pod metadata");
    pod.spec = Some(spec);
    pod
}

#[cfg(test)]
mod tests {
    use super::*;

    fn residency(spec: serde_json::Value) -> ModelResidency {
        let mut r = ModelResidency::new("gpu", serde_json::from_value(spec).unwrap());
        r.metadata.namespace = Some("ns".into());
        r
    }

    fn owner() -> OwnerReference {
        OwnerReference {
            api_version: "residency.dev/v1alpha1".into(),
            kind: "ModelResidency".into(),
            name: "gpu".into(),
            uid: "u".into(),
            controller: Some(true),
            block_owner_deletion: Some(true),
        }
    }

    #[test]
    fn the_claim_asks_for_exactly_the_declared_device() {
        let r = residency(json!({"device": "GPU-ab", "models": []}));
        let c = build_claim(&r, &owner());
        assert_eq!(c.metadata.name.as_deref(), Some("gpu-gpu"));
        let req = &c.spec.devices.as_ref().unwrap().requests.as_ref().unwrap()[0];
        let exactly = req.exactly.as_ref().unwrap();
        assert_eq!(exactly.device_class_name, "gpu.nvidia.com");
        assert_eq!(exactly.count, Some(1));
        let cel = &exactly.selectors.as_ref().unwrap()[0]
            .cel
            .as_ref()
            .unwrap()
            .expression;
        assert_eq!(cel, "device.attributes['gpu.nvidia.com'].uuid == 'GPU-ab'");
        assert_eq!(wanted(&r), "gpu.nvidia.com/GPU-ab@*");
        let mig = residency(json!({"device": "MIG-x", "nodeName": "n", "models": []}));
        assert_eq!(wanted(&mig), "mig.nvidia.com/MIG-x@n");
    }

    #[test]
    fn the_holder_goes_where_model_pods_may_go() {
        let r = residency(json!({"device": "0", "nodeName": "node-a", "models": [{
            "name": "m", "size": "1Gi", "template": {"spec": {
                "tolerations": [{"key": "nvidia.com/gpu", "operator": "Exists"}],
                "containers": [{"name": "s", "image": "i"}]}}}]}));
        let pod = build_holder(&r, &owner(), DEFAULT_HOLDER_IMAGE, "gpu-gpu");
        assert_eq!(pod.metadata.name.as_deref(), Some("gpu-gpu-holder"));
        let spec = pod.spec.unwrap();
        assert_eq!(
            spec.tolerations.unwrap()[0].key.as_deref(),
            Some("nvidia.com/gpu")
        );
        let claims = spec.resource_claims.unwrap();
        assert_eq!(claims[0].resource_claim_name.as_deref(), Some("gpu-gpu"));
        let terms = spec
            .affinity
            .unwrap()
            .node_affinity
            .unwrap()
            .required_during_scheduling_ignored_during_execution
            .unwrap()
            .node_selector_terms;
        let fields = terms[0].match_fields.as_ref().unwrap();
        assert_eq!(fields[0].values.as_ref().unwrap(), &["node-a".to_owned()]);
        assert!(
            spec.containers[0]
                .resources
                .as_ref()
                .unwrap()
                .claims
                .is_none()
        );
    }
}
