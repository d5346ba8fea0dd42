//! `model-residency top` (and `kubectl residency top`, the binary installed
//! as `kubectl-residency`): what is loaded where. Every GPU (residency) of
//! a namespace, or of all, with the models on it: state, size, last use,
//! when idle unload will take each, and how many GPUs serve it; refreshed
//! until interrupted, or printed once (`--once`, `-o json`).
//!
//! It reads what the operator wrote (each residency's status, its registry
//! resolved against its catalog for keepAlive), one list of each kind per
//! refresh; it writes nothing.

use super::Failure;
use k8s_openapi::jiff::{SignedDuration, Timestamp};
use kube::api::{Api, ListParams};
use kube::{Client, ResourceExt};
use model_residency::api::{ModelCatalog, ModelResidency, ModelState};
use model_residency::quantity::{format_bytes_rounded, parse_bytes, parse_duration};
use model_residency::residency::catalog;
use model_residency::residency::conditions::GPU_HEALTHY;
use model_residency::residency::state::{later, recorded_time};
use serde::Serialize;
use std::collections::BTreeMap;
use std::time::Duration;

#[derive(clap::Args, Debug)]
pub struct Args {
    /// Namespace (default: the kubeconfig's).
    #[arg(short, long)]
    namespace: Option<String>,
    /// Every namespace.
    #[arg(short = 'A', long, conflicts_with = "namespace")]
    all_namespaces: bool,
    /// Only residencies with these labels (a label selector, e.g.
    /// residency.dev/set=fleet).
    #[arg(short = 'l', long)]
    selector: Option<String>,
    /// Only the GPUs of this node.
    #[arg(long)]
    node: Option<String>,
    /// Also the models not on their GPU (Evicted, Unloaded, Refused, never
    /// requested).
    #[arg(short, long)]
    all: bool,
    /// Time between refreshes.
    #[arg(long, default_value = "2s", value_parser = interval)]
    interval: Duration,
    /// Print once and exit.
    #[arg(long)]
    once: bool,
    /// text, or json (one snapshot, for scripts).
    #[arg(short, long, value_enum, default_value_t = Output::Text)]
    output: Output,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum)]
enum Output {
    Text,
    Json,
}

fn interval(s: &str) -> Result<Duration, String> {
    match parse_duration(s) {
        Some(d) if d >= Duration::from_millis(200) => Ok(d),
        Some(_) => Err("at least 200ms".into()),
        None => Err(format!("{s:?} is not a duration (2s, 500ms, 1m)")),
    }
}

/// One GPU (residency) and its models. Field names are the `-o json` keys.
#[derive(Debug, PartialEq, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct GpuView {
    pub namespace: String,
    pub residency: String,
    /// Its node, when placed.
    pub node: Option<String>,
    /// spec.device: the GPU on the node.
    pub device: String,
    /// Bytes.
    pub budget: Option<u64>,
    pub used: Option<u64>,
    /// The set that stamped it, if one did.
    pub set: Option<String>,
    pub models: Vec<ModelView>,
    /// Models left out (not on the GPU; `--all` shows them).
    pub others: usize,
    /// Why the GPU takes no new models, when it does not (its GpuHealthy
    /// condition's reason: NoExecute, NoSchedule, Cordoned, HeldOff).
    pub unhealthy: Option<String>,
}

#[derive(Debug, PartialEq, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct ModelView {
    pub name: String,
    pub state: ModelState,
    /// Bytes, as its status records them.
    pub size: Option<u64>,
    /// The request that last hit or loaded it (RFC 3339).
    pub last_used: Option<String>,
    /// When idle unload takes it (its keepAlive after its last use), if
    /// anything will: none for pinned models, keepAlive 0s or none set.
    pub idle_unload_at: Option<String>,
    /// GPUs of its namespace where it is Loaded or Loading.
    pub copies: u32,
    /// With spec.anticipate: when its forecast next expects a request
    /// (the start of a 10-minute slot, RFC 3339).
    pub expected_next: Option<String>,
}

/// Whether a model is on its GPU (holding VRAM or about to).
fn on_gpu(state: ModelState) -> bool {
    state.is_resident() || matches!(state, ModelState::Sleeping | ModelState::Queued)
}

