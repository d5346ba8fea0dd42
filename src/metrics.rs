//! Prometheus metrics, prefixed `model_residency_`, in seconds and bytes.
//!
//! Per residency (labels `namespace`, `residency`): budget, used and peak
//! bytes, resident models, and the hits, loads, evictions, refusals and
//! unloads totals (exported from status, so they survive restarts of the
//! operator as one counter reset). Per controller: reconciles, reconcile
//! duration, reconcile errors by reason, API requests by verb and resource
//! (every request the reconciler makes; watches aside), model load duration
//! (pod created to Ready). Tests and benchmarks read these too, through
//! [`Metrics::sum`], so there is one count of everything.

use crate::api::Counters;
use crate::exposition::{exposition, sum_where};
use crate::residency::state::Usage;
use prometheus_client::collector::Collector;
use prometheus_client::encoding::{DescriptorEncoder, EncodeLabelSet, EncodeMetric};
use prometheus_client::metrics::MetricType;
use prometheus_client::metrics::counter::{ConstCounter, Counter};
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::{ConstGauge, Gauge};
use prometheus_client::metrics::histogram::{Histogram, exponential_buckets};
use prometheus_client::registry::Registry;
use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::Instant;

/// The exposition names of the reconciler's own counts (for [`Metrics::sum`]).
pub const API_REQUESTS: &str = "model_residency_api_requests_total";
pub const RECONCILES: &str = "model_residency_reconciles_total";

