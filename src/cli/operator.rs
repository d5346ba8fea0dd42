//! `model-residency run`: the controller process. Serves `/healthz`,
//! `/readyz` and `/metrics`, checks at start-up that it can do its job
//! (CRD installed, RBAC allows the watches), optionally elects a leader, and
//! stops cleanly on SIGTERM or Ctrl-C.

use super::Failure;
use k8s_openapi::api::core::v1::Pod;
use kube::api::{Api, ListParams};
use model_residency::api::ModelResidency;
use model_residency::controller::Context;
use model_residency::http::{Endpoints, serve};
use model_residency::operator::lease::{LeaderElector, LeaseConfig};
use std::net::SocketAddr;
use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::Duration;
use tokio::sync::watch;

#[derive(clap::Args, Debug)]
pub struct Args {
    /// Watch only this namespace (default: all namespaces).
    #[arg(long, env = "WATCH_NAMESPACE")]
    namespace: Option<String>,
    /// Address of /healthz, /readyz and /metrics.
    #[arg(long, env = "HTTP_ADDR", default_value = "0.0.0.0:8080")]
    http_addr: SocketAddr,
    #[command(flatten)]
    pub logging: Logging,
    /// Elect a leader among replicas through a Lease; only the leader writes.
    #[arg(long, env = "LEADER_ELECT")]
    leader_elect: bool,
    /// Namespace of the Lease (default: POD_NAMESPACE, else the kubeconfig's).
    #[arg(long, env = "POD_NAMESPACE")]
    lease_namespace: Option<String>,
    /// Name of the Lease.
    #[arg(long, default_value = "model-residency")]
    lease_name: String,
    /// This replica's identity in the Lease (default: POD_NAME, else the host name).
    #[arg(long, env = "POD_NAME")]
    identity: Option<String>,
    /// Seconds a Lease stays valid without renewal.
    #[arg(long, default_value_t = 15)]
    lease_seconds: u64,
    /// How far a request's time (spec.demand) may be ahead of this
    /// operator's clock and still count as written; a later time is taken
    /// as the moment the operator saw it (with a ClockSkew event).
    #[arg(long, env = "MAX_CLOCK_SKEW", default_value = "1m", value_parser = parse_duration)]
    max_clock_skew: std::time::Duration,
}

/// A duration as `90s`, `1m`, `1m30s` or `0s`, at most 100 years (longer
/// ones overflow the clocks they are added to: a deadline of
/// `now + 2^63 s` panics).
pub fn parse_duration(s: &str) -> Result<std::time::Duration, String> {
    const CENTURY: std::time::Duration = std::time::Duration::from_secs(100 * 365 * 24 * 3600);
    let d: k8s_openapi::jiff::SignedDuration = s
        .parse()
        .map_err(|e| format!("{s:?} is not a duration like 90s or 1m: {e}"))?;
    let d = std::time::Duration::try_from(d).map_err(|_| format!("{s:?} is negative"))?;
    if d > CENTURY {
        return Err(format!("{s:?} is longer than 100 years"));
    }
    Ok(d)
}

/// How a long-running subcommand (`run`, `route`, `node-agent`) logs.
#[derive(clap::Args, Clone, Copy, Debug)]
pub struct Logging {
    /// Log format.
    #[arg(long, env = "LOG_FORMAT", value_enum, default_value_t = LogFormat::Text)]
    log_format: LogFormat,
}

impl Logging {
    pub fn init(self) {
        use tracing_subscriber::EnvFilter;
        let filter = EnvFilter::try_from_default_env().unwrap_or_else(|_| EnvFilter::new("info"));
        let builder = tracing_subscriber::fmt()
            .with_env_filter(filter)
            .with_writer(std::io::stderr)
            .with_ansi(std::io::IsTerminal::is_terminal(&std::io::stderr()));
        match self.log_format {
            LogFormat::Text => builder.init(),
            LogFormat::Json => builder.json().init(),
        }
    }
}

#[derive(Clone, Copy, Debug, clap::ValueEnum)]
pub enum LogFormat {
    Text,
    Json,
}

pub(super) fn fatal(message: String) -> Failure {
    // Every subcommand fails through here: logged as the program's, not
    // as this module's (a node agent's error said `cli::operator`).
    tracing::error!(target: "model_residency", "{message}");
    Failure { message, code: 1 }
}

/// Fails fast, with the fix, when the CRD is missing or RBAC forbids what
/// a process must watch (`needs` says what it needs, for the message).
pub(super) async fn preflight(
    client: &kube::Client,
    namespace: Option<&str>,
    needs: &str,
) -> Result<(), Failure> {
    let (residencies, pods): (Api<ModelResidency>, Api<Pod>) = match namespace {
        Some(ns) => (
            Api::namespaced(client.clone(), ns),
            Api::namespaced(client.clone(), ns),
        ),
        None => (Api::all(client.clone()), Api::all(client.clone())),
    };
    let lp = ListParams::default().limit(1);
    let forbidden = |what: &str, message: &str| {
        fatal(format!("RBAC forbids listing {what}: {message}. {needs}"))
    };
    match residencies.list_metadata(&lp).await {
        Ok(_) => {}
        Err(kube::Error::Api(s)) if s.code == 404 => {
            return Err(fatal(
                "the ModelResidency CRD is not installed: run `model-residency crd | kubectl apply -f -` \
                 (or install the Helm chart, which carries it)"
                    .into(),
            ));
        }
        Err(kube::Error::Api(s)) if s.code == 403 => {
            return Err(forbidden("modelresidencies.residency.dev", &s.message));
        }
        Err(e) => return Err(fatal(format!("cannot reach the cluster: {e}"))),
    }
    match pods.list_metadata(&lp).await {
        Ok(_) => Ok(()),
        Err(kube::Error::Api(s)) if s.code == 403 => Err(forbidden("pods", &s.message)),
        Err(e) => Err(fatal(format!("cannot list pods: {e}"))),
    }
}

