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

use super::blobs::{self, STORE_DIR};
use super::fetch::{self, FileSource, Progress};
use super::keep::{self, Blob, Held, Want, Wanted, rest_blob, unique_bytes};
use super::metrics::{AgentMetrics, ResultLabels};
use super::oci::{self, Registry, Resolved};
use crate::api::{
    ArtifactState, CachedArtifact, ModelResidency, NodeModelCache, NodeModelCacheSpec,
    NodeModelCacheStatus,
};
use crate::cluster::{apply_status, reflect};
use crate::quantity::{format_bytes, parse_bytes};
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

/// An artifact some residency on the node declares.
#[derive(Debug, Clone)]
struct Declared {
    model: String,
    origin: Origin,
    size: u64,
    want: Want,
    pinned: bool,
    requested: Option<Timestamp>,
}

/// The residencies of both watches, each once (one that names the node
/// and was allocated there is in both).
fn residencies_of(
    named: &Store<ModelResidency>,
    placed: &Store<ModelResidency>,
) -> Vec<Arc<ModelResidency>> {
    let mut all = named.state();
    let uids: HashSet<Option<String>> = all.iter().map(|r| r.metadata.uid.clone()).collect();
    all.extend(
        placed
            .state()
            .into_iter()
            .filter(|r| !uids.contains(&r.metadata.uid)),
    );
    all
}

/// What the residencies on `node` want on its disk, by cache key.
fn declared(residencies: &[Arc<ModelResidency>], node: &str) -> HashMap<String, Declared> {
    let mut out: HashMap<String, Declared> = HashMap::new();
    let mut add = |key: String, d: Declared| {
        out.entry(key)
            .and_modify(|e| {
                e.want = e.want.min(d.want);
                e.pinned |= d.pinned;
                e.requested = e.requested.max(d.requested);
            })
            .or_insert(d);
    };
    for r in residencies.iter().filter(|r| node_of(r) == Some(node)) {
        let status = r.status.as_ref();
        let state_of = |m: &str| status.and_then(|s| s.model(m));
        let mut idle = Vec::new();
        for m in &r.spec.models {
            let Some(artifact) = &m.artifact else {
                continue;
            };
            let Ok(size) = parse_bytes(&artifact.size.0) else {
                continue;
            };
            let st = state_of(&m.name);
            let requested = st
                .and_then(|s| recorded_time(s.last_requested.as_deref()))
                .or_else(|| r.spec.demand.get(&m.name).and_then(|t| t.parse().ok()));
            let origin = match &artifact.source {
                Some(source) => Origin::Oci {
                    source: source.clone(),
                    layer_dir: artifact.layer_dir().to_owned(),
                },
                None => Origin::Files(
                    artifact
                        .files
                        .iter()
                        .map(|f| FileSource {
                            uri: f.uri.clone(),
                            path: f.path.clone(),
                            sha256: f.sha256.as_ref().map(|s| s.to_lowercase()),
                        })
                        .collect(),
                ),
            };
            let d = Declared {
                model: m.name.clone(),
                origin,
                size,
                want: Want::Required,
                pinned: m.pinned,
                requested,
            };
            if st.is_some_and(|s| s.is_resident()) {
                add(artifact.cache_key(&m.name), d);
            } else if requested.is_some() {
                idle.push((artifact.cache_key(&m.name), d));
            }
        }
        idle.sort_by_key(|(_, d)| std::cmp::Reverse(d.requested));
        for (key, mut d) in idle.into_iter().take(r.spec.prefetch as usize) {
            d.want = Want::Prefetch;
            add(key, d);
        }
    }
    out
}

/// Every artifact key the registries on `node` declare.
fn registry_keys(
    residencies: &[Arc<ModelResidency>],
    node: &str,
) -> std::collections::HashSet<String> {
    residencies
        .iter()
        .filter(|r| node_of(r) == Some(node))
        .flat_map(|r| r.spec.models.iter())
        .filter_map(|m| m.artifact.as_ref().map(|a| a.cache_key(&m.name)))
        .collect()
}

/// The artifacts that pods on the node mount (by cache key): a model pod
/// mounts its artifact's directory, `<cacheDir>/<key>`, as a hostPath. A
/// pod counts until it is gone, terminating included; one that has
/// finished (Succeeded or Failed) runs nothing.
fn mounted(pods: &[Arc<Pod>], cache_dir: &Path) -> HashSet<String> {
    pods.iter()
        .filter(|p| {
            let phase = p.status.as_ref().and_then(|s| s.phase.as_deref());
            !matches!(phase, Some("Succeeded" | "Failed"))
        })
        .flat_map(|p| p.spec.iter().flat_map(|s| s.volumes.iter().flatten()))
        .filter_map(|v| {
            let path = Path::new(&v.host_path.as_ref()?.path);
            if path.parent()? != cache_dir {
                return None;
            }
            path.file_name()?.to_str().map(str::to_owned)
        })
        .collect()
}

