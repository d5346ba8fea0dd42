//! What the operator knows of the cluster's DRA objects, kept from two
//! watches: the ResourceClaims in its namespaces (summaries, not whole
//! claims) and the devices every ResourceSlice publishes. A reconcile reads
//! these instead of asking the API server, so a claim that is allocated
//! costs no request per load.

use crate::engine::Bytes;
use crate::residency::devices;
use crate::residency::labels::{CLAIM_DEVICE_ANNOTATION, RESIDENCY_LABEL};
use k8s_openapi::api::resource::v1::{ResourceClaim, ResourceSlice};
use kube::runtime::watcher;
use std::collections::HashMap;
use std::sync::{Arc, Mutex};

/// The attribute domain of the NVIDIA DRA driver (its driver name).
pub const NVIDIA_DRIVER: &str = "gpu.nvidia.com";

/// Where the scheduler allocated a claim.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Allocation {
    /// From the allocation's node selector (`metadata.name In [node]`).
    pub node: Option<String>,
    pub driver: String,
    pub pool: String,
    pub device: String,
}

/// A ResourceClaim, as far as a reconcile needs it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ClaimState {
    pub uid: String,
    /// Uid of the ModelResidency that controls it, if one does.
    pub controller: Option<String>,
    /// The residency label (claims the operator made).
    pub residency: Option<String>,
    pub deleting: bool,
    /// What the operator asked for when it made it (annotation).
    pub wants: Option<String>,
    pub allocation: Option<Allocation>,
    /// Names of the pods it is reserved for.
    pub reserved_for: Vec<String>,
}

impl ClaimState {
    pub fn of(c: &ResourceClaim) -> Self {
        let meta = &c.metadata;
        let status = c.status.as_ref();
        let allocation = status.and_then(|s| s.allocation.as_ref()).and_then(|a| {
            let result = a.devices.as_ref()?.results.as_ref()?.first()?;
            let node = a
                .node_selector
                .iter()
                .flat_map(|s| s.node_selector_terms.iter())
                .flat_map(|t| t.match_fields.iter().flatten())
                .find(|f| f.key == "metadata.name" && f.operator == "In")
                .and_then(|f| f.values.as_ref()?.first().cloned());
            Some(Allocation {
                node,
                driver: result.driver.clone(),
                pool: result.pool.clone(),
                device: result.device.clone(),
            })
        });
        ClaimState {
            uid: meta.uid.clone().unwrap_or_default(),
            controller: meta
                .owner_references
                .iter()
                .flatten()
                .find(|o| o.controller == Some(true) && o.kind == "ModelResidency")
                .map(|o| o.uid.clone()),
            residency: meta
                .labels
                .as_ref()
                .and_then(|l| l.get(RESIDENCY_LABEL))
                .cloned(),
            deleting: meta.deletion_timestamp.is_some(),
            wants: meta
                .annotations
                .as_ref()
                .and_then(|a| a.get(CLAIM_DEVICE_ANNOTATION))
                .cloned(),
            allocation,
            reserved_for: status
                .and_then(|s| s.reserved_for.as_ref())
                .into_iter()
                .flatten()
                .filter(|r| r.resource == "pods")
                .map(|r| r.name.clone())
                .collect(),
        }
    }
}

/// A published device.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Device {
    pub driver: String,
    pub pool: String,
    pub name: String,
    pub node: Option<String>,
    pub uuid: Option<String>,
    pub index: Option<i64>,
    pub product: Option<String>,
    pub memory: Option<Bytes>,
    /// Its PCIe root ([`PCIE_ROOT_ATTRIBUTE`]), when the driver publishes
    /// it: a gang's GPUs share one.
    pub pcie_root: Option<String>,
    pub taints: Vec<crate::residency::health::Taint>,
}

/// The standard DRA attribute for a device's PCIe root complex: devices
/// under one root communicate with the lowest latency, so a gang (a model
/// spanning several GPUs) is placed on GPUs that share it, where the
/// driver publishes it.
pub const PCIE_ROOT_ATTRIBUTE: &str = "resource.kubernetes.io/pcieRoot";

