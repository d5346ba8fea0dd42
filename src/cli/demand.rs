//! `model-residency demand load|unload` and `model-residency status`:
//! the cluster-facing commands people and scripts use. Also works as a
//! kubectl plugin when the binary is installed as `kubectl-residency`.

use super::Failure;
use k8s_openapi::jiff::Timestamp;
use kube::api::Api;
use model_residency::api::{ModelResidency, ModelState};
use model_residency::quantity::format_bytes;
use model_residency::residency::demand;
use model_residency::residency::labels::is_dns_label;
use model_residency::residency::state::{later, recorded_time, restore, validate};

#[derive(clap::Args, Debug)]
pub struct Target {
    /// Namespace of the ModelResidency (default: the kubeconfig's).
    #[arg(short, long, global = true)]
    namespace: Option<String>,
}

#[derive(clap::Subcommand, Debug)]
pub enum DemandCommand {
    /// Request a model: set its demand key to now (one merge patch; a
    /// second one, just after it, when this clock is behind the last
    /// request the residency processed for the model).
    Load { residency: String, model: String },
    /// Stop demanding a model: remove its demand key, which unloads it.
    Unload { residency: String, model: String },
}

async fn api_of<K>(target: &Target) -> Result<Api<K>, Failure>
where
    K: kube::Resource<Scope = kube::core::NamespaceResourceScope>,
    K::DynamicType: Default,
{
    let client = kube::Client::try_default()
        .await
        .map_err(|e| Failure::other(format!("cannot reach the cluster: {e}")))?;
    Ok(match &target.namespace {
        Some(ns) => Api::namespaced(client, ns),
        None => Api::default_namespaced(client),
    })
}

fn not_found(e: kube::Error, residency: &str) -> Failure {
    match e {
        kube::Error::Api(s) if s.code == 404 => Failure::bad_input(format!(
            "ModelResidency {residency:?} not found (is the CRD installed and the namespace right?)"
        )),
        e => Failure::other(e),
    }
}

pub async fn demand(target: Target, command: DemandCommand) -> Result<(), Failure> {
    let (DemandCommand::Load { model, .. } | DemandCommand::Unload { model, .. }) = &command;
    // No registry can list it, and the API server on hand may not check a
    // map's keys: refused here rather than written.
    if !is_dns_label(model) {
        return Err(Failure::bad_input(format!(
            "{model:?} is not a model name (a DNS label: lowercase letters, digits and '-', at most 63)"
        )));
    }
    let api: Api<ModelResidency> = api_of(&target).await?;
    match command {
        DemandCommand::Load { residency, model } => {
            let mut at = Timestamp::now();
            let mut r = demand::load(&api, &residency, &model, at)
                .await
                .map_err(|e| not_found(e, &residency))?;
            // The answer shows the last request the operator processed for
            // the model. One from a faster clock (a router, another
            // laptop) at or after this one makes this one count as
            // processed already, so it would do nothing: ask again just
            // after it.
            let processed = r
                .status
                .as_ref()
                .and_then(|s| s.model(&model))
                .and_then(|m| recorded_time(m.last_requested.as_deref()));
            if let Some(last) = processed.filter(|last| *last >= at) {
                let again = later(last, std::time::Duration::from_micros(1));
                eprintln!(
                    "note: this clock ({at}) is behind the last request {residency} processed for {model} ({last}); requesting at {again} instead"
                );
                at = again;
                r = demand::load(&api, &residency, &model, at)
                    .await
                    .map_err(|e| not_found(e, &residency))?;
            }
            println!("requested {model} on {residency} at {at}");
            // Its registry with its catalog, if it names one (read now).
            let registry = with_catalog(api.clone().into_client(), r).await.spec.models;
            if !registry.iter().any(|m| m.name == model) {
                eprintln!(
                    "warning: {model:?} is not in {residency}'s registry; it will be refused (UnknownModel)"
                );
            }
        }
        DemandCommand::Unload { residency, model } => {
            demand::unload(&api, &residency, &model)
                .await
                .map_err(|e| not_found(e, &residency))?;
            println!("removed the demand for {model} on {residency}; it will be unloaded");
        }
    }
    Ok(())
}

pub async fn status(target: Target, residency: String) -> Result<(), Failure> {
    let api: Api<ModelResidency> = api_of(&target).await?;
    let r = api
        .get(&residency)
        .await
        .map_err(|e| not_found(e, &residency))?;
    let r = with_catalog(api.into_client(), r).await;
    print!("{}", render_status(&r));
    Ok(())
}

/// `r` with the models of the ModelCatalog it names (read now), as the
/// operator reads it; as it is when it names none, or (with a warning on
/// standard error) when its catalog cannot be read.
pub async fn with_catalog(client: kube::Client, r: ModelResidency) -> ModelResidency {
    let Some(c) = &r.spec.catalog else {
        return r;
    };
    let ns = kube::ResourceExt::namespace(&r).unwrap_or_default();
    let catalogs: Api<model_residency::api::ModelCatalog> = Api::namespaced(client, &ns);
    let catalog = catalogs.get_opt(&c.name).await.ok().flatten();
    match model_residency::residency::catalog::resolve(&r, catalog.as_ref()) {
        Ok(Some(resolved)) => resolved,
        Ok(None) => r,
        Err(problem) => {
            eprintln!("warning: {problem}");
            r
        }
    }
}

