//! The decide step: a pure function from what the reconciler observed (the
//! spec, the previous status, the owned pods, the time, who holds the GPU,
//! which templates the API server rejected) to what it should do (pods to
//! create and delete, the new status, events to publish).
//!
//! The engine is restored from the previous status ([`crate::residency::state`]), then
//! fed, in this order:
//! 1. registry removals (unload), 2. size changes (re-admission),
//! 3. the budget (a shrink evicts), 4. removed demand entries (unload),
//! 5. demand entries not processed yet, oldest first (ties by model name).
//!
//! A residency whose GPU another (older) residency holds unloads everything
//! and processes no requests until the claim is released.
//!
//! Pods follow the engine (`settle`): a non-resident model's pod is
//! deleted; a resident model without a live pod gets one only when the
//! declared sizes of all live pods (terminating ones included, since they
//! still hold VRAM) leave room for it; a pod built for another size, node,
//! GPU or template is replaced. Nothing here does I/O, so a reconcile with
//! nothing new yields the previous status unchanged and no actions.
//!
//! By concern: [`gpu`] (whether the GPU is this residency's), [`requests`]
//! (what is asked for and what waits), [`settle`] (each model's status and
//! the residency's around them), [`resident`] (a resident model's pod
//! through its life), [`warm`] (what sleeps and wakes), [`inventory`]
//! (what the pods hold), [`decision`] (what is yielded, and the outcome of
//! the calls written back into it), [`progress`] (a load's first moments,
//! held back from the status), [`gangs`] (a model spanning several GPUs:
//! its one pod, its sleep and wake as one).

use super::artifacts::NodeArtifacts;
use super::events::{EventReason, ModelEvent};
use super::pods::{ModelPod, build_pod};
use crate::api::{ModelResidency, ModelResidencyStatus, ModelState, ModelStatus};
use crate::controller::model_names::Shadowing;
use crate::engine::{Bytes, Engine, ModelId, RefuseReason, Resize};
use crate::quantity::format_bytes;
use crate::residency::conditions::{ConditionSet, DEGRADED, READY, REFUSED};
use crate::residency::gangs::GangPlacement;
use crate::residency::gpu::{Budget, GpuView, assumed};
use crate::residency::reasons::{Reason, refusal_message};
use crate::residency::state::{
    InvalidSpec, Restored, Valid, ValidModel, declared_budget, recorded_models, recorded_time,
    restore, validate_with_budget,
};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::OwnerReference;
use k8s_openapi::jiff::Timestamp;
use std::collections::{BTreeMap, HashMap, HashSet};
use std::time::Duration;

mod anticipate;
mod decision;
mod gangs;
mod gpu;
mod inventory;
mod progress;
mod requests;
pub use anticipate::{Forecasts, epoch_seconds, look_ahead};
pub use decision::{Decision, PodCall, PodRef};
mod resident;
mod settle;
mod warm;

/// Everything the decision depends on.
pub struct Observed<'a> {
    pub residency: &'a ModelResidency,
    pub owner: OwnerReference,
    pub pods: &'a [ModelPod],
    pub now: Timestamp,
    /// How far a request's time may be ahead of `now` and still be taken
    /// as written; a later one is taken as `now`.
    pub max_skew: Duration,
    /// The residency (`namespace/name`) that holds this one's GPU, when it
    /// is another (devicePlugin and env mode).
    pub gpu_holder: Option<&'a str>,
    /// The GPU: where the pods go and how they get it, or why it is not
    /// this residency's (yet).
    pub gpu: GpuView,
    /// Models whose pod the API server rejected (a server-side dry run),
    /// with its message.
    pub rejected_templates: &'a BTreeMap<String, String>,
    /// The residency's node's artifact cache, as its agent reports it
    /// (none: no agent, so models with an artifact wait in Fetching).
    pub artifacts: Option<&'a NodeArtifacts>,
    /// Its names that other namespaces' residencies list too.
    pub shadowing: Shadowing,
    /// Its models' forecasts, with `spec.anticipate` on (none: nothing is
    /// done ahead of demand).
    pub forecasts: Option<&'a Forecasts>,
    /// Whether its GPU may take models (device taints, node cordon).
    pub health: crate::residency::health::GpuHealth,
}

