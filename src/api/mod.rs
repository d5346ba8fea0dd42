//! The `ModelResidency` custom resource (`residency.dev/v1alpha1`): one
//! object per GPU. `crds/modelresidency.yaml` is generated from these types
//! by `model-residency crd`; a test fails when the two drift apart.

mod anticipate;
mod artifact;
mod copies;
mod demand_map;
mod gpu;
mod inference_pool;
mod lora;
mod model_catalog;
mod model_copies;
mod model_demand;
mod residency_set;
pub mod rules;
mod warm;

pub use anticipate::AnticipateSpec;
pub use artifact::{
    ArtifactFile, ArtifactSpec, ArtifactState, CachedArtifact, NodeModelCache, NodeModelCacheSpec,
    NodeModelCacheStatus,
};
pub use copies::CopiesSpec;
pub use demand_map::DemandMap;
pub use gpu::{
    DEFAULT_BUDGET_FRACTION, DEFAULT_DEVICE_CLASS, DEFAULT_GPU_RESOURCE, GpuMode, GpuSpec,
    GpuStatus, MIG_DEVICE_CLASS,
};
pub use inference_pool::{
    EndpointPickerRef, InferencePool, InferencePoolSpec, PoolPort, PoolSelector,
};
pub use lora::{AdapterArtifact, AdapterFile, AdapterSpec, LoraSpec, MAX_LORA_RANK_ENV};
pub use model_catalog::{CatalogRef, ModelCatalog, ModelCatalogSpec, ModelCatalogStatus};
pub use model_copies::{ModelCopies, ModelCopiesSpec, ModelCopiesStatus};
pub use model_demand::{ModelDemand, ModelDemandSpec, ModelDemandStatus};
pub use residency_set::{
    CelSelector, DeviceSelection, DeviceSelector, ModelGpus, ResidencySet, ResidencySetSpec,
    ResidencySetStatus, StampedSettings,
};
pub use warm::{EvictionPolicy, PodRequest, SleepPreset, SleepSpec, WarmSpec};

use k8s_openapi::apimachinery::pkg::apis::meta::v1::Condition;
use kube::CustomResource;
use schemars::{JsonSchema, Schema, SchemaGenerator, json_schema};
use serde::{Deserialize, Deserializer, Serialize};

/// `spec.catalog` on the wire as the plain object it is (serde's own `Arc`
/// support is a crate feature every dependant would be rebuilt for).
mod shared_catalog {
    use super::CatalogRef;
    use serde::{Deserialize, Deserializer, Serialize, Serializer};
    use std::sync::Arc;

    pub fn serialize<S: Serializer>(v: &Option<Arc<CatalogRef>>, s: S) -> Result<S::Ok, S::Error> {
        v.as_deref().serialize(s)
    }

    pub fn deserialize<'de, D: Deserializer<'de>>(
        d: D,
    ) -> Result<Option<Arc<CatalogRef>>, D::Error> {
        Ok(Option::<CatalogRef>::deserialize(d)?.map(Arc::new))
    }
}

