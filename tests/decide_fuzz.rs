//! Random specs, previous statuses and pods fed to the decide step: it never
//! panics, an invalid spec touches no pods, and the pods it leaves plus the
//! ones it creates never declare more than the budget (when the pods it was
//! given did not already).

use k8s_openapi::jiff::{SignedDuration, Timestamp};
use kube::Resource;
use model_residency::api::{
    ByteQuantity, Counters, ModelResidency, ModelResidencySpec, ModelResidencyStatus, ModelSpec,
    ModelState, ModelStatus,
};
use model_residency::controller::decide::{Observed, decide};
use model_residency::controller::pods::{ModelPod, PodPhase};
use model_residency::quantity::parse_bytes;
use proptest::prelude::*;
use serde_json::json;

const NAMES: &[&str] = &["m0", "m1", "m2", "m3", "m4", "m5", "ghost"];
const GI: u64 = 1 << 30;

fn base() -> Timestamp {
    "2026-11-30T03:00:00Z".parse().unwrap()
}

fn quantity() -> impl Strategy<Value = String> {
    prop_oneof![
        24 => (1u64..12).prop_map(|g| format!("{g}Gi")),
        6 => (1u64..12_000).prop_map(|m| format!("{m}Mi")),
        1 => Just("0".to_owned()),
        1 => Just("-3Gi".to_owned()),
        1 => Just("lots".to_owned()),
        1 => Just("99999999999999Ei".to_owned()),
        1 => "[ -~]{0,8}",
    ]
}

fn time() -> impl Strategy<Value = String> {
    prop_oneof![
        9 => (0i64..600).prop_map(|s| (base() + SignedDuration::from_secs(s)).to_string()),
        1 => "[ -~]{0,12}",
    ]
}

fn state() -> impl Strategy<Value = ModelState> {
    prop_oneof![
        Just(ModelState::Loaded),
        Just(ModelState::Loading),
        Just(ModelState::Evicted),
        Just(ModelState::Refused),
        Just(ModelState::Unloaded),
        Just(ModelState::Failed),
    ]
}

fn name() -> impl Strategy<Value = String> {
    prop::sample::select(NAMES).prop_map(str::to_owned)
}

fn residency() -> impl Strategy<Value = ModelResidency> {
    let model = (quantity(), any::<bool>(), 0u8..4).prop_map(|(size, pinned, t)| ModelSpec {
        name: String::new(),
        size: ByteQuantity(size),
        pinned,
        // Now and then an idle timeout of its own.
        artifact: None,
        keep_alive: (t == 0).then(|| "90s".into()),
        template: match t {
            0 => None,
            1 => Some(json!({"spec": {"containers": []}}).into()),
            _ => Some(json!({"spec": {"containers": [{"name": "s", "image": "i"}]}}).into()),
        },
        load_time: None,
        sleep: None,
    });
    let demand = (name(), time());
    let prev_model = (
        name(),
        state(),
        prop::option::of(quantity()),
        prop::option::of(time()),
        prop::option::of(time()),
        0u32..5,
        prop::option::of(time()),
    )
        .prop_map(
            |(name, state, size, last_requested, last_used, failures, retry_at)| ModelStatus {
                name: name.into(),
                state,
                size: size.map(Into::into),
                last_requested: last_requested.map(Into::into),
                last_used: last_used.map(Into::into),
                failures,
                retry_at: retry_at.map(Into::into),
                ..ModelStatus::default()
            },
        );
    let status = (
        prop::option::of(quantity()),
        prop::option::of(quantity()),
        prop::collection::vec(prev_model, 0..8),
        any::<[u16; 5]>(),
    )
        .prop_map(|(budget, peak, models, c)| ModelResidencyStatus {
            budget,
            peak,
            models,
            counters: Counters {
                hits: c[0].into(),
                loads: c[1].into(),
                evictions: c[2].into(),
                refusals: c[3].into(),
                unloads: c[4].into(),
                ..Counters::default()
            },
            ..ModelResidencyStatus::default()
        });
    // Registry names are unique (duplicates are the unit tests' business),
    // so most specs are valid and the interesting paths run.
    let registry = (
        prop::sample::subsequence(NAMES[..6].to_vec(), 0..6),
        prop::collection::vec(model, 6),
    )
        .prop_map(|(names, mut models)| {
            models.truncate(names.len());
            for (m, n) in models.iter_mut().zip(names) {
                m.name = n.to_owned();
            }
            models
        });
    (
        prop_oneof![4 => (1u64..16).prop_map(|g| format!("{g}Gi")), 1 => quantity()],
        registry,
        prop::collection::btree_map(demand.0, demand.1, 0..8),
        prop::option::of(status),
    )
        .prop_map(|(budget, models, demand, status)| {
            let mut r = ModelResidency::new(
                "gpu",
                ModelResidencySpec {
                    node_name: Some("node-a".into()),
                    device: "0".into(),
                    gpu: Default::default(),
                    budget: Some(ByteQuantity(budget)),
                    budget_fraction: None,
                    models,
                    prefetch: 0,
                    warm: None,
                    eviction: Default::default(),
                    keep_alive: Some("5m".into()),
                    demand: demand.into(),
                },
            );
            r.metadata.namespace = Some("ns".into());
            r.metadata.uid = Some("uid".into());
            r.metadata.generation = Some(3);
            r.status = status;
            r
        })
}

