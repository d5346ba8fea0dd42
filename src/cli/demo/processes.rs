//! What the demo starts and stops: the node (real or the stand-in), the
//! operator, the router and the node agent as processes with the chart's
//! ServiceAccounts, and the RBAC they run under.

use super::*;

/// The node the demo's pods run on.
#[derive(Clone, Copy, Debug)]
pub(super) enum Node {
    /// The real kubelet and containerd (in the demo's lane).
    Real,
    /// The kubelet stand-in, with its seconds of "loading" per GiB.
    StandIn(f64),
}

/// Whichever node runs, kept until the demo ends.
pub(super) enum RunningNode {
    #[allow(dead_code)] // held for its Drop
    Real(RealNode),
    #[allow(dead_code)] // held for its Drop
    StandIn(FakeKubelet),
}

/// Starts the demo's node: two GPUs (the residency's claim takes one,
/// `gpus` shows the other free; the warm tier's residency then takes it).
pub(super) async fn start_node(
    plane: &ControlPlane,
    client: &kube::Client,
    name: &str,
    node: Node,
) -> Result<RunningNode, Failure> {
    match node {
        Node::Real => {
            say(&format!(
                "Starting a real node {name}: the kubelet {} on containerd {} and runc, pods on a bridge of the demo's own network namespace, its two GPUs published by a DRA kubelet plugin (fake devices: this machine has none); images made from this binary",
                model_residency::local::control_plane::KUBERNETES_VERSION,
                model_residency::local::real_node::CONTAINERD_VERSION
            ));
            let options = RealNodeOptions {
                name: name.to_owned(),
                gpus: 2,
                gpu_memory: 80 << 30,
                binary: std::env::current_exe().map_err(Failure::other)?,
            };
            let real = RealNode::start(plane, client, options)
                .await
                .map_err(Failure::other)?;
            println!(
                "   node {name} Ready in {:.1} s",
                real.startup.as_secs_f64()
            );
            kubectl(plane.kubeconfig(), &["get", "nodes", "-o", "wide"]);
            Ok(RunningNode::Real(real))
        }
        Node::StandIn(secs_per_gib) => {
            say(&format!(
                "Registering fake GPU node {name} with the kubelet stand-in (pods become Ready after {secs_per_gib} s per GiB)"
            ));
            let mut config = KubeletConfig::instant(&[name]);
            config.nodes[0].gpus = 2;
            config.load_delay = Duration::from_millis(100);
            config.delay_per_gib = Duration::from_secs_f64(secs_per_gib.max(0.0));
            config.terminating_delay = Duration::from_millis(200);
            let kubelet = FakeKubelet::start(client.clone(), config)
                .await
                .map_err(fail("register the node"))?;
            Ok(RunningNode::StandIn(kubelet))
        }
    }
}

/// A `model-residency` subcommand run as a separate process with only its
/// chart ServiceAccount's RBAC.
pub(super) struct Process {
    pub(super) what: &'static str,
    pub(super) child: std::process::Child,
    pub(super) addr: String,
    pub(super) log: PathBuf,
    pub(super) _dir: tempfile::TempDir,
}

impl Process {
    #[allow(unsafe_code)] // a libc call std has no safe wrapper for
    pub(super) fn stop(mut self) {
        say(&format!(
            "Stopping the {} with SIGTERM (a Deployment's pod shutdown)",
            self.what
        ));
        // SAFETY: kill(2) on our own child's pid.
        unsafe {
            libc::kill(self.child.id() as i32, libc::SIGTERM);
        }
        let status = self.child.wait();
        println!(
            "   exited: {}; its last log line: {}",
            status
                .map(|s| s.to_string())
                .unwrap_or_else(|e| e.to_string()),
            std::fs::read_to_string(&self.log)
                .unwrap_or_default()
                .lines()
                .last()
                .unwrap_or("")
        );
    }
}

