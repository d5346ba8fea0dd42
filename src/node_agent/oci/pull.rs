//! Pull: a layer's blob streamed into the blob store's partial file,
//! hashed as it arrives, resumed with a Range request, its digest and
//! size checked before it is kept.

use super::*;

/// Downloads `layer` into the store's partial file and yields its path
/// once its digest is checked, resuming what an earlier try left.
pub(super) async fn download(
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
    let (chunks, sink) = crate::node_agent::fetch::disk_writer(path.clone(), kept);
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
        &crate::node_agent::fetch::encode_hex(digest.as_ref()),
        received,
    );
    if checked.is_err() {
        let _ = std::fs::remove_file(&path);
    }
    checked.map(|()| (path, kept))
}

/// The blob's bytes from `answer` into the disk writer's `chunks`, in
/// writes of [`crate::node_agent::fetch::WRITE_CHUNK`], never more than its
/// descriptor's size; `received` counts them.
pub(super) async fn stream_blob(
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
        if pending.len() >= crate::node_agent::fetch::WRITE_CHUNK
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
pub(super) fn blob_is(
    layer: &Layer,
    source: &Source,
    got: &str,
    received: u64,
) -> Result<(), FetchError> {
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
