//! Whether the GPU is this residency's: where its pods go, and what it
//! does when another residency (or an unallocated claim) withholds it.

use super::Decider;
use crate::api::ModelState;
use crate::controller::events::{EventReason, ModelEvent};
use crate::residency::gpu::{GpuView, Placement};
use crate::residency::reasons::Reason;

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
            GpuView::Withheld(w) => Some((w.reason, w.message.clone())),
            GpuView::Placed(_) => None,
        }
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
                reason: if reason == Reason::GpuConflict {
                    EventReason::GpuConflict
                } else {
                    EventReason::GpuUnavailable
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
