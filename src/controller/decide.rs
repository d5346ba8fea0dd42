//! The decide step: a pure function from what the reconciler observed (the
//! spec, the previous status, the owned pods, the time) to what it should do
//! (pods to create and delete, the new status, events to publish).
//!
//! The engine is rebuilt from the previous status (residents restored in
//! LRU order, counters carried over), then fed, in this order:
//! 1. registry removals (unload), 2. size changes (re-admission),
//! 3. the budget (a shrink evicts), 4. removed demand entries (unload),
//! 5. demand entries newer than the model's last processed request, in
//!    `lastRequested` order (ties by model name).
//!
//! Pods follow the engine: a non-resident model's pod is deleted; a
//! resident model without a live pod gets one only when the declared sizes
//! of all live pods (terminating ones included, since they still hold VRAM)
//! leave room for it. Nothing here does I/O, so a reconcile with nothing new
//! yields the previous status unchanged and no actions.

use super::conditions::{ConditionSet, DEGRADED, READY, REFUSED, model_conditions};
use super::pods::{ModelPod, PodPhase, build_pod, pod_name};
use crate::api::{ModelResidency, ModelResidencyStatus, ModelSpec, ModelState, ModelStatus};
use crate::engine::{Admission, Bytes, Engine, RefuseReason, Resize};
use crate::quantity::{format_bytes, parse_bytes};
use k8s_openapi::api::core::v1::Pod;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::OwnerReference;
use k8s_openapi::jiff::{SignedDuration, Timestamp};
use std::collections::{BTreeMap, HashMap};
use std::time::Duration;

/// Everything the decision depends on.
pub struct Observed<'a> {
    pub residency: &'a ModelResidency,
    pub owner: OwnerReference,
    pub pods: &'a [ModelPod],
    pub now: Timestamp,
}

/// An event to publish once the status is written.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Note {
    /// The model it is about; its pod becomes the event's related object,
    /// which also keeps events about different models from being merged
    /// into one series.
    pub model: Option<String>,
    pub warning: bool,
    pub reason: &'static str,
    pub action: &'static str,
    pub message: String,
}

/// What to do.
#[derive(Debug)]
pub struct Decision {
    pub status: ModelResidencyStatus,
    pub create: Vec<Pod>,
    /// (pod name, uid) to delete.
    pub delete: Vec<(String, String)>,
    pub notes: Vec<Note>,
    /// When to look again even if nothing changes (a retry falls due).
    pub requeue_after: Option<Duration>,
    /// Seconds from pod creation to Ready of the models that became Loaded.
    pub load_seconds: Vec<f64>,
}

/// First retry after a failed load; doubles per failure up to the cap.
const RETRY_BASE: Duration = Duration::from_secs(5);
const RETRY_CAP: Duration = Duration::from_secs(300);

fn retry_delay(failures: u32) -> Duration {
    RETRY_BASE
        .saturating_mul(1u32 << failures.saturating_sub(1).min(16))
        .min(RETRY_CAP)
}

/// The spec, checked and converted.
struct Valid<'a> {
    budget: Bytes,
    models: Vec<(&'a ModelSpec, Bytes)>,
    /// (lastRequested, model), sorted.
    demand: Vec<(Timestamp, &'a str)>,
}

fn validate(r: &ModelResidency) -> Result<Valid<'_>, String> {
    let name = r.metadata.name.as_deref().unwrap_or_default();
    if name.len() > 63 {
        return Err(format!(
            "the name {name:?} is longer than 63 characters; it must fit a label value"
        ));
    }
    let spec = &r.spec;
    let budget = parse_bytes(&spec.budget.0).map_err(|e| format!("spec.budget: {e}"))?;
    if budget == 0 {
        return Err("spec.budget: must be positive".into());
    }
    let mut seen = std::collections::HashSet::new();
    let mut models = Vec::with_capacity(spec.models.len());
    for m in &spec.models {
        if !seen.insert(m.name.as_str()) {
            return Err(format!("spec.models: {:?} is listed twice", m.name));
        }
        let size =
            parse_bytes(&m.size.0).map_err(|e| format!("spec.models[{}].size: {e}", m.name))?;
        if size == 0 {
            return Err(format!("spec.models[{}].size: must be positive", m.name));
        }
        models.push((m, size));
    }
    let mut demand = Vec::with_capacity(spec.demand.len());
    for d in &spec.demand {
        let t: Timestamp = d.last_requested.parse().map_err(|e| {
            format!(
                "spec.demand[{}].lastRequested: {:?} is not an RFC 3339 time: {e}",
                d.model, d.last_requested
            )
        })?;
        demand.push((t, d.model.as_str()));
    }
    demand.sort();
    Ok(Valid {
        budget,
        models,
        demand,
    })
}

