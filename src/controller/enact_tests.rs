//! The I/O shell's exact call sequences against a mocked API server
//! (`tower_test`, as kube-rs's controller-rs does): deletes before creates,
//! the status before the events, the 404/409 arms, and errors that name the
//! step and the object. Behaviour is tested on the real API server; these
//! pin down the order and the shape of the requests.

use super::decide::{Decision, PodRef};
use super::enact::{Enacted, enact};
use super::events::{EventReason, ModelEvent};
use super::{Context, Error, error_delay};
use crate::api::{ModelResidency, ModelResidencyStatus};
use crate::metrics::API_REQUESTS;
use http::{Method, Request, Response, StatusCode};
use k8s_openapi::api::core::v1::Pod;
use kube::client::Body;
use serde_json::{Value, json};
use std::sync::Arc;
use std::time::Duration;
use tower_test::mock::{self, Handle};

type ApiHandle = Handle<Request<Body>, Response<Body>>;

fn residency() -> ModelResidency {
    let r: ModelResidency = serde_json::from_value(json!({
        "apiVersion": "residency.dev/v1alpha1",
        "kind": "ModelResidency",
        "metadata": {"name": "gpu", "namespace": "ns", "uid": "uid-1"},
        "spec": {"nodeName": "node-a", "device": "0", "budget": "10Gi", "models": []}
    }))
    .unwrap();
    r
}

fn pod(name: &str) -> Pod {
    serde_json::from_value(json!({
        "apiVersion": "v1", "kind": "Pod",
        "metadata": {"name": name, "namespace": "ns", "uid": format!("u-{name}"),
                     "labels": {"residency.dev/model": "b", "residency.dev/residency": "gpu"}},
        "spec": {"containers": [{"name": "s", "image": "i"}]}
    }))
    .unwrap()
}

fn decision() -> Decision {
    Decision {
        status: ModelResidencyStatus {
            resident: 1,
            ..ModelResidencyStatus::default()
        },
        create: vec![pod("gpu-b")],
        delete: vec![PodRef {
            name: "gpu-a".into(),
            uid: "u-gpu-a".into(),
        }],
        events: vec![ModelEvent::about(
            "b",
            EventReason::Loaded,
            "b loaded".into(),
        )],
        requeue_after: None,
        load_seconds: Vec::new(),
        calls: Vec::new(),
        usage: None,
    }
}

/// A decision that only creates b's pod, b Loading in its status.
fn creating_b() -> Decision {
    let mut d = decision();
    d.delete.clear();
    d.events.clear();
    d.status.models = vec![crate::api::ModelStatus {
        name: "b".into(),
        state: crate::api::ModelState::Loading,
        size: Some("1Gi".into()),
        ..Default::default()
    }];
    d
}

/// Enacts a decision with no sleeps or wakes: all of it in the reconcile.
async fn enact_now(r: &ModelResidency, d: Decision, ctx: &Arc<Context>) -> super::Result<bool> {
    match enact(&Arc::new(r.clone()), "ns", d, ctx).await? {
        Enacted::Done(retry_soon) => Ok(retry_soon),
        Enacted::Asking => panic!("no pod calls were decided"),
    }
}

fn mocked() -> (Arc<Context>, ApiHandle) {
    let (service, handle) = mock::pair::<Request<Body>, Response<Body>>();
    let client = kube::Client::new(service, "ns");
    (Context::new(client), handle)
}

/// Takes the next request, checks its method and path, and answers it.
async fn expect(
    handle: &mut ApiHandle,
    method: Method,
    path: &str,
    code: u16,
    body: Value,
) -> Value {
    let (request, respond) = handle.next_request().await.expect("another request");
    assert_eq!(request.method(), method, "{}", request.uri());
    assert_eq!(request.uri().path(), path);
    let sent = request.into_body().collect_bytes().await.unwrap();
    let sent = serde_json::from_slice(&sent).unwrap_or(Value::Null);
    let response = Response::builder()
        .status(StatusCode::from_u16(code).unwrap())
        .body(Body::from(serde_json::to_vec(&body).unwrap()))
        .unwrap();
    respond.send_response(response);
    sent
}

