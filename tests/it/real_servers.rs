//! The fake model server against a real vLLM (0.32.0 for CPU, from PyPI,
//! serving a tiny random-weight Llama made locally: `scripts/vllm.sh`),
//! on the warm tier's contract: the same scenario, with the operator's own
//! sleep and wake calls (`residency::warm::protocol`, `pod_calls::ask`),
//! against both, and the same observable sequence asserted of both; then
//! real vLLM as a model pod through the router and the operator; and the
//! same run of LoRA adapter loads, unloads and requests (vLLM's runtime
//! adapter API, `--enable-lora`) against both; and a second vLLM, tensor
//! parallel over two ranks, as the one pod of a gang (`gpus: 2`). On
//! CPU vLLM refuses `--enable-sleep-mode`; with `VLLM_SERVER_DEV_MODE=1`
//! its sleep endpoints are real (the scheduler pauses, requests are held,
//! `mode` is honoured, level 2 needs `reload_weights`) and only the memory
//! release is a no-op.

use crate::support::artifact_server::sha256_hex;
use crate::support::http::{send, streamed};
use model_residency::controller::decide::{PodCall, PodRef};
use model_residency::controller::pod_calls::ask;
use model_residency::local::model_server::{FakeModelServer, Identity, SleepBehaviour, Tuning};
use model_residency::local::vllm::{
    LORA_HOST_SLOTS, LORA_SLOTS, MAX_LORA_RANK, MODEL, Vllm, write_adapters,
};
use model_residency::residency::warm::protocol;
use serde_json::json;
use std::net::SocketAddr;
use std::time::{Duration, Instant};

/// The operator's call for the vLLM preset at `level`.
fn call(addr: SocketAddr, level: u8, wake: bool) -> PodCall {
    let spec =
        serde_json::from_value(json!({"preset": "vllm", "level": level, "sleepingSize": "1Gi"}))
            .unwrap();
    PodCall {
        model: MODEL.into(),
        pod: PodRef {
            name: "p".into(),
            uid: "u".into(),
        },
        addr: Some(addr),
        wake,
        protocol: protocol(&spec),
    }
}

async fn operator_asks(addr: SocketAddr, level: u8, wake: bool) {
    let (result, seconds) = ask(&call(addr, level, wake), Duration::from_secs(120)).await;
    let what = if wake { "wake" } else { "sleep" };
    result.unwrap_or_else(|e| panic!("the operator's level-{level} {what}: {e}"));
    eprintln!("level-{level} {what} confirmed in {seconds:.3} s");
}

fn chat(max_tokens: u32, stream: bool) -> String {
    let mut body = json!({"model": MODEL, "max_tokens": max_tokens, "ignore_eos": true,
        "stream": stream, "messages": [{"role": "user", "content": "the model"}]});
    if stream {
        // vLLM sends several tokens in one chunk at times: its last chunk
        // counts them (the fake sends one per chunk and no usage).
        body["stream_options"] = json!({"include_usage": true});
    }
    body.to_string()
}

/// What the warm-tier scenario showed of one server.
#[derive(Debug, PartialEq)]
struct Seen {
    /// The long generation ended normally (not "abort"), every token sent.
    long_whole: bool,
    /// The sleep was answered only after the generation ended.
    slept_after_it: bool,
    /// A request sent while asleep was still unanswered a second later.
    held_while_asleep: bool,
    /// ...and answered 200 once woken.
    answered_after_wake: bool,
    /// A level-2 sleep and the preset's wake: the next answer is a 200 that
    /// is not the fake's garbage mark.
    level_2_serves: bool,
}

