//! Smoke tests of the local control plane and the kubelet stand-in: a real
//! kube-apiserver + etcd + garbage collector, started by this test binary.

use crate::support::cluster::{eventually, test_env};
use crate::support::http;
use futures::{StreamExt, TryStreamExt};
use k8s_openapi::api::core::v1::{ConfigMap, Pod};
use kube::api::{Api, ApiResource, DeleteParams, DynamicObject, GroupVersionKind, PostParams};
use kube::runtime::{WatchStreamExt, watcher};
use model_residency::local::kubelet::{FAIL_ANNOTATION, FakeKubelet, KubeletConfig, fail_pod};
use serde_json::json;

fn pod(name: &str, node: &str, annotations: serde_json::Value) -> Pod {
    serde_json::from_value(json!({
        "metadata": {"name": name, "annotations": annotations},
        "spec": {"nodeName": node, "containers": [{"name": "server", "image": "example/model:1"}]},
    }))
    .unwrap()
}

async fn phase(api: &Api<Pod>, name: &str) -> Option<String> {
    api.get_opt(name)
        .await
        .unwrap()
        .and_then(|p| p.status)
        .and_then(|s| s.phase)
}

fn ready(p: &Pod) -> bool {
    p.status
        .as_ref()
        .and_then(|s| s.conditions.as_ref())
        .is_some_and(|cs| cs.iter().any(|c| c.type_ == "Ready" && c.status == "True"))
}

