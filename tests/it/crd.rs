//! The committed CRD, and the chart's copy, must be exactly what the Rust
//! types generate.

#[test]
fn committed_crds_match_the_types() {
    for (file, generated) in model_residency::api::crd_files() {
        for dir in ["crds", "charts/model-residency/crds"] {
            let path = format!("{dir}/{file}");
            let committed =
                std::fs::read_to_string(&path).unwrap_or_else(|e| panic!("{path}: {e}"));
            assert!(
                committed == generated,
                "{path} is stale: run `bash scripts/crds.sh`"
            );
        }
    }
}
