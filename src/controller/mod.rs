//! The reconciler, one step per module: the pods it owns come from the pod
//! cache ([`pod_cache`]); [`state`] validates the spec and restores the
//! engine from status; [`decide`](mod@decide) (pure) says what to do; this module does
//! it: delete, then create pods, write the status (only when it changed),
//! publish the events ([`events`]), and count every API request in the
//! metrics.

pub mod artifacts;
pub mod cached;
pub mod claims;
pub mod decide;
pub mod events;
pub mod fast_lane;
pub mod pod_cache;
pub mod pods;
pub mod relist;
pub mod templates;
pub mod written;

use crate::api::ModelResidency;
use crate::metrics::Metrics;
use crate::residency::labels::{MANAGER, MODEL_LABEL, RESIDENCY_LABEL, fits_label_value};
use claims::GpuClaims;
use decide::{DEFAULT_MAX_SKEW, Decision, Observed, decide};
use futures::{StreamExt, TryStreamExt};
use k8s_openapi::api::core::v1::{ObjectReference, Pod};
use k8s_openapi::jiff::Timestamp;
use kube::api::{Api, DeleteParams, Patch, PatchParams, PostParams, Preconditions};
use kube::runtime::controller::{self, Action, Controller};
use kube::runtime::events::{Event, EventType, Recorder, Reporter};
use kube::runtime::reflector::ObjectRef;
use kube::runtime::{WatchStreamExt, reflector, watcher};
use kube::{Resource, ResourceExt};
use pod_cache::PodCache;
use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::Duration;
use templates::{TemplateVerdicts, rejects_the_pod};
use written::WrittenStatuses;

/// Reconciles running at once.
const RECONCILE_CONCURRENCY: u16 = 8;

/// What failed, named by the step and the object it was about.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    #[error("creating pod {pod}: {}", describe(.source))]
    CreatePod { pod: String, source: kube::Error },
    #[error("deleting pod {pod}: {}", describe(.source))]
    DeletePod { pod: String, source: kube::Error },
    #[error("writing the status: {}", describe(.source))]
    PatchStatus { source: kube::Error },
    #[error("the object has no {0}")]
    Incomplete(&'static str),
    /// A bug: the reconcile panicked. Only this residency's reconcile
    /// fails (retried after a minute); the controller goes on.
    #[error("the reconcile panicked: {0}")]
    Panicked(String),
}

/// An API error as one line: the API server's code, reason and message
/// (kube's own text for it includes a debug dump of the whole response).
fn describe(e: &kube::Error) -> String {
    match e {
        kube::Error::Api(s) => format!("{} {}: {}", s.code, s.reason, s.message),
        e => e.to_string(),
    }
}

impl Error {
    /// The API error underneath, if any.
    fn api_code(&self) -> Option<u16> {
        match self {
            Error::CreatePod { source, .. }
            | Error::DeletePod { source, .. }
            | Error::PatchStatus { source } => match source {
                kube::Error::Api(s) => Some(s.code),
                _ => None,
            },
            Error::Incomplete(_) | Error::Panicked(_) => None,
        }
    }

    /// A short label for metrics and logs.
    pub fn metric_label(&self) -> &'static str {
        if self.api_code() == Some(409) {
            return "conflict";
        }
        match self {
            Error::CreatePod { .. } => "create_pod",
            Error::DeletePod { .. } => "delete_pod",
            Error::PatchStatus { .. } => "patch_status",
            Error::Incomplete(_) => "incomplete",
            Error::Panicked(_) => "panic",
        }
    }
}

pub type Result<T, E = Error> = std::result::Result<T, E>;

pub struct Context {
    pub client: kube::Client,
    /// Who the operator's events say reported them.
    pub reporter: Reporter,
    /// Every API request the reconciler makes is counted here.
    pub metrics: Arc<Metrics>,
    /// Filled by [`run`]'s pod watch; reset when a run starts.
    pub pods: PodCache,
    /// Who holds each GPU; filled by [`run`]'s residency watch.
    pub claims: GpuClaims,
    /// Which pod templates the API server accepts.
    pub templates: TemplateVerdicts,
    /// Status writes the residency cache may not show yet.
    pub written: WrittenStatuses,
    /// How far ahead of this clock a request's time may be.
    pub max_skew: Duration,
    /// The nodes' artifact caches, as their agents report them.
    pub node_caches: artifacts::NodeCaches,
    /// Which residencies are being reconciled, by the controller or the
    /// fast lane.
    pub turns: Arc<fast_lane::Turns>,
    /// The fast lane takes events while fewer reconciles than this run (0
    /// turns it off).
    pub fast_lane_slots: usize,
}

