//! Model registry files for `simulate --registry`: either a YAML list of
//! models or a whole `ModelResidency` manifest whose `spec.models` is that
//! list, so one file serves `kubectl apply` and the simulator. An entry is
//! the CRD's own [`ModelSpec`] (every field of `spec.models[]`, templates,
//! artifacts and copies included, though only size, pinned, loadTime and
//! sleep matter to a replay), checked by the operator's own validation,
//! and the engine is built by the operator's own restore: what the
//! simulator replays is what the operator would decide.

use crate::api::{ModelResidency, ModelResidencyStatus, ModelSpec};
use crate::engine::{Bytes, Engine};
use crate::residency::state::{InvalidSpec, restore, validate_with_budget};
use std::path::Path;

/// Load and wake seconds for the models that declare none.
#[derive(Clone, Copy, Debug, Default)]
pub struct DefaultCosts {
    pub load: Option<f64>,
    pub wake: Option<f64>,
}

/// A registry file that cannot be used, naming the file and the problem.
#[derive(Debug, thiserror::Error)]
pub enum RegistryFileError {
    #[error("{path}: {source}")]
    Read {
        path: String,
        source: std::io::Error,
    },
    #[error("{path}: {problem}")]
    Yaml { path: String, problem: String },
    #[error("{path}: {source}")]
    Invalid { path: String, source: InvalidSpec },
}

/// Reads and validates a registry file.
pub fn load(path: &Path) -> Result<Vec<ModelSpec>, RegistryFileError> {
    let shown = path.display().to_string();
    let text = std::fs::read_to_string(path).map_err(|source| RegistryFileError::Read {
        path: shown.clone(),
        source,
    })?;
    parse(&text, &shown)
}

/// Parses registry YAML; `origin` names the source in errors.
pub fn parse(text: &str, origin: &str) -> Result<Vec<ModelSpec>, RegistryFileError> {
    let yaml = |problem: String| RegistryFileError::Yaml {
        path: origin.to_owned(),
        problem,
    };
    let doc: serde_json::Value = serde_saphyr::from_str(text).map_err(|e| yaml(e.to_string()))?;
    // A list, or a manifest whose spec.models is one.
    let list = match &doc {
        serde_json::Value::Array(_) => doc,
        serde_json::Value::Object(o) => match o.get("spec").and_then(|s| s.get("models")) {
            Some(models) => models.clone(),
            None => return Err(yaml("missing field `spec` with `models`: neither a list of models nor a ModelResidency manifest".into())),
        },
        _ => return Err(yaml("neither a list of models nor a ModelResidency manifest".into())),
    };
    let known = model_fields();
    let entries = list.as_array().map(Vec::as_slice).unwrap_or_default();
    for (i, entry) in entries.iter().enumerate() {
        for key in entry.as_object().into_iter().flat_map(|o| o.keys()) {
            if !known.iter().any(|k| k == key) {
                return Err(yaml(format!(
                    "models[{i}]: unknown field `{key}`, expected one of {}",
                    known.join(", ")
                )));
            }
        }
    }
    let models: Vec<ModelSpec> = serde_json::from_value(list).map_err(|e| yaml(e.to_string()))?;
    // Validated as the operator validates a residency's registry.
    build_engine(1, &models, DefaultCosts::default()).map_err(|source| {
        RegistryFileError::Invalid {
            path: origin.to_owned(),
            source,
        }
    })?;
    Ok(models)
}

/// The fields of a `spec.models[]` entry, as the CRD's schema names them.
fn model_fields() -> Vec<String> {
    let schema = serde_json::to_value(schemars::schema_for!(ModelSpec)).unwrap_or_default();
    schema["properties"]
        .as_object()
        .map(|p| p.keys().cloned().collect())
        .unwrap_or_default()
}

