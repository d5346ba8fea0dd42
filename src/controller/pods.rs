//! Model pods: building one from a model's template (pure), and reading back
//! what the reconciler needs from the pods it owns.

use crate::api::{LoraSpec, ModelResidency, ModelSpec};
use crate::engine::Bytes;
use crate::residency::gangs::{
    GANG_DEVICES_ENV, GANG_MEMBERS_ANNOTATION, GANG_SIZE_ENV, GangPlacement,
};
use crate::residency::gpu::{Access, CLAIM_REQUEST, Placement};
use crate::residency::labels::{
    DEVICE_ANNOTATION, GPU_ACCESS_ANNOTATION, MODEL_LABEL, NODE_ANNOTATION, RESIDENCY_LABEL,
    SIZE_ANNOTATION, TEMPLATE_HASH_ANNOTATION,
};
use k8s_openapi::api::core::v1::{
    Affinity, Container, EnvVar, NodeAffinity, NodeSelector, NodeSelectorRequirement,
    NodeSelectorTerm, Pod, PodResourceClaim, PodSpec, PodTemplateSpec, ResourceClaim,
};
use k8s_openapi::apimachinery::pkg::api::resource::Quantity;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::OwnerReference;

/// The environment variable that tells a model server which GPU to use.
pub const DEVICE_ENV: &str = "NVIDIA_VISIBLE_DEVICES";

/// The pod name for a model: `<residency>-<model>-<hash>`. The hash (of the
/// pair) keeps names unique per (residency, model): without it residency
/// `gpu` with model `a-b` and residency `gpu-a` with model `b` would both
/// want `gpu-a-b`.
pub fn pod_name(residency: &str, model: &str) -> String {
    let pair = fnv1a([residency.as_bytes(), b"/", model.as_bytes()]);
    format!("{residency}-{model}-{:05x}", pair & 0xf_ffff)
}

/// A template's hash, recorded on its pods as 16 hex digits. The template
/// is kept as canonical JSON (sorted keys), so equal templates hash equal.
pub fn template_hash(template: &str) -> u64 {
    fnv1a([template.as_bytes()])
}

/// FNV-1a, 64 bits: stable across builds and platforms (unlike std's
/// hasher), which names and recorded hashes need.
fn fnv1a<'a>(parts: impl IntoIterator<Item = &'a [u8]>) -> u64 {
    let mut h: u64 = 0xcbf2_9ce4_8422_2325;
    for b in parts.into_iter().flatten() {
        h = (h ^ u64::from(*b)).wrapping_mul(0x0100_0000_01b3);
    }
    h
}

/// Where a model pod stands, as far as VRAM is concerned.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum PodPhase {
    /// Exists and may hold VRAM: pending, running or unknown.
    Live,
    /// Terminated: `Failed`, or `Succeeded` (a model server should not
    /// exit, so that is a failure too). Holds no VRAM.
    Finished,
}

/// What the reconciler needs to know about one of its model pods.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ModelPod {
    pub name: Box<str>,
    pub uid: Box<str>,
    pub model: Box<str>,
    /// Declared size from the pod's annotation.
    pub size: Option<Bytes>,
    pub phase: PodPhase,
    /// `lastTransitionTime` of a true `Ready` condition.
    pub ready_since: Option<Box<str>>,
    /// `deletionTimestamp` is set: terminating, still holding VRAM.
    pub deleting: bool,
    /// Why a finished pod stopped.
    pub failure: Option<Box<str>>,
    /// `creationTimestamp`, to time loads.
    pub created: Option<Box<str>>,
    /// The node it is for (its annotation), or bound to.
    pub node: Option<Box<str>>,
    /// The GPU it was given (annotation).
    pub device: Option<Box<str>>,
    /// How it was given the GPU ([`Access::key`], annotation).
    pub access: Option<Box<str>>,
    /// The hash of the template it was built from (annotation).
    pub template_hash: Option<u64>,
    /// Why a pod that is not Ready is waiting, in the kubelet's or the
    /// scheduler's words (a container's waiting reason, an unschedulable
    /// pod); `None` when nothing says.
    pub waiting: Option<Box<str>>,
    /// Whether anything has reported a status for it yet.
    pub reported: bool,
    /// Whether it is bound to a node (`spec.nodeName`): a scheduler placed
    /// it. Model pods are always placed by one.
    pub bound: bool,
    /// Where it serves (its IP and serving port), once it has an IP: where
    /// sleep and wake requests go.
    pub addr: Option<std::net::SocketAddr>,
    /// Its serving port, IP or not (an InferencePool's target port).
    pub port: u16,
    /// Whether it carries the serving label as `true` (the copy scaler's
    /// mark for InferencePools) and the draining label (a copy being
    /// removed).
    pub serving_label: bool,
    pub draining: bool,
    /// When the copy scaler wants this copy off its GPU
    /// ([`RETIRE_ANNOTATION`](crate::residency::labels::RETIRE_ANNOTATION)).
    pub retire_at: Option<Box<str>>,
    /// The LoRA adapters its server said it holds
    /// ([`ADAPTERS_ANNOTATION`](crate::residency::labels::ADAPTERS_ANNOTATION)).
    pub adapters: Option<Box<str>>,
    /// A gang's pod: its members, head first
    /// ([`GANG_MEMBERS_ANNOTATION`](crate::residency::gangs::GANG_MEMBERS_ANNOTATION)).
    pub gang: Option<Box<str>>,
}