/// Requests may be this far ahead of the operator's clock by default.
pub const DEFAULT_MAX_SKEW: Duration = Duration::from_secs(60);

/// How long after the request that admitted it a loading model is kept
/// from eviction (the router's default `--load-timeout`): a pod that never
/// becomes Ready (an image that cannot be pulled) must not hold its room
/// against every later request for ever.
pub const LOADING_PROTECTION: Duration = Duration::from_secs(600);

/// How long after its pod became Ready (or it woke) a model is still no
/// victim of a request that was queued (behind loads): the requests that
/// waited for it reach it through the routers, which learn it is Ready from
/// the status this operator writes. Evicted at once by the queued request,
/// it was gone before they saw it, and each of them had it loaded a second
/// time (a CI run: 18 loads for 17 held requests). Short next to a load
/// (30-90 s for a real model). Ready times are whole seconds, hence 5 s,
/// not 1 s. A request that was not queued evicts by the seed's LRU (the
/// operator's counters stay the engine's).
pub const FRESH_LOAD_GRACE: Duration = Duration::from_secs(5);

impl<'a> Observed<'a> {
    /// What a reconcile observes in the common case: the GPU where the
    /// spec says ([`assumed`]), no GPU conflict, no rejected template, the
    /// default clock skew allowance.
    pub fn new(
        residency: &'a ModelResidency,
        owner: OwnerReference,
        pods: &'a [ModelPod],
        now: Timestamp,
    ) -> Self {
        static NONE: BTreeMap<String, String> = BTreeMap::new();
        Observed {
            residency,
            owner,
            pods,
            now,
            max_skew: DEFAULT_MAX_SKEW,
            gpu_holder: None,
            gpu: GpuView::Placed(assumed(residency)),
            rejected_templates: &NONE,
            artifacts: None,
            shadowing: Shadowing::default(),
            forecasts: None,
            health: Default::default(),
        }
    }
}

/// Decides what to do about one residency.
pub fn decide(input: &Observed<'_>) -> Decision {
    let empty = ModelResidencyStatus::default();
    let previous = input.residency.status.as_ref().unwrap_or(&empty);
    let r = input.residency;
    let declared = match declared_budget(r) {
        Ok(d) => d,
        Err(problem) => return invalid(input, previous, &problem),
    };
    let fraction = r
        .spec
        .budget_fraction
        .unwrap_or(crate::api::DEFAULT_BUDGET_FRACTION);
    let memory = match &input.gpu {
        GpuView::Placed(p) => p.memory,
        GpuView::Withheld(_) => None,
    };
    let budget = crate::residency::gpu::budget(declared, memory, fraction);
    let bytes = match (&budget, &input.gpu) {
        (Some(b), _) => b.bytes,
        // Nothing loads while the GPU is withheld; the budget only rebuilds
        // the recorded state (restore prefers the recorded budget).
        (None, GpuView::Withheld(_)) => Bytes::MAX,
        (None, GpuView::Placed(_)) => return invalid(input, previous, &InvalidSpec::NoBudget),
    };
    match validate_with_budget(r, bytes) {
        Ok(valid) => {
            let mut d = Decider::new(input, previous, valid, budget).run();
            progress::hold_early_progress(&mut d, previous, input.now);
            d
        }
        Err(problem) => invalid(input, previous, &problem),
    }
}

/// An invalid spec: touch no pods, say why, wait for a change.
fn invalid(
    input: &Observed<'_>,
    previous: &ModelResidencyStatus,
    problem: &InvalidSpec,
) -> Decision {
    standing_still(
        input.residency,
        previous,
        input.now,
        EventReason::InvalidSpec,
        problem.to_string(),
    )
}

/// A residency whose ModelCatalog cannot be read (missing, or lacking a
/// model it lists): as an invalid spec, nothing is loaded, unloaded or
/// evicted; Ready=False says why, until the catalog is there.
pub fn catalog_unavailable(
    residency: &ModelResidency,
    problem: &crate::residency::catalog::CatalogProblem,
    now: Timestamp,
) -> Decision {
    let empty = ModelResidencyStatus::default();
    let previous = residency.status.as_ref().unwrap_or(&empty);
    standing_still(
        residency,
        previous,
        now,
        EventReason::CatalogUnavailable,
        problem.to_string(),
    )
}

