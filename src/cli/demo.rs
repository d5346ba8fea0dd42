//! `model-residency demo`: the whole product on a local control plane, in
//! about half a minute, explaining itself as it goes.
//!
//! Starts a real kube-apiserver + etcd + garbage collector, installs the
//! CRD and the chart's RBAC, runs `model-residency run --leader-elect` and
//! `model-residency route` as separate processes, each with its chart
//! ServiceAccount's permissions, plays the kubelet for one fake GPU node
//! (every model pod a real HTTP server), applies
//! `examples/seed-registry.yaml` (the seed's models on a 16000Mi GPU) and
//! sends the seed's requests through the router as real HTTP: held cold
//! starts, hits, LRU evictions, an oversized model refused (503 with the
//! sizes), an unknown model (404), then an unload. Then the node's disk:
//! `model-residency node-agent` (as its ServiceAccount) fetches a new
//! model's weights from a model store the demo serves over HTTP, verified
//! by sha256, before its pod starts with them mounted read-only. Then the
//! warm tier ([`warm`]): a model put to sleep instead of deleted, and
//! woken on the same pod by its next request. It ends
//! with events, pods, counters and the processes' metrics, and stops
//! everything it started.

use super::Failure;
use super::demand::render_status;

mod warm;
use k8s_openapi::api::core::v1::Namespace;
use kube::api::{Api, PostParams};
use model_residency::api::{ModelResidency, ModelState};
use model_residency::local::control_plane::{ControlPlane, PlaneOptions};
use model_residency::local::images::{MODEL_SERVER_IMAGE, PAUSE_IMAGE, model_server_template};
use model_residency::local::kubelet::{FakeKubelet, KubeletConfig};
use model_residency::local::real_node::{RealNode, RealNodeOptions};
use model_residency::residency::demand;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::{Duration, Instant};

const NAMESPACE: &str = "models";

/// A file of this crate's checkout (the chart, the scripts, the example):
/// the demo is built from a checkout and runs against its files, wherever
/// it is started from.
fn checkout_file(relative: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join(relative)
}
const NAME: &str = "seed-gpu";

#[derive(clap::Args, Debug)]
pub struct Args {
    /// The manifest to apply (a ModelResidency on node-a).
    #[arg(long, default_value = concat!(env!("CARGO_MANIFEST_DIR"), "/examples/seed-registry.yaml"))]
    manifest: PathBuf,
    /// Seconds the stand-in kubelet takes to "load" each GiB of a model.
    #[arg(long, default_value_t = 0.05)]
    load_secs_per_gib: f64,
    /// Which node runs the pods: `real` (the real kubelet and containerd,
    /// in a lane of their own: scripts/real-node.sh builds them), `stand-in`
    /// (the kubelet stand-in), or `auto`: real when it can run here (root,
    /// the real node's binaries built), the stand-in otherwise, saying why.
    #[arg(long, value_enum, default_value_t = NodeKind::Auto)]
    node: NodeKind,
}

#[derive(clap::ValueEnum, Clone, Copy, Debug, PartialEq, Eq)]
pub enum NodeKind {
    Auto,
    Real,
    StandIn,
}

/// Why a real node cannot run here, if it cannot.
#[allow(unsafe_code)] // a libc call std has no safe wrapper for
fn real_node_unavailable() -> Option<String> {
    // SAFETY: geteuid has no preconditions.
    if unsafe { libc::geteuid() } != 0 {
        return Some("a real node needs root (namespaces, mounts, cgroups)".into());
    }
    if let Err(e) = model_residency::local::real_node::find_binaries() {
        return Some(e.to_string());
    }
    None
}

fn fail(what: &str) -> impl Fn(kube::Error) -> Failure + '_ {
    move |e| Failure {
        message: format!("{what}: {e}"),
        code: 1,
    }
}

