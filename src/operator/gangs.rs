//! The gang coordinator: places each gang (a model of `gpus: N`) on N
//! residencies of one namespace and node, all or nothing, and keeps them
//! one (`crate::residency::gangs` says what it writes).
//!
//! One task under the operator's leadership decides every gang, one node
//! at a time, so two gangs never place themselves on the same room: a
//! gang's placement is written on its members before any of them admits
//! it, and the next plan counts it as theirs. A member's own reconcile
//! then admits the gang within its own budget (its own evictions), as a
//! request; the coordinator marks the placement `ready` once every member
//! holds it and its GPU's live pods leave room, and the head starts the
//! one pod. For each node with gangs, on each change of its residencies
//! and every second while something waits:
//!
//! - a gang requested (a demand key no member has processed) and placed
//!   nowhere is planned over the node's engines as their statuses leave
//!   them ([`NodeGpus`]: GPUs where it fits first, then the cheapest
//!   evictions by each GPU's policy; GPUs of one PCIe root where the
//!   driver publishes `resource.kubernetes.io/pcieRoot`): placed on the chosen GPUs (the
//!   placement and the request's time written on each), queued (room held
//!   by loads: nothing written, looked at again), or refused with each
//!   GPU's reason (written where it was asked for);
//! - a placed gang that any member let go (evicted, unloaded, its budget
//!   too small) is taken off every member (placement and demand key: each
//!   unloads it), so it leaves as one;
//! - a request for a placed gang on one member (the routers' recency ticks
//!   go to the head) is copied to the others: one recency;
//! - a gang a member put to sleep to make room sleeps on every member, and
//!   a request after that wakes it on every member ([`sleep_step`]).

use crate::api::{ModelResidency, ModelState};
use crate::controller::Context;
use crate::controller::cached;
use crate::controller::guarded::{Guarded, merge_unless_changed};
use crate::engine::gangs::{GangRefused, NodeAdmission, NodeGpus};
use crate::engine::{Engine, RefuseReason};
use crate::quantity::format_bytes;
use crate::residency::gangs::{
    GANG_REFUSED_ANNOTATION, GANGS_ANNOTATION, GangMember, GangPlacement, GangSleep, SleepPhase,
    placements, refusals, width,
};
use crate::residency::gpu::node_of;
use crate::residency::labels::MANAGER;
use crate::residency::reasons::Reason;
use crate::residency::state::{recorded_time, restore, validate};
use futures::StreamExt;
use kube::api::{Api, PatchParams};
use kube::runtime::reflector::{ObjectRef, Store};
use kube::{Resource, ResourceExt};
use serde_json::{Value, json};
use std::collections::{BTreeMap, BTreeSet};
use std::sync::Arc;
use std::time::Duration;

/// A namespace and a node: the residencies a gang may span.
type Group = (String, String);

/// How often a node where a gang waits is looked at again.
const RECHECK: Duration = Duration::from_secs(1);

/// Runs the coordinator until dropped: `changed` names every residency
/// whose object changed.
pub async fn run(
    ctx: Arc<Context>,
    store: Store<ModelResidency>,
    changed: Arc<
        tokio::sync::Mutex<futures::channel::mpsc::UnboundedReceiver<ObjectRef<ModelResidency>>>,
    >,
) {
    // Held for this run (a restart after a panic takes it up again).
    let mut changed = changed.lock().await;
    // The store's readiness wakes only its latest waiter (the
    // controller's), so poll for it.
    loop {
        let ready = tokio::time::timeout(Duration::from_millis(200), store.wait_until_ready());
        match ready.await {
            Ok(Ok(())) => break,
            // The store's writer is gone: the operator's term is ending
            // (idle until then; its supervisor would start it again).
            Ok(Err(_)) => return std::future::pending().await,
            Err(_) => {}
        }
    }
    ctx.pods.wait_ready().await;
    let mut waiting: BTreeSet<Group> = BTreeSet::new();
    let mut tick = tokio::time::interval(RECHECK);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        let mut dirty: BTreeSet<Group> = BTreeSet::new();
        tokio::select! {
            next = changed.next() => {
                // Closed: the residency watch ended with the term.
                let Some(first) = next else { return std::future::pending().await };
                let mut refs = vec![first];
                while let Ok(more) = changed.try_recv() {
                    refs.push(more);
                }
                for r in refs.iter().filter_map(|r| store.get(r)) {
                    if let Some(group) = gang_group(&ctx, &r) {
                        dirty.insert(group);
                    }
                }
            }
            _ = tick.tick() => dirty.extend(waiting.iter().cloned()),
        }
        for group in dirty {
            match pass(&ctx, &store, &group).await {
                Ok(true) => {
                    waiting.insert(group);
                }
                Ok(false) => {
                    waiting.remove(&group);
                }
                Err(e) => {
                    tracing::warn!(namespace = %group.0, node = %group.1, error = %e, "gang coordinator");
                    waiting.insert(group);
                }
            }
        }
    }
}

