//! An intrusive doubly-linked recency list over the engine's model slots.
//!
//! The engine keeps resident models in two of these (evictable and pinned),
//! least recently used at the head. Links live in the slots themselves, so
//! moving a model to the most-recently-used end, unlinking a victim and
//! peeking at the least-recently-used one are all O(1) and allocation-free.

/// The "no slot" index in a link.
pub(crate) const NIL: u32 = u32::MAX;

/// The two links every slot carries.
#[derive(Clone, Copy, Debug)]
pub(crate) struct Links {
    pub(crate) prev: u32,
    pub(crate) next: u32,
}

impl Default for Links {
    fn default() -> Self {
        Links {
            prev: NIL,
            next: NIL,
        }
    }
}

/// Something that owns [`Links`] for each slot index.
pub(crate) trait Linked {
    fn links(&mut self, slot: u32) -> &mut Links;
    fn links_of(&self, slot: u32) -> Links;
}

/// Head = least recently used, tail = most recently used.
#[derive(Clone, Copy, Debug)]
pub(crate) struct RecencyList {
    head: u32,
    tail: u32,
}

impl Default for RecencyList {
    fn default() -> Self {
        RecencyList {
            head: NIL,
            tail: NIL,
        }
    }
}

impl RecencyList {
    /// The least recently used slot, if any.
    pub(crate) fn lru(&self) -> Option<u32> {
        (self.head != NIL).then_some(self.head)
    }

    /// Appends `slot` as the most recently used. `slot` must not be linked.
    pub(crate) fn push_mru(&mut self, slots: &mut impl Linked, slot: u32) {
        *slots.links(slot) = Links {
            prev: self.tail,
            next: NIL,
        };
        if self.tail == NIL {
            self.head = slot;
        } else {
            slots.links(self.tail).next = slot;
        }
        self.tail = slot;
    }

    /// Inserts `slot` just before `before` (or at the MRU end for `NIL`).
    pub(crate) fn insert_before(&mut self, slots: &mut impl Linked, slot: u32, before: u32) {
        if before == NIL {
            return self.push_mru(slots, slot);
        }
        let prev = slots.links_of(before).prev;
        *slots.links(slot) = Links { prev, next: before };
        slots.links(before).prev = slot;
        if prev == NIL {
            self.head = slot;
        } else {
            slots.links(prev).next = slot;
        }
    }

    /// Removes `slot`, which must be linked into this list.
    pub(crate) fn unlink(&mut self, slots: &mut impl Linked, slot: u32) {
        let Links { prev, next } = slots.links_of(slot);
        if prev == NIL {
            self.head = next;
        } else {
            slots.links(prev).next = next;
        }
        if next == NIL {
            self.tail = prev;
        } else {
            slots.links(next).prev = prev;
        }
        *slots.links(slot) = Links::default();
    }

    /// Moves a linked `slot` to the most-recently-used end.
    pub(crate) fn touch(&mut self, slots: &mut impl Linked, slot: u32) {
        if self.tail != slot {
            self.unlink(slots, slot);
            self.push_mru(slots, slot);
        }
    }

    /// Walks from least to most recently used.
    pub(crate) fn iter<'a, L: Linked>(&self, slots: &'a L) -> RecencyIter<'a, L> {
        RecencyIter {
            slots,
            at: self.head,
        }
    }
}

pub(crate) struct RecencyIter<'a, L> {
    slots: &'a L,
    at: u32,
}

impl<L: Linked> Iterator for RecencyIter<'_, L> {
    type Item = u32;
    fn next(&mut self) -> Option<u32> {
        if self.at == NIL {
            return None;
        }
        let at = self.at;
        self.at = self.slots.links_of(at).next;
        Some(at)
    }
}
