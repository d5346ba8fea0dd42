//! The CRD against a real API server: it installs, the examples apply,
//! `kubectl get mres` shows the printer columns, and invalid objects are
//! rejected at admission with a message that names the problem.

use crate::support::cluster::test_env;

fn text(out: &std::process::Output) -> String {
    format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    )
}

const VALID: &str = r#"
apiVersion: residency.dev/v1alpha1
kind: ModelResidency
metadata: {name: gpu}
spec:
  nodeName: node-a
  device: "0"
  budget: "BUDGET"
  models:
  - {name: a, size: "SIZE"}
  - {name: b, size: 1Gi}
"#;

fn object(budget: &str, size: &str) -> String {
    VALID.replace("BUDGET", budget).replace("SIZE", size)
}

fn apply(env: &crate::support::cluster::TestEnv, yaml: &str) -> std::process::Output {
    let path = std::env::temp_dir().join(format!("{}-{}.yaml", env.namespace, rand_suffix()));
    std::fs::write(&path, yaml).unwrap();
    let out = env.kubectl(&["apply", "-f", path.to_str().unwrap()]);
    let _ = std::fs::remove_file(path);
    out
}

fn rand_suffix() -> u128 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .as_nanos()
}

#[tokio::test]
#[ignore = "needs the local control plane: scripts/test.sh runs it with --include-ignored"]
async fn crd_and_examples_apply_and_print_columns() {
    let env = test_env("api-columns").await;
    env.install_crds();
    let out = env.kubectl(&["apply", "-f", "examples/"]);
    assert!(out.status.success(), "{}", text(&out));
    let out = env.kubectl(&["get", "mres"]);
    let table = text(&out);
    let header = table.lines().next().unwrap_or_default();
    for col in [
        "NAME",
        "NODE",
        "DEVICE",
        "BUDGET",
        "USED",
        "RESIDENT",
        "REFUSED",
        "READY",
        "GPU HEALTH",
        "AGE",
    ] {
        assert!(header.contains(col), "missing column {col} in:\n{table}");
    }
    // Node, device and budget are what the operator found (status.gpu,
    // status.budget): in claim mode the node and the device are the
    // scheduler's. No operator runs here, so they are empty.
    assert!(table.contains("seed-gpu"), "{table}");
    let out = env.kubectl(&["get", "mres", "-o", "wide"]);
    assert!(
        text(&out)
            .lines()
            .next()
            .unwrap_or_default()
            .contains("UUID"),
        "{}",
        text(&out)
    );
    // Every field is documented.
    let out = env.kubectl(&["explain", "mres.spec.models.pinned"]);
    assert!(text(&out).contains("never evicted"), "{}", text(&out));
}