#[derive(Clone, Debug, Hash, PartialEq, Eq, PartialOrd, Ord, EncodeLabelSet)]
pub struct ResidencyLabels {
    pub namespace: String,
    pub residency: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct ErrorLabels {
    pub reason: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct RequestLabels {
    pub verb: &'static str,
    pub resource: &'static str,
}

/// What is exported for one residency.
#[derive(Clone, Copy, Debug, Default)]
struct Snapshot {
    budget: u64,
    used: u64,
    peak: u64,
    resident: u32,
    gpu_conflict: bool,
    gpu_unhealthy: bool,
    /// Exported totals: they only grow, even when the object is recreated.
    totals: Counters,
    /// The status counters last seen, to add their growth to `totals`.
    last: Counters,
}

/// What one model holds on its GPU, for `model_bytes`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ModelHolding {
    pub model: Box<str>,
    /// Its state's name (Loaded, Loading, Fetching, Sleeping, Failed).
    pub state: &'static str,
    /// VRAM it holds: its size, or its sleeping size while it sleeps.
    pub bytes: u64,
}

/// The per-residency metrics, kept as one small record per residency and
/// written out at scrape time: nine metric families of their own would
/// cost about 1.5 KiB a residency (a map entry and label copy in each).
// Boxed: a hash map has room for up to twice its entries, and a snapshot
// (144 bytes) in each slot was 3.1 MB at 10,000 residencies.
#[derive(Debug, Default)]
struct PerResidency(Mutex<HashMap<ResidencyLabels, Box<Snapshot>>>);

/// Per residency, the models holding VRAM on it (most have one or two).
#[derive(Debug, Default)]
struct PerModel(Mutex<HashMap<ResidencyLabels, Box<[ModelHolding]>>>);

impl Collector for PerModel {
    fn encode(&self, mut encoder: DescriptorEncoder) -> Result<(), std::fmt::Error> {
        let map = self.0.lock().expect("metrics lock");
        let mut rows: Vec<(&ResidencyLabels, &Box<[ModelHolding]>)> = map.iter().collect();
        rows.sort_unstable_by(|a, b| a.0.cmp(b.0));
        let mut family = encoder.encode_descriptor(
            "model_bytes",
            "VRAM each model on a GPU holds, by state: its size, or its sleeping size while it sleeps",
            None,
            MetricType::Gauge,
        )?;
        for (r, models) in rows {
            for m in models.iter() {
                let labels = [
                    ("namespace", r.namespace.as_str()),
                    ("residency", r.residency.as_str()),
                    ("model", &*m.model),
                    ("state", m.state),
                ];
                ConstGauge::new(m.bytes).encode(family.encode_family(&labels)?)?;
            }
        }
        Ok(())
    }
}

type Field = fn(&Snapshot) -> u64;

const GAUGES: [(&str, &str, Field); 6] = [
    ("budget_bytes", "VRAM budget of the GPU", |s| s.budget),
    ("used_bytes", "VRAM declared by resident models", |s| s.used),
    ("peak_bytes", "Most VRAM ever declared at once", |s| s.peak),
    (
        "resident_models",
        "Models holding VRAM (loaded, loading or failed)",
        |s| u64::from(s.resident),
    ),
    (
        "gpu_conflict",
        "1 while another (older) residency holds this one's GPU, so it loads nothing",
        |s| u64::from(s.gpu_conflict),
    ),
    (
        "gpu_unhealthy",
        "1 while the residency's GPU takes no new models (its GpuHealthy condition False: a device taint, a cordoned node)",
        |s| u64::from(s.gpu_unhealthy),
    ),
];

const COUNTERS: [(&str, &str, Field); 10] = [
    ("hits", "Requests for an already resident model", |s| {
        s.totals.hits
    }),
    ("loads", "Models loaded", |s| s.totals.loads),
    (
        "evictions",
        "Models evicted to make room or by a budget shrink",
        |s| s.totals.evictions,
    ),
    ("refusals", "Requests refused", |s| s.totals.refusals),
    (
        "unloads",
        "Models unloaded by demand removal or registry removal",
        |s| s.totals.unloads,
    ),
    (
        "sleeps",
        "Models put to sleep to make room (the warm tier)",
        |s| s.totals.sleeps,
    ),
    ("wakes", "Requests that woke a sleeping model", |s| {
        s.totals.wakes
    }),
    (
        "anticipated",
        "Models loaded or woken ahead of demand (spec.anticipate)",
        |s| s.totals.anticipated,
    ),
    (
        "anticipated_used",
        "Models loaded or woken ahead of demand that a request used",
        |s| s.totals.anticipated_used,
    ),
    (
        "anticipated_wasted",
        "Models loaded or woken ahead of demand that left the GPU or fell asleep unused",
        |s| s.totals.anticipated_wasted,
    ),
];

impl Collector for PerResidency {
    fn encode(&self, mut encoder: DescriptorEncoder) -> Result<(), std::fmt::Error> {
        let map = self.0.lock().expect("metrics lock");
        let mut rows: Vec<(&ResidencyLabels, &Snapshot)> =
            map.iter().map(|(l, s)| (l, &**s)).collect();
        rows.sort_unstable_by(|a, b| a.0.cmp(b.0));
        for (name, help, field) in GAUGES {
            let mut family = encoder.encode_descriptor(name, help, None, MetricType::Gauge)?;
            for (labels, snap) in &rows {
                ConstGauge::new(field(snap)).encode(family.encode_family(*labels)?)?;
            }
        }
        for (name, help, field) in COUNTERS {
            let mut family = encoder.encode_descriptor(name, help, None, MetricType::Counter)?;
            for (labels, snap) in &rows {
                ConstCounter::new(field(snap)).encode(family.encode_family(*labels)?)?;
            }
        }
        Ok(())
    }
}

pub struct Metrics {
    registry: Registry,
    residencies: Arc<PerResidency>,
    models: Arc<PerModel>,
    reconcile_duration: Histogram,
    reconcile_errors: Family<ErrorLabels, Counter>,
    reconciles: Counter,
    api_requests: Family<RequestLabels, Counter>,
    load_duration: Histogram,
    wake_duration: Histogram,
    sleep_duration: Histogram,
    /// Per model: its copies (serving or loading), the copies its load
    /// asks for, and 1 while a wanted copy has no GPU to go to.
    pub copies: Family<ModelLabels, Gauge>,
    pub copies_wanted: Family<ModelLabels, Gauge>,
    pub copies_unplaced: Family<ModelLabels, Gauge>,
    /// Routers the copy scaler could not read in its last round (no copy
    /// is removed while one is unread).
    pub copies_routers_unread: Gauge,
    /// Model servers found asleep while their status said Loaded.
    pub found_asleep: Counter,
    /// Background tasks restarted after they panicked or ended, by task.
    pub task_restarts: Family<TaskLabels, Counter>,
}

/// A background task of the operator, as its restarts are counted.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct TaskLabels {
    pub task: &'static str,
}

