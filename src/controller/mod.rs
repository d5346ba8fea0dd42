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
pub mod gpu;
pub mod pod_cache;
pub mod pod_calls;
pub mod pods;
pub mod relist;
pub mod templates;
pub mod written;

use crate::api::ModelResidency;
use crate::metrics::Metrics;
use crate::residency::gpu::{GpuView, assumed};
use crate::residency::labels::{MANAGER, MODEL_LABEL, fits_label_value};
use claims::GpuClaims;
use decide::{DEFAULT_MAX_SKEW, Decision, Observed, PodRef, decide};
use k8s_openapi::api::core::v1::{ObjectReference, Pod};
use k8s_openapi::jiff::Timestamp;
use kube::api::{Api, DeleteParams, PostParams, Preconditions};
use kube::runtime::controller::{self, Action};
use kube::runtime::events::{Event, EventType, Recorder, Reporter};
use kube::runtime::reflector::ObjectRef;
use kube::runtime::{reflector, watcher};
use kube::{Resource, ResourceExt};
use pod_cache::PodCache;
use std::sync::Arc;
use std::time::Duration;
use templates::{TemplateVerdicts, rejects_the_pod};
use written::WrittenStatuses;

/// Reconciles running at once.
pub(crate) const RECONCILE_CONCURRENCY: u16 = 8;

/// What failed, named by the step and the object it was about.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    #[error("creating pod {pod}: {}", describe(.source))]
    CreatePod { pod: String, source: kube::Error },
    #[error("deleting pod {pod}: {}", describe(.source))]
    DeletePod { pod: String, source: kube::Error },
    #[error("writing the status: {}", describe(.source))]
    PatchStatus { source: kube::Error },
    #[error("making or deleting ResourceClaim {claim}: {}", describe(.source))]
    Claim { claim: String, source: kube::Error },
    #[error("making or deleting GPU holder pod {pod}: {}", describe(.source))]
    HolderPod { pod: String, source: kube::Error },
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
            | Error::Claim { source, .. }
            | Error::HolderPod { source, .. }
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
            Error::Claim { .. } => "resource_claim",
            Error::HolderPod { .. } => "gpu_holder",
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
    /// How the residency and pod watches list.
    pub initial_list: crate::cluster::InitialList,
    /// The ResourceClaims and published devices (claim mode).
    pub gpus: gpu::inventory::GpuInventory,
    /// The image of the GPU holder pods (claim mode).
    pub gpu_holder_image: String,
    /// The residencies whose sleeps and wakes are being asked.
    pub asking: Arc<pod_calls::Asking>,
    /// The longest one sleep, wake or status request may take, whatever
    /// its spec says (`--pod-call-timeout-max`).
    pub pod_call_timeout_max: Duration,
}

impl Context {
    pub fn new(client: kube::Client) -> Arc<Self> {
        Self::with_options(
            client,
            Arc::default(),
            DEFAULT_MAX_SKEW,
            Default::default(),
            gpu::objects::DEFAULT_HOLDER_IMAGE.into(),
        )
    }

