//! `model-residency route`: the front door. An HTTP reverse proxy in front
//! of the model pods that routes each request by its model id, holds a
//! request whose model is not loaded until its pod is Ready (requesting
//! the load itself), and turns traffic into demand.
//!
//! Stateless: it watches ModelResidency objects and their model pods and
//! keeps nothing else, so any number of replicas can run side by side
//! (no leader election). Its only write is the demand merge patch.
//!
//! - [`target`]: which model a request names;
//! - [`snapshot`]: what the watches show, per model;
//! - [`balance`]: which of a model's copies serves a request;
//! - [`crate::residency::placement`]: where a model resident nowhere is loaded;
//! - [`recency`]: when traffic becomes a demand write;
//! - [`proxy`]: sending on and streaming back;
//! - [`errors`]: the OpenAI-shaped answers when it cannot proxy;
//! - [`catalog`]: what it answers itself (model list, readiness);
//! - [`adapters`]: LoRA adapters loaded into their base model's pods;
//! - `keepalive`: a streaming client held through a cold load hears SSE
//!   comments until the model's stream follows.

mod adapters;
mod body;
mod in_flight;

use body::*;
use in_flight::*;

pub mod balance;
pub mod catalog;
pub mod errors;
mod hold;
mod keepalive;
pub mod metrics;
pub mod proxy;
pub mod recency;
pub mod snapshot;
pub mod target;
mod watches;
pub mod workers;

use crate::api::ModelResidency;
use bytes::Bytes;
use errors::Refusal;
use http::{Request, Response, header};
use http_body_util::{BodyExt, Full, combinators::BoxBody};
use hyper::body::Incoming;
use k8s_openapi::jiff::Timestamp;
use kube::api::Api;
use metrics::{CodeLabels, ModelLabels, NamespacedLabels, RouterMetrics, WriteLabels};
use recency::{Key, Recency};
use snapshot::{Endpoint, Snapshot};
use std::collections::HashMap;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};
use tokio::net::TcpListener;
use tokio::sync::{Notify, watch};
use tokio::task::JoinHandle;

/// How the router runs.
#[derive(Clone, Debug)]
pub struct Config {
    /// Watch only this namespace (default: all).
    pub namespace: Option<String>,
    /// Serve only residencies matching this label selector.
    pub selector: Option<String>,
    /// A hit refreshes its model's recency at most this often (zero: every
    /// hit writes).
    pub recency_resolution: Duration,
    /// The longest a request waits for its model to load.
    pub load_timeout: Duration,
    /// Requests that may wait for loads, per model.
    pub max_pending: usize,
    /// Requests that may wait for loads, in all.
    pub max_pending_total: usize,
    /// The largest request body read.
    pub max_body: usize,
    /// The longest a request's body may pause between two reads (then
    /// 408): a client that stops sending half way does not hold its
    /// connection and up to `max_body` of memory for ever.
    pub body_timeout: Duration,
    /// The longest a request's whole body may take (then 408): a client
    /// that trickles a byte just inside `body_timeout` is cut off too.
    pub body_deadline: Duration,
    /// Which Ready copy of a model gets a request ([`balance`]).
    pub balance: balance::Strategy,
    /// The request bodies the router may hold at once, in bytes, all
    /// requests together (then 429): bodies are read whole and held
    /// through a load, so `max_pending_total` bodies of `max_body` each
    /// would be far past any memory limit.
    pub max_buffered: usize,
    /// Exact paths forwarded besides the inference APIs, for servers with
    /// APIs of their own (GET or POST, the model in `X-Model`).
    pub forward_paths: Vec<String>,
    /// A request naming a LoRA adapter goes to a copy whose pod holds it,
    /// when one does, else to the adapter's home copy (a consistent hash
    /// of its name), not the balancing strategy's pick (on by default; off
    /// only to measure what it saves, benches/balance.rs).
    pub adapter_affinity: bool,
    /// A request that asked to stream (`"stream": true`) for a model with
    /// no Ready pod is answered at once and sent an SSE comment this often
    /// while it is held (zero: held silently, answered only once served).
    pub stream_keepalive: Duration,
}

impl Default for Config {
    fn default() -> Self {
        Config {
            namespace: None,
            selector: None,
            recency_resolution: Duration::from_secs(5),
            load_timeout: Duration::from_secs(600),
            max_pending: 256,
            max_pending_total: 4096,
            max_body: 32 << 20,
            body_timeout: Duration::from_secs(60),
            body_deadline: Duration::from_secs(300),
            balance: balance::Strategy::LeastInFlight,
            max_buffered: 96 << 20,
            forward_paths: Vec::new(),
            adapter_affinity: true,
            stream_keepalive: Duration::from_secs(10),
        }
    }
}

