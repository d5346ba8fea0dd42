//! Doing what the decide step said, in this order: delete pods (each by
//! its UID), create pods, write the status (only when it changed, with
//! the sleeps and wakes confirmed first, in a task of their own), publish
//! the events; every API request counted in the metrics.

use super::decide::{Decision, PodRef};
use super::templates::rejects_the_pod;
use super::{Context, Error, Result, describe, report_failure};
use super::{pod_calls, pods};
use crate::api::ModelResidency;
use crate::residency::labels::{MANAGER, MODEL_LABEL};
use k8s_openapi::api::core::v1::{ObjectReference, Pod};
use k8s_openapi::jiff::Timestamp;
use kube::api::{Api, DeleteParams, PostParams, Preconditions};
use kube::runtime::events::{Event, EventType, Recorder};
use kube::runtime::reflector::ObjectRef;
use kube::{Resource, ResourceExt};
use std::sync::Arc;

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
            // The previous pod of that name is still terminating; or a pod
            // this residency does not own holds the name, which no retry
            // will free: said in status, with the templates' backoff.
            Err(kube::Error::Api(s)) if s.code == 409 => match squatter(api, pod, ctx).await {
                Some(message) => {
                    let labels = pod.metadata.labels.as_ref();
                    let model = labels.and_then(|l| l.get(MODEL_LABEL)).cloned();
                    outcome.rejected.push((model.unwrap_or_default(), message));
                }
                None => outcome.retry_soon = true,
            },
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

/// Why `pod`'s name is taken for good, if it is: a live pod of that name
/// whose controller is not the residency that would own `pod` (made by
/// hand, by another tool, by a residency of the same name before it was
/// deleted and made again). The operator never deletes a pod it does not
/// own; it retried the create every 500 ms for ever, saying nothing.
async fn squatter(api: &Api<Pod>, pod: &Pod, ctx: &Context) -> Option<String> {
    let name = pod.metadata.name.as_deref()?;
    ctx.metrics.api_request("get", "pods");
    let there = api.get_opt(name).await.ok()??;
    if there.metadata.deletion_timestamp.is_some() {
        return None;
    }
    let owner = |p: &Pod| {
        p.metadata
            .owner_references
            .as_ref()?
            .iter()
            .find(|o| o.controller == Some(true))
            .map(|o| o.uid.clone())
    };
    (owner(&there) != owner(pod)).then(|| {
        format!(
            "a pod named {name} that this residency does not own is in the way (delete or rename it; the operator never deletes a pod it does not own)"
        )
    })
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
pub(super) enum Enacted {
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
pub(super) async fn enact(
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

/// What each model on the GPU holds, as its status says (one whose sleep
/// is confirmed: its registry entry's sleeping size), for the
/// `model_bytes` metric.
fn holdings(
    r: &ModelResidency,
    status: &crate::api::ModelResidencyStatus,
) -> Vec<crate::metrics::ModelHolding> {
    use crate::api::ModelState;
    status
        .models
        .iter()
        .filter(|m| m.is_resident())
        .filter_map(|m| {
            let size = crate::quantity::parse_bytes(m.size.as_deref()?).ok()?;
            // Falling asleep it still holds its whole size.
            let asleep = m.state == ModelState::Sleeping && m.reason.as_deref() == Some("Asleep");
            let bytes = if asleep {
                let spec = r.spec.models.iter().find(|s| *s.name == *m.name)?;
                crate::residency::warm::sleep_figures(&m.name, spec.sleep.as_deref()?, size)
                    .ok()?
                    .sleeping_size
            } else {
                size
            };
            Some(crate::metrics::ModelHolding {
                model: m.name.clone(),
                state: m.state.as_str(),
                bytes,
            })
        })
        .collect()
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
        ctx.metrics
            .observe_models(ns, &r.name_any(), holdings(r, &d.status));
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
