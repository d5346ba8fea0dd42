//! `model-residency local-cluster`: a local control plane with the CRDs
//! installed, plus a kubelet stand-in for fake GPU nodes, kept up until
//! Ctrl-C, for trying the operator by hand with kubectl (`export
//! KUBECONFIG=...` as printed, with the next commands to run).

use super::Failure;
use model_residency::local::control_plane::ControlPlane;
use model_residency::local::kubelet::{FakeKubelet, FakeNode, KubeletConfig};
use std::time::Duration;

#[derive(clap::Args, Debug)]
pub struct Args {
    /// Fake GPU nodes to register (repeatable), each with one 80Gi GPU
    /// unless --gpu says otherwise.
    #[arg(long = "node", default_values_t = ["node-a".to_string()])]
    nodes: Vec<String>,
    /// A node's GPUs as NODE=COUNTxMEMORY (`--gpu node-a=2x80Gi`,
    /// repeatable): published in its ResourceSlice as the NVIDIA DRA driver
    /// does. A node named only here is registered too.
    #[arg(long = "gpu")]
    gpus: Vec<FakeNode>,
    /// Seconds a pod takes to become Ready, per GiB of its model.
    #[arg(long, default_value_t = 0.2)]
    load_secs_per_gib: f64,
    /// Run the first node as a real node (the kubelet and containerd, in a
    /// lane of their own: docs/local-cluster.md) instead of the stand-in;
    /// needs root and `bash scripts/real-node.sh`.
    #[arg(long)]
    real_node: bool,
    /// With --real-node: install the chart as users do (`helm install` of
    /// charts/model-residency, its image built from this binary without
    /// Docker) into model-residency-system, at the restricted Pod Security
    /// level, and a residency with two models on the node's first GPU in
    /// namespace models; it prints the router Service to send requests to.
    #[arg(long, requires = "real_node")]
    chart: bool,
}

pub fn run(args: Args) -> Result<(), Failure> {
    if args.real_node {
        return real_node(args);
    }
    let plane = ControlPlane::start().map_err(|e| Failure {
        message: e.to_string(),
        code: 1,
    })?;
    let runtime = tokio::runtime::Runtime::new().map_err(|e| Failure {
        message: e.to_string(),
        code: 1,
    })?;
    runtime.block_on(async {
        let client = plane.client().await.map_err(|e| Failure {
            message: e.to_string(),
            code: 1,
        })?;
        model_residency::local::install_crd(&client)
            .await
            .map_err(|e| Failure {
                message: format!("install the CRDs: {e}"),
                code: 1,
            })?;
        let nodes: Vec<&str> = args.nodes.iter().map(String::as_str).collect();
        let mut config = KubeletConfig::instant(&nodes);
        for gpu in &args.gpus {
            match config.nodes.iter_mut().find(|n| n.name == gpu.name) {
                Some(n) => *n = gpu.clone(),
                None => config.nodes.push(gpu.clone()),
            }
        }
        let described: Vec<String> = config
            .nodes
            .iter()
            .map(|n| format!("{} ({}x{})", n.name, n.gpus, model_residency::quantity::format_bytes(n.gpu_memory)))
            .collect();
        config.load_delay = Duration::from_millis(200);
        config.delay_per_gib = Duration::from_secs_f64(args.load_secs_per_gib.max(0.0));
        config.terminating_delay = Duration::from_millis(200);
        let _kubelet = FakeKubelet::start(client, config)
            .await
            .map_err(|e| Failure {
                message: format!("register the nodes: {e}"),
                code: 1,
            })?;
        println!(
            "local control plane (Kubernetes {}) ready in {:.1} s; fake GPU nodes: {}",
            plane.version(),
            plane.startup.as_secs_f64(),
            described.join(", ")
        );
        println!("the ModelResidency, ModelDemand and NodeModelCache CRDs are installed");
        println!("export KUBECONFIG={}", plane.kubeconfig().display());
        println!("(Ctrl-C or SIGTERM stops it and removes its files)");
        println!(
            "then, each in a shell with that KUBECONFIG:\n  \
             model-residency run --http-addr 127.0.0.1:8081\n  \
             model-residency route --http-addr 127.0.0.1:8080\n  \
             kubectl create namespace models && kubectl apply -n models -f examples/seed-registry.yaml\n  \
             curl -s 127.0.0.1:8080/v1/chat/completions -d '{{\"model\":\"qwen-llm\",\"messages\":[]}}'\n  \
             kubectl get mres -n models"
        );
        super::process::termination().await;
        Ok(())
    })
}

