//! A local Kubernetes for tests and the demo: a real control plane
//! ([`control_plane`]) and a stand-in for the kubelet ([`kubelet`]), the one
//! part that cannot run here.

pub mod control_plane;
pub mod kubelet;
