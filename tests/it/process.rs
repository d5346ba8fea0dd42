//! `model-residency run` as a process, the way a Deployment runs it: it
//! refuses to start without the CRD (saying how to install it), serves
//! /healthz, /readyz and /metrics, reconciles, and exits cleanly on SIGTERM.
//! "No CRD" is asked of a control plane of its own: the shared one has the
//! CRDs from the other tests of this binary.

use crate::support::cluster::{eventually, test_env};
use crate::support::http::free_port;
use kube::api::{Api, PostParams};
use model_residency::api::{ModelResidency, ModelState};
use model_residency::local::kubelet::{FakeKubelet, KubeletConfig};
use serde_json::json;
use std::io::Read;
use std::process::{Command, Stdio};
use std::time::Duration;

/// GETs `path` from the operator on `port`: the status and the body.
async fn http_get(port: u16, path: &str) -> Option<(u16, String)> {
    let addr = std::net::SocketAddr::from(([127, 0, 0, 1], port));
    let answer = model_residency::http::send(addr, "GET", path, "")
        .await
        .ok()?;
    Some((answer.status, answer.body))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "needs the local control plane: scripts/test.sh runs it with --include-ignored"]
#[allow(unsafe_code)] // a libc call std has no safe wrapper for
async fn run_checks_serves_reconciles_and_stops_on_sigterm() {
    let env = test_env("process").await;
    let bin = env!("CARGO_BIN_EXE_model-residency");

    // 1. Without the CRD: exit 1 with the fix.
    let bare = model_residency::local::control_plane::ControlPlane::start()
        .unwrap_or_else(|e| panic!("a control plane without the CRDs could not start: {e}"));
    let mut cmd = Command::new(bin);
    cmd.env("KUBECONFIG", bare.kubeconfig())
        .args(["run", "--http-addr", &format!("127.0.0.1:{}", free_port())])
        .stdout(Stdio::null())
        .stderr(Stdio::piped());
    let mut child = model_residency::local::control_plane::spawn_owned(cmd).unwrap();
    let out = tokio::task::spawn_blocking(move || {
        for _ in 0..300 {
            if child.try_wait().unwrap().is_some() {
                return child.wait_with_output().unwrap();
            }
            std::thread::sleep(Duration::from_millis(100));
        }
        let _ = child.kill();
        panic!("run without the CRD did not exit within 30 s");
    })
    .await
    .unwrap();
    drop(bare);
    assert_eq!(out.status.code(), Some(1));
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        err.contains("CRD is not installed")
            && err.contains("model-residency crd | kubectl apply -f -"),
        "{err}"
    );

    // 2. With it: endpoints, readiness after the first sync, reconciling.
    env.install_crds();
    let port = free_port();
    let mut cmd = Command::new(bin);
    cmd.env("KUBECONFIG", env.plane.kubeconfig())
        .args(["run", "--namespace", &env.namespace, "--log-format", "json"])
        .args(["--http-addr", &format!("127.0.0.1:{port}")])
        .stdout(Stdio::null())
        .stderr(Stdio::piped());
    // Dies with the test binary, even when an assertion below panics.
    let mut child = model_residency::local::control_plane::spawn_owned(cmd).unwrap();
    let ready = eventually(20, "/readyz to answer 200", || async {
        http_get(port, "/readyz")
            .await
            .filter(|(status, _)| *status == 200)
    })
    .await;
    assert_eq!(ready.1, "ok\n");
    assert_eq!(http_get(port, "/healthz").await.unwrap().0, 200);

    let node = env.node("gpu");
    let _kubelet = FakeKubelet::start(env.client.clone(), KubeletConfig::instant(&[&node]))
        .await
        .unwrap();
    let api: Api<ModelResidency> = Api::namespaced(env.client.clone(), &env.namespace);
    let r: ModelResidency = serde_json::from_value(json!({
        "apiVersion": "residency.dev/v1alpha1", "kind": "ModelResidency",
        "metadata": {"name": "gpu"},
        "spec": {"nodeName": node, "device": "0", "budget": "8Gi",
                 "models": [{"name": "a", "size": "6Gi",
                             "template": {"spec": {"containers": [{"name": "s", "image": "i"}]}}}]},
    }))
    .unwrap();
    api.create(&PostParams::default(), &r).await.unwrap();
    model_residency::residency::demand::load(&api, "gpu", "a", k8s_openapi::jiff::Timestamp::now())
        .await
        .unwrap();
    eventually(30, "a to load", || async {
        let r = api.get("gpu").await.unwrap();
        let s = r.status?;
        (s.model("a")?.state == ModelState::Loaded).then_some(())
    })
    .await;
    let metrics = eventually(10, "metrics for the residency", || async {
        let (_, body) = http_get(port, "/metrics").await?;
        body.contains("model_residency_loads_total{")
            .then_some(body)
    })
    .await;
    let labels = format!(r#"{{namespace="{}",residency="gpu"}}"#, env.namespace);
    for want in [
        format!("model_residency_budget_bytes{labels} {}", 8u64 << 30),
        format!("model_residency_used_bytes{labels} {}", 6u64 << 30),
        format!("model_residency_resident_models{labels} 1"),
        format!("model_residency_loads_total{labels} 1"),
        "model_residency_reconcile_duration_seconds_count".to_owned(),
        "model_residency_model_load_duration_seconds_count 1".to_owned(),
    ] {
        assert!(metrics.contains(&want), "{want} missing in:\n{metrics}");
    }
    let addr = std::net::SocketAddr::from(([127, 0, 0, 1], port));
    let post = model_residency::http::send(addr, "POST", "/metrics", "")
        .await
        .unwrap();
    assert_eq!(post.status, 405, "{}", post.body);

    // 3. SIGTERM: a clean exit.
    unsafe {
        libc::kill(child.id() as i32, libc::SIGTERM);
    }
    let status = tokio::task::spawn_blocking(move || {
        for _ in 0..100 {
            if let Some(s) = child.try_wait().unwrap() {
                let mut err = String::new();
                child
                    .stderr
                    .take()
                    .unwrap()
                    .read_to_string(&mut err)
                    .unwrap();
                return (s, err);
            }
            std::thread::sleep(Duration::from_millis(100));
        }
        let _ = child.kill();
        panic!("no exit within 10 s of SIGTERM");
    })
    .await
    .unwrap();
    assert!(status.0.success(), "exit status {:?}", status.0);
    // JSON logs, one object per line.
    let first = status.1.lines().next().unwrap_or_default();
    assert!(
        serde_json::from_str::<serde_json::Value>(first).is_ok(),
        "not JSON: {first}"
    );
    assert!(status.1.contains("shutting down"));
}
