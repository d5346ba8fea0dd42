//! The Gateway API Inference Extension's `InferencePool`
//! (`inference.networking.k8s.io/v1`): the fields the operator writes, from
//! the published v1 API (its Go module is not served here, so the type is
//! ours). The operator keeps one per model and namespace when asked to
//! (`--inference-pools`); the CRD itself is the extension's to install.

use kube::CustomResource;
use schemars::JsonSchema;
use serde::{Deserialize, Serialize};
use std::collections::BTreeMap;

/// A group of model server pods a Gateway routes a model's requests to.
#[derive(CustomResource, Serialize, Deserialize, Clone, Debug, PartialEq, JsonSchema)]
#[kube(
    group = "inference.networking.k8s.io",
    version = "v1",
    kind = "InferencePool",
    plural = "inferencepools",
    shortname = "infpool",
    namespaced
)]
#[serde(rename_all = "camelCase")]
pub struct InferencePoolSpec {
    /// The pods in the pool: labels only, within the pool's namespace.
    pub selector: PoolSelector,
    /// The port the selected pods serve on (exactly one).
    pub target_ports: Vec<PoolPort>,
    /// The endpoint picker (optional since the extension's v1.5).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub endpoint_picker_ref: Option<EndpointPickerRef>,
}

#[derive(Serialize, Deserialize, Clone, Debug, Default, PartialEq, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct PoolSelector {
    pub match_labels: BTreeMap<String, String>,
}

#[derive(Serialize, Deserialize, Clone, Debug, PartialEq, JsonSchema)]
pub struct PoolPort {
    pub number: u16,
}

#[derive(Serialize, Deserialize, Clone, Debug, PartialEq, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct EndpointPickerRef {
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub group: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub kind: Option<String>,
    pub name: String,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub port_number: Option<u16>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub failure_mode: Option<String>,
}