fn retry_delay(failures: u32) -> Duration {
    Duration::from_secs(
        5u64.saturating_mul(1 << failures.saturating_sub(1).min(6))
            .min(300),
    )
}

/// What a task the agent started reports back.
enum Done {
    Fetched(String, Result<fetch::Fetched, fetch::FetchError>),
    Resolved(String, Result<Resolved, fetch::FetchError>),
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
    /// Artifacts already on disk (a restart): Ready at their size on disk;
    /// and downloads a previous run left cut short, due for a try now (the
    /// first pass resumes the ones still wanted and removes the others).
    fn scan(&mut self) -> std::io::Result<()> {
        for entry in std::fs::read_dir(&self.config.cache_dir)? {
            let entry = entry?;
            let name = entry.file_name().to_string_lossy().into_owned();
            if !entry.file_type()?.is_dir() || name == STORE_DIR {
                continue;
            }
            let bytes = fetch::disk_usage(&entry.path())?;
            let (key, state) = match name.strip_prefix(fetch::PARTIAL_PREFIX) {
                Some(key) => (key.to_owned(), ArtifactState::Failed),
                None => (name, ArtifactState::Ready),
            };
            let model = key
                .rsplit_once('-')
                .map_or(key.as_str(), |(m, _)| m)
                .to_owned();
            let mut entry = Entry::new(model, bytes, state, None);
            entry.bytes = bytes;
            if state == ArtifactState::Ready {
                // What it links, as its fetch recorded it; an artifact
                // from before the blob store is all its own.
                match self.store.read_view(&key) {
                    Some(record) => {
                        entry.blobs = record.blobs;
                        entry.digest = record.manifest;
                    }
                    None => entry.blobs = vec![rest_blob(&key, bytes)],
                }
            }
            if state == ArtifactState::Failed {
                entry.partial = true;
                entry.retry_at = Some(Timestamp::now());
            }
            self.entries.insert(key, entry);
        }
        Ok(())
    }

    /// Removes the download of `key` that was cut short, if any.
    fn drop_partial(&mut self, key: &str) {
        if let Some(e) = self.entries.get_mut(key).filter(|e| e.partial) {
            e.partial = false;
            self.disk_changed = true;
            let dir = fetch::partial_dir(&self.config.cache_dir, key);
            if let Err(err) = std::fs::remove_dir_all(&dir)
                && err.kind() != std::io::ErrorKind::NotFound
            {
                tracing::warn!(artifact = %key, error = %err, "removing a partial download failed");
            }
        }
    }

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

    /// Starts resolving the manifests of wanted OCI artifacts not resolved
    /// yet (nor on disk, nor failed and waiting for their retry).
    fn resolve_unknown(&mut self, wanted: &HashMap<String, Declared>, now: Timestamp) {
        for (key, d) in wanted {
            let Origin::Oci { source, .. } = &d.origin else {
                continue;
            };
            let on_disk = self.entries.get(key).is_some_and(|e| e.holds_room());
            let waiting = self.entries.get(key).is_some_and(|e| e.waits(now));
            if on_disk
                || waiting
                || self.resolved.contains_key(key)
                || !self.resolving.insert(key.clone())
            {
                continue;
            }
            let (registry, secrets, config, done) = (
                self.registry.clone(),
                self.secrets.clone(),
                self.config.clone(),
                self.done.clone(),
            );
            // A tag fetched before (this agent's life, or on its disk)
            // keeps the digest it was fetched at.
            let pinned = self.entries.get(key).and_then(|e| e.digest.clone());
            let (key, source) = (key.clone(), source.clone());
            tokio::spawn(async move {
                let result = resolve(&registry, secrets.as_ref(), &config, &source, pinned).await;
                let _ = done.send(Done::Resolved(key, result));
            });
        }
    }

    /// Removes the blobs no artifact links any more (after evictions), but
    /// those a fetch running now may link, and OCI blobs cut short that no
    /// wanted artifact needs.
    fn collect_garbage(&mut self, wanted: &HashMap<String, Declared>) {
        let fetching: HashSet<String> = self
            .entries
            .iter()
            .filter(|(_, e)| e.state == ArtifactState::Fetching)
            .filter_map(|(k, _)| wanted.get(k).map(|d| (k, d)))
            .flat_map(|(k, d)| self.known_blobs(k, d).into_iter().map(|(id, _)| id))
            .collect();
        if std::mem::take(&mut self.collect_due) {
            match self
                .store
                .collect_garbage(&self.config.cache_dir, &fetching)
            {
                Ok(0) => {}
                Ok(freed) => {
                    tracing::info!(bytes = freed, "removed blobs no artifact links");
                    self.disk_changed = true;
                }
                Err(e) => {
                    tracing::warn!(error = %e, "collecting unlinked blobs failed");
                    self.collect_due = true;
                }
            }
            self.layer_sizes.get_mut().clear();
        }
        // Which blobs cut short are still of use is known once every
        // wanted OCI artifact is resolved (after a restart, a partial blob
        // waits for its manifest to be read again).
        let unresolved = wanted
            .iter()
            .any(|(k, d)| matches!(d.origin, Origin::Oci { .. }) && !self.resolved.contains_key(k));
        if unresolved {
            return;
        }
        let needed: HashSet<String> = wanted
            .keys()
            .filter_map(|k| self.resolved.get(k))
            .flat_map(|r| r.layers.iter().map(|l| l.digest.clone()))
            .collect();
        if self.store.drop_partials(&needed) > 0 {
            self.disk_changed = true;
        }
    }