/// The view of `residencies` (each resolved against its catalog where it
/// names one: `catalogs` by namespace and name), sorted by namespace,
/// node, device.
pub fn view(
    residencies: &[ModelResidency],
    catalogs: &BTreeMap<(String, String), ModelCatalog>,
    all: bool,
) -> Vec<GpuView> {
    // Copies: GPUs of a namespace where the model is Loaded or Loading.
    let mut copies: BTreeMap<(String, String), u32> = BTreeMap::new();
    for r in residencies {
        let ns = r.namespace().unwrap_or_default();
        for m in r.status.iter().flat_map(|s| &s.models) {
            if matches!(m.state, ModelState::Loaded | ModelState::Loading) {
                *copies.entry((ns.clone(), m.name.to_string())).or_default() += 1;
            }
        }
    }
    let mut gpus: Vec<GpuView> = residencies
        .iter()
        .map(|r| {
            let ns = r.namespace().unwrap_or_default();
            let catalog = r
                .spec
                .catalog
                .as_ref()
                .and_then(|c| catalogs.get(&(ns.clone(), c.name.clone())));
            let resolved = catalog::resolve(r, catalog).ok().flatten();
            let registry = resolved.as_ref().unwrap_or(r);
            let default_keep = r.spec.keep_alive.as_deref().and_then(parse_duration);
            let status = r.status.as_ref();
            let mut models = Vec::new();
            let mut others = 0;
            for m in status.iter().flat_map(|s| &s.models) {
                if !all && !on_gpu(m.state) {
                    others += 1;
                    continue;
                }
                let spec = registry.spec.models.iter().find(|s| *s.name == *m.name);
                let keep = spec
                    .and_then(|s| s.keep_alive.as_deref().and_then(parse_duration))
                    .or(default_keep)
                    .filter(|k| !k.is_zero() && !spec.is_some_and(|s| s.pinned));
                let last = recorded_time(m.last_used.as_deref());
                let unload = match (keep, last) {
                    (Some(k), Some(t))
                        if m.state.is_resident() || m.state == ModelState::Sleeping =>
                    {
                        Some(later(t, k).to_string())
                    }
                    _ => None,
                };
                models.push(ModelView {
                    name: m.name.to_string(),
                    state: m.state,
                    size: m.size.as_deref().and_then(|s| parse_bytes(s).ok()),
                    last_used: last.map(|t| t.to_string()),
                    idle_unload_at: unload,
                    copies: copies
                        .get(&(ns.clone(), m.name.to_string()))
                        .copied()
                        .unwrap_or(0),
                    expected_next: m.expected_next.as_deref().map(str::to_owned),
                });
            }
            GpuView {
                namespace: ns,
                residency: r.name_any(),
                node: model_residency::residency::gpu::node_of(r).map(str::to_owned),
                device: r.spec.device.clone(),
                budget: status
                    .and_then(|s| s.budget.as_deref())
                    .and_then(|b| parse_bytes(b).ok()),
                used: status
                    .and_then(|s| s.used.as_deref())
                    .and_then(|b| parse_bytes(b).ok()),
                set: r.labels().get("residency.dev/set").cloned(),
                models,
                others,
                unhealthy: status.and_then(|s| {
                    let c = s.conditions.iter().find(|c| c.type_ == GPU_HEALTHY)?;
                    (c.status == "False" || c.reason == "HeldOff").then(|| c.reason.clone())
                }),
            }
        })
        .collect();
    gpus.sort_by(|a, b| {
        (&a.namespace, &a.node, &a.device, &a.residency).cmp(&(
            &b.namespace,
            &b.node,
            &b.device,
            &b.residency,
        ))
    });
    gpus
}

/// "12s", "4m", "2h", "3d": the largest unit, whole.
fn ago(d: SignedDuration) -> String {
    let s = d.as_secs().max(0);
    match s {
        0..60 => format!("{s}s"),
        60..3600 => format!("{}m", s / 60),
        3600..86400 => format!("{}h", s / 3600),
        _ => format!("{}d", s / 86400),
    }
}

fn since(now: Timestamp, t: Option<&str>) -> String {
    match t.and_then(|t| t.parse::<Timestamp>().ok()) {
        Some(t) if t <= now => format!("{} ago", ago(now.duration_since(t))),
        Some(_) => "now".into(),
        None => "-".into(),
    }
}

/// "in 4m", or `reached` once `t` is past.
fn until(now: Timestamp, t: Option<&str>, reached: &str) -> String {
    match t.and_then(|t| t.parse::<Timestamp>().ok()) {
        Some(t) if t > now => format!("in {}", ago(t.duration_since(now))),
        Some(_) => reached.into(),
        None => "-".into(),
    }
}

fn bytes(b: Option<u64>) -> String {
    b.map_or_else(|| "-".into(), format_bytes_rounded)
}

