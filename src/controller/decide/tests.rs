//! The decide step without a cluster: fixed clock, hand-made pods.

use super::settle::{RETRY_BASE, RETRY_CAP, retry_delay};
use super::*;
use crate::api::{ByteQuantity, Demand, ModelResidencySpec, ModelSpec};
use crate::controller::pods::{PodPhase, pod_name};
use k8s_openapi::jiff::SignedDuration;
use kube::Resource;
use serde_json::json;

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
            node_name: "node-a".into(),
            device: "0".into(),
            budget: ByteQuantity(budget.into()),
            models: models
                .iter()
                .map(|(n, s, p)| ModelSpec {
                    name: (*n).into(),
                    size: ByteQuantity((*s).into()),
                    pinned: *p,
                    template: Some(
                        json!({"spec": {"containers": [{"name": "s", "image": "i"}]}}).into(),
                    ),
                })
                .collect(),
            demand: demand
                .iter()
                .map(|(m, t)| Demand {
                    model: (*m).into(),
                    last_requested: at(*t).to_string(),
                })
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
        name: format!("gpu-{model}"),
        uid: format!("u-{model}"),
        model: model.into(),
        size: Some(size),
        phase: PodPhase::Live,
        ready_since: ready.then(|| T0.to_owned()),
        deleting,
        failure: None,
        created: None,
        node: Some("node-a".into()),
        device: Some("0".into()),
        template_hash: None,
        waiting: None,
        reported: true,
    }
}

fn state(d: &Decision, model: &str) -> ModelState {
    d.status
        .models
        .iter()
        .find(|m| m.name == model)
        .unwrap()
        .state
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
    let mut r = residency(
        "10Gi",
        &[("a", "6Gi", false), ("b", "6Gi", false)],
        &[("a", 1)],
    );
    let d = run(&r, &[], 2);
    assert_eq!(d.create.len(), 1);
    r.status = Some(d.status);
    // a is up; b is requested: a is evicted, b must wait for a's pod.
    r.spec.demand.push(Demand {
        model: "b".into(),
        last_requested: at(3).to_string(),
    });
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
    r.spec.budget = ByteQuantity("ten gigs".into());
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
    let a = d.status.models.iter().find(|m| m.name == "a").unwrap();
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
