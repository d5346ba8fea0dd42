//! Artifacts from a container registry (`artifact.source: oci://...`).
//! The ORAS project's `oci-client` logs in (its auth handshakes); the two
//! reads themselves, a manifest and a blob from an offset, are made by
//! [`super::distribution`], with the agent's redirect rule and limits.
//!
//! - **Resolve**: the reference's manifest is fetched (at most
//!   [`MANIFEST_LIMIT`] bytes) and checked against the reference's digest.
//!   An image index picks one manifest by this rule: the only one if it
//!   has one; else the one whose platform is `linux` on the node's
//!   architecture; else it is refused as ambiguous. An OCI artifact
//!   manifest's `blobs` count as its layers.
//! - **Place**: a layer with an `org.opencontainers.image.title`
//!   annotation is that file (the ORAS convention; the same path rules as
//!   http files). A tar layer (`...tar`, `+gzip`, `+zstd`) is unpacked, and
//!   the directory `path` inside it (default `/models`) is the model's
//!   directory. Model formats ([`resolve::ModelFormat`]): a CNCF ModelPack
//!   layer (`application/vnd.cncf.model.*`, and the legacy
//!   `application/vnd.cnai.model.*` its builder modctl still writes) is,
//!   raw, the file its `org.cncf.model.filepath` (or `org.cnai.model.filepath`)
//!   names, and as a tar the files at their paths from the model's root; a
//!   KitOps ModelKit layer (`application/vnd.kitops.modelkit.*`) is a tar
//!   of files at their paths from the root. Every entry of a tar layer is checked before anything is
//!   written: no absolute paths, no `..`, no links out of the layer, no
//!   device files or fifos. Anything else is `UnsupportedMediaType`.
//! - **Verify and resume**: a blob streams into `.blobs/partial/<hex>`,
//!   hashed as it arrives, its descriptor's size a hard limit; a blob cut
//!   short resumes there with a Range request; a digest that does not
//!   match removes it.
//! - **Store once**: blobs and unpacked layers are kept in the node's blob
//!   store ([`super::blobs`]) and linked into the artifact's directory; a
//!   blob the store holds is linked, not fetched.

mod pull;
mod resolve;
mod unpack;

use pull::*;
use resolve::*;
use unpack::*;
pub use unpack::{MAX_LAYER_ENTRIES, unpack_layer};

use super::blobs::{Store, ViewRecord, blob_id};
use super::distribution::{ReadError, Session};
use super::fetch::{
    Budget, FetchError, Fetched, PARTIAL_PREFIX, Progress, error_chain, inside_path, io,
};
use super::keep::Blob;
use oci_client::client::{Certificate, CertificateEncoding, ClientConfig};
use oci_client::errors::{OciDistributionError, OciErrorCode};
use oci_client::secrets::RegistryAuth;
use oci_client::{Client, Reference};
use std::path::{Path, PathBuf};

/// The largest manifest accepted (containerd's limit).
pub const MANIFEST_LIMIT: usize = 4 << 20;

const TITLE: &str = "org.opencontainers.image.title";

const MANIFEST_TYPES: &[&str] = &[
    "application/vnd.oci.image.manifest.v1+json",
    "application/vnd.docker.distribution.manifest.v2+json",
    "application/vnd.oci.image.index.v1+json",
    "application/vnd.docker.distribution.manifest.list.v2+json",
    "application/vnd.oci.artifact.manifest.v1+json",
];

/// An `oci://` source, parsed.
#[derive(Clone, Debug)]
pub struct Source {
    pub reference: Reference,
    /// As written (`oci://...`).
    pub text: String,
}

