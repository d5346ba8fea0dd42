//! The decide step without a cluster: fixed clock, hand-made pods.

use super::resident::{RETRY_BASE, RETRY_CAP, retry_delay};
use super::*;
use crate::api::{ByteQuantity, ModelResidencySpec, ModelSpec};
use crate::controller::pods::{PodPhase, pod_name};
use crate::quantity::parse_bytes;
use k8s_openapi::jiff::SignedDuration;
use kube::Resource;
use serde_json::json;
use std::collections::BTreeMap;

const T0: &str = "2026-11-30T03:00:00Z";

fn at(secs: i64) -> Timestamp {
    T0.parse::<Timestamp>().unwrap() + SignedDuration::from_secs(secs)
}

fn residency(
    budget: &str,
    models: &[(&str, &str, bool)],
    demand: &[(&str, i64)],
) -> ModelResidency {
    let mut r = ModelResidency::new(
        "gpu",
        ModelResidencySpec {
            catalog: None,
            node_name: Some("node-a".into()),
            device: "0".into(),
            // The declared mode: the GPU is where the spec says.
            gpu: Box::new(crate::api::GpuSpec {
                mode: crate::api::GpuMode::Env,
                ..Default::default()
            }),
            budget: Some(ByteQuantity(budget.into())),
            budget_fraction: None,
            models: models
                .iter()
                .map(|(n, s, p)| ModelSpec {
                    name: (*n).into(),
                    size: ByteQuantity((*s).into()),
                    pinned: *p,
                    gpus: None,
                    artifact: None,
                    keep_alive: None,
                    template: Some(
                        json!({"spec": {"containers": [{"name": "s", "image": "i"}]}}).into(),
                    ),
                    load_time: None,
                    sleep: None,
                    copies: None,
                    lora: None,
                })
                .collect(),
            prefetch: 0,
            warm: None,
            eviction: Default::default(),
            anticipate: None,
            keep_alive: None,
            demand: demand
                .iter()
                .map(|(m, t)| ((*m).to_owned(), at(*t).to_string()))
                .collect(),
        },
    );
    r.metadata.namespace = Some("ns".into());
    r.metadata.uid = Some("uid-1".into());
    r.metadata.generation = Some(1);
    r
}

fn run(r: &ModelResidency, pods: &[ModelPod], now: i64) -> Decision {
    decide(&Observed::new(
        r,
        r.controller_owner_ref(&()).unwrap(),
        pods,
        at(now),
    ))
}

fn live(model: &str, size: u64, ready: bool, deleting: bool) -> ModelPod {
    ModelPod {
        name: format!("gpu-{model}").into(),
        uid: format!("u-{model}").into(),
        model: model.into(),
        size: Some(size),
        phase: PodPhase::Live,
        // Ready long before the tests' reconciles (past FRESH_LOAD_GRACE),
        // unless a test says when.
        ready_since: ready.then(|| at(-60).to_string().into()),
        deleting,
        failure: None,
        created: None,
        node: Some("node-a".into()),
        device: Some("0".into()),
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
    }
}

/// A Ready pod for every model the residency's status has resident: a
/// kubelet that starts every pod at once.
fn ready_pods(r: &ModelResidency) -> Vec<ModelPod> {
    let Some(status) = &r.status else {
        return Vec::new();
    };
    status
        .models
        .iter()
        .filter(|m| m.is_resident())
        .map(|m| {
            let size = parse_bytes(m.size.as_deref().unwrap_or("1")).unwrap();
            live(&m.name, size, true, false)
        })
        .collect()
}

/// a and b, 6Gi each, on 10Gi (room for one), a requested at 1 s.
fn a_and_b_on_10gi() -> ModelResidency {
    residency(
        "10Gi",
        &[("a", "6Gi", false), ("b", "6Gi", false)],
        &[("a", 1)],
    )
}

fn state(d: &Decision, model: &str) -> ModelState {
    d.status.model(model).unwrap().state
}

const GI: u64 = 1 << 30;

fn condition<'d>(d: &'d Decision, type_: &str) -> (&'d str, &'d str) {
    let c = d
        .status
        .conditions
        .iter()
        .find(|c| c.type_ == type_)
        .unwrap();
    (c.status.as_str(), c.reason.as_str())
}

#[test]
fn a_load_waits_until_the_evicted_pod_is_gone() {
    let mut r = a_and_b_on_10gi();
    let d = run(&r, &[], 2);
    assert_eq!(d.create.len(), 1);
    r.status = Some(d.status);
    let d = run(&r, &[live("a", 6 * GI, true, false)], 3);
    assert_eq!(state(&d, "a"), ModelState::Loaded);
    r.status = Some(d.status);
    // a is up; b is requested: a is evicted, b must wait for a's pod.
    r.spec.demand.insert("b".into(), at(3).to_string());
    let d = run(&r, &[live("a", 6 * GI, true, false)], 4);
    let gone = PodRef {
        name: "gpu-a".to_owned(),
        uid: "u-a".to_owned(),
    };
    assert_eq!(d.delete, vec![gone]);
    assert!(
        d.create.is_empty(),
        "b created while a's pod still holds VRAM"
    );
    assert_eq!(state(&d, "b"), ModelState::Loading);
    assert_eq!(state(&d, "a"), ModelState::Evicted);
    r.status = Some(d.status);
    // a is terminating: still no room.
    let d = run(&r, &[live("a", 6 * GI, true, true)], 5);
    assert!(d.create.is_empty() && d.delete.is_empty());
    r.status = Some(d.status);
    // a is gone: b's pod is created.
    let d = run(&r, &[], 6);
    assert_eq!(d.create.len(), 1);
    assert_eq!(d.create[0].metadata.name, Some(pod_name("gpu", "b")));
}

/// A load's pod created and seen starting within PROGRESS_HOLD of its
/// admission: the status keeps saying it waits until the hold ends (or
/// the pod is Ready, said at once), then says it starts.
#[test]
fn a_loads_first_moments_are_written_with_what_follows_them() {
    let hold = super::progress::PROGRESS_HOLD;
    let mut r = a_and_b_on_10gi();
    for now in [2, 3] {
        let d = run(&r, &[live("a", 6 * GI, true, false)], now);
        r.status = Some(d.status);
    }
    r.spec.demand.insert("b".into(), at(3).to_string());
    let d = run(&r, &[live("a", 6 * GI, true, false)], 4);
    assert_eq!((d.delete.len(), d.create.len()), (1, 0));
    assert_eq!(state(&d, "b"), ModelState::Loading);
    r.status = Some(d.status);
    let waiting = r.status.clone();
    // a's pod is gone a second later: b's pod is created, the status held.
    let d = run(&r, &[], 5);
    assert_eq!(d.create.len(), 1);
    assert_eq!(d.status, waiting.clone().unwrap(), "held");
    assert_eq!(d.requeue_after, Some(hold - Duration::from_secs(1)));
    // Ready before the hold ends: Loaded at once, with its event.
    let d = run(&r, &[live("b", 6 * GI, true, false)], 5);
    assert_eq!(state(&d, "b"), ModelState::Loaded);
    assert_eq!(events(&d, EventReason::Loaded), 1);
    // Still starting when the hold ends: written, saying so.
    let end = 4 + i64::try_from(hold.as_secs()).unwrap();
    let d = run(&r, &[live("b", 6 * GI, false, false)], end);
    assert_ne!(Some(&d.status), waiting.as_ref());
    let b = d.status.model("b").unwrap();
    assert_eq!(b.reason.as_deref(), Some("PodStarting"));
    assert_eq!(b.pod.as_deref(), Some("gpu-b"));
    // An admission a clock ahead of the operator's stamped holds nothing.
    let mut ahead = r.clone();
    let b = ahead.status.as_mut().unwrap().model_mut("b").unwrap();
    b.admitted_at = Some(at(60).to_string().into());
    let d = run(&ahead, &[], 5);
    assert_eq!(d.create.len(), 1);
    assert_eq!(
        d.status.model("b").unwrap().reason.as_deref(),
        Some("PodCreated")
    );
}

/// A load waiting for two evicted pods, one of them gone: its message
/// (the VRAM they still hold) is held with the rest of its first moments;
/// a step back (a created pod lost, waiting again) is not.
#[test]
fn a_wait_with_less_vram_held_is_held_and_a_step_back_is_not() {
    let mut r = residency(
        "10Gi",
        &[
            ("a", "4Gi", false),
            ("b", "4Gi", false),
            ("c", "8Gi", false),
        ],
        &[("a", 1), ("b", 2)],
    );
    let both = [
        live("a", 4 * GI, true, false),
        live("b", 4 * GI, true, false),
    ];
    for now in [2, 3] {
        let d = run(&r, &both, now);
        r.status = Some(d.status);
    }
    r.spec.demand.insert("c".into(), at(3).to_string());
    let d = run(&r, &both, 4);
    assert_eq!((d.delete.len(), d.create.len()), (2, 0));
    r.status = Some(d.status);
    let waiting = r.status.clone().unwrap();
    let c = waiting.model("c").unwrap();
    assert_eq!(c.reason.as_deref(), Some("WaitingForVram"));
    // b's pod is gone: c still waits, for less; held.
    let d = run(&r, &[live("a", 4 * GI, true, true)], 5);
    assert!(d.create.is_empty());
    assert_eq!(d.status, waiting, "held");
    // Both gone: c's pod created, still held. A step back (a created
    // pod lost, waiting again) would not be.
    let d = run(&r, &[], 6);
    assert_eq!(d.create.len(), 1);
    assert_eq!(d.status, waiting, "held");
    let mut created = waiting.clone();
    let c = created.model_mut("c").unwrap();
    c.reason = Some("PodCreated".into());
    c.message = Some("gpu-c is starting".into());
    c.pod = Some("gpu-c".into());
    assert!(super::progress::hold(&waiting, &created, at(6)).is_some());
    assert_eq!(super::progress::hold(&created, &waiting, at(6)), None);
}