/// b's create answered 409, and the read of the pod holding its name
/// answered with one of `metadata`.
async fn name_taken_by(handle: &mut ApiHandle, metadata: Value) {
    expect(
        handle,
        Method::POST,
        PODS,
        409,
        status(409, "AlreadyExists"),
    )
    .await;
    let pod = json!({"apiVersion": "v1", "kind": "Pod", "metadata": metadata});
    expect(handle, Method::GET, &format!("{PODS}/gpu-b"), 200, pod).await;
}

fn status(code: u16, reason: &str) -> Value {
    json!({"kind": "Status", "apiVersion": "v1", "status": "Failure",
           "code": code, "reason": reason, "message": format!("{reason} (mocked)")})
}

const PODS: &str = "/api/v1/namespaces/ns/pods";
const STATUS: &str = "/apis/residency.dev/v1alpha1/namespaces/ns/modelresidencies/gpu/status";
const EVENTS: &str = "/apis/events.k8s.io/v1/namespaces/ns/events";

#[tokio::test]
async fn deletes_then_creates_then_writes_status_then_publishes_events() {
    let (ctx, mut handle) = mocked();
    let r = residency();
    let d = decision();
    let server = async {
        let sent = expect(
            &mut handle,
            Method::DELETE,
            &format!("{PODS}/gpu-a"),
            200,
            json!(pod("gpu-a")),
        )
        .await;
        assert_eq!(
            sent["preconditions"]["uid"], "u-gpu-a",
            "deletes only the pod it saw"
        );
        let sent = expect(&mut handle, Method::POST, PODS, 201, json!(pod("gpu-b"))).await;
        assert_eq!(sent["metadata"]["name"], "gpu-b");
        let sent = expect(&mut handle, Method::PATCH, STATUS, 200, json!(r)).await;
        assert_eq!(sent["status"]["resident"], 1);
        let sent = expect(&mut handle, Method::POST, EVENTS, 201, json!({})).await;
        assert_eq!(sent["reason"], "Loaded");
        assert_eq!(sent["related"]["name"], super::pods::pod_name("gpu", "b"));
    };
    let (result, ()) = tokio::join!(enact_now(&r, d, &ctx), server);
    assert!(!result.unwrap(), "no retry needed");
    assert_eq!(ctx.metrics.sum(API_REQUESTS), 4);
    drop(ctx);
    assert!(handle.next_request().await.is_none(), "an extra request");
}

#[tokio::test]
async fn a_pod_already_gone_and_a_name_still_taken_are_not_errors() {
    let (ctx, mut handle) = mocked();
    let r = residency();
    let mut d = decision();
    d.events.clear();
    let server = async {
        expect(
            &mut handle,
            Method::DELETE,
            &format!("{PODS}/gpu-a"),
            404,
            status(404, "NotFound"),
        )
        .await;
        // Whose is it? The previous pod, still terminating.
        let terminating = json!({"name": "gpu-b", "namespace": "ns",
                                 "deletionTimestamp": "2026-12-06T00:00:00Z"});
        name_taken_by(&mut handle, terminating).await;
        expect(&mut handle, Method::PATCH, STATUS, 200, json!(r)).await;
    };
    let (result, ()) = tokio::join!(enact_now(&r, d, &ctx), server);
    assert!(result.unwrap(), "a taken name asks to look again soon");
}

