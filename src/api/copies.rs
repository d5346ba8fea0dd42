//! `spec.models[].copies`: how many GPUs hold copies of a model under load
//! (the policy is `crate::engine::copies`; the operator runs it).

use schemars::JsonSchema;
use serde::{Deserialize, Serialize};

/// Copies of this model on other residencies that list it (one per GPU),
/// added while its requests in flight, summed over every router, exceed
/// targetInFlight per copy, and removed one per scaleDownDelay when they
/// fall. Each copy is an ordinary resident of its GPU: its budget, eviction
/// and warm tier apply; a copy only evicts idle models. Omitted fields take
/// the operator's flags (--copies-*). Residencies that list the model
/// should agree: the first by namespace/name is read.
#[derive(Serialize, Deserialize, Clone, Debug, Default, PartialEq, JsonSchema)]
#[serde(rename_all = "camelCase")]
#[schemars(extend("x-kubernetes-validations" = min_not_above_max()))]
pub struct CopiesSpec {
    /// The fewest copies kept once the model is loaded (default 1). Copies
    /// above one are loaded even without traffic.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(range(min = 1, max = 1024))]
    pub min: Option<u32>,
    /// The most copies (default: every GPU that lists the model).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(range(min = 1, max = 1024))]
    pub max: Option<u32>,
    /// Requests in flight (held ones included) one copy should carry
    /// (default 100).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(range(min = 1, max = 1000000))]
    pub target_in_flight: Option<u32>,
    /// Time between two removals, and from an addition to a removal, as a
    /// duration (default 2m).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(length(min = 1, max = 32), extend("x-kubernetes-validations" = super::rules::duration()))]
    pub scale_down_delay: Option<String>,
}

fn min_not_above_max() -> serde_json::Value {
    serde_json::json!([{
        "rule": "!has(self.min) || !has(self.max) || self.min <= self.max",
        "message": "copies.min is above copies.max",
    }])
}
