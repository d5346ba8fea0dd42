//! A reconcile started straight from a residency's watch event.
//!
//! kube-runtime's controller passes every reconcile request, even one due
//! now, through its scheduler's `DelayQueue`, which rounds the deadline up
//! to the next millisecond and then sleeps on tokio's timer: 1-2 ms between
//! a watch event and its reconcile (docs/performance.md). A request costs
//! two API writes in series (the demand, then the status), so that wait is
//! a large share of what the operator adds to it.
//!
//! The fast lane runs the reconcile for a residency's live watch change
//! (not a re-list's events) at once when the operator is nearly idle
//! (fewer than [`FAST_LANE_SLOTS`] reconciles running, by either path) and
//! no one is reconciling that residency; every other event goes to the
//! controller, which keeps the queueing, the coalescing of a busy
//! residency's events, the requeues and the retries. So a request that
//! arrives alone is reconciled at once, and a storm goes through the
//! controller (taking storm events in the lane as well would cost the
//! coalescing: more reconciles, docs/performance.md). A fast-lane reconcile that asks for a requeue, or fails,
//! hands the residency back to the controller (after the error's backoff).
//!
//! One reconcile per residency at a time holds across both paths: each
//! takes the residency's turn ([`Turns`]) first, and the controller's path
//! reads the residency from the store again once it has its turn (the
//! copy it was handed may predate a change the fast lane just acted on).

use super::{Context, error_delay, reconcile, report_failure};
use crate::api::ModelResidency;
use futures::channel::mpsc::UnboundedSender;
use kube::runtime::controller::Action;
use kube::runtime::reflector::ObjectRef;
use std::collections::HashSet;
use std::sync::{Arc, Mutex};
use tokio::sync::Notify;
use tokio::task::JoinSet;

/// The lane takes an event only while fewer reconciles than this run.
pub const FAST_LANE_SLOTS: usize = 2;

type Key = ObjectRef<ModelResidency>;

/// Which residencies are being reconciled right now, by either path.
#[derive(Debug, Default)]
pub struct Turns {
    busy: Mutex<HashSet<Key>>,
    freed: Notify,
}

/// A residency's turn; the next may reconcile it once this is dropped.
pub struct Turn {
    turns: Arc<Turns>,
    key: Key,
}

impl Drop for Turn {
    fn drop(&mut self) {
        self.turns
            .busy
            .lock()
            .expect("turns lock")
            .remove(&self.key);
        self.turns.freed.notify_waiters();
    }
}

impl Turns {
    /// How many residencies are being reconciled.
    pub fn held(&self) -> usize {
        self.busy.lock().expect("turns lock").len()
    }

    /// The residency's turn, if no one holds it.
    pub fn try_take(self: &Arc<Self>, key: &Key) -> Option<Turn> {
        let fresh = self.busy.lock().expect("turns lock").insert(key.clone());
        fresh.then(|| Turn {
            turns: self.clone(),
            key: key.clone(),
        })
    }

    /// The residency's turn, once whoever holds it is done.
    pub async fn take(self: &Arc<Self>, key: &Key) -> Turn {
        loop {
            // Registered before trying, so a release in between still wakes it.
            let freed = self.freed.notified();
            tokio::pin!(freed);
            freed.as_mut().enable();
            if let Some(turn) = self.try_take(key) {
                return turn;
            }
            freed.await;
        }
    }
}

/// Where residency events go first; see the module's comment.
pub struct FastLane {
    ctx: Arc<Context>,
    /// Residencies handed back to the controller (a requeue, a retry).
    to_controller: UnboundedSender<Key>,
    /// The lane's reconciles; dropped (and so aborted) with the lane, so a
    /// controller task that is aborted (leadership lost) stops them too.
    running: Mutex<JoinSet<()>>,
}

impl FastLane {
    /// A lane that takes events while fewer than the context's
    /// `fast_lane_slots` reconciles run (0: every event goes to the
    /// controller).
    pub fn new(ctx: Arc<Context>, to_controller: UnboundedSender<Key>) -> Self {
        FastLane {
            ctx,
            to_controller,
            running: Mutex::default(),
        }
    }

    /// Starts the reconcile of `r` (a live change, already in the cache) now
    /// when the operator is nearly idle and no one holds its turn (`None`),
    /// or gives `r` back for the controller.
    pub fn offer(&self, r: ModelResidency) -> Option<ModelResidency> {
        // Offers come one at a time from the event stream, so no other
        // lane reconcile can start between this count and the take.
        if self.ctx.turns.held() >= self.ctx.fast_lane_slots {
            return Some(r);
        }
        let Some(turn) = self.ctx.turns.try_take(&ObjectRef::from_obj(&r)) else {
            return Some(r);
        };
        let mut running = self.running.lock().expect("fast lane lock");
        while running.try_join_next().is_some() {}
        running.spawn(run(
            Arc::new(r),
            self.ctx.clone(),
            turn,
            self.to_controller.clone(),
        ));
        None
    }

    /// Waits for the lane's reconciles (the controller has stopped, so no
    /// more are offered).
    pub async fn finish(&self) {
        let mut running = std::mem::take(&mut *self.running.lock().expect("fast lane lock"));
        while running.join_next().await.is_some() {}
    }
}

/// One fast-lane reconcile, then what the controller must take over.
async fn run(
    r: Arc<ModelResidency>,
    ctx: Arc<Context>,
    turn: Turn,
    to_controller: UnboundedSender<Key>,
) {
    let result = reconcile(r.clone(), ctx.clone()).await;
    let key = turn.key.clone();
    drop(turn);
    let delay = match result {
        Ok(action) if action == Action::await_change() => return,
        // The controller's scheduler keeps requeues (one entry per
        // residency, the earliest wins); its reconcile finds nothing new to
        // write and asks for the same requeue.
        Ok(_) => None,
        Err(e) => {
            report_failure(&r, &e, &ctx);
            Some(error_delay(&e))
        }
    };
    match delay {
        None => {
            let _ = to_controller.unbounded_send(key);
        }
        // Waited out apart, so a shutdown does not wait for it (the
        // controller is gone by then and the send just fails).
        Some(delay) => {
            tokio::spawn(async move {
                tokio::time::sleep(delay).await;
                let _ = to_controller.unbounded_send(key);
            });
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Duration;

    fn key(name: &str) -> Key {
        ObjectRef::new(name).within("ns")
    }

    #[tokio::test]
    async fn a_turn_is_held_by_one_path_at_a_time() {
        let turns = Arc::new(Turns::default());
        let a = turns.try_take(&key("a")).expect("free");
        assert!(turns.try_take(&key("a")).is_none(), "a is taken");
        let b = turns.try_take(&key("b"));
        assert!(b.is_some(), "another residency is not");
        // Polled by hand: pending (not merely slow) while a is held.
        let a_key = key("a");
        let mut waiter = std::pin::pin!(turns.take(&a_key));
        assert!(
            futures::poll!(&mut waiter).is_pending(),
            "waits while a is held"
        );
        drop(a);
        let again = tokio::time::timeout(Duration::from_secs(1), waiter)
            .await
            .expect("woken when a is released");
        assert!(turns.try_take(&key("a")).is_none(), "the waiter holds a");
        drop(again);
        assert!(turns.try_take(&key("a")).is_some());
    }
}