/// A live pod of the name that the residency does not own will not go by
/// waiting: the model says so (it was retried every 500 ms for ever).
#[tokio::test]
async fn a_name_taken_by_a_pod_the_residency_does_not_own_is_said_in_status() {
    let (ctx, mut handle) = mocked();
    let r = residency();
    let d = creating_b();
    let server = async {
        let theirs = json!({"name": "gpu-b", "namespace": "ns", "ownerReferences": [
            {"apiVersion": "apps/v1", "kind": "ReplicaSet", "name": "theirs",
             "uid": "another", "controller": true}]});
        name_taken_by(&mut handle, theirs).await;
        let sent = expect(&mut handle, Method::PATCH, STATUS, 200, json!(r)).await;
        let b = &sent["status"]["models"][0];
        assert_eq!(b["state"], "Failed", "{b}");
        let message = b["message"].as_str().unwrap();
        assert!(
            message.contains("a pod named gpu-b that this residency does not own"),
            "{message}"
        );
        // The model's LoadFailed event follows.
        expect(&mut handle, Method::POST, EVENTS, 201, json!({})).await;
    };
    let (result, ()) = tokio::join!(enact_now(&r, d, &ctx), server);
    assert!(
        !result.unwrap(),
        "no retry every 500 ms: the templates' backoff"
    );
}

#[tokio::test]
async fn a_create_the_api_server_rejects_is_written_into_the_status() {
    let (ctx, mut handle) = mocked();
    let r = residency();
    let d = creating_b();
    let server = async {
        let invalid = status(422, "Invalid");
        expect(&mut handle, Method::POST, PODS, 422, invalid).await;
        let sent = expect(&mut handle, Method::PATCH, STATUS, 200, json!(r)).await;
        let b = &sent["status"]["models"][0];
        assert_eq!(
            (b["state"].as_str(), b["reason"].as_str()),
            (Some("Failed"), Some("InvalidTemplate"))
        );
        assert!(
            b["message"].as_str().unwrap().contains("Invalid (mocked)"),
            "{b}"
        );
        let sent = expect(&mut handle, Method::POST, EVENTS, 201, json!({})).await;
        assert_eq!(sent["reason"], "LoadFailed");
    };
    let (result, ()) = tokio::join!(enact_now(&r, d, &ctx), server);
    assert!(!result.unwrap());
}

#[tokio::test]
async fn a_create_that_fails_still_writes_the_status_then_fails_the_reconcile() {
    let (ctx, mut handle) = mocked();
    let r = residency();
    let mut d = decision();
    d.delete.clear();
    d.events.clear();
    let server = async {
        expect(
            &mut handle,
            Method::POST,
            PODS,
            503,
            status(503, "ServiceUnavailable"),
        )
        .await;
        expect(&mut handle, Method::PATCH, STATUS, 200, json!(r)).await;
    };
    let (result, ()) = tokio::join!(enact_now(&r, d, &ctx), server);
    let e = result.unwrap_err();
    assert!(
        matches!(&e, Error::CreatePod { pod, .. } if pod == "gpu-b"),
        "{e:?}"
    );
    assert_eq!(e.metric_label(), "create_pod");
}

#[tokio::test]
async fn two_like_events_in_one_reconcile_are_two_events_not_a_series() {
    // A storm's batch can evict one model twice in one reconcile: each
    // eviction is counted, so each must be its own event (a create), not a
    // patch of the first into a series.
    let (ctx, mut handle) = mocked();
    let r = residency();
    let mut d = decision();
    (d.delete, d.create) = (Vec::new(), Vec::new());
    let evicted = |n: u32| ModelEvent::about("a", EventReason::Evicted, format!("eviction {n}"));
    d.events = vec![evicted(1), evicted(2)];
    let server = async {
        expect(&mut handle, Method::PATCH, STATUS, 200, json!(r)).await;
        for n in 1..=2 {
            let sent = expect(&mut handle, Method::POST, EVENTS, 201, json!({})).await;
            assert_eq!(sent["note"], format!("eviction {n}"));
        }
    };
    let (result, ()) = tokio::join!(enact_now(&r, d, &ctx), server);
    result.unwrap();
}

