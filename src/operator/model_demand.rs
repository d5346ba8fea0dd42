//! The ModelDemand controller: turns each ModelDemand's `replicas` into its
//! residency's demand key, and mirrors the residency's view of the model
//! back into the ModelDemand's status (and so into its `/scale`).
//!
//! [`plan`] decides (pure); [`reconcile`] reads the residency, writes the
//! key with one merge patch when it must change, and writes the status only
//! when it changed. A finalizer removes the key when the ModelDemand is
//! deleted. No owner references cross the two kinds: deleting a
//! ModelDemand never deletes a residency, and the other way round.

use crate::api::{ModelDemand, ModelDemandStatus, ModelResidency, ModelState};
use crate::metrics::Metrics;
use crate::residency::conditions::ConditionSet;
use crate::residency::demand;
use crate::residency::labels::MANAGER;
use crate::residency::labels::{MODEL_LABEL, RESIDENCY_LABEL};
use crate::residency::state::later;
use futures::StreamExt;
use k8s_openapi::jiff::Timestamp;
use kube::ResourceExt;
use kube::api::{Api, ListParams};
use kube::runtime::controller::{Action, Controller};
use kube::runtime::finalizer::{Event, finalizer};
use kube::runtime::reflector::{ObjectRef, Store};
use kube::runtime::watcher;
use std::borrow::Borrow;
use std::collections::HashMap;
use std::sync::Arc;
use std::time::Duration;

/// Keeps a ModelDemand until its demand key is removed.
pub const FINALIZER: &str = "residency.dev/demand-key";

/// The condition that mirrors the model's state.
const READY: &str = "Ready";

/// What the residency's demand key for the model should become.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum KeyWrite {
    /// Nothing to write.
    Keep,
    /// Request the model at this time.
    Set(Timestamp),
    /// Remove the key (an unload).
    Remove,
}

/// What to do for one ModelDemand, given its residency (`None`: not found)
/// and the older ModelDemand that holds the same residency's model key, if
/// another does (see [`holder_of`]).
pub fn plan(
    md: &ModelDemand,
    residency: Option<&ModelResidency>,
    held_by: Option<&str>,
    now: Timestamp,
) -> (KeyWrite, ModelDemandStatus) {
    let previous = md.status.clone().unwrap_or_default();
    let (r_name, model) = (&md.spec.residency, &md.spec.model);
    let selector = Some(format!("{RESIDENCY_LABEL}={r_name},{MODEL_LABEL}={model}"));
    if let Some(holder) = held_by {
        return (
            KeyWrite::Keep,
            duplicate(md, &previous, holder, selector, now),
        );
    }
    let wanted = md.spec.replicas >= 1;
    // The request time of a standing request: set when replicas went to 1,
    // kept (not renewed) while it stays 1.
    // A spec that now names another key starts afresh there.
    let same_key = retargeted_from(md).is_none();
    let standing = previous
        .requested_at
        .as_deref()
        .filter(|_| same_key)
        .and_then(|t| t.parse().ok());
    // A new request is later than the time the key holds: a writer whose
    // clock runs ahead may have left one after now, and a request at an
    // earlier time would be ignored as already processed.
    let key_time = residency
        .and_then(|r| r.spec.demand.get(model))
        .and_then(|t| t.parse::<Timestamp>().ok());
    let just_after = |t| later(t, Duration::from_micros(1));
    // A standing request that was served and whose model then left the
    // GPU (evicted, or put to sleep, to make room) is made again, at the
    // soonest REASK_AFTER after it: a ModelDemand at 1 keeps asking for
    // its model, as HPA at 1 means, and two at 1 whose models cannot
    // share a GPU take turns instead of thrashing.
    let standing =
        standing.filter(|&at| reask_in(residency, model, at, now) != Some(Duration::ZERO));
    let requested_at = wanted
        .then(|| standing.unwrap_or_else(|| key_time.map_or(now, |k| now.max(just_after(k)))));
    let mut status = ModelDemandStatus {
        replicas: 0,
        selector,
        state: None,
        requested_at: requested_at.map(|t: Timestamp| t.to_string()),
        residency: Some(r_name.clone()),
        model: Some(model.clone()),
        observed_generation: md.metadata.generation,
        conditions: Vec::new(),
    };
    let mut set = ConditionSet::new(&previous.conditions, md.metadata.generation, now);
    let Some(r) = residency else {
        let message = format!("ModelResidency {r_name:?} does not exist in this namespace");
        set.set(READY, false, "ResidencyNotFound", message);
        status.conditions = set.finish();
        return (KeyWrite::Keep, status);
    };
    let known = r.spec.models.iter().any(|m| &m.name == model);
    let own = same_key
        .then_some(previous.requested_at.as_deref())
        .flatten();
    let write = key_write(requested_at, r.spec.demand.get(model), own, known);
    mirror_the_model(&mut status, &mut set, r, model, known);
    status.conditions = set.finish();
    (write, status)
}

