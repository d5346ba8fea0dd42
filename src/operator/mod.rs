//! The operator process (`model-residency run`): what runs, and under
//! which leadership. One residency watch feeds the residency controller
//! ([`crate::controller`]) and, when its CRD is installed, the ModelDemand
//! controller ([`model_demand`]); the model-pod and node-cache watches wake
//! the residencies they concern; [`run_elected`] runs all of it only while
//! this replica holds the Lease ([`lease`]). Wiring only: what a reconcile
//! decides and does is the controllers' business.

mod backlog;
mod catalogs;
mod cordons;
pub mod gangs;

use catalogs::*;

pub mod lease;
pub mod model_demand;
pub mod residency_set;

use crate::api::ModelResidency;
use crate::controller::{
    Context, RECONCILE_CONCURRENCY, cached, error_policy, fast_lane, log_controller_error,
    model_names, reconcile_in_turn, relist,
};
use crate::http::Readiness;
use crate::residency::labels::{MANAGER, RESIDENCY_LABEL};
use futures::{StreamExt, TryStreamExt};
use k8s_openapi::api::core::v1::Pod;
use kube::ResourceExt;
use kube::api::Api;
use kube::runtime::controller::Controller;
use kube::runtime::reflector::ObjectRef;
use kube::runtime::{WatchStreamExt, reflector, watcher};
use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::Duration;

