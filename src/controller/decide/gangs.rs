//! A gang's side of a member's decide: the head (the placement's first
//! member) keeps, replaces and retries the one pod as any model's once the
//! coordinator says every member made room; the other members follow it.
//! A gang sleeps and wakes as one: when the placement says it sleeps,
//! every member puts it to sleep and only the head asks the pod (the
//! others hold it at its full size until the coordinator passes on the
//! head's confirmation); a request after that wakes it on every member,
//! and the head asks the pod to wake once the coordinator says every
//! member made room for its full size ([`crate::residency::gangs`]).

use super::Decider;
use super::inventory::{PodInventory, PodPlan};
use crate::api::{ModelState, ModelStatus};
use crate::controller::pods::ModelPod;
use crate::engine::Bytes;
use crate::residency::gangs::{GangPlacement, SleepPhase};
use crate::residency::reasons::Reason;
use crate::residency::state::{ValidModel, recorded_time};

impl<'a> Decider<'a> {
    /// Gangs whose placement says they sleep: put to sleep here too (the
    /// sleep a member chose to make room is the gang's), unless a request
    /// came after the sleep was asked (that wakes them instead). One that
    /// cannot sleep here (no host room) is unloaded, and so leaves every
    /// member.
    pub(super) fn sleep_gangs(&mut self) {
        let me = self.me();
        let asked: Vec<(String, String, String)> = self
            .gangs
            .iter()
            .filter(|(_, p)| p.includes(me))
            .filter_map(|(name, p)| {
                let s = p.sleep.as_ref()?;
                matches!(s.phase, SleepPhase::Asked | SleepPhase::Asleep)
                    .then(|| (name.clone(), s.after.clone(), p.names()))
            })
            .collect();
        for (name, after, members) in asked {
            let Some(id) = self.engine.id(&name) else {
                continue;
            };
            if !self.engine.is_resident(id)
                || self.engine.is_asleep(id)
                || self.engine.is_loading(id)
            {
                continue;
            }
            let after = recorded_time(Some(&after));
            let requested = self.valid.demand.iter().find(|r| r.model == name);
            if requested.is_some_and(|r| after.is_none_or(|a| r.at > a)) {
                // Asked for again since: it wakes on every member.
                continue;
            }
            let asleep = format!("{name} goes to sleep with its gang on GPUs {members}");
            let unloaded = format!(
                "{name} cannot sleep on this GPU (its host budget has no room), so it leaves every GPU of its gang ({members})"
            );
            self.sleep_or_unload(id, &name, asleep, (Reason::GangCannotSleep, unloaded));
        }
    }

    /// A sleeping gang on this GPU: the head asks its pod to sleep once
    /// the placement says the gang sleeps (every member was told); the
    /// others keep it `FallingAsleep` at its full size until the placement
    /// says the head's pod confirmed.
    pub(super) fn gang_asleep_status(
        &self,
        mut st: ModelStatus,
        pods: &mut PodInventory<'_>,
        plan: &mut PodPlan,
    ) -> ModelStatus {
        let name = st.name.to_string();
        let gang = self.gang_here(&name);
        let phase = gang.and_then(|g| g.sleep.as_ref()).map(|s| s.phase);
        let head = gang.is_some_and(|g| g.head() == self.me());
        if head && phase.is_some() {
            return self.asleep_status(st, pods, plan);
        }
        st.state = ModelState::Sleeping;
        st.failures = self.previous_failures(&name);
        let Some(pod) = pods.live(&name) else {
            return st;
        };
        st.pod = Some(pod.name.clone());
        st.slept_at = Some(self.fell_asleep_at(&name).to_string().into());
        let members = gang.map(GangPlacement::names).unwrap_or_default();
        if !head && (phase == Some(SleepPhase::Asleep) || self.was_asleep(&name)) {
            st.reason = Some(Reason::Asleep.into());
            let message = format!("{name} sleeps with its gang on GPUs {members}");
            st.message = Some(message.into());
            return st;
        }
        st.reason = Some(Reason::FallingAsleep.into());
        let message = match gang {
            Some(g) if !head => format!(
                "{name} goes to sleep with its gang on GPUs {members}: {} puts its pod to sleep",
                g.head()
            ),
            _ => format!(
                "{name} goes to sleep once the operator has put its gang to sleep on every GPU ({members})"
            ),
        };
        st.message = Some(message.into());
        st
    }

