//! Demand from traffic: when the router writes a request into a
//! residency's `spec.demand`, and when it does not.
//!
//! - A request for a model that is not resident writes a request once per
//!   model and GPU: while the router's last write is not yet processed
//!   (the model's `lastRequested` in status is older), more requests for it
//!   wait on that write instead of adding their own.
//! - A hit refreshes the model's recency at most once per resolution: the
//!   first hit after a quiet `resolution` writes at once; hits within it
//!   mark the model, and the next tick writes for it. Models with requests
//!   in flight are refreshed on the ticks the same way, so a long stream
//!   keeps its model recent. Steady traffic therefore costs at most one
//!   write per model per resolution (per router replica).
//! - One write per model at a time: while one is on its way (an API server
//!   under load can take seconds), the next waits for the tick after it.
//!   Two in flight could land out of order, and the older time would
//!   overwrite the newer one in `spec.demand` (seen in the router bench on
//!   v1.37: a model's demand going back by 10 s).
//! - With a zero resolution every hit writes, before it is proxied, in the
//!   order the hits came: the seed's exact LRU and counters.
//!
//! Pure bookkeeping: the caller does the writes.

use crate::residency::state::later;
use k8s_openapi::jiff::Timestamp;
use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

/// A model on one residency: (namespace, residency, model). Shared, so the
/// hit path never copies the names.
pub type Key = Arc<(String, String, String)>;

/// How long a request this router wrote may stay unprocessed before it is
/// taken as lost and written again: a write whose future was dropped (its
/// client gone mid-write), or that another writer overwrote, would
/// otherwise leave every later request for the model waiting on it.
pub const LOST_AFTER: Duration = Duration::from_secs(10);

#[derive(Default, Debug)]
struct Entry {
    /// When the router last wrote (or started writing) a request for it.
    last_write: Option<Instant>,
    /// The request time of that write.
    written: Option<Timestamp>,
    /// Hit since the last write.
    dirty: bool,
    /// A write is on its way (with a resolution; with none every hit
    /// writes, awaited before it is proxied).
    writing: bool,
    /// Taken for each write of this key, so writes go one at a time.
    turn: std::sync::Arc<tokio::sync::Mutex<()>>,
    /// The newest request time a write of this key has landed.
    landed: Option<Timestamp>,
}

#[derive(Debug)]
pub struct Recency {
    resolution: Duration,
    entries: Mutex<HashMap<Key, Entry>>,
    /// The last request time handed out: times are strictly increasing, so
    /// requests this router writes are processed in the order they came.
    last_time: Mutex<Timestamp>,
}

impl Entry {
    /// Whether a request written for this key is still to be processed (by
    /// a status that last processed one at `processed`), and recent enough
    /// to wait for.
    fn waits(&self, processed: Option<Timestamp>, now: Instant) -> bool {
        let unprocessed = self
            .written
            .is_some_and(|w| processed.is_none_or(|p| w > p));
        let recent = self
            .last_write
            .is_some_and(|t| now.duration_since(t) < LOST_AFTER);
        unprocessed && recent
    }
}

impl Recency {
    pub fn new(resolution: Duration) -> Self {
        Recency {
            resolution,
            entries: Mutex::default(),
            last_time: Mutex::new(Timestamp::UNIX_EPOCH),
        }
    }

    pub fn resolution(&self) -> Duration {
        self.resolution
    }

    fn next_time(&self) -> Timestamp {
        self.next_time_after(None)
    }

    /// The next request time, also later than `after` (the last request
    /// the residency processed): a router whose clock runs behind the
    /// writer of that request would otherwise write times the operator
    /// ignores as already processed, and write them again on every change
    /// it causes.
    fn next_time_after(&self, after: Option<Timestamp>) -> Timestamp {
        // Just after `t`; the last representable time (a status
        // hand-edited to it) has no later one and is as late as it gets.
        let just_after = |t| later(t, Duration::from_micros(1));
        let mut last = self.last_time.lock().expect("recency lock");
        let mut now = Timestamp::now().max(just_after(*last));
        if let Some(after) = after {
            now = now.max(just_after(after));
        }
        *last = now;
        now
    }

