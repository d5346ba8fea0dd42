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
    /// The GPU's device is tainted NoExecute: every model unloaded.
    GpuTainted,
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
    /// LoRA adapters a model pod's server holds now and did not when last
    /// asked (a router loaded them), and those it no longer holds (a
    /// router unloaded them to make room, or the server restarted).
    AdapterLoaded,
    AdapterUnloaded,
    /// A model loaded or woken ahead of demand: its forecast expects a
    /// request within its load time (`spec.anticipate`).
    Anticipated,
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
            EventReason::GpuTainted => "GpuTainted",
            EventReason::GpuUnavailable => "GpuUnavailable",
            EventReason::ClockSkew => "ClockSkew",
            EventReason::Slept => "Slept",
            EventReason::Woken => "Woken",
            EventReason::SleepFailed => "SleepFailed",
            EventReason::WakeFailed => "WakeFailed",
            EventReason::AdapterLoaded => "AdapterLoaded",
            EventReason::AdapterUnloaded => "AdapterUnloaded",
            EventReason::Anticipated => "Anticipated",
        }
    }

    /// What the operator was doing (the event's `action`).
    pub fn action(self) -> &'static str {
        match self {
            EventReason::Loaded | EventReason::LoadFailed | EventReason::Anticipated => "Load",
            EventReason::Evicted => "Evict",
            EventReason::Unloaded
            | EventReason::GpuConflict
            | EventReason::GpuUnavailable
            | EventReason::GpuTainted => "Unload",
            EventReason::Refused | EventReason::ClockSkew => "Admit",
            EventReason::Resized | EventReason::Moved | EventReason::TemplateChanged => "Replace",
            EventReason::InvalidSpec | EventReason::CatalogUnavailable => "Validate",
            EventReason::Slept | EventReason::SleepFailed => "Sleep",
            EventReason::Woken | EventReason::WakeFailed => "Wake",
            EventReason::AdapterLoaded => "LoadAdapter",
            EventReason::AdapterUnloaded => "UnloadAdapter",
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
        .flat_map(|m| {
            let before = prev.get(&*m.name).copied();
            transition_event(before, m)
                .into_iter()
                .chain(adapter_events(before, m))
        })
        .collect()
}

/// The adapters a Loaded model's pod holds now against what it held when
/// last asked: one event for those loaded since, one for those gone. The
/// audit asks every --sleep-audit-interval, so a load and unload between
/// two looks is in the routers' counters only.
fn adapter_events(before: Option<&ModelStatus>, m: &ModelStatus) -> Vec<ModelEvent> {
    let Some(before) = before else {
        return Vec::new();
    };
    let same_pod = before.pod.is_some() && before.pod == m.pod;
    if !same_pod || m.state != ModelState::Loaded || before.adapters == m.adapters {
        return Vec::new();
    }
    let pod = m.pod.as_deref().unwrap_or_default();
    // The names of `these` that `those` lacks, comma-separated.
    let missing = |these: &[Box<str>], those: &[Box<str>]| {
        let names: Vec<&str> = these
            .iter()
            .filter(|a| !those.contains(a))
            .map(|a| &**a)
            .collect();
        (!names.is_empty()).then(|| names.join(", "))
    };
    let mut out = Vec::new();
    if let Some(loaded) = missing(&m.adapters, &before.adapters) {
        let message = format!("pod {pod}'s server holds {loaded} now");
        out.push(ModelEvent::about(
            &m.name,
            EventReason::AdapterLoaded,
            message,
        ));
    }
    if let Some(gone) = missing(&before.adapters, &m.adapters) {
        let message = format!("pod {pod}'s server no longer holds {gone}");
        out.push(ModelEvent::about(
            &m.name,
            EventReason::AdapterUnloaded,
            message,
        ));
    }
    out
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

#[cfg(test)]
mod tests {
    use super::*;

    fn loaded(pod: &str, adapters: &[&str]) -> ModelStatus {
        ModelStatus {
            name: "tiny".into(),
            state: ModelState::Loaded,
            pod: Some(pod.into()),
            adapters: adapters.iter().map(|&a| a.into()).collect(),
            ..Default::default()
        }
    }

    #[test]
    fn adapters_a_pod_gained_or_lost_since_the_last_look_are_events() {
        let before = loaded("p1", &["a1", "a2"]);
        let events = adapter_events(Some(&before), &loaded("p1", &["a2", "a3", "a4"]));
        let said: Vec<(EventReason, &str)> = events
            .iter()
            .map(|e| (e.reason, e.message.as_str()))
            .collect();
        assert_eq!(
            said,
            [
                (
                    EventReason::AdapterLoaded,
                    "pod p1's server holds a3, a4 now"
                ),
                (
                    EventReason::AdapterUnloaded,
                    "pod p1's server no longer holds a1"
                ),
            ]
        );
        // Nothing changed, another pod (a new server starts empty: its
        // loads are announced from its first look), or not Loaded: none.
        assert!(adapter_events(Some(&before), &before).is_empty());
        assert!(adapter_events(Some(&before), &loaded("p2", &[])).is_empty());
        let mut asleep = loaded("p1", &[]);
        asleep.state = ModelState::Sleeping;
        assert!(adapter_events(Some(&before), &asleep).is_empty());
        assert!(adapter_events(None, &before).is_empty());
    }
}
