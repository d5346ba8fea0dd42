//! The sleep audit: a model server asleep while its status says it is
//! awake is found and woken. The operator alone sleeps and wakes model
//! servers, but their control endpoints are the servers' own: a sleep sent
//! to a pod behind the operator's back (a client through an older router,
//! anything on the pod network) left the model `Loaded` in status, its pod
//! Ready, and every request to it unanswered, with nothing to repair it.
//!
//! Every `--sleep-audit-interval` (leader only) each `Loaded` model whose
//! spec says how it sleeps, with a status request (vLLM's `GET
//! /is_sleeping`), is asked whether it sleeps; one that does is woken with
//! its own wake requests and a `FoundAsleep` warning event says so (and
//! `WakeFailed`'s reason when the wake did not work: its residency's next
//! request or reconcile sees a server that does not answer). A residency
//! whose sleeps and wakes are being made is left to them.

use super::Context;
use super::cached;
use super::decide::PodCall;
use super::pods::{ModelPod, pod_name};
use crate::api::{ModelResidency, ModelState};
use crate::residency::warm::{protocol, says_asleep};
use kube::ResourceExt;
use kube::runtime::events::EventType;
use kube::runtime::reflector::{ObjectRef, Store};
use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::Duration;

/// How often Loaded models are asked whether they sleep (the default of
/// `--sleep-audit-interval`).
pub const DEFAULT_INTERVAL: Duration = Duration::from_secs(30);

/// Runs until the task is dropped (with every question it is asking);
/// `every` zero: never.
pub async fn run(ctx: Arc<Context>, store: Store<ModelResidency>, every: Duration) {
    if every.is_zero() {
        // Off: idle, not ended (its supervisor would start it again).
        return std::future::pending().await;
    }
    let mut ticks = tokio::time::interval(every);
    ticks.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    let state = Arc::new(Mutex::new(Backoff::default()));
    let mut asking = tokio::task::JoinSet::new();
    loop {
        tokio::select! {
            _ = ticks.tick() => {
                // One look at the pods for both audits.
                let pods = ready_pods(&ctx);
                audit(&ctx, &store, &pods, &state, &mut asking);
                super::adapter_audit::audit(&ctx, &store, &pods).await;
            }
            Some(_) = asking.join_next() => {}
        }
    }
}

/// The Ready, live model pods by (namespace, pod name).
pub(super) type ReadyPods = HashMap<(String, String), ModelPod>;

fn ready_pods(ctx: &Context) -> ReadyPods {
    let mut pods = HashMap::new();
    ctx.pods.each(|ns, _, pod| {
        if pod.ready_since.is_some() && !pod.deleting {
            pods.insert((ns.to_owned(), pod.name.to_string()), pod.clone());
        }
    });
    pods
}

/// The servers asked at once, at most. Each question (and the wake that
/// may follow it) is a task of its own that the next rounds do not wait
/// for: one server's status request that never answers costs its own
/// timeout, not every other tenant's (asked one after another in one
/// round, two such servers stretched a 5 s round to 150 s). A server still
/// being asked is passed by.
pub const AUDIT_CONCURRENCY: usize = 16;

/// The most rounds a server found asleep again and again is passed by.
const MAX_SKIPPED_ROUNDS: u32 = 32;

/// Servers found asleep round after round (one that always says so, or
/// whose wake does not hold): each is passed by for twice as many rounds
/// each time, up to [`MAX_SKIPPED_ROUNDS`], instead of a wake and a
/// warning every round for ever. Keyed by the pod's uid (a new pod starts
/// afresh); forgotten once a round finds it awake. Also the servers being
/// asked now.
#[derive(Default)]
pub struct Backoff {
    round: u64,
    /// uid -> (times found asleep in a row, the round it is asked again).
    servers: HashMap<String, (u32, u64)>,
    asking: std::collections::HashSet<String>,
}

impl Backoff {
    fn skips(&self, uid: &str) -> bool {
        self.asking.contains(uid)
            || self
                .servers
                .get(uid)
                .is_some_and(|&(_, next)| next > self.round)
    }

    fn found_asleep(&mut self, uid: &str) {
        let round = self.round;
        let entry = self.servers.entry(uid.to_owned()).or_insert((0, 0));
        entry.0 += 1;
        let skip = 2u32
            .saturating_pow(entry.0 - 1)
            .min(MAX_SKIPPED_ROUNDS)
            .saturating_sub(1);
        entry.1 = round + 1 + u64::from(skip);
    }

    fn found_awake(&mut self, uid: &str) {
        self.servers.remove(uid);
    }
}

