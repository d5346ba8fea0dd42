//! What may be fetched, checked before anything is: each source against
//! `--allowed-sources` (by origin and path, not by text), each `path`
//! against escaping the model's directory, each sha256 read.

use super::*;

/// A checked file: where it goes and what it must hash to.
#[derive(Debug)]
pub(crate) struct Checked {
    pub(super) uri: String,
    pub(super) path: PathBuf,
    pub(super) sha256: Option<Vec<u8>>,
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
pub(crate) fn has_dot_segments(path: &str) -> bool {
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
pub(crate) fn check(files: &[FileSource], allowed: &[String]) -> Result<Vec<Checked>, FetchError> {
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
pub(crate) fn inside_path(raw: &str) -> Option<PathBuf> {
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

pub(crate) fn decode_hex(s: &str) -> Option<Vec<u8>> {
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
