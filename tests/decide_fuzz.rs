//! Random specs, previous statuses and pods fed to the decide step: it never
//! panics, an invalid spec touches no pods, and the pods it leaves plus the
//! ones it creates never declare more than the budget (when the pods it was
//! given did not already).

use k8s_openapi::jiff::{SignedDuration, Timestamp};
use kube::Resource;
use model_residency::api::{
    ByteQuantity, Counters, EvictionPolicy, ModelResidency, ModelResidencySpec,
    ModelResidencyStatus, ModelSpec, ModelState, ModelStatus,
};
use model_residency::controller::decide::{Decision, Observed, decide};
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

/// A recorded rate: mostly plausible, sometimes not a rate at all.
fn rate() -> impl Strategy<Value = f64> {
    prop_oneof![
        8 => 0.0f64..50.0,
        1 => Just(f64::NAN),
        1 => Just(f64::INFINITY),
        1 => Just(-3.0),
        1 => Just(f64::MAX),
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
        1 => Just(ModelState::Loaded),
        1 => Just(ModelState::Loading),
        1 => Just(ModelState::Evicted),
        1 => Just(ModelState::Refused),
        1 => Just(ModelState::Unloaded),
        1 => Just(ModelState::Failed),
        3 => Just(ModelState::Sleeping),
    ]
}

/// A reason a previous status may give, the warm tier's among them.
fn reason() -> impl Strategy<Value = Option<Box<str>>> {
    prop::option::of(prop::sample::select(
        &[
            "Asleep",
            "FallingAsleep",
            "Waking",
            "MadeRoom",
            "PodCreated",
        ][..],
    ))
    .prop_map(|r| r.map(Into::into))
}

fn name() -> impl Strategy<Value = String> {
    prop::sample::select(NAMES).prop_map(str::to_owned)
}

