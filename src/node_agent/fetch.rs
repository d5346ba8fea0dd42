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

/// A checked file: where it goes and what it must hash to.
#[derive(Debug)]
struct Checked {
    uri: String,
    path: PathBuf,
    sha256: Option<Vec<u8>>,
}

/// `prefix` as an allowed source: an http(s) URI with a host, or `None`
/// (such a prefix allows nothing).
pub fn source_prefix(prefix: &str) -> Option<http::Uri> {
    let p = prefix.trim().parse::<http::Uri>().ok()?;
    (matches!(p.scheme_str(), Some("http" | "https")) && p.host().is_some()).then_some(p)
}

/// Whether `uri` is under the allowed source `prefix`: the same scheme,
/// host and port, no user info, no dot segments, and a path under the
/// prefix's on a segment boundary. Compared as text,
/// `https://models.example.com` let through
/// `https://models.example.com.evil.net/...` and
/// `https://models.example.com@evil.net/...` (whose host is evil.net).
pub fn is_under(uri: &http::Uri, prefix: &str) -> bool {
    let Some(p) = source_prefix(prefix) else {
        return false;
    };
    if has_dot_segments(uri.path()) {
        return false;
    }
    let port = |u: &http::Uri| {
        u.port_u16().or(match u.scheme_str() {
            Some("https") => Some(443),
            Some("http") => Some(80),
            _ => None,
        })
    };
    let userinfo = |u: &http::Uri| u.authority().is_some_and(|a| a.as_str().contains('@'));
    let same_origin = uri.scheme_str().map(str::to_ascii_lowercase)
        == p.scheme_str().map(str::to_ascii_lowercase)
        && uri.host().map(str::to_ascii_lowercase) == p.host().map(str::to_ascii_lowercase)
        && port(uri) == port(&p)
        && !userinfo(uri)
        && !userinfo(&p);
    let (base, path) = (p.path(), uri.path());
    same_origin
        && (base == "/"
            || path == base
            || path
                .strip_prefix(base)
                .is_some_and(|rest| base.ends_with('/') || rest.starts_with('/')))
}

/// Whether a URI path has a segment that a server may resolve upwards or
/// sideways: `.` or `..`, literal or percent-encoded (`%2e%2e`, as RFC 3986
/// says servers decode unreserved characters), also before a `;` (Tomcat
/// and Jetty drop a segment's `;parameters`, so `..;x` is `..` to them), a
/// `\` literal or encoded (some stores read it as `/`), or an encoded `/`
/// inside a segment. Such a path is refused outright rather than resolved:
/// `/allowed/../secret.bin` is under `/allowed/` as text and outside it
/// once the store resolves it.
fn has_dot_segments(path: &str) -> bool {
    path.split('/').any(|segment| {
        let lower = segment.to_ascii_lowercase();
        let decoded = lower.replace("%2e", ".").replace("%3b", ";");
        let name = decoded.split(';').next().unwrap_or_default();
        name == "."
            || name == ".."
            || lower.contains("%2f")
            || lower.contains("%5c")
            || lower.contains('\\')
    })
}

/// Checks every file before anything is fetched: allowed source, http(s),
/// a relative path that stays inside the directory, a well-formed sha256.
fn check(files: &[FileSource], allowed: &[String]) -> Result<Vec<Checked>, FetchError> {
    let mut seen = std::collections::HashSet::new();
    let mut checked = Vec::new();
    for f in files {
        let uri: http::Uri = f
            .uri
            .parse()
            .map_err(|_| FetchError::BadUri { uri: f.uri.clone() })?;
        if !matches!(uri.scheme_str(), Some("http" | "https")) || uri.host().is_none() {
            return Err(FetchError::BadUri { uri: f.uri.clone() });
        }
        if !allowed.iter().any(|prefix| is_under(&uri, prefix)) {
            return Err(FetchError::NotAllowed {
                uri: f.uri.clone(),
                allowed: if allowed.is_empty() {
                    "none, so every source is refused".into()
                } else {
                    allowed.join(", ")
                },
            });
        }
        let raw = match &f.path {
            Some(p) => p.clone(),
            None => uri.path().rsplit('/').next().unwrap_or_default().to_owned(),
        };
        let Some(path) = inside_path(&raw) else {
            return Err(FetchError::PathEscapes { path: raw });
        };
        if !seen.insert(path.clone()) {
            return Err(FetchError::DuplicatePath { path: raw });
        }
        let sha256 = match &f.sha256 {
            None => None,
            Some(hex) => Some(
                decode_hex(hex).ok_or_else(|| FetchError::BadChecksum { value: hex.clone() })?,
            ),
        };
        checked.push(Checked {
            uri: f.uri.clone(),
            path,
            sha256,
        });
    }
    // A file cannot also be a directory other files go in.
    for file in &checked {
        if let Some(under) = checked
            .iter()
            .find(|o| o.path != file.path && o.path.starts_with(&file.path))
        {
            return Err(FetchError::PathsOverlap {
                file: file.path.display().to_string(),
                under: under.path.display().to_string(),
            });
        }
    }
    Ok(checked)
}