    /// The blobs of `d` known by digest (those a shared store may hold),
    /// with the sizes they take on disk.
    fn known_blobs(&self, key: &str, d: &Declared) -> Vec<Blob> {
        let mut known: Vec<Blob> = Vec::new();
        match &d.origin {
            Origin::Files(files) => {
                for hex in files.iter().filter_map(|f| f.sha256.as_deref()) {
                    if let Some(size) = self.store.has_file(hex) {
                        known.push((blobs::blob_id(hex), size));
                    }
                }
            }
            Origin::Oci { .. } => {
                for layer in self.resolved.get(key).iter().flat_map(|r| r.layers.iter()) {
                    let hex = layer.digest.trim_start_matches("sha256:");
                    if layer.title.is_some() {
                        known.push((layer.digest.clone(), layer.size));
                    } else if let Some(bytes) = self.layer_size(hex) {
                        known.push((layer.digest.clone(), bytes));
                    }
                }
            }
        }
        let mut seen = HashSet::new();
        known.retain(|(id, _)| seen.insert(id.clone()));
        known
    }

    /// The bytes of unpacked layer `hex`, if the store holds it.
    fn layer_size(&self, hex: &str) -> Option<u64> {
        if let Some(&bytes) = self.layer_sizes.borrow().get(hex) {
            return Some(bytes);
        }
        let bytes = blobs::unique_usage(&self.store.layer(hex))
            .ok()
            .filter(|&b| b > 0)?;
        self.layer_sizes.borrow_mut().insert(hex.to_owned(), bytes);
        Some(bytes)
    }

    /// The cache directory's bytes on disk, walked again only when they
    /// may have changed.
    fn refresh_on_disk(&mut self) {
        let fetching = self
            .entries
            .values()
            .any(|e| e.state == ArtifactState::Fetching);
        if std::mem::take(&mut self.disk_changed) || fetching || self.on_disk.is_none() {
            self.on_disk = blobs::allocated(&self.config.cache_dir).ok();
        }
    }

    /// What `d` takes on disk when fetched: its known blobs and the rest of
    /// its declared size.
    fn planned_blobs(&self, key: &str, d: &Declared) -> Vec<Blob> {
        let mut blobs = self.known_blobs(key, d);
        let known: u64 = blobs.iter().map(|(_, n)| n).sum();
        blobs.push(rest_blob(key, d.size.saturating_sub(known)));
        blobs
    }

    /// The pass's plan (pure, [`keep::plan`]) from what is wanted, what the
    /// node holds and what its pods mount; wanted artifacts' sizes and last
    /// uses are brought up to date first.
    fn plan(
        &mut self,
        wanted: &HashMap<String, Declared>,
        in_use: &HashSet<String>,
        now: Timestamp,
    ) -> keep::Plan {
        for (key, d) in wanted {
            if let Some(e) = self.entries.get_mut(key) {
                e.size = d.size;
                if d.want == Want::Required {
                    e.last_use = e.last_use.max(d.requested).or(Some(now));
                }
            }
        }
        let held = self.held(wanted, in_use);
        let want: Vec<Wanted> = wanted
            .iter()
            .map(|(k, d)| Wanted {
                key: k.clone(),
                blobs: self.planned_blobs(k, d),
                want: d.want,
                pinned: d.pinned,
                requested: d.requested,
            })
            .collect();
        keep::plan(self.config.budget, &held, &want)
    }

    /// What holds room: a Ready artifact its blobs; one being fetched (or
    /// cut short) its planned blobs, or its declared size if no residency
    /// declares it any more.
    fn held(&self, wanted: &HashMap<String, Declared>, in_use: &HashSet<String>) -> Vec<Held> {
        self.entries
            .iter()
            .filter(|(_, e)| e.holds_room())
            .map(|(k, e)| Held {
                key: k.clone(),
                blobs: match (e.state, wanted.get(k)) {
                    (ArtifactState::Ready, _) if !e.blobs.is_empty() => e.blobs.clone(),
                    (_, Some(d)) => self.planned_blobs(k, d),
                    _ => vec![rest_blob(k, e.size)],
                },
                last_use: e.last_use,
                in_use: in_use.contains(k),
            })
            .collect()
    }

