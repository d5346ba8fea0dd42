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
//! - **The DRA driver.** For each node it publishes a ResourceSlice as the
//!   NVIDIA DRA driver's kubelet plugin does (driver `gpu.nvidia.com`, pool
//!   and slice named after the node, one device `gpu-<i>` per GPU with the
//!   attributes `type` ("gpu"), `index`, `minor`, `uuid` (a stable
//!   `GPU-...` made from the node's name and the index), `productName`, and
//!   the capacity `memory`), and installs the driver's DeviceClass
//!   `gpu.nvidia.com` when it is missing. No device is prepared (no CDI, no
//!   driver on a node); allocation is the real scheduler's.
//! - **Starting pods.** A pod the scheduler bound to one of its nodes
//!   (`spec.nodeName`) that is still `Pending` is started once every
//!   ResourceClaim it references is allocated and reserved for it (as the
//!   kubelet waits for them): marked `Running` and `Ready` (pod conditions and
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
//!   (8080 if none), and stops it when the pod is deleted as a server stops
//!   on SIGTERM (nothing new accepted, what it answers finished within the
//!   pod's termination grace), before it finishes the deletion. So
//!   traffic to a model pod is real HTTP; what answers is not a model (a
//!   GPU holder pod, `residency.dev/gpu-holder`, gets none: it serves
//!   nothing). An
//!   address another process holds is skipped for the next one; a pod whose
//!   server cannot listen at all is marked `Failed`, never Ready. A pod
//!   annotated `kubelet-standin.residency.dev/served-at: <loopback IPv4>`
//!   gets that address as its IP and no fake server: a real model server
//!   the test started there (a real vLLM) is its container.
//! - **Finishing deletions.** A bound pod whose `deletionTimestamp` is set is
//!   deleted with grace period 0, as the kubelet does once containers stop
//!   (`terminating_delay` later). Finalizers are left alone.
//!
//! Pods on other nodes, and unbound pods, are never touched.

use super::model_server::{
    BATCH_ANNOTATION, FakeModelServer, Identity, PREFIX_CACHE_ANNOTATION, PrefixCache,
    SLEEP_ANNOTATION, SleepBehaviour, Tuning, next_pod_ip,
};
use crate::quantity::parse_bytes;
use crate::residency::labels::{GPU_HOLDER_LABEL, MODEL_LABEL, SIZE_ANNOTATION};
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

/// Pod annotation naming the loopback address a real server the test
/// started listens on (at the pod's port): the pod's IP, and no fake.
pub const SERVED_AT_ANNOTATION: &str = "kubelet-standin.residency.dev/served-at";

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
    /// Each GPU's memory, in bytes (its ResourceSlice capacity).
    pub gpu_memory: u64,
}

/// The memory of a stand-in GPU unless said otherwise: an H100's 80 GiB.
pub const DEFAULT_GPU_MEMORY: u64 = 80 << 30;

/// The product name the stand-in's GPUs publish.
pub const FAKE_PRODUCT: &str = "NVIDIA H100 80GB HBM3 (kubelet stand-in)";

/// The uuid attribute of GPU `index` of fake node `node`: a `GPU-` UUID
/// made from both, the same in every run.
pub fn fake_gpu_uuid(node: &str, index: u32) -> String {
    let mut h: u64 = 0xcbf2_9ce4_8422_2325;
    for b in node.bytes().chain(index.to_le_bytes()) {
        h = (h ^ u64::from(b)).wrapping_mul(0x0100_0000_01b3);
    }
    let l = h.rotate_left(29) ^ 0x9e37_79b9_7f4a_7c15;
    format!(
        "GPU-{:08x}-{:04x}-{:04x}-{:04x}-{:012x}",
        h >> 32,
        (h >> 16) & 0xffff,
        h & 0xffff,
        l >> 48,
        l & 0xffff_ffff_ffff
    )
}

impl std::str::FromStr for FakeNode {
    type Err = String;

    /// `NODE=COUNTxMEMORY` (`node-a=2x80Gi`), or `NODE=COUNT` for GPUs of
    /// the default memory.
    fn from_str(s: &str) -> Result<Self, String> {
        let bad = || format!("{s:?} is not NODE=COUNTxMEMORY (node-a=2x80Gi)");
        let (name, gpus) = s.split_once('=').ok_or_else(bad)?;
        if !crate::residency::labels::is_dns_subdomain(name) {
            return Err(format!("{name:?} is not a node name"));
        }
        let (count, memory) = match gpus.split_once('x') {
            Some((c, m)) => (c, parse_bytes(m).map_err(|e| format!("{s:?}: {e}"))?),
            None => (gpus, DEFAULT_GPU_MEMORY),
        };
        let gpus: u32 = count.parse().map_err(|_| bad())?;
        if gpus == 0 || gpus > 128 || memory == 0 {
            return Err(format!("{s:?}: 1 to 128 GPUs of more than 0 bytes"));
        }
        Ok(FakeNode {
            name: name.to_owned(),
            gpus,
            gpu_memory: memory,
        })
    }
}

