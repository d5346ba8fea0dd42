//! The warm tier against the local control plane, with real HTTP: how long
//! a request for an evicted model waits for its first byte when the model
//! was put to sleep, against when its pod was deleted, in one run.
//!
//! Run: `cargo bench --bench warm [-- --samples 10 --floor-samples 50]`
//! (needs `bash scripts/control-plane.sh` once). Prints its figures; the
//! ones in docs/performance.md came from this command.
//!
//! Two residencies alike but for `sleep` (each 10Gi, two 6Gi models, one
//! GPU each, env mode), the operator and the router in this process, the
//! kubelet stand-in's pods Ready 2 s after creation (a cold load) and its
//! fake servers sleeping in 100 ms and waking in 200 ms (a tenth of the
//! load). Each sample, for both in turn: a request for the other model
//! makes the first one sleep (or go), then a request for it is timed to
//! its first byte. The operator's and router's own part of a wake is that
//! time minus the fake server's 200 ms wake, against the ModelResidency
//! write-to-watch round trip measured in the same run: back to back (the
//! goal's floor) and after 250 ms of quiet (as a wake's writes come); and
//! minus the fake's wake as it is measured, called directly in the same
//! run (its timer and this busy process add 1-2 ms to the declared 200).

mod support;

use kube::api::{Api, ListParams, PostParams};
use model_residency::api::{ModelResidency, ModelState};
use model_residency::local::kubelet::{FakeKubelet, KubeletConfig};
use model_residency::local::model_server::{
    FakeModelServer, Identity, SLEEP_ANNOTATION, SleepBehaviour,
};
use serde_json::json;
use std::net::SocketAddr;
use std::time::{Duration, Instant};
use support::{
    QUIET, arg, bench_args, client_with, ms, percentile, poke, quiet_pokes, runtime, start_plane,
    watch_poke,
};

const NS: &str = "bench-warm";
const FLOOR_NS: &str = "bench-warm-floor";
const NODE: &str = "node-w";
const LOAD_DELAY: Duration = Duration::from_secs(2);
const WAKE_DELAY: Duration = Duration::from_millis(200);
/// The fake pods' sleep and wake (their template's annotation), `WAKE_DELAY`'s
/// wake; the direct wakes start a server with the same.
const SLEEP_BEHAVIOUR: &str = "sleep=100ms,wake=200ms";

fn residency(name: &str, device: &str, models: [&str; 2], sleeps: bool) -> ModelResidency {
    let model = |n: &str, sleep: bool| {
        let mut m = json!({"name": n, "size": "6Gi", "template": {
            "metadata": {"annotations": {SLEEP_ANNOTATION: SLEEP_BEHAVIOUR}},
            "spec": {"containers": [{"name": "server", "image": format!("example/{n}:1")}]}}});
        if sleep {
            m["sleep"] = json!({"preset": "vllm", "sleepingSize": "1Gi"});
        }
        m
    };
    serde_json::from_value(json!({
        "apiVersion": "residency.dev/v1alpha1", "kind": "ModelResidency",
        "metadata": {"name": name},
        "spec": {"nodeName": NODE, "device": device, "gpu": {"mode": "env"}, "budget": "10Gi",
                 "warm": {"hostBudget": "8Gi"},
                 "models": [model(models[0], sleeps), model(models[1], false)]},
    }))
    .unwrap()
}