/// `raw` as a path inside an artifact's directory (`./w.bin` and `w.bin`
/// are one file), or `None` if it is empty, absolute or has `..`.
pub(super) fn inside_path(raw: &str) -> Option<PathBuf> {
    let given = PathBuf::from(raw);
    let inside = !raw.is_empty()
        && given
            .components()
            .all(|c| matches!(c, Component::Normal(_) | Component::CurDir))
        && given
            .components()
            .any(|c| matches!(c, Component::Normal(_)));
    inside.then(|| {
        given
            .components()
            .filter(|c| matches!(c, Component::Normal(_)))
            .collect()
    })
}

fn decode_hex(s: &str) -> Option<Vec<u8>> {
    if s.len() != 64 {
        return None;
    }
    (0..32)
        .map(|i| u8::from_str_radix(s.get(2 * i..2 * i + 2)?, 16).ok())
        .collect()
}

/// Lowercase hex, as `sha256` fields are written.
pub fn encode_hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
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

/// Where a file's download starts: at 0, or where a cut-short one stopped.
enum Start {
    /// The whole file is in the answer.
    Whole,
    /// The answer carries the rest, from this offset.
    At(u64),
    /// The file was complete already (the source says there is nothing
    /// past its end): only its checksum is left to check.
    Complete(u64),
}

/// Whether a 206 answer's `Content-Range` starts at `offset`.
pub(super) fn range_starts_at(headers: &http::HeaderMap, offset: u64) -> bool {
    headers
        .get(http::header::CONTENT_RANGE)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.strip_prefix("bytes "))
        .and_then(|v| v.split_once('-'))
        .is_some_and(|(from, _)| from.trim().parse() == Ok(offset))
}

/// Sends a GET for `uri` (with `range` if given); redirects are followed
/// by the agent's one rule ([`super::transport`]), each hop under an
/// allowed source; any other redirect is a permanent failure that says
/// why (it can never succeed as it stands).
async fn get_following(
    client: &HttpsClient,
    uri: &str,
    range: Option<String>,
) -> Result<reqwest::Response, FetchError> {
    let redirect = |why: String| FetchError::Redirect {
        uri: uri.to_owned(),
        why,
    };
    let url = reqwest::Url::parse(uri).map_err(|_| FetchError::BadUri {
        uri: uri.to_owned(),
    })?;
    let mut request = client.get(url);
    if let Some(range) = &range {
        request = request.header(http::header::RANGE, range);
    }
    let response =
        request
            .send()
            .await
            .map_err(|e| match super::transport::redirect_reason(&e) {
                Some(why) => redirect(why),
                None => FetchError::Transfer {
                    uri: uri.to_owned(),
                    message: error_chain(&e),
                },
            })?;
    // reqwest hands back a redirect it could not follow for want of a
    // Location.
    if response.status().is_redirection() {
        let status = response.status().as_u16();
        return Err(redirect(format!("({status}) without a Location")));
    }
    Ok(response)
}

