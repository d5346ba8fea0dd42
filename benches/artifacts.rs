//! The node's disk tier: how fast the node agent downloads, and what a
//! cached artifact saves.
//!
//! Run: `cargo bench --bench artifacts [-- --mib 512 --rounds 3 --model-mib 200]`
//! (the second part needs `bash scripts/control-plane.sh` once). Prints its
//! figures; the ones in docs/performance.md came from this command.
//!
//! - **Download throughput**: one file of `--mib` MiB from a local HTTP
//!   server, fetched by the agent's fetcher (sha256 verified, synced to
//!   disk, renamed into place) and by three floors in the same run,
//!   alternating, `--rounds` each, the median of each: `curl -o` alone;
//!   `curl -o` then `sha256sum` (the floor); and that then `sync`
//!   of the file (as durable as the agent's).
//! - **Registry pull**: one `--oci-mib` MiB blob from a local registry
//!   (Debian's docker-registry, TLS, basic auth; `bash scripts/registry.sh`)
//!   by the agent's OCI fetcher against `curl | sha256sum` of the same
//!   blob; then a second artifact that shares all but a 1 MiB layer with
//!   the first: what it fetches and how long it takes.
//! - **Time to Ready**: a model with a `--model-mib` MiB artifact, from its
//!   request until its status is Loaded: fetched on demand, then (after an
//!   eviction) from the cache.

mod support;

use bytes::Bytes;
use http::{Request, Response};
use http_body_util::Full;
use hyper::body::Incoming;
use kube::api::{Api, PostParams};
use model_residency::api::{ModelResidency, ModelState};
use model_residency::local::control_plane::ControlPlane;
use model_residency::local::kubelet::{FakeKubelet, KubeletConfig};
use model_residency::node_agent::agent::AgentConfig;
use model_residency::node_agent::blobs::STORE_DIR;
use model_residency::node_agent::fetch::{FileSource, Progress, client, fetch};
use serde_json::json;
use std::convert::Infallible;
use std::net::SocketAddr;
use std::process::Command;
use std::sync::Arc;
use std::time::{Duration, Instant};
use support::{arg, bench_args, client_with, runtime, start_plane, until_state};

const NS: &str = "bench-artifacts";
const NODE: &str = "node-art";

/// Serves `data` at every path, from a runtime of its own (so the server
/// takes no time from the fetcher's runtime, as it takes none from curl).
async fn serve(data: Bytes) -> SocketAddr {
    let (tx, rx) = tokio::sync::oneshot::channel();
    std::thread::spawn(move || {
        let rt = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .unwrap();
        rt.block_on(async move {
            let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
            let _ = tx.send(listener.local_addr().unwrap());
            model_residency::http::accept_loop(listener, move |stream| {
                let data = data.clone();
                tokio::spawn(async move {
                    let service = hyper::service::service_fn(move |_req: Request<Incoming>| {
                        let data = data.clone();
                        async move { Ok::<_, Infallible>(Response::new(Full::new(data))) }
                    });
                    let _ = hyper::server::conn::http1::Builder::new()
                        .serve_connection(hyper_util::rt::TokioIo::new(stream), service)
                        .await;
                });
            })
            .await
        })
    });
    rx.await.unwrap()
}

fn median(mut v: Vec<Duration>) -> Duration {
    v.sort();
    v[v.len() / 2]
}

fn mib_per_s(bytes: usize, d: Duration) -> f64 {
    bytes as f64 / (1 << 20) as f64 / d.as_secs_f64()
}