impl Source {
    pub fn parse(text: &str) -> Result<Source, FetchError> {
        let bad = |why: &str| FetchError::BadReference {
            reference: text.to_owned(),
            why: why.to_owned(),
        };
        let rest = text
            .strip_prefix("oci://")
            .ok_or_else(|| bad("it does not start with oci://"))?;
        let (registry, _) = rest
            .split_once('/')
            .ok_or_else(|| bad("it names no repository"))?;
        if registry.is_empty() || !(registry.contains('.') || registry.contains(':')) {
            // Without this, oci-client would read `models/x` as Docker Hub's.
            return Err(bad(
                "its first part must be a registry host (with a '.' or a port)",
            ));
        }
        let reference = if let Some(v6) = registry.strip_prefix('[') {
            ipv6_reference(registry, v6, &rest[registry.len()..]).map_err(|why| bad(&why))?
        } else {
            rest.parse().map_err(|e| bad(&format!("{e}")))?
        };
        Ok(Source {
            reference,
            text: text.to_owned(),
        })
    }

    /// The registry, as `host[:port]`.
    pub fn registry(&self) -> &str {
        self.reference.registry()
    }

    /// Whether it is under one of `allowed`'s `oci://` prefixes: the same
    /// registry host and port, and a repository under the prefix's path on
    /// a segment boundary (the rules of http sources, read as https).
    pub fn is_allowed(&self, allowed: &[String]) -> bool {
        let Ok(as_uri) = format!(
            "https://{}/{}",
            self.registry(),
            self.reference.repository()
        )
        .parse::<http::Uri>() else {
            return false;
        };
        allowed.iter().any(|prefix| {
            prefix.strip_prefix("oci://").is_some_and(|p| {
                super::fetch::is_under(&as_uri, &format!("https://{}", p.trim_end_matches('/')))
            })
        })
    }

    /// Whether the reference pins a digest (else a tag is resolved).
    pub fn digest(&self) -> Option<&str> {
        self.reference.digest()
    }
}

/// A reference on an IPv6 registry (`[addr]:port`, as URLs write it),
/// which the reference grammar (Docker's) has no form for: the rest is
/// parsed under a stand-in host, and the registry put back.
fn ipv6_reference(registry: &str, v6: &str, rest: &str) -> Result<Reference, String> {
    let (addr, port) = v6
        .split_once(']')
        .ok_or("an IPv6 registry needs its closing ']'")?;
    addr.parse::<std::net::Ipv6Addr>()
        .map_err(|e| format!("{addr:?} is not an IPv6 address: {e}"))?;
    if !(port.is_empty()
        || port
            .strip_prefix(':')
            .is_some_and(|p| p.parse::<u16>().is_ok()))
    {
        return Err(format!("{port:?} after the IPv6 address is not :<port>"));
    }
    let stand_in: Reference = format!("ipv6.invalid{rest}")
        .parse()
        .map_err(|e| format!("{e}"))?;
    let (registry, repository) = (registry.to_owned(), stand_in.repository().to_owned());
    Ok(match (stand_in.tag(), stand_in.digest()) {
        (Some(tag), Some(digest)) => {
            Reference::with_tag_and_digest(registry, repository, tag.into(), digest.into())
        }
        (None, Some(digest)) => Reference::with_digest(registry, repository, digest.into()),
        (tag, None) => Reference::with_tag(registry, repository, tag.unwrap_or("latest").into()),
    })
}

/// One layer of a resolved manifest.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Layer {
    pub digest: String,
    pub size: u64,
    pub media_type: String,
    /// The file it is (ORAS's title, a ModelPack raw layer's filepath),
    /// if annotated.
    pub title: Option<String>,
    /// A tar layer of a model format (ModelPack, KitOps) whose entries are
    /// the model's files at their paths: unpacked whole at the artifact's
    /// root, not `artifact.path` taken out of it as from an image.
    pub whole: bool,
}

impl Layer {
    fn hex(&self) -> &str {
        self.digest.trim_start_matches("sha256:")
    }
}

/// A manifest resolved to the layers the agent places.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Resolved {
    /// The manifest's digest (of the image manifest, after an index).
    pub digest: String,
    /// The digest the reference resolved to first (the index's, if any):
    /// what a tag is pinned to.
    pub pinned: String,
    pub layers: Vec<Layer>,
}

