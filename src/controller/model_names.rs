//! Which namespace each model name belongs to, kept from the residency
//! watch, so a reconcile can say in its `NameShadowed` condition that a
//! name it lists is served to another namespace's clients by the one
//! router the chart runs (`residency::names` gives the rule: a name is its
//! oldest lister's namespace's). Only names listed from more than one
//! namespace ever wake anyone: one tenant's edits cost the others nothing.

use crate::api::ModelResidency;
use crate::residency::names::{Claimant, claimant, names_of};
use kube::runtime::reflector::ObjectRef;
use kube::runtime::watcher;
use std::collections::{BTreeSet, HashMap};
use std::sync::{Arc, Mutex};

/// Each name's listers, oldest first; each lister's names. A lister is
/// one shared copy however many names it lists (a catalog's residencies
/// list hundreds each).
#[derive(Debug, Default)]
struct Index {
    listers: HashMap<Box<str>, Vec<Arc<Claimant>>>,
    names: HashMap<(String, String), Vec<Box<str>>>,
}

impl Index {
    /// Records `r` as listing `names` (none: it is gone). Returns the other
    /// listers of the names whose listers changed, where more than one
    /// namespace lists them (before or after).
    fn set(&mut self, r: &ModelResidency, names: Vec<Box<str>>) -> Vec<Claimant> {
        let me = Arc::new(claimant(r));
        let key = (me.1.clone(), me.2.clone());
        let old = self.names.remove(&key).unwrap_or_default();
        let (old_set, new_set): (BTreeSet<_>, BTreeSet<_>) =
            (old.iter().collect(), names.iter().collect());
        let mut woken = Vec::new();
        for name in old_set.symmetric_difference(&new_set) {
            let list = self.listers.entry((*name).clone()).or_default();
            let spans_before = spans_namespaces(list);
            list.retain(|c| (&c.1, &c.2) != (&key.0, &key.1));
            if new_set.contains(name) {
                let at = list.partition_point(|c| **c < *me);
                list.insert(at, me.clone());
            }
            if spans_before || spans_namespaces(list) {
                woken.extend(list.iter().filter(|c| ***c != *me).map(|c| (**c).clone()));
            }
            if list.is_empty() {
                self.listers.remove(*name);
            }
        }
        if !names.is_empty() {
            self.names.insert(key, names);
        }
        woken.sort();
        woken.dedup();
        woken
    }
}

fn spans_namespaces(list: &[Arc<Claimant>]) -> bool {
    list.first()
        .is_some_and(|first| list.iter().any(|c| c.1 != first.1))
}

/// The names a residency lists (`resolved`: its registry with its catalog,
/// where that can be read), as the index keeps them.
pub fn listed(resolved: &ModelResidency) -> Vec<Box<str>> {
    let mut names: Vec<Box<str>> = names_of(resolved).map(Into::into).collect();
    names.sort();
    names.dedup();
    names
}

/// What `r`'s names are to other namespaces.
#[derive(Debug, Default, PartialEq)]
pub struct Shadowing {
    /// Names another namespace's older residency lists (the router serves
    /// them there): each with that owner, `namespace/name`.
    pub shadowed: Vec<(String, String)>,
    /// Names this residency's namespace owns that residencies of other
    /// namespaces list too: each with those, `namespace/name`.
    pub shared: Vec<(String, Vec<String>)>,
}

/// The model names of every watched residency.
#[derive(Debug, Default)]
pub struct ModelNames {
    inner: Mutex<(Index, Option<Index>)>,
}

impl ModelNames {
    /// Records one watch event (`resolve` gives a residency's registry with
    /// its catalog). Returns the residencies whose names' owners may have
    /// changed, to reconcile. A relist swaps a whole new index in.
    pub fn record(
        &self,
        event: &watcher::Event<ModelResidency>,
        resolve: impl Fn(&ModelResidency) -> Vec<Box<str>>,
    ) -> Vec<ObjectRef<ModelResidency>> {
        let mut guard = self.inner.lock().expect("names lock");
        let (index, relist) = &mut *guard;
        let woken = match event {
            watcher::Event::Init => {
                *relist = Some(Index::default());
                Vec::new()
            }
            watcher::Event::InitApply(r) => {
                relist.get_or_insert_with(Index::default).set(r, resolve(r));
                Vec::new()
            }
            watcher::Event::InitDone => {
                if let Some(fresh) = relist.take() {
                    *index = fresh;
                }
                Vec::new()
            }
            watcher::Event::Apply(r) => index.set(r, resolve(r)),
            watcher::Event::Delete(r) => index.set(r, Vec::new()),
        };
        woken
            .into_iter()
            .map(|(_, ns, name)| ObjectRef::new(&name).within(&ns))
            .collect()
    }

