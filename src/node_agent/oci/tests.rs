use super::*;

#[test]
fn references_are_parsed_and_admitted_by_registry_and_repository_prefix() {
    let s = Source::parse("oci://reg.example:5000/models/llama@sha256:0000000000000000000000000000000000000000000000000000000000000000").unwrap();
    assert_eq!(s.registry(), "reg.example:5000");
    assert!(s.digest().is_some());
    assert!(s.is_allowed(&["oci://reg.example:5000/models".into()]));
    assert!(s.is_allowed(&["oci://reg.example:5000/".into()]));
    assert!(
        !s.is_allowed(&["oci://reg.example:5000/mod".into()]),
        "segment boundary"
    );
    assert!(
        !s.is_allowed(&["oci://reg.example/models".into()]),
        "other port"
    );
    assert!(
        !s.is_allowed(&["https://reg.example:5000/".into()]),
        "not an oci prefix"
    );
    let t = Source::parse("oci://reg.example/models/llama:v1").unwrap();
    assert_eq!(t.digest(), None);
    // An IPv6 registry, bracketed as in a URL.
    let v6 = Source::parse("oci://[::1]:5000/models/llama:v1").unwrap();
    assert_eq!(v6.registry(), "[::1]:5000");
    assert_eq!(v6.reference.repository(), "models/llama");
    assert_eq!(v6.reference.tag(), Some("v1"));
    assert!(v6.is_allowed(&["oci://[::1]:5000/models".into()]));
    for bad in [
        "https://x/y",
        "oci://models/llama",
        "oci://reg.example",
        "oci://reg.example/UPPER",
        "oci://[::1:5000/models/x",
        "oci://[::zz]:5000/models/x",
        "oci://[::1]x/models/x",
    ] {
        assert!(Source::parse(bad).is_err(), "{bad}");
    }
}

#[test]
fn the_clients_errors_become_the_artifacts_reasons() {
    let s = Source::parse("oci://reg.example/models/a:v1").unwrap();
    let basic = RegistryAuth::Basic("u".into(), "p".into());
    let url = || "https://reg.example/v2/models/a/manifests/v1".to_owned();
    let envelope = |code: &str| -> oci_client::errors::OciEnvelope {
        serde_json::from_value(serde_json::json!({"errors": [{"code": code, "message": "m"}]}))
            .unwrap()
    };
    let cases: Vec<(OciDistributionError, Option<&str>, &RegistryAuth, &str)> = vec![
        (
            OciDistributionError::UnauthorizedError { url: url() },
            None,
            &RegistryAuth::Anonymous,
            "RegistryAuthFailed",
        ),
        (
            OciDistributionError::RegistryError {
                envelope: envelope("DENIED"),
                url: url(),
            },
            None,
            &basic,
            "RegistryAuthFailed",
        ),
        (
            OciDistributionError::RegistryError {
                envelope: envelope("MANIFEST_UNKNOWN"),
                url: url(),
            },
            None,
            &basic,
            "ManifestNotFound",
        ),
        (
            OciDistributionError::RegistryError {
                envelope: envelope("BLOB_UNKNOWN"),
                url: url(),
            },
            Some("sha256:ab"),
            &basic,
            "BlobNotFound",
        ),
        (
            OciDistributionError::ServerError {
                code: 404,
                url: url(),
                message: String::new(),
            },
            Some("sha256:ab"),
            &basic,
            "BlobNotFound",
        ),
        (
            OciDistributionError::ServerError {
                code: 503,
                url: url(),
                message: String::new(),
            },
            None,
            &basic,
            "RegistryUnavailable",
        ),
        (
            OciDistributionError::UnsupportedMediaTypeError("x/y".into()),
            None,
            &basic,
            "UnsupportedMediaType",
        ),
    ];
    for (e, blob, auth, want) in cases {
        let text = e.to_string();
        let got = registry_error(&s, auth, blob, e);
        assert_eq!(got.reason(), want, "{text}: {got}");
    }
    let anonymous = registry_error(
        &s,
        &RegistryAuth::Anonymous,
        None,
        OciDistributionError::UnauthorizedError { url: url() },
    );
    assert!(anonymous.to_string().contains("has none"), "{anonymous}");
    assert!(
        registry_error(
            &s,
            &basic,
            None,
            OciDistributionError::ServerError {
                code: 503,
                url: url(),
                message: String::new()
            }
        )
        .retryable()
    );
}