#[tokio::test]
#[ignore = "needs the local control plane: scripts/test.sh runs it with --include-ignored"]
async fn invalid_objects_are_rejected_at_admission() {
    let env = test_env("api-invalid").await;
    env.install_crds();
    // Valid forms first, so the table below really tests the rules.
    for (budget, size) in [
        ("16000Mi", "10900Mi"),
        ("80Gi", "1.5Gi"),
        ("17179869184", "1000"),
        ("12e9", "1k"),
    ] {
        let out = apply(&env, &object(budget, size));
        assert!(
            out.status.success(),
            "{budget}/{size} should be valid: {}",
            text(&out)
        );
    }
    let valid = object("1Gi", "1");
    let with_model = |model: &str| valid.replace("{name: a, size: \"1\"}", model);
    let artifact = |files: &str| {
        with_model(&format!(
            "{{name: a, size: \"1\", artifact: {{size: 1Gi, files: [{files}]}}}}"
        ))
    };
    let many: String = (0..1001)
        .map(|i| format!("  - {{name: m{i}, size: 1Gi}}\n"))
        .collect();
    // What the API server must say: the field, and (for the CEL rules) a
    // sentence, never the regex behind it.
    let cases: Vec<(&str, String, &str, &str)> = vec![
        ("zero budget", object("0", "1Gi"), "spec.budget: Invalid value: ", "'0' is not a positive size"),
        ("negative budget", object("-16Gi", "1Gi"), "spec.budget: Invalid value: ", "'-16Gi' is not a positive size"),
        ("malformed budget", object("16 GB", "1Gi"), "spec.budget: Invalid value: ", "'16 GB' is not a positive size"),
        ("unknown unit", object("16GB", "1Gi"), "spec.budget: Invalid value: ", "'16GB' is not a positive size"),
        ("zero size", object("16Gi", "0Mi"), "spec.models[0].size: Invalid value: ", "'0Mi' is not a positive size"),
        ("negative size", object("16Gi", "-1"), "spec.models[0].size: Invalid value: ", "'-1' is not a positive size"),
        ("malformed size", object("16Gi", "lots"), "spec.models[0].size: Invalid value: ", "'lots' is not a positive size"),
        ("milli-bytes budget", object("1500m", "1"), "spec.budget: Invalid value: ", "'1500m' is not a positive size"),
        ("size with a space", object("16Gi", "10 Gi"), "spec.models[0].size: Invalid value: ", "'10 Gi' is not a positive size"),
        ("budget as a bare integer", valid.replace("budget: \"1Gi\"", "budget: 17179869184"), "spec.budget: Invalid value: \"integer\"", "spec.budget in body must be of type string"),
        ("budget as bool", valid.replace("budget: \"1Gi\"", "budget: true"), "spec.budget: Invalid value: \"boolean\"", "must be of type string"),
        ("uppercase name", with_model("{name: Zimage, size: \"1\"}"), "spec.models[0].name: Invalid value: ", "'Zimage' is not a model name"),
        ("name with dot", with_model("{name: a.b, size: \"1\"}"), "spec.models[0].name: Invalid value: ", "'a.b' is not a model name"),
        ("model name too long", with_model(&format!("{{name: {}, size: \"1\"}}", "a".repeat(64))), "spec.models[0].name: Too long", "may not be more than 63 bytes"),
        ("missing budget outside claim mode", valid.replace("  budget: \"1Gi\"\n", "  gpu: {mode: env}\n"), "spec: Invalid value: ", "spec.budget is required unless spec.gpu.mode is claim"),
        ("a catalog without its name", "apiVersion: residency.dev/v1alpha1\nkind: ModelResidency\nmetadata: {name: gpu}\nspec: {nodeName: n, device: \"0\", budget: 1Gi, catalog: {models: [a]}}\n".into(), "spec.catalog.name: Required value", ""),
        ("more than 1000 models", valid.replace("  - {name: b, size: 1Gi}\n", &many), "spec.models: Too many: 1002", "must have at most 1000 items"),
        ("unknown field", valid.replace("  device: \"0\"", "  device: \"0\"\n  budgte: 5Gi"), "unknown field \"spec.budgte\"", ""),
        ("duplicate model", valid.replace("{name: b, size: 1Gi}", "{name: a, size: 1Gi}"), "spec.models[1]: Duplicate value", "{\"name\":\"a\"}"),
        ("empty device", valid.replace("device: \"0\"", "device: \"\""), "spec.device: Invalid value: \"\"", ""),
        ("device all", valid.replace("device: \"0\"", "device: all"), "spec.device: Invalid value: ", "'all' is not one GPU"),
        ("demand as a list (the old shape)", object("16Gi", "1Gi") + "  demand:\n  - {model: a, lastRequested: \"2026-11-30T03:00:00Z\"}\n", "unknown field \"spec.demand[0].model\"", ""),
        ("demand key not a model name", object("16Gi", "1Gi") + "  demand:\n    a: \"2026-11-30T03:00:00Z\"\n    Bad Key: \"2026-11-30T03:00:00Z\"\n", "spec.demand: Invalid value: ", "keys are model names (lowercase letters, digits and '-', at most 63), and 'Bad Key' is not one"),
        ("missing nodeName outside claim mode", valid.replace("  nodeName: node-a\n", "  gpu: {mode: devicePlugin}\n"), "spec: Invalid value: ", "spec.nodeName is required unless spec.gpu.mode is claim"),
        ("unknown gpu mode", valid.replace("  nodeName: node-a\n", "  nodeName: node-a\n  gpu: {mode: mps}\n"), "spec.gpu.mode: Unsupported value: \"mps\"", "supported values: \"claim\", \"devicePlugin\", \"env\""),
        ("existingClaim outside claim mode", valid.replace("  nodeName: node-a\n", "  nodeName: node-a\n  gpu: {mode: env, existingClaim: team-gpu}\n"), "spec: Invalid value: ", "spec.gpu.existingClaim is for spec.gpu.mode claim only"),
        ("resourceName outside devicePlugin mode", valid.replace("  nodeName: node-a\n", "  nodeName: node-a\n  gpu: {resourceName: nvidia.com/gpu}\n"), "spec: Invalid value: ", "spec.gpu.resourceName is for spec.gpu.mode devicePlugin only"),
        ("budgetFraction above 1", valid.replace("  nodeName: node-a\n", "  nodeName: node-a\n  budgetFraction: 1.5\n"), "spec.budgetFraction: Invalid value: 1.5", "should be less than or equal to 1"),
        ("empty nodeName", valid.replace("nodeName: node-a", "nodeName: \"\""), "spec.nodeName: Invalid value: \"\"", ""),
        ("nodeName not a node name", valid.replace("nodeName: node-a", "nodeName: Node_A"), "spec.nodeName: Invalid value: ", "'Node_A' is not a node name"),
        ("pinned not a bool", with_model("{name: a, size: \"1\", pinned: maybe}"), "spec.models[0].pinned: Invalid value: \"string\"", "must be of type boolean"),
        ("models not a list", "apiVersion: residency.dev/v1alpha1\nkind: ModelResidency\nmetadata: {name: gpu}\nspec: {nodeName: n, device: \"0\", budget: 1Gi, models: {name: a}}\n".into(), "unknown field \"spec.models.name\"", ""),
        ("demand time not a string", object("16Gi", "1Gi") + "  demand:\n    a: 5\n", "spec.demand.a: Invalid value: \"int64\"", "must be of type date-time"),
        ("bad demand time", object("16Gi", "1Gi") + "  demand:\n    a: yesterday\n", "spec.demand.a: Invalid value: \"yesterday\"", "must be of type date-time"),
        ("template not an object", valid.replace("{name: b, size: 1Gi}", "{name: b, size: 1Gi, template: oops}"), "spec.models[1].template: Invalid value: \"string\"", "must be of type object"),
        ("artifact from ftp", artifact("{uri: \"ftp://host/w\"}"), "spec.models[0].artifact.files[0].uri: Invalid value: ", "'ftp://host/w' is not an http:// or https:// URI"),
        ("artifact sha256 not hex", artifact(&format!("{{uri: \"http://h/w\", sha256: {}}}", "z".repeat(64))), "spec.models[0].artifact.files[0].sha256: Invalid value: ", "is not a SHA-256"),
        ("sleep timeout not a duration", with_model("{name: a, size: \"2\", sleep: {sleepingSize: \"1\", sleep: {path: /sleep, timeout: forever}}}"), "spec.models[0].sleep.sleep.timeout: Invalid value: ", "'forever' is not a duration"),
        ("sleep path a URL", with_model("{name: a, size: \"2\", sleep: {sleepingSize: \"1\", sleep: {path: \"http://169.254.169.254/latest\"}}}"), "spec.models[0].sleep.sleep.path: Invalid value: ", "is not a path on the model's pod"),
        ("sleep method with CR/LF", with_model("{name: a, size: \"2\", sleep: {sleepingSize: \"1\", wake: {path: /wake_up, method: \"POST /x HTTP/1.1\\r\\nHost: y\"}}}"), "spec.models[0].sleep.wake.method: Unsupported value", "supported values: \"GET\", \"POST\", \"PUT\""),
        ("wakeTime not a duration", with_model("{name: a, size: \"2\", sleep: {sleepingSize: \"1\", wakeTime: soon}}"), "spec.models[0].sleep.wakeTime: Invalid value: ", "'soon' is not a duration"),
        ("device index out of range", valid.replace("device: \"0\"", "device: \"99999999999999999999\""), "spec.device: Invalid value: ", "is not one GPU"),
        ("budgetFraction zero", valid.replace("  nodeName: node-a\n", "  nodeName: node-a\n  budgetFraction: 0\n"), "spec.budgetFraction: Invalid value: ", "budgetFraction is a share of the device's memory: at least 0.01, at most 1"),
        ("budgetFraction 2 as an integer", valid.replace("  nodeName: node-a\n", "  nodeName: node-a\n  budgetFraction: 2\n"), "spec.budgetFraction: Invalid value: ", "budgetFraction is a share of the device's memory: at least 0.01, at most 1"),
        ("mountPath with ..", with_model("{name: a, size: \"1\", artifact: {size: 1Gi, mountPath: /models/../etc, files: [{uri: \"http://h/w\"}]}}"), "spec.models[0].artifact.mountPath: Invalid value: ", "'/models/../etc' is not a normalized absolute path"),
    ];
    assert!(
        cases.len() >= 30,
        "the table should cover at least 30 cases"
    );
    let mut failures = Vec::new();
    for (what, yaml, field, sentence) in &cases {
        let out = apply(&env, yaml);
        let msg = text(&out);
        let said = msg.contains(field) && msg.contains(sentence);
        if out.status.success() || !said || msg.contains("should match") {
            failures.push(format!(
                "{what}: expected a rejection saying {field:?} and {sentence:?} (and no regex), got: {msg}"
            ));
        }
    }
    assert!(failures.is_empty(), "{}", failures.join("\n"));
}