/// Touches no pods and keeps the status as it was, but Ready=False for
/// `reason` with `problem`; its event once per new message.
fn standing_still(
    residency: &ModelResidency,
    previous: &ModelResidencyStatus,
    now: Timestamp,
    reason: EventReason,
    problem: String,
) -> Decision {
    let generation = residency.metadata.generation;
    let mut set = ConditionSet::new(&previous.conditions, generation, now);
    set.set(READY, false, reason.as_str(), problem.clone());
    set.keep(REFUSED);
    set.keep(DEGRADED);
    let mut status = previous.clone();
    status.observed_generation = generation;
    status.conditions = set.finish();
    let changed = previous
        .conditions
        .iter()
        .all(|c| c.reason != reason.as_str() || c.message != problem);
    let event = ModelEvent {
        model: None,
        reason,
        message: problem,
    };
    Decision {
        status,
        create: Vec::new(),
        delete: Vec::new(),
        events: changed.then_some(event).into_iter().collect(),
        requeue_after: None,
        load_seconds: Vec::new(),
        calls: Vec::new(),
        usage: None,
    }
}

/// What happened to a model in this reconcile, before pods are considered.
struct Outcome {
    state: ModelState,
    reason: Reason,
    message: String,
}

/// A model's request times after this reconcile (RFC 3339, as in status).
#[derive(Clone, Debug, Default)]
struct RequestTimes {
    /// The newest request processed.
    last_requested: Option<Box<str>>,
    /// The newest request that hit or loaded it: its LRU key.
    last_used: Option<Box<str>>,
}

struct Decider<'a> {
    input: &'a Observed<'a>,
    previous: &'a ModelResidencyStatus,
    prev_models: HashMap<&'a str, &'a ModelStatus>,
    valid: Valid<'a>,
    /// The budget and its source; `None` while the GPU is withheld and no
    /// budget is declared.
    budget: Option<Budget>,
    engine: Engine,
    /// Resident models that left the registry, still to be unloaded.
    removed: Vec<String>,
    /// The registry by name.
    by_name: HashMap<&'a str, ValidModel<'a>>,
    /// Whether each distinct template text builds a pod (see
    /// [`Self::template_problem`]).
    template_checks: std::cell::RefCell<HashMap<&'a str, Option<String>>>,
    outcomes: HashMap<String, Outcome>,
    requested: HashMap<String, RequestTimes>,
    /// When the next resident model goes idle.
    idle_requeue: Option<Duration>,
    events: Vec<ModelEvent>,
    /// Counted loads not announced yet (their one `Loaded` event), with
    /// when each was admitted: the last status's, then this reconcile's.
    unannounced: HashMap<String, Box<str>>,
    /// Models chosen to sleep and requested again before their sleep was
    /// sent (counted by the engine as a sleep and a wake).
    cancelled_sleeps: u64,
    /// Loads of gangs admitted here whose head counts them: a gang's load
    /// is one load, in its head's counters.
    gang_loads_elsewhere: u64,
    /// The gangs the coordinator placed on this GPU, and those it refused
    /// where they were asked for here ([`crate::residency::gangs`]).
    gangs: BTreeMap<String, GangPlacement>,
    gang_refusals: BTreeMap<String, String>,
    /// Models brought in ahead of demand and not requested since, with
    /// when ([`anticipate`]).
    anticipated: HashMap<String, Box<str>>,
    /// Whether the GPU takes new models, and when a hold-off ends.
    health: (crate::residency::health::GpuHealth, Option<Duration>),
}

