//! LoRA adapters as residents of their base model, through the router, over
//! the real API server and operator: the base model's pods are fake model
//! servers speaking vLLM's runtime adapter API (the contract test in
//! real_servers.rs holds it to the real vLLM's answers), the adapters are
//! real files on the disk the fake reads.

use crate::support::cluster::eventually;
use crate::support::http::send;
use crate::support::operator::{Harness, server_template};
use crate::support::router::{RouterUnderTest, json_of};
use futures::future::join_all;
use kube::api::DeleteParams;
use model_residency::api::ModelResidency;
use model_residency::controller::pods::pod_name;
use model_residency::local::vllm::write_adapters;
use model_residency::residency::labels::DEFAULT_MODEL_PORT;
use serde_json::json;
use std::path::Path;

/// A residency on its own GPU whose model `base` has three adapter slots
/// (one GPU slot) for `p` (pinned), `a1`..`a4`, `big` (rank 16, past the
/// maxRank of 8) and `gone` (no files), all under `dir`.
async fn create(h: &Harness, dir: &Path) {
    let adapter = |name: &str, rank: u32| json!({"name": name, "rank": rank, "path": dir.join(name), "pinned": name == "p"});
    let adapters: Vec<_> = [("p", 8), ("a1", 8), ("a2", 8), ("a3", 8), ("a4", 8)]
        .iter()
        .chain(&[("big", 16), ("gone", 8)])
        .map(|&(n, r)| adapter(n, r))
        .collect();
    let r: ModelResidency = serde_json::from_value(json!({
        "apiVersion": "residency.dev/v1alpha1", "kind": "ModelResidency",
        "metadata": {"name": "gpu"},
        "spec": {"nodeName": h.node, "device": "0", "gpu": {"mode": "env"}, "budget": "10Gi",
            "models": [{"name": "base", "size": "6Gi", "template": server_template("base"),
                "lora": {"slots": 1, "hostSlots": 3, "maxRank": 8, "adapters": adapters}}]},
    }))
    .unwrap();
    h.api.create(&Default::default(), &r).await.unwrap();
}

/// The base model's pod's name and its server's address.
async fn base_pod(h: &Harness) -> (String, std::net::SocketAddr) {
    let name = pod_name("gpu", "base");
    let pod = h.pods.get(&name).await.unwrap();
    let ip = pod.status.unwrap().pod_ip.unwrap();
    (name, format!("{ip}:{DEFAULT_MODEL_PORT}").parse().unwrap())
}

/// The adapters the base model's server lists (its own /v1/models), in
/// the order it loaded them.
async fn listed(h: &Harness) -> Vec<String> {
    let a = send(base_pod(h).await.1, "GET", "/v1/models", "").await;
    let v: serde_json::Value = serde_json::from_str(&a.body).unwrap();
    v["data"]
        .as_array()
        .unwrap()
        .iter()
        .filter(|m| m["parent"] == "base")
        .map(|m| m["id"].as_str().unwrap().to_owned())
        .collect()
}

/// Waits until `base`'s status lists `held` as its pod's adapters (the
/// operator's audit asks the server).
async fn in_status(h: &Harness, held: &[&str]) {
    eventually(30, "the adapters the server holds in status", || async {
        let r = h.api.get("gpu").await.unwrap();
        let status = r.status?;
        let m = status.models.iter().find(|m| &*m.name == "base")?;
        m.adapters
            .iter()
            .map(|a| &**a)
            .eq(held.iter().copied())
            .then_some(())
    })
    .await;
}

