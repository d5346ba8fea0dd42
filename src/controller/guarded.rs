//! A merge patch that cannot erase what another writer wrote meanwhile.
//!
//! The gang coordinator decides from its cache and writes whole
//! annotations and single demand keys. A plain merge patch applies on
//! whatever the object holds by then: a router's request written after
//! the cached read (a demand key) is erased by a coordinator that takes
//! its gang off, and the coordinator's own previous write, not yet in its
//! cache, is overwritten by the next pass. A `resourceVersion` precondition
//! alone refuses the write on any change, including each member's status
//! writes under load, and starved gang placement.
//!
//! So the patch carries the `resourceVersion` it was decided on and, when
//! that is refused (409), reads the object again: if every field the patch
//! sets still holds what the decision saw, only other fields moved and the
//! patch is sent again on the new version; if one of them changed, the
//! decision is stale and nothing is written (the change wakes the writer,
//! which decides again from what it now sees).

use kube::api::{Api, Patch, PatchParams};
use kube::{Resource, ResourceExt};
use serde::Serialize;
use serde::de::DeserializeOwned;
use serde_json::Value;
use std::fmt::Debug;

/// Fresh reads after a refused version before the write is left to the
/// writer's next pass (each refusal means the object changed: under a
/// storm of status writes, give way rather than spin).
const TRIES: usize = 4;

/// What became of a guarded patch.
#[derive(Debug)]
pub enum Guarded<K> {
    /// Applied: the object as the write left it.
    Written(K),
    /// A field the patch sets changed since `seen` (or the object kept
    /// changing): nothing written.
    Stale,
    /// The object is gone.
    Gone,
}

/// Applies the merge patch `body` to `seen`'s object if every field it
/// sets still reads as in `seen`.
pub async fn merge_unless_changed<K>(
    api: &Api<K>,
    params: &PatchParams,
    seen: &K,
    body: &Value,
) -> kube::Result<Guarded<K>>
where
    K: Resource + Clone + DeserializeOwned + Serialize + Debug,
{
    let name = seen.name_any();
    let leaves = leaves(body);
    let as_seen = serde_json::to_value(seen).unwrap_or(Value::Null);
    let mut version = seen.resource_version();
    for _ in 0..TRIES {
        let mut attempt = body.clone();
        if let Some(v) = &version {
            attempt["metadata"]["resourceVersion"] = Value::String(v.clone());
        }
        match api.patch(&name, params, &Patch::Merge(&attempt)).await {
            Ok(written) => return Ok(Guarded::Written(written)),
            Err(kube::Error::Api(e)) if e.code == 404 => return Ok(Guarded::Gone),
            Err(kube::Error::Api(e)) if e.code == 409 => {}
            Err(e) => return Err(e),
        }
        let Some(fresh) = api.get_opt(&name).await? else {
            return Ok(Guarded::Gone);
        };
        let now = serde_json::to_value(&fresh).unwrap_or(Value::Null);
        if leaves
            .iter()
            .any(|path| at(&now, path) != at(&as_seen, path))
        {
            return Ok(Guarded::Stale);
        }
        version = fresh.resource_version();
    }
    Ok(Guarded::Stale)
}

/// The paths of the values a merge patch sets (a `null` removes one).
fn leaves(body: &Value) -> Vec<Vec<String>> {
    fn walk(v: &Value, path: &mut Vec<String>, out: &mut Vec<Vec<String>>) {
        match v {
            Value::Object(map) if !map.is_empty() => {
                for (k, v) in map {
                    path.push(k.clone());
                    walk(v, path, out);
                    path.pop();
                }
            }
            _ => out.push(path.clone()),
        }
    }
    let mut out = Vec::new();
    walk(body, &mut Vec::new(), &mut out);
    out
}

/// The value at `path`; a missing field reads as `null` (as a merge patch
/// treats it).
fn at<'v>(v: &'v Value, path: &[String]) -> &'v Value {
    path.iter()
        .try_fold(v, |v, k| v.get(k))
        .unwrap_or(&Value::Null)
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn the_fields_a_patch_sets_are_its_leaves_removals_included() {
        let body = json!({
            "metadata": {"annotations": {"residency.dev/gangs": null, "b": "x"}},
            "spec": {"demand": {"tp": "2026-12-07T00:00:00Z"}}
        });
        let mut paths = leaves(&body);
        paths.sort();
        assert_eq!(
            paths,
            [
                vec!["metadata", "annotations", "b"],
                vec!["metadata", "annotations", "residency.dev/gangs"],
                vec!["spec", "demand", "tp"],
            ]
        );
    }

    #[test]
    fn a_missing_field_reads_as_null_and_a_present_one_as_itself() {
        let v = json!({"spec": {"demand": {"tp": "t"}}});
        let path = |p: &[&str]| p.iter().map(|s| s.to_string()).collect::<Vec<_>>();
        assert_eq!(at(&v, &path(&["spec", "demand", "tp"])), &json!("t"));
        assert_eq!(at(&v, &path(&["spec", "demand", "a"])), &Value::Null);
        assert_eq!(
            at(&v, &path(&["metadata", "annotations", "x"])),
            &Value::Null
        );
    }
}
