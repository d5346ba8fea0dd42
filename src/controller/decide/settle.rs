//! Settling pods with the engine's resident set: each registry model's
//! status and pod action, then the residency's status around them.

use super::{Decider, Decision, PodCall, PodRef};
use crate::api::{ModelResidencyStatus, ModelState, ModelStatus};
use crate::controller::artifacts::{ArtifactGate, artifact_gate, mount_artifact};
use crate::controller::events::{EventReason, transition_events};
use crate::controller::pods::{ModelPod, PodPhase, build_pod, pod_name, template_hash};
use crate::engine::{Bytes, Engine};
use crate::quantity::{format_bytes, format_bytes_rounded};
use crate::residency::conditions::{
    BUDGET_EXCEEDS_DEVICE, CANNOT_SLEEP, ConditionSet, model_conditions,
};
use crate::residency::gpu::GpuView;
use crate::residency::reasons::Reason;
use crate::residency::state::{Usage, ValidModel, recorded_time};
use k8s_openapi::api::core::v1::Pod;
use k8s_openapi::jiff::SignedDuration;
use std::collections::{BTreeMap, HashMap};
use std::time::Duration;

/// How long after a model is chosen to sleep its sleep request is sent:
/// time for the routers to see it is no longer Loaded (they stop sending it
/// requests) before its server stops answering them.
pub(super) const SLEEP_DRAIN: Duration = Duration::from_secs(1);

/// Whether a model's status says its server sleeps: its sleep confirmed
/// (`Sleeping`/`Asleep`), or requested and not woken yet (`Loading`/
/// `Waking`). Not while it falls asleep: it still holds its full size.
fn server_asleep(m: &ModelStatus) -> bool {
    let reason = m.reason.as_deref();
    (m.state == ModelState::Sleeping && reason == Some(Reason::Asleep.as_str()))
        || (m.state == ModelState::Loading && reason == Some(Reason::Waking.as_str()))
}

/// How long a pod may go without any status before its model's message
/// says that no kubelet reports on it.
const UNREPORTED_AFTER: Duration = Duration::from_secs(30);

/// First retry after a failed load; doubles per failure up to the cap.
pub(super) const RETRY_BASE: Duration = Duration::from_secs(5);
pub(super) const RETRY_CAP: Duration = Duration::from_secs(300);

pub(super) fn retry_delay(failures: u32) -> Duration {
    RETRY_BASE
        .saturating_mul(1u32 << failures.saturating_sub(1).min(16))
        .min(RETRY_CAP)
}

/// The residency's pods by model, and the VRAM they hold.
struct PodInventory<'p> {
    by_model: BTreeMap<&'p str, Vec<&'p ModelPod>>,
    /// Declared sizes of every pod that has not finished, terminating ones
    /// included (they still hold VRAM), plus the pods created so far in
    /// this reconcile.
    live_declared: Bytes,
    /// Host memory the pods may hold asleep: the confirmed sleepers', and
    /// every terminating pod's of a model that can sleep (it may have been
    /// asleep when it was deleted, and holds it until it is gone), plus the
    /// sleeps asked so far in this reconcile.
    host_held: Bytes,
}

impl<'p> PodInventory<'p> {
    /// `asleep`: the pods whose sleep was confirmed (and not woken since),
    /// with the VRAM each keeps asleep.
    fn new(pods: &'p [ModelPod], engine: &Engine, asleep: &HashMap<&str, Bytes>) -> Self {
        let mut by_model: BTreeMap<&str, Vec<&ModelPod>> = BTreeMap::new();
        let mut live_declared = 0;
        let mut host_held = 0;
        for p in pods {
            by_model.entry(&*p.model).or_default().push(p);
            if p.phase == PodPhase::Live {
                let sleep = engine.id(&p.model).and_then(|id| engine.sleep_of(id));
                if asleep.contains_key(&*p.name) || p.deleting {
                    host_held += sleep.map_or(0, |s| s.host_memory);
                }
                if let Some(&kept) = asleep.get(&*p.name).filter(|_| !p.deleting) {
                    live_declared += kept;
                    continue;
                }
                // A pod without its size annotation counts at the model's
                // current size.
                let registered = || engine.id(&p.model).map_or(0, |id| engine.size(id));
                live_declared += p.size.unwrap_or_else(registered);
            }
        }
        PodInventory {
            by_model,
            live_declared,
            host_held,
        }
    }

    fn of(&self, model: &str) -> &[&'p ModelPod] {
        self.by_model.get(model).map_or(&[], Vec::as_slice)
    }

