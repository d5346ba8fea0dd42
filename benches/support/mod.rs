//! What the cluster and router benchmarks share: arguments, namespaces,
//! the write-to-watch floor (a patch until a watch sees it), percentiles.
#![allow(dead_code)]

use futures::{StreamExt, TryStreamExt};
use k8s_openapi::api::core::v1::Namespace;
use kube::ResourceExt;
use kube::api::{Api, Patch, PatchParams, PostParams};
use kube::runtime::{WatchStreamExt, watcher};
use serde_json::json;
use std::time::{Duration, Instant};

/// The arguments after `cargo bench -- ` (without the `--bench` cargo adds).
pub fn bench_args() -> Vec<String> {
    std::env::args()
        .skip(1)
        .filter(|a| a != "--bench")
        .collect()
}

/// The runtime every bench runs on: two workers, as the machine has cores.
pub fn runtime() -> tokio::runtime::Runtime {
    tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .unwrap()
}

/// The local control plane, built once by `scripts/control-plane.sh`.
pub fn start_plane() -> model_residency::local::control_plane::ControlPlane {
    model_residency::local::control_plane::ControlPlane::start()
        .expect("start the control plane (bash scripts/control-plane.sh)")
}

pub fn arg(args: &[String], name: &str, default: &str) -> String {
    args.iter()
        .position(|a| a == name)
        .and_then(|i| args.get(i + 1))
        .cloned()
        .unwrap_or_else(|| default.to_owned())
}

/// A client of `plane` with the project's CRDs installed and `namespaces`
/// created: what every bench against the control plane starts with.
pub async fn client_with(
    plane: &model_residency::local::control_plane::ControlPlane,
    namespaces: &[&str],
) -> kube::Client {
    let client = plane.client().await.unwrap();
    model_residency::local::install_crd(&client).await.unwrap();
    for ns in namespaces {
        create_namespace(&client, ns).await;
    }
    client
}

pub async fn create_namespace(client: &kube::Client, name: &str) {
    let nss: Api<Namespace> = Api::all(client.clone());
    nss.create(
        &PostParams::default(),
        &serde_json::from_value(json!({"metadata": {"name": name}})).unwrap(),
    )
    .await
    .unwrap();
}

/// What `read` makes of each version of the object `name` seen through a
/// watch (versions it maps to `None` are skipped), latest first.
pub fn watch_named<K, T>(
    api: Api<K>,
    name: &str,
    read: impl Fn(K) -> Option<T> + Send + 'static,
) -> tokio::sync::watch::Receiver<T>
where
    K: kube::Resource + Clone + std::fmt::Debug + serde::de::DeserializeOwned + Send + 'static,
    T: Default + Send + Sync + 'static,
{
    let (tx, rx) = tokio::sync::watch::channel(T::default());
    let config = watcher::Config::default().fields(&format!("metadata.name={name}"));
    tokio::spawn(async move {
        let mut s = watcher(api, config).applied_objects().boxed();
        while let Ok(Some(o)) = s.try_next().await {
            if let Some(v) = read(o) {
                let _ = tx.send(v);
            }
        }
    });
    rx
}

/// The latest `poke` annotation of the object named `floor`.
pub fn watch_poke<K>(api: Api<K>) -> tokio::sync::watch::Receiver<String>
where
    K: kube::Resource + Clone + std::fmt::Debug + serde::de::DeserializeOwned + Send + 'static,
{
    watch_named(api, "floor", |o: K| {
        Some(o.annotations().get("poke").cloned().unwrap_or_default())
    })
}

/// One floor sample: merge-patch `floor`'s `poke` annotation to `value`,
/// until the watch sees it.
pub async fn poke<K>(
    api: &Api<K>,
    seen: &tokio::sync::watch::Receiver<String>,
    value: &str,
) -> Duration
where
    K: kube::Resource + Clone + std::fmt::Debug + serde::de::DeserializeOwned,
{
    let mut seen = seen.clone();
    let t0 = Instant::now();
    api.patch(
        "floor",
        &PatchParams::default(),
        &Patch::Merge(json!({"metadata": {"annotations": {"poke": value}}})),
    )
    .await
    .unwrap();
    seen.wait_for(|v| v == value).await.unwrap();
    t0.elapsed()
}

/// The quiet before each sample of [`quiet_pokes`]: about what precedes a
/// wake's status write in the warm bench (the fake server's 200 ms wake).
pub const QUIET: Duration = Duration::from_millis(250);

/// `samples` floor samples, each after `quiet` with nothing written, sorted:
/// the write as a load's or a wake's writes come (after a wait), where
/// samples back to back find the API server hot (about twice as fast here).
pub async fn quiet_pokes<K>(
    api: &Api<K>,
    seen: &tokio::sync::watch::Receiver<String>,
    samples: usize,
    quiet: Duration,
) -> Vec<Duration>
where
    K: kube::Resource + Clone + std::fmt::Debug + serde::de::DeserializeOwned,
{
    let mut v = Vec::with_capacity(samples);
    for i in 0..samples {
        tokio::time::sleep(quiet).await;
        v.push(poke(api, seen, &format!("q{i}")).await);
    }
    v.sort();
    v
}

