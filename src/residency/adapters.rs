//! Which declared LoRA adapters can never be served, and why: read the same
//! way by the router (which refuses a request for one, unsent) and the
//! operator (which says so in the AdaptersRefused condition).

use crate::api::{AdapterSpec, LoraSpec, ModelSpec};

/// Why `adapter` of base model `base` can never be served by this
/// registry, if it cannot.
pub fn refusal(
    models: &[ModelSpec],
    base: &str,
    lora: &LoraSpec,
    adapter: &AdapterSpec,
) -> Option<String> {
    if adapter.rank > lora.max_rank {
        return Some(format!(
            "the adapter `{}` has rank {}, larger than its base model `{base}`'s lora.maxRank {}: its server would refuse it",
            adapter.name, adapter.rank, lora.max_rank
        ));
    }
    if let Some(problem) = adapter.artifact.as_ref().and_then(|a| a.problem()) {
        return Some(format!(
            "the adapter `{}` of `{base}` cannot be fetched: {problem}",
            adapter.name
        ));
    }
    if models.iter().any(|m| m.name == adapter.name) {
        return Some(format!(
            "the adapter `{}` of `{base}` has the name of a model: a request for that name is the model's",
            adapter.name
        ));
    }
    None
}

/// Every refused adapter of the registry, in words (None: none is).
pub fn refused(models: &[ModelSpec]) -> Option<String> {
    let words: Vec<String> = models
        .iter()
        .filter_map(|m| Some((m, m.lora.as_deref()?)))
        .flat_map(|(m, lora)| {
            lora.adapters
                .iter()
                .filter_map(move |a| refusal(models, &m.name, lora, a))
        })
        .collect();
    (!words.is_empty()).then(|| words.join("; "))
}