    /// A gang woken by a request whose pod still sleeps: the head asks it
    /// to wake once the placement says every member made room for its full
    /// size; the others stay `Waking` (holding the pod at its sleeping
    /// size, their engine the full size) while the placement says it
    /// sleeps.
    fn gang_waking(
        &self,
        mut st: ModelStatus,
        gang: &GangPlacement,
        pod: &ModelPod,
        size: Bytes,
        pods: &mut PodInventory<'_>,
        plan: &mut PodPlan,
    ) -> ModelStatus {
        let phase = gang.sleep.as_ref().map(|s| s.phase);
        let head = gang.head() == self.me();
        if head && phase == Some(SleepPhase::Waking) {
            return self.waking_status(st, pod, size, pods, plan);
        }
        st.state = ModelState::Loading;
        st.reason = Some(Reason::Waking.into());
        st.pod = Some(pod.name.clone());
        st.failures = self.previous_failures(&st.name);
        let message = if head {
            format!(
                "{} wakes once every GPU of its gang ({}) has made room",
                st.name,
                gang.names()
            )
        } else {
            format!("{} waits for {} to wake its pod", st.name, gang.head())
        };
        st.message = Some(message.into());
        st
    }

    /// A resident gang: its head (the first member) keeps, replaces and
    /// retries its one pod as any model's, and starts it once the
    /// coordinator says every member made room; the other members follow
    /// that pod (it holds VRAM on their GPUs too) and never start, replace
    /// or retry it.
    pub(super) fn gang_status(
        &mut self,
        mut st: ModelStatus,
        m: ValidModel<'_>,
        size: Bytes,
        pods: &mut PodInventory<'_>,
        plan: &mut PodPlan,
    ) -> ModelStatus {
        let name = m.name();
        let Some(gang) = self.gang_here(name).cloned() else {
            st.state = ModelState::Loading;
            st.reason = Some(Reason::GangPlacing.into());
            st.message = Some(format!("{name} waits for its gang's placement").into());
            return st;
        };
        let head = gang.head() == self.me();
        let members = gang.names();
        if let Some(p) = pods.live(name)
            && self.was_asleep(name)
            && (head || gang.sleep.is_some())
        {
            // Still asleep (a member other than the head follows the
            // placement: once it no longer sleeps, the pod is awake).
            return self.gang_waking(st, &gang, p, size, pods, plan);
        }
        if let Some(p) = pods.live(name) {
            if head {
                return self.with_live_pod(st, m, p, size, plan);
            }
            st.pod = Some(p.name.clone());
            st.reason = Some(Reason::GangMember.into());
            if let Some(since) = &p.ready_since {
                st.state = ModelState::Loaded;
                st.loaded_at = Some(since.clone());
                st.message =
                    Some(format!("{name} runs on GPUs {members} in pod {}", p.name).into());
            } else {
                st.state = ModelState::Loading;
                st.message =
                    Some(format!("{name} is starting on GPUs {members} in pod {}", p.name).into());
            }
            return st;
        }
        if head {
            if let Some(p) = pods.failed(name) {
                return self.with_failed_pod(st, p, plan);
            }
            if self.gang_pod_lost(name) {
                // Deleted by a member that let the gang go (or by someone
                // else): started again only once the coordinator has seen
                // every member hold it afresh, never on this placement's
                // word alone (a member may have used the room since).
                st.state = ModelState::Loading;
                st.reason = Some(Reason::GangPodLost.into());
                let message = format!(
                    "{name}'s pod went away: the operator takes the gang off every GPU and its next request places it again"
                );
                st.message = Some(message.into());
                return st;
            }
            if let Some(waiting) = self.waiting_for_retry(&st, plan) {
                return waiting;
            }
        }
        st.state = ModelState::Loading;
        if !gang.ready {
            st.reason = Some(Reason::GangWaiting.into());
            let message =
                format!("{name} waits for every GPU of its gang ({members}) to make room");
            st.message = Some(message.into());
            return st;
        }
        if !head {
            st.reason = Some(Reason::GangMember.into());
            let message = format!(
                "{name} waits for {} to start its pod on GPUs {members}",
                gang.head()
            );
            st.message = Some(message.into());
            return st;
        }
        st.failures = self.previous_failures(name);
        self.start_pod(st, m, size, pods, plan)
    }

    /// Whether the gang `name`'s pod, which this head started (its last
    /// status names it), is gone without having failed or been replaced
    /// by this residency.
    pub(super) fn gang_pod_lost(&self, name: &str) -> bool {
        let Some(prev) = self.prev_models.get(name) else {
            return false;
        };
        // Said once, it stays so until the coordinator takes the gang off
        // (its placement gone, it unloads): a reconcile between the two
        // must not start it again.
        if prev.reason.as_deref() == Some(Reason::GangPodLost.as_str()) {
            return true;
        }
        let replaced = [
            Reason::Resized,
            Reason::Moved,
            Reason::TemplateChanged,
            Reason::Retrying,
            Reason::GangWaiting,
        ]
        .iter()
        .any(|r| prev.reason.as_deref() == Some(r.as_str()));
        prev.pod.is_some() && prev.is_resident() && prev.state != ModelState::Failed && !replaced
    }
}