#[test]
fn nothing_new_means_the_same_status_and_no_actions() {
    let mut r = residency(
        "10Gi",
        &[("a", "6Gi", false), ("big", "20Gi", false)],
        &[("a", 1), ("big", 2)],
    );
    let d = run(&r, &[], 3);
    r.status = Some(d.status);
    let pods = [live("a", 6 * GI, true, false)];
    let d = run(&r, &pods, 4);
    r.status = Some(d.status.clone());
    let again = run(&r, &pods, 500);
    assert_eq!(Some(&again.status), r.status.as_ref());
    assert!(again.create.is_empty() && again.delete.is_empty() && again.events.is_empty());
}

#[test]
fn an_invalid_spec_touches_no_pods() {
    let mut r = residency("10Gi", &[("a", "6Gi", false)], &[("a", 1)]);
    r.spec.budget = Some(ByteQuantity("ten gigs".into()));
    let d = run(&r, &[live("a", 6 * GI, true, false)], 2);
    assert!(d.create.is_empty() && d.delete.is_empty());
    let ready = d
        .status
        .conditions
        .iter()
        .find(|c| c.type_ == "Ready")
        .unwrap();
    assert_eq!(
        (ready.status.as_str(), ready.reason.as_str()),
        ("False", "InvalidSpec")
    );
    assert!(ready.message.contains("spec.budget"), "{}", ready.message);
}

#[test]
fn a_failed_pod_is_retried_after_a_backoff() {
    let mut r = residency("10Gi", &[("a", "6Gi", false)], &[("a", 1)]);
    let d = run(&r, &[], 2);
    r.status = Some(d.status);
    let mut failed = live("a", 6 * GI, false, false);
    failed.phase = PodPhase::Finished;
    failed.failure = Some("OOMKilled".into());
    let d = run(&r, std::slice::from_ref(&failed), 3);
    assert_eq!(state(&d, "a"), ModelState::Failed);
    assert!(d.delete.is_empty(), "the failed pod is kept for its logs");
    assert_eq!(d.requeue_after, Some(RETRY_BASE));
    assert!(d.events.iter().any(|n| n.reason == EventReason::LoadFailed));
    assert_eq!(condition(&d, "Degraded"), ("True", "PodFailed"));
    r.status = Some(d.status);
    // Before the retry time: nothing is created or deleted, no new event.
    let d = run(&r, std::slice::from_ref(&failed), 5);
    assert!(d.create.is_empty() && d.delete.is_empty() && d.events.is_empty());
    assert_eq!(state(&d, "a"), ModelState::Failed);
    // After it: the failed pod goes first; Degraded stays until a load
    // succeeds.
    let d = run(&r, std::slice::from_ref(&failed), 9);
    assert_eq!(d.delete.len(), 1);
    assert!(d.create.is_empty());
    assert_eq!(state(&d, "a"), ModelState::Loading);
    assert_eq!(condition(&d, "Degraded").0, "True");
    r.status = Some(d.status);
    // Gone: a new pod.
    let d = run(&r, &[], 10);
    assert_eq!(d.create.len(), 1);
    assert_eq!(condition(&d, "Degraded").0, "True");
    r.status = Some(d.status);
    // Ready: recovered.
    let d = run(&r, &[live("a", 6 * GI, true, false)], 11);
    assert_eq!(state(&d, "a"), ModelState::Loaded);
    assert_eq!(condition(&d, "Degraded").0, "False");
    assert_eq!(retry_delay(3), RETRY_BASE * 4);
    assert_eq!(retry_delay(40), RETRY_CAP);
}

#[test]
fn template_problems_fail_the_load_without_a_pod() {
    let mut r = residency("10Gi", &[("a", "6Gi", false)], &[("a", 1)]);
    r.spec.models[0].template = Some(json!({"spec": {"containers": []}}).into());
    let d = run(&r, &[], 2);
    assert!(d.create.is_empty());
    let a = d.status.model("a").unwrap();
    assert_eq!(
        (a.state, a.reason.as_deref()),
        (ModelState::Failed, Some("InvalidTemplate"))
    );
    let degraded = d
        .status
        .conditions
        .iter()
        .find(|c| c.type_ == "Degraded")
        .unwrap();
    assert_eq!(degraded.status, "True");
}

fn events(d: &Decision, reason: EventReason) -> usize {
    d.events.iter().filter(|e| e.reason == reason).count()
}

#[test]
fn a_request_from_the_future_counts_as_now_and_shadows_nothing() {
    let mut r = a_and_b_on_10gi();
    // Written by a clock far ahead (the year 2200 in the black-box test).
    r.spec
        .demand
        .insert("a".into(), "2200-01-01T00:00:00Z".into());
    let d = run(&r, &[], 2);
    assert_eq!(state(&d, "a"), ModelState::Loading);
    assert_eq!(events(&d, EventReason::ClockSkew), 1);
    let a = d.status.model("a").unwrap();
    assert_eq!(a.last_used.as_deref(), Some(at(2).to_string().as_str()));
    r.status = Some(d.status);
    // The same entry again is not a new request (a's pod is Ready now).
    let d = run(&r, &ready_pods(&r), 3);
    assert_eq!(events(&d, EventReason::Loaded), 1, "{:?}", d.events);
    assert_eq!(d.events.len(), 1, "{:?}", d.events);
    r.status = Some(d.status);
    // b evicts a; a real request for a later is not shadowed by 2200.
    r.spec.demand.insert("b".into(), at(4).to_string());
    let d = run(&r, &ready_pods(&r), 5);
    assert_eq!(state(&d, "a"), ModelState::Evicted);
    r.status = Some(d.status);
    let d = run(&r, &ready_pods(&r), 6);
    assert_eq!(state(&d, "b"), ModelState::Loaded);
    r.status = Some(d.status);
    r.spec.demand.insert("a".into(), at(6).to_string());
    let d = run(&r, &ready_pods(&r), 7);
    assert_eq!(
        state(&d, "a"),
        ModelState::Loading,
        "2200 shadowed a later request"
    );
    // Within the allowance a time is taken as written.
    let mut r = residency("10Gi", &[("a", "6Gi", false)], &[("a", 30)]);
    let d = run(&r, &[], 0);
    assert_eq!(events(&d, EventReason::ClockSkew), 0);
    r.status = Some(d.status);
    let a = r.status.as_ref().unwrap().model("a");
    assert_eq!(
        a.unwrap().last_used.as_deref(),
        Some(at(30).to_string().as_str())
    );
}

#[test]
fn demand_written_before_its_registry_entry_loads_once_the_model_is_added() {
    let mut r = residency("10Gi", &[("a", "6Gi", false)], &[("new", 1)]);
    let d = run(&r, &[], 2);
    assert_eq!(state(&d, "new"), ModelState::Refused);
    r.status = Some(d.status);
    r.spec.models.push(ModelSpec {
        name: "new".into(),
        size: ByteQuantity("2Gi".into()),
        pinned: false,
        gpus: None,
        artifact: None,
        keep_alive: None,
        template: r.spec.models[0].template.clone(),
        load_time: None,
        sleep: None,
        copies: None,
        lora: None,
    });
    let d = run(&r, &[], 3);
    assert_eq!(state(&d, "new"), ModelState::Loading);
    assert_eq!(d.status.counters.loads, 1);
}

#[test]
fn a_moved_residency_replaces_its_pods_old_one_first() {
    let mut r = residency("10Gi", &[("a", "6Gi", false)], &[("a", 1)]);
    let d = run(&r, &[], 2);
    r.status = Some(d.status);
    let pod = live("a", 6 * GI, true, false);
    let d = run(&r, std::slice::from_ref(&pod), 3);
    assert_eq!(state(&d, "a"), ModelState::Loaded);
    r.status = Some(d.status);
    r.spec.device = "1".into();
    let d = run(&r, std::slice::from_ref(&pod), 4);
    assert_eq!(d.delete.len(), 1, "the pod on GPU 0 goes");
    assert!(d.create.is_empty(), "not before it is gone");
    assert_eq!(events(&d, EventReason::Moved), 1);
    assert_eq!(d.status.counters.loads, 1, "a move is not a load");
    r.status = Some(d.status);
    let d = run(&r, &[], 5);
    assert_eq!(d.create.len(), 1);
    let env = d.create[0].spec.as_ref().unwrap().containers[0].env.clone();
    assert_eq!(env.unwrap()[0].value.as_deref(), Some("1"));
}

#[test]
fn a_changed_template_is_rolled_out_and_a_broken_one_is_not() {
    let mut r = residency("10Gi", &[("a", "6Gi", false)], &[("a", 1)]);
    let d = run(&r, &[], 2);
    let created = d.create[0].clone();
    r.status = Some(d.status);
    let mut pod = live("a", 6 * GI, true, false);
    let recorded = &created.metadata.annotations.unwrap()["residency.dev/template-hash"];
    pod.template_hash = u64::from_str_radix(recorded, 16).ok();
    let d = run(&r, std::slice::from_ref(&pod), 3);
    assert!(d.delete.is_empty() && d.events.iter().all(|e| e.reason == EventReason::Loaded));
    r.status = Some(d.status);
    // A broken template: the running pod stays, and it is reported.
    r.spec.models[0].template = Some(json!({"spec": {"containres": []}}).into());
    let d = run(&r, std::slice::from_ref(&pod), 4);
    assert!(
        d.delete.is_empty(),
        "a broken template replaced a running pod"
    );
    assert_eq!(condition(&d, "Degraded"), ("True", "InvalidTemplate"));
    // A good new image: replaced, with an event.
    r.spec.models[0].template =
        Some(json!({"spec": {"containers": [{"name": "s", "image": "i:2"}]}}).into());
    let d = run(&r, std::slice::from_ref(&pod), 5);
    assert_eq!(d.delete.len(), 1);
    assert_eq!(events(&d, EventReason::TemplateChanged), 1);
    assert_eq!(state(&d, "a"), ModelState::Loading);
}