pub fn run(args: Args) -> Result<(), Failure> {
    let in_lane = model_residency::local::lane::current().is_some();
    let real = match (args.node, real_node_unavailable()) {
        (NodeKind::StandIn, _) => false,
        (_, None) if !in_lane => return super::container::rerun_in_lane(&["--node", "real"]),
        (_, None) => true,
        (NodeKind::Real, Some(why)) => return Err(Failure::other(why)),
        (NodeKind::Auto, Some(why)) => {
            say(&format!("The demo runs on the kubelet stand-in: {why}"));
            false
        }
    };
    let manifest = std::fs::read_to_string(&args.manifest)
        .map_err(|e| Failure::bad_input(format!("{}: {e}", args.manifest.display())))?;
    let residency: ModelResidency = serde_saphyr::from_str(&manifest)
        .map_err(|e| Failure::bad_input(format!("{}: {e}", args.manifest.display())))?;
    say(
        "Starting a local Kubernetes control plane (etcd, kube-apiserver, kube-scheduler, kube-controller-manager)...",
    );
    let node = demo_node(&residency);
    let options = PlaneOptions {
        real_node: real.then(|| node.clone()),
    };
    let plane = ControlPlane::start_with(options).map_err(|e| Failure {
        message: e.to_string(),
        code: 1,
    })?;
    println!(
        "   Kubernetes {} ready in {:.1} s at {} (kubeconfig {})",
        plane.version(),
        plane.startup.as_secs_f64(),
        plane.server_url(),
        plane.kubeconfig().display()
    );
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .map_err(|e| Failure {
            message: e.to_string(),
            code: 1,
        })?;
    let started = Instant::now();
    let node = if real {
        Node::Real
    } else {
        Node::StandIn(args.load_secs_per_gib)
    };
    let result = runtime.block_on(story(&plane, residency, node));
    runtime.shutdown_timeout(Duration::from_secs(2));
    drop(plane);
    if result.is_ok() {
        say(&format!(
            "Done in {:.0} s. The control plane, the operator and the {} are stopped and their files removed.",
            started.elapsed().as_secs_f64(),
            if real {
                "real node (its containers with it)"
            } else {
                "stand-in kubelet"
            }
        ));
    }
    result
}

fn say(text: &str) {
    println!("\n== {text}");
}

/// Runs `model-residency gpus` against the demo's control plane, as a
/// person would.
fn gpus(kubeconfig: &Path) {
    println!("$ model-residency gpus");
    let out = std::env::current_exe().and_then(|exe| {
        Command::new(exe)
            .env("KUBECONFIG", kubeconfig)
            .arg("gpus")
            .output()
    });
    match out {
        Ok(out) => {
            print!("{}", String::from_utf8_lossy(&out.stdout));
            print!("{}", String::from_utf8_lossy(&out.stderr));
        }
        Err(e) => println!("(could not run model-residency gpus: {e})"),
    }
}

/// Runs kubectl against the demo's control plane and prints the command and
/// its output, as a person would see them.
fn kubectl(kubeconfig: &Path, args: &[&str]) {
    println!("$ kubectl {}", args.join(" "));
    let cache = tempfile::tempdir().ok();
    let mut cmd = Command::new(model_residency::local::control_plane::kubectl());
    cmd.env("KUBECONFIG", kubeconfig).args(args);
    if let Some(c) = &cache {
        cmd.arg(format!("--cache-dir={}", c.path().display()));
    }
    match cmd.output() {
        Ok(out) => {
            print!("{}", String::from_utf8_lossy(&out.stdout));
            print!("{}", String::from_utf8_lossy(&out.stderr));
        }
        Err(e) => println!("(kubectl is not available here: {e})"),
    }
}

/// The demo's GPU node: the one the example residency names.
fn demo_node(r: &ModelResidency) -> String {
    r.spec
        .node_name
        .clone()
        .unwrap_or_else(|| "gpu-node-1".into())
}

/// The node the demo's pods run on.
#[derive(Clone, Copy, Debug)]
enum Node {
    /// The real kubelet and containerd (in the demo's lane).
    Real,
    /// The kubelet stand-in, with its seconds of "loading" per GiB.
    StandIn(f64),
}

/// Whichever node runs, kept until the demo ends.
enum RunningNode {
    #[allow(dead_code)] // held for its Drop
    Real(RealNode),
    #[allow(dead_code)] // held for its Drop
    StandIn(FakeKubelet),
}

