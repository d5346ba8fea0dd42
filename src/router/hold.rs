//! Holding a request through its model's load: where to request it (the
//! placement rule), once, then waiting on the watches (no polling) until a
//! pod of the model is Ready, bounded by `--load-timeout` and
//! `--max-pending`; a model taken away while the request waits is asked
//! for again once, then the request fails with the reason.

use super::errors::Refusal;
use super::snapshot::{Endpoint, Snapshot};
use super::{ModelLabels, Router, key};
use crate::api::{ModelResidency, ModelState};
use crate::residency::placement::{Placement, place};
use crate::residency::state::recorded_time;
use k8s_openapi::jiff::Timestamp;
use kube::ResourceExt;
use std::sync::Arc;
use std::time::{Duration, Instant};
use tokio::sync::watch;

/// Whether one of `model`'s homes has it sleeping (its request is a wake).
fn sleeps_somewhere(snap: &Snapshot, model: &str) -> bool {
    snap.models.get(model).is_some_and(|view| {
        view.homes
            .iter()
            .any(|&i| snap.state(i, model) == ModelState::Sleeping)
    })
}

impl Router {
    /// Holds a request until its model has a Ready pod, requesting the load
    /// where the placement rule says, bounded by `--load-timeout` and
    /// `--max-pending`. Wakes on the watches, never polls.
    pub(super) async fn hold(
        &self,
        model: &str,
        mut rx: watch::Receiver<Arc<Snapshot>>,
        avoid: Option<&str>,
        key: Option<&str>,
    ) -> Result<Endpoint, Refusal> {
        let _pending = self.enter_pending(model)?;
        self.metrics
            .cold_starts
            .get_or_create(&ModelLabels {
                model: model.to_owned(),
            })
            .inc();
        let start = Instant::now();
        let deadline = tokio::time::Instant::now() + self.config.load_timeout;
        let mut held = Held::default();
        let mut closing = self.closing.subscribe();
        let kind = if sleeps_somewhere(&rx.borrow(), model) {
            "warm"
        } else {
            "cold"
        };
        loop {
            if *closing.borrow_and_update() {
                return Err(shutting_down());
            }
            let snap = rx.borrow_and_update().clone();
            if let Some(endpoint) = self.step(&snap, model, (avoid, key), &mut held).await? {
                let labels = super::metrics::HoldLabels { kind };
                let waited = start.elapsed().as_secs_f64();
                self.metrics.hold.get_or_create(&labels).observe(waited);
                return Ok(endpoint);
            }
            tokio::select! {
                changed = rx.changed() => if changed.is_err() { return Err(shutting_down()) },
                _ = self.retry.notified() => {}
                _ = closing.changed() => {}
                // A request written and never processed is written again
                // after a while (recency::LOST_AFTER): look again then.
                _ = tokio::time::sleep(RELOOK) => {}
                _ = tokio::time::sleep_until(deadline) => {
                    return Err(timed_out(model, self.config.load_timeout));
                }
            }
        }
    }

    /// One look at the cluster for a held request: its pod if one is
    /// Ready; else nothing, after making sure a load is requested (once);
    /// or why it will not load. A model taken away while the request waits
    /// for it (evicted, unloaded) is requested again once; the second time
    /// the request fails at once with the reason.
    async fn step(
        &self,
        snap: &Snapshot,
        model: &str,
        (avoid, key): (Option<&str>, Option<&str>),
        held: &mut Held,
    ) -> Result<Option<Endpoint>, Refusal> {
        let Some(view) = snap.models.get(model) else {
            return Err(Refusal::ModelNotFound(format!(
                "the model `{model}` was removed from every registry while the request waited"
            )));
        };
        if let Some(e) = self.choose(&view.ready, avoid, key) {
            return Ok(Some(e));
        }
        let refused_here = match self.at_its_homes(snap, &view.homes, model, held)? {
            AtHomes::OnTheWay => return Ok(None),
            AtHomes::Nowhere { refused_here } => refused_here,
        };
        if let Some(i) = held.admitted_on.take()
            && snap.state(i, model) != ModelState::Refused
        {
            // Admitted for this request, and gone before it was Ready (a
            // gang queued for placement and then refused was not taken
            // off: the placement below refuses it).
            held.lost += 1;
            if held.lost > 1 {
                let status = snap.model_status(i, model);
                let s = status.and_then(|m| m.message.as_deref()).unwrap_or("gone");
                return Err(Refusal::ModelUnavailable {
                    message: format!(
                        "{model} was taken off {} twice while this request waited for it (last: {s})",
                        snap.residency_name(i)
                    ),
                    retry_after: Duration::from_secs(1),
                });
            }
        }
        self.request_load(snap, &view.homes, model, refused_here, held)
            .await
            .map(|()| None)
    }

