//! The request router against the real API server, the real operator and
//! real HTTP: every model pod is a fake model server on its own loopback
//! address (the kubelet stand-in), and every request goes through the
//! router's socket.

use crate::support::cluster::eventually;
use crate::support::operator::Harness;
use crate::support::router::{RouterUnderTest, assert_served_by, json_of};
use crate::support::seed::{SEED, SEED_CASES, assert_matches_the_engine, seed_engine};
use futures::future::join_all;
use k8s_openapi::api::core::v1::Pod;
use kube::api::{Patch, PatchParams};
use model_residency::api::{ModelResidency, ModelState};
use model_residency::local::kubelet::FAIL_ANNOTATION;
use model_residency::router::Config;
use serde_json::json;
use std::collections::BTreeSet;
use std::sync::Arc;
use std::time::Duration;
use tokio::io::{AsyncReadExt, AsyncWriteExt};

fn exact() -> Config {
    Config {
        recency_resolution: Duration::ZERO,
        ..Config::default()
    }
}

async fn label(h: &Harness, residency: &str, key: &str, value: &str) {
    let body = json!({"metadata": {"labels": {key: value}}});
    h.api
        .patch(residency, &PatchParams::default(), &Patch::Merge(&body))
        .await
        .unwrap();
}

fn counters(r: &ModelResidency) -> (u64, u64, u64, u64) {
    let c = &r.status.as_ref().unwrap().counters;
    (c.hits, c.loads, c.evictions, c.refusals)
}

#[tokio::test]
#[ignore = "needs the local control plane: scripts/test.sh runs it with --include-ignored"]
async fn seed_cases_through_the_router_give_the_seed_counters() {
    let h = Harness::start("route-seed").await;
    for (i, (budget, requests)) in SEED_CASES.iter().enumerate() {
        let name = format!("case-{i}");
        h.create(&name, &format!("{budget}Mi"), SEED).await;
        label(&h, &name, "seed-case", &i.to_string()).await;
        // One router per case: every case has the same registry, and the
        // selector keeps the router to this case's GPU.
        let router = RouterUnderTest::start(
            &h,
            Config {
                selector: Some(format!("seed-case={i}")),
                ..exact()
            },
        )
        .await;
        let mut engine = seed_engine(*budget);
        for (n, model) in requests.iter().enumerate() {
            let outcome = engine.request_named(model);
            let answer = router.chat(model).await;
            if matches!(outcome, model_residency::engine::Admission::Refused(_)) {
                assert_eq!(answer.status, 503, "{}", answer.body);
                assert_eq!(json_of(&answer)["error"]["code"], "model_refused");
            } else {
                assert_served_by(&answer, model);
            }
            // The request is processed before the next one is sent, as the
            // seed's sequence is.
            let processed = n as u64 + 1;
            eventually(
                30,
                &format!("{name} to count request {processed}"),
                || async {
                    let r = h.api.get(&name).await.unwrap();
                    r.status.as_ref()?;
                    let (hits, loads, _, refusals) = counters(&r);
                    (hits + loads + refusals == processed).then_some(())
                },
            )
            .await;
        }
        let r = h.converged(&name).await;
        assert_matches_the_engine(&h, &name, &r, &engine).await;
        assert_eq!(
            router.metric("model_residency_router_requests_total", ""),
            requests.len() as u64,
            "the router counts every request"
        );
    }
}

#[tokio::test]
#[ignore = "needs the local control plane: scripts/test.sh runs it with --include-ignored"]
async fn fifty_concurrent_requests_for_a_cold_model_cause_one_load() {
    let h = Harness::start_with("route-cold50", Duration::from_millis(500)).await;
    h.create(
        "gpu",
        "8Gi",
        &[("qwen", "4Gi", false), ("sd", "4Gi", false)],
    )
    .await;
    let router = RouterUnderTest::start(&h, Config::default()).await;
    let answers = join_all((0..50).map(|_| router.chat("qwen"))).await;
    for a in &answers {
        assert_served_by(a, "qwen");
    }
    let r = h.converged("gpu").await;
    assert_eq!(counters(&r).1, 1, "exactly one load");
    assert_eq!(
        router.metric(
            "model_residency_router_demand_writes_total",
            r#"kind="cold""#
        ),
        1,
        "one demand write for the load"
    );
    assert_eq!(
        router.metric(
            "model_residency_router_cold_starts_total",
            r#"model="qwen""#
        ),
        50
    );
    assert_eq!(
        router.metric(
            "model_residency_router_requests_total",
            r#"model="qwen",code="200""#
        ),
        50
    );
}

#[tokio::test]
#[ignore = "needs the local control plane: scripts/test.sh runs it with --include-ignored"]
async fn on_shutdown_held_requests_finish_within_the_grace_or_get_a_503() {
    // Loads take 3 s.
    let h = Harness::start_with("route-shutdown", Duration::from_secs(3)).await;
    h.create(
        "gpu",
        "8Gi",
        &[("qwen", "4Gi", false), ("sd", "4Gi", false)],
    )
    .await;
    let held = |router: std::sync::Arc<RouterUnderTest>, model: &'static str| {
        (0..5)
            .map(|_| {
                let router = router.clone();
                tokio::spawn(async move { router.chat(model).await })
            })
            .collect::<Vec<_>>()
    };
    let pending =
        |router: &RouterUnderTest| router.metric("model_residency_router_pending_requests", "");
    // A grace longer than the load: the held requests are served.
    let patient = std::sync::Arc::new(RouterUnderTest::start(&h, Config::default()).await);
    let served = held(patient.clone(), "qwen");
    eventually(10, "five held requests", || async {
        (pending(&patient) == 5).then_some(())
    })
    .await;
    // Held requests count as in flight for their model (what copies scale on).
    let in_flight = |router: &RouterUnderTest| {
        router.metric(
            "model_residency_router_in_flight_requests",
            r#"model="qwen""#,
        )
    };
    assert_eq!(in_flight(&patient), 5);
    patient.router.drain(Duration::from_secs(20)).await;
    for a in join_all(served).await {
        assert_served_by(&a.unwrap(), "qwen");
    }
    assert_eq!(
        in_flight(&patient),
        0,
        "each answered request leaves the count"
    );
    // A grace shorter than the load: each held request gets a 503 with
    // Retry-After once drain returns, none is dropped unanswered.
    let hasty = std::sync::Arc::new(RouterUnderTest::start(&h, Config::default()).await);
    let refused = held(hasty.clone(), "sd");
    eventually(10, "five held requests", || async {
        (pending(&hasty) == 5).then_some(())
    })
    .await;
    hasty.router.drain(Duration::from_millis(1500)).await;
    // Each client has its answer once drain has returned: waited for,
    // bounded (the load itself would take another 1.5 s and more).
    for task in refused {
        let a = tokio::time::timeout(Duration::from_secs(1), task)
            .await
            .expect("a held request is still unanswered a second after drain returned")
            .unwrap();
        assert_eq!(a.status, 503, "{}", a.body);
        assert!(a.headers.contains_key("retry-after"), "{:?}", a.headers);
        assert!(a.body.contains("shutting down"), "{}", a.body);
    }
}