#[tokio::test]
#[ignore = "needs the local control plane: scripts/test.sh runs it with --include-ignored"]
async fn crd_apply_create_and_watch() {
    let env = test_env("crd-watch").await;
    let out = env.kubectl(&["apply", "-f", "tests/fixtures/smoke-crd.yaml"]);
    assert!(
        out.status.success(),
        "kubectl apply: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    env.until_established(&["widgets.smoke.residency.dev"]);

    let ar = ApiResource::from_gvk(&GroupVersionKind::gvk(
        "smoke.residency.dev",
        "v1",
        "Widget",
    ));
    let widgets: Api<DynamicObject> = Api::namespaced_with(env.client.clone(), &env.namespace, &ar);
    let mut events = watcher(widgets.clone(), watcher::Config::default())
        .applied_objects()
        .boxed();
    let mut w = DynamicObject::new("w1", &ar);
    w.data = json!({"spec": {"size": 7}});
    widgets.create(&PostParams::default(), &w).await.unwrap();

    let seen = tokio::time::timeout(std::time::Duration::from_secs(20), async {
        while let Some(obj) = events.try_next().await.unwrap() {
            if obj.metadata.name.as_deref() == Some("w1") {
                return obj;
            }
        }
        panic!("watch ended");
    })
    .await
    .expect("watch event for the created widget");
    assert_eq!(seen.data["spec"]["size"], 7);

    // kubectl sees it too.
    let out = env.kubectl(&["get", "widgets", "-o", "name"]);
    assert_eq!(
        String::from_utf8_lossy(&out.stdout).trim(),
        "widget.smoke.residency.dev/w1"
    );
}

#[tokio::test]
#[ignore = "needs the local control plane: scripts/test.sh runs it with --include-ignored"]
async fn garbage_collector_removes_an_owned_pod_with_the_standin_finishing_deletion() {
    let env = test_env("gc").await;
    let node = env.node("gpu");
    let _kubelet = FakeKubelet::start(env.client.clone(), KubeletConfig::instant(&[&node]))
        .await
        .unwrap();
    let cms: Api<ConfigMap> = Api::namespaced(env.client.clone(), &env.namespace);
    let pods: Api<Pod> = Api::namespaced(env.client.clone(), &env.namespace);
    let owner: ConfigMap = serde_json::from_value(json!({"metadata": {"name": "owner"}})).unwrap();
    let owner = cms.create(&PostParams::default(), &owner).await.unwrap();

    let mut child = pod("child", &node, json!({}));
    child.metadata.owner_references = Some(vec![
        serde_json::from_value(json!({
            "apiVersion": "v1", "kind": "ConfigMap", "name": "owner",
            "uid": owner.metadata.uid.clone().unwrap(),
        }))
        .unwrap(),
    ]);
    pods.create(&PostParams::default(), &child).await.unwrap();
    eventually(
        20,
        "the stand-in to mark the pod Running and Ready",
        || async {
            pods.get_opt("child")
                .await
                .unwrap()
                .filter(ready)
                .map(|_| ())
        },
    )
    .await;

    cms.delete("owner", &DeleteParams::default()).await.unwrap();
    // The garbage collector deletes the pod (graceful, since it is bound to
    // a node); the stand-in finishes the deletion as a kubelet would.
    eventually(60, "the owned pod to be garbage collected", || async {
        pods.get_opt("child").await.unwrap().is_none().then_some(())
    })
    .await;
}

#[tokio::test]
#[ignore = "needs the local control plane: scripts/test.sh runs it with --include-ignored"]
async fn standin_fails_pods_on_request_and_ignores_other_nodes() {
    let env = test_env("standin").await;
    let node = env.node("gpu");
    let _kubelet = FakeKubelet::start(env.client.clone(), KubeletConfig::instant(&[&node]))
        .await
        .unwrap();
    let pods: Api<Pod> = Api::namespaced(env.client.clone(), &env.namespace);
    let pp = PostParams::default();
    pods.create(
        &pp,
        &pod(
            "doomed",
            &node,
            json!({FAIL_ANNOTATION: "CUDA out of memory"}),
        ),
    )
    .await
    .unwrap();
    pods.create(&pp, &pod("healthy", &node, json!({})))
        .await
        .unwrap();
    pods.create(&pp, &pod("elsewhere", "some-other-node", json!({})))
        .await
        .unwrap();

    eventually(20, "the annotated pod to fail", || async {
        (phase(&pods, "doomed").await.as_deref() == Some("Failed")).then_some(())
    })
    .await;
    let doomed = pods.get("doomed").await.unwrap();
    assert_eq!(
        doomed.status.unwrap().message.as_deref(),
        Some("CUDA out of memory")
    );

    eventually(20, "the healthy pod to run", || async {
        (phase(&pods, "healthy").await.as_deref() == Some("Running")).then_some(())
    })
    .await;
    fail_pod(&pods, "healthy", "Xid 79: GPU fell off the bus")
        .await
        .unwrap();
    assert_eq!(phase(&pods, "healthy").await.as_deref(), Some("Failed"));

    // A pod on a node the stand-in does not play stays Pending.
    assert_eq!(phase(&pods, "elsewhere").await.as_deref(), Some("Pending"));
}

#[tokio::test]
#[ignore = "needs the local control plane: scripts/test.sh runs it with --include-ignored"]
async fn standin_pods_answer_real_http_on_their_own_address_until_deleted() {
    let env = test_env("standin-http").await;
    let node = env.node("gpu");
    let _kubelet = FakeKubelet::start(env.client.clone(), KubeletConfig::instant(&[&node]))
        .await
        .unwrap();
    let pods: Api<Pod> = Api::namespaced(env.client.clone(), &env.namespace);
    let served = |name: &str, model: &str| -> Pod {
        serde_json::from_value(json!({
            "metadata": {"name": name, "labels": {"residency.dev/model": model}},
            "spec": {"nodeName": node, "containers": [
                {"name": "server", "image": "example/model:1", "ports": [{"containerPort": 8000}]}
            ]},
        }))
        .unwrap()
    };
    let pp = PostParams::default();
    for (name, model) in [("one", "zimage"), ("two", "sdxl")] {
        pods.create(&pp, &served(name, model)).await.unwrap();
    }
    let ip = |name: &'static str| {
        let pods = pods.clone();
        async move {
            let p = pods.get(name).await.unwrap();
            let ready = ready(&p);
            let ip = p.status?.pod_ip?;
            ready.then(|| {
                format!("{ip}:8000")
                    .parse::<std::net::SocketAddr>()
                    .unwrap()
            })
        }
    };
    let one = eventually(20, "pod one to be ready", || ip("one")).await;
    let two = eventually(20, "pod two to be ready", || ip("two")).await;
    assert_ne!(one.ip(), two.ip(), "each pod has its own address");
    assert_eq!(one.port(), 8000);
    let body = r#"{"model": "zimage", "messages": [{"role": "user", "content": "hi"}]}"#;
    let answer = http::send(one, "POST", "/v1/chat/completions", body).await;
    assert_eq!(answer.status, 200);
    assert_eq!(answer.headers["x-model-pod"], "one");
    let v: serde_json::Value = serde_json::from_str(&answer.body).unwrap();
    assert_eq!(
        (v["model"].as_str(), v["pod"].as_str()),
        (Some("zimage"), Some("one"))
    );
    let answer = http::send(two, "POST", "/v2/models/sdxl/infer", "{}").await;
    assert!(answer.body.contains("\"pod\":\"two\""), "{}", answer.body);
    // Streaming: three chunks 20 ms apart, then the end marker.
    let streamed = r#"{"model": "zimage", "stream": true}"#;
    let answer = http::send(one, "POST", "/v1/chat/completions", streamed).await;
    assert_eq!(answer.headers["content-type"], "text/event-stream");
    assert!(answer.body.ends_with("data: [DONE]\n\n"), "{}", answer.body);
    assert_eq!(answer.body.matches("data: ").count(), 4);
    assert!(
        answer.chunks.len() >= 3,
        "not streamed: {:?}",
        answer.chunks
    );
    let spread = answer.chunks.last().unwrap().0 - answer.chunks[0].0;
    assert!(
        spread >= std::time::Duration::from_millis(50),
        "chunks arrived together: {spread:?}"
    );
    // Deleted: the server stops.
    pods.delete("one", &DeleteParams::default()).await.unwrap();
    eventually(20, "pod one to be gone", || async {
        pods.get_opt("one").await.unwrap().is_none().then_some(())
    })
    .await;
    assert!(
        tokio::net::TcpStream::connect(one).await.is_err(),
        "still serving after delete"
    );
}

