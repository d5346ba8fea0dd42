//! The operator's view of the nodes' artifact caches (`NodeModelCache`,
//! written by each node's agent) and the gate it puts before a model pod
//! with an artifact: the pod starts only once its artifact is Ready on the
//! node, with the artifact's directory mounted read-only.

use crate::api::{ArtifactSpec, ArtifactState, CachedArtifact, NodeModelCache};
use crate::residency::reasons::Reason;
use k8s_openapi::api::core::v1::{HostPathVolumeSource, Pod, Volume, VolumeMount};
use std::collections::HashMap;
use std::sync::{Arc, Mutex};

/// One node's cache, as its agent last reported it.
#[derive(Debug, Default, Clone, PartialEq)]
pub struct NodeArtifacts {
    pub cache_dir: String,
    pub by_key: HashMap<String, CachedArtifact>,
}

impl NodeArtifacts {
    pub fn from_cache(c: &NodeModelCache) -> Self {
        let by_key = c
            .status
            .iter()
            .flat_map(|s| s.artifacts.iter())
            .map(|a| (a.key.clone(), a.clone()))
            .collect();
        NodeArtifacts {
            cache_dir: c.spec.cache_dir.clone(),
            by_key,
        }
    }
}

/// Every node's cache the operator has seen, by node name.
#[derive(Debug, Default)]
pub struct NodeCaches(Mutex<HashMap<String, Arc<NodeArtifacts>>>);

impl NodeCaches {
    pub fn get(&self, node: &str) -> Option<Arc<NodeArtifacts>> {
        self.0.lock().expect("node caches lock").get(node).cloned()
    }

    /// Records a node's cache; returns whether it changed.
    pub fn record(&self, c: &NodeModelCache) -> bool {
        let node = c.metadata.name.clone().unwrap_or_default();
        let now = Arc::new(NodeArtifacts::from_cache(c));
        let mut all = self.0.lock().expect("node caches lock");
        let changed = all.get(&node).is_none_or(|before| **before != *now);
        all.insert(node, now);
        changed
    }

    pub fn forget(&self, node: &str) {
        self.0.lock().expect("node caches lock").remove(node);
    }
}

/// What the gate says about a model's artifact.
#[derive(Debug, PartialEq, Eq)]
pub enum ArtifactGate {
    /// Ready: mount `host_dir`.
    Mount { host_dir: String },
    /// Not there yet: the model is Fetching.
    Wait { message: String },
    /// It will not come without a change: the model's load fails.
    Fail { reason: Reason, message: String },
}

pub fn artifact_gate(
    node: Option<&NodeArtifacts>,
    artifact: &ArtifactSpec,
    model: &str,
    node_name: &str,
) -> ArtifactGate {
    if let Some(problem) = artifact.mount_path_problem() {
        return ArtifactGate::Fail {
            reason: Reason::InvalidArtifact,
            message: format!("{model}'s artifact cannot be mounted: {problem}"),
        };
    }
    let key = artifact.cache_key(model);
    let Some(node) = node else {
        return ArtifactGate::Wait {
            message: format!(
                "{model} waits for its artifact {key}: no node agent reports node {node_name}'s cache (is the node-agent DaemonSet running there?)"
            ),
        };
    };
    match node.by_key.get(&key) {
        Some(a) if a.state == ArtifactState::Ready => ArtifactGate::Mount {
            host_dir: format!("{}/{key}", node.cache_dir.trim_end_matches('/')),
        },
        Some(a) if a.state == ArtifactState::Refused => ArtifactGate::Fail {
            reason: Reason::DiskFull,
            message: a
                .message
                .clone()
                .unwrap_or_else(|| format!("{key} does not fit the node's disk budget")),
        },
        Some(a) if a.state == ArtifactState::Failed => ArtifactGate::Fail {
            reason: Reason::ArtifactFailed,
            message: format!(
                "{model}'s artifact {key} failed on node {node_name}: {}: {}{}",
                a.reason.as_deref().unwrap_or("Failed"),
                a.message.as_deref().unwrap_or("no reason given"),
                a.retry_at
                    .as_deref()
                    .map(|t| format!(" (the agent retries at {t})"))
                    .unwrap_or_else(|| " (not retried: change the artifact)".into())
            ),
        },
        Some(a) if a.state == ArtifactState::Waiting => ArtifactGate::Wait {
            message: format!(
                "{model} waits for room on node {node_name}'s disk: {}",
                a.message
                    .as_deref()
                    .unwrap_or("pods still mount other artifacts")
            ),
        },
        Some(a) => ArtifactGate::Wait {
            message: format!(
                "{model} waits for its artifact {key} on node {node_name} ({} bytes so far)",
                a.bytes
            ),
        },
        None => ArtifactGate::Wait {
            message: format!(
                "{model} waits for node {node_name}'s agent to fetch its artifact {key}"
            ),
        },
    }
}

/// What the gate says about a model's LoRA adapters' files on its node.
#[derive(Debug, Default, PartialEq, Eq)]
pub struct AdapterFiles {
    /// Ready: (volume, host directory, mount path) for each.
    pub mounts: Vec<(String, String, String)>,
    /// Failed or refused by the node: (adapter, the node's words). The pod
    /// starts without them; they are refused in it.
    pub refused: Vec<(String, String)>,
    /// Not there yet: the model waits (Fetching), in these words.
    pub waiting: Option<String>,
}

