//! The fake's sleep endpoints, as the real servers answer them (read in
//! their source and tried against vLLM 0.32 on CPU and SGLang 0.5.23's
//! HTTP app; `../shared/docs/real-servers.md` in the team's notes):
//!
//! - vLLM: `POST /sleep?level=N&mode=M`. From the call on, the server is
//!   paused: `GET /is_sleeping` is true and a new inference request is
//!   held until the wake, then answered. `mode=abort` (vLLM's default)
//!   ends the generations running at once, each with a 200 and
//!   `finish_reason: "abort"`, cut short; `mode=wait` answers only once
//!   they have finished. Level 2 discards the weights: after `POST
//!   /wake_up` the answers are garbage until `POST /collective_rpc
//!   {"method":"reload_weights"}`. `POST /wake_up?tags=weights` alone
//!   leaves it asleep (as `tags=kv_cache` or no tags wake it).
//! - SGLang: `POST /release_memory_occupation` and
//!   `/resume_memory_occupation` need a JSON body (an empty one is 400
//!   "Field required"); a release while a generation runs is refused (the
//!   scheduler asserts the server is idle), and answers `null` when it
//!   worked.

use super::{Body, JSON, Server, SleepBehaviour, SleepMode, full, read_body, respond};
use http::{Method, Request, Response, StatusCode};
use hyper::body::Incoming;
use serde_json::{Value, json};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::Duration;

/// A fake server's sleep state and what it counted.
#[derive(Debug, Default)]
pub(super) struct SleepState {
    /// Paused or asleep: `/is_sleeping` says true, requests are held.
    asleep: AtomicBool,
    /// Level 2 discarded the weights and they were not loaded again.
    weights_lost: AtomicBool,
    /// Generations running.
    running: AtomicU64,
    /// Bumped by each aborting sleep: a generation that began before it
    /// ends, cut short.
    aborts: AtomicU64,
    woken: tokio::sync::Notify,
    /// Sleep requests received, answered or not.
    sleep_requests: AtomicU64,
    sleeps: AtomicU64,
    wakes: AtomicU64,
    pub(super) inference_while_asleep: AtomicU64,
    pub(super) aborted: AtomicU64,
    pub(super) garbage: AtomicU64,
}

impl SleepState {
    /// Generations running now.
    pub(super) fn running(&self) -> u64 {
        self.running.load(Ordering::SeqCst)
    }

    /// Waits until the server is awake (at once if it is).
    pub(super) async fn until_awake(&self) {
        loop {
            let woken = self.woken.notified();
            tokio::pin!(woken);
            woken.as_mut().enable();
            if !self.asleep.load(Ordering::SeqCst) {
                return;
            }
            woken.await;
        }
    }

    pub(super) fn asleep(&self) -> bool {
        self.asleep.load(Ordering::SeqCst)
    }

    pub(super) fn weights_lost(&self) -> bool {
        self.weights_lost.load(Ordering::SeqCst)
    }

    /// The count of aborting sleeps so far.
    pub(super) fn aborts(&self) -> u64 {
        self.aborts.load(Ordering::SeqCst)
    }

    fn wake(&self) {
        if self.asleep.swap(false, Ordering::SeqCst) {
            self.wakes.fetch_add(1, Ordering::SeqCst);
        }
        self.woken.notify_waiters();
    }

    /// Waits until no generation runs.
    async fn until_idle(&self) {
        while self.running.load(Ordering::SeqCst) > 0 {
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
    }
}

/// A generation in progress, counted while it lives.
pub(super) struct Running(std::sync::Arc<Server>);

impl Running {
    pub(super) fn new(server: std::sync::Arc<Server>) -> Self {
        server.state.running.fetch_add(1, Ordering::SeqCst);
        Running(server)
    }
}

impl Drop for Running {
    fn drop(&mut self) {
        self.0.state.running.fetch_sub(1, Ordering::SeqCst);
    }
}

/// The value of `key` in a query string.
fn query<'q>(query: Option<&'q str>, key: &str) -> Vec<&'q str> {
    query
        .unwrap_or_default()
        .split('&')
        .filter_map(|kv| kv.split_once('='))
        .filter(|(k, _)| *k == key)
        .map(|(_, v)| v)
        .collect()
}

const SLEEP_PATHS: [&str; 6] = [
    "/sleep",
    "/wake_up",
    "/is_sleeping",
    "/collective_rpc",
    "/release_memory_occupation",
    "/resume_memory_occupation",
];