#[tokio::test]
async fn a_failed_delete_stops_before_any_create_and_names_the_pod() {
    let (ctx, mut handle) = mocked();
    let r = residency();
    let d = decision();
    let path = format!("{PODS}/gpu-a");
    let server = expect(
        &mut handle,
        Method::DELETE,
        &path,
        500,
        status(500, "InternalError"),
    );
    let (result, _) = tokio::join!(enact_now(&r, d, &ctx), server);
    let e = result.unwrap_err();
    assert!(
        matches!(&e, Error::DeletePod { pod, .. } if pod == "gpu-a"),
        "{e:?}"
    );
    assert_eq!(
        e.to_string(),
        "deleting pod gpu-a: 500 InternalError: InternalError (mocked)"
    );
    assert_eq!(e.metric_label(), "delete_pod");
    drop(ctx);
    assert!(
        handle.next_request().await.is_none(),
        "went on after a failure"
    );
}

#[tokio::test]
async fn a_rejected_status_write_is_a_patch_status_error_and_no_events_follow() {
    let (ctx, mut handle) = mocked();
    let r = residency();
    let mut d = decision();
    d.delete.clear();
    d.create.clear();
    let server = expect(
        &mut handle,
        Method::PATCH,
        STATUS,
        422,
        status(422, "Invalid"),
    );
    let (result, _) = tokio::join!(enact_now(&r, d, &ctx), server);
    let e = result.unwrap_err();
    assert!(matches!(e, Error::PatchStatus { .. }), "{e:?}");
    drop(ctx);
    assert!(
        handle.next_request().await.is_none(),
        "an event without its status"
    );
}

#[tokio::test]
async fn an_unchanged_status_is_not_written() {
    let (ctx, mut handle) = mocked();
    let mut r = residency();
    let mut d = decision();
    (d.delete, d.create, d.events) = (Vec::new(), Vec::new(), Vec::new());
    r.status = Some(d.status.clone());
    // A request here would wait for an answer that never comes.
    let result = tokio::time::timeout(std::time::Duration::from_secs(5), enact_now(&r, d, &ctx));
    assert!(!result.await.expect("a request was made").unwrap());
    drop(ctx);
    assert!(handle.next_request().await.is_none());
}

#[test]
fn a_panicked_reconcile_is_counted_as_such_and_retried_after_a_minute() {
    let e = Error::Panicked("lastUsed + keepAlive overflowed".into());
    assert_eq!(
        e.to_string(),
        "the reconcile panicked: lastUsed + keepAlive overflowed"
    );
    assert_eq!(e.metric_label(), "panic");
    assert_eq!(error_delay(&e), Duration::from_secs(60));
}

/// A claim-mode residency's ResourceClaim as the scheduler leaves it:
/// allocated on node-a's gpu-0 and reserved for the holder.
fn allocated_claim() -> k8s_openapi::api::resource::v1::ResourceClaim {
    serde_json::from_value(json!({
        "metadata": {"name": "gpu-gpu", "namespace": "ns", "uid": "c-1",
            "annotations": {"residency.dev/claim-device": "gpu.nvidia.com/0@node-a"},
            "ownerReferences": [{"apiVersion": "residency.dev/v1alpha1", "kind": "ModelResidency",
                "name": "gpu", "uid": "uid-1", "controller": true}]},
        "spec": {"devices": {"requests": []}},
        "status": {
            "allocation": {
                "devices": {"results": [{"request": "gpu", "driver": "gpu.nvidia.com", "pool": "node-a", "device": "gpu-0"}]},
                "nodeSelector": {"nodeSelectorTerms": [{"matchFields": [
                    {"key": "metadata.name", "operator": "In", "values": ["node-a"]}]}]},
            },
            "reservedFor": [{"resource": "pods", "name": "gpu-gpu-holder", "uid": "h-1"}],
        },
    }))
    .unwrap()
}

fn claim_mode(r: &mut ModelResidency) {
    *r.spec.gpu = Default::default();
}