/// A chat completion for `model` through the router: its first byte.
async fn first_byte(router: SocketAddr, model: &str) -> Duration {
    let body = format!(r#"{{"model":"{model}","messages":[{{"role":"user","content":"hi"}}]}}"#);
    let a = model_residency::http::send(router, "POST", "/v1/chat/completions", &body)
        .await
        .unwrap();
    assert_eq!(a.status, 200, "{model}: {}", a.body);
    a.chunks.first().expect("a body").0
}

/// Waits until `model` of `residency` is unloaded and its pod gone.
async fn made_room_of_unloaded(
    api: &Api<ModelResidency>,
    pods: &Api<kube::api::DynamicObject>,
    residency: &str,
    model: &str,
) {
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        let r = api.get(residency).await.unwrap();
        let unloaded = r
            .status
            .as_ref()
            .and_then(|s| s.model(model))
            .is_some_and(|m| m.state == ModelState::Unloaded);
        let lp = ListParams::default().labels(&format!("residency.dev/model={model}"));
        if unloaded && pods.list(&lp).await.unwrap().items.is_empty() {
            return;
        }
        assert!(Instant::now() < deadline, "{model} was not unloaded");
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
}

/// Waits until `model` of `residency` is evicted and its pod gone, or
/// (when it sleeps) asleep, confirmed.
async fn made_room_of(
    api: &Api<ModelResidency>,
    pods: &Api<kube::api::DynamicObject>,
    residency: &str,
    model: &str,
    sleeps: bool,
) {
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        let r = api.get(residency).await.unwrap();
        let m = r.status.as_ref().and_then(|s| s.model(model)).cloned();
        let done = match m {
            Some(m) if sleeps => {
                m.state == ModelState::Sleeping && m.reason.as_deref() == Some("Asleep")
            }
            Some(m) if m.state == ModelState::Evicted => {
                let lp = ListParams::default().labels(&format!("residency.dev/model={model}"));
                pods.list(&lp).await.unwrap().items.is_empty()
            }
            _ => false,
        };
        if done {
            return;
        }
        assert!(Instant::now() < deadline, "{model} was not made room of");
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
}

/// The fake server's own wake, called directly as the operator calls it
/// (asleep first, then `POST /wake_up` timed to its answer), `samples`
/// times, sorted: what a wake costs the server in this process, beyond
/// which the rest of a wake's first byte is the operator's and router's.
async fn direct_wakes(samples: usize) -> Vec<Duration> {
    let identity = Identity {
        model: "direct".into(),
        pod: "direct".into(),
    };
    let sleep = SleepBehaviour::parse(SLEEP_BEHAVIOUR);
    assert_eq!(sleep.wake_delay, WAKE_DELAY);
    let addr: SocketAddr = "127.0.0.1:0".parse().unwrap();
    let server = FakeModelServer::start(addr, identity, Duration::ZERO, sleep)
        .await
        .unwrap();
    let mut wakes = Vec::with_capacity(samples);
    for _ in 0..samples {
        let slept = model_residency::http::send(server.addr, "POST", "/sleep?level=1", "").await;
        assert_eq!(slept.unwrap().status, 200);
        let t = Instant::now();
        let woke = model_residency::http::send(server.addr, "POST", "/wake_up", "").await;
        wakes.push(t.elapsed());
        assert_eq!(woke.unwrap().status, 200);
    }
    wakes.sort();
    wakes
}

fn main() {
    let args = bench_args();
    let samples: usize = arg(&args, "--samples", "10").parse().unwrap();
    let floor_samples: usize = arg(&args, "--floor-samples", "50").parse().unwrap();
    let plane = start_plane();
    let rt = runtime();
    rt.block_on(async {
        let client = client_with(&plane, &[NS, FLOOR_NS]).await;
        let mut config = KubeletConfig::instant(&[NODE]);
        config.nodes[0].gpus = 2;
        config.load_delay = LOAD_DELAY;
        let _kubelet = FakeKubelet::start(client.clone(), config).await.unwrap();
        let (_ctx, _operator) = model_residency::operator::spawn_for_namespace(client.clone(), NS);
        let api: Api<ModelResidency> = Api::namespaced(client.clone(), NS);
        let pods_gvk = kube::api::ApiResource::erase::<k8s_openapi::api::core::v1::Pod>(&());
        let pods: Api<kube::api::DynamicObject> = Api::namespaced_with(client.clone(), NS, &pods_gvk);
        let cases = [("slept", "0", ["wa", "wb"], true), ("deleted", "1", ["ca", "cb"], false)];
        for (name, device, models, sleeps) in cases {
            api.create(&PostParams::default(), &residency(name, device, models, sleeps))
                .await
                .unwrap();
        }
        let router_config = model_residency::router::Config {
            namespace: Some(NS.into()),
            ..Default::default()
        };
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let router_addr = listener.local_addr().unwrap();
        let router = model_residency::router::Router::start(client.clone(), router_config);
        tokio::spawn(router.clone().serve(listener));
        while !router.ready() {
            tokio::time::sleep(Duration::from_millis(20)).await;
        }

        // The floor: a ModelResidency write until a watch sees it.
        let crs: Api<ModelResidency> = Api::namespaced(client.clone(), FLOOR_NS);
        let mut floor_object = residency("floor", "0", ["fa", "fb"], true);
        floor_object.metadata.name = Some("floor".into());
        crs.create(&PostParams::default(), &floor_object).await.unwrap();
        let seen = watch_poke(crs.clone());
        tokio::time::sleep(Duration::from_millis(300)).await;
        let mut floor = Vec::new();
        for i in 0..floor_samples {
            floor.push(poke(&crs, &seen, &format!("p{i}")).await);
        }
        floor.sort();
        // The same write after a quiet spell, as a wake's status write
        // comes after the server's 200 ms wake: writes back to back find
        // the API server hot, which no write of a wake does.
        let quiet = quiet_pokes(&crs, &seen, floor_samples.min(20), QUIET).await;

        // Warm up: each residency's first model loaded once.
        for (_, _, [first, _], _) in cases {
            first_byte(router_addr, first).await;
        }
        let (mut slept, mut deleted, mut free) = (Vec::new(), Vec::new(), Vec::new());
        for _ in 0..samples {
            for (name, _, [first, other], sleeps) in cases {
                first_byte(router_addr, other).await;
                made_room_of(&api, &pods, name, first, sleeps).await;
                let t = first_byte(router_addr, first).await;
                if sleeps { slept.push(t) } else { deleted.push(t) }
            }
            // The wake alone: the other model unloaded and its pod gone
            // first, so the wake needs no room made.
            let (name, _, [first, other], _) = cases[0];
            first_byte(router_addr, other).await;
            made_room_of(&api, &pods, name, first, true).await;
            model_residency::residency::demand::unload(&api, name, other).await.unwrap();
            made_room_of_unloaded(&api, &pods, name, other).await;
            free.push(first_byte(router_addr, first).await);
            first_byte(router_addr, other).await;
            made_room_of(&api, &pods, name, first, true).await;
            first_byte(router_addr, first).await;
        }
        slept.sort();
        deleted.sort();
        free.sort();
        let p50 = |v: &[Duration]| percentile(v, 0.5);
        let floor50 = p50(&floor);
        println!("warm bench: {samples} samples each; the fake pods load in {} ms and wake in {} ms", LOAD_DELAY.as_millis(), WAKE_DELAY.as_millis());
        println!("  ModelResidency write round trip: p50 {:.2} ms, p99 {:.2} ms ({floor_samples} samples)", ms(floor50), ms(percentile(&floor, 0.99)));
        let quiet50 = p50(&quiet);
        println!("  the same write after {} ms quiet: p50 {:.2} ms, p99 {:.2} ms ({} samples)", QUIET.as_millis(), ms(quiet50), ms(percentile(&quiet, 0.99)), quiet.len());
        for (what, v) in [
            ("slept (a wake, the other model evicted first)", &slept),
            ("deleted (a cold load, the other model evicted first)", &deleted),
            ("slept, with its room free (the wake alone)", &free),
        ] {
            println!("  first byte after the model was {what}: p50 {:.1} ms, p99 {:.1} ms, min {:.1} ms", ms(p50(v)), ms(percentile(v, 0.99)), ms(v[0]));
        }
        println!("  deleted / slept at p50: {:.2}x", p50(&deleted).as_secs_f64() / p50(&slept).as_secs_f64());
        let wake_part = p50(&slept).saturating_sub(WAKE_DELAY);
        let load_part = p50(&deleted).saturating_sub(LOAD_DELAY);
        let alone = p50(&free).saturating_sub(WAKE_DELAY);
        println!(
            "  the operator's and router's part of a wake whose room is free: p50 {:.1} ms = {:.2}x the write round trip (goal at most 3x)",
            ms(alone),
            alone.as_secs_f64() / floor50.as_secs_f64()
        );
        println!(
            "  the same over the write after {} ms quiet: {:.2}x",
            QUIET.as_millis(),
            alone.as_secs_f64() / quiet50.as_secs_f64()
        );
        // The fake's declared wake is not what it takes: its timer and this
        // busy process add to it. Its wake called directly, in the same run.
        let direct = direct_wakes(samples.max(12)).await;
        let direct50 = p50(&direct);
        let beyond = p50(&free).saturating_sub(direct50);
        println!(
            "  the fake's wake called directly: p50 {:.2} ms, p99 {:.2} ms (declared {} ms); a wake whose room is free less it: p50 {:.1} ms = {:.2}x the write round trip, {:.2}x after {} ms quiet",
            ms(direct50),
            ms(percentile(&direct, 0.99)),
            WAKE_DELAY.as_millis(),
            ms(beyond),
            beyond.as_secs_f64() / floor50.as_secs_f64(),
            beyond.as_secs_f64() / quiet50.as_secs_f64(),
            QUIET.as_millis(),
        );
        println!(
            "  the operator's and router's part of a wake that evicts (first byte minus the {} ms wake; the evicted pod's deletion included): p50 {:.1} ms = {:.2}x the write round trip",
            WAKE_DELAY.as_millis(),
            ms(wake_part),
            wake_part.as_secs_f64() / floor50.as_secs_f64()
        );
        println!(
            "  the same for a cold load (minus the {} ms load): p50 {:.1} ms = {:.2}x",
            LOAD_DELAY.as_millis(),
            ms(load_part),
            load_part.as_secs_f64() / floor50.as_secs_f64()
        );
        let metrics = router.metrics.encode();
        for line in metrics.lines().filter(|l| l.starts_with("model_residency_router_hold_seconds_count")) {
            println!("  router {line}");
        }
    });
}
