//! Resolve: a reference's manifest fetched, checked against its digest,
//! an image index narrowed to one manifest, and its layers read; the
//! registry's errors said in the agent's terms.

use super::*;

/// The manifest `reference` names, at most [`MANIFEST_LIMIT`] bytes read,
/// and its digest, checked against the one the reference pins.
pub(super) async fn manifest(
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

pub(super) fn parse_manifest(
    source: &Source,
    body: &[u8],
) -> Result<serde_json::Value, FetchError> {
    serde_json::from_slice(body).map_err(|e| FetchError::UnsupportedMediaType {
        what: format!("{}'s manifest (not JSON: {e})", source.text),
        media_type: String::new(),
    })
}

pub(super) fn media_type_of(v: &serde_json::Value) -> String {
    v.get("mediaType")
        .and_then(|m| m.as_str())
        .unwrap_or_default()
        .to_owned()
}

pub(super) fn is_index(v: &serde_json::Value) -> bool {
    v.get("manifests").is_some_and(|m| m.is_array())
}

/// The index's manifest by the documented rule: the only one, else the
/// one for linux on this architecture.
pub(super) fn choose_from_index(
    source: &Source,
    index: &serde_json::Value,
) -> Result<String, FetchError> {
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

pub(super) fn invalid_manifest(source: &Source, message: &str) -> FetchError {
    FetchError::InvalidLayer {
        layer: source.text.clone(),
        message: message.to_owned(),
    }
}

pub(super) fn layers_of(
    source: &Source,
    manifest: &serde_json::Value,
) -> Result<Vec<Layer>, FetchError> {
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
            let media_type = l["mediaType"].as_str().unwrap_or_default().to_owned();
            let format = ModelFormat::of(&media_type);
            let tar = tar_compression(&media_type).is_some();
            // A model format's tar is unpacked whatever it is titled; its
            // raw file is where its title or filepath says.
            let whole = format.is_some() && tar;
            let filepath = || FILEPATHS.iter().find_map(|a| l["annotations"][*a].as_str());
            let title = match format {
                _ if whole => None,
                Some(ModelFormat::ModelPack) => l["annotations"][TITLE].as_str().or_else(filepath),
                _ => l["annotations"][TITLE].as_str(),
            };
            Ok(Layer {
                digest: digest.to_ascii_lowercase(),
                size,
                title: title.map(str::to_owned),
                whole,
                media_type,
            })
        })
        .collect()
}

/// A model packaging format an artifact's layers may be in.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ModelFormat {
    /// The CNCF ModelPack specification (model-spec), in its current
    /// `vnd.cncf.model` spelling and the legacy `vnd.cnai.model` one.
    ModelPack,
    /// KitOps ModelKits.
    KitOps,
}

/// Where a ModelPack raw layer says which file it is (the legacy
/// spelling too).
pub(super) const FILEPATHS: [&str; 2] = ["org.cncf.model.filepath", "org.cnai.model.filepath"];

impl ModelFormat {
    /// The format a layer's media type belongs to, if a model format.
    pub fn of(media_type: &str) -> Option<ModelFormat> {
        let m = media_type.to_ascii_lowercase();
        if m.starts_with("application/vnd.cncf.model.")
            || m.starts_with("application/vnd.cnai.model.")
        {
            Some(ModelFormat::ModelPack)
        } else if m.starts_with("application/vnd.kitops.modelkit.") {
            Some(ModelFormat::KitOps)
        } else {
            None
        }
    }
}

/// How a tar layer is compressed, by its media type; `None`: not a tar.
pub(super) fn tar_compression(media_type: &str) -> Option<&'static str> {
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
pub(super) fn read_error(
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
pub(super) fn registry_error(
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
