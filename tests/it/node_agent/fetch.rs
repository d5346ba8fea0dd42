//! Fetching model artifacts onto a real disk from a real HTTP server the
//! test starts: verified, renamed into place, never half-visible, and every
//! failure with its reason and nothing left behind.

use crate::support::artifact_server::{serve, serve_logged, sha256_hex, weights};
use model_residency::node_agent::fetch::{
    FetchError, FileSource, PARTIAL_PREFIX, Progress, client, disk_usage, fetch, size_limit,
};
use std::net::SocketAddr;
use std::path::Path;
use std::sync::atomic::Ordering;

fn source(addr: SocketAddr, path: &str, sha256: Option<String>) -> FileSource {
    FileSource {
        uri: format!("http://{addr}{path}"),
        path: None,
        sha256,
    }
}

/// Removes artifact `w` and the blob store (which would link its file by
/// its sha256 instead of fetching it again).
fn forget(cache: &Path) {
    std::fs::remove_dir_all(cache.join("w")).unwrap();
    let _ = std::fs::remove_dir_all(cache.join(model_residency::node_agent::blobs::STORE_DIR));
}

/// Everything in the cache directory, by name, but the blob store (its
/// blobs are linked from the artifacts listed).
fn entries(cache: &Path) -> Vec<String> {
    let mut names: Vec<String> = std::fs::read_dir(cache)
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .filter(|n| n != model_residency::node_agent::blobs::STORE_DIR)
        .collect();
    names.sort();
    names
}

#[tokio::test]
async fn an_artifact_is_fetched_verified_and_renamed_into_place() {
    let (addr, _) = serve().await;
    let cache = tempfile::tempdir().unwrap();
    let allowed = vec![format!("http://{addr}/")];
    let files = [
        source(addr, "/weights.bin", Some(sha256_hex(&weights()))),
        FileSource {
            path: Some("conf/config.json".into()),
            ..source(addr, "/config.json", None)
        },
    ];
    let progress = Progress::default();
    let client = client(&allowed).unwrap();
    let fetched = fetch(
        &client,
        cache.path(),
        "qwen",
        &files,
        300 * 1024,
        &allowed,
        &progress,
    )
    .await
    .unwrap();
    // Two files: the recorded sha256 is that of their manifest.
    let manifest = format!(
        "{}  weights.bin\n{}  conf/config.json\n",
        sha256_hex(&weights()),
        sha256_hex(br#"{"layers": 2}"#)
    );
    assert_eq!(fetched.sha256, sha256_hex(manifest.as_bytes()));
    let bytes = fetched.bytes;
    assert_eq!(bytes, weights().len() as u64 + 13);
    assert_eq!(progress.bytes.load(Ordering::Relaxed), bytes);
    assert_eq!(entries(cache.path()), ["qwen"]);
    let dir = cache.path().join("qwen");
    assert_eq!(std::fs::read(dir.join("weights.bin")).unwrap(), weights());
    assert_eq!(
        std::fs::read_to_string(dir.join("conf/config.json")).unwrap(),
        r#"{"layers": 2}"#
    );
    assert_eq!(disk_usage(&dir).unwrap(), bytes);
}

#[tokio::test]
async fn each_failure_says_why_and_leaves_nothing_behind() {
    let (addr, requests) = serve().await;
    let cache = tempfile::tempdir().unwrap();
    let allowed = vec![format!("http://{addr}/")];
    let client = client(&allowed).unwrap();
    // A good artifact already in place must not be disturbed by the
    // failures of others.
    fetch(
        &client,
        cache.path(),
        "good",
        &[source(addr, "/weights.bin", None)],
        1 << 20,
        &allowed,
        &Progress::default(),
    )
    .await
    .unwrap();
    let run = |key: &'static str, files: Vec<FileSource>, declared: u64, allowed: Vec<String>| {
        let (client, cache) = (client.clone(), cache.path().to_owned());
        async move {
            fetch(
                &client,
                &cache,
                key,
                &files,
                declared,
                &allowed,
                &Progress::default(),
            )
            .await
            .unwrap_err()
        }
    };

    let wrong = "0".repeat(64);
    let e = run(
        "sum",
        vec![source(addr, "/weights.bin", Some(wrong.clone()))],
        1 << 20,
        allowed.clone(),
    )
    .await;
    assert!(
        matches!(&e, FetchError::ChecksumMismatch { want, got, .. } if *want == wrong && *got == sha256_hex(&weights())),
        "{e}"
    );
    assert_eq!(e.reason(), "ChecksumMismatch");

    let before = requests.load(Ordering::Relaxed);
    let e = run(
        "elsewhere",
        vec![source(addr, "/weights.bin", None)],
        1 << 20,
        vec!["http://models.internal/".into()],
    )
    .await;
    assert_eq!(e.reason(), "SourceNotAllowed");
    assert!(e.to_string().contains("models.internal"), "{e}");
    let e = run(
        "nothing-allowed",
        vec![source(addr, "/weights.bin", None)],
        1 << 20,
        vec![],
    )
    .await;
    assert!(e.to_string().contains("every source is refused"), "{e}");
    let escape = FileSource {
        path: Some("../../etc/cron.d/x".into()),
        ..source(addr, "/weights.bin", None)
    };
    let e = run("escape", vec![escape], 1 << 20, allowed.clone()).await;
    assert_eq!(e.reason(), "InvalidArtifact");
    assert_eq!(
        requests.load(Ordering::Relaxed),
        before,
        "refused before any request"
    );

    let e = run(
        "missing",
        vec![source(addr, "/missing", None)],
        1 << 20,
        allowed.clone(),
    )
    .await;
    assert!(matches!(e, FetchError::Status { status: 404, .. }), "{e}");
    assert!(e.retryable());

    let e = run(
        "cut",
        vec![source(addr, "/cut", None)],
        1 << 20,
        allowed.clone(),
    )
    .await;
    assert!(matches!(e, FetchError::Transfer { .. }), "{e}");

    let e = run(
        "runaway",
        vec![source(addr, "/endless", None)],
        1 << 20,
        allowed.clone(),
    )
    .await;
    assert!(
        matches!(e, FetchError::TooLarge { declared, got } if declared == 1 << 20 && got <= size_limit(declared) + (64 << 10)),
        "{e}"
    );
    assert_eq!(e.reason(), "LargerThanDeclared");

    // Nothing half-written, nothing of the failed keys, the good one intact.
    assert_eq!(entries(cache.path()), ["good"]);
    assert_eq!(
        std::fs::read(cache.path().join("good/weights.bin")).unwrap(),
        weights()
    );
}

