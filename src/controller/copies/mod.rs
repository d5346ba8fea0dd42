//! Copies of a model across its GPUs, driven by load: once a tick, the
//! routers' in-flight counts per model are read and summed (every replica:
//! a count one replica decided alone would be wrong), each model's
//! [`CopyScaler`] decides, and a step is carried out with demand keys:
//!
//! - **adding** a copy writes the model's demand key on the home that
//!   [`place_copy`] chooses (a wake, room, or idle models only), so the
//!   copy is an ordinary resident there: budget, eviction, warm tier;
//! - **removing** one takes it out of the routers first (the pod's
//!   [`DRAINING_LABEL`]: the routers stop choosing it), waits `drain_grace`
//!   for their watches, then sets the pod's
//!   [`RETIRE_ANNOTATION`](crate::residency::labels::RETIRE_ANNOTATION) to now:
//!   the residency puts the copy to sleep when it can (adding it back is
//!   then a wake), else unloads it (its server finishes what it serves on
//!   SIGTERM), unless it was requested there since. Its demand key stays,
//!   processed, as an evicted model's does. The label and the time go once
//!   the model is no longer loaded there.
//!
//! Its reads (a list of ModelCopies each tick; of router pods when those
//! are asked for; the model pods come from the operator's pod cache) are
//! not counted in
//! `model_residency_api_requests_total`, which counts the reconciler's
//! requests and whose steady-state figure is writes; its writes are.
//!
//! Runs on the leader only (inside [`super::run`]). The built-in signal is
//! off unless routers are named (`--router-metrics` or `--router-selector`)
//! and applies only to models with `spec.models[].copies`; a model a
//! `ModelCopies` names is counted by it instead ([`owned`]); InferencePools
//! are kept with `--inference-pools` ([`pools`]). A round in which a router
//! could not be read removes nothing: the sum would be too low.
//!
//! **Everything here is per namespace.** Model names are not unique across
//! tenants (everyone has a `llama-8b`): a model is a [`ModelKey`], its
//! namespace and name; its homes, its policy, its ModelCopies and its
//! routers' count are that namespace's alone, so one tenant's spec never
//! moves another's models. The routers label their count with the
//! namespace of the model's homes; a name a router serves from several
//! namespaces at once is counted under no namespace and moves no copy.

use crate::api::{ModelResidency, ModelState};
use crate::controller::Context;
use crate::controller::cached;
use crate::engine::copies::{CopyPolicy, CopyScaler, Step};
use crate::residency::catalog::Catalogs;
pub mod adapter_maps;
mod enact;
mod owned;
mod pools;
pub mod routes;

pub use pools::PoolConfig;

use crate::metrics::ModelLabels;
use crate::residency::labels::DRAINING_LABEL;
use crate::residency::placement::place_copy;
use crate::residency::state::recorded_time;
use k8s_openapi::api::core::v1::Pod;
use k8s_openapi::jiff::Timestamp;
use kube::ResourceExt;
use kube::api::{Api, ListParams};
use kube::runtime::reflector::Store;
use std::collections::{BTreeMap, HashMap, HashSet};
use std::net::SocketAddr;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

/// The routers' metric the copies follow.
pub const IN_FLIGHT_METRIC: &str = "model_residency_router_in_flight_requests";

/// A model of one namespace: `(namespace, model)`.
pub type ModelKey = (String, String);

/// The routers' in-flight counts, summed per namespace and model.
pub type InFlight = HashMap<ModelKey, f64>;

/// Where the routers are and how the scaler runs.
#[derive(Clone, Debug)]
pub struct CopiesConfig {
    /// Routers' `/metrics` addresses, read as they are.
    pub routers: Vec<SocketAddr>,
    /// A label selector of router pods (in `router_namespace`, or every
    /// namespace) whose `podIP:router_port` serves `/metrics`.
    pub router_selector: Option<String>,
    pub router_namespace: Option<String>,
    pub router_port: u16,
    /// How often the counts are read and steps decided.
    pub tick: Duration,
    /// How long a copy is out of the routers before it is retired.
    pub drain_grace: Duration,
    /// What a model's `copies` leaves out.
    pub defaults: CopyPolicy,
    /// InferencePools kept per model (`--inference-pools`), if at all.
    pub pools: Option<PoolConfig>,
}

