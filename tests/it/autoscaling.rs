//! A real autoscaler owns the copies of a model: KEDA's ScaledObject on a
//! `ModelCopies`, its prometheus trigger on the routers' in-flight metric
//! (Prometheus scraping the router under test), the HPA that KEDA makes run
//! by kube-controller-manager's HPA controller through the aggregation
//! layer, and the operator keeping the count it is given.

use crate::copies::{four_gpus_and_a_router, load, loaded, model_copies};
use crate::support::cluster::eventually;
use crate::support::keda::Keda;
use crate::support::operator::Harness;
use serde_json::json;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

/// The docs' ScaledObject for ModelCopies (`docs/keda-scaledobject.yaml`,
/// its second document), as a user would apply it, with only what a test
/// must change: this namespace, this Prometheus, and test-sized numbers (0
/// to 3 copies, 2 requests in flight per copy, polled every second, to 0
/// after 5 s without any, and an HPA that scales down without the default
/// 5-minute stabilization window). The model (chat) and the query are the
/// docs' own.
fn docs_scaled_object(h: &Harness, prometheus: std::net::SocketAddr) -> serde_json::Value {
    let out = h.env.kubectl(&[
        "create",
        "--namespace=models",
        "--dry-run=client",
        "-o",
        "json",
        "-f",
        "docs/keda-scaledobject.yaml",
    ]);
    assert!(out.status.success(), "docs/keda-scaledobject.yaml: {out:?}");
    // One JSON object per document, one after the other.
    let mut items: Vec<serde_json::Value> = serde_json::Deserializer::from_slice(&out.stdout)
        .into_iter()
        .collect::<Result<_, _>>()
        .unwrap();
    assert_eq!(items.len(), 2, "two ScaledObjects in the docs");
    // Both are valid against KEDA's own CRD.
    for item in &mut items {
        item["metadata"]["namespace"] = json!(h.env.namespace);
    }
    let list = json!({"apiVersion": "v1", "kind": "List", "items": items});
    let file = tempfile::NamedTempFile::new().unwrap();
    std::fs::write(file.path(), list.to_string()).unwrap();
    let path = file.path().to_str().unwrap();
    let out = h.env.kubectl(&["apply", "--dry-run=server", "-f", path]);
    assert!(out.status.success(), "the docs' ScaledObjects: {out:?}");
    let mut so = items
        .iter()
        .find(|o| o["spec"]["scaleTargetRef"]["kind"] == "ModelCopies")
        .expect("a ScaledObject for ModelCopies in the docs")
        .clone();
    assert_eq!(so["spec"]["scaleTargetRef"]["name"], "chat");
    let spec = &mut so["spec"];
    spec["triggers"][0]["metadata"]["serverAddress"] = json!(format!("http://{prometheus}"));
    spec["triggers"][0]["metadata"]["threshold"] = json!("2");
    spec["pollingInterval"] = json!(1);
    spec["cooldownPeriod"] = json!(5);
    spec["maxReplicaCount"] = json!(3);
    spec["advanced"] = json!({"horizontalPodAutoscalerConfig": {"behavior": {
        "scaleDown": {"stabilizationWindowSeconds": 0}}}});
    so
}