/// Starts the demo's node: two GPUs (the residency's claim takes one,
/// `gpus` shows the other free; the warm tier's residency then takes it).
async fn start_node(
    plane: &ControlPlane,
    client: &kube::Client,
    name: &str,
    node: Node,
) -> Result<RunningNode, Failure> {
    match node {
        Node::Real => {
            say(&format!(
                "Starting a real node {name}: the kubelet {} on containerd {} and runc, pods on a bridge of the demo's own network namespace, its two GPUs published by a DRA kubelet plugin (fake devices: this machine has none); images made from this binary",
                model_residency::local::control_plane::KUBERNETES_VERSION,
                model_residency::local::real_node::CONTAINERD_VERSION
            ));
            let options = RealNodeOptions {
                name: name.to_owned(),
                gpus: 2,
                gpu_memory: 80 << 30,
                binary: std::env::current_exe().map_err(Failure::other)?,
            };
            let real = RealNode::start(plane, client, options)
                .await
                .map_err(Failure::other)?;
            println!(
                "   node {name} Ready in {:.1} s",
                real.startup.as_secs_f64()
            );
            kubectl(plane.kubeconfig(), &["get", "nodes", "-o", "wide"]);
            Ok(RunningNode::Real(real))
        }
        Node::StandIn(secs_per_gib) => {
            say(&format!(
                "Registering fake GPU node {name} with the kubelet stand-in (pods become Ready after {secs_per_gib} s per GiB)"
            ));
            let mut config = KubeletConfig::instant(&[name]);
            config.nodes[0].gpus = 2;
            config.load_delay = Duration::from_millis(100);
            config.delay_per_gib = Duration::from_secs_f64(secs_per_gib.max(0.0));
            config.terminating_delay = Duration::from_millis(200);
            let kubelet = FakeKubelet::start(client.clone(), config)
                .await
                .map_err(fail("register the node"))?;
            Ok(RunningNode::StandIn(kubelet))
        }
    }
}

