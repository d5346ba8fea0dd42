//! What the operator keeps in memory per residency, in heap bytes, counted
//! by a global allocator wrapper (no cluster needed).
//!
//! Run: `cargo bench --bench heap`. Prints, for 1,000 residencies shaped
//! like those of `cargo bench --bench cluster -- memory` (3 models, one
//! resident with its pod): the cached residency, its metrics record and its
//! pod-cache entry; then a residency as a ResidencySet stamps it (`-- set`),
//! whole and with each of its parts left out, to say what each costs. RSS
//! adds the allocator's own overhead and what is in flight; this is the
//! floor under it.

use k8s_openapi::api::core::v1::Pod;
use kube::runtime::watcher;
use model_residency::api::{ModelResidency, ModelResidencyStatus};
use model_residency::controller::cached;
use model_residency::controller::claims::GpuClaims;
use model_residency::controller::pod_cache::PodCache;
use model_residency::metrics::Metrics;
use model_residency::residency::state::Usage;
use serde_json::json;
use std::alloc::{GlobalAlloc, Layout, System};
use std::sync::Arc;
use std::sync::atomic::{AtomicIsize, Ordering};

/// Counts the bytes currently allocated.
struct Counting;

static LIVE: AtomicIsize = AtomicIsize::new(0);

// SAFETY: forwards to the system allocator unchanged; only counts.
#[allow(unsafe_code)] // a global allocator is unsafe to implement
unsafe impl GlobalAlloc for Counting {
    unsafe fn alloc(&self, l: Layout) -> *mut u8 {
        LIVE.fetch_add(l.size() as isize, Ordering::Relaxed);
        // SAFETY: the caller's contract is passed on as is.
        unsafe { System.alloc(l) }
    }
    unsafe fn dealloc(&self, p: *mut u8, l: Layout) {
        LIVE.fetch_sub(l.size() as isize, Ordering::Relaxed);
        // SAFETY: as above.
        unsafe { System.dealloc(p, l) }
    }
}

#[global_allocator]
static ALLOCATOR: Counting = Counting;

const N: usize = 1000;

/// Heap bytes per item that `add` leaves allocated when called for each of
/// N items.
fn retained_per_item(mut add: impl FnMut(usize)) -> isize {
    let before = LIVE.load(Ordering::Relaxed);
    (0..N).for_each(&mut add);
    (LIVE.load(Ordering::Relaxed) - before) / N as isize
}

/// The three conditions the operator writes on a residency with
/// `resident` models ready, at `generation`.
fn conditions(resident: u32, generation: i64) -> serde_json::Value {
    let condition = |t: &str, s: &str, reason: &str, message: &str| {
        json!({"type": t, "status": s, "reason": reason, "message": message,
            "lastTransitionTime": "2026-11-30T07:00:02Z", "observedGeneration": generation})
    };
    json!([
        condition(
            "Ready",
            "True",
            "AllResidentModelsReady",
            &format!("{resident} resident model(s) ready")
        ),
        condition("Refused", "False", "NoRefusals", "no refused models"),
        condition("Degraded", "False", "NoLoadFailures", "no failed loads"),
    ])
}