/// Runs the controller for `namespace` (all namespaces when `None`) until
/// `shutdown` completes. `synced` is set once the first watch lists are in.
pub async fn run(
    ctx: Arc<Context>,
    namespace: Option<String>,
    shutdown: impl std::future::Future<Output = ()> + Send + Sync + 'static,
    synced: Readiness,
) {
    let shutdown = futures::FutureExt::shared(shutdown);
    let client = ctx.client.clone();
    let residencies: Api<ModelResidency> = crate::cluster::api_in(&client, namespace.as_deref());
    let pods: Api<Pod> = crate::cluster::api_in(&client, namespace.as_deref());
    // The cache of residencies keeps what `cached::compact` leaves.
    let (store, writer) = reflector::store();
    let (claim_tx, claim_rx) = futures::channel::mpsc::unbounded();
    let (changed_tx, changed_rx) = futures::channel::mpsc::unbounded();
    let (set_tx, set_rx) = futures::channel::mpsc::unbounded();
    let (gang_tx, gang_rx) = futures::channel::mpsc::unbounded();
    let (handed_back_tx, handed_back_rx) = futures::channel::mpsc::unbounded();
    // Bursts (a list's every residency) go to the controller as it takes
    // them.
    let (burst_tx, burst_rx) = futures::channel::mpsc::unbounded();
    let backlog = backlog::paced(
        {
            let metrics = ctx.metrics.clone();
            move || metrics.reconciles_started()
        },
        burst_rx,
    );
    // A residency whose sleeps and wakes were asked is reconciled again
    // when they end.
    let (asked_tx, asked_rx) = futures::channel::mpsc::unbounded();
    ctx.asking.announce_to(asked_tx);
    // Whoever runs next (this replica again, or the new leader) asks again
    // what is still to ask.
    let _asking = ctx.asking.while_running();
    let lane = Arc::new(fast_lane::FastLane::new(ctx.clone(), handed_back_tx));
    let model_demands = start_model_demands(
        &ctx,
        namespace.as_deref(),
        shutdown.clone(),
        store.clone(),
        changed_rx,
    )
    .await;
    let _sets = start_residency_sets(
        &ctx,
        namespace.as_deref(),
        shutdown.clone(),
        store.clone(),
        set_rx,
    )
    .await;
    let residency_events = residency_events(
        &ctx,
        residencies,
        writer,
        Told {
            claim_tx,
            burst_tx: burst_tx.clone(),
            changed_tx: model_demands.is_some().then_some(changed_tx),
            set_tx,
            gang_tx,
        },
        lane.clone(),
    );
    // At most this many reconciles at once: each holds an API connection
    // (TLS and HTTP buffers, pooled afterwards), so an unbounded burst at
    // start-up over thousands of residencies costs memory and floods the
    // API server for no gain.
    let controller = Controller::for_stream(residency_events, store.clone()).with_config(
        kube::runtime::controller::Config::default().concurrency(RECONCILE_CONCURRENCY),
    );
    let pod_events = pod_events(&ctx, pods, burst_tx);
    let (catalog_events, _catalog_watch) =
        catalog_events(ctx.clone(), namespace.as_deref(), store.clone()).await;
    let cache_events = node_cache_events(ctx.clone(), store.clone()).await;
    let gpu_events = gpu_events(ctx.clone(), namespace.as_deref(), store.clone()).await;
    let gpu_events = futures::stream::select(
        gpu_events,
        cordons::cordon_events(ctx.clone(), store.clone()),
    );
    // Ended with this function however it ends: a lost lease aborts it
    // (`Term`), and a copy scaler left running would go on adding and
    // removing copies beside the new leader's.
    let _sync = AbortOnDrop(tokio::spawn(mark_synced(
        store.clone(),
        ctx.clone(),
        synced.clone(),
    )));
    // Each supervised: restarted when it panics or ends, counted, and
    // `/healthz` fails when one keeps failing (crate::supervise).
    let supervised = |task: &'static str, start: Box<dyn FnMut() -> Task + Send>| {
        AbortOnDrop(tokio::spawn(crate::supervise::supervised(
            task,
            ctx.metrics.clone(),
            synced.clone(),
            start,
        )))
    };
    let _copies = {
        let (ctx, namespace, store) = (ctx.clone(), namespace.clone(), store.clone());
        supervised(
            "copies",
            Box::new(move || {
                let f = crate::controller::copies::run(
                    ctx.clone(),
                    namespace.clone(),
                    store.clone(),
                    ctx.copies.clone(),
                );
                Box::pin(f) as Task
            }),
        )
    };
    let gang_rx = Arc::new(tokio::sync::Mutex::new(gang_rx));
    let _gangs = {
        let (ctx, store) = (ctx.clone(), store.clone());
        supervised(
            "gangs",
            Box::new(move || {
                let (ctx, store, rx) = (ctx.clone(), store.clone(), gang_rx.clone());
                Box::pin(gangs::run(ctx, store, rx)) as Task
            }),
        )
    };
    let _sleep_audit = {
        let (ctx, store) = (ctx.clone(), store.clone());
        supervised(
            "sleep-audit",
            Box::new(move || {
                let f = crate::controller::sleep_audit::run(
                    ctx.clone(),
                    store.clone(),
                    ctx.sleep_audit,
                );
                Box::pin(f) as Task
            }),
        )
    };
    let _evacuate = {
        let (ctx, store) = (ctx.clone(), store.clone());
        supervised(
            "evacuate",
            Box::new(move || {
                let f = crate::controller::evacuate::run(ctx.clone(), store.clone());
                Box::pin(f) as Task
            }),
        )
    };
    controller
        .reconcile_on(futures::stream::select(
            futures::stream::select(
                futures::stream::select(pod_events, claim_rx),
                futures::stream::select(asked_rx, backlog),
            ),
            futures::stream::select(
                futures::stream::select(cache_events, handed_back_rx),
                futures::stream::select(gpu_events, catalog_events),
            ),
        ))
        .graceful_shutdown_on(shutdown)
        .run(
            move |r, ctx| reconcile_in_turn(r, ctx, store.clone()),
            error_policy,
            ctx,
        )
        .for_each(|result| async move {
            if let Err(e) = result {
                log_controller_error(&e);
            }
        })
        .await;
    // A graceful shutdown lets the lane's reconciles finish as the
    // controller's did (an aborted run drops them with the lane).
    lane.finish().await;
}

