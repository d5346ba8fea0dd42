//! Copies owned by a `ModelCopies` object (HPA, KEDA, `kubectl scale`):
//! its `spec.replicas` is the count, and its status says what is there.

use super::{InFlight, ModelKey, Scaler, enact, holds_copy};
use crate::api::{ModelCopies, ModelCopiesStatus, ModelResidency, ModelState};
use crate::residency::conditions::{ConditionSet, READY};
use crate::residency::labels::MODEL_LABEL;
use crate::residency::placement::{Placement, place, residency_key};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::Condition;
use k8s_openapi::jiff::Timestamp;
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

/// Each ModelCopies with the one that holds its model when that is
/// another: one model, one owner. The oldest (creation time, then name) of
/// those naming a model in a namespace holds it; the others stand aside
/// (`Some(holder)`), as a second ModelDemand for one key does: two counts
/// for one model fought for ever (24 adds and as many removals in 64 s).
pub(super) fn holders(mut all: Vec<ModelCopies>) -> Vec<(ModelCopies, Option<String>)> {
    all.sort_by(|a, b| {
        let key = |m: &ModelCopies| {
            (
                m.namespace(),
                m.spec.model.clone(),
                m.metadata.creation_timestamp.clone(),
                m.name_any(),
            )
        };
        key(a).cmp(&key(b))
    });
    let mut first: HashMap<ModelKey, String> = HashMap::new();
    all.into_iter()
        .map(|mc| {
            let key = (mc.namespace().unwrap_or_default(), mc.spec.model.clone());
            let holder = match first.get(&key) {
                Some(h) => Some(h.clone()),
                None => {
                    first.insert(key, mc.name_any());
                    None
                }
            };
            (mc, holder)
        })
        .collect()
}

/// `mc`'s Ready condition, its transition time kept while its status
/// stays (a status that is the same is not written).
fn ready_condition(mc: &ModelCopies, ready: bool, reason: &str, message: String) -> Vec<Condition> {
    let previous = mc.status.as_ref().map_or(&[][..], |s| &s.conditions[..]);
    let mut set = ConditionSet::new(previous, mc.metadata.generation, Timestamp::now());
    set.set(READY, ready, reason, message);
    set.finish()
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
        key: &ModelKey,
        homes: &[Arc<ModelResidency>],
        in_flight: &InFlight,
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
            why = self.add(key, homes, missing, in_flight, &policy).await.1;
        } else if copies.len() > wanted {
            let requests = in_flight.get(key).copied().unwrap_or(0.0);
            if wanted == 0 && copies.len() == 1 && (requests > 0.0 || !complete) {
                why = Some(if complete {
                    format!(
                        "the last copy stays while {requests} requests for {model} are in flight"
                    )
                } else {
                    format!(
                        "the last copy stays while a router's count of {model} is unread: {}",
                        self.unread.join(", ")
                    )
                });
            } else {
                self.remove(model, homes, &copies);
            }
        }
        self.set_unplaced(key, homes, why.clone()).await;
        let status = self.status_of(mc, homes, why);
        self.write_status(mc, status).await;
    }

    /// A ModelCopies that stands aside for `holder`: it keeps nothing and
    /// says who holds its model.
    pub(super) async fn write_duplicate(&self, mc: &ModelCopies, holder: &str) {
        let model = &mc.spec.model;
        let message = format!(
            "ModelCopies {holder:?} already holds {model} in this namespace; this one is ignored while that one exists"
        );
        let status = ModelCopiesStatus {
            replicas: 0,
            selector: Some(format!("{MODEL_LABEL}={model}")),
            residencies: Vec::new(),
            conditions: ready_condition(mc, false, "DuplicateModelCopies", message.clone()),
            message: Some(message),
            observed_generation: mc.metadata.generation,
        };
        self.write_status(mc, status).await;
    }

    /// `mc`'s status: the Ready copies, the selector of the model's pods,
    /// where its copies are, and why they are short.
    fn status_of(
        &self,
        mc: &ModelCopies,
        homes: &[Arc<ModelResidency>],
        message: Option<String>,
    ) -> ModelCopiesStatus {
        let model = mc.spec.model.as_str();
        let ready = homes
            .iter()
            .filter(|r| serves(r, model) && !self.is_draining(r, model))
            .count();
        ModelCopiesStatus {
            replicas: i32::try_from(ready).unwrap_or(i32::MAX),
            selector: Some(format!("{MODEL_LABEL}={model}")),
            residencies: homes
                .iter()
                .filter(|r| holds_copy(r, model))
                .map(|r| residency_key(r))
                .collect(),
            conditions: match &message {
                None => ready_condition(mc, true, "CopiesKept", String::new()),
                Some(m) => ready_condition(mc, false, "CopiesShort", m.clone()),
            },
            message,
            observed_generation: mc.metadata.generation,
        }
    }

    /// Writes `mc`'s status when it changed.
    async fn write_status(&self, mc: &ModelCopies, status: ModelCopiesStatus) {
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