#[test]
fn a_template_the_api_server_rejects_evicts_nothing() {
    let mut r = residency(
        "10Gi",
        &[("a", "6Gi", false), ("bad", "6Gi", false)],
        &[("a", 1)],
    );
    let d = run(&r, &[], 2);
    r.status = Some(d.status);
    r.spec.demand.insert("bad".into(), at(3).to_string());
    let pods = [live("a", 6 * GI, true, false)];
    let rejected = BTreeMap::from([(
        "bad".to_owned(),
        "spec.containers[0].image: Required value".to_owned(),
    )]);
    let mut input = Observed::new(&r, r.controller_owner_ref(&()).unwrap(), &pods, at(4));
    input.rejected_templates = &rejected;
    let d = decide(&input);
    assert_eq!(
        state(&d, "a"),
        ModelState::Loaded,
        "a was evicted for a pod that cannot start"
    );
    assert!(d.delete.is_empty() && d.create.is_empty());
    let bad = d.status.model("bad").unwrap();
    assert_eq!(
        (bad.state, bad.reason.as_deref()),
        (ModelState::Failed, Some("InvalidTemplate"))
    );
    assert!(bad.message.as_deref().unwrap().contains("Required value"));
    assert!(!bad.is_resident());
    assert_eq!(events(&d, EventReason::LoadFailed), 1);
    assert_eq!(condition(&d, "Degraded").0, "True");
    assert_eq!(d.status.resident, 1);
    // Fixed: the failed request is pending again and loads (evicting a).
    r.status = Some(d.status);
    let d = run(&r, &pods, 5);
    assert_eq!(state(&d, "bad"), ModelState::Loading);
    assert_eq!(state(&d, "a"), ModelState::Evicted);
}

#[test]
fn a_residency_that_does_not_hold_its_gpu_unloads_and_waits() {
    let mut r = residency("10Gi", &[("a", "6Gi", false)], &[("a", 1)]);
    let d = run(&r, &[], 2);
    r.status = Some(d.status);
    let pods = [live("a", 6 * GI, true, false)];
    let mut input = Observed::new(&r, r.controller_owner_ref(&()).unwrap(), &pods, at(3));
    input.gpu_holder = Some("other/gpu");
    let d = decide(&input);
    assert_eq!(state(&d, "a"), ModelState::Unloaded);
    assert_eq!(d.delete.len(), 1);
    assert_eq!(condition(&d, "Ready"), ("False", "GpuConflict"));
    assert!(
        d.events
            .iter()
            .any(|e| e.reason == EventReason::GpuConflict && e.message.contains("other/gpu"))
    );
    assert_eq!(d.status.counters.unloads, 1);
    assert!(d.usage.unwrap().gpu_conflict);
    // Released with no request: the model no longer says the GPU is
    // another's (it kept GpuConflict/GpuPending while Ready said True).
    r.status = Some(d.status.clone());
    let back = run(&r, &[], 4);
    assert_eq!(condition(&back, "Ready").0, "True");
    let a = back.status.model("a").unwrap();
    assert_eq!((a.state, a.reason.as_deref()), (ModelState::Unloaded, None));
    assert!(
        a.message
            .as_deref()
            .unwrap_or_default()
            .contains("next request loads it"),
        "{a:?}"
    );
    // Released: the pending request loads again.
    r.status = Some(d.status);
    r.spec.demand.insert("a".into(), at(4).to_string());
    let d = run(&r, &[], 5);
    assert_eq!(state(&d, "a"), ModelState::Loading);
    assert_eq!(condition(&d, "Ready").0, "True");
}

#[test]
fn loading_is_not_a_reason_to_be_unready_and_a_silent_pending_pod_is_named() {
    let mut r = residency("10Gi", &[("a", "6Gi", false)], &[("a", 1)]);
    let d = run(&r, &[], 2);
    assert_eq!(condition(&d, "Ready"), ("True", "Converging"));
    assert_eq!(d.status.loading, 1);
    r.status = Some(d.status);
    let mut pending = live("a", 6 * GI, false, false);
    pending.reported = false;
    pending.created = Some(at(2).to_string().into());
    // After the load's first moments (held, progress), looked at again
    // when its pod has been silent for 30 s.
    let d = run(&r, std::slice::from_ref(&pending), 14);
    assert!(super::progress::PROGRESS_HOLD < Duration::from_secs(12));
    assert_eq!(d.requeue_after, Some(Duration::from_secs(18)));
    let d = run(&r, std::slice::from_ref(&pending), 40);
    let a = d.status.model("a").unwrap();
    assert!(
        a.message
            .as_deref()
            .unwrap()
            .contains("no kubelet has reported"),
        "{a:?}"
    );
    pending.reported = true;
    pending.waiting = Some("ImagePullBackOff: no such image".into());
    let d = run(&r, std::slice::from_ref(&pending), 41);
    let a = d.status.model("a").unwrap();
    assert!(
        a.message.as_deref().unwrap().contains("ImagePullBackOff"),
        "{a:?}"
    );
}

/// A pod no scheduler places or says anything of (one down, or one that
/// holds the pod back before trying) is named once it has waited 30 s;
/// a scheduler's own word (unschedulable, and why) is shown as it is.
#[test]
fn a_pod_no_scheduler_places_or_speaks_of_is_named() {
    let mut r = residency("10Gi", &[("a", "6Gi", false)], &[("a", 1)]);
    let d = run(&r, &[], 2);
    r.status = Some(d.status);
    let mut pending = live("a", 6 * GI, false, false);
    pending.bound = false;
    pending.created = Some(at(2).to_string().into());
    let d = run(&r, std::slice::from_ref(&pending), 14);
    assert_eq!(d.requeue_after, Some(Duration::from_secs(18)));
    let d = run(&r, std::slice::from_ref(&pending), 40);
    let a = d.status.model("a").unwrap();
    assert_eq!(a.state, ModelState::Loading);
    assert!(
        a.message
            .as_deref()
            .unwrap()
            .contains("not placed on a node 30s after its creation and no scheduler has said why"),
        "{a:?}"
    );
    // The message does not change with the pod's age: no write a reconcile.
    r.status = Some(d.status.clone());
    let later = run(&r, std::slice::from_ref(&pending), 95);
    assert_eq!(later.status.model("a").unwrap().message, a.message);
    pending.waiting = Some("Unschedulable: 0/1 nodes are available".into());
    let d = run(&r, std::slice::from_ref(&pending), 96);
    let a = d.status.model("a").unwrap();
    assert!(a.message.as_deref().unwrap().contains("0/1 nodes"), "{a:?}");
}

/// Exactly one event per counted load, eviction, unload and refusal, over
/// random request sequences: at every step, each load is announced or
/// still under way (its admittedAt in status), never both.
#[test]
fn events_match_the_counters() {
    let models = [
        ("a", "4Gi", false),
        ("b", "5Gi", false),
        ("c", "3Gi", true),
        ("d", "9Gi", false),
        ("e", "12Gi", false),
    ];
    let mut seed: u64 = 7;
    let mut next = || {
        seed = seed
            .wrapping_mul(6364136223846793005)
            .wrapping_add(1442695040888963407);
        (seed >> 33) as usize
    };
    let mut r = residency("10Gi", &models, &[]);
    let mut tally = [0u64; 4];
    for step in 1..400 {
        let model = models[next() % models.len()].0;
        match next() % 4 {
            0 => {
                r.spec.demand.remove(model);
            }
            _ => {
                r.spec.demand.insert(model.into(), at(step).to_string());
            }
        }
        let d = run(&r, &ready_pods(&r), step);
        for (i, reason) in [
            EventReason::Loaded,
            EventReason::Evicted,
            EventReason::Unloaded,
            EventReason::Refused,
        ]
        .into_iter()
        .enumerate()
        {
            tally[i] += events(&d, reason) as u64;
        }
        let under_way = d.status.models.iter().filter(|m| m.admitted_at.is_some());
        for m in under_way.clone() {
            assert!(
                m.state.is_resident() && m.state != ModelState::Loaded,
                "{m:?}"
            );
        }
        let c = d.status.counters;
        assert_eq!(tally[0] + under_way.count() as u64, c.loads, "step {step}");
        r.status = Some(d.status);
    }
    // Every pod Ready: every load announced.
    let d = run(&r, &ready_pods(&r), 400);
    tally[0] += events(&d, EventReason::Loaded) as u64;
    assert!(d.status.models.iter().all(|m| m.admitted_at.is_none()));
    r.status = Some(d.status);
    let c = r.status.unwrap().counters;
    assert_eq!(tally, [c.loads, c.evictions, c.unloads, c.refusals]);
    assert!(
        c.loads > 20 && c.evictions > 10 && c.unloads > 10 && c.refusals > 5,
        "{c:?}"
    );
}