async fn throughput(mib: usize, rounds: usize) {
    let data: Vec<u8> = (0..mib << 20).map(|i| (i % 251) as u8).collect();
    let sha: String = ring::digest::digest(&ring::digest::SHA256, &data)
        .as_ref()
        .iter()
        .map(|b| format!("{b:02x}"))
        .collect();
    let len = data.len();
    let addr = serve(Bytes::from(data)).await;
    let dir = tempfile::tempdir_in(std::env::temp_dir()).unwrap();
    let files = [FileSource {
        uri: format!("http://{addr}/weights.bin"),
        path: None,
        sha256: Some(sha),
    }];
    let allowed = vec![format!("http://{addr}/")];
    let http = client(&allowed).unwrap();
    // Floors, each alternating with the agent: the transfer alone; the
    // issue's floor, the transfer and its sha256 (one after the other, as a
    // script would); and that, durable as the agent's (fsync of the file).
    let floors = [
        ("curl -o (the transfer alone)", ""),
        ("curl -o, then sha256sum", " && sha256sum \"$1\" >/dev/null"),
        (
            "curl -o, sha256sum, then sync (durable, as the agent)",
            " && sha256sum \"$1\" >/dev/null && sync \"$1\"",
        ),
    ];
    let mut ours = Vec::new();
    let mut theirs = vec![Vec::new(); floors.len()];
    for round in 0..rounds {
        let t = Instant::now();
        fetch(
            &http,
            dir.path(),
            &format!("m{round}"),
            &files,
            len as u64,
            &allowed,
            &Progress::default(),
        )
        .await
        .unwrap();
        ours.push(t.elapsed());
        std::fs::remove_dir_all(dir.path().join(format!("m{round}"))).unwrap();
        // The next round downloads again (the blob store would link it).
        std::fs::remove_dir_all(dir.path().join(STORE_DIR)).unwrap();
        let out = dir.path().join("curl.bin");
        for ((_, then), times) in floors.iter().zip(&mut theirs) {
            let script = format!(
                "set -e; set -- {}; curl -sf -o \"$1\" {}{then}",
                out.display(),
                files[0].uri
            );
            let (took, done) = timed_bash(script).await;
            assert!(done.status.success(), "{done:?}");
            assert_eq!(std::fs::metadata(&out).unwrap().len(), len as u64);
            std::fs::remove_file(&out).unwrap();
            times.push(took);
        }
    }
    let o = median(ours);
    println!("== download throughput: {mib} MiB, median of {rounds}");
    println!(
        "   node agent (sha256 verified, synced, renamed into place): {:.0} MiB/s ({:.2} s)",
        mib_per_s(len, o),
        o.as_secs_f64()
    );
    for ((name, _), times) in floors.iter().zip(theirs) {
        let c = median(times);
        println!(
            "   {name:<55} {:.0} MiB/s ({:.2} s): agent {:.2}x",
            mib_per_s(len, c),
            c.as_secs_f64(),
            c.as_secs_f64() / o.as_secs_f64()
        );
    }
    println!("   goal: at least 0.95x the transfer and its sha256");
}

async fn time_to_ready(plane: &ControlPlane, model_mib: usize) {
    let client = client_with(plane, &[NS]).await;
    let _kubelet = FakeKubelet::start(client.clone(), KubeletConfig::instant(&[NODE]))
        .await
        .unwrap();
    let (_ctx, _operator) = model_residency::operator::spawn_for_namespace(client.clone(), NS);
    let data: Vec<u8> = (0..model_mib << 20).map(|i| (i % 241) as u8).collect();
    let addr = serve(Bytes::from(data)).await;
    let dir = tempfile::tempdir().unwrap();
    let config = AgentConfig {
        node: NODE.into(),
        cache_dir: dir.path().join("cache"),
        budget: 10 << 30,
        allowed_sources: vec![format!("http://{addr}/")],
        max_concurrent_downloads: 2,
        registry: Default::default(),
    };
    let agent = tokio::spawn(model_residency::node_agent::agent::run(
        client.clone(),
        config,
        Default::default(),
        Arc::default(),
        std::future::pending(),
    ));
    let template = json!({"spec": {"containers": [{"name": "s", "image": "i"}]}});
    let r: ModelResidency = serde_json::from_value(json!({
        "apiVersion": "residency.dev/v1alpha1", "kind": "ModelResidency",
        "metadata": {"name": "gpu"},
        "spec": {"nodeName": NODE, "device": "0", "budget": "1Gi", "models": [
            {"name": "big", "size": "1Gi", "template": template,
             "artifact": {"files": [{"uri": format!("http://{addr}/w.bin")}], "size": format!("{model_mib}Mi")}},
            {"name": "other", "size": "1Gi", "template": template},
        ]},
    }))
    .unwrap();
    let api: Api<ModelResidency> = Api::namespaced(client.clone(), NS);
    api.create(&PostParams::default(), &r).await.unwrap();
    let request = |m: &'static str| {
        let api = api.clone();
        async move {
            let t = Instant::now();
            model_residency::residency::demand::load(
                &api,
                "gpu",
                m,
                k8s_openapi::jiff::Timestamp::now(),
            )
            .await
            .unwrap();
            until_state(&api, m, ModelState::Loaded, Duration::from_secs(120)).await;
            t.elapsed()
        }
    };
    let cold = request("big").await;
    request("other").await;
    let cached = request("big").await;
    println!(
        "\n== time to Ready of a model with a {model_mib} MiB artifact (request to status Loaded)"
    );
    println!("   fetched on demand: {:.0} ms", cold.as_secs_f64() * 1e3);
    println!(
        "   from the node's cache (after an eviction): {:.0} ms",
        cached.as_secs_f64() * 1e3
    );
    println!(
        "   the cache saves {:.0} ms ({:.1}x faster)",
        (cold - cached).as_secs_f64() * 1e3,
        cold.as_secs_f64() / cached.as_secs_f64()
    );
    agent.abort();
}

