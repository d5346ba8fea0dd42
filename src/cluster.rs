//! What every process does the same way against the API server: an API
//! handle for one namespace or all of them, a status written by
//! server-side apply under its type's own `apiVersion` and `kind`, a
//! watch kept in a store that says when it changed, and how a watch lists.

use futures::StreamExt;
use kube::Resource;
use kube::api::{Api, Patch, PatchParams};
use kube::core::NamespaceResourceScope;
use kube::runtime::{WatchStreamExt, reflector, watcher};
use serde::Serialize;
use serde::de::DeserializeOwned;
use std::fmt::Debug;
use std::sync::Arc;
use tokio::sync::Notify;

/// `K`s in `namespace`, or in all namespaces when `None`.
pub fn api_in<K>(client: &kube::Client, namespace: Option<&str>) -> Api<K>
where
    K: Resource<Scope = NamespaceResourceScope, DynamicType = ()>,
{
    match namespace {
        Some(ns) => Api::namespaced(client.clone(), ns),
        None => Api::all(client.clone()),
    }
}

/// Applies `status` as the status of `name` under the field manager
/// `manager` (forced: the manager owns the status it writes), and returns
/// the object as the API server stored it.
pub async fn apply_status<K>(
    api: &Api<K>,
    name: &str,
    manager: &str,
    status: &impl Serialize,
) -> Result<K, kube::Error>
where
    K: Resource<DynamicType = ()> + Clone + DeserializeOwned + Debug,
{
    let body = serde_json::json!({
        "apiVersion": K::api_version(&()),
        "kind": K::kind(&()),
        "status": status,
    });
    let pp = PatchParams::apply(manager).force();
    api.patch_status(name, &pp, &Patch::Apply(&body)).await
}

/// How a watch retries after an error: 250 ms, doubling to at most 4 s,
/// and back to 250 ms at the first event that arrives.
///
/// kube's `default_backoff` (client-go's: 0.8 s doubling to 30 s) resets
/// only after two minutes without an error, so after an API server
/// restart in a busy minute a watch waited up to 30 s between tries: a new
/// residency stayed unseen 30-35 s after an 11 s outage (a black-box
/// round). One process's watches trying every 4 s are no load on a
/// recovering API server.
#[derive(Debug, Clone)]
pub struct WatchBackoff {
    next: std::time::Duration,
}

impl WatchBackoff {
    const FIRST: std::time::Duration = std::time::Duration::from_millis(250);
    const MOST: std::time::Duration = std::time::Duration::from_secs(4);
}

impl Default for WatchBackoff {
    fn default() -> Self {
        WatchBackoff { next: Self::FIRST }
    }
}

impl Iterator for WatchBackoff {
    type Item = std::time::Duration;

    fn next(&mut self) -> Option<std::time::Duration> {
        let now = self.next;
        self.next = (now * 2).min(Self::MOST);
        Some(now)
    }
}

impl kube::runtime::utils::Backoff for WatchBackoff {
    fn reset(&mut self) {
        self.next = Self::FIRST;
    }
}

/// Keeps `writer`'s store current from a watch of `api` (retried with
/// backoff), notifying `changed` after every event: what the router and
/// the node agent rebuild their view on. `what` names the watch in logs.
pub async fn reflect<K>(
    writer: reflector::store::Writer<K>,
    api: Api<K>,
    config: watcher::Config,
    changed: Arc<Notify>,
    what: &'static str,
) where
    K: Resource + Clone + Debug + DeserializeOwned + Send + Sync + 'static,
    K::DynamicType: Default + Eq + std::hash::Hash + Clone,
{
    reflector::reflector(
        writer,
        watcher(api, config).backoff(WatchBackoff::default()),
    )
    .for_each(move |event| {
        if let Err(e) = event {
            tracing::warn!(error = %e, "{what} failed (retrying)");
        }
        changed.notify_one();
        futures::future::ready(())
    })
    .await
}

/// How the operator's watches get their initial state (and re-list after
/// a watch is lost).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, clap::ValueEnum)]
pub enum InitialList {
    /// A streaming list (watch-list with `sendInitialEvents`): objects one
    /// at a time instead of one whole list in memory. At 10,000
    /// residencies a restart peaked at 67 MiB instead of 82 MiB, ready
    /// 1.1 s later (docs/performance.md). Needs the API server's WatchList
    /// feature (beta, on by default in every supported release).
    #[default]
    Stream,
    /// A plain list, then a watch: for API servers with WatchList off.
    List,
}

impl InitialList {
    pub fn config(self) -> watcher::Config {
        match self {
            InitialList::Stream => watcher::Config::default().streaming_lists(),
            // 100 objects a page, not 500: a page is decoded whole (each
            // object with its managedFields) while the trimmed copies the
            // cache keeps are made, and what a restart over 10,000
            // residencies held above the converged operator was the lists'
            // passing objects (docs/performance.md, the set at 10,000).
            InitialList::List => watcher::Config::default().page_size(100),
        }
    }
}

/// How the ResourceSlice watches list: 16 slices a page, not 500. A
/// slice holds all of a node's devices, and a page is decoded whole
/// before its objects are handed on: with 100 slices of 100 GPUs, each
/// watch's one page of all of them was the start's peak in a heap profile
/// (docs/performance.md, the set at 10,000 GPUs).
pub fn slice_watch_config() -> watcher::Config {
    watcher::Config::default().page_size(16)
}

#[cfg(test)]
mod tests {
    use super::WatchBackoff;
    use kube::runtime::utils::Backoff;
    use std::time::Duration;

    #[test]
    fn a_watch_retries_within_four_seconds_and_starts_over_after_an_event() {
        let mut b = WatchBackoff::default();
        let waits: Vec<Duration> = b.by_ref().take(7).collect();
        let ms = |n| Duration::from_millis(n);
        assert_eq!(
            waits,
            [
                ms(250),
                ms(500),
                ms(1000),
                ms(2000),
                ms(4000),
                ms(4000),
                ms(4000)
            ]
        );
        b.reset();
        assert_eq!(b.next(), Some(ms(250)));
    }
}
