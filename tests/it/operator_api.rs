//! The CRD against a real API server: it installs, the examples apply,
//! `kubectl get mres` shows the printer columns, and invalid objects are
//! rejected at admission with a message that names the problem.

use crate::support::cluster::test_env;

/// `msg` with every `[<digits>]` taken out.
fn without_indexes(msg: &str) -> String {
    let mut out = String::with_capacity(msg.len());
    let mut rest = msg;
    while let Some(i) = rest.find('[') {
        let (before, after) = rest.split_at(i);
        out.push_str(before);
        match after[1..].find(']') {
            Some(j) if j > 0 && after[1..=j].bytes().all(|b| b.is_ascii_digit()) => {
                rest = &after[j + 2..];
            }
            _ => {
                out.push('[');
                rest = &after[1..];
            }
        }
    }
    out.push_str(rest);
    out
}

#[test]
fn list_indexes_are_taken_out_of_admission_messages() {
    assert_eq!(
        without_indexes("spec.models[0].size: Invalid value; spec.models[12].name"),
        "spec.models.size: Invalid value; spec.models.name"
    );
    assert_eq!(without_indexes("a [b] [] [1x] end["), "a [b] [] [1x] end[");
}

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
  budget: BUDGET
  models:
  - {name: a, size: SIZE}
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
        "NAME", "NODE", "DEVICE", "BUDGET", "USED", "RESIDENT", "REFUSED", "READY", "AGE",
    ] {
        assert!(header.contains(col), "missing column {col} in:\n{table}");
    }
    assert!(
        table.contains("seed-gpu") && table.contains("16000Mi"),
        "{table}"
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
    let cases: Vec<(&str, String, &str)> = vec![
        ("zero budget", object("0", "1Gi"), "spec.budget"),
        ("negative budget", object("-16Gi", "1Gi"), "spec.budget"),
        ("malformed budget", object("16 GB", "1Gi"), "spec.budget"),
        ("unknown unit", object("16GB", "1Gi"), "spec.budget"),
        ("zero size", object("16Gi", "0Mi"), "spec.models.size"),
        ("negative size", object("16Gi", "-1"), "spec.models.size"),
        ("malformed size", object("16Gi", "lots"), "spec.models.size"),
        ("uppercase name", VALID.replace("{name: a,", "{name: Zimage,").replace("BUDGET", "1Gi").replace("SIZE", "1"), "spec.models.name"),
        ("name with dot", VALID.replace("{name: a,", "{name: a.b,").replace("BUDGET", "1Gi").replace("SIZE", "1"), "spec.models.name"),
        ("missing budget", VALID.replace("  budget: BUDGET\n", "").replace("SIZE", "1"), "budget"),
        ("missing models", "apiVersion: residency.dev/v1alpha1\nkind: ModelResidency\nmetadata: {name: gpu}\nspec: {nodeName: n, device: \"0\", budget: 1Gi}\n".into(), "models"),
        ("unknown field", object("16Gi", "1Gi").replace("  device: \"0\"", "  device: \"0\"\n  budgte: 5Gi"), "budgte"),
        ("duplicate model", VALID.replace("{name: b, size: 1Gi}", "{name: a, size: 1Gi}").replace("BUDGET", "1Gi").replace("SIZE", "1"), "Duplicate value"),
        ("budget as bool", object("true", "1Gi"), "spec.budget"),
        ("empty device", object("1Gi", "1").replace("device: \"0\"", "device: \"\""), "spec.device"),
        ("demand as a list (the old shape)", object("16Gi", "1Gi") + "  demand:\n  - {model: a, lastRequested: \"2026-11-30T03:00:00Z\"}\n", "spec.demand"),
        ("missing nodeName", object("16Gi", "1Gi").replace("  nodeName: node-a\n", ""), "nodeName"),
        ("empty nodeName", object("16Gi", "1Gi").replace("nodeName: node-a", "nodeName: \"\""), "spec.nodeName"),
        ("nodeName not a node name", object("16Gi", "1Gi").replace("nodeName: node-a", "nodeName: Node_A"), "spec.nodeName"),
        ("model name too long", VALID.replace("{name: a,", &format!("{{name: {},", "a".repeat(64))).replace("BUDGET", "1Gi").replace("SIZE", "1"), "spec.models.name"),
        ("pinned not a bool", VALID.replace("{name: a, size: SIZE}", "{name: a, size: SIZE, pinned: maybe}").replace("BUDGET", "1Gi").replace("SIZE", "1"), "pinned"),
        ("models not a list", "apiVersion: residency.dev/v1alpha1\nkind: ModelResidency\nmetadata: {name: gpu}\nspec: {nodeName: n, device: \"0\", budget: 1Gi, models: {name: a}}\n".into(), "models"),
        ("demand time not a string", object("16Gi", "1Gi") + "  demand:\n    a: 5\n", "spec.demand.a"),
        ("milli-bytes budget", object("1500m", "1"), "spec.budget"),
        ("size with a space", object("16Gi", "10 Gi"), "spec.models.size"),
        ("template not an object", VALID.replace("{name: b, size: 1Gi}", "{name: b, size: 1Gi, template: oops}").replace("BUDGET", "1Gi").replace("SIZE", "1"), "template"),
        ("bad demand time", object("16Gi", "1Gi") + "  demand:\n    a: yesterday\n", "spec.demand.a"),
    ];
    assert!(
        cases.len() >= 25,
        "the table should cover at least 25 cases"
    );
    let mut failures = Vec::new();
    for (what, yaml, want) in &cases {
        let out = apply(&env, yaml);
        let msg = text(&out);
        // Current API servers name a list item's field with its index
        // (`spec.models[0].size`), v1.20 without (`spec.models.size`).
        if out.status.success() || !without_indexes(&msg).contains(want) {
            failures.push(format!(
                "{what}: expected rejection mentioning {want:?}, got: {msg}"
            ));
        }
    }
    assert!(failures.is_empty(), "{}", failures.join("\n"));
}
