//! A residency's state as typed values: the spec checked and converted
//! ([`validate`]), and the engine as the last status left it ([`restore`]).
//!
//! This is the only place that reads status strings (sizes, times, the
//! budget) back into numbers; everything after it (the decide step, the
//! CLI's `status` view) works on the typed values.

use crate::api::{ModelResidency, ModelResidencyStatus, ModelSpec, ModelState, ModelStatus};
use crate::engine::{Bytes, Engine, Eviction, Sleep};
use crate::quantity::{QuantityError, parse_bytes};
use crate::residency::labels::{fits_label_value, is_dns_subdomain};
use k8s_openapi::jiff::{SignedDuration, Timestamp};
use std::collections::{HashMap, HashSet};
use std::time::Duration;

/// Why a spec cannot be acted on. Its text is the `InvalidSpec` condition's
/// message.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum InvalidSpec {
    #[error("the name {0:?} is longer than 63 characters; it must fit a label value")]
    NameTooLong(String),
    #[error("spec.nodeName: {0:?} is not a node name (lowercase letters, digits, '-' and '.')")]
    NodeName(String),
    #[error("spec.budget: {0}")]
    Budget(QuantityError),
    #[error("spec.budget: must be positive")]
    ZeroBudget,
    #[error("spec.budget is omitted and the device's memory is not known yet")]
    NoBudget,
    #[error("spec.models: {0:?} is listed twice")]
    DuplicateModel(String),
    #[error("spec.models[{model}].size: {problem}")]
    Size {
        model: String,
        problem: QuantityError,
    },
    #[error("spec.models[{0}].size: must be positive")]
    ZeroSize(String),
    #[error("{field}: {value:?} is not a duration like 90s, 10m or 1h30m")]
    KeepAlive { field: String, value: String },
    #[error("{0}")]
    Warm(String),
    #[error("spec.models[{model}]: a model of gpus: {gpus} {problem}")]
    Gang {
        model: String,
        gpus: u8,
        problem: &'static str,
    },
    #[error("spec.demand.{model}: {value:?} is not an RFC 3339 time: {problem}")]
    RequestTime {
        model: String,
        value: String,
        problem: String,
    },
}

/// A residency's VRAM figures in bytes (for metrics and views, which
/// therefore never parse status strings).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Usage {
    pub budget: Bytes,
    pub used: Bytes,
    pub peak: Bytes,
    /// Models holding VRAM (loaded, loading or failed).
    pub resident: u32,
    /// Another residency holds the GPU, so this one loads nothing.
    pub gpu_conflict: bool,
    /// The GPU takes no new models (GpuHealthy=False: a device taint, a
    /// cordoned node).
    pub gpu_unhealthy: bool,
}

/// A registry entry with its size in bytes.
#[derive(Clone, Copy, Debug)]
pub struct ValidModel<'a> {
    pub spec: &'a ModelSpec,
    pub size: Bytes,
    /// How long it may stay resident without a request (its own keepAlive,
    /// else the residency's); `None`: until evicted. Zero means never
    /// unloaded for idleness.
    pub keep_alive: Option<Duration>,
    /// How it sleeps, if it can (spec.models[].sleep, checked).
    pub sleep: Option<Sleep>,
}

impl ValidModel<'_> {
    pub fn name(&self) -> &str {
        &self.spec.name
    }
}

/// A demand entry: a request for `model` made at `at`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
pub struct Request<'a> {
    pub at: Timestamp,
    pub model: &'a str,
}

/// The spec, checked and converted.
#[derive(Debug)]
pub struct Valid<'a> {
    pub budget: Bytes,
    /// In registry order.
    pub models: Vec<ValidModel<'a>>,
    /// Oldest first (ties by model name): the order requests are applied in.
    pub demand: Vec<Request<'a>>,
    /// spec.warm.hostBudget in bytes (0 when unset).
    pub host_budget: Bytes,
    pub eviction: Eviction,
}