/// A model of one namespace, as the copy metrics label it.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct ModelLabels {
    pub namespace: String,
    pub model: String,
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
            residencies: Arc::default(),
            models: Arc::default(),
            reconcile_duration: Histogram::new(exponential_buckets(0.001, 2.0, 14)),
            reconcile_errors: Family::default(),
            reconciles: Counter::default(),
            api_requests: Family::default(),
            load_duration: Histogram::new(exponential_buckets(0.1, 2.0, 14)),
            wake_duration: Histogram::new(exponential_buckets(0.01, 2.0, 14)),
            sleep_duration: Histogram::new(exponential_buckets(0.01, 2.0, 14)),
            copies: Family::default(),
            copies_wanted: Family::default(),
            copies_unplaced: Family::default(),
            copies_routers_unread: Gauge::default(),
            found_asleep: Counter::default(),
            task_restarts: Family::default(),
            registry: Registry::default(),
        };
        registry.register_collector(Box::new(m.residencies.clone()));
        registry.register_collector(Box::new(m.models.clone()));
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
        registry.register("reconciles", "Reconciles started", m.reconciles.clone());
        registry.register(
            "task_restarts",
            "Background tasks (gang coordinator, copy scaler, sleep audit, ...) restarted after they panicked or ended, by task",
            m.task_restarts.clone(),
        );
        registry.register(
            "api_requests",
            "API requests the reconciler made (pod creates and deletes, status patches, events), by verb and resource",
            m.api_requests.clone(),
        );
        registry.register(
            "model_load_duration_seconds",
            "Time from a model pod's creation to Ready",
            m.load_duration.clone(),
        );
        registry.register(
            "model_wake_duration_seconds",
            "Time from a wake request to its confirmation",
            m.wake_duration.clone(),
        );
        registry.register(
            "model_sleep_duration_seconds",
            "Time from a sleep request to its confirmation",
            m.sleep_duration.clone(),
        );
        registry.register(
            "model_copies",
            "Copies of a model across its GPUs, serving or loading (with --router-metrics or --router-selector)",
            m.copies.clone(),
        );
        registry.register(
            "model_copies_wanted",
            "Copies a model's requests in flight ask for, within its copies.min and copies.max",
            m.copies_wanted.clone(),
        );
        registry.register(
            "model_copies_unplaced",
            "1 while a copy a model wants has no GPU to go to (every other GPU would evict a busy model, or is full of loads), else 0",
            m.copies_unplaced.clone(),
        );
        registry.register(
            "copies_routers_unread",
            "Routers (or the router pods' list) the copy scaler could not read in its last round: while above 0, no copy is removed (the summed count would be too low)",
            m.copies_routers_unread.clone(),
        );
        registry.register(
            "found_asleep",
            "Model servers the sleep audit found asleep while their status said Loaded (their sleep endpoint called outside the operator), each woken",
            m.found_asleep.clone(),
        );
        Metrics { registry, ..m }
    }

    /// Exports a residency's decided usage and status counters.
    pub fn observe(&self, namespace: &str, residency: &str, usage: &Usage, c: Counters) {
        let mut map = self.residencies.0.lock().expect("metrics lock");
        let labels = ResidencyLabels {
            namespace: namespace.into(),
            residency: residency.into(),
        };
        let snap = map.entry(labels).or_default();
        snap.budget = usage.budget;
        snap.used = usage.used;
        snap.peak = usage.peak;
        snap.resident = usage.resident;
        snap.gpu_conflict = usage.gpu_conflict;
        snap.gpu_unhealthy = usage.gpu_unhealthy;
        let (totals, last) = (&mut snap.totals, &mut snap.last);
        for (total, now, before) in [
            (&mut totals.hits, c.hits, &mut last.hits),
            (&mut totals.loads, c.loads, &mut last.loads),
            (&mut totals.evictions, c.evictions, &mut last.evictions),
            (&mut totals.refusals, c.refusals, &mut last.refusals),
            (&mut totals.unloads, c.unloads, &mut last.unloads),
            (&mut totals.sleeps, c.sleeps, &mut last.sleeps),
            (&mut totals.wakes, c.wakes, &mut last.wakes),
            (
                &mut totals.anticipated,
                c.anticipated,
                &mut last.anticipated,
            ),
            (
                &mut totals.anticipated_used,
                c.anticipated_used,
                &mut last.anticipated_used,
            ),
            (
                &mut totals.anticipated_wasted,
                c.anticipated_wasted,
                &mut last.anticipated_wasted,
            ),
        ] {
            // A lower value means the object was recreated: count on.
            *total += now.checked_sub(*before).unwrap_or(now);
            *before = now;
        }
    }

    /// Exports the models holding VRAM on a residency's GPU (none: its
    /// row goes).
    pub fn observe_models(&self, namespace: &str, residency: &str, models: Vec<ModelHolding>) {
        let labels = ResidencyLabels {
            namespace: namespace.into(),
            residency: residency.into(),
        };
        let mut map = self.models.0.lock().expect("metrics lock");
        if models.is_empty() {
            map.remove(&labels);
        } else {
            map.insert(labels, models.into_boxed_slice());
        }
    }

    /// Forgets every residency but those in `present` (what a list of
    /// them found: the others were deleted while the watch was down).
    pub fn keep_only(&self, present: &std::collections::HashSet<(String, String)>) {
        let kept =
            |l: &ResidencyLabels| present.contains(&(l.namespace.clone(), l.residency.clone()));
        self.residencies
            .0
            .lock()
            .expect("metrics lock")
            .retain(|l, _| kept(l));
        self.models
            .0
            .lock()
            .expect("metrics lock")
            .retain(|l, _| kept(l));
    }

    /// Forgets a deleted residency.
    pub fn forget(&self, namespace: &str, residency: &str) {
        let labels = ResidencyLabels {
            namespace: namespace.into(),
            residency: residency.into(),
        };
        self.models.0.lock().expect("metrics lock").remove(&labels);
        self.residencies
            .0
            .lock()
            .expect("metrics lock")
            .remove(&labels);
    }

    pub fn reconcile_error(&self, reason: &str) {
        self.reconcile_errors
            .get_or_create(&ErrorLabels {
                reason: reason.into(),
            })
            .inc();
    }

    pub fn reconciled(&self) {
        self.reconciles.inc();
    }

    /// Reconciles started so far.
    pub fn reconciles_started(&self) -> u64 {
        self.reconciles.get()
    }

    /// Counts one API request, made whatever its answer.
    pub fn api_request(&self, verb: &'static str, resource: &'static str) {
        self.api_requests
            .get_or_create(&RequestLabels { verb, resource })
            .inc();
    }

    pub fn model_loaded(&self, seconds: f64) {
        self.load_duration.observe(seconds);
    }

    /// A confirmed wake (`true`) or sleep, and how long it took.
    pub fn model_woke_or_slept(&self, wake: bool, seconds: f64) {
        if wake {
            self.wake_duration.observe(seconds);
        } else {
            self.sleep_duration.observe(seconds);
        }
    }

    /// A guard that records the reconcile's duration when dropped.
    pub fn reconcile_timer(&self) -> ReconcileTimer<'_> {
        ReconcileTimer {
            metrics: self,
            start: Instant::now(),
        }
    }

    /// The sum of a metric's samples over all its label sets, as the
    /// exposition shows them: `sum(API_REQUESTS)`.
    pub fn sum(&self, metric: &str) -> u64 {
        self.sum_where(metric, "")
    }

    /// The sum of a metric's samples whose labels contain `labels`, as
    /// exposed: `sum_where(API_REQUESTS, r#"verb="create",resource="pods""#)`.
    pub fn sum_where(&self, metric: &str, labels: &str) -> u64 {
        sum_where(&self.encode(), metric, labels)
    }

    /// The OpenMetrics text exposition.
    pub fn encode(&self) -> String {
        exposition(&self.registry)
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
    fn exports_what_each_model_holds_until_it_holds_nothing_or_goes() {
        let m = Metrics::new();
        let holding = |model: &str, state, bytes| ModelHolding {
            model: model.into(),
            state,
            bytes,
        };
        m.observe_models(
            "models",
            "gpu0",
            vec![
                holding("chat", "Loaded", 8 << 30),
                holding("code", "Sleeping", 1 << 30),
            ],
        );
        let text = m.encode();
        for want in [
            format!(
                r#"model_residency_model_bytes{{namespace="models",residency="gpu0",model="chat",state="Loaded"}} {}"#,
                8u64 << 30
            ),
            format!(
                r#"model_residency_model_bytes{{namespace="models",residency="gpu0",model="code",state="Sleeping"}} {}"#,
                1u64 << 30
            ),
        ] {
            assert!(text.contains(&want), "{want} missing in\n{text}");
        }
        m.observe_models("models", "gpu0", vec![]);
        assert!(!m.encode().contains("model_bytes{"));
        m.observe_models("models", "gpu0", vec![holding("chat", "Loaded", 1)]);
        m.forget("models", "gpu0");
        assert!(!m.encode().contains("model_bytes{"));
    }

    #[test]
    fn exports_status_and_counts_deltas() {
        let m = Metrics::new();
        let usage = Usage {
            budget: 16000 << 20,
            used: 13900 << 20,
            peak: 13900 << 20,
            resident: 2,
            gpu_conflict: false,
            gpu_unhealthy: false,
        };
        let mut c = Counters {
            loads: 2,
            ..Counters::default()
        };
        m.observe("models", "gpu0", &usage, c);
        c.loads = 3;
        m.observe("models", "gpu0", &usage, c);
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
        m.reconciled();
        m.api_request("create", "pods");
        m.api_request("create", "pods");
        m.api_request("create", "events");
        assert_eq!(m.sum(API_REQUESTS), 3);
        assert_eq!(m.sum(RECONCILES), 1);
        let pods = r#"verb="create",resource="pods""#;
        assert_eq!(m.sum_where(API_REQUESTS, pods), 2);
        assert_eq!(m.sum("model_residency_loads_total"), 3);
        m.forget("models", "gpu0");
        assert!(!m.encode().contains("gpu0"));
    }
}
