//! A real, local Kubernetes control plane: etcd, kube-apiserver,
//! kube-scheduler and kube-controller-manager (its garbage collector,
//! namespace, resource-claim and HPA controllers) on free loopback ports, in
//! a temporary directory. The API server's aggregation layer is configured
//! (a front proxy's CA and client certificate), so an extension API server
//! such as KEDA's external metrics can be registered with an APIService.
//!
//! The binaries come from `scripts/control-plane.sh` (built once from the
//! Kubernetes and etcd Go modules and cached) or from a directory named by
//! `MODEL_RESIDENCY_ASSETS` or `KUBEBUILDER_ASSETS`. There is no kubelet: see
//! [`super::kubelet`] for the stand-in, which registers the nodes the
//! scheduler places pods on.
//!
//! Nothing outlives its owner: every process is started with
//! `PR_SET_PDEATHSIG` from a thread that lives as long as the process, and a
//! small janitor process (immune to Ctrl-C) kills them by pid and removes the
//! temporary directory as soon as the owning process is gone, whether it
//! exited, panicked or was killed.

mod files;
mod process;

use files::*;
use process::*;
pub use process::{cpu_seconds_of, spawn_owned};

use kube::config::{KubeConfigOptions, Kubeconfig};
use std::fs;
use std::io::Write;
use std::net::TcpListener;
use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::mpsc;
use std::time::{Duration, Instant};

/// The Kubernetes version `scripts/control-plane.sh` builds by default.
pub const KUBERNETES_VERSION: &str = "v1.37.2";
/// Its cache entry (version + recipe rev).
const CACHE_KEY: &str = "v1.37.2-go1";
/// What an assets directory holds.
const BINARIES: [&str; 4] = [
    "etcd",
    "kube-apiserver",
    "kube-controller-manager",
    "kube-scheduler",
];
const ADMIN_TOKEN: &str = "model-residency-admin-token";
/// The real node's kubelet's token (user `system:node:<name>`, group
/// `system:nodes`, as the Node authorizer wants).
const KUBELET_TOKEN: &str = "model-residency-kubelet-token";

/// What a control plane is started for.
#[derive(Clone, Debug, Default)]
pub struct PlaneOptions {
    /// A real kubelet will register this node ([`super::real_node`]): the
    /// API server authorizes it as a node (Node,RBAC), reaches it at its
    /// InternalIP, and the node lifecycle controller runs (the stand-in's
    /// nodes send no heartbeats, so it is off for them).
    pub real_node: Option<String>,
}

