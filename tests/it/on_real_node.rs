//! The real-node lane: the operator and the router against the real
//! kubelet v1.37.2 on containerd v2.4.2 and runc, pods in containers with
//! addresses of their own on the lane's bridge, GPUs from our DRA kubelet
//! plugin through CDI (support/lane.rs). `scripts/test.sh` runs these
//! inside `model-residency lane`, one at a time.
//!
//! Each test checks something a node that lied would get wrong: a
//! container's id and pid, the environment CDI injected, a read-only mount
//! seen from inside, a drain after a real SIGTERM, a process killed under
//! the kubelet.

use crate::support::cluster::eventually;
use crate::support::http::send;
use crate::support::lane::{NODE, cluster, real_harness};
use crate::support::operator::Harness;
use crate::support::router::{RouterUnderTest, assert_served_by, json_of};
use k8s_openapi::api::core::v1::Pod;
use model_residency::api::ModelState;
use serde_json::Value;
use std::net::SocketAddr;

/// A pod's container id (`containerd://...`), IP and phase.
fn container_of(pod: &Pod) -> (String, String, String) {
    let status = pod.status.clone().unwrap_or_default();
    let id = status
        .container_statuses
        .iter()
        .flatten()
        .find_map(|c| c.container_id.clone())
        .unwrap_or_default();
    (
        id,
        status.pod_ip.unwrap_or_default(),
        status.phase.unwrap_or_default(),
    )
}

/// What the fake server in `pod`'s container says about itself.
async fn inside(pod: &Pod, path: &str) -> Value {
    let (_, ip, _) = container_of(pod);
    let addr: SocketAddr = format!("{ip}:8080").parse().expect("a pod IP");
    let a = send(addr, "GET", path, "").await;
    assert_eq!(a.status, 200, "{path} on {ip}: {}", a.body);
    serde_json::from_str(&a.body).unwrap()
}

/// The one live model pod of `model` in residency `name`.
async fn model_pod(h: &Harness, name: &str, model: &str) -> Pod {
    let pod = model_residency::controller::pods::pod_name(name, model);
    eventually(60, &format!("{pod} Running and Ready"), || async {
        let p = h.pods.get_opt(&pod).await.ok()??;
        let ready = p
            .status
            .as_ref()?
            .conditions
            .iter()
            .flatten()
            .any(|c| c.type_ == "Ready" && c.status == "True");
        (ready && p.metadata.deletion_timestamp.is_none()).then_some(p)
    })
    .await
}

/// Device name -> uuid, as the plugin publishes the node's GPUs in its
/// ResourceSlice.
async fn uuids_on_node(client: &kube::Client) -> std::collections::BTreeMap<String, String> {
    let slices: kube::Api<k8s_openapi::api::resource::v1::ResourceSlice> =
        kube::Api::all(client.clone());
    slices
        .list(&Default::default())
        .await
        .unwrap()
        .items
        .into_iter()
        .filter(|s| s.spec.node_name.as_deref() == Some(NODE))
        .flat_map(|s| s.spec.devices.unwrap_or_default())
        .filter_map(|d| Some((d.name.clone(), d.attributes?.get("uuid")?.string.clone()?)))
        .collect()
}

#[tokio::test]
#[ignore = "needs the real node's lane (scripts/test.sh runs it)"]
async fn the_seeds_requests_run_in_real_containers_through_the_router() {
    let h = real_harness("real-node-seed", 1).await;
    let wide = h.env.kubectl(&["get", "nodes", "-o", "wide"]);
    let wide = String::from_utf8_lossy(&wide.stdout);
    assert!(
        wide.lines().any(|l| l.starts_with(NODE)
            && l.contains(" Ready ")
            && l.contains("containerd://2.4.2")),
        "kubectl get nodes -o wide:\n{wide}"
    );
    // The seed's policy on room for two: A, B, A, C evicts B (the least
    // recently used), as the engine's first case.
    h.create(
        "seed",
        "40Gi",
        &[
            ("a", "20Gi", false),
            ("b", "20Gi", false),
            ("c", "20Gi", false),
        ],
    )
    .await;
    let router = RouterUnderTest::exact(&h).await;
    let mut containers = Vec::new();
    for model in ["a", "b", "a", "c"] {
        let answer = router.chat(model).await;
        assert_served_by(&answer, model);
        let pod = model_pod(&h, "seed", model).await;
        let (id, ip, phase) = container_of(&pod);
        assert!(
            id.starts_with("containerd://"),
            "{model}: container id {id:?}"
        );
        assert!(
            ip.starts_with("10.88."),
            "{model}: pod IP {ip} is not on the lane's bridge"
        );
        assert_eq!(phase, "Running");
        containers.push((model, id));
    }
    // The second request for a was a hit on the same container.
    assert_eq!(containers[0], containers[2]);
    let r = h.converged("seed").await;
    let resident: Vec<_> = r
        .status
        .unwrap()
        .models
        .into_iter()
        .filter(|m| m.state == ModelState::Loaded)
        .map(|m| m.name.to_string())
        .collect();
    assert_eq!(resident.len(), 2, "{resident:?}");
    assert!(
        !resident.contains(&"b".to_string()),
        "b was the LRU: {resident:?}"
    );
    eventually(60, "b's pod to be gone from the node", || async {
        let b = model_residency::controller::pods::pod_name("seed", "b");
        h.pods.get_opt(&b).await.ok()?.is_none().then_some(())
    })
    .await;
}

