//! Artifacts from a real OCI registry: Debian's docker-registry on
//! loopback with TLS (a CA the test makes) and htpasswd auth, artifacts
//! pushed through the same OCI client the node agent pulls with.

use super::{
    Agent, artifact_state, bytes_on_disk, cached, create, model, node_cache, start_agent_with,
    status_of,
};
use crate::support::operator::Harness;
use k8s_openapi::api::core::v1::Secret;
use kube::api::{Api, PostParams};
use model_residency::api::{ArtifactState, ModelState};
use model_residency::local::registry::{
    LocalRegistry, PASSWORD, USER, docker_config, sha256_digest, tar_gz,
};
use model_residency::quantity::parse_bytes;
use serde_json::json;
use std::path::Path;

const OCTETS: &str = "application/octet-stream";
const TAR_GZ: &str = "application/vnd.oci.image.layer.v1.tar+gzip";

fn registry() -> LocalRegistry {
    LocalRegistry::start().unwrap_or_else(|e| panic!("the test registry: {e}"))
}

/// `n` bytes that differ by `seed`.
fn bytes(n: usize, seed: u8) -> Vec<u8> {
    (0..n)
        .map(|i| (i as u8).wrapping_mul(31).wrapping_add(seed))
        .collect()
}

/// The credentials Secret, with `password`.
async fn credentials(h: &Harness, registry: &LocalRegistry, password: &str) {
    let api: Api<Secret> = Api::namespaced(h.env.client.clone(), &h.env.namespace);
    let config = docker_config(&registry.host(), USER, password);
    let secret: Secret = serde_json::from_value(json!({
        "metadata": {"name": "regcred"},
        "type": "kubernetes.io/dockerconfigjson",
        "stringData": {".dockerconfigjson": config},
    }))
    .unwrap();
    let _ = api.delete("regcred", &Default::default()).await;
    api.create(&PostParams::default(), &secret).await.unwrap();
}

/// An agent allowed the registry's `models/` repositories, trusting its
/// CA, with the `regcred` Secret (or none).
fn agent(h: &Harness, cache: &Path, budget: &str, registry: &LocalRegistry, creds: bool) -> Agent {
    let mut extra = vec![
        "--registry-ca-file".to_owned(),
        registry.ca_file().display().to_string(),
    ];
    if creds {
        extra.extend(["--registry-credentials", "regcred", "--namespace"].map(String::from));
        extra.push(h.env.namespace.clone());
    }
    start_agent_with(
        h,
        cache,
        budget,
        &format!("oci://{}/models", registry.host()),
        &extra,
    )
}

fn oci(registry: &LocalRegistry, repo_and_ref: &str, size: &str) -> serde_json::Value {
    json!({"source": format!("oci://{}/{repo_and_ref}", registry.host()), "size": size})
}

/// A residency `gpu` whose one model `r` is `models/r@<digest>` of
/// `size`, and a request for it.
async fn request_r(h: &Harness, registry: &LocalRegistry, digest: &str, size: &str) {
    let artifact = oci(registry, &format!("models/r@{digest}"), size);
    create(h, "gpu", "8Gi", vec![model("r", "1Gi", Some(artifact))], 0).await;
    h.request_nowait("gpu", "r").await;
}

/// Waits until `model` is Loaded; the directory its pod mounts.
async fn loaded_dir(h: &Harness, model: &str) -> std::path::PathBuf {
    let r = h.until_state("gpu", model, ModelState::Loaded, 60).await;
    let pod: k8s_openapi::api::core::v1::Pod = h
        .pods
        .get(status_of(&r, model).pod.as_ref().unwrap())
        .await
        .unwrap();
    let volume = &pod.spec.unwrap().volumes.unwrap()[0];
    volume.host_path.as_ref().unwrap().path.clone().into()
}

async fn cache_status(h: &Harness) -> model_residency::api::NodeModelCacheStatus {
    node_cache(h).await.unwrap().status.unwrap()
}

