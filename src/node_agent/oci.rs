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
//!   directory. Every entry of a tar layer is checked before anything is
//!   written: no absolute paths, no `..`, no links out of the layer, no
//!   device files or fifos. Anything else is `UnsupportedMediaType`.
//! - **Verify and resume**: a blob streams into `.blobs/partial/<hex>`,
//!   hashed as it arrives, its descriptor's size a hard limit; a blob cut
//!   short resumes there with a Range request; a digest that does not
//!   match removes it.
//! - **Store once**: blobs and unpacked layers are kept in the node's blob
//!   store ([`super::blobs`]) and linked into the artifact's directory; a
//!   blob the store holds is linked, not fetched.

use super::blobs::{Store, ViewRecord, blob_id};
use super::distribution::{self, ReadError, Session};
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
    /// The file it is (ORAS), if annotated.
    pub title: Option<String>,
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
        let http = distribution::client(ca_pem.as_deref(), &allowed).map_err(|why| {
            FetchError::BadReference {
                reference: "the registry CA bundle".into(),
                why,
            }
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

/// The manifest `reference` names, at most [`MANIFEST_LIMIT`] bytes read,
/// and its digest, checked against the one the reference pins.
async fn manifest(
    session: &Session,
    source: &Source,
    reference: &Reference,
    auth: &RegistryAuth,
) -> Result<(bytes::Bytes, String), FetchError> {
    let name = reference
        .digest()
        .or(reference.tag())
        .unwrap_or("latest")
        .to_owned();
    let (body, digest) = session
        .manifest(&name, MANIFEST_TYPES, MANIFEST_LIMIT)
        .await
        .map_err(|e| match e {
            ReadError::TooLarge { bytes } => FetchError::ManifestTooLarge {
                reference: source.text.clone(),
                bytes,
                limit: MANIFEST_LIMIT,
            },
            other => read_error(source, auth, None, other),
        })?;
    if let Some(want) = reference.digest()
        && !want.eq_ignore_ascii_case(&digest)
    {
        return Err(FetchError::DigestMismatch {
            what: format!("{}'s manifest", source.text),
            want: want.to_owned(),
            got: digest,
        });
    }
    Ok((body, digest))
}

/// Downloads `layer` into the store's partial file and yields its path
/// once its digest is checked, resuming what an earlier try left.
async fn download(
    registry: &Registry,
    store: &Store,
    source: &Source,
    auth: &RegistryAuth,
    layer: &Layer,
    counter: &mut Budget<'_>,
) -> Result<(PathBuf, u64), FetchError> {
    let path = store.partial(layer.hex());
    let have = std::fs::metadata(&path).map_or(0, |m| m.len());
    let have = if have > layer.size {
        let _ = std::fs::remove_file(&path);
        0
    } else {
        have
    };
    let (answer, kept) = if have == layer.size && have > 0 {
        (None, have)
    } else {
        // Logged in for each blob: a bearer token may not outlive a
        // long layer before it.
        let session = registry.session(source, auth).await?;
        let (answer, partial) = session
            .blob(&layer.digest, have)
            .await
            .map_err(|e| read_error(source, auth, Some(&layer.digest), e))?;
        (Some(answer), if partial { have } else { 0 })
    };
    counter.add(kept)?;
    let (chunks, sink) = super::fetch::disk_writer(path.clone(), kept);
    let mut received = kept;
    let streamed = match answer {
        Some(answer) => stream_blob(answer, &chunks, source, layer, counter, &mut received).await,
        None => Ok(()),
    };
    drop(chunks);
    let written = sink.await.map_err(|e| FetchError::Io(e.to_string()))?;
    if let Err(e) = streamed {
        if !e.retryable() {
            let _ = std::fs::remove_file(&path);
        }
        return Err(e);
    }
    let digest = written.map_err(io)?;
    let checked = blob_is(
        layer,
        source,
        &super::fetch::encode_hex(digest.as_ref()),
        received,
    );
    if checked.is_err() {
        let _ = std::fs::remove_file(&path);
    }
    checked.map(|()| (path, kept))
}

/// The blob's bytes from `answer` into the disk writer's `chunks`, in
/// writes of [`super::fetch::WRITE_CHUNK`], never more than its
/// descriptor's size; `received` counts them.
async fn stream_blob(
    mut answer: reqwest::Response,
    chunks: &tokio::sync::mpsc::Sender<bytes::Bytes>,
    source: &Source,
    layer: &Layer,
    counter: &mut Budget<'_>,
    received: &mut u64,
) -> Result<(), FetchError> {
    let mut pending = bytes::BytesMut::new();
    loop {
        let chunk = answer.chunk().await.map_err(|e| FetchError::Registry {
            registry: source.registry().to_owned(),
            message: format!("reading blob {}: {}", layer.digest, error_chain(&e)),
        })?;
        let Some(chunk) = chunk else { break };
        *received += chunk.len() as u64;
        if *received > layer.size {
            return Err(FetchError::TooLarge {
                declared: layer.size,
                got: *received,
            });
        }
        counter.add(chunk.len() as u64)?;
        pending.extend_from_slice(&chunk);
        if pending.len() >= super::fetch::WRITE_CHUNK
            && chunks.send(pending.split().freeze()).await.is_err()
        {
            break;
        }
    }
    if !pending.is_empty() {
        let _ = chunks.send(pending.split().freeze()).await;
    }
    Ok(())
}

/// Whether the `received` bytes hashing to `got` are the layer's blob.
fn blob_is(layer: &Layer, source: &Source, got: &str, received: u64) -> Result<(), FetchError> {
    if got == layer.hex() && received != layer.size {
        // The bytes are the blob the digest names: the descriptor is wrong.
        return Err(FetchError::InvalidLayer {
            layer: layer.digest.clone(),
            message: format!(
                "the registry's blob is {received} bytes, but the manifest's descriptor says {}",
                layer.size
            ),
        });
    }
    if got != layer.hex() {
        return Err(FetchError::DigestMismatch {
            what: format!("{} blob", source.text),
            want: layer.digest.clone(),
            got: format!("sha256:{got} ({received} of {} bytes)", layer.size),
        });
    }
    Ok(())
}

fn parse_manifest(source: &Source, body: &[u8]) -> Result<serde_json::Value, FetchError> {
    serde_json::from_slice(body).map_err(|e| FetchError::UnsupportedMediaType {
        what: format!("{}'s manifest (not JSON: {e})", source.text),
        media_type: String::new(),
    })
}

fn media_type_of(v: &serde_json::Value) -> String {
    v.get("mediaType")
        .and_then(|m| m.as_str())
        .unwrap_or_default()
        .to_owned()
}

fn is_index(v: &serde_json::Value) -> bool {
    v.get("manifests").is_some_and(|m| m.is_array())
}

/// The index's manifest by the documented rule: the only one, else the
/// one for linux on this architecture.
fn choose_from_index(source: &Source, index: &serde_json::Value) -> Result<String, FetchError> {
    let entries = index["manifests"].as_array().cloned().unwrap_or_default();
    let digest = |e: &serde_json::Value| e["digest"].as_str().map(str::to_owned);
    if let [only] = entries.as_slice() {
        return digest(only)
            .ok_or_else(|| invalid_manifest(source, "an index entry has no digest"));
    }
    let arch = match std::env::consts::ARCH {
        "x86_64" => "amd64",
        "aarch64" => "arm64",
        other => other,
    };
    let matching: Vec<&serde_json::Value> = entries
        .iter()
        .filter(|e| e["platform"]["os"] == "linux" && e["platform"]["architecture"] == arch)
        .collect();
    match matching.as_slice() {
        [one] => {
            digest(one).ok_or_else(|| invalid_manifest(source, "an index entry has no digest"))
        }
        _ => Err(invalid_manifest(
            source,
            &format!(
                "its index lists {} manifests and {} for linux/{arch}: say which by digest",
                entries.len(),
                matching.len()
            ),
        )),
    }
}

fn invalid_manifest(source: &Source, message: &str) -> FetchError {
    FetchError::InvalidLayer {
        layer: source.text.clone(),
        message: message.to_owned(),
    }
}

fn layers_of(source: &Source, manifest: &serde_json::Value) -> Result<Vec<Layer>, FetchError> {
    let list = manifest
        .get("layers")
        .or_else(|| manifest.get("blobs"))
        .and_then(|l| l.as_array())
        .ok_or_else(|| FetchError::UnsupportedMediaType {
            what: format!("{}'s manifest (it has no layers)", source.text),
            media_type: media_type_of(manifest),
        })?;
    list.iter()
        .map(|l| {
            let digest = l["digest"].as_str().unwrap_or_default().to_owned();
            let hex = digest.strip_prefix("sha256:").unwrap_or_default();
            if hex.len() != 64 || !hex.bytes().all(|b| b.is_ascii_hexdigit()) {
                return Err(invalid_manifest(
                    source,
                    &format!("layer digest {digest:?} is not sha256:<64 hex digits>"),
                ));
            }
            let size = l["size"]
                .as_u64()
                .ok_or_else(|| invalid_manifest(source, &format!("layer {digest} has no size")))?;
            Ok(Layer {
                digest: digest.to_ascii_lowercase(),
                size,
                media_type: l["mediaType"].as_str().unwrap_or_default().to_owned(),
                title: l["annotations"][TITLE].as_str().map(str::to_owned),
            })
        })
        .collect()
}

/// How a tar layer is compressed, by its media type; `None`: not a tar.
fn tar_compression(media_type: &str) -> Option<&'static str> {
    let m = media_type.to_ascii_lowercase();
    if !m.contains("tar") {
        return None;
    }
    Some(if m.ends_with("gzip") {
        "gzip"
    } else if m.ends_with("zstd") {
        "zstd"
    } else {
        "none"
    })
}

/// Maps a read's errors to the artifact's reasons.
fn read_error(
    source: &Source,
    auth: &RegistryAuth,
    blob: Option<&str>,
    e: ReadError,
) -> FetchError {
    match e {
        ReadError::Registry(e) => registry_error(source, auth, blob, e),
        ReadError::Redirect { uri, why } => FetchError::Redirect { uri, why },
        ReadError::TooLarge { bytes } => FetchError::Registry {
            registry: source.registry().to_owned(),
            message: format!("an answer of more than {bytes} bytes where a small one was due"),
        },
        ReadError::Transfer(message) => FetchError::Registry {
            registry: source.registry().to_owned(),
            message,
        },
    }
}

/// Maps the client's errors to the artifact's reasons.
fn registry_error(
    source: &Source,
    auth: &RegistryAuth,
    blob: Option<&str>,
    e: OciDistributionError,
) -> FetchError {
    let registry = source.registry().to_owned();
    let unknown = |codes: &[OciErrorCode], envelope: &oci_client::errors::OciEnvelope| {
        envelope.errors.iter().any(|x| codes.contains(&x.code))
    };
    let not_found = || match blob {
        Some(digest) => FetchError::BlobNotFound {
            reference: source.text.clone(),
            digest: digest.to_owned(),
        },
        None => FetchError::ManifestNotFound {
            reference: source.text.clone(),
        },
    };
    let auth_failed = || {
        FetchError::RegistryAuth {
        registry: registry.clone(),
        message: match auth {
            RegistryAuth::Anonymous => {
                "the registry wants credentials and the agent has none for it (its --registry-credentials Secret)".to_owned()
            }
            _ => "the registry refused the credentials of the agent's --registry-credentials Secret".to_owned(),
        },
    }
    };
    match e {
        OciDistributionError::UnauthorizedError { .. }
        | OciDistributionError::AuthenticationFailure(_) => auth_failed(),
        OciDistributionError::RegistryError { envelope, .. } => {
            if unknown(
                &[OciErrorCode::Unauthorized, OciErrorCode::Denied],
                &envelope,
            ) {
                auth_failed()
            } else if unknown(
                &[
                    OciErrorCode::ManifestUnknown,
                    OciErrorCode::BlobUnknown,
                    OciErrorCode::NameUnknown,
                    OciErrorCode::NotFound,
                ],
                &envelope,
            ) {
                not_found()
            } else {
                FetchError::Registry {
                    registry,
                    message: envelope.to_string(),
                }
            }
        }
        OciDistributionError::ServerError { code: 404, .. }
        | OciDistributionError::ImageManifestNotFoundError(_) => not_found(),
        OciDistributionError::ServerError {
            code: 401 | 403, ..
        } => auth_failed(),
        OciDistributionError::DigestError(d) => FetchError::DigestMismatch {
            what: format!("{}'s manifest", source.text),
            want: source.digest().unwrap_or_default().to_owned(),
            got: d.to_string(),
        },
        OciDistributionError::UnsupportedMediaTypeError(m) => FetchError::UnsupportedMediaType {
            what: source.text.clone(),
            media_type: m,
        },
        other => FetchError::Registry {
            registry,
            message: error_chain(&other),
        },
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

/// One artifact's layers being placed into its view, and what that took.
struct Placing<'a> {
    registry: &'a Registry,
    auth: &'a RegistryAuth,
    store: &'a Store,
    view: &'a Path,
    source: &'a Source,
    counter: Budget<'a>,
    resumed: u64,
    shared: u64,
}

impl Placing<'_> {
    /// The layer's blob in the store, downloaded if it is not there yet,
    /// as a partial file; `kept`: the bytes an earlier try left.
    async fn download(&mut self, layer: &Layer) -> Result<PathBuf, FetchError> {
        let (registry, store, source, auth) = (self.registry, self.store, self.source, self.auth);
        let (partial, kept) =
            download(registry, store, source, auth, layer, &mut self.counter).await?;
        self.resumed += kept;
        Ok(partial)
    }

    /// A titled layer: that file, linked from the store if it holds it.
    async fn titled(&mut self, layer: &Layer, title: &str) -> Result<u64, FetchError> {
        let hex = layer.hex();
        let rel = inside_path(title).unwrap_or_default();
        let path = place_in(self.view, &rel, &layer.digest)?;
        if let Some(size) = self.store.link(hex, &path).map_err(io)? {
            self.counter.add(size)?;
            self.shared += size;
            return Ok(size);
        }
        let partial = self.download(layer).await?;
        std::fs::rename(&partial, &path).map_err(io)?;
        self.store.adopt(&path, hex).map_err(io)
    }

    /// A tar layer: unpacked into the store once, its `layer_dir` linked
    /// into the view. Its bytes, and whether it had that directory.
    async fn tar(&mut self, layer: &Layer, layer_dir: &str) -> Result<(u64, bool), FetchError> {
        let hex = layer.hex();
        let unpacked = self.store.layer(hex);
        let bytes = if unpacked.is_dir() {
            let bytes = super::blobs::unique_usage(&unpacked).map_err(io)?;
            self.counter.add(bytes)?;
            self.shared += bytes;
            bytes
        } else {
            let partial = self.download(layer).await?;
            let room = self.counter.limit.saturating_sub(self.counter.total);
            let compression = tar_compression(&layer.media_type).unwrap_or("none");
            let (from, to, digest) = (partial.clone(), unpacked.clone(), layer.digest.clone());
            let unpacked_bytes = tokio::task::spawn_blocking(move || {
                unpack_layer(&from, &to, compression, room, &digest)
            })
            .await
            .map_err(|e| FetchError::Io(e.to_string()))?;
            let _ = std::fs::remove_file(&partial);
            let bytes = unpacked_bytes?;
            // The download was counted compressed; the layer holds its
            // unpacked bytes.
            self.counter.total = self.counter.total.saturating_sub(layer.size);
            self.counter.add(bytes)?;
            bytes
        };
        let found = self
            .store
            .link_layer(hex, layer_dir, self.view)
            .map_err(|e| confined(e, &layer.digest))?;
        Ok((bytes, found))
    }
}

#[allow(clippy::too_many_arguments)]
async fn place_all(
    registry: &Registry,
    auth: &RegistryAuth,
    store: &Store,
    view: &Path,
    source: &Source,
    resolved: &Resolved,
    layer_dir: &str,
    declared: u64,
    progress: &Progress,
) -> Result<Fetched, FetchError> {
    check_layers(source, resolved)?;
    let mut placing = Placing {
        registry,
        auth,
        store,
        view,
        source,
        counter: Budget::new(declared, progress),
        resumed: 0,
        shared: 0,
    };
    let mut blobs: Vec<Blob> = Vec::new();
    let (mut any_tar, mut found_dir) = (false, false);
    for layer in &resolved.layers {
        let size = match &layer.title {
            Some(title) => placing.titled(layer, title).await?,
            None => {
                any_tar = true;
                let (bytes, found) = placing.tar(layer, layer_dir).await?;
                found_dir |= found;
                bytes
            }
        };
        let id = blob_id(layer.hex());
        if !blobs.iter().any(|(b, _)| *b == id) {
            blobs.push((id, size));
        }
    }
    // Judged on the whole view, every layer in place: links from two
    // layers may lead out together where neither does alone.
    if let Some((at, why)) = super::confine::escaping_link(view).map_err(io)? {
        return Err(FetchError::InvalidLayer {
            layer: source.text.clone(),
            message: format!(
                "{:?} {why}: a link may not lead outside the model's directory",
                at.display()
            ),
        });
    }
    if any_tar && !found_dir {
        return Err(FetchError::InvalidLayer {
            layer: source.text.clone(),
            message: format!("no layer has the directory /{layer_dir} (artifact.path)"),
        });
    }
    Ok(Fetched {
        bytes: placing.counter.total,
        resumed: placing.resumed,
        shared: placing.shared,
        blobs,
        sha256: resolved.digest.trim_start_matches("sha256:").to_owned(),
    })
}

/// An artifact's refusal by the confinement ([`super::confine`]) is
/// `InvalidArtifact` on `layer`; any other error is the disk's.
fn confined(e: std::io::Error, layer: &str) -> FetchError {
    match e.kind() {
        std::io::ErrorKind::InvalidInput => FetchError::InvalidLayer {
            layer: layer.to_owned(),
            message: e.to_string(),
        },
        _ => io(e),
    }
}

/// Where a titled layer's file goes in the view: its directories made
/// through real directories only; a directory already at its place (a
/// tar layer's) is a clash in the artifact, not a disk error.
fn place_in(view: &Path, rel: &Path, layer: &str) -> Result<PathBuf, FetchError> {
    let path = super::confine::dirs_to(view, rel).map_err(|e| confined(e, layer))?;
    if path.symlink_metadata().is_ok_and(|m| m.is_dir()) {
        return Err(FetchError::InvalidLayer {
            layer: layer.to_owned(),
            message: format!(
                "its file {:?} would replace a directory of the artifact",
                rel.display()
            ),
        });
    }
    Ok(path)
}

/// A tar layer's reader, decompressed.
fn tar_reader(path: &Path, compression: &str) -> std::io::Result<Box<dyn std::io::Read>> {
    let file = std::io::BufReader::new(std::fs::File::open(path)?);
    Ok(match compression {
        "gzip" => Box::new(flate2::read::GzDecoder::new(file)),
        "zstd" => Box::new(
            ruzstd::decoding::StreamingDecoder::new(file)
                .map_err(|e| std::io::Error::new(std::io::ErrorKind::InvalidData, e.to_string()))?,
        ),
        _ => Box::new(file),
    })
}

/// The most entries one tar layer may hold: a model's directory has tens
/// of files, and every entry costs an inode whatever its size (a layer of
/// 40,000 one-byte files took 120,000 inodes of a small cache).
pub const MAX_LAYER_ENTRIES: u64 = 10_000;

/// Checks every entry of the tar layer at `from`, then unpacks it into
/// `to` (through a temporary directory beside it, renamed into place), at
/// most `room` bytes of files. Yields the bytes unpacked.
///
/// The size that counts is what is written, not what a header says (a
/// PAX `size` record overrides the ustar header's); nothing is written
/// through a symlink; and once every entry is in place, a symlink that
/// leads out of the layer (a chain of links each inside on its own)
/// refuses the layer before it reaches the store.
pub fn unpack_layer(
    from: &Path,
    to: &Path,
    compression: &str,
    room: u64,
    digest: &str,
) -> Result<u64, FetchError> {
    let refuse = |message: String| FetchError::InvalidLayer {
        layer: digest.to_owned(),
        message,
    };
    let unreadable = |e: std::io::Error| refuse(format!("not a readable tar: {e}"));
    // First pass: nothing is written until every entry passed.
    let (mut total, mut count) = (0u64, 0u64);
    let mut archive = tar::Archive::new(tar_reader(from, compression).map_err(unreadable)?);
    for entry in archive.entries().map_err(unreadable)? {
        let entry = entry.map_err(unreadable)?;
        check_entry(&entry).map_err(&refuse)?;
        count += 1;
        if count > MAX_LAYER_ENTRIES {
            return Err(refuse(format!(
                "it has more than {MAX_LAYER_ENTRIES} entries"
            )));
        }
        // The size the reader will use (a PAX record's, if any), as the
        // disk holds it.
        total = total.saturating_add(on_disk(&entry));
        if total > room {
            return Err(FetchError::LayersTooLarge {
                declared: room,
                claimed: total,
            });
        }
    }
    let tmp = to.with_file_name(format!(
        ".tmp-{}",
        to.file_name().and_then(|n| n.to_str()).unwrap_or("layer")
    ));
    let _ = std::fs::remove_dir_all(&tmp);
    std::fs::create_dir_all(&tmp).map_err(io)?;
    let unpacked = (|| -> Result<(), FetchError> {
        let mut archive = tar::Archive::new(tar_reader(from, compression).map_err(unreadable)?);
        let mut written = 0u64;
        for entry in archive.entries().map_err(unreadable)? {
            let mut entry = entry.map_err(unreadable)?;
            place_entry(&mut entry, &tmp, room, &mut written, &refuse)?;
        }
        if let Some((at, why)) = super::confine::escaping_link(&tmp).map_err(io)? {
            return Err(refuse(format!(
                "entry {:?} {why}: a link may not lead outside the layer",
                at.display()
            )));
        }
        read_only_tree(&tmp).map_err(io)?;
        if to.exists() {
            std::fs::remove_dir_all(to).map_err(io)?;
        }
        std::fs::rename(&tmp, to).map_err(io)
    })();
    if unpacked.is_err() {
        let _ = std::fs::remove_dir_all(&tmp);
    }
    unpacked?;
    super::blobs::unique_usage(to).map_err(io)
}

/// Writes one checked tar entry under `root`: through real directories
/// only, a file opened with `O_NOFOLLOW` and cut off once `written`
/// reaches `room`. A later entry replaces an earlier file or link (tar's
/// rule), never a directory.
fn place_entry<R: std::io::Read>(
    entry: &mut tar::Entry<'_, R>,
    root: &Path,
    room: u64,
    written: &mut u64,
    refuse: &dyn Fn(String) -> FetchError,
) -> Result<(), FetchError> {
    use std::os::unix::fs::OpenOptionsExt;
    use tar::EntryType;
    let path = entry
        .path()
        .map_err(|e| refuse(format!("an unreadable path: {e}")))?
        .into_owned();
    let shown = path.display().to_string();
    let rel = super::confine::normal(&path)
        .ok_or_else(|| refuse(format!("entry {shown:?} leaves the layer")))?;
    if rel.as_os_str().is_empty() {
        return Ok(()); // "./": the layer's own directory
    }
    // A refusal of the confinement is the artifact's fault; anything else
    // is the disk's.
    let placed = |e: std::io::Error| match confined(e, "") {
        FetchError::InvalidLayer { message, .. } => refuse(format!("entry {shown:?}: {message}")),
        other => other,
    };
    let dst = super::confine::dirs_to(root, &rel).map_err(placed)?;
    let existing = dst.symlink_metadata().ok();
    let kind = entry.header().entry_type();
    if kind == EntryType::Directory {
        return match existing {
            Some(m) if m.is_dir() => Ok(()),
            Some(_) => Err(refuse(format!(
                "entry {shown:?} is a directory where the layer has a file or a link"
            ))),
            None => {
                *written += BLOCK;
                std::fs::create_dir(&dst).map_err(io)
            }
        };
    }
    match existing {
        Some(m) if m.is_dir() => {
            return Err(refuse(format!(
                "entry {shown:?} would replace a directory of the layer"
            )));
        }
        Some(_) => std::fs::remove_file(&dst).map_err(io)?,
        None => {}
    }
    let link_name = |entry: &tar::Entry<'_, R>| {
        entry
            .link_name()
            .ok()
            .flatten()
            .map(|l| l.into_owned())
            .ok_or_else(|| refuse(format!("entry {shown:?} is a link to nothing")))
    };
    match kind {
        EntryType::Symlink => std::os::unix::fs::symlink(link_name(entry)?, &dst).map_err(io),
        EntryType::Link => {
            let source = super::confine::existing_file(root, &link_name(entry)?).map_err(placed)?;
            std::fs::hard_link(source, &dst).map_err(io)
        }
        _ => {
            let mut file = std::fs::OpenOptions::new()
                .write(true)
                .create_new(true)
                .custom_flags(libc::O_NOFOLLOW)
                .open(&dst)
                .map_err(io)?;
            let left = room.saturating_sub(*written);
            let mut limited = std::io::Read::take(&mut *entry, left.saturating_add(1));
            let n = std::io::copy(&mut limited, &mut file).map_err(io)?;
            *written += n.div_ceil(BLOCK) * BLOCK;
            if n > left {
                return Err(FetchError::TooLarge {
                    declared: room,
                    got: *written,
                });
            }
            Ok(())
        }
    }
}