#[test]
fn an_idle_model_is_unloaded_at_its_keep_alive_without_polling() {
    let mut r = residency(
        "10Gi",
        &[
            ("a", "2Gi", false),
            ("b", "2Gi", false),
            ("pin", "2Gi", true),
        ],
        &[("a", 1), ("b", 1), ("pin", 1)],
    );
    r.spec.keep_alive = Some("60s".into());
    r.spec.models[1].keep_alive = Some("0s".into()); // b: never for idleness
    let d = run(&r, &[], 2);
    assert_eq!(
        d.requeue_after,
        Some(std::time::Duration::from_secs(59)),
        "at a's expiry"
    );
    r.status = Some(d.status);
    let pods = [
        live("a", 2 * GI, true, false),
        live("b", 2 * GI, true, false),
        live("pin", 2 * GI, true, false),
    ];
    let d = run(&r, &pods, 30);
    assert_eq!(state(&d, "a"), ModelState::Loaded);
    r.status = Some(d.status);
    let d = run(&r, &pods, 61);
    let a = d.status.model("a").unwrap();
    assert_eq!(
        (a.state, a.reason.as_deref()),
        (ModelState::Unloaded, Some("Idle"))
    );
    assert_eq!(state(&d, "b"), ModelState::Loaded, "keepAlive 0s: kept");
    assert_eq!(state(&d, "pin"), ModelState::Loaded, "pinned: kept");
    assert_eq!(d.status.counters.unloads, 1);
    assert_eq!(events(&d, EventReason::Unloaded), 1);
    assert_eq!(d.delete.len(), 1);
    // A bad duration is an invalid spec.
    r.spec.keep_alive = Some("a while".into());
    let d = run(&r, &pods, 62);
    assert_eq!(condition(&d, "Ready").1, "InvalidSpec");
}

#[test]
fn deadlines_past_the_last_representable_time_never_come_and_never_panic() {
    // A keepAlive of eleven million years overflowed `lastUsed + keepAlive`
    // and the reconcile panicked (which stopped the whole controller).
    let mut r = residency("10Gi", &[("a", "2Gi", false)], &[("a", 1)]);
    r.spec.keep_alive = Some("99999999999h".into());
    let d = run(&r, &[], 2);
    assert_eq!(state(&d, "a"), ModelState::Loading);
    r.status = Some(d.status);
    let pods = [live("a", 2 * GI, true, false)];
    let d = run(&r, &pods, 3);
    assert_eq!(state(&d, "a"), ModelState::Loaded, "never idle");
    // A status hand-edited to the last second of the year 9999, with a
    // keepAlive of a minute.
    r.spec.keep_alive = Some("60s".into());
    let mut status = d.status;
    status.model_mut("a").unwrap().last_used = Some("9999-12-31T23:59:59Z".into());
    r.status = Some(status);
    let d = run(&r, &pods, 4);
    assert_eq!(state(&d, "a"), ModelState::Loaded);
    // An operator started with a clock-skew allowance as large.
    let mut observed = Observed::new(&r, r.controller_owner_ref(&()).unwrap(), &pods, at(5));
    observed.max_skew = std::time::Duration::from_secs(u64::MAX / 2);
    let d = decide(&observed);
    assert_eq!(state(&d, "a"), ModelState::Loaded);
}

/// A load has one event, `Loaded`, when its pod is Ready (saying so), or
/// when the model leaves before that (saying that instead); none while
/// it is under way, when the status keeps when it was admitted.
#[test]
fn a_load_is_announced_once_when_ready_or_when_gone_before() {
    let models = [("a", "4Gi", false), ("b", "4Gi", false)];
    let mut r = residency("8Gi", &models, &[("a", 1)]);
    let d = run(&r, &[], 2);
    assert_eq!(events(&d, EventReason::Loaded), 0, "{:?}", d.events);
    assert_eq!(d.status.counters.loads, 1);
    let admitted = d.status.model("a").unwrap().admitted_at.clone();
    assert_eq!(admitted.as_deref(), Some(at(2).to_string().as_str()));
    r.status = Some(d.status);
    // Still starting: nothing to say; the admission is kept.
    let starting = [live("a", 4 * GI, false, false)];
    let d = run(&r, &starting, 3);
    assert!(d.events.is_empty(), "{:?}", d.events);
    assert_eq!(d.status.model("a").unwrap().admitted_at, admitted);
    // Ready at 9 s: one event, and the status forgets the admission.
    let mut ready = live("a", 4 * GI, true, false);
    ready.ready_since = Some(at(9).to_string().into());
    let d = run(&r, &[ready], 10);
    assert_eq!(d.events.len(), 1, "{:?}", d.events);
    assert_eq!(d.events[0].reason, EventReason::Loaded);
    assert_eq!(
        d.events[0].message,
        "a loaded (4Gi): Ready on node node-a GPU 0, 7s after it was admitted (requested 1s before that)"
    );
    assert_eq!(d.status.model("a").unwrap().admitted_at, None);
    // b's demand is removed while it loads: its load is announced as gone,
    // beside the unload's own event.
    r.status = Some(d.status);
    r.spec.demand.insert("b".into(), at(11).to_string());
    let d = run(&r, &[live("a", 4 * GI, true, false)], 12);
    assert_eq!(events(&d, EventReason::Loaded), 0);
    r.status = Some(d.status);
    r.spec.demand.remove("b");
    let pods = [
        live("a", 4 * GI, true, false),
        live("b", 4 * GI, false, false),
    ];
    let d = run(&r, &pods, 13);
    let loaded: Vec<&str> = d
        .events
        .iter()
        .filter(|e| e.reason == EventReason::Loaded)
        .map(|e| e.message.as_str())
        .collect();
    assert_eq!(loaded.len(), 1, "{:?}", d.events);
    assert!(
        loaded[0].starts_with("b loaded, and gone before its pod was Ready: "),
        "{loaded:?}"
    );
    assert_eq!(events(&d, EventReason::Unloaded), 1);
    assert_eq!(d.status.counters.loads, 2);
    assert!(d.status.models.iter().all(|m| m.admitted_at.is_none()));
}

/// A pod's Ready time has whole seconds, so one within a second of the
/// admission may read before it: "within a second", never "0s".
#[test]
fn a_ready_within_a_second_of_its_admission_says_so() {
    let message = |admitted: i64, ready: i64| {
        super::settle::loaded_message(
            "a",
            "4Gi",
            "node node-a GPU 0",
            Some(at(admitted)),
            Some(at(ready)),
            Some(at(admitted)),
        )
    };
    let within = "a loaded (4Gi): Ready on node node-a GPU 0, within a second of its admission";
    assert_eq!(message(5, 5), within);
    assert_eq!(message(5, 4), within);
    assert!(message(5, 9).ends_with(", 4s after it was admitted"));
}

/// A request that finds the GPU full of models whose status still says
/// Loading, but whose pods the pod cache shows Ready, evicts by LRU: those
/// models are loaded, and the request is not queued behind them (a storm
/// found each GPU in this state between a pod turning Ready and the
/// status saying so).
#[test]
fn a_request_is_not_queued_behind_models_whose_pods_are_ready() {
    let models = [
        ("a", "4Gi", false),
        ("b", "4Gi", false),
        ("c", "4Gi", false),
    ];
    let mut r = residency("8Gi", &models, &[("a", 1), ("b", 2)]);
    let d = run(&r, &[], 3);
    assert_eq!(state(&d, "a"), ModelState::Loading);
    assert_eq!(state(&d, "b"), ModelState::Loading);
    r.status = Some(d.status);
    r.spec.demand.insert("c".into(), at(4).to_string());
    // Pods not Ready yet: c waits.
    let starting: Vec<ModelPod> = ["a", "b"]
        .iter()
        .map(|m| live(m, 4 << 30, false, false))
        .collect();
    let d = run(&r, &starting, 5);
    assert_eq!(state(&d, "c"), ModelState::Queued);
    // Both Ready (since long before): c loads at once, evicting a.
    let d = run(&r, &ready_pods(&r), 5);
    assert_eq!(state(&d, "c"), ModelState::Loading, "{:?}", d.status.models);
    assert_eq!(state(&d, "a"), ModelState::Evicted);
    assert_eq!(state(&d, "b"), ModelState::Loaded);
    assert_eq!(d.status.counters.evictions, 1);
}

/// Nine held requests at once for nine 1Gi models on an 8Gi GPU: eight
/// load and are never evicted while loading; the ninth waits (Queued, not
/// counted) and loads once a model is Ready and has been seen so (its
/// status written), evicting that one. Nine loads, one eviction.
#[test]
fn more_requests_at_once_than_fit_queue_behind_loading_models_instead_of_evicting_them() {
    let names: Vec<String> = (0..9).map(|i| format!("m{i}")).collect();
    let models: Vec<(&str, &str, bool)> =
        names.iter().map(|n| (n.as_str(), "1Gi", false)).collect();
    let demand: Vec<(&str, i64)> = names.iter().map(|n| (n.as_str(), 1)).collect();
    let mut r = residency("8Gi", &models, &demand);
    let d = run(&r, &[], 2);
    assert_eq!(d.create.len(), 8);
    assert_eq!(d.status.counters.loads, 8);
    assert_eq!(d.status.counters.evictions, 0);
    // Ties by name: m8 is the last request.
    assert_eq!(state(&d, "m8"), ModelState::Queued);
    let m8 = d.status.model("m8").unwrap();
    assert_eq!(m8.reason.as_deref(), Some("WaitingForLoads"));
    assert!(
        m8.last_requested.is_none(),
        "a queued request is not processed"
    );
    assert!(
        d.events.is_empty(),
        "no event for the queue, Loaded ones at Ready: {:?}",
        d.events
    );
    r.status = Some(d.status);
    // Still loading: nothing changes, nothing is written again.
    let d = run(&r, &[], 3);
    assert_eq!(state(&d, "m8"), ModelState::Queued);
    assert!(d.events.is_empty(), "{:?}", d.events);
    assert_eq!(Some(&d.status), r.status.as_ref());
    // The pods become Ready at 4 s: Loaded, but not evicted in the same
    // reconcile, nor in the next ones for FRESH_LOAD_GRACE (the routers
    // learn they are Ready from this status, then send them the requests
    // that waited for them).
    let ready = |r: &ModelResidency| {
        let mut pods = ready_pods(r);
        for p in &mut pods {
            p.ready_since = Some(at(4).to_string().into());
        }
        pods
    };
    let d = run(&r, &ready(&r), 4);
    assert_eq!(state(&d, "m0"), ModelState::Loaded);
    assert_eq!(state(&d, "m8"), ModelState::Queued);
    assert_eq!(d.status.counters.evictions, 0);
    r.status = Some(d.status);
    let d = run(&r, &ready(&r), 5);
    assert_eq!(state(&d, "m8"), ModelState::Queued);
    assert_eq!(d.status.counters.evictions, 0);
    let grace = FRESH_LOAD_GRACE.as_secs() as i64;
    assert_eq!(
        d.requeue_after,
        Some(std::time::Duration::from_secs((4 + grace - 5) as u64)),
        "looked at again when the grace ends"
    );
    let message = d.status.model("m8").unwrap().message.as_deref().unwrap();
    assert!(message.contains("Ready for less than"), "{message}");
    // A Ready time far ahead of the operator's clock holds nothing.
    let mut skewed = ready(&r);
    for p in &mut skewed {
        p.ready_since = Some(at(3600).to_string().into());
    }
    let mut ahead = r.clone();
    for m in &mut ahead.status.as_mut().unwrap().models {
        if m.state == ModelState::Loaded {
            m.loaded_at = Some(at(3600).to_string().into());
        }
    }
    let d = run(&ahead, &skewed, 5);
    assert_eq!(
        state(&d, "m8"),
        ModelState::Loading,
        "{:?}",
        d.status.model("m8")
    );
    // After the grace the oldest ready model makes room.
    let d = run(&r, &ready(&r), 4 + grace);
    assert_eq!(state(&d, "m0"), ModelState::Evicted);
    assert_eq!(state(&d, "m8"), ModelState::Loading);
    assert_eq!(d.status.counters.loads, 9);
    assert_eq!(d.status.counters.evictions, 1);
    assert!(d.status.model("m8").unwrap().last_requested.is_some());
    // Its pod Ready: the one Loaded event of its load says how long its
    // request waited in the queue.
    r.status = Some(d.status);
    let pods: Vec<ModelPod> = ready(&r)
        .into_iter()
        .filter(|p| &*p.model != "m0")
        .collect();
    let d = run(&r, &pods, 6 + grace);
    let m8: Vec<&ModelEvent> = d
        .events
        .iter()
        .filter(|e| e.model.as_deref() == Some("m8"))
        .collect();
    assert_eq!(m8.len(), 1, "{:?}", d.events);
    let waited = format!("(requested {}s before that)", 3 + grace);
    assert!(m8[0].message.ends_with(&waited), "{}", m8[0].message);
}

