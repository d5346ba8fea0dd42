//! The demo's warm tier: a second GPU whose vLLM-style model sleeps
//! instead of being deleted when room must be made, and wakes on the same
//! pod at its next request (docs/warm.md). The stand-in's fake servers
//! answer vLLM's sleep endpoints as vLLM does, with the delays the pod
//! annotation declares.

use super::{Failure, NAMESPACE, ask, fail, http_get, kubectl, say};
use kube::api::{Api, PostParams};
use model_residency::api::{ModelResidency, ModelStatus};
use model_residency::local::model_server::SLEEP_ANNOTATION;
use std::path::Path;
use std::time::{Duration, Instant};

const NAME: &str = "warm-gpu";

/// Waits until `model`'s status satisfies `done`; its status then.
async fn until(
    api: &Api<ModelResidency>,
    model: &str,
    what: &str,
    done: impl Fn(&ModelStatus) -> bool,
) -> Result<ModelStatus, Failure> {
    let deadline = Instant::now() + Duration::from_secs(60);
    loop {
        let r = api.get(NAME).await.map_err(fail("read warm-gpu"))?;
        let status = r.status.unwrap_or_default();
        if let Some(m) = status.models.iter().find(|m| &*m.name == model && done(m)) {
            return Ok(m.clone());
        }
        if Instant::now() > deadline {
            return Err(Failure {
                message: format!("{model} was not {what} within 60 s"),
                code: 1,
            });
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

pub(super) async fn warm_tier(
    api: &Api<ModelResidency>,
    kc: &Path,
    node: &str,
    router: &str,
    real: bool,
) -> Result<(), Failure> {
    let cold = if real {
        "a cold load here is a container's start and its readiness probe"
    } else {
        "a cold load here is the stand-in's 0.05 s per GiB, 0.3 s"
    };
    say(&format!(
        "The warm tier: {NAME} on the node's second GPU, a 10Gi budget with 16Gi of host memory for sleeping models; chat-a (6Gi) sleeps at 1Gi by the vllm preset (its fake server sleeps in 100 ms and wakes in 50 ms; {cold}), chat-b (6Gi) cannot sleep"
    ));
    // On a real node, the local fake model server image (its sleep from
    // its environment); on the stand-in, vLLM's image, never pulled (its
    // fake server's sleep from the annotation).
    let template = |annotations: serde_json::Value| {
        if real {
            let sleep = annotations[SLEEP_ANNOTATION].as_str();
            return model_residency::local::images::model_server_template(8000, sleep);
        }
        serde_json::json!({"metadata": {"annotations": annotations},
            "spec": {"containers": [{"name": "vllm", "image": "vllm/vllm-openai:v0.32.0",
                "ports": [{"containerPort": 8000}]}]}})
    };
    let r: ModelResidency = serde_json::from_value(serde_json::json!({
        "apiVersion": "residency.dev/v1alpha1", "kind": "ModelResidency",
        "metadata": {"name": NAME},
        "spec": {"nodeName": node, "device": "1", "budget": "10Gi",
            "warm": {"hostBudget": "16Gi"},
            "models": [
                {"name": "chat-a", "size": "6Gi",
                 "sleep": {"preset": "vllm", "sleepingSize": "1Gi"},
                 "template": template(serde_json::json!({SLEEP_ANNOTATION: "sleep=100ms,wake=50ms"}))},
                {"name": "chat-b", "size": "6Gi", "template": template(serde_json::json!({}))},
            ]},
    }))
    .map_err(Failure::other)?;
    api.create(&PostParams::default(), &r)
        .await
        .map_err(fail("create warm-gpu"))?;
    // The router learns of a new residency from its watch: wait until it
    // lists the model (a request before that is a 404).
    let deadline = Instant::now() + Duration::from_secs(30);
    while !http_get(router, "/v1/models")
        .await
        .is_some_and(|(_, body)| body.contains("\"chat-a\""))
    {
        if Instant::now() > deadline {
            return Err(Failure::other("the router did not list chat-a within 30 s"));
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    say("Step W1: chat-a is not loaded: a cold load (its pod starts and becomes Ready).");
    ask(router, "chat-a").await?;
    let first = until(api, "chat-a", "Loaded", |m| {
        m.pod.is_some() && m.loaded_at.is_some()
    })
    .await?;
    say(
        "Step W2: chat-b needs chat-a's room: chat-a is put to sleep (after its server finishes what it runs), not deleted; its pod stays and holds 1Gi.",
    );
    ask(router, "chat-b").await?;
    until(api, "chat-a", "asleep", |m| {
        m.reason.as_deref() == Some("Asleep")
    })
    .await?;
    kubectl(kc, &["get", "mres", NAME, "-n", NAMESPACE, "-o", "wide"]);
    kubectl(
        kc,
        &[
            "get",
            "pods",
            "-n",
            NAMESPACE,
            "-l",
            &format!("residency.dev/residency={NAME}"),
            "-L",
            "residency.dev/model",
        ],
    );
    say(
        "Step W3: chat-a again: a wake on the same pod, not a load (chat-b is evicted to make its room).",
    );
    ask(router, "chat-a").await?;
    let woken = until(api, "chat-a", "awake", |m| m.wake_seconds.is_some()).await?;
    let same = first.pod == woken.pod;
    println!(
        "   chat-a's pod before and after: {} and {} ({}); its wake, asked and confirmed: {:.2} s",
        first.pod.as_deref().unwrap_or("-"),
        woken.pod.as_deref().unwrap_or("-"),
        if same { "the same pod" } else { "a new pod" },
        woken.wake_seconds.unwrap_or_default(),
    );
    let r = api.get(NAME).await.map_err(fail("read warm-gpu"))?;
    let c = r.status.unwrap_or_default().counters;
    println!(
        "   {NAME}: loads {} | sleeps {} | wakes {} | evictions {}",
        c.loads, c.sleeps, c.wakes, c.evictions
    );
    if !same || c.sleeps != 1 || c.wakes != 1 {
        return Err(Failure::other(format!(
            "the warm tier did not sleep and wake chat-a on its pod (sleeps {}, wakes {})",
            c.sleeps, c.wakes
        )));
    }
    Ok(())
}