impl Context {
    pub fn new(client: kube::Client) -> Arc<Self> {
        Self::with_options(client, Arc::default(), DEFAULT_MAX_SKEW)
    }

    pub fn with_options(
        client: kube::Client,
        metrics: Arc<Metrics>,
        max_skew: Duration,
    ) -> Arc<Self> {
        let reporter = Reporter {
            controller: MANAGER.into(),
            instance: std::env::var("POD_NAME").ok(),
        };
        Arc::new(Context {
            client,
            reporter,
            metrics,
            pods: PodCache::default(),
            claims: GpuClaims::default(),
            templates: TemplateVerdicts::default(),
            written: WrittenStatuses::default(),
            max_skew,
            node_caches: Default::default(),
            turns: Arc::default(),
            fast_lane_slots: fast_lane::FAST_LANE_SLOTS,
        })
    }
}

/// What [`enact_pods`] met besides success.
#[derive(Debug, Default)]
struct PodOutcome {
    /// A create met a pod of that name still terminating: look again soon.
    retry_soon: bool,
    /// Models whose pod create the API server rejected, with its message.
    rejected: Vec<(String, String)>,
    /// A create that failed otherwise (the API server unavailable, say):
    /// the status is still written, then the reconcile fails and retries.
    failed: Option<Error>,
}

/// Deletes first (they free VRAM), then creates what fits. `ns` and
/// `residency` name the residency whose pods these are. A create the API
/// server rejects is reported back (the status must say so), not an error.
async fn enact_pods(
    api: &Api<Pod>,
    (ns, residency): (&str, &str),
    d: &Decision,
    ctx: &Context,
) -> Result<PodOutcome> {
    for pod in &d.delete {
        let dp = DeleteParams {
            preconditions: Some(Preconditions {
                uid: Some(pod.uid.clone()),
                resource_version: None,
            }),
            ..DeleteParams::default()
        };
        let result = api.delete(&pod.name, &dp).await;
        ctx.metrics.api_request("delete", "pods");
        match result {
            Ok(_) => ctx.pods.deleting(ns, residency, &pod.name),
            // Already gone, or replaced by another pod of that name.
            Err(kube::Error::Api(s)) if s.code == 404 || s.code == 409 => {}
            Err(source) => {
                let pod = pod.name.clone();
                return Err(Error::DeletePod { pod, source });
            }
        }
    }
    let mut outcome = PodOutcome::default();
    for pod in &d.create {
        let result = api.create(&PostParams::default(), pod).await;
        ctx.metrics.api_request("create", "pods");
        match result {
            Ok(created) => ctx.pods.created(&created),
            // The previous pod of that name is still terminating.
            Err(kube::Error::Api(s)) if s.code == 409 => outcome.retry_soon = true,
            Err(source) => match rejects_the_pod(&source) {
                Some(message) => {
                    let labels = pod.metadata.labels.as_ref();
                    let model = labels.and_then(|l| l.get(MODEL_LABEL)).cloned();
                    outcome.rejected.push((model.unwrap_or_default(), message));
                }
                None => {
                    let pod = pod.metadata.name.clone().unwrap_or_default();
                    outcome.failed = Some(Error::CreatePod { pod, source });
                    break;
                }
            },
        }
    }
    Ok(outcome)
}

/// Writes the decided status with server-side apply, unless it is what the
/// object already has.
async fn write_status(
    api: &Api<ModelResidency>,
    r: &ModelResidency,
    d: &Decision,
    ctx: &Context,
) -> Result<()> {
    if r.status.as_ref() == Some(&d.status) {
        return Ok(());
    }
    let body = serde_json::json!({
        "apiVersion": "residency.dev/v1alpha1",
        "kind": "ModelResidency",
        "status": d.status,
    });
    let pp = PatchParams::apply(MANAGER).force();
    let result = api
        .patch_status(&r.name_any(), &pp, &Patch::Apply(&body))
        .await;
    ctx.metrics.api_request("patch", "modelresidencies/status");
    // The next reconcile may start before the watch delivers this write
    // (at once, on the fast lane): it reads this copy instead of deciding
    // again from the older status and announcing the same transitions.
    let written = result.map_err(|source| Error::PatchStatus { source })?;
    ctx.written.record(written);
    Ok(())
}

