//! An operator under test: the real controller, run in-process against the
//! shared control plane and watching only the test's namespace, a kubelet
//! stand-in for the test's fake node, and helpers to drive demand and wait
//! for convergence.

use super::cluster::{TestEnv, eventually, test_env};
use futures::TryStreamExt;
use k8s_openapi::api::core::v1::Pod;
use k8s_openapi::api::events::v1::Event;
use k8s_openapi::jiff::Timestamp;
use kube::api::{Api, PostParams};
use kube::runtime::{WatchStreamExt, watcher};
use model_residency::api::{ModelResidency, ModelState};
use model_residency::controller::Context;
use model_residency::local::kubelet::{FakeKubelet, KubeletConfig};
use model_residency::quantity::parse_bytes;
use model_residency::residency::demand;
use model_residency::residency::gangs::GANG_MEMBERS_ANNOTATION;
use model_residency::residency::labels::{RESIDENCY_LABEL, SIZE_ANNOTATION};
use serde_json::json;
use std::collections::{BTreeMap, BTreeSet};
use std::sync::{Arc, Mutex};
use std::time::Duration;

pub struct Harness {
    pub env: TestEnv,
    pub api: Api<ModelResidency>,
    pub pods: Api<Pod>,
    pub ctx: Arc<Context>,
    pub node: String,
    /// spec.gpu.mode of the residencies `create` makes (default: the
    /// spec's default, claim).
    pub gpu_mode: Option<&'static str>,
    /// The model pods' template (`server_template`'s by default; the real
    /// node's runs the local fake-model-server image).
    pub template: fn(&str) -> serde_json::Value,
    last_time: Mutex<Timestamp>,
    pub next_device: std::sync::atomic::AtomicU32,
    /// The copy scaler's settings the operator starts with (off by default).
    pub copies: model_residency::controller::copies::CopiesConfig,
    /// How often the operator's sleep audit runs (its default unless set).
    pub sleep_audit: Duration,
    /// The stand-in, unless the node is real.
    _kubelet: Option<FakeKubelet>,
    stop: Option<tokio::sync::oneshot::Sender<()>>,
    task: Option<tokio::task::JoinHandle<()>>,
}

impl Drop for Harness {
    fn drop(&mut self) {
        if let Some(stop) = self.stop.take() {
            let _ = stop.send(());
        }
        if let Some(task) = self.task.take() {
            task.abort();
        }
    }
}

/// The stand-in's model pod template: any image (nothing is pulled).
pub fn server_template(model: &str) -> serde_json::Value {
    json!({"spec": {"containers": [{"name": "server", "image": format!("example/{model}:1")}]}})
}

/// A model for `Harness::create`: (name, size, pinned).
pub type Model<'a> = (&'a str, &'a str, bool);

impl Harness {
    pub async fn start(test: &str) -> Harness {
        Self::start_with(test, Duration::from_millis(30)).await
    }

    pub async fn start_with(test: &str, load_delay: Duration) -> Harness {
        Self::start_kubelet(test, |c| c.load_delay = load_delay).await
    }

    /// Starts with the kubelet stand-in configured by `configure` (pods
    /// ready at once by default).
    pub async fn start_kubelet(test: &str, configure: impl FnOnce(&mut KubeletConfig)) -> Harness {
        let env = test_env(test).await;
        env.install_crds();
        let node = env.node("gpu");
        let mut config = KubeletConfig::instant(&[&node]);
        // A GPU per residency a test makes (each on a device of its own).
        config.nodes[0].gpus = 16;
        configure(&mut config);
        let kubelet = FakeKubelet::start(env.client.clone(), config)
            .await
            .unwrap();
        Self::with(env, node, Some(kubelet), Context::new)
    }

    /// An operator (made by `context`) for `env`'s namespace, on `node`
    /// (played by `kubelet`, or a real node's).
    pub fn with(
        env: TestEnv,
        node: String,
        kubelet: Option<FakeKubelet>,
        context: fn(kube::Client) -> Arc<Context>,
    ) -> Harness {
        let ctx = context(env.client.clone());
        let mut h = Harness {
            api: Api::namespaced(env.client.clone(), &env.namespace),
            pods: Api::namespaced(env.client.clone(), &env.namespace),
            ctx,
            node,
            env,
            gpu_mode: None,
            template: server_template,
            last_time: Mutex::new(Timestamp::UNIX_EPOCH),
            next_device: Default::default(),
            copies: Default::default(),
            sleep_audit: model_residency::controller::sleep_audit::DEFAULT_INTERVAL,
            _kubelet: kubelet,
            stop: None,
            task: None,
        };
        h.start_operator();
        h
    }

