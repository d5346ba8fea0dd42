//! The fake model server the kubelet stand-in runs for each pod it starts,
//! so that tests and the demo carry real HTTP traffic to model pods.
//!
//! What it fakes: an OpenAI-compatible model server that has "loaded" its
//! model. It listens on the pod's own loopback address (127.0.0.0/8 is all
//! local, so every pod can use the same container port) from the moment
//! the stand-in marks the pod Ready until the pod is deleted or failed, and
//! answers:
//! - `POST /v1/embeddings`: one 8-number vector per input, in OpenAI's
//!   embedding list shape;
//! - `POST /v1/completions`: a text completion (`choices[].text`);
//! - any other `POST /v1/...` and `POST /v2/models/<name>/...`: a chat
//!   completion (`choices[].message`);
//! - each of them names the model and the pod (`model`, `pod`, and the
//!   text `"<model> on <pod>"`), with the `id`, `created` and `usage` an
//!   OpenAI client reads; with `"stream": true` in the body, three
//!   server-sent-event chunks of the same kind `stream_delay` apart, then
//!   `data: [DONE]`;
//! - `max_tokens` in the body sets how many chunks a stream has (default
//!   3); a request naming another `model` gets vLLM's 404;
//! - `GET /v1/models`: the one model (and its LoRA adapters); `GET
//!   /health` (and `/healthz`): ok.
//! - vLLM's runtime LoRA adapter endpoints, as vLLM 0.32 answers them,
//!   when started with an adapter rank ([`lora`]).
//! - vLLM's sleep mode endpoints, as vLLM 0.32 behaves ([`sleep`]);
//!   SGLang's release and resume, as SGLang 0.5.23's HTTP app answers.
//!   The pod annotation `kubelet-standin.residency.dev/sleep` declares the
//!   delays and faults: `sleep=200ms,wake=50ms`, and `mode=missing` (no
//!   sleep endpoints: 404), `mode=lies` (answers 200 and does not sleep)
//!   or `mode=slow` (the sleep never answers).
//! - `GET /fake/stats`: `{"asleep", "sleep_requests", "sleeps", "wakes",
//!   "inference_while_asleep", "aborted", "garbage"}`, for tests to check
//!   that nothing was sent to a sleeping server, cut short, or answered
//!   without its weights (`sleep_requests` counts those received, answered
//!   or not).
//!
//! Every response carries `x-model-pod: <pod>`. What it still fakes: no
//! inference happens (the text names the model and the pod); every pod
//! answers chat, completions and embeddings (vLLM serves embeddings only
//! from a pooling model, and then no chat); any other `POST /v1/...` or
//! `/v2/models/...` is a chat (vLLM: 404); no batching, limits, GPU
//! memory, `/metrics`; a sleep frees nothing (there is nothing to free),
//! and a level-2 wake without its reload answers text marked as garbage
//! rather than random tokens.

use bytes::Bytes;
use http::{Request, Response, StatusCode, header};
use http_body_util::{BodyExt, Full, combinators::BoxBody};
use hyper::body::Incoming;
use hyper::server::conn::http1;
use hyper::service::service_fn;
use hyper_util::rt::TokioIo;
use std::convert::Infallible;
use std::net::{Ipv4Addr, SocketAddr};
use std::sync::Arc;
use std::sync::atomic::{AtomicU32, Ordering};
use std::time::Duration;
use tokio::net::TcpListener;
use tokio::task::JoinHandle;

/// The largest request body the fake server reads.
const MAX_BODY: usize = 1 << 20;

/// A loopback address no other pod of this process has: 127.1.0.0/16 and
/// up (127.0.0.0/16 is left to everything else), starting at an offset of
/// this process's own, so two local clusters on one machine seldom meet
/// (and the kubelet stand-in skips an address that is taken).
pub fn next_pod_ip() -> Ipv4Addr {
    static NEXT: AtomicU32 = AtomicU32::new(0);
    let start = (std::process::id() % 1024) << 13;
    let n = (start + NEXT.fetch_add(1, Ordering::Relaxed)) % ((1 << 23) - 1) + 1;
    Ipv4Addr::from(0x7f01_0000 + n)
}

