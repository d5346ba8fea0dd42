//! The demo's chapter on the seed's requests: held cold starts, a hit, LRU
//! evictions, a refusal, an unknown model and an unload, each through the
//! router as a client sends it.

use super::*;

/// One step of the demo's story.
pub(super) enum Step {
    /// A chat completion for the model, through the router.
    Ask(&'static str),
    /// An unload, as an autoscaler writes it.
    Unload(&'static str),
}

/// Sends a chat completion for `model` through the router, as a client
/// would, and shows the answer and how long it took.
pub(super) async fn ask(router: &str, model: &str) -> Result<(), Failure> {
    let addr: std::net::SocketAddr = router.parse().map_err(Failure::other)?;
    let body = format!(r#"{{"model":"{model}","messages":[{{"role":"user","content":"hi"}}]}}"#);
    println!("$ curl -s http://{router}/v1/chat/completions -d '{body}'");
    let start = Instant::now();
    let answer = model_residency::http::send(addr, "POST", "/v1/chat/completions", &body)
        .await
        .map_err(|e| Failure::other(format!("ask the router for {model}: {e}")))?;
    let header = |h: &str| {
        answer
            .headers
            .get(h)
            .and_then(|v| v.to_str().ok())
            .unwrap_or("-")
            .to_owned()
    };
    println!(
        "   HTTP {} in {:.2} s   x-model-pod: {}   x-residency: {}",
        answer.status,
        start.elapsed().as_secs_f64(),
        header("x-model-pod"),
        header("x-residency"),
    );
    let shown = match serde_json::from_str::<serde_json::Value>(&answer.body) {
        Ok(v) if answer.status == 200 => v["choices"][0]["message"]["content"]
            .as_str()
            .map(|c| format!("answer: {c:?}"))
            .unwrap_or_else(|| answer.body.clone()),
        Ok(v) => format!("error: {}", v["error"]),
        Err(_) => answer.body.clone(),
    };
    println!("   {shown}");
    Ok(())
}

/// Waits until the status reflects the spec and nothing is loading.
pub(super) async fn settle(
    api: &Api<ModelResidency>,
    name: &str,
) -> Result<ModelResidency, Failure> {
    let deadline = Instant::now() + Duration::from_secs(60);
    loop {
        let r = api
            .get(name)
            .await
            .map_err(fail("read the ModelResidency"))?;
        if let Some(s) = &r.status
            && s.observed_generation == r.metadata.generation
            && s.models.iter().all(|m| m.state != ModelState::Loading)
        {
            return Ok(r);
        }
        if Instant::now() > deadline {
            return Err(Failure {
                message: format!("{name} did not settle within 60 s"),
                code: 1,
            });
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

/// The seed's requests, one step at a time, each explained, with the
/// residency after it (and its status view after the evictions and the
/// refusal).
pub(super) async fn seed_requests(
    api: &Api<ModelResidency>,
    kc: &Path,
    name: &str,
    router: &str,
) -> Result<(), Failure> {
    let steps: &[(Step, &str)] = &[
        (
            Step::Ask("zimage"),
            "zimage (10900Mi) is not loaded: the router holds the request, writes the load into spec.demand, waits for the pod to be Ready, then proxies.",
        ),
        (
            Step::Ask("qwen-llm"),
            "qwen-llm (3000Mi) fits next to it: another held cold start; 13900Mi used.",
        ),
        (
            Step::Ask("qwen-llm"),
            "qwen-llm again: resident, a hit, answered at once; it becomes the most recently used.",
        ),
        (
            Step::Ask("sdxl"),
            "sdxl (6000Mi) does not fit: the least recently used model (zimage) is evicted first, and sdxl's pod starts only once zimage's pod is gone.",
        ),
        (Step::Ask("small-a"), "small-a (4000Mi) fits: 13000Mi used."),
        (
            Step::Ask("oversized"),
            "oversized (20000Mi) is larger than the whole budget: 503 model_refused with the sizes, nothing evicted.",
        ),
        (
            Step::Ask("gpt-4"),
            "gpt-4 is in no registry: 404 model_not_found.",
        ),
        (
            Step::Ask("zimage"),
            "zimage comes back: qwen-llm and sdxl are the least recently used, so both go.",
        ),
        (
            Step::Unload("small-a"),
            "An autoscaler scales small-a down: its demand entry is removed, the model unloaded (not an eviction).",
        ),
    ];
    for (i, (step, why)) in steps.iter().enumerate() {
        say(&format!("Step {}: {why}", i + 1));
        match *step {
            Step::Ask(model) => ask(router, model).await?,
            Step::Unload(model) => {
                println!("$ model-residency demand unload {name} {model} -n {NAMESPACE}");
                demand::unload(api, name, model)
                    .await
                    .map_err(fail("write demand"))?;
            }
        }
        let r = settle(api, name).await?;
        kubectl(kc, &["get", "mres", "-n", NAMESPACE]);
        if matches!(i, 3 | 5 | 7) {
            println!("$ model-residency status {name} -n {NAMESPACE}");
            let r = super::super::demand::with_catalog(api.clone().into_client(), r).await;
            print!("{}", render_status(&r));
        }
    }
    say(
        "What is loaded where, on every GPU of the namespace (`kubectl residency top` as a kubectl plugin; without --once it refreshes until Ctrl-C):",
    );
    println!("$ model-residency top --once -n {NAMESPACE}");
    print!(
        "{}",
        super::super::top::once(&api.clone().into_client(), NAMESPACE).await?
    );

    Ok(())
}
