//! The `ModelCatalog` custom resource (`residency.dev/v1alpha1`): models
//! declared once, in the very schema of a residency's `spec.models[]`
//! entry, for every residency in its namespace that names it in
//! `spec.catalog`. A residency's registry is then the catalog's entries
//! (all of them, or the ones `spec.catalog.models` lists) with its own
//! inline `spec.models` entries added, an inline entry overriding the
//! catalog's of the same name ([`crate::residency::catalog`]).

use super::ModelSpec;
use kube::CustomResource;
use schemars::JsonSchema;
use serde::{Deserialize, Serialize};

/// Models declared once for the residencies of a namespace.
#[derive(CustomResource, Serialize, Deserialize, Clone, Debug, PartialEq, JsonSchema)]
#[kube(
    group = "residency.dev",
    version = "v1alpha1",
    kind = "ModelCatalog",
    doc = "Models declared once, each entry what a ModelResidency's spec.models[] entry holds, for the residencies (and ResidencySets) in this namespace that name it in spec.catalog.",
    plural = "modelcatalogs",
    singular = "modelcatalog",
    shortname = "mcat",
    namespaced,
    status = "ModelCatalogStatus",
    printcolumn = r#"{"name":"Models","type":"integer","jsonPath":".status.models"}"#,
    printcolumn = r#"{"name":"Age","type":"date","jsonPath":".metadata.creationTimestamp"}"#
)]
#[serde(rename_all = "camelCase")]
pub struct ModelCatalogSpec {
    /// The models, at most 1000, each as a ModelResidency's spec.models[]
    /// entry (name, size, template, artifact, sleep, copies, keepAlive,
    /// loadTime, pinned). Keyed by name: the API server refuses a name
    /// listed twice.
    #[serde(default)]
    #[schemars(length(max = 1000), extend("x-kubernetes-list-type" = "map", "x-kubernetes-list-map-keys" = ["name"]))]
    pub models: Vec<ModelSpec>,
}

/// What the operator sees of a catalog.
#[derive(Serialize, Deserialize, Clone, Debug, Default, PartialEq, Eq, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct ModelCatalogStatus {
    /// Models in the catalog, as the operator last read it.
    #[serde(default)]
    pub models: u32,
    /// The spec generation this status reflects.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub observed_generation: Option<i64>,
}

/// A residency's use of a catalog (`spec.catalog`).
#[derive(Serialize, Deserialize, Clone, Debug, Default, PartialEq, Eq, Hash, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct CatalogRef {
    /// The ModelCatalog, in the residency's namespace.
    #[schemars(length(min = 1, max = 253))]
    pub name: String,
    /// The catalog's models this residency serves; unset: all of them. A
    /// name the catalog lacks leaves the residency Ready=False
    /// (CatalogUnavailable) and changes nothing until it is there.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(length(max = 1000))]
    pub models: Option<Vec<String>>,
}
