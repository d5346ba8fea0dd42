//! `model-residency demo`: the whole product on a local control plane, in
//! about half a minute, explaining itself as it goes.
//!
//! Starts a real kube-apiserver + etcd + garbage collector, installs the
//! CRD and the chart's RBAC, runs `model-residency run --leader-elect` and
//! `model-residency route` as separate processes, each with its chart
//! ServiceAccount's permissions, plays the kubelet for one fake GPU node
//! (every model pod a real HTTP server), declares the models of
//! `examples/seed-registry.yaml` once as a ModelCatalog and a ResidencySet
//! over the node's GPU 0 with the manifest's 16000Mi budget (the operator
//! stamps that GPU's ModelResidency from the node's ResourceSlice), and
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

mod disk;
mod observe;
mod processes;
mod seed;

use disk::*;
use processes::*;
use seed::*;

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
/// The catalog and the set the demo declares.
const SEED: &str = "seed";

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
    /// Save the dashboard's main panel, as Prometheus answers it over the
    /// run, into this folder (for scripts/dashboard-picture.py).
    #[arg(long, value_name = "DIR")]
    dashboard_data: Option<PathBuf>,
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
    let result = runtime.block_on(story(
        &plane,
        residency,
        node,
        args.dashboard_data.as_deref(),
    ));
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

async fn story(
    plane: &ControlPlane,
    mut residency: ModelResidency,
    node_kind: Node,
    dashboard_data: Option<&Path>,
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
    let mut prometheus = observe::start(&[&operator.addr])?;

    let namespaces: Api<Namespace> = Api::all(client.clone());
    let ns: Namespace =
        serde_json::from_value(serde_json::json!({"metadata": {"name": NAMESPACE}}))
            .expect("static namespace");
    namespaces
        .create(&PostParams::default(), &ns)
        .await
        .map_err(fail("create the namespace"))?;
    let name = catalog_and_set(&client, &residency).await?;
    let api: Api<ModelResidency> = Api::namespaced(client.clone(), NAMESPACE);
    settle(&api, &name).await?;
    kubectl(
        kc,
        &["get", "mcat,mrset,mres", "-n", NAMESPACE, "-o", "wide"],
    );
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
    if let Some(p) = &mut prometheus {
        p.add(&router.addr)?;
    }
    seed_requests(&api, kc, &name, &router.addr).await?;

    let (node_agent, disk) = disk_tier(plane, &api, &name, &residency, &router.addr).await?;
    if let Some(p) = &mut prometheus {
        p.add(&node_agent.addr)?;
    }
    warm::warm_tier(&api, kc, &demo_node(&residency), &router.addr, real).await?;

    epilogue(
        &api,
        kc,
        &name,
        &router.addr,
        &operator.addr,
        &node_agent.addr,
    )
    .await?;
    if let Some(prometheus) = prometheus {
        say(
            "The chart's Grafana dashboard and alerts (dashboard.enabled, alerts.enabled) against that Prometheus: every panel's queries, every alert's expression",
        );
        prometheus.check(3).await?;
        if let Some(dir) = dashboard_data {
            prometheus.save_main_panel(dir).await?;
        }
    }
    router.stop();
    node_agent.stop();
    drop(disk);
    operator.stop();
    Ok(())
}

/// The end of the story: what the router serves, the events, the pods, the
/// counters and each process's metrics.
async fn epilogue(
    api: &Api<ModelResidency>,
    kc: &Path,
    name: &str,
    router: &str,
    operator: &str,
    node_agent: &str,
) -> Result<(), Failure> {
    say("What the router serves (curl /v1/models)");
    println!("$ curl -s http://{}/v1/models", router);
    let models = http_get(router, "/v1/models").await.unwrap_or_default().1;
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
        .get(name)
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
            operator
        ),
        operator,
        |l| l.contains("residency=\"seed-gpu\""),
    )
    .await;
    show_metrics(
        &format!(
            "The router's metrics (curl http://{}/metrics | grep requests_total): every request, by model and code",
            router
        ),
        router,
        |l| {
            l.starts_with("model_residency_router_requests_total")
                || l.starts_with("model_residency_router_demand_writes_total")
        },
    )
    .await;
    show_metrics(
        &format!(
            "The node agent's metrics (curl http://{}/metrics | grep fetch)",
            node_agent
        ),
        node_agent,
        |l| {
            l.starts_with("model_residency_node_agent_fetches_total")
                || l.starts_with("model_residency_node_agent_fetched_bytes_total")
                || l.starts_with("model_residency_node_agent_disk_used_bytes")
        },
    )
    .await;
    Ok(())
}

