//! The node's disk as a second residency tier (issue #15, in progress):
//! the parts of the node agent that decide and fetch.
//!
//! - [`keep`]: what the node keeps within its disk budget (pure);
//! - [`fetch`]: downloading an artifact into the cache directory, verified
//!   and renamed into place, never half-visible.
//!
//! Not built yet: the `node-agent` subcommand and its `NodeModelCache`
//! object, the registry's `artifact` field, the operator's `Fetching` gate
//! and the hostPath mount (see the README's "Limits").

pub mod fetch;
pub mod keep;
