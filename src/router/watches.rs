//! The router's watches: residencies and their model pods, folded into a
//! new [`Snapshot`] after each change, and the recency ticks that turn hits
//! into demand writes.

use super::Router;
use super::recency::Key;
use super::snapshot::Snapshot;
use crate::api::{ModelResidency, ModelState};
use crate::cluster::reflect;
use crate::residency::labels::MODEL_LABEL;
use k8s_openapi::api::core::v1::Pod;
use kube::api::Api;
use kube::runtime::reflector::{self, Store};
use kube::runtime::watcher;
use std::sync::Arc;
use std::time::{Duration, Instant};
use tokio::sync::{Notify, watch};

/// Watches residencies and model pods, and publishes a new snapshot after
/// each change (changes that come together are folded into one).
pub(super) async fn watch_cluster(
    router: std::sync::Weak<Router>,
    tx: watch::Sender<Arc<Snapshot>>,
) {
    let Some((client, config)) = router
        .upgrade()
        .map(|r| (r.client.clone(), r.config.clone()))
    else {
        return;
    };
    let residency_api: Api<ModelResidency> =
        crate::cluster::api_in(&client, config.namespace.as_deref());
    let pod_api: Api<Pod> = crate::cluster::api_in(&client, config.namespace.as_deref());
    let mut residency_config = watcher::Config::default();
    if let Some(selector) = &config.selector {
        residency_config = residency_config.labels(selector);
    }
    let pod_config = watcher::Config::default().labels(MODEL_LABEL);
    let (residencies, residency_writer) = reflector::store();
    let (pods, pod_writer) = reflector::store();
    let changed = Arc::new(Notify::new());
    let feed = futures::future::join(
        reflect(
            residency_writer,
            residency_api,
            residency_config,
            changed.clone(),
            "router's residency watch",
        ),
        reflect(
            pod_writer,
            pod_api,
            pod_config,
            changed.clone(),
            "router's pod watch",
        ),
    );
    let publish = async {
        let synced = async {
            let _ = residencies.wait_until_ready().await;
            let _ = pods.wait_until_ready().await;
        };
        synced.await;
        loop {
            let mut snapshot = build(&residencies, &pods);
            let Some(r) = router.upgrade() else {
                return;
            };
            snapshot.count_with(|pod| r.in_flight_of(pod));
            if tx.send(Arc::new(snapshot)).is_err() {
                return;
            }
            r.forget_idle_counters();
            r.ready.set();
            drop(r);
            changed.notified().await;
        }
    };
    tokio::join!(feed, publish);
}

fn build(residencies: &Store<ModelResidency>, pods: &Store<Pod>) -> Snapshot {
    Snapshot::build(true, residencies.state(), &pods.state())
}

/// Whether `key`'s model is Loaded or Loading on its residency, and not a copy
/// being removed.
fn still_resident(snap: &Snapshot, key: &Key) -> bool {
    if snap.draining.contains(key) {
        // The copy scaler is removing it.
        return false;
    }
    snap.residencies
        .iter()
        .position(|r| {
            kube::ResourceExt::namespace(&**r).as_deref() == Some(key.0.as_str())
                && kube::ResourceExt::name_any(&**r) == key.1
        })
        .is_some_and(|i| {
            matches!(
                snap.state(i, &key.2),
                ModelState::Loaded | ModelState::Loading | ModelState::Fetching
            )
        })
}

/// Refreshes the recency of models hit (or with requests in flight) since
/// their last write, every half resolution.
pub(super) async fn refresh_recency(router: std::sync::Weak<Router>) {
    let Some(period) = router
        .upgrade()
        .map(|r| (r.config.recency_resolution / 2).max(Duration::from_millis(50)))
    else {
        return;
    };
    let mut ticks = tokio::time::interval(period);
    ticks.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        ticks.tick().await;
        let Some(router) = router.upgrade() else {
            return;
        };
        let snap = router.snapshot.borrow().clone();
        for (key, at) in router.recency.due(Instant::now(), &snap.busy()) {
            // A model evicted since its hits is not refreshed: the write
            // would load it back for requests that are already answered.
            if !still_resident(&snap, &key) {
                continue;
            }
            let router = router.clone();
            tokio::spawn(async move {
                let _ = router.write(&key, at, "recency").await;
            });
        }
    }
}
