use super::*;
use serde_json::json;

fn md(replicas: i32, requested_at: Option<&str>) -> ModelDemand {
    let mut md: ModelDemand = serde_json::from_value(json!({
        "apiVersion": "residency.dev/v1alpha1", "kind": "ModelDemand",
        "metadata": {"name": "z", "namespace": "ns", "generation": 2},
        "spec": {"residency": "gpu", "model": "zimage", "replicas": replicas}
    }))
    .unwrap();
    md.status = Some(ModelDemandStatus {
        requested_at: requested_at.map(str::to_owned),
        ..Default::default()
    });
    md
}

fn residency(demand: Option<&str>, state: Option<&str>) -> ModelResidency {
    let mut r: ModelResidency = serde_json::from_value(json!({
        "apiVersion": "residency.dev/v1alpha1", "kind": "ModelResidency",
        "metadata": {"name": "gpu", "namespace": "ns"},
        "spec": {"nodeName": "n", "device": "0", "budget": "16Gi",
                 "models": [{"name": "zimage", "size": "10Gi"}]}
    }))
    .unwrap();
    if let Some(t) = demand {
        r.spec.demand.insert("zimage".into(), t.into());
    }
    if let Some(state) = state {
        r.status = serde_json::from_value(json!({"models": [
            {"name": "zimage", "state": state, "reason": "MadeRoom", "message": "zimage was evicted"}
        ]}))
        .unwrap();
    }
    r
}

const NOW: &str = "2026-11-30T03:00:00Z";

fn now() -> Timestamp {
    NOW.parse().unwrap()
}

#[test]
fn going_to_one_is_a_request_now_and_staying_at_one_renews_nothing() {
    let (write, status) = plan(&md(1, None), Some(&residency(None, None)), None, now());
    assert_eq!(write, KeyWrite::Set(now()));
    assert_eq!(status.requested_at.as_deref(), Some(NOW));
    assert_eq!(
        status.selector.as_deref(),
        Some("residency.dev/residency=gpu,residency.dev/model=zimage")
    );
    // Later, still 1, key in place: nothing is written.
    let later = "2026-11-30T04:00:00Z".parse().unwrap();
    let (write, _) = plan(
        &md(1, Some(NOW)),
        Some(&residency(Some(NOW), None)),
        None,
        later,
    );
    assert_eq!(write, KeyWrite::Keep);
    // A newer request by someone else stands.
    let (write, _) = plan(
        &md(1, Some(NOW)),
        Some(&residency(Some("2026-11-30T03:30:00Z"), None)),
        None,
        later,
    );
    assert_eq!(write, KeyWrite::Keep);
}

fn later_by(t: Timestamp, d: Duration) -> Timestamp {
    later(t, d)
}

#[test]
fn at_one_a_model_evicted_after_its_request_is_asked_for_again() {
    let later: Timestamp = "2026-11-30T04:00:00Z".parse().unwrap();
    let mut r = residency(Some(NOW), Some("Evicted"));
    // Evicted before the request was processed: it is coming.
    let (write, _) = plan(&md(1, Some(NOW)), Some(&r), None, later);
    assert_eq!(write, KeyWrite::Keep);
    // Served, then evicted (a copy of another model took its room):
    // asked again once REASK_AFTER has passed, and the status keeps
    // the new request.
    r.status.as_mut().unwrap().models[0].last_requested = Some(NOW.into());
    let soon = later_by(now(), REASK_AFTER - Duration::from_secs(1));
    let (write, _) = plan(&md(1, Some(NOW)), Some(&r), None, soon);
    assert_eq!(write, KeyWrite::Keep, "its turn has not come");
    let (write, status) = plan(&md(1, Some(NOW)), Some(&r), None, later);
    assert_eq!(write, KeyWrite::Set(later));
    assert_eq!(status.requested_at, Some(later.to_string()));
    // At 0 nothing is asked.
    let (write, _) = plan(&md(0, Some(NOW)), Some(&r), None, later);
    assert_ne!(write, KeyWrite::Set(later));
}

#[test]
fn zero_removes_the_key_and_status_mirrors_the_model() {
    let (write, status) = plan(
        &md(0, Some(NOW)),
        Some(&residency(Some(NOW), Some("Loaded"))),
        None,
        now(),
    );
    assert_eq!(write, KeyWrite::Remove);
    assert_eq!(status.requested_at, None);
    assert_eq!(
        (status.replicas, status.state.as_deref()),
        (1, Some("Loaded"))
    );
    let (_, status) = plan(
        &md(1, Some(NOW)),
        Some(&residency(Some(NOW), Some("Evicted"))),
        None,
        now(),
    );
    assert_eq!(status.replicas, 0);
    let ready = &status.conditions[0];
    assert_eq!(
        (ready.status.as_str(), ready.reason.as_str()),
        ("False", "MadeRoom")
    );
}