impl FakeNode {
    /// A node with `gpus` GPUs of the default memory.
    pub fn new(name: &str, gpus: u32) -> Self {
        FakeNode {
            name: name.to_owned(),
            gpus,
            gpu_memory: DEFAULT_GPU_MEMORY,
        }
    }
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
            nodes: nodes.iter().map(|n| FakeNode::new(n, 1)).collect(),
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
        install_device_class(&client).await?;
        for node in &config.nodes {
            register_node(&nodes, node).await?;
            publish_gpus(&client, node).await?;
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

/// The DeviceClass of the NVIDIA DRA driver's chart, when it is missing
/// (left alone when present: a test may share the control plane).
pub async fn install_device_class(client: &kube::Client) -> Result<(), kube::Error> {
    use k8s_openapi::api::resource::v1::DeviceClass;
    let classes: Api<DeviceClass> = Api::all(client.clone());
    let class: DeviceClass = serde_json::from_value(json!({
        "apiVersion": "resource.k8s.io/v1", "kind": "DeviceClass",
        "metadata": {"name": GPU_DRIVER},
        "spec": {"selectors": [{"cel": {"expression":
            "device.driver == 'gpu.nvidia.com' && device.attributes['gpu.nvidia.com'].type == 'gpu'"}}]},
    }))
    .expect("a DeviceClass");
    match classes
        .create(&kube::api::PostParams::default(), &class)
        .await
    {
        Ok(_) => Ok(()),
        Err(kube::Error::Api(s)) if s.code == 409 => Ok(()),
        Err(e) => Err(e),
    }
}

/// The driver the stand-in plays.
pub const GPU_DRIVER: &str = "gpu.nvidia.com";

/// The name of fake node `node`'s ResourceSlice.
pub fn slice_name(node: &str) -> String {
    format!("{node}-{GPU_DRIVER}")
}

/// Publishes the node's GPUs as the NVIDIA DRA driver does.
async fn publish_gpus(client: &kube::Client, node: &FakeNode) -> Result<(), kube::Error> {
    use k8s_openapi::api::resource::v1::ResourceSlice;
    let slices: Api<ResourceSlice> = Api::all(client.clone());
    let devices: Vec<_> = (0..node.gpus)
        .map(|i| {
            json!({
                "name": format!("gpu-{i}"),
                "attributes": {
                    "type": {"string": "gpu"},
                    "index": {"int": i},
                    "minor": {"int": i},
                    "uuid": {"string": fake_gpu_uuid(&node.name, i)},
                    "productName": {"string": FAKE_PRODUCT},
                },
                "capacity": {"memory": {"value": node.gpu_memory.to_string()}},
            })
        })
        .collect();
    let body = json!({
        "apiVersion": "resource.k8s.io/v1", "kind": "ResourceSlice",
        "metadata": {"name": slice_name(&node.name)},
        "spec": {
            "driver": GPU_DRIVER, "nodeName": node.name,
            "pool": {"name": node.name, "generation": 1, "resourceSliceCount": 1},
            "devices": devices,
        },
    });
    let pp = PatchParams::apply(MANAGER).force();
    slices
        .patch(&slice_name(&node.name), &pp, &Patch::Apply(&body))
        .await?;
    Ok(())
}

/// Whether every claim `pod` references is allocated and reserved for it;
/// `Err` names the first that is not.
async fn claims_ready(client: &kube::Client, pod: &Pod) -> Result<(), String> {
    use k8s_openapi::api::resource::v1::ResourceClaim;
    let ns = pod.metadata.namespace.as_deref().unwrap_or_default();
    let claims: Api<ResourceClaim> = Api::namespaced(client.clone(), ns);
    let uid = pod.metadata.uid.as_deref().unwrap_or_default();
    let referenced = pod
        .spec
        .iter()
        .flat_map(|s| s.resource_claims.iter().flatten())
        .filter_map(|c| c.resource_claim_name.as_deref());
    for name in referenced {
        let claim = claims.get_opt(name).await.map_err(|e| e.to_string())?;
        let status = claim.as_ref().and_then(|c| c.status.as_ref());
        let allocated = status.is_some_and(|s| s.allocation.is_some());
        let reserved = status
            .and_then(|s| s.reserved_for.as_ref())
            .is_some_and(|r| r.iter().any(|c| c.uid == uid));
        if !(allocated && reserved) {
            return Err(format!(
                "claim {name} is not allocated and reserved for the pod"
            ));
        }
    }
    Ok(())
}

/// How long the stand-in waits for a bound pod's claims before it says so
/// (the scheduler reserves them before it binds, so this is only the
/// watch's lag); it keeps waiting while the pod is there, as a kubelet
/// keeps retrying a pod whose resources are not prepared.
const CLAIM_WAIT: Duration = Duration::from_secs(30);

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
        let Some(work) = Work::of(pod, &names) else {
            continue;
        };
        if !busy.lock().expect("busy lock").insert(work.key()) {
            continue;
        }
        let (client, busy) = (client.clone(), busy.clone());
        let (config, servers) = (config.clone(), servers.clone());
        tokio::spawn(async move {
            let key = work.key();
            work.act(client, &config, &servers).await;
            busy.lock().expect("busy lock").remove(&key);
        });
    }
}

