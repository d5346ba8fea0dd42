//! The node's blob store: every file an artifact holds is kept once, by
//! the SHA-256 of its content, however many artifacts contain it.
//!
//! An artifact's directory (`<cache>/<key>`, what its model pods mount) is
//! a view of the store: each of its files is a **hard link** to a blob.
//! Hard links rather than symlinks into the store, because a pod mounts
//! only the artifact's directory: a symlink to `../.blobs/...` would
//! dangle inside the container, a hard link is the file itself. So the
//! store and the views must be on one filesystem (they are: both under
//! the cache directory), and a blob's bytes are freed when its last link
//! goes: a blob is garbage exactly when the store's own link is the only
//! one left (`st_nlink == 1`), which holds across restarts with no
//! reference counts to keep. Blobs are made read-only: two models share
//! the same inode, so no one may write it.
//!
//! Layout under `<cache>/.blobs/`:
//! - `sha256/<hex>`: a verified file (an http file, an OCI layer that is a
//!   file);
//! - `layers/<hex>/`: an OCI tar layer, unpacked once, its files linked
//!   into the views that use it;
//! - `partial/<hex>`: an OCI blob being downloaded (resumed from there);
//! - `views/<key>.json`: which blobs an artifact's directory holds (what
//!   the disk plan counts), and the manifest digest of an OCI artifact.

use super::keep::Blob;
use serde::{Deserialize, Serialize};
use std::collections::HashSet;
use std::io;
use std::os::unix::fs::MetadataExt;
use std::path::{Path, PathBuf};

/// The store's directory name in the cache directory (hidden: not an
/// artifact key).
pub const STORE_DIR: &str = ".blobs";

/// What an artifact's directory is made of.
#[derive(Serialize, Deserialize, Clone, Debug, Default, PartialEq, Eq)]
pub struct ViewRecord {
    /// `(sha256:<hex>, bytes)` per blob, each once.
    pub blobs: Vec<Blob>,
    /// The OCI manifest digest it was made from.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub manifest: Option<String>,
}

/// The blob store of one cache directory.
#[derive(Clone, Debug)]
pub struct Store {
    root: PathBuf,
}

/// `sha256:<hex>` as the id the disk plan and the records use.
pub fn blob_id(hex: &str) -> String {
    format!("sha256:{hex}")
}

impl Store {
    pub fn new(cache: &Path) -> Store {
        Store {
            root: cache.join(STORE_DIR),
        }
    }

    pub fn file(&self, hex: &str) -> PathBuf {
        self.root.join("sha256").join(hex)
    }

    pub fn layer(&self, hex: &str) -> PathBuf {
        self.root.join("layers").join(hex)
    }

    pub fn partial(&self, hex: &str) -> PathBuf {
        self.root.join("partial").join(hex)
    }

    fn view_record_path(&self, key: &str) -> PathBuf {
        self.root.join("views").join(format!("{key}.json"))
    }

    /// Creates the store's directories.
    pub fn create(&self) -> io::Result<()> {
        for d in ["sha256", "layers", "partial", "views"] {
            std::fs::create_dir_all(self.root.join(d))?;
        }
        Ok(())
    }

    /// The size of blob `hex` if the store holds it.
    pub fn has_file(&self, hex: &str) -> Option<u64> {
        std::fs::metadata(self.file(hex)).ok().map(|m| m.len())
    }

    /// Moves the verified file at `from` (whose SHA-256 is `hex`) into the
    /// store, or drops it if the store has that blob already, and leaves a
    /// link to the blob at `from`. Yields the blob's size.
    pub fn adopt(&self, from: &Path, hex: &str) -> io::Result<u64> {
        let blob = self.file(hex);
        if blob.exists() {
            std::fs::remove_file(from)?;
        } else {
            read_only(from)?;
            std::fs::rename(from, &blob)?;
        }
        std::fs::hard_link(&blob, from)?;
        Ok(std::fs::metadata(&blob)?.len())
    }

