//! LoRA adapters through the router against real vLLM for CPU, with real
//! HTTP on kept connections: what a request naming a loaded adapter costs against one for the
//! base model, and what an adapter's cold load through the router costs
//! against vLLM's own load call, in one run.
//!
//! Run: `cargo bench --bench adapters [-- --samples 20]` (needs
//! `bash scripts/control-plane.sh` and `bash scripts/vllm.sh` once, and
//! MODEL_RESIDENCY_VLLM_PYTHON set to the latter's python). Prints its
//! figures; the ones in docs/performance.md came from this command.
//!
//! The operator and the router in this process, the kubelet stand-in
//! giving the base model's pod vLLM's loopback address; vLLM serves the
//! tiny model with 2 GPU adapter slots and 3 in all
//! ([`model_residency::local::vllm`]), six adapters written by the bench.
//!
//! - **Hit**: one-token chat completions, interleaved, for the base model
//!   and a loaded adapter, through the router and straight to vLLM: the
//!   medians, and the adapter's over the base's through the router.
//! - **Cold load**: requests through the router cycling over five adapters
//!   with three slots, so each is a miss (one unload, one load, then the
//!   request), minus the median adapter hit: the router's load; against
//!   the same work straight to vLLM, interleaved with them (its load call,
//!   the first request, its unload call), minus the straight adapter hit.

mod support;

use http_body_util::BodyExt;
use kube::api::{Api, PostParams};
use model_residency::api::ModelResidency;
use model_residency::local::kubelet::{FakeKubelet, KubeletConfig, SERVED_AT_ANNOTATION};
use model_residency::local::vllm::{
    LORA_HOST_SLOTS, LORA_SLOTS, MAX_LORA_RANK, MODEL, Vllm, write_adapters,
};
use model_residency::router::proxy::Upstream;
use serde_json::json;
use std::net::SocketAddr;
use std::sync::OnceLock;
use std::time::{Duration, Instant};
use support::{arg, bench_args, client_with, ms, percentile, runtime, start_plane};

const NS: &str = "bench-adapters";
const NODE: &str = "node-l";
/// The adapters the requests cycle over (`a0` stays loaded for the hits).
const ADAPTERS: [&str; 6] = ["a0", "a1", "a2", "a3", "a4", "a5"];

/// The bench's one client, keeping its connections (to the router and to
/// vLLM alike), as the router keeps its own to model pods: neither side
/// pays a connection per call.
fn client() -> &'static Upstream {
    static CLIENT: OnceLock<Upstream> = OnceLock::new();
    CLIENT.get_or_init(model_residency::router::proxy::upstream)
}

/// A POST of `body` to `addr` at `path`: the status and the answer.
async fn post(addr: SocketAddr, path: &str, body: String) -> (u16, String) {
    let (parts, ()) = http::Request::builder()
        .method(http::Method::POST)
        .uri(path)
        .header(http::header::CONTENT_TYPE, "application/json")
        .body(())
        .unwrap()
        .into_parts();
    let answer = model_residency::router::proxy::send(client(), addr, &parts, body.into())
        .await
        .unwrap_or_else(|e| panic!("{path}: {e:?}"));
    let status = answer.status().as_u16();
    let bytes = answer.into_body().collect().await.unwrap().to_bytes();
    (status, String::from_utf8_lossy(&bytes).into_owned())
}

/// One request for `model`, a one-token chat completion, to `addr`: its
/// time to the whole answer.
async fn ask(addr: SocketAddr, model: &str) -> Duration {
    let body = json!({"model": model, "max_tokens": 1, "temperature": 0,
        "messages": [{"role": "user", "content": "the model"}]})
    .to_string();
    let t = Instant::now();
    let (status, answer) = post(addr, "/v1/chat/completions", body).await;
    assert_eq!(status, 200, "{model}: {answer}");
    t.elapsed()
}

/// vLLM's own call at `path` with `body`, timed.
async fn call(addr: SocketAddr, path: &str, body: serde_json::Value) -> Duration {
    let t = Instant::now();
    let (status, answer) = post(addr, path, body.to_string()).await;
    assert_eq!(status, 200, "{path}: {answer}");
    t.elapsed()
}

