//! Model artifacts on the node's disk: the registry's `artifact` field and
//! the `NodeModelCache` custom resource (`residency.dev/v1alpha1`,
//! cluster-scoped, one per node, named after it), which the node agent
//! owns and the operator reads.

use super::ByteQuantity;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::Condition;
use kube::CustomResource;
use schemars::JsonSchema;
use serde::{Deserialize, Serialize};

/// What a model needs on the node's disk before its pod may start.
#[derive(Serialize, Deserialize, Clone, Debug, PartialEq, JsonSchema)]
#[serde(rename_all = "camelCase")]
#[schemars(extend("x-kubernetes-validations" = super::rules::artifact_source()))]
pub struct ArtifactSpec {
    /// The files, fetched over http(s) into the model's directory on the
    /// node. Either `files` or `source`.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    #[schemars(length(max = 64))]
    pub files: Vec<ArtifactFile>,
    /// An OCI artifact or image in a container registry:
    /// `oci://<registry>/<repository>@sha256:<digest>`, or `:<tag>` (the
    /// node agent that fetches it first resolves the tag to a digest, and
    /// that digest is what every node fetches until the spec changes).
    /// Layers with an `org.opencontainers.image.title` annotation become
    /// that file (ORAS artifacts); tar layers are unpacked (images, e.g.
    /// KServe modelcars) and `path` of them is the model's directory.
    /// Either `files` or `source`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(length(min = 7, max = 1024), extend("x-kubernetes-validations" = super::rules::oci_source()))]
    pub source: Option<String>,
    /// With `source`: the directory inside the image's tar layers that is
    /// the model's directory (default `/models`, the modelcar convention).
    /// Title-annotated layers are placed at the top whatever it says.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(length(min = 1, max = 1024), extend("x-kubernetes-validations" = super::rules::mount_path()))]
    pub path: Option<String>,
    /// The artifact's declared disk footprint: a positive quantity as a
    /// string ("8Gi") or bytes. The node agent keeps artifacts within the
    /// node's disk budget by these sizes, and stops a download that goes
    /// past it.
    pub size: ByteQuantity,
    /// Where the model's pod sees the directory, read-only (default
    /// `/models/<name>`): a normalized absolute path (no `.` or `..`
    /// segments, no empty ones, not `/`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(length(min = 2, max = 1024), extend("x-kubernetes-validations" = super::rules::mount_path()))]
    pub mount_path: Option<String>,
}

/// One file of an artifact.
#[derive(Serialize, Deserialize, Clone, Debug, PartialEq, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct ArtifactFile {
    /// Where to fetch it: an http or https URI under one of the node
    /// agent's --allowed-sources.
    #[schemars(length(min = 1, max = 2048), extend("x-kubernetes-validations" = super::rules::http_uri()))]
    pub uri: String,
    /// Its path inside the model's directory, relative, never escaping it
    /// (default: the URI's last segment).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(length(min = 1, max = 512))]
    pub path: Option<String>,
    /// Its SHA-256 (64 hex digits), checked before the artifact is used.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(length(min = 64, max = 64), extend("x-kubernetes-validations" = super::rules::sha256()))]
    pub sha256: Option<String>,
}

impl ArtifactSpec {
    /// The artifact's name in the node's cache: the model's name and a hash
    /// of what it fetches, so two residencies on one node share a model's
    /// files when they declare the same ones, and an edited artifact is a
    /// new one.
    pub fn cache_key(&self, model: &str) -> String {
        // Files-only artifacts hash as they always did (their caches on
        // nodes keep their names across this version).
        let text = match &self.source {
            None => serde_json::to_string(&(&self.files, &self.size.0)),
            Some(source) => serde_json::to_string(&(source, &self.path, &self.size.0)),
        }
        .unwrap_or_default();
        let digest = ring::digest::digest(&ring::digest::SHA256, text.as_bytes());
        let short: String = digest.as_ref()[..5]
            .iter()
            .map(|b| format!("{b:02x}"))
            .collect();
        format!("{model}-{short}")
    }

    /// Why the mount path is unusable, if it is: not absolute, `/`, or
    /// not normalized (`/models/../etc` mounts over `/etc`). The schema
    /// says the same at admission; this holds for objects stored before it.
    pub fn mount_path_problem(&self) -> Option<String> {
        let path = self.mount_path.as_deref()?;
        let normal = path.len() > 1
            && path.starts_with('/')
            && path[1..]
                .split('/')
                .all(|s| !s.is_empty() && s != "." && s != "..");
        (!normal).then(|| {
            format!("mountPath {path:?} must be a normalized absolute path (no '.', '..' or empty segments, not '/')")
        })
    }

    /// The directory inside tar layers that is the model's (`path`,
    /// default `/models`), without its leading `/`.
    pub fn layer_dir(&self) -> &str {
        self.path
            .as_deref()
            .unwrap_or("/models")
            .trim_start_matches('/')
    }

    /// Where the pod sees it.
    pub fn mount_path_for(&self, model: &str) -> String {
        self.mount_path
            .clone()
            .unwrap_or_else(|| format!("/models/{model}"))
    }
}

