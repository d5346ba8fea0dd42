//! The chart installed on the real node the way users install it: `helm
//! install` (or `helm upgrade`) of this checkout's `charts/model-residency`
//! with no value but the images' — the chart's own image, built from this
//! repository without Docker and imported into the node's containerd
//! ([`super::images`]), and the GPU holder's — waiting for its pods.
//! `model-residency local-cluster --real-node --chart` and the real node's
//! chart test both install it through [`helm_release`].

use super::images::{CHART_IMAGE_REPOSITORY, PAUSE_IMAGE};
use std::path::{Path, PathBuf};
use std::process::{Command, Output};

/// The chart, in this checkout.
pub fn chart_dir() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("charts/model-residency")
}

/// helm: `HELM`, else what `scripts/helm.sh` provides (it downloads the
/// pinned release once and prints its path).
pub fn helm_binary() -> Result<PathBuf, String> {
    if let Some(helm) = std::env::var_os("HELM") {
        return Ok(helm.into());
    }
    let script = Path::new(env!("CARGO_MANIFEST_DIR")).join("scripts/helm.sh");
    let out = Command::new("bash")
        .arg(&script)
        .output()
        .map_err(|e| format!("bash {}: {e}", script.display()))?;
    let path = String::from_utf8_lossy(&out.stdout)
        .trim()
        .lines()
        .last()
        .unwrap_or_default()
        .to_owned();
    if !out.status.success() || path.is_empty() {
        return Err(format!(
            "helm is needed: run `bash scripts/helm.sh` (or set HELM): {}",
            String::from_utf8_lossy(&out.stderr).trim()
        ));
    }
    Ok(path.into())
}

/// What to run: `verb` (`install` or `upgrade`) of `release` into
/// `namespace`, the chart's image at `tag` (one of
/// [`super::images::CHART_IMAGE_TAGS`]), waiting up to `wait_secs` for its
/// pods to be Ready.
pub struct Release<'a> {
    pub helm: &'a Path,
    pub kubeconfig: &'a Path,
    pub verb: &'a str,
    pub release: &'a str,
    pub namespace: &'a str,
    pub tag: &'a str,
    pub wait_secs: u64,
}

/// Runs helm for `r`, with the images' values only.
pub fn helm_release(r: &Release) -> std::io::Result<Output> {
    Command::new(r.helm)
        .args([r.verb, r.release])
        .arg(chart_dir())
        .args(["--namespace", r.namespace, "--kubeconfig"])
        .arg(r.kubeconfig)
        .args(["--wait", "--timeout", &format!("{}s", r.wait_secs)])
        .args([
            "--set",
            &format!("image.repository={CHART_IMAGE_REPOSITORY}"),
        ])
        .args(["--set", &format!("image.tag={}", r.tag)])
        // The GPU holder's image is an image too: the node has no other.
        .args(["--set", &format!("gpuHolderImage={PAUSE_IMAGE}")])
        .output()
}