#[tokio::test]
#[ignore = "needs the real node's lane (scripts/test.sh runs it)"]
async fn the_gpu_claim_is_shared_by_the_holder_and_the_model_pods_through_cdi() {
    let h = real_harness("real-node-claim", 1).await;
    h.create(
        "shared",
        "80Gi",
        &[("x", "20Gi", false), ("y", "20Gi", false)],
    )
    .await;
    let router = RouterUnderTest::exact(&h).await;
    assert_served_by(&router.chat("x").await, "x");
    assert_served_by(&router.chat("y").await, "y");
    let r = h.placed("shared").await;
    let gpu = r.status.unwrap().gpu.unwrap();
    let device = gpu.device.clone().unwrap();
    // The uuid the plugin published for that device, from its slice.
    let uuid = uuids_on_node(&h.env.client)
        .await
        .remove(&device)
        .expect("the device's uuid");
    let mut claims = Vec::new();
    for model in ["x", "y"] {
        let pod = model_pod(&h, "shared", model).await;
        let seen = inside(&pod, "/fake/container").await;
        assert_eq!(
            seen["env"]["NVIDIA_VISIBLE_DEVICES"], uuid,
            "{model}: the CDI spec's env in the container: {seen}"
        );
        assert_eq!(seen["env"]["FAKE_GPU_DEVICES"], device.as_str());
        claims.push(seen["env"]["FAKE_GPU_CLAIM"].clone());
    }
    assert_eq!(claims[0], claims[1], "one claim for both model pods");
    // The holder keeps the claim with them, in a container of its own.
    let holders = h
        .pods
        .list(&kube::api::ListParams::default().labels("residency.dev/gpu-holder"))
        .await
        .unwrap()
        .items;
    assert_eq!(holders.len(), 1);
    let (id, _, phase) = container_of(&holders[0]);
    assert!(
        id.starts_with("containerd://") && phase == "Running",
        "{id} {phase}"
    );
    let claim_name = holders[0]
        .spec
        .as_ref()
        .unwrap()
        .resource_claims
        .as_ref()
        .unwrap()[0]
        .resource_claim_name
        .clone()
        .unwrap();
    assert_eq!(
        claims[0],
        format!("{}/{claim_name}", h.env.namespace).as_str()
    );
}

