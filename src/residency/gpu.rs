//! Where a residency's GPU is and how its model pods get it, as values:
//! the reconciler finds them (from the spec, or in claim mode from the
//! ResourceClaim's allocation and the device's ResourceSlice), the decide
//! step builds pods and the budget from them. No I/O here.

use super::reasons::Reason;
use crate::api::{GpuMode, GpuStatus, ModelResidency};
use crate::engine::Bytes;
use crate::quantity::format_bytes;

/// The name of the claim the operator makes for residency `name`. Claims
/// are their own kind, so it can only collide with a claim someone else
/// made of that name (then the residency says ClaimMissing).
pub fn claim_name(residency: &str) -> String {
    format!("{residency}-gpu")
}

/// The name of residency `name`'s GPU holder pod. A model pod's name ends
/// in five hex digits (`pods::pod_name`), and "holder" is not hex, so no
/// model of any residency gets this name.
pub fn holder_name(residency: &str) -> String {
    format!("{residency}-gpu-holder")
}

/// The node residency `r`'s pods are on: spec.nodeName, else (claim
/// mode) the node its claim was allocated on, as its status says.
pub fn node_of(r: &ModelResidency) -> Option<&str> {
    r.spec.node_name.as_deref().or_else(|| {
        r.status
            .as_ref()
            .and_then(|s| s.gpu.as_ref())
            .and_then(|g| g.node.as_deref())
    })
}

/// The name of the request in the claim and of the claim reference in
/// each model pod.
pub const CLAIM_REQUEST: &str = "gpu";

/// The CEL selector that picks `device` among the class's devices: its
/// `uuid` attribute for a GPU- or MIG- UUID, its `index` attribute for an
/// index (the attributes the NVIDIA DRA driver publishes in the
/// `gpu.nvidia.com` domain). `device` is checked by the schema to be one
/// of those forms, so it needs no quoting beyond the quotes.
pub fn device_selector(driver_domain: &str, device: &str) -> String {
    if device.bytes().all(|b| b.is_ascii_digit()) {
        format!("device.attributes['{driver_domain}'].index == {device}")
    } else {
        format!("device.attributes['{driver_domain}'].uuid == '{device}'")
    }
}

/// How the model pods get the GPU.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Access {
    /// NVIDIA_VISIBLE_DEVICES only.
    Env,
    /// One of this extended resource per pod.
    DevicePlugin { resource: String },
    /// A reference to this shared ResourceClaim.
    Claim { claim: String },
}

impl Access {
    /// A short text recorded on each pod, so a pod made for another access
    /// is seen and replaced.
    pub fn key(&self) -> String {
        match self {
            Access::Env => "env".into(),
            Access::DevicePlugin { resource } => format!("devicePlugin:{resource}"),
            Access::Claim { claim } => format!("claim:{claim}"),
        }
    }
}

/// The GPU, found: where the pods go, how they get it, what it holds.
#[derive(Clone, Debug, PartialEq)]
pub struct Placement {
    pub node: String,
    /// spec.device (recorded on each pod).
    pub device: String,
    pub access: Access,
    /// The device's memory (claim mode, from its ResourceSlice).
    pub memory: Option<Bytes>,
    pub status: GpuStatus,
}

/// The GPU is not this residency's to use (yet): why, in the status's
/// words. It loads nothing meanwhile.
#[derive(Clone, Debug, PartialEq)]
pub struct Withheld {
    pub reason: Reason,
    pub message: String,
    pub status: GpuStatus,
}

/// What the reconciler found about the GPU.
#[derive(Clone, Debug, PartialEq)]
pub enum GpuView {
    Placed(Placement),
    Withheld(Withheld),
}

/// The GPU of a residency in devicePlugin or env mode: the declared node
/// and device. `None` in claim mode, or without a node (the schema requires
/// one outside claim mode).
pub fn declared(r: &ModelResidency) -> Option<Placement> {
    let spec = &r.spec;
    let access = match spec.gpu.mode {
        GpuMode::Claim => return None,
        GpuMode::Env => Access::Env,
        GpuMode::DevicePlugin => Access::DevicePlugin {
            resource: spec.gpu.resource().to_owned(),
        },
    };
    let node = spec.node_name.clone()?;
    Some(Placement {
        status: GpuStatus {
            mode: spec.gpu.mode,
            node: Some(node.clone()),
            device: Some(spec.device.clone()),
            ..GpuStatus::default()
        },
        node,
        device: spec.device.clone(),
        access,
        memory: None,
    })
}

