//! The request router against the local control plane, with real HTTP.
//!
//! Run: `cargo bench --bench router [-- --seconds 5 --rounds 3 --cold-samples 10
//! --floor-samples 50 --steady 20 --list-models 1000]` (needs `bash scripts/control-plane.sh`
//! once; installs nginx-light and wrk from Debian's packages through
//! `scripts/bench-tools.sh`). Prints its figures; the ones in
//! docs/performance.md came from this command.
//!
//! - **Hit path**: wrk (POST chat completions for one resident model) at 1
//!   and 64 connections against the same fake model server, five ways in
//!   one run: straight to the pod, through nginx as a plain reverse proxy,
//!   through `model-residency route` (a separate process), and through a
//!   bare hyper forwarder (the HTTP stack's own ceiling, see
//!   `bare_forwarder`) on one multi-thread runtime and in the router's
//!   per-core shape, in
//!   `--rounds` interleaved rounds: p50, p99, requests/s, the CPU each
//!   proxy's own processes used per request (from /proc), and the medians
//!   over the rounds of the router's added p50 against nginx's, of its
//!   throughput over nginx's and of its CPU per request over nginx's and
//!   over the bare per-core forwarder's.
//! - **Cold path**: time to the first answer byte for a model that is not
//!   resident, minus the pod's own creation-to-Ready time (both seen
//!   through watches), against the ModelResidency write-to-watch round trip
//!   measured in the same run (back to back, the goal's floor; after 250 ms
//!   of quiet; and for a copy of the served 21-model residency).
//! - **Write cost**: demand writes per second from one router under a
//!   constant load on 20 resident models.
//! - **Model list under load** (`--list-models N`, 0 skips it): four
//!   residencies over one catalog of N models, then chat p50/p99 on one
//!   connection alone, beside 4 connections looping `GET /readyz` (the
//!   floor: the machine shared with the clients) and while they loop
//!   `GET /v1/models`, in interleaved rounds (#68 finding 6: a list was built on the serving
//!   threads, and a chat request that took 0.7 ms alone took 16 s).

mod support;

// The same allocator as `model-residency` (for the bare forwarders, which
// run as this bench's own processes, and the fake model servers).
#[global_allocator]
static ALLOCATOR: tikv_jemallocator::Jemalloc = tikv_jemallocator::Jemalloc;

use futures::TryStreamExt;
use k8s_openapi::api::core::v1::Pod;
use kube::api::{Api, PostParams};
use kube::runtime::{WatchStreamExt, watcher};
use model_residency::api::{ModelResidency, ModelState};
use model_residency::local::control_plane::spawn_owned;
use model_residency::local::kubelet::{FakeKubelet, KubeletConfig};
use serde_json::json;
use std::collections::HashMap;
use std::net::SocketAddr;
use std::process::{Child, Command};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};
use support::{
    QUIET, arg, bench_args, client_with, copy_as_floor, create_namespace, ms, percentile, poke,
    quiet_pokes, runtime, start_plane, until_state, until_state_of, watch_poke,
};

const NS: &str = "bench-router";
const FLOOR_NS: &str = "bench-router-floor";
/// Where the copy of the served residency lives (no operator watches it).
const SHAPED_FLOOR_NS: &str = "bench-router-floor-shaped";
const NODE: &str = "node-r";
/// The fake pods' own creation-to-Ready time.
const LOAD_DELAY: Duration = Duration::from_millis(200);

#[derive(Clone)]
struct Tools {
    nginx: String,
    wrk: String,
}

fn tools() -> Tools {
    let out = Command::new("bash")
        .arg(concat!(
            env!("CARGO_MANIFEST_DIR"),
            "/scripts/bench-tools.sh"
        ))
        .output()
        .expect("bash scripts/bench-tools.sh");
    assert!(
        out.status.success(),
        "bench-tools: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    let text = String::from_utf8_lossy(&out.stdout);
    let field = |k: &str| {
        text.split_whitespace()
            .find_map(|w| w.strip_prefix(&format!("{k}=")))
            .unwrap_or_else(|| panic!("bench-tools printed no {k}: {text}"))
            .to_owned()
    };
    Tools {
        nginx: field("nginx"),
        wrk: field("wrk"),
    }
}

/// A child process killed with the bench.
struct Proc(Child);

impl Drop for Proc {
    #[allow(unsafe_code)] // a libc call std has no safe wrapper for
    fn drop(&mut self) {
        // SIGTERM, not SIGKILL: nginx's master stops its workers on TERM,
        // while a killed master leaves them running.
        // SAFETY: kill(2) on our own child's pid.
        unsafe {
            libc::kill(self.0.id() as i32, libc::SIGTERM);
        }
        let _ = self.0.wait();
    }
}

fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port()
}