async fn story(
    plane: &ControlPlane,
    mut residency: ModelResidency,
    node_kind: Node,
) -> Result<(), Failure> {
    let client = plane.client().await.map_err(|e| Failure {
        message: e.to_string(),
        code: 1,
    })?;
    let kc = plane.kubeconfig();
    let real = matches!(node_kind, Node::Real);

    say("Installing the ModelResidency CRD (model-residency crd | kubectl apply -f -)");
    model_residency::local::install_crd(&client)
        .await
        .map_err(fail("install the CRD"))?;

    let node = demo_node(&residency);
    let _node = start_node(plane, &client, &node, node_kind).await?;
    if real {
        // The manifest's images are examples; on a real node every model
        // runs the local fake model server image instead.
        for model in &mut residency.spec.models {
            model.template = serde_json::from_value(model_server_template(8080, None)).ok();
        }
    }

    let operator = start_operator(plane, real).await?;

    let namespaces: Api<Namespace> = Api::all(client.clone());
    let ns: Namespace =
        serde_json::from_value(serde_json::json!({"metadata": {"name": NAMESPACE}}))
            .expect("static namespace");
    namespaces
        .create(&PostParams::default(), &ns)
        .await
        .map_err(fail("create the namespace"))?;
    say(&format!(
        "Applying {NAME}: a 16000Mi GPU with the seed's models (zimage 10900Mi, qwen-llm 3000Mi, sdxl 6000Mi, oversized 20000Mi, small-a/b/c 4000Mi)"
    ));
    let api: Api<ModelResidency> = Api::namespaced(client.clone(), NAMESPACE);
    api.create(&PostParams::default(), &residency)
        .await
        .map_err(fail("create the ModelResidency"))?;
    let name = residency
        .metadata
        .name
        .clone()
        .unwrap_or_else(|| NAME.into());
    settle(&api, &name).await?;
    kubectl(kc, &["get", "mres", "-n", NAMESPACE, "-o", "wide"]);
    say(
        "Its GPU, the way current clusters grant one (spec.gpu.mode claim, the default): the operator made one ResourceClaim for exactly GPU 0 of the node, and a small holder pod that the scheduler placed, allocating the claim; every model pod will reference the same claim",
    );
    kubectl(
        kc,
        &[
            "get",
            "resourceclaims",
            "-n",
            NAMESPACE,
            "-o",
            "custom-columns=NAME:.metadata.name,DEVICE:.status.allocation.devices.results[0].device,POOL:.status.allocation.devices.results[0].pool,RESERVED-FOR:.status.reservedFor[*].name",
        ],
    );
    gpus(kc);

    let router = start_router(plane).await?;
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
            Step::Ask(model) => ask(&router.addr, model).await?,
            Step::Unload(model) => {
                println!("$ model-residency demand unload {name} {model} -n {NAMESPACE}");
                demand::unload(&api, &name, model)
                    .await
                    .map_err(fail("write demand"))?;
            }
        }
        let r = settle(&api, &name).await?;
        kubectl(kc, &["get", "mres", "-n", NAMESPACE]);
        if matches!(i, 3 | 5 | 7) {
            println!("$ model-residency status {name} -n {NAMESPACE}");
            print!("{}", render_status(&r));
        }
    }

    let (node_agent, disk) = disk_tier(plane, &api, &name, &residency, &router.addr).await?;
    warm::warm_tier(&api, kc, &demo_node(&residency), &router.addr, real).await?;

    say("What the router serves (curl /v1/models)");
    println!("$ curl -s http://{}/v1/models", router.addr);
    let models = http_get(&router.addr, "/v1/models")
        .await
        .unwrap_or_default()
        .1;
    if let Ok(list) = serde_json::from_str::<serde_json::Value>(&models) {
        for m in list["data"].as_array().into_iter().flatten() {
            println!(
                "   {:<10} {:<9} {}",
                m["id"].as_str().unwrap_or_default(),
                m["state"].as_str().unwrap_or_default(),
                m["residency"].as_str().unwrap_or_default()
            );
        }
    }

    say("What happened, as events (kubectl get events)");
    kubectl(
        kc,
        &[
            "get",
            "events",
            "-n",
            NAMESPACE,
            "--sort-by=.metadata.creationTimestamp",
            "-o",
            "custom-columns=TYPE:.type,REASON:.reason,MESSAGE:.message",
        ],
    );
    say("Model pods now (one per resident model, bound to the GPU's node)");
    kubectl(
        kc,
        &[
            "get",
            "pods",
            "-n",
            NAMESPACE,
            "-L",
            "residency.dev/model",
            "-o",
            "wide",
        ],
    );

    let r = api
        .get(&name)
        .await
        .map_err(fail("read the ModelResidency"))?;
    let s = r.status.unwrap_or_default();
    let c = s.counters;
    say("Summary");
    println!(
        "   hits {} | loads {} | evictions {} | refusals {} | unloads {} | used {} of {} | peak {}",
        c.hits,
        c.loads,
        c.evictions,
        c.refusals,
        c.unloads,
        s.used.as_deref().unwrap_or("0"),
        s.budget.as_deref().unwrap_or("?"),
        s.peak.as_deref().unwrap_or("0"),
    );
    show_metrics(
        &format!(
            "The operator's metrics (curl http://{}/metrics | grep seed-gpu)",
            operator.addr
        ),
        &operator.addr,
        |l| l.contains("residency=\"seed-gpu\""),
    )
    .await;
    show_metrics(
        &format!(
            "The router's metrics (curl http://{}/metrics | grep requests_total): every request, by model and code",
            router.addr
        ),
        &router.addr,
        |l| {
            l.starts_with("model_residency_router_requests_total")
                || l.starts_with("model_residency_router_demand_writes_total")
        },
    )
    .await;
    show_metrics(
        &format!(
            "The node agent's metrics (curl http://{}/metrics | grep fetch)",
            node_agent.addr
        ),
        &node_agent.addr,
        |l| {
            l.starts_with("model_residency_node_agent_fetches_total")
                || l.starts_with("model_residency_node_agent_fetched_bytes_total")
                || l.starts_with("model_residency_node_agent_disk_used_bytes")
        },
    )
    .await;
    router.stop();
    node_agent.stop();
    drop(disk);
    operator.stop();
    Ok(())
}

/// Says `title` and prints the lines of `addr`'s /metrics that `keep`.
async fn show_metrics(title: &str, addr: &str, keep: impl Fn(&str) -> bool) {
    say(title);
    let metrics = http_get(addr, "/metrics").await.unwrap_or_default().1;
    for line in metrics.lines().filter(|l| keep(l)) {
        println!("   {line}");
    }
}

/// The weights the demo's artifact server serves: 8 MiB of a pattern.
fn demo_weights() -> bytes::Bytes {
    (0..8u32 << 20).map(|i| (i % 251) as u8).collect()
}