#[tokio::test]
#[ignore = "needs the real node's lane (scripts/test.sh runs it)"]
async fn an_unloaded_pod_finishes_its_stream_after_sigterm_and_gets_nothing_new() {
    let h = real_harness("real-node-drain", 1).await;
    h.create("drain", "80Gi", &[("long", "20Gi", false)]).await;
    let router = RouterUnderTest::exact(&h).await;
    assert_served_by(&router.chat("long").await, "long");
    let pod = model_pod(&h, "drain", "long").await;
    let uid = pod.metadata.uid.clone().unwrap();
    // 150 chunks 20 ms apart: about 3 s of stream, begun before the unload.
    let body = r#"{"model":"long","stream":true,"max_tokens":150,"messages":[]}"#;
    let addr = router.addr;
    let stream =
        tokio::spawn(async move { send(addr, "POST", "/v1/chat/completions", body).await });
    tokio::time::sleep(std::time::Duration::from_millis(500)).await;
    model_residency::residency::demand::unload(&h.api, "drain", "long")
        .await
        .unwrap();
    eventually(30, "the pod to be terminating", || async {
        let p = h.pods.get_opt(&pod_name(&pod)).await.ok()??;
        p.metadata.deletion_timestamp.is_some().then_some(())
    })
    .await;
    // The container's own log, followed from now until it exits: the
    // kubelet sent it SIGTERM, and it drained before it went.
    let follow = {
        let kubectl = model_residency::local::control_plane::kubectl();
        let (kubeconfig, ns) = (h.env.plane.kubeconfig().to_owned(), h.env.namespace.clone());
        let pod = pod_name(&pod);
        tokio::task::spawn_blocking(move || {
            std::process::Command::new(kubectl)
                .env("KUBECONFIG", kubeconfig)
                .args(["-n", &ns, "logs", "-f", &pod])
                .output()
        })
    };
    // Nothing new reaches the draining pod: the router holds the request
    // for a new load instead (answered by another pod, or still held).
    let next = tokio::spawn({
        let addr = router.addr;
        async move {
            send(
                addr,
                "POST",
                "/v1/chat/completions",
                r#"{"model":"long","messages":[]}"#,
            )
            .await
        }
    });
    let answer = stream.await.unwrap();
    assert_eq!(answer.status, 200);
    let chunks = answer.body.matches("data: {").count();
    assert_eq!(
        chunks,
        150,
        "the whole stream, not cut by SIGTERM: {}",
        answer.body.len()
    );
    assert!(answer.body.contains("data: [DONE]"));
    let logs = tokio::time::timeout(std::time::Duration::from_secs(30), follow)
        .await
        .expect("the container to exit within its grace period")
        .unwrap()
        .expect("kubectl logs -f");
    let logs = String::from_utf8_lossy(&logs.stdout);
    let (term, drained) = (logs.find("got SIGTERM"), logs.find("drained; exiting"));
    assert!(
        term.is_some() && drained > term,
        "the container's log:\n{logs}"
    );
    let next = next.await.unwrap();
    if next.status == 200 {
        let served_by = json_of(&next)["pod"].clone();
        let new = h.pods.get_opt(served_by.as_str().unwrap()).await.unwrap();
        assert_ne!(
            new.and_then(|p| p.metadata.uid),
            Some(uid.clone()),
            "a new pod served it"
        );
    } else {
        assert_eq!(next.status, 503, "{}", next.body);
    }
}

fn pod_name(pod: &Pod) -> String {
    pod.metadata.name.clone().unwrap_or_default()
}

#[tokio::test]
#[ignore = "needs the real node's lane (scripts/test.sh runs it)"]
async fn a_container_killed_under_the_kubelet_is_seen_and_its_model_loaded_again() {
    let h = real_harness("real-node-kill", 1).await;
    h.create("kill", "80Gi", &[("victim", "20Gi", false)]).await;
    let router = RouterUnderTest::exact(&h).await;
    assert_served_by(&router.chat("victim").await, "victim");
    let pod = model_pod(&h, "kill", "victim").await;
    let (id, _, _) = container_of(&pod);
    let id = id.trim_start_matches("containerd://").to_owned();
    let killed = cluster()
        .node
        .ctr(["tasks", "kill", "--signal", "SIGKILL", &id]);
    assert!(
        killed.status.success(),
        "ctr tasks kill: {}",
        String::from_utf8_lossy(&killed.stderr)
    );
    // The kubelet sees the exit (137) and fails the pod (restartPolicy
    // Never: the operator reloads); the operator sees it and loads again.
    let failed = eventually(60, "the kubelet to report the killed container", || async {
        let p = h.pods.get_opt(&pod_name(&pod)).await.ok()??;
        let terminated = p
            .status
            .as_ref()?
            .container_statuses
            .iter()
            .flatten()
            .find_map(|c| c.state.as_ref()?.terminated.clone())?;
        Some(terminated)
    })
    .await;
    assert_eq!(failed.exit_code, 137, "{failed:?}");
    // The operator's view: the load failed (the pod did), retried after
    // its backoff; the router says so meanwhile, then serves the new pod.
    let mut answers = Vec::new();
    for _ in 0..40 {
        let answer = router.chat("victim").await;
        let ok = answer.status == 200;
        answers.push(answer);
        if ok {
            break;
        }
        tokio::time::sleep(std::time::Duration::from_secs(1)).await;
    }
    let last = answers.last().unwrap();
    assert_served_by(last, "victim");
    if let Some(refused) = answers.iter().find(|a| a.status != 200) {
        assert_eq!(refused.status, 503, "{}", refused.body);
        assert!(refused.body.contains("pod Failed"), "{}", refused.body);
    }
    let again = model_pod(&h, "kill", "victim").await;
    assert_ne!(again.metadata.uid, pod.metadata.uid, "a new pod serves it");
    let (new_id, _, _) = container_of(&again);
    assert_ne!(new_id.trim_start_matches("containerd://"), id);
}

