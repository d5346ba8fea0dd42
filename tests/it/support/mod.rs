//! What the integration tests share: the control plane, the operator
//! harness, HTTP helpers, the router under test, the artifact server, the
//! seed's cases and the naive reference of the policy.

pub mod artifact_server;
pub mod cluster;
pub mod http;
pub mod keda;
pub mod lane;
pub mod node_agent;
pub mod operator;
pub mod reference;
pub mod router;
pub mod seed;

/// splitmix64: deterministic "random" numbers, so a failing storm replays
/// the same way.
pub fn rng(seed: u64) -> impl FnMut() -> u64 {
    let mut state = seed;
    move || {
        state = state.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = state;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^ (z >> 31)
    }
}
