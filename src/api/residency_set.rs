//! The `ResidencySet` custom resource (`residency.dev/v1alpha1`): one
//! `ModelResidency` stamped for every GPU the cluster publishes that it
//! selects (DRA ResourceSlices: a device class, CEL selectors over the
//! devices' attributes and capacity as a ResourceClaim's, a node
//! selector), each over the set's catalog and with the set's residency
//! settings. The operator keeps exactly one per matching device
//! (`crate::operator::residency_set`): made when a device appears,
//! updated when the set changes, and, when a device leaves its slice or
//! stops matching, drained (its models unloaded as an unload is, so held
//! requests go elsewhere) and then deleted.

use super::{ByteQuantity, CatalogRef, EvictionPolicy, GpuSpec, WarmSpec};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::Condition;
use kube::CustomResource;
use schemars::JsonSchema;
use serde::{Deserialize, Serialize};
use std::collections::BTreeMap;

/// Residencies stamped for the GPUs a cluster publishes.
#[derive(CustomResource, Serialize, Deserialize, Clone, Debug, PartialEq, JsonSchema)]
#[kube(
    group = "residency.dev",
    version = "v1alpha1",
    kind = "ResidencySet",
    doc = "One ModelResidency per GPU the cluster publishes (DRA ResourceSlices) that this set selects, each over the set's ModelCatalog with the set's residency settings; a GPU that leaves is drained, then its residency removed.",
    plural = "residencysets",
    singular = "residencyset",
    shortname = "mrset",
    namespaced,
    status = "ResidencySetStatus",
    printcolumn = r#"{"name":"Catalog","type":"string","jsonPath":".spec.catalog.name"}"#,
    printcolumn = r#"{"name":"Devices","type":"integer","jsonPath":".status.devices"}"#,
    printcolumn = r#"{"name":"Residencies","type":"integer","jsonPath":".status.residencies"}"#,
    printcolumn = r#"{"name":"Ready","type":"integer","jsonPath":".status.ready"}"#,
    printcolumn = r#"{"name":"Skipped","type":"integer","jsonPath":".status.skippedCount","priority":1}"#,
    printcolumn = r#"{"name":"Age","type":"date","jsonPath":".metadata.creationTimestamp"}"#
)]
#[serde(rename_all = "camelCase")]
pub struct ResidencySetSpec {
    /// Which published devices get a residency.
    #[serde(default)]
    pub devices: DeviceSelection,
    /// The ModelCatalog (in this namespace) every stamped residency
    /// serves: all of it, or the models listed.
    pub catalog: CatalogRef,
    /// The settings each stamped residency takes.
    #[serde(default)]
    pub residency: StampedSettings,
}

/// Devices as a ResourceClaim selects them, and the nodes they may be on.
#[derive(Serialize, Deserialize, Clone, Debug, Default, PartialEq, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct DeviceSelection {
    /// The DeviceClass whose devices are selected: its driver's devices
    /// that its own selectors admit. Default gpu.nvidia.com.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(length(min = 1, max = 253))]
    pub device_class_name: Option<String>,
    /// More CEL selectors, all of which a device must satisfy, over
    /// `device.driver`, `device.attributes["<driver>"].<name>` and
    /// `device.capacity["<driver>"].<name>` (a quantity: compare with
    /// `.compareTo(quantity("40Gi"))`), as in a ResourceClaim. A selector
    /// that fails on a device (a missing attribute) does not select it.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    #[schemars(length(max = 32))]
    pub selectors: Vec<DeviceSelector>,
    /// Labels a device's node must have (a Pod's nodeSelector).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub node_selector: Option<BTreeMap<String, String>>,
}

/// One selector: a CEL expression, as `resource.k8s.io` writes one.
#[derive(Serialize, Deserialize, Clone, Debug, Default, PartialEq, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct DeviceSelector {
    pub cel: CelSelector,
}

#[derive(Serialize, Deserialize, Clone, Debug, Default, PartialEq, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct CelSelector {
    /// A CEL expression that is true for the devices to select.
    #[schemars(length(min = 1, max = 10240))]
    pub expression: String,
}

/// What a stamped residency takes from its set (the GPU's node and device
/// come from the ResourceSlice).
#[derive(Serialize, Deserialize, Clone, Debug, Default, PartialEq, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct StampedSettings {
    /// Each GPU's budget. Unset: the device's memory times
    /// budgetFraction.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub budget: Option<ByteQuantity>,
    /// The share of each device's memory that is its budget when budget is
    /// unset: more than 0, at most 1. Default 0.9.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(range(min = 0.01, max = 1.0))]
    pub budget_fraction: Option<f64>,
    /// How model pods get the GPU (as a residency's spec.gpu; the claim's
    /// device class is the set's).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub gpu: Option<GpuSpec>,
    #[serde(default)]
    pub eviction: EvictionPolicy,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub warm: Option<WarmSpec>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(length(min = 1, max = 32))]
    pub keep_alive: Option<String>,
    #[serde(default)]
    #[schemars(range(min = 0, max = 64))]
    pub prefetch: u32,
}

/// What the operator sees of a set.
#[derive(Serialize, Deserialize, Clone, Debug, Default, PartialEq, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct ResidencySetStatus {
    /// Published devices the set selects.
    #[serde(default)]
    pub devices: u32,
    /// Residencies it keeps (draining ones included).
    #[serde(default)]
    pub residencies: u32,
    /// Of those, Ready.
    #[serde(default)]
    pub ready: u32,
    /// Selected devices another residency (stamped or hand-written)
    /// holds: `node/device: held by namespace/residency`.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub skipped: Vec<String>,
    #[serde(default)]
    pub skipped_count: u32,
    /// Per model, how many of its residencies hold it (loaded, loading or
    /// asleep).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub models: Vec<ModelGpus>,
    /// The spec generation this status reflects.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub observed_generation: Option<i64>,
    /// Ready: True once every selected device has its residency; False
    /// with NoDevicesMatched, InvalidSelector or Stamping otherwise.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    #[schemars(extend("x-kubernetes-list-type" = "atomic"))]
    pub conditions: Vec<Condition>,
}

/// How many GPUs of a set hold one model.
#[derive(Serialize, Deserialize, Clone, Debug, Default, PartialEq, Eq, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct ModelGpus {
    pub name: String,
    pub gpus: u32,
}