#[tokio::test]
#[ignore = "needs the local control plane: scripts/test.sh runs it with --include-ignored"]
async fn oras_artifacts_are_pulled_by_digest_and_tag_and_a_shared_layer_is_stored_once() {
    let reg = registry();
    let h = Harness::start("oci-shared").await;
    // a and b share a 200Ki weights layer; a has 100Ki of its own, b 10Ki.
    let shared = bytes(200 << 10, 1);
    let (a_own, b_own) = (bytes(100 << 10, 2), bytes(10 << 10, 3));
    let da = reg
        .push(
            "models/a",
            "v1",
            &[
                (OCTETS, &shared, Some("weights.bin")),
                (OCTETS, &a_own, Some("extra/a.bin")),
            ],
        )
        .await
        .unwrap();
    let db = reg
        .push(
            "models/b",
            "v1",
            &[
                (OCTETS, &shared, Some("weights.bin")),
                (OCTETS, &b_own, Some("b.bin")),
            ],
        )
        .await
        .unwrap();
    let dd = reg
        .push(
            "models/d",
            "v1",
            &[(OCTETS, &bytes(150 << 10, 4), Some("d.bin"))],
        )
        .await
        .unwrap();
    credentials(&h, &reg, PASSWORD).await;
    let dir = tempfile::tempdir().unwrap();
    let cache = dir.path().join("cache");
    // 450Ki: a and b together declare 530Ki but hold 310Ki.
    let agent = agent(&h, &cache, "450Ki", &reg, true);
    create(
        &h,
        "gpu",
        "2Gi",
        vec![
            model(
                "a",
                "1Gi",
                Some(oci(&reg, &format!("models/a@{da}"), "310Ki")),
            ),
            // By tag: resolved once, recorded.
            model("b", "1Gi", Some(oci(&reg, "models/b:v1", "220Ki"))),
            model(
                "d",
                "1Gi",
                Some(oci(&reg, &format!("models/d@{dd}"), "200Ki")),
            ),
        ],
        0,
    )
    .await;
    h.request_nowait("gpu", "a").await;
    let host = loaded_dir(&h, "a").await;
    assert_eq!(
        std::fs::read(Path::new(&host).join("weights.bin")).unwrap(),
        shared
    );
    assert_eq!(
        std::fs::read(Path::new(&host).join("extra/a.bin")).unwrap(),
        a_own
    );
    h.request_nowait("gpu", "b").await;
    let r = h.until_state("gpu", "b", ModelState::Loaded, 60).await;
    assert_eq!(
        status_of(&r, "a").state,
        ModelState::Loaded,
        "both resident: 2Gi of VRAM"
    );
    let status = cache_status(&h).await;
    let digest_of = |m: &str| {
        status
            .artifacts
            .iter()
            .find(|x| x.model == m)
            .and_then(|x| x.digest.clone())
    };
    assert_eq!(digest_of("a").as_deref(), Some(da.as_str()));
    assert_eq!(
        digest_of("b").as_deref(),
        Some(db.as_str()),
        "the tag resolved to what was pushed"
    );
    let deduplicated = parse_bytes(status.deduplicated.as_deref().unwrap()).unwrap();
    assert_eq!(deduplicated, 200 << 10, "{status:?}");
    let used = parse_bytes(status.used.as_deref().unwrap()).unwrap();
    assert_eq!(used, (200 + 100 + 10) << 10, "each blob once: {status:?}");
    assert!(bytes_on_disk(&cache) <= 450 << 10);
    const M: &str = "model_residency_node_agent_";
    assert_eq!(
        agent.metric(&format!("{M}shared_bytes_total"), "").await,
        200 << 10,
        "b's weights were linked, not fetched"
    );
    assert_eq!(
        agent.metric(&format!("{M}fetched_bytes_total"), "").await,
        (200 + 100 + 10) << 10,
        "each blob fetched once"
    );

    // d needs room: a (no longer resident) goes, and with it only its own
    // 100Ki; the weights stay for b.
    h.request_nowait("gpu", "d").await;
    h.until_state("gpu", "d", ModelState::Loaded, 60).await;
    assert_eq!(artifact_state(&h, "a").await, Some(ArtifactState::Evicted));
    assert_eq!(artifact_state(&h, "b").await, Some(ArtifactState::Ready));
    let b_dir = cache.join(
        cache_status(&h)
            .await
            .artifacts
            .iter()
            .find(|x| x.model == "b")
            .unwrap()
            .key
            .clone(),
    );
    assert_eq!(std::fs::read(b_dir.join("weights.bin")).unwrap(), shared);
    assert!(
        !cached(&cache)
            .iter()
            .any(|n| n.ends_with(sha256_digest(&a_own).trim_start_matches("sha256:"))),
        "a's own blob is gone: {:?}",
        cached(&cache)
    );
    let status = cache_status(&h).await;
    assert_eq!(
        status.conditions[0].status, "False",
        "never DiskFull: {status:?}"
    );
    assert!(bytes_on_disk(&cache) <= 450 << 10);
}

