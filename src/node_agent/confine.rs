//! Writing and checking an artifact's tree without ever leaving it.
//!
//! An artifact comes from a tenant, and its tar layers may hold symlinks.
//! A symlink that looks harmless on its own can lead out once others are
//! in place (a chain of `../` links, each inside by itself), and anything
//! written *through* a symlink lands where the link points: the blob
//! store, another tenant's weights, the host. So two rules, both judged
//! on the real tree rather than on names:
//! - nothing is ever written through a symlink: every directory between a
//!   root and what is placed under it must be a real directory
//!   ([`dirs_to`]; files are opened with `O_NOFOLLOW`);
//! - once a tree is complete, every symlink in it must resolve inside it,
//!   following the links it meets the way the kernel would
//!   ([`escaping_link`]), since only that tree is mounted into the pod.

use std::collections::VecDeque;
use std::ffi::OsString;
use std::io;
use std::path::{Component, Path, PathBuf};

/// How many symlinks one resolution may follow (the kernel's limit).
const MAX_HOPS: usize = 40;

/// Why a path may not be used.
fn refused(message: String) -> io::Error {
    io::Error::new(io::ErrorKind::InvalidInput, message)
}

/// `rel`'s normal components (`.` dropped); `None` when it has `..`, a
/// root or a prefix.
pub fn normal(rel: &Path) -> Option<PathBuf> {
    let mut out = PathBuf::new();
    for c in rel.components() {
        match c {
            Component::Normal(n) => out.push(n),
            Component::CurDir => {}
            _ => return None,
        }
    }
    Some(out)
}

/// Walks the first `depth` parts of normal `rel` under `root`, each of
/// which must be a real directory (a symlink or a file on the way is
/// refused, never followed). A missing one is made with `make`, else the
/// walk yields `None`.
fn through_dirs(root: &Path, rel: &Path, depth: usize, make: bool) -> io::Result<Option<PathBuf>> {
    let mut here = root.to_path_buf();
    for part in rel.components().take(depth) {
        here.push(part);
        match here.symlink_metadata() {
            Ok(m) if m.is_dir() => {}
            Ok(_) => {
                return Err(refused(format!(
                    "{:?} is placed through {:?}, which is a link or a file, not a directory",
                    rel,
                    here.strip_prefix(root).unwrap_or(&here)
                )));
            }
            Err(e) if e.kind() == io::ErrorKind::NotFound && make => std::fs::create_dir(&here)?,
            Err(e) if e.kind() == io::ErrorKind::NotFound => return Ok(None),
            Err(e) => return Err(e),
        }
    }
    Ok(Some(here))
}

/// `rel` made normal, or refused.
fn inside(rel: &Path) -> io::Result<PathBuf> {
    normal(rel).ok_or_else(|| refused(format!("{rel:?} leaves its directory")))
}

/// Makes every directory between `root` and `rel`'s last component, each
/// a real directory, and yields `root/rel`.
pub fn dirs_to(root: &Path, rel: &Path) -> io::Result<PathBuf> {
    let rel = inside(rel)?;
    let depth = rel.components().count().saturating_sub(1);
    let parent = through_dirs(root, &rel, depth, true)?.expect("made");
    Ok(match rel.file_name() {
        Some(name) => parent.join(name),
        None => parent,
    })
}

/// One step of a path being resolved.
enum Step {
    Up,
    Into(OsString),
}

/// `path`'s steps; `Err` when it is absolute.
fn steps(path: &Path) -> Result<Vec<Step>, String> {
    let mut out = Vec::new();
    for c in path.components() {
        match c {
            Component::CurDir => {}
            Component::ParentDir => out.push(Step::Up),
            Component::Normal(n) => out.push(Step::Into(n.to_owned())),
            Component::RootDir | Component::Prefix(_) => return Err("it is absolute".into()),
        }
    }
    Ok(out)
}

/// Whether `rel` (from `root`) stays below `root` when every symlink met
/// on the way is followed as the kernel would; `Err` says why not (a `..`
/// above `root`, an absolute target, a loop). A part that does not exist
/// is taken as written: nothing there can lead elsewhere.
fn resolve(root: &Path, rel: &Path) -> Result<(), String> {
    let mut at: Vec<OsString> = Vec::new();
    let mut todo: VecDeque<Step> = steps(rel)?.into();
    let mut hops = 0;
    while let Some(step) = todo.pop_front() {
        let name = match step {
            Step::Up => {
                at.pop().ok_or("it climbs above the artifact's directory")?;
                continue;
            }
            Step::Into(name) => name,
        };
        at.push(name);
        let here: PathBuf = at.iter().fold(root.to_path_buf(), |p, c| p.join(c));
        let is_link = here
            .symlink_metadata()
            .is_ok_and(|m| m.file_type().is_symlink());
        if !is_link {
            continue;
        }
        hops += 1;
        if hops > MAX_HOPS {
            return Err("its links loop".into());
        }
        let target = std::fs::read_link(&here).map_err(|e| e.to_string())?;
        at.pop();
        for step in steps(&target)?.into_iter().rev() {
            todo.push_front(step);
        }
    }
    Ok(())
}

