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
