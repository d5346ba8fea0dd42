//! The forecasts of the residencies with `spec.anticipate` on (#69):
//! learnt from the demand entries the routers write (each entry newer than
//! the last one counted is a request at its time), kept in memory per
//! residency, and, with `--persist-forecasts`, in a ConfigMap of the
//! residency's namespace (`<residency>-forecasts`, owned by the residency,
//! so it goes with it) that a restarted operator or a new leader reads
//! back. A residency with anticipation off keeps none.
//!
//! What is lost: up to [`PERSIST_EVERY`] of learning when the operator
//! stops; demand entries are request times at the routers' recency
//! resolution (5 s by default), so a model's busiest seconds count once
//! per resolution (what the forecast needs is whether a slot sees a
//! request, not how many).

use super::decide::{Forecasts, epoch_seconds};
use crate::api::ModelResidency;
use crate::engine::forecast::{BYTES, Forecast};
use crate::metrics::Metrics;
use k8s_openapi::ByteString;
use k8s_openapi::api::core::v1::ConfigMap;
use k8s_openapi::jiff::Timestamp;
use kube::api::{Api, Patch, PatchParams};
use kube::{Resource, ResourceExt};
use std::collections::HashMap;
use std::io::{Read, Write};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

/// How often a residency's changed forecasts are written.
pub const PERSIST_EVERY: Duration = Duration::from_secs(300);
/// The ConfigMap's one key.
const KEY: &str = "forecasts.gz";
/// A ConfigMap holds at most 1 MiB: what does not fit below this is the
/// models requested longest ago, which are left out.
const MAX_STORED: usize = 900 * 1024;

/// One residency's forecasts.
#[derive(Default)]
pub struct Kept {
    /// The residency's uid: a residency recreated under the same name
    /// starts afresh.
    uid: String,
    pub models: Forecasts,
    /// Whether the stored copy was read (or found absent).
    read: bool,
    written_at: Option<Instant>,
    changed: bool,
}

/// One residency's forecasts, behind the lock its reconciles take in turn.
type Shared = Arc<tokio::sync::Mutex<Kept>>;

/// Every residency's forecasts, by namespace and name.
#[derive(Default)]
pub struct ForecastStore {
    by_residency: Mutex<HashMap<(String, String), Shared>>,
    /// Whether they are kept in ConfigMaps too (`--persist-forecasts`).
    pub persist: bool,
}

/// The ConfigMap that keeps `residency`'s forecasts.
pub fn configmap_name(residency: &str) -> String {
    const SUFFIX: &str = "-forecasts";
    let keep = residency.len().min(253 - SUFFIX.len());
    format!("{}{SUFFIX}", &residency[..keep])
}

impl ForecastStore {
    /// `r`'s forecasts with its demand entries counted and brought up to
    /// `now`; `None` with anticipation off there (and what was kept for it
    /// is dropped).
    pub async fn learn(
        &self,
        client: &kube::Client,
        metrics: &Metrics,
        r: &ModelResidency,
        now: Timestamp,
    ) -> Option<tokio::sync::OwnedMutexGuard<Kept>> {
        let key = (r.namespace().unwrap_or_default(), r.name_any());
        let on = r.spec.anticipate.as_ref().is_some_and(|a| a.enabled);
        if !on {
            self.forget(&key.0, &key.1);
            return None;
        }
        let uid = r.metadata.uid.clone().unwrap_or_default();
        let kept = {
            let mut all = self.by_residency.lock().expect("forecasts lock");
            all.entry(key.clone()).or_default().clone()
        };
        let mut kept = kept.lock_owned().await;
        if kept.uid != uid {
            *kept = Kept {
                uid: uid.clone(),
                ..Kept::default()
            };
        }
        if !kept.read {
            if self.persist {
                kept.models = read(client, metrics, &key.0, &key.1, &uid).await;
            }
            kept.read = true;
        }
        let t = epoch_seconds(now);
        for (model, at) in r.spec.demand.iter() {
            let Ok(at) = at.parse::<Timestamp>() else {
                continue;
            };
            // A time ahead of the clock counts as now, as decide takes it.
            let at = epoch_seconds(at).min(t);
            let f = kept.models.entry(model.to_owned()).or_default();
            if f.last_request().is_none_or(|last| at > last) {
                f.request(at);
                kept.changed = true;
            }
        }
        for f in kept.models.values_mut() {
            f.advance(t);
        }
        // Models that left the registry are forgotten.
        let registry: std::collections::HashSet<&str> =
            r.spec.models.iter().map(|m| m.name.as_str()).collect();
        let before = kept.models.len();
        kept.models.retain(|m, _| registry.contains(m.as_str()));
        kept.changed |= kept.models.len() != before;
        Some(kept)
    }