/// The grace of a model just Ready holds against queued requests only: a
/// request that was not queued evicts by the seed's LRU at once, fresh or
/// not (the operator's counters stay the engine's).
#[test]
fn a_request_that_was_not_queued_evicts_a_model_just_ready_by_lru() {
    let mut r = residency(
        "2Gi",
        &[
            ("a", "1Gi", false),
            ("b", "1Gi", false),
            ("c", "1Gi", false),
        ],
        &[("a", 1), ("b", 2)],
    );
    let d = run(&r, &[], 2);
    assert_eq!(d.status.counters.loads, 2);
    r.status = Some(d.status);
    let mut pods = ready_pods(&r);
    for p in &mut pods {
        p.ready_since = Some(at(3).to_string().into());
    }
    let d = run(&r, &pods, 3);
    assert_eq!(state(&d, "a"), ModelState::Loaded);
    r.status = Some(d.status);
    r.spec.demand.insert("c".into(), at(4).to_string());
    let d = run(&r, &pods, 4);
    assert_eq!(state(&d, "a"), ModelState::Evicted);
    assert_eq!(state(&d, "c"), ModelState::Loading);
    assert_eq!(d.status.counters.evictions, 1);
}

#[test]
fn a_loading_model_is_protected_only_for_a_while_and_a_queued_model_no_longer_wanted_is_unloaded() {
    let mut r = residency(
        "2Gi",
        &[
            ("a", "2Gi", false),
            ("b", "2Gi", false),
            ("c", "2Gi", false),
        ],
        &[("a", 1), ("b", 2)],
    );
    let d = run(&r, &[], 3);
    assert_eq!(state(&d, "a"), ModelState::Loading);
    assert_eq!(state(&d, "b"), ModelState::Queued);
    // Looked at again when a's protection ends.
    let expiry = LOADING_PROTECTION - std::time::Duration::from_secs(2);
    assert_eq!(d.requeue_after, Some(expiry));
    r.status = Some(d.status);
    // a never becomes Ready (an image that cannot be pulled): after the
    // protection it is an ordinary victim again.
    let late = LOADING_PROTECTION.as_secs() as i64 + 2;
    let d = run(&r, &[live("a", 2 * GI, false, false)], late);
    assert_eq!(state(&d, "a"), ModelState::Evicted);
    assert_eq!(state(&d, "b"), ModelState::Loading);
    r.status = Some(d.status);
    // c queues behind b, whose request is old but whose pod was just
    // created; c's demand entry is then removed: Unloaded, no event
    // counted as an unload (nothing was resident).
    let mut b = live("b", 2 * GI, false, false);
    b.created = Some(at(late).to_string().into());
    r.spec.demand.insert("c".into(), at(late).to_string());
    let d = run(&r, std::slice::from_ref(&b), late + 1);
    assert_eq!(state(&d, "c"), ModelState::Queued);
    r.status = Some(d.status);
    r.spec.demand.remove("c");
    let d = run(&r, std::slice::from_ref(&b), late + 2);
    assert_eq!(state(&d, "c"), ModelState::Unloaded);
    assert_eq!(events(&d, EventReason::Unloaded), 0);
}

/// Residency `r` in claim mode, its claim allocated on node-a with a
/// device of `memory` bytes.
fn claimed(r: &mut ModelResidency, memory: Option<u64>) -> GpuView {
    *r.spec.gpu = Default::default();
    let mut p = crate::residency::gpu::assumed(r);
    p.memory = memory;
    GpuView::Placed(p)
}

#[test]
fn a_claim_that_is_not_allocated_unloads_everything_and_waits() {
    let mut r = residency("10Gi", &[("a", "6Gi", false)], &[("a", 1)]);
    let placed = claimed(&mut r, Some(80 * GI));
    let mut input = Observed::new(&r, r.controller_owner_ref(&()).unwrap(), &[], at(2));
    input.gpu = placed.clone();
    let d = decide(&input);
    assert_eq!(state(&d, "a"), ModelState::Loading);
    let pod = &d.create[0];
    let claims = pod.spec.as_ref().unwrap().resource_claims.as_ref().unwrap();
    assert_eq!(claims[0].resource_claim_name.as_deref(), Some("gpu-gpu"));
    r.status = Some(d.status);
    let pods = [live("a", 6 * GI, true, false)];
    let mut input = Observed::new(&r, r.controller_owner_ref(&()).unwrap(), &pods, at(3));
    let message =
        "ResourceClaim gpu-gpu cannot be allocated: the scheduler says: 0/1 nodes are available"
            .to_owned();
    input.gpu = GpuView::Withheld(crate::residency::gpu::Withheld {
        reason: Reason::GpuUnavailable,
        message: message.clone(),
        status: Default::default(),
    });
    let d = decide(&input);
    assert_eq!(state(&d, "a"), ModelState::Unloaded);
    assert_eq!(d.delete.len(), 1, "the pod loses its GPU");
    assert_eq!(condition(&d, "Ready"), ("False", "GpuUnavailable"));
    assert!(
        d.events
            .iter()
            .any(|e| e.reason == EventReason::GpuUnavailable && e.message == message)
    );
    // Allocated again: the pending request loads.
    r.status = Some(d.status);
    r.spec.demand.insert("a".into(), at(4).to_string());
    let mut input = Observed::new(&r, r.controller_owner_ref(&()).unwrap(), &[], at(5));
    input.gpu = placed;
    let d = decide(&input);
    assert_eq!(state(&d, "a"), ModelState::Loading);
    assert_eq!(condition(&d, "Ready").0, "True");
}

#[test]
fn without_a_budget_the_device_sets_it_and_a_larger_one_is_cut() {
    let mut r = residency("10Gi", &[("a", "6Gi", false)], &[("a", 1)]);
    r.spec.budget = None;
    let mut input_gpu = claimed(&mut r, Some(80 * GI));
    let mut input = Observed::new(&r, r.controller_owner_ref(&()).unwrap(), &[], at(2));
    input.gpu = input_gpu.clone();
    let d = decide(&input);
    assert_eq!(
        d.status.budget.as_deref(),
        Some("72Gi"),
        "0.9 of the device"
    );
    assert_eq!(
        d.status.gpu.as_ref().unwrap().budget_source.as_deref(),
        Some("device")
    );
    r.spec.budget_fraction = Some(0.5);
    let mut input = Observed::new(&r, r.controller_owner_ref(&()).unwrap(), &[], at(2));
    input.gpu = input_gpu.clone();
    assert_eq!(decide(&input).status.budget.as_deref(), Some("40Gi"));
    // Declared larger than the device: cut, and said.
    r.spec.budget_fraction = None;
    r.spec.budget = Some(ByteQuantity("100Gi".into()));
    let mut input = Observed::new(&r, r.controller_owner_ref(&()).unwrap(), &[], at(2));
    input.gpu = input_gpu.clone();
    let d = decide(&input);
    assert_eq!(d.status.budget.as_deref(), Some("80Gi"));
    assert_eq!(condition(&d, "BudgetExceedsDevice").0, "True");
    // No budget and no device memory known: nothing is decided on a guess.
    r.spec.budget = None;
    if let GpuView::Placed(p) = &mut input_gpu {
        p.memory = None;
    }
    let mut input = Observed::new(&r, r.controller_owner_ref(&()).unwrap(), &[], at(2));
    input.gpu = input_gpu;
    let d = decide(&input);
    assert_eq!(condition(&d, "Ready"), ("False", "InvalidSpec"));
    assert!(d.create.is_empty());
}