/// An engine with `budget` and every model registered (none resident),
/// built as the operator builds one from a residency with no status; the
/// models that declare no loadTime or wakeTime take `defaults`.
pub fn build_engine(
    budget: Bytes,
    models: &[ModelSpec],
    defaults: DefaultCosts,
) -> Result<Engine, InvalidSpec> {
    let r: ModelResidency = serde_json::from_value(serde_json::json!({
        "apiVersion": "residency.dev/v1alpha1",
        "kind": "ModelResidency",
        "metadata": {"name": "simulate"},
        "spec": {"device": "0", "budget": budget.to_string(), "models": models},
    }))
    .map_err(|e| InvalidSpec::Warm(format!("spec.models: {e}")))?;
    let valid = validate_with_budget(&r, budget)?;
    let mut engine = restore(&valid, &ModelResidencyStatus::default()).engine;
    for m in &valid.models {
        let load_declared = m.spec.load_time.is_some();
        let wake_declared = m.spec.sleep.as_ref().is_some_and(|s| s.wake_time.is_some());
        if let Some(id) = engine.id(m.name()) {
            let costs = crate::residency::warm::costs(
                m.spec,
                defaults.load.filter(|_| !load_declared),
                defaults.wake.filter(|_| !wake_declared),
            );
            engine.set_costs(id, costs);
        }
    }
    Ok(engine)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::engine::{Costs, Sleep};

    fn engine(text: &str) -> Engine {
        build_engine(
            16 << 30,
            &parse(text, "test.yaml").unwrap(),
            DefaultCosts::default(),
        )
        .unwrap()
    }

    #[test]
    fn reads_quantities_numbers_and_pins() {
        let e = engine(
            "- {name: a, size: 10Mi}\n- {name: b, size: 2048, pinned: true}\n- name: c\n  size: 1Gi\n  template: {spec: {containers: []}}\n",
        );
        let got: Vec<(String, u64, bool)> = e
            .models()
            .map(|id| (e.name(id).to_owned(), e.size(id), e.is_pinned(id)))
            .collect();
        assert_eq!(
            got,
            [
                ("a".into(), 10 << 20, false),
                ("b".into(), 2048, true),
                ("c".into(), 1 << 30, false)
            ]
        );
    }

    #[test]
    fn reads_the_models_of_a_modelresidency_manifest_copies_and_all() {
        let text = "# a GPU\napiVersion: residency.dev/v1alpha1\nkind: ModelResidency\nmetadata: {name: g}\nspec:\n  nodeName: n\n  budget: 1Gi\n  models:\n  - {name: a, size: 1Mi, pinned: true, copies: {max: 4}, keepAlive: 10m}\n";
        let models = parse(text, "m.yaml").unwrap();
        assert_eq!(models.len(), 1);
        assert!(models[0].pinned && models[0].copies.is_some());
        let e = build_engine(1 << 30, &models, DefaultCosts::default()).unwrap();
        assert!(e.is_pinned(e.id("a").unwrap()));
    }

    #[test]
    fn reads_load_times_and_how_models_sleep() {
        let text = "- {name: a, size: 10Gi, loadTime: 45s, sleep: {preset: vllm, sleepingSize: 1Gi, hostMemory: 8Gi, wakeTime: 1500ms}}\n- {name: b, size: 4Gi, sleep: {level: 2, sleepingSize: 512Mi}}\n- {name: c, size: 2Gi}\n";
        let models = parse(text, "w.yaml").unwrap();
        let defaults = DefaultCosts {
            load: Some(30.0),
            wake: None,
        };
        let e = build_engine(16 << 30, &models, defaults).unwrap();
        let (a, b, c) = (e.id("a").unwrap(), e.id("b").unwrap(), e.id("c").unwrap());
        assert_eq!(
            e.sleep_of(a),
            Some(Sleep {
                sleeping_size: 1 << 30,
                host_memory: 8 << 30
            })
        );
        assert_eq!(e.sleep_of(b).map(|s| s.host_memory), Some(0), "level 2");
        // Declared costs stand; the defaults fill what is not declared.
        assert_eq!(
            e.costs(a),
            Costs {
                load: 45.0,
                wake: 1.5
            }
        );
        assert_eq!(
            e.costs(c),
            Costs {
                load: 30.0,
                wake: 1.5
            }
        );
        for (yaml, want) in [
            (
                "- {name: a, size: 1Gi, sleep: {sleepingSize: 2Gi}}\n",
                "not smaller than the model's size",
            ),
            (
                "- {name: a, size: 1Gi, loadTime: soon}\n",
                "\"soon\" is not a duration",
            ),
            (
                "- {name: a, size: 1Gi, sleep: {sleepingSize: 1Mi, wakeTime: x}}\n",
                "wakeTime",
            ),
            (
                "- {name: a, size: 1Gi, sleep: {}}\n",
                "missing field `sleepingSize`",
            ),
        ] {
            let err = parse(yaml, "w.yaml").unwrap_err().to_string();
            assert!(err.contains(want), "{yaml:?}: {err:?} lacks {want:?}");
        }
    }

    #[test]
    fn bad_files_name_the_file_and_the_problem() {
        let cases = [
            ("- {name: a, size: -5}\n", "spec.models[a].size: "),
            ("- {name: a, size: 5MB}\n", "unknown unit \"MB\""),
            ("- {name: a}\n", "missing field `size`"),
            (
                "- {name: a, size: 1, pined: true}\n",
                "unknown field `pined`",
            ),
            (
                "- {name: a, size: 1}\n- {name: a, size: 2}\n",
                "\"a\" is listed twice",
            ),
            ("- {name: a, size: 0}\n", "must be positive"),
            ("name: a\n", "missing field `spec`"),
            (
                "kind: ModelResidency\nspec: {models: [{name: a, size: 2, sise: 1}]}\n",
                "unknown field `sise`",
            ),
        ];
        for (yaml, want) in cases {
            let err = parse(yaml, "test.yaml").unwrap_err().to_string();
            assert!(err.contains(want), "{yaml:?}: {err:?} lacks {want:?}");
            assert!(err.starts_with("test.yaml"), "{err}");
        }
    }
}
