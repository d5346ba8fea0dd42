//! A real node: the real kubelet (the control plane's release) on
//! containerd v2.4.2 and Debian's runc, with the bridge CNI plugin giving
//! every pod its own address on the lane's bridge, the real kube-proxy
//! (nftables mode, Debian's nft) routing Services' cluster IPs to their
//! pods from the pods and from the lane's own processes alike, and our
//! fake-GPU DRA kubelet plugin (`scripts/real-node/gpu-plugin`) publishing
//! the same `gpu.nvidia.com` devices as the kubelet stand-in and injecting
//! each claim's devices into its containers through CDI.
//!
//! It runs only inside a lane ([`super::lane`]): the lane's network
//! namespace keeps every address the node and its pods use private, and
//! its mount namespace takes this module's mounts with it. The binaries
//! come from `scripts/real-node.sh` (cached with the control plane).
//!
//! Two settings this machine kind needs, both logged as deprecations or
//! warnings by the components: root here lacks `CAP_SYS_RESOURCE`, so
//! containerd's CRI runs with `restrict_oom_score_adj` (runc cannot set the
//! kubelet's -998 for sandboxes; pods get 0 instead of -997/-998); and the
//! machine has cgroup v1 hierarchies, so the kubelet runs with
//! `failCgroupV1: false` (cgroupfs driver).
//!
//! What the node must not write to the machine, it writes here: the kubelet
//! checks six kernel sysctls it would otherwise set host-wide, so files
//! holding the values it wants are bound over them inside the lane
//! (`protectKernelDefaults: true`: a value that differs makes it stop, not
//! write); `/var` and `/run` are overlaid with directories of the node's,
//! for the paths the kubelet and runc hard-code; every other path is
//! configured under the node's directory. The kubelet's cgroups live under
//! the lane's own cgroup root, which the lane removes at its end.

use super::control_plane::{ControlPlane, spawn_owned};
use super::images;
use super::lane;
use k8s_openapi::api::core::v1::Node;
use kube::Api;
use std::fs;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

/// The containerd release `scripts/real-node.sh` builds.
pub const CONTAINERD_VERSION: &str = "v2.4.2";
/// Its cache entry (the kubelet's release, containerd's, the recipe rev).
const CACHE_KEY: &str = "v1.37.2-containerd-v2.4.2-go2";
const BINARIES: [&str; 5] = [
    "kubelet",
    "kube-proxy",
    "containerd",
    "containerd-shim-runc-v2",
    "gpu-plugin",
];
/// The kubelet's port on the node's lane address (the lane is private, so
/// the usual port is free).
const KUBELET_PORT: u16 = 10250;

/// The node's run directory, in the lane's private /run (an overlay of
/// the node's: [`isolate`]).
const RUN: &str = "/run/model-residency";
/// containerd's socket.
const SOCKET: &str = "/run/model-residency/containerd.sock";

/// The sysctls the kubelet's container manager checks, and their values.
const KERNEL_DEFAULTS: [(&str, &str); 6] = [
    ("vm/overcommit_memory", "1"),
    ("vm/panic_on_oom", "0"),
    ("kernel/panic", "10"),
    ("kernel/panic_on_oops", "1"),
    ("kernel/keys/root_maxkeys", "1000000"),
    ("kernel/keys/root_maxbytes", "25000000"),
];

