//! The real-node lane's cluster: one control plane and one real node
//! (kubelet, containerd, runc, the fake-GPU DRA plugin) shared by the
//! binary's real-node tests, which `scripts/test.sh` runs inside
//! `model-residency lane` one at a time (they share the node's GPUs and
//! its one kubelet). Each test gets a namespace and GPUs of its own.
//!
//! Outside a lane these tests fail with the reason (they are `#[ignore]`d,
//! so a plain `cargo test` counts them as skipped).

use super::cluster::TestEnv;
use super::operator::Harness;
use model_residency::controller::Context;
use model_residency::local::control_plane::{ControlPlane, PlaneOptions};
use model_residency::local::images::{PAUSE_IMAGE, model_server_template};
use model_residency::local::real_node::{RealNode, RealNodeOptions};
use std::sync::OnceLock;
use std::sync::atomic::{AtomicU32, Ordering};

/// The real node's name.
pub const NODE: &str = "real-node";
/// Its GPUs (fake devices: as many as the lane's tests use, one or two each).
pub const GPUS: u32 = 12;

pub struct RealCluster {
    pub plane: ControlPlane,
    pub node: RealNode,
}

static CLUSTER: OnceLock<Result<RealCluster, String>> = OnceLock::new();

/// The lane's cluster, started on first use.
pub fn cluster() -> &'static RealCluster {
    let started = CLUSTER.get_or_init(|| {
        std::thread::spawn(start)
            .join()
            .unwrap_or_else(|_| Err("starting the real node panicked".into()))
    });
    match started {
        Ok(c) => c,
        Err(e) => panic!("the real node could not start: {e}"),
    }
}

fn start() -> Result<RealCluster, String> {
    let plane = ControlPlane::start_with(PlaneOptions {
        real_node: Some(NODE.into()),
    })
    .map_err(|e| e.to_string())?;
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .map_err(|e| e.to_string())?;
    let node = runtime.block_on(async {
        let client = plane.client().await.map_err(|e| e.to_string())?;
        let options = RealNodeOptions {
            name: NODE.into(),
            gpus: GPUS,
            gpu_memory: 80 << 30,
            binary: env!("CARGO_BIN_EXE_model-residency").into(),
        };
        RealNode::start(&plane, &client, options)
            .await
            .map_err(|e| e.to_string())
    })?;
    eprintln!(
        "real node {NODE} Ready {:.1} s after its start (control plane {:.1} s)",
        node.startup.as_secs_f64(),
        plane.startup.as_secs_f64()
    );
    Ok(RealCluster { plane, node })
}

/// A namespace of the test's own on the lane's cluster.
pub async fn real_env(test: &str) -> TestEnv {
    let plane = &cluster().plane;
    let client = plane.client().await.expect("admin client");
    let namespace = test.replace('_', "-").chars().take(60).collect::<String>();
    super::cluster::create_namespace(&client, &namespace).await;
    TestEnv {
        client,
        namespace,
        plane,
    }
}

/// An operator for the test's namespace on the real node: model pods run
/// the local fake-model-server image, GPU holders the local pause image,
/// and the test's residencies get GPUs no other test of the lane uses.
pub async fn real_harness(test: &str, gpus: u32) -> Harness {
    let env = real_env(test).await;
    env.install_crds();
    let first = reserve_gpus(gpus);
    let mut h = Harness::with(env, NODE.into(), None, |client| {
        Context::with_holder_image(client, PAUSE_IMAGE)
    });
    h.template = real_template;
    h.next_device = AtomicU32::new(first);
    h
}

/// The index of the first of `gpus` GPUs of the node that no other test of
/// the lane uses.
pub fn reserve_gpus(gpus: u32) -> u32 {
    static NEXT_GPU: AtomicU32 = AtomicU32::new(0);
    let first = NEXT_GPU.fetch_add(gpus, Ordering::Relaxed);
    assert!(
        first + gpus <= GPUS,
        "the lane's tests want more than {GPUS} GPUs"
    );
    first
}

/// A model pod that runs the fake model server in a container.
pub fn real_template(_model: &str) -> serde_json::Value {
    model_server_template(8080, None)
}

/// The body of the first 200 to `GET path` at a Service's cluster IP
/// `addr`, within `secs` (kube-proxy follows a Service's endpoints within
/// a second or so; each try gives up after 3 s).
pub async fn served_at(addr: std::net::SocketAddr, path: &str, secs: u64) -> String {
    let what = format!("http://{addr}{path} to answer 200");
    super::cluster::eventually(secs, &what, || async {
        let asked = model_residency::http::send(addr, "GET", path, "");
        let a = tokio::time::timeout(std::time::Duration::from_secs(3), asked)
            .await
            .ok()?
            .ok()?;
        (a.status == 200).then_some(a.body)
    })
    .await
}