    /// A hit on `key`: the request time to write now, if one is due.
    pub fn hit(&self, key: &Key, now: Instant) -> Option<Timestamp> {
        let mut entries = self.entries.lock().expect("recency lock");
        let entry = entries.entry(key.clone()).or_default();
        let due = entry
            .last_write
            .is_none_or(|t| now.duration_since(t) >= self.resolution);
        if !due || (entry.writing && !self.resolution.is_zero()) {
            entry.dirty = true;
            return None;
        }
        entry.dirty = false;
        entry.writing = true;
        entry.last_write = Some(now);
        let at = self.next_time();
        entry.written = Some(at);
        Some(at)
    }

    /// A request for `key`, which is not resident there, whose status last
    /// processed a request from `processed`: the request time to write, or
    /// `None` while this router's last write is still unprocessed.
    pub fn cold(&self, key: &Key, processed: Option<Timestamp>, now: Instant) -> Option<Timestamp> {
        let mut entries = self.entries.lock().expect("recency lock");
        let entry = entries.entry(key.clone()).or_default();
        if entry.waits(processed, now) {
            return None;
        }
        entry.dirty = false;
        entry.writing = true;
        entry.last_write = Some(now);
        let at = self.next_time_after(processed);
        entry.written = Some(at);
        Some(at)
    }

    /// Every request this router wrote (or is writing), with its time,
    /// oldest first: what placement counts as on its way.
    pub fn written(&self) -> Vec<(Key, Timestamp)> {
        let entries = self.entries.lock().expect("recency lock");
        let mut written: Vec<(Key, Timestamp)> = entries
            .iter()
            .filter_map(|(k, e)| Some((k.clone(), e.written?)))
            .collect();
        written.sort_by_key(|(_, at)| *at);
        written
    }

    /// Whether this router wrote a request for `key` that the status (last
    /// processed at `processed`) has not seen yet.
    pub fn unprocessed(&self, key: &Key, processed: Option<Timestamp>) -> bool {
        let entries = self.entries.lock().expect("recency lock");
        entries
            .get(key)
            .is_some_and(|e| e.waits(processed, Instant::now()))
    }

    /// Whether the router's last request for `key` was processed by the
    /// status that last processed one at `processed`.
    pub fn processed(&self, key: &Key, processed: Option<Timestamp>) -> bool {
        let entries = self.entries.lock().expect("recency lock");
        entries
            .get(key)
            .and_then(|e| e.written)
            .is_some_and(|w| processed.is_some_and(|p| w <= p))
    }

    /// The turn a write of `key` takes (one write per key at a time: a
    /// load's write and a hit's could otherwise land out of order, and the
    /// older time overwrite the newer, which the router then waits on for
    /// ever as unprocessed).
    pub fn write_turn(&self, key: &Key) -> std::sync::Arc<tokio::sync::Mutex<()>> {
        let mut entries = self.entries.lock().expect("recency lock");
        entries.entry(key.clone()).or_default().turn.clone()
    }

    /// Whether a newer request time than `at` has landed for `key` (so
    /// writing `at` would move the demand back).
    pub fn superseded(&self, key: &Key, at: Timestamp) -> bool {
        let entries = self.entries.lock().expect("recency lock");
        entries
            .get(key)
            .and_then(|e| e.landed)
            .is_some_and(|l| l > at)
    }

    /// A write of `at` for `key` landed.
    pub fn landed(&self, key: &Key, at: Timestamp) {
        let mut entries = self.entries.lock().expect("recency lock");
        if let Some(e) = entries.get_mut(key) {
            e.landed = Some(e.landed.map_or(at, |l| l.max(at)));
        }
    }