/// The status of a second ModelDemand for a model another one drives.
/// One key, one writer: it would undo the first's request (or remove the
/// key it holds when deleted). It writes nothing and keeps no request
/// time, so it starts afresh if it takes over.
fn duplicate(
    md: &ModelDemand,
    previous: &ModelDemandStatus,
    holder: &str,
    selector: Option<String>,
    now: Timestamp,
) -> ModelDemandStatus {
    let (r_name, model) = (&md.spec.residency, &md.spec.model);
    let mut set = ConditionSet::new(&previous.conditions, md.metadata.generation, now);
    let message = format!(
        "ModelDemand {holder:?} already drives {model} on {r_name}; this one is ignored while that one exists"
    );
    set.set(READY, false, "DuplicateModelDemand", message);
    ModelDemandStatus {
        replicas: 0,
        selector,
        observed_generation: md.metadata.generation,
        conditions: set.finish(),
        ..ModelDemandStatus::default()
    }
}

/// What to do with the residency's demand key, which holds `key`: this
/// ModelDemand asks at `requested_at` (or not at all), its own last
/// request was `own`, and the model is `known` to the registry.
fn key_write(
    requested_at: Option<Timestamp>,
    key: Option<&String>,
    own: Option<&str>,
    known: bool,
) -> KeyWrite {
    match (requested_at, key) {
        // 0 withdraws this ModelDemand's own request, not anyone else's.
        (None, Some(t)) if holds_own_request(t, own) => KeyWrite::Remove,
        (None, _) => KeyWrite::Keep,
        (Some(_), _) if !known => KeyWrite::Keep,
        (Some(at), None) => KeyWrite::Set(at),
        // A newer request (a router's, or ours) stands.
        (Some(at), Some(t)) => match t.parse::<Timestamp>() {
            Ok(t) if t >= at => KeyWrite::Keep,
            _ => KeyWrite::Set(at),
        },
    }
}

/// The ModelDemand's status and `Ready` condition as the residency sees
/// its model: replicas 1 while it is resident and Ready, the residency's
/// state and reason, or why there is none.
fn mirror_the_model(
    status: &mut ModelDemandStatus,
    set: &mut ConditionSet<'_>,
    r: &ModelResidency,
    model: &str,
    known: bool,
) {
    let r_name = r.name_any();
    let seen = r.status.as_ref().and_then(|s| s.model(model));
    if !known {
        let message = format!("{model:?} is not in {r_name}'s spec.models");
        set.set(READY, false, "ModelNotFound", message);
    } else if let Some(m) = seen {
        status.state = Some(format!("{:?}", m.state));
        let ready = m.state == ModelState::Loaded && m.is_resident();
        status.replicas = i32::from(ready);
        let reason = match (ready, m.reason.as_deref()) {
            (true, _) => "ModelLoaded".to_owned(),
            (false, Some(reason)) => reason.to_owned(),
            (false, None) => format!("{:?}", m.state),
        };
        let message = m.message.as_deref().map_or_else(
            || format!("{model} is {:?} on {r_name}", m.state),
            str::to_owned,
        );
        set.set(READY, ready, &reason, message);
    } else {
        let message = format!("{model} has no state on {r_name} yet");
        set.set(READY, false, "Pending", message);
    }
}

