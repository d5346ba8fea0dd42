use super::*;
use serde_json::json;

fn residency(name: &str, copies: serde_json::Value) -> ModelResidency {
    serde_json::from_value(json!({
        "apiVersion": "residency.dev/v1alpha1", "kind": "ModelResidency",
        "metadata": {"name": name, "namespace": "ns"},
        "spec": {"nodeName": "n", "device": "0", "budget": "8Gi",
                 "models": [{"name": "chat", "size": "4Gi", "copies": copies}],
                 "demand": {"chat": "2026-12-03T00:00:00Z"}},
    }))
    .unwrap()
}

#[test]
fn a_models_policy_is_its_first_homes_with_the_flags_for_the_rest() {
    let defaults = CopyPolicy::default();
    let a = Arc::new(residency("a", json!({"max": 3, "scaleDownDelay": "45s"})));
    let b = Arc::new(residency("b", json!({"max": 9, "targetInFlight": 7})));
    let p = policy_of("chat", &[a, b.clone()], &Catalogs::default(), &defaults).unwrap();
    assert_eq!(
        (p.min, p.max, p.target_in_flight, p.scale_down_delay),
        (1, 3, 100.0, 45.0)
    );
    let p = policy_of("chat", &[b], &Catalogs::default(), &defaults).unwrap();
    assert_eq!((p.max, p.target_in_flight), (9, 7.0));
    // No copies set: the model's copies are left alone.
    let none = Arc::new(residency("c", serde_json::Value::Null));
    assert!(policy_of("chat", &[none], &Catalogs::default(), &defaults).is_none());
}

#[test]
fn a_copy_is_a_requested_model_that_serves_or_will() {
    let mut r = residency("a", json!({}));
    // Requested, not processed yet: a copy on its way.
    assert!(holds_copy(&r, "chat"));
    r.status = Some(
        serde_json::from_value(json!({"models": [
        {"name": "chat", "state": "Sleeping"}]}))
        .unwrap(),
    );
    assert!(!holds_copy(&r, "chat"));
    r.status = Some(
        serde_json::from_value(json!({"models": [
        {"name": "chat", "state": "Loaded"}]}))
        .unwrap(),
    );
    assert!(holds_copy(&r, "chat"));
    // Retired (unloaded, its key processed): no copy; requested again
    // since: a copy on its way.
    let retired = |processed: &str| {
        serde_json::from_value(json!({"models": [
        {"name": "chat", "state": "Unloaded", "reason": "CopyRemoved",
         "lastRequested": processed}]}))
        .unwrap()
    };
    r.status = Some(retired("2026-12-03T00:00:00Z"));
    assert!(!holds_copy(&r, "chat"));
    r.status = Some(retired("2026-12-02T23:00:00Z"));
    assert!(holds_copy(&r, "chat"));
    r.spec.demand = Default::default();
    assert!(
        !holds_copy(&r, "chat"),
        "loaded but no longer requested: going"
    );
}

#[test]
fn a_victim_is_idle_without_requests_in_flight_or_a_recent_request() {
    let policy = CopyPolicy::default();
    let mut r = residency("a", json!({}));
    let quiet = HashMap::new();
    // Requested long ago (the fixture's time), nothing in flight.
    assert!(idle(&r, "chat", &quiet, &policy));
    let busy = HashMap::from([(("ns".to_owned(), "chat".to_owned()), 1.0)]);
    // Busy in another namespace: not this one's request.
    let elsewhere = HashMap::from([(("other".to_owned(), "chat".to_owned()), 1.0)]);
    assert!(idle(&r, "chat", &elsewhere, &policy));
    assert!(!idle(&r, "chat", &busy, &policy));
    r.spec
        .demand
        .insert("chat".into(), Timestamp::now().to_string());
    assert!(!idle(&r, "chat", &quiet, &policy));
    // Requested long ago, but Ready only now: not idle yet.
    let mut fresh = residency("b", json!({}));
    fresh.status = Some(
        serde_json::from_value(json!({"models": [
        {"name": "chat", "state": "Loaded", "loadedAt": Timestamp::now().to_string()}]}))
        .unwrap(),
    );
    assert!(!idle(&fresh, "chat", &quiet, &policy));
}
