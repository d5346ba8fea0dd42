//! The reconciler, one step per module: the pods it owns come from the pod
//! cache ([`pod_cache`]); `residency::state` validates the spec and
//! restores the engine from status; [`decide`](mod@decide) (pure) says what
//! to do; `enact` does it (delete, then create pods, write the status only
//! when it changed, publish the events ([`events`]), count every API
//! request in the metrics). This module wires them: the context a
//! reconcile reads, the reconcile itself and its error policy.

pub mod adapter_audit;
pub mod artifacts;
pub mod cached;
pub mod claims;
pub mod copies;
pub mod decide;
mod enact;
pub mod evacuate;
pub mod events;
pub mod fast_lane;
pub mod forecasts;
pub mod gpu;
pub mod guarded;
pub mod model_names;
pub mod pod_cache;
pub mod pod_calls;
pub mod pods;
pub mod relist;
pub mod sleep_audit;
pub mod templates;
pub mod written;

use crate::api::ModelResidency;
use crate::metrics::Metrics;
use crate::residency::gpu::{GpuView, assumed};
use crate::residency::labels::{MANAGER, fits_label_value};
use claims::GpuClaims;
use decide::{DEFAULT_MAX_SKEW, Observed, decide};
use enact::{Enacted, enact};
use k8s_openapi::api::core::v1::Pod;
use k8s_openapi::jiff::Timestamp;
use kube::api::Api;
use kube::runtime::controller::{self, Action};
use kube::runtime::events::Reporter;
use kube::runtime::reflector::ObjectRef;
use kube::runtime::{reflector, watcher};
use kube::{Resource, ResourceExt};
use pod_cache::PodCache;
use std::sync::Arc;
use std::time::Duration;
use templates::TemplateVerdicts;
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
    /// Which namespace each model name belongs to (`NameShadowed`).
    pub names: model_names::ModelNames,
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
    /// Copies of models under load: where the routers are (off when
    /// none is named) and the policy's defaults.
    pub copies: copies::CopiesConfig,
    /// How often Loaded models that can sleep are asked whether they do
    /// (`--sleep-audit-interval`; zero: never).
    pub sleep_audit: Duration,
    /// The ModelCatalogs residencies name; filled by [`run`]'s catalog
    /// watch (crate::operator).
    pub catalogs: Arc<crate::residency::catalog::Catalogs>,
    /// The models' forecasts of residencies with spec.anticipate on.
    pub forecasts: forecasts::ForecastStore,
}

/// Publishes one event on `r` outside a reconcile (the copy scaler's, the
/// sleep audit's); one the API server does not take is logged.
pub(crate) async fn publish_event(
    ctx: &Context,
    r: &ModelResidency,
    type_: kube::runtime::events::EventType,
    reason: &str,
    action: &str,
    note: String,
) {
    use kube::Resource;
    use kube::runtime::events::{Event, Recorder};
    let recorder = Recorder::new(ctx.client.clone(), ctx.reporter.clone());
    let ev = Event {
        type_,
        reason: reason.into(),
        note: Some(note),
        action: action.into(),
        secondary: None,
    };
    ctx.metrics.api_request("create", "events");
    if let Err(e) = recorder.publish(&ev, &r.object_ref(&())).await {
        tracing::warn!(%reason, error = %e, "could not publish an event");
    }
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

    /// [`Self::new`] whose GPU holder pods run `image` (a local cluster's
    /// own pause image on a real node). Tests only (feature `local`).
    #[cfg(feature = "local")]
    pub fn with_holder_image(client: kube::Client, image: &str) -> Arc<Self> {
        Self::with_options(
            client,
            Arc::default(),
            DEFAULT_MAX_SKEW,
            Default::default(),
            image.into(),
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
            names: Default::default(),
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
            copies: Default::default(),
            sleep_audit: sleep_audit::DEFAULT_INTERVAL,
            catalogs: Default::default(),
            forecasts: Default::default(),
        })
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
    let r = cached::unpacked(ctx.written.fresher(r));
    // Its sleeps and wakes are still being asked: the task that asks them
    // decides nothing more and reconciles it again when it ends.
    if ctx.asking.busy(&ObjectRef::from_obj(&*r)) {
        return Ok(Action::await_change());
    }
    let ns = r.namespace().ok_or(Error::Incomplete("namespace"))?;
    // Its registry with the catalog it names; one that cannot be read
    // changes nothing but Ready (a deleted catalog evicts nothing).
    if r.spec.catalog.is_some() {
        ctx.catalogs.wait_ready().await;
    }
    let r = match ctx.catalogs.resolve(r.clone()) {
        Ok(resolved) => resolved,
        Err(problem) => {
            let decision = decide::catalog_unavailable(&r, &problem, Timestamp::now());
            return match enact(&r, &ns, decision, &ctx).await? {
                Enacted::Done(true) => Ok(Action::requeue(Duration::from_millis(500))),
                _ => Ok(Action::await_change()),
            };
        }
    };
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
    // Where it would use a GPU now (one withheld from it uses none).
    let at = match &found.view {
        GpuView::Placed(p) => claims::allocated(&p.status),
        GpuView::Withheld(_) => None,
    };
    let holder = ctx.claims.holder_other_than(
        &r,
        at,
        |node| ctx.gpus.node_devices(node),
        |ns, name| ctx.pods.has_pods(ns, name),
    );
    // A deleted holder's pods give no event to this residency when they go.
    let holder_leaving = holder
        .as_ref()
        .filter(|h| h.leaving)
        .map(|_| Duration::from_secs(1));
    let gpu_holder = holder.map(|h| match h.leaving {
        true => format!("{} (deleted; its pods are still terminating)", h.name),
        false => h.name,
    });
    let node_cache = ctx.node_caches.get(&placement.node);
    let health = match &found.view {
        GpuView::Placed(p) => ctx.gpus.health(&p.node, &r.spec.device),
        GpuView::Withheld(_) => Default::default(),
    };
    let now = Timestamp::now();
    let mut forecasts = ctx
        .forecasts
        .learn(&ctx.client, &ctx.metrics, &r, now)
        .await;
    let decision = decide(&Observed {
        residency: &r,
        owner,
        pods: &owned,
        now,
        max_skew: ctx.max_skew,
        gpu_holder: gpu_holder.as_deref(),
        gpu: found.view,
        rejected_templates: &rejections.by_model,
        artifacts: node_cache.as_deref(),
        shadowing: ctx.names.shadowing(&r),
        forecasts: forecasts.as_deref().map(|k| &k.models),
        health,
    });
    if let Some(kept) = forecasts.as_deref_mut() {
        ctx.forecasts
            .persist(&ctx.client, &ctx.metrics, &r, kept)
            .await;
    }
    drop(forecasts);
    let decided_requeue = decision.requeue_after;
    let retry_soon = match enact(&r, &ns, decision, &ctx).await? {
        Enacted::Done(retry_soon) => retry_soon,
        Enacted::Asking => return Ok(Action::await_change()),
    };
    // A rejected template is asked again when its backoff ends (the
    // quota or webhook that rejected it may have changed meanwhile).
    let requeue_after = [
        decided_requeue,
        rejections.recheck_in,
        found.recheck,
        holder_leaving,
    ]
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