/// The human view: resident models in LRU order, used/budget, and what the
/// next load of each other model would evict.
pub fn render_status(r: &ModelResidency) -> String {
    let mut out = String::new();
    let status = r.status.clone().unwrap_or_default();
    let name = r.metadata.name.as_deref().unwrap_or("?");
    let node = model_residency::residency::gpu::node_of(r).unwrap_or("(not placed yet)");
    let where_ = format!("{name} on node {node} GPU {}", r.spec.device);
    let valid = match validate(r) {
        Ok(v) => v,
        Err(problem) => {
            out += &format!("{where_}\nthe spec is invalid: {problem}\n");
            return out;
        }
    };
    // The engine as the status left it: its budget, residents, peak.
    let engine = restore(&valid, &status).engine;
    let (budget, used) = (valid.budget, engine.used());
    out += &format!(
        "{where_}: used {} of {} ({:.0}%), peak {}\n",
        format_bytes(used),
        format_bytes(budget),
        100.0 * used as f64 / budget as f64,
        format_bytes(engine.peak()),
    );
    out += &residents(&engine, &status);
    out += &not_resident(&engine, &status);
    let c = status.counters;
    out += &format!(
        "counters: hits {} loads {} evictions {} refusals {} unloads {}\n",
        c.hits, c.loads, c.evictions, c.refusals, c.unloads
    );
    if r.spec.anticipate.as_ref().is_some_and(|a| a.enabled) || c.anticipated > 0 {
        out += &format!(
            "ahead of demand: anticipated {} used {} wasted {}\n",
            c.anticipated, c.anticipated_used, c.anticipated_wasted
        );
        for m in status.models.iter().filter(|m| m.expected_next.is_some()) {
            out += &format!(
                "  {:<20} next expected {}{}\n",
                m.name,
                m.expected_next.as_deref().unwrap_or_default(),
                m.anticipated_at
                    .as_deref()
                    .map(|t| format!(", brought in ahead at {t}"))
                    .unwrap_or_default()
            );
        }
    }
    for c in &status.conditions {
        out += &format!(
            "condition {}={} ({}): {}\n",
            c.type_, c.status, c.reason, c.message
        );
    }
    out
}

/// The status view's resident models, least recently used first.
fn residents(
    engine: &model_residency::engine::Engine,
    status: &model_residency::api::ModelResidencyStatus,
) -> String {
    let mut out = String::from("resident, least recently used first:\n");
    let residents = engine.residents();
    if residents.is_empty() {
        out += "  (none)\n";
    }
    for id in &residents {
        let name = engine.name(*id);
        let m = status.model(name);
        out += &format!(
            "  {:<20} {:>10}  {:<8} {}{}\n",
            name,
            format_bytes(engine.size(*id)),
            m.map(|m| format!("{:?}", m.state)).unwrap_or_default(),
            m.and_then(|m| m.last_used.clone())
                .map(|t| format!("last used {t}"))
                .unwrap_or_default(),
            if engine.is_pinned(*id) {
                ", pinned"
            } else {
                ""
            },
        );
        // What its pod's server holds of its LoRA adapters.
        if let Some(m) = m.filter(|m| !m.adapters.is_empty()) {
            out += &format!("    adapters loaded: {}\n", m.adapters.join(", "));
        }
    }
    out
}

/// The status view's other models, and what loading each would do.
fn not_resident(
    engine: &model_residency::engine::Engine,
    status: &model_residency::api::ModelResidencyStatus,
) -> String {
    let mut out = String::from("not resident, and what loading it would do:\n");
    let mut any = false;
    for id in engine.models() {
        if engine.is_resident(id) {
            continue;
        }
        any = true;
        let name = engine.name(id);
        let state = status
            .model(name)
            .map(|m| m.state)
            .unwrap_or(ModelState::Unloaded);
        let plan = match engine.plan_load(id) {
            Ok(None) => "queued behind models still loading".to_owned(),
            Ok(Some(v)) if v.is_empty() => "fits without evictions".to_owned(),
            Ok(Some(v)) => format!(
                "evicts {}",
                v.iter()
                    .map(|&e| engine.name(e))
                    .collect::<Vec<_>>()
                    .join(", ")
            ),
            Err(reason) => format!("refused ({})", reason.as_str()),
        };
        out += &format!(
            "  {:<20} {:>10}  {:<8} {}\n",
            name,
            format_bytes(engine.size(id)),
            format!("{state:?}"),
            plan
        );
    }
    if !any {
        out += "  (none)\n";
    }
    out
}

#[cfg(test)]
mod tests {
    #[test]
    fn the_status_view_shows_the_adapters_a_model_pod_holds() {
        let r: model_residency::api::ModelResidency = serde_json::from_value(serde_json::json!({
            "apiVersion": "residency.dev/v1alpha1", "kind": "ModelResidency",
            "metadata": {"name": "gpu-0"},
            "spec": {"nodeName": "n", "device": "0", "budget": "10Gi", "models": [
                {"name": "tiny", "size": "2Gi", "lora": {"adapters": [{"name": "a1", "rank": 8}]}}]},
            "status": {"models": [{"name": "tiny", "state": "Loaded", "size": "2Gi",
                "lastUsed": "2026-12-06T10:00:00Z", "adapters": ["a1", "p"]}]}}))
        .unwrap();
        let view = super::render_status(&r);
        assert!(view.contains("    adapters loaded: a1, p\n"), "{view}");
    }
}