    /// Removes the plan's victims from disk (never one being fetched).
    fn evict(&mut self, keys: &[String]) {
        for key in keys {
            let Some(e) = self.entries.get(key) else {
                continue;
            };
            if e.state == ArtifactState::Fetching {
                continue;
            }
            if e.partial {
                // A download cut short: its part goes; it starts over.
                self.drop_partial(key);
                continue;
            }
            let dir = self.config.cache_dir.join(key);
            match std::fs::remove_dir_all(&dir) {
                Ok(()) => {
                    self.store.remove_view(key);
                    self.collect_due = true;
                    self.disk_changed = true;
                    tracing::info!(artifact = %key, "evicted from the disk cache");
                    self.metrics.evictions.inc();
                    if let Some(e) = self.entries.get_mut(key) {
                        e.state = ArtifactState::Evicted;
                        e.bytes = 0;
                        e.blobs.clear();
                    }
                }
                Err(e) => tracing::warn!(artifact = %key, error = %e, "evicting failed"),
            }
        }
    }

    /// Starts fetching `key` unless it is being fetched or waits for its
    /// retry time; the result comes back on `done`.
    fn start_fetch(&mut self, key: &str, d: &Declared, now: Timestamp) {
        let entry = self.entries.entry(key.to_owned()).or_insert_with(|| {
            Entry::new(d.model.clone(), d.size, ArtifactState::Failed, d.requested)
        });
        if entry.state == ArtifactState::Fetching || entry.waits(now) {
            return;
        }
        entry.state = ArtifactState::Fetching;
        entry.reason = None;
        entry.message = None;
        entry.retry_at = None;
        let progress = Arc::new(Progress::default());
        entry.progress = Some(progress.clone());
        let (client, cache, key, origin, size, allowed, permits, done, metrics) = (
            self.client.clone(),
            self.config.cache_dir.clone(),
            key.to_owned(),
            d.origin.clone(),
            d.size,
            self.config.allowed_sources.clone(),
            self.downloads.clone(),
            self.done.clone(),
            self.metrics.clone(),
        );
        let resolved = self.resolved.get(&key).cloned();
        let (registry, secrets, config) = (
            self.registry.clone(),
            self.secrets.clone(),
            self.config.clone(),
        );
        tokio::spawn(async move {
            let _permit = permits.acquire_owned().await;
            let started = std::time::Instant::now();
            let result = match origin {
                Origin::Files(files) => {
                    fetch::fetch(&client, &cache, &key, &files, size, &allowed, &progress).await
                }
                Origin::Oci { source, layer_dir } => {
                    fetch_oci(
                        &registry,
                        secrets.as_ref(),
                        &config,
                        (&key, &source, &layer_dir, size),
                        resolved,
                        &progress,
                    )
                    .await
                }
            };
            metrics
                .fetch_duration
                .observe(started.elapsed().as_secs_f64());
            let outcome = match &result {
                Ok(fetched) => {
                    metrics
                        .fetched_bytes
                        .inc_by(fetched.bytes - fetched.resumed - fetched.shared);
                    metrics.shared_bytes.inc_by(fetched.shared);
                    metrics.resumed_bytes.inc_by(fetched.resumed);
                    "Fetched"
                }
                Err(e) => e.reason(),
            };
            metrics
                .fetches
                .get_or_create(&ResultLabels { result: outcome })
                .inc();
            let _ = done.send(Done::Fetched(key, result));
        });
    }

    /// The plan's refusals and waits, as they stand now: earlier ones that
    /// now fit (or are no longer wanted) go.
    fn mark_refused_and_waiting(&mut self, wanted: &HashMap<String, Declared>, plan: &keep::Plan) {
        let refused: HashMap<&String, &String> = plan.refused.iter().map(|(k, m)| (k, m)).collect();
        let waiting: HashMap<&String, &String> = plan.waiting.iter().map(|(k, m)| (k, m)).collect();
        self.entries.retain(|k, e| match e.state {
            ArtifactState::Refused => refused.contains_key(k),
            ArtifactState::Waiting => waiting.contains_key(k),
            _ => true,
        });
        let marks = refused
            .iter()
            .map(|(k, m)| (*k, *m, ArtifactState::Refused, "DiskFull"))
            .chain(
                waiting
                    .iter()
                    .map(|(k, m)| (*k, *m, ArtifactState::Waiting, "MountedArtifactsHoldRoom")),
            );
        for (key, message, state, reason) in marks {
            let d = &wanted[key];
            let e = self
                .entries
                .entry(key.clone())
                .or_insert_with(|| Entry::new(d.model.clone(), d.size, state, d.requested));
            if e.state != ArtifactState::Fetching && e.state != ArtifactState::Ready {
                e.state = state;
                e.reason = Some(reason.into());
                e.message = Some(message.clone());
            }
        }
    }

