//! A model's expected demand (#69), learnt online from the requests the
//! routers report: when in the day and in the week it is used, and how
//! busy it is now. Pure and small: 1,185 bytes a model, so 10,000 models
//! keep 12 MB, and its state is a plain array an operator can persist and
//! read back (`to_bytes`, `from_bytes`).
//!
//! Real traffic repeats by the day and the week (the ServeGen production
//! traces: clients silent for hours who come back at the same time each
//! day), and a model's load takes tens of seconds: what is wanted is the
//! chance of a request within the next load time, not a rate. So the
//! forecast keeps, for each 10-minute slot of the day and of the week, how
//! often that slot saw at least one request (an exponentially weighted
//! share: a slot used on most recent days reads near 1, one used once a
//! fortnight near 0), how busy a slot that sees requests is (one rate for
//! the model: within such a slot its requests are taken as Poisson at that
//! rate, so a model used once in a busy hour is not expected within every
//! minute of it), and a short-term level (an exponentially weighted
//! rate, half-life 20 minutes) for the hour in progress. The chance of a
//! request within a horizon is the larger of the seasonal one (the slots
//! the horizon ends in, weekly and daily blended once a week has been seen)
//! and the level's (a Poisson process at the recent rate): a model busy
//! now stays expected, and one that comes back each morning is expected
//! at that time, before its first request.

/// A forecast's length as bytes ([`Forecast::to_bytes`]).
pub const BYTES: usize = DAY_SLOTS + WEEK_SLOTS + 8 + 1 + 4 + 4 + 4 + 4 + 8;

/// The forecast's time step: a slot of the day or week, in seconds.
pub const SLOT_SECONDS: f64 = 600.0;
/// Slots in a day and in a week.
pub const DAY_SLOTS: usize = 144;
pub const WEEK_SLOTS: usize = 7 * DAY_SLOTS;
/// What one slot's outcome weighs in the daily and the weekly share (a
/// slot used two days running reads 0.64: the daily one follows a change
/// within a few days, the weekly one within two or three weeks), and what
/// one active slot's rate weighs in the active rate.
const DAY_WEIGHT: f64 = 0.4;
const WEEK_WEIGHT: f64 = 0.5;
const ACTIVE_WEIGHT: f64 = 0.1;
/// The short-term level's half-life, in seconds.
const LEVEL_HALF_LIFE: f64 = 1200.0;

/// One model's forecast.
#[derive(Clone, Debug, PartialEq)]
pub struct Forecast {
    /// Share of recent days whose slot saw a request, 0..=255.
    day: [u8; DAY_SLOTS],
    /// The same by slot of the week.
    week: [u8; WEEK_SLOTS],
    /// The slot (counted from the epoch) requests are being counted in,
    /// whether one came in it, and how many.
    slot: u64,
    seen: bool,
    count: u32,
    /// Requests per second in a slot that sees any (exponentially weighted
    /// over such slots).
    active_rate: f32,
    /// Slots observed since the first request: the weekly shares count
    /// once a week has been seen.
    slots_seen: u32,
    /// Requests per second recently, and when that was last brought up to
    /// date (seconds from the epoch).
    level: f32,
    level_at: f64,
}

impl Default for Forecast {
    fn default() -> Self {
        Forecast {
            day: [0; DAY_SLOTS],
            week: [0; WEEK_SLOTS],
            slot: 0,
            seen: false,
            count: 0,
            active_rate: 0.0,
            slots_seen: 0,
            level: 0.0,
            level_at: 0.0,
        }
    }
}

fn slot_of(t: f64) -> u64 {
    (t.max(0.0) / SLOT_SECONDS) as u64
}

fn blend(share: u8, happened: bool, weight: f64) -> u8 {
    let target = if happened { 255.0 } else { 0.0 };
    (share as f64 + weight * (target - share as f64)).round() as u8
}

impl Forecast {
    /// A request at `t` (seconds from the epoch; a time before the last
    /// one seen counts as that one: clocks that lie move nothing back).
    pub fn request(&mut self, t: f64) {
        self.advance(t);
        self.seen = true;
        self.count = self.count.saturating_add(1);
        let t = t.max(self.level_at);
        self.decay_level(t);
        // Each request adds to the rate what one request in a half-life's
        // exponential window is worth.
        self.level += (std::f64::consts::LN_2 / LEVEL_HALF_LIFE) as f32;
    }

