//! The reconciler: fetch (owned pods) -> decide (pure, with the engine) ->
//! apply (delete, then create pods) -> status (server-side apply, only when
//! it changed) -> events.

pub mod conditions;
pub mod decide;
pub mod pods;

use crate::api::ModelResidency;
use crate::labels::RESIDENCY_LABEL;
use decide::{Decision, Observed, decide};
use futures::StreamExt;
use k8s_openapi::api::core::v1::{ObjectReference, Pod};
use k8s_openapi::jiff::Timestamp;
use kube::api::{Api, DeleteParams, ListParams, Patch, PatchParams, PostParams, Preconditions};
use kube::runtime::controller::{Action, Controller};
use kube::runtime::events::{Event, EventType, Recorder, Reporter};
use kube::runtime::watcher;
use kube::{Resource, ResourceExt};
use pods::ModelPod;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

/// The field manager of everything the operator writes.
pub const MANAGER: &str = "model-residency";

#[derive(Debug, thiserror::Error)]
pub enum Error {
    #[error("kubernetes API: {0}")]
    Kube(#[from] kube::Error),
    #[error("object has no {0}")]
    Incomplete(&'static str),
}

impl Error {
    /// A short label for metrics and logs.
    pub fn metric_label(&self) -> &'static str {
        match self {
            Error::Kube(kube::Error::Api(s)) if s.code == 409 => "conflict",
            Error::Kube(_) => "kube",
            Error::Incomplete(_) => "incomplete",
        }
    }
}

pub type Result<T, E = Error> = std::result::Result<T, E>;

/// Counts of the API calls that change something, for tests and metrics.
#[derive(Debug, Default)]
pub struct Writes {
    pub pods_created: AtomicU64,
    pub pods_deleted: AtomicU64,
    pub status_patches: AtomicU64,
    pub reconciles: AtomicU64,
}

impl Writes {
    /// Pod creates, pod deletes and status patches together.
    pub fn total(&self) -> u64 {
        self.pods_created.load(Ordering::Relaxed)
            + self.pods_deleted.load(Ordering::Relaxed)
            + self.status_patches.load(Ordering::Relaxed)
    }
}

pub struct Context {
    pub client: kube::Client,
    pub recorder: Recorder,
    pub writes: Writes,
}

impl Context {
    pub fn new(client: kube::Client) -> Arc<Self> {
        let recorder = Recorder::new(
            client.clone(),
            Reporter {
                controller: MANAGER.into(),
                instance: std::env::var("POD_NAME").ok(),
            },
        );
        Arc::new(Context {
            client,
            recorder,
            writes: Writes::default(),
        })
    }
}

/// The pods this residency owns (by label, confirmed by owner uid).
async fn fetch_pods(api: &Api<Pod>, r: &ModelResidency) -> Result<Vec<ModelPod>> {
    let uid = r.metadata.uid.as_deref().ok_or(Error::Incomplete("uid"))?;
    let lp = ListParams::default().labels(&format!("{RESIDENCY_LABEL}={}", r.name_any()));
    let pods = api.list(&lp).await?;
    Ok(pods
        .items
        .iter()
        .filter(|p| p.owner_references().iter().any(|o| o.uid == uid))
        .filter_map(ModelPod::from_pod)
        .collect())
}

/// Deletes first (they free VRAM), then creates what fits.
async fn apply(api: &Api<Pod>, d: &Decision, ctx: &Context) -> Result<bool> {
    let mut retry_soon = false;
    for (name, uid) in &d.delete {
        let dp = DeleteParams {
            preconditions: Some(Preconditions {
                uid: Some(uid.clone()),
                resource_version: None,
            }),
            ..DeleteParams::default()
        };
        match api.delete(name, &dp).await {
            Ok(_) => {
                ctx.writes.pods_deleted.fetch_add(1, Ordering::Relaxed);
            }
            // Already gone, or replaced by another pod of that name.
            Err(kube::Error::Api(s)) if s.code == 404 || s.code == 409 => {}
            Err(e) => return Err(e.into()),
        }
    }
    for pod in &d.create {
        match api.create(&PostParams::default(), pod).await {
            Ok(_) => {
                ctx.writes.pods_created.fetch_add(1, Ordering::Relaxed);
            }
            // The previous pod of that name is still terminating.
            Err(kube::Error::Api(s)) if s.code == 409 => retry_soon = true,
            Err(e) => return Err(e.into()),
        }
    }
    Ok(retry_soon)
}

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
    api.patch_status(&r.name_any(), &pp, &Patch::Apply(&body))
        .await?;
    ctx.writes.status_patches.fetch_add(1, Ordering::Relaxed);
    Ok(())
}