/// Desired residency of models on one GPU.
#[derive(CustomResource, Serialize, Deserialize, Clone, Debug, PartialEq, JsonSchema)]
#[kube(
    group = "residency.dev",
    version = "v1alpha1",
    kind = "ModelResidency",
    doc = "One GPU's VRAM budget, its model registry and the demand for those models.",
    plural = "modelresidencies",
    singular = "modelresidency",
    shortname = "mres",
    namespaced,
    status = "ModelResidencyStatus",
    printcolumn = r#"{"name":"Node","type":"string","jsonPath":".status.gpu.node"}"#,
    printcolumn = r#"{"name":"Device","type":"string","jsonPath":".status.gpu.device"}"#,
    printcolumn = r#"{"name":"UUID","type":"string","jsonPath":".status.gpu.uuid","priority":1}"#,
    printcolumn = r#"{"name":"Budget","type":"string","jsonPath":".status.budget"}"#,
    printcolumn = r#"{"name":"Used","type":"string","jsonPath":".status.used"}"#,
    printcolumn = r#"{"name":"Resident","type":"integer","jsonPath":".status.resident"}"#,
    printcolumn = r#"{"name":"Loading","type":"integer","jsonPath":".status.loading"}"#,
    printcolumn = r#"{"name":"Fetching","type":"integer","jsonPath":".status.fetching","priority":1}"#,
    printcolumn = r#"{"name":"Sleeping","type":"integer","jsonPath":".status.sleeping","priority":1}"#,
    printcolumn = r#"{"name":"Refused","type":"integer","jsonPath":".status.refused"}"#,
    printcolumn = r#"{"name":"Ready","type":"string","jsonPath":".status.conditions[?(@.type==\"Ready\")].status"}"#,
    printcolumn = r#"{"name":"GPU Health","type":"string","jsonPath":".status.conditions[?(@.type==\"GpuHealthy\")].reason"}"#,
    printcolumn = r#"{"name":"Age","type":"date","jsonPath":".metadata.creationTimestamp"}"#,
    selectable = ".spec.nodeName",
    selectable = ".spec.device",
    selectable = ".status.gpu.node"
)]
#[serde(rename_all = "camelCase")]
#[schemars(extend("x-kubernetes-validations" = rules::spec()))]
pub struct ModelResidencySpec {
    /// The node that holds the GPU (a node name: lowercase letters, digits,
    /// '-' and '.'). Every model pod is kept to it by a required node
    /// affinity on the node's name; the scheduler binds it there. Required
    /// unless gpu.mode is claim, where the scheduler may choose the node.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(length(min = 1, max = 253), extend("x-kubernetes-validations" = rules::node_name()))]
    pub node_name: Option<String>,
    /// The GPU: one GPU, as an index ("0"), a UUID ("GPU-...") or a MIG
    /// instance ("MIG-..."); not "all", "none" or a list. In claim mode the
    /// claim selects the device with this index or uuid; otherwise model
    /// pods get it as NVIDIA_VISIBLE_DEVICES. In devicePlugin and env mode
    /// two residencies naming the same node and GPU are one budget: the
    /// older one holds it, the other loads nothing (Ready=False,
    /// GpuConflict); in claim mode the scheduler gives the device to one
    /// claim (the other residency says GpuUnavailable).
    #[schemars(length(min = 1, max = 128), extend("x-kubernetes-validations" = rules::one_gpu()))]
    pub device: String,
    /// How model pods get the GPU: a shared ResourceClaim (claim, the
    /// default), a device plugin's resource (devicePlugin) or only the
    /// environment variable (env).
    // Boxed, as the status's `gpu`: inline, the two made a cached
    // residency (with its Arc) 1,096 bytes, jemalloc's 1,280 class; boxed,
    // 856 (the 896 class) plus the two boxes (112 and 160), 112 bytes less
    // (history/5-memory.md).
    #[serde(default, skip_serializing_if = "is_default_gpu")]
    pub gpu: Box<GpuSpec>,
    /// VRAM budget: the most the resident models may declare together. A
    /// positive Kubernetes quantity as a string ("16000Mi", "80Gi") or bytes
    /// ("17179869184"). In claim mode it may be omitted: it is then the
    /// allocated device's memory times budgetFraction; one larger than the
    /// device's memory is cut to it (condition BudgetExceedsDevice).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub budget: Option<ByteQuantity>,
    /// The share of the device's memory that is the budget when budget is
    /// omitted (claim mode): more than 0, at most 1. Default 0.9.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(range(min = 0.01, max = 1.0), extend("x-kubernetes-validations" = rules::fraction()))]
    pub budget_fraction: Option<f64>,
    /// The model registry: every model this GPU may serve, at most 1000
    /// (the object, status included, must stay well under etcd's request
    /// limit, and the API server's budget for checking it). Keyed by name: server-side apply merges two managers'
    /// models by name. With spec.catalog, these are added to the
    /// catalog's, an entry here overriding the catalog's of its name.
    #[serde(default)]
    #[schemars(length(max = 1000), extend("x-kubernetes-list-type" = "map", "x-kubernetes-list-map-keys" = ["name"]))]
    pub models: Vec<ModelSpec>,
    /// Models declared once in a ModelCatalog of this namespace: all of
    /// its models, or those listed. The registry is the catalog's entries
    /// and spec.models; a missing catalog (or a listed model it lacks)
    /// leaves the residency Ready=False (CatalogUnavailable) with nothing
    /// unloaded or evicted for it.
    // Behind an Arc: inline it is 48 bytes, and without it a cached
    // residency (with its Arc) is 896 bytes, jemalloc's 896 class rather
    // than its 1,024; and the residencies a set stamps name one catalog
    // the same way, which the cache keeps once (`controller::cached`).
    #[serde(
        default,
        skip_serializing_if = "Option::is_none",
        with = "shared_catalog"
    )]
    #[schemars(with = "Option<CatalogRef>")]
    pub catalog: Option<std::sync::Arc<CatalogRef>>,
    /// Unload a resident model that has not been requested for this long
    /// (a duration: 90s, 10m, 1h30m), a sleeping one too (its pod is
    /// deleted and its host memory freed). Unset: keep it until it is
    /// evicted or unloaded. Pinned models are never unloaded for idleness.
    /// A model's own keepAlive overrides it.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(length(min = 1, max = 32))]
    pub keep_alive: Option<String>,
    /// Requests: model name -> the RFC 3339 time of its last request.
    /// A time newer than the model's last processed request is a new
    /// request; removing the key unloads the model. One JSON merge patch
    /// writes one key without a read: `{"spec":{"demand":{"zimage":"<now>"}}}`
    /// requests, `{"spec":{"demand":{"zimage":null}}}` unloads. Server-side
    /// apply owns single keys.
    #[serde(default, skip_serializing_if = "DemandMap::is_empty")]
    pub demand: DemandMap,
    /// How many of the most recently requested models that are not
    /// resident keep their artifacts on the node's disk (fetched ahead of
    /// their next request), within the node's disk budget. Default 0.
    #[serde(default, skip_serializing_if = "is_zero_u32")]
    #[schemars(range(min = 0, max = 64))]
    pub prefetch: u32,
    /// The warm tier: host memory for the models that sleep instead of
    /// being deleted (models with sleep). Unset: no host memory, so only
    /// level-2 sleeps (which keep none) are possible.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub warm: Option<WarmSpec>,
    /// Which resident makes room: lru (default), cost or rate.
    #[serde(default, skip_serializing_if = "is_default_eviction")]
    pub eviction: EvictionPolicy,
    /// Work ahead of demand: models loaded or woken before their requests
    /// where each model's forecast (learnt from its requests, by time of
    /// day and week) expects one soon. Unset or `enabled: false`: off, and
    /// every model waits for a request, as before.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub anticipate: Option<AnticipateSpec>,
}