/// What the stand-in has to do for a pod of its nodes: start it (it is
/// Pending) or finish its deletion.
struct Work {
    pod: Pod,
    uid: String,
    name: String,
    namespace: String,
    deleting: bool,
}

impl Work {
    /// The work `pod` asks for, if it is bound to one of `nodes` and is
    /// Pending or being deleted.
    fn of(pod: Pod, nodes: &HashSet<String>) -> Option<Work> {
        let node = pod.spec.as_ref()?.node_name.as_deref()?;
        if !nodes.contains(node) {
            return None;
        }
        let deleting = pod.metadata.deletion_timestamp.is_some();
        let pending = pod
            .status
            .as_ref()
            .and_then(|s| s.phase.as_deref())
            .is_none_or(|p| p == "Pending");
        if !(deleting || pending) {
            return None;
        }
        Some(Work {
            uid: pod.metadata.uid.clone()?,
            name: pod.metadata.name.clone()?,
            namespace: pod.metadata.namespace.clone()?,
            deleting,
            pod,
        })
    }

    /// One piece of work per pod and kind at a time.
    fn key(&self) -> String {
        format!("{}/{}", self.uid, self.deleting)
    }

    /// Whether this pod (this uid) is still there, not being deleted.
    /// An error (an API server restarting) counts as still there.
    async fn still_pending(&self, api: &Api<Pod>) -> bool {
        match api.get_opt(&self.name).await {
            Ok(Some(pod)) => {
                pod.metadata.uid.as_deref() == Some(self.uid.as_str())
                    && pod.metadata.deletion_timestamp.is_none()
            }
            Ok(None) => false,
            Err(_) => true,
        }
    }

    async fn act(self, client: kube::Client, config: &KubeletConfig, servers: &Servers) {
        let api: Api<Pod> = Api::namespaced(client.clone(), &self.namespace);
        if self.deleting {
            tokio::time::sleep(config.terminating_delay).await;
            // As the kubelet: SIGTERM, then the pod's grace for what its
            // server is answering, then the end.
            let server = servers.lock().expect("servers lock").remove(&self.uid);
            if let Some(server) = server {
                server.shut_down(termination_grace(&self.pod)).await;
            }
        } else {
            // As the kubelet: no container starts before its claims are
            // allocated and reserved for the pod.
            let waited = tokio::time::Instant::now();
            let mut said = false;
            while let Err(why) = claims_ready(&client, &self.pod).await {
                if waited.elapsed() > CLAIM_WAIT {
                    if !self.still_pending(&api).await {
                        return;
                    }
                    if !said {
                        tracing::warn!(pod = %self.name, "kubelet stand-in: {why}; still waiting");
                        said = true;
                    }
                    tokio::time::sleep(Duration::from_secs(1)).await;
                    continue;
                }
                tokio::time::sleep(Duration::from_millis(100)).await;
            }
            tokio::time::sleep(load_time(config, &self.pod)).await;
        }
        // A kubelet keeps at it: an action the API server did not take (it
        // was restarting, say) is tried again, since the watch may not
        // bring the pod up again (it resumes, it does not relist).
        for attempt in 1.. {
            let result = if self.deleting {
                finish_deletion(&api, &self.name, &self.uid).await
            } else {
                start_pod(&api, &self.pod, servers, config.stream_delay).await
            };
            match result {
                Ok(()) => break,
                Err(e) if attempt < ACTION_ATTEMPTS => {
                    tracing::debug!(pod = %self.name, error = %e, attempt, "kubelet stand-in action failed; retrying");
                    tokio::time::sleep(ACTION_RETRY).await;
                }
                Err(e) => {
                    tracing::warn!(pod = %self.name, error = %e, "kubelet stand-in action given up");
                    break;
                }
            }
        }
    }
}

