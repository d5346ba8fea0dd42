use super::*;
use serde_json::json;

fn residency(
    node: &str,
    prefetch: u32,
    resident: &[&str],
    requested: &[(&str, u64)],
) -> Arc<ModelResidency> {
    let models: Vec<_> = ["a", "b", "c", "plain"]
        .iter()
        .map(|m| {
            let mut v = json!({"name": m, "size": "1Gi"});
            if *m != "plain" {
                v["artifact"] =
                    json!({"files": [{"uri": format!("http://h/{m}.bin")}], "size": "2Gi"});
            }
            v
        })
        .collect();
    let statuses: Vec<_> = requested
        .iter()
        .map(|(m, t)| {
            let state = if resident.contains(m) { "Loaded" } else { "Evicted" };
            json!({"name": m, "state": state, "size": "1Gi",
                   "lastRequested": Timestamp::from_second(1_700_000_000 + *t as i64).unwrap().to_string()})
        })
        .collect();
    Arc::new(
        serde_json::from_value(json!({
            "apiVersion": "residency.dev/v1alpha1", "kind": "ModelResidency",
            "metadata": {"name": "gpu", "namespace": "ns"},
            "spec": {"nodeName": node, "device": "0", "budget": "8Gi", "models": models, "prefetch": prefetch},
            "status": {"models": statuses},
        }))
        .unwrap(),
    )
}

#[test]
fn resident_models_require_their_artifacts_and_recent_ones_are_prefetched() {
    let r = residency("n1", 1, &["a"], &[("a", 1), ("b", 5), ("c", 3)]);
    let other_node = residency("n2", 3, &["b"], &[("b", 9)]);
    let d = declared(&[r, other_node], "n1");
    let want = |m: &str| d.values().find(|x| x.model == m).map(|x| x.want);
    assert_eq!(want("a"), Some(Want::Required));
    assert_eq!(
        want("b"),
        Some(Want::Prefetch),
        "the most recent non-resident"
    );
    assert_eq!(want("c"), None, "beyond prefetch: 1");
    assert_eq!(want("plain"), None, "no artifact");
    assert!(d.values().all(|x| x.size == 2 << 30));
}

#[test]
fn retries_back_off_to_five_minutes() {
    assert_eq!(retry_delay(1), Duration::from_secs(5));
    assert_eq!(retry_delay(2), Duration::from_secs(10));
    assert_eq!(retry_delay(30), Duration::from_secs(300));
}
