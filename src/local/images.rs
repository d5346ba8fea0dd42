//! The real node's images, made locally (nothing is pulled from outside):
//! one layer holding this project's own binary (stripped of its debug
//! information when `strip` is there) with the shared libraries `ldd` lists
//! for it and the system's CA bundle, and images on that layer: the fake
//! model server ([`MODEL_SERVER_IMAGE`], entrypoint `model-residency
//! fake-model-server`), the pod sandbox and GPU holder image
//! ([`PAUSE_IMAGE`], entrypoint `model-residency pause`), and the chart's
//! image in two revisions ([`CHART_IMAGE_REPOSITORY`], what the Dockerfile
//! builds, without Docker). All are written as one OCI image layout tar
//! that `ctr images import` takes.

use ring::digest::{Context, SHA256};
use serde_json::json;
use std::fs::File;
use std::io::{BufWriter, Read, Write};
use std::path::{Path, PathBuf};
use std::process::Command;

/// The fake model server's image.
pub const MODEL_SERVER_IMAGE: &str = "localhost/model-residency/fake-model-server:dev";
/// The pod sandbox's (and the GPU holder's) image.
pub const PAUSE_IMAGE: &str = "localhost/model-residency/pause:dev";
/// The chart's image (`image.repository`), as the Dockerfile makes it:
/// entrypoint the binary alone (the chart's pods give the subcommand), run
/// as 65532 (distroless' nonroot).
pub const CHART_IMAGE_REPOSITORY: &str = "localhost/model-residency/model-residency";
/// Its tags: two revisions of one build that differ only in a label, so
/// that `helm upgrade` from one to the other changes every pod's image.
pub const CHART_IMAGE_TAGS: [&str; 2] = ["dev", "dev-2"];
/// Where the binary is inside every image.
pub const BINARY_IN_IMAGE: &str = "/model-residency";

/// A model pod template that runs the fake model server from
/// [`MODEL_SERVER_IMAGE`] on a real node: its model and pod name from the
/// downward API (the operator labels each model pod with its model), Ready
/// by its own `/health` on `port`, its sleep delays and faults from
/// `sleep` (`sleep=100ms,wake=50ms`; the stand-in's annotation says the
/// same), ten seconds to drain (eight of them for answers in progress).
pub fn model_server_template(port: u16, sleep: Option<&str>) -> serde_json::Value {
    let mut env = vec![
        json!({"name": "MODEL_NAME", "valueFrom": {"fieldRef": {"fieldPath": "metadata.labels['residency.dev/model']"}}}),
        json!({"name": "POD_NAME", "valueFrom": {"fieldRef": {"fieldPath": "metadata.name"}}}),
    ];
    if let Some(sleep) = sleep {
        env.push(json!({"name": "FAKE_SLEEP", "value": sleep}));
    }
    json!({"spec": {
        "terminationGracePeriodSeconds": 10,
        "containers": [{
            "name": "server", "image": MODEL_SERVER_IMAGE, "imagePullPolicy": "Never",
            "args": ["--listen", format!("0.0.0.0:{port}"), "--stream-delay-ms", "20", "--drain-secs", "8"],
            "env": env,
            "ports": [{"containerPort": port}],
            "readinessProbe": {"httpGet": {"path": "/health", "port": port}, "periodSeconds": 1},
        }],
    }})
}

const LAYER_TYPE: &str = "application/vnd.oci.image.layer.v1.tar";
const CONFIG_TYPE: &str = "application/vnd.oci.image.config.v1+json";
const MANIFEST_TYPE: &str = "application/vnd.oci.image.manifest.v1+json";

/// A blob of the layout: its digest (`sha256:...`) and size.
struct Blob {
    digest: String,
    size: u64,
}

fn sha256_hex(bytes: &[u8]) -> String {
    hex(ring::digest::digest(&SHA256, bytes).as_ref())
}

fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

