//! The node agent's loop: reads the residencies on its node, decides with
//! [`keep::plan`] what the disk holds, fetches and evicts, and reports it
//! all in its node's `NodeModelCache`.
//!
//! Required artifacts are those of models resident on the node (Fetching,
//! Loading, Loaded, or Failed while admitted); prefetch ones the
//! `spec.prefetch` most recently requested models of each residency that
//! are not resident. Artifacts the node's model pods mount (a pod being
//! deleted may still read its files) are kept until the pod is gone. A
//! failed fetch is retried with backoff (5 s, doubling, at most 5 min),
//! resuming what it fetched if it may (see [`fetch`]), also after a
//! restart of the agent.
//! It is the only writer of its `NodeModelCache`: on each
//! change, a server-side apply of the object (its spec: budget and cache
//! directory) and one of its status.

mod execute;
mod plan;
mod publish;
mod watches;

use execute::*;
use plan::*;
use publish::*;
use watches::*;

use super::blobs::{self, STORE_DIR};
use super::fetch::{self, FileSource, Progress};
use super::keep::{self, Blob, Held, Want, Wanted, rest_blob, unique_bytes};
use super::metrics::{AgentMetrics, ResultLabels};
use super::oci::{self, Registry, Resolved};
use crate::api::{
    ArtifactState, CachedArtifact, ModelCatalog, ModelResidency, NodeModelCache,
    NodeModelCacheSpec, NodeModelCacheStatus,
};
use crate::cluster::{apply_status, reflect};
use crate::quantity::{format_bytes, parse_bytes};
use crate::residency::catalog::{CatalogProblem, Catalogs};
use crate::residency::gpu::node_of;
use crate::residency::labels::NODE_AGENT_MANAGER;
use crate::residency::state::recorded_time;
use k8s_openapi::api::core::v1::{Pod, Secret};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::{Condition, Time};
use k8s_openapi::jiff::Timestamp;
use kube::api::{Api, Patch, PatchParams};
use kube::runtime::reflector::{self, Store};
use kube::runtime::watcher;
use std::collections::{HashMap, HashSet};
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;
use tokio::sync::{Notify, Semaphore, mpsc};

#[derive(Clone, Debug)]
pub struct AgentConfig {
    pub node: String,
    pub cache_dir: PathBuf,
    pub budget: u64,
    pub allowed_sources: Vec<String>,
    pub max_concurrent_downloads: usize,
    pub registry: RegistryConfig,
}

/// How the agent reaches OCI registries.
#[derive(Clone, Default)]
pub struct RegistryConfig {
    /// A `kubernetes.io/dockerconfigjson` Secret in the agent's own
    /// namespace (`namespace`): the credentials, read at each resolve (an
    /// edited Secret counts at the next try).
    pub credentials: Option<String>,
    pub namespace: Option<String>,
    /// PEM CA certificates trusted beside the system's.
    pub ca_pem: Option<Vec<u8>>,
}

/// Its CA as a size, not as the byte array the start log printed.
impl std::fmt::Debug for RegistryConfig {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RegistryConfig")
            .field("credentials", &self.credentials)
            .field("namespace", &self.namespace)
            .field(
                "ca_pem",
                &self
                    .ca_pem
                    .as_ref()
                    .map(|p| format!("{} bytes of PEM", p.len())),
            )
            .finish()
    }
}

/// One artifact the agent knows of.
#[derive(Debug, Clone)]
struct Entry {
    model: String,
    /// Declared size (or, for one found on disk at start and not yet
    /// declared by any residency, its size on disk).
    size: u64,
    state: ArtifactState,
    bytes: u64,
    last_use: Option<Timestamp>,
    reason: Option<String>,
    message: Option<String>,
    retry_at: Option<Timestamp>,
    failures: u32,
    progress: Option<Arc<Progress>>,
    sha256: Option<String>,
    /// The blobs its directory links (Ready).
    blobs: Vec<Blob>,
    /// An OCI artifact's manifest digest (a tag resolved).
    digest: Option<String>,
    /// A download of it that was cut short is on disk (in its
    /// [`fetch::partial_dir`]): the next try resumes it. It holds the
    /// artifact's size against the budget meanwhile.
    partial: bool,
    /// It failed in a way its spec always will ([`fetch::FetchError::permanent`]):
    /// not tried again by this agent.
    permanent: bool,
}

impl Entry {
    /// Failed, and not to be tried at `now`: its retry is not due, or it
    /// never will be.
    fn waits(&self, now: Timestamp) -> bool {
        self.state == ArtifactState::Failed
            && (self.permanent || self.retry_at.is_some_and(|at| at > now))
    }

    fn new(model: String, size: u64, state: ArtifactState, last_use: Option<Timestamp>) -> Self {
        Entry {
            model,
            size,
            state,
            bytes: 0,
            last_use,
            reason: None,
            message: None,
            retry_at: None,
            failures: 0,
            progress: None,
            sha256: None,
            blobs: Vec::new(),
            digest: None,
            partial: false,
            permanent: false,
        }
    }

    /// Whether it holds room on the disk: on it, being fetched, or a
    /// download cut short waiting for its next try.
    fn holds_room(&self) -> bool {
        matches!(self.state, ArtifactState::Ready | ArtifactState::Fetching) || self.partial
    }
}

/// Where an artifact's bytes come from.
#[derive(Debug, Clone, PartialEq, Eq)]
enum Origin {
    Files(Vec<FileSource>),
    /// `oci://...`, and the directory inside tar layers.
    Oci {
        source: String,
        layer_dir: String,
    },
}

