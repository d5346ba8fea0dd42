//! The GPUs a cluster publishes (DRA ResourceSlices), and which of them a
//! ResidencySet selects: its DeviceClass's CEL selectors and its own, as
//! a ResourceClaim selects devices (`device.driver`,
//! `device.attributes["<domain>"].<name>`, `device.capacity["<domain>"].<name>`
//! with `quantity("40Gi")` and `.compareTo(...)`), and a node selector.
//! Pure: the caller hands in the slices, the class and the node labels.

use super::cel_bounds;
use crate::quantity::parse_bytes;
use crate::shared::Shared;
use cel_interpreter::extractors::This;
use cel_interpreter::{Context, Program, Value};
use k8s_openapi::api::resource::v1::ResourceSlice;
use std::collections::{BTreeMap, HashMap};
use std::sync::Arc;

/// One published device.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Device {
    pub node: String,
    pub driver: String,
    pub pool: String,
    /// Its name in the slice (`gpu-0`).
    pub name: String,
    /// Attributes by their name within the driver's domain.
    pub attributes: Fields<serde_json::Value>,
    /// Capacities in bytes (memory) or units.
    pub capacity: Fields<u64>,
    /// Its taints (`DRADeviceTaints`): a failing GPU, one going to
    /// maintenance ([`super::health`]).
    pub taints: Box<[super::health::Taint]>,
}

/// A device's few named fields, sorted by name in one boxed slice: a
/// BTreeMap's first node holds room for eleven entries, which at 10,000
/// devices of five attributes and one capacity was most of the 1.1 KB each
/// took. The names are shared by every device that has them (one copy of
/// `uuid` for all).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Fields<V>(Box<[(Arc<str>, V)]>);

impl<V> Fields<V> {
    pub fn get(&self, name: &str) -> Option<&V> {
        self.0
            .binary_search_by(|(k, _)| (**k).cmp(name))
            .ok()
            .map(|i| &self.0[i].1)
    }

    pub fn iter(&self) -> impl Iterator<Item = (&str, &V)> {
        self.0.iter().map(|(k, v)| (&**k, v))
    }
}

impl<V> FromIterator<(String, V)> for Fields<V> {
    /// Sorted by name; of two with one name the last stands, as in a map.
    fn from_iter<I: IntoIterator<Item = (String, V)>>(fields: I) -> Self {
        let mut all: Vec<(String, V)> = fields.into_iter().collect();
        all.reverse();
        all.sort_by(|a, b| a.0.cmp(&b.0));
        all.dedup_by(|later, first| later.0 == first.0);
        let mut names = NAMES.lock().expect("field names lock");
        Fields(
            all.into_iter()
                .map(|(k, v)| (names.share(&Arc::from(k)), v))
                .collect(),
        )
    }
}

/// The fields' names, one copy of each (a driver may name its attributes
/// per device: unused ones are swept).
static NAMES: std::sync::LazyLock<std::sync::Mutex<Shared<str>>> =
    std::sync::LazyLock::new(Default::default);

impl Device {
    /// What a residency's `spec.device` names it by: its uuid attribute,
    /// else its index.
    pub fn spec_device(&self) -> Option<String> {
        if let Some(uuid) = self.attributes.get("uuid").and_then(|v| v.as_str()) {
            return Some(uuid.to_owned());
        }
        self.attributes
            .get("index")
            .and_then(|v| v.as_i64())
            .map(|i| i.to_string())
    }

    /// Its memory capacity, if published.
    pub fn memory(&self) -> Option<u64> {
        self.capacity.get("memory").copied()
    }
}

/// The devices of each slice as one list, by node and name, each once;
/// only a node's (a device every node reaches is none a set can stamp).
pub fn all_devices<'a>(per_slice: impl Iterator<Item = &'a Vec<Arc<Device>>>) -> Vec<Arc<Device>> {
    let mut out: Vec<Arc<Device>> = per_slice
        .flatten()
        .filter(|d| !d.node.is_empty())
        .cloned()
        .collect();
    out.sort_by(|a, b| (&a.node, &a.name).cmp(&(&b.node, &b.name)));
    out.dedup_by(|a, b| a.node == b.node && a.name == b.name && a.driver == b.driver);
    out
}