/// The group of `r` when it may take part in a gang: it declares one, or
/// carries a gang's placement or refusal.
fn gang_group(ctx: &Context, r: &ModelResidency) -> Option<Group> {
    let annotated = r.metadata.annotations.as_ref().is_some_and(|a| {
        a.contains_key(GANGS_ANNOTATION) || a.contains_key(GANG_REFUSED_ANNOTATION)
    });
    let declares = ctx
        .catalogs
        .with_models(r, |models| models.iter().any(|m| width(m) > 1))
        .unwrap_or(false);
    if !(annotated || declares) {
        return None;
    }
    Some((r.namespace()?, node_of(r)?.to_owned()))
}

/// One GPU of the node as the coordinator sees it.
struct Gpu {
    r: Arc<ModelResidency>,
    name: String,
    engine: Engine,
    /// The gangs it declares, with their width.
    gangs: BTreeMap<String, usize>,
    /// Its annotations as read: the gangs placed on it, those refused there.
    placed: BTreeMap<String, GangPlacement>,
    refused: BTreeMap<String, String>,
    /// Its device's PCIe root, where the driver publishes one (claim
    /// mode): a gang's members share one.
    group: Option<String>,
}

impl Gpu {
    fn status_of(&self, model: &str) -> Option<&crate::api::ModelStatus> {
        self.r.status.as_ref()?.model(model)
    }

    /// `model`'s state and reason in its status.
    fn state_of(&self, model: &str) -> Option<(ModelState, Option<&str>)> {
        self.status_of(model)
            .map(|m| (m.state, m.reason.as_deref()))
    }

    /// When its status last processed a request for `model`.
    fn processed(&self, model: &str) -> Option<k8s_openapi::jiff::Timestamp> {
        recorded_time(self.status_of(model)?.last_requested.as_deref())
    }

    /// Whether its status has processed a request for `model` at `at` or
    /// later.
    fn processed_since(&self, model: &str, at: Option<k8s_openapi::jiff::Timestamp>) -> bool {
        at.is_some_and(|at| self.processed(model).is_some_and(|t| t >= at))
    }

    fn demand(&self, model: &str) -> Option<(&str, k8s_openapi::jiff::Timestamp)> {
        let at = self.r.spec.demand.get(model)?;
        Some((at.as_str(), recorded_time(Some(at))?))
    }

    fn holds(&self, model: &str) -> bool {
        self.status_of(model).is_some_and(|m| m.state.is_resident())
    }

    fn member(&self) -> GangMember {
        let gpu = self.r.status.as_ref().and_then(|s| s.gpu.as_ref());
        GangMember {
            residency: self.name.clone(),
            uid: self.r.uid().unwrap_or_default(),
            device: gpu
                .and_then(|g| g.device.clone())
                .or_else(|| Some(self.r.spec.device.clone()).filter(|d| !d.is_empty())),
            claim: gpu.and_then(|g| g.claim.clone()),
        }
    }
}

