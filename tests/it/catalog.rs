//! ModelCatalog: models declared once, for the residencies that name it,
//! on the real API server with the operator and a router.

use crate::support::cluster::eventually;
use crate::support::operator::{Harness, server_template};
use crate::support::router::{RouterUnderTest, assert_served_by, json_of};
use k8s_openapi::api::core::v1::Pod;
use kube::api::{Api, DeleteParams, ListParams, Patch, PatchParams, PostParams};
use model_residency::api::{ModelCatalog, ModelResidency, ModelState};
use serde_json::{Value, json};
use std::collections::BTreeSet;

fn catalog(models: Value) -> ModelCatalog {
    serde_json::from_value(json!({
        "apiVersion": "residency.dev/v1alpha1", "kind": "ModelCatalog",
        "metadata": {"name": "models"}, "spec": {"models": models},
    }))
    .unwrap()
}

fn entry(name: &str, size: &str) -> Value {
    json!({"name": name, "size": size, "template": server_template(name)})
}

/// A residency of `h`'s node on GPU `device` over the catalog, with
/// `extra` merged into its spec.
async fn residency(h: &Harness, name: &str, device: &str, extra: Value) -> ModelResidency {
    let mut spec = json!({"nodeName": h.node, "device": device, "budget": "12Gi",
        "gpu": {"mode": "env"}, "catalog": {"name": "models"}});
    for (k, v) in extra.as_object().unwrap() {
        spec[k] = v.clone();
    }
    let r: ModelResidency = serde_json::from_value(json!({
        "apiVersion": "residency.dev/v1alpha1", "kind": "ModelResidency",
        "metadata": {"name": name}, "spec": spec,
    }))
    .unwrap();
    h.api.create(&PostParams::default(), &r).await.unwrap()
}

fn ready(r: &ModelResidency) -> Option<(String, String, String)> {
    let c = r
        .status
        .as_ref()?
        .conditions
        .iter()
        .find(|c| c.type_ == "Ready")?;
    Some((c.status.clone(), c.reason.clone(), c.message.clone()))
}

async fn until_ready_is(h: &Harness, name: &str, status: &str, reason: &str) -> String {
    eventually(30, &format!("{name} Ready={status} ({reason})"), || async {
        let r = h.api.get(name).await.ok()?;
        let (s, why, message) = ready(&r)?;
        (s == status && why == reason).then_some(message)
    })
    .await
}

/// Names and uids of a residency's live pods.
async fn pods(h: &Harness, name: &str) -> BTreeSet<(String, String)> {
    let lp = ListParams::default().labels(&format!("residency.dev/residency={name}"));
    let pods: Api<Pod> = h.pods.clone();
    pods.list(&lp)
        .await
        .unwrap()
        .items
        .into_iter()
        .filter(|p| p.metadata.deletion_timestamp.is_none())
        .map(|p| (p.metadata.name.unwrap(), p.metadata.uid.unwrap()))
        .collect()
}

async fn wait_event(h: &Harness, name: &str, reason: &str) {
    let with = format!(" {reason} x");
    eventually(20, &format!("a {reason} event on {name}"), || async {
        h.events_of(name)
            .await
            .iter()
            .any(|line| line.contains(&with))
            .then_some(())
    })
    .await;
}

