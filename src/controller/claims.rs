//! Who holds each GPU. Residencies that name one physical GPU describe one
//! budget: only one of them may use it. The oldest holds it (creation
//! time, then namespace/name); the others load nothing until it goes away
//! or moves. One GPU has several names: its index and its uuid (spec.device
//! in devicePlugin and env mode), its device name in its ResourceSlice
//! (where a claim was allocated), and a ResourceClaim that two residencies
//! share; names on one node are the same GPU when the node's published
//! devices say so ([`same_device`]), whatever the mode or namespace. Fed
//! from the residency watch, so every reconcile sees every claim the
//! operator watches.

use crate::api::{GpuMode, GpuStatus, ModelResidency};
use crate::residency::devices::Device;
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
    /// How it names the GPU on its node (an index, a uuid or a device
    /// name); empty in a claim's list.
    device: Box<str>,
    /// Deleted, its pods not all gone yet: it holds the GPU until they are
    /// (a terminating pod holds its VRAM).
    leaving: bool,
}

impl Claimant {
    fn of(r: &ModelResidency, device: &str) -> Self {
        Claimant {
            // A residency always has one once stored; none sorts first.
            created: r.metadata.creation_timestamp.as_ref().map(|t| t.0),
            key: Arc::new((
                r.namespace().unwrap_or_default().into(),
                r.name_any().into(),
            )),
            device: device.into(),
            leaving: false,
        }
    }

    fn object_ref(&self) -> ObjectRef<ModelResidency> {
        ObjectRef::new(&self.key.1).within(&self.key.0)
    }

    fn name(&self) -> String {
        format!("{}/{}", self.key.0, self.key.1)
    }
}

/// Where a residency uses a GPU: its node and the device as it names it.
/// In devicePlugin and env mode, what the spec declares; in claim mode,
/// where its claim was allocated (a claim not allocated uses no GPU: the
/// scheduler keeps it from one another claim holds).
pub fn uses(r: &ModelResidency) -> Option<(&str, &str)> {
    match r.spec.gpu.mode {
        GpuMode::Claim => r.status.as_ref()?.gpu.as_deref().and_then(allocated),
        _ => Some((r.spec.node_name.as_deref()?, r.spec.device.as_str())),
    }
}

/// The node and device a GPU status names (claim mode: once allocated).
pub fn allocated(g: &GpuStatus) -> Option<(&str, &str)> {
    Some((g.node.as_deref()?, g.device.as_deref()?))
}

/// The claim a claim-mode residency shares with whoever names it too
/// (spec.gpu.existingClaim, or another's own claim): claims are
/// namespaced.
fn claim_key(r: &ModelResidency) -> Option<Key> {
    (r.spec.gpu.mode == GpuMode::Claim).then(|| {
        Arc::new((
            r.namespace().unwrap_or_default().into(),
            crate::residency::gpu::claim_of(r).into(),
        ))
    })
}

/// Whether `name` is how one would name device `d`: its index (digits),
/// its uuid attribute, or its name in the slice.
pub fn device_is(d: &Device, name: &str) -> bool {
    if !name.is_empty() && name.bytes().all(|b| b.is_ascii_digit()) {
        return d
            .attributes
            .get("index")
            .and_then(|v| v.as_i64())
            .is_some_and(|i| i.to_string() == name);
    }
    d.name == name || d.attributes.get("uuid").and_then(|v| v.as_str()) == Some(name)
}

/// Whether `a` and `b` name one GPU among a node's published devices: the
/// same text, or the same device by index, uuid or name. Without the
/// node's devices only the same text is known to be one GPU.
pub fn same_device(node_devices: &[Arc<Device>], a: &str, b: &str) -> bool {
    if a == b {
        return true;
    }
    let find = |n: &str| node_devices.iter().position(|d| device_is(d, n));
    find(a).is_some_and(|i| find(b) == Some(i))
}

