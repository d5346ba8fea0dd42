//! The warm tier end to end: models that sleep instead of being deleted,
//! their sleep and wake asked of the fake model server's vLLM endpoints
//! over real HTTP, and what happens when those endpoints are missing, slow
//! or lie.

use super::{events_for, model};
use crate::support::cluster::eventually;
use crate::support::operator::Harness;
use crate::support::router::{RouterUnderTest, assert_served_by};
use k8s_openapi::api::core::v1::Pod;
use kube::api::PostParams;
use model_residency::api::{ModelResidency, ModelState};
use model_residency::controller::pods::pod_name;
use model_residency::local::model_server::SLEEP_ANNOTATION;
use model_residency::router::Config;
use serde_json::{Value, json};
use std::net::SocketAddr;
use std::time::Duration;

/// A residency `name` (env mode) on GPU `device` of the harness's node:
/// `a` (6Gi) sleeps
/// at 1Gi by the vLLM preset, its fake server behaving as `behaviour`
/// says; `b` (6Gi) cannot sleep; 10Gi of VRAM and `host` of host memory.
async fn create(
    h: &Harness,
    (name, device): (&str, &str),
    behaviour: &str,
    host: &str,
    sleep: Value,
) {
    let template = |image: &str, annotations: Value| {
        json!({"metadata": {"annotations": annotations},
               "spec": {"containers": [{"name": "server", "image": image}]}})
    };
    let r: ModelResidency = serde_json::from_value(json!({
        "apiVersion": "residency.dev/v1alpha1", "kind": "ModelResidency",
        "metadata": {"name": name},
        "spec": {
            "nodeName": h.node, "device": device, "gpu": {"mode": "env"}, "budget": "10Gi",
            "warm": {"hostBudget": host},
            "models": [
                {"name": "a", "size": "6Gi", "sleep": sleep,
                 "template": template("example/a:1", json!({SLEEP_ANNOTATION: behaviour}))},
                {"name": "b", "size": "6Gi", "template": template("example/b:1", json!({}))},
            ],
        },
    }))
    .unwrap();
    h.api.create(&PostParams::default(), &r).await.unwrap();
}

fn vllm() -> Value {
    json!({"preset": "vllm", "sleepingSize": "1Gi"})
}

/// Where `model`'s pod of residency `name` serves.
async fn addr_of(h: &Harness, name: &str, model: &str) -> (SocketAddr, Pod) {
    let pod = h.pods.get(&pod_name(name, model)).await.unwrap();
    let ip = pod.status.as_ref().unwrap().pod_ip.as_deref().unwrap();
    (SocketAddr::new(ip.parse().unwrap(), 8080), pod)
}

/// What the fake server of `model`'s pod counted.
async fn stats(h: &Harness, name: &str, model: &str) -> Value {
    let (addr, _) = addr_of(h, name, model).await;
    let a = crate::support::http::send(addr, "GET", "/fake/stats", "").await;
    serde_json::from_str(&a.body).unwrap()
}

fn reason(r: &ModelResidency, m: &str) -> String {
    model(r, m).reason.as_deref().unwrap_or_default().to_owned()
}

#[tokio::test]
#[ignore = "needs the local control plane: scripts/test.sh runs it with --include-ignored"]
async fn an_evicted_model_sleeps_keeps_its_pod_and_wakes_instead_of_loading() {
    let h = Harness::start("warm-wake").await;
    create(&h, ("gpu", "0"), "sleep=100ms,wake=50ms", "8Gi", vllm()).await;
    h.request("gpu", "a").await;
    let (_, first) = addr_of(&h, "gpu", "a").await;
    // b needs room: a sleeps (confirmed by its server) and keeps its pod.
    let r = h.request("gpu", "b").await;
    assert_eq!(model(&r, "a").state, ModelState::Sleeping, "{:?}", model(&r, "a"));
    assert_eq!(reason(&r, "a"), "Asleep");
    assert_eq!(model(&r, "b").state, ModelState::Loaded);
    let status = r.status.as_ref().unwrap();
    assert_eq!(
        (status.sleeping, status.host_used.as_deref()),
        (1, Some("6Gi"))
    );
    assert_eq!(
        status.used.as_deref(),
        Some("7Gi"),
        "a holds its sleeping size"
    );
    assert_eq!(stats(&h, "gpu", "a").await["asleep"], true);
    // a again: a wake, not a load; b makes room.
    let r = h.request("gpu", "a").await;
    assert_eq!(model(&r, "a").state, ModelState::Loaded);
    assert_eq!(model(&r, "b").state, ModelState::Evicted);
    let c = r.status.as_ref().unwrap().counters;
    assert_eq!(
        (c.loads, c.sleeps, c.wakes, c.evictions, c.hits),
        (2, 1, 1, 1, 0)
    );
    let (_, now) = addr_of(&h, "gpu", "a").await;
    assert_eq!(now.metadata.uid, first.metadata.uid, "the same pod, woken");
    let s = stats(&h, "gpu", "a").await;
    assert_eq!(
        (s["sleeps"].as_u64(), s["wakes"].as_u64()),
        (Some(1), Some(1))
    );
    assert_eq!(s["asleep"], false);
    assert!(model(&r, "a").wake_seconds.is_some_and(|w| w >= 0.05));
    let events: Vec<String> = events_for(&h, "gpu")
        .await
        .into_iter()
        .map(|e| e.0)
        .collect();
    for want in ["Slept", "Woken"] {
        assert!(
            events.iter().any(|e| e == want),
            "no {want} event: {events:?}"
        );
    }
    let metrics = h.ctx.metrics.encode();
    assert!(
        metrics.contains("model_residency_wakes_total{namespace="),
        "{metrics}"
    );
    assert!(metrics.contains("model_residency_model_wake_duration_seconds_count 1"));
}

