//! The reasons a model's status gives for its state: one word each, as
//! `kubectl` shows them and alerts match on them.

use crate::engine::RefuseReason;
use crate::quantity::format_bytes;

/// Why a model is in its state.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Reason {
    /// Its pod was just created.
    PodCreated,
    /// Loaded or woken ahead of demand (`spec.anticipate`), not requested
    /// since.
    Anticipated,
    /// Its artifact is being fetched onto the node's disk.
    FetchingArtifact,
    /// Its artifact could not be fetched (the node agent says why).
    ArtifactFailed,
    /// Its artifact's spec can never work (a mount path that is not a
    /// normalized absolute path).
    InvalidArtifact,
    /// The node's disk budget cannot hold its artifact.
    DiskFull,
    /// Its pod exists and is not Ready yet.
    PodStarting,
    /// Resident, but waits for evicted pods to release their VRAM.
    WaitingForVram,
    /// Requested, not admitted yet: the only models it could evict are
    /// still loading.
    WaitingForLoads,
    /// Its pod is being replaced because its declared size changed.
    Resized,
    /// Its pod is being replaced because the residency's node or GPU changed.
    Moved,
    /// Its pod is being replaced because its template changed.
    TemplateChanged,
    /// A failed pod is being replaced by a retry.
    Retrying,
    /// Its pod failed; a retry is scheduled.
    PodFailed,
    /// Its pod template cannot make a pod.
    InvalidTemplate,
    /// Evicted to make room for another model.
    MadeRoom,
    /// Evicted because the budget shrank.
    BudgetShrunk,
    /// Dropped because the recorded status broke its own budget.
    BudgetExceeded,
    /// Unloaded because its demand entry was removed.
    DemandRemoved,
    /// Unloaded because the copy scaler removed this copy and it could not
    /// sleep.
    CopyRemoved,
    /// Unloaded because it left the registry.
    RemovedFromRegistry,
    /// Unloaded because it was not requested for its keepAlive.
    Idle,
    /// Unloaded (or not loaded) because another residency holds the GPU.
    GpuConflict,
    /// Its GPU's device is tainted NoExecute (failing, or taken away): its
    /// models are unloaded and it loads nothing; or, for a request, the
    /// GPU takes no new models (NoSchedule, a cordoned node, a taint just
    /// gone): a router loads it on another GPU.
    GpuTainted,
    /// claim mode: the claim is being made, replaced or allocated.
    GpuPending,
    /// claim mode: the scheduler cannot allocate the claim (another claim
    /// holds the device, say); its reason is in the message.
    GpuUnavailable,
    /// claim mode: the claim's DeviceClass does not exist.
    DeviceClassMissing,
    /// claim mode: the node publishes no devices of the class's driver.
    NoGpuDriver,
    /// claim mode: no published device has the index or uuid of spec.device.
    NoSuchGpu,
    /// claim mode: spec.gpu.existingClaim names no claim, or the claim the
    /// operator would make is someone else's.
    ClaimMissing,
    /// Sleeping: put to sleep to make room; its sleep request is sent
    /// shortly (it holds its full size until the sleep is confirmed).
    FallingAsleep,
    /// Sleeping, confirmed by its server: it holds its sleeping size.
    Asleep,
    /// Requested while asleep: its wake request is sent once the room is
    /// free (it holds its sleeping size until then).
    Waking,
    /// Its sleep request failed or was not confirmed: its pod was deleted.
    SleepFailed,
    /// Its wake request failed: its pod was deleted and it loads cold.
    WakeFailed,
    /// It slept, and its pod went away or restarted: it is not resident.
    SleepingPodLost,
    /// Refused: larger than the whole budget.
    LargerThanBudget,
    /// Refused: fits only by evicting pinned models.
    NoEvictableRoom,
    /// Refused: not in the registry.
    UnknownModel,
    /// A gang (`gpus: N`) requested here, waiting for the operator to
    /// place it on N GPUs of its node that can all make room.
    GangPlacing,
    /// A gang placed here, waiting for its other GPUs to make room before
    /// its pod starts.
    GangWaiting,
    /// A gang on this GPU whose pod another residency of the gang (its
    /// head, the first GPU) starts and replaces.
    GangMember,
    /// A gang's pod went away (a member let the gang go, or someone
    /// deleted it): the coordinator takes the gang off every member.
    GangPodLost,
    /// Refused: no N GPUs of the node could ever hold the gang (each GPU's
    /// reason in the message).
    GangRefused,
    /// A gang another GPU put to sleep cannot sleep on this one (its host
    /// budget has no room): unloaded here, it leaves every GPU.
    GangCannotSleep,
}