/// Who a fake server says it is.
#[derive(Clone, Debug)]
pub struct Identity {
    pub model: String,
    pub pod: String,
}

/// Pod annotation declaring the fake server's sleep delays and faults
/// (module docs).
pub const SLEEP_ANNOTATION: &str = "kubelet-standin.residency.dev/sleep";

/// How a fake server sleeps and wakes.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct SleepBehaviour {
    pub sleep_delay: Duration,
    pub wake_delay: Duration,
    pub mode: SleepMode,
}

impl Default for SleepBehaviour {
    fn default() -> Self {
        SleepBehaviour {
            sleep_delay: Duration::from_millis(20),
            wake_delay: Duration::from_millis(20),
            mode: SleepMode::Honest,
        }
    }
}

/// The faults a fake server's sleep endpoints can have.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum SleepMode {
    Honest,
    /// No sleep endpoints (404).
    Missing,
    /// Answers 200 to a sleep and does not sleep.
    Lies,
    /// A sleep never answers.
    Slow,
}

impl SleepBehaviour {
    /// Reads the annotation's `key=value` list; unknown keys or values are
    /// ignored (a stand-in, not an API).
    pub fn parse(text: &str) -> Self {
        let mut b = SleepBehaviour::default();
        for part in text.split(',') {
            let Some((key, value)) = part.split_once('=') else {
                continue;
            };
            let delay = crate::quantity::parse_duration(value.trim());
            match (key.trim(), value.trim()) {
                ("sleep", _) => b.sleep_delay = delay.unwrap_or(b.sleep_delay),
                ("wake", _) => b.wake_delay = delay.unwrap_or(b.wake_delay),
                ("mode", "missing") => b.mode = SleepMode::Missing,
                ("mode", "lies") => b.mode = SleepMode::Lies,
                ("mode", "slow") => b.mode = SleepMode::Slow,
                _ => {}
            }
        }
        b
    }
}

mod container;
mod lora;
mod openai;
mod sleep;

pub use container::{Options as ContainerOptions, run_in_container};
pub use lora::Adapters;

use sleep::SleepState;

/// One fake server: who it is, how it sleeps, what it is doing.
#[derive(Debug)]
struct Server {
    id: Identity,
    sleep: SleepBehaviour,
    state: SleepState,
    stream_delay: Duration,
    prefix: Option<PrefixCache>,
    batch: Option<u32>,
    /// LoRA adapters, when it serves them ([`lora`]).
    adapters: Option<Adapters>,
}

impl Server {
    /// The time between two chunks of a stream now: the stream delay, or
    /// more with more streams running than the batch holds.
    fn chunk_delay(&self) -> Duration {
        let Some(batch) = self.batch.filter(|&b| b > 0) else {
            return self.stream_delay;
        };
        let running = self.state.running().max(1);
        self.stream_delay
            .mul_f64((running as f64 / f64::from(batch)).max(1.0))
    }
}

/// Pod annotation giving the fake server a GPU's batch (`16`): up to that
/// many streams decode at the stream delay per chunk; with `n` more
/// running, every chunk takes `n / batch` times as long, as a GPU's decode
/// step grows once the batch is past what it holds. Benchmarks of copies
/// use it: more copies, faster streams.
pub const BATCH_ANNOTATION: &str = "kubelet-standin.residency.dev/batch";

/// What a fake server does beyond its defaults.
#[derive(Debug, Default)]
pub struct Tuning {
    pub prefix: Option<PrefixCache>,
    pub batch: Option<u32>,
    /// Serve LoRA adapters up to this rank, as vLLM with `--enable-lora
    /// --max-lora-rank N` does ([`lora`]).
    pub max_lora_rank: Option<u64>,
}

/// Pod annotation giving the fake server a KV cache of prompt prefixes
/// (`slots=8,hit=5ms,miss=60ms`): a request whose prompt prefix (its own
/// key, [`cached_prefix`], not the router's) is among the last `slots` it
/// saw waits `hit` before it answers, any other `miss`, as a server with
/// prefix caching prefills a cached prefix faster.
pub const PREFIX_CACHE_ANNOTATION: &str = "kubelet-standin.residency.dev/prefix-cache";