    /// Starts the operator (again), with the same metrics.
    pub fn start_operator(&mut self) {
        let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
        let ns = self.env.namespace.clone();
        let ctx = Context::with_options(
            self.env.client.clone(),
            self.ctx.metrics.clone(),
            self.ctx.max_skew,
            self.ctx.initial_list,
            self.ctx.gpu_holder_image.clone(),
        );
        let mut ctx = ctx;
        let fresh = Arc::get_mut(&mut ctx).expect("a new context");
        fresh.copies = self.copies.clone();
        fresh.sleep_audit = self.sleep_audit;
        // As the chart's anticipation.persistForecasts: the anticipation
        // tests restart the operator and read them back.
        fresh.forecasts.persist = true;
        self.ctx = ctx.clone();
        self.task = Some(tokio::spawn(async move {
            model_residency::operator::run(
                ctx,
                Some(ns),
                async {
                    let _ = stopped.await;
                },
                Default::default(),
            )
            .await
        }));
        self.stop = Some(stop);
    }

    /// Stops the operator (its watches and its writes).
    pub async fn stop_operator(&mut self) {
        if let Some(stop) = self.stop.take() {
            let _ = stop.send(());
        }
        self.abort_operator().await;
    }

    /// Aborts the operator's task at once, without its graceful shutdown:
    /// what a lost lease does to the leader's controller (operator::Term).
    pub async fn abort_operator(&mut self) {
        if let Some(task) = self.task.take() {
            task.abort();
            let _ = task.await;
        }
        // Dropped only now: a dropped sender is a graceful shutdown.
        self.stop.take();
    }