fn is_default_eviction(e: &EvictionPolicy) -> bool {
    *e == EvictionPolicy::Lru
}

fn is_default_gpu(g: &GpuSpec) -> bool {
    *g == GpuSpec::default()
}

fn is_zero_u32(n: &u32) -> bool {
    *n == 0
}

/// One model in the registry.
#[derive(Serialize, Deserialize, Clone, Debug, PartialEq, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct ModelSpec {
    /// Model name: a DNS label (it names the model's pod and labels it).
    #[schemars(length(min = 1, max = 63), extend("x-kubernetes-validations" = rules::model_name()))]
    pub name: String,
    /// The model's VRAM footprint: a positive quantity as a string
    /// ("10900Mi") or bytes ("11429478400").
    pub size: ByteQuantity,
    /// A pinned model, once loaded, is never evicted to make room for
    /// another (only a budget shrink below the pinned models' total, an
    /// unload or a registry removal takes it out).
    #[serde(default)]
    pub pinned: bool,
    /// GPUs of one node this model spans at once (tensor parallel N). 2 or
    /// more makes it a gang: loaded on that many GPUs of one node at once,
    /// by one pod holding them all, only when every one of them has room
    /// (evicting each GPU's least recently used models), and evicted,
    /// unloaded and requested as one. `size` is what it holds on EACH of
    /// its GPUs (as a server's --gpu-memory-utilization is per GPU) and is
    /// charged to each one's budget. The residencies of one namespace and
    /// node that list it are the GPUs it may use; the pod learns its GPUs
    /// from the environment (RESIDENCY_GANG_SIZE, RESIDENCY_GANG_DEVICES)
    /// and one ResourceClaim reference per GPU in claim mode. Default 1.
    /// A gang that declares sleep sleeps and wakes as one (its
    /// sleepingSize held on each GPU). A gang may not declare copies, lora
    /// or artifact (yet).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(range(min = 1, max = 16))]
    pub gpus: Option<u8>,
    /// This model's idle time before it is unloaded (overrides
    /// spec.keepAlive; "0s" never unloads it for idleness).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(length(min = 1, max = 32))]
    pub keep_alive: Option<Box<str>>,
    /// Pod template of the model server (containers, volumes, ...). The
    /// operator adds the node affinity to spec.nodeName (and drops a
    /// nodeName of the template's), the GPU (NVIDIA_VISIBLE_DEVICES),
    /// labels, an owner reference and the size annotation. Checked when the model
    /// loads; a template without containers fails the load.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(schema_with = "template_schema")]
    pub template: Option<PodTemplate>,
    /// Files the model's pod needs on the node's disk: fetched by the node
    /// agent (model-residency node-agent) before the pod starts, kept in
    /// the node's cache within its disk budget, and mounted read-only at
    /// mountPath. While they are fetched the model is Fetching.
    // Boxed: most models have none, and inline it would make every cached
    // model 64 bytes larger.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub artifact: Option<Box<ArtifactSpec>>,
    /// How long a cold load takes (pod creation to Ready), as a duration
    /// (45s, 2m), until one is measured: what spec.eviction cost weighs.
    /// Default 60s.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(length(min = 1, max = 32))]
    pub load_time: Option<Box<str>>,
    /// The model's server can sleep: when room must be made it is put to
    /// sleep (keeping sleepingSize of VRAM) rather than deleted, and its
    /// next request wakes it.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub sleep: Option<Box<SleepSpec>>,
    /// Copies of the model on other GPUs under load (see CopiesSpec).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub copies: Option<Box<CopiesSpec>>,
    /// LoRA adapters of this model, loaded into its running pods on demand
    /// (see LoraSpec): a request naming an adapter is served by this
    /// model's pod with the adapter loaded.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub lora: Option<Box<LoraSpec>>,
}