/// The devices one slice publishes. A device's node is the slice's, else
/// its own (`nodeName` per device); one that every node reaches has none
/// (an empty `node`). Each is shared with whoever decoded the same device
/// as it is: the GPU inventory and the ResidencySet controller watch the
/// slices each, and at 10,000 GPUs a second copy of every device was
/// 3.6 MB of the operator's heap.
pub fn slice_devices(s: &ResourceSlice) -> Vec<Arc<Device>> {
    let spec = &s.spec;
    let decoded = spec.devices.iter().flatten().map(|d| {
        let attributes = d
            .attributes
            .iter()
            .flatten()
            .map(|(k, a)| {
                let v = if let Some(i) = a.int {
                    serde_json::json!(i)
                } else if let Some(b) = a.bool {
                    serde_json::json!(b)
                } else if let Some(s) = &a.string {
                    serde_json::json!(s)
                } else {
                    serde_json::json!(a.version)
                };
                (unqualified(k, &spec.driver), v)
            })
            .collect();
        let capacity = d
            .capacity
            .iter()
            .flatten()
            .filter_map(|(k, c)| {
                Some((unqualified(k, &spec.driver), parse_bytes(&c.value.0).ok()?))
            })
            .collect();
        Device {
            node: spec
                .node_name
                .clone()
                .or_else(|| d.node_name.clone())
                .unwrap_or_default(),
            driver: spec.driver.clone(),
            pool: spec.pool.name.clone(),
            name: d.name.clone(),
            attributes,
            capacity,
            taints: d
                .taints
                .iter()
                .flatten()
                .map(|t| super::health::Taint {
                    key: t.key.clone(),
                    value: t.value.clone(),
                    effect: t.effect.clone(),
                    time_added: t.time_added.as_ref().map(|at| at.0.to_string()),
                })
                .collect(),
        }
    });
    let mut shared = SHARED.lock().expect("devices lock");
    decoded.map(|d| shared.share(&Arc::new(d))).collect()
}

/// The devices decoded so far, one copy of each as it is.
static SHARED: std::sync::LazyLock<std::sync::Mutex<Shared<Device>>> =
    std::sync::LazyLock::new(Default::default);

/// Hashed by where it is (node, driver, pool, name), equal when every field
/// is: a changed device is another value, its old copy swept once unused.
impl std::hash::Hash for Device {
    fn hash<H: std::hash::Hasher>(&self, h: &mut H) {
        (&self.node, &self.driver, &self.pool, &self.name).hash(h)
    }
}

/// An attribute's name without its driver's own domain (`gpu.nvidia.com/index`
/// is `index` for that driver's devices).
fn unqualified(name: &str, driver: &str) -> String {
    name.strip_prefix(driver)
        .and_then(|n| n.strip_prefix('/'))
        .unwrap_or(name)
        .to_owned()
}

/// Compiled CEL selectors; a device is selected when every one is true.
pub struct Selector {
    programs: Vec<(String, Program)>,
}