#[tokio::test]
#[ignore = "needs the local control plane: scripts/test.sh runs it with --include-ignored"]
async fn control_plane_reports_its_version() {
    let env = test_env("version").await;
    let info = env.client.apiserver_version().await.unwrap();
    // What /version says is what the binary was stamped with, and it is in
    // the supported range (1.34-1.37).
    assert_eq!(info.git_version, env.plane.version());
    let minor: u32 = info.minor.trim_end_matches('+').parse().unwrap();
    assert_eq!(info.major, "1");
    assert!(
        (34..=37).contains(&minor),
        "unsupported {}",
        info.git_version
    );
    eprintln!(
        "control plane {}: started in {:.2} s, {} MiB resident (etcd, apiserver, controller manager, scheduler)",
        info.git_version,
        env.plane.startup.as_secs_f64(),
        env.plane.rss_bytes() >> 20
    );
}

/// A cache build cleans only its own leftovers: `control-plane.sh install`
/// removed every `build.*` under the cache root, KEDA's build in progress
/// included (a demo started beside a cold test run left KEDA without its
/// operator binary). Run against a cache root of the test's own whose
/// control plane is the built one, linked in.
#[test]
#[ignore = "needs the local control plane: scripts/test.sh runs it with --include-ignored"]
fn a_cache_build_leaves_another_builds_work_alone() {
    let assets = std::env::var("MODEL_RESIDENCY_ASSETS")
        .expect("MODEL_RESIDENCY_ASSETS: scripts/test.sh sets it to the built control plane");
    let version = std::process::Command::new("bash")
        .args(["scripts/control-plane.sh", "version"])
        .output()
        .unwrap();
    let version = String::from_utf8(version.stdout).unwrap();
    let root = tempfile::tempdir().unwrap();
    let cached = root.path().join("control-plane");
    std::fs::create_dir_all(&cached).unwrap();
    let name = std::path::Path::new(&assets).file_name().unwrap();
    assert!(
        name.to_string_lossy().starts_with(version.trim()),
        "{assets} is not {version}"
    );
    std::os::unix::fs::symlink(&assets, cached.join(name)).unwrap();
    let others = ["build-keda.x1", "build-real-node.x2"];
    for d in others.iter().chain(&["build-control-plane.killed"]) {
        std::fs::create_dir_all(root.path().join(d)).unwrap();
        std::fs::write(root.path().join(d).join("half-built"), "x").unwrap();
    }
    let out = std::process::Command::new("bash")
        .args(["scripts/control-plane.sh", "install"])
        .env("MODEL_RESIDENCY_CACHE", root.path())
        .env_remove("MODEL_RESIDENCY_ASSETS")
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    for d in others {
        assert!(
            root.path().join(d).join("half-built").exists(),
            "{d} was removed by the control plane's install"
        );
    }
    assert!(
        !root.path().join("build-control-plane.killed").exists(),
        "its own leftover stays"
    );
}
