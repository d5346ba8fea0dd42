//! The `ModelCopies` custom resource (`residency.dev/v1alpha1`): the copies
//! of one model across the residencies (in its namespace) that list it,
//! with a `/scale` subresource, so HPA, KEDA and `kubectl scale` can own the
//! count instead of the operator's built-in signal.
//!
//! Semantics: while a ModelCopies names a model, the copy scaler stands
//! down for it (its in-flight signal is still read and exported) and keeps
//! `spec.replicas` copies: 0 removes every copy (the last one once the
//! routers count no request for the model: 0 never strands traffic), 1 loads
//! the model where a request would (the router's placement), more adds
//! copies where the scaler would (a wake, room, idle models only) and
//! removes the least recently requested ones first, each drained before
//! it goes. Status: `replicas` counts the Ready copies, `selector` selects
//! the model's pods.

use k8s_openapi::apimachinery::pkg::apis::meta::v1::Condition;
use kube::CustomResource;
use schemars::JsonSchema;
use serde::{Deserialize, Serialize};

/// How many GPUs hold copies of one model, for HPA, KEDA and kubectl scale.
#[derive(CustomResource, Serialize, Deserialize, Clone, Debug, PartialEq, JsonSchema)]
#[kube(
    group = "residency.dev",
    version = "v1alpha1",
    kind = "ModelCopies",
    doc = "The copies of one model across the ModelResidencies (in this namespace) that list it, with a /scale subresource: while it exists, replicas is the number of copies the operator keeps (0 unloads the model everywhere), instead of the routers' in-flight signal.",
    plural = "modelcopies",
    singular = "modelcopies",
    shortname = "mcopies",
    namespaced,
    status = "ModelCopiesStatus",
    scale(
        spec_replicas_path = ".spec.replicas",
        status_replicas_path = ".status.replicas",
        label_selector_path = ".status.selector"
    ),
    printcolumn = r#"{"name":"Model","type":"string","jsonPath":".spec.model"}"#,
    printcolumn = r#"{"name":"Wanted","type":"integer","jsonPath":".spec.replicas"}"#,
    printcolumn = r#"{"name":"Ready","type":"integer","jsonPath":".status.replicas"}"#,
    printcolumn = r#"{"name":"Message","type":"string","jsonPath":".status.message","priority":1}"#,
    printcolumn = r#"{"name":"Age","type":"date","jsonPath":".metadata.creationTimestamp"}"#
)]
#[serde(rename_all = "camelCase")]
pub struct ModelCopiesSpec {
    /// The model: a name in the spec.models of the residencies (in this
    /// namespace) that may hold its copies.
    #[schemars(length(min = 1, max = 63), extend("x-kubernetes-validations" = super::rules::model_name()))]
    pub model: String,
    /// The copies to keep, one per GPU (more than the GPUs listing the
    /// model is as many as there are).
    #[serde(default)]
    #[schemars(range(min = 0, max = 1024))]
    pub replicas: i32,
}

/// What the operator sees of the model's copies.
#[derive(Serialize, Deserialize, Clone, Debug, Default, PartialEq, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct ModelCopiesStatus {
    /// Ready copies (the model Loaded, its pod Ready).
    #[serde(default)]
    pub replicas: i32,
    /// A label selector (as a string) matching the model's pods, for HPA.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub selector: Option<String>,
    /// The residencies holding a copy (serving or on its way), as
    /// namespace/name.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub residencies: Vec<String>,
    /// Why the copies are not what spec.replicas asks, when they are not
    /// (no GPU can take another, the model is listed nowhere).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub message: Option<String>,
    /// The spec generation this status reflects.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub observed_generation: Option<i64>,
    /// Ready: True while the copies are what spec.replicas asks; False
    /// with the message otherwise (CopiesShort), or DuplicateModelCopies
    /// while an older ModelCopies in this namespace holds the model (this
    /// one is then ignored).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    #[schemars(extend("x-kubernetes-list-type" = "map", "x-kubernetes-list-map-keys" = ["type"]))]
    pub conditions: Vec<Condition>,
}
