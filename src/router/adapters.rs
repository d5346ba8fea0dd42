//! LoRA adapters in the request path: a request whose model is an
//! adapter's name goes to a Ready pod of its base model, one that holds the
//! adapter when there is one; else the router loads it into the chosen pod
//! through the server's own API (vLLM's `POST /v1/load_lora_adapter`)
//! before sending the request on, unloading the least recently used
//! unpinned adapter first when the pod's slots are full
//! ([`crate::engine::adapters`]).
//!
//! Why the router and not the operator: the load is on the request's path
//! either way (the request cannot be answered before it), and the router
//! is already there; asking the operator would add a status round trip
//! (seconds) to every adapter miss, and the operator's reconcile would do
//! an HTTP call per pod per adapter change. The cost: each router replica
//! keeps its own view of what a pod holds, so two replicas can each evict
//! what the other loaded; each then reloads on its next miss (a load is a
//! file read, tens of milliseconds), and the server stays within its slots
//! since each load call is the server's own LRU's (vLLM keeps at most
//! --max-cpu-loras in memory whatever it is sent). vLLM's
//! `lora_filesystem_resolver` (a request naming an unknown adapter loads it
//! from a directory) is not used: it never unloads, so a server of a
//! hundred adapters keeps all of them registered, and it answers a missing
//! directory only as "model does not exist".
//!
//! What a pod holds is what its server says: a pod replaced under the same
//! name (another UID) starts with nothing, and a request answered 404 (the
//! server no longer knows the adapter: its container restarted) forgets
//! what the pod was thought to hold and loads again once.

use super::errors::Refusal;
use super::metrics::AdapterLabels;
use super::snapshot::{AdapterView, Endpoint, Snapshot};
use super::*;
use crate::engine::adapters::{AdapterPlan, AdapterSlots};

/// What one pod holds, and its turn to load: loads into one pod go one at
/// a time, so concurrent requests for one adapter trigger one load.
pub(super) struct PodAdapters {
    slots: Mutex<AdapterSlots>,
    turn: tokio::sync::Mutex<()>,
}

/// A request served by an adapter: it is no victim until the request's
/// answer ends.
pub(super) struct InUse {
    pod: Arc<PodAdapters>,
    name: String,
}

impl Drop for InUse {
    fn drop(&mut self) {
        self.pod
            .slots
            .lock()
            .expect("adapter slots")
            .release(&self.name);
    }
}

/// The router's view of every pod's adapters, by pod UID.
#[derive(Default)]
pub(super) struct Adapters {
    pods: Mutex<HashMap<Arc<str>, Arc<PodAdapters>>>,
}

impl Adapters {
    fn pod(&self, uid: &Arc<str>, capacity: u32) -> Arc<PodAdapters> {
        let mut pods = self.pods.lock().expect("adapter pods");
        let pod = pods.entry(uid.clone()).or_insert_with(|| {
            Arc::new(PodAdapters {
                slots: Mutex::new(AdapterSlots::new(capacity)),
                turn: tokio::sync::Mutex::new(()),
            })
        });
        pod.slots.lock().expect("adapter slots").resize(capacity);
        pod.clone()
    }

    /// Whether the pod of `uid` holds `adapter` (balancing's affinity).
    pub(super) fn holds(&self, uid: &str, adapter: &str) -> bool {
        let pods = self.pods.lock().expect("adapter pods");
        pods.get(uid)
            .is_some_and(|p| p.slots.lock().expect("adapter slots").holds(adapter))
    }

    /// The pod of `uid` holds nothing the router knows of.
    pub(super) fn forget(&self, uid: &str) {
        if let Some(p) = self.pods.lock().expect("adapter pods").get(uid) {
            p.slots.lock().expect("adapter slots").forget();
        }
    }

