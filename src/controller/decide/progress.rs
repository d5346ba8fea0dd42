//! A load's first moments are held back from the status: its pod created
//! once the evicted pods are gone, then seen starting, within
//! [`PROGRESS_HOLD`] of its admission. When pods start fast the write that
//! says so is followed at once by the one that says the model is Ready;
//! held, the two are one write (a storm of 5,000 requests on 1,000 GPUs
//! wrote 8,093 statuses, 1.6 a request). The admission itself (counted,
//! announced, the routers' answer to wait) and every other change are
//! written at once; a held status is written by the end of the hold, so
//! `kubectl` is at most that far behind a load that takes longer.

use super::Decision;
use crate::api::{ModelResidencyStatus, ModelState, ModelStatus};
use crate::residency::reasons::Reason;
use crate::residency::state::recorded_time;
use k8s_openapi::jiff::Timestamp;
use std::time::Duration;

/// How long after its admission a load's progress may go unwritten.
pub(super) const PROGRESS_HOLD: Duration = Duration::from_secs(2);

/// A decision whose only news is a load's first moments keeps the
/// previous status until they are over (the module docs), and looks again
/// then. Not with events (an event never announces what the status does
/// not show yet) or calls to make.
pub(super) fn hold_early_progress(
    d: &mut Decision,
    previous: &ModelResidencyStatus,
    now: Timestamp,
) {
    if !d.events.is_empty() || !d.calls.is_empty() {
        return;
    }
    if let Some(wait) = hold(previous, &d.status, now) {
        d.status = previous.clone();
        d.requeue_after = Some(d.requeue_after.map_or(wait, |r| r.min(wait)));
    }
}

/// How long `next` may wait unwritten in place of `prev`, if all that
/// differs are loads admitted less than [`PROGRESS_HOLD`] ago moving from
/// waiting for VRAM to a pod created, or from a pod created to starting.
pub(super) fn hold(
    prev: &ModelResidencyStatus,
    next: &ModelResidencyStatus,
    now: Timestamp,
) -> Option<Duration> {
    if prev.models.len() != next.models.len() {
        return None;
    }
    let mut wait: Option<Duration> = None;
    for (p, n) in prev.models.iter().zip(&next.models) {
        if p == n {
            continue;
        }
        let left = early_progress(p, n, now)?;
        wait = Some(wait.map_or(left, |w| w.min(left)));
    }
    let wait = wait?;
    // Nothing else may differ (counters, conditions, usage, generation).
    let rest_same = ModelResidencyStatus {
        models: Vec::new(),
        ..prev.clone()
    } == ModelResidencyStatus {
        models: Vec::new(),
        ..next.clone()
    };
    rest_same.then_some(wait)
}

/// What is left of the hold when `n` is `p` a step further into its pod's
/// start and nothing else.
fn early_progress(p: &ModelStatus, n: &ModelStatus, now: Timestamp) -> Option<Duration> {
    let is = |m: &ModelStatus, reasons: &[Reason]| {
        m.state == ModelState::Loading
            && reasons
                .iter()
                .any(|r| m.reason.as_deref() == Some(r.as_str()))
    };
    let steps = is(p, &[Reason::WaitingForVram, Reason::PodCreated])
        && is(n, &[Reason::PodCreated, Reason::PodStarting]);
    // The cheap test first: this runs for a changed model of every
    // decision, most of which are no such step.
    if !steps {
        return None;
    }
    let progress_only = ModelStatus {
        reason: n.reason.clone(),
        message: n.message.clone(),
        pod: n.pod.clone(),
        ..p.clone()
    } == *n;
    if !progress_only {
        return None;
    }
    // Admitted by this operator's clock; one ahead of it holds nothing.
    let admitted = recorded_time(n.admitted_at.as_deref())?;
    let since = admitted.duration_until(now);
    if since.is_negative() {
        return None;
    }
    PROGRESS_HOLD
        .checked_sub(since.unsigned_abs())
        .filter(|d| !d.is_zero())
}