#[tokio::test]
async fn a_download_cut_short_resumes_where_it_stopped() {
    let (addr, _, log) = serve_logged().await;
    let cache = tempfile::tempdir().unwrap();
    let allowed = vec![format!("http://{addr}/")];
    let client = client(&allowed).unwrap();
    let get = |path: &'static str, sha: Option<String>| {
        let (client, cache, allowed) = (client.clone(), cache.path().to_owned(), allowed.clone());
        async move {
            fetch(
                &client,
                &cache,
                "w",
                &[source(addr, path, sha)],
                1 << 20,
                &allowed,
                &Progress::default(),
            )
            .await
        }
    };
    let sum = Some(sha256_hex(&weights()));
    let partial = cache.path().join(format!("{PARTIAL_PREFIX}w/weights.bin"));

    // The connection breaks after 64 KiB: they stay for the next try,
    // which asks for the rest only.
    let e = get("/flaky/weights.bin", sum.clone()).await.unwrap_err();
    assert!(matches!(e, FetchError::Transfer { .. }), "{e}");
    assert_eq!(std::fs::metadata(&partial).unwrap().len(), 64 * 1024);
    let fetched = get("/flaky/weights.bin", sum.clone()).await.unwrap();
    assert_eq!(
        (fetched.bytes, fetched.resumed),
        (weights().len() as u64, 64 * 1024)
    );
    assert_eq!(
        log.lock().unwrap().last().unwrap(),
        "/flaky/weights.bin bytes=65536-"
    );
    assert_eq!(
        std::fs::read(cache.path().join("w/weights.bin")).unwrap(),
        weights()
    );
    assert_eq!(
        entries(cache.path()),
        ["w"],
        "the partial became the artifact"
    );

    // A kept part that does not belong to the file (the source changed,
    // the disk lost it): the checksum catches it, the file starts over.
    forget(cache.path());
    std::fs::create_dir_all(partial.parent().unwrap()).unwrap();
    std::fs::write(&partial, vec![9u8; 1000]).unwrap();
    let e = get("/ranged/weights.bin", sum.clone()).await.unwrap_err();
    assert!(e.retryable(), "{e}");
    assert!(e.to_string().contains("starts over"), "{e}");
    assert!(!partial.exists(), "the bad part is gone");
    let fetched = get("/ranged/weights.bin", sum.clone()).await.unwrap();
    assert_eq!(fetched.resumed, 0);
    assert_eq!(log.lock().unwrap().last().unwrap(), "/ranged/weights.bin -");

    // A file that was complete: the source says there is nothing past its
    // end (416), and only its checksum is checked.
    forget(cache.path());
    std::fs::create_dir_all(partial.parent().unwrap()).unwrap();
    std::fs::write(&partial, weights()).unwrap();
    let fetched = get("/ranged/weights.bin", sum.clone()).await.unwrap();
    assert_eq!(fetched.resumed, weights().len() as u64);

    // A source that ignores ranges answers the whole file: it is written
    // over from the start.
    forget(cache.path());
    std::fs::create_dir_all(partial.parent().unwrap()).unwrap();
    std::fs::write(&partial, &weights()[..1000]).unwrap();
    let fetched = get("/weights.bin", sum.clone()).await.unwrap();
    assert_eq!(fetched.resumed, 0);
    assert_eq!(
        std::fs::read(cache.path().join("w/weights.bin")).unwrap(),
        weights()
    );

    // A kept part of a download that may no longer be made (its source
    // is not allowed any more) goes.
    forget(cache.path());
    std::fs::create_dir_all(partial.parent().unwrap()).unwrap();
    std::fs::write(&partial, &weights()[..1000]).unwrap();
    let e = fetch(
        &client,
        cache.path(),
        "w",
        &[source(addr, "/ranged/weights.bin", sum.clone())],
        1 << 20,
        &["http://models.internal/".to_owned()],
        &Progress::default(),
    )
    .await
    .unwrap_err();
    assert_eq!(e.reason(), "SourceNotAllowed");
    assert!(
        entries(cache.path()).is_empty(),
        "{:?}",
        entries(cache.path())
    );

    // Without a sha256 nothing could tell a kept part from a changed
    // source: such a file is never resumed, and nothing of it is kept.
    let e = get("/cut", None).await.unwrap_err();
    assert!(e.retryable(), "{e}");
    assert!(
        entries(cache.path()).is_empty(),
        "{:?}",
        entries(cache.path())
    );
}