/// Who the residency watch tells of changes: the residencies sharing a
/// GPU (`claim_tx`), every residency at a list's end (`burst_tx`, paced
/// by [`backlog`]), the ModelDemand controller when it runs
/// (`changed_tx`), the ResidencySet controller (`set_tx`) and the gang
/// coordinator (`gang_tx`).
struct Told {
    claim_tx: futures::channel::mpsc::UnboundedSender<ObjectRef<ModelResidency>>,
    burst_tx: futures::channel::mpsc::UnboundedSender<Vec<ObjectRef<ModelResidency>>>,
    changed_tx: Option<futures::channel::mpsc::UnboundedSender<ObjectRef<ModelResidency>>>,
    set_tx: futures::channel::mpsc::UnboundedSender<ObjectRef<crate::api::ResidencySet>>,
    gang_tx: futures::channel::mpsc::UnboundedSender<ObjectRef<ModelResidency>>,
}

/// The residency watch: compacted into the cache, recording deletions and
/// GPU claims (and waking the residencies sharing a GPU with one that
/// changed), telling the ModelDemand controller (`changed`, when it runs)
/// what changed after the cache has it, and offering each live change to
/// the fast lane first.
fn residency_events(
    ctx: &Arc<Context>,
    residencies: Api<ModelResidency>,
    writer: reflector::store::Writer<ModelResidency>,
    told: Told,
    offered: Arc<fast_lane::FastLane>,
) -> impl futures::Stream<Item = Result<ModelResidency, watcher::Error>> + Send + use<> {
    let Told {
        claim_tx,
        burst_tx,
        changed_tx,
        set_tx,
        gang_tx,
    } = told;
    let cached = writer.as_reader();
    watcher(residencies, ctx.initial_list.config())
        .backoff(crate::cluster::WatchBackoff::default())
        .modify(cached::compact)
        .inspect_ok({
            // A deleted residency's metrics go with it, also one deleted
            // while the watch was down (the list that follows leaves it
            // out). Every event updates the GPU claims; the residencies
            // sharing a GPU with the one it is about are reconciled (their
            // holder may have changed).
            let ctx = ctx.clone();
            let mut relist = relist::Relist::default();
            move |event| {
                if let watcher::Event::Delete(r) = event {
                    ctx.metrics
                        .forget(&r.namespace().unwrap_or_default(), &r.name_any());
                    ctx.written.forget(r);
                    ctx.forecasts
                        .forget(&r.namespace().unwrap_or_default(), &r.name_any());
                }
                if let Some(present) = relist.record(event) {
                    ctx.metrics.keep_only(&present);
                    ctx.written.keep_only(&present);
                    ctx.forecasts.keep_only(&present);
                }
                for other in ctx.claims.record(event) {
                    let _ = claim_tx.unbounded_send(other);
                }
                // Names listed from several namespaces: their listers'
                // `NameShadowed` may have changed.
                let listed = |r: &ModelResidency| match &r.spec.catalog {
                    None => model_names::listed(r),
                    Some(_) => match ctx.catalogs.resolve(Arc::new(r.clone())) {
                        Ok(resolved) => model_names::listed(&resolved),
                        Err(_) => model_names::listed(r),
                    },
                };
                for other in ctx.names.record(event, listed) {
                    let _ = claim_tx.unbounded_send(other);
                }
            }
        })
        .reflect(writer)
        .inspect_ok(move |event| {
            // A whole list is in the cache only now (it swaps the list in
            // at its end): every residency is reconciled from here, on the
            // listed copies (see the filter below).
            if let watcher::Event::InitDone = event {
                let every = cached
                    .state()
                    .iter()
                    .map(|r| {
                        ObjectRef::new(&r.name_any()).within(&r.namespace().unwrap_or_default())
                    })
                    .collect();
                let _ = burst_tx.unbounded_send(every);
            }
            // After the cache has it: the ModelDemands naming this
            // residency read it there.
            if let watcher::Event::Apply(r)
            | watcher::Event::InitApply(r)
            | watcher::Event::Delete(r) = event
            {
                if let Some(changed_tx) = &changed_tx {
                    let _ = changed_tx.unbounded_send(ObjectRef::from_obj(r));
                }
                // The gang coordinator looks at the nodes with gangs.
                let _ = gang_tx.unbounded_send(ObjectRef::from_obj(r));
                // A stamped residency's change is its set's to count.
                if let Some(set) = residency_set::set_of(r) {
                    let _ = set_tx.unbounded_send(set);
                }
            }
        })
        // A residency's own change is reconciled at once when the fast
        // lane can take it; the rest go through the controller's queue.
        // Only live changes: during a list (a watch that restarts) the
        // cache keeps the previous copies until the whole list is in, so a
        // reconcile started at once would act on an old copy and swallow
        // the event (seen in the API-server-restart fault test). For the
        // same reason a list's objects do not go to the controller's queue
        // one by one either (a reconcile the queue ran before the list's
        // end read the old copy, found nothing to do, and the change was
        // never reconciled: generation 36 observed 35 for a minute after
        // an API server restart); the list's end queues them all, above.
        .try_filter_map(move |event| {
            futures::future::ready(Ok(match event {
                watcher::Event::Apply(r) => offered.offer(r).map(watcher::Event::Apply),
                watcher::Event::InitApply(_) => None,
                other => Some(other),
            }))
        })
        .touched_objects()
}

