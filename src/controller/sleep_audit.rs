//! The sleep audit: a model server asleep while its status says it is
//! awake is found and woken. The operator alone sleeps and wakes model
//! servers, but their control endpoints are the servers' own: a sleep sent
//! to a pod behind the operator's back (a client through an older router,
//! anything on the pod network) left the model `Loaded` in status, its pod
//! Ready, and every request to it unanswered, with nothing to repair it.
//!
//! Every `--sleep-audit-interval` (leader only) each `Loaded` model whose
//! spec says how it sleeps, with a status request (vLLM's `GET
//! /is_sleeping`), is asked whether it sleeps; one that does is woken with
//! its own wake requests and a `FoundAsleep` warning event says so (and
//! `WakeFailed`'s reason when the wake did not work: its residency's next
//! request or reconcile sees a server that does not answer). A residency
//! whose sleeps and wakes are being made is left to them.

use super::Context;
use super::cached;
use super::decide::PodCall;
use super::pods::{ModelPod, pod_name};
use crate::api::{ModelResidency, ModelState};
use crate::residency::warm::{protocol, says_asleep};
use kube::ResourceExt;
use kube::runtime::events::EventType;
use kube::runtime::reflector::{ObjectRef, Store};
use std::collections::HashMap;
use std::sync::Arc;
use std::time::Duration;

/// How often Loaded models are asked whether they sleep (the default of
/// `--sleep-audit-interval`).
pub const DEFAULT_INTERVAL: Duration = Duration::from_secs(30);

/// Runs until the task is dropped; `every` zero: never.
pub async fn run(ctx: Arc<Context>, store: Store<ModelResidency>, every: Duration) {
    if every.is_zero() {
        return;
    }
    let mut ticks = tokio::time::interval(every);
    ticks.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        ticks.tick().await;
        // One look at the pods for both audits.
        let pods = ready_pods(&ctx);
        audit(&ctx, &store, &pods).await;
        super::adapter_audit::audit(&ctx, &store, &pods).await;
    }
}

/// The Ready, live model pods by (namespace, pod name).
pub(super) type ReadyPods = HashMap<(String, String), ModelPod>;

fn ready_pods(ctx: &Context) -> ReadyPods {
    let mut pods = HashMap::new();
    ctx.pods.each(|ns, _, pod| {
        if pod.ready_since.is_some() && !pod.deleting {
            pods.insert((ns.to_owned(), pod.name.to_string()), pod.clone());
        }
    });
    pods
}

/// One round over every residency in the cache.
async fn audit(ctx: &Context, store: &Store<ModelResidency>, pods: &ReadyPods) {
    for r in store.state() {
        let key = ObjectRef::from_obj(&*r);
        if ctx.asking.busy(&key) {
            continue;
        }
        // Most residencies have no model that sleeps: those are passed by
        // in place, not copied (resolved, unpacked) every round.
        let sleeps = ctx
            .catalogs
            .with_models(&r, |models| models.iter().any(|m| m.sleep.is_some()));
        if sleeps != Ok(true) {
            continue;
        }
        let r = cached::unpacked(r);
        let Ok(r) = ctx.catalogs.resolve(r) else {
            continue;
        };
        let ns = r.namespace().unwrap_or_default();
        for m in &r.spec.models {
            let Some(spec) = m.sleep.as_deref() else {
                continue;
            };
            if r.model_state(&m.name) != ModelState::Loaded {
                continue;
            }
            let Some(pod) = pods.get(&(ns.clone(), pod_name(&r.name_any(), &m.name))) else {
                continue;
            };
            let call = PodCall {
                model: m.name.clone(),
                pod: pod.into(),
                addr: pod.addr,
                wake: true,
                protocol: protocol(spec),
            };
            if asleep(&call, ctx.pod_call_timeout_max).await {
                wake(ctx, &r, call).await;
            }
        }
    }
}

/// Whether the server says it sleeps (no status request, no address, or
/// no clear answer: not known to, so left alone).
async fn asleep(call: &PodCall, limit: Duration) -> bool {
    let (Some(addr), Some((status, field))) = (call.addr, &call.protocol.status) else {
        return false;
    };
    let within = status.timeout.clamp(Duration::from_millis(1), limit);
    let answer = tokio::time::timeout(
        within,
        crate::http::send_capped(
            addr,
            &status.method,
            &status.path,
            &status.body,
            super::pod_calls::ANSWER_LIMIT,
        ),
    )
    .await;
    match answer {
        Ok(Ok(a)) if status.worked(a.status) => says_asleep(&a.body, field) == Some(true),
        _ => false,
    }
}

/// Wakes a server found asleep, and says so.
async fn wake(ctx: &Context, r: &ModelResidency, call: PodCall) {
    let (result, seconds) = super::pod_calls::ask(&call, ctx.pod_call_timeout_max).await;
    let model = &call.model;
    let note = match &result {
        Ok(()) => format!(
            "{model}'s server was asleep while its status said Loaded (its sleep endpoint was called outside the operator): woken in {seconds:.1}s"
        ),
        Err(why) => format!(
            "{model}'s server was asleep while its status said Loaded (its sleep endpoint was called outside the operator), and waking it failed: {why}"
        ),
    };
    tracing::warn!(residency = %r.name_any(), %model, ok = result.is_ok(), "{note}");
    ctx.metrics.found_asleep.inc();
    super::publish_event(ctx, r, EventType::Warning, "FoundAsleep", "Wake", note).await;
}