#[tokio::test]
#[ignore = "needs the local control plane: scripts/test.sh runs it with --include-ignored"]
async fn residencies_take_their_models_from_a_catalog_and_follow_its_changes() {
    let h = Harness::start("catalog").await;
    let catalogs: Api<ModelCatalog> = Api::namespaced(h.env.client.clone(), &h.env.namespace);
    catalogs
        .create(
            &PostParams::default(),
            &catalog(json!([
                entry("a", "4Gi"),
                entry("b", "6Gi"),
                entry("c", "3Gi")
            ])),
        )
        .await
        .unwrap();
    // All of it, c overridden inline; only a, plus a model of its own.
    residency(&h, "gpu-all", "0", json!({"models": [entry("c", "1Gi")]})).await;
    residency(
        &h,
        "gpu-one",
        "1",
        json!({"catalog": {"name": "models", "models": ["a"]}, "models": [entry("own", "2Gi")]}),
    )
    .await;
    for (name, model) in [
        ("gpu-all", "a"),
        ("gpu-all", "c"),
        ("gpu-one", "a"),
        ("gpu-one", "own"),
    ] {
        // Waited for by the model's state: a timeout prints the
        // residency's status and events.
        h.request_nowait(name, model).await;
        h.until_state(name, model, ModelState::Loaded, 60).await;
    }
    let all = h.converged("gpu-all").await;
    let status = all.status.as_ref().unwrap();
    // The inline entry stands for c.
    assert_eq!(status.model("c").unwrap().size.as_deref(), Some("1Gi"));
    // b is not one of gpu-one's: refused as a model outside its registry.
    let one = h.request("gpu-one", "b").await;
    let b = one.status.as_ref().unwrap().model("b").unwrap();
    assert_eq!(b.state, ModelState::Refused, "{b:?}");

    // Its model count, in its status (`kubectl get mcat`).
    eventually(30, "the catalog's status to count its models", || async {
        let c = catalogs.get("models").await.ok()?;
        (c.status?.models == 3).then_some(())
    })
    .await;
    // The router serves what the catalogs say.
    let router = RouterUnderTest::exact(&h).await;
    let listed: BTreeSet<String> = json_of(&router.get("/v1/models").await)["data"]
        .as_array()
        .unwrap()
        .iter()
        .map(|m| m["id"].as_str().unwrap().to_owned())
        .collect();
    assert_eq!(
        listed,
        ["a", "b", "c", "own"].map(String::from).into(),
        "/v1/models"
    );
    assert_served_by(&router.chat("b").await, "b");

    // A catalog change reaches each residency through the paths a spec
    // change takes: a new template replaces a's pods, a new size is a
    // resize.
    let mut changed_a = entry("a", "4Gi");
    changed_a["template"]["metadata"] = json!({"annotations": {"catalog-version": "2"}});
    let changed_b = entry("b", "5Gi");
    catalogs
        .patch(
            "models",
            &PatchParams::default(),
            &Patch::Merge(json!({"spec": {"models": [changed_a, changed_b, entry("c", "3Gi")]}})),
        )
        .await
        .unwrap();
    wait_event(&h, "gpu-all", "TemplateChanged").await;
    wait_event(&h, "gpu-one", "TemplateChanged").await;
    wait_event(&h, "gpu-all", "Resized").await;
    h.until_state("gpu-all", "a", ModelState::Loaded, 30).await;
    let all = h.converged("gpu-all").await;
    assert_eq!(
        all.status
            .as_ref()
            .unwrap()
            .model("b")
            .unwrap()
            .size
            .as_deref(),
        Some("5Gi")
    );

    // The catalog deleted: each residency says so, and nothing is evicted
    // or unloaded for it: the same pods stay.
    let before_all = pods(&h, "gpu-all").await;
    let before_one = pods(&h, "gpu-one").await;
    assert!(!before_all.is_empty() && !before_one.is_empty());
    catalogs
        .delete("models", &DeleteParams::default())
        .await
        .unwrap();
    let message = until_ready_is(&h, "gpu-all", "False", "CatalogUnavailable").await;
    assert!(message.contains("does not exist"), "{message}");
    until_ready_is(&h, "gpu-one", "False", "CatalogUnavailable").await;
    wait_event(&h, "gpu-all", "CatalogUnavailable").await;
    // A request meanwhile changes nothing either.
    model_residency::residency::demand::load(
        &h.api,
        "gpu-all",
        "b",
        k8s_openapi::jiff::Timestamp::now(),
    )
    .await
    .unwrap();
    let r = h.api.get("gpu-all").await.unwrap();
    let loaded: Vec<_> = r
        .status
        .as_ref()
        .unwrap()
        .models
        .iter()
        .filter(|m| m.state == ModelState::Loaded)
        .map(|m| m.name.to_string())
        .collect();
    assert!(!loaded.is_empty(), "{loaded:?}");
    // The router serves what is loaded (the black-box round's finding 9:
    // it answered 404 model_not_found for running models), and a name no
    // registry it can read lists is a 503 to retry, not a 404.
    eventually(30, "the router to see the catalog gone", || async {
        let a = router.chat("not-in-any-registry").await;
        (a.status == 503).then_some(a)
    })
    .await;
    for m in &loaded {
        assert_served_by(&router.chat(m).await, m);
    }
    let unknown = router.chat("not-in-any-registry").await;
    assert!(
        unknown.body.contains("model_unavailable"),
        "{}",
        unknown.body
    );
    assert!(
        unknown.headers.contains_key("retry-after"),
        "{:?}",
        unknown.headers
    );
    assert_eq!(pods(&h, "gpu-all").await, before_all);
    assert_eq!(pods(&h, "gpu-one").await, before_one);

    // Back: Ready again, the models still there (the same pods for the
    // model whose entry did not change).
    catalogs
        .create(
            &PostParams::default(),
            &catalog(json!([
                entry("a", "4Gi"),
                entry("b", "5Gi"),
                entry("c", "3Gi")
            ])),
        )
        .await
        .unwrap();
    until_ready_is(&h, "gpu-one", "True", "AllResidentModelsReady").await;
    let own_pod =
        |p: &BTreeSet<(String, String)>| p.iter().find(|(n, _)| n.contains("own")).cloned();
    assert_eq!(own_pod(&pods(&h, "gpu-one").await), own_pod(&before_one));
}