impl CopiesConfig {
    /// Whether any router is named: the built-in signal runs only then
    /// (ModelCopies objects are served either way).
    pub fn reads_routers(&self) -> bool {
        !self.routers.is_empty() || self.router_selector.is_some()
    }
}

impl Default for CopiesConfig {
    fn default() -> Self {
        CopiesConfig {
            routers: Vec::new(),
            router_selector: None,
            router_namespace: None,
            router_port: 8080,
            tick: Duration::from_secs(5),
            drain_grace: Duration::from_secs(2),
            defaults: CopyPolicy::default(),
            pools: None,
        }
    }
}

/// The scaler's state across ticks.
struct Scaler {
    ctx: Arc<Context>,
    /// The operator's namespace (`None`: every namespace).
    namespace: Option<String>,
    store: Store<ModelResidency>,
    config: CopiesConfig,
    started: Instant,
    models: HashMap<ModelKey, CopyScaler>,
    /// `(namespace, residency, model)` copies being removed.
    draining: Arc<Mutex<HashSet<(String, String, String)>>>,
    /// Models whose wanted copy had no home at the last tick.
    unplaced: HashSet<ModelKey>,
    /// The routers unread in the last round, each as its address and
    /// what it said.
    unread: Vec<String>,
    /// Models whose InferencePool name another's pool holds (announced).
    pool_clashes: Mutex<HashSet<ModelKey>>,
    /// The removals under way: aborted with the scaler (a removal of a
    /// scaler whose term ended must not write beside the next one's).
    removals: tokio::task::JoinSet<()>,
}

/// Runs until the task is dropped.
pub async fn run(
    ctx: Arc<Context>,
    namespace: Option<String>,
    store: Store<ModelResidency>,
    config: CopiesConfig,
) {
    let mut scaler = Scaler {
        ctx,
        namespace,
        store,
        config,
        started: Instant::now(),
        models: HashMap::new(),
        draining: Arc::default(),
        unplaced: HashSet::new(),
        pool_clashes: Mutex::default(),
        unread: Vec::new(),
        removals: tokio::task::JoinSet::new(),
    };
    scaler.release_stale_drains().await;
    let mut ticks = tokio::time::interval(scaler.config.tick);
    ticks.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        ticks.tick().await;
        while scaler.removals.try_join_next().is_some() {}
        let (in_flight, complete) = scaler.read_routers().await;
        scaler.round(&in_flight, complete).await;
    }
}

/// Each model's homes (the residencies of its namespace whose registry,
/// with its catalog, lists it), sorted by name, from the cache as they
/// are there: their statuses packed and their catalogs not resolved
/// (whoever reads a model's homes resolves and unpacks them: [`read`];
/// most models have no copies policy, and a copy of every residency each
/// tick is what made memory grow). A residency whose catalog cannot be
/// read is no home of anything.
fn homes_by_model(
    store: &Store<ModelResidency>,
    catalogs: &Catalogs,
) -> BTreeMap<ModelKey, Vec<Arc<ModelResidency>>> {
    let mut residencies = store.state();
    residencies.sort_by_key(|r| (r.namespace(), r.name_any()));
    let mut homes: BTreeMap<ModelKey, Vec<Arc<ModelResidency>>> = BTreeMap::new();
    for r in residencies {
        let Ok(names) = catalogs.with_models(&r, |models| {
            models.iter().map(|m| m.name.clone()).collect::<Vec<_>>()
        }) else {
            continue;
        };
        let ns = r.namespace().unwrap_or_default();
        for name in names {
            homes.entry((ns.clone(), name)).or_default().push(r.clone());
        }
    }
    homes
}

/// A model's homes as [`homes_by_model`] found them, read: each with its
/// catalog resolved and its status unpacked.
fn read(homes: &[Arc<ModelResidency>], catalogs: &Catalogs) -> Vec<Arc<ModelResidency>> {
    homes
        .iter()
        .filter_map(|r| catalogs.resolve(r.clone()).ok())
        .map(cached::unpacked)
        .collect()
}