/// The scenario: a long generation in flight when the operator's sleep is
/// sent; a request while asleep; the wake; a level-2 sleep and wake.
async fn scenario(addr: SocketAddr, long_tokens: u32) -> Seen {
    let long = tokio::spawn(async move {
        let a = send(
            addr,
            "POST",
            "/v1/chat/completions",
            &chat(long_tokens, true),
        )
        .await;
        (a, Instant::now())
    });
    tokio::time::sleep(Duration::from_millis(300)).await;
    assert!(
        !long.is_finished(),
        "the long generation must still run when the sleep is sent"
    );
    operator_asks(addr, 1, false).await;
    let slept = Instant::now();
    let (a, ended) = long.await.unwrap();
    let (reason, text) = streamed(&a);
    eprintln!("long generation: {} {reason:?}, {text} tokens", a.status);
    let long_whole = a.status == 200
        && matches!(reason.as_deref(), Some("stop" | "length"))
        && text == u64::from(long_tokens);
    let held =
        tokio::spawn(
            async move { send(addr, "POST", "/v1/chat/completions", &chat(8, false)).await },
        );
    tokio::time::sleep(Duration::from_secs(1)).await;
    let held_while_asleep = !held.is_finished();
    operator_asks(addr, 1, true).await;
    let answered_after_wake = tokio::time::timeout(Duration::from_secs(30), held)
        .await
        .is_ok_and(|a| a.unwrap().status == 200);
    operator_asks(addr, 2, false).await;
    operator_asks(addr, 2, true).await;
    let after = send(addr, "POST", "/v1/chat/completions", &chat(8, false)).await;
    Seen {
        long_whole,
        // The client reads the last bytes a moment after the server sent them.
        slept_after_it: slept + Duration::from_millis(50) >= ended,
        held_while_asleep,
        answered_after_wake,
        level_2_serves: after.status == 200 && !after.body.contains("garbage"),
    }
}

#[tokio::test]
#[ignore = "needs vLLM for CPU: scripts/test.sh provides it (scripts/vllm.sh) and runs it with --include-ignored"]
async fn the_fake_and_a_real_vllm_keep_the_warm_tier_and_adapter_contracts_alike() {
    let all = Seen {
        long_whole: true,
        slept_after_it: true,
        held_while_asleep: true,
        answered_after_wake: true,
        level_2_serves: true,
    };
    let fake = FakeModelServer::start_with(
        ([127, 0, 0, 1], 0).into(),
        Identity {
            model: MODEL.into(),
            pod: "fake".into(),
        },
        Duration::from_millis(2),
        SleepBehaviour::default(),
        Tuning {
            max_lora_rank: Some(MAX_LORA_RANK),
            ..Default::default()
        },
    )
    .await
    .unwrap();
    // 1,000 chunks 2 ms apart: 2 s.
    assert_eq!(scenario(fake.addr, 1000).await, all, "the fake");
    let adapters = tempfile::tempdir().unwrap();
    write_adapters(
        adapters.path(),
        MODEL,
        &[
            ("a1", 8, 1),
            ("a2", 8, 2),
            ("big", 16, 3),
            ("a3", 8, 4),
            ("p", 8, 5),
        ],
    )
    .unwrap();
    let expected = adapters_expected();
    assert_eq!(
        adapters_scenario(fake.addr, adapters.path()).await,
        expected,
        "the fake's adapters"
    );
    let vllm = Vllm::start().await.unwrap();
    // 1,500 tokens of the tiny model: seconds on two cores.
    assert_eq!(scenario(vllm.addr, 1500).await, all, "real vLLM");
    assert_eq!(
        adapters_scenario(vllm.addr, adapters.path()).await,
        expected,
        "real vLLM's adapters"
    );
    // The same server as a model pod, through the router and the operator.
    through_the_router(&vllm).await;
    adapters_through_the_router(vllm, adapters.path()).await;
}

