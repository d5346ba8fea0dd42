//! Requests: the demand keys not processed yet, applied oldest first
//! (request times from a clock that runs fast taken as now), and the idle
//! unload that follows them; a loading model is protected from eviction
//! for [`LOADING_PROTECTION`] after it was admitted, and a model just
//! Ready from the queued requests for [`FRESH_LOAD_GRACE`].

use super::{Decider, FRESH_LOAD_GRACE, LOADING_PROTECTION};
use crate::api::ModelState;
use crate::controller::events::EventReason;
use crate::engine::{Admission, ModelId};
use crate::quantity::format_bytes;
use crate::residency::reasons::Reason;
use crate::residency::state::{later, recorded_time};
use k8s_openapi::jiff::Timestamp;
use std::time::Duration;

impl<'a> Decider<'a> {
    /// Demand entries not processed yet, oldest first. A time too far
    /// ahead of the operator's clock is taken as now (and said so).
    pub(super) fn apply_requests(&mut self) {
        let now = self.input.now;
        let horizon = later(now, self.input.max_skew);
        let mut pending: Vec<(Timestamp, &'a str, Timestamp)> = Vec::new();
        for request in &self.valid.demand {
            if self.is_processed(request.model, request.at, horizon) {
                continue;
            }
            let effective = if request.at > horizon {
                now
            } else {
                request.at
            };
            pending.push((effective, request.model, request.at));
        }
        pending.sort();
        let fresh = self.fresh_loads();
        for (effective, model, written) in pending {
            // Only a request that was queued already waits out the fresh
            // models' grace: it waited behind loads whose own held requests
            // are on their way to them. Any other request evicts by the
            // seed's LRU, as the engine does.
            let was_queued = self
                .prev_models
                .get(model)
                .is_some_and(|m| m.state == ModelState::Queued);
            for &id in &fresh {
                self.engine.set_loading(id, was_queued);
            }
            if effective != written {
                let message = format!(
                    "{model}: lastRequested {written} is {:.0}s ahead of the operator's clock (allowed: {}s); taken as {now}",
                    now.duration_until(written).as_secs_f64(),
                    self.input.max_skew.as_secs()
                );
                self.event(model, EventReason::ClockSkew, message);
            }
            self.request(model, written, effective);
        }
        for id in fresh {
            self.engine.set_loading(id, false);
        }
    }

    /// Whether the demand entry `at` for `model` was processed already: its
    /// time is not newer than the last one processed. A recorded time ahead
    /// of `horizon` (written by a clock that ran fast) orders nothing: any
    /// other entry is then new. A request refused because the model was not
    /// in the registry is pending again once it is, and one that failed for
    /// its template once the template makes a pod.
    fn is_processed(&self, model: &str, at: Timestamp, horizon: Timestamp) -> bool {
        let Some(prev) = self.prev_models.get(model) else {
            return false;
        };
        let reason = prev.reason.as_deref();
        if reason == Some(Reason::UnknownModel.as_str()) && self.engine.id(model).is_some() {
            return false;
        }
        if reason == Some(Reason::InvalidTemplate.as_str())
            && prev.state == ModelState::Failed
            && !prev.is_resident()
            && self.engine.id(model).is_some()
            && self.template_problem(model).is_none()
        {
            return false;
        }
        match recorded_time(prev.last_requested.as_deref()) {
            None => false,
            Some(w) if w > horizon => at == w,
            Some(w) => at <= w,
        }
    }

    /// Resident models not requested for their keepAlive are unloaded
    /// (pinned ones never); the earliest expiry still to come is when to
    /// look again (no polling).
    pub(super) fn unload_idle(&mut self) {
        let now = self.input.now;
        for id in self.engine.residents() {
            let name = self.engine.name(id).to_owned();
            let Some(m) = self.by_name.get(name.as_str()).copied() else {
                continue;
            };
            let keep_alive = match m.keep_alive {
                Some(k) if !k.is_zero() && !m.spec.pinned => k,
                _ => continue,
            };
            let last_used = self
                .requested
                .get(&name)
                .and_then(|t| t.last_used.as_deref())
                .or_else(|| self.prev_models.get(name.as_str())?.last_used.as_deref());
            // One brought in ahead of demand is idle from then on.
            let brought = self
                .anticipated
                .get(&name)
                .and_then(|t| recorded_time(Some(t)));
            let Some(last_used) = recorded_time(last_used).max(brought) else {
                continue;
            };
            let expiry = later(last_used, keep_alive);
            if expiry > now {
                let after = now.duration_until(expiry).unsigned_abs();
                self.idle_requeue = Some(self.idle_requeue.map_or(after, |r| r.min(after)));
                continue;
            }
            if self.expected_soon(&name) {
                // Its forecast expects it back within the horizon: an
                // unload now would be a load then.
                continue;
            }
            self.engine.unload(id);
            let message = format!(
                "{name} unloaded: not requested for {}s (keepAlive)",
                keep_alive.as_secs()
            );
            self.event(&name, EventReason::Unloaded, message.clone());
            self.outcome(&name, ModelState::Unloaded, Reason::Idle, message);
        }
    }

    /// One request: `written` is the entry's time (recorded, so the entry is
    /// processed once), `at` the time it counts as (the LRU key). A request
    /// the engine queues is not recorded: it stays pending and is decided
    /// again, in request order, by the next reconcile.
    fn request(&mut self, model: &str, written: Timestamp, at: Timestamp) {
        let Some(id) = self.engine.id(model) else {
            self.processed(model, written);
            self.engine.request_named(model);
            let message = format!("{model} is not in spec.models; demand for it is refused");
            self.event(model, EventReason::Refused, message.clone());
            self.outcome(model, ModelState::Refused, Reason::UnknownModel, message);
            return;
        };
        if self.width(model) > 1 && self.gang_here(model).is_none() {
            // A gang loads only where the coordinator placed it: on N GPUs
            // that all make room at once.
            if let Some(why) = self.gang_refusals.get(model).cloned() {
                self.processed(model, written);
                let message = format!("{model} is refused: {why}");
                // Counted and announced once per refusal, not once per
                // request written while it stands (the routers' requests
                // for it were 20 a second once).
                let known = self.previous.model(model).is_some_and(|m| {
                    m.state == ModelState::Refused && m.message.as_deref() == Some(&message)
                });
                if !known {
                    self.engine.count_refusal();
                    self.event(model, EventReason::Refused, message.clone());
                }
                self.outcome(model, ModelState::Refused, Reason::GangRefused, message);
            } else if !self.engine.is_resident(id) {
                let message = format!(
                    "{model} needs {} GPUs of one node at once: it waits for the operator to place it on GPUs that can all make room",
                    self.width(model)
                );
                self.outcome(model, ModelState::Queued, Reason::GangPlacing, message);
            }
            return;
        }
        if self.refused_for_health(model, id) {
            self.processed(model, written);
            return;
        }
        if !self.engine.is_resident(id)
            && let Some(problem) = self.template_problem(model)
        {
            // Checked before the engine sees the request, so nothing is
            // evicted for a model that cannot start.
            self.processed(model, written);
            let message = format!("{model} cannot load: {problem}");
            self.outcome(model, ModelState::Failed, Reason::InvalidTemplate, message);
            return;
        }
        let used = match self.engine.request(id) {
            Admission::Hit => true,
            Admission::Loaded { evicted } => {
                let evicted = evicted.to_vec();
                if self.gang_here(model).is_some_and(|g| g.head() != self.me()) {
                    self.gang_loads_elsewhere += 1;
                }
                self.load_admitted(model);
                self.admitted(id, &evicted);
                true
            }
            Admission::Woken { evicted } => {
                let evicted = evicted.to_vec();
                if !self.was_asleep(model) {
                    self.cancelled_sleeps += 1;
                }
                self.admitted(id, &evicted);
                true
            }
            Admission::Queued { loading } => {
                let message = format!(
                    "{model} ({}) waits for a model to finish loading: the room it needs is held by models still loading or Ready for less than {}s ({}), which no request evicts",
                    format_bytes(self.engine.size(id)),
                    FRESH_LOAD_GRACE.as_secs(),
                    format_bytes(loading)
                );
                self.outcome(model, ModelState::Queued, Reason::WaitingForLoads, message);
                return;
            }
            Admission::Refused(reason) => {
                self.refused(model, &reason);
                false
            }
        };
        self.processed(model, written);
        if used {
            let times = self.requested.entry(model.to_owned()).or_default();
            times.last_used = Some(at.to_string().into());
        }
    }

    /// A counted load of `model`, announced once its pod is Ready or it
    /// leaves the GPU first ([`Self::announce_loads`]). A load of it still
    /// unannounced was made in this reconcile and ended in it.
    pub(super) fn load_admitted(&mut self, model: &str) {
        let now: Box<str> = self.input.now.to_string().into();
        if self.unannounced.insert(model.to_owned(), now).is_some() {
            let why = self.outcomes.get(model).map(|o| o.message.as_str());
            let message = gone_before_ready(model, why.unwrap_or("unloaded"));
            self.event(model, EventReason::Loaded, message);
        }
    }

    /// A load or a wake of `id` admitted, after evicting `evicted` (and
    /// putting the engine's last slept models to sleep).
    pub(super) fn admitted(
        &mut self,
        id: crate::engine::ModelId,
        evicted: &[crate::engine::ModelId],
    ) {
        let model = self.engine.name(id).to_owned();
        // Its pod is not ready (or awake) yet: no later request evicts it.
        self.engine.set_loading(id, true);
        self.outcomes.remove(&model);
        let why = format!("to make room for {model}");
        self.evicted(evicted, Reason::MadeRoom, &why);
        self.slept(&model);
    }

    /// The models the last request put to sleep to make room for `model`.
    fn slept(&mut self, model: &str) {
        for v in self.engine.last_slept().to_vec() {
            let name = self.engine.name(v).to_owned();
            let message = format!("{name} goes to sleep to make room for {model}");
            self.outcome(&name, ModelState::Sleeping, Reason::FallingAsleep, message);
        }
    }

    /// Records `written` as the newest request processed for `model`.
    fn processed(&mut self, model: &str, written: Timestamp) {
        let times = self.requested.entry(model.to_owned()).or_default();
        times.last_requested = Some(written.to_string().into());
    }

    /// When the loading model `id` was admitted, as far as is known: its
    /// last use, or its pod's creation when that is later (a request that
    /// waited in the queue is admitted after its own time).
    pub(super) fn admitted_at(&self, id: ModelId) -> Option<Timestamp> {
        let name = self.engine.name(id);
        let now = self
            .requested
            .get(name)
            .and_then(|t| t.last_used.as_deref());
        let before = || self.prev_models.get(name)?.last_used.as_deref();
        let used = recorded_time(now.or_else(before));
        let created = self
            .input
            .pods
            .iter()
            .filter(|p| &*p.model == name && !p.deleting)
            .filter_map(|p| recorded_time(p.created.as_deref()))
            .max();
        used.max(created)
    }

    /// Loading models admitted longer than [`LOADING_PROTECTION`] ago (or
    /// at no recorded time) may be evicted again.
    pub(super) fn end_old_protections(&mut self) {
        let now = self.input.now;
        for id in self.engine.residents() {
            if !self.engine.is_loading(id) {
                continue;
            }
            let expired = self
                .admitted_at(id)
                .is_none_or(|t| later(t, LOADING_PROTECTION) <= now);
            if expired {
                self.engine.set_loading(id, false);
            }
        }
    }

    /// Loading models whose pod the pod cache shows Ready already (the
    /// status has not caught up): loaded, not loading, so no request is
    /// queued behind them. A queued request still waits out their fresh
    /// grace, counted from the pod's Ready time.
    pub(super) fn end_ready_loads(&mut self) {
        for id in self.engine.residents() {
            if self.engine.is_loading(id) && self.starting_pod_ready(id).is_some() {
                self.engine.set_loading(id, false);
            }
        }
    }

    /// When the pod of `id`, a model the last status left waiting for its
    /// pod to start (not a wake, a fetch or a replacement), turned Ready.
    fn starting_pod_ready(&self, id: ModelId) -> Option<&'a str> {
        let name = self.engine.name(id);
        let prev = self.prev_models.get(name)?;
        let starting = [Reason::PodCreated, Reason::PodStarting]
            .iter()
            .any(|r| prev.reason.as_deref() == Some(r.as_str()));
        if prev.state != ModelState::Loading || !starting {
            return None;
        }
        let size = self.engine.size(id);
        let input: &'a super::Observed<'a> = self.input;
        input
            .pods
            .iter()
            .filter(|p| &*p.model == name && !p.deleting && p.size.is_none_or(|s| s == size))
            .find_map(|p| p.ready_since.as_deref())
    }