    /// Failures of artifacts nobody wants any more are forgotten (their
    /// parts removed), and evictions of artifacts no registry on the node
    /// declares.
    fn forget_unwanted(
        &mut self,
        residencies: &[Arc<ModelResidency>],
        wanted: &HashMap<String, Declared>,
    ) {
        let declared_here = registry_keys(residencies, &self.config.node);
        let forgotten: Vec<String> = self
            .entries
            .iter()
            .filter(|(k, e)| {
                e.partial && e.state == ArtifactState::Failed && !wanted.contains_key(*k)
            })
            .map(|(k, _)| k.clone())
            .collect();
        for key in &forgotten {
            self.drop_partial(key);
        }
        self.entries.retain(|k, e| match e.state {
            ArtifactState::Failed => wanted.contains_key(k),
            ArtifactState::Evicted => declared_here.contains(k),
            _ => true,
        });
    }

    fn done(&mut self, done: Done) {
        match done {
            Done::Fetched(key, result) => self.finished(&key, result),
            Done::Resolved(key, result) => {
                self.resolving.remove(&key);
                match result {
                    Ok(resolved) => {
                        tracing::info!(artifact = %key, digest = %resolved.pinned, layers = resolved.layers.len(), "resolved");
                        self.resolved.insert(key, resolved);
                    }
                    Err(err) => {
                        let e = self.entries.entry(key.clone()).or_insert_with(|| {
                            let model = key.rsplit_once('-').map_or(key.as_str(), |(m, _)| m);
                            Entry::new(model.to_owned(), 0, ArtifactState::Failed, None)
                        });
                        if e.state == ArtifactState::Fetching {
                            return;
                        }
                        e.failures += 1;
                        let delay = retry_delay(e.failures);
                        tracing::warn!(artifact = %key, error = %err, retry_in = ?delay, permanent = err.permanent(), "resolving failed");
                        e.state = ArtifactState::Failed;
                        e.reason = Some(err.reason().into());
                        e.message = Some(err.to_string());
                        e.permanent = err.permanent();
                        e.retry_at = (!e.permanent).then(|| Timestamp::now() + delay);
                        self.metrics
                            .fetches
                            .get_or_create(&ResultLabels {
                                result: err.reason(),
                            })
                            .inc();
                    }
                }
            }
        }
    }

    fn finished(&mut self, key: &str, result: Result<fetch::Fetched, fetch::FetchError>) {
        // A failed fetch removed its links; a finished one may have
        // replaced a stale copy; either way the disk changed.
        self.collect_due = true;
        self.disk_changed = true;
        let Some(e) = self.entries.get_mut(key) else {
            return;
        };
        let reached = e
            .progress
            .take()
            .map_or(0, |p| p.bytes.load(std::sync::atomic::Ordering::Relaxed));
        match result {
            Ok(fetched) => {
                tracing::info!(artifact = %key, bytes = fetched.bytes, resumed = fetched.resumed, sha256 = %fetched.sha256, "fetched");
                e.state = ArtifactState::Ready;
                e.bytes = fetched.bytes;
                e.sha256 = Some(fetched.sha256);
                e.blobs = fetched.blobs;
                e.digest = self.resolved.get(key).map(|r| r.pinned.clone());
                e.failures = 0;
                e.partial = false;
                e.permanent = false;
            }
            Err(err) => {
                e.failures += 1;
                let delay = retry_delay(e.failures);
                tracing::warn!(artifact = %key, error = %err, retry_in = ?delay, "fetch failed");
                e.state = ArtifactState::Failed;
                // What may pass keeps its part on disk for the next try.
                e.partial = err.retryable();
                e.bytes = if e.partial { reached } else { 0 };
                e.sha256 = None;
                // A manifest that changed under it (a digest mismatch, a
                // missing blob) is asked again at the next try.
                if !err.retryable() {
                    self.resolved.remove(key);
                }
                e.reason = Some(err.reason().into());
                e.message = Some(err.to_string());
                e.permanent = err.permanent();
                e.retry_at = (!e.permanent).then(|| Timestamp::now() + delay);
            }
        }
    }

    fn fetching(&self) -> bool {
        !self.resolving.is_empty()
            || self.entries.values().any(|e| {
                e.state == ArtifactState::Fetching
                    || (e.state == ArtifactState::Failed && e.retry_at.is_some())
            })
    }

    /// What counts against the budget: the blobs of what is on the disk,
    /// each once, and the declared sizes of what is being fetched to it.
    fn used(&self) -> u64 {
        let held = self.held(&HashMap::new(), &HashSet::new());
        unique_bytes(held.iter().map(|h| h.blobs.as_slice()))
    }