/// The claim residency `r`'s pods share in claim mode:
/// spec.gpu.existingClaim, else the one the operator makes.
pub fn claim_of(r: &ModelResidency) -> String {
    match &r.spec.gpu.existing_claim {
        Some(existing) => existing.clone(),
        None => claim_name(r.metadata.name.as_deref().unwrap_or_default()),
    }
}

/// The placement the spec asks for, a claim taken as allocated where the
/// spec says (its node, if any, and its device): what pods are built for
/// before the claim is known (the API server's dry run of a template), and
/// what unit tests decide with. Without spec.nodeName the node is empty
/// and the pod is kept to no node.
pub fn assumed(r: &ModelResidency) -> Placement {
    declared(r).unwrap_or_else(|| {
        let claim = claim_of(r);
        Placement {
            node: r.spec.node_name.clone().unwrap_or_default(),
            device: r.spec.device.clone(),
            status: GpuStatus {
                mode: GpuMode::Claim,
                node: r.spec.node_name.clone(),
                device: Some(r.spec.device.clone()),
                claim: Some(claim.clone()),
                ..GpuStatus::default()
            },
            access: Access::Claim { claim },
            memory: None,
        }
    })
}

/// The budget the engine works with, and where it came from.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Budget {
    pub bytes: Bytes,
    /// `spec`, `device` or `deviceLimit` (status.gpu.budgetSource).
    pub source: &'static str,
    /// The declared budget is larger than the device: the message of the
    /// BudgetExceedsDevice condition.
    pub exceeds: Option<String>,
}

/// The budget from the declared one and the device's memory: the declared
/// one, cut to the device's memory when larger; without one, the memory
/// times `fraction`. `None` when neither is known.
pub fn budget(declared: Option<Bytes>, memory: Option<Bytes>, fraction: f64) -> Option<Budget> {
    match (declared, memory) {
        (Some(d), Some(m)) if d > m => Some(Budget {
            bytes: m,
            source: "deviceLimit",
            exceeds: Some(format!(
                "spec.budget {} is more than the device's memory {}; the budget is {}",
                format_bytes(d),
                format_bytes(m),
                format_bytes(m)
            )),
        }),
        (Some(d), _) => Some(Budget {
            bytes: d,
            source: "spec",
            exceeds: None,
        }),
        (None, Some(m)) => {
            // At least one byte: a fraction of a tiny device must still be
            // a positive budget.
            let bytes = ((m as f64) * fraction.clamp(0.0, 1.0)).floor() as Bytes;
            Some(Budget {
                bytes: bytes.max(1),
                source: "device",
                exceeds: None,
            })
        }
        (None, None) => None,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_selector_picks_by_index_or_by_uuid() {
        assert_eq!(
            device_selector("gpu.nvidia.com", "3"),
            "device.attributes['gpu.nvidia.com'].index == 3"
        );
        assert_eq!(
            device_selector("gpu.nvidia.com", "GPU-4f2a"),
            "device.attributes['gpu.nvidia.com'].uuid == 'GPU-4f2a'"
        );
        assert_eq!(
            device_selector("gpu.nvidia.com", "MIG-GPU-4f2a/1/0"),
            "device.attributes['gpu.nvidia.com'].uuid == 'MIG-GPU-4f2a/1/0'"
        );
    }

    #[test]
    fn the_budget_is_declared_cut_to_the_device_or_a_share_of_it() {
        let gib = 1u64 << 30;
        let b = budget(Some(10 * gib), Some(80 * gib), 0.9).unwrap();
        assert_eq!((b.bytes, b.source, b.exceeds), (10 * gib, "spec", None));
        let b = budget(Some(100 * gib), Some(80 * gib), 0.9).unwrap();
        assert_eq!((b.bytes, b.source), (80 * gib, "deviceLimit"));
        assert!(b.exceeds.unwrap().contains("100Gi is more than"));
        let b = budget(None, Some(80 * gib), 0.9).unwrap();
        assert_eq!((b.bytes, b.source), (72 * gib, "device"));
        assert_eq!(budget(None, Some(1), 0.5).unwrap().bytes, 1);
        assert_eq!(budget(Some(5), None, 0.9).unwrap().bytes, 5);
        assert_eq!(budget(None, None, 0.9), None);
    }
}