impl Reason {
    pub fn as_str(self) -> &'static str {
        match self {
            Reason::PodCreated => "PodCreated",
            Reason::Anticipated => "Anticipated",
            Reason::FetchingArtifact => "FetchingArtifact",
            Reason::ArtifactFailed => "ArtifactFailed",
            Reason::InvalidArtifact => "InvalidArtifact",
            Reason::DiskFull => "DiskFull",
            Reason::PodStarting => "PodStarting",
            Reason::WaitingForVram => "WaitingForVram",
            Reason::WaitingForLoads => "WaitingForLoads",
            Reason::Resized => "Resized",
            Reason::Moved => "Moved",
            Reason::TemplateChanged => "TemplateChanged",
            Reason::Retrying => "Retrying",
            Reason::PodFailed => "PodFailed",
            Reason::InvalidTemplate => "InvalidTemplate",
            Reason::MadeRoom => "MadeRoom",
            Reason::BudgetShrunk => "BudgetShrunk",
            Reason::BudgetExceeded => "BudgetExceeded",
            Reason::DemandRemoved => "DemandRemoved",
            Reason::CopyRemoved => "CopyRemoved",
            Reason::RemovedFromRegistry => "RemovedFromRegistry",
            Reason::Idle => "Idle",
            Reason::GpuConflict => "GpuConflict",
            Reason::GpuTainted => "GpuTainted",
            Reason::GpuPending => "GpuPending",
            Reason::GpuUnavailable => "GpuUnavailable",
            Reason::DeviceClassMissing => "DeviceClassMissing",
            Reason::NoGpuDriver => "NoGpuDriver",
            Reason::NoSuchGpu => "NoSuchGpu",
            Reason::ClaimMissing => "ClaimMissing",
            Reason::FallingAsleep => "FallingAsleep",
            Reason::Asleep => "Asleep",
            Reason::Waking => "Waking",
            Reason::SleepFailed => "SleepFailed",
            Reason::WakeFailed => "WakeFailed",
            Reason::SleepingPodLost => "SleepingPodLost",
            Reason::LargerThanBudget => "LargerThanBudget",
            Reason::NoEvictableRoom => "NoEvictableRoom",
            Reason::UnknownModel => "UnknownModel",
            Reason::GangPlacing => "GangPlacing",
            Reason::GangWaiting => "GangWaiting",
            Reason::GangMember => "GangMember",
            Reason::GangRefused => "GangRefused",
            Reason::GangPodLost => "GangPodLost",
            Reason::GangCannotSleep => "GangCannotSleep",
        }
    }
}

impl From<&RefuseReason> for Reason {
    fn from(r: &RefuseReason) -> Self {
        match r {
            RefuseReason::LargerThanBudget { .. } => Reason::LargerThanBudget,
            RefuseReason::NoEvictableRoom { .. } => Reason::NoEvictableRoom,
            RefuseReason::UnknownModel => Reason::UnknownModel,
        }
    }
}

impl From<Reason> for String {
    fn from(r: Reason) -> Self {
        r.as_str().to_owned()
    }
}

impl From<Reason> for Box<str> {
    fn from(r: Reason) -> Self {
        r.as_str().into()
    }
}

/// A refusal explained with the sizes, as the model's status message and
/// the router's 503 say it.
pub fn refusal_message(model: &str, reason: &RefuseReason) -> String {
    match *reason {
        RefuseReason::LargerThanBudget { size, budget } => format!(
            "{model} needs {}, budget is {}",
            format_bytes(size),
            format_bytes(budget)
        ),
        RefuseReason::NoEvictableRoom {
            size,
            budget,
            pinned,
        } => format!(
            "{model} needs {}, budget is {} and pinned models hold {}",
            format_bytes(size),
            format_bytes(budget),
            format_bytes(pinned)
        ),
        RefuseReason::UnknownModel => format!("{model} is not in spec.models"),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn refusal_words_match_the_engine() {
        for r in [
            RefuseReason::LargerThanBudget { size: 2, budget: 1 },
            RefuseReason::NoEvictableRoom {
                size: 2,
                budget: 3,
                pinned: 2,
            },
            RefuseReason::UnknownModel,
        ] {
            assert_eq!(Reason::from(&r).as_str(), r.as_str());
        }
    }
}