    /// What to publish; `used` is [`Self::used`].
    fn status(&self, used: u64) -> NodeModelCacheStatus {
        let mut keys: Vec<&String> = self.entries.keys().collect();
        keys.sort();
        let mut status = NodeModelCacheStatus::default();
        for key in keys {
            let e = &self.entries[key];
            let bytes = match &e.progress {
                Some(p) => p.bytes.load(std::sync::atomic::Ordering::Relaxed),
                None => e.bytes,
            };
            match e.state {
                ArtifactState::Ready => status.ready += 1,
                ArtifactState::Fetching => status.fetching += 1,
                _ => {}
            }
            status.artifacts.push(CachedArtifact {
                key: key.clone(),
                model: e.model.clone(),
                state: e.state,
                bytes,
                size: Some(format_bytes(e.size)),
                sha256: e.sha256.clone(),
                digest: e.digest.clone(),
                last_use: e.last_use.map(|t| t.to_string()),
                reason: e.reason.clone(),
                message: e.message.clone(),
                retry_at: e.retry_at.map(|t| t.to_string()),
            });
        }
        status.used = Some(format_bytes(used));
        let ready: Vec<&[Blob]> = self
            .entries
            .values()
            .filter(|e| e.state == ArtifactState::Ready)
            .map(|e| e.blobs.as_slice())
            .collect();
        let logical: u64 = ready.iter().flat_map(|b| b.iter()).map(|(_, n)| n).sum();
        status.deduplicated = Some(format_bytes(
            logical.saturating_sub(unique_bytes(ready.iter().copied())),
        ));
        status.on_disk = self.on_disk.map(format_bytes);
        let refused: Vec<&CachedArtifact> = status
            .artifacts
            .iter()
            .filter(|a| a.state == ArtifactState::Refused)
            .collect();
        let (value, reason, message) = match refused.first() {
            Some(a) => (
                "True",
                "RequiredArtifactRefused",
                a.message.clone().unwrap_or_default(),
            ),
            None => (
                "False",
                "Fits",
                "every required artifact fits the disk budget".to_owned(),
            ),
        };
        status.conditions.push(Condition {
            type_: "DiskFull".into(),
            status: value.into(),
            reason: reason.into(),
            message,
            last_transition_time: Time(Timestamp::now()),
            observed_generation: None,
        });
        status
    }
}

/// Credentials for one registry, and what to add to an authentication
/// failure (the Secret that should have had them is missing).
struct Auth {
    auth: oci_client::secrets::RegistryAuth,
    missing: Option<String>,
}

impl Auth {
    /// `e`, naming the missing Secret if the registry refused anonymous
    /// access.
    fn explain(&self, e: fetch::FetchError) -> fetch::FetchError {
        match (e, &self.missing) {
            (fetch::FetchError::RegistryAuth { registry, message }, Some(missing)) => {
                fetch::FetchError::RegistryAuth {
                    registry,
                    message: format!("{message} (tried anonymously: {missing})"),
                }
            }
            (e, _) => e,
        }
    }
}

/// The registry credentials for `registry`: from the agent's Secret, or
/// none (anonymous) without one. A Secret that does not exist is
/// anonymous access too: a registry that needs no credentials is not
/// failed by it (it was, every one of them).
async fn auth_for(
    secrets: Option<&Api<Secret>>,
    config: &AgentConfig,
    registry: &str,
) -> Result<Auth, fetch::FetchError> {
    let anonymous = |missing| Auth {
        auth: oci_client::secrets::RegistryAuth::Anonymous,
        missing,
    };
    let (Some(api), Some(name)) = (secrets, &config.registry.credentials) else {
        return Ok(anonymous(None));
    };
    let failed = |message: String| fetch::FetchError::RegistryAuth {
        registry: registry.to_owned(),
        message,
    };
    let ns = config.registry.namespace.as_deref().unwrap_or_default();
    let secret = match api.get_opt(name).await {
        Ok(Some(s)) => s,
        Ok(None) => {
            let missing = format!("the credentials Secret {ns}/{name} does not exist");
            tracing::warn!(registry, "{missing}; trying anonymously");
            return Ok(anonymous(Some(missing)));
        }
        Err(e) => {
            return Err(fetch::FetchError::Registry {
                registry: registry.to_owned(),
                message: format!("reading the credentials Secret {ns}/{name}: {e}"),
            });
        }
    };
    let config_json = secret
        .data
        .as_ref()
        .and_then(|d| d.get(".dockerconfigjson"))
        .ok_or_else(|| {
            failed(format!(
                "the Secret {ns}/{name} has no .dockerconfigjson (it must be of type kubernetes.io/dockerconfigjson)"
            ))
        })?;
    let auth = oci::credentials_for(&config_json.0, registry)
        .map_err(|e| failed(format!("the Secret {ns}/{name}: {e}")))?;
    Ok(Auth {
        auth,
        missing: None,
    })
}

