//! A router under test: the real `model_residency::router`, in-process,
//! on a loopback port, watching the test's namespace.

use super::cluster::eventually;
use super::operator::Harness;
pub use model_residency::http::Answer;
use model_residency::router::{Config, Router};
use serde_json::json;
use std::net::SocketAddr;
use std::sync::Arc;

pub struct RouterUnderTest {
    pub addr: SocketAddr,
    pub router: Arc<Router>,
    task: tokio::task::JoinHandle<()>,
}

impl Drop for RouterUnderTest {
    fn drop(&mut self) {
        self.task.abort();
    }
}

impl RouterUnderTest {
    /// Starts a router over `h`'s namespace with `config` (its namespace
    /// set to the test's) and waits until it is ready.
    pub async fn start(h: &Harness, mut config: Config) -> Self {
        config.namespace = Some(h.env.namespace.clone());
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let router = Router::start(h.env.client.clone(), config);
        let task = tokio::spawn(router.clone().serve(listener));
        eventually(30, "the router to be ready", || async {
            router.ready().then_some(())
        })
        .await;
        RouterUnderTest { addr, router, task }
    }

    /// A router that writes every hit's recency at once (resolution 0), so
    /// a test sees each request's effect without waiting for a tick.
    pub async fn exact(h: &Harness) -> Self {
        let config = Config {
            recency_resolution: std::time::Duration::ZERO,
            ..Config::default()
        };
        Self::start(h, config).await
    }

    /// `POST /v1/chat/completions` for `model`.
    pub async fn chat(&self, model: &str) -> Answer {
        let body = json!({"model": model, "messages": [{"role": "user", "content": "hi"}]});
        self.post("/v1/chat/completions", &body.to_string()).await
    }

    pub async fn post(&self, path: &str, body: &str) -> Answer {
        super::http::send(self.addr, "POST", path, body).await
    }

    pub async fn get(&self, path: &str) -> Answer {
        super::http::send(self.addr, "GET", path, "").await
    }

    /// A router metric's sum over the label sets containing `labels`.
    pub fn metric(&self, name: &str, labels: &str) -> u64 {
        self.router.metrics.sum_where(name, labels)
    }
}

/// The answer's JSON body.
pub fn json_of(a: &Answer) -> serde_json::Value {
    serde_json::from_str(&a.body).unwrap_or_else(|e| panic!("not JSON ({e}): {}", a.body))
}

/// Asserts the answer is a 200 from `model`'s own pod: the fake model
/// server says which model it serves, independently of the router.
pub fn assert_served_by(a: &Answer, model: &str) {
    assert_eq!(a.status, 200, "{model}: {}", a.body);
    let body = json_of(a);
    assert_eq!(body["model"], model, "{}", a.body);
    let pod = a.headers["x-model-pod"].to_str().unwrap();
    assert_eq!(body["pod"], pod, "x-model-pod names the pod that answered");
    assert!(a.headers.contains_key("x-residency"));
}