/// What to write on one residency.
#[derive(Default)]
struct Write {
    gangs: Option<BTreeMap<String, GangPlacement>>,
    refused: Option<BTreeMap<String, String>>,
    demand: BTreeMap<String, Option<String>>,
}

impl Write {
    /// The gangs placed on `g` as this pass leaves them.
    fn gangs(&mut self, g: &Gpu) -> &mut BTreeMap<String, GangPlacement> {
        self.gangs.get_or_insert_with(|| g.placed.clone())
    }

    /// The gangs refused on `g` as this pass leaves them.
    fn refused(&mut self, g: &Gpu) -> &mut BTreeMap<String, String> {
        self.refused.get_or_insert_with(|| g.refused.clone())
    }
}

/// What to write on `g`.
fn write<'w>(writes: &'w mut BTreeMap<String, Write>, g: &Gpu) -> &'w mut Write {
    writes.entry(g.name.clone()).or_default()
}

/// `placement` of `model` written on every member in `members`.
fn place(
    writes: &mut BTreeMap<String, Write>,
    members: &[&Gpu],
    model: &str,
    placement: &GangPlacement,
) {
    for g in members {
        write(writes, g)
            .gangs(g)
            .insert(model.to_owned(), placement.clone());
    }
}

/// Counts `model` as admitted (and loading) in a plan's engine: a
/// placement's room is its members' from the moment it is written.
fn hold_room(engine: &mut Engine, model: &str) {
    if let Some(id) = engine.id(model) {
        let _ = engine.request(id);
        engine.set_loading(id, true);
    }
}