#[test]
fn an_index_gives_its_only_entry_or_linux_on_this_architecture() {
    let s = Source::parse("oci://reg.example/models/a:v1").unwrap();
    let d = |n: u8| format!("sha256:{}", format!("{n:02x}").repeat(32));
    let arch = match std::env::consts::ARCH {
        "x86_64" => "amd64",
        "aarch64" => "arm64",
        other => other,
    };
    let one = serde_json::json!({"manifests": [{"digest": d(1)}]});
    assert_eq!(choose_from_index(&s, &one).unwrap(), d(1));
    let many = serde_json::json!({"manifests": [
        {"digest": d(1), "platform": {"os": "linux", "architecture": "s390x"}},
        {"digest": d(2), "platform": {"os": "linux", "architecture": arch}},
        {"digest": d(3), "platform": {"os": "windows", "architecture": arch}},
    ]});
    assert_eq!(choose_from_index(&s, &many).unwrap(), d(2));
    let ambiguous = serde_json::json!({"manifests": [{"digest": d(1)}, {"digest": d(2)}]});
    assert_eq!(
        choose_from_index(&s, &ambiguous).unwrap_err().reason(),
        "InvalidArtifact"
    );
}

#[test]
fn credentials_come_from_the_entry_for_the_registry() {
    let config = br#"{"auths": {
        "https://reg.example:5000/v1/": {"auth": "dXNlcjpwYXNz"},
        "tok.example": {"registrytoken": "abc"},
        "plain.example": {"username": "u", "password": "p"},
        "broken.example": {"auth": "%%%"}}}"#;
    assert_eq!(
        credentials_for(config, "reg.example:5000").unwrap(),
        RegistryAuth::Basic("user".into(), "pass".into())
    );
    assert_eq!(
        credentials_for(config, "tok.example").unwrap(),
        RegistryAuth::Bearer("abc".into())
    );
    assert_eq!(
        credentials_for(config, "plain.example").unwrap(),
        RegistryAuth::Basic("u".into(), "p".into())
    );
    assert_eq!(
        credentials_for(config, "other.example").unwrap(),
        RegistryAuth::Anonymous
    );
    assert!(credentials_for(config, "broken.example").is_err());
    assert!(credentials_for(b"[]", "x").is_err());
}

fn tar_with(build: impl FnOnce(&mut tar::Builder<Vec<u8>>)) -> Vec<u8> {
    let mut b = tar::Builder::new(Vec::new());
    build(&mut b);
    b.into_inner().unwrap()
}

fn header(path: &str, kind: tar::EntryType, size: u64) -> tar::Header {
    let mut h = tar::Header::new_gnu();
    // set_path refuses '..' and absolute paths: the name is written raw.
    let name = &mut h.as_gnu_mut().unwrap().name;
    name[..path.len()].copy_from_slice(path.as_bytes());
    h.set_entry_type(kind);
    h.set_size(size);
    h.set_mode(0o644);
    h.set_cksum();
    h
}

