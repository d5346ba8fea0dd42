//! Claim mode's part of a reconcile: make the residency's ResourceClaim and
//! its GPU holder pod, and read from them where the GPU is ([`find`]). The
//! other modes' GPU is what the spec declares.
//!
//! The claim is allocated by the scheduler when the holder pod, its first
//! consumer, is scheduled; every model pod references the same claim, so
//! it lands on that node with that device. The holder keeps the claim
//! reserved between loads: the resource claim controller deallocates a
//! claim no pod references (measured on v1.37.2 in
//! `tests/it/operator/gpu_claims.rs`), and another claim could then take
//! the device between two loads.

pub mod inventory;
pub mod objects;

use super::{Context, Error, Result};
use crate::api::{GpuMode, GpuStatus, ModelResidency};
use crate::quantity::format_bytes;
use crate::residency::gpu::{
    Access, GpuView, Placement, Withheld, claim_of, declared, holder_name,
};
use crate::residency::reasons::Reason;
use inventory::{ClaimState, NVIDIA_DRIVER};
use k8s_openapi::api::core::v1::Pod;
use k8s_openapi::api::resource::v1::{DeviceClass, ResourceClaim};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::OwnerReference;
use kube::ResourceExt;
use kube::api::{Api, DeleteParams, PostParams, Preconditions};
use std::time::Duration;

/// How often a residency whose claim is not allocated looks again (the
/// scheduler's reason can change without the claim changing).
pub const PENDING_RECHECK: Duration = Duration::from_secs(5);

/// What [`find`] found, and when to look again.
pub struct Found {
    pub view: GpuView,
    pub recheck: Option<Duration>,
}

impl Found {
    fn placed(p: Placement) -> Self {
        Found {
            view: GpuView::Placed(p),
            recheck: None,
        }
    }
}

fn withheld(reason: Reason, message: String, status: &GpuStatus) -> Found {
    Found {
        view: GpuView::Withheld(Withheld {
            reason,
            message,
            status: status.clone(),
        }),
        recheck: Some(PENDING_RECHECK),
    }
}

/// Finds residency `r`'s GPU, making its claim and holder pod when they
/// are missing (claim mode). With the claim allocated and reserved for the
/// holder, it reads only the watch caches: no request.
pub async fn find(r: &ModelResidency, owner: &OwnerReference, ctx: &Context) -> Result<Found> {
    if let Some(p) = declared(r) {
        return Ok(Found::placed(p));
    }
    let ns = r.namespace().ok_or(Error::Incomplete("namespace"))?;
    let claim = claim_of(r);
    let ours = r.spec.gpu.existing_claim.is_none();
    let status = GpuStatus {
        mode: GpuMode::Claim,
        node: r.spec.node_name.clone(),
        claim: Some(claim.clone()),
        ..GpuStatus::default()
    };
    if !ctx.gpus.served() {
        let message = ctx.gpus.unserved().unwrap_or_else(|| {
            "the operator has not read the cluster's ResourceClaims yet".to_owned()
        });
        return Ok(withheld(Reason::GpuUnavailable, message, &status));
    }
    // Never decide on a partial view of the claims and devices.
    ctx.gpus.wait_listed().await;
    let claims: Api<ResourceClaim> = Api::namespaced(ctx.client.clone(), &ns);
    let Some(state) = ctx.gpus.claim(&ns, &claim) else {
        if !ours {
            let message = format!(
                "spec.gpu.existingClaim {claim}: there is no such ResourceClaim in namespace {ns}"
            );
            return Ok(withheld(Reason::ClaimMissing, message, &status));
        }
        create_claim(&claims, r, owner, ctx).await?;
        let message =
            format!("ResourceClaim {claim} was made; waiting for the scheduler to allocate it");
        return Ok(withheld(Reason::GpuPending, message, &status));
    };
    let uid = r.metadata.uid.as_deref().unwrap_or_default();
    if ours && state.controller.as_deref() != Some(uid) {
        let message = format!(
            "a ResourceClaim named {claim} exists in namespace {ns} and is not this residency's: rename one of them, or name it in spec.gpu.existingClaim to share it"
        );
        return Ok(withheld(Reason::ClaimMissing, message, &status));
    }
    let holder = holder_name(&r.name_any());
    let pods: Api<Pod> = Api::namespaced(ctx.client.clone(), &ns);
    if state.deleting {
        // Its pods must go before it does (the scheduler's finalizer waits
        // for them); it is made again once it is gone.
        delete_holder(&pods, &holder, None, ctx).await?;
        let message = format!(
            "ResourceClaim {claim} is being deleted: its pods go first, then it is made again"
        );
        return Ok(withheld(Reason::GpuPending, message, &status));
    }
    let wanted = objects::wanted(r);
    if ours && state.wants.as_deref() != Some(wanted.as_str()) {
        // A claim's spec cannot change: a new device, class or node is a
        // new claim.
        delete_claim(&claims, &claim, &state, ctx).await?;
        delete_holder(&pods, &holder, None, ctx).await?;
        let message = format!(
            "ResourceClaim {claim} was made for {} and is replaced for {wanted}",
            state.wants.as_deref().unwrap_or("another spec")
        );
        return Ok(withheld(Reason::GpuPending, message, &status));
    }
    if !state.reserved_for.contains(&holder) {
        ensure_holder(&pods, r, owner, &claim, ctx).await?;
    }
    let Some(allocation) = &state.allocation else {
        let (reason, message) = why_unallocated(r, &claim, &pods, &holder, ctx).await;
        return Ok(withheld(reason, message, &status));
    };
    Ok(placed_by(r, claim, allocation, ctx, status))
}