/// Resolves an OCI source (after checking it is allowed).
async fn resolve(
    registry: &Registry,
    secrets: Option<&Api<Secret>>,
    config: &AgentConfig,
    text: &str,
    pinned: Option<String>,
) -> Result<Resolved, fetch::FetchError> {
    let mut source = oci::Source::parse(text)?;
    if let (None, Some(digest)) = (source.digest(), pinned) {
        source.reference = source.reference.clone_with_digest(digest);
    }
    if !source.is_allowed(&config.allowed_sources) {
        return Err(fetch::FetchError::NotAllowed {
            uri: text.to_owned(),
            allowed: config.allowed_sources.join(", "),
        });
    }
    let auth = auth_for(secrets, config, source.registry()).await?;
    let resolved = registry.resolve(&source, &auth.auth).await;
    resolved.map_err(|e| auth.explain(e))
}

/// Fetches an OCI artifact whose manifest was resolved (or resolves it
/// first: a download cut short, resumed after a restart).
async fn fetch_oci(
    registry: &Registry,
    secrets: Option<&Api<Secret>>,
    config: &AgentConfig,
    (key, text, layer_dir, size): (&str, &str, &str, u64),
    resolved: Option<Resolved>,
    progress: &Progress,
) -> Result<fetch::Fetched, fetch::FetchError> {
    let resolved = match resolved {
        Some(r) => r,
        None => resolve(registry, secrets, config, text, None).await?,
    };
    let source = oci::Source::parse(text)?;
    let auth = auth_for(secrets, config, source.registry()).await?;
    let pinned = source.reference.clone_with_digest(resolved.pinned.clone());
    let source = oci::Source {
        reference: pinned,
        text: source.text,
    };
    oci::fetch(
        registry,
        &auth.auth,
        &config.cache_dir,
        key,
        &source,
        &resolved,
        layer_dir,
        size,
        progress,
    )
    .await
    .map_err(|e| auth.explain(e))
}