/// Kept small (measured by `cargo bench --bench heap`): the claimants in
/// sorted vectors (a node has a few GPUs, a claim almost always one)
/// rather than B-trees, whose first node alone is most of a kilobyte.
#[derive(Debug, Default)]
struct Index {
    /// Node -> every residency using a GPU of it, with the device's name.
    on_node: HashMap<Box<str>, Vec<Claimant>>,
    /// Shared claim -> the residencies naming it (claim mode).
    on_claim: HashMap<Key, Vec<Claimant>>,
    /// Each residency's current node and claim, to find its entries again
    /// when it moves.
    claims: HashMap<Key, (Option<Box<str>>, Option<Key>)>,
    /// The deleted residencies still held as claimants ([`Index::leave`]):
    /// few, so each look checks these and never scans every claim.
    leaving: Vec<Key>,
}

fn insert(list: &mut Vec<Claimant>, c: Claimant) {
    let at = list.partition_point(|x| *x < c);
    list.insert(at, c);
    list.shrink_to_fit();
}

fn remove<K: std::hash::Hash + Eq>(map: &mut HashMap<K, Vec<Claimant>>, at: &K, key: &Key) {
    if let Some(list) = map.get_mut(at) {
        list.retain(|c| c.key != *key);
        if list.is_empty() {
            map.remove(at);
        }
    }
}

/// What changed for a watch event: the node and claim whose claimants
/// are to be woken.
type Touched = (Vec<Box<str>>, Vec<Key>);

impl Index {
    /// Records a residency's claim; returns where its claimants changed.
    fn claim(&mut self, r: &ModelResidency) -> Touched {
        let key = Claimant::of(r, "").key;
        let (mut nodes, mut claims) = self.release(&key);
        let node = uses(r).map(|(node, device)| {
            let mut c = Claimant::of(r, device);
            c.key = key.clone();
            let node: Box<str> = node.into();
            insert(self.on_node.entry(node.clone()).or_default(), c);
            node
        });
        let claim = claim_key(r).inspect(|claim| {
            let mut c = Claimant::of(r, "");
            c.key = key.clone();
            insert(self.on_claim.entry(claim.clone()).or_default(), c);
        });
        nodes.extend(node.clone());
        claims.extend(claim.clone());
        self.claims.insert(key, (node, claim));
        (nodes, claims)
    }

    /// A deleted residency: kept as its GPU's claimant, leaving, until its
    /// pods are gone ([`GpuClaims::holder_other_than`] drops it then).
    fn leave(&mut self, key: &Key) -> Touched {
        let Some((node, claim)) = self.claims.get(key).cloned() else {
            return Default::default();
        };
        let mark = |list: Option<&mut Vec<Claimant>>| {
            for c in list.into_iter().flatten().filter(|c| c.key == *key) {
                c.leaving = true;
            }
        };
        if let Some(n) = &node {
            mark(self.on_node.get_mut(n));
        }
        if let Some(c) = &claim {
            mark(self.on_claim.get_mut(c));
        }
        if !self.leaving.contains(key) {
            self.leaving.push(key.clone());
        }
        (node.into_iter().collect(), claim.into_iter().collect())
    }

    fn release(&mut self, key: &Key) -> Touched {
        self.leaving.retain(|k| k != key);
        let Some((node, claim)) = self.claims.remove(key) else {
            return Default::default();
        };
        if let Some(node) = &node {
            remove(&mut self.on_node, node, key);
        }
        if let Some(claim) = &claim {
            remove(&mut self.on_claim, claim, key);
        }
        (node.into_iter().collect(), claim.into_iter().collect())
    }

    fn claimants(&self, (nodes, claims): &Touched) -> Vec<ObjectRef<ModelResidency>> {
        let mut out: Vec<_> = nodes
            .iter()
            .filter_map(|n| self.on_node.get(n))
            .chain(claims.iter().filter_map(|c| self.on_claim.get(c)))
            .flatten()
            .map(Claimant::object_ref)
            .collect();
        out.sort_by(|a, b| (&a.namespace, &a.name).cmp(&(&b.namespace, &b.name)));
        out.dedup();
        out
    }
}