    /// How long until the first loading or fresh model's protection ends
    /// (when a queued request may evict it).
    pub(super) fn next_protection_end(&self) -> Option<Duration> {
        let now = self.input.now;
        let ends = self.engine.residents().into_iter().filter_map(|id| {
            if self.engine.is_loading(id) {
                self.admitted_at(id).map(|t| later(t, LOADING_PROTECTION))
            } else {
                self.fresh_until(id)
            }
        });
        ends.map(|t| now.duration_until(t).unsigned_abs()).min()
    }

    /// The ready models Ready for less than [`FRESH_LOAD_GRACE`] (as the
    /// last status says, or their pod since).
    fn fresh_loads(&self) -> Vec<ModelId> {
        let residents = self.engine.residents().into_iter();
        residents
            .filter(|&id| !self.engine.is_loading(id) && self.fresh_until(id).is_some())
            .collect()
    }

    /// When the grace of a model Ready (as the last status says) ends, if it
    /// has not. A Ready time ahead of the operator's clock by more than the
    /// grace (a node whose clock runs fast) gives none: a clock cannot hold
    /// a model's room.
    fn fresh_until(&self, id: ModelId) -> Option<Timestamp> {
        let now = self.input.now;
        let prev = self.prev_models.get(self.engine.name(id))?;
        if self.engine.is_asleep(id) {
            return None;
        }
        let ready = if prev.state == ModelState::Loaded {
            prev.loaded_at.as_deref()
        } else {
            self.starting_pod_ready(id)
        };
        let ready = recorded_time(ready)?;
        let until = later(ready, FRESH_LOAD_GRACE);
        (until > now && ready <= later(now, FRESH_LOAD_GRACE)).then_some(until)
    }
}

/// A load's announcement when it ended before its pod was Ready.
pub(super) fn gone_before_ready(model: &str, why: &str) -> String {
    format!("{model} loaded, and gone before its pod was Ready: {why}")
}