/// Declares the manifest's models once, as ModelCatalog `seed`, and a
/// ResidencySet `seed` over the node's GPU the manifest names (its budget
/// and GPU mode): the operator stamps that GPU's residency from the
/// ResourceSlice the node publishes. Its name, once it is there.
async fn catalog_and_set(
    client: &kube::Client,
    residency: &ModelResidency,
) -> Result<String, Failure> {
    use model_residency::api::{ModelCatalog, ResidencySet};
    let node = demo_node(residency);
    let spec = &residency.spec;
    say(&format!(
        "Declaring the seed's models once: ModelCatalog {SEED} (zimage 10900Mi, qwen-llm 3000Mi, sdxl 6000Mi, oversized 20000Mi, small-a/b/c 4000Mi)"
    ));
    let catalog: ModelCatalog = serde_json::from_value(serde_json::json!({
        "apiVersion": "residency.dev/v1alpha1", "kind": "ModelCatalog",
        "metadata": {"name": SEED}, "spec": {"models": spec.models},
    }))
    .map_err(Failure::other)?;
    Api::<ModelCatalog>::namespaced(client.clone(), NAMESPACE)
        .create(&PostParams::default(), &catalog)
        .await
        .map_err(fail("create the ModelCatalog"))?;
    let selector = format!(
        "device.attributes['gpu.nvidia.com'].index == {}",
        spec.device
    );
    say(&format!(
        "A ResidencySet {SEED} over the GPUs the node publishes that `{selector}` selects, each with a {} budget and the catalog: the operator stamps one ModelResidency per GPU from the node's ResourceSlice",
        spec.budget
            .as_ref()
            .map_or("device-sized", |b| b.0.as_str())
    ));
    let mut settings = serde_json::json!({});
    if let Some(b) = &spec.budget {
        settings["budget"] = serde_json::json!(b.0);
    }
    if *spec.gpu != Default::default() {
        settings["gpu"] = serde_json::json!(spec.gpu);
    }
    let set: ResidencySet = serde_json::from_value(serde_json::json!({
        "apiVersion": "residency.dev/v1alpha1", "kind": "ResidencySet",
        "metadata": {"name": SEED},
        "spec": {"devices": {"selectors": [{"cel": {"expression": selector}}]},
            "catalog": {"name": SEED}, "residency": settings},
    }))
    .map_err(Failure::other)?;
    Api::<ResidencySet>::namespaced(client.clone(), NAMESPACE)
        .create(&PostParams::default(), &set)
        .await
        .map_err(fail("create the ResidencySet"))?;
    let name = model_residency::residency::devices::stamped_name(
        SEED,
        &node,
        &format!("gpu-{}", spec.device),
    );
    let api: Api<ModelResidency> = Api::namespaced(client.clone(), NAMESPACE);
    let deadline = Instant::now() + Duration::from_secs(60);
    while api
        .get_opt(&name)
        .await
        .map_err(fail("read the ModelResidency"))?
        .is_none()
    {
        if Instant::now() > deadline {
            return Err(Failure::other(format!(
                "the set stamped no {name} within 60 s"
            )));
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    println!("   stamped ModelResidency {name}");
    // The set counts it once the residency watch has it.
    let sets: Api<ResidencySet> = Api::namespaced(client.clone(), NAMESPACE);
    while sets
        .get(SEED)
        .await
        .map_err(fail("read the ResidencySet"))?
        .status
        .is_none_or(|s| s.residencies == 0)
    {
        if Instant::now() > deadline {
            return Err(Failure::other(format!(
                "{SEED} did not count {name} within 60 s"
            )));
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    Ok(name)
}

/// Says `title` and prints the lines of `addr`'s /metrics that `keep`.
async fn show_metrics(title: &str, addr: &str, keep: impl Fn(&str) -> bool) {
    say(title);
    let metrics = http_get(addr, "/metrics").await.unwrap_or_default().1;
    for line in metrics.lines().filter(|l| keep(l)) {
        println!("   {line}");
    }
}