    /// Drops the pods `snapshot` does not list as Ready (when it serves
    /// again, its server says what it holds: "already loaded" is loaded).
    /// Nothing to do, and no set made, for a router that loaded no adapter.
    pub(super) fn retain(&self, snapshot: &Snapshot) {
        let mut pods = self.pods.lock().expect("adapter pods");
        if pods.is_empty() {
            return;
        }
        let live: std::collections::HashSet<&str> = snapshot
            .models
            .values()
            .flat_map(|v| &v.ready)
            .map(|e| &*e.uid)
            .collect();
        pods.retain(|uid, _| live.contains(&**uid));
    }
}

impl Router {
    /// The adapter loaded in `endpoint`'s pod, and held there for one
    /// request: at once if it is, else after its load (and an eviction).
    pub(super) async fn adapter_in(
        &self,
        endpoint: &Endpoint,
        adapter: &AdapterView,
    ) -> Result<InUse, Refusal> {
        let labels = AdapterLabels {
            model: adapter.base.clone(),
            adapter: adapter.name.clone(),
        };
        let pod = self.adapters.pod(&endpoint.uid, adapter.capacity);
        let in_use = || InUse {
            pod: pod.clone(),
            name: adapter.name.clone(),
        };
        let hit = || {
            let held = pod
                .slots
                .lock()
                .expect("adapter slots")
                .begin(&adapter.name);
            if held {
                self.metrics.adapter_hits.get_or_create(&labels).inc();
            }
            held
        };
        if hit() {
            return Ok(in_use());
        }
        let _turn = pod.turn.lock().await;
        // Loaded by the request whose turn came first.
        if hit() {
            return Ok(in_use());
        }
        // The victim leaves the view at once, under the lock that chose it:
        // a request for it arriving during the unload call must not count
        // it held and be sent to a server that is dropping it.
        let plan = {
            let mut slots = pod.slots.lock().expect("adapter slots");
            let plan = slots.plan(&adapter.name);
            if let AdapterPlan::Load {
                evict: Some(victim),
            } = &plan
            {
                slots.unloaded(victim);
            }
            plan
        };
        let evict = match plan {
            AdapterPlan::Hit => None,
            AdapterPlan::Load { evict } => evict,
            AdapterPlan::Full => {
                return Err(Refusal::ModelUnavailable {
                    message: format!(
                        "every adapter slot of model `{}`'s pod {} holds a pinned adapter or one serving requests; `{}` cannot be loaded now",
                        adapter.base, endpoint.pod, adapter.name
                    ),
                    retry_after: Duration::from_secs(1),
                });
            }
        };
        let started = Instant::now();
        if let Some(victim) = evict {
            self.unload(endpoint, &victim).await?;
            self.metrics
                .adapter_evictions
                .get_or_create(&AdapterLabels {
                    model: adapter.base.clone(),
                    adapter: victim.clone(),
                })
                .inc();
            tracing::info!(pod = %endpoint.pod, adapter = %victim, for_adapter = %adapter.name, "adapter unloaded to make room");
        }
        match self.load(endpoint, adapter).await {
            Ok(()) => {
                self.metrics
                    .adapter_load_seconds
                    .observe(started.elapsed().as_secs_f64());
                self.metrics.adapter_loads.get_or_create(&labels).inc();
                let mut slots = pod.slots.lock().expect("adapter slots");
                slots.loaded(&adapter.name, adapter.pinned);
                slots.begin(&adapter.name);
                tracing::info!(pod = %endpoint.pod, adapter = %adapter.name, "adapter loaded");
                Ok(in_use())
            }
            Err(message) => {
                self.metrics
                    .adapter_load_failures
                    .get_or_create(&labels)
                    .inc();
                Err(Refusal::AdapterLoadFailed(message))
            }
        }
    }

    /// The server's load call; "already loaded" is loaded (another replica
    /// loaded it, or this one forgot).
    async fn load(&self, endpoint: &Endpoint, adapter: &AdapterView) -> Result<(), String> {
        let body = serde_json::json!({"lora_name": adapter.name, "lora_path": adapter.path});
        let (status, answer) = self
            .adapter_call(endpoint, "/v1/load_lora_adapter", &body)
            .await
            .map_err(|e| {
                format!(
                    "loading the adapter `{}` into model `{}`'s pod {}: the server did not answer: {e}",
                    adapter.name, adapter.base, endpoint.pod
                )
            })?;
        if status == 200 || already_loaded(status, &answer) {
            return Ok(());
        }
        Err(format!(
            "loading the adapter `{}` from {} into model `{}`'s pod {} failed: the server answered {}: {}",
            adapter.name,
            adapter.path,
            adapter.base,
            endpoint.pod,
            status,
            server_message(&answer)
        ))
    }

