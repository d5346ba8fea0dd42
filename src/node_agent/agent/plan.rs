//! Plan: which artifacts the node's residencies declare, which the node's
//! pods mount, and what the disk should hold ([`crate::node_agent::keep::plan`]).

use super::*;
use crate::api::{ArtifactSpec, ModelSpec};

/// An artifact some residency on the node declares.
#[derive(Debug, Clone)]
pub(super) struct Declared {
    pub(super) model: String,
    pub(super) origin: Origin,
    pub(super) size: u64,
    pub(super) want: Want,
    pub(super) pinned: bool,
    pub(super) requested: Option<Timestamp>,
}

/// The residencies of both watches, each once (one that names the node
/// and was allocated there is in both), each with its catalog's models.
pub(super) fn residencies_of(
    named: &Store<ModelResidency>,
    placed: &Store<ModelResidency>,
    catalogs: &Catalogs,
) -> Result<Vec<Arc<ModelResidency>>, CatalogProblem> {
    let mut all = named.state();
    let uids: HashSet<Option<String>> = all.iter().map(|r| r.metadata.uid.clone()).collect();
    all.extend(
        placed
            .state()
            .into_iter()
            .filter(|r| !uids.contains(&r.metadata.uid)),
    );
    all.into_iter().map(|r| catalogs.resolve(r)).collect()
}

/// What the residencies on `node` want on its disk, by cache key.
pub(super) fn declared(
    residencies: &[Arc<ModelResidency>],
    node: &str,
) -> HashMap<String, Declared> {
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
            // A resident model's adapters' files: its pod waits for them.
            if state_of(&m.name).is_some_and(|s| s.is_resident()) {
                for (key, d) in adapter_artifacts(m) {
                    add(key, d);
                }
            }
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
            let d = Declared {
                model: m.name.clone(),
                origin: origin(artifact),
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

/// Where an artifact's files come from.
fn origin(artifact: &ArtifactSpec) -> Origin {
    match &artifact.source {
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
    }
}

/// The files of `m`'s LoRA adapters, keyed in the cache by the adapter's
/// name (unique among a residency's models and adapters): required, as
/// the model's pod waits for them.
fn adapter_artifacts(m: &ModelSpec) -> impl Iterator<Item = (String, Declared)> + '_ {
    m.lora.iter().flat_map(|l| &l.adapters).filter_map(|a| {
        let artifact = a.artifact()?;
        let size = parse_bytes(&artifact.size.0).ok()?;
        let d = Declared {
            model: a.name.clone(),
            origin: origin(&artifact),
            size,
            want: Want::Required,
            pinned: false,
            requested: None,
        };
        Some((artifact.cache_key(&a.name), d))
    })
}

/// Every artifact key the registries on `node` declare (their adapters'
/// included).
pub(super) fn registry_keys(
    residencies: &[Arc<ModelResidency>],
    node: &str,
) -> std::collections::HashSet<String> {
    residencies
        .iter()
        .filter(|r| node_of(r) == Some(node))
        .flat_map(|r| r.spec.models.iter())
        .flat_map(|m| {
            let adapters = adapter_artifacts(m).map(|(key, _)| key);
            m.artifact
                .as_ref()
                .map(|a| a.cache_key(&m.name))
                .into_iter()
                .chain(adapters)
        })
        .collect()
}

/// The artifacts that pods on the node mount (by cache key): a model pod
/// mounts its artifact's directory, `<cacheDir>/<key>`, as a hostPath. A
/// pod counts until it is gone, terminating included; one that has
/// finished (Succeeded or Failed) runs nothing.
pub(super) fn mounted(pods: &[Arc<Pod>], cache_dir: &Path) -> HashSet<String> {
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

impl super::Agent {
    /// Artifacts already on disk (a restart): Ready at their size on disk;
    /// and downloads a previous run left cut short, due for a try now (the
    /// first pass resumes the ones still wanted and removes the others).
    pub(super) fn scan(&mut self) -> std::io::Result<()> {
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

    /// The blobs of `d` known by digest (those a shared store may hold),
    /// with the sizes they take on disk.
    pub(super) fn known_blobs(&self, key: &str, d: &Declared) -> Vec<Blob> {
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
    pub(super) fn layer_size(&self, hex: &str) -> Option<u64> {
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
    pub(super) fn refresh_on_disk(&mut self) {
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
    pub(super) fn planned_blobs(&self, key: &str, d: &Declared) -> Vec<Blob> {
        let mut blobs = self.known_blobs(key, d);
        let known: u64 = blobs.iter().map(|(_, n)| n).sum();
        blobs.push(rest_blob(key, d.size.saturating_sub(known)));
        blobs
    }

    /// The pass's plan (pure, [`keep::plan`]) from what is wanted, what the
    /// node holds and what its pods mount; wanted artifacts' sizes and last
    /// uses are brought up to date first.
    pub(super) fn plan(
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
    pub(super) fn held(
        &self,
        wanted: &HashMap<String, Declared>,
        in_use: &HashSet<String>,
    ) -> Vec<Held> {
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
}
