//! The node agent's one HTTP client stack (reqwest over rustls, as
//! oci-client's own), for both its reads: http(s) artifact files and the
//! OCI registry reads of [`super::distribution`]. One redirect rule for
//! both, in [`followed`]:
//!
//! - a hop is followed when it is under an allowed http(s) source
//!   (`--allowed-sources`), at most [`MAX_REDIRECTS`] times;
//! - for a registry read, also on the registry's own https origin (the
//!   origin of the request that began the chain);
//! - anything else stops the chain with a reason that names the target
//!   and the allowed sources: a permanent failure, as it can never succeed
//!   as it stands. Credentials never travel to another host (reqwest
//!   drops `Authorization` when the host changes).

use std::time::Duration;

/// Redirects followed per request at most (object stores and CDNs answer
/// one or two).
pub const MAX_REDIRECTS: usize = 5;

/// Whose reads a client makes: the rule's registry clause applies to
/// registry reads only, so a file under an allowed prefix cannot be
/// redirected elsewhere on its host.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Reads {
    /// http(s) artifact files.
    Files,
    /// A registry's manifests and blobs.
    Registry,
}

/// A pooled client for `reads`, trusting the system's roots and `ca_pem`
/// (a CA bundle for registries with private certificates), following
/// redirects by [`followed`].
pub fn client(
    reads: Reads,
    ca_pem: Option<&[u8]>,
    allowed: &[String],
) -> Result<reqwest::Client, String> {
    // The tree's TLS is ring's; reqwest (and oci-client through it) takes
    // the process's provider and panics if none was installed yet.
    let _ = rustls::crypto::ring::default_provider().install_default();
    let allowed = allowed.to_vec();
    let policy = reqwest::redirect::Policy::custom(move |attempt| {
        if attempt.previous().len() > MAX_REDIRECTS {
            return attempt.error(format!("more than {MAX_REDIRECTS} times"));
        }
        let next = attempt.url().as_str().to_owned();
        // The chain's first URL is the request that began it.
        let first = attempt.previous().first().map_or("", |u| u.as_str());
        if followed(reads, &next, first, &allowed) {
            return attempt.follow();
        }
        let what = match reads {
            Reads::Files => "which is not under an allowed source",
            Reads::Registry => "which is neither the registry nor under an allowed source",
        };
        let why = format!(
            "({}) to {next}, {what} (--allowed-sources: {})",
            attempt.status(),
            allowed.join(", ")
        );
        attempt.error(why)
    });
    let mut builder = reqwest::Client::builder()
        .redirect(policy)
        .connect_timeout(Duration::from_secs(10))
        .read_timeout(Duration::from_secs(60));
    if let Some(pem) = ca_pem {
        let certs = reqwest::Certificate::from_pem_bundle(pem)
            .map_err(|e| format!("the registry CA bundle: {e}"))?;
        for cert in certs {
            builder = builder.add_root_certificate(cert);
        }
    }
    builder.build().map_err(|e| e.to_string())
}

/// Whether a redirect to `next` is followed in a chain of `reads` that
/// began at `first`: under an allowed http(s) prefix, or, for a registry
/// read, on that registry's own https origin.
pub fn followed(reads: Reads, next: &str, first: &str, allowed: &[String]) -> bool {
    if reads == Reads::Registry {
        let own = first
            .parse::<http::Uri>()
            .ok()
            .filter(|u| u.scheme_str() == Some("https"))
            .and_then(|u| u.authority().map(|a| format!("https://{a}/")));
        if own.is_some_and(|own| next.starts_with(&own)) {
            return true;
        }
    }
    let Ok(uri) = next.parse::<http::Uri>() else {
        return false;
    };
    allowed
        .iter()
        .filter(|p| p.starts_with("http://") || p.starts_with("https://"))
        .any(|prefix| super::fetch::is_under(&uri, prefix))
}

/// A refused redirect's reason, as the rule gave it (reqwest wraps it).
pub fn redirect_reason(e: &reqwest::Error) -> Option<String> {
    e.is_redirect()
        .then(|| std::error::Error::source(e).map_or_else(|| e.to_string(), |s| s.to_string()))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn redirects_are_followed_to_the_registry_or_allowed_http_sources_only() {
        // The read that began the chain.
        let own = "https://reg.example:5000/v2/x/manifests/v1";
        let allowed = [
            "oci://reg.example:5000/models".to_owned(),
            "https://cdn.example/blobs".to_owned(),
        ];
        let registry = |next: &str| followed(Reads::Registry, next, own, &allowed);
        assert!(registry("https://reg.example:5000/v2/x/blobs/y"));
        assert!(registry("https://cdn.example/blobs/sha256/y"));
        // Plain http to the same host, another port, another host, a path
        // beside the allowed one: all refused.
        assert!(!registry("http://reg.example:5000/v2/x"));
        assert!(!registry("https://reg.example:5001/v2/x"));
        assert!(!registry("http://127.0.0.1:9/anything"));
        assert!(!registry("https://cdn.example/blobsmith/y"));
        // An oci:// prefix allows the registry, not an http host of that name.
        assert!(!registry("https://reg.example:5000.evil/v2"));
    }

    #[test]
    fn a_files_redirect_is_followed_only_under_an_allowed_source() {
        let first = "https://store.example/models/a.bin";
        let allowed = ["https://store.example/models/".to_owned()];
        let files = |next: &str| followed(Reads::Files, next, first, &allowed);
        assert!(files("https://store.example/models/b/a.bin"));
        // The same host outside the prefix: not for files (the registry
        // clause is a registry read's only).
        assert!(!files("https://store.example/private/a.bin"));
        assert!(!files("http://store.example/models/a.bin"));
    }
}
