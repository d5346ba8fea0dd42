//! The ResidencySet controller: exactly one `ModelResidency` per published
//! device a set selects (`crate::residency::devices`), under the same
//! leadership as the residency controller.
//!
//! - **Stamped** by server-side apply (field manager `residency-set`): the
//!   device's node and its uuid (else index), the set's catalog and
//!   settings, owned by the set (deleting the set deletes them), labelled
//!   `residency.dev/set`, named `<set>-<node>-<device>`. Only the fields
//!   the set owns are written: demand (the routers') is never touched.
//! - **Skipped**, and said in status, is a selected device that another
//!   residency (stamped by another set, or hand-written) already names.
//! - **Drained, then deleted**, is a stamped residency whose device left
//!   its slice or stopped matching: its registry is emptied (its catalog's
//!   model list set to none), so the operator unloads each model as an
//!   unload is done and the routers send held and new requests to other
//!   copies or load them elsewhere; once nothing is resident it is deleted.
//! - A selector that does not compile, or a DeviceClass that is missing,
//!   changes nothing (no residency is drained for it): `Ready=False`.

use crate::api::{
    CatalogRef, GpuSpec, ModelResidency, ModelState, ResidencySet, ResidencySetStatus,
};
use crate::metrics::Metrics;
use crate::quantity::format_bytes;
use crate::residency::conditions::{ConditionSet, READY};
use crate::residency::devices::{Device, all_devices, node_matches, select, slice_devices};
use futures::StreamExt;
use k8s_openapi::api::core::v1::Node;
use k8s_openapi::api::resource::v1::{DeviceClass, ResourceSlice};
use k8s_openapi::jiff::Timestamp;
use kube::api::{Api, DeleteParams, PartialObjectMeta, Patch, PatchParams};
use kube::runtime::controller::{Action, Controller};
use kube::runtime::reflector::{ObjectRef, Store};
use kube::runtime::{WatchStreamExt, reflector, watcher};
use kube::{Resource, ResourceExt};
use serde_json::json;
use set_devices::{claim_device, stamped_for};
use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::Duration;

/// The field manager of stamped residencies and of the sets' status.
pub const MANAGER: &str = "residency-set";
use crate::residency::labels::set_label;
pub use crate::residency::labels::{
    SET_DEVICE_ANNOTATION, SET_DRAINING_LABEL as DRAINING_LABEL, SET_LABEL,
};
/// The default DeviceClass (the NVIDIA DRA driver's).
pub const DEFAULT_CLASS: &str = "gpu.nvidia.com";

#[path = "set_devices.rs"]
mod set_devices;

