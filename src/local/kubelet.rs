//! The kubelet stand-in: plays the kubelet for fake GPU nodes on the local
//! control plane, where no kubelet (and no container runtime) can run.
//!
//! Placement is real: kube-scheduler binds each pod to a node (the operator
//! only says which, by node affinity); the stand-in plays the node's side.
//! What it fakes, and nothing more:
//! - **Nodes.** Registers each declared node with a `Ready` condition and a
//!   capacity and allocatable of `nvidia.com/gpu: <gpus>` plus nominal cpu
//!   (16), memory (64Gi) and pods (110), which the scheduler fits pods
//!   against, and takes off the `node.kubernetes.io/not-ready` taint the
//!   API server puts on a new node (the node lifecycle controller's part,
//!   which is not run: without heartbeats it would find every node
//!   unreachable). No heartbeats, no node leases.
//! - **Starting pods.** A pod the scheduler bound to one of its nodes
//!   (`spec.nodeName`) that is still `Pending` is marked `Running` and `Ready` (pod conditions and
//!   one running status per container) after `load_delay`, plus
//!   `delay_per_gib` for each GiB in the pod's `residency.dev/size`
//!   annotation, to mimic a model loading into VRAM. No container runs; no
//!   probe is evaluated; no image is pulled.
//! - **Failing pods.** A pod annotated `kubelet-standin.residency.dev/fail:
//!   <message>` is marked `Failed` (reason `StandInFailure`) instead, and
//!   [`fail_pod`] fails a running pod on request. So is a pod with a
//!   `hostPath` volume of `type: Directory` whose directory does not exist
//!   on this machine, as a kubelet refuses it (the node agent's artifacts
//!   are real directories here).
//! - **Serving.** When it marks a pod Ready it starts a fake model server
//!   for it ([`super::model_server`]) on a loopback address of the pod's own
//!   (its `status.podIP`) and the first container's first `containerPort`
//!   (8080 if none), and stops it when it finishes the pod's deletion. So
//!   traffic to a model pod is real HTTP; what answers is not a model. An
//!   address another process holds is skipped for the next one; a pod whose
//!   server cannot listen at all is marked `Failed`, never Ready.
//! - **Finishing deletions.** A bound pod whose `deletionTimestamp` is set is
//!   deleted with grace period 0, as the kubelet does once containers stop
//!   (`terminating_delay` later). Finalizers are left alone.
//!
//! Pods on other nodes, and unbound pods, are never touched.

use super::model_server::{FakeModelServer, Identity, next_pod_ip};
use crate::quantity::parse_bytes;
use crate::residency::labels::{MODEL_LABEL, SIZE_ANNOTATION};
use futures::TryStreamExt;
use k8s_openapi::api::core::v1::{Node, Pod};
use kube::api::{Api, DeleteParams, Patch, PatchParams, Preconditions};
use kube::runtime::{WatchStreamExt, watcher};
use serde_json::json;
use std::collections::{HashMap, HashSet};
use std::net::{Ipv4Addr, SocketAddr};
use std::sync::{Arc, Mutex};
use std::time::Duration;
use tokio::task::JoinHandle;

/// Pod annotation that makes the stand-in fail the pod with this message.
pub const FAIL_ANNOTATION: &str = "kubelet-standin.residency.dev/fail";
/// Node label marking nodes registered by the stand-in.
pub const FAKE_NODE_LABEL: &str = "kubelet-standin.residency.dev/fake";
const MANAGER: &str = "kubelet-standin";
/// How often, and how far apart, an action the API server did not take is
/// tried (a minute in all: longer than any API server restart in the tests).
const ACTION_ATTEMPTS: u32 = 120;
const ACTION_RETRY: Duration = Duration::from_millis(500);

/// A node the stand-in plays the kubelet for.
#[derive(Clone, Debug)]
pub struct FakeNode {
    pub name: String,
    pub gpus: u32,
}