impl<'a> Decider<'a> {
    fn new(
        input: &'a Observed<'a>,
        previous: &'a ModelResidencyStatus,
        valid: Valid<'a>,
        budget: Option<Budget>,
    ) -> Self {
        let prev_models = recorded_models(previous).map(|m| (&*m.name, m)).collect();
        let unannounced = recorded_models(previous)
            .filter_map(|m| Some((m.name.to_string(), m.admitted_at.clone()?)))
            .collect();
        let anticipated = recorded_models(previous)
            .filter_map(|m| Some((m.name.to_string(), m.anticipated_at.clone()?)))
            .collect();
        let Restored {
            engine,
            removed,
            overflow,
        } = restore(&valid, previous);
        let by_name = valid
            .models
            .iter()
            .map(|m| (m.spec.name.as_str(), *m))
            .collect();
        let mut decider = Decider {
            input,
            previous,
            prev_models,
            valid,
            budget,
            engine,
            removed,
            by_name,
            template_checks: Default::default(),
            outcomes: HashMap::new(),
            requested: HashMap::new(),
            idle_requeue: None,
            events: Vec::new(),
            unannounced,
            cancelled_sleeps: 0,
            gang_loads_elsewhere: 0,
            gangs: crate::residency::gangs::placements(input.residency),
            gang_refusals: crate::residency::gangs::refusals(input.residency),
            anticipated,
            health: gpu::effective_health(input, previous),
        };
        decider.end_old_protections();
        decider.end_ready_loads();
        decider.drop_lost_sleepers();
        for name in overflow {
            let message =
                format!("{name} did not fit the recorded budget when the state was rebuilt");
            decider.outcome(&name, ModelState::Evicted, Reason::BudgetExceeded, message);
        }
        decider
    }

    fn run(mut self) -> Decision {
        self.unload_removed();
        if let Some((reason, message)) = self.withheld() {
            self.yield_gpu(reason, message);
        } else {
            self.readmit_resized();
            self.apply_budget();
            self.unload_undemanded();
            self.apply_requests();
            self.retire_removed_copies();
            self.sleep_gangs();
            self.unload_idle();
            self.anticipate();
        }
        self.account_anticipated();
        self.settle()
    }

    /// How many GPUs `model` spans (1 for a model not declared here).
    fn width(&self, model: &str) -> usize {
        self.by_name
            .get(model)
            .map_or(1, |m| crate::residency::gangs::width(m.spec))
    }

