//! The events a reconcile announces: one per model state transition, and
//! one when the spec turns invalid. Pure; the reconciler publishes them
//! after the status is written.

use crate::api::{ModelState, ModelStatus};
use std::collections::HashMap;

/// An event's reason, which also fixes its type and action.
///
/// Each counted operation has exactly one event: `Loaded` when the load's
/// pod is Ready (or when the model leaves the GPU before that: the message
/// says so), `Evicted`, `Unloaded` and `Refused` when they are decided. The
/// others announce what is not counted.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum EventReason {
    Loaded,
    Evicted,
    Unloaded,
    Refused,
    LoadFailed,
    Resized,
    Moved,
    TemplateChanged,
    InvalidSpec,
    /// The ModelCatalog a residency names is not there, or lacks a model
    /// it lists: nothing is acted on until it is.
    CatalogUnavailable,
    GpuConflict,
    /// claim mode: the GPU is not this residency's (yet); the message says
    /// why (the status's Ready reason names it).
    GpuUnavailable,
    ClockSkew,
    /// The warm tier: a model's server confirmed its sleep, or its wake;
    /// or one of them failed (its pod is deleted).
    Slept,
    Woken,
    SleepFailed,
    WakeFailed,
}

impl EventReason {
    pub fn as_str(self) -> &'static str {
        match self {
            EventReason::Loaded => "Loaded",
            EventReason::Evicted => "Evicted",
            EventReason::Unloaded => "Unloaded",
            EventReason::Refused => "Refused",
            EventReason::LoadFailed => "LoadFailed",
            EventReason::Resized => "Resized",
            EventReason::Moved => "Moved",
            EventReason::TemplateChanged => "TemplateChanged",
            EventReason::InvalidSpec => "InvalidSpec",
            EventReason::CatalogUnavailable => "CatalogUnavailable",
            EventReason::GpuConflict => "GpuConflict",
            EventReason::GpuUnavailable => "GpuUnavailable",
            EventReason::ClockSkew => "ClockSkew",
            EventReason::Slept => "Slept",
            EventReason::Woken => "Woken",
            EventReason::SleepFailed => "SleepFailed",
            EventReason::WakeFailed => "WakeFailed",
        }
    }

    /// What the operator was doing (the event's `action`).
    pub fn action(self) -> &'static str {
        match self {
            EventReason::Loaded | EventReason::LoadFailed => "Load",
            EventReason::Evicted => "Evict",
            EventReason::Unloaded | EventReason::GpuConflict | EventReason::GpuUnavailable => {
                "Unload"
            }
            EventReason::Refused | EventReason::ClockSkew => "Admit",
            EventReason::Resized | EventReason::Moved | EventReason::TemplateChanged => "Replace",
            EventReason::InvalidSpec | EventReason::CatalogUnavailable => "Validate",
            EventReason::Slept | EventReason::SleepFailed => "Sleep",
            EventReason::Woken | EventReason::WakeFailed => "Wake",
        }
    }

    /// Warnings are what someone should look at.
    pub fn is_warning(self) -> bool {
        matches!(
            self,
            EventReason::Refused
                | EventReason::LoadFailed
                | EventReason::InvalidSpec
                | EventReason::CatalogUnavailable
                | EventReason::GpuConflict
                | EventReason::GpuUnavailable
                | EventReason::ClockSkew
                | EventReason::SleepFailed
                | EventReason::WakeFailed
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

/// Events of transitions between two statuses (the counted operations
/// announce themselves, see [`EventReason`]): each failed load. A request
/// queued behind loads has none: its model's status says `Queued` while it
/// waits, and the `Loaded` event of its load says how long it waited (an
/// event per wait was a third of a storm's events).
pub fn transition_events(
    prev: &HashMap<&str, &ModelStatus>,
    models: &[ModelStatus],
) -> Vec<ModelEvent> {
    models
        .iter()
        .filter_map(|m| transition_event(prev.get(&*m.name).copied(), m))
        .collect()
}

fn transition_event(before: Option<&ModelStatus>, m: &ModelStatus) -> Option<ModelEvent> {
    // Each failure in a row is its own event.
    let failed_again = m.state == ModelState::Failed
        && before.is_none_or(|b| b.state != ModelState::Failed || b.failures != m.failures);
    failed_again.then(|| {
        let message = m.message.as_deref().unwrap_or_default().to_owned();
        ModelEvent::about(&m.name, EventReason::LoadFailed, message)
    })
}
