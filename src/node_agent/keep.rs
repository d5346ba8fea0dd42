//! What a node keeps on its disk: the second residency tier's policy, pure
//! (artifacts in, a plan out), with the same discipline as VRAM: a budget
//! never exceeded, LRU eviction, pinning, clear refusals.
//!
//! - *Required*: the artifacts of models resident or loading on the node.
//!   Each is kept, or fetched if it is missing.
//! - *Prefetch*: artifacts of recently requested models that are not
//!   resident. Fetched only into room that evicting nothing wanted makes.
//! - Room comes from evicting artifacts nobody requires, least recently
//!   used first; a pinned model's artifact is never evicted.
//! - A required artifact that does not fit even then is refused (the
//!   `DiskFull` condition, with the sizes); nothing is ever fetched into
//!   part of its room.
//! - An artifact a pod on the node still mounts (one being deleted, still
//!   finishing its requests) is never evicted: its files may still be
//!   read, and deleting them would not free the disk while they are open.
//!   A required artifact that only its room keeps out waits for it.
//!
//! Downloads in progress, and downloads cut short that wait to resume,
//! hold their declared size, so the budget holds while they run.
//!
//! Artifacts share bytes: each is a set of blobs (content-addressed files
//! or unpacked layers, by digest), and the disk holds each blob once
//! however many artifacts name it. Used room is the size of the union of
//! the kept artifacts' blobs; evicting an artifact frees only the blobs no
//! kept artifact shares; fetching one costs only the blobs not on disk.
//! What is not known yet of an artifact (a download whose files are not
//! all known by digest) is a blob of its own, `<key>#rest`, of its declared
//! size less the blobs it is known to share.

use crate::engine::Bytes;
use crate::quantity::format_bytes;
use k8s_openapi::jiff::Timestamp;
use std::collections::{HashMap, HashSet};

/// Why the node wants an artifact.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
pub enum Want {
    /// Its model is resident or loading on this node.
    Required,
    /// Its model was requested recently and may be requested again.
    Prefetch,
}

/// A blob: its digest (or another id unique to its content) and size.
pub type Blob = (String, Bytes);

/// The blob that stands for what is not known of an artifact yet.
pub fn rest_blob(key: &str, size: Bytes) -> Blob {
    (format!("{key}#rest"), size)
}

/// An artifact the node's residencies ask for.
#[derive(Clone, Debug)]
pub struct Wanted {
    pub key: String,
    /// What it takes on disk: the blobs known by digest and its
    /// [`rest_blob`].
    pub blobs: Vec<Blob>,
    pub want: Want,
    pub pinned: bool,
    /// Its model's last request, newest first among equals.
    pub requested: Option<Timestamp>,
}

/// An artifact on disk (or being fetched: it holds its declared size).
#[derive(Clone, Debug)]
pub struct Held {
    pub key: String,
    pub blobs: Vec<Blob>,
    pub last_use: Option<Timestamp>,
    /// A pod on the node mounts it.
    pub in_use: bool,
}

/// What to do now.
#[derive(Debug, Default, PartialEq, Eq)]
pub struct Plan {
    /// Fetch these (required first, then prefetch), in this order.
    pub fetch: Vec<String>,
    /// Delete these first.
    pub evict: Vec<String>,
    /// Required artifacts that cannot fit: key and the `DiskFull` message.
    pub refused: Vec<(String, String)>,
    /// Required artifacts that fit once artifacts still mounted by pods
    /// are free to go: key and why it waits.
    pub waiting: Vec<(String, String)>,
}

/// The bytes the union of `artifacts`' blobs takes: each blob once.
pub fn unique_bytes<'b>(artifacts: impl IntoIterator<Item = &'b [Blob]>) -> Bytes {
    let mut seen: HashSet<&str> = HashSet::new();
    let mut total: Bytes = 0;
    for blobs in artifacts {
        for (id, size) in blobs {
            if seen.insert(id.as_str()) {
                total = total.saturating_add(*size);
            }
        }
    }
    total
}

