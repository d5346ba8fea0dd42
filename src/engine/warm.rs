//! The warm tier and the choice of victims: what a model keeps while it
//! sleeps, what bringing it back costs, and the three eviction policies.
//!
//! A model that declares [`Sleep`] can be put to sleep instead of deleted
//! when room must be made: it then holds its `sleeping_size` of VRAM (the
//! server's CUDA context and whatever it keeps) and, at level 1, its
//! `host_memory` in the GPU's host budget, and a request for it is a wake
//! rather than a load.
//!
//! [`Eviction::Lru`] takes victims least recently used first (the seed's
//! policy). [`Eviction::Cost`] is GreedyDual-Size-Frequency (Cherkasova,
//! 1998) with the frequency taken as a logarithm: each resident model has
//! the value
//!
//! ```text
//! H = L + (1 + ln F) * C / S
//! ```
//!
//! where `F` is how many requests it served since it became resident, `C`
//! the seconds bringing it back would cost if it were made room of now, `S`
//! the VRAM (GiB) that would free, and `L` the engine's inflation at the
//! model's last use. The victim is the model with the lowest `H`, and `L`
//! rises to the victim's `H`, so a model that is not used ages against the
//! ones that are. `C` and `S` depend on what would happen to it: an awake
//! model that can sleep costs its wake time and frees `size - sleepingSize`;
//! one that cannot costs its load time and frees its size; a sleeping model
//! costs `load - wake` (its next request would load instead of wake) and
//! frees its `sleepingSize`.
//!
//! Why the logarithm: `F` counts uses over a model's whole stay, so a hot
//! model that has been resident for hours gets thousands while a cold one
//! sleeping beside it has one or two, and plain GDSF then deletes ten cold
//! sleeping copies (each a 30-90 s load later) rather than put the hot one
//! to sleep (a 0.5-6 s wake). On the warm-tier trace of docs/performance.md
//! (256Gi host budget) plain `F` waited 2.7x less than LRU, `1 + ln F`
//! 5.4x, no frequency at all (GreedyDual-Size) 5.2x but 0.98x of LRU
//! without the warm tier, where `1 + ln F` is 1.10x better than LRU.

//!
//! [`Eviction::Rate`] (#39) ranks by the waiting a model's absence would
//! cause, per GiB it frees:
//!
//! ```text
//! rate * C / S
//! ```
//!
//! with `C` and `S` as above and `rate` the model's requests, each decayed
//! by how many requests (for any model) were served since: its half-life
//! is 500 served requests, and a request that follows the model's own last
//! one within 5 served requests counts as `gap / 5` of one (a burst of 40
//! costs one load or wake, not 40). Unlike GDSF's `F`, the rate is kept
//! when the model leaves: what TinyLFU's frequency sketch does for a cache
//! of unbounded keys, done exactly for a registry of known models. And it
//! decides what the host memory admits: an awake victim goes to sleep only
//! when the sleepers dropped for its host room would cost less waiting
//! (their rates times load minus wake) than deleting it instead; else it is
//! deleted, so a model asked for once no longer pushes a hot sleeper out.
//! Sleepers dropped for host room go by that waiting per GiB of host
//! memory they free (the budget they are dropped for), not per GiB of VRAM.
//!
//! Its clock is requests served, not time, so it needs no clock that can
//! lie and reads the same in `simulate` and in the operator (which keeps
//! it in status). On four traces (history/1-policies-on-traces.md) it waits
//! 1.15-1.42x less than `cost` with the warm tier at 256Gi of host memory
//! and 1.12-1.57x at 512Gi, and 1.13-1.24x less without the warm tier.
//! The half-life trades the shifting trace (shorter is better: 1.17x at
//! 250, 1.09x at 1000) against the steady Zipf one (7.50x and 7.80x the
//! seed's LRU); 500 was the best product of the four ratios.

use super::Bytes;

/// How a model sleeps, in bytes.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Sleep {
    /// VRAM the sleeping server keeps.
    pub sleeping_size: Bytes,
    /// Host RAM its offloaded weights take (level 1; 0 at level 2).
    pub host_memory: Bytes,
}

/// What bringing a model back costs, in seconds.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Costs {
    /// A cold load (pod creation to Ready).
    pub load: f64,
    /// A wake from sleep.
    pub wake: f64,
}