/// The GPU claims of every watched residency.
#[derive(Debug, Default)]
pub struct GpuClaims {
    inner: Mutex<(Index, Option<Index>)>,
}

impl GpuClaims {
    /// Records one watch event. Returns the residencies that share a node
    /// or a claim with the one it is about (a GPU's holder may have
    /// changed), to reconcile. A relist builds a new index and swaps it in
    /// when it is complete, so a reconcile never sees half of the claims.
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
                let touched = index.claim(r);
                return index.claimants(&touched);
            }
            watcher::Event::Delete(r) => {
                let touched = index.leave(&Claimant::of(r, "").key);
                return index.claimants(&touched);
            }
        }
        Vec::new()
    }

    /// The residency that holds the GPU `r` would use, when it is not `r`
    /// itself: the oldest of those using the same GPU (`at`: its node and
    /// device as `r` names it now, `None` when it uses none yet) or naming
    /// the same claim, a deleted one included while `pods_left` says it
    /// has pods (they hold their VRAM until they are gone). `node_devices`
    /// gives a node's published devices, which say which names are one GPU.
    pub fn holder_other_than(
        &self,
        r: &ModelResidency,
        at: Option<(&str, &str)>,
        node_devices: impl FnOnce(&str) -> Vec<Arc<Device>>,
        pods_left: impl Fn(&str, &str) -> bool,
    ) -> Option<Holder> {
        let me = Claimant::of(r, "");
        let mut guard = self.inner.lock().expect("claims lock");
        let index = &mut guard.0;
        // Deleted residencies whose pods are all gone hold nothing.
        let gone: Vec<Key> = index
            .leaving
            .iter()
            .filter(|k| !pods_left(&k.0, &k.1))
            .cloned()
            .collect();
        for k in &gone {
            index.release(k);
        }
        let by_claim = claim_key(r)
            .and_then(|c| index.on_claim.get(&c))
            .and_then(|list| list.first());
        let by_device = at.and_then(|(node, device)| {
            let list = index.on_node.get(node)?;
            // Most nodes' residencies all name their GPUs alike: the
            // devices are read only when names differ.
            let mut devices = None;
            let mut node_devices = Some(node_devices);
            list.iter().find(|c| {
                *c.device == *device || {
                    let d = devices.get_or_insert_with(|| {
                        node_devices.take().map(|f| f(node)).unwrap_or_default()
                    });
                    same_device(d, &c.device, device)
                }
            })
        });
        let first = [by_claim, by_device].into_iter().flatten().min()?;
        let ahead = first.leaving || (first.created, &first.key) < (me.created, &me.key);
        (ahead && first.key != me.key).then(|| Holder {
            name: first.name(),
            leaving: first.leaving,
        })
    }
}