fn parse_time(s: Option<&str>) -> Option<Timestamp> {
    s.and_then(|s| s.parse().ok())
}

/// Decides what to do about one residency.
pub fn decide(input: &Observed<'_>) -> Decision {
    let r = input.residency;
    let previous = r.status.clone().unwrap_or_default();
    match validate(r) {
        Ok(valid) => Decider::new(input, &previous, valid).run(),
        Err(problem) => invalid(input, previous, problem),
    }
}

/// The engine as a residency's status left it (residents restored in LRU
/// order), for "what would the next load evict" views.
pub fn rebuild_engine(r: &ModelResidency) -> Result<Engine, String> {
    let previous = r.status.clone().unwrap_or_default();
    let valid = validate(r)?;
    let input = Observed {
        residency: r,
        owner: OwnerReference::default(),
        pods: &[],
        now: Timestamp::now(),
    };
    let mut decider = Decider::new(&input, &previous, valid);
    decider.restore();
    Ok(decider.engine)
}

/// An invalid spec: touch no pods, say why, wait for a change.
fn invalid(input: &Observed<'_>, previous: ModelResidencyStatus, problem: String) -> Decision {
    let generation = input.residency.metadata.generation;
    let mut set = ConditionSet::new(&previous.conditions, generation, input.now);
    set.set(READY, false, "InvalidSpec", problem.clone());
    set.keep(REFUSED);
    set.keep(DEGRADED);
    let mut status = previous.clone();
    status.observed_generation = generation;
    status.conditions = set.finish();
    let changed = previous
        .conditions
        .iter()
        .all(|c| c.reason != "InvalidSpec" || c.message != problem);
    Decision {
        status,
        create: Vec::new(),
        delete: Vec::new(),
        notes: changed
            .then_some(Note {
                model: None,
                warning: true,
                reason: "InvalidSpec",
                action: "Validate",
                message: problem,
            })
            .into_iter()
            .collect(),
        requeue_after: None,
        load_seconds: Vec::new(),
    }
}

/// What happened to a model in this reconcile, before pods are considered.
struct Outcome {
    state: ModelState,
    reason: &'static str,
    message: String,
}

struct Decider<'a> {
    input: &'a Observed<'a>,
    previous: &'a ModelResidencyStatus,
    prev_models: HashMap<&'a str, &'a ModelStatus>,
    valid: Valid<'a>,
    engine: Engine,
    outcomes: HashMap<String, Outcome>,
    /// Per model: (lastRequested, lastUsed) after this reconcile.
    requested: HashMap<String, (Option<String>, Option<String>)>,
    notes: Vec<Note>,
}

impl<'a> Decider<'a> {
    fn new(input: &'a Observed<'a>, previous: &'a ModelResidencyStatus, valid: Valid<'a>) -> Self {
        let prev_models = previous
            .models
            .iter()
            .map(|m| (m.name.as_str(), m))
            .collect();
        Decider {
            input,
            previous,
            prev_models,
            valid,
            engine: Engine::new(0),
            outcomes: HashMap::new(),
            requested: HashMap::new(),
            notes: Vec::new(),
        }
    }