/// A model's pod template, kept as its compact JSON text.
///
/// The operator caches every residency; as a `serde_json::Value` tree a
/// one-container template costs about 2 KiB (a B-tree node per JSON
/// object), as text about a hundred bytes. It is parsed only when a pod is
/// built from it. The text is shared: a model's template is usually the
/// same on every GPU, and the operator's cache keeps one copy of it
/// (`controller::cached` interns it).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct PodTemplate(std::sync::Arc<str>);

impl PodTemplate {
    /// The template as JSON text.
    pub fn json(&self) -> &str {
        &self.0
    }

    /// The shared text.
    pub fn shared(&self) -> &std::sync::Arc<str> {
        &self.0
    }

    /// A template of this shared text.
    pub fn of_shared(text: std::sync::Arc<str>) -> Self {
        PodTemplate(text)
    }
}

impl From<serde_json::Value> for PodTemplate {
    fn from(v: serde_json::Value) -> Self {
        PodTemplate(v.to_string().into())
    }
}

impl Serialize for PodTemplate {
    fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        serde_json::from_str::<serde_json::Value>(&self.0)
            .map_err(serde::ser::Error::custom)?
            .serialize(s)
    }
}

impl<'de> Deserialize<'de> for PodTemplate {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        serde_json::Value::deserialize(d).map(PodTemplate::from)
    }
}