async fn publish(d: &Decision, r: &ModelResidency, ctx: &Context) {
    let reference = r.object_ref(&());
    for n in &d.notes {
        let secondary = n.model.as_ref().map(|m| ObjectReference {
            api_version: Some("v1".into()),
            kind: Some("Pod".into()),
            name: Some(pods::pod_name(&r.name_any(), m)),
            namespace: r.namespace(),
            ..ObjectReference::default()
        });
        let ev = Event {
            type_: if n.warning {
                EventType::Warning
            } else {
                EventType::Normal
            },
            reason: n.reason.into(),
            note: Some(n.message.clone()),
            action: n.action.into(),
            secondary,
        };
        if let Err(e) = ctx.recorder.publish(&ev, &reference).await {
            tracing::warn!(error = %e, "could not publish event");
        }
    }
}

#[tracing::instrument(skip(r, ctx), fields(residency = %r.name_any()))]
pub async fn reconcile(r: Arc<ModelResidency>, ctx: Arc<Context>) -> Result<Action> {
    ctx.writes.reconciles.fetch_add(1, Ordering::Relaxed);
    let ns = r.namespace().ok_or(Error::Incomplete("namespace"))?;
    let pods: Api<Pod> = Api::namespaced(ctx.client.clone(), &ns);
    let residencies: Api<ModelResidency> = Api::namespaced(ctx.client.clone(), &ns);
    let owned = fetch_pods(&pods, &r).await?;
    let owner = r
        .controller_owner_ref(&())
        .ok_or(Error::Incomplete("uid"))?;
    let decision = decide(&Observed {
        residency: &r,
        owner,
        pods: &owned,
        now: Timestamp::now(),
    });
    let retry_soon = apply(&pods, &decision, &ctx).await?;
    write_status(&residencies, &r, &decision, &ctx).await?;
    publish(&decision, &r, &ctx).await;
    Ok(match (retry_soon, decision.requeue_after) {
        (true, _) => Action::requeue(Duration::from_millis(500)),
        (false, Some(after)) => Action::requeue(after),
        // Everything else arrives by watch; this is a safety net.
        (false, None) => Action::requeue(Duration::from_secs(300)),
    })
}

/// Transient errors retry with a short backoff; conflicts at once.
pub fn error_policy(_r: Arc<ModelResidency>, error: &Error, _ctx: Arc<Context>) -> Action {
    tracing::warn!(error = %error, reason = error.metric_label(), "reconcile failed");
    match error {
        Error::Kube(kube::Error::Api(s)) if s.code == 409 => {
            Action::requeue(Duration::from_millis(200))
        }
        _ => Action::requeue(Duration::from_secs(2)),
    }
}

/// Runs the controller for `namespace` (all namespaces when `None`) until
/// `shutdown` completes.
pub async fn run(
    ctx: Arc<Context>,
    namespace: Option<&str>,
    shutdown: impl std::future::Future<Output = ()> + Send + Sync + 'static,
) {
    let client = ctx.client.clone();
    let (residencies, pods): (Api<ModelResidency>, Api<Pod>) = match namespace {
        Some(ns) => (
            Api::namespaced(client.clone(), ns),
            Api::namespaced(client, ns),
        ),
        None => (Api::all(client.clone()), Api::all(client)),
    };
    Controller::new(residencies, watcher::Config::default())
        .owns(pods, watcher::Config::default().labels(RESIDENCY_LABEL))
        .graceful_shutdown_on(shutdown)
        .run(reconcile, error_policy, ctx)
        .for_each(|result| async move {
            if let Err(e) = result {
                tracing::debug!(error = %e, "controller event");
            }
        })
        .await;
}
