//! Where a model that is resident nowhere should be loaded: the placement
//! rule, pure (the residencies as the watch last saw them in, a choice out).
//!
//! Among the residencies whose registry has the model (its *homes*):
//! 1. never one that would refuse it (larger than its budget, or room only
//!    by evicting pinned models), one whose spec is invalid, or one that
//!    lost its GPU to another residency (`GpuConflict`) or whose claim is
//!    not allocated to it (`GpuUnavailable` and the other claim reasons);
//! 2. one that holds a sleeping copy of it (the warm tier: a wake, seconds,
//!    where anywhere else is a load), whose evictions hurt least as in 4;
//! 3. one where it fits without evicting anything, the most free VRAM
//!    first;
//! 4. else the one whose evictions hurt least: the most recently used of
//!    the models it would evict was used longest ago;
//! 5. else one where it would be queued behind models still loading (a
//!    loading model is never evicted), the least loading VRAM first;
//! 6. else one whose GPU claim is still being made or allocated (claim
//!    mode): the request waits for it;
//! 7. ties by namespace/name.
//!
//! Loads the caller has requested and the residency has not processed yet
//! (`pending`) count as admitted, loading, on their home: requests that
//! come at once would otherwise all see the same empty GPU and pile onto
//! it, evicting each other there while another GPU stays empty.
//!
//! Loads nowhere: every home refuses it, each with its sizes.

use crate::api::{ModelResidency, ModelResidencyStatus};
use crate::engine::{Admission, Bytes, Engine, ModelId};
use crate::residency::reasons::refusal_message;
use crate::residency::state::{recorded_time, restore, validate};
use k8s_openapi::jiff::Timestamp;
use kube::ResourceExt;
use std::collections::HashMap;

/// What loading the model would cost on one home.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
enum Cost {
    /// Sleeps there: a wake, not a load (what it would evict, as for a
    /// load, breaks ties).
    Wakes(Option<Timestamp>),
    /// Fits as is; `Reverse` so more free VRAM sorts first.
    Fits(std::cmp::Reverse<Bytes>),
    /// Evicts models; the newest last use among them (sooner is cheaper).
    Evicts(Option<Timestamp>),
    /// Waits for models still loading, holding this much VRAM.
    Queued(Bytes),
    /// Waits for its GPU: its claim is being made or allocated (claim
    /// mode), so nothing is known of its room yet; the loads already sent
    /// there, fewest first (a burst spreads over such GPUs).
    Pending(usize),
}

/// The placement of a load.
#[derive(Debug, PartialEq, Eq)]
pub enum Placement {
    /// Load it on `homes[i]`.
    On(usize),
    /// Every home refuses it: `why` says why, with the sizes; `refusing`
    /// are the homes that refuse it by size (the others are unusable).
    Nowhere { why: String, refusing: Vec<usize> },
}

/// Why a residency is no place for any load right now, if it is not:
/// another residency holds its GPU, or (claim mode) its claim is not
/// allocated to it.
/// Whether `r`'s GPU takes no new models (a device taint, its node
/// cordoned, or a taint just gone: its GpuHealthy condition).
pub fn takes_no_new_models(r: &ModelResidency) -> bool {
    r.status.as_ref().is_some_and(|s| {
        s.conditions.iter().any(|c| {
            c.type_ == super::conditions::GPU_HEALTHY
                && (c.status == "False" || c.reason == "HeldOff")
        })
    })
}

fn unusable(r: &ModelResidency) -> Option<&'static str> {
    use crate::residency::reasons::Reason;
    let conditions = &r.status.as_ref()?.conditions;
    if takes_no_new_models(r) {
        return Some(
            "its GPU takes no new models (tainted, its node cordoned, or a taint just gone: see its GpuHealthy condition)",
        );
    }
    let ready = conditions
        .iter()
        .find(|c| c.type_ == "Ready" && c.status == "False")?;
    if ready.reason == Reason::GpuConflict.as_str() {
        return Some("another residency holds its GPU");
    }
    let withheld = [
        Reason::GpuUnavailable,
        Reason::DeviceClassMissing,
        Reason::NoGpuDriver,
        Reason::NoSuchGpu,
        Reason::ClaimMissing,
    ];
    withheld
        .iter()
        .any(|w| w.as_str() == ready.reason)
        .then_some("its GPU claim is not allocated to it (see its Ready condition)")
}

