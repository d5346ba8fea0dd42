//! model-residency: per-GPU model residency for Kubernetes.
//!
//! Below every process (none imports the reconciler):
//! - [`api`]: the custom resources (`ModelResidency`, `ModelDemand`,
//!   `ModelCopies`, `NodeModelCache`; the fields of the Gateway API Inference
//!   Extension's `InferencePool` the operator writes) and their admission
//!   rules.
//! - [`engine`]: the pure VRAM-budgeted admission policy (LRU, cost, the
//!   warm tier); no kube, no I/O.
//! - [`residency`]: what every process knows of a residency: its validated
//!   state, reasons, conditions, labels, demand writes, GPU placement, the
//!   warm tier's requests.
//! - [`quantity`], [`registry`]: quantities as bytes; registry files.
//!
//! The processes:
//! - [`controller`]: the residency reconciler (pod cache, decide, enact;
//!   sleeps and wakes in tasks of their own); [`operator`] wires it with
//!   the ModelDemand controller and leader election.
//! - [`router`]: the request router (`model-residency route`).
//! - [`node_agent`]: the node's disk tier: the disk plan, http and OCI
//!   fetches, the blob store, an artifact's confinement to its directory.
//! - [`simulate`]: replaying request traces through the engine.
//!
//! Shared plumbing: [`cluster`] (API handles, status writes, watch
//! backoff), [`http`] (admin endpoints, a small client), [`metrics`] (the
//! operator's), [`exposition`] (the Prometheus text format, every process's),
//! [`panic_guard`], [`supervise`] (background tasks restarted and counted); `local` (feature `local`): a local control plane, a
//! real node in a lane of its own, the kubelet stand-in, the fake model
//! server, local images and a registry (tests, benchmarks, demo), not in
//! the operator image.

pub mod api;
pub mod cluster;
pub mod controller;
pub mod engine;
pub mod exposition;
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
pub mod shared;
pub mod simulate;
pub mod supervise;