impl Selector {
    /// Compiles `expressions`; the first that does not compile is the error.
    /// Each is held to the bounds of [`cel_bounds`] first (their costs
    /// together), and parsed only then. Call it on a thread with
    /// [`SELECTOR_STACK`] of stack ([`select`] does).
    pub fn compile<'a>(expressions: impl IntoIterator<Item = &'a str>) -> Result<Selector, String> {
        let expressions: Vec<&str> = expressions.into_iter().collect();
        let mut cost = 0u64;
        for e in &expressions {
            cost = cost.saturating_add(cel_bounds::check(e)?);
        }
        if cost > cel_bounds::MAX_COST {
            return Err(format!(
                "the selectors would take about {cost} steps on each device; at most {} are run",
                cel_bounds::MAX_COST
            ));
        }
        let programs = expressions
            .into_iter()
            .map(|e| {
                // The parser (antlr4rust) panics on some malformed input
                // instead of failing: a user's selector is an error, never
                // a panic of the operator.
                std::panic::catch_unwind(|| Program::compile(e))
                    .map_err(|_| format!("{e:?} is not a CEL expression"))?
                    .map(|p| (e.to_owned(), p))
                    .map_err(|err| format!("{e:?} is not a CEL expression: {err}"))
            })
            .collect::<Result<_, _>>()?;
        Ok(Selector { programs })
    }

    /// Whether every selector is true for `device`; an expression that
    /// fails on it (a missing attribute) or is not a bool does not select
    /// it, and says why.
    pub fn selects(&self, device: &Device) -> Result<bool, String> {
        let mut context = Context::default();
        context.add_function("quantity", quantity);
        context.add_function("compareTo", compare_to);
        let by_domain = |m: HashMap<String, Value>| {
            Value::Map(HashMap::from([(device.driver.clone(), Value::Map(m.into()))]).into())
        };
        let attributes: HashMap<String, Value> = device
            .attributes
            .iter()
            .map(|(k, v)| (k.to_owned(), json_value(v)))
            .collect();
        let capacity: HashMap<String, Value> = device
            .capacity
            .iter()
            .map(|(k, v)| (k.to_owned(), Value::Int(*v as i64)))
            .collect();
        let value = Value::Map(
            HashMap::from([
                (
                    "driver".to_owned(),
                    Value::String(Arc::new(device.driver.clone())),
                ),
                ("attributes".to_owned(), by_domain(attributes)),
                ("capacity".to_owned(), by_domain(capacity)),
            ])
            .into(),
        );
        context.add_variable_from_value("device", value);
        for (text, program) in &self.programs {
            let run = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
                program.execute(&context)
            }));
            let Ok(result) = run else {
                return Err(format!(
                    "{text:?} failed on {}/{}",
                    device.node, device.name
                ));
            };
            match result {
                Ok(Value::Bool(true)) => {}
                Ok(Value::Bool(false)) => return Ok(false),
                Ok(other) => return Err(format!("{text:?} gave {other:?}, not a bool")),
                Err(e) => return Err(format!("{text:?} on {}/{}: {e}", device.node, device.name)),
            }
        }
        Ok(true)
    }
}

/// The stack of the thread selectors are parsed and run on: the parser
/// and the evaluator recurse, and a tree within [`cel_bounds`] stays far
/// inside it (a tokio worker's 2 MiB overflowed at 500 brackets). Only the
/// pages it touches are memory.
pub const SELECTOR_STACK: usize = 64 << 20;

/// What a set's selectors picked.
#[derive(Debug, Default)]
pub struct Selection {
    pub selected: Vec<Arc<Device>>,
    /// The first error of a selector on a device (that device is not
    /// selected), for the set's status.
    pub failed_on: Option<String>,
}

/// Runs `f` on a thread of its own with [`SELECTOR_STACK`] of stack.
pub fn on_selector_thread<T: Send + 'static>(f: impl FnOnce() -> T + Send + 'static) -> T {
    std::thread::Builder::new()
        .name("cel-selector".into())
        .stack_size(SELECTOR_STACK)
        .spawn(f)
        .expect("a selector thread")
        .join()
        .unwrap_or_else(|panic| std::panic::resume_unwind(panic))
}

/// Compiles `expressions` and runs them over `devices`, off the async
/// runtime: on a thread of its own ([`on_selector_thread`]), awaited here.
/// The error is why the selectors cannot run (they do not compile, or
/// pass a bound).
pub async fn select(
    expressions: Vec<String>,
    devices: Vec<Arc<Device>>,
) -> Result<Selection, String> {
    let (tx, rx) = tokio::sync::oneshot::channel();
    std::thread::Builder::new()
        .name("cel-selector".into())
        .stack_size(SELECTOR_STACK)
        .spawn(move || {
            let _ = tx.send(select_now(&expressions, devices));
        })
        .map_err(|e| format!("no thread to run the selectors on: {e}"))?;
    rx.await
        .map_err(|_| "the selectors' thread ended without an answer".to_owned())?
}

/// [`select`]'s work, on the thread that runs it.
fn select_now(expressions: &[String], devices: Vec<Arc<Device>>) -> Result<Selection, String> {
    let selector = Selector::compile(expressions.iter().map(String::as_str))?;
    let mut out = Selection::default();
    for d in devices {
        match selector.selects(&d) {
            Ok(true) => out.selected.push(d),
            Ok(false) => {}
            Err(e) => {
                out.failed_on.get_or_insert(e);
            }
        }
    }
    Ok(out)
}

