//! A resident model's pod through its life: kept while it matches, Loaded
//! once Ready, replaced when its size, GPU or template changed, retried
//! with a growing delay when it failed, started when the live pods leave
//! room (and its artifact is on the node). A sleeping or waking one is
//! [`super::warm`]'s.

use super::Decider;
use super::inventory::{PodInventory, PodPlan};
use crate::api::{ModelState, ModelStatus};
use crate::controller::artifacts::{
    ArtifactGate, adapter_gate, artifact_gate, mount_artifact, mount_volume,
};
use crate::controller::events::EventReason;
use crate::controller::pods::{ModelPod, build_pod, make_gang_pod, pod_name, template_hash};
use crate::engine::Bytes;
use crate::quantity::format_bytes;
use crate::residency::labels::ADAPTERS_REFUSED_ANNOTATION;
use crate::residency::reasons::Reason;
use crate::residency::state::{ValidModel, recorded_time};
use k8s_openapi::jiff::SignedDuration;
use std::time::Duration;

/// How long a pod may go without any status before its model's message
/// says that no kubelet reports on it, or unplaced with no word from a
/// scheduler before the message says that.
pub(super) const UNREPORTED_AFTER: Duration = Duration::from_secs(30);

/// First retry after a failed load; doubles per failure up to the cap.
pub(super) const RETRY_BASE: Duration = Duration::from_secs(5);

pub(super) const RETRY_CAP: Duration = Duration::from_secs(300);

pub(super) fn retry_delay(failures: u32) -> Duration {
    RETRY_BASE
        .saturating_mul(1u32 << failures.saturating_sub(1).min(16))
        .min(RETRY_CAP)
}

impl<'a> Decider<'a> {
    /// A resident model: keep, replace, retry or start its pod.
    pub(super) fn resident_status(
        &mut self,
        m: ValidModel<'_>,
        pods: &mut PodInventory<'_>,
        plan: &mut PodPlan,
    ) -> ModelStatus {
        let size = self.registered_size(m.name());
        let mut st = self.base_status(m.name(), Some(size));
        let id = self.engine.id(m.name()).expect("registered");
        if self.engine.is_asleep(id) {
            if self.width(m.name()) > 1 {
                return self.gang_asleep_status(st, pods, plan);
            }
            return self.asleep_status(st, pods, plan);
        }
        if self.width(m.name()) > 1 {
            return self.gang_status(st, m, size, pods, plan);
        }
        if let Some(p) = pods.live(m.name())
            && self.was_asleep(m.name())
        {
            return self.waking_status(st, p, size, pods, plan);
        }
        if let Some(p) = pods.live(m.name()) {
            self.with_live_pod(st, m, p, size, plan)
        } else if let Some(p) = pods.failed(m.name()) {
            self.with_failed_pod(st, p, plan)
        } else if let Some(waiting) = self.waiting_for_retry(&st, plan) {
            waiting
        } else {
            st.failures = self.previous_failures(m.name());
            self.start_pod(st, m, size, pods, plan)
        }
    }

    /// Why a live pod no longer matches what it should run, if it does not:
    /// another size (the budget check must see the new one), another node
    /// or GPU (the residency moved), another template (a rollout, once the
    /// new template is known to make a pod). Pods from before an annotation
    /// existed are taken as matching it.
    pub(super) fn stale_pod(
        &self,
        m: ValidModel<'_>,
        p: &ModelPod,
        size: Bytes,
    ) -> Option<(Reason, String)> {
        if p.size.is_some_and(|s| s != size) {
            let why = format!(
                "{} is restarting with its new size {}",
                m.name(),
                format_bytes(size)
            );
            return Some((Reason::Resized, why));
        }
        if let Some(gpu) = self.placement() {
            let moved_node = p.node.as_deref().is_some_and(|n| n != gpu.node);
            let moved_gpu = p.device.as_deref().is_some_and(|d| d != gpu.device);
            if moved_node || moved_gpu {
                let why = format!(
                    "{} moves to {}: its pod on node {} GPU {} is replaced",
                    m.name(),
                    self.where_(),
                    p.node.as_deref().unwrap_or("?"),
                    p.device.as_deref().unwrap_or("?")
                );
                return Some((Reason::Moved, why));
            }
            let access = gpu.access.key();
            if p.access.as_deref().is_some_and(|a| a != access) {
                let why = format!(
                    "{} gets its GPU another way ({access}, was {}): its pod is replaced",
                    m.name(),
                    p.access.as_deref().unwrap_or("?")
                );
                return Some((Reason::Moved, why));
            }
        }
        let current = m.spec.template.as_ref().map(|t| template_hash(t.json()));
        let changed = p.template_hash.is_some() && p.template_hash != current;
        if changed && self.template_problem(m.name()).is_none() {
            let why = format!("{}'s template changed: its pod is replaced", m.name());
            return Some((Reason::TemplateChanged, why));
        }
        None
    }

