//! Publishing: the NodeModelCache's spec and status, applied by the agent,
//! its only writer.

use super::*;

/// Writes the node's `NodeModelCache` when its content changed (the
/// condition's transition time kept from the last write).
pub(super) async fn publish(
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

impl super::Agent {
    pub(super) fn fetching(&self) -> bool {
        !self.resolving.is_empty()
            || self.entries.values().any(|e| {
                e.state == ArtifactState::Fetching
                    || (e.state == ArtifactState::Failed && e.retry_at.is_some())
            })
    }

    /// What counts against the budget: the blobs of what is on the disk,
    /// each once, and the declared sizes of what is being fetched to it.
    pub(super) fn used(&self) -> u64 {
        let held = self.held(&HashMap::new(), &HashSet::new());
        unique_bytes(held.iter().map(|h| h.blobs.as_slice()))
    }

    /// What to publish; `used` is [`Self::used`].
    pub(super) fn status(&self, used: u64) -> NodeModelCacheStatus {
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