#[derive(Debug, thiserror::Error)]
pub enum Error {
    #[error("kube: {0}")]
    Kube(#[from] kube::Error),
    #[error("the object has no {0}")]
    Incomplete(&'static str),
}

pub struct Context {
    pub client: kube::Client,
    pub metrics: Arc<Metrics>,
    /// The residency controller's cache (every residency it watches).
    pub residencies: Store<ModelResidency>,
    devices: Arc<PublishedDevices>,
    classes: Store<DeviceClass>,
    nodes: Store<PartialObjectMeta<Node>>,
}

/// Runs the set controller for `namespace` (all when `None`) until
/// `shutdown`; `owned` names the set of each residency the residency
/// watch has just seen change.
pub async fn run(
    client: kube::Client,
    metrics: Arc<Metrics>,
    namespace: Option<String>,
    shutdown: impl std::future::Future<Output = ()> + Send + Sync + 'static,
    residencies: Store<ModelResidency>,
    owned: impl futures::Stream<Item = ObjectRef<ResidencySet>> + Send + 'static,
) {
    let sets: Api<ResidencySet> = crate::cluster::api_in(&client, namespace.as_deref());
    let controller = Controller::new(sets, watcher::Config::default());
    let all_sets = controller.store();
    let devices = Arc::new(PublishedDevices::default());
    let (classes, class_writer) = reflector::store();
    let (nodes, node_writer) = reflector::store();
    // The devices, classes and nodes are read by tasks of their own (a
    // reconcile waits for their first lists: they must not depend on the
    // controller pulling its triggers); a change to any may concern every
    // set.
    // Only what a set reads counts as a change: a slice's devices, a
    // class, a node's labels (nodes report their status every few seconds:
    // at a hundred nodes those updates alone never left the set a quiet
    // moment to reconcile in).
    let (changed_tx, changed_rx) = futures::channel::mpsc::unbounded();
    let _watches = [
        spawn_published_devices(
            Api::<ResourceSlice>::all(client.clone()),
            devices.clone(),
            changed_tx.clone(),
        ),
        spawn_reflector(
            watcher(
                Api::<DeviceClass>::all(client.clone()),
                watcher::Config::default(),
            ),
            class_writer,
            changed_tx.clone(),
            |c: &DeviceClass| serde_json::to_string(&c.spec).unwrap_or_default(),
        ),
        spawn_reflector(
            watcher(
                Api::<PartialObjectMeta<Node>>::all(client.clone()),
                watcher::Config::default(),
            ),
            node_writer,
            changed_tx,
            |n: &PartialObjectMeta<Node>| format!("{:?}", n.metadata.labels),
        ),
    ];
    let changes = changed_rx.flat_map(everyone(all_sets.clone()));
    let ctx = Arc::new(Context {
        client,
        metrics,
        residencies,
        devices,
        classes,
        nodes,
    });
    let triggers = paced(
        futures::stream::select(changes, owned),
        Duration::from_millis(500),
    );
    controller
        .reconcile_on(triggers)
        .graceful_shutdown_on(shutdown)
        .run(reconcile, error_policy, ctx)
        .for_each(|_| async {})
        .await;
}

/// The devices of every ResourceSlice, kept as a set reads them (their
/// node, names, attributes and capacities: [`Device`]) rather than as whole
/// slices: at 10,000 GPUs the slices' objects took the operator about
/// 6 KiB a device (docs/performance.md).
#[derive(Default)]
struct PublishedDevices {
    /// Slice name -> its devices.
    by_slice: std::sync::RwLock<std::collections::HashMap<String, Vec<Arc<Device>>>>,
    /// Whether the first list is in.
    listed: std::sync::atomic::AtomicBool,
}

impl PublishedDevices {
    fn is_listed(&self) -> bool {
        self.listed.load(std::sync::atomic::Ordering::Acquire)
    }

    /// Every published device, by node and name: shared, not copied (a
    /// copy of 10,000 devices in each set reconcile was 13 MB at once).
    fn all(&self) -> Vec<Arc<Device>> {
        all_devices(self.by_slice.read().expect("devices lock").values())
    }
}

/// Keeps `cache` with the slices' devices in a task (aborted when the
/// guard is dropped), saying on `changed` each change of a slice's devices,
/// each slice gone and each relist's end. A relist replaces the whole map
/// at its end, so a slice deleted while the watch was down goes too.
fn spawn_published_devices(
    slices: Api<ResourceSlice>,
    cache: Arc<PublishedDevices>,
    changed: futures::channel::mpsc::UnboundedSender<()>,
) -> super::AbortOnDrop {
    let mut relisted: Option<std::collections::HashMap<String, Vec<Arc<Device>>>> = None;
    let run = watcher(slices, crate::cluster::slice_watch_config())
        .backoff(crate::cluster::WatchBackoff::default())
        .for_each(move |event| {
            let change = match event {
                Ok(watcher::Event::Init) => {
                    relisted = Some(Default::default());
                    false
                }
                Ok(watcher::Event::InitApply(slice)) => {
                    if let Some(map) = relisted.as_mut() {
                        map.insert(slice.name_any(), slice_devices(&slice));
                    }
                    false
                }
                Ok(watcher::Event::InitDone) => {
                    if let Some(map) = relisted.take() {
                        *cache.by_slice.write().expect("devices lock") = map;
                    }
                    cache
                        .listed
                        .store(true, std::sync::atomic::Ordering::Release);
                    true
                }
                Ok(watcher::Event::Apply(slice)) => {
                    let devices = slice_devices(&slice);
                    let mut map = cache.by_slice.write().expect("devices lock");
                    map.insert(slice.name_any(), devices.clone()) != Some(devices)
                }
                Ok(watcher::Event::Delete(slice)) => cache
                    .by_slice
                    .write()
                    .expect("devices lock")
                    .remove(&slice.name_any())
                    .is_some(),
                Err(_) => false,
            };
            if change {
                let _ = changed.unbounded_send(());
            }
            futures::future::ready(())
        });
    super::AbortOnDrop(tokio::spawn(run))
}

/// Runs `events` into `writer`'s store in a task (aborted when the guard
/// is dropped), saying on `changed` each change of what `read` takes of an
/// object (what a set reads of it), each deletion and each relist's end.
/// The store keeps no object's managedFields (a set never reads them),
/// and the change check keeps a hash of what was read, not the text.
fn spawn_reflector<K>(
    events: impl futures::Stream<Item = Result<watcher::Event<K>, watcher::Error>> + Send + 'static,
    writer: reflector::store::Writer<K>,
    changed: futures::channel::mpsc::UnboundedSender<()>,
    read: fn(&K) -> String,
) -> super::AbortOnDrop
where
    K: kube::Resource + Clone + std::fmt::Debug + Send + Sync + 'static,
    K::DynamicType: Default + Eq + std::hash::Hash + Clone + Send + Sync,
{
    let mut seen: std::collections::HashMap<ObjectRef<K>, u64> = Default::default();
    let run = events
        .backoff(crate::cluster::WatchBackoff::default())
        .modify(|o| o.meta_mut().managed_fields = None)
        .reflect(writer)
        .for_each(move |event| {
            let change = match &event {
                Ok(watcher::Event::Apply(o) | watcher::Event::InitApply(o)) => {
                    let now = {
                        use std::hash::{BuildHasher, BuildHasherDefault};
                        BuildHasherDefault::<std::collections::hash_map::DefaultHasher>::default()
                            .hash_one(read(o))
                    };
                    seen.insert(ObjectRef::from_obj(o), now) != Some(now)
                }
                Ok(watcher::Event::Delete(o)) => {
                    seen.remove(&ObjectRef::from_obj(o));
                    true
                }
                Ok(watcher::Event::InitDone) => true,
                Ok(watcher::Event::Init) | Err(_) => false,
            };
            if change {
                let _ = changed.unbounded_send(());
            }
            futures::future::ready(())
        });
    super::AbortOnDrop(tokio::spawn(run))
}

/// `triggers`, each set at most once per `every`: what arrives meanwhile
/// is gathered and sent at the next beat. Unlike a debounce, a steady
/// stream of changes (residency statuses during a storm) never keeps a
/// set from being reconciled; it is reconciled every `every` instead.
fn paced(
    triggers: impl futures::Stream<Item = ObjectRef<ResidencySet>> + Send + 'static,
    every: Duration,
) -> impl futures::Stream<Item = ObjectRef<ResidencySet>> + Send + 'static {
    use std::collections::BTreeSet;
    // The beats go on for as long as the controller reads them (it stops
    // on shutdown).
    let beats = tokio_stream_interval(every).map(|_| None);
    let mut pending: BTreeSet<(Option<String>, String)> = BTreeSet::new();
    futures::stream::select(triggers.map(Some), beats)
        .map(move |item| {
            let out: Vec<ObjectRef<ResidencySet>> = match item {
                Some(set) => {
                    pending.insert((set.namespace.clone(), set.name.clone()));
                    Vec::new()
                }
                None => std::mem::take(&mut pending)
                    .into_iter()
                    .map(|(ns, name)| {
                        let r = ObjectRef::new(&name);
                        match ns {
                            Some(ns) => r.within(&ns),
                            None => r,
                        }
                    })
                    .collect(),
            };
            futures::stream::iter(out)
        })
        .flatten()
}

/// A stream that yields every `every`, from one `every` from now.
fn tokio_stream_interval(every: Duration) -> impl futures::Stream<Item = ()> + Send + 'static {
    futures::stream::unfold(
        tokio::time::interval_at(tokio::time::Instant::now() + every, every),
        |mut ticks| async move {
            ticks.tick().await;
            Some(((), ticks))
        },
    )
}

