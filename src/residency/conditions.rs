//! Status conditions: named constructors, and a lastTransitionTime that
//! moves only when a condition's status does.

use super::reasons::Reason;
use crate::api::{ModelState, ModelStatus};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::{Condition, Time};
use k8s_openapi::jiff::Timestamp;

pub const READY: &str = "Ready";
pub const REFUSED: &str = "Refused";
pub const DEGRADED: &str = "Degraded";
/// True while spec.budget is cut to the device's memory (claim mode).
pub const BUDGET_EXCEEDS_DEVICE: &str = "BudgetExceedsDevice";
/// True while a model that sleeps holds more host memory asleep than
/// spec.warm.hostBudget: it can never sleep, and is deleted instead.
pub const CANNOT_SLEEP: &str = "CannotSleep";
/// True while the registry declares LoRA adapters that can never be
/// served (a rank past the base's maxRank, a model's name): requests for
/// them are refused by the router, never sent.
pub const ADAPTERS_REFUSED: &str = "AdaptersRefused";

/// True while a name this residency lists belongs to another namespace
/// (its oldest lister's): a router serving every namespace sends requests
/// for it there. False, with who else lists them, on the names' owner.
pub const NAME_SHADOWED: &str = "NameShadowed";

/// False while the GPU takes no new models (a NoSchedule or NoExecute
/// taint on its device, its node cordoned); True once that went (reason
/// `HeldOff` for `health::HOLD_OFF`, then `TaintRemoved`). Absent on a
/// GPU that was never unhealthy.
pub const GPU_HEALTHY: &str = "GpuHealthy";

/// Builds conditions against the previous ones, keeping each one's
/// `lastTransitionTime` unless its status flips.
pub struct ConditionSet<'a> {
    previous: &'a [Condition],
    generation: Option<i64>,
    now: Timestamp,
    out: Vec<Condition>,
}

impl<'a> ConditionSet<'a> {
    pub fn new(previous: &'a [Condition], generation: Option<i64>, now: Timestamp) -> Self {
        ConditionSet {
            previous,
            generation,
            now,
            out: Vec::new(),
        }
    }

    pub fn set(&mut self, type_: &str, status: bool, reason: &str, message: String) {
        let status = if status { "True" } else { "False" };
        let since = self
            .previous
            .iter()
            .find(|c| c.type_ == type_ && c.status == status)
            .map(|c| c.last_transition_time.clone())
            .unwrap_or(Time(self.now));
        self.out.push(Condition {
            type_: type_.into(),
            status: status.into(),
            reason: reason.into(),
            message,
            observed_generation: self.generation,
            last_transition_time: since,
        });
    }

    /// Keeps a previous condition as it was (for an invalid spec, where only
    /// Ready is re-evaluated).
    pub fn keep(&mut self, type_: &str) {
        if let Some(c) = self.previous.iter().find(|c| c.type_ == type_) {
            self.out.push(c.clone());
        }
    }

    pub fn finish(self) -> Vec<Condition> {
        self.out
    }
}

/// Ready, Refused and Degraded for a set of model states.
///
/// Ready says the residency is healthy and converging: a model loading is
/// normal (the count of loading models is in status), so only a GPU that is
/// not this residency's (`withheld`: the reason and message) makes it False
/// here (an invalid spec is decided elsewhere). Degraded stays True from a failed load until a load of that
/// model succeeds or it is no longer wanted, and while a template is
/// invalid.
pub fn model_conditions(
    set: &mut ConditionSet<'_>,
    models: &[ModelStatus],
    withheld: Option<(&str, &str)>,
) {
    let resident: Vec<&ModelStatus> = models.iter().filter(|m| m.is_resident()).collect();
    let loaded = resident
        .iter()
        .filter(|m| m.state == ModelState::Loaded)
        .count();
    let loading: Vec<&str> = resident
        .iter()
        .filter(|m| matches!(m.state, ModelState::Loading | ModelState::Fetching))
        .map(|m| &*m.name)
        .collect();
    match withheld {
        Some((reason, message)) => set.set(READY, false, reason, message.to_owned()),
        None if loading.is_empty() => {
            let message = match loaded {
                0 => "no models resident".to_owned(),
                n => format!("{n} resident model(s) ready"),
            };
            set.set(READY, true, "AllResidentModelsReady", message);
        }
        None => set.set(
            READY,
            true,
            "Converging",
            format!(
                "{loaded} of {} resident models ready; loading {}",
                resident.len(),
                loading.join(", ")
            ),
        ),
    }

    let mut refused: Vec<&ModelStatus> = models
        .iter()
        .filter(|m| m.state == ModelState::Refused)
        .collect();
    // The newest refusal names the condition's reason.
    refused.sort_by(|a, b| {
        b.last_requested
            .cmp(&a.last_requested)
            .then(a.name.cmp(&b.name))
    });
    match refused.first() {
        None => set.set(REFUSED, false, "NoRefusals", "no refused models".into()),
        Some(newest) => set.set(
            REFUSED,
            true,
            newest.reason.as_deref().unwrap_or("Refused"),
            join_messages(&refused),
        ),
    }

    let failing: Vec<&ModelStatus> = models.iter().filter(|m| is_failing(m)).collect();
    match failing.first() {
        None => set.set(DEGRADED, false, "NoLoadFailures", "no failed loads".into()),
        Some(first) => set.set(
            DEGRADED,
            true,
            first.reason.as_deref().unwrap_or("LoadFailed"),
            join_messages(&failing),
        ),
    }
}

/// A model whose loads fail: Failed, loading again after failures (a retry
/// is not a recovery until it is Ready), or with a template that cannot
/// make a pod.
fn is_failing(m: &ModelStatus) -> bool {
    m.state == ModelState::Failed
        || (m.state == ModelState::Loading && m.failures > 0)
        || m.reason.as_deref() == Some(Reason::InvalidTemplate.as_str())
}

fn join_messages(models: &[&ModelStatus]) -> String {
    models
        .iter()
        .map(|m| m.message.as_deref().unwrap_or(&m.name).to_owned())
        .collect::<Vec<_>>()
        .join("; ")
}

#[cfg(test)]
mod tests {
    use super::*;

    fn at(s: &str) -> Timestamp {
        s.parse().unwrap()
    }

    #[test]
    fn transition_time_moves_only_when_status_flips() {
        let t0 = at("2026-11-30T03:00:00Z");
        let t1 = at("2026-11-30T04:00:00Z");
        let mut first = ConditionSet::new(&[], Some(1), t0);
        first.set(READY, true, "AllResidentModelsReady", "a".into());
        let first = first.finish();

        let mut same = ConditionSet::new(&first, Some(2), t1);
        same.set(READY, true, "AllResidentModelsReady", "b".into());
        assert_eq!(same.finish()[0].last_transition_time, Time(t0));

        let mut flipped = ConditionSet::new(&first, Some(2), t1);
        flipped.set(READY, false, "ModelsNotReady", "c".into());
        assert_eq!(flipped.finish()[0].last_transition_time, Time(t1));
    }
}
