//! model-residency: per-GPU model residency for Kubernetes.
//!
//! - [`engine`]: the pure VRAM-budgeted LRU admission policy.
//! - [`quantity`]: Kubernetes quantities as whole bytes.
//! - [`registry`]: registry files (`{name, size, pinned}` lists).
//! - [`simulate`]: replaying request traces through the engine.

pub mod engine;
pub mod quantity;
pub mod registry;
pub mod simulate;