#[tokio::test]
#[ignore = "needs the local control plane: scripts/test.sh runs it with --include-ignored"]
async fn two_managers_applying_different_models_merge_by_name() {
    use kube::api::{Api, Patch, PatchParams};
    use model_residency::api::ModelResidency;
    use serde_json::json;
    let env = test_env("api-two-managers").await;
    env.install_crds();
    let api: Api<ModelResidency> = Api::namespaced(env.client.clone(), &env.namespace);
    let apply = |manager: &'static str, spec: serde_json::Value| {
        let api = api.clone();
        async move {
            let body = json!({
                "apiVersion": "residency.dev/v1alpha1", "kind": "ModelResidency",
                "metadata": {"name": "gpu"}, "spec": spec,
            });
            api.patch("gpu", &PatchParams::apply(manager), &Patch::Apply(&body))
                .await
                .unwrap_or_else(|e| panic!("{manager}'s apply: {e}"))
        }
    };
    let names = |r: &ModelResidency| -> Vec<(String, String)> {
        r.spec
            .models
            .iter()
            .map(|m| (m.name.clone(), m.size.0.clone()))
            .collect()
    };
    // The platform team owns the GPU and its base model; an ML team adds
    // its own model with its own manager.
    apply(
        "platform",
        json!({"nodeName": "node-a", "device": "0", "budget": "80Gi",
               "models": [{"name": "base", "size": "10Gi"}]}),
    )
    .await;
    let r = apply(
        "ml-team",
        json!({"models": [{"name": "tuned", "size": "4Gi"}]}),
    )
    .await;
    assert_eq!(
        names(&r),
        [
            ("base".into(), "10Gi".into()),
            ("tuned".into(), "4Gi".into())
        ]
    );
    // Each re-applies only its own: the other's model stays.
    let r = apply(
        "platform",
        json!({"nodeName": "node-a", "device": "0", "budget": "80Gi",
               "models": [{"name": "base", "size": "12Gi"}]}),
    )
    .await;
    assert_eq!(
        names(&r),
        [
            ("base".into(), "12Gi".into()),
            ("tuned".into(), "4Gi".into())
        ]
    );
    let r = apply("ml-team", json!({"models": []})).await;
    assert_eq!(names(&r), [("base".into(), "12Gi".into())]);
    // And one manager changing the other's model is a conflict, not a
    // silent overwrite.
    let body = json!({
        "apiVersion": "residency.dev/v1alpha1", "kind": "ModelResidency",
        "metadata": {"name": "gpu"}, "spec": {"models": [{"name": "base", "size": "1Gi"}]},
    });
    let err = api
        .patch("gpu", &PatchParams::apply("ml-team"), &Patch::Apply(&body))
        .await
        .expect_err("changing another manager's model must conflict");
    assert!(
        matches!(&err, kube::Error::Api(s) if s.code == 409),
        "{err}"
    );
}

