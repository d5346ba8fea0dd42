//! `model-residency node-agent`: keeps model artifacts on this node's disk
//! within a budget (see `model_residency::node_agent`). Serves `/healthz`,
//! `/readyz` and `/metrics` (`node_agent::metrics`); stops on SIGTERM or
//! Ctrl-C (a download in flight is cut short; the next start resumes it if
//! it is still wanted, and removes it if not).

use super::Failure;
use super::process::{Logging, Threads, cluster_client, fatal, preflight, termination};
use model_residency::http::{Readiness, serve_admin};
use model_residency::node_agent::agent::{AgentConfig, RegistryConfig, run as run_agent};
use model_residency::node_agent::fetch;
use model_residency::node_agent::metrics::AgentMetrics;
use model_residency::quantity::parse_bytes;
use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::Arc;

#[derive(clap::Args, Debug)]
pub struct Args {
    /// This node's name (the chart passes spec.nodeName).
    #[arg(long, env = "NODE_NAME")]
    node: String,
    /// Where artifacts live on the node (a hostPath in the chart).
    #[arg(long, env = "CACHE_DIR", default_value = "/var/cache/model-residency")]
    cache_dir: PathBuf,
    /// The most the artifacts may declare together on this node.
    #[arg(long, env = "DISK_BUDGET")]
    disk_budget: String,
    /// Sources artifacts may be fetched from, comma-separated http(s) URIs
    /// (e.g. `https://models.example.com/,http://minio.models:9000/`): a
    /// file's URI must have a source's scheme, host and port and a path
    /// under its path. Registries are `oci://<host>[:port]/<repository
    /// prefix>` (e.g. `oci://registry.example.com/models`): an `oci://`
    /// source's registry must be the same and its repository under the
    /// prefix. None by default: every source is refused, so a tenant's
    /// ModelResidency cannot make nodes fetch arbitrary addresses.
    #[arg(long, env = "ALLOWED_SOURCES", value_delimiter = ',')]
    allowed_sources: Vec<String>,
    /// A `kubernetes.io/dockerconfigjson` Secret in the agent's own
    /// namespace (--namespace) with the credentials of the registries
    /// `oci://` artifacts come from (basic auth, or a bearer token as
    /// `registrytoken`). Read at each resolve; nothing else of Secrets is
    /// read.
    #[arg(long, env = "REGISTRY_CREDENTIALS")]
    registry_credentials: Option<String>,
    /// The agent's namespace (the chart passes metadata.namespace).
    #[arg(long, env = "POD_NAMESPACE")]
    namespace: Option<String>,
    /// PEM CA certificates to trust for registries (beside the system's),
    /// for registries with private certificates.
    #[arg(long, env = "REGISTRY_CA_FILE")]
    registry_ca_file: Option<PathBuf>,
    /// Downloads at once.
    #[arg(long, env = "MAX_CONCURRENT_DOWNLOADS", default_value_t = 2)]
    max_concurrent_downloads: usize,
    /// Address of /healthz, /readyz and /metrics.
    #[arg(long, env = "HTTP_ADDR", default_value = "0.0.0.0:8081")]
    http_addr: SocketAddr,
    #[command(flatten)]
    pub logging: Logging,
    #[command(flatten)]
    pub threads: Threads,
}

pub async fn run(args: Args) -> Result<(), Failure> {
    let budget = parse_bytes(&args.disk_budget)
        .map_err(|e| Failure::bad_input(format!("--disk-budget: {e}")))?;
    if budget == 0 {
        return Err(Failure::bad_input(
            "--disk-budget: 0 would refuse every artifact (DiskFull); give the room the node has for them",
        ));
    }
    if args.allowed_sources.iter().any(|s| s.trim().is_empty()) {
        return Err(Failure::bad_input(
            "--allowed-sources: an empty prefix would allow every source",
        ));
    }
    // A prefix allows a scheme, host and port and a path under it; one that
    // names no host would silently allow nothing.
    if let Some(bad) = args.allowed_sources.iter().find(|s| {
        let as_http = s
            .strip_prefix("oci://")
            .map(|rest| format!("https://{rest}"));
        fetch::source_prefix(as_http.as_deref().unwrap_or(s)).is_none()
    }) {
        return Err(Failure::bad_input(format!(
            "--allowed-sources: {bad:?} is not an http(s) URI with a host (like https://models.example.com/) nor an oci:// registry (like oci://registry.example.com/models)"
        )));
    }
    if args.registry_credentials.is_some() && args.namespace.is_none() {
        return Err(Failure::bad_input(
            "--registry-credentials names a Secret in the agent's namespace: give --namespace (POD_NAMESPACE)",
        ));
    }
    let ca_pem = match &args.registry_ca_file {
        Some(path) => Some(std::fs::read(path).map_err(|e| {
            Failure::bad_input(format!("--registry-ca-file {}: {e}", path.display()))
        })?),
        None => None,
    };
    let client = cluster_client().await?;
    preflight(
        &client,
        None,
        "The node agent needs list/watch on modelresidencies and pods in all namespaces, and \
         get/create/patch on nodemodelcaches and their status (the chart's node-agent ClusterRole \
         grants them)",
    )
    .await?;
    let metrics = Arc::new(AgentMetrics::default());
    let ready = Readiness::default();
    let http = serve_admin(args.http_addr, ready.clone(), {
        let metrics = metrics.clone();
        move || metrics.encode()
    })
    .await
    .map_err(|e| fatal(format!("cannot listen on {}: {e}", args.http_addr)))?;
    if args.allowed_sources.is_empty() {
        tracing::warn!("--allowed-sources is empty: every artifact source is refused");
    }
    let config = AgentConfig {
        node: args.node,
        cache_dir: args.cache_dir,
        budget,
        allowed_sources: args.allowed_sources,
        max_concurrent_downloads: args.max_concurrent_downloads,
        registry: RegistryConfig {
            credentials: args.registry_credentials,
            namespace: args.namespace,
            ca_pem,
        },
    };
    tracing::info!(?config, "keeping model artifacts on this node");
    let result = run_agent(client, config, ready, metrics, termination()).await;
    http.abort();
    result.map_err(|e| fatal(e.to_string()))
}