/// The soonest a ModelDemand at 1 asks again for a model that left its GPU.
pub const REASK_AFTER: Duration = Duration::from_secs(30);

/// When `model`, requested at `at`, is to be asked for again: it left
/// `residency`'s GPU (Evicted or Sleeping) after that request was
/// processed there; in zero once [`REASK_AFTER`] has passed since `at`.
/// `None` while it has not left.
fn reask_in(
    residency: Option<&ModelResidency>,
    model: &str,
    at: Timestamp,
    now: Timestamp,
) -> Option<Duration> {
    let m = residency.and_then(|r| r.status.as_ref()?.model(model))?;
    let processed = m.last_requested.as_deref()?.parse::<Timestamp>().ok()?;
    if !matches!(m.state, ModelState::Evicted | ModelState::Sleeping) || processed < at {
        return None;
    }
    let since = Duration::try_from(now.duration_since(at)).unwrap_or_default();
    Some(REASK_AFTER.saturating_sub(since))
}

/// Whether the key's time `key` is still the request a ModelDemand made at
/// `own` (no one requested the model since). A later time is someone
/// else's request (the router's traffic, `demand load`, another tool):
/// scaling the ModelDemand to 0 or deleting it leaves that standing, so a
/// ModelDemand at 0 never vetoes traffic (requests the router holds for
/// the model would otherwise wait out their load timeout).
fn holds_own_request(key: &str, own: Option<&str>) -> bool {
    let (Ok(key), Some(Ok(own))) = (key.parse::<Timestamp>(), own.map(str::parse::<Timestamp>))
    else {
        return false;
    };
    key <= own
}

/// A demand key: the namespace, residency and model a ModelDemand names.
pub type DemandKey<'a> = (Option<&'a str>, &'a str, &'a str);

/// The key `md`'s spec names.
pub fn key_of(md: &ModelDemand) -> DemandKey<'_> {
    let ns = md.metadata.namespace.as_deref();
    (ns, &md.spec.residency, &md.spec.model)
}

/// The key `md` drove (as its status records), when its spec now names
/// another.
pub fn retargeted_from(md: &ModelDemand) -> Option<DemandKey<'_>> {
    let status = md.status.as_ref()?;
    let ns = md.metadata.namespace.as_deref();
    let drove = (ns, status.residency.as_deref()?, status.model.as_deref()?);
    (drove != key_of(md)).then_some(drove)
}

/// The name of the ModelDemand, other than the one named `me`, that holds
/// `key` among `all`: of those naming it and not being deleted, the oldest
/// (then the first by name). `None` when `me` holds it, or no other names
/// it. A ModelDemand being deleted holds nothing, so the next one takes
/// over as soon as the deletion starts.
pub fn holder_of<'a, D: Borrow<ModelDemand>>(
    key: DemandKey<'_>,
    me: &str,
    all: impl IntoIterator<Item = &'a D>,
) -> Option<&'a D> {
    let age = |d: &ModelDemand| {
        (
            d.metadata.creation_timestamp.as_ref().map(|t| t.0),
            d.name_any(),
        )
    };
    let holder = all
        .into_iter()
        .filter(|d| {
            let d: &ModelDemand = (*d).borrow();
            key_of(d) == key && d.metadata.deletion_timestamp.is_none()
        })
        .min_by_key(|d| age((*d).borrow()))?;
    (holder.borrow().name_any() != me).then_some(holder)
}

#[derive(Debug, thiserror::Error)]
pub enum Error {
    #[error("writing the demand key of {residency}: {source}")]
    WriteDemand {
        residency: String,
        source: kube::Error,
    },
    #[error("writing the status: {source}")]
    PatchStatus { source: kube::Error },
    #[error("the finalizer: {0}")]
    Finalizer(Box<kube::runtime::finalizer::Error<Error>>),
    /// A bug: the reconcile panicked ([`crate::panic_guard`]).
    #[error("the reconcile panicked: {0}")]
    Panicked(String),
}