#[test]
fn a_pod_given_its_gpu_another_way_is_replaced() {
    let mut r = residency("10Gi", &[("a", "6Gi", false)], &[("a", 1)]);
    let d = run(&r, &[], 2);
    r.status = Some(d.status);
    let mut pod = live("a", 6 * GI, true, false);
    pod.access = Some("env".into());
    let d = run(&r, std::slice::from_ref(&pod), 3);
    assert!(d.delete.is_empty(), "same access");
    r.status = Some(d.status);
    let placed = claimed(&mut r, Some(80 * GI));
    let mut input = Observed::new(
        &r,
        r.controller_owner_ref(&()).unwrap(),
        std::slice::from_ref(&pod),
        at(4),
    );
    input.gpu = placed;
    let d = decide(&input);
    assert_eq!(d.delete.len(), 1, "the env pod goes for a claim pod");
    assert_eq!(events(&d, EventReason::Moved), 1);
}

// ---- the warm tier ---------------------------------------------------------

/// a (6Gi, sleeps at 1Gi) and b (6Gi) on 10Gi, with a host budget.
fn warm_residency(host_budget: &str) -> ModelResidency {
    let mut r = a_and_b_on_10gi();
    r.spec.models[0].sleep = Some(Box::new(
        serde_json::from_value(json!({"preset": "vllm", "sleepingSize": "1Gi"})).unwrap(),
    ));
    r.spec.warm = Some(crate::api::WarmSpec {
        host_budget: ByteQuantity(host_budget.into()),
    });
    r
}

/// a loaded (in `a_pod`) at 2-3 s, then b requested at 3 s.
fn a_loaded_then_b_requested(r: &mut ModelResidency, a_pod: &ModelPod) {
    for now in [2, 3] {
        let d = run(r, std::slice::from_ref(a_pod), now);
        r.status = Some(d.status);
    }
    r.spec.demand.insert("b".into(), at(3).to_string());
}

/// [`warm_residency`] with a loaded (in `a_pod`), then put to sleep by a
/// request for b at 3 s, its sleep confirmed at 6 s.
fn a_asleep(a_pod: &ModelPod) -> ModelResidency {
    let mut r = warm_residency("8Gi");
    a_loaded_then_b_requested(&mut r, a_pod);
    for now in [4, 6] {
        let mut d = run(&r, std::slice::from_ref(a_pod), now);
        if !d.calls.is_empty() {
            done(&mut d, Ok(()), now);
        }
        r.status = Some(d.status);
    }
    r
}

fn done(d: &mut Decision, ok: Result<(), String>, now: i64) -> Option<PodRef> {
    let call = d.calls.pop().expect("a call");
    assert!(d.calls.is_empty());
    d.call_done(&call, ok, 0.05, at(now))
}

#[test]
fn an_evicted_model_sleeps_after_the_drain_and_its_request_wakes_it() {
    let mut r = warm_residency("8Gi");
    let d = run(&r, &[], 2);
    r.status = Some(d.status);
    let a_pod = live("a", 6 * GI, true, false);
    let d = run(&r, std::slice::from_ref(&a_pod), 3);
    assert_eq!(state(&d, "a"), ModelState::Loaded);
    r.status = Some(d.status);
    // b is requested: a goes to sleep rather than away.
    r.spec.demand.insert("b".into(), at(3).to_string());
    let d = run(&r, std::slice::from_ref(&a_pod), 4);
    assert!(d.delete.is_empty(), "a sleeping pod is kept");
    assert!(
        d.calls.is_empty(),
        "the sleep waits for the routers to see it"
    );
    assert_eq!(state(&d, "a"), ModelState::Sleeping);
    assert_eq!(
        d.status.model("a").unwrap().reason.as_deref(),
        Some("FallingAsleep")
    );
    assert!(
        d.create.is_empty(),
        "b created while a still holds its full size"
    );
    assert_eq!(d.requeue_after, Some(super::warm::SLEEP_DRAIN));
    assert_eq!(
        (d.status.counters.sleeps, d.status.counters.evictions),
        (0, 0),
        "a sleep counts once its server confirms it"
    );
    r.status = Some(d.status);
    // After the drain the sleep is asked; confirmed, a keeps 1Gi.
    let mut d = run(&r, std::slice::from_ref(&a_pod), 6);
    assert!(!d.calls[0].wake);
    assert!(d.create.is_empty(), "b waits for the confirmation");
    assert_eq!(done(&mut d, Ok(()), 6), None);
    assert_eq!(
        d.status.model("a").unwrap().reason.as_deref(),
        Some("Asleep")
    );
    assert_eq!(d.events.last().unwrap().reason, EventReason::Slept);
    assert_eq!(d.status.counters.sleeps, 1);
    r.status = Some(d.status);
    let d = run(&r, std::slice::from_ref(&a_pod), 7);
    assert_eq!(
        d.create.len(),
        1,
        "1Gi + 6Gi fit 10Gi once the sleep is confirmed"
    );
    assert_eq!(d.create[0].metadata.name, Some(pod_name("gpu", "b")));
    assert_eq!(d.status.host_used.as_deref(), Some("6Gi"));
    assert_eq!(d.status.sleeping, 1);
    r.status = Some(d.status);
    let pods = [a_pod.clone(), live("b", 6 * GI, true, false)];
    let d = run(&r, &pods, 8);
    r.status = Some(d.status);
    // a is requested again: a wake, which evicts b; the wake is asked once
    // b's pod is gone.
    r.spec.demand.insert("a".into(), at(8).to_string());
    let d = run(&r, &pods, 9);
    assert_eq!(d.status.counters.wakes, 0, "counted once confirmed");
    assert_eq!(d.status.counters.loads, 2, "a wake is not a load");
    assert_eq!(state(&d, "b"), ModelState::Evicted);
    assert_eq!(
        d.status.model("a").unwrap().reason.as_deref(),
        Some("Waking")
    );
    assert!(d.calls.is_empty(), "b's pod still holds its 6Gi");
    r.status = Some(d.status);
    let mut d = run(&r, std::slice::from_ref(&a_pod), 10);
    assert!(d.calls[0].wake);
    assert_eq!(done(&mut d, Ok(()), 10), None);
    assert_eq!(state(&d, "a"), ModelState::Loaded);
    assert_eq!(d.events.last().unwrap().reason, EventReason::Woken);
    assert_eq!(d.status.counters.wakes, 1);
    assert!(d.status.model("a").unwrap().wake_seconds.is_some());
}

#[test]
fn a_retired_copy_sleeps_when_it_can_else_unloads_and_a_later_request_keeps_it() {
    // (host budget, requested again after the retire time, what follows)
    let cases = [
        ("8Gi", false, ModelState::Sleeping),
        ("4Gi", false, ModelState::Unloaded),
        ("8Gi", true, ModelState::Loaded),
    ];
    for (host, again, want) in cases {
        let mut r = warm_residency(host);
        let mut a_pod = live("a", 6 * GI, true, false);
        for now in [2, 3] {
            let d = run(&r, std::slice::from_ref(&a_pod), now);
            r.status = Some(d.status);
        }
        assert_eq!(r.model_state("a"), ModelState::Loaded);
        // The copy scaler annotates the drained pod; its demand key stays.
        a_pod.retire_at = Some(at(4).to_string().into());
        if again {
            r.spec.demand.insert("a".into(), at(5).to_string());
        }
        let d = run(&r, std::slice::from_ref(&a_pod), 6);
        assert_eq!(state(&d, "a"), want, "host {host}, again {again}");
        let m = d.status.model("a").unwrap();
        match want {
            ModelState::Sleeping => {
                assert!(d.delete.is_empty(), "a sleeping copy keeps its pod");
                assert_eq!(m.reason.as_deref(), Some("FallingAsleep"));
                assert!(m.message.as_deref().unwrap().contains("copy was removed"));
            }
            ModelState::Unloaded => {
                assert_eq!(m.reason.as_deref(), Some("CopyRemoved"));
                assert_eq!(d.delete.len(), 1, "its pod goes");
            }
            _ => assert!(d.delete.is_empty()),
        }
        // The entry stays, processed: the next pass loads nothing back.
        r.status = Some(d.status);
        let pods: Vec<ModelPod> = if want == ModelState::Unloaded {
            Vec::new()
        } else {
            vec![a_pod.clone()]
        };
        let d = run(&r, &pods, 7);
        assert_eq!(state(&d, "a"), want, "still, host {host}, again {again}");
        assert!(d.create.is_empty());
    }
}

#[test]
fn a_model_that_could_never_sleep_is_named_in_a_condition() {
    // a sleeps at level 1 with its 6Gi in host memory; the host budget
    // is 4Gi.
    let r = warm_residency("4Gi");
    let d = run(&r, &[], 2);
    let c = d
        .status
        .conditions
        .iter()
        .find(|c| c.type_ == "CannotSleep")
        .expect("a CannotSleep condition");
    assert_eq!(
        (c.status.as_str(), c.reason.as_str()),
        ("True", "CannotSleep")
    );
    assert!(
        c.message.contains("a (6Gi)") && c.message.contains("4Gi"),
        "{}",
        c.message
    );
    let fits = warm_residency("8Gi");
    let d = run(&fits, &[], 2);
    assert!(d.status.conditions.iter().all(|c| c.type_ != "CannotSleep"));
}