/// Publishes the decision's events (after the status, so an event never
/// announces a state the object does not show yet).
async fn publish(d: &Decision, r: &ModelResidency, ctx: &Context) {
    if d.events.is_empty() {
        return;
    }
    // A recorder per event, not one for the process: kube's recorder keeps
    // every event it published for six minutes and turns a repeat (same
    // reason, object and related pod, whatever the message) into a patch of
    // a series, which at thousands of residencies is megabytes and a scan
    // per event, and would fold two evictions of one model in one reconcile
    // (a storm's batch) into one event object: each counted operation must
    // be its own event, and every publish one create.
    let reference = r.object_ref(&());
    for e in &d.events {
        let recorder = Recorder::new(ctx.client.clone(), ctx.reporter.clone());
        let secondary = e.model.as_ref().map(|m| ObjectReference {
            api_version: Some("v1".into()),
            kind: Some("Pod".into()),
            name: Some(pods::pod_name(&r.name_any(), m)),
            namespace: r.namespace(),
            ..ObjectReference::default()
        });
        let ev = Event {
            type_: if e.reason.is_warning() {
                EventType::Warning
            } else {
                EventType::Normal
            },
            reason: e.reason.as_str().into(),
            note: Some(e.message.clone()),
            action: e.reason.action().into(),
            secondary,
        };
        let result = recorder.publish(&ev, &reference).await;
        ctx.metrics.api_request("create", "events");
        if let Err(e) = result {
            ctx.metrics.reconcile_error("publish_event");
            tracing::warn!(error = %describe(&e), "could not publish an event");
        }
    }
}

/// Carries out a decision: pods, then status, then events. Returns whether
/// to look again soon (a pod name still taken by a terminating pod). The
/// status is written whatever the pod creates answered.
async fn enact(r: &ModelResidency, ns: &str, d: &mut Decision, ctx: &Context) -> Result<bool> {
    let name = r.name_any();
    let pods: Api<Pod> = Api::namespaced(ctx.client.clone(), ns);
    let residencies: Api<ModelResidency> = Api::namespaced(ctx.client.clone(), ns);
    let outcome = enact_pods(&pods, (ns, &name), d, ctx).await?;
    for (model, message) in &outcome.rejected {
        d.pod_rejected(model, message);
        let template = r.spec.models.iter().find(|m| &m.name == model);
        if let Some(t) = template.and_then(|m| m.template.as_ref()) {
            ctx.templates
                .rejected_create(ns, &name, t.json(), message.clone());
        }
    }
    write_status(&residencies, r, d, ctx).await?;
    if let Some(usage) = &d.usage {
        ctx.metrics.observe(ns, &name, usage, d.status.counters);
    }
    for seconds in &d.load_seconds {
        ctx.metrics.model_loaded(*seconds);
    }
    publish(d, r, ctx).await;
    match outcome.failed {
        Some(e) => Err(e),
        None => Ok(outcome.retry_soon),
    }
}

/// Reconciles one residency; a panic in it is this residency's failed
/// reconcile ([`crate::panic_guard`]).
pub async fn reconcile(r: Arc<ModelResidency>, ctx: Arc<Context>) -> Result<Action> {
    crate::panic_guard::guarded(reconcile_unguarded(r, ctx), Error::Panicked).await
}

#[tracing::instrument(skip(r, ctx), fields(namespace = r.namespace().unwrap_or_default(), residency = %r.name_any()))]
async fn reconcile_unguarded(r: Arc<ModelResidency>, ctx: Arc<Context>) -> Result<Action> {
    ctx.metrics.reconciled();
    let _timer = ctx.metrics.reconcile_timer();
    let r = ctx.written.fresher(r);
    let ns = r.namespace().ok_or(Error::Incomplete("namespace"))?;
    let name = r.name_any();
    // A name that cannot be a label value cannot select pods either; decide
    // reports it as InvalidSpec and touches no pods.
    let owned = if fits_label_value(&name) {
        let uid = r.metadata.uid.as_deref().ok_or(Error::Incomplete("uid"))?;
        // Never decide on a partial view of the pods.
        ctx.pods.wait_ready().await;
        ctx.pods.owned(&ns, &name, uid)
    } else {
        Vec::new()
    };
    let owner = r
        .controller_owner_ref(&())
        .ok_or(Error::Incomplete("uid"))?;
    let rejections = if fits_label_value(&name) {
        let pods: Api<Pod> = Api::namespaced(ctx.client.clone(), &ns);
        ctx.templates
            .rejected(&pods, &r, &owner, &ctx.metrics)
            .await
    } else {
        Default::default()
    };
    let gpu_holder = ctx.claims.holder_other_than(&r);
    let node_cache = ctx.node_caches.get(&r.spec.node_name);
    let mut decision = decide(&Observed {
        residency: &r,
        owner,
        pods: &owned,
        now: Timestamp::now(),
        max_skew: ctx.max_skew,
        gpu_holder: gpu_holder.as_deref(),
        rejected_templates: &rejections.by_model,
        artifacts: node_cache.as_deref(),
    });
    let retry_soon = enact(&r, &ns, &mut decision, &ctx).await?;
    // A rejected template is asked again when its backoff ends (the
    // quota or webhook that rejected it may have changed meanwhile).
    let requeue_after = [decision.requeue_after, rejections.recheck_in]
        .into_iter()
        .flatten()
        .min();
    Ok(match (retry_soon, requeue_after) {
        (true, _) => Action::requeue(Duration::from_millis(500)),
        (false, Some(after)) => Action::requeue(after),
        // Everything else arrives by watch (a watch that restarts lists
        // again, which reconciles every residency). No periodic requeue: it
        // kept a scheduler entry per residency (with the last-applied strip,
        // 6 MiB of RSS at 10,000 residencies) only to find nothing to do.
        (false, None) => Action::await_change(),
    })
}

