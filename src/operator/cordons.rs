//! Which nodes are cordoned (`spec.unschedulable`, as `kubectl cordon` and
//! a drain set it), for the GPUs' health (#70): a watch of only the
//! cordoned nodes' metadata (a field selector, so the rest of a large
//! fleet costs nothing), each change waking the residencies on that node.

use crate::api::ModelResidency;
use crate::controller::Context;
use futures::StreamExt;
use k8s_openapi::api::core::v1::Node;
use kube::api::{Api, PartialObjectMeta};
use kube::runtime::reflector::{self, ObjectRef};
use kube::runtime::{WatchStreamExt, watcher};
use std::sync::Arc;

/// The residencies to look at again as nodes are cordoned and uncordoned.
pub fn cordon_events(
    ctx: Arc<Context>,
    residencies: reflector::Store<ModelResidency>,
) -> futures::stream::BoxStream<'static, ObjectRef<ModelResidency>> {
    let nodes: Api<PartialObjectMeta<Node>> = Api::all(ctx.client.clone());
    let config = watcher::Config::default().fields("spec.unschedulable=true");
    watcher(nodes, config)
        .backoff(crate::cluster::WatchBackoff::default())
        .flat_map(move |event| {
            let touched: Vec<ObjectRef<ModelResidency>> = match &event {
                Ok(ev) => on_nodes(&residencies, &ctx.gpus.record_cordon(ev)),
                Err(e) => {
                    tracing::debug!(error = %e, "cordoned Node watch");
                    Vec::new()
                }
            };
            futures::stream::iter(touched)
        })
        .boxed()
}

/// The residencies whose pods are on one of `nodes`.
fn on_nodes(
    residencies: &reflector::Store<ModelResidency>,
    nodes: &[String],
) -> Vec<ObjectRef<ModelResidency>> {
    if nodes.is_empty() {
        return Vec::new();
    }
    residencies
        .state()
        .iter()
        .filter(|r| crate::residency::gpu::node_of(r).is_some_and(|n| nodes.iter().any(|c| c == n)))
        .map(|r| ObjectRef::from_obj(&**r))
        .collect()
}