#[tokio::test]
#[ignore = "needs the local control plane: scripts/test.sh runs it with --include-ignored"]
async fn a_sleep_endpoint_that_is_missing_slow_or_lies_deletes_the_pod_instead() {
    let h = Harness::start("warm-faults").await;
    let slow = json!({"preset": "vllm", "sleepingSize": "1Gi",
                      "sleep": {"path": "/sleep?level=1", "timeout": "1s"}});
    for (device, (name, behaviour, sleep, why)) in [
        ("missing", "mode=missing", vllm(), "answered 404"),
        (
            "lies",
            "mode=lies",
            vllm(),
            "says is_sleeping=false after the sleep",
        ),
        ("slow", "mode=slow", slow, "did not answer within 1s"),
    ]
    .into_iter()
    .enumerate()
    {
        create(&h, (name, &device.to_string()), behaviour, "8Gi", sleep).await;
        h.request(name, "a").await;
        let r = h.request(name, "b").await;
        assert_eq!(model(&r, "a").state, ModelState::Evicted, "{name}");
        assert_eq!(reason(&r, "a"), "SleepFailed", "{name}");
        let message = model(&r, "a").message.clone().unwrap_or_default();
        assert!(message.contains(why), "{name}: {message}");
        let c = r.status.as_ref().unwrap().counters;
        assert_eq!((c.sleeps, c.evictions), (0, 1), "{name}");
        let (live, _) = h.pods_of(name).await;
        assert_eq!(live.into_iter().collect::<Vec<_>>(), ["b"], "{name}");
        let events = events_for(&h, name).await;
        assert!(
            events
                .iter()
                .any(|(r, note)| r == "SleepFailed" && note.contains(why)),
            "{name}: {events:?}"
        );
        // The next request for a is a cold load.
        let r = h.request(name, "a").await;
        assert_eq!(model(&r, "a").state, ModelState::Loaded);
        assert_eq!(r.status.as_ref().unwrap().counters.loads, 3, "{name}");
    }
}

#[tokio::test]
#[ignore = "needs the local control plane: scripts/test.sh runs it with --include-ignored"]
async fn the_router_holds_a_request_through_the_wake_and_never_sends_to_a_sleeping_pod() {
    let h = Harness::start("warm-route").await;
    create(&h, ("gpu", "0"), "sleep=200ms,wake=300ms", "8Gi", vllm()).await;
    let router = RouterUnderTest::start(
        &h,
        Config {
            recency_resolution: Duration::ZERO,
            ..Config::default()
        },
    )
    .await;
    assert_served_by(&router.chat("a").await, "a");
    let (_, first) = addr_of(&h, "gpu", "a").await;
    // Both, at once, through the router: they take turns, a sleeping and
    // waking.
    let both = futures::future::join_all((0..20).map(|i| {
        let model = if i % 2 == 0 { "a" } else { "b" };
        let router = &router;
        async move { (model, router.chat(model).await) }
    }))
    .await;
    for (model, a) in &both {
        assert_served_by(a, model);
    }
    let r = h.converged("gpu").await;
    let before = r.status.as_ref().unwrap().counters;
    assert!(before.sleeps >= 1, "b made room by a sleep: {before:?}");
    // Turns, one at a time: each request for a is held through its wake.
    for model in ["b", "a", "b", "a"] {
        assert_served_by(&router.chat(model).await, model);
    }
    let r = h.converged("gpu").await;
    let c = r.status.as_ref().unwrap().counters;
    assert_eq!(c.wakes - before.wakes, 2, "{before:?} then {c:?}");
    let (_, now) = addr_of(&h, "gpu", "a").await;
    assert_eq!(
        now.metadata.uid, first.metadata.uid,
        "a was never loaded again"
    );
    let s = eventually(10, "a's server to be reachable", || async {
        Some(stats(&h, "gpu", "a").await)
    })
    .await;
    assert_eq!(
        s["inference_while_asleep"], 0,
        "the router sent a request to a sleeping server: {s}"
    );
}