/// Transient errors retry with a short backoff; conflicts at once. The one
/// log line of a failed reconcile is written here.
pub fn error_policy(r: Arc<ModelResidency>, error: &Error, ctx: Arc<Context>) -> Action {
    report_failure(&r, error, &ctx);
    Action::requeue(error_delay(error))
}

/// The log line and the metric of a failed reconcile.
fn report_failure(r: &ModelResidency, error: &Error, ctx: &Context) {
    tracing::warn!(
        namespace = r.namespace().unwrap_or_default(),
        residency = %r.name_any(),
        step = error.metric_label(),
        "reconcile failed: {error}"
    );
    ctx.metrics.reconcile_error(error.metric_label());
}

/// How long to wait before trying a failed reconcile again.
fn error_delay(error: &Error) -> Duration {
    match (error, error.api_code()) {
        (_, Some(409)) => Duration::from_millis(200),
        // It will most likely panic again.
        (Error::Panicked(_), _) => Duration::from_secs(60),
        _ => Duration::from_secs(2),
    }
}

/// The controller's reconcile: once the residency's turn is free (the fast
/// lane may hold it), on the store's copy as it is then.
async fn reconcile_in_turn(
    r: Arc<ModelResidency>,
    ctx: Arc<Context>,
    store: reflector::Store<ModelResidency>,
) -> Result<Action> {
    let key = ObjectRef::from_obj(&*r);
    let _turn = ctx.turns.take(&key).await;
    match store.get(&key) {
        Some(latest) => reconcile(latest, ctx).await,
        // Deleted while it waited.
        None => Ok(Action::await_change()),
    }
}

/// Logs what the controller's stream reports, except failed reconciles,
/// which [`error_policy`] has logged already.
fn log_controller_error(e: &controller::Error<Error, watcher::Error>) {
    match e {
        controller::Error::ReconcilerFailed(..) => {}
        // The object was deleted before its reconcile ran.
        controller::Error::ObjectNotFound(obj) => {
            tracing::debug!(object = %obj, "reconcile of a deleted object skipped");
        }
        e => tracing::warn!(error = %e, "controller"),
    }
}

