//! `model-residency run`: the controller process. Serves `/healthz`,
//! `/readyz` and `/metrics`, checks at start-up that it can do its job
//! (CRD installed, RBAC allows the watches), optionally elects a leader, and
//! stops cleanly on SIGTERM or Ctrl-C.

use super::Failure;
use super::process::{
    Logging, Threads, cluster_client, fatal, parse_duration, preflight, termination,
};
use model_residency::api::EndpointPickerRef;
use model_residency::controller::Context;
use model_residency::controller::copies::routes::RouteConfig;
use model_residency::controller::copies::{CopiesConfig, PoolConfig};
use model_residency::engine::copies::CopyPolicy;
use model_residency::http::{Readiness, serve_admin};
use model_residency::operator::lease::{LeaderElector, LeaseConfig};
use std::net::SocketAddr;
use std::sync::Arc;
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
    #[command(flatten)]
    pub threads: Threads,
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
    /// The longest one sleep, wake or status request to a model pod may
    /// take, whatever the model's spec says (a tenant's `timeout` is capped
    /// by it). The requests run beside the reconciles, never in their
    /// slots, but a server that never answers holds its residency's
    /// decisions until then.
    #[arg(long, env = "POD_CALL_TIMEOUT_MAX", default_value = "2m", value_parser = parse_duration)]
    pod_call_timeout_max: std::time::Duration,
    /// How often each Loaded model that can sleep (spec.models[].sleep with
    /// a status request: vLLM's /is_sleeping) is asked whether it sleeps;
    /// one found asleep behind the operator's back is woken, with a
    /// FoundAsleep event; and each Loaded model with LoRA adapters is asked
    /// which it holds (GET /v1/models), into status.models[].adapters.
    /// 0s: never.
    #[arg(long, env = "SLEEP_AUDIT_INTERVAL", default_value = "30s", value_parser = parse_duration)]
    sleep_audit_interval: std::time::Duration,
    /// How the watches get their initial state: stream (a streaming list,
    /// less memory at a restart) or list (for API servers with the
    /// WatchList feature off).
    #[arg(long, env = "INITIAL_LIST", value_enum, default_value_t)]
    initial_list: model_residency::cluster::InitialList,
    /// The image of the GPU holder pods (claim mode: one per residency,
    /// keeping its ResourceClaim allocated between loads; docs/gpu.md).
    #[arg(long, env = "GPU_HOLDER_IMAGE", default_value = model_residency::controller::gpu::objects::DEFAULT_HOLDER_IMAGE)]
    gpu_holder_image: String,
    /// Keep the forecasts of the residencies with spec.anticipate on in a
    /// ConfigMap beside each (`<residency>-forecasts`, owned by it), so a
    /// restarted operator or a new leader reads back what was learnt
    /// (needs ConfigMaps get, create and patch). Off: they are kept in
    /// memory only and learnt afresh after a restart.
    #[arg(long, env = "PERSIST_FORECASTS")]
    persist_forecasts: bool,
    #[command(flatten)]
    copies: CopiesArgs,
}

/// Copies of a model across its GPUs under load (docs/serving.md): off
/// unless the routers are named, since their summed in-flight counts are
/// the signal.
#[derive(clap::Args, Debug)]
struct CopiesArgs {
    /// A router's address whose /metrics is read (repeatable; or
    /// comma-separated in ROUTER_METRICS).
    #[arg(long = "router-metrics", env = "ROUTER_METRICS", value_delimiter = ',')]
    router_metrics: Vec<std::net::SocketAddr>,
    /// A label selector of the router pods: each one's podIP:--router-port
    /// /metrics is read (the chart sets it).
    #[arg(long, env = "ROUTER_SELECTOR")]
    router_selector: Option<String>,
    /// The router pods' namespace: required with --router-selector (any
    /// tenant's pod carrying the labels would otherwise feed the copy
    /// signal).
    #[arg(long, env = "ROUTER_NAMESPACE")]
    router_namespace: Option<String>,
    /// The router pods' port.
    #[arg(long, env = "ROUTER_PORT", default_value_t = 8080)]
    router_port: u16,
    /// How often the counts are read and copies decided.
    #[arg(long, default_value = "5s", value_parser = parse_duration)]
    copies_tick: std::time::Duration,
    /// The window the in-flight counts are averaged over.
    #[arg(long, default_value = "30s", value_parser = parse_duration)]
    copies_window: std::time::Duration,
    /// Requests in flight one copy should carry, for models whose
    /// copies.targetInFlight is unset.
    #[arg(long, default_value_t = 100)]
    copies_target_in_flight: u32,
    /// Time between two removals of a model's copies, and from an addition
    /// to a removal, for models whose copies.scaleDownDelay is unset.
    #[arg(long, default_value = "2m", value_parser = parse_duration)]
    copies_scale_down_delay: std::time::Duration,
    /// How long a copy is out of the routers before it is retired (put to
    /// sleep when it can, else unloaded).
    #[arg(long, default_value = "2s", value_parser = parse_duration)]
    copies_drain_grace: std::time::Duration,
    /// Keep one InferencePool (inference.networking.k8s.io/v1, the Gateway
    /// API Inference Extension's CRD) per model and namespace, selecting
    /// the model's serving copies.
    #[arg(long, env = "INFERENCE_POOLS")]
    inference_pools: bool,
    /// The endpoint picker Service every InferencePool names (none: the
    /// gateway picks; the extension's v1.6 made it optional, its v1.5
    /// requires it).
    #[arg(long, env = "ENDPOINT_PICKER")]
    endpoint_picker: Option<String>,
    /// Keep one ConfigMap per base model with LoRA adapters and namespace
    /// (`<model>-adapters`) in the shape llm-d's payload processor reads
    /// (label inference.llm-d.ai/ipp-managed=true, keys baseModel and
    /// adapters), so a gateway running it routes an adapter's name to its
    /// base model's InferencePool (needs --inference-pools).
    #[arg(long, env = "LLM_D_ADAPTER_MAPS")]
    llm_d_adapter_maps: bool,
    /// The endpoint picker Service's port.
    #[arg(long, env = "ENDPOINT_PICKER_PORT", default_value_t = 9002)]
    endpoint_picker_port: u16,
    /// Keep HTTPRoutes (gateway.networking.k8s.io/v1) on this Gateway,
    /// [NAMESPACE/]NAME: one per model with serving copies toward its
    /// InferencePool (matching the X-Gateway-Model-Name header body-based
    /// routing sets), and a catch-all toward the router Service (needs
    /// --inference-pools and --gateway-router-service).
    #[arg(long, env = "GATEWAY_ROUTES", requires = "gateway_router_service")]
    gateway_routes: Option<String>,
    /// The router Service the catch-all route sends every other request
    /// to, NAMESPACE/NAME:PORT.
    #[arg(long, env = "GATEWAY_ROUTER_SERVICE", requires = "gateway_routes")]
    gateway_router_service: Option<String>,
}

