use super::*;
use serde_json::json;

fn residency(
    ns: &str,
    name: &str,
    node: &str,
    device: &str,
    spec: serde_json::Value,
    models: serde_json::Value,
) -> ModelResidency {
    let mut spec = spec;
    spec["nodeName"] = json!(node);
    spec["device"] = json!(device);
    serde_json::from_value(json!({
        "apiVersion": "residency.dev/v1alpha1", "kind": "ModelResidency",
        "metadata": {"name": name, "namespace": ns},
        "spec": spec,
        "status": {"budget": "16Gi", "used": "12Gi", "models": models},
    }))
    .unwrap()
}

const T0: &str = "2026-12-06T12:00:00Z";

fn fleet() -> (
    Vec<ModelResidency>,
    BTreeMap<(String, String), ModelCatalog>,
) {
    let catalog: ModelCatalog = serde_json::from_value(json!({
        "apiVersion": "residency.dev/v1alpha1", "kind": "ModelCatalog",
        "metadata": {"name": "models", "namespace": "ml"},
        "spec": {"models": [
            {"name": "chat", "size": "8Gi", "keepAlive": "10m"},
            {"name": "embed", "size": "4Gi", "pinned": true, "keepAlive": "10m"},
            {"name": "code", "size": "6Gi"},
        ]},
    }))
    .unwrap();
    let a = residency(
        "ml",
        "gpu-a",
        "node-a",
        "0",
        json!({"catalog": {"name": "models"}, "keepAlive": "1h"}),
        json!([
            {"name": "chat", "state": "Loaded", "size": "8Gi", "lastUsed": T0},
            {"name": "embed", "state": "Loaded", "size": "4Gi", "lastUsed": T0},
            {"name": "code", "state": "Evicted"},
        ]),
    );
    let b = residency(
        "ml",
        "gpu-b",
        "node-a",
        "1",
        json!({"catalog": {"name": "models"}, "keepAlive": "1h"}),
        json!([
            {"name": "chat", "state": "Loading", "size": "8Gi", "lastUsed": T0},
            {"name": "code", "state": "Loaded", "size": "6Gi", "lastUsed": T0},
        ]),
    );
    let other = residency(
        "other",
        "gpu-c",
        "node-b",
        "0",
        json!({"models": [{"name": "chat", "size": "8Gi"}]}),
        json!([
            {"name": "chat", "state": "Loaded", "size": "8Gi", "lastUsed": T0},
        ]),
    );
    let catalogs = [(("ml".to_owned(), "models".to_owned()), catalog)].into();
    (vec![b, other, a], catalogs)
}

#[test]
fn each_gpu_shows_its_models_with_idle_unload_and_copies_per_namespace() {
    let (residencies, catalogs) = fleet();
    let gpus = view(&residencies, &catalogs, false);
    let names: Vec<_> = gpus.iter().map(|g| g.residency.as_str()).collect();
    assert_eq!(
        names,
        ["gpu-a", "gpu-b", "gpu-c"],
        "sorted by namespace, node, device"
    );
    let a = &gpus[0];
    assert_eq!(a.node.as_deref(), Some("node-a"));
    assert_eq!((a.budget, a.used), (Some(16 << 30), Some(12 << 30)));
    assert_eq!(a.others, 1, "code is Evicted: left out");
    let chat = &a.models[0];
    assert_eq!(chat.size, Some(8 << 30));
    // The catalog's keepAlive (10m), not the residency's (1h).
    assert_eq!(chat.idle_unload_at.as_deref(), Some("2026-12-06T12:10:00Z"));
    // Loaded on gpu-a and Loading on gpu-b: two copies in ml; the other
    // namespace's chat is its own.
    assert_eq!(chat.copies, 2);
    assert_eq!(gpus[2].models[0].copies, 1);
    // Pinned: idle unload never takes it.
    assert_eq!(a.models[1].name, "embed");
    assert_eq!(a.models[1].idle_unload_at, None);
    // No keepAlive at all: none either.
    assert_eq!(gpus[2].models[0].idle_unload_at, None);
    // The residency's own keepAlive where the entry sets none.
    let code = &gpus[1].models[1];
    assert_eq!(code.idle_unload_at.as_deref(), Some("2026-12-06T13:00:00Z"));
    // --all: the evicted model too.
    let all = view(&residencies, &catalogs, true);
    assert_eq!(all[0].models.len(), 3);
    assert_eq!(all[0].others, 0);
}

