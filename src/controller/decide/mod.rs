//! The decide step: a pure function from what the reconciler observed (the
//! spec, the previous status, the owned pods, the time) to what it should do
//! (pods to create and delete, the new status, events to publish).
//!
//! The engine is rebuilt from the previous status (residents restored in
//! LRU order, counters carried over), then fed, in this order:
//! 1. registry removals (unload), 2. size changes (re-admission),
//! 3. the budget (a shrink evicts), 4. removed demand entries (unload),
//! 5. demand entries newer than the model's last processed request, in
//!    `lastRequested` order (ties by model name).
//!
//! Pods follow the engine: a non-resident model's pod is deleted; a
//! resident model without a live pod gets one only when the declared sizes
//! of all live pods (terminating ones included, since they still hold VRAM)
//! leave room for it. Nothing here does I/O, so a reconcile with nothing new
//! yields the previous status unchanged and no actions.

use super::conditions::{ConditionSet, DEGRADED, READY, REFUSED};
use super::events::{EventReason, ModelEvent};
use super::pods::ModelPod;
use super::reasons::Reason;
use super::state::{InvalidSpec, Restored, Usage, Valid, recorded_time, restore, validate};
use crate::api::{ModelResidency, ModelResidencyStatus, ModelState, ModelStatus};
use crate::engine::{Admission, Engine, ModelId, RefuseReason, Resize};
use crate::quantity::format_bytes;
use k8s_openapi::api::core::v1::Pod;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::OwnerReference;
use k8s_openapi::jiff::Timestamp;
use std::collections::{HashMap, HashSet};
use std::time::Duration;

mod settle;

/// Everything the decision depends on.
pub struct Observed<'a> {
    pub residency: &'a ModelResidency,
    pub owner: OwnerReference,
    pub pods: &'a [ModelPod],
    pub now: Timestamp,
}

/// A pod to delete: its name, and the UID it must still have (a newer pod
/// of the same name is not this one).
#[derive(Clone, Debug, PartialEq, Eq, PartialOrd, Ord)]
pub struct PodRef {
    pub name: String,
    pub uid: String,
}

impl From<&ModelPod> for PodRef {
    fn from(p: &ModelPod) -> Self {
        PodRef {
            name: p.name.clone(),
            uid: p.uid.clone(),
        }
    }
}

/// What to do.
#[derive(Debug)]
pub struct Decision {
    pub status: ModelResidencyStatus,
    pub create: Vec<Pod>,
    pub delete: Vec<PodRef>,
    pub events: Vec<ModelEvent>,
    /// When to look again even if nothing changes (a retry falls due).
    pub requeue_after: Option<Duration>,
    /// Seconds from pod creation to Ready of the models that became Loaded.
    pub load_seconds: Vec<f64>,
    /// `None` when the spec is invalid and nothing was decided.
    pub usage: Option<Usage>,
}

/// Decides what to do about one residency.
pub fn decide(input: &Observed<'_>) -> Decision {
    let empty = ModelResidencyStatus::default();
    let previous = input.residency.status.as_ref().unwrap_or(&empty);
    match validate(input.residency) {
        Ok(valid) => Decider::new(input, previous, valid).run(),
        Err(problem) => invalid(input, previous, &problem),
    }
}

/// An invalid spec: touch no pods, say why, wait for a change.
fn invalid(
    input: &Observed<'_>,
    previous: &ModelResidencyStatus,
    problem: &InvalidSpec,
) -> Decision {
    const REASON: EventReason = EventReason::InvalidSpec;
    let problem = problem.to_string();
    let generation = input.residency.metadata.generation;
    let mut set = ConditionSet::new(&previous.conditions, generation, input.now);
    set.set(READY, false, REASON.as_str(), problem.clone());
    set.keep(REFUSED);
    set.keep(DEGRADED);
    let mut status = previous.clone();
    status.observed_generation = generation;
    status.conditions = set.finish();
    let changed = previous
        .conditions
        .iter()
        .all(|c| c.reason != REASON.as_str() || c.message != problem);
    let event = ModelEvent {
        model: None,
        reason: REASON,
        message: problem,
    };
    Decision {
        status,
        create: Vec::new(),
        delete: Vec::new(),
        events: changed.then_some(event).into_iter().collect(),
        requeue_after: None,
        load_seconds: Vec::new(),
        usage: None,
    }
}

/// What happened to a model in this reconcile, before pods are considered.
struct Outcome {
    state: ModelState,
    reason: Reason,
    message: String,
}

/// A model's request times after this reconcile (RFC 3339, as in status).
#[derive(Clone, Debug, Default)]
struct RequestTimes {
    /// The newest request processed.
    last_requested: Option<String>,
    /// The newest request that hit or loaded it: its LRU key.
    last_used: Option<String>,
}

struct Decider<'a> {
    input: &'a Observed<'a>,
    previous: &'a ModelResidencyStatus,
    prev_models: HashMap<&'a str, &'a ModelStatus>,
    valid: Valid<'a>,
    engine: Engine,
    /// Resident models that left the registry, still to be unloaded.
    removed: Vec<String>,
    outcomes: HashMap<String, Outcome>,
    requested: HashMap<String, RequestTimes>,
    events: Vec<ModelEvent>,
}

impl<'a> Decider<'a> {
    fn new(input: &'a Observed<'a>, previous: &'a ModelResidencyStatus, valid: Valid<'a>) -> Self {
        let prev_models = previous
            .models
            .iter()
            .map(|m| (m.name.as_str(), m))
            .collect();
        let Restored {
            engine,
            removed,
            overflow,
        } = restore(&valid, previous);
        let mut decider = Decider {
            input,
            previous,
            prev_models,
            valid,
            engine,
            removed,
            outcomes: HashMap::new(),
            requested: HashMap::new(),
            events: Vec::new(),
        };
        for name in overflow {
            let message =
                format!("{name} did not fit the recorded budget when the state was rebuilt");
            decider.outcome(&name, ModelState::Evicted, Reason::BudgetExceeded, message);
        }
        decider
    }