impl CopiesArgs {
    fn config(&self) -> Result<CopiesConfig, Failure> {
        if self.router_selector.is_some() && self.router_namespace.is_none() {
            return Err(Failure::bad_input(
                "--router-selector needs --router-namespace: router pods are read in that namespace only (in every namespace, any tenant's pod carrying the labels would feed the copy signal)",
            ));
        }
        let routes = match (&self.gateway_routes, &self.gateway_router_service) {
            (Some(gateway), Some(router)) => {
                if !self.inference_pools {
                    return Err(Failure::bad_input(
                        "--gateway-routes needs --inference-pools: a model's route goes to its InferencePool",
                    ));
                }
                Some(RouteConfig::parse(gateway, router).map_err(Failure::bad_input)?)
            }
            _ => None,
        };
        if self.llm_d_adapter_maps && !self.inference_pools {
            return Err(Failure::bad_input(
                "--llm-d-adapter-maps needs --inference-pools: an adapter's name is routed to its base model's InferencePool",
            ));
        }
        if self.copies_tick.is_zero() || self.copies_target_in_flight == 0 {
            return Err(Failure::bad_input(
                "--copies-tick and --copies-target-in-flight must be above zero",
            ));
        }
        Ok(CopiesConfig {
            routers: self.router_metrics.clone(),
            router_selector: self.router_selector.clone(),
            router_namespace: self.router_namespace.clone(),
            router_port: self.router_port,
            tick: self.copies_tick,
            drain_grace: self.copies_drain_grace,
            defaults: CopyPolicy {
                target_in_flight: f64::from(self.copies_target_in_flight),
                window: self.copies_window.as_secs_f64(),
                scale_down_delay: self.copies_scale_down_delay.as_secs_f64(),
                ..CopyPolicy::default()
            },
            pools: self.inference_pools.then(|| PoolConfig {
                endpoint_picker: self
                    .endpoint_picker
                    .clone()
                    .map(|name| EndpointPickerRef::service(name, self.endpoint_picker_port)),
                routes,
                adapter_maps: self.llm_d_adapter_maps,
            }),
        })
    }
}

pub async fn run(args: Args) -> Result<(), Failure> {
    let copies = args.copies.config()?;
    let client = cluster_client().await?;
    preflight(
        &client,
        args.namespace.as_deref(),
        "The controller needs list/watch on modelresidencies and pods, patch on \
         modelresidencies/status, create/delete on pods (the chart's ClusterRole grants them)",
    )
    .await?;

    let metrics = Arc::new(model_residency::metrics::Metrics::default());
    let ready = Readiness::default();
    let http = serve_admin(args.http_addr, ready.clone(), {
        let metrics = metrics.clone();
        move || metrics.encode()
    })
    .await
    .map_err(|e| fatal(format!("cannot listen on {}: {e}", args.http_addr)))?;

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

    let mut ctx = Context::with_options(
        client.clone(),
        metrics,
        args.max_clock_skew,
        args.initial_list,
        args.gpu_holder_image.clone(),
    );
    {
        let fresh = Arc::get_mut(&mut ctx).expect("a new context");
        fresh.pod_call_timeout_max = args.pod_call_timeout_max;
        fresh.sleep_audit = args.sleep_audit_interval;
        fresh.forecasts.persist = args.persist_forecasts;
        fresh.copies = copies;
    }
    if !args.leader_elect {
        // Ready once the controller's first lists are in.
        model_residency::operator::run(ctx, args.namespace.clone(), stopped(stop_rx), ready).await;
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
    ready.set();
    model_residency::operator::run_elected(
        ctx,
        args.namespace.clone(),
        elector,
        stop_rx,
        Readiness::default(),
        Arc::default(),
    )
    .await;
    http.abort();
    Ok(())
}
