//! What the decide step yields: the status, the pods to create and
//! delete, the sleeps and wakes to ask, the events; and how the outcome of
//! what the API server and the pods did is written back into it.

use crate::api::{ModelResidencyStatus, ModelState};
use crate::controller::events::{EventReason, ModelEvent};
use crate::controller::pods::ModelPod;
use crate::quantity::{format_bytes_rounded, parse_bytes};
use crate::residency::reasons::Reason;
use crate::residency::state::Usage;
use k8s_openapi::api::core::v1::Pod;
use k8s_openapi::jiff::Timestamp;
use std::time::Duration;

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
            name: p.name.to_string(),
            uid: p.uid.to_string(),
        }
    }
}

/// A sleep or a wake to ask of a model's pod.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct PodCall {
    pub model: String,
    pub pod: PodRef,
    /// Where the pod serves (`None`: it has no IP, so the call fails).
    pub addr: Option<std::net::SocketAddr>,
    pub wake: bool,
    pub protocol: crate::residency::warm::Protocol,
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
    /// Sleeps and wakes to ask of pods, after the pod deletes and creates
    /// and before the status is written (their outcome changes it).
    pub calls: Vec<PodCall>,
    /// `None` when the spec is invalid and nothing was decided.
    pub usage: Option<Usage>,
}

impl Decision {
    /// The API server rejected the create of `model`'s pod (a template it
    /// accepted in the dry run, refused by the real create: a quota, an
    /// admission webhook). The status says so, whatever else was decided:
    /// the model's load failed (`Failed`, `InvalidTemplate`, no VRAM held)
    /// and a `LoadFailed` event is sent.
    pub fn pod_rejected(&mut self, model: &str, message: &str) {
        let Some(st) = self.status.model_mut(model) else {
            return;
        };
        let size = st.size.as_deref().and_then(|s| parse_bytes(s).ok());
        st.state = ModelState::Failed;
        st.reason = Some(Reason::InvalidTemplate.into());
        st.message =
            Some(format!("{model} cannot load: the API server rejects its pod: {message}").into());
        st.pod = None;
        st.adapters.clear();
        st.failures += 1;
        let event = ModelEvent::about(
            model,
            EventReason::LoadFailed,
            st.message.as_deref().unwrap_or_default().to_owned(),
        );
        self.events.push(event);
        self.status.recount();
        if let (Some(usage), Some(size)) = (&mut self.usage, size) {
            usage.used = usage.used.saturating_sub(size);
            usage.resident = self.status.resident;
            self.status.used = Some(format_bytes_rounded(usage.used));
        }
    }
}

impl Decision {
    /// What a sleep or wake request came to (`seconds`: how long it took;
    /// `at`: now), in the status and events. A failed one deletes the pod
    /// (the caller does) and is returned for that.
    pub fn call_done(
        &mut self,
        call: &PodCall,
        result: Result<(), String>,
        seconds: f64,
        at: Timestamp,
    ) -> Option<PodRef> {
        let model = call.model.as_str();
        let st = self.status.model_mut(model)?;
        let (reason, message, failed) = match (call.wake, result) {
            (false, Ok(())) => {
                st.reason = Some(Reason::Asleep.into());
                st.slept_at = Some(at.to_string().into());
                let m = format!("{model} sleeps (its server confirmed, {seconds:.2}s)");
                st.message = Some(m.clone().into());
                (EventReason::Slept, m, false)
            }
            (true, Ok(())) => {
                st.state = ModelState::Loaded;
                st.reason = None;
                st.message = None;
                st.loaded_at = Some(at.to_string().into());
                st.wake_seconds = Some(crate::residency::warm::moving_average(
                    st.wake_seconds,
                    seconds,
                ));
                let m = format!("{model} is awake ({seconds:.2}s)");
                (EventReason::Woken, m, false)
            }
            (false, Err(why)) => {
                let m = format!("{model} could not sleep ({why}): its pod is deleted instead");
                st.state = ModelState::Evicted;
                st.reason = Some(Reason::SleepFailed.into());
                st.message = Some(m.clone().into());
                st.pod = None;
                st.adapters.clear();
                st.slept_at = None;
                st.uses = 0;
                st.value_base = None;
                self.status.counters.evictions += 1;
                (EventReason::SleepFailed, m, true)
            }
            (true, Err(why)) => {
                let m =
                    format!("{model} could not wake ({why}): its pod is deleted and it loads cold");
                st.state = ModelState::Loading;
                st.reason = Some(Reason::WakeFailed.into());
                st.message = Some(m.clone().into());
                st.pod = None;
                st.adapters.clear();
                (EventReason::WakeFailed, m, true)
            }
        };
        // Counted with their Slept or Woken event, never taken back.
        let c = &mut self.status.counters;
        match (failed, call.wake) {
            (false, false) => c.sleeps += 1,
            (false, true) => c.wakes += 1,
            // It loads cold in a new pod (its WakeFailed event says so).
            (true, true) => c.loads += 1,
            (true, false) => {}
        }
        self.events.push(ModelEvent::about(model, reason, message));
        self.status.recount();
        failed.then(|| call.pod.clone())
    }
}
