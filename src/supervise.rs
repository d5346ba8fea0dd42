//! Every long-running task of a process has an owner. A background task
//! (the gang coordinator, the copy scaler, the sleep audit) that was spawned
//! and never joined stopped for good when it panicked or returned, while
//! `/healthz` still said ok and the leader kept its Lease. [`supervised`]
//! runs one: when it panics or ends it is started again after a back-off
//! (1 s, doubling to 1 min; back to 1 s once it has run a minute) and
//! counted (`model_residency_task_restarts_total{task}`); after
//! [`FAILING_AFTER`] restarts in a row `/healthz` fails, so Kubernetes
//! restarts the pod and the Lease moves to a standby. Dropping the
//! supervisor's future stops the task with it.

use crate::http::Readiness;
use crate::metrics::{Metrics, TaskLabels};
use std::future::Future;
use std::sync::Arc;
use std::time::Duration;

/// Restarts in a row (none running a minute between them) after which the
/// process reports itself unhealthy.
pub const FAILING_AFTER: u32 = 5;

/// The first back-off, doubled at each restart in a row.
const FIRST_BACKOFF: Duration = Duration::from_secs(1);
/// The longest back-off.
const MAX_BACKOFF: Duration = Duration::from_secs(60);
/// A run this long is a success: the next failure backs off from the start.
const STEADY: Duration = Duration::from_secs(60);

/// Aborts its task when dropped.
struct Owned(tokio::task::JoinHandle<()>);

impl Drop for Owned {
    fn drop(&mut self) {
        self.0.abort();
    }
}

/// Runs the task `start` makes, again after each panic or return, until
/// this future is dropped.
pub async fn supervised<F, Fut>(
    task: &'static str,
    metrics: Arc<Metrics>,
    health: Readiness,
    start: F,
) where
    F: FnMut() -> Fut,
    Fut: Future<Output = ()> + Send + 'static,
{
    supervised_with(task, metrics, health, FIRST_BACKOFF, start).await
}

/// [`supervised`] with its first back-off `first` (tests).
pub async fn supervised_with<F, Fut>(
    task: &'static str,
    metrics: Arc<Metrics>,
    health: Readiness,
    first: Duration,
    mut start: F,
) where
    F: FnMut() -> Fut,
    Fut: Future<Output = ()> + Send + 'static,
{
    let mut in_a_row = 0u32;
    loop {
        let began = tokio::time::Instant::now();
        let mut owned = Owned(tokio::spawn(start()));
        let how = match (&mut owned.0).await {
            Ok(()) => "ended".to_owned(),
            Err(e) if e.is_panic() => "panicked".to_owned(),
            Err(e) => format!("stopped ({e})"),
        };
        if began.elapsed() >= STEADY {
            in_a_row = 0;
        }
        in_a_row += 1;
        metrics
            .task_restarts
            .get_or_create(&TaskLabels { task })
            .inc();
        tracing::error!(
            task,
            restarts_in_a_row = in_a_row,
            "a background task {how}; starting it again"
        );
        if in_a_row >= FAILING_AFTER {
            health.fail(format!(
                "the {task} task {how} {in_a_row} times in a row; this process needs a restart"
            ));
        }
        let backoff = first
            .saturating_mul(1 << (in_a_row - 1).min(16))
            .min(MAX_BACKOFF.max(first));
        tokio::time::sleep(backoff).await;
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::{AtomicU32, Ordering};

    /// A task that panics is started again and counted; one that keeps
    /// failing makes the process unhealthy; dropping the supervisor stops
    /// the task.
    #[tokio::test(start_paused = true)]
    async fn a_task_that_panics_is_restarted_counted_and_at_last_fails_health() {
        let metrics = Arc::new(Metrics::new());
        let health = Readiness::default();
        let starts = Arc::new(AtomicU32::new(0));
        let s = starts.clone();
        let supervisor = tokio::spawn(supervised_with(
            "gangs",
            metrics.clone(),
            health.clone(),
            Duration::from_millis(10),
            move || {
                let n = s.fetch_add(1, Ordering::SeqCst);
                async move {
                    if n < 2 {
                        panic!("a bug in the task");
                    }
                    // The third run works (until the test ends).
                    std::future::pending::<()>().await
                }
            },
        ));
        tokio::time::sleep(Duration::from_secs(1)).await;
        assert_eq!(starts.load(Ordering::SeqCst), 3);
        assert_eq!(
            metrics.sum_where("model_residency_task_restarts_total", r#"task="gangs""#),
            2
        );
        assert_eq!(
            health.failing(),
            None,
            "two restarts are not yet a failing process"
        );
        supervisor.abort();

        // Always ending: unhealthy after FAILING_AFTER restarts in a row.
        let health = Readiness::default();
        let supervisor = tokio::spawn(supervised_with(
            "copies",
            metrics.clone(),
            health.clone(),
            Duration::from_millis(10),
            || async {},
        ));
        tokio::time::sleep(Duration::from_secs(30)).await;
        let why = health.failing().expect("unhealthy");
        assert!(why.contains("copies") && why.contains("ended"), "{why}");
        supervisor.abort();
    }
}