pub type ProxyBody = BoxBody<Bytes, hyper::Error>;

fn full(bytes: Bytes) -> ProxyBody {
    boxed(Full::new(bytes))
}

/// The router's own answers in the proxy's body type.
fn boxed(body: Full<Bytes>) -> ProxyBody {
    body.map_err(|never| match never {}).boxed()
}

/// The last part of the shutdown grace, in which the requests still held
/// for a load get their 503.
pub const HELD_ANSWER_TIME: Duration = Duration::from_secs(1);

/// A running router: its watches, its view of the cluster, and its
/// bookkeeping of traffic. Its tasks stop when it is dropped.
pub struct Router {
    config: Config,
    client: kube::Client,
    snapshot: watch::Receiver<Arc<Snapshot>>,
    /// Woken when a demand write fails, so the requests waiting on it
    /// write again.
    retry: Notify,
    ready: crate::http::Readiness,
    recency: Recency,
    /// Requests being proxied, per pod (`<namespace>/<pod>`).
    in_flight: Mutex<HashMap<Arc<str>, Arc<AtomicUsize>>>,
    /// Requests waiting for loads, per model, and in all.
    pending: Mutex<(HashMap<String, usize>, usize)>,
    /// Bytes of request bodies held now (read, or declared and being read).
    buffered: Arc<AtomicUsize>,
    pub metrics: RouterMetrics,
    /// What each model pod holds of LoRA adapters, as this router loaded them.
    adapters: adapters::Adapters,
    tasks: Mutex<Vec<JoinHandle<()>>>,
    /// Set when the shutdown grace is nearly over: requests still held for
    /// a load are answered 503 with `Retry-After` rather than dropped.
    closing: watch::Sender<bool>,
}

impl Drop for Router {
    fn drop(&mut self) {
        for task in self.tasks.get_mut().expect("tasks lock").drain(..) {
            task.abort();
        }
    }
}

impl Router {
    /// Starts the watches (and the recency ticks); the router is ready once
    /// both watches have listed (see [`Router::ready`]).
    pub fn start(client: kube::Client, config: Config) -> Arc<Router> {
        let (tx, rx) = watch::channel(Arc::new(Snapshot::default()));
        let router = Arc::new(Router {
            recency: Recency::new(config.recency_resolution),
            config,
            client,
            snapshot: rx,
            retry: Notify::new(),
            ready: crate::http::Readiness::default(),
            in_flight: Mutex::default(),
            pending: Mutex::default(),
            buffered: Arc::default(),
            metrics: RouterMetrics::default(),
            adapters: adapters::Adapters::default(),
            tasks: Mutex::default(),
            closing: watch::Sender::new(false),
        });
        let watches = tokio::spawn(watches::watch_cluster(Arc::downgrade(&router), tx));
        let mut tasks = vec![watches];
        if !router.config.recency_resolution.is_zero() {
            tasks.push(tokio::spawn(watches::refresh_recency(Arc::downgrade(
                &router,
            ))));
        }
        *router.tasks.lock().expect("tasks lock") = tasks;
        router
    }

    /// On shutdown, after the listener is closed: waits (within `grace`)
    /// until no request is in flight, those held for a load included; the
    /// held ones that are left when the grace is nearly over are answered
    /// 503 with `Retry-After` (another replica serves them), in its last
    /// [`HELD_ANSWER_TIME`].
    pub async fn drain(&self, grace: Duration) {
        let until_idle = |deadline: Instant| async move {
            while Instant::now() < deadline && self.busy() {
                tokio::time::sleep(Duration::from_millis(50)).await;
            }
        };
        until_idle(Instant::now() + grace.saturating_sub(HELD_ANSWER_TIME)).await;
        self.closing.send_replace(true);
        until_idle(Instant::now() + HELD_ANSWER_TIME.min(grace)).await;
        // A held request stops counting when its answer is made, a moment
        // before the connection has written it.
        tokio::time::sleep(Duration::from_millis(100)).await;
    }

    /// Whether a request is being proxied or held for a load.
    fn busy(&self) -> bool {
        let proxied = self
            .in_flight
            .lock()
            .expect("in-flight lock")
            .values()
            .any(|n| n.load(Ordering::Relaxed) > 0);
        proxied || self.pending.lock().expect("pending lock").1 > 0
    }