impl Device {
    /// Whether this is the device spec.device names (its index or uuid).
    pub fn is(&self, device: &str) -> bool {
        match device.parse::<i64>() {
            Ok(i) => self.index == Some(i),
            Err(_) => self.uuid.as_deref() == Some(device),
        }
    }

    /// What a reconcile reads of a published device.
    fn of(d: &devices::Device) -> Device {
        let string = |name: &str| {
            d.attributes
                .get(name)
                .and_then(|v| v.as_str())
                .map(str::to_owned)
        };
        Device {
            driver: d.driver.clone(),
            pool: d.pool.clone(),
            name: d.name.clone(),
            node: Some(d.node.clone()).filter(|n| !n.is_empty()),
            uuid: string("uuid"),
            index: d.attributes.get("index").and_then(|v| v.as_i64()),
            product: string("productName"),
            pcie_root: string(PCIE_ROOT_ATTRIBUTE),
            memory: d.memory(),
            taints: d.taints.to_vec(),
        }
    }
}

/// The devices one ResourceSlice publishes, as a reconcile reads them.
pub fn devices_of(slice: &ResourceSlice) -> Vec<Device> {
    devices::slice_devices(slice)
        .iter()
        .map(|d| Device::of(d))
        .collect()
}

type Key = (String, String);

#[derive(Default)]
struct Inner {
    /// (namespace, name) -> claim.
    claims: HashMap<Key, ClaimState>,
    /// Slice name -> its devices, as they are decoded once for every
    /// reader (`devices::slice_devices`).
    slices: HashMap<String, Vec<Arc<devices::Device>>>,
    /// The slices with a tainted device: every reconcile asks its GPU's
    /// health, and most fleets have none.
    tainted: std::collections::HashSet<String>,
    /// The cordoned nodes (spec.unschedulable), from their own watch.
    cordoned: std::collections::HashSet<String>,
}

/// The claims and devices, as the watches last reported them.
#[derive(Default)]
pub struct GpuInventory {
    inner: Mutex<Inner>,
    /// Whether the operator can read resource.k8s.io/v1 claims (set at
    /// start), and if not why.
    served: std::sync::atomic::AtomicBool,
    unserved: Mutex<Option<String>>,
    /// Whether the claims' and the slices' watches have made their first
    /// list: until then a claim not in the cache may well exist (a
    /// restarted operator found none, made it again, got a conflict, and
    /// unloaded every model as if its claim were new).
    listed: tokio::sync::watch::Sender<(bool, bool)>,
}

impl GpuInventory {
    pub fn set_served(&self, served: bool) {
        self.served
            .store(served, std::sync::atomic::Ordering::SeqCst);
    }

    /// The claims cannot be read: `why`, for the residencies' condition.
    pub fn set_unserved(&self, why: String) {
        self.set_served(false);
        *self.unserved.lock().expect("gpu inventory lock") = Some(why);
    }

    /// Why claims cannot be read, when that was found at start.
    pub fn unserved(&self) -> Option<String> {
        self.unserved.lock().expect("gpu inventory lock").clone()
    }

    pub fn served(&self) -> bool {
        self.served.load(std::sync::atomic::Ordering::SeqCst)
    }

    /// Records a claim watch event; returns the claim it was about
    /// (namespace, name, residency label) to wake whoever uses it.
    pub fn record_claim(
        &self,
        event: &watcher::Event<ResourceClaim>,
    ) -> Vec<(String, String, Option<String>)> {
        let mut inner = self.inner.lock().expect("gpu inventory lock");
        let key = |c: &ResourceClaim| {
            (
                c.metadata.namespace.clone().unwrap_or_default(),
                c.metadata.name.clone().unwrap_or_default(),
            )
        };
        match event {
            watcher::Event::Apply(c) | watcher::Event::InitApply(c) => {
                let (ns, name) = key(c);
                let state = ClaimState::of(c);
                let label = state.residency.clone();
                inner.claims.insert((ns.clone(), name.clone()), state);
                vec![(ns, name, label)]
            }
            watcher::Event::Delete(c) => {
                let (ns, name) = key(c);
                let label = inner
                    .claims
                    .remove(&(ns.clone(), name.clone()))
                    .and_then(|s| s.residency);
                vec![(ns, name, label)]
            }
            // A relist re-applies every claim; stale ones are few and are
            // found again as missing when their residency next asks.
            watcher::Event::Init => Vec::new(),
            watcher::Event::InitDone => {
                drop(inner);
                self.listed.send_modify(|l| l.0 = true);
                Vec::new()
            }
        }
    }

