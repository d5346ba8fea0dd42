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

mod node;
mod pods;

use node::*;
pub use node::{GPU_DRIVER, install_device_class, set_gpu_taints, slice_name};
pub use pods::fail_pod;
use pods::*;

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
    /// GPUs per PCIe root: with `Some(k)`, each GPU publishes the standard
    /// `resource.kubernetes.io/pcieRoot` attribute, `k` GPUs to a root
    /// (what says which GPUs communicate fastest); `None`: no such
    /// attribute, as before.
    pub gpus_per_pcie_root: Option<u32>,
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
            gpus_per_pcie_root: None,
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
            gpus_per_pcie_root: None,
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

#[cfg(test)]
mod tests;