/// One round over every residency in the cache: each Loaded model that
/// can sleep, not asked now and not backed off, asked in a task of its own
/// (at most [`AUDIT_CONCURRENCY`] at once), and woken if it sleeps.
fn audit(
    ctx: &Arc<Context>,
    store: &Store<ModelResidency>,
    pods: &ReadyPods,
    state: &Arc<Mutex<Backoff>>,
    asking: &mut tokio::task::JoinSet<()>,
) {
    state.lock().expect("audit lock").round += 1;
    for r in store.state() {
        let key = ObjectRef::from_obj(&*r);
        if ctx.asking.busy(&key) {
            continue;
        }
        // Most residencies have no model that sleeps: those are passed by
        // in place, not copied (resolved, unpacked) every round.
        let sleeps = ctx
            .catalogs
            .with_models(&r, |models| models.iter().any(|m| m.sleep.is_some()));
        if sleeps != Ok(true) {
            continue;
        }
        let r = cached::unpacked(r);
        let Ok(r) = ctx.catalogs.resolve(r) else {
            continue;
        };
        let ns = r.namespace().unwrap_or_default();
        for m in &r.spec.models {
            let Some(spec) = m.sleep.as_deref() else {
                continue;
            };
            if r.model_state(&m.name) != ModelState::Loaded {
                continue;
            }
            let Some(pod) = pods.get(&(ns.clone(), pod_name(&r.name_any(), &m.name))) else {
                continue;
            };
            let uid = pod.uid.to_string();
            {
                let mut s = state.lock().expect("audit lock");
                if asking.len() >= AUDIT_CONCURRENCY || s.skips(&uid) {
                    continue;
                }
                s.asking.insert(uid.clone());
            }
            let call = PodCall {
                model: m.name.clone(),
                pod: pod.into(),
                addr: pod.addr,
                wake: true,
                protocol: protocol(spec),
            };
            let (ctx, r, state) = (ctx.clone(), r.clone(), state.clone());
            asking.spawn(async move {
                let found = asleep(&call, ctx.pod_call_timeout_max).await;
                if found {
                    wake(&ctx, &r, call).await;
                }
                let mut s = state.lock().expect("audit lock");
                s.asking.remove(&uid);
                match found {
                    true => s.found_asleep(&uid),
                    false => s.found_awake(&uid),
                }
            });
        }
    }
}

/// Whether the server says it sleeps (no status request, no address, or
/// no clear answer: not known to, so left alone).
async fn asleep(call: &PodCall, limit: Duration) -> bool {
    let (Some(addr), Some((status, field))) = (call.addr, &call.protocol.status) else {
        return false;
    };
    let within = status.timeout.clamp(Duration::from_millis(1), limit);
    let answer = tokio::time::timeout(
        within,
        crate::http::send_capped(
            addr,
            &status.method,
            &status.path,
            &status.body,
            super::pod_calls::ANSWER_LIMIT,
        ),
    )
    .await;
    match answer {
        Ok(Ok(a)) if status.worked(a.status) => says_asleep(&a.body, field) == Some(true),
        _ => false,
    }
}

/// Wakes a server found asleep, and says so.
async fn wake(ctx: &Context, r: &ModelResidency, call: PodCall) {
    let (result, seconds) = super::pod_calls::ask(&call, ctx.pod_call_timeout_max).await;
    let model = &call.model;
    let note = match &result {
        Ok(()) => format!(
            "{model}'s server was asleep while its status said Loaded (its sleep endpoint was called outside the operator): woken in {seconds:.1}s"
        ),
        Err(why) => format!(
            "{model}'s server was asleep while its status said Loaded (its sleep endpoint was called outside the operator), and waking it failed: {why}"
        ),
    };
    tracing::warn!(residency = %r.name_any(), %model, ok = result.is_ok(), "{note}");
    ctx.metrics.found_asleep.inc();
    super::publish_event(ctx, r, EventType::Warning, "FoundAsleep", "Wake", note).await;
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A server that always says it sleeps is asked, and woken, in rounds
    /// 1, 2, 4, 8, 16, ... (then every 32nd), not every round.
    #[test]
    fn a_server_found_asleep_again_and_again_is_asked_ever_more_rarely() {
        let mut b = Backoff::default();
        let mut asked = Vec::new();
        for round in 1..=80u64 {
            b.round = round;
            if !b.skips("uid") {
                asked.push(round);
                b.found_asleep("uid");
            }
        }
        assert_eq!(asked, [1, 2, 4, 8, 16, 32, 64]);
        // Found awake: asked every round again.
        b.found_awake("uid");
        b.round += 1;
        assert!(!b.skips("uid"));
    }
}
