//! A load's first moments are held back from the status: waiting for
//! the evicted pods to go (the message counts what they still hold), its
//! pod created, then seen starting, within [`PROGRESS_HOLD`] of its
//! admission. When pods start fast the writes that say so are followed at
//! once by the one that says the model is Ready; held, they are one write.
//! A storm of 5,000 requests on 1,000 GPUs wrote 8,093 statuses with none
//! held; on 12-05's machine, where the API server took longer than 2 s to
//! start a pod under the storm, 7,082 with a 2 s hold, 6,643 with 5 s and
//! 6,487 with 10 s (history/4-scale.md). The
//! admission itself (counted, the routers' answer to wait), Ready (with its
//! event) and every other change are written at once; a held status is
//! written by the end of the hold, so `kubectl` is at most that far behind
//! a load's progress, and a load takes 30 s and more on real servers.

use super::Decision;
use crate::api::{ModelResidencyStatus, ModelState, ModelStatus};
use crate::residency::reasons::Reason;
use crate::residency::state::recorded_time;
use k8s_openapi::jiff::Timestamp;
use std::time::Duration;

/// How long after its admission a load's progress may go unwritten.
pub(super) const PROGRESS_HOLD: Duration = Duration::from_secs(10);

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
/// differs are loads admitted less than [`PROGRESS_HOLD`] ago moving on
/// through their pods' start (waiting for VRAM, a pod created, starting)
/// or waiting with less VRAM still held by the evicted pods.
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

/// What is left of the hold when `n` is `p` as far or further into its
/// pod's start and nothing else.
fn early_progress(p: &ModelStatus, n: &ModelStatus, now: Timestamp) -> Option<Duration> {
    let steps = start_step(p)
        .zip(start_step(n))
        .is_some_and(|(from, to)| from <= to);
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

/// Where a loading model is in its pod's start, in order; `None` for any
/// other state (an admission, Ready, a failure are never held).
fn start_step(m: &ModelStatus) -> Option<usize> {
    const STEPS: [Reason; 3] = [
        Reason::WaitingForVram,
        Reason::PodCreated,
        Reason::PodStarting,
    ];
    if m.state != ModelState::Loading {
        return None;
    }
    let reason = m.reason.as_deref()?;
    STEPS.iter().position(|r| r.as_str() == reason)
}