#[tokio::test]
#[ignore = "needs the real node's lane (scripts/test.sh runs it)"]
async fn the_warm_tier_sleeps_and_wakes_the_same_container() {
    let h = real_harness("real-node-warm", 1).await;
    let template =
        model_residency::local::images::model_server_template(8080, Some("sleep=100ms,wake=50ms"));
    let r: model_residency::api::ModelResidency = serde_json::from_value(serde_json::json!({
        "apiVersion": "residency.dev/v1alpha1", "kind": "ModelResidency",
        "metadata": {"name": "warm"},
        "spec": {
            "nodeName": NODE, "device": h.next_device.load(std::sync::atomic::Ordering::Relaxed).to_string(),
            "budget": "10Gi", "warm": {"hostBudget": "8Gi"},
            "models": [
                {"name": "a", "size": "6Gi", "sleep": {"preset": "vllm", "sleepingSize": "1Gi"}, "template": template},
                {"name": "b", "size": "6Gi", "template": crate::support::lane::real_template("b")},
            ],
        },
    }))
    .unwrap();
    h.api.create(&Default::default(), &r).await.unwrap();
    h.placed("warm").await;
    let router = RouterUnderTest::exact(&h).await;
    assert_served_by(&router.chat("a").await, "a");
    let first = model_pod(&h, "warm", "a").await;
    let before = inside(&first, "/fake/container").await;
    // b needs the room: a sleeps in its container instead of going.
    assert_served_by(&router.chat("b").await, "b");
    h.until_state("warm", "a", ModelState::Sleeping, 60).await;
    assert_eq!(inside(&first, "/fake/stats").await["asleep"], true);
    // a again: woken in the same container (same id, same process).
    assert_served_by(&router.chat("a").await, "a");
    let now = model_pod(&h, "warm", "a").await;
    assert_eq!(
        container_of(&now).0,
        container_of(&first).0,
        "the same container"
    );
    assert_eq!(now.metadata.uid, first.metadata.uid);
    let after = inside(&now, "/fake/container").await;
    assert_eq!(after["pid"], before["pid"], "the same process");
    let stats = inside(&now, "/fake/stats").await;
    assert_eq!(
        (stats["sleeps"].as_u64(), stats["wakes"].as_u64()),
        (Some(1), Some(1)),
        "{stats}"
    );
    let restarts = now.status.unwrap().container_statuses.unwrap()[0].restart_count;
    assert_eq!(restarts, 0);
}

