//! One real control plane per test binary, a namespace per test.
//!
//! The control plane starts on first use and is shared by the binary's
//! tests (which run in parallel, each in its own namespace and with its own
//! client, since a client belongs to the runtime that made it). It is torn
//! down by the janitor process when the test binary exits, however it exits.
//!
//! The tests that use it are `#[ignore]`d, so a plain `cargo test` counts
//! them as skipped (not passed); `scripts/test.sh` runs them with
//! `--include-ignored` once it has provisioned the control plane. A test
//! that runs and cannot start the control plane fails with the reason.

use model_residency::local::control_plane::ControlPlane;
use std::process::{Command, Output};
use std::sync::OnceLock;
use std::sync::atomic::{AtomicU32, Ordering};

static PLANE: OnceLock<Result<ControlPlane, String>> = OnceLock::new();

/// The shared control plane, started on first use.
pub fn plane() -> Result<&'static ControlPlane, &'static str> {
    PLANE
        .get_or_init(|| ControlPlane::start().map_err(|e| e.to_string()))
        .as_ref()
        .map_err(String::as_str)
}

/// What a control-plane test gets: an admin client and its own namespace.
pub struct TestEnv {
    pub client: kube::Client,
    pub namespace: String,
    pub plane: &'static ControlPlane,
}

/// Starts (or reuses) the control plane and creates a fresh namespace named
/// after the test.
pub async fn test_env(test: &str) -> TestEnv {
    let plane = plane().unwrap_or_else(|e| {
        panic!(
            "{test}: the local control plane could not start: {e}\n\
             Run `bash scripts/control-plane.sh` once to build it."
        )
    });
    let client = plane.client().await.expect("admin client");
    static SEQ: AtomicU32 = AtomicU32::new(0);
    let namespace = format!(
        "{}-{}",
        test.replace('_', "-").chars().take(50).collect::<String>(),
        SEQ.fetch_add(1, Ordering::Relaxed)
    );
    create_namespace(&client, &namespace).await;
    TestEnv {
        client,
        namespace,
        plane,
    }
}

/// Creates namespace `name` (a test's own).
pub async fn create_namespace(client: &kube::Client, name: &str) {
    let ns: kube::Api<k8s_openapi::api::core::v1::Namespace> = kube::Api::all(client.clone());
    let body: k8s_openapi::api::core::v1::Namespace =
        serde_json::from_value(serde_json::json!({"metadata": {"name": name}})).unwrap();
    ns.create(&Default::default(), &body)
        .await
        .expect("create test namespace");
}

impl TestEnv {
    /// Runs kubectl against this control plane (in the test's namespace
    /// unless the arguments say otherwise).
    /// Each call gets a fresh discovery cache, so a CRD installed a moment
    /// ago is always found.
    pub fn kubectl(&self, args: &[&str]) -> Output {
        let cache = tempfile::tempdir().expect("kubectl cache dir");
        Command::new(model_residency::local::control_plane::kubectl())
            .env("KUBECONFIG", self.plane.kubeconfig())
            .arg(format!("--cache-dir={}", cache.path().display()))
            .args(["-n", &self.namespace])
            .args(args)
            .output()
            .expect("run kubectl")
    }

    /// Whether `kind/name` has its condition `type_` True now, with what
    /// kubectl said on stderr.
    pub fn condition_is_true(&self, kind: &str, name: &str, type_: &str) -> (bool, String) {
        let path = format!("jsonpath={{.status.conditions[?(@.type==\"{type_}\")].status}}");
        let out = self.kubectl(&["get", kind, name, "-o", &path]);
        (
            String::from_utf8_lossy(&out.stdout).trim() == "True",
            stderr(&out),
        )
    }

    /// Waits (up to 60 s each) until the CRDs are Established. Polled:
    /// `kubectl wait` fails at once on a CRD whose status has no
    /// conditions yet, which a CRD just created may not have.
    pub fn until_established(&self, crds: &[&str]) {
        for crd in crds {
            let deadline = std::time::Instant::now() + std::time::Duration::from_secs(60);
            loop {
                let (established, err) = self.condition_is_true("crd", crd, "Established");
                if established {
                    break;
                }
                assert!(
                    std::time::Instant::now() < deadline,
                    "CRD {crd} not Established within 60 s: {err}"
                );
                std::thread::sleep(std::time::Duration::from_millis(200));
            }
        }
    }

    /// Installs `crds/` once per test binary (tests race otherwise) and
    /// waits until discovery serves the new types.
    pub fn install_crds(&self) {
        static INSTALLED: OnceLock<()> = OnceLock::new();
        INSTALLED.get_or_init(|| {
            let out = self.kubectl(&["apply", "-f", "crds/"]);
            assert!(
                out.status.success(),
                "kubectl apply -f crds/: {}",
                stderr(&out)
            );
            self.until_established(&[
                "modelresidencies.residency.dev",
                "modeldemands.residency.dev",
                "modelcopies.residency.dev",
                "nodemodelcaches.residency.dev",
            ]);
            // Established comes a moment before discovery and the published
            // OpenAPI (which kubectl apply validates against) serve the type.
            for _ in 0..300 {
                if self.kubectl(&["get", "mres"]).status.success()
                    && self.kubectl(&["get", "mdem"]).status.success()
                    && self
                        .kubectl(&["explain", "mres.spec.budget"])
                        .status
                        .success()
                {
                    return;
                }
                std::thread::sleep(std::time::Duration::from_millis(100));
            }
            panic!("discovery or OpenAPI never served modelresidencies");
        });
    }

    /// A name for a fake node private to this test.
    pub fn node(&self, suffix: &str) -> String {
        format!("{}-{suffix}", self.namespace)
    }
}

fn stderr(out: &Output) -> String {
    String::from_utf8_lossy(&out.stderr).into_owned()
}

/// Polls `check` every 50 ms until it returns `Some`, or panics after
/// `secs` seconds with `what`.
pub async fn eventually<T, F, Fut>(secs: u64, what: &str, mut check: F) -> T
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = Option<T>>,
{
    let deadline = tokio::time::Instant::now() + std::time::Duration::from_secs(secs);
    loop {
        if let Some(v) = check().await {
            return v;
        }
        if tokio::time::Instant::now() > deadline {
            panic!("timed out after {secs} s waiting for {what}");
        }
        tokio::time::sleep(std::time::Duration::from_millis(50)).await;
    }
}
