//! What the agent watches: the residencies that name its node or whose
//! GPU is placed there, the node's model pods, its own NodeModelCache;
//! each change a notification. And the agent's start: its state restored
//! from the NodeModelCache and the disk.

use super::*;

impl Agent {
    pub(super) fn new(
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
            client: fetch::client(&config.allowed_sources).map_err(AgentError::HttpClient)?,
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
    pub(super) async fn restore_last_uses(&mut self, caches: &Api<NodeModelCache>) {
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
pub(super) struct NodeWatches {
    /// Residencies that name the node (`spec.nodeName`).
    pub(super) named: Store<ModelResidency>,
    /// Residencies whose claim the scheduler allocated here (claim mode,
    /// no `spec.nodeName`; `status.gpu.node`).
    pub(super) placed: Store<ModelResidency>,
    /// The model pods on the node: what they mount stays on the disk.
    pub(super) pods: Store<Pod>,
    /// The ModelCatalogs the residencies name.
    pub(super) catalogs: Arc<Catalogs>,
    pub(super) changed: Arc<Notify>,
    pub(super) tasks: Vec<tokio::task::JoinHandle<()>>,
}

impl NodeWatches {
    /// Starts the watches and waits for their first lists. Only this
    /// node's objects, selected by the API server (the CRD declares
    /// spec.nodeName and status.gpu.node selectable): a node agent on each
    /// of a thousand nodes does not hold and re-list every residency.
    pub(super) async fn start(client: kube::Client, node: &str) -> NodeWatches {
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
        let mut tasks = vec![named_task, placed_task, pod_task];
        // The catalogs residencies name (all namespaces, as the
        // residencies), where the cluster serves them.
        let catalogs = Arc::new(Catalogs::default());
        let catalog_api = Api::<ModelCatalog>::all(client.clone());
        if catalog_api
            .list_metadata(&kube::api::ListParams::default().limit(1))
            .await
            .is_ok()
        {
            let (store, writer) = reflector::store();
            catalogs.set(store);
            tasks.push(tokio::spawn(reflect(
                writer,
                catalog_api,
                watcher::Config::default(),
                changed.clone(),
                "node agent's catalog watch",
            )));
        }
        let watches = NodeWatches {
            named,
            placed,
            pods,
            catalogs,
            changed,
            tasks,
        };
        let _ = watches.named.wait_until_ready().await;
        let _ = watches.placed.wait_until_ready().await;
        let _ = watches.pods.wait_until_ready().await;
        watches.catalogs.wait_ready().await;
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
