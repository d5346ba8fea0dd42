//! The warm tier's fields: how a model sleeps and wakes
//! (`spec.models[].sleep`), the host memory its sleeping copies may hold
//! (`spec.warm`), and which victim makes room (`spec.eviction`).

use super::ByteQuantity;
use schemars::JsonSchema;
use serde::{Deserialize, Serialize};

/// How a model's server sleeps, wakes and says which it is doing.
#[derive(Serialize, Deserialize, Clone, Debug, PartialEq, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct SleepSpec {
    /// The server's own endpoints. vllm (0.17 and later): POST
    /// /sleep?level=N&mode=wait (the server finishes the requests it is
    /// running first), POST /wake_up (at level 2 /wake_up?tags=weights,
    /// POST /collective_rpc {"method":"reload_weights"}, /wake_up?tags=kv_cache),
    /// GET /is_sleeping; the server needs VLLM_SERVER_DEV_MODE=1, and
    /// --enable-sleep-mode for a sleep to free GPU memory. sglang: POST
    /// /release_memory_occupation {} (tried again until the server is idle),
    /// POST /resume_memory_occupation {}; no status endpoint, so the
    /// answer is the confirmation; the server needs --enable-memory-saver
    /// (and --enable-weights-cpu-backup for level 1). Requests given below
    /// replace the preset's.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub preset: Option<SleepPreset>,
    /// 1: the weights go to host memory (wakes fast, holds hostMemory);
    /// 2: they are discarded (wakes slower, holds no host memory). Default 1.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(range(min = 1, max = 2))]
    pub level: Option<u8>,
    /// VRAM the sleeping server keeps (its CUDA context and what it does
    /// not release): counted in the budget while it sleeps. Required;
    /// smaller than the model's size.
    pub sleeping_size: ByteQuantity,
    /// Host RAM the offloaded weights take while it sleeps at level 1,
    /// counted in spec.warm.hostBudget. Default: the model's size.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub host_memory: Option<ByteQuantity>,
    /// How long a wake takes, as a duration (2s, 500ms), until one is
    /// measured; used by spec.eviction cost. Default: loadTime / 20.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(length(min = 1, max = 32), extend("x-kubernetes-validations" = super::rules::duration()))]
    pub wake_time: Option<String>,
    /// The request that puts it to sleep (replaces the preset's).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub sleep: Option<PodRequest>,
    /// The request that wakes it (replaces the preset's).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub wake: Option<PodRequest>,
    /// The request that says whether it sleeps (replaces the preset's):
    /// its answer is a JSON object whose boolean `field` is true while it
    /// sleeps.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub status: Option<PodRequest>,
}

/// A server whose sleep endpoints are known.
#[derive(Serialize, Deserialize, Clone, Copy, Debug, PartialEq, Eq, JsonSchema)]
#[serde(rename_all = "lowercase")]
pub enum SleepPreset {
    Vllm,
    Sglang,
}

/// One HTTP request to the model's pod, on its first container port.
#[derive(Serialize, Deserialize, Clone, Debug, PartialEq, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct PodRequest {
    /// GET, POST or PUT. Default POST (GET for status).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(extend("enum" = ["GET", "POST", "PUT"]))]
    pub method: Option<String>,
    /// Path and query on the model's pod, starting with '/'.
    #[schemars(length(min = 1, max = 256), extend("x-kubernetes-validations" = super::rules::pod_path()))]
    pub path: String,
    /// The answer's status code that means it worked. Default: any 2xx.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub expect_status: Option<u16>,
    /// For a status request: the boolean field of the JSON answer that is
    /// true while the server sleeps. Default is_sleeping.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub field: Option<String>,
    /// A JSON body to send (as is, with Content-Type application/json).
    /// Default: none.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(length(max = 4096))]
    pub body: Option<String>,
    /// How long to wait for the answer, as a duration. Default 30s (a
    /// preset's sleep: 2m, since it waits for the requests running); the
    /// operator's --pod-call-timeout-max (default 2m) caps it.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(length(min = 1, max = 32), extend("x-kubernetes-validations" = super::rules::duration()))]
    pub timeout: Option<String>,
}

/// The warm tier of this GPU.
#[derive(Serialize, Deserialize, Clone, Debug, PartialEq, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct WarmSpec {
    /// Host memory this GPU's sleeping models may hold together (level 1
    /// offloads their weights there). The residencies of one node share
    /// its RAM: their hostBudgets together, plus what the pods need
    /// awake, must fit the node's memory.
    pub host_budget: ByteQuantity,
}

/// Which resident makes room for a load or a wake.
#[derive(Serialize, Deserialize, Clone, Copy, Debug, Default, PartialEq, Eq, JsonSchema)]
#[serde(rename_all = "lowercase")]
pub enum EvictionPolicy {
    /// The least recently used (the default).
    #[default]
    Lru,
    /// The least valuable by GreedyDual-Size-Frequency: how often it is
    /// used and how recently, what bringing it back would cost (its
    /// measured load or wake time), per GiB it frees (docs/warm.md).
    Cost,
    /// The one whose absence would cause the least waiting per GiB it
    /// frees: its request rate (kept across evictions, decayed over
    /// requests served) times what bringing it back costs; a victim
    /// sleeps only if the sleepers it would push out of host memory are
    /// worth less (docs/warm.md).
    Rate,
}

impl From<EvictionPolicy> for crate::engine::Eviction {
    fn from(p: EvictionPolicy) -> Self {
        match p {
            EvictionPolicy::Lru => crate::engine::Eviction::Lru,
            EvictionPolicy::Cost => crate::engine::Eviction::Cost,
            EvictionPolicy::Rate => crate::engine::Eviction::Rate,
        }
    }
}
