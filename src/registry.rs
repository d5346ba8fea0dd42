//! Model registry files for `simulate --registry`: either a YAML list of
//! `{name, size, pinned}` models, or a whole `ModelResidency` manifest whose
//! `spec.models` is that list (so one file serves `kubectl apply` and the
//! simulator; templates are accepted and ignored here). A model's
//! `loadTime` and `sleep` give the simulator its costs and its warm tier.

use crate::api::SleepSpec;
use crate::engine::{Bytes, Costs, Engine, RegistryError, Sleep};
use crate::quantity::{QuantityError, parse_bytes};
use crate::residency::warm::{declared_costs, sleep_figures};
use serde::Deserialize;
use std::path::Path;

/// One registry entry, sizes resolved to bytes.
#[derive(Clone, Debug, PartialEq)]
pub struct RegistryModel {
    pub name: String,
    pub size: Bytes,
    pub pinned: bool,
    /// Seconds a load and a wake take, as declared (loadTime,
    /// sleep.wakeTime).
    pub load_seconds: Option<f64>,
    pub wake_seconds: Option<f64>,
    /// How it sleeps, if it can.
    pub sleep: Option<Sleep>,
}

/// Load and wake seconds for the models that declare none.
#[derive(Clone, Copy, Debug, Default)]
pub struct DefaultCosts {
    pub load: Option<f64>,
    pub wake: Option<f64>,
}

impl RegistryModel {
    /// A model that cannot sleep, at the default costs.
    pub fn plain(name: &str, size: Bytes, pinned: bool) -> Self {
        RegistryModel {
            name: name.into(),
            size,
            pinned,
            load_seconds: None,
            wake_seconds: None,
            sleep: None,
        }
    }

    /// Its costs: declared, else the defaults given, else the project's.
    pub fn costs(&self, defaults: DefaultCosts) -> Costs {
        let load = self.load_seconds.or(defaults.load);
        let wake = self.wake_seconds.or(defaults.wake);
        let mut costs = declared_costs(None, None, load, None);
        if let Some(wake) = wake {
            costs.wake = wake;
        }
        costs
    }
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct Entry {
    name: String,
    size: SizeValue,
    #[serde(default)]
    pinned: bool,
    #[serde(default, rename = "loadTime")]
    load_time: Option<String>,
    #[serde(default)]
    sleep: Option<SleepSpec>,
    // Accepted so CRD model lists load unchanged.
    #[serde(default)]
    #[allow(dead_code)]
    template: Option<serde_json::Value>,
    #[serde(default, rename = "keepAlive")]
    #[allow(dead_code)]
    keep_alive: Option<String>,
    #[serde(default)]
    #[allow(dead_code)]
    artifact: Option<serde_json::Value>,
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
    #[error("{path}: {problem}")]
    Warm { path: String, problem: String },
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
        if let Some(t) = &e.load_time
            && crate::residency::warm::seconds(t).is_none()
        {
            return Err(RegistryFileError::Warm {
                path: origin.to_owned(),
                problem: format!(
                    "model {:?}: loadTime: {t:?} is not a duration like 45s",
                    e.name
                ),
            });
        }
        let sleep = match &e.sleep {
            Some(spec) => Some(sleep_figures(&e.name, spec, size).map_err(|problem| {
                RegistryFileError::Warm {
                    path: origin.to_owned(),
                    problem,
                }
            })?),
            None => None,
        };
        let wake_seconds = e
            .sleep
            .as_ref()
            .and_then(|s| s.wake_time.as_deref())
            .and_then(crate::residency::warm::seconds);
        models.push(RegistryModel {
            load_seconds: e
                .load_time
                .as_deref()
                .and_then(crate::residency::warm::seconds),
            wake_seconds,
            name: e.name,
            size,
            pinned: e.pinned,
            sleep,
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
    build_engine_with(budget, models, DefaultCosts::default())
}

/// [`build_engine`], with the costs of models that declare none.
pub fn build_engine_with(
    budget: Bytes,
    models: &[RegistryModel],
    defaults: DefaultCosts,
) -> Result<Engine, RegistryError> {
    let mut engine = Engine::new(budget);
    for m in models {
        let id = engine.register(&m.name, m.size, m.pinned)?;
        engine.set_sleep(id, m.sleep)?;
        engine.set_costs(id, m.costs(defaults));
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
                RegistryModel::plain("a", 10 << 20, false),
                RegistryModel::plain("b", 2048, true),
                RegistryModel::plain("c", 1 << 30, false),
            ]
        );
    }

    #[test]
    fn reads_the_models_of_a_modelresidency_manifest() {
        let text = "# a GPU\napiVersion: residency.dev/v1alpha1\nkind: ModelResidency\nmetadata: {name: g}\nspec:\n  nodeName: n\n  budget: 1Gi\n  models:\n  - {name: a, size: 1Mi, pinned: true}\n";
        let models = parse(text, "m.yaml").unwrap();
        assert_eq!(models, vec![RegistryModel::plain("a", 1 << 20, true)]);
    }

    #[test]
    fn reads_load_times_and_how_models_sleep() {
        let text = "- {name: a, size: 10Gi, loadTime: 45s, sleep: {preset: vllm, sleepingSize: 1Gi, hostMemory: 8Gi, wakeTime: 1500ms}}\n- {name: b, size: 4Gi, sleep: {level: 2, sleepingSize: 512Mi}}\n- {name: c, size: 2Gi}\n";
        let models = parse(text, "w.yaml").unwrap();
        let a = &models[0];
        assert_eq!((a.load_seconds, a.wake_seconds), (Some(45.0), Some(1.5)));
        assert_eq!(
            a.sleep,
            Some(Sleep {
                sleeping_size: 1 << 30,
                host_memory: 8 << 30
            })
        );
        assert_eq!(models[1].sleep.map(|s| s.host_memory), Some(0), "level 2");
        let defaults = DefaultCosts {
            load: Some(30.0),
            wake: None,
        };
        assert_eq!(
            models[2].costs(defaults),
            Costs {
                load: 30.0,
                wake: 1.5
            }
        );
        assert_eq!(
            a.costs(defaults),
            Costs {
                load: 45.0,
                wake: 1.5
            }
        );
        let engine = build_engine_with(16 << 30, &models, defaults).unwrap();
        let id = engine.id("a").unwrap();
        assert_eq!(engine.costs(id).load, 45.0);
        assert!(engine.sleep_of(id).is_some());
        for (yaml, want) in [
            (
                "- {name: a, size: 1Gi, sleep: {sleepingSize: 2Gi}}\n",
                "not smaller than the model's size",
            ),
            (
                "- {name: a, size: 1Gi, loadTime: soon}\n",
                "loadTime: \"soon\" is not a duration",
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
