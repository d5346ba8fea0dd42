//! KEDA and Prometheus beside the shared control plane, as real processes
//! on loopback ports: Prometheus (Debian's) scraping the routers under test,
//! KEDA's operator (ScaledObjects, the HPAs it makes, scaling from and to
//! zero) and KEDA's external-metrics API server, registered with the API
//! server's aggregation layer so the real HPA controller of
//! kube-controller-manager reads `external.metrics.k8s.io` through it.
//!
//! The binaries and KEDA's CRDs come from `scripts/keda.sh` (built from the
//! `github.com/kedacore/keda/v2` module, cached), named by
//! `MODEL_RESIDENCY_KEDA`; `scripts/test.sh` sets it.
//!
//! In a cluster KEDA's metrics server is a Service the aggregator reaches
//! at its ClusterIP. There is no kube-proxy here, so the APIService names
//! an `ExternalName` Service for `localhost`, which the aggregator resolves
//! to that host name and the APIService's port: the traffic stays on
//! loopback, over TLS checked against the test's own CA. The APIService is
//! cluster-wide: one `Keda` per control plane (the one test that uses it),
//! and it goes when the `Keda` is dropped.

use super::cluster::{TestEnv, eventually};
use super::http::free_port;
use model_residency::local::control_plane::spawn_owned;
use model_residency::local::tls::issue_certificate;
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};

/// The APIService KEDA serves external metrics under.
const API_SERVICE: &str = "v1beta1.external.metrics.k8s.io";