/// A residency whose models' pods fail to start (`failing`) or never get
/// going: the registry is `(name, size)`.
async fn create_with_failing(
    h: &Harness,
    name: &str,
    budget: &str,
    models: &[(&str, &str)],
    failing: &[&str],
) {
    let models: Vec<_> = models
        .iter()
        .map(|(n, size)| {
            let annotations = if failing.contains(n) {
                json!({FAIL_ANNOTATION: "CUDA out of memory"})
            } else {
                json!({})
            };
            json!({"name": n, "size": size, "template": {
                "metadata": {"annotations": annotations},
                "spec": {"containers": [{"name": "server", "image": format!("example/{n}:1")}]}
            }})
        })
        .collect();
    let r: ModelResidency = serde_json::from_value(json!({
        "apiVersion": "residency.dev/v1alpha1", "kind": "ModelResidency",
        "metadata": {"name": name},
        "spec": {"nodeName": h.node, "device": "7", "budget": budget, "models": models},
    }))
    .unwrap();
    h.api.create(&Default::default(), &r).await.unwrap();
}

fn error_code(a: &crate::support::router::Answer) -> String {
    json_of(a)["error"]["code"]
        .as_str()
        .unwrap_or_default()
        .to_owned()
}

#[tokio::test]
#[ignore = "needs the local control plane: scripts/test.sh runs it with --include-ignored"]
async fn each_error_has_its_status_body_and_headers() {
    let h = Harness::start_with("route-errors", Duration::from_millis(1500)).await;
    create_with_failing(
        &h,
        "gpu",
        "8Gi",
        &[
            ("ok", "2Gi"),
            ("slow", "2Gi"),
            ("broken", "2Gi"),
            ("huge", "20Gi"),
        ],
        &["broken"],
    )
    .await;
    let router = RouterUnderTest::start(&h, Config::default()).await;

    // 404: no residency lists it.
    let a = router.chat("gpt-17").await;
    assert_eq!(
        (a.status, error_code(&a).as_str()),
        (404, "model_not_found")
    );
    assert!(
        json_of(&a)["error"]["message"]
            .as_str()
            .unwrap()
            .contains("gpt-17")
    );
    // A name longer than any model's is not sent back whole.
    let a = router.chat(&"x".repeat(5000)).await;
    assert_eq!(a.status, 404);
    let message = json_of(&a)["error"]["message"].as_str().unwrap().to_owned();
    assert!(message.contains("... (5000 bytes)"), "{message}");
    assert!(message.len() < 300, "{message}");

    // 503 refused, with the sizes and no Retry-After.
    let a = router.chat("huge").await;
    assert_eq!((a.status, error_code(&a).as_str()), (503, "model_refused"));
    let message = json_of(&a)["error"]["message"].as_str().unwrap().to_owned();
    assert!(
        message.contains("20Gi") && message.contains("8Gi"),
        "{message}"
    );
    assert!(!a.headers.contains_key("retry-after"));

    // 503 unavailable with Retry-After: the load failed.
    let a = router.chat("broken").await;
    assert_eq!(
        (a.status, error_code(&a).as_str()),
        (503, "model_unavailable"),
        "{}",
        a.body
    );
    assert!(a.headers.contains_key("retry-after"));
    assert!(a.body.contains("CUDA out of memory"), "{}", a.body);

    // 503 unavailable with Retry-After: the load took longer than the
    // router's --load-timeout (the stand-in takes 1.5 s).
    let impatient = RouterUnderTest::start(
        &h,
        Config {
            load_timeout: Duration::from_millis(300),
            ..Config::default()
        },
    )
    .await;
    let a = impatient.chat("slow").await;
    assert_eq!(
        (a.status, error_code(&a).as_str()),
        (503, "model_unavailable")
    );
    assert!(a.headers.contains_key("retry-after"));
    assert!(a.body.contains("--load-timeout"), "{}", a.body);
    drop(impatient);
    h.until_state("gpu", "slow", ModelState::Loaded, 30).await;

    // 429 with Retry-After: more requests than --max-pending wait for ok.
    let strict = RouterUnderTest::start(
        &h,
        Config {
            max_pending: 1,
            ..Config::default()
        },
    )
    .await;
    let answers = join_all((0..3).map(|_| strict.chat("ok"))).await;
    let codes: Vec<u16> = answers.iter().map(|a| a.status).collect();
    assert_eq!(codes.iter().filter(|&&c| c == 200).count(), 1, "{codes:?}");
    for a in answers.iter().filter(|a| a.status != 200) {
        assert_eq!(
            (a.status, error_code(a).as_str()),
            (429, "too_many_pending")
        );
        assert!(a.headers.contains_key("retry-after"));
    }
    drop(strict);

    // 400s: what is wrong with the request, said.
    let bad = [
        (r#"{"messages":[]}"#, "has no"),
        (r#"{"model":42}"#, "must be a string"),
        ("not json", "not JSON"),
        ("[1,2]", "not an object"),
        (r#"{"model":"ok","model":"slow"}"#, "more than one"),
    ];
    for (body, says) in bad {
        let a = router.post("/v1/chat/completions", body).await;
        assert_eq!(
            (a.status, error_code(&a).as_str()),
            (400, "invalid_request"),
            "{body}"
        );
        assert!(a.body.contains(says), "{body}: {}", a.body);
    }
    let small = RouterUnderTest::start(
        &h,
        Config {
            max_body: 64,
            ..Config::default()
        },
    )
    .await;
    let long = json!({"model": "ok", "prompt": "x".repeat(100)}).to_string();
    let a = small.post("/v1/completions", &long).await;
    assert_eq!(a.status, 400);
    assert!(a.body.contains("--max-body"), "{}", a.body);

    // 408: a body that stops half way, on a raw connection (a client
    // library would not stop).
    let patient = RouterUnderTest::start(
        &h,
        Config {
            body_timeout: Duration::from_secs(1),
            ..Config::default()
        },
    )
    .await;
    let answer = raw_exchange(
        patient.addr,
        b"POST /v1/chat/completions HTTP/1.1\r\nhost: r\r\ncontent-type: application/json\r\n\
          content-length: 100\r\n\r\n{\"model\": \"ok\",",
    )
    .await;
    assert!(answer.starts_with("HTTP/1.1 408"), "{answer}");
    assert!(answer.contains(r#""code":"request_timeout""#), "{answer}");
    assert!(answer.contains("--body-timeout"), "{answer}");
    assert!(
        patient.metric("model_residency_router_requests_total", "code=\"408\"") == 1,
        "counted"
    );

    // 408 too for a body that trickles in just inside the pause timeout,
    // once the whole-body deadline is up.
    let trickled = RouterUnderTest::start(
        &h,
        Config {
            body_timeout: Duration::from_secs(2),
            body_deadline: Duration::from_secs(3),
            ..Config::default()
        },
    )
    .await;
    let mut conn = tokio::net::TcpStream::connect(trickled.addr).await.unwrap();
    conn.write_all(
        b"POST /v1/chat/completions HTTP/1.1\r\nhost: r\r\ncontent-type: application/json\r\n\
          content-length: 100\r\n\r\n{",
    )
    .await
    .unwrap();
    let started = std::time::Instant::now();
    let trickle = async {
        // A byte a second: never a pause of 2 s. Stops when the router
        // closes the connection (a write then fails).
        for _ in 0..30 {
            tokio::time::sleep(Duration::from_secs(1)).await;
            if conn.write_all(b" ").await.is_err() {
                break;
            }
        }
    };
    let _ = tokio::time::timeout(Duration::from_secs(6), trickle).await;
    let mut answer = String::new();
    tokio::time::timeout(Duration::from_secs(20), conn.read_to_string(&mut answer))
        .await
        .expect("an answer, and the connection closed")
        .ok();
    assert!(answer.starts_with("HTTP/1.1 408"), "{answer}");
    assert!(answer.contains("--body-deadline"), "{answer}");
    assert!(started.elapsed() < Duration::from_secs(25));

    // Two X-Model headers are as ambiguous as two "model" fields.
    let answer = raw_exchange(
        patient.addr,
        b"POST /v1/audio/transcriptions HTTP/1.1\r\nhost: r\r\nx-model: ok\r\nx-model: slow\r\n\
          content-length: 0\r\nconnection: close\r\n\r\n",
    )
    .await;
    assert!(answer.starts_with("HTTP/1.1 400"), "{answer}");
    assert!(answer.contains("more than one X-Model header"), "{answer}");

    // CONNECT: a 400 that says what was asked, and the connection closed
    // (what follows would be a tunnel's bytes).
    let answer = raw_exchange(
        patient.addr,
        b"CONNECT evil.example:443 HTTP/1.1\r\nhost: evil.example:443\r\n\r\n",
    )
    .await;
    assert!(answer.starts_with("HTTP/1.1 400"), "{answer}");
    assert!(
        answer.contains("CONNECT evil.example:443 is not served"),
        "{answer}"
    );

    // 502: the pod is listed Ready but nothing answers at its address.
    let pods = h.pods.list(&Default::default()).await.unwrap();
    let ok_pod: &Pod = pods
        .items
        .iter()
        .find(|p| {
            let labels = p.metadata.labels.as_ref().unwrap();
            labels.get("residency.dev/model").map(String::as_str) == Some("slow")
        })
        .unwrap();
    let name = ok_pod.metadata.name.clone().unwrap();
    let body = json!({"status": {"podIP": "127.254.0.1"}});
    h.pods
        .patch_status(&name, &PatchParams::default(), &Patch::Merge(&body))
        .await
        .unwrap();
    eventually(10, "the router to see the new pod IP", || async {
        let a = router.chat("slow").await;
        (a.status == 502).then_some(a)
    })
    .await;
    assert!(
        router.metric(
            "model_residency_router_upstream_errors_total",
            r#"model="slow""#
        ) >= 1
    );
}

#[tokio::test]
#[ignore = "needs the local control plane: scripts/test.sh runs it with --include-ignored"]
async fn streamed_answers_arrive_chunk_by_chunk() {
    let h = Harness::start_kubelet("route-stream", |c| {
        c.stream_delay = Duration::from_millis(200)
    })
    .await;
    h.create("gpu", "8Gi", &[("qwen", "4Gi", false)]).await;
    let router = RouterUnderTest::start(&h, Config::default()).await;
    assert_served_by(&router.chat("qwen").await, "qwen");
    let body = json!({"model": "qwen", "stream": true, "messages": []}).to_string();
    let a = router.post("/v1/chat/completions", &body).await;
    assert_eq!(a.status, 200);
    assert_eq!(a.headers["content-type"], "text/event-stream");
    assert!(a.body.ends_with("data: [DONE]\n\n"), "{}", a.body);
    // Four events 200 ms apart: had the router buffered the answer, they
    // would arrive as one chunk, at once.
    assert!(a.chunks.len() >= 4, "{} chunks", a.chunks.len());
    let first = a.chunks.first().unwrap().0;
    let last = a.chunks.last().unwrap().0;
    assert!(
        last - first >= Duration::from_millis(500),
        "chunks spread over {:?}",
        last - first
    );
}

#[tokio::test]
#[ignore = "needs the local control plane: scripts/test.sh runs it with --include-ignored"]
async fn with_the_operator_stopped_resident_models_serve_and_cold_ones_wait() {
    let mut h = Harness::start("route-no-operator").await;
    h.create(
        "gpu",
        "8Gi",
        &[("qwen", "4Gi", false), ("sd", "4Gi", false)],
    )
    .await;
    let router = RouterUnderTest::start(&h, Config::default()).await;
    assert_served_by(&router.chat("qwen").await, "qwen");
    h.stop_operator().await;
    for _ in 0..5 {
        assert_served_by(&router.chat("qwen").await, "qwen");
    }
    let cold = tokio::spawn({
        let addr = router.addr;
        async move {
            let body = json!({"model": "sd", "messages": []}).to_string();
            crate::support::http::send(addr, "POST", "/v1/chat/completions", &body).await
        }
    });
    tokio::time::sleep(Duration::from_secs(2)).await;
    assert!(
        !cold.is_finished(),
        "the cold request waits for the operator"
    );
    let r = h.api.get("gpu").await.unwrap();
    assert!(r.spec.demand.contains_key("sd"), "its load was requested");
    h.start_operator();
    let a = tokio::time::timeout(Duration::from_secs(30), cold)
        .await
        .expect("served once the operator is back")
        .unwrap();
    assert_served_by(&a, "sd");
}

#[tokio::test]
#[ignore = "needs the local control plane: scripts/test.sh runs it with --include-ignored"]
async fn two_gpus_placement_follows_the_rule_and_a_storm_loses_nothing() {
    let h = Harness::start_kubelet("route-two-gpus", |c| {
        c.load_delay = Duration::from_millis(100);
        // Evicted pods keep serving what they took for a moment, as a model
        // server does in its termination grace period.
        c.terminating_delay = Duration::from_millis(300);
    })
    .await;
    let models: &[(&str, &str, bool)] = &[
        ("a", "4Gi", false),
        ("b", "4Gi", false),
        ("c", "4Gi", false),
        ("d", "4Gi", false),
        ("e", "4Gi", false),
    ];
    h.create("gpu-0", "8Gi", models).await;
    h.create("gpu-1", "8Gi", models).await;
    let router = RouterUnderTest::start(&h, exact()).await;
    let served_on = |a: &crate::support::router::Answer| {
        a.headers["x-residency"]
            .to_str()
            .unwrap()
            .rsplit('/')
            .next()
            .unwrap()
            .to_owned()
    };
    // Both empty: a tie on free VRAM, broken by name. Then the most free
    // VRAM, then a tie again; once both are full, the GPU whose victim was
    // used longest ago (gpu-0's a, before gpu-1's b).
    let mut placed = Vec::new();
    for m in ["a", "b", "c", "d", "e"] {
        let a = router.chat(m).await;
        assert_served_by(&a, m);
        placed.push((m, served_on(&a)));
    }
    let want = [
        ("a", "gpu-0"),
        ("b", "gpu-1"),
        ("c", "gpu-0"),
        ("d", "gpu-1"),
        ("e", "gpu-0"),
    ];
    assert_eq!(placed, want.map(|(m, g)| (m, g.to_owned())));
    let r0 = h.converged("gpu-0").await;
    let resident: BTreeSet<&str> = r0
        .status
        .as_ref()
        .unwrap()
        .models
        .iter()
        .filter(|m| m.state == ModelState::Loaded)
        .map(|m| &*m.name)
        .collect();
    assert_eq!(resident, BTreeSet::from(["c", "e"]), "a was evicted for e");

    // A storm of mixed requests, 16 at a time, across evictions: every one
    // answered by the model it asked for.
    let storm = RouterUnderTest::start(&h, Config::default()).await;
    let names = ["a", "b", "c", "d", "e"];
    let sequence: Vec<&str> = (0..240).map(|i| names[(i * 7 + i / 5) % 5]).collect();
    for chunk in sequence.chunks(16) {
        let chats = join_all(chunk.iter().map(|m| {
            let storm = &storm;
            async move {
                let a = tokio::time::timeout(Duration::from_secs(60), storm.chat(m)).await;
                (m, a)
            }
        }))
        .await;
        let stuck: Vec<&&str> = chats
            .iter()
            .filter(|(_, a)| a.is_err())
            .map(|(m, _)| *m)
            .collect();
        if !stuck.is_empty() {
            let mut states = String::new();
            for r in ["gpu-0", "gpu-1"] {
                let r = h.api.get(r).await.unwrap();
                states.push_str(&format!("{}\n", serde_json::to_string(&r.status).unwrap()));
                states.push_str(&format!("{:?}\n", r.spec.demand));
            }
            let pods = h.pods.list(&Default::default()).await.unwrap();
            let pods: Vec<_> = pods
                .items
                .iter()
                .map(|p| {
                    (
                        p.metadata.name.clone(),
                        p.status.as_ref().and_then(|s| s.phase.clone()),
                        p.metadata.deletion_timestamp.is_some(),
                    )
                })
                .collect();
            panic!(
                "no answer in 60 s for {stuck:?}\n{states}\npods {pods:?}\nrouter metrics:\n{}",
                storm.router.metrics.encode()
            );
        }
        let answers: Vec<_> = chats.into_iter().map(|(_, a)| a.unwrap()).collect();
        for (a, m) in answers.iter().zip(chunk) {
            assert_served_by(a, m);
        }
    }
    let loads = counters(&h.api.get("gpu-0").await.unwrap()).1
        + counters(&h.api.get("gpu-1").await.unwrap()).1;
    assert!(loads > 5, "the storm moved models ({loads} loads in all)");
}

#[tokio::test]
#[ignore = "needs the local control plane: scripts/test.sh runs it with --include-ignored"]
async fn models_are_listed_and_routed_by_path() {
    let h = Harness::start("route-list").await;
    h.create(
        "gpu",
        "8Gi",
        &[("qwen", "4Gi", false), ("resnet", "1Gi", false)],
    )
    .await;
    let router = RouterUnderTest::start(&h, Config::default()).await;
    // KServe v2's readiness questions are answered by the router and never
    // load a model: a cold model is "not ready" (any 4xx) and stays cold.
    let cold = router.get("/v2/models/resnet/ready").await;
    assert_eq!(
        (cold.status, error_code(&cold).as_str()),
        (400, "model_not_ready"),
        "{}",
        cold.body
    );
    assert!(cold.body.contains("Unloaded"), "{}", cold.body);
    let unknown = router.get("/v2/models/nope/ready").await;
    assert_eq!(
        (unknown.status, error_code(&unknown).as_str()),
        (404, "model_not_found")
    );
    assert_eq!(router.get("/v2/health/live").await.status, 200);
    assert_eq!(router.get("/v2/health/ready").await.status, 200);
    // The black-box round's finding 12: a pipelined request (the second
    // written before the first's answer) was never answered. Both are,
    // in order, on the one connection.
    let pipelined = raw_exchange(
        router.addr,
        b"GET /v2/health/live HTTP/1.1\r\nHost: r\r\n\r\nGET /v2 HTTP/1.1\r\nHost: r\r\nConnection: close\r\n\r\n",
    )
    .await;
    assert_eq!(pipelined.matches("HTTP/1.1 200").count(), 2, "{pipelined}");
    assert!(pipelined.contains("model-residency"), "{pipelined}");
    // Behind a refused request whose body the router never needed.
    let pipelined = raw_exchange(
        router.addr,
        b"POST /nope HTTP/1.1\r\nHost: r\r\nContent-Length: 5\r\n\r\nhelloGET /v2 HTTP/1.1\r\nHost: r\r\nConnection: close\r\n\r\n",
    )
    .await;
    assert!(pipelined.contains("HTTP/1.1 404"), "{pipelined}");
    assert!(pipelined.contains("model-residency"), "{pipelined}");
    assert_eq!(json_of(&router.get("/v2").await)["name"], "model-residency");
    let spec = h.api.get("gpu").await.unwrap().spec;
    assert!(spec.demand.is_empty(), "a readiness poll wrote demand");
    // KServe v2 names the model in the path.
    let a = router
        .post("/v2/models/resnet/infer", r#"{"inputs":[]}"#)
        .await;
    assert_served_by(&a, "resnet");
    h.converged("gpu").await;
    assert_eq!(router.get("/v2/models/resnet/ready").await.status, 200);
    // Pipelined proxied requests too.
    let body = r#"{"inputs":[]}"#;
    let one = format!(
        "POST /v2/models/resnet/infer HTTP/1.1\r\nHost: r\r\nContent-Type: application/json\r\nContent-Length: {}\r\n\r\n{body}",
        body.len()
    );
    let last = one.replacen("Host: r\r\n", "Host: r\r\nConnection: close\r\n", 1);
    let pipelined = raw_exchange(router.addr, format!("{one}{last}").as_bytes()).await;
    assert_eq!(pipelined.matches("HTTP/1.1 200").count(), 2, "{pipelined}");
    let chat = r#"{"model":"resnet","messages":[{"role":"user","content":"hi"}]}"#;
    let one = format!(
        "POST /v1/chat/completions HTTP/1.1\r\nHost: r\r\nContent-Length: {}\r\n\r\n{chat}",
        chat.len()
    );
    let last = one.replacen("Host: r\r\n", "Host: r\r\nConnection: close\r\n", 1);
    let pipelined = raw_exchange(router.addr, format!("{one}{one}{last}").as_bytes()).await;
    assert_eq!(pipelined.matches("HTTP/1.1 200").count(), 3, "{pipelined}");
    assert_eq!(
        router
            .get("/v2/models/resnet/versions/1/ready")
            .await
            .status,
        200
    );
    let list = json_of(&router.get("/v1/models").await);
    assert_eq!(list["object"], "list");
    let entries = list["data"].as_array().unwrap();
    let ids: Vec<&str> = entries.iter().map(|e| e["id"].as_str().unwrap()).collect();
    assert_eq!(ids, ["qwen", "resnet"]);
    let resnet = &entries[1];
    assert_eq!(
        (resnet["state"].as_str(), resnet["residency"].as_str()),
        (
            Some("Loaded"),
            Some(format!("{}/gpu", h.env.namespace).as_str())
        )
    );
    assert_eq!(entries[0]["state"], "Unloaded");
    // `created`: the residency's creation time, in Unix seconds.
    let r = h.api.get("gpu").await.unwrap();
    let created = r.metadata.creation_timestamp.unwrap().0.as_second();
    assert!(created > 0);
    assert_eq!(resnet["created"].as_i64(), Some(created));
    // OpenAI's retrieve-model: the list's entry, or a 404.
    assert_eq!(&json_of(&router.get("/v1/models/resnet").await), resnet);
    let missing = router.get("/v1/models/nope").await;
    assert_eq!(
        (missing.status, error_code(&missing).as_str()),
        (404, "model_not_found")
    );
    // Only the inference APIs go to a model's pod: its server's control
    // endpoints are nobody's to call through the router (a sleep sent so
    // left a model Loaded in status and answering nothing).
    for request in [
        "POST /sleep?level=1",
        "POST /wake_up",
        "POST /collective_rpc",
        "POST /release_memory_occupation",
        "GET /generate",
        "POST /v2/models/qwen/sleep",
    ] {
        let raw = format!(
            "{request} HTTP/1.1\r\nhost: r\r\nx-model: qwen\r\ncontent-length: 0\r\nconnection: close\r\n\r\n"
        );
        let answer = raw_exchange(router.addr, raw.as_bytes()).await;
        assert!(answer.starts_with("HTTP/1.1 404"), "{request}: {answer}");
        assert!(answer.contains("path_not_found"), "{request}: {answer}");
    }
    let wrong = router.get("/v1/chat/completions").await;
    assert_eq!(wrong.status, 405);
    assert_eq!(wrong.headers["allow"], "POST");
    assert_eq!(
        h.api.get("gpu").await.unwrap().model_state("qwen"),
        ModelState::Unloaded,
        "nothing refused loaded the model"
    );
    let health = router.get("/healthz").await;
    assert_eq!(health.status, 200);
    let metrics = router.get("/metrics").await;
    assert!(
        metrics
            .body
            .contains("model_residency_router_requests_total"),
        "{}",
        metrics.body
    );
}

#[tokio::test]
#[ignore = "needs the local control plane: scripts/test.sh runs it with --include-ignored"]
async fn a_router_whose_clock_runs_behind_still_loads_a_cold_model() {
    let h = Harness::start("route-clock").await;
    h.create("gpu", "8Gi", &[("qwen", "4Gi", false)]).await;
    // A writer whose clock is 50 s ahead of this router's (within the
    // operator's allowed skew) requested qwen; then it was unloaded. The
    // residency has processed a request later than the router's clock.
    let ahead = k8s_openapi::jiff::Timestamp::now() + Duration::from_secs(50);
    model_residency::residency::demand::load(&h.api, "gpu", "qwen", ahead)
        .await
        .unwrap();
    h.until_state("gpu", "qwen", ModelState::Loaded, 30).await;
    model_residency::residency::demand::unload(&h.api, "gpu", "qwen")
        .await
        .unwrap();
    h.until_state("gpu", "qwen", ModelState::Unloaded, 30).await;
    let router = RouterUnderTest::start(&h, Config::default()).await;
    // Before, the router wrote its own (earlier) time, which the operator
    // ignored as processed, and wrote again on every change that caused:
    // a loop of writes until its clock passed the other's.
    let a = tokio::time::timeout(Duration::from_secs(20), router.chat("qwen"))
        .await
        .expect("served before the router's clock catches up");
    assert_served_by(&a, "qwen");
    let cold_writes = router.metric(
        "model_residency_router_demand_writes_total",
        r#"kind="cold""#,
    );
    assert_eq!(cold_writes, 1, "one request for one cold model");
}

/// One request per model, all sent at once; every one answered in time.
async fn burst(
    router: &RouterUnderTest,
    models: &[(&str, &str, bool)],
) -> Vec<crate::support::router::Answer> {
    let asks = models.iter().map(|(m, _, _)| router.chat(m));
    tokio::time::timeout(Duration::from_secs(150), join_all(asks))
        .await
        .expect("every request answered within 150 s")
}

/// Sends `request` as raw bytes (what a client library would never send)
/// and reads until the router closes the connection, within 20 s.
async fn raw_exchange(addr: std::net::SocketAddr, request: &[u8]) -> String {
    let mut conn = tokio::net::TcpStream::connect(addr).await.unwrap();
    conn.write_all(request).await.unwrap();
    let mut answer = String::new();
    tokio::time::timeout(Duration::from_secs(20), conn.read_to_string(&mut answer))
        .await
        .expect("an answer, and the connection closed, within 20 s")
        .unwrap();
    answer
}

/// Loads and evictions on `names`' residencies, from their status.
async fn loads_and_evictions(h: &Harness, names: &[&str]) -> (u64, u64) {
    let mut total = (0, 0);
    for n in names {
        let c = counters(&h.api.get(n).await.unwrap());
        total.0 += c.1;
        total.1 += c.2;
    }
    total
}

/// The black-box round's livelock: one request per model, sent at once,
/// for more models than a GPU holds (nine 1Gi models on 8Gi; then 17 on two
/// such GPUs). Before, each held request's load evicted a model still
/// loading for another held request, and none was ever answered (1,102
/// loads in 20 s). Every request is answered by its model now, with one
/// load per model: a loading model is never a victim, and the load that
/// would need one waits its turn.
#[tokio::test]
#[ignore = "needs the local control plane: scripts/test.sh runs it with --include-ignored"]
async fn held_requests_for_more_models_than_fit_are_all_answered_with_one_load_each() {
    let h = Harness::start_kubelet("route-burst", |c| {
        c.load_delay = Duration::from_millis(300);
        c.terminating_delay = Duration::from_millis(300);
    })
    .await;
    let names: Vec<String> = (0..17).map(|i| format!("m{i:02}")).collect();
    let nine: Vec<(&str, &str, bool)> = names[..9]
        .iter()
        .map(|n| (n.as_str(), "1Gi", false))
        .collect();
    h.create("one", "8Gi", &nine).await;
    let config = Config {
        recency_resolution: Duration::from_secs(1),
        load_timeout: Duration::from_secs(120),
        selector: Some("burst=one".into()),
        ..Config::default()
    };
    label(&h, "one", "burst", "one").await;
    let router = RouterUnderTest::start(&h, config.clone()).await;
    let answers = burst(&router, &nine).await;
    for (a, (m, _, _)) in answers.iter().zip(&nine) {
        assert_served_by(a, m);
    }
    let (loads, evictions) = loads_and_evictions(&h, &["one"]).await;
    println!("one GPU, 9 models at once: {loads} loads, {evictions} evictions");
    assert!(loads <= 9, "{loads} loads for 9 models");
    assert!(evictions <= 1, "{evictions} evictions");

    // Two GPUs with room for 16, 17 models, one request each at once.
    let seventeen: Vec<(&str, &str, bool)> =
        names.iter().map(|n| (n.as_str(), "1Gi", false)).collect();
    for gpu in ["two-a", "two-b"] {
        h.create(gpu, "8Gi", &seventeen).await;
        label(&h, gpu, "burst", "two").await;
    }
    let router = RouterUnderTest::start(
        &h,
        Config {
            selector: Some("burst=two".into()),
            ..config
        },
    )
    .await;
    let answers = burst(&router, &seventeen).await;
    for (a, (m, _, _)) in answers.iter().zip(&seventeen) {
        assert_served_by(a, m);
    }
    let (loads, evictions) = loads_and_evictions(&h, &["two-a", "two-b"]).await;
    // The router counts its own requests not processed yet where they
    // went, so the burst spreads: one eviction where 16 fit (before it
    // did, most went to the GPU first by name: 9 evictions). Two requests
    // placed at the same instant on two threads may still pick one GPU.
    println!("two GPUs, 17 models at once: {loads} loads, {evictions} evictions");
    assert!(loads <= 17, "{loads} loads for 17 models");
    assert!(evictions <= 2, "{evictions} evictions");
}

/// A refusal recorded on one GPU stands for that GPU only, and the model
/// list names where a request would go.
#[tokio::test]
#[ignore = "needs the local control plane: scripts/test.sh runs it with --include-ignored"]
async fn a_refusal_on_one_gpu_does_not_stand_for_another_that_takes_the_model() {
    let h = Harness::start("route-refused-here").await;
    h.create("a", "10Gi", &[("w", "20Gi", false)]).await;
    let router = RouterUnderTest::start(&h, exact()).await;
    let refused = router.chat("w").await;
    assert_eq!(refused.status, 503, "{}", refused.body);
    assert_eq!(json_of(&refused)["error"]["code"], "model_refused");
    h.until_state("a", "w", ModelState::Refused, 30).await;
    // The model list names no GPU while every one would refuse it.
    let w = json_of(&router.get("/v1/models/w").await);
    assert_eq!(
        (w["state"].as_str(), w["residency"].as_str()),
        (Some("Refused"), None)
    );
    // B lists w at a size it holds: the list names B, a request loads it
    // there, and nothing more is written to A.
    h.create("b", "8Gi", &[("w", "4Gi", false)]).await;
    let ns = &h.env.namespace;
    eventually(10, "the router to see b", || async {
        let w = json_of(&router.get("/v1/models/w").await);
        (w["residency"].as_str() == Some(format!("{ns}/b").as_str())).then_some(())
    })
    .await;
    let a_before = h.api.get("a").await.unwrap().spec.demand;
    let served = router.chat("w").await;
    assert_served_by(&served, "w");
    assert_eq!(
        served.headers["x-residency"].to_str().unwrap(),
        format!("{ns}/b")
    );
    assert_eq!(h.api.get("a").await.unwrap().spec.demand, a_before);
    eventually(10, "the list to say w is Loaded", || async {
        let w = json_of(&router.get("/v1/models/w").await);
        (w["state"] == "Loaded").then_some(())
    })
    .await;
}

/// The official OpenAI Python SDK (scripts/openai-sdk.sh installs it from
/// PyPI) against the router and the fake model servers: chat, streamed
/// chat, completions, streamed completions, embeddings, the model list
/// and each error the router answers, all parsed by the SDK itself.
#[tokio::test]
#[ignore = "needs the local control plane: scripts/test.sh runs it with --include-ignored"]
async fn the_official_openai_sdk_reads_every_answer() {
    let python = std::env::var("MODEL_RESIDENCY_OPENAI_PYTHON").expect(
        "MODEL_RESIDENCY_OPENAI_PYTHON is not set: run scripts/test.sh, which installs the SDK (scripts/openai-sdk.sh)",
    );
    let h = Harness::start("route-openai-sdk").await;
    h.create(
        "gpu",
        "8Gi",
        &[("chat", "1Gi", false), ("huge", "20Gi", false)],
    )
    .await;
    let router = RouterUnderTest::start(&h, Config::default()).await;
    let base = format!("http://{}/v1", router.addr);
    let out = tokio::task::spawn_blocking(move || {
        std::process::Command::new(python)
            .args([
                "tests/fixtures/openai_sdk.py",
                &base,
                "chat",
                "nope",
                "huge",
            ])
            .output()
            .unwrap()
    })
    .await
    .unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "{stdout}\n{stderr}");
    assert!(stdout.contains("all OpenAI SDK checks passed"), "{stdout}");
}

/// A held request whose model is taken away before its pod is Ready (its
/// demand entry removed, as a scale-down would) requests it once more;
/// taken away again, the request fails at once with the reason, long
/// before `--load-timeout`, instead of waiting for a load nobody is doing.
#[tokio::test]
#[ignore = "needs the local control plane: scripts/test.sh runs it with --include-ignored"]
async fn a_model_taken_away_twice_while_a_request_waits_fails_it_at_once() {
    let h = Harness::start_kubelet("route-taken-away", |c| {
        c.load_delay = Duration::from_secs(60);
    })
    .await;
    h.create("gpu", "8Gi", &[("slow", "1Gi", false)]).await;
    let router = RouterUnderTest::start(
        &h,
        Config {
            load_timeout: Duration::from_secs(300),
            ..exact()
        },
    )
    .await;
    let started = std::time::Instant::now();
    let asked = tokio::spawn({
        let addr = router.addr;
        async move {
            let body = json!({"model": "slow", "messages": []}).to_string();
            crate::support::http::send(addr, "POST", "/v1/chat/completions", &body).await
        }
    });
    for round in 1..=2 {
        h.until_state("gpu", "slow", ModelState::Loading, 30).await;
        h.patch_spec("gpu", json!({"demand": {"slow": null}})).await;
        if round == 1 {
            // The router asks for it again.
            eventually(30, "the router to request slow again", || async {
                let r = h.api.get("gpu").await.unwrap();
                r.spec.demand.contains_key("slow").then_some(())
            })
            .await;
        }
    }
    let answer = tokio::time::timeout(Duration::from_secs(30), asked)
        .await
        .expect("answered at once, not at --load-timeout")
        .unwrap();
    assert_eq!(answer.status, 503, "{}", answer.body);
    assert_eq!(json_of(&answer)["error"]["code"], "model_unavailable");
    assert!(answer.body.contains("twice"), "{}", answer.body);
    assert!(started.elapsed() < Duration::from_secs(120));
}

/// The bodies a router holds are bounded in all: 30 MiB bodies held
/// through a slow load took about 50 MB each, so five of them would have
/// had the chart's 256Mi router OOM-killed with every request it held. Two
/// fit the 64 MiB given here; a third is refused at its head (429,
/// Retry-After, the connection closed) before a byte of it is read.
#[tokio::test]
#[ignore = "needs the local control plane: scripts/test.sh runs it with --include-ignored"]
async fn the_bodies_a_router_holds_are_bounded_in_all() {
    let h = Harness::start_with("route-buffered", Duration::from_secs(4)).await;
    h.create("gpu", "8Gi", &[("qwen", "4Gi", false)]).await;
    let config = Config {
        max_buffered: 64 << 20,
        ..Config::default()
    };
    let router = RouterUnderTest::start(&h, config).await;
    let big = Arc::new(
        json!({"model": "qwen", "messages": [{"role": "user", "content": "x".repeat(30 << 20)}]})
            .to_string(),
    );
    let held: Vec<_> = (0..2)
        .map(|_| {
            let (body, addr) = (big.clone(), router.addr);
            tokio::spawn(async move {
                crate::support::http::send(addr, "POST", "/v1/chat/completions", &body).await
            })
        })
        .collect();
    eventually(20, "two bodies held through the load", || async {
        (router.router.buffered() >= 60 << 20).then_some(())
    })
    .await;
    let head = format!(
        "POST /v1/chat/completions HTTP/1.1\r\nhost: r\r\ncontent-type: application/json\r\n\
         content-length: {}\r\nexpect: 100-continue\r\n\r\n",
        big.len()
    );
    let answer = raw_exchange(router.addr, head.as_bytes()).await;
    assert!(answer.starts_with("HTTP/1.1 429"), "{answer}");
    assert!(answer.contains("too_much_buffered"), "{answer}");
    assert!(answer.to_lowercase().contains("retry-after: 1"), "{answer}");
    assert!(router.router.buffered() <= 64 << 20);
    for a in join_all(held).await {
        assert_ne!(a.unwrap().status, 429, "a held body was refused");
    }
    assert_eq!(router.router.buffered(), 0, "every held byte released");
}

/// A streaming client held through a cold load: answered at once, and an
/// SSE comment at every `stream_keepalive` until the model's own stream
/// follows, so a proxy that closes idle connections (here: 1.5 s, against
/// a 4 s load and a 500 ms keep-alive; in production 30 s against minutes
/// and 10 s) never sees one idle. The second cold load says what the first
/// measured (`X-Model-Load-Expected`). A refusal is one error event.
#[tokio::test]
#[ignore = "needs the local control plane: scripts/test.sh runs it with --include-ignored"]
async fn a_streaming_client_held_through_a_load_hears_keepalives_then_the_stream() {
    let h = Harness::start_with("route-keepalive", Duration::from_secs(4)).await;
    h.create(
        "gpu",
        "8Gi",
        &[
            ("qwen", "4Gi", false),
            ("sd", "6Gi", false),
            ("huge", "20Gi", false),
        ],
    )
    .await;
    let config = Config {
        stream_keepalive: Duration::from_millis(500),
        ..exact()
    };
    let router = RouterUnderTest::start(&h, config).await;
    let stream = |m: &str| json!({"model": m, "stream": true, "messages": []}).to_string();
    let a = router.post("/v1/chat/completions", &stream("qwen")).await;
    assert_eq!(a.status, 200, "{}", a.body);
    assert_eq!(a.headers["content-type"], "text/event-stream");
    assert!(
        a.body.starts_with(": waiting for qwen to load"),
        "{}",
        a.body
    );
    assert!(a.body.ends_with("data: [DONE]\n\n"), "{}", a.body);
    assert!(a.body.contains("\"model\":\"qwen\""), "{}", a.body);
    let mut at = Duration::ZERO;
    let mut longest = Duration::ZERO;
    for (t, _) in &a.chunks {
        longest = longest.max(*t - at);
        at = *t;
    }
    assert!(
        at >= Duration::from_secs(3),
        "held through the load: {at:?}"
    );
    assert!(
        longest < Duration::from_millis(1500),
        "idle for {longest:?}"
    );
    let comments = a.body.matches(": waiting for qwen").count();
    assert!(comments >= 5, "{comments} keep-alives in {at:?}");
    // sd evicts qwen; qwen's next cold load says how long the last took.
    assert!(
        router
            .post("/v1/chat/completions", &stream("sd"))
            .await
            .body
            .contains("[DONE]")
    );
    let again = router.post("/v1/chat/completions", &stream("qwen")).await;
    let expected: f64 = again.headers["x-model-load-expected"]
        .to_str()
        .unwrap()
        .parse()
        .unwrap();
    assert!((3.0..30.0).contains(&expected), "{expected}");
    // A model that can never load, or that does not exist: its error
    // status at once, as without a stream.
    let refused = router.post("/v1/chat/completions", &stream("huge")).await;
    assert_eq!(refused.status, 503, "{}", refused.body);
    assert!(refused.body.contains("model_refused"), "{}", refused.body);
    let unknown = router.post("/v1/chat/completions", &stream("nope")).await;
    assert_eq!(unknown.status, 404, "{}", unknown.body);
    // A model already served is streamed as before, with no comment.
    let hot = router.post("/v1/chat/completions", &stream("qwen")).await;
    assert!(!hot.body.contains(": waiting"), "{}", hot.body);
}
