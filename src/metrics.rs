//! Prometheus metrics, prefixed `model_residency_`, in seconds and bytes.
//!
//! Per residency (labels `namespace`, `residency`): budget, used and peak
//! bytes, resident models, and the hits, loads, evictions, refusals and
//! unloads totals (exported from status, so they survive restarts of the
//! operator as one counter reset). Per controller: reconcile duration,
//! reconcile errors by reason, model load duration (pod created to Ready).

use crate::api::{Counters, ModelResidencyStatus};
use crate::quantity::parse_bytes;
use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::metrics::histogram::{Histogram, exponential_buckets};
use prometheus_client::registry::Registry;
use std::collections::HashMap;
use std::sync::Mutex;
use std::sync::atomic::AtomicU64;
use std::time::Instant;

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct ResidencyLabels {
    pub namespace: String,
    pub residency: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct ErrorLabels {
    pub reason: String,
}

pub struct Metrics {
    registry: Registry,
    budget: Family<ResidencyLabels, Gauge<u64, AtomicU64>>,
    used: Family<ResidencyLabels, Gauge<u64, AtomicU64>>,
    peak: Family<ResidencyLabels, Gauge<u64, AtomicU64>>,
    resident: Family<ResidencyLabels, Gauge>,
    hits: Family<ResidencyLabels, Counter>,
    loads: Family<ResidencyLabels, Counter>,
    evictions: Family<ResidencyLabels, Counter>,
    refusals: Family<ResidencyLabels, Counter>,
    unloads: Family<ResidencyLabels, Counter>,
    reconcile_duration: Histogram,
    reconcile_errors: Family<ErrorLabels, Counter>,
    load_duration: Histogram,
    /// The counters last exported per residency, to export deltas.
    exported: Mutex<HashMap<ResidencyLabels, Counters>>,
}

impl Default for Metrics {
    fn default() -> Self {
        Self::new()
    }
}

impl Metrics {
    pub fn new() -> Self {
        let mut registry = Registry::with_prefix("model_residency");
        let m = Metrics {
            budget: Family::default(),
            used: Family::default(),
            peak: Family::default(),
            resident: Family::default(),
            hits: Family::default(),
            loads: Family::default(),
            evictions: Family::default(),
            refusals: Family::default(),
            unloads: Family::default(),
            reconcile_duration: Histogram::new(exponential_buckets(0.001, 2.0, 14)),
            reconcile_errors: Family::default(),
            load_duration: Histogram::new(exponential_buckets(0.1, 2.0, 14)),
            exported: Mutex::default(),
            registry: Registry::default(),
        };
        registry.register("budget_bytes", "VRAM budget of the GPU", m.budget.clone());
        registry.register(
            "used_bytes",
            "VRAM declared by resident models",
            m.used.clone(),
        );
        registry.register(
            "peak_bytes",
            "Most VRAM ever declared at once",
            m.peak.clone(),
        );
        registry.register(
            "resident_models",
            "Models holding VRAM (loaded, loading or failed)",
            m.resident.clone(),
        );
        registry.register(
            "hits",
            "Requests for an already resident model",
            m.hits.clone(),
        );
        registry.register("loads", "Models loaded", m.loads.clone());
        registry.register(
            "evictions",
            "Models evicted to make room or by a budget shrink",
            m.evictions.clone(),
        );
        registry.register("refusals", "Requests refused", m.refusals.clone());
        registry.register(
            "unloads",
            "Models unloaded by demand removal or registry removal",
            m.unloads.clone(),
        );
        registry.register(
            "reconcile_duration_seconds",
            "Time to reconcile one residency",
            m.reconcile_duration.clone(),
        );
        registry.register(
            "reconcile_errors",
            "Failed reconciles by reason",
            m.reconcile_errors.clone(),
        );
        registry.register(
            "model_load_duration_seconds",
            "Time from a model pod's creation to Ready",
            m.load_duration.clone(),
        );
        Metrics { registry, ..m }
    }

    /// Exports a residency's status.
    pub fn observe_status(&self, namespace: &str, residency: &str, s: &ModelResidencyStatus) {
        let labels = ResidencyLabels {
            namespace: namespace.into(),
            residency: residency.into(),
        };
        let bytes =
            |q: &Option<String>| q.as_deref().and_then(|q| parse_bytes(q).ok()).unwrap_or(0);
        self.budget.get_or_create(&labels).set(bytes(&s.budget));
        self.used.get_or_create(&labels).set(bytes(&s.used));
        self.peak.get_or_create(&labels).set(bytes(&s.peak));
        self.resident
            .get_or_create(&labels)
            .set(i64::from(s.resident));
        let mut exported = self.exported.lock().expect("metrics lock");
        let last = exported.entry(labels.clone()).or_default();
        let c = s.counters;
        for (family, now, before) in [
            (&self.hits, c.hits, &mut last.hits),
            (&self.loads, c.loads, &mut last.loads),
            (&self.evictions, c.evictions, &mut last.evictions),
            (&self.refusals, c.refusals, &mut last.refusals),
            (&self.unloads, c.unloads, &mut last.unloads),
        ] {
            // A lower value means the object was recreated: count on.
            let delta = now.checked_sub(*before).unwrap_or(now);
            family.get_or_create(&labels).inc_by(delta);
            *before = now;
        }
    }

    /// Forgets a deleted residency.
    pub fn forget(&self, namespace: &str, residency: &str) {
        let labels = ResidencyLabels {
            namespace: namespace.into(),
            residency: residency.into(),
        };
        for f in [&self.budget, &self.used, &self.peak] {
            f.remove(&labels);
        }
        self.resident.remove(&labels);
        for f in [
            &self.hits,
            &self.loads,
            &self.evictions,
            &self.refusals,
            &self.unloads,
        ] {
            f.remove(&labels);
        }
        self.exported.lock().expect("metrics lock").remove(&labels);
    }

    pub fn reconcile_error(&self, reason: &str) {
        self.reconcile_errors
            .get_or_create(&ErrorLabels {
                reason: reason.into(),
            })
            .inc();
    }

    pub fn model_loaded(&self, seconds: f64) {
        self.load_duration.observe(seconds);
    }

    /// A guard that records the reconcile's duration when dropped.
    pub fn reconcile_timer(&self) -> ReconcileTimer<'_> {
        ReconcileTimer {
            metrics: self,
            start: Instant::now(),
        }
    }

    /// The OpenMetrics text exposition.
    pub fn encode(&self) -> String {
        let mut out = String::new();
        prometheus_client::encoding::text::encode(&mut out, &self.registry)
            .expect("writing to a String cannot fail");
        out
    }
}