#[derive(Clone, Debug)]
pub struct KubeletConfig {
    pub nodes: Vec<FakeNode>,
    /// Time from seeing a pending pod to marking it Ready.
    pub load_delay: Duration,
    /// Extra load time per GiB of the pod's `residency.dev/size`.
    pub delay_per_gib: Duration,
    /// Time from `deletionTimestamp` to the final delete.
    pub terminating_delay: Duration,
    /// Time between the chunks of a streamed answer of the fake servers.
    pub stream_delay: Duration,
}

impl KubeletConfig {
    /// Nodes with one GPU each, pods ready at once.
    pub fn instant(nodes: &[&str]) -> Self {
        KubeletConfig {
            nodes: nodes
                .iter()
                .map(|n| FakeNode {
                    name: (*n).to_owned(),
                    gpus: 1,
                })
                .collect(),
            load_delay: Duration::ZERO,
            delay_per_gib: Duration::ZERO,
            terminating_delay: Duration::ZERO,
            stream_delay: Duration::from_millis(20),
        }
    }
}

/// A running stand-in; stops when dropped.
pub struct FakeKubelet {
    task: JoinHandle<()>,
}

impl Drop for FakeKubelet {
    fn drop(&mut self) {
        self.task.abort();
    }
}

impl FakeKubelet {
    /// Registers the nodes and starts playing their kubelet.
    pub async fn start(client: kube::Client, config: KubeletConfig) -> Result<Self, kube::Error> {
        let nodes: Api<Node> = Api::all(client.clone());
        for node in &config.nodes {
            register_node(&nodes, node).await?;
        }
        let config = Arc::new(config);
        let task = tokio::spawn(run(client, config));
        Ok(FakeKubelet { task })
    }
}

async fn register_node(nodes: &Api<Node>, node: &FakeNode) -> Result<(), kube::Error> {
    let now = kube_time_now();
    let capacity = json!({
        "cpu": "16", "memory": "64Gi", "pods": "110", "nvidia.com/gpu": node.gpus.to_string(),
    });
    let body = json!({
        "apiVersion": "v1", "kind": "Node",
        "metadata": {"name": node.name, "labels": {
            "kubernetes.io/hostname": node.name, FAKE_NODE_LABEL: "true",
        }},
    });
    let pp = PatchParams::apply(MANAGER).force();
    nodes.patch(&node.name, &pp, &Patch::Apply(&body)).await?;
    let status = json!({
        "apiVersion": "v1", "kind": "Node",
        "status": {
            "capacity": capacity, "allocatable": capacity,
            "conditions": [{
                "type": "Ready", "status": "True", "reason": "KubeletReady",
                "message": "kubelet stand-in (no containers run)",
                "lastHeartbeatTime": now, "lastTransitionTime": now,
            }],
        },
    });
    nodes
        .patch_status(&node.name, &pp, &Patch::Apply(&status))
        .await?;
    // The API server taints a new node not-ready (NoSchedule); the node
    // lifecycle controller takes the taint off once the node reports
    // Ready. That controller is not run here (without kubelet heartbeats it
    // would declare every node unreachable), so the stand-in does its part.
    let registered = nodes.get(&node.name).await?;
    let taints = registered.spec.and_then(|s| s.taints).unwrap_or_default();
    if taints.iter().any(|t| t.key == NOT_READY_TAINT) {
        let kept: Vec<_> = taints
            .into_iter()
            .filter(|t| t.key != NOT_READY_TAINT)
            .collect();
        let patch = json!({"spec": {"taints": kept}});
        nodes
            .patch(&node.name, &PatchParams::default(), &Patch::Merge(&patch))
            .await?;
    }
    Ok(())
}

/// The taint a new node carries until it is Ready.
const NOT_READY_TAINT: &str = "node.kubernetes.io/not-ready";

