//! What the residency's pods hold (by model, the VRAM and host memory of
//! those not gone yet) and the pod side of a decision, filled model by
//! model as [`super::settle`] goes through the registry.

use super::{PodCall, PodRef};
use crate::controller::pods::{ModelPod, PodPhase};
use crate::engine::{Bytes, Engine};
use k8s_openapi::api::core::v1::Pod;
use std::collections::{BTreeMap, HashMap};
use std::time::Duration;

/// The residency's pods by model, and the VRAM they hold.
pub(super) struct PodInventory<'p> {
    pub(super) by_model: BTreeMap<&'p str, Vec<&'p ModelPod>>,
    /// Declared sizes of every pod that has not finished, terminating ones
    /// included (they still hold VRAM), plus the pods created so far in
    /// this reconcile.
    pub(super) live_declared: Bytes,
    /// Host memory the pods may hold asleep: the confirmed sleepers', and
    /// every terminating pod's of a model that can sleep (it may have been
    /// asleep when it was deleted, and holds it until it is gone), plus the
    /// sleeps asked so far in this reconcile.
    pub(super) host_held: Bytes,
}

impl<'p> PodInventory<'p> {
    /// `asleep`: the pods whose sleep was confirmed (and not woken since),
    /// with the VRAM each keeps asleep.
    pub(super) fn new(
        pods: &'p [ModelPod],
        engine: &Engine,
        asleep: &HashMap<&str, Bytes>,
    ) -> Self {
        let mut by_model: BTreeMap<&str, Vec<&ModelPod>> = BTreeMap::new();
        let mut live_declared = 0;
        let mut host_held = 0;
        for p in pods {
            by_model.entry(&*p.model).or_default().push(p);
            if p.phase == PodPhase::Live {
                let sleep = engine.id(&p.model).and_then(|id| engine.sleep_of(id));
                if asleep.contains_key(&*p.name) || p.deleting {
                    host_held += sleep.map_or(0, |s| s.host_memory);
                }
                if let Some(&kept) = asleep.get(&*p.name).filter(|_| !p.deleting) {
                    live_declared += kept;
                    continue;
                }
                // A pod without its size annotation counts at the model's
                // current size.
                let registered = || engine.id(&p.model).map_or(0, |id| engine.size(id));
                live_declared += p.size.unwrap_or_else(registered);
            }
        }
        PodInventory {
            by_model,
            live_declared,
            host_held,
        }
    }

    pub(super) fn of(&self, model: &str) -> &[&'p ModelPod] {
        self.by_model.get(model).map_or(&[], Vec::as_slice)
    }

    /// The model's pod that is (or may soon be) serving.
    pub(super) fn live(&self, model: &str) -> Option<&'p ModelPod> {
        let mut found = self.of(model).iter().copied();
        found.find(|p| p.phase == PodPhase::Live && !p.deleting)
    }

    /// The model's pod that stopped and has not been deleted yet.
    pub(super) fn failed(&self, model: &str) -> Option<&'p ModelPod> {
        let mut found = self.of(model).iter().copied();
        found.find(|p| p.phase == PodPhase::Finished && !p.deleting)
    }
}

/// The pod side of the decision, filled model by model.
#[derive(Default)]
pub(super) struct PodPlan {
    pub(super) create: Vec<Pod>,
    pub(super) delete: Vec<PodRef>,
    pub(super) requeue: Option<Duration>,
    pub(super) load_seconds: Vec<f64>,
    pub(super) calls: Vec<PodCall>,
}

impl PodPlan {
    pub(super) fn delete(&mut self, p: &ModelPod) {
        self.delete.push(p.into());
    }

    pub(super) fn look_again_within(&mut self, after: Duration) {
        self.requeue = Some(self.requeue.map_or(after, |r| r.min(after)));
    }
}