/// Serves `/llama/model.safetensors` (`weights`) over HTTP on a free
/// loopback port, as a model store would; returns its address.
async fn artifact_server(weights: bytes::Bytes) -> Result<std::net::SocketAddr, Failure> {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
        .await
        .map_err(Failure::other)?;
    let addr = listener.local_addr().map_err(Failure::other)?;
    tokio::spawn(model_residency::http::accept_loop(
        listener,
        move |stream| {
            let weights = weights.clone();
            tokio::spawn(async move {
                let service =
                    hyper::service::service_fn(move |req: http::Request<hyper::body::Incoming>| {
                        let weights = weights.clone();
                        async move {
                            let mut answer =
                                http::Response::new(http_body_util::Full::new(weights));
                            if req.uri().path() != "/llama/model.safetensors" {
                                *answer.body_mut() = http_body_util::Full::new(bytes::Bytes::new());
                                *answer.status_mut() = http::StatusCode::NOT_FOUND;
                            }
                            Ok::<_, std::convert::Infallible>(answer)
                        }
                    });
                let _ = hyper::server::conn::http1::Builder::new()
                    .serve_connection(hyper_util::rt::TokioIo::new(stream), service)
                    .await;
            });
        },
    ));
    Ok(addr)
}

/// The registry credentials Secret of the demo's node agent.
const DEMO_REGISTRY_SECRET: &str = "demo-registry";

/// Where llama's weights come from: an OCI artifact in a local registry
/// (Debian's docker-registry, TLS and basic auth), pushed here; or, when no
/// registry can be started, the plain http store.
struct WeightsSource {
    artifact: serde_json::Value,
    allowed: String,
    agent_flags: Vec<String>,
    says: String,
    _registry: Option<model_residency::local::registry::LocalRegistry>,
}

async fn weights_source(
    plane: &ControlPlane,
    weights: bytes::Bytes,
    sha: &str,
) -> Result<WeightsSource, Failure> {
    use model_residency::local::registry::{LocalRegistry, PASSWORD, USER, docker_config};
    match LocalRegistry::start() {
        Ok(registry) => {
            let digest = registry
                .push(
                    "models/llama",
                    "1.0",
                    &[(
                        "application/octet-stream",
                        &weights,
                        Some("model.safetensors"),
                    )],
                )
                .await
                .map_err(Failure::other)?;
            let secrets: Api<k8s_openapi::api::core::v1::Secret> =
                Api::namespaced(plane.client().await.map_err(Failure::other)?, OPERATOR_NS);
            let secret: k8s_openapi::api::core::v1::Secret = serde_json::from_value(serde_json::json!({
                "metadata": {"name": DEMO_REGISTRY_SECRET},
                "type": "kubernetes.io/dockerconfigjson",
                "stringData": {".dockerconfigjson": docker_config(&registry.host(), USER, PASSWORD)},
            }))
            .map_err(Failure::other)?;
            let _ = secrets
                .create(&kube::api::PostParams::default(), &secret)
                .await;
            let host = registry.host();
            Ok(WeightsSource {
                artifact: serde_json::json!({"size": "8Mi", "source": format!("oci://{host}/models/llama@{digest}")}),
                allowed: format!("oci://{host}/models"),
                agent_flags: vec![
                    "--registry-credentials".into(),
                    DEMO_REGISTRY_SECRET.into(),
                    "--namespace".into(),
                    OPERATOR_NS.into(),
                    "--registry-ca-file".into(),
                    registry.ca_file().display().to_string(),
                ],
                says: format!(
                    "pulling only from the local OCI registry at {host} (TLS, htpasswd; its credentials in the Secret {OPERATOR_NS}/{DEMO_REGISTRY_SECRET}), where llama's weights were pushed as an ORAS artifact, {digest}"
                ),
                _registry: Some(registry),
            })
        }
        Err(why) => {
            let store = artifact_server(weights).await?;
            Ok(WeightsSource {
                artifact: serde_json::json!({"size": "8Mi", "files": [{
                    "uri": format!("http://{store}/llama/model.safetensors"), "sha256": sha}]}),
                allowed: format!("http://{store}/"),
                agent_flags: Vec::new(),
                says: format!(
                    "fetching only from the model store at http://{store}/ (no local registry: {why})"
                ),
                _registry: None,
            })
        }
    }
}

