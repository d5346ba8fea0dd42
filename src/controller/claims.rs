//! Who holds each declared GPU (devicePlugin and env mode; in claim mode
//! the scheduler decides). Residencies that name the same node and device
//! describe one GPU, whose VRAM is one budget: only one of them may use it.
//! The oldest holds it (creation time, then namespace/name); the others
//! load nothing until it goes away or moves. Fed from the residency watch,
//! so every reconcile sees every claim the operator watches.

use crate::api::ModelResidency;
use k8s_openapi::jiff::Timestamp;
use kube::ResourceExt;
use kube::runtime::reflector::ObjectRef;
use kube::runtime::watcher;
use std::collections::HashMap;
use std::sync::{Arc, Mutex};

/// A residency by (namespace, name): one allocation shared by its claim
/// and its entry in the index (one of each is kept per residency).
type Key = Arc<(Box<str>, Box<str>)>;

/// A residency claiming a GPU; the order is the precedence (oldest first,
/// then namespace, then name).
#[derive(Clone, Debug, PartialEq, Eq, PartialOrd, Ord)]
struct Claimant {
    created: Option<Timestamp>,
    key: Key,
}

impl Claimant {
    fn of(r: &ModelResidency) -> Self {
        Claimant {
            // A residency always has one once stored; none sorts first.
            created: r.metadata.creation_timestamp.as_ref().map(|t| t.0),
            key: Arc::new((
                r.namespace().unwrap_or_default().into(),
                r.name_any().into(),
            )),
        }
    }

    fn object_ref(&self) -> ObjectRef<ModelResidency> {
        ObjectRef::new(&self.key.1).within(&self.key.0)
    }
}

/// A GPU: (node, device), one allocation shared by the index's two maps.
type Gpu = Arc<(Box<str>, Box<str>)>;

/// The GPU a residency declares: its node and device (devicePlugin and
/// env mode), or in claim mode its ResourceClaim: the scheduler gives a
/// device to one claim, but two residencies may name one claim
/// (spec.gpu.existingClaim, the other's claim too), and one device is one
/// budget.
fn gpu_of(r: &ModelResidency) -> Option<Gpu> {
    if r.spec.gpu.mode == crate::api::GpuMode::Claim {
        let ns = r.namespace().unwrap_or_default();
        return Some(Arc::new((
            format!("claim {ns}").into(),
            crate::residency::gpu::claim_of(r).into(),
        )));
    }
    Some(Arc::new((
        r.spec.node_name.as_deref()?.into(),
        r.spec.device.as_str().into(),
    )))
}

/// Kept small (measured by `cargo bench --bench heap`): a GPU's claimants
/// in a sorted vector (almost always one) rather than a B-tree, whose
/// first node alone is most of a kilobyte; each GPU's and each
/// residency's names once, shared between the maps.
#[derive(Debug, Default)]
struct Index {
    by_gpu: HashMap<Gpu, Vec<Claimant>>,
    /// Each residency's current GPU, to find its claim again when it moves.
    claims: HashMap<Key, Gpu>,
}

impl Index {
    /// Records a residency's claim; returns the GPUs whose claimants changed.
    fn claim(&mut self, r: &ModelResidency) -> Vec<Gpu> {
        let claimant = Claimant::of(r);
        let old = self.release(&claimant.key);
        let Some(gpu) = gpu_of(r) else {
            return old.into_iter().collect();
        };
        // The GPU's names as the index already holds them, if it does.
        let gpu = match self.by_gpu.get_key_value(&gpu) {
            Some((known, _)) => known.clone(),
            None => gpu,
        };
        let mut changed = vec![gpu.clone()];
        if let Some(old) = old
            && old != gpu
        {
            changed.push(old);
        }
        self.claims.insert(claimant.key.clone(), gpu.clone());
        let claimants = self.by_gpu.entry(gpu).or_default();
        let at = claimants.partition_point(|c| *c < claimant);
        claimants.insert(at, claimant);
        claimants.shrink_to_fit();
        changed
    }

    fn release(&mut self, key: &Key) -> Option<Gpu> {
        let gpu = self.claims.remove(key)?;
        if let Some(claimants) = self.by_gpu.get_mut(&gpu) {
            claimants.retain(|c| c.key != *key);
            if claimants.is_empty() {
                self.by_gpu.remove(&gpu);
            }
        }
        Some(gpu)
    }

    fn claimants(&self, gpus: &[Gpu]) -> Vec<ObjectRef<ModelResidency>> {
        gpus.iter()
            .filter_map(|g| self.by_gpu.get(g))
            .flatten()
            .map(Claimant::object_ref)
            .collect()
    }
}

/// The GPU claims of every watched residency.
#[derive(Debug, Default)]
pub struct GpuClaims {
    inner: Mutex<(Index, Option<Index>)>,
}

impl GpuClaims {
    /// Records one watch event. Returns the residencies that share a GPU
    /// with the one it is about (their holder may have changed), to
    /// reconcile. A relist builds a new index and swaps it in when it is
    /// complete, so a reconcile never sees half of the claims.
    pub fn record(&self, event: &watcher::Event<ModelResidency>) -> Vec<ObjectRef<ModelResidency>> {
        let mut guard = self.inner.lock().expect("claims lock");
        let (index, relist) = &mut *guard;
        match event {
            watcher::Event::Init => *relist = Some(Index::default()),
            watcher::Event::InitApply(r) => {
                relist.get_or_insert_with(Index::default).claim(r);
            }
            watcher::Event::InitDone => {
                if let Some(fresh) = relist.take() {
                    *index = fresh;
                }
                // The relist reconciles every residency anyway.
            }
            watcher::Event::Apply(r) => {
                let changed = index.claim(r);
                return index.claimants(&changed);
            }
            watcher::Event::Delete(r) => {
                if let Some(gpu) = index.release(&Claimant::of(r).key) {
                    return index.claimants(&[gpu]);
                }
            }
        }
        Vec::new()
    }