/// The in-cluster or kubeconfig client of a long-running process, or a
/// logged, fatal failure.
pub(super) async fn cluster_client() -> Result<kube::Client, Failure> {
    kube::Client::try_default().await.map_err(|e| {
        fatal(format!(
            "cannot load a kubeconfig or in-cluster config: {e}"
        ))
    })
}

/// Completes on SIGTERM or Ctrl-C.
pub(super) async fn termination() {
    let mut term = tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate()).ok();
    tokio::select! {
        _ = tokio::signal::ctrl_c() => {}
        _ = async {
            match term.as_mut() {
                Some(t) => { t.recv().await; }
                None => std::future::pending::<()>().await,
            }
        } => {}
    }
}

pub async fn run(args: Args) -> Result<(), Failure> {
    let client = cluster_client().await?;
    preflight(
        &client,
        args.namespace.as_deref(),
        "The controller needs list/watch on modelresidencies and pods, patch on \
         modelresidencies/status, create/delete on pods (the chart's ClusterRole grants them)",
    )
    .await?;

    let metrics = Arc::new(model_residency::metrics::Metrics::default());
    let endpoints = Arc::new(Endpoints::new({
        let metrics = metrics.clone();
        move || metrics.encode()
    }));
    let listener = tokio::net::TcpListener::bind(args.http_addr)
        .await
        .map_err(|e| fatal(format!("cannot listen on {}: {e}", args.http_addr)))?;
    tracing::info!(addr = %args.http_addr, "serving /healthz, /readyz, /metrics");
    let http = tokio::spawn(serve(listener, endpoints.clone()));

    // Shutdown fans out to whatever is running.
    let (stop_tx, stop_rx) = watch::channel(false);
    tokio::spawn(async move {
        termination().await;
        tracing::info!("shutting down");
        let _ = stop_tx.send(true);
    });
    let stopped = |mut rx: watch::Receiver<bool>| async move {
        let _ = rx.wait_for(|s| *s).await;
    };

    let ctx = Context::with_options(client.clone(), metrics, args.max_clock_skew);
    let synced = Arc::new(std::sync::atomic::AtomicBool::new(false));
    if !args.leader_elect {
        let watcher = spawn_ready_mirror(synced.clone(), endpoints.clone());
        model_residency::operator::run(ctx, args.namespace.clone(), stopped(stop_rx), synced).await;
        watcher.abort();
        http.abort();
        return Ok(());
    }

    let identity = args.identity.clone().unwrap_or_else(|| {
        std::fs::read_to_string("/proc/sys/kernel/hostname")
            .map(|h| h.trim().to_owned())
            .unwrap_or_else(|_| format!("model-residency-{}", std::process::id()))
    });
    let lease_ns = args
        .lease_namespace
        .clone()
        .unwrap_or_else(|| client.default_namespace().to_owned());
    let elector = LeaderElector::new(
        client.clone(),
        LeaseConfig::new(
            &lease_ns,
            &args.lease_name,
            &identity,
            Duration::from_secs(args.lease_seconds),
        ),
    );
    // A standby is healthy and ready to take over.
    endpoints.ready.store(true, Ordering::Relaxed);
    model_residency::operator::run_elected(
        ctx,
        args.namespace.clone(),
        elector,
        stop_rx,
        synced,
        Arc::default(),
    )
    .await;
    http.abort();
    Ok(())
}

/// Mirrors the controller's first sync into `/readyz`.
fn spawn_ready_mirror(
    synced: Arc<std::sync::atomic::AtomicBool>,
    endpoints: Arc<Endpoints>,
) -> tokio::task::JoinHandle<()> {
    tokio::spawn(async move {
        while !synced.load(Ordering::Relaxed) {
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
        endpoints.ready.store(true, Ordering::Relaxed);
    })
}

#[cfg(test)]
mod tests {
    use super::parse_duration;
    use std::time::Duration;

    #[test]
    fn durations_read_as_people_write_them() {
        assert_eq!(parse_duration("90s"), Ok(Duration::from_secs(90)));
        assert_eq!(parse_duration("1m"), Ok(Duration::from_secs(60)));
        assert_eq!(parse_duration("1m30s"), Ok(Duration::from_secs(90)));
        assert_eq!(parse_duration("0s"), Ok(Duration::ZERO));
        assert!(parse_duration("soon").is_err());
        assert!(parse_duration("-5s").is_err());
        assert_eq!(
            parse_duration("9223372036854775807s"),
            Err("\"9223372036854775807s\" is longer than 100 years".into())
        );
        assert!(parse_duration("876000h").is_ok());
    }
}