impl Error {
    /// Adding or removing the finalizer lost a race: a reconcile started
    /// from a cache that had not yet seen the previous finalizer patch
    /// (kube's JSON-patch test fails). The retry reads the settled object.
    fn is_finalizer_race(&self) -> bool {
        use kube::runtime::finalizer::Error as F;
        matches!(self, Error::Finalizer(e) if !matches!(e.as_ref(), F::ApplyFailed(_) | F::CleanupFailed(_)))
    }

    /// The `reason` label of `reconcile_errors_total`: the step that failed.
    fn metric_label(&self) -> &'static str {
        use kube::runtime::finalizer::Error as F;
        match self {
            Error::WriteDemand { .. } => "demand_write_demand",
            Error::PatchStatus { .. } => "demand_patch_status",
            Error::Finalizer(e) => match e.as_ref() {
                F::ApplyFailed(inner) | F::CleanupFailed(inner) => inner.metric_label(),
                _ => "demand_finalizer",
            },
            Error::Panicked(_) => "demand_panic",
        }
    }
}

pub struct Context {
    pub client: kube::Client,
    pub metrics: Arc<Metrics>,
    /// The residency controller's cache: a ModelDemand reads its residency
    /// there (no read per reconcile, no second watch of every residency).
    pub residencies: Store<ModelResidency>,
    /// The catalogs the residencies name (the residency controller's).
    pub catalogs: Arc<crate::residency::catalog::Catalogs>,
    /// This controller's cache of ModelDemands: who holds a model's key.
    pub demands: Store<ModelDemand>,
    /// The last request time this process wrote for each key. A reconcile
    /// reads its ModelDemand from the cache, which can predate the status
    /// the previous reconcile wrote (and so its `requestedAt`); this says
    /// which key time is this controller's own request meanwhile.
    pub written: std::sync::Mutex<HashMap<Written, Timestamp>>,
}

/// A ModelDemand's name and a key it wrote, for [`Context::written`].
type Written = (String, String, String, String);

fn owned(md: &ModelDemand, (ns, residency, model): DemandKey<'_>) -> Written {
    let ns = ns.unwrap_or_default().to_owned();
    (ns, md.name_any(), residency.to_owned(), model.to_owned())
}

/// `md`'s own request time for `key`: the later of its status's
/// `requestedAt` and what this process last wrote for it.
fn own_request(ctx: &Context, key: DemandKey<'_>, md: &ModelDemand) -> Option<Timestamp> {
    let recorded = md.status.as_ref().and_then(|s| s.requested_at.as_deref());
    let recorded = recorded.and_then(|t| t.parse::<Timestamp>().ok());
    let written = ctx
        .written
        .lock()
        .expect("written lock")
        .get(&owned(md, key))
        .copied();
    recorded.max(written)
}

/// The ModelDemand other than `md` that holds `key`, from the cache.
fn held_by(ctx: &Context, key: DemandKey<'_>, md: &ModelDemand) -> Option<Arc<ModelDemand>> {
    let all = ctx.demands.state();
    holder_of(key, &md.name_any(), &all).cloned()
}

fn residency_of(ctx: &Context, (ns, residency, _): DemandKey<'_>) -> Option<Arc<ModelResidency>> {
    ctx.residencies
        .get(&ObjectRef::new(residency).within(ns.unwrap_or_default()))
        .map(crate::controller::cached::unpacked)
        // One whose catalog cannot be read is read with its inline models
        // only (it acts on nothing meanwhile).
        .map(|r| ctx.catalogs.resolve(r.clone()).unwrap_or(r))
}

async fn write_key(
    ctx: &Context,
    md: &ModelDemand,
    key: DemandKey<'_>,
    write: &KeyWrite,
) -> Result<(), Error> {
    let (ns, residency, model) = key;
    let api: Api<ModelResidency> = Api::namespaced(ctx.client.clone(), ns.unwrap_or_default());
    let result = match write {
        KeyWrite::Keep => return Ok(()),
        KeyWrite::Set(at) => demand::load(&api, residency, model, *at).await,
        KeyWrite::Remove => demand::unload(&api, residency, model).await,
    };
    ctx.metrics.api_request("patch", "modelresidencies");
    if result.is_ok() {
        let mut written = ctx.written.lock().expect("written lock");
        match write {
            KeyWrite::Set(at) => written.insert(owned(md, key), *at),
            _ => written.remove(&owned(md, key)),
        };
    }
    match result {
        Ok(_) => Ok(()),
        // Deleted meanwhile: nothing left to write into.
        Err(kube::Error::Api(s)) if s.code == 404 => Ok(()),
        Err(source) => Err(Error::WriteDemand {
            residency: residency.to_owned(),
            source,
        }),
    }
}