pub fn percentile(sorted: &[Duration], p: f64) -> Duration {
    sorted[((sorted.len() as f64 * p).ceil() as usize).clamp(1, sorted.len()) - 1]
}

pub fn ms(d: Duration) -> f64 {
    d.as_secs_f64() * 1e3
}

/// Copies residency `name`, its spec and its status, to `floor` in `to`'s
/// namespace (which no operator watches), replacing an earlier copy: a
/// floor object as large as the one measured. A custom resource's write
/// costs the API server more the larger the object is (decoding, schema
/// validation and pruning, managedFields), so a one-model object's round
/// trip understates what a write to a 20-model residency with its status
/// can take.
pub async fn copy_as_floor(
    from: &Api<model_residency::api::ModelResidency>,
    name: &str,
    to: &Api<model_residency::api::ModelResidency>,
) {
    let r = from.get(name).await.unwrap();
    copy_residency(&r, to, "floor").await;
}

/// Writes `r`'s spec and status to `name` in `to`'s namespace, creating it
/// or replacing an earlier copy.
pub async fn copy_residency(
    r: &model_residency::api::ModelResidency,
    to: &Api<model_residency::api::ModelResidency>,
    name: &str,
) {
    let copy = model_residency::api::ModelResidency::new(name, r.spec.clone());
    match to.create(&PostParams::default(), &copy).await {
        Ok(_) => {}
        Err(kube::Error::Api(s)) if s.code == 409 => {
            to.patch(
                name,
                &PatchParams::default(),
                &Patch::Merge(json!({"spec": r.spec})),
            )
            .await
            .unwrap();
        }
        Err(e) => panic!("create the copy {name}: {e}"),
    }
    to.patch_status(
        name,
        &PatchParams::default(),
        &Patch::Merge(json!({"status": r.status})),
    )
    .await
    .unwrap();
}

/// Waits until model `model` of residency `gpu` is in state `want`, looking
/// every 10 ms (fine enough to time a load by), for at most `within`.
pub async fn until_state(
    api: &Api<model_residency::api::ModelResidency>,
    model: &str,
    want: model_residency::api::ModelState,
    within: Duration,
) {
    until_state_of(api, "gpu", model, want, within).await
}

/// [`until_state`] for residency `residency`.
pub async fn until_state_of(
    api: &Api<model_residency::api::ModelResidency>,
    residency: &str,
    model: &str,
    want: model_residency::api::ModelState,
    within: Duration,
) {
    let deadline = Instant::now() + within;
    loop {
        let r = api.get(residency).await.unwrap();
        if r.model_status(model).map(|m| m.state) == Some(want) {
            return;
        }
        assert!(Instant::now() < deadline, "{model} never became {want:?}");
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
}

/// A runtime whose threads' CPU time is counted, so the operator's CPU can
/// be told apart from the bench's own load generator and the kubelet
/// stand-in, which run on the bench's runtime in the same process.
pub struct CountedRuntime {
    pub rt: tokio::runtime::Runtime,
    live: std::sync::Arc<std::sync::Mutex<std::collections::HashSet<i32>>>,
    /// CPU seconds of its threads that have ended.
    ended: std::sync::Arc<std::sync::Mutex<f64>>,
}

impl CountedRuntime {
    #[allow(unsafe_code)] // a libc call std has no safe wrapper for
    pub fn new(workers: usize) -> Self {
        let live = std::sync::Arc::new(std::sync::Mutex::new(std::collections::HashSet::new()));
        let ended = std::sync::Arc::new(std::sync::Mutex::new(0.0));
        let (started, stopping, total) = (live.clone(), live.clone(), ended.clone());
        let rt = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(workers)
            .enable_all()
            .on_thread_start(move || {
                // SAFETY: gettid has no preconditions.
                started.lock().unwrap().insert(unsafe { libc::gettid() });
            })
            .on_thread_stop(move || {
                // SAFETY: as above.
                let tid = unsafe { libc::gettid() };
                *total.lock().unwrap() += thread_cpu(tid);
                stopping.lock().unwrap().remove(&tid);
            })
            .build()
            .unwrap();
        CountedRuntime { rt, live, ended }
    }

    /// CPU seconds its threads have used so far.
    pub fn cpu_seconds(&self) -> f64 {
        let live: f64 = self
            .live
            .lock()
            .unwrap()
            .iter()
            .map(|&t| thread_cpu(t))
            .sum();
        live + *self.ended.lock().unwrap()
    }
}

fn thread_cpu(tid: i32) -> f64 {
    let stat = format!("/proc/self/task/{tid}/stat");
    model_residency::local::control_plane::cpu_seconds_of(std::path::Path::new(&stat))
        .unwrap_or(0.0)
}
