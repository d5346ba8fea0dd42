//! The chart installed the way users install it, on the real node: its
//! pods from the project's image (built without Docker, imported into the
//! node's containerd: `src/local/images.rs`), in a namespace that enforces
//! the restricted Pod Security level, reaching the API server in-cluster
//! through the `kubernetes` Service (kube-proxy on the node), and a
//! request sent to the router's Service answered by a model the operator
//! loads in a real container.

use crate::support::cluster::eventually;
use crate::support::lane::{NODE, real_env, real_template, reserve_gpus};
use crate::support::router::assert_served_by;
use k8s_openapi::api::coordination::v1::Lease;
use k8s_openapi::api::core::v1::{Pod, Service};
use k8s_openapi::api::resource::v1::ResourceClaim;
use kube::ResourceExt;
use kube::api::{Api, DeleteParams, ListParams, PostParams};
use model_residency::api::ModelResidency;
use model_residency::http::Answer;
use model_residency::local::chart::Release;
use model_residency::local::images::{CHART_IMAGE_REPOSITORY, PAUSE_IMAGE};
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::process::{Command, Output};
use std::time::Duration;

const RELEASE: &str = "mr";
/// The chart's names for release `mr`.
const CONTROLLER: &str = "mr-model-residency";
const ROUTER: &str = "mr-model-residency-router";

/// `helm install` or `helm upgrade` of the chart with the images' values
/// and nothing else, waiting for its pods.
fn helm(namespace: &str, kubeconfig: &str, verb: &str, tag: &str) -> Output {
    let helm = PathBuf::from(crate::chart::helm());
    model_residency::local::chart::helm_release(&Release {
        helm: &helm,
        kubeconfig: Path::new(kubeconfig),
        verb,
        release: RELEASE,
        namespace,
        tag,
        wait_secs: 120,
    })
    .expect("run helm")
}

fn text(out: &Output) -> String {
    format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    )
}

/// A chat request for `model` to the router's Service, from the lane.
async fn chat(addr: SocketAddr, model: &str) -> Answer {
    let body = serde_json::json!({"model": model, "messages": [{"role": "user", "content": "hi"}]});
    model_residency::http::send(addr, "POST", "/v1/chat/completions", &body.to_string())
        .await
        .unwrap_or_else(|e| panic!("POST {addr} for {model}: {e}"))
}

/// The fake model server's template, Ready 10 s after it starts.
fn slow_template(model: &str) -> serde_json::Value {
    let mut template = real_template(model);
    template["spec"]["containers"][0]["readinessProbe"]["initialDelaySeconds"] = 10.into();
    template
}

fn image_of(pod: &Pod) -> String {
    pod.spec
        .as_ref()
        .and_then(|s| s.containers.first())
        .and_then(|c| c.image.clone())
        .unwrap_or_default()
}