    /// Links blob `hex` at `to` (whose directory the caller made, through
    /// real directories only: [`super::confine::dirs_to`]), if the store
    /// holds it. Yields its size.
    pub fn link(&self, hex: &str, to: &Path) -> io::Result<Option<u64>> {
        let blob = self.file(hex);
        let Ok(meta) = std::fs::metadata(&blob) else {
            return Ok(None);
        };
        match std::fs::remove_file(to) {
            Err(e) if e.kind() != io::ErrorKind::NotFound => return Err(e),
            _ => {}
        }
        std::fs::hard_link(&blob, to)?;
        Ok(Some(meta.len()))
    }

    /// Links every entry under `sub` of unpacked layer `hex` into `into`,
    /// directories made, a file an earlier layer put there replaced (the
    /// image convention: later layers win). Yields whether `sub` exists in
    /// the layer. `sub` must be a real directory reached through real
    /// directories: a layer whose `models` is a link (to `/etc`, to the
    /// store) is refused (`InvalidInput`), never followed.
    pub fn link_layer(&self, hex: &str, sub: &str, into: &Path) -> io::Result<bool> {
        let Some(from) = super::confine::real_dir(&self.layer(hex), Path::new(sub))? else {
            return Ok(false);
        };
        link_tree(&from, into)?;
        Ok(true)
    }

    pub fn write_view(&self, key: &str, record: &ViewRecord) -> io::Result<()> {
        let path = self.view_record_path(key);
        let tmp = path.with_extension("json.tmp");
        std::fs::write(&tmp, serde_json::to_vec(record).map_err(io::Error::other)?)?;
        std::fs::rename(tmp, path)
    }

    pub fn read_view(&self, key: &str) -> Option<ViewRecord> {
        let bytes = std::fs::read(self.view_record_path(key)).ok()?;
        serde_json::from_slice(&bytes).ok()
    }

    pub fn remove_view(&self, key: &str) {
        let _ = std::fs::remove_file(self.view_record_path(key));
    }

    /// Removes every blob and unpacked layer no artifact directory links
    /// any more, except those in `keep` (ids of blobs a fetch running now
    /// is about to link), and view records whose directory is gone. Yields
    /// the bytes freed.
    pub fn collect_garbage(&self, cache: &Path, keep: &HashSet<String>) -> io::Result<u64> {
        let mut freed = 0;
        for entry in read_dir_or_empty(&self.root.join("sha256"))? {
            let entry = entry?;
            let hex = entry.file_name().to_string_lossy().into_owned();
            let meta = entry.metadata()?;
            if meta.nlink() <= 1 && !keep.contains(&blob_id(&hex)) {
                std::fs::remove_file(entry.path())?;
                freed += meta.len();
            }
        }
        for entry in read_dir_or_empty(&self.root.join("layers"))? {
            let entry = entry?;
            let hex = entry.file_name().to_string_lossy().into_owned();
            if keep.contains(&blob_id(&hex)) {
                continue;
            }
            let (bytes, linked) = tree_links(&entry.path())?;
            if !linked {
                std::fs::remove_dir_all(entry.path())?;
                freed += bytes;
            }
        }
        for entry in read_dir_or_empty(&self.root.join("views"))? {
            let entry = entry?;
            let name = entry.file_name().to_string_lossy().into_owned();
            if let Some(key) = name.strip_suffix(".json")
                && !cache.join(key).is_dir()
            {
                let _ = std::fs::remove_file(entry.path());
            }
        }
        Ok(freed)
    }

    /// Removes OCI blobs being downloaded, but those in `keep`. Yields how
    /// many went.
    pub fn drop_partials(&self, keep: &HashSet<String>) -> usize {
        let Ok(entries) = read_dir_or_empty(&self.root.join("partial")) else {
            return 0;
        };
        let mut dropped = 0;
        for entry in entries.into_iter().flatten() {
            let hex = entry.file_name().to_string_lossy().into_owned();
            if !keep.contains(&blob_id(&hex)) && std::fs::remove_file(entry.path()).is_ok() {
                dropped += 1;
            }
        }
        dropped
    }
}

