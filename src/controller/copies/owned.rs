//! Copies owned by a `ModelCopies` object (HPA, KEDA, `kubectl scale`):
//! its `spec.replicas` is the count, and its status says what is there.

use super::{Scaler, enact, holds_copy};
use crate::api::{ModelCopies, ModelCopiesStatus, ModelResidency, ModelState};
use crate::residency::labels::MODEL_LABEL;
use crate::residency::placement::{Placement, place, residency_key};
use kube::ResourceExt;
use kube::api::{Api, ListParams, Patch, PatchParams};
use std::collections::HashMap;
use std::sync::Arc;

/// Every ModelCopies the operator watches (none when the kind is not
/// installed or not readable: the built-in signal then has every model).
pub(super) async fn list(scaler: &Scaler) -> Vec<ModelCopies> {
    let api: Api<ModelCopies> =
        crate::cluster::api_in(&scaler.ctx.client, scaler.namespace.as_deref());
    match api.list(&ListParams::default()).await {
        Ok(list) => list.items,
        Err(e) => {
            tracing::debug!(error = %e, "copies: no ModelCopies read");
            Vec::new()
        }
    }
}

/// Whether `r` serves `model` now: Loaded there.
fn serves(r: &ModelResidency, model: &str) -> bool {
    r.model_state(model) == ModelState::Loaded
}

impl Scaler {
    /// One tick for a model `mc` owns: one step towards `spec.replicas`
    /// (adding all that are missing at once, removing one at a time, each
    /// drained), then its status. `homes` are the model's homes in `mc`'s
    /// namespace. The last copy stays while the routers count requests for
    /// the model, or while one of them went unread (`complete` false): 0
    /// stops the model once it is idle, as a ModelDemand at 0 never vetoes
    /// traffic (a request to the router loads a copy on its own, and an
    /// autoscaler's 0 can trail that request by its polling interval).
    pub(super) async fn owned_round(
        &mut self,
        mc: &ModelCopies,
        homes: &[Arc<ModelResidency>],
        in_flight: &HashMap<String, f64>,
        complete: bool,
    ) {
        let model = mc.spec.model.as_str();
        let copies = self.copies_of(model, homes);
        let wanted = usize::try_from(mc.spec.replicas).unwrap_or(0);
        let mut why = None;
        if homes.is_empty() {
            why = Some(format!("no ModelResidency in this namespace lists {model}"));
        } else if copies.is_empty() && wanted > 0 {
            // The first copy goes where a request would load it.
            let listed: Vec<&ModelResidency> = homes.iter().map(|r| &**r).collect();
            match place(model, &listed, &[]) {
                Placement::On(i) => {
                    enact::request(&self.ctx, &homes[i], model).await;
                }
                Placement::Nowhere { why: w, .. } => why = Some(w),
            }
        } else if copies.len() < wanted {
            let missing = u32::try_from(wanted - copies.len()).unwrap_or(u32::MAX);
            let policy = self.config.defaults;
            why = self.add(model, homes, missing, in_flight, &policy).await.1;
        } else if copies.len() > wanted {
            let requests = in_flight.get(model).copied().unwrap_or(0.0);
            if wanted == 0 && copies.len() == 1 && (requests > 0.0 || !complete) {
                why = Some(if complete {
                    format!(
                        "the last copy stays while {requests} requests for {model} are in flight"
                    )
                } else {
                    format!("the last copy stays while a router's count of {model} is unread")
                });
            } else {
                self.remove(model, homes, &copies);
            }
        }
        self.set_unplaced(model, homes, why.clone()).await;
        self.write_status(mc, homes, why).await;
    }

    /// Writes `mc`'s status when it changed: the Ready copies, the
    /// selector of the model's pods, where its copies are, and why they
    /// are short.
    async fn write_status(
        &self,
        mc: &ModelCopies,
        homes: &[Arc<ModelResidency>],
        message: Option<String>,
    ) {
        let model = mc.spec.model.as_str();
        let ready = homes
            .iter()
            .filter(|r| serves(r, model) && !self.is_draining(r, model))
            .count();
        let status = ModelCopiesStatus {
            replicas: i32::try_from(ready).unwrap_or(i32::MAX),
            selector: Some(format!("{MODEL_LABEL}={model}")),
            residencies: homes
                .iter()
                .filter(|r| holds_copy(r, model))
                .map(|r| residency_key(r))
                .collect(),
            message,
            observed_generation: mc.metadata.generation,
        };
        if mc.status.as_ref() == Some(&status) {
            return;
        }
        let api: Api<ModelCopies> =
            Api::namespaced(self.ctx.client.clone(), &mc.namespace().unwrap_or_default());
        // A merge patch: what is gone must be said (null, an empty list).
        let mut body = serde_json::to_value(&status).expect("a status serializes");
        body["message"] = serde_json::json!(status.message);
        body["residencies"] = serde_json::json!(status.residencies);
        let patch = serde_json::json!({ "status": body });
        self.ctx.metrics.api_request("patch", "modelcopies/status");
        if let Err(e) = api
            .patch_status(
                &mc.name_any(),
                &PatchParams::default(),
                &Patch::Merge(&patch),
            )
            .await
        {
            tracing::warn!(name = %mc.name_any(), error = %e, "copies: could not write a ModelCopies status");
        }
    }
}