/// One step of the adapter scenario: what was asked, the status, and what
/// the answer said (an error's type, the answering model, a model list).
type Step = (&'static str, u16, String);

/// What both servers must answer, step by step.
fn adapters_expected() -> Vec<Step> {
    let s = |step: &'static str, status: u16, what: &str| (step, status, what.to_owned());
    vec![
        s(
            "load a1",
            200,
            "Success: LoRA adapter 'a1' added successfully.",
        ),
        s("load a1 again", 400, "InvalidUserInput"),
        s(
            "load a2",
            200,
            "Success: LoRA adapter 'a2' added successfully.",
        ),
        s("load a path with no adapter", 404, "NotFoundError"),
        s("load the base model's name", 400, "InvalidUserInput"),
        s(
            "load a rank over the server's",
            500,
            "InternalServerError: Call to add_lora method failed: Worker failed with error \
             'LoRA rank 16 is greater than max_lora_rank 8.', please check the stack trace \
             above for the root cause",
        ),
        s(
            "list models",
            200,
            "tiny, a1 (parent tiny), a2 (parent tiny)",
        ),
        s("ask a1", 200, "a1"),
        s("ask the base model", 200, "tiny"),
        s(
            "unload a1",
            200,
            "Success: LoRA adapter 'a1' removed successfully.",
        ),
        s("unload a1 again", 404, "NotFoundError"),
        s("ask a1 once unloaded", 404, "NotFoundError"),
        s("list models", 200, "tiny, a2 (parent tiny)"),
    ]
}

/// vLLM's runtime adapter calls, and requests naming adapters, against
/// the server at `addr`, with the adapters `write_adapters` made in `dir` (a1, a2 of rank 8, big of
/// rank 16).
async fn adapters_scenario(addr: SocketAddr, dir: &std::path::Path) -> Vec<Step> {
    let load = |name: &str, path: std::path::PathBuf| {
        json!({"lora_name": name, "lora_path": path}).to_string()
    };
    let post = |path: &'static str, body: String| async move {
        let a = send(addr, "POST", path, &body).await;
        let v: serde_json::Value = serde_json::from_str(&a.body).unwrap_or_default();
        let what = match (a.status, v["error"]["type"].as_str()) {
            (500, Some(kind)) => format!(
                "{kind}: {}",
                v["error"]["message"].as_str().unwrap_or_default()
            ),
            (_, Some(kind)) => kind.to_owned(),
            (_, None) => v["model"]
                .as_str()
                .map_or_else(|| a.body.clone(), str::to_owned),
        };
        (a.status, what)
    };
    let ask = |model: &str| {
        json!({"model": model, "max_tokens": 4, "messages": [{"role": "user", "content": "the model"}]}).to_string()
    };
    let list = || async {
        let a = send(addr, "GET", "/v1/models", "").await;
        let v: serde_json::Value = serde_json::from_str(&a.body).unwrap();
        let names: Vec<String> = v["data"]
            .as_array()
            .unwrap()
            .iter()
            .map(|m| match m["parent"].as_str() {
                Some(parent) => format!("{} (parent {parent})", m["id"].as_str().unwrap_or("")),
                None => m["id"].as_str().unwrap_or("").to_owned(),
            })
            .collect();
        (a.status, names.join(", "))
    };
    let mut steps = Vec::new();
    let mut step = |name: &'static str, (status, what): (u16, String)| {
        steps.push((name, status, what));
    };
    step(
        "load a1",
        post("/v1/load_lora_adapter", load("a1", dir.join("a1"))).await,
    );
    step(
        "load a1 again",
        post("/v1/load_lora_adapter", load("a1", dir.join("a1"))).await,
    );
    step(
        "load a2",
        post("/v1/load_lora_adapter", load("a2", dir.join("a2"))).await,
    );
    step(
        "load a path with no adapter",
        post(
            "/v1/load_lora_adapter",
            load("nowhere", dir.join("nowhere")),
        )
        .await,
    );
    step(
        "load the base model's name",
        post("/v1/load_lora_adapter", load(MODEL, dir.join("a1"))).await,
    );
    step(
        "load a rank over the server's",
        post("/v1/load_lora_adapter", load("big", dir.join("big"))).await,
    );
    step("list models", list().await);
    step("ask a1", post("/v1/chat/completions", ask("a1")).await);
    step(
        "ask the base model",
        post("/v1/chat/completions", ask(MODEL)).await,
    );
    let unload = || json!({"lora_name": "a1"}).to_string();
    step("unload a1", post("/v1/unload_lora_adapter", unload()).await);
    step(
        "unload a1 again",
        post("/v1/unload_lora_adapter", unload()).await,
    );
    step(
        "ask a1 once unloaded",
        post("/v1/chat/completions", ask("a1")).await,
    );
    step("list models", list().await);
    steps
}