/// Runs the controller for `namespace` (all namespaces when `None`) until
/// `shutdown` completes. `synced` is set once the first watch list is in.
pub async fn run(
    ctx: Arc<Context>,
    namespace: Option<String>,
    shutdown: impl std::future::Future<Output = ()> + Send + Sync + 'static,
    synced: Arc<std::sync::atomic::AtomicBool>,
) {
    let shutdown = futures::FutureExt::shared(shutdown);
    let client = ctx.client.clone();
    let (residencies, pods): (Api<ModelResidency>, Api<Pod>) = match namespace.as_deref() {
        Some(ns) => (
            Api::namespaced(client.clone(), ns),
            Api::namespaced(client, ns),
        ),
        None => (Api::all(client.clone()), Api::all(client)),
    };
    // The cache of residencies keeps what `cached::compact` leaves.
    let (store, writer) = reflector::store();
    let (claim_tx, claim_rx) = futures::channel::mpsc::unbounded();
    let (changed_tx, changed_rx) = futures::channel::mpsc::unbounded();
    let (handed_back_tx, handed_back_rx) = futures::channel::mpsc::unbounded();
    let lane = Arc::new(fast_lane::FastLane::new(ctx.clone(), handed_back_tx));
    let offered = lane.clone();
    let model_demands = start_model_demands(
        &ctx,
        namespace.as_deref(),
        shutdown.clone(),
        store.clone(),
        changed_rx,
    )
    .await;
    let residency_events = watcher(residencies, watcher::Config::default())
        .default_backoff()
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
                }
                if let Some(present) = relist.record(event) {
                    ctx.metrics.keep_only(&present);
                    ctx.written.keep_only(&present);
                }
                for other in ctx.claims.record(event) {
                    let _ = claim_tx.unbounded_send(other);
                }
            }
        })
        .reflect(writer)
        .inspect_ok(move |event| {
            // After the cache has it: the ModelDemands naming this
            // residency read it there.
            if model_demands.is_some()
                && let watcher::Event::Apply(r)
                | watcher::Event::InitApply(r)
                | watcher::Event::Delete(r) = event
            {
                let _ = changed_tx.unbounded_send(ObjectRef::from_obj(r));
            }
        })
        // A residency's own change is reconciled at once when the fast
        // lane can take it; the rest go through the controller's queue.
        // Only live changes: during a list (a watch that restarts) the
        // cache keeps the previous copies until the whole list is in, so a
        // reconcile started at once would act on an old copy and swallow
        // the event (seen in the API-server-restart fault test); list
        // events keep going through the controller's queue as before.
        .try_filter_map(move |event| {
            futures::future::ready(Ok(match event {
                watcher::Event::Apply(r) => offered.offer(r).map(watcher::Event::Apply),
                other => Some(other),
            }))
        })
        .touched_objects();
    // At most this many reconciles at once: each holds an API connection
    // (TLS and HTTP buffers, pooled afterwards), so an unbounded burst at
    // start-up over thousands of residencies costs memory and floods the
    // API server for no gain.
    let controller = Controller::for_stream(residency_events, store.clone()).with_config(
        kube::runtime::controller::Config::default().concurrency(RECONCILE_CONCURRENCY),
    );
    // Model pods: one watch by label feeds the pod cache, and wakes the
    // residency each event concerns (after the cache has it).
    ctx.pods.reset();
    let cache = ctx.clone();
    let pod_events = watcher(pods, watcher::Config::default().labels(RESIDENCY_LABEL))
        .default_backoff()
        .flat_map(move |event| {
            let touched = match event {
                Ok(ev) => cache.pods.record(&ev),
                Err(e) => {
                    tracing::debug!(error = %e, "pod watch");
                    Vec::new()
                }
            };
            futures::stream::iter(touched)
        });
    let cache_events = node_cache_events(ctx.clone(), store.clone()).await;
    let sync = tokio::spawn(mark_synced(store.clone(), ctx.clone(), synced));
    controller
        .reconcile_on(futures::stream::select(
            futures::stream::select(pod_events, claim_rx),
            futures::stream::select(cache_events, handed_back_rx),
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
    sync.abort();
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
    if !crate::model_demand::installed(&ctx.client, namespace).await {
        return None;
    }
    let task = crate::model_demand::run(
        ctx.client.clone(),
        ctx.metrics.clone(),
        namespace.map(str::to_owned),
        shutdown,
        residencies,
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
        .default_backoff()
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
                .filter(|r| nodes.contains(&r.spec.node_name))
                .map(|r| ObjectRef::from_obj(&**r))
                .collect();
            futures::stream::iter(touched)
        })
        .boxed()
}

/// Sets `synced` once the residency store and the pod cache hold their
/// first complete lists.
async fn mark_synced(
    store: reflector::Store<ModelResidency>,
    ctx: Arc<Context>,
    synced: Arc<std::sync::atomic::AtomicBool>,
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
    synced.store(true, Ordering::Relaxed);
}

/// A task that ends with its owner, however the owner ends.
struct AbortOnDrop(tokio::task::JoinHandle<()>);

impl Drop for AbortOnDrop {
    fn drop(&mut self) {
        self.0.abort();
    }
}

/// Starts a controller for one namespace in the background (tests,
/// benchmarks): its context, to read the metrics, and its task.
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
        Arc::default(),
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
    elector: crate::lease::LeaderElector,
    stop: tokio::sync::watch::Receiver<bool>,
    synced: Arc<std::sync::atomic::AtomicBool>,
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

#[cfg(test)]
#[path = "enact_tests.rs"]
mod enact_tests;
