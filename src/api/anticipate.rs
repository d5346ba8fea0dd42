//! `spec.anticipate`: work ahead of demand (docs/anticipation.md).

use schemars::JsonSchema;
use serde::{Deserialize, Serialize};

/// `spec.anticipate`. Off by default: on the production traces of
/// docs/performance.md it cut the total wait to about a quarter, and about
/// 70% of the loads it made ahead left the GPU unused (GPU time and bytes
/// moved, but no request waits for them: they are the first victims).
#[derive(Serialize, Deserialize, Clone, Debug, Default, PartialEq, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct AnticipateSpec {
    /// Whether the operator loads and wakes models ahead of demand here.
    #[serde(default)]
    pub enabled: bool,
    /// Loads or wakes ahead of demand under way on this GPU at once
    /// (default 2).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(range(min = 1, max = 16))]
    pub in_flight: Option<u32>,
    /// The least chance, in percent, of a request within the next ten
    /// minutes (or the model's load time and a minute, when longer) that a
    /// load ahead is made for (default 50).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(range(min = 1, max = 100))]
    pub min_chance_percent: Option<u32>,
}

impl AnticipateSpec {
    /// The engine's limits for this spec.
    pub fn limits(&self) -> crate::engine::anticipation::Limits {
        let mut limits = crate::engine::anticipation::Limits::default();
        if let Some(n) = self.in_flight {
            limits.in_flight = n.clamp(1, 16) as usize;
        }
        if let Some(p) = self.min_chance_percent {
            limits.min_chance = f64::from(p.clamp(1, 100)) / 100.0;
        }
        limits
    }
}