/// What the fake's prefix cache is keyed by, as a server caches the KV of
/// a prompt's leading blocks: a chat's first message (its system prompt,
/// the part requests share), or a completion prompt's first
/// [`PROMPT_BLOCK`] characters. Its own rule, so that the balance bench
/// measures the router's prefix key against a server's, not against
/// itself.
pub fn cached_prefix(request: &serde_json::Value) -> Option<String> {
    if let Some(first) = request["messages"].as_array().and_then(|m| m.first()) {
        return match &first["content"] {
            serde_json::Value::String(s) => Some(s.clone()),
            serde_json::Value::Array(parts) => Some(
                parts
                    .iter()
                    .filter_map(|p| p["text"].as_str())
                    .collect::<String>(),
            ),
            _ => None,
        };
    }
    let prompt = request["prompt"].as_str()?;
    Some(prompt.chars().take(PROMPT_BLOCK).collect())
}

/// The characters of a completion prompt the fake's prefix cache keys by.
pub const PROMPT_BLOCK: usize = 256;

/// The fake's prefix cache (see [`PREFIX_CACHE_ANNOTATION`]).
#[derive(Debug)]
pub struct PrefixCache {
    slots: usize,
    hit: Duration,
    miss: Duration,
    /// Most recent last.
    seen: std::sync::Mutex<std::collections::VecDeque<String>>,
    hits: std::sync::atomic::AtomicU64,
    misses: std::sync::atomic::AtomicU64,
}

impl PrefixCache {
    /// Reads the annotation's `key=value` list (defaults: 8 slots, 5 ms, 60 ms).
    pub fn parse(text: &str) -> Self {
        let mut c = PrefixCache {
            slots: 8,
            hit: Duration::from_millis(5),
            miss: Duration::from_millis(60),
            seen: Default::default(),
            hits: Default::default(),
            misses: Default::default(),
        };
        for (key, value) in text.split(',').filter_map(|p| p.split_once('=')) {
            let delay = crate::quantity::parse_duration(value.trim());
            match key.trim() {
                "slots" => c.slots = value.trim().parse().unwrap_or(c.slots),
                "hit" => c.hit = delay.unwrap_or(c.hit),
                "miss" => c.miss = delay.unwrap_or(c.miss),
                _ => {}
            }
        }
        c
    }

    /// How long a prompt with this prefix takes to prefill, counting it.
    fn prefill(&self, prefix: &str) -> Duration {
        let mut seen = self.seen.lock().expect("prefix cache lock");
        let hit = if let Some(i) = seen.iter().position(|p| p == prefix) {
            let p = seen.remove(i).expect("present");
            seen.push_back(p);
            true
        } else {
            seen.push_back(prefix.to_owned());
            if seen.len() > self.slots {
                seen.pop_front();
            }
            false
        };
        if hit {
            self.hits.fetch_add(1, Ordering::Relaxed);
            self.hit
        } else {
            self.misses.fetch_add(1, Ordering::Relaxed);
            self.miss
        }
    }
}

/// A running fake model server; stops when dropped.
#[derive(Debug)]
pub struct FakeModelServer {
    pub addr: SocketAddr,
    task: Option<JoinHandle<()>>,
    stop: tokio::sync::watch::Sender<bool>,
}

impl Drop for FakeModelServer {
    fn drop(&mut self) {
        if let Some(task) = self.task.take() {
            task.abort();
        }
    }
}

impl FakeModelServer {
    /// Binds `addr` and serves until dropped.
    pub async fn start(
        addr: SocketAddr,
        identity: Identity,
        stream_delay: Duration,
        sleep: SleepBehaviour,
    ) -> std::io::Result<Self> {
        Self::start_with(addr, identity, stream_delay, sleep, Tuning::default()).await
    }