impl ModelPod {
    /// Reads a pod the reconciler owns; `None` when it lacks the model label.
    pub fn from_pod(pod: &Pod) -> Option<ModelPod> {
        let meta = &pod.metadata;
        let model = meta.labels.as_ref()?.get(MODEL_LABEL)?.clone();
        let status = pod.status.as_ref();
        let phase = status.and_then(|s| s.phase.as_deref());
        let finished = matches!(phase, Some("Failed" | "Succeeded"));
        let ready_since = status
            .and_then(|s| s.conditions.as_ref())
            .and_then(|cs| cs.iter().find(|c| c.type_ == "Ready" && c.status == "True"))
            .map(|c| {
                c.last_transition_time
                    .as_ref()
                    .map(|t| t.0.to_string())
                    .unwrap_or_default()
            });
        let failure = finished.then(|| {
            let s = status.expect("a phase implies a status");
            s.message
                .clone()
                .or_else(|| s.reason.clone())
                .unwrap_or_else(|| format!("pod {}", phase.unwrap_or("stopped")))
        });
        let annotation = |key: &str| meta.annotations.as_ref().and_then(|a| a.get(key)).cloned();
        let labels = meta.labels.as_ref()?;
        let port = crate::residency::labels::serving_port(pod);
        Some(ModelPod {
            name: meta.name.as_deref()?.into(),
            uid: meta.uid.as_deref().unwrap_or_default().into(),
            model: model.into(),
            size: annotation(SIZE_ANNOTATION).and_then(|s| s.parse().ok()),
            phase: if finished {
                PodPhase::Finished
            } else {
                PodPhase::Live
            },
            ready_since: if finished {
                None
            } else {
                ready_since.map(Into::into)
            },
            deleting: meta.deletion_timestamp.is_some(),
            failure: failure.map(Into::into),
            created: meta
                .creation_timestamp
                .as_ref()
                .map(|t| t.0.to_string().into()),
            // The node it is for: bound or not yet (pods from before the
            // annotation say it only once bound).
            node: annotation(NODE_ANNOTATION)
                .or_else(|| pod.spec.as_ref().and_then(|s| s.node_name.clone()))
                .map(Into::into),
            device: annotation(DEVICE_ANNOTATION).map(Into::into),
            access: annotation(GPU_ACCESS_ANNOTATION).map(Into::into),
            template_hash: annotation(TEMPLATE_HASH_ANNOTATION)
                .and_then(|h| u64::from_str_radix(&h, 16).ok()),
            waiting: if finished {
                None
            } else {
                waiting_reason(pod).map(Into::into)
            },
            reported: status.is_some_and(|s| s.phase.is_some()),
            bound: pod.spec.as_ref().is_some_and(|s| s.node_name.is_some()),
            addr: status
                .and_then(|s| s.pod_ip.as_deref())
                .and_then(|ip| ip.parse::<std::net::IpAddr>().ok())
                .map(|ip| std::net::SocketAddr::new(ip, port)),
            port,
            serving_label: labels
                .get(crate::residency::labels::SERVING_LABEL)
                .is_some_and(|v| v == "true"),
            draining: labels.contains_key(crate::residency::labels::DRAINING_LABEL),
            retire_at: annotation(crate::residency::labels::RETIRE_ANNOTATION).map(Into::into),
            adapters: annotation(crate::residency::labels::ADAPTERS_ANNOTATION).map(Into::into),
            gang: annotation(crate::residency::gangs::GANG_MEMBERS_ANNOTATION).map(Into::into),
        })
    }
}