#[tokio::test]
async fn redirects_are_followed_only_through_allowed_sources() {
    let (addr, _, log) = serve_logged().await;
    let cache = tempfile::tempdir().unwrap();
    let allowed = vec![format!("http://{addr}/store/")];
    let client = client(&allowed).unwrap();
    let sum = Some(sha256_hex(&weights()));
    let get = |path: &'static str| {
        let (client, cache, allowed, sum) = (&client, cache.path(), &allowed, sum.clone());
        async move {
            let files = [source(addr, path, sum)];
            let progress = Progress::default();
            fetch(client, cache, "m", &files, 300 * 1024, allowed, &progress).await
        }
    };
    // Two hops, both under the allowed source: fetched and verified.
    let fetched = get("/store/hop.bin").await.unwrap();
    assert_eq!(fetched.bytes, weights().len() as u64);
    assert_eq!(
        std::fs::read(cache.path().join("m/hop.bin")).unwrap(),
        weights()
    );
    let seen = log.lock().unwrap().clone();
    let seen: Vec<&str> = seen.iter().map(|l| l.split(' ').next().unwrap()).collect();
    assert_eq!(
        seen,
        [
            "/store/hop.bin",
            "/store/moved.bin",
            "/store/blobs/weights.bin"
        ]
    );
    // A file the store holds by its sha256 is linked without a request:
    // the store goes, so the cases below reach the network.
    std::fs::remove_dir_all(
        cache
            .path()
            .join(model_residency::node_agent::blobs::STORE_DIR),
    )
    .unwrap();
    // Out of the allowed source: permanent, says where, never fetched.
    log.lock().unwrap().clear();
    let e = get("/store/away.bin").await.unwrap_err();
    assert!(matches!(e, FetchError::Redirect { .. }), "{e}");
    assert_eq!(e.reason(), "SourceNotAllowed");
    assert!(!e.retryable());
    assert!(
        e.to_string()
            .contains("/weights.bin, which is not under an allowed source"),
        "{e}"
    );
    assert_eq!(
        log.lock().unwrap().len(),
        1,
        "the target outside was not asked"
    );
    // A loop, and a redirect without a Location.
    let e = get("/store/loop.bin").await.unwrap_err();
    assert!(e.to_string().contains("more than 5 times"), "{e}");
    let e = get("/store/nowhere.bin").await.unwrap_err();
    assert!(e.to_string().contains("without a Location"), "{e}");
    assert!(!e.retryable());
}
