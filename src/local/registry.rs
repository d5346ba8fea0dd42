//! A real OCI registry on loopback for tests, benchmarks and the demo:
//! Debian's `docker-registry` (the CNCF distribution registry), with TLS
//! (a CA and a server certificate made here with `openssl`) and htpasswd
//! basic auth (`htpasswd -B` from apache2-utils). `scripts/registry.sh`
//! installs both. Artifacts are pushed through the same OCI client the
//! node agent pulls with.

use oci_client::client::{Certificate, CertificateEncoding, ClientConfig};
use oci_client::secrets::RegistryAuth;
use oci_client::{Client, Reference, RegistryOperation};
use std::net::{SocketAddr, TcpListener, TcpStream};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

/// The registry's one user.
pub const USER: &str = "pusher";
pub const PASSWORD: &str = "s3cret-pass";

/// A running registry; stopped (SIGKILL) when dropped.
pub struct LocalRegistry {
    pub addr: SocketAddr,
    dir: tempfile::TempDir,
    process: Option<Child>,
}

/// The registry binary: `$MODEL_RESIDENCY_REGISTRY` or Debian's.
fn binary() -> PathBuf {
    std::env::var_os("MODEL_RESIDENCY_REGISTRY")
        .map(PathBuf::from)
        .unwrap_or_else(|| PathBuf::from("/usr/bin/docker-registry"))
}

impl LocalRegistry {
    /// Makes the certificates, the password file and the configuration,
    /// and starts the registry on a free loopback port.
    pub fn start() -> Result<LocalRegistry, String> {
        if !binary().exists() {
            return Err(format!(
                "no registry at {} (bash scripts/registry.sh installs Debian's docker-registry)",
                binary().display()
            ));
        }
        let dir = tempfile::tempdir().map_err(|e| e.to_string())?;
        let d = dir.path();
        let port = TcpListener::bind("127.0.0.1:0")
            .and_then(|l| l.local_addr())
            .map_err(|e| e.to_string())?
            .port();
        let addr: SocketAddr = ([127, 0, 0, 1], port).into();
        let tls = |r: std::io::Result<()>| r.map_err(|e| e.to_string());
        tls(super::tls::issue_certificate(
            d,
            "ca",
            "model-residency test CA",
            None,
            &[],
        ))?;
        tls(super::tls::issue_certificate(
            d,
            "server",
            "127.0.0.1",
            Some("ca"),
            &["subjectAltName=IP:127.0.0.1,DNS:localhost"],
        ))?;
        let htpasswd = Command::new("htpasswd")
            .args(["-Bbn", USER, PASSWORD])
            .output()
            .map_err(|e| format!("htpasswd (apache2-utils): {e}"))?;
        std::fs::write(d.join("htpasswd"), htpasswd.stdout).map_err(|e| e.to_string())?;
        let config = format!(
            "version: 0.1\nlog:\n  level: error\nstorage:\n  filesystem:\n    rootdirectory: {root}\n  delete:\n    enabled: true\nhttp:\n  addr: {addr}\n  tls:\n    certificate: {d}/server.crt\n    key: {d}/server.key\nauth:\n  htpasswd:\n    realm: model-residency-test\n    path: {d}/htpasswd\n",
            root = d.join("storage").display(),
            d = d.display(),
        );
        std::fs::write(d.join("config.yml"), config).map_err(|e| e.to_string())?;
        let mut registry = LocalRegistry {
            addr,
            dir,
            process: None,
        };
        registry.resume()?;
        Ok(registry)
    }

    /// `127.0.0.1:<port>`, as references name it.
    pub fn host(&self) -> String {
        self.addr.to_string()
    }

    /// The CA certificate (PEM) the registry's certificate is signed by.
    pub fn ca_file(&self) -> PathBuf {
        self.dir.path().join("ca.crt")
    }

    /// Where the registry keeps its blobs (a test removes one to make a
    /// manifest point at a blob the registry does not have).
    pub fn storage(&self) -> &Path {
        self.dir.path()
    }

    /// Restarts it answering every blob GET with a redirect to `baseurl`
    /// (distribution's `redirect` storage middleware, as registries behind
    /// a CDN or an object store answer).
    pub fn redirect_blobs_to(&mut self, baseurl: &str) -> Result<(), String> {
        let path = self.dir.path().join("config.yml");
        let config = std::fs::read_to_string(&path).map_err(|e| e.to_string())?;
        let config = format!(
            "{config}middleware:\n  storage:\n    - name: redirect\n      options:\n        baseurl: {baseurl}\n"
        );
        std::fs::write(&path, config).map_err(|e| e.to_string())?;
        self.resume()
    }

    /// Stops the registry (SIGKILL).
    pub fn stop(&mut self) {
        if let Some(mut p) = self.process.take() {
            let _ = p.kill();
            let _ = p.wait();
        }
    }

    /// Starts it (again) on the same port and storage; waits until it
    /// accepts connections.
    pub fn resume(&mut self) -> Result<(), String> {
        self.stop();
        let child = Command::new(binary())
            .arg("serve")
            .arg(self.dir.path().join("config.yml"))
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .map_err(|e| format!("starting {}: {e}", binary().display()))?;
        self.process = Some(child);
        let deadline = Instant::now() + Duration::from_secs(15);
        while TcpStream::connect(self.addr).is_err() {
            if Instant::now() > deadline {
                return Err("the registry did not listen within 15 s".into());
            }
            std::thread::sleep(Duration::from_millis(20));
        }
        Ok(())
    }