/// Why a pod is not running yet, as its status says: a container's waiting
/// reason (ImagePullBackOff, CrashLoopBackOff, ...), a false PodScheduled
/// condition (Unschedulable), or the pod's own reason.
fn waiting_reason(pod: &Pod) -> Option<String> {
    let status = pod.status.as_ref()?;
    let said = |reason: &str, message: Option<&str>| match message.filter(|m| !m.is_empty()) {
        Some(m) => format!("{reason}: {m}"),
        None => reason.to_owned(),
    };
    let containers = status.container_statuses.iter().flatten();
    if let Some(w) = containers
        .filter_map(|c| c.state.as_ref()?.waiting.as_ref())
        .find(|w| {
            w.reason
                .as_deref()
                .is_some_and(|r| r != "ContainerCreating")
        })
    {
        return Some(said(w.reason.as_deref()?, w.message.as_deref()));
    }
    if let Some(c) = status
        .conditions
        .iter()
        .flatten()
        .find(|c| c.type_ == "PodScheduled" && c.status == "False")
    {
        return Some(said(
            c.reason.as_deref().unwrap_or("NotScheduled"),
            c.message.as_deref(),
        ));
    }
    status
        .reason
        .as_deref()
        .map(|r| said(r, status.message.as_deref()))
}

/// Builds the pod for `model` from its template: kept to the residency's
/// node (for the scheduler to place it there), given the GPU, labelled,
/// annotated with its size and owned by the residency. Fails with a
/// message when the template is unusable.
pub fn build_pod(
    residency: &ModelResidency,
    owner: &OwnerReference,
    model: &ModelSpec,
    size: Bytes,
    gpu: &Placement,
) -> Result<Pod, String> {
    let template: PodTemplateSpec = match &model.template {
        None => return Err("the model has no pod template".into()),
        Some(t) => serde_json::from_str(t.json())
            .map_err(|e| format!("the pod template is not a valid PodTemplateSpec: {e}"))?,
    };
    let mut spec = template.spec.ok_or("the pod template has no spec")?;
    if spec.containers.is_empty() {
        return Err("the pod template has no containers".into());
    }
    // A name that matches no container would give the GPU to none: a pod
    // that starts, turns Ready and serves without its device.
    if let Some(named) = &residency.spec.gpu.containers
        && let Some(missing) = named
            .iter()
            .find(|n| !spec.containers.iter().any(|c| &c.name == *n))
    {
        return Err(format!(
            "spec.gpu.containers names {missing:?}, which the pod template has no container of"
        ));
    }
    let residency_name = residency.metadata.name.clone().unwrap_or_default();
    if !gpu.node.is_empty() {
        require_node(&mut spec, &gpu.node);
    }
    // The operator retries failed loads itself (with backoff, reported in
    // status); a kubelet restart loop would hide failures from it.
    spec.restart_policy.get_or_insert_with(|| "Never".into());
    give_gpu(&mut spec, residency, gpu);
    if let Some(lora) = &model.lora {
        give_adapter_slots(&mut spec, residency, lora);
    }
    let hash = template_hash(
        model
            .template
            .as_ref()
            .map(|t| t.json())
            .unwrap_or_default(),
    );
    let mut meta = template.metadata.unwrap_or_default();
    meta.name = Some(pod_name(&residency_name, &model.name));
    meta.namespace = residency.metadata.namespace.clone();
    meta.generate_name = None;
    let labels = meta.labels.get_or_insert_with(Default::default);
    labels.insert(MODEL_LABEL.into(), model.name.clone());
    labels.insert(RESIDENCY_LABEL.into(), residency_name);
    let annotations = meta.annotations.get_or_insert_with(Default::default);
    annotations.insert(SIZE_ANNOTATION.into(), size.to_string());
    annotations.insert(DEVICE_ANNOTATION.into(), gpu.device.clone());
    annotations.insert(NODE_ANNOTATION.into(), gpu.node.clone());
    annotations.insert(GPU_ACCESS_ANNOTATION.into(), gpu.access.key());
    annotations.insert(TEMPLATE_HASH_ANNOTATION.into(), format!("{hash:016x}"));
    meta.owner_references = Some(vec![owner.clone()]);
    Ok(Pod {
        metadata: meta,
        spec: Some(spec),
        status: None,
    })
}