/// Model pods: one watch by label feeds the pod cache, and wakes the
/// residency each event concerns (after the cache has it); those of a
/// list's pods go to `burst_tx`, paced.
fn pod_events(
    ctx: &Arc<Context>,
    pods: Api<Pod>,
    burst_tx: futures::channel::mpsc::UnboundedSender<Vec<ObjectRef<ModelResidency>>>,
) -> impl futures::Stream<Item = ObjectRef<ModelResidency>> + Send + use<> {
    ctx.pods.reset();
    let cache = ctx.clone();
    watcher(pods, ctx.initial_list.config().labels(RESIDENCY_LABEL))
        .backoff(crate::cluster::WatchBackoff::default())
        .flat_map(move |event| {
            let touched = match event {
                Ok(ev @ watcher::Event::InitApply(_)) => {
                    let listed = cache.pods.record(&ev);
                    if !listed.is_empty() {
                        let _ = burst_tx.unbounded_send(listed);
                    }
                    Vec::new()
                }
                Ok(ev) => cache.pods.record(&ev),
                Err(e) => {
                    tracing::debug!(error = %e, "pod watch");
                    Vec::new()
                }
            };
            futures::stream::iter(touched)
        })
}

/// The ResidencySet controller, beside the residency controller and under
/// the same leadership; `None` when the cluster does not serve the kind
/// (CRDs of an earlier release).
async fn start_residency_sets(
    ctx: &Context,
    namespace: Option<&str>,
    shutdown: impl std::future::Future<Output = ()> + Send + Sync + 'static,
    residencies: reflector::Store<ModelResidency>,
    owned: futures::channel::mpsc::UnboundedReceiver<ObjectRef<crate::api::ResidencySet>>,
) -> Option<AbortOnDrop> {
    let sets: Api<crate::api::ResidencySet> = crate::cluster::api_in(&ctx.client, namespace);
    if let Err(e) = sets
        .list_metadata(&kube::api::ListParams::default().limit(1))
        .await
    {
        tracing::info!(error = %e, "ResidencySet objects are not served: no residencies are stamped");
        return None;
    }
    let task = residency_set::run(
        ctx.client.clone(),
        ctx.metrics.clone(),
        namespace.map(str::to_owned),
        shutdown,
        residencies,
        owned,
    );
    Some(AbortOnDrop(tokio::spawn(task)))
}