/// The first symlink under `root` that leads out of it once followed
/// (through the other links of the tree as they are now), with why; the
/// walk itself follows no link.
pub fn escaping_link(root: &Path) -> io::Result<Option<(PathBuf, String)>> {
    let mut stack = vec![PathBuf::new()];
    while let Some(dir) = stack.pop() {
        for entry in std::fs::read_dir(root.join(&dir))? {
            let entry = entry?;
            let rel = dir.join(entry.file_name());
            let kind = entry.file_type()?;
            if kind.is_dir() {
                stack.push(rel);
            } else if kind.is_symlink()
                && let Err(why) = resolve(root, &rel)
            {
                let target = std::fs::read_link(root.join(&rel))?;
                return Ok(Some((rel, format!("links to {target:?}: {why}"))));
            }
        }
    }
    Ok(None)
}

/// The regular file at `rel` under `root`, reached through real
/// directories only (for a tar hard link's source).
pub fn existing_file(root: &Path, rel: &Path) -> io::Result<PathBuf> {
    let rel = inside(rel)?;
    let depth = rel.components().count().saturating_sub(1);
    let found = through_dirs(root, &rel, depth, false)?
        .zip(rel.file_name())
        .map(|(parent, name)| parent.join(name))
        .filter(|file| file.symlink_metadata().is_ok_and(|m| m.is_file()));
    found.ok_or_else(|| refused(format!("{rel:?} is not a regular file")))
}

/// The directory at `rel` under `root` if it is one, reached through
/// real directories; `None` if nothing is there; refused (`InvalidInput`)
/// when a link or a file stands on the way or at its place.
pub fn real_dir(root: &Path, rel: &Path) -> io::Result<Option<PathBuf>> {
    let rel = inside(rel)?;
    through_dirs(root, &rel, usize::MAX, false)
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::unix::fs::symlink;

    #[test]
    fn nothing_is_placed_through_a_link() {
        let dir = tempfile::tempdir().unwrap();
        let root = dir.path().join("root");
        std::fs::create_dir(&root).unwrap();
        symlink("..", root.join("up")).unwrap();
        std::fs::write(root.join("file"), b"x").unwrap();
        assert_eq!(
            dirs_to(&root, Path::new("a/b/c.bin")).unwrap(),
            root.join("a/b/c.bin")
        );
        assert!(root.join("a/b").is_dir());
        for through in ["up/escaped.bin", "up/x/y", "file/z", "../out"] {
            let err = dirs_to(&root, Path::new(through)).unwrap_err();
            assert_eq!(err.kind(), io::ErrorKind::InvalidInput, "{through}");
        }
        assert!(!dir.path().join("escaped.bin").exists() && !dir.path().join("x").exists());
        // The last part may be a link: what is placed there replaces it.
        assert_eq!(dirs_to(&root, Path::new("up")).unwrap(), root.join("up"));
    }

    #[test]
    fn a_chain_of_links_each_inside_on_its_own_is_judged_where_it_really_leads() {
        let dir = tempfile::tempdir().unwrap();
        let root = dir.path();
        // models/d/d/d/s -> ../../.. (back to models/), then s/t -> ../..:
        // lexically "d/d/d/s/t" is four deep and ../.. stays inside; it
        // really is models/t, and ../.. is above the root.
        std::fs::create_dir_all(root.join("models/d/d/d")).unwrap();
        symlink("../../..", root.join("models/d/d/d/s")).unwrap();
        assert_eq!(escaping_link(root).unwrap(), None, "s leads to models/");
        symlink("../..", root.join("models/t")).unwrap();
        let (at, why) = escaping_link(root).unwrap().expect("t leads out");
        assert_eq!(at, Path::new("models/t"));
        assert!(why.contains("climbs above"), "{why}");
        std::fs::remove_file(root.join("models/t")).unwrap();
        // Through s: d/d/d/s/x -> ../.. is models/x -> ../.. (out).
        symlink("../../../../../x", root.join("models/d/d/d/y")).unwrap();
        assert!(escaping_link(root).unwrap().is_some());
        std::fs::remove_file(root.join("models/d/d/d/y")).unwrap();
        symlink("d/d/d/s/../..", root.join("models/q")).unwrap();
        assert!(
            escaping_link(root).unwrap().is_some(),
            "s is models/, so s/../.. is above the root"
        );
        std::fs::remove_file(root.join("models/q")).unwrap();
        for (name, target) in [("abs", "/etc/passwd"), ("loop", "loop/x")] {
            symlink(target, root.join(name)).unwrap();
            assert!(escaping_link(root).unwrap().is_some(), "{name}");
            std::fs::remove_file(root.join(name)).unwrap();
        }
        // Links that stay inside, dangling ones too, pass.
        symlink("models/d", root.join("ok")).unwrap();
        symlink("nothere/../models", root.join("dangles")).unwrap();
        assert_eq!(escaping_link(root).unwrap(), None);
    }

    #[test]
    fn a_hard_links_source_is_a_file_reached_through_directories() {
        let dir = tempfile::tempdir().unwrap();
        let root = dir.path();
        std::fs::create_dir(root.join("d")).unwrap();
        std::fs::write(root.join("d/w.bin"), b"w").unwrap();
        symlink("d", root.join("l")).unwrap();
        assert_eq!(
            existing_file(root, Path::new("d/w.bin")).unwrap(),
            root.join("d/w.bin")
        );
        for bad in ["l/w.bin", "d", "l", "../x", "nothere"] {
            assert!(existing_file(root, Path::new(bad)).is_err(), "{bad}");
        }
    }
}
