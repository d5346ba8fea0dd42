//! The node's disk as a second residency tier: the node agent
//! (`model-residency node-agent`, one per node, a DaemonSet in the chart).
//!
//! - [`keep`]: what the node keeps within its disk budget (pure);
//! - [`fetch`]: downloading an artifact into the cache directory, verified
//!   and renamed into place, never half-visible;
//! - [`oci`]: artifacts from OCI registries (resolve, download, unpack
//!   tar layers), reading through [`distribution`] (a manifest and a blob,
//!   with the agent's redirect rule and limits);
//! - [`blobs`]: the content-addressed store the artifacts' directories
//!   link into; [`confine`]: nothing placed through a symlink;
//! - [`agent`]: the loop that reads the residencies on its node, plans,
//!   fetches, evicts and reports in the node's `NodeModelCache`;
//! - [`metrics`]: its downloads, evictions and disk use, on `/metrics`.
//!
//! The operator reads `NodeModelCache` objects: a model with an artifact
//! is `Fetching` until its artifact is Ready on the node, then its pod
//! starts with the artifact's directory mounted read-only
//! (`controller::artifacts`).

pub mod agent;
pub mod blobs;
pub mod confine;
pub mod distribution;
pub mod fetch;
pub mod keep;
pub mod metrics;
pub mod oci;
pub mod transport;