/// Where an allocated claim puts the residency: the device's node,
/// UUID and memory (from its ResourceSlice), or why it cannot be used.
fn placed_by(
    r: &ModelResidency,
    claim: String,
    allocation: &inventory::Allocation,
    ctx: &Context,
    mut status: GpuStatus,
) -> Found {
    let device = ctx.gpus.device(allocation);
    let node = allocation
        .node
        .clone()
        .or_else(|| device.as_ref().and_then(|d| d.node.clone()));
    status.node = node.clone();
    status.device = Some(allocation.device.clone());
    status.uuid = device.as_ref().and_then(|d| d.uuid.clone());
    status.memory = device.as_ref().and_then(|d| d.memory).map(format_bytes);
    let Some(node) = node else {
        let message = format!(
            "ResourceClaim {claim} is allocated device {} of pool {}, which is on no single node; model pods need one",
            allocation.device, allocation.pool
        );
        return withheld(Reason::GpuUnavailable, message, &status);
    };
    let memory = device.as_ref().and_then(|d| d.memory);
    if memory.is_none() && r.spec.budget.is_none() {
        let message = format!(
            "spec.budget is omitted and the allocated device {} publishes no memory capacity (is its ResourceSlice there?)",
            allocation.device
        );
        return withheld(Reason::GpuPending, message, &status);
    }
    Found::placed(Placement {
        node,
        device: r.spec.device.clone(),
        access: Access::Claim { claim },
        memory,
        status,
    })
}

async fn create_claim(
    claims: &Api<ResourceClaim>,
    r: &ModelResidency,
    owner: &OwnerReference,
    ctx: &Context,
) -> Result<()> {
    let claim = objects::build_claim(r, owner);
    let result = claims.create(&PostParams::default(), &claim).await;
    ctx.metrics.api_request("create", "resourceclaims");
    match result {
        Ok(made) => ctx.gpus.wrote_claim(&made),
        // Made meanwhile (the watch will bring it).
        Err(kube::Error::Api(s)) if s.code == 409 => {}
        Err(source) => {
            let claim = claim.metadata.name.unwrap_or_default();
            return Err(Error::Claim { claim, source });
        }
    }
    Ok(())
}

async fn delete_claim(
    claims: &Api<ResourceClaim>,
    name: &str,
    state: &ClaimState,
    ctx: &Context,
) -> Result<()> {
    let uid = Some(state.uid.clone());
    delete_gone_ok(claims, name, uid, ctx, "resourceclaims")
        .await
        .map_err(|source| Error::Claim {
            claim: name.to_owned(),
            source,
        })
}

/// Deletes `name` (only while it has `uid`, when given); already gone, or
/// replaced by a newer object of that name, is done too.
async fn delete_gone_ok<K>(
    api: &Api<K>,
    name: &str,
    uid: Option<String>,
    ctx: &Context,
    resource: &'static str,
) -> std::result::Result<(), kube::Error>
where
    K: Clone + serde::de::DeserializeOwned + std::fmt::Debug,
{
    let dp = DeleteParams {
        preconditions: uid.map(|uid| Preconditions {
            uid: Some(uid),
            resource_version: None,
        }),
        ..DeleteParams::default()
    };
    let result = api.delete(name, &dp).await;
    ctx.metrics.api_request("delete", resource);
    match result {
        Ok(_) => Ok(()),
        Err(kube::Error::Api(s)) if s.code == 404 || s.code == 409 => Ok(()),
        Err(e) => Err(e),
    }
}

