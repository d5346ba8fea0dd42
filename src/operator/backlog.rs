//! Bursts of residencies to reconcile (every residency at the end of a
//! list of them, the residency of every model pod in a list of pods)
//! handed to the residency controller as it takes them, a window at a
//! time, instead of all at once. The controller's scheduler keeps the room
//! it once needed: after a restart over 10,000 residencies its map and
//! delay queue, grown to 10,000 entries by the list's burst, held 8.5 MB
//! of the operator's heap once every reconcile was done (a heap profile;
//! docs/performance.md). The burst is reconciled no later: the controller
//! runs a few reconciles at a time whatever is queued.

use crate::api::ModelResidency;
use futures::channel::mpsc::UnboundedReceiver;
use futures::{Stream, StreamExt};
use kube::runtime::reflector::ObjectRef;
use std::collections::{HashSet, VecDeque};
use std::time::{Duration, Instant};

/// At most this many handed over and not yet started: enough to keep the
/// controller's reconcile slots busy.
pub const WINDOW: u64 = 32;

/// A handed-over residency the controller merged with one it had queued
/// starts no reconcile of its own, so the count of those not yet started
/// can only overstate: when no reconcile has started for this long, the
/// next window goes anyway.
const STALL: Duration = Duration::from_millis(100);

/// How often a full window looks again.
const POLL: Duration = Duration::from_millis(5);

/// The residencies of `bursts`, each once while it waits, in the order
/// they came, at most [`WINDOW`] ahead of the reconciles `started` counts.
/// Ends when `bursts` closes and nothing waits.
pub fn paced(
    started: impl Fn() -> u64 + Send + 'static,
    bursts: UnboundedReceiver<Vec<ObjectRef<ModelResidency>>>,
) -> impl Stream<Item = ObjectRef<ModelResidency>> + Send {
    let backlog = Backlog {
        bursts,
        waiting: VecDeque::new(),
        queued: HashSet::new(),
        base: started(),
        sent: 0,
        last_started: started(),
        moved_at: Instant::now(),
        started,
    };
    futures::stream::unfold(backlog, |mut b| async move {
        let next = b.next().await?;
        Some((next, b))
    })
}

struct Backlog<F> {
    bursts: UnboundedReceiver<Vec<ObjectRef<ModelResidency>>>,
    waiting: VecDeque<ObjectRef<ModelResidency>>,
    queued: HashSet<ObjectRef<ModelResidency>>,
    /// `started` when `sent` was last zero.
    base: u64,
    sent: u64,
    last_started: u64,
    moved_at: Instant,
    started: F,
}

impl<F: Fn() -> u64> Backlog<F> {
    fn add(&mut self, burst: Vec<ObjectRef<ModelResidency>>) {
        for r in burst {
            if self.queued.insert(r.clone()) {
                self.waiting.push_back(r);
            }
        }
    }

    async fn next(&mut self) -> Option<ObjectRef<ModelResidency>> {
        loop {
            // Whatever came meanwhile joins the queue; a closed channel
            // still lets the queue drain.
            while let Ok(burst) = self.bursts.try_recv() {
                self.add(burst);
            }
            if self.waiting.is_empty() {
                let burst = self.bursts.next().await?;
                self.add(burst);
                continue;
            }
            let started = (self.started)();
            if started != self.last_started {
                (self.last_started, self.moved_at) = (started, Instant::now());
            }
            if self.moved_at.elapsed() >= STALL {
                (self.base, self.sent, self.moved_at) = (started, 0, Instant::now());
            }
            let ahead = self.sent.saturating_sub(started.saturating_sub(self.base));
            if ahead < WINDOW {
                let r = self.waiting.pop_front()?;
                self.queued.remove(&r);
                self.sent += 1;
                if self.waiting.is_empty() {
                    // Their room goes with them (a burst of 10,000 grew
                    // both to that size).
                    (self.waiting, self.queued) = Default::default();
                }
                return Some(r);
            }
            tokio::time::sleep(POLL).await;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::Arc;
    use std::sync::atomic::{AtomicU64, Ordering};

    fn refs(names: &[&str]) -> Vec<ObjectRef<ModelResidency>> {
        names
            .iter()
            .map(|n| ObjectRef::new(n).within("ns"))
            .collect()
    }

    #[tokio::test]
    async fn a_burst_goes_a_window_ahead_of_the_reconciles_each_once_in_order() {
        let started = Arc::new(AtomicU64::new(0));
        let (tx, rx) = futures::channel::mpsc::unbounded();
        let names: Vec<String> = (0..100).map(|i| format!("r{i}")).collect();
        let mut burst = refs(&names.iter().map(String::as_str).collect::<Vec<_>>());
        // One named twice waits once.
        burst.extend(refs(&["r0"]));
        tx.unbounded_send(burst).unwrap();
        let counted = started.clone();
        let mut out = Box::pin(paced(move || counted.load(Ordering::SeqCst), rx));
        let mut got = Vec::new();
        for _ in 0..WINDOW {
            got.push(out.next().await.unwrap().name);
        }
        // A full window: nothing more until reconciles start (well within
        // the stall allowance).
        let more = tokio::time::timeout(Duration::from_millis(30), out.next()).await;
        assert!(more.is_err(), "handed over past the window");
        started.fetch_add(10, Ordering::SeqCst);
        for _ in 0..10 {
            got.push(out.next().await.unwrap().name);
        }
        // No reconcile starts for a while (merged ones): the next window
        // goes anyway, and the rest after it.
        while got.len() < 100 {
            got.push(out.next().await.unwrap().name);
        }
        assert_eq!(got, names);
        drop(tx);
        assert!(out.next().await.is_none());
    }
}
