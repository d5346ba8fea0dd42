//! The executor: fetches started (http or OCI, with the registry's
//! credentials) and their ends taken in, evictions, partial downloads
//! dropped, retries with backoff, refusals and waits marked.

use super::*;

pub(super) fn retry_delay(failures: u32) -> Duration {
    Duration::from_secs(
        5u64.saturating_mul(1 << failures.saturating_sub(1).min(6))
            .min(300),
    )
}

/// What a task the agent started reports back.
pub(super) enum Done {
    Fetched(String, Result<fetch::Fetched, fetch::FetchError>),
    Resolved(String, Result<Resolved, fetch::FetchError>),
}

/// Credentials for one registry, and what to add to an authentication
/// failure (the Secret that should have had them is missing).
pub(super) struct Auth {
    pub(super) auth: oci_client::secrets::RegistryAuth,
    pub(super) missing: Option<String>,
}

impl Auth {
    /// `e`, naming the missing Secret if the registry refused anonymous
    /// access.
    pub(super) fn explain(&self, e: fetch::FetchError) -> fetch::FetchError {
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
pub(super) async fn auth_for(
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
pub(super) async fn resolve(
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
pub(super) async fn fetch_oci(
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

impl super::Agent {
    /// Removes the download of `key` that was cut short, if any.
    pub(super) fn drop_partial(&mut self, key: &str) {
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

    /// Starts resolving the manifests of wanted OCI artifacts not resolved
    /// yet (nor on disk, nor failed and waiting for their retry).
    pub(super) fn resolve_unknown(&mut self, wanted: &HashMap<String, Declared>, now: Timestamp) {
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
    pub(super) fn collect_garbage(&mut self, wanted: &HashMap<String, Declared>) {
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

    /// Removes the plan's victims from disk (never one being fetched).
    pub(super) fn evict(&mut self, keys: &[String]) {
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
    pub(super) fn start_fetch(&mut self, key: &str, d: &Declared, now: Timestamp) {
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
    pub(super) fn mark_refused_and_waiting(
        &mut self,
        wanted: &HashMap<String, Declared>,
        plan: &keep::Plan,
    ) {
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
    pub(super) fn forget_unwanted(
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

    pub(super) fn done(&mut self, done: Done) {
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

    pub(super) fn finished(
        &mut self,
        key: &str,
        result: Result<fetch::Fetched, fetch::FetchError>,
    ) {
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
}
