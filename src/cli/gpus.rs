//! `model-residency gpus`: every GPU the cluster's DRA drivers publish
//! (ResourceSlices), which residency's claim holds it, and with `--emit` a
//! starting ModelResidency for each free one.

use super::Failure;
use k8s_openapi::api::resource::v1::{ResourceClaim, ResourceSlice};
use kube::api::{Api, ListParams};
use model_residency::api::{DEFAULT_BUDGET_FRACTION, ModelResidency};
use model_residency::controller::gpu::inventory::{ClaimState, Device, NVIDIA_DRIVER, devices_of};
use model_residency::quantity::format_bytes;
use model_residency::residency::labels::fits_label_value;
use std::collections::HashMap;

#[derive(clap::Args, Debug)]
pub struct Args {
    /// Print a ModelResidency manifest (YAML) for each free GPU instead of
    /// the table: its node, its uuid, a budget of 0.9 of its memory and an
    /// empty registry, for `kubectl apply -f -` once models are added.
    #[arg(long)]
    emit: bool,
    /// The namespace the emitted manifests are for.
    #[arg(short, long, default_value = "default")]
    namespace: String,
}

/// One GPU and who holds it.
#[derive(Debug, PartialEq)]
struct Row {
    device: Device,
    /// `namespace/residency` (or `namespace/claim` for a claim no
    /// residency names), when an allocated claim holds it.
    held_by: Option<String>,
}

/// Who holds each device: the allocated claims, each named by the
/// residency it belongs to (its label, else a residency that names it in
/// spec.gpu.existingClaim), else by itself.
fn holders(
    claims: &[(String, String, ClaimState)],
    residencies: &[ModelResidency],
) -> HashMap<(String, String, String), String> {
    let mut out = HashMap::new();
    for (ns, name, state) in claims {
        let Some(a) = &state.allocation else { continue };
        let by_existing = || {
            residencies.iter().find(|r| {
                r.metadata.namespace.as_deref() == Some(ns)
                    && r.spec.gpu.existing_claim.as_deref() == Some(name)
            })
        };
        let holder = match &state.residency {
            Some(r) => format!("{ns}/{r}"),
            None => match by_existing() {
                Some(r) => format!("{ns}/{}", r.metadata.name.as_deref().unwrap_or_default()),
                None => format!("{ns}/{name} (claim)"),
            },
        };
        out.insert((a.driver.clone(), a.pool.clone(), a.device.clone()), holder);
    }
    out
}

fn rows(devices: Vec<Device>, holders: &HashMap<(String, String, String), String>) -> Vec<Row> {
    devices
        .into_iter()
        .map(|d| {
            let key = (d.driver.clone(), d.pool.clone(), d.name.clone());
            Row {
                held_by: holders.get(&key).cloned(),
                device: d,
            }
        })
        .collect()
}

fn table(rows: &[Row]) -> String {
    let header = [
        "NODE", "DEVICE", "UUID", "PRODUCT", "MEMORY", "HELD-BY", "FREE",
    ];
    let mut lines: Vec<[String; 7]> = vec![header.map(str::to_owned)];
    for r in rows {
        let d = &r.device;
        lines.push([
            d.node.clone().unwrap_or_else(|| "-".into()),
            d.name.clone(),
            d.uuid.clone().unwrap_or_else(|| "-".into()),
            d.product.clone().unwrap_or_else(|| "-".into()),
            d.memory.map(format_bytes).unwrap_or_else(|| "-".into()),
            r.held_by.clone().unwrap_or_else(|| "-".into()),
            if r.held_by.is_none() { "yes" } else { "no" }.into(),
        ]);
    }
    let mut widths = [0; 7];
    for line in &lines {
        for (w, cell) in widths.iter_mut().zip(line) {
            *w = (*w).max(cell.len());
        }
    }
    let mut out = String::new();
    for line in &lines {
        let cells: Vec<String> = line
            .iter()
            .zip(widths)
            .map(|(cell, w)| format!("{cell:<w$}"))
            .collect();
        out.push_str(cells.join("   ").trim_end());
        out.push('\n');
    }
    out
}

/// A starting ModelResidency for a free GPU: on its node, selecting it by
/// uuid, with 0.9 of its memory as the budget, no models yet.
fn manifest(d: &Device, namespace: &str) -> serde_json::Value {
    let node = d.node.as_deref().unwrap_or("node");
    let mut name: String = format!("{node}-{}", d.name)
        .chars()
        .map(|c| {
            if c.is_ascii_alphanumeric() || c == '-' {
                c.to_ascii_lowercase()
            } else {
                '-'
            }
        })
        .collect();
    while !fits_label_value(&name) {
        name.pop();
    }
    let name = name.trim_matches('-').to_owned();
    let device = d
        .uuid
        .clone()
        .or_else(|| d.index.map(|i| i.to_string()))
        .unwrap_or_else(|| d.name.clone());
    let mut spec = serde_json::json!({"device": device, "models": []});
    if let Some(node) = &d.node {
        spec["nodeName"] = node.clone().into();
    }
    if let Some(memory) = d.memory {
        let budget = ((memory as f64) * DEFAULT_BUDGET_FRACTION).floor() as u64;
        spec["budget"] = format_bytes(budget).into();
    }
    serde_json::json!({
        "apiVersion": "residency.dev/v1alpha1", "kind": "ModelResidency",
        "metadata": {"name": name, "namespace": namespace},
        "spec": spec,
    })
}