impl Drop for Process {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

pub(super) const OPERATOR_NS: &str = "model-residency-system";

/// GETs `path` from one of the demo's processes: the status and the body.
pub(super) async fn http_get(addr: &str, path: &str) -> Option<(u16, String)> {
    let addr = addr.parse().ok()?;
    let answer = model_residency::http::send(addr, "GET", path, "")
        .await
        .ok()?;
    Some((answer.status, answer.body))
}

/// Renders the chart with helm and applies its ServiceAccounts and RBAC
/// (the operator's and the router's).
pub(super) fn install_rbac(plane: &ControlPlane) -> Result<(), Failure> {
    let helm = model_residency::local::chart::helm_binary().map_err(|e| Failure {
        message: format!("to render the chart's RBAC: {e}"),
        code: 1,
    })?;
    say(
        "Installing the chart's ServiceAccounts and RBAC (helm template charts/model-residency | kubectl apply)",
    );
    let rendered = Command::new(&helm)
        .args(["template", "model-residency"])
        .arg(checkout_file("charts/model-residency"))
        .args(["--namespace", OPERATOR_NS])
        .args(["--set", "nodeAgent.enabled=true"])
        .args([
            "--set",
            &format!("nodeAgent.registryCredentials={DEMO_REGISTRY_SECRET}"),
        ])
        .output()
        .map_err(|e| Failure::other(format!("helm: {e}")))?;
    if !rendered.status.success() {
        return Err(Failure::other(format!(
            "helm template: {}",
            String::from_utf8_lossy(&rendered.stderr)
        )));
    }
    let rbac_kinds = [
        "ServiceAccount",
        "ClusterRole",
        "ClusterRoleBinding",
        "Role",
        "RoleBinding",
    ];
    let rbac: Vec<&str> = std::str::from_utf8(&rendered.stdout)
        .unwrap_or_default()
        .split("\n---")
        .filter(|doc| {
            doc.lines().any(|l| {
                rbac_kinds
                    .iter()
                    .any(|k| l.strip_prefix("kind: ") == Some(*k))
            })
        })
        .collect();
    let dir = tempfile::tempdir().map_err(Failure::other)?;
    let rbac_file = dir.path().join("rbac.yaml");
    std::fs::write(&rbac_file, rbac.join("\n---")).map_err(Failure::other)?;
    let kc = plane.kubeconfig();
    kubectl(kc, &["create", "namespace", OPERATOR_NS]);
    kubectl(kc, &["apply", "-f", rbac_file.to_str().unwrap_or_default()]);
    Ok(())
}

/// Runs `model-residency <args> --http-addr <a free port>` as ServiceAccount
/// `account` of the chart, and waits for its /readyz.
pub(super) async fn spawn_as(
    plane: &ControlPlane,
    what: &'static str,
    account: &str,
    args: &[&str],
) -> Result<Process, Failure> {
    let dir = tempfile::tempdir().map_err(Failure::other)?;
    let sa = format!("system:serviceaccount:{OPERATOR_NS}:{account}");
    let sa_groups = [
        "system:serviceaccounts",
        "system:serviceaccounts:model-residency-system",
        "system:authenticated",
    ];
    let kubeconfig = dir.path().join("kubeconfig");
    plane
        .write_kubeconfig_as(&kubeconfig, &sa, &sa_groups)
        .map_err(Failure::other)?;
    let port = std::net::TcpListener::bind("127.0.0.1:0")
        .and_then(|l| l.local_addr())
        .map(|a| a.port())
        .map_err(Failure::other)?;
    let addr = format!("127.0.0.1:{port}");
    let log = dir.path().join("log");
    let log_file = std::fs::File::create(&log).map_err(Failure::other)?;
    let exe = std::env::current_exe().map_err(Failure::other)?;
    let mut cmd = Command::new(exe);
    cmd.env("KUBECONFIG", &kubeconfig)
        .env("POD_NAME", format!("model-residency-demo-{what}"))
        .args(args)
        .args(["--http-addr", &addr])
        .stdout(std::process::Stdio::null())
        .stderr(log_file);
    // Dies with the demo, however the demo ends.
    let child = model_residency::local::control_plane::spawn_owned(cmd)
        .map_err(|e| Failure::other(format!("start the {what}: {e}")))?;
    let process = Process {
        what,
        child,
        addr: addr.clone(),
        log,
        _dir: dir,
    };
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        if http_get(&addr, "/readyz")
            .await
            .is_some_and(|(status, _)| status == 200)
        {
            break;
        }
        if Instant::now() > deadline {
            return Err(Failure {
                message: format!(
                    "the {what} did not become ready; its log:\n{}",
                    std::fs::read_to_string(&process.log).unwrap_or_default()
                ),
                code: 1,
            });
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    println!("   ready: http://{addr}/readyz answers 200");
    Ok(process)
}

/// `model-residency run --leader-elect`, as the chart's ServiceAccount.
pub(super) async fn start_operator(plane: &ControlPlane, real: bool) -> Result<Process, Failure> {
    install_rbac(plane)?;
    say("Starting the operator: model-residency run --leader-elect, as the chart's ServiceAccount");
    let mut args = vec!["run", "--leader-elect", "--lease-namespace", OPERATOR_NS];
    if real {
        // The GPU holder runs the local pause image (nothing is pulled).
        args.extend(["--gpu-holder-image", PAUSE_IMAGE]);
    }
    spawn_as(plane, "operator", "model-residency", &args).await
}

/// `model-residency route`, as the chart's router ServiceAccount. A zero
/// recency resolution writes every hit, so the residency's counters are the
/// seed's exactly.
pub(super) async fn start_router(plane: &ControlPlane) -> Result<Process, Failure> {
    say(
        "Starting the request router: model-residency route --recency-resolution 0s, as the chart's router ServiceAccount",
    );
    spawn_as(
        plane,
        "router",
        "model-residency-router",
        &[
            "route",
            "--recency-resolution",
            "0s",
            "--load-timeout",
            "60s",
        ],
    )
    .await
}
