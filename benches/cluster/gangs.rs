//! `cargo bench --bench cluster -- gang [--samples N] [--load-ms L]`:
//! apply-to-status of a gang's request beside a single model's, on one
//! stand-in node of four GPUs (env mode, pods Ready at once, or L ms after
//! they start: a load time), same run, interleaved.
//!
//! - **Cold**: a request for a model nothing holds, until a status shows
//!   it processed (apply-to-status as the latency mode measures it: for
//!   the gang, once a member admitted it, after the coordinator placed
//!   it), then until its status says `Loaded` (a single model: on its
//!   GPU; the TP-2 gang: on both of its members). The gang's path has more steps in series: the gang
//!   coordinator places it (one write on each member), each member's
//!   reconcile admits it, the coordinator marks the placement ready once
//!   every member holds it, the head starts the pod, each member sees it
//!   Ready. Then both are unloaded (the gang: its demand key taken off the
//!   head, and so by the coordinator off every member) until nothing holds
//!   them, outside the timing.
//! - **Hit**: a request for the model while it is loaded, until the status
//!   shows it processed (a single model: its residency; the gang: the head,
//!   where the request went, then every member, which the coordinator's
//!   copy of the request reaches).

use futures::{StreamExt, TryStreamExt};
use k8s_openapi::jiff::Timestamp;
use kube::ResourceExt;
use kube::api::{Api, PostParams};
use kube::runtime::{WatchStreamExt, watcher};
use model_residency::api::{ModelResidency, ModelState};
use model_residency::local::kubelet::{FakeKubelet, FakeNode, KubeletConfig};
use model_residency::residency::demand;
use serde_json::json;
use std::collections::BTreeMap;
use std::time::{Duration, Instant};

use crate::support::{ms, percentile};

const NODE: &str = "node-gang";
const GPUS: [&str; 4] = ["g0", "g1", "g2", "g3"];
/// How long one load or unload may take before the bench gives up.
const WITHIN: Duration = Duration::from_secs(60);

/// Each residency's models as the watch last saw them: model -> (state,
/// lastRequested).
type Seen = BTreeMap<String, BTreeMap<String, (ModelState, String)>>;