/// Whether a residency waits for its GPU (claim mode): its claim is being
/// made, replaced or allocated, or no status says where it is yet. A
/// request may wait for it (the operator applies its demand once the claim
/// is allocated), after every home that can take the load now.
fn waits_for_its_gpu(r: &ModelResidency) -> bool {
    use crate::api::GpuMode;
    if r.spec.gpu.mode != GpuMode::Claim {
        return false;
    }
    let Some(status) = &r.status else {
        return true;
    };
    let placed = status
        .gpu
        .as_ref()
        .is_some_and(|g| g.node.is_some() && g.device.is_some());
    let pending = status.conditions.iter().any(|c| {
        c.type_ == "Ready"
            && c.status == "False"
            && c.reason == crate::residency::reasons::Reason::GpuPending.as_str()
    });
    pending || !placed
}

/// The newest last use among `victims`, as `status` records them.
fn newest_use(
    engine: &crate::engine::Engine,
    status: &ModelResidencyStatus,
    victims: &[crate::engine::ModelId],
) -> Option<Timestamp> {
    victims
        .iter()
        .filter_map(|&v| {
            let m = status.model(engine.name(v))?;
            recorded_time(m.last_used.as_deref())
        })
        .max()
}

/// What loading `model` on one home would take.
enum Appraisal {
    /// No place for any load now (see [`unusable`]), or its spec is invalid.
    Unusable(String),
    /// Its GPU claim is being made or allocated.
    WaitsForItsGpu,
    /// The home does not list it.
    NotListed,
    /// It would refuse the load, saying why.
    Refuses(String),
    /// It can take the load (or holds the model already: `held`) at
    /// `cost`, evicting (or putting to sleep) `victims`.
    Takes {
        held: bool,
        cost: Cost,
        victims: Vec<String>,
    },
}

/// What loading `model` on `r` would take, the loads in `pending` (models
/// requested there and not processed yet) counted as admitted, loading.
/// `restored` keeps each home's engine as its status restores it, for a
/// caller that places many models over the same homes.
fn appraise(
    model: &str,
    r: &ModelResidency,
    pending: &[&str],
    restored: &mut Restored,
) -> Appraisal {
    if let Some(why) = unusable(r) {
        return Appraisal::Unusable(why.to_owned());
    }
    if waits_for_its_gpu(r) {
        return Appraisal::WaitsForItsGpu;
    }
    let engine = match restored.engine(r) {
        Ok(e) => e,
        Err(e) => return Appraisal::Unusable(e.clone()),
    };
    let Some(id) = engine.id(model) else {
        return Appraisal::NotListed;
    };
    // A gang the operator refused here (the node's GPUs can never hold it
    // together) is refused as a model larger than its budget is: at once,
    // not held until the load timeout while its request is written again.
    if let Some(why) = crate::residency::gangs::refusals(r).remove(model) {
        return Appraisal::Refuses(format!("{model} is refused: {why}"));
    }
    let others: Vec<&str> = pending.iter().copied().filter(|&m| m != model).collect();
    if others.is_empty() {
        return appraise_on(model, id, r, engine);
    }
    let mut engine = engine.clone();
    for m in others {
        let Some(m) = engine.id(m).filter(|&m| !engine.is_resident(m)) else {
            continue;
        };
        if matches!(engine.request(m), Admission::Loaded { .. }) {
            engine.set_loading(m, true);
        }
    }
    appraise_on(model, id, r, &engine)
}

/// [`appraise`] on `r`'s engine as it stands.
fn appraise_on(model: &str, id: ModelId, r: &ModelResidency, engine: &Engine) -> Appraisal {
    let empty = ModelResidencyStatus::default();
    let status = r.status.as_ref().unwrap_or(&empty);
    let asleep = engine.is_asleep(id);
    let plan = engine.plan_load(id);
    let victims = match &plan {
        Ok(Some(v)) => v.iter().map(|&v| engine.name(v).to_owned()).collect(),
        _ => Vec::new(),
    };
    let cost = match plan {
        Ok(Some(victims)) if asleep => Cost::Wakes(newest_use(engine, status, &victims)),
        Ok(None) => Cost::Queued(engine.loading_used()),
        Ok(Some(victims)) if victims.is_empty() => Cost::Fits(std::cmp::Reverse(
            engine.budget().saturating_sub(engine.used()),
        )),
        Ok(Some(victims)) => Cost::Evicts(newest_use(engine, status, &victims)),
        Err(reason) => return Appraisal::Refuses(refusal_message(model, &reason)),
    };
    Appraisal::Takes {
        held: engine.is_resident(id) && !asleep,
        cost,
        victims,
    }
}

/// Homes' engines as their statuses restore them, each restored once: a
/// caller placing every model over the same homes (the router's model
/// list) restored each home once per model, 0.6 ms a model and GPU at
/// 1,000 models.
#[derive(Default)]
pub struct Restored {
    engines: HashMap<String, Result<Engine, String>>,
}