pub async fn run(args: Args) -> Result<(), Failure> {
    let client = kube::Client::try_default()
        .await
        .map_err(|e| Failure::other(format!("cannot reach the cluster: {e}")))?;
    let listed = |what: &'static str| {
        move |e: kube::Error| match e {
            kube::Error::Api(s) if s.code == 404 => Failure::other(format!(
                "this cluster serves no {what} (resource.k8s.io/v1 needs Kubernetes 1.34 or later)"
            )),
            e => Failure::other(format!("cannot list {what}: {e}")),
        }
    };
    let slices = Api::<ResourceSlice>::all(client.clone())
        .list(&ListParams::default())
        .await
        .map_err(listed("ResourceSlices"))?;
    let claims = Api::<ResourceClaim>::all(client.clone())
        .list(&ListParams::default())
        .await
        .map_err(listed("ResourceClaims"))?;
    // Without the CRD no residency can hold a GPU by name: an empty list.
    let residencies = Api::<ModelResidency>::all(client)
        .list(&ListParams::default())
        .await
        .map(|l| l.items)
        .unwrap_or_default();
    let mut devices: Vec<Device> = slices
        .items
        .iter()
        .flat_map(devices_of)
        .filter(|d| d.driver == NVIDIA_DRIVER)
        .collect();
    devices.sort_by(|a, b| (&a.node, &a.name).cmp(&(&b.node, &b.name)));
    let claims: Vec<_> = claims
        .items
        .iter()
        .map(|c| {
            let ns = c.metadata.namespace.clone().unwrap_or_default();
            let name = c.metadata.name.clone().unwrap_or_default();
            (ns, name, ClaimState::of(c))
        })
        .collect();
    let rows = rows(devices, &holders(&claims, &residencies));
    if args.emit {
        for r in rows.iter().filter(|r| r.held_by.is_none()) {
            let yaml = serde_saphyr::to_string(&manifest(&r.device, &args.namespace))
                .map_err(Failure::other)?;
            print!("---\n{yaml}");
        }
    } else {
        print!("{}", table(&rows));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use model_residency::controller::gpu::inventory::Allocation;

    fn device(node: &str, i: i64) -> Device {
        Device {
            driver: NVIDIA_DRIVER.into(),
            pool: node.into(),
            name: format!("gpu-{i}"),
            node: Some(node.into()),
            uuid: Some(format!("GPU-{node}-{i}")),
            index: Some(i),
            product: Some("H100".into()),
            memory: Some(80 << 30),
            pcie_root: None,
            taints: Vec::new(),
        }
    }

    #[test]
    fn held_gpus_name_their_residency_and_free_ones_get_a_manifest() {
        let claim = |label: Option<&str>, dev: &str| ClaimState {
            uid: "u".into(),
            controller: None,
            residency: label.map(Into::into),
            deleting: false,
            wants: None,
            allocation: Some(Allocation {
                node: Some("n1".into()),
                driver: NVIDIA_DRIVER.into(),
                pool: "n1".into(),
                device: dev.into(),
            }),
            reserved_for: vec![],
        };
        let claims = vec![
            ("team".into(), "gpu-gpu".into(), claim(Some("gpu"), "gpu-0")),
            ("team".into(), "other".into(), claim(None, "gpu-1")),
        ];
        let rows = rows(
            vec![device("n1", 0), device("n1", 1), device("n1", 2)],
            &holders(&claims, &[]),
        );
        assert_eq!(rows[0].held_by.as_deref(), Some("team/gpu"));
        assert_eq!(rows[1].held_by.as_deref(), Some("team/other (claim)"));
        assert_eq!(rows[2].held_by, None);
        let text = table(&rows);
        assert!(text.lines().nth(3).unwrap().ends_with("yes"), "{text}");
        let m = manifest(&rows[2].device, "models");
        assert_eq!(m["metadata"]["name"], "n1-gpu-2");
        assert_eq!(m["spec"]["device"], "GPU-n1-2");
        assert_eq!(m["spec"]["budget"], "72Gi");
        // It is a valid residency.
        let _: ModelResidency = serde_json::from_value(m).unwrap();
    }
}
