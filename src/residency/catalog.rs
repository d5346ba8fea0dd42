//! A residency's registry when it names a ModelCatalog (`spec.catalog`):
//! the catalog's entries (all, or those `spec.catalog.models` lists), in
//! the catalog's order, then the residency's own `spec.models` entries, an
//! inline entry replacing the catalog's of the same name (a GPU that needs
//! another size or template for one model says so where it is). Every
//! reader of a residency's models (the operator's reconcile, copy scaler
//! and sleep audit, the router, the node agent, the CLI) reads the
//! resolved residency, so a catalog change reaches each of them through
//! the paths a spec change takes (a new template is `TemplateChanged`, a
//! new size `Resized`).
//!
//! A catalog that is not there, or that lacks a model the residency lists,
//! resolves to nothing: the reconcile says so (`Ready=False`,
//! `CatalogUnavailable`) and acts on nothing, so a deleted catalog never
//! unloads or evicts a model. No I/O: the caller hands the catalog in.

use crate::api::{ModelCatalog, ModelResidency, ModelSpec};
use kube::ResourceExt;
use kube::runtime::reflector::{ObjectRef, Store};
use std::sync::{Arc, RwLock};

/// Why a residency's catalog cannot be read.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum CatalogProblem {
    #[error(
        "spec.catalog: ModelCatalog {namespace}/{name} does not exist; nothing is loaded, unloaded or evicted until it does"
    )]
    NotFound { namespace: String, name: String },
    #[error(
        "spec.catalog.models: ModelCatalog {namespace}/{name} has no {missing:?}; nothing is loaded, unloaded or evicted until it does"
    )]
    Missing {
        namespace: String,
        name: String,
        missing: Vec<String>,
    },
}

/// `r` with its registry resolved against `catalog` (the ModelCatalog
/// `spec.catalog` names, if the caller found it): `None` when `r` names
/// no catalog (it is read as it is).
pub fn resolve(
    r: &ModelResidency,
    catalog: Option<&ModelCatalog>,
) -> Result<Option<ModelResidency>, CatalogProblem> {
    let Some(models) = entries(r, catalog)? else {
        return Ok(None);
    };
    let models = models.into_iter().cloned().collect();
    let mut resolved = r.clone();
    resolved.spec.models = models;
    Ok(Some(resolved))
}

/// The entries of `r`'s resolved registry, borrowed from `r` and
/// `catalog` ([`resolve`] without the copy); `None` when `r` names no
/// catalog (its own `spec.models` are its registry).
fn entries<'a>(
    r: &'a ModelResidency,
    catalog: Option<&'a ModelCatalog>,
) -> Result<Option<Vec<&'a ModelSpec>>, CatalogProblem> {
    let Some(wanted) = &r.spec.catalog else {
        return Ok(None);
    };
    let namespace = r.namespace().unwrap_or_default();
    let Some(catalog) = catalog else {
        return Err(CatalogProblem::NotFound {
            namespace,
            name: wanted.name.clone(),
        });
    };
    let listed = |name: &str| {
        wanted
            .models
            .as_ref()
            .is_none_or(|l| l.iter().any(|m| m == name))
    };
    if let Some(list) = &wanted.models {
        let missing: Vec<String> = list
            .iter()
            .filter(|m| !catalog.spec.models.iter().any(|c| &c.name == *m))
            .cloned()
            .collect();
        if !missing.is_empty() {
            return Err(CatalogProblem::Missing {
                namespace,
                name: wanted.name.clone(),
                missing,
            });
        }
    }
    let inline = &r.spec.models;
    let mut models: Vec<&ModelSpec> = catalog
        .spec
        .models
        .iter()
        .filter(|c| listed(&c.name))
        .map(|c| inline.iter().find(|m| m.name == c.name).unwrap_or(c))
        .collect();
    for m in inline {
        if !models.iter().any(|c| c.name == m.name) {
            models.push(m);
        }
    }
    Ok(Some(models))
}

/// The ModelCatalogs a process watches, for resolving the residencies it
/// reads. Empty until a watch hands its store in: a process that never
/// does (an old deployment's RBAC) reads every residency that names a
/// catalog as unresolvable, never as an empty registry.
#[derive(Default)]
pub struct Catalogs(RwLock<Option<Store<ModelCatalog>>>);

impl Catalogs {
    /// Reads catalogs from `store` from now on.
    pub fn set(&self, store: Store<ModelCatalog>) {
        *self.0.write().expect("catalogs lock") = Some(store);
    }

    fn store(&self) -> Option<Store<ModelCatalog>> {
        self.0.read().expect("catalogs lock").clone()
    }

    /// Waits until the catalogs' first list is in (no catalog reads as
    /// missing because its watch had not listed yet), for at most 30 s (a
    /// watch that cannot list then makes the residency say its catalog is
    /// missing rather than say nothing); at once when none is watched.
    pub async fn wait_ready(&self) {
        if let Some(store) = self.store() {
            let ready = store.wait_until_ready();
            if tokio::time::timeout(std::time::Duration::from_secs(30), ready)
                .await
                .is_err()
            {
                tracing::warn!("the ModelCatalog watch has not listed in 30 s");
            }
        }
    }

