//! Routes for standard gateways (`--gateway-routes`, with
//! `--inference-pools`): a Gateway API gateway with body-based routing
//! (which copies a request's `model` into the `X-Gateway-Model-Name`
//! header) sends a model that has serving copies to its InferencePool,
//! and every other request to our router, which holds it and loads the
//! model. Each tick:
//!
//! - one HTTPRoute per model and namespace while the model has a serving
//!   copy (its pool selects a pod), named after the model like its pool,
//!   owned by the residencies that list it: one rule matching the header
//!   exactly, toward the pool. A model with no serving copy has none, so
//!   its requests fall through to the router rather than to an empty
//!   pool's 503;
//! - one catch-all HTTPRoute (`model-residency-router`, in the router
//!   Service's namespace): every path, toward the router Service.
//!
//! Under Gateway API's precedence both rules match the path `/`, and the
//! one with a header match wins; the catch-all takes the rest. Routes are
//! applied only when what is stored does not already say what they would
//! (the API server's defaults fill in the rest), and a model's route is
//! deleted when it stops serving. A route of either name that the operator
//! did not make (no label of its) is left alone, and said in the log.

use super::{ModelKey, Scaler};
use crate::api::ModelResidency;
use crate::residency::labels::MANAGER;
use kube::ResourceExt;
use kube::api::{Api, ApiResource, DeleteParams, DynamicObject, ListParams, Patch, PatchParams};
use kube::core::GroupVersionKind;
use serde_json::{Value, json};
use std::collections::{BTreeMap, HashSet};
use std::sync::Arc;

/// The header body-based routing sets from the request's `model`.
pub const MODEL_HEADER: &str = "X-Gateway-Model-Name";

/// The label of a model's route: the model's name.
pub const ROUTE_MODEL_LABEL: &str = "residency.dev/route-model";

/// The label of the catch-all route.
pub const ROUTE_ROUTER_LABEL: &str = "residency.dev/route";

/// The catch-all route's name.
pub const ROUTER_ROUTE: &str = "model-residency-router";

/// Where the routes attach and where the catch-all goes.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct RouteConfig {
    /// The Gateway: its namespace (none: each route's own) and name.
    pub gateway_namespace: Option<String>,
    pub gateway: String,
    /// The router Service: namespace, name, port.
    pub router_namespace: String,
    pub router_service: String,
    pub router_port: u16,
}

impl RouteConfig {
    /// `[NAMESPACE/]GATEWAY` and `NAMESPACE/SERVICE:PORT`, as the flags
    /// give them.
    pub fn parse(gateway: &str, router: &str) -> Result<Self, String> {
        let (gateway_namespace, gateway) = match gateway.split_once('/') {
            Some((ns, name)) => (Some(ns.to_owned()), name.to_owned()),
            None => (None, gateway.to_owned()),
        };
        let label = crate::residency::labels::is_dns_subdomain;
        if !label(&gateway) || gateway_namespace.as_deref().is_some_and(|n| !label(n)) {
            return Err(format!(
                "--gateway-routes {gateway:?}: give [NAMESPACE/]GATEWAY, the Gateway the routes attach to"
            ));
        }
        let bad = || {
            format!(
                "--gateway-router-service {router:?}: give NAMESPACE/SERVICE:PORT, the router's Service"
            )
        };
        let (ns, rest) = router.split_once('/').ok_or_else(bad)?;
        let (name, port) = rest.split_once(':').ok_or_else(bad)?;
        let port: u16 = port.parse().ok().filter(|&p| p > 0).ok_or_else(bad)?;
        if !label(ns) || !label(name) {
            return Err(bad());
        }
        Ok(RouteConfig {
            gateway_namespace,
            gateway,
            router_namespace: ns.to_owned(),
            router_service: name.to_owned(),
            router_port: port,
        })
    }

    fn parent(&self) -> Value {
        let mut parent = json!({
            "group": "gateway.networking.k8s.io", "kind": "Gateway", "name": self.gateway,
        });
        if let Some(ns) = &self.gateway_namespace {
            parent["namespace"] = json!(ns);
        }
        parent
    }
}

/// HTTPRoute (gateway.networking.k8s.io/v1), untyped: the operator writes
/// two shapes and reads their specs back.
fn route_resource() -> ApiResource {
    ApiResource::from_gvk_with_plural(
        &GroupVersionKind::gvk("gateway.networking.k8s.io", "v1", "HTTPRoute"),
        "httproutes",
    )
}