    fn run(mut self) -> Decision {
        let removed = self.restore();
        self.apply_spec_changes(&removed);
        self.apply_demand();
        self.settle()
    }

    fn prev_size(&self, name: &str) -> Option<Bytes> {
        self.prev_models
            .get(name)
            .filter(|m| m.state.is_resident())
            .and_then(|m| m.size.as_deref())
            .and_then(|s| parse_bytes(s).ok())
            // A hand-edited status may say anything; zero is no size.
            .filter(|&s| s > 0)
    }

    /// Rebuilds the engine as the previous status left it. Returns the
    /// resident models that are no longer in the registry.
    fn restore(&mut self) -> Vec<String> {
        let prev_budget = self
            .previous
            .budget
            .as_deref()
            .and_then(|b| parse_bytes(b).ok())
            .unwrap_or(self.valid.budget);
        self.engine = Engine::new(prev_budget);
        for &(m, size) in &self.valid.models {
            let size = self.prev_size(&m.name).unwrap_or(size);
            self.engine
                .register(&m.name, size, m.pinned)
                .expect("validated: unique names, positive sizes");
        }
        let mut removed = Vec::new();
        let mut residents: Vec<&ModelStatus> = Vec::new();
        for m in &self.previous.models {
            if !m.state.is_resident() {
                continue;
            }
            if self.engine.id(&m.name).is_none() {
                let Some(size) = self.prev_size(&m.name) else {
                    continue;
                };
                if self.engine.register(&m.name, size, false).is_err() {
                    continue;
                }
                removed.push(m.name.clone());
            }
            residents.push(m);
        }
        residents.sort_by(|a, b| {
            parse_time(a.last_used.as_deref())
                .cmp(&parse_time(b.last_used.as_deref()))
                .then(a.name.cmp(&b.name))
        });
        for m in residents {
            let id = self.engine.id(&m.name).expect("registered above");
            if self.engine.restore(id).is_err() {
                // The stored status broke its own budget (edited by hand?):
                // drop the extra model rather than break the invariant.
                self.outcome(
                    &m.name,
                    ModelState::Evicted,
                    "BudgetExceeded",
                    format!(
                        "{} did not fit the recorded budget when the state was rebuilt",
                        m.name
                    ),
                );
            }
        }
        let peak = self
            .previous
            .peak
            .as_deref()
            .and_then(|p| parse_bytes(p).ok())
            .unwrap_or(0);
        self.engine.resume(self.previous.counters.into(), peak);
        removed
    }

    fn outcome(&mut self, model: &str, state: ModelState, reason: &'static str, message: String) {
        self.outcomes.insert(
            model.to_owned(),
            Outcome {
                state,
                reason,
                message,
            },
        );
    }

    fn evicted(&mut self, victims: Vec<String>, reason: &'static str, why: &str) {
        for v in victims {
            let message = format!("{v} was evicted {why}");
            self.outcome(&v, ModelState::Evicted, reason, message);
        }
    }

    fn names(&self, ids: &[crate::engine::ModelId]) -> Vec<String> {
        ids.iter()
            .map(|&id| self.engine.name(id).to_owned())
            .collect()
    }

