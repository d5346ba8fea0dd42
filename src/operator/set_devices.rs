//! Which of a ResidencySet's selected devices are its own, pure: a device
//! another, older residency names is held (one GPU, one budget: the oldest
//! holds it), and the stamp's name, hashed when another residency has it.

use crate::api::ModelResidency;
use crate::controller::claims::{device_is, uses};
use crate::residency::devices::{Device, stamped_name, stamped_name_hashed};
use kube::ResourceExt;
use std::sync::Arc;

/// The name of set `set`'s residency for device `d` (`ours` when it has
/// one), or why the device is not the set's: another residency, older than
/// the set's own, names it (one GPU, one budget: the oldest holds it,
/// whatever its namespace, mode or set; a younger one waits, and the set
/// keeps what it stamped first). A stamp's name that another residency has
/// taken (one made by hand, or another set's: `s-node` on node `e` and `s`
/// on node `node-e` both stamp `s-node-e-...`) does not make the device
/// held: the stamp takes a name with a hash of set, node and device.
pub(super) fn claim_device(
    all: &[Arc<ModelResidency>],
    set_uid: &str,
    ns: &str,
    set: &str,
    d: &Device,
    ours: Option<&Arc<ModelResidency>>,
) -> Result<String, String> {
    let not_ours =
        |r: &&Arc<ModelResidency>| !r.owner_references().iter().any(|o| o.uid == set_uid);
    let age = |r: &ModelResidency| {
        (
            r.metadata.creation_timestamp.as_ref().map(|t| t.0),
            r.namespace(),
            r.name_any(),
        )
    };
    let holder = all
        .iter()
        .filter(not_ours)
        .filter(|r| holds(r, d))
        .min_by_key(|r| age(r))
        .filter(|h| ours.is_none_or(|o| age(h) < age(o)));
    if let Some(h) = holder {
        return Err(format!(
            "{}/{}: held by ModelResidency {}/{}",
            d.node,
            d.name,
            h.namespace().unwrap_or_default(),
            h.name_any()
        ));
    }
    if let Some(o) = ours {
        return Ok(o.name_any());
    }
    let taken = |n: &str| {
        all.iter()
            .any(|r| r.namespace().as_deref() == Some(ns) && r.name_any() == n)
    };
    let plain = stamped_name(set, &d.node, &d.name);
    if !taken(&plain) {
        return Ok(plain);
    }
    let hashed = stamped_name_hashed(set, &d.node, &d.name);
    if !taken(&hashed) {
        return Ok(hashed);
    }
    Err(format!(
        "{}/{}: the names {plain} and {hashed} are taken by residencies that are not this set's",
        d.node, d.name
    ))
}

/// Whether `r` (the set's own) was stamped for device `d`: its node, and
/// the device as the stamp names it.
pub(super) fn stamped_for(r: &ModelResidency, d: &Device) -> bool {
    r.spec.node_name.as_deref() == Some(d.node.as_str())
        && Some(&r.spec.device) == d.spec_device().as_ref()
}