/// A change to the devices, a class or a node may concern every set.
fn everyone<T>(
    store: Store<ResidencySet>,
) -> impl FnMut(T) -> futures::stream::Iter<std::vec::IntoIter<ObjectRef<ResidencySet>>> {
    move |_| {
        futures::stream::iter(
            store
                .state()
                .iter()
                .map(|s| ObjectRef::from_obj(&**s))
                .collect::<Vec<_>>(),
        )
    }
}

fn error_policy(_: Arc<ResidencySet>, e: &Error, _: Arc<Context>) -> Action {
    tracing::warn!(error = %e, "residency set");
    Action::requeue(Duration::from_secs(5))
}

/// The sets `r` belongs to (by its owner reference), for the residency
/// watch's events.
pub fn set_of(r: &ModelResidency) -> Option<ObjectRef<ResidencySet>> {
    let owner = r
        .owner_references()
        .iter()
        .find(|o| o.kind == "ResidencySet" && o.api_version == ResidencySet::api_version(&()))?;
    Some(ObjectRef::new(&owner.name).within(&r.namespace()?))
}

/// What a set wants of one device.
struct Wanted<'a> {
    device: &'a Device,
    name: String,
    /// Its residency, when stamped already.
    current: Option<&'a Arc<ModelResidency>>,
}

