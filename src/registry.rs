//! Model registry files for `simulate --registry`: either a YAML list of
//! `{name, size, pinned}` models, or a whole `ModelResidency` manifest whose
//! `spec.models` is that list (so one file serves `kubectl apply` and the
//! simulator; templates are accepted and ignored here).

use crate::engine::{Bytes, Engine, RegistryError};
use crate::quantity::{QuantityError, parse_bytes};
use serde::Deserialize;
use std::path::Path;

/// One registry entry, sizes resolved to bytes.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct RegistryModel {
    pub name: String,
    pub size: Bytes,
    pub pinned: bool,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct Entry {
    name: String,
    size: SizeValue,
    #[serde(default)]
    pinned: bool,
    #[serde(default)]
    #[allow(dead_code)] // accepted so CRD model lists load unchanged
    template: Option<serde_json::Value>,
}

/// A `ModelResidency` manifest; only `spec.models` matters here.
#[derive(Deserialize)]
struct Manifest {
    spec: ManifestSpec,
}

#[derive(Deserialize)]
struct ManifestSpec {
    models: Vec<Entry>,
}

/// A size as YAML writes it: a quantity string or a bare number.
#[derive(Deserialize)]
#[serde(untagged)]
enum SizeValue {
    Bytes(u64),
    Negative(i64),
    Quantity(String),
}

/// A registry file that cannot be used, naming the file and the problem.
#[derive(Debug, thiserror::Error)]
pub enum RegistryFileError {
    #[error("{path}: {source}")]
    Read {
        path: String,
        source: std::io::Error,
    },
    #[error("{path}: {source}")]
    Yaml {
        path: String,
        source: Box<serde_saphyr::Error>,
    },
    #[error("{path}: model {name:?}: size: {source}")]
    Size {
        path: String,
        name: String,
        source: QuantityError,
    },
    #[error("{path}: {source}")]
    Registry { path: String, source: RegistryError },
}

/// Reads and validates a registry file.
pub fn load(path: &Path) -> Result<Vec<RegistryModel>, RegistryFileError> {
    let shown = path.display().to_string();
    let text = std::fs::read_to_string(path).map_err(|source| RegistryFileError::Read {
        path: shown.clone(),
        source,
    })?;
    parse(&text, &shown)
}

/// Parses registry YAML; `origin` names the source in errors.
pub fn parse(text: &str, origin: &str) -> Result<Vec<RegistryModel>, RegistryFileError> {
    let yaml_error = |source| RegistryFileError::Yaml {
        path: origin.to_owned(),
        source: Box::new(source),
    };
    // A list starts with `-` or `[`; anything else is read as a manifest.
    let is_list = text
        .lines()
        .map(str::trim_start)
        .find(|l| !l.is_empty() && !l.starts_with('#') && *l != "---")
        .is_some_and(|l| l.starts_with('-') || l.starts_with('['));
    let entries: Vec<Entry> = if is_list {
        serde_saphyr::from_str(text).map_err(yaml_error)?
    } else {
        serde_saphyr::from_str::<Manifest>(text)
            .map_err(yaml_error)?
            .spec
            .models
    };
    let mut models = Vec::with_capacity(entries.len());
    for e in entries {
        let size = match e.size {
            SizeValue::Bytes(b) => Ok(b),
            SizeValue::Negative(n) => Err(QuantityError::Negative(n.to_string())),
            SizeValue::Quantity(q) => parse_bytes(&q),
        }
        .map_err(|source| RegistryFileError::Size {
            path: origin.to_owned(),
            name: e.name.clone(),
            source,
        })?;
        models.push(RegistryModel {
            name: e.name,
            size,
            pinned: e.pinned,
        });
    }
    // Validate names and sizes the way the engine will use them.
    build_engine(0, &models).map_err(|source| RegistryFileError::Registry {
        path: origin.to_owned(),
        source,
    })?;
    Ok(models)
}

/// An engine with `budget` and every model registered (none resident).
pub fn build_engine(budget: Bytes, models: &[RegistryModel]) -> Result<Engine, RegistryError> {
    let mut engine = Engine::new(budget);
    for m in models {
        engine.register(&m.name, m.size, m.pinned)?;
    }
    Ok(engine)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reads_quantities_numbers_and_pins() {
        let models = parse(
            "- {name: a, size: 10Mi}\n- {name: b, size: 2048, pinned: true}\n- name: c\n  size: 1Gi\n  template: {spec: {containers: []}}\n",
            "test.yaml",
        )
        .unwrap();
        assert_eq!(
            models,
            vec![
                RegistryModel {
                    name: "a".into(),
                    size: 10 << 20,
                    pinned: false
                },
                RegistryModel {
                    name: "b".into(),
                    size: 2048,
                    pinned: true
                },
                RegistryModel {
                    name: "c".into(),
                    size: 1 << 30,
                    pinned: false
                },
            ]
        );
    }

    #[test]
    fn reads_the_models_of_a_modelresidency_manifest() {
        let text = "# a GPU\napiVersion: residency.dev/v1alpha1\nkind: ModelResidency\nmetadata: {name: g}\nspec:\n  nodeName: n\n  budget: 1Gi\n  models:\n  - {name: a, size: 1Mi, pinned: true}\n";
        let models = parse(text, "m.yaml").unwrap();
        assert_eq!(
            models,
            vec![RegistryModel {
                name: "a".into(),
                size: 1 << 20,
                pinned: true
            }]
        );
    }

    #[test]
    fn bad_files_name_the_file_and_the_problem() {
        let cases = [
            (
                "- {name: a, size: -5}\n",
                "test.yaml: model \"a\": size: \"-5\" is negative",
            ),
            ("- {name: a, size: 5MB}\n", "unknown unit \"MB\""),
            ("- {name: a}\n", "missing field `size`"),
            (
                "- {name: a, size: 1, pined: true}\n",
                "unknown field `pined`",
            ),
            (
                "- {name: a, size: 1}\n- {name: a, size: 2}\n",
                "\"a\" is already registered",
            ),
            ("- {name: a, size: 0}\n", "size 0"),
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
