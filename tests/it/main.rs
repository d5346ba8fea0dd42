//! The integration tests, one binary (one link on two cores instead of
//! sixteen), one module per subject; `support/` is what they share. Tests
//! that need the local control plane are `#[ignore]`d, so a plain `cargo
//! test` reports them as skipped; `scripts/test.sh` runs them with
//! `--include-ignored`. The pure property and fuzz tests keep binaries of
//! their own (`tests/engine_*.rs`, `tests/decide_fuzz.rs`).

mod adapters;
mod autoscaling;
mod catalog;
mod chart;
mod cli;
mod control_plane;
mod copies;
mod crd;
mod dockerfile;
mod docs;
mod model_demand;
mod node_agent;
mod on_real_node;
mod operator;
mod operator_api;
mod process;
mod real_servers;
mod residency_set;
mod router;
mod support;