/// Writes the node's `NodeModelCache` when its content changed (the
/// condition's transition time kept from the last write).
async fn publish(
    api: &Api<NodeModelCache>,
    config: &AgentConfig,
    mut status: NodeModelCacheStatus,
    last: &mut Option<NodeModelCacheStatus>,
) {
    if let Some(before) = last {
        for c in &mut status.conditions {
            if let Some(b) = before
                .conditions
                .iter()
                .find(|b| b.type_ == c.type_ && b.status == c.status)
            {
                c.last_transition_time = b.last_transition_time.clone();
            }
        }
        if *before == status {
            return;
        }
    }
    let object = |part: &str, value: serde_json::Value| {
        serde_json::json!({
            "apiVersion": "residency.dev/v1alpha1",
            "kind": "NodeModelCache",
            "metadata": {"name": config.node},
            part: value,
        })
    };
    let pp = PatchParams::apply(NODE_AGENT_MANAGER).force();
    let spec = NodeModelCacheSpec {
        budget: format_bytes(config.budget),
        cache_dir: config.cache_dir.display().to_string(),
    };
    // The object (created by the first apply), then its status subresource.
    let spec = serde_json::to_value(spec).expect("serializable");
    let result = match api
        .patch(&config.node, &pp, &Patch::Apply(object("spec", spec)))
        .await
    {
        Ok(_) => apply_status(api, &config.node, NODE_AGENT_MANAGER, &status).await,
        Err(e) => Err(e),
    };
    match result {
        Ok(_) => *last = Some(status),
        Err(e) => tracing::warn!(error = %e, "writing the NodeModelCache failed; retrying"),
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
        let residencies = residencies_of(&watches.named, &watches.placed);
        agent.step(&residencies, &watches.pods.state());
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

impl Agent {
    fn new(
        client: &kube::Client,
        config: &AgentConfig,
        done: mpsc::UnboundedSender<Done>,
        metrics: Arc<AgentMetrics>,
    ) -> Result<Agent, AgentError> {
        let secrets = match (&config.registry.credentials, &config.registry.namespace) {
            (Some(_), Some(ns)) => Some(Api::namespaced(client.clone(), ns)),
            _ => None,
        };
        let registry = Registry::new(
            config.registry.ca_pem.clone(),
            config.allowed_sources.clone(),
        )
        .map_err(AgentError::HttpClient)?;
        Ok(Agent {
            downloads: Arc::new(Semaphore::new(config.max_concurrent_downloads.max(1))),
            client: fetch::client().map_err(AgentError::HttpClient)?,
            registry,
            secrets,
            resolved: HashMap::new(),
            resolving: HashSet::new(),
            store: blobs::Store::new(&config.cache_dir),
            collect_due: true,
            layer_sizes: Default::default(),
            on_disk: None,
            disk_changed: true,
            config: config.clone(),
            entries: HashMap::new(),
            done,
            metrics,
        })
    }

    /// Last uses survive a restart through the node's object.
    async fn restore_last_uses(&mut self, caches: &Api<NodeModelCache>) {
        if let Ok(Some(previous)) = caches.get_opt(&self.config.node).await {
            for a in previous.status.iter().flat_map(|s| s.artifacts.iter()) {
                if let Some(e) = self.entries.get_mut(&a.key) {
                    e.last_use = recorded_time(a.last_use.as_deref());
                }
            }
        }
    }
}

/// What the agent watches of its node, each change a notification; the
/// watches stop when it is dropped.
struct NodeWatches {
    /// Residencies that name the node (`spec.nodeName`).
    named: Store<ModelResidency>,
    /// Residencies whose claim the scheduler allocated here (claim mode,
    /// no `spec.nodeName`; `status.gpu.node`).
    placed: Store<ModelResidency>,
    /// The model pods on the node: what they mount stays on the disk.
    pods: Store<Pod>,
    changed: Arc<Notify>,
    tasks: Vec<tokio::task::JoinHandle<()>>,
}

impl NodeWatches {
    /// Starts the watches and waits for their first lists. Only this
    /// node's objects, selected by the API server (the CRD declares
    /// spec.nodeName and status.gpu.node selectable): a node agent on each
    /// of a thousand nodes does not hold and re-list every residency.
    async fn start(client: kube::Client, node: &str) -> NodeWatches {
        let changed = Arc::new(Notify::new());
        let residencies = || Api::<ModelResidency>::all(client.clone());
        let (named, writer) = reflector::store();
        let by_name = watcher::Config::default().fields(&format!("spec.nodeName={node}"));
        let named_task = tokio::spawn(reflect(
            writer,
            residencies(),
            by_name,
            changed.clone(),
            "node agent's residency watch",
        ));
        let (placed, writer) = reflector::store();
        let by_claim = watcher::Config::default().fields(&format!("status.gpu.node={node}"));
        let placed_task = tokio::spawn(reflect(
            writer,
            residencies(),
            by_claim,
            changed.clone(),
            "node agent's allocated-residency watch",
        ));
        let (pods, writer) = reflector::store();
        let model_pods = watcher::Config::default()
            .fields(&format!("spec.nodeName={node}"))
            .labels(crate::residency::labels::MODEL_LABEL);
        let pod_task = tokio::spawn(reflect(
            writer,
            Api::<Pod>::all(client.clone()),
            model_pods,
            changed.clone(),
            "node agent's pod watch",
        ));
        let watches = NodeWatches {
            named,
            placed,
            pods,
            changed,
            tasks: vec![named_task, placed_task, pod_task],
        };
        let _ = watches.named.wait_until_ready().await;
        let _ = watches.placed.wait_until_ready().await;
        let _ = watches.pods.wait_until_ready().await;
        watches
    }
}

impl Drop for NodeWatches {
    fn drop(&mut self) {
        for task in &self.tasks {
            task.abort();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn residency(
        node: &str,
        prefetch: u32,
        resident: &[&str],
        requested: &[(&str, u64)],
    ) -> Arc<ModelResidency> {
        let models: Vec<_> = ["a", "b", "c", "plain"]
            .iter()
            .map(|m| {
                let mut v = json!({"name": m, "size": "1Gi"});
                if *m != "plain" {
                    v["artifact"] =
                        json!({"files": [{"uri": format!("http://h/{m}.bin")}], "size": "2Gi"});
                }
                v
            })
            .collect();
        let statuses: Vec<_> = requested
            .iter()
            .map(|(m, t)| {
                let state = if resident.contains(m) { "Loaded" } else { "Evicted" };
                json!({"name": m, "state": state, "size": "1Gi",
                       "lastRequested": Timestamp::from_second(1_700_000_000 + *t as i64).unwrap().to_string()})
            })
            .collect();
        Arc::new(
            serde_json::from_value(json!({
                "apiVersion": "residency.dev/v1alpha1", "kind": "ModelResidency",
                "metadata": {"name": "gpu", "namespace": "ns"},
                "spec": {"nodeName": node, "device": "0", "budget": "8Gi", "models": models, "prefetch": prefetch},
                "status": {"models": statuses},
            }))
            .unwrap(),
        )
    }

    #[test]
    fn resident_models_require_their_artifacts_and_recent_ones_are_prefetched() {
        let r = residency("n1", 1, &["a"], &[("a", 1), ("b", 5), ("c", 3)]);
        let other_node = residency("n2", 3, &["b"], &[("b", 9)]);
        let d = declared(&[r, other_node], "n1");
        let want = |m: &str| d.values().find(|x| x.model == m).map(|x| x.want);
        assert_eq!(want("a"), Some(Want::Required));
        assert_eq!(
            want("b"),
            Some(Want::Prefetch),
            "the most recent non-resident"
        );
        assert_eq!(want("c"), None, "beyond prefetch: 1");
        assert_eq!(want("plain"), None, "no artifact");
        assert!(d.values().all(|x| x.size == 2 << 30));
    }

    #[test]
    fn retries_back_off_to_five_minutes() {
        assert_eq!(retry_delay(1), Duration::from_secs(5));
        assert_eq!(retry_delay(2), Duration::from_secs(10));
        assert_eq!(retry_delay(30), Duration::from_secs(300));
    }
}
