//! Work ahead of demand (`spec.anticipate`, #69) on the real API server:
//! a model its forecast expects is loaded before its request, within the
//! budget, said in status, events and counters; the forecasts outlive an
//! operator restart in their ConfigMap.

use crate::support::cluster::eventually;
use crate::support::operator::Harness;
use k8s_openapi::ByteString;
use k8s_openapi::api::core::v1::ConfigMap;
use k8s_openapi::jiff::Timestamp;
use kube::Resource;
use kube::api::{Api, PostParams};
use model_residency::api::ModelState;
use model_residency::controller::decide::{Forecasts, epoch_seconds};
use model_residency::controller::forecasts::{configmap_name, decode, encode};
use model_residency::engine::forecast::Forecast;
use serde_json::json;
use std::time::Duration;

#[tokio::test]
#[ignore = "needs the local control plane (scripts/control-plane.sh)"]
async fn a_model_its_forecast_expects_is_loaded_ahead_and_what_was_learnt_outlives_a_restart() {
    // Loads that take 2 s. A load of no time saves no wait, so it is never
    // worth what it sends out; and load times are measured in whole
    // seconds, so with 1 s loads a's could read 1 s and b's 2 s, and a's
    // return (chance ~1 times 1 s) no longer beat twice b's expected cost
    // (0.29 times 2 s): this test failed so in CI once. At 2 s the worst
    // reading is 2 against 3 s, which clears the margin.
    let mut h = Harness::start_with("anticipation", Duration::from_secs(2)).await;
    h.create("gpu", "10Gi", &[("a", "6Gi", false), ("b", "6Gi", false)])
        .await;
    h.request("gpu", "a").await;
    h.request("gpu", "b").await;
    let r = h.until_state("gpu", "a", ModelState::Evicted, 30).await;

    // What the operator would have learnt of a: requested every 10 s for
    // the last five minutes, kept in the residency's ConfigMap.
    let now = epoch_seconds(Timestamp::now());
    let mut busy = Forecast::default();
    for i in 0..30 {
        busy.request(now - 300.0 + f64::from(i) * 10.0);
    }
    let seeded: Forecasts = [("a".to_owned(), busy)].into();
    let maps: Api<ConfigMap> = Api::namespaced(h.env.client.clone(), &h.env.namespace);
    let map: ConfigMap = serde_json::from_value(json!({
        "metadata": {"name": configmap_name("gpu"),
            "ownerReferences": [r.controller_owner_ref(&()).unwrap()]},
    }))
    .unwrap();
    let map = ConfigMap {
        binary_data: Some([("forecasts.gz".to_owned(), ByteString(encode(&seeded)))].into()),
        ..map
    };
    maps.create(&PostParams::default(), &map).await.unwrap();

    // On: a comes back before any request for it, b (asked for once)
    // makes room, as a request for a would have it.
    h.patch_spec("gpu", json!({"anticipate": {"enabled": true}}))
        .await;
    let r = h.until_state("gpu", "a", ModelState::Loaded, 30).await;
    let status = r.status.as_ref().unwrap();
    let a = status.model("a").unwrap();
    assert_eq!(a.reason.as_deref(), Some("Anticipated"), "{a:?}");
    assert!(
        a.anticipated_at.is_some() && a.expected_next.is_some(),
        "{a:?}"
    );
    assert_eq!(status.model("b").unwrap().state, ModelState::Evicted);
    assert_eq!(status.counters.anticipated, 1);
    let events = h.events_of("gpu").await;
    assert!(
        events
            .iter()
            .any(|e| e.contains("Anticipated") && e.contains("a loaded ahead of demand")),
        "{events:#?}"
    );

    // What was learnt (b's request too) is written beside it.
    let stored = eventually(30, "the forecasts to be written back", || async {
        let map = maps.get(&configmap_name("gpu")).await.ok()?;
        let f = decode(&map.binary_data?.get("forecasts.gz")?.0);
        f.contains_key("b").then_some(f)
    })
    .await;
    assert!(stored["a"].chance_within(now, 600.0) > 0.9);

    // A restarted operator goes on from it: a's request is the use of
    // the load made ahead, counted once.
    h.stop_operator().await;
    h.start_operator();
    let r = h.request("gpu", "a").await;
    let status = r.status.as_ref().unwrap();
    let a = status.model("a").unwrap();
    assert_eq!(
        (a.state, a.anticipated_at.as_deref()),
        (ModelState::Loaded, None)
    );
    let c = status.counters;
    assert_eq!(
        (c.anticipated, c.anticipated_used, c.anticipated_wasted),
        (1, 1, 0),
        "{:#?}",
        h.events_of("gpu").await
    );
    let ns = &h.env.namespace;
    let exported = eventually(10, "the counters exported", || async {
        let metrics = h.ctx.metrics.encode();
        let series = |name: &str| {
            format!(r#"model_residency_{name}_total{{namespace="{ns}",residency="gpu"}} 1"#)
        };
        ["anticipated", "anticipated_used"]
            .iter()
            .all(|n| metrics.contains(&series(n)))
            .then_some(metrics)
    })
    .await;
    let wasted = format!(
        r#"model_residency_anticipated_wasted_total{{namespace="{ns}",residency="gpu"}} 0"#
    );
    assert!(exported.contains(&wasted), "{exported}");
    let kept = h
        .ctx
        .forecasts
        .learn(&h.env.client, &h.ctx.metrics, &r, Timestamp::now())
        .await
        .expect("anticipation is on");
    assert!(
        kept.models["a"].chance_within(now, 600.0) > 0.9,
        "the new operator read back what the old one learnt"
    );
}