#[tokio::test]
#[ignore = "needs the real node's lane (scripts/test.sh runs it)"]
async fn the_node_agent_runs_as_a_pod_and_the_artifact_is_read_only_in_the_model_container() {
    use crate::support::artifact_server::{serve, sha256_hex, weights};
    let h = real_harness("real-node-artifact", 1).await;
    let (addr, requests) = serve().await;
    // The agent as a DaemonSet's pod would run it: host network (the API
    // server is on the lane's loopback), its cache a hostPath that the
    // model pods' hostPath mounts then share, on the real node.
    let dir = tempfile::tempdir().unwrap();
    let cache = dir.path().join("cache");
    std::fs::create_dir_all(&cache).unwrap();
    let cache = cache.display().to_string();
    let kubeconfig = h.env.plane.kubeconfig().display().to_string();
    let port = crate::support::http::free_port();
    let agent: Pod = serde_json::from_value(serde_json::json!({
        "metadata": {"name": "node-agent"},
        "spec": {
            "nodeName": NODE, "hostNetwork": true, "terminationGracePeriodSeconds": 1,
            "containers": [{
                "name": "agent", "image": model_residency::local::images::MODEL_SERVER_IMAGE,
                "imagePullPolicy": "Never",
                "command": ["/model-residency", "node-agent", "--node", NODE, "--disk-budget", "10Mi",
                            "--cache-dir", cache, "--allowed-sources", format!("http://{addr}/"),
                            "--http-addr", format!("127.0.0.1:{port}")],
                "env": [{"name": "KUBECONFIG", "value": "/etc/lane/kubeconfig"}, {"name": "RUST_LOG", "value": "info"}],
                "readinessProbe": {"httpGet": {"host": "127.0.0.1", "path": "/readyz", "port": port}, "periodSeconds": 1},
                "volumeMounts": [{"name": "cache", "mountPath": cache},
                                 {"name": "kubeconfig", "mountPath": "/etc/lane/kubeconfig", "readOnly": true}],
            }],
            "volumes": [{"name": "cache", "hostPath": {"path": cache, "type": "Directory"}},
                        {"name": "kubeconfig", "hostPath": {"path": kubeconfig, "type": "File"}}],
        },
    }))
    .unwrap();
    h.pods.create(&Default::default(), &agent).await.unwrap();
    let ready = tokio::time::timeout(std::time::Duration::from_secs(60), async {
        loop {
            let p = h.pods.get("node-agent").await.unwrap();
            let conditions = p.status.and_then(|s| s.conditions).unwrap_or_default();
            if conditions
                .iter()
                .any(|c| c.type_ == "Ready" && c.status == "True")
            {
                return;
            }
            tokio::time::sleep(std::time::Duration::from_millis(200)).await;
        }
    })
    .await;
    if ready.is_err() {
        let describe = h.env.kubectl(&["describe", "pod", "node-agent"]);
        let logs = h.env.kubectl(&["logs", "node-agent"]);
        panic!(
            "the node agent's pod not Ready in 60 s:\n{}\n{}{}",
            String::from_utf8_lossy(&describe.stdout),
            String::from_utf8_lossy(&logs.stdout),
            String::from_utf8_lossy(&logs.stderr)
        );
    }
    let artifact = serde_json::json!({"files": [{"uri": format!("http://{addr}/weights.bin"),
        "sha256": sha256_hex(&weights())}], "size": "1Mi"});
    let mut w = serde_json::json!({"name": "w", "size": "20Gi", "template": crate::support::lane::real_template("w")});
    w["artifact"] = artifact;
    let r: model_residency::api::ModelResidency = serde_json::from_value(serde_json::json!({
        "apiVersion": "residency.dev/v1alpha1", "kind": "ModelResidency",
        "metadata": {"name": "art"},
        "spec": {"nodeName": NODE, "device": h.next_device.load(std::sync::atomic::Ordering::Relaxed).to_string(),
                 "budget": "40Gi", "models": [w]},
    }))
    .unwrap();
    h.api.create(&Default::default(), &r).await.unwrap();
    h.placed("art").await;
    let router = RouterUnderTest::exact(&h).await;
    assert_served_by(&router.chat("w").await, "w");
    let pod = model_pod(&h, "art", "w").await;
    // Read inside the container, through the kubelet's real bind mount.
    let file = inside(&pod, "/fake/file?path=/models/w/weights.bin").await;
    assert_eq!(file["sha256"], sha256_hex(&weights()).as_str(), "{file}");
    assert_eq!(file["bytes"], weights().len());
    assert_eq!(file["writable"], false, "{file}");
    assert!(
        file["write_error"]
            .as_str()
            .unwrap_or_default()
            .contains("Read-only file system"),
        "{file}"
    );
    assert_eq!(
        requests.load(std::sync::atomic::Ordering::Relaxed),
        1,
        "fetched once"
    );
    h.pods
        .delete("node-agent", &Default::default())
        .await
        .unwrap();
}

