//! Fetching an artifact into the node's cache directory, done right:
//!
//! - every source is checked against `--allowed-sources` (URI prefixes)
//!   and every `path` against escaping the model's directory *before*
//!   anything is downloaded;
//! - files are downloaded into a temporary directory in the cache
//!   directory (`.partial-<key>`, see [`partial_dir`]), hashed as they
//!   arrive, checked against their `sha256`, then the directory is renamed
//!   into place in one step: no half artifact is ever visible under its
//!   name;
//! - a download that goes past the declared size (plus a small margin) is
//!   stopped; a connection cut mid-body, a non-200 answer or a checksum
//!   mismatch fail with the reason;
//! - a download cut short by something that may pass (a lost connection,
//!   an error answer, a restarted agent) keeps its temporary directory, and
//!   the next try resumes each file that declares a `sha256` where it
//!   stopped (an HTTP range request; the checksum covers the whole file,
//!   so parts that do not match are caught, and the file starts over). Any
//!   other failure removes the directory.
//! - every verified file goes into the node's blob store (see
//!   [`super::blobs`]) and the artifact's directory links it; a file whose
//!   declared `sha256` the store holds already is linked without a
//!   download.

mod disk;
mod download;
mod sources;

pub use disk::*;
pub(crate) use download::*;
pub use sources::*;

use super::blobs::{Store, blob_id};
use super::keep::Blob;
use bytes::Bytes;
use std::path::{Component, Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};

/// Bytes gathered before each write to disk.
pub(super) const WRITE_CHUNK: usize = 1 << 20;

/// Prefix of temporary download directories in the cache directory.
pub const PARTIAL_PREFIX: &str = ".partial-";

/// The temporary directory a download of `key` is written in, one per key:
/// what a download cut short left there is where the next one resumes.
pub fn partial_dir(cache: &Path, key: &str) -> PathBuf {
    cache.join(format!("{PARTIAL_PREFIX}{key}"))
}

/// One file of an artifact.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct FileSource {
    pub uri: String,
    /// Relative path inside the model's directory (default: the URI's last
    /// segment).
    pub path: Option<String>,
    /// Expected SHA-256, hex.
    pub sha256: Option<String>,
}

#[derive(Debug, PartialEq, Eq, thiserror::Error)]
pub enum FetchError {
    #[error("{uri} is not under an allowed source (--allowed-sources: {allowed})")]
    NotAllowed { uri: String, allowed: String },
    #[error("{uri} is not an http or https URI")]
    BadUri { uri: String },
    #[error("path {path:?} must be relative and stay inside the model's directory")]
    PathEscapes { path: String },
    #[error("two files of the artifact are both written to {path:?}")]
    DuplicatePath { path: String },
    #[error("{file:?} is a file of the artifact, so {under:?} cannot be inside it")]
    PathsOverlap { file: String, under: String },
    #[error("sha256 {value:?} is not 64 hex digits")]
    BadChecksum { value: String },
    #[error("{uri} answered {status}")]
    Status { uri: String, status: u16 },
    #[error("{uri} redirects {why}")]
    Redirect { uri: String, why: String },
    #[error("fetching {uri}: {message}")]
    Transfer { uri: String, message: String },
    #[error("{uri}: sha256 is {got}, expected {want}")]
    ChecksumMismatch {
        uri: String,
        want: String,
        got: String,
    },
    #[error(
        "the artifact is larger than its declared size {declared} bytes (stopped at {got} bytes)"
    )]
    TooLarge { declared: u64, got: u64 },
    /// A layer's tar (and PAX) headers claim more than its room: found
    /// before a byte is unpacked, so nothing was read past the headers.
    #[error(
        "the artifact's layers declare {claimed} bytes in their tar headers, more than its declared size {declared} bytes (nothing was unpacked)"
    )]
    LayersTooLarge { declared: u64, claimed: u64 },
    #[error("writing to the cache directory: {0}")]
    Io(String),
    #[error("{reference:?} is not an OCI reference: {why}")]
    BadReference { reference: String, why: String },
    #[error("registry {registry}: {message}")]
    RegistryAuth { registry: String, message: String },
    #[error("{reference}: no such manifest in the registry")]
    ManifestNotFound { reference: String },
    #[error("{reference}: the registry has no blob {digest}")]
    BlobNotFound { reference: String, digest: String },
    #[error("{what}: digest is {got}, expected {want}")]
    DigestMismatch {
        what: String,
        want: String,
        got: String,
    },
    #[error("{reference}: the manifest is {bytes} bytes, more than the {limit} allowed")]
    ManifestTooLarge {
        reference: String,
        bytes: usize,
        limit: usize,
    },
    #[error("{what} has media type {media_type:?}, which the node agent does not handle")]
    UnsupportedMediaType { what: String, media_type: String },
    #[error("layer {layer}: {message}")]
    InvalidLayer { layer: String, message: String },
    #[error("registry {registry}: {message}")]
    Registry { registry: String, message: String },
}