/// The text view: per GPU a line (namespace/residency, node/device, used
/// of budget), then a line per model; 78 columns at most for names up to
/// 20 characters.
pub fn render(gpus: &[GpuView], now: Timestamp) -> String {
    let mut out = String::new();
    let (models, loaded): (usize, usize) = gpus.iter().fold((0, 0), |(m, l), g| {
        (
            m + g.models.len(),
            l + g
                .models
                .iter()
                .filter(|m| m.state == ModelState::Loaded)
                .count(),
        )
    });
    let plural = |n: usize, one: &str| format!("{n} {one}{}", if n == 1 { "" } else { "s" });
    out.push_str(&format!(
        "{}, {} on them ({loaded} Loaded) at {}\n",
        plural(gpus.len(), "GPU"),
        plural(models, "model"),
        now.strftime("%H:%M:%S")
    ));
    if gpus.is_empty() {
        out.push_str("no ModelResidency here (kubectl get mres -A)\n");
        return out;
    }
    out.push_str(&format!(
        "  {:<20} {:<9} {:>9} {:>9} {:>11} {:>6} {:>6}\n",
        "MODEL", "STATE", "SIZE", "LAST USE", "IDLE UNLOAD", "COPIES", "NEXT"
    ));
    for g in gpus {
        let pct = match (g.used, g.budget) {
            (Some(u), Some(b)) if b > 0 => format!(" ({}%)", u * 100 / b),
            _ => String::new(),
        };
        // A GPU's uuid (a stamped residency's device) is shortened: its
        // residency's name already says which GPU it is.
        let device = match g.device.char_indices().nth(12) {
            Some((cut, _)) if g.device.len() > 16 => format!("{}…", &g.device[..cut]),
            _ => g.device.clone(),
        };
        let place = format!("{}/{device}", g.node.as_deref().unwrap_or("(unplaced)"));
        out.push_str(&format!(
            "{}/{}  {place}  {} of {}{pct}{}\n",
            g.namespace,
            g.residency,
            bytes(g.used),
            bytes(g.budget),
            if g.others > 0 {
                format!("  +{} not on it", g.others)
            } else {
                String::new()
            }
        ));
        if let Some(why) = &g.unhealthy {
            out.push_str(&format!(
                "  ! takes no new models: {why} (its GpuHealthy condition)\n"
            ));
        }
        for m in &g.models {
            out.push_str(&format!(
                "  {:<20} {:<9} {:>9} {:>9} {:>11} {:>6} {:>6}\n",
                m.name,
                format!("{:?}", m.state),
                bytes(m.size),
                since(now, m.last_used.as_deref()),
                until(now, m.idle_unload_at.as_deref(), "due"),
                m.copies,
                until(now, m.expected_next.as_deref(), "now")
            ));
        }
    }
    out
}

async fn snapshot(client: &Client, args: &Args) -> Result<Vec<GpuView>, Failure> {
    let (residencies, catalogs): (Api<ModelResidency>, Api<ModelCatalog>) = if args.all_namespaces {
        (Api::all(client.clone()), Api::all(client.clone()))
    } else {
        match &args.namespace {
            Some(ns) => (
                Api::namespaced(client.clone(), ns),
                Api::namespaced(client.clone(), ns),
            ),
            None => (
                Api::default_namespaced(client.clone()),
                Api::default_namespaced(client.clone()),
            ),
        }
    };
    let mut lp = ListParams::default();
    if let Some(s) = &args.selector {
        lp = lp.labels(s);
    }
    let mut items = residencies
        .list(&lp)
        .await
        .map_err(|e| Failure::other(format!("cannot list ModelResidencies: {e}")))?
        .items;
    if let Some(node) = &args.node {
        items.retain(|r| model_residency::residency::gpu::node_of(r) == Some(node.as_str()));
    }
    // A cluster without the catalog kind (CRDs of an earlier release)
    // shows residencies as their own registries say.
    let catalogs: BTreeMap<(String, String), ModelCatalog> = catalogs
        .list(&ListParams::default())
        .await
        .map(|l| l.items)
        .unwrap_or_default()
        .into_iter()
        .map(|c| ((c.namespace().unwrap_or_default(), c.name_any()), c))
        .collect();
    Ok(view(&items, &catalogs, args.all))
}

/// `top --once -n namespace` as text (the demo prints it).
pub async fn once(client: &Client, namespace: &str) -> Result<String, Failure> {
    let args = Args {
        namespace: Some(namespace.to_owned()),
        all_namespaces: false,
        selector: None,
        node: None,
        all: false,
        interval: Duration::from_secs(2),
        once: true,
        output: Output::Text,
    };
    Ok(render(&snapshot(client, &args).await?, Timestamp::now()))
}

pub async fn run(args: Args) -> Result<(), Failure> {
    let client = Client::try_default()
        .await
        .map_err(|e| Failure::other(format!("cannot reach the cluster: {e}")))?;
    loop {
        let gpus = snapshot(&client, &args).await?;
        match args.output {
            Output::Json => {
                println!(
                    "{}",
                    serde_json::to_string_pretty(&gpus).expect("the view serializes")
                );
                return Ok(());
            }
            Output::Text if args.once => {
                print!("{}", render(&gpus, Timestamp::now()));
                return Ok(());
            }
            Output::Text => {
                // Home and clear, then the view: a terminal shows it in place.
                print!("\x1b[H\x1b[2J{}", render(&gpus, Timestamp::now()));
                use std::io::Write;
                let _ = std::io::stdout().flush();
            }
        }
        tokio::select! {
            _ = tokio::time::sleep(args.interval) => {}
            _ = tokio::signal::ctrl_c() => return Ok(()),
        }
    }
}

#[cfg(test)]
#[path = "top_tests.rs"]
mod tests;