/// The routers' counts in a `/metrics` exposition, by namespace and
/// model. A sample with an empty namespace (a name the router serves from
/// several namespaces) or none (an older router) is left out: it cannot
/// say whose model it counts.
fn in_flight_by_model(exposition: &str) -> impl Iterator<Item = (ModelKey, f64)> + '_ {
    crate::exposition::by_labels(exposition, IN_FLIGHT_METRIC, ["namespace", "model"])
        .into_iter()
        .filter(|([ns, _], _)| !ns.is_empty())
        .map(|([ns, model], n)| ((ns, model), n))
}

/// Whether `r` holds a serving (or soon serving) copy of `model`: it is
/// requested there and loaded, loading, fetching or queued, or requested
/// and not processed yet.
fn holds_copy(r: &ModelResidency, model: &str) -> bool {
    let Some(at) = recorded_time(r.spec.demand.get(model).map(String::as_str)) else {
        return false;
    };
    match r.model_state(model) {
        ModelState::Loaded | ModelState::Loading | ModelState::Fetching | ModelState::Queued => {
            true
        }
        // A request not processed yet; a retired copy's key stays,
        // processed, and is no copy.
        ModelState::Unloaded => {
            let processed = r
                .model_status(model)
                .and_then(|m| m.last_requested.as_deref());
            recorded_time(processed).is_none_or(|p| at > p)
        }
        _ => false,
    }
}

/// The model's policy: the first home's `copies`, the defaults for what
/// it leaves out; `None` when it sets none (its copies are left alone:
/// copies are opt-in per model, so demand written by hand or by
/// per-residency ModelDemands on several GPUs is never undone).
fn policy_of(
    model: &str,
    homes: &[Arc<ModelResidency>],
    catalogs: &Catalogs,
    defaults: &CopyPolicy,
) -> Option<CopyPolicy> {
    let c = homes.iter().find_map(|r| {
        catalogs
            .with_models(r, |models| {
                models
                    .iter()
                    .find(|m| m.name == model)
                    .map(|m| m.copies.clone())
            })
            .ok()
            .flatten()
    })??;
    let delay = c
        .scale_down_delay
        .as_deref()
        .and_then(crate::quantity::parse_duration)
        .map_or(defaults.scale_down_delay, |d| d.as_secs_f64());
    Some(CopyPolicy {
        min: c.min.unwrap_or(defaults.min),
        max: c.max.unwrap_or(defaults.max),
        target_in_flight: c
            .target_in_flight
            .map_or(defaults.target_in_flight, f64::from),
        window: defaults.window,
        scale_down_delay: delay,
    })
}

/// The residencies that list a model, as owners (not controllers) of an
/// object kept for it (its pool, route, adapter map): it goes with the
/// last of them.
fn as_owners<'a>(
    homes: impl IntoIterator<Item = &'a Arc<ModelResidency>>,
) -> Vec<k8s_openapi::apimachinery::pkg::apis::meta::v1::OwnerReference> {
    use kube::Resource;
    homes
        .into_iter()
        .filter_map(|r| {
            let mut o = r.controller_owner_ref(&())?;
            o.controller = Some(false);
            o.block_owner_deletion = None;
            Some(o)
        })
        .collect()
}

impl Scaler {
    /// Deletes the objects of `existing` (the operator's, of `resource`)
    /// that `wanted` does not name: what no model needs any more.
    async fn delete_unwanted<K>(&self, existing: &[K], wanted: &[K], resource: &'static str)
    where
        K: kube::Resource<Scope = k8s_openapi::NamespaceResourceScope>
            + Clone
            + serde::de::DeserializeOwned
            + std::fmt::Debug,
        K::DynamicType: Default,
    {
        for old in existing {
            let kept = wanted
                .iter()
                .any(|w| w.namespace() == old.namespace() && w.name_any() == old.name_any());
            if kept {
                continue;
            }
            let api: Api<K> = Api::namespaced(
                self.ctx.client.clone(),
                &old.namespace().unwrap_or_default(),
            );
            self.ctx.metrics.api_request("delete", resource);
            if let Err(e) = api.delete(&old.name_any(), &Default::default()).await {
                tracing::warn!(name = %old.name_any(), resource, error = %e, "could not delete");
            }
        }
    }
}

impl Scaler {
    /// Every router's in-flight counts, summed per model; `false` when one
    /// could not be read.
    async fn read_routers(&mut self) -> (InFlight, bool) {
        let mut addrs = self.config.routers.clone();
        let mut unread: Vec<String> = Vec::new();
        if let Some(selector) = &self.config.router_selector {
            match self.router_pods(selector).await {
                Ok(found) => addrs.extend(found),
                Err(e) => unread.push(format!("the router pods' list ({e})")),
            }
        }
        let mut sums: InFlight = HashMap::new();
        for addr in addrs {
            let read = tokio::time::timeout(
                self.config.tick.min(Duration::from_secs(5)),
                crate::http::send_capped(addr, "GET", "/metrics", "", 8 << 20),
            )
            .await;
            match read {
                Ok(Ok(a)) if a.status == 200 => {
                    for (key, n) in in_flight_by_model(&a.body) {
                        *sums.entry(key).or_default() += n;
                    }
                }
                Ok(Ok(a)) => unread.push(format!("{addr} (HTTP {})", a.status)),
                Ok(Err(e)) => unread.push(format!("{addr} ({e})")),
                Err(_) => unread.push(format!("{addr} (no answer in time)")),
            }
        }
        self.say_unread(&unread);
        (sums, unread.is_empty())
    }