pub async fn gang(client: &kube::Client, samples: usize, load: Duration) {
    let mut node = FakeNode::new(NODE, 4);
    node.gpu_memory = 8 << 30;
    let config = KubeletConfig {
        nodes: vec![node],
        load_delay: load,
        ..KubeletConfig::instant(&[])
    };
    let _kubelet = FakeKubelet::start(client.clone(), config).await.unwrap();
    let api: Api<ModelResidency> = Api::namespaced(client.clone(), super::NS);
    let template = |n: &str| json!({"spec": {"containers": [{"name": "server", "image": format!("example/{n}:1")}]}});
    for gpu in GPUS {
        let r: ModelResidency = serde_json::from_value(json!({
            "apiVersion": "residency.dev/v1alpha1", "kind": "ModelResidency",
            "metadata": {"name": gpu},
            "spec": {"nodeName": NODE, "device": super::gpu_of(gpu), "budget": "8Gi",
                     "gpu": {"mode": "env"},
                     "models": [
                         {"name": "single", "size": "2Gi", "template": template("single")},
                         {"name": "tp", "size": "2Gi", "gpus": 2, "template": template("tp")},
                     ]},
        }))
        .unwrap();
        api.create(&PostParams::default(), &r).await.unwrap();
    }
    let seen = watch_all(api.clone());
    let (_ctx, operator) = super::start_operator(client);

    let mut cold_single = Vec::with_capacity(samples);
    let mut cold_gang = Vec::with_capacity(samples);
    let mut processed_single = Vec::with_capacity(samples);
    let mut processed_gang = Vec::with_capacity(samples);
    let mut hit_single = Vec::with_capacity(samples);
    let mut hit_gang_head = Vec::with_capacity(samples);
    let mut hit_gang_all = Vec::with_capacity(samples);
    for _ in 0..samples {
        // The single model on the last GPU, the gang where it is placed.
        let at = Timestamp::now();
        let t0 = Instant::now();
        demand::load(&api, "g3", "single", at).await.unwrap();
        let want = at.to_string();
        until(&seen, "single processed", |s| {
            requested(s, "single", &want) == 1
        })
        .await;
        processed_single.push(t0.elapsed());
        until(&seen, "single Loaded", |s| holders(s, "single", true) == 1).await;
        cold_single.push(t0.elapsed());

        let at = Timestamp::now();
        let t0 = Instant::now();
        demand::load(&api, "g0", "tp", at).await.unwrap();
        let want = at.to_string();
        until(&seen, "tp processed", |s| requested(s, "tp", &want) >= 1).await;
        processed_gang.push(t0.elapsed());
        until(&seen, "tp Loaded on two GPUs", |s| {
            holders(s, "tp", true) == 2
        })
        .await;
        cold_gang.push(t0.elapsed());

        let at = Timestamp::now();
        let t0 = Instant::now();
        demand::load(&api, "g3", "single", at).await.unwrap();
        let want = at.to_string();
        until(&seen, "the single hit", |s| {
            requested(s, "single", &want) == 1
        })
        .await;
        hit_single.push(t0.elapsed());

        let at = Timestamp::now();
        let t0 = Instant::now();
        demand::load(&api, "g0", "tp", at).await.unwrap();
        let want = at.to_string();
        until(&seen, "the gang hit on its head", |s| {
            s.get("g0")
                .and_then(|m| m.get("tp"))
                .is_some_and(|(_, t)| *t == want)
        })
        .await;
        hit_gang_head.push(t0.elapsed());
        until(&seen, "the gang hit on both members", |s| {
            requested(s, "tp", &want) == 2
        })
        .await;
        hit_gang_all.push(t0.elapsed());

        // Unloaded, outside the timing.
        demand::unload(&api, "g3", "single").await.unwrap();
        demand::unload(&api, "g0", "tp").await.unwrap();
        until(&seen, "both unloaded", |s| {
            holders(s, "single", false) == 0 && holders(s, "tp", false) == 0
        })
        .await;
    }
    operator.abort();
    let _ = operator.await;

    let row = |label: &str, v: &mut Vec<Duration>| {
        v.sort();
        let (p50, p99) = (ms(percentile(v, 0.5)), ms(percentile(v, 0.99)));
        println!("  {label:<52} p50 {p50:>8.2} ms  p99 {p99:>8.2} ms");
        (p50, p99)
    };
    println!(
        "gang apply-to-status over {samples} samples each (interleaved), one node of 4 GPUs, env mode, pods Ready {} ms after they start:",
        load.as_millis()
    );
    let (ps50, ps99) = row("cold single (request -> processed)", &mut processed_single);
    let (pg50, pg99) = row(
        "cold TP-2 gang (request -> processed on a member)",
        &mut processed_gang,
    );
    let (cs50, cs99) = row("cold single (request -> Loaded)", &mut cold_single);
    let (cg50, cg99) = row("cold TP-2 gang (request -> Loaded on both)", &mut cold_gang);
    let (hs50, _) = row("hit single (request -> processed)", &mut hit_single);
    let (hh50, _) = row(
        "hit gang (request -> processed on its head)",
        &mut hit_gang_head,
    );
    let (ha50, _) = row("hit gang (request -> processed on both)", &mut hit_gang_all);
    println!(
        "  gang / single: cold until processed p50 {:.2}x p99 {:.2}x (goal <= 1.5x); until Loaded p50 {:.2}x p99 {:.2}x; hit on the head p50 {:.2}x, on both p50 {:.2}x",
        pg50 / ps50,
        pg99 / ps99,
        cg50 / cs50,
        cg99 / cs99,
        hh50 / hs50,
        ha50 / hs50
    );
}

/// Every residency's models, kept current by one watch of the namespace.
fn watch_all(api: Api<ModelResidency>) -> tokio::sync::watch::Receiver<Seen> {
    let (tx, rx) = tokio::sync::watch::channel(Seen::new());
    tokio::spawn(async move {
        let mut s = watcher(api, watcher::Config::default())
            .applied_objects()
            .boxed();
        while let Ok(Some(r)) = s.try_next().await {
            let models = r
                .status
                .iter()
                .flat_map(|s| &s.models)
                .map(|m| {
                    let at = m.last_requested.as_deref().unwrap_or_default();
                    (m.name.to_string(), (m.state, at.to_owned()))
                })
                .collect();
            let name = r.name_any();
            tx.send_modify(|seen| {
                seen.insert(name, models);
            });
        }
    });
    rx
}

/// How many residencies hold `model` Loaded (`loaded`), or resident at all.
fn holders(seen: &Seen, model: &str, loaded: bool) -> usize {
    seen.values()
        .filter_map(|m| m.get(model))
        .filter(|(state, _)| {
            if loaded {
                *state == ModelState::Loaded
            } else {
                state.is_resident() || *state == ModelState::Loading
            }
        })
        .count()
}

/// How many residencies show `model` requested at `at`.
fn requested(seen: &Seen, model: &str, at: &str) -> usize {
    seen.values()
        .filter_map(|m| m.get(model))
        .filter(|(_, t)| t == at)
        .count()
}

async fn until(
    seen: &tokio::sync::watch::Receiver<Seen>,
    what: &str,
    done: impl Fn(&Seen) -> bool,
) {
    let mut rx = seen.clone();
    tokio::time::timeout(WITHIN, rx.wait_for(|s| done(s)))
        .await
        .unwrap_or_else(|_| panic!("{what}: not within {WITHIN:?}: {:?}", *seen.borrow()))
        .unwrap();
}