async fn reconcile(set: Arc<ResidencySet>, ctx: Arc<Context>) -> Result<Action, Error> {
    // Nothing is decided on a partial view: a device missing from a slice
    // store that has not listed yet would drain its residency.
    use futures::FutureExt;
    let listed = [
        ctx.classes.wait_until_ready().now_or_never(),
        ctx.nodes.wait_until_ready().now_or_never(),
        ctx.residencies.wait_until_ready().now_or_never(),
    ];
    if !ctx.devices.is_listed() || listed.iter().any(|l| !matches!(l, Some(Ok(())))) {
        return Ok(Action::requeue(Duration::from_millis(500)));
    }
    let ns = set.namespace().ok_or(Error::Incomplete("namespace"))?;
    let uid = set.uid().ok_or(Error::Incomplete("uid"))?;
    let name = set.name_any();
    let now = Timestamp::now();
    let previous = set.status.clone().unwrap_or_default();
    let mut status = ResidencySetStatus {
        observed_generation: set.metadata.generation,
        ..Default::default()
    };
    let mut conditions = ConditionSet::new(&previous.conditions, set.metadata.generation, now);
    let residencies: Api<ModelResidency> = Api::namespaced(ctx.client.clone(), &ns);
    let all = ctx.residencies.state();
    let owned: Vec<&Arc<ModelResidency>> = all
        .iter()
        .filter(|r| r.owner_references().iter().any(|o| o.uid == uid))
        .collect();

    // Its name is every stamp's set label: one that cannot be a label
    // value could never stamp (the API server refuses each stamp).
    if !crate::residency::labels::fits_label_value(&name) {
        count_owned(&mut status, &owned);
        let message = format!(
            "the set's name is {} characters; its stamped residencies carry it as the {SET_LABEL} label, which takes at most 63: rename the set",
            name.len()
        );
        conditions.set(READY, false, "InvalidName", message);
        status.conditions = conditions.finish();
        write_status(&ctx, &ns, &name, &previous, status).await?;
        return Ok(Action::await_change());
    }

    // Which devices: nothing is drained while this cannot be said.
    let class_name = set
        .spec
        .devices
        .device_class_name
        .clone()
        .unwrap_or_else(|| DEFAULT_CLASS.to_owned());
    let expressions = match ctx.classes.get(&ObjectRef::new(&class_name)) {
        None => Err((
            "DeviceClassNotFound",
            format!("DeviceClass {class_name} does not exist"),
        )),
        Some(class) => Ok(class
            .spec
            .selectors
            .iter()
            .flatten()
            .filter_map(|s| s.cel.as_ref().map(|c| c.expression.clone()))
            .chain(
                set.spec
                    .devices
                    .selectors
                    .iter()
                    .map(|s| s.cel.expression.clone()),
            )
            .collect::<Vec<String>>()),
    };
    let nodes: BTreeMap<String, Arc<PartialObjectMeta<Node>>> = ctx
        .nodes
        .state()
        .into_iter()
        .map(|n| (n.name_any(), n))
        .collect();
    let candidates: Vec<Arc<Device>> = ctx
        .devices
        .all()
        .into_iter()
        .filter(|d| {
            node_matches(
                set.spec.devices.node_selector.as_ref(),
                nodes.get(&d.node).and_then(|n| n.metadata.labels.as_ref()),
            )
        })
        .collect();
    // Parsed and run off the runtime, within their bounds (a tenant's
    // selector must not stop the operator for every tenant).
    let selection = match expressions {
        Ok(e) => select(e, candidates)
            .await
            .map_err(|e| ("InvalidSelector", e)),
        Err(e) => Err(e),
    };
    let (selected, failed_on) = match selection {
        Ok(s) => (s.selected, s.failed_on),
        Err((reason, message)) => {
            count_owned(&mut status, &owned);
            conditions.set(READY, false, reason, message);
            status.conditions = conditions.finish();
            write_status(&ctx, &ns, &name, &previous, status).await?;
            return Ok(Action::await_change());
        }
    };
    let selected: Vec<&Device> = selected.iter().map(|d| &**d).collect();
    status.devices = selected.len() as u32;

    // Each selected device: ours, or held by someone else.
    let mut wanted = Vec::new();
    for d in &selected {
        let ours = owned.iter().copied().find(|r| stamped_for(r, d));
        match claim_device(&all, &uid, &ns, &name, d, ours) {
            Ok(name) => wanted.push(Wanted {
                device: d,
                name,
                current: ours,
            }),
            Err(why) => status.skipped.push(why),
        }
    }
    status.skipped_count = status.skipped.len() as u32;

    let owner = set
        .controller_owner_ref(&())
        .ok_or(Error::Incomplete("uid"))?;
    // A device whose residency the API server refuses (its uuid not of
    // the form the CRD takes, say) is said in status and passed by: it
    // must not keep the devices after it from being stamped.
    let mut refused = Vec::new();
    for w in &wanted {
        let desired = stamped_body(&set, w, &owner, &class_name);
        if w.current.is_none_or(|r| differs(r, &desired)) {
            ctx.metrics.api_request("patch", "modelresidencies");
            let applied = residencies
                .patch(
                    &w.name,
                    &PatchParams::apply(MANAGER).force(),
                    &Patch::Apply(&desired),
                )
                .await;
            match applied {
                Ok(_) => {}
                Err(kube::Error::Api(e)) if e.code == 422 || e.code == 400 => {
                    refused.push(format!(
                        "{}/{}: the API server refuses its residency {}: {}",
                        w.device.node, w.device.name, w.name, e.message
                    ))
                }
                Err(e) => return Err(e.into()),
            }
        }
    }
    status.skipped.extend(refused.iter().cloned());
    status.skipped_count = status.skipped.len() as u32;
    // Those whose device is gone: drained, then deleted.
    let mut draining = 0;
    for r in owned
        .iter()
        .filter(|r| !wanted.iter().any(|w| w.name == r.name_any()))
    {
        draining += 1;
        let drained = r.labels().contains_key(DRAINING_LABEL);
        if !drained {
            let body = drain_body(r, &set.spec.catalog);
            ctx.metrics.api_request("patch", "modelresidencies");
            residencies
                .patch(
                    &r.name_any(),
                    &PatchParams::apply(MANAGER).force(),
                    &Patch::Apply(&body),
                )
                .await?;
        } else if nothing_resident(r) {
            ctx.metrics.api_request("delete", "modelresidencies");
            match residencies
                .delete(&r.name_any(), &DeleteParams::default())
                .await
            {
                Ok(_) => {}
                Err(kube::Error::Api(s)) if s.code == 404 => {}
                Err(e) => return Err(e.into()),
            }
        }
    }

    count_owned(&mut status, &owned);
    let (ready, reason, message) = match (&failed_on, selected.is_empty(), draining) {
        (Some(e), true, _) => (false, "InvalidSelector", e.clone()),
        (_, true, _) => (
            false,
            "NoDevicesMatched",
            format!("no published device of DeviceClass {class_name} matches"),
        ),
        (_, false, n) if n > 0 => (
            false,
            "Draining",
            format!("{n} residency(ies) whose device left are draining"),
        ),
        _ if !refused.is_empty() => (
            false,
            "ResidencyRefused",
            format!(
                "{} device(s) cannot be stamped (see status.skipped): {}",
                refused.len(),
                refused[0]
            ),
        ),
        _ if status.residencies < wanted.len() as u32 => {
            (false, "Stamping", "residencies are being made".to_owned())
        }
        _ => (
            true,
            "AllDevicesStamped",
            format!(
                "{} device(s), {} skipped",
                status.devices, status.skipped_count
            ),
        ),
    };
    conditions.set(READY, ready, reason, message);
    status.conditions = conditions.finish();
    write_status(&ctx, &ns, &name, &previous, status).await?;
    // A draining residency is looked at again until it is gone (its status
    // changes wake the set too).
    Ok(if draining > 0 {
        Action::requeue(Duration::from_secs(2))
    } else {
        Action::await_change()
    })
}