fn read_dir_or_empty(dir: &Path) -> io::Result<Vec<io::Result<std::fs::DirEntry>>> {
    match std::fs::read_dir(dir) {
        Ok(entries) => Ok(entries.collect()),
        Err(e) if e.kind() == io::ErrorKind::NotFound => Ok(Vec::new()),
        Err(e) => Err(e),
    }
}

fn read_only(path: &Path) -> io::Result<()> {
    let mut perms = std::fs::metadata(path)?.permissions();
    perms.set_readonly(true);
    std::fs::set_permissions(path, perms)
}

/// Hard-links the tree under `from` into `into` (symlinks copied as
/// symlinks, never followed; the finished view is checked for links that
/// lead out of it).
fn link_tree(from: &Path, into: &Path) -> io::Result<()> {
    if into.symlink_metadata().is_err() {
        std::fs::create_dir(into)?;
    }
    for entry in std::fs::read_dir(from)? {
        let entry = entry?;
        let kind = entry.file_type()?;
        let target = into.join(entry.file_name());
        if kind.is_dir() {
            if target.symlink_metadata().is_ok_and(|m| !m.is_dir()) {
                std::fs::remove_file(&target)?;
            }
            link_tree(&entry.path(), &target)?;
            continue;
        }
        if let Ok(m) = target.symlink_metadata() {
            if m.is_dir() {
                std::fs::remove_dir_all(&target)?;
            } else {
                std::fs::remove_file(&target)?;
            }
        }
        if kind.is_symlink() {
            std::os::unix::fs::symlink(std::fs::read_link(entry.path())?, &target)?;
        } else {
            std::fs::hard_link(entry.path(), &target)?;
        }
    }
    Ok(())
}

/// The bytes of the regular files under `dir`, and whether any of them is
/// linked from elsewhere.
fn tree_links(dir: &Path) -> io::Result<(u64, bool)> {
    let mut bytes = 0;
    let mut linked = false;
    for entry in std::fs::read_dir(dir)? {
        let entry = entry?;
        let meta = entry.path().symlink_metadata()?;
        if meta.is_dir() {
            let (b, l) = tree_links(&entry.path())?;
            bytes += b;
            linked |= l;
        } else if meta.is_file() {
            bytes += meta.len();
            linked |= meta.nlink() > 1;
        }
    }
    Ok((bytes, linked))
}

/// Calls `each` once per inode under `dir` (a file linked from several
/// places, once), directories included, never following a link.
fn each_inode(dir: &Path, mut each: impl FnMut(&std::fs::Metadata)) -> io::Result<()> {
    let mut seen = HashSet::new();
    let mut stack = vec![dir.to_path_buf()];
    while let Some(d) = stack.pop() {
        let entries = match std::fs::read_dir(&d) {
            Ok(e) => e,
            Err(e) if e.kind() == io::ErrorKind::NotFound => continue,
            Err(e) => return Err(e),
        };
        for entry in entries {
            let path = entry?.path();
            let meta = path.symlink_metadata()?;
            if meta.is_dir() {
                stack.push(path);
            }
            if seen.insert((meta.dev(), meta.ino())) {
                each(&meta);
            }
        }
    }
    Ok(())
}

/// The bytes of the regular files under `dir`, each file once however
/// many names it has.
pub fn unique_usage(dir: &Path) -> io::Result<u64> {
    let mut total = 0;
    each_inode(dir, |meta| {
        if meta.is_file() {
            total += meta.len();
        }
    })?;
    Ok(total)
}

