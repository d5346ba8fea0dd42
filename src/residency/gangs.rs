//! Gangs as the residencies carry them: a model of `gpus: N` (N > 1) is
//! placed by the operator's gang coordinator on N residencies of one
//! namespace and node (its *members*, the first its *head*) and recorded
//! on each member in the [`GANGS_ANNOTATION`]; a gang that no N of them
//! could ever hold is recorded on the residency asked for it in the
//! [`GANG_REFUSED_ANNOTATION`]. Each member's own reconcile admits the
//! gang into its own budget (its own evictions) once placed there; the
//! head starts the one pod that holds every member's GPU once the
//! coordinator says every member made room (`ready`). No I/O here.

use crate::api::{ModelResidency, ModelSpec};
use serde::{Deserialize, Serialize};
use std::collections::BTreeMap;

/// Annotation on a residency: the gangs placed on its GPU, a JSON object
/// of model name to [`GangPlacement`]. Written by the gang coordinator
/// only.
pub const GANGS_ANNOTATION: &str = "residency.dev/gangs";
/// Annotation on a residency: gangs requested there that no N GPUs of its
/// node could ever hold, a JSON object of model name to why (per GPU).
pub const GANG_REFUSED_ANNOTATION: &str = "residency.dev/gang-refused";
/// Annotation on a gang's pod: its members' residency names, comma
/// separated, head first; each member sees the pod as its own (it holds
/// VRAM on each member's GPU).
pub const GANG_MEMBERS_ANNOTATION: &str = "residency.dev/gang-members";
/// The environment a gang's pod gets: how many GPUs it holds, and their
/// devices (each member's spec.device or allocated device), comma
/// separated in member order.
pub const GANG_SIZE_ENV: &str = "RESIDENCY_GANG_SIZE";
pub const GANG_DEVICES_ENV: &str = "RESIDENCY_GANG_DEVICES";

/// How many GPUs `m` spans at once (1: an ordinary model).
pub fn width(m: &ModelSpec) -> usize {
    usize::from(m.gpus.unwrap_or(1).max(1))
}

/// One GPU of a placed gang.
#[derive(Serialize, Deserialize, Clone, Debug, PartialEq, Eq)]
#[serde(rename_all = "camelCase")]
pub struct GangMember {
    /// The member residency's name.
    pub residency: String,
    /// Its uid (the gang pod is owned by every member).
    pub uid: String,
    /// Its device (spec.device, or the allocated device in claim mode).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub device: Option<String>,
    /// claim mode: the ResourceClaim its model pods share.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub claim: Option<String>,
}

/// Where a gang is placed: its members, head first, and whether every one
/// has made room (its pod may start).
#[derive(Serialize, Deserialize, Clone, Debug, PartialEq, Eq)]
#[serde(rename_all = "camelCase")]
pub struct GangPlacement {
    pub members: Vec<GangMember>,
    /// Every member admitted it: the head starts its pod.
    #[serde(default)]
    pub ready: bool,
    /// The request it was placed for (RFC 3339, the demand time written
    /// on every member): a member whose status has processed a request
    /// this recent and does not hold the gang has let it go.
    #[serde(default)]
    pub at: String,
    /// The gang sleeps: a member chose to put it to sleep to make room, so
    /// every member does, and the head asks its one pod.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub sleep: Option<GangSleep>,
}

/// A gang's sleep, as the coordinator keeps it on every member.
#[derive(Serialize, Deserialize, Clone, Debug, PartialEq, Eq)]
#[serde(rename_all = "camelCase")]
pub struct GangSleep {
    pub phase: SleepPhase,
    /// The newest request for the gang when it was put to sleep (RFC
    /// 3339): a member puts it to sleep only while no newer request came;
    /// a newer one wakes it on every member.
    pub after: String,
}

