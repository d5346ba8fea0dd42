//! Work ahead of demand (`spec.anticipate`, #69): each reconcile of a
//! residency that has it on asks the engine's [`plan`] which models its
//! forecasts expect within their load time, and loads or wakes them as a
//! request would (the same room made by the same policy, never a pinned
//! or loading model moved out, never over a budget) without counting a
//! use. A model brought in so is marked (`anticipatedAt`) until a request
//! uses it or it leaves the GPU or falls asleep unused, which counts it as
//! used or wasted. Only models with a demand entry are brought in: one
//! whose entry an autoscaler removed was unloaded on purpose.
//!
//! Its idle unload (keepAlive) counts from when it was brought in, and a
//! model whose forecast still expects a request within the horizon is
//! kept past it.

use super::Decider;
use crate::controller::events::EventReason;
use crate::engine::anticipation::{Limits, Outlook, plan};
use crate::engine::forecast::{Forecast, SLOT_SECONDS};
use crate::engine::{Admission, ModelId};
use crate::residency::reasons::Reason;
use k8s_openapi::jiff::Timestamp;
use std::collections::{HashMap, HashSet};
use std::time::Duration;

/// Each model's forecast, by name, as the operator keeps them.
pub type Forecasts = HashMap<String, Forecast>;

/// How often a residency with anticipation on is looked at without a
/// change: the engine's `Limits::ahead` (a model needed before the next
/// look must be started at this one).
pub fn look_ahead(limits: &Limits) -> Duration {
    Duration::from_secs_f64(limits.ahead.max(1.0))
}

/// Seconds from the epoch, as the forecasts count time.
pub fn epoch_seconds(t: Timestamp) -> f64 {
    t.as_millisecond() as f64 / 1000.0
}

/// The forecasts the engine reads: the chance of a request for the
/// models that may be brought in, and for those resident (what a move
/// would cost). Any other model reads 0.
struct View<'f> {
    forecasts: HashMap<ModelId, &'f Forecast>,
    now: f64,
}

impl Outlook for View<'_> {
    fn chance_within(&self, id: ModelId, seconds: f64) -> f64 {
        self.forecasts
            .get(&id)
            .map_or(0.0, |f| f.chance_within(self.now, seconds))
    }
}

impl<'a> Decider<'a> {
    /// The limits and the forecasts, when anticipation is on here.
    fn anticipation(&self) -> Option<(Limits, &'a Forecasts)> {
        let spec = self.input.residency.spec.anticipate.as_ref()?;
        // Nothing new comes to a GPU that takes no new models.
        let healthy = *self.health() == crate::residency::health::GpuHealth::Healthy;
        (spec.enabled && healthy)
            .then(|| spec.limits())
            .zip(self.input.forecasts)
    }

    /// Whether `name`'s forecast expects a request within the horizon
    /// (kept past its keepAlive).
    pub(super) fn expected_soon(&self, name: &str) -> bool {
        let Some((limits, forecasts)) = self.anticipation() else {
            return false;
        };
        let now = epoch_seconds(self.input.now);
        forecasts
            .get(name)
            .is_some_and(|f| f.chance_within(now, limits.hold) >= limits.min_chance)
    }

    /// Loads and wakes what the forecasts expect, within the limits.
    pub(super) fn anticipate(&mut self) {
        let Some((limits, forecasts)) = self.anticipation() else {
            return;
        };
        let after = look_ahead(&limits);
        self.idle_requeue = Some(self.idle_requeue.map_or(after, |r| r.min(after)));
        let now = epoch_seconds(self.input.now);
        let demanded: HashSet<&str> = self.valid.demand.iter().map(|r| r.model).collect();
        let mut view = View {
            forecasts: HashMap::new(),
            now,
        };
        for id in self.engine.models() {
            let name = self.engine.name(id);
            let Some(f) = forecasts.get(name) else {
                continue;
            };
            let may_come = demanded.contains(name)
                && self.width(name) == 1
                && !self.prev_models.get(name).is_some_and(|p| {
                    matches!(
                        p.state,
                        crate::api::ModelState::Failed | crate::api::ModelState::Refused
                    )
                })
                && self.template_problem(name).is_none();
            if may_come || self.engine.is_resident(id) {
                view.forecasts.insert(id, f);
            }
        }
        let in_flight = self
            .anticipated
            .keys()
            .filter_map(|n| self.engine.id(n))
            .filter(|&id| self.engine.is_loading(id))
            .count();
        for m in plan(&self.engine, &view, &limits, in_flight) {
            let name = self.engine.name(m.id).to_owned();
            let (evicted, woke) = match self.engine.anticipate(m.id) {
                Admission::Loaded { evicted } => (evicted.to_vec(), false),
                Admission::Woken { evicted } => (evicted.to_vec(), true),
                _ => continue,
            };
            if !woke {
                self.load_admitted(&name);
            }
            self.admitted(m.id, &evicted);
            self.anticipated
                .insert(name.clone(), self.input.now.to_string().into());
            let c = self.engine.costs(m.id);
            let horizon = limits
                .hold
                .max(if woke { c.wake } else { c.load } + limits.ahead);
            let message = format!(
                "{name} {} ahead of demand: its forecast gives a request within {horizon:.0}s a {:.0}% chance",
                if woke { "woken" } else { "loaded" },
                m.chance * 100.0
            );
            self.event(&name, EventReason::Anticipated, message);
        }
    }

    /// What became of the models brought in ahead: used by a request of
    /// this reconcile, or gone from the GPU (or asleep) unused. Counted
    /// once each, and unmarked.
    pub(super) fn account_anticipated(&mut self) {
        let marked: Vec<String> = self.anticipated.keys().cloned().collect();
        for name in marked {
            let used = self
                .requested
                .get(&name)
                .is_some_and(|t| t.last_used.is_some());
            let here = self
                .engine
                .id(&name)
                .is_some_and(|id| self.engine.is_resident(id) && !self.engine.is_asleep(id));
            if used || !here {
                self.engine.count_anticipation(used);
                self.anticipated.remove(&name);
            }
        }
    }

    /// Each model's `anticipatedAt` and, with anticipation on, its
    /// `expectedNext`; a Loaded model brought in ahead and not requested
    /// since says so as its reason.
    pub(super) fn anticipation_fields(&self, models: &mut [crate::api::ModelStatus]) {
        let on = self.anticipation();
        let now = epoch_seconds(self.input.now);
        for st in models {
            if let Some(at) = self.anticipated.get(&*st.name) {
                st.anticipated_at = Some(at.clone());
                if st.state == crate::api::ModelState::Loaded && st.reason.is_none() {
                    st.reason = Some(Reason::Anticipated.into());
                    st.message = Some(
                        format!(
                            "{} was brought in ahead of demand at {at}: its forecast expected a request; none since",
                            st.name
                        )
                        .into(),
                    );
                }
            }
            let Some((_, forecasts)) = on else {
                continue;
            };
            st.expected_next = forecasts
                .get(&*st.name)
                .and_then(|f| f.expected_next(now))
                .and_then(|t| {
                    // The slot's start: one value for ten minutes, not a
                    // status write per reconcile.
                    let slot = (t / SLOT_SECONDS).floor() * SLOT_SECONDS;
                    Timestamp::from_second(slot as i64).ok()
                })
                .map(|t| t.to_string().into());
        }
    }
}