/// The shared libraries the dynamic loader would map for `binary`, the
/// loader itself included, as `ldd` lists them.
pub fn shared_libraries(binary: &Path) -> std::io::Result<Vec<PathBuf>> {
    let out = Command::new("ldd").arg(binary).output()?;
    let text = String::from_utf8_lossy(&out.stdout);
    Ok(text
        .lines()
        .filter_map(|line| {
            // "libc.so.6 => /lib/x86_64-linux-gnu/libc.so.6 (0x...)" or
            // "/lib64/ld-linux-x86-64.so.2 (0x...)"; the vdso has no file.
            let path = match line.split_once("=>") {
                Some((_, rest)) => rest.split_whitespace().next()?,
                None => line.split_whitespace().next()?,
            };
            path.starts_with('/').then(|| PathBuf::from(path))
        })
        .collect())
}

/// Writes the layer tar to `out`: the binary at [`BINARY_IN_IMAGE`], each
/// library (and the CA bundle) at its own path (links followed: a container has no host to
/// point into), and the empty directories a container's runtime mounts
/// over.
fn write_layer(binary: &Path, libraries: &[PathBuf], out: &Path) -> std::io::Result<Blob> {
    let mut tar = tar::Builder::new(BufWriter::new(File::create(out)?));
    tar.follow_symlinks(true);
    for dir in ["dev", "proc", "sys", "etc", "tmp", "models", "var", "run"] {
        let mut header = tar::Header::new_gnu();
        header.set_entry_type(tar::EntryType::Directory);
        header.set_mode(if dir == "tmp" { 0o1777 } else { 0o755 });
        header.set_size(0);
        tar.append_data(&mut header, dir, std::io::empty())?;
    }
    tar.append_path_with_name(binary, BINARY_IN_IMAGE.trim_start_matches('/'))?;
    for lib in libraries {
        let inside = lib.strip_prefix("/").unwrap_or(lib);
        tar.append_path_with_name(lib, inside)?;
    }
    tar.into_inner()?.flush()?;
    let (sha256, size) = file_sha256(out)?;
    Ok(Blob {
        digest: format!("sha256:{sha256}"),
        size,
    })
}

/// A file's sha256 (hex) and size, read once.
pub fn file_sha256(path: &Path) -> std::io::Result<(String, u64)> {
    let mut digest = Context::new(&SHA256);
    let mut file = File::open(path)?;
    let mut buf = vec![0; 1 << 20];
    let mut size = 0u64;
    loop {
        let n = file.read(&mut buf)?;
        if n == 0 {
            break;
        }
        digest.update(&buf[..n]);
        size += n as u64;
    }
    Ok((hex(digest.finish().as_ref()), size))
}