/// The disk's allocation unit: what an entry holds is counted in whole
/// blocks (a layer of 40,000 one-byte files and 20,000 empty directories,
/// declared 10Mi, took 331 MB of a 300Mi cache counted by file bytes).
const BLOCK: u64 = 4096;

/// What a checked entry will hold on the disk: a file its size in whole
/// blocks, a directory a block, a link nothing beside its inode.
fn on_disk<R: std::io::Read>(entry: &tar::Entry<'_, R>) -> u64 {
    match entry.header().entry_type() {
        tar::EntryType::Directory => BLOCK,
        tar::EntryType::Regular | tar::EntryType::Continuous => {
            entry.size().div_ceil(BLOCK) * BLOCK
        }
        _ => 0,
    }
}

/// Why a tar entry may not be unpacked, if it may not.
fn check_entry<R: std::io::Read>(entry: &tar::Entry<'_, R>) -> Result<(), String> {
    use tar::EntryType;
    let path = entry
        .path()
        .map_err(|e| format!("an unreadable path: {e}"))?;
    let shown = path.display().to_string();
    let normal = |p: &Path| {
        p.components().all(|c| {
            matches!(
                c,
                std::path::Component::Normal(_) | std::path::Component::CurDir
            )
        })
    };
    if path.is_absolute() || !normal(&path) {
        return Err(format!(
            "entry {shown:?} is absolute or has '..': it would be written outside the model's directory"
        ));
    }
    let kind = entry.header().entry_type();
    match kind {
        EntryType::Regular | EntryType::Directory | EntryType::Continuous => Ok(()),
        EntryType::Symlink | EntryType::Link => {
            let target = entry
                .link_name()
                .map_err(|e| format!("entry {shown:?}: an unreadable link target: {e}"))?
                .ok_or_else(|| format!("entry {shown:?} is a link to nothing"))?;
            // A hard link names a path in the layer; a symlink is relative
            // to its own directory.
            let base = match kind {
                EntryType::Link => PathBuf::new(),
                _ => path.parent().map(Path::to_path_buf).unwrap_or_default(),
            };
            if target.is_absolute() || escapes(&base.join(&target)) {
                return Err(format!(
                    "entry {shown:?} links to {:?}, outside the artifact",
                    target.display()
                ));
            }
            Ok(())
        }
        EntryType::Char | EntryType::Block => Err(format!(
            "entry {shown:?} is a device file, which a model's directory may not hold"
        )),
        EntryType::Fifo => Err(format!("entry {shown:?} is a fifo")),
        other => Err(format!(
            "entry {shown:?} is of a kind not handled ({other:?})"
        )),
    }
}