/// The stamped residency's body: what the set owns of it.
fn stamped_body(
    set: &ResidencySet,
    w: &Wanted<'_>,
    owner: &k8s_openapi::apimachinery::pkg::apis::meta::v1::OwnerReference,
    class: &str,
) -> serde_json::Value {
    let s = &set.spec.residency;
    let mut gpu = s.gpu.clone().unwrap_or_default();
    let claim = gpu.mode == crate::api::GpuMode::Claim;
    if claim && gpu.device_class_name.is_none() && class != DEFAULT_CLASS {
        gpu.device_class_name = Some(class.to_owned());
    }
    let mut spec = json!({
        "nodeName": w.device.node,
        "device": w.device.spec_device().unwrap_or_else(|| w.device.name.clone()),
        "catalog": set.spec.catalog,
        "prefetch": s.prefetch,
        "eviction": s.eviction,
    });
    if gpu != GpuSpec::default() {
        spec["gpu"] = json!(gpu);
    }
    let fraction = s
        .budget_fraction
        .unwrap_or(crate::api::DEFAULT_BUDGET_FRACTION);
    match (&s.budget, claim, w.device.memory()) {
        (Some(b), _, _) => spec["budget"] = json!(b.0),
        (None, true, _) => spec["budgetFraction"] = json!(fraction),
        // The other modes cannot read the device: its published memory.
        (None, false, Some(m)) => {
            spec["budget"] = json!(format_bytes((m as f64 * fraction) as u64))
        }
        (None, false, None) => {}
    }
    if let Some(w) = &s.warm {
        spec["warm"] = json!(w);
    }
    if let Some(k) = &s.keep_alive {
        spec["keepAlive"] = json!(k);
    }
    json!({
        "apiVersion": ModelResidency::api_version(&()), "kind": "ModelResidency",
        "metadata": {
            "name": w.name,
            "labels": {SET_LABEL: set.name_any()},
            "annotations": {SET_DEVICE_ANNOTATION: format!("{}/{}", w.device.node, w.device.name)},
            "ownerReferences": [owner],
        },
        "spec": spec,
    })
}