/// Plans the disk within `budget` given what is `held` and what is `wanted`.
pub fn plan(budget: Bytes, held: &[Held], wanted: &[Wanted]) -> Plan {
    let mut planner = Planner::new(budget, held, wanted);
    let on_disk: HashSet<&str> = held.iter().map(|h| h.key.as_str()).collect();
    // Newest request first, within each kind.
    let mut missing: Vec<&Wanted> = wanted
        .iter()
        .filter(|w| !on_disk.contains(w.key.as_str()))
        .collect();
    missing.sort_by(|a, b| {
        (a.want, std::cmp::Reverse(a.requested), &a.key).cmp(&(
            b.want,
            std::cmp::Reverse(b.requested),
            &b.key,
        ))
    });
    for w in missing {
        planner.place(w);
    }
    planner.plan
}

/// The plan as it is made: what the disk holds after the decisions so far.
struct Planner<'a> {
    budget: Bytes,
    held: &'a [Held],
    wants: HashMap<&'a str, &'a Wanted>,
    /// Evictable now (nobody requires them, no pod mounts them), least
    /// recently used first; unwanted before prefetch-wanted at equal age.
    evictable: Vec<&'a Held>,
    /// Free to go but still mounted by a pod.
    mounted: HashSet<&'a str>,
    /// Evicted so far (the first `evicted` of `evictable`).
    gone: HashSet<&'a str>,
    evicted: usize,
    fetched: Vec<&'a Wanted>,
    plan: Plan,
}

impl<'a> Planner<'a> {
    fn new(budget: Bytes, held: &'a [Held], wanted: &'a [Wanted]) -> Self {
        let wants: HashMap<&str, &Wanted> = wanted.iter().map(|w| (w.key.as_str(), w)).collect();
        // Free to go once no pod mounts it: what no one requires and no
        // pinned model owns.
        let unrequired = |h: &&Held| {
            wants
                .get(h.key.as_str())
                .is_none_or(|w| w.want != Want::Required && !w.pinned)
        };
        let mut evictable: Vec<&Held> = held
            .iter()
            .filter(unrequired)
            .filter(|h| !h.in_use)
            .collect();
        evictable.sort_by(|a, b| {
            let wanted = |h: &Held| wants.contains_key(h.key.as_str());
            (wanted(a), a.last_use, &a.key).cmp(&(wanted(b), b.last_use, &b.key))
        });
        let mounted = held
            .iter()
            .filter(unrequired)
            .filter(|h| h.in_use)
            .map(|h| h.key.as_str())
            .collect();
        Planner {
            budget,
            held,
            wants,
            evictable,
            mounted,
            gone: HashSet::new(),
            evicted: 0,
            fetched: Vec::new(),
            plan: Plan::default(),
        }
    }

    /// The disk's use without the `gone` artifacts, with the fetched ones
    /// and `extra`: the union of their blobs.
    fn use_without(&self, gone: &HashSet<&str>, extra: &[Blob]) -> Bytes {
        unique_bytes(
            self.held
                .iter()
                .filter(|h| !gone.contains(h.key.as_str()))
                .map(|h| h.blobs.as_slice())
                .chain(self.fetched.iter().map(|w| w.blobs.as_slice()))
                .chain(std::iter::once(extra)),
        )
    }

    /// Fetches `w` if evicting least recently used artifacts makes its
    /// room (only unwanted ones for a prefetch); else says why a required
    /// one waits or is refused.
    fn place(&mut self, w: &'a Wanted) {
        let may_evict =
            |h: &Held| w.want == Want::Required || !self.wants.contains_key(h.key.as_str());
        let mut trial = self.gone.clone();
        let mut after = self.use_without(&trial, &w.blobs);
        let mut take = self.evicted;
        while after > self.budget && take < self.evictable.len() && may_evict(self.evictable[take])
        {
            trial.insert(self.evictable[take].key.as_str());
            take += 1;
            after = self.use_without(&trial, &w.blobs);
        }
        if after > self.budget {
            if w.want == Want::Required {
                self.no_room(w, trial);
            }
            return;
        }
        for h in &self.evictable[self.evicted..take] {
            self.plan.evict.push(h.key.clone());
        }
        self.gone = trial;
        self.evicted = take;
        self.fetched.push(w);
        self.plan.fetch.push(w.key.clone());
    }