    /// The model's pod that is (or may soon be) serving.
    fn live(&self, model: &str) -> Option<&'p ModelPod> {
        let mut found = self.of(model).iter().copied();
        found.find(|p| p.phase == PodPhase::Live && !p.deleting)
    }

    /// The model's pod that stopped and has not been deleted yet.
    fn failed(&self, model: &str) -> Option<&'p ModelPod> {
        let mut found = self.of(model).iter().copied();
        found.find(|p| p.phase == PodPhase::Finished && !p.deleting)
    }
}

/// The pod side of the decision, filled model by model.
#[derive(Default)]
struct PodPlan {
    create: Vec<Pod>,
    delete: Vec<PodRef>,
    requeue: Option<Duration>,
    load_seconds: Vec<f64>,
    calls: Vec<PodCall>,
}

impl PodPlan {
    fn delete(&mut self, p: &ModelPod) {
        self.delete.push(p.into());
    }

    fn look_again_within(&mut self, after: Duration) {
        self.requeue = Some(self.requeue.map_or(after, |r| r.min(after)));
    }
}

impl<'a> Decider<'a> {
    /// Reconciles pods with the engine's resident set and builds the status.
    pub(super) fn settle(mut self) -> Decision {
        let asleep = self.confirmed_asleep();
        let mut pods = PodInventory::new(self.input.pods, &self.engine, &asleep);
        let mut plan = PodPlan::default();
        if let Some(after) = self.idle_requeue {
            plan.look_again_within(after);
        }
        let queued = self
            .outcomes
            .values()
            .any(|o| o.state == ModelState::Queued);
        if let Some(after) = self.next_protection_end().filter(|_| queued) {
            plan.look_again_within(after);
        }
        for p in self.input.pods {
            if self.engine.id(&p.model).is_none() && !p.deleting {
                plan.delete(p);
            }
        }
        let mut states: BTreeMap<String, ModelStatus> = BTreeMap::new();
        for m in self.settle_order() {
            let id = self.engine.id(m.name()).expect("registered");
            let st = if self.engine.is_resident(id) {
                self.resident_status(m, &mut pods, &mut plan)
            } else {
                self.absent_status(m, &pods, &mut plan)
            };
            states.insert(m.name().to_owned(), st);
        }
        self.unknown_model_statuses(&mut states);
        // Status in registry order, then unknown models by name.
        let mut models: Vec<ModelStatus> = Vec::with_capacity(states.len());
        for m in &self.valid.models {
            models.extend(states.remove(m.name()));
        }
        models.extend(states.into_values());
        self.assemble(models, plan)
    }

    /// The pods whose server sleeps by the previous status (confirmed
    /// asleep, or asleep and waiting to be woken), with what each keeps.
    fn confirmed_asleep(&self) -> HashMap<&'a str, Bytes> {
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

