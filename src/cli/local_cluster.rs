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
}

pub fn run(args: Args) -> Result<(), Failure> {
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
        println!("(Ctrl-C stops it and removes its files)");
        println!(
            "then, each in a shell with that KUBECONFIG:\n  \
             model-residency run --http-addr 127.0.0.1:8081\n  \
             model-residency route --http-addr 127.0.0.1:8080\n  \
             kubectl create namespace models && kubectl apply -n models -f examples/seed-registry.yaml\n  \
             curl -s 127.0.0.1:8080/v1/chat/completions -d '{{\"model\":\"qwen-llm\",\"messages\":[]}}'\n  \
             kubectl get mres -n models"
        );
        let _ = tokio::signal::ctrl_c().await;
        Ok(())
    })
}