/// Runs `script` with bash; how long it took, and what it printed.
async fn timed_bash(script: String) -> (Duration, std::process::Output) {
    let t = Instant::now();
    let out =
        tokio::task::spawn_blocking(move || Command::new("bash").args(["-c", &script]).output())
            .await
            .unwrap()
            .expect("bash");
    (t.elapsed(), out)
}

/// A blob pulled from the local registry (TLS, basic auth) by the node
/// agent's OCI fetcher against curl of the same blob piped to sha256sum,
/// alternating; then a second artifact sharing all but one small layer.
async fn registry_pull(mib: usize, rounds: usize) {
    use model_residency::local::registry::{LocalRegistry, PASSWORD, USER};
    use model_residency::node_agent::oci::{self, Registry, Source};
    use oci_client::secrets::RegistryAuth;
    let data: Vec<u8> = (0..mib << 20).map(|i| (i % 253) as u8).collect();
    let own: Vec<u8> = (0..1 << 20).map(|i| (i % 241) as u8).collect();
    let reg = match LocalRegistry::start() {
        Ok(r) => r,
        Err(e) => {
            println!("== registry pull: skipped ({e})");
            return;
        }
    };
    const OCTETS: &str = "application/octet-stream";
    let d1 = reg
        .push("models/big", "v1", &[(OCTETS, &data, Some("weights.bin"))])
        .await
        .unwrap();
    let d2 = reg
        .push(
            "models/big2",
            "v1",
            &[
                (OCTETS, &data, Some("weights.bin")),
                (OCTETS, &own, Some("adapter.bin")),
            ],
        )
        .await
        .unwrap();
    let blob = model_residency::local::registry::sha256_digest(&data);
    let registry = Registry::new(Some(std::fs::read(reg.ca_file()).unwrap()), vec![]).unwrap();
    let auth = RegistryAuth::Basic(USER.into(), PASSWORD.into());
    let source =
        |repo: &str, d: &str| Source::parse(&format!("oci://{}/{repo}@{d}", reg.host())).unwrap();
    let (s1, s2) = (source("models/big", &d1), source("models/big2", &d2));
    let (mut ours, mut theirs, mut bare) = (Vec::new(), Vec::new(), Vec::new());
    let declared = (data.len() + own.len()) as u64;
    for _ in 0..rounds {
        let dir = tempfile::tempdir_in(std::env::temp_dir()).unwrap();
        let t = Instant::now();
        let resolved = registry.resolve(&s1, &auth).await.unwrap();
        oci::fetch(
            &registry,
            &auth,
            dir.path(),
            "big",
            &s1,
            &resolved,
            "models",
            declared,
            &Progress::default(),
        )
        .await
        .unwrap();
        ours.push(t.elapsed());
        drop(dir);
        let script = format!(
            "set -o pipefail; curl -sf --cacert {} -u {USER}:{PASSWORD} https://{}/v2/models/big/blobs/{blob} | sha256sum",
            reg.ca_file().display(),
            reg.host()
        );
        let (took, out) = timed_bash(script).await;
        theirs.push(took);
        assert!(
            out.status.success(),
            "{}",
            String::from_utf8_lossy(&out.stderr)
        );
        assert!(
            String::from_utf8_lossy(&out.stdout).starts_with(blob.trim_start_matches("sha256:"))
        );
        // The transfer alone: curl -o, no hash.
        let file = std::env::temp_dir().join("registry-curl.bin");
        let script = format!(
            "curl -sf --cacert {} -u {USER}:{PASSWORD} -o {} https://{}/v2/models/big/blobs/{blob}",
            reg.ca_file().display(),
            file.display(),
            reg.host()
        );
        let (took, out) = timed_bash(script).await;
        bare.push(took);
        assert!(out.status.success());
        assert_eq!(std::fs::metadata(&file).unwrap().len(), data.len() as u64);
        std::fs::remove_file(&file).unwrap();
    }
    let (o, c, b) = (median(ours), median(theirs), median(bare));
    println!("== registry pull: one {mib} MiB blob over TLS with basic auth, median of {rounds}");
    println!(
        "   node agent (resolve, digest verified, into the blob store, linked): {:.0} MiB/s ({:.2} s)",
        mib_per_s(data.len(), o),
        o.as_secs_f64()
    );
    println!(
        "   curl | sha256sum:                                                 {:.0} MiB/s ({:.2} s)",
        mib_per_s(data.len(), c),
        c.as_secs_f64()
    );
    println!(
        "   curl -o (the transfer alone, no hash):                            {:.0} MiB/s ({:.2} s)",
        mib_per_s(data.len(), b),
        b.as_secs_f64()
    );
    println!(
        "   ratio agent/(curl | sha256sum): {:.2}x (goal at least 0.9x); agent/(curl -o): {:.2}x",
        c.as_secs_f64() / o.as_secs_f64(),
        b.as_secs_f64() / o.as_secs_f64()
    );
    // A second model sharing all but its 1 MiB adapter.
    let dir = tempfile::tempdir_in(std::env::temp_dir()).unwrap();
    let first = registry.resolve(&s1, &auth).await.unwrap();
    let t = Instant::now();
    let a = oci::fetch(
        &registry,
        &auth,
        dir.path(),
        "big",
        &s1,
        &first,
        "models",
        declared,
        &Progress::default(),
    )
    .await
    .unwrap();
    let first_time = t.elapsed();
    let t = Instant::now();
    let second = registry.resolve(&s2, &auth).await.unwrap();
    let b = oci::fetch(
        &registry,
        &auth,
        dir.path(),
        "big2",
        &s2,
        &second,
        "models",
        declared,
        &Progress::default(),
    )
    .await
    .unwrap();
    let second_time = t.elapsed();
    let on_disk = model_residency::node_agent::blobs::unique_usage(dir.path()).unwrap();
    println!("== a second model sharing all but one layer");
    println!(
        "   first:  {:.3} s, {} bytes fetched",
        first_time.as_secs_f64(),
        a.bytes - a.shared - a.resumed
    );
    println!(
        "   second: {:.3} s, {} bytes fetched (its own layer: {} bytes), {} linked from the store",
        second_time.as_secs_f64(),
        b.bytes - b.shared - b.resumed,
        own.len(),
        b.shared
    );
    println!(
        "   on disk for both: {} bytes ({} of artifacts)",
        on_disk,
        a.bytes + b.bytes
    );
}

fn main() {
    let args = bench_args();
    let mib: usize = arg(&args, "--mib", "512").parse().unwrap();
    let rounds: usize = arg(&args, "--rounds", "3").parse().unwrap();
    let model_mib: usize = arg(&args, "--model-mib", "200").parse().unwrap();
    let oci_mib: usize = arg(&args, "--oci-mib", "256").parse().unwrap();
    let rt = runtime();
    rt.block_on(throughput(mib, rounds));
    rt.block_on(registry_pull(oci_mib, rounds));
    let plane = start_plane();
    rt.block_on(time_to_ready(&plane, model_mib));
}
