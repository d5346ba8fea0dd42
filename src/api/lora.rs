//! LoRA adapters as residents of their base model (`spec.models[].lora`):
//! the adapter slots the base model's server is started with, and the
//! adapters it may load into them at run time. Adapters live one level
//! down from models: inside a Ready pod of their base model, loaded and
//! unloaded through the server's own API by the router
//! ([`crate::router::adapters`]), the least recently used unpinned one
//! out when the slots are full.

use schemars::JsonSchema;
use serde::{Deserialize, Serialize};

/// The base model's adapter slots and its adapters.
#[derive(Serialize, Deserialize, Clone, Debug, PartialEq, JsonSchema)]
#[serde(rename_all = "camelCase")]
#[schemars(extend("x-kubernetes-validations" = super::rules::lora()))]
pub struct LoraSpec {
    /// Adapters active on the GPU at once (vLLM's --max-loras, default 1).
    /// The pod gets it as MODEL_RESIDENCY_MAX_LORAS.
    #[serde(default = "one")]
    #[schemars(range(min = 1, max = 256))]
    pub slots: u32,
    /// Adapters a pod holds loaded at once, in GPU and host memory (vLLM's
    /// --max-cpu-loras; default: slots). The router keeps at most this many
    /// loaded in each pod, unloading the least recently used unpinned one
    /// to load another. The pod gets it as MODEL_RESIDENCY_MAX_CPU_LORAS.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(range(min = 1, max = 1024))]
    pub host_slots: Option<u32>,
    /// The largest adapter rank the server takes (vLLM's --max-lora-rank,
    /// default 16): an adapter of a larger rank is refused, never sent.
    /// The pod gets it as MODEL_RESIDENCY_MAX_LORA_RANK.
    #[serde(default = "sixteen")]
    #[schemars(range(min = 1, max = 512))]
    pub max_rank: u32,
    /// The adapters, at most 128, keyed by name. A request whose model is
    /// an adapter's name is served by a pod of this model with the adapter
    /// loaded.
    #[serde(default)]
    #[schemars(length(max = 128), extend("x-kubernetes-list-type" = "map", "x-kubernetes-list-map-keys" = ["name"]))]
    pub adapters: Vec<AdapterSpec>,
}

fn one() -> u32 {
    1
}

fn sixteen() -> u32 {
    16
}

impl LoraSpec {
    /// The adapters a pod holds at once (`hostSlots`, else `slots`).
    pub fn capacity(&self) -> u32 {
        self.host_slots.unwrap_or(self.slots).max(self.slots)
    }

    /// The environment the base model's containers get, from which the
    /// template's flags can be made (`--max-loras=$(MODEL_RESIDENCY_MAX_LORAS)`):
    /// vLLM's runtime adapter API switched on, and the slots and rank.
    pub fn env(&self) -> [(&'static str, String); 4] {
        [
            ("VLLM_ALLOW_RUNTIME_LORA_UPDATING", "True".into()),
            ("MODEL_RESIDENCY_MAX_LORAS", self.slots.to_string()),
            ("MODEL_RESIDENCY_MAX_CPU_LORAS", self.capacity().to_string()),
            ("MODEL_RESIDENCY_MAX_LORA_RANK", self.max_rank.to_string()),
        ]
    }
}

/// The environment variable that carries `maxRank` into the pod.
pub const MAX_LORA_RANK_ENV: &str = "MODEL_RESIDENCY_MAX_LORA_RANK";

/// One adapter of a base model.
#[derive(Serialize, Deserialize, Clone, Debug, PartialEq, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct AdapterSpec {
    /// The adapter's name: what requests name as their model. A DNS label,
    /// unique among the residency's models and adapters.
    // A pattern, not a CEL rule: CEL's cost over 1000 models of 128
    // adapters is past what the API server allows a schema.
    #[schemars(length(min = 1, max = 63), regex(pattern = super::rules::DNS_LABEL))]
    pub name: String,
    /// Its rank (the `r` of its adapter_config.json). Larger than the
    /// base's maxRank: refused, never sent to a server.
    #[schemars(range(min = 1, max = 4096))]
    pub rank: u32,
    /// Where the base model's server reads the adapter's directory
    /// (adapter_config.json and its weights), as the pod sees it: a volume
    /// of the template (default `/adapters/<name>`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(length(min = 2, max = 1024), regex(pattern = super::rules::NORMAL_ABSOLUTE_PATH))]
    pub path: Option<String>,
    /// A pinned adapter, once loaded into a pod, is never unloaded from it
    /// to make room for another.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub pinned: bool,
    /// Where the adapter's files come from: the node agent fetches them
    /// (http files, each checked against its sha256, or an OCI artifact),
    /// caches them on the node's disk like a model's weights, and the base
    /// model's pods mount them read-only at `path`. A base model's pod
    /// starts once each of its adapters' files is on the node or has
    /// failed; one that failed (a sha256 mismatch) is refused in that pod,
    /// with the node agent's words, never sent to its server. Without
    /// it, the template provides `path` (an image or a volume of its own).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub artifact: Option<AdapterArtifact>,
}