fn residency_json(i: usize) -> String {
    let models: Vec<_> = (0..3)
        .map(|m| json!({"name": format!("model-{m}"), "size": "2Gi",
            "template": {"spec": {"containers": [{"name": "server", "image": format!("example/model-{m}:1")}]}}}))
        .collect();
    json!({
        "apiVersion": "residency.dev/v1alpha1", "kind": "ModelResidency",
        "metadata": {"name": format!("m0-{i}"), "namespace": "bench",
            "uid": "0b6f6a55-3a4e-4d1e-9a57-2f1c9d7c2c11", "resourceVersion": "1234567",
            "generation": 2, "creationTimestamp": "2026-11-30T07:00:00Z",
            // As the API server sends it: who wrote what (the cache drops it).
            "managedFields": [
                {"manager": "bench", "operation": "Update", "apiVersion": "residency.dev/v1alpha1",
                    "time": "2026-11-30T07:00:00Z", "fieldsType": "FieldsV1",
                    "fieldsV1": {"f:spec": {".": {}, "f:budget": {}, "f:device": {}, "f:models": {}, "f:nodeName": {}}}},
                {"manager": "model-residency", "operation": "Apply", "apiVersion": "residency.dev/v1alpha1",
                    "time": "2026-11-30T07:00:02Z", "fieldsType": "FieldsV1", "subresource": "status",
                    "fieldsV1": {"f:status": {"f:budget": {}, "f:conditions": {}, "f:counters": {}, "f:models": {}}}}]},
        // Env mode: the GPU conflict index holds every residency (claim
        // mode's hold none of it; the scheduler decides).
        "spec": {"nodeName": "node-34", "device": i.to_string(), "budget": "8Gi", "models": models,
            "gpu": {"mode": "env"},
            "demand": {"model-0": "2026-11-30T07:00:01.123456Z"}},
        "status": {"observedGeneration": 2, "budget": "8Gi", "used": "2Gi", "peak": "2Gi",
            "resident": 1, "refused": 0,
            "models": [
                {"name": "model-0", "state": "Loaded", "size": "2Gi",
                    "lastRequested": "2026-11-30T07:00:01.123456Z",
                    "lastUsed": "2026-11-30T07:00:01.123456Z", "loadedAt": "2026-11-30T07:00:02Z",
                    "pod": format!("m0-{i}-model-0"), "reason": "Loaded", "message": "ready"},
                {"name": "model-1", "state": "Unloaded", "size": "2Gi"},
                {"name": "model-2", "state": "Unloaded", "size": "2Gi"}],
            "counters": {"hits": 0, "loads": 1, "evictions": 0, "refusals": 0, "unloads": 0},
            "conditions": conditions(1, 2)}
    })
    .to_string()
}

/// A residency as a ResidencySet stamps it (`cargo bench --bench cluster
/// -- set`: env mode, three catalog models, none loaded) with the status
/// the operator writes on it.
fn stamped_json(i: usize, leave_out: &[&str]) -> String {
    let mut r = json!({
        "apiVersion": "residency.dev/v1alpha1", "kind": "ModelResidency",
        "metadata": {"name": format!("fleet-node-{}-gpu-{}", i / 100, i % 100), "namespace": "bench",
            "uid": "0b6f6a55-3a4e-4d1e-9a57-2f1c9d7c2c11", "resourceVersion": "1234567",
            "generation": 1, "creationTimestamp": "2026-11-30T07:00:00Z",
            "labels": {"residency.dev/set": "fleet"},
            "annotations": {"residency.dev/set-device": format!("node-{}/gpu-{}", i / 100, i % 100)},
            "ownerReferences": [{"apiVersion": "residency.dev/v1alpha1", "kind": "ResidencySet",
                "name": "fleet", "uid": "0b6f6a55-3a4e-4d1e-9a57-2f1c9d7c2c12", "controller": true,
                "blockOwnerDeletion": true}]},
        "spec": {"nodeName": format!("node-{}", i / 100),
            "device": format!("GPU-0000e57a-0000-0000-0000-{i:012x}"),
            "catalog": {"name": "fleet", "models": ["model-0", "model-1", "model-2"]},
            "budget": "12Gi", "gpu": {"mode": "env"}},
        "status": {"observedGeneration": 1, "budget": "12Gi", "used": "0", "peak": "0",
            "gpu": {"mode": "env", "node": format!("node-{}", i / 100), "device": format!("GPU-0000e57a-0000-0000-0000-{i:012x}")},
            "resident": 0, "refused": 0,
            "models": [
                {"name": "model-0", "state": "Unloaded", "size": "2Gi"},
                {"name": "model-1", "state": "Unloaded", "size": "2Gi"},
                {"name": "model-2", "state": "Unloaded", "size": "2Gi"}],
            "counters": {"hits": 0, "loads": 0, "evictions": 0, "refusals": 0, "unloads": 0},
            "conditions": conditions(0, 1)}
    });
    for path in leave_out {
        let (parent, key) = path.rsplit_once('/').unwrap();
        if let Some(o) = r.pointer_mut(parent).and_then(|v| v.as_object_mut()) {
            o.remove(key);
        }
    }
    r.to_string()
}