/// The agent's state: its artifacts and what to do next.
struct Agent {
    config: AgentConfig,
    entries: HashMap<String, Entry>,
    downloads: Arc<Semaphore>,
    done: mpsc::UnboundedSender<Done>,
    client: fetch::HttpsClient,
    registry: Registry,
    /// Where the registry credentials are read (the agent's namespace).
    secrets: Option<Api<Secret>>,
    /// OCI artifacts' manifests, by key: resolved before the disk plan
    /// counts them (it needs their layers to know what they share), once
    /// per key (a tag resolved once keeps its digest for the agent's life,
    /// and across restarts through the view record).
    resolved: HashMap<String, Resolved>,
    resolving: HashSet<String>,
    store: blobs::Store,
    /// Whether a blob may have lost its last link since the store was last
    /// collected (an eviction, a fetch that ended, the start): collecting
    /// walks every unpacked layer, so it is not done on every pass.
    collect_due: bool,
    /// Unpacked layers' sizes on disk, by digest (content-addressed: a
    /// layer's size never changes while it is there; forgotten when the
    /// store is collected).
    layer_sizes: std::cell::RefCell<HashMap<String, u64>>,
    /// The cache directory's bytes on disk as last walked, and whether
    /// they may have changed since (a fetch running or ended, an
    /// eviction): walked again only then.
    on_disk: Option<u64>,
    disk_changed: bool,
    metrics: Arc<AgentMetrics>,
}

impl Agent {
    /// One pass: plan against what the residencies want and what the
    /// node's pods mount, evict, start fetches, mark refusals and waits.
    fn step(&mut self, residencies: &[Arc<ModelResidency>], pods: &[Arc<Pod>]) {
        let now = Timestamp::now();
        let all_wanted = declared(residencies, &self.config.node);
        self.resolve_unknown(&all_wanted, now);
        // An OCI artifact is planned once its manifest says what it holds
        // (it stays wanted meanwhile: a failure waiting for its retry is
        // kept).
        let mut wanted = all_wanted.clone();
        wanted.retain(|k, d| {
            !matches!(d.origin, Origin::Oci { .. })
                || self.resolved.contains_key(k)
                || self.entries.get(k).is_some_and(|e| e.holds_room())
        });
        let in_use = mounted(pods, &self.config.cache_dir);
        let plan = self.plan(&wanted, &in_use, now);
        self.evict(&plan.evict);
        self.collect_garbage(&all_wanted);
        // Downloads cut short resume in the room they hold, once due.
        let resumable: Vec<&String> = wanted
            .keys()
            .filter(|k| {
                self.entries
                    .get(*k)
                    .is_some_and(|e| e.partial && e.state == ArtifactState::Failed)
            })
            .collect();
        for key in plan.fetch.iter().chain(resumable) {
            self.start_fetch(key, &wanted[key], now);
        }
        self.mark_refused_and_waiting(&wanted, &plan);
        self.forget_unwanted(residencies, &all_wanted);
    }
}

/// Why the agent could not start.
#[derive(Debug, thiserror::Error)]
pub enum AgentError {
    #[error("creating the cache directory {dir}: {source}")]
    CreateCacheDir { dir: String, source: std::io::Error },
    #[error("reading the cache directory {dir}: {source}")]
    ReadCacheDir { dir: String, source: std::io::Error },
    #[error("building the HTTPS client: {0}")]
    HttpClient(fetch::FetchError),
}

/// Runs the agent until `shutdown` completes. `ready` is set after the
/// first pass; `metrics` is kept current.
pub async fn run(
    client: kube::Client,
    config: AgentConfig,
    ready: crate::http::Readiness,
    metrics: Arc<AgentMetrics>,
    shutdown: impl std::future::Future<Output = ()>,
) -> Result<(), AgentError> {
    let dir = || config.cache_dir.display().to_string();
    std::fs::create_dir_all(&config.cache_dir)
        .map_err(|source| AgentError::CreateCacheDir { dir: dir(), source })?;
    let (done_tx, mut done_rx) = mpsc::unbounded_channel();
    let mut agent = Agent::new(&client, &config, done_tx, metrics.clone())?;
    agent
        .scan()
        .map_err(|source| AgentError::ReadCacheDir { dir: dir(), source })?;
    let cut_short = agent.entries.values().filter(|e| e.partial).count();
    if cut_short > 0 {
        tracing::info!(
            cut_short,
            "found downloads a previous run left cut short: those still wanted resume, the others are removed"
        );
    }
    let caches: Api<NodeModelCache> = Api::all(client.clone());
    agent.restore_last_uses(&caches).await;
    let watches = NodeWatches::start(client, &config.node).await;
    let mut last = None;
    let mut shutdown = std::pin::pin!(shutdown);
    loop {
        // A residency whose catalog cannot be read (deleted, not listed
        // yet) says nothing of what it wants: rather than take its
        // artifacts for unwanted, nothing is planned until it can.
        match residencies_of(&watches.named, &watches.placed, &watches.catalogs) {
            Ok(residencies) => agent.step(&residencies, &watches.pods.state()),
            Err(e) => {
                tracing::info!(error = %e, "a residency's catalog cannot be read; the disk is left as it is")
            }
        }
        let used = agent.used();
        agent.refresh_on_disk();
        let status = agent.status(used);
        metrics.observe(config.budget, used, &status);
        publish(&caches, &config, status, &mut last).await;
        ready.set();
        // Progress and retries are looked at every second while anything
        // is fetching or waiting to retry; otherwise only on changes.
        let tick = if agent.fetching() {
            Duration::from_secs(1)
        } else {
            Duration::from_secs(60)
        };
        tokio::select! {
            _ = watches.changed.notified() => {}
            Some(done) = done_rx.recv() => agent.done(done),
            _ = tokio::time::sleep(tick) => {}
            _ = &mut shutdown => break,
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests;