/// Whether `r` differs from `desired` in what the set owns of it.
fn differs(r: &ModelResidency, desired: &serde_json::Value) -> bool {
    let have = serde_json::to_value(&r.spec).unwrap_or_default();
    // The desired spec as the type writes it (a default such as prefetch 0
    // left out, as in `have`): written as JSON it would differ from every
    // stored residency, and each reconcile would rewrite them all.
    let want = serde_json::from_value::<crate::api::ModelResidencySpec>(desired["spec"].clone())
        .ok()
        .and_then(|s| serde_json::to_value(s).ok())
        .unwrap_or_else(|| desired["spec"].clone());
    let keys = desired["spec"].as_object().into_iter().flatten();
    set_label(r) != desired["metadata"]["labels"][SET_LABEL].as_str()
        || r.labels().contains_key(DRAINING_LABEL)
        || keys.into_iter().any(|(k, _)| have.get(k) != want.get(k))
}

/// A stamped residency emptied for its drain: the same fields, its
/// catalog's model list none and its own models none.
fn drain_body(r: &ModelResidency, catalog: &CatalogRef) -> serde_json::Value {
    let mut spec = serde_json::to_value(&r.spec).unwrap_or_default();
    if let Some(o) = spec.as_object_mut() {
        o.remove("demand");
        o.insert("models".into(), json!([]));
        o.insert(
            "catalog".into(),
            json!({"name": catalog.name, "models": []}),
        );
    }
    json!({
        "apiVersion": ModelResidency::api_version(&()), "kind": "ModelResidency",
        "metadata": {
            "name": r.name_any(),
            "labels": {SET_LABEL: set_label(r), DRAINING_LABEL: "true"},
            "ownerReferences": r.owner_references(),
        },
        "spec": spec,
    })
}