#[test]
fn a_tar_layer_with_a_path_out_a_link_out_or_a_device_is_refused_before_anything_is_written() {
    let dir = tempfile::tempdir().unwrap();
    let cases: Vec<(&str, Vec<u8>)> = vec![
        (
            "dotdot",
            tar_with(|b| {
                b.append(
                    &header("models/../../etc/passwd", tar::EntryType::Regular, 1),
                    &b"x"[..],
                )
                .unwrap();
            }),
        ),
        (
            "absolute",
            tar_with(|b| {
                b.append(
                    &header("/etc/passwd", tar::EntryType::Regular, 1),
                    &b"x"[..],
                )
                .unwrap();
            }),
        ),
        (
            "symlink out",
            tar_with(|b| {
                let mut h = header("models/evil", tar::EntryType::Symlink, 0);
                h.set_link_name("../../../etc/shadow").unwrap();
                h.set_cksum();
                b.append(&h, std::io::empty()).unwrap();
            }),
        ),
        (
            "device",
            tar_with(|b| {
                b.append(
                    &header("models/sda", tar::EntryType::Block, 0),
                    std::io::empty(),
                )
                .unwrap();
            }),
        ),
    ];
    for (name, bytes) in cases {
        let from = dir.path().join(format!("{name}.tar"));
        // A good file first: the refusal must come before it is written.
        let mut all = tar_with(|b| {
            b.append(
                &header("models/ok.txt", tar::EntryType::Regular, 2),
                &b"ok"[..],
            )
            .unwrap();
        });
        all.truncate(all.len() - 1024); // drop the end-of-archive blocks
        all.extend(bytes);
        std::fs::write(&from, all).unwrap();
        let to = dir.path().join(format!("out-{name}"));
        let err = unpack_layer(&from, &to, "none", 1 << 20, "sha256:test").unwrap_err();
        assert_eq!(err.reason(), "InvalidArtifact", "{name}: {err}");
        assert!(!to.exists(), "{name}: nothing written");
        let leftovers: Vec<_> = std::fs::read_dir(dir.path())
            .unwrap()
            .filter_map(|e| e.ok())
            .filter(|e| e.file_name().to_string_lossy().starts_with(".tmp"))
            .collect();
        assert!(leftovers.is_empty(), "{name}");
    }
    // A link that stays inside, and a gzip layer, unpack.
    let good = tar_with(|b| {
        b.append(
            &header("models/w.bin", tar::EntryType::Regular, 3),
            &b"abc"[..],
        )
        .unwrap();
        let mut h = header("models/alias", tar::EntryType::Symlink, 0);
        h.set_link_name("w.bin").unwrap();
        h.set_cksum();
        b.append(&h, std::io::empty()).unwrap();
    });
    let mut gz = flate2::write::GzEncoder::new(Vec::new(), flate2::Compression::fast());
    std::io::Write::write_all(&mut gz, &good).unwrap();
    let from = dir.path().join("good.tar.gz");
    std::fs::write(&from, gz.finish().unwrap()).unwrap();
    let to = dir.path().join("good");
    assert_eq!(unpack_layer(&from, &to, "gzip", 1 << 20, "d").unwrap(), 3);
    assert_eq!(std::fs::read(to.join("models/alias")).unwrap(), b"abc");
    // Larger than the room left: refused.
    let err = unpack_layer(&from, &dir.path().join("small"), "gzip", 2, "d").unwrap_err();
    assert_eq!(err.reason(), "LargerThanDeclared");
}

fn symlink(path: &str, target: &str) -> tar::Header {
    let mut h = header(path, tar::EntryType::Symlink, 0);
    h.set_link_name(target).unwrap();
    h.set_cksum();
    h
}

fn leftovers(dir: &Path) -> Vec<String> {
    std::fs::read_dir(dir)
        .unwrap()
        .filter_map(|e| e.ok())
        .map(|e| e.file_name().to_string_lossy().into_owned())
        .filter(|n| n.starts_with(".tmp"))
        .collect()
}

/// Writes `layer` as `<name>.tar` in `dir` and unpacks it into
/// `out-<name>` with `room`; where it went, and what came of it.
fn unpack_in(
    dir: &Path,
    name: &str,
    layer: Vec<u8>,
    room: u64,
) -> (PathBuf, Result<u64, FetchError>) {
    let from = dir.join(format!("{name}.tar"));
    std::fs::write(&from, layer).unwrap();
    let to = dir.join(format!("out-{name}"));
    let result = unpack_layer(&from, &to, "none", room, "sha256:t");
    (to, result)
}

