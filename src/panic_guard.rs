//! A reconcile that panics fails alone. kube-runtime's controller polls its
//! reconciles inside its own stream, so a panic there (a bug some input
//! reaches) ends the controller for every object while the process, its
//! `/healthz` and its lease look alive. Guarded, the panic is that object's
//! failed reconcile: logged, counted and retried like any other error.

use futures::FutureExt;
#[cfg(test)]
use futures::StreamExt;
use std::future::Future;
use std::panic::AssertUnwindSafe;

/// `work`, with a panic turned into the error `panicked` makes of its
/// message.
pub async fn guarded<T, E>(
    work: impl Future<Output = Result<T, E>>,
    panicked: impl FnOnce(String) -> E,
) -> Result<T, E> {
    match AssertUnwindSafe(work).catch_unwind().await {
        Ok(result) => result,
        Err(panic) => {
            let message = panic
                .downcast_ref::<&str>()
                .map(|s| s.to_string())
                .or_else(|| panic.downcast_ref::<String>().cloned())
                .unwrap_or_default();
            Err(panicked(message))
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn a_panic_is_an_error_with_its_message() {
        let r: Result<(), String> = guarded(async { panic!("overflowed") }, |m| m).await;
        assert_eq!(r.unwrap_err(), "overflowed");
        let r: Result<(), String> = guarded(async { panic!("at {}", 7) }, |m| m).await;
        assert_eq!(r.unwrap_err(), "at 7");
        let r: Result<u8, String> = guarded(async { Ok(3) }, |m| m).await;
        assert_eq!(r.unwrap(), 3);
    }

    /// Under kube-runtime's own controller (a watch stream's objects, its
    /// scheduler and its error policy, as the operator runs them), one
    /// object whose reconcile panics fails alone: the others are
    /// reconciled, and it is retried by the error policy (the controller
    /// lived through its panics).
    #[tokio::test]
    async fn one_objects_panicking_reconcile_leaves_the_others_reconciling() {
        use k8s_openapi::api::core::v1::ConfigMap;
        use kube::runtime::controller::{Action, Controller};
        use kube::runtime::{WatchStreamExt, reflector, watcher};
        use std::sync::{Arc, Mutex};
        use std::time::Duration;

        let object = |name: &str| ConfigMap {
            metadata: kube::api::ObjectMeta {
                name: Some(name.into()),
                namespace: Some("ns".into()),
                ..Default::default()
            },
            ..Default::default()
        };
        let (reader, writer) = reflector::store::<ConfigMap>();
        let events = [
            watcher::Event::Init,
            watcher::Event::InitApply(object("a")),
            watcher::Event::InitApply(object("bad")),
            watcher::Event::InitApply(object("c")),
            watcher::Event::InitDone,
        ]
        .map(Ok::<_, watcher::Error>);
        // The watch ends after its list; the controller would stop with
        // it, so it is kept open.
        let events = futures::stream::iter(events).chain(futures::stream::pending());
        let objects = reflector(writer, events).applied_objects();
        let seen: Arc<Mutex<Vec<String>>> = Arc::default();
        let results = Controller::for_stream(objects, reader).run(
            |cm: Arc<ConfigMap>, seen: Arc<Mutex<Vec<String>>>| {
                let name = cm.metadata.name.clone().unwrap_or_default();
                guarded(
                    async move {
                        if name == "bad" {
                            panic!("a bug some input reaches");
                        }
                        seen.lock().unwrap().push(name);
                        Ok(Action::await_change())
                    },
                    crate::controller::Error::Panicked,
                )
            },
            |_, _: &crate::controller::Error, _| Action::requeue(Duration::from_millis(10)),
            seen.clone(),
        );
        let mut results = std::pin::pin!(results);
        let mut panicked = 0;
        let outcome = tokio::time::timeout(Duration::from_secs(10), async {
            while let Some(result) = results.next().await {
                if let Err(kube::runtime::controller::Error::ReconcilerFailed(e, _)) = &result {
                    assert_eq!(
                        e.to_string(),
                        "the reconcile panicked: a bug some input reaches"
                    );
                    panicked += 1;
                }
                if panicked >= 3 && seen.lock().unwrap().len() >= 2 {
                    return;
                }
            }
        })
        .await;
        assert!(
            outcome.is_ok(),
            "the controller stopped: {panicked} panics, reconciled {:?}",
            seen.lock().unwrap()
        );
        let mut reconciled = seen.lock().unwrap().clone();
        reconciled.sort();
        assert_eq!(reconciled, ["a", "c"]);
    }
}