fn json_value(v: &serde_json::Value) -> Value {
    match v {
        serde_json::Value::Bool(b) => Value::Bool(*b),
        serde_json::Value::Number(n) => Value::Int(n.as_i64().unwrap_or_default()),
        serde_json::Value::String(s) => Value::String(Arc::new(s.clone())),
        _ => Value::Null,
    }
}

/// `quantity("40Gi")`: a Kubernetes quantity, as bytes.
fn quantity(s: Arc<String>) -> cel_interpreter::ResolveResult {
    parse_bytes(&s)
        .map(|b| Value::Int(b as i64))
        .map_err(|e| cel_interpreter::ExecutionError::function_error("quantity", e.to_string()))
}

/// `a.compareTo(b)`: -1, 0 or 1, as Kubernetes' quantities compare.
fn compare_to(This(this): This<i64>, other: i64) -> i64 {
    match this.cmp(&other) {
        std::cmp::Ordering::Less => -1,
        std::cmp::Ordering::Equal => 0,
        std::cmp::Ordering::Greater => 1,
    }
}

/// Whether `labels` (a node's) has every label of `selector`.
pub fn node_matches(
    selector: Option<&BTreeMap<String, String>>,
    labels: Option<&BTreeMap<String, String>>,
) -> bool {
    selector.is_none_or(|want| {
        want.iter()
            .all(|(k, v)| labels.and_then(|l| l.get(k)) == Some(v))
    })
}

/// The name of set `set`'s residency for `device` on `node`: the three,
/// readable (`h100s-node-a-gpu-0`), a DNS label; a name longer than 63
/// characters keeps its start and a hash of the whole.
pub fn stamped_name(set: &str, node: &str, device: &str) -> String {
    let raw = format!("{set}-{node}-{device}");
    let clean: String = raw
        .to_lowercase()
        .chars()
        .map(|c| {
            if c.is_ascii_alphanumeric() || c == '-' {
                c
            } else {
                '-'
            }
        })
        .collect();
    let clean = clean.trim_matches('-').to_owned();
    if clean.len() <= 63 {
        return clean;
    }
    with_hash(&clean, &raw)
}

/// The name of set `set`'s residency for `device` on `node` when
/// [`stamped_name`]'s is taken: its start and a hash of the three, kept
/// apart (`s-node` on node `e` and `s` on node `node-e` hash unlike).
pub fn stamped_name_hashed(set: &str, node: &str, device: &str) -> String {
    let plain = stamped_name(set, node, device);
    let raw = format!("{set}\n{node}\n{device}");
    with_hash(&plain[..plain.len().min(54)], &raw)
}

/// `clean` cut to 54 characters and an 8-hex-digit hash of `raw`.
fn with_hash(clean: &str, raw: &str) -> String {
    let digest = ring::digest::digest(&ring::digest::SHA256, raw.as_bytes());
    let hash: String = digest.as_ref()[..4]
        .iter()
        .map(|b| format!("{b:02x}"))
        .collect();
    format!(
        "{}-{hash}",
        clean[..clean.len().min(54)].trim_end_matches('-')
    )
}

#[cfg(test)]
mod tests {
    #[test]
    fn fields_are_found_by_name_and_the_last_of_a_name_stands() {
        let f: Fields<u64> = [
            ("b".to_owned(), 1),
            ("a".to_owned(), 2),
            ("b".to_owned(), 3),
        ]
        .into_iter()
        .collect();
        assert_eq!(
            (f.get("a"), f.get("b"), f.get("c")),
            (Some(&2), Some(&3), None)
        );
        let names: Vec<&str> = f.iter().map(|(k, _)| k).collect();
        assert_eq!(names, ["a", "b"]);
    }

    use super::*;
    use serde_json::json;

    fn slice(node: &str, devices: serde_json::Value) -> Arc<ResourceSlice> {
        Arc::new(
            serde_json::from_value(json!({
                "metadata": {"name": format!("{node}-gpu")},
                "spec": {"driver": "gpu.nvidia.com", "nodeName": node,
                    "pool": {"name": node, "generation": 1, "resourceSliceCount": 1},
                    "devices": devices},
            }))
            .unwrap(),
        )
    }