fn pods() -> impl Strategy<Value = Vec<ModelPod>> {
    let pod = (
        name(),
        1u64..8,
        any::<bool>(),
        any::<bool>(),
        any::<bool>(),
        any::<bool>(),
    )
        .prop_map(|(model, gib, live, ready, deleting, sized)| ModelPod {
            name: format!("gpu-{model}").into(),
            uid: format!("uid-{model}-{gib}").into(),
            model: model.into(),
            size: sized.then_some(gib * GI),
            phase: if live {
                PodPhase::Live
            } else {
                PodPhase::Finished
            },
            ready_since: (live && ready).then(|| base().to_string().into()),
            deleting,
            access: None,
            failure: (!live).then(|| "boom".into()),
            created: Some(base().to_string().into()),
            // Now and then a pod left on another node (a residency moved).
            node: Some(if gib % 3 == 0 { "elsewhere" } else { "node-a" }.into()),
            device: None,
            template_hash: None,
            waiting: None,
            reported: true,
            addr: None,
        });
    prop::collection::vec(pod, 0..6)
}

fn declared(p: &ModelPod, r: &ModelResidency) -> u64 {
    p.size.unwrap_or_else(|| {
        r.spec
            .models
            .iter()
            .find(|m| *m.name == *p.model)
            .and_then(|m| parse_bytes(&m.size.0).ok())
            .unwrap_or(0)
    })
}

static VALID: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);

#[test]
fn most_generated_specs_are_valid() {
    // Runs the property first if needed; the property must not only ever
    // see rejected specs.
    decide_never_panics_and_keeps_the_budget();
    assert!(VALID.load(std::sync::atomic::Ordering::Relaxed) > 500);
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 2000, ..ProptestConfig::default() })]

    #[test]
    fn decide_never_panics_and_keeps_the_budget(
        r in residency(),
        pods in pods(),
        now in 0i64..900,
        conflict in prop::bool::weighted(0.1),
        withheld_claim in any::<bool>(),
        rejected in prop::collection::btree_set(name(), 0..3),
        skew in 0u64..120,
    ) {
        // Now and then another residency holds the GPU, the API server
        // rejects some templates, and the clock-skew allowance varies.
        let rejected: std::collections::BTreeMap<String, String> =
            rejected.into_iter().map(|m| (m, "rejected".to_owned())).collect();
        let owner = r.controller_owner_ref(&()).unwrap();
        let mut input = Observed::new(&r, owner, &pods, base() + SignedDuration::from_secs(now));
        // Half the GPUs lost are another residency's (declared modes),
        // half a claim that is not allocated (claim mode).
        if conflict && withheld_claim {
            input.gpu = model_residency::residency::gpu::GpuView::Withheld(
                model_residency::residency::gpu::Withheld {
                    reason: model_residency::residency::reasons::Reason::GpuUnavailable,
                    message: "taken".into(),
                    status: Default::default(),
                },
            );
        } else {
            input.gpu_holder = conflict.then_some("other/gpu");
        }
        input.rejected_templates = &rejected;
        input.max_skew = std::time::Duration::from_secs(skew);
        let d = decide(&input);
        let invalid = d.status.conditions.iter().any(|c| c.reason == "InvalidSpec");
        VALID.fetch_add(u64::from(!invalid), std::sync::atomic::Ordering::Relaxed);
        if invalid {
            prop_assert!(d.create.is_empty() && d.delete.is_empty());
            return Ok(());
        }
        if conflict {
            prop_assert!(d.create.is_empty(), "a residency that does not hold its GPU loaded");
            prop_assert_eq!(d.status.resident, 0);
        }
        let budget = parse_bytes(&r.spec.budget.as_ref().unwrap().0).unwrap();
        let used = parse_bytes(d.status.used.as_deref().unwrap()).unwrap();
        prop_assert!(used <= budget, "used {} > budget {}", used, budget);
        let live_before: u64 = pods.iter().filter(|p| p.phase == PodPhase::Live).map(|p| declared(p, &r)).sum();
        let created: u64 = d
            .create
            .iter()
            .map(|p| p.metadata.annotations.as_ref().unwrap()["residency.dev/size"].parse::<u64>().unwrap())
            .sum();
        if live_before <= budget {
            // Deleted pods may still be terminating: they count until gone.
            prop_assert!(live_before + created <= budget, "{} + {} > {}", live_before, created, budget);
        }
        for pod in &d.create {
            let model = &pod.metadata.labels.as_ref().unwrap()["residency.dev/model"];
            let st = d.status.model(model).unwrap();
            prop_assert_eq!(st.state, ModelState::Loading);
        }
        prop_assert_eq!(d.status.resident as usize, d.status.models.iter().filter(|m| m.is_resident()).count());
    }
}