/// Writes both images as one OCI image layout tar at `out`, from `binary`
/// (this project's), using `scratch` for the intermediate files.
pub fn write_layout(binary: &Path, scratch: &Path, out: &Path) -> std::io::Result<()> {
    let stripped = scratch.join("model-residency");
    let strip = Command::new("strip")
        .arg("-o")
        .arg(&stripped)
        .arg(binary)
        .status();
    if !strip.is_ok_and(|s| s.success()) {
        std::fs::copy(binary, &stripped)?;
    }
    let mut libraries = shared_libraries(binary)?;
    // The system's CA bundle, as a distroless base has it: a client with
    // native roots (the node agent's kube client) refuses to start without
    // one, even for a server it does not verify.
    let bundle = Path::new("/etc/ssl/certs/ca-certificates.crt");
    if bundle.is_file() {
        libraries.push(bundle.to_owned());
    }
    let layer_path = scratch.join("layer.tar");
    let layer = write_layer(&stripped, &libraries, &layer_path)?;
    let mut blobs: Vec<(String, Vec<u8>)> = Vec::new();
    let mut manifests = Vec::new();
    let mut images = vec![
        (
            MODEL_SERVER_IMAGE.to_owned(),
            json!({"Entrypoint": [BINARY_IN_IMAGE, "fake-model-server"]}),
        ),
        (
            PAUSE_IMAGE.to_owned(),
            json!({"Entrypoint": [BINARY_IN_IMAGE, "pause"]}),
        ),
    ];
    for tag in CHART_IMAGE_TAGS {
        images.push((
            format!("{CHART_IMAGE_REPOSITORY}:{tag}"),
            json!({"Entrypoint": [BINARY_IN_IMAGE], "User": "65532:65532",
                   "Labels": {"dev.residency.revision": tag}}),
        ));
    }
    for (reference, mut runtime) in images {
        runtime["Env"] = json!(["PATH=/"]);
        runtime["WorkingDir"] = json!("/");
        let config = json!({
            "architecture": "amd64", "os": "linux",
            "config": runtime,
            "rootfs": {"type": "layers", "diff_ids": [layer.digest]},
        })
        .to_string()
        .into_bytes();
        let config_blob = Blob {
            digest: format!("sha256:{}", sha256_hex(&config)),
            size: config.len() as u64,
        };
        let manifest = json!({
            "schemaVersion": 2, "mediaType": MANIFEST_TYPE,
            "config": {"mediaType": CONFIG_TYPE, "digest": config_blob.digest, "size": config_blob.size},
            "layers": [{"mediaType": LAYER_TYPE, "digest": layer.digest, "size": layer.size}],
        })
        .to_string()
        .into_bytes();
        let digest = format!("sha256:{}", sha256_hex(&manifest));
        manifests.push(json!({
            "mediaType": MANIFEST_TYPE, "digest": digest, "size": manifest.len(),
            "platform": {"architecture": "amd64", "os": "linux"},
            "annotations": {
                "io.containerd.image.name": &reference,
                "org.opencontainers.image.ref.name": reference.rsplit(':').next().unwrap_or("dev"),
            },
        }));
        blobs.push((config_blob.digest, config));
        blobs.push((digest, manifest));
    }
    let index = json!({"schemaVersion": 2, "manifests": manifests}).to_string();
    let mut tar = tar::Builder::new(BufWriter::new(File::create(out)?));
    let mut add = |name: &str, data: &[u8]| -> std::io::Result<()> {
        let mut header = tar::Header::new_gnu();
        header.set_size(data.len() as u64);
        header.set_mode(0o644);
        tar.append_data(&mut header, name, data)
    };
    add("oci-layout", br#"{"imageLayoutVersion":"1.0.0"}"#)?;
    add("index.json", index.as_bytes())?;
    for (digest, data) in &blobs {
        add(&blob_path(digest), data)?;
    }
    tar.append_path_with_name(&layer_path, blob_path(&layer.digest))?;
    tar.into_inner()?.flush()?;
    Ok(())
}

fn blob_path(digest: &str) -> String {
    format!("blobs/{}", digest.replacen(':', "/", 1))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ldd_names_the_loader_and_libc_of_a_dynamic_binary() {
        let libs = shared_libraries(Path::new("/bin/sh")).unwrap();
        assert!(
            libs.iter().any(|l| l.to_string_lossy().contains("libc.so")),
            "{libs:?}"
        );
        assert!(
            libs.iter()
                .any(|l| l.to_string_lossy().contains("ld-linux")),
            "{libs:?}"
        );
    }

    #[test]
    fn the_layout_holds_every_image_on_one_layer() {
        let dir = tempfile::tempdir().unwrap();
        let out = dir.path().join("images.tar");
        write_layout(Path::new("/bin/true"), dir.path(), &out).unwrap();
        let mut names = Vec::new();
        let mut index = String::new();
        let mut archive = tar::Archive::new(File::open(&out).unwrap());
        for entry in archive.entries().unwrap() {
            let mut entry = entry.unwrap();
            let name = entry.path().unwrap().to_string_lossy().into_owned();
            if name == "index.json" {
                entry.read_to_string(&mut index).unwrap();
            }
            names.push(name);
        }
        // A layer, and four configs and four manifests.
        assert_eq!(names.iter().filter(|n| n.starts_with("blobs/")).count(), 9);
        let index: serde_json::Value = serde_json::from_str(&index).unwrap();
        let refs: Vec<_> = index["manifests"]
            .as_array()
            .unwrap()
            .iter()
            .map(|m| m["annotations"]["io.containerd.image.name"].clone())
            .collect();
        assert_eq!(
            refs,
            [
                json!(MODEL_SERVER_IMAGE),
                json!(PAUSE_IMAGE),
                json!(format!("{CHART_IMAGE_REPOSITORY}:dev")),
                json!(format!("{CHART_IMAGE_REPOSITORY}:dev-2")),
            ]
        );
    }
}