impl Default for Costs {
    /// The same for every model, so `cost` weighs only size and use.
    fn default() -> Self {
        Costs {
            load: 60.0,
            wake: 3.0,
        }
    }
}

/// Which resident makes room.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum Eviction {
    /// Least recently used first.
    #[default]
    Lru,
    /// Least valuable first by GreedyDual-Size-Frequency (module docs).
    Cost,
    /// Least expected waiting per GiB first, by each model's decayed
    /// request rate, kept across evictions (module docs).
    Rate,
}

impl Eviction {
    pub fn as_str(self) -> &'static str {
        match self {
            Eviction::Lru => "lru",
            Eviction::Cost => "cost",
            Eviction::Rate => "rate",
        }
    }
}

impl std::str::FromStr for Eviction {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        match s {
            "lru" => Ok(Eviction::Lru),
            "cost" => Ok(Eviction::Cost),
            "rate" => Ok(Eviction::Rate),
            other => Err(format!("eviction {other:?} is not lru, cost or rate")),
        }
    }
}

/// What a ceiling measurement knows of a model's future (#39): given to
/// [`Eviction::Rate`] in place of its rate estimate, it shows how much of
/// the waiting left is the estimate's (the past's) and how much the keys'.
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum Known {
    /// The probability that a request is for this model, from now on (the
    /// rate its trace was drawn with).
    Share(f64),
    /// The request (a trace row, from 0) that next asks for it: the
    /// clairvoyant ceiling, Belady's farthest-next-use weighed by cost per
    /// GiB.
    NextRequest(u64),
    /// Never asked for again.
    Never,
}

impl Known {
    /// As a rate in the estimate's unit (requests, each decayed over the
    /// half-life): a share `p` of the requests sums to `p` times the
    /// half-life over ln 2; the next request `d` rows ahead reads as one
    /// every `d`.
    pub(super) fn rate(self, now: u64) -> f64 {
        let mean_life = RATE_HALF_LIFE / std::f64::consts::LN_2;
        match self {
            Known::Share(p) => p * mean_life,
            Known::NextRequest(at) => mean_life / at.saturating_sub(now).max(1) as f64,
            Known::Never => 0.0,
        }
    }
}

/// What making room of a model would cost and free, by its state.
pub(super) fn cost_and_room(
    size: Bytes,
    sleep: Option<Sleep>,
    asleep: bool,
    c: Costs,
) -> (f64, Bytes) {
    match sleep {
        Some(s) if asleep => ((c.load - c.wake).max(0.0), s.sleeping_size),
        Some(s) => (c.wake, size - s.sleeping_size),
        None => (c.load, size),
    }
}

/// [`Eviction::Rate`]'s half-life, in requests served: a model's rate
/// halves over this many requests for other models.
const RATE_HALF_LIFE: f64 = 500.0;

/// [`Eviction::Rate`]: a request this close (in requests served) after the
/// model's last one counts as a fraction of one (`gap / RATE_EPISODE`).
const RATE_EPISODE: f64 = 5.0;

/// A rate `age` requests served after it was counted.
pub(super) fn decayed(rate: f64, age: u64) -> f64 {
    rate * (-(age as f64) * std::f64::consts::LN_2 / RATE_HALF_LIFE).exp()
}

/// What a request served at `now` adds to a rate last counted at `last`
/// (0: never).
pub(super) fn rate_increment(last: u64, now: u64) -> f64 {
    if last == 0 {
        return 1.0;
    }
    (now.saturating_sub(last) as f64 / RATE_EPISODE).min(1.0)
}

/// [`Eviction::Rate`]'s key: the waiting a model's absence would cause (its
/// rate times what bringing it back costs), per GiB it frees.
pub(super) fn expected_wait(rate: f64, cost: f64, room: Bytes) -> f64 {
    rate * cost / gib(room)
}

/// Room in GiB, at least a byte's worth (the keys divide by it), so keys
/// read as seconds per GiB.
fn gib(room: Bytes) -> f64 {
    const GIB: f64 = (1u64 << 30) as f64;
    (room as f64 / GIB).max(1.0 / GIB)
}

/// GDSF's `H` (module docs); room in GiB, so values read as seconds per GiB.
pub(super) fn value(base: f64, uses: u64, cost: f64, room: Bytes) -> f64 {
    let room = gib(room);
    base + (1.0 + (uses.max(1) as f64).ln()) * cost / room
}