/// The node's disk: the node agent fetches a model's weights, verified,
/// before its pod starts, and the pod mounts them read-only. Returns the
/// agent and its cache directory (removed when dropped, after the agent
/// has stopped).
async fn disk_tier(
    plane: &ControlPlane,
    api: &Api<ModelResidency>,
    name: &str,
    residency: &ModelResidency,
    router: &str,
) -> Result<(Process, tempfile::TempDir), Failure> {
    let kc = plane.kubeconfig();
    let weights = demo_weights();
    let sha = model_residency::node_agent::fetch::encode_hex(
        ring::digest::digest(&ring::digest::SHA256, &weights).as_ref(),
    );
    let source = weights_source(plane, weights, &sha).await?;
    let cache = tempfile::tempdir().map_err(Failure::other)?;
    let cache_dir = cache.path().join("model-cache");
    say(&format!(
        "The node's disk: starting the node agent (model-residency node-agent, as the chart's node-agent ServiceAccount) with a 64Mi disk budget, {}",
        source.says
    ));
    let node = demo_node(residency);
    let cache_arg = cache_dir.display().to_string();
    let mut args: Vec<&str> = vec![
        "node-agent",
        "--node",
        &node,
        "--disk-budget",
        "64Mi",
        "--cache-dir",
        &cache_arg,
        "--allowed-sources",
        &source.allowed,
    ];
    args.extend(source.agent_flags.iter().map(String::as_str));
    let agent = spawn_as(plane, "node agent", "model-residency-node-agent", &args).await?;
    // The new model's pod is the seed's first template with its own image.
    let mut template = residency
        .spec
        .models
        .first()
        .map(|m| serde_json::to_value(&m.template).unwrap_or_default())
        .unwrap_or_default();
    // The stand-in runs any image; a real node keeps the local one.
    if template["spec"]["containers"][0]["image"] != MODEL_SERVER_IMAGE {
        template["spec"]["containers"][0]["image"] = "ghcr.io/example/llama-server:1.0".into();
        template["spec"]["containers"][0]["args"] = serde_json::json!(["--model", "llama"]);
    }
    let model = serde_json::json!({
        "name": "llama", "size": "2000Mi", "template": template,
        "artifact": source.artifact,
    });
    let patch = serde_json::json!([{"op": "add", "path": "/spec/models/-", "value": model}]);
    say(
        "Registering llama (2000Mi of VRAM) with an artifact: 8Mi of weights, pinned by digest, that its pod needs on the node's disk",
    );
    println!(
        "$ kubectl patch mres {name} -n {NAMESPACE} --type=json -p '[{{\"op\":\"add\",\"path\":\"/spec/models/-\",\"value\":{{\"name\":\"llama\",\"size\":\"2000Mi\",\"artifact\":{{...}},...}}}}]'"
    );
    api.patch(
        name,
        &kube::api::PatchParams::default(),
        &kube::api::Patch::<()>::Json(serde_json::from_value(patch).map_err(Failure::other)?),
    )
    .await
    .map_err(fail("add llama to the registry"))?;
    settle(api, name).await?;
    say(
        "Asking for llama: the router holds the request while the operator waits in Fetching for the node agent to download and verify the weights, then starts the pod with them mounted read-only",
    );
    ask(router, "llama").await?;
    let r = settle(api, name).await?;
    kubectl(kc, &["get", "nmc"]);
    kubectl(
        kc,
        &[
            "get",
            "nmc",
            &node,
            "-o",
            "custom-columns=ARTIFACT:.status.artifacts[*].key,STATE:.status.artifacts[*].state,BYTES:.status.artifacts[*].bytes,SHA256:.status.artifacts[*].sha256,DIGEST:.status.artifacts[*].digest",
        ],
    );
    if let Some(pod) = r
        .status
        .as_ref()
        .and_then(|s| s.model("llama"))
        .and_then(|m| m.pod.clone())
    {
        kubectl(
            kc,
            &[
                "get",
                "pod",
                &pod,
                "-n",
                NAMESPACE,
                "-o",
                "jsonpath={.spec.volumes[0].hostPath.path} -> {.spec.containers[0].volumeMounts[0].mountPath} (readOnly {.spec.containers[0].volumeMounts[0].readOnly})",
            ],
        );
        println!();
    }
    println!("$ ls -l {}/*", cache_dir.display());
    for dir in std::fs::read_dir(&cache_dir)
        .into_iter()
        .flatten()
        .flatten()
        .filter(|d| d.file_name() != model_residency::node_agent::blobs::STORE_DIR)
    {
        for file in std::fs::read_dir(dir.path())
            .into_iter()
            .flatten()
            .flatten()
        {
            println!(
                "   {}/{}  {} bytes",
                dir.file_name().to_string_lossy(),
                file.file_name().to_string_lossy(),
                file.metadata().map(|m| m.len()).unwrap_or(0)
            );
        }
    }
    Ok((agent, cache))
}