/// Gives the GPU to the containers spec.gpu.containers names (all by
/// default), the way the mode says: a reference to the shared claim, one
/// of the device plugin's resource, or the environment variable alone. In
/// the first two the variable is dropped (the claim's or the plugin's
/// device is the one the container sees).
fn give_gpu(spec: &mut PodSpec, residency: &ModelResidency, gpu: &Placement) {
    let chosen = &residency.spec.gpu;
    if let Access::Claim { claim } = &gpu.access {
        let claims = spec.resource_claims.get_or_insert_with(Vec::new);
        claims.retain(|c| c.name != CLAIM_REQUEST);
        claims.push(PodResourceClaim {
            name: CLAIM_REQUEST.into(),
            resource_claim_name: Some(claim.clone()),
            resource_claim_template_name: None,
        });
    }
    let given = |c: &Container| chosen.gives_to(&c.name);
    for c in spec.containers.iter_mut().filter(|c| given(c)) {
        let env = c.env.get_or_insert_with(Vec::new);
        env.retain(|e| e.name != DEVICE_ENV);
        match &gpu.access {
            Access::Env => env.push(EnvVar {
                name: DEVICE_ENV.into(),
                value: Some(gpu.device.clone()),
                value_from: None,
            }),
            Access::DevicePlugin { resource } => {
                let resources = c.resources.get_or_insert_with(Default::default);
                for list in [&mut resources.limits, &mut resources.requests] {
                    list.get_or_insert_with(Default::default)
                        .insert(resource.clone(), Quantity("1".into()));
                }
            }
            Access::Claim { .. } => {
                let resources = c.resources.get_or_insert_with(Default::default);
                let claims = resources.claims.get_or_insert_with(Vec::new);
                claims.retain(|r| r.name != CLAIM_REQUEST);
                claims.push(ResourceClaim {
                    name: CLAIM_REQUEST.into(),
                    request: None,
                });
            }
        }
        if c.env.as_ref().is_some_and(Vec::is_empty) {
            c.env = None;
        }
    }
}