/// Whether a draining residency holds nothing any more (its status has
/// caught up with the drain and no model is resident, loading or asleep).
fn nothing_resident(r: &ModelResidency) -> bool {
    let Some(s) = &r.status else {
        return true;
    };
    s.observed_generation == r.metadata.generation
        && s.resident == 0
        && s.loading == 0
        && s.sleeping == 0
        && s.fetching == 0
}

/// The owned residencies' counts and the GPUs of each model.
fn count_owned(status: &mut ResidencySetStatus, owned: &[&Arc<ModelResidency>]) {
    status.residencies = owned.len() as u32;
    let mut gpus: BTreeMap<String, u32> = BTreeMap::new();
    for r in owned {
        let s = crate::controller::cached::unpacked((*r).clone());
        let Some(st) = &s.status else {
            continue;
        };
        if st
            .conditions
            .iter()
            .any(|c| c.type_ == READY && c.status == "True")
        {
            status.ready += 1;
        }
        for m in &st.models {
            if m.is_resident() || m.state == ModelState::Sleeping {
                *gpus.entry(m.name.to_string()).or_default() += 1;
            }
        }
    }
    status.models = gpus
        .into_iter()
        .map(|(name, gpus)| crate::api::ModelGpus { name, gpus })
        .collect();
}

async fn write_status(
    ctx: &Context,
    ns: &str,
    name: &str,
    previous: &ResidencySetStatus,
    status: ResidencySetStatus,
) -> Result<(), Error> {
    if *previous == status {
        return Ok(());
    }
    let sets: Api<ResidencySet> = Api::namespaced(ctx.client.clone(), ns);
    ctx.metrics.api_request("patch", "residencysets");
    crate::cluster::apply_status(&sets, name, MANAGER, &status).await?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test(start_paused = true)]
    async fn a_steady_stream_of_changes_paces_the_set_and_never_starves_it() {
        // A change every 100 ms for 3 s (a debounce of 500 ms would never
        // fire): the set is reconciled once per beat, its duplicates merged.
        let changes = futures::stream::unfold(0u32, |n| async move {
            if n == 30 {
                return None;
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
            Some((ObjectRef::<ResidencySet>::new("fleet").within("ns"), n + 1))
        });
        let mut out = Box::pin(paced(changes, Duration::from_millis(500)));
        let t0 = tokio::time::Instant::now();
        let mut at = Vec::new();
        while let Ok(Some(set)) = tokio::time::timeout(Duration::from_secs(2), out.next()).await {
            assert_eq!(set.name, "fleet");
            assert_eq!(set.namespace.as_deref(), Some("ns"));
            at.push(t0.elapsed().as_millis());
        }
        assert_eq!(at, [500, 1000, 1500, 2000, 2500, 3000], "{at:?}");
    }

    #[test]
    fn a_stamped_residency_as_stored_does_not_differ_from_its_body() {
        let desired = json!({
            "metadata": {"labels": {SET_LABEL: "fleet"}},
            "spec": {"nodeName": "node-0", "device": "GPU-1", "catalog": {"name": "c"},
                     "prefetch": 0, "eviction": "lru", "budget": "12Gi", "gpu": {"mode": "env"}},
        });
        let stored: ModelResidency = serde_json::from_value(json!({
            "apiVersion": "residency.dev/v1alpha1", "kind": "ModelResidency",
            "metadata": {"name": "fleet-node-0-gpu-0", "labels": {SET_LABEL: "fleet"}},
            "spec": desired["spec"].clone(),
        }))
        .unwrap();
        // prefetch 0 and eviction lru are what the type leaves out.
        assert!(!differs(&stored, &desired));
        let mut bigger = desired.clone();
        bigger["spec"]["budget"] = json!("16Gi");
        assert!(differs(&stored, &bigger));
        let mut prefetching = desired.clone();
        prefetching["spec"]["prefetch"] = json!(2);
        assert!(differs(&stored, &prefetching));
    }
}