#[tokio::test]
#[ignore = "needs the local control plane: scripts/test.sh runs it with --include-ignored"]
async fn a_modelcar_image_is_unpacked_and_a_layer_that_escapes_is_refused_before_anything_is_written()
 {
    let reg = registry();
    let h = Harness::start("oci-tar").await;
    let layer = tar_gz(&[
        ("models/config.json", br#"{"arch":"llama"}"#),
        ("models/tok/vocab.txt", b"a b c"),
        ("etc/not-the-model", b"x"),
    ]);
    let dcar = reg
        .push("models/car", "v1", &[(TAR_GZ, &layer, None)])
        .await
        .unwrap();
    // A device node in a layer (and a good file before it).
    let mut evil = tar::Builder::new(Vec::new());
    let mut ok = tar::Header::new_gnu();
    ok.set_path("models/ok.txt").unwrap();
    ok.set_size(2);
    ok.set_cksum();
    evil.append(&ok, &b"ok"[..]).unwrap();
    let mut dev = tar::Header::new_gnu();
    dev.set_path("models/sda").unwrap();
    dev.set_entry_type(tar::EntryType::Block);
    dev.set_size(0);
    dev.set_cksum();
    evil.append(&dev, std::io::empty()).unwrap();
    let evil = evil.into_inner().unwrap();
    let devil = reg
        .push(
            "models/evil",
            "v1",
            &[("application/vnd.oci.image.layer.v1.tar", &evil, None)],
        )
        .await
        .unwrap();
    credentials(&h, &reg, PASSWORD).await;
    let dir = tempfile::tempdir().unwrap();
    let cache = dir.path().join("cache");
    let _agent = agent(&h, &cache, "10Mi", &reg, true);
    let mut elsewhere = oci(&reg, &format!("models/car@{dcar}"), "1Mi");
    elsewhere["path"] = json!("/nothere");
    create(
        &h,
        "gpu",
        "8Gi",
        vec![
            model(
                "car",
                "1Gi",
                Some(oci(&reg, &format!("models/car@{dcar}"), "1Mi")),
            ),
            model(
                "evil",
                "1Gi",
                Some(oci(&reg, &format!("models/evil@{devil}"), "1Mi")),
            ),
            model("elsewhere", "1Gi", Some(elsewhere)),
        ],
        0,
    )
    .await;
    h.request_nowait("gpu", "car").await;
    let host = loaded_dir(&h, "car").await;
    let host = host.as_path();
    assert_eq!(
        std::fs::read(host.join("config.json")).unwrap(),
        br#"{"arch":"llama"}"#
    );
    assert_eq!(std::fs::read(host.join("tok/vocab.txt")).unwrap(), b"a b c");
    assert!(
        !host.join("etc").exists() && !host.join("models").exists(),
        "only /models, at the top"
    );
    for (m, says) in [("evil", "device file"), ("elsewhere", "/nothere")] {
        h.request_nowait("gpu", m).await;
        let r = h.until_state("gpu", m, ModelState::Failed, 60).await;
        let st = status_of(&r, m);
        let message = st.message.as_deref().unwrap_or_default();
        assert!(
            message.contains("InvalidArtifact") && message.contains(says),
            "{m}: {st:?}"
        );
    }
    // Nothing of the refused layer was written: no view, no unpacked
    // layer, no blob left behind.
    let evil_hex = sha256_digest(&evil)
        .trim_start_matches("sha256:")
        .to_owned();
    let names = cached(&cache);
    assert!(
        !names
            .iter()
            .any(|n| n.contains("evil-") || n.contains(&evil_hex)),
        "{names:?}"
    );
}

/// A plain (uncompressed) tar of `files`.
fn plain_tar(files: &[(&str, &[u8])]) -> Vec<u8> {
    let mut builder = tar::Builder::new(Vec::new());
    for (path, bytes) in files {
        let mut h = tar::Header::new_gnu();
        h.set_size(bytes.len() as u64);
        h.set_mode(0o644);
        h.set_path(path).unwrap();
        h.set_cksum();
        builder.append(&h, *bytes).unwrap();
    }
    builder.into_inner().unwrap()
}

/// Pushes `layers` (media type, bytes, annotations) as an artifact of
/// `artifact_type` whose config is of `config_type`.
async fn push_format(
    reg: &LocalRegistry,
    repository: &str,
    artifact_type: &str,
    config_type: &str,
    layers: &[(&str, &[u8], serde_json::Value)],
) -> String {
    let plain: Vec<(&str, &[u8], Option<&str>)> =
        layers.iter().map(|(t, b, _)| (*t, *b, None)).collect();
    let annotations: Vec<serde_json::Value> = layers.iter().map(|(_, _, a)| a.clone()).collect();
    reg.push_edited(repository, "v1", &plain, |m| {
        m["artifactType"] = json!(artifact_type);
        m["config"]["mediaType"] = json!(config_type);
        for (layer, a) in m["layers"]
            .as_array_mut()
            .unwrap()
            .iter_mut()
            .zip(annotations)
        {
            if !a.is_null() {
                layer["annotations"] = a;
            }
        }
    })
    .await
    .unwrap()
}

#[tokio::test]
#[ignore = "needs the local control plane: scripts/test.sh runs it with --include-ignored"]
async fn modelpack_in_both_spellings_and_kitops_modelkits_land_as_their_files() {
    let reg = registry();
    let h = Harness::start("oci-formats").await;
    let weights = bytes(4096, 7);
    let config = tar_gz(&[
        ("config.json", br#"{"arch":"llama"}"#),
        ("tokenizer/tok.json", b"{}"),
    ]);
    // What modctl writes today: the legacy vnd.cnai.model spelling, a raw
    // weight named by org.cnai.model.filepath, no title.
    let legacy = push_format(
        &reg,
        "models/legacy",
        "application/vnd.cnai.model.manifest.v1+json",
        "application/vnd.cnai.model.config.v1+json",
        &[
            (
                "application/vnd.cnai.model.weight.v1.raw",
                &weights,
                json!({"org.cnai.model.filepath": "model.safetensors"}),
            ),
            (
                "application/vnd.cnai.model.weight.config.v1.tar+gzip",
                &config,
                json!({"org.cnai.model.filepath": "config.json"}),
            ),
        ],
    )
    .await;
    // The current spelling: an uncompressed tar of weights, a raw doc.
    let shards = plain_tar(&[("weights/a.bin", b"aaaa"), ("weights/b.bin", b"bbbb")]);
    let current = push_format(
        &reg,
        "models/current",
        "application/vnd.cncf.model.manifest.v1+json",
        "application/vnd.cncf.model.config.v1+json",
        &[
            (
                "application/vnd.cncf.model.weight.v1.tar",
                &shards,
                json!({"org.cncf.model.filepath": "weights"}),
            ),
            (
                "application/vnd.cncf.model.doc.v1.raw",
                b"# model card",
                json!({"org.cncf.model.filepath": "docs/README.md"}),
            ),
        ],
    )
    .await;
    // A KitOps ModelKit: tars of files from the kit's root.
    let kit_model = tar_gz(&[("model.gguf", b"GGUF")]);
    let kit_docs = tar_gz(&[("README.md", b"kit")]);
    let kit = push_format(
        &reg,
        "models/kit",
        "application/vnd.kitops.modelkit.manifest.v1+json",
        "application/vnd.kitops.modelkit.config.v1+json",
        &[
            (
                "application/vnd.kitops.modelkit.model.v1.tar+gzip",
                &kit_model,
                json!(null),
            ),
            (
                "application/vnd.kitops.modelkit.docs.v1.tar+gzip",
                &kit_docs,
                json!(null),
            ),
        ],
    )
    .await;
    // A raw layer whose filepath leads out, and one that names no file.
    let escape = push_format(
        &reg,
        "models/escape",
        "application/vnd.cncf.model.manifest.v1+json",
        "application/vnd.cncf.model.config.v1+json",
        &[(
            "application/vnd.cncf.model.weight.v1.raw",
            b"x",
            json!({"org.cncf.model.filepath": "../../etc/passwd"}),
        )],
    )
    .await;
    let unnamed = push_format(
        &reg,
        "models/unnamed",
        "application/vnd.cncf.model.manifest.v1+json",
        "application/vnd.cncf.model.config.v1+json",
        &[(
            "application/vnd.cncf.model.weight.v1.raw",
            b"x",
            json!(null),
        )],
    )
    .await;
    credentials(&h, &reg, PASSWORD).await;
    let dir = tempfile::tempdir().unwrap();
    let cache = dir.path().join("cache");
    let _agent = agent(&h, &cache, "10Mi", &reg, true);
    let models = [
        ("legacy", &legacy),
        ("current", &current),
        ("kit", &kit),
        ("escape", &escape),
        ("unnamed", &unnamed),
    ];
    let registry_models = models
        .iter()
        .map(|(m, d)| model(m, "1Gi", Some(oci(&reg, &format!("models/{m}@{d}"), "1Mi"))))
        .collect();
    create(&h, "gpu", "8Gi", registry_models, 0).await;
    let mut dirs = std::collections::BTreeMap::new();
    for m in ["legacy", "current", "kit"] {
        h.request_nowait("gpu", m).await;
        dirs.insert(m, loaded_dir(&h, m).await);
    }
    let read = |m: &str, path: &str| std::fs::read(dirs[m].join(path)).unwrap();
    assert_eq!(read("legacy", "model.safetensors"), weights);
    assert_eq!(read("legacy", "config.json"), br#"{"arch":"llama"}"#);
    assert_eq!(read("legacy", "tokenizer/tok.json"), b"{}");
    assert_eq!(read("current", "weights/a.bin"), b"aaaa");
    assert_eq!(read("current", "weights/b.bin"), b"bbbb");
    assert_eq!(read("current", "docs/README.md"), b"# model card");
    assert_eq!(read("kit", "model.gguf"), b"GGUF");
    assert_eq!(read("kit", "README.md"), b"kit");
    for (m, reason) in [
        ("escape", "InvalidArtifact"),
        ("unnamed", "UnsupportedMediaType"),
    ] {
        h.request_nowait("gpu", m).await;
        let r = h.until_state("gpu", m, ModelState::Failed, 60).await;
        let st = status_of(&r, m);
        let message = st.message.as_deref().unwrap_or_default();
        assert!(message.contains(reason), "{m}: {st:?}");
    }
}

#[tokio::test]
#[ignore = "needs the local control plane: scripts/test.sh runs it with --include-ignored"]
async fn each_registry_failure_has_its_reason_and_a_stopped_registry_is_waited_out() {
    let mut reg = registry();
    let h = Harness::start("oci-failures").await;
    let weights = bytes(64 << 10, 9);
    let dw = reg
        .push("models/w", "v1", &[(OCTETS, &weights, Some("w.bin"))])
        .await
        .unwrap();
    let w2 = bytes(32 << 10, 11);
    let dw2 = reg
        .push("models/w2", "v1", &[(OCTETS, &w2, Some("w2.bin"))])
        .await
        .unwrap();
    let gone = bytes(1000, 10);
    let dgone = reg
        .push("models/gone", "v1", &[(OCTETS, &gone, Some("g.bin"))])
        .await
        .unwrap();
    // The registry loses the blob's data after the push.
    let hex = sha256_digest(&gone)
        .trim_start_matches("sha256:")
        .to_owned();
    let data = reg
        .storage()
        .join("storage/docker/registry/v2/blobs/sha256")
        .join(&hex[..2])
        .join(&hex)
        .join("data");
    std::fs::remove_file(&data).unwrap();
    let nothing = sha256_digest(b"no such manifest");
    let danon = reg
        .push(
            "models/anon",
            "v1",
            &[(OCTETS, &bytes(1000, 12), Some("a.bin"))],
        )
        .await
        .unwrap();
    credentials(&h, &reg, "wrong-password").await;
    let dir = tempfile::tempdir().unwrap();
    let cache = dir.path().join("cache");
    let _agent = agent(&h, &cache, "10Mi", &reg, true);
    create(
        &h,
        "gpu",
        "8Gi",
        vec![
            model(
                "w",
                "1Gi",
                Some(oci(&reg, &format!("models/w@{dw}"), "1Mi")),
            ),
            model(
                "w2",
                "1Gi",
                Some(oci(&reg, &format!("models/w2@{dw2}"), "1Mi")),
            ),
            model(
                "gone",
                "1Gi",
                Some(oci(&reg, &format!("models/gone@{dgone}"), "1Mi")),
            ),
            model(
                "nothing",
                "1Gi",
                Some(oci(&reg, &format!("models/w@{nothing}"), "1Mi")),
            ),
            model(
                "outside",
                "1Gi",
                Some(json!({"source": format!("oci://{}/other/x:v1", reg.host()), "size": "1Mi"})),
            ),
            model(
                "anon",
                "1Gi",
                Some(oci(&reg, &format!("models/anon@{danon}"), "1Mi")),
            ),
        ],
        0,
    )
    .await;
    // Wrong credentials, then a Secret fixed: the retry succeeds.
    h.request_nowait("gpu", "w").await;
    let r = h.until_state("gpu", "w", ModelState::Failed, 60).await;
    let message = status_of(&r, "w").message.clone().unwrap_or_default();
    assert!(
        message.contains("RegistryAuthFailed") && message.contains("refused the credentials"),
        "{message}"
    );
    // The Secret fixed: the retry (5 s later) reads it and loads.
    credentials(&h, &reg, PASSWORD).await;
    h.until_state("gpu", "w", ModelState::Loaded, 60).await;
    // The registry stops: w2's pull fails as RegistryUnavailable; started
    // again, its retry loads it.
    reg.stop();
    h.request_nowait("gpu", "w2").await;
    crate::support::cluster::eventually(30, "w2's pull to find the registry down", || async {
        let status = cache_status(&h).await;
        let a = status.artifacts.iter().find(|x| x.model == "w2")?;
        (a.reason.as_deref() == Some("RegistryUnavailable")).then_some(())
    })
    .await;
    reg.resume().unwrap();
    let host = loaded_dir(&h, "w2").await;
    assert_eq!(std::fs::read(Path::new(&host).join("w2.bin")).unwrap(), w2);
    for (m, reason) in [
        ("gone", "BlobNotFound"),
        ("nothing", "ManifestNotFound"),
        ("outside", "SourceNotAllowed"),
    ] {
        h.request_nowait("gpu", m).await;
        let r = h.until_state("gpu", m, ModelState::Failed, 60).await;
        let message = status_of(&r, m).message.clone().unwrap_or_default();
        assert!(message.contains(reason), "{m}: {message}");
    }
    let names = cached(&cache);
    assert!(
        !names
            .iter()
            .any(|n| n.contains(&hex) || n.contains("gone-")),
        "nothing half-written: {names:?}"
    );
    // The Secret deleted: the pull is anonymous (a registry that needs no
    // credentials would serve it); this one refuses, and says which
    // Secret was missing.
    let secrets: Api<Secret> = Api::namespaced(h.env.client.clone(), &h.env.namespace);
    secrets
        .delete("regcred", &Default::default())
        .await
        .unwrap();
    h.request_nowait("gpu", "anon").await;
    let r = h.until_state("gpu", "anon", ModelState::Failed, 60).await;
    let message = status_of(&r, "anon").message.clone().unwrap_or_default();
    assert!(
        message.contains("RegistryAuthFailed")
            && message.contains("tried anonymously: the credentials Secret")
            && message.contains("regcred does not exist"),
        "{message}"
    );
}

#[tokio::test]
#[ignore = "needs the local control plane: scripts/test.sh runs it with --include-ignored"]
async fn a_blob_an_agent_was_killed_in_the_middle_of_resumes_where_it_stopped() {
    let reg = registry();
    let h = Harness::start("oci-resume").await;
    let weights = bytes(2 << 20, 12);
    let d = reg
        .push("models/r", "v1", &[(OCTETS, &weights, Some("w.bin"))])
        .await
        .unwrap();
    credentials(&h, &reg, PASSWORD).await;
    // What an agent killed mid-blob leaves: the first MiB of the blob in
    // the store's partial file.
    let dir = tempfile::tempdir().unwrap();
    let cache = dir.path().join("cache");
    let hex = sha256_digest(&weights)
        .trim_start_matches("sha256:")
        .to_owned();
    let partial = cache.join(".blobs/partial").join(&hex);
    std::fs::create_dir_all(partial.parent().unwrap()).unwrap();
    std::fs::write(&partial, &weights[..1 << 20]).unwrap();
    request_r(&h, &reg, &d, "3Mi").await;
    h.until_state("gpu", "r", ModelState::Fetching, 30).await;
    // The model is resident (Fetching) when the agent comes back.
    let agent = agent(&h, &cache, "10Mi", &reg, true);
    let host = loaded_dir(&h, "r").await;
    assert_eq!(
        std::fs::read(Path::new(&host).join("w.bin")).unwrap(),
        weights
    );
    const M: &str = "model_residency_node_agent_";
    assert_eq!(
        agent.metric(&format!("{M}resumed_bytes_total"), "").await,
        1 << 20
    );
    assert_eq!(
        agent.metric(&format!("{M}fetched_bytes_total"), "").await,
        1 << 20,
        "only the rest was asked for"
    );
    assert!(!partial.exists(), "the partial became the blob");
}

/// A tar layer of symlinks (path, target) and files (path, bytes).
fn tar_of(links: &[(&str, &str)], files: &[(&str, &[u8])]) -> Vec<u8> {
    let mut b = tar::Builder::new(Vec::new());
    // append_link and append_data write GNU long names where needed.
    for (path, target) in links {
        let mut h = tar::Header::new_gnu();
        h.set_entry_type(tar::EntryType::Symlink);
        h.set_size(0);
        b.append_link(&mut h, path, target).unwrap();
    }
    for (path, bytes) in files {
        let mut h = tar::Header::new_gnu();
        h.set_size(bytes.len() as u64);
        h.set_mode(0o644);
        b.append_data(&mut h, path, *bytes).unwrap();
    }
    b.into_inner().unwrap()
}

/// Every file of the blob store holds the bytes its name is the hash of.
fn store_is_honest(cache: &Path) {
    let dir = cache.join(".blobs/sha256");
    for e in std::fs::read_dir(&dir).into_iter().flatten() {
        let e = e.unwrap();
        let name = e.file_name().to_string_lossy().into_owned();
        let bytes = std::fs::read(e.path()).unwrap();
        assert_eq!(
            sha256_digest(&bytes),
            format!("sha256:{name}"),
            "a blob holds other bytes than its name says"
        );
    }
}

#[tokio::test]
#[ignore = "needs the local control plane: scripts/test.sh runs it with --include-ignored"]
async fn hostile_layers_write_nothing_outside_poison_no_blob_and_link_no_host_file() {
    const TAR: &str = "application/vnd.oci.image.layer.v1.tar";
    let reg = registry();
    let h = Harness::start("oci-hostile").await;
    let dir = tempfile::tempdir().unwrap();
    let cache = dir.path().join("cache");
    // A host file next to the cache, which no layer may reach.
    std::fs::write(dir.path().join("host-secret"), b"host").unwrap();
    // 1. A chain: s is models/ again, so the copied link t points far
    // above it; a titled layer is then placed through t.
    // As the black-box round built it: s (22 levels down) is models/
    // again, and t, which looks 23 levels deep, is models/t and points 22
    // levels up; each passes a check of its own path.
    let deep = format!("models/{}d", "d/".repeat(21));
    let up22 = "../".repeat(22);
    let (s, t) = (format!("{deep}/s"), format!("{deep}/s/t"));
    let chain = tar_of(&[(&s, &up22), (&t, &up22)], &[]);
    let pwned = b"written through a link".to_vec();
    // 2. models/up is the cache directory (one above the view): a titled
    // layer named up/.blobs/sha256/<hex> would be a blob of the store.
    let victim = bytes(4 << 10, 9);
    let victim_hex = sha256_digest(&victim)
        .trim_start_matches("sha256:")
        .to_owned();
    let poison = tar_of(&[("models/up", "..")], &[("models/w.bin", b"w")]);
    let poisoned = b"the attacker's bytes".to_vec();
    let poison_title = format!("up/.blobs/sha256/{victim_hex}");
    // 3. models itself leads out (through a link that is inside on its
    // own): whatever is there would be linked into the view.
    let host = tar_of(&[("d/d/s", "../.."), ("models", "d/d/s/..")], &[]);
    let clash = tar_of(&[], &[("models/x/inside.txt", b"in")]);
    let pushed = [
        (
            "chain",
            reg.push(
                "models/chain",
                "v1",
                &[(TAR, &chain, None), (OCTETS, &pwned, Some("t/x/pwned.txt"))],
            )
            .await
            .unwrap(),
        ),
        (
            "poison",
            reg.push(
                "models/poison",
                "v1",
                &[
                    (TAR, &poison, None),
                    (OCTETS, &poisoned, Some(&poison_title)),
                ],
            )
            .await
            .unwrap(),
        ),
        (
            // The same link alone: the view it would make leads out.
            "above",
            reg.push("models/above", "v1", &[(TAR, &poison, None)])
                .await
                .unwrap(),
        ),
        (
            "host",
            reg.push("models/host", "v1", &[(TAR, &host, None)])
                .await
                .unwrap(),
        ),
        (
            // A titled file where the tar layer has a directory.
            "clash",
            reg.push(
                "models/clash",
                "v1",
                &[(TAR, &clash, None), (OCTETS, b"file", Some("x"))],
            )
            .await
            .unwrap(),
        ),
        (
            // The right digest, a descriptor that says 100 bytes more.
            "lies",
            reg.push_edited(
                "models/lies",
                "v1",
                &[(OCTETS, &victim, Some("lies.bin"))],
                |m| m["layers"][0]["size"] = json!(victim.len() + 100),
            )
            .await
            .unwrap(),
        ),
    ];
    credentials(&h, &reg, PASSWORD).await;
    let _agent = agent(&h, &cache, "10Mi", &reg, true);
    let models = pushed
        .iter()
        .map(|(name, digest)| {
            model(
                name,
                "1Gi",
                Some(oci(&reg, &format!("models/{name}@{digest}"), "1Mi")),
            )
        })
        .collect();
    create(&h, "gpu", "8Gi", models, 0).await;
    for (name, says) in [
        ("chain", "placed through"),
        ("poison", "placed through"),
        ("above", "outside the model's directory"),
        ("host", "climbs above"),
        ("clash", "would replace a directory"),
        ("lies", "the manifest's descriptor says 4196"),
    ] {
        h.request_nowait("gpu", name).await;
        let r = h.until_state("gpu", name, ModelState::Failed, 60).await;
        let message = status_of(&r, name).message.clone().unwrap_or_default();
        assert!(
            message.contains("InvalidArtifact") && message.contains(says),
            "{name}: {message}"
        );
    }
    // Nothing outside the cache but what the test put there.
    let mut around: Vec<String> = std::fs::read_dir(dir.path())
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .collect();
    around.sort();
    assert_eq!(
        around,
        ["cache", "cache.log", "host-secret"],
        "the agent's log beside it"
    );
    assert!(!cache.join("x").exists() && !cache.join("t").exists());
    // No blob under the victim's hash, and every blob honest.
    assert!(!cache.join(".blobs/sha256").join(&victim_hex).exists());
    store_is_honest(&cache);
    // A refusal its spec will always get is not fetched again (it was,
    // every 5 s and then less often, a download each time): past the
    // first retry's time, each artifact failed once in the agent's log.
    let r = h.api.get("gpu").await.unwrap();
    let message = status_of(&r, "chain").message.clone().unwrap_or_default();
    assert!(message.contains("not retried"), "{message}");
    tokio::time::sleep(std::time::Duration::from_secs(7)).await;
    let log = std::fs::read_to_string(dir.path().join("cache.log")).unwrap();
    for name in ["chain", "poison", "above", "host"] {
        let tries = log
            .lines()
            .filter(|l| l.contains("fetch failed") && l.contains(&format!("{name}-")))
            .count();
        assert_eq!(tries, 1, "{name} was fetched {tries} times");
    }
    // No view of a refused artifact is left to mount.
    let names = cached(&cache);
    assert!(
        !names
            .iter()
            .any(|n| ["chain-", "poison-", "above-", "host-"]
                .iter()
                .any(|p| n.starts_with(p))),
        "{names:?}"
    );
}

#[tokio::test]
#[ignore = "needs the local control plane: scripts/test.sh runs it with --include-ignored"]
async fn a_registry_redirect_outside_the_allowed_sources_is_not_followed() {
    let mut reg = registry();
    let h = Harness::start("oci-redirect").await;
    let weights = bytes(64 << 10, 21);
    let digest = reg
        .push("models/r", "v1", &[(OCTETS, &weights, Some("r.bin"))])
        .await
        .unwrap();
    // The registry sends every blob GET to a plain-http host on another
    // port, which no --allowed-sources prefix names.
    let (elsewhere, requests, _) = crate::support::artifact_server::serve_logged().await;
    reg.redirect_blobs_to(&format!("http://{elsewhere}/"))
        .unwrap();
    credentials(&h, &reg, PASSWORD).await;
    let dir = tempfile::tempdir().unwrap();
    let cache = dir.path().join("cache");
    let _agent = agent(&h, &cache, "10Mi", &reg, true);
    request_r(&h, &reg, &digest, "1Mi").await;
    let r = h.until_state("gpu", "r", ModelState::Failed, 60).await;
    let message = status_of(&r, "r").message.clone().unwrap_or_default();
    assert!(
        message.contains("SourceNotAllowed")
            && message.contains(&format!("to http://{elsewhere}/"))
            && message.contains("neither the registry nor under an allowed source"),
        "{message}"
    );
    assert_eq!(
        requests.load(std::sync::atomic::Ordering::Relaxed),
        0,
        "the redirect's target got no request"
    );
    assert!(!cached(&cache).iter().any(|n| n.contains("r-")));
}