#[test]
fn eight_gpus_fit_80_columns_and_say_when() {
    let (mut residencies, catalogs) = fleet();
    let template = residencies[0].clone();
    for k in 0..6 {
        let mut r = template.clone();
        r.metadata.name = Some(format!("fleet-node-long-name-{k}-gpu-{k}"));
        r.spec.device = k.to_string();
        residencies.push(r);
    }
    let gpus = view(&residencies, &catalogs, false);
    assert_eq!(gpus.len(), 9);
    let now: Timestamp = "2026-12-06T12:04:30Z".parse().unwrap();
    let text = render(&gpus, now);
    for line in text.lines() {
        assert!(line.len() <= 80, "{} columns: {line:?}", line.len());
    }
    assert!(text.starts_with("9 GPUs, "), "{text}");
    assert!(
        text.contains("ml/gpu-a  node-a/0  12Gi of 16Gi (75%)  +1 not on it"),
        "{text}"
    );
    // Last used 4m30s ago; idle unload in 5m (10m after).
    let chat = text
        .lines()
        .find(|l| l.trim_start().starts_with("chat") && l.contains("Loaded"))
        .unwrap();
    assert!(chat.contains("4m ago"), "{chat}");
    assert!(chat.contains("in 5m"), "{chat}");
    println!("{text}");
    assert!(render(&[], now).contains("no ModelResidency here"));
    // A stamped residency's device is its GPU's uuid: shortened.
    let mut stamped = fleet().0.remove(2);
    stamped.spec.device = "GPU-083f45b5-13eb-1e03-3c4a-1a791e4d94a3".into();
    let text = render(&view(&[stamped], &catalogs, false), now);
    assert!(
        text.contains("node-a/GPU-083f45b5…  12Gi of 16Gi"),
        "{text}"
    );
}

#[test]
fn the_json_view_has_the_documented_keys() {
    let (residencies, catalogs) = fleet();
    let v = serde_json::to_value(view(&residencies, &catalogs, false)).unwrap();
    let gpu = &v[0];
    for key in [
        "namespace",
        "residency",
        "node",
        "device",
        "budget",
        "used",
        "set",
        "models",
        "others",
    ] {
        assert!(gpu.get(key).is_some(), "{key} in {gpu}");
    }
    let model = &gpu["models"][0];
    for key in [
        "name",
        "state",
        "size",
        "lastUsed",
        "idleUnloadAt",
        "copies",
    ] {
        assert!(model.get(key).is_some(), "{key} in {model}");
    }
    assert_eq!(model["state"], "Loaded");
}

#[test]
fn a_gpu_that_takes_no_new_models_and_a_models_expected_next_use_show_at_a_glance() {
    let (mut residencies, catalogs) = fleet();
    let a = residencies
        .iter_mut()
        .find(|r| r.metadata.name.as_deref() == Some("gpu-a"))
        .unwrap();
    let status = a.status.as_mut().unwrap();
    status.conditions = serde_json::from_value(json!([{
        "type": "GpuHealthy", "status": "False", "reason": "NoExecute",
        "message": "its device is tainted gpu.nvidia.com/xid=79:NoExecute",
        "lastTransitionTime": T0,
    }]))
    .unwrap();
    status.models[0].expected_next = Some("2026-12-06T13:00:00Z".into());
    let gpus = view(&residencies, &catalogs, false);
    for g in &gpus {
        let want = (g.residency == "gpu-a" && g.namespace == "ml").then_some("NoExecute");
        assert_eq!(g.unhealthy.as_deref(), want, "{}", g.residency);
    }
    let now: Timestamp = "2026-12-06T12:04:30Z".parse().unwrap();
    let text = render(&gpus, now);
    for line in text.lines() {
        assert!(line.len() <= 80, "{} columns: {line:?}", line.len());
    }
    assert!(
        text.contains("! takes no new models: NoExecute (its GpuHealthy condition)"),
        "{text}"
    );
    let chat = text
        .lines()
        .find(|l| l.trim_start().starts_with("chat") && l.contains("Loaded"))
        .unwrap();
    assert!(chat.ends_with("in 55m"), "{chat}");
    assert_eq!(text.matches("ml/gpu-a").count(), 1);
}