/// Where a gang's sleep stands.
#[derive(Serialize, Deserialize, Clone, Copy, Debug, PartialEq, Eq)]
#[serde(rename_all = "camelCase")]
pub enum SleepPhase {
    /// Every member puts it to sleep (each holds it at its full size
    /// until the head's pod confirms); the head asks the pod.
    Asked,
    /// The head's pod confirmed: every member holds its sleeping size.
    Asleep,
    /// A request woke it on every member and each has made room for its
    /// full size: the head asks the pod to wake.
    Waking,
}

impl GangPlacement {
    /// Whether `residency` is one of its members.
    pub fn includes(&self, residency: &str) -> bool {
        self.members.iter().any(|m| m.residency == residency)
    }

    /// The member that starts and replaces its pod.
    pub fn head(&self) -> &str {
        self.members.first().map_or("", |m| m.residency.as_str())
    }

    /// The members' names, head first, comma separated (the pod's
    /// [`GANG_MEMBERS_ANNOTATION`]).
    pub fn names(&self) -> String {
        let names: Vec<&str> = self.members.iter().map(|m| m.residency.as_str()).collect();
        names.join(",")
    }
}

/// The gangs placed on `r`'s GPU. An annotation that does not parse (a
/// person's edit) places nothing; the coordinator rewrites it.
pub fn placements(r: &ModelResidency) -> BTreeMap<String, GangPlacement> {
    annotation(r, GANGS_ANNOTATION)
}

/// The gangs refused where `r` asked for them, with why.
pub fn refusals(r: &ModelResidency) -> BTreeMap<String, String> {
    annotation(r, GANG_REFUSED_ANNOTATION)
}

fn annotation<T: serde::de::DeserializeOwned + Default>(r: &ModelResidency, key: &str) -> T {
    r.metadata
        .annotations
        .as_ref()
        .and_then(|a| a.get(key))
        .and_then(|v| serde_json::from_str(v).ok())
        .unwrap_or_default()
}

/// The members a gang pod's annotation names, head first.
pub fn pod_members(annotation: &str) -> impl Iterator<Item = &str> {
    annotation.split(',').filter(|m| !m.is_empty())
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn residency(annotations: serde_json::Value) -> ModelResidency {
        serde_json::from_value(json!({
            "apiVersion": "residency.dev/v1alpha1", "kind": "ModelResidency",
            "metadata": {"name": "gpu-0", "namespace": "ns", "annotations": annotations},
            "spec": {"budget": "10Gi", "nodeName": "n", "device": "0", "models": []}
        }))
        .unwrap()
    }

    #[test]
    fn a_placement_reads_back_and_a_broken_one_places_nothing() {
        let placed = json!({"big": {"members": [
            {"residency": "gpu-0", "uid": "u0", "device": "0"},
            {"residency": "gpu-1", "uid": "u1", "claim": "gpu-1-gpu"}
        ], "ready": true, "at": "2026-12-06T00:00:00Z",
           "sleep": {"phase": "asleep", "after": "2026-12-06T00:00:01Z"}}});
        let r = residency(json!({GANGS_ANNOTATION: placed.to_string()}));
        let p = &placements(&r)["big"];
        assert!(p.ready && p.includes("gpu-1") && !p.includes("gpu-2"));
        assert_eq!(p.head(), "gpu-0");
        assert_eq!(p.names(), "gpu-0,gpu-1");
        assert_eq!(p.sleep.as_ref().unwrap().phase, SleepPhase::Asleep);
        assert_eq!(serde_json::to_value(p).unwrap(), placed["big"]);
        let broken = residency(json!({GANGS_ANNOTATION: "{not json"}));
        assert!(placements(&broken).is_empty());
        let refused = residency(json!({GANG_REFUSED_ANNOTATION: r#"{"big":"why"}"#}));
        assert_eq!(refusals(&refused)["big"], "why");
        assert_eq!(pod_members("a,b,").collect::<Vec<_>>(), ["a", "b"]);
    }
}