/// Whether `path`, resolved lexically, climbs above its root.
fn escapes(path: &Path) -> bool {
    let mut depth: i64 = 0;
    for c in path.components() {
        match c {
            std::path::Component::ParentDir => depth -= 1,
            std::path::Component::Normal(_) => depth += 1,
            std::path::Component::CurDir => {}
            _ => return true,
        }
        if depth < 0 {
            return true;
        }
    }
    false
}

fn read_only_tree(dir: &Path) -> std::io::Result<()> {
    for entry in std::fs::read_dir(dir)? {
        let entry = entry?;
        let meta = entry.path().symlink_metadata()?;
        if meta.is_dir() {
            read_only_tree(&entry.path())?;
        } else if meta.is_file() {
            let mut perms = meta.permissions();
            perms.set_readonly(true);
            std::fs::set_permissions(entry.path(), perms)?;
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
mod tests {
    use super::*;

    #[test]
    fn references_are_parsed_and_admitted_by_registry_and_repository_prefix() {
        let s = Source::parse("oci://reg.example:5000/models/llama@sha256:0000000000000000000000000000000000000000000000000000000000000000").unwrap();
        assert_eq!(s.registry(), "reg.example:5000");
        assert!(s.digest().is_some());
        assert!(s.is_allowed(&["oci://reg.example:5000/models".into()]));
        assert!(s.is_allowed(&["oci://reg.example:5000/".into()]));
        assert!(
            !s.is_allowed(&["oci://reg.example:5000/mod".into()]),
            "segment boundary"
        );
        assert!(
            !s.is_allowed(&["oci://reg.example/models".into()]),
            "other port"
        );
        assert!(
            !s.is_allowed(&["https://reg.example:5000/".into()]),
            "not an oci prefix"
        );
        let t = Source::parse("oci://reg.example/models/llama:v1").unwrap();
        assert_eq!(t.digest(), None);
        // An IPv6 registry, bracketed as in a URL.
        let v6 = Source::parse("oci://[::1]:5000/models/llama:v1").unwrap();
        assert_eq!(v6.registry(), "[::1]:5000");
        assert_eq!(v6.reference.repository(), "models/llama");
        assert_eq!(v6.reference.tag(), Some("v1"));
        assert!(v6.is_allowed(&["oci://[::1]:5000/models".into()]));
        for bad in [
            "https://x/y",
            "oci://models/llama",
            "oci://reg.example",
            "oci://reg.example/UPPER",
            "oci://[::1:5000/models/x",
            "oci://[::zz]:5000/models/x",
            "oci://[::1]x/models/x",
        ] {
            assert!(Source::parse(bad).is_err(), "{bad}");
        }
    }

    #[test]
    fn the_clients_errors_become_the_artifacts_reasons() {
        let s = Source::parse("oci://reg.example/models/a:v1").unwrap();
        let basic = RegistryAuth::Basic("u".into(), "p".into());
        let url = || "https://reg.example/v2/models/a/manifests/v1".to_owned();
        let envelope = |code: &str| -> oci_client::errors::OciEnvelope {
            serde_json::from_value(serde_json::json!({"errors": [{"code": code, "message": "m"}]}))
                .unwrap()
        };
        let cases: Vec<(OciDistributionError, Option<&str>, &RegistryAuth, &str)> = vec![
            (
                OciDistributionError::UnauthorizedError { url: url() },
                None,
                &RegistryAuth::Anonymous,
                "RegistryAuthFailed",
            ),
            (
                OciDistributionError::RegistryError {
                    envelope: envelope("DENIED"),
                    url: url(),
                },
                None,
                &basic,
                "RegistryAuthFailed",
            ),
            (
                OciDistributionError::RegistryError {
                    envelope: envelope("MANIFEST_UNKNOWN"),
                    url: url(),
                },
                None,
                &basic,
                "ManifestNotFound",
            ),
            (
                OciDistributionError::RegistryError {
                    envelope: envelope("BLOB_UNKNOWN"),
                    url: url(),
                },
                Some("sha256:ab"),
                &basic,
                "BlobNotFound",
            ),
            (
                OciDistributionError::ServerError {
                    code: 404,
                    url: url(),
                    message: String::new(),
                },
                Some("sha256:ab"),
                &basic,
                "BlobNotFound",
            ),
            (
                OciDistributionError::ServerError {
                    code: 503,
                    url: url(),
                    message: String::new(),
                },
                None,
                &basic,
                "RegistryUnavailable",
            ),
            (
                OciDistributionError::UnsupportedMediaTypeError("x/y".into()),
                None,
                &basic,
                "UnsupportedMediaType",
            ),
        ];
        for (e, blob, auth, want) in cases {
            let text = e.to_string();
            let got = registry_error(&s, auth, blob, e);
            assert_eq!(got.reason(), want, "{text}: {got}");
        }
        let anonymous = registry_error(
            &s,
            &RegistryAuth::Anonymous,
            None,
            OciDistributionError::UnauthorizedError { url: url() },
        );
        assert!(anonymous.to_string().contains("has none"), "{anonymous}");
        assert!(
            registry_error(
                &s,
                &basic,
                None,
                OciDistributionError::ServerError {
                    code: 503,
                    url: url(),
                    message: String::new()
                }
            )
            .retryable()
        );
    }

    #[test]
    fn an_index_gives_its_only_entry_or_linux_on_this_architecture() {
        let s = Source::parse("oci://reg.example/models/a:v1").unwrap();
        let d = |n: u8| format!("sha256:{}", format!("{n:02x}").repeat(32));
        let arch = match std::env::consts::ARCH {
            "x86_64" => "amd64",
            "aarch64" => "arm64",
            other => other,
        };
        let one = serde_json::json!({"manifests": [{"digest": d(1)}]});
        assert_eq!(choose_from_index(&s, &one).unwrap(), d(1));
        let many = serde_json::json!({"manifests": [
            {"digest": d(1), "platform": {"os": "linux", "architecture": "s390x"}},
            {"digest": d(2), "platform": {"os": "linux", "architecture": arch}},
            {"digest": d(3), "platform": {"os": "windows", "architecture": arch}},
        ]});
        assert_eq!(choose_from_index(&s, &many).unwrap(), d(2));
        let ambiguous = serde_json::json!({"manifests": [{"digest": d(1)}, {"digest": d(2)}]});
        assert_eq!(
            choose_from_index(&s, &ambiguous).unwrap_err().reason(),
            "InvalidArtifact"
        );
    }

    #[test]
    fn credentials_come_from_the_entry_for_the_registry() {
        let config = br#"{"auths": {
            "https://reg.example:5000/v1/": {"auth": "dXNlcjpwYXNz"},
            "tok.example": {"registrytoken": "abc"},
            "plain.example": {"username": "u", "password": "p"},
            "broken.example": {"auth": "%%%"}}}"#;
        assert_eq!(
            credentials_for(config, "reg.example:5000").unwrap(),
            RegistryAuth::Basic("user".into(), "pass".into())
        );
        assert_eq!(
            credentials_for(config, "tok.example").unwrap(),
            RegistryAuth::Bearer("abc".into())
        );
        assert_eq!(
            credentials_for(config, "plain.example").unwrap(),
            RegistryAuth::Basic("u".into(), "p".into())
        );
        assert_eq!(
            credentials_for(config, "other.example").unwrap(),
            RegistryAuth::Anonymous
        );
        assert!(credentials_for(config, "broken.example").is_err());
        assert!(credentials_for(b"[]", "x").is_err());
    }

    fn tar_with(build: impl FnOnce(&mut tar::Builder<Vec<u8>>)) -> Vec<u8> {
        let mut b = tar::Builder::new(Vec::new());
        build(&mut b);
        b.into_inner().unwrap()
    }

    fn header(path: &str, kind: tar::EntryType, size: u64) -> tar::Header {
        let mut h = tar::Header::new_gnu();
        // set_path refuses '..' and absolute paths: the name is written raw.
        let name = &mut h.as_gnu_mut().unwrap().name;
        name[..path.len()].copy_from_slice(path.as_bytes());
        h.set_entry_type(kind);
        h.set_size(size);
        h.set_mode(0o644);
        h.set_cksum();
        h
    }

    #[test]
    fn a_tar_layer_with_a_path_out_a_link_out_or_a_device_is_refused_before_anything_is_written() {
        let dir = tempfile::tempdir().unwrap();
        let cases: Vec<(&str, Vec<u8>)> = vec![
            (
                "dotdot",
                tar_with(|b| {
                    b.append(
                        &header("models/../../etc/passwd", tar::EntryType::Regular, 1),
                        &b"x"[..],
                    )
                    .unwrap();
                }),
            ),
            (
                "absolute",
                tar_with(|b| {
                    b.append(
                        &header("/etc/passwd", tar::EntryType::Regular, 1),
                        &b"x"[..],
                    )
                    .unwrap();
                }),
            ),
            (
                "symlink out",
                tar_with(|b| {
                    let mut h = header("models/evil", tar::EntryType::Symlink, 0);
                    h.set_link_name("../../../etc/shadow").unwrap();
                    h.set_cksum();
                    b.append(&h, std::io::empty()).unwrap();
                }),
            ),
            (
                "device",
                tar_with(|b| {
                    b.append(
                        &header("models/sda", tar::EntryType::Block, 0),
                        std::io::empty(),
                    )
                    .unwrap();
                }),
            ),
        ];
        for (name, bytes) in cases {
            let from = dir.path().join(format!("{name}.tar"));
            // A good file first: the refusal must come before it is written.
            let mut all = tar_with(|b| {
                b.append(
                    &header("models/ok.txt", tar::EntryType::Regular, 2),
                    &b"ok"[..],
                )
                .unwrap();
            });
            all.truncate(all.len() - 1024); // drop the end-of-archive blocks
            all.extend(bytes);
            std::fs::write(&from, all).unwrap();
            let to = dir.path().join(format!("out-{name}"));
            let err = unpack_layer(&from, &to, "none", 1 << 20, "sha256:test").unwrap_err();
            assert_eq!(err.reason(), "InvalidArtifact", "{name}: {err}");
            assert!(!to.exists(), "{name}: nothing written");
            let leftovers: Vec<_> = std::fs::read_dir(dir.path())
                .unwrap()
                .filter_map(|e| e.ok())
                .filter(|e| e.file_name().to_string_lossy().starts_with(".tmp"))
                .collect();
            assert!(leftovers.is_empty(), "{name}");
        }
        // A link that stays inside, and a gzip layer, unpack.
        let good = tar_with(|b| {
            b.append(
                &header("models/w.bin", tar::EntryType::Regular, 3),
                &b"abc"[..],
            )
            .unwrap();
            let mut h = header("models/alias", tar::EntryType::Symlink, 0);
            h.set_link_name("w.bin").unwrap();
            h.set_cksum();
            b.append(&h, std::io::empty()).unwrap();
        });
        let mut gz = flate2::write::GzEncoder::new(Vec::new(), flate2::Compression::fast());
        std::io::Write::write_all(&mut gz, &good).unwrap();
        let from = dir.path().join("good.tar.gz");
        std::fs::write(&from, gz.finish().unwrap()).unwrap();
        let to = dir.path().join("good");
        assert_eq!(unpack_layer(&from, &to, "gzip", 1 << 20, "d").unwrap(), 3);
        assert_eq!(std::fs::read(to.join("models/alias")).unwrap(), b"abc");
        // Larger than the room left: refused.
        let err = unpack_layer(&from, &dir.path().join("small"), "gzip", 2, "d").unwrap_err();
        assert_eq!(err.reason(), "LargerThanDeclared");
    }

    fn symlink(path: &str, target: &str) -> tar::Header {
        let mut h = header(path, tar::EntryType::Symlink, 0);
        h.set_link_name(target).unwrap();
        h.set_cksum();
        h
    }

    fn leftovers(dir: &Path) -> Vec<String> {
        std::fs::read_dir(dir)
            .unwrap()
            .filter_map(|e| e.ok())
            .map(|e| e.file_name().to_string_lossy().into_owned())
            .filter(|n| n.starts_with(".tmp"))
            .collect()
    }

    /// Writes `layer` as `<name>.tar` in `dir` and unpacks it into
    /// `out-<name>` with `room`; where it went, and what came of it.
    fn unpack_in(
        dir: &Path,
        name: &str,
        layer: Vec<u8>,
        room: u64,
    ) -> (PathBuf, Result<u64, FetchError>) {
        let from = dir.join(format!("{name}.tar"));
        std::fs::write(&from, layer).unwrap();
        let to = dir.join(format!("out-{name}"));
        let result = unpack_layer(&from, &to, "none", room, "sha256:t");
        (to, result)
    }

    #[test]
    fn links_are_judged_where_they_really_lead_and_nothing_is_written_through_one() {
        let dir = tempfile::tempdir().unwrap();
        let outside = dir.path().join("outside");
        std::fs::create_dir(&outside).unwrap();
        let cases: Vec<(&str, Vec<u8>, &str)> = vec![
            (
                // s is models/, so t's ../../.. is above the layer: each
                // link is inside when read on its own.
                "chain",
                tar_with(|b| {
                    let e = std::io::empty;
                    b.append(&symlink("models/d/d/d/s", "../../.."), e())
                        .unwrap();
                    b.append(&symlink("models/t", "d/d/d/s/../../.."), e())
                        .unwrap();
                }),
                "climbs above",
            ),
            (
                // The black-box round's chain: a file placed through s.
                "through a link",
                tar_with(|b| {
                    b.append(&symlink("models/d/d/d/s", "../../.."), std::io::empty())
                        .unwrap();
                    b.append(
                        &header("models/d/d/d/s/t/escaped.bin", tar::EntryType::Regular, 1),
                        &b"x"[..],
                    )
                    .unwrap();
                }),
                "placed through",
            ),
            (
                "hard link through a link",
                tar_with(|b| {
                    b.append(&header("w/f.bin", tar::EntryType::Regular, 1), &b"x"[..])
                        .unwrap();
                    b.append(&symlink("models/up", ".."), std::io::empty())
                        .unwrap();
                    let mut h = header("models/h", tar::EntryType::Link, 0);
                    h.set_link_name("models/up/w/f.bin").unwrap();
                    h.set_cksum();
                    b.append(&h, std::io::empty()).unwrap();
                }),
                "is placed through \"models/up\"",
            ),
        ];
        for (name, bytes, says) in cases {
            let (to, result) = unpack_in(dir.path(), name, bytes, 1 << 20);
            let err = result.unwrap_err();
            assert_eq!(err.reason(), "InvalidArtifact", "{name}: {err}");
            assert!(err.to_string().contains(says), "{name}: {err}");
            assert!(!to.exists(), "{name}");
            assert!(leftovers(dir.path()).is_empty(), "{name}");
        }
        assert!(
            !dir.path().join("t").exists() && !dir.path().join("escaped.bin").exists(),
            "nothing written outside"
        );
    }

    #[test]
    fn tiny_files_and_empty_directories_count_as_the_blocks_they_take() {
        // 300 one-byte files and 300 empty directories: 600 bytes of
        // files, 2.4 MB of blocks.
        let layer = tar_with(|b| {
            for i in 0..300 {
                b.append(
                    &header(&format!("models/f{i}"), tar::EntryType::Regular, 1),
                    &b"x"[..],
                )
                .unwrap();
                b.append(
                    &header(&format!("models/d{i}/"), tar::EntryType::Directory, 0),
                    std::io::empty(),
                )
                .unwrap();
            }
        });
        let dir = tempfile::tempdir().unwrap();
        let (to, result) = unpack_in(dir.path(), "tiny", layer.clone(), 1 << 20);
        let err = result.unwrap_err();
        assert_eq!(err.reason(), "LargerThanDeclared", "{err}");
        assert!(!to.exists());
        assert_eq!(
            unpack_in(dir.path(), "tiny", layer, 4 << 20).1.unwrap(),
            300
        );
    }

    #[test]
    fn a_pax_size_counts_and_the_room_is_what_is_written() {
        // A PAX record saying 300Ki before a ustar header saying 0: the
        // reader takes 300Ki of data for the entry.
        let big = 300u64 << 10;
        let record = |value: &str| {
            let body = format!(" size={value}\n");
            let mut n = body.len() + 1;
            while format!("{n}{body}").len() != n {
                n += 1;
            }
            format!("{n}{body}")
        };
        let pax = record(&big.to_string());
        let bomb = tar_with(|b| {
            let h = header(
                "./PaxHeaders/big",
                tar::EntryType::XHeader,
                pax.len() as u64,
            );
            b.append(&h, pax.as_bytes()).unwrap();
            let h = header("models/big.bin", tar::EntryType::Regular, 0);
            b.append(&h, std::io::empty()).unwrap();
            // The data the PAX size promises, after the header (a whole
            // number of blocks).
            b.get_mut().extend(std::iter::repeat_n(0u8, big as usize));
        });
        let dir = tempfile::tempdir().unwrap();
        let (to, result) = unpack_in(dir.path(), "bomb", bomb.clone(), 100 << 10);
        let err = result.unwrap_err();
        assert_eq!(err.reason(), "LargerThanDeclared", "{err}");
        // Its message says what the headers claim, not bytes it read.
        assert!(
            matches!(err, FetchError::LayersTooLarge { declared, claimed } if declared == 100 << 10 && claimed == big),
            "{err}"
        );
        assert!(err.to_string().contains("nothing was unpacked"), "{err}");
        assert!(!to.exists() && leftovers(dir.path()).is_empty());
        // With room for it, it is unpacked at its real size.
        assert_eq!(unpack_in(dir.path(), "bomb", bomb, 1 << 20).1.unwrap(), big);
    }
}