/// The sleep endpoints and the stand-in's stats; any other request is
/// given back.
pub(super) async fn endpoint(
    req: Request<Incoming>,
    server: &Server,
) -> Result<Response<Body>, Request<Incoming>> {
    let (b, state, pod) = (server.sleep, &server.state, server.id.pod.as_str());
    let answer =
        |status: StatusCode, body: Value| respond(status, JSON, full(body.to_string()), pod);
    let ok = |body: Value| answer(StatusCode::OK, body);
    let path = req.uri().path().to_owned();
    let q = req.uri().query().map(str::to_owned);
    if SLEEP_PATHS.contains(&path.as_str()) && b.mode == SleepMode::Missing {
        let error = json!({"error": {"message": format!("no route for {path}")}});
        return Ok(answer(StatusCode::NOT_FOUND, error));
    }
    let method = req.method().clone();
    Ok(match (method, path.as_str()) {
        (Method::POST, "/sleep") => {
            let (status, body) = vllm_sleep(b, state, q.as_deref()).await;
            answer(status, body)
        }
        (Method::POST, "/wake_up") => {
            tokio::time::sleep(b.wake_delay).await;
            let tags = query(q.as_deref(), "tags");
            if tags.is_empty() || tags.contains(&"kv_cache") {
                state.wake();
                ok(json!({"status": "awake"}))
            } else {
                ok(json!({"status": "sleeping", "tags": tags}))
            }
        }
        (Method::POST, "/collective_rpc") => {
            let body = read_body(req).await.unwrap_or_default();
            let v: Value = serde_json::from_slice(&body).unwrap_or(Value::Null);
            if v["method"] == "reload_weights" {
                state.weights_lost.store(false, Ordering::SeqCst);
            }
            ok(json!({"results": [null]}))
        }
        (Method::GET, "/is_sleeping") => ok(json!({"is_sleeping": state.asleep()})),
        (
            Method::GET | Method::POST,
            "/release_memory_occupation" | "/resume_memory_occupation",
        ) => {
            let release = path == "/release_memory_occupation";
            let body = read_body(req).await.unwrap_or_default();
            let (status, body) = sglang(b, state, release, &body).await;
            answer(status, body)
        }
        (Method::GET, "/fake/stats") => ok(json!({
            "asleep": state.asleep(),
            "sleep_requests": state.sleep_requests.load(Ordering::SeqCst),
            "sleeps": state.sleeps.load(Ordering::SeqCst),
            "wakes": state.wakes.load(Ordering::SeqCst),
            "inference_while_asleep": state.inference_while_asleep.load(Ordering::SeqCst),
            "aborted": state.aborted.load(Ordering::SeqCst),
            "garbage": state.garbage.load(Ordering::SeqCst),
            "prefix_hits": server.prefix.as_ref().map(|c| c.hits.load(Ordering::Relaxed)),
            "prefix_misses": server.prefix.as_ref().map(|c| c.misses.load(Ordering::Relaxed)),
        })),
        _ => return Err(req),
    })
}

/// vLLM's `POST /sleep?level=N&mode=M` (module docs): the answer's status
/// and body.
async fn vllm_sleep(b: SleepBehaviour, state: &SleepState, q: Option<&str>) -> (StatusCode, Value) {
    state.sleep_requests.fetch_add(1, Ordering::SeqCst);
    if b.mode == SleepMode::Slow {
        std::future::pending::<()>().await;
    }
    if b.mode == SleepMode::Lies {
        tokio::time::sleep(b.sleep_delay).await;
        return (StatusCode::OK, json!({"status": "sleeping"}));
    }
    let level = query(q, "level").first().copied().unwrap_or("1").to_owned();
    let mode = query(q, "mode")
        .first()
        .copied()
        .unwrap_or("abort")
        .to_owned();
    if !["abort", "wait", "keep"].contains(&mode.as_str()) {
        let error = json!({"error": {"message": "Input should be 'abort', 'wait' or 'keep'", "param": "query.mode", "code": 400}});
        return (StatusCode::BAD_REQUEST, error);
    }
    // Paused from here: new requests wait for the wake.
    state.asleep.store(true, Ordering::SeqCst);
    if mode == "abort" {
        state.aborts.fetch_add(1, Ordering::SeqCst);
    }
    if mode == "wait" {
        state.until_idle().await;
    }
    tokio::time::sleep(b.sleep_delay).await;
    if level == "2" {
        state.weights_lost.store(true, Ordering::SeqCst);
    }
    state.sleeps.fetch_add(1, Ordering::SeqCst);
    (
        StatusCode::OK,
        json!({"status": "sleeping", "level": level}),
    )
}

/// SGLang's release (`release`) or resume, with the request's `body`.
async fn sglang(
    b: SleepBehaviour,
    state: &SleepState,
    release: bool,
    body: &[u8],
) -> (StatusCode, Value) {
    if serde_json::from_slice::<Value>(body).is_err() {
        let error = json!({"object": "error", "message": "1 validation error:\n  {'type': 'missing', 'loc': ('body',), 'msg': 'Field required', 'input': None}", "code": 400});
        return (StatusCode::BAD_REQUEST, error);
    }
    if !release {
        tokio::time::sleep(b.wake_delay).await;
        state.wake();
        return (StatusCode::OK, Value::Null);
    }
    state.sleep_requests.fetch_add(1, Ordering::SeqCst);
    if state.running.load(Ordering::SeqCst) > 0 {
        let error = json!({"error": {"message": "release_memory_occupation should be called only when server is idle."}});
        return (StatusCode::BAD_REQUEST, error);
    }
    tokio::time::sleep(b.sleep_delay).await;
    if b.mode != SleepMode::Lies {
        state.asleep.store(true, Ordering::SeqCst);
        state.sleeps.fetch_add(1, Ordering::SeqCst);
    }
    (StatusCode::OK, Value::Null)
}