    /// A resident model with a live pod: Loaded once Ready, Loading before,
    /// replaced when it no longer matches (the old pod goes first; the new
    /// one is created once it is gone).
    pub(super) fn with_live_pod(
        &mut self,
        mut st: ModelStatus,
        m: ValidModel<'_>,
        p: &ModelPod,
        size: Bytes,
        plan: &mut PodPlan,
    ) -> ModelStatus {
        st.pod = Some(p.name.clone());
        st.adapters = p
            .adapters
            .as_deref()
            .unwrap_or_default()
            .split(',')
            .filter(|a| !a.is_empty())
            .map(Into::into)
            .collect();
        if let Some((reason, why)) = self.stale_pod(m, p, size) {
            plan.delete(p);
            let event = match reason {
                Reason::Resized => EventReason::Resized,
                Reason::Moved => EventReason::Moved,
                _ => EventReason::TemplateChanged,
            };
            self.event(m.name(), event, why.clone());
            st.state = ModelState::Loading;
            st.reason = Some(reason.into());
            st.message = Some(why.into());
            st.failures = self.previous_failures(&st.name);
            return st;
        }
        let Some(since) = &p.ready_since else {
            st.state = ModelState::Loading;
            st.reason = Some(Reason::PodStarting.into());
            st.message = Some(self.starting_message(p, plan).into());
            st.failures = self.previous_failures(&st.name);
            return st;
        };
        st.state = ModelState::Loaded;
        st.loaded_at = Some(since.clone());
        if let Some(problem) = self.template_problem(m.name()) {
            // The running pod keeps the template it was built from.
            st.reason = Some(Reason::InvalidTemplate.into());
            let message = format!(
                "{}'s template cannot make a pod ({problem}); the running pod keeps the previous one",
                m.name()
            );
            st.message = Some(message.into());
        }
        let was_loaded = self
            .prev_models
            .get(&*st.name)
            .is_some_and(|prev| prev.state == ModelState::Loaded);
        if !was_loaded
            && let (Some(ready), Some(created)) = (
                recorded_time(Some(since)),
                recorded_time(p.created.as_deref()),
            )
        {
            let seconds = created.duration_until(ready).as_secs_f64();
            plan.load_seconds.push(seconds);
            st.load_seconds = Some(crate::residency::warm::moving_average(
                st.load_seconds,
                seconds,
            ));
        }
        st
    }

    /// A pod that is not Ready yet, and why, in its own words. A pod nothing
    /// has reported on for a while (a node that does not exist or whose
    /// kubelet is down) says so; the message is looked at again then.
    pub(super) fn starting_message(&self, p: &ModelPod, plan: &mut PodPlan) -> String {
        if let Some(waiting) = &p.waiting {
            return format!("{} is starting ({waiting})", p.name);
        }
        let age = recorded_time(p.created.as_deref())
            .map(|c| c.duration_until(self.input.now).unsigned_abs())
            .unwrap_or_default();
        // The messages name the threshold, not the pod's age: a message
        // that changed with every reconcile would be a status write each.
        let after = UNREPORTED_AFTER.as_secs();
        // A scheduler that says nothing of a pod it does not place: one that
        // is down, or that holds the pod back before it tries (the
        // scheduler's DRA plugin does, silently, for a ResourceClaim it has
        // not seen).
        if !p.bound {
            if age >= UNREPORTED_AFTER {
                return format!(
                    "{} is Pending: not placed on a node {after}s after its creation and no scheduler has said why (is kube-scheduler running, and has it seen the pod's ResourceClaim?)",
                    p.name
                );
            }
            plan.look_again_within(UNREPORTED_AFTER - age);
        }
        if !p.reported {
            if age >= UNREPORTED_AFTER {
                return format!(
                    "{} is Pending: no kubelet has reported on it {after}s after its creation (is node {} there and running?)",
                    p.name,
                    p.node.as_deref().unwrap_or("?")
                );
            }
            plan.look_again_within(UNREPORTED_AFTER - age);
        }
        format!("{} is starting", p.name)
    }

    /// A resident model whose pod stopped. The failed pod is kept (its logs
    /// say why) until the retry replaces it; it holds no VRAM.
    pub(super) fn with_failed_pod(
        &mut self,
        mut st: ModelStatus,
        p: &ModelPod,
        plan: &mut PodPlan,
    ) -> ModelStatus {
        let now = self.input.now;
        let prev = self
            .prev_models
            .get(&*st.name)
            .filter(|prev| prev.state == ModelState::Failed);
        if let Some(prev) = prev {
            // This failure was counted when it was first seen.
            let due = recorded_time(prev.retry_at.as_deref()).filter(|&at| at > now);
            if let Some(at) = due {
                plan.look_again_within(now.duration_until(at).unsigned_abs());
                return ModelStatus {
                    last_requested: st.last_requested,
                    last_used: st.last_used,
                    ..(*prev).clone()
                };
            }
            plan.delete(p);
            st.state = ModelState::Loading;
            st.failures = prev.failures;
            st.reason = Some(Reason::Retrying.into());
            st.message = Some(
                format!(
                    "{} retries its load ({} failed so far): the failed pod {} is replaced",
                    st.name, prev.failures, p.name
                )
                .into(),
            );
            return st;
        }
        let failures = self.previous_failures(&st.name) + 1;
        let delay = retry_delay(failures);
        st.state = ModelState::Failed;
        st.pod = Some(p.name.clone());
        st.failures = failures;
        st.retry_at = Some(
            (now + SignedDuration::try_from(delay).unwrap_or_default())
                .to_string()
                .into(),
        );
        st.reason = Some(Reason::PodFailed.into());
        st.message = Some(
            format!(
                "{} failed to load ({}); retry {} in {}s (kubectl logs {} shows why)",
                st.name,
                p.failure.as_deref().unwrap_or("pod failed"),
                failures,
                delay.as_secs(),
                p.name
            )
            .into(),
        );
        plan.look_again_within(delay);
        st
    }