async fn run(client: kube::Client, config: Arc<KubeletConfig>) {
    let names: HashSet<String> = config.nodes.iter().map(|n| n.name.clone()).collect();
    // Pods we are already starting or deleting, by uid.
    let busy: Arc<Mutex<HashSet<String>>> = Arc::default();
    // The fake model server of each running pod, by uid (dropped, and so
    // stopped, with the stand-in).
    let servers: Servers = Arc::default();
    let pods: Api<Pod> = Api::all(client.clone());
    let stream = watcher(pods, watcher::Config::default())
        .default_backoff()
        .applied_objects();
    let mut stream = std::pin::pin!(stream);
    loop {
        let pod = match stream.try_next().await {
            Ok(Some(pod)) => pod,
            Ok(None) => return,
            Err(e) => {
                tracing::warn!(error = %e, "kubelet stand-in watch error");
                continue;
            }
        };
        let Some(node) = pod.spec.as_ref().and_then(|s| s.node_name.as_deref()) else {
            continue;
        };
        if !names.contains(node) {
            continue;
        }
        let (Some(uid), Some(name), Some(ns)) = (
            pod.metadata.uid.clone(),
            pod.metadata.name.clone(),
            pod.metadata.namespace.clone(),
        ) else {
            continue;
        };
        let deleting = pod.metadata.deletion_timestamp.is_some();
        let pending = pod
            .status
            .as_ref()
            .and_then(|s| s.phase.as_deref())
            .is_none_or(|p| p == "Pending");
        if !(deleting || pending) {
            continue;
        }
        let key = format!("{uid}/{deleting}");
        if !busy.lock().expect("busy lock").insert(key.clone()) {
            continue;
        }
        let api: Api<Pod> = Api::namespaced(client.clone(), &ns);
        let busy = busy.clone();
        let config = config.clone();
        let servers = servers.clone();
        tokio::spawn(async move {
            if deleting {
                tokio::time::sleep(config.terminating_delay).await;
                servers.lock().expect("servers lock").remove(&uid);
            } else {
                tokio::time::sleep(load_time(&config, &pod)).await;
            }
            // A kubelet keeps at it: an action the API server did not take
            // (it was restarting, say) is tried again, since the watch may
            // not bring the pod up again (it resumes, it does not relist).
            for attempt in 1.. {
                let result = if deleting {
                    finish_deletion(&api, &name, &uid).await
                } else {
                    start_pod(&api, &pod, &servers, config.stream_delay).await
                };
                match result {
                    Ok(()) => break,
                    Err(e) if attempt < ACTION_ATTEMPTS => {
                        tracing::debug!(pod = %name, error = %e, attempt, "kubelet stand-in action failed; retrying");
                        tokio::time::sleep(ACTION_RETRY).await;
                    }
                    Err(e) => {
                        tracing::warn!(pod = %name, error = %e, "kubelet stand-in action given up");
                        break;
                    }
                }
            }
            busy.lock().expect("busy lock").remove(&key);
        });
    }
}

fn load_time(config: &KubeletConfig, pod: &Pod) -> Duration {
    let bytes = pod
        .metadata
        .annotations
        .as_ref()
        .and_then(|a| a.get(SIZE_ANNOTATION))
        .and_then(|s| parse_bytes(s).ok())
        .unwrap_or(0);
    config.load_delay
        + config
            .delay_per_gib
            .mul_f64(bytes as f64 / (1u64 << 30) as f64)
}

async fn finish_deletion(api: &Api<Pod>, name: &str, uid: &str) -> Result<(), kube::Error> {
    let dp = DeleteParams {
        grace_period_seconds: Some(0),
        preconditions: Some(Preconditions {
            uid: Some(uid.to_owned()),
            resource_version: None,
        }),
        ..DeleteParams::default()
    };
    match api.delete(name, &dp).await {
        Ok(_) => Ok(()),
        // Gone already, or replaced by a newer pod of that name: done.
        Err(kube::Error::Api(s)) if s.code == 404 || s.code == 409 => Ok(()),
        Err(e) => Err(e),
    }
}

type Servers = Arc<Mutex<HashMap<String, FakeModelServer>>>;