/// Makes `pod`, built by its head for its own GPU ([`build_pod`]), the
/// pod of gang `gang`: owned by every member (each member's reconcile sees
/// it as its own), named by the members' annotation, and given every
/// member's GPU: a claim reference per member in claim mode (`gpu` the
/// head's, `gpu-1`, `gpu-2`, ... the others', in member order), all the
/// members' devices in NVIDIA_VISIBLE_DEVICES in env mode, N of the
/// extended resource in devicePlugin mode (the device plugin picks them).
/// The containers that get the GPU also learn the gang's width and its
/// devices ([`GANG_SIZE_ENV`], [`GANG_DEVICES_ENV`]), e.g. for
/// `--tensor-parallel-size=$(RESIDENCY_GANG_SIZE)`.
pub fn make_gang_pod(
    pod: &mut Pod,
    residency: &ModelResidency,
    gpu: &Placement,
    owner: &OwnerReference,
    gang: &GangPlacement,
) {
    let me = residency.metadata.name.as_deref().unwrap_or_default();
    let meta = &mut pod.metadata;
    meta.annotations
        .get_or_insert_with(Default::default)
        .insert(GANG_MEMBERS_ANNOTATION.into(), gang.names());
    let owners = meta.owner_references.get_or_insert_with(Vec::new);
    for m in gang.members.iter().filter(|m| m.residency != me) {
        owners.push(OwnerReference {
            name: m.residency.clone(),
            uid: m.uid.clone(),
            controller: None,
            ..owner.clone()
        });
    }
    let width = gang.members.len();
    let devices: Vec<&str> = gang
        .members
        .iter()
        .map(|m| m.device.as_deref().unwrap_or("?"))
        .collect();
    let Some(spec) = pod.spec.as_mut() else {
        return;
    };
    let others: Vec<(String, String)> = gang
        .members
        .iter()
        .filter(|m| m.residency != me)
        .enumerate()
        .filter_map(|(i, m)| Some((format!("{CLAIM_REQUEST}-{}", i + 1), m.claim.clone()?)))
        .collect();
    if let Access::Claim { .. } = &gpu.access {
        let claims = spec.resource_claims.get_or_insert_with(Vec::new);
        for (name, claim) in &others {
            claims.push(PodResourceClaim {
                name: name.clone(),
                resource_claim_name: Some(claim.clone()),
                resource_claim_template_name: None,
            });
        }
    }
    let chosen = &residency.spec.gpu;
    for c in spec
        .containers
        .iter_mut()
        .filter(|c| chosen.gives_to(&c.name))
    {
        let env = c.env.get_or_insert_with(Vec::new);
        env.retain(|e| e.name != GANG_SIZE_ENV && e.name != GANG_DEVICES_ENV);
        let var = |name: &str, value: String| EnvVar {
            name: name.into(),
            value: Some(value),
            value_from: None,
        };
        env.push(var(GANG_SIZE_ENV, width.to_string()));
        env.push(var(GANG_DEVICES_ENV, devices.join(",")));
        match &gpu.access {
            Access::Env => {
                for e in env.iter_mut().filter(|e| e.name == DEVICE_ENV) {
                    e.value = Some(devices.join(","));
                }
            }
            Access::DevicePlugin { resource } => {
                let resources = c.resources.get_or_insert_with(Default::default);
                for list in [&mut resources.limits, &mut resources.requests] {
                    list.get_or_insert_with(Default::default)
                        .insert(resource.clone(), Quantity(width.to_string()));
                }
            }
            Access::Claim { .. } => {
                let resources = c.resources.get_or_insert_with(Default::default);
                let claims = resources.claims.get_or_insert_with(Vec::new);
                for (name, _) in &others {
                    claims.push(ResourceClaim {
                        name: name.clone(),
                        request: None,
                    });
                }
            }
        }
    }
}

/// Tells the containers that get the GPU their adapter slots and rank
/// (`LoraSpec::env`), so the template's flags can name them
/// (`--max-loras=$(MODEL_RESIDENCY_MAX_LORAS)`) and they stay what the
/// router counts on; the template's own values of these names give way.
fn give_adapter_slots(spec: &mut PodSpec, residency: &ModelResidency, lora: &LoraSpec) {
    let vars = lora.env();
    for c in spec
        .containers
        .iter_mut()
        .filter(|c| residency.spec.gpu.gives_to(&c.name))
    {
        let env = c.env.get_or_insert_with(Vec::new);
        env.retain(|e| !vars.iter().any(|(name, _)| e.name == *name));
        env.extend(vars.iter().map(|(name, value)| EnvVar {
            name: (*name).into(),
            value: Some(value.clone()),
            value_from: None,
        }));
    }
}

/// Keeps the pod to `node` through the scheduler: a required node affinity
/// on the node's name (`matchFields metadata.name`, as the DaemonSet
/// controller does; a hostname label need not equal the name). The
/// template's own required terms stay, each narrowed to the node (terms
/// are ORed, so a term left alone would let the pod go elsewhere). A
/// `nodeName` in the template is dropped: it would bypass the scheduler,
/// which hardened clusters and device allocation need to see the pod.
pub(crate) fn require_node(spec: &mut PodSpec, node: &str) {
    spec.node_name = None;
    let on_node = NodeSelectorRequirement {
        key: "metadata.name".into(),
        operator: "In".into(),
        values: Some(vec![node.to_owned()]),
    };
    let required = spec
        .affinity
        .get_or_insert_with(Affinity::default)
        .node_affinity
        .get_or_insert_with(NodeAffinity::default)
        .required_during_scheduling_ignored_during_execution
        .get_or_insert_with(NodeSelector::default);
    if required.node_selector_terms.is_empty() {
        required
            .node_selector_terms
            .push(NodeSelectorTerm::default());
    }
    for term in &mut required.node_selector_terms {
        let fields = term.match_fields.get_or_insert_with(Vec::new);
        fields.retain(|f| f.key != "metadata.name");
        fields.push(on_node.clone());
    }
}
#[cfg(test)]
#[path = "pods_tests.rs"]
mod tests;
