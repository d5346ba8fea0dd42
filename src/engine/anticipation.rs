//! Work ahead of demand (#69): a model loaded or woken because a forecast
//! expects a request within its load time, and the rule that says when
//! that is worth what it moves out. Pure, as the rest of the engine.
//!
//! A model brought in ahead of demand is admitted as a request would be
//! (the same room made by the same policy, the same budget, queued behind
//! loads rather than evicting one), but it is not a use: no hit or load is
//! counted as a request's, and the `rate` estimate is left as the requests
//! made it, so a forecast that is wrong never teaches the policy that the
//! model is wanted. It becomes the most recently used, so the next
//! request for another model does not evict it before its own comes.

use super::*;

/// What one GPU's models are expected to do, as [`plan`] reads it.
pub trait Outlook {
    /// The chance that `id` is requested within `seconds` from now.
    fn chance_within(&self, id: ModelId, seconds: f64) -> f64;
}

/// How anticipation is held in.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Limits {
    /// Loads or wakes ahead of demand in flight on one GPU at once.
    pub in_flight: usize,
    /// The least chance of a request within the horizon that is acted on.
    pub min_chance: f64,
    /// The horizon, in seconds: how long a model brought in ahead is
    /// expected to wait for its request (used by none, it is the first
    /// victim of a request that needs room). At least the model's load
    /// time plus `ahead`.
    pub hold: f64,
    /// The expected wait a move saves must beat the expected wait it
    /// causes (what it evicts or puts to sleep) this many times.
    pub margin: f64,
    /// Seconds beyond a model's own load time a forecast looks ahead (the
    /// interval between two looks: a model needed before the next look
    /// must be started at this one).
    pub ahead: f64,
}

impl Default for Limits {
    fn default() -> Self {
        Limits {
            in_flight: 2,
            min_chance: 0.5,
            hold: 600.0,
            margin: 2.0,
            ahead: 60.0,
        }
    }
}

/// One move ahead of demand.
#[derive(Clone, Debug, PartialEq)]
pub struct Move {
    pub id: ModelId,
    /// Whether it wakes a sleeping model (else loads it).
    pub wake: bool,
    /// What it evicts or puts to sleep, by the engine's policy.
    pub victims: Vec<ModelId>,
    /// The chance of a request within its load (or wake) time.
    pub chance: f64,
}

impl super::Engine {
    /// Loads or wakes `id` ahead of demand: room made as a request's is,
    /// nothing counted as a use. `Hit` when it is resident and awake
    /// already (nothing changes).
    pub fn anticipate(&mut self, id: ModelId) -> Admission<'_> {
        self.evicted.clear();
        self.slept.clear();
        let slot = &self.slots.0[id.index()];
        let (size, resident, asleep) = (slot.size, slot.resident, slot.asleep);
        if resident && !asleep {
            return Admission::Hit;
        }
        if let Err(reason) = self.check_fit(id, size) {
            return Admission::Refused(reason);
        }
        let need = size - if asleep { slot.footprint() } else { 0 };
        if self.must_queue(id, need) {
            return Admission::Queued {
                loading: self.loading_used,
            };
        }
        self.clock += 1;
        self.counters.anticipated += 1;
        self.make_room(need, Some(id));
        if asleep {
            self.wake(id);
            self.counters.wakes += 1;
            let (list, slots) = self.list_of(id);
            list.touch(slots, id.0);
            return Admission::Woken {
                evicted: &self.evicted,
            };
        }
        self.make_resident(id);
        self.counters.loads += 1;
        let slot = &mut self.slots.0[id.index()];
        slot.uses = 0;
        slot.base = self.inflation;
        Admission::Loaded {
            evicted: &self.evicted,
        }
    }
}

impl super::Engine {
    /// What became of a model brought in ahead of demand: a request used
    /// it (`used`), or it left the GPU or fell asleep unused.
    pub fn count_anticipation(&mut self, used: bool) {
        if used {
            self.counters.anticipated_used += 1;
        } else {
            self.counters.anticipated_wasted += 1;
        }
    }
}