    /// A failed model without a pod before its retry time keeps its status
    /// as it was.
    pub(super) fn waiting_for_retry(
        &self,
        st: &ModelStatus,
        plan: &mut PodPlan,
    ) -> Option<ModelStatus> {
        let prev = self
            .prev_models
            .get(&*st.name)
            .filter(|p| p.state == ModelState::Failed && p.is_resident())?;
        let at = recorded_time(prev.retry_at.as_deref()).filter(|&at| at > self.input.now)?;
        plan.look_again_within(self.input.now.duration_until(at).unsigned_abs());
        Some(ModelStatus {
            last_requested: st.last_requested.clone(),
            last_used: st.last_used.clone(),
            ..(*prev).clone()
        })
    }

    /// A resident model without a pod: create one when the live pods leave
    /// room for it, else wait for evicted pods to go.
    pub(super) fn start_pod(
        &self,
        mut st: ModelStatus,
        m: ValidModel<'_>,
        size: Bytes,
        pods: &mut PodInventory<'_>,
        plan: &mut PodPlan,
    ) -> ModelStatus {
        let r = self.input.residency;
        let budget = self.valid.budget;
        // Only a placed GPU has residents (a withheld one unloads them all).
        let Some(gpu) = self.placement() else {
            return st;
        };
        let built = build_pod(r, &self.input.owner, m.spec, size, gpu);
        let mut pod = match built {
            Ok(mut pod) => {
                if let Some(gang) = self.gang_here(m.name()) {
                    make_gang_pod(&mut pod, r, gpu, &self.input.owner, gang);
                }
                pod
            }
            Err(problem) => {
                st.state = ModelState::Failed;
                st.failures = st.failures.max(1);
                st.reason = Some(Reason::PodFailed.into());
                st.message = Some(format!("{}: {problem}", m.name()).into());
                return st;
            }
        };
        // A model with an artifact starts only once the node holds it.
        if let Some(artifact) = &m.spec.artifact {
            match artifact_gate(self.input.artifacts, artifact, m.name(), &gpu.node) {
                ArtifactGate::Mount { host_dir } => {
                    mount_artifact(&mut pod, &host_dir, &artifact.mount_path_for(m.name()));
                }
                ArtifactGate::Wait { message } => {
                    st.state = ModelState::Fetching;
                    st.reason = Some(Reason::FetchingArtifact.into());
                    st.message = Some(message.into());
                    return st;
                }
                ArtifactGate::Fail { reason, message } => {
                    st.state = ModelState::Failed;
                    st.failures = st.failures.max(1);
                    st.reason = Some(reason.into());
                    st.message = Some(message.into());
                    return st;
                }
            }
        }
        // Its adapters' files: each Ready one mounted, a failed one left
        // out and refused in this pod, the pod held while any is coming.
        let adapters = adapter_gate(self.input.artifacts, m.spec, &gpu.node);
        if let Some(message) = adapters.waiting {
            st.state = ModelState::Fetching;
            st.reason = Some(Reason::FetchingArtifact.into());
            st.message = Some(message.into());
            return st;
        }
        for (volume, host_dir, mount) in &adapters.mounts {
            mount_volume(&mut pod, volume, host_dir, mount);
        }
        if !adapters.refused.is_empty() {
            let refused: serde_json::Map<String, serde_json::Value> = adapters
                .refused
                .into_iter()
                .map(|(name, words)| (name, words.into()))
                .collect();
            pod.metadata
                .annotations
                .get_or_insert_with(Default::default)
                .insert(
                    ADAPTERS_REFUSED_ANNOTATION.into(),
                    serde_json::Value::Object(refused).to_string(),
                );
        }
        st.state = ModelState::Loading;
        if pods.live_declared + size > budget {
            st.reason = Some(Reason::WaitingForVram.into());
            let message = format!(
                "{} waits for evicted pods to release VRAM ({} held by live pods, needs {}, budget {})",
                m.name(),
                format_bytes(pods.live_declared),
                format_bytes(size),
                format_bytes(budget)
            );
            st.message = Some(message.into());
            return st;
        }
        pods.live_declared += size;
        let name = pod_name(r.metadata.name.as_deref().unwrap_or_default(), m.name());
        st.reason = Some(Reason::PodCreated.into());
        st.message = Some(format!("{name} is starting").into());
        st.pod = Some(name.into());
        plan.create.push(pod);
        st
    }
}