    /// A resident model that sleeps: chosen now or before, its sleep asked
    /// once the drain is over; confirmed, it keeps its sleeping size.
    fn asleep_status(
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
        let since = prev
            .filter(|p| p.state == ModelState::Sleeping)
            .and_then(|p| recorded_time(p.slept_at.as_deref()))
            .unwrap_or(self.input.now);
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
    fn waking_status(
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
    fn cannot_sleep(&self) -> Option<String> {
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
    fn call(&self, model: &str, pod: &ModelPod, wake: bool) -> Option<PodCall> {
        let spec = self.by_name.get(model)?.spec.sleep.as_deref()?;
        Some(PodCall {
            model: model.to_owned(),
            pod: pod.into(),
            addr: pod.addr,
            wake,
            protocol: crate::residency::warm::protocol(spec),
        })
    }

    /// Residents first, least recently used first, so older models get
    /// their pods first when room opens up; then the rest in registry order.
    fn settle_order(&self) -> Vec<ValidModel<'a>> {
        let rank: HashMap<&str, usize> = self
            .engine
            .residents()
            .into_iter()
            .enumerate()
            .map(|(i, id)| (self.engine.name(id), i))
            .collect();
        let mut order = self.valid.models.clone();
        order.sort_by_key(|m| rank.get(m.name()).copied().unwrap_or(usize::MAX));
        order
    }

    /// A model's status before its pods are looked at: name, size and
    /// request times.
    fn base_status(&self, name: &str, size: Option<Bytes>) -> ModelStatus {
        let prev = self.prev_models.get(name).copied();
        let times = self.requested.get(name).cloned().unwrap_or_default();
        ModelStatus {
            name: name.into(),
            size: size.map(|s| format_bytes(s).into()),
            last_requested: times
                .last_requested
                .or_else(|| prev.and_then(|p| p.last_requested.clone())),
            last_used: times
                .last_used
                .or_else(|| prev.and_then(|p| p.last_used.clone())),
            load_seconds: prev.and_then(|p| p.load_seconds),
            wake_seconds: prev.and_then(|p| p.wake_seconds),
            ..ModelStatus::default()
        }
    }

    /// A registry model's size as the engine has it (its recorded size
    /// while it is resident and not re-admitted yet).
    fn registered_size(&self, name: &str) -> Bytes {
        self.engine.size(self.engine.id(name).expect("registered"))
    }

    fn previous_failures(&self, name: &str) -> u32 {
        self.prev_models.get(name).map_or(0, |p| p.failures)
    }

    /// A resident model: keep, replace, retry or start its pod.
    fn resident_status(
        &mut self,
        m: ValidModel<'_>,
        pods: &mut PodInventory<'_>,
        plan: &mut PodPlan,
    ) -> ModelStatus {
        let size = self.registered_size(m.name());
        let mut st = self.base_status(m.name(), Some(size));
        let id = self.engine.id(m.name()).expect("registered");
        if self.engine.is_asleep(id) {
            return self.asleep_status(st, pods, plan);
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
    fn stale_pod(&self, m: ValidModel<'_>, p: &ModelPod, size: Bytes) -> Option<(Reason, String)> {
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
    fn with_live_pod(
        &mut self,
        mut st: ModelStatus,
        m: ValidModel<'_>,
        p: &ModelPod,
        size: Bytes,
        plan: &mut PodPlan,
    ) -> ModelStatus {
        st.pod = Some(p.name.clone());
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
    fn starting_message(&self, p: &ModelPod, plan: &mut PodPlan) -> String {
        if let Some(waiting) = &p.waiting {
            return format!("{} is starting ({waiting})", p.name);
        }
        let age = recorded_time(p.created.as_deref())
            .map(|c| c.duration_until(self.input.now).unsigned_abs())
            .unwrap_or_default();
        if !p.reported {
            if age >= UNREPORTED_AFTER {
                return format!(
                    "{} is Pending: no kubelet has reported on it for {}s (is node {} there and running?)",
                    p.name,
                    age.as_secs(),
                    p.node.as_deref().unwrap_or("?")
                );
            }
            plan.look_again_within(UNREPORTED_AFTER - age);
        }
        format!("{} is starting", p.name)
    }

    /// A resident model whose pod stopped. The failed pod is kept (its logs
    /// say why) until the retry replaces it; it holds no VRAM.
    fn with_failed_pod(
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
    fn waiting_for_retry(&self, st: &ModelStatus, plan: &mut PodPlan) -> Option<ModelStatus> {
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
    fn start_pod(
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
        let mut pod = match build_pod(r, &self.input.owner, m.spec, size, gpu) {
            Ok(pod) => pod,
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

    /// A model that is not resident: its pods go; its state is what this
    /// reconcile did to it, or what it was. A template that cannot make a
    /// pod is reported before anyone requests the model.
    fn absent_status(
        &self,
        m: ValidModel<'_>,
        pods: &PodInventory<'_>,
        plan: &mut PodPlan,
    ) -> ModelStatus {
        let size = self.registered_size(m.name());
        let mut st = self.base_status(m.name(), Some(size));
        for p in pods.of(m.name()) {
            if !p.deleting {
                plan.delete(p);
            }
        }
        let prev = self.prev_models.get(m.name()).filter(|p| !p.is_resident());
        // A model without a template is a registry entry that cannot load
        // (said when it is requested), not a typo to report up front.
        let problem = m
            .spec
            .template
            .as_ref()
            .and_then(|_| self.template_problem(m.name()));
        match (self.outcomes.get(m.name()), prev) {
            (Some(o), _) => {
                st.state = o.state;
                st.reason = Some(o.reason.into());
                st.message = Some(o.message.clone().into());
                if o.reason == Reason::InvalidTemplate {
                    // Each failed request is its own failure (and event).
                    st.failures = prev.map_or(0, |p| p.failures) + 1;
                }
                return st;
            }
            (None, Some(p)) if p.state == ModelState::Queued => {
                // Queued, and not requested any more (its demand entry
                // went, or the GPU went to another residency).
                st.state = ModelState::Unloaded;
            }
            (None, Some(p)) => {
                st.state = p.state;
                st.reason = p.reason.clone();
                st.message = p.message.clone();
                st.failures = p.failures;
                // Unloaded while the GPU was not this residency's, and it
                // is again: that reason is over.
                let gpu_reasons = [Reason::GpuPending.as_str(), Reason::GpuConflict.as_str()];
                if st
                    .reason
                    .as_deref()
                    .is_some_and(|r| gpu_reasons.contains(&r))
                    && self.withheld().is_none()
                {
                    st.reason = None;
                    st.message = Some(
                        format!(
                            "{} was unloaded while the GPU was not this residency's; its next request loads it",
                            m.name()
                        )
                        .into(),
                    );
                }
            }
            (None, None) => st.state = ModelState::Unloaded,
        }
        let was_invalid = st.reason.as_deref() == Some(Reason::InvalidTemplate.as_str());
        match problem {
            Some(problem) if st.state != ModelState::Failed => {
                st.reason = Some(Reason::InvalidTemplate.into());
                st.message =
                    Some(format!("{}'s template cannot make a pod: {problem}", m.name()).into());
            }
            None if was_invalid => {
                // Fixed: nothing to report any more.
                st.state = ModelState::Unloaded;
                st.reason = None;
                st.message = None;
                st.failures = 0;
            }
            _ => {}
        }
        st
    }

    /// Demanded models that are not in the registry (refused, or still
    /// carrying a state from before they left it).
    fn unknown_model_statuses(&self, states: &mut BTreeMap<String, ModelStatus>) {
        for request in &self.valid.demand {
            let model = request.model;
            if self.engine.id(model).is_some() || states.contains_key(model) {
                continue;
            }
            let prev = self.prev_models.get(model).copied();
            let st = match (self.outcomes.get(model), prev) {
                (Some(o), _) => {
                    let mut st = self.base_status(model, None);
                    st.last_used = None;
                    st.state = o.state;
                    st.reason = Some(o.reason.into());
                    st.message = Some(o.message.clone().into());
                    st
                }
                (None, Some(p)) if !p.is_resident() => p.clone(),
                _ => continue,
            };
            states.insert(model.to_owned(), st);
        }
    }

    /// The residency's status around the model statuses, and the decision.
    fn assemble(mut self, models: Vec<ModelStatus>, mut plan: PodPlan) -> Decision {
        let r = self.input.residency;
        let where_ = self.where_();
        self.events
            .extend(transition_events(&self.prev_models, &models, &where_));
        let generation = r.metadata.generation;
        let mut set = ConditionSet::new(&self.previous.conditions, generation, self.input.now);
        let withheld = self.withheld();
        let withheld_view = withheld.as_ref().map(|(r, m)| (r.as_str(), m.as_str()));
        model_conditions(&mut set, &models, withheld_view);
        if let Some(exceeds) = self.budget.as_ref().and_then(|b| b.exceeds.clone()) {
            set.set(BUDGET_EXCEEDS_DEVICE, true, BUDGET_EXCEEDS_DEVICE, exceeds);
        }
        if let Some(never) = self.cannot_sleep() {
            set.set(CANNOT_SLEEP, true, CANNOT_SLEEP, never);
        }
        let mut gpu = match &self.input.gpu {
            GpuView::Placed(p) => p.status.clone(),
            GpuView::Withheld(w) => w.status.clone(),
        };
        gpu.budget_source = self.budget.as_ref().map(|b| b.source.to_owned());
        let (used, peak) = (self.engine.used(), self.engine.peak());
        let cost = self.engine.eviction() == crate::engine::Eviction::Cost;
        let mut models = models;
        if cost {
            for m in &mut models {
                if let Some(id) = self
                    .engine
                    .id(&m.name)
                    .filter(|&id| self.engine.is_resident(id))
                {
                    let (uses, base) = self.engine.value_state(id);
                    m.uses = uses;
                    m.value_base = Some(base);
                }
            }
        }
        let host_used = self.engine.host_used();
        let mut status = ModelResidencyStatus {
            observed_generation: generation,
            budget: self.budget.as_ref().map(|b| format_bytes(b.bytes)),
            gpu: Some(gpu),
            used: Some(format_bytes_rounded(used)),
            peak: Some(format_bytes_rounded(peak)),
            models,
            counters: {
                // Sleeps and wakes count when their server confirms them
                // ([`Decision::call_done`]), each with its Slept or Woken
                // event, so the counters never go down; a request that
                // cancels a sleep not sent yet found its model awake: a hit.
                let before = self.input.residency.status.as_ref();
                let before = before.map(|s| s.counters).unwrap_or_default();
                let mut c = self.engine.counters();
                c.sleeps = before.sleeps;
                c.wakes = before.wakes;
                c.hits += self.cancelled_sleeps;
                c
            },
            conditions: set.finish(),
            host_used: (self.valid.host_budget > 0 || host_used > 0)
                .then(|| format_bytes_rounded(host_used)),
            inflation: cost.then(|| self.engine.inflation()),
            ..ModelResidencyStatus::default()
        };
        status.recount();
        let usage = Usage {
            budget: self.valid.budget,
            used,
            peak,
            resident: status.resident,
            gpu_conflict: withheld.is_some(),
        };
        plan.delete.sort();
        plan.delete.dedup();
        Decision {
            status,
            create: plan.create,
            delete: plan.delete,
            events: self.events,
            requeue_after: plan.requeue,
            load_seconds: plan.load_seconds,
            calls: plan.calls,
            usage: Some(usage),
        }
    }
}