    /// Creates a residency on the test's node with a server template per
    /// model, on a GPU of its own (two residencies on one GPU conflict).
    pub async fn create(&self, name: &str, budget: &str, models: &[Model<'_>]) -> ModelResidency {
        let device = self
            .next_device
            .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        self.create_on(name, budget, models, &device.to_string())
            .await
    }

    /// Creates a residency on GPU `device` of the test's node.
    pub async fn create_on(
        &self,
        name: &str,
        budget: &str,
        models: &[Model<'_>],
        device: &str,
    ) -> ModelResidency {
        let models: Vec<_> = models
            .iter()
            .map(|(n, size, pinned)| {
                json!({"name": n, "size": size, "pinned": pinned, "template": (self.template)(n)})
            })
            .collect();
        let mut spec =
            json!({"nodeName": self.node, "device": device, "budget": budget, "models": models});
        if let Some(mode) = self.gpu_mode {
            spec["gpu"] = json!({"mode": mode});
        }
        let r: ModelResidency = serde_json::from_value(json!({
            "apiVersion": "residency.dev/v1alpha1", "kind": "ModelResidency",
            "metadata": {"name": name},
            "spec": spec,
        }))
        .unwrap();
        let created = self.api.create(&PostParams::default(), &r).await.unwrap();
        if matches!(self.gpu_mode, None | Some("claim")) {
            self.placed(name).await;
        }
        created
    }

    /// Waits until residency `name`'s status says where its GPU is (claim
    /// mode: its claim allocated), as a residency is once it is set up:
    /// requests sent before that wait for the claim (gpu_claims.rs).
    pub async fn placed(&self, name: &str) -> ModelResidency {
        eventually(30, &format!("{name}'s GPU to be placed"), || async {
            let r = self.api.get(name).await.ok()?;
            let gpu = r.status.as_ref()?.gpu.as_ref()?;
            (gpu.node.is_some() && gpu.device.is_some()).then_some(r.clone())
        })
        .await
    }

    /// Merge-patches residency `name`'s spec with `spec`, as an admin's
    /// `kubectl patch --type=merge` would.
    pub async fn patch_spec(&self, name: &str, spec: serde_json::Value) {
        let body = json!({ "spec": spec });
        let pp = kube::api::PatchParams::default();
        self.api
            .patch(name, &pp, &kube::api::Patch::Merge(&body))
            .await
            .unwrap();
    }

    /// A strictly increasing request time.
    fn next_time(&self) -> Timestamp {
        let mut last = self.last_time.lock().unwrap();
        let now = Timestamp::now().max(*last + Duration::from_micros(1));
        *last = now;
        now
    }

    /// Requests `model` and waits until the operator has processed it and
    /// converged.
    pub async fn request(&self, name: &str, model: &str) -> ModelResidency {
        let at = self.next_time();
        demand::load(&self.api, name, model, at).await.unwrap();
        let want = at.to_string();
        eventually(
            30,
            &format!("{name} to process the request for {model}"),
            || async {
                let r = self.api.get(name).await.unwrap();
                let seen = r
                    .status
                    .as_ref()
                    .and_then(|s| s.model(model))
                    .and_then(|m| m.last_requested.clone());
                (seen.as_deref() == Some(want.as_str())).then_some(())
            },
        )
        .await;
        self.converged(name).await
    }

    /// Waits (up to `secs`) until `model` of residency `name` is in `state`.
    pub async fn until_state(
        &self,
        name: &str,
        model: &str,
        state: ModelState,
        secs: u64,
    ) -> ModelResidency {
        // On a timeout, what the residency said last (a test that times
        // out here is then readable from its output alone).
        let deadline = tokio::time::Instant::now() + Duration::from_secs(secs);
        loop {
            let r = self.api.get(name).await.unwrap();
            let reached = r.status.as_ref().is_some_and(|s| {
                s.models
                    .iter()
                    .any(|m| &*m.name == model && m.state == state)
            });
            if reached {
                return r;
            }
            if tokio::time::Instant::now() >= deadline {
                let (live, terminating) = self.pods_of(name).await;
                panic!(
                    "timed out after {secs} s waiting for {model} to be {state:?}; last status:\n{}\nlive pods {live:?}, terminating {terminating}\nevents:\n{}",
                    serde_json::to_string_pretty(&r.status).unwrap(),
                    self.events_of(name).await.join("\n")
                );
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }

    /// Requests `model` without waiting.
    pub async fn request_nowait(&self, name: &str, model: &str) {
        let at = self.next_time();
        demand::load(&self.api, name, model, at).await.unwrap();
    }

    /// Waits until every demand entry of `name` has been processed (none
    /// waits in the queue any more), then until it has converged. After a
    /// storm, requests queued behind loading models are served oldest
    /// first, possibly after a newer request that was a hit: which model is
    /// resident at the end is the last one served, not the last requested.
    pub async fn drained(&self, name: &str) -> ModelResidency {
        eventually(
            60,
            &format!("{name} to serve every queued request"),
            || async {
                let r = self.api.get(name).await.unwrap();
                let status = r.status.as_ref()?;
                let served = r.spec.demand.iter().all(|(model, at)| {
                    let seen = status
                        .model(model)
                        .and_then(|m| recorded(m.last_requested.as_deref()));
                    seen.is_some_and(|seen| Some(seen) >= recorded(Some(at)))
                });
                let queued = status.models.iter().any(|m| m.state == ModelState::Queued);
                (served && !queued).then_some(())
            },
        )
        .await;
        self.converged(name).await
    }

    /// Waits until the status reflects the current spec, every resident
    /// model is Loaded, Failed or asleep (confirmed), and the live pods are
    /// exactly the Loaded and Sleeping models' pods.
    pub async fn converged(&self, name: &str) -> ModelResidency {
        let last = Mutex::new(String::new());
        let deadline = tokio::time::Instant::now() + Duration::from_secs(60);
        while tokio::time::Instant::now() < deadline {
            if let Some(r) = self.converged_now(name, &last).await {
                return r;
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        panic!(
            "{name} did not converge in 60 s; last seen:\n{}",
            last.lock().unwrap()
        );
    }

    async fn converged_now(&self, name: &str, last: &Mutex<String>) -> Option<ModelResidency> {
        {
            let r = self.api.get(name).await.unwrap();
            let (live, terminating) = self.pods_of(name).await;
            *last.lock().unwrap() = format!(
                "generation {:?}\nstatus {}\nlive pods {live:?}, terminating {terminating}",
                r.metadata.generation,
                serde_json::to_string_pretty(&r.status).unwrap()
            );
            let status = r.status.as_ref()?;
            if status.observed_generation != r.metadata.generation {
                return None;
            }
            let starting = |m: &&model_residency::api::ModelStatus| {
                matches!(m.state, ModelState::Loading | ModelState::Fetching)
            };
            if status.models.iter().any(|m| starting(&m)) {
                return None;
            }
            // A sleeping model keeps its pod, once its sleep is confirmed.
            let falling_asleep = status
                .models
                .iter()
                .any(|m| m.state == ModelState::Sleeping && m.reason.as_deref() != Some("Asleep"));
            if falling_asleep {
                return None;
            }
            let loaded: BTreeSet<String> = status
                .models
                .iter()
                .filter(|m| matches!(m.state, ModelState::Loaded | ModelState::Sleeping))
                .map(|m| m.name.to_string())
                .collect();
            (terminating == 0 && live == loaded).then_some(r)
        }
    }

    /// The events about residency `name`, oldest first, one line each
    /// (what a test that timed out prints, to say how it got there).
    pub async fn events_of(&self, name: &str) -> Vec<String> {
        let api: Api<Event> = Api::namespaced(self.api.clone().into_client(), &self.env.namespace);
        let Ok(list) = api.list(&kube::api::ListParams::default()).await else {
            return vec!["(the events could not be listed)".into()];
        };
        let mut lines: Vec<(String, String)> = list
            .items
            .into_iter()
            .filter(|e| e.regarding.as_ref().and_then(|r| r.name.as_deref()) == Some(name))
            .map(|e| {
                let at = e
                    .event_time
                    .as_ref()
                    .map(|t| t.0.to_string())
                    .unwrap_or_default();
                let count = e.series.as_ref().map_or(1, |s| s.count);
                let line = format!(
                    "{at} {} x{count}: {}",
                    e.reason.unwrap_or_default(),
                    e.note.unwrap_or_default()
                );
                (at, line)
            })
            .collect();
        lines.sort();
        lines.into_iter().map(|(_, l)| l).collect()
    }

    /// Models of live, non-deleting pods of a residency, and the number of
    /// terminating ones.
    pub async fn pods_of(&self, name: &str) -> (BTreeSet<String>, usize) {
        // Its own pods, and the pods of gangs it is a member of.
        let lp = kube::api::ListParams::default().labels(RESIDENCY_LABEL);
        let pods = self.pods.list(&lp).await.unwrap();
        let mine = |p: &Pod| {
            let labelled = p
                .metadata
                .labels
                .as_ref()
                .and_then(|l| l.get(RESIDENCY_LABEL));
            let gang = p
                .metadata
                .annotations
                .as_ref()
                .and_then(|a| a.get(GANG_MEMBERS_ANNOTATION));
            labelled.is_some_and(|l| l == name)
                || gang.is_some_and(|g| g.split(',').any(|m| m == name))
        };
        let mut live = BTreeSet::new();
        let mut terminating = 0;
        for p in pods.items.into_iter().filter(mine) {
            if p.metadata.deletion_timestamp.is_some() {
                terminating += 1;
            } else if p.status.as_ref().and_then(|s| s.phase.as_deref()) != Some("Failed") {
                live.insert(p.metadata.labels.unwrap()["residency.dev/model"].clone());
            }
        }
        (live, terminating)
    }

    /// Starts the independent budget watcher over this namespace's pods.
    pub fn budget_watcher(&self, budgets: BTreeMap<String, u64>) -> BudgetWatcher {
        BudgetWatcher::start(self.pods.clone(), budgets)
    }
}

/// What a model pod holds, as the budget watchers charge it: `None` once it
/// is deleted or finished (Succeeded, Failed); else its residencies (a
/// gang's pod is every member's) and its declared size.
fn charged(p: &Pod, deleted: bool) -> Option<(Vec<String>, u64)> {
    let finished = matches!(
        p.status.as_ref().and_then(|s| s.phase.as_deref()),
        Some("Failed" | "Succeeded")
    );
    if deleted || finished {
        return None;
    }
    let labels = p.metadata.labels.clone().unwrap_or_default();
    let annotations = p.metadata.annotations.clone().unwrap_or_default();
    let size = annotations
        .get(SIZE_ANNOTATION)
        .and_then(|s| parse_bytes(s).ok())
        .unwrap_or(u64::MAX / 4);
    let members = match annotations.get(GANG_MEMBERS_ANNOTATION) {
        Some(g) => g.split(',').map(str::to_owned).collect(),
        None => vec![labels.get(RESIDENCY_LABEL).cloned().unwrap_or_default()],
    };
    Some((members, size))
}

/// Watches every model pod and, after each event, checks that the declared
/// sizes of each residency's live pods (terminating included; Succeeded and
/// Failed excluded) stay within its budget.
pub struct BudgetWatcher {
    pub violations: Arc<Mutex<Vec<String>>>,
    pub events: Arc<Mutex<u64>>,
    task: tokio::task::JoinHandle<()>,
}

impl Drop for BudgetWatcher {
    fn drop(&mut self) {
        self.task.abort();
    }
}

impl BudgetWatcher {
    pub fn start(pods: Api<Pod>, budgets: BTreeMap<String, u64>) -> Self {
        let violations: Arc<Mutex<Vec<String>>> = Arc::default();
        let events: Arc<Mutex<u64>> = Arc::default();
        let (v, e) = (violations.clone(), events.clone());
        let task = tokio::spawn(async move {
            // pod name -> (residencies, declared size) for live pods: a
            // gang's pod holds its size on each member's GPU.
            let mut live: BTreeMap<String, (Vec<String>, u64)> = BTreeMap::new();
            let cfg = watcher::Config::default().labels(RESIDENCY_LABEL);
            let mut stream = std::pin::pin!(watcher(pods, cfg).default_backoff());
            while let Ok(Some(event)) = stream.try_next().await {
                let mut touch = |p: &Pod, deleted: bool| {
                    let name = p.metadata.name.clone().unwrap_or_default();
                    match charged(p, deleted) {
                        Some(held) => live.insert(name, held),
                        None => live.remove(&name),
                    };
                };
                match &event {
                    watcher::Event::Apply(p) | watcher::Event::InitApply(p) => touch(p, false),
                    watcher::Event::Delete(p) => touch(p, true),
                    watcher::Event::Init => live.clear(),
                    watcher::Event::InitDone => {}
                }
                *e.lock().unwrap() += 1;
                let mut per: BTreeMap<&str, u64> = BTreeMap::new();
                for (members, size) in live.values() {
                    for res in members {
                        *per.entry(res.as_str()).or_default() += size;
                    }
                }
                for (res, used) in per {
                    if let Some(&budget) = budgets.get(res)
                        && used > budget
                    {
                        v.lock().unwrap().push(format!(
                            "{res}: live pods declare {used} bytes, budget {budget}: {:?}",
                            live.iter()
                                .map(|(n, (m, s))| format!("{n} {m:?} {s}"))
                                .collect::<Vec<_>>()
                        ));
                    }
                }
            }
        });
        BudgetWatcher {
            violations,
            events,
            task,
        }
    }
}

/// The budget watcher for residencies with a warm tier: besides the pods,
/// it watches the residencies, and counts a pod at its model's
/// `sleepingSize` (and its `hostMemory` against `spec.warm.hostBudget`)
/// from the status saying its sleep is confirmed (`Sleeping`/`Asleep`, or
/// `Loading`/`Waking`: still asleep) until it names the pod awake (a
/// sleeping pod that is deleted holds its sleeping size while it
/// terminates); at its full size otherwise, going to sleep included (a
/// gang's pod on each member, as that member's status says). The two
/// watches may deliver out of order, so
/// a breach seen on a pod event is recorded once the residency watch has
/// caught up with that event (its resourceVersion), or 2 s later.
pub struct WarmBudgetWatcher {
    pub violations: Arc<Mutex<Vec<String>>>,
    /// Events seen, and the most pods counted asleep at once.
    pub events: Arc<Mutex<(u64, usize)>>,
    /// The newest residency resourceVersion seen, and the breaches still
    /// waiting for the residency watch to catch up (see [`Self::caught_up`]).
    seen: Arc<Mutex<(u64, usize)>>,
    task: tokio::task::JoinHandle<()>,
}

impl Drop for WarmBudgetWatcher {
    fn drop(&mut self) {
        self.task.abort();
    }
}

/// A residency's VRAM budget, host budget, and the pods it says are
/// asleep with what each keeps (VRAM, host memory).
type WarmBudgets = (u64, u64, BTreeMap<String, (u64, u64)>);

#[derive(Default)]
struct WarmView {
    /// Live pod -> (residencies, declared size): a gang's pod holds its
    /// size on each member's GPU, each member's status saying whether it
    /// counts asleep there.
    pods: BTreeMap<String, (Vec<String>, u64)>,
    /// Residency -> (VRAM budget, host budget, pod -> (sleeping, host)
    /// of the pods it says are asleep).
    residencies: BTreeMap<String, WarmBudgets>,
    /// The newest resourceVersion the residency watch delivered.
    residency_rv: u64,
    /// What the statuses say, for the messages.
    said: BTreeMap<String, String>,
}

impl WarmView {
    fn residency(&mut self, r: &ModelResidency) {
        let name = r.metadata.name.clone().unwrap_or_default();
        self.residency_rv = self.residency_rv.max(rv(&r.metadata));
        let bytes = |q: Option<&str>| q.and_then(|q| parse_bytes(q).ok());
        let budget = bytes(r.spec.budget.as_ref().map(|b| b.0.as_str())).unwrap_or(u64::MAX);
        let host_budget =
            bytes(r.spec.warm.as_ref().map(|w| w.host_budget.0.as_str())).unwrap_or(0);
        // A pod's last known state: asleep once the status says so, until
        // it says the pod is awake. A sleeping pod that is deleted stays
        // asleep while it terminates (the status then names it no more).
        let mut asleep = self
            .residencies
            .remove(&name)
            .map(|r| r.2)
            .unwrap_or_default();
        for m in r.status.iter().flat_map(|s| s.models.iter()) {
            let reason = m.reason.as_deref();
            let sleeping = (m.state == ModelState::Sleeping && reason == Some("Asleep"))
                || (m.state == ModelState::Loading && reason == Some("Waking"));
            let spec = r.spec.models.iter().find(|s| *s.name == *m.name);
            if let (Some(pod), false) = (m.pod.as_deref(), sleeping) {
                // Named by a state that is not asleep: awake (or going to
                // sleep, still at its full size).
                asleep.remove(pod);
            }
            let (Some(pod), Some(spec), true) = (m.pod.as_deref(), spec, sleeping) else {
                continue;
            };
            let Some(sleep) = spec.sleep.as_deref() else {
                continue;
            };
            let size = bytes(Some(&spec.size.0)).unwrap_or(0);
            let kept = bytes(Some(&sleep.sleeping_size.0)).unwrap_or(size);
            let host = match sleep.level {
                Some(2) => 0,
                _ => bytes(sleep.host_memory.as_ref().map(|h| h.0.as_str())).unwrap_or(size),
            };
            asleep.insert(pod.to_owned(), (kept, host));
        }
        let said: Vec<String> = r
            .status
            .iter()
            .flat_map(|s| s.models.iter())
            .filter(|m| m.is_resident())
            .map(|m| {
                format!(
                    "{} {:?}/{}",
                    m.name,
                    m.state,
                    m.reason.as_deref().unwrap_or("-")
                )
            })
            .collect();
        self.said.insert(name.clone(), said.join(", "));
        self.residencies.insert(name, (budget, host_budget, asleep));
    }

    /// The breaches now, and how many pods count asleep.
    fn breaches(&self) -> (Vec<String>, usize) {
        let mut vram: BTreeMap<&str, u64> = BTreeMap::new();
        let mut host: BTreeMap<&str, u64> = BTreeMap::new();
        let mut sleeping = 0;
        for (pod, (members, size)) in &self.pods {
            for res in members {
                let asleep = self.residencies.get(res).and_then(|r| r.2.get(pod));
                let (v, h) = match asleep {
                    Some(&(kept, h)) => {
                        sleeping += 1;
                        (kept, h)
                    }
                    None => (*size, 0),
                };
                *vram.entry(res).or_default() += v;
                *host.entry(res).or_default() += h;
            }
        }
        let mut out = Vec::new();
        for (res, (budget, host_budget, _)) in &self.residencies {
            let (v, h) = (vram.get(res.as_str()), host.get(res.as_str()));
            if let Some(&v) = v.filter(|&&v| v > *budget) {
                let pods: Vec<String> = self
                    .pods
                    .iter()
                    .filter(|(_, (members, _))| members.contains(res))
                    .map(|(p, (_, size))| {
                        let asleep = self.residencies[res].2.contains_key(p);
                        format!(
                            "{p} {}Mi{}",
                            size >> 20,
                            if asleep { " asleep" } else { "" }
                        )
                    })
                    .collect();
                out.push(format!(
                    "{res}: pods hold {v} bytes of VRAM, budget {budget} ({pods:?}; residency rv {}: {})",
                    self.residency_rv,
                    self.said.get(res).map_or("", String::as_str)
                ));
            }
            if let Some(&h) = h.filter(|&&h| h > *host_budget) {
                out.push(format!(
                    "{res}: sleeping pods hold {h} bytes of host memory, budget {host_budget}"
                ));
            }
        }
        (out, sleeping)
    }
}

fn rv(meta: &k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta) -> u64 {
    meta.resource_version
        .as_deref()
        .and_then(|v| v.parse().ok())
        .unwrap_or(0)
}

impl WarmBudgetWatcher {
    pub fn start(pods: Api<Pod>, residencies: Api<ModelResidency>) -> Self {
        let violations: Arc<Mutex<Vec<String>>> = Arc::default();
        let events: Arc<Mutex<(u64, usize)>> = Arc::default();
        let seen: Arc<Mutex<(u64, usize)>> = Arc::default();
        let (v, e, s) = (violations.clone(), events.clone(), seen.clone());
        let task = tokio::spawn(async move {
            let cfg = watcher::Config::default().labels(RESIDENCY_LABEL);
            let mut pod_events = std::pin::pin!(watcher(pods, cfg).default_backoff());
            let mut res_events =
                std::pin::pin!(watcher(residencies, watcher::Config::default()).default_backoff());
            let mut view = WarmView::default();
            // A breach seen at a pod event: (its resourceVersion, deadline).
            let mut pending: Vec<(u64, tokio::time::Instant, Vec<String>)> = Vec::new();
            let mut tick = tokio::time::interval(Duration::from_millis(100));
            loop {
                let mut pod_rv = None;
                tokio::select! {
                    event = pod_events.try_next() => {
                        let Ok(Some(event)) = event else { break };
                        match &event {
                            watcher::Event::Apply(p) | watcher::Event::InitApply(p) => {
                                let name = p.metadata.name.clone().unwrap_or_default();
                                let finished = matches!(
                                    p.status.as_ref().and_then(|s| s.phase.as_deref()),
                                    Some("Failed" | "Succeeded")
                                );
                                if finished {
                                    view.pods.remove(&name);
                                } else {
                                    let labels = p.metadata.labels.clone().unwrap_or_default();
                                    let size = p.metadata.annotations.as_ref()
                                        .and_then(|a| a.get(SIZE_ANNOTATION))
                                        .and_then(|s| parse_bytes(s).ok())
                                        .unwrap_or(u64::MAX / 4);
                                    let members = match p.metadata.annotations.as_ref()
                                        .and_then(|a| a.get(GANG_MEMBERS_ANNOTATION)) {
                                        Some(g) => g.split(',').map(str::to_owned).collect(),
                                        None => vec![labels[RESIDENCY_LABEL].clone()],
                                    };
                                    view.pods.insert(name, (members, size));
                                }
                                pod_rv = Some(rv(&p.metadata));
                            }
                            watcher::Event::Delete(p) => {
                                let name = p.metadata.name.as_deref().unwrap_or_default();
                                view.pods.remove(name);
                                // Pod names repeat per model: a pod made
                                // again under this name is a new, awake one.
                                for r in view.residencies.values_mut() {
                                    r.2.remove(name);
                                }
                            }
                            watcher::Event::Init => view.pods.clear(),
                            watcher::Event::InitDone => {}
                        }
                    }
                    event = res_events.try_next() => {
                        let Ok(Some(event)) = event else { break };
                        match &event {
                            watcher::Event::Apply(r) | watcher::Event::InitApply(r) => view.residency(r),
                            watcher::Event::Delete(r) => {
                                view.residencies.remove(r.metadata.name.as_deref().unwrap_or_default());
                            }
                            _ => {}
                        }
                    }
                    _ = tick.tick() => {}
                }
                let (breaches, sleeping) = view.breaches();
                {
                    let mut e = e.lock().unwrap();
                    e.0 += 1;
                    e.1 = e.1.max(sleeping);
                }
                if !breaches.is_empty() {
                    let at = pod_rv.unwrap_or(view.residency_rv);
                    pending.push((
                        at,
                        tokio::time::Instant::now() + Duration::from_secs(2),
                        breaches,
                    ));
                }
                let now = tokio::time::Instant::now();
                let still = view.breaches().0;
                pending.retain(|(at, deadline, seen)| {
                    let due = view.residency_rv >= *at || now >= *deadline;
                    if !due {
                        return true;
                    }
                    if !still.is_empty() {
                        v.lock()
                            .unwrap()
                            .push(format!("{seen:?}, still: {still:?}"));
                    }
                    false
                });
                *s.lock().unwrap() = (view.residency_rv, pending.len());
            }
        });
        WarmBudgetWatcher {
            violations,
            events,
            seen,
            task,
        }
    }

    /// Whether the watcher has seen `r` (its resourceVersion or a newer
    /// one) and judged every breach it held: what a test waits for before
    /// it reads the violations.
    pub fn caught_up(&self, r: &ModelResidency) -> bool {
        let (seen, pending) = *self.seen.lock().unwrap();
        seen >= rv(&r.metadata) && pending == 0
    }
}

/// A recorded RFC 3339 time, comparable.
fn recorded(at: Option<&str>) -> Option<Timestamp> {
    at?.parse().ok()
}

/// The budget watcher of physical GPUs: every model pod of every namespace
/// charged to the GPU it really uses, whatever its residency calls it (an
/// index or a uuid, env or claim mode, by hand or by a set), mapped through
/// the ResourceSlices to the device's uuid, against the device's memory.
/// A residency is mapped when one of its pods is first seen (claim mode:
/// the uuid its status says its claim was given).
pub struct PhysicalBudgetWatcher {
    pub violations: Arc<Mutex<Vec<String>>>,
    /// Residencies with live pods whose GPU is not known yet (claim mode:
    /// its status names the device after its first pod is made).
    pub unmapped: Arc<Mutex<BTreeSet<String>>>,
    /// Pod events seen, and the most bytes any one GPU held at once.
    pub events: Arc<Mutex<(u64, u64)>>,
    task: tokio::task::JoinHandle<()>,
}

impl Drop for PhysicalBudgetWatcher {
    fn drop(&mut self) {
        self.task.abort();
    }
}

/// The uuid and memory of the GPU residency `ns/name` uses, from its spec
/// and the slices (claim mode: from its status).
async fn physical_gpu(client: &kube::Client, ns: &str, name: &str) -> Option<(String, u64)> {
    use k8s_openapi::api::resource::v1::ResourceSlice;
    use model_residency::api::GpuMode;
    let r = Api::<ModelResidency>::namespaced(client.clone(), ns)
        .get(name)
        .await
        .ok()?;
    let slices = Api::<ResourceSlice>::all(client.clone())
        .list(&Default::default())
        .await
        .ok()?;
    let devices = slices.items.iter().flat_map(|s| {
        let node = s.spec.node_name.clone().unwrap_or_default();
        s.spec
            .devices
            .iter()
            .flatten()
            .map(move |d| (node.clone(), d))
    });
    let attr = |d: &k8s_openapi::api::resource::v1::Device, k: &str| {
        d.attributes.as_ref().and_then(|a| a.get(k)).cloned()
    };
    let (node, device) = match r.spec.gpu.mode {
        GpuMode::Claim => {
            let g = r.status.as_ref()?.gpu.as_deref()?;
            (g.node.clone()?, g.device.clone()?)
        }
        _ => (r.spec.node_name.clone()?, r.spec.device.clone()),
    };
    for (n, d) in devices {
        let uuid = attr(d, "uuid").and_then(|a| a.string)?;
        let index = attr(d, "index").and_then(|a| a.int);
        let names_it =
            d.name == device || uuid == device || index.is_some_and(|i| i.to_string() == device);
        if n == node && names_it {
            let memory = d
                .capacity
                .as_ref()
                .and_then(|c| c.get("memory"))
                .and_then(|c| parse_bytes(&c.value.0).ok())?;
            return Some((uuid, memory));
        }
    }
    None
}

impl PhysicalBudgetWatcher {
    pub fn start(client: kube::Client) -> Self {
        let violations: Arc<Mutex<Vec<String>>> = Arc::default();
        let events: Arc<Mutex<(u64, u64)>> = Arc::default();
        let unmapped: Arc<Mutex<BTreeSet<String>>> = Arc::default();
        let (v, e, u) = (violations.clone(), events.clone(), unmapped.clone());
        let task = tokio::spawn(async move {
            // "ns/pod" -> (its residencies as "ns/name", declared size).
            let mut live: BTreeMap<String, (Vec<String>, u64)> = BTreeMap::new();
            // "ns/residency" -> (uuid, memory).
            let mut gpus: BTreeMap<String, (String, u64)> = BTreeMap::new();
            let pods: Api<Pod> = Api::all(client.clone());
            let cfg = watcher::Config::default().labels(RESIDENCY_LABEL);
            let mut stream = std::pin::pin!(watcher(pods, cfg).default_backoff());
            while let Ok(Some(event)) = stream.try_next().await {
                let mut touch = |p: &Pod, deleted: bool| {
                    // Residencies and pods of every namespace: keyed "ns/name".
                    let ns = p.metadata.namespace.clone().unwrap_or_default();
                    let name = format!("{ns}/{}", p.metadata.name.clone().unwrap_or_default());
                    match charged(p, deleted) {
                        Some((members, size)) => {
                            let members = members.iter().map(|m| format!("{ns}/{m}")).collect();
                            live.insert(name, (members, size));
                        }
                        None => {
                            live.remove(&name);
                        }
                    }
                };
                match &event {
                    watcher::Event::Apply(p) | watcher::Event::InitApply(p) => touch(p, false),
                    watcher::Event::Delete(p) => touch(p, true),
                    watcher::Event::Init => live.clear(),
                    watcher::Event::InitDone => {}
                }
                for (members, _) in live.values() {
                    for m in members {
                        if !gpus.contains_key(m)
                            && let Some((ns, name)) = m.split_once('/')
                            && let Some(gpu) = physical_gpu(&client, ns, name).await
                        {
                            gpus.insert(m.clone(), gpu);
                        }
                    }
                }
                let mut per: BTreeMap<&str, (u64, u64)> = BTreeMap::new();
                for (members, size) in live.values() {
                    for m in members {
                        let Some((uuid, memory)) = gpus.get(m) else {
                            u.lock().unwrap().insert(m.clone());
                            continue;
                        };
                        u.lock().unwrap().remove(m);
                        let slot = per.entry(uuid.as_str()).or_insert((0, *memory));
                        slot.0 += size;
                    }
                }
                let mut seen = e.lock().unwrap();
                seen.0 += 1;
                for (uuid, (used, memory)) in per {
                    seen.1 = seen.1.max(used);
                    if used > memory {
                        v.lock().unwrap().push(format!(
                            "GPU {uuid}: live pods declare {used} bytes of its {memory}: {:?}",
                            live.iter()
                                .map(|(n, (m, s))| format!("{n} {m:?} {s}"))
                                .collect::<Vec<_>>()
                        ));
                    }
                }
            }
        });
        PhysicalBudgetWatcher {
            violations,
            unmapped,
            events,
            task,
        }
    }
}