#[tokio::test]
#[ignore = "needs the local control plane and KEDA: scripts/test.sh runs it with --include-ignored"]
async fn keda_scales_model_copies_0_1_3_0_on_the_routers_in_flight_requests() {
    let mut h = Harness::start("keda").await;
    let tick = Duration::from_millis(300);
    let router = four_gpus_and_a_router(&mut h, tick, Default::default()).await;
    let keda = Keda::start(&h.env, &[router.addr]).await;
    keda.until_scraped().await;

    let api = model_copies(&h, 0).await;
    let so = docs_scaled_object(&h, keda.prometheus);
    let name = so["metadata"]["name"].as_str().unwrap().to_owned();
    let file = tempfile::NamedTempFile::new().unwrap();
    std::fs::write(file.path(), so.to_string()).unwrap();
    let out = h
        .env
        .kubectl(&["apply", "-f", file.path().to_str().unwrap()]);
    assert!(out.status.success(), "ScaledObject: {out:?}");
    eventually(60, "KEDA's HPA for the ScaledObject", || async {
        let out = h
            .env
            .kubectl(&["get", "hpa", "keda-hpa-chat-copies", "-o", "name"]);
        out.status.success().then_some(())
    })
    .await;

    // Every spec.replicas the autoscaler writes, in order (only KEDA and
    // the HPA controller write it in this test).
    let seen = Arc::new(Mutex::new(vec![0]));
    let watching = Arc::new(AtomicBool::new(true));
    let watcher = {
        let (api, seen, watching) = (api.clone(), seen.clone(), watching.clone());
        tokio::spawn(async move {
            // Bounded: 5 minutes of 100 ms polls at most.
            for _ in 0..3000 {
                if !watching.load(Ordering::Relaxed) {
                    break;
                }
                if let Ok(mc) = api.get("chat").await {
                    let mut seen = seen.lock().unwrap();
                    if seen.last() != Some(&mc.spec.replicas) {
                        seen.push(mc.spec.replicas);
                    }
                }
                tokio::time::sleep(Duration::from_millis(100)).await;
            }
        })
    };
    let spec_replicas = || async { api.get("chat").await.ok().map(|mc| mc.spec.replicas) };

    // Idle: KEDA leaves it at 0, and nothing is loaded.
    tokio::time::sleep(Duration::from_secs(3)).await;
    assert_eq!(spec_replicas().await, Some(0), "{}", keda.logs());
    assert!(loaded(&h).await.is_empty());

    // One stream at a time: active, one copy (1 in flight / 2 per copy).
    let tally = Arc::new((AtomicUsize::new(0), AtomicUsize::new(0)));
    let stop = Arc::new(AtomicBool::new(false));
    let one = load(router.addr, 1, stop.clone(), tally.clone());
    eventually(60, "KEDA to scale chat to 1", || async {
        (spec_replicas().await == Some(1) && loaded(&h).await.len() == 1).then_some(())
    })
    .await;

    // Twelve at once: 12 / 2 = 6 copies wanted, 3 at most, through the HPA.
    let stop_many = Arc::new(AtomicBool::new(false));
    let many = load(router.addr, 12, stop_many.clone(), tally.clone());
    eventually(60, "the HPA to scale chat to 3", || async {
        let ready = api.get("chat").await.ok()?.status?.replicas;
        (spec_replicas().await == Some(3) && loaded(&h).await.len() == 3 && ready == 3)
            .then_some(())
    })
    .await;
    let hpa = h.env.kubectl(&[
        "get",
        "hpa",
        &format!("keda-hpa-{name}"),
        "-o",
        "jsonpath={.status.currentMetrics[0].external.current.averageValue}",
    ]);
    let read = String::from_utf8_lossy(&hpa.stdout).to_string();
    assert!(
        !read.is_empty(),
        "the HPA read the external metric through KEDA's metrics server: {hpa:?}"
    );

    // No traffic: down to 0 (the HPA to its minimum 1, KEDA to 0 after
    // the cooldown), each copy drained, every request answered.
    stop_many.store(true, Ordering::Relaxed);
    stop.store(true, Ordering::Relaxed);
    futures::future::join_all(many.into_iter().chain(one)).await;
    eventually(90, "KEDA to scale chat to 0", || async {
        (spec_replicas().await == Some(0) && loaded(&h).await.is_empty()).then_some(())
    })
    .await;
    watching.store(false, Ordering::Relaxed);
    watcher.await.unwrap();
    let seen = seen.lock().unwrap().clone();
    // 0 -> 1 (KEDA's activation) -> up to 3 (the HPA; a step through 2
    // when a scrape caught fewer in flight) -> down to 0.
    let peak = seen.iter().position(|&n| n == 3);
    let rising = peak.is_some_and(|p| seen[..=p].windows(2).all(|w| w[0] < w[1]));
    assert!(
        seen.starts_with(&[0, 1]) && rising,
        "0 -> 1 -> 3 first: {seen:?}"
    );
    assert_eq!(seen.last(), Some(&0), "{seen:?}");
    assert!(seen.iter().all(|&n| n <= 3), "never above max: {seen:?}");
    let (ok, failed) = (
        tally.0.load(Ordering::Relaxed),
        tally.1.load(Ordering::Relaxed),
    );
    assert_eq!(failed, 0, "{failed} of {} requests failed", ok + failed);
    println!(
        "keda: spec.replicas went {seen:?}; the HPA last read an average of {read} in flight; {ok} requests answered"
    );
}
