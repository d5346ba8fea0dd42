//! What a control plane keeps on disk: its directory, the credentials and
//! tokens, etcd's arguments and the kubeconfigs.

use super::*;

/// The control plane's directory: etcd fsyncs every write, and on tmpfs
/// that costs nothing. In a lane, under the lane's directory instead: the
/// janitor dies with the lane, and the lane removes its directory.
pub(super) fn plane_dir() -> std::io::Result<tempfile::TempDir> {
    let base = Path::new("/dev/shm");
    let builder = tempfile::Builder::new()
        .prefix("model-residency-cp.")
        .clone();
    if base.is_dir() && crate::local::lane::current().is_none() {
        builder.tempdir_in(base)
    } else {
        builder.tempdir()
    }
}

/// Credentials: a static admin token (and the real node's kubelet's) and a
/// service-account key.
pub(super) fn write_credentials(d: &Path, options: &PlaneOptions) -> Result<(), ControlPlaneError> {
    let mut tokens = format!("{ADMIN_TOKEN},admin,admin,\"system:masters\"\n");
    if let Some(node) = &options.real_node {
        tokens +=
            &format!("{KUBELET_TOKEN},system:node:{node},system:node:{node},\"system:nodes\"\n");
    }
    fs::write(d.join("tokens.csv"), tokens)?;
    crate::local::tls::openssl(d, &["genrsa", "-out", "sa.key", "2048"])?;
    // The front proxy's CA and the client certificate the API server
    // proxies to extension API servers with.
    crate::local::tls::issue_certificate(d, "front-proxy-ca", "front-proxy-ca", None, &[])?;
    crate::local::tls::issue_certificate(
        d,
        "front-proxy-client",
        "front-proxy-client",
        Some("front-proxy-ca"),
        &["extendedKeyUsage=clientAuth"],
    )?;
    Ok(())
}

pub(super) fn etcd_args(dir: &Path, port: u16, peer: u16) -> Vec<String> {
    vec![
        "--name=default".into(),
        format!("--data-dir={}", dir.join("etcd").display()),
        format!("--listen-client-urls=http://127.0.0.1:{port}"),
        format!("--advertise-client-urls=http://127.0.0.1:{port}"),
        format!("--listen-peer-urls=http://127.0.0.1:{peer}"),
        format!("--initial-advertise-peer-urls=http://127.0.0.1:{peer}"),
        format!("--initial-cluster=default=http://127.0.0.1:{peer}"),
        "--log-level=warn".into(),
    ]
}

pub(super) fn write_kubeconfig(path: &Path, port: u16) -> std::io::Result<()> {
    let mut f = fs::File::create(path)?;
    write!(
        f,
        "apiVersion: v1
kind: Config
clusters:
- name: local
  cluster:
    server: https://127.0.0.1:{port}
    insecure-skip-tls-verify: true
users:
- name: admin
  user:
    token: {ADMIN_TOKEN}
contexts:
- name: local
  context: {{cluster: local, user: admin, namespace: default}}
current-context: local
"
    )
}

pub(super) async fn client_from(kubeconfig: &Path) -> Result<kube::Client, ControlPlaneError> {
    let kc =
        Kubeconfig::read_from(kubeconfig).map_err(|e| ControlPlaneError::Config(e.to_string()))?;
    let config = kube::Config::from_custom_kubeconfig(kc, &KubeConfigOptions::default())
        .await
        .map_err(|e| ControlPlaneError::Config(e.to_string()))?;
    Ok(kube::Client::try_from(config)?)
}