    /// What `resolved`'s names are to other namespaces, by what the index
    /// holds of the others.
    pub fn shadowing(&self, resolved: &ModelResidency) -> Shadowing {
        let me = claimant(resolved);
        let guard = self.inner.lock().expect("names lock");
        let mut out = Shadowing::default();
        for name in listed(resolved) {
            let Some(list) = guard.0.listers.get(&name) else {
                continue;
            };
            let others = list.iter().filter(|c| (&c.1, &c.2) != (&me.1, &me.2));
            let owner = others.clone().find(|c| ***c < me);
            match owner {
                Some(o) if o.1 != me.1 => out
                    .shadowed
                    .push((name.to_string(), format!("{}/{}", o.1, o.2))),
                Some(_) => {}
                None => {
                    let mut foreign: Vec<String> = others
                        .filter(|c| c.1 != me.1)
                        .map(|c| format!("{}/{}", c.1, c.2))
                        .collect();
                    foreign.dedup();
                    if !foreign.is_empty() {
                        out.shared.push((name.to_string(), foreign));
                    }
                }
            }
        }
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn residency(ns: &str, name: &str, created: &str, models: &[&str]) -> ModelResidency {
        let models: Vec<_> = models
            .iter()
            .map(|m| json!({"name": m, "size": "1Gi", "template": {}}))
            .collect();
        serde_json::from_value(json!({
            "apiVersion": "residency.dev/v1alpha1", "kind": "ModelResidency",
            "metadata": {"name": name, "namespace": ns, "creationTimestamp": created},
            "spec": {"nodeName": "n", "device": "0", "budget": "10Gi", "models": models},
        }))
        .unwrap()
    }

    fn apply(names: &ModelNames, r: &ModelResidency) -> Vec<String> {
        names
            .record(&watcher::Event::Apply(r.clone()), listed)
            .into_iter()
            .map(|o| format!("{}/{}", o.namespace.unwrap_or_default(), o.name))
            .collect()
    }

    #[test]
    fn a_name_two_namespaces_list_is_shadowed_on_the_younger_and_shared_on_the_owner() {
        let names = ModelNames::default();
        let a = residency("team-a", "gpu", "2026-12-07T10:00:00Z", &["base", "own"]);
        let b = residency("team-b", "gpu", "2026-12-07T11:00:00Z", &["base", "mine"]);
        assert!(apply(&names, &a).is_empty());
        // B's listing of `base` changes A's view: A is woken.
        assert_eq!(apply(&names, &b), ["team-a/gpu"]);
        assert_eq!(
            names.shadowing(&b).shadowed,
            [("base".to_string(), "team-a/gpu".to_string())]
        );
        assert_eq!(
            names.shadowing(&a).shared,
            [("base".to_string(), vec!["team-b/gpu".to_string()])]
        );
        assert!(names.shadowing(&a).shadowed.is_empty());
        // B renames its model: both are clear, and A is woken to say so.
        let b2 = residency("team-b", "gpu", "2026-12-07T11:00:00Z", &["b-base", "mine"]);
        assert_eq!(apply(&names, &b2), ["team-a/gpu"]);
        assert_eq!(names.shadowing(&a), Shadowing::default());
        assert_eq!(names.shadowing(&b2), Shadowing::default());
    }

    #[test]
    fn one_namespaces_residencies_sharing_a_name_shadow_nothing_and_wake_no_one() {
        let names = ModelNames::default();
        let a = residency("team-a", "gpu-0", "2026-12-07T10:00:00Z", &["base"]);
        let a1 = residency("team-a", "gpu-1", "2026-12-07T11:00:00Z", &["base"]);
        apply(&names, &a);
        assert!(apply(&names, &a1).is_empty());
        assert_eq!(names.shadowing(&a1), Shadowing::default());
        assert_eq!(names.shadowing(&a), Shadowing::default());
    }

    #[test]
    fn a_deleted_owner_leaves_the_name_to_the_next_namespace() {
        let names = ModelNames::default();
        let a = residency("team-a", "gpu", "2026-12-07T10:00:00Z", &["base"]);
        let b = residency("team-b", "gpu", "2026-12-07T11:00:00Z", &["base"]);
        apply(&names, &a);
        apply(&names, &b);
        let woken = names.record(&watcher::Event::Delete(a.clone()), listed);
        assert_eq!(woken.len(), 1);
        assert_eq!(names.shadowing(&b), Shadowing::default());
    }
}