impl FetchError {
    /// The CamelCase reason a status shows.
    pub fn reason(&self) -> &'static str {
        match self {
            FetchError::NotAllowed { .. } | FetchError::Redirect { .. } => "SourceNotAllowed",
            FetchError::BadUri { .. }
            | FetchError::PathEscapes { .. }
            | FetchError::DuplicatePath { .. }
            | FetchError::PathsOverlap { .. }
            | FetchError::BadChecksum { .. }
            | FetchError::BadReference { .. }
            | FetchError::InvalidLayer { .. } => "InvalidArtifact",
            FetchError::Status { .. } | FetchError::Transfer { .. } => "DownloadFailed",
            FetchError::ChecksumMismatch { .. } => "ChecksumMismatch",
            FetchError::TooLarge { .. } | FetchError::LayersTooLarge { .. } => "LargerThanDeclared",
            FetchError::Io(_) => "DiskError",
            FetchError::RegistryAuth { .. } => "RegistryAuthFailed",
            FetchError::ManifestNotFound { .. } => "ManifestNotFound",
            FetchError::BlobNotFound { .. } => "BlobNotFound",
            FetchError::DigestMismatch { .. } => "DigestMismatch",
            FetchError::ManifestTooLarge { .. } => "ManifestTooLarge",
            FetchError::UnsupportedMediaType { .. } => "UnsupportedMediaType",
            FetchError::Registry { .. } => "RegistryUnavailable",
        }
    }

    /// Whether trying again may succeed (a server or network problem), as
    /// opposed to a spec that will fail the same way every time.
    pub fn retryable(&self) -> bool {
        matches!(
            self,
            FetchError::Status { .. }
                | FetchError::Transfer { .. }
                | FetchError::Io(_)
                | FetchError::Registry { .. }
        )
    }
}

impl FetchError {
    /// Whether the same artifact spec fails the same way whatever is tried
    /// again: its paths, links, sources, sizes or media types. Such a
    /// failure is not tried again (a download each time) until the spec
    /// changes (a new artifact key) or the agent restarts (its
    /// `--allowed-sources` may have changed). A mismatching checksum or
    /// digest and failed credentials are retried: the store, the registry
    /// or the Secret may be fixed.
    pub fn permanent(&self) -> bool {
        matches!(
            self.reason(),
            "InvalidArtifact"
                | "SourceNotAllowed"
                | "LargerThanDeclared"
                | "UnsupportedMediaType"
                | "ManifestTooLarge"
        )
    }
}

pub(super) fn io(e: std::io::Error) -> FetchError {
    FetchError::Io(e.to_string())
}

/// How far past its declared size an artifact may go: 1 % plus 1 MiB (a
/// declared size is rounded; a runaway download is not).
pub fn size_limit(declared: u64) -> u64 {
    declared + declared / 100 + (1 << 20)
}

/// The download client's type: the agent's one stack
/// ([`super::transport`]).
pub type HttpsClient = reqwest::Client;

/// The download client: http and https (verified against the system's CA
/// certificates), pooled, following redirects only under `allowed`.
pub fn client(allowed: &[String]) -> Result<HttpsClient, FetchError> {
    super::transport::client(super::transport::Reads::Files, None, allowed)
        .map_err(|e| FetchError::Io(format!("the download client: {e}")))
}

/// A fetch's progress, readable while it runs.
#[derive(Debug, Default)]
pub struct Progress {
    pub bytes: AtomicU64,
}

/// What a fetch put in place.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Fetched {
    /// The artifact's bytes.
    pub bytes: u64,
    /// Of those, what an earlier try had fetched (a resumed download).
    pub resumed: u64,
    /// Of those, what the blob store had already (files another artifact
    /// holds with the same SHA-256): linked, not downloaded.
    pub shared: u64,
    /// The blobs its directory links, each once.
    pub blobs: Vec<Blob>,
    /// The SHA-256 (hex) of the file, for a one-file artifact; else of its
    /// manifest, the `sha256sum`-style lines `<hex>  <path>` of its files
    /// in order.
    pub sha256: String,
}

/// Fetches `files` into `<cache>/<key>/`, replacing whatever was there,
/// within `declared` bytes (plus [`size_limit`]'s margin). Sources are
/// checked against `allowed`; redirects follow `client`'s rule, built by
/// [`client`] from the same list.
pub async fn fetch(
    client: &HttpsClient,
    cache: &Path,
    key: &str,
    files: &[FileSource],
    declared: u64,
    allowed: &[String],
    progress: &Progress,
) -> Result<Fetched, FetchError> {
    let partial = partial_dir(cache, key);
    let checked = match check(files, allowed) {
        Ok(checked) => checked,
        Err(e) => {
            // What an earlier try kept is no use now (the agent was
            // restarted with other --allowed-sources, say).
            let _ = tokio::fs::remove_dir_all(&partial).await;
            return Err(e);
        }
    };
    tokio::fs::create_dir_all(&partial).await.map_err(io)?;
    let store = Store::new(cache);
    store.create().map_err(io)?;
    let result = download_all(client, &store, &partial, &checked, declared, progress).await;
    let result = match result {
        Ok(fetched) => {
            let target = cache.join(key);
            // A stale copy (an earlier failed verification left none; an
            // edited spec may leave one) is replaced as a whole.
            if tokio::fs::metadata(&target).await.is_ok() {
                tokio::fs::remove_dir_all(&target).await.map_err(io)?;
            }
            tokio::fs::rename(&partial, &target)
                .await
                .map(|_| fetched)
                .map_err(io)
        }
        Err(e) => Err(e),
    };
    if let Err(e) = &result {
        // Kept for the next try: what arrived of files that declare a
        // sha256 (the others start over anyway), after a failure that may
        // pass. Nothing else stays.
        if e.retryable() {
            for f in checked.iter().filter(|f| f.sha256.is_none()) {
                let _ = tokio::fs::remove_file(partial.join(&f.path)).await;
            }
        }
        if !e.retryable() || disk_usage(&partial).unwrap_or(0) == 0 {
            let _ = tokio::fs::remove_dir_all(&partial).await;
        }
    }
    result
}

/// An error with its causes (hyper's top-level messages alone are vague).
pub(super) fn error_chain(e: &dyn std::error::Error) -> String {
    let mut text = e.to_string();
    let mut source = e.source();
    while let Some(s) = source {
        text.push_str(": ");
        text.push_str(&s.to_string());
        source = s.source();
    }
    text
}

#[cfg(test)]
mod tests;