async fn download_all(
    client: &HttpsClient,
    store: &Store,
    dir: &Path,
    files: &[Checked],
    declared: u64,
    progress: &Progress,
) -> Result<Fetched, FetchError> {
    let mut budget = Budget::new(declared, progress);
    let mut resumed = 0u64;
    let mut shared = 0u64;
    let mut blobs: Vec<Blob> = Vec::new();
    let mut manifest = String::new();
    for f in files {
        // A file the store holds by its declared SHA-256 is linked, not
        // downloaded again.
        let known = f.sha256.as_ref().map(|want| encode_hex(want));
        // Paths were checked to stay inside; no link stands in an http
        // artifact's directory, but it is made through real ones all the
        // same.
        let path = super::confine::dirs_to(dir, &f.path).map_err(io)?;
        let linked = match &known {
            Some(hex) => store.link(hex, &path).map_err(io)?,
            None => None,
        };
        let (hex, size) = match (known, linked) {
            (Some(hex), Some(size)) => {
                budget.add(size)?;
                shared += size;
                (hex, size)
            }
            _ => {
                let (digest, kept) = download_one(client, dir, f, &mut budget).await?;
                resumed += kept;
                let hex = encode_hex(digest.as_ref());
                let size = store.adopt(&path, &hex).map_err(io)?;
                (hex, size)
            }
        };
        let id = blob_id(&hex);
        if !blobs.iter().any(|(b, _)| *b == id) {
            blobs.push((id, size));
        }
        manifest.push_str(&format!("{hex}  {}\n", f.path.display()));
    }
    let sha256 = match files {
        [_one] => manifest
            .split_whitespace()
            .next()
            .unwrap_or_default()
            .to_owned(),
        _ => encode_hex(ring::digest::digest(&ring::digest::SHA256, manifest.as_bytes()).as_ref()),
    };
    Ok(Fetched {
        bytes: budget.total,
        resumed,
        shared,
        blobs,
        sha256,
    })
}

/// The artifact's bytes so far against its size limit, shown as progress.
pub(super) struct Budget<'p> {
    declared: u64,
    pub(super) limit: u64,
    pub(super) total: u64,
    progress: &'p Progress,
}