/// Who holds a GPU another residency would use.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Holder {
    /// `namespace/name`.
    pub name: String,
    /// Deleted, its pods still terminating.
    pub leaving: bool,
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

    /// A claim-mode residency; `allocated` is the device its status says
    /// its claim was given on node n1.
    fn in_claim_mode(
        ns: &str,
        name: &str,
        created: i64,
        existing: Option<&str>,
        allocated: Option<&str>,
    ) -> ModelResidency {
        let mut r = residency(ns, name, created, "n1", "0");
        r.spec.gpu.mode = GpuMode::Claim;
        r.spec.gpu.existing_claim = existing.map(str::to_owned);
        if let Some(device) = allocated {
            r.status = Some(crate::api::ModelResidencyStatus {
                gpu: Some(Box::new(GpuStatus {
                    mode: GpuMode::Claim,
                    node: Some("n1".into()),
                    device: Some(device.into()),
                    ..GpuStatus::default()
                })),
                ..Default::default()
            });
        }
        r
    }

    /// Node n1's devices as a DRA driver publishes them: gpu-i, index i,
    /// uuid GPU-i.
    fn n1_devices(_: &str) -> Vec<Arc<Device>> {
        let slice: k8s_openapi::api::resource::v1::ResourceSlice =
            serde_json::from_value(serde_json::json!({
                "metadata": {"name": "n1-gpu"},
                "spec": {"driver": "gpu.nvidia.com", "nodeName": "n1",
                    "pool": {"name": "n1", "generation": 1, "resourceSliceCount": 1},
                    "devices": (0..4).map(|i| serde_json::json!({"name": format!("gpu-{i}"),
                        "attributes": {"index": {"int": i}, "uuid": {"string": format!("GPU-{i}")}}}))
                        .collect::<Vec<_>>()}
            }))
            .unwrap();
        crate::residency::devices::slice_devices(&slice)
    }

    fn holder(claims: &GpuClaims, r: &ModelResidency) -> Option<String> {
        let at = match r.spec.gpu.mode {
            GpuMode::Claim => r
                .status
                .as_ref()
                .and_then(|s| s.gpu.as_deref())
                .and_then(allocated),
            _ => uses(r),
        };
        claims
            .holder_other_than(r, at, n1_devices, |_, _| false)
            .map(|h| h.name)
    }

    fn apply(claims: &GpuClaims, rs: &[&ModelResidency]) {
        for r in rs {
            claims.record(&watcher::Event::Apply((*r).clone()));
        }
    }

    #[test]
    fn the_oldest_claim_holds_the_gpu_and_ties_go_by_namespace_and_name() {
        let claims = GpuClaims::default();
        let old = residency("b", "gpu", 100, "n1", "0");
        let young = residency("a", "gpu", 200, "n1", "0");
        let tie = residency("a", "zzz", 100, "n1", "0");
        let other_gpu = residency("a", "other", 50, "n1", "1");
        apply(&claims, &[&young, &old, &tie, &other_gpu]);
        // Same age: a/zzz goes before b/gpu.
        assert_eq!(holder(&claims, &tie), None);
        assert_eq!(holder(&claims, &old).as_deref(), Some("a/zzz"));
        assert_eq!(holder(&claims, &young).as_deref(), Some("a/zzz"));
        assert_eq!(holder(&claims, &other_gpu), None);
        // The holder goes: the next in line holds it, and the node's
        // residencies are woken.
        let woken = claims.record(&watcher::Event::Delete(tie.clone()));
        assert_eq!(woken.len(), 4);
        assert_eq!(holder(&claims, &old), None);
        assert_eq!(holder(&claims, &young).as_deref(), Some("b/gpu"));
        // The holder moves to another GPU: the claim it left is released.
        let moved = residency("b", "gpu", 100, "n2", "0");
        claims.record(&watcher::Event::Apply(moved));
        assert_eq!(holder(&claims, &young), None);
    }

    /// The black-box round's finding: one 80Gi GPU taken by three
    /// residencies in three namespaces, by index in env mode, by uuid in
    /// env mode and by index in claim mode (allocated as gpu-2), each with
    /// a budget of its own.
    #[test]
    fn one_gpu_named_by_index_uuid_or_allocation_is_one_budget_in_any_namespace() {
        let claims = GpuClaims::default();
        let by_index = residency("t1", "a", 100, "n1", "2");
        let by_uuid = residency("t2", "b", 200, "n1", "GPU-2");
        let by_claim = in_claim_mode("t3", "c", 300, None, Some("gpu-2"));
        let elsewhere = residency("t4", "d", 50, "n1", "GPU-3");
        apply(&claims, &[&by_claim, &by_uuid, &by_index, &elsewhere]);
        assert_eq!(holder(&claims, &by_index), None);
        assert_eq!(holder(&claims, &by_uuid).as_deref(), Some("t1/a"));
        assert_eq!(holder(&claims, &by_claim).as_deref(), Some("t1/a"));
        assert_eq!(holder(&claims, &elsewhere), None);
        // The oldest goes: the uuid's holds it, the claim's still waits.
        claims.record(&watcher::Event::Delete(by_index));
        assert_eq!(holder(&claims, &by_uuid), None);
        assert_eq!(holder(&claims, &by_claim).as_deref(), Some("t2/b"));
        // The claim holds it when it is the oldest.
        let older_claim = in_claim_mode("t5", "e", 10, None, Some("gpu-2"));
        apply(&claims, &[&older_claim]);
        assert_eq!(holder(&claims, &by_uuid).as_deref(), Some("t5/e"));
        // Without the node's devices, an index and a uuid are not known to
        // be one GPU (nothing says so).
        assert_eq!(
            claims.holder_other_than(&by_uuid, uses(&by_uuid), |_| Vec::new(), |_, _| false),
            None
        );
    }

    /// A deleted holder's pods still terminate (they hold their VRAM): the
    /// next in line waits for them.
    #[test]
    fn a_deleted_holder_holds_its_gpu_until_its_pods_are_gone() {
        let claims = GpuClaims::default();
        let old = residency("t1", "old", 1, "n1", "2");
        let next = residency("t2", "next", 2, "n1", "GPU-2");
        apply(&claims, &[&old, &next]);
        claims.record(&watcher::Event::Delete(old.clone()));
        let at = uses(&next);
        let held = claims.holder_other_than(&next, at, n1_devices, |_, _| true);
        assert_eq!(
            held,
            Some(Holder {
                name: "t1/old".into(),
                leaving: true
            })
        );
        // Its pods are gone: the next holds it, and the old is forgotten.
        assert_eq!(
            claims.holder_other_than(&next, at, n1_devices, |_, _| false),
            None
        );
        assert_eq!(
            claims.holder_other_than(&next, at, n1_devices, |_, _| true),
            None
        );
    }

    #[test]
    fn a_claim_not_allocated_holds_no_gpu_by_its_device() {
        let claims = GpuClaims::default();
        // Older, but its claim is not allocated: it uses no GPU, so a
        // younger env-mode residency on gpu-0 is not held off by it (else
        // neither would ever load).
        let pending = in_claim_mode("t", "pending", 1, None, None);
        let env = residency("u", "env", 2, "n1", "0");
        apply(&claims, &[&pending, &env]);
        assert_eq!(holder(&claims, &env), None);
    }

    #[test]
    fn residencies_naming_one_claim_are_one_gpu_held_by_the_oldest() {
        let claims = GpuClaims::default();
        let a = in_claim_mode("t", "a", 100, None, None);
        // b names a's own claim, c a shared one, d the same in another
        // namespace (claims are namespaced: another claim).
        let a_claim = crate::residency::gpu::claim_of(&a);
        let b = in_claim_mode("t", "b", 200, Some(&a_claim), None);
        let c = in_claim_mode("t", "c", 300, Some("team-gpu"), None);
        let d = in_claim_mode("t", "d", 400, Some("team-gpu"), None);
        let e = in_claim_mode("u", "e", 500, Some("team-gpu"), None);
        apply(&claims, &[&a, &b, &c, &d, &e]);
        assert_eq!(holder(&claims, &a), None);
        assert_eq!(holder(&claims, &b).as_deref(), Some("t/a"));
        assert_eq!(holder(&claims, &c), None);
        assert_eq!(holder(&claims, &d).as_deref(), Some("t/c"));
        assert_eq!(holder(&claims, &e), None);
        // Two residencies with claims of their own share nothing.
        let f = in_claim_mode("t", "f", 50, None, None);
        apply(&claims, &[&f]);
        assert_eq!(holder(&claims, &a), None);
    }

    #[test]
    fn a_relist_swaps_in_whole() {
        let claims = GpuClaims::default();
        let a = residency("ns", "a", 1, "n", "0");
        let b = residency("ns", "b", 2, "n", "0");
        apply(&claims, &[&a, &b]);
        claims.record(&watcher::Event::Init);
        claims.record(&watcher::Event::InitApply(b.clone()));
        // Mid-relist the old claims still stand.
        assert_eq!(holder(&claims, &b).as_deref(), Some("ns/a"));
        claims.record(&watcher::Event::InitDone);
        assert_eq!(holder(&claims, &b), None, "a was gone in the relist");
    }
}