    pub fn with_options(
        client: kube::Client,
        metrics: Arc<Metrics>,
        max_skew: Duration,
        initial_list: crate::cluster::InitialList,
        gpu_holder_image: String,
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
            initial_list,
            gpus: Default::default(),
            gpu_holder_image,
            asking: Arc::default(),
            pod_call_timeout_max: pod_calls::DEFAULT_CALL_TIMEOUT_MAX,
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

/// Deletes `pods` of `residency` (each only while it has its UID); one
/// already gone, or replaced by another pod of that name, is done too.
async fn delete_pods(
    api: &Api<Pod>,
    (ns, residency): (&str, &str),
    pods: &[PodRef],
    ctx: &Context,
) -> Result<()> {
    for pod in pods {
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
    Ok(())
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
    delete_pods(api, (ns, residency), &d.delete, ctx).await?;
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
/// object already has. Yields whether the spec had moved on past the one
/// decided on by the time of the write (the object the write returned has
/// a newer generation): that change is then reconciled soon even if its
/// watch event is lost (one that arrived while the watch re-listed after
/// an API server restart was, once: status stuck a generation behind).
async fn write_status(
    api: &Api<ModelResidency>,
    r: &ModelResidency,
    d: &Decision,
    ctx: &Context,
) -> Result<bool> {
    if r.status.as_ref() == Some(&d.status) {
        return Ok(false);
    }
    let result = crate::cluster::apply_status(api, &r.name_any(), MANAGER, &d.status).await;
    ctx.metrics.api_request("patch", "modelresidencies/status");
    // The next reconcile may start before the watch delivers this write
    // (at once, on the fast lane): it reads this copy instead of deciding
    // again from the older status and announcing the same transitions.
    let written = result.map_err(|source| Error::PatchStatus { source })?;
    let moved_on = written
        .metadata
        .generation
        .is_some_and(|g| d.status.observed_generation.is_some_and(|o| g > o));
    ctx.written.record(written);
    Ok(moved_on)
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

/// How a reconcile ended.
enum Enacted {
    /// Done; whether to look again soon (a pod name still taken by a
    /// terminating pod, a spec that moved on).
    Done(bool),
    /// Its pod calls, status and events go on in a task of their own
    /// ([`pod_calls::Asking`]), which reconciles it again when it ends.
    Asking,
}

/// Carries out a decision: pods, then the sleeps and wakes, then status,
/// then events. The status is written whatever the pod creates answered.
/// With sleeps or wakes to ask, all but the pods is handed to a task of
/// its own: a pod may take minutes to answer, and no other residency may
/// wait for it.
async fn enact(
    r: &Arc<ModelResidency>,
    ns: &str,
    mut d: Decision,
    ctx: &Arc<Context>,
) -> Result<Enacted> {
    let name = r.name_any();
    let pods: Api<Pod> = Api::namespaced(ctx.client.clone(), ns);
    let outcome = enact_pods(&pods, (ns, &name), &d, ctx).await?;
    for (model, message) in &outcome.rejected {
        d.pod_rejected(model, message);
        let template = r.spec.models.iter().find(|m| &m.name == model);
        if let Some(t) = template.and_then(|m| m.template.as_ref()) {
            ctx.templates
                .rejected_create(ns, &name, t.json(), message.clone());
        }
    }
    if d.calls.is_empty() {
        return conclude(r, ns, &mut d, outcome, ctx)
            .await
            .map(Enacted::Done);
    }
    let (r, ns, task_ctx) = (r.clone(), ns.to_owned(), ctx.clone());
    ctx.asking.spawn(ObjectRef::from_obj(&*r), async move {
        let ctx = task_ctx;
        let result = async {
            sleep_and_wake(&pods, &ns, &name, &mut d, &ctx).await?;
            conclude(&r, &ns, &mut d, outcome, &ctx).await
        };
        if let Err(e) = result.await {
            report_failure(&r, &e, &ctx);
        }
    });
    Ok(Enacted::Asking)
}

/// The rest of a decision once its pods are done: status, metrics, events.
/// Yields whether to look again soon.
async fn conclude(
    r: &ModelResidency,
    ns: &str,
    d: &mut Decision,
    outcome: PodOutcome,
    ctx: &Context,
) -> Result<bool> {
    let residencies: Api<ModelResidency> = Api::namespaced(ctx.client.clone(), ns);
    let spec_moved_on = write_status(&residencies, r, d, ctx).await?;
    if let Some(usage) = &d.usage {
        ctx.metrics
            .observe(ns, &r.name_any(), usage, d.status.counters);
    }
    for seconds in &d.load_seconds {
        ctx.metrics.model_loaded(*seconds);
    }
    publish(d, r, ctx).await;
    match outcome.failed {
        Some(e) => Err(e),
        None => Ok(outcome.retry_soon || spec_moved_on),
    }
}

/// Asks the decided sleeps and wakes of their pods, together, and records
/// what each came to; a pod whose sleep or wake failed is deleted.
async fn sleep_and_wake(
    api: &Api<Pod>,
    ns: &str,
    residency: &str,
    d: &mut Decision,
    ctx: &Context,
) -> Result<()> {
    if d.calls.is_empty() {
        return Ok(());
    }
    let calls = std::mem::take(&mut d.calls);
    let limit = ctx.pod_call_timeout_max;
    let results = futures::future::join_all(calls.iter().map(|c| pod_calls::ask(c, limit))).await;
    let now = Timestamp::now();
    let mut failed = Vec::new();
    for (call, (result, seconds)) in calls.iter().zip(results) {
        if result.is_ok() {
            ctx.metrics.model_woke_or_slept(call.wake, seconds);
        }
        failed.extend(d.call_done(call, result, seconds, now));
    }
    delete_pods(api, (ns, residency), &failed, ctx).await
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
    // Its sleeps and wakes are still being asked: the task that asks them
    // decides nothing more and reconciles it again when it ends.
    if ctx.asking.busy(&ObjectRef::from_obj(&*r)) {
        return Ok(Action::await_change());
    }
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
    // No claim or holder pod for a residency that cannot own pods.
    let found = if fits_label_value(&name) {
        gpu::find(&r, &owner, &ctx).await?
    } else {
        gpu::Found {
            view: GpuView::Placed(assumed(&r)),
            recheck: None,
        }
    };
    let placement = match &found.view {
        GpuView::Placed(p) => p.clone(),
        GpuView::Withheld(_) => assumed(&r),
    };
    let rejections = if fits_label_value(&name) {
        let pods: Api<Pod> = Api::namespaced(ctx.client.clone(), &ns);
        ctx.templates
            .rejected(&pods, &r, &owner, &placement, &ctx.metrics)
            .await
    } else {
        Default::default()
    };
    let gpu_holder = ctx.claims.holder_other_than(&r);
    let node_cache = ctx.node_caches.get(&placement.node);
    let decision = decide(&Observed {
        residency: &r,
        owner,
        pods: &owned,
        now: Timestamp::now(),
        max_skew: ctx.max_skew,
        gpu_holder: gpu_holder.as_deref(),
        gpu: found.view,
        rejected_templates: &rejections.by_model,
        artifacts: node_cache.as_deref(),
    });
    let decided_requeue = decision.requeue_after;
    let retry_soon = match enact(&r, &ns, decision, &ctx).await? {
        Enacted::Done(retry_soon) => retry_soon,
        Enacted::Asking => return Ok(Action::await_change()),
    };
    // A rejected template is asked again when its backoff ends (the
    // quota or webhook that rejected it may have changed meanwhile).
    let requeue_after = [decided_requeue, rejections.recheck_in, found.recheck]
        .into_iter()
        .flatten()
        .min();
    Ok(match (retry_soon, requeue_after) {
        (true, _) => Action::requeue(Duration::from_millis(500)),
        (false, Some(after)) => Action::requeue(after),
        // Everything else arrives by watch (a watch that restarts lists
        // again, which reconciles every residency). No periodic requeue: it
        // would keep a scheduler entry per residency (memory at 10,000
        // residencies, docs/performance.md) only to find nothing to do.
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
pub(crate) async fn reconcile_in_turn(
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
pub(crate) fn log_controller_error(e: &controller::Error<Error, watcher::Error>) {
    match e {
        controller::Error::ReconcilerFailed(..) => {}
        // The object was deleted before its reconcile ran.
        controller::Error::ObjectNotFound(obj) => {
            tracing::debug!(object = %obj, "reconcile of a deleted object skipped");
        }
        e => tracing::warn!(error = %e, "controller"),
    }
}

#[cfg(test)]
#[path = "enact_tests.rs"]
mod enact_tests;