/// The mean of the router's adapter_load_seconds (its unload and load
/// calls to the server), from its exposition.
fn load_seconds(exposition: &str) -> f64 {
    let value = |name: &str| {
        exposition
            .lines()
            .find(|l| l.starts_with(name))
            .and_then(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
            .unwrap_or(0.0)
    };
    let metric = "model_residency_router_adapter_load_seconds";
    value(&format!("{metric}_sum")) / value(&format!("{metric}_count")).max(1.0)
}

fn median(mut samples: Vec<Duration>) -> Duration {
    samples.sort();
    percentile(&samples, 0.5)
}

fn main() {
    let args = bench_args();
    let samples: usize = arg(&args, "--samples", "20").parse().unwrap();
    let plane = start_plane();
    let rt = runtime();
    rt.block_on(async {
        let vllm = Vllm::start().await.expect("real vLLM for CPU");
        let dir = tempfile::tempdir().unwrap();
        let files: Vec<(&str, u64, u64)> = ADAPTERS.iter().zip(1..).map(|(&n, s)| (n, 8, s)).collect();
        write_adapters(dir.path(), MODEL, &files).unwrap();
        let client = client_with(&plane, &[NS]).await;
        let _kubelet = FakeKubelet::start(client.clone(), KubeletConfig::instant(&[NODE]))
            .await
            .unwrap();
        let (_ctx, _operator) = model_residency::operator::spawn_for_namespace(client.clone(), NS);
        let adapters: Vec<_> = ADAPTERS
            .iter()
            .map(|n| json!({"name": n, "rank": 8, "path": dir.path().join(n)}))
            .collect();
        let r: ModelResidency = serde_json::from_value(json!({
            "apiVersion": "residency.dev/v1alpha1", "kind": "ModelResidency",
            "metadata": {"name": "gpu"},
            "spec": {"nodeName": NODE, "device": "0", "gpu": {"mode": "env"}, "budget": "10Gi",
                "models": [{"name": MODEL, "size": "6Gi",
                    "lora": {"slots": LORA_SLOTS, "hostSlots": LORA_HOST_SLOTS, "maxRank": MAX_LORA_RANK,
                        "adapters": adapters},
                    "template": {"metadata": {"annotations": {SERVED_AT_ANNOTATION: "127.0.0.1"}},
                        "spec": {"containers": [{"name": "vllm", "image": "vllm/vllm-openai:v0.32.0",
                            "ports": [{"containerPort": vllm.addr.port()}]}]}}}]},
        }))
        .unwrap();
        let api: Api<ModelResidency> = Api::namespaced(client.clone(), NS);
        api.create(&PostParams::default(), &r).await.unwrap();
        let config = model_residency::router::Config {
            namespace: Some(NS.into()),
            ..Default::default()
        };
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let router_addr = listener.local_addr().unwrap();
        let router = model_residency::router::Router::start(client.clone(), config);
        tokio::spawn(router.clone().serve(listener));
        while !router.ready() {
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        // The base model loaded, a0 loaded into it, both warm.
        for _ in 0..3 {
            ask(router_addr, MODEL).await;
            ask(router_addr, "a0").await;
        }

        let mut hit = [Vec::new(), Vec::new(), Vec::new(), Vec::new()];
        for _ in 0..samples {
            hit[0].push(ask(router_addr, MODEL).await);
            hit[1].push(ask(router_addr, "a0").await);
            hit[2].push(ask(vllm.addr, MODEL).await);
            hit[3].push(ask(vllm.addr, "a0").await);
        }
        let [base, adapter, base_direct, adapter_direct] = hit.map(median);
        println!("adapters bench: real vLLM 0.32 for CPU, tiny model, {samples} samples each");
        println!("  hit, one-token chat completion (median):");
        println!(
            "    through the router: base model {:.1} ms, loaded adapter {:.1} ms: adapter / base {:.2}x",
            ms(base),
            ms(adapter),
            adapter.as_secs_f64() / base.as_secs_f64()
        );
        println!(
            "    straight to vLLM:   base model {:.1} ms, loaded adapter {:.1} ms: adapter / base {:.2}x",
            ms(base_direct),
            ms(adapter_direct),
            adapter_direct.as_secs_f64() / base_direct.as_secs_f64()
        );
        println!(
            "    router / straight: base {:.2}x, adapter {:.2}x",
            base.as_secs_f64() / base_direct.as_secs_f64(),
            adapter.as_secs_f64() / adapter_direct.as_secs_f64()
        );

        // Misses: a1..a5 over the slots a0 and two others share, so each
        // request unloads the least recently used and loads its own.
        let loads_before = router
            .metrics
            .sum_where("model_residency_router_adapter_loads_total", "");
        // Interleaved, a miss through the router then vLLM's own calls for
        // the same work straight (a load, the first request for it, which
        // moves it onto a GPU slot as the router's first request does, and
        // an unload), so that the machine's drift falls on both alike.
        let mut cold = Vec::new();
        let mut direct = Vec::new();
        let mut direct_calls = Vec::new();
        for i in 0..samples {
            let name = ADAPTERS[1 + i % 5];
            cold.push(ask(router_addr, name).await);
            let name = format!("d{i}");
            let path = dir.path().join(ADAPTERS[1 + i % 5]);
            let load = call(
                vllm.addr,
                "/v1/load_lora_adapter",
                json!({"lora_name": name, "lora_path": path}),
            )
            .await;
            let first = ask(vllm.addr, &name).await;
            let unload = call(vllm.addr, "/v1/unload_lora_adapter", json!({"lora_name": name})).await;
            direct.push(load + first + unload);
            direct_calls.push(load + unload);
        }
        let loads = router
            .metrics
            .sum_where("model_residency_router_adapter_loads_total", "")
            - loads_before;
        assert_eq!(loads, samples as u64, "every cycled request a load");
        let router_calls = load_seconds(&router.metrics.encode());
        let cold = median(cold);
        let direct = median(direct);
        let router_load = cold.saturating_sub(adapter);
        let direct_load = direct.saturating_sub(adapter_direct);
        println!("  cold load (median):");
        println!(
            "    through the router: request for an adapter not loaded {:.1} ms, minus the adapter hit: {:.1} ms",
            ms(cold),
            ms(router_load)
        );
        println!(
            "    straight to vLLM: its load call, the first request, its unload call {:.1} ms, minus the adapter hit: {:.1} ms",
            ms(direct),
            ms(direct_load)
        );
        println!(
            "    of which the server's unload and load calls: through the router {:.1} ms (mean, its adapter_load_seconds), straight {:.1} ms (median)",
            router_calls * 1e3,
            ms(median(direct_calls))
        );
        println!(
            "    the whole miss / the same work straight: {:.2}x",
            cold.as_secs_f64() / direct.as_secs_f64()
        );
        println!(
            "    router's load / vLLM's own: {:.2}x (goal <= 1.2x)",
            router_load.as_secs_f64() / direct_load.as_secs_f64()
        );
    });
}