    /// The in-flight counter of `pod`, the same for every snapshot; counters
    /// of pods gone from every snapshot and idle are dropped on the way.
    fn in_flight_of(&self, pod: &Arc<str>) -> Arc<AtomicUsize> {
        let mut counters = self.in_flight.lock().expect("in-flight lock");
        counters.entry(pod.clone()).or_default().clone()
    }

    /// Drops the counters no snapshot and no request holds any more.
    fn forget_idle_counters(&self) {
        let mut counters = self.in_flight.lock().expect("in-flight lock");
        counters.retain(|_, n| Arc::strong_count(n) > 1 || n.load(Ordering::Relaxed) > 0);
    }

    /// Bytes of request bodies held now (`--max-buffered-bytes` bounds it).
    pub fn buffered(&self) -> usize {
        self.buffered.load(Ordering::Relaxed)
    }

    /// What it was started with.
    pub fn config(&self) -> &Config {
        &self.config
    }

    /// Both watches have listed once.
    pub fn ready(&self) -> bool {
        self.ready.is_ready()
    }

    /// Serves HTTP on `listener` until the task is dropped.
    pub async fn serve(self: Arc<Self>, listener: TcpListener) {
        crate::http::accept_loop(listener, |stream| {
            let router = self.clone();
            tokio::spawn(async move {
                let service = hyper::service::service_fn(move |req| {
                    let router = router.clone();
                    async move { Ok::<_, std::convert::Infallible>(router.handle(req).await) }
                });
                let _ = hyper::server::conn::http1::Builder::new()
                    .timer(hyper_util::rt::TokioTimer::new())
                    .header_read_timeout(Duration::from_secs(30))
                    .serve_connection(hyper_util::rt::TokioIo::new(stream), service)
                    .await;
            });
        })
        .await
    }

    /// Answers one request.
    pub async fn handle(self: Arc<Self>, req: Request<Incoming>) -> Response<ProxyBody> {
        let start = Instant::now();
        if let Some(r) = crate::http::probe(&req, self.ready(), || self.metrics.encode()) {
            return r.map(boxed);
        }
        if let Some(q) = catalog::question(req.method(), req.uri().path()) {
            let snap = self.snapshot.borrow().clone();
            if q == catalog::Question::Models {
                return catalog::models_list(&snap).await.map(boxed);
            }
            return catalog::answer(q, &snap, self.ready()).map(boxed);
        }
        let (model, result) = match self.model_of(req).await {
            Ok((model, parts, body, held))
                if !self.config.stream_keepalive.is_zero()
                    && keepalive::wants_stream(&body)
                    && self.held_for_a_load(&model) =>
            {
                let request = keepalive::Held {
                    parts,
                    body,
                    buffered: held,
                    start,
                };
                let response = self.keep_alive_through_load(model.clone(), request);
                (self.known(&model), Ok(response))
            }
            Ok((model, parts, body, _held)) => {
                let result = self.serve_model(&model, &parts, body, start).await;
                // A proxied request's model is one the router serves.
                let model = if result.is_ok() {
                    model
                } else {
                    self.known(&model)
                };
                (model, result)
            }
            Err(refusal) => (String::new(), Err(refusal)),
        };
        let response = result.unwrap_or_else(|r| {
            if matches!(r, Refusal::Upstream(_)) {
                self.metrics
                    .upstream_errors
                    .get_or_create(&ModelLabels {
                        model: model.clone(),
                    })
                    .inc();
            }
            r.response::<Full<Bytes>>().map(boxed)
        });
        self.metrics
            .requests
            .get_or_create(&CodeLabels {
                model,
                code: response.status().as_u16(),
            })
            .inc();
        response
    }