    /// Closes the slots before `t`'s: each records whether it saw a
    /// request (at most a week of empty slots is walked: after that every
    /// share has been lowered by a week of them, as a longer walk would).
    pub fn advance(&mut self, t: f64) {
        let now = slot_of(t);
        if self.slots_seen == 0 && !self.seen {
            // Nothing yet: start counting here.
            self.slot = now;
            return;
        }
        if now <= self.slot {
            return;
        }
        if self.seen {
            let rate = self.count as f64 / SLOT_SECONDS;
            let a = if self.active_rate == 0.0 {
                1.0
            } else {
                ACTIVE_WEIGHT
            };
            self.active_rate += (a * (rate - self.active_rate as f64)) as f32;
        }
        let closing = (now - self.slot).min(WEEK_SLOTS as u64);
        let first = now - closing;
        for s in first..now {
            let happened = s == self.slot && self.seen;
            let d = (s % DAY_SLOTS as u64) as usize;
            let w = (s % WEEK_SLOTS as u64) as usize;
            self.day[d] = blend(self.day[d], happened, DAY_WEIGHT);
            self.week[w] = blend(self.week[w], happened, WEEK_WEIGHT);
        }
        self.slots_seen = self
            .slots_seen
            .saturating_add((now - self.slot).min(u32::MAX as u64) as u32);
        self.slot = now;
        self.seen = false;
        self.count = 0;
    }

    fn decay_level(&mut self, t: f64) {
        if t > self.level_at {
            let dt = t - self.level_at;
            self.level *= (-(dt / LEVEL_HALF_LIFE) * std::f64::consts::LN_2).exp() as f32;
            self.level_at = t;
        }
    }

    /// The recent rate at `t`, in requests per second.
    /// The time of the newest request counted (seconds from the epoch), if
    /// any: a reader feeding requests from a list counts only newer ones.
    pub fn last_request(&self) -> Option<f64> {
        (self.level_at > 0.0 || self.level > 0.0).then_some(self.level_at)
    }

    pub fn level(&self, t: f64) -> f64 {
        let dt = (t - self.level_at).max(0.0);
        self.level as f64 * (-(dt / LEVEL_HALF_LIFE) * std::f64::consts::LN_2).exp()
    }

    /// The seasonal chance that slot `s` sees a request: the daily share,
    /// blended half and half with the weekly one once a week has been seen.
    fn seasonal(&self, s: u64) -> f64 {
        let d = self.day[(s % DAY_SLOTS as u64) as usize] as f64 / 255.0;
        if (self.slots_seen as usize) < WEEK_SLOTS {
            return d;
        }
        let w = self.week[(s % WEEK_SLOTS as u64) as usize] as f64 / 255.0;
        0.5 * d + 0.5 * w
    }

    /// The chance of at least one request between `t` and `t + seconds`:
    /// the larger of the recent level's (Poisson at that rate) and the
    /// seasonal one: for each slot the span covers, the chance that the
    /// slot is one that sees requests times the chance that one falls in
    /// the part of it covered, at the active rate (the slot in progress
    /// counts only while it has had no request yet: the recent level
    /// speaks for it once it has). Slots are taken as independent.
    pub fn chance_within(&self, t: f64, seconds: f64) -> f64 {
        let seconds = seconds.max(0.0);
        let recent = 1.0 - (-self.level(t) * seconds).exp();
        let end = t + seconds;
        let (from, to) = (slot_of(t), slot_of(end).min(slot_of(t) + DAY_SLOTS as u64));
        let rate = self.active_rate as f64;
        let none = (from..=to)
            .filter(|&s| s > from || !(s == self.slot && self.seen))
            .map(|s| {
                let start = (s as f64 * SLOT_SECONDS).max(t);
                let stop = ((s + 1) as f64 * SLOT_SECONDS).min(end);
                let covered = (stop - start).max(0.0);
                1.0 - self.seasonal(s) * (1.0 - (-rate * covered).exp())
            })
            .product::<f64>();
        recent.max(1.0 - none)
    }

    /// When the next request is expected, from `t`: the start of the first
    /// slot within a week whose seasonal chance is at least one half (`t`
    /// itself while the recent level expects one within a slot).
    pub fn expected_next(&self, t: f64) -> Option<f64> {
        if 1.0 - (-self.level(t) * SLOT_SECONDS).exp() >= 0.5 {
            return Some(t);
        }
        let from = slot_of(t);
        (from + 1..from + WEEK_SLOTS as u64)
            .find(|&s| self.seasonal(s) >= 0.5)
            .map(|s| s as f64 * SLOT_SECONDS)
    }

    /// The forecast as bytes, to be kept where an operator reads it back.
    pub fn to_bytes(&self) -> Vec<u8> {
        let mut out = Vec::with_capacity(BYTES);
        out.extend_from_slice(&self.day);
        out.extend_from_slice(&self.week);
        out.extend_from_slice(&self.slot.to_le_bytes());
        out.push(self.seen as u8);
        out.extend_from_slice(&self.count.to_le_bytes());
        out.extend_from_slice(&self.active_rate.to_le_bytes());
        out.extend_from_slice(&self.slots_seen.to_le_bytes());
        out.extend_from_slice(&self.level.to_le_bytes());
        out.extend_from_slice(&self.level_at.to_le_bytes());
        out
    }

