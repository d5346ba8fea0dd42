//! The `ModelDemand` custom resource (`residency.dev/v1alpha1`): one model
//! on one residency, with a `/scale` subresource, so HPA, KEDA and
//! `kubectl scale` can load and unload it. A subresource cannot point into
//! `spec.demand`'s map, hence this small opt-in object.
//!
//! Semantics: `replicas` going from 0 to 1 is a request at that moment;
//! while it stays 1 the demand key keeps that time (a standing request is
//! not renewed, so two standing requests that do not fit do not thrash);
//! 0 withdraws this object's own request, removing the key (an unload)
//! while it still holds the time this object set (a later request by
//! anyone else, such as the router's traffic, stands), and so does
//! deleting the object. Status
//! mirrors the residency's view of the model: `replicas` is 1 while the
//! model is resident and Ready.

use k8s_openapi::apimachinery::pkg::apis::meta::v1::Condition;
use kube::CustomResource;
use schemars::JsonSchema;
use serde::{Deserialize, Serialize};

/// A request for one model on one GPU, scalable between 0 and 1.
#[derive(CustomResource, Serialize, Deserialize, Clone, Debug, PartialEq, JsonSchema)]
#[kube(
    group = "residency.dev",
    version = "v1alpha1",
    kind = "ModelDemand",
    doc = "One model on one ModelResidency, with a /scale subresource for HPA, KEDA and kubectl scale: replicas 1 requests it, 0 withdraws that request (an unload unless someone requested the model since).",
    plural = "modeldemands",
    singular = "modeldemand",
    shortname = "mdem",
    namespaced,
    status = "ModelDemandStatus",
    scale(
        spec_replicas_path = ".spec.replicas",
        status_replicas_path = ".status.replicas",
        label_selector_path = ".status.selector"
    ),
    printcolumn = r#"{"name":"Residency","type":"string","jsonPath":".spec.residency"}"#,
    printcolumn = r#"{"name":"Model","type":"string","jsonPath":".spec.model"}"#,
    printcolumn = r#"{"name":"Wanted","type":"integer","jsonPath":".spec.replicas"}"#,
    printcolumn = r#"{"name":"Ready","type":"integer","jsonPath":".status.replicas"}"#,
    printcolumn = r#"{"name":"State","type":"string","jsonPath":".status.state"}"#,
    printcolumn = r#"{"name":"Age","type":"date","jsonPath":".metadata.creationTimestamp"}"#
)]
#[serde(rename_all = "camelCase")]
pub struct ModelDemandSpec {
    /// The ModelResidency (in this namespace) whose model this is.
    #[schemars(length(min = 1, max = 253))]
    pub residency: String,
    /// The model: a name in that residency's spec.models.
    #[schemars(length(min = 1, max = 63), extend("x-kubernetes-validations" = super::rules::model_name()))]
    pub model: String,
    /// 1: the model is wanted (the change from 0 is a request); 0: this
    /// object's request is withdrawn (its demand key is removed, which
    /// unloads the model, unless someone requested it since).
    #[serde(default)]
    #[schemars(range(min = 0, max = 1))]
    pub replicas: i32,
}

/// The residency's view of the model.
#[derive(Serialize, Deserialize, Clone, Debug, Default, PartialEq, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct ModelDemandStatus {
    /// 1 while the model is resident and Ready, else 0.
    #[serde(default)]
    pub replicas: i32,
    /// A label selector (as a string) matching the model's pod, for HPA.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub selector: Option<String>,
    /// The model's state on the residency (Loaded, Loading, Evicted, ...).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub state: Option<String>,
    /// When this object's replicas went to 1: the request time it wrote.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub requested_at: Option<String>,
    /// The residency whose demand key this object drives (its spec's, once
    /// seen). When the spec names another residency or model, the key it
    /// drove is removed first, so nothing is left requested behind it.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub residency: Option<String>,
    /// The model whose demand key this object drives (see residency).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub model: Option<String>,
    /// The spec generation this status reflects.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub observed_generation: Option<i64>,
    /// Ready (the model is resident and Ready; otherwise the residency's
    /// reason, or ResidencyNotFound / ModelNotFound).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    #[schemars(extend("x-kubernetes-list-type" = "map", "x-kubernetes-list-map-keys" = ["type"]))]
    pub conditions: Vec<Condition>,
}