    /// A required artifact without room: it waits when the artifacts still
    /// mounted would make it, else it is refused with the sizes.
    fn no_room(&mut self, w: &Wanted, mut freed: HashSet<&'a str>) {
        let needs = format_bytes(unique_bytes([w.blobs.as_slice()]));
        freed.extend(self.mounted.iter().copied());
        if self.use_without(&freed, &w.blobs) <= self.budget {
            let mut keys: Vec<&str> = self.mounted.iter().copied().collect();
            keys.sort();
            self.plan.waiting.push((
                w.key.clone(),
                format!(
                    "{} needs {needs} on disk; room comes free when no pod mounts {} any more",
                    w.key,
                    keys.join(", ")
                ),
            ));
            return;
        }
        let mut all_evictable = self.gone.clone();
        all_evictable.extend(
            self.evictable[self.evicted..]
                .iter()
                .map(|h| h.key.as_str()),
        );
        let pinned_or_required = self.use_without(&all_evictable, &[]);
        self.plan.refused.push((
            w.key.clone(),
            format!(
                "{} needs {needs} on disk; the disk budget is {} and required or pinned artifacts hold {}",
                w.key,
                format_bytes(self.budget),
                format_bytes(pinned_or_required)
            ),
        ));
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn t(s: u64) -> Option<Timestamp> {
        Some(Timestamp::from_second(1_700_000_000 + s as i64).unwrap())
    }

    fn held(key: &str, size: Bytes, used: u64) -> Held {
        Held {
            key: key.into(),
            blobs: vec![(key.into(), size)],
            last_use: t(used),
            in_use: false,
        }
    }

    fn wanted(key: &str, size: Bytes, want: Want, pinned: bool, at: u64) -> Wanted {
        Wanted {
            key: key.into(),
            blobs: vec![(key.into(), size)],
            want,
            pinned,
            requested: t(at),
        }
    }

    fn blobs(list: &[(&str, Bytes)]) -> Vec<Blob> {
        list.iter().map(|(id, n)| (id.to_string(), *n)).collect()
    }

    #[test]
    fn a_shared_blob_counts_once_and_its_artifact_costs_only_its_own() {
        // `a` (base 6 + tune 2) on disk; `b` shares the base: it costs 2.
        let mut a = held("a", 0, 1);
        a.blobs = blobs(&[("base", 6), ("tune-a", 2)]);
        let mut b = wanted("b", 0, Want::Required, false, 5);
        b.blobs = blobs(&[("base", 6), ("tune-b", 2)]);
        let p = plan(10, std::slice::from_ref(&a), std::slice::from_ref(&b));
        assert_eq!(p.fetch, ["b"]);
        assert!(p.evict.is_empty(), "10 holds 6 + 2 + 2: {p:?}");
        // With 9, `a` must go, and only its own 2 bytes are freed by it.
        let p = plan(9, std::slice::from_ref(&a), std::slice::from_ref(&b));
        assert_eq!(p.evict, ["a"]);
        assert_eq!(p.fetch, ["b"]);
        // A third artifact that is all shared costs nothing.
        let mut c = wanted("c", 0, Want::Prefetch, false, 4);
        c.blobs = blobs(&[("base", 6)]);
        let p = plan(8, &[a], &[c]);
        assert_eq!(p.fetch, ["c"]);
        assert!(p.evict.is_empty());
    }

    #[test]
    fn room_for_a_required_artifact_comes_from_the_least_recently_used() {
        let held = [held("a", 4, 1), held("b", 4, 2), held("c", 4, 3)];
        let want = [wanted("d", 6, Want::Required, false, 10)];
        let p = plan(12, &held, &want);
        assert_eq!(p.evict, ["a", "b"]);
        assert_eq!(p.fetch, ["d"]);
        assert!(p.refused.is_empty());
    }

    #[test]
    fn pinned_and_required_artifacts_stay_and_a_misfit_is_refused_whole() {
        let held = [held("p", 6, 1), held("r", 4, 2), held("old", 2, 0)];
        let want = [
            wanted("p", 6, Want::Prefetch, true, 1),
            wanted("r", 4, Want::Required, false, 2),
            wanted("big", 4, Want::Required, false, 5),
        ];
        let p = plan(12, &held, &want);
        assert!(p.fetch.is_empty() && p.evict.is_empty(), "{p:?}");
        assert_eq!(p.refused.len(), 1);
        let msg = &p.refused[0].1;
        assert!(msg.contains("needs 4") && msg.contains("hold 10"), "{msg}");
    }

    #[test]
    fn an_artifact_a_pod_mounts_stays_and_what_needs_its_room_waits() {
        let mut mounted = held("going", 4, 0);
        mounted.in_use = true;
        let held = [mounted, held("old", 4, 1)];
        // 4 free after evicting `old`: `small` fits; `big` needs the
        // mounted artifact's room too, so it waits; `huge` never fits.
        let want = [
            wanted("small", 4, Want::Required, false, 9),
            wanted("big", 4, Want::Required, false, 8),
            wanted("huge", 20, Want::Required, false, 7),
            wanted("pre", 4, Want::Prefetch, false, 6),
        ];
        let p = plan(8, &held, &want);
        assert_eq!(p.evict, ["old"], "never the mounted one");
        assert_eq!(p.fetch, ["small"]);
        assert_eq!(p.waiting.len(), 1, "{p:?}");
        assert_eq!(p.waiting[0].0, "big");
        assert!(p.waiting[0].1.contains("going"), "{}", p.waiting[0].1);
        assert_eq!(p.refused.len(), 1);
        assert_eq!(p.refused[0].0, "huge");
    }

    #[test]
    fn prefetch_uses_free_room_and_never_evicts_what_is_wanted() {
        let held = [held("unwanted", 4, 0), held("warm", 4, 1)];
        let want = [
            wanted("warm", 4, Want::Prefetch, false, 1),
            wanted("next", 4, Want::Prefetch, false, 9),
            wanted("later", 4, Want::Prefetch, false, 5),
        ];
        let p = plan(12, &held, &want);
        // 4 free: `next` (newest) fits; `later` only by evicting the
        // unwanted artifact, which prefetch may do; never `warm`.
        assert_eq!(p.fetch, ["next", "later"]);
        assert_eq!(p.evict, ["unwanted"]);
    }

    #[test]
    fn the_budget_is_never_exceeded() {
        // Every combination of held and wanted sizes over a small budget.
        for budget in 0..12u64 {
            for mask in 0..64u32 {
                let held: Vec<Held> = (0..3)
                    .filter(|i| mask & (1 << i) != 0)
                    .map(|i| held(&format!("h{i}"), 2 + i as u64, i as u64))
                    .collect();
                let used = unique_bytes(held.iter().map(|h| h.blobs.as_slice()));
                let want: Vec<Wanted> = (0..3)
                    .filter(|i| mask & (8 << i) != 0)
                    .map(|i| {
                        wanted(
                            &format!("w{i}"),
                            3 + i as u64,
                            if i == 0 {
                                Want::Prefetch
                            } else {
                                Want::Required
                            },
                            false,
                            10 + i as u64,
                        )
                    })
                    .collect();
                let p = plan(budget, &held, &want);
                let fetched = p.fetch.len();
                let after = unique_bytes(
                    held.iter()
                        .filter(|h| !p.evict.contains(&h.key))
                        .map(|h| h.blobs.as_slice())
                        .chain(
                            want.iter()
                                .filter(|w| p.fetch.contains(&w.key))
                                .map(|w| w.blobs.as_slice()),
                        ),
                );
                assert!(
                    fetched == 0 || after <= budget,
                    "budget {budget} mask {mask} (used {used}): {p:?}"
                );
            }
        }
    }

    mod props {
        use super::super::*;
        use proptest::prelude::*;

        fn held_strategy() -> impl Strategy<Value = Vec<(u64, u64, bool, u8)>> {
            // (own size, last use, mounted by a pod, which shared blobs)
            proptest::collection::vec(
                (0u64..=8, 0u64..20, proptest::bool::weighted(0.3), 0u8..16),
                0..6,
            )
        }

        fn wanted_strategy() -> impl Strategy<Value = Vec<(u64, bool, bool, u64, Option<usize>, u8)>>
        {
            // (own size, required, pinned, requested at, the held artifact
            // it is, which shared blobs)
            proptest::collection::vec(
                (
                    0u64..=10,
                    proptest::bool::ANY,
                    proptest::bool::weighted(0.2),
                    0u64..20,
                    proptest::option::weighted(0.4, 0usize..6),
                    0u8..16,
                ),
                0..6,
            )
        }

        /// An artifact's blobs: its own, and those of the four shared ones
        /// (a tokenizer, a base, ...) that `mask` names.
        fn blobs_of(key: &str, own: u64, mask: u8) -> Vec<Blob> {
            let mut blobs: Vec<Blob> = (0..4)
                .filter(|i| mask & (1 << i) != 0)
                .map(|i| (format!("shared{i}"), 1 + 2 * i as u64))
                .collect();
            if own > 0 || blobs.is_empty() {
                blobs.push(rest_blob(key, own));
            }
            blobs
        }

        proptest! {
            /// On random disks whose artifacts share blobs: the unique
            /// bytes kept stay within the budget whenever anything is
            /// fetched; nothing mounted, required or pinned is evicted;
            /// every missing required artifact is fetched, waits or is
            /// refused, and waits only where mounted artifacts hold room it
            /// needs; prefetch is never refused.
            #[test]
            fn the_disk_plan_keeps_its_rules(budget in 0u64..30, held in held_strategy(), wanted in wanted_strategy()) {
                let t = |s: u64| Some(Timestamp::from_second(1_700_000_000 + s as i64).unwrap());
                let held: Vec<Held> = held
                    .iter()
                    .enumerate()
                    .map(|(i, &(own, used, in_use, mask))| {
                        let key = format!("h{i}");
                        Held { blobs: blobs_of(&key, own, mask), key, last_use: t(used), in_use }
                    })
                    .collect();
                let mut seen = HashSet::new();
                let wanted: Vec<Wanted> = wanted
                    .iter()
                    .enumerate()
                    .map(|(i, &(own, required, pinned, at, same, mask))| {
                        let key = match same {
                            Some(h) if h < held.len() => held[h].key.clone(),
                            _ => format!("w{i}"),
                        };
                        let blobs = held.iter().find(|h| h.key == key).map_or_else(|| blobs_of(&key, own, mask), |h| h.blobs.clone());
                        Wanted { key, blobs, want: if required { Want::Required } else { Want::Prefetch }, pinned, requested: t(at) }
                    })
                    .filter(|w| seen.insert(w.key.clone()))
                    .collect();
                let p = plan(budget, &held, &wanted);
                let kept: Vec<&[Blob]> = held
                    .iter()
                    .filter(|h| !p.evict.contains(&h.key))
                    .map(|h| h.blobs.as_slice())
                    .chain(wanted.iter().filter(|w| p.fetch.contains(&w.key)).map(|w| w.blobs.as_slice()))
                    .collect();
                prop_assert!(p.fetch.is_empty() || unique_bytes(kept.iter().copied()) <= budget, "{p:?}");
                // Every blob of a mounted artifact is still kept.
                let kept_ids: HashSet<&str> = kept.iter().flat_map(|b| b.iter().map(|(id, _)| id.as_str())).collect();
                for h in held.iter().filter(|h| h.in_use) {
                    prop_assert!(h.blobs.iter().all(|(id, _)| kept_ids.contains(id.as_str())), "{p:?}");
                }
                let want_of = |k: &str| wanted.iter().find(|w| w.key == k);
                for k in &p.evict {
                    let h = held.iter().find(|h| &h.key == k).unwrap();
                    prop_assert!(!h.in_use, "evicted a mounted artifact: {p:?}");
                    prop_assert!(want_of(k).is_none_or(|w| w.want != Want::Required && !w.pinned), "{p:?}");
                }
                let mounted_free = held.iter().any(|h| h.in_use && want_of(&h.key).is_none_or(|w| w.want != Want::Required && !w.pinned));
                for w in &wanted {
                    let on_disk = held.iter().any(|h| h.key == w.key);
                    let places = [
                        p.fetch.contains(&w.key),
                        p.refused.iter().any(|(k, _)| k == &w.key),
                        p.waiting.iter().any(|(k, _)| k == &w.key),
                    ];
                    let n = places.iter().filter(|x| **x).count();
                    if on_disk {
                        prop_assert_eq!(n, 0, "{:?} is on disk: {:?}", w.key, p);
                    } else if w.want == Want::Required {
                        prop_assert_eq!(n, 1, "{:?}: {:?}", w.key, p);
                        prop_assert!(!places[2] || mounted_free, "waits with nothing mounted: {p:?}");
                    } else {
                        prop_assert!(!places[1] && !places[2], "prefetch refused or waiting: {p:?}");
                    }
                }
            }
        }
    }
}