/// What `dir` really takes on the disk: the blocks allocated to its
/// files, directories and links, each inode once. A layer of many tiny
/// files or empty directories takes far more than its bytes (the black-box
/// round: 61.4k of bytes, 331 MB of disk); the node reports this.
pub fn allocated(dir: &Path) -> io::Result<u64> {
    let mut total = 0;
    // st_blocks is in 512-byte units whatever the block size.
    each_inode(dir, |meta| total += meta.blocks() * 512)?;
    Ok(total)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn what_a_tree_takes_counts_blocks_of_files_and_directories_once() {
        let dir = tempfile::tempdir().unwrap();
        for i in 0..50 {
            let sub = dir.path().join(format!("d{i}"));
            std::fs::create_dir(&sub).unwrap();
            std::fs::write(sub.join("one"), b"x").unwrap();
            // A second name for the same inode counts once.
            std::fs::hard_link(sub.join("one"), sub.join("again")).unwrap();
        }
        assert_eq!(unique_usage(dir.path()).unwrap(), 50, "file bytes");
        let took = allocated(dir.path()).unwrap();
        // 50 one-byte files and 50 directories: at least a block each on
        // any file system that allocates in blocks.
        assert!(took >= 50 * 4096, "{took}");
        assert!(took <= 200 * 4096, "each inode once: {took}");
    }

    #[test]
    fn a_blob_two_views_link_is_stored_once_and_goes_with_its_last_view() {
        let dir = tempfile::tempdir().unwrap();
        let cache = dir.path();
        let store = Store::new(cache);
        store.create().unwrap();
        std::fs::create_dir_all(cache.join("a")).unwrap();
        std::fs::write(cache.join("a/w.bin"), vec![7u8; 1000]).unwrap();
        assert_eq!(store.adopt(&cache.join("a/w.bin"), "ab").unwrap(), 1000);
        std::fs::create_dir_all(cache.join("b/sub")).unwrap();
        assert_eq!(
            store.link("ab", &cache.join("b/sub/w.bin")).unwrap(),
            Some(1000)
        );
        assert_eq!(store.link("cd", &cache.join("b/x")).unwrap(), None);
        assert_eq!(unique_usage(cache).unwrap(), 1000, "one inode, three links");
        let keep = HashSet::new();
        std::fs::remove_dir_all(cache.join("a")).unwrap();
        assert_eq!(
            store.collect_garbage(cache, &keep).unwrap(),
            0,
            "b links it"
        );
        assert_eq!(
            std::fs::read(cache.join("b/sub/w.bin")).unwrap().len(),
            1000
        );
        std::fs::remove_dir_all(cache.join("b")).unwrap();
        // A fetch about to link it keeps it.
        let running = HashSet::from([blob_id("ab")]);
        assert_eq!(store.collect_garbage(cache, &running).unwrap(), 0);
        assert_eq!(store.collect_garbage(cache, &keep).unwrap(), 1000);
        assert_eq!(unique_usage(cache).unwrap(), 0);
    }

    #[test]
    fn an_unpacked_layer_is_linked_into_views_and_collected_when_unlinked() {
        let dir = tempfile::tempdir().unwrap();
        let cache = dir.path();
        let store = Store::new(cache);
        store.create().unwrap();
        let layer = store.layer("ff");
        std::fs::create_dir_all(layer.join("models/tok")).unwrap();
        std::fs::write(layer.join("models/tok/vocab.json"), b"{}").unwrap();
        std::fs::write(layer.join("models/config.json"), b"{\"a\":1}").unwrap();
        std::os::unix::fs::symlink("config.json", layer.join("models/alias.json")).unwrap();
        assert!(store.link_layer("ff", "models", &cache.join("m")).unwrap());
        assert!(!store.link_layer("ff", "nothere", &cache.join("m")).unwrap());
        assert_eq!(
            std::fs::read(cache.join("m/tok/vocab.json")).unwrap(),
            b"{}"
        );
        assert_eq!(
            std::fs::read(cache.join("m/alias.json")).unwrap(),
            b"{\"a\":1}"
        );
        assert_eq!(unique_usage(cache).unwrap(), 2 + 7);
        let keep = HashSet::new();
        assert_eq!(store.collect_garbage(cache, &keep).unwrap(), 0);
        std::fs::remove_dir_all(cache.join("m")).unwrap();
        assert_eq!(store.collect_garbage(cache, &keep).unwrap(), 9);
        assert!(!layer.exists());
    }
}