/// The registry clients. oci-client's (which logs in) is made for each
/// session: it keeps the first credentials it is given for a registry, so
/// a shared one would never see an edited Secret.
#[derive(Clone)]
pub struct Registry {
    ca_pem: Option<Vec<u8>>,
    /// The reads themselves (redirects only under `--allowed-sources`),
    /// one pooled client for every registry.
    http: reqwest::Client,
}

impl Registry {
    /// A client trusting the system's roots and `ca_pem` (a CA bundle for
    /// registries with private certificates), following redirects only
    /// under `allowed`.
    pub fn new(ca_pem: Option<Vec<u8>>, allowed: Vec<String>) -> Result<Registry, FetchError> {
        let http = crate::node_agent::transport::client(
            crate::node_agent::transport::Reads::Registry,
            ca_pem.as_deref(),
            &allowed,
        )
        .map_err(|why| FetchError::BadReference {
            reference: "the registry CA bundle".into(),
            why,
        })?;
        let registry = Registry { ca_pem, http };
        registry.client()?;
        Ok(registry)
    }

    fn client(&self) -> Result<Client, FetchError> {
        let config = ClientConfig {
            extra_root_certificates: self
                .ca_pem
                .clone()
                .into_iter()
                .map(|data| Certificate {
                    encoding: CertificateEncoding::Pem,
                    data,
                })
                .collect(),
            // The index is selected here, by the documented rule.
            platform_resolver: None,
            connect_timeout: Some(std::time::Duration::from_secs(10)),
            read_timeout: Some(std::time::Duration::from_secs(60)),
            ..Default::default()
        };
        // Not Client::new: it logs a bad CA bundle and goes on without it.
        Client::try_from(config).map_err(|e| FetchError::BadReference {
            reference: "the registry CA bundle".into(),
            why: error_chain(&e),
        })
    }

    /// Logs in to `source`'s repository for the reads that follow.
    async fn session(&self, source: &Source, auth: &RegistryAuth) -> Result<Session, FetchError> {
        Session::open(self.http.clone(), &self.client()?, &source.reference, auth)
            .await
            .map_err(|e| read_error(source, auth, None, e))
    }

    /// Resolves `source` to its manifest's layers.
    pub async fn resolve(
        &self,
        source: &Source,
        auth: &RegistryAuth,
    ) -> Result<Resolved, FetchError> {
        let session = self.session(source, auth).await?;
        let (body, digest) = manifest(&session, source, &source.reference, auth).await?;
        let value = parse_manifest(source, &body)?;
        if is_index(&value) {
            let chosen = choose_from_index(source, &value)?;
            let by_digest = source.reference.clone_with_digest(chosen.clone());
            let (body, inner) = manifest(&session, source, &by_digest, auth).await?;
            let value = parse_manifest(source, &body)?;
            if is_index(&value) {
                return Err(FetchError::UnsupportedMediaType {
                    what: format!("{} (an index inside an index)", source.text),
                    media_type: media_type_of(&value),
                });
            }
            return Ok(Resolved {
                digest: inner,
                pinned: digest,
                layers: layers_of(source, &value)?,
            });
        }
        Ok(Resolved {
            layers: layers_of(source, &value)?,
            pinned: digest.clone(),
            digest,
        })
    }
}