async fn start_pod(
    api: &Api<Pod>,
    pod: &Pod,
    servers: &Servers,
    stream_delay: Duration,
) -> Result<(), kube::Error> {
    let name = pod.metadata.name.as_deref().unwrap_or_default();
    // Re-read: the pod may have been deleted or replaced while "loading".
    let Some(current) = api.get_opt(name).await? else {
        return Ok(());
    };
    if current.metadata.uid != pod.metadata.uid || current.metadata.deletion_timestamp.is_some() {
        return Ok(());
    }
    // Failed meanwhile (by `fail_pod`): a kubelet does not start it again.
    let phase = current.status.as_ref().and_then(|s| s.phase.as_deref());
    if phase.is_some_and(|p| p != "Pending") {
        return Ok(());
    }
    let fail = current
        .metadata
        .annotations
        .as_ref()
        .and_then(|a| a.get(FAIL_ANNOTATION))
        .cloned();
    let fail = fail.or_else(|| missing_host_dir(&current));
    match fail {
        Some(message) => set_failed(api, &current, &message).await,
        None => match serve(&current, servers, stream_delay).await {
            Ok(ip) => set_running(api, &current, ip).await,
            // A server that cannot listen serves nothing: the pod fails,
            // as a model server that cannot bind its port exits.
            Err(message) => set_failed(api, &current, &message).await,
        },
    }
}

/// Addresses tried for one pod's server before the pod fails.
const BIND_TRIES: usize = 8;

/// Starts the pod's fake model server; its address is the pod's IP. An
/// address another process holds (another local cluster's pod, say) is
/// skipped for the next; when none of [`BIND_TRIES`] can be had the pod
/// fails, never a pod marked Ready that someone else answers for.
async fn serve(pod: &Pod, servers: &Servers, stream_delay: Duration) -> Result<Ipv4Addr, String> {
    let port = crate::residency::labels::serving_port(pod);
    let meta = &pod.metadata;
    let pod_name = meta.name.clone().unwrap_or_default();
    let model = meta
        .labels
        .as_ref()
        .and_then(|l| l.get(MODEL_LABEL))
        .cloned()
        .unwrap_or_else(|| pod_name.clone());
    let identity = Identity {
        model,
        pod: pod_name,
    };
    let candidates = std::iter::repeat_with(next_pod_ip).take(BIND_TRIES);
    match listen_on_one_of(candidates, port, identity, stream_delay).await {
        Ok(server) => {
            let ip = match server.addr.ip() {
                std::net::IpAddr::V4(ip) => ip,
                std::net::IpAddr::V6(_) => unreachable!("bound an IPv4 candidate"),
            };
            let uid = meta.uid.clone().unwrap_or_default();
            servers.lock().expect("servers lock").insert(uid, server);
            Ok(ip)
        }
        Err(e) => {
            tracing::warn!(port, error = %e, "kubelet stand-in: fake model server not started");
            Err(e)
        }
    }
}

/// A fake model server on the first of `candidates` that can be bound at
/// `port`; the error says why the last one could not.
async fn listen_on_one_of(
    candidates: impl Iterator<Item = Ipv4Addr>,
    port: u16,
    identity: Identity,
    stream_delay: Duration,
) -> Result<FakeModelServer, String> {
    let mut last = String::from("no address to try");
    for ip in candidates {
        let addr = SocketAddr::from((ip, port));
        match FakeModelServer::start(addr, identity.clone(), stream_delay).await {
            Ok(server) => return Ok(server),
            Err(e) if e.kind() == std::io::ErrorKind::AddrInUse => {
                last = format!("the model server cannot listen on {addr}: {e}");
            }
            Err(e) => return Err(format!("the model server cannot listen on {addr}: {e}")),
        }
    }
    Err(last)
}

/// A `hostPath` volume of `type: Directory` whose directory does not
/// exist: a kubelet does not start such a pod (nor does the stand-in).
fn missing_host_dir(pod: &Pod) -> Option<String> {
    pod.spec
        .iter()
        .flat_map(|s| s.volumes.iter().flatten())
        .filter_map(|v| v.host_path.as_ref())
        .find(|h| {
            h.type_.as_deref() == Some("Directory") && !std::path::Path::new(&h.path).is_dir()
        })
        .map(|h| format!("hostPath type check failed: {} is not a directory", h.path))
}