/// Checks a residency's spec and converts its quantities and times, with
/// the budget its status was last computed against (the spec's when the
/// status has none): what a reader of the object (the router, the CLI)
/// works with.
pub fn validate(r: &ModelResidency) -> Result<Valid<'_>, InvalidSpec> {
    let declared = declared_budget(r)?;
    let recorded = r
        .status
        .as_ref()
        .and_then(|s| s.budget.as_deref())
        .and_then(|b| parse_bytes(b).ok())
        .filter(|&b| b > 0);
    let budget = recorded.or(declared).ok_or(InvalidSpec::NoBudget)?;
    validate_with_budget(r, budget)
}

/// spec.budget in bytes; `None` when omitted (claim mode may leave it to
/// the device).
pub fn declared_budget(r: &ModelResidency) -> Result<Option<Bytes>, InvalidSpec> {
    let Some(budget) = &r.spec.budget else {
        return Ok(None);
    };
    let budget = parse_bytes(&budget.0).map_err(InvalidSpec::Budget)?;
    if budget == 0 {
        return Err(InvalidSpec::ZeroBudget);
    }
    Ok(Some(budget))
}

/// [`validate`] with the budget decided elsewhere (the reconciler's, from
/// the spec and the device).
pub fn validate_with_budget(r: &ModelResidency, budget: Bytes) -> Result<Valid<'_>, InvalidSpec> {
    let name = r.metadata.name.as_deref().unwrap_or_default();
    if !fits_label_value(name) {
        return Err(InvalidSpec::NameTooLong(name.to_owned()));
    }
    let spec = &r.spec;
    // The schema says so too; an object stored before it did gets this
    // rather than a pod the API server rejects for every model.
    if let Some(node) = &spec.node_name
        && !is_dns_subdomain(node)
    {
        return Err(InvalidSpec::NodeName(node.clone()));
    }
    let default_keep_alive = keep_alive("spec.keepAlive".into(), spec.keep_alive.as_deref())?;
    let mut seen = HashSet::new();
    let mut models = Vec::with_capacity(spec.models.len());
    for m in &spec.models {
        if !seen.insert(m.name.as_str()) {
            return Err(InvalidSpec::DuplicateModel(m.name.clone()));
        }
        models.push(validate_model(m, default_keep_alive)?);
    }
    let demand = requests(spec)?;
    let host_budget = match &spec.warm {
        Some(w) => parse_bytes(&w.host_budget.0)
            .map_err(|e| InvalidSpec::Warm(format!("spec.warm.hostBudget: {e}")))?,
        None => 0,
    };
    Ok(Valid {
        budget,
        models,
        demand,
        host_budget,
        eviction: spec.eviction.into(),
    })
}

/// A keepAlive (or loadTime) duration, named by `field` in the error.
fn keep_alive(field: String, value: Option<&str>) -> Result<Option<Duration>, InvalidSpec> {
    match value {
        None => Ok(None),
        Some(v) => {
            crate::quantity::parse_duration(v)
                .map(Some)
                .ok_or_else(|| InvalidSpec::KeepAlive {
                    field,
                    value: v.to_owned(),
                })
        }
    }
}

/// One registry entry: its size, keepAlive (its own or the residency's),
/// load time and sleep figures.
fn validate_model(
    m: &ModelSpec,
    default_keep_alive: Option<Duration>,
) -> Result<ValidModel<'_>, InvalidSpec> {
    let size = parse_bytes(&m.size.0).map_err(|problem| InvalidSpec::Size {
        model: m.name.clone(),
        problem,
    })?;
    if size == 0 {
        return Err(InvalidSpec::ZeroSize(m.name.clone()));
    }
    let own = keep_alive(
        format!("spec.models[{}].keepAlive", m.name),
        m.keep_alive.as_deref(),
    )?;
    if let Some(t) = &m.load_time
        && crate::residency::warm::seconds(t).is_none()
    {
        return Err(InvalidSpec::KeepAlive {
            field: format!("spec.models[{}].loadTime", m.name),
            value: t.to_string(),
        });
    }
    if let Some(gpus) = m.gpus {
        let gang = |problem| InvalidSpec::Gang {
            model: m.name.clone(),
            gpus,
            problem,
        };
        if gpus == 0 || gpus > 16 {
            return Err(gang("is out of range: 1 to 16 GPUs"));
        }
        if gpus > 1 {
            if m.copies.is_some() {
                return Err(gang("cannot declare copies yet"));
            }
            if m.lora.is_some() {
                return Err(gang("cannot declare lora yet"));
            }
            if m.artifact.is_some() {
                return Err(gang("cannot declare an artifact yet"));
            }
        }
    }
    let sleep = match &m.sleep {
        Some(s) => Some(
            crate::residency::warm::sleep_figures(&m.name, s, size).map_err(InvalidSpec::Warm)?,
        ),
        None => None,
    };
    Ok(ValidModel {
        spec: m,
        size,
        keep_alive: own.or(default_keep_alive),
        sleep,
    })
}