#[tokio::test]
#[ignore = "needs the local control plane: scripts/test.sh runs it with --include-ignored"]
async fn bad_catalogs_are_refused_or_said_and_evict_nothing() {
    let h = Harness::start("catalog-bad").await;
    let catalogs: Api<ModelCatalog> = Api::namespaced(h.env.client.clone(), &h.env.namespace);
    // The API server refuses a name listed twice (a list keyed by name).
    let twice = catalogs
        .create(
            &PostParams::default(),
            &catalog(json!([entry("a", "1Gi"), entry("a", "2Gi")])),
        )
        .await
        .unwrap_err();
    assert!(
        matches!(&twice, kube::Error::Api(s) if s.code == 422 && s.message.contains("Duplicate value")),
        "{twice}"
    );
    catalogs
        .create(&PostParams::default(), &catalog(json!([entry("a", "1Gi")])))
        .await
        .unwrap();
    residency(
        &h,
        "gpu",
        "0",
        json!({"catalog": {"name": "models", "models": ["a", "zz"]}}),
    )
    .await;
    let message = until_ready_is(&h, "gpu", "False", "CatalogUnavailable").await;
    assert!(message.contains("has no [\"zz\"]"), "{message}");
    // Named by a residency before it exists: the same, until it is made.
    residency(&h, "early", "1", json!({"catalog": {"name": "later"}})).await;
    until_ready_is(&h, "early", "False", "CatalogUnavailable").await;
    let mut later = catalog(json!([entry("x", "1Gi")]));
    later.metadata.name = Some("later".into());
    catalogs
        .create(&PostParams::default(), &later)
        .await
        .unwrap();
    h.request("early", "x").await;
    h.until_state("early", "x", ModelState::Loaded, 30).await;
    // A catalog entry whose template the API server rejects (a container
    // without an image): the model fails as an inline one does, nothing
    // loaded is evicted for it, and it says why.
    let bad = json!({"name": "bad", "size": "1Gi", "template": {"spec": {"containers": [{"name": "server"}]}}});
    catalogs
        .patch(
            "later",
            &PatchParams::default(),
            &Patch::Merge(json!({"spec": {"models": [entry("x", "1Gi"), bad]}})),
        )
        .await
        .unwrap();
    h.request_nowait("early", "bad").await;
    let r = h.until_state("early", "bad", ModelState::Failed, 30).await;
    let status = r.status.as_ref().unwrap();
    let failed = status.model("bad").unwrap();
    assert_eq!(
        failed.reason.as_deref(),
        Some("InvalidTemplate"),
        "{failed:?}"
    );
    assert!(
        failed
            .message
            .as_deref()
            .unwrap_or_default()
            .contains("image"),
        "{failed:?}"
    );
    assert_eq!(status.model("x").unwrap().state, ModelState::Loaded);
    assert_eq!(status.counters.evictions, 0);
}
