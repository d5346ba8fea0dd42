//! The seed's LRU one level down: the LoRA adapters one model server holds
//! in its adapter slots. A slot is a count, not bytes (a server is started
//! with so many adapter slots, each as large as its largest rank), so the
//! policy is the seed's with every size one:
//!
//! 1. the adapter is loaded: a **hit**, it becomes the most recently used;
//! 2. a free slot: **load** it;
//! 3. else the least recently used adapter that is neither pinned nor
//!    serving a request is the **victim**, unloaded first;
//! 4. no such adapter: **full** (every slot pinned or busy); the caller
//!    says so and nothing is unloaded.
//!
//! Invariant: never more adapters than slots, and a pinned adapter once
//! loaded is never a victim. Pure: the router's I/O
//! ([`crate::router::adapters`]) calls the server and reports back.

/// What a request for an adapter needs done first.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum AdapterPlan {
    /// Loaded: nothing to do.
    Hit,
    /// Load it, unloading `evict` first when named.
    Load { evict: Option<String> },
    /// Every slot holds a pinned adapter or one serving requests.
    Full,
}

#[derive(Clone, Debug)]
struct Held {
    name: String,
    pinned: bool,
    last_used: u64,
    /// Requests being served by it now.
    in_use: u32,
}

/// The adapters one server holds.
#[derive(Clone, Debug)]
pub struct AdapterSlots {
    slots: usize,
    held: Vec<Held>,
    clock: u64,
}

impl AdapterSlots {
    pub fn new(slots: u32) -> Self {
        AdapterSlots {
            slots: slots.max(1) as usize,
            held: Vec::new(),
            clock: 0,
        }
    }

    /// How many slots (changed with the spec; held adapters beyond it go as
    /// they are needed).
    pub fn resize(&mut self, slots: u32) {
        self.slots = slots.max(1) as usize;
    }

    fn find(&self, name: &str) -> Option<usize> {
        self.held.iter().position(|h| h.name == name)
    }

    pub fn holds(&self, name: &str) -> bool {
        self.find(name).is_some()
    }

    /// The adapters held, least recently used first (what the tests
    /// compare with their own order).
    #[cfg(test)]
    pub fn held(&self) -> Vec<&str> {
        let mut held: Vec<&Held> = self.held.iter().collect();
        held.sort_by_key(|h| h.last_used);
        held.into_iter().map(|h| h.name.as_str()).collect()
    }

    /// What a request for `name` needs.
    pub fn plan(&self, name: &str) -> AdapterPlan {
        if self.holds(name) {
            return AdapterPlan::Hit;
        }
        if self.held.len() < self.slots {
            return AdapterPlan::Load { evict: None };
        }
        self.held
            .iter()
            .filter(|h| !h.pinned && h.in_use == 0)
            .min_by_key(|h| h.last_used)
            .map_or(AdapterPlan::Full, |h| AdapterPlan::Load {
                evict: Some(h.name.clone()),
            })
    }

    /// A request starts using `name` (held): it is the most recently used
    /// and no victim until [`AdapterSlots::release`].
    pub fn begin(&mut self, name: &str) -> bool {
        self.clock += 1;
        let now = self.clock;
        match self.held.iter_mut().find(|h| h.name == name) {
            Some(h) => {
                h.last_used = now;
                h.in_use += 1;
                true
            }
            None => false,
        }
    }

    /// A request that used `name` ended.
    pub fn release(&mut self, name: &str) {
        if let Some(h) = self.held.iter_mut().find(|h| h.name == name) {
            h.in_use = h.in_use.saturating_sub(1);
        }
    }

    /// The server loaded `name` (or said it already had it).
    pub fn loaded(&mut self, name: &str, pinned: bool) {
        self.clock += 1;
        match self.find(name) {
            Some(i) => {
                self.held[i].last_used = self.clock;
                self.held[i].pinned = pinned;
            }
            None => self.held.push(Held {
                name: name.to_owned(),
                pinned,
                last_used: self.clock,
                in_use: 0,
            }),
        }
    }

    /// The server no longer holds `name`.
    pub fn unloaded(&mut self, name: &str) {
        self.held.retain(|h| h.name != name);
    }

    /// The server holds none (it restarted, or said it lacks one it should
    /// hold): what it holds is learned again request by request. Requests
    /// in flight keep their counts of nothing.
    pub fn forget(&mut self) {
        self.held.clear();
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn load(s: &mut AdapterSlots, name: &str, pinned: bool) -> AdapterPlan {
        let plan = s.plan(name);
        if let AdapterPlan::Load { evict } = &plan {
            if let Some(v) = evict {
                s.unloaded(v);
            }
            s.loaded(name, pinned);
        }
        if plan != AdapterPlan::Full {
            s.begin(name);
            s.release(name);
        }
        plan
    }

    #[test]
    fn the_least_recently_used_unpinned_adapter_makes_room() {
        let mut s = AdapterSlots::new(2);
        assert_eq!(load(&mut s, "a", false), AdapterPlan::Load { evict: None });
        assert_eq!(load(&mut s, "b", false), AdapterPlan::Load { evict: None });
        assert_eq!(load(&mut s, "a", false), AdapterPlan::Hit);
        assert_eq!(
            load(&mut s, "c", false),
            AdapterPlan::Load {
                evict: Some("b".into())
            }
        );
        assert_eq!(s.held(), ["a", "c"]);
    }

    #[test]
    fn pinned_and_busy_adapters_are_never_victims() {
        let mut s = AdapterSlots::new(2);
        load(&mut s, "p", true);
        load(&mut s, "a", false);
        assert!(s.begin("a"));
        assert_eq!(s.plan("b"), AdapterPlan::Full);
        s.release("a");
        assert_eq!(
            s.plan("b"),
            AdapterPlan::Load {
                evict: Some("a".into())
            }
        );
    }

    #[test]
    fn a_forgotten_server_loads_again() {
        let mut s = AdapterSlots::new(2);
        load(&mut s, "a", false);
        s.forget();
        assert_eq!(s.plan("a"), AdapterPlan::Load { evict: None });
    }

    proptest! {
        /// Random requests over six adapters (two pinned) on three slots:
        /// never more held than slots, a pinned adapter once loaded stays,
        /// and the victim is always the least recently used unpinned one.
        #[test]
        fn slots_hold_and_pins_stay(requests in proptest::collection::vec(0usize..6, 1..200)) {
            let names = ["p0", "p1", "a", "b", "c", "d"];
            let mut s = AdapterSlots::new(3);
            let mut order: Vec<&str> = Vec::new();
            for i in requests {
                let name = names[i];
                let pinned = name.starts_with('p');
                let plan = load(&mut s, name, pinned);
                if let AdapterPlan::Load { evict: Some(v) } = &plan {
                    let expected = order.iter().find(|n| !n.starts_with('p')).copied();
                    prop_assert_eq!(Some(v.as_str()), expected);
                    order.retain(|n| n != v);
                }
                prop_assert!(plan != AdapterPlan::Full);
                order.retain(|n| *n != name);
                order.push(name);
                prop_assert!(s.held().len() <= 3);
                prop_assert_eq!(s.held(), order.clone());
            }
        }
    }
}