/// An adapter's files on the node: a small artifact, so its schema holds
/// patterns only (CEL rules over 1000 models of 128 adapters cost more
/// than the API server allows a schema); what a pattern cannot say is
/// checked by the operator (an AdaptersRefused condition).
#[derive(Serialize, Deserialize, Clone, Debug, PartialEq, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct AdapterArtifact {
    /// The adapter's files over http(s) (adapter_config.json and its
    /// weights), at most 8. Either `files` or `source`.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    #[schemars(length(max = 8))]
    pub files: Vec<AdapterFile>,
    /// An OCI artifact (`oci://<registry>/<repository>@sha256:<digest>`
    /// or `:<tag>`) whose title-annotated layers are the adapter's files.
    /// Either `files` or `source`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(length(min = 8, max = 1024), regex(pattern = r"^oci://[^ ]+$"))]
    pub source: Option<String>,
    /// Its declared disk footprint, a positive quantity ("64Mi"): the node
    /// agent keeps it within the node's disk budget by this size.
    #[schemars(length(min = 1, max = 32), regex(pattern = super::rules::POSITIVE_QUANTITY))]
    pub size: String,
}

/// One file of an adapter's artifact.
#[derive(Serialize, Deserialize, Clone, Debug, PartialEq, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct AdapterFile {
    /// An http or https URI under one of the node agent's --allowed-sources.
    #[schemars(length(min = 8, max = 2048), regex(pattern = r"^https?://[^ ]+$"))]
    pub uri: String,
    /// Its path inside the adapter's directory (default: the URI's last
    /// segment).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(length(min = 1, max = 512))]
    pub path: Option<String>,
    /// Its SHA-256 (64 hex digits): a file that does not match is not
    /// used, and the adapter is refused in the pods of that node.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(regex(pattern = r"^[0-9a-fA-F]{64}$"))]
    pub sha256: Option<String>,
}

impl AdapterArtifact {
    /// The same files as a model's artifact, mounted at `mount_path`: what
    /// the node agent fetches and the operator's gate reads.
    pub fn as_artifact(&self, mount_path: String) -> super::ArtifactSpec {
        super::ArtifactSpec {
            files: self
                .files
                .iter()
                .map(|f| super::ArtifactFile {
                    uri: f.uri.clone(),
                    path: f.path.clone(),
                    sha256: f.sha256.clone(),
                })
                .collect(),
            source: self.source.clone(),
            path: None,
            size: super::ByteQuantity(self.size.clone()),
            mount_path: Some(mount_path),
        }
    }

    /// What the schema's patterns cannot say: exactly one of files and
    /// source.
    pub fn problem(&self) -> Option<&'static str> {
        match (self.files.is_empty(), self.source.is_some()) {
            (true, false) => Some("its artifact names neither files nor a source"),
            (false, true) => Some("its artifact names both files and a source: one of them"),
            _ => None,
        }
    }
}

impl AdapterSpec {
    /// Where the server reads it.
    pub fn path(&self) -> String {
        self.path
            .clone()
            .unwrap_or_else(|| format!("/adapters/{}", self.name))
    }

    /// Its files as an artifact of the node's cache (keyed by the adapter's
    /// name), mounted where the server reads it.
    pub fn artifact(&self) -> Option<super::ArtifactSpec> {
        let a = self.artifact.as_ref().filter(|a| a.problem().is_none())?;
        Some(a.as_artifact(self.path()))
    }
}