    /// What the model's homes say of it: on its way somewhere (admitted,
    /// queued, or this router's request not processed yet), failed (an
    /// error), or nowhere, with a refusal on one of them if there was one.
    fn at_its_homes(
        &self,
        snap: &Snapshot,
        homes: &[usize],
        model: &str,
        held: &mut Held,
    ) -> Result<AtHomes, Refusal> {
        let mut refused_here = None;
        for &i in homes {
            let key = key(snap, i, model);
            let status = snap.model_status(i, model);
            let processed = recorded_time(status.and_then(|m| m.last_requested.as_deref()));
            let why = || {
                let s = status.and_then(|m| m.message.clone()).unwrap_or_default();
                format!("{model} on {}: {s}", snap.residency_name(i))
            };
            match snap.state(i, model) {
                // Admitted here (or queued behind loads): its pod is on
                // the way.
                ModelState::Loaded
                | ModelState::Loading
                | ModelState::Fetching
                | ModelState::Queued => {
                    held.admitted_on = Some(i);
                    return Ok(AtHomes::OnTheWay);
                }
                ModelState::Failed => {
                    let retry_at = recorded_time(status.and_then(|m| m.retry_at.as_deref()));
                    let retry_after = retry_at
                        .and_then(|t| Duration::try_from(t.duration_since(Timestamp::now())).ok())
                        .unwrap_or(Duration::from_secs(10));
                    return Err(Refusal::ModelUnavailable {
                        message: format!("the load failed: {}", why()),
                        retry_after,
                    });
                }
                // A refusal on this GPU stands for this GPU only: the
                // placement looks for one that takes the model.
                ModelState::Refused if self.recency.processed(&key, processed) => {
                    refused_here = Some(why());
                    continue;
                }
                _ => {}
            }
            if self.recency.unprocessed(&key, processed) {
                // Our request waits for the operator.
                return Ok(AtHomes::OnTheWay);
            }
        }
        Ok(AtHomes::Nowhere { refused_here })
    }

    /// Requests the model's load where the placement rule says (once per
    /// unprocessed request), or says why it loads nowhere.
    async fn request_load(
        &self,
        snap: &Snapshot,
        homes: &[usize],
        model: &str,
        refused_here: Option<String>,
        held: &mut Held,
    ) -> Result<(), Refusal> {
        let residencies: Vec<&ModelResidency> =
            homes.iter().map(|&i| &*snap.residencies[i]).collect();
        // This router's own requests the residencies have not processed
        // yet count where they went.
        let written = self.recency.written();
        let pending: Vec<(usize, &str)> = written
            .iter()
            .filter_map(|(k, at)| {
                let j = homes.iter().position(|&h| {
                    let r = &snap.residencies[h];
                    r.namespace().as_deref() == Some(k.0.as_str()) && r.name_any() == k.1
                })?;
                let processed = snap
                    .model_status(homes[j], &k.2)
                    .and_then(|s| recorded_time(s.last_requested.as_deref()));
                processed
                    .is_none_or(|p| *at > p)
                    .then_some((j, k.2.as_str()))
            })
            .collect();
        let i = match place(model, &residencies, &pending) {
            Placement::Nowhere { why, refusing } if refusing.is_empty() => {
                // No home refuses it: each is unusable for now (another
                // residency holds its GPU, its claim is not allocated).
                // That can pass: a 503 to retry, not "waiting will not
                // help".
                return Err(Refusal::ModelUnavailable {
                    message: format!("{why} (this may pass: retry)"),
                    retry_after: Duration::from_secs(5),
                });
            }
            Placement::Nowhere { why, refusing } => {
                // The request still reaches the residencies (at most once
                // per resolution), so their status and counters show the
                // refusal as they would for any other writer.
                for j in refusing {
                    let key = key(snap, homes[j], model);
                    // Refused there for this very request (sent as a load
                    // while the GPU was not placed yet): counted once.
                    let processed = recorded_time(
                        snap.model_status(homes[j], model)
                            .and_then(|m| m.last_requested.as_deref()),
                    );
                    if held.requested
                        && snap.state(homes[j], model) == ModelState::Refused
                        && self.recency.processed(&key, processed)
                    {
                        continue;
                    }
                    if let Some(at) = self.recency.hit(&key, Instant::now()) {
                        let _ = self.write(&key, at, "refused").await;
                    }
                }
                return Err(Refusal::ModelRefused(match refused_here {
                    Some(here) if homes.len() == 1 => format!("refused: {here}"),
                    _ => why,
                }));
            }
            Placement::On(j) => homes[j],
        };
        let key = key(snap, i, model);
        let processed = recorded_time(
            snap.model_status(i, model)
                .and_then(|m| m.last_requested.as_deref()),
        );
        let cold = self.recency.cold(&key, processed, Instant::now());
        held.requested |= cold.is_some();
        if let Some(at) = cold
            && let Err(e) = self.write(&key, at, "cold").await
        {
            return Err(Refusal::ModelUnavailable {
                message: format!(
                    "could not request {model} on {}: {e}",
                    snap.residency_name(i)
                ),
                retry_after: Duration::from_secs(1),
            });
        }
        Ok(())
    }