    /// Says where an operator looks that routers went unread (no copy is
    /// removed meanwhile): the metric each round, a warning when the set
    /// of unread routers changes, and the routers in each ModelCopies
    /// message that waits on them.
    fn say_unread(&mut self, unread: &[String]) {
        self.ctx
            .metrics
            .copies_routers_unread
            .set(unread.len() as i64);
        // Said when the set of routers changes, not each round a router
        // says something new.
        let addresses = |all: &[String]| -> Vec<String> {
            all.iter()
                .map(|u| u.split(' ').next().unwrap_or_default().to_owned())
                .collect()
        };
        if addresses(unread) != addresses(&self.unread) {
            if unread.is_empty() {
                tracing::info!("copies: every router answers again; copies may be removed");
            } else {
                tracing::warn!(unread = ?unread, "copies: routers could not be read; no copy is removed until they are");
            }
        }
        self.unread = unread.to_vec();
    }

    /// The Ready router pods' `/metrics` addresses.
    async fn router_pods(&self, selector: &str) -> Result<Vec<SocketAddr>, kube::Error> {
        let api: Api<Pod> =
            crate::cluster::api_in(&self.ctx.client, self.config.router_namespace.as_deref());
        let pods = api.list(&ListParams::default().labels(selector)).await?;
        Ok(pods
            .items
            .iter()
            .filter(|p| p.metadata.deletion_timestamp.is_none())
            .filter_map(|p| p.status.as_ref()?.pod_ip.as_deref()?.parse().ok())
            .map(|ip| SocketAddr::new(ip, self.config.router_port))
            .collect())
    }

    /// One tick: every model's step.
    async fn round(&mut self, in_flight: &InFlight, complete: bool) {
        let now = self.started.elapsed().as_secs_f64();
        let all = homes_by_model(&self.store, &self.ctx.catalogs);
        // Models gone from every registry of their namespace are forgotten.
        self.models.retain(|m, _| all.contains_key(m));
        if let Some(pools) = &self.config.pools {
            self.pools_round(&all, pools).await;
            if pools.adapter_maps {
                self.adapter_maps_round(&all).await;
            }
        }
        let owners = owned::holders(owned::list(self).await);
        for (mc, holder) in &owners {
            let key = (mc.namespace().unwrap_or_default(), mc.spec.model.clone());
            let homes = read(all.get(&key).map_or(&[], Vec::as_slice), &self.ctx.catalogs);
            match holder {
                None => {
                    self.owned_round(mc, &key, &homes, in_flight, complete)
                        .await
                }
                Some(holder) => self.write_duplicate(mc, holder).await,
            }
        }
        if !self.config.reads_routers() {
            return;
        }
        for (key, homes) in all {
            let owned = owners.iter().any(|(mc, _)| {
                mc.spec.model == key.1 && mc.namespace().unwrap_or_default() == key.0
            });
            if owned {
                // Its count is the ModelCopies' (HPA's, KEDA's).
                continue;
            }
            let Some(policy) = policy_of(&key.1, &homes, &self.ctx.catalogs, &self.config.defaults)
            else {
                continue;
            };
            // Its homes' registries and statuses are read from here on.
            let homes = read(&homes, &self.ctx.catalogs);
            let model = key.1.as_str();
            let copies = self.copies_of(model, &homes);
            let load = in_flight.get(&key).copied().unwrap_or(0.0);
            let scaler = self.models.entry(key.clone()).or_default();
            scaler.observe(&policy, now, load);
            let step = scaler.decide(&policy, now, copies.len() as u32);
            let labels = ModelLabels {
                namespace: key.0.clone(),
                model: key.1.clone(),
            };
            let metrics = &self.ctx.metrics;
            metrics
                .copies
                .get_or_create(&labels)
                .set(copies.len() as i64);
            let wanted = if copies.is_empty() {
                0
            } else {
                policy.wanted(scaler.mean())
            };
            metrics
                .copies_wanted
                .get_or_create(&labels)
                .set(i64::from(wanted));
            let done = match step {
                Step::Hold => {
                    self.set_unplaced(&key, &homes, None).await;
                    false
                }
                Step::Add(n) => {
                    let (added, why) = self.add(&key, &homes, n, in_flight, &policy).await;
                    self.set_unplaced(&key, &homes, why).await;
                    added
                }
                Step::Remove if complete => self.remove(model, &homes, &copies),
                Step::Remove => false,
            };
            if done {
                self.models
                    .get_mut(&key)
                    .expect("entered above")
                    .changed(now);
            }
        }
    }