/// A model's route: its header, exactly, toward its pool.
pub fn model_route(
    model: &str,
    ns: &str,
    homes: &[Arc<ModelResidency>],
    config: &RouteConfig,
) -> Value {
    let owners = super::as_owners(homes);
    json!({
        "apiVersion": "gateway.networking.k8s.io/v1", "kind": "HTTPRoute",
        "metadata": {"name": model, "namespace": ns,
            "labels": {ROUTE_MODEL_LABEL: model}, "ownerReferences": owners},
        "spec": {
            "parentRefs": [config.parent()],
            "rules": [{
                "matches": [{
                    "path": {"type": "PathPrefix", "value": "/"},
                    "headers": [{"type": "Exact", "name": MODEL_HEADER, "value": model}],
                }],
                "backendRefs": [{"group": "inference.networking.k8s.io", "kind": "InferencePool",
                    "name": model, "weight": 1}],
            }],
        },
    })
}

/// The catch-all: every path toward the router Service.
pub fn router_route(config: &RouteConfig) -> Value {
    json!({
        "apiVersion": "gateway.networking.k8s.io/v1", "kind": "HTTPRoute",
        "metadata": {"name": ROUTER_ROUTE, "namespace": config.router_namespace,
            "labels": {ROUTE_ROUTER_LABEL: "router"}},
        "spec": {
            "parentRefs": [config.parent()],
            "rules": [{
                "matches": [{"path": {"type": "PathPrefix", "value": "/"}}],
                "backendRefs": [{"group": "", "kind": "Service", "name": config.router_service,
                    "port": config.router_port, "weight": 1}],
            }],
        },
    })
}

/// Whether `stored` says everything `wanted` says (and maybe more: the API
/// server's defaults). Lists must have the same length, item by item.
pub fn covers(stored: &Value, wanted: &Value) -> bool {
    match (stored, wanted) {
        (Value::Object(s), Value::Object(w)) => w
            .iter()
            .all(|(k, v)| s.get(k).is_some_and(|sv| covers(sv, v))),
        (Value::Array(s), Value::Array(w)) => {
            s.len() == w.len() && s.iter().zip(w).all(|(a, b)| covers(a, b))
        }
        _ => stored == wanted,
    }
}

fn key_of(o: &DynamicObject) -> (String, String) {
    (o.namespace().unwrap_or_default(), o.name_any())
}