/// What the operator decided and observed.
#[derive(Serialize, Deserialize, Clone, Debug, Default, PartialEq, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct ModelResidencyStatus {
    /// The spec generation this status reflects.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub observed_generation: Option<i64>,
    /// The budget this status was computed against.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub budget: Option<String>,
    /// The GPU: its node and device, and in claim mode the claim and what
    /// the allocated device is.
    // Boxed for the cache's size: see `ModelResidencySpec::gpu`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub gpu: Option<Box<GpuStatus>>,
    /// VRAM declared by the resident models, a sleeping one at its
    /// sleepingSize (rounded down to two decimals when no unit says it
    /// exactly).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub used: Option<String>,
    /// The most VRAM ever declared at once by resident models (rounded down
    /// like used).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub peak: Option<String>,
    /// Number of resident models (Loaded, Loading or Failed while holding
    /// VRAM).
    #[serde(default)]
    pub resident: u32,
    /// Number of resident models whose pod is not Ready yet.
    #[serde(default)]
    pub loading: u32,
    /// Number of resident models waiting for their artifact on the node's
    /// disk (before their pod may start).
    #[serde(default)]
    pub fetching: u32,
    /// Number of models whose last request was refused.
    #[serde(default)]
    pub refused: u32,
    /// Number of resident models that sleep.
    #[serde(default, skip_serializing_if = "is_zero")]
    pub sleeping: u32,
    /// Host memory the sleeping models hold (of spec.warm.hostBudget).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub host_used: Option<String>,
    /// spec.eviction cost's inflation (its L: the value of the last model
    /// made room of), carried from one decision to the next.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub inflation: Option<f64>,
    /// spec.eviction rate's clock: requests served (hits, wakes, loads)
    /// since it was chosen; each model's rate decays over it.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub served: Option<u64>,
    /// spec.eviction cost and rate: how many loads more than the seed's
    /// LRU they made recently (decayed over 256 requests); past 0.5 their
    /// victims are taken least recently used first until it falls back.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub lag: Option<f64>,
    /// One entry per registry model, plus one per demanded unknown model.
    /// Written whole by the operator (the only writer of this status): an
    /// atomic list.
    // Atomic, not a map keyed by name: as a map, every field of every entry
    // was listed in the operator's managedFields entry (about 4 KB of a
    // 20 KB object at 21 models), which the API server reads and writes on
    // every write to the object (the router's demand writes included),
    // and a field of one entry that another writer took over by
    // server-side apply stayed when the operator dropped the entry,
    // leaving it without its required `state`: every later status write
    // was refused (422). docs/performance.md has the write costs. The
    // conditions below are atomic for the second reason (BudgetExceedsDevice
    // and CannotSleep are listed only while they hold).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    #[schemars(extend("x-kubernetes-list-type" = "atomic"))]
    pub models: Vec<ModelStatus>,
    /// Running totals since the object was created.
    #[serde(default)]
    pub counters: Counters,
    /// Ready, Refused and Degraded; BudgetExceedsDevice and CannotSleep
    /// while they hold. Written whole by the operator: an atomic list.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    #[schemars(extend("x-kubernetes-list-type" = "atomic"))]
    pub conditions: Vec<Condition>,
    /// Only in the operator's cache of residencies: `models` and
    /// `conditions` kept deflated ([`crate::controller::cached`]); never
    /// sent or read on the wire.
    #[serde(skip)]
    #[schemars(skip)]
    pub packed: Option<PackedDetail>,
}

/// A cached status's `models` and `conditions`, deflated: at 10,000
/// residencies they were two fifths of the operator's memory.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct PackedDetail(pub Box<[u8]>);

/// The state of one model on this GPU.
#[derive(Serialize, Deserialize, Clone, Debug, Default, PartialEq, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct ModelStatus {
    /// Model name.
    pub name: Box<str>,
    /// Loaded, Loading, Fetching, Sleeping, Queued, Evicted, Refused,
    /// Unloaded or Failed.
    pub state: ModelState,
    /// Declared size the state was computed with.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub size: Option<Box<str>>,
    /// lastRequested of the newest request processed for this model.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub last_requested: Option<Box<str>>,
    /// lastRequested of the request that last hit or loaded it: the LRU key.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub last_used: Option<Box<str>>,
    /// When its pod became Ready.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub loaded_at: Option<Box<str>>,
    /// While a load is under way: when it was admitted. The load's one
    /// `Loaded` event is published, and this cleared, once its pod is
    /// Ready, or once the model leaves the GPU before that.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub admitted_at: Option<Box<str>>,
    /// The model's pod, while it has one.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub pod: Option<Box<str>>,
    /// The LoRA adapters its pod's server holds, as the server said when
    /// last asked (every --sleep-audit-interval), in its order.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub adapters: Vec<Box<str>>,
    /// Load failures in a row (reset when a pod becomes Ready).
    #[serde(default, skip_serializing_if = "is_zero")]
    pub failures: u32,
    /// After a failure: when the next load attempt is due.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub retry_at: Option<Box<str>>,
    /// A CamelCase reason for the state (e.g. LargerThanBudget, MadeRoom).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub reason: Option<Box<str>>,
    /// When it was loaded or woken ahead of demand (`spec.anticipate`);
    /// cleared by its first request since, or when it leaves the GPU or
    /// falls asleep unused (counted in counters.anticipatedUsed and
    /// anticipatedWasted).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub anticipated_at: Option<Box<str>>,
    /// With spec.anticipate on: the start of the ten-minute slot in which
    /// its forecast next expects a request (the current one while it is
    /// busy); absent when it expects none within a week.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub expected_next: Option<Box<str>>,
    /// A human-readable explanation.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub message: Option<Box<str>>,
    /// Measured seconds from pod creation to Ready, a moving average of
    /// its loads (the last weighs 0.3).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub load_seconds: Option<f64>,
    /// Measured seconds of a wake, a moving average like loadSeconds.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub wake_seconds: Option<f64>,
    /// While Sleeping: when its sleep was decided (FallingAsleep) or
    /// confirmed (Asleep).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub slept_at: Option<Box<str>>,
    /// spec.eviction cost: requests served since it became resident, and
    /// the inflation at its last use (its value's base).
    #[serde(default, skip_serializing_if = "is_zero_u64")]
    pub uses: u64,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub value_base: Option<f64>,
    /// spec.eviction rate: its requests, each decayed by the requests
    /// served since (half-life 500), as counted at rateAt (status.served
    /// then). Kept while it is not resident.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub rate: Option<f64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub rate_at: Option<u64>,
}