/// Whether residency `r` names device `d`: by its spec (its node and the
/// device's index, uuid or name), or where its claim was allocated.
fn holds(r: &ModelResidency, d: &Device) -> bool {
    let names = |(node, device): (&str, &str)| node == d.node && device_is(d, device);
    let by_spec = r
        .spec
        .node_name
        .as_deref()
        .is_some_and(|node| names((node, &r.spec.device)));
    by_spec || uses(r).is_some_and(names)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::residency::devices::slice_devices;
    use k8s_openapi::api::resource::v1::ResourceSlice;
    use k8s_openapi::jiff::Timestamp;
    use serde_json::json;

    /// Node node-e's GPU 4, as the NVIDIA DRA driver publishes it.
    fn gpu_4() -> Arc<Device> {
        let slice: ResourceSlice = serde_json::from_value(json!({
            "metadata": {"name": "node-e-gpu"},
            "spec": {"driver": "gpu.nvidia.com", "nodeName": "node-e",
                "pool": {"name": "node-e", "generation": 1, "resourceSliceCount": 1},
                "devices": [{"name": "gpu-4",
                    "attributes": {"index": {"int": 4}, "uuid": {"string": "GPU-44"}}}]},
        }))
        .unwrap();
        slice_devices(&slice).remove(0)
    }

    /// A residency in `ns` created at second `created`, on node-e's
    /// `device`; owned by set uid `set` when given.
    fn residency(
        ns: &str,
        name: &str,
        created: i64,
        device: &str,
        set: Option<&str>,
    ) -> Arc<ModelResidency> {
        let owners: Vec<_> = set
            .map(|uid| {
                json!({"apiVersion": "residency.dev/v1alpha1", "kind": "ResidencySet",
                "name": "fleet", "uid": uid, "controller": true})
            })
            .into_iter()
            .collect();
        let created = Timestamp::from_second(created).unwrap().to_string();
        Arc::new(
            serde_json::from_value(json!({
                "apiVersion": "residency.dev/v1alpha1", "kind": "ModelResidency",
                "metadata": {"name": name, "namespace": ns, "creationTimestamp": created,
                    "ownerReferences": owners},
                "spec": {"nodeName": "node-e", "device": device, "budget": "16Gi", "models": []},
            }))
            .unwrap(),
        )
    }

    /// The black-box round's finding 2: tenant B names the GPU that tenant
    /// A's set stamped first; at A's next reconcile the set kept giving it
    /// to B. The oldest holds it.
    #[test]
    fn a_set_keeps_the_gpu_it_stamped_first_and_a_younger_claimant_waits() {
        let d = gpu_4();
        let ours = residency("a", "fleet-node-e-gpu-4", 100, "GPU-44", Some("set-uid"));
        let younger = residency("b", "mine", 200, "4", None);
        let all = vec![ours.clone(), younger];
        assert_eq!(
            claim_device(&all, "set-uid", "a", "fleet", &d, Some(&ours)),
            Ok("fleet-node-e-gpu-4".to_owned())
        );
        // One older than the stamp holds it (by index, uuid or name).
        for device in ["4", "GPU-44"] {
            let older = residency("c", "first", 50, device, None);
            let all = vec![ours.clone(), older];
            let held = claim_device(&all, "set-uid", "a", "fleet", &d, Some(&ours));
            assert_eq!(
                held,
                Err("node-e/gpu-4: held by ModelResidency c/first".to_owned())
            );
        }
        // Not stamped yet: whoever names it holds it.
        let other = residency("b", "mine", 200, "4", None);
        assert!(claim_device(&[other], "set-uid", "a", "fleet", &d, None).is_err());
    }

    /// Finding 10: a residency that merely has the stamp's name does not
    /// hold the GPU; the stamp takes a hashed name.
    #[test]
    fn a_stamp_whose_name_is_taken_takes_a_hashed_one() {
        let d = gpu_4();
        // Another set's stamp for another GPU ("s-node" on node "e" and
        // "fleet" on "node-e" alike), or one by hand.
        let namesake = residency("a", "fleet-node-e-gpu-4", 10, "0", None);
        let got = claim_device(
            std::slice::from_ref(&namesake),
            "set-uid",
            "a",
            "fleet",
            &d,
            None,
        )
        .unwrap();
        assert_eq!(got, stamped_name_hashed("fleet", "node-e", "gpu-4"));
        assert_ne!(got, stamped_name("fleet", "node-e", "gpu-4"));
        assert!(
            got.len() <= 63 && got.starts_with("fleet-node-e-gpu-4-"),
            "{got}"
        );
        assert_ne!(
            stamped_name_hashed("s-node", "e", "gpu-0"),
            stamped_name_hashed("s", "node-e", "gpu-0")
        );
        // Both names taken: said, not stamped.
        let second = residency("a", &got, 10, "1", None);
        let err = claim_device(&[namesake, second], "set-uid", "a", "fleet", &d, None);
        assert!(err.unwrap_err().contains("taken"));
    }
}