#[test]
fn zero_withdraws_only_its_own_request() {
    // Someone requested the model after this ModelDemand did (the
    // router's traffic): going to 0 leaves that request standing.
    let later = "2026-11-30T03:30:00Z";
    let (write, status) = plan(
        &md(0, Some(NOW)),
        Some(&residency(Some(later), Some("Loaded"))),
        None,
        now(),
    );
    assert_eq!(write, KeyWrite::Keep);
    assert_eq!(status.requested_at, None, "its own request is withdrawn");
    // A ModelDemand at 0 that never asked vetoes nothing.
    let (write, _) = plan(
        &md(0, None),
        Some(&residency(Some(NOW), Some("Loaded"))),
        None,
        now(),
    );
    assert_eq!(write, KeyWrite::Keep);
    // Only a time it can read is its own.
    assert!(holds_own_request(NOW, Some(NOW)));
    assert!(holds_own_request("2026-11-30T02:00:00Z", Some(NOW)));
    assert!(!holds_own_request(later, Some(NOW)));
    assert!(!holds_own_request("yesterday", Some(NOW)));
    assert!(!holds_own_request(NOW, None));
}

#[test]
fn going_to_one_is_later_than_a_key_a_fast_clock_left() {
    // A writer 30 minutes ahead left the key (processed, then the
    // model was evicted): a request at now would be ignored.
    let ahead = "2026-11-30T03:30:00Z";
    let (write, status) = plan(
        &md(1, None),
        Some(&residency(Some(ahead), Some("Evicted"))),
        None,
        now(),
    );
    let at: Timestamp = "2026-11-30T03:30:00.000001Z".parse().unwrap();
    assert_eq!(write, KeyWrite::Set(at));
    assert_eq!(status.requested_at, Some(at.to_string()));
}

#[test]
fn a_missing_residency_or_model_is_a_condition() {
    let (write, status) = plan(&md(1, None), None, None, now());
    assert_eq!(write, KeyWrite::Keep);
    assert_eq!(status.conditions[0].reason, "ResidencyNotFound");
    let mut r = residency(None, None);
    r.spec.models.clear();
    let (write, status) = plan(&md(1, None), Some(&r), None, now());
    assert_eq!(
        write,
        KeyWrite::Keep,
        "no key for a model the registry lacks"
    );
    assert_eq!(status.conditions[0].reason, "ModelNotFound");
}

#[test]
fn a_second_demand_for_one_model_writes_nothing_and_says_who_holds_it() {
    let named = |name: &str, created: &str, model: &str| {
        let mut d = md(1, None);
        d.metadata.name = Some(name.into());
        d.metadata.creation_timestamp = Some(k8s_openapi::apimachinery::pkg::apis::meta::v1::Time(
            created.parse().unwrap(),
        ));
        d.spec.model = model.into();
        d
    };
    let first = named("b-first", "2026-11-30T01:00:00Z", "zimage");
    let second = named("a-second", "2026-11-30T02:00:00Z", "zimage");
    let other_model = named("c", "2026-11-30T00:00:00Z", "sdxl");
    let all = [first.clone(), second.clone(), other_model.clone()];
    let holder = |md: &ModelDemand, all: &[ModelDemand]| {
        holder_of(key_of(md), &md.name_any(), all).map(|d| d.name_any())
    };
    assert_eq!(holder(&first, &all), None, "the oldest holds it");
    assert_eq!(holder(&second, &all).as_deref(), Some("b-first"));
    assert_eq!(holder(&other_model, &all), None);
    // Same age: the first by name.
    let twin = named("a-twin", "2026-11-30T01:00:00Z", "zimage");
    assert_eq!(
        holder(&first, &[first.clone(), twin.clone()]).as_deref(),
        Some("a-twin")
    );
    // Being deleted, the holder holds nothing: the next one takes over.
    let mut going = first.clone();
    going.metadata.deletion_timestamp = first.metadata.creation_timestamp.clone();
    assert_eq!(holder(&second, &[going, second.clone()]), None);

    let (write, status) = plan(
        &second,
        Some(&residency(None, Some("Loaded"))),
        Some("b-first"),
        now(),
    );
    assert_eq!(write, KeyWrite::Keep);
    assert_eq!((status.replicas, status.requested_at), (0, None));
    let ready = &status.conditions[0];
    assert_eq!(
        (ready.status.as_str(), ready.reason.as_str()),
        ("False", "DuplicateModelDemand")
    );
    assert!(ready.message.contains("b-first"), "{}", ready.message);
}

#[test]
fn a_spec_naming_another_model_releases_the_old_key_and_requests_anew() {
    let mut moved = md(1, Some(NOW));
    let status = moved.status.as_mut().unwrap();
    (status.residency, status.model) = (Some("gpu".into()), Some("sdxl".into()));
    assert_eq!(retargeted_from(&moved), Some((Some("ns"), "gpu", "sdxl")));
    let later: Timestamp = "2026-11-30T04:00:00Z".parse().unwrap();
    let (write, status) = plan(&moved, Some(&residency(None, None)), None, later);
    assert_eq!(write, KeyWrite::Set(later), "a request now, not at {NOW}");
    assert_eq!(
        (status.residency.as_deref(), status.model.as_deref()),
        (Some("gpu"), Some("zimage"))
    );
    // Written back, it drives the new key and nothing else.
    moved.status = Some(status);
    assert_eq!(retargeted_from(&moved), None);
}