fn residency() -> impl Strategy<Value = ModelResidency> {
    let model = (quantity(), any::<bool>(), 0u8..4).prop_map(|(size, pinned, t)| ModelSpec {
        // Now and then a model that sleeps (at 512Mi, its size in host
        // memory), among those sized in GiB.
        sleep: (t >= 2 && size.ends_with("Gi")).then(|| {
            Box::new(
                serde_json::from_value(json!({"preset": "vllm", "sleepingSize": "512Mi"})).unwrap(),
            )
        }),
        name: String::new(),
        size: ByteQuantity(size),
        pinned,
        gpus: None,
        // Now and then an idle timeout of its own.
        artifact: None,
        copies: None,
        lora: None,
        keep_alive: (t == 0).then(|| "90s".into()),
        template: match t {
            0 => None,
            1 => Some(json!({"spec": {"containers": []}}).into()),
            _ => Some(json!({"spec": {"containers": [{"name": "s", "image": "i"}]}}).into()),
        },
        load_time: None,
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
        (reason(), any::<bool>(), prop::option::of(time())),
        // `rate` eviction's state, as a status may hold it (or lie).
        (prop::option::of(rate()), prop::option::of(any::<u64>())),
    )
        .prop_map(
            |(
                name,
                state,
                size,
                last_requested,
                last_used,
                failures,
                retry_at,
                (reason, named, slept_at),
                (rate, rate_at),
            )| ModelStatus {
                // Now and then naming its pod (as a sleeping model's
                // status does).
                pod: named.then(|| format!("gpu-{name}").into()),
                name: name.into(),
                state,
                size: size.map(Into::into),
                last_requested: last_requested.map(Into::into),
                last_used: last_used.map(Into::into),
                failures,
                retry_at: retry_at.map(Into::into),
                reason,
                slept_at: slept_at.map(Into::into),
                rate,
                rate_at,
                ..ModelStatus::default()
            },
        );
    let status = (
        prop::option::of(quantity()),
        prop::option::of(quantity()),
        prop::collection::vec(prev_model, 0..8),
        any::<[u16; 5]>(),
        prop::option::of(prop_oneof![0u64..64, any::<u64>()]),
    )
        .prop_map(|(budget, peak, models, c, served)| ModelResidencyStatus {
            budget,
            peak,
            models,
            served,
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
        prop::sample::select(&["0", "3Gi", "64Gi"][..]),
        prop::sample::select(
            &[
                EvictionPolicy::Lru,
                EvictionPolicy::Cost,
                EvictionPolicy::Rate,
            ][..],
        ),
    )
        .prop_map(|(budget, models, demand, status, host_budget, eviction)| {
            let mut r = ModelResidency::new(
                "gpu",
                ModelResidencySpec {
                    catalog: None,
                    node_name: Some("node-a".into()),
                    device: "0".into(),
                    gpu: Default::default(),
                    budget: Some(ByteQuantity(budget)),
                    budget_fraction: None,
                    models,
                    prefetch: 0,
                    warm: Some(model_residency::api::WarmSpec {
                        host_budget: ByteQuantity(host_budget.into()),
                    }),
                    eviction,
                    anticipate: None,
                    keep_alive: Some("5m".into()),
                    demand: demand.into(),
                },
            );
            r.metadata.namespace = Some("ns".into());
            r.metadata.uid = Some("uid".into());
            r.metadata.generation = Some(3);
            r.status = status;
            // Half the recorded models at their registry size (the failure
            // count is the coin), so the sleeping and waking paths run, not
            // only the re-admission of a resized model.
            let specs = r.spec.models.clone();
            for m in r.status.iter_mut().flat_map(|s| s.models.iter_mut()) {
                let spec = specs.iter().find(|s| *s.name == *m.name);
                if let (Some(spec), true) = (spec, m.failures % 2 == 0) {
                    m.size = Some(spec.size.0.clone().into());
                }
            }
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
            bound: true,
            addr: None,
            port: 8080,
            serving_label: false,
            draining: false,
            retire_at: None,
            adapters: None,
            gang: None,
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
/// Decisions of the warm-tier property that asked a sleep or a wake.
static CALLS: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);

#[test]
fn most_generated_specs_are_valid() {
    // Runs the property first if needed; the property must not only ever
    // see rejected specs.
    decide_never_panics_and_keeps_the_budget();
    assert!(VALID.load(std::sync::atomic::Ordering::Relaxed) > 500);
}

#[test]
fn the_warm_property_asks_sleeps_and_wakes() {
    warm_decisions_keep_both_budgets_with_the_pods();
    let calls = CALLS.load(std::sync::atomic::Ordering::Relaxed);
    assert!(calls > 50, "only {calls} decisions asked a sleep or a wake");
}

/// What must hold of a decision on a valid spec: the engine's VRAM within
/// the budget; pods created and wakes asked fit beside the live pods
/// (counted as the operator must: a confirmed sleeper, its previous status
/// Asleep or Waking naming it, at its sleeping size unless it terminates);
/// sleeps asked fit the host budget beside the confirmed sleepers and the
/// terminating pods of models that sleep; created pods are Loading.
fn check_budgets(r: &ModelResidency, pods: &[ModelPod], d: &Decision) -> Result<(), TestCaseError> {
    const KEPT: u64 = 512 << 20;
    let budget = parse_bytes(&r.spec.budget.as_ref().unwrap().0).unwrap();
    let used = parse_bytes(d.status.used.as_deref().unwrap()).unwrap();
    prop_assert!(used <= budget, "used {} > budget {}", used, budget);
    let prev = r.status.clone().unwrap_or_default();
    let spec_of = |p: &ModelPod| r.spec.models.iter().find(|s| *s.name == *p.model);
    let sleeper = |p: &ModelPod| {
        let m = prev.model(&p.model)?;
        let reason = m.reason.as_deref();
        let asleep = (m.state == ModelState::Sleeping && reason == Some("Asleep"))
            || (m.state == ModelState::Loading && reason == Some("Waking"));
        let spec = spec_of(p)?;
        (asleep && m.pod.as_deref() == Some(&*p.name) && spec.sleep.is_some()).then_some(spec)
    };
    let counted = |p: &ModelPod| match sleeper(p) {
        Some(_) if !p.deleting => KEPT,
        _ => declared(p, r),
    };
    let live = pods.iter().filter(|p| p.phase == PodPhase::Live);
    let live_before: u64 = live.clone().map(counted).sum();
    let woken: u64 = d
        .calls
        .iter()
        .filter(|c| c.wake)
        .map(|c| {
            let p = pods.iter().find(|p| *p.name == *c.pod.name).unwrap();
            declared(p, r).saturating_sub(KEPT)
        })
        .sum();
    let host_budget = r
        .spec
        .warm
        .as_ref()
        .map_or(0, |w| parse_bytes(&w.host_budget.0).unwrap());
    let host = |p: &ModelPod| {
        let spec = spec_of(p)?;
        spec.sleep.as_ref()?;
        parse_bytes(&spec.size.0).ok()
    };
    let host_held: u64 = live
        .filter(|p| sleeper(p).is_some() || p.deleting)
        .filter_map(host)
        .sum();
    let asked: u64 = d
        .calls
        .iter()
        .filter(|c| !c.wake)
        .filter_map(|c| pods.iter().find(|p| *p.name == *c.pod.name))
        .filter_map(host)
        .sum();
    if host_held <= host_budget {
        prop_assert!(
            host_held + asked <= host_budget,
            "host {} + {} > {}",
            host_held,
            asked,
            host_budget
        );
    }
    let created: u64 = d
        .create
        .iter()
        .map(|p| {
            p.metadata.annotations.as_ref().unwrap()["residency.dev/size"]
                .parse::<u64>()
                .unwrap()
        })
        .sum();
    if live_before <= budget {
        // Deleted pods may still be terminating: they count until gone.
        prop_assert!(
            live_before + created + woken <= budget,
            "{} + {} + {} > {}",
            live_before,
            created,
            woken,
            budget
        );
    }
    for pod in &d.create {
        let model = &pod.metadata.labels.as_ref().unwrap()["residency.dev/model"];
        let st = d.status.model(model).unwrap();
        prop_assert_eq!(st.state, ModelState::Loading);
    }
    prop_assert_eq!(
        d.status.resident as usize,
        d.status.models.iter().filter(|m| m.is_resident()).count()
    );
    Ok(())
}

/// A residency whose every model sleeps, with a previous status that is
/// consistent with its registry (sizes, pod names) and pods for its
/// resident models: where the sleeping and waking paths run.
fn warm_case() -> impl Strategy<Value = (ModelResidency, Vec<ModelPod>)> {
    let model = (
        1u64..8,
        warm_state(),
        prop::option::of(0i64..600),
        any::<bool>(),
        any::<bool>(),
    );
    (
        2u64..20,
        prop::sample::select(&["0", "4Gi", "16Gi", "64Gi"][..]),
        prop::collection::vec(model, 1..6),
        prop::collection::btree_map(0usize..6, 0i64..600, 0..6),
    )
        .prop_map(|(budget, host, models, demand)| {
            let names: Vec<String> = (0..models.len()).map(|i| format!("m{i}")).collect();
            let registry: Vec<_> = models
                .iter()
                .zip(&names)
                .map(|((gib, ..), n)| {
                    json!({"name": n, "size": format!("{gib}Gi"),
                    "sleep": {"preset": "vllm", "sleepingSize": "512Mi"},
                    "template": {"spec": {"containers": [{"name": "s", "image": "i"}]}}})
                })
                .collect();
            let at = |s: i64| (base() + SignedDuration::from_secs(s)).to_string();
            let demand: serde_json::Map<String, serde_json::Value> = demand
                .iter()
                .filter(|(i, _)| **i < names.len())
                .map(|(i, t)| (names[*i].clone(), json!(at(*t))))
                .collect();
            let mut pods = Vec::new();
            let statuses: Vec<_> = models
                .iter()
                .zip(&names)
                .map(|((gib, (state, reason), slept, processed, pod_live), n)| {
                    let pod = format!("gpu-{n}");
                    if state.is_resident() && *pod_live {
                        pods.push(ModelPod {
                            name: pod.clone().into(),
                            uid: format!("uid-{n}").into(),
                            model: n.clone().into(),
                            size: Some(gib * GI),
                            phase: PodPhase::Live,
                            ready_since: Some(base().to_string().into()),
                            deleting: false,
                            failure: None,
                            created: Some(base().to_string().into()),
                            node: Some("node-a".into()),
                            device: None,
                            access: None,
                            template_hash: None,
                            waiting: None,
                            reported: true,
                            bound: true,
                            addr: None,
                            port: 8080,
                            serving_label: false,
                            draining: false,
                            retire_at: None,
                            adapters: None,
                            gang: None,
                        });
                    }
                    json!({"name": n, "state": state, "size": format!("{gib}Gi"), "reason": reason,
                           "pod": pod, "sleptAt": slept.map(at),
                           "lastUsed": at(0),
                           "lastRequested": if *processed { json!(at(600)) } else { json!(null) }})
                })
                .collect();
            let r: ModelResidency = serde_json::from_value(json!({
                "apiVersion": "residency.dev/v1alpha1", "kind": "ModelResidency",
                "metadata": {"name": "gpu", "namespace": "ns", "uid": "uid", "generation": 3},
                "spec": {"nodeName": "node-a", "device": "0", "gpu": {"mode": "env"},
                         "budget": format!("{budget}Gi"), "warm": {"hostBudget": host},
                         "models": registry, "demand": demand},
                "status": {"budget": format!("{budget}Gi"), "models": statuses},
            }))
            .unwrap();
            (r, pods)
        })
}

fn warm_state() -> impl Strategy<Value = (ModelState, Option<&'static str>)> {
    prop_oneof![
        2 => Just((ModelState::Loaded, None)),
        1 => Just((ModelState::Loading, Some("PodStarting"))),
        2 => Just((ModelState::Loading, Some("Waking"))),
        3 => Just((ModelState::Sleeping, Some("Asleep"))),
        3 => Just((ModelState::Sleeping, Some("FallingAsleep"))),
        1 => Just((ModelState::Evicted, Some("MadeRoom"))),
        1 => Just((ModelState::Unloaded, None)),
    ]
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
        check_budgets(&r, &pods, &d)?;
    }

    #[test]
    fn warm_decisions_keep_both_budgets_with_the_pods(
        (r, pods) in warm_case(),
        now in 0i64..1200,
    ) {
        let owner = r.controller_owner_ref(&()).unwrap();
        let input = Observed::new(&r, owner, &pods, base() + SignedDuration::from_secs(now));
        let d = decide(&input);
        prop_assert!(!d.status.conditions.iter().any(|c| c.reason == "InvalidSpec"), "{:?}", d.status.conditions);
        CALLS.fetch_add(u64::from(!d.calls.is_empty()), std::sync::atomic::Ordering::Relaxed);
        check_budgets(&r, &pods, &d)?;
        // A sleep or wake is asked only of a pod that is there.
        for c in &d.calls {
            prop_assert!(pods.iter().any(|p| *p.name == *c.pod.name && !p.deleting));
        }
    }
}