/// A node's model artifact cache, as its node agent keeps it.
#[derive(CustomResource, Serialize, Deserialize, Clone, Debug, PartialEq, JsonSchema)]
#[kube(
    group = "residency.dev",
    version = "v1alpha1",
    kind = "NodeModelCache",
    doc = "One node's model artifact cache, written by that node's agent (model-residency node-agent): its disk budget, what it holds and fetches.",
    plural = "nodemodelcaches",
    singular = "nodemodelcache",
    shortname = "nmc",
    status = "NodeModelCacheStatus",
    printcolumn = r#"{"name":"Budget","type":"string","jsonPath":".spec.budget"}"#,
    printcolumn = r#"{"name":"Used","type":"string","jsonPath":".status.used"}"#,
    printcolumn = r#"{"name":"OnDisk","type":"string","jsonPath":".status.onDisk"}"#,
    printcolumn = r#"{"name":"Deduplicated","type":"string","jsonPath":".status.deduplicated"}"#,
    printcolumn = r#"{"name":"Ready","type":"integer","jsonPath":".status.ready"}"#,
    printcolumn = r#"{"name":"Fetching","type":"integer","jsonPath":".status.fetching"}"#,
    printcolumn = r#"{"name":"DiskFull","type":"string","jsonPath":".status.conditions[?(@.type==\"DiskFull\")].status"}"#,
    printcolumn = r#"{"name":"Age","type":"date","jsonPath":".metadata.creationTimestamp"}"#
)]
#[serde(rename_all = "camelCase")]
pub struct NodeModelCacheSpec {
    /// The agent's disk budget (its --disk-budget).
    pub budget: String,
    /// The cache directory on the node (its --cache-dir): model pods mount
    /// `<cacheDir>/<key>`.
    pub cache_dir: String,
}

#[derive(Serialize, Deserialize, Clone, Debug, Default, PartialEq, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct NodeModelCacheStatus {
    /// What counts against the budget: the artifacts on disk (each blob
    /// once, however many share it) and the declared sizes of those being
    /// fetched.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub used: Option<String>,
    /// What the cache directory really takes on the disk: the blocks of
    /// its files, directories and links, each once however many artifacts
    /// link it (many tiny files take far more than their bytes).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub on_disk: Option<String>,
    /// Bytes the artifacts on disk share: the sum of their sizes less what
    /// they take on disk together.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub deduplicated: Option<String>,
    #[serde(default)]
    pub ready: u32,
    #[serde(default)]
    pub fetching: u32,
    #[serde(default)]
    pub artifacts: Vec<CachedArtifact>,
    #[serde(default)]
    pub conditions: Vec<Condition>,
}

/// Where an artifact stands on the node.
#[derive(Serialize, Deserialize, Clone, Copy, Debug, Default, PartialEq, Eq, JsonSchema)]
pub enum ArtifactState {
    /// Being downloaded (see bytes).
    #[default]
    Fetching,
    /// On disk and verified: pods may mount it.
    Ready,
    /// Its fetch failed (see reason); retried at retryAt if it may succeed.
    Failed,
    /// Required but refused: the disk budget cannot hold it (DiskFull).
    Refused,
    /// Required, and it fits once artifacts that pods on the node still
    /// mount (pods being deleted) are gone: fetched then.
    Waiting,
    /// Taken off the disk to make room (least recently used, unrequired);
    /// fetched again when a model needs it.
    Evicted,
}

#[derive(Serialize, Deserialize, Clone, Debug, Default, PartialEq, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct CachedArtifact {
    /// `<model>-<hash>`: its directory under cacheDir.
    pub key: String,
    pub model: String,
    pub state: ArtifactState,
    /// Bytes downloaded so far (Fetching) or on disk (Ready).
    #[serde(default)]
    pub bytes: u64,
    /// Declared size.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub size: Option<String>,
    /// SHA-256 of what was fetched: the file's, for a one-file artifact;
    /// else of its manifest (`<hex>  <path>` lines, sha256sum style).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub sha256: Option<String>,
    /// For an OCI source: the manifest digest fetched (a tag resolved).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub digest: Option<String>,
    /// When a model last needed it (the LRU key).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub last_use: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub reason: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub message: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub retry_at: Option<String>,
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_cache_key_follows_what_is_fetched() {
        let a: ArtifactSpec = serde_json::from_value(serde_json::json!({
            "files": [{"uri": "http://m/w.bin"}], "size": "1Gi"}))
        .unwrap();
        let mut b = a.clone();
        assert_eq!(a.cache_key("qwen"), b.cache_key("qwen"));
        assert!(a.cache_key("qwen").starts_with("qwen-"));
        b.files[0].uri = "http://m/w2.bin".into();
        assert_ne!(a.cache_key("qwen"), b.cache_key("qwen"));
        b.mount_path = Some("/weights".into());
        assert_eq!(b.mount_path_for("qwen"), "/weights");
        assert_eq!(b.mount_path_problem(), None);
        for bad in [
            "/models/../etc",
            "/",
            "/a//b",
            "/a/./b",
            "/a/",
            "relative",
            "/..",
        ] {
            b.mount_path = Some(bad.into());
            assert!(b.mount_path_problem().is_some(), "{bad}");
        }
        for good in ["/models/qwen", "/.cache/m", "/a/...", "/w..x"] {
            b.mount_path = Some(good.into());
            assert_eq!(b.mount_path_problem(), None, "{good}");
        }
        assert_eq!(a.mount_path_for("qwen"), "/models/qwen");
    }
}