/// Fetches the resolved artifact into `<cache>/<key>/`: each layer placed
/// from the blob store (downloaded into it first if it is not there),
/// within `declared` bytes (plus the http files' margin). Nothing is
/// visible under the key until every layer is placed.
#[allow(clippy::too_many_arguments)]
pub async fn fetch(
    registry: &Registry,
    auth: &RegistryAuth,
    cache: &Path,
    key: &str,
    source: &Source,
    resolved: &Resolved,
    layer_dir: &str,
    declared: u64,
    progress: &Progress,
) -> Result<Fetched, FetchError> {
    let store = Store::new(cache);
    store.create().map_err(io)?;
    // The view is links only: it is made afresh on every try (what a try
    // downloaded waits in the store's partial files).
    let view = cache.join(format!("{PARTIAL_PREFIX}{key}"));
    let _ = std::fs::remove_dir_all(&view);
    std::fs::create_dir_all(&view).map_err(io)?;
    let result = place_all(
        registry, auth, &store, &view, source, resolved, layer_dir, declared, progress,
    )
    .await;
    let result = match result {
        Ok(fetched) => {
            let record = ViewRecord {
                blobs: fetched.blobs.clone(),
                manifest: Some(resolved.pinned.clone()),
            };
            let target = cache.join(key);
            let placed = (|| {
                store.write_view(key, &record)?;
                if target.exists() {
                    std::fs::remove_dir_all(&target)?;
                }
                std::fs::rename(&view, &target)
            })();
            placed.map(|_| fetched).map_err(io)
        }
        Err(e) => Err(e),
    };
    if result.is_err() {
        let _ = std::fs::remove_dir_all(&view);
    }
    result
}

/// Every layer checked for what it is before anything is fetched.
fn check_layers(source: &Source, resolved: &Resolved) -> Result<(), FetchError> {
    for layer in &resolved.layers {
        if layer.title.is_none() && tar_compression(&layer.media_type).is_none() {
            return Err(FetchError::UnsupportedMediaType {
                what: format!("{} layer {}", source.text, layer.digest),
                media_type: layer.media_type.clone(),
            });
        }
        if let Some(title) = &layer.title
            && inside_path(title).is_none()
        {
            return Err(FetchError::InvalidLayer {
                layer: layer.digest.clone(),
                message: format!("its title {title:?} is not a relative path inside the artifact"),
            });
        }
    }
    Ok(())
}

/// Registry credentials from a `kubernetes.io/dockerconfigjson` Secret's
/// `.dockerconfigjson`: the entry for `registry` (keys may carry a scheme
/// or a path, as `docker login` writes them). `auth` (base64
/// `user:password`) or `username`/`password` are basic auth, which
/// oci-client also trades for a bearer token where the registry asks for
/// one; `registrytoken` is a bearer token as is.
pub fn credentials_for(config: &[u8], registry: &str) -> Result<RegistryAuth, String> {
    use base64::Engine;
    let value: serde_json::Value =
        serde_json::from_slice(config).map_err(|e| format!("not JSON: {e}"))?;
    let auths = value
        .get("auths")
        .and_then(|a| a.as_object())
        .ok_or("no \"auths\" object")?;
    let host_of = |k: &str| {
        let k = k
            .strip_prefix("https://")
            .or_else(|| k.strip_prefix("http://"))
            .unwrap_or(k);
        k.split('/').next().unwrap_or_default().to_ascii_lowercase()
    };
    let Some((_, entry)) = auths
        .iter()
        .find(|(k, _)| host_of(k) == registry.to_ascii_lowercase())
    else {
        return Ok(RegistryAuth::Anonymous);
    };
    let text = |k: &str| {
        entry
            .get(k)
            .and_then(|v| v.as_str())
            .filter(|s| !s.is_empty())
    };
    if let Some(token) = text("registrytoken") {
        return Ok(RegistryAuth::Bearer(token.to_owned()));
    }
    if let (Some(user), Some(password)) = (text("username"), text("password")) {
        return Ok(RegistryAuth::Basic(user.to_owned(), password.to_owned()));
    }
    if let Some(auth) = text("auth") {
        let decoded = base64::engine::general_purpose::STANDARD
            .decode(auth)
            .map_err(|e| format!("the auth of {registry} is not base64: {e}"))?;
        let decoded = String::from_utf8(decoded)
            .map_err(|_| format!("the auth of {registry} is not text"))?;
        let (user, password) = decoded
            .split_once(':')
            .ok_or_else(|| format!("the auth of {registry} is not user:password"))?;
        return Ok(RegistryAuth::Basic(user.to_owned(), password.to_owned()));
    }
    Err(format!(
        "the entry for {registry} has neither auth, username/password nor registrytoken"
    ))
}

#[cfg(test)]
mod tests;