pub struct Keda {
    /// Prometheus's address (`http://` it for KEDA's prometheus trigger).
    pub prometheus: SocketAddr,
    processes: Vec<(&'static str, Child)>,
    dir: tempfile::TempDir,
    kubeconfig: PathBuf,
}

impl Drop for Keda {
    fn drop(&mut self) {
        // The APIService first: left behind, it names a server that is
        // gone, and an aggregated API that does not answer fails discovery
        // for every client of the shared control plane (the garbage
        // collector's and the namespace controller's among them).
        let _ = Command::new(model_residency::local::control_plane::kubectl())
            .env("KUBECONFIG", &self.kubeconfig)
            .args(["delete", "apiservice", API_SERVICE, "--wait=false"])
            .output();
        for (_, child) in &mut self.processes {
            let _ = child.kill();
            let _ = child.wait();
        }
    }
}

/// The directory `scripts/keda.sh` built into.
fn installed() -> PathBuf {
    let dir = std::env::var_os("MODEL_RESIDENCY_KEDA")
        .map(PathBuf::from)
        .expect(
            "MODEL_RESIDENCY_KEDA is not set: run scripts/test.sh, which builds KEDA \
         (scripts/keda.sh) and installs Prometheus",
        );
    assert!(
        dir.join("keda").is_file() && dir.join("keda-adapter").is_file(),
        "no KEDA binaries in {}",
        dir.display()
    );
    dir
}

impl Keda {
    /// Starts Prometheus scraping `targets` (`/metrics`, every second),
    /// installs KEDA's CRDs, starts KEDA's operator and metrics server and
    /// waits until the API server reports the external metrics API
    /// Available.
    pub async fn start(env: &TestEnv, targets: &[SocketAddr]) -> Keda {
        let bin = installed();
        let dir = tempfile::tempdir().unwrap();
        let d = dir.path();
        // One certificate for KEDA's two processes: its gRPC metrics
        // service is mutual TLS (the operator serves, the metrics server
        // dials), and the aggregator checks the metrics server's against
        // the APIService's caBundle, by the Service's DNS name.
        issue_certificate(d, "ca", "keda-test-ca", None, &[]).unwrap();
        issue_certificate(
            d,
            "tls",
            "keda",
            Some("ca"),
            &[
                "subjectAltName=DNS:localhost,DNS:keda-metrics-apiserver.keda.svc,IP:127.0.0.1",
                "extendedKeyUsage=serverAuth,clientAuth",
            ],
        )
        .unwrap();
        let mut keda = Keda {
            prometheus: ([127, 0, 0, 1], free_port()).into(),
            processes: Vec::new(),
            dir,
            kubeconfig: env.plane.kubeconfig().to_owned(),
        };
        keda.start_prometheus(targets);

        let crds = bin.join("crds");
        let out = env.kubectl(&[
            "apply",
            "--server-side",
            "--force-conflicts",
            "-f",
            crds.to_str().unwrap(),
        ]);
        assert!(out.status.success(), "KEDA CRDs: {out:?}");
        env.until_established(&["scaledobjects.keda.sh"]);

        let grpc = free_port();
        let secure = free_port();
        let kubeconfig = keda.kubeconfig.clone();
        let d = keda.dir.path().to_owned();
        let cert_dir = format!("--cert-dir={}", d.display());
        keda.spawn(
            "keda-operator",
            &bin.join("keda"),
            &kubeconfig,
            &[
                "--metrics-bind-address=0".into(),
                "--health-probe-bind-address=0".into(),
                format!("--metrics-service-bind-address=127.0.0.1:{grpc}"),
                cert_dir.clone(),
                format!("--ca-dir={}", d.display()),
                "--zap-log-level=info".into(),
            ],
        );
        let kc = kubeconfig.display();
        keda.spawn(
            "keda-adapter",
            &bin.join("keda-adapter"),
            &kubeconfig,
            &[
                format!("--secure-port={secure}"),
                "--bind-address=127.0.0.1".into(),
                cert_dir,
                format!("--tls-cert-file={}", d.join("tls.crt").display()),
                format!("--tls-private-key-file={}", d.join("tls.key").display()),
                format!("--lister-kubeconfig={kc}"),
                format!("--authentication-kubeconfig={kc}"),
                format!("--authorization-kubeconfig={kc}"),
                format!("--metrics-service-address=localhost:{grpc}"),
                // Its own /metrics (on every interface: KEDA binds ":PORT");
                // nothing reads it.
                format!("--port={}", free_port()),
                "--zap-log-level=info".into(),
            ],
        );
        // Registered once it listens: an APIService whose server does not
        // answer fails discovery for every client of the shared plane.
        eventually(60, "KEDA's metrics server to listen", || async {
            tokio::net::TcpStream::connect(("127.0.0.1", secure))
                .await
                .ok()
                .map(drop)
        })
        .await;
        keda.register(env, secure);
        keda.until_available(env).await;
        keda
    }

    fn start_prometheus(&mut self, targets: &[SocketAddr]) {
        let d = self.dir.path();
        let targets: Vec<String> = targets.iter().map(|t| format!("\"{t}\"")).collect();
        let config = format!(
            "global: {{scrape_interval: 1s, evaluation_interval: 1s}}\n\
             scrape_configs:\n- job_name: routers\n  static_configs:\n  - targets: [{}]\n",
            targets.join(", ")
        );
        std::fs::write(d.join("prometheus.yml"), config).unwrap();
        let mut cmd = Command::new("/usr/bin/prometheus");
        cmd.arg(format!(
            "--config.file={}",
            d.join("prometheus.yml").display()
        ))
        .arg(format!("--storage.tsdb.path={}", d.join("tsdb").display()))
        .arg(format!("--web.listen-address={}", self.prometheus))
        .arg("--log.level=warn");
        self.spawn_command("prometheus", cmd);
    }