#[tokio::test]
#[ignore = "needs the local control plane: scripts/test.sh runs it with --include-ignored"]
async fn residencies_are_selectable_by_node_and_explain_names_types() {
    let env = test_env("api-selectable").await;
    env.install_crds();
    for (name, node) in [("gpu-a", "node-a"), ("gpu-b", "node-b")] {
        let yaml = object("1Gi", "1")
            .replace("{name: gpu}", &format!("{{name: {name}}}"))
            .replace("node-a", node);
        let out = apply(&env, &yaml);
        assert!(out.status.success(), "{}", text(&out));
    }
    let out = env.kubectl(&[
        "get",
        "mres",
        "--field-selector",
        "spec.nodeName=node-b",
        "-o",
        "name",
    ]);
    assert_eq!(
        text(&out).trim(),
        "modelresidency.residency.dev/gpu-b",
        "{}",
        text(&out)
    );
    let out = env.kubectl(&[
        "get",
        "mres",
        "--field-selector",
        "spec.device=0",
        "-o",
        "name",
    ]);
    assert_eq!(text(&out).lines().count(), 2, "{}", text(&out));
    // A field the CRD does not declare selectable is refused, not ignored.
    let out = env.kubectl(&["get", "mres", "--field-selector", "spec.budget=1Gi"]);
    assert!(!out.status.success(), "{}", text(&out));
    for (field, description) in [
        ("mres.spec.budget", "VRAM budget"),
        ("mres.spec.models.size", "VRAM footprint"),
    ] {
        let out = env.kubectl(&["explain", field]);
        let shown = text(&out);
        assert!(
            shown.contains("<string>") && shown.contains(description),
            "{field}: {shown}"
        );
    }
}