    fn apply_spec_changes(&mut self, removed: &[String]) {
        for name in removed {
            let id = self.engine.id(name).expect("registered in restore");
            if self.engine.deregister(id) {
                let message = format!("{name} was removed from spec.models and unloaded");
                // A still-demanded model keeps a status entry, whose
                // transition makes the event; otherwise say it here.
                if !self.valid.demand.iter().any(|&(_, m)| m == name) {
                    self.notes.push(Note {
                        model: Some(name.clone()),
                        warning: false,
                        reason: "Unloaded",
                        action: "Unload",
                        message: message.clone(),
                    });
                }
                self.outcome(name, ModelState::Unloaded, "RemovedFromRegistry", message);
            }
        }
        for i in 0..self.valid.models.len() {
            let (m, size) = self.valid.models[i];
            let id = self.engine.id(&m.name).expect("registered");
            if self.engine.size(id) == size {
                continue;
            }
            let old = self.engine.size(id);
            let resized = match self.engine.resize(id, size).expect("positive size") {
                Resize::NotResident => Ok(Vec::new()),
                Resize::Kept { evicted } => Ok(evicted.to_vec()),
                Resize::Dropped(reason) => Err(reason),
            };
            match resized {
                Ok(evicted) if evicted.is_empty() => {}
                Ok(evicted) => {
                    let victims = self.names(&evicted);
                    let why = format!(
                        "to make room for {}, which grew from {} to {}",
                        m.name,
                        format_bytes(old),
                        format_bytes(size)
                    );
                    self.evicted(victims, "MadeRoom", &why);
                }
                Err(reason) => {
                    let message = refusal_message(&m.name, &reason);
                    self.outcome(&m.name, ModelState::Refused, reason.as_str(), message);
                }
            }
        }
        let budget = self.valid.budget;
        let victims = self.engine.set_budget(budget).to_vec();
        let victims = self.names(&victims);
        let why = format!("because the budget shrank to {}", format_bytes(budget));
        self.evicted(victims, "BudgetShrunk", &why);
    }

    fn apply_demand(&mut self) {
        // Removed demand entries unload.
        let demanded: std::collections::HashSet<&str> =
            self.valid.demand.iter().map(|&(_, m)| m).collect();
        for id in self.engine.residents() {
            let name = self.engine.name(id).to_owned();
            if !demanded.contains(name.as_str()) {
                self.engine.unload(id);
                let message = format!("{name} unloaded: its demand entry was removed");
                self.outcome(&name, ModelState::Unloaded, "DemandRemoved", message);
            }
        }
        // New requests, oldest first.
        let demand = std::mem::take(&mut self.valid.demand);
        for &(t, model) in &demand {
            let watermark = self
                .prev_models
                .get(model)
                .and_then(|m| parse_time(m.last_requested.as_deref()));
            if watermark.is_some_and(|w| t <= w) {
                continue;
            }
            let when = t.to_string();
            let Some(id) = self.engine.id(model) else {
                self.engine.request_named(model);
                self.requested.insert(model.to_owned(), (Some(when), None));
                let message = format!("{model} is not in spec.models; demand for it is refused");
                self.outcome(model, ModelState::Refused, "UnknownModel", message);
                continue;
            };
            let admission = match self.engine.request(id) {
                Admission::Hit => Ok(None),
                Admission::Loaded { evicted } => Ok(Some(evicted.to_vec())),
                Admission::Refused(reason) => Err(reason),
            };
            let used = match admission {
                Ok(None) => true,
                Ok(Some(evicted)) => {
                    let victims = self.names(&evicted);
                    self.outcomes.remove(model);
                    self.evicted(victims, "MadeRoom", &format!("to make room for {model}"));
                    true
                }
                Err(reason) => {
                    let message = refusal_message(model, &reason);
                    self.outcome(model, ModelState::Refused, reason.as_str(), message);
                    false
                }
            };
            let entry = self.requested.entry(model.to_owned()).or_default();
            entry.0 = Some(when.clone());
            if used {
                entry.1 = Some(when);
            }
        }
        self.valid.demand = demand;
    }