    /// The indexes of `homes` holding a copy of `model` that is not being
    /// removed.
    fn copies_of(&self, model: &str, homes: &[Arc<ModelResidency>]) -> Vec<usize> {
        (0..homes.len())
            .filter(|&i| holds_copy(&homes[i], model) && !self.is_draining(&homes[i], model))
            .collect()
    }

    fn is_draining(&self, r: &ModelResidency, model: &str) -> bool {
        let key = (
            r.namespace().unwrap_or_default(),
            r.name_any(),
            model.to_owned(),
        );
        self.draining.lock().expect("draining lock").contains(&key)
    }

    /// Adds up to `n` copies, one home each: whether any was added, and
    /// why a wanted one has no home.
    async fn add(
        &mut self,
        key: &ModelKey,
        homes: &[Arc<ModelResidency>],
        n: u32,
        in_flight: &InFlight,
        policy: &CopyPolicy,
    ) -> (bool, Option<String>) {
        let model = key.1.as_str();
        let held = self.held_by_model_demands(&key.0).await;
        let mut taken: HashSet<usize> = HashSet::new();
        let mut added = 0;
        let mut why = None;
        for _ in 0..n {
            let free: Vec<(usize, &ModelResidency)> = homes
                .iter()
                .enumerate()
                .filter(|(i, r)| !taken.contains(i) && !self.is_draining(r, model))
                .map(|(i, r)| (i, &**r))
                .collect();
            let candidates: Vec<&ModelResidency> = free.iter().map(|(_, r)| *r).collect();
            let idle = |r: &ModelResidency, victim: &str| {
                held.as_ref()
                    .is_some_and(|h| !h.contains(&(r.name_any(), victim.to_owned())))
                    && idle(r, victim, in_flight, policy)
            };
            let i = match place_copy(model, &candidates, idle) {
                Ok(k) => free[k].0,
                Err(e) => {
                    why = Some(e);
                    break;
                }
            };
            taken.insert(i);
            if enact::request(&self.ctx, &homes[i], model).await {
                added += 1;
            }
        }
        (added > 0, why)
    }

    /// The `(residency, model)` keys the ModelDemands of namespace `ns` hold
    /// at 1: their models are asked for, never a copy's victims. Read only
    /// when a copy is to be added; unreadable, every model counts as held
    /// (no victim is better than a wrong one).
    async fn held_by_model_demands(&self, ns: &str) -> Option<HashSet<(String, String)>> {
        let api: Api<crate::api::ModelDemand> = Api::namespaced(self.ctx.client.clone(), ns);
        match api.list(&ListParams::default()).await {
            Ok(list) => Some(
                list.items
                    .into_iter()
                    .filter(|d| d.spec.replicas >= 1)
                    .map(|d| (d.spec.residency, d.spec.model))
                    .collect(),
            ),
            Err(e) => {
                tracing::warn!(namespace = %ns, error = %e, "copies: cannot list ModelDemands; no model is a copy's victim this round");
                None
            }
        }
    }