    /// [`Self::start`] with a prefix cache or a batch.
    pub async fn start_with(
        addr: SocketAddr,
        identity: Identity,
        stream_delay: Duration,
        sleep: SleepBehaviour,
        tuning: Tuning,
    ) -> std::io::Result<Self> {
        let listener = TcpListener::bind(addr).await?;
        let addr = listener.local_addr()?;
        let server = Arc::new(Server {
            id: identity,
            sleep,
            state: SleepState::default(),
            stream_delay,
            prefix: tuning.prefix,
            batch: tuning.batch,
            adapters: tuning.max_lora_rank.map(Adapters::new),
        });
        let (stop, signal) = tokio::sync::watch::channel(false);
        let stopping = Stop {
            signal,
            // `shut_down`'s own bound is the one that counts.
            drain: Duration::from_secs(3600),
        };
        let task = tokio::spawn(serve(listener, server, Some(stopping)));
        Ok(FakeModelServer {
            addr,
            task: Some(task),
            stop,
        })
    }

    /// Stops as a server stops on SIGTERM: accepts nothing new, finishes
    /// what it is answering, and is cut off after `grace` (as a kubelet
    /// kills a container at the end of its termination grace).
    pub async fn shut_down(mut self, grace: Duration) {
        self.stop.send_replace(true);
        if let Some(mut task) = self.task.take()
            && tokio::time::timeout(grace, &mut task).await.is_err()
        {
            task.abort();
        }
    }
}

/// Accepts connections and answers them until `stop` says so (if ever);
/// then stops accepting, lets every connection finish what it is answering
/// (hyper's graceful shutdown closes idle keep-alives) and returns once all
/// have, or after `drain`, whichever is first.
async fn serve(listener: TcpListener, server: Arc<Server>, stop: Option<Stop>) {
    // Without a stop, a signal that never comes: its sender lives as long
    // as the server (a dropped sender would end `wait_for` at once).
    let (never, unstoppable) = tokio::sync::watch::channel(false);
    let (mut stopping, drain) = match stop {
        Some(s) => (s.signal, s.drain),
        None => (unstoppable, Duration::ZERO),
    };
    let _never = never;
    let mut connections = tokio::task::JoinSet::new();
    loop {
        let accepted = tokio::select! {
            a = listener.accept() => a,
            _ = stopped(&mut stopping) => break,
        };
        let Ok((stream, _)) = accepted else {
            tokio::time::sleep(Duration::from_millis(50)).await;
            continue;
        };
        let server = server.clone();
        let mut stopping = stopping.clone();
        connections.spawn(async move {
            let service = service_fn(move |req| {
                let server = server.clone();
                async move {
                    let answer = match sleep::endpoint(req, &server).await {
                        Ok(answer) => answer,
                        Err(req) => match container::endpoint(req, &server).await {
                            Ok(answer) => answer,
                            Err(req) => match lora::endpoint(req, &server).await {
                                Ok(answer) => answer,
                                Err(req) => openai::answer(req, &server).await,
                            },
                        },
                    };
                    Ok::<_, Infallible>(answer)
                }
            });
            let conn = http1::Builder::new().serve_connection(TokioIo::new(stream), service);
            tokio::pin!(conn);
            tokio::select! {
                _ = conn.as_mut() => {}
                _ = stopped(&mut stopping) => {
                    conn.as_mut().graceful_shutdown();
                    let _ = conn.await;
                }
            }
        });
        // Finished connections' results are not kept.
        while connections.try_join_next().is_some() {}
    }
    drop(listener);
    let _ = tokio::time::timeout(drain, async {
        while connections.join_next().await.is_some() {}
    })
    .await;
}

/// Resolves once the stop signal is up (the guard `wait_for` hands back
/// is not held across an await: it is not Send).
async fn stopped(rx: &mut tokio::sync::watch::Receiver<bool>) {
    let _ = rx.wait_for(|s| *s).await;
}

/// When a server stops, and how long it gives what it is answering.
struct Stop {
    signal: tokio::sync::watch::Receiver<bool>,
    drain: Duration,
}

type Body = BoxBody<Bytes, Infallible>;

fn full(body: impl Into<Bytes>) -> Body {
    Full::new(body.into()).boxed()
}

