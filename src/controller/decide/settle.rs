//! Settling pods with the engine's resident set: each registry model's
//! status and pod action, then the residency's status around them.

use super::inventory::{PodInventory, PodPlan};
use super::requests::gone_before_ready;
use super::{Decider, Decision};
use crate::api::{ModelResidencyStatus, ModelState, ModelStatus};
use crate::controller::artifacts::adapter_gate;
use crate::controller::events::EventReason;
use crate::controller::events::transition_events;
use crate::engine::Bytes;
use crate::quantity::{format_bytes, format_bytes_rounded};
use crate::residency::conditions::{
    ADAPTERS_REFUSED, BUDGET_EXCEEDS_DEVICE, CANNOT_SLEEP, ConditionSet, NAME_SHADOWED,
    model_conditions,
};
use crate::residency::gpu::GpuView;
use crate::residency::reasons::Reason;
use crate::residency::state::{Usage, ValidModel, recorded_time};
use k8s_openapi::jiff::Timestamp;
use std::collections::{BTreeMap, HashMap};

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
        self.anticipation_fields(&mut models);
        self.announce_loads(&mut models);
        self.assemble(models, plan)
    }

    /// Each counted load's one `Loaded` event: once its pod is Ready, or
    /// once the model is not resident any more (evicted, unloaded, failed
    /// for its template, gone from the registry) before that. A load still
    /// under way keeps its admittedAt in status for a later reconcile.
    fn announce_loads(&mut self, models: &mut [ModelStatus]) {
        let where_ = self.where_();
        for st in models.iter_mut() {
            let Some(admitted) = self.unannounced.remove(&*st.name) else {
                continue;
            };
            let size = st.size.as_deref().unwrap_or("?");
            let message = match st.state {
                ModelState::Loaded => loaded_message(
                    &st.name,
                    size,
                    &where_,
                    recorded_time(Some(&admitted)),
                    recorded_time(st.loaded_at.as_deref()),
                    recorded_time(st.last_requested.as_deref()),
                ),
                state if state.is_resident() => {
                    st.admitted_at = Some(admitted);
                    continue;
                }
                _ => gone_before_ready(&st.name, st.message.as_deref().unwrap_or("unloaded")),
            };
            let message = match self.gang_here(&st.name) {
                Some(g) => format!("{message} (a gang on GPUs {})", g.names()),
                None => message,
            };
            self.event(&st.name.clone(), EventReason::Loaded, message);
        }
        let left: Vec<String> = self.unannounced.drain().map(|(m, _)| m).collect();
        for model in left {
            let message = gone_before_ready(&model, "it left the registry");
            self.event(&model, EventReason::Loaded, message);
        }
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
    pub(super) fn base_status(&self, name: &str, size: Option<Bytes>) -> ModelStatus {
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
    pub(super) fn registered_size(&self, name: &str) -> Bytes {
        self.engine.size(self.engine.id(name).expect("registered"))
    }

    pub(super) fn previous_failures(&self, name: &str) -> u32 {
        self.prev_models.get(name).map_or(0, |p| p.failures)
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
                // Unloaded while the GPU was not this residency's (or
                // was tainted), and it is again: that reason is over.
                let gpu_reasons = [
                    Reason::GpuPending.as_str(),
                    Reason::GpuConflict.as_str(),
                    Reason::GpuTainted.as_str(),
                ];
                let over = st
                    .reason
                    .as_deref()
                    .is_some_and(|r| gpu_reasons.contains(&r))
                    && self.withheld().is_none();
                if over && st.state == ModelState::Unloaded {
                    st.reason = None;
                    st.message = Some(
                        format!(
                            "{} was unloaded while the GPU was not this residency's; its next request loads it",
                            m.name()
                        )
                        .into(),
                    );
                }
                // Refused while the GPU took no new models, and it does.
                let healthy = *self.health() == crate::residency::health::GpuHealth::Healthy;
                if over && st.state == ModelState::Refused && healthy {
                    st.state = ModelState::Unloaded;
                    st.reason = None;
                    st.message = Some(
                        format!(
                            "{} was not loaded while its GPU took no new models; its next request loads it",
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

    /// The adapters whose files failed on this GPU's node, in the node's
    /// words: refused in the pods started since (AdaptersRefused).
    fn adapter_files_refused(&self) -> Option<String> {
        let node = &self.placement()?.node;
        let words: Vec<String> = self
            .input
            .residency
            .spec
            .models
            .iter()
            .flat_map(|m| adapter_gate(self.input.artifacts, m, node).refused)
            .map(|(adapter, why)| format!("the adapter `{adapter}`'s files: {why}"))
            .collect();
        (!words.is_empty()).then(|| words.join("; "))
    }

    /// The residency's status around the model statuses, and the decision.
    fn assemble(mut self, models: Vec<ModelStatus>, mut plan: PodPlan) -> Decision {
        let r = self.input.residency;
        self.events
            .extend(transition_events(&self.prev_models, &models));
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
        let refused: Vec<String> = crate::residency::adapters::refused(&r.spec.models)
            .into_iter()
            .chain(self.adapter_files_refused())
            .collect();
        if !refused.is_empty() {
            set.set(ADAPTERS_REFUSED, true, ADAPTERS_REFUSED, refused.join("; "));
        }
        name_conditions(&mut set, &self.input.shadowing);
        if let Some(after) = self.health_condition(&mut set) {
            plan.look_again_within(after);
        }
        let mut gpu = match &self.input.gpu {
            GpuView::Placed(p) => p.status.clone(),
            GpuView::Withheld(w) => w.status.clone(),
        };
        gpu.budget_source = self.budget.as_ref().map(|b| b.source.to_owned());
        let (used, peak) = (self.engine.used(), self.engine.peak());
        let cost = self.engine.eviction() == crate::engine::Eviction::Cost;
        let rate = self.engine.eviction() == crate::engine::Eviction::Rate;
        let mut models = models;
        if cost {
            self.value_fields(&mut models);
        }
        if rate {
            self.rate_fields(&mut models);
        }
        let host_used = self.engine.host_used();
        let mut status = ModelResidencyStatus {
            observed_generation: generation,
            budget: self.budget.as_ref().map(|b| format_bytes(b.bytes)),
            gpu: Some(Box::new(gpu)),
            used: Some(format_bytes_rounded(used)),
            peak: Some(format_bytes_rounded(peak)),
            models,
            counters: self.counters(),
            conditions: set.finish(),
            host_used: (self.valid.host_budget > 0 || host_used > 0)
                .then(|| format_bytes_rounded(host_used)),
            inflation: cost.then(|| self.engine.inflation()),
            served: rate.then(|| self.engine.served()),
            // Rounded: a status write per request's float noise is not
            // worth a write.
            lag: (cost || rate).then(|| (self.engine.lag() * 1000.0).round() / 1000.0),
            ..ModelResidencyStatus::default()
        };
        status.recount();
        let usage = Usage {
            budget: self.valid.budget,
            used,
            peak,
            resident: status.resident,
            gpu_conflict: withheld
                .as_ref()
                .is_some_and(|(r, _)| *r != Reason::GpuTainted),
            gpu_unhealthy: status.conditions.iter().any(|c| {
                c.type_ == crate::residency::conditions::GPU_HEALTHY && c.status == "False"
            }),
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

    /// Each model's rate, resident or not, which `rate` eviction is
    /// restored from (a model never served has none).
    fn rate_fields(&self, models: &mut [ModelStatus]) {
        for m in models {
            let Some(id) = self.engine.id(&m.name) else {
                continue;
            };
            let (rate, at) = self.engine.rate_state(id);
            if rate > 0.0 {
                m.rate = Some(rate);
                m.rate_at = Some(at);
            }
        }
    }

    /// Each resident model's value state, which `cost` eviction is restored
    /// from.
    fn value_fields(&self, models: &mut [ModelStatus]) {
        for m in models {
            let resident = self
                .engine
                .id(&m.name)
                .filter(|&id| self.engine.is_resident(id));
            if let Some(id) = resident {
                let (uses, base) = self.engine.value_state(id);
                m.uses = uses;
                m.value_base = Some(base);
            }
        }
    }

    /// The engine's counters, but sleeps and wakes as they were: those
    /// count when their server confirms them ([`Decision::call_done`]),
    /// each with its Slept or Woken event, so the counters never go down.
    /// A request that cancels a sleep not sent yet found its model awake:
    /// a hit. A gang's load counts once, on its head.
    fn counters(&self) -> crate::api::Counters {
        let before = self.input.residency.status.as_ref();
        let before = before.map(|s| s.counters).unwrap_or_default();
        let mut c = self.engine.counters();
        c.sleeps = before.sleeps;
        c.wakes = before.wakes;
        c.hits += self.cancelled_sleeps;
        c.loads = c.loads.saturating_sub(self.gang_loads_elsewhere);
        c
    }
}

/// A load's `Loaded` event when its pod is Ready: where, how long after its
/// admission, and, when its request waited (queued behind other loads, or
/// an operator slow to see it: the queue has no event of its own), how
/// long before that it was requested.
pub(super) fn loaded_message(
    name: &str,
    size: &str,
    where_: &str,
    admitted: Option<Timestamp>,
    ready: Option<Timestamp>,
    requested: Option<Timestamp>,
) -> String {
    let secs = |from: Timestamp, to: Timestamp| from.duration_until(to).as_secs_f64();
    // A pod's Ready time has whole seconds: one within a second of the
    // admission may even read before it.
    let after = match (admitted, ready) {
        (Some(a), Some(r)) if secs(a, r) >= 1.0 => {
            format!(", {:.0}s after it was admitted", secs(a, r))
        }
        (Some(_), Some(_)) => ", within a second of its admission".to_owned(),
        _ => String::new(),
    };
    let waited = match (requested, admitted) {
        (Some(q), Some(a)) if secs(q, a) >= 1.0 => {
            format!(" (requested {:.0}s before that)", secs(q, a))
        }
        _ => String::new(),
    };
    format!("{name} loaded ({size}): Ready on {where_}{after}{waited}")
}

/// `NameShadowed`: True on a residency listing names another namespace
/// owns (the router sends their requests there), False on the owner while
/// other namespaces list its names; absent when no name is shared.
fn name_conditions(set: &mut ConditionSet<'_>, s: &crate::controller::model_names::Shadowing) {
    if !s.shadowed.is_empty() {
        let each: Vec<String> = s
            .shadowed
            .iter()
            .map(|(name, owner)| format!("{name} (listed first by {owner})"))
            .collect();
        let message = format!(
            "a router serving several namespaces sends requests for these names to the namespace that listed them first: {}; rename them, or serve this namespace with a router of its own (route --namespace)",
            each.join(", ")
        );
        set.set(NAME_SHADOWED, true, "ListedFirstElsewhere", message);
    } else if !s.shared.is_empty() {
        let each: Vec<String> = s
            .shared
            .iter()
            .map(|(name, others)| format!("{name} (also listed by {})", others.join(", ")))
            .collect();
        let message = format!(
            "names this namespace listed first are listed in other namespaces too; a router serving several namespaces serves them here: {}",
            each.join(", ")
        );
        set.set(NAME_SHADOWED, false, "ListedElsewhereToo", message);
    }
}
