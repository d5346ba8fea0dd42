//! Models moved off a GPU before it goes (#70): a GPU that takes no new
//! models but still serves (a NoSchedule device taint announcing
//! maintenance, its node cordoned at the start of a drain) has its hot
//! models loaded or woken on another GPU of the namespace that lists
//! them, while it still serves them, so no request pays a cold load when
//! a NoExecute taint or the drain takes it.
//!
//! Once a [`TICK`] (leader only): on each such GPU, each Loaded model
//! requested within [`HOT`] that no other GPU of its namespace holds awake
//! or is loading gets its demand key written on the home the copy
//! scaler's rule chooses (`place_copy`: a wake, free room, or room made
//! from models not requested within [`HOT`] only; never a GPU that takes
//! no new models), as a router's request would. It is then an ordinary
//! copy there: budget, eviction, warm tier; the routers balance over both
//! until the old GPU goes. A model moved so is not moved again for
//! [`AGAIN_AFTER`].

use super::Context;
use super::cached;
use crate::api::{ModelResidency, ModelState};
use crate::residency::conditions::GPU_HEALTHY;
use crate::residency::placement::place_copy;
use crate::residency::state::recorded_time;
use k8s_openapi::jiff::Timestamp;
use kube::ResourceExt;
use kube::api::Api;
use kube::runtime::events::EventType;
use kube::runtime::reflector::Store;
use std::collections::HashMap;
use std::sync::Arc;
use std::time::{Duration, Instant};

/// How often GPUs that take no new models are looked at.
pub const TICK: Duration = Duration::from_secs(2);
/// A model requested within this long is hot: it is moved first, and it
/// is not what room is made from.
pub const HOT: Duration = Duration::from_secs(600);
/// A model moved is not moved again for this long (its new home's status
/// shows it loading long before).
pub const AGAIN_AFTER: Duration = Duration::from_secs(60);

/// Runs until the task is dropped.
pub async fn run(ctx: Arc<Context>, store: Store<ModelResidency>) {
    let mut ticks = tokio::time::interval(TICK);
    ticks.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    let mut moved: HashMap<(String, String), Instant> = HashMap::new();
    loop {
        ticks.tick().await;
        moved.retain(|_, at| at.elapsed() < AGAIN_AFTER);
        tick(&ctx, &store, &mut moved).await;
    }
}

/// Whether `r`'s GPU takes no new models (its GpuHealthy condition False
/// with it still serving: NoSchedule or a cordon).
fn leaving(r: &ModelResidency) -> bool {
    r.status.as_ref().is_some_and(|s| {
        s.conditions
            .iter()
            .any(|c| c.type_ == GPU_HEALTHY && c.status == "False" && c.reason != "NoExecute")
    })
}

/// Whether `model` was requested on `r` within [`HOT`] of `now`.
fn hot(r: &ModelResidency, model: &str, now: Timestamp) -> bool {
    let used = r
        .status
        .as_ref()
        .and_then(|s| s.model(model))
        .and_then(|m| recorded_time(m.last_used.as_deref()));
    used.is_some_and(|t| t.duration_until(now).unsigned_abs() < HOT)
}

async fn tick(
    ctx: &Context,
    store: &Store<ModelResidency>,
    moved: &mut HashMap<(String, String), Instant>,
) {
    // Nothing tainted or cordoned anywhere (the usual case): no residency
    // is read, none unpacked.
    if !ctx.gpus.any_unhealthy() {
        return;
    }
    let read: Vec<Arc<ModelResidency>> = store
        .state()
        .into_iter()
        .filter_map(|r| ctx.catalogs.resolve(r).ok())
        .map(cached::unpacked)
        .collect();
    let now = Timestamp::now();
    for from in read.iter().filter(|r| leaving(r)) {
        let ns = from.namespace().unwrap_or_default();
        let loaded = from.status.iter().flat_map(|s| &s.models);
        for m in loaded.filter(|m| m.state == ModelState::Loaded) {
            let key = (ns.clone(), m.name.to_string());
            if moved.contains_key(&key) || !hot(from, &m.name, now) {
                continue;
            }
            let homes: Vec<&ModelResidency> = read
                .iter()
                .filter(|r| r.namespace().as_deref() == Some(&*ns))
                .filter(|r| r.spec.models.iter().any(|s| *s.name == *m.name))
                .map(|r| &**r)
                .collect();
            let elsewhere = homes.iter().any(|r| {
                r.name_any() != from.name_any()
                    && r.status
                        .as_ref()
                        .and_then(|s| s.model(&m.name))
                        .is_some_and(|s| {
                            matches!(
                                s.state,
                                ModelState::Loaded | ModelState::Loading | ModelState::Fetching
                            )
                        })
            });
            if elsewhere {
                continue;
            }
            // The leaving GPU holds it awake, so place_copy passes it over.
            let chosen = place_copy(&m.name, &homes, |r, victim| !hot(r, victim, now));
            let Ok(i) = chosen else {
                continue;
            };
            let to = homes[i];
            let api: Api<ModelResidency> = Api::namespaced(ctx.client.clone(), &ns);
            ctx.metrics.api_request("patch", "modelresidencies");
            let written = crate::residency::demand::load(&api, &to.name_any(), &m.name, now).await;
            if let Err(e) = written {
                tracing::warn!(model = %m.name, to = %to.name_any(), error = %e, "could not move a model off a GPU that takes no new models");
                continue;
            }
            moved.insert(key, Instant::now());
            let note = format!(
                "{} is loaded on {} ahead of this GPU going: it takes no new models ({})",
                m.name,
                to.name_any(),
                from.status
                    .as_ref()
                    .and_then(|s| s.conditions.iter().find(|c| c.type_ == GPU_HEALTHY))
                    .map_or("", |c| c.message.as_str())
            );
            super::publish_event(ctx, from, EventType::Normal, "MovedAhead", "Move", note).await;
        }
    }
}
