//! Warm start time and memory of the local control plane.
//!
//! Run: `cargo bench --bench control_plane` (needs `bash scripts/control-plane.sh` once).
//! Starts etcd + kube-apiserver + kube-controller-manager five times from
//! the cached binaries, and prints the time to `/readyz` and the resident
//! memory of the three processes once ready and after 100 objects.

use k8s_openapi::api::core::v1::ConfigMap;
use kube::api::{Api, PostParams};
use model_residency::local::control_plane::ControlPlane;
use std::time::Duration;

fn main() {
    let mut startups = Vec::new();
    for run in 1..=5 {
        let plane = ControlPlane::start().expect("start the control plane");
        startups.push(plane.startup);
        let idle = plane.rss_bytes();
        if run == 1 {
            let rt = tokio::runtime::Runtime::new().unwrap();
            rt.block_on(async {
                let client = plane.client().await.unwrap();
                let cms: Api<ConfigMap> = Api::namespaced(client, "default");
                for i in 0..100 {
                    let cm: ConfigMap = serde_json::from_value(serde_json::json!({
                        "metadata": {"name": format!("cm-{i}")}, "data": {"k": "v"}
                    }))
                    .unwrap();
                    cms.create(&PostParams::default(), &cm).await.unwrap();
                }
            });
            std::thread::sleep(Duration::from_secs(2));
            println!(
                "run {run}: ready in {:.2} s; RSS {} MiB idle, {} MiB after 100 objects",
                plane.startup.as_secs_f64(),
                idle >> 20,
                plane.rss_bytes() >> 20
            );
        } else {
            println!(
                "run {run}: ready in {:.2} s; RSS {} MiB",
                plane.startup.as_secs_f64(),
                idle >> 20
            );
        }
    }
    startups.sort();
    println!(
        "warm start to /readyz: median {:.2} s, max {:.2} s over {} runs",
        startups[startups.len() / 2].as_secs_f64(),
        startups.last().unwrap().as_secs_f64(),
        startups.len()
    );
}
