//! The events a reconcile announces: one per model state transition, and
//! one when the spec turns invalid. Pure; the reconciler publishes them
//! after the status is written.

use crate::api::{ModelResidency, ModelState, ModelStatus};
use std::collections::HashMap;

/// An event's reason, which also fixes its type and action.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum EventReason {
    Loaded,
    Evicted,
    Unloaded,
    Refused,
    LoadFailed,
    InvalidSpec,
}

impl EventReason {
    pub fn as_str(self) -> &'static str {
        match self {
            EventReason::Loaded => "Loaded",
            EventReason::Evicted => "Evicted",
            EventReason::Unloaded => "Unloaded",
            EventReason::Refused => "Refused",
            EventReason::LoadFailed => "LoadFailed",
            EventReason::InvalidSpec => "InvalidSpec",
        }
    }

    /// What the operator was doing (the event's `action`).
    pub fn action(self) -> &'static str {
        match self {
            EventReason::Loaded | EventReason::LoadFailed => "Load",
            EventReason::Evicted => "Evict",
            EventReason::Unloaded => "Unload",
            EventReason::Refused => "Admit",
            EventReason::InvalidSpec => "Validate",
        }
    }

    /// Warnings are what someone should look at.
    pub fn is_warning(self) -> bool {
        matches!(
            self,
            EventReason::Refused | EventReason::LoadFailed | EventReason::InvalidSpec
        )
    }
}

/// An event to publish once the status is written.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ModelEvent {
    /// The model it is about; its pod becomes the event's related object,
    /// which also keeps events about different models from being merged
    /// into one series.
    pub model: Option<String>,
    pub reason: EventReason,
    pub message: String,
}

impl ModelEvent {
    pub fn about(model: &str, reason: EventReason, message: String) -> Self {
        ModelEvent {
            model: Some(model.to_owned()),
            reason,
            message,
        }
    }
}

/// One event per model state transition between two statuses.
pub fn transition_events(
    prev: &HashMap<&str, &ModelStatus>,
    models: &[ModelStatus],
    r: &ModelResidency,
) -> Vec<ModelEvent> {
    models
        .iter()
        .filter_map(|m| transition_event(prev.get(m.name.as_str()).copied(), m, r))
        .collect()
}

fn transition_event(
    before: Option<&ModelStatus>,
    m: &ModelStatus,
    r: &ModelResidency,
) -> Option<ModelEvent> {
    let was = before.map(|b| b.state);
    let was_resident = was.is_some_and(ModelState::is_resident);
    let reason = match m.state {
        ModelState::Loaded if was != Some(ModelState::Loaded) => {
            let message = format!(
                "{} loaded ({}) on node {} GPU {}",
                m.name,
                m.size.as_deref().unwrap_or("?"),
                r.spec.node_name,
                r.spec.device
            );
            return Some(ModelEvent::about(&m.name, EventReason::Loaded, message));
        }
        ModelState::Evicted if was_resident => EventReason::Evicted,
        ModelState::Unloaded if was_resident => EventReason::Unloaded,
        // A refusal of a newer request is a new refusal.
        ModelState::Refused
            if was != Some(ModelState::Refused)
                || before.and_then(|b| b.last_requested.as_ref()) != m.last_requested.as_ref() =>
        {
            EventReason::Refused
        }
        // Each failure in a row is its own event.
        ModelState::Failed
            if was != Some(ModelState::Failed)
                || before.is_some_and(|b| b.failures != m.failures) =>
        {
            EventReason::LoadFailed
        }
        _ => return None,
    };
    let message = m.message.clone().unwrap_or_default();
    Some(ModelEvent::about(&m.name, reason, message))
}