/// spec.demand as requests, oldest first.
fn requests(spec: &crate::api::ModelResidencySpec) -> Result<Vec<Request<'_>>, InvalidSpec> {
    let mut demand = Vec::with_capacity(spec.demand.len());
    for (model, time) in &spec.demand {
        let at = time
            .parse()
            .map_err(|e: k8s_openapi::jiff::Error| InvalidSpec::RequestTime {
                model: model.clone(),
                value: time.clone(),
                problem: e.to_string(),
            })?;
        demand.push(Request {
            at,
            model: model.as_str(),
        });
    }
    demand.sort();
    Ok(demand)
}

/// `t` plus `d`, or the last time there is when that is later (a keepAlive
/// of a million years, a status hand-edited to the year 9999): such a
/// deadline never comes, which is what it means.
pub fn later(t: Timestamp, d: Duration) -> Timestamp {
    SignedDuration::try_from(d)
        .ok()
        .and_then(|d| t.checked_add(d).ok())
        .unwrap_or(Timestamp::MAX)
}

/// A time recorded in status; a hand-edited value that does not parse is
/// no time.
pub fn recorded_time(s: Option<&str>) -> Option<Timestamp> {
    s.and_then(|s| s.parse().ok())
}

/// The size a resident model was admitted with, as its status records it.
/// A hand-edited status may say anything; zero or unreadable is no size.
pub fn recorded_size(m: &ModelStatus) -> Option<Bytes> {
    m.is_resident()
        .then_some(m.size.as_deref())
        .flatten()
        .and_then(|s| parse_bytes(s).ok())
        .filter(|&s| s > 0)
}

/// The engine as the last status left it.
#[derive(Debug)]
pub struct Restored {
    pub engine: Engine,
    /// Resident models no longer in the registry: registered with their
    /// recorded size so they can be unloaded properly.
    pub removed: Vec<String>,
    /// Residents the recorded budget could not hold (a status edited by
    /// hand): dropped rather than break the invariant.
    pub overflow: Vec<String>,
}

/// A previous status's models, each name once: the first entry of a name
/// stands, as [`ModelResidencyStatus::model`] reads it. The operator never
/// writes a name twice, but a status edited by hand (or by another writer)
/// can; a later duplicate must not restore a model twice or have its pod
/// counted at another size than the one the budget checks see.
pub fn recorded_models(status: &ModelResidencyStatus) -> impl Iterator<Item = &ModelStatus> {
    let mut seen = HashSet::new();
    status.models.iter().filter(move |m| seen.insert(&*m.name))
}

