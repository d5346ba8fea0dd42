//! A local Kubernetes for tests, benchmarks and the demo: a real control
//! plane ([`control_plane`]) and a stand-in for the kubelet ([`kubelet`]),
//! the one part that cannot run here.

pub mod chart;
pub mod control_plane;
pub mod images;
pub mod kubelet;
pub mod lane;
pub mod model_server;
pub mod real_node;
pub mod registry;
pub mod tls;
pub mod vllm;

use crate::api::{
    ModelCatalog, ModelCopies, ModelDemand, ModelResidency, NodeModelCache, ResidencySet,
};
use k8s_openapi::apiextensions_apiserver::pkg::apis::apiextensions::v1::CustomResourceDefinition;
use kube::CustomResourceExt;
use kube::api::{Api, ListParams, Patch, PatchParams};
use std::time::Duration;

/// Installs (server-side applies) the ModelResidency, ModelDemand, ModelCopies and
/// NodeModelCache CRDs and waits until the API server serves the types,
/// which comes a moment after creation.
pub async fn install_crd(client: &kube::Client) -> Result<(), kube::Error> {
    let crds: Api<CustomResourceDefinition> = Api::all(client.clone());
    for crd in [
        ModelResidency::crd(),
        ModelCatalog::crd(),
        ResidencySet::crd(),
        ModelDemand::crd(),
        ModelCopies::crd(),
        NodeModelCache::crd(),
    ] {
        let name = crd.metadata.name.clone().unwrap_or_default();
        let pp = PatchParams::apply("model-residency-local").force();
        crds.patch(&name, &pp, &Patch::Apply(crd)).await?;
    }
    served::<ModelResidency>(client).await?;
    served::<ModelCatalog>(client).await?;
    served::<ResidencySet>(client).await?;
    served::<ModelDemand>(client).await?;
    served::<ModelCopies>(client).await?;
    served::<NodeModelCache>(client).await
}

async fn served<K>(client: &kube::Client) -> Result<(), kube::Error>
where
    K: kube::Resource<DynamicType = ()> + Clone + std::fmt::Debug + serde::de::DeserializeOwned,
{
    let api: Api<K> = Api::all(client.clone());
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