/// A cached copy's models are packed: whoever reads them from the cache
/// unpacks it first (`cached::unpacked`); debug builds (the tests) check.
const UNPACK_FIRST: &str = "a cached status read without cached::unpacked";

fn is_zero_u64(n: &u64) -> bool {
    *n == 0
}

impl ModelResidency {
    /// The model's entry in status, if status has one.
    pub fn model_status(&self, model: &str) -> Option<&ModelStatus> {
        self.status.as_ref()?.model(model)
    }

    /// The model's state as status says (Unloaded when it says nothing).
    pub fn model_state(&self, model: &str) -> ModelState {
        self.model_status(model)
            .map(|m| m.state)
            .unwrap_or_default()
    }
}

impl ModelResidencyStatus {
    /// The status of the model named `name`, if it has one.
    pub fn model(&self, name: &str) -> Option<&ModelStatus> {
        debug_assert!(self.packed.is_none(), "{UNPACK_FIRST}");
        self.models.iter().find(|m| &*m.name == name)
    }

    /// The same, to change it.
    pub fn model_mut(&mut self, name: &str) -> Option<&mut ModelStatus> {
        debug_assert!(self.packed.is_none(), "{UNPACK_FIRST}");
        self.models.iter_mut().find(|m| &*m.name == name)
    }

    /// Sets the resident, loading and refused counts from the models.
    pub fn recount(&mut self) {
        let count =
            |f: fn(&ModelStatus) -> bool| self.models.iter().filter(|m| f(m)).count() as u32;
        self.resident = count(ModelStatus::is_resident);
        self.loading = count(|m| m.state == ModelState::Loading);
        self.fetching = count(|m| m.state == ModelState::Fetching);
        self.refused = count(|m| m.state == ModelState::Refused);
        self.sleeping = count(|m| m.state == ModelState::Sleeping);
    }
}

impl ModelStatus {
    /// Whether the model holds VRAM in the budget: Loaded, Loading, or Failed
    /// after it was admitted. A load refused for an invalid template fails
    /// without being admitted, so it holds none.
    pub fn is_resident(&self) -> bool {
        self.state.is_resident()
            && !(self.state == ModelState::Failed
                && self.reason.as_deref() == Some(INVALID_TEMPLATE_REQUEST))
    }
}

/// The reason of a load that failed before admission: the model's pod
/// template is unusable (the reconciler's `Reason::InvalidTemplate`).
const INVALID_TEMPLATE_REQUEST: &str = "InvalidTemplate";

fn is_zero(n: &u32) -> bool {
    *n == 0
}

/// Where a model stands.
#[derive(Serialize, Deserialize, Clone, Copy, Debug, Default, PartialEq, Eq, JsonSchema)]
pub enum ModelState {
    /// Resident and its pod is Ready.
    Loaded,
    /// Resident; its pod is starting, or waiting for evicted pods to go.
    Loading,
    /// Resident; its artifact is being fetched onto the node's disk (by the
    /// node agent) before its pod may start.
    Fetching,
    /// Requested, not resident yet: the only models its load could evict
    /// are still loading, and a loading model is never evicted. Admitted,
    /// in request order, once one of them has been ready for 5 s (the
    /// requests that waited for it reach it first).
    Queued,
    /// Taken out to make room for another model or by a budget shrink.
    Evicted,
    /// Its last request was refused (see reason).
    Refused,
    /// Resident, its server asleep (it holds its sleepingSize of VRAM
    /// once the sleep is confirmed, reason Asleep; its full size while
    /// reason is FallingAsleep). A request wakes it.
    Sleeping,
    /// Never loaded, or unloaded by demand removal.
    #[default]
    Unloaded,
    /// Its load failed: its pod failed (resident, retried with backoff), or
    /// its template is invalid (nothing was evicted for it).
    Failed,
}