fn containers(pod: &Pod) -> Vec<(String, String)> {
    pod.spec
        .iter()
        .flat_map(|s| s.containers.iter())
        .map(|c| (c.name.clone(), c.image.clone().unwrap_or_default()))
        .collect()
}

async fn set_running(api: &Api<Pod>, pod: &Pod, ip: Ipv4Addr) -> Result<(), kube::Error> {
    let now = kube_time_now();
    let statuses: Vec<_> = containers(pod)
        .into_iter()
        .map(|(name, image)| {
            json!({
                "name": name, "image": image, "imageID": "", "ready": true, "started": true,
                "restartCount": 0, "state": {"running": {"startedAt": now}},
            })
        })
        .collect();
    let cond = |t: &str| json!({"type": t, "status": "True", "lastTransitionTime": now});
    let status = json!({"status": {
        "phase": "Running", "hostIP": "127.0.0.1", "podIP": ip.to_string(), "startTime": now,
        "conditions": [cond("PodScheduled"), cond("Initialized"), cond("ContainersReady"), cond("Ready")],
        "containerStatuses": statuses,
    }});
    patch_status(api, pod, status).await
}

/// Marks a pod `Failed` with `message`, as a crashed model server would be.
pub async fn fail_pod(api: &Api<Pod>, name: &str, message: &str) -> Result<(), kube::Error> {
    let pod = api.get(name).await?;
    set_failed(api, &pod, message).await
}

async fn set_failed(api: &Api<Pod>, pod: &Pod, message: &str) -> Result<(), kube::Error> {
    let now = kube_time_now();
    let statuses: Vec<_> = containers(pod)
        .into_iter()
        .map(|(name, image)| {
            json!({
                "name": name, "image": image, "imageID": "", "ready": false, "started": false,
                "restartCount": 0,
                "state": {"terminated": {"exitCode": 1, "reason": "Error", "message": message,
                                         "startedAt": now, "finishedAt": now}},
            })
        })
        .collect();
    let status = json!({"status": {
        "phase": "Failed", "reason": "StandInFailure", "message": message,
        "hostIP": "127.0.0.1", "startTime": now,
        "conditions": [{"type": "Ready", "status": "False", "reason": "PodFailed", "lastTransitionTime": now}],
        "containerStatuses": statuses,
    }});
    patch_status(api, pod, status).await
}

async fn patch_status(
    api: &Api<Pod>,
    pod: &Pod,
    status: serde_json::Value,
) -> Result<(), kube::Error> {
    let name = pod.metadata.name.as_deref().unwrap_or_default();
    api.patch_status(name, &PatchParams::default(), &Patch::Merge(&status))
        .await
        .map(|_| ())
}

/// Now as an RFC 3339 timestamp, second precision (as the kubelet writes).
fn kube_time_now() -> String {
    k8s_openapi::jiff::Timestamp::now()
        .round(k8s_openapi::jiff::Unit::Second)
        .map(|t| t.to_string())
        .unwrap_or_default()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn a_server_that_cannot_listen_is_an_error_and_a_taken_address_is_skipped() {
        let taken = tokio::net::TcpListener::bind("127.3.0.1:0").await.unwrap();
        let port = taken.local_addr().unwrap().port();
        let id = Identity {
            model: "m".into(),
            pod: "p".into(),
        };
        let ip = |n: u8| Ipv4Addr::new(127, 3, 0, n);
        let e = listen_on_one_of([ip(1)].into_iter(), port, id.clone(), Duration::ZERO)
            .await
            .unwrap_err();
        assert!(e.contains("cannot listen on 127.3.0.1"), "{e}");
        let server = listen_on_one_of([ip(1), ip(2)].into_iter(), port, id, Duration::ZERO)
            .await
            .unwrap();
        assert_eq!(server.addr, SocketAddr::from((ip(2), port)));
    }
}