/// Real vLLM as model `tiny`'s pod (the stand-in gives the pod vLLM's
/// address and starts no fake), beside a fake model `b` that needs its
/// room: a long generation streamed through the router when `b` is asked
/// for; `tiny` sleeps only once it has ended, whole; a request for `tiny`
/// is held by the router through the wake, on the same pod.
async fn through_the_router(vllm: &Vllm) {
    use crate::support::operator::Harness;
    use crate::support::router::RouterUnderTest;
    use model_residency::api::{ModelResidency, ModelState};
    use model_residency::local::kubelet::SERVED_AT_ANNOTATION;
    let h = Harness::start("real-vllm").await;
    let port = vllm.addr.port();
    let r: ModelResidency = serde_json::from_value(json!({
        "apiVersion": "residency.dev/v1alpha1", "kind": "ModelResidency",
        "metadata": {"name": "gpu"},
        "spec": {"nodeName": h.node, "device": "0", "gpu": {"mode": "env"}, "budget": "10Gi",
            "warm": {"hostBudget": "8Gi"},
            "models": [
                {"name": MODEL, "size": "6Gi", "sleep": {"preset": "vllm", "sleepingSize": "1Gi"},
                 "template": {"metadata": {"annotations": {SERVED_AT_ANNOTATION: "127.0.0.1"}},
                    "spec": {"containers": [{"name": "vllm", "image": "vllm/vllm-openai:v0.32.0",
                        "ports": [{"containerPort": port}]}]}}},
                {"name": "b", "size": "6Gi",
                 "template": {"spec": {"containers": [{"name": "server", "image": "example/b:1"}]}}},
            ]},
    }))
    .unwrap();
    h.api.create(&Default::default(), &r).await.unwrap();
    let router = RouterUnderTest::exact(&h).await;
    let first = router.post("/v1/chat/completions", &chat(8, false)).await;
    assert_eq!(first.status, 200, "{}", first.body);
    let pod = |r: &ModelResidency| {
        let status = r.status.as_ref().unwrap();
        let m = status.models.iter().find(|m| &*m.name == MODEL).unwrap();
        (m.state, m.reason.clone(), m.pod.clone())
    };
    let (_, _, loaded_on) = pod(&h.converged("gpu").await);
    let body = chat(1500, true);
    let long = router.post("/v1/chat/completions", &body);
    let b_later = async {
        tokio::time::sleep(Duration::from_millis(300)).await;
        router.chat("b").await
    };
    let (a, b) = tokio::join!(long, b_later);
    assert_eq!(b.status, 200, "{}", b.body);
    assert_eq!(a.status, 200, "{}", a.body);
    assert_eq!(
        streamed(&a),
        (Some("length".to_owned()), 1500),
        "the generation through the router, whole"
    );
    let r = h.converged("gpu").await;
    assert_eq!(
        pod(&r),
        (
            ModelState::Sleeping,
            Some("Asleep".into()),
            loaded_on.clone()
        )
    );
    let c = r.status.as_ref().unwrap().counters;
    assert_eq!((c.sleeps, c.evictions), (1, 0), "{c:?}");
    // Asleep: the router holds the request through the wake (b makes room).
    let again = router.post("/v1/chat/completions", &chat(8, false)).await;
    assert_eq!(again.status, 200, "{}", again.body);
    let r = h.converged("gpu").await;
    assert_eq!(pod(&r), (ModelState::Loaded, None, loaded_on));
    let c = r.status.as_ref().unwrap().counters;
    assert_eq!((c.sleeps, c.wakes, c.loads), (1, 1, 2), "{c:?}");
    let s = send(vllm.addr, "GET", "/is_sleeping", "").await;
    assert_eq!(s.body, r#"{"is_sleeping":false}"#);
}

/// Real vLLM as model `tiny`'s pod with adapters declared on it (two GPU
/// slots, three in all, `p` pinned): requests naming them through the
/// router, each answered by the adapter asked (greedy decoding: each
/// adapter's text is its own, and the same after it is evicted and loaded
/// again), loads and evictions as the LRU over the three slots says, the
/// pinned one never out, a rank past the server's refused unsent; then
/// vLLM killed and a new one in its place as a replaced pod: the next
/// request for each adapter loads it into the new server and is answered
/// by it.
async fn adapters_through_the_router(vllm: Vllm, dir: &std::path::Path) {
    use crate::support::operator::Harness;
    use crate::support::router::{RouterUnderTest, json_of};
    use kube::api::DeleteParams;
    use model_residency::api::ModelResidency;
    use model_residency::controller::pods::pod_name;
    use model_residency::local::kubelet::SERVED_AT_ANNOTATION;
    let h = Harness::start("real-vllm-lora").await;
    let port = vllm.addr.port();
    let mut adapters: Vec<_> = [("p", 8), ("a1", 8), ("a2", 8), ("a3", 8), ("big", 16)]
        .iter()
        .map(|&(n, rank)| json!({"name": n, "rank": rank, "path": dir.join(n), "pinned": n == "p"}))
        .collect();
    // Two adapters whose files the node agent fetches over HTTP: `f` (a3's
    // files, each with its sha256) and `bad` (the same files, one sha256
    // wrong). vLLM runs on this host, so each one's path is where the
    // agent puts it, `<cache>/<key>`, as its mount would be in a pod.
    let files = crate::support::artifact_server::serve_dir(dir.to_owned()).await;
    let cache = tempfile::tempdir().unwrap();
    let _agent = crate::support::node_agent::start_agent(
        &h,
        cache.path(),
        "64Mi",
        &format!("http://{files}/"),
    );
    for (name, wrong) in [("f", false), ("bad", true)] {
        let sha = |file: &str| {
            let hex = sha256_hex(&std::fs::read(dir.join("a3").join(file)).unwrap());
            if wrong && file == "adapter_config.json" {
                "0".repeat(64)
            } else {
                hex
            }
        };
        let mut a = json!({"name": name, "rank": 8, "artifact": {"size": "1Mi", "files": [
            {"uri": format!("http://{files}/a3/adapter_config.json"), "sha256": sha("adapter_config.json")},
            {"uri": format!("http://{files}/a3/adapter_model.safetensors"), "sha256": sha("adapter_model.safetensors")}]}});
        let spec: model_residency::api::AdapterSpec = serde_json::from_value(a.clone()).unwrap();
        let key = spec.artifact().unwrap().cache_key(name);
        a["path"] = json!(cache.path().join(key));
        adapters.push(a);
    }
    let r: ModelResidency = serde_json::from_value(json!({
        "apiVersion": "residency.dev/v1alpha1", "kind": "ModelResidency",
        "metadata": {"name": "gpu"},
        "spec": {"nodeName": h.node, "device": "0", "gpu": {"mode": "env"}, "budget": "10Gi",
            "models": [{"name": MODEL, "size": "6Gi",
                "lora": {"slots": LORA_SLOTS, "hostSlots": LORA_HOST_SLOTS, "maxRank": MAX_LORA_RANK,
                    "adapters": adapters},
                "template": {"metadata": {"annotations": {SERVED_AT_ANNOTATION: "127.0.0.1"}},
                    "spec": {"containers": [{"name": "vllm", "image": "vllm/vllm-openai:v0.32.0",
                        "ports": [{"containerPort": port}]}]}}}]},
    }))
    .unwrap();
    h.api.create(&Default::default(), &r).await.unwrap();
    let router = RouterUnderTest::exact(&h).await;
    let ask = |model: &str| {
        // The tiny model's tokens mostly decode to nothing: its answer is
        // told by its token ids and their log-probabilities.
        let body = json!({"model": model, "max_tokens": 6, "temperature": 0, "ignore_eos": true,
            "logprobs": true, "return_tokens_as_token_ids": true,
            "messages": [{"role": "user", "content": "the model"}]});
        let router = &router;
        let model = model.to_owned();
        async move {
            let a = router.post("/v1/chat/completions", &body.to_string()).await;
            assert_eq!(a.status, 200, "{model}: {}", a.body);
            let v = json_of(&a);
            assert_eq!(v["model"], model.as_str(), "answered as the model asked");
            let tokens = v["choices"][0]["logprobs"]["content"].as_array().unwrap();
            let said: Vec<String> = tokens
                .iter()
                .map(|t| {
                    format!(
                        "{}@{:.2}",
                        t["token"].as_str().unwrap(),
                        t["logprob"].as_f64().unwrap()
                    )
                })
                .collect();
            said.join(" ")
        }
    };
    let listed = || async {
        let a = send(vllm_addr(port), "GET", "/v1/models", "").await;
        let v: serde_json::Value = serde_json::from_str(&a.body).unwrap();
        let mut ids: Vec<String> = v["data"]
            .as_array()
            .unwrap()
            .iter()
            .filter(|m| m["parent"] == MODEL)
            .map(|m| m["id"].as_str().unwrap().to_owned())
            .collect();
        ids.sort();
        ids
    };
    let metric = |name: &str, adapter: &str| {
        router.metric(
            &format!("model_residency_router_adapter_{name}_total"),
            &format!("adapter=\"{adapter}\""),
        )
    };
    let mut text = std::collections::BTreeMap::new();
    for m in [MODEL, "p", "a1", "a2"] {
        text.insert(m, ask(m).await);
    }
    assert_eq!(listed().await, ["a1", "a2", "p"]);
    // Full: a3 takes the place of a1, the least recently used unpinned.
    text.insert("a3", ask("a3").await);
    assert_eq!(listed().await, ["a2", "a3", "p"]);
    assert_eq!(metric("evictions", "a1"), 1);
    let distinct: std::collections::BTreeSet<&String> = text.values().collect();
    assert_eq!(
        distinct.len(),
        5,
        "each adapter answers its own way: {text:?}"
    );
    // a1 again: loaded again (a2 out), the same answer as before.
    assert_eq!(ask("a1").await, text["a1"]);
    assert_eq!(listed().await, ["a1", "a3", "p"]);
    assert_eq!((metric("loads", "a1"), metric("evictions", "a2")), (2, 1));
    assert_eq!(metric("evictions", "p"), 0);
    // A rank past the server's: refused by the router, never sent.
    let big = router.chat("big").await;
    assert_eq!(big.status, 503, "{}", big.body);
    assert!(!listed().await.contains(&"big".to_owned()));
    // vLLM killed; a new one in its place, as a replaced pod: it holds no
    // adapter, and each is loaded into it by its next request.
    drop(vllm);
    let _replacement = Vllm::start_on(port).await.unwrap();
    h.pods
        .delete(&pod_name("gpu", MODEL), &DeleteParams::default())
        .await
        .unwrap();
    for m in ["a3", "p"] {
        let loads = metric("loads", m);
        assert_eq!(ask(m).await, text[m], "{m} on the new server");
        assert_eq!(metric("loads", m), loads + 1, "{m} loaded again");
    }
    assert_eq!(listed().await, ["a3", "p"]);
    // Files from the node agent: `bad`'s failed their sha256, so the pod
    // started without them and `bad` is refused with the agent's words,
    // never sent; `f`'s were verified, mounted where the server reads
    // them, and answer as a3's (the same weights).
    let bad = router.chat("bad").await;
    assert_eq!(bad.status, 503, "{}", bad.body);
    assert!(bad.body.contains("ChecksumMismatch"), "{}", bad.body);
    assert!(!listed().await.contains(&"bad".to_owned()));
    assert_eq!(ask("f").await, text["a3"], "f's fetched files are a3's");
    assert_eq!(listed().await, ["a3", "f", "p"]);
    let r = h.api.get("gpu").await.unwrap();
    let refused = r
        .status
        .as_ref()
        .and_then(|s| s.conditions.iter().find(|c| c.type_ == "AdaptersRefused"));
    let words = refused.map(|c| c.message.clone()).unwrap_or_default();
    assert!(
        words.contains("`bad`") && words.contains("ChecksumMismatch"),
        "{words}"
    );
    assert!(!words.contains("`f`"), "{words}");
}

fn vllm_addr(port: u16) -> SocketAddr {
    ([127, 0, 0, 1], port).into()
}

/// Real vLLM tensor parallel over two ranks (`--tensor-parallel-size 2`,
/// a worker process per core, their collectives on loopback) as the one
/// pod of a TP-2 gang (`gpus: 2`) on a four-GPU stand-in node: asked for
/// through the router, placed on two GPUs at once, and answered by the
/// real server, the router holding the request through the gang's load.
#[tokio::test]
#[ignore = "needs vLLM for CPU: scripts/test.sh provides it (scripts/vllm.sh) and runs it with --include-ignored"]
async fn a_tensor_parallel_2_vllm_serves_a_gang_through_the_router() {
    use crate::support::operator::Harness;
    use crate::support::router::RouterUnderTest;
    use model_residency::api::{ModelResidency, ModelState};
    use model_residency::local::kubelet::SERVED_AT_ANNOTATION;
    use model_residency::residency::gangs::placements;
    let vllm = Vllm::start_tensor_parallel(2).await.unwrap();
    let log = vllm.log_head();
    assert!(
        log.contains("tensor_parallel_size=2"),
        "vLLM's engine config: {log}"
    );
    let h = Harness::start("real-vllm-tp2").await;
    let models = json!([
        {"name": MODEL, "size": "6Gi", "gpus": 2,
         "template": {"metadata": {"annotations": {SERVED_AT_ANNOTATION: "127.0.0.1"}},
            "spec": {"containers": [{"name": "vllm", "image": "vllm/vllm-openai:v0.32.0",
                "args": ["--tensor-parallel-size=$(RESIDENCY_GANG_SIZE)"],
                "ports": [{"containerPort": vllm.addr.port()}]}]}}},
    ]);
    for device in 0..4 {
        let r: ModelResidency = serde_json::from_value(json!({
            "apiVersion": "residency.dev/v1alpha1", "kind": "ModelResidency",
            "metadata": {"name": format!("gpu-{device}")},
            "spec": {"nodeName": h.node, "device": device.to_string(), "gpu": {"mode": "env"},
                     "budget": "10Gi", "models": models},
        }))
        .unwrap();
        h.api.create(&Default::default(), &r).await.unwrap();
    }
    let router = RouterUnderTest::exact(&h).await;
    let answer = router.post("/v1/chat/completions", &chat(8, false)).await;
    assert_eq!(answer.status, 200, "{}", answer.body);
    let body: serde_json::Value = serde_json::from_str(&answer.body).unwrap();
    assert_eq!(body["model"], MODEL, "answered by vLLM: {}", answer.body);
    // Loaded on two GPUs at once, one pod for both.
    let mut holders = Vec::new();
    let mut pods = std::collections::BTreeSet::new();
    for device in 0..4 {
        let r = h.converged(&format!("gpu-{device}")).await;
        let m = r.status.as_ref().unwrap().model(MODEL).cloned();
        if let Some(m) = m.filter(|m| m.state == ModelState::Loaded) {
            holders.push(format!("gpu-{device}"));
            pods.insert(m.pod.clone().unwrap());
            assert_eq!(placements(&r)[MODEL].members.len(), 2);
        }
    }
    assert_eq!(holders.len(), 2, "{holders:?}");
    assert_eq!(pods.len(), 1, "{pods:?}");
}
