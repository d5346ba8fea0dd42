//! A local Kubernetes for tests, benchmarks and the demo: a real control
//! plane ([`control_plane`]) and a stand-in for the kubelet ([`kubelet`]),
//! the one part that cannot run here.

pub mod control_plane;
pub mod kubelet;

use crate::api::ModelResidency;
use k8s_openapi::apiextensions_apiserver::pkg::apis::apiextensions::v1::CustomResourceDefinition;
use kube::CustomResourceExt;
use kube::api::{Api, ListParams, Patch, PatchParams};
use std::time::Duration;

/// Installs (server-side applies) the ModelResidency CRD and waits until
/// the API server serves the type, which comes a moment after creation.
pub async fn install_crd(client: &kube::Client) -> Result<(), kube::Error> {
    let crds: Api<CustomResourceDefinition> = Api::all(client.clone());
    crds.patch(
        "modelresidencies.residency.dev",
        &PatchParams::apply("model-residency-local").force(),
        &Patch::Apply(ModelResidency::crd()),
    )
    .await?;
    let api: Api<ModelResidency> = Api::all(client.clone());
    let mut attempts = 0;
    loop {
        match api.list(&ListParams::default().limit(1)).await {
            Ok(_) => return Ok(()),
            Err(e) if attempts >= 300 => return Err(e),
            Err(_) => attempts += 1,
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}