    /// Writes `kept` to `r`'s ConfigMap when it changed and was not
    /// written for [`PERSIST_EVERY`] (a failure is logged and tried again
    /// at a later reconcile).
    pub async fn persist(
        &self,
        client: &kube::Client,
        metrics: &Metrics,
        r: &ModelResidency,
        kept: &mut Kept,
    ) {
        let due = kept.written_at.is_none_or(|w| w.elapsed() >= PERSIST_EVERY);
        if !self.persist || !kept.changed || !due {
            return;
        }
        let ns = r.namespace().unwrap_or_default();
        let Some(owner) = r.controller_owner_ref(&()) else {
            return;
        };
        let name = configmap_name(&r.name_any());
        let map = ConfigMap {
            metadata: kube::api::ObjectMeta {
                name: Some(name.clone()),
                namespace: Some(ns.clone()),
                labels: Some(
                    [(
                        crate::residency::labels::RESIDENCY_LABEL.to_owned(),
                        r.name_any(),
                    )]
                    .into(),
                ),
                owner_references: Some(vec![owner]),
                ..Default::default()
            },
            binary_data: Some([(KEY.to_owned(), ByteString(encode(&kept.models)))].into()),
            ..Default::default()
        };
        let api: Api<ConfigMap> = Api::namespaced(client.clone(), &ns);
        metrics.api_request("patch", "configmaps");
        let params = PatchParams::apply(crate::residency::labels::MANAGER).force();
        match api.patch(&name, &params, &Patch::Apply(&map)).await {
            Ok(_) => {
                kept.written_at = Some(Instant::now());
                kept.changed = false;
            }
            Err(e) => {
                tracing::warn!(configmap = %name, namespace = %ns, error = %e, "could not keep the forecasts")
            }
        }
    }

    /// Drops what is kept for residencies not in `present` (a relist).
    pub fn keep_only(&self, present: &std::collections::HashSet<(String, String)>) {
        self.by_residency
            .lock()
            .expect("forecasts lock")
            .retain(|key, _| present.contains(key));
    }

    /// Drops what is kept for a residency (deleted, or anticipation off).
    pub fn forget(&self, namespace: &str, name: &str) {
        let key = (namespace.to_owned(), name.to_owned());
        self.by_residency
            .lock()
            .expect("forecasts lock")
            .remove(&key);
    }
}

/// The stored forecasts of residency `uid`, or none (absent, unreadable,
/// or another object's: a ConfigMap of that name the residency does not
/// own is left alone).
async fn read(
    client: &kube::Client,
    metrics: &Metrics,
    ns: &str,
    residency: &str,
    uid: &str,
) -> Forecasts {
    let api: Api<ConfigMap> = Api::namespaced(client.clone(), ns);
    metrics.api_request("get", "configmaps");
    let name = configmap_name(residency);
    let map = match api.get_opt(&name).await {
        Ok(Some(map)) => map,
        Ok(None) => return Forecasts::new(),
        Err(e) => {
            tracing::warn!(configmap = %name, namespace = %ns, error = %e, "could not read the kept forecasts; learning afresh");
            return Forecasts::new();
        }
    };
    let owned = map.owner_references().iter().any(|o| o.uid == uid);
    if !owned {
        tracing::warn!(configmap = %name, namespace = %ns, "a ConfigMap of the forecasts' name that this residency does not own; learning afresh");
        return Forecasts::new();
    }
    let bytes = map.binary_data.as_ref().and_then(|d| d.get(KEY));
    bytes.map(|b| decode(&b.0)).unwrap_or_default()
}