/// The moves worth making on `engine` now, best first, within `limits`
/// (`in_flight`: those already under way on this GPU). A model not
/// resident awake is brought in:
///
/// when its chance of a request within the horizon (`limits.hold`, or its
/// load or wake time plus `limits.ahead` when longer) is at least
/// `limits.min_chance`, and, where it must make room, when the wait that
/// saves (that chance times its load or wake time) beats `limits.margin`
/// times the wait its victims expect to cost (each one's chance within the
/// same horizon times its own load, or wake when it only goes to sleep),
/// and each victim is `limits.margin` times less likely to be asked for
/// (one nearly as likely would come back and send the model out unused).
/// Nor is it brought in when a request for a model nearly as likely would
/// send it out again unused, by the engine's own choice of victims.
/// Into free room it costs GPU time and nothing a request will miss.
///
/// Pinned and loading models are never victims (the engine's rule); one
/// move's room is taken from the next's.
pub fn plan(
    engine: &Engine,
    outlook: &impl Outlook,
    limits: &Limits,
    in_flight: usize,
) -> Vec<Move> {
    let mut candidates: Vec<(f64, Move)> = engine
        .models()
        .filter_map(|id| {
            if engine.is_resident(id) && !engine.is_asleep(id) {
                return None;
            }
            let wake = engine.is_asleep(id);
            let costs = engine.costs(id);
            let time = if wake { costs.wake } else { costs.load };
            let chance = outlook.chance_within(id, limits.hold.max(time + limits.ahead));
            (chance >= limits.min_chance).then(|| {
                let m = Move {
                    id,
                    wake,
                    victims: Vec::new(),
                    chance,
                };
                (chance * time, m)
            })
        })
        .collect();
    candidates.sort_by(|a, b| b.0.total_cmp(&a.0).then(a.1.id.0.cmp(&b.1.id.0)));
    // The engine as the moves made so far leave it.
    let mut planned = engine.clone();
    let mut moves = Vec::new();
    for (saves, mut m) in candidates {
        if in_flight + moves.len() >= limits.in_flight {
            break;
        }
        let mut trial = planned.clone();
        let victims: Vec<ModelId> = match trial.anticipate(m.id) {
            Admission::Loaded { evicted } | Admission::Woken { evicted } => evicted.to_vec(),
            _ => continue,
        };
        let slept = trial.last_slept().to_vec();
        if !(victims.is_empty() && slept.is_empty()) {
            let horizon = {
                let c = engine.costs(m.id);
                limits
                    .hold
                    .max((if m.wake { c.wake } else { c.load }) + limits.ahead)
            };
            // Never what is nearly as likely to be asked for (`margin`
            // times less likely, at most): it would come back and send
            // this model out unused.
            let likelier = victims
                .iter()
                .chain(&slept)
                .any(|v| limits.margin * outlook.chance_within(*v, horizon) >= m.chance);
            if likelier {
                continue;
            }
            let cost = |v: &ModelId, back: f64| outlook.chance_within(*v, horizon) * back;
            let costs: f64 = victims
                .iter()
                .map(|v| cost(v, engine.costs(*v).load))
                .chain(slept.iter().map(|v| cost(v, engine.costs(*v).wake)))
                .sum();
            if saves <= limits.margin * costs {
                continue;
            }
        }
        // Worth nothing if a request likely as soon would send it out
        // unused: as the engine's own policy would choose (its rate is
        // what requests made it).
        let horizon = {
            let c = engine.costs(m.id);
            limits
                .hold
                .max((if m.wake { c.wake } else { c.load }) + limits.ahead)
        };
        let pushed_out = trial.models().any(|w| {
            if w == m.id
                || (trial.is_resident(w) && !trial.is_asleep(w))
                || limits.margin * outlook.chance_within(w, horizon) < m.chance
            {
                return false;
            }
            let mut next = trial.clone();
            match next.request(w) {
                Admission::Loaded { evicted } | Admission::Woken { evicted }
                    if evicted.contains(&m.id) =>
                {
                    true
                }
                Admission::Loaded { .. } | Admission::Woken { .. } => {
                    next.last_slept().contains(&m.id)
                }
                _ => false,
            }
        });
        if pushed_out {
            continue;
        }
        trial.set_loading(m.id, true);
        planned = trial;
        m.victims = victims.into_iter().chain(slept).collect();
        moves.push(m);
    }
    moves
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::HashMap;

    const GIB: Bytes = 1 << 30;

    struct Chances(HashMap<ModelId, f64>);

    impl Outlook for Chances {
        fn chance_within(&self, id: ModelId, _seconds: f64) -> f64 {
            self.0.get(&id).copied().unwrap_or(0.0)
        }
    }

    fn engine() -> (Engine, Vec<ModelId>) {
        let mut e = Engine::new(40 * GIB);
        let ids = ["a", "b", "c", "d"]
            .iter()
            .map(|n| e.register(n, 20 * GIB, false).unwrap())
            .collect();
        (e, ids)
    }

    #[test]
    fn a_load_ahead_is_no_use_and_leaves_the_rate_as_requests_made_it() {
        let (mut e, ids) = engine();
        e.set_eviction(Eviction::Rate);
        e.request(ids[0]);
        let before = (e.counters().hits, e.rate(ids[1]), e.served());
        assert!(matches!(e.anticipate(ids[1]), Admission::Loaded { .. }));
        assert!(e.is_resident(ids[1]));
        assert_eq!((e.counters().hits, e.rate(ids[1]), e.served()), before);
        // Resident already: nothing changes.
        assert!(matches!(e.anticipate(ids[1]), Admission::Hit));
    }

    #[test]
    fn free_room_is_filled_with_what_is_expected_and_nothing_else() {
        let (e, ids) = engine();
        let outlook = Chances([(ids[2], 0.9), (ids[3], 0.2)].into());
        let moves = plan(&e, &outlook, &Limits::default(), 0);
        assert_eq!(moves.len(), 1);
        assert_eq!(moves[0].id, ids[2]);
        assert!(moves[0].victims.is_empty());
    }

    #[test]
    fn a_victim_expected_as_soon_is_kept_and_a_pinned_or_loading_one_never_goes() {
        let (mut e, ids) = engine();
        e.request(ids[0]);
        e.request(ids[1]);
        // Full: c is as likely as what it would evict.
        let outlook = Chances([(ids[0], 0.8), (ids[1], 0.8), (ids[2], 0.9)].into());
        assert!(plan(&e, &outlook, &Limits::default(), 0).is_empty());
        // Both residents pinned or loading: no room can be made.
        e.set_pinned(ids[0], true);
        e.set_loading(ids[1], true);
        let outlook = Chances([(ids[2], 1.0)].into());
        assert!(plan(&e, &outlook, &Limits::default(), 0).is_empty());
    }

    #[test]
    fn a_victim_not_expected_makes_room_and_the_cap_holds() {
        let (mut e, ids) = engine();
        e.request(ids[0]);
        e.request(ids[1]);
        let outlook = Chances([(ids[2], 0.9), (ids[3], 0.9)].into());
        let moves = plan(&e, &outlook, &Limits::default(), 0);
        assert_eq!(moves.len(), 2);
        assert_eq!(moves[0].victims.len(), 1);
        // One already in flight and a cap of two: one more.
        assert_eq!(plan(&e, &outlook, &Limits::default(), 1).len(), 1);
        assert!(plan(&e, &outlook, &Limits::default(), 2).is_empty());
    }

    proptest::proptest! {
        /// Whatever the registry, the requests, the pins, the loads under
        /// way and the forecasts: the moves never take a GPU over its
        /// budget, never evict or put to sleep a pinned or loading model,
        /// and the same state plans the same moves.
        #[test]
        fn moves_ahead_stay_in_budget_and_spare_pinned_and_loading_models(
            sizes in proptest::collection::vec(1u64..24, 2..8),
            pinned in proptest::collection::vec(proptest::bool::ANY, 8),
            requests in proptest::collection::vec(0usize..8, 0..30),
            loading in proptest::collection::vec(proptest::bool::ANY, 8),
            chances in proptest::collection::vec(0.0f64..1.0, 8),
            sleeps in proptest::bool::ANY,
        ) {
            let mut e = Engine::new(40 * GIB);
            e.set_eviction(Eviction::Rate);
            if sleeps {
                e.set_host_budget(64 * GIB);
            }
            let ids: Vec<ModelId> = sizes
                .iter()
                .enumerate()
                .map(|(i, s)| e.register(&format!("m{i}"), s * GIB, false).unwrap())
                .collect();
            for (i, id) in ids.iter().enumerate() {
                if sleeps {
                    let sleep = Sleep { sleeping_size: GIB / 2, host_memory: sizes[i] * GIB };
                    let _ = e.set_sleep(*id, Some(sleep));
                }
            }
            for r in &requests {
                if let Some(id) = ids.get(*r) {
                    let _ = e.request(*id);
                }
            }
            for (i, id) in ids.iter().enumerate() {
                if pinned[i] && e.is_resident(*id) && e.pinned_used() + sizes[i] * GIB <= 40 * GIB {
                    e.set_pinned(*id, true);
                }
                if loading[i] {
                    e.set_loading(*id, true);
                }
            }
            let outlook = Chances(ids.iter().zip(&chances).map(|(id, c)| (*id, *c)).collect());
            let moves = plan(&e, &outlook, &Limits::default(), 0);
            proptest::prop_assert_eq!(&moves, &plan(&e, &outlook, &Limits::default(), 0));
            proptest::prop_assert!(moves.len() <= Limits::default().in_flight);
            let spared: Vec<ModelId> = ids
                .iter()
                .copied()
                .filter(|id| e.is_pinned(*id) || e.is_loading(*id))
                .collect();
            for m in &moves {
                proptest::prop_assert!(m.chance >= Limits::default().min_chance);
                for v in &m.victims {
                    proptest::prop_assert!(!spared.contains(v), "{v:?} spared: {spared:?}");
                }
                let _ = e.anticipate(m.id);
                e.set_loading(m.id, true);
                proptest::prop_assert!(e.used() <= e.budget());
                proptest::prop_assert!(e.host_used() <= e.host_budget());
            }
        }
    }
}