    /// `r` resolved against the catalog it names ([`resolve`]); `r` itself
    /// when it names none.
    pub fn resolve(&self, r: Arc<ModelResidency>) -> Result<Arc<ModelResidency>, CatalogProblem> {
        let Some(wanted) = &r.spec.catalog else {
            return Ok(r);
        };
        let catalog = self.store().and_then(|s| {
            s.get(&ObjectRef::new(&wanted.name).within(&r.namespace().unwrap_or_default()))
        });
        Ok(match resolve(&r, catalog.as_deref())? {
            Some(resolved) => Arc::new(resolved),
            None => r,
        })
    }

    /// What `f` makes of `r`'s resolved registry, read in place: no copy
    /// of `r` or of the catalog (readers that scan every residency on a
    /// tick: a copy of each is what made the operator's memory grow with
    /// catalogs).
    pub fn with_models<T>(
        &self,
        r: &ModelResidency,
        f: impl FnOnce(&[&ModelSpec]) -> T,
    ) -> Result<T, CatalogProblem> {
        let Some(wanted) = &r.spec.catalog else {
            let own: Vec<&ModelSpec> = r.spec.models.iter().collect();
            return Ok(f(&own));
        };
        let catalog = self.store().and_then(|s| {
            s.get(&ObjectRef::new(&wanted.name).within(&r.namespace().unwrap_or_default()))
        });
        let models = entries(r, catalog.as_deref())?.unwrap_or_default();
        Ok(f(&models))
    }

    /// The residencies of `store` that name the catalog `catalog`.
    pub fn users(
        store: &Store<ModelResidency>,
        catalog: &ObjectRef<ModelCatalog>,
    ) -> Vec<ObjectRef<ModelResidency>> {
        store
            .state()
            .iter()
            .filter(|r| {
                r.spec
                    .catalog
                    .as_ref()
                    .is_some_and(|c| c.name == catalog.name)
                    && r.namespace() == catalog.namespace
            })
            .map(|r| ObjectRef::from_obj(&**r))
            .collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn residency(spec: serde_json::Value) -> ModelResidency {
        let mut spec = spec;
        spec["device"] = json!("0");
        serde_json::from_value(json!({
            "apiVersion": "residency.dev/v1alpha1", "kind": "ModelResidency",
            "metadata": {"name": "gpu", "namespace": "ns"}, "spec": spec,
        }))
        .unwrap()
    }

    fn catalog(models: serde_json::Value) -> ModelCatalog {
        serde_json::from_value(json!({
            "apiVersion": "residency.dev/v1alpha1", "kind": "ModelCatalog",
            "metadata": {"name": "cat", "namespace": "ns"}, "spec": {"models": models},
        }))
        .unwrap()
    }

    fn names(r: &ModelResidency) -> Vec<(&str, &str)> {
        r.spec
            .models
            .iter()
            .map(|m| (m.name.as_str(), m.size.0.as_str()))
            .collect()
    }

    #[test]
    fn a_registry_is_the_catalogs_entries_then_its_own_an_inline_entry_overriding() {
        let cat = catalog(
            json!([{"name": "a", "size": "1Gi"}, {"name": "b", "size": "2Gi"}, {"name": "c", "size": "3Gi"}]),
        );
        let r = residency(json!({"catalog": {"name": "cat"},
            "models": [{"name": "b", "size": "5Gi"}, {"name": "own", "size": "1Gi"}]}));
        let resolved = resolve(&r, Some(&cat)).unwrap().unwrap();
        assert_eq!(
            names(&resolved),
            [("a", "1Gi"), ("b", "5Gi"), ("c", "3Gi"), ("own", "1Gi")]
        );
        // A list takes only those (an inline entry still counts).
        let r = residency(json!({"catalog": {"name": "cat", "models": ["c", "a"]},
            "models": [{"name": "own", "size": "1Gi"}]}));
        let resolved = resolve(&r, Some(&cat)).unwrap().unwrap();
        assert_eq!(
            names(&resolved),
            [("a", "1Gi"), ("c", "3Gi"), ("own", "1Gi")]
        );
        // No catalog named: read as it is.
        let plain = residency(json!({"models": [{"name": "a", "size": "1Gi"}]}));
        assert!(resolve(&plain, Some(&cat)).unwrap().is_none());
    }

    #[test]
    fn a_missing_catalog_or_model_resolves_to_nothing_and_says_which() {
        let r = residency(json!({"catalog": {"name": "cat", "models": ["a", "zz"]}}));
        let e = resolve(&r, None).unwrap_err();
        assert_eq!(
            e,
            CatalogProblem::NotFound {
                namespace: "ns".into(),
                name: "cat".into()
            }
        );
        assert!(e.to_string().contains("ModelCatalog ns/cat does not exist"));
        let cat = catalog(json!([{"name": "a", "size": "1Gi"}]));
        let e = resolve(&r, Some(&cat)).unwrap_err();
        assert!(e.to_string().contains("has no [\"zz\"]"), "{e}");
        // An unwatched process never reads an empty registry either.
        let unwatched = Catalogs::default();
        assert!(unwatched.resolve(Arc::new(r)).is_err());
    }
}