    /// A forecast read back; `None` for bytes that are not one.
    pub fn from_bytes(b: &[u8]) -> Option<Forecast> {
        if b.len() != BYTES {
            return None;
        }
        let (day, rest) = b.split_at(DAY_SLOTS);
        let (week, rest) = rest.split_at(WEEK_SLOTS);
        let (slot, rest) = rest.split_at(8);
        let (seen, rest) = rest.split_at(1);
        let (count, rest) = rest.split_at(4);
        let (active_rate, rest) = rest.split_at(4);
        let active_rate = f32::from_le_bytes(active_rate.try_into().ok()?);
        let (slots_seen, rest) = rest.split_at(4);
        let (level, level_at) = rest.split_at(4);
        let level = f32::from_le_bytes(level.try_into().ok()?);
        let level_at = f64::from_le_bytes(level_at.try_into().ok()?);
        let rates_ok = [level, active_rate]
            .iter()
            .all(|r| r.is_finite() && *r >= 0.0);
        if !rates_ok || !level_at.is_finite() || seen[0] > 1 {
            return None;
        }
        Some(Forecast {
            day: day.try_into().ok()?,
            week: week.try_into().ok()?,
            slot: u64::from_le_bytes(slot.try_into().ok()?),
            seen: seen[0] == 1,
            count: u32::from_le_bytes(count.try_into().ok()?),
            active_rate,
            slots_seen: u32::from_le_bytes(slots_seen.try_into().ok()?),
            level,
            level_at,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const HOUR: f64 = 3600.0;
    const DAY: f64 = 24.0 * HOUR;

    /// Requests every minute from 9:00 to 9:30, each day for `days` days.
    fn mornings(days: u32) -> Forecast {
        let mut f = Forecast::default();
        for d in 0..days {
            for m in 0..30 {
                f.request(d as f64 * DAY + 9.0 * HOUR + m as f64 * 60.0);
            }
        }
        f
    }

    #[test]
    fn a_model_used_each_morning_is_expected_the_next_morning_before_its_first_request() {
        let f = mornings(7);
        // 8:58 the next day: quiet since yesterday's 9:30, yet within ten
        // minutes a request is all but sure, within three (one minute of
        // the 9:00 slot, at one a minute) about 1 - 1/e.
        let t = 7.0 * DAY + 8.0 * HOUR + 58.0 * 60.0;
        assert!(f.level(t) < 1e-6);
        assert!(
            f.chance_within(t, 600.0) > 0.95,
            "{}",
            f.chance_within(t, 600.0)
        );
        let three = f.chance_within(t, 180.0);
        assert!((0.55..0.65).contains(&three), "{three}");
        // At 15:00 it is not.
        assert!(f.chance_within(7.0 * DAY + 15.0 * HOUR, 180.0) < 0.1);
        let next = f.expected_next(7.0 * DAY + 15.0 * HOUR).unwrap();
        assert_eq!(next, 8.0 * DAY + 9.0 * HOUR);
    }

    #[test]
    fn a_busy_model_is_expected_now_and_a_habit_dropped_fades() {
        let mut f = Forecast::default();
        for s in 0..120 {
            f.request(s as f64 * 10.0);
        }
        assert!(
            f.chance_within(1200.0, 60.0) > 0.9,
            "{}",
            f.chance_within(1200.0, 60.0)
        );
        let mut f = mornings(7);
        // Two weeks without it: the mornings are forgotten.
        f.advance(21.0 * DAY);
        assert!(f.chance_within(21.0 * DAY + 8.9 * HOUR, 600.0) < 0.2);
    }

    #[test]
    fn a_clock_that_goes_back_moves_nothing_back() {
        let mut f = mornings(2);
        let before = f.clone();
        f.request(0.0);
        assert_eq!(f.day, before.day);
        assert!(f.level(2.0 * DAY) >= before.level(2.0 * DAY));
    }

    #[test]
    fn a_forecast_read_back_is_the_same_and_garbage_is_refused() {
        let f = mornings(8);
        let bytes = f.to_bytes();
        assert_eq!(bytes.len(), BYTES);
        assert_eq!(BYTES, 1185);
        assert_eq!(Forecast::from_bytes(&bytes), Some(f));
        assert_eq!(Forecast::from_bytes(&bytes[1..]), None);
        let mut bad = bytes.clone();
        let n = bad.len();
        bad[n - 12..n - 8].copy_from_slice(&f32::NAN.to_le_bytes());
        assert_eq!(Forecast::from_bytes(&bad), None);
    }
}