/// One pass over a node's residencies; `true` while a gang there waits
/// (queued, or placed and not every member ready).
async fn pass(
    ctx: &Context,
    store: &Store<ModelResidency>,
    group: &Group,
) -> Result<bool, kube::Error> {
    let gpus = node_gpus(ctx, store, group);
    let mut writes: BTreeMap<String, Write> = BTreeMap::new();
    let widths: BTreeMap<String, usize> = gpus
        .iter()
        .flat_map(|g| g.gangs.iter().map(|(m, w)| (m.clone(), *w)))
        .collect();
    let mut placed: BTreeMap<String, GangPlacement> = BTreeMap::new();
    for g in &gpus {
        for (model, p) in &g.placed {
            if p.head() == g.name || !placed.contains_key(model) {
                placed.insert(model.clone(), p.clone());
            }
        }
    }
    let mut waits = false;
    let mut plan_engines: Vec<Engine> = gpus.iter().map(|g| g.engine.clone()).collect();
    // Placements the members have not admitted yet hold their room in
    // every plan.
    for (model, p) in &placed {
        for (i, g) in gpus.iter().enumerate() {
            let admitted = plan_engines[i]
                .id(model)
                .is_some_and(|id| plan_engines[i].is_resident(id));
            if p.includes(&g.name) && !admitted {
                hold_room(&mut plan_engines[i], model);
            }
        }
    }
    // Each GPU's models' last use, so the evictions used longest ago are
    // the cheapest across GPUs in every plan of this pass.
    let last_uses: Vec<(usize, &str, u64)> = gpus
        .iter()
        .enumerate()
        .flat_map(|(i, g)| {
            g.r.status
                .iter()
                .flat_map(|s| s.models.iter())
                .filter_map(move |m| {
                    let t = recorded_time(m.last_used.as_deref())?;
                    Some((i, &*m.name, u64::try_from(t.as_nanosecond()).unwrap_or(0)))
                })
        })
        .collect();
    for model in widths.keys() {
        let newest = gpus
            .iter()
            .filter_map(|g| g.demand(model))
            .max_by_key(|(_, t)| *t);
        if let Some(p) = placed.get(model).cloned() {
            let at = recorded_time(Some(&p.at));
            let members: Vec<&Gpu> = gpus.iter().filter(|g| p.includes(&g.name)).collect();
            let let_go = members.len() < p.members.len()
                || members.iter().any(|g| {
                    let lost = g.status_of(model).and_then(|m| m.reason.as_deref())
                        == Some(Reason::GangPodLost.as_str());
                    lost || (g.processed_since(model, at) && !g.holds(model))
                });
            if let_go {
                tracing::info!(model, members = %p.names(), "a gang member let the gang go: taken off every member");
                for g in &gpus {
                    if p.includes(&g.name) || g.placed.contains_key(model) {
                        let w = write(&mut writes, g);
                        w.gangs(g).remove(model);
                        w.demand.insert(model.clone(), None);
                    }
                }
                continue;
            }
            // One recency: the newest request anywhere, on every member.
            if let Some((text, t)) = newest {
                for g in &members {
                    if g.demand(model).is_none_or(|(_, mine)| mine < t) {
                        let w = write(&mut writes, g);
                        w.demand.insert(model.clone(), Some(text.to_owned()));
                    }
                }
            }
            for g in gpus
                .iter()
                .filter(|g| !p.includes(&g.name) && g.demand(model).is_some())
            {
                let w = write(&mut writes, g);
                w.demand.insert(model.clone(), None);
            }
            let (step, sleep_waits) = sleep_step(ctx, &p, &members, model, newest);
            waits |= sleep_waits;
            if let Some(sleep) = step {
                tracing::info!(model, members = %p.names(), sleep = ?sleep, "gang sleep");
                let next = GangPlacement { sleep, ..p.clone() };
                place(&mut writes, &members, model, &next);
                continue;
            }
            if !p.ready {
                let admitted = members
                    .iter()
                    .all(|g| g.holds(model) && g.processed_since(model, at));
                if admitted && members.iter().all(|g| has_room(ctx, g, model)) {
                    let ready = GangPlacement {
                        ready: true,
                        ..p.clone()
                    };
                    place(&mut writes, &members, model, &ready);
                } else {
                    waits = true;
                }
            }
            continue;
        }
        // Not placed: a request nobody processed places it.
        let Some((text, _)) = newest else { continue };
        let requesters: Vec<&Gpu> = gpus
            .iter()
            .filter(|g| {
                g.demand(model)
                    .is_some_and(|(_, at)| g.processed(model).is_none_or(|done| done < at))
            })
            .collect();
        if requesters.is_empty() {
            continue;
        }
        let gangs = widths.iter().map(|(m, w)| (m.clone(), *w));
        let mut node = NodeGpus::new(plan_engines.clone(), gangs);
        if gpus.iter().any(|g| g.group.is_some()) {
            node.set_groups(gpus.iter().map(|g| g.group.clone()).collect());
        }
        for &(i, name, at) in &last_uses {
            node.used_at(i, name, at);
        }
        match node.request(0, model) {
            NodeAdmission::Loaded { gpus: chosen, .. }
            | NodeAdmission::Woken { gpus: chosen, .. } => {
                // The head: a requester when one was chosen (its pod name
                // is the residency the request went to), else the first.
                let mut order: Vec<usize> = chosen.clone();
                if let Some(pos) = order
                    .iter()
                    .position(|&i| requesters.iter().any(|r| r.name == gpus[i].name))
                {
                    let head = order.remove(pos);
                    order.insert(0, head);
                }
                let placement = GangPlacement {
                    members: order.iter().map(|&i| gpus[i].member()).collect(),
                    ready: false,
                    at: text.to_owned(),
                    sleep: None,
                };
                tracing::info!(model, members = %placement.names(), "gang placed");
                for &i in &order {
                    let g = &gpus[i];
                    let w = write(&mut writes, g);
                    w.gangs(g).insert(model.clone(), placement.clone());
                    w.demand.insert(model.clone(), Some(text.to_owned()));
                    // Its room is this gang's in the next plans of this pass.
                    hold_room(&mut plan_engines[i], model);
                }
                for g in &requesters {
                    if !placement.includes(&g.name) {
                        let w = write(&mut writes, g);
                        w.demand.insert(model.clone(), None);
                    }
                }
                for g in gpus.iter().filter(|g| g.refused.contains_key(model)) {
                    write(&mut writes, g).refused(g).remove(model);
                }
            }
            NodeAdmission::GangRefused(refused) => {
                let why = refusal(&gpus, &refused);
                for g in requesters
                    .iter()
                    .filter(|g| g.refused.get(model) != Some(&why))
                {
                    write(&mut writes, g)
                        .refused(g)
                        .insert(model.clone(), why.clone());
                }
            }
            NodeAdmission::Queued => waits = true,
            NodeAdmission::Hit { .. } | NodeAdmission::Refused(_) => {}
        }
    }
    let api: Api<ModelResidency> = Api::namespaced(ctx.client.clone(), &group.0);
    let params = PatchParams {
        field_manager: Some(MANAGER.into()),
        ..PatchParams::default()
    };
    // The members' writes at once: a gang's placement is N writes, and
    // each is a round trip its load would otherwise wait for in series.
    // Each is guarded: written only if what it changes is still as this
    // pass read it (a router's request meanwhile, or this coordinator's
    // own last write not yet in the cache, is never erased).
    let seen: BTreeMap<&str, &ModelResidency> = gpus
        .iter()
        .map(|g| (g.name.as_str(), g.r.as_ref()))
        .collect();
    let patches = writes.iter().filter_map(|(name, w)| {
        let seen = *seen.get(name.as_str())?;
        ctx.metrics.api_request("patch", "modelresidencies");
        let body = patch_body(w);
        let (api, params) = (&api, &params);
        Some(async move { merge_unless_changed(api, params, seen, &body).await })
    });
    let written = futures::future::try_join_all(patches).await?;
    // A stale write is decided again from the change that made it stale.
    let stale = written.iter().any(|w| matches!(w, Guarded::Stale));
    Ok(waits || stale)
}