fn pod(i: usize) -> Pod {
    let residency = format!("m0-{i}");
    serde_json::from_value(json!({
        "metadata": {"name": format!("{residency}-model-0"), "namespace": "bench",
            "uid": "0b6f6a55-3a4e-4d1e-9a57-2f1c9d7c2c11", "resourceVersion": (i + 1).to_string(),
            "creationTimestamp": "2026-11-30T07:00:00Z",
            "labels": {"residency.dev/residency": residency, "residency.dev/model": "model-0"},
            "annotations": {"residency.dev/size": "2147483648"},
            "ownerReferences": [{"apiVersion": "residency.dev/v1alpha1", "kind": "ModelResidency",
                "name": residency, "uid": "0b6f6a55-3a4e-4d1e-9a57-2f1c9d7c2c12", "controller": true}]},
        "spec": {"nodeName": "node-34", "containers": [{"name": "server", "image": "example/model-0:1"}]},
        "status": {"phase": "Running", "conditions": [
            {"type": "Ready", "status": "True", "lastTransitionTime": "2026-11-30T07:00:02Z"}]}
    }))
    .unwrap()
}

fn main() {
    let texts: Vec<String> = (0..N).map(residency_json).collect();
    // Kept the way the reflector keeps them (trimmed as the operator's watch
    // trims them); the vector is allocated first.
    let mut store = Vec::with_capacity(N);
    let residency = retained_per_item(|i| {
        let mut r = serde_json::from_str::<ModelResidency>(&texts[i]).unwrap();
        cached::compact(&mut r);
        store.push(Arc::new(r))
    });
    let status: ModelResidencyStatus = serde_json::from_str::<ModelResidency>(&texts[0])
        .unwrap()
        .status
        .unwrap();
    let names: Vec<String> = (0..N).map(|i| format!("m0-{i}")).collect();
    let metrics = Metrics::new();
    let usage = Usage {
        budget: 16 << 30,
        used: 10 << 30,
        peak: 10 << 30,
        resident: status.resident,
        gpu_conflict: false,
        gpu_unhealthy: false,
    };
    let metric =
        retained_per_item(|i| metrics.observe("bench", &names[i], &usage, status.counters));
    let pods: Vec<Pod> = (0..N).map(pod).collect();
    let cache = PodCache::default();
    let pod_entry = retained_per_item(|i| {
        cache.record(&watcher::Event::Apply(pods[i].clone()));
    });
    let claims = GpuClaims::default();
    let claim = retained_per_item(|i| {
        claims.record(&watcher::Event::Apply((*store[i]).clone()));
    });
    println!("heap per residency ({N} residencies, 3 models, one resident with its pod):");
    println!("  cached ModelResidency:  {residency:>6} bytes");
    println!("  metrics record:         {metric:>6} bytes");
    println!("  pod cache entry:        {pod_entry:>6} bytes");
    println!("  GPU claim:              {claim:>6} bytes");
    let total = residency + metric + pod_entry + claim;
    // Inline sizes: paid by every cached copy whether a field is set or
    // not (jemalloc rounds each allocation up to its size class).
    println!(
        "  inline: ModelResidency {} (metadata {}, spec {}, status {}), model spec {}, model status {}, condition {}",
        std::mem::size_of::<ModelResidency>(),
        std::mem::size_of::<k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta>(),
        std::mem::size_of::<model_residency::api::ModelResidencySpec>(),
        std::mem::size_of::<Option<ModelResidencyStatus>>(),
        std::mem::size_of::<model_residency::api::ModelSpec>(),
        std::mem::size_of::<model_residency::api::ModelStatus>(),
        std::mem::size_of::<k8s_openapi::apimachinery::pkg::apis::meta::v1::Condition>(),
    );
    println!(
        "  total:                  {total:>6} bytes ({:.1} MiB at 10,000)",
        total as f64 * 10_000.0 / (1 << 20) as f64
    );
    // A stamped residency, whole and with parts left out (what each costs).
    println!("heap per stamped residency ({N}, 3 catalog models, none loaded):");
    for leave_out in [
        &[][..],
        &["/metadata/labels"],
        &["/metadata/annotations"],
        &["/metadata/ownerReferences"],
        &["/spec/catalog"],
        &["/status/gpu"],
        &["/status/models", "/status/conditions"],
    ] {
        let texts: Vec<String> = (0..N).map(|i| stamped_json(i, leave_out)).collect();
        let mut store = Vec::with_capacity(N);
        let bytes = retained_per_item(|i| {
            let mut r = serde_json::from_str::<ModelResidency>(&texts[i]).unwrap();
            cached::compact(&mut r);
            store.push(Arc::new(r))
        });
        let what = if leave_out.is_empty() {
            "whole".to_owned()
        } else {
            format!("without {}", leave_out.join(", "))
        };
        println!("  {what:<40} {bytes:>6} bytes");
    }
}
