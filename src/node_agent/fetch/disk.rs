//! Writing to the node's disk: chunks hashed and written on a blocking
//! thread as they arrive, written back as they go, and what a directory
//! holds.

use super::*;

/// A blocking thread that writes the chunks it is sent to `path`, hashing
/// them, then syncs the file to disk (before it is renamed into place: a
/// crash after the rename never leaves a visible artifact with missing
/// data). With `kept` above zero the file's first `kept` bytes stay (a
/// resumed download): they are hashed first and the chunks follow them.
/// Yields the SHA-256 of the whole file.
pub(crate) fn disk_writer(
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
pub(crate) fn start_writeback(file: &std::fs::File, written: u64) {
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