    /// The residency (`namespace/name`) that holds `r`'s GPU, when it is
    /// not `r` itself.
    pub fn holder_other_than(&self, r: &ModelResidency) -> Option<String> {
        let me = Claimant::of(r);
        let guard = self.inner.lock().expect("claims lock");
        let first = guard.0.by_gpu.get(&gpu_of(r)?)?.first()?;
        (*first < me).then(|| format!("{}/{}", first.key.0, first.key.1))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::api::ModelResidencySpec;
    use k8s_openapi::apimachinery::pkg::apis::meta::v1::Time;

    fn residency(ns: &str, name: &str, created: i64, node: &str, device: &str) -> ModelResidency {
        let spec: ModelResidencySpec = serde_json::from_value(serde_json::json!({
            "nodeName": node, "device": device, "budget": "16Gi", "models": [],
            "gpu": {"mode": "env"}
        }))
        .unwrap();
        let mut r = ModelResidency::new(name, spec);
        r.metadata.namespace = Some(ns.into());
        r.metadata.creation_timestamp = Some(Time(Timestamp::from_second(created).unwrap()));
        r
    }

    #[test]
    fn the_oldest_claim_holds_the_gpu_and_ties_go_by_namespace_and_name() {
        let claims = GpuClaims::default();
        let old = residency("b", "gpu", 100, "n1", "0");
        let young = residency("a", "gpu", 200, "n1", "0");
        let tie = residency("a", "zzz", 100, "n1", "0");
        let other_gpu = residency("a", "other", 50, "n1", "1");
        for r in [&young, &old, &tie, &other_gpu] {
            claims.record(&watcher::Event::Apply(r.clone()));
        }
        // Same age: a/zzz goes before b/gpu.
        assert_eq!(claims.holder_other_than(&tie), None);
        assert_eq!(claims.holder_other_than(&old).as_deref(), Some("a/zzz"));
        assert_eq!(claims.holder_other_than(&young).as_deref(), Some("a/zzz"));
        assert_eq!(claims.holder_other_than(&other_gpu), None);
        // The holder goes: the next in line holds it, and both are woken.
        let woken = claims.record(&watcher::Event::Delete(tie.clone()));
        assert_eq!(woken.len(), 2);
        assert_eq!(claims.holder_other_than(&old), None);
        assert_eq!(claims.holder_other_than(&young).as_deref(), Some("b/gpu"));
        // The holder moves to another GPU: the claim it left is released.
        let moved = residency("b", "gpu", 100, "n2", "0");
        claims.record(&watcher::Event::Apply(moved));
        assert_eq!(claims.holder_other_than(&young), None);
    }

    #[test]
    fn residencies_naming_one_claim_are_one_gpu_held_by_the_oldest() {
        let claims = GpuClaims::default();
        let in_claim_mode = |ns: &str, name: &str, created: i64, existing: Option<&str>| {
            let mut r = residency(ns, name, created, "n1", "0");
            r.spec.gpu.mode = crate::api::GpuMode::Claim;
            r.spec.gpu.existing_claim = existing.map(str::to_owned);
            r
        };
        let a = in_claim_mode("t", "a", 100, None);
        // b names a's own claim, c a shared one, d the same in another
        // namespace (claims are namespaced: another claim).
        let a_claim = crate::residency::gpu::claim_of(&a);
        let b = in_claim_mode("t", "b", 200, Some(&a_claim));
        let c = in_claim_mode("t", "c", 300, Some("team-gpu"));
        let d = in_claim_mode("t", "d", 400, Some("team-gpu"));
        let e = in_claim_mode("u", "e", 500, Some("team-gpu"));
        for r in [&a, &b, &c, &d, &e] {
            claims.record(&watcher::Event::Apply(r.clone()));
        }
        assert_eq!(claims.holder_other_than(&a), None);
        assert_eq!(claims.holder_other_than(&b).as_deref(), Some("t/a"));
        assert_eq!(claims.holder_other_than(&c), None);
        assert_eq!(claims.holder_other_than(&d).as_deref(), Some("t/c"));
        assert_eq!(claims.holder_other_than(&e), None);
        // Two residencies with claims of their own share nothing.
        let f = in_claim_mode("t", "f", 50, None);
        claims.record(&watcher::Event::Apply(f.clone()));
        assert_eq!(claims.holder_other_than(&a), None);
    }

    #[test]
    fn a_relist_swaps_in_whole() {
        let claims = GpuClaims::default();
        let a = residency("ns", "a", 1, "n", "0");
        let b = residency("ns", "b", 2, "n", "0");
        claims.record(&watcher::Event::Apply(a.clone()));
        claims.record(&watcher::Event::Apply(b.clone()));
        claims.record(&watcher::Event::Init);
        claims.record(&watcher::Event::InitApply(b.clone()));
        // Mid-relist the old claims still stand.
        assert_eq!(claims.holder_other_than(&b).as_deref(), Some("ns/a"));
        claims.record(&watcher::Event::InitDone);
        assert_eq!(
            claims.holder_other_than(&b),
            None,
            "a was gone in the relist"
        );
    }
}