/// One step of the demo's story.
enum Step {
    /// A chat completion for the model, through the router.
    Ask(&'static str),
    /// An unload, as an autoscaler writes it.
    Unload(&'static str),
}

/// Sends a chat completion for `model` through the router, as a client
/// would, and shows the answer and how long it took.
async fn ask(router: &str, model: &str) -> Result<(), Failure> {
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

/// A `model-residency` subcommand run as a separate process with only its
/// chart ServiceAccount's RBAC.
struct Process {
    what: &'static str,
    child: std::process::Child,
    addr: String,
    log: PathBuf,
    _dir: tempfile::TempDir,
}

impl Process {
    #[allow(unsafe_code)] // a libc call std has no safe wrapper for
    fn stop(mut self) {
        say(&format!(
            "Stopping the {} with SIGTERM (a Deployment's pod shutdown)",
            self.what
        ));
        // SAFETY: kill(2) on our own child's pid.
        unsafe {
            libc::kill(self.child.id() as i32, libc::SIGTERM);
        }
        let status = self.child.wait();
        println!(
            "   exited: {}; its last log line: {}",
            status
                .map(|s| s.to_string())
                .unwrap_or_else(|e| e.to_string()),
            std::fs::read_to_string(&self.log)
                .unwrap_or_default()
                .lines()
                .last()
                .unwrap_or("")
        );
    }
}

impl Drop for Process {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

const OPERATOR_NS: &str = "model-residency-system";

/// GETs `path` from one of the demo's processes: the status and the body.
async fn http_get(addr: &str, path: &str) -> Option<(u16, String)> {
    let addr = addr.parse().ok()?;
    let answer = model_residency::http::send(addr, "GET", path, "")
        .await
        .ok()?;
    Some((answer.status, answer.body))
}

/// Renders the chart with helm and applies its ServiceAccounts and RBAC
/// (the operator's and the router's).
fn install_rbac(plane: &ControlPlane) -> Result<(), Failure> {
    let helm = std::env::var("HELM").ok().or_else(|| {
        Command::new("bash")
            .arg(checkout_file("scripts/helm.sh"))
            .output()
            .ok()
            .filter(|o| o.status.success())
            .and_then(|o| String::from_utf8(o.stdout).ok())
            .map(|s| s.trim().to_owned())
    });
    let Some(helm) = helm else {
        return Err(Failure {
            message: "helm is needed to render the chart's RBAC: run `bash scripts/helm.sh` (or set HELM)".into(),
            code: 1,
        });
    };
    say(
        "Installing the chart's ServiceAccounts and RBAC (helm template charts/model-residency | kubectl apply)",
    );
    let rendered = Command::new(&helm)
        .args(["template", "model-residency"])
        .arg(checkout_file("charts/model-residency"))
        .args(["--namespace", OPERATOR_NS])
        .args(["--set", "nodeAgent.enabled=true"])
        .args([
            "--set",
            &format!("nodeAgent.registryCredentials={DEMO_REGISTRY_SECRET}"),
        ])
        .output()
        .map_err(|e| Failure::other(format!("helm: {e}")))?;
    if !rendered.status.success() {
        return Err(Failure::other(format!(
            "helm template: {}",
            String::from_utf8_lossy(&rendered.stderr)
        )));
    }
    let rbac_kinds = [
        "ServiceAccount",
        "ClusterRole",
        "ClusterRoleBinding",
        "Role",
        "RoleBinding",
    ];
    let rbac: Vec<&str> = std::str::from_utf8(&rendered.stdout)
        .unwrap_or_default()
        .split("\n---")
        .filter(|doc| {
            doc.lines().any(|l| {
                rbac_kinds
                    .iter()
                    .any(|k| l.strip_prefix("kind: ") == Some(*k))
            })
        })
        .collect();
    let dir = tempfile::tempdir().map_err(Failure::other)?;
    let rbac_file = dir.path().join("rbac.yaml");
    std::fs::write(&rbac_file, rbac.join("\n---")).map_err(Failure::other)?;
    let kc = plane.kubeconfig();
    kubectl(kc, &["create", "namespace", OPERATOR_NS]);
    kubectl(kc, &["apply", "-f", rbac_file.to_str().unwrap_or_default()]);
    Ok(())
}

/// Runs `model-residency <args> --http-addr <a free port>` as ServiceAccount
/// `account` of the chart, and waits for its /readyz.
async fn spawn_as(
    plane: &ControlPlane,
    what: &'static str,
    account: &str,
    args: &[&str],
) -> Result<Process, Failure> {
    let dir = tempfile::tempdir().map_err(Failure::other)?;
    let sa = format!("system:serviceaccount:{OPERATOR_NS}:{account}");
    let sa_groups = [
        "system:serviceaccounts",
        "system:serviceaccounts:model-residency-system",
        "system:authenticated",
    ];
    let kubeconfig = dir.path().join("kubeconfig");
    plane
        .write_kubeconfig_as(&kubeconfig, &sa, &sa_groups)
        .map_err(Failure::other)?;
    let port = std::net::TcpListener::bind("127.0.0.1:0")
        .and_then(|l| l.local_addr())
        .map(|a| a.port())
        .map_err(Failure::other)?;
    let addr = format!("127.0.0.1:{port}");
    let log = dir.path().join("log");
    let log_file = std::fs::File::create(&log).map_err(Failure::other)?;
    let exe = std::env::current_exe().map_err(Failure::other)?;
    let mut cmd = Command::new(exe);
    cmd.env("KUBECONFIG", &kubeconfig)
        .env("POD_NAME", format!("model-residency-demo-{what}"))
        .args(args)
        .args(["--http-addr", &addr])
        .stdout(std::process::Stdio::null())
        .stderr(log_file);
    // Dies with the demo, however the demo ends.
    let child = model_residency::local::control_plane::spawn_owned(cmd)
        .map_err(|e| Failure::other(format!("start the {what}: {e}")))?;
    let process = Process {
        what,
        child,
        addr: addr.clone(),
        log,
        _dir: dir,
    };
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        if http_get(&addr, "/readyz")
            .await
            .is_some_and(|(status, _)| status == 200)
        {
            break;
        }
        if Instant::now() > deadline {
            return Err(Failure {
                message: format!(
                    "the {what} did not become ready; its log:\n{}",
                    std::fs::read_to_string(&process.log).unwrap_or_default()
                ),
                code: 1,
            });
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    println!("   ready: http://{addr}/readyz answers 200");
    Ok(process)
}

/// `model-residency run --leader-elect`, as the chart's ServiceAccount.
async fn start_operator(plane: &ControlPlane, real: bool) -> Result<Process, Failure> {
    install_rbac(plane)?;
    say("Starting the operator: model-residency run --leader-elect, as the chart's ServiceAccount");
    let mut args = vec!["run", "--leader-elect", "--lease-namespace", OPERATOR_NS];
    if real {
        // The GPU holder runs the local pause image (nothing is pulled).
        args.extend(["--gpu-holder-image", PAUSE_IMAGE]);
    }
    spawn_as(plane, "operator", "model-residency", &args).await
}

/// `model-residency route`, as the chart's router ServiceAccount. A zero
/// recency resolution writes every hit, so the residency's counters are the
/// seed's exactly.
async fn start_router(plane: &ControlPlane) -> Result<Process, Failure> {
    say(
        "Starting the request router: model-residency route --recency-resolution 0s, as the chart's router ServiceAccount",
    );
    spawn_as(
        plane,
        "router",
        "model-residency-router",
        &[
            "route",
            "--recency-resolution",
            "0s",
            "--load-timeout",
            "60s",
        ],
    )
    .await
}

/// Waits until the status reflects the spec and nothing is loading.
async fn settle(api: &Api<ModelResidency>, name: &str) -> Result<ModelResidency, Failure> {
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