/// Withdraws `md`'s own request for `key` (the key it drove): removes the
/// key if it still holds that request, unless another ModelDemand that
/// holds the key now asks for the model (it requests it anew at once).
async fn release(ctx: &Context, key: DemandKey<'_>, md: &ModelDemand) -> Result<(), Error> {
    let (_, _, model) = key;
    let own = own_request(ctx, key, md).map(|t| t.to_string());
    let own = own.as_deref();
    let residency = residency_of(ctx, key);
    let Some(t) = residency.as_ref().and_then(|r| r.spec.demand.get(model)) else {
        return Ok(());
    };
    let successor_asks = held_by(ctx, key, md).is_some_and(|d| d.spec.replicas >= 1);
    if holds_own_request(t, own) && !successor_asks {
        write_key(ctx, md, key, &KeyWrite::Remove).await?;
    }
    Ok(())
}

async fn apply(md: Arc<ModelDemand>, ctx: &Context) -> Result<Action, Error> {
    let ns = md.namespace().unwrap_or_default();
    // The key it drove before its spec named another.
    if let Some(old) = retargeted_from(&md) {
        release(ctx, old, &md).await?;
    }
    // Planned from this controller's own latest request, which the cache
    // may not show yet (the status is still compared with the cache's).
    let mut planned = (*md).clone();
    if let Some(t) = own_request(ctx, key_of(&md), &md) {
        let status = planned.status.get_or_insert_with(Default::default);
        status.requested_at = Some(t.to_string());
    }
    let residency = residency_of(ctx, key_of(&md));
    let holder = held_by(ctx, key_of(&md), &md).map(|d| d.name_any());
    let (write, status) = plan(
        &planned,
        residency.as_deref(),
        holder.as_deref(),
        Timestamp::now(),
    );
    write_key(ctx, &md, key_of(&md), &write).await?;
    if md.status.as_ref() != Some(&status) {
        let api: Api<ModelDemand> = Api::namespaced(ctx.client.clone(), &ns);
        let result = crate::cluster::apply_status(&api, &md.name_any(), MANAGER, &status).await;
        ctx.metrics.api_request("patch", "modeldemands/status");
        result.map_err(|source| Error::PatchStatus { source })?;
    }
    // A model that left its GPU is asked for again when its turn comes.
    let standing = status.requested_at.as_deref().and_then(|t| t.parse().ok());
    if let Some(wait) = standing
        .filter(|_| md.spec.replicas >= 1)
        .and_then(|at| reask_in(residency.as_deref(), &md.spec.model, at, Timestamp::now()))
    {
        return Ok(Action::requeue(wait.max(Duration::from_millis(100))));
    }
    // A missing residency or model is a condition, not an error loop: the
    // residency watch wakes this object when that changes.
    Ok(Action::await_change())
}

/// The ModelDemand is going: its demand key goes with it, unless another
/// ModelDemand for the same model stays (that one takes the key over, and
/// its own replicas decide it).
async fn cleanup(md: Arc<ModelDemand>, ctx: &Context) -> Result<Action, Error> {
    if let Some(old) = retargeted_from(&md) {
        release(ctx, old, &md).await?;
    }
    release(ctx, key_of(&md), &md).await?;
    let (ns, name) = (md.namespace().unwrap_or_default(), md.name_any());
    let mut written = ctx.written.lock().expect("written lock");
    written.retain(|(n, d, _, _), _| (n, d) != (&ns, &name));
    Ok(Action::await_change())
}

/// Reconciles one ModelDemand; a panic in it is this object's failed
/// reconcile ([`crate::panic_guard`]).
pub async fn reconcile(md: Arc<ModelDemand>, ctx: Arc<Context>) -> Result<Action, Error> {
    crate::panic_guard::guarded(reconcile_unguarded(md, ctx), Error::Panicked).await
}

