//! The router's watches: residencies, the ModelCatalogs they name and
//! their model pods, folded into a new [`Snapshot`] after each change (a
//! residency's models read with its catalog), and the recency ticks that
//! turn hits into demand writes.

use super::Router;
use super::recency::Key;
use super::snapshot::Snapshot;
use crate::api::{ModelCatalog, ModelResidency, ModelState};
use crate::cluster::reflect;
use crate::residency::catalog::Catalogs;
use crate::residency::labels::MODEL_LABEL;
use k8s_openapi::api::core::v1::Pod;
use kube::api::Api;
use kube::runtime::reflector::{self, Store};
use kube::runtime::watcher;
use std::collections::{HashMap, HashSet};
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
    // The catalogs, where the cluster serves them (CRDs of an earlier
    // release do not: every residency is then read as it is).
    let catalog_api: Api<ModelCatalog> =
        crate::cluster::api_in(&client, config.namespace.as_deref());
    let catalogs = Catalogs::default();
    let served = catalog_api
        .list_metadata(&kube::api::ListParams::default().limit(1))
        .await
        .is_ok();
    let catalog_feed = async {
        if served {
            let (store, writer) = reflector::store();
            catalogs.set(store);
            reflect(
                writer,
                catalog_api,
                watcher::Config::default(),
                changed.clone(),
                "router's catalog watch",
            )
            .await;
        }
    };
    let feed = futures::future::join3(
        catalog_feed,
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
            catalogs.wait_ready().await;
        };
        synced.await;
        let mut registries = Registries::default();
        loop {
            let mut snapshot = registries.build(&residencies, &catalogs, &pods);
            let Some(r) = router.upgrade() else {
                return;
            };
            snapshot.count_with(|pod| r.in_flight_of(pod));
            r.adapters.retain(&snapshot);
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

/// Each residency's registry as last read with its catalog, for when its
/// catalog cannot be read (a GitOps tool deleting and making it again): the
/// operator keeps its models meanwhile (`CatalogUnavailable`), so the
/// router keeps serving them rather than answering that they do not exist.
#[derive(Default)]
struct Registries {
    last: HashMap<(String, String), Vec<crate::api::ModelSpec>>,
}

impl Registries {
    /// The snapshot of the residencies, each read with its catalog; one
    /// whose catalog cannot be read with its last registry read (else its
    /// own models only), and counted as such in the snapshot.
    fn build(
        &mut self,
        residencies: &Store<ModelResidency>,
        catalogs: &Catalogs,
        pods: &Store<Pod>,
    ) -> Snapshot {
        let mut unreadable = 0;
        let mut seen = HashSet::new();
        let resolved: Vec<Arc<ModelResidency>> = residencies
            .state()
            .into_iter()
            .map(|r| {
                let key = (
                    kube::ResourceExt::namespace(&*r).unwrap_or_default(),
                    kube::ResourceExt::name_any(&*r),
                );
                let out = match catalogs.resolve(r.clone()) {
                    Ok(resolved) => {
                        if resolved.spec.catalog.is_some() {
                            self.last.insert(key.clone(), resolved.spec.models.clone());
                        }
                        resolved
                    }
                    Err(_) => {
                        unreadable += 1;
                        match self.last.get(&key) {
                            Some(models) => {
                                let mut kept = (*r).clone();
                                kept.spec.models = models.clone();
                                Arc::new(kept)
                            }
                            None => r,
                        }
                    }
                };
                seen.insert(key);
                out
            })
            .collect();
        self.last.retain(|k, _| seen.contains(k));
        let mut snapshot = Snapshot::build(true, resolved, &pods.state());
        snapshot.catalogs_unreadable = unreadable;
        snapshot
    }
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