impl Scaler {
    /// Applies each serving model's route and the catch-all where what is
    /// stored differs, deletes the routes of models that stopped serving.
    pub(super) async fn apply_routes(
        &self,
        all: &BTreeMap<ModelKey, Vec<Arc<ModelResidency>>>,
        serving: &HashSet<ModelKey>,
        config: &RouteConfig,
    ) {
        let resource = route_resource();
        let api: Api<DynamicObject> = match self.namespace.as_deref() {
            Some(ns) => Api::namespaced_with(self.ctx.client.clone(), ns, &resource),
            None => Api::all_with(self.ctx.client.clone(), &resource),
        };
        let existing = match api.list(&ListParams::default()).await {
            Ok(list) => list.items,
            Err(e) => {
                tracing::warn!(error = %e, "routes: cannot list HTTPRoutes (are the Gateway API CRDs installed?)");
                return;
            }
        };
        let mut wanted: Vec<Value> = all
            .iter()
            .filter(|(key, _)| serving.contains(*key))
            .map(|((ns, model), homes)| model_route(model, ns, homes, config))
            .collect();
        wanted.push(router_route(config));
        let router_api: Api<DynamicObject> =
            Api::namespaced_with(self.ctx.client.clone(), &config.router_namespace, &resource);
        let router_stored = match self.namespace.as_deref() {
            Some(ns) if ns != config.router_namespace => {
                router_api.get_opt(ROUTER_ROUTE).await.ok().flatten()
            }
            _ => None,
        };
        for route in &wanted {
            let ns = route["metadata"]["namespace"].as_str().unwrap_or_default();
            let name = route["metadata"]["name"].as_str().unwrap_or_default();
            let stored = existing
                .iter()
                .chain(router_stored.as_ref())
                .find(|o| key_of(o) == (ns.to_owned(), name.to_owned()));
            if let Some(stored) = stored {
                let ours = stored.labels().contains_key(ROUTE_MODEL_LABEL)
                    || stored.labels().contains_key(ROUTE_ROUTER_LABEL);
                if !ours {
                    tracing::warn!(namespace = %ns, route = %name, "routes: an HTTPRoute of this name is not the operator's; left alone");
                    continue;
                }
                let same_owners = stored.metadata.owner_references.as_ref().map_or_else(
                    || {
                        route["metadata"]["ownerReferences"]
                            .as_array()
                            .is_none_or(Vec::is_empty)
                    },
                    |o| {
                        serde_json::to_value(o).ok().as_ref()
                            == Some(&route["metadata"]["ownerReferences"])
                    },
                );
                if same_owners && covers(&stored.data["spec"], &route["spec"]) {
                    continue;
                }
            }
            let api: Api<DynamicObject> =
                Api::namespaced_with(self.ctx.client.clone(), ns, &resource);
            self.ctx.metrics.api_request("patch", "httproutes");
            if let Err(e) = api
                .patch(name, &PatchParams::apply(MANAGER), &Patch::Apply(route))
                .await
            {
                tracing::warn!(route = %name, error = %e, "routes: could not apply an HTTPRoute");
            }
        }
        // Models that stopped serving (or that no residency lists) lose
        // their routes: their requests reach the router again.
        for old in &existing {
            if !old.labels().contains_key(ROUTE_MODEL_LABEL) {
                continue;
            }
            let (ns, name) = key_of(old);
            let kept = wanted.iter().any(|w| {
                w["metadata"]["namespace"] == ns.as_str() && w["metadata"]["name"] == name.as_str()
            });
            if kept {
                continue;
            }
            let api: Api<DynamicObject> =
                Api::namespaced_with(self.ctx.client.clone(), &ns, &resource);
            self.ctx.metrics.api_request("delete", "httproutes");
            if let Err(e) = api.delete(&name, &DeleteParams::default()).await {
                tracing::warn!(route = %name, error = %e, "routes: could not delete an HTTPRoute");
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_flags_parse_and_bad_ones_say_the_shape() {
        let c = RouteConfig::parse("infra/inference-gw", "serving/model-residency-router:8080")
            .unwrap();
        assert_eq!(c.gateway_namespace.as_deref(), Some("infra"));
        assert_eq!(c.gateway, "inference-gw");
        assert_eq!(
            (
                c.router_namespace.as_str(),
                c.router_service.as_str(),
                c.router_port
            ),
            ("serving", "model-residency-router", 8080)
        );
        assert_eq!(
            RouteConfig::parse("gw", "a/b:1").unwrap().gateway_namespace,
            None
        );
        for (gw, router) in [
            ("gw", "b:80"),
            ("gw", "a/b"),
            ("gw", "a/b:0"),
            ("Bad/gw", "a/b:80"),
        ] {
            let e = RouteConfig::parse(gw, router).unwrap_err();
            assert!(e.contains("give "), "{e}");
        }
    }

    #[test]
    fn a_models_route_matches_its_header_toward_its_pool_and_the_catch_all_the_router() {
        let c = RouteConfig::parse("gw", "serving/router:80").unwrap();
        let r = model_route("chat", "ml", &[], &c);
        let rule = &r["spec"]["rules"][0];
        assert_eq!(rule["matches"][0]["headers"][0]["name"], MODEL_HEADER);
        assert_eq!(rule["matches"][0]["headers"][0]["value"], "chat");
        assert_eq!(rule["backendRefs"][0]["kind"], "InferencePool");
        assert_eq!(rule["backendRefs"][0]["name"], "chat");
        assert!(r["spec"]["parentRefs"][0].get("namespace").is_none());
        let all = router_route(&c);
        assert_eq!(all["metadata"]["namespace"], "serving");
        assert!(
            all["spec"]["rules"][0]["matches"][0]
                .get("headers")
                .is_none()
        );
        assert_eq!(all["spec"]["rules"][0]["backendRefs"][0]["port"], 80);
    }

    #[test]
    fn covers_reads_defaults_as_the_same_and_a_change_as_a_change() {
        let wanted = json!({"rules": [{"backendRefs": [{"name": "a"}]}]});
        let stored =
            json!({"rules": [{"backendRefs": [{"name": "a", "weight": 1}], "timeouts": {}}]});
        assert!(covers(&stored, &wanted));
        assert!(!covers(
            &json!({"rules": [{"backendRefs": [{"name": "b"}]}]}),
            &wanted
        ));
        assert!(!covers(&json!({"rules": []}), &wanted));
    }
}