    async fn serve_model(
        self: &Arc<Self>,
        model: &str,
        parts: &http::request::Parts,
        body: Bytes,
        start: Instant,
    ) -> Result<Response<ProxyBody>, Refusal> {
        // A LoRA adapter's name: served by a pod of its base model.
        let adapter = self.snapshot.borrow().adapters.get(model).cloned();
        if let Some(why) = adapter.as_ref().and_then(|a| a.refused.clone()) {
            return Err(Refusal::ModelRefused(why));
        }
        let target = adapter.as_ref().map_or(model, |a| a.base.as_str());
        let mut gone: Option<Arc<str>> = None;
        // Counted from here to the end of its answer (the clone that
        // `forward` keeps), for models this router serves only: a client
        // cannot grow the label set at will.
        let counted = self
            .snapshot
            .borrow()
            .models
            .get(target)
            .map(|view| Arc::new(ModelInFlight::enter(&self.metrics, &view.namespace, target)));
        // The prompt's prefix is read only when the strategy uses it.
        let key = match self.config.balance {
            balance::Strategy::PrefixHash => balance::prompt_prefix(&body),
            balance::Strategy::LeastInFlight => None,
        };
        let mut reloaded = false;
        // At most two tries: a pod that went away before the request was
        // sent is re-resolved once (and an adapter its server no longer
        // knows is loaded again once).
        loop {
            let affinity = adapter.as_ref().map(|a| a.name.as_str());
            let (endpoint, cold) = self
                .resolve(target, gone.as_deref(), key.as_deref(), affinity)
                .await?;
            if !cold {
                self.refresh(&endpoint).await;
            }
            if let Some(why) = adapter.as_ref().and_then(|a| endpoint.refuses(&a.name)) {
                return Err(Refusal::ModelRefused(format!(
                    "the adapter `{model}` is refused in model `{target}`'s pod {}: {why}",
                    endpoint.pod
                )));
            }
            let in_use = match &adapter {
                Some(a) => match self.adapter_in(&endpoint, a).await {
                    // Every slot of this pod busy serving: another copy,
                    // once, before the client hears 503.
                    Err(Refusal::ModelUnavailable { .. })
                        if gone.is_none() && self.copies_of(target) > 1 =>
                    {
                        gone = Some(endpoint.pod.clone());
                        continue;
                    }
                    held => Some(held?),
                },
                None => None,
            };
            match self
                .forward(
                    &endpoint,
                    parts,
                    body.clone(),
                    start,
                    counted.clone(),
                    in_use,
                )
                .await
            {
                Err(proxy::SendError::Connect(e)) if gone.is_none() => {
                    tracing::debug!(pod = %endpoint.pod, error = %e, "pod unreachable; re-resolving");
                    gone = Some(endpoint.pod.clone());
                }
                Err(proxy::SendError::Connect(e) | proxy::SendError::Other(e)) => {
                    return Err(Refusal::Upstream(format!(
                        "model {model}'s pod {} did not answer: {e}",
                        endpoint.pod
                    )));
                }
                // The server does not know the adapter it was thought to
                // hold (its container restarted): what it holds is learned
                // again, this adapter first.
                Ok(response)
                    if adapter.is_some()
                        && response.status() == http::StatusCode::NOT_FOUND
                        && !reloaded =>
                {
                    tracing::info!(pod = %endpoint.pod, model, "the server lacks the adapter; loading it again");
                    self.adapters.forget(&endpoint.uid);
                    reloaded = true;
                }
                Ok(response) => return Ok(response),
            }
        }
    }

    /// How many Ready copies `model` has now.
    fn copies_of(&self, model: &str) -> usize {
        self.snapshot
            .borrow()
            .models
            .get(model)
            .map_or(0, |v| v.ready.len())
    }

    /// A Ready pod for `model` (not `avoid`): at once if there is one, else
    /// after holding the request through a load. `cold` says it was held.
    async fn resolve(
        &self,
        model: &str,
        avoid: Option<&str>,
        key: Option<&str>,
        adapter: Option<&str>,
    ) -> Result<(Endpoint, bool), Refusal> {
        // The hit path only reads the latest snapshot; a receiver of its
        // own is made only for waiting.
        let mut snap = self.snapshot.borrow().clone();
        if !snap.synced {
            // Started and asked before the first list: wait for it.
            let mut rx = self.snapshot.clone();
            let deadline = tokio::time::Instant::now() + self.config.load_timeout;
            while !snap.synced {
                tokio::select! {
                    changed = rx.changed() => if changed.is_err() { return Err(hold::shutting_down()) },
                    _ = tokio::time::sleep_until(deadline) => return Err(hold::timed_out(model, self.config.load_timeout)),
                }
                snap = rx.borrow_and_update().clone();
            }
        }
        let Some(view) = snap.models.get(model) else {
            return Err(snap.not_listed(model));
        };
        // A copy that holds the adapter before one that does not.
        if let Some(adapter) = adapter.filter(|_| self.config.adapter_affinity) {
            let holding: Vec<Endpoint> = view
                .ready
                .iter()
                .filter(|e| self.adapters.holds(&e.uid, adapter))
                .cloned()
                .collect();
            if let Some(e) = self.choose(&holding, avoid, key) {
                return Ok((e, false));
            }
        }
        // Else the adapter's home copy among those that can load it (its
        // files are on their nodes): a consistent hash of its name, with
        // bounded loads, so each adapter tends to one copy and the copies'
        // slots together hold more adapters than any one pod's (by the
        // in-flight count alone, every miss on a quiet model would go to
        // the same first copy).
        if let Some(adapter) = adapter {
            let able: Vec<Endpoint> = view
                .ready
                .iter()
                .filter(|e| e.refuses(adapter).is_none())
                .cloned()
                .collect();
            let home = if self.config.adapter_affinity {
                balance::pick(balance::Strategy::PrefixHash, &able, avoid, Some(adapter))
            } else {
                self.choose(&able, avoid, key)
            };
            if let Some(e) = home {
                return Ok((e, false));
            }
        }
        if let Some(e) = self.choose(&view.ready, avoid, key) {
            return Ok((e, false));
        }
        let endpoint = self.hold(model, self.snapshot.clone(), avoid, key).await?;
        Ok((endpoint, true))
    }

