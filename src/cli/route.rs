//! `model-residency route`: the request router process (see
//! `model_residency::router`). Serves the model API, `/healthz`, `/readyz`
//! and `/metrics` on one address; stops on SIGTERM or Ctrl-C after the
//! requests in flight have finished (up to `--shutdown-grace`).

use super::Failure;
use super::process::{Logging, cluster_client, fatal, parse_duration, preflight, termination};
use model_residency::router::workers::Workers;
use model_residency::router::{Config, Router};
use std::net::SocketAddr;
use std::time::Duration;

#[derive(clap::Args, Debug)]
pub struct Args {
    /// Serve only ModelResidencies (and their pods) in this namespace
    /// (default: all namespaces).
    #[arg(long, env = "WATCH_NAMESPACE")]
    namespace: Option<String>,
    /// Serve only ModelResidencies matching this label selector
    /// (e.g. `tier=gpu`).
    #[arg(long, short = 'l', env = "RESIDENCY_SELECTOR")]
    selector: Option<String>,
    /// Address of the model API and of /healthz, /readyz, /metrics.
    #[arg(long, env = "HTTP_ADDR", default_value = "0.0.0.0:8080")]
    http_addr: SocketAddr,
    /// A hit refreshes its model's recency (writes spec.demand) at most this
    /// often; `0s` writes every hit (the seed's exact LRU and counters).
    #[arg(long, env = "RECENCY_RESOLUTION", default_value = "5s", value_parser = parse_duration)]
    recency_resolution: Duration,
    /// The longest a request waits for its model to load (then 503).
    #[arg(long, env = "LOAD_TIMEOUT", default_value = "10m", value_parser = parse_duration)]
    load_timeout: Duration,
    /// Requests that may wait for one model to load (then 429).
    #[arg(long, env = "MAX_PENDING", default_value_t = 256)]
    max_pending: usize,
    /// Requests that may wait for loads in all (then 429).
    #[arg(long, env = "MAX_PENDING_TOTAL", default_value_t = 4096)]
    max_pending_total: usize,
    /// The largest request body, in bytes (then 400).
    #[arg(long, env = "MAX_BODY", default_value_t = 32 << 20)]
    max_body: usize,
    /// The request bodies held at once, in bytes, all requests together
    /// (then 429 with Retry-After and the connection closed): bodies are
    /// read whole and held through a load. Keep it well under the router's
    /// memory limit (the chart's 256Mi: 96 MiB).
    #[arg(long, env = "MAX_BUFFERED_BYTES", default_value_t = 96 << 20)]
    max_buffered_bytes: usize,
    /// An exact path forwarded besides the inference APIs (repeatable), for
    /// model servers with APIs of their own: GET or POST, the model in the
    /// X-Model header. Everything else is a 404 (405 for a wrong method):
    /// model servers' control endpoints (/sleep, /wake_up, /collective_rpc,
    /// ...) are never forwarded.
    #[arg(long, env = "FORWARD_PATHS", value_delimiter = ',')]
    forward_path: Vec<String>,
    /// The longest a request's body may pause between two reads (then 408
    /// and the connection is closed).
    #[arg(long, env = "BODY_TIMEOUT", default_value = "60s", value_parser = parse_duration)]
    body_timeout: Duration,
    /// The longest a request's whole body may take to arrive, however
    /// steadily it comes (then 408 and the connection is closed).
    #[arg(long, env = "BODY_DEADLINE", default_value = "5m", value_parser = parse_duration)]
    body_deadline: Duration,
    /// Which Ready copy of a model gets a request: `least-in-flight` (the
    /// fewest requests this router proxies to it now), or `prefix-hash`
    /// (the same prompt prefix to the same copy, for KV-cache reuse, within
    /// 1.25x the mean load; docs/serving.md).
    #[arg(long, env = "BALANCE", value_enum, default_value_t = model_residency::router::balance::Strategy::LeastInFlight)]
    balance: model_residency::router::balance::Strategy,
    /// Serving threads, each with its own runtime, listener (SO_REUSEPORT on
    /// --http-addr) and connections to model pods (default: the cores this
    /// process may use).
    #[arg(long, env = "ROUTER_WORKERS", value_parser = clap::value_parser!(u16).range(1..))]
    workers: Option<u16>,
    /// How often a request that asked to stream ("stream": true) for a
    /// model with no Ready pod hears an SSE comment while the router holds
    /// it through the load (answered at once, 200 text/event-stream): many
    /// clients and proxies drop a connection idle for 30-60 s. 0s: held
    /// silently.
    #[arg(long, env = "STREAM_KEEPALIVE", default_value = "10s", value_parser = parse_duration)]
    stream_keepalive: Duration,
    /// On SIGTERM, how long requests in flight may take to finish.
    #[arg(long, default_value = "25s", value_parser = parse_duration)]
    shutdown_grace: Duration,
    #[command(flatten)]
    pub logging: Logging,
}

pub async fn run(args: Args) -> Result<(), Failure> {
    if args.body_timeout.is_zero() {
        return Err(Failure::bad_input(
            "--body-timeout: 0s would refuse every request whose body comes in more than one read",
        ));
    }
    if args.body_deadline.is_zero() {
        return Err(Failure::bad_input(
            "--body-deadline: 0s would refuse every request that has a body",
        ));
    }
    for path in &args.forward_path {
        model_residency::router::target::check_forward_path(path).map_err(fatal)?;
    }
    let client = cluster_client().await?;
    preflight(
        &client,
        args.namespace.as_deref(),
        "The router needs list/watch on modelresidencies and pods, and patch on \
         modelresidencies (the chart's router ClusterRole grants exactly that)",
    )
    .await?;
    let config = Config {
        namespace: args.namespace,
        selector: args.selector,
        recency_resolution: args.recency_resolution,
        load_timeout: args.load_timeout,
        max_pending: args.max_pending,
        max_pending_total: args.max_pending_total,
        max_body: args.max_body,
        body_timeout: args.body_timeout,
        body_deadline: args.body_deadline,
        balance: args.balance,
        max_buffered: args.max_buffered_bytes,
        forward_paths: args.forward_path,
        adapter_affinity: true,
        stream_keepalive: args.stream_keepalive,
    };
    let workers = match args.workers {
        Some(n) => usize::from(n),
        None => std::thread::available_parallelism().map_or(1, |n| n.get()),
    };
    let router = Router::start(client, config);
    let serving = Workers::start(args.http_addr, workers, {
        let router = router.clone();
        move |listener| router.clone().serve(listener)
    })
    .map_err(|e| fatal(format!("cannot listen on {}: {e}", args.http_addr)))?;
    tracing::info!(addr = %serving.addr, workers, config = ?router.config(), "routing model requests");
    termination().await;
    tracing::info!("shutting down: no new connections; finishing the requests in flight");
    serving.stop_accepting();
    router.drain(args.shutdown_grace).await;
    tokio::task::spawn_blocking(move || serving.stop())
        .await
        .map_err(|e| fatal(format!("stopping the router's workers: {e}")))?;
    Ok(())
}
