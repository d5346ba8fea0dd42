//! How a residency's model pods get their GPU (`spec.gpu`), and what the
//! operator found out about that GPU (`status.gpu`).

use schemars::JsonSchema;
use serde::{Deserialize, Serialize};

/// The DeviceClass the NVIDIA DRA driver's chart installs for whole GPUs.
pub const DEFAULT_DEVICE_CLASS: &str = "gpu.nvidia.com";
/// The DeviceClass it installs for MIG instances.
pub const MIG_DEVICE_CLASS: &str = "mig.nvidia.com";
/// The extended resource the NVIDIA device plugin advertises.
pub const DEFAULT_GPU_RESOURCE: &str = "nvidia.com/gpu";
/// The share of the device's memory that is the budget when none is
/// declared (`spec.budgetFraction`).
pub const DEFAULT_BUDGET_FRACTION: f64 = 0.9;

/// How model pods get the GPU.
#[derive(Serialize, Deserialize, Clone, Debug, Default, PartialEq, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct GpuSpec {
    /// claim (the default): one resource.k8s.io/v1 ResourceClaim for this
    /// residency, allocated by the scheduler and shared by all its model
    /// pods (Kubernetes 1.34+ with a DRA driver, such as NVIDIA's).
    /// devicePlugin: each model pod requests one `resourceName` (a device
    /// plugin that shares GPUs by time-slicing). env: no request at all,
    /// only NVIDIA_VISIBLE_DEVICES=<device> (a cluster whose container
    /// toolkit honours that variable in unprivileged containers).
    #[serde(default)]
    pub mode: GpuMode,
    /// claim: the DeviceClass of the requested device. Default
    /// gpu.nvidia.com, or mig.nvidia.com for a MIG- device.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(length(min = 1, max = 253))]
    pub device_class_name: Option<String>,
    /// claim: use this ResourceClaim (in the residency's namespace, made
    /// by someone else, never deleted by the operator) instead of making
    /// one.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(length(min = 1, max = 253))]
    pub existing_claim: Option<String>,
    /// devicePlugin: the extended resource each model pod requests one of.
    /// Default nvidia.com/gpu.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(length(min = 1, max = 253))]
    pub resource_name: Option<String>,
    /// The containers of a model pod that get the GPU (the claim, the
    /// resource or the variable), by name. Default: all of them.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(length(max = 16))]
    pub containers: Option<Vec<String>>,
}

/// See [`GpuSpec::mode`].
#[derive(Serialize, Deserialize, Clone, Copy, Debug, Default, PartialEq, Eq, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub enum GpuMode {
    #[default]
    Claim,
    DevicePlugin,
    Env,
}

impl GpuMode {
    pub fn as_str(self) -> &'static str {
        match self {
            GpuMode::Claim => "claim",
            GpuMode::DevicePlugin => "devicePlugin",
            GpuMode::Env => "env",
        }
    }
}

impl GpuSpec {
    /// The DeviceClass a claim asks for `device` from.
    pub fn device_class(&self, device: &str) -> &str {
        match &self.device_class_name {
            Some(class) => class,
            None if device.starts_with("MIG-") => MIG_DEVICE_CLASS,
            None => DEFAULT_DEVICE_CLASS,
        }
    }

    /// The extended resource of devicePlugin mode.
    pub fn resource(&self) -> &str {
        self.resource_name
            .as_deref()
            .unwrap_or(DEFAULT_GPU_RESOURCE)
    }

    /// Whether container `name` of a model pod gets the GPU.
    pub fn gives_to(&self, name: &str) -> bool {
        self.containers
            .as_ref()
            .is_none_or(|c| c.iter().any(|n| n == name))
    }
}

/// The GPU as the operator found it: where the pods go and what the device
/// is.
#[derive(Serialize, Deserialize, Clone, Debug, Default, PartialEq, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct GpuStatus {
    /// spec.gpu.mode this was found in.
    pub mode: GpuMode,
    /// The node the model pods go to (spec.nodeName, or the node the
    /// scheduler allocated the claim on).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub node: Option<String>,
    /// spec.device, or in claim mode the allocated device's name in its
    /// ResourceSlice (gpu-0).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub device: Option<String>,
    /// The allocated device's uuid attribute.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub uuid: Option<String>,
    /// The allocated device's memory capacity.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub memory: Option<String>,
    /// claim mode: the ResourceClaim the model pods share.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub claim: Option<String>,
    /// Where status.budget came from: spec (spec.budget), device (the
    /// device's memory times spec.budgetFraction) or deviceLimit (the
    /// device's memory, smaller than spec.budget).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub budget_source: Option<String>,
}