    /// A client that trusts the registry's CA, logged in for pushing to
    /// `repository`.
    pub async fn pusher(&self, repository: &str) -> Result<(Client, Reference), String> {
        let ca = std::fs::read(self.ca_file()).map_err(|e| e.to_string())?;
        let client = Client::try_from(ClientConfig {
            extra_root_certificates: vec![Certificate {
                encoding: CertificateEncoding::Pem,
                data: ca,
            }],
            ..Default::default()
        })
        .map_err(|e| e.to_string())?;
        let reference: Reference = format!("{}/{repository}:latest", self.host())
            .parse()
            .map_err(|e| format!("{e}"))?;
        client
            .auth(
                &reference,
                &RegistryAuth::Basic(USER.into(), PASSWORD.into()),
                RegistryOperation::Push,
            )
            .await
            .map_err(|e| e.to_string())?;
        Ok((client, reference))
    }

    /// Pushes an artifact of `layers` (media type, bytes, title) to
    /// `repository` under `tag`; yields the manifest's digest.
    pub async fn push(
        &self,
        repository: &str,
        tag: &str,
        layers: &[(&str, &[u8], Option<&str>)],
    ) -> Result<String, String> {
        self.push_edited(repository, tag, layers, |_| {}).await
    }

    /// As [`Self::push`], with the manifest changed by `edit` before it is
    /// pushed (a test's registry that lies in a descriptor).
    pub async fn push_edited(
        &self,
        repository: &str,
        tag: &str,
        layers: &[(&str, &[u8], Option<&str>)],
        edit: impl FnOnce(&mut serde_json::Value),
    ) -> Result<String, String> {
        let (client, reference) = self.pusher(repository).await?;
        let reference = Reference::with_tag(
            reference.registry().to_owned(),
            reference.repository().to_owned(),
            tag.to_owned(),
        );
        let mut descriptors = Vec::new();
        for (media_type, bytes, title) in layers {
            let digest = sha256_digest(bytes);
            client
                .push_blob(&reference, bytes.to_vec(), &digest)
                .await
                .map_err(|e| format!("pushing a blob: {e}"))?;
            let mut d =
                serde_json::json!({"mediaType": media_type, "digest": digest, "size": bytes.len()});
            if let Some(t) = title {
                d["annotations"] = serde_json::json!({"org.opencontainers.image.title": t});
            }
            descriptors.push(d);
        }
        // The empty config of an artifact (the OCI image spec's guidance).
        let empty = b"{}";
        let config_digest = sha256_digest(empty);
        client
            .push_blob(&reference, empty.to_vec(), &config_digest)
            .await
            .map_err(|e| format!("pushing the config: {e}"))?;
        let mut manifest = serde_json::json!({
            "schemaVersion": 2,
            "mediaType": "application/vnd.oci.image.manifest.v1+json",
            "artifactType": "application/vnd.model-residency.test",
            "config": {"mediaType": "application/vnd.oci.empty.v1+json", "digest": config_digest, "size": 2},
            "layers": descriptors,
        });
        edit(&mut manifest);
        let body = serde_json::to_vec(&manifest).map_err(|e| e.to_string())?;
        let digest = sha256_digest(&body);
        client
            .push_manifest_raw(
                &reference,
                body,
                http::HeaderValue::from_static("application/vnd.oci.image.manifest.v1+json"),
            )
            .await
            .map_err(|e| format!("pushing the manifest: {e}"))?;
        Ok(digest)
    }
}

impl Drop for LocalRegistry {
    fn drop(&mut self) {
        self.stop();
    }
}

/// `sha256:<hex>` of `bytes`.
pub fn sha256_digest(bytes: &[u8]) -> String {
    let d = ring::digest::digest(&ring::digest::SHA256, bytes);
    format!(
        "sha256:{}",
        crate::node_agent::fetch::encode_hex(d.as_ref())
    )
}

/// A `kubernetes.io/dockerconfigjson` for `registry` with `user:password`.
pub fn docker_config(registry: &str, user: &str, password: &str) -> String {
    use base64::Engine;
    let auth = base64::engine::general_purpose::STANDARD.encode(format!("{user}:{password}"));
    serde_json::json!({"auths": {registry: {"auth": auth}}}).to_string()
}

/// A gzip tar of `files` (path, bytes), as an image layer.
pub fn tar_gz(files: &[(&str, &[u8])]) -> Vec<u8> {
    let mut builder = tar::Builder::new(Vec::new());
    for (path, bytes) in files {
        let mut h = tar::Header::new_gnu();
        h.set_size(bytes.len() as u64);
        h.set_mode(0o644);
        h.set_entry_type(tar::EntryType::Regular);
        h.set_path(path).expect("a tar path");
        h.set_cksum();
        builder.append(&h, *bytes).expect("a tar entry");
    }
    let tar = builder.into_inner().expect("a tar");
    let mut gz = flate2::write::GzEncoder::new(Vec::new(), flate2::Compression::fast());
    std::io::Write::write_all(&mut gz, &tar).expect("gzip");
    gz.finish().expect("gzip")
}