    /// The server's unload call; an adapter it does not hold is unloaded.
    async fn unload(&self, endpoint: &Endpoint, victim: &str) -> Result<(), Refusal> {
        let body = serde_json::json!({"lora_name": victim});
        let (status, answer) = self
            .adapter_call(endpoint, "/v1/unload_lora_adapter", &body)
            .await
            .map_err(|e| {
                Refusal::Upstream(format!(
                    "unloading the adapter `{victim}` from pod {}: the server did not answer: {e}",
                    endpoint.pod
                ))
            })?;
        match status {
            200 | 404 => Ok(()),
            s => Err(Refusal::AdapterLoadFailed(format!(
                "unloading the adapter `{victim}` from pod {} to make room failed: the server answered {s}: {}",
                endpoint.pod,
                server_message(&answer)
            ))),
        }
    }

    /// One POST of the adapter API to the pod, on this worker's kept
    /// connections to it (the ones requests use: no connection opened per
    /// load), within the load timeout; the answer read to at most 64 KiB.
    async fn adapter_call(
        &self,
        endpoint: &Endpoint,
        path: &str,
        body: &serde_json::Value,
    ) -> Result<(u16, String), String> {
        let (parts, ()) = http::Request::builder()
            .method(http::Method::POST)
            .uri(path)
            .header(http::header::CONTENT_TYPE, "application/json")
            .body(())
            .map_err(|e| e.to_string())?
            .into_parts();
        let call = async {
            let answer = proxy::send(
                &proxy::thread_upstream(),
                endpoint.addr,
                &parts,
                Bytes::from(body.to_string()),
            )
            .await
            .map_err(|e| match e {
                proxy::SendError::Connect(e) | proxy::SendError::Other(e) => e,
            })?;
            let status = answer.status().as_u16();
            let limited = http_body_util::Limited::new(answer.into_body(), 64 << 10);
            let bytes = limited
                .collect()
                .await
                .map_err(|e| format!("reading its answer: {e}"))?
                .to_bytes();
            Ok((status, String::from_utf8_lossy(&bytes).into_owned()))
        };
        tokio::time::timeout(self.config.load_timeout, call)
            .await
            .unwrap_or_else(|_| Err("no answer within the load timeout".into()))
    }
}

/// vLLM's answer to loading a name it holds: 400, "has already been loaded".
fn already_loaded(status: u16, body: &str) -> bool {
    status == 400 && body.contains("already been loaded")
}

/// The server's error message (OpenAI-shaped or not), for the client.
fn server_message(body: &str) -> String {
    let parsed: Option<String> = serde_json::from_str::<serde_json::Value>(body)
        .ok()
        .and_then(|v| {
            v.pointer("/error/message")
                .or_else(|| v.get("message"))
                .or_else(|| v.get("detail"))
                .and_then(|m| m.as_str().map(str::to_owned))
        });
    let text = parsed.unwrap_or_else(|| body.trim().to_owned());
    text.chars().take(500).collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_servers_words_reach_the_client() {
        let vllm = r#"{"error":{"message":"Loading lora a failed: No adapter found for /x","type":"NotFoundError","param":null,"code":404}}"#;
        assert_eq!(
            server_message(vllm),
            "Loading lora a failed: No adapter found for /x"
        );
        assert_eq!(server_message("plain words\n"), "plain words");
        assert!(already_loaded(
            400,
            r#"{"error":{"message":"The lora adapter 'a' has already been loaded."}}"#
        ));
        assert!(!already_loaded(500, "already been loaded"));
    }
}