impl Restored {
    fn engine(&mut self, r: &ModelResidency) -> &Result<Engine, String> {
        self.engines.entry(residency_key(r)).or_insert_with(|| {
            let valid = validate(r).map_err(|e| format!("invalid spec: {e}"))?;
            let empty = ModelResidencyStatus::default();
            Ok(restore(&valid, r.status.as_ref().unwrap_or(&empty)).engine)
        })
    }
}

/// `<namespace>/<name>`: how homes are told apart and ordered (and how
/// statuses and headers name a residency).
pub fn residency_key(r: &ModelResidency) -> String {
    format!("{}/{}", r.namespace().unwrap_or_default(), r.name_any())
}

/// Chooses where to load `model` among `homes` (residencies whose registry
/// lists it); `pending` are the loads requested (in request order), as
/// `(i, m)`: model `m` on
/// `homes[i]` is not processed yet.
pub fn place(model: &str, homes: &[&ModelResidency], pending: &[(usize, &str)]) -> Placement {
    place_with(model, homes, pending, &mut Restored::default())
}

/// [`place`] with the homes' engines kept in `restored` (the same homes
/// in every call that shares it).
pub fn place_with(
    model: &str,
    homes: &[&ModelResidency],
    pending: &[(usize, &str)],
    restored: &mut Restored,
) -> Placement {
    let mut best: Option<(Cost, String, usize)> = None;
    let mut refusals = Vec::new();
    let mut refusing = Vec::new();
    for (i, r) in homes.iter().enumerate() {
        let key = residency_key(r);
        let here: Vec<&str> = pending
            .iter()
            .filter(|(j, _)| *j == i)
            .map(|&(_, m)| m)
            .collect();
        let cost = match appraise(model, r, &here, restored) {
            Appraisal::Unusable(why) => {
                refusals.push(format!("{key}: {why}"));
                continue;
            }
            Appraisal::WaitsForItsGpu => Cost::Pending(here.len()),
            Appraisal::NotListed => continue,
            Appraisal::Refuses(why) => {
                refusals.push(format!("{key}: {why}"));
                refusing.push(i);
                continue;
            }
            Appraisal::Takes { cost, .. } => cost,
        };
        if best.as_ref().is_none_or(|(c, k, _)| (cost, &key) < (*c, k)) {
            best = Some((cost, key, i));
        }
    }
    match best {
        Some((_, _, i)) => Placement::On(i),
        None => Placement::Nowhere {
            why: format!(
                "{model} cannot be loaded on any GPU that serves it: {}",
                refusals.join("; ")
            ),
            refusing,
        },
    }
}