#[test]
fn links_are_judged_where_they_really_lead_and_nothing_is_written_through_one() {
    let dir = tempfile::tempdir().unwrap();
    let outside = dir.path().join("outside");
    std::fs::create_dir(&outside).unwrap();
    let cases: Vec<(&str, Vec<u8>, &str)> = vec![
        (
            // s is models/, so t's ../../.. is above the layer: each
            // link is inside when read on its own.
            "chain",
            tar_with(|b| {
                let e = std::io::empty;
                b.append(&symlink("models/d/d/d/s", "../../.."), e())
                    .unwrap();
                b.append(&symlink("models/t", "d/d/d/s/../../.."), e())
                    .unwrap();
            }),
            "climbs above",
        ),
        (
            // The black-box round's chain: a file placed through s.
            "through a link",
            tar_with(|b| {
                b.append(&symlink("models/d/d/d/s", "../../.."), std::io::empty())
                    .unwrap();
                b.append(
                    &header("models/d/d/d/s/t/escaped.bin", tar::EntryType::Regular, 1),
                    &b"x"[..],
                )
                .unwrap();
            }),
            "placed through",
        ),
        (
            "hard link through a link",
            tar_with(|b| {
                b.append(&header("w/f.bin", tar::EntryType::Regular, 1), &b"x"[..])
                    .unwrap();
                b.append(&symlink("models/up", ".."), std::io::empty())
                    .unwrap();
                let mut h = header("models/h", tar::EntryType::Link, 0);
                h.set_link_name("models/up/w/f.bin").unwrap();
                h.set_cksum();
                b.append(&h, std::io::empty()).unwrap();
            }),
            "is placed through \"models/up\"",
        ),
    ];
    for (name, bytes, says) in cases {
        let (to, result) = unpack_in(dir.path(), name, bytes, 1 << 20);
        let err = result.unwrap_err();
        assert_eq!(err.reason(), "InvalidArtifact", "{name}: {err}");
        assert!(err.to_string().contains(says), "{name}: {err}");
        assert!(!to.exists(), "{name}");
        assert!(leftovers(dir.path()).is_empty(), "{name}");
    }
    assert!(
        !dir.path().join("t").exists() && !dir.path().join("escaped.bin").exists(),
        "nothing written outside"
    );
}

#[test]
fn tiny_files_and_empty_directories_count_as_the_blocks_they_take() {
    // 300 one-byte files and 300 empty directories: 600 bytes of
    // files, 2.4 MB of blocks.
    let layer = tar_with(|b| {
        for i in 0..300 {
            b.append(
                &header(&format!("models/f{i}"), tar::EntryType::Regular, 1),
                &b"x"[..],
            )
            .unwrap();
            b.append(
                &header(&format!("models/d{i}/"), tar::EntryType::Directory, 0),
                std::io::empty(),
            )
            .unwrap();
        }
    });
    let dir = tempfile::tempdir().unwrap();
    let (to, result) = unpack_in(dir.path(), "tiny", layer.clone(), 1 << 20);
    let err = result.unwrap_err();
    assert_eq!(err.reason(), "LargerThanDeclared", "{err}");
    assert!(!to.exists());
    assert_eq!(
        unpack_in(dir.path(), "tiny", layer, 4 << 20).1.unwrap(),
        300
    );
}

#[test]
fn a_pax_size_counts_and_the_room_is_what_is_written() {
    // A PAX record saying 300Ki before a ustar header saying 0: the
    // reader takes 300Ki of data for the entry.
    let big = 300u64 << 10;
    let record = |value: &str| {
        let body = format!(" size={value}\n");
        let mut n = body.len() + 1;
        while format!("{n}{body}").len() != n {
            n += 1;
        }
        format!("{n}{body}")
    };
    let pax = record(&big.to_string());
    let bomb = tar_with(|b| {
        let h = header(
            "./PaxHeaders/big",
            tar::EntryType::XHeader,
            pax.len() as u64,
        );
        b.append(&h, pax.as_bytes()).unwrap();
        let h = header("models/big.bin", tar::EntryType::Regular, 0);
        b.append(&h, std::io::empty()).unwrap();
        // The data the PAX size promises, after the header (a whole
        // number of blocks).
        b.get_mut().extend(std::iter::repeat_n(0u8, big as usize));
    });
    let dir = tempfile::tempdir().unwrap();
    let (to, result) = unpack_in(dir.path(), "bomb", bomb.clone(), 100 << 10);
    let err = result.unwrap_err();
    assert_eq!(err.reason(), "LargerThanDeclared", "{err}");
    // Its message says what the headers claim, not bytes it read.
    assert!(
        matches!(err, FetchError::LayersTooLarge { declared, claimed } if declared == 100 << 10 && claimed == big),
        "{err}"
    );
    assert!(err.to_string().contains("nothing was unpacked"), "{err}");
    assert!(!to.exists() && leftovers(dir.path()).is_empty());
    // With room for it, it is unpacked at its real size.
    assert_eq!(unpack_in(dir.path(), "bomb", bomb, 1 << 20).1.unwrap(), big);
}