    /// A write for `key` is done: the next may go.
    pub fn write_done(&self, key: &Key) {
        let mut entries = self.entries.lock().expect("recency lock");
        if let Some(e) = entries.get_mut(key) {
            e.writing = false;
        }
    }

    /// A write for `key` failed: forget it, so the next request writes again.
    pub fn write_failed(&self, key: &Key, at: Timestamp) {
        let mut entries = self.entries.lock().expect("recency lock");
        if let Some(e) = entries.get_mut(key) {
            e.writing = false;
            if e.written == Some(at) {
                e.written = None;
                e.last_write = None;
            }
        }
    }

    /// The tick: the models hit since their last write, or with requests in
    /// flight (`busy`), whose last write is a resolution old, each with the
    /// request time to write for it now.
    pub fn due(&self, now: Instant, busy: &[Key]) -> Vec<(Key, Timestamp)> {
        let quiet_for = |e: &Entry| e.last_write.map(|t| now.duration_since(t));
        let mut entries = self.entries.lock().expect("recency lock");
        for key in busy {
            entries.entry(key.clone()).or_default();
        }
        let busy: std::collections::HashSet<&Key> = busy.iter().collect();
        let mut due = Vec::new();
        for (key, e) in entries.iter_mut() {
            let old = quiet_for(e).is_none_or(|q| q >= self.resolution);
            if old && !e.writing && (e.dirty || busy.contains(key)) {
                let at = self.next_time();
                e.dirty = false;
                e.writing = true;
                e.last_write = Some(now);
                e.written = Some(at);
                due.push((key.clone(), at));
            }
        }
        // Models gone quiet for a while are forgotten, so the map stays as
        // small as the traffic (their next request writes at once).
        let forget_after = self.resolution * 4 + Duration::from_secs(60);
        entries.retain(|k, e| {
            e.dirty
                || e.writing
                || busy.contains(k)
                || quiet_for(e).is_some_and(|q| q < forget_after)
        });
        due
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn key(m: &str) -> Key {
        Arc::new(("ns".into(), "gpu".into(), m.into()))
    }

    #[test]
    fn a_request_never_processed_is_written_again_after_a_while() {
        let r = Recency::new(Duration::ZERO);
        let t0 = Instant::now();
        let first = r.cold(&key("a"), None, t0).unwrap();
        assert!(
            r.cold(&key("a"), None, t0 + Duration::from_secs(1))
                .is_none(),
            "waits for it"
        );
        // Never processed (its write lost): written again.
        let again = r.cold(&key("a"), None, t0 + LOST_AFTER).unwrap();
        assert!(again > first);
    }

    #[test]
    fn an_older_write_never_lands_after_a_newer_one() {
        let r = Recency::new(Duration::ZERO);
        let now = Instant::now();
        let older = r.hit(&key("a"), now).unwrap();
        let newer = r.cold(&key("a"), Some(older), now).unwrap();
        assert!(newer > older);
        // One turn per key: the second writer waits for the first.
        let turn = r.write_turn(&key("a"));
        let held = turn.try_lock().unwrap();
        assert!(r.write_turn(&key("a")).try_lock().is_err());
        drop(held);
        // The newer landed first: the older is superseded, not written.
        r.landed(&key("a"), newer);
        assert!(r.superseded(&key("a"), older));
        assert!(!r.superseded(&key("a"), newer));
        assert!(!r.superseded(&key("b"), older), "another key");
    }

    #[test]
    fn steady_hits_write_once_per_resolution() {
        let r = Recency::new(Duration::from_secs(5));
        let t0 = Instant::now();
        assert!(r.hit(&key("a"), t0).is_some());
        r.write_done(&key("a"));
        for ms in [1, 100, 4_000] {
            assert!(r.hit(&key("a"), t0 + Duration::from_millis(ms)).is_none());
        }
        // The tick before the resolution is up writes nothing; after it, one.
        assert!(r.due(t0 + Duration::from_secs(4), &[]).is_empty());
        assert_eq!(r.due(t0 + Duration::from_secs(5), &[]).len(), 1);
        r.write_done(&key("a"));
        assert!(
            r.due(t0 + Duration::from_secs(10), &[]).is_empty(),
            "no hits since"
        );
        assert!(r.hit(&key("a"), t0 + Duration::from_secs(11)).is_some());
    }

    #[test]
    fn one_write_per_model_at_a_time() {
        let r = Recency::new(Duration::from_secs(5));
        let t0 = Instant::now();
        let first = r.hit(&key("a"), t0).unwrap();
        // Still on its way a resolution later: nothing more is written for
        // the model, by a hit or by the tick, until it is done.
        let later = t0 + Duration::from_secs(6);
        assert!(r.hit(&key("a"), later).is_none());
        assert!(r.due(later, &[key("a")]).is_empty());
        assert!(r.hit(&key("b"), later).is_some(), "other models go on");
        r.write_done(&key("a"));
        let next = r.due(later, &[]);
        assert_eq!(next.len(), 1, "the hit while it was on its way counts");
        assert!(next[0].1 > first);
        // A failed write lets the next one go too.
        r.write_failed(&key("a"), next[0].1);
        assert!(r.hit(&key("a"), later).is_some());
    }

    #[test]
    fn zero_resolution_writes_every_hit_in_order() {
        let r = Recency::new(Duration::ZERO);
        let t0 = Instant::now();
        let a = r.hit(&key("a"), t0).unwrap();
        let b = r.hit(&key("a"), t0).unwrap();
        assert!(b > a);
    }

    #[test]
    fn a_cold_model_is_requested_once_until_that_request_is_processed() {
        let r = Recency::new(Duration::from_secs(5));
        let t0 = Instant::now();
        let at = r.cold(&key("a"), None, t0).unwrap();
        assert!(r.cold(&key("a"), None, t0).is_none());
        assert!(r.unprocessed(&key("a"), None));
        assert!(!r.processed(&key("a"), None));
        // Processed: a later request (say, after an eviction) writes again.
        assert!(r.processed(&key("a"), Some(at)));
        assert!(r.cold(&key("a"), Some(at), t0).is_some());
        // A failed write is forgotten.
        let again = r.cold(&key("b"), None, t0).unwrap();
        r.write_failed(&key("b"), again);
        assert!(r.cold(&key("b"), None, t0).is_some());
    }

    #[test]
    fn a_cold_request_is_later_than_the_last_one_processed_whatever_this_clock_says() {
        // The residency processed a request from a writer whose clock is
        // ten minutes ahead of this router's: a request at this router's
        // time would be ignored as already processed (and written again
        // on every change it caused).
        let r = Recency::new(Duration::from_secs(5));
        let t0 = Instant::now();
        let ahead = Timestamp::now() + Duration::from_secs(600);
        let at = r.cold(&key("a"), Some(ahead), t0).unwrap();
        assert!(at > ahead, "{at} after {ahead}");
        assert!(r.unprocessed(&key("a"), Some(ahead)));
        // Its own times stay increasing after that.
        assert!(r.hit(&key("b"), t0).unwrap() > at);
        // The last representable time has no later one, and no panic.
        let last = Timestamp::MAX;
        assert_eq!(r.cold(&key("c"), Some(last), t0), Some(last));
        assert_eq!(r.hit(&key("d"), t0), Some(last));
    }

    #[test]
    fn a_model_with_requests_in_flight_stays_recent() {
        let r = Recency::new(Duration::from_secs(5));
        let t0 = Instant::now();
        r.hit(&key("a"), t0);
        r.write_done(&key("a"));
        let busy = [key("a")];
        assert_eq!(r.due(t0 + Duration::from_secs(5), &busy).len(), 1);
        r.write_done(&key("a"));
        assert_eq!(r.due(t0 + Duration::from_secs(10), &busy).len(), 1);
        r.write_done(&key("a"));
        assert!(r.due(t0 + Duration::from_secs(15), &[]).is_empty());
    }
}