/// The ModelDemand controller, beside the residency controller and under
/// the same leadership (it stops when the returned guard is dropped); `None`
/// when the opt-in CRD is not installed.
async fn start_model_demands(
    ctx: &Context,
    namespace: Option<&str>,
    shutdown: impl std::future::Future<Output = ()> + Send + Sync + 'static,
    residencies: reflector::Store<ModelResidency>,
    changed: futures::channel::mpsc::UnboundedReceiver<ObjectRef<ModelResidency>>,
) -> Option<AbortOnDrop> {
    if !model_demand::installed(&ctx.client, namespace).await {
        return None;
    }
    let task = model_demand::run(
        ctx.client.clone(),
        ctx.metrics.clone(),
        namespace.map(str::to_owned),
        shutdown,
        residencies,
        ctx.catalogs.clone(),
        changed,
    );
    Some(AbortOnDrop(tokio::spawn(task)))
}

/// The nodes' artifact caches (`NodeModelCache`, when its opt-in CRD is
/// installed): each change is recorded in the context and wakes the
/// residencies on that node (a model waiting in Fetching may start).
async fn node_cache_events(
    ctx: Arc<Context>,
    residencies: reflector::Store<ModelResidency>,
) -> futures::stream::BoxStream<'static, ObjectRef<ModelResidency>> {
    use crate::api::NodeModelCache;
    let api: Api<NodeModelCache> = Api::all(ctx.client.clone());
    match api
        .list_metadata(&kube::api::ListParams::default().limit(1))
        .await
    {
        Ok(_) => {}
        Err(e) => {
            tracing::info!(error = %e, "NodeModelCache objects are not served: models with an artifact wait in Fetching");
            return futures::stream::empty().boxed();
        }
    }
    watcher(api, watcher::Config::default())
        .backoff(crate::cluster::WatchBackoff::default())
        .flat_map(move |event| {
            let mut nodes = Vec::new();
            match event {
                Ok(watcher::Event::Apply(c) | watcher::Event::InitApply(c)) => {
                    if ctx.node_caches.record(&c) {
                        nodes.push(c.name_any());
                    }
                }
                Ok(watcher::Event::Delete(c)) => {
                    ctx.node_caches.forget(&c.name_any());
                    nodes.push(c.name_any());
                }
                Ok(_) => {}
                Err(e) => tracing::debug!(error = %e, "NodeModelCache watch"),
            }
            let touched: Vec<ObjectRef<ModelResidency>> = residencies
                .state()
                .iter()
                .filter(|r| {
                    crate::residency::gpu::node_of(r).is_some_and(|n| nodes.iter().any(|x| x == n))
                })
                .map(|r| ObjectRef::from_obj(&**r))
                .collect();
            futures::stream::iter(touched)
        })
        .boxed()
}

