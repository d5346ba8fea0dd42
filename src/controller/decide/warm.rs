//! The warm tier's side of settling: a model chosen to sleep is asked to
//! once the routers have stopped sending to it, and is then kept at its
//! sleeping size; a sleeping model a request wakes is asked to wake once
//! its full size fits; a model whose host memory asleep is more than the
//! host budget is named in the `CannotSleep` condition.

use super::inventory::{PodInventory, PodPlan};
use super::{Decider, PodCall};
use crate::api::{ModelState, ModelStatus};
use crate::controller::events::EventReason;
use crate::controller::pods::{ModelPod, PodPhase};
use crate::engine::Bytes;
use crate::quantity::format_bytes;
use crate::residency::reasons::Reason;
use crate::residency::state::{later, recorded_time};
use k8s_openapi::jiff::Timestamp;
use std::collections::HashMap;
use std::time::Duration;

/// How long after a model is chosen to sleep its sleep request is sent:
/// time for the routers to see it is no longer Loaded (they stop sending it
/// requests) before its server stops answering them.
pub(super) const SLEEP_DRAIN: Duration = Duration::from_secs(1);

/// Whether a model's status says its server sleeps: its sleep confirmed
/// (`Sleeping`/`Asleep`), or requested and not woken yet (`Loading`/
/// `Waking`). Not while it falls asleep: it still holds its full size.
pub(super) fn server_asleep(m: &ModelStatus) -> bool {
    let reason = m.reason.as_deref();
    (m.state == ModelState::Sleeping && reason == Some(Reason::Asleep.as_str()))
        || (m.state == ModelState::Loading && reason == Some(Reason::Waking.as_str()))
}