/// A ResidencySet over the GPUs the real node's DRA plugin publishes: a
/// GPU added to its slice gets a residency, whose model loads in a real
/// container; taken away, the request on it is answered, the model
/// unloaded and the residency removed.
#[tokio::test]
#[ignore = "needs the real node's lane (scripts/test.sh runs it)"]
async fn a_set_follows_the_gpus_the_real_plugin_publishes() {
    use crate::support::lane::GPUS;
    use kube::api::{Api, PostParams};
    use model_residency::api::{ModelCatalog, ResidencySet};
    let h = real_harness("real-node-set", 0).await;
    let catalogs: Api<ModelCatalog> = Api::namespaced(h.env.client.clone(), &h.env.namespace);
    let catalog: ModelCatalog = serde_json::from_value(serde_json::json!({
        "apiVersion": "residency.dev/v1alpha1", "kind": "ModelCatalog",
        "metadata": {"name": "models"},
        "spec": {"models": [{"name": "m", "size": "10Gi", "template": (h.template)("m")}]},
    }))
    .unwrap();
    catalogs
        .create(&PostParams::default(), &catalog)
        .await
        .unwrap();
    // Only GPUs past the lane's own (the plugin publishes GPUS of them).
    let sets: Api<ResidencySet> = Api::namespaced(h.env.client.clone(), &h.env.namespace);
    let set: ResidencySet = serde_json::from_value(serde_json::json!({
        "apiVersion": "residency.dev/v1alpha1", "kind": "ResidencySet",
        "metadata": {"name": "extra"},
        "spec": {"devices": {"selectors": [{"cel": {"expression":
                    format!("device.attributes['gpu.nvidia.com'].index >= {GPUS}")}}]},
            "catalog": {"name": "models"},
            "residency": {"budget": "40Gi", "gpu": {"mode": "env"}}},
    }))
    .unwrap();
    sets.create(&PostParams::default(), &set).await.unwrap();
    let stamped = || crate::residency_set::stamped(&h, "extra");
    assert!(stamped().await.is_empty());
    // A GPU appears in the plugin's slice.
    let node = &cluster().node;
    node.set_gpus(GPUS + 1).unwrap();
    let name = format!("extra-{NODE}-gpu-{GPUS}");
    eventually(60, "a residency stamped for the new GPU", || async {
        (stamped().await == [name.clone()].into()).then_some(())
    })
    .await;
    let router = std::sync::Arc::new(RouterUnderTest::exact(&h).await);
    assert_served_by(&router.chat("m").await, "m");
    let pod = model_pod(&h, &name, "m").await;
    assert!(container_of(&pod).0.starts_with("containerd://"));
    // It leaves while a request for its model is sent: answered, then the
    // model unloaded and the residency gone.
    let asked = {
        let router = router.clone();
        tokio::spawn(async move { router.chat("m").await })
    };
    node.set_gpus(GPUS).unwrap();
    assert_served_by(&asked.await.unwrap(), "m");
    eventually(
        90,
        "the residency of the GPU that left to be gone",
        || async { stamped().await.is_empty().then_some(()) },
    )
    .await;
    let gone = model_residency::controller::pods::pod_name(&name, "m");
    eventually(60, "its model pod to be gone", || async {
        h.pods.get_opt(&gone).await.ok()?.is_none().then_some(())
    })
    .await;
}