/// The forecasts as stored: gzip of, per model, its name's length (u16),
/// its name and its forecast's bytes. The models requested longest ago
/// are left out where all would not fit a ConfigMap.
pub fn encode(models: &Forecasts) -> Vec<u8> {
    let mut names: Vec<(&String, &Forecast)> = models.iter().collect();
    // Newest first, so what is cut is the oldest.
    names.sort_by(|a, b| {
        let last = |f: &Forecast| f.last_request().unwrap_or(0.0);
        last(b.1).total_cmp(&last(a.1)).then(a.0.cmp(b.0))
    });
    let mut keep = names.len();
    loop {
        let mut raw = Vec::with_capacity(keep * (BYTES + 66));
        for (name, f) in &names[..keep] {
            raw.extend_from_slice(&(name.len() as u16).to_le_bytes());
            raw.extend_from_slice(name.as_bytes());
            raw.extend_from_slice(&f.to_bytes());
        }
        let mut gz = flate2::write::GzEncoder::new(Vec::new(), flate2::Compression::default());
        let out = gz
            .write_all(&raw)
            .and_then(|_| gz.finish())
            .unwrap_or_default();
        if out.len() <= MAX_STORED || keep == 0 {
            return out;
        }
        keep /= 2;
    }
}

/// [`encode`]'s inverse; what cannot be read ends the list (a cut or
/// corrupt store gives what came before).
pub fn decode(stored: &[u8]) -> Forecasts {
    let mut raw = Vec::new();
    // Bounded: a store is at most a ConfigMap's 1 MiB, and a forecast
    // compresses at most about 1,000 times.
    let limit = (stored.len() as u64).saturating_mul(1024).min(1 << 30);
    let _ = flate2::read::GzDecoder::new(stored)
        .take(limit)
        .read_to_end(&mut raw);
    let mut models = Forecasts::new();
    let mut rest = raw.as_slice();
    while rest.len() >= 2 {
        let len = u16::from_le_bytes([rest[0], rest[1]]) as usize;
        let Some(entry) = rest.get(2..2 + len + BYTES) else {
            break;
        };
        let (name, bytes) = entry.split_at(len);
        let (Ok(name), Some(f)) = (std::str::from_utf8(name), Forecast::from_bytes(bytes)) else {
            break;
        };
        models.insert(name.to_owned(), f);
        rest = &rest[2 + len + BYTES..];
    }
    models
}

#[cfg(test)]
mod tests {
    use super::*;

    fn forecasts(n: usize) -> Forecasts {
        (0..n)
            .map(|i| {
                let mut f = Forecast::default();
                for day in 0..3 {
                    f.request(1.7e9 + (day * 86_400 + i * 600) as f64);
                }
                (format!("model-{i}"), f)
            })
            .collect()
    }

    #[test]
    fn forecasts_read_back_as_they_were_written() {
        let models = forecasts(50);
        let stored = encode(&models);
        assert!(stored.len() < 50 * BYTES / 4, "{} bytes", stored.len());
        assert_eq!(decode(&stored), models);
    }

    #[test]
    fn a_cut_or_foreign_store_reads_as_what_it_holds_whole_never_a_panic() {
        let models = forecasts(5);
        let stored = encode(&models);
        assert!(decode(&stored[..stored.len() / 2]).len() < 5);
        assert!(decode(b"not gzip at all").is_empty());
        assert!(decode(&[]).is_empty());
        // A store whose lengths lie.
        let mut gz = flate2::write::GzEncoder::new(Vec::new(), flate2::Compression::fast());
        gz.write_all(&[0xff, 0xff, b'a']).unwrap();
        assert!(decode(&gz.finish().unwrap()).is_empty());
    }

    #[test]
    fn a_name_too_long_for_its_configmap_is_cut_to_fit() {
        assert_eq!(configmap_name("gpu-0"), "gpu-0-forecasts");
        assert_eq!(configmap_name(&"a".repeat(253)).len(), 253);
    }
}