impl<'a> Decider<'a> {
    /// The pods whose server sleeps by the previous status (confirmed
    /// asleep, or asleep and waiting to be woken), with what each keeps.
    pub(super) fn confirmed_asleep(&self) -> HashMap<&'a str, Bytes> {
        let mut asleep = HashMap::new();
        for (&name, &prev) in &self.prev_models {
            let kept = self
                .engine
                .id(name)
                .and_then(|id| self.engine.sleep_of(id))
                .map(|s| s.sleeping_size);
            if let (true, Some(pod), Some(kept)) = (server_asleep(prev), prev.pod.as_deref(), kept)
            {
                asleep.insert(pod, kept);
            }
        }
        asleep
    }

    /// Whether the previous status had `name`'s server asleep (confirmed,
    /// or waiting to be woken).
    pub(super) fn was_asleep(&self, name: &str) -> bool {
        self.prev_models.get(name).is_some_and(|p| server_asleep(p))
    }

    /// When `name` was chosen to sleep: its previous status's, or now.
    pub(super) fn fell_asleep_at(&self, name: &str) -> Timestamp {
        self.prev_models
            .get(name)
            .filter(|p| p.state == ModelState::Sleeping)
            .and_then(|p| recorded_time(p.slept_at.as_deref()))
            .unwrap_or(self.input.now)
    }

    /// A resident model that sleeps: chosen now or before, its sleep asked
    /// once the drain is over; confirmed, it keeps its sleeping size.
    pub(super) fn asleep_status(
        &self,
        mut st: ModelStatus,
        pods: &mut PodInventory<'_>,
        plan: &mut PodPlan,
    ) -> ModelStatus {
        let prev = self.prev_models.get(&*st.name).copied();
        st.state = ModelState::Sleeping;
        st.failures = self.previous_failures(&st.name);
        let Some(pod) = pods.live(&st.name) else {
            // Dropped before the decision when its pod is gone.
            return st;
        };
        st.pod = Some(pod.name.clone());
        if self.was_asleep(&st.name) {
            st.reason = Some(Reason::Asleep.into());
            st.slept_at = prev.and_then(|p| p.slept_at.clone());
            st.message = prev.and_then(|p| p.message.clone());
            return st;
        }
        let since = self.fell_asleep_at(&st.name);
        st.reason = Some(Reason::FallingAsleep.into());
        st.slept_at = Some(since.to_string().into());
        st.message = Some(
            self.outcomes
                .get(&*st.name)
                .map(|o| o.message.clone())
                .or_else(|| prev.and_then(|p| p.message.as_deref().map(str::to_owned)))
                .unwrap_or_else(|| format!("{} goes to sleep", st.name))
                .into(),
        );
        let waited = since.duration_until(self.input.now).unsigned_abs();
        if waited < SLEEP_DRAIN {
            plan.look_again_within(SLEEP_DRAIN - waited);
            return st;
        }
        let id = self.engine.id(&st.name).expect("registered");
        let host = self.engine.sleep_of(id).map_or(0, |s| s.host_memory);
        if pods.host_held + host > self.valid.host_budget {
            // Sleeping pods being deleted still hold theirs.
            st.message = Some(
                format!(
                    "{} waits for deleted sleeping pods to release host memory before it sleeps ({} held, needs {}, host budget {})",
                    st.name,
                    format_bytes(pods.host_held),
                    format_bytes(host),
                    format_bytes(self.valid.host_budget)
                )
                .into(),
            );
            plan.look_again_within(Duration::from_millis(500));
            return st;
        }
        pods.host_held += host;
        if let Some(call) = self.call(&st.name, pod, false) {
            plan.calls.push(call);
        }
        st
    }

    /// A model woken by a request whose pod still sleeps: its wake is asked
    /// once the room its full size needs is free.
    pub(super) fn waking_status(
        &self,
        mut st: ModelStatus,
        pod: &ModelPod,
        size: Bytes,
        pods: &mut PodInventory<'_>,
        plan: &mut PodPlan,
    ) -> ModelStatus {
        let id = self.engine.id(&st.name).expect("registered");
        let kept = self.engine.sleep_of(id).map_or(0, |s| s.sleeping_size);
        st.state = ModelState::Loading;
        st.reason = Some(Reason::Waking.into());
        st.pod = Some(pod.name.clone());
        st.failures = self.previous_failures(&st.name);
        let budget = self.valid.budget;
        let awake = pods.live_declared.saturating_sub(kept) + size;
        if awake > budget {
            st.message = Some(
                format!(
                    "{} waits for evicted pods to release VRAM before it wakes ({} held by live pods, needs {} more)",
                    st.name,
                    format_bytes(pods.live_declared),
                    format_bytes(size.saturating_sub(kept))
                )
                .into(),
            );
            return st;
        }
        pods.live_declared = awake;
        st.message = Some(format!("{} wakes", st.name).into());
        if let Some(call) = self.call(&st.name, pod, true) {
            plan.calls.push(call);
        }
        st
    }

    /// The models whose host memory asleep is more than the whole host
    /// budget, named with it: they are deleted whenever they would sleep.
    pub(super) fn cannot_sleep(&self) -> Option<String> {
        self.input.residency.spec.warm.as_ref()?;
        let budget = self.valid.host_budget;
        let never: Vec<String> = self
            .valid
            .models
            .iter()
            .filter_map(|m| {
                let host = m.sleep?.host_memory;
                (host > budget).then(|| format!("{} ({})", m.name(), format_bytes(host)))
            })
            .collect();
        (!never.is_empty()).then(|| {
            format!(
                "host memory asleep is more than spec.warm.hostBudget {}, so these are deleted instead of put to sleep: {}; raise the budget, or give them level 2",
                format_bytes(budget),
                never.join(", ")
            )
        })
    }

    /// The sleep or wake request for `model`'s pod.
    pub(super) fn call(&self, model: &str, pod: &ModelPod, wake: bool) -> Option<PodCall> {
        let spec = self.by_name.get(model)?.spec.sleep.as_deref()?;
        Some(PodCall {
            model: model.to_owned(),
            pod: pod.into(),
            addr: pod.addr,
            wake,
            protocol: crate::residency::warm::protocol(spec),
        })
    }

    /// A sleeping model whose pod is gone, finished, terminating, or Ready
    /// again since its sleep (it restarted awake) is not resident.
    pub(super) fn drop_lost_sleepers(&mut self) {
        for id in self.engine.residents() {
            if !self.engine.is_asleep(id) {
                continue;
            }
            let name = self.engine.name(id).to_owned();
            let slept_at = self
                .prev_models
                .get(name.as_str())
                .and_then(|p| recorded_time(p.slept_at.as_deref()));
            let pod = self
                .input
                .pods
                .iter()
                .find(|p| *p.model == *name && p.phase == PodPhase::Live && !p.deleting);
            // Pod times are whole seconds: Ready more than a second after
            // the sleep is a restart.
            let restarted = |ready: Timestamp| {
                slept_at.is_some_and(|s| ready > later(s, Duration::from_secs(1)))
            };
            let kept = pod.is_some_and(|p| {
                recorded_time(p.ready_since.as_deref()).is_some_and(|ready| !restarted(ready))
            });
            if kept {
                continue;
            }
            self.engine.unload(id);
            let message = format!(
                "{name} was sleeping and its pod went away or restarted; it loads cold at its next request"
            );
            self.event(&name, EventReason::Unloaded, message.clone());
            self.outcome(
                &name,
                ModelState::Unloaded,
                Reason::SleepingPodLost,
                message,
            );
        }
    }
}
