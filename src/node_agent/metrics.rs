//! The node agent's Prometheus metrics (prefix `model_residency_node_agent_`),
//! served on its `/metrics`: downloads by result, bytes fetched, download
//! time, evictions from the disk, and the disk budget, what the artifacts
//! take of it and how many are in each state (as its `NodeModelCache`
//! status says, for dashboards and alerts that do not read objects).

use crate::api::{ArtifactState, NodeModelCacheStatus};
use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::metrics::histogram::{Histogram, exponential_buckets};
use prometheus_client::registry::Registry;

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct ResultLabels {
    /// `Fetched`, or the failure's reason as the status shows it
    /// (`DownloadFailed`, `ChecksumMismatch`, `SourceNotAllowed`, ...).
    pub result: &'static str,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct StateLabels {
    pub state: &'static str,
}

pub struct AgentMetrics {
    registry: Registry,
    pub fetches: Family<ResultLabels, Counter>,
    pub fetched_bytes: Counter,
    pub resumed_bytes: Counter,
    pub shared_bytes: Counter,
    pub fetch_duration: Histogram,
    pub evictions: Counter,
    budget: Gauge,
    used: Gauge,
    artifacts: Family<StateLabels, Gauge>,
}

/// Every state, so a state with no artifact exports 0 rather than
/// vanishing.
const STATES: [ArtifactState; 6] = [
    ArtifactState::Fetching,
    ArtifactState::Ready,
    ArtifactState::Failed,
    ArtifactState::Refused,
    ArtifactState::Waiting,
    ArtifactState::Evicted,
];

fn state_name(s: ArtifactState) -> &'static str {
    match s {
        ArtifactState::Fetching => "Fetching",
        ArtifactState::Ready => "Ready",
        ArtifactState::Failed => "Failed",
        ArtifactState::Refused => "Refused",
        ArtifactState::Waiting => "Waiting",
        ArtifactState::Evicted => "Evicted",
    }
}

impl Default for AgentMetrics {
    fn default() -> Self {
        let mut registry = Registry::with_prefix("model_residency_node_agent");
        let m = AgentMetrics {
            fetches: Family::default(),
            fetched_bytes: Counter::default(),
            resumed_bytes: Counter::default(),
            shared_bytes: Counter::default(),
            // 100 ms .. ~55 min: artifacts run to tens of GiB.
            fetch_duration: Histogram::new(exponential_buckets(0.1, 2.0, 16)),
            evictions: Counter::default(),
            budget: Gauge::default(),
            used: Gauge::default(),
            artifacts: Family::default(),
            registry: Registry::default(),
        };
        registry.register(
            "fetches",
            "Artifact downloads finished, by result (Fetched, or the failure's reason)",
            m.fetches.clone(),
        );
        registry.register(
            "fetched_bytes",
            "Bytes downloaded for artifacts that were then verified",
            m.fetched_bytes.clone(),
        );
        registry.register(
            "resumed_bytes",
            "Bytes of verified artifacts kept from a download cut short (a lost connection, a restart) rather than fetched again",
            m.resumed_bytes.clone(),
        );
        registry.register(
            "shared_bytes",
            "Bytes of artifacts linked from the node's blob store (another artifact holds the same file or layer) rather than fetched",
            m.shared_bytes.clone(),
        );
        registry.register(
            "fetch_duration_seconds",
            "Time an artifact's download and verification took, failed ones included",
            m.fetch_duration.clone(),
        );
        registry.register(
            "evictions",
            "Artifacts removed from the disk to make room",
            m.evictions.clone(),
        );
        registry.register(
            "disk_budget_bytes",
            "The most the artifacts may declare together on this node (--disk-budget)",
            m.budget.clone(),
        );
        registry.register(
            "disk_used_bytes",
            "Declared sizes of the artifacts on the disk or being fetched to it",
            m.used.clone(),
        );
        registry.register(
            "artifacts",
            "Artifacts the agent knows of, by state",
            m.artifacts.clone(),
        );
        AgentMetrics { registry, ..m }
    }
}

impl AgentMetrics {
    /// Sets the gauges from what the agent publishes.
    pub fn observe(&self, budget: u64, used: u64, status: &NodeModelCacheStatus) {
        self.budget.set(gauge_value(budget));
        self.used.set(gauge_value(used));
        for s in STATES {
            let n = status.artifacts.iter().filter(|a| a.state == s).count();
            self.artifacts
                .get_or_create(&StateLabels {
                    state: state_name(s),
                })
                .set(gauge_value(n as u64));
        }
    }

    pub fn encode(&self) -> String {
        crate::exposition::exposition(&self.registry)
    }
}

fn gauge_value(n: u64) -> i64 {
    i64::try_from(n).unwrap_or(i64::MAX)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::api::CachedArtifact;

    #[test]
    fn gauges_follow_the_published_status() {
        let m = AgentMetrics::default();
        let artifact = |state| CachedArtifact {
            state,
            ..Default::default()
        };
        let status = NodeModelCacheStatus {
            artifacts: vec![
                artifact(ArtifactState::Ready),
                artifact(ArtifactState::Ready),
                artifact(ArtifactState::Failed),
            ],
            ..Default::default()
        };
        m.observe(10 << 30, 3 << 30, &status);
        m.fetches
            .get_or_create(&ResultLabels { result: "Fetched" })
            .inc();
        let text = m.encode();
        for line in [
            "model_residency_node_agent_disk_budget_bytes 10737418240",
            "model_residency_node_agent_disk_used_bytes 3221225472",
            "model_residency_node_agent_artifacts{state=\"Ready\"} 2",
            "model_residency_node_agent_artifacts{state=\"Failed\"} 1",
            "model_residency_node_agent_artifacts{state=\"Evicted\"} 0",
            "model_residency_node_agent_fetches_total{result=\"Fetched\"} 1",
        ] {
            assert!(text.contains(line), "{line} not in\n{text}");
        }
    }
}