    fn run(mut self) -> Decision {
        self.unload_removed();
        self.readmit_resized();
        self.apply_budget();
        self.unload_undemanded();
        self.apply_requests();
        self.settle()
    }

    fn outcome(&mut self, model: &str, state: ModelState, reason: Reason, message: String) {
        let outcome = Outcome {
            state,
            reason,
            message,
        };
        self.outcomes.insert(model.to_owned(), outcome);
    }

    fn evicted(&mut self, victims: &[ModelId], reason: Reason, why: &str) {
        for &v in victims {
            let name = self.engine.name(v).to_owned();
            let message = format!("{name} was evicted {why}");
            self.outcome(&name, ModelState::Evicted, reason, message);
        }
    }

    /// Registry removals unload.
    fn unload_removed(&mut self) {
        for name in std::mem::take(&mut self.removed) {
            let id = self.engine.id(&name).expect("registered in restore");
            if !self.engine.deregister(id) {
                continue;
            }
            let message = format!("{name} was removed from spec.models and unloaded");
            // A still-demanded model keeps a status entry, whose transition
            // makes the event; otherwise say it here.
            if !self.valid.is_demanded(&name) {
                let event = ModelEvent::about(&name, EventReason::Unloaded, message.clone());
                self.events.push(event);
            }
            self.outcome(
                &name,
                ModelState::Unloaded,
                Reason::RemovedFromRegistry,
                message,
            );
        }
    }

    /// Size changes re-admit the model under the same rules.
    fn readmit_resized(&mut self) {
        for i in 0..self.valid.models.len() {
            let m = self.valid.models[i];
            let id = self.engine.id(m.name()).expect("registered");
            let old = self.engine.size(id);
            if old == m.size {
                continue;
            }
            let evicted = match self.engine.resize(id, m.size).expect("positive size") {
                Resize::NotResident => continue,
                Resize::Kept { evicted } => evicted.to_vec(),
                Resize::Dropped(reason) => {
                    let message = refusal_message(m.name(), &reason);
                    self.outcome(m.name(), ModelState::Refused, (&reason).into(), message);
                    continue;
                }
            };
            let why = format!(
                "to make room for {}, which grew from {} to {}",
                m.name(),
                format_bytes(old),
                format_bytes(m.size)
            );
            self.evicted(&evicted, Reason::MadeRoom, &why);
        }
    }

    /// A budget shrink evicts least recently used residents.
    fn apply_budget(&mut self) {
        let budget = self.valid.budget;
        let victims = self.engine.set_budget(budget).to_vec();
        let why = format!("because the budget shrank to {}", format_bytes(budget));
        self.evicted(&victims, Reason::BudgetShrunk, &why);
    }

    /// Removed demand entries unload.
    fn unload_undemanded(&mut self) {
        let demanded: HashSet<&str> = self.valid.demand.iter().map(|r| r.model).collect();
        for id in self.engine.residents() {
            let name = self.engine.name(id).to_owned();
            if !demanded.contains(name.as_str()) {
                self.engine.unload(id);
                let message = format!("{name} unloaded: its demand entry was removed");
                self.outcome(&name, ModelState::Unloaded, Reason::DemandRemoved, message);
            }
        }
    }

    /// Demand entries newer than the model's last processed request, oldest
    /// first.
    fn apply_requests(&mut self) {
        for i in 0..self.valid.demand.len() {
            let request = self.valid.demand[i];
            let watermark = self
                .prev_models
                .get(request.model)
                .and_then(|m| recorded_time(m.last_requested.as_deref()));
            if watermark.is_none_or(|w| request.at > w) {
                self.request(request.model, request.at);
            }
        }
    }

    fn request(&mut self, model: &str, at: Timestamp) {
        let when = at.to_string();
        let Some(id) = self.engine.id(model) else {
            self.engine.request_named(model);
            let times = RequestTimes {
                last_requested: Some(when),
                last_used: None,
            };
            self.requested.insert(model.to_owned(), times);
            let message = format!("{model} is not in spec.models; demand for it is refused");
            self.outcome(model, ModelState::Refused, Reason::UnknownModel, message);
            return;
        };
        let used = match self.engine.request(id) {
            Admission::Hit => true,
            Admission::Loaded { evicted } => {
                let evicted = evicted.to_vec();
                self.outcomes.remove(model);
                self.evicted(
                    &evicted,
                    Reason::MadeRoom,
                    &format!("to make room for {model}"),
                );
                true
            }
            Admission::Refused(reason) => {
                let message = refusal_message(model, &reason);
                self.outcome(model, ModelState::Refused, (&reason).into(), message);
                false
            }
        };
        let times = self.requested.entry(model.to_owned()).or_default();
        times.last_requested = Some(when.clone());
        if used {
            times.last_used = Some(when);
        }
    }
}

fn refusal_message(model: &str, reason: &RefuseReason) -> String {
    match *reason {
        RefuseReason::LargerThanBudget { size, budget } => format!(
            "{model} needs {}, budget is {}",
            format_bytes(size),
            format_bytes(budget)
        ),
        RefuseReason::NoEvictableRoom {
            size,
            budget,
            pinned,
        } => format!(
            "{model} needs {}, budget is {} and pinned models hold {}",
            format_bytes(size),
            format_bytes(budget),
            format_bytes(pinned)
        ),
        RefuseReason::UnknownModel => format!("{model} is not in spec.models"),
    }
}

#[cfg(test)]
mod tests;