/// Where the next copy of `model` goes among `homes` (residencies whose
/// registry lists it): one where it sleeps (a wake), else one where it fits
/// (the most free VRAM first), else one where room is made from idle models
/// only (`idle(home, name)`), whose evictions hurt least; never one that holds it
/// awake already, would queue it behind loads, waits for its GPU claim, or
/// would evict (or put to sleep) a model that is not idle. Ties by
/// namespace/name. `Err` says why no home qualifies, home by home.
pub fn place_copy(
    model: &str,
    homes: &[&ModelResidency],
    idle: impl Fn(&ModelResidency, &str) -> bool,
) -> Result<usize, String> {
    let mut best: Option<(Cost, String, usize)> = None;
    let mut why = Vec::new();
    for (i, r) in homes.iter().enumerate() {
        let key = residency_key(r);
        let (cost, victims) = match appraise(model, r, &[], &mut Restored::default()) {
            Appraisal::Takes { held: true, .. } | Appraisal::NotListed => continue,
            Appraisal::Takes {
                cost: cost @ (Cost::Wakes(_) | Cost::Fits(_) | Cost::Evicts(_)),
                victims,
                ..
            } => (cost, victims),
            Appraisal::Takes { .. } => {
                why.push(format!("{key}: only behind models still loading"));
                continue;
            }
            Appraisal::WaitsForItsGpu => {
                why.push(format!("{key}: its GPU claim is not allocated yet"));
                continue;
            }
            Appraisal::Unusable(w) | Appraisal::Refuses(w) => {
                why.push(format!("{key}: {w}"));
                continue;
            }
        };
        if let Some(busy) = victims.iter().find(|v| !idle(r, v)) {
            why.push(format!("{key}: only by evicting {busy}, which is not idle"));
            continue;
        }
        if best.as_ref().is_none_or(|(c, k, _)| (cost, &key) < (*c, k)) {
            best = Some((cost, key, i));
        }
    }
    match best {
        Some((_, _, i)) => Ok(i),
        None if why.is_empty() => Err(format!("every GPU that lists {model} holds a copy")),
        None => Err(why.join("; ")),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::api::{ModelState, ModelStatus};
    use serde_json::json;

    /// A residency with `models` (name, size, pinned) and the resident ones
    /// (name, lastUsed) in status.
    fn residency(
        name: &str,
        budget: &str,
        models: &[(&str, &str, bool)],
        resident: &[(&str, &str)],
    ) -> ModelResidency {
        let mut r: ModelResidency = serde_json::from_value(json!({
            "apiVersion": "residency.dev/v1alpha1", "kind": "ModelResidency",
            "metadata": {"name": name, "namespace": "ns"},
            "spec": {"nodeName": "n", "device": "0", "budget": budget,
                     "models": models.iter().map(|(n, s, p)| json!({"name": n, "size": s, "pinned": p})).collect::<Vec<_>>()},
        }))
        .unwrap();
        // Its claim allocated, as the operator says once it is.
        let mut status = ModelResidencyStatus {
            budget: Some(budget.into()),
            gpu: Some(Box::new(crate::api::GpuStatus {
                node: Some("n".into()),
                device: Some("gpu-0".into()),
                ..Default::default()
            })),
            ..Default::default()
        };
        for (m, used) in resident {
            let size = models.iter().find(|x| x.0 == *m).unwrap().1;
            status.models.push(ModelStatus {
                name: (*m).into(),
                state: ModelState::Loaded,
                size: Some(size.into()),
                last_used: Some((*used).into()),
                ..Default::default()
            });
        }
        r.status = Some(status);
        r
    }

    #[test]
    fn a_gpu_whose_claim_is_being_allocated_is_waited_for_last() {
        let models = [("a", "4Gi", false), ("b", "4Gi", false)];
        let full = residency("full", "4Gi", &models, &[("b", T1)]);
        let mut fresh = residency("fresh", "8Gi", &models, &[]);
        fresh.status = None;
        // Evicting on an allocated GPU beats waiting for a claim.
        assert_eq!(place("a", &[&fresh, &full], &[]), Placement::On(1));
        // Alone, it is waited for (not refused).
        assert_eq!(place("a", &[&fresh], &[]), Placement::On(0));
        // Two such GPUs: loads already sent to one go to the other.
        let mut other = residency("other", "8Gi", &models, &[]);
        other.status = None;
        assert_eq!(place("b", &[&fresh, &other], &[(0, "a")]), Placement::On(1));
        // A claim it can never have is no place at all.
        let mut lost = residency("lost", "8Gi", &models, &[]);
        lost.status.as_mut().unwrap().conditions.push(
            k8s_openapi::apimachinery::pkg::apis::meta::v1::Condition {
                type_: "Ready".into(),
                status: "False".into(),
                reason: "NoSuchGpu".into(),
                message: "no device".into(),
                observed_generation: None,
                last_transition_time: k8s_openapi::apimachinery::pkg::apis::meta::v1::Time(
                    k8s_openapi::jiff::Timestamp::UNIX_EPOCH,
                ),
            },
        );
        assert!(matches!(
            place("a", &[&lost], &[]),
            Placement::Nowhere { .. }
        ));
    }

    const T1: &str = "2026-11-30T10:00:00Z";
    const T2: &str = "2026-11-30T11:00:00Z";

    #[test]
    fn a_gpu_that_holds_a_sleeping_copy_wins_over_free_room_elsewhere() {
        let models = [("a", "4Gi", false), ("b", "4Gi", false)];
        let mut warm = residency("warm", "8Gi", &models, &[("a", T1), ("b", T2)]);
        warm.spec.models[0].sleep = Some(Box::new(
            serde_json::from_value(json!({"sleepingSize": "1Gi"})).unwrap(),
        ));
        warm.spec.warm = Some(crate::api::WarmSpec {
            host_budget: crate::api::ByteQuantity("8Gi".into()),
        });
        let st = warm.status.as_mut().unwrap();
        st.models[0].state = ModelState::Sleeping;
        st.models[0].reason = Some("Asleep".into());
        let empty = residency("empty", "16Gi", &models, &[]);
        assert_eq!(place("a", &[&empty, &warm], &[]), Placement::On(1));
        // Awake there, it is no wake: the most free VRAM wins, as before.
        warm.status.as_mut().unwrap().models[0].state = ModelState::Loaded;
        warm.status.as_mut().unwrap().models.remove(0);
        assert_eq!(place("a", &[&empty, &warm], &[]), Placement::On(0));
    }

    #[test]
    fn fitting_without_evictions_wins_then_the_most_free_vram() {
        let models = [
            ("a", "4Gi", false),
            ("b", "4Gi", false),
            ("c", "4Gi", false),
        ];
        let full = residency("full", "8Gi", &models, &[("a", T1), ("b", T1)]);
        let half = residency("half", "8Gi", &models, &[("a", T1)]);
        let empty = residency("empty", "16Gi", &models, &[]);
        assert_eq!(place("c", &[&full, &half, &empty], &[]), Placement::On(2));
        assert_eq!(place("c", &[&full, &half], &[]), Placement::On(1));
    }

    #[test]
    fn else_the_gpu_whose_victims_were_used_longest_ago() {
        let models = [
            ("a", "8Gi", false),
            ("b", "8Gi", false),
            ("c", "8Gi", false),
        ];
        let recent = residency("recent", "8Gi", &models, &[("a", T2)]);
        let stale = residency("stale", "8Gi", &models, &[("b", T1)]);
        assert_eq!(place("c", &[&recent, &stale], &[]), Placement::On(1));
        assert_eq!(place("c", &[&stale, &recent], &[]), Placement::On(0));
    }

    #[test]
    fn never_a_gpu_that_would_refuse_it() {
        let models = [
            ("p", "6Gi", true),
            ("big", "6Gi", false),
            ("huge", "20Gi", false),
        ];
        let pinned = residency("pinned", "8Gi", &models, &[("p", T1)]);
        let small = residency("small", "16Gi", &models, &[]);
        assert_eq!(place("big", &[&pinned, &small], &[]), Placement::On(1));
        let Placement::Nowhere { why, refusing } = place("huge", &[&pinned, &small], &[]) else {
            panic!("placed a model larger than every budget");
        };
        assert_eq!(refusing, vec![0, 1]);
        assert!(
            why.contains("ns/small: huge needs 20Gi, budget is 16Gi"),
            "{why}"
        );
        let Placement::Nowhere { why, .. } = place("big", &[&pinned], &[]) else {
            panic!("placed past pinned models");
        };
        assert!(why.contains("pinned models hold 6Gi"), "{why}");
    }

    #[test]
    fn loads_requested_and_not_processed_yet_count_on_their_gpu() {
        let models = [
            ("a", "4Gi", false),
            ("b", "4Gi", false),
            ("c", "4Gi", false),
            ("d", "4Gi", false),
        ];
        let x = residency("x", "8Gi", &models, &[]);
        let y = residency("y", "8Gi", &models, &[]);
        // Both empty: x by name. With a and b on their way to x, y.
        assert_eq!(place("c", &[&x, &y], &[]), Placement::On(0));
        assert_eq!(
            place("c", &[&x, &y], &[(0, "a"), (0, "b")]),
            Placement::On(1)
        );
        // x full of loads on the way, y half: y, where c fits.
        let busy = [(0, "a"), (1, "a"), (0, "b")];
        assert_eq!(place("c", &[&x, &y], &busy), Placement::On(1));
    }

    #[test]
    fn a_copy_goes_where_it_fits_then_where_only_idle_models_make_room() {
        let models = [
            ("chat", "4Gi", false),
            ("a", "4Gi", false),
            ("b", "4Gi", false),
        ];
        let holder = residency("holder", "8Gi", &models, &[("chat", T2)]);
        let full = residency("full", "8Gi", &models, &[("a", T1), ("b", T2)]);
        let half = residency("half", "8Gi", &models, &[("a", T1)]);
        let idle = |_: &ModelResidency, _: &str| true;
        // Never where it is already; where it fits before where it evicts.
        assert_eq!(place_copy("chat", &[&holder, &full, &half], idle), Ok(2));
        assert_eq!(place_copy("chat", &[&holder, &full], idle), Ok(1));
        // Not at the cost of a model with requests in flight.
        let busy_a = |_: &ModelResidency, m: &str| m != "a";
        let why = place_copy("chat", &[&holder, &full], busy_a).unwrap_err();
        assert_eq!(why, "ns/full: only by evicting a, which is not idle");
        let why = place_copy("chat", &[&holder], idle).unwrap_err();
        assert_eq!(why, "every GPU that lists chat holds a copy");
        // A GPU too small says so.
        let small = residency("small", "2Gi", &models, &[]);
        let why = place_copy("chat", &[&small], idle).unwrap_err();
        assert!(why.starts_with("ns/small: "), "{why}");
    }
}