/// A status edited to list a model twice (the operator never writes one
/// so): its first entry stands everywhere, as `status.model()` reads it, so
/// the pod is not counted at its sleeping size by one part of the decision
/// and woken to its full size by another (found by `decide_fuzz`: 4Gi +
/// a 3.5Gi wake on 7Gi).
#[test]
fn a_model_listed_twice_in_status_is_read_by_its_first_entry() {
    let a_pod = live("a", 6 * GI, true, false);
    let mut asleep = a_asleep(&a_pod);
    asleep.spec.demand.remove("b");
    asleep.spec.demand.insert("a".into(), at(7).to_string());
    let entry = asleep.status.as_ref().unwrap().model("a").unwrap().clone();
    assert_eq!(entry.reason.as_deref(), Some("Asleep"));
    let loaded = ModelStatus {
        state: ModelState::Loaded,
        reason: None,
        pod: None,
        ..entry.clone()
    };
    for (first, second, wakes) in [(&loaded, &entry, false), (&entry, &loaded, true)] {
        let mut r = asleep.clone();
        let st = r.status.as_mut().unwrap();
        st.models.retain(|m| &*m.name != "a");
        st.models.insert(0, second.clone());
        st.models.insert(0, first.clone());
        let d = run(&r, std::slice::from_ref(&a_pod), 7);
        assert_eq!(d.calls.iter().any(|c| c.wake), wakes, "{first:?}");
        assert!(d.create.is_empty());
        let listed = d.status.models.iter().filter(|m| &*m.name == "a");
        assert_eq!(listed.count(), 1, "written once");
        let used = parse_bytes(d.status.used.as_deref().unwrap()).unwrap();
        assert!(used <= 10 * GI);
    }
}

#[test]
fn a_sleep_cancelled_before_it_is_sent_takes_no_count_back() {
    let mut r = warm_residency("8Gi");
    let a_pod = live("a", 6 * GI, true, false);
    a_loaded_then_b_requested(&mut r, &a_pod);
    let d = run(&r, std::slice::from_ref(&a_pod), 4);
    assert_eq!(
        d.status.model("a").unwrap().reason.as_deref(),
        Some("FallingAsleep")
    );
    let before = d.status.counters;
    r.status = Some(d.status);
    // b is unloaded and a asked for again before its sleep is sent: it
    // was never asleep.
    r.spec.demand.remove("b");
    r.spec.demand.insert("a".into(), at(5).to_string());
    let d = run(&r, std::slice::from_ref(&a_pod), 5);
    assert_eq!(state(&d, "a"), ModelState::Loaded);
    assert!(d.calls.is_empty(), "no sleep is sent");
    let after = d.status.counters;
    // Every counter only goes up (the metrics read a decrease as a new
    // object and add the whole value again).
    for (name, was, is) in [
        ("sleeps", before.sleeps, after.sleeps),
        ("wakes", before.wakes, after.wakes),
        ("hits", before.hits, after.hits),
        ("loads", before.loads, after.loads),
        ("evictions", before.evictions, after.evictions),
        ("unloads", before.unloads, after.unloads),
    ] {
        assert!(is >= was, "{name} went down: {was} -> {is}");
    }
    assert_eq!((after.sleeps, after.wakes), (0, 0), "no sleep, no wake");
    assert_eq!(after.hits, before.hits + 1, "the request found a awake");
    assert_eq!(events(&d, EventReason::Slept), 0);
}

#[test]
fn a_failed_sleep_deletes_the_pod_and_a_failed_wake_loads_cold() {
    let mut r = warm_residency("8Gi");
    let a_pod = live("a", 6 * GI, true, false);
    a_loaded_then_b_requested(&mut r, &a_pod);
    let d = run(&r, std::slice::from_ref(&a_pod), 4);
    r.status = Some(d.status);
    let mut d = run(&r, std::slice::from_ref(&a_pod), 6);
    let doomed = done(&mut d, Err("POST /sleep?level=1 answered 404".into()), 6);
    assert_eq!(doomed.map(|p| p.name), Some("gpu-a".into()));
    assert_eq!(state(&d, "a"), ModelState::Evicted);
    assert_eq!(
        d.status.model("a").unwrap().reason.as_deref(),
        Some("SleepFailed")
    );
    assert_eq!(
        (d.status.counters.sleeps, d.status.counters.evictions),
        (0, 1)
    );
    assert_eq!(d.events.last().unwrap().reason, EventReason::SleepFailed);
    // A wake that fails: the pod goes and the model starts a new one.
    let mut r = a_asleep(&a_pod);
    r.spec.demand.remove("b");
    r.spec.demand.insert("a".into(), at(7).to_string());
    let mut d = run(&r, std::slice::from_ref(&a_pod), 8);
    let doomed = done(
        &mut d,
        Err("POST /wake_up did not answer within 30s".into()),
        8,
    );
    assert_eq!(doomed.map(|p| p.name), Some("gpu-a".into()));
    assert_eq!(state(&d, "a"), ModelState::Loading);
    r.status = Some(d.status);
    let d = run(&r, &[], 9);
    assert_eq!(d.create.len(), 1, "a loads cold");
}

#[test]
fn a_sleeping_pod_that_restarted_or_went_is_not_resident() {
    let a_pod = live("a", 6 * GI, true, false);
    let r = a_asleep(&a_pod);
    // Ready again after its sleep: it restarted, awake, outside the budget.
    let mut restarted = a_pod.clone();
    restarted.ready_since = Some(at(20).to_string().into());
    let d = run(&r, &[restarted], 21);
    assert_eq!(state(&d, "a"), ModelState::Unloaded);
    assert_eq!(
        d.status.model("a").unwrap().reason.as_deref(),
        Some("SleepingPodLost")
    );
    assert_eq!(d.delete.len(), 1, "its pod goes");
}

#[test]
fn without_a_sleep_spec_nothing_sleeps_and_the_counters_are_the_seeds() {
    let mut r = a_and_b_on_10gi();
    r.spec.warm = Some(crate::api::WarmSpec {
        host_budget: ByteQuantity("64Gi".into()),
    });
    let a_pod = live("a", 6 * GI, true, false);
    a_loaded_then_b_requested(&mut r, &a_pod);
    let d = run(&r, std::slice::from_ref(&a_pod), 4);
    assert_eq!(state(&d, "a"), ModelState::Evicted);
    assert_eq!(d.delete.len(), 1);
    let c = d.status.counters;
    assert_eq!((c.loads, c.evictions, c.sleeps, c.wakes), (2, 1, 0, 0));
}

/// Forecasts for the anticipation tests: `busy` requested every 10 s over
/// the last five minutes before `now`, `once` at `once_at` only.
fn forecasts(busy: &str, now: i64, once: &str, once_at: i64) -> Forecasts {
    use crate::engine::forecast::Forecast;
    let secs = |t: i64| epoch_seconds(at(t));
    let mut hot = Forecast::default();
    for i in 0..30 {
        hot.request(secs(now - 300 + i * 10));
    }
    let mut cold = Forecast::default();
    cold.request(secs(once_at));
    [(busy.to_owned(), hot), (once.to_owned(), cold)].into()
}

fn run_with(r: &ModelResidency, pods: &[ModelPod], now: i64, f: &Forecasts) -> Decision {
    let mut input = Observed::new(r, r.controller_owner_ref(&()).unwrap(), pods, at(now));
    input.forecasts = Some(f);
    decide(&input)
}

/// a loaded and then evicted for b: a's demand entry stays, b is the
/// newest request. Returns the residency with its status, b's pod Ready.
fn a_evicted_for_b() -> ModelResidency {
    let mut r = a_and_b_on_10gi();
    for (now, pods) in [(2, vec![]), (3, vec![live("a", 6 * GI, true, false)])] {
        let d = run(&r, &pods, now);
        r.status = Some(d.status);
    }
    r.spec.demand.insert("b".into(), at(3).to_string());
    for (now, pods) in [
        (4, vec![live("a", 6 * GI, true, false)]),
        (5, vec![]),
        (6, vec![live("b", 6 * GI, true, false)]),
    ] {
        let d = run(&r, &pods, now);
        r.status = Some(d.status);
    }
    assert_eq!(
        r.status.as_ref().unwrap().model("b").unwrap().state,
        ModelState::Loaded
    );
    assert_eq!(
        r.status.as_ref().unwrap().model("a").unwrap().state,
        ModelState::Evicted
    );
    r
}

#[test]
fn anticipation_brings_in_what_the_forecast_expects_and_counts_its_use() {
    let mut r = a_evicted_for_b();
    let f = forecasts("a", 100, "b", 3);
    let b_pod = [live("b", 6 * GI, true, false)];
    // Off (no spec.anticipate): forecasts or not, nothing moves.
    let d = run_with(&r, &b_pod, 100, &f);
    assert_eq!(events(&d, EventReason::Anticipated), 0);
    assert_eq!(state(&d, "a"), ModelState::Evicted);
    assert!(d.status.model("a").unwrap().expected_next.is_none());
    // On: a is expected (requested every 10 s until now), b hardly: b
    // makes room for a, as a request for a would have it.
    r.spec.anticipate = Some(crate::api::AnticipateSpec {
        enabled: true,
        ..Default::default()
    });
    let d = run_with(&r, &b_pod, 100, &f);
    assert_eq!(events(&d, EventReason::Anticipated), 1, "{:?}", d.events);
    assert_eq!(state(&d, "a"), ModelState::Loading);
    assert_eq!(state(&d, "b"), ModelState::Evicted);
    assert_eq!(d.status.counters.anticipated, 1);
    let a = d.status.model("a").unwrap();
    assert_eq!(a.anticipated_at.as_deref(), Some(&*at(100).to_string()));
    assert_eq!(
        a.last_used.as_deref(),
        Some(&*at(1).to_string()),
        "not a use"
    );
    assert!(a.expected_next.is_some());
    assert!(
        d.requeue_after
            .is_some_and(|r| r <= Duration::from_secs(60))
    );
    r.status = Some(d.status);
    // Planned again with a still loading: nothing more, nothing counted
    // twice.
    let d = run_with(&r, &[live("b", 6 * GI, true, true)], 101, &f);
    assert_eq!(events(&d, EventReason::Anticipated), 0);
    r.status = Some(d.status);
    let d = run_with(&r, &[], 102, &f);
    r.status = Some(d.status);
    // Ready: Loaded, saying it came ahead of demand.
    let a_pod = [live("a", 6 * GI, true, false)];
    let d = run_with(&r, &a_pod, 103, &f);
    let a = d.status.model("a").unwrap();
    assert_eq!(
        (a.state, a.reason.as_deref()),
        (ModelState::Loaded, Some("Anticipated"))
    );
    r.status = Some(d.status);
    // Its request comes: a hit, counted as used, the mark gone.
    r.spec.demand.insert("a".into(), at(110).to_string());
    let d = run_with(&r, &a_pod, 110, &f);
    let a = d.status.model("a").unwrap();
    assert_eq!((a.state, a.reason.as_deref()), (ModelState::Loaded, None));
    assert_eq!(a.anticipated_at, None);
    let c = d.status.counters;
    assert_eq!(
        (c.anticipated, c.anticipated_used, c.anticipated_wasted),
        (1, 1, 0)
    );
    assert_eq!(c.hits, 1);
}