    /// Records a slice watch event.
    pub fn record_slice(&self, event: &watcher::Event<ResourceSlice>) {
        let mut inner = self.inner.lock().expect("gpu inventory lock");
        match event {
            watcher::Event::Apply(s) | watcher::Event::InitApply(s) => {
                let name = s.metadata.name.clone().unwrap_or_default();
                let devices = devices::slice_devices(s);
                if devices.iter().any(|d| !d.taints.is_empty()) {
                    inner.tainted.insert(name.clone());
                } else {
                    inner.tainted.remove(&name);
                }
                inner.slices.insert(name, devices);
            }
            watcher::Event::Delete(s) => {
                let name = s.metadata.name.as_deref().unwrap_or_default();
                inner.slices.remove(name);
                inner.tainted.remove(name);
            }
            watcher::Event::Init => {}
            watcher::Event::InitDone => {
                drop(inner);
                self.listed.send_modify(|l| l.1 = true);
            }
        }
    }

    /// Waits until the claims and the slices are listed.
    pub async fn wait_listed(&self) {
        let mut rx = self.listed.subscribe();
        let _ = rx.wait_for(|(claims, slices)| *claims && *slices).await;
    }

    pub fn claim(&self, namespace: &str, name: &str) -> Option<ClaimState> {
        let inner = self.inner.lock().expect("gpu inventory lock");
        inner
            .claims
            .get(&(namespace.to_owned(), name.to_owned()))
            .cloned()
    }

    /// The claim as the API server answered a write (the watch may lag).
    pub fn wrote_claim(&self, c: &ResourceClaim) {
        let mut inner = self.inner.lock().expect("gpu inventory lock");
        let key = (
            c.metadata.namespace.clone().unwrap_or_default(),
            c.metadata.name.clone().unwrap_or_default(),
        );
        inner.claims.insert(key, ClaimState::of(c));
    }

    /// The allocated device: a lookup that copies no other device (every
    /// reconcile of an allocated claim reads it).
    pub fn device(&self, a: &Allocation) -> Option<Device> {
        let inner = self.inner.lock().expect("gpu inventory lock");
        inner
            .slices
            .values()
            .flatten()
            .find(|d| d.driver == a.driver && d.pool == a.pool && d.name == a.device)
            .map(|d| Device::of(d))
    }

    /// The device `name` published for `node`.
    pub fn device_on(&self, node: &str, name: &str) -> Option<Device> {
        let inner = self.inner.lock().expect("gpu inventory lock");
        inner
            .slices
            .values()
            .flatten()
            .find(|d| d.node == node && d.name == name)
            .map(|d| Device::of(d))
    }

    /// The health of GPU `device` (spec.device: an index or uuid) of
    /// `node`: its published device's taints and the node's cordon. A
    /// device not published (env and devicePlugin mode without DRA) has
    /// none.
    pub fn health(&self, node: &str, device: &str) -> crate::residency::health::GpuHealth {
        let inner = self.inner.lock().expect("gpu inventory lock");
        let taints = inner
            .tainted
            .iter()
            .filter_map(|name| inner.slices.get(name))
            .flatten()
            .filter(|d| d.node == node && !d.taints.is_empty())
            .map(|d| Device::of(d))
            .find(|d| d.is(device))
            .map(|d| d.taints)
            .unwrap_or_default();
        let cordoned = inner.cordoned.contains(node).then_some(node);
        crate::residency::health::GpuHealth::of(&taints, cordoned)
    }

    /// Whether any published device is tainted or any node cordoned: when
    /// none is, no GPU has anything to move off.
    pub fn any_unhealthy(&self) -> bool {
        let inner = self.inner.lock().expect("gpu inventory lock");
        !inner.tainted.is_empty() || !inner.cordoned.is_empty()
    }