fn respond(
    status: StatusCode,
    content_type: &'static str,
    body: Body,
    pod: &str,
) -> Response<Body> {
    let mut response = Response::new(body);
    *response.status_mut() = status;
    let headers = response.headers_mut();
    headers.insert(
        header::CONTENT_TYPE,
        header::HeaderValue::from_static(content_type),
    );
    if let Ok(pod) = header::HeaderValue::from_str(pod) {
        headers.insert("x-model-pod", pod);
    }
    response
}

const JSON: &str = "application/json";

/// A request's body, at most [`MAX_BODY`] bytes.
async fn read_body(req: Request<Incoming>) -> Option<Bytes> {
    http_body_util::Limited::new(req.into_body(), MAX_BODY)
        .collect()
        .await
        .ok()
        .map(|b| b.to_bytes())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::http::send;

    fn server() -> Arc<Server> {
        Arc::new(Server {
            id: Identity {
                model: "m".into(),
                pod: "p".into(),
            },
            sleep: SleepBehaviour::default(),
            state: SleepState::default(),
            stream_delay: Duration::from_millis(10),
            prefix: None,
            batch: None,
            adapters: None,
        })
    }

    /// A fake server of model `m` on a loopback port, started in 10 ms.
    pub(super) async fn started() -> FakeModelServer {
        FakeModelServer::start(
            "127.0.0.1:0".parse().unwrap(),
            Identity {
                model: "m".into(),
                pod: "p".into(),
            },
            Duration::from_millis(10),
            SleepBehaviour::default(),
        )
        .await
        .unwrap()
    }

    #[tokio::test]
    async fn a_server_without_a_stop_keeps_serving() {
        let s = started().await;
        tokio::time::sleep(Duration::from_millis(100)).await;
        for _ in 0..3 {
            let a = send(s.addr, "GET", "/health", "").await.unwrap();
            assert_eq!(a.status, 200);
        }
    }

    #[tokio::test]
    async fn an_adapter_is_served_from_its_load_to_its_unload_and_only_from_a_real_config() {
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let mut s = Arc::try_unwrap(server()).unwrap();
        s.adapters = Some(Adapters::new(8));
        tokio::spawn(serve(listener, Arc::new(s), None));
        let dir = tempfile::tempdir().unwrap();
        let a1 = dir.path().join("a1");
        std::fs::create_dir_all(&a1).unwrap();
        std::fs::write(a1.join("adapter_config.json"), r#"{"r": 8}"#).unwrap();
        let load = |name: &str, path: &std::path::Path| {
            serde_json::json!({"lora_name": name, "lora_path": path}).to_string()
        };
        let post = |path: &'static str, body: String| async move {
            send(addr, "POST", path, &body).await.unwrap()
        };
        let ask = r#"{"model":"a1","messages":[]}"#.to_string();
        assert_eq!(post("/v1/chat/completions", ask.clone()).await.status, 404);
        assert_eq!(
            post("/v1/load_lora_adapter", load("a1", &a1)).await.status,
            200
        );
        let missing = post("/v1/load_lora_adapter", load("a2", &dir.path().join("a2"))).await;
        assert_eq!(missing.status, 404, "no config there: {}", missing.body);
        let answer = post("/v1/chat/completions", ask.clone()).await;
        assert_eq!(answer.status, 200);
        assert!(answer.body.contains("a1 on p"), "{}", answer.body);
        let models = send(addr, "GET", "/v1/models", "").await.unwrap().body;
        assert!(models.contains(r#""parent":"m""#), "{models}");
        let unload = serde_json::json!({"lora_name": "a1"}).to_string();
        assert_eq!(
            post("/v1/unload_lora_adapter", unload.clone()).await.status,
            200
        );
        assert_eq!(post("/v1/unload_lora_adapter", unload).await.status, 404);
        assert_eq!(post("/v1/chat/completions", ask).await.status, 404);
    }

    #[tokio::test]
    async fn streams_past_the_batch_slow_down_in_proportion() {
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let mut s = Arc::try_unwrap(server()).unwrap();
        s.batch = Some(2);
        tokio::spawn(serve(listener, Arc::new(s), None));
        let body = r#"{"model":"m","stream":true,"max_tokens":20}"#;
        let t = std::time::Instant::now();
        send(addr, "POST", "/v1/chat/completions", body)
            .await
            .unwrap();
        let alone = t.elapsed();
        // Eight at once on a batch of two: each chunk about 4x as long.
        let t = std::time::Instant::now();
        let all = (0..8).map(|_| send(addr, "POST", "/v1/chat/completions", body));
        for a in futures::future::join_all(all).await {
            assert!(a.unwrap().body.contains("[DONE]"));
        }
        let crowded = t.elapsed();
        assert!(
            crowded > alone * 2,
            "alone {alone:?}, eight at once {crowded:?}"
        );
    }

    #[tokio::test]
    async fn a_stop_finishes_the_stream_in_flight_and_accepts_nothing_new() {
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let (tx, rx) = tokio::sync::watch::channel(false);
        let stop = Stop {
            signal: rx,
            drain: Duration::from_secs(10),
        };
        let serving = tokio::spawn(serve(listener, server(), Some(stop)));
        let body = r#"{"model":"m","stream":true,"max_tokens":30}"#;
        let stream =
            tokio::spawn(async move { send(addr, "POST", "/v1/chat/completions", body).await });
        tokio::time::sleep(Duration::from_millis(100)).await;
        tx.send(true).unwrap();
        let answer = stream.await.unwrap().unwrap();
        assert_eq!(
            answer.body.matches("data: {").count(),
            30,
            "{}",
            answer.body
        );
        tokio::time::timeout(Duration::from_secs(5), serving)
            .await
            .expect("the server returns once drained")
            .unwrap();
        assert!(
            send(addr, "GET", "/health", "").await.is_err(),
            "no longer accepting"
        );
    }

    #[test]
    fn the_prefix_cache_keys_by_the_first_message_or_the_prompts_first_block() {
        let chat = |system: &str, user: &str| {
            serde_json::json!({"messages": [
                {"role": "system", "content": system}, {"role": "user", "content": user}]})
        };
        // One system prompt, two questions: one key, as a server's cache of
        // the shared leading blocks.
        assert_eq!(
            cached_prefix(&chat("be brief", "a?")),
            cached_prefix(&chat("be brief", "b?"))
        );
        assert_ne!(
            cached_prefix(&chat("be brief", "a?")),
            cached_prefix(&chat("be long", "a?"))
        );
        let parts =
            serde_json::json!({"messages": [{"content": [{"text": "be "}, {"text": "brief"}]}]});
        assert_eq!(cached_prefix(&parts).as_deref(), Some("be brief"));
        let long = "x".repeat(PROMPT_BLOCK) + "tail";
        let prompt = serde_json::json!({ "prompt": long });
        assert_eq!(cached_prefix(&prompt).map(|p| p.len()), Some(PROMPT_BLOCK));
        assert_eq!(cached_prefix(&serde_json::json!({})), None);
    }
}

#[cfg(test)]
mod early_answer {
    use super::*;

    /// The fake server refuses a body over its 1 MiB before reading the rest;
    /// the router's proxy passes its answer on (#54 S3.14).
    #[tokio::test]
    async fn a_refused_large_body_is_answered_through_the_proxy() {
        let s = super::tests::started().await;
        tokio::time::sleep(Duration::from_millis(100)).await;
        let (parts, _) = Request::post("/v1/chat/completions")
            .header("content-length", 30 << 20)
            .body(())
            .unwrap()
            .into_parts();
        let mut failed = Vec::new();
        for _ in 0..3 {
            let body = Bytes::from(vec![b'x'; 30 << 20]);
            match crate::router::proxy::send(
                &crate::router::proxy::upstream(),
                s.addr,
                &parts,
                body,
            )
            .await
            {
                Ok(a) => assert!(a.status().is_client_error(), "{}", a.status()),
                Err(
                    crate::router::proxy::SendError::Connect(e)
                    | crate::router::proxy::SendError::Other(e),
                ) => failed.push(e),
            }
        }
        assert!(failed.is_empty(), "{failed:?}");
    }
}
