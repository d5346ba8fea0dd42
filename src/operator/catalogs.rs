//! The ModelCatalogs in the operator: watched into the context's catalogs
//! (every residency naming a changed catalog reconciled), and each
//! catalog's model count written into its status.

use super::*;
use std::collections::HashMap;

/// The ModelCatalogs, watched into `ctx.catalogs` by a task of their own
/// (ended with the returned guard): a change to one (deleted included)
/// reconciles every residency that names it, through the returned
/// stream. The watch runs apart from the controller's trigger streams: a
/// reconcile that waits for the catalogs' first list must not be what
/// keeps that list from being read (the controller stops pulling its
/// triggers while its reconciles wait). A cluster that does not serve the
/// kind (CRDs of an earlier release) leaves the catalogs empty: a
/// residency naming one says its catalog is missing.
pub(super) async fn catalog_events(
    ctx: Arc<Context>,
    namespace: Option<&str>,
    residencies: reflector::Store<ModelResidency>,
) -> (
    futures::stream::BoxStream<'static, ObjectRef<ModelResidency>>,
    Option<AbortOnDrop>,
) {
    use crate::api::ModelCatalog;
    use crate::residency::catalog::Catalogs;
    let api: Api<ModelCatalog> = crate::cluster::api_in(&ctx.client, namespace);
    if let Err(e) = api
        .list_metadata(&kube::api::ListParams::default().limit(1))
        .await
    {
        tracing::info!(error = %e, "ModelCatalog objects are not served: residencies naming a catalog say it is missing");
        return (futures::stream::empty().boxed(), None);
    }
    let (store, writer) = reflector::store();
    ctx.catalogs.set(store);
    let (tx, rx) = futures::channel::mpsc::unbounded();
    // The generation each catalog's users last saw: a change of status
    // alone (the model count written below) or a relist that finds the
    // catalog as it was reconciles none of them (ten thousand residencies
    // may name one catalog).
    let mut seen: HashMap<ObjectRef<ModelCatalog>, Option<i64>> = HashMap::new();
    // The catalogs a relist has found so far: one it no longer finds was
    // deleted while the watch was down (no Delete event says so).
    let mut relisted: Option<std::collections::HashSet<ObjectRef<ModelCatalog>>> = None;
    let watch = reflector(writer, watcher(api, watcher::Config::default()))
        .backoff(crate::cluster::WatchBackoff::default())
        .for_each(move |event| {
            let touched = match event {
                Ok(watcher::Event::Init) => {
                    relisted = Some(Default::default());
                    Vec::new()
                }
                Ok(watcher::Event::InitDone) => {
                    let found = relisted.take().unwrap_or_default();
                    let gone: Vec<_> = seen
                        .keys()
                        .filter(|k| !found.contains(*k))
                        .cloned()
                        .collect();
                    gone.iter()
                        .flat_map(|key| {
                            seen.remove(key);
                            Catalogs::users(&residencies, key)
                        })
                        .collect()
                }
                Ok(watcher::Event::Apply(c) | watcher::Event::InitApply(c)) => {
                    count_models(&ctx, &c);
                    let key = ObjectRef::from_obj(&c);
                    if let Some(found) = &mut relisted {
                        found.insert(key.clone());
                    }
                    let generation = c.metadata.generation;
                    if seen.insert(key.clone(), generation) == Some(generation) {
                        Vec::new()
                    } else {
                        Catalogs::users(&residencies, &key)
                    }
                }
                Ok(watcher::Event::Delete(c)) => {
                    let key = ObjectRef::from_obj(&c);
                    seen.remove(&key);
                    Catalogs::users(&residencies, &key)
                }
                Err(e) => {
                    tracing::debug!(error = %e, "catalog watch");
                    Vec::new()
                }
            };
            for r in touched {
                let _ = tx.unbounded_send(r);
            }
            futures::future::ready(())
        });
    (rx.boxed(), Some(AbortOnDrop(tokio::spawn(watch))))
}

/// Writes a catalog's model count into its status (`kubectl get mcat`)
/// when it is not what the status says, in the background.
pub(super) fn count_models(ctx: &Arc<Context>, c: &crate::api::ModelCatalog) {
    let models = c.spec.models.len() as u32;
    let current = c.status.as_ref();
    if current.is_some_and(|s| s.models == models && s.observed_generation == c.metadata.generation)
    {
        return;
    }
    let (Some(ns), name) = (c.namespace(), c.name_any()) else {
        return;
    };
    let status = crate::api::ModelCatalogStatus {
        models,
        observed_generation: c.metadata.generation,
    };
    let ctx = ctx.clone();
    tokio::spawn(async move {
        let api: Api<crate::api::ModelCatalog> = Api::namespaced(ctx.client.clone(), &ns);
        ctx.metrics.api_request("patch", "modelcatalogs");
        if let Err(e) = crate::cluster::apply_status(&api, &name, MANAGER, &status).await {
            tracing::debug!(error = %e, "catalog status");
        }
    });
}