/// Where a placed gang's sleep goes next (`Some`: the placement's new
/// `sleep`), and whether it waits on something this pass cannot see
/// change (a pod going away). A member that put the gang to sleep to make
/// room asks every member to (`asked`, after the newest request); the
/// head's pod confirming makes it `asleep` on every member; a newer
/// request, once every member has processed it and holds the gang awake
/// again with room for its full size, lets the head wake the pod
/// (`waking`); the head awake (woken, or its sleep cancelled before it was
/// sent) ends it.
fn sleep_step(
    ctx: &Context,
    p: &GangPlacement,
    members: &[&Gpu],
    model: &str,
    newest: Option<(&str, k8s_openapi::jiff::Timestamp)>,
) -> (Option<Option<GangSleep>>, bool) {
    let Some(head) = members.iter().find(|g| g.name == p.head()) else {
        return (None, false);
    };
    let Some(sleep) = &p.sleep else {
        let chosen = members.iter().any(|g| {
            g.state_of(model)
                .is_some_and(|(s, _)| s == ModelState::Sleeping)
        });
        if !(p.ready && chosen) {
            return (None, false);
        }
        let after = newest.map_or_else(|| p.at.clone(), |(text, _)| text.to_owned());
        let asked = GangSleep {
            phase: SleepPhase::Asked,
            after,
        };
        return (Some(Some(asked)), false);
    };
    let after = recorded_time(Some(&sleep.after));
    let woken_by = newest
        .map(|(_, t)| t)
        .filter(|t| after.is_none_or(|a| *t > a));
    let Some(request) = woken_by else {
        if sleep.phase == SleepPhase::Asked
            && head.state_of(model) == Some((ModelState::Sleeping, Some(Reason::Asleep.as_str())))
        {
            let asleep = GangSleep {
                phase: SleepPhase::Asleep,
                after: sleep.after.clone(),
            };
            return (Some(Some(asleep)), false);
        }
        return (None, sleep.phase == SleepPhase::Asked);
    };
    let awake_again = members.iter().all(|g| {
        g.processed_since(model, Some(request))
            && g.state_of(model)
                .is_some_and(|(s, _)| s.is_resident() && s != ModelState::Sleeping)
    });
    if !awake_again {
        return (None, true);
    }
    if head
        .state_of(model)
        .is_some_and(|(s, _)| s == ModelState::Loaded)
    {
        return (Some(None), false);
    }
    if sleep.phase == SleepPhase::Waking {
        return (None, true);
    }
    if members.iter().all(|g| has_room(ctx, g, model)) {
        let waking = GangSleep {
            phase: SleepPhase::Waking,
            after: sleep.after.clone(),
        };
        return (Some(Some(waking)), false);
    }
    (None, true)
}