impl<'p> Budget<'p> {
    /// Nothing counted yet, against `declared` (plus [`size_limit`]'s
    /// margin).
    pub(super) fn new(declared: u64, progress: &'p Progress) -> Budget<'p> {
        Budget {
            declared,
            limit: size_limit(declared),
            total: 0,
            progress,
        }
    }

    /// Counts `n` more bytes; past the limit is `TooLarge`.
    pub(super) fn add(&mut self, n: u64) -> Result<(), FetchError> {
        self.total += n;
        if self.total > self.limit {
            return Err(FetchError::TooLarge {
                declared: self.declared,
                got: self.total,
            });
        }
        self.progress.bytes.store(self.total, Ordering::Relaxed);
        Ok(())
    }
}

/// Fetches one file into `dir`, resuming a part an earlier try kept when
/// the file has a sha256 to tell whether the parts belong together, and
/// checks it. Yields its SHA-256 and how many of its bytes were kept.
async fn download_one(
    client: &HttpsClient,
    dir: &Path,
    f: &Checked,
    budget: &mut Budget<'_>,
) -> Result<(ring::digest::Digest, u64), FetchError> {
    let transfer = |message: String| FetchError::Transfer {
        uri: f.uri.clone(),
        message,
    };
    let path = dir.join(&f.path);
    if let Some(parent) = path.parent() {
        tokio::fs::create_dir_all(parent).await.map_err(io)?;
    }
    // Resumed only where the checksum will say whether the parts belong
    // together (a source may change between two tries).
    let have = match &f.sha256 {
        Some(_) => tokio::fs::metadata(&path).await.map_or(0, |m| m.len()),
        None => 0,
    };
    let range = (have > 0).then(|| format!("bytes={have}-"));
    let response = get_following(client, &f.uri, range).await?;
    let start = start_of(&response, have, &f.uri)?;
    let kept = match start {
        Start::Whole => 0,
        Start::At(n) | Start::Complete(n) => n,
    };
    budget.add(kept)?;
    // Received here, hashed and written on a blocking thread, chunk by
    // chunk, so the network, the hash and the disk overlap.
    let (chunks, mut sink) = disk_writer(path.clone(), kept);
    let mut pending = bytes::BytesMut::with_capacity(WRITE_CHUNK);
    let mut body = response;
    let received: Result<(), FetchError> = async {
        if matches!(start, Start::Complete(_)) {
            return Ok(());
        }
        while let Some(data) = body.chunk().await.map_err(|e| transfer(error_chain(&e)))? {
            budget.add(data.len() as u64)?;
            pending.extend_from_slice(&data);
            if pending.len() >= WRITE_CHUNK {
                let chunk = pending.split().freeze();
                if chunks.send(chunk).await.is_err() {
                    break; // the writer failed; its error follows
                }
            }
        }
        Ok(())
    }
    .await;
    // What arrived before a cut is kept (and written) for the next try.
    if !pending.is_empty() && !matches!(received, Err(FetchError::TooLarge { .. })) {
        let _ = chunks.send(pending.split().freeze()).await;
    }
    drop(chunks);
    let written = (&mut sink)
        .await
        .map_err(|e| FetchError::Io(e.to_string()))?;
    received?;
    let digest = written.map_err(io)?;
    if let Some(want) = &f.sha256 {
        checksum_is(f, &path, want, &digest, kept).await?;
    }
    Ok((digest, kept))
}

/// Where an answer to a GET from `have` bytes on starts the file.
fn start_of(response: &reqwest::Response, have: u64, uri: &str) -> Result<Start, FetchError> {
    Ok(match response.status() {
        http::StatusCode::OK => Start::Whole,
        http::StatusCode::PARTIAL_CONTENT
            if have > 0 && range_starts_at(response.headers(), have) =>
        {
            Start::At(have)
        }
        http::StatusCode::RANGE_NOT_SATISFIABLE if have > 0 => Start::Complete(have),
        status => {
            return Err(FetchError::Status {
                uri: uri.to_owned(),
                status: status.as_u16(),
            });
        }
    })
}

/// Whether the file's `digest` is the declared `want`; a resumed file
/// whose parts do not belong together starts over on the next try.
async fn checksum_is(
    f: &Checked,
    path: &Path,
    want: &[u8],
    digest: &ring::digest::Digest,
    kept: u64,
) -> Result<(), FetchError> {
    if digest.as_ref() == want {
        return Ok(());
    }
    if kept > 0 {
        // The kept part and the rest do not belong together (the source
        // changed, or the kept part was damaged).
        let _ = tokio::fs::remove_file(path).await;
        return Err(FetchError::Transfer {
            uri: f.uri.clone(),
            message: format!(
                "sha256 is {}, expected {}, after resuming at byte {kept}: the file starts over",
                encode_hex(digest.as_ref()),
                encode_hex(want)
            ),
        });
    }
    Err(FetchError::ChecksumMismatch {
        uri: f.uri.clone(),
        want: encode_hex(want),
        got: encode_hex(digest.as_ref()),
    })
}

/// A blocking thread that writes the chunks it is sent to `path`, hashing
/// them, then syncs the file to disk (before it is renamed into place: a
/// crash after the rename never leaves a visible artifact with missing
/// data). With `kept` above zero the file's first `kept` bytes stay (a
/// resumed download): they are hashed first and the chunks follow them.
/// Yields the SHA-256 of the whole file.
pub(super) fn disk_writer(
    path: PathBuf,
    kept: u64,
) -> (
    tokio::sync::mpsc::Sender<Bytes>,
    tokio::task::JoinHandle<std::io::Result<ring::digest::Digest>>,
) {
    let (tx, mut rx) = tokio::sync::mpsc::channel::<Bytes>(4);
    let task = tokio::task::spawn_blocking(move || {
        use std::io::{Read, Seek, Write};
        let mut hash = ring::digest::Context::new(&ring::digest::SHA256);
        let mut file = if kept == 0 {
            std::fs::File::create(&path)?
        } else {
            let mut file = std::fs::OpenOptions::new()
                .read(true)
                .write(true)
                .open(&path)?;
            // Anything past what the source resumed from goes.
            file.set_len(kept)?;
            let mut buf = vec![0u8; WRITE_CHUNK];
            loop {
                let n = file.read(&mut buf)?;
                if n == 0 {
                    break;
                }
                hash.update(&buf[..n]);
            }
            file.seek(std::io::SeekFrom::End(0))?;
            file
        };
        let mut written = kept;
        while let Some(chunk) = rx.blocking_recv() {
            hash.update(&chunk);
            file.write_all(&chunk)?;
            written += chunk.len() as u64;
            start_writeback(&file, written);
        }
        file.sync_all()?;
        Ok(hash.finish())
    });
    (tx, task)
}

/// Starts the kernel writing the file's pages out while the download goes
/// on (Linux `sync_file_range` with WRITE only: it does not wait), so the
/// final sync finds little left to flush. Elsewhere, nothing.
#[allow(unsafe_code)] // a libc call std has no safe wrapper for
fn start_writeback(file: &std::fs::File, written: u64) {
    #[cfg(target_os = "linux")]
    {
        use std::os::fd::AsRawFd;
        const STEP: u64 = 8 << 20;
        if written % STEP < WRITE_CHUNK as u64 && written >= STEP {
            let from = (written / STEP - 1) * STEP;
            // SAFETY: a plain syscall on a file descriptor we own; a failure
            // only means the final sync does the work.
            unsafe {
                libc::sync_file_range(
                    file.as_raw_fd(),
                    from as libc::off64_t,
                    STEP as libc::off64_t,
                    libc::SYNC_FILE_RANGE_WRITE,
                );
            }
        }
    }
    #[cfg(not(target_os = "linux"))]
    let _ = (file, written);
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

/// Bytes under `dir` (the size of an artifact on disk).
pub fn disk_usage(dir: &Path) -> std::io::Result<u64> {
    let mut total = 0;
    for entry in std::fs::read_dir(dir)? {
        let entry = entry?;
        let meta = entry.metadata()?;
        total += if meta.is_dir() {
            disk_usage(&entry.path())?
        } else {
            meta.len()
        };
    }
    Ok(total)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn file(uri: &str, path: Option<&str>) -> FileSource {
        FileSource {
            uri: uri.into(),
            path: path.map(Into::into),
            sha256: None,
        }
    }

    #[test]
    fn a_source_is_allowed_by_origin_and_path_not_by_text() {
        let under = |uri: &str, prefix: &str| is_under(&uri.parse().unwrap(), prefix);
        for prefix in ["https://models.example.com", "https://models.example.com/"] {
            assert!(under("https://models.example.com/qwen/w.bin", prefix));
            assert!(under("HTTPS://Models.Example.com:443/qwen/w.bin", prefix));
            // What a text prefix let through.
            assert!(!under("https://models.example.com.evil.net/w.bin", prefix));
            assert!(!under("https://models.example.com@evil.net/w.bin", prefix));
            assert!(!under("https://models.example.com:8443/w.bin", prefix));
            assert!(!under("http://models.example.com/w.bin", prefix));
        }
        let prefix = "http://minio.models:9000/bucket";
        assert!(under("http://minio.models:9000/bucket/qwen/w.bin", prefix));
        assert!(under("http://minio.models:9000/bucket", prefix));
        assert!(!under(
            "http://minio.models:9000/bucket-other/w.bin",
            prefix
        ));
        assert!(!under("http://minio.models/bucket/w.bin", prefix));
        assert!(under(
            "http://minio.models:9000/bucket/w.bin",
            "http://minio.models:9000/bucket/"
        ));
        // Dot segments, literal or percent-encoded, are refused: the store
        // would resolve them out of the prefix.
        let allowed = "http://127.0.0.1:28090/allowed/";
        assert!(under("http://127.0.0.1:28090/allowed/w.bin", allowed));
        for sneaky in [
            "http://127.0.0.1:28090/allowed/../secret.bin",
            "http://127.0.0.1:28090/allowed/%2e%2e/secret.bin",
            "http://127.0.0.1:28090/allowed/%2E%2E/secret.bin",
            "http://127.0.0.1:28090/allowed/.%2e/secret.bin",
            "http://127.0.0.1:28090/allowed/./w.bin",
            "http://127.0.0.1:28090/allowed/a/../../secret.bin",
            "http://127.0.0.1:28090/allowed/..%2fsecret.bin",
            "http://127.0.0.1:28090/allowed/..%5csecret.bin",
            "http://127.0.0.1:28090/allowed/..",
            // What Tomcat and Jetty read as `..`, and a `\` some stores
            // read as `/` (a black-box round sent both to the store).
            "http://127.0.0.1:28090/allowed/..;/fresh.bin",
            "http://127.0.0.1:28090/allowed/..;x=1/fresh.bin",
            "http://127.0.0.1:28090/allowed/.%2e%3b/fresh.bin",
            "http://127.0.0.1:28090/allowed/..\\fresh.bin",
            "http://127.0.0.1:28090/allowed/a\\..\\..\\fresh.bin",
        ] {
            assert!(!under(sneaky, allowed), "{sneaky}");
        }
        // Dots inside a name are just a name.
        assert!(under("http://127.0.0.1:28090/allowed/w..bin", allowed));
        assert!(under("http://127.0.0.1:28090/allowed/.hidden", allowed));
        // A prefix that is not an http(s) URI with a host allows nothing.
        for bad in [
            "models.example.com",
            "/bucket",
            "",
            "https://user@models.example.com/",
        ] {
            assert!(!under("https://models.example.com/w.bin", bad), "{bad:?}");
        }
    }

    #[test]
    fn sources_and_paths_are_checked_before_anything_is_fetched() {
        let allowed = vec!["http://models.local/".to_owned()];
        assert!(check(&[file("http://models.local/a/w.bin", None)], &allowed).is_ok());
        assert!(matches!(
            check(&[file("http://evil.example/w.bin", None)], &allowed),
            Err(FetchError::NotAllowed { .. })
        ));
        assert!(matches!(
            check(&[file("http://models.local/w.bin", None)], &[]),
            Err(FetchError::NotAllowed { .. })
        ));
        assert!(matches!(
            check(
                &[file("ftp://models.local/w.bin", None)],
                &["ftp://".into()]
            ),
            Err(FetchError::BadUri { .. })
        ));
        for bad in ["../w.bin", "/etc/passwd", "a/../../w.bin", "", "."] {
            assert!(
                matches!(
                    check(&[file("http://models.local/w.bin", Some(bad))], &allowed),
                    Err(FetchError::PathEscapes { .. })
                ),
                "{bad}"
            );
        }
        assert!(
            check(
                &[file("http://models.local/w.bin", Some("sub/dir/w.bin"))],
                &allowed
            )
            .is_ok()
        );
        // The URI's last segment is the default path; a URI ending in / has none.
        assert!(matches!(
            check(&[file("http://models.local/dir/", None)], &allowed),
            Err(FetchError::PathEscapes { .. })
        ));
        let dup = [
            file("http://models.local/a/w.bin", None),
            file("http://models.local/b/w.bin", None),
        ];
        assert!(matches!(
            check(&dup, &allowed),
            Err(FetchError::DuplicatePath { .. })
        ));
        let same = [
            file("http://models.local/a/w.bin", Some("w.bin")),
            file("http://models.local/b/w.bin", Some("./w.bin")),
        ];
        assert!(matches!(
            check(&same, &allowed),
            Err(FetchError::DuplicatePath { .. })
        ));
        let overlap = [
            file("http://models.local/a", Some("config")),
            file("http://models.local/b", Some("config/model.json")),
        ];
        let e = check(&overlap, &allowed).unwrap_err();
        assert!(matches!(e, FetchError::PathsOverlap { .. }), "{e}");
        assert_eq!(e.reason(), "InvalidArtifact");
        assert!(!e.retryable());
        let mut bad_sum = file("http://models.local/w.bin", None);
        bad_sum.sha256 = Some("abc".into());
        assert!(matches!(
            check(&[bad_sum], &allowed),
            Err(FetchError::BadChecksum { .. })
        ));
    }

    #[test]
    fn hex_round_trips() {
        let bytes: Vec<u8> = (0..32).collect();
        assert_eq!(decode_hex(&encode_hex(&bytes)), Some(bytes));
        assert_eq!(decode_hex(&"zz".repeat(32)), None);
    }
}
