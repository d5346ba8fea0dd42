//! model-residency: per-GPU model residency for Kubernetes.
//!
//! - [`api`]: the `ModelResidency` and `ModelDemand` custom resources.
//! - [`cluster`]: namespaced-or-all API handles and status writes.
//! - [`controller`]: the reconciler (validate, restore, decide, enact).
//! - [`demand`]: load/unload requests (one merge patch of a `spec.demand` key).
//! - [`engine`]: the pure VRAM-budgeted LRU admission policy.
//! - [`quantity`]: Kubernetes quantities as whole bytes.
//! - [`registry`]: registry files (`{name, size, pinned}` lists).
//! - [`simulate`]: replaying request traces through the engine.
//! - [`http`]: `/healthz`, `/readyz`, `/metrics`.
//! - [`lease`]: leader election on a Lease.
//! - [`labels`]: label and annotation keys on model pods.
//! - [`metrics`]: Prometheus metrics.
//! - [`router`]: the request router (`model-residency route`).
//! - [`node_agent`]: the node's disk tier for model artifacts (what to keep,
//!   fetching); in progress.
//! - [`model_demand`]: the ModelDemand controller (`/scale` for HPA and KEDA).
//! - `local` (feature `local`): a local control plane and kubelet stand-in
//!   (tests, benchmarks, demo); not in the operator image.

pub mod api;
pub mod cluster;
pub mod controller;
pub mod engine;
pub mod http;
#[cfg(feature = "local")]
pub mod local;
pub mod metrics;
pub mod node_agent;
pub mod operator;
pub mod panic_guard;
pub mod quantity;
pub mod registry;
pub mod residency;
pub mod router;
pub mod simulate;