/// The node's residencies in `group` that can take part: their registry
/// resolved, their spec valid, their engine as their status leaves it.
fn node_gpus(ctx: &Context, store: &Store<ModelResidency>, group: &Group) -> Vec<Gpu> {
    let mut gpus: Vec<Gpu> = store
        .state()
        .into_iter()
        .filter(|r| r.namespace().as_deref() == Some(group.0.as_str()))
        .filter(|r| node_of(r) == Some(group.1.as_str()))
        .filter(|r| r.meta().deletion_timestamp.is_none())
        .filter_map(|r| {
            let r = cached::unpacked(ctx.written.fresher(r));
            let r = ctx.catalogs.resolve(r).ok()?;
            let (engine, gangs) = {
                let valid = validate(&r).ok()?;
                let status = r.status.clone().unwrap_or_default();
                let engine = restore(&valid, &status).engine;
                let gangs = valid
                    .models
                    .iter()
                    .filter(|m| width(m.spec) > 1)
                    .map(|m| (m.name().to_owned(), width(m.spec)))
                    .collect();
                (engine, gangs)
            };
            let group = r
                .status
                .as_ref()
                .and_then(|s| s.gpu.as_ref())
                .and_then(|g| ctx.gpus.device_on(g.node.as_deref()?, g.device.as_deref()?))
                .and_then(|d| d.pcie_root);
            Some(Gpu {
                name: r.name_any(),
                placed: placements(&r),
                refused: refusals(&r),
                group,
                r,
                engine,
                gangs,
            })
        })
        .collect();
    gpus.sort_by(|a, b| a.name.cmp(&b.name));
    gpus
}

/// Whether `g`'s live pods (terminating ones too: they hold VRAM until
/// gone), other than the gang's own, leave room for `model` on its GPU.
fn has_room(ctx: &Context, g: &Gpu, model: &str) -> bool {
    let (Some(ns), Some(uid)) = (g.r.namespace(), g.r.uid()) else {
        return false;
    };
    let Some(id) = g.engine.id(model) else {
        return false;
    };
    let held: u64 = ctx
        .pods
        .owned(&ns, &g.name, &uid)
        .iter()
        .filter(|p| p.phase == crate::controller::pods::PodPhase::Live && *p.model != *model)
        .map(|p| p.size.unwrap_or(0))
        .sum();
    held + g.engine.size(id) <= g.engine.budget()
}

/// Why no `width` GPUs of the node could ever hold the gang, per GPU.
fn refusal(gpus: &[Gpu], refused: &GangRefused) -> String {
    let (width, could) = (refused.width, refused.could);
    let each: Vec<String> = refused
        .why
        .iter()
        .map(|(i, reason)| {
            let detail = match reason {
                RefuseReason::LargerThanBudget { size, budget } => format!(
                    "needs {} and its budget is {}",
                    format_bytes(*size),
                    format_bytes(*budget)
                ),
                RefuseReason::NoEvictableRoom {
                    size,
                    budget,
                    pinned,
                } => format!(
                    "needs {} beside {} pinned of {}",
                    format_bytes(*size),
                    format_bytes(*pinned),
                    format_bytes(*budget)
                ),
                RefuseReason::UnknownModel => "does not declare it".into(),
            };
            format!("{}: {} ({detail})", gpus[*i].name, reason.as_str())
        })
        .collect();
    let node = gpus
        .first()
        .and_then(|g| node_of(&g.r).map(str::to_owned))
        .unwrap_or_default();
    let mut message = if refused.grouped {
        format!(
            "needs {width} GPUs of one PCIe root of node {node} at once and at most {could} of one root could ever hold it"
        )
    } else {
        format!(
            "needs {width} GPUs of node {node} at once and {could} of its {} could ever hold it",
            gpus.len()
        )
    };
    if !each.is_empty() {
        message.push_str("; ");
        message.push_str(&each.join("; "));
    }
    message
}

