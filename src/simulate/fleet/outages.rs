//! GPUs taken out of a fleet replay (#70): a failure (`--gpu-failure
//! G@T`: the device tainted NoExecute at T, with no notice) and a planned
//! maintenance (`--gpu-maintenance G@T+NOTICE`: tainted NoSchedule at T,
//! NoExecute NOTICE seconds later), as the operator acts on them:
//!
//! - from the NoSchedule taint, nothing new is placed on the GPU (its
//!   residents still serve), and with the pre-move (the operator's
//!   `evacuate`; `--no-pre-move` leaves it out) each of its models used
//!   within [`HOT`] that no other GPU holds awake is loaded on another GPU
//!   by the copy rule (a wake, room, or idle victims only);
//! - at NoExecute, its models are unloaded, the requests in flight on it
//!   are lost (counted as failed: their server went), and it takes nothing
//!   for the rest of the replay.

use super::Fleet;
use crate::engine::ModelId;

/// A model used within this long of the notice is moved first (the
/// operator's `evacuate::HOT`).
pub const HOT: f64 = 600.0;

/// One GPU's outage.
#[derive(Clone, Debug, PartialEq)]
pub struct Outage {
    pub gpu: usize,
    /// When it takes no new models (NoSchedule), and when it goes
    /// (NoExecute); equal for a failure.
    pub tainted: f64,
    pub gone: f64,
}

/// `G@T`: GPU G fails at T seconds.
pub fn parse_failure(s: &str) -> Result<Outage, String> {
    let (gpu, at) = gpu_at(s, "G@T")?;
    Ok(Outage {
        gpu,
        tainted: at,
        gone: at,
    })
}

/// `G@T+NOTICE`: GPU G is announced for maintenance at T and goes NOTICE
/// seconds later.
pub fn parse_maintenance(s: &str) -> Result<Outage, String> {
    let (head, notice) = s
        .split_once('+')
        .ok_or_else(|| format!("{s:?}: give G@T+NOTICE (seconds of notice)"))?;
    let (gpu, at) = gpu_at(head, "G@T+NOTICE")?;
    let notice: f64 = notice
        .parse()
        .ok()
        .filter(|n: &f64| n.is_finite() && *n >= 0.0)
        .ok_or_else(|| format!("{s:?}: NOTICE is seconds, 0 or more"))?;
    Ok(Outage {
        gpu,
        tainted: at,
        gone: at + notice,
    })
}

fn gpu_at(s: &str, form: &str) -> Result<(usize, f64), String> {
    let (gpu, at) = s
        .split_once('@')
        .ok_or_else(|| format!("{s:?}: give {form} (a GPU index and seconds)"))?;
    let gpu = gpu
        .parse()
        .map_err(|_| format!("{s:?}: {gpu:?} is not a GPU index"))?;
    let at = at
        .parse()
        .ok()
        .filter(|t: &f64| t.is_finite() && *t >= 0.0)
        .ok_or_else(|| format!("{s:?}: {at:?} is not a time in seconds"))?;
    Ok((gpu, at))
}

/// What a GPU may do now.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub(super) enum GpuState {
    #[default]
    Up,
    NoNewModels,
    Gone,
}

impl Fleet {
    /// The outages' steps due by `now`, each at its own time, in order.
    pub(super) fn outages_until(&mut self, now: f64) {
        loop {
            let next = self
                .options
                .outages
                .iter()
                .flat_map(|o| {
                    let state = self.states[o.gpu];
                    let taint = (state == GpuState::Up && o.tainted < o.gone).then_some((
                        o.tainted,
                        o.gpu,
                        GpuState::NoNewModels,
                    ));
                    let gone = (state != GpuState::Gone).then_some((o.gone, o.gpu, GpuState::Gone));
                    taint.or(gone)
                })
                .filter(|(t, _, _)| *t <= now)
                .min_by(|a, b| a.0.total_cmp(&b.0));
            let Some((t, g, to)) = next else {
                return;
            };
            match to {
                GpuState::NoNewModels => {
                    self.states[g] = to;
                    if self.options.pre_move {
                        self.move_ahead(g, t);
                    }
                }
                _ => self.go(g, t),
            }
        }
    }

    /// Each model of GPU `g` used within [`HOT`] of `t` and held awake
    /// nowhere else, loaded on another GPU by the copy rule.
    fn move_ahead(&mut self, g: usize, t: f64) {
        let hot: Vec<ModelId> = self.gpus()[g]
            .residents()
            .into_iter()
            .filter(|&id| !self.gpus()[g].is_asleep(id))
            .filter(|&id| self.node.width(self.template.name(id)).is_none())
            .filter(|id| self.last_use.get(&(g, *id)).is_some_and(|u| t - u < HOT))
            .collect();
        for id in hot {
            if self.holders(id).iter().any(|&h| h != g) {
                continue;
            }
            if let Some(to) = self.place(id, t, true)
                && self.serve_on(to, id, t).is_some()
            {
                self.report.moved_ahead += 1;
            }
        }
    }

    /// GPU `g` goes at `t`: what is in flight there fails, its models are
    /// unloaded.
    fn go(&mut self, g: usize, t: f64) {
        self.states[g] = GpuState::Gone;
        let lost: usize = self
            .in_flight
            .iter()
            .filter(|((gpu, _), _)| *gpu == g)
            .map(|(_, ends)| ends.iter().filter(|&&e| e > t).count())
            .sum();
        self.report.failed_requests += lost as u64;
        self.in_flight.retain(|(gpu, _), _| *gpu != g);
        for id in self.gpus()[g].residents() {
            let name = self.template.name(id).to_owned();
            self.node.unload_on(g, &name);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn outages_are_read_as_written_and_bad_ones_say_why() {
        assert_eq!(
            parse_failure("1@3600").unwrap(),
            Outage {
                gpu: 1,
                tainted: 3600.0,
                gone: 3600.0
            }
        );
        assert_eq!(
            parse_maintenance("0@60+600").unwrap(),
            Outage {
                gpu: 0,
                tainted: 60.0,
                gone: 660.0
            }
        );
        for bad in ["1", "x@1", "1@-5", "1@nan"] {
            assert!(parse_failure(bad).is_err(), "{bad}");
        }
        for bad in ["1@60", "1@60+x", "1@60+-1"] {
            assert!(parse_maintenance(bad).is_err(), "{bad}");
        }
    }
}
