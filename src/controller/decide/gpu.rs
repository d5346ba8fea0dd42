//! Whether the GPU is this residency's: where its pods go, and what it
//! does when another residency (or an unallocated claim) withholds it.

use super::Decider;
use crate::api::ModelState;
use crate::controller::events::{EventReason, ModelEvent};
use crate::residency::conditions::{ConditionSet, GPU_HEALTHY};
use crate::residency::gpu::{GpuView, Placement};
use crate::residency::health::{GpuHealth, HOLD_OFF, Held};
use crate::residency::reasons::Reason;
use crate::residency::state::later;
use std::time::Duration;

impl<'a> Decider<'a> {
    /// The GPU the pods are for, when it is this residency's.
    pub(super) fn placement(&self) -> Option<&'a Placement> {
        match &self.input.gpu {
            GpuView::Placed(p) => Some(p),
            GpuView::Withheld(_) => None,
        }
    }

    /// Where the models are, for messages: "node a GPU 0".
    pub(super) fn where_(&self) -> String {
        match self.placement() {
            Some(p) => format!("node {} GPU {}", p.node, p.device),
            None => format!("GPU {}", self.input.residency.spec.device),
        }
    }

    /// Why this residency may not use the GPU now, if it may not: another
    /// residency holds it (devicePlugin and env mode), or in claim mode the
    /// claim is not (yet) allocated to it.
    pub(super) fn withheld(&self) -> Option<(Reason, String)> {
        if let Some(holder) = self.input.gpu_holder {
            let message = format!(
                "{} is held by the older residency {holder}; this one loads nothing until it is released",
                self.where_()
            );
            return Some((Reason::GpuConflict, message));
        }
        match &self.input.gpu {
            GpuView::Withheld(w) => return Some((w.reason, w.message.clone())),
            GpuView::Placed(_) => {}
        }
        match &self.input.health {
            GpuHealth::Gone(why) => Some((
                Reason::GpuTainted,
                format!(
                    "{}: {why}; its models are unloaded and it loads nothing until the taint goes",
                    self.where_()
                ),
            )),
            _ => None,
        }
    }

    /// Whether the GPU takes new models now ([`effective_health`]).
    pub(super) fn health(&self) -> &GpuHealth {
        &self.health.0
    }

    /// The GpuHealthy condition (listed once the GPU was unhealthy), and
    /// when the hold-off ends.
    pub(super) fn health_condition(&self, set: &mut ConditionSet<'_>) -> Option<Duration> {
        let (health, recheck) = &self.health;
        let listed = self
            .previous
            .conditions
            .iter()
            .find(|c| c.type_ == GPU_HEALTHY);
        match (health, listed) {
            (GpuHealth::Healthy, Some(last)) => {
                let went = last.last_transition_time.0;
                let message = format!("its device's taint went at {went}");
                set.set(GPU_HEALTHY, true, "TaintRemoved", message);
            }
            (GpuHealth::Healthy, None) => {}
            (GpuHealth::NoNewModels(Held::HeldOff, why), _) => {
                set.set(GPU_HEALTHY, true, "HeldOff", why.clone());
            }
            (h, _) => set.set(GPU_HEALTHY, false, h.reason(), h.message().to_owned()),
        }
        *recheck
    }

    /// A request for a model that is not resident awake on a GPU that
    /// takes no new models: refused here (a router places it on another
    /// GPU that lists it), not counted as a refusal. `false`: it may load.
    pub(super) fn refused_for_health(&mut self, model: &str, id: crate::engine::ModelId) -> bool {
        if self.engine.is_resident(id) && !self.engine.is_asleep(id) {
            return false;
        }
        let GpuHealth::NoNewModels(_, why) = self.health() else {
            return false;
        };
        let message = format!(
            "{model} is not loaded on {}: {why}; a router loads it on another GPU that lists it",
            self.where_()
        );
        self.outcome(model, ModelState::Refused, Reason::GpuTainted, message);
        true
    }

    /// The GPU is not this residency's: unload every resident model and
    /// leave requests for when it is.
    pub(super) fn yield_gpu(&mut self, reason: Reason, message: String) {
        let same = self
            .previous
            .conditions
            .iter()
            .any(|c| c.reason == reason.as_str() && c.message == message);
        if !same {
            self.events.push(ModelEvent {
                model: None,
                reason: match reason {
                    Reason::GpuConflict => EventReason::GpuConflict,
                    Reason::GpuTainted => EventReason::GpuTainted,
                    _ => EventReason::GpuUnavailable,
                },
                message: message.clone(),
            });
        }
        for id in self.engine.residents() {
            let name = self.engine.name(id).to_owned();
            self.engine.unload(id);
            let why = format!("{name} unloaded: {message}");
            self.event(&name, EventReason::Unloaded, why.clone());
            self.outcome(&name, ModelState::Unloaded, reason, why);
        }
    }
}

/// Whether the GPU takes new models now: not while it is unhealthy, nor
/// for [`HOLD_OFF`] after it was (a GPU whose taint toggles takes nothing
/// new until it is stable); and when to look again. Decided once per
/// reconcile.
pub(super) fn effective_health(
    input: &super::Observed<'_>,
    previous: &crate::api::ModelResidencyStatus,
) -> (GpuHealth, Option<Duration>) {
    if input.health != GpuHealth::Healthy {
        return (input.health.clone(), None);
    }
    let now = input.now;
    let last = previous.conditions.iter().find(|c| c.type_ == GPU_HEALTHY);
    let went = match last {
        None => return (GpuHealth::Healthy, None),
        Some(c) if c.status == "False" => now,
        Some(c) => c.last_transition_time.0,
    };
    let until = later(went, HOLD_OFF);
    if until <= now {
        return (GpuHealth::Healthy, None);
    }
    let why = format!(
        "its device's taint went at {went}; new models wait until {until}, so a GPU whose taint toggles takes nothing new"
    );
    let after = now.duration_until(until).unsigned_abs();
    (GpuHealth::NoNewModels(Held::HeldOff, why), Some(after))
}
