//! The committed CRD must be exactly what the Rust types generate.

#[test]
fn committed_crd_matches_the_types() {
    let committed =
        std::fs::read_to_string("crds/modelresidency.yaml").expect("crds/modelresidency.yaml");
    assert!(
        committed == model_residency::api::crd_yaml(),
        "crds/modelresidency.yaml is stale: run `cargo run -- crd > crds/modelresidency.yaml`"
    );
}
