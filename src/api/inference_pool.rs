//! The Gateway API Inference Extension's `InferencePool`
//! (`inference.networking.k8s.io/v1`): the fields the operator writes, as
//! the extension's released CRDs (v1.5, v1.6) declare them; the tests apply
//! it against those CRDs (`scripts/inference-extension.sh` fetches them from
//! the extension's Go module). The operator keeps one per model and
//! namespace when asked to (`--inference-pools`); the CRD itself is the
//! extension's to install.

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
    /// The endpoint picker (required by the extension's v1.5, optional
    /// since v1.6).
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

/// The endpoint picker a pool names. The operator writes every field the
/// API server would default (group "", kind Service, failureMode
/// FailClose), so what it writes is what is stored and a pool is applied
/// only when it really differs.
#[derive(Serialize, Deserialize, Clone, Debug, PartialEq, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct EndpointPickerRef {
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub group: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub kind: Option<String>,
    pub name: String,
    /// Required when kind is Service.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub port: Option<PoolPort>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub failure_mode: Option<String>,
}

impl EndpointPickerRef {
    /// The picker Service `name` on `port`, with the CRD's defaults
    /// written out.
    pub fn service(name: String, port: u16) -> Self {
        EndpointPickerRef {
            group: Some(String::new()),
            kind: Some("Service".into()),
            name,
            port: Some(PoolPort { number: port }),
            failure_mode: Some("FailClose".into()),
        }
    }
}
