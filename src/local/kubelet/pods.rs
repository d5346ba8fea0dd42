//! What the stand-in does for a pod: starts its fake model server on an
//! address of its own, and reports it Running, Ready or Failed as a
//! kubelet would.

use super::*;

pub(super) type Servers = Arc<Mutex<HashMap<String, FakeModelServer>>>;

pub(super) async fn start_pod(
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
pub(super) const BIND_TRIES: usize = 8;

/// Starts the pod's fake model server; its address is the pod's IP. An
/// address another process holds (another local cluster's pod, say) is
/// skipped for the next; when none of [`BIND_TRIES`] can be had the pod
/// fails, never a pod marked Ready that someone else answers for.
pub(super) async fn serve(
    pod: &Pod,
    servers: &Servers,
    stream_delay: Duration,
) -> Result<Ipv4Addr, String> {
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
    // The adapter rank the operator gave the server's containers
    // (`LoraSpec::env`): a pod with adapter slots speaks the LoRA API.
    let max_lora_rank = pod
        .spec
        .iter()
        .flat_map(|s| s.containers.iter())
        .flat_map(|c| c.env.iter().flatten())
        .find(|e| e.name == crate::api::MAX_LORA_RANK_ENV)
        .and_then(|e| e.value.as_deref()?.parse().ok());
    let candidates = std::iter::repeat_with(next_pod_ip).take(BIND_TRIES);
    let behaviour = (sleep, prefix, batch, max_lora_rank);
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

/// What the pod asks of its fake server: how it sleeps, its prefix cache
/// and batch (annotations), its adapters' largest rank (environment).
pub(super) type Behaviour = (SleepBehaviour, Option<String>, Option<u32>, Option<u64>);

/// A fake model server on the first of `candidates` that can be bound at
/// `port`; the error says why the last one could not.
pub(super) async fn listen_on_one_of(
    candidates: impl Iterator<Item = Ipv4Addr>,
    port: u16,
    identity: Identity,
    stream_delay: Duration,
    (sleep, prefix, batch, max_lora_rank): Behaviour,
) -> Result<FakeModelServer, String> {
    let mut last = String::from("no address to try");
    for ip in candidates {
        let addr = SocketAddr::from((ip, port));
        let tuning = Tuning {
            prefix: prefix.as_deref().map(PrefixCache::parse),
            batch,
            max_lora_rank,
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
pub(super) fn missing_host_dir(pod: &Pod) -> Option<String> {
    pod.spec
        .iter()
        .flat_map(|s| s.volumes.iter().flatten())
        .filter_map(|v| v.host_path.as_ref())
        .find(|h| {
            h.type_.as_deref() == Some("Directory") && !std::path::Path::new(&h.path).is_dir()
        })
        .map(|h| format!("hostPath type check failed: {} is not a directory", h.path))
}

pub(super) fn containers(pod: &Pod) -> Vec<(String, String)> {
    pod.spec
        .iter()
        .flat_map(|s| s.containers.iter())
        .map(|c| (c.name.clone(), c.image.clone().unwrap_or_default()))
        .collect()
}

pub(super) async fn set_running(
    api: &Api<Pod>,
    pod: &Pod,
    ip: Ipv4Addr,
) -> Result<(), kube::Error> {
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

pub(super) async fn set_failed(
    api: &Api<Pod>,
    pod: &Pod,
    message: &str,
) -> Result<(), kube::Error> {
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

pub(super) async fn patch_status(
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
pub(super) fn kube_time_now() -> String {
    let now = k8s_openapi::jiff::Timestamp::now();
    k8s_openapi::jiff::Timestamp::from_second(now.as_second())
        .map(|t| t.to_string())
        .unwrap_or_default()
}
