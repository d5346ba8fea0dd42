//! What the black-box round's hostile inputs cost, with no cluster:
//!
//! - **Selectors**: 1,000 ResidencySet selectors of the round's seven shapes
//!   (500 nested parentheses, 300 nested `size(...)`, deeply nested lists,
//!   1,000 nested conditionals, 4,000-deep member chains, 2,000-term sums,
//!   nine nested ten-element comprehensions), each refused by the bounds
//!   (`residency::cel_bounds`), on the selector thread: CPU seconds for all
//!   of them, against compiling and running 1,000 ordinary selectors on
//!   100 devices (the floor: work the operator does anyway).
//! - **The model list**: `GET /v1/models`'s body for 1,000 models on 4
//!   GPUs, each home's engine restored once for the whole list (as the
//!   router builds it now) against the placement rule run per model with
//!   each home restored per model (as it was built on a serving thread).
//!
//! Run: `cargo bench --bench hostile`. Prints its figures.

use model_residency::api::ModelResidency;
use model_residency::residency::devices::{on_selector_thread, slice_devices};
use model_residency::residency::placement::{Restored, place, place_with};
use serde_json::json;
use std::time::Instant;

/// CPU seconds this process has used (user + system), from /proc.
fn cpu_seconds() -> f64 {
    let stat = std::fs::read_to_string("/proc/self/stat").unwrap_or_default();
    let rest = &stat[stat.rfind(')').map_or(0, |i| i + 1)..];
    let fields: Vec<&str> = rest.split_whitespace().collect();
    let ticks = |i: usize| {
        fields
            .get(i)
            .and_then(|f| f.parse::<f64>().ok())
            .unwrap_or(0.0)
    };
    // utime and stime: fields 14 and 15 of the stat line (11, 12 after comm).
    (ticks(11) + ticks(12)) / 100.0
}

fn hostile(i: usize) -> String {
    match i % 7 {
        0 => format!("{}true{}", "(".repeat(500), ")".repeat(500)),
        1 => format!("{}[1]{}", "size(".repeat(300), ")".repeat(300)),
        2 => format!("{}1{} != []", "[".repeat(400), "]".repeat(400)),
        3 => format!("{}1 == 1", "true ? 1 : ".repeat(1000)),
        4 => format!("device{} == 1", ".a".repeat(4000)),
        5 => format!("1{} > 0", " + 1".repeat(2000)),
        _ => {
            let mut e = "true".to_owned();
            for v in 0..9 {
                e = format!("[0,1,2,3,4,5,6,7,8,9].all(v{v}, {e})");
            }
            e
        }
    }
}

fn devices(n: usize) -> Vec<std::sync::Arc<model_residency::residency::devices::Device>> {
    let slice: k8s_openapi::api::resource::v1::ResourceSlice = serde_json::from_value(json!({
        "metadata": {"name": "n"},
        "spec": {"driver": "gpu.nvidia.com", "nodeName": "n",
            "pool": {"name": "n", "generation": 1, "resourceSliceCount": 1},
            "devices": (0..n).map(|i| json!({"name": format!("gpu-{i}"),
                "attributes": {"index": {"int": i}, "productName": {"string": "H100"}},
                "capacity": {"memory": {"value": "80Gi"}}})).collect::<Vec<_>>()}
    }))
    .unwrap();
    slice_devices(&slice)
}

fn selectors() {
    // Each text its own (verdicts are remembered by text): 1,000 distinct
    // hostile selectors, then the same 1,000 again (a set is reconciled
    // again on every slice, node or class change).
    let texts: Vec<String> = (0..1000)
        .map(|i| format!("{}{}", hostile(i), " ".repeat(i / 7)))
        .collect();
    let (refused, hostile_cpu, again_cpu) = on_selector_thread(move || {
        let round = |texts: &[String]| {
            let t = cpu_seconds();
            let refused = texts
                .iter()
                .filter(|e| {
                    model_residency::residency::devices::Selector::compile([e.as_str()]).is_err()
                })
                .count();
            (refused, cpu_seconds() - t)
        };
        let (refused, first) = round(&texts);
        let (_, again) = round(&texts);
        (refused, first, again)
    });
    let devices = devices(100);
    let floor = on_selector_thread(move || {
        let t = cpu_seconds();
        for i in 0..1000 {
            let e = format!(
                "device.attributes['gpu.nvidia.com'].productName == 'H100' && device.attributes['gpu.nvidia.com'].index >= {}",
                i % 100
            );
            let s = model_residency::residency::devices::Selector::compile([e.as_str()]).unwrap();
            for d in &devices {
                let _ = s.selects(d);
            }
        }
        cpu_seconds() - t
    });
    println!(
        "selectors: 1,000 hostile ones (7 shapes): {refused} refused, {hostile_cpu:.2} CPU s; the same again (remembered): {again_cpu:.2} CPU s"
    );
    println!(
        "selectors: 1,000 ordinary ones compiled and run on 100 devices: {floor:.2} CPU s (ratio {:.2})",
        hostile_cpu / floor.max(0.01)
    );
}

fn residencies(models: usize, gpus: usize) -> Vec<ModelResidency> {
    let list: Vec<_> = (0..models)
        .map(|i| json!({"name": format!("m{i}"), "size": "1Gi"}))
        .collect();
    (0..gpus)
        .map(|g| {
            serde_json::from_value(json!({
                "apiVersion": "residency.dev/v1alpha1", "kind": "ModelResidency",
                "metadata": {"name": format!("gpu-{g}"), "namespace": "ns"},
                "spec": {"nodeName": "n", "device": g.to_string(), "budget": "64Gi",
                         "gpu": {"mode": "env"}, "models": list},
            }))
            .unwrap()
        })
        .collect()
}

fn model_list() {
    let (models, gpus) = (1000, 4);
    let rs = residencies(models, gpus);
    let homes: Vec<&ModelResidency> = rs.iter().collect();
    let t = Instant::now();
    let mut restored = Restored::default();
    for i in 0..models {
        let _ = place_with(&format!("m{i}"), &homes, &[], &mut restored);
    }
    let once = t.elapsed().as_secs_f64();
    let t = Instant::now();
    for i in 0..models {
        let _ = place(&format!("m{i}"), &homes, &[]);
    }
    let per_model = t.elapsed().as_secs_f64();
    println!(
        "model list: {models} models on {gpus} GPUs: {:.1} ms with each GPU restored once, {:.1} ms restored per model ({:.0}x)",
        once * 1e3,
        per_model * 1e3,
        per_model / once.max(1e-9)
    );
}

fn main() {
    // `cargo test --benches` runs this with --bench absent: say so, do little.
    if !std::env::args().any(|a| a == "--bench") {
        println!("hostile: run with cargo bench --bench hostile");
        return;
    }
    selectors();
    model_list();
}