async fn reconcile_unguarded(md: Arc<ModelDemand>, ctx: Arc<Context>) -> Result<Action, Error> {
    let ns = md.namespace().unwrap_or_default();
    let api: Api<ModelDemand> = Api::namespaced(ctx.client.clone(), &ns);
    finalizer(&api, FINALIZER, md, |event| async {
        match event {
            Event::Apply(md) => apply(md, &ctx).await,
            Event::Cleanup(md) => cleanup(md, &ctx).await,
        }
    })
    .await
    .map_err(|e| Error::Finalizer(Box::new(e)))
}

fn error_policy(md: Arc<ModelDemand>, error: &Error, ctx: Arc<Context>) -> Action {
    tracing::warn!(
        namespace = md.namespace().unwrap_or_default(),
        modeldemand = %md.name_any(),
        step = error.metric_label(),
        "reconcile failed: {error}"
    );
    ctx.metrics.reconcile_error(error.metric_label());
    if error.is_finalizer_race() {
        // Settles as soon as the cache catches up.
        Action::requeue(Duration::from_millis(200))
    } else if matches!(error, Error::Panicked(_)) {
        // It will most likely panic again.
        Action::requeue(Duration::from_secs(60))
    } else {
        Action::requeue(Duration::from_secs(2))
    }
}

/// Whether the ModelDemand CRD is installed and readable (it is opt-in).
pub async fn installed(client: &kube::Client, namespace: Option<&str>) -> bool {
    let api: Api<ModelDemand> = crate::cluster::api_in(client, namespace);
    match api.list(&ListParams::default().limit(1)).await {
        Ok(_) => true,
        Err(e) => {
            tracing::info!(error = %e, "ModelDemand objects are not served");
            false
        }
    }
}

/// Runs the ModelDemand controller for `namespace` (all when `None`) until
/// `shutdown` completes. `residencies` is the residency controller's cache
/// and `changed` names each residency it has just updated, which wakes the
/// ModelDemands that name it.
pub async fn run(
    client: kube::Client,
    metrics: Arc<Metrics>,
    namespace: Option<String>,
    shutdown: impl std::future::Future<Output = ()> + Send + Sync + 'static,
    residencies: Store<ModelResidency>,
    catalogs: Arc<crate::residency::catalog::Catalogs>,
    changed: impl futures::Stream<Item = ObjectRef<ModelResidency>> + Send + 'static,
) {
    let demands: Api<ModelDemand> = crate::cluster::api_in(&client, namespace.as_deref());
    let controller = Controller::new(demands.clone(), watcher::Config::default());
    let store = controller.store();
    let demand_cache = store.clone();
    // A ModelDemand that changes or goes wakes the others for its model: one
    // of them may now hold the key (or no longer does).
    let siblings_of = {
        let store = store.clone();
        move |md: ModelDemand| {
            // The key it drove before its spec changed, too.
            let keys = [Some(key_of(&md)), retargeted_from(&md)];
            store
                .state()
                .iter()
                .filter(|d| keys.contains(&Some(key_of(d))) && d.name_any() != md.name_any())
                .map(|d| ObjectRef::from_obj(&**d))
                .collect::<Vec<_>>()
        }
    };
    let woken = changed.flat_map(move |r| {
        let woken: Vec<ObjectRef<ModelDemand>> = store
            .state()
            .iter()
            .filter(|md| md.namespace() == r.namespace && md.spec.residency == r.name)
            .map(|md| ObjectRef::from_obj(&**md))
            .collect();
        futures::stream::iter(woken)
    });
    let ctx = Arc::new(Context {
        client,
        metrics,
        residencies,
        catalogs,
        demands: demand_cache,
        written: Default::default(),
    });
    controller
        .watches(demands, watcher::Config::default(), siblings_of)
        .reconcile_on(woken)
        .graceful_shutdown_on(shutdown)
        .run(reconcile, error_policy, ctx)
        .for_each(|_| async {})
        .await;
}
#[cfg(test)]
#[path = "model_demand_tests.rs"]
mod tests;