    fn enter_pending(&self, model: &str) -> Result<PendingGuard<'_>, Refusal> {
        let mut pending = self.pending.lock().expect("pending lock");
        let (per_model, total) = &mut *pending;
        let here = per_model.get(model).copied().unwrap_or(0);
        let full = |message: String| Refusal::TooManyPending {
            message,
            retry_after: Duration::from_secs(5),
        };
        if here >= self.config.max_pending {
            return Err(full(format!(
                "{here} requests already wait for {model} to load (--max-pending)"
            )));
        }
        if *total >= self.config.max_pending_total {
            return Err(full(format!(
                "{total} requests already wait for models to load (--max-pending-total)"
            )));
        }
        per_model.insert(model.to_owned(), here + 1);
        *total += 1;
        self.metrics
            .pending
            .get_or_create(&ModelLabels {
                model: model.to_owned(),
            })
            .inc();
        Ok(PendingGuard {
            router: self,
            model: model.to_owned(),
        })
    }
}

pub(super) fn shutting_down() -> Refusal {
    Refusal::ModelUnavailable {
        message: "the router is shutting down".into(),
        retry_after: Duration::from_secs(1),
    }
}

pub(super) fn timed_out(model: &str, after: Duration) -> Refusal {
    Refusal::ModelUnavailable {
        message: format!(
            "{model} did not become ready within {}s (--load-timeout)",
            after.as_secs()
        ),
        retry_after: Duration::from_secs(30),
    }
}

/// What a held request's model's homes say.
enum AtHomes {
    /// Admitted, queued, or requested and not processed yet: wait.
    OnTheWay,
    /// Not on its way anywhere (a refusal on one home, if any).
    Nowhere { refused_here: Option<String> },
}

/// How often a held request looks again with nothing changed.
const RELOOK: Duration = Duration::from_secs(2);

/// What one held request has seen of its model's load.
#[derive(Debug, Default)]
struct Held {
    /// The home that last showed the model admitted (or queued).
    admitted_on: Option<usize>,
    /// This request wrote a load request (its refusal, if it is refused,
    /// is counted by it).
    requested: bool,
    /// How often the model was admitted and then taken away.
    lost: u32,
}

/// A request counted as waiting for a load until dropped.
struct PendingGuard<'a> {
    router: &'a Router,
    model: String,
}

impl Drop for PendingGuard<'_> {
    fn drop(&mut self) {
        let mut pending = self.router.pending.lock().expect("pending lock");
        let (per_model, total) = &mut *pending;
        if let Some(n) = per_model.get_mut(&self.model) {
            *n -= 1;
            if *n == 0 {
                per_model.remove(&self.model);
            }
        }
        *total -= 1;
        self.router
            .metrics
            .pending
            .get_or_create(&ModelLabels {
                model: self.model.clone(),
            })
            .dec();
    }
}