/// One merge patch: the annotations and demand keys that change.
fn patch_body(w: &Write) -> Value {
    let text = |v: String| {
        if v == "{}" {
            Value::Null
        } else {
            Value::String(v)
        }
    };
    let mut annotations = serde_json::Map::new();
    if let Some(g) = &w.gangs {
        annotations.insert(
            GANGS_ANNOTATION.into(),
            text(serde_json::to_string(g).unwrap_or_default()),
        );
    }
    if let Some(r) = &w.refused {
        annotations.insert(
            GANG_REFUSED_ANNOTATION.into(),
            text(serde_json::to_string(r).unwrap_or_default()),
        );
    }
    let demand: serde_json::Map<String, Value> = w
        .demand
        .iter()
        .map(|(m, t)| (m.clone(), t.clone().map_or(Value::Null, Value::String)))
        .collect();
    let mut body = json!({});
    if !annotations.is_empty() {
        body["metadata"] = json!({ "annotations": annotations });
    }
    if !demand.is_empty() {
        body["spec"] = json!({ "demand": demand });
    }
    body
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_write_is_one_merge_patch_and_an_empty_map_removes_its_annotation() {
        let mut w = Write {
            gangs: Some(BTreeMap::new()),
            ..Write::default()
        };
        w.demand.insert("big".into(), None);
        w.demand
            .insert("tp".into(), Some("2026-12-06T00:00:00Z".into()));
        let mut refused = BTreeMap::new();
        refused.insert("huge".to_owned(), "why".to_owned());
        w.refused = Some(refused);
        assert_eq!(
            patch_body(&w),
            json!({
                "metadata": {"annotations": {
                    GANGS_ANNOTATION: null,
                    GANG_REFUSED_ANNOTATION: r#"{"huge":"why"}"#,
                }},
                "spec": {"demand": {"big": null, "tp": "2026-12-06T00:00:00Z"}}
            })
        );
    }

    #[test]
    fn a_refusal_names_each_gpu_and_its_reason() {
        let gpu = |name: &str, budget| {
            let r: ModelResidency = serde_json::from_value(json!({
                "apiVersion": "residency.dev/v1alpha1", "kind": "ModelResidency",
                "metadata": {"name": name, "namespace": "ns"},
                "spec": {"budget": "10Gi", "nodeName": "node-a", "device": "0", "models": []}
            }))
            .unwrap();
            Gpu {
                name: name.into(),
                r: Arc::new(r),
                engine: Engine::new(budget),
                gangs: BTreeMap::new(),
                placed: BTreeMap::new(),
                refused: BTreeMap::new(),
                group: None,
            }
        };
        let gpus = [gpu("g0", 10), gpu("g1", 10), gpu("g2", 10)];
        let why = [
            (
                0,
                RefuseReason::LargerThanBudget {
                    size: 1 << 34,
                    budget: 10 << 30,
                },
            ),
            (2, RefuseReason::UnknownModel),
        ];
        let refused = GangRefused {
            width: 2,
            could: 1,
            why: why.to_vec(),
            grouped: false,
        };
        assert_eq!(
            refusal(&gpus, &refused),
            "needs 2 GPUs of node node-a at once and 1 of its 3 could ever hold it; g0: LargerThanBudget (needs 16Gi and its budget is 10Gi); g2: UnknownModel (does not declare it)"
        );
    }
}
