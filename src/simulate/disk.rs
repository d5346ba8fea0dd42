//! The node's disk tier in a replay: which models' artifacts are on the
//! node's disk, and what fetching one that is not costs.
//!
//! A load needs its model's artifact on disk: one that is not there is
//! fetched from its registry first, which adds `fetch_seconds_per_gib`
//! times its size (GiB) to the load's wait, and it then stays on disk. The
//! artifacts of resident models (awake or asleep) are in use and stay; the
//! disk makes room by dropping others. Which ones: the least recently used
//! (as the node agent's cache does) under `lru` and `cost` eviction; under
//! `rate`, the ones whose models have the lowest rate (the same measure
//! the engine keeps them in VRAM and host memory by: every artifact costs
//! the same per GiB to fetch again, so rate alone orders them), least
//! recently used first among equals. An artifact that cannot get room is
//! fetched for its load and not kept.
//!
//! The fetch rate's default, 1.5 s/GiB, is the node agent's own figure
//! (`cargo bench --bench artifacts`: 512 MiB in 0.77 s from a registry on
//! loopback, digest checked and fsynced); a registry across a network is
//! slower, so the flag is there to say how much.

use crate::engine::{Bytes, Engine, Eviction, ModelId};
use std::collections::HashMap;

/// The default fetch seconds per GiB (module docs).
pub const FETCH_SECONDS_PER_GIB: f64 = 1.5;

/// How the disk tier is set up in a replay.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct DiskOptions {
    /// The disk space artifacts may take.
    pub budget: Bytes,
    pub fetch_seconds_per_gib: f64,
}

/// The artifacts on disk and what fetching cost so far.
#[derive(Debug)]
pub(super) struct Disk {
    options: DiskOptions,
    /// Artifacts on disk: their size and the replay step of their last use.
    on_disk: HashMap<ModelId, (Bytes, u64)>,
    used: Bytes,
    step: u64,
    pub fetches: u64,
    pub fetch_seconds: f64,
}

impl Disk {
    pub fn new(options: DiskOptions) -> Self {
        Disk {
            options,
            on_disk: HashMap::new(),
            used: 0,
            step: 0,
            fetches: 0,
            fetch_seconds: 0.0,
        }
    }

    /// A request for `id` was served; `loaded` when it was a load. Returns
    /// the seconds a fetch added to its wait.
    pub fn served(&mut self, engine: &Engine, id: ModelId, loaded: bool) -> f64 {
        self.step += 1;
        if let Some(entry) = self.on_disk.get_mut(&id) {
            entry.1 = self.step;
            return 0.0;
        }
        if !loaded {
            // Resident before the disk tier saw it (restored, or loaded
            // before the replay): its artifact is taken as on disk.
            self.keep(engine, id);
            return 0.0;
        }
        const GIB: f64 = (1u64 << 30) as f64;
        let seconds = engine.size(id) as f64 / GIB * self.options.fetch_seconds_per_gib;
        self.fetches += 1;
        self.fetch_seconds += seconds;
        self.keep(engine, id);
        seconds
    }

    /// Places `id`'s artifact on disk if room can be made for it.
    fn keep(&mut self, engine: &Engine, id: ModelId) {
        let size = engine.size(id);
        while self.used + size > self.options.budget {
            let victim = self
                .on_disk
                .iter()
                .filter(|&(&m, _)| m != id && !engine.is_resident(m))
                .min_by(|a, b| {
                    let by_rate = match engine.eviction() {
                        Eviction::Rate => engine.rate(*a.0).total_cmp(&engine.rate(*b.0)),
                        Eviction::Lru | Eviction::Cost => std::cmp::Ordering::Equal,
                    };
                    by_rate.then(a.1.1.cmp(&b.1.1))
                })
                .map(|(&m, _)| m);
            let Some(victim) = victim else {
                return; // in use: fetched for this load, not kept
            };
            let (freed, _) = self.on_disk.remove(&victim).expect("chosen from the map");
            self.used -= freed;
        }
        self.on_disk.insert(id, (size, self.step));
        self.used += size;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const GI: Bytes = 1 << 30;

    fn setup(eviction: Eviction) -> (Engine, Vec<ModelId>, Disk) {
        let mut e = Engine::new(10 * GI);
        e.set_eviction(eviction);
        let ids = ["a", "b", "c"]
            .iter()
            .map(|n| e.register(n, 8 * GI, false).unwrap())
            .collect();
        let disk = Disk::new(DiskOptions {
            budget: 16 * GI,
            fetch_seconds_per_gib: 2.0,
        });
        (e, ids, disk)
    }

    /// Requests `id`, as the replay does, returning the fetch's seconds.
    fn request(e: &mut Engine, disk: &mut Disk, id: ModelId) -> f64 {
        let loaded = !e.is_resident(id);
        e.request(id);
        disk.served(e, id, loaded)
    }

    #[test]
    fn a_load_fetches_only_what_is_not_on_disk() {
        let (mut e, m, mut disk) = setup(Eviction::Lru);
        assert_eq!(request(&mut e, &mut disk, m[0]), 16.0, "8 GiB at 2 s/GiB");
        assert_eq!(request(&mut e, &mut disk, m[0]), 0.0, "a hit");
        assert_eq!(request(&mut e, &mut disk, m[1]), 16.0);
        // a was evicted from VRAM; its artifact is still on disk.
        assert_eq!(request(&mut e, &mut disk, m[0]), 0.0);
        assert_eq!((disk.fetches, disk.fetch_seconds), (2, 32.0));
    }

    #[test]
    fn the_disk_drops_what_is_not_resident_by_the_policy() {
        // VRAM holds one model, the disk two artifacts. a has the higher
        // rate, b was used more recently; c's load evicts b from VRAM and
        // needs one artifact's room on disk.
        let dropped = |eviction| {
            let (mut e, m, mut disk) = setup(eviction);
            e.resume_served(100);
            e.resume_rate(m[0], 10.0, 100);
            e.resume_rate(m[1], 1.0, 100);
            for &id in &m {
                assert_eq!(request(&mut e, &mut disk, id), 16.0, "each fetched once");
            }
            assert!(disk.on_disk.contains_key(&m[2]));
            assert_eq!(disk.on_disk.len(), 2, "16 GiB of disk");
            if disk.on_disk.contains_key(&m[0]) {
                "b"
            } else {
                "a"
            }
        };
        assert_eq!(dropped(Eviction::Lru), "a", "the least recently used");
        assert_eq!(dropped(Eviction::Cost), "a");
        assert_eq!(dropped(Eviction::Rate), "b", "the lower rate");
    }

    #[test]
    fn an_artifact_without_room_is_fetched_and_not_kept() {
        let (mut e, m, _) = setup(Eviction::Lru);
        let mut disk = Disk::new(DiskOptions {
            budget: 4 * GI,
            fetch_seconds_per_gib: 1.0,
        });
        assert_eq!(request(&mut e, &mut disk, m[0]), 8.0);
        assert!(disk.on_disk.is_empty());
        e.unload(m[0]);
        assert_eq!(request(&mut e, &mut disk, m[0]), 8.0, "fetched again");
    }
}