    /// Records a watch event of cordoned nodes; returns the nodes whose
    /// cordon changed.
    pub fn record_cordon(
        &self,
        event: &kube::runtime::watcher::Event<
            kube::api::PartialObjectMeta<k8s_openapi::api::core::v1::Node>,
        >,
    ) -> Vec<String> {
        use kube::runtime::watcher::Event;
        let mut inner = self.inner.lock().expect("gpu inventory lock");
        let name =
            |n: &kube::api::PartialObjectMeta<_>| n.metadata.name.clone().unwrap_or_default();
        match event {
            Event::Apply(n) | Event::InitApply(n) => {
                let node = name(n);
                inner
                    .cordoned
                    .insert(node.clone())
                    .then_some(node)
                    .into_iter()
                    .collect()
            }
            Event::Delete(n) => {
                let node = name(n);
                inner
                    .cordoned
                    .remove(&node)
                    .then_some(node)
                    .into_iter()
                    .collect()
            }
            Event::Init => {
                // A relist: what is cordoned is what it brings.
                std::mem::take(&mut inner.cordoned).into_iter().collect()
            }
            Event::InitDone => Vec::new(),
        }
    }

    /// The devices published for `node` (shared, not copied).
    pub fn node_devices(&self, node: &str) -> Vec<Arc<devices::Device>> {
        let inner = self.inner.lock().expect("gpu inventory lock");
        inner
            .slices
            .values()
            .flatten()
            .filter(|d| d.node == node)
            .cloned()
            .collect()
    }

    /// Every published device, by node and name.
    pub fn devices(&self) -> Vec<Device> {
        let inner = self.inner.lock().expect("gpu inventory lock");
        let mut all: Vec<Device> = inner
            .slices
            .values()
            .flatten()
            .map(|d| Device::of(d))
            .collect();
        all.sort_by(|a, b| (&a.node, &a.name).cmp(&(&b.node, &b.name)));
        all
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn a_claim_summary_reads_the_allocation_and_its_consumers() {
        let c: ResourceClaim = serde_json::from_value(json!({
            "metadata": {"name": "gpu-gpu", "namespace": "ns", "uid": "c1",
                "labels": {RESIDENCY_LABEL: "gpu"},
                "ownerReferences": [{"apiVersion": "residency.dev/v1alpha1", "kind": "ModelResidency",
                    "name": "gpu", "uid": "r1", "controller": true}]},
            "spec": {"devices": {"requests": []}},
            "status": {
                "allocation": {
                    "devices": {"results": [{"request": "gpu", "driver": "gpu.nvidia.com", "pool": "node-a", "device": "gpu-1"}]},
                    "nodeSelector": {"nodeSelectorTerms": [{"matchFields": [
                        {"key": "metadata.name", "operator": "In", "values": ["node-a"]}]}]},
                },
                "reservedFor": [{"resource": "pods", "name": "gpu-gpu-holder", "uid": "p1"}],
            },
        }))
        .unwrap();
        let s = ClaimState::of(&c);
        assert_eq!(s.controller.as_deref(), Some("r1"));
        assert_eq!(s.residency.as_deref(), Some("gpu"));
        let a = s.allocation.unwrap();
        assert_eq!(
            (a.node.as_deref(), a.pool.as_str(), a.device.as_str()),
            (Some("node-a"), "node-a", "gpu-1")
        );
        assert_eq!(s.reserved_for, ["gpu-gpu-holder"]);
    }

    #[test]
    fn devices_are_read_from_slices_by_index_and_uuid() {
        let slice: ResourceSlice = serde_json::from_value(json!({
            "metadata": {"name": "node-a-gpu"},
            "spec": {"driver": "gpu.nvidia.com", "nodeName": "node-a",
                "pool": {"name": "node-a", "generation": 1, "resourceSliceCount": 1},
                "devices": [{"name": "gpu-0",
                    "attributes": {"index": {"int": 0}, "uuid": {"string": "GPU-aa"}, "productName": {"string": "H100"}},
                    "capacity": {"memory": {"value": "80Gi"}}}]},
        }))
        .unwrap();
        let inv = GpuInventory::default();
        inv.record_slice(&watcher::Event::Apply(slice));
        let d = &inv.devices()[0];
        assert_eq!(d.memory, Some(80 << 30));
        assert!(d.is("0") && d.is("GPU-aa") && !d.is("1") && !d.is("GPU-bb"));
        assert_eq!(d.node.as_deref(), Some("node-a"));
    }
}
