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
use crate::engine::{Admission, Bytes};
use crate::residency::reasons::refusal_message;
use crate::residency::state::{recorded_time, restore, validate};
use k8s_openapi::jiff::Timestamp;
use kube::ResourceExt;

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
fn unusable(r: &ModelResidency) -> Option<&'static str> {
    use crate::residency::reasons::Reason;
    let ready = r
        .status
        .as_ref()?
        .conditions
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

/// Chooses where to load `model` among `homes` (residencies whose registry
/// lists it); `pending` are the loads requested (in request order), as
/// `(i, m)`: model `m` on
/// `homes[i]` is not processed yet.
pub fn place(model: &str, homes: &[&ModelResidency], pending: &[(usize, &str)]) -> Placement {
    let empty = ModelResidencyStatus::default();
    let mut best: Option<(Cost, String, usize)> = None;
    let mut refusals = Vec::new();
    let mut refusing = Vec::new();
    for (i, r) in homes.iter().enumerate() {
        let key = format!("{}/{}", r.namespace().unwrap_or_default(), r.name_any());
        if let Some(why) = unusable(r) {
            refusals.push(format!("{key}: {why}"));
            continue;
        }
        if waits_for_its_gpu(r) {
            let cost = Cost::Pending(pending.iter().filter(|(j, _)| *j == i).count());
            if best.as_ref().is_none_or(|(c, k, _)| (cost, &key) < (*c, k)) {
                best = Some((cost, key, i));
            }
            continue;
        }
        let valid = match validate(r) {
            Ok(v) => v,
            Err(e) => {
                refusals.push(format!("{key}: invalid spec: {e}"));
                continue;
            }
        };
        let status = r.status.as_ref().unwrap_or(&empty);
        let mut engine = restore(&valid, status).engine;
        let Some(id) = engine.id(model) else {
            continue;
        };
        for &(_, m) in pending.iter().filter(|(j, m)| *j == i && *m != model) {
            let Some(m) = engine.id(m).filter(|&m| !engine.is_resident(m)) else {
                continue;
            };
            if matches!(engine.request(m), Admission::Loaded { .. }) {
                engine.set_loading(m, true);
            }
        }
        let asleep = engine.is_asleep(id);
        let cost = match engine.plan_load(id) {
            Ok(Some(victims)) if asleep => Cost::Wakes(newest_use(&engine, status, &victims)),
            Ok(None) => Cost::Queued(engine.loading_used()),
            Ok(Some(victims)) if victims.is_empty() => Cost::Fits(std::cmp::Reverse(
                engine.budget().saturating_sub(engine.used()),
            )),
            Ok(Some(victims)) => Cost::Evicts(newest_use(&engine, status, &victims)),
            Err(reason) => {
                refusals.push(format!("{key}: {}", refusal_message(model, &reason)));
                refusing.push(i);
                continue;
            }
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
            gpu: Some(crate::api::GpuStatus {
                node: Some("n".into()),
                device: Some("gpu-0".into()),
                ..Default::default()
            }),
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
}
