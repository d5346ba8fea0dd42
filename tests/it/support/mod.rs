//! What the integration tests share: the control plane, the operator
//! harness, HTTP helpers, the router under test, the artifact server, the
//! seed's cases and the naive reference of the policy.

pub mod artifact_server;
pub mod cluster;
pub mod http;
pub mod operator;
pub mod reference;
pub mod router;
pub mod seed;