/// Rebuilds the engine from a previous status: the recorded budget, every
/// registry model (at its recorded size while resident, so a size change is
/// seen as one), the residents in LRU order (those still `Loading` or
/// `Fetching` marked loading: no request evicts them), and the counters and
/// peak.
pub fn restore(valid: &Valid<'_>, status: &ModelResidencyStatus) -> Restored {
    let recorded: HashMap<&str, &ModelStatus> =
        recorded_models(status).map(|m| (&*m.name, m)).collect();
    let resident_size = |name: &str| recorded.get(name).and_then(|m| recorded_size(m));
    let budget = status
        .budget
        .as_deref()
        .and_then(|b| parse_bytes(b).ok())
        .unwrap_or(valid.budget);
    let mut engine = Engine::new(budget);
    engine.set_eviction(valid.eviction);
    engine.set_host_budget(valid.host_budget);
    // `rate` eviction's clock first: each model's rate is counted on it.
    engine.resume_served(status.served.unwrap_or(0));
    for m in &valid.models {
        let size = resident_size(m.name()).unwrap_or(m.size);
        let id = engine
            .register(m.name(), size, m.spec.pinned)
            .expect("validated: unique names, positive sizes");
        // At a recorded size its sleeping size does not fit under, it does
        // not sleep until it is re-admitted at the new one.
        let _ = engine.set_sleep(id, m.sleep);
        let prev = recorded.get(m.name());
        let costs = crate::residency::warm::costs(
            m.spec,
            prev.and_then(|p| p.load_seconds),
            prev.and_then(|p| p.wake_seconds),
        );
        engine.set_costs(id, costs);
        if let Some((rate, at)) = prev.and_then(|p| p.rate.zip(p.rate_at)) {
            engine.resume_rate(id, rate, at);
        }
    }
    let mut removed = Vec::new();
    let mut residents: Vec<&ModelStatus> = Vec::new();
    // Evicted models come back into the recency order too (not onto the
    // GPU): what the seed's LRU would hold is what `cost` and `rate` are
    // weighed against.
    let evicted: Vec<&ModelStatus> = recorded_models(status)
        .filter(|m| m.state == ModelState::Evicted && engine.id(&m.name).is_some())
        .collect();
    for m in recorded_models(status).filter(|m| m.is_resident()) {
        if engine.id(&m.name).is_none() {
            let Some(size) = recorded_size(m) else {
                continue;
            };
            if engine.register(&m.name, size, false).is_err() {
                continue;
            }
            removed.push(m.name.to_string());
        }
        residents.push(m);
    }
    residents.extend(evicted);
    residents.sort_by(|a, b| {
        recorded_time(a.last_used.as_deref())
            .cmp(&recorded_time(b.last_used.as_deref()))
            .then(a.name.cmp(&b.name))
    });
    let mut overflow = Vec::new();
    for m in residents {
        let id = engine.id(&m.name).expect("registered above");
        if m.state == ModelState::Evicted {
            engine.restore_recency(id);
            continue;
        }
        let restored = if m.state == ModelState::Sleeping {
            engine.restore_asleep(id)
        } else {
            engine.restore(id)
        };
        if restored.is_err() {
            overflow.push(m.name.to_string());
        } else if matches!(m.state, ModelState::Loading | ModelState::Fetching) {
            engine.set_loading(id, true);
        }
        if restored.is_ok() {
            engine.resume_value(id, m.uses, m.value_base.unwrap_or(0.0));
        }
    }
    if let Some(inflation) = status.inflation {
        engine.resume_inflation(inflation);
    }
    if let Some(lag) = status.lag {
        engine.resume_lag(lag);
    }
    let peak = status
        .peak
        .as_deref()
        .and_then(|p| parse_bytes(p).ok())
        .unwrap_or(0);
    engine.resume(status.counters, peak);
    Restored {
        engine,
        removed,
        overflow,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::api::{ByteQuantity, ModelResidencySpec, ModelState};

    #[test]
    fn node_names_are_dns_subdomains() {
        for ok in ["n", "node-a", "gpu-1.example.com", "a1", &"a".repeat(253)] {
            assert!(is_dns_subdomain(ok), "{ok}");
        }
        for bad in [
            "",
            "Node-A",
            "node_a",
            "-a",
            "a-",
            "a..b",
            ".a",
            "Bad Node!",
            &"a".repeat(254),
        ] {
            assert!(!is_dns_subdomain(bad), "{bad}");
        }
        let mut r = residency(&[("a", "1Gi")]);
        r.spec.node_name = Some("Node_A".into());
        assert_eq!(
            validate(&r).unwrap_err().to_string(),
            "spec.nodeName: \"Node_A\" is not a node name (lowercase letters, digits, '-' and '.')"
        );
    }

    fn residency(models: &[(&str, &str)]) -> ModelResidency {
        let mut r = ModelResidency::new(
            "gpu",
            ModelResidencySpec {
                catalog: None,
                node_name: Some("n".into()),
                device: "0".into(),
                gpu: Default::default(),
                budget: Some(ByteQuantity("10Gi".into())),
                budget_fraction: None,
                models: models
                    .iter()
                    .map(|(n, s)| ModelSpec {
                        name: (*n).into(),
                        size: ByteQuantity((*s).into()),
                        pinned: false,
                        gpus: None,
                        artifact: None,
                        keep_alive: None,
                        template: None,
                        load_time: None,
                        sleep: None,
                        copies: None,
                        lora: None,
                    })
                    .collect(),
                prefetch: 0,
                warm: None,
                eviction: Default::default(),
                anticipate: None,
                keep_alive: None,
                demand: [("b", "2026-11-30T03:00:02Z"), ("a", "2026-11-30T03:00:01Z")]
                    .map(|(m, t)| (m.to_owned(), t.to_owned()))
                    .into_iter()
                    .collect(),
            },
        );
        r.metadata.namespace = Some("ns".into());
        r
    }

    #[test]
    fn validate_converts_sizes_and_orders_demand_by_time() {
        let r = residency(&[("a", "1Gi"), ("b", "2Gi")]);
        let v = validate(&r).unwrap();
        assert_eq!(v.budget, 10 << 30);
        assert_eq!(v.models[1].size, 2 << 30);
        let order: Vec<&str> = v.demand.iter().map(|d| d.model).collect();
        assert_eq!(order, ["a", "b"]);
    }

    #[test]
    fn validate_names_the_field_at_fault() {
        let r = residency(&[("a", "1Gi"), ("a", "2Gi")]);
        assert_eq!(
            validate(&r).unwrap_err().to_string(),
            "spec.models: \"a\" is listed twice"
        );
        let r = residency(&[("a", "0")]);
        assert_eq!(validate(&r).unwrap_err(), InvalidSpec::ZeroSize("a".into()));
        let mut r = residency(&[("a", "1Gi")]);
        r.spec.demand.insert("b".into(), "yesterday".into());
        assert!(
            validate(&r)
                .unwrap_err()
                .to_string()
                .starts_with("spec.demand.b: \"yesterday\"")
        );
    }

    #[test]
    fn restore_rebuilds_lru_order_removed_models_and_overflow() {
        let r = residency(&[("a", "4Gi"), ("b", "4Gi")]);
        let v = validate(&r).unwrap();
        let model = |name: &str, size: &str, used: &str| ModelStatus {
            name: name.into(),
            state: ModelState::Loaded,
            size: Some(size.into()),
            last_used: Some(used.into()),
            ..ModelStatus::default()
        };
        let status = ModelResidencyStatus {
            budget: Some("10Gi".into()),
            models: vec![
                model("b", "4Gi", "2026-11-30T03:00:01Z"),
                // Recorded at its old size: the engine keeps that size.
                model("a", "3Gi", "2026-11-30T03:00:02Z"),
                // Gone from the registry.
                model("gone", "2Gi", "2026-11-30T03:00:00Z"),
                // Past what the budget can hold.
                model("extra", "5Gi", "2026-11-30T03:00:03Z"),
            ],
            ..ModelResidencyStatus::default()
        };
        let rs = restore(&v, &status);
        let e = &rs.engine;
        let lru: Vec<&str> = e.residents().iter().map(|&id| e.name(id)).collect();
        assert_eq!(lru, ["gone", "b", "a"]);
        assert_eq!(e.size(e.id("a").unwrap()), 3 << 30);
        assert_eq!(rs.removed, ["gone", "extra"]);
        assert_eq!(rs.overflow, ["extra"]);
    }
}
