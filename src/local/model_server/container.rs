//! The fake model server as a container's process on a real node
//! (`model-residency fake-model-server`, the local image's entrypoint):
//! the same answers as under the stand-in, plus what a test needs to see
//! from inside a container, and a real process's end.
//!
//! - `GET /fake/container`: the process's pid, hostname and the GPU
//!   environment the node gave it (`NVIDIA_VISIBLE_DEVICES`,
//!   `FAKE_GPU_DEVICES`, `FAKE_GPU_CLAIM`, `FAKE_GPU_DEVICE_<NAME>` per
//!   device, `RESIDENCY_GPU_DEVICE`, a gang's `RESIDENCY_GANG_SIZE` and
//!   `RESIDENCY_GANG_DEVICES`), so a
//!   test sees what the DRA driver's CDI spec injected and whether a
//!   container is still the same one.
//! - `GET /fake/file?path=P`: the file's sha256 and size as read inside the
//!   container, and whether it could be opened for writing (a read-only
//!   mount says no).
//! - SIGTERM: stops accepting, finishes what it is answering (streams
//!   included) within `--drain`, then exits 0, as a model server with a
//!   preStop-free graceful shutdown does.

use super::{Body, Identity, JSON, Server, SleepBehaviour, Stop, full, respond, serve};
use http::{Method, Request, Response, StatusCode};
use hyper::body::Incoming;
use serde_json::json;
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

/// The environment variables `/fake/container` reports.
const GPU_ENV: [&str; 6] = [
    "NVIDIA_VISIBLE_DEVICES",
    "FAKE_GPU_DEVICES",
    "FAKE_GPU_CLAIM",
    "RESIDENCY_GPU_DEVICE",
    crate::residency::gangs::GANG_SIZE_ENV,
    crate::residency::gangs::GANG_DEVICES_ENV,
];

/// The real node's fake DRA plugin also sets one variable per device it
/// prepared (`FAKE_GPU_DEVICE_GPU_3=<uuid>`): these add up over a pod's
/// several claims (a gang's), where the shared names keep the last
/// claim's only.
const DEVICE_ENV_PREFIX: &str = "FAKE_GPU_DEVICE_";

/// How the container's server runs.
#[derive(Clone, Debug)]
pub struct Options {
    pub listen: SocketAddr,
    pub identity: Identity,
    pub sleep: SleepBehaviour,
    pub stream_delay: Duration,
    /// The longest a SIGTERM waits for answers in progress.
    pub drain: Duration,
    /// Serve LoRA adapters up to this rank (vLLM's `--max-lora-rank`).
    pub max_lora_rank: Option<u64>,
}

/// Serves until SIGTERM or SIGINT, then drains and returns.
pub async fn run_in_container(options: Options) -> std::io::Result<()> {
    let listener = tokio::net::TcpListener::bind(options.listen).await?;
    let server = Arc::new(Server {
        id: options.identity,
        sleep: options.sleep,
        state: Default::default(),
        stream_delay: options.stream_delay,
        prefix: None,
        batch: None,
        adapters: options.max_lora_rank.map(super::Adapters::new),
    });
    eprintln!(
        "fake model server for {} (pod {}) pid {} listening on {}",
        server.id.model,
        server.id.pod,
        std::process::id(),
        listener.local_addr()?
    );
    let (tx, rx) = tokio::sync::watch::channel(false);
    let stop = Stop {
        signal: rx,
        drain: options.drain,
    };
    let serving = tokio::spawn(serve(listener, server, Some(stop)));
    let mut term = tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate())?;
    tokio::select! {
        _ = term.recv() => {}
        _ = tokio::signal::ctrl_c() => {}
    }
    eprintln!(
        "got SIGTERM: finishing what is in flight (up to {} s)",
        options.drain.as_secs()
    );
    let _ = tx.send(true);
    let _ = serving.await;
    eprintln!("drained; exiting");
    Ok(())
}

/// The container endpoints; `Err` gives the request back for the others.
pub(super) async fn endpoint(
    req: Request<Incoming>,
    server: &Arc<Server>,
) -> Result<Response<Body>, Request<Incoming>> {
    let pod = &server.id.pod;
    let ok = |body: serde_json::Value| respond(StatusCode::OK, JSON, full(body.to_string()), pod);
    match (req.method(), req.uri().path()) {
        (&Method::GET, "/fake/container") => {
            let env: serde_json::Map<_, _> = std::env::vars()
                .filter(|(k, _)| GPU_ENV.contains(&k.as_str()) || k.starts_with(DEVICE_ENV_PREFIX))
                .map(|(k, v)| (k, json!(v)))
                .collect();
            let hostname = std::fs::read_to_string("/proc/sys/kernel/hostname")
                .unwrap_or_default()
                .trim()
                .to_owned();
            Ok(ok(
                json!({"pid": std::process::id(), "hostname": hostname, "env": env}),
            ))
        }
        (&Method::GET, "/fake/file") => {
            let path = req
                .uri()
                .query()
                .unwrap_or_default()
                .split('&')
                .find_map(|kv| kv.strip_prefix("path="))
                .unwrap_or_default()
                .to_owned();
            Ok(match file_facts(&path) {
                Ok(facts) => ok(facts),
                Err(e) => respond(
                    StatusCode::NOT_FOUND,
                    JSON,
                    full(json!({"error": format!("{path}: {e}")}).to_string()),
                    pod,
                ),
            })
        }
        _ => Err(req),
    }
}

/// A file's sha256 and size, and whether it opens for writing.
fn file_facts(path: &str) -> std::io::Result<serde_json::Value> {
    let (sha256, size) = crate::local::images::file_sha256(std::path::Path::new(path))?;
    let write = std::fs::OpenOptions::new().append(true).open(path);
    Ok(json!({
        "sha256": sha256,
        "bytes": size,
        "writable": write.is_ok(),
        "write_error": write.err().map(|e| e.to_string()),
    }))
}