/// `local-cluster --real-node`: in a lane, the control plane and one real
/// node, until Ctrl-C; a shell enters the lane with nsenter to use them.
fn real_node(args: Args) -> Result<(), Failure> {
    use model_residency::local::real_node::{RealNode, RealNodeOptions};
    if model_residency::local::lane::current().is_none() {
        return super::container::rerun_in_lane(&[]);
    }
    let name = args
        .nodes
        .first()
        .cloned()
        .unwrap_or_else(|| "node-a".into());
    let gpu = args.gpus.iter().find(|g| g.name == name);
    let options = RealNodeOptions {
        name: name.clone(),
        gpus: gpu.map_or(2, |g| g.gpus),
        gpu_memory: gpu.map_or(80 << 30, |g| g.gpu_memory),
        binary: std::env::current_exe().map_err(Failure::other)?,
    };
    let plane = ControlPlane::start_with(model_residency::local::control_plane::PlaneOptions {
        real_node: Some(name.clone()),
    })
    .map_err(Failure::other)?;
    let runtime = tokio::runtime::Runtime::new().map_err(Failure::other)?;
    runtime.block_on(async {
        let client = plane.client().await.map_err(Failure::other)?;
        model_residency::local::install_crd(&client)
            .await
            .map_err(|e| Failure::other(format!("install the CRDs: {e}")))?;
        let node = RealNode::start(&plane, &client, options)
            .await
            .map_err(Failure::other)?;
        let enter = model_residency::local::lane::entry_pid()
            .map(|pid| format!("nsenter --target {pid} --net --mount"))
            .unwrap_or_else(|| "nsenter (the lane's pid was not found)".into());
        println!(
            "local control plane (Kubernetes {}) and real node {name} (containerd {}) ready in {:.1} s, in a lane of their own",
            plane.version(),
            model_residency::local::real_node::CONTAINERD_VERSION,
            plane.startup.as_secs_f64() + node.startup.as_secs_f64()
        );
        println!("enter the lane from another shell (as root): {enter} bash");
        println!("export KUBECONFIG={}", plane.kubeconfig().display());
        println!(
            "model pods run the local image {} (model-residency fake-model-server), GPU holders {}: \
             run the operator with --gpu-holder-image {}",
            model_residency::local::images::MODEL_SERVER_IMAGE,
            model_residency::local::images::PAUSE_IMAGE,
            model_residency::local::images::PAUSE_IMAGE
        );
        if args.chart {
            let router = install_chart(&plane, &client, &name).await?;
            println!(
                "the chart is installed in {CHART_NAMESPACE} (kubectl get pods -n {CHART_NAMESPACE}), and residency \
                 gpu-0 in namespace models lists small and large; in the lane:\n  \
                 curl -s http://{router}/v1/chat/completions -d '{{\"model\":\"small\",\"messages\":[]}}'\n  \
                 model-residency top -A"
            );
        }
        println!("(Ctrl-C or SIGTERM stops it; its containers, mounts and files go with it)");
        super::process::termination().await;
        drop(node);
        Ok(())
    })
}

/// Where `--chart` installs it.
const CHART_NAMESPACE: &str = "model-residency-system";

/// `--chart`: the chart into [`CHART_NAMESPACE`] (restricted Pod Security),
/// and a residency on GPU 0 of `node` in namespace `models`; returns the
/// router Service's address.
async fn install_chart(
    plane: &ControlPlane,
    client: &kube::Client,
    node: &str,
) -> Result<String, Failure> {
    use k8s_openapi::api::core::v1::{Namespace, Service};
    use kube::api::{Api, PostParams};
    use model_residency::local::chart::{Release, helm_binary, helm_release};
    use model_residency::local::images::model_server_template;
    let namespaces: Api<Namespace> = Api::all(client.clone());
    for (name, level) in [(CHART_NAMESPACE, "restricted"), ("models", "baseline")] {
        let ns: Namespace = serde_json::from_value(serde_json::json!({"metadata": {
            "name": name, "labels": {"pod-security.kubernetes.io/enforce": level}}}))
        .map_err(Failure::other)?;
        namespaces
            .create(&PostParams::default(), &ns)
            .await
            .map_err(Failure::other)?;
    }
    let helm = helm_binary().map_err(Failure::other)?;
    println!(
        "helm install model-residency charts/model-residency -n {CHART_NAMESPACE} (its pods from the local image)"
    );
    let out = helm_release(&Release {
        helm: &helm,
        kubeconfig: plane.kubeconfig(),
        verb: "install",
        release: "model-residency",
        namespace: CHART_NAMESPACE,
        tag: model_residency::local::images::CHART_IMAGE_TAGS[0],
        wait_secs: 180,
    })
    .map_err(Failure::other)?;
    if !out.status.success() {
        return Err(Failure::other(format!(
            "helm install: {}",
            String::from_utf8_lossy(&out.stderr)
        )));
    }
    let residency: model_residency::api::ModelResidency =
        serde_json::from_value(serde_json::json!({
            "apiVersion": "residency.dev/v1alpha1", "kind": "ModelResidency",
            "metadata": {"name": "gpu-0"},
            "spec": {"nodeName": node, "device": "0", "budget": "40Gi", "models": [
                {"name": "small", "size": "10Gi", "template": model_server_template(8080, None)},
                {"name": "large", "size": "30Gi", "template": model_server_template(8080, None)},
            ]},
        }))
        .map_err(Failure::other)?;
    Api::namespaced(client.clone(), "models")
        .create(&PostParams::default(), &residency)
        .await
        .map_err(Failure::other)?;
    let services: Api<Service> = Api::namespaced(client.clone(), CHART_NAMESPACE);
    let ip = services
        .get("model-residency-router")
        .await
        .map_err(Failure::other)?
        .spec
        .and_then(|s| s.cluster_ip)
        .unwrap_or_default();
    Ok(format!("{ip}:80"))
}