#[derive(Debug, thiserror::Error)]
pub enum ControlPlaneError {
    #[error(
        "no control-plane binaries found ({0}). Install them with `bash scripts/control-plane.sh` \
         (builds Kubernetes {KUBERNETES_VERSION} from its Go modules once, about 12 minutes, \
         cached in ~/.cache/model-residency), or point MODEL_RESIDENCY_ASSETS at a directory \
         holding etcd, kube-apiserver, kube-controller-manager and kube-scheduler"
    )]
    NoAssets(String),
    #[error("control plane: {0}")]
    Io(#[from] std::io::Error),
    #[error("{process} did not become ready within {seconds} s; last log lines:\n{log}")]
    NotReady {
        process: &'static str,
        seconds: u64,
        log: String,
    },
    #[error("control plane: {0}")]
    Kube(#[from] kube::Error),
    #[error("control plane kubeconfig: {0}")]
    Config(String),
}

/// Finds the directory holding the [`BINARIES`].
pub fn find_assets() -> Result<PathBuf, ControlPlaneError> {
    let mut tried = Vec::new();
    let mut candidates: Vec<PathBuf> = ["MODEL_RESIDENCY_ASSETS", "KUBEBUILDER_ASSETS"]
        .iter()
        .filter_map(|v| std::env::var_os(v).map(PathBuf::from))
        .collect();
    let cache = std::env::var_os("MODEL_RESIDENCY_CACHE")
        .map(PathBuf::from)
        .or_else(|| std::env::var_os("HOME").map(|h| Path::new(&h).join(".cache/model-residency")));
    if let Some(cache) = cache {
        candidates.push(cache.join("control-plane").join(CACHE_KEY));
    }
    for dir in candidates {
        let complete = BINARIES.iter().all(|b| dir.join(b).is_file());
        if complete {
            return Ok(dir);
        }
        tried.push(dir.display().to_string());
    }
    Err(ControlPlaneError::NoAssets(format!(
        "looked in: {}",
        if tried.is_empty() {
            "nothing".to_owned()
        } else {
            tried.join(", ")
        }
    )))
}

/// The kubectl to use with these control planes: the one built with them
/// (`kubectl` in the assets directory, at their version, so within
/// kubectl's version skew), else whatever `kubectl` is on the PATH.
pub fn kubectl() -> PathBuf {
    find_assets()
        .map(|dir| dir.join("kubectl"))
        .ok()
        .filter(|k| k.is_file())
        .unwrap_or_else(|| PathBuf::from("kubectl"))
}

/// A running control plane. Dropping it stops every process and removes
/// its directory.
pub struct ControlPlane {
    dir: tempfile::TempDir,
    assets: PathBuf,
    etcd: Process,
    apiserver: Process,
    controller_manager: Process,
    scheduler: Process,
    apiserver_port: u16,
    etcd_port: u16,
    kubeconfig: PathBuf,
    janitor: Option<Child>,
    /// Time from start to `/readyz` answering `ok`.
    pub startup: Duration,
    /// Started for a real kubelet ([`PlaneOptions::real_node`]).
    real_node: bool,
}

impl ControlPlane {
    /// Starts etcd, kube-apiserver and kube-controller-manager and waits for
    /// `/readyz` (blocking, for up to a minute).
    pub fn start() -> Result<Self, ControlPlaneError> {
        Self::start_with(PlaneOptions::default())
    }

    /// [`Self::start`] for what `options` says.
    pub fn start_with(options: PlaneOptions) -> Result<Self, ControlPlaneError> {
        let assets = find_assets()?;
        let t0 = Instant::now();
        let dir = plane_dir()?;
        let d = dir.path();
        let etcd_port = free_port()?;
        let peer_port = free_port()?;
        let apiserver_port = free_port()?;

        write_credentials(d, &options)?;
        let kubeconfig = d.join("kubeconfig");
        write_kubeconfig(&kubeconfig, apiserver_port)?;

        let mut plane = ControlPlane {
            etcd: start_process(
                "etcd",
                &assets.join("etcd"),
                &etcd_args(d, etcd_port, peer_port),
                d,
            )?,
            apiserver: Process::not_started("kube-apiserver", d),
            controller_manager: Process::not_started("kube-controller-manager", d),
            scheduler: Process::not_started("kube-scheduler", d),
            janitor: None,
            assets,
            apiserver_port,
            etcd_port,
            kubeconfig,
            dir,
            startup: Duration::ZERO,
            real_node: options.real_node.is_some(),
        };
        plane.start_janitor()?;
        plane.start_apiserver()?;
        plane.wait_ready(Duration::from_secs(60))?;
        plane.start_managers()?;
        plane.start_janitor()?;
        plane.startup = t0.elapsed();
        Ok(plane)
    }

    /// Starts kube-controller-manager and kube-scheduler.
    fn start_managers(&mut self) -> Result<(), ControlPlaneError> {
        let kubeconfig = format!("--kubeconfig={}", self.kubeconfig.display());
        // No serving (--secure-port=0): parallel control planes must not
        // share ports.
        // The HPA controller scales what KEDA (or a user's HPA) asks for;
        // with no HorizontalPodAutoscaler it does nothing.
        let mut controllers = "garbage-collector-controller,namespace-controller,\
                               resourceclaim-controller,horizontal-pod-autoscaler-controller"
            .to_owned();
        let mut manager = vec![kubeconfig];
        if self.real_node {
            // What pods need of a cluster to call its API (a ServiceAccount
            // in each namespace, its CA in each namespace's
            // kube-root-ca.crt), Services need to have endpoints, and a
            // chart's workloads need to have pods.
            controllers += ",node-lifecycle-controller,serviceaccount-controller,\
                            root-ca-cert-publisher,endpointslice-controller,\
                            deployment-controller,replicaset-controller,daemonset-controller";
            manager.push(format!(
                "--root-ca-file={}",
                self.dir.path().join("certs/apiserver.crt").display()
            ));
        }
        manager.extend([
            format!("--controllers={controllers}"),
            "--leader-elect=false".into(),
            "--use-service-account-credentials=false".into(),
            "--secure-port=0".into(),
            "--concurrent-gc-syncs=5".into(),
            // Every second, not every 15: tests watch a scale follow load.
            "--horizontal-pod-autoscaler-sync-period=1s".into(),
        ]);
        // Each binary is named as its process is.
        let name = "kube-controller-manager";
        let exe = self.assets.join(name);
        self.controller_manager = start_process(name, &exe, &manager, self.dir.path())?;
        self.start_scheduler()
    }

    /// Starts kube-scheduler (no serving either).
    fn start_scheduler(&mut self) -> Result<(), ControlPlaneError> {
        let args = [
            format!("--kubeconfig={}", self.kubeconfig.display()),
            "--leader-elect=false".into(),
            "--secure-port=0".into(),
            "--v=2".into(),
        ];
        let exe = self.assets.join("kube-scheduler");
        self.scheduler = start_process("kube-scheduler", &exe, &args, self.dir.path())?;
        Ok(())
    }

    /// Kills kube-scheduler and starts it again: what a cluster's admin
    /// does for a scheduler that stalled (its log starts over).
    pub fn restart_scheduler(&mut self) -> Result<(), ControlPlaneError> {
        self.scheduler.kill();
        self.start_scheduler()
    }

    /// Kills kube-scheduler (no pod is placed until
    /// [`ControlPlane::restart_scheduler`]).
    pub fn stop_scheduler(&mut self) {
        self.scheduler.kill();
    }

    fn start_apiserver(&mut self) -> Result<(), ControlPlaneError> {
        let d = self.dir.path();
        let mut args = vec![
            format!("--etcd-servers=http://127.0.0.1:{}", self.etcd_port),
            format!("--cert-dir={}", d.join("certs").display()),
            format!("--secure-port={}", self.apiserver_port),
        ];
        if self.real_node {
            // Pods reach the API server as in any cluster: through the
            // `kubernetes` Service (kube-proxy on the real node) to the
            // address it advertises, the node's on the lane's bridge (the
            // lane is a network namespace of its own, so listening on all
            // of its addresses exposes nothing). Its self-signed certificate
            // names that address and the Service's; pods get it, and a
            // ServiceAccount token, as in any cluster (admission below, the
            // controller-manager's root CA publisher).
            args.extend([
                "--bind-address=0.0.0.0".into(),
                format!("--advertise-address={}", super::lane::NODE_IP),
            ]);
        } else {
            args.extend([
                "--bind-address=127.0.0.1".into(),
                "--advertise-address=127.0.0.1".into(),
                // A loopback advertise address is refused by the endpoint
                // reconciler since 1.3x; without a node nothing needs the
                // kubernetes Service's endpoints.
                "--endpoint-reconciler-type=none".into(),
                // Pods here never run: no token to mount.
                "--disable-admission-plugins=ServiceAccount".into(),
            ]);
        }
        args.extend([
            format!("--token-auth-file={}", d.join("tokens.csv").display()),
            if self.real_node {
                "--authorization-mode=Node,RBAC".into()
            } else {
                "--authorization-mode=RBAC".into()
            },
            // The real node's kubelet is reached at its lane address.
            "--kubelet-preferred-address-types=InternalIP".into(),
            format!("--service-account-key-file={}", d.join("sa.key").display()),
            format!(
                "--service-account-signing-key-file={}",
                d.join("sa.key").display()
            ),
            "--service-account-issuer=https://kubernetes.default.svc".into(),
            format!("--service-cluster-ip-range={}", super::lane::SERVICE_SUBNET),
            "--allow-privileged=true".into(),
            "--profiling=false".into(),
            "--enable-priority-and-fairness=false".into(),
            // The aggregation layer (for KEDA's external metrics API): the
            // API server proxies as front-proxy-client, and extension API
            // servers trust the request headers it sets.
            format!(
                "--requestheader-client-ca-file={}",
                d.join("front-proxy-ca.crt").display()
            ),
            "--requestheader-allowed-names=front-proxy-client".into(),
            "--requestheader-username-headers=X-Remote-User".into(),
            "--requestheader-group-headers=X-Remote-Group".into(),
            "--requestheader-extra-headers-prefix=X-Remote-Extra-".into(),
            format!(
                "--proxy-client-cert-file={}",
                d.join("front-proxy-client.crt").display()
            ),
            format!(
                "--proxy-client-key-file={}",
                d.join("front-proxy-client.key").display()
            ),
        ]);
        self.apiserver = start_process(
            "kube-apiserver",
            &self.assets.join("kube-apiserver"),
            &args,
            d,
        )?;
        self.start_janitor()?;
        Ok(())
    }

    /// Restarts the janitor so it knows the current pids.
    fn start_janitor(&mut self) -> std::io::Result<()> {
        if let Some(mut old) = self.janitor.take() {
            let _ = old.kill();
            let _ = old.wait();
        }
        let pids: Vec<String> = self
            .processes()
            .iter()
            .filter_map(|p| p.pid())
            .map(|p| p.to_string())
            .collect();
        let script = format!(
            "trap '' INT TERM HUP; while kill -0 {owner} 2>/dev/null; do sleep 0.5; done; \
             kill -9 {pids} 2>/dev/null; sleep 0.2; rm -rf '{dir}'",
            owner = std::process::id(),
            pids = pids.join(" "),
            dir = self.dir.path().display(),
        );
        let mut cmd = Command::new("sh");
        cmd.args(["-c", &script])
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .process_group(0);
        self.janitor = Some(cmd.spawn()?);
        Ok(())
    }

    /// Polls `/readyz`. Runs its own runtime on a scoped thread, so it can be
    /// called from synchronous code and from inside an async test alike.
    fn wait_ready(&mut self, timeout: Duration) -> Result<(), ControlPlaneError> {
        std::thread::scope(|s| {
            s.spawn(|| self.poll_ready(timeout))
                .join()
                .unwrap_or_else(|_| Err(std::io::Error::other("readiness probe panicked").into()))
        })
    }

    fn poll_ready(&mut self, timeout: Duration) -> Result<(), ControlPlaneError> {
        let deadline = Instant::now() + timeout;
        let runtime = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()?;
        let client = runtime.block_on(client_from(&self.kubeconfig))?;
        loop {
            if self.etcd.exited() {
                return Err(self.not_ready(0));
            }
            if self.apiserver.exited() {
                return Err(self.not_ready(1));
            }
            let req = http::Request::get("/readyz")
                .body(Vec::new())
                .expect("static request");
            if let Ok(Ok(body)) = runtime.block_on(async {
                tokio::time::timeout(Duration::from_secs(2), client.request_text(req)).await
            }) && body.trim() == "ok"
            {
                return Ok(());
            }
            if Instant::now() > deadline {
                return Err(self.not_ready(1));
            }
            std::thread::sleep(Duration::from_millis(100));
        }
    }

    fn not_ready(&self, which: usize) -> ControlPlaneError {
        let p = if which == 0 {
            &self.etcd
        } else {
            &self.apiserver
        };
        ControlPlaneError::NotReady {
            process: p.name,
            seconds: 60,
            log: p.log_tail(),
        }
    }

    /// An admin (`system:masters`) client. Each tokio runtime needs its own.
    pub async fn client(&self) -> Result<kube::Client, ControlPlaneError> {
        client_from(&self.kubeconfig).await
    }

    /// A client that impersonates `user` in `groups` (the admin may), to
    /// run code with exactly a ServiceAccount's permissions.
    pub async fn client_as(
        &self,
        user: &str,
        groups: &[&str],
    ) -> Result<kube::Client, ControlPlaneError> {
        let kc = Kubeconfig::read_from(&self.kubeconfig)
            .map_err(|e| ControlPlaneError::Config(e.to_string()))?;
        let mut config = kube::Config::from_custom_kubeconfig(kc, &KubeConfigOptions::default())
            .await
            .map_err(|e| ControlPlaneError::Config(e.to_string()))?;
        config.auth_info.impersonate = Some(user.to_owned());
        config.auth_info.impersonate_groups =
            Some(groups.iter().map(|g| (*g).to_owned()).collect());
        Ok(kube::Client::try_from(config)?)
    }

    /// Writes a kubeconfig that acts as `user` in `groups` (impersonation by
    /// the admin), e.g. to run `model-residency run` with exactly a
    /// ServiceAccount's permissions.
    pub fn write_kubeconfig_as(
        &self,
        path: &Path,
        user: &str,
        groups: &[&str],
    ) -> std::io::Result<()> {
        write_kubeconfig(path, self.apiserver_port)?;
        let mut text = fs::read_to_string(path)?;
        let groups: Vec<String> = groups.iter().map(|g| format!("\"{g}\"")).collect();
        text = text.replace(
            &format!("    token: {ADMIN_TOKEN}\n"),
            &format!(
                "    token: {ADMIN_TOKEN}\n    as: \"{user}\"\n    as-groups: [{}]\n",
                groups.join(", ")
            ),
        );
        fs::write(path, text)
    }

    /// The kubeconfig file, for kubectl (`KUBECONFIG=...`).
    /// Writes a kubeconfig for the real node's kubelet (its node token).
    pub fn write_kubelet_kubeconfig(&self, path: &Path) -> std::io::Result<()> {
        let admin = fs::read_to_string(&self.kubeconfig)?;
        fs::write(path, admin.replace(ADMIN_TOKEN, KUBELET_TOKEN))
    }

    pub fn kubeconfig(&self) -> &Path {
        &self.kubeconfig
    }

    /// `https://127.0.0.1:PORT`.
    pub fn server_url(&self) -> String {
        format!("https://127.0.0.1:{}", self.apiserver_port)
    }

    /// Kills kube-apiserver (SIGKILL) and starts it again on the same etcd
    /// and port, waiting for `/readyz`: for fault tests.
    pub fn restart_apiserver(&mut self) -> Result<Duration, ControlPlaneError> {
        let t0 = Instant::now();
        self.apiserver.kill();
        self.start_apiserver()?;
        self.wait_ready(Duration::from_secs(60))?;
        Ok(t0.elapsed())
    }

    /// Each process, whether it still runs, and its log's last lines: for a
    /// failed test's message, before the directory with the logs goes.
    pub fn report(&mut self) -> String {
        let mut out = String::new();
        for p in [
            &mut self.etcd,
            &mut self.apiserver,
            &mut self.controller_manager,
            &mut self.scheduler,
        ] {
            let state = if p.exited() { "exited" } else { "running" };
            out.push_str(&format!("--- {} ({state}):\n{}\n", p.name, p.log_tail()));
        }
        out
    }

    /// The processes, in the order they start.
    fn processes(&self) -> [&Process; 4] {
        [
            &self.etcd,
            &self.apiserver,
            &self.controller_manager,
            &self.scheduler,
        ]
    }

    /// The Kubernetes version the API server binary reports (`v1.37.2`).
    pub fn version(&self) -> String {
        binary_version(&self.assets.join("kube-apiserver")).unwrap_or_else(|| "unknown".into())
    }

    /// CPU seconds (user and system) the API server and etcd have used so
    /// far: what the operator's own CPU is weighed against in the scale
    /// bench. 0 for one that is not running.
    pub fn cpu_seconds(&self) -> (f64, f64) {
        let of = |p: &Process| {
            p.pid()
                .and_then(|pid| cpu_seconds_of(Path::new(&format!("/proc/{pid}/stat"))))
                .unwrap_or(0.0)
        };
        (of(&self.apiserver), of(&self.etcd))
    }

    /// Resident memory of the control plane's processes together, in bytes.
    pub fn rss_bytes(&self) -> u64 {
        self.processes()
            .iter()
            .filter_map(|p| p.pid())
            .filter_map(|pid| fs::read_to_string(format!("/proc/{pid}/status")).ok())
            .filter_map(|s| {
                s.lines()
                    .find(|l| l.starts_with("VmRSS:"))
                    .and_then(|l| l.split_whitespace().nth(1))
                    .and_then(|kb| kb.parse::<u64>().ok())
            })
            .sum::<u64>()
            * 1024
    }
}

impl Drop for ControlPlane {
    fn drop(&mut self) {
        // Reverse order of start; the TempDir removes the directory.
        self.scheduler.kill();
        self.controller_manager.kill();
        self.apiserver.kill();
        self.etcd.kill();
        if let Some(mut j) = self.janitor.take() {
            let _ = j.kill();
            let _ = j.wait();
        }
    }
}