/// Claim mode's watches, when the cluster serves resource.k8s.io/v1: the
/// ResourceClaims (each change wakes the residency whose claim it is, by
/// label, or that names it in spec.gpu.existingClaim) and the
/// ResourceSlices (the devices, for status.gpu and the budget; a change
/// wakes the claim-mode residencies, which read their device again).
async fn gpu_events(
    ctx: Arc<Context>,
    namespace: Option<&str>,
    residencies: reflector::Store<ModelResidency>,
) -> futures::stream::BoxStream<'static, ObjectRef<ModelResidency>> {
    use k8s_openapi::api::resource::v1::{ResourceClaim, ResourceSlice};
    let claims: Api<ResourceClaim> = crate::cluster::api_in(&ctx.client, namespace);
    let served = claims
        .list_metadata(&kube::api::ListParams::default().limit(1))
        .await;
    match &served {
        Ok(_) => ctx.gpus.set_served(true),
        Err(e) => {
            tracing::info!(error = %e, "ResourceClaims (resource.k8s.io/v1) are not served or not readable: residencies in claim mode wait with Ready=False");
            let why = claims_unserved(e);
            ctx.gpus.set_unserved(why);
            return futures::stream::empty().boxed();
        }
    }
    let slices: Api<ResourceSlice> = Api::all(ctx.client.clone());
    let slice_ctx = ctx.clone();
    let slice_store = residencies.clone();
    let slice_events = watcher(slices, crate::cluster::slice_watch_config())
        .backoff(crate::cluster::WatchBackoff::default())
        .flat_map(move |event| {
            let touched = match &event {
                Ok(ev) => {
                    slice_ctx.gpus.record_slice(ev);
                    match ev {
                        // The claim-mode residencies on the slice's node,
                        // and those not placed yet (a device may have come).
                        watcher::Event::Apply(slice) | watcher::Event::Delete(slice) => {
                            near_slice(&slice_store, slice.spec.node_name.as_deref())
                        }
                        _ => Vec::new(),
                    }
                }
                Err(e) => {
                    tracing::debug!(error = %e, "ResourceSlice watch");
                    Vec::new()
                }
            };
            futures::stream::iter(touched)
        });
    let claim_events = watcher(claims, watcher::Config::default())
        .backoff(crate::cluster::WatchBackoff::default())
        .flat_map(move |event| {
            let touched: Vec<ObjectRef<ModelResidency>> = match &event {
                Ok(ev) => ctx
                    .gpus
                    .record_claim(ev)
                    .into_iter()
                    .flat_map(|(ns, claim, label)| match label {
                        // A claim the operator made names its residency.
                        Some(name) => vec![ObjectRef::new(&name).within(&ns)],
                        // Someone else's: the residencies that name it.
                        None => naming_claim(&residencies, &ns, &claim),
                    })
                    .collect(),
                Err(e) => {
                    tracing::debug!(error = %e, "ResourceClaim watch");
                    Vec::new()
                }
            };
            futures::stream::iter(touched)
        });
    futures::stream::select(slice_events, claim_events).boxed()
}

/// Why claim mode cannot work, from the error of the first claim list.
fn claims_unserved(e: &kube::Error) -> String {
    match e {
        kube::Error::Api(s) if s.code == 404 => {
            "this cluster serves no resource.k8s.io/v1 ResourceClaims (Kubernetes 1.34 or later with DRA): set spec.gpu.mode to devicePlugin or env".to_owned()
        }
        kube::Error::Api(s) if s.code == 403 => format!(
            "the operator may not list resourceclaims.resource.k8s.io ({}): its ClusterRole needs the claim rules of the chart's (docs/gpu.md); restart it after",
            s.message
        ),
        e => format!("the operator could not list ResourceClaims at start ({e}); restart it"),
    }
}

/// The claim-mode residencies a ResourceSlice on `node` may concern:
/// those placed there, and those not placed yet (a device may have come).
fn near_slice(
    residencies: &reflector::Store<ModelResidency>,
    node: Option<&str>,
) -> Vec<ObjectRef<ModelResidency>> {
    residencies
        .state()
        .iter()
        .filter(|r| r.spec.gpu.mode == crate::api::GpuMode::Claim)
        .filter(|r| {
            let placed = crate::residency::gpu::node_of(r);
            placed.is_none() || node.is_none() || placed == node
        })
        .map(|r| ObjectRef::from_obj(&**r))
        .collect()
}

/// The residencies of namespace `ns` that name `claim` as their existing
/// claim.
fn naming_claim(
    residencies: &reflector::Store<ModelResidency>,
    ns: &str,
    claim: &str,
) -> Vec<ObjectRef<ModelResidency>> {
    residencies
        .state()
        .iter()
        .filter(|r| r.metadata.namespace.as_deref() == Some(ns))
        .filter(|r| r.spec.gpu.existing_claim.as_deref() == Some(claim))
        .map(|r| ObjectRef::from_obj(&**r))
        .collect()
}

