//! A reconcile that panics fails alone. kube-runtime's controller polls its
//! reconciles inside its own stream, so a panic there (a bug some input
//! reaches) ends the controller for every object while the process, its
//! `/healthz` and its lease look alive. Guarded, the panic is that object's
//! failed reconcile: logged, counted and retried like any other error.

use futures::FutureExt;
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
}
