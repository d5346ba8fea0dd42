//! The committed CRD, and the chart's copy, must be exactly what the Rust
//! types generate.

#[test]
fn committed_crds_match_the_types() {
    let generated = model_residency::api::crd_yaml();
    for path in [
        "crds/modelresidency.yaml",
        "charts/model-residency/crds/modelresidency.yaml",
    ] {
        let committed = std::fs::read_to_string(path).unwrap_or_else(|e| panic!("{path}: {e}"));
        assert!(
            committed == generated,
            "{path} is stale: run `cargo run -- crd > {path}`"
        );
    }
}