async fn until_listening(addr: SocketAddr) {
    let deadline = Instant::now() + Duration::from_secs(20);
    while tokio::net::TcpStream::connect(addr).await.is_err() {
        assert!(Instant::now() < deadline, "nothing listens on {addr}");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// nginx as a plain reverse proxy to `upstream` (keep-alive upstream
/// connections, as any tuned proxy has), on its own port.
#[allow(unsafe_code)] // a libc call std has no safe wrapper for
fn start_nginx(nginx: &str, upstream: SocketAddr, dir: &std::path::Path) -> (Proc, SocketAddr) {
    let port = free_port();
    let d = dir.display();
    // Workers run as root when the bench does: their temp dirs are ours.
    let user = if unsafe { libc::geteuid() } == 0 {
        "user root;"
    } else {
        ""
    };
    let conf = format!(
        "{user}
worker_processes auto;
daemon off;
pid {d}/nginx.pid;
error_log {d}/error.log warn;
events {{ worker_connections 4096; }}
http {{
  access_log off;
  client_body_temp_path {d}/body;
  proxy_temp_path {d}/proxy;
  fastcgi_temp_path {d}/fastcgi;
  uwsgi_temp_path {d}/uwsgi;
  scgi_temp_path {d}/scgi;
  upstream pod {{ server {upstream}; keepalive 128; }}
  server {{
    listen 127.0.0.1:{port};
    location / {{
      proxy_pass http://pod;
      proxy_http_version 1.1;
      proxy_set_header Connection \"\";
    }}
  }}
}}
"
    );
    let path = dir.join("nginx.conf");
    std::fs::write(&path, conf).unwrap();
    let mut cmd = Command::new(nginx);
    cmd.arg("-p").arg(dir).arg("-c").arg(&path);
    let child = spawn_owned(cmd).expect("start nginx");
    (Proc(child), SocketAddr::from(([127, 0, 0, 1], port)))
}

/// One wrk run's figures.
#[derive(Debug)]
struct Load {
    p50: Duration,
    p99: Duration,
    rps: f64,
    /// Requests answered in the run (wrk's "N requests in").
    requests: f64,
    errors: String,
}

/// CPU seconds `pid` and its children have used (nginx's master and its
/// workers; a forwarder or the router alone).
fn process_cpu(pid: u32) -> f64 {
    let own = |p: u32| {
        model_residency::local::control_plane::cpu_seconds_of(std::path::Path::new(&format!(
            "/proc/{p}/stat"
        )))
        .unwrap_or(0.0)
    };
    let children =
        std::fs::read_to_string(format!("/proc/{pid}/task/{pid}/children")).unwrap_or_default();
    own(pid)
        + children
            .split_whitespace()
            .filter_map(|c| c.parse().ok())
            .map(own)
            .sum::<f64>()
}

fn parse_wrk_duration(s: &str) -> Duration {
    let (num, unit) = s.split_at(s.find(|c: char| c.is_ascii_alphabetic()).unwrap_or(s.len()));
    let v: f64 = num.parse().unwrap_or(f64::NAN);
    let secs = match unit {
        "us" => v / 1e6,
        "ms" => v / 1e3,
        "s" => v,
        "m" => v * 60.0,
        _ => f64::NAN,
    };
    Duration::from_secs_f64(secs.max(0.0))
}

/// A wrk Lua script that POSTs a chat completion, round-robin over `models`.
fn wrk_script(dir: &std::path::Path, models: &[String]) -> std::path::PathBuf {
    let list: Vec<String> = models.iter().map(|m| format!("{m:?}")).collect();
    let script = format!(
        r#"local models = {{{}}}
local i = 0
request = function()
  i = i + 1
  local m = models[(i % #models) + 1]
  local body = '{{"model":"' .. m .. '","messages":[{{"role":"user","content":"hi"}}]}}'
  return wrk.format("POST", "/v1/chat/completions", {{["Content-Type"] = "application/json"}}, body)
end
"#,
        list.join(", ")
    );
    let path = dir.join(format!("post-{}.lua", models.len()));
    std::fs::write(&path, script).unwrap();
    path
}

fn wrk(tools: &Tools, script: &std::path::Path, addr: SocketAddr, conns: usize, secs: u64) -> Load {
    wrk_at(
        tools,
        Some(script),
        addr,
        "/v1/chat/completions",
        conns,
        secs,
    )
}

/// wrk against `path` of `addr`: with a script, what it sends; without, GETs.
fn wrk_at(
    tools: &Tools,
    script: Option<&std::path::Path>,
    addr: SocketAddr,
    path: &str,
    conns: usize,
    secs: u64,
) -> Load {
    let threads = conns.min(2);
    let mut cmd = Command::new(&tools.wrk);
    cmd.args(["-t", &threads.to_string(), "-c", &conns.to_string()])
        .args(["-d", &format!("{secs}s"), "--latency"]);
    if let Some(script) = script {
        cmd.arg("-s").arg(script);
    }
    let out = cmd
        .arg(format!("http://{addr}{path}"))
        .output()
        .expect("run wrk");
    let text = String::from_utf8_lossy(&out.stdout).into_owned();
    let pct = |p: &str| {
        text.lines()
            .map(str::trim)
            .find_map(|l| l.strip_prefix(p))
            .map(|rest| parse_wrk_duration(rest.trim()))
            .unwrap_or_else(|| panic!("wrk printed no {p} latency:\n{text}"))
    };
    let rps = text
        .lines()
        .find_map(|l| l.strip_prefix("Requests/sec:"))
        .and_then(|v| v.trim().parse().ok())
        .unwrap_or_else(|| panic!("wrk printed no Requests/sec:\n{text}"));
    let requests = text
        .lines()
        .find_map(|l| {
            l.trim()
                .split_once(" requests in ")
                .map(|(n, _)| n.to_owned())
        })
        .and_then(|n| n.trim().parse().ok())
        .unwrap_or_else(|| panic!("wrk printed no \"requests in\":\n{text}"));
    let errors = text
        .lines()
        .filter(|l| l.contains("Non-2xx") || l.contains("Socket errors"))
        .map(str::trim)
        .collect::<Vec<_>>()
        .join("; ");
    Load {
        p50: pct("50%"),
        p99: pct("99%"),
        rps,
        requests,
        errors,
    }
}

/// Residency `name` on GPU `device` of the node, in `spec.gpu.mode` `mode`.
fn residency_as(name: &str, device: &str, mode: &str, models: &[String]) -> ModelResidency {
    let models: Vec<_> = models
        .iter()
        .map(|n| json!({"name": n, "size": "1Gi",
            "template": {"spec": {"containers": [{"name": "server", "image": format!("example/{n}:1")}]}}}))
        .collect();
    serde_json::from_value(json!({
        "apiVersion": "residency.dev/v1alpha1", "kind": "ModelResidency",
        "metadata": {"name": name},
        "spec": {"nodeName": NODE, "device": device, "budget": "64Gi", "models": models,
                 "gpu": {"mode": mode}},
    }))
    .unwrap()
}

/// The served residency: claim mode (the default), on GPU 0.
fn residency(models: &[String]) -> ModelResidency {
    residency_as("gpu", "0", "claim", models)
}

/// When each pod of a model was first seen and first seen Ready, by uid,
/// through a watch.
type PodTimes = Arc<Mutex<HashMap<String, (Instant, Option<Instant>)>>>;

fn watch_cold_pods(pods: Api<Pod>, model: &str) -> PodTimes {
    let times: PodTimes = Arc::default();
    let out = times.clone();
    let selector = format!("residency.dev/model={model}");
    tokio::spawn(async move {
        let config = watcher::Config::default().labels(&selector);
        let mut s = std::pin::pin!(watcher(pods, config).applied_objects());
        while let Ok(Some(p)) = s.try_next().await {
            let now = Instant::now();
            let uid = p.metadata.uid.clone().unwrap_or_default();
            let ready = p
                .status
                .iter()
                .flat_map(|s| s.conditions.iter().flatten())
                .any(|c| c.type_ == "Ready" && c.status == "True");
            let mut t = times.lock().unwrap();
            let entry = t.entry(uid).or_insert((now, None));
            if ready && entry.1.is_none() {
                entry.1 = Some(now);
            }
        }
    });
    out
}

/// Each model's distinct request times in the residency's `spec.demand`,
/// with when the watch showed each, in that order.
type DemandSeen = Arc<Mutex<HashMap<String, Vec<(k8s_openapi::jiff::Timestamp, Instant)>>>>;

fn watch_demand(api: Api<ModelResidency>) -> DemandSeen {
    let seen: DemandSeen = Arc::default();
    let out = seen.clone();
    tokio::spawn(async move {
        let mut s = std::pin::pin!(watcher(api, watcher::Config::default()).applied_objects());
        while let Ok(Some(r)) = s.try_next().await {
            let now = Instant::now();
            let mut seen = seen.lock().unwrap();
            for model in r.spec.demand.keys() {
                let Some(at) = r.spec.demand.get(model).and_then(|v| v.parse().ok()) else {
                    continue;
                };
                let times = seen.entry(model.clone()).or_default();
                if times.last().map(|(t, _)| t) != Some(&at) {
                    times.push((at, now));
                }
            }
        }
    });
    out
}

async fn router_metric(router: SocketAddr, name: &str) -> u64 {
    let answer = model_residency::http::send(router, "GET", "/metrics", "")
        .await
        .unwrap();
    model_residency::exposition::sum_where(&answer.body, name, "")
}

/// A bare hyper forwarder, run in its own process (the bench starts itself
/// again with `--bare-forwarder <listen> <upstream>`): the same hyper
/// server and the same sending code as `route` (`proxy::send` on
/// hyper-util's pooled client), the body read whole as `route` reads it,
/// then sent to the one upstream and its answer streamed back. No routing,
/// no JSON, no metrics: what any router on this HTTP stack can do at best
/// on this machine, next to nginx.
fn bare_forwarder(listen: &str, upstream: &str, per_core: bool) {
    let (listen, upstream): (SocketAddr, SocketAddr) =
        (listen.parse().unwrap(), upstream.parse().unwrap());
    if per_core {
        // The router's own shape: a current-thread runtime, listener and
        // pool per core (model_residency::router::workers).
        let cores = std::thread::available_parallelism().map_or(1, |n| n.get());
        let workers = model_residency::router::workers::Workers::start(listen, cores, move |l| {
            forward_all(l, upstream)
        })
        .unwrap();
        std::thread::park();
        drop(workers);
    } else {
        runtime().block_on(async move {
            let listener = tokio::net::TcpListener::bind(listen).await.unwrap();
            forward_all(listener, upstream).await
        });
    }
}

/// Serves `listener`: every request's body read whole and sent to
/// `upstream` with the router's sending code, on this thread's pool.
async fn forward_all(listener: tokio::net::TcpListener, upstream: SocketAddr) {
    use http_body_util::{BodyExt, Full, combinators::BoxBody};
    use model_residency::router::proxy;
    model_residency::http::accept_loop(listener, |stream| {
        tokio::spawn(async move {
            let service = hyper::service::service_fn(
                move |req: http::Request<hyper::body::Incoming>| async move {
                    let client = proxy::thread_upstream();
                    let (parts, body) = req.into_parts();
                    let body = body.collect().await?.to_bytes();
                    let answer = match proxy::send(&client, upstream, &parts, body).await {
                        Ok(a) => a.map(|b| b.boxed()),
                        Err(e) => http::Response::builder()
                            .status(502)
                            .body(BoxBody::new(
                                Full::new(bytes::Bytes::from(format!("{e:?}")))
                                    .map_err(|never| match never {}),
                            ))
                            .unwrap(),
                    };
                    Ok::<_, hyper::Error>(answer)
                },
            );
            let _ = hyper::server::conn::http1::Builder::new()
                .serve_connection(hyper_util::rt::TokioIo::new(stream), service)
                .await;
        });
    })
    .await
}

/// This bench again as a bare forwarder (`flag`: one runtime, or per core)
/// in front of `pod`, once it listens.
async fn start_forwarder(flag: &str, pod: SocketAddr) -> (Proc, SocketAddr) {
    let addr = SocketAddr::from(([127, 0, 0, 1], free_port()));
    let mut cmd = Command::new(std::env::current_exe().unwrap());
    cmd.arg(flag).arg(addr.to_string()).arg(pod.to_string());
    let process = Proc(spawn_owned(cmd).expect("start a bare forwarder"));
    until_listening(addr).await;
    (process, addr)
}

/// One cold load of `model` (of residency `name`) through the router, and
/// back to unloaded: its first byte, the router's part (first byte minus
/// the pod's creation-to-Ready), and that part's pieces.
struct ColdSample {
    ttfb: Duration,
    overhead: Duration,
    /// Request sent -> the router's demand write seen; -> the pod seen;
    /// pod Ready -> first byte (when the demand write was seen).
    parts: Option<(Duration, Duration, Duration)>,
}

struct ColdRig<'a> {
    api: &'a Api<ModelResidency>,
    pods: &'a Api<Pod>,
    router: SocketAddr,
    name: &'a str,
    model: &'a str,
    times: PodTimes,
    demanded: DemandSeen,
}

async fn cold_sample(rig: &ColdRig<'_>) -> ColdSample {
    let (times, demanded, model) = (&rig.times, &rig.demanded, rig.model);
    let known: Vec<String> = times.lock().unwrap().keys().cloned().collect();
    let requests_before = demanded.lock().unwrap().get(model).map_or(0, Vec::len);
    let body = format!(r#"{{"model":"{model}","messages":[{{"role":"user","content":"hi"}}]}}"#);
    let sent = Instant::now();
    let answer = model_residency::http::send(rig.router, "POST", "/v1/chat/completions", &body)
        .await
        .unwrap();
    assert_eq!(answer.status, 200, "{}", answer.body);
    let ttfb = answer.chunks.first().expect("a body").0;
    // The router may see the pod Ready (and answer) just before this
    // bench's own watch does.
    let deadline = Instant::now() + Duration::from_secs(5);
    let (created, ready) = loop {
        let seen = times
            .lock()
            .unwrap()
            .iter()
            .find(|(uid, _)| !known.contains(uid))
            .map(|(_, t)| *t);
        match seen {
            Some((created, Some(ready))) => break (created, ready),
            _ if Instant::now() > deadline => panic!("{model}'s new pod was not seen Ready"),
            _ => tokio::time::sleep(Duration::from_millis(2)).await,
        }
    };
    let requested = demanded
        .lock()
        .unwrap()
        .get(model)
        .and_then(|times| times.get(requests_before))
        .map(|&(_, seen)| seen);
    let parts = requested.map(|requested| {
        (
            requested.saturating_duration_since(sent),
            created.saturating_duration_since(requested),
            (sent + ttfb).saturating_duration_since(ready),
        )
    });
    model_residency::residency::demand::unload(rig.api, rig.name, model)
        .await
        .unwrap();
    until_state_of(
        rig.api,
        rig.name,
        model,
        ModelState::Unloaded,
        Duration::from_secs(60),
    )
    .await;
    let deadline = Instant::now() + Duration::from_secs(30);
    let selector = format!("residency.dev/model={model}");
    while !rig
        .pods
        .list(&kube::api::ListParams::default().labels(&selector))
        .await
        .unwrap()
        .items
        .is_empty()
    {
        assert!(Instant::now() < deadline, "{model}'s pod never went");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    ColdSample {
        ttfb,
        overhead: ttfb.saturating_sub(ready - created),
        parts,
    }
}

fn main() {
    let args = bench_args();
    if let Some(i) = args.iter().position(|a| a == "--bare-forwarder") {
        return bare_forwarder(&args[i + 1], &args[i + 2], false);
    }
    if let Some(i) = args.iter().position(|a| a == "--bare-forwarder-per-core") {
        return bare_forwarder(&args[i + 1], &args[i + 2], true);
    }
    let secs: u64 = arg(&args, "--seconds", "5").parse().unwrap();
    let rounds: usize = arg(&args, "--rounds", "3").parse().unwrap();
    let cold_samples: usize = arg(&args, "--cold-samples", "10").parse().unwrap();
    let floor_samples: usize = arg(&args, "--floor-samples", "50").parse().unwrap();
    let steady: u64 = arg(&args, "--steady", "20").parse().unwrap();
    let list_models: usize = arg(&args, "--list-models", "1000").parse().unwrap();
    let tools = tools();
    let plane = start_plane();
    let rt = runtime();
    let dir = tempfile::tempdir().unwrap();
    rt.block_on(async {
        let client = client_with(&plane, &[NS, FLOOR_NS]).await;
        create_namespace(&client, SHAPED_FLOOR_NS).await;
        let mut config = KubeletConfig::instant(&[NODE]);
        // GPU 0 serves, 1 and 2 hold the claim/env pair, 3-6 the model
        // list's four residencies.
        config.nodes[0].gpus = 7;
        config.load_delay = LOAD_DELAY;
        let _kubelet = FakeKubelet::start(client.clone(), config).await.unwrap();
        let (_ctx, _operator) = model_residency::operator::spawn_for_namespace(client.clone(), NS);

        let hot: Vec<String> = (0..20).map(|i| format!("m{i}")).collect();
        let mut all = hot.clone();
        all.push("cold".into());
        let api: Api<ModelResidency> = Api::namespaced(client.clone(), NS);
        api.create(&PostParams::default(), &residency(&all))
            .await
            .unwrap();
        // The claim's cost per load: two one-model residencies alike but
        // for spec.gpu.mode, on the node's second and third GPUs.
        // (Each on a GPU of its own: one GPU, however named, is one budget.)
        for (name, device, mode, model) in [("gpu-claim", "1", "claim", "cold-claim"), ("gpu-env", "2", "env", "cold-env")] {
            api.create(&PostParams::default(), &residency_as(name, device, mode, &[model.into()]))
                .await
                .unwrap();
        }
        for m in &hot {
            model_residency::residency::demand::load(&api, "gpu", m, k8s_openapi::jiff::Timestamp::now())
                .await
                .unwrap();
        }
        for m in &hot {
            until_state(&api, m, ModelState::Loaded, Duration::from_secs(60)).await;
        }

        // The router, as `model-residency route` runs in its Deployment.
        let router_addr = SocketAddr::from(([127, 0, 0, 1], free_port()));
        let mut cmd = Command::new(env!("CARGO_BIN_EXE_model-residency"));
        cmd.env("KUBECONFIG", plane.kubeconfig())
            .env("RUST_LOG", "warn")
            .args(["route", "--namespace", NS, "--recency-resolution", "5s"])
            .args(["--http-addr", &router_addr.to_string()])
            .stdout(std::process::Stdio::null())
            .stderr(std::fs::File::create(dir.path().join("router.log")).unwrap());
        let _router = Proc(spawn_owned(cmd).expect("start the router"));
        let deadline = Instant::now() + Duration::from_secs(30);
        loop {
            let ready = model_residency::http::send(router_addr, "GET", "/readyz", "")
                .await
                .is_ok_and(|a| a.status == 200);
            if ready {
                break;
            }
            assert!(Instant::now() < deadline, "the router never became ready");
            tokio::time::sleep(Duration::from_millis(50)).await;
        }

        let pods: Api<Pod> = Api::namespaced(client.clone(), NS);
        let m0 = pods
            .list(&kube::api::ListParams::default().labels("residency.dev/model=m0"))
            .await
            .unwrap()
            .items
            .into_iter()
            .find(|p| p.metadata.deletion_timestamp.is_none())
            .expect("m0's pod");
        let pod_ip = m0.status.unwrap().pod_ip.unwrap();
        let pod_addr: SocketAddr = format!("{pod_ip}:8080").parse().unwrap();
        let (_nginx, nginx_addr) = start_nginx(&tools.nginx, pod_addr, dir.path());
        until_listening(nginx_addr).await;
        let (_bare, bare_addr) = start_forwarder("--bare-forwarder", pod_addr).await;
        let (_core, core_addr) = start_forwarder("--bare-forwarder-per-core", pod_addr).await;

        println!(
            "== hit path: POST /v1/chat/completions for one resident model, {secs} s per run, {rounds} rounds of the five targets back to back"
        );
        println!(
            "{:<7} {:<6} {:<8} {:>10} {:>10} {:>12} {:>12}  errors",
            "conns", "round", "via", "p50 ms", "p99 ms", "requests/s", "cpu us/req"
        );
        let one = wrk_script(dir.path(), &hot[..1]);
        for conns in [1usize, 64] {
            // Per round: the router's added p50 minus nginx's, and its
            // throughput over nginx's. Rounds interleave the targets so a
            // machine that slows down or speeds up weighs on all three.
            let (mut added_gap, mut ratios) = (Vec::new(), Vec::new());
            let (mut bare_gap, mut bare_ratios) = (Vec::new(), Vec::new());
            let mut core_ratios = Vec::new();
            // CPU per request of the proxy's own processes: steadier than
            // throughput on two cores shared with wrk and the fake server.
            let (mut cpu_nginx, mut cpu_core) = (Vec::new(), Vec::new());
            for round in 1..=rounds {
                let mut row = Vec::new();
                let mut cpu = Vec::new();
                let targets = [
                    ("direct", pod_addr, None),
                    ("nginx", nginx_addr, Some(_nginx.0.id())),
                    ("router", router_addr, Some(_router.0.id())),
                    ("hyper", bare_addr, Some(_bare.0.id())),
                    ("hyper-pc", core_addr, Some(_core.0.id())),
                ];
                for (via, addr, pid) in targets {
                    let (tools, one) = (tools.clone(), one.clone());
                    let before = pid.map(process_cpu);
                    let load = tokio::task::spawn_blocking(move || wrk(&tools, &one, addr, conns, secs))
                        .await
                        .unwrap();
                    let per_request = pid
                        .zip(before)
                        .map(|(p, b)| (process_cpu(p) - b) / load.requests.max(1.0) * 1e6);
                    println!(
                        "{conns:<7} {round:<6} {via:<8} {:>10.3} {:>10.3} {:>12.0} {:>12}  {}",
                        ms(load.p50),
                        ms(load.p99),
                        load.rps,
                        per_request.map_or("-".to_owned(), |c| format!("{c:.1}")),
                        load.errors
                    );
                    row.push(load);
                    cpu.push(per_request.unwrap_or(f64::NAN));
                }
                cpu_nginx.push(cpu[2] / cpu[1]);
                cpu_core.push(cpu[2] / cpu[4]);
                let (direct, nginx, router, bare, core) =
                    (&row[0], &row[1], &row[2], &row[3], &row[4]);
                let added = |via: &Load| ms(via.p50.saturating_sub(direct.p50));
                let (nginx_added, router_added) = (added(nginx), added(router));
                println!(
                    "   added p50: nginx {nginx_added:.3} ms, router {router_added:.3} ms, bare hyper {:.3} ms; throughput router/nginx {:.2}x, bare hyper/nginx {:.2}x, bare per-core hyper/nginx {:.2}x",
                    added(bare),
                    router.rps / nginx.rps,
                    bare.rps / nginx.rps,
                    core.rps / nginx.rps
                );
                core_ratios.push(core.rps / nginx.rps);
                added_gap.push(router_added - nginx_added);
                ratios.push(router.rps / nginx.rps);
                bare_ratios.push(bare.rps / nginx.rps);
                bare_gap.push(added(bare) - nginx_added);
            }
            let median = |v: &mut Vec<f64>| {
                v.sort_by(f64::total_cmp);
                v[v.len() / 2]
            };
            println!(
                "   {conns} connection(s), median of {rounds} rounds: router's added p50 minus nginx's {:+.3} ms (goal <= 0); throughput router/nginx {:.2}x (goal >= 1)",
                median(&mut added_gap),
                median(&mut ratios)
            );
            println!(
                "   the same for the bare hyper forwarder (the HTTP stack's own ceiling): added p50 minus nginx's {:+.3} ms; throughput bare/nginx {:.2}x",
                median(&mut bare_gap),
                median(&mut bare_ratios)
            );
            println!(
                "   the bare forwarder in the router's shape (a runtime, listener and pool per core): throughput/nginx {:.2}x",
                median(&mut core_ratios)
            );
            println!(
                "   CPU per request (the proxy's own processes): router/nginx {:.2}x, router/bare per-core forwarder {:.2}x",
                median(&mut cpu_nginx),
                median(&mut cpu_core)
            );
        }

        println!("\n== write cost: 64 connections round-robin over 20 resident models for {steady} s, --recency-resolution 5s");
        let twenty = wrk_script(dir.path(), &hot);
        // Every request time written for each model, as the residency's
        // watch shows them: the bound is per model, one write per
        // resolution, so the gap between two of one model's writes is
        // checked as well as the count in the window (a window of T s can
        // hold T / 5 + 1 writes of a model whose writes are 5 s apart).
        let written = watch_demand(api.clone());
        tokio::time::sleep(Duration::from_millis(300)).await;
        written.lock().unwrap().clear();
        let before = router_metric(router_addr, "model_residency_router_demand_writes_total").await;
        let load = tokio::task::spawn_blocking({
            let tools = tools.clone();
            move || wrk(&tools, &twenty, router_addr, 64, steady)
        })
        .await
        .unwrap();
        let after = router_metric(router_addr, "model_residency_router_demand_writes_total").await;
        let writes = after - before;
        let failed = router_metric(router_addr, "model_residency_router_demand_write_errors_total").await;
        println!(
            "   {:.0} requests/s, {writes} demand writes in {steady} s = {:.2} writes/s (goal at most 20 / 5 s = 4.00)  {}",
            load.rps,
            writes as f64 / steady as f64,
            load.errors
        );
        // Signed: a pair whose later write carries the earlier time would
        // otherwise read as a zero gap.
        let gaps: Vec<f64> = written
            .lock()
            .unwrap()
            .iter()
            .filter(|(model, _)| hot.contains(model))
            .flat_map(|(_, times)| {
                times
                    .windows(2)
                    .map(|w| w[1].0.duration_since(w[0].0).as_secs_f64())
                    .collect::<Vec<_>>()
            })
            .collect();
        let backwards = gaps.iter().filter(|g| **g < 0.0).count();
        let short = gaps.iter().filter(|g| (0.0..4.9).contains(*g)).count();
        println!(
            "   shortest gap between two writes of one model: {:.2} s over {} gaps (goal at least 5 s); {backwards} backwards, {short} under 4.9 s; demand writes failed so far: {failed}",
            gaps.iter().copied().fold(f64::INFINITY, f64::min),
            gaps.len()
        );

        println!("\n== cold path: {cold_samples} loads of a model that is not resident");
        // Two floors: a one-model residency, and a copy of the served one
        // (21 models, with its status), which is what the router writes to.
        let crs: Api<ModelResidency> = Api::namespaced(client.clone(), FLOOR_NS);
        let mut floor_object = residency(&["x".into()]);
        floor_object.metadata.name = Some("floor".into());
        crs.create(&PostParams::default(), &floor_object).await.unwrap();
        let seen = watch_poke(crs.clone());
        let shaped: Api<ModelResidency> = Api::namespaced(client.clone(), SHAPED_FLOOR_NS);
        copy_as_floor(&api, "gpu", &shaped).await;
        let shaped_seen = watch_poke(shaped.clone());
        tokio::time::sleep(Duration::from_millis(300)).await;
        let (mut floor, mut shaped_floor) = (Vec::new(), Vec::new());
        for i in 0..floor_samples {
            floor.push(poke(&crs, &seen, &format!("p{i}")).await);
            shaped_floor.push(poke(&shaped, &shaped_seen, &format!("p{i}")).await);
        }
        floor.sort();
        shaped_floor.sort();
        // The one-model write after a quiet spell, as a cold request's
        // demand write comes to an idle API server.
        let quiet_floor = quiet_pokes(&crs, &seen, floor_samples.min(20), QUIET).await;
        // Interleaved, one sample of each in turn: the served residency
        // (claim mode, its claim allocated long before by its holder pod),
        // and the one-model claim/env pair on the node's second and third GPUs.
        let claim_rig = ColdRig {
            api: &api,
            pods: &pods,
            router: router_addr,
            name: "gpu",
            model: "cold",
            times: watch_cold_pods(pods.clone(), "cold"),
            demanded: watch_demand(api.clone()),
        };
        let pair = |name: &'static str, model: &'static str| ColdRig {
            name,
            model,
            times: watch_cold_pods(pods.clone(), model),
            demanded: watch_demand(api.clone()),
            ..claim_rig
        };
        let (one_claim, one_env) = (pair("gpu-claim", "cold-claim"), pair("gpu-env", "cold-env"));
        let (mut to_demand, mut to_pod, mut to_byte) = (Vec::new(), Vec::new(), Vec::new());
        let mut overhead = Vec::new();
        let mut ttfbs = Vec::new();
        let (mut env_ttfbs, mut env_overhead) = (Vec::new(), Vec::new());
        let (mut claim_ttfbs, mut claim_overhead) = (Vec::new(), Vec::new());
        for _ in 0..cold_samples {
            let c = cold_sample(&claim_rig).await;
            if let Some((d, p, b)) = c.parts {
                to_demand.push(d);
                to_pod.push(p);
                to_byte.push(b);
            }
            ttfbs.push(c.ttfb);
            overhead.push(c.overhead);
            let c = cold_sample(&one_claim).await;
            claim_ttfbs.push(c.ttfb);
            claim_overhead.push(c.overhead);
            let e = cold_sample(&one_env).await;
            env_ttfbs.push(e.ttfb);
            env_overhead.push(e.overhead);
        }
        claim_ttfbs.sort();
        claim_overhead.sort();
        env_ttfbs.sort();
        env_overhead.sort();
        overhead.sort();
        ttfbs.sort();
        for v in [&mut to_demand, &mut to_pod, &mut to_byte] {
            v.sort();
        }
        let p50 = percentile(&overhead, 0.5);
        let floor50 = percentile(&floor, 0.5);
        println!(
            "   claim mode (spec.gpu.mode claim, its claim allocated): first byte p50 {:.1} ms (pod creation-to-Ready {:.0} ms of the stand-in's included); router's part p50 {:.1} ms, p99 {:.1} ms",
            ms(percentile(&ttfbs, 0.5)),
            ms(LOAD_DELAY),
            ms(p50),
            ms(percentile(&overhead, 0.99))
        );
        let env50 = percentile(&env_overhead, 0.5);
        let claim50 = percentile(&claim_overhead, 0.5);
        println!(
            "   the claim's cost per load, two one-model residencies alike but for spec.gpu.mode, interleaved: claim first byte p50 {:.1} ms, router's part p50 {:.1} ms (p99 {:.1}); env first byte p50 {:.1} ms, router's part p50 {:.1} ms (p99 {:.1}); claim/env first byte {:.2}x, router's part {:.2}x (goal: the claim costs nothing per load, 1.00x)",
            ms(percentile(&claim_ttfbs, 0.5)),
            ms(claim50),
            ms(percentile(&claim_overhead, 0.99)),
            ms(percentile(&env_ttfbs, 0.5)),
            ms(env50),
            ms(percentile(&env_overhead, 0.99)),
            percentile(&claim_ttfbs, 0.5).as_secs_f64() / percentile(&env_ttfbs, 0.5).as_secs_f64(),
            claim50.as_secs_f64() / env50.as_secs_f64()
        );
        println!(
            "   of which p50: request sent -> the router's demand write seen {:.1} ms; -> the operator's pod seen {:.1} ms; pod seen Ready -> first byte {:.1} ms",
            ms(percentile(&to_demand, 0.5)),
            ms(percentile(&to_pod, 0.5)),
            ms(percentile(&to_byte, 0.5)),
        );
        println!(
            "   ModelResidency write-to-watch round trip p50 {:.2} ms (one model, no status); ratio {:.2}x (goal at most 3x)",
            ms(floor50),
            p50.as_secs_f64() / floor50.as_secs_f64()
        );
        let quiet50 = percentile(&quiet_floor, 0.5);
        println!(
            "   the one-model round trip after {} ms quiet p50 {:.2} ms ({} samples); ratio {:.2}x",
            QUIET.as_millis(),
            ms(quiet50),
            quiet_floor.len(),
            p50.as_secs_f64() / quiet50.as_secs_f64()
        );
        let shaped50 = percentile(&shaped_floor, 0.5);
        println!(
            "   the same round trip for a copy of the served residency (21 models and status) p50 {:.2} ms; ratio {:.2}x",
            ms(shaped50),
            p50.as_secs_f64() / shaped50.as_secs_f64()
        );

        if list_models > 0 {
            list_under_load(&tools, &client, router_addr, &hot, list_models, secs, rounds, dir.path()).await;
        }
    });
}

/// #68 finding 6: chat requests while clients list a large catalog's
/// models, against the same chat requests alone, in interleaved rounds.
#[allow(clippy::too_many_arguments)]
async fn list_under_load(
    tools: &Tools,
    client: &kube::Client,
    router: SocketAddr,
    hot: &[String],
    n: usize,
    secs: u64,
    rounds: usize,
    dir: &std::path::Path,
) {
    let entries: Vec<_> = (0..n)
        .map(|i| json!({"name": format!("listed-{i}"), "size": "1Gi",
            "template": {"spec": {"containers": [{"name": "server", "image": "example/listed:1"}]}}}))
        .collect();
    let catalog: model_residency::api::ModelCatalog = serde_json::from_value(json!({
        "apiVersion": "residency.dev/v1alpha1", "kind": "ModelCatalog",
        "metadata": {"name": "listed"}, "spec": {"models": entries},
    }))
    .unwrap();
    Api::<model_residency::api::ModelCatalog>::namespaced(client.clone(), NS)
        .create(&PostParams::default(), &catalog)
        .await
        .unwrap();
    let api: Api<ModelResidency> = Api::namespaced(client.clone(), NS);
    for d in 3..7 {
        let mut r = residency_as(&format!("listed-{d}"), &d.to_string(), "env", &[]);
        r.spec.catalog = Some(Arc::new(model_residency::api::CatalogRef {
            name: "listed".into(),
            ..Default::default()
        }));
        api.create(&PostParams::default(), &r).await.unwrap();
    }
    // Until the router lists them all.
    let deadline = Instant::now() + Duration::from_secs(120);
    let (listed, bytes) = loop {
        let answer = model_residency::http::send(router, "GET", "/v1/models", "").await;
        if let Ok(a) = answer {
            let v: serde_json::Value = serde_json::from_str(&a.body).unwrap_or_default();
            let listed = v["data"].as_array().map_or(0, Vec::len);
            if listed >= n + hot.len() {
                break (listed, a.body.len());
            }
        }
        assert!(
            Instant::now() < deadline,
            "the router never listed the catalog's {n} models"
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    };
    println!(
        "\n== model list under load: {listed} models ({n} from one catalog named by 4 residencies), a list is {} KiB; chat on 1 connection for {secs} s, alone and while 4 connections GET /v1/models, {rounds} rounds",
        bytes / 1024
    );
    let one = wrk_script(dir, &hot[..1]);
    // Chat on one connection while 4 connections loop on `path` (none:
    // alone).
    let chat_beside = |path: Option<&'static str>| {
        let (tools, one) = (tools.clone(), one.clone());
        async move {
            let busy = path.map(|p| {
                let tools = tools.clone();
                tokio::task::spawn_blocking(move || wrk_at(&tools, None, router, p, 4, secs + 1))
            });
            let chat = tokio::task::spawn_blocking(move || wrk(&tools, &one, router, 1, secs))
                .await
                .unwrap();
            let busy = match busy {
                Some(b) => Some(b.await.unwrap()),
                None => None,
            };
            (chat, busy)
        }
    };
    let (mut p50s, mut p99s, mut floor99s) = (Vec::new(), Vec::new(), Vec::new());
    for round in 1..=rounds {
        let (alone, _) = chat_beside(None).await;
        // The floor: the same four connections on an answer that costs
        // nothing (`/readyz`), so what the machine's two cores shared
        // with the clients cost the chat p99 is told from the list's.
        let (floor, ready) = chat_beside(Some("/readyz")).await;
        let (chat, lists) = chat_beside(Some("/v1/models")).await;
        let (ready, lists) = (ready.unwrap(), lists.unwrap());
        println!(
            "   round {round}: chat alone p50 {:.3} ms p99 {:.3} ms; beside /readyz p99 {:.3} ms ({:.0}/s); while listing p50 {:.3} ms p99 {:.3} ms ({:.0} lists/s, list p50 {:.1} ms)  {} {} {}",
            ms(alone.p50),
            ms(alone.p99),
            ms(floor.p99),
            ready.rps,
            ms(chat.p50),
            ms(chat.p99),
            lists.rps,
            ms(lists.p50),
            alone.errors,
            chat.errors,
            lists.errors
        );
        p50s.push(ms(chat.p50) / ms(alone.p50));
        p99s.push(ms(chat.p99) / ms(alone.p99));
        floor99s.push(ms(floor.p99) / ms(alone.p99));
    }
    for v in [&mut p50s, &mut p99s, &mut floor99s] {
        v.sort_by(f64::total_cmp);
    }
    println!(
        "   median of {rounds} rounds: chat while listing / alone: p50 {:.2}x, p99 {:.2}x (goal <= 1.2x); the floor, chat beside four /readyz loops / alone: p99 {:.2}x",
        p50s[rounds / 2],
        p99s[rounds / 2],
        floor99s[rounds / 2]
    );
}