    #[test]
    fn one_device_decoded_twice_is_one_copy_until_it_changes() {
        // A node name of this test's own: the shared set is process-wide.
        let first = slice_devices(&slice("shared-a", json!([gpu(0, "H100", "80Gi")])));
        let again = slice_devices(&slice("shared-a", json!([gpu(0, "H100", "80Gi")])));
        assert!(Arc::ptr_eq(&first[0], &again[0]));
        let changed = slice_devices(&slice("shared-a", json!([gpu(0, "H100", "40Gi")])));
        assert!(!Arc::ptr_eq(&first[0], &changed[0]));
        assert_eq!(changed[0].memory(), Some(40 << 30));
        // A device with its own node in a slice of none is that node's; one
        // with none is no node's and no set stamps it.
        let mut per_device: ResourceSlice =
            (*slice("x", json!([gpu(0, "H100", "80Gi"), gpu(1, "H100", "80Gi")]))).clone();
        per_device.spec.node_name = None;
        per_device.spec.devices.as_mut().unwrap()[0].node_name = Some("shared-b".into());
        let devices = slice_devices(&per_device);
        assert_eq!(
            (devices[0].node.as_str(), devices[1].node.as_str()),
            ("shared-b", "")
        );
        let stampable = all_devices([devices].iter());
        assert_eq!(stampable.len(), 1);
    }

    fn gpu(i: i64, product: &str, memory: &str) -> serde_json::Value {
        json!({"name": format!("gpu-{i}"), "attributes": {"type": {"string": "gpu"}, "index": {"int": i},
            "uuid": {"string": format!("GPU-{i}")}, "productName": {"string": product}},
            "capacity": {"memory": {"value": memory}}})
    }

    #[test]
    fn devices_are_selected_by_class_and_set_selectors_as_a_claim_selects_them() {
        let per_slice = [
            slice("a", json!([gpu(0, "H100", "80Gi"), gpu(1, "A10", "24Gi")])),
            slice("b", json!([gpu(0, "H100", "80Gi")])),
        ]
        .map(|s| slice_devices(&s));
        let devices = all_devices(per_slice.iter());
        assert_eq!(devices.len(), 3);
        assert_eq!(devices[0].spec_device().as_deref(), Some("GPU-0"));
        assert_eq!(devices[0].memory(), Some(80 << 30));
        let class = "device.driver == 'gpu.nvidia.com' && device.attributes['gpu.nvidia.com'].type == 'gpu'";
        let big = "device.capacity['gpu.nvidia.com'].memory.compareTo(quantity('40Gi')) >= 0";
        let s = Selector::compile([class, big]).unwrap();
        let picked: Vec<_> = devices
            .iter()
            .filter(|d| s.selects(d).unwrap())
            .map(|d| format!("{}/{}", d.node, d.name))
            .collect();
        assert_eq!(picked, ["a/gpu-0", "b/gpu-0"]);
        let h100 =
            Selector::compile(["device.attributes['gpu.nvidia.com'].productName.startsWith('A1')"])
                .unwrap();
        assert!(h100.selects(&devices[1]).unwrap());
        // A missing attribute does not select, and says why.
        let missing =
            Selector::compile(["device.attributes['gpu.nvidia.com'].nvlinkDomain == 3"]).unwrap();
        assert!(missing.selects(&devices[0]).is_err());
        assert!(Selector::compile(["device.driver =="]).is_err());
    }

    #[test]
    fn a_stamped_name_says_which_gpu_and_stays_a_dns_label() {
        assert_eq!(
            stamped_name("h100s", "node-a", "gpu-0"),
            "h100s-node-a-gpu-0"
        );
        assert_eq!(
            stamped_name("s", "Node.Example.COM", "gpu-1"),
            "s-node-example-com-gpu-1"
        );
        let long = stamped_name(&"x".repeat(40), &"n".repeat(40), "gpu-0");
        assert!(long.len() <= 63, "{long}");
        assert_ne!(
            long,
            stamped_name(&"x".repeat(40), &"n".repeat(40), "gpu-1")
        );
        assert!(node_matches(None, None));
        let want = BTreeMap::from([("pool".to_owned(), "big".to_owned())]);
        assert!(!node_matches(Some(&want), None));
        assert!(node_matches(Some(&want), Some(&want)));
    }
}
