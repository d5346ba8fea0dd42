//! Whose a model's name is when residencies of several namespaces list it.
//! One router may serve every namespace (the chart's default), and a name is
//! what a client sends: two tenants listing a model `base` each, on their
//! own GPUs and servers, split one tenant's requests between both servers
//! (the black-box round saw 6 of 12 reach the other tenant's pod). A name
//! (a model's or a LoRA adapter's: one request field names either) belongs
//! to one namespace: that of the oldest residency listing it, the name's
//! first owner, as the oldest residency holds a GPU. The router resolves the
//! name there only; a residency of another namespace that lists it says so
//! in its `NameShadowed` condition, and its clients reach it through a
//! router of their namespace's own (`route --namespace`). Pure.

use crate::api::ModelResidency;
use k8s_openapi::jiff::Timestamp;
use kube::ResourceExt;
use std::collections::HashMap;

/// The names a residency's (resolved) registry gives requests: its models'
/// and their LoRA adapters'.
pub fn names_of(r: &ModelResidency) -> impl Iterator<Item = &str> {
    r.spec.models.iter().flat_map(|m| {
        std::iter::once(m.name.as_str()).chain(
            m.lora
                .iter()
                .flat_map(|l| l.adapters.iter().map(|a| a.name.as_str())),
        )
    })
}

/// A residency as a name's claimant: oldest first, then namespace, then
/// name (the order GPU claims go by).
pub type Claimant = (Option<Timestamp>, String, String);

/// `r` as a claimant of the names it lists.
pub fn claimant(r: &ModelResidency) -> Claimant {
    (
        r.metadata.creation_timestamp.as_ref().map(|t| t.0),
        r.namespace().unwrap_or_default(),
        r.name_any(),
    )
}

/// Each name's owner among `residencies` (resolved registries): the oldest
/// residency listing it.
pub fn owners<'a>(
    residencies: impl IntoIterator<Item = &'a ModelResidency>,
) -> HashMap<&'a str, Claimant> {
    let mut owners: HashMap<&str, Claimant> = HashMap::new();
    for r in residencies {
        let c = claimant(r);
        for name in names_of(r) {
            match owners.get(name) {
                Some(o) if *o <= c => {}
                _ => {
                    owners.insert(name, c.clone());
                }
            }
        }
    }
    owners
}

/// The names `r` lists whose owner is a residency of another namespace,
/// each with that owner (`namespace/name`), sorted by name.
pub fn shadowed(r: &ModelResidency, owners: &HashMap<&str, Claimant>) -> Vec<(String, String)> {
    let ns = r.namespace().unwrap_or_default();
    let mut out: Vec<(String, String)> = names_of(r)
        .filter_map(|name| {
            let (_, owner_ns, owner) = owners.get(name)?;
            (*owner_ns != ns).then(|| (name.to_owned(), format!("{owner_ns}/{owner}")))
        })
        .collect();
    out.sort();
    out.dedup();
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    fn residency(ns: &str, name: &str, created: i64, models: serde_json::Value) -> ModelResidency {
        let mut r: ModelResidency = serde_json::from_value(serde_json::json!({
            "apiVersion": "residency.dev/v1alpha1", "kind": "ModelResidency",
            "metadata": {"name": name, "namespace": ns},
            "spec": {"nodeName": "n", "device": "0", "budget": "16Gi", "models": models},
        }))
        .unwrap();
        r.metadata.creation_timestamp = Some(k8s_openapi::apimachinery::pkg::apis::meta::v1::Time(
            Timestamp::from_second(created).unwrap(),
        ));
        r
    }

    #[test]
    fn a_name_is_the_oldest_listers_and_adapters_share_the_names() {
        let base = serde_json::json!([{"name": "base", "size": "1Gi", "lora": {
            "adapters": [{"name": "a2", "rank": 8}]}}]);
        let a = residency("a", "gpu", 100, base);
        // B, younger: a plain model a2 and its own base.
        let b = residency(
            "b",
            "gpu",
            200,
            serde_json::json!([{"name": "base", "size": "1Gi"}, {"name": "a2", "size": "1Gi"}, {"name": "own", "size": "1Gi"}]),
        );
        let all = [&a, &b];
        let owners = owners(all.iter().copied());
        assert_eq!(owners["base"].1, "a");
        assert_eq!(owners["a2"].1, "a", "an adapter's name is a name");
        assert_eq!(owners["own"].1, "b");
        assert_eq!(
            shadowed(&b, &owners),
            [
                ("a2".to_owned(), "a/gpu".to_owned()),
                ("base".to_owned(), "a/gpu".to_owned())
            ]
        );
        assert!(shadowed(&a, &owners).is_empty());
    }
}
