//! A file's download: a GET (resumed with a Range request where a sha256
//! will tell whether the parts belong together), counted against the
//! artifact's size limit, hashed as it arrives and checked.

use super::*;

/// Where a file's download starts: at 0, or where a cut-short one stopped.
pub(crate) enum Start {
    /// The whole file is in the answer.
    Whole,
    /// The answer carries the rest, from this offset.
    At(u64),
    /// The file was complete already (the source says there is nothing
    /// past its end): only its checksum is left to check.
    Complete(u64),
}

/// Whether a 206 answer's `Content-Range` starts at `offset`.
pub(crate) fn range_starts_at(headers: &http::HeaderMap, offset: u64) -> bool {
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
pub(crate) async fn get_following(
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
    let response = request.send().await.map_err(|e| {
        match crate::node_agent::transport::redirect_reason(&e) {
            Some(why) => redirect(why),
            None => FetchError::Transfer {
                uri: uri.to_owned(),
                message: error_chain(&e),
            },
        }
    })?;
    // reqwest hands back a redirect it could not follow for want of a
    // Location.
    if response.status().is_redirection() {
        let status = response.status().as_u16();
        return Err(redirect(format!("({status}) without a Location")));
    }
    Ok(response)
}

pub(crate) async fn download_all(
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
        let path = crate::node_agent::confine::dirs_to(dir, &f.path).map_err(io)?;
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
pub(crate) struct Budget<'p> {
    pub(crate) declared: u64,
    pub(crate) limit: u64,
    pub(crate) total: u64,
    pub(crate) progress: &'p Progress,
}

impl<'p> Budget<'p> {
    /// Nothing counted yet, against `declared` (plus [`size_limit`]'s
    /// margin).
    pub(crate) fn new(declared: u64, progress: &'p Progress) -> Budget<'p> {
        Budget {
            declared,
            limit: size_limit(declared),
            total: 0,
            progress,
        }
    }

    /// Counts `n` more bytes; past the limit is `TooLarge`.
    pub(crate) fn add(&mut self, n: u64) -> Result<(), FetchError> {
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
pub(crate) async fn download_one(
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
pub(crate) fn start_of(
    response: &reqwest::Response,
    have: u64,
    uri: &str,
) -> Result<Start, FetchError> {
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
pub(crate) async fn checksum_is(
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