impl ModelState {
    /// Its name, as status and the metrics write it.
    pub fn as_str(self) -> &'static str {
        match self {
            ModelState::Loaded => "Loaded",
            ModelState::Loading => "Loading",
            ModelState::Fetching => "Fetching",
            ModelState::Queued => "Queued",
            ModelState::Evicted => "Evicted",
            ModelState::Refused => "Refused",
            ModelState::Sleeping => "Sleeping",
            ModelState::Unloaded => "Unloaded",
            ModelState::Failed => "Failed",
        }
    }

    /// Whether a model in this state may hold VRAM (see
    /// [`ModelStatus::is_resident`] for whether it does).
    pub fn is_resident(self) -> bool {
        matches!(
            self,
            ModelState::Loaded
                | ModelState::Loading
                | ModelState::Fetching
                | ModelState::Failed
                | ModelState::Sleeping
        )
    }
}

/// Running totals, kept in status (one type with the engine's).
pub use crate::engine::Counters;

/// A VRAM quantity as written in the spec: a string like `16000Mi`, or an
/// integer number of bytes. Parsed to bytes by the reconciler.
#[derive(Serialize, Clone, Debug, PartialEq, Eq)]
pub struct ByteQuantity(pub String);

impl<'de> Deserialize<'de> for ByteQuantity {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        #[derive(Deserialize)]
        #[serde(untagged)]
        enum Raw {
            Int(i64),
            UInt(u64),
            Str(String),
        }
        Ok(ByteQuantity(match Raw::deserialize(d)? {
            Raw::Int(i) => i.to_string(),
            Raw::UInt(u) => u.to_string(),
            Raw::Str(s) => s,
        }))
    }
}

impl JsonSchema for ByteQuantity {
    fn schema_name() -> std::borrow::Cow<'static, str> {
        "ByteQuantity".into()
    }
    fn inline_schema() -> bool {
        true
    }
    fn json_schema(_: &mut SchemaGenerator) -> Schema {
        // A string, not int-or-string: kubectl explain can name only a
        // declared type (it showed int-or-string as <Object>), and a
        // quantity's digits alone are bytes anyway ("17179869184").
        let mut schema = json_schema!({
            "type": "string",
            "minLength": 1,
            "maxLength": 64,
        });
        schema.insert(
            "x-kubernetes-validations".into(),
            rules::positive_quantity(),
        );
        schema
    }
}

fn template_schema(_: &mut SchemaGenerator) -> Schema {
    // The full PodTemplateSpec schema would make the CRD too large for
    // client-side `kubectl apply`; the reconciler checks the template.
    json_schema!({
        "type": "object",
        "x-kubernetes-preserve-unknown-fields": true,
    })
}

/// The ModelResidency CRD as YAML, exactly as committed in
/// `crds/modelresidency.yaml`.
pub fn crd_yaml() -> String {
    use kube::CustomResourceExt;
    yaml_document(&ModelResidency::crd())
}

/// The ModelDemand CRD as YAML, exactly as committed in
/// `crds/modeldemand.yaml`.
pub fn model_demand_crd_yaml() -> String {
    use kube::CustomResourceExt;
    yaml_document(&ModelDemand::crd())
}

/// Every CRD of the project, as committed under `crds/` (file name, YAML).
pub fn crd_files() -> [(&'static str, String); 6] {
    use kube::CustomResourceExt;
    [
        ("modelresidency.yaml", crd_yaml()),
        ("modelcatalog.yaml", yaml_document(&ModelCatalog::crd())),
        ("residencyset.yaml", yaml_document(&ResidencySet::crd())),
        ("modeldemand.yaml", model_demand_crd_yaml()),
        ("modelcopies.yaml", yaml_document(&ModelCopies::crd())),
        ("nodemodelcache.yaml", yaml_document(&NodeModelCache::crd())),
    ]
}

fn yaml_document(
    crd: &k8s_openapi::apiextensions_apiserver::pkg::apis::apiextensions::v1::CustomResourceDefinition,
) -> String {
    let crd = serde_json::to_value(crd).expect("CRD serializes");
    let body = serde_saphyr::to_string(&crd).expect("CRD serializes to YAML");
    format!("# Generated by `model-residency crd`; do not edit.\n---\n{body}")
}