#[tokio::test]
async fn an_allocated_claim_costs_no_request_per_reconcile() {
    let (ctx, mut handle) = mocked();
    ctx.gpus.set_served(true);
    ctx.gpus
        .record_claim(&kube::runtime::watcher::Event::InitDone);
    ctx.gpus
        .record_slice(&kube::runtime::watcher::Event::InitDone);
    ctx.gpus
        .record_claim(&kube::runtime::watcher::Event::Apply(allocated_claim()));
    let slice = serde_json::from_value(json!({
        "metadata": {"name": "node-a-gpu"},
        "spec": {"driver": "gpu.nvidia.com", "nodeName": "node-a",
            "pool": {"name": "node-a", "generation": 1, "resourceSliceCount": 1},
            "devices": [{"name": "gpu-0", "attributes": {"index": {"int": 0}, "uuid": {"string": "GPU-a"}},
                "capacity": {"memory": {"value": "80Gi"}}}]},
    }))
    .unwrap();
    ctx.gpus
        .record_slice(&kube::runtime::watcher::Event::Apply(slice));
    let mut r = residency();
    claim_mode(&mut r);
    let owner = kube::Resource::controller_owner_ref(&r, &()).unwrap();
    // A request here would wait for an answer that never comes.
    let found = tokio::time::timeout(Duration::from_secs(5), super::gpu::find(&r, &owner, &ctx))
        .await
        .expect("a request was made")
        .unwrap();
    let crate::residency::gpu::GpuView::Placed(p) = found.view else {
        panic!("not placed");
    };
    assert_eq!((p.node.as_str(), p.memory), ("node-a", Some(80 << 30)));
    assert_eq!(p.status.uuid.as_deref(), Some("GPU-a"));
    drop(ctx);
    assert!(handle.next_request().await.is_none());
}

#[tokio::test]
async fn a_missing_claim_is_made_and_one_that_asks_for_another_device_is_replaced() {
    let (ctx, mut handle) = mocked();
    ctx.gpus.set_served(true);
    ctx.gpus
        .record_claim(&kube::runtime::watcher::Event::InitDone);
    ctx.gpus
        .record_slice(&kube::runtime::watcher::Event::InitDone);
    let mut r = residency();
    claim_mode(&mut r);
    let owner = kube::Resource::controller_owner_ref(&r, &()).unwrap();
    let claims = "/apis/resource.k8s.io/v1/namespaces/ns/resourceclaims";
    let answered = tokio::spawn(async move {
        let made = serde_json::to_value(allocated_claim()).unwrap();
        let sent = expect(&mut handle, Method::POST, claims, 201, made).await;
        assert_eq!(sent["metadata"]["name"], "gpu-gpu");
        let exactly = &sent["spec"]["devices"]["requests"][0]["exactly"];
        assert_eq!(exactly["count"], 1);
        let cel = exactly["selectors"][0]["cel"]["expression"]
            .as_str()
            .unwrap();
        assert_eq!(cel, "device.attributes['gpu.nvidia.com'].index == 0");
        handle
    });
    let found = super::gpu::find(&r, &owner, &ctx).await.unwrap();
    let mut handle = answered.await.unwrap();
    let crate::residency::gpu::GpuView::Withheld(w) = found.view else {
        panic!("placed before the claim is allocated");
    };
    assert_eq!(w.reason, crate::residency::reasons::Reason::GpuPending);
    // The spec now names GPU 1: the claim (made for GPU 0) is deleted, with
    // its holder, before a new one is made.
    r.spec.device = "1".into();
    let answered = tokio::spawn(async move {
        expect(
            &mut handle,
            Method::DELETE,
            &format!("{claims}/gpu-gpu"),
            200,
            json!({}),
        )
        .await;
        expect(
            &mut handle,
            Method::DELETE,
            &format!("{PODS}/gpu-gpu-holder"),
            404,
            status(404, "NotFound"),
        )
        .await;
    });
    let found = super::gpu::find(&r, &owner, &ctx).await.unwrap();
    answered.await.unwrap();
    let crate::residency::gpu::GpuView::Withheld(w) = found.view else {
        panic!("placed on a claim for another device");
    };
    assert!(
        w.message
            .contains("is replaced for gpu.nvidia.com/1@node-a"),
        "{}",
        w.message
    );
}
