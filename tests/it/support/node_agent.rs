//! The node agent as a real process (`model-residency node-agent`) for
//! the tests that need a node's disk: the disk tier's and the adapters'.

use super::http::{free_port, send};
use super::operator::Harness;
use model_residency::local::control_plane::spawn_owned;
use std::net::SocketAddr;
use std::path::Path;
use std::process::{Child, Command};

/// The agent process; killed (SIGKILL, no cleanup) when dropped.
pub struct Agent {
    process: Child,
    /// Where it serves /healthz, /readyz and /metrics.
    pub http: SocketAddr,
}

impl Drop for Agent {
    fn drop(&mut self) {
        let _ = self.process.kill();
        let _ = self.process.wait();
    }
}

impl Agent {
    /// The sum of a metric's samples whose labels contain `labels`, as
    /// the agent's /metrics says now.
    pub async fn metric(&self, metric: &str, labels: &str) -> u64 {
        let answer = send(self.http, "GET", "/metrics", "").await;
        assert_eq!(answer.status, 200, "{}", answer.body);
        model_residency::exposition::sum_where(&answer.body, metric, labels)
    }
}

pub fn start_agent(h: &Harness, cache: &Path, budget: &str, allowed: &str) -> Agent {
    start_agent_with(h, cache, budget, allowed, &[])
}

/// [`start_agent`] with more flags.
pub fn start_agent_with(
    h: &Harness,
    cache: &Path,
    budget: &str,
    allowed: &str,
    extra: &[String],
) -> Agent {
    // The agent's log, beside the cache (kept while the test runs).
    let log = std::fs::File::create(cache.with_extension("log")).unwrap();
    let http: SocketAddr = format!("127.0.0.1:{}", free_port()).parse().unwrap();
    let mut cmd = Command::new(env!("CARGO_BIN_EXE_model-residency"));
    cmd.env("KUBECONFIG", h.env.plane.kubeconfig())
        .env("RUST_LOG", "info")
        .args(["node-agent", "--node", &h.node, "--disk-budget", budget])
        .arg("--cache-dir")
        .arg(cache)
        .args([
            "--allowed-sources",
            allowed,
            "--http-addr",
            &http.to_string(),
        ])
        .args(extra)
        .stdout(std::process::Stdio::null())
        .stderr(log);
    Agent {
        process: spawn_owned(cmd).expect("start the node agent"),
        http,
    }
}