pub struct ReconcileTimer<'a> {
    metrics: &'a Metrics,
    start: Instant,
}

impl Drop for ReconcileTimer<'_> {
    fn drop(&mut self) {
        self.metrics
            .reconcile_duration
            .observe(self.start.elapsed().as_secs_f64());
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn exports_status_and_counts_deltas() {
        let m = Metrics::new();
        let mut s = ModelResidencyStatus {
            budget: Some("16000Mi".into()),
            used: Some("13900Mi".into()),
            peak: Some("13900Mi".into()),
            resident: 2,
            ..Default::default()
        };
        s.counters.loads = 2;
        m.observe_status("models", "gpu0", &s);
        s.counters.loads = 3;
        m.observe_status("models", "gpu0", &s);
        let text = m.encode();
        let labels = r#"{namespace="models",residency="gpu0"}"#;
        for want in [
            format!("model_residency_budget_bytes{labels} {}", 16000u64 << 20),
            format!("model_residency_used_bytes{labels} {}", 13900u64 << 20),
            format!("model_residency_resident_models{labels} 2"),
            format!("model_residency_loads_total{labels} 3"),
            format!("model_residency_evictions_total{labels} 0"),
        ] {
            assert!(text.contains(&want), "{want} missing in\n{text}");
        }
        {
            let _t = m.reconcile_timer();
        }
        m.reconcile_error("kube");
        let text = m.encode();
        assert!(
            text.contains("model_residency_reconcile_duration_seconds_count 1"),
            "{text}"
        );
        assert!(
            text.contains(r#"model_residency_reconcile_errors_total{reason="kube"} 1"#),
            "{text}"
        );
        m.forget("models", "gpu0");
        assert!(!m.encode().contains("gpu0"));
    }
}