#[test]
fn a_model_brought_in_ahead_and_sent_out_unused_counts_as_wasted() {
    let mut r = a_evicted_for_b();
    r.spec.anticipate = Some(crate::api::AnticipateSpec {
        enabled: true,
        ..Default::default()
    });
    let f = forecasts("a", 100, "b", 3);
    let d = run_with(&r, &[live("b", 6 * GI, true, false)], 100, &f);
    r.status = Some(d.status);
    let a_pod = [live("a", 6 * GI, true, false)];
    let d = run_with(&r, &a_pod, 110, &f);
    r.status = Some(d.status);
    // b is asked for after all: a, brought in ahead and never used, is
    // the one that makes room (its last use is older).
    r.spec.demand.insert("b".into(), at(120).to_string());
    let d = run_with(&r, &a_pod, 120, &forecasts("b", 120, "a", 1));
    assert_eq!(state(&d, "a"), ModelState::Evicted);
    assert_eq!(state(&d, "b"), ModelState::Loading);
    let a = d.status.model("a").unwrap();
    assert_eq!(a.anticipated_at, None);
    let c = d.status.counters;
    assert_eq!(
        (c.anticipated, c.anticipated_used, c.anticipated_wasted),
        (1, 0, 1)
    );
}

#[test]
fn a_model_its_forecast_expects_is_kept_past_its_keep_alive() {
    let mut r = residency("10Gi", &[("a", "6Gi", false)], &[("a", 1)]);
    r.spec.keep_alive = Some("60s".into());
    for (now, pods) in [(2, vec![]), (3, vec![live("a", 6 * GI, true, false)])] {
        let d = run(&r, &pods, now);
        r.status = Some(d.status);
    }
    let a_pod = [live("a", 6 * GI, true, false)];
    let f = forecasts("a", 120, "b", 1);
    // Off: unloaded at its keepAlive.
    assert_eq!(
        state(&run_with(&r, &a_pod, 120, &f), "a"),
        ModelState::Unloaded
    );
    // On: its forecast expects it within the horizon, so it stays.
    r.spec.anticipate = Some(crate::api::AnticipateSpec {
        enabled: true,
        ..Default::default()
    });
    assert_eq!(
        state(&run_with(&r, &a_pod, 120, &f), "a"),
        ModelState::Loaded
    );
    // Nothing expected any more (a day later): unloaded.
    let quiet = forecasts("x", 120, "y", 1);
    assert_eq!(
        state(&run_with(&r, &a_pod, 120, &quiet), "a"),
        ModelState::Unloaded
    );
}

fn run_health(
    r: &ModelResidency,
    pods: &[ModelPod],
    now: i64,
    health: &GpuHealthState,
) -> Decision {
    let mut input = Observed::new(r, r.controller_owner_ref(&()).unwrap(), pods, at(now));
    input.health = health.clone();
    decide(&input)
}

use crate::residency::health::GpuHealth as GpuHealthState;

fn tainted(effect: &str) -> GpuHealthState {
    let taint = crate::residency::health::Taint {
        key: "gpu.nvidia.com/xid".into(),
        value: Some("79".into()),
        effect: effect.into(),
        time_added: None,
    };
    GpuHealthState::of(&[taint], None)
}

#[test]
fn a_no_execute_taint_unloads_everything_as_no_eviction_and_loads_nothing() {
    let mut r = residency(
        "10Gi",
        &[("a", "4Gi", false), ("b", "4Gi", false)],
        &[("a", 1)],
    );
    let a_pod = [live("a", 4 * GI, true, false)];
    for now in [2, 3] {
        r.status = Some(run(&r, &a_pod, now).status);
    }
    let d = run_health(&r, &a_pod, 4, &tainted("NoExecute"));
    let a = d.status.model("a").unwrap();
    assert_eq!(
        (a.state, a.reason.as_deref()),
        (ModelState::Unloaded, Some("GpuTainted"))
    );
    assert_eq!(d.delete.len(), 1);
    assert_eq!(condition(&d, "Ready"), ("False", "GpuTainted"));
    assert_eq!(condition(&d, "GpuHealthy"), ("False", "NoExecute"));
    assert_eq!(events(&d, EventReason::GpuTainted), 1);
    assert_eq!(d.status.counters.evictions, 0, "not an eviction");
    r.status = Some(d.status);
    // A request meanwhile loads nothing here.
    r.spec.demand.insert("b".into(), at(5).to_string());
    let d = run_health(&r, &[], 5, &tainted("NoExecute"));
    assert!(d.create.is_empty());
    assert_eq!(d.status.resident, 0);
}

#[test]
fn a_no_schedule_taint_or_cordon_keeps_what_is_there_and_takes_nothing_new() {
    for health in [
        tainted("NoSchedule"),
        GpuHealthState::of(&[], Some("node-a")),
    ] {
        let mut r = residency(
            "10Gi",
            &[("a", "4Gi", false), ("b", "4Gi", false)],
            &[("a", 1)],
        );
        let a_pod = [live("a", 4 * GI, true, false)];
        for now in [2, 3] {
            r.status = Some(run(&r, &a_pod, now).status);
        }
        r.spec.demand.insert("a".into(), at(4).to_string());
        r.spec.demand.insert("b".into(), at(4).to_string());
        let d = run_health(&r, &a_pod, 5, &health);
        assert_eq!(state(&d, "a"), ModelState::Loaded, "{health:?}");
        let b = d.status.model("b").unwrap();
        assert_eq!(
            (b.state, b.reason.as_deref()),
            (ModelState::Refused, Some("GpuTainted"))
        );
        assert!(d.create.is_empty() && d.delete.is_empty());
        assert_eq!(d.status.counters.refusals, 0, "not a refusal of the model");
        assert_eq!(d.status.counters.hits, 1, "a is served where it is");
        assert_eq!(condition(&d, "GpuHealthy"), ("False", health.reason()));
        assert_eq!(condition(&d, "Ready").0, "True");
    }
}

#[test]
fn a_gpu_whose_taint_went_takes_new_models_only_after_the_hold_off() {
    let mut r = residency("10Gi", &[("a", "4Gi", false)], &[]);
    r.status = Some(run_health(&r, &[], 2, &tainted("NoSchedule")).status);
    // The taint goes: held off, said so, looked at again when it ends.
    let d = run_health(&r, &[], 10, &GpuHealthState::Healthy);
    assert_eq!(condition(&d, "GpuHealthy"), ("True", "HeldOff"));
    let hold = crate::residency::health::HOLD_OFF;
    assert_eq!(d.requeue_after, Some(hold));
    r.status = Some(d.status);
    r.spec.demand.insert("a".into(), at(11).to_string());
    let d = run_health(&r, &[], 11, &GpuHealthState::Healthy);
    assert_eq!(state(&d, "a"), ModelState::Refused);
    r.status = Some(d.status);
    // Back while held off: the hold-off starts again when it goes.
    let d = run_health(&r, &[], 12, &tainted("NoSchedule"));
    assert_eq!(condition(&d, "GpuHealthy"), ("False", "NoSchedule"));
    r.status = Some(d.status);
    let d = run_health(&r, &[], 13, &GpuHealthState::Healthy);
    r.status = Some(d.status);
    let end = 13 + i64::try_from(hold.as_secs()).unwrap();
    r.spec.demand.insert("a".into(), at(end - 1).to_string());
    let d = run_health(&r, &[], end - 1, &GpuHealthState::Healthy);
    assert_eq!(state(&d, "a"), ModelState::Refused);
    r.status = Some(d.status);
    // Stable for the hold-off: it takes models again.
    r.spec.demand.insert("a".into(), at(end).to_string());
    let d = run_health(&r, &[], end, &GpuHealthState::Healthy);
    assert_eq!(state(&d, "a"), ModelState::Loading);
    assert_eq!(d.create.len(), 1);
    assert_eq!(condition(&d, "GpuHealthy"), ("True", "TaintRemoved"));
}

#[test]
fn a_request_refused_while_the_gpu_took_nothing_new_is_unloaded_once_it_does() {
    let mut r = residency("10Gi", &[("a", "4Gi", false)], &[("a", 1)]);
    let d = run_health(&r, &[], 2, &tainted("NoSchedule"));
    assert_eq!(state(&d, "a"), ModelState::Refused);
    r.status = Some(d.status);
    // Healthy again, past the hold-off: no longer Refused, nothing loaded
    // until its next request.
    // The taint went at 3 s: held off until 33 s.
    let hold = crate::residency::health::HOLD_OFF.as_secs() as i64;
    r.status = Some(run_health(&r, &[], 3, &GpuHealthState::Healthy).status);
    let d = run_health(&r, &[], 3 + hold + 1, &GpuHealthState::Healthy);
    let a = d.status.model("a").unwrap();
    assert_eq!((a.state, a.reason.as_deref()), (ModelState::Unloaded, None));
    assert!(d.create.is_empty());
    assert_eq!(condition(&d, "Refused").0, "False");
}