    /// The Ready copy for a request whose prompt starts with `key`, as the
    /// balancing strategy says; a pod that could not be reached (`avoid`)
    /// only if it is the only one still listed.
    fn choose(
        &self,
        ready: &[Endpoint],
        avoid: Option<&str>,
        key: Option<&str>,
    ) -> Option<Endpoint> {
        balance::pick(self.config.balance, ready, avoid, key)
    }

    /// Writes a request for `key` at `at` (one merge patch).
    async fn write(&self, key: &Key, at: Timestamp, kind: &'static str) -> Result<(), kube::Error> {
        let turn = self.recency.write_turn(key);
        let _turn = turn.lock().await;
        if self.recency.superseded(key, at) {
            // A newer request of this key landed first: it stands for this
            // one too.
            self.recency.write_done(key);
            return Ok(());
        }
        let api: Api<ModelResidency> = Api::namespaced(self.client.clone(), &key.0);
        let result = crate::residency::demand::load(&api, &key.1, &key.2, at).await;
        self.metrics
            .demand_writes
            .get_or_create(&WriteLabels { kind })
            .inc();
        match &result {
            Ok(_) => {
                self.recency.landed(key, at);
                self.recency.write_done(key);
            }
            Err(e) => {
                self.metrics.demand_write_errors.inc();
                tracing::warn!(namespace = %key.0, residency = %key.1, model = %key.2, error = %e, "demand write failed");
                self.recency.write_failed(key, at);
                self.retry.notify_waiters();
            }
        }
        result.map(|_| ())
    }

    /// A hit: refresh its model's recency if due (with a zero resolution,
    /// before it is proxied, so the writes keep the requests' order).
    async fn refresh(self: &Arc<Self>, endpoint: &Endpoint) {
        let key = endpoint.key.clone();
        let Some(at) = self.recency.hit(&key, Instant::now()) else {
            return;
        };
        if self.config.recency_resolution.is_zero() {
            let _ = self.write(&key, at, "recency").await;
        } else {
            let router = self.clone();
            tokio::spawn(async move {
                let _ = router.write(&key, at, "recency").await;
            });
        }
    }

    async fn forward(
        self: &Arc<Self>,
        endpoint: &Endpoint,
        parts: &http::request::Parts,
        body: Bytes,
        start: Instant,
        counted: Option<Arc<ModelInFlight>>,
        adapter: Option<adapters::InUse>,
    ) -> Result<Response<ProxyBody>, proxy::SendError> {
        let guard = InFlight::enter(self.clone(), endpoint, start, counted, adapter);
        let answer = proxy::send(&proxy::thread_upstream(), endpoint.addr, parts, body).await?;
        let (head, incoming) = answer.into_parts();
        let body = if proxy::small_and_whole(&head.headers) {
            // A short answer of known length (most non-streamed answers)
            // is read whole, so it goes out with its head in one write;
            // anything else (SSE, chunked, large) streams frame by frame.
            match incoming.collect().await {
                Ok(collected) => {
                    drop(guard);
                    full(collected.to_bytes())
                }
                Err(e) => return Err(proxy::SendError::Other(e.to_string())),
            }
        } else {
            proxy::Tracked::new(incoming, guard).boxed()
        };
        let mut response = Response::new(body);
        *response.status_mut() = head.status;
        let headers = response.headers_mut();
        proxy::copy_headers(&head.headers, headers);
        headers.insert("x-residency", endpoint.residency_header.clone());
        headers.insert("x-model-pod", endpoint.pod_header.clone());
        Ok(response)
    }
}

fn key(snap: &Snapshot, i: usize, model: &str) -> Key {
    let r = &snap.residencies[i];
    Arc::new((
        kube::ResourceExt::namespace(&**r).unwrap_or_default(),
        kube::ResourceExt::name_any(&**r),
        model.to_owned(),
    ))
}

impl std::fmt::Debug for Router {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Router")
            .field("config", &self.config)
            .finish()
    }
}