/// The gate over `model`'s adapters' files: each Ready one mounted, each
/// that failed refused, and the pod held while any is still coming.
pub fn adapter_gate(
    node: Option<&NodeArtifacts>,
    model: &crate::api::ModelSpec,
    node_name: &str,
) -> AdapterFiles {
    let mut out = AdapterFiles::default();
    let adapters = model.lora.iter().flat_map(|l| l.adapters.iter());
    for (i, adapter) in adapters.enumerate() {
        let Some(artifact) = adapter.artifact() else {
            continue;
        };
        match artifact_gate(node, &artifact, &adapter.name, node_name) {
            ArtifactGate::Mount { host_dir } => {
                let mount = artifact.mount_path_for(&adapter.name);
                out.mounts.push((format!("lora-{i}"), host_dir, mount));
            }
            ArtifactGate::Wait { message } => {
                out.waiting
                    .get_or_insert(format!("{}'s adapter {message}", model.name));
            }
            ArtifactGate::Fail { message, .. } => {
                out.refused.push((adapter.name.clone(), message));
            }
        }
    }
    out
}

/// The volume's name in the pod.
const VOLUME: &str = "model-artifact";

/// Mounts `host_dir` read-only at `mount_path` in every container. The
/// hostPath must be a directory that exists (`type: Directory`): a kubelet
/// refuses to start the pod otherwise, so a pod can never run on a half
/// or missing artifact.
pub fn mount_artifact(pod: &mut Pod, host_dir: &str, mount_path: &str) {
    mount_volume(pod, VOLUME, host_dir, mount_path);
}

/// Mounts `host_dir` read-only at `mount_path` in every container, as the
/// volume `name`.
pub fn mount_volume(pod: &mut Pod, name: &str, host_dir: &str, mount_path: &str) {
    let Some(spec) = pod.spec.as_mut() else {
        return;
    };
    let volumes = spec.volumes.get_or_insert_with(Vec::new);
    volumes.retain(|v| v.name != name);
    volumes.push(Volume {
        name: name.into(),
        host_path: Some(HostPathVolumeSource {
            path: host_dir.into(),
            type_: Some("Directory".into()),
        }),
        ..Volume::default()
    });
    for c in &mut spec.containers {
        let mounts = c.volume_mounts.get_or_insert_with(Vec::new);
        mounts.retain(|m| m.name != name);
        mounts.push(VolumeMount {
            name: name.into(),
            mount_path: mount_path.into(),
            read_only: Some(true),
            ..VolumeMount::default()
        });
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn spec() -> ArtifactSpec {
        serde_json::from_value(
            serde_json::json!({"files": [{"uri": "http://m/w.bin"}], "size": "1Gi"}),
        )
        .unwrap()
    }

    fn node(state: ArtifactState) -> NodeArtifacts {
        let key = spec().cache_key("qwen");
        let a = CachedArtifact {
            key: key.clone(),
            model: "qwen".into(),
            state,
            message: Some("sha256 mismatch".into()),
            ..Default::default()
        };
        NodeArtifacts {
            cache_dir: "/var/cache/models/".into(),
            by_key: HashMap::from([(key, a)]),
        }
    }

    #[test]
    fn a_pod_starts_only_on_a_ready_artifact() {
        let key = spec().cache_key("qwen");
        assert_eq!(
            artifact_gate(Some(&node(ArtifactState::Ready)), &spec(), "qwen", "n"),
            ArtifactGate::Mount {
                host_dir: format!("/var/cache/models/{key}")
            }
        );
        assert!(matches!(
            artifact_gate(Some(&node(ArtifactState::Fetching)), &spec(), "qwen", "n"),
            ArtifactGate::Wait { .. }
        ));
        assert!(matches!(
            artifact_gate(None, &spec(), "qwen", "n"),
            ArtifactGate::Wait { .. }
        ));
        assert!(matches!(
            artifact_gate(Some(&node(ArtifactState::Failed)), &spec(), "qwen", "n"),
            ArtifactGate::Fail { reason: Reason::ArtifactFailed, message } if message.contains("sha256 mismatch")
        ));
        assert!(matches!(
            artifact_gate(Some(&node(ArtifactState::Refused)), &spec(), "qwen", "n"),
            ArtifactGate::Fail {
                reason: Reason::DiskFull,
                ..
            }
        ));
    }

    #[test]
    fn the_artifact_is_mounted_read_only_in_every_container() {
        let mut pod: Pod = serde_json::from_value(serde_json::json!({
            "spec": {"containers": [{"name": "a"}, {"name": "b"}]}}))
        .unwrap();
        mount_artifact(&mut pod, "/cache/qwen-1", "/models/qwen");
        mount_artifact(&mut pod, "/cache/qwen-1", "/models/qwen");
        let spec = pod.spec.unwrap();
        let volumes = spec.volumes.unwrap();
        assert_eq!(volumes.len(), 1, "mounting twice is mounting once");
        assert_eq!(
            volumes[0].host_path.as_ref().unwrap().type_.as_deref(),
            Some("Directory")
        );
        for c in spec.containers {
            let m = &c.volume_mounts.unwrap()[0];
            assert_eq!(
                (m.mount_path.as_str(), m.read_only),
                ("/models/qwen", Some(true))
            );
        }
    }
}
