//! Place and unpack: each layer put into the artifact's directory from the
//! blob store, a tar layer's entries checked before anything is written
//! (no absolute paths, no `..`, no links out, no devices), the tree made
//! read-only.

use super::*;

/// One artifact's layers being placed into its view, and what that took.
pub(super) struct Placing<'a> {
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
            let bytes = crate::node_agent::blobs::unique_usage(&unpacked).map_err(io)?;
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
pub(super) async fn place_all(
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
            // A model format's tar: its files from the artifact's root.
            None if layer.whole => placing.tar(layer, "").await?.0,
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
    if let Some((at, why)) = crate::node_agent::confine::escaping_link(view).map_err(io)? {
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
pub(super) fn confined(e: std::io::Error, layer: &str) -> FetchError {
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
pub(super) fn place_in(view: &Path, rel: &Path, layer: &str) -> Result<PathBuf, FetchError> {
    let path = crate::node_agent::confine::dirs_to(view, rel).map_err(|e| confined(e, layer))?;
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
pub(super) fn tar_reader(
    path: &Path,
    compression: &str,
) -> std::io::Result<Box<dyn std::io::Read>> {
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
        if let Some((at, why)) = crate::node_agent::confine::escaping_link(&tmp).map_err(io)? {
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
    crate::node_agent::blobs::unique_usage(to).map_err(io)
}

/// Writes one checked tar entry under `root`: through real directories
/// only, a file opened with `O_NOFOLLOW` and cut off once `written`
/// reaches `room`. A later entry replaces an earlier file or link (tar's
/// rule), never a directory.
pub(super) fn place_entry<R: std::io::Read>(
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
    let rel = crate::node_agent::confine::normal(&path)
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
    let dst = crate::node_agent::confine::dirs_to(root, &rel).map_err(placed)?;
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
            let source = crate::node_agent::confine::existing_file(root, &link_name(entry)?)
                .map_err(placed)?;
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
pub(super) const BLOCK: u64 = 4096;

/// What a checked entry will hold on the disk: a file its size in whole
/// blocks, a directory a block, a link nothing beside its inode.
pub(super) fn on_disk<R: std::io::Read>(entry: &tar::Entry<'_, R>) -> u64 {
    match entry.header().entry_type() {
        tar::EntryType::Directory => BLOCK,
        tar::EntryType::Regular | tar::EntryType::Continuous => {
            entry.size().div_ceil(BLOCK) * BLOCK
        }
        _ => 0,
    }
}

/// Why a tar entry may not be unpacked, if it may not.
pub(super) fn check_entry<R: std::io::Read>(entry: &tar::Entry<'_, R>) -> Result<(), String> {
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
pub(super) fn escapes(path: &Path) -> bool {
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

pub(super) fn read_only_tree(dir: &Path) -> std::io::Result<()> {
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