    /// Reconciles pods with the engine's resident set and writes the status.
    fn settle(mut self) -> Decision {
        let input = self.input;
        let r = input.residency;
        let residency_name = r.metadata.name.clone().unwrap_or_default();
        let budget = self.valid.budget;
        let mut create = Vec::new();
        let mut delete = Vec::new();
        let mut requeue: Option<Duration> = None;
        let mut load_seconds = Vec::new();

        // Pods by model; VRAM held by every pod that has not finished.
        let mut pods: BTreeMap<&str, Vec<&ModelPod>> = BTreeMap::new();
        let mut live_declared: Bytes = 0;
        for p in input.pods {
            pods.entry(p.model.as_str()).or_default().push(p);
            if p.phase == PodPhase::Live {
                let size = p.size.unwrap_or_else(|| {
                    self.engine
                        .id(&p.model)
                        .map(|id| self.engine.size(id))
                        .unwrap_or(0)
                });
                live_declared += size;
            }
        }
        // Pods of models no longer in the registry.
        for p in input.pods {
            if self.engine.id(&p.model).is_none() && !p.deleting {
                delete.push((p.name.clone(), p.uid.clone()));
            }
        }

        let mut states: BTreeMap<String, ModelStatus> = BTreeMap::new();
        // Residents first, least recently used first, so older models get
        // their pods first when room opens up.
        let residents = self.engine.residents();
        let order: Vec<(&ModelSpec, Bytes)> = {
            let mut v: Vec<(&ModelSpec, Bytes)> = self.valid.models.clone();
            let rank: HashMap<&str, usize> = residents
                .iter()
                .enumerate()
                .map(|(i, &id)| (self.engine.name(id), i))
                .collect();
            v.sort_by_key(|(m, _)| rank.get(m.name.as_str()).copied().unwrap_or(usize::MAX));
            v
        };
        for (m, _) in order {
            let id = self.engine.id(&m.name).expect("registered");
            let size = self.engine.size(id);
            let prev = self.prev_models.get(m.name.as_str()).copied();
            let (last_requested, last_used) =
                self.requested.get(&m.name).cloned().unwrap_or_default();
            let mut st = ModelStatus {
                name: m.name.clone(),
                size: Some(format_bytes(size)),
                last_requested: last_requested
                    .or_else(|| prev.and_then(|p| p.last_requested.clone())),
                last_used: last_used.or_else(|| prev.and_then(|p| p.last_used.clone())),
                ..ModelStatus::default()
            };
            let model_pods = pods.get(m.name.as_str()).cloned().unwrap_or_default();
            if self.engine.is_resident(id) {
                let live = model_pods
                    .iter()
                    .find(|p| p.phase == PodPhase::Live && !p.deleting);
                let failed = model_pods
                    .iter()
                    .find(|p| p.phase == PodPhase::Finished && !p.deleting);
                let prev_failures = prev.map(|p| p.failures).unwrap_or(0);
                if let Some(p) = live.filter(|p| p.size.is_some_and(|s| s != size)) {
                    // Declared with an old size: replace it so the budget
                    // check sees the new one.
                    delete.push((p.name.clone(), p.uid.clone()));
                    st.state = ModelState::Loading;
                    st.reason = Some("Resized".into());
                    st.message = Some(format!(
                        "{} is restarting with its new size {}",
                        m.name,
                        format_bytes(size)
                    ));
                    st.pod = Some(p.name.clone());
                    st.failures = prev_failures;
                } else if let Some(p) = live {
                    st.pod = Some(p.name.clone());
                    match &p.ready_since {
                        Some(since) => {
                            st.state = ModelState::Loaded;
                            st.loaded_at = Some(since.clone());
                            if prev.is_none_or(|p| p.state != ModelState::Loaded)
                                && let (Some(ready), Some(created)) =
                                    (parse_time(Some(since)), parse_time(p.created.as_deref()))
                            {
                                load_seconds.push(created.duration_until(ready).as_secs_f64());
                            }
                        }
                        None => {
                            st.state = ModelState::Loading;
                            st.reason = Some("PodStarting".into());
                            st.message = Some(format!("{} is starting", p.name));
                            st.failures = prev_failures;
                        }
                    }
                } else if let Some(p) = failed {
                    delete.push((p.name.clone(), p.uid.clone()));
                    let failures = prev_failures + 1;
                    let delay = retry_delay(failures);
                    st.state = ModelState::Failed;
                    st.failures = failures;
                    st.retry_at = Some(
                        (input.now + SignedDuration::try_from(delay).unwrap_or_default())
                            .to_string(),
                    );
                    st.reason = Some("PodFailed".into());
                    st.message = Some(format!(
                        "{} failed to load ({}); retry {} in {}s",
                        m.name,
                        p.failure.as_deref().unwrap_or("pod failed"),
                        failures,
                        delay.as_secs()
                    ));
                    requeue = min_duration(requeue, delay);
                } else {
                    // A failed model waits for its retry time.
                    let retry_due = prev
                        .filter(|p| p.state == ModelState::Failed)
                        .and_then(|p| parse_time(p.retry_at.as_deref()))
                        .filter(|&at| at > input.now);
                    if let (Some(at), Some(p)) = (retry_due, prev) {
                        st = ModelStatus {
                            last_requested: st.last_requested,
                            last_used: st.last_used,
                            ..p.clone()
                        };
                        requeue =
                            min_duration(requeue, input.now.duration_until(at).unsigned_abs());
                    } else {
                        match build_pod(r, &input.owner, m, size) {
                            Err(problem) => {
                                st.state = ModelState::Failed;
                                st.failures = prev_failures.max(1);
                                st.reason = Some("InvalidTemplate".into());
                                st.message = Some(format!("{}: {problem}", m.name));
                            }
                            Ok(pod) if live_declared + size <= budget => {
                                live_declared += size;
                                st.state = ModelState::Loading;
                                st.pod = Some(pod_name(&residency_name, &m.name));
                                st.reason = Some("PodCreated".into());
                                st.message = Some(format!(
                                    "{} is starting",
                                    pod_name(&residency_name, &m.name)
                                ));
                                st.failures = prev_failures;
                                create.push(pod);
                            }
                            Ok(_) => {
                                st.state = ModelState::Loading;
                                st.reason = Some("WaitingForVram".into());
                                st.message = Some(format!(
                                    "{} waits for evicted pods to release VRAM ({} held by live pods, needs {}, budget {})",
                                    m.name,
                                    format_bytes(live_declared),
                                    format_bytes(size),
                                    format_bytes(budget)
                                ));
                                st.failures = prev_failures;
                            }
                        }
                    }
                }
            } else {
                for p in &model_pods {
                    if !p.deleting {
                        delete.push((p.name.clone(), p.uid.clone()));
                    }
                }
                match self.outcomes.get(&m.name) {
                    Some(o) => {
                        st.state = o.state;
                        st.reason = Some(o.reason.into());
                        st.message = Some(o.message.clone());
                    }
                    None => match prev.filter(|p| !p.state.is_resident()) {
                        Some(p) => {
                            st.state = p.state;
                            st.reason = p.reason.clone();
                            st.message = p.message.clone();
                        }
                        None => st.state = ModelState::Unloaded,
                    },
                }
            }
            states.insert(m.name.clone(), st);
        }
        // Demand for unknown models.
        for &(_, model) in &self.valid.demand {
            if self.engine.id(model).is_some() || states.contains_key(model) {
                continue;
            }
            let prev = self.prev_models.get(model).copied();
            let (last_requested, _) = self.requested.get(model).cloned().unwrap_or_default();
            let st = match (self.outcomes.get(model), prev) {
                (Some(o), _) => ModelStatus {
                    name: model.to_owned(),
                    state: o.state,
                    last_requested: last_requested
                        .or_else(|| prev.and_then(|p| p.last_requested.clone())),
                    reason: Some(o.reason.into()),
                    message: Some(o.message.clone()),
                    ..ModelStatus::default()
                },
                (None, Some(p)) if !p.state.is_resident() => p.clone(),
                _ => continue,
            };
            states.insert(model.to_owned(), st);
        }

        // Status in registry order, then unknown models by name.
        let mut models: Vec<ModelStatus> = Vec::with_capacity(states.len());
        for (m, _) in &self.valid.models {
            if let Some(st) = states.remove(&m.name) {
                models.push(st);
            }
        }
        models.extend(states.into_values());

        self.notes
            .extend(transition_notes(&self.prev_models, &models, r));
        let generation = r.metadata.generation;
        let mut set = ConditionSet::new(&self.previous.conditions, generation, input.now);
        model_conditions(&mut set, &models);
        let status = ModelResidencyStatus {
            observed_generation: generation,
            budget: Some(format_bytes(budget)),
            used: Some(format_bytes(self.engine.used())),
            peak: Some(format_bytes(self.engine.peak())),
            resident: models.iter().filter(|m| m.state.is_resident()).count() as u32,
            refused: models
                .iter()
                .filter(|m| m.state == ModelState::Refused)
                .count() as u32,
            models,
            counters: self.engine.counters().into(),
            conditions: set.finish(),
        };
        delete.sort();
        delete.dedup();
        Decision {
            status,
            create,
            delete,
            notes: self.notes,
            requeue_after: requeue,
            load_seconds,
        }
    }
}