/// Sets `synced` once the residency store and the pod cache hold their
/// first complete lists.
async fn mark_synced(
    store: reflector::Store<ModelResidency>,
    ctx: Arc<Context>,
    synced: Readiness,
) {
    // The store's readiness wakes only its latest waiter (the controller's
    // own), so poll again now and then instead of waiting.
    loop {
        let attempt =
            tokio::time::timeout(Duration::from_millis(200), store.wait_until_ready()).await;
        match attempt {
            Ok(Ok(())) => break,
            Ok(Err(_)) => return,
            Err(_) => {}
        }
    }
    ctx.pods.wait_ready().await;
    synced.set();
}

/// A task that ends with its owner, however the owner ends.
pub(crate) struct AbortOnDrop(pub(crate) tokio::task::JoinHandle<()>);

/// A supervised background task's future.
type Task = std::pin::Pin<Box<dyn std::future::Future<Output = ()> + Send>>;

impl Drop for AbortOnDrop {
    fn drop(&mut self) {
        self.0.abort();
    }
}

/// Starts a controller for one namespace in the background (tests,
/// benchmarks): its context, to read the metrics, and its task. Not in the
/// operator image's API (feature `local`).
#[cfg(feature = "local")]
pub fn spawn_for_namespace(
    client: kube::Client,
    namespace: &str,
) -> (Arc<Context>, tokio::task::JoinHandle<()>) {
    let ctx = Context::new(client);
    (ctx.clone(), spawn_with(ctx, namespace))
}

/// Starts a controller for one namespace with the given context.
pub fn spawn_with(ctx: Arc<Context>, namespace: &str) -> tokio::task::JoinHandle<()> {
    tokio::spawn(run(
        ctx,
        Some(namespace.to_owned()),
        std::future::pending(),
        Readiness::default(),
    ))
}

/// A term of leadership: dropping it (stepping down, or the whole task being
/// cancelled) aborts the controller at once, rather than draining it, and
/// clears the `leading` flag.
struct Term {
    controller: tokio::task::JoinHandle<()>,
    leading: Arc<std::sync::atomic::AtomicBool>,
}

impl Drop for Term {
    fn drop(&mut self) {
        self.controller.abort();
        self.leading.store(false, Ordering::SeqCst);
    }
}

/// Runs the controller only while this replica holds the lease, standing by
/// otherwise, until `stop` turns true. `leading` tells who leads right now.
pub async fn run_elected(
    ctx: Arc<Context>,
    namespace: Option<String>,
    elector: lease::LeaderElector,
    stop: tokio::sync::watch::Receiver<bool>,
    synced: Readiness,
    leading: Arc<std::sync::atomic::AtomicBool>,
) {
    let stopped = |mut rx: tokio::sync::watch::Receiver<bool>| async move {
        let _ = rx.wait_for(|s| *s).await;
    };
    let identity = elector.config().identity.clone();
    loop {
        tracing::info!(identity, "waiting for leadership");
        tokio::select! {
            _ = elector.acquire() => {}
            _ = stopped(stop.clone()) => return,
        }
        tracing::info!(identity, "leading");
        let (lead_tx, lead_rx) = tokio::sync::watch::channel(false);
        let mut term = Term {
            controller: tokio::spawn(run(
                ctx.clone(),
                namespace.clone(),
                stopped(lead_rx),
                synced.clone(),
            )),
            leading: leading.clone(),
        };
        leading.store(true, Ordering::SeqCst);
        let shutting_down = tokio::select! {
            _ = elector.hold() => false,
            _ = stopped(stop.clone()) => true,
            _ = &mut term.controller => false,
        };
        let _ = lead_tx.send(true);
        drop(term);
        if shutting_down {
            if let Err(e) = elector.release().await {
                tracing::warn!(error = %e, "could not release the lease");
            }
            return;
        }
        tracing::warn!(identity, "lost leadership; standing by");
    }
}