    /// This residency's name.
    fn me(&self) -> &'a str {
        self.input
            .residency
            .metadata
            .name
            .as_deref()
            .unwrap_or_default()
    }

    /// The placement of gang `model` that includes this GPU.
    fn gang_here(&self, model: &str) -> Option<&GangPlacement> {
        self.gangs.get(model).filter(|g| g.includes(self.me()))
    }

    fn event(&mut self, model: &str, reason: EventReason, message: String) {
        self.events.push(ModelEvent::about(model, reason, message));
    }

    fn outcome(&mut self, model: &str, state: ModelState, reason: Reason, message: String) {
        let outcome = Outcome {
            state,
            reason,
            message,
        };
        self.outcomes.insert(model.to_owned(), outcome);
    }

    fn evicted(&mut self, victims: &[ModelId], reason: Reason, why: &str) {
        for &v in victims {
            let name = self.engine.name(v).to_owned();
            let message = format!("{name} was evicted {why}");
            self.event(&name, EventReason::Evicted, message.clone());
            self.outcome(&name, ModelState::Evicted, reason, message);
        }
    }

    fn refused(&mut self, model: &str, reason: &RefuseReason) {
        let message = refusal_message(model, reason);
        self.event(model, EventReason::Refused, message.clone());
        self.outcome(model, ModelState::Refused, reason.into(), message);
    }

    /// Registry removals unload.
    fn unload_removed(&mut self) {
        for name in std::mem::take(&mut self.removed) {
            let id = self.engine.id(&name).expect("registered in restore");
            if !self.engine.deregister(id) {
                continue;
            }
            let message = format!("{name} was removed from spec.models and unloaded");
            self.event(&name, EventReason::Unloaded, message.clone());
            self.outcome(
                &name,
                ModelState::Unloaded,
                Reason::RemovedFromRegistry,
                message,
            );
        }
    }

    /// Size changes re-admit the model under the same rules.
    fn readmit_resized(&mut self) {
        for i in 0..self.valid.models.len() {
            let m = self.valid.models[i];
            let id = self.engine.id(m.name()).expect("registered");
            let old = self.engine.size(id);
            if old == m.size {
                continue;
            }
            let evicted = match self.engine.resize(id, m.size).expect("positive size") {
                Resize::NotResident => continue,
                Resize::Kept { evicted } => evicted.to_vec(),
                Resize::Dropped(reason) => {
                    self.refused(m.name(), &reason);
                    continue;
                }
            };
            let why = format!(
                "to make room for {}, which grew from {} to {}",
                m.name(),
                format_bytes(old),
                format_bytes(m.size)
            );
            self.evicted(&evicted, Reason::MadeRoom, &why);
        }
    }

    /// A budget shrink evicts least recently used residents.
    fn apply_budget(&mut self) {
        let budget = self.valid.budget;
        let victims = self.engine.set_budget(budget).to_vec();
        let why = format!("because the budget shrank to {}", format_bytes(budget));
        self.evicted(&victims, Reason::BudgetShrunk, &why);
    }

    /// Removed demand entries unload.
    fn unload_undemanded(&mut self) {
        let demanded: HashSet<&str> = self.valid.demand.iter().map(|r| r.model).collect();
        for id in self.engine.residents() {
            let name = self.engine.name(id).to_owned();
            if !demanded.contains(name.as_str()) {
                self.engine.unload(id);
                let message = format!("{name} unloaded: its demand entry was removed");
                self.event(&name, EventReason::Unloaded, message.clone());
                self.outcome(&name, ModelState::Unloaded, Reason::DemandRemoved, message);
            }
        }
    }

    /// Copies the copy scaler retires (their pod annotated with a time, no
    /// request for them there since): to sleep when they can, else unloaded.
    /// Their demand entry stays, processed, so nothing loads them back.
    fn retire_removed_copies(&mut self) {
        for id in self.engine.residents() {
            if self.engine.is_asleep(id) || self.engine.is_loading(id) {
                continue;
            }
            let name = self.engine.name(id).to_owned();
            let retire_at = self
                .input
                .pods
                .iter()
                .filter(|p| *p.model == *name && !p.deleting)
                .find_map(|p| recorded_time(p.retire_at.as_deref()));
            let Some(retire_at) = retire_at else {
                continue;
            };
            let requested = self.valid.demand.iter().find(|r| r.model == name);
            if requested.is_some_and(|r| r.at > retire_at) {
                // Asked for again since: it stays.
                continue;
            }
            let asleep = format!("{name} goes to sleep: its copy was removed");
            let unloaded = format!("{name} unloaded: its copy was removed");
            self.sleep_or_unload(id, &name, asleep, (Reason::CopyRemoved, unloaded));
        }
    }

    /// Puts `name` to sleep (dropping sleepers for its host memory), or,
    /// where it cannot sleep, unloads it, with `unloaded`'s reason and
    /// words.
    fn sleep_or_unload(
        &mut self,
        id: ModelId,
        name: &str,
        asleep: String,
        unloaded: (Reason, String),
    ) {
        if let Some(dropped) = self.engine.retire(id) {
            let dropped = dropped.to_vec();
            let why = format!("to make host memory for {name}'s sleep");
            self.evicted(&dropped, Reason::MadeRoom, &why);
            self.outcome(name, ModelState::Sleeping, Reason::FallingAsleep, asleep);
            return;
        }
        self.engine.unload(id);
        let (reason, message) = unloaded;
        self.event(name, EventReason::Unloaded, message.clone());
        self.outcome(name, ModelState::Unloaded, reason, message);
    }

    /// Why a model's pod cannot be made, if it cannot: the template does
    /// not build, or the API server rejected it.
    fn template_problem(&self, model: &str) -> Option<String> {
        if let Some(message) = self.input.rejected_templates.get(model) {
            return Some(format!("the API server rejects its pod: {message}"));
        }
        let m = *self.by_name.get(model)?;
        // Whether a template builds depends on its text alone, and a
        // registry may repeat one template thousands of times.
        let text = m.spec.template.as_ref().map_or("", |t| t.json());
        let mut checked = self.template_checks.borrow_mut();
        let fallback;
        let gpu = match self.placement() {
            Some(p) => p,
            None => {
                fallback = assumed(self.input.residency);
                &fallback
            }
        };
        checked
            .entry(text)
            .or_insert_with(|| {
                build_pod(self.input.residency, &self.input.owner, m.spec, m.size, gpu).err()
            })
            .clone()
    }
}

#[cfg(test)]
mod tests;
