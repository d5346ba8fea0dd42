//! Whether a residency's GPU may take models (#70), from what the cluster
//! publishes: the DRA device taints on its ResourceSlice device (a driver
//! taints a failing GPU, an admin a GPU going to maintenance, a
//! DeviceTaintRule many at once) and its node's cordon. No I/O here.
//!
//! - `NoExecute`: the GPU is going or gone. Its models are unloaded at
//!   once (reason `GpuTainted`, not an eviction) and it loads nothing; the
//!   routers load elsewhere.
//! - `NoSchedule`, a cordoned node: nothing new is loaded or woken there
//!   (a request is refused here with reason `GpuTainted`, so a router
//!   places it on another GPU that lists the model); what is resident
//!   stays and serves.
//! - For [`HOLD_OFF`] after the last taint went, the GPU is treated as
//!   `NoSchedule`: one that toggles takes nothing new until it is stable.

use std::time::Duration;

/// How long a GPU whose taint went takes nothing new.
pub const HOLD_OFF: Duration = Duration::from_secs(30);

/// One taint of a device, as its ResourceSlice publishes it.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Taint {
    pub key: String,
    pub value: Option<String>,
    /// `NoSchedule` or `NoExecute` (anything else is read as NoSchedule:
    /// an effect this operator does not know still says something is
    /// wrong).
    pub effect: String,
    /// When it was added (RFC 3339), where the API server says.
    pub time_added: Option<String>,
}

impl Taint {
    pub fn no_execute(&self) -> bool {
        self.effect == "NoExecute"
    }

    /// `key=value:Effect`, as kubectl prints a taint.
    pub fn describe(&self) -> String {
        match &self.value {
            Some(v) if !v.is_empty() => format!("{}={v}:{}", self.key, self.effect),
            _ => format!("{}:{}", self.key, self.effect),
        }
    }
}

/// Why a GPU takes no new models while it still serves.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Held {
    /// A taint on its device (NoSchedule, or an effect not known here).
    Tainted,
    /// Its node is cordoned.
    Cordoned,
    /// Its taint went less than [`HOLD_OFF`] ago.
    HeldOff,
}

/// What the GPU may do now.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub enum GpuHealth {
    #[default]
    Healthy,
    /// Nothing new loads or wakes; residents stay. Why, and in words.
    NoNewModels(Held, String),
    /// Everything is unloaded; nothing loads. Why, in words.
    Gone(String),
}

impl GpuHealth {
    /// The GPU's health from its device's taints and its node's cordon:
    /// the gravest first.
    pub fn of(taints: &[Taint], cordoned: Option<&str>) -> GpuHealth {
        let said = |t: &Taint| match &t.time_added {
            Some(at) => format!("its device is tainted {} (since {at})", t.describe()),
            None => format!("its device is tainted {}", t.describe()),
        };
        if let Some(t) = taints.iter().find(|t| t.no_execute()) {
            return GpuHealth::Gone(said(t));
        }
        if let Some(t) = taints.first() {
            return GpuHealth::NoNewModels(Held::Tainted, said(t));
        }
        match cordoned {
            Some(node) => GpuHealth::NoNewModels(
                Held::Cordoned,
                format!("its node {node} is cordoned (spec.unschedulable)"),
            ),
            None => GpuHealth::Healthy,
        }
    }

    /// The condition's reason: the effect, `Cordoned` or `HeldOff`.
    pub fn reason(&self) -> &'static str {
        match self {
            GpuHealth::Healthy => "Healthy",
            GpuHealth::NoNewModels(Held::Tainted, _) => "NoSchedule",
            GpuHealth::NoNewModels(Held::Cordoned, _) => "Cordoned",
            GpuHealth::NoNewModels(Held::HeldOff, _) => "HeldOff",
            GpuHealth::Gone(_) => "NoExecute",
        }
    }

    pub fn message(&self) -> &str {
        match self {
            GpuHealth::Healthy => "no taint on its device, its node not cordoned",
            GpuHealth::NoNewModels(_, why) | GpuHealth::Gone(why) => why,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn taint(effect: &str) -> Taint {
        Taint {
            key: "gpu.nvidia.com/xid".into(),
            value: Some("79".into()),
            effect: effect.into(),
            time_added: Some("2026-12-08T00:00:00Z".into()),
        }
    }

    #[test]
    fn the_gravest_of_taints_and_cordon_decides() {
        assert_eq!(GpuHealth::of(&[], None), GpuHealth::Healthy);
        let cordoned = GpuHealth::of(&[], Some("node-a"));
        assert_eq!(cordoned.reason(), "Cordoned");
        let both = GpuHealth::of(&[taint("NoSchedule"), taint("NoExecute")], Some("n"));
        assert_eq!(both.reason(), "NoExecute");
        assert_eq!(
            both.message(),
            "its device is tainted gpu.nvidia.com/xid=79:NoExecute (since 2026-12-08T00:00:00Z)"
        );
        // An effect not known here still keeps new models away.
        assert_eq!(
            GpuHealth::of(&[taint("PreferNoSchedule")], None).reason(),
            "NoSchedule"
        );
    }
}