/// Makes the holder pod when there is none, and replaces one that has
/// finished (a holder that stopped holds nothing).
async fn ensure_holder(
    pods: &Api<Pod>,
    r: &ModelResidency,
    owner: &OwnerReference,
    claim: &str,
    ctx: &Context,
) -> Result<()> {
    let name = holder_name(&r.name_any());
    let current = pods.get_opt(&name).await;
    ctx.metrics.api_request("get", "pods");
    let current = current.map_err(|source| Error::HolderPod {
        pod: name.clone(),
        source,
    })?;
    if let Some(pod) = current {
        let phase = pod.status.as_ref().and_then(|s| s.phase.as_deref());
        let finished = matches!(phase, Some("Failed" | "Succeeded"));
        if !finished {
            return Ok(());
        }
        delete_holder(pods, &name, pod.metadata.uid.clone(), ctx).await?;
        return Ok(());
    }
    let image = ctx.gpu_holder_image.as_str();
    let pod = objects::build_holder(r, owner, image, claim);
    let result = pods.create(&PostParams::default(), &pod).await;
    ctx.metrics.api_request("create", "pods");
    match result {
        Ok(_) => Ok(()),
        Err(kube::Error::Api(s)) if s.code == 409 => Ok(()),
        Err(source) => Err(Error::HolderPod { pod: name, source }),
    }
}

async fn delete_holder(
    pods: &Api<Pod>,
    name: &str,
    uid: Option<String>,
    ctx: &Context,
) -> Result<()> {
    delete_gone_ok(pods, name, uid, ctx, "pods")
        .await
        .map_err(|source| Error::HolderPod {
            pod: name.to_owned(),
            source,
        })
}

/// Why the claim is not allocated, naming what is missing: the
/// DeviceClass, any device of the driver (on the node), the device itself;
/// else the scheduler's own words about the holder pod (the device is
/// another claim's, say).
async fn why_unallocated(
    r: &ModelResidency,
    claim: &str,
    pods: &Api<Pod>,
    holder: &str,
    ctx: &Context,
) -> (Reason, String) {
    let spec = &r.spec;
    let class = spec.gpu.device_class(&spec.device);
    let classes: Api<DeviceClass> = Api::all(ctx.client.clone());
    let found = classes.get_opt(class).await;
    ctx.metrics.api_request("get", "deviceclasses");
    if let Ok(None) = found {
        let message = format!(
            "ResourceClaim {claim} cannot be allocated: DeviceClass {class} does not exist (is the NVIDIA DRA driver installed? or set spec.gpu.deviceClassName)"
        );
        return (Reason::DeviceClassMissing, message);
    }
    let devices: Vec<_> = ctx
        .gpus
        .devices()
        .into_iter()
        .filter(|d| d.driver == NVIDIA_DRIVER)
        .filter(|d| spec.node_name.is_none() || d.node == spec.node_name)
        .collect();
    let where_ = match &spec.node_name {
        Some(node) => format!("node {node}"),
        None => "any node".to_owned(),
    };
    if devices.is_empty() {
        let message = format!(
            "ResourceClaim {claim} cannot be allocated: {where_} publishes no {NVIDIA_DRIVER} devices (no ResourceSlice: is the NVIDIA DRA driver's kubelet plugin running there?)"
        );
        return (Reason::NoGpuDriver, message);
    }
    if !devices.iter().any(|d| d.is(&spec.device)) {
        let have: Vec<String> = devices
            .iter()
            .take(8)
            .map(|d| {
                format!(
                    "{} (index {}, {})",
                    d.name,
                    d.index.map_or("?".into(), |i| i.to_string()),
                    d.uuid.as_deref().unwrap_or("no uuid")
                )
            })
            .collect();
        let message = format!(
            "ResourceClaim {claim} cannot be allocated: no device on {where_} has index or uuid {} (there: {})",
            spec.device,
            have.join(", ")
        );
        return (Reason::NoSuchGpu, message);
    }
    let pod = pods.get_opt(holder).await;
    ctx.metrics.api_request("get", "pods");
    let scheduling = pod
        .ok()
        .flatten()
        .and_then(|p| p.status)
        .and_then(|s| s.conditions)
        .into_iter()
        .flatten()
        .find(|c| c.type_ == "PodScheduled" && c.status == "False")
        .and_then(|c| c.message);
    match scheduling {
        Some(why) => (
            Reason::GpuUnavailable,
            format!("ResourceClaim {claim} cannot be allocated: the scheduler says: {why}"),
        ),
        None => (
            Reason::GpuPending,
            format!(
                "ResourceClaim {claim} waits for the scheduler to place its holder pod {holder}"
            ),
        ),
    }
}