    /// The Service and APIService the aggregator proxies
    /// `external.metrics.k8s.io` through, to the metrics server's `port`.
    fn register(&self, env: &TestEnv, port: u16) {
        use base64::Engine;
        let ca = std::fs::read(self.dir.path().join("ca.crt")).unwrap();
        let ca = base64::engine::general_purpose::STANDARD.encode(ca);
        let manifest = format!(
            r#"apiVersion: v1
kind: Namespace
metadata: {{name: keda}}
---
apiVersion: v1
kind: Service
metadata: {{name: keda-metrics-apiserver, namespace: keda}}
spec:
  type: ExternalName
  externalName: localhost
  ports: [{{name: https, port: {port}}}]
---
apiVersion: apiregistration.k8s.io/v1
kind: APIService
metadata: {{name: {API_SERVICE}}}
spec:
  service: {{name: keda-metrics-apiserver, namespace: keda, port: {port}}}
  group: external.metrics.k8s.io
  version: v1beta1
  caBundle: {ca}
  groupPriorityMinimum: 100
  versionPriority: 100
"#
        );
        let file = self.dir.path().join("apiservice.yaml");
        std::fs::write(&file, manifest).unwrap();
        let out = env.kubectl(&["apply", "-n", "keda", "-f", file.to_str().unwrap()]);
        assert!(out.status.success(), "KEDA's APIService: {out:?}");
    }

    fn spawn(&mut self, name: &'static str, binary: &Path, kubeconfig: &Path, args: &[String]) {
        let mut cmd = Command::new(binary);
        cmd.args(args)
            .env("KUBECONFIG", kubeconfig)
            .env("WATCH_NAMESPACE", "")
            .env("POD_NAMESPACE", "keda")
            .env("KEDA_CLUSTER_OBJECT_NAMESPACE", "keda");
        self.spawn_command(name, cmd);
    }

    fn spawn_command(&mut self, name: &'static str, mut cmd: Command) {
        let log = std::fs::File::create(self.dir.path().join(format!("{name}.log"))).unwrap();
        cmd.stdin(Stdio::null())
            .stdout(log.try_clone().unwrap())
            .stderr(log);
        let child = spawn_owned(cmd).unwrap_or_else(|e| panic!("cannot start {name}: {e}"));
        self.processes.push((name, child));
    }

    /// The last lines of each process's log, for a failure's message.
    pub fn logs(&self) -> String {
        self.processes
            .iter()
            .map(|(name, _)| {
                let text = std::fs::read_to_string(self.dir.path().join(format!("{name}.log")))
                    .unwrap_or_default();
                let lines: Vec<&str> = text.lines().collect();
                format!(
                    "--- {name}:\n{}",
                    lines[lines.len().saturating_sub(15)..].join("\n")
                )
            })
            .collect::<Vec<_>>()
            .join("\n")
    }

    async fn until_available(&mut self, env: &TestEnv) {
        let t0 = std::time::Instant::now();
        while t0.elapsed() < std::time::Duration::from_secs(90) {
            let exited = self
                .processes
                .iter_mut()
                .find_map(|(name, child)| Some((*name, child.try_wait().ok()??)));
            if let Some((name, status)) = exited {
                panic!("{name} exited ({status}):\n{}", self.logs());
            }
            if env
                .condition_is_true("apiservice", API_SERVICE, "Available")
                .0
            {
                return;
            }
            tokio::time::sleep(std::time::Duration::from_millis(500)).await;
        }
        panic!(
            "KEDA's external metrics API was not Available within 90 s:\n{}",
            self.logs()
        );
    }

    /// Prometheus's answer to an instant query, the first sample's value.
    pub async fn query(&self, promql: &str) -> Option<f64> {
        let path = format!(
            "/api/v1/query?query={}",
            model_residency::http::percent_encode(promql)
        );
        let a = super::http::send(self.prometheus, "GET", &path, "").await;
        let v: serde_json::Value = serde_json::from_str(&a.body).ok()?;
        v["data"]["result"][0]["value"][1].as_str()?.parse().ok()
    }

    /// Waits until Prometheus has scraped every target once.
    pub async fn until_scraped(&self) {
        eventually(30, "Prometheus to scrape the routers", || async {
            (self.query("min(up{job=\"routers\"})").await == Some(1.0)).then_some(())
        })
        .await;
    }
}