/// Services on the real node, as in any cluster: kube-proxy's rules send a
/// Service's cluster IP to its pod (here from the lane's own process), and
/// a pod with a ServiceAccount reaches the API server through the
/// `kubernetes` Service with the token and CA the cluster mounts into it
/// (our binary's `top`, in-cluster, lists a residency the test made).
#[tokio::test]
#[ignore = "needs the real node's lane (scripts/test.sh runs it)"]
async fn services_route_to_pods_and_pods_reach_the_api_in_cluster() {
    use crate::support::lane::real_env;
    use k8s_openapi::api::core::v1::Service;
    use kube::api::{Api, PostParams};
    use model_residency::local::images::{MODEL_SERVER_IMAGE, PAUSE_IMAGE};
    let env = real_env("real-node-services").await;
    env.install_crds();
    let pods: Api<Pod> = Api::namespaced(env.client.clone(), &env.namespace);
    let pp = PostParams::default();
    // A fake model server behind a Service on port 80.
    let server: Pod = serde_json::from_value(serde_json::json!({
        "metadata": {"name": "server", "labels": {"app": "server"}},
        "spec": {"nodeName": NODE, "terminationGracePeriodSeconds": 1, "containers": [{
            "name": "server", "image": MODEL_SERVER_IMAGE, "imagePullPolicy": "Never",
            "args": ["--listen", "0.0.0.0:8080"],
            "env": [{"name": "MODEL_NAME", "value": "behind-a-service"}],
            "readinessProbe": {"httpGet": {"path": "/health", "port": 8080}, "periodSeconds": 1},
        }]},
    }))
    .unwrap();
    pods.create(&pp, &server).await.unwrap();
    let services: Api<Service> = Api::namespaced(env.client.clone(), &env.namespace);
    let service: Service = serde_json::from_value(serde_json::json!({
        "metadata": {"name": "server"},
        "spec": {"selector": {"app": "server"}, "ports": [{"port": 80, "targetPort": 8080}]},
    }))
    .unwrap();
    let ip = services
        .create(&pp, &service)
        .await
        .unwrap()
        .spec
        .and_then(|s| s.cluster_ip)
        .expect("a cluster IP");
    let addr: SocketAddr = format!("{ip}:80").parse().unwrap();
    let models = crate::support::lane::served_at(addr, "/v1/models", 60).await;
    assert!(models.contains("behind-a-service"), "{models}");

    // A residency (no operator runs: it is only read) and a pod that lists
    // it with our binary's in-cluster client, allowed by a Role.
    let residency: model_residency::api::ModelResidency =
        serde_json::from_value(serde_json::json!({
            "apiVersion": "residency.dev/v1alpha1", "kind": "ModelResidency",
            "metadata": {"name": "seen-from-a-pod"},
            "spec": {"nodeName": NODE, "device": "0", "budget": "40Gi", "models": []},
        }))
        .unwrap();
    Api::namespaced(env.client.clone(), &env.namespace)
        .create(&pp, &residency)
        .await
        .unwrap();
    let rbac = format!(
        "apiVersion: v1\nkind: ServiceAccount\nmetadata: {{name: reader, namespace: {ns}}}\n---\n\
         apiVersion: rbac.authorization.k8s.io/v1\nkind: Role\nmetadata: {{name: reader, namespace: {ns}}}\n\
         rules: [{{apiGroups: [residency.dev], resources: [modelresidencies, modelcatalogs], verbs: [get, list]}}]\n---\n\
         apiVersion: rbac.authorization.k8s.io/v1\nkind: RoleBinding\nmetadata: {{name: reader, namespace: {ns}}}\n\
         roleRef: {{apiGroup: rbac.authorization.k8s.io, kind: Role, name: reader}}\n\
         subjects: [{{kind: ServiceAccount, name: reader, namespace: {ns}}}]\n",
        ns = env.namespace
    );
    let file = tempfile::NamedTempFile::new().unwrap();
    std::fs::write(file.path(), rbac).unwrap();
    let applied = env.kubectl(&["apply", "-f", &file.path().display().to_string()]);
    assert!(applied.status.success(), "{applied:?}");
    let reader: Pod = serde_json::from_value(serde_json::json!({
        "metadata": {"name": "reader"},
        "spec": {"nodeName": NODE, "serviceAccountName": "reader", "restartPolicy": "Never",
            "containers": [{"name": "top", "image": PAUSE_IMAGE, "imagePullPolicy": "Never",
                "command": ["/model-residency", "top", "--once", "-o", "json"]}]},
    }))
    .unwrap();
    pods.create(&pp, &reader).await.unwrap();
    let phase = eventually(90, "the reader pod to finish", || async {
        let p = pods.get("reader").await.ok()?;
        let phase = p.status?.phase?;
        matches!(phase.as_str(), "Succeeded" | "Failed").then_some(phase)
    })
    .await;
    let logs = env.kubectl(&["logs", "reader"]);
    let out = String::from_utf8_lossy(&logs.stdout);
    assert_eq!(
        phase,
        "Succeeded",
        "{out}{}",
        String::from_utf8_lossy(&logs.stderr)
    );
    let listed: Value = serde_json::from_str(&out).unwrap_or_else(|e| panic!("{e}: {out}"));
    assert_eq!(listed[0]["residency"], "seen-from-a-pod", "{listed}");
    // It was in-cluster: the pod had no kubeconfig, only the token and CA
    // the cluster mounted into it (ServiceAccount admission's projected
    // volume), and `top` read those.
    let p = pods.get("reader").await.unwrap();
    let spec = p.spec.unwrap();
    let mounted: Vec<String> = spec.containers[0]
        .volume_mounts
        .iter()
        .flatten()
        .map(|m| m.mount_path.clone())
        .collect();
    assert!(
        mounted.contains(&"/var/run/secrets/kubernetes.io/serviceaccount".to_owned()),
        "{mounted:?}"
    );
}

mod chart;
mod gangs;