fn min_duration(a: Option<Duration>, b: Duration) -> Option<Duration> {
    Some(a.map_or(b, |a| a.min(b)))
}

fn refusal_message(model: &str, reason: &RefuseReason) -> String {
    match *reason {
        RefuseReason::LargerThanBudget { size, budget } => format!(
            "{model} needs {}, budget is {}",
            format_bytes(size),
            format_bytes(budget)
        ),
        RefuseReason::NoEvictableRoom {
            size,
            budget,
            pinned,
        } => format!(
            "{model} needs {}, budget is {} and pinned models hold {}",
            format_bytes(size),
            format_bytes(budget),
            format_bytes(pinned)
        ),
        RefuseReason::UnknownModel => format!("{model} is not in spec.models"),
    }
}

/// One event per model state transition.
fn transition_notes(
    prev: &HashMap<&str, &ModelStatus>,
    models: &[ModelStatus],
    r: &ModelResidency,
) -> Vec<Note> {
    let mut notes = Vec::new();
    for m in models {
        let before = prev.get(m.name.as_str()).copied();
        let was = before.map(|b| b.state);
        let message = m.message.clone().unwrap_or_default();
        let note = match m.state {
            ModelState::Loaded if was != Some(ModelState::Loaded) => Some(Note {
                model: Some(m.name.clone()),
                warning: false,
                reason: "Loaded",
                action: "Load",
                message: format!(
                    "{} loaded ({}) on node {} GPU {}",
                    m.name,
                    m.size.as_deref().unwrap_or("?"),
                    r.spec.node_name,
                    r.spec.device
                ),
            }),
            ModelState::Evicted if was.is_some_and(ModelState::is_resident) => Some(Note {
                model: Some(m.name.clone()),
                warning: false,
                reason: "Evicted",
                action: "Evict",
                message,
            }),
            ModelState::Unloaded if was.is_some_and(ModelState::is_resident) => Some(Note {
                model: Some(m.name.clone()),
                warning: false,
                reason: "Unloaded",
                action: "Unload",
                message,
            }),
            ModelState::Refused
                if was != Some(ModelState::Refused)
                    || before.and_then(|b| b.last_requested.as_ref())
                        != m.last_requested.as_ref() =>
            {
                Some(Note {
                    model: Some(m.name.clone()),
                    warning: true,
                    reason: "Refused",
                    action: "Admit",
                    message,
                })
            }
            ModelState::Failed
                if was != Some(ModelState::Failed)
                    || before.is_some_and(|b| b.failures != m.failures) =>
            {
                Some(Note {
                    model: Some(m.name.clone()),
                    warning: true,
                    reason: "LoadFailed",
                    action: "Load",
                    message,
                })
            }
            _ => None,
        };
        notes.extend(note);
    }
    notes
}

#[cfg(test)]
#[path = "decide_tests.rs"]
mod tests;