    /// Says (a metric, and an event on the change) whether a wanted copy
    /// has no home: `why` when it has none.
    async fn set_unplaced(
        &mut self,
        key: &ModelKey,
        homes: &[Arc<ModelResidency>],
        why: Option<String>,
    ) {
        let model = key.1.as_str();
        let labels = ModelLabels {
            namespace: key.0.clone(),
            model: key.1.clone(),
        };
        let now_unplaced = why.is_some();
        self.ctx
            .metrics
            .copies_unplaced
            .get_or_create(&labels)
            .set(i64::from(now_unplaced));
        if !announce(&mut self.unplaced, key, now_unplaced) {
            return;
        }
        let Some(first) = homes.first() else {
            return;
        };
        let note = match why {
            Some(why) => format!("{model} wants another copy and no GPU can take it: {why}"),
            None => format!("{model}'s copies are where its load wants them again"),
        };
        enact::publish(&self.ctx, first, now_unplaced, note).await;
    }

    /// Starts removing one copy: one on a GPU that takes no new models
    /// first (it is going: the copy the evacuation made elsewhere must
    /// stay), else the least recently requested (the routers refresh each
    /// copy's demand time as it serves), ties the last by namespace/name.
    /// Whether one was started.
    fn remove(&mut self, model: &str, homes: &[Arc<ModelResidency>], copies: &[usize]) -> bool {
        let last_request =
            |i: usize| recorded_time(homes[i].spec.demand.get(model).map(String::as_str));
        let staying = |i: usize| !crate::residency::placement::takes_no_new_models(&homes[i]);
        let Some(&i) = copies
            .iter()
            .min_by_key(|&&i| (staying(i), last_request(i), std::cmp::Reverse(i)))
        else {
            return false;
        };
        let r = homes[i].clone();
        let key = (
            r.namespace().unwrap_or_default(),
            r.name_any(),
            model.to_owned(),
        );
        self.draining
            .lock()
            .expect("draining lock")
            .insert(key.clone());
        let (ctx, store, grace, draining) = (
            self.ctx.clone(),
            self.store.clone(),
            self.config.drain_grace,
            self.draining.clone(),
        );
        self.removals.spawn(async move {
            enact::drain_and_retire(&ctx, &store, &key, grace).await;
            draining.lock().expect("draining lock").remove(&key);
        });
        true
    }

    /// Labels left by a removal this process did not finish (a restart, a
    /// new leader) are taken off: the copy is decided again from scratch.
    async fn release_stale_drains(&self) {
        let api: Api<Pod> = crate::cluster::api_in(&self.ctx.client, self.namespace.as_deref());
        let Ok(pods) = api
            .list(&ListParams::default().labels(DRAINING_LABEL))
            .await
        else {
            return;
        };
        for pod in pods.items {
            let ns = pod.namespace().unwrap_or_default();
            enact::release(&self.ctx, &ns, &pod.name_any()).await;
        }
    }
}

/// Records whether `key` has a wanted copy with no home; whether that
/// changed (a change is announced, a steady state is not: an event per
/// tick was 17,280 a day per model).
fn announce(unplaced: &mut HashSet<ModelKey>, key: &ModelKey, now_unplaced: bool) -> bool {
    if now_unplaced {
        unplaced.insert(key.clone())
    } else {
        unplaced.remove(key)
    }
}

/// Whether `victim` on `r` may be evicted for a copy: no request in flight
/// for it in its namespace, not requested on `r` and not Ready there
/// within the scale-down delay (a model that just came up has had no time
/// to be asked for: a copy evicted one 8 s after its load).
fn idle(r: &ModelResidency, victim: &str, in_flight: &InFlight, policy: &CopyPolicy) -> bool {
    let key = (r.namespace().unwrap_or_default(), victim.to_owned());
    if in_flight.get(&key).is_some_and(|&n| n > 0.0) {
        return false;
    }
    let recent = |t: Option<Timestamp>| {
        t.is_some_and(|t| {
            let age = Timestamp::now().duration_since(t);
            age.as_secs_f64() < policy.scale_down_delay
        })
    };
    let requested = recorded_time(r.spec.demand.get(victim).map(String::as_str));
    let ready = recorded_time(r.model_status(victim).and_then(|m| m.loaded_at.as_deref()));
    !recent(requested) && !recent(ready)
}
#[cfg(test)]
mod tests;