/// The pod's termination grace (30 s when unset, as the API server's
/// default), at most a minute here.
fn termination_grace(pod: &Pod) -> Duration {
    let seconds = pod
        .spec
        .as_ref()
        .and_then(|s| s.termination_grace_period_seconds)
        .unwrap_or(30)
        .clamp(0, 60);
    Duration::from_secs(seconds as u64)
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
    let holder = current
        .metadata
        .labels
        .as_ref()
        .is_some_and(|l| l.contains_key(GPU_HOLDER_LABEL));
    match fail {
        Some(message) => set_failed(api, &current, &message).await,
        // A GPU holder serves nothing; its "container" just runs.
        None if holder => set_running(api, &current, next_pod_ip()).await,
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
    let served_at = meta
        .annotations
        .as_ref()
        .and_then(|a| a.get(SERVED_AT_ANNOTATION));
    if let Some(at) = served_at {
        // Only loopback: a test's traffic stays on this machine.
        return match at.parse::<Ipv4Addr>() {
            Ok(ip) if ip.is_loopback() => Ok(ip),
            _ => Err(format!(
                "{SERVED_AT_ANNOTATION} {at:?} is not a loopback IPv4 address"
            )),
        };
    }
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
    let sleep = meta
        .annotations
        .as_ref()
        .and_then(|a| a.get(SLEEP_ANNOTATION))
        .map(|t| SleepBehaviour::parse(t))
        .unwrap_or_default();
    let prefix = meta
        .annotations
        .as_ref()
        .and_then(|a| a.get(PREFIX_CACHE_ANNOTATION))
        .cloned();
    let batch = meta
        .annotations
        .as_ref()
        .and_then(|a| a.get(BATCH_ANNOTATION))
        .and_then(|b| b.trim().parse().ok());
    let candidates = std::iter::repeat_with(next_pod_ip).take(BIND_TRIES);
    let behaviour = (sleep, prefix, batch);
    match listen_on_one_of(candidates, port, identity, stream_delay, behaviour).await {
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
    (sleep, prefix, batch): (SleepBehaviour, Option<String>, Option<u32>),
) -> Result<FakeModelServer, String> {
    let mut last = String::from("no address to try");
    for ip in candidates {
        let addr = SocketAddr::from((ip, port));
        let tuning = Tuning {
            prefix: prefix.as_deref().map(PrefixCache::parse),
            batch,
        };
        match FakeModelServer::start_with(addr, identity.clone(), stream_delay, sleep, tuning).await
        {
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
/// Now, in whole seconds, cut as the API server's times are (never
/// rounded up into the future).
fn kube_time_now() -> String {
    let now = k8s_openapi::jiff::Timestamp::now();
    k8s_openapi::jiff::Timestamp::from_second(now.as_second())
        .map(|t| t.to_string())
        .unwrap_or_default()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn gpu_nodes_are_read_from_node_count_and_memory() {
        let n: FakeNode = "node-a=2x40Gi".parse().unwrap();
        assert_eq!(
            (n.name.as_str(), n.gpus, n.gpu_memory),
            ("node-a", 2, 40 << 30)
        );
        let n: FakeNode = "b=3".parse().unwrap();
        assert_eq!((n.gpus, n.gpu_memory), (3, DEFAULT_GPU_MEMORY));
        for bad in ["node-a", "Node=1", "a=0", "a=2xlots", "a=x80Gi"] {
            assert!(bad.parse::<FakeNode>().is_err(), "{bad}");
        }
        assert_ne!(fake_gpu_uuid("a", 0), fake_gpu_uuid("a", 1));
        assert_eq!(fake_gpu_uuid("a", 0), fake_gpu_uuid("a", 0), "stable");
        assert!(fake_gpu_uuid("a", 0).starts_with("GPU-"));
    }

    #[tokio::test]
    async fn a_server_that_cannot_listen_is_an_error_and_a_taken_address_is_skipped() {
        let taken = tokio::net::TcpListener::bind("127.3.0.1:0").await.unwrap();
        let port = taken.local_addr().unwrap().port();
        let id = Identity {
            model: "m".into(),
            pod: "p".into(),
        };
        let ip = |n: u8| Ipv4Addr::new(127, 3, 0, n);
        let e = listen_on_one_of(
            [ip(1)].into_iter(),
            port,
            id.clone(),
            Duration::ZERO,
            Default::default(),
        )
        .await
        .unwrap_err();
        assert!(e.contains("cannot listen on 127.3.0.1"), "{e}");
        let server = listen_on_one_of(
            [ip(1), ip(2)].into_iter(),
            port,
            id,
            Duration::ZERO,
            Default::default(),
        )
        .await
        .unwrap();
        assert_eq!(server.addr, SocketAddr::from((ip(2), port)));
    }
}