#[tokio::test]
#[ignore = "needs the real node's lane (scripts/test.sh runs it)"]
async fn the_chart_serves_upgrades_and_uninstalls_under_restricted_pod_security() {
    let system = real_env("real-node-chart").await;
    let users = real_env("real-node-chart-models").await;
    let ns = system.namespace.clone();
    let labelled = system.kubectl(&[
        "label",
        "namespace",
        &ns,
        "pod-security.kubernetes.io/enforce=restricted",
    ]);
    assert!(labelled.status.success(), "{}", text(&labelled));
    let kubeconfig = system.plane.kubeconfig().display().to_string();
    let installed = helm(&ns, &kubeconfig, "install", "dev");
    if !installed.status.success() {
        let pods = system.kubectl(&["get", "all,events", "-o", "wide"]);
        panic!("helm install: {}\n{}", text(&installed), text(&pods));
    }
    // The policy is enforced there: a privileged pod is refused.
    let refused = system.kubectl(&[
        "run",
        "privileged",
        "--image",
        PAUSE_IMAGE,
        "--privileged",
        "--dry-run=server",
    ]);
    assert!(
        !refused.status.success() && text(&refused).contains("restricted"),
        "{}",
        text(&refused)
    );
    let pods: Api<Pod> = Api::namespaced(system.client.clone(), &ns);
    let chart_pods = pods.list(&Default::default()).await.unwrap().items;
    assert_eq!(chart_pods.len(), 4, "two controllers and two routers");
    assert!(
        chart_pods
            .iter()
            .all(|p| image_of(p) == format!("{CHART_IMAGE_REPOSITORY}:dev")),
        "every pod from the chart's image"
    );

    // A residency of the user's, on a GPU of the node (claim mode, the
    // default: the chart's operator makes the claim and its holder).
    let device = reserve_gpus(1);
    let residency: ModelResidency = serde_json::from_value(serde_json::json!({
        "apiVersion": "residency.dev/v1alpha1", "kind": "ModelResidency",
        "metadata": {"name": "chart-gpu"},
        "spec": {"nodeName": NODE, "device": device.to_string(), "budget": "40Gi", "models": [
            {"name": "chart-m", "size": "10Gi", "template": real_template("chart-m")},
            {"name": "chart-n", "size": "10Gi", "template": slow_template("chart-n")},
        ]},
    }))
    .unwrap();
    let residencies: Api<ModelResidency> = Api::namespaced(users.client.clone(), &users.namespace);
    residencies
        .create(&PostParams::default(), &residency)
        .await
        .unwrap();
    let services: Api<Service> = Api::namespaced(system.client.clone(), &ns);
    let ip = services
        .get(ROUTER)
        .await
        .unwrap()
        .spec
        .and_then(|s| s.cluster_ip)
        .expect("the router Service's cluster IP");
    let router: SocketAddr = format!("{ip}:80").parse().unwrap();
    crate::support::lane::served_at(router, "/readyz", 30).await;
    // Held by a router while the operator loads it, then answered.
    let first = tokio::time::timeout(Duration::from_secs(120), chat(router, "chart-m"))
        .await
        .expect("answered within 120 s");
    assert_served_by(&first, "chart-m");

    // An upgrade to a changed image, with a request held through it: for a
    // model whose load takes over 10 s, sent as the rollout starts, so
    // that the router holding it is replaced while it waits (the
    // controllers roll over the same seconds).
    let leases: Api<Lease> = Api::namespaced(system.client.clone(), &ns);
    let holder = |l: Lease| l.spec.and_then(|s| s.holder_identity).unwrap_or_default();
    let leader = holder(leases.get(CONTROLLER).await.unwrap());
    let old_routers: Vec<String> = pods
        .list(&ListParams::default().labels("app.kubernetes.io/name=model-residency-router"))
        .await
        .unwrap()
        .items
        .iter()
        .map(|p| p.name_any())
        .collect();
    assert_eq!(old_routers.len(), 2);
    let upgrade = {
        let (ns, kubeconfig) = (ns.clone(), kubeconfig.clone());
        tokio::task::spawn_blocking(move || helm(&ns, &kubeconfig, "upgrade", "dev-2"))
    };
    tokio::time::sleep(Duration::from_millis(500)).await;
    let held = tokio::time::timeout(Duration::from_secs(180), chat(router, "chart-n"))
        .await
        .expect("answered within 180 s");
    // Sent 0.5 s into the rollout, before a new router could be Ready, it
    // was held by a router of the old image: each of them was told to stop
    // (or gone) by the time it was answered.
    for name in &old_routers {
        let pod = pods.get_opt(name).await.unwrap();
        assert!(
            pod.is_none_or(|p| p.metadata.deletion_timestamp.is_some()),
            "{name} still serves: the upgrade did not overlap the held request"
        );
    }
    let upgraded = upgrade.await.unwrap();
    assert!(
        upgraded.status.success(),
        "helm upgrade: {}",
        text(&upgraded)
    );
    assert_served_by(&held, "chart-n");
    let new_leader = eventually(60, "a pod of the new image to hold the lease", || async {
        let name = holder(leases.get(CONTROLLER).await.ok()?);
        let pod = pods.get_opt(&name).await.ok()??;
        (image_of(&pod).ends_with(":dev-2")).then_some(name)
    })
    .await;
    assert_ne!(new_leader, leader);
    let after = pods.list(&Default::default()).await.unwrap().items;
    assert!(
        after
            .iter()
            .filter(|p| p.metadata.deletion_timestamp.is_none())
            .all(|p| image_of(p).ends_with(":dev-2")),
        "every pod rolled"
    );
    assert_served_by(&chat(router, "chart-m").await, "chart-m");

    // Uninstalled: none of the chart's pods stays; the CRDs and the user's
    // residency do (docs/operating.md), and deleting the residency then
    // takes its model pods, holder and claim with it, operator or not.
    let uninstalled = Command::new(crate::chart::helm())
        .args(["uninstall", RELEASE, "--namespace", &ns])
        .args(["--kubeconfig", &kubeconfig, "--wait", "--timeout", "120s"])
        .output()
        .unwrap();
    assert!(uninstalled.status.success(), "{}", text(&uninstalled));
    eventually(60, "the chart's pods to be gone", || async {
        pods.list(&Default::default())
            .await
            .ok()?
            .items
            .is_empty()
            .then_some(())
    })
    .await;
    assert!(residencies.get_opt("chart-gpu").await.unwrap().is_some());
    let crd = system.kubectl(&["get", "crd", "modelresidencies.residency.dev"]);
    assert!(crd.status.success(), "{}", text(&crd));
    residencies
        .delete("chart-gpu", &DeleteParams::default())
        .await
        .unwrap();
    let user_pods: Api<Pod> = Api::namespaced(users.client.clone(), &users.namespace);
    let claims: Api<ResourceClaim> = Api::namespaced(users.client.clone(), &users.namespace);
    eventually(90, "the residency's pods and claim to be gone", || async {
        let pods = user_pods.list(&Default::default()).await.ok()?.items;
        let claims = claims.list(&Default::default()).await.ok()?.items;
        (pods.is_empty() && claims.is_empty()).then_some(())
    })
    .await;
}
