//! The names on a residency's objects that every process agrees on: label
//! and annotation keys of model pods, the field managers that write them,
//! and the port a model pod serves on.

use crate::api::ModelResidency;
use k8s_openapi::api::core::v1::Pod;

/// The operator's field manager (status writes, ModelDemand keys) and the
/// controller name its events report.
pub const MANAGER: &str = "model-residency";
/// The node agent's field manager (its `NodeModelCache`).
pub const NODE_AGENT_MANAGER: &str = "model-residency-node-agent";

/// The port a model pod serves on when its first container declares none
/// (the kubelet stand-in's fake servers listen there too).
pub const DEFAULT_MODEL_PORT: u16 = 8080;

/// The port a model pod serves on: its first container's first
/// `containerPort`, else [`DEFAULT_MODEL_PORT`].
pub fn serving_port(pod: &Pod) -> u16 {
    pod.spec
        .iter()
        .flat_map(|s| s.containers.first())
        .flat_map(|c| c.ports.iter().flatten())
        .map(|p| p.container_port)
        .next()
        .and_then(|p| u16::try_from(p).ok())
        .unwrap_or(DEFAULT_MODEL_PORT)
}

/// Label on a residency a ResidencySet stamped: the set's name.
pub const SET_LABEL: &str = "residency.dev/set";
/// Label on a stamped residency being drained (its device is gone).
pub const SET_DRAINING_LABEL: &str = "residency.dev/set-draining";
/// Annotation on a stamped residency: its device as the slice names it,
/// `<node>/<device>` (for people: the name may be shortened with a hash).
pub const SET_DEVICE_ANNOTATION: &str = "residency.dev/set-device";

/// The set a residency was stamped by: its [`SET_LABEL`]. The operator's
/// cache keeps an empty labels map (which allocates nothing, where one
/// label takes a B-tree node of about 540 bytes) for a residency whose
/// only label is that one naming its controlling set (`controller::cached`);
/// the API server never sends an empty map, so an empty one means the
/// controlling ResidencySet's name.
pub fn set_label(r: &ModelResidency) -> Option<&str> {
    match &r.metadata.labels {
        Some(labels) if labels.is_empty() => set_owner(r),
        Some(labels) => labels.get(SET_LABEL).map(String::as_str),
        None => None,
    }
}

/// The name of the ResidencySet that controls `r`, if one does.
pub fn set_owner(r: &ModelResidency) -> Option<&str> {
    r.metadata
        .owner_references
        .iter()
        .flatten()
        .find(|o| o.controller == Some(true) && o.kind == "ResidencySet")
        .map(|o| o.name.as_str())
}

/// Label on a model pod: the model it serves.
pub const MODEL_LABEL: &str = "residency.dev/model";
/// Label on a model pod: a copy being removed (set by the operator's copy
/// scaler); routers stop choosing it, its requests in flight finish, then
/// it is retired ([`RETIRE_ANNOTATION`]).
pub const DRAINING_LABEL: &str = "residency.dev/draining";
/// Annotation on a draining model pod: the time (RFC 3339) after which the
/// copy scaler wants the copy off its GPU. The residency then puts it to
/// sleep when it can, else unloads it, unless the model was requested there
/// after that time. Its demand key stays, as an evicted model's does.
pub const RETIRE_ANNOTATION: &str = "residency.dev/retire-at";
/// Annotation on a model pod whose model has LoRA adapters: the adapters
/// its server said it holds when last asked (`GET /v1/models`, its
/// entries whose parent is the model), comma-separated in the server's
/// order. Written by the operator's audit; a replaced pod starts without
/// it, as its server starts without adapters.
pub const ADAPTERS_ANNOTATION: &str = "residency.dev/adapters";
/// Annotation on a model pod started without some of its model's adapters
/// (their files failed on the node: a sha256 mismatch, the disk budget):
/// a JSON object of adapter name to the node's words. The router refuses
/// those adapters in that pod, unsent.
pub const ADAPTERS_REFUSED_ANNOTATION: &str = "residency.dev/adapters-refused";
/// Label on a model pod: `true` while it serves (Ready, awake, not
/// draining), set and cleared by the operator with `--inference-pools`:
/// the model's InferencePool selects it.
pub const SERVING_LABEL: &str = "residency.dev/serving";
/// Label on an InferencePool the operator keeps: the model it is for.
pub const POOL_MODEL_LABEL: &str = "residency.dev/pool-model";
/// Label on a model pod: the ModelResidency that owns it.
pub const RESIDENCY_LABEL: &str = "residency.dev/residency";
/// Annotation on a model pod: the model's declared VRAM size in bytes.
pub const SIZE_ANNOTATION: &str = "residency.dev/size";
/// Annotation on a model pod: the GPU it was given.
pub const DEVICE_ANNOTATION: &str = "residency.dev/device";
/// Annotation on a model pod: the node it is kept to (by node affinity),
/// so a pod the scheduler has not bound yet is known to be for that node.
pub const NODE_ANNOTATION: &str = "residency.dev/node";
/// Annotation on a model pod: how it was given the GPU (`env`,
/// `devicePlugin:<resource>`, `claim:<claim>`), so a pod made for another
/// way is replaced.
pub const GPU_ACCESS_ANNOTATION: &str = "residency.dev/gpu-access";
/// Label on a GPU holder pod (claim mode): the residency whose claim it
/// keeps allocated. Not the residency label: it is no model pod.
pub const GPU_HOLDER_LABEL: &str = "residency.dev/gpu-holder";
/// Annotation on a claim the operator made: spec.device and the
/// DeviceClass it selects, so a changed spec replaces the claim (a claim's
/// spec cannot change).
pub const CLAIM_DEVICE_ANNOTATION: &str = "residency.dev/claim-device";
/// Annotation on a model pod: a hash of the template it was built from, so
/// a changed template is seen and rolled out.
pub const TEMPLATE_HASH_ANNOTATION: &str = "residency.dev/template-hash";

/// The longest a label value may be. A residency's name is a label value
/// on its pods, so it is held to this too.
pub const LABEL_VALUE_MAX: usize = 63;

/// Lowercase letters, digits and '-', starting and ending with a letter or
/// digit: one part of a DNS-1123 name, of any length.
fn dns_part(s: &str) -> bool {
    let b = s.as_bytes();
    let inner = |c: &u8| c.is_ascii_lowercase() || c.is_ascii_digit();
    !b.is_empty()
        && inner(&b[0])
        && inner(&b[b.len() - 1])
        && b.iter().all(|c| inner(c) || *c == b'-')
}

/// Whether `s` is a DNS-1123 label, as model names are.
pub fn is_dns_label(s: &str) -> bool {
    s.len() <= 63 && dns_part(s)
}

/// Whether `s` is a DNS-1123 subdomain, as a pod's `spec.nodeName` must be.
pub fn is_dns_subdomain(s: &str) -> bool {
    s.len() <= 253 && s.split('.').all(dns_part)
}

/// Whether `s` is short enough to be a label value.
pub fn fits_label_value(s: &str) -> bool {
    s.len() <= LABEL_VALUE_MAX
}