#[derive(Debug, thiserror::Error)]
pub enum RealNodeError {
    #[error(
        "a real node runs only inside a lane (its own network and mount namespaces): \
         run the command under `model-residency lane -- ...` (scripts/test.sh does)"
    )]
    NotInLane,
    #[error(
        "no real-node binaries found ({0}). Build them with `bash scripts/real-node.sh` \
         (kubelet, containerd and the fake-GPU DRA plugin from their Go modules: about 2.5 \
         minutes after the control plane's build, cached in ~/.cache/model-residency), or \
         point MODEL_RESIDENCY_REAL_NODE at a directory holding {BINARIES:?}"
    )]
    NoBinaries(String),
    #[error("real node: {0}")]
    Io(#[from] std::io::Error),
    #[error("real node: {what}; last log lines:\n{log}")]
    NotReady { what: String, log: String },
    #[error("real node: {0}")]
    Kube(#[from] kube::Error),
}

/// What node to run.
#[derive(Clone, Debug)]
pub struct RealNodeOptions {
    /// The node's name (the control plane must know it:
    /// [`super::control_plane::PlaneOptions::real_node`]).
    pub name: String,
    pub gpus: u32,
    /// Each GPU's memory, in bytes.
    pub gpu_memory: u64,
    /// This project's binary, for the local images.
    pub binary: PathBuf,
}

/// A running real node. Dropping it stops the kubelet, the GPU plugin and
/// containerd; the containers go with the lane.
pub struct RealNode {
    pub name: String,
    dir: tempfile::TempDir,
    bin: PathBuf,
    processes: Vec<(&'static str, Child)>,
    /// From start to the node Ready with its GPUs published.
    pub startup: Duration,
}

impl Drop for RealNode {
    fn drop(&mut self) {
        for (_, child) in self.processes.iter_mut().rev() {
            let _ = child.kill();
            let _ = child.wait();
        }
    }
}

/// Finds the directory holding the real node's [`BINARIES`].
pub fn find_binaries() -> Result<PathBuf, RealNodeError> {
    let mut candidates: Vec<PathBuf> = std::env::var_os("MODEL_RESIDENCY_REAL_NODE")
        .map(PathBuf::from)
        .into_iter()
        .collect();
    let cache = std::env::var_os("MODEL_RESIDENCY_CACHE")
        .map(PathBuf::from)
        .or_else(|| std::env::var_os("HOME").map(|h| Path::new(&h).join(".cache/model-residency")));
    if let Some(cache) = cache {
        candidates.push(cache.join("real-node").join(CACHE_KEY));
    }
    let tried: Vec<String> = candidates.iter().map(|d| d.display().to_string()).collect();
    candidates
        .into_iter()
        .find(|dir| BINARIES.iter().all(|b| dir.join(b).is_file()))
        .ok_or_else(|| RealNodeError::NoBinaries(format!("tried {}", tried.join(", "))))
}

impl RealNode {
    /// Starts containerd, imports the local images, starts the kubelet and
    /// the GPU plugin, and waits (up to two minutes) until the node is
    /// Ready with its GPUs published.
    pub async fn start(
        plane: &ControlPlane,
        client: &kube::Client,
        options: RealNodeOptions,
    ) -> Result<Self, RealNodeError> {
        let lane = lane::current().ok_or(RealNodeError::NotInLane)?;
        let bin = find_binaries()?;
        let t0 = Instant::now();
        // In the lane's short TMPDIR: the plugins' sockets are deep in it.
        let dir = tempfile::Builder::new().prefix("node.").tempdir()?;
        let d = dir.path().to_owned();
        isolate(&d, &lane)?;
        let mut node = RealNode {
            name: options.name.clone(),
            dir,
            bin: bin.clone(),
            processes: Vec::new(),
            startup: Duration::ZERO,
        };
        write_configs(&d, &lane)?;
        fs::write(d.join(GPUS_FILE), options.gpus.to_string())?;
        node.spawn(
            &bin,
            "containerd",
            &[format!(
                "--config={}",
                d.join("etc/containerd.toml").display()
            )],
        )?;
        node.until_containerd(&bin).await?;
        node.import_images(&bin, &options.binary)?;
        plane.write_kubelet_kubeconfig(&d.join("etc/kubelet.kubeconfig"))?;
        node.spawn(&bin, "kubelet", &kubelet_args(&d, &options.name))?;
        node.spawn(&bin, "kube-proxy", &kube_proxy_args(plane, &options.name))?;
        node.spawn(&bin, "gpu-plugin", &plugin_args(&d, plane, &options))?;
        super::kubelet::install_device_class(client).await?;
        node.until_ready(client).await?;
        node.startup = t0.elapsed();
        Ok(node)
    }

    /// Makes the node's DRA plugin publish `gpus` GPUs from now on (within a
    /// second): a GPU added, or the highest-indexed taken away, as a
    /// driver's slice follows its devices.
    pub fn set_gpus(&self, gpus: u32) -> std::io::Result<()> {
        fs::write(self.dir().join(GPUS_FILE), gpus.to_string())
    }

    /// The node's directory (configs, logs, the kubelet's root).
    pub fn dir(&self) -> &Path {
        self.dir.path()
    }

    fn spawn(&mut self, bin: &Path, name: &'static str, args: &[String]) -> std::io::Result<()> {
        let log = fs::File::create(self.dir().join(format!("{name}.log")))?;
        let path = format!(
            "{}:{}",
            bin.display(),
            std::env::var("PATH").unwrap_or_default()
        );
        let mut cmd = Command::new(bin.join(name));
        cmd.args(args)
            .env("PATH", path)
            .stdin(Stdio::null())
            .stdout(log.try_clone()?)
            .stderr(log);
        let child = spawn_owned(cmd)?;
        self.processes.push((name, child));
        Ok(())
    }

    /// The last lines of each process's log.
    pub fn log_tails(&self) -> String {
        let mut out = String::new();
        for (name, _) in &self.processes {
            let text =
                fs::read_to_string(self.dir().join(format!("{name}.log"))).unwrap_or_default();
            let lines: Vec<&str> = text.lines().collect();
            out += &format!(
                "--- {name}\n{}\n",
                lines[lines.len().saturating_sub(15)..].join("\n")
            );
        }
        out
    }

    fn not_ready(&self, what: impl Into<String>) -> RealNodeError {
        RealNodeError::NotReady {
            what: what.into(),
            log: self.log_tails(),
        }
    }

    /// Runs `ctr` against the node's containerd (namespace k8s.io, the
    /// CRI's), as a test pokes at a container under the kubelet.
    pub fn ctr<I: IntoIterator<Item = S>, S: AsRef<std::ffi::OsStr>>(
        &self,
        args: I,
    ) -> std::process::Output {
        self.ctr_command(&self.bin)
            .args(args)
            .output()
            .unwrap_or_else(|e| std::process::Output {
                status: std::process::ExitStatus::default(),
                stdout: Vec::new(),
                stderr: e.to_string().into_bytes(),
            })
    }

    fn ctr_command(&self, bin: &Path) -> Command {
        let mut cmd = Command::new(bin.join("ctr"));
        cmd.arg(format!("--address={SOCKET}"))
            .args(["--namespace", "k8s.io"]);
        cmd
    }

    async fn until_containerd(&mut self, bin: &Path) -> Result<(), RealNodeError> {
        for _ in 0..200 {
            let version = self.ctr_command(bin).arg("version").output()?;
            if version.status.success() {
                return Ok(());
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        Err(self.not_ready("containerd did not answer within 10 s"))
    }

    fn import_images(&self, bin: &Path, binary: &Path) -> Result<(), RealNodeError> {
        let scratch = self.dir().join("images");
        fs::create_dir_all(&scratch)?;
        let layout = scratch.join("images.tar");
        images::write_layout(binary, &scratch, &layout)?;
        let out = self
            .ctr_command(bin)
            .args(["images", "import", "--platform", "linux/amd64"])
            .arg(&layout)
            .output()?;
        if !out.status.success() {
            return Err(self.not_ready(format!(
                "ctr images import: {}",
                String::from_utf8_lossy(&out.stderr)
            )));
        }
        // The layout is in containerd's content store now.
        let _ = fs::remove_dir_all(&scratch);
        Ok(())
    }

    async fn until_ready(&mut self, client: &kube::Client) -> Result<(), RealNodeError> {
        let nodes: Api<Node> = Api::all(client.clone());
        let slices: Api<k8s_openapi::api::resource::v1::ResourceSlice> = Api::all(client.clone());
        let deadline = Instant::now() + Duration::from_secs(120);
        loop {
            let ready = nodes
                .get_opt(&self.name)
                .await?
                .is_some_and(|n| is_ready(&n));
            let published = slices
                .list(&Default::default())
                .await?
                .items
                .iter()
                .any(|s| {
                    s.spec.driver == super::kubelet::GPU_DRIVER
                        && s.spec.node_name.as_deref() == Some(self.name.as_str())
                });
            // kube-proxy's /healthz answers 200 once its rules are in place.
            let proxying = crate::http::send(
                KUBE_PROXY_HEALTHZ.parse().expect("an address"),
                "GET",
                "/healthz",
                "",
            )
            .await
            .is_ok_and(|a| a.status == 200);
            if ready && published && proxying {
                return Ok(());
            }
            let exited = self
                .processes
                .iter_mut()
                .find_map(|(name, c)| (!matches!(c.try_wait(), Ok(None))).then_some(*name));
            if let Some(name) = exited {
                return Err(self.not_ready(format!("{name} exited")));
            }
            if Instant::now() > deadline {
                return Err(self.not_ready(format!(
                    "node {} not Ready with its GPUs within 120 s (Ready: {ready}, GPUs published: {published}, kube-proxy healthy: {proxying})",
                    self.name
                )));
            }
            tokio::time::sleep(Duration::from_millis(200)).await;
        }
    }
}

/// Whether a node says it is Ready.
pub fn is_ready(node: &Node) -> bool {
    node.status
        .iter()
        .flat_map(|s| s.conditions.iter().flatten())
        .any(|c| c.type_ == "Ready" && c.status == "True")
}

/// Everything that keeps the node's writes off the machine (module docs).
fn isolate(d: &Path, lane: &str) -> std::io::Result<()> {
    let sysctls = d.join("sysctl");
    fs::create_dir_all(&sysctls)?;
    for (name, value) in KERNEL_DEFAULTS {
        let file = sysctls.join(name.replace('/', "."));
        fs::write(&file, format!("{value}\n"))?;
        bind(&file, &Path::new("/proc/sys").join(name))?;
    }
    for top in ["var", "run"] {
        let (upper, work) = (
            d.join("overlay").join(top),
            d.join("overlay").join(format!("{top}.work")),
        );
        fs::create_dir_all(&upper)?;
        fs::create_dir_all(&work)?;
        let data = format!(
            "lowerdir=/{top},upperdir={},workdir={}",
            upper.display(),
            work.display()
        );
        mount(
            "overlay",
            &Path::new("/").join(top),
            "overlay",
            0,
            Some(&data),
        )?;
    }
    // The kubelet wants its cgroup root in every hierarchy before it starts.
    if let Ok(entries) = fs::read_dir("/sys/fs/cgroup") {
        for e in entries.flatten() {
            if e.path().join("cgroup.procs").is_file() {
                fs::create_dir_all(e.path().join(lane))?;
            }
        }
    }
    Ok(())
}

fn bind(from: &Path, to: &Path) -> std::io::Result<()> {
    mount(&from.to_string_lossy(), to, "", libc::MS_BIND, None)
}

#[allow(unsafe_code)] // a libc call std has no safe wrapper for
fn mount(
    source: &str,
    target: &Path,
    fstype: &str,
    flags: libc::c_ulong,
    data: Option<&str>,
) -> std::io::Result<()> {
    use std::ffi::CString;
    let c = |s: &str| CString::new(s).map_err(std::io::Error::other);
    let (source, target_c, fstype) = (c(source)?, c(&target.to_string_lossy())?, c(fstype)?);
    let data = data.map(c).transpose()?;
    // SAFETY: every pointer is a NUL-terminated string that outlives the
    // call, or null for no data.
    let rc = unsafe {
        libc::mount(
            source.as_ptr(),
            target_c.as_ptr(),
            fstype.as_ptr(),
            flags,
            data.as_ref()
                .map_or(std::ptr::null(), |d| d.as_ptr().cast()),
        )
    };
    if rc == 0 {
        Ok(())
    } else {
        let e = std::io::Error::last_os_error();
        Err(std::io::Error::new(
            e.kind(),
            format!("mount {}: {e}", target.display()),
        ))
    }
}

fn write_configs(d: &Path, lane: &str) -> std::io::Result<()> {
    for sub in ["etc", "cni", "cdi", "kubelet", "logs"] {
        fs::create_dir_all(d.join(sub))?;
    }
    fs::create_dir_all(RUN)?;
    let dir = d.display();
    fs::write(
        d.join("etc/containerd.toml"),
        containerd_config(&dir.to_string()),
    )?;
    fs::write(d.join("cni/10-lane.conflist"), cni_config(&dir.to_string()))?;
    fs::write(
        d.join("etc/kubelet.yaml"),
        kubelet_config(&dir.to_string(), lane),
    )?;
    Ok(())
}

fn containerd_config(dir: &str) -> String {
    let pause = images::PAUSE_IMAGE;
    format!(
        r#"version = 4
root = '{dir}/containerd/root'
state = '{dir}/containerd/state'
[plugins.'io.containerd.cri.v1.images']
  snapshotter = 'overlayfs'
  [plugins.'io.containerd.cri.v1.images'.pinned_images]
    sandbox = '{pause}'
[plugins.'io.containerd.cri.v1.runtime']
  # This machine's root lacks CAP_SYS_RESOURCE: runc cannot lower a
  # sandbox's oom_score_adj to the kubelet's -998 (module docs).
  restrict_oom_score_adj = true
  cdi_spec_dirs = ['{dir}/cdi']
  [plugins.'io.containerd.cri.v1.runtime'.containerd]
    default_runtime_name = 'runc'
    [plugins.'io.containerd.cri.v1.runtime'.containerd.runtimes.runc]
      runtime_type = 'io.containerd.runc.v2'
      [plugins.'io.containerd.cri.v1.runtime'.containerd.runtimes.runc.options]
        BinaryName = '/usr/sbin/runc'
        Root = '{RUN}/runc'
        SystemdCgroup = false
  [plugins.'io.containerd.cri.v1.runtime'.cni]
    bin_dirs = ['/usr/lib/cni']
    conf_dir = '{dir}/cni'
[plugins.'io.containerd.internal.v1.opt']
  path = '{dir}/containerd/opt'
[plugins.'io.containerd.nri.v1.nri']
  disable = true
[plugins.'io.containerd.server.v1.grpc']
  address = '{SOCKET}'
[plugins.'io.containerd.server.v1.ttrpc']
  address = '{SOCKET}.ttrpc'
# The shims' socket directory may be at most 42 characters long; the lane's
# /run is the node's own (an overlay), so a short path there is private.
[plugins.'io.containerd.shim.v1.manager']
  socket_dir = '{RUN}/s'
"#
    )
}

/// Debian's bridge plugin on the lane's bridge, addresses from host-local.
fn cni_config(dir: &str) -> String {
    serde_json::json!({
        "cniVersion": "1.0.0", "name": "lane",
        "plugins": [{
            // The node is each pod's default gateway: a Service's cluster
            // IP is routed to it, where kube-proxy's rules rewrite it.
            "type": "bridge", "bridge": lane::BRIDGE, "isGateway": true, "isDefaultGateway": true,
            "ipMasq": false,
            "hairpinMode": true,
            "ipam": {
                "type": "host-local", "dataDir": format!("{dir}/cni/ipam"),
                "ranges": [[{"subnet": lane::POD_SUBNET, "gateway": lane::NODE_IP}]],
            },
        }],
    })
    .to_string()
}

fn kubelet_config(dir: &str, lane: &str) -> String {
    format!(
        r#"apiVersion: kubelet.config.k8s.io/v1beta1
kind: KubeletConfiguration
address: {ip}
port: {KUBELET_PORT}
readOnlyPort: 0
healthzBindAddress: 127.0.0.1
healthzPort: 10248
cgroupDriver: cgroupfs
cgroupRoot: /{lane}
# This machine has cgroup v1 hierarchies (module docs).
failCgroupV1: false
failSwapOn: false
containerRuntimeEndpoint: unix://{SOCKET}
imageServiceEndpoint: unix://{SOCKET}
# Only the lane's own processes can reach it (its network namespace).
authentication:
  anonymous: {{enabled: true}}
  webhook: {{enabled: false}}
authorization: {{mode: AlwaysAllow}}
resolvConf: ""
rotateCertificates: false
serverTLSBootstrap: false
protectKernelDefaults: true
evictionHard: {{memory.available: "100Mi", nodefs.available: "1%", imagefs.available: "1%"}}
imageGCHighThresholdPercent: 99
imageGCLowThresholdPercent: 98
syncFrequency: 10s
nodeStatusUpdateFrequency: 10s
podLogsDir: {dir}/logs/pods
volumePluginDir: {dir}/kubelet/volume-plugins
"#,
        ip = lane::NODE_IP
    )
}

fn kubelet_args(d: &Path, name: &str) -> Vec<String> {
    vec![
        format!("--config={}", d.join("etc/kubelet.yaml").display()),
        format!(
            "--kubeconfig={}",
            d.join("etc/kubelet.kubeconfig").display()
        ),
        format!("--root-dir={}", d.join("kubelet").display()),
        format!("--cert-dir={}", d.join("kubelet/pki").display()),
        format!("--hostname-override={name}"),
        format!("--node-ip={}", lane::NODE_IP),
        "--v=2".into(),
    ]
}

/// Where kube-proxy says whether its rules are in place.
const KUBE_PROXY_HEALTHZ: &str = "127.0.0.1:10256";

/// kube-proxy in nftables mode, for the node's name. Its rules live in the
/// lane's network namespace and die with it. It leaves the conntrack
/// sysctls alone (a zero is "do not set"), and masquerades every Service
/// connection: a pod's answer to another pod on the bridge then comes back
/// through the node, whose connection tracking rewrites it, without
/// bridged traffic having to pass through netfilter.
fn kube_proxy_args(plane: &ControlPlane, name: &str) -> Vec<String> {
    vec![
        format!("--kubeconfig={}", plane.kubeconfig().display()),
        format!("--hostname-override={name}"),
        "--proxy-mode=nftables".into(),
        format!("--cluster-cidr={}", lane::POD_SUBNET),
        "--masquerade-all".into(),
        "--conntrack-max-per-core=0".into(),
        "--conntrack-tcp-timeout-established=0".into(),
        "--conntrack-tcp-timeout-close-wait=0".into(),
        // No CAP_SYS_RESOURCE here (module docs): leave its score as it is.
        "--oom-score-adj=0".into(),
        format!("--healthz-bind-address={KUBE_PROXY_HEALTHZ}"),
        "--metrics-bind-address=127.0.0.1:10249".into(),
        "--v=2".into(),
    ]
}

/// The file the plugin reads its GPU count from ([`RealNode::set_gpus`]).
const GPUS_FILE: &str = "etc/gpus";

fn plugin_args(d: &Path, plane: &ControlPlane, options: &RealNodeOptions) -> Vec<String> {
    vec![
        format!("--kubeconfig={}", plane.kubeconfig().display()),
        format!("--node-name={}", options.name),
        format!("--gpus={}", options.gpus),
        format!("--gpus-file={}", d.join(GPUS_FILE).display()),
        format!("--gpu-memory={}", options.gpu_memory),
        format!("--product-name={}", super::kubelet::FAKE_PRODUCT),
        format!(
            "--registry-dir={}",
            d.join("kubelet/plugins_registry").display()
        ),
        format!("--plugins-dir={}", d.join("kubelet/plugins").display()),
        format!("--cdi-dir={}", d.join("cdi").display()),
    ]
}