/// Requests naming adapters are answered by them through the router: each
/// loaded on its first request, the least recently used unpinned one
/// unloaded when the three slots are full, the pinned one never; a rank
/// past the server's refused without a call; files that are not there a
/// clear 502 in the server's words; concurrent requests for one adapter
/// one load; a server that lost an adapter behind the router's back, and
/// a pod replaced, load again on the next request.
#[tokio::test]
#[ignore = "needs the local control plane: scripts/test.sh runs it with --include-ignored"]
async fn adapters_load_into_their_base_models_pods_least_recently_used_out() {
    let mut h = Harness::start("adapters").await;
    // The audit that reads what each pod's server holds into status.
    h.stop_operator().await;
    h.sleep_audit = std::time::Duration::from_millis(300);
    h.start_operator();
    let dir = tempfile::tempdir().unwrap();
    let files: Vec<(&str, u64, u64)> = ["p", "a1", "a2", "a3", "a4", "big"]
        .iter()
        .zip(1..)
        .map(|(&n, seed)| (n, if n == "big" { 16 } else { 8 }, seed))
        .collect();
    write_adapters(dir.path(), "base", &files).unwrap();
    create(&h, dir.path()).await;
    let router = RouterUnderTest::exact(&h).await;
    let served = |a: &crate::support::router::Answer, adapter: &str| {
        assert_eq!(a.status, 200, "{adapter}: {}", a.body);
        assert_eq!(
            json_of(a)["model"],
            adapter,
            "answered by the adapter asked"
        );
    };
    let metric = |name: &str, adapter: &str| {
        router.metric(
            &format!("model_residency_router_adapter_{name}_total"),
            &format!("adapter=\"{adapter}\""),
        )
    };
    // The first request loads the base model, then the adapter into it.
    for adapter in ["p", "a1", "a2"] {
        served(&router.chat(adapter).await, adapter);
    }
    assert_eq!(listed(&h).await, ["p", "a1", "a2"]);
    served(&router.chat("a1").await, "a1");
    assert_eq!(metric("hits", "a1"), 1);
    // Full: a3 takes the place of a2, the least recently used unpinned.
    served(&router.chat("a3").await, "a3");
    assert_eq!(listed(&h).await, ["p", "a1", "a3"]);
    assert_eq!(
        (metric("evictions", "a2"), metric("evictions", "a1")),
        (1, 0)
    );
    served(&router.chat("a2").await, "a2");
    assert_eq!(listed(&h).await, ["p", "a3", "a2"], "a1 out, p stays");
    in_status(&h, &["p", "a3", "a2"]).await;
    // The base model is served as ever beside its adapters.
    served(&router.chat("base").await, "base");
    // A rank past the server's: refused, never sent.
    let big = router.chat("big").await;
    assert_eq!(big.status, 503, "{}", big.body);
    assert_eq!(json_of(&big)["error"]["code"], "model_refused");
    assert!(big.body.contains("maxRank 8"), "{}", big.body);
    assert_eq!(metric("load_failures", "big") + metric("loads", "big"), 0);
    // ...and said by the operator in a condition, the residency Ready.
    let r = h.converged("gpu").await;
    let conditions = &r.status.as_ref().unwrap().conditions;
    let refused = conditions
        .iter()
        .find(|c| c.type_ == "AdaptersRefused")
        .expect("the AdaptersRefused condition");
    assert_eq!(refused.status, "True");
    assert!(
        refused.message.contains("`big` has rank 16"),
        "{}",
        refused.message
    );
    assert!(
        conditions
            .iter()
            .any(|c| c.type_ == "Ready" && c.status == "True")
    );
    // Files that are not there: the server's own words, nothing unloaded.
    let gone = router.chat("gone").await;
    assert_eq!(gone.status, 502, "{}", gone.body);
    assert_eq!(json_of(&gone)["error"]["code"], "adapter_load_failed");
    assert!(gone.body.contains("No adapter found"), "{}", gone.body);
    assert_eq!(metric("load_failures", "gone"), 1);
    // Listed by the router with their base as parent.
    let models = json_of(&router.get("/v1/models").await);
    let a1 = models["data"]
        .as_array()
        .unwrap()
        .iter()
        .find(|m| m["id"] == "a1")
        .cloned()
        .unwrap();
    assert_eq!(a1["parent"], "base");
    // Eight at once for a4: one load (a3 out, the least recently used).
    let answers = join_all((0..8).map(|_| router.chat("a4"))).await;
    for a in &answers {
        served(a, "a4");
    }
    assert_eq!(metric("loads", "a4"), 1);
    assert_eq!(metric("evictions", "a3"), 1);
    assert_eq!(listed(&h).await, ["p", "a2", "a4"]);
    // Status shows what the server holds, in its order; what it gained
    // and lost between two looks of the audit are events.
    in_status(&h, &["p", "a2", "a4"]).await;
    let events = h.events_of("gpu").await;
    let said = |reason: &str, adapter: &str| {
        events
            .iter()
            .any(|e| e.contains(reason) && e.contains(adapter))
    };
    assert!(said("AdapterLoaded", "a4"), "{events:#?}");
    assert!(said("AdapterUnloaded", "a3"), "{events:#?}");
    // Unloaded behind the router's back: the server's 404 is the truth,
    // and the request is answered after a load.
    let (pod, addr) = base_pod(&h).await;
    let unload = json!({"lora_name": "a4"}).to_string();
    let u = send(addr, "POST", "/v1/unload_lora_adapter", &unload).await;
    assert_eq!(u.status, 200, "{}", u.body);
    served(&router.chat("a4").await, "a4");
    assert_eq!(metric("loads", "a4"), 2);
    // The pod replaced: the new one holds nothing, and each adapter asked
    // is loaded into it again.
    let loads_before = metric("loads", "a2");
    h.pods.delete(&pod, &DeleteParams::default()).await.unwrap();
    eventually(60, "the replaced pod to answer a2", || async {
        let a = router.chat("a2").await;
        (a.status == 200 && metric("loads", "a2") == loads_before + 1).then_some(a)
    })
    .await;
    assert_eq!(listed(&h).await, ["a2"]);
    served(&router.chat("p").await, "p");
    assert_eq!(listed(&h).await, ["a2", "p"]);
    in_status(&h, &["a2", "p"]).await;
}
