//! The router's Prometheus metrics (prefix `model_residency_router_`).
//! Every request is counted here, whatever the recency resolution: the
//! residency's own hit counter counts only the requests written to it.

use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::metrics::histogram::{Histogram, exponential_buckets};
use prometheus_client::registry::Registry;

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct CodeLabels {
    pub model: String,
    pub code: u16,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct ModelLabels {
    pub model: String,
}

/// A model as its residencies' namespace names it: the in-flight count's
/// labels (namespace empty when the router serves the name from several).
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct NamespacedLabels {
    pub namespace: String,
    pub model: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct WriteLabels {
    /// `cold` (a load), `recency` (a hit's refresh) or `refused` (a
    /// request no GPU can take, written so its residencies record it).
    pub kind: &'static str,
}

/// What a held request waited for.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct HoldLabels {
    /// `cold` (a load) or `warm` (a wake: the model slept on one of its
    /// GPUs when the request came).
    pub kind: &'static str,
}

/// An adapter and its base model.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct AdapterLabels {
    pub model: String,
    pub adapter: String,
}

type HoldHistograms = Family<HoldLabels, Histogram, fn() -> Histogram>;

fn hold_histogram() -> Histogram {
    // 10 ms .. ~20 min: model loads are slow.
    Histogram::new(exponential_buckets(0.01, 2.0, 17))
}

pub struct RouterMetrics {
    registry: Registry,
    pub requests: Family<CodeLabels, Counter>,
    pub duration: Histogram,
    pub hold: HoldHistograms,
    pub cold_starts: Family<ModelLabels, Counter>,
    pub pending: Family<ModelLabels, Gauge>,
    pub in_flight: Family<NamespacedLabels, Gauge>,
    pub upstream_errors: Family<ModelLabels, Counter>,
    pub demand_writes: Family<WriteLabels, Counter>,
    pub demand_write_errors: Counter,
    pub adapter_hits: Family<AdapterLabels, Counter>,
    pub adapter_loads: Family<AdapterLabels, Counter>,
    pub adapter_load_failures: Family<AdapterLabels, Counter>,
    pub adapter_evictions: Family<AdapterLabels, Counter>,
    pub adapter_load_seconds: Histogram,
}

impl Default for RouterMetrics {
    fn default() -> Self {
        let mut registry = Registry::with_prefix("model_residency_router");
        let m = RouterMetrics {
            requests: Family::default(),
            // 1 ms .. ~16 s for proxied answers (a stream lasts as long as
            // it streams); loads are in `hold`.
            duration: Histogram::new(exponential_buckets(0.001, 2.0, 15)),
            hold: Family::new_with_constructor(hold_histogram),
            cold_starts: Family::default(),
            pending: Family::default(),
            in_flight: Family::default(),
            upstream_errors: Family::default(),
            demand_writes: Family::default(),
            demand_write_errors: Counter::default(),
            adapter_hits: Family::default(),
            adapter_loads: Family::default(),
            adapter_load_failures: Family::default(),
            adapter_evictions: Family::default(),
            // 1 ms .. ~16 s: an adapter's load reads a few MiB from disk.
            adapter_load_seconds: Histogram::new(exponential_buckets(0.001, 2.0, 15)),
            registry: Registry::default(),
        };
        registry.register(
            "requests",
            "Requests answered, by model and status code (the router's own errors included; model is empty when the request named none the router serves)",
            m.requests.clone(),
        );
        registry.register(
            "request_duration_seconds",
            "Time from a request's arrival to the end of its answer",
            m.duration.clone(),
        );
        registry.register(
            "hold_seconds",
            "Time a request waited for its model to load (kind=cold) or wake (kind=warm)",
            m.hold.clone(),
        );
        registry.register(
            "cold_starts",
            "Requests that found their model not ready and waited for a load",
            m.cold_starts.clone(),
        );
        registry.register(
            "pending_requests",
            "Requests waiting for their model to load now",
            m.pending.clone(),
        );
        registry.register(
            "in_flight_requests",
            "Requests for a model from their arrival to the end of their answer, those held for a load or a wake included: the signal its copies scale on (summed over every router replica); namespace is that of the model's residencies, empty when this router serves the name from several namespaces (then no copy follows it)",
            m.in_flight.clone(),
        );
        registry.register(
            "upstream_errors",
            "Requests whose model pod could not be reached or broke off",
            m.upstream_errors.clone(),
        );
        registry.register(
            "demand_writes",
            "Requests written into a residency's spec.demand, by kind (cold: a load; recency: a hit's refresh; refused: a request no GPU can take)",
            m.demand_writes.clone(),
        );
        registry.register(
            "demand_write_errors",
            "Demand writes the API server did not take",
            m.demand_write_errors.clone(),
        );
        registry.register(
            "adapter_hits",
            "Requests for a LoRA adapter sent to a pod that held it",
            m.adapter_hits.clone(),
        );
        registry.register(
            "adapter_loads",
            "LoRA adapters loaded into a pod by this router (the server's load call answered)",
            m.adapter_loads.clone(),
        );
        registry.register(
            "adapter_load_failures",
            "LoRA adapter loads the server refused or did not answer",
            m.adapter_load_failures.clone(),
        );
        registry.register(
            "adapter_evictions",
            "LoRA adapters unloaded from a pod to make room for another",
            m.adapter_evictions.clone(),
        );
        registry.register(
            "adapter_load_seconds",
            "Time of an adapter's load call, an eviction's unload before it included",
            m.adapter_load_seconds.clone(),
        );
        RouterMetrics { registry, ..m }
    }
}

impl RouterMetrics {
    pub fn encode(&self) -> String {
        crate::exposition::exposition(&self.registry)
    }

    /// The sum of a metric's samples whose labels contain `labels`.
    pub fn sum_where(&self, metric: &str, labels: &str) -> u64 {
        crate::exposition::sum_where(&self.encode(), metric, labels)
    }
}
